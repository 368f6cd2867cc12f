"""Command-line entry points (click): ``pwmesh`` and one command per daemon."""

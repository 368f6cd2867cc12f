"""``python -m pwmesh`` is the ``pwmesh`` command (works even where scripts are not on PATH)."""

from pwmesh.cli.main import main

main(prog_name="pwmesh")

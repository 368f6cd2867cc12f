"""``@pw.program``: trace a Python function that calls compiled functions into one program."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from pwmesh.client.tracing import NeedsStaging, ProgramCache, TracedProgram, execute, run_staged
from pwmesh.errors import InvalidArgument

DISPATCH_MODES = ("parallel", "sequential")


class Program:
    """A traced, cached dataflow program; calling it dispatches one run asynchronously.

    ``dispatch="parallel"`` (the default) sends every node at once, one message per
    island, so executors prepare all of them before any runs. ``"sequential"`` sends
    each node only after its predecessors have completed (the slow path the paper
    compares against; also what a data-dependent node forces on what follows it).
    """

    def __init__(self, fn: Callable[..., Any], dispatch: str = "parallel") -> None:
        if dispatch not in DISPATCH_MODES:
            raise InvalidArgument(f"dispatch must be one of {DISPATCH_MODES}, got {dispatch!r}")
        self.fn = fn
        self.dispatch = dispatch
        self._cache = ProgramCache(fn)
        self._staged = False  # it calls pw.host: traced anew each call, with its real arguments
        functools.update_wrapper(self, fn)

    def trace(self, *args: Any) -> TracedProgram:
        """The program graph for these arguments (traced once per argument signature)."""
        return self._cache.get(args)

    def __call__(self, *args: Any) -> Any:
        sequential = self.dispatch == "sequential"
        if not self._staged:
            try:
                return execute(self._cache.get(args), args, sequential=sequential)
            except NeedsStaging:
                self._staged = True
        return run_staged(self.fn, args, sequential=sequential)


def program(fn: Callable[..., Any] | None = None, *, dispatch: str = "parallel") -> Any:
    """Decorator: ``fn`` becomes one program, with one node per compiled-function call.

    Use as ``@pw.program`` or ``@pw.program(dispatch="sequential")``.
    """
    if fn is None:
        return lambda f: Program(f, dispatch)
    return Program(fn, dispatch)

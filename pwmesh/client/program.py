"""``@pw.program``: trace a Python function that calls compiled functions into one program."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from pwmesh.client.tracing import ProgramCache, TracedProgram, execute


class Program:
    """A traced, cached dataflow program; calling it dispatches one run asynchronously."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._cache = ProgramCache(fn)
        functools.update_wrapper(self, fn)

    def trace(self, *args: Any) -> TracedProgram:
        """The program graph for these arguments (traced once per argument signature)."""
        return self._cache.get(args)

    def __call__(self, *args: Any) -> Any:
        return execute(self._cache.get(args), args)


def program(fn: Callable[..., Any]) -> Program:
    """Decorator: ``fn`` becomes one program, with one node per compiled-function call."""
    return Program(fn)

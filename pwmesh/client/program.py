"""``@pw.program``: trace a Python function that calls compiled functions into one program;
``pw.host``: a data-dependent host step inside one."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from pwmesh.client.dispatch import execute, host_values, run_staged
from pwmesh.client.tracing import NeedsStaging, ProgramCache, TracedProgram, current_builder, split_static, with_static
from pwmesh.errors import InvalidArgument

DISPATCH_MODES = ("parallel", "sequential")


class Program:
    """A traced, cached dataflow program; calling it dispatches one run asynchronously.

    ``dispatch="parallel"`` (the default) sends every node at once, one message per
    island, so executors prepare all of them before any runs. ``"sequential"`` sends
    each node only after its predecessors have completed (the slow path the paper
    compares against; also what a data-dependent node forces on what follows it).
    Arguments and results are pytrees; ``static_argnums``/``static_argnames`` as in ``jax.jit``.
    """

    __name__: str  # the function's (``functools.update_wrapper``)

    def __init__(self, fn: Callable[..., Any], dispatch: str = "parallel", static_argnums: Iterable[int] = (),
                 static_argnames: Iterable[str] = ()) -> None:
        if dispatch not in DISPATCH_MODES:
            raise InvalidArgument(f"dispatch must be one of {DISPATCH_MODES}, got {dispatch!r}")
        self.fn = fn
        self.dispatch = dispatch
        self.static_argnums = tuple(static_argnums)
        self.static_argnames = tuple(static_argnames)
        self._cache = ProgramCache(self._body)
        self._staged = False  # it calls pw.host: traced anew each call, with its real arguments
        functools.update_wrapper(self, fn)

    def _body(self, args: Sequence[Any], kwargs: dict[str, Any], static: tuple[Any, ...]) -> Any:
        full, kw = with_static(args, kwargs, static)
        return self.fn(*full, **kw)

    def trace(self, *args: Any, **kwargs: Any) -> TracedProgram:
        """The program graph for these arguments (traced once per argument signature)."""
        dyn_args, dyn_kwargs, static = split_static(self.__name__, args, kwargs, self.static_argnums,
                                                    self.static_argnames)
        return self._cache.get(dyn_args, dyn_kwargs, static)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        sequential = self.dispatch == "sequential"
        dyn_args, dyn_kwargs, static = split_static(self.__name__, args, kwargs, self.static_argnums,
                                                    self.static_argnames)
        if not self._staged:
            try:
                traced = self._cache.get(dyn_args, dyn_kwargs, static)
                return execute(traced, jax.tree_util.tree_leaves((dyn_args, dyn_kwargs)), sequential=sequential)
            except NeedsStaging:
                self._staged = True
        return run_staged(lambda *a, **k: self._body(a, k, static), dyn_args, dyn_kwargs, sequential=sequential)


def program(fn: Callable[..., Any] | None = None, *, dispatch: str = "parallel", static_argnums: Iterable[int] = (),
            static_argnames: Iterable[str] = ()) -> Any:
    """Decorator: ``fn`` becomes one program, with one node per compiled-function call.

    Use as ``@pw.program`` or ``@pw.program(dispatch="sequential")``.
    """
    if fn is None:
        return lambda f: Program(f, dispatch, static_argnums, static_argnames)
    return Program(fn, dispatch, static_argnums, static_argnames)


class HostFunction:
    """``pw.host(fn)``: a host-side step on concrete values (numpy in, numpy out), whose
    output shape may depend on the data. Inside ``@pw.program`` what comes before it is
    dispatched as one parallel program; what follows waits for its result (sequential)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "host")

    def __call__(self, *args: Any) -> Any:
        builder = current_builder()
        if builder is not None:
            return builder.host_call(self.fn, args, host_values)
        leaves, tree = jax.tree_util.tree_flatten(list(args))
        return self.fn(*jax.tree_util.tree_unflatten(tree, host_values(leaves)))


def host(fn: Callable[..., Any]) -> HostFunction:
    """Mark ``fn`` as a host-side, data-dependent step (see ``HostFunction``)."""
    return HostFunction(fn)

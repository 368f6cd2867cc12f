"""Ahead of time, as ``jax.stages``: ``pw.jit(f).lower(*args)`` (``Lowered``) and its ``.compile()``
(``Compiled``).

A ``Lowered`` is the function traced and exported for its arguments' types (values, ``pw.Array``s,
``jax.ShapeDtypeStruct``s or ``jax.core.ShapedArray``s); each executor compiles the module when it first
runs it (the cluster's devices are not this process's), so ``compile`` checks nothing more. A ``Compiled``
is called with the dynamic arguments only (its static ones were fixed by ``lower``), of the pytree and
types it was lowered for, else ``TypeError``, as ``jax.stages.Compiled`` is; never under a JAX
transformation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

from pwmesh.client.export import ExportedFunction
from pwmesh.client.tracing import leaf_aval, with_static


class Jitted(Protocol):
    """What a stage needs of the ``pw.jit`` function it was lowered from (``functions.JitFunction``)."""

    __name__: str
    donate_argnums: tuple[int, ...]

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...



@dataclasses.dataclass(frozen=True)
class ArgInfo:
    """One argument leaf, as ``jax.stages.ArgInfo``: its abstract value and whether the call consumes it."""

    aval: Any
    donated: bool

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.aval.shape)

    @property
    def dtype(self) -> Any:
        return self.aval.dtype


class Lowered:
    """``pw.jit(f).lower(*args)``: what ``jax.jit``'s ``Lowered`` is, for a slice."""

    def __init__(self, fn: Jitted, exported: ExportedFunction, static: tuple[Any, ...], in_tree: Any,
                 avals: tuple[jax.ShapeDtypeStruct, ...], donated: list[int]) -> None:
        self._fn = fn
        self._static = static
        self.exported = exported
        self.in_tree = in_tree  # of (dynamic positional arguments, dynamic keyword arguments)
        self._avals = avals
        shaped = [jax.core.ShapedArray(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
        self.in_avals = jax.tree_util.tree_unflatten(in_tree, shaped)
        self.args_info = jax.tree_util.tree_unflatten(
            in_tree, [ArgInfo(a, i in donated) for i, a in enumerate(shaped)])
        self.donate_argnums = fn.donate_argnums
        self.out_info = jax.tree_util.tree_unflatten(exported.out_tree, list(exported.out_avals))

    def as_text(self) -> str:
        """The StableHLO module the executors compile."""
        return jax.export.deserialize(bytearray(self.exported.serialized)).mlir_module()

    def compile(self) -> Compiled:
        """Compiled, as ``jax.jit``'s: each executor compiles it when it first runs it (the cluster's devices
        are not this process's), so this checks nothing more; calling it runs it."""
        return Compiled(self)


class Compiled:
    """``pw.jit(f).lower(*args).compile()``: callable with dynamic arguments of the pytree and types it was
    lowered for."""

    def __init__(self, lowered: Lowered) -> None:
        self._lowered = lowered
        self.in_tree = lowered.in_tree
        self.in_avals = lowered.in_avals
        self.args_info = lowered.args_info
        self.donate_argnums = lowered.donate_argnums
        self.out_info = lowered.out_info

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        lowered = self._lowered
        fn = lowered._fn
        leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        for leaf in leaves:
            if isinstance(leaf, jax.core.Tracer):
                raise TypeError("Cannot apply JAX transformations to a function lowered and compiled for a "
                                f"particular signature. Detected argument of Tracer type {type(leaf)}.")
        if in_tree != lowered.in_tree:
            raise TypeError("Function compiled with input pytree does not match the input pytree it was called "
                            f"with: compiled for {lowered.in_tree}, called with {in_tree}")
        got = [leaf_aval(leaf) for leaf in leaves]
        want = lowered._avals
        if [(a.shape, a.dtype) for a in got] != [(a.shape, a.dtype) for a in want]:
            raise TypeError(f"{fn.__name__}: argument types differ from those it was compiled for: got "
                            f"{[f'{a.dtype}{list(a.shape)}' for a in got]}, compiled for "
                            f"{[f'{a.dtype}{list(a.shape)}' for a in want]}")
        full, kw = with_static(args, kwargs, lowered._static)
        return fn(*full, **kw)

"""Running traced programs: their functions and the program registered once, then one ``RunProgram``
per call, posted without waiting; the outputs come back at once as ``pw.Array`` futures."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from pwmesh.client import prng
from pwmesh.client.array import Array
from pwmesh.client.export import canonical
from pwmesh.client.tracing import NotAValue, ProgramBuilder, Symbol, TracedProgram, trace
from pwmesh.errors import InvalidArgument
from pwmesh.wire.messages import ProgramInput, RunProgram, Sharding

if TYPE_CHECKING:
    from pwmesh.client.tracing import ProgramCache


class DonatedTwiceError(InvalidArgument, RuntimeError):
    """A donated ``pw.Array`` passed twice in one call: a ``RuntimeError``, as JAX raises (and the
    ``InvalidArgument`` pwmesh raised before)."""


def _placed(traced: TracedProgram, index: int) -> tuple[int, Sharding] | None:
    """Where argument ``index``'s value lives, if one slice and layout: (slice id, sharding) of the calls
    that read it (all alike, each with explicit in_shardings), else None (the lowering decides)."""
    value = traced.spec.inputs[index]
    found: list[tuple[int, Sharding]] = []
    for node in traced.spec.nodes:
        for pos, v in enumerate(node.inputs):
            if v == value:
                if node.kind != "call" or not node.in_shardings:
                    return None
                if not found or found[0] != (node.slice_id, node.in_shardings[pos]):
                    found.append((node.slice_id, node.in_shardings[pos]))
    return found[0] if len(found) == 1 else None


def _host_input(traced: TracedProgram, index: int, leaf: Any, puts: list[int]) -> ProgramInput:
    """A host argument: sent with the run, or, if it is big, put straight onto its executors first
    (``client/direct.py``: never through the proxy); its buffer id goes in ``puts``, released after the run."""
    arr = canonical(leaf)
    session = traced.session
    if not 0 <= session.direct_min_bytes <= arr.nbytes:
        return ProgramInput(array=arr)
    placed = _placed(traced, index)
    if placed is None:
        return ProgramInput(array=arr)
    buffer_id = session.new_buffer_id()
    session.put(buffer_id, placed[0], arr, placed[1])
    puts.append(buffer_id)
    return ProgramInput(buffer=buffer_id)


def _inputs(traced: TracedProgram, leaves: Sequence[Any], puts: list[int]) -> list[ProgramInput]:
    session = traced.session
    inputs = []
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, Array):
            leaf._check_alive()
            if leaf.session is not session:
                raise InvalidArgument("a pw.Array can only be used with the client that made it")
            inputs.append(ProgramInput(buffer=leaf.buffer_id))
        else:
            inputs.append(_host_input(traced, index, leaf, puts))
    if traced.donated:
        passed = collections.Counter(id(leaf) for leaf in leaves)  # once, not a scan per donated leaf
        for i in traced.donated:
            leaf = leaves[i]
            if isinstance(leaf, Array) and passed[id(leaf)] > 1:
                raise DonatedTwiceError(f"pw.Array {leaf.buffer_id} is donated to {traced.donated_to[i]} and "
                                        "passed again in the same call: a donated buffer is consumed by the one call "
                                        "it is given to")
    inputs.extend(ProgramInput(array=c) for c in traced.constants)
    for array in traced.captured:
        array._check_alive()
        if array.session is not session:
            raise InvalidArgument("a pw.Array can only be used with the client that made it")
        inputs.append(ProgramInput(buffer=array.buffer_id))
    return inputs


def execute(traced: TracedProgram, leaves: Sequence[Any], *, sequential: bool = False) -> Any:
    """Dispatch a traced program without waiting for it; returns its outputs as ``pw.Array`` futures."""
    session = traced.session
    puts: list[int] = []  # big host arguments put first (direct): released once the run has them
    inputs = _inputs(traced, leaves, puts)
    for exported, slice_id in traced.functions:
        exported.register(session.register_function, slice_id)
    ids = [session.new_buffer_id() for _ in traced.spec.outputs]
    if traced.program_id:  # registered once; each run names it (the proxy caches its lowering)
        session.register_program(traced.program_id, traced.spec)
        run = RunProgram(program_id=traced.program_id, inputs=inputs, outputs=ids, sequential=sequential)
    else:  # traced for this run only (a staged program)
        run = RunProgram(program=traced.spec, inputs=inputs, outputs=ids, sequential=sequential)
    session.post(run)
    for buffer_id in puts:  # behind the run on the same connection: it holds them until it has read them
        session.release(buffer_id)
    for i in traced.donated:
        if isinstance(leaves[i], Array):
            leaves[i].donated_to(traced.donated_to[i])
    outs = []
    weak = traced.out_weak or [False] * len(ids)
    for i, (buffer_id, v, sharding, weak_type) in enumerate(zip(ids, traced.spec.outputs, traced.out_shardings, weak,
                                                                strict=True)):
        spec = traced.spec.values[v]
        key = traced.out_keys.get(i)
        if key is None:
            outs.append(Array(session, buffer_id, tuple(spec.shape), np.dtype(spec.dtype), sharding, weak_type))
        else:  # a typed key array (its data on the wire), or a sub-byte one (its container): ``client/prng.py``
            outs.append(Array(session, buffer_id, prng.logical_shape(spec.shape, key), key, sharding, weak_type))
    return jax.tree_util.tree_unflatten(traced.out_tree, outs)


def call_eagerly(fn: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """A compiled function called outside any program: its one-node program, traced once per signature."""
    dyn_args, dyn_kwargs, static = fn.split(args, kwargs)
    cache: ProgramCache = fn.eager
    try:
        traced = cache.get(dyn_args, dyn_kwargs, static)
    except NotAValue as exc:  # named by its place in the arguments, as jax.jit names it
        leaves = jax.tree_util.tree_leaves((dyn_args, dyn_kwargs))
        index = next(i for i, leaf in enumerate(leaves) if leaf is exc.leaf)
        raise fn.not_a_value(exc.leaf, exc.leaf, index, (dyn_args, dyn_kwargs)) from None
    return execute(traced, jax.tree_util.tree_leaves((dyn_args, dyn_kwargs)))


def fetch_all(leaves: Sequence[Any]) -> None:
    """Fetch every ``pw.Array`` among ``leaves`` not fetched yet, in parallel (small ones in one request)."""
    arrays = [leaf for leaf in leaves if isinstance(leaf, Array) and leaf._value is None]
    by_session: dict[int, list[Array]] = {}
    for arr in arrays:
        arr._check_alive()
        by_session.setdefault(id(arr.session), []).append(arr)
    for group in by_session.values():
        fetched = group[0].session.fetch([a.buffer_id for a in group], layouts=[a.layout() for a in group])
        for arr, blocks in zip(group, fetched, strict=True):
            arr._value = arr.assemble(blocks)


def host_values(leaves: list[Any]) -> list[Any]:
    """``leaves`` with every ``pw.Array`` fetched (in parallel) into a host array."""
    fetch_all(leaves)
    return [leaf.value() if isinstance(leaf, Array) else leaf for leaf in leaves]


def run_staged(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], *, sequential: bool) -> Any:
    """Run a program that contains host functions: trace with its real arguments at hand."""
    leaves = jax.tree_util.tree_leaves((tuple(args), kwargs))
    builder = ProgramBuilder(concrete=[leaf if isinstance(leaf, Array) else np.asarray(leaf) for leaf in leaves],
                             run=execute)
    builder.sequential = sequential
    builder, result = trace(fn, args, kwargs, builder)
    if builder.flushed is None:  # this time no host function ran: one ordinary program
        builder._flush()
    assert builder.flushed is not None
    return jax.tree_util.tree_map(builder.concrete_of, result, is_leaf=lambda x: isinstance(x, (Symbol, Array)))

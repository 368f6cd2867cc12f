"""``pw.jit`` and ``pw.pmap``: JAX functions compiled for a slice, called like JAX's.

``pw.jit(fn, devices=slice, in_specs=..., out_specs=..., static_argnums=...,
static_argnames=..., donate_argnums=..., donate_argnames=...)`` is ``jax.jit`` with
``NamedSharding``s over the slice's mesh: ``fn`` sees global arrays and runs as one
SPMD program over the slice (collectives inserted by XLA). Arguments and results are
pytrees; static arguments key the compiled function, as in ``jax.jit``. Where a spec
is left out: an array already on the slice keeps its sharding, one on another slice
keeps its spec if this mesh has those axes, a host value is replicated, and outputs
take the sharding XLA's propagation gives them.

``pw.pmap(fn, devices=slice, axis_name=None)`` maps ``fn`` over the leading axis,
one element per device, as ``jax.pmap`` does.

Called inside ``@pw.program`` either adds one node to the program; called outside,
it runs as a one-node program of its own.
"""

from __future__ import annotations

import functools
import inspect
import math
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, overload

import jax
import numpy as np
from jax._src import core as jax_core  # JAX names the trace under way only privately
from jax.sharding import AbstractMesh

from pwmesh.client import dispatch
from pwmesh.client.argnums import argnums_and_argnames
from pwmesh.client.array import Array
from pwmesh.client.devices import Slice, VirtualDevice, slice_of
from pwmesh.client.export import ExportedFunction, TracedFunction, export_jit, export_pmap, trace_jit
from pwmesh.client.sharding import P, SliceSharding, abstract_mesh, default_spec, is_spec_leaf, resolve
from pwmesh.client.stages import Lowered
from pwmesh.client.tracing import Call, ProgramCache, Symbol, current_builder, leaf_aval, split_static, with_static
from pwmesh.errors import InvalidArgument, SliceSuspended

# Exports by function, shared by every wrapper of it with the same calling convention on a slice of the same
# mesh (``jax.jit(f)(x)`` in a loop makes a new wrapper each time, and finds its compiled function in JAX's
# cache): function -> (mesh, axes, platforms, convention) -> (exports, closed-over arrays) by call signature.
_SHARED: weakref.WeakKeyDictionary[Callable[..., Any], dict[tuple[Any, ...], _Caches]] = weakref.WeakKeyDictionary()
_shared_lock = threading.Lock()


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct:
    """A leaf's abstract value, a tracer's included (weak types kept)."""
    if isinstance(leaf, jax.core.Tracer):
        aval = jax.typeof(leaf)
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)
    return leaf_aval(leaf)


def _one_call(ref: weakref.ref[_Compiled]) -> Callable[[Sequence[Any], dict[str, Any], tuple[Any, ...]], Any]:
    """The body of the one-node program an eager call runs (the wrapper held weakly: its cache of programs
    keeps no cycle through it, so dropping the wrapper frees it and what its function closes over at once)."""

    def call(args: Sequence[Any], kwargs: dict[str, Any], static: tuple[Any, ...]) -> Any:
        compiled = ref()
        assert compiled is not None, "traced through a live wrapper"
        full, kw = with_static(args, kwargs, static)
        return compiled(*full, **kw)

    return call


class _Caches:
    """What every wrapper of one function with one calling convention on one mesh shares."""

    __slots__ = ("exports", "captured", "traces")

    def __init__(self) -> None:
        self.exports: dict[tuple[Any, ...], ExportedFunction] = {}
        self.captured: dict[tuple[Any, ...], list[Array]] = {}  # by export key: the pw.Arrays it closes over
        self.traces: dict[tuple[Any, ...], TracedFunction] = {}  # by (mesh, static, in_tree, avals)


class _Compiled:
    """What ``pw.jit`` and ``pw.pmap`` share: the slice, the exports cache, the eager path."""

    def __init__(self, fn: Callable[..., Any], devices: Slice | Sequence[VirtualDevice]) -> None:
        if not callable(fn):
            raise TypeError(f"Expected a callable value, got {fn}")
        if inspect.isgeneratorfunction(fn):
            raise TypeError(f"Expected a function, got a generator function: {fn}")
        functools.update_wrapper(self, fn)  # its name, module, docstring, annotations, attributes: jax.jit's too
        self.__name__ = getattr(fn, "__name__", "fn")
        self.fn = fn
        self.slice = slice_of(devices)
        self._lock = threading.Lock()
        self._caches = _Caches()
        self.eager = ProgramCache(_one_call(weakref.ref(self)))
        self._convention: tuple[Any, ...] | None = None
        self._reshapes = self.slice.reshapes  # its slice's mesh it was made for (``_follow_slice``)
        self.static_argnums: tuple[int, ...] = ()
        self.static_argnames: tuple[str, ...] = ()

    @property
    def _exports(self) -> dict[tuple[Any, ...], ExportedFunction]:
        return self._caches.exports

    @property
    def num_devices(self) -> int:
        return len(self.slice.devices)

    def _share(self, convention: tuple[Any, ...]) -> None:
        """Use the exports of every other wrapper of this function with this calling convention, on a slice
        of this mesh (none shared where the function or the convention cannot key a dictionary)."""
        self._convention = convention
        key = (self.slice.mesh_shape, self.slice.axis_names, tuple(self.slice.platforms), convention)
        try:
            hash(key)
            with _shared_lock:
                self._caches = _SHARED.setdefault(self.fn, {}).setdefault(key, _Caches())
        except TypeError:
            pass

    def _follow_slice(self) -> None:
        """Its slice was reshaped (``Slice.reshape``): trace and export for the new mesh. A suspended one runs
        nothing (``Slice.suspend``)."""
        if self.slice.suspended:
            raise SliceSuspended(f"{self.__name__}: slice {self.slice.slice_id} is suspended; resume it "
                                 "(slice.resume()) and call again")
        if self._reshapes != self.slice.reshapes:
            with self._lock:
                self._reshapes = self.slice.reshapes
                self._caches = _Caches()
                self.eager = ProgramCache(_one_call(weakref.ref(self)))
            if self._convention is not None:
                self._share(self._convention)

    def split(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any],
                                                                          tuple[Any, ...]]:
        return split_static(self.__name__, args, kwargs, self.static_argnums, self.static_argnames)

    def not_a_value(self, leaf: Any, aval: Any, index: int, tree: Any) -> TypeError:
        """JAX's error for an argument that is no array (a string, a type, a ``ShapeDtypeStruct`` in a call)."""
        path, _ = jax.tree_util.tree_flatten_with_path(tree)[0][index]
        where, rest = path[:2], path[2:]
        if where[0].idx == 0:  # type: ignore[attr-defined]  # a positional argument: its parameter's name
            names = [p for p in inspect.signature(self.fn).parameters] if callable(self.fn) else []
            k = where[1].idx  # type: ignore[attr-defined]
            name = names[k] if k < len(names) else f"args[{k}]"
        else:
            name = str(where[1].key)  # type: ignore[attr-defined]
        at = name + jax.tree_util.keystr(rest)
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return TypeError(f"Argument '{at}' of shape {aval.dtype}[{','.join(map(str, aval.shape))}] of type "
                             f"{type(leaf)} is not a valid JAX type.")
        return TypeError(f"Error interpreting argument to {self.fn} as an abstract array. The problematic value is "
                         f"of type {type(leaf)} and was passed to the function at path {at}.")

    def _exported(self, key: tuple[Any, ...], make: Callable[[], ExportedFunction]) -> ExportedFunction:
        with self._lock:
            found = self._caches.exports.get(key)
        if found is None:
            found = make()
            with self._lock:
                found = self._caches.exports.setdefault(key, found)
        return found

    def _trace(self, static: tuple[Any, ...], in_tree: Any, avals: Sequence[jax.ShapeDtypeStruct],
               mesh: AbstractMesh) -> TracedFunction:
        """The function traced for this signature under ``mesh``: once, then found by every later call, export and
        inlined call of it (as ``jax.jit`` traces once per signature)."""
        key = (mesh, static, in_tree, tuple((a.shape, str(a.dtype), a.weak_type) for a in avals))
        with self._lock:
            found = self._caches.traces.get(key)
        if found is not None:
            return found
        with jax.sharding.use_abstract_mesh(mesh):
            traced = trace_jit(self._flat(static, in_tree), avals)
        if traced.reusable:
            with self._lock:
                traced = self._caches.traces.setdefault(key, traced)
        return traced

    def _flat(self, static: tuple[Any, ...], in_tree: Any) -> Callable[..., Any]:
        """The function of its dynamic arguments' leaves (a pw.Array it returns as it is: an output it computes)."""
        fn = self.fn

        def flat_fn(*flat: Any) -> Any:
            a, k = jax.tree_util.tree_unflatten(in_tree, list(flat))
            full, kw = with_static(a, k, static)
            out = fn(*full, **kw)
            return jax.tree_util.tree_map(lambda x: x.__jax_array__() if isinstance(x, Array) else x, out)

        return flat_fn

    def bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
        raise NotImplementedError

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        """As a method, bound to its instance (as ``jax.jit``'s function is)."""
        return self if instance is None else types.MethodType(self, instance)

    def _traced(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """Called while another function is being traced (``pw.jit``'s, ``jax.jit``'s): what it becomes there."""
        raise InvalidArgument(f"{self!r} was called while another function is being traced; call it outside, or "
                              "use jax.vmap inside")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # As jax.jit under jax.disable_jit(): the Python function, called as it is.
        if jax.config.jax_disable_jit:  # type: ignore[attr-defined]
            return self.fn(*args, **kwargs)
        # Inside a JAX trace (a tracer among its arguments, or none: jax.eval_shape of a function calling it with
        # ShapeDtypeStructs or constants), it is part of that trace, as a nested jax.jit is.
        if (not jax_core.trace_ctx.is_top_level()
                or any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves((args, kwargs)))):
            return self._traced(args, kwargs)
        self._follow_slice()
        builder = current_builder()
        if builder is None:
            return dispatch.call_eagerly(self, args, kwargs)
        if builder.flushed is not None:  # past a host function in a staged program: run it as it comes
            return dispatch.call_eagerly(self, *builder.concrete_tree((args, kwargs)))
        return builder.call(self.bind(args, kwargs))


class JitFunction(_Compiled):
    """What ``pw.jit`` returns: callable eagerly, or inside a ``@pw.program``."""

    def __init__(self, fn: Callable[..., Any], devices: Slice | Sequence[VirtualDevice], *, in_specs: Any = None,
                 out_specs: Any = None, static_argnums: int | Iterable[int] | None = None,
                 static_argnames: str | Iterable[str] | None = None, donate_argnums: int | Iterable[int] | None = None,
                 donate_argnames: str | Iterable[str] | None = None) -> None:
        super().__init__(fn, devices)
        self.in_specs = in_specs
        self.out_specs = out_specs
        (self.static_argnums, self.static_argnames, self.donate_argnums,
         self.donate_argnames) = _jit_argnums(fn, static_argnums, static_argnames, donate_argnums, donate_argnames)
        self._share(("jit", in_specs, out_specs, self.static_argnums, self.static_argnames, self.donate_argnums,
                     self.donate_argnames))

    def _traced(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """Inlined, as ``jax.jit`` inside a traced function is: part of the one program being traced (its
        slice and specs are the outer function's business; donation, as in JAX, does not apply). Traced once
        per signature, as a call of it outside any trace is (the two share their traces)."""
        dyn_args, dyn_kwargs, static = self.split(args, kwargs)
        leaves, in_tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        leaves = [leaf.__jax_array__() if isinstance(leaf, Array) else leaf for leaf in leaves]
        traced = self._trace(static, in_tree, [_abstract(leaf) for leaf in leaves], jax.sharding.get_abstract_mesh())
        closed = [a.__jax_array__() for a in traced.captured]  # the outer trace's own inputs for them
        return jax.tree_util.tree_unflatten(traced.out_tree, jax.jit(traced.flat)(*leaves, *closed))

    def _wanted(self, dyn_args: tuple[Any, ...], dyn_kwargs: dict[str, Any]) -> list[Any]:
        """The spec asked for each leaf (``None``: the default): ``in_specs`` covers the positional
        arguments (static ones left out, as ``jax.jit``'s ``in_shardings``); keyword ones take the default
        (``jax.jit`` refuses them when ``in_shardings`` are given)."""
        n_kw = len(jax.tree_util.tree_leaves(dyn_kwargs))
        if self.in_specs is None:
            return [None] * (len(jax.tree_util.tree_leaves(dyn_args)) + n_kw)
        if is_spec_leaf(self.in_specs):
            return [self.in_specs] * (len(jax.tree_util.tree_leaves(dyn_args)) + n_kw)
        specs = tuple(self.in_specs) if isinstance(self.in_specs, list) else self.in_specs
        if not isinstance(specs, tuple) or len(specs) != len(dyn_args):
            raise InvalidArgument(f"{self.__name__}: in_specs has {len(specs) if isinstance(specs, tuple) else 1} "
                                  f"entries for {len(dyn_args)} positional arguments (static ones left out); give "
                                  "one per argument, or one PartitionSpec for all")
        return resolve(specs, dyn_args, f"{self.__name__}: in_specs") + [None] * n_kw

    def _donated_leaves(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[int]:
        """The flat (dynamic) leaves of the donated arguments."""
        out: list[int] = []
        at = 0
        nums = set(self.static_argnums)
        for i, arg in enumerate(args):
            if i in nums:
                continue
            count = len(jax.tree_util.tree_leaves(arg))
            if i in self.donate_argnums:
                out.extend(range(at, at + count))
            at += count
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        for name, value in sorted(dyn_kwargs.items()):  # dicts flatten in key order
            count = len(jax.tree_util.tree_leaves(value))
            if name in self.donate_argnames:
                out.extend(range(at, at + count))
            at += count
        return out

    def bind(self, args: Sequence[Any], kwargs: dict[str, Any], ahead_of_time: bool = False) -> Call:
        dyn_args, dyn_kwargs, static = self.split(args, kwargs)
        leaves, in_tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        wanted = self._wanted(dyn_args, dyn_kwargs)
        shardings = []
        avals = []
        for i, (leaf, spec) in enumerate(zip(leaves, wanted, strict=True)):
            aval = leaf_aval(leaf)
            if (not ahead_of_time and isinstance(leaf, jax.ShapeDtypeStruct)) or not _an_array_dtype(aval.dtype):
                raise self.not_a_value(leaf, aval, i, (dyn_args, dyn_kwargs))
            now = leaf.sharding if isinstance(leaf, (Array, Symbol)) else None
            sharding = SliceSharding(self.slice, spec if spec is not None else default_spec(now, self.slice))
            sharding.check(aval.shape, f"{self.__name__}: argument leaf {i}")
            shardings.append(sharding)
            avals.append(aval)
        donate = self._donated_leaves(args, kwargs)
        key = (static, in_tree, tuple((a.shape, str(a.dtype), a.weak_type) for a in avals),
               tuple(tuple(map(tuple, s.wire.spec)) for s in shardings), tuple(donate))
        def export() -> ExportedFunction:
            traced = self._trace(static, in_tree, avals, abstract_mesh(self.slice))
            closed = list(traced.captured)
            if closed:
                with self._lock:
                    self._caches.captured[key] = closed
            exported = export_jit(traced, self.slice, traced.in_avals,
                                  [*(s.spec for s in shardings), *(self._closed_sharding(a).spec for a in closed)],
                                  self.out_specs, donate, self.__name__)
            _warn_unusable([avals[i] for i in donate], exported.out_avals)
            return exported

        exported = self._exported(key, export)
        with self._lock:
            closed = self._caches.captured.get(key, [])
        return Call(self.__name__, exported, self.slice, [*leaves, *closed],
                    [*shardings, *map(self._closed_sharding, closed)], donate, captured=len(closed))

    def _closed_sharding(self, array: Array) -> SliceSharding:
        """How a pw.Array the function closes over is read: as it lies, on this slice."""
        return SliceSharding(self.slice, default_spec(array.sharding, self.slice))

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """The result's shapes and dtypes (``jax.ShapeDtypeStruct``s), as ``jax.jit(...).eval_shape``: traced
        only (the trace a later call finds), never exported nor run."""
        dyn_args, dyn_kwargs, static = self.split(args, kwargs)
        leaves, in_tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        return self._trace(static, in_tree, [leaf_aval(leaf) for leaf in leaves], abstract_mesh(self.slice)).out_shape

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Ahead of time, as ``jax.jit(...).lower``: the function traced and exported for these arguments (values,
        ``pw.Array``s, ``jax.ShapeDtypeStruct``s or ``jax.core.ShapedArray``s), without running it."""
        dyn_args, dyn_kwargs, static = self.split(args, kwargs)
        in_tree = jax.tree_util.tree_structure((dyn_args, dyn_kwargs))
        call = self.bind(args, kwargs, ahead_of_time=True)
        own = call.leaves[:len(call.leaves) - call.captured]
        return Lowered(self, call.exported, static, in_tree, tuple(map(leaf_aval, own)), call.donate)

    def __repr__(self) -> str:
        return f"pw.jit({self.__name__}, slice={self.slice.slice_id}, mesh={self.slice.mesh})"


class MappedFunction(_Compiled):
    """What ``pw.pmap`` returns: ``fn`` over one leading-axis element per device."""

    def __init__(self, fn: Callable[..., Any], devices: Slice | Sequence[VirtualDevice],
                 axis_name: str | None = None) -> None:
        super().__init__(fn, devices)
        self.axis_name = axis_name
        self._share(("pmap", axis_name))

    def bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
        if kwargs:
            raise InvalidArgument(f"{self.__name__}: pw.pmap maps positional arguments; got keywords {sorted(kwargs)}")
        leaves, in_tree = jax.tree_util.tree_flatten(tuple(args))
        avals = [leaf_aval(leaf) for leaf in leaves]
        key = (in_tree, tuple((a.shape, str(a.dtype)) for a in avals))
        fn = self.fn

        def flat_fn(*flat: Any) -> Any:
            return fn(*jax.tree_util.tree_unflatten(in_tree, list(flat)))

        exported = self._exported(key, lambda: export_pmap(flat_fn, self.slice, avals, self.axis_name, self.__name__))
        blocks = SliceSharding(self.slice, exported.in_specs[0] if exported.in_specs else P())
        return Call(self.__name__, exported, self.slice, leaves, [blocks] * len(leaves), [])

    def __repr__(self) -> str:
        return f"pw.pmap({self.__name__}, slice={self.slice.slice_id}, axis_name={self.axis_name!r})"


def _an_array_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is one a JAX array can have (a string's, an object's or a date's is not)."""
    try:
        return np.dtype(dtype).kind not in "OUSMm"
    except TypeError:  # an extended dtype (a typed key's): JAX's own
        return True


def _warn_unusable(donated: Sequence[jax.ShapeDtypeStruct], outputs: Sequence[jax.ShapeDtypeStruct]) -> None:
    """As ``jax.jit`` warns when it compiles: donated inputs that no output can reuse (none of their dtype and
    number of elements left: a reshape reuses its input, as XLA aliases it)."""
    free = [(math.prod(o.shape), str(o.dtype)) for o in outputs]
    unusable = []
    for a in donated:
        want = (math.prod(a.shape), str(a.dtype))
        if want in free:
            free.remove(want)
        else:
            unusable.append(f"{a.dtype}[{','.join(map(str, a.shape))}]")
    if unusable:
        warnings.warn(f"Some donated buffers were not usable: {', '.join(unusable)}.", UserWarning, stacklevel=4)


def _jit_argnums(fn: Callable[..., Any], static_argnums: Any, static_argnames: Any, donate_argnums: Any,
                 donate_argnames: Any) -> tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
    """A ``pw.jit``'s static and donated arguments, inferred and checked as ``jax.jit``'s are."""
    static, static_names = argnums_and_argnames(fn, static_argnums, static_argnames, "static")
    donate, donate_names = argnums_and_argnames(fn, donate_argnums, donate_argnames, "donate")
    clash = set(static) & set(donate)
    if clash:
        raise InvalidArgument(f"{getattr(fn, '__name__', 'fn')}: argument(s) {sorted(clash)} are both static and "
                              "donated")
    return static, static_names, donate, donate_names


class FollowingJit:
    """``pw.jit(fn)`` without ``devices=``: as ``jax.jit`` follows its committed arguments, it runs on the slice
    its ``pw.Array`` arguments live on (compiled once per slice: a ``JitFunction`` each)."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]) -> None:
        if not callable(fn):  # bad arguments are refused now, as jax.jit's are
            raise TypeError(f"Expected a callable value, got {fn}")
        _jit_argnums(fn, *(options[k] for k in ("static_argnums", "static_argnames", "donate_argnums",
                                                "donate_argnames")))
        functools.update_wrapper(self, fn)
        self.__name__ = getattr(fn, "__name__", "fn")
        self._fn = fn
        self._options = options
        self._on: dict[int, JitFunction] = {}  # by slice (the JitFunction keeps its slice alive)
        self._lock = threading.Lock()

    def on(self, args: Sequence[Any], kwargs: dict[str, Any]) -> JitFunction:
        """The function compiled for the slice ``args`` live on."""
        slices = {id(leaf.sharding.slice): leaf.sharding.slice for leaf in jax.tree_util.tree_leaves((args, kwargs))
                  if isinstance(leaf, Array | Symbol) and leaf.sharding is not None}
        if not slices:
            raise InvalidArgument(f"pw.jit({self.__name__}) without devices= runs where its pw.Array arguments are, "
                                  "and none of its arguments is one: give devices=, or put them first (pw.put)")
        if len(slices) > 1:
            raise InvalidArgument(f"pw.jit({self.__name__}): its arguments are on {len(slices)} slices "
                                  f"({', '.join(str(k) for k in sorted(s.slice_id for s in slices.values()))}); as "
                                  "jax.jit refuses incompatible devices, move them to one (pw.reshard) or give devices=")
        ((key, sl),) = slices.items()
        with self._lock:
            found = self._on.get(key)
            if found is None:
                found = self._on[key] = JitFunction(self._fn, sl, **self._options)
        return found

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.on(args, kwargs)(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        return self.on(args, kwargs).lower(*args, **kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        return self.on(args, kwargs).eval_shape(*args, **kwargs)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        return self if instance is None else types.MethodType(self, instance)


@overload
def jit(fn: Callable[..., Any], /, *, devices: Slice | Sequence[VirtualDevice] | None = None, in_specs: Any = None,
        out_specs: Any = None, static_argnums: int | Iterable[int] | None = None,
        static_argnames: str | Iterable[str] | None = None, donate_argnums: int | Iterable[int] | None = None,
        donate_argnames: str | Iterable[str] | None = None, in_shardings: Any = None,
        out_shardings: Any = None) -> JitFunction: ...


@overload
def jit(fn: None = None, /, *, devices: Slice | Sequence[VirtualDevice] | None = None, in_specs: Any = None,
        out_specs: Any = None, static_argnums: int | Iterable[int] | None = None,
        static_argnames: str | Iterable[str] | None = None, donate_argnums: int | Iterable[int] | None = None,
        donate_argnames: str | Iterable[str] | None = None, in_shardings: Any = None,
        out_shardings: Any = None) -> Callable[[Callable[..., Any]], JitFunction]: ...


def jit(fn: Callable[..., Any] | None = None, /, *, devices: Slice | Sequence[VirtualDevice] | None = None,
        in_specs: Any = None, out_specs: Any = None, static_argnums: int | Iterable[int] | None = None,
        static_argnames: str | Iterable[str] | None = None, donate_argnums: int | Iterable[int] | None = None,
        donate_argnames: str | Iterable[str] | None = None, in_shardings: Any = None, out_shardings: Any = None) -> Any:
    """``fn`` compiled for ``devices`` (a slice) like ``jax.jit`` with ``NamedSharding``s over its mesh; without
    ``fn``, a decorator that compiles the function it is given so (``@pw.jit(devices=s, static_argnames=...)``).
    Without ``devices``, it runs on the slice its ``pw.Array`` arguments live on, as ``jax.jit`` follows its
    committed arguments (``FollowingJit``).

    ``in_specs``: a ``PartitionSpec`` for every argument, or a tuple with one entry per positional
    argument (static ones left out), each a pytree prefix of that argument (``None``: the default).
    ``out_specs``: a spec or a pytree prefix of the result. Defaults: see the module docstring.

    ``in_shardings`` / ``out_shardings``: ``jax.jit``'s names, taken as it takes them: the same prefixes with
    ``pw.NamedSharding``s (or ``PartitionSpec``s) as leaves; the slice they name is ``devices``."""
    devices, in_specs, out_specs = _from_shardings(devices, in_specs, out_specs, in_shardings, out_shardings)
    options = dict(in_specs=in_specs, out_specs=out_specs, static_argnums=static_argnums,
                   static_argnames=static_argnames, donate_argnums=donate_argnums, donate_argnames=donate_argnames)
    if devices is None:
        if fn is None:
            return functools.partial(FollowingJit, options=options)
        return FollowingJit(fn, options)
    if fn is None:
        return functools.partial(JitFunction, devices=devices, **options)
    return JitFunction(fn, devices, **options)


def _from_shardings(devices: Any, in_specs: Any, out_specs: Any, in_shardings: Any,
                    out_shardings: Any) -> tuple[Any, Any, Any]:
    """``jax.jit``'s ``in_shardings``/``out_shardings`` as ``devices``, ``in_specs`` and ``out_specs``."""
    slices: dict[int, Slice] = {}

    def spec_of(leaf: Any) -> Any:
        if isinstance(leaf, SliceSharding):
            slices.setdefault(id(leaf.slice), leaf.slice)
            return leaf.spec
        if leaf is None or isinstance(leaf, P):
            return leaf
        raise InvalidArgument(f"pw.jit: a sharding is a pw.NamedSharding (or a PartitionSpec over the slice's "
                              f"mesh), got {type(leaf).__name__} {leaf!r}")

    def specs(given: Any, also: Any, name: str) -> Any:
        if given is None:
            return also
        if also is not None:
            raise InvalidArgument(f"pw.jit: give {name}_shardings or {name}_specs, not both")
        return jax.tree_util.tree_map(spec_of, given, is_leaf=lambda x: x is None or isinstance(x, (P, SliceSharding)))

    in_specs = specs(in_shardings, in_specs, "in")
    out_specs = specs(out_shardings, out_specs, "out")
    if len(slices) > 1:
        raise InvalidArgument(f"pw.jit: its shardings name {len(slices)} slices; as jax.jit refuses shardings over "
                              "different devices, give shardings of one slice")
    if slices:
        (named,) = slices.values()
        if devices is None:
            return named, in_specs, out_specs
        if slice_of(devices) is not named:
            raise InvalidArgument(f"pw.jit: its shardings are on slice {named.slice_id}, devices= is another")
    return devices, in_specs, out_specs


def pmap(fn: Callable[..., Any], *, devices: Slice | Sequence[VirtualDevice],
         axis_name: str | None = None) -> MappedFunction:
    """Map ``fn`` over the leading axis of its arguments, one element per device of ``devices``."""
    return MappedFunction(fn, devices, axis_name)

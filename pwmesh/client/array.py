"""``pw.Array``: a future for a logical, sharded buffer living in the executors' stores.

Shape, dtype and sharding are known the moment the array exists (they are static);
the value is fetched only when asked (``np.asarray``, ``pw.get``) and then cached.
Dropping the last Python reference releases the buffer on the cluster; donating it
to a function (``donate_argnums``) hands it over: it can no longer be used.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from pwmesh.client import prng, subbyte
from pwmesh.client.session import Session, wire_spec
from pwmesh.client.sharding import SliceSharding
from pwmesh.dataflow.layout import Layout
from pwmesh.errors import InvalidArgument
from pwmesh.wire.messages import ValueSpec

REPR_TIMEOUT_SECONDS = 2.0  # how long a repr waits for the proxy to say whether the value is ready


class DeletedArrayError(RuntimeError, ValueError):
    """A deleted ``pw.Array`` was used: a ``RuntimeError``, as JAX raises for a deleted ``jax.Array`` (and a
    ``ValueError``, as pwmesh raised before, for code that catches that)."""


# ``pwmesh.client.array_ops``, which runs ``pw.jit``: it sits above this module (jit makes pw.Arrays), so it
# registers itself here when imported (``pwmesh.client.api`` imports it: no array exists without a client).
_operations: list[Any] = []


def use_operations(ops: Any) -> None:
    """Run ``pw.Array``'s operators, indexing and ``astype`` with ``ops`` (``pwmesh.client.array_ops``)."""
    _operations[:] = [ops]


_capture: list[Callable[[Any], Any]] = []


def use_capture(as_jax: Callable[[Any], Any]) -> None:
    """Give JAX ``as_jax(array)`` where it meets a ``pw.Array`` (``pwmesh.client.capture``)."""
    _capture[:] = [as_jax]


def _ops() -> Any:
    if not _operations:
        raise InvalidArgument("pw.Array's operators come with the client library: import pwmesh.client.api")
    return _operations[0]


def _binary(op: Callable[[Any, Any], Any], reflected: bool = False) -> Callable[[Array, Any], Any]:
    def method(self: Array, other: Any) -> Any:
        return _ops().binary(op, self, other, reflected)

    method.__name__ = f"__{'r' if reflected else ''}{op.__name__.strip('_')}__"
    return method


def _unary(op: Callable[[Any], Any]) -> Callable[[Array], Any]:
    def method(self: Array) -> Any:
        return _ops().unary(op, self)

    return method


def _method(name: str) -> Callable[..., Any]:
    def method(self: Array, *args: Any, **kwargs: Any) -> Any:
        return _ops().method(name, self, args, kwargs)

    method.__name__ = name
    method.__doc__ = f"As ``jax.Array.{name}``: a computation on its slice (a new ``pw.Array``)."
    return method


def _computed(name: str) -> property:
    return property(lambda self: _ops().method(name, self, None, {}),
                    doc=f"As ``jax.Array.{name}``: a computation on its slice.")


def _scalar(convert: Callable[[Any], Any]) -> Callable[[Array], Any]:
    def method(self: Array) -> Any:
        return convert(self.value())

    return method


class Array:
    __slots__ = ("__weakref__", "_session", "_id", "_value", "_deleted", "_donated", "shape", "dtype", "sharding",
                 "weak_type")

    # As jax.Array: NumPy defers to its operators (NumPy array + pw.Array is a pw.Array); unhashable, so never a
    # static argument nor a dictionary key.
    __array_priority__ = 100
    __hash__ = None  # type: ignore[assignment]
    # As an uncommitted jax.Array: pw.jit lays it out as in_specs say (it is resharded on its way in), and
    # jax.ShapeDtypeStruct.like gives its shape, dtype and weak type, no sharding (its sharding is a slice's,
    # not a JAX Sharding).
    _committed = False

    # Operators run the jax.numpy operation on its slice (``pwmesh.client.array_ops``); conversions fetch.
    __add__, __radd__ = _binary(operator.add), _binary(operator.add, True)
    __sub__, __rsub__ = _binary(operator.sub), _binary(operator.sub, True)
    __mul__, __rmul__ = _binary(operator.mul), _binary(operator.mul, True)
    __truediv__, __rtruediv__ = _binary(operator.truediv), _binary(operator.truediv, True)
    __floordiv__, __rfloordiv__ = _binary(operator.floordiv), _binary(operator.floordiv, True)
    __mod__, __rmod__ = _binary(operator.mod), _binary(operator.mod, True)
    __pow__, __rpow__ = _binary(operator.pow), _binary(operator.pow, True)
    __matmul__, __rmatmul__ = _binary(operator.matmul), _binary(operator.matmul, True)
    __and__, __rand__ = _binary(operator.and_), _binary(operator.and_, True)
    __or__, __ror__ = _binary(operator.or_), _binary(operator.or_, True)
    __xor__, __rxor__ = _binary(operator.xor), _binary(operator.xor, True)
    __lshift__, __rlshift__ = _binary(operator.lshift), _binary(operator.lshift, True)
    __rshift__, __rrshift__ = _binary(operator.rshift), _binary(operator.rshift, True)
    __lt__, __le__, __gt__, __ge__ = (_binary(operator.lt), _binary(operator.le), _binary(operator.gt),
                                      _binary(operator.ge))
    __eq__ = _binary(operator.eq)  # type: ignore[assignment]
    __ne__ = _binary(operator.ne)  # type: ignore[assignment]
    __neg__, __pos__, __abs__, __invert__ = (_unary(operator.neg), _unary(operator.pos), _unary(operator.abs),
                                             _unary(operator.invert))
    __bool__, __int__, __float__, __complex__, __index__ = (_scalar(bool), _scalar(int), _scalar(float),
                                                            _scalar(complex), _scalar(operator.index))
    # jax.Array's methods that compute: each runs as jax.Array's does, on the array's slice.
    (all, any, argmax, argmin, argsort, clip, conj, cumprod, cumsum, diagonal, dot, flatten, max, mean, min, prod,
     ravel, repeat, reshape, round, sort, squeeze, std, sum, swapaxes, take, transpose, var) = map(_method, (
        "all", "any", "argmax", "argmin", "argsort", "clip", "conj", "cumprod", "cumsum", "diagonal", "dot",
        "flatten", "max", "mean", "min", "prod", "ravel", "repeat", "reshape", "round", "sort", "squeeze", "std",
        "sum", "swapaxes", "take", "transpose", "var"))
    T, mT, real, imag = map(_computed, ("T", "mT", "real", "imag"))

    def __init__(self, session: Session, buffer_id: int, shape: tuple[int, ...], dtype: np.dtype,
                 sharding: SliceSharding, weak_type: bool = False) -> None:
        self._session = session
        self._id = buffer_id
        self._value: np.ndarray | None = None
        self._deleted = False
        self._donated = ""  # what it was donated to
        self.shape = tuple(shape)
        self.dtype = prng.dtype_of(dtype)  # a typed key array's is a key dtype (``client/prng.py``)
        self.sharding = sharding
        # Weakly typed, as a jax.Array made of a Python scalar: a bfloat16 value times it stays bfloat16.
        self.weak_type = weak_type
        session.track(self)

    @property
    def buffer_id(self) -> int:
        return self._id

    @property
    def session(self) -> Session:
        return self._session

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        shape, dtype = prng.physical(self.shape, self.dtype)
        return math.prod(shape) * dtype.itemsize

    @property
    def shards(self) -> int:
        """How many devices hold a shard of it (replicas included)."""
        return len(self.sharding.slice.devices)

    def spec(self) -> ValueSpec:
        """What it is on the wire (as the program that made it, or the put, described it)."""
        return wire_spec(self.shape, self.dtype, self.sharding)

    def _check_alive(self) -> None:
        if self._donated:
            self._take_back()
        if self._deleted:
            raise DeletedArrayError(f"Array has been deleted with shape={self._short_type()}. (pw.Array {self._id})")

    def _short_type(self) -> str:
        """As JAX writes an array's type: ``float32[8,2]``."""
        return f"{self.dtype.name}[{','.join(map(str, self.shape))}]"

    def _take_back(self) -> None:
        """Used after it was donated: the cluster gives it back if the run it went to was aborted before it
        consumed it (a scheduler or host lost meanwhile; that run's outputs fail saying so), as if the call
        had never been made; else this is an error, as using a donated ``jax.Array`` is."""
        try:
            self._session.take_back(self._id)
        except InvalidArgument:
            raise InvalidArgument(f"pw.Array {self._id} {self.dtype}{list(self.shape)} was donated to "
                                  f"{self._donated} and can no longer be used") from None
        self._donated, self._deleted = "", False
        self._session.track(self)

    def donated_to(self, what: str) -> None:
        """It was handed to ``what`` (``donate_argnums``): the cluster frees it; using it again is an error."""
        self._donated = what
        self._deleted = True
        self._value = None
        self._session.gone(self)

    def block_until_ready(self) -> Array:
        """Wait until the value is computed; raises the remote error if computing it failed."""
        if self._value is None:
            self._check_alive()
            self._session.await_buffers([self._id])
        return self

    def is_ready(self) -> bool:
        """Whether the value is computed (or has failed), without waiting."""
        if self._value is not None:
            return True
        self._check_alive()
        return self._session.ready([self._id])[0]

    def value(self) -> Any:
        """The value, fetched once: a NumPy array (a typed key array's: a key ``jax.Array``, as
        ``jax.device_get`` gives)."""
        if self._value is None:
            self._check_alive()
            (blocks,) = self._session.fetch([self._id], layouts=[self.layout()])
            self._value = self.assemble(blocks)
        return self._value

    def layout(self) -> tuple[Layout, np.dtype]:
        """How the value lies over its devices on the wire, and its dtype there (what a fetch assembles)."""
        shape, dtype = prng.physical(self.shape, self.dtype)
        return self.sharding.layout(shape), dtype

    def assemble(self, blocks: list[np.ndarray]) -> Any:
        """The global value from its distinct blocks as the proxy sends them."""
        layout, dtype = self.layout()
        value = layout.assemble(blocks, dtype)
        if prng.is_key(self.dtype):
            return prng.wrap(value, self.dtype)
        return subbyte.released(value, self.dtype)  # a sub-byte value comes in its container

    def __jax_array__(self) -> Any:
        """What JAX meets: an input of the computation while ``pw.jit`` traces a function closing over it
        (``pwmesh.client.capture``), else its value."""
        if not _capture:
            raise InvalidArgument("pw.Array meets JAX through the client library: import pwmesh.client.api")
        return _capture[0](self)

    @property
    def format(self) -> Any:
        """JAX reads it where one of its own functions is given a pw.Array directly, outside any trace
        (``jnp.sin(w)``, ``jax.jit(f)(w)``): refused there, as JAX refuses any ``__jax_array__`` object."""
        raise InvalidArgument("a pw.Array was given to a JAX function directly; as for any __jax_array__ object, "
                              "convert it first: jnp.asarray(w) inside a pw.jit function, np.asarray(w) to fetch "
                              "it, jax.ShapeDtypeStruct.like(w) for its type (jax.eval_shape takes that); or run "
                              "the function with pw.jit")

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if prng.is_key(self.dtype):
            raise prng.not_numpy(self.dtype)
        value = self.value()
        if dtype is not None and np.dtype(dtype) != value.dtype:
            return value.astype(dtype)
        return value.copy() if copy else value

    def delete(self, now: bool = True) -> None:
        """Free the buffer on the cluster now (also happens, batched with others, when the array is
        garbage-collected)."""
        if self._donated:  # kept for us only if its run was aborted first (``_take_back``)
            self._session.drop_donated(self._id)
            self._donated = ""
        elif not self._deleted:
            self._deleted = True
            self._session.gone(self)
            self._session.release(self._id, now)

    @property
    def donated(self) -> bool:
        """Whether it was donated to a call (and not taken back since): gone, unless that call's run is aborted
        before it consumes it."""
        return bool(self._donated)

    def is_deleted(self) -> bool:
        """Whether its buffer is gone: deleted (``delete``) or donated to a call, as ``jax.Array.is_deleted``."""
        return self._deleted or bool(self._donated)

    def __del__(self) -> None:
        try:
            self.delete(now=False)
        except Exception:  # interpreter shutdown or a closed connection: nothing left to free
            pass

    def __getitem__(self, index: Any) -> Any:
        return _ops().getitem(self, index)

    def __iter__(self) -> Any:
        return _ops().rows(self)

    def astype(self, dtype: Any, copy: bool = False) -> Any:
        """A new array of ``dtype`` on the same devices (``copy``: accepted, as ``jax.Array.astype``'s; the
        result is always a new array)."""
        del copy
        return _ops().astype(self, dtype)

    def copy(self) -> Any:
        """A new array of the same value, layout and weak type, on the same slice (``jax.Array.copy``)."""
        return _ops().method("copy", self, (), {})

    def __copy__(self) -> Any:
        return self.copy()

    def __deepcopy__(self, memo: Any) -> Any:
        """As ``jax.Array``'s: a copy (its session and slice are shared, not copied)."""
        del memo
        return self.copy()

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def is_fully_replicated(self) -> bool:
        return self.sharding.is_fully_replicated

    def item(self, *args: Any) -> Any:
        """An element as a Python scalar (fetched), as ``jax.Array.item``."""
        return self.value().item(*args)

    def copy_to_host_async(self) -> None:
        """As ``jax.Array``'s, accepted; the value is fetched when first read (``np.asarray``, ``pw.get``)."""

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d pw.Array")
        return self.shape[0]

    def __repr__(self) -> str:
        if self._donated:
            state = "donated"
        elif self._deleted:  # as jax.Array's repr
            raise DeletedArrayError("Array has been deleted.")
        elif self._value is not None:
            state = "fetched"
        else:
            state = self._state_now()
        return (f"pw.Array(shape={self.shape}, dtype={self.dtype}, slice={self.sharding.slice.slice_id}, "
                f"spec={self.sharding.spec}, {state})")

    def _state_now(self) -> str:
        """For ``repr``, which asks the proxy (briefly) and never raises: ready, not ready, or unknown."""
        try:
            return "ready" if self._session.ready([self._id], timeout_seconds=REPR_TIMEOUT_SECONDS)[0] else "not ready"
        except Exception as exc:  # a closed session, an unreachable proxy: say so rather than guess
            return f"state unknown: {type(exc).__name__}"

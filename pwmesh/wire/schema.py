"""Typed records with one validation home.

A ``Record`` is a slotted dataclass. ``to_wire`` turns it into plain msgpack-able
values; ``from_wire`` checks every field against its annotation and raises
``ProtocolError`` naming the path of the first bad value. Supported annotations:
``int float str bool bytes Any np.ndarray``, ``list[X]``, ``dict[str, X]``,
``X | None`` and nested ``Record`` types.

Both directions are compiled once per class, at first use (annotations name
classes defined later): the type hints become straight-line Python with the
checks inlined, so a message costs no ``typing`` introspection and no path
strings. The compiled decoder only says *whether* a value is valid; when it is
not, the reference implementation (``_slow_from_wire``/``_check``, which builds
the path of every value it visits) runs again on the same data and raises the
error with its path. The two accept exactly the same values.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import threading
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Self

import numpy as np

from pwmesh.errors import ProtocolError

_HINTS: dict[type, dict[str, Any]] = {}
_DECODERS: dict[type, Callable[[Any], Any]] = {}
_PENDING: dict[type, Callable[[Any], Any]] = {}  # being compiled, by this thread (under the lock)
_COMPILE_LOCK = threading.RLock()


class _Invalid(Exception):  # noqa: N818 - internal signal, never leaves this module
    """A compiled decoder found a bad value; the slow path says which and where."""


class Record:
    """Base of every typed structure that crosses the wire."""

    __slots__ = ()
    _field_names: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Each class gets its own to_wire, compiled at its first call (a subclass
        # must not inherit its parent's: it has other fields). A hand-written
        # to_wire, here or inherited, is left alone.
        if "to_wire" not in cls.__dict__ and getattr(cls.to_wire, "_generated", False):
            cls.to_wire = _first_to_wire  # type: ignore[method-assign]

    @classmethod
    def _hints(cls) -> dict[str, Any]:
        hints = _HINTS.get(cls)
        if hints is None:
            all_hints = typing.get_type_hints(cls)
            hints = {f.name: all_hints[f.name] for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
            _HINTS[cls] = hints
        return hints

    def to_wire(self) -> dict[str, Any]:
        return _first_to_wire(self)

    @classmethod
    def from_wire(cls, data: Any, path: str = "") -> Self:
        decoder = _DECODERS.get(cls) or _decoder(cls)
        try:
            return decoder(data)  # type: ignore[no-any-return]
        except _Invalid:
            pass
        # Outside the except block: the ProtocolError does not chain the internal signal.
        return _slow_from_wire(cls, data, path)


Record.to_wire._generated = True  # type: ignore[attr-defined]


# ------------------------------------------------------------- reference implementation


def _slow_from_wire(cls: type[Record], data: Any, path: str) -> Any:
    where = path or cls.__name__
    if not isinstance(data, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(data).__name__}")
    hints = cls._hints()
    unknown = set(data) - set(hints)
    if unknown:
        raise ProtocolError(f"{where}: unknown field(s) {sorted(map(str, unknown))}")
    values = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name in data:
            values[field.name] = _check(hints[field.name], data[field.name], f"{where}.{field.name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{where}: missing field {field.name!r}")
    return cls(**values)


def _to_wire(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_wire()
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


def _check(tp: Any, value: Any, path: str) -> Any:
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(arg, value, path)
            except ProtocolError as exc:
                errors.append(str(exc))
        raise ProtocolError(errors[0] if len(errors) == 1 else f"{path}: matches none of {tp}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ProtocolError(f"{path}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)
        return [_check(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{path}: expected a map, got {type(value).__name__}")
        key_tp, val_tp = typing.get_args(tp)
        return {
            _check(key_tp, k, f"{path}<key>"): _check(val_tp, v, f"{path}[{k!r}]")
            for k, v in value.items()
        }
    if isinstance(tp, type) and issubclass(tp, Record):
        return _slow_from_wire(tp, value, path)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is np.ndarray:
        if isinstance(value, np.ndarray):
            return value
    elif tp in (str, bool, bytes):
        if isinstance(value, tp):
            return value
    else:  # pragma: no cover - a programming error in a message definition
        raise TypeError(f"unsupported annotation {tp!r} at {path}")
    raise ProtocolError(f"{path}: expected {getattr(tp, '__name__', tp)}, got {type(value).__name__}")


# ------------------------------------------------------------- compiled decoders


_CHECKS = {  # annotation -> the condition under which a value is rejected (it is kept as it is)
    str: "not isinstance({v}, str)",
    bool: "not isinstance({v}, bool)",
    bytes: "not isinstance({v}, bytes)",
    np.ndarray: "not isinstance({v}, _ndarray)",
    # bool is an int to Python, not to the wire; the exact-type test first is the common case.
    int: "type({v}) is not int and (not isinstance({v}, int) or isinstance({v}, bool))",
}


class _Compiler:
    """Turns annotations into Python source; names the objects that source uses in ``ns``."""

    def __init__(self) -> None:
        self.ns: dict[str, Any] = {"_Invalid": _Invalid, "_ndarray": np.ndarray}
        self._names = itertools.count()

    def name(self, obj: Any, hint: str = "o") -> str:
        name = f"_{hint}{next(self._names)}"
        self.ns[name] = obj
        return name

    def lines(self, tp: Any, v: str, depth: int = 0) -> list[str]:
        """Statements that raise ``_Invalid`` unless ``v`` fits ``tp``, and rebind ``v`` to its converted value."""
        if tp is Any:
            return []
        if tp in _CHECKS:
            return [f"if {_CHECKS[tp].format(v=v)}: raise _Invalid"]
        if tp is float:
            return [f"if type({v}) is not float:",
                    f"    if isinstance({v}, (int, float)) and not isinstance({v}, bool): {v} = float({v})",
                    "    else: raise _Invalid"]
        origin = typing.get_origin(tp)
        if origin in (types.UnionType, typing.Union):
            arms = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(arms) == 1:
                body = self.lines(arms[0], v, depth) or ["pass"]
                if type(None) not in typing.get_args(tp):  # pragma: no cover - typing collapses one-arm unions
                    return body
                return [f"if {v} is not None:", *("    " + line for line in body)]
            return [f"{v} = {self.name(_union(tp, [_converter(a) for a in arms]), 'union')}({v})"]
        if origin is list:
            (item,) = typing.get_args(tp)
            head = f"if not isinstance({v}, (list, tuple)): raise _Invalid"
            x = f"_x{depth}"
            body = self.lines(item, x, depth + 1)
            if not any(re.search(rf"(?<!\w){x} = ", line) for line in body):  # only checks: copy the list
                loop = [f"for {x} in {v}:", *("    " + line for line in body)] if body else []
                return [head, *loop, f"{v} = list({v})"]
            return [head, f"{v} = [{self.name(_converter(item), 'item')}({x}) for {x} in {v}]"]
        if origin is dict:
            key_tp, val_tp = typing.get_args(tp)
            key, val = self.name(_converter(key_tp), "key"), self.name(_converter(val_tp), "val")
            return [f"if not isinstance({v}, dict): raise _Invalid",
                    f"{v} = {{{key}(_k): {val}(_w) for _k, _w in {v}.items()}}"]
        if isinstance(tp, type) and issubclass(tp, Record):
            return [f"{v} = {self.name(_decoder(tp), 'record')}({v})"]
        # Unsupported: a programming error, which the slow path reports with its path.
        return ["raise _Invalid"]

    def function(self, name: str, args: str, body: list[str]) -> Callable[..., Any]:
        source = "\n".join([f"def {name}({args}):", *("    " + line for line in body)])
        exec(compile(source, f"<pwmesh.wire.schema {name}>", "exec"), self.ns)  # noqa: S102 - our own source
        fn: Callable[..., Any] = self.ns[name]
        fn._source = source  # type: ignore[attr-defined]  # for debugging: what the hints became
        return fn


def _union(tp: Any, arms: list[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    nullable = type(None) in typing.get_args(tp)

    def convert(value: Any) -> Any:
        if value is None and nullable:
            return None
        for arm in arms:
            try:
                return arm(value)
            except _Invalid:
                pass
        raise _Invalid

    return convert


_CONVERTERS: dict[Any, Callable[[Any], Any]] = {}


def _converter(tp: Any) -> Callable[[Any], Any]:
    """A compiled function: the value of annotation ``tp`` converted, or ``_Invalid``."""
    fn = _CONVERTERS.get(tp)
    if fn is None:
        if isinstance(tp, type) and issubclass(tp, Record):
            return _decoder(tp)
        compiler = _Compiler()
        fn = compiler.function("convert", "v", [*compiler.lines(tp, "v"), "return v"])
        _CONVERTERS[tp] = fn
    return fn


def _decoder(cls: type[Record]) -> Callable[[Any], Any]:
    """``cls``'s compiled decoder (compiled now if it is the first use)."""
    decoder = _DECODERS.get(cls)
    if decoder is not None:
        return decoder
    with _COMPILE_LOCK:  # other threads wait for the decoder rather than see a half-made one
        decoder = _DECODERS.get(cls) or _PENDING.get(cls)
        if decoder is not None:
            return decoder
        # A record that (indirectly) holds itself calls its own decoder through this until it exists.
        _PENDING[cls] = lambda data: _decoder(cls)(data)
        try:
            decoder = _compile_decoder(cls)
        finally:
            del _PENDING[cls]
        _DECODERS[cls] = decoder
        return decoder


def _compile_decoder(cls: type[Record]) -> Callable[[Any], Any]:
    hints = cls._hints()
    compiler = _Compiler()
    ns = compiler.ns
    ns["_cls"], ns["_fields"] = cls, frozenset(hints)
    body = ["if not isinstance(data, dict) or not _fields.issuperset(data): raise _Invalid"]
    kwargs = []
    for i, field in enumerate(dataclasses.fields(cls)):  # type: ignore[arg-type]
        v = f"v{i}"
        checks = compiler.lines(hints[field.name], v) or ["pass"]
        body += ["try:", f"    {v} = data[{field.name!r}]", "except KeyError:"]
        if field.default is not dataclasses.MISSING:
            body.append(f"    {v} = {compiler.name(field.default, 'default')}")
        elif field.default_factory is not dataclasses.MISSING:
            body.append(f"    {v} = {compiler.name(field.default_factory, 'factory')}()")
        else:
            body.append("    raise _Invalid from None")
            body += checks
            kwargs.append(f"{field.name}={v}")
            continue
        body += ["else:", *("    " + line for line in checks)]
        kwargs.append(f"{field.name}={v}")
    if _plain_init(cls):
        # What the dataclass __init__ would do, without parsing keyword arguments (half the cost).
        ns["_new"] = object.__new__
        body += ["o = _new(_cls)", *(f"o.{kw.replace('=', ' = ', 1)}" for kw in kwargs), "return o"]
    else:
        body.append(f"return _cls({', '.join(kwargs)})")
    return compiler.function(f"from_wire_{cls.__name__}", "data", body)


def _plain_init(cls: type) -> bool:
    """Whether ``cls.__init__`` only stores its arguments: the one ``dataclass`` wrote, no ``__post_init__``."""
    init = cls.__init__  # type: ignore[misc]
    code = getattr(init, "__code__", None)
    return (code is not None and code.co_filename.startswith("<")  # generated, not written in a file
            and not hasattr(cls, "__post_init__") and "__new__" not in vars(cls)
            and all(f.init for f in dataclasses.fields(cls)))  # type: ignore[arg-type]


# ------------------------------------------------------------- compiled encoders

_PLAIN = (int, float, str, bool, bytes, np.ndarray)


def _holds_records(tp: Any) -> bool:
    if tp is Any:
        return True
    if isinstance(tp, type):
        return issubclass(tp, Record)
    return any(_holds_records(a) for a in typing.get_args(tp))


def _wire_expr(tp: Any, attr: str, v: str) -> str:
    """An expression for the wire form of ``self.<attr>`` (annotated ``tp``), as ``_to_wire`` makes it."""
    get = f"({v} := self.{attr})"
    if tp in _PLAIN:
        return f"self.{attr}"
    if isinstance(tp, type) and issubclass(tp, Record):
        return f"({v}.to_wire() if isinstance({get}, _Record) else _to_wire({v}))"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list and args[0] in _PLAIN:
        return f"(list({v}) if type({get}) is list else _to_wire({v}))"
    if origin is list and isinstance(args[0], type) and issubclass(args[0], Record):
        return (f"([_e.to_wire() if isinstance(_e, _Record) else _to_wire(_e) for _e in {v}]"
                f" if isinstance({get}, (list, tuple)) else _to_wire({v}))")
    if origin in (types.UnionType, typing.Union) and not _holds_records(tp) and all(
            a in _PLAIN or a is type(None) for a in args):
        return f"self.{attr}"
    if origin in (types.UnionType, typing.Union):
        return f"(None if {get} is None else _to_wire({v}))"
    return f"_to_wire(self.{attr})"


def _compile_to_wire(cls: type[Record]) -> Callable[[Record], dict[str, Any]]:
    compiler = _Compiler()
    compiler.ns.update(_Record=Record, _to_wire=_to_wire)
    items = [f"{name!r}: {_wire_expr(tp, name, f'v{i}')}" for i, (name, tp) in enumerate(cls._hints().items())]
    fn = compiler.function(f"to_wire_{cls.__name__}", "self", [f"return {{{', '.join(items)}}}"])
    fn._generated = True  # type: ignore[attr-defined]
    return fn


def _first_to_wire(self: Record) -> dict[str, Any]:
    cls = type(self)
    fn = _compile_to_wire(cls)
    if cls.__dict__.get("to_wire") is _first_to_wire:
        # mypy does not model replacing a method on a class (here, by its compiled version).
        cls.to_wire = fn  # type: ignore[method-assign, assignment]
    return fn(self)


_first_to_wire._generated = True  # type: ignore[attr-defined]


_T = typing.TypeVar("_T")


@typing.dataclass_transform(kw_only_default=True, field_specifiers=(dataclasses.field,))
def record(cls: type[_T]) -> type[_T]:
    """Decorator: make ``cls`` a slotted, keyword-only dataclass ``Record`` (a dataclass to type checkers)."""
    return dataclasses.dataclass(slots=True, kw_only=True)(cls)


def maker(cls: type[_T]) -> Callable[..., _T]:
    """``cls``'s constructor as a plain function of its fields, by keyword: ``maker(cls)(**fields)`` makes what
    ``cls(**fields)`` makes, the same defaults included, at about half the cost. A class call packs its
    keywords into a dict that the dataclass ``__init__`` unpacks again; a function call does neither. For
    records made per decision in a hot loop (the island scheduler's ``Enqueue``); a class whose ``__init__``
    does more than store its fields gets the class itself."""
    if not _plain_init(cls):
        return cls
    compiler = _Compiler()
    ns = compiler.ns
    ns["_cls"], ns["_new"], ns["_missing"] = cls, object.__new__, dataclasses.MISSING
    args, body = [], ["o = _new(_cls)"]
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        name = field.name
        if field.default is not dataclasses.MISSING:
            args.append(f"{name}={compiler.name(field.default, 'default')}")
            body.append(f"o.{name} = {name}")
        elif field.default_factory is not dataclasses.MISSING:
            args.append(f"{name}=_missing")
            body.append(f"o.{name} = {compiler.name(field.default_factory, 'factory')}() "
                        f"if {name} is _missing else {name}")
        else:
            args.append(name)
            body.append(f"o.{name} = {name}")
    body.append("return o")
    return compiler.function(f"make_{cls.__name__}", f"*, {', '.join(args)}" if args else "", body)

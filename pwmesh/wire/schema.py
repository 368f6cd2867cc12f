"""Typed records with one validation home.

A ``Record`` is a slotted dataclass. ``to_wire`` turns it into plain msgpack-able
values; ``from_wire`` checks every field against its annotation and raises
``ProtocolError`` naming the path of the first bad value. Supported annotations:
``int float str bool bytes Any np.ndarray``, ``list[X]``, ``dict[str, X]``,
``X | None`` and nested ``Record`` types.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, ClassVar, Self

import numpy as np

from pwmesh.errors import ProtocolError

_HINTS: dict[type, dict[str, Any]] = {}


class Record:
    """Base of every typed structure that crosses the wire."""

    __slots__ = ()
    _field_names: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)

    @classmethod
    def _hints(cls) -> dict[str, Any]:
        hints = _HINTS.get(cls)
        if hints is None:
            all_hints = typing.get_type_hints(cls)
            hints = {f.name: all_hints[f.name] for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
            _HINTS[cls] = hints
        return hints

    def to_wire(self) -> dict[str, Any]:
        return {name: _to_wire(getattr(self, name)) for name in self._hints()}

    @classmethod
    def from_wire(cls, data: Any, path: str = "") -> Self:
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
        return tp.from_wire(value, path)
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


def record(cls: type) -> type:
    """Decorator: make ``cls`` a slotted, keyword-only dataclass ``Record``."""
    return dataclasses.dataclass(slots=True, kw_only=True)(cls)

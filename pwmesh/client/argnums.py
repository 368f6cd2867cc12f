"""Which arguments of a ``pw.jit`` function are static or donated, inferred and checked as ``jax.jit`` does.

``static_argnums``/``static_argnames`` (and ``donate_argnums``/``donate_argnames``): one left out is
completed from the other through the function's signature; both given, each is taken as it is. Numbers
past the positional parameters (with no ``*args``) and names that are no keyword parameter (with no
``**kwargs``; positional-only and ``*args`` names never) are refused with ``ValueError`` when the
wrapper is made, in ``jax.jit``'s words. The same checks as ``jax/_src/api_util.py``'s
``infer_argnums_and_argnames``, ``validate_argnums`` and ``validate_argnames``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from pwmesh.errors import InvalidArgument


def _argnums(value: int | Iterable[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _argnames(value: str | Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or a callable without a signature
        return None


def argnums_and_argnames(fn: Callable[..., Any], nums_given: int | Iterable[int] | None,
                         names_given: str | Iterable[str] | None,
                         kind: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(numbers, names)`` of the ``kind`` (``static``, ``donate``) arguments of ``fn``."""
    nums, names = _argnums(nums_given), _argnames(names_given)
    sig = _signature(fn)
    if sig is None:
        if kind == "donate" and names_given is not None:
            raise InvalidArgument(f"Getting the signature of function {fn} failed. Pass donate_argnums instead of "
                                  "donate_argnames.")
        return nums, names
    params = list(sig.parameters.items())
    keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD
    if nums_given is None:
        nums = tuple(i for i, (name, p) in enumerate(params) if p.kind == keyword and name in names)
    if names_given is None:
        names = tuple(name for i, (name, p) in enumerate(params) if p.kind == keyword and i in nums)
    _check_nums(sig, nums, f"{kind}_argnums")
    _check_names(sig, names, f"{kind}_argnames")
    return nums, names


def _check_nums(sig: inspect.Signature, nums: tuple[int, ...], what: str) -> None:
    positional = 0
    for p in sig.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            return  # any number of positional arguments
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional += 1
    if nums and (-min(nums) > positional or max(nums) >= positional):
        raise InvalidArgument(f"Jitted function has {what}={nums}, but only accepts {positional} positional "
                              "arguments.")


def _check_names(sig: inspect.Signature, names: tuple[str, ...], what: str) -> None:
    valid, invalid, any_keyword = set(), set(), False
    for name, p in sig.parameters.items():
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            valid.add(name)
        elif p.kind == p.VAR_KEYWORD:
            any_keyword = True
        else:
            invalid.add(name)
    if wrong := invalid & set(names):
        raise InvalidArgument(f"Jitted function has invalid argnames {wrong} in {what}. These are positional-only")
    if not any_keyword and (wrong := set(names) - valid):
        raise InvalidArgument(f"Jitted function has invalid argnames {wrong} in {what}. Function does not take "
                              "these args.")

"""One configuration style for every process: its settings are the fields of a frozen dataclass, each with a
default and a one-line help (:func:`setting`), validated in ``__post_init__`` (:func:`require`); its command-line
flags are generated from those fields (:func:`add_flags`) and the parsed flags make the dataclass (:func:`from_flags`).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any, Literal, TypeVar, overload

T = TypeVar("T")


@dataclass(frozen=True)
class FlagOptions:
    """How a setting's flag differs from the generated one (see :func:`setting`)."""

    type: Callable[[str], Any] | None = None
    flag: str | tuple[str, ...] | None = None
    metavar: str | None = None
    group: str | None = None
    text: str | None = None
    flags: Callable[[argparse._ActionsContainer], None] | None = None


@overload
def setting(
    default: str,
    help: str,
    *,
    type: Callable[[str], T],
    flag: str | tuple[str, ...] | None = None,
    metavar: str | None = None,
    group: str | None = None,
) -> T: ...


@overload
def setting(
    default: T,
    help: str,
    *,
    type: Callable[[str], Any] | None = None,
    flag: str | tuple[str, ...] | None = None,
    metavar: str | None = None,
    group: str | None = None,
    flags: Callable[[argparse._ActionsContainer], None] | None = None,
) -> T: ...


@overload
def setting(
    *,
    help: str,
    factory: Callable[[], T],
    type: Callable[[str], Any] | None = None,
    flag: str | tuple[str, ...] | None = None,
    metavar: str | None = None,
    group: str | None = None,
) -> T: ...


@overload
def setting(
    *,
    help: str,
    type: Callable[[str], Any] | None = None,
    flag: str | tuple[str, ...] | None = None,
    metavar: str | None = None,
    group: str | None = None,
) -> Any: ...


def setting(
    default: Any = MISSING,
    help: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    type: Callable[[str], Any] | None = None,
    flag: str | tuple[str, ...] | None = None,
    metavar: str | None = None,
    group: str | None = None,
    flags: Callable[[argparse._ActionsContainer], None] | None = None,
) -> Any:
    """A config field with its default and its one-line description (``help``: what it does and its unit; the
    CLI appends the default); ``factory``: a default read when the dataclass is made (from the environment, say),
    also by the CLI as it starts; neither: a required flag. Its flag is ``--field-name``, typed from the field's
    hint, unless these say otherwise:

    - ``type``: an argparse type (``flying.cli.port``); a ``str`` default is parsed by it, as argparse parses a
      string default, and ``--help`` shows it as given (``setting("2:5", ..., type=rate_range)``);
    - ``flag``: the option strings (``("-n", "--num-requests")``); a bool's one flag is a switch to the value
      other than its default (``--no-early-dispatch``) instead of the pair ``--x/--no-x``;
    - ``metavar``; ``group``: the title of the ``--help`` section that lists it;
    - ``flags``: a function that adds the setting's flags itself (flags every process shares, the Redis ones):
      none is generated, and :func:`from_flags` leaves its value to the caller."""
    meta = {"help": help, "flag": FlagOptions(type, flag, metavar, group, None, flags)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    if type is not None and isinstance(default, str):
        meta["flag"] = FlagOptions(type, flag, metavar, group, default, flags)
        return field(default_factory=lambda: type(default), metadata=meta)
    return field(default=default, metadata=meta)


def require(ok: bool, message: str) -> None:
    """A setting a user gave is out of range: ValueError naming it (checked under ``python -O`` too)."""
    if not ok:
        raise ValueError(message)


def describe(cls: type) -> dict[str, str]:
    """Field name -> its ``help``, for the fields of config dataclass ``cls`` that carry one."""
    return {f.name: f.metadata["help"] for f in dataclasses.fields(cls) if "help" in f.metadata}


def _settings(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of config dataclass ``cls`` that are settings (made by :func:`setting`), in order."""
    return [f for f in dataclasses.fields(cls) if "flag" in f.metadata]


def add_flags(
    p: argparse._ActionsContainer, cls: type, descriptions: Mapping[str, str] | None = None
) -> None:
    """One flag per setting of ``cls``, in field order (``--max-width 4``, ``--no-load-adaptation``), defaults
    from the class; a setting with a ``group`` is listed under that title (``descriptions``: a group's text)."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in _settings(cls):
        o: FlagOptions = f.metadata["flag"]
        if o.flags is not None:
            o.flags(p)
            continue
        where = p
        if o.group is not None:
            if o.group not in groups:
                groups[o.group] = p.add_argument_group(o.group, (descriptions or {}).get(o.group))
            where = groups[o.group]
        names = (o.flag,) if isinstance(o.flag, str) else o.flag or ("--" + f.name.replace("_", "-"),)
        text = f.metadata["help"].replace("%", "%%")
        where.add_argument(*names, dest=f.name, help=text, **_flag(f, hints[f.name], o))


def _flag(f: dataclasses.Field[Any], hint: Any, o: FlagOptions) -> dict[str, Any]:
    """``add_argument``'s keywords for setting ``f`` of type ``hint``."""
    if f.default is MISSING and f.default_factory is MISSING:
        kind: dict[str, Any] = {"required": True}
    else:
        kind = {"default": o.text if o.text is not None else _default(f)}
    if o.metavar is not None:
        kind["metavar"] = o.metavar
    if hint is bool:
        if o.flag is None:
            return kind | {"action": argparse.BooleanOptionalAction}
        return kind | {"action": "store_false" if kind["default"] else "store_true"}
    hint = _unless_none(hint)
    if _repeated(hint):
        kind["action"] = "append"
        if isinstance(kind.get("default"), tuple):
            kind["default"] = list(kind["default"])
        hint = typing.get_args(hint)[0]
    if o.type is not None:
        return kind | {"type": o.type}
    if typing.get_origin(hint) is Literal:
        return kind | {"choices": typing.get_args(hint)}
    return kind if hint is str else kind | {"type": hint}


def _repeated(hint: Any) -> bool:
    """``tuple[X, ...]`` or ``list[X]``: a flag given once per item (a fixed-size tuple is one value)."""
    args = typing.get_args(hint)
    return typing.get_origin(hint) is list or (typing.get_origin(hint) is tuple and args[-1:] == (...,))


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


def _unless_none(hint: Any) -> Any:
    """``X | None`` -> ``X``: an optional setting's flag takes an X (unset: its default, None)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint


def from_flags(cls: type[T], a: argparse.Namespace, **others: Any) -> T:
    """``cls`` made from the flags :func:`add_flags` added and ``a`` holds, and ``others`` (fields whose flags
    are not generated, or values the caller resolves); ValueError when a setting is out of range."""
    hints = typing.get_type_hints(cls)
    values = {
        f.name: _value(getattr(a, f.name), hints[f.name])
        for f in _settings(cls)
        if f.metadata["flag"].flags is None and f.name not in others
    }
    return cls(**values, **others)


def _value(value: Any, hint: Any) -> Any:
    """A repeated flag's list as the setting's tuple."""
    if isinstance(value, list) and typing.get_origin(_unless_none(hint)) is tuple:
        return tuple(value)
    return value

"""Command-line conventions shared by the processes' parsers: every option's help ends with its default."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from flying import redis_conn, settings


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: ...)`` to every option's help, except a required option's and one whose default is None
    and whose help says what that default means (it contains ``default``). A switch that turns a setting off
    (``--disable-radix-cache``) is not given by default: ``(default: False)``, as a switch that turns one on."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.required or (action.default is None and "default" in text):
            return text
        if isinstance(action, argparse._StoreFalseAction):
            return f"{text} (default: False)"
        return super()._get_help_string(action)


def port(text: str) -> int:
    """An ``argparse`` type: a TCP port, 0-65535 (0: any free one, where the option allows it)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {value}")
    return value


def non_negative(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """An ``argparse`` type: an int or float of at least 0."""
    return _number(kind, lambda v: v >= 0, "at least 0")


def positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """An ``argparse`` type: an int or float above 0."""
    return _number(kind, lambda v: v > 0, "at least 1" if kind is int else "above 0")


def share(text: str) -> float:
    """An ``argparse`` type: a share, a float from 0 to 1."""
    return float(_number(float, lambda v: 0 <= v <= 1, "from 0 to 1")(text))


def at_least(kind: type[int] | type[float], low: float) -> Callable[[str], int | float]:
    """An ``argparse`` type: an int or float of at least ``low``."""
    return _number(kind, lambda v: v >= low, f"at least {low:g}")


def _number(
    kind: type[int] | type[float], accept: Callable[[int | float], bool], rule: str
) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
        return value

    return parse


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)


def add_redis_arguments(p: argparse._ActionsContainer) -> None:
    """``--redis-url``, ``--redis-sentinel``, ``--redis-master-name`` and ``--key-prefix``, as every process takes
    them (defaults from the environment); :func:`redis_url` makes the one URL they name."""
    p.add_argument(
        "--redis-url",
        default=settings.redis_url(),
        help=f"Redis: redis://host:port/db, or redis+sentinel://host:port,host:port/master/db (env {settings.REDIS_URL})",
    )
    p.add_argument(
        "--redis-sentinel",
        default=settings.redis_sentinel() or None,
        metavar="HOST:PORT,...",
        help="Redis Sentinels to ask for the primary (the database and password from --redis-url; default: none, "
        f"--redis-url is the server) (env {settings.REDIS_SENTINEL})",
    )
    p.add_argument(
        "--redis-master-name",
        default=settings.redis_master_name(),
        help=f"the primary's name in the Sentinels' configuration (env {settings.REDIS_MASTER_NAME})",
    )
    p.add_argument(
        "--key-prefix",
        default=settings.key_prefix(),
        help=f"prefix of every Redis key (env {settings.KEY_PREFIX}; default: %(default)s)",
    )


def redis_url(a: argparse.Namespace) -> str:
    """The Redis URL the parsed options name (a ``redis+sentinel://`` one with ``--redis-sentinel``); exits with
    a usage error when they cannot be used."""
    try:
        url = redis_conn.with_sentinel(a.redis_url, a.redis_sentinel, a.redis_master_name)
        redis_conn.parse(url)
    except redis_conn.RedisUrlError as exc:
        print(f"{os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return url


def help_line(p: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text ``--help`` prints for ``action`` (with its default), unexpanded."""
    formatter = p.formatter_class(prog=p.prog)
    assert isinstance(formatter, argparse.HelpFormatter)
    return formatter._get_help_string(action) or ""  # noqa: SLF001 - the formatter's own rule, as --help applies it

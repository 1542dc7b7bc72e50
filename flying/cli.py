"""Command-line conventions shared by the processes' parsers: every option's help ends with its default."""

from __future__ import annotations

import argparse

from flying import settings


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: ...)`` to every option's help, except a required option's and one whose default is None
    and whose help says what that default means (it contains ``default``)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.required or (action.default is None and "default" in text):
            return text
        return super()._get_help_string(action)


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)


def add_redis_arguments(p: argparse.ArgumentParser) -> None:
    """``--redis-url`` and ``--key-prefix``, as every process takes them (defaults from the environment)."""
    p.add_argument("--redis-url", default=settings.redis_url(), help=f"Redis (env {settings.REDIS_URL})")
    p.add_argument(
        "--key-prefix",
        default=settings.key_prefix(),
        help=f"prefix of every Redis key (env {settings.KEY_PREFIX})",
    )


def help_line(p: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text ``--help`` prints for ``action`` (with its default), unexpanded."""
    formatter = p.formatter_class(prog=p.prog)
    assert isinstance(formatter, argparse.HelpFormatter)
    return formatter._get_help_string(action) or ""  # noqa: SLF001 - the formatter's own rule, as --help applies it

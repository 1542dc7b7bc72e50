"""Messages without native source locations: a C++ library's exception text names the file and line that raised it
("[07:56:08] /project/cpp/regex_converter.cc:83: ...", "[/__w/pytorch/.../gloo/transport/tcp/pair.cc:537] ..."),
which tells a client or an operator nothing and shows the server's build paths."""

from __future__ import annotations

import re

# found by its end, then back to the path's start: one pattern for the whole path would backtrack on long
# path-like text
_SOURCE_END = re.compile(r"\.(?:cc|cpp|cxx|c|h|hpp|rs|py):\d+:\s*")
_STAMP = re.compile(r"\[\d\d:\d\d:\d\d\]\s?")
# a bracketed location, as gloo writes it (no spaces or brackets inside: linear)
_BRACKETED = re.compile(r"\[[^\[\]\s]*\.(?:cc|cpp|cxx|c|h|hpp|rs|py):\d+\]\s?")


def without_sources(text: str) -> str:
    """``text`` without absolute source paths with their line ("/a/b.cc:83: ", with a time stamp before it) and
    bracketed source locations ("[../gloo/pair.cc:537] ")."""
    text = _BRACKETED.sub("", text)
    out, last = [], 0
    for m in _SOURCE_END.finditer(text):
        start = max(text.rfind(" ", last, m.start()), text.rfind("\n", last, m.start())) + 1
        if start < last or not text.startswith("/", start):
            continue
        stamp = text.rfind("[", last, start)
        if stamp >= 0 and _STAMP.fullmatch(text, stamp, start):
            start = stamp
        out.append(text[last:start])
        last = m.end()
    return "".join(out) + text[last:]

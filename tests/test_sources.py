"""Native source locations taken out of messages (flying.sources)."""

from __future__ import annotations

import pytest

from flying.sources import without_sources


@pytest.mark.parametrize(
    ("message", "clean"),
    [
        ("x /a/b.py:3: y, and /c/d.cc:9: z", "x y, and z"),
        ("compile: [07:56:08] /project/cpp/regex_converter.cc:83: parse error", "compile: parse error"),
        (
            "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection closed "
            "by peer [127.0.0.1]:35407",
            "RuntimeError: Connection closed by peer [127.0.0.1]:35407",
        ),
        ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out", "Timed out"),
        (
            "relative/path.py:3: is kept, as is [not a source]",
            "relative/path.py:3: is kept, as is [not a source]",
        ),
    ],
)
def test_source_locations_are_taken_out(message, clean):
    assert without_sources(message) == clean

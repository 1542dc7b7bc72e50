"""SGLang's own benchmark client, ``sglang.bench_serving --backend sglang-oai`` (completions: it sends
``best_of: 1`` and ``ignore_eos`` with every request), run against a real gateway process, the real router and an
engine that answers as SGLang does (tests.sglang_like): every request succeeds. (``--backend sglang-oai-chat``
works too; one run keeps the test short: the client's start-up imports most of SGLang.)"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.sglang_like import SGLangLike
from tests.stack import ServerThread, gateway_process

pytestmark = pytest.mark.e2e
pytest.importorskip("sglang")
PROMPTS = 20


def test_bench_serving_completes_every_request(redis_server, keys, tiny_model, tmp_path):
    fake = SGLangLike()
    with (
        ServerThread(fake.app) as engine,
        gateway_process(redis_server.url, keys, tiny_model, tmp_path, engine_url=engine.url) as url,
    ):
        cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang-oai", "--base-url", url,
               "--model", "tiny-llama", "--tokenizer", str(tiny_model), "--dataset-name", "random-ids",
               "--num-prompts", str(PROMPTS), "--random-input-len", "32", "--random-output-len", "8",
               "--request-rate", "20", "--disable-tqdm"]  # fmt: skip
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path
        )  # (its result file)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(rf"Successful requests:\s+{PROMPTS}\b", out.stdout), out.stdout[-3000:]

"""The gateway's /metrics after real traffic: a real gateway process, the real router, a fake engine."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from tests.stack import gateway_process


@pytest.fixture
def gateway(redis_server, keys, tiny_model, tmp_path):
    with gateway_process(redis_server.url, keys, tiny_model, tmp_path) as url:
        yield url


def sample(text: str, name: str, **labels) -> float:
    """One sample's value from the exposition text (labels in any order)."""
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if m and dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")) == labels:
            return float(m.group(2))
    return 0.0


@pytest.mark.slow
def test_requests_ttft_queue_time_and_rejections_by_priority(gateway):
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    high = {"X-Priority": "high"}
    client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=2, extra_headers=high)
    list(client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=2, stream=True, extra_headers=high))  # fmt: skip
    client.completions.create(model="tiny-llama", prompt="one two", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=0)
    text = httpx.get(f"{gateway}/metrics").text
    chat = "/v1/chat/completions"
    assert sample(text, "flying_gateway_requests_total", route=chat, status="200", priority="high") == 2
    assert (
        sample(
            text, "flying_gateway_requests_total", route="/v1/completions", status="200", priority="normal"
        )
        == 1
    )
    assert sample(text, "flying_gateway_requests_total", route=chat, status="400", priority="normal") == 1
    assert sample(text, "flying_gateway_ttft_seconds_count", priority="high") == 2
    assert sample(text, "flying_gateway_queue_time_seconds_count", priority="high") == 2
    assert sample(text, "flying_gateway_rejected_total", status="400", reason="invalid_request") == 1
    assert sample(text, "flying_gateway_requests_in_flight") == 1, "the scrape itself"

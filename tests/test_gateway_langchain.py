"""``langchain-openai``'s ``ChatOpenAI`` and ``OpenAI`` (completions: it always sends a list of prompts) against the
gateway, as in tests.test_gateway_openai; skipped where ``langchain-openai`` is not installed."""

from __future__ import annotations

import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from tests import test_gateway_openai as stack
from tests.stack import CountWords, RouterThread, ServerThread, announce_engine

langchain_openai = pytest.importorskip("langchain_openai")
engine = stack.engine  # the fixture: the engine of tests.test_gateway_openai


@pytest.fixture
def gateway_url(redis_server, sync_redis, keys, engine):
    """The gateway served by uvicorn (langchain builds its own HTTP clients)."""
    engine.calls.clear()
    announce_engine(sync_redis, keys, url=engine.url)
    cfg = GatewayConfig(model_path="unused", redis_url=redis_server.url, key_prefix=keys.prefix)
    with (
        RouterThread(redis_server.url, keys.prefix),
        ServerThread(create_app(cfg, count_tokens=CountWords())) as gw,
    ):
        yield gw.url + "/v1"


def test_chat_openai_invoke_and_stream(gateway_url):
    chat = langchain_openai.ChatOpenAI(base_url=gateway_url, api_key="unused", model="tiny-llama", max_retries=0,
                                       max_tokens=3)  # fmt: skip
    assert chat.invoke("hello there").content == " w0 w1 w2"
    assert "".join(str(c.content) for c in chat.stream("hello there")) == " w0 w1 w2"


def test_completions_class_sends_a_list_of_prompts(gateway_url, engine):
    llm = langchain_openai.OpenAI(base_url=gateway_url, api_key="unused", model="tiny-llama", max_retries=0,
                                  max_tokens=3)  # fmt: skip
    assert llm.invoke("hello there") == " w0 w1 w2"
    out = llm.generate(["one", "two words"])
    assert [g[0].text for g in out.generations] == [" w0 w1 w2", " w0 w1 w2"]
    assert sorted(body["prompt"] for _, body in engine.calls[-2:]) == ["one", "two words"]

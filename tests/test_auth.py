"""API keys on the gateway: the real app with a real Redis, through Starlette's test client and the official
openai client."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway.auth import RequireKey, read_keys
from tests.stack import gateway_process


def test_keys_come_from_the_environment_and_a_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("k2\n\n# a comment\nk3  # trailing comment\nk1\n")
    assert read_keys(" k1, ,k4", str(f)) == ("k1", "k4", "k2", "k3")
    assert read_keys(None) == ()


def test_only_a_listed_bearer_key_is_allowed():
    m = RequireKey(app=None, keys=("k1", "k2"))
    assert m.allows("Bearer k1") and m.allows("bearer k2") and m.allows("Bearer  k2 ")
    assert (
        not m.allows("") and not m.allows("Bearer") and not m.allows("Basic k1") and not m.allows("Bearer k3")
    )
    assert m.protected("/v1/chat/completions") and m.protected("/v1/models")
    assert not m.protected("/health") and not m.protected("/metrics")
    assert RequireKey(app=None, keys=("k",), protect_metrics=True).protected("/metrics")
    assert not RequireKey(app=None, keys=()).protected("/v1/models"), "no keys: open"


@pytest.fixture
def gateway_with_keys(redis_server, keys, tiny_model, tmp_path):
    """A real gateway process with FLYING_API_KEYS=k1 and a key file with k2 (tests.stack.gateway_process)."""
    (tmp_path / "keys").write_text("k2\n")
    env, args = {"FLYING_API_KEYS": "k1"}, ("--api-key-file", str(tmp_path / "keys"), "--metrics-require-key")
    with gateway_process(redis_server.url, keys, tiny_model, tmp_path, env, args) as url:
        yield url, tmp_path / "gateway.log"


@pytest.mark.slow
def test_the_openai_client_with_a_key_is_served_and_without_one_gets_401(gateway_with_keys):
    url, log = gateway_with_keys
    msgs = [{"role": "user", "content": "hi"}]
    for key in ("k1", "k2"):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        out = client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=3)
        assert out.choices[0].message.content
        chunks = list(
            client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=3, stream=True)
        )
        assert chunks
    with pytest.raises(openai.AuthenticationError) as err:
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    bare = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny-llama", "messages": msgs})
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    assert bare.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{url}/health").status_code == 200, "/health stays open"
    assert httpx.get(f"{url}/metrics").status_code == 401, "--metrics-require-key"
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer k1"}).text
    assert 'flying_gateway_rejected_total{reason="invalid_api_key",status="401"} 3.0' in metrics
    text = log.read_text()
    assert "2 API keys" in text and "k1" not in text and "wrong" not in text, "keys are never logged"

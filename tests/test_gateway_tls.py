"""TLS end to end: a real ``flying-gateway`` process serving HTTPS with a self-signed certificate (the real openai
client trusts that certificate), whose Redis is a ``redis-server`` that speaks only TLS and wants a password, as
does the router's (in a thread); a fake engine process serves."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
import redis

from flying.keys import Keys
from flying.procs import free_port, spawn, stop
from loadgen import fake_server
from tests.stack import RouterThread, announce_engine
from tests.tls import self_signed, tls_redis


def wait_https(proc: subprocess.Popen, url: str, cert: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the gateway exited"
        try:
            if httpx.get(url + "/health", verify=cert, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"{url} not healthy within {timeout_s} s")


@pytest.mark.e2e
def test_https_gateway_over_a_tls_redis_with_a_password(tiny_model, tmp_path):
    cert, key = self_signed(tmp_path)
    keys = Keys("tls")
    engine, engine_url = fake_server.start_process(tmp_path / "engine.log")
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    try:
        with tls_redis(tmp_path / "redis") as redis_url, RouterThread(redis_url, keys.prefix):
            announce_engine(redis.Redis.from_url(redis_url), keys, url=engine_url)
            gw = spawn(
                [sys.executable, "-m", "gateway.main", "--model-path", str(tiny_model), "--port", str(port),
                 "--key-prefix", keys.prefix, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)],
                tmp_path / "gateway.log",
                env=os.environ | {"FLYING_REDIS_URL": redis_url},  # the password stays out of the process listing
            )  # fmt: skip
            try:
                wait_https(gw, url, str(cert))
                client = openai.OpenAI(
                    base_url=url + "/v1", api_key="none", http_client=httpx.Client(verify=str(cert))
                )
                messages = [{"role": "user", "content": "hello there"}]
                answer = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=4)
                assert answer.choices[0].message.content
                chunks = list(client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=4, stream=True))  # fmt: skip
                assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                with pytest.raises(httpx.HTTPError):
                    httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)  # TLS only
                with pytest.raises(httpx.ConnectError, match="(?i)certificate"):
                    httpx.get(url + "/health", timeout=2)  # not trusted without the certificate
            finally:
                stop(gw)
    finally:
        engine.kill()
        engine.wait()

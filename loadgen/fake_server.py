"""A minimal, fast OpenAI-style streaming endpoint: loadgen's self-test target and the "fast endpoint" of its
dispatch benchmark. Raw asyncio HTTP/1.1 with keep-alive and chunked SSE, so it costs far less CPU than the
client it serves. Each request streams ``max_tokens`` tokens (one per chunk, usage in every chunk when asked),
``itl_ms`` apart, after ``ttft_ms``; ``/v1/models`` lists one model; ``/health`` answers 200; ``/abort_request`` (SGLang's, by ``rid``)
ends a running stream with ``finish_reason`` "abort". A word of the prompt (of every message's content, for chat)
stands for a token; usage reports ``prompt_tokens_details.cached_tokens`` from a prefix cache of the prompts and
outputs it has seen, in blocks of ``BLOCK`` words. With ``--api-key`` every ``/v1/*`` request needs
``Authorization: Bearer <key>`` (else 401, as the gateway's ``--api-key-file`` does).

    python -m loadgen.fake_server --port 9000 --ttft-ms 5 --itl-ms 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

MODEL = "fake-model"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


BLOCK = 4  # words per block of the fake prefix cache
CACHE_BLOCKS = 100_000  # blocks it holds before it starts over


@dataclass
class EngineState:
    """What one fake engine is doing: the request ids streaming now, those it was asked to abort, its prefix
    cache (a hash chain per block of words, as SGLang's paged cache hashes pages), and with ``log`` set, every
    request body it got."""

    running: set[str] = field(default_factory=set)
    aborted: list[str] = field(default_factory=list)
    blocks: set[int] = field(default_factory=set)
    log: list[dict] | None = None

    def cached(self, words: list[str]) -> int:
        """Words of ``words`` found in the cache (whole blocks of a prefix)."""
        h, n = 0, 0
        for i in range(0, len(words) - BLOCK + 1, BLOCK):
            h = hash((h, *words[i : i + BLOCK]))
            if h not in self.blocks:
                break
            n = i + BLOCK
        return n

    def insert(self, words: list[str]) -> None:
        if len(self.blocks) > CACHE_BLOCKS:
            self.blocks.clear()
        h = 0
        for i in range(0, len(words) - BLOCK + 1, BLOCK):
            h = hash((h, *words[i : i + BLOCK]))
            self.blocks.add(h)


def prompt_words(req: dict) -> list[str]:
    """The prompt as the fake counts it: a token-id prompt's ids, a text prompt's words, chat contents' words."""
    if "messages" in req:
        return [w for m in req["messages"] for w in str(m.get("content") or "").split()]
    prompt = req.get("prompt") or ""
    return [str(x) for x in prompt] if isinstance(prompt, list) else str(prompt).split()


class _Conn(asyncio.Protocol):
    def __init__(self, ttft_ms: float, itl_ms: float, state: EngineState, api_key: str | None = None) -> None:
        self.ttft, self.itl = ttft_ms / 1000, itl_ms / 1000
        self.state = state
        self.auth = f"Bearer {api_key}".encode() if api_key else None
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            head, sep, rest = self.buf.partition(b"\r\n\r\n")
            if not sep:
                return
            length, auth = 0, b""
            for line in head.split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"content-length":
                    length = int(v)
                elif k.strip().lower() == b"authorization":
                    auth = v.strip()
            if len(rest) < length:
                return
            body, self.buf = rest[:length], rest[length:]
            request_line = head.split(b"\r\n", 1)[0].split()
            asyncio.ensure_future(self.respond(request_line[0], request_line[1], body, auth))

    async def respond(self, method: bytes, path: bytes, body: bytes, auth: bytes = b"") -> None:
        t = self.transport
        assert t is not None
        if self.auth is not None and path.startswith(b"/v1/") and auth != self.auth:
            doc = b'{"error": {"message": "invalid API key", "code": "invalid_api_key"}}'
            t.write(
                b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(doc), doc)
            )
            return
        if path == b"/v1/models":
            doc = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
            t.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(doc), doc)
            )
            return
        if path in (b"/health", b"/health_generate"):  # what routers in front of engines probe
            t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            return
        if method == b"POST" and path == b"/abort_request":
            self.state.aborted.append(json.loads(body).get("rid", ""))
            t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            return
        if method != b"POST" or path not in (b"/v1/chat/completions", b"/v1/completions"):
            t.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            return
        req = json.loads(body)
        if self.state.log is not None:
            self.state.log.append(req)
        rid = str(req.get("rid") or id(req))
        self.state.running.add(rid)
        try:
            if not req.get("stream"):
                await self.complete(t, req, path == b"/v1/chat/completions")
                return
            await self.stream(t, req, rid, path == b"/v1/chat/completions")
        finally:
            self.state.running.discard(rid)

    async def complete(self, t: asyncio.Transport, req: dict, chat: bool) -> None:
        """A non-streaming answer: ``n`` choices of ``max_tokens`` tokens " tok", after the time a stream takes;
        its id is the request's rid, as SGLang's is."""
        n, k = int(req.get("max_tokens") or 16), int(req.get("n") or 1)
        await asyncio.sleep(self.ttft + self.itl * (n - 1))
        words = prompt_words(req)
        p, cached = len(words) or 8, self.state.cached(words)
        text = " tok" * n
        self.state.insert(words + text.split())
        choices = [
            {"index": i, "finish_reason": "length"}
            | ({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            for i in range(k)
        ]
        usage = {
            "prompt_tokens": p,
            "completion_tokens": n * k,
            "total_tokens": p + n * k,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        kind = "chat.completion" if chat else "text_completion"
        doc = json.dumps(
            {
                "id": str(req.get("rid") or "x"),
                "object": kind,
                "created": int(time.time()),
                "model": MODEL,
                "choices": choices,
                "usage": usage,
            }
        ).encode()
        t.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(doc), doc)
        )

    async def stream(self, t: asyncio.Transport, req: dict, rid: str, chat: bool) -> None:
        """Token i of a prompt of p tokens has id p + i and text " t<id>" (p: the ids of a token-id prompt, else
        its words), so a stream resumed from prompt + streamed ids continues exactly where it broke."""
        n = int(req.get("max_tokens") or 16)
        every = bool((req.get("stream_options") or {}).get("continuous_usage_stats"))
        prompt = req.get("prompt") or ""
        words = prompt_words(req)
        p, cached, out = len(words) or 8, self.state.cached(words), []
        ids = bool(req.get("return_token_ids"))
        t.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-queue-time-ms: 0.5\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        await asyncio.sleep(self.ttft)
        for i in range(n):
            if i:
                await asyncio.sleep(self.itl)
            text = f" t{p + i}" if ids else " tok"
            out.append(text.strip())
            choice: dict = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            if ids:
                choice["token_ids"] = [p + i]
                if i == 0:
                    choice["prompt_token_ids"] = prompt if isinstance(prompt, list) else list(range(p))
            if i == n - 1:
                choice["finish_reason"] = "length"
            event: dict = {"id": rid, "created": int(time.time()), "model": MODEL, "choices": [choice]}
            if every:
                event["usage"] = {
                    "prompt_tokens": p,
                    "completion_tokens": i + 1,
                    "total_tokens": p + i + 1,
                    "prompt_tokens_details": {"cached_tokens": cached},
                }
            if t.is_closing():
                return
            if rid in self.state.aborted:
                choice |= {"finish_reason": "abort"}
                t.write(
                    _chunk(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n") + b"0\r\n\r\n"
                )
                return
            t.write(_chunk(b"data: " + json.dumps(event).encode() + b"\n\n"))
        self.state.insert(words + out)
        usage = {
            "prompt_tokens": p,
            "completion_tokens": n,
            "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        tail = {"id": rid, "model": MODEL, "choices": [], "usage": usage}
        t.write(_chunk(b"data: " + json.dumps(tail).encode() + b"\n\ndata: [DONE]\n\n") + b"0\r\n\r\n")


async def serve(
    port: int,
    ttft_ms: float = 0.0,
    itl_ms: float = 0.0,
    host: str = "127.0.0.1",
    state: EngineState | None = None,
    api_key: str | None = None,
) -> asyncio.Server:
    loop = asyncio.get_running_loop()
    state = state or EngineState()
    return await loop.create_server(lambda: _Conn(ttft_ms, itl_ms, state, api_key), host, port, backlog=4096)


def start_process(
    log: Path, ttft_ms: float = 0.0, itl_ms: float = 0.0, api_key: str | None = None
) -> tuple[subprocess.Popen, str]:
    """Run the endpoint in its own process (so it does not share the client's event loop or GIL); return the
    process and its base URL once it answers."""
    from flying.procs import free_port, spawn, wait_healthy

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "loadgen.fake_server",
        "--port",
        str(port),
        "--ttft-ms",
        str(ttft_ms),
        "--itl-ms",
        str(itl_ms),
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    proc = spawn(cmd, log)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 30, path="/health")
    return proc, url


def main() -> None:
    p = argparse.ArgumentParser(prog="loadgen.fake_server", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=0.0)
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer <this> on /v1/*")
    a = p.parse_args()

    async def forever() -> None:
        server = await serve(a.port, a.ttft_ms, a.itl_ms, api_key=a.api_key)
        print(f"fake OpenAI endpoint on http://127.0.0.1:{a.port}", flush=True)
        async with server:
            await server.serve_forever()

    try:
        import uvloop

        uvloop.run(forever())
    except ImportError:
        asyncio.run(forever())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

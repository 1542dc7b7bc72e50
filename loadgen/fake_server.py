"""A minimal, fast OpenAI-style streaming endpoint: loadgen's self-test target and the "fast endpoint" of its
dispatch benchmark. Raw asyncio HTTP/1.1 with keep-alive and chunked SSE, so it costs far less CPU than the
client it serves. Each request streams ``max_tokens`` tokens (one per chunk, usage in every chunk when asked),
``itl_ms`` apart, after ``ttft_ms``; ``/v1/models`` lists one model.

    python -m loadgen.fake_server --port 9000 --ttft-ms 5 --itl-ms 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

MODEL = "fake-model"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Conn(asyncio.Protocol):
    def __init__(self, ttft_ms: float, itl_ms: float) -> None:
        self.ttft, self.itl = ttft_ms / 1000, itl_ms / 1000
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            head, sep, rest = self.buf.partition(b"\r\n\r\n")
            if not sep:
                return
            length = 0
            for line in head.split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"content-length":
                    length = int(v)
            if len(rest) < length:
                return
            body, self.buf = rest[:length], rest[length:]
            request_line = head.split(b"\r\n", 1)[0].split()
            asyncio.ensure_future(self.respond(request_line[0], request_line[1], body))

    async def respond(self, method: bytes, path: bytes, body: bytes) -> None:
        t = self.transport
        assert t is not None
        if path == b"/v1/models":
            doc = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
            t.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(doc), doc)
            )
            return
        if method != b"POST" or path not in (b"/v1/chat/completions", b"/v1/completions"):
            t.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            return
        req = json.loads(body)
        n = int(req.get("max_tokens") or 16)
        every = bool((req.get("stream_options") or {}).get("continuous_usage_stats"))
        chat = path == b"/v1/chat/completions"
        t.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-queue-time-ms: 0.5\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        await asyncio.sleep(self.ttft)
        for i in range(n):
            if i:
                await asyncio.sleep(self.itl)
            choice = {"index": 0, "delta": {"content": " tok"}} if chat else {"index": 0, "text": " tok"}
            event: dict = {"id": "x", "created": int(time.time()), "model": MODEL, "choices": [choice]}
            if every:
                event["usage"] = {"prompt_tokens": 8, "completion_tokens": i + 1, "total_tokens": 9 + i}
            if t.is_closing():
                return
            t.write(_chunk(b"data: " + json.dumps(event).encode() + b"\n\n"))
        usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
        tail = {"id": "x", "model": MODEL, "choices": [], "usage": usage}
        t.write(_chunk(b"data: " + json.dumps(tail).encode() + b"\n\ndata: [DONE]\n\n") + b"0\r\n\r\n")


async def serve(
    port: int, ttft_ms: float = 0.0, itl_ms: float = 0.0, host: str = "127.0.0.1"
) -> asyncio.Server:
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Conn(ttft_ms, itl_ms), host, port, backlog=4096)


def start_process(log: Path, ttft_ms: float = 0.0, itl_ms: float = 0.0) -> tuple[subprocess.Popen, str]:
    """Run the endpoint in its own process (so it does not share the client's event loop or GIL); return the
    process and its base URL once it answers."""
    from flying.procs import free_port, spawn, wait_healthy

    port = free_port()
    cmd = [sys.executable, "-m", "loadgen.fake_server", "--port", str(port), "--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms)]  # fmt: skip
    proc = spawn(cmd, log)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 30, path="/v1/models")
    return proc, url


def main() -> None:
    p = argparse.ArgumentParser(prog="loadgen.fake_server", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=0.0)
    a = p.parse_args()

    async def forever() -> None:
        server = await serve(a.port, a.ttft_ms, a.itl_ms)
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

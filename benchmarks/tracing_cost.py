"""What the gateway's tracing (gateway.tracing) costs a request in CPU: the request's server span and its steps'
spans (admission, queue, dispatch, relay) around steps that do nothing, the spans exported in batches to an
exporter that drops them. Off, on (every request sampled) and on with 1 % sampled (OTEL_TRACES_SAMPLER), in one
process, one after another, each the median of ``--rounds`` rounds.

    PYTHONPATH=. .venv/bin/python benchmarks/tracing_cost.py --requests 3000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from types import SimpleNamespace

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from flying.messages import Assignment, QueuedRequest
from gateway.admission import Admitted
from gateway.observer import NOTHING, Observer
from gateway.tracing import Tracing

SCOPE = {
    "type": "http",
    "method": "POST",
    "path": "/v1/chat/completions",
    "headers": [(b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")],
}


class Drop(SpanExporter):
    def export(self, spans):
        return SpanExportResult.SUCCESS


class Steps:
    """Serving steps that do nothing but call their observer where the gateway's components do
    (gateway.observer); off, the observer that does nothing."""

    def __init__(self, observer: Observer = NOTHING) -> None:
        self.obs = observer

    async def admit(self, req, priority, request_id=None):
        started = time.time_ns()
        record = QueuedRequest(
            id=request_id,
            priority=priority,
            model="m",
            prompt_tokens=1,
            max_tokens=1,
            gateway="g",
            enqueued_at=time.time(),
        )
        self.obs.admitted(record, started)
        return Admitted(record, "/v1/completions", {"rid": request_id}, stream=True)

    async def wait_assignment(self, adm, fut, disconnected):
        a = Assignment(id=adm.record.id, engine=0, url="http://e0", queue_ms=0.1)
        self.obs.assigned(adm.record, a)
        return a

    async def open_stream(self, url, path, body, headers=None):
        headers = dict(headers or {})
        handle = self.obs.relaying(body, url, path, True, headers)
        self.obs.relayed(handle, body, True, 200)
        return SimpleNamespace(status_code=200)

    async def finish(self, rid, state, error=""):
        self.obs.finished(rid, state, error)
        return True


async def request(steps: Steps, tracing: Tracing | None) -> None:
    if tracing is not None:
        span, token = tracing.start_request(SCOPE)
    adm = await steps.admit(None, "normal", "r")
    a = await steps.wait_assignment(adm, None, None)
    await steps.open_stream(a.url, adm.path, adm.body)
    await steps.finish("r", "done")
    if tracing is not None:
        tracing.end_request(span, token, 200, "r")


async def per_request_us(steps: Steps, tracing: Tracing | None, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        await request(steps, tracing)
    return (time.perf_counter() - t) / n * 1e6


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    out = {}
    for name, ratio in (("off", None), ("on", "1"), ("on, 1 % sampled", "0.01")):
        steps, tracing = Steps(), None
        if ratio is not None:
            os.environ.update({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": ratio})
            provider = TracerProvider()
            provider.add_span_processor(BatchSpanProcessor(Drop()))
            tracing = Tracing(provider)
            steps = Steps(tracing)
        out[name] = statistics.median(
            [await per_request_us(steps, tracing, a.requests) for _ in range(a.rounds)]
        )
        if tracing is not None:
            tracing.shutdown()
    print(" | ".join(f"{k}: {v:.1f} us/request" for k, v in out.items()))


if __name__ == "__main__":
    asyncio.run(main())

"""Worker heartbeats: a snapshot of the engine's load written to Redis every ``interval_s`` (50 ms), and at once
when the switching state (mode, epoch) changes. Never once per step: a busy engine steps every few ms, and a
Redis write per step costs the scheduler thread measurable time (the GIL).

A heartbeat key expires ``ttl_ms`` (3 s) after the last write: long enough that a scheduler starved of CPU (or of
the GIL) for a few seconds is not declared dead; a dead engine is found sooner by its ready key, which its launcher
refreshes while the server process lives (``worker_ext.launch``, 1.5 s). Writes happen on a background thread;
the scheduler step only swaps an in-memory snapshot and sets an event. Every write also re-adds the engine to the
registry, so after Redis lost its data the engine is back within one interval.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Literal, TypedDict, Unpack

import redis

from flying import redis_conn
from flying.keys import Keys
from flying.messages import Heartbeat, StepCost, encode

log = logging.getLogger(__name__)


class Load(TypedDict, total=False):
    """What a step boundary reports: the :class:`~flying.messages.Heartbeat` fields the engine's scheduler
    (``sglang_patches.scheduler_load``) and its binding (``Binding.status``) know."""

    mode: Literal["dp", "tp"]
    epoch: int
    pending: int
    group: tuple[int, ...]
    width: int
    bind_ms: float
    release_ms: float
    switch_error: str
    comm_groups: int
    comm_rebuilds: int
    pool_ready: bool
    num_engines: int
    pool_first: int
    kv_transform: bool
    park: bool
    parked: tuple[int, ...]
    transform_ms: float
    transform_tokens: int
    transform_peak_bytes: int
    transform_retracted: int
    param_bytes: int
    steps_tp: int
    steps_sp: int
    device: str
    sp_threshold: int
    step_costs: tuple[StepCost, ...]
    comm_ms: dict[str, float]
    running: int
    waiting: int
    paused: int
    free_kv_tokens: int
    max_total_tokens: int
    context_len: int
    max_running_requests: int
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class HeartbeatConfig:
    engine: int
    url: str
    model: str
    redis_url: str
    launch_id: str = ""
    node: str = ""  # the node it announces
    key_prefix: str = "flying"
    interval_s: float = 0.05
    ttl_ms: int = 3000

    def __post_init__(self) -> None:
        if self.engine < 0:
            raise ValueError(f"engine index must be >= 0, got {self.engine}")
        if self.ttl_ms <= self.interval_s * 1000 * 3:
            raise ValueError(f"ttl_ms {self.ttl_ms} must cover several missed beats of {self.interval_s} s")


class HeartbeatPublisher:
    """Owns one Redis connection and one daemon thread; ``beat(**load)`` is cheap and non-blocking."""

    def __init__(self, config: HeartbeatConfig) -> None:
        self.config = config
        self.keys = Keys(config.key_prefix)
        self.step = 0
        self._load: Load = {}
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._redis = redis_conn.sync_client(config.redis_url, socket_timeout=2)
        self._thread = threading.Thread(target=self._run, name="flying-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop writing (the key then expires); for tests and clean shutdowns."""
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout=2)

    def beat(self, **load: Unpack[Load]) -> None:
        """Record the engine's load at a step boundary; wake the writer if the switching state changed."""
        self.step += 1
        urgent = any(load.get(k) != self._load.get(k) for k in ("mode", "epoch", "pending"))
        self._load = load
        if urgent:
            self._wake.set()

    def snapshot(self) -> Heartbeat:
        cfg = self.config
        return Heartbeat(
            engine=cfg.engine,
            url=cfg.url,
            pid=os.getpid(),
            model=cfg.model,
            launch_id=cfg.launch_id,
            node=cfg.node,
            step=self.step,
            ts=time.time(),
            **self._load,
        )

    def write(self) -> None:
        hb = self.snapshot()
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(self.keys.worker(self.config.engine), encode(hb), px=self.config.ttl_ms)
        pipe.sadd(self.keys.workers, self.config.engine)
        pipe.execute()

    def _run(self) -> None:
        failing_since: float | None = None
        while not self._stopped.is_set():
            self._wake.wait(self.config.interval_s)  # every interval, or at once on a switching-state change
            self._wake.clear()
            if self._stopped.is_set():
                return
            try:
                self.write()
                if failing_since is not None:
                    log.warning("heartbeats resumed after %.1f s", time.monotonic() - failing_since)
                    failing_since = None
            except (
                redis.RedisError
            ) as exc:  # keep beating (redis-py reconnects); the key expiring is the signal
                if failing_since is None:
                    log.warning("heartbeat write failed (%s); retrying", exc)
                    failing_since = time.monotonic()
                time.sleep(min(0.5, self.config.interval_s * 4))

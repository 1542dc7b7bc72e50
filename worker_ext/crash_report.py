"""The engine's crash report (``flying.crashes``): written from the crashing scheduler, synchronously and before
SGLang's handler takes the server down, so it is in Redis before any gateway sees the engine's connection break."""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from flying import crashes, redis_conn
from flying.keys import Keys
from flying.messages import CrashReport
from worker_ext.sglang_patches import crash

log = logging.getLogger(__name__)
WRITE_TIMEOUT_S = 1.0  # the dying scheduler waits at most this long for Redis (connect, then write)
ERROR_CHARS = 300  # of the exception's text kept in the report


class CrashReporter:
    """Reports engine ``engine``'s crash to Redis at ``redis_url``."""

    def __init__(self, engine: int, redis_url: str, keys: Keys, launch_id: str = "") -> None:
        self.engine, self.keys, self.launch_id = engine, keys, launch_id
        self._redis = redis_conn.sync_client(
            redis_url, socket_timeout=WRITE_TIMEOUT_S, socket_connect_timeout=WRITE_TIMEOUT_S
        )

    def report(self, scheduler: Any, exc: BaseException, batches: list[Any]) -> CrashReport:
        """Write what ``scheduler`` held when it raised ``exc`` (``batches``: the batches it was running); a
        Redis that does not answer is logged, never raised (the crash goes on to SGLang's handler)."""
        report = CrashReport(
            engine=self.engine,
            launch_id=self.launch_id,
            at=time.time(),
            error=f"{type(exc).__name__}: {exc}"[:ERROR_CHARS],
            batch=tuple(crash.batch_rids(batches)),
            held=tuple(crash.held_rids(scheduler, batches)),
        )
        try:
            crashes.write(self._redis, self.keys, report)
        except redis.RedisError as err:
            log.error("engine %d: crash report not written (%r): %s", self.engine, err, report)
            return report
        log.error(
            "engine %d crashed (%s) running %s; reported in %s",
            self.engine,
            report.error,
            list(report.batch) or "no batch",
            self.keys.crash(self.engine),
        )
        return report

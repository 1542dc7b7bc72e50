"""The SGLang plugin (entry point ``sglang.srt.plugins: flying_serving``).

SGLang loads it in every one of its processes. It does nothing unless the process was started by
``flying-worker`` (env FLYING_ENGINE_INDEX set), so stock SGLang servers in the same environment stay stock.
"""

from __future__ import annotations

import logging
import os

from flying import settings

log = logging.getLogger(__name__)
_publisher = None


def register() -> None:
    if os.environ.get(settings.ENGINE_INDEX) is None:
        return
    from worker_ext import sglang_patches

    sglang_patches.check_version()
    sglang_patches.apply_scheduler_hooks(on_init=_on_scheduler_init, on_step=_on_step)


def _on_scheduler_init(scheduler) -> None:
    global _publisher
    from worker_ext import sglang_patches
    from worker_ext.heartbeat import HeartbeatConfig, HeartbeatPublisher

    if sglang_patches.scheduler_tp_rank(scheduler) != 0:
        return
    config = HeartbeatConfig(
        engine=int(os.environ[settings.ENGINE_INDEX]),
        url=os.environ[settings.ENGINE_URL],
        model=os.environ.get(settings.SERVED_MODEL, "default"),
        launch_id=os.environ.get(settings.LAUNCH_ID, ""),
        redis_url=settings.redis_url(),
        key_prefix=settings.key_prefix(),
    )
    _publisher = HeartbeatPublisher(config)
    _publisher.beat(**sglang_patches.scheduler_load(scheduler))
    _publisher.start()
    log.info("flying-serving plugin: engine %d heartbeating to %s", config.engine, config.redis_url)


def _on_step(scheduler) -> None:
    if _publisher is None:
        return
    from worker_ext import sglang_patches

    _publisher.beat(**sglang_patches.scheduler_load(scheduler))

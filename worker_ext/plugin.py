"""The SGLang plugin (entry point ``sglang.srt.plugins: flying_serving``).

SGLang loads it in every one of its processes. It does nothing unless the process was started by
``flying-worker`` (env FLYING_ENGINE_INDEX set), so stock SGLang servers in the same environment stay stock.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

from flying import settings

if TYPE_CHECKING:
    from worker_ext.binding import Binding
    from worker_ext.commands import CommandReader
    from worker_ext.crash_report import CrashReporter
    from worker_ext.heartbeat import HeartbeatConfig, HeartbeatPublisher

log = logging.getLogger(__name__)


def register() -> None:
    if os.environ.get(settings.ENGINE_INDEX) is None:
        return
    from worker_ext import sglang_patches

    sglang_patches.check_version()
    _setup_logs(os.environ.get(settings.LOG_FORMAT, "text"))
    plugin = Plugin()
    sglang_patches.apply_scheduler_hooks(on_init=plugin.on_scheduler_init, on_step=plugin.on_step)
    sglang_patches.apply_forward_hook(plugin.around_forward)
    sglang_patches.apply_abort_hook(plugin.on_abort)
    from worker_ext.sglang_patches import crash, requests

    requests.apply_output_hook()
    test_crash = plugin.crash_on_marker if os.environ.get(settings.TEST_CRASH_STOP) else None
    crash.apply_crash_hook(plugin.on_crash, before_batch=test_crash)


def _setup_logs(fmt: str) -> None:
    """The flying loggers at INFO (pool size, binds and releases show in the worker log); with ``json``, they and
    SGLang's request lines (rid as ``request_id``) are JSON lines (SGLang's other lines keep its text format)."""
    from flying import logs
    from worker_ext import sglang_patches

    ours = logging.getLogger("flying")
    ours.setLevel(logging.INFO)
    if fmt == "json":
        ours.addHandler(logs.handler("json"))
        ours.propagate = False
        sglang_patches.apply_request_log_handler(logs.handler("json", sys.stdout))


class Plugin:
    """The engine's flying side, one per scheduler process: its heartbeat, and for a bound-capable engine its
    command reader and binding, made when SGLang's scheduler starts (:meth:`on_scheduler_init`) and driven by
    SGLang's hooks."""

    def __init__(self) -> None:
        self.publisher: HeartbeatPublisher | None = None
        self.binding: Binding | None = None
        self.commands: CommandReader | None = None
        self.crashes: CrashReporter | None = None

    def on_abort(self, scheduler, rid: str) -> None:
        if self.binding is not None:
            self.binding.note_abort(rid)

    def on_crash(self, scheduler, exc: BaseException, batches: list) -> None:
        if self.crashes is not None:
            self.crashes.report(scheduler, exc, batches)

    def crash_on_marker(self, scheduler, batch) -> None:
        """The tests' poison request: a batch holding a request whose stop strings hold FLYING_TEST_CRASH_STOP's
        value raises, as a forward that fails on it would."""
        from worker_ext.sglang_patches import crash

        if self.publisher is not None and crash.stop_strings_in(batch, os.environ[settings.TEST_CRASH_STOP]):
            raise RuntimeError(f"{settings.TEST_CRASH_STOP}: a request asked this scheduler to crash")

    def around_forward(self, original, runner, forward_batch, *args, **kwargs):
        if self.binding is None:
            return original(runner, forward_batch, *args, **kwargs)
        return self.binding.around_forward(original, runner, forward_batch, *args, **kwargs)

    def on_scheduler_init(self, scheduler) -> None:
        from flying.keys import Keys
        from worker_ext import sglang_patches
        from worker_ext.crash_report import CrashReporter
        from worker_ext.heartbeat import HeartbeatConfig, HeartbeatPublisher

        if sglang_patches.scheduler_tp_rank(scheduler) != 0:
            return
        config = HeartbeatConfig(
            engine=int(os.environ[settings.ENGINE_INDEX]),
            url=os.environ[settings.ENGINE_URL],
            model=os.environ.get(settings.SERVED_MODEL, "default"),
            launch_id=os.environ.get(settings.LAUNCH_ID, ""),
            node=os.environ.get(settings.NODE, ""),
            redis_url=settings.redis_url(),
            key_prefix=settings.key_prefix(),
        )
        self.publisher = HeartbeatPublisher(config)
        self.publisher.beat(**sglang_patches.scheduler_load(scheduler))
        self.publisher.start()
        self.crashes = CrashReporter(
            config.engine, config.redis_url, Keys(config.key_prefix), launch_id=config.launch_id
        )
        log.info("flying-serving plugin: engine %d heartbeating to %s", config.engine, config.redis_url)
        self._start_switching(scheduler, config)

    def _start_switching(self, scheduler, config: HeartbeatConfig) -> None:
        """Bound-capable engines: the communicator pool (built in the background), the command reader, the
        binding."""
        from flying.keys import Keys
        from worker_ext import sglang_patches
        from worker_ext.binding import Binding
        from worker_ext.comm_pool import CommPool
        from worker_ext.commands import CommandReader
        from worker_ext.layout import Layout
        from worker_ext.sglang_patches.surface import SGLangScheduler
        from worker_ext.step_costs import StepCosts

        num_engines = int(os.environ.get(settings.NUM_ENGINES, "1"))
        port = os.environ.get(settings.COMM_PORT)
        if num_engines < 2 or not port:
            return
        # or the scheduler's own device: the pool's thread has no current device of its own
        device = "cpu"
        if os.environ.get(settings.DEVICE, "cpu") == "cuda":
            import torch

            device = f"cuda:{torch.cuda.current_device()}"
        host = os.environ.get(settings.COMM_HOST, "127.0.0.1")
        first = int(os.environ.get(settings.FIRST_ENGINE, "0"))
        pool = CommPool(
            config.engine,
            num_engines,
            host,
            int(port),
            first=first,
            device=device,
            launch_id=config.launch_id,
        ).start()
        self.commands = CommandReader(config.redis_url, Keys(config.key_prefix), config.engine).start()
        sglang_patches.register_idle_wake(scheduler, self.commands.wake_socket)
        engine = SGLangScheduler(scheduler)
        layout = Layout(
            engine.decoder_layers(),
            engine.kv_pool(),
            engine.kv_allocator(),
            engine.parameters,
            engine.decoder_stack(),
        )
        self.binding = Binding(
            engine,
            config.engine,
            pool,
            layout,
            on_change=lambda: self.beat(scheduler),
            sp_threshold=settings.sp_threshold(),
            costs=StepCosts("cuda" if device.startswith("cuda") else "cpu"),
        )

    def on_step(self, scheduler) -> None:
        if self.publisher is None:
            return
        if self.binding is not None and self.commands is not None:
            self.binding.on_step(self.commands.drain())
        self.beat(scheduler)

    def beat(self, scheduler) -> None:
        from worker_ext import sglang_patches

        # (set before the first step and before the binding exists)
        if self.publisher is None:
            return
        switching = self.binding.status() if self.binding is not None else {}
        load = sglang_patches.scheduler_load(scheduler)
        if (width := int(switching.get("width", 1))) > 1:
            # its own KV: bound, its pool holds ``width`` times the token slots (each a 1/width head slice), and
            # the status's max_total_tokens is its DP one
            load["free_kv_tokens"] //= width
        self.publisher.beat(**(load | switching))

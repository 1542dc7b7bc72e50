"""The launcher's liveness signal: the ready key lives exactly as long as the server process (refreshed with a
TTL), and rides out Redis losing its data or restarting."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import redis

from devstack.redis_server import RedisServer
from flying.procs import free_port
from worker_ext import launch


def keep_ready_in_thread(r, key, proc) -> dict:
    out: dict = {}
    t = threading.Thread(
        target=lambda: out.setdefault("rc", launch.keep_ready(r, key, "L1", proc)), daemon=True
    )
    t.start()
    out["thread"] = t
    return out


def wait_for(pred, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout_s, "condition not met in time"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_ready_key_expires_with_the_server_process(sync_redis, keys):
    proc = subprocess.Popen(["sleep", "1.5"])
    out = keep_ready_in_thread(sync_redis, keys.ready(0), proc)
    wait_for(lambda: sync_redis.get(keys.ready(0)) == b"L1", 2)
    assert 0 < sync_redis.pttl(keys.ready(0)) <= launch.READY_TTL_MS
    sync_redis.delete(keys.ready(0))  # Redis lost it: back within one refresh
    assert wait_for(lambda: sync_redis.exists(keys.ready(0)), 1) < 2 * launch.READY_REFRESH_S
    out["thread"].join(5)
    assert out["rc"] == 0
    assert wait_for(lambda: not sync_redis.exists(keys.ready(0)), 2) <= launch.READY_TTL_MS / 1000


def test_ready_key_comes_back_after_a_redis_restart(tmp_path, keys):
    server = RedisServer(data_dir=tmp_path).start()
    r = redis.Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)
    proc = subprocess.Popen(["sleep", "30"])
    try:
        out = keep_ready_in_thread(r, keys.ready(0), proc)
        wait_for(lambda: r.exists(keys.ready(0)), 2)
        server.stop()
        time.sleep(1.0)  # the launcher keeps going while Redis is away
        assert out["thread"].is_alive()
        server = RedisServer(port=server.port, data_dir=tmp_path).start()  # no persistence: the data is gone
        assert wait_for(lambda: r.exists(keys.ready(0)), 5) < 2
    finally:
        proc.kill()
        proc.wait()
        server.stop()


def test_a_cpu_worker_without_max_total_tokens_sizes_its_kv_from_the_hosts_memory(tiny_model):
    gib = 1 << 30
    two_on_24 = launch.default_kv_tokens(str(tiny_model), 2, "float32", available_bytes=22 * gib)
    per_token = 2 * 4 * 4 * 32 * 4  # K and V, 4 layers, 4 KV heads of 32, fp32
    assert two_on_24 * per_token <= 22 * gib * launch.KV_SHARE / 2, "each engine stays within its share"
    assert two_on_24 == 32 * 4096, "capped at 32 contexts"
    assert launch.default_kv_tokens(str(tiny_model), 2, "float32", available_bytes=gib // 100) == 4096, (
        "one context"
    )
    cfg = launch.WorkerConfig(engine=0, num_engines=2, model_path=str(tiny_model), port=30000, cpu=True)
    sized = launch.with_default_kv(cfg)
    assert sized.max_total_tokens and "--max-total-tokens" in launch.sglang_command(sized)
    assert (
        launch.with_default_kv(
            launch.WorkerConfig(**{**cfg.__dict__, "max_total_tokens": 512})
        ).max_total_tokens
        == 512
    )
    gpu = launch.WorkerConfig(**{**cfg.__dict__, "cpu": False})
    assert launch.with_default_kv(gpu).max_total_tokens is None, "GPU engines keep SGLang's own sizing"


def test_drain_withdraws_readiness_then_waits_for_assigned_requests(sync_redis, keys):
    proc = subprocess.Popen(["sleep", "30"])
    try:
        stop = threading.Event()
        sync_redis.sadd(keys.inflight(0), "a", "b")
        t = threading.Thread(
            target=launch.keep_ready, args=(sync_redis, keys.ready(0), "L1", proc, stop.is_set)
        )
        t.start()
        wait_for(lambda: sync_redis.exists(keys.ready(0)), 2)
        stop.set()  # SIGTERM
        t.join(1)
        assert not t.is_alive()
        out: dict = {}
        d = threading.Thread(
            target=lambda: out.setdefault(
                "left", launch.drain(sync_redis, keys.ready(0), keys.inflight(0), proc, grace_s=10)
            )
        )
        d.start()
        wait_for(lambda: not sync_redis.exists(keys.ready(0)), 1)  # not live any more: no new work
        time.sleep(0.5)
        assert d.is_alive(), "still serving its two requests"
        sync_redis.srem(keys.inflight(0), "a", "b")
        d.join(2)
        assert out["left"] == 0 and proc.poll() is None, "the launcher stops the engine after drain() returns"
        sync_redis.sadd(keys.inflight(0), "c")
        assert launch.drain(sync_redis, keys.ready(0), keys.inflight(0), proc, grace_s=0.3) == 1, "grace over"
    finally:
        proc.kill()
        proc.wait()


def test_enable_metrics_is_passed_to_sglang():
    cfg = launch.WorkerConfig(engine=0, num_engines=1, model_path="m", port=1)
    assert "--enable-metrics" not in launch.sglang_command(cfg)
    on = launch.WorkerConfig(engine=0, num_engines=1, model_path="m", port=1, enable_metrics=True)
    assert "--enable-metrics" in launch.sglang_command(on)


def test_the_radix_cache_is_on_for_bound_capable_workers_unless_turned_off():
    bindable = launch.WorkerConfig(engine=0, num_engines=2, model_path="m", port=1, comm_port=2)
    assert "--disable-radix-cache" not in launch.sglang_command(bindable)
    assert "--enable-cache-report" in launch.sglang_command(bindable), (
        "usage.prompt_tokens_details.cached_tokens"
    )
    args = launch.parser().parse_args(
        ["--engine", "0", "--num-engines", "2", "--model-path", "m", "--port", "1", "--disable-radix-cache"]
    )
    assert args.prefix_cache is False
    off = launch.WorkerConfig(
        engine=0, num_engines=2, model_path="m", port=1, comm_port=2, prefix_cache=False
    )
    assert "--disable-radix-cache" in launch.sglang_command(off)


@pytest.mark.slow
def test_a_worker_whose_port_is_taken_exits_at_once_saying_so():
    """Within PORT_WAIT_S, not after SGLang's start-up nor in a hang: SGLang's server finds the port taken only
    once loaded, and its exit then waits on its scheduler process."""
    port = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        cfg = launch.WorkerConfig(engine=3, num_engines=4, model_path="m", port=port, host="127.0.0.1")
        t0 = time.monotonic()
        with pytest.raises(SystemExit, match=f"engine 3: cannot serve on 127.0.0.1:{port}: .*in use"):
            launch.run(cfg)
        assert launch.PORT_WAIT_S <= time.monotonic() - t0 < launch.PORT_WAIT_S + 5
    assert launch.port_taken("127.0.0.1", port) == ""


def test_a_port_freed_while_the_worker_waits_is_taken():
    port = free_port()
    held = socket.socket()
    held.bind(("127.0.0.1", port))
    held.listen()
    threading.Timer(0.5, held.close).start()  # a previous server on the port, still exiting
    assert launch.port_taken("127.0.0.1", port, wait_s=5) == ""


def test_the_supported_sglang_version_is_checked_with_a_clear_error():
    from worker_ext import sglang_patches

    sglang_patches.check_version()  # the installed one is the supported one
    with pytest.raises(sglang_patches.SGLangMismatch, match=r"patches sglang 0\.5\.23, but sglang 0\.4\.0"):
        sglang_patches.check_version("0.4.0")


def test_a_worker_config_out_of_range_is_a_value_error_naming_the_flag():
    from worker_ext.launch import WorkerConfig

    with pytest.raises(ValueError, match="--engine 2"):
        WorkerConfig(engine=2, num_engines=2, model_path="/m", port=30000)
    with pytest.raises(ValueError, match="--port 0"):
        WorkerConfig(engine=0, num_engines=2, model_path="/m", port=0)
    with pytest.raises(ValueError, match=r"--engine 1 is not in its node's pool \[2, 4\)"):
        WorkerConfig(engine=1, num_engines=2, model_path="/m", port=30000, first_engine=2)


def test_a_second_nodes_worker_announces_its_node_and_pool_and_uses_its_local_gpu():
    """Node b's engine 9 (engines 8..15): its pool starts at 8, the plugin learns node and pool from the
    environment, and it runs on the node's second GPU; without --node it announces the host name."""
    from flying import settings
    from worker_ext.launch import WorkerConfig, parser, sglang_env

    a = parser().parse_args(
        ["--engine", "9", "--num-engines", "8", "--first-engine", "8", "--node", "b", "--model-path", "/m"]
        + ["--port", "30009"]
    )
    assert (a.node, a.first_engine) == ("b", 8)
    cfg = WorkerConfig(
        engine=9, num_engines=8, model_path="/m", port=30009, node="b", first_engine=8, cpu=False
    )
    env = sglang_env(cfg, "L1")
    assert (env[settings.NODE], env[settings.FIRST_ENGINE], env[settings.NUM_ENGINES]) == ("b", "8", "8")
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert (
        parser().parse_args(["--engine", "0", "--num-engines", "1", "--model-path", "/m", "--port", "1"]).node
        is None
    )


def test_the_flags_make_the_worker_config_with_its_device_node_and_sglang_arguments_resolved():
    a = launch.parser().parse_args(
        ["--engine", "0", "--num-engines", "1", "--model-path", "/m", "--port", "1", "--device", "cuda"]
        + ["--drain-grace-s", "5", "--", "--chunked-prefill-size", "512"]
    )
    cfg = launch.worker_config(a)
    assert (cfg.cpu, cfg.node, cfg.drain_grace_s) == (False, socket.gethostname(), 5.0)
    assert cfg.extra_args == ("--chunked-prefill-size", "512") and cfg.prefix_cache and cfg.log_requests


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--engine", "2", "--num-engines", "2", "--port", "1234"], "not in its node's pool"),
        (["--engine", "0", "--num-engines", "1", "--port", "0"], "--port 0 is not a TCP port"),
        (["--engine", "0", "--num-engines", "1", "--port", "1234", "--sp-threshold", "-1"], "must be >= 0"),
    ],
)
def test_options_that_do_not_fit_together_are_a_usage_error_in_words(args, said, capsys, tmp_path):
    with pytest.raises(SystemExit) as exited:
        launch.main([*args, "--model-path", str(tmp_path)])
    assert exited.value.code == 2 and said in capsys.readouterr().err


def test_a_missing_model_directory_is_a_usage_error_in_words(capsys, tmp_path):
    with pytest.raises(SystemExit) as exited:
        launch.main(["--engine", "0", "--num-engines", "1", "--port", "1234", "--model-path", str(tmp_path / "no"), "--device", "cpu"])  # fmt: skip
    assert exited.value.code == 2 and "config.json (a model directory)" in capsys.readouterr().err


def traced_lines(target, at: int | None, on_line) -> int:
    """Run ``target`` in a thread, tracing the lines it runs in this launcher's module and in ``threading``;
    call ``on_line()`` at line number ``at`` (as a signal handler would run there). Returns how many such lines
    ran, or -1 when ``target`` was still running 2 s later."""
    seen = [0]

    def tracer(frame, event, arg):
        if frame.f_code.co_filename not in (launch.__file__, threading.__file__):
            return None
        if event == "line":
            if seen[0] == at:
                on_line()
            seen[0] += 1
        return tracer

    def traced():
        sys.settrace(tracer)
        try:
            target()
        finally:
            sys.settrace(None)

    t = threading.Thread(target=traced, daemon=True)
    t.start()
    t.join(2)
    return -1 if t.is_alive() else seen[0]


def test_the_stop_signal_lands_at_any_line_of_the_ready_loop_and_it_still_ends(monkeypatch, sync_redis, keys):
    """A signal handler runs between any two lines of the main thread, the launcher's among them. Called at each
    line the ready-key loop runs (in this module and in threading), the SIGTERM handler returns, asks for a drain,
    and the loop ends at its next refresh. (A handler that took a lock the interrupted code held, as
    threading.Event.set does inside Event.wait, hung the launcher for good.)"""
    monkeypatch.setattr(launch, "READY_REFRESH_S", 0.005)
    proc = subprocess.Popen(["sleep", "60"])
    try:
        calls = [0]

        def twice() -> bool:  # a dry run: two refreshes, then stop
            calls[0] += 1
            return calls[0] > 2

        lines = traced_lines(
            lambda: launch.keep_ready(sync_redis, keys.ready(0), "L1", proc, twice), None, bool
        )
        assert lines > 5
        for at in range(lines):
            life = launch.Lifecycle()
            life.serving()

            def ready_loop(life=life):
                assert launch.keep_ready(sync_redis, keys.ready(0), "L1", proc, life.is_draining) is None

            def sigterm(life=life):
                life.on_signal(signal.SIGTERM, None)

            assert traced_lines(ready_loop, at, sigterm) >= 0, f"still waiting after a signal at line {at}"
            assert life.is_draining()
    finally:
        proc.kill()
        proc.wait()


def test_a_second_signal_or_one_before_serving_stops_the_launcher():
    early = launch.Lifecycle()
    with pytest.raises(SystemExit) as exc:
        early.on_signal(signal.SIGTERM, None)
    assert exc.value.code == 128 + signal.SIGTERM
    life = launch.Lifecycle()
    life.serving()
    life.on_signal(signal.SIGINT, None)
    assert life.is_draining()
    with pytest.raises(SystemExit):
        life.on_signal(signal.SIGINT, None)
    life.cleaning_up()
    life.on_signal(signal.SIGTERM, None)  # ignored while the launcher cleans up


SERVES_THEN_EXITS = """
import http.server, sys, threading, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
s = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
threading.Thread(target=s.serve_forever, daemon=True).start()
time.sleep(1.5)
sys.exit(3)
"""


def test_the_launcher_says_when_its_sglang_server_stops_and_exits_with_its_code(
    monkeypatch, redis_server, sync_redis, keys, caplog
):
    port = free_port()
    cfg = launch.WorkerConfig(engine=2, num_engines=4, model_path="m", port=port, redis_url=redis_server.url,
                              key_prefix=keys.prefix)  # fmt: skip
    monkeypatch.setattr(
        launch, "sglang_command", lambda c: [sys.executable, "-c", SERVES_THEN_EXITS, str(c.port)]
    )
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with caplog.at_level("ERROR", logger="flying.worker"):
            assert launch.run(cfg, ready_timeout_s=20) == 3
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert "engine 2: the SGLang server stopped (exit code 3)" in caplog.text
    assert not sync_redis.exists(keys.ready(2)), "no longer ready"

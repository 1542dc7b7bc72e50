"""flyctl and flying.control against a real Redis: commands land on each member's stream, status reads beats."""

import time

import pytest

from flyctl.cli import main
from flying import control
from flying.messages import Bind, Heartbeat, Release, RouterState, decode_command, encode
from flying.queue import CLASS_WEIGHT


def test_bind_and_release_write_every_members_stream(sync_redis, keys, redis_server, capsys):
    args = ["--redis-url", redis_server.url, "--key-prefix", keys.prefix]
    for e in range(4):
        _beat(sync_redis, keys, e, "", 0, n=4)
    assert main([*args, "bind", "1", "0"]) == 0
    epoch = int(capsys.readouterr().out)
    assert main([*args, "bind", "2", "3"]) == 0
    assert int(capsys.readouterr().out) == epoch + 1  # epochs are unique and increasing
    for e in (0, 1):
        ((_, fields),) = sync_redis.xrange(keys.commands(e))
        assert decode_command(fields[b"msg"]) == Bind(epoch=epoch, members=(0, 1))
    assert main([*args, "release", str(epoch), "0", "1"]) == 0
    assert decode_command(sync_redis.xrange(keys.commands(0))[-1][1][b"msg"]) == Release(epoch=epoch)
    assert main([*args, "release", str(epoch + 1), "2", "3", "--retract"]) == 0
    assert decode_command(sync_redis.xrange(keys.commands(3))[-1][1][b"msg"]) == Release(
        epoch=epoch + 1, retract=True
    )
    records = {g.epoch: g for g in control.groups(sync_redis, keys)}
    assert (records[epoch].released, records[epoch + 1].released) == ("wait", "retract"), (
        "how, for the metrics"
    )
    assert main([*args, "bind", "1"]) == 2  # a group of one is refused


def test_release_refuses_an_epoch_no_group_has_and_other_members(sync_redis, keys, redis_server, capsys):
    args = ["--redis-url", redis_server.url, "--key-prefix", keys.prefix]
    assert main([*args, "release", "999", "0", "1"]) == 2
    assert "cannot release epoch 999: no group has that epoch" in capsys.readouterr().err
    assert sync_redis.xlen(keys.commands(0)) == 0, "nothing sent"
    for e in range(4):
        _beat(sync_redis, keys, e, "", 0, n=4)
    assert main([*args, "bind", "0", "1"]) == 0
    epoch = int(capsys.readouterr().out)
    assert main([*args, "release", str(epoch), "0", "2"]) == 2
    assert "its group is [0, 1], not [0, 2]" in capsys.readouterr().err
    assert sync_redis.xlen(keys.commands(2)) == 0
    sync_redis.hdel(
        keys.groups, str(epoch)
    )  # the record gone, but an engine still reports the epoch: allowed
    hb = Heartbeat(engine=0, url="u", pid=1, model="m", launch_id="L", mode="tp", epoch=epoch, group=(0, 1))
    sync_redis.set(keys.worker(0), encode(hb))
    sync_redis.set(keys.ready(0), "L")
    sync_redis.sadd(keys.workers, 0)
    assert main([*args, "release", str(epoch), "0", "1"]) == 0


def test_bind_of_engines_started_without_a_comm_port_says_so(sync_redis, keys, redis_server, capsys):
    args = ["--redis-url", redis_server.url, "--key-prefix", keys.prefix]
    for e in (0, 1):
        _beat(sync_redis, keys, e, "a", e, n=1)  # what a worker without --comm-port reports: a pool of one
    assert main([*args, "status"]) == 0
    assert "pool engines none (cannot bind: no --comm-port)" in capsys.readouterr().out
    assert main([*args, "bind", "0", "1"]) == 2
    assert "started without --comm-port" in capsys.readouterr().err


def test_status_lists_live_engines_only(sync_redis, keys, redis_server, capsys):
    hb = Heartbeat(
        engine=0, url="u", pid=1, model="m", launch_id="L", mode="tp", epoch=4, group=(0, 1), width=2,
        prompt_tokens=1200, cached_tokens=900, paused=3,
    )  # fmt: skip
    sync_redis.set(keys.worker(0), encode(hb))
    sync_redis.set(keys.ready(0), "L")
    sync_redis.set(keys.worker(1), encode(Heartbeat(engine=1, url="u", pid=2, model="m", launch_id="X")))
    sync_redis.set(keys.ready(1), "Y")  # restarted server, stale heartbeat: not live
    sync_redis.sadd(keys.workers, 0, 1)
    assert list(control.status(sync_redis, keys)) == [0]
    assert main(["--redis-url", redis_server.url, "--key-prefix", keys.prefix, "status"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:5] == ["0", "tp", "4", "0", "0,1"] and len(out) == 6
    assert out[2].split()[:2] == ["1", "down:"] and out[2].endswith("breaker closed"), (
        "a registered engine not live"
    )
    assert out[0].split()[11:13] == ["cache", "hit"] and out[1].split()[10] == "75.0%", (
        "cached / prompt tokens"
    )
    assert out[0].split()[8] == "paused" and out[1].split()[8] == "3", "DP requests a bind set aside"
    assert out[3:] == ["router: none holds the lease; no router state", "groups: none", "queue: 0 waiting"]


def test_status_shows_groups_regime_and_queue_by_priority(sync_redis, keys, redis_server, capsys):
    args = ["--redis-url", redis_server.url, "--key-prefix", keys.prefix]
    assert main([*args, "bind", "0", "1"]) == 2, "no engine is live"
    assert "cannot bind [0, 1]: engines [0, 1] are not live" in capsys.readouterr().err
    for e in range(4):
        _beat(sync_redis, keys, e, "", 0, n=4)
    assert main([*args, "bind", "0", "1"]) == 0
    epoch = int(capsys.readouterr().out)
    sync_redis.set(
        keys.router_state,
        encode(
            RouterState(
                busy=False,
                widths={"0": 2},
                rate=2.0,
                prompt_rate=1000.0,
                output_rate=200.0,
                suspect={3: time.time() + 9.6, 2: 1.0},
            )
        ),
    )
    for i, (prio, cls) in enumerate([("high", 0), ("normal", 1), ("normal", 1)]):
        rid = f"r{i}"
        sync_redis.hset(keys.request(rid), mapping={"id": rid, "priority": prio, "enqueued_at": time.time() - 2,
                                                    "prompt_tokens": 5, "max_tokens": 7})  # fmt: skip
        sync_redis.zadd(keys.queue, {rid: cls * CLASS_WEIGHT + i})
    assert main([*args, "status"]) == 0
    out = capsys.readouterr().out
    assert (
        "planned: node 0 width 2; light: a group serves better; arrivals 2.0 req/s of 500/100 tokens" in out
    )
    assert "; left out of binds: 3 (10 s)" in out  # engine 2's time is over
    assert f"epoch {epoch:>4}  [0,1]  binding   manual" in out
    assert "queue: 3 waiting: high 1 (oldest 2.0" in out and "normal 2 (oldest 2.0" in out
    assert main([*args, "queue", "-n", "2"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [r.split()[:2] for r in rows[1:3]] == [["r0", "high"], ["r1", "normal"]]
    assert rows[-1] == "3 waiting (first 2 shown)"
    assert main([*args, "watch", "--count", "2", "--interval", "0.1"]) == 0
    watched = capsys.readouterr().out
    assert watched.count("groups: 1") == 2 and "\x1b" not in watched  # not a terminal: no screen clearing
    with pytest.raises(SystemExit) as refused:  # a busy loop on Redis
        main([*args, "watch", "--interval", "0"])
    assert refused.value.code == 2 and "at least 0.1" in capsys.readouterr().err
    assert main([*args, "bind", "1", "2"]) == 2  # overlaps the manual group (0, 1)
    capsys.readouterr()
    assert main([*args, "bind", "0", "1", "2", "3"]) == 0  # contains it: a width change replaces the record
    assert int(capsys.readouterr().out) == epoch + 1, "the refused bind took no epoch"
    assert [g.members for g in control.groups(sync_redis, keys)] == [(0, 1, 2, 3)]
    assert main([*args, "bind", "2", "3"]) == 2  # inside it but under another leader: refused
    assert main([*args, "bind", "0", "1"]) == 0  # narrower under the same leader: replaces it
    assert [g.members for g in control.groups(sync_redis, keys)] == [(0, 1)]


def test_status_shows_no_hit_rate_before_an_engine_finished_a_request(sync_redis, keys, redis_server, capsys):
    sync_redis.set(keys.worker(0), encode(Heartbeat(engine=0, url="u", pid=1, model="m", launch_id="L")))
    sync_redis.set(keys.ready(0), "L")
    sync_redis.sadd(keys.workers, 0)
    assert main(["--redis-url", redis_server.url, "--key-prefix", keys.prefix, "status"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[10] == "-"


async def test_tenants_lists_each_tenants_counters(aredis, sync_redis, keys, redis_server, capsys):
    from flying.queue import Charge, RequestQueue, TenantLimited
    from tests.test_queue import mk

    q = RequestQueue(aredis, keys)
    await q.admit(mk("a1"), charge=Charge("team-a", requests_per_s=1, tokens=100))
    with pytest.raises(TenantLimited):
        await q.admit(mk("a2"), charge=Charge("team-a", requests_per_s=1, tokens=100))
    assert main(["--redis-url", redis_server.url, "--key-prefix", keys.prefix, "tenants"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["tenant", "requests", "tokens"] + ["refused", "rps", "refused", "tpm"] + [
        "refused", "conc", "refused", "prio"
    ]  # fmt: skip
    assert lines[1].split() == ["team-a", "1", "100", "1", "0", "0", "0"]
    sync_redis.hset(keys.tenant("team-a"), mapping={"refused_max_concurrent": 2, "finish:1": "12.5"})
    assert main(["--redis-url", redis_server.url, "--key-prefix", keys.prefix, "tenants"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split() == ["team-a", "1", "100", "1", "0", "2", "0"]


def _beat(sync_redis, keys, e, node, first, n=2):
    hb = Heartbeat(
        engine=e, url="u", pid=e, model="m", launch_id=f"L{e}", node=node, pool_first=first, num_engines=n
    )
    sync_redis.set(keys.worker(e), encode(hb))
    sync_redis.set(keys.ready(e), f"L{e}")
    sync_redis.sadd(keys.workers, e)


def test_status_groups_engines_by_node_and_bind_refuses_a_cross_node_group(
    sync_redis, keys, redis_server, capsys
):
    args = ["--redis-url", redis_server.url, "--key-prefix", keys.prefix]
    for e, node, first in ((0, "a", 0), (1, "a", 0), (2, "b", 2), (3, "b", 2)):
        _beat(sync_redis, keys, e, node, first)
    assert main([*args, "status"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "node a: 2 live, pool engines 0..1" and [r.split()[0] for r in out[2:4]] == ["0", "1"]
    assert out[4] == "node b: 2 live, pool engines 2..3" and [r.split()[0] for r in out[5:7]] == ["2", "3"]
    assert main([*args, "bind", "1", "2"]) == 2
    err = capsys.readouterr().err
    assert "cannot bind [1, 2]: engines 1 on a, 2 on b: a group binds engines of one node only" in err
    assert sync_redis.xlen(keys.commands(1)) == 0 and not control.groups(sync_redis, keys), "nothing sent"
    _beat(sync_redis, keys, 4, "b", 2)  # (a heartbeat claiming node b but outside its pool)
    assert main([*args, "bind", "3", "4"]) == 2
    assert "engines [4] are not in engine 3's pool on node b (engines 2..3)" in capsys.readouterr().err
    assert main([*args, "bind", "2", "3"]) == 0
    assert [g.members for g in control.groups(sync_redis, keys)] == [(2, 3)]


def test_bind_wait_reports_whether_the_group_formed(sync_redis, keys, redis_server, capsys):
    """``--wait``: exit 0 once the record says bound, 1 when the router rolled it back or time ran out."""
    import threading

    import msgspec

    from flying.messages import Group, decode

    args = ["--redis-url", redis_server.url, "--key-prefix", keys.prefix]
    for e in range(2):
        _beat(sync_redis, keys, e, "", 0, n=2)

    def then(action, after_s=0.3):
        def run():
            time.sleep(after_s)
            (raw,) = sync_redis.hvals(keys.groups)
            g = decode(raw, Group)
            if action == "bound":
                sync_redis.hset(keys.groups, str(g.epoch), encode(msgspec.structs.replace(g, state="bound")))
            else:
                sync_redis.hdel(keys.groups, str(g.epoch))

        t = threading.Thread(target=run)
        t.start()
        return t

    t = then("bound")
    assert main([*args, "bind", "0", "1", "--wait", "5"]) == 0
    t.join()
    assert "bound: [0, 1]" in capsys.readouterr().out
    t = then("rolled back")
    assert main([*args, "bind", "0", "1", "--wait", "5"]) == 1
    t.join()
    assert "was rolled back" in capsys.readouterr().err
    assert main([*args, "bind", "0", "1", "--wait", "0.3"]) == 1
    assert "not bound within 0.3 s" in capsys.readouterr().err
    for i in range(2):
        sync_redis.hset(
            keys.request(f"q{i}"), mapping={"id": f"q{i}", "priority": "normal", "enqueued_at": "1"}
        )
        sync_redis.zadd(keys.queue, {f"q{i}": i})
    assert main([*args, "queue", "-n", "0"]) == 0
    out = capsys.readouterr().out
    assert "q0" not in out and "2 waiting (first 0 shown)" in out


def test_release_park_then_resume_binds_the_same_engines_in_order_and_a_plain_release_ends_it(
    sync_redis, keys, redis_server, capsys
):
    import msgspec

    from flying.messages import Group, decode

    args = ["--redis-url", redis_server.url, "--key-prefix", keys.prefix]
    for e in range(4):
        _beat(sync_redis, keys, e, "", 0, n=4)
    assert main([*args, "resume", "7"]) == 2
    assert "cannot resume epoch 7: no parked group has that epoch" in capsys.readouterr().err
    assert main([*args, "bind", "2", "3"]) == 0
    epoch = int(capsys.readouterr().out)
    assert main([*args, "release", "--park", str(epoch), "2", "3"]) == 0
    assert decode_command(sync_redis.xrange(keys.commands(2))[-1][1][b"msg"]) == Release(
        epoch=epoch, park=True
    )
    record = decode(sync_redis.hget(keys.groups, str(epoch)), Group)
    assert (record.state, record.park) == ("releasing", True)
    assert main([*args, "resume", str(epoch)]) == 2  # not parked yet: the members are still bound
    assert "it is still being parked" in capsys.readouterr().err
    sync_redis.hset(
        keys.groups, str(epoch), encode(msgspec.structs.replace(record, state="parked"))
    )  # (router)
    assert main([*args, "resume", str(epoch)]) == 0
    new = int(capsys.readouterr().out)
    assert decode_command(sync_redis.xrange(keys.commands(3))[-1][1][b"msg"]) == Bind(
        epoch=new, members=(2, 3), resume=epoch
    )
    assert sync_redis.hget(keys.groups, str(epoch)) is None
    assert decode(sync_redis.hget(keys.groups, str(new)), Group).carries == (epoch,)
    parked = Group(epoch=50, members=(0, 1), reason="long", state="parked", parked_requests=1)
    sync_redis.hset(keys.groups, "50", encode(parked))
    assert main([*args, "status"]) == 0
    assert "parked    long" in (out := capsys.readouterr().out) and "parked requests: 1" in out
    assert main([*args, "release", "50", "0", "1"]) == 0  # a parked epoch: its requests end
    assert decode_command(sync_redis.xrange(keys.commands(0))[-1][1][b"msg"]) == Release(epoch=50)
    assert sync_redis.hget(keys.groups, "50") is None


def test_watch_into_a_pipe_that_closes_ends_quietly(redis_server, keys):
    """``flyctl watch | head -1``: the reader leaves; flyctl stops with status 0 and no traceback."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "flyctl.cli", "--redis-url", redis_server.url, "--key-prefix", keys.prefix,
         "watch", "--interval", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline()
    proc.stdout.close()  # the reader is gone: the next refresh's write breaks the pipe
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and b"Traceback" not in err, err.decode()


def test_status_says_when_an_engines_pool_is_still_connecting(sync_redis, keys, redis_server, capsys):
    """A restarted engine serves before its communicator pool has connected; a bind then is refused: said."""
    args = ["--redis-url", redis_server.url, "--key-prefix", keys.prefix]
    _beat(sync_redis, keys, 0, "", 0)
    hb = Heartbeat(engine=1, url="u", pid=1, model="m", launch_id="L1", num_engines=2, pool_ready=False)
    sync_redis.set(keys.worker(1), encode(hb))
    sync_redis.set(keys.ready(1), "L1")
    sync_redis.sadd(keys.workers, 1)
    assert main([*args, "status"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["0"], ["1"])}  # fmt: skip
    assert "pool connecting" in rows["1"] and "pool connecting" not in rows["0"]


def test_status_tells_a_draining_engine_from_a_dead_one(sync_redis, keys, redis_server, capsys):
    """Both left the live set; one still beats (its launcher withdrew the ready key to drain), one does not."""
    args = ["--redis-url", redis_server.url, "--key-prefix", keys.prefix]
    for e in (0, 1):
        _beat(sync_redis, keys, e, "", 0)
    sync_redis.delete(keys.ready(0))  # draining: no new work, 2 requests to finish
    sync_redis.sadd(keys.inflight(0), "a", "b")
    sync_redis.delete(keys.ready(1), keys.worker(1))  # dead: no heartbeat either
    assert main([*args, "status"]) == 0
    out = capsys.readouterr().out
    assert "0 not live: draining (2 requests to finish)" in out
    assert "1 down: no live heartbeat" in out


def test_an_open_breaker_shows_the_seconds_to_its_probe_then_that_it_is_due():
    from flyctl.cli import breaker_cell
    from flying.breaker import Breaker, BreakerState

    assert breaker_cell(None) == "closed"
    assert breaker_cell(Breaker(BreakerState.OPEN, until=time.time() + 7.2)) == "open 7s"
    assert breaker_cell(Breaker(BreakerState.OPEN, until=time.time() - 30)) == "open, probe due"
    assert breaker_cell(Breaker(BreakerState.HALF_OPEN)) == "half_open"


def test_status_says_which_keys_it_cannot_read_and_shows_the_rest(sync_redis, keys, redis_server, capsys):
    sync_redis.set(keys.router_state, "nonsense")
    sync_redis.hset(keys.groups, "3", '{"members": "x"}')
    sync_redis.hset(keys.breakers, "0", "[]")
    assert main(["--redis-url", redis_server.url, "--key-prefix", keys.prefix, "status"]) == 0
    out = capsys.readouterr().out
    assert "queue: 0 waiting" in out and "router: none holds the lease; no router state" in out
    for key in (keys.router_state, keys.groups, keys.breakers):
        assert f"unreadable (not written by this version?): {key} (" in out

"""The communicator pool across real processes (gloo on CPU), no default process group anywhere."""

import contextlib
import multiprocessing as mp
import time

import pytest
import torch

from flying.groups import merge_sets, pool_sets
from flying.procs import free_port
from worker_ext.comm_pool import CommPool, NotInPool, peer_lost


def test_merge_sets_are_linear_aligned_ranges():
    assert merge_sets(1) == []
    assert merge_sets(2) == [(0, 1)]
    assert merge_sets(4) == [(0, 1), (2, 3), (0, 1, 2, 3)]
    assert merge_sets(6) == [(0, 1), (2, 3), (4, 5), (0, 1, 2, 3), (0, 1, 2, 3, 4, 5)]
    assert len(merge_sets(8)) == 7
    assert merge_sets(4, widths=(4,)) == [(0, 1, 2, 3)]
    with pytest.raises(ValueError):
        merge_sets(4, widths=(8,))


def test_a_nodes_pool_spans_its_own_engines_only():
    """Engine indices are global; a node's pool spans its run of them, and its merge sets stay inside it."""
    assert pool_sets(4, 4) == [(4, 5), (6, 7), (4, 5, 6, 7)]
    pool = CommPool(5, 4, "127.0.0.1", 1, first=4)
    assert pool.mine() == [(4, 5), (4, 5, 6, 7)]
    pool.ready.set()  # (nothing built: the lookup refuses before it looks)
    with pytest.raises(NotInPool, match=r"engines \[3\] are not in this node's pool \(engines 4..7\)"):
        pool.get((3, 4))
    with pytest.raises(ValueError, match=r"engine 3 is not in its pool \[4, 8\)"):
        CommPool(3, 4, "127.0.0.1", 1, first=4)


def _member(engine, n, port, out, first=0):
    pool = CommPool(engine, n, "127.0.0.1", port, timeout_s=5, first=first).start()
    pool.ready.wait(60)
    res = {"groups": list(pool.groups), "error": pool.error, "host_bytes": pool.host_bytes}
    for members in pool.groups:
        g = pool.get(members)
        x = torch.tensor([float(engine + 1)])
        g.all_reduce(x)
        plan = g.broadcast_object({"step": 7, "from": engine} if g.rank == 0 else None)
        res[members] = (x.item(), plan)
    out.put((engine, res))


@pytest.mark.slow
def test_every_engine_builds_its_groups_and_they_work():
    ctx = mp.get_context("spawn")
    out, port, n = ctx.Queue(), free_port(), 4
    procs = [ctx.Process(target=_member, args=(e, n, port, out)) for e in (3, 1, 2, 0)]  # any start order
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert results[0]["groups"] == [(0, 1), (0, 1, 2, 3)]
    assert results[3]["groups"] == [(2, 3), (0, 1, 2, 3)]
    for res in results.values():
        assert res["error"] == ""
        for members in res["groups"]:
            total, plan = res[members]
            assert total == sum(m + 1 for m in members)
            assert plan == {"step": 7, "from": members[0]}  # the leader's plan reached every member


@pytest.mark.slow
def test_two_nodes_build_separate_pools_on_their_own_stores():
    """Node a (engines 0, 1) and node b (engines 2, 3), each pool on its first engine's store: each engine builds
    its node's group only, and each group reduces over its own members."""
    ctx = mp.get_context("spawn")
    out, ports = ctx.Queue(), {0: free_port(), 2: free_port()}
    procs = [
        ctx.Process(target=_member, args=(e, 2, ports[first], out, first))
        for e, first in ((3, 2), (0, 0), (2, 2), (1, 0))
    ]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert {e: r["groups"] for e, r in results.items()} == {
        0: [(0, 1)],
        1: [(0, 1)],
        2: [(2, 3)],
        3: [(2, 3)],
    }
    assert results[0][(0, 1)][0] == 3.0 and results[3][(2, 3)][0] == 7.0


def _dies_or_waits(engine, port, out):
    pool = CommPool(engine, 2, "127.0.0.1", port, timeout_s=3).start()
    pool.ready.wait(60)
    g = pool.get((0, 1))
    if engine == 1:
        out.put("joined")
        return  # the process exits: a dead member
    time.sleep(1)
    t0 = time.monotonic()
    try:
        g.all_reduce(torch.ones(1))
        out.put(("no error", time.monotonic() - t0))
    except RuntimeError as exc:
        out.put(("error", time.monotonic() - t0, str(exc)[:80]))


@pytest.mark.slow
def test_a_dead_member_is_an_error_within_the_timeout_not_a_hang():
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_dies_or_waits, args=(e, port, out)) for e in (0, 1)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    verdict = next(x for x in got if x != "joined")
    assert verdict[0] == "error" and verdict[1] < 5


def _restartable(engine, port, launch_id, cmd, out):
    """A pool member driven by ``cmd``: "reduce" runs an all-reduce on (0, 1) and reports the sum; "exit" dies."""
    pool = CommPool(engine, 2, "127.0.0.1", port, timeout_s=5, launch_id=launch_id, watch_s=0.2).start()
    pool.ready.wait(60)
    while (what := cmd.get(timeout=120)) != "exit":
        deadline = time.monotonic() + 90  # (a restarted peer imports torch and rebuilds: slow on a busy host)
        while pool.built_for.get((0, 1), ("",))[engine ^ 1] != what:  # the peer's generation is in
            assert time.monotonic() < deadline, f"engine {engine} never saw peer launch {what}"
            time.sleep(0.05)
        x = torch.tensor([float(engine + 1)])
        pool.get((0, 1)).all_reduce(x)
        out.put((engine, x.item(), pool.rebuilds))


@pytest.mark.slow
@pytest.mark.parametrize("restarted", [1, 0], ids=["member", "store-host"])
def test_a_restarted_member_rejoins_its_groups(restarted):
    """Kill one engine's process and start a new one (a new launch id): the survivor rebuilds the group with it
    (engine 0 hosts the rendezvous store: when it restarts, the survivor reconnects to the new one)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    # a queue each way per process: a process killed just after a put can leave its queue's lock held (its feeder
    # thread releases it after the bytes are out), and a queue shared with the survivor would then block it
    cmds, outs = {e: ctx.Queue() for e in (0, 1)}, {e: ctx.Queue() for e in (0, 1)}
    ids = {0: "A0", 1: "A1"}
    procs = {e: ctx.Process(target=_restartable, args=(e, port, ids[e], cmds[e], outs[e])) for e in (0, 1)}
    for p in procs.values():
        p.start()

    def reduce_all():
        for e in (0, 1):
            cmds[e].put(ids[e ^ 1])
        return {e: (total, rebuilds) for e, total, rebuilds in (outs[e].get(timeout=120) for e in (0, 1))}

    try:
        assert {e: t for e, (t, _) in reduce_all().items()} == {0: 3.0, 1: 3.0}
        procs[restarted].kill()
        procs[restarted].join(10)
        ids[restarted] = "B" + str(restarted)
        cmds[restarted], outs[restarted] = ctx.Queue(), ctx.Queue()  # (the killed one's may be locked)
        procs[restarted] = ctx.Process(
            target=_restartable, args=(restarted, port, ids[restarted], cmds[restarted], outs[restarted])
        )
        procs[restarted].start()
        got = reduce_all()
        assert {e: t for e, (t, _) in got.items()} == {0: 3.0, 1: 3.0}
        assert got[restarted ^ 1][1] == 1, "the survivor rebuilt the group once"
        for e in (0, 1):
            cmds[e].put("exit")
        for p in procs.values():
            p.join(30)
    finally:  # a failure leaves no member behind (pytest would wait for it at exit)
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(10)


def _resettable(engine, port, out):
    """Engine 0 resets (0, 1) as if epoch 5 had failed on it; both then reduce once the group is rebuilt."""
    pool = CommPool(engine, 2, "127.0.0.1", port, timeout_s=5, watch_s=0.2).start()
    pool.ready.wait(60)
    refused = ""
    if engine == 0:
        time.sleep(0.5)  # engine 1 is blocked in a collective by now
        pool.reset(pool.get((0, 1)), 5)
        try:
            pool.get((0, 1))
        except RuntimeError as exc:
            refused = str(exc)
    else:  # waits in a collective its peer never joins: fails once the peer closes its side, not at the timeout
        t0 = time.monotonic()
        with contextlib.suppress(RuntimeError):
            pool.get((0, 1)).all_reduce(torch.ones(1))
        refused = f"{time.monotonic() - t0:.2f}"
    deadline = time.monotonic() + 30
    while pool.reset_for.get((0, 1)) != 5:  # rebuilt after the reset (engine 1 learns it from the store)
        if time.monotonic() > deadline:
            out.put((engine, "never rebuilt", refused))
            return
        time.sleep(0.05)
    x = torch.tensor([float(engine + 1)])
    pool.get((0, 1)).all_reduce(x)
    out.put((engine, (x.item(), pool.rebuilds), refused))


@pytest.mark.slow
def test_a_group_reset_after_a_failed_epoch_is_rebuilt_by_every_member():
    """A failed epoch leaves the group's pairs closed: the member that reports it refuses the group at once, and
    both members (the other learns it from the store) rebuild it on a fresh prefix, where it works again."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_resettable, args=(e, port, out)) for e in (0, 1)]
    for p in procs:
        p.start()
    got = {e: (res, refused) for e, res, refused in (out.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(30)
    assert got[0][0] == (3.0, 1) and got[1][0] == (3.0, 1), got
    assert "being rebuilt (epoch 5 failed on it)" in got[0][1]
    assert float(got[1][1]) < 3, f"the blocked peer failed after {got[1][1]} s (timeout 5 s)"


def test_members_that_keep_missing_each_other_still_build_the_group():
    """Both members retry their build of (0, 1) like the watcher (a 1 s pause after each failed try, timeout 1 s),
    engine 0 starting while engine 1 pauses after its first try. gloo leaves a rank's address under the prefix it
    built on: retries on one prefix would send each member to the address its peer just gave up on, in step,
    forever. The group must be built within a few tries."""
    import threading

    port = free_port()
    pools = [CommPool(e, 2, "127.0.0.1", port, timeout_s=1) for e in (0, 1)]
    for pool in pools:
        pool.store = pool._connect()
    ids = pools[0]._launch_ids((0, 1), wait=True)
    tries = {0: 0, 1: 0}

    def build(pool: CommPool, delay: float) -> None:
        time.sleep(delay)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            tries[pool.engine] += 1
            try:
                pool._build_group((0, 1), ids)
                return
            except Exception:  # noqa: BLE001 - retried like the watcher
                time.sleep(1.0)

    threads = [threading.Thread(target=build, args=(p, d)) for p, d in zip(pools, (1.3, 0.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all((0, 1) in p.groups for p in pools), f"never built (tries {tries})"
    assert max(tries.values()) <= 4, tries
    sums = [torch.tensor([float(e + 1)]) for e in (0, 1)]
    reducers = [threading.Thread(target=p.groups[(0, 1)].all_reduce, args=(x,)) for p, x in zip(pools, sums)]
    for t in reducers:
        t.start()
    for t in reducers:
        t.join(10)
    assert [x.item() for x in sums] == [3.0, 3.0]


def test_a_member_waiting_on_a_group_with_a_dead_member_gives_up_in_bounded_time():
    """Engine 2 of (0, 1, 2) is gone: the leader keeps opening rounds (its watcher, every second) that never
    complete. Engine 1 must still give up within three timeouts, not wait for ever on round after round, or it
    would never come back to rebuild its other groups."""
    import threading

    port = free_port()
    pools = [CommPool(e, 3, "127.0.0.1", port, timeout_s=1) for e in (0, 1)]
    for pool in pools:
        pool.store = pool._connect()
    pools[0]._connected().set("flying/launch/2", "gone")
    ids = pools[0]._launch_ids((0, 1, 2), wait=True)
    stop = threading.Event()

    def leader() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                pools[0]._rendezvous("g", (0, 1, 2), ids)

    got: list[BaseException] = []

    def follower() -> None:
        try:
            pools[1]._rendezvous("g", (0, 1, 2), ids)
        except BaseException as exc:  # noqa: BLE001 - checked below
            got.append(exc)

    threads = [threading.Thread(target=leader), threading.Thread(target=follower, daemon=True)]
    for t in threads:
        t.start()
    threads[1].join(8)
    stop.set()
    threads[0].join(10)
    assert not threads[1].is_alive(), "engine 1 still waits on rounds that never complete"
    assert len(got) == 1 and isinstance(got[0], TimeoutError) and "no round of g completed" in str(got[0])


@pytest.mark.parametrize(
    "message",
    [
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:63648: "
        "Connection reset by peer. This is typically caused by a remote worker hanging",
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:21007",
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation",
        "pooled group closed after a failed epoch; it is being rebuilt",
    ],
)
def test_peer_lost_knows_how_gloo_says_a_member_is_gone(message):
    assert peer_lost(RuntimeError(message))


def test_peer_lost_leaves_other_errors_to_their_tracebacks():
    assert not peer_lost(RuntimeError("shape '[4, 2]' is invalid for input of size 6"))
    assert not peer_lost(ValueError("follower out of KV: 4 free, 9 needed"))

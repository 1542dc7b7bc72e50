"""The communicator pool: every process group an engine can be bound into, built once at worker start.

A pool is one node's: it spans the node's N engines, ``first`` .. ``first + N - 1`` (engine indices are global,
each node numbers its own run of them). Merge sets are the aligned contiguous ranges of power-of-two widths over
them (N=4, first 0: (0,1), (2,3), (0,1,2,3); first 4: (4,5), (6,7), (4,5,6,7)) plus the full set when N is not a
power of two: linear in N; no set spans two nodes. Groups are built on a rendezvous ``TCPStore`` hosted by the
node's first engine,
each on its own ``PrefixStore``, directly as ``ProcessGroupGloo`` (and ``ProcessGroupNCCL`` for data on GPU) with no
default process group, so they never touch the engine's own SGLang world. Every engine builds the sets it belongs
to in one global order (width, then start), so no two engines wait on each other in a cycle. Nothing here runs on
a switch's critical path: a bind looks a group up by its member tuple.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import pickle
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal, cast, overload

import psutil
import torch
import torch.distributed as dist

from flying.groups import pool_sets

log = logging.getLogger("flying.comm_pool")


def _collectives(backend: dist.ProcessGroupGloo | dist.ProcessGroupNCCL) -> dist.ProcessGroup:
    """``backend`` as the collectives API it has at runtime: torch's stubs declare ``allreduce``, ``broadcast`` and
    ``allgather`` on ``ProcessGroup`` only, though gloo and NCCL backends (used here directly, without a default
    process group) have the same methods."""
    return cast(dist.ProcessGroup, backend)


# How gloo and NCCL say that the other end of a collective went away (its process stopped or was killed); the
# error is then the peer's fate, not a fault here, and its traceback (torch's internals) tells nothing more.
_PEER_GONE = (
    "connection reset by peer",
    "connection closed by peer",
    "socket closed",
    "broken pipe",
    "timed out",
    "remote process exited",
    "communicator was aborted",
    "pooled group closed",
)


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a group's collective, says that a member is gone rather than that this member
    went wrong."""
    text = str(exc).lower()
    return any(phrase in text for phrase in _PEER_GONE)


class _Closed:
    """What a closed group's collectives are: each call fails at once."""

    def __getattr__(self, name: str) -> object:
        raise RuntimeError("pooled group closed after a failed epoch; it is being rebuilt")


@dataclass
class MergedGroup:
    """One bound group as seen by one member: its rank, a data group (all-reduce) and a control group (step
    plans, acknowledgements). On CPU both are gloo; on GPU data is NCCL."""

    members: tuple[int, ...]
    rank: int
    data: dist.ProcessGroup
    control: dist.ProcessGroup
    spent_ms: dict[str, float] = field(default_factory=dict)  # time in each data collective, since built

    @property
    def rank_in_group(self) -> int:  # the names SGLang's linear layers read
        return self.rank

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def leader(self) -> int:
        return self.members[0]

    def close(self) -> None:
        """End this member's side of the group (its epoch failed): its process groups are released, which closes
        their connections, so a peer blocked in a collective fails at once instead of after the timeout. Every
        later collective here raises; the pool rebuilds the group on a fresh prefix."""
        data, control = self.data, self.control
        self.data = self.control = cast(dist.ProcessGroup, _Closed())
        if data is not control:  # NCCL data: abort its communicator
            with contextlib.suppress(Exception):
                data.abort()
        del data, control

    def _spent(self, kind: str, t0: float) -> None:
        self.spent_ms[kind] = self.spent_ms.get(kind, 0.0) + (time.perf_counter() - t0) * 1000

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        self.data.allreduce([tensor]).wait()
        self._spent("all_reduce", t0)
        return tensor

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> None:
        """Rows of ``inp`` to each rank by ``in_splits``, rows from each rank into ``out`` by ``out_splits`` (the
        data group: a sequence-parallel step's exchange, worker_ext.sequence_parallel)."""
        t0 = time.perf_counter()
        self.data.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions()).wait()
        self._spent("all_to_all", t0)

    def all_gather(self, out: list[torch.Tensor], inp: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.data.allgather([out], [inp]).wait()
        self._spent("all_gather", t0)

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0 sends ``obj``; every rank returns it. Pickle over the control group (length, then bytes)."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.control.broadcast([size], opts).wait()
        if self.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.control.broadcast([payload], opts).wait()
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def all_gather_object(self, obj: object) -> list:
        """Every rank's ``obj``, by rank. Pickle over the control group (lengths, then padded bytes)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in self.members]
        self.control.allgather([sizes], [torch.tensor([payload.numel()], dtype=torch.int64)]).wait()
        n = max(int(t.item()) for t in sizes)
        padded = torch.zeros(n, dtype=torch.uint8)
        padded[: payload.numel()] = payload
        got = [torch.empty(n, dtype=torch.uint8) for _ in self.members]
        self.control.allgather([got], [padded]).wait()
        return [pickle.loads(t[: int(k.item())].numpy().tobytes()) for t, k in zip(got, sizes)]


class NotInPool(KeyError):
    """A bind names engines this engine's pool does not span (another node's, or none's)."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass
class CommPool:
    """Every pooled group of one engine (its node's engines only), each built for one *generation*: its members'
    launch ids, announced in the rendezvous store. A restarted member's new id makes the survivors' watcher
    (:meth:`watch`) rebuild its groups off the serving path. A member that aborts an epoch resets the group
    (:meth:`reset`): every member rebuilds it on a fresh prefix, and binds over it are refused until then."""

    engine: int
    num_engines: int  # engines of the node's pool
    store_host: str
    store_port: int
    first: int = 0  # the node's first engine (it hosts the store)
    sets: list[tuple[int, ...]] = field(default_factory=list)
    timeout_s: float = 10.0
    device: str = "cpu"  # "cpu" (gloo only), or "cuda" / "cuda:N" (NCCL data groups on that device)
    launch_id: str = ""
    watch_s: float = 1.0
    groups: dict[tuple[int, ...], MergedGroup] = field(default_factory=dict)
    built_for: dict[tuple[int, ...], tuple[str, ...]] = field(default_factory=dict)  # the generation of each
    # the failed epoch each group was rebuilt after (0: none)
    reset_for: dict[tuple[int, ...], int] = field(default_factory=dict)
    rebuilds: int = 0
    # how long each NCCL communicator took to create (at build, off the serving path)
    connect_ms: dict[tuple[int, ...], float] = field(default_factory=dict)
    host_bytes: int = 0
    build_s: float = 0.0
    error: str = ""
    ready: threading.Event = field(default_factory=threading.Event)
    store: dist.Store | None = None
    # failed epochs reported by the serving thread (reset), until the group is rebuilt after them
    _resets: dict[tuple[int, ...], int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if not self.first <= self.engine < self.first + self.num_engines:
            raise ValueError(
                f"engine {self.engine} is not in its pool [{self.first}, {self.first + self.num_engines})"
            )
        if not self.sets:
            self.sets = pool_sets(self.first, self.num_engines)
        self.launch_id = self.launch_id or f"{psutil.Process().pid}-{time.time_ns()}"

    def mine(self) -> list[tuple[int, ...]]:
        return [s for s in self.sets if self.engine in s]

    def build(self) -> None:
        """Connect every group this engine belongs to (blocks until its peers join; run it off the serving
        path, see :meth:`start`)."""
        t0, rss0 = time.perf_counter(), psutil.Process().memory_info().rss
        try:
            self.store = self._connect()
            for members in self.mine():
                self._build_group(members, self._launch_ids(members, wait=True), self._reset_epoch(members))
        except Exception as exc:  # noqa: BLE001 - reported in the heartbeat, the engine keeps serving DP
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("communicator pool failed: %s", self.error)
        self.build_s = time.perf_counter() - t0
        self.host_bytes = max(0, psutil.Process().memory_info().rss - rss0)
        log.info(
            "communicator pool: %d groups %s in %.2f s, about %.1f MiB host memory",
            len(self.groups),
            list(self.groups),
            self.build_s,
            self.host_bytes / 2**20,
        )
        self.ready.set()

    def _connect(self) -> dist.Store:
        """The rendezvous store (the node's first engine hosts it), with this engine's launch id announced on it."""
        store = dist.TCPStore(
            self.store_host,
            self.store_port,
            is_master=self.engine == self.first,
            wait_for_workers=False,
            timeout=timedelta(seconds=max(self.timeout_s, 600)),
        )
        store.set(f"flying/launch/{self.engine}", self.launch_id)
        return store

    @overload
    def _launch_ids(self, members: tuple[int, ...], wait: Literal[True]) -> tuple[str, ...]: ...
    @overload
    def _launch_ids(self, members: tuple[int, ...], wait: bool) -> tuple[str, ...] | None: ...
    def _launch_ids(self, members: tuple[int, ...], wait: bool) -> tuple[str, ...] | None:
        """The members' announced launch ids (None if one has not announced and ``wait`` is False)."""
        store = self._connected()
        keys = [f"flying/launch/{m}" for m in members]
        if wait:
            store.wait(keys, timedelta(seconds=max(self.timeout_s, 600)))
        elif not store.check(keys):
            return None
        return tuple(store.get(k).decode() for k in keys)

    def _connected(self) -> dist.Store:
        if self.store is None:  # the first connection failed (build() reported it); watch() retries it
            raise RuntimeError("not connected to the rendezvous store")
        return self.store

    @staticmethod
    def _reset_key(members: tuple[int, ...]) -> str:
        return f"flying/reset/{'-'.join(map(str, members))}"

    def _reset_epoch(self, members: tuple[int, ...]) -> int:
        """The last failed epoch the store says ``members``' group was reset after (0: never)."""
        store, key = self._connected(), self._reset_key(members)
        return int(store.get(key)) if store.check([key]) else 0

    def reset(self, group: MergedGroup, epoch: int) -> None:
        """Epoch ``epoch`` failed on ``group`` here: close this member's side of it (peers blocked in it fail at
        once), have every member rebuild it (the watcher writes the epoch to the store), and refuse the group
        until it is rebuilt. Safe from any thread."""
        members = group.members
        group.close()
        if members not in self.groups:
            return
        with self._lock:
            self._resets[members] = max(epoch, self._resets.get(members, 0))
        log.warning("communicator pool: %s reset after epoch %d failed; rebuilding", members, epoch)

    def _publish_resets(self) -> None:
        with self._lock:
            resets = dict(self._resets)
        store = self._connected()
        for members, epoch in resets.items():
            if epoch > self._reset_epoch(members):
                store.set(self._reset_key(members), str(epoch))

    def _rendezvous(self, name: str, members: tuple[int, ...], ids: tuple[str, ...]) -> str:
        """A fresh store prefix for one build of ``members``' group, agreed while all of them are there (gloo
        leaves addresses under a prefix, so one a member gave up on is never reused). The leader opens a numbered
        round, collects every member's token within ``timeout_s`` and writes a go naming them; a member builds only
        on a go with its token. Both give up after a bounded wait, or when a member's launch id changes."""
        store, rank = self._connected(), members.index(self.engine)
        counter, token = f"{name}/round", uuid.uuid4().hex[:12]
        checked = time.monotonic()
        deadline = checked + (self.timeout_s if rank == 0 else 3 * self.timeout_s)

        def superseded() -> bool:
            nonlocal checked
            if time.monotonic() - checked < 0.5:
                return False
            checked = time.monotonic()
            return self._launch_ids(members, wait=False) != ids

        if rank == 0:
            n = store.add(counter, 1)
            answers = [f"{name}/{n}/here/{r}" for r in range(1, len(members))]
            while not store.check(answers):
                if time.monotonic() > deadline or superseded():
                    raise TimeoutError(f"{members}: not every member answered round {n} of {name}")
                time.sleep(0.02)
            store.set(f"{name}/{n}/go", ",".join(store.get(k).decode() for k in answers))
            return f"{name}/{n}"
        seen = 0
        while True:
            n = store.add(counter, 0)  # (reads the counter, 0 while no round was opened)
            if n > seen:  # a newer round: answer it
                store.set(f"{name}/{n}/here/{rank}", token)
                seen = n
            go = f"{name}/{seen}/go"
            if seen and store.check([go]) and token in store.get(go).decode().split(","):
                return f"{name}/{seen}"
            if time.monotonic() > deadline or superseded():
                raise TimeoutError(f"{members}: no round of {name} completed with this member in it")
            time.sleep(0.02)

    def _build_group(self, members: tuple[int, ...], ids: tuple[str, ...], reset: int = 0) -> None:
        store = self._connected()
        rank, size = members.index(self.engine), len(members)
        gen = hashlib.sha1(("/".join(ids) + f"/{reset}").encode()).hexdigest()[:12]
        name = self._rendezvous(f"flying/{'-'.join(map(str, members))}/{gen}", members, ids)
        timeout = timedelta(seconds=self.timeout_s)
        control = dist.ProcessGroupGloo(dist.PrefixStore(f"{name}/ctl", store), rank, size, timeout)
        data: dist.ProcessGroupGloo | dist.ProcessGroupNCCL = control
        if self.device.startswith("cuda"):
            # (the default options, spelled out)
            data = dist.ProcessGroupNCCL(
                dist.PrefixStore(f"{name}/nccl", store), rank, size, dist.ProcessGroupNCCL.Options()
            )
            self._connect_nccl(members, data)
        self.groups[members] = MergedGroup(members, rank, _collectives(data), _collectives(control))
        self.built_for[members] = ids
        self.reset_for[members] = reset
        with self._lock:
            if self._resets.get(members, 0) <= reset:
                self._resets.pop(members, None)

    def _connect_nccl(self, members: tuple[int, ...], data: dist.ProcessGroupNCCL) -> None:
        """Create the NCCL communicator now, off the serving path: ProcessGroupNCCL makes it lazily, at the first
        collective, which would otherwise be the first bound step (hundreds of ms). One all-reduce of one element
        on this engine's device; every member builds the same groups in the same order, so the calls pair up."""
        t0 = time.perf_counter()
        device = torch.device(self.device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        one = torch.zeros(1, device=device)
        _collectives(data).allreduce([one]).wait()
        torch.cuda.synchronize(device)
        self.connect_ms[members] = (time.perf_counter() - t0) * 1000

    def watch(self) -> None:
        """Rebuild the groups whose members' launch ids changed (a member restarted), in the global set order
        every engine uses; reconnect to the store if it is gone (the first engine restarted)."""
        while True:
            time.sleep(self.watch_s)
            try:
                self._publish_resets()
                for members in self.mine():
                    ids = self._launch_ids(members, wait=False)
                    if ids is None:
                        continue
                    reset, restarted = self._reset_epoch(members), ids != self.built_for.get(members)
                    if restarted or reset != self.reset_for.get(members, 0):
                        why = "a member restarted" if restarted else f"epoch {reset} failed"
                        log.info("communicator pool: rebuilding %s (%s)", members, why)
                        self._build_group(members, ids, reset)
                        self.rebuilds += 1
                        log.info("communicator pool: %s rebuilt", members)
                self.error = ""
            except Exception as exc:  # noqa: BLE001 - a peer or the store is gone: retry (on a fresh connection)
                self.error = f"{type(exc).__name__}: {str(exc)[:200]}"
                log.warning("communicator pool: %s; retrying", self.error)
                if self.engine != self.first:  # the first engine hosts the store: its own never goes away
                    with contextlib.suppress(Exception):
                        self.store = self._connect()

    def start(self) -> CommPool:
        def run() -> None:
            self.build()
            self.watch()

        threading.Thread(target=run, name="flying-comm-pool", daemon=True).start()
        return self

    def get(self, members: tuple[int, ...]) -> MergedGroup:
        if not self.ready.is_set():
            raise RuntimeError("communicator pool is still connecting")
        outside = [m for m in members if not self.first <= m < self.first + self.num_engines]
        if outside:
            raise NotInPool(
                f"engines {outside} are not in this node's pool (engines {self.first}.."
                f"{self.first + self.num_engines - 1}): a group binds engines of one node only"
            )
        if members not in self.groups:
            raise KeyError(f"no pooled group for {members}; pooled: {sorted(self.groups)}")
        with self._lock:
            failed = self._resets.get(members)
        if failed is not None:
            raise RuntimeError(f"pooled group {members} is being rebuilt (epoch {failed} failed on it)")
        return self.groups[members]

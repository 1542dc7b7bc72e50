"""The communicator pool: every process group an engine can be bound into, built once at worker start.

Merge sets are the aligned contiguous ranges of power-of-two widths (N=4: (0,1), (2,3), (0,1,2,3)) plus the full
set when N is not a power of two: linear in N. Groups are built on a rendezvous ``TCPStore`` hosted by engine 0,
each on its own ``PrefixStore``, directly as ``ProcessGroupGloo`` (and ``ProcessGroupNCCL`` for data on GPU) with no
default process group, so they never touch the engine's own SGLang world. Every engine builds the sets it belongs
to in one global order (width, then start), so no two engines wait on each other in a cycle. Nothing here runs on
a switch's critical path: a bind looks a group up by its member tuple.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist

from flying.groups import merge_sets

log = logging.getLogger("flying.comm_pool")


@dataclass
class MergedGroup:
    """One bound group as seen by one member: its rank, a data group (all-reduce) and a control group (step
    plans, acknowledgements). On CPU both are gloo; on GPU data is NCCL."""

    members: tuple[int, ...]
    rank: int
    data: dist.ProcessGroup
    control: dist.ProcessGroup

    @property
    def rank_in_group(self) -> int:  # the names SGLang's linear layers read
        return self.rank

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def leader(self) -> int:
        return self.members[0]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.data.allreduce([tensor]).wait()
        return tensor

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


@dataclass
class CommPool:
    engine: int
    num_engines: int
    store_host: str
    store_port: int
    sets: list[tuple[int, ...]] = field(default_factory=list)
    timeout_s: float = 10.0
    device: str = "cpu"
    groups: dict[tuple[int, ...], MergedGroup] = field(default_factory=dict)
    host_bytes: int = 0
    build_s: float = 0.0
    error: str = ""
    ready: threading.Event = field(default_factory=threading.Event)
    store: dist.Store | None = None

    def __post_init__(self) -> None:
        if not self.sets:
            self.sets = merge_sets(self.num_engines)

    def mine(self) -> list[tuple[int, ...]]:
        return [s for s in self.sets if self.engine in s]

    def build(self) -> None:
        """Connect every group this engine belongs to (blocks until its peers join; run it off the serving
        path, see :meth:`start`)."""
        t0, rss0 = time.perf_counter(), psutil.Process().memory_info().rss
        try:
            store = dist.TCPStore(
                self.store_host,
                self.store_port,
                is_master=self.engine == 0,
                wait_for_workers=False,
                timeout=timedelta(seconds=max(self.timeout_s, 600)),
            )
            timeout = timedelta(seconds=self.timeout_s)
            for members in self.mine():
                rank, size = members.index(self.engine), len(members)
                name = "-".join(map(str, members))
                control = dist.ProcessGroupGloo(
                    dist.PrefixStore(f"flying/{name}/ctl", store), rank, size, timeout
                )
                data = control
                if self.device == "cuda":
                    data = dist.ProcessGroupNCCL(dist.PrefixStore(f"flying/{name}/nccl", store), rank, size)
                self.groups[members] = MergedGroup(members, rank, data, control)
            self.store = store  # engine 0 hosts it; also carries soft-bind readiness
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

    def start(self) -> CommPool:
        threading.Thread(target=self.build, name="flying-comm-pool", daemon=True).start()
        return self

    def get(self, members: tuple[int, ...]) -> MergedGroup:
        if not self.ready.is_set():
            raise RuntimeError("communicator pool is still connecting")
        if members not in self.groups:
            raise KeyError(f"no pooled group for {members}; pooled: {sorted(self.groups)}")
        return self.groups[members]

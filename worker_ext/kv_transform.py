"""KV transformation inside one group: move head slices of in-flight requests among its members (Gyges, seed 002,
section 4.1), so a bind can adopt busy engines' DP requests and a release can hand TP requests back to DP, with no
recompute.

Layout (see worker_ext.kv_layout): at width d, physical slot p of a member's pool is viewed as the virtual slots
p*d .. p*d+d-1, virtual slot p*d+j holding heads [j*H/d, (j+1)*H/d) of p. A request's TP KV on rank k is its head
slice k, in virtual slots of rank k's own pool.

    adopt (DP request x of member r, physical slots P):     scatter (TP request x, back to DP on its owner o):
      rank r keeps slice r in place: virtual P*d + r          o takes fresh physical slots P'
      slice j != r is sent to rank j, into slots it carves     rank k sends its slice to o, into P'*d + k
      P*d + j (j != r) are then free virtual slots             (o copies its own slice locally)

Both are one ``Exchange``: for every layer, each rank gathers the slots it sends to each peer into one buffer, a
single all-to-all over the group's data communicator moves them, and each rank writes what it received into its
destination slots. Gathering precedes writing in every layer, so destination slots may reuse slots whose content
leaves in the same exchange (the phased reuse of Gyges: freed sibling slots take the incoming slices). The peak
extra memory is one layer's outgoing plus incoming slices, reported as ``peak_bytes``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
import torch
import torch.distributed as dist


@dataclass
class Exchange:
    """What one rank sends to and receives from every rank of its group (index = rank in group): virtual slot
    indices in its own width-d KV views. ``send[k]`` on rank r pairs, in order, with ``recv[r]`` on rank k."""

    width: int
    send: list[list[torch.Tensor]] = field(default_factory=list)
    recv: list[list[torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.send = self.send or [[] for _ in range(self.width)]
        self.recv = self.recv or [[] for _ in range(self.width)]

    def tokens_out(self, rank: int) -> int:
        return sum(int(t.numel()) for k, ts in enumerate(self.send) if k != rank for t in ts)


@dataclass(frozen=True)
class ExchangeStats:
    tokens: int  # token slices this rank sent to other ranks (local copies not counted)
    ms: float
    peak_bytes: int  # the largest per-layer send + receive buffer


def _cat(ts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.cat(ts).to(device) if ts else torch.empty(0, dtype=torch.int64, device=device)


def run_exchange(
    group: dist.ProcessGroup,
    rank: int,
    ex: Exchange,
    k_views: list[torch.Tensor],
    v_views: list[torch.Tensor],
) -> ExchangeStats:
    """Move the slices of ``ex`` for every layer: one all-to-all per layer (K and V together)."""
    t0 = time.perf_counter()
    device = k_views[0].device
    send = [_cat(ts, device) for ts in ex.send]
    recv = [_cat(ts, device) for ts in ex.recv]
    send_all, recv_all = torch.cat(send), torch.cat(recv)
    in_splits, out_splits = [int(t.numel()) for t in send], [int(t.numel()) for t in recv]
    peak = 0
    for k_buf, v_buf in zip(k_views, v_views):
        inp = torch.stack((k_buf[send_all], v_buf[send_all]), dim=1).contiguous()
        out = torch.empty((recv_all.numel(), *inp.shape[1:]), dtype=inp.dtype, device=device)
        group.alltoall_base(
            out, inp, out_splits, in_splits, dist.AllToAllOptions()
        ).wait()  # every rank, always
        k_buf[recv_all] = out[:, 0]
        v_buf[recv_all] = out[:, 1]
        peak = max(peak, inp.nbytes + out.nbytes)
    return ExchangeStats(ex.tokens_out(rank), (time.perf_counter() - t0) * 1000, peak)


# --- plans: which slots go where, computed identically on every rank from the same gathered manifests ---------


class Held(msgspec.Struct, frozen=True):
    """One request's KV as the group sees it before a transformation: ``rank`` holds it (adopt: the member it runs
    on in DP; scatter: the member that owns it and takes it back), ``length`` tokens of KV, the first ``shared`` of
    them in slots its holder's prefix tree owns (adopt: read in place, never carved; see
    worker_ext.sglang_patches.prefix_cache)."""

    rid: str
    rank: int
    length: int
    shared: int = 0


def adopt_fits(held: list[Held], available: list[int], width: int) -> list[int]:
    """Ranks that cannot hold the slices an adoption sends them: each rank carves, for every other rank's request,
    ``length`` virtual slots, from its free virtual slots (``available``, at width ``width``) plus the sibling slots
    its own requests free (not those of tree-owned slots: other requests may read them)."""
    short = []
    for k in range(width):
        need = sum(h.length for h in held if h.rank != k)
        freed = (width - 1) * sum(h.length - h.shared for h in held if h.rank == k)
        if need > available[k] + freed:
            short.append(k)
    return short


def plan_adopt(held: list[Held], rank: int, width: int, own: dict, take_over, alloc) -> tuple[Exchange, dict]:
    """This rank's part of an adoption. ``own[rid]``: physical slots of this rank's own requests; ``take_over``
    (physical, keep) -> kept virtual slots; ``alloc(n)`` -> n free virtual slots. Returns the exchange and, per
    request, this rank's virtual slots for its slice (in token order). The first ``shared`` slots of an own request
    belong to this rank's prefix tree: its slice of them is read in place and their siblings stay as they are."""
    ex, slots = Exchange(width), {}
    for h in held:  # first free the siblings of every own request, so the carving below can reuse them
        if h.rank == rank and h.length:
            phys = own[h.rid]
            kept = phys[: h.shared].to(torch.int64) * width + rank
            slots[h.rid] = torch.cat((kept, take_over(phys[h.shared :], rank)))
            for j in range(width):
                if j != rank:
                    ex.send[j].append(phys.to(torch.int64) * width + j)
    for h in held:
        if h.rank != rank and h.length:
            got = alloc(h.length)
            assert got is not None, f"no KV for {h.length} tokens of {h.rid} (adopt_fits should have said)"
            slots[h.rid] = got
            ex.recv[h.rank].append(got)
    return ex, slots


def scatter_placement(held: list[Held], free_physical: list[int]) -> set[str]:
    """Requests that go back to DP on their owner with their KV: in order, while the owner's free physical slots
    hold them. The others are retracted there (recomputed)."""
    left, placed = list(free_physical), set()
    for h in held:
        if h.length <= left[h.rank]:
            left[h.rank] -= h.length
            placed.add(h.rid)
    return placed


def plan_scatter(
    held: list[Held], placed: set[str], rank: int, width: int, mine: dict, alloc_physical
) -> tuple[Exchange, dict]:
    """This rank's part of a scatter. ``mine[rid]``: this rank's virtual slots of each TP request (its slice);
    ``alloc_physical(n)`` -> n free physical slots. Returns the exchange and the physical slots this rank takes
    for the requests it owns."""
    ex, taken = Exchange(width), {}
    for h in held:
        if h.rid not in placed or not h.length:
            continue
        ex.send[h.rank].append(mine[h.rid])
        if h.rank == rank:
            phys = alloc_physical(h.length)
            assert phys is not None, f"no physical KV for {h.rid} (scatter_placement should have said)"
            taken[h.rid] = phys
            for k in range(width):
                ex.recv[k].append(phys.to(torch.int64) * width + k)
    return ex, taken

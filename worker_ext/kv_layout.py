"""The KV block-size adaptor (paper eq. 3): one physical KV pool, a per-request layout.

A physical slot p holds H KV heads of one token. A request executed at width d keeps only its rank's H/d heads,
so the same bytes are viewed as d virtual slots p*d .. p*d+d-1 of H/d heads each: ``buffer.view(S*d, H/d, D)``.
The view is exact (no copy) because the buffer is contiguous in (slot, head, dim). DP requests keep physical
slots, TP requests virtual ones, both carved from the engine's one allocator: a switch changes metadata only.

Invariant (the stale-layout bug of prior work): for every width, the slot a token is written to is the slot
attention reads; both go through :func:`view` with the request's own width, never a cached one.
"""

from __future__ import annotations

import torch


def view(buffer: torch.Tensor, width: int) -> torch.Tensor:
    """``(S, H, D)`` -> ``(S*width, H/width, D)`` over the same storage."""
    if width == 1:
        return buffer
    s, h, d = buffer.shape
    if h % width:
        raise ValueError(f"{h} KV heads are not divisible by width {width}")
    if not buffer.is_contiguous():
        raise ValueError("KV buffer must be contiguous to be re-viewed")
    return buffer.view(s * width, h // width, d)


class SubSlotAllocator:
    """Virtual slots of one width, carved from physical slots of a base allocator.

    ``base`` needs ``alloc(n) -> Tensor | None``, ``free(Tensor)``, ``available_size() -> int`` (SGLang's
    token allocators have them). A physical slot goes back to ``base`` once all of its ``width`` virtual slots are
    free. Slots of different requests may share a physical slot; they never share a virtual one.
    """

    def __init__(self, base, width: int) -> None:
        self.base, self.width = base, width
        self.free_virtual: list[int] = []
        self.used: dict[int, int] = {}  # physical slot -> virtual slots in use
        self.reserve = 0  # virtual slots kept out of available_size() (see keep_back)
        # a group leader with a prefix cache logs its frees: its followers free their copies of those slots
        self.free_log: list[int] | None = None
        # a follower under such a leader: the leader's virtual slot -> this member's slot holding its head slice
        self.aliases: dict[int, int] = {}

    def available_size(self) -> int:
        """Free virtual slots less the reserve: negative while the reserve exceeds them, so that SGLang's
        eviction, which asks the tree for ``need - available_size()``, frees what the reserve covers too (at zero
        it would evict one step's worth and still find no room)."""
        return self.base.available_size() * self.width + len(self.free_virtual) - self.reserve

    def keep_back(self, n: int) -> None:
        """Report ``n`` virtual slots fewer than are free: a group's leader keeps back the room its tightest
        member lacks (free and evictable), so that SGLang's own checks (admission, retraction) plan no step a
        member cannot carve slots for. Allocation itself is not limited."""
        self.reserve = max(0, n)

    def alloc(self, n: int) -> torch.Tensor | None:
        need = n - len(self.free_virtual)
        if need > 0:
            phys = self.base.alloc(-(-need // self.width))
            if phys is None:
                return None
            for p in phys.tolist():
                self.used[p] = 0
                self.free_virtual += [p * self.width + j for j in range(self.width)]
        out, self.free_virtual = self.free_virtual[:n], self.free_virtual[n:]
        for v in out:
            self.used[v // self.width] += 1
        return torch.tensor(out, dtype=torch.int64)

    def free(self, virtual: torch.Tensor) -> None:
        back = []
        freed = virtual.tolist()
        if self.free_log is not None:
            self.free_log += freed
        for v in freed:
            p = v // self.width
            self.used[p] -= 1
            self.free_virtual.append(v)
            if self.used[p] == 0:
                back.append(p)
        if back:
            gone = set(back)
            self.free_virtual = [v for v in self.free_virtual if v // self.width not in gone]
            for p in back:
                del self.used[p]
            self.base.free(torch.tensor(back, dtype=torch.int64))

    def take_over(self, physical: torch.Tensor, keep: int) -> torch.Tensor:
        """Adopt physical slots a DP request holds in ``base``: virtual slot ``p*width + keep`` of each stays in
        use (the head slice this rank keeps in place), the other ``width - 1`` become free virtual slots. Returns
        the kept virtual slots. The physical slots go back to ``base`` once all of their virtual slots are free."""
        assert 0 <= keep < self.width, f"keep {keep} outside width {self.width}"
        for p in physical.tolist():
            assert p not in self.used, f"physical slot {p} is already carved"
            self.used[p] = 1
            self.free_virtual += [p * self.width + j for j in range(self.width) if j != keep]
        return physical.to(torch.int64) * self.width + keep

    def take_freed(self) -> list[int]:
        """The virtual slots freed since the last call (logged: see ``free_log``)."""
        out, self.free_log = self.free_log or [], [] if self.free_log is not None else None
        return out

    def physical_in_use(self) -> int:
        return len(self.used)

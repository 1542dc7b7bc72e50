"""A bound group's own prefix tree (pinned: ``SUPPORTED_SGLANG``, ``RadixCache``).

The leader's scheduler forms every batch of the group, so one tree on the leader serves the group: SGLang's
``RadixCache`` over the engine allocator while the sub-slot allocator is installed, so its values are the group's
virtual slots. A TP request matches against it at admission, is checkpointed into it after its prefill and at its
end (as SGLang does for DP requests), and the tree evicts with SGLang's policy when the allocator runs short. Its
nodes are ``TreeNode`` objects while the engine's own tree hands out integer node ids: the engine tree's methods,
patched for the epoch (:func:`worker_ext.sglang_patches.prefix_cache.bypass`), pass a call on to this tree when
its node is one of these. DP requests the group adopted never enter it.

Followers hold their head slice of every virtual slot the leader's requests and tree use at slots of their own
(``SubSlotAllocator.aliases``): each plan carries the leader's new slots, the slots of a prefix a request starts
from, and the slots the leader freed since the last plan (``SubSlotAllocator.free_log``), which the followers free.
A checkpoint that finds part of a request's KV already in the tree frees the request's duplicates and points its
row at the tree's slots: every message carries those new row entries (:meth:`GroupCache.take_repoints`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class GroupCache:
    """The leader's tree for one epoch (kept with the epoch's sub-slot allocator when the epoch parks)."""

    def __init__(self, scheduler: Any) -> None:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode

        self.node_type: type = TreeNode
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=scheduler.req_to_token_pool,
            token_to_kv_pool_allocator=scheduler.token_to_kv_pool_allocator,
            page_size=int(scheduler.tree_cache.page_size),
            eviction_policy=getattr(scheduler.server_args, "radix_eviction_policy", "lru"),
        )
        self.tree = RadixCache(params)
        self.adopted: set[str] = set()  # never matched nor inserted
        self.matched: set[str] = set()  # started from a cached prefix, not yet in a plan
        self._repointed: dict[
            str, tuple[Any, int, int]
        ] = {}  # rid -> (req, first, end) of row entries changed

    def holds(self, node: Any) -> bool:
        """``node`` is one of this tree's (else the engine tree's)."""
        return isinstance(node, self.node_type)

    def serves(self, req: Any) -> bool:
        return req is not None and req.rid not in self.adopted

    def match_prefix(self, params: Any) -> Any:
        result = self.tree.match_prefix(params)
        if result.device_prefix_len:
            self.matched.add(params.req.rid)
        return result

    def checkpoint(self, req: Any, up_to: int) -> None:
        """SGLang's checkpoint into this tree, noting the row entries it pointed at other slots (duplicates)."""
        row, lo = req.kv.req_pool_idx, int(req.kv.cache_protected_len)
        table = self.tree.req_to_token_pool.req_to_token
        before = table[row, lo:up_to].clone()
        self.tree.checkpoint(req, up_to=up_to)
        hi = int(req.kv.cache_protected_len)
        changed = (table[row, lo:hi] != before[: hi - lo]).nonzero().flatten().tolist()
        if changed:
            first, end = lo + changed[0], lo + changed[-1] + 1
            _, f0, e0 = self._repointed.get(req.rid, (req, first, end))
            self._repointed[req.rid] = (req, min(first, f0), max(end, e0))

    def take_repoints(self) -> dict[str, tuple[int, list[int]]]:
        """Row entries checkpoints pointed at the tree's slots since the last call, per request still holding its
        row: (first position, the leader's slots from there)."""
        table = self.tree.req_to_token_pool.req_to_token
        out = {
            rid: (first, table[req.kv.req_pool_idx, first:end].tolist())
            for rid, (req, first, end) in self._repointed.items()
            if req.kv.holds_kv and not req.finished()
        }
        self._repointed.clear()
        return out

    def evictable(self) -> int:
        return int(self.tree.evictable_size())

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked prefixes for ``num_tokens`` virtual slots (SGLang's policy); returns those freed."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        return int(self.tree.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted)

    def let_go(self, req: Any) -> None:
        """``req`` no longer reads the tree (a parked epoch's request ends): drop its lock."""
        if getattr(req, "lock", None) is not None and self.holds(req.lock.node):
            self.tree.unlock(req.lock)
            req.lock = None

    def drop(self, free: Callable[[torch.Tensor], None] | None = None) -> int:
        """Free every slot the tree holds (no request reads them any more), through ``free`` (default: the
        engine allocator, the sub-slot allocator installed); returns how many."""
        values = []
        stack = [self.tree.root_node]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.tree.root_node and len(node.value):
                values.append(node.value)
        self.tree.reset()
        if values:
            slots = torch.cat(values)
            (free or self.tree.token_to_kv_pool_allocator.free)(slots)
            return int(slots.numel())
        return 0

    def plan_slots(self, scheduler: Any, forward_batch: Any) -> tuple[list[int], dict[str, list[int]]]:
        """A forward's slots as its plan carries them: the leader's new slots (``out_cache_loc``, in batch
        order) and, per request starting from a prefix this tree cached, the slots of that prefix."""
        prefixes: dict[str, list[int]] = {}
        rids = list(forward_batch.rids or [])
        if self.matched and forward_batch.forward_mode.is_extend():
            rows = forward_batch.req_pool_indices.tolist()
            starts = list(forward_batch.extend_prefix_lens_cpu or [])
            table = scheduler.req_to_token_pool.req_to_token
            for rid, row, start in zip(rids, rows, starts):
                if rid in self.matched and start:
                    prefixes[rid] = table[row, :start].tolist()
        self.matched -= set(rids)
        return forward_batch.out_cache_loc.tolist(), prefixes

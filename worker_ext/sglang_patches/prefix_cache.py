"""The engine's prefix tree while it is bound (pinned: ``SUPPORTED_SGLANG``, ``UnifiedRadixCache``).

In DP the radix tree works as on stock SGLang: its values are physical KV slots, shared by the DP requests whose
prompts match (a running request's prompt is in the tree, locked, from its first step on). A bind views the same
pool at the group's width and carves TP slots from the free physical slots (worker_ext.kv_layout), so for the
epoch (:func:`bypass`, undone by :func:`restore`):

- TP requests bypass the tree: a TP-layout slot never enters it. On the group's leader they match against, and
  are checkpointed into, the group's own tree (worker_ext.sglang_patches.group_cache), whose values are virtual
  slots; the engine tree's methods pass every call about one of that tree's nodes on to it. Elsewhere (and for
  DP requests the group adopted) matching, inserting and checkpointing answer what a tree built with
  ``--disable-radix-cache`` answers;
- the tree keeps its DP content and counts and frees in physical slots: its own eviction path runs when the
  group needs memory (asked in virtual slots, ``ceil(n / width)`` physical slots evicted), and it reports its
  evictable KV to the scheduler's budget in virtual slots (``width`` per physical slot);
- a TP request's own slots go back through the engine's allocator (the sub-slot allocator, virtual slots);
- when the allocator runs short the group's tree evicts first (virtual slots), then the engine's tree;
- nodes locked by paused DP requests, and by DP requests the group adopted (whose cached prompt stays where it
  is: each member reads its head slice of it in place, see :func:`shared_len`), stay locked: never evicted,
  never carved.

After the release the tree is the same tree: a DP request that reuses a prefix cached before the bind reads the
same KV it would have read without the epoch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from worker_ext.sglang_patches import require
from worker_ext.sglang_patches.group_cache import GroupCache
from worker_ext.sglang_patches.memory_pool import BaseAllocator

# Tree methods answered as a disabled tree answers them while bound (TP requests neither hit nor fill the tree).
_AS_DISABLED = ("match_prefix", "touch_prefix", "insert", "checkpoint")
_SCALED = ("evictable_size", "full_evictable_size")  # physical slots -> virtual ones
_EVICT = ("evict", "evict_for_alloc")
# Calls about one node, answered by the group's tree when the node is one of its own.
_BY_NODE = ("lock", "inc_lock_ref", "dec_lock_ref", "path_device_indices", "rotation_base_of")
_PATCHED = (*_AS_DISABLED, *_SCALED, *_EVICT, "free_kv_row")
_GROUP = (*_BY_NODE, "is_root", "unlock", "prefix_device_indices", "dfs_weight_order", "on_release")


def enabled(scheduler: Any) -> bool:
    """The engine shares prefixes (its radix cache is on)."""
    t = scheduler.tree_cache
    return t is not None and bool(t.supports_prefix_sharing())


def shared_len(req: Any) -> int:
    """Leading KV tokens of ``req`` that the tree owns (its cached prompt, locked by the request): shared with
    other requests, so they are read where they are and never freed or carved as the request's own."""
    return int(req.kv.cache_protected_len) if req.kv.holds_kv else 0


class PhysicalView:
    """The engine allocator as the bound engine's tree sees it: physical slots (the tree's values are DP-layout
    slots), everything else the allocator's own. A request's eviction demand still arrives in virtual slots
    (``evict_to_free_tokens`` is the engine allocator's)."""

    def __init__(self, allocator: Any, base: BaseAllocator) -> None:
        self.engine_allocator, self._base = allocator, base

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine_allocator, name)

    def available_size(self) -> int:
        return int(self._base.available_size())

    full_available_size = available_size

    def free(self, index: torch.Tensor) -> None:
        if index.numel():
            self._base.free(index)

    def free_segment(self, index: torch.Tensor, *, start_pos: int = 0) -> None:
        self.free(index)

    free_full_segment = free_segment

    def free_segments(self, segments: Any) -> None:
        for index, _ in segments:
            self.free(index)

    free_full_segments = free_segments

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> Any:
        return self.engine_allocator.evict_to_free_tokens(tree_cache, num_tokens)


def bypass(scheduler: Any, base: BaseAllocator, width: int, group: GroupCache | None = None) -> None:
    """Apply the epoch's rules (module docstring) to the engine's tree, at the group's ``width`` (``group``: the
    leader's tree of the group's own prefixes). Call after the sub-slot allocator is installed; a no-op when the
    radix cache is off."""
    if not enabled(scheduler):
        return
    t = scheduler.tree_cache
    cls = type(t)
    require(all(callable(getattr(cls, n, None)) for n in (*_PATCHED, *_GROUP)), "prefix tree API")
    assert "match_prefix" not in t.__dict__, "tree already bypassed"
    engine_allocator = t.token_to_kv_pool_allocator
    view = PhysicalView(engine_allocator, base)
    t.token_to_kv_pool_allocator = view

    def as_disabled(name: str) -> Any:
        method = getattr(cls, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            t.disable = True
            try:
                return method(t, *args, **kwargs)
            finally:
                t.disable = False

        return call

    def scaled(name: str) -> Any:
        method = getattr(cls, name)
        return lambda: int(method(t)) * width + (group.evictable() if group is not None else 0)

    def evicting(name: str) -> Any:
        method = getattr(cls, name)

        def call(params: Any, *args: Any, **kwargs: Any) -> Any:
            got = group.evict(params.num_tokens) if group is not None and params.num_tokens > 0 else 0
            physical = dataclasses.replace(
                params, num_tokens=math.ceil(max(0, params.num_tokens - got) / width)
            )
            result = method(t, physical, *args, **kwargs)
            result.num_tokens_evicted = result.num_tokens_evicted * width + got
            return result

        return call

    def free_kv_row(kv: Any, ranges: list[tuple[int, int]]) -> None:
        t.token_to_kv_pool_allocator = engine_allocator  # a request's own slots: virtual
        try:
            cls.free_kv_row(t, kv, ranges)
        finally:
            t.token_to_kv_pool_allocator = view

    for name in _AS_DISABLED:
        setattr(t, name, as_disabled(name))
    for name in _SCALED:
        setattr(t, name, scaled(name))
    for name in _EVICT:
        setattr(t, name, evicting(name))
    t.free_kv_row = free_kv_row
    if group is not None:
        _route_to_group(t, group, as_disabled)


def _route_to_group(t: Any, group: GroupCache, as_disabled: Any) -> None:
    """The engine tree's calls about a TP request, or one of the group tree's nodes, go to the group's tree."""
    cls, g = type(t), group.tree
    t._flying_group = group
    disabled = {name: as_disabled(name) for name in ("match_prefix", "checkpoint")}

    def by_node(name: str) -> Any:
        method, ours = getattr(cls, name), getattr(g, name)
        return lambda node, *a, **kw: ours(node) if group.holds(node) else method(t, node, *a, **kw)

    def match_prefix(params: Any) -> Any:
        return group.match_prefix(params) if group.serves(params.req) else disabled["match_prefix"](params)

    def checkpoint(req: Any, **kwargs: Any) -> Any:
        if group.holds(req.last_node):
            return group.checkpoint(req, kwargs["up_to"])
        return disabled["checkpoint"](req, **kwargs)

    def unlock(lock: Any) -> None:
        if lock is not None and group.holds(lock.node):
            g.unlock(lock)
        else:
            cls.unlock(t, lock)

    def prefix_device_indices(req: Any) -> torch.Tensor:
        return (
            g.prefix_device_indices(req) if group.holds(req.last_node) else cls.prefix_device_indices(t, req)
        )

    def dfs_weight_order(nodes: Any) -> list[int]:
        if any(group.holds(n) for n in nodes):  # a mixed queue: keep its order
            return list(range(len(nodes)))
        return list(cls.dfs_weight_order(t, nodes))

    def on_release(req: Any, **kwargs: Any) -> None:
        if not group.holds(getattr(req, "last_node", None)):
            cls.on_release(t, req, **kwargs)

    for name in _BY_NODE:
        setattr(t, name, by_node(name))
    t.is_root = lambda node: node is g.root_node if group.holds(node) else cls.is_root(t, node)
    t.match_prefix, t.checkpoint, t.unlock = match_prefix, checkpoint, unlock
    t.touch_prefix = g.touch_prefix
    t.prefix_device_indices, t.dfs_weight_order, t.on_release = (
        prefix_device_indices,
        dfs_weight_order,
        on_release,
    )


def group_cache(scheduler: Any) -> GroupCache | None:
    """The group's tree while the engine leads a bound group with one, else None."""
    t = scheduler.tree_cache
    got = t.__dict__.get("_flying_group") if t is not None else None
    return got if isinstance(got, GroupCache) else None


def _bypassed(scheduler: Any) -> PhysicalView | None:
    """The tree's allocator view while :func:`bypass` is applied, else None."""
    t = scheduler.tree_cache
    view = t.__dict__.get("token_to_kv_pool_allocator") if t is not None else None
    return view if isinstance(view, PhysicalView) else None


def restore(scheduler: Any) -> None:
    """The tree as SGLang made it (after the sub-slot allocator is gone)."""
    t, view = scheduler.tree_cache, _bypassed(scheduler)
    if view is None:
        return
    for name in (*_PATCHED, *_GROUP, "_flying_group"):
        t.__dict__.pop(name, None)
    t.token_to_kv_pool_allocator = view.engine_allocator


def evict_physical(scheduler: Any, num_tokens: int) -> None:
    """Bound: make ``num_tokens`` physical slots free, evicting unlocked tree content if needed."""
    t, view = scheduler.tree_cache, _bypassed(scheduler)
    if view is None:
        return
    short = num_tokens - view.available_size()
    if short > 0:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        type(t).evict(t, EvictParams(num_tokens=short))


def evictable_physical(scheduler: Any) -> int:
    """Bound: physical slots the tree could give back."""
    t = scheduler.tree_cache
    return int(type(t).evictable_size(t)) if _bypassed(scheduler) is not None else 0


def make_room(scheduler: Any, num_tokens: int) -> None:
    """Bound: evict until the engine allocator can give ``num_tokens`` (virtual) slots, as the scheduler does
    before its own allocations."""
    if enabled(scheduler):
        scheduler.token_to_kv_pool_allocator.evict_to_free_tokens(scheduler.tree_cache, num_tokens)


def let_go(scheduler: Any, req: Any) -> None:
    """``req`` no longer reads the tree's copy of its prefix (it ended elsewhere, or its KV was copied to slots of
    its own): drop its lock so the prefix can be evicted again, and count its whole row as its own."""
    t = scheduler.tree_cache
    if t is None or getattr(req, "lock", None) is None:
        return
    t.unlock(req.lock)
    req.lock = None
    req.last_node = t.root_node_handle(extra_key=req.extra_key)
    if req.kv.holds_kv:
        req.kv.cache_protected_len = 0
        req.kv.cache_inserted_len = 0


class PrefixCacheTally:
    """Prompt tokens and prefix-cache hits of the requests this engine streamed to their end, since it started:
    per request ``len(origin_input_ids)`` and SGLang's ``Req.cached_tokens`` (what its usage reports as
    ``prompt_tokens_details.cached_tokens``), counted once, when its last output goes out."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def count(self, reqs: list) -> None:
        for req in reqs:
            if req.finished() and not getattr(req, "_flying_tallied", False):
                req._flying_tallied = True
                self.prompt_tokens += len(req.origin_input_ids)
                self.cached_tokens += int(req.cached_tokens)


tally = PrefixCacheTally()  # one scheduler per process

"""Which engines may form a tensor-parallel group: the merge sets the communicator pool builds and the policy picks
from. Pure functions, shared by the workers (worker_ext.comm_pool) and the router (router.policy)."""

from __future__ import annotations


def merge_sets(num_engines: int, widths: tuple[int, ...] | None = None) -> list[tuple[int, ...]]:
    """Aligned contiguous groups of power-of-two widths (plus the full set), ordered by (width, first member)."""
    if widths is None:
        widths = tuple(w for w in (2**k for k in range(1, num_engines.bit_length())) if w <= num_engines)
        if num_engines > 1 and num_engines not in widths:
            widths += (num_engines,)
    out = []
    for w in sorted(set(widths)):
        if w < 2 or w > num_engines:
            raise ValueError(f"merge width {w} is outside 2..{num_engines}")
        out += [tuple(range(s, s + w)) for s in range(0, num_engines - w + 1, w)]
    return out


def widths(num_engines: int) -> list[int]:
    """The group widths available with ``num_engines`` engines, ascending (1 = a lone DP engine)."""
    return [1] + sorted({len(m) for m in merge_sets(num_engines)})


def pooled_limit(num_engines: int, per_engine_tokens: int) -> int:
    """The most KV tokens one request can use: the widest group's pooled KV (one engine's without groups)."""
    return max(widths(num_engines)) * per_engine_tokens


def pool_sets(first: int, num_engines: int, widths: tuple[int, ...] | None = None) -> list[tuple[int, ...]]:
    """The merge sets of one node's pool, which spans engines ``first`` .. ``first + num_engines - 1``: those of
    :func:`merge_sets` offset by ``first`` (a group never spans two nodes)."""
    return [tuple(first + m for m in ms) for ms in merge_sets(num_engines, widths)]

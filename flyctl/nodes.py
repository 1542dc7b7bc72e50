"""Nodes as flyctl shows and checks them: engines grouped by the node their heartbeat announces, and the rule that
a group binds engines of one node's communicator pool only."""

from __future__ import annotations

from collections.abc import Mapping

from flying.messages import Heartbeat


def by_node(beats: Mapping[int, Heartbeat]) -> dict[str, dict[int, Heartbeat]]:
    """The live engines' heartbeats by node (nodes in the order of their first engine, engines in order)."""
    out: dict[str, dict[int, Heartbeat]] = {}
    for e in sorted(beats):
        out.setdefault(beats[e].node, {})[e] = beats[e]
    return out


def node_header(node: str, beats: Mapping[int, Heartbeat]) -> str:
    """One node's line above its engines: its name and its pool's span as the heartbeats report it."""
    pools = sorted({(hb.pool_first, hb.num_engines) for hb in beats.values()})
    spans = ", ".join(
        f"{f}..{f + n - 1}" if n > 1 else "none (cannot bind: no --comm-port)" for f, n in pools
    )
    return f"node {node or '(unnamed)'}: {len(beats)} live, pool engines {spans}"


def cross_node(beats: Mapping[int, Heartbeat], members: tuple[int, ...]) -> str:
    """Why ``members`` cannot form one group as the live heartbeats show them ('' if nothing says they cannot):
    one is not live (no engine by that index, or one down: the router would drop the group at once), they are on
    different nodes, or one is outside another's pool."""
    if down := [m for m in members if m not in beats]:
        return f"engines {down} are not live (no heartbeat; flyctl status lists the engines)"
    live = {m: beats[m] for m in members}
    nodes = {hb.node for hb in live.values()}
    if len(nodes) > 1:
        where = ", ".join(f"{m} on {hb.node or '(unnamed)'}" for m, hb in live.items())
        return f"engines {where}: a group binds engines of one node only"
    for m, hb in live.items():
        first, n = hb.pool_first, hb.num_engines
        if n <= 1 and len(members) > 1:
            return (
                f"engine {m} has no communicator pool: its flying-worker was started without --comm-port (give "
                "every engine of the node the same --comm-port and --num-engines to let them bind)"
            )
        if outside := [x for x in members if not first <= x < first + n]:
            return (
                f"engines {outside} are not in engine {m}'s pool on node {hb.node or '(unnamed)'} "
                f"(engines {first}..{first + n - 1}): a group binds engines of one node only"
            )
    return ""

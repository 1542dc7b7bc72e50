"""Every message that crosses a process boundary, as msgspec structs, with one encoder and decoder."""

from __future__ import annotations

from typing import Literal, TypeVar

import msgspec

from flying.prefix import decode_chain

Priority = Literal["high", "normal", "low"]
PRIORITY_CLASS: dict[str, int] = {"high": 0, "normal": 1, "low": 2}
RequestState = Literal["queued", "assigned", "done", "failed", "cancelled"]
S = TypeVar("S", bound=msgspec.Struct)


class QueuedRequest(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What the gateway admits into the global queue (stored as the fields of the request hash)."""

    id: str
    priority: Priority = "normal"
    model: str
    prompt_tokens: int
    max_tokens: int
    gateway: str
    enqueued_at: float
    seq: int = 0
    attempts: int = 0
    failed_on: int = -1  # the engine it was last dispatched to that failed before answering (-1: none)
    suspect: int = 0  # engines that died holding it (flying:suspects): one more and it is not tried again
    n: int = 1  # choices (SGLang runs them as n requests sharing the prompt: rids ``{id}_{i}``)
    prefix: str = ""  # the prompt's block-hash chain (flying.prefix.encode_chain; "": shorter than one block)
    keyed: bool = False  # the chain starts with the hash of the client's cache key (prompt_cache_key)
    # constrained decoding (a grammar: JSON mode or schema, a forced tool call, regex, EBNF): a bound group's
    # follower cannot hand it to its leader (the grammar's state lives in its own process), so it goes to a
    # group's leader or to a DP engine
    leader_only: bool = False

    @property
    def chain(self) -> tuple[int, ...]:
        """The prompt's cumulative block hashes (flying.prefix), for cache-aware dispatch."""
        return decode_chain(self.prefix)

    @property
    def kv_tokens(self) -> int:
        """KV cache tokens the request can occupy at its end (the prompt's counted once: SGLang caches it)."""
        return self.prompt_tokens + self.n * self.max_tokens

    def engine_rids(self) -> list[str]:
        """The request ids SGLang knows its current attempt by (what an abort names)."""
        return engine_rids(engine_rid(self.id, self.attempts), self.n)


def engine_rid(request_id: str, attempt: int = 0) -> str:
    """The SGLang rid of a request's ``attempt``-th dispatch (0: the first; each re-dispatch after an engine
    failed counts one): ``<id>~<attempt>``. SGLang's abort of a rid also ends every rid that begins with it; ``~``
    is in no request id, so no other request's rid begins with this one (a reused client id's ``<id>-<hex>``
    included), nor, below ten attempts, another attempt's."""
    return f"{request_id}~{attempt}"


def split_engine_rid(rid: str) -> tuple[str, int | None]:
    """An SGLang rid -> (the request id, the attempt), a choice's (``<id>~<attempt>_<i>``, :func:`engine_rids`)
    included; a rid not made by :func:`engine_rid` -> (rid, None)."""
    base, sep, tail = rid.rpartition("~")
    attempt, under, choice = tail.partition("_")
    if sep and attempt.isdigit() and (not under or choice.isdigit()):
        return base, int(attempt)
    return rid, None


def engine_rids(rid: str, n: int = 1) -> list[str]:
    """SGLang runs a request of ``n`` choices as ``n`` requests, ``{rid}_{i}``; of one choice, as ``rid``."""
    return [rid] if n == 1 else [f"{rid}_{i}" for i in range(n)]


class Assignment(msgspec.Struct, frozen=True, kw_only=True):
    """Router -> gateway: request ``id`` runs on engine ``engine`` at ``url``."""

    id: str
    engine: int
    url: str
    queue_ms: float


class FastTarget(msgspec.Struct, frozen=True, kw_only=True):
    """Router -> gateways' admission script (``flying:router:fast``): where a short request arriving before the
    next round goes at once, without waiting for that round, while the queue is empty (a high-priority one only to
    a bound group's member, where the round would put it too): to
    ``engine`` (a member of a bound group when ``epoch`` > 0) while its inflight set holds fewer than ``cap`` requests and
    the request's KV (prompt + max_tokens) is at most ``max_kv``. ``affinity``: a request carrying a prefix chain
    (``QueuedRequest.prefix``) does not take it: the router places it by prefix (cache-aware DP dispatch)."""

    engine: int
    url: str
    epoch: int = 0
    cap: int
    max_kv: int
    affinity: bool = False
    follower: bool = False  # a bound group's follower: no request that is leader_only


class StepCost(msgspec.Struct, frozen=True, array_like=True):
    """What an engine's forwards of one kind have cost since it started (``worker_ext.step_costs``): ``mode``
    (dp, tp or sp) at ``width`` engines, the ``n`` steps whose batched tokens fell in one power-of-two bucket, their
    mean ``tokens`` and mean milliseconds ``ms``. The router fits its cost model to them (``router.cost_fit``)."""

    mode: str
    width: int
    n: int
    tokens: float
    ms: float


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True):
    """Worker -> Redis (``flying:worker:{i}``, PX 3000): a snapshot of the engine written every 50 ms, and at once
    when its mode, epoch or pending bind changes (worker_ext.heartbeat)."""

    engine: int
    url: str
    pid: int
    model: str
    launch_id: str = ""
    mode: Literal["dp", "tp"] = "dp"
    epoch: int = 0  # the bound epoch (0: none)
    pending: int = 0  # a bind this engine has read and not yet applied (0: none): its acknowledgement
    group: tuple[int, ...] = ()  # members of the bound group; the first is the leader
    width: int = 1
    bind_ms: float = 0.0  # last bind: command applied at a step boundary -> group ready
    release_ms: float = 0.0  # last release: command applied -> DP layout restored
    switch_error: str = ""  # why the last epoch was aborted, if it was
    comm_groups: int = 0  # pooled communicators built (see worker_ext.comm_pool)
    comm_rebuilds: int = 0  # groups rebuilt because a member restarted
    pool_ready: bool = True  # its communicator pool is built (False: still connecting, so it refuses binds)
    num_engines: int = 1  # engines the pool was built for (merge sets); 1: this engine cannot bind
    kv_transform: bool = False  # applies Bind.adopt / Release.scatter (moves KV head slices within a group)
    mixed_steps: bool = False  # applies Bind.keep: bound, it runs its own DP requests in the group's steps
    # applies Release.park and Bind.resume (parks a group's requests, KV kept, and resumes them)
    park: bool = False
    parked: tuple[
        int, ...
    ] = ()  # epochs whose requests are parked here (their KV head slices kept, no steps)
    transform_ms: float = 0.0  # last KV transformation (adopt or scatter) on this engine: exchange time
    transform_tokens: int = 0  # token head-slices it sent to other members
    # peak extra memory of its exchange (one layer's outgoing + incoming slices)
    transform_peak_bytes: int = 0
    # requests its last scatter could not place on their owner (recomputed there)
    transform_retracted: int = 0
    # bytes over the unique storages of the model's parameters (constant across switches)
    param_bytes: int = 0
    steps_tp: int = 0  # forwards this engine ran as a bound group's member in TP mode, since it started ...
    steps_sp: int = 0  # ... and in SP mode (sequence-parallel prefill, worker_ext.sequence_parallel)
    device: str = ""  # what its forwards run on: "cpu" or "cuda" ("": an older worker)
    sp_threshold: int = 0  # its --sp-threshold: a group's steps of this many batched tokens run SP (0: never)
    step_costs: tuple[StepCost, ...] = ()  # its forwards' measured cost by mode, width and size
    comm_ms: dict[str, float] = {}  # its bound group's time in each data collective (all_reduce, all_to_all,
    # all_gather), since the group was built
    running: int = 0
    waiting: int = 0
    paused: int = 0  # DP requests a bind set aside here (hard preemption, or an adoption that could not move
    # them): neither running nor waiting, they resume at the release
    free_kv_tokens: int = 0
    max_total_tokens: int = 0  # this engine's own KV tokens (also while bound: the group has width x this)
    context_len: int = 0
    max_running_requests: int = 0
    prompt_tokens: int = 0  # prompt tokens of the requests the engine finished since it started ...
    cached_tokens: int = 0  # ... and how many of them its prefix cache held (SGLang's cached_tokens)
    step: int = 0
    ts: float = 0.0
    # the node (host) it runs on: a group only binds engines of one node ("": a one-node record)
    node: str = ""
    pool_first: int = 0  # the first engine of its node's communicator pool: the pool spans engines
    # pool_first .. pool_first + num_engines - 1 and its merge sets are flying.groups.pool_sets(pool_first, ...)

    @property
    def cache_hit_rate(self) -> float | None:
        """Share of the finished requests' prompt tokens found in the prefix cache (None: none finished)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


class CrashReport(msgspec.Struct, frozen=True, kw_only=True):
    """Worker -> gateways (``flying:crash:{i}``): engine ``engine``'s scheduler raised ``error`` at ``at`` and is
    going down. ``batch``: the SGLang rids of the batches it was running (or whose output it was processing) when
    it raised, empty when it raised elsewhere in its loop; ``held``: every rid it held then (the batches'
    included). What the gateways make of it: :mod:`flying.crashes`."""

    engine: int
    launch_id: str = ""
    at: float
    error: str
    batch: tuple[str, ...] = ()
    held: tuple[str, ...] = ()


_encoder = msgspec.json.Encoder()


def encode(msg: msgspec.Struct | list[msgspec.Struct]) -> bytes:
    return _encoder.encode(msg)


Preempt = Literal["hard", "sequential", "soft"]


class Bind(msgspec.Struct, frozen=True, kw_only=True, tag="bind"):
    """Router/operator -> every member's command stream: bind ``members`` into one TP group of ``width``.

    ``adopt``: at the next clean step boundary every member's running and waiting DP requests become the group's
    TP requests, their KV transformed in place (each member keeps its own head slice and sends the others to
    their ranks; no recompute). ``keep``: the members' DP requests stay theirs and keep running, in DP, beside the
    group's: each member runs its own DP batch and its slice of the group's tokens in one (sequence-parallel) step,
    with its full weights, until its DP work has finished (engines whose heartbeat reports ``mixed_steps``).
    Without either, ``preempt`` says what happens to the members' DP work."""

    epoch: int
    members: tuple[int, ...]
    preempt: Preempt = "hard"
    adopt: bool = False
    keep: bool = False
    resume: int = 0  # continue the requests parked at the release of this epoch (the same members, in order)
    # steps of at least this many batched tokens run sequence-parallel (0: never;
    sp_threshold: int | None = None
    # None: the leader engine's own --sp-threshold)

    @property
    def width(self) -> int:
        return len(self.members)


class Release(msgspec.Struct, frozen=True, kw_only=True, tag="release"):
    """Router/operator -> every member: end ``epoch`` and return to DP once its TP requests have finished. At
    once instead: ``retract`` recomputes them in DP on the leader; ``scatter`` moves each, with its KV, to the
    member that owns it (retracted there if it does not fit); ``park`` scatters those an owner can hold and keeps
    the others' KV head slices where they are, stepping no more, until a bind with ``resume`` set to this epoch
    continues them (a release of a parked epoch aborts them)."""

    epoch: int
    retract: bool = False
    scatter: bool = False
    park: bool = False

    @property
    def kind(self) -> ReleaseKind:
        if self.park:
            return "park"
        return "scatter" if self.scatter else "retract" if self.retract else "wait"


# how a release treats the group's TP requests: they finish in it first (wait), recomputed in DP on the leader
# (retract), continue in DP on their owners, KV moved (scatter), or as scatter with those no owner holds parked
ReleaseKind = Literal["wait", "retract", "scatter", "park"]
Command = Bind | Release

GroupReason = Literal["load", "priority", "long", "manual"]
GroupState = Literal["binding", "bound", "releasing", "parked"]


class Group(msgspec.Struct, frozen=True, kw_only=True):
    """The router's record of one TP group (``flying:groups``, field = epoch). Written before its commands are
    sent, so a restarted router knows every group that may exist."""

    epoch: int
    members: tuple[int, ...]
    reason: GroupReason
    preempt: Preempt = "hard"
    state: GroupState = "binding"
    since: float = 0.0  # when it entered ``state`` (router clock, epoch seconds)
    last_used: float = 0.0  # last TP dispatch to it (or its creation)
    kv_cap: int = 0  # KV tokens its TP requests may use (hard: what the members had free; 0: all of their KV)
    adopt: bool = False  # bound by adoption (Bind.adopt): the members' DP requests became its TP requests
    keep: bool = False  # bound with the members' DP requests kept running beside its steps (Bind.keep)
    # released with Release.park: once released, its parked requests keep the record ("parked")
    park: bool = False
    hold: bool = False  # it serves a high-priority request no engine holds alone: never parked
    # the parked epochs whose requests it continues, oldest first (Bind.resume: the last); their requests count as
    # its own (their inflight records name the epoch they were dispatched to)
    carries: tuple[int, ...] = ()
    # a parked record: its parked requests the router has counted in the inflight sets (0: none seen yet, as of
    # requests sent to an engine directly); once it had some and has none left, their clients are gone
    parked_requests: int = 0
    released: ReleaseKind = "wait"  # releasing: how (the router's release, or flyctl's)

    @property
    def resumes(self) -> int:
        """The epoch whose parked requests its bind resumes (0: none)."""
        return self.carries[-1] if self.carries else 0

    @property
    def width(self) -> int:
        return len(self.members)

    @property
    def leader(self) -> int:
        return self.members[0]


class RouterState(msgspec.Struct, frozen=True, kw_only=True):
    """Load-adaptation state (``flying:router:state``), so a restarted router keeps its regime."""

    busy: bool = True  # every node's planned width is 1 (DP everywhere); False: some node binds load groups
    changed_at: float = 0.0  # when ``busy`` last changed
    widths: dict[
        str, int
    ] = {}  # node (its name, or its first engine) -> its planned load width (router.regime)
    planned_at: float = 0.0  # when the widths were planned (0: never)
    # the router binds groups for requests one engine cannot hold (gateways admit them)
    long_context: bool = True
    suspect: dict[int, float] = {}  # engine -> until when it is not picked for a bind (it failed one)
    rate: float = 0.0  # admissions per second, exponentially weighted (the planner's arrivals)
    prompt_rate: float = 0.0  # ... their prompt tokens per second
    output_rate: float = 0.0  # ... their max_tokens per second
    high_rate: float = 0.0  # ... high-priority admissions per second
    dispatched_rate: float = 0.0  # prompt tokens dispatched per second ...
    reused_rate: float = 0.0  # ... and those a prefix cache of their node could have held (router.reuse)
    reuse: tuple[int, int] = (0, 0)  # the router's (dispatched, reused) counters at rate_ts
    rate_ts: float = 0.0  # when the rates were last updated (0: never)
    # the counters (``flying:stats`` admitted, admitted_prompt_tokens, admitted_output_tokens,
    admitted: int = 0
    prompt_tokens: int = 0  # admitted_high) at that time
    output_tokens: int = 0
    high: int = 0
    recent: dict[int, float] = {}  # engine -> DP dispatches, exponentially decayed (router.round.SPREAD_S)
    long_waits: dict[str, float] = {}  # long requests waiting for calm -> since when (router.long_wait)
    # how long a long request of normal or low priority may wait for calm (PolicyConfig.long_wait_s; 0: it does not
    # wait): gateways let such a request wait up to twice that, beyond their wait budgets (read by gateways)
    long_wait_s: float = 0.0


DecisionKind = Literal["bind", "release", "regime", "distrust", "wait"]


class DecisionEvent(msgspec.Struct, frozen=True, kw_only=True):
    """Router -> Redis (``flying:router:decisions``, a capped stream): one entry of the router's decision log, as it
    applies a round: a bind, a release, a change of the load regime, engines left out of binds. ``text`` is the
    router's log line for it, made from the policy's note (why); the other fields are for readers that act on it:
    ``epoch`` and ``members`` of a bind or release (of a distrust: the engines), the group's ``reason``, a
    release's ``cause`` (``router.decision.ReleaseCause``'s value) and ``busy`` for a regime change; ``wait``: a
    long request began or ended its wait for calm (``cause``: ``router.decision.WaitCause``'s value)."""

    ts: float
    kind: DecisionKind
    text: str
    epoch: int = 0
    members: tuple[int, ...] = ()
    reason: str = ""
    cause: str = ""
    busy: bool = False


def decode_command(data: bytes | str) -> Command:
    cmd: Command = msgspec.json.decode(data, type=Command)
    return cmd


def decode(data: bytes | str, type_: type[S]) -> S:
    return msgspec.json.decode(data, type=type_)


def to_hash(msg: msgspec.Struct) -> dict[str, str]:
    """Struct -> flat Redis hash fields (all strings), readable with redis-cli HGETALL."""
    return {k: str(v) for k, v in msgspec.structs.asdict(msg).items()}


def from_hash(fields: dict[str, str], type_: type[S]) -> S:
    """Redis hash fields -> struct (extra fields such as ``state`` are ignored)."""
    names = set(type_.__struct_fields__)
    return msgspec.convert({k: v for k, v in fields.items() if k in names}, type_, strict=False)


class GroupLost(msgspec.Struct, frozen=True, kw_only=True):
    """Worker -> gateway, through SGLang: how a worker ends the TP requests of a group that lost a member (an
    abort finish reason with this status and type; SGLang answers a non-streaming request with the status and ends
    a stream with an abort event or an error event carrying it), so the gateway can re-dispatch or resume them."""

    message: str = "tensor-parallel group lost a member; request aborted"
    status: int = 503
    err_type: str = "ServiceUnavailable"


GROUP_LOST = GroupLost()
# a request its group set aside before its first token, when the group was parked for a burst (worker_ext.parking):
# nothing failed, so the gateway queues it again without counting an attempt
GROUP_PARKED = GroupLost(
    message="its tensor-parallel group was parked for a burst before its first token; request aborted"
)
# a constrained request (QueuedRequest.leader_only) that reached a bound group's follower (sent to it directly, or
# while it was binding): it cannot run there; nothing failed, so the gateway queues it again uncounted
GROUP_LEADER_ONLY = GroupLost(
    message="this engine follows a tensor-parallel group and cannot run a constrained (grammar) request: send it "
    "to the group's leader, or again once the group is released"
)
# gave up before its first token, nothing failed
UNCOUNTED = (
    GROUP_PARKED.message,
    GROUP_LEADER_ONLY.message,
)


def uncounted(why: str) -> bool:
    """An engine's give-up text says nothing failed (:data:`UNCOUNTED`): the request is queued again without
    using an attempt."""
    return any(m in why for m in UNCOUNTED)


class GaveUp(msgspec.Struct, frozen=True):
    """An engine gave up on a request: why, and whether because its TP group lost a member (the engine itself is
    fine: not a failure of its own)."""

    why: str
    group_lost: bool = False
    parked: bool = False  # set aside before its first token (GROUP_PARKED, GROUP_LEADER_ONLY): not an attempt that failed


def engine_gave_up(event: object) -> GaveUp | None:
    """Whether an engine's SSE event (decoded JSON) says it gave up on the request: an error event with the
    GROUP_LOST status (its group lost a member), or any abort finish (SGLang's end of a request aborted on the
    engine); None if it does not."""
    if isinstance(event, dict):
        err = event.get("error")
        if isinstance(err, dict) and err.get("code") in (
            GROUP_LOST.status,
            str(GROUP_LOST.status),
            "SERVICE_UNAVAILABLE",
        ):
            why = str(err.get("message", GROUP_LOST.status))
            return GaveUp(why, group_lost=True, parked=uncounted(why))
        if any(c.get("finish_reason") == "abort" for c in event.get("choices") or ()):
            return GaveUp("aborted")
    return None

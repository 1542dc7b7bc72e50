"""The simulator's engine model: a continuous-batching scheduler (:class:`Unit`) per DP engine or TP group, an
engine (:class:`Engine`) that reads bind and release commands as a worker does (:func:`worker_ext.intake.intake`),
and a bound group (:class:`SimGroup`) with its adoption and scatter. Step times come from :mod:`flying.cost_model`.
The event loop that drives them is :class:`sim.simulator.Simulator`, seen here through :class:`Host`."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Literal, Protocol

from flying.cost_model import causal_pairs
from flying.messages import Bind, Heartbeat, QueuedRequest, Release
from flying.prefix import BLOCK
from router.engine_view import EngineView
from router.transform_cost import adopt_moves, scatter_moves
from sim.config import SimConfig
from sim.prefix_cache import PrefixCache
from sim.workload import SimRequest
from worker_ext.intake import Intake, intake


class Host(Protocol):
    """What the engine model needs from the event loop (:class:`sim.simulator.Simulator`)."""

    cfg: SimConfig
    now: float
    engines: list[Engine]
    stats: collections.Counter[str]
    shift_steps: list[tuple[float, float, bool]]

    @property
    def kv_per_engine(self) -> int: ...

    def at(self, t: float, fn: Callable, *args) -> None: ...

    def finish(self, r: Req) -> None: ...

    def arrive(self, b: Bind, idx: int) -> None: ...

    def dissolve(self, g: SimGroup) -> None: ...

    @property
    def parked(self) -> dict[int, tuple[tuple[int, ...], list[Req]]]: ...

    def park(self, g: SimGroup, reqs: list[Req]) -> None: ...

    def unpark(self, epoch: int) -> list[Req]: ...

    def requeue(self, r: Req) -> None: ...

    def discard(self, epoch: int) -> None: ...

    def note_states(self) -> None: ...

    def note_transform(self, kind: str, ms: float, requests: int) -> None: ...


class Req:
    __slots__ = (
        "i",
        "spec",
        "q",
        "engine",
        "epoch",
        "prefilled",
        "generated",
        "started",
        "times",
        "done",
        "lost",
        "cached",
    )

    def __init__(self, i: int, spec: SimRequest, q: QueuedRequest) -> None:
        self.i, self.spec, self.q = i, spec, q
        self.engine, self.epoch = -1, 0
        self.prefilled = self.generated = 0
        self.cached = 0  # prompt tokens its engine's prefix cache held when it started
        self.started = float("nan")
        self.times: list[float] = []
        self.done = False
        self.lost = False  # ended unserved: its parked group lost a member

    @property
    def kv(self) -> int:
        return self.spec.prompt + self.spec.output


class Unit:
    """One scheduler: a DP engine, or a group run by its leader (under ``shift``, every engine's one scheduler)."""

    def __init__(
        self,
        sim: Host,
        width: int,
        kv_cap: int,
        merged: bool,
        on_idle: Callable[[], None],
        shift: bool = False,
        cache: PrefixCache | None = None,
        sp_threshold: int = 0,
    ) -> None:
        self.sim, self.width, self.kv_cap, self.merged, self.on_idle = sim, width, kv_cap, merged, on_idle
        self.shift = shift
        self.sp_threshold = sp_threshold  # a bound group: prefill steps of at least this many tokens run SP
        self.cache = cache  # its prefix cache (a DP engine's, or a group's own over its KV)
        # a shift scheduler runs as much per GPU as a DP engine; a bound group's SP steps batch a DP engine's chunk
        # per member (each member runs 1/width of the step's tokens)
        scale = width if shift or sp_threshold else 1
        chunk_scale = width if shift or sp_threshold else 1
        self.max_running = sim.cfg.cost.max_running * scale
        self.chunk_tokens = sim.cfg.cost.chunk_tokens * chunk_scale
        self.queue: list[Req] = []
        self.running: list[Req] = []
        self.kv_used = 0
        self.stepping = False
        self.admit = True

    def has_work(self) -> bool:
        return bool(self.running or (self.queue and self.admit))

    def reopen(self, kv_cap: int) -> None:
        """Admit again, within ``kv_cap`` (its engine left a group)."""
        self.admit, self.kv_cap = True, kv_cap

    def startable(self) -> bool:
        """Its queue's head could start, now or once its running requests end (it fits the KV it may use)."""
        return bool(self.queue) and self.queue[0].kv <= self.kv_cap

    def select(self) -> tuple[list[tuple[Req, int]], list[Req], int, int] | None:
        """Admit what fits, then the next step's work: (prefill chunks, decoding requests, prefill tokens, decode
        context tokens); None if nothing runs (idle, or the head does not fit yet)."""
        now = self.sim.now
        while (
            self.admit
            and self.queue
            and len(self.running) < self.max_running
            and self.kv_used + self.queue[0].kv <= self.kv_cap
        ):
            r = self.queue.pop(0)
            self.running.append(r)
            self.kv_used += r.kv
            r.started = now
            if self.cache is not None and r.prefilled == r.generated == 0:
                r.cached = r.prefilled = min(self.cache.hit(r.spec.prompt_blocks) * BLOCK, r.spec.prompt - 1)
        if not self.running:
            return None  # idle (or the head does not fit yet); the next dispatch or finish pokes it
        budget, prefill, decode = self.chunk_tokens, [], []
        for r in self.running:
            if r.prefilled < r.spec.prompt:
                take = min(budget, r.spec.prompt - r.prefilled)
                if take:
                    prefill.append((r, take))
                    budget -= take
            else:
                decode.append(r)
        ctx = sum(r.prefilled + r.generated for r in decode)
        return prefill, decode, self.chunk_tokens - budget, ctx

    def step(self) -> None:
        work = self.select()
        if work is None:
            return
        prefill, decode, tokens, ctx = work
        ms = self.step_ms(tokens, len(decode), ctx, attn_pairs(prefill))
        self.stepping = True
        self.sim.at(self.sim.now + ms / 1000, self.end_step, prefill, decode)

    def step_ms(self, prefill_tokens: int, decode_seqs: int, ctx: int, pairs: float = 0.0) -> float:
        cost = self.sim.cfg.cost
        if not self.shift:
            tokens = prefill_tokens + decode_seqs
            if self.sp_threshold and tokens >= max(self.sp_threshold, self.width):
                # the worker's choose_mode: SP above the threshold, as shift's base
                self.sim.stats["sp_steps"] += 1
                return cost.sp_step_ms(self.width, prefill_tokens, decode_seqs, ctx, pairs)
            if self.width > 1 and self.merged:
                self.sim.stats["tp_steps"] += 1
            return cost.step_ms(self.width, prefill_tokens, decode_seqs, ctx, self.merged, pairs)
        ms, shifted = cost.shift_step_ms(
            self.width, self.sim.cfg.shift_threshold, prefill_tokens, decode_seqs, ctx, pairs
        )
        self.sim.shift_steps.append((self.sim.now, ms / 1000, shifted))
        return ms

    def end_step(self, prefill: list[tuple[Req, int]], decode: list[Req]) -> None:
        now = self.sim.now
        self.stepping = False
        for r, take in prefill:
            r.prefilled += take
            if r.prefilled == r.spec.prompt:  # first token (or, after a retraction, the next one)
                r.generated += 1
                r.times.append(now)
                if self.cache is not None:
                    self.cache.insert(r.spec.prompt_blocks, self.cache_room())
        for r in decode:
            r.generated += 1
            r.times.append(now)
        for r in [r for r in self.running if r.generated >= r.spec.output]:
            self.running.remove(r)
            self.kv_used -= r.kv
            if self.cache is not None:
                # prompt and answer, as SGLang caches them
                self.cache.insert(r.spec.blocks, self.cache_room())
            self.sim.finish(r)
        self.on_idle()

    def cache_room(self) -> int:
        """KV tokens the prefix cache may hold: all of it but the outputs the running requests reserve (their
        prompts are in the cache)."""
        return self.kv_cap - sum(r.spec.output for r in self.running)


class Engine:
    def __init__(self, sim: Host, idx: int) -> None:
        self.sim, self.idx = sim, idx
        self.cache = PrefixCache()
        self.dp = Unit(sim, 1, sim.kv_per_engine, False, self.boundary, cache=self.cache)
        self.pending: Bind | None = None
        self.arrived = 0  # the epoch whose group this engine waits to form
        self.last_epoch = 0
        self.group: SimGroup | None = None
        self.paused_queue: list[Req] = []
        self.paused_running: list[Req] = []
        self.parked: dict[
            int, int
        ] = {}  # parked epoch -> the KV tokens its requests hold here (their head slices)
        # requests assigned to it (DP, paused, adopted, and TP when it leads a group): it owns them
        self.assigned = 0
        self.beat_ts = 0.0
        self._view: tuple[tuple, EngineView] | None = None  # (what it was built from, the view)
        # running, waiting: for the group it waits to form
        self.adopted: tuple[list[Req], list[Req]] = ([], [])

    @property
    def mode(self) -> Literal["dp", "tp"]:
        return "tp" if self.group else "dp"

    @property
    def state(self) -> str:
        """For the mode track: dp, binding (a bind read, the group not formed yet), tp<width>, releasing."""
        g = self.group
        if g is None:
            return "binding" if self.pending else "dp"
        if g.release_asked:
            return "releasing"
        return f"tp{len(g.members)}" if g.formed else "binding"

    @property
    def paused(self) -> int:
        return len(self.paused_running) + len(self.paused_queue)

    @property
    def transforms(self) -> bool:
        return self.sim.cfg.kv_transform and self.idx not in self.sim.cfg.no_kv_transform

    @property
    def mixed(self) -> bool:
        """It applies Bind.keep: bound, it runs its own DP requests in the group's steps."""
        return self.sim.cfg.mixed_steps

    @property
    def parked_kv(self) -> int:
        return sum(self.parked.values())

    def heartbeat(self) -> Heartbeat:
        """What a worker would publish now (the fields the router reads)."""
        g, kv = self.group, self.sim.kv_per_engine
        return Heartbeat(
            engine=self.idx,
            url=f"sim://{self.idx}",
            pid=0,
            model="sim",
            mode=self.mode,
            epoch=g.epoch if g else 0,
            pending=self.pending.epoch if self.pending else 0,
            num_engines=self.sim.cfg.per_node,
            node=f"node{self.sim.cfg.node_of(self.idx)}" if self.sim.cfg.nodes > 1 else "",
            pool_first=self.sim.cfg.node_of(self.idx) * self.sim.cfg.per_node,
            kv_transform=self.transforms,
            mixed_steps=self.mixed,
            park=self.sim.cfg.park,
            parked=tuple(self.parked),
            free_kv_tokens=kv - self.dp.kv_used - self.parked_kv,
            max_total_tokens=kv,
            ts=self.beat_ts,
            running=self.decoding(),
            waiting=self.prefilling(),
        )

    def reported_unit(self) -> Unit | None:
        """The scheduler its heartbeat reports: its DP unit, or, as a bound group's leader, the group's."""
        g = self.group
        return g.unit if g is not None and g.members[0] == self.idx else None if g is not None else self.dp

    def decoding(self) -> int:
        """Sequences its running batch decodes (prefill done), as SGLang's ``running``."""
        unit = self.reported_unit()
        return 0 if unit is None else sum(1 for r in unit.running if r.prefilled >= r.spec.prompt)

    def prefilling(self) -> int:
        """Requests not prefilled yet, as SGLang's ``waiting`` (its queue, and those admitted mid-prefill)."""
        unit = self.reported_unit()
        if unit is None:
            return 0
        return len(unit.queue) + sum(1 for r in unit.running if r.prefilled < r.spec.prompt)

    def view(self) -> EngineView:
        """The router's view of this engine, from the heartbeat it would publish now (kept while nothing the
        heartbeat carries changed: a round's snapshot reads every engine, most of them unchanged since the
        last round)."""
        g = self.group
        pending = self.pending.epoch if self.pending else 0
        key = (
            self.mode,
            g.epoch if g else 0,
            pending,
            self.dp.kv_used,
            self.beat_ts,
            self.assigned,
            tuple(self.parked),
            self.decoding(),
            self.prefilling(),
        )
        if self._view is None or self._view[0] != key:
            self._view = (key, EngineView.from_heartbeat(self.heartbeat(), self.assigned))
        return self._view[1]

    def command(self, cmd: Bind | Release) -> None:
        """The worker's own intake rule (:func:`worker_ext.intake.intake`); width changes are not modelled (the
        policy issues none)."""
        self.beat_ts = self.sim.now
        g, pending = self.group, self.pending
        what = intake(cmd, self.idx, self.last_epoch, g.epoch if g else 0, pending.epoch if pending else 0)
        if what is Intake.BIND and g is None:
            assert isinstance(cmd, Bind)  # intake answers BIND to binds only
            if any(e == self.idx and a <= self.sim.now < b for e, a, b in self.sim.cfg.ignore_binds):
                return
            self.pending = cmd
        elif what is Intake.CANCEL:
            self.pending, self.arrived, self.last_epoch = None, 0, max(self.last_epoch, cmd.epoch)
            self.dp.admit = True
            self.resume()
        elif (
            isinstance(cmd, Release) and cmd.epoch in self.parked and not cmd.park
        ):  # its parked requests cannot resume: they end (a follower reads the park itself after its leader's)
            self.sim.discard(cmd.epoch)
        elif what is Intake.RELEASE:
            # RELEASE: a release of the epoch it is bound in
            assert isinstance(cmd, Release) and g is not None
            g.release_asked = True
            g.retract, g.scatter, g.park = cmd.retract, cmd.scatter, cmd.park and self.sim.cfg.park
            self.sim.engines[g.leader].boundary()
            self.sim.note_states()
            return
        elif isinstance(cmd, Bind):
            return
        self.boundary()
        self.sim.note_states()

    def boundary(self) -> None:
        """A step boundary (or an idle engine poked): apply commands, then run the next step."""
        if self.dp.stepping:
            return
        g = self.group
        if g is not None:
            if g.formed and (g.leader == self.idx or g.mixed):
                g.boundary()
            self.local_step()
            return
        b = self.pending
        keep = b is not None and b.keep and self.mixed
        if b is not None and not self.arrived:
            # hard: at once (its DP work pauses, KV kept); sequential/soft: once its DP work (running and queued;
            # the router sends no more) has finished, or what is queued cannot start (parked requests hold the KV). (The worker holds queued, unstarted DP requests with the
            # paused work instead of running them first: a slightly earlier bind there.)
            adopt = b.adopt and self.transforms  # (an engine without it reads the bind as hard)
            ready = b.preempt == "hard" or adopt or keep or not (self.dp.running or self.dp.startable())
            if ready:
                if adopt:  # they become the group's when it forms; their KV stays here until then
                    self.adopted = (self.dp.running, self.dp.queue)
                    self.dp.running, self.dp.queue = [], []
                elif not keep:  # (kept: they run on, beside the group's steps)
                    self.paused_running, self.paused_queue = self.dp.running, self.dp.queue
                    self.dp.running, self.dp.queue = [], []
                self.arrived = b.epoch
                self.sim.arrive(b, self.idx)
                if not keep:
                    return
        if self.arrived and not keep:
            return
        if self.dp.has_work():
            self.dp.step()

    def local_step(self, force: bool = False) -> None:
        """Bound in a group of members that run mixed steps, with DP work of its own (kept at the bind): its DP
        requests step on their own unless the group waits for its next mixed step, which runs them
        (:meth:`SimGroup.waits`); ``force``: they step anyway (the group has nothing it can run yet)."""
        g = self.group
        if g is None or not g.mixed or self.dp.stepping or g.unit.stepping:
            return
        if g.waits() and not force:
            return
        if self.dp.has_work():
            g.since_mixed[self.idx] += 1
            self.dp.step()

    def assign(self, n: int = 1) -> None:
        """``n`` requests were assigned to it (negative: ended, or lost with their parked group)."""
        self.assigned += n

    def join(self, g: SimGroup, epoch: int) -> None:
        """It is a member of ``g`` (bound in ``epoch``) from now on."""
        self.group, self.pending, self.arrived, self.last_epoch = g, None, 0, epoch

    def beat(self, now: float) -> None:
        """Its heartbeat changed (a router round reads it anew)."""
        self.beat_ts = now

    def leave(self, now: float) -> None:
        """Its group dissolved: back to DP, with the KV its parked requests leave, its paused work resumed."""
        self.group, self.beat_ts = None, now
        self.dp.reopen(self.sim.kv_per_engine - self.parked_kv)
        self.resume()

    def resume(self) -> None:
        self.dp.running = self.adopted[0] + self.paused_running + self.dp.running
        self.dp.queue = self.adopted[1] + self.paused_queue + self.dp.queue
        self.paused_running, self.paused_queue, self.adopted = [], [], ([], [])


def attn_pairs(prefill: list[tuple[Req, int]]) -> float:
    """The (query, key) pairs a step's prefill chunks attend over: each chunk's tokens to the tokens before it
    (cached or prefilled; a retracted request recomputes its prompt and its output so far, from ``prefilled`` =
    ``-generated``) and, causally, to each other."""
    return sum(causal_pairs(r.prefilled + r.generated, take) for r, take in prefill)


def kv_in_use(r: Req) -> int:
    """KV tokens a request holds now (a retracted one recomputes from -generated)."""
    return r.prefilled + r.generated


class SimGroup:
    """A bound group (or a static TP or shift scheduler). ``cache``: it keeps a prefix cache of its own over its
    TP layout (static TP and Shift Parallelism, whose engines cache prefixes in TP as in DP); without it its
    requests bypass the members' caches."""

    def __init__(self, sim: Host, bind: Bind, merged: bool, shift: bool = False, cache: bool = False) -> None:
        self.sim, self.epoch, self.members = sim, bind.epoch, bind.members
        self.leader = bind.members[0]
        engines = [sim.engines[m] for m in self.members]
        self.adopt = bind.adopt and all(e.transforms for e in engines)
        # mixed: its members run their own DP work in its steps (their KV their own); keep: from the bind on, the
        # DP work they ran then too
        self.mixed = all(e.mixed for e in engines)
        self.keep = bind.keep and not self.adopt and self.mixed
        # each member's own DP steps since the last mixed step
        self.since_mixed = dict.fromkeys(self.members, 0)
        paused_kv = 0 if self.adopt else sum(e.dp.kv_used for e in engines)
        parked_kv = sum(e.parked_kv - e.parked.get(bind.resume, 0) for e in engines)  # other parked requests'
        cap = len(self.members) * sim.kv_per_engine - paused_kv - parked_kv
        threshold = sim.cfg.sp_threshold if bind.sp_threshold is None else bind.sp_threshold
        self.unit = Unit(
            sim,
            len(self.members),
            cap,
            merged,
            self.boundary,
            shift,
            cache=PrefixCache() if cache else None,
            sp_threshold=threshold * merged,
        )
        self.release_asked = self.retract = self.scatter = self.park = False
        self.formed = False
        self.transform_ms = 0.0
        if bind.resume in sim.parked:  # the requests parked at that epoch's release continue here
            back = sim.unpark(bind.resume)
            started = [r for r in back if r.started == r.started]  # (NaN: never admitted)
            self.unit.running += started
            self.unit.queue += [r for r in back if r not in started]
            self.unit.kv_used += sum(r.kv for r in started)
        if self.adopt:  # the members' DP requests become this group's, KV by head slices
            tokens: list[float] = []
            for e in engines:
                running, waiting = e.adopted
                e.adopted = ([], [])
                self.unit.running += running
                self.unit.queue += waiting
                self.unit.kv_used += e.dp.kv_used
                e.dp.kv_used = 0
                tokens.append(sum(kv_in_use(r) for r in running))
            if any(tokens):
                self.transform_ms = sim.cfg.cost.transform_ms(adopt_moves(tokens))
                sim.note_transform("adopt", self.transform_ms, len(self.unit.running) + len(self.unit.queue))

    def form(self) -> None:
        """Every member arrived and the switch's stall is over: it steps from now on."""
        self.formed = True

    def boundary(self) -> None:
        if self.unit.stepping or not self.formed:
            return
        members = [self.sim.engines[m] for m in self.members]
        if self.mixed:
            if any(e.dp.stepping for e in members):
                return  # a member's own DP step runs: the next mixed step waits for it
            kv, share = self.sim.kv_per_engine, -(-self.unit.kv_used // len(members))
            self.unit.kv_cap = len(members) * kv - sum(e.dp.kv_used for e in members)
            for e in members:  # its own requests get what the group's share of its KV leaves
                e.dp.kv_cap = kv - share
        delay = 0.0
        moving = self.retract or self.scatter or self.park
        if self.release_asked and self.park and self.prefilling_long():
            self.requeue_prefilling()
        if (
            self.release_asked
            and moving
            and (self.unit.running or self.unit.queue)
            and not self.prefilling_long()
        ):
            delay = self.move_out()
            self.sim.note_states()
        if self.release_asked and not self.unit.running and not self.unit.queue:
            self.formed = False
            self.sim.at(self.sim.now + self.sim.cfg.cost.switch_ms / 1000 + delay, self.sim.dissolve, self)
        elif self.unit.has_work():
            if self.mixed and any(e.dp.has_work() for e in members):
                if self.waits():
                    self.mixed_step(members)
                else:  # decode only: the members' own steps first
                    for e in members:
                        e.local_step()
            else:
                self.unit.step()
            self.trim_caches()

    def prefilling_long(self) -> bool:
        """Parking: a request no engine holds alone is in its prefill (the workers park between whole requests'
        steps: the group steps on until that prefill ends)."""
        kv = self.sim.kv_per_engine
        return self.park and any(r.kv > kv and r.prefilled < r.spec.prompt for r in self.unit.running)

    def requeue_prefilling(self) -> None:
        """Parking: a request no engine holds alone that is still in its prefill ends on the group as its members'
        loss would end it (no token streamed yet): the gateway queues it again, and it starts over later."""
        kv, sim = self.sim.kv_per_engine, self.sim  # (one with a token streamed steps on: it parks after)
        for r in [
            r for r in self.unit.running if r.kv > kv and 0 <= r.prefilled < r.spec.prompt and not r.generated
        ]:
            self.unit.running.remove(r)
            self.unit.kv_used -= r.kv
            r.prefilled = 0
            sim.requeue(r)

    def waits(self) -> bool:
        """The members (with DP work kept) wait for the group's next mixed step instead of stepping on their own:
        the group has a prefill to run (a new request's first token comes first), or decode work and every member
        with DP work of its own ran ``mixed_decode_every - 1`` steps of it since the last mixed step (the group's
        decoding requests join every n-th of their steps: each mixed step costs every member the all-to-alls'
        latency and the wait for the slowest member)."""
        unit = self.unit
        if not unit.has_work():
            return False
        if unit.queue or any(r.prefilled < r.spec.prompt for r in unit.running):
            return True
        busy = [n for e, n in self.since_mixed.items() if self.sim.engines[e].dp.has_work()]
        return min(busy, default=0) >= self.sim.cfg.mixed_decode_every - 1

    def mixed_step(self, members: list[Engine]) -> None:
        """One step of the group that also runs each member's own DP batch: the group's tokens in SP, a slice on
        every member, beside the member's DP tokens, all through its full weights; as slow as its busiest member."""
        work = self.unit.select()
        if work is None:  # (the group's head does not fit yet: the members' own work must free KV first)
            for e in members:
                e.local_step(force=True)
            return
        prefill, decode, tokens, ctx = work
        local = {e.idx: e.dp.select() for e in members}
        cost, w = self.sim.cfg.cost, len(members)
        ms = max(
            cost.mixed_step_ms(
                w,
                (mine[2], len(mine[1]), mine[3]) if mine else (0, 0, 0),
                (tokens, len(decode), ctx),
                (attn_pairs(mine[0]) if mine else 0.0, attn_pairs(prefill)),
            )
            for mine in local.values()
        )
        self.sim.stats["mixed_steps"] += 1
        self.since_mixed = dict.fromkeys(self.members, 0)
        self.unit.stepping = True
        for e in members:
            e.dp.stepping = local[e.idx] is not None
        self.sim.at(self.sim.now + ms / 1000, self.end_mixed_step, members, prefill, decode, local)

    def end_mixed_step(
        self,
        members: list[Engine],
        prefill: list[tuple[Req, int]],
        decode: list[Req],
        local: dict[int, tuple[list[tuple[Req, int]], list[Req], int, int] | None],
    ) -> None:
        for e in members:
            mine = local[e.idx]
            if mine is not None:
                e.dp.end_step(mine[0], mine[1])  # (its boundary waits: the group is still stepping)
        self.unit.end_step(prefill, decode)  # the group's boundary: the next (mixed) step
        for e in members:
            e.local_step()

    def trim_caches(self) -> None:
        """The members keep their prefix caches through the epoch (TP requests use the group's own), but the group's KV
        demand evicts their unlocked DP prefixes: each member holds a 1/width share of it, beside its own DP KV."""
        share = -(-self.unit.kv_used // len(self.members))
        for m in self.members:
            e = self.sim.engines[m]
            e.cache.insert((), self.sim.kv_per_engine - e.dp.kv_used - share)

    def move_out(self) -> float:
        """Release at once: every TP request goes back to DP on its owner, by scatter (its KV moves there if the
        owner's free KV holds it whole) or else retracted (recomputed there). Returns the transformation's ms."""
        sim = self.sim
        scatter = (self.scatter or self.park) and all(sim.engines[m].transforms for m in self.members)
        parked = [r for r in self.unit.running + self.unit.queue if self.park and r.kv > sim.kv_per_engine]
        if parked:  # no engine holds them alone: they stay where they are, KV kept, until a resume
            self.unit.running = [r for r in self.unit.running if r not in parked]
            self.unit.queue = [r for r in self.unit.queue if r not in parked]
            sim.park(self, parked)
        owned = dict.fromkeys(self.members, 0)
        moved: dict[int, list[Req]] = {m: [] for m in self.members}
        retracted: dict[int, list[Req]] = {m: [] for m in self.members}
        for r in self.unit.running:
            owner = sim.engines[r.engine]
            if scatter and owner.dp.kv_used + r.kv <= owner.dp.kv_cap:
                owner.dp.kv_used += r.kv
                owned[r.engine] += kv_in_use(r)
                moved[r.engine].append(r)
            else:  # recomputed in DP: the prompt and the tokens generated so far
                r.prefilled = -r.generated
                retracted[r.engine].append(r)
        waiting: dict[int, list[Req]] = {m: [] for m in self.members}
        for r in self.unit.queue:
            waiting[r.engine].append(r)
        for m in self.members:
            e = sim.engines[m]
            e.paused_running = moved[m] + e.paused_running
            e.paused_queue = retracted[m] + waiting[m] + e.paused_queue
        sim.stats["scattered"] += sum(map(len, moved.values()))
        sim.stats["retracted"] += sum(map(len, retracted.values()))
        sim.stats["scatter_fallbacks"] += sum(map(len, retracted.values())) if scatter else 0
        self.unit.running, self.unit.queue, self.unit.kv_used = [], [], 0
        if not any(owned.values()):
            return 0.0
        ms = sim.cfg.cost.transform_ms(scatter_moves([owned[m] for m in self.members]))
        sim.note_transform("scatter", ms, sum(map(len, moved.values())))
        return ms / 1000

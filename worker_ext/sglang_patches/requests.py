"""The SGLang request internals a KV transformation touches (pinned: ``SUPPORTED_SGLANG``): a request's KV row, its
state as another member re-creates it, a decode batch of requests whose KV is already in place, and the output
path (which member's detokenizer a token goes to).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from worker_ext.sglang_patches import require

# Output lists a request with return_logprob accumulates per generated token (Req.logprob.*).
LOGPROB_LISTS = (
    "output_token_logprobs_val",
    "output_token_logprobs_idx",
    "output_top_logprobs_val",
    "output_top_logprobs_idx",
    "output_token_ids_logprobs_val",
    "output_token_ids_logprobs_idx",
)


class ReqState(msgspec.Struct, kw_only=True):
    """What a member needs to run another member's request as its own (sent pickled over the control group)."""

    rid: str
    origin_input_text: str | None
    origin_input_ids: list[int]
    output_ids: list[int]
    sampling_params: Any
    return_logprob: bool
    top_logprobs_num: int
    token_ids_logprob: list[int] | None
    logprob_start_len: int
    stream: bool
    eos_token_ids: Any
    vocab_size: int | None
    priority: int | None
    logprobs: dict[str, list] = {}


# The prompt's log-probs (Req.logprob.*), computed by whoever prefills the request.
INPUT_LOGPROB_LISTS = (
    "input_token_logprobs_val",
    "input_token_logprobs_idx",
    "input_top_logprobs_val",
    "input_top_logprobs_idx",
    "input_token_ids_logprobs_val",
    "input_token_ids_logprobs_idx",
)


class Emitted(msgspec.Struct, kw_only=True):
    """New output of a request since the last emission, for the member that streams it (with its first output,
    the prompt's log-probs and the prompt tokens it found cached, when the leader prefilled it)."""

    rid: str
    output_ids: list[int]
    logprobs: dict[str, list] = {}
    input_logprobs: dict[str, Any] = {}
    finished_reason: Any = None
    finished_len: int | None = None
    cached_tokens: int = 0


def kv_need(req: Any) -> int:
    """KV tokens the request may come to hold: its prompt and ``max_new_tokens``."""
    return len(req.origin_input_ids) + int(req.sampling_params.max_new_tokens or 0)


def adoptable(req: Any) -> bool:
    """A request another member can take over as it is: no grammar, custom logit processor, multimodal input or
    hidden-state capture (their state lives in objects of this process)."""
    return relayable(req) and not req.finished()


def relayable(req: Any) -> bool:
    """A new request a follower can hand to its leader (:func:`state_of` carries all it needs)."""
    return (
        req.grammar is None
        and req.custom_logit_processor is None
        and req.multimodal_inputs is None
        and not req.return_hidden_states
    )


def running_reqs(scheduler: Any) -> list:
    return [r for r in scheduler.running_batch.reqs if not r.finished()]


def kv_length(req: Any) -> int:
    """Tokens of KV the request holds (its newest sampled token has none yet)."""
    return int(req.kv.kv_committed_len) if req.kv.holds_kv else 0


def kv_slots(scheduler: Any, req: Any) -> torch.Tensor:
    row = req.kv.req_pool_idx
    return scheduler.req_to_token_pool.req_to_token[row, : kv_length(req)].to(torch.int64)


def detach_kv(req: Any) -> tuple[int, int]:
    """Take the request's KV row away from it (the row now belongs to the caller); returns (row, kv length)."""
    row, n = req.kv.req_pool_idx, kv_length(req)
    req.kv = type(req.kv)()
    return row, n


def attach_kv(req: Any, row: int, length: int) -> None:
    req.kv.req_pool_idx = row
    req.kv.kv_committed_len = req.kv.kv_allocated_len = length
    req.kv.cache_protected_len = 0


def state_of(req: Any) -> ReqState:
    lp = req.logprob
    return ReqState(
        rid=req.rid,
        origin_input_text=getattr(req, "origin_input_text", None),
        origin_input_ids=list(req.origin_input_ids),
        output_ids=list(req.output_ids),
        sampling_params=req.sampling_params,
        return_logprob=bool(req.return_logprob),
        top_logprobs_num=int(lp.top_logprobs_num or 0),
        token_ids_logprob=lp.token_ids_logprob,
        logprob_start_len=int(req.logprob_start_len),
        stream=bool(req.stream),
        eos_token_ids=req.eos_token_ids,
        vocab_size=req.vocab_size,
        priority=req.priority,
        logprobs={n: list(getattr(lp, n)) for n in LOGPROB_LISTS if getattr(lp, n, None) is not None},
    )


def req_from_state(scheduler: Any, st: ReqState) -> Any:
    """A request of this scheduler's that continues ``st`` (its prompt already prefilled elsewhere)."""
    from sglang.srt.managers.schedule_batch import Req

    req = Req(
        st.rid,
        st.origin_input_text or "",
        array("q", st.origin_input_ids),
        st.sampling_params,
        return_logprob=st.return_logprob,
        top_logprobs_num=st.top_logprobs_num,
        token_ids_logprob=st.token_ids_logprob,
        stream=st.stream,
        eos_token_ids=st.eos_token_ids,
        vocab_size=st.vocab_size,
        priority=st.priority,
    )
    req.tokenizer = scheduler.tokenizer
    req.output_ids = array("q", st.output_ids)
    req.logprob_start_len = st.logprob_start_len
    req.input_logprob_sent = bool(st.output_ids)  # its owner already streamed the prompt's log-probs
    for name, values in st.logprobs.items():
        setattr(req.logprob, name, list(values))
    req.refresh_fill_ids()
    return req


def emitted_since(req: Any, sent: int, sent_logprobs: int, ending: bool = False) -> Emitted:
    """What ``req`` produced since ``sent`` output ids and ``sent_logprobs`` log-probs; ``ending``: the
    scheduler ends it outside the output stream (an abort), its ``to_finish`` is the finish reason."""
    lp = req.logprob
    out = Emitted(
        rid=req.rid,
        output_ids=list(req.output_ids[sent:]),
        logprobs={n: list(getattr(lp, n)[sent_logprobs:]) for n in LOGPROB_LISTS if getattr(lp, n, None)},
    )
    if sent == 0:
        out.cached_tokens = int(getattr(req, "cached_tokens", 0) or 0)
    if sent == 0 and req.return_logprob:
        out.input_logprobs = {n: v for n in INPUT_LOGPROB_LISTS if (v := getattr(lp, n, None)) is not None}
    if req.finished():
        out.finished_reason, out.finished_len = req.finished_reason, req.finished_len
    elif ending and req.to_finish is not None:
        out.finished_reason = req.to_finish
    return out


def logprob_count(req: Any) -> int:
    vals = getattr(req.logprob, "output_token_logprobs_val", None)
    return len(vals) if vals is not None else 0


def apply_emitted(req: Any, em: Emitted) -> None:
    req.output_ids.extend(em.output_ids)
    for name, values in em.logprobs.items():
        getattr(req.logprob, name).extend(values)
    for name, value in em.input_logprobs.items():
        setattr(req.logprob, name, value)
    if em.cached_tokens:
        req.cached_tokens = em.cached_tokens
    if em.finished_reason is not None:
        req.finished_reason, req.finished_len = em.finished_reason, em.finished_len


def stream(scheduler: Any, reqs: list) -> None:
    """Send the requests' new output to this engine's detokenizer (and so to their clients)."""
    if reqs:
        scheduler.output_streamer.stream_output(reqs, any(r.return_logprob for r in reqs))


_STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_diverts: dict[int, Callable[[Any], bool]] = {}  # id(output streamer) -> divert, while a filter is applied
_ends: dict[int, Callable[[Any], bool]] = {}  # id(scheduler) -> divert of an abort, while a filter is applied


def apply_output_hook() -> None:
    """Wrap ``SchedulerOutputStreamer.stream_output`` (once per process, at plugin load) so that
    :func:`apply_output_filter` can keep requests away from this engine's detokenizer, and the requests it
    streams to their end are tallied in :data:`~worker_ext.sglang_patches.prefix_cache.tally`."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    require(callable(getattr(SchedulerOutputStreamer, "stream_output", None)), "stream_output missing")

    from worker_ext.sglang_patches import prefix_cache

    def around(original, streamer, reqs, return_logprob, *args, **kwargs):
        divert = _diverts.get(id(streamer))
        if divert is not None:
            reqs = [r for r in reqs if not divert(r)]
            if not reqs:
                return None
        prefix_cache.tally.count(reqs)
        return original(streamer, reqs, return_logprob, *args, **kwargs)

    HookRegistry.register(f"{_STREAMER}.stream_output", around, HookType.AROUND)

    def around_abort(original, scheduler, abort_req, req, *args, **kwargs):
        end = _ends.get(id(scheduler))
        if end is not None and req is not None and end(req):
            return None
        return original(scheduler, abort_req, req, *args, **kwargs)

    require(callable(getattr(Scheduler, "send_abort_output", None)), "Scheduler.send_abort_output missing")
    HookRegistry.register(f"{_SCHEDULER}.send_abort_output", around_abort, HookType.AROUND)


def apply_output_filter(scheduler: Any, divert: Callable[[Any], bool], end: Callable[[Any], bool]) -> None:
    """Requests for which ``divert(req)`` is true are not sent to this engine's detokenizer (another member
    streams them); ``divert`` sees each of their outputs, and ``end`` each abort the scheduler sends outside the
    output stream (a retraction's, say: true when it went to the member). Undone by
    :func:`remove_output_filter`."""
    _diverts[id(scheduler.output_streamer)] = divert
    _ends[id(scheduler)] = end


def remove_output_filter(scheduler: Any) -> None:
    _diverts.pop(id(scheduler.output_streamer), None)
    _ends.pop(id(scheduler), None)


def merge_decoding(scheduler: Any, reqs: list) -> None:
    """Put requests whose KV is already in their rows (``kv_committed_len`` tokens) into the running batch, to
    decode their next token (the last of ``output_ids``) at the next step, like SGLang's prebuilt (disaggregated
    decode) requests: no prefill."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    if not reqs:
        return
    s = scheduler
    batch = ScheduleBatch.init_new(
        reqs,
        s.req_to_token_pool,
        s.token_to_kv_pool_allocator,
        s.tree_cache,
        s.model_config,
        s.enable_overlap,
        s.spec_algorithm,
    )
    device = batch.device
    rows = [r.kv.req_pool_idx for r in reqs]
    seq = [r.kv.kv_committed_len for r in reqs]
    for r in reqs:
        assert len(r.origin_input_ids) + len(r.output_ids) == r.kv.kv_committed_len + 1, f"{r.rid}: KV length"
        r.is_retracted = False
        r.refresh_fill_ids()
    batch.forward_mode = ForwardMode.DECODE
    batch.req_pool_indices = torch.tensor(rows, dtype=torch.int64, device=device)
    batch.req_pool_indices_cpu = torch.tensor(rows, dtype=torch.int64)
    batch.seq_lens = torch.tensor(seq, dtype=torch.int64, device=device)
    batch.seq_lens_cpu = torch.tensor(seq, dtype=torch.int64)
    batch.orig_seq_lens = torch.tensor(seq, dtype=torch.int32, device=device)
    batch.seq_lens_sum = sum(seq)
    batch.input_ids = None
    batch.multimodal_inputs = [None] * len(reqs)
    if batch.return_logprob:
        batch.top_logprobs_nums = [r.logprob.top_logprobs_num for r in reqs]
        batch.token_ids_logprobs = [r.logprob.token_ids_logprob for r in reqs]
    batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, s.model_config.vocab_size)
    last = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64, device=device)
    s.future_map.stash_bonus_tokens(batch.req_pool_indices, last)  # the next decode's input ids
    if s.running_batch.is_empty():
        s.running_batch = batch
    else:
        s.running_batch.merge_batch(batch)


def drop_from_batches(scheduler: Any, rids: set[str]) -> list:
    """Take the requests out of the running batch and the waiting queue; returns them."""
    s = scheduler
    gone = [r for r in s.running_batch.reqs if r.rid in rids]
    if gone:
        s.running_batch.filter_batch(
            keep_indices=[i for i, r in enumerate(s.running_batch.reqs) if r.rid not in rids]
        )
    waiting = [r for r in s.waiting_queue if r.rid in rids]
    s.waiting_queue[:] = [r for r in s.waiting_queue if r.rid not in rids]
    return gone + waiting


def release_kv(scheduler: Any, req: Any) -> None:
    """Give the request's KV row and slots back (through whatever allocator is installed)."""
    from sglang.srt.mem_cache.common import release_kv_cache

    if req.kv.holds_kv:
        release_kv_cache(req, scheduler.tree_cache, checkpoint=False)


def retract(scheduler: Any, reqs: list) -> None:
    """SGLang's own retraction of running requests (KV freed, recomputed when admitted again); the caller takes
    them out of the running batch."""
    from sglang.srt.managers.schedule_batch import retract_all

    s = scheduler
    retract_all(
        reqs=reqs,
        req_to_token_pool=s.req_to_token_pool,
        token_to_kv_pool_allocator=s.token_to_kv_pool_allocator,
        tree_cache=s.tree_cache,
        hisparse_coordinator=None,
        offload_kv=False,
    )


def reset_for_recompute(req: Any) -> None:
    """SGLang's retraction state: the request is prefilled again (prompt + output so far) when admitted."""
    req.reset_for_retract()
    req.kv = type(req.kv)()


# --- client aborts while an engine follows a group ---------------------------------------------------------------


class Received(msgspec.Struct):
    """What a following engine's tokenizer sent: the request ids its clients aborted (SGLang aborts every request
    whose id starts with one) and its new generate requests, as this scheduler's own ``Req`` objects."""

    aborted: list[str]
    new: list[Any]


def receive_while_following(scheduler: Any) -> Received:
    """A follower's scheduler loop is not running: take what its tokenizer sent meanwhile. New generate requests go
    through SGLang's own intake (validation, limits) and come back as requests for the group to run; everything
    else (aborts included) is kept for the loop's next iteration, as SGLang keeps inputs it cannot dispatch yet."""
    from sglang.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput

    got = scheduler.request_receiver.recv_requests(local_reqs=[])
    generate = [r for r in got if isinstance(r, TokenizedGenerateReqInput)]
    scheduler._deferred_input_requests.extend(r for r in got if not isinstance(r, TokenizedGenerateReqInput))
    new: list[Any] = []
    if generate:
        before = len(scheduler.waiting_queue)
        grammars = scheduler.grammar_manager.grammar_queue
        compiling = len(grammars)
        scheduler.process_input_requests(generate)  # validated and queued here, as SGLang queues any request
        new = list(scheduler.waiting_queue[before:])
        del scheduler.waiting_queue[before:]
        refused = list(grammars[compiling:]) + [r for r in new if not relayable(r)]
        del grammars[compiling:]
        new = [r for r in new if relayable(r)]
        refuse(scheduler, refused)
    aborted = [r.rid for r in got if isinstance(r, AbortReq) and r.rid and not r.abort_all]
    return Received(aborted, new)


def refuse(scheduler: Any, reqs: list) -> None:
    """End new requests a follower cannot hand to its leader (a grammar's state lives in this process) with the
    uncounted 503 (``GROUP_LEADER_ONLY``): nothing ran, the gateway queues them again for a leader or a DP
    engine, a client calling this engine directly is told where to send them. (Kept here, they waited for the
    group's release, which at light load can be minutes.)"""
    from concurrent.futures import Future

    from flying.messages import GROUP_LEADER_ONLY
    from worker_ext.sglang_patches import group_lost

    for req in reqs:
        if isinstance(req.grammar, Future):  # its grammar still compiling: not wanted any more
            req.grammar.cancel()
        req.finished_reason = group_lost(GROUP_LEADER_ONLY.message)
    stream(scheduler, reqs)


def abort(scheduler: Any, rid: str) -> None:
    """Abort ``rid`` (and ``rid_*``) in this scheduler as a client's abort does."""
    from sglang.srt.managers.io_struct import AbortReq

    scheduler.abort_request(AbortReq(rid=rid))


def end_aborted(scheduler: Any, reqs: list) -> None:
    """Finish requests whose client left (an abort) and tell this engine's tokenizer."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    for req in reqs:
        req.finished_reason = FINISH_ABORT()
    stream(scheduler, reqs)

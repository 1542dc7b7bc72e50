"""Admission: a request checked against what the deployment can serve (its model, a live engine, a router
dispatching, the context length) and made into what the gateway queues and forwards (:class:`Admitted`: the
queue record, the engine endpoint and body, and for a resumable stream its progress). The prompt is tokenized
here, a long one off the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from dataclasses import dataclass

import msgspec

from flying.messages import Priority, QueuedRequest, engine_rid, engine_rids
from flying.prefix import block_hashes, encode_chain
from gateway.api.engine_fields import StreamId
from gateway.api.errors import ContextTooLong, InvalidRequest, ModelNotFound, NoLiveWorkers, NoRouter
from gateway.api.schemas import (
    NOT_RESUMABLE,
    ChatCompletionRequest,
    ServiceTier,
    answer_tier,
    constrained,
    requested_max_tokens,
)
from gateway.cluster_view import ClusterView
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.observer import NOTHING, Observer
from gateway.resume import Resumable, upstream_body
from gateway.tokens import LONG_TEXT_CHARS

SGLANG_PRIORITY = {"high": 2, "normal": 1, "low": 0}  # SGLang runs higher integers first
OFF_LOOP_CHARS = LONG_TEXT_CHARS  # prompts longer than this are tokenized off the event loop ...
HUGE_PROMPT_CHARS = 1 << 18  # ... and longer than this, one at a time (seconds of a core each: a few megabyte
# prompts tokenized at once took the cores from everything else)
# SGLang refuses a prompt of min(context length, KV) - 6 tokens or more (its scheduler's max_req_input_len), after
# the request has waited its turn: the gateway refuses it at the door instead
PROMPT_RESERVE = 7
# SGLang ends a request's output 2 tokens short of min(context length, KV): its max_req_len is that minus 1, and its
# scheduler caps max_new_tokens at max_req_len - prompt - 1; the gateway admits only what the engine will produce
OUTPUT_RESERVE = 2
PATIENCE_MARGIN_S = 30.0  # beyond twice long_wait_s: a group binds and prefills before its assignment


@dataclass(frozen=True)
class Admitted:
    """A validated request, ready to queue and forward."""

    record: QueuedRequest
    path: str  # SGLang endpoint
    body: dict
    stream: bool
    resume: Resumable | None = None  # a stream that can continue on another engine (see gateway.resume)
    # seconds it may wait for its assignment beyond its class's budget: a long-context request of normal or low
    # priority, which the router holds for a calm period (up to twice its long_wait_s)
    patience_s: float = 0.0
    service_tier: ServiceTier | None = None  # what a chat answer says it was served at (schemas.answer_tier)

    def renamed(self, rid: str) -> Admitted:
        """The same request under id ``rid`` (its record; SGLang runs it as ``<rid>~0``)."""
        self.body["rid"] = engine_rid(rid)  # the one body dict, shared with ``resume``
        return dataclasses.replace(self, record=msgspec.structs.replace(self.record, id=rid))

    def next_attempt(self, attempt: int) -> None:
        """The request goes to an engine again (its ``attempt``-th re-dispatch), under an SGLang rid of its own
        (:func:`flying.messages.engine_rid`): whatever is still aimed at an earlier attempt on the same engine
        (SGLang aborts the rid of a stream whose connection closed, seconds later) ends nothing of this one."""
        self.body["rid"] = engine_rid(self.record.id, attempt)

    def engine_rids(self) -> list[str]:
        """The ids SGLang runs the current attempt under (what an abort names)."""
        return engine_rids(self.body["rid"], self.record.n)


class Admission:
    """Validates requests for one gateway: ``count_tokens`` is the prompt counter (``chat_ids(req)``: a chat
    prompt's ids; ``completion(req)``: a completion prompt's ids or length); the cluster view says what the
    deployment can serve."""

    def __init__(
        self,
        config: GatewayConfig,
        cluster: ClusterView,
        count_tokens,
        metrics: GatewayMetrics | None = None,
        observer: Observer = NOTHING,
    ) -> None:
        self.config = config
        self.observer = observer
        self.cluster = cluster
        self.count_tokens = count_tokens
        # huge prompts tokenized at once (the permit is held by the thread that tokenizes)
        self._huge = threading.Semaphore(1)
        self.metrics = metrics or GatewayMetrics()

    async def admit(self, req, priority: Priority, request_id: str | None = None) -> Admitted:
        """Validate ``req`` and build its record and engine body, under ``request_id`` (else a fresh id), at
        ``priority``: the tenant's already (``gateway.tenants.prioritise`` lowers or refuses it)."""
        started = time.time_ns()
        try:
            adm = await self._admit(req, priority, request_id)
        except BaseException as exc:
            self.observer.admission_failed(exc, started)
            raise
        self.observer.admitted(adm.record, started)
        return adm

    async def _admit(self, req, priority: Priority, request_id: str | None) -> Admitted:
        if req.model != self.config.served_model_name:
            raise ModelNotFound(
                f"The model '{req.model}' does not exist; this gateway serves '{self.config.served_model_name}'",
                param="model",
            )
        cluster = self.cluster
        beats = await cluster.workers() or await cluster.workers_again()  # before a 503, look again
        if not beats:
            raise NoLiveWorkers("no live workers; try again later")
        if cluster.router_missing():
            raise NoRouter("no router is dispatching (none holds the lease); try again later")
        chat = isinstance(req, ChatCompletionRequest)
        self._check_vocabulary(req)
        size = sum(len(m.text()) for m in req.messages) if chat else len(req.prompt)
        if size > OFF_LOOP_CHARS:  # a long prompt is tokenized on a thread: other requests keep flowing
            ids = await asyncio.to_thread(self._tokens_off_loop, req, chat, size > HUGE_PROMPT_CHARS)
        else:
            ids = self._tokens(req, chat)
        prompt = ids if isinstance(ids, int) else len(ids)
        limit = cluster.limit(beats)
        max_tokens = self._max_tokens(req, prompt, limit)
        rid = request_id or os.urandom(16).hex()
        body = msgspec.to_builtins(req)
        body.pop("max_completion_tokens", None)
        key = body.pop("prompt_cache_key", None)  # an affinity key for the router, not the engine's
        tokens = ids if isinstance(ids, list) else req.prompt
        chain = block_hashes(tokens, key=key)  # for cache-aware dispatch
        body.update(max_tokens=max_tokens, rid=engine_rid(rid), priority=SGLANG_PRIORITY[priority])
        record = QueuedRequest(
            id=rid,
            priority=priority,
            model=req.model,
            prompt_tokens=prompt,
            max_tokens=max_tokens,
            gateway=self.config.gateway_id,
            enqueued_at=time.time(),
            n=req.n,
            prefix=encode_chain(chain),
            keyed=key is not None,
            leader_only=constrained(req),
        )
        path = "/v1/chat/completions" if chat else "/v1/completions"
        patience = self._patience(record, beats)
        keep = (
            req.logprobs
            or req.n > 1
            or (not chat and req.echo)
            or any(getattr(req, f, None) is not None for f in NOT_RESUMABLE)
        )
        tier = answer_tier(req, priority)
        if not req.stream or keep:  # the engine's own endpoint
            return Admitted(record, path, body, bool(req.stream), patience_s=patience, service_tier=tier)
        up = upstream_body(body, chat, ids if isinstance(ids, list) else None)
        # a text prompt's ids come with the engine's first chunk
        known = up["prompt"] if isinstance(up["prompt"], list) else None
        decode = getattr(self.count_tokens, "decode", None) if up.get("skip_special_tokens", True) else None
        resume = Resumable(
            up, max_tokens, chat=chat, prompt_ids=known, decode=decode, stream_id=StreamId(tier=tier)
        )
        return Admitted(record, "/v1/completions", up, True, resume, patience_s=patience, service_tier=tier)

    def _patience(self, record: QueuedRequest, beats: list) -> float:
        """A request no engine holds alone, of normal or low priority, waits for a calm period up to the router's
        ``long_wait_s`` (up to twice that while bursts go on): it may wait that long, plus a margin, beyond its
        class's budget (it would end with 504 while the router held it on purpose)."""
        one = max((b.max_total_tokens for b in beats), default=0)
        wait = self.cluster.long_wait_s
        if record.priority == "high" or not wait or record.kv_tokens <= one:
            return 0.0
        return 2 * wait + PATIENCE_MARGIN_S

    def _check_vocabulary(self, req) -> None:
        """``logit_bias`` names token ids of the model's vocabulary (the schema checked that they are ids)."""
        vocab = getattr(self.count_tokens, "vocab", None)
        bias = getattr(req, "logit_bias", None)
        if vocab and bias and (top := max(int(k) for k in bias)) >= vocab:
            raise InvalidRequest(
                f"logit_bias keys must be token ids of the model's vocabulary (0 to {vocab - 1}); got {top}",
                param="logit_bias",
            )

    def _tokens_off_loop(self, req, chat: bool, huge: bool) -> list[int] | int:
        """:meth:`_tokens` on a worker thread; a huge prompt waits there for the one permit (a client that leaves
        meanwhile does not free it before its tokenizing ends)."""
        if not huge:
            return self._tokens(req, chat)
        with self._huge:
            return self._tokens(req, chat)

    def _tokens(self, req, chat: bool) -> list[int] | int:
        """The chat prompt's token ids, or a completion prompt's length; a prompt the tokenizer or chat
        template rejects (e.g. roles a template does not allow) is the client's error."""
        try:
            return self.count_tokens.chat_ids(req) if chat else self.count_tokens.completion(req)
        except Exception as exc:  # noqa: BLE001 - tokenizers and Jinja templates raise anything
            param = "messages" if chat else "prompt"
            raise InvalidRequest(f"the {param} could not be tokenized: {exc}", param=param) from None

    def _max_tokens(self, req, prompt: int, limit: int) -> int:
        asked, param = requested_max_tokens(req)
        if asked is not None and asked < 1:
            raise InvalidRequest(f"{param} must be at least 1, got {asked}", param=param)
        if prompt > limit - PROMPT_RESERVE:
            raise ContextTooLong(
                f"This model's maximum context length is {limit} tokens, of which a prompt may use "
                f"{limit - PROMPT_RESERVE}; the prompt has {prompt} tokens.",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            )
        room = limit - OUTPUT_RESERVE  # prompt + completion
        if asked is None:
            return self._within(req, min(self.config.default_max_tokens, room - prompt), "the default")
        if prompt + asked > room:
            raise ContextTooLong(
                f"This model's maximum context length is {limit} tokens, of which a request may use {room} (prompt "
                f"and completion). However, you requested {prompt + asked} tokens ({prompt} in the prompt, {asked} "
                "in the completion).",
                param=param,
            )
        return self._within(req, asked, param)

    @staticmethod
    def _within(req, max_tokens: int, what: str) -> int:
        """``max_tokens``, once SGLang's ``min_tokens`` (checked an integer >= 0 by the schema) fits under it."""
        least = getattr(req, "min_tokens", None)
        if least is not None and least > max_tokens:
            raise InvalidRequest(
                f"min_tokens must be at most max_tokens ({max_tokens}, {what}); got {least}",
                param="min_tokens",
            )
        return max_tokens

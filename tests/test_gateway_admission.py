"""Admission alone, against a fake cluster view (no Redis): which requests it refuses and with which error, and
what it makes of those it accepts (the engine endpoint, the body, the record, a resumable stream's progress)."""

from __future__ import annotations

import json
import time

import msgspec
import pytest

from flying.messages import Heartbeat
from flying.prefix import block_hashes, decode_chain, key_hash
from gateway.admission import OUTPUT_RESERVE, PROMPT_RESERVE, Admission, Admitted
from gateway.api.errors import ContextTooLong, InvalidRequest, ModelNotFound, NoLiveWorkers, NoRouter
from gateway.api.schemas import ChatCompletionRequest, CompletionRequest, decode
from gateway.cluster_view import ClusterView
from gateway.config import GatewayConfig


class FakeCluster:
    """What admission asks of the cluster view: the live engines (``reads`` counts the reads), whether a router
    dispatches, the context limit."""

    def __init__(self, beats: list[Heartbeat], router: bool = True) -> None:
        self.beats, self.router = beats, router
        self.reads: list[float] = []
        self.last_live = -1e9  # no engine seen live lately: no wait before the 503
        self.long_wait_s = 0.0  # the router's, as published

    workers_again = ClusterView.workers_again

    async def workers(self, max_age_s: float = 0.25) -> list[Heartbeat]:
        self.reads.append(max_age_s)
        return self.beats

    def router_missing(self) -> bool:
        return not self.router

    def limit(self, beats: list[Heartbeat]) -> int:
        return ClusterView.context_limit(beats)


class CountWords:
    def chat_ids(self, req):
        return [1] * (sum(len(m.text().split()) for m in req.messages) + 3)

    def completion(self, req):
        return len(req.prompt) if isinstance(req.prompt, list) else len(req.prompt.split())


ENGINE = Heartbeat(
    engine=0, url="http://e0", pid=1, model="m", context_len=64, max_total_tokens=64, ts=time.time()
)


def admission(beats=(ENGINE,), router: bool = True, counter=None, **config) -> Admission:
    cfg = GatewayConfig(model_path="unused", **({"default_max_tokens": 16} | config))
    return Admission(cfg, FakeCluster(list(beats), router), counter or CountWords())  # type: ignore[arg-type]


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi there"}]} | fields
    return decode(json.dumps(body).encode(), ChatCompletionRequest)


def completion(**fields) -> CompletionRequest:
    return decode(json.dumps({"model": "tiny-llama", "prompt": "a b c"} | fields).encode(), CompletionRequest)


async def test_a_long_request_of_normal_priority_may_wait_for_calm_beyond_its_budget():
    """The router holds a request no engine holds alone for a calm period, up to twice its long_wait_s: the
    gateway lets it wait that long (plus a margin) instead of ending it with 504 at its class's budget."""
    from gateway.admission import PATIENCE_MARGIN_S

    beats = [msgspec.structs.replace(ENGINE, engine=i, context_len=256, num_engines=2) for i in (0, 1)]
    adm = admission(beats)
    adm.cluster.long_wait_s = 100.0
    words = " ".join(["w"] * 70)
    long = chat(messages=[{"role": "user", "content": words}], max_tokens=8)
    got = await adm.admit(long, "normal")
    assert got.record.kv_tokens > 64 and got.patience_s == 200.0 + PATIENCE_MARGIN_S
    assert (await adm.admit(long, "high")).patience_s == 0.0  # never held for calm
    assert (await adm.admit(chat(max_tokens=8), "normal")).patience_s == 0.0  # one engine holds it
    adm.cluster.long_wait_s = 0.0  # the router does not hold long requests
    assert (await adm.admit(long, "low")).patience_s == 0.0


async def test_a_chat_request_is_made_into_its_record_and_the_engines_chat_body():
    adm = await admission().admit(chat(max_tokens=8), "high", "rid-1")
    assert isinstance(adm, Admitted) and adm.path == "/v1/chat/completions" and not adm.stream
    assert adm.resume is None
    assert adm.body["rid"] == "rid-1~0" and adm.body["priority"] == 2 and adm.body["max_tokens"] == 8
    rec = adm.record
    assert (rec.id, rec.priority, rec.prompt_tokens, rec.max_tokens) == ("rid-1", "high", 5, 8)


async def test_a_fresh_id_when_none_is_given_and_the_default_max_tokens_within_the_context():
    a = await admission().admit(chat(), "normal")
    b = await admission().admit(chat(), "normal")
    assert a.record.id != b.record.id and len(a.record.id) == 32
    assert a.record.max_tokens == 16, "the default"
    long = await admission().admit(chat(messages=[{"role": "user", "content": "w " * 50}]), "normal")
    assert long.record.max_tokens == 64 - OUTPUT_RESERVE - 53, "what the context has left"


async def test_a_streaming_chat_request_travels_as_a_resumable_token_id_completion():
    adm = await admission().admit(chat(stream=True), "normal")
    assert adm.stream and adm.path == "/v1/completions"
    assert adm.resume is not None and adm.resume.chat and adm.resume.prompt_ids == [1] * 5
    assert adm.body["prompt"] == [1] * 5
    assert decode_chain(adm.record.prefix) == (), "shorter than one block: no chain"


@pytest.mark.parametrize("stream", [False, True], ids=["engine-body", "resumable"])
async def test_a_prompt_cache_key_heads_the_chain_and_is_not_sent_to_the_engine(stream):
    adm = await admission().admit(chat(stream=stream, prompt_cache_key="user-7"), "normal")
    assert adm.record.keyed and decode_chain(adm.record.prefix) == (key_hash("user-7"),)
    assert "prompt_cache_key" not in adm.body
    big = admission([msgspec.structs.replace(ENGINE, context_len=256, max_total_tokens=256)])
    plain = await big.admit(completion(prompt=list(range(70))), "normal")
    keyed = await big.admit(completion(prompt=list(range(70)), prompt_cache_key="k"), "normal")
    assert not plain.record.keyed and decode_chain(plain.record.prefix) == tuple(
        block_hashes(list(range(70)))
    )
    assert decode_chain(keyed.record.prefix) == tuple(block_hashes(list(range(70)), key="k"))


async def test_a_resumable_stream_gets_the_counters_decoder_unless_special_tokens_are_kept():
    class Decoding(CountWords):
        def decode(self, ids):
            return ""

    counter = Decoding()
    adm = await admission(counter=counter).admit(chat(stream=True), "normal")
    assert adm.resume is not None and adm.resume.decode == counter.decode
    kept = await admission(counter=counter).admit(chat(stream=True, skip_special_tokens=False), "normal")
    assert kept.resume is not None and kept.resume.decode is None, (
        "the gateway's text would not be the engine's"
    )


async def test_a_stream_that_asks_for_logprobs_keeps_the_engines_own_endpoint():
    adm = await admission().admit(chat(stream=True, logprobs=True), "normal")
    assert adm.stream and adm.path == "/v1/chat/completions" and adm.resume is None


async def test_a_completion_with_a_text_prompt_learns_its_ids_from_the_first_chunk():
    adm = await admission().admit(completion(stream=True), "low")
    assert adm.path == "/v1/completions" and adm.body["priority"] == 0
    assert adm.resume is not None and adm.resume.prompt_ids is None


async def test_another_model_is_not_found():
    with pytest.raises(ModelNotFound, match="does not exist"):
        await admission().admit(chat(model="other"), "normal")


async def test_no_live_engine_is_looked_for_again_before_the_503():
    adm = admission(beats=())
    with pytest.raises(NoLiveWorkers):
        await adm.admit(chat(), "normal")
    assert adm.cluster.reads == [0.25, 0], "a cached read, then a fresh one"


async def test_no_router_dispatching_is_a_503():
    with pytest.raises(NoRouter):
        await admission(router=False).admit(chat(), "normal")


@pytest.mark.parametrize(
    ("fields", "error", "param"),
    [
        ({"max_tokens": 0}, InvalidRequest, "max_tokens"),
        ({"max_completion_tokens": 0}, InvalidRequest, "max_completion_tokens"),
        ({"max_tokens": 60}, ContextTooLong, "max_tokens"),
        ({"messages": [{"role": "user", "content": "w " * 61}]}, ContextTooLong, "messages"),
        ({"max_tokens": 3, "min_tokens": 10}, InvalidRequest, "min_tokens"),
        ({"min_tokens": 17}, InvalidRequest, "min_tokens"),
    ],
    ids=[
        "max-tokens-0",
        "max-completion-tokens-0",
        "over-the-context",
        "prompt-fills-the-context",
        "min-over-max",
        "min-over-the-default",
    ],  # fmt: skip
)
async def test_sizes_the_deployment_cannot_hold_are_refused_naming_the_parameter(fields, error, param):
    with pytest.raises(error) as caught:
        await admission().admit(chat(**fields), "normal")
    assert caught.value.param == param


async def test_a_prompt_the_tokenizer_rejects_is_the_clients_error():
    class Rejecting(CountWords):
        def chat_ids(self, req):
            raise ValueError("roles must alternate")

    with pytest.raises(InvalidRequest, match="could not be tokenized: roles must alternate") as caught:
        await admission(counter=Rejecting()).admit(chat(), "normal")
    assert caught.value.param == "messages"


async def test_logit_bias_names_token_ids_of_the_vocabulary():
    """The engine would refuse the key in its own words after the request waited its turn (SGLang: "must has
    keys in [0, 1023]"): refused at the door, naming the parameter."""

    class Vocabulary(CountWords):
        vocab = 1024

    counted = admission(counter=Vocabulary())
    await counted.admit(chat(logit_bias={"1023": 5}), "normal")
    with pytest.raises(InvalidRequest, match=r"vocabulary \(0 to 1023\); got 99999999") as caught:
        await counted.admit(chat(logit_bias={"12": 1, "99999999": 5}), "normal")
    assert caught.value.param == "logit_bias"


async def test_prompt_and_completion_fit_in_what_sglang_will_produce():
    """SGLang ends an output 2 tokens short of the context (max_req_len = context - 1, output < max_req_len -
    prompt): a request admitted gets every token it asked for, one that asks for more is refused at the door."""
    prompt = list(range(40))
    room = 64 - OUTPUT_RESERVE - len(prompt)
    ok = await admission().admit(completion(prompt=prompt, max_tokens=room), "normal")
    assert ok.record.max_tokens == ok.body["max_tokens"] == room
    with pytest.raises(ContextTooLong, match=f"a request may use {64 - OUTPUT_RESERVE}") as caught:
        await admission().admit(completion(prompt=prompt, max_tokens=room + 1), "normal")
    assert caught.value.param == "max_tokens"
    default = await admission(default_max_tokens=10_000).admit(completion(prompt=prompt), "normal")
    assert default.record.max_tokens == room, "the default fits too"


async def test_a_prompt_within_the_last_tokens_that_sglang_keeps_is_refused_at_the_door():
    """SGLang refuses a prompt of context - 6 tokens or more (after it waited its turn): the gateway refuses it
    first, in OpenAI's terms, and admits one a token shorter."""
    limit = 64 - PROMPT_RESERVE
    ok = await admission().admit(completion(prompt=list(range(limit)), max_tokens=1), "normal")
    assert ok.record.prompt_tokens == limit
    with pytest.raises(ContextTooLong) as caught:
        await admission().admit(completion(prompt=list(range(limit + 1)), max_tokens=1), "normal")
    assert caught.value.param == "prompt" and f"a prompt may use {limit}" in caught.value.message

"""Request bodies of the OpenAI-style endpoints as msgspec structs, and their semantic checks.

Decoding checks types; :func:`check_sampling` and friends check values. Anything wrong is an InvalidRequest
naming the offending parameter, never a 500. The fields SGLang's own OpenAI server accepts are either typed here,
passed through to it untouched (``Any``: SGLang validates them, and its 400 reaches the client), or refused with a
400 that says why (:data:`REFUSED`); a field neither knows is a 400 naming it. OpenAI's fields that change nothing
here are accepted and not forwarded (:data:`GATEWAY_ONLY`, :func:`for_engine`); ``service_tier`` maps to a priority
(:func:`resolve_priority`). docs/openai.md has the table.
"""

from __future__ import annotations

import re
import typing
from typing import Any, Literal

import msgspec

from flying.messages import Priority
from gateway.api.errors import InvalidRequest

Role = Literal["system", "user", "assistant", "developer", "tool"]
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]
PRIORITIES: tuple[str, ...] = ("high", "normal", "low")
SERVICE_TIER_PRIORITY: dict[str, Priority] = {
    "priority": "high",
    "default": "normal",
    "auto": "normal",
    "scale": "normal",
    "flex": "low",
}
# the tier a chat answer says it was served at (OpenAI's ``service_tier`` in the response): its final priority's
PRIORITY_TIER: dict[Priority, ServiceTier] = {"high": "priority", "normal": "default", "low": "flex"}


def answer_tier(req: Any, priority: Priority) -> ServiceTier | None:
    """The ``service_tier`` an answer to ``req`` served at ``priority`` carries: chat answers (and the Responses
    API's) have the field, as OpenAI's do; completions have none."""
    return PRIORITY_TIER[priority] if isinstance(req, ChatCompletionRequest) else None


class TextPart(msgspec.Struct, kw_only=True):
    type: Literal["text"]
    text: str


class Message(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Any = None  # passed through (an assistant's tool calls, a tool message's id)
    tool_call_id: Any = None
    reasoning_content: Any = None
    # what the openai client's model_dump() of an answer's message carries back in the next turn: accepted and
    # not sent on (the rendered prompt uses content); audio and the deprecated function_call only as null
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk (SGLang, vLLM)


class _Sampling(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # OpenAI's, accepted and not forwarded (GATEWAY_ONLY): nothing is stored, no tier but the priority exists
    store: bool | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    service_tier: ServiceTier | None = None  # a priority unless X-Priority or priority is given
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    ignore_eos: bool | None = None  # SGLang extension, forwarded
    priority: str | None = None  # flying-serving extension; the X-Priority header wins
    # passed through to SGLang as they are (it validates them):
    logit_bias: Any = None
    top_k: Any = None
    min_p: Any = None
    min_tokens: Any = None
    repetition_penalty: Any = None
    stop_token_ids: Any = None
    stop_regex: Any = None
    no_stop_trim: Any = None
    skip_special_tokens: Any = None
    regex: Any = None
    ebnf: Any = None
    response_format: Any = None
    lora_path: Any = None
    custom_params: Any = None
    cache_salt: Any = None
    extra_key: Any = None
    return_cached_tokens_details: Any = None


class ChatCompletionRequest(_Sampling, kw_only=True, omit_defaults=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Any = None
    separate_reasoning: Any = None
    stream_reasoning: Any = None
    chat_template_kwargs: Any = None
    continue_final_message: Any = None
    modalities: list[str] | None = None  # only ["text"]
    verbosity: Literal["low", "medium", "high"] | None = None  # for reasoning models: accepted, not forwarded


class CompletionRequest(_Sampling, kw_only=True, omit_defaults=True):
    """``prompt``: a string or token ids (one prompt), or a list of either (a batch: see :func:`split_prompts`);
    its shape is checked by :func:`check_completion` (msgspec unions hold one array type only)."""

    prompt: Any
    best_of: int | None = None  # accepted when equal to n: every sequence generated is returned
    echo: bool | None = None
    logprobs: int | None = None
    suffix: Any = None
    json_schema: Any = None


# SGLang accepts these, but they cannot work behind the gateway's queue, or not on this deployment:
REFUSED = {
    "rid": "the gateway names every request (send X-Request-Id for your own id)",
    "data_parallel_rank": "the router picks the engine",
    "session_id": "sessions live on one engine; the router may send the next request elsewhere",
    "session_params": "sessions live on one engine; the router may send the next request elsewhere",
    "input_ids": "send messages (the gateway counts their tokens with the chat template)",
    "return_hidden_states": "not served by the gateway",
    "return_routed_experts": "not served by the gateway",
    "routed_experts_start_len": "not served by the gateway",
    "custom_logit_processor": "not served by the gateway",
    "images_config": "multimodal input is not served",
    "video_config": "multimodal input is not served",
    "mm_processor_kwargs": "multimodal input is not served",
    "max_dynamic_patch": "multimodal input is not served",
    "min_dynamic_patch": "multimodal input is not served",
    "use_audio_in_video": "multimodal input is not served",
    "audio": "audio output is not served",
    "prediction": "predicted outputs are not served",
    "web_search_options": "web search is not served",
    "functions": "the deprecated functions parameter is not served (use tools)",
    "function_call": "the deprecated function_call parameter is not served (use tool_choice)",
}
# accepted from the client, never sent to the engine (they change nothing there, or the gateway applies them);
# ``prompt_cache_key`` is not sent either: admission takes it off for the router (gateway.admission)
GATEWAY_ONLY = (
    "store",
    "metadata",
    "safety_identifier",
    "service_tier",
    "modalities",
    "best_of",
    "prompt_cache_retention",
    "verbosity",
)
# A stream with any of these keeps the engine's own endpoint (it is not resumable on another engine: they change
# how the prompt is rendered, or constrain the output with state a continuation elsewhere would not have).
NOT_RESUMABLE = (
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "regex",
    "ebnf",
    "json_schema",
    "reasoning_effort",
    "separate_reasoning",
    "stream_reasoning",
    "chat_template_kwargs",
    "continue_final_message",
    "min_tokens",
    "suffix",
)


def constrained(req: object) -> bool:
    """The request constrains its output with a grammar (JSON mode or a schema, regex, EBNF, tools): SGLang keeps
    the grammar's state in the process that runs it, so a bound group's follower cannot hand the request to its
    leader (``QueuedRequest.leader_only``). One the gateway does not foresee (a server that gives every request a
    grammar) is refused by the follower and marked leader-only when it is queued again."""
    fmt = getattr(req, "response_format", None)
    if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
        return True
    if any(getattr(req, f, None) is not None for f in ("regex", "ebnf", "json_schema")):
        return True
    # tools: a forced call is a grammar, and SGLang gives "auto" one too for strict tools or a server's tool
    # strictness; a request with tools that may call one is kept off followers
    return bool(getattr(req, "tools", None)) and getattr(req, "tool_choice", None) != "none"


MAX_N = 16  # choices per request (each holds its own KV for its output)
# SGLang's "whole vocabulary" top_k (sampling_params.TOP_K_ALL); its sampler holds top_k in an int32 tensor, so a
# larger one stopped the engine's scheduler with an overflow, killing every request on it
TOP_K_MAX = 1 << 30
MAX_LOGPROBS = 20  # top log-probabilities per token (a completion's logprobs, a chat's top_logprobs)
_UNKNOWN = re.compile(r"unknown field `([^`]*)`(?: - at `\$\.?([^`]*)`)?")
_AT = re.compile(r"at `\$\.?([^`]*)`")


def decode(body: bytes, type_: type[_Sampling]) -> _Sampling:
    """Parse and type-check a JSON body, mapping msgspec's errors to InvalidRequest with the parameter path."""
    req = decode_struct(body, type_, REFUSED)
    assert isinstance(req, _Sampling)
    return req


def decode_struct(body: bytes, type_: type[msgspec.Struct], refused: dict[str, str]) -> msgspec.Struct:
    """:func:`decode` for any request struct; ``refused``: top-level fields known but refused, with why."""
    if not body.strip():
        raise InvalidRequest("request body is empty; expected a JSON object")
    try:
        try:
            return msgspec.json.decode(body, type=type_)
        except msgspec.ValidationError:
            if (without := _without_nulls(body)) is None:
                raise
            return msgspec.convert(without, type=type_)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        if u := _UNKNOWN.search(msg):
            field, where = u.group(1), u.group(2)
            param = f"{where}.{field}" if where else field
            why = refused.get(field) if not where else None
            detail = f"{field} is not supported here: {why}" if why else f"unknown parameter {param}"
            raise InvalidRequest(detail, param=param) from None
        m = _AT.search(msg)
        param = (m.group(1) or None) if m else None
        if missing := _MISSING.search(msg):  # the param is the missing field itself
            field = missing.group(1)
            raise InvalidRequest(readable(msg, param), param=f"{param}.{field}" if param else field) from None
        raise InvalidRequest(readable(msg, param), param=param) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply to be read") from None
    except ValueError as exc:  # UnicodeDecodeError (invalid UTF-8) and any other decoding failure
        raise InvalidRequest(f"request body is not valid UTF-8 JSON: {exc}") from None


def _without_nulls(body: bytes) -> dict | None:
    """The body's object without its top-level nulls (None when it has none): OpenAI's optional fields sent as
    null mean their defaults (``stream``, ``n``, ``audio``, ...), as clients that send every field do. Tried only
    when the body does not fit as it is, so a valid request pays nothing for it."""
    try:
        doc = msgspec.json.decode(body)
    except (msgspec.DecodeError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or None not in doc.values():
        return None
    return {k: v for k, v in doc.items() if v is not None}


_EXPECTED = re.compile(r"Expected `([^`]*)`, got `([^`]*)`")
_MISSING = re.compile(r"Object missing required field `([^`]*)`")
_TYPE_NAMES = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "a boolean",
    "array": "an array",
    "object": "an object",
    "null": "null",
}


_ENUM = re.compile(r"Invalid enum value (.+?)(?: - at `|$)")
_PART_TYPE = re.compile(r"content\[\d+\]\.type$")


def _enum_words(value: str, param: str | None) -> str:
    """A value outside a field's set, in words with the values it takes (msgspec names neither)."""
    if param and _PART_TYPE.search(param):
        return (
            f"{param}: only text content parts are served (got {value}: image, audio and file input are not)"
        )
    allowed = {"service_tier": tuple(SERVICE_TIER_PRIORITY), "role": typing.get_args(Role)}
    name = (param or "").rsplit(".", 1)[-1]
    if name in allowed:
        return f"{param} must be one of {', '.join(allowed[name])}; got {value}"
    return f"{param or 'a field'} does not take the value {value}"


def readable(msg: str, param: str | None) -> str:
    """msgspec's validation message in words: ``max_tokens must be an integer or null, got a string``."""
    if m := _ENUM.search(msg):
        return _enum_words(m.group(1), param)
    if m := _EXPECTED.search(msg):
        want = " or ".join(_TYPE_NAMES.get(t, t) for t in m.group(1).split(" | "))
        got = _TYPE_NAMES.get(m.group(2), m.group(2))
        return f"{param or 'the request body'} must be {want}, got {got}"
    if m := _MISSING.search(msg):
        where = f" in {param}" if param else ""
        return f"{m.group(1)} is required{where}"
    return f"invalid request: {msg}"


def check_sampling(req: _Sampling) -> None:
    if not 1 <= req.n <= MAX_N:
        raise InvalidRequest(f"n must be between 1 and {MAX_N}", param="n")
    if req.temperature is not None and not 0 <= req.temperature <= 2:
        raise InvalidRequest("temperature must be between 0 and 2", param="temperature")
    if req.top_p is not None and not 0 <= req.top_p <= 1:
        raise InvalidRequest("top_p must be between 0 and 1", param="top_p")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v is not None and not -2 <= v <= 2:
            raise InvalidRequest(f"{name} must be between -2 and 2", param=name)
    _check_extensions(req)
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > 4:
        raise InvalidRequest("at most 4 stop sequences are allowed", param="stop")
    if "" in stops:
        raise InvalidRequest(
            "stop sequences must not be empty (an empty one would end every answer at once)", param="stop"
        )
    if not req.model:
        raise InvalidRequest("model must be a non-empty string", param="model")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    check_metadata(req.metadata)
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:
        raise InvalidRequest("seed must be a 64-bit integer", param="seed")
    ids = req.stop_token_ids
    if ids is not None and not (isinstance(ids, list) and all(_is_int(t) and t >= 0 for t in ids)):
        raise InvalidRequest("stop_token_ids must be a list of token ids", param="stop_token_ids")
    _check_response_format(req.response_format)


METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's bounds


def check_metadata(metadata: dict[str, str] | None) -> None:
    """``metadata`` within OpenAI's bounds (16 pairs, keys up to 64 characters, values up to 512)."""
    if metadata is None:
        return
    if len(metadata) > METADATA_PAIRS:
        raise InvalidRequest(
            f"metadata holds at most {METADATA_PAIRS} pairs; got {len(metadata)}", param="metadata"
        )
    for k, v in metadata.items():
        if len(k) > METADATA_KEY_CHARS or len(v) > METADATA_VALUE_CHARS:
            raise InvalidRequest(
                f"metadata keys are at most {METADATA_KEY_CHARS} characters and values at most "
                f"{METADATA_VALUE_CHARS}; {k[:70]!r} is not",
                param="metadata",
            )


RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


def _check_response_format(fmt: Any) -> None:
    """``response_format`` as OpenAI's (or SGLang's ``structural_tag``); a ``json_schema`` one carries its schema
    (the engine's own error named an internal field, ``schema_``, and no parameter)."""
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise InvalidRequest(
            f"response_format must be an object whose type is one of {', '.join(RESPONSE_FORMATS)}; got {fmt!r}",
            param="response_format.type" if isinstance(fmt, dict) else "response_format",
        )
    if kind != "json_schema":
        return
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(
            'response_format of type json_schema needs json_schema: {"name": ..., "schema": {...}}',
            param="response_format.json_schema",
        )
    schema = spec.get("schema", spec.get("schema_"))
    if not isinstance(schema, dict | bool):
        raise InvalidRequest(
            "response_format.json_schema.schema must be a JSON schema (an object)",
            param="response_format.json_schema.schema",
        )


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _check_extensions(req: _Sampling) -> None:
    """``logit_bias`` and SGLang's numeric sampling extensions, checked here: the engine refuses bad ones with a
    Python exception's text, after the request has waited its turn."""
    if req.logit_bias is not None:
        if not isinstance(req.logit_bias, dict):
            raise InvalidRequest("logit_bias must map token ids to biases", param="logit_bias")
        for key, bias in req.logit_bias.items():
            if not (isinstance(key, str) and key.isdigit()):
                raise InvalidRequest(f"logit_bias keys must be token ids; got {key!r}", param="logit_bias")
            if not _number(bias) or not -100 <= bias <= 100:
                raise InvalidRequest(
                    f"logit_bias values must be between -100 and 100; got {bias!r} for {key}",
                    param="logit_bias",
                )
    if req.top_k is not None and not (
        _is_int(req.top_k) and (req.top_k == -1 or 1 <= req.top_k <= TOP_K_MAX)
    ):
        raise InvalidRequest(
            f"top_k must be -1 (off) or an integer from 1 to {TOP_K_MAX}; got {req.top_k!r}", param="top_k"
        )
    if req.min_tokens is not None and not (_is_int(req.min_tokens) and req.min_tokens >= 0):
        raise InvalidRequest(
            f"min_tokens must be an integer >= 0; got {req.min_tokens!r}", param="min_tokens"
        )
    if req.min_p is not None and not (_number(req.min_p) and 0 <= req.min_p <= 1):
        raise InvalidRequest(f"min_p must be between 0 and 1; got {req.min_p!r}", param="min_p")
    if req.repetition_penalty is not None and not (
        _number(req.repetition_penalty) and 0 < req.repetition_penalty <= 2
    ):
        raise InvalidRequest(
            f"repetition_penalty must be in (0, 2]; got {req.repetition_penalty!r}",
            param="repetition_penalty",
        )


def check_chat(req: ChatCompletionRequest) -> None:
    check_sampling(req)
    if not req.messages:
        raise InvalidRequest("messages must contain at least one message", param="messages")
    if all(not m.text() for m in req.messages):
        raise InvalidRequest("no message has any content", param="messages")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be between 0 and {MAX_LOGPROBS}", param="top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("logprobs must be true when top_logprobs is used", param="top_logprobs")
    if req.modalities is not None and req.modalities != ["text"]:
        raise InvalidRequest(
            f'modalities must be ["text"] (only text is served); got {req.modalities}', param="modalities"
        )
    for i, m in enumerate(req.messages):
        if m.role == "tool" and not (isinstance(m.tool_call_id, str) and m.tool_call_id):
            raise InvalidRequest(
                "a tool message answers a tool call: its tool_call_id is required",
                param=f"messages[{i}].tool_call_id",
            )
    _check_tools(req.tools, req.tool_choice)


def _check_tools(tools: Any, choice: Any) -> None:
    """``tools`` a list of functions with names; ``tool_choice`` one of none / auto / required or a function
    named among them (the engine's own error for a missing name named no parameter)."""
    names: list[str] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequest(f"tools must be a list of tools; got {_json_type(tools)}", param="tools")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise InvalidRequest(
                    'each tool must be {"type": "function", "function": {"name": ...}}',
                    param=f"tools[{i}].function" + (".name" if isinstance(fn, dict) else ""),
                )
            names.append(fn["name"])
    if choice is None or choice in ("none", "auto"):
        return
    if choice == "required" and names:
        return
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
    ):
        name = choice["function"].get("name")
        if name in names:
            return
        have = ", ".join(map(repr, names)) or "no tools were given"
        raise InvalidRequest(
            f"tool_choice names the function {name!r}, which is not among tools ({have})", param="tool_choice"
        )
    if choice == "required":
        raise InvalidRequest('tool_choice "required" needs tools', param="tool_choice")
    raise InvalidRequest(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}; '
        f"got {choice!r}",
        param="tool_choice",
    )


PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"


def check_completion(req: CompletionRequest) -> None:
    check_sampling(req)
    prompts(req.prompt)
    # more than the vocabulary stopped the engine's scheduler (top-k over the vocabulary: index out of range)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(
            f"logprobs must be between 0 and {MAX_LOGPROBS} (the most likely tokens to return at each position); "
            f"got {req.logprobs}",
            param="logprobs",
        )
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest(
            f"best_of must equal n (every sequence generated is returned); got best_of={req.best_of}, n={req.n}",
            param="best_of",
        )


def prompts(prompt: Any) -> list[str | list[int]]:
    """A completion's prompts, one or several, checked: each a non-empty string or a non-empty list of
    non-negative token ids. Raises InvalidRequest naming the one that is wrong."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_int(prompt[0])):
        batch, single = [prompt], True
    elif isinstance(prompt, list) and prompt:
        batch, single = prompt, False
    elif isinstance(prompt, list):
        raise InvalidRequest("prompt must not be an empty list", param="prompt")
    else:
        raise InvalidRequest(f"prompt must be {PROMPT_SHAPES}; got {_json_type(prompt)}", param="prompt")
    for i, p in enumerate(batch):
        _check_prompt(p, "prompt" if single else f"prompt[{i}]")
    return batch


def _check_prompt(p: Any, param: str) -> None:
    if isinstance(p, str):
        if not p:
            raise InvalidRequest(f"{param} must not be empty", param=param)
        return
    if not isinstance(p, list) or not p:
        got = "an empty list" if isinstance(p, list) else _json_type(p)
        raise InvalidRequest(f"{param} must be a non-empty string or token-id list; got {got}", param=param)
    try:  # (in C: a prompt may hold many thousands of ids)
        msgspec.convert(p, list[int])
        ok = min(p) >= 0
    except msgspec.ValidationError:
        ok = False
    if not ok:
        j, t = next((j, t) for j, t in enumerate(p) if not _is_int(t) or t < 0)
        raise InvalidRequest(
            f"{param}[{j}] must be a token id (a non-negative integer); got {t!r}", param=f"{param}[{j}]"
        )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _json_type(x: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "an object"}
    return "null" if x is None else names.get(type(x), type(x).__name__)


def split_prompts(req: CompletionRequest) -> list[CompletionRequest]:
    """A checked completion request as one request per prompt (a batch of N prompts is N requests, each with
    the same parameters and ``n`` choices); a single prompt in a list is a request of that prompt."""
    return [msgspec.structs.replace(req, prompt=p) for p in prompts(req.prompt)]


def for_engine(req: _Sampling) -> _Sampling:
    """``req`` without the fields the gateway accepts but does not forward (:data:`GATEWAY_ONLY`); ``top_p`` 0,
    which OpenAI takes as "the most likely token only" and SGLang refuses, as ``top_k`` 1."""
    change: dict[str, Any] = {f: None for f in GATEWAY_ONLY if getattr(req, f, None) is not None}
    if req.top_p == 0:
        change.update(top_p=None, top_k=1)
    return msgspec.structs.replace(req, **change) if change else req


def requested_max_tokens(req: _Sampling) -> tuple[int | None, str]:
    """The requested output limit and the parameter it came from."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def priority_param(header: str | None, body: str | None, service_tier: str | None) -> str | None:
    """Where a request asks for its priority, in :func:`resolve_priority`'s order (None: it asks for none)."""
    asked = (("X-Priority", header), ("priority", body), ("service_tier", service_tier))
    return next((param for param, value in asked if value is not None), None)


def resolve_priority(header: str | None, body: str | None, service_tier: str | None = None) -> Priority:
    """X-Priority header, else body field ``priority``, else OpenAI's ``service_tier`` (SERVICE_TIER_PRIORITY),
    else normal. An empty header is no header (a client that sets it from an unset variable)."""
    if header is not None and not header.strip():
        header = None
    if header is None and body is None and service_tier is not None:
        return SERVICE_TIER_PRIORITY[service_tier]
    for value, param in ((header, "X-Priority"), (body, "priority")):
        if value is None:
            continue
        v = value.strip().lower()
        if v not in PRIORITIES:
            raise InvalidRequest(f"{param} must be one of high, normal, low; got {value!r}", param=param)
        return v  # type: ignore[return-value]
    return "normal"


def parse(body: bytes, kind: str) -> ChatCompletionRequest | CompletionRequest:
    """The request body decoded and checked (InvalidRequest naming what is wrong)."""
    if kind == "chat":
        chat = decode(body, ChatCompletionRequest)
        assert isinstance(chat, ChatCompletionRequest)
        check_chat(chat)
        return chat
    completion = decode(body, CompletionRequest)
    assert isinstance(completion, CompletionRequest)
    check_completion(completion)
    return completion

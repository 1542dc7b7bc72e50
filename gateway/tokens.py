"""Prompt length in tokens, counted with the served model's own tokenizer and chat template."""

from __future__ import annotations

import functools
from collections.abc import Callable

from gateway.api.schemas import ChatCompletionRequest, CompletionRequest

# Text this long is encoded without holding the GIL (the Rust backend's ``encode`` holds it throughout: a 4 MB
# prompt stopped the gateway's event loop for 3 s even from another thread; ``encode_batch`` releases it), and the
# gateway tokenizes it on a thread.
LONG_TEXT_CHARS = 8192


class PromptCounter:
    def __init__(self, tokenizer_path: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(tokenizer_path)
        # A fast tokenizer's Rust backend, called directly: the same ids as ``self.tok(text)``, at a tenth of the
        # cost of the Python wrapper around it (~15 us against ~140 us for a short prompt).
        self.backend = self.tok.backend_tokenizer if self.tok.is_fast else None
        self.vocab = len(self.tok)  # token ids a prompt may hold: 0 .. vocab - 1
        self.render = _renderer(self.tok)

    def ids(self, text: str, special: bool) -> list[int]:
        """``text``'s token ids; ``special``: with the tokenizer's special tokens (e.g. BOS) added."""
        if self.backend is not None:
            if len(text) > LONG_TEXT_CHARS:
                return self.backend.encode_batch([text], add_special_tokens=special)[0].ids
            return self.backend.encode(text, add_special_tokens=special).ids
        return self.tok(text, add_special_tokens=special).input_ids

    def decode(self, ids: list[int]) -> str:
        """``ids`` as text, special tokens skipped (the engine's default)."""
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=True)
        # as SGLang's tokenizer decodes: no clean-up of spaces
        return str(self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        """The prompt's token ids as the engine's chat endpoint would make them (template, then tokenizer)."""
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        text: object
        if self.render is not None:
            text = self.render(messages=messages)
        else:
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # tokenize=False renders one conversation to text (a transformers that does not is not supported)
        if not isinstance(text, str):
            raise TypeError(f"the chat template rendered {type(text).__name__}, not text")
        return self.ids(text, special=False)

    def chat(self, req: ChatCompletionRequest) -> int:
        return len(self.chat_ids(req))

    def completion(self, req: CompletionRequest) -> int:
        """The prompt's length in tokens; ValueError for a token id outside the vocabulary (an engine would fail
        on it, not the request)."""
        if isinstance(req.prompt, list):
            if req.prompt and (top := max(req.prompt)) >= self.vocab:
                raise ValueError(
                    f"token id {top} is outside the model's vocabulary (ids 0 to {self.vocab - 1})"
                )
            return len(req.prompt)
        return len(self.ids(req.prompt, special=True))


def _renderer(tok) -> Callable[..., str] | None:
    """The chat template compiled once and rendered as ``apply_chat_template`` renders it (transformers' own
    compiler, the tokenizer's special tokens, no tools or documents), without that method's per-call work (a third
    of its ~75 us for a short conversation); None when this transformers has no such compiler or the tokenizer no
    template (then ``apply_chat_template`` it is)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        template = _compile_jinja_template(tok.get_chat_template())
    except (ImportError, ValueError, TypeError, AttributeError):
        return None
    specials = dict(tok.special_tokens_map)
    render = functools.partial(
        template.render, tools=None, documents=None, add_generation_prompt=True, **specials
    )
    return _shared_context(template, render.keywords) or render


def _shared_context(template, fixed: dict) -> Callable[..., str] | None:
    """``template`` rendered into a context whose variables (its globals and ``fixed``, merged once) are passed
    as they are: ``Template.render`` merges the template's globals (a ``ChainMap``) into a new dict on every call,
    three quarters of a short conversation's render (~13 us against ~3). The same text as ``Template.render`` on a
    probe conversation, else None (then that it is)."""
    try:
        from jinja2.runtime import new_context

        base = {**template.globals, **fixed}
        env, name, blocks, root = (
            template.environment,
            template.name,
            template.blocks,
            template.root_render_func,
        )

        def render(**variables) -> str:
            context = new_context(env, name, blocks, {**base, **variables}, True, None, None)
            return env.concat(root(context))

        probe = [{"role": "user", "content": "hi"}]
        if render(messages=probe) != template.render(messages=probe, **fixed):
            return None
    except Exception:  # noqa: BLE001 - another jinja's internals, or a template that refuses the probe
        return None
    return render

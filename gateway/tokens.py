"""Prompt length in tokens, counted with the served model's own tokenizer and chat template."""

from __future__ import annotations

from gateway.schemas import ChatCompletionRequest, CompletionRequest


class PromptCounter:
    def __init__(self, tokenizer_path: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(tokenizer_path)

    def chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        """The prompt's token ids as the engine's chat endpoint would make them (template, then tokenizer)."""
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tok(text, add_special_tokens=False).input_ids

    def chat(self, req: ChatCompletionRequest) -> int:
        return len(self.chat_ids(req))

    def completion(self, req: CompletionRequest) -> int:
        if isinstance(req.prompt, list):
            return len(req.prompt)
        return len(self.tok(req.prompt).input_ids)

"""Write a tiny random-initialised Llama with an offline-trained byte-level BPE tokenizer and a chat template.

    python -m worker_ext.tinymodel OUT_DIR --seed 0
    python -m worker_ext.tinymodel OUT_DIR --hidden 2048 --layers 8    # a larger model of the same kind

Deterministic from the seed and the size (weights and tokenizer); the default size is a few MB of safetensors.
Tests and the demo serve it in float32 so outputs can be compared exactly. The shape divides by 1, 2 and 4 so every
TP width can shard it. ``--hidden`` scales heads and intermediate with it (head_dim 128 from hidden 1024 up, as in
Llama-class models; KV heads a quarter of the heads), unless they are given.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "corpus.txt"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{{ '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyLlamaSpec:
    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 4096
    init_std: float = 0.05

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must divide by {self.num_attention_heads} heads"
            )
        for width in (1, 2, 4):
            if self.num_key_value_heads % width or self.intermediate_size % width:
                raise ValueError(f"kv heads and intermediate size must shard at TP width {width}")

    @classmethod
    def sized(
        cls,
        hidden: int,
        layers: int,
        heads: int | None = None,
        kv_heads: int | None = None,
        intermediate: int | None = None,
    ) -> TinyLlamaSpec:
        """A model of the same kind at another size; the default spec at hidden 256 and 4 layers."""
        if (
            hidden == cls.hidden_size
            and layers == cls.num_hidden_layers
            and heads is kv_heads is intermediate is None
        ):
            return cls()
        heads = heads or max(8, hidden // 128)
        kv_heads = kv_heads or max(4, heads // 4)
        intermediate = intermediate or (hidden * 11 // 4 + 3) // 4 * 4  # ~2.75 x hidden (Llama), divides by 4
        return cls(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            init_std=min(cls.init_std, hidden**-0.5),
        )


def train_tokenizer(vocab_size: int):
    """Byte-level BPE trained on the repo's corpus; wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.read_text().splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def build(out: Path, seed: int = 0, spec: TinyLlamaSpec | None = None) -> Path:
    """Write the model and tokenizer to ``out`` (created); return ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or TinyLlamaSpec()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec.vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "flying_tinymodel.json").write_text(json.dumps({"seed": seed, **asdict(spec)}, indent=2))
    return out


def ensure(out: Path, seed: int = 0, spec: TinyLlamaSpec | None = None) -> Path:
    """Build the model unless ``out`` already holds one built from the same seed and spec."""
    spec = spec or TinyLlamaSpec()
    marker = out / "flying_tinymodel.json"
    if marker.exists() and json.loads(marker.read_text()) == {"seed": seed, **asdict(spec)}:
        return out
    return build(out, seed, spec)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=TinyLlamaSpec.hidden_size)
    parser.add_argument("--layers", type=int, default=TinyLlamaSpec.num_hidden_layers)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--intermediate", type=int, default=None)
    args = parser.parse_args(argv)
    spec = TinyLlamaSpec.sized(args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate)
    path = build(args.out, args.seed, spec)
    size = sum(f.stat().st_size for f in path.iterdir())
    print(f"wrote {path} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()

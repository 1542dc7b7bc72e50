import hashlib

from worker_ext.tinymodel import build


def digest(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a, b, c = build(tmp_path / "a", 0), build(tmp_path / "b", 0), build(tmp_path / "c", 1)
    assert digest(a) == digest(b)
    assert digest(a)["model.safetensors"] != digest(c)["model.safetensors"]
    assert digest(a)["tokenizer.json"] == digest(c)["tokenizer.json"]


def test_tokenizer_round_trips_and_has_a_chat_template(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = "Hello! The river runs to the sea. 123 {json}"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<s><|user|>hi<|end|><|assistant|>"

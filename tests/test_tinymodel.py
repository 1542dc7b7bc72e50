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


def test_size_option_builds_a_larger_model_of_the_same_kind(tmp_path):
    import json

    from safetensors import safe_open

    from worker_ext.tinymodel import TinyLlamaSpec, main

    main([str(tmp_path / "m"), "--hidden", "512", "--layers", "2"])
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    spec = TinyLlamaSpec.sized(512, 2)
    assert (config["hidden_size"], config["num_hidden_layers"]) == (512, 2)
    assert config["intermediate_size"] == spec.intermediate_size and spec.intermediate_size % 4 == 0
    assert config["num_attention_heads"] % 4 == 0 and config["num_key_value_heads"] % 4 == 0
    with safe_open(tmp_path / "m" / "model.safetensors", "pt") as f:
        shape = f.get_slice("model.layers.1.mlp.gate_proj.weight").get_shape()
    assert shape == [spec.intermediate_size, 512]
    assert TinyLlamaSpec.sized(256, 4) == TinyLlamaSpec()  # the default size is the default spec

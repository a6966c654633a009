"""backends.models: the offline byte-level tokenizer, tiny Llama / Qwen2 checkpoints, and loading them back."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from backends.models import (
    CHAT_TOKENS,
    SPECIAL_TOKENS,
    SUPPORTED_MODEL_TYPES,
    TinyModelConfig,
    build_char_tokenizer,
    build_tiny_model,
    load_causal_lm,
    load_tokenizer,
    write_tiny_model,
)

TINY = dict(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_position_embeddings=64
)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny_dir(request, tmp_path_factory):
    config = TinyModelConfig(arch=request.param, **TINY)
    return config, write_tiny_model(tmp_path_factory.mktemp(request.param), config)


def test_char_tokenizer_round_trip():
    tok = build_char_tokenizer()
    ids = tok.encode("12+34=46")
    assert ids == [tok.convert_tokens_to_ids(c) for c in "12+34=46"]
    assert tok.decode(ids) == "12+34=46"
    assert tok.decode(tok.encode("What is 3 * 4? 12.")) == "What is 3 * 4? 12."
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.padding_side == "left"
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHAT_TOKENS) + 256  # a token per byte
    assert tok.encode("1~2") == [tok.convert_tokens_to_ids(c) for c in "1~2"]
    assert len(tok.encode("é")) == 2 and tok.decode(tok.encode("1 é~")) == "1 é~"  # UTF-8 bytes, nothing unknown
    assert tok.decode([*ids, tok.eos_token_id], skip_special_tokens=True) == "12+34=46"
    batch = tok(["1+1=", "10+10="], padding=True)
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2 and batch["attention_mask"][0][:2] == [0, 0]


def test_char_tokenizer_rejects_duplicate_words():
    with pytest.raises(ValueError, match="already a token"):
        build_char_tokenizer(words=["ab", "ab"])


def test_round_trip_same_logits(tiny_dir):
    config, path = tiny_dir
    model, tok = load_causal_lm(path)
    reference = build_tiny_model(config)
    assert type(model).__name__ == {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[config.arch]
    assert model.config.model_type == config.arch
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    ids = torch.tensor([tok.encode("12+34=46"), tok.encode("99+1=100")[:8]])
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, reference(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert tok.decode(tok.encode("12+34=46")) == "12+34=46"
    assert tok.encode("12+34=46") == build_char_tokenizer().encode("12+34=46")
    assert len(tok) == model.config.vocab_size


def test_weights_depend_only_on_the_seed():
    a, b = build_tiny_model(TinyModelConfig(**TINY)), build_tiny_model(TinyModelConfig(**TINY))
    c = build_tiny_model(TinyModelConfig(**TINY, seed=1))
    w = "model.layers.0.mlp.up_proj.weight"
    torch.testing.assert_close(a.state_dict()[w], b.state_dict()[w])
    assert not torch.equal(a.state_dict()[w], c.state_dict()[w])


def test_load_in_bfloat16(tiny_dir):
    _, path = tiny_dir
    model, _ = load_causal_lm(path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_causal_lm(tmp_path / "nope")


def test_path_is_a_file(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        load_causal_lm(f)


def test_dir_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_causal_lm(tmp_path)


def test_dir_without_weights(tiny_dir, tmp_path):
    _, path = tiny_dir
    shutil.copy(path / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_causal_lm(tmp_path)


def test_unsupported_model_type(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_embd=64, n_layer=1, n_head=2).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gpt2"
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'.*supported: llama, qwen2"):
        load_causal_lm(tmp_path)
    assert SUPPORTED_MODEL_TYPES == ("llama", "qwen2")


def test_missing_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_tokenizer(tmp_path)


def test_config_validation():
    with pytest.raises(ValueError, match=r"head_dim = hidden_size / num_heads = 64/4 = 16 must be >= 32"):
        TinyModelConfig(hidden_size=64, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="arch must be one of"):
        TinyModelConfig(arch="gpt2")
    with pytest.raises(ValueError, match="not divisible by num_kv_heads"):
        TinyModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        TinyModelConfig(hidden_size=100, num_heads=3)
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        TinyModelConfig(num_layers=0)
    with pytest.raises(TypeError, match="hidden"):
        TinyModelConfig(hidden=64)
    assert TinyModelConfig().head_dim == 64


def test_default_config_is_platform_config_b():
    model = build_tiny_model(TinyModelConfig())
    assert 2.8e6 < sum(p.numel() for p in model.parameters()) < 3.0e6

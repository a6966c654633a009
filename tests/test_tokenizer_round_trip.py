"""Every tokenizer rlfunc writes gives back the text it encoded, loaded the way users and vLLM load it.

``AutoTokenizer`` rebuilds a ``model_type: qwen2`` dir's tokenizer as a ``Qwen2Tokenizer`` (byte-level
pre-tokenizer and decoder, NFC) from the vocabulary of ``tokenizer.json`` alone: a character-level vocabulary
lost every space and every character outside it that way. The property: for any text ``t`` (no lone surrogates),
``decode(encode(t)) == NFC(t)`` for the tokenizer as built, as ``AutoTokenizer`` loads each dir rlfunc writes
(tiny Qwen2 / Llama models, a reward model, a task's ``tiny_words``), and after the recipes' export of the
loaded tokenizer (``final_model/``, ``sft_model/``); and every one of them gives the same ids.
"""

from __future__ import annotations

import unicodedata

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from backends.checkpoint.hf_export import export_hf
from backends.models import (
    CHAT_TOKENS,
    SPECIAL_TOKENS,
    TinyModelConfig,
    build_char_tokenizer,
    build_tiny_model,
    load_tokenizer,
    write_tiny_model,
    write_tiny_reward_model,
)
from experiments.tasks import calculator

TINY = dict(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=64)
#: a task's tokenizer words: the calculator preset's, and ones with spaces and characters outside ASCII
WORDS = (*calculator.TOKENIZER_WORDS, " the answer is ", "café au lait")


class Holder:
    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict:
    """name -> (tokenizer as rlfunc built it, the same loaded back by AutoTokenizer from the dir rlfunc wrote)."""
    root = tmp_path_factory.mktemp("tokenizers")
    built, words = build_char_tokenizer(), build_char_tokenizer(words=WORDS)
    dirs = {
        "tiny qwen2": (built, write_tiny_model(root / "qwen2", TinyModelConfig(**TINY), built)),
        "tiny llama": (built, write_tiny_model(root / "llama", TinyModelConfig(arch="llama", **TINY), built)),
        "tiny qwen2 with words": (words, write_tiny_model(root / "words", TinyModelConfig(**TINY), words)),
        "reward model": (built, write_tiny_reward_model(root / "rm", TinyModelConfig(**TINY), built)),
    }
    # the recipes export the tokenizer they loaded (final_model/, sft_model/): a Qwen2Tokenizer saved again
    for name in ("tiny qwen2", "tiny qwen2 with words"):
        src, path = dirs[name]
        exported = export_hf(
            Holder(build_tiny_model(TinyModelConfig(**TINY), src)),
            root / f"{name} export".replace(" ", "_"),
            tokenizer=load_tokenizer(path),
        )
        dirs[f"{name}, exported"] = (src, exported)
    return {
        name: (src, AutoTokenizer.from_pretrained(path, local_files_only=True)) for name, (src, path) in dirs.items()
    }


def texts(words: tuple[str, ...] = ()) -> st.SearchStrategy[str]:
    """Any text, with special tokens, chat tokens and words among it."""
    pieces = st.one_of(
        st.text(st.characters(exclude_categories=("Cs",)), max_size=12),
        st.sampled_from(SPECIAL_TOKENS + CHAT_TOKENS + words + (" ", "\n", "  ", "\t")),
    )
    return st.lists(pieces, max_size=8).map("".join)


def test_the_qwen2_dir_loads_as_qwen2s_own_tokenizer(written):
    """What made the loss happen: a Qwen2 dir's tokenizer is Qwen2's class, whatever tokenizer_config.json says."""
    assert type(written["tiny qwen2"][1]).__name__ == "Qwen2Tokenizer"
    assert type(written["tiny llama"][1]).__name__ == "TokenizersBackend"


@pytest.mark.parametrize(
    "name",
    [
        "tiny qwen2",
        "tiny llama",
        "tiny qwen2 with words",
        "reward model",
        "tiny qwen2, exported",
        "tiny qwen2 with words, exported",
    ],
)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_written_tokenizer_round_trips_any_text(written, name, data):
    built, loaded = written[name]
    text = data.draw(texts(WORDS if "words" in name else ()))
    want = unicodedata.normalize("NFC", text)
    ids = built.encode(text)
    assert loaded.encode(text) == ids
    assert built.decode(ids) == want
    assert loaded.decode(ids) == want
    assert max(ids, default=0) < len(loaded) == len(built)


def test_the_issue_s_prompts_keep_their_spaces(written):
    _, loaded = written["tiny qwen2"]
    for text in ("Which is largest: 71 50 23?", "error: the tool call is not valid JSON", "café ~ naïve"):
        assert loaded.decode(loaded.encode(text)) == text
    chat = loaded.apply_chat_template(
        [{"role": "user", "content": "Which is largest: 71 50 23?"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|user|>Which is largest: 71 50 23?<eos><|assistant|>"
    assert loaded.decode(loaded.encode(chat), skip_special_tokens=True) == "Which is largest: 71 50 23?"


def test_words_are_one_token_and_a_word_that_cannot_decode_is_refused():
    tok = build_char_tokenizer(words=WORDS)
    for word in WORDS:
        assert len(tok.encode(word)) == 1, word
    with pytest.raises(ValueError, match="does not decode back to itself"):
        build_char_tokenizer(words=["héllo"])
    with pytest.raises(ValueError, match="single character or already a token"):
        build_char_tokenizer(words=["ab", "ab"])


def test_the_calculator_preset_s_words_arrive_whole():
    """A preset's list of strings reaches the config item by item (they hold commas and edge spaces), so a tool
    call is a dozen tokens, within the preset's 16 per turn."""
    from backends.config import apply_overrides
    from experiments import grpo

    cfg = apply_overrides(grpo.Config(), ["preset=demo/calculator"], presets_dir=grpo.PRESETS)
    assert cfg.model.tiny_words == calculator.TOKENIZER_WORDS
    tok = build_char_tokenizer(words=cfg.model.tiny_words)
    assert len(tok.encode(calculator.tool_call(900, 115))) == 11 < cfg.rollout.max_new_tokens

"""Local Hugging Face causal LMs: an offline byte-level tokenizer, tiny random models, and loading.

Nothing here touches the network: the tokenizer is built with ``tokenizers``, tiny models are random
initialised and written with ``save_pretrained`` (safetensors), and :func:`load_causal_lm` reads a local
directory with ``local_files_only=True``, so a tiny test model and a real Llama / Qwen2 checkpoint go
through the same loading code.
"""

from __future__ import annotations

import contextlib
import json
import os
import string
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import attrs
import torch

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "SPECIAL_TOKENS",
    "CHAT_TOKENS",
    "CHAR_CHAT_TEMPLATE",
    "build_char_tokenizer",
    "byte_symbols",
    "QWEN2_PRETOKENIZE_REGEX",
    "TinyModelConfig",
    "ModelConfig",
    "build_tiny_model",
    "write_tiny_model",
    "load_causal_lm",
    "load_tokenizer",
    "VALUE_HEAD_INITS",
    "build_tiny_classifier",
    "write_tiny_value_model",
    "write_tiny_reward_model",
    "load_value_model",
]

#: ``config.model_type`` values :func:`load_causal_lm` accepts (the Llama and Qwen2 families).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

#: Special tokens of the char tokenizer, in id order (``<pad>`` is id 0).
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")

#: The chat tokens of the char tokenizer, one token each, after the characters: role markers and the
#: markers of a tool call and its result, so that a chat turn costs a few tokens, not a few dozen.
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<tool_call>", "</tool_call>")

#: The char tokenizer's chat template: each message is its role token, its content and ``<eos>`` (the
#: end of a turn, which is also where sampling stops); the generation prompt is ``<|assistant|>``.
CHAR_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<eos>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

# JSON and code characters come last, so the ids of the earlier ones stay what they were
_DEFAULT_CHARS = (
    string.digits + "+-*=" + " " + string.ascii_lowercase + string.ascii_uppercase + ".,:;!?()/" + "{}[]\"'_#<>%&|\n"
)

#: Qwen2's pre-tokenizer split (transformers' ``Qwen2Tokenizer``). The tiny tokenizer uses Qwen2's whole pipeline
#: because ``AutoTokenizer`` rebuilds any ``model_type: qwen2`` dir's tokenizer with it, keeping only the vocabulary
#: of ``tokenizer.json``: with the same pipeline on both sides every loader gives the same ids.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable symbol table (what ``tokenizers``' ByteLevel pre-tokenizer writes for each byte):
    printable Latin-1 bytes stand for themselves, the others (space, control bytes, ...) for ``chr(256 + k)``."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + k) for k, b in enumerate(moved)}}


def build_char_tokenizer(*, words: Sequence[str] = (), model_max_length: int = 256) -> Any:
    """A byte-level ``PreTrainedTokenizerFast`` built offline: one token per byte (so one per ASCII character),
    with a chat template.

    Ids: ``<pad>=0, <bos>=1, <eos>=2, <unk>=3``, then the common characters (digits, ``+-*=``, space, letters,
    punctuation, JSON characters and newline: 92 symbols), then :data:`CHAT_TOKENS`, then the other 164 bytes,
    then ``words``: multi-character strings that encode as one (ordinary, not special) token wherever they
    occur, for a task's frequent text such as the fixed part of its tool-call JSON. Every text round-trips
    (``decode(encode(t)) == t`` for NFC-normalised text: the pipeline NFC-normalises, as Qwen2's does; a
    character outside ASCII costs its UTF-8 bytes), whether the tokenizer is used as built or loaded back from
    a saved dir by ``AutoTokenizer`` (as a ``Qwen2Tokenizer`` for a Qwen2 model dir: see
    :data:`QWEN2_PRETOKENIZE_REGEX`). Encoding adds no special tokens. Padding is on the left, which is what
    batched generation needs. ``apply_chat_template`` renders :data:`CHAR_CHAT_TEMPLATE`, so chat prompts go
    through the same path as a real instruct model's.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = byte_symbols()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in _DEFAULT_CHARS:
        vocab[symbols[ord(ch)]] = len(vocab)
    for tok in CHAT_TOKENS:
        vocab[tok] = len(vocab)
    for symbol in symbols.values():
        vocab.setdefault(symbol, len(vocab))
    for word in words:
        if len(word) < 2 or word in vocab or word in _DEFAULT_CHARS:
            raise ValueError(f"tokenizer word {word!r} is a single character or already a token")
        vocab[word] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    # whole-token matches before the byte split (and dropped by skip_special_tokens)
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + CHAT_TOKENS])
    core.add_tokens([AddedToken(w, special=False, normalized=False) for w in words])
    for word in words:  # the byte-level decoder reads a token's characters as bytes where it can
        if core.decode(core.encode(word).ids) != word:
            raise ValueError(
                f"tokenizer word {word!r} does not decode back to itself (a word mixing characters "
                "outside ASCII with no space); leave it out, its bytes are tokens already"
            )
    return PreTrainedTokenizerFast(
        chat_template=CHAR_CHAT_TEMPLATE,
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def _validate_arch(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if value not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"TinyModelConfig.arch must be one of {SUPPORTED_MODEL_TYPES}, got {value!r}")


def _positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"TinyModelConfig.{attribute.name} must be >= 1, got {value}")


@attrs.frozen
class TinyModelConfig:
    """A small random-init Llama / Qwen2 decoder (defaults: the benchmarks' config B, about 2.9M params).

    ``head_dim = hidden_size // num_heads`` must be at least 32 (vLLM's CPU attention needs it).
    """

    arch: str = attrs.field(default="qwen2", validator=_validate_arch)  #: "qwen2" or "llama"
    hidden_size: int = attrs.field(default=256, validator=_positive)  #: model width
    num_layers: int = attrs.field(default=4, validator=_positive)  #: decoder layers
    num_heads: int = attrs.field(default=4, validator=_positive)  #: query heads
    num_kv_heads: int = attrs.field(default=2, validator=_positive)  #: key/value heads (GQA)
    intermediate_size: int = attrs.field(default=688, validator=_positive)  #: SwiGLU MLP width
    tie_word_embeddings: bool = True  #: lm_head shares the input embedding
    max_position_embeddings: int = attrs.field(default=256, validator=_positive)  #: context length
    rope_theta: float = 10000.0  #: RoPE base frequency
    initializer_range: float = 0.02  #: std of the random init (HF's default 0.02)
    seed: int = 0  #: weight init seed (the global RNG is left untouched)

    def __attrs_post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if self.head_dim < 32:
            raise ValueError(
                f"head_dim = hidden_size / num_heads = {self.hidden_size}/{self.num_heads} = {self.head_dim}"
                " must be >= 32 (vLLM's CPU attention needs it)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@attrs.frozen
class ModelConfig:
    """The policy model a recipe starts from."""

    #: a local Hugging Face dir (Llama / Qwen2 family) used as it is; empty: a tiny random model (model.tiny) in the
    #: run dir
    path: str = ""
    #: the tiny model written when model.path is empty (char tokenizer with a chat template)
    tiny: TinyModelConfig = TinyModelConfig()
    #: the tiny model's tokenizer: strings that become one token each (e.g. the fixed part of a task's tool-call JSON)
    tiny_words: tuple[str, ...] = attrs.field(default=(), converter=tuple)


def _hf_config(config: TinyModelConfig, tokenizer: Any) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_theta=config.rope_theta,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        rms_norm_eps=1e-6,
        initializer_range=config.initializer_range,
    )
    if config.arch == "qwen2":
        return Qwen2Config(**common)
    return LlamaConfig(**common)


def build_tiny_model(config: TinyModelConfig = TinyModelConfig(), tokenizer: Any = None) -> Any:
    """The in-memory random-init HF model (``Qwen2ForCausalLM`` / ``LlamaForCausalLM``, fp32, eval mode).

    The weights depend only on ``config`` (seeded by ``config.seed`` inside ``torch.random.fork_rng``,
    so the caller's global RNG is not touched). The vocabulary is the tokenizer's (default: the char
    tokenizer of :func:`build_char_tokenizer`).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = (
        tokenizer if tokenizer is not None else build_char_tokenizer(model_max_length=config.max_position_embeddings)
    )
    hf_config = _hf_config(config, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model.eval()


def write_tiny_model(
    out_dir: str | os.PathLike, config: TinyModelConfig = TinyModelConfig(), tokenizer: Any = None
) -> Path:
    """Write :func:`build_tiny_model`'s model as a real HF checkpoint dir (config, safetensors, tokenizer).

    Returns the directory (created if needed).
    """
    out = Path(out_dir)
    tokenizer = (
        tokenizer if tokenizer is not None else build_char_tokenizer(model_max_length=config.max_position_embeddings)
    )
    model = build_tiny_model(config, tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def check_model_dir(path: Path) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(
            f"model path {str(path)!r} is not a directory (expected a Hugging Face checkpoint dir)"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{str(path)!r} has no config.json: not a Hugging Face checkpoint dir")
    try:
        hf_config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{str(config_file)!r} is not valid JSON ({e})") from None
    if not isinstance(hf_config, dict):
        raise ValueError(f"{str(config_file)!r} must hold a JSON object, got {type(hf_config).__name__}")
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r} in {str(config_file)!r}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    has_weights = any((path / f).is_file() for f in _WEIGHT_FILES) or any(path.glob("*.safetensors"))
    if not has_weights:
        raise FileNotFoundError(
            f"{str(path)!r} has a config.json but no weights (looked for {', '.join(_WEIGHT_FILES)} or *.safetensors)"
        )
    return hf_config


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer saved in a local HF dir (offline); a clear error if there is none."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise FileNotFoundError(f"{str(path)!r} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # a damaged file surfaces as whatever its parser raises
        raise ValueError(f"cannot load the tokenizer in {str(path)!r}: {type(e).__name__}: {e}") from e
    if tokenizer.pad_token is None:  # padding needs a token: the end-of-sequence one, as verl does
        if tokenizer.eos_token is None:
            raise ValueError(
                f"the tokenizer in {str(path)!r} has neither a pad token nor an eos token; set "
                "pad_token in its tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` from a local HF dir of the Llama or Qwen2 family, offline.

    Errors name the problem: a missing dir, no ``config.json``, an unsupported ``model_type`` (listing
    the supported ones), no weight files. The model comes back in eval mode on ``device`` in ``dtype``.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    check_model_dir(path)
    try:
        with quiet_transformers():  # its load report is replaced by the checks below
            model, info = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=dtype,
                local_files_only=True,
                attn_implementation=attn_implementation,
                output_loading_info=True,
                ignore_mismatched_sizes=True,
            )
    except Exception as e:  # a truncated safetensors file, a config.json that transformers refuses, ...
        raise ValueError(f"cannot load the model in {str(path)!r}: {type(e).__name__}: {e}") from e
    check_loaded_weights(path, info)
    model.to(device)
    model.eval()
    tokenizer = load_tokenizer(path)
    check_vocab(path, model, tokenizer)
    return model, tokenizer


def check_loaded_weights(path: Path, info: Mapping[str, Any]) -> None:
    """Weights whose shape does not fit ``config.json``, or that the files lack, are an error naming them
    (transformers would re-initialise them at random and only log it)."""
    mismatched = [
        f"{key}: file {tuple(saved)}, config.json {tuple(wanted)}" for key, saved, wanted in info["mismatched_keys"]
    ]
    if mismatched:
        raise ValueError(
            f"the weights in {str(path)!r} do not fit its config.json ({len(mismatched)} of other shape): "
            + "; ".join(sorted(mismatched)[:4])
        )
    if info["missing_keys"]:
        raise ValueError(
            f"the weight files in {str(path)!r} lack {len(info['missing_keys'])} weight(s) of the model, "
            f"e.g. {sorted(info['missing_keys'])[:3]}"
        )


def check_vocab(path: Path, model: Any, tokenizer: Any) -> None:
    """Every token id the tokenizer can give (the pad id too) has a row in the model's embedding."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ValueError(
            f"the tokenizer in {str(path)!r} has {len(tokenizer)} tokens but the model embeds only {rows} "
            "(config.json vocab_size): the tokenizer belongs to another model"
        )


# ------------------------------------------------------------------ value models and reward models
#
# Both are the causal LM's backbone (``model.*``) with a 1-output linear head ``score`` on the last
# hidden state instead of ``lm_head``: ``*ForTokenClassification`` (a value per token: the critic) and
# ``*ForSequenceClassification`` (one score per sequence, no bias: the reward model), ``num_labels=1``.

#: How :func:`load_value_model` initialises a value head that the checkpoint does not have.
VALUE_HEAD_INITS = ("normal", "zero")


def build_tiny_classifier(
    config: TinyModelConfig = TinyModelConfig(), tokenizer: Any = None, *, kind: str = "token"
) -> Any:
    """A random-init tiny ``*ForTokenClassification`` (``kind="token"``, a value model) or
    ``*ForSequenceClassification`` (``kind="sequence"``, a reward model) with one label, fp32, eval mode.

    Seeded by ``config.seed`` like :func:`build_tiny_model` (the global RNG is left untouched). Dropout
    before the value head is 0 (``classifier_dropout=0.0``, as verl sets for its critic).
    """
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    classes = {"token": AutoModelForTokenClassification, "sequence": AutoModelForSequenceClassification}
    if kind not in classes:
        raise ValueError(f"kind must be one of {tuple(classes)}, got {kind!r}")
    tokenizer = (
        tokenizer if tokenizer is not None else build_char_tokenizer(model_max_length=config.max_position_embeddings)
    )
    hf_config = _hf_config(config, tokenizer)
    hf_config.num_labels = 1
    hf_config.classifier_dropout = 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = classes[kind].from_config(hf_config, dtype=torch.float32)
    return model.eval()


def _write_classifier(out_dir: str | os.PathLike, config: TinyModelConfig, tokenizer: Any, kind: str) -> Path:
    out = Path(out_dir)
    tokenizer = (
        tokenizer if tokenizer is not None else build_char_tokenizer(model_max_length=config.max_position_embeddings)
    )
    model = build_tiny_classifier(config, tokenizer, kind=kind)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def write_tiny_value_model(
    out_dir: str | os.PathLike, config: TinyModelConfig = TinyModelConfig(), tokenizer: Any = None
) -> Path:
    """Write a random-init tiny value model (``*ForTokenClassification``, one label) as a HF dir."""
    return _write_classifier(out_dir, config, tokenizer, "token")


def write_tiny_reward_model(
    out_dir: str | os.PathLike, config: TinyModelConfig = TinyModelConfig(), tokenizer: Any = None
) -> Path:
    """Write a random-init tiny reward model (``*ForSequenceClassification``, one label) as a HF dir."""
    return _write_classifier(out_dir, config, tokenizer, "sequence")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' load report for the duration (the caller checks the missing keys itself)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def load_value_model(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    value_head_init: str = "normal",
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> tuple[Any, Any]:
    """Load ``(value_model, tokenizer)``: a ``*ForTokenClassification`` with ``num_labels=1`` (verl's critic).

    ``path`` is a local HF dir of the Llama / Qwen2 family holding either

    - a **value model** (``architectures`` ``*ForTokenClassification``, one label): loaded as is;
    - a **causal LM** (``*ForCausalLM``): its backbone weights (``model.*``) are loaded and the value
      head ``score`` (``hidden -> 1``, with bias) is new. ``value_head_init="normal"`` draws its weight
      from N(0, ``initializer_range``) and zeroes the bias, the distribution HF's (and so verl's) fresh
      head has, but from a ``torch.Generator`` seeded by ``seed``: every rank builds the same head and a
      run is reproducible. ``"zero"`` zeroes the head (values start at 0; the backbone then gets no
      gradient until the head has moved, one step).

    The tokenizer is None when the dir has none (an exported critic). Dropout before the head is 0
    (``classifier_dropout=0.0``, as verl forces). Any other architecture,
    or a value model with ``num_labels != 1``, is an error naming it; so is a checkpoint missing
    backbone weights.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    if value_head_init not in VALUE_HEAD_INITS:
        raise ValueError(f"value_head_init must be one of {VALUE_HEAD_INITS}, got {value_head_init!r}")
    path = Path(path)
    raw = check_model_dir(path)
    archs = raw.get("architectures") or []
    is_value_model = any(a.endswith("ForTokenClassification") for a in archs)
    is_causal_lm = any(a.endswith("ForCausalLM") for a in archs)
    if not (is_value_model or is_causal_lm):
        raise ValueError(
            f"{str(path)!r} has architectures {archs}: a critic loads a value model (*ForTokenClassification, "
            "num_labels=1) or initialises one from a causal LM (*ForCausalLM)"
        )
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    if is_value_model and hf_config.num_labels != 1:
        raise ValueError(f"{str(path)!r} is a token classifier with {hf_config.num_labels} labels; a value model has 1")
    hf_config.num_labels = 1
    hf_config.classifier_dropout = 0.0
    with quiet_transformers():
        model, info = AutoModelForTokenClassification.from_pretrained(
            path,
            config=hf_config,
            dtype=dtype,
            local_files_only=True,
            attn_implementation=attn_implementation,
            output_loading_info=True,
        )
    missing = set(info["missing_keys"])
    head = {n for n, _ in model.score.named_parameters(prefix="score")}
    if missing - head or (is_value_model and missing):
        raise ValueError(f"{str(path)!r} is missing weights {sorted(missing)}; cannot build a value model from it")
    if missing:  # a fresh head on a causal LM backbone
        with torch.no_grad():
            weight = model.score.weight
            if value_head_init == "normal":
                g = torch.Generator().manual_seed(seed)
                std = getattr(hf_config, "initializer_range", 0.02)
                weight.copy_(torch.randn(weight.shape, generator=g, dtype=torch.float32).mul_(std))
            else:
                weight.zero_()
            if model.score.bias is not None:
                model.score.bias.zero_()
    model.to(device)
    model.eval()
    try:
        tokenizer = load_tokenizer(path)
    except FileNotFoundError:  # a value model reads the actor's token ids; its own tokenizer is optional
        tokenizer = None
    return model, tokenizer

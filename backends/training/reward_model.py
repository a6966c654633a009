"""Reward-model role: a Hugging Face sequence classifier that scores each (prompt, response) row, forward-only.

API::

    rm = build_reward_model(path, env, RewardModelConfig(micro_batch_size=16))
    rm_scores = score(rm, batch)                                      # (b,) fp32, no grad
    batch = batch.replace(scores=combine_rewards(batch.scores, rm_scores, rm_weight=0.5))

The model is ``*ForSequenceClassification`` with ``num_labels=1`` (Llama / Qwen2 family, a local HF
dir; :func:`backends.models.write_tiny_reward_model` writes a tiny random one). It runs in eval mode
under ``torch.inference_mode``, micro-batched, and is never trained. Placement: by default every rank
holds a full replica (forward-only, no collectives; each rank scores its own rows); with
``RewardModelConfig(shard=True)`` its weights are FSDP2-sharded over all ranks like the reference
model, and every rank must then call :func:`score` in step (the micro-batch count is agreed on with
one all-reduce, ranks with fewer rows run dummy micro-batches).

**Which token is scored.** The score is the head's output at the last token of prompt + response:
the last ``response_mask`` position, or the last prompt token when the response is empty. The index
is computed from the masks (prompts left-padded, responses right-padded), not from
``pad_token_id`` as HF's ``*ForSequenceClassification.forward`` does (rightmost token that is not
the pad id). The two agree whenever padding holds ``pad_token_id`` and no real token equals it; they
differ for tokenizers whose pad token *is* the EOS token (Qwen2.5 base models, for one), where HF's
rule would skip the EOS that ends the response. The per-token head output is taken with a forward
hook on the ``score`` layer, so HF's pooling result is not used.

Differences from verl (whose discriminative reward model runs behind a vLLM / SGLang server): verl
decodes the response, strips EOS, re-applies the reward model's chat template and re-tokenizes; here
the reward model reads the actor's token ids as they are (it must share the actor's tokenizer: an id
beyond its vocabulary is an error), EOS included. verl uses the reward model's score *instead of* the
rule-based reward; :func:`combine_rewards` does that with ``rule_scores=None`` and adds the two
otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import attrs
import torch
from torch import Tensor, nn

from backends.distributed.setup import DistEnv, device_mesh, init_distributed
from backends.distributed.sharded_state import reshard
from backends.models import check_model_dir, load_tokenizer, quiet_transformers
from backends.training.common import (
    all_reduce_max,
    check_batch,
    dummy_micro_batch,
    micro_batches,
    to_device,
    trim_micro_batch,
)
from rlfunc.batch import RolloutBatch
from rlfunc.checks import bind, check_finite, check_floating

__all__ = [
    "RewardModelConfig",
    "RewardModel",
    "load_reward_model",
    "build_reward_model",
    "score",
    "combine_rewards",
]


@attrs.frozen
class RewardModelConfig:
    """Which reward model, and how it is stored and fed (verl's ``reward_model`` section, where it has one)."""

    #: a reward model HF dir (*ForSequenceClassification, one label); empty: none. The recipes add
    #: reward_model.weight x its score to the reward functions' score
    path: str = ""
    weight: float = 1.0  #: the weight of the reward model's score in the reward
    #: rows per forward pass (verl: ``reward_model.micro_batch_size_per_gpu``)
    micro_batch_size: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    #: weight / compute dtype; "auto" = bfloat16 on GPU, float32 on CPU. Scores are returned in fp32.
    param_dtype: Literal["auto", "float32", "bfloat16"] = attrs.field(
        default="auto", validator=attrs.validators.in_(("auto", "float32", "bfloat16"))
    )
    #: FSDP2-shard the weights over all ranks (reference-style) instead of one full replica per rank
    shard: bool = False


@attrs.frozen(kw_only=True)
class RewardModel:
    """The loaded reward model (eval mode, no grads) and where it runs."""

    module: nn.Module  # *ForSequenceClassification, num_labels=1 (FSDP2-wrapped when config.shard)
    config: RewardModelConfig
    device: torch.device
    vocab_size: int
    env: DistEnv | None = None  # set when sharded
    mesh: Any = None  # the 1-D "dp" DeviceMesh when sharded


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load_reward_model(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` of a local reward-model dir (``*ForSequenceClassification``, one label).

    Errors name the problem: a missing dir / config / weights (as :func:`backends.models.load_causal_lm`),
    an architecture that is not a sequence classifier (a causal LM, a value model), ``num_labels != 1``,
    a checkpoint without the trained ``score`` head. The tokenizer is None when the dir has none.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    path = Path(path)
    raw = check_model_dir(path)
    archs = raw.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(
            f"{str(path)!r} is not a sequence classifier (architectures {archs}); a reward model is a "
            "*ForSequenceClassification with num_labels=1"
        )
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    if hf_config.num_labels != 1:
        raise ValueError(
            f"{str(path)!r} is a sequence classifier with {hf_config.num_labels} labels; a reward model has 1"
        )
    with quiet_transformers():
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path,
            config=hf_config,
            dtype=dtype,
            local_files_only=True,
            attn_implementation=attn_implementation,
            output_loading_info=True,
        )
    if info["missing_keys"]:
        raise ValueError(f"{str(path)!r} is missing weights {sorted(info['missing_keys'])}: not a trained reward model")
    model.to(device)
    model.eval()
    try:
        tokenizer = load_tokenizer(path)
    except FileNotFoundError:
        tokenizer = None
    return model, tokenizer


def _check_reward_module(model: nn.Module) -> nn.Module:
    name = type(model).__name__
    config = getattr(model, "config", None)
    if not name.endswith("ForSequenceClassification") or getattr(config, "num_labels", None) != 1:
        raise ValueError(
            f"a reward model must be a *ForSequenceClassification with num_labels=1, got {name} "
            f"with num_labels={getattr(config, 'num_labels', None)}"
        )
    if not isinstance(getattr(model, "score", None), nn.Module):
        raise ValueError(f"{name} has no `score` head to read per-token scores from")
    return model


def build_reward_model(
    model_path: str | os.PathLike | nn.Module,
    env: DistEnv | None = None,
    config: RewardModelConfig = RewardModelConfig(),
) -> RewardModel:
    """Load a reward model (a local HF dir or an unsharded HF module) for :func:`score`.

    Replicated (default): the full model on ``env.device`` (CPU when ``env`` is None; no process group
    needed). ``config.shard``: FSDP2-sharded over all ranks of ``env`` (``init_distributed()`` when None),
    weights stored in the compute dtype, as :func:`backends.training.fsdp.build_reference`.
    """
    if config.shard and env is None:
        env = init_distributed()
    device = env.device if env is not None else torch.device("cpu")
    dtype = _dtype(config.param_dtype, device)
    if isinstance(model_path, nn.Module):
        model = _check_reward_module(model_path).to(dtype)
    else:
        model, _tokenizer = load_reward_model(model_path, dtype=dtype, device="cpu")
    model.requires_grad_(False)
    model.eval()
    if getattr(model.config, "pad_token_id", None) is None:
        # HF's pooling (whose result is not used, see the module docstring) refuses batches without one
        model.config.pad_token_id = 0
    vocab_size = model.get_input_embeddings().num_embeddings
    mesh = None
    if config.shard:
        from backends.training.fsdp import FSDPConfig
        from backends.training.fsdp_sharding import shard_module

        mesh = device_mesh(env)
        model = shard_module(model.to(device), mesh, FSDPConfig(), None)
        model.eval()
    else:
        model = model.to(device)
    return RewardModel(module=model, config=config, device=device, vocab_size=vocab_size, env=env, mesh=mesh)


def _last_token_index(prompt_width: int, response_mask: Tensor) -> Tensor:
    """``(b,)`` index into prompt + response of the last token: the last true of ``response_mask``,
    or the last prompt column (prompts are left-padded) when the response is empty."""
    t = response_mask.shape[1]
    positions = torch.arange(1, t + 1, device=response_mask.device)
    length = (positions * response_mask).amax(dim=1)  # 1 + index of the last response token, 0 if none
    return prompt_width - 1 + length


def _forward_scores(module: nn.Module, mb: RolloutBatch) -> Tensor:
    """``(b,)`` fp32 scores of one micro-batch (already on the model's device)."""
    captured: list[Tensor] = []
    handle = module.score.register_forward_hook(lambda mod, args, out: captured.append(out))
    try:
        input_ids = torch.cat([mb.prompt_ids, mb.response_ids], dim=1)
        attention_mask = torch.cat([mb.prompt_mask, torch.ones_like(mb.response_mask)], dim=1).long()
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        module(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    finally:
        handle.remove()
    per_token = captured[-1]  # (b, s, 1)
    index = _last_token_index(mb.prompt_ids.shape[1], mb.response_mask)
    return per_token[torch.arange(per_token.shape[0], device=per_token.device), index, 0].float()


def score(rm: RewardModel, batch: RolloutBatch, *, micro_batch_size: int | None = None) -> Tensor:
    """``(b,)`` fp32 reward-model scores of the rows of ``batch``, on the batch's device, without gradients.

    Reads ``prompt_ids`` / ``prompt_mask`` (left-padded) and ``response_ids`` / ``response_mask``
    (right-padded); the scored token is the last one of prompt + response (module docstring).
    Micro-batches of ``micro_batch_size`` rows (default: the config's). A sharded reward model is a
    collective: every rank calls this in step.
    """
    check_batch(batch)
    top = int(torch.maximum(batch.prompt_ids.max(), batch.response_ids.max()))
    if top >= rm.vocab_size:
        raise ValueError(
            f"token id {top} is outside the reward model's vocabulary ({rm.vocab_size} ids): it must share the "
            "actor's tokenizer"
        )
    size = micro_batch_size if micro_batch_size is not None else rm.config.micro_batch_size
    mbs = micro_batches(batch, micro_batch_size=size)
    n_max = len(mbs) if rm.mesh is None else all_reduce_max(len(mbs), group=rm.mesh.get_group(), device=rm.device)
    out_device = batch.response_ids.device
    scores = []
    try:
        with torch.inference_mode():
            for i in range(n_max):
                real = i < len(mbs)
                mb = trim_micro_batch(mbs[i] if real else dummy_micro_batch(mbs[0]))
                s = _forward_scores(rm.module, to_device(mb, rm.device))
                if real:
                    scores.append(s.to(out_device))
    finally:
        if rm.mesh is not None:
            reshard(rm.module)
    # made outside inference mode, the result is an ordinary tensor (usable in later autograd code)
    return torch.cat(scores)


def combine_rewards(rule_scores: Tensor | None, rm_scores: Tensor, *, rm_weight: float = 1.0) -> Tensor:
    r"""Sequence rewards from a rule-based score and a reward-model score: ``rule + rm_weight * rm``.

    ``rule_scores=None`` gives ``rm_weight * rm``, verl's behaviour when a reward model is enabled
    (its score replaces the rule-based one). Shapes ``(b,)``; both floating point and finite (a NaN
    reward would silently poison the advantages), else an error naming the argument.
    """
    bind({"rule_scores": (rule_scores, "b"), "rm_scores": (rm_scores, "b")})
    check_floating("rm_scores", rm_scores)
    check_finite("rm_scores", rm_scores)
    if rule_scores is None:
        return rm_weight * rm_scores
    check_floating("rule_scores", rule_scores)
    check_finite("rule_scores", rule_scores)
    return rule_scores + rm_weight * rm_scores.to(rule_scores.device, rule_scores.dtype)

"""A native torch rollout engine: batched autoregressive sampling with a KV cache, in-process.

The engine keeps its own unsharded copy of a Llama / Qwen2 model (eval mode, no grads) and runs the
decoder itself (:mod:`backends.rollout.decoder`), straight from the HF module's parameters, with a
preallocated KV cache:

1. prefill each distinct prompt once (left-padded, ``position_ids = cumsum(mask) - 1``) and copy its
   keys/values into the cache rows of its ``n`` samples;
2. decode one token per step for the whole batch, computing only the last position's logits;
3. drop finished rows from the working batch (compaction), so the work per step follows the number of
   sequences still running: with the CPU kernel strategy by index (the caches stay where they are, so
   it is free and happens whenever the running rows fit a smaller multiple of 8 rows), else by copying
   the caches once 1/8 of the working rows have finished;
4. stop when every row has produced EOS or ``max_new_tokens`` tokens.

``sync_weights`` copies full HF-named tensors into the model's parameters in place, so the decoder
always reads the newest weights.

Why it is faster than ``model.generate``: the decode GEMMs dominate a step, and the engine does little
around them: no per-step mask building or cache concatenation, one fused QKV GEMM, oneDNN prepacked
weights with fused SiLU / residual add, only last-position logits, inverse-CDF sampling with one uniform
per row, prefill once per distinct prompt, finished rows dropped from the working batch, weights and
caches kept between calls (:class:`~backends.rollout.decoder.Workspace`), and on AVX-512 CPUs a C kernel
for the decode step's attention (the kernel strategy, ``backends.cpu.decode``; the portable PyTorch
strategy is :mod:`backends.rollout.kv_cache`). A bfloat16 engine (``build_native_rollout(...,
dtype=torch.bfloat16)``) halves GEMM time and weight traffic at the price of log-probs further from an
fp32 trainer's.

Log-probabilities. ``RolloutBatch.rollout_logprobs[i, j]`` is ``log_softmax(logits)[token]`` of the
sampled token under the model's *raw* distribution (temperature 1, no top-k / top-p), which is the
quantity the trainer recomputes with a plain forward (``rlfunc.logprobs_from_logits``); the two agree
to float rounding in fp32 (see tests/test_rollout_native.py). The sampling distribution itself (after
temperature, top-k, top-p) is different whenever those options are set.
"""

from __future__ import annotations

import copy
import difflib
import os
from typing import Any, Iterable, Sequence

import attrs
import torch
from torch import Tensor

from backends.rollout.common import (
    SamplingConfig,
    assemble_batch,
    check_group_ids,
    decode_responses,
    default_eos_token_ids,
    left_pad,
    prepare_prompts,
    sample_tokens,
)
from backends.rollout.decoder import Decoder, Workspace
from backends.rollout.kv_cache import DecodeBackend
from rlfunc.batch import RolloutBatch

__all__ = [
    "SamplingConfig",
    "NativeRollout",
    "build_native_rollout",
    "sync_weights",
    "generate",
    "sample_tokens",
    "decode_responses",
]


def _check_decode_backend(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if value not in ("auto", "torch", "kernel"):
        raise ValueError(f"NativeRollout.decode_backend must be 'auto', 'torch' or 'kernel', got {value!r}")


@attrs.frozen
class NativeRollout:
    """The rollout engine's state: its own model copy, the token ids it needs and its workspace.

    Not thread-safe: one :func:`generate` at a time per model (the calls share the workspace's caches).

    ``weights_version`` counts :func:`sync_weights` calls. The model is updated in place by
    ``sync_weights`` (one copy of the weights), so an older ``NativeRollout`` value shares the new
    weights; use the returned value and treat the old one as stale.
    """

    model: Any = attrs.field(eq=False, repr=lambda m: type(m).__name__)
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    max_context: int  #: prompt + response tokens must fit in this many positions
    #: drop finished rows from the working batch once this fraction of it has finished (0 = at once);
    #: None: automatic (see the module docstring, step 3)
    compact_fraction: float | None = None
    #: on CPU, run linears through oneDNN with prepacked weights (repacked when a parameter changes)
    prepack_cpu_weights: bool = True
    #: the decoder's KV-cache / attention strategy: ``auto`` (the CPU kernel where it runs, else PyTorch),
    #: ``torch`` (the portable path) or ``kernel`` (the CPU kernel, an error where it cannot run)
    decode_backend: DecodeBackend = attrs.field(default="auto", validator=_check_decode_backend)
    weights_version: int = 0
    #: what :func:`generate` keeps between calls (decoder weights, KV caches); shared by evolved copies
    workspace: Workspace = attrs.field(factory=Workspace, eq=False, repr=False)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().weight.shape[0]


# --------------------------------------------------------------------------------------------------
# Building and weight sync


def _check_supported(model: Any) -> None:
    cfg = model.config
    model_type = getattr(cfg, "model_type", None)
    if model_type not in ("llama", "qwen2"):
        raise NotImplementedError(f"the native rollout engine runs Llama and Qwen2 models, got model_type {model_type!r}")
    layer_types = getattr(cfg, "layer_types", None) or []
    if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise NotImplementedError("the native rollout engine does not implement sliding-window attention")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"the native rollout engine implements the SiLU MLP only, got hidden_act={act!r}")
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        raise NotImplementedError("pretraining_tp > 1 is not supported")


def build_native_rollout(
    model_path_or_module: str | os.PathLike | torch.nn.Module,
    tokenizer: Any = None,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    max_context: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
    compact_fraction: float | None = None,
) -> NativeRollout:
    """A rollout engine over a local HF dir, or over a private deep copy of an (unsharded) HF module.

    ``dtype`` defaults to float32 for a path and to the module's dtype for a module; ``device`` to the
    module's device (CPU for a path). ``max_context`` defaults to ``config.max_position_embeddings``.
    EOS ids come from ``generation_config`` (or ``config``) plus ``tokenizer.eos_token_id``.
    """
    if isinstance(model_path_or_module, torch.nn.Module):
        model = copy.deepcopy(model_path_or_module)
        if dtype is not None or device is not None:
            model.to(device=device, dtype=dtype)
    else:
        from backends.models import load_causal_lm

        model, loaded_tok = load_causal_lm(model_path_or_module, dtype=dtype or torch.float32, device=device or "cpu")
        tokenizer = tokenizer if tokenizer is not None else loaded_tok
    _check_supported(model)
    model.eval()
    model.requires_grad_(False)
    cfg = model.config
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else cfg.pad_token_id
    eos = tuple(int(i) for i in eos_token_ids) if eos_token_ids is not None else default_eos_token_ids(model, tokenizer)
    if pad is None:
        pad = eos[0]
    if compact_fraction is not None and not 0.0 <= compact_fraction <= 1.0:
        raise ValueError(f"compact_fraction must be in [0, 1] or None, got {compact_fraction}")
    return NativeRollout(
        model=model,
        pad_token_id=int(pad),
        eos_token_ids=eos,
        max_context=int(max_context or cfg.max_position_embeddings),
        compact_fraction=compact_fraction,
    )


def sync_weights(rollout: NativeRollout, named_tensors: Iterable[tuple[str, Tensor]], *, strict: bool = True) -> NativeRollout:
    """Copy full tensors with HF names (``model.layers.0.self_attn.q_proj.weight``...) into the model.

    Tensors are consumed one at a time (a generator of gathered FSDP tensors works), cast to the
    rollout's dtype and device, ``DTensor`` values are gathered with ``full_tensor()``. Unknown names
    and shape mismatches raise; with ``strict`` every parameter must have been received (tied weights
    count once). Returns the rollout with ``weights_version`` bumped.
    """
    model = rollout.model
    targets: dict[str, Tensor] = dict(model.named_parameters(remove_duplicate=False))
    persistent = set(model.state_dict().keys())
    targets.update((n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in persistent)
    written: set[int] = set()
    with torch.no_grad():
        for name, tensor in named_tensors:
            target = targets.get(name)
            if target is None:
                close = difflib.get_close_matches(name, targets, n=3)
                hint = f"; did you mean {close}?" if close else ""
                raise KeyError(f"sync_weights: the rollout model has no parameter {name!r}{hint}")
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"sync_weights: {name!r} has shape {tuple(tensor.shape)}, the rollout model expects {tuple(target.shape)}"
                )
            target.copy_(tensor)
            written.add(id(target))
    if strict:
        missing = sorted({n for n, p in targets.items() if id(p) not in written})
        if missing:
            raise ValueError(f"sync_weights: {len(missing)} parameters were not received, e.g. {missing[:5]}")
    return attrs.evolve(rollout, weights_version=rollout.weights_version + 1)


# --------------------------------------------------------------------------------------------------
# Generation


def generate(
    rollout: NativeRollout,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig = SamplingConfig(),
    *,
    group_ids: Tensor | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> RolloutBatch:
    """Sample ``sampling.n`` responses per prompt; return a validated :class:`rlfunc.RolloutBatch`.

    ``prompts`` are unpadded token-id lists. Rows are ``prompt 0`` x n, then ``prompt 1`` x n, ...;
    ``group_ids (b,)`` is the prompt index repeated n times, or ``group_ids[prompt]`` when a ``(num
    prompts,)`` tensor is given. ``prompt_ids (b p)`` are left-padded, ``response_ids (b t)`` right-padded
    with ``pad_token_id``; ``t`` is the longest response in the batch. ``response_mask`` is true up to
    and including the first EOS (all true for a row cut at ``max_new_tokens``). ``rollout_logprobs``
    (fp32) are the raw model log-probs of the sampled tokens (see the module docstring), 0 where masked.

    Randomness comes only from ``generator`` if given, else from a fresh generator seeded with ``seed``
    (default ``sampling.seed``): the same seed and inputs give the same samples.
    """
    prompts = prepare_prompts(prompts, sampling, max_context=rollout.max_context, vocab_size=rollout.vocab_size)
    group_ids = check_group_ids(group_ids, len(prompts))
    if generator is None:
        generator = torch.Generator(device=rollout.device)
        generator.manual_seed(sampling.seed if seed is None else seed)
    prompt_ids, prompt_mask = left_pad(prompts, rollout.pad_token_id)
    prompt_ids, prompt_mask = prompt_ids.to(rollout.device), prompt_mask.to(rollout.device)
    with torch.inference_mode():
        tokens, logprobs = _generate_tokens(rollout, prompt_ids, prompt_mask, sampling, generator)
    # fresh (non-inference) tensors, so the trainer may use them in autograd
    response_ids, response_mask, rollout_logprobs = _responses(rollout, tokens.clone(), logprobs.clone())
    return assemble_batch(prompt_ids.clone(), prompt_mask.clone(), response_ids, response_mask, rollout_logprobs,
                          n=sampling.n, group_ids=group_ids)


def _responses(rollout: NativeRollout, tokens: Tensor, logprobs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Raw tokens and log-probs ``(b steps)`` cut after each row's first EOS: ``response_ids`` (padded),
    ``response_mask`` and ``rollout_logprobs`` (0 where masked), ``t`` = the longest response."""
    is_eos = torch.isin(tokens, torch.tensor(rollout.eos_token_ids, device=tokens.device))
    steps = tokens.shape[1]
    no_eos = torch.full_like(is_eos[:, 0], steps, dtype=torch.long)
    first_eos = torch.where(is_eos.any(-1), is_eos.float().argmax(-1), no_eos)
    lengths = (first_eos + 1).clamp(max=steps)
    t = int(lengths.max())
    response_mask = torch.arange(t, device=tokens.device)[None] < lengths[:, None]
    response_ids = tokens[:, :t].masked_fill(~response_mask, rollout.pad_token_id)
    return response_ids, response_mask, logprobs[:, :t].masked_fill(~response_mask, 0.0)


def _generate_tokens(
    rollout: NativeRollout, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingConfig, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """The decoding loop over left-padded prompts ``(num_prompts p)``. Returns raw tokens and log-probs
    ``(b steps)`` (garbage after a row's EOS)."""
    device = rollout.device
    n, (num_prompts, p) = sampling.n, prompt_ids.shape
    rows, max_new = num_prompts * n, sampling.max_new_tokens
    decoder = Decoder(rollout.model, rows, p + max_new, rollout.prepack_cpu_weights, rollout.workspace,
                      backend=rollout.decode_backend)
    logits = decoder.prefill(prompt_ids, prompt_mask, copies=n).float().repeat_interleave(n, dim=0)
    next_pos = prompt_mask.sum(-1).repeat_interleave(n)  # RoPE position of each row's first response token
    eos = torch.tensor(rollout.eos_token_ids, device=device)

    out_tokens = torch.full((rows, max_new), rollout.pad_token_id, dtype=torch.long, device=device)
    out_logprobs = torch.zeros((rows, max_new), dtype=torch.float32, device=device)
    active = None  # indices into the full batch of the working rows; None = all rows, in order
    running = torch.ones(rows, dtype=torch.bool, device=device)  # per working row: no EOS yet
    steps = 0
    for s in range(max_new):
        # one uniform per row of the whole batch every step, so a row's samples do not depend on which
        # rows share its working batch (compaction, by index or by copy, changes nothing)
        uniform = None
        if sampling.temperature > 0.0:
            uniform = torch.rand((rows, 1), generator=generator, device=device)
            uniform = uniform if active is None else uniform[active]
        token = sample_tokens(logits, sampling, generator, uniform=uniform)
        logprob = torch.log_softmax(logits, dim=-1).gather(-1, token[:, None]).squeeze(-1)
        if active is None:
            out_tokens[:, s] = token
            out_logprobs[:, s] = logprob
        else:
            out_tokens[:, s].index_copy_(0, active, token)
            out_logprobs[:, s].index_copy_(0, active, logprob)
        steps = s + 1
        running &= ~torch.isin(token, eos)
        num_running = int(running.sum())
        if num_running == 0 or s == max_new - 1:
            break
        keep = _rows_to_keep(running, num_running, rollout.compact_fraction, decoder.drops_rows_by_index)
        if keep is not None:
            decoder.keep_rows(keep)
            active = keep if active is None else active[keep]
            token, next_pos, running = token[keep], next_pos[keep], running[keep]
        logits = decoder.step(token, next_pos + s, p + s).float()
    return out_tokens[:, :steps], out_logprobs[:, :steps]


#: copying compaction (the PyTorch strategy) waits until this fraction of the working rows has finished
COPY_COMPACT_FRACTION = 0.125
#: compaction by index keeps the running rows padded with finished ones to a multiple of this many rows:
#: oneDNN builds a GEMM kernel for every new row count, so the working batch takes few distinct sizes
INDEX_COMPACT_MULTIPLE = 8


def _rows_to_keep(running: Tensor, num_running: int, fraction: float | None, by_index: bool) -> Tensor | None:
    """The working rows to keep for the next step (ascending indices), or None to keep them all.

    ``fraction`` (``NativeRollout.compact_fraction``): drop every finished row once that fraction of the
    working rows has finished. None: by index, whenever the running rows fit a smaller multiple of
    :data:`INDEX_COMPACT_MULTIPLE` (the finished rows kept to fill it are the first ones); by copy, at
    :data:`COPY_COMPACT_FRACTION`.
    """
    rows = running.shape[0]
    if fraction is None and by_index:
        target = min(rows, -(-num_running // INDEX_COMPACT_MULTIPLE) * INDEX_COMPACT_MULTIPLE)
        if target == rows:
            return None
        finished = (~running).nonzero().squeeze(-1)[: target - num_running]
        return torch.cat([running.nonzero().squeeze(-1), finished]).sort().values
    fraction = COPY_COMPACT_FRACTION if fraction is None else fraction
    num_done = rows - num_running
    if num_done > 0 and num_done >= fraction * rows:
        return running.nonzero().squeeze(-1)
    return None

"""A native torch rollout engine: batched autoregressive sampling with a KV cache, in-process.

The engine keeps its own unsharded copy of a Llama / Qwen2 model (eval mode, no grads) and runs the
decoder itself (:mod:`backends.rollout.decoder`), straight from the HF module's parameters. ``generate`` batches
in one of two ways (``NativeRollout.batching``, ``rollout.native.batching``):

- ``continuous`` (the default; :mod:`backends.rollout.scheduler` over :mod:`backends.rollout.paged_kv`): rows
  stream through a fixed number of slots; a prompt's ``n`` samples share its KV-cache blocks (prefilled once,
  a partial last block copied on write), a finished row frees its slot and blocks at once and the next waiting
  prompt takes them, so more prompts than slots pass through a bounded cache;
- ``lockstep``: the whole batch steps together over a preallocated contiguous cache:

1. prefill each distinct prompt once (left-padded, ``position_ids = cumsum(mask) - 1``) and copy its
   keys/values into the cache rows of its ``n`` samples;
2. decode one token per step for the whole batch, computing only the last position's logits;
3. drop finished rows from the working batch (compaction), so the work per step follows the number of
   sequences still running: the caches are copied down once 1/8 of the working rows have finished;
4. stop when every row has produced EOS or ``max_new_tokens`` tokens.

Both draw row ``r``'s ``k``-th token from a uniform keyed by ``(seed, r, k)``
(:mod:`backends.rollout.row_random`), so they sample the same tokens for the same seed and weights
(tests/test_native_engine.py).

``sync_weights`` copies full HF-named tensors into the model's parameters in place, so the decoder
always reads the newest weights.

Partial rollouts (``with_weight_updates``; continuous batching only): a generation stops every ``chunk_tokens``
iterations so the caller can copy newer weights in, and its unfinished rows continue under them, their caches
computed again (:mod:`backends.rollout.scheduler`); the batch then carries ``policy_version (b t)``, the version
of the weights that sampled each token, whose log-prob ``rollout_logprobs`` is under those weights.

Why it is faster than ``model.generate``: the decode GEMMs dominate a step, and the engine does little
around them: no per-step mask building or cache concatenation, one fused QKV GEMM, oneDNN prepacked
weights with fused SiLU / residual add, only last-position logits, inverse-CDF sampling with one uniform
per row, prefill once per distinct prompt, finished rows dropped from the working batch, weights and
caches kept between calls (:class:`~backends.rollout.decoder.Workspace`). A bfloat16 engine (``build_native_rollout(...,
dtype=torch.bfloat16)``) halves GEMM time and weight traffic at the price of log-probs further from an
fp32 trainer's.

Multi-turn sessions (:mod:`backends.rollout.native_session`: ``start_session``, ``continue_session``,
``end_session``): the prompts are prefilled once and each row's KV cache continues across turns; a call
feeds each active row its forced tokens (an observation, a tool result) and then samples its next turn,
and hands back exactly the token ids it fed and sampled (token-in / token-out). That module says how
rows that have nothing to feed in a step keep the cache consistent.

Log-probabilities. ``RolloutBatch.rollout_logprobs[i, j]`` is ``log_softmax(logits)[token]`` of the
sampled token under the model's *raw* distribution (temperature 1, no top-k / top-p), which is the
quantity the trainer recomputes with a plain forward (``rlfunc.logprobs_from_logits``); the two agree
to float rounding in fp32 (see tests/test_rollout_native.py). The sampling distribution itself (after
temperature, top-k, top-p) is different whenever those options are set.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Iterable, Literal, Mapping, Sequence

import attrs
import torch
from torch import Tensor

from backends.config import ConfigError
from backends.rollout.common import (
    SamplingConfig,
    TurnOutput,
    assemble_batch,
    check_group_ids,
    decode_responses,
    default_eos_token_ids,
    left_pad,
    prepare_prompts,
    sample_tokens,
    sampling_options,
)
from backends.rollout.decoder import Decoder, Workspace
from backends.rollout.engine import RolloutEngineSpec
from backends.rollout.native_requests import NativeRequestStream
from backends.rollout.native_session import NativeSession, start_session
from backends.rollout.native_turns import NativeTurnStream
from backends.rollout.row_random import RowKeys, row_uniforms
from backends.rollout.scheduler import BatchingLimits, WeightUpdates, generate_continuous
from backends.rollout.weight_sync import check_sync_tensor
from rlfunc.batch import RolloutBatch, validate

__all__ = [
    "SamplingConfig",
    "NativeRollout",
    "build_native_rollout",
    "sync_weights",
    "generate",
    "sample_tokens",
    "decode_responses",
    "TurnOutput",
    "BatchingLimits",
    "NativeConfig",
    "ENGINE_SPEC",
]


def _check_decode_backend(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if value == "kernel":
        raise ConfigError(
            "NativeRollout.decode_backend='kernel': the CPU kernels were removed from rlfunc; the "
            "decoder runs PyTorch on every device: use decode_backend='auto' (the default) or 'torch'"
        )
    if value not in ("auto", "torch"):
        raise ConfigError(f"NativeRollout.decode_backend must be 'auto' or 'torch', got {value!r}")


def _positive_setting(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"rollout.native.{attribute.name} must be positive, got {value}")


@attrs.frozen
class NativeConfig:
    """How the native engine batches (``rollout.native.*``; ignored by the vLLM engine)."""

    #: continuous: rows stream through slots of a paged KV cache shared by a prompt's samples, a finished row's slot
    #: taking the next waiting one; lockstep: the whole batch steps together over a contiguous cache
    batching: Literal["continuous", "lockstep"] = attrs.field(
        default="continuous", validator=attrs.validators.in_(("continuous", "lockstep"))
    )
    #: continuous: rows decoded together; none: every row of a call, up to 1024
    max_slots: int | None = attrs.field(default=None, validator=_positive_setting)
    #: continuous: the most prompt tokens one step computes; a longer prompt is fed in chunks of this many, one per
    #: step, while the running rows go on decoding (chunked prefill)
    prefill_tokens: int = attrs.field(default=4096, validator=_positive_setting)
    block_size: int = attrs.field(default=8, validator=_positive_setting)  #: continuous: tokens per KV-cache block
    #: continuous: the KV cache's size in GiB (a request that can never fit is refused, naming it); none: enough for
    #: max_slots rows at their longest
    kv_cache_gib: float | None = attrs.field(default=None, validator=_positive_setting)
    #: continuous, on CUDA: replay the decode step from CUDA graphs, one per bucket of rows and keys (no launch
    #: overhead)
    cuda_graphs: bool = True
    #: continuous, on CUDA: queue each decode step before reading the tokens sampled before it, so the host's
    #: bookkeeping overlaps the GPU's step (a row that sampled its EOS steps once more for nothing)
    overlap_steps: bool = True
    #: continuous, a rollout server's calls: the blocks of a call's ended rows stay cached (least recently used
    #: evicted first), so a later call that starts with the same tokens (an agent's next turn, which sends the
    #: conversation again) computes only the tokens after them
    prefix_cache: bool = True

    def limits(self) -> BatchingLimits:
        return BatchingLimits(
            max_slots=self.max_slots,
            prefill_tokens=self.prefill_tokens,
            block_size=self.block_size,
            kv_cache_gib=self.kv_cache_gib,
            cuda_graphs=self.cuda_graphs,
            overlap_steps=self.overlap_steps,
            prefix_cache=self.prefix_cache,
        )


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
    #: the decoder's KV-cache / attention implementation: PyTorch on every device, which ``auto`` and
    #: ``torch`` both name
    decode_backend: Literal["auto", "torch"] = attrs.field(default="auto", validator=_check_decode_backend)
    #: ``continuous``: :func:`generate` streams rows through slots of a paged KV cache
    #: (:mod:`backends.rollout.scheduler`); ``lockstep``: the whole batch steps together over a contiguous cache,
    #: finished rows compacted away
    batching: Literal["continuous", "lockstep"] = attrs.field(
        default="continuous", validator=attrs.validators.in_(("continuous", "lockstep"))
    )
    batching_limits: BatchingLimits = BatchingLimits()  #: slots, prefill budget, block size, cache budget
    weights_version: int = 0
    #: partial rollouts: where :func:`generate` stops for newer weights and who loads them (None: never stops)
    weight_updates: WeightUpdates | None = attrs.field(default=None, eq=False, repr=False)
    #: what :func:`generate` keeps between calls (decoder weights, KV caches); shared by evolved copies
    workspace: Workspace = attrs.field(factory=Workspace, eq=False, repr=False)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().weight.shape[0]

    # the RolloutEngine protocol (backends.rollout.engine): the module's functions below

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig = SamplingConfig(),
        *,
        group_ids: Tensor | None = None,
        seed: int | RowKeys | None = None,
    ) -> RolloutBatch:
        return generate(self, prompts, sampling_options(sampling), group_ids=group_ids, seed=seed)

    def start_session(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *, seed: int, max_slots: int
    ) -> NativeSession:
        return start_session(self, prompts, sampling_options(sampling), seed=seed, max_slots=max_slots)

    def start_turn_stream(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *, seed: int, max_slots: int
    ) -> NativeTurnStream | None:
        """With continuous batching, a :class:`~backends.rollout.engine.TurnStream` over ``prompts`` (the arguments
        of :meth:`start_session`; :mod:`backends.rollout.native_turns`); lock-step batching has none (None)."""
        if self.batching != "continuous":
            return None
        sampling = sampling_options(sampling)
        return NativeTurnStream(self, prompts, sampling, seed=seed, max_slots=max_slots, limits=self.batching_limits)

    def start_request_stream(self, sampling: SamplingConfig, *, max_rows: int) -> NativeRequestStream | None:
        """With continuous batching (and no partial rollouts), a :class:`~backends.rollout.engine.RequestStream` of
        ``max_rows`` slots under ``sampling``'s options (:mod:`backends.rollout.native_requests`); else None."""
        if self.batching != "continuous" or self.weight_updates is not None:
            return None
        return NativeRequestStream(self, sampling_options(sampling), max_rows=max_rows)

    def sync_weights(self, named_tensors: Iterable[tuple[str, Tensor]], *, strict: bool = True) -> NativeRollout:
        return sync_weights(self, named_tensors, strict=strict)

    def sync_adapter(
        self, adapter: Mapping[str, Tensor], *, rank: int, alpha: float, target_modules: Sequence[str], version: int
    ) -> NativeRollout:
        raise ValueError("the native rollout engine receives merged full weights, not LoRA adapters")

    def with_weight_updates(self, updates: WeightUpdates | None) -> NativeRollout:
        """This engine with :func:`generate` taking newer weights at chunk boundaries (partial rollouts; None: off)."""
        if updates is not None and self.batching != "continuous":
            raise ValueError(
                f"partial rollouts need rollout.native.batching=continuous, got {self.batching}: the lock-step loop "
                "cannot recompute its rows' caches under new weights"
            )
        return attrs.evolve(self, weight_updates=updates)

    def release_memory(self) -> NativeRollout:
        return self  # nothing worth freeing: the caches are reused by the next step

    def shutdown(self) -> None:
        return None

    def logprob_numerics(self) -> str | None:
        # the HF model's own fp32 forward, to float rounding (tests/test_rollout_native.py); bf16 rounds its own way
        return "hf-float32" if self.model.get_input_embeddings().weight.dtype == torch.float32 else None


# --------------------------------------------------------------------------------------------------
# Building and weight sync


def _check_supported(model: Any) -> None:
    cfg = model.config
    model_type = getattr(cfg, "model_type", None)
    if model_type not in ("llama", "qwen2"):
        raise NotImplementedError(
            f"the native rollout engine runs Llama and Qwen2 models, got model_type {model_type!r}"
        )
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
    batching: Literal["continuous", "lockstep"] = "continuous",
    batching_limits: BatchingLimits = BatchingLimits(),
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
        batching=batching,
        batching_limits=batching_limits,
    )


def sync_weights(
    rollout: NativeRollout, named_tensors: Iterable[tuple[str, Tensor]], *, strict: bool = True
) -> NativeRollout:
    """Copy full tensors with HF names (``model.layers.0.self_attn.q_proj.weight``...) into the model.

    Tensors are consumed one at a time (a generator of gathered FSDP tensors works), cast to the
    rollout's dtype and device, ``DTensor`` values are gathered with ``full_tensor()``. Unknown names,
    shape mismatches, non-floating tensors for floating parameters and tensors holding NaN or Inf raise,
    each before its tensor is copied; with ``strict`` every parameter must have been received (tied
    weights count once). Returns the rollout with ``weights_version`` bumped.

    All or nothing: the previous value of each parameter is saved just before it is overwritten (on the
    CPU for a GPU engine), and any failure (a refused tensor, an exception from ``named_tensors`` after
    some tensors were copied, missing parameters) puts the saved values back before the error propagates,
    so the engine keeps generating with its previous weights, bit for bit. The price is one copy of the
    weights that were written, held until the call returns.
    """
    model = rollout.model
    targets: dict[str, Tensor] = dict(model.named_parameters(remove_duplicate=False))
    persistent = set(model.state_dict().keys())
    targets.update((n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in persistent)
    saved: dict[int, tuple[Tensor, Tensor]] = {}  # id(target) -> (target, its value before this call)
    with torch.no_grad():
        try:
            for name, tensor in named_tensors:
                target = targets.get(name)
                tensor = check_sync_tensor(name, tensor, targets)
                if id(target) not in saved:
                    backup_device = "cpu" if target.device.type != "cpu" else target.device
                    saved[id(target)] = (target, target.detach().to(backup_device, copy=True))
                target.copy_(tensor)
            if strict:
                missing = sorted({n for n, p in targets.items() if id(p) not in saved})
                if missing:
                    raise ValueError(f"sync_weights: {len(missing)} parameters were not received, e.g. {missing[:5]}")
        except BaseException:
            for target, before in saved.values():
                target.copy_(before)
            raise
    return attrs.evolve(rollout, weights_version=rollout.weights_version + 1)


# --------------------------------------------------------------------------------------------------
# Generation


def generate(
    rollout: NativeRollout,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig = SamplingConfig(),
    *,
    group_ids: Tensor | None = None,
    seed: int | RowKeys | None = None,
    generator: torch.Generator | None = None,
) -> RolloutBatch:
    """Sample ``sampling.n`` responses per prompt; return a validated :class:`rlfunc.RolloutBatch`.

    ``prompts`` are unpadded token-id lists. Rows are ``prompt 0`` x n, then ``prompt 1`` x n, ...;
    ``group_ids (b,)`` is the prompt index repeated n times, or ``group_ids[prompt]`` when a ``(num
    prompts,)`` tensor is given. ``prompt_ids (b p)`` are left-padded, ``response_ids (b t)`` right-padded
    with ``pad_token_id``; ``t`` is the longest response in the batch. ``response_mask`` is true up to
    and including the first EOS (all true for a row cut at ``max_new_tokens``). ``rollout_logprobs``
    (fp32) are the raw model log-probs of the sampled tokens (see the module docstring), 0 where masked.

    Randomness: row ``r``'s ``k``-th token inverts its CDF at ``row_uniforms(seed, r, k)``
    (:mod:`backends.rollout.row_random`), ``seed`` defaulting to ``sampling.seed`` (or drawn once from
    ``generator`` if given, which advances it): the same seed and inputs give the same samples, in either batching
    mode and whichever rows share a step. ``seed`` may be a :class:`~backends.rollout.row_random.RowKeys`: each
    row then draws as its own request would alone (a server batching several requests into one call).
    """
    prompts = prepare_prompts(prompts, sampling, max_context=rollout.max_context, vocab_size=rollout.vocab_size)
    group_ids = check_group_ids(group_ids, len(prompts))
    if generator is not None:
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    seed = sampling.seed if seed is None else seed
    prompt_ids, prompt_mask = left_pad(prompts, rollout.pad_token_id)
    versions = None
    with torch.inference_mode():
        if rollout.batching == "continuous":
            updates = rollout.weight_updates
            tokens, logprobs, versions = generate_continuous(
                rollout, prompts, sampling, seed, rollout.batching_limits, updates
            )
            versions = versions if updates is not None else None
        else:
            ids, mask = prompt_ids.to(rollout.device), prompt_mask.to(rollout.device)
            tokens, logprobs = _generate_tokens(rollout, ids, mask, sampling, seed)
    # fresh (non-inference) tensors, so the trainer may use them in autograd; on the host, as vLLM's batch is:
    # rewards, advantages and metrics are host-side, and the trainer moves each micro-batch to its device
    response_ids, response_mask, rollout_logprobs = (
        x.cpu() for x in _responses(rollout, tokens.clone(), logprobs.clone())
    )
    batch = assemble_batch(
        prompt_ids.cpu().clone(),
        prompt_mask.cpu().clone(),
        response_ids,
        response_mask,
        rollout_logprobs,
        n=sampling.n,
        group_ids=group_ids,
    )
    if versions is None:
        return batch
    return validate(batch.replace(policy_version=versions[:, : response_ids.shape[1]].cpu().clone()))


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
    rollout: NativeRollout,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    sampling: SamplingConfig,
    seed: int,
) -> tuple[Tensor, Tensor]:
    """The lock-step decoding loop over left-padded prompts ``(num_prompts p)``. Returns raw tokens and log-probs
    ``(b steps)`` (garbage after a row's EOS)."""
    device = rollout.device
    n, (num_prompts, p) = sampling.n, prompt_ids.shape
    rows, max_new = num_prompts * n, sampling.max_new_tokens
    decoder = Decoder(rollout.model, rows, p + max_new, rollout.prepack_cpu_weights, rollout.workspace)
    logits = decoder.prefill(prompt_ids, prompt_mask, copies=n).float().repeat_interleave(n, dim=0)
    next_pos = prompt_mask.sum(-1).repeat_interleave(n)  # RoPE position of each row's first response token
    eos = torch.tensor(rollout.eos_token_ids, device=device)

    out_tokens = torch.full((rows, max_new), rollout.pad_token_id, dtype=torch.long, device=device)
    out_logprobs = torch.zeros((rows, max_new), dtype=torch.float32, device=device)
    active = None  # indices into the full batch of the working rows; None = all rows, in order
    all_rows = torch.arange(rows, device=device)
    running = torch.ones(rows, dtype=torch.bool, device=device)  # per working row: no EOS yet
    steps = 0
    for s in range(max_new):
        # each row's uniform is keyed by (seed, row, step), so a row's samples do not depend on which rows
        # share its working batch (compaction changes nothing; the continuous scheduler draws the same)
        uniform = None
        if sampling.temperature > 0.0:
            uniform = row_uniforms(seed, all_rows if active is None else active, s)[:, None]
        token = sample_tokens(logits, sampling, None, uniform=uniform)
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
        keep = _rows_to_keep(running, num_running, rollout.compact_fraction)
        if keep is not None:
            decoder.keep_rows(keep)
            active = keep if active is None else active[keep]
            token, next_pos, running = token[keep], next_pos[keep], running[keep]
        logits = decoder.step(token, next_pos + s, p + s).float()
    return out_tokens[:, :steps], out_logprobs[:, :steps]


#: compaction (a copy of the caches) waits until this fraction of the working rows has finished
COPY_COMPACT_FRACTION = 0.125


def _rows_to_keep(running: Tensor, num_running: int, fraction: float | None) -> Tensor | None:
    """The working rows to keep for the next step (ascending indices), or None to keep them all.

    ``fraction`` (``NativeRollout.compact_fraction``): drop every finished row once that fraction of the
    working rows has finished; None: :data:`COPY_COMPACT_FRACTION`.
    """
    rows = running.shape[0]
    fraction = COPY_COMPACT_FRACTION if fraction is None else fraction
    num_done = rows - num_running
    if num_done > 0 and num_done >= fraction * rows:
        return running.nonzero().squeeze(-1)
    return None


# --------------------------------------------------------------------------------------------------
# Registration (backends.rollout.api.ROLLOUT_ENGINES)


def _build_from_config(
    cfg: Any,
    model_path: str | os.PathLike,
    tokenizer: Any = None,
    *,
    seed: int = 0,
    max_context: int | None = None,
    device: str | torch.device | None = None,
) -> NativeRollout:
    native = getattr(cfg, "native", NativeConfig())
    return build_native_rollout(
        model_path,
        tokenizer,
        dtype=getattr(torch, cfg.dtype),
        device=device,
        batching=native.batching,
        batching_limits=native.limits(),
    )


#: ``rollout.engine=native``: weights in ``rollout.dtype``; runs on any ranks (it creates no process groups)
ENGINE_SPEC = RolloutEngineSpec(
    build=_build_from_config,
    check_config=lambda cfg: None,
    weight_dtype=lambda cfg: getattr(torch, cfg.dtype),
    engine_type=NativeRollout,
    session_type=NativeSession,
    partial_rollouts=lambda cfg: None
    if getattr(cfg, "native", NativeConfig()).batching == "continuous"
    else "rollout.native.batching=lockstep cannot recompute its rows' caches under new weights: use continuous",
)

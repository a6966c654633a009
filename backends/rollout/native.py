"""A native torch rollout engine: batched autoregressive sampling with a KV cache, in-process.

The engine keeps its own unsharded copy of a Llama / Qwen2 model (eval mode, no grads) and runs the
decoder itself (:mod:`backends.rollout.decoder`), straight from the HF module's parameters, with a
preallocated KV cache:

1. prefill each distinct prompt once (left-padded, ``position_ids = cumsum(mask) - 1``) and copy its
   keys/values into the cache rows of its ``n`` samples;
2. decode one token per step for the whole batch, computing only the last position's logits;
3. drop finished rows from the working batch (compaction), so the work per step follows the number of
   sequences still running: the caches are copied down once 1/8 of the working rows have finished;
4. stop when every row has produced EOS or ``max_new_tokens`` tokens.

``sync_weights`` copies full HF-named tensors into the model's parameters in place, so the decoder
always reads the newest weights.

Why it is faster than ``model.generate``: the decode GEMMs dominate a step, and the engine does little
around them: no per-step mask building or cache concatenation, one fused QKV GEMM, oneDNN prepacked
weights with fused SiLU / residual add, only last-position logits, inverse-CDF sampling with one uniform
per row, prefill once per distinct prompt, finished rows dropped from the working batch, weights and
caches kept between calls (:class:`~backends.rollout.decoder.Workspace`). A bfloat16 engine (``build_native_rollout(...,
dtype=torch.bfloat16)``) halves GEMM time and weight traffic at the price of log-probs further from an
fp32 trainer's.

Multi-turn sessions (:func:`start_session`, :func:`continue_session`, :func:`end_session`): the prompts
are prefilled once and each row's KV cache continues across turns; a call feeds each active row its
forced tokens (an observation, a tool result) and then samples its next turn, and hands back exactly the
token ids it fed and sampled (token-in / token-out). See "Multi-turn sessions" below for how rows that
have nothing to feed in a step keep the cache consistent.

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
from backends.rollout.weight_sync import check_sync_tensor
from rlfunc.batch import RolloutBatch

__all__ = [
    "SamplingConfig",
    "NativeRollout",
    "build_native_rollout",
    "sync_weights",
    "generate",
    "sample_tokens",
    "decode_responses",
    "TurnOutput",
    "NativeSession",
    "start_session",
    "continue_session",
    "end_session",
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
    weights_version: int = 0
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
        seed: int | None = None,
    ) -> RolloutBatch:
        return generate(self, prompts, sampling_options(sampling), group_ids=group_ids, seed=seed)

    def start_session(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *, seed: int, max_slots: int
    ) -> NativeSession:
        return start_session(self, prompts, sampling_options(sampling), seed=seed, max_slots=max_slots)

    def sync_weights(self, named_tensors: Iterable[tuple[str, Tensor]], *, strict: bool = True) -> NativeRollout:
        return sync_weights(self, named_tensors, strict=strict)

    def sync_adapter(
        self, adapter: Mapping[str, Tensor], *, rank: int, alpha: float, target_modules: Sequence[str], version: int
    ) -> NativeRollout:
        raise ValueError("the native rollout engine receives merged full weights, not LoRA adapters")

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
    # fresh (non-inference) tensors, so the trainer may use them in autograd; on the host, as vLLM's batch is:
    # rewards, advantages and metrics are host-side, and the trainer moves each micro-batch to its device
    response_ids, response_mask, rollout_logprobs = (
        x.cpu() for x in _responses(rollout, tokens.clone(), logprobs.clone())
    )
    return assemble_batch(
        prompt_ids.cpu().clone(),
        prompt_mask.cpu().clone(),
        response_ids,
        response_mask,
        rollout_logprobs,
        n=sampling.n,
        group_ids=group_ids,
    )


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
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """The decoding loop over left-padded prompts ``(num_prompts p)``. Returns raw tokens and log-probs
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
    running = torch.ones(rows, dtype=torch.bool, device=device)  # per working row: no EOS yet
    steps = 0
    for s in range(max_new):
        # one uniform per row of the whole batch every step, so a row's samples do not depend on which
        # rows share its working batch (compaction changes nothing)
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
# Multi-turn sessions
#
# A session prefills its prompts once and then continues every row's KV cache across turns. Every
# decoder step writes one token per row into one shared cache slot: a row with something to feed (a
# forced token, or the token it just sampled) feeds it at its own RoPE position; a row with nothing to
# feed (inactive this call, or its turn already ended) feeds a dummy whose slot is masked for that row
# (``Decoder.step(..., masked=)``) and whose position is not advanced, so no row ever attends to a dummy
# and the cache never needs re-prefilling. Rows never leave the working batch.


@attrs.define(eq=False)
class _LiveCache:
    """What calls change in place, shared by every session value of one :func:`start_session`."""

    decoder: Decoder | None  #: None once the session has ended
    slot: int  #: the next free cache slot: only the session value whose ``slot`` it is may continue


@attrs.frozen
class NativeSession:
    """A multi-turn session of a :class:`NativeRollout`: rows whose KV caches continue across turns.

    :func:`continue_session` returns the next value; the cache they refer to is changed in place, so only
    the newest value continues (an older one raises), and a failed call leaves its input usable. Do not
    sync weights during a session: its cache holds keys and values of the weights it started with.
    """

    rollout: NativeRollout = attrs.field(eq=False, repr=False)
    sampling: SamplingConfig  #: temperature, top-k, top-p (``n`` copies per prompt; ``max_new_tokens`` unused)
    #: per row: the prompt's tokens, then every token the calls added, in order
    tokens: tuple[tuple[int, ...], ...]
    prompt_slots: int  #: cache slots the left-padded prompts take
    max_slots: int  #: cache slots after the prompts that the whole session may use
    slot: int  #: the next cache slot a step writes
    #: per row: its last sampled token (it ended a turn) while not yet fed to the model; the next call feeds it first
    unfed: tuple[int | None, ...]
    #: (rows,) int64: each row's RoPE position for its next fed token (the number of its tokens fed so far)
    positions: Tensor = attrs.field(eq=False, repr=False)
    #: (rows v) fp32: each row's next-token logits after the tokens fed so far
    logits: Tensor = attrs.field(eq=False, repr=False)
    #: (rows,) int64: tokens each row has sampled in the session (the ``uniforms`` column of its next sample)
    num_sampled: Tensor = attrs.field(eq=False, repr=False)
    generator: torch.Generator = attrs.field(eq=False, repr=False)
    #: (rows, max_slots + 1) fp32 from ``generator``: row r's k-th sample of the session inverts the CDF at
    #: ``uniforms[r, k]``, so its samples do not depend on the other rows; None when greedy
    uniforms: Tensor | None = attrs.field(eq=False, repr=False)
    live: _LiveCache = attrs.field(eq=False, repr=False)

    @property
    def slots_left(self) -> int:
        """Cache slots the session may still write (one per step of a call: see :func:`continue_session`)."""
        return self.max_slots - (self.slot - self.prompt_slots)

    def continue_turn(
        self, forced: Sequence[Sequence[int]], *, active: Sequence[bool], max_new_tokens: Sequence[int]
    ) -> tuple[NativeSession, TurnOutput]:
        return continue_session(self, forced, active=active, max_new_tokens=max_new_tokens)

    def end(self) -> None:
        end_session(self)


def _session_prompts(
    rollout: NativeRollout, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, max_slots: int
) -> list[list[int]]:
    """The prompts, checked as ``generate`` checks them, with ``max_slots`` in place of ``max_new_tokens``."""
    context = rollout.max_context
    if not 1 <= max_slots < context:
        raise ValueError(
            f"max_slots must be in [1, {context}) (the rollout's context is {context} positions), got {max_slots}"
        )
    if not sampling.truncate_prompts and isinstance(prompts, Sequence):
        for i, prompt in enumerate(prompts):
            if len(prompt) + max_slots > context:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens; with max_slots={max_slots} the session needs "
                    f"{len(prompt) + max_slots} positions, more than the context of {context} (lower max_slots "
                    "or set truncate_prompts=True to keep the last tokens)"
                )
    slots_as_budget = attrs.evolve(sampling, max_new_tokens=max_slots)
    return prepare_prompts(prompts, slots_as_budget, max_context=context, vocab_size=rollout.vocab_size)


def start_session(
    rollout: NativeRollout, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *, seed: int, max_slots: int
) -> NativeSession:
    """Prefill ``prompts`` once and open a multi-turn session over ``sampling.n`` rows per prompt.

    Rows are in :func:`generate`'s order (prompt i's ``n`` copies consecutive). ``max_slots``: the cache
    slots after the prompts that the whole session may use; a call that needs more raises an error
    naming it. Randomness comes only from a fresh generator seeded with ``seed``: the same seed, prompts,
    forced tokens and weights give the same session. The session allocates its own caches, so ``generate``
    may run on the same rollout between its turns; :func:`end_session` releases them.
    """
    prompts = _session_prompts(rollout, prompts, sampling, max_slots)
    n, device = sampling.n, rollout.device
    rows = len(prompts) * n
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    prompt_ids, prompt_mask = left_pad(prompts, rollout.pad_token_id)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    p = prompt_ids.shape[1]
    with torch.inference_mode():
        decoder = Decoder(
            rollout.model, rows, p + max_slots, rollout.prepack_cpu_weights, rollout.workspace, own_cache=True
        )
        logits = decoder.prefill(prompt_ids, prompt_mask, copies=n).float().repeat_interleave(n, dim=0)
        uniforms = None
        if sampling.temperature > 0.0:
            # one uniform per row and per sample it can draw: every sample but its latest one takes a slot
            uniforms = torch.rand((rows, max_slots + 1), generator=generator, device=device)
    return NativeSession(
        rollout=rollout,
        sampling=sampling,
        tokens=tuple(tuple(prompts[r // n]) for r in range(rows)),
        prompt_slots=p,
        max_slots=max_slots,
        slot=p,
        unfed=(None,) * rows,
        positions=prompt_mask.sum(-1).repeat_interleave(n),
        logits=logits,
        num_sampled=torch.zeros(rows, dtype=torch.long, device=device),
        generator=generator,
        uniforms=uniforms,
        live=_LiveCache(decoder=decoder, slot=p),
    )


def end_session(session: NativeSession) -> None:
    """Release the session's caches; continuing it (or any value of it) afterwards raises."""
    if session.live.decoder is not None:
        session.live.decoder.release()
        session.live.decoder = None


def _check_turn(
    session: NativeSession, forced: Sequence[Sequence[int]], active: Sequence[bool], max_new_tokens: Sequence[int]
) -> tuple[list[list[int]], list[bool], list[int]]:
    """The call's arguments as plain lists, checked against the session."""
    if session.live.decoder is None:
        raise RuntimeError("continue_session: the session has ended (end_session was called)")
    if session.live.slot != session.slot:
        raise RuntimeError("continue_session: a stale session value; continue the one the last call returned")
    rows, vocab = len(session.tokens), session.rollout.vocab_size
    for name, value in (("forced", forced), ("active", active), ("max_new_tokens", max_new_tokens)):
        if len(value) != rows:
            raise ValueError(f"continue_session: {name} needs one entry per row ({rows}), got {len(value)}")
    forced = [row.tolist() if isinstance(row, Tensor) else [int(t) for t in row] for row in forced]
    active = [bool(a) for a in active]
    budgets = [int(m) for m in max_new_tokens]
    for row, (ids, act, budget) in enumerate(zip(forced, active, budgets)):
        if ids and not act:
            raise ValueError(f"continue_session: row {row} is inactive but has {len(ids)} forced tokens")
        if ids and not 0 <= min(ids) <= max(ids) < vocab:
            raise ValueError(f"continue_session: row {row}'s forced tokens are outside [0, {vocab})")
        if budget < 0:
            raise ValueError(f"continue_session: max_new_tokens[{row}] must be >= 0, got {budget}")
    return forced, active, budgets


def continue_session(
    session: NativeSession, forced: Sequence[Sequence[int]], *, active: Sequence[bool], max_new_tokens: Sequence[int]
) -> tuple[NativeSession, TurnOutput]:
    """Continue every active row by one turn: feed its ``forced`` tokens (given, never sampled: an
    observation, a tool result), then sample until an EOS or ``max_new_tokens[row]`` sampled tokens.

    Inactive rows add nothing (empty lists, ``finished`` False) and must have no forced tokens. A row's
    sampled log-probs are raw (temperature 1), as :func:`generate`'s ``rollout_logprobs``; forced tokens
    get 0.0. The token that ended a row's turn is fed at the start of its next active call, so a call
    takes at most ``max over active rows of (pending + len(forced) + max(max_new_tokens - 1, 0))`` steps
    (pending: 1 if the row sampled in an earlier call, else 0), one cache slot each; when
    :attr:`NativeSession.slots_left` runs out it raises a ``ValueError`` naming ``max_slots``, and the input
    session stays usable (retry it with smaller budgets, or end it).
    """
    forced, active, budgets = _check_turn(session, forced, active, max_new_tokens)
    rows, device = len(session.tokens), session.rollout.device
    pending = [[u] if act and u is not None else [] for u, act in zip(session.unfed, active)]
    queues = [pend + ids for pend, ids in zip(pending, forced)]
    queue = torch.full((rows, max(1, *map(len, queues))), session.rollout.pad_token_id, dtype=torch.long)
    for row, ids in enumerate(queues):
        queue[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    plan = _TurnPlan(
        queue=queue.to(device),
        queue_len=torch.tensor(list(map(len, queues)), dtype=torch.long, device=device),
        first_out=torch.tensor(list(map(len, pending)), dtype=torch.long, device=device),
        in_turn=torch.tensor(active, dtype=torch.bool, device=device),
        budget=torch.tensor(budgets, dtype=torch.long, device=device),
    )
    with torch.inference_mode():
        turn = _run_turn(session, plan)
    out = _turn_output(turn.events, turn.finished)
    ends = turn.last_sample.tolist()
    unfed = tuple(int(e) if e >= 0 else (None if act else u) for e, act, u in zip(ends, active, session.unfed))
    session.live.slot = turn.slot
    new = attrs.evolve(
        session,
        tokens=tuple(old + tuple(added) for old, added in zip(session.tokens, out.tokens)),
        slot=turn.slot,
        unfed=unfed,
        positions=turn.positions,
        logits=turn.logits,
        num_sampled=turn.num_sampled,
    )
    return new, out


@attrs.frozen
class _TurnPlan:
    """One call's work per row, on the device."""

    queue: Tensor  #: (rows q) int64: the tokens to feed before sampling (the unfed one, then the forced ones)
    queue_len: Tensor  #: (rows,) int64
    first_out: Tensor  #: (rows,) int64: queue index of the first forced token (earlier ones were added before)
    in_turn: Tensor  #: (rows,) bool: the active rows
    budget: Tensor  #: (rows,) int64: max_new_tokens


@attrs.frozen
class _TurnResult:
    #: per step: token, log-prob and kind (0: nothing added, 1: forced, 2: sampled), each (rows,)
    events: list[tuple[Tensor, Tensor, Tensor]]
    last_sample: Tensor  #: (rows,) int64: the sampled token that ended each row's turn, unfed; -1 if none
    finished: Tensor  #: (rows,) bool: the turn ended with an EOS
    positions: Tensor
    logits: Tensor
    num_sampled: Tensor
    slot: int


#: a step runs every row while more than this share of them is in its turn; below it, only those rows (gathering
#: their caches costs about what computing the others would save)
_FULL_STEP_FRACTION = 0.75


def _run_turn(session: NativeSession, plan: _TurnPlan) -> _TurnResult:
    """The step loop of one call: each step, every row still in its turn samples (when it has nothing left
    to feed) and feeds one token; the others feed a masked dummy. Ends when no row is in its turn."""
    rollout, sampling, decoder = session.rollout, session.sampling, session.live.decoder
    rows, device = plan.queue.shape[0], plan.queue.device
    eos = torch.tensor(rollout.eos_token_ids, device=device)
    row_index = torch.arange(rows, device=device)
    logits, positions, num_sampled = session.logits, session.positions.clone(), session.num_sampled.clone()
    in_turn = plan.in_turn.clone()
    fed = torch.zeros(rows, dtype=torch.long, device=device)  # queue tokens fed so far
    sampled = torch.zeros(rows, dtype=torch.long, device=device)  # tokens sampled this call
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    last_sample = torch.full((rows,), -1, dtype=torch.long, device=device)
    events: list[tuple[Tensor, Tensor, Tensor]] = []
    slot = session.slot
    if _fits_a_chunk(session, plan):
        logits, positions, fed, slot, events = _feed_queues(session, plan, logits, positions)
    while True:
        queue_empty = fed >= plan.queue_len
        in_turn &= ~(queue_empty & (sampled >= plan.budget))  # a zero budget: nothing to sample
        sampling_now = in_turn & queue_empty
        uniform = None
        if session.uniforms is not None:
            uniform = session.uniforms.gather(1, num_sampled.clamp(max=session.max_slots)[:, None])
        drawn = sample_tokens(logits, sampling, None, uniform=uniform)
        logprob = torch.log_softmax(logits, dim=-1).gather(-1, drawn[:, None]).squeeze(-1)
        token = torch.where(sampling_now, drawn, plan.queue[row_index, fed.clamp(max=plan.queue.shape[1] - 1)])
        sampled += sampling_now
        num_sampled += sampling_now
        is_eos = sampling_now & torch.isin(drawn, eos)
        ends = is_eos | (sampling_now & (sampled >= plan.budget))
        finished |= is_eos
        last_sample = torch.where(ends, drawn, last_sample)
        forced_out = in_turn & ~sampling_now & (fed >= plan.first_out)
        kind = torch.where(sampling_now, 2, forced_out.long())
        events.append((token, torch.where(sampling_now, logprob, 0.0), kind))
        in_turn &= ~ends
        if not bool(in_turn.any()):
            break
        if slot - session.prompt_slots >= session.max_slots:
            raise ValueError(
                f"continue_session: the session needs more than max_slots={session.max_slots} cache slots (this "
                f"call had {session.slots_left} left): start it with a larger max_slots or give smaller budgets"
            )
        fed += in_turn & ~sampling_now
        feed = torch.where(in_turn, token, rollout.pad_token_id)
        stepping = in_turn.nonzero().squeeze(1)
        if stepping.numel() > _FULL_STEP_FRACTION * rows:
            stepped = decoder.step(feed, positions, slot, masked=~in_turn).float()
            logits = torch.where(in_turn[:, None], stepped, logits)
        else:  # most rows' turns are over: step only the rest (turns end at different lengths)
            stepped = decoder.step(feed[stepping], positions[stepping], slot, masked=~in_turn, rows=stepping).float()
            logits = logits.index_copy(0, stepping, stepped)
        positions += in_turn
        slot += 1
    return _TurnResult(
        events=events,
        last_sample=last_sample,
        finished=finished,
        positions=positions,
        logits=logits,
        num_sampled=num_sampled,
        slot=slot,
    )


def _fits_a_chunk(session: NativeSession, plan: _TurnPlan) -> bool:
    """Whether the queues go in as one chunk: there are some, and the chunk plus the longest turn still fit the
    session's slots (a chunk takes its widest queue's slots on every row, where one step per token lets short
    queues start sampling early; when that would not fit, the step loop feeds them)."""
    width = plan.queue.shape[1] if bool(plan.queue_len.gt(0).any()) else 0
    return 0 < width and session.slot + width + int(plan.budget.max()) <= session.prompt_slots + session.max_slots


def _feed_queues(
    session: NativeSession, plan: _TurnPlan, logits: Tensor, positions: Tensor
) -> tuple[Tensor, Tensor, Tensor, int, list[tuple[Tensor, Tensor, Tensor]]]:
    """Every active row's queue (its unfed token, then its forced ones) in one forward over the cache: an
    observation costs one pass, not one decode step per token. Returns the logits after each row's queue, the
    new positions, the tokens fed, the next slot and the events (kind 1 for forced tokens, 0 for the rest)."""
    width = plan.queue.shape[1]
    offsets = torch.arange(width, device=positions.device)
    valid = (offsets < plan.queue_len[:, None]) & plan.in_turn[:, None]
    chunk_positions = positions[:, None] + torch.minimum(offsets, (plan.queue_len - 1).clamp(min=0)[:, None])
    stepped = session.live.decoder.extend(plan.queue, chunk_positions, session.slot, valid).float()
    fed_any = valid.any(-1)
    logits = torch.where(fed_any[:, None], stepped, logits)
    fed = valid.sum(-1)
    kinds = (valid & (offsets >= plan.first_out[:, None])).long()
    zeros = torch.zeros(plan.queue.shape[0], device=positions.device)
    events = [(plan.queue[:, j], zeros, kinds[:, j]) for j in range(width)]
    return logits, positions + fed, fed, session.slot + width, events


def _turn_output(events: list[tuple[Tensor, Tensor, Tensor]], finished: Tensor) -> TurnOutput:
    """The per-row lists of a call from its per-step events."""
    tokens, logprobs, kinds = (torch.stack(column, dim=1).tolist() for column in zip(*events))
    out_tokens, out_logprobs, out_sampled = [], [], []
    for row_tokens, row_logprobs, row_kinds in zip(tokens, logprobs, kinds):
        keep = [j for j, k in enumerate(row_kinds) if k]
        out_tokens.append([row_tokens[j] for j in keep])
        out_logprobs.append([row_logprobs[j] for j in keep])
        out_sampled.append([row_kinds[j] == 2 for j in keep])
    return TurnOutput(
        tokens=out_tokens, logprobs=out_logprobs, sampled=out_sampled, finished=[bool(f) for f in finished.tolist()]
    )


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
    return build_native_rollout(model_path, tokenizer, dtype=getattr(torch, cfg.dtype), device=device)


#: ``rollout.engine=native``: weights in ``rollout.dtype``; runs on any ranks (it creates no process groups)
ENGINE_SPEC = RolloutEngineSpec(
    build=_build_from_config,
    check_config=lambda cfg: None,
    weight_dtype=lambda cfg: getattr(torch, cfg.dtype),
    engine_type=NativeRollout,
    session_type=NativeSession,
)

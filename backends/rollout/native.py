"""A native torch rollout engine: batched autoregressive sampling with a KV cache, in-process.

The engine keeps its own unsharded copy of a Llama / Qwen2 model (eval mode, no grads) and runs the
decoder itself, straight from the HF module's parameters, with a preallocated KV cache:

1. prefill each distinct prompt once (left-padded, ``position_ids = cumsum(mask) - 1``) and copy its
   keys/values into the cache rows of its ``n`` samples;
2. decode one token per step for the whole batch, computing only the last position's logits;
3. drop finished rows from the working batch (compaction), so the work per step follows the number of
   sequences still running: with the CPU kernels by index (the caches stay where they are, so it is free
   and happens whenever the running rows fit a smaller multiple of 8 rows), else by copying the caches
   once 1/8 of the working rows have finished;
4. stop when every row has produced EOS or ``max_new_tokens`` tokens.

``sync_weights`` copies full HF-named tensors into the model's parameters in place, so the decoder
always reads the newest weights.

Speed (benchmarks/bench_rollout.py, config B, 128 prompts, 32 new tokens, 1 CPU thread): the decode
GEMMs run near the CPU's peak and take about 70% of an fp32 run; the engine gains on
``model.generate`` (1.9-2.1x in fp32, 2.3x in bf16 over sessions 9-10, BUILD.md) by doing less around them (no
per-step mask building or cache concatenation, one fused QKV GEMM, oneDNN prepacked weights with fused
SiLU / residual add, only last-position logits, inverse-CDF sampling with one uniform per row, prefill
once per distinct prompt, finished rows dropped by index, weights and caches kept between calls
(:class:`_Workspace`), and on AVX-512 CPUs a C kernel for the
decode step's attention, ``backends/cpu/kernels.py``, with the keys cached transposed). A bfloat16 engine
(``build_native_rollout(..., dtype=torch.bfloat16)``) halves GEMM time and weight traffic at the price
of log-probs that differ from an fp32 trainer's by about 1e-2.

Log-probabilities. ``RolloutBatch.rollout_logprobs[i, j]`` is ``log_softmax(logits)[token]`` of the
sampled token under the model's *raw* distribution (temperature 1, no top-k / top-p), which is the
quantity the trainer recomputes with a plain forward (``rlfunc.logprobs_from_logits``); the two agree
to float rounding (about 1e-6 in fp32, see tests/test_rollout_native.py). The sampling distribution
itself (after temperature, top-k, top-p) is different whenever those options are set.
"""

from __future__ import annotations

import copy
import difflib
import mmap
import os
from typing import Any, Iterable, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from backends.cpu.fused_modules import onednn_linear_works as _onednn_linear_works
from backends.cpu.kernels import decode_attention_kernel, norm_act_kernel, record_rows_kernel
from rlfunc.batch import RolloutBatch, validate

__all__ = [
    "SamplingConfig",
    "NativeRollout",
    "RolloutActivations",
    "build_native_rollout",
    "sync_weights",
    "generate",
    "generate_recording",
    "sample_tokens",
    "decode_responses",
]


def _at_least(minimum: float):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value < minimum:
            raise ValueError(f"SamplingConfig.{attribute.name} must be >= {minimum}, got {value}")

    return check


def _check_top_p(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {value}")


@attrs.frozen
class SamplingConfig:
    """How :func:`generate` samples. An unknown option is a ``TypeError`` naming it (attrs)."""

    n: int = attrs.field(default=8, validator=_at_least(1))  #: samples (rows) per prompt: one group each
    temperature: float = attrs.field(default=1.0, validator=_at_least(0.0))  #: 0 means greedy (argmax)
    top_k: int = attrs.field(default=0, validator=_at_least(0))  #: keep the k most likely tokens; 0 = off
    top_p: float = attrs.field(default=1.0, validator=_check_top_p)  #: nucleus mass; 1.0 = off
    max_new_tokens: int = attrs.field(default=16, validator=_at_least(1))  #: response length cap
    seed: int = 0  #: seed of the sampling generator (overridable per call: ``generate(..., seed=)``)
    truncate_prompts: bool = False  #: left-truncate prompts that do not fit the context (else raise)


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
    weights_version: int = 0
    #: what the last :func:`sync_weights` said its weights are (``tag=``, e.g. the actor's optimizer step;
    #: None if it said nothing): stamped on :class:`RolloutActivations`, checked by the trainer that reuses them
    weights_tag: int | None = None
    #: what :func:`generate` keeps between calls (decoder weights, KV caches); shared by evolved copies
    workspace: _Workspace = attrs.field(factory=lambda: _Workspace(), eq=False, repr=False)

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


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    candidates: list[Any] = []
    gen_cfg = getattr(model, "generation_config", None)
    for source in (gen_cfg, model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            candidates.append(value)
            break
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        candidates.append(tokenizer.eos_token_id)
    ids: list[int] = []
    for c in candidates:
        for i in c if isinstance(c, (list, tuple)) else [c]:
            if int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError("no EOS token id: the model's generation_config, config and the tokenizer name none")
    return tuple(ids)


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
    eos = tuple(int(i) for i in eos_token_ids) if eos_token_ids is not None else _eos_ids(model, tokenizer)
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
    rollout: NativeRollout, named_tensors: Iterable[tuple[str, Tensor]], *, strict: bool = True, tag: int | None = None
) -> NativeRollout:
    """Copy full tensors with HF names (``model.layers.0.self_attn.q_proj.weight``...) into the model.

    Tensors are consumed one at a time (a generator of gathered FSDP tensors works), cast to the
    rollout's dtype and device, ``DTensor`` values are gathered with ``full_tensor()``. Unknown names
    and shape mismatches raise; with ``strict`` every parameter must have been received (tied weights
    count once). Returns the rollout with ``weights_version`` bumped and ``weights_tag`` set to ``tag``
    (what these weights are, e.g. the trainer's optimizer step; see :func:`generate_recording`).
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
    return attrs.evolve(rollout, weights_version=rollout.weights_version + 1, weights_tag=tag)


# --------------------------------------------------------------------------------------------------
# Sampling


def sample_tokens(
    logits: Tensor, sampling: SamplingConfig, generator: torch.Generator | None, *, uniform: Tensor | None = None
) -> Tensor:
    """Draw one token per row from ``logits`` ``(b v)``: temperature, then top-k, then top-p (HF order).

    ``temperature == 0`` is greedy (``argmax``, first index on ties; top-k / top-p are then moot).
    Top-k keeps every token whose logit reaches the k-th largest (ties kept, like HF); top-p keeps the
    smallest set of most likely tokens whose mass reaches ``top_p`` (always at least one). Drawing is
    inverse-CDF sampling with one uniform per row (same distribution as ``torch.multinomial``, cheaper
    on CPU): ``uniform (b 1)`` in [0, 1) if given, else drawn from ``generator``.
    """
    logits = logits.float()
    if sampling.temperature == 0.0:
        return logits.argmax(dim=-1)
    scaled = logits / sampling.temperature
    vocab = scaled.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    order = None
    if sampling.top_p < 1.0:
        scaled, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
        probs = torch.softmax(scaled, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(mass_before >= sampling.top_p, 0.0)
    else:
        probs = torch.softmax(scaled, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    if uniform is None:
        uniform = torch.rand((cdf.shape[0], 1), generator=generator, device=cdf.device, dtype=cdf.dtype)
    choice = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).clamp_(max=vocab - 1)
    if order is not None:
        choice = order.gather(-1, choice)
    return choice.squeeze(-1)


# --------------------------------------------------------------------------------------------------
# Recorded activations: what a trainer can reuse instead of recomputing its forward pass


@attrs.frozen(eq=False)
class RolloutActivations:
    """The output of every linear layer for every token a recording rollout ran (:func:`generate_recording`).

    ``outputs[name]`` is ``(N, width)``: the output of the Hugging Face module ``name`` of the model,
    bias included, before any activation, RoPE or residual add. ``model.layers.<i>.self_attn`` holds
    the stacked q / k / v projections (q, then k, then v, before RoPE); ``model.layers.<i>.self_attn.o_proj``,
    ``model.layers.<i>.mlp.gate_proj`` / ``up_proj`` / ``down_proj`` and the LM head (``lm_head_name``) their
    own outputs. A trainer whose weights are those the rollout ran with (``weights_tag``) gets the same
    numbers from its forward pass, to float rounding (the products see different row counts), and
    only needs the backward (``backends.cpu.fused_modules.replay_linear_outputs``).

    ``slots (rows, positions)`` gives the record row of the token at RoPE position ``pos`` of rollout
    row ``R`` (``batch.rollout_rows``), -1 for tokens not recorded: prompt padding, and the last
    sampled token of each row, which a trainer does not run either (steps that still ran a finished
    row keep nothing of it). The ``n`` rows of a prompt share its prompt's record rows. The records
    are in the order of ``backends.packing.pack_rows(step_major=True)`` for the whole batch: every
    prompt's real tokens, then the first response token of every row that has a second one, and so on,
    so a trainer packing the batch that way reads them without a gather. ``logit_slots`` does the same
    for the LM head, which ran on the last prompt token and on each step's input token only, the tokens
    whose outputs predict a response token.

    On the CPU the outputs live in the engine's workspace (reused memory, as the KV caches): the next
    recording rollout on the same engine overwrites them, after which :meth:`record_rows` refuses them.
    """

    outputs: dict[str, Tensor]
    slots: Tensor
    logit_slots: Tensor
    lm_head_name: str
    weights_tag: int | None
    #: the workspace whose buffers hold ``outputs`` and its recording count when they were written (None: own memory)
    workspace: _Workspace | None = attrs.field(default=None, repr=False)
    recording: int = 0

    def record_rows(self, rows: Tensor, positions: Tensor, *, logits: bool = False) -> Tensor:
        """The record rows of the tokens at ``positions`` of rollout rows ``rows`` (same shapes, int64);
        a token the rollout did not run is an error naming it."""
        if self.workspace is not None and self.workspace.recordings != self.recording:
            raise ValueError(
                "these rollout activations were overwritten by a later recording rollout on the same engine "
                f"(recording {self.recording}, the engine is at {self.workspace.recordings}): use them before the next one"
            )
        table = self.logit_slots if logits else self.slots
        if bool(((rows < 0) | (rows >= table.shape[0]) | (positions < 0) | (positions >= table.shape[1])).any()):
            raise IndexError(f"RolloutActivations: rows / positions outside the recorded ({table.shape[0]}, {table.shape[1]})")
        found = table[rows, positions]
        missing = (found < 0).nonzero()
        if missing.numel():
            i = missing[0, 0]
            what = "LM-head output" if logits else "activations"
            raise ValueError(
                f"RolloutActivations: no recorded {what} for rollout row {int(rows.reshape(-1)[i])} at position "
                f"{int(positions.reshape(-1)[i])} ({missing.shape[0]} tokens missing); were these rows sampled by this rollout?"
            )
        return found


class _Recorder:
    """Collects a recording rollout's linear outputs, chunk by chunk (the prefill, then each step), into
    one buffer per module from the workspace (CPU: kept between calls, on huge pages: fresh buffers of
    about 150 MB page-faulted in for 60-75 ms per config-B GRPO rollout, measured)."""

    #: buffers are sized in whole multiples of this many rows, so that calls with slightly different
    #: prompt lengths reuse them
    CAPACITY_STEP = 1024

    def __init__(self, model: Any, rows: int, positions: int, *, workspace: _Workspace, layer_rows: int,
                 logit_rows: int) -> None:
        names = {id(m): n for n, m in model.named_modules()}
        self.layer_names = [
            (names[id(layer.self_attn)], names[id(layer.self_attn.o_proj)], names[id(layer.mlp.gate_proj)],
             names[id(layer.mlp.up_proj)], names[id(layer.mlp.down_proj)])
            for layer in model.model.layers
        ]
        self.lm_head_name = names[id(model.get_output_embeddings())]
        self.workspace = workspace
        self.copy_kernel = record_rows_kernel()
        workspace.recordings += 1
        self.recording = workspace.recordings
        step = self.CAPACITY_STEP
        self.capacity = {False: -(-layer_rows // step) * step, True: -(-logit_rows // step) * step}
        self.buffers: dict[str, Tensor] = {}
        self.filled: dict[str, int] = {}
        self.slots = torch.full((rows, positions), -1, dtype=torch.long)
        self.logit_slots = torch.full((rows, positions), -1, dtype=torch.long)
        self.next_slot = self.next_logit_slot = 0
        #: the rows of the next chunk's outputs to keep (layers, LM head): indices, or None for all
        self.keep: dict[bool, Tensor | None] = {False: None, True: None}

    def begin_chunk(self, layer_rows: Tensor | None, logit_rows: Tensor | None) -> None:
        """Keep rows ``layer_rows`` of the next call's layer outputs and ``logit_rows`` of its LM-head output
        (ascending indices into the call's rows; None keeps every row)."""
        self.keep = {False: layer_rows, True: logit_rows}

    def add(self, name: str, output: Tensor) -> None:
        output = output.reshape(-1, output.shape[-1])
        keep = self.keep[name == self.lm_head_name]
        count = output.shape[0] if keep is None else keep.shape[0]
        buffer = self.buffers.get(name)
        if buffer is None:
            shape = (self.capacity[name == self.lm_head_name], output.shape[1])
            # normal tensors (the rollout runs in inference mode): a trainer's autograd may save views of them
            with torch.inference_mode(False):
                buffer = self.workspace.buffers(f"record {name}", shape, output.dtype, output.device, 1)[0]
            self.buffers[name], self.filled[name] = buffer, 0
        start, target = self.filled[name], buffer[self.filled[name] : self.filled[name] + count]
        if self.copy_kernel is not None and output.device.type == "cpu" and output.is_contiguous():
            self.copy_kernel(output, target, keep)  # streaming stores: the buffer is not read back into cache
        elif keep is None:
            target.copy_(output)
        else:
            torch.index_select(output, 0, keep, out=target)
        self.filled[name] = start + count

    def place(self, rows: Tensor, positions: Tensor, chunk_rows: Tensor, *, logits: bool) -> None:
        """The current chunk's kept outputs hold tokens (``rows``, ``positions``) at their rows ``chunk_rows``."""
        table = self.logit_slots if logits else self.slots
        base = self.next_logit_slot if logits else self.next_slot
        table[rows.cpu(), positions.cpu()] = base + chunk_rows.cpu()

    def advance(self, layer_rows: int, logit_rows: int) -> None:
        """Move past the current chunk, which kept this many layer and LM-head rows."""
        self.next_slot += layer_rows
        self.next_logit_slot += logit_rows

    def finish(self, weights_tag: int | None) -> RolloutActivations:
        outputs = {name: buffer[: self.filled[name]] for name, buffer in self.buffers.items()}
        on_cpu = all(t.device.type == "cpu" for t in outputs.values())
        return RolloutActivations(outputs=outputs, slots=self.slots, logit_slots=self.logit_slots,
                                  lm_head_name=self.lm_head_name, weights_tag=weights_tag,
                                  workspace=self.workspace if on_cpu else None, recording=self.recording)


# --------------------------------------------------------------------------------------------------
# The decoder (Llama / Qwen2 math, read from the HF module's parameters)


#: fp32 weights with fewer elements run faster through ``F.linear`` (MKL) than prepacked oneDNN:
#: for 128 rows, 47 vs 53 us at 64 -> 256 and 347 vs 319 us at 256 -> 512 (one thread, torch 2.13),
#: and oneDNN compiles a kernel for every new row count it meets (about 0.5 ms each), which in a
#: short rollout with shrinking batches is most of them: config A's 16 x 8 rollout took 22 ms
#: through F.linear against 33 ms prepacked. bf16 linears run through oneDNN either way.
PREPACK_MIN_FP32_WEIGHT = 65536


class _Linear:
    """``x @ W.T + b`` with an optional fused SiLU or residual add; oneDNN-prepacked on CPU.

    On CPU with one thread, prepacking (a one-off reorder, redone by the rollout's :class:`_Workspace`
    whenever a parameter has changed, so it always sees the current weights) runs the decoder's GEMMs 5-15% faster than ``F.linear`` for bf16 weights and
    for fp32 weights of at least :data:`PREPACK_MIN_FP32_WEIGHT` elements; otherwise, elsewhere, or
    if the internal ops are missing, it is plain ``F.linear``.
    """

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: Tensor, bias: Tensor | None, rows_hint: int, prepack: bool) -> None:
        self.weight, self.bias, self.packed = weight, bias, None
        large_enough = weight.dtype != torch.float32 or weight.numel() >= PREPACK_MIN_FP32_WEIGHT
        if prepack and large_enough and weight.device.type == "cpu" and _onednn_linear_works(weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows_hint)

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def silu(self, x: Tensor) -> Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "swish", [], "")
        return F.silu(F.linear(x, self.weight, self.bias))

    def add_to(self, residual: Tensor, x: Tensor) -> Tensor:
        """``residual + linear(x)``."""
        if self.packed is not None and residual.is_contiguous():
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")
        return residual + F.linear(x, self.weight, self.bias)


def _cat_bias(*linears: Any) -> Tensor | None:
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else m.weight.new_zeros(m.weight.shape[0]) for b, m in zip(biases, linears)])


@attrs.frozen
class _Layer:
    ln1: Tensor
    eps1: float
    qkv: _Linear  # q, k and v projections stacked: one GEMM
    o: _Linear
    ln2: Tensor
    eps2: float
    gate: _Linear
    up: _Linear
    down: _Linear


def _layers(model: Any, rows_hint: int, prepack: bool) -> list[_Layer]:
    out = []
    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        qkv_w = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
        out.append(
            _Layer(
                ln1=layer.input_layernorm.weight,
                eps1=layer.input_layernorm.variance_epsilon,
                qkv=_Linear(qkv_w, _cat_bias(att.q_proj, att.k_proj, att.v_proj), rows_hint, prepack),
                o=_Linear(att.o_proj.weight, att.o_proj.bias, rows_hint, prepack),
                ln2=layer.post_attention_layernorm.weight,
                eps2=layer.post_attention_layernorm.variance_epsilon,
                gate=_Linear(mlp.gate_proj.weight, mlp.gate_proj.bias, rows_hint, prepack),
                up=_Linear(mlp.up_proj.weight, mlp.up_proj.bias, rows_hint, prepack),
                down=_Linear(mlp.down_proj.weight, mlp.down_proj.bias, rows_hint, prepack),
            )
        )
    return out


def _softmax(x: Tensor) -> Tensor:
    """``softmax(x, -1)``; as exp / sum when the last dim is under 16 on CPU, where PyTorch's kernel
    takes a slow path (torch 2.13, (128, 2, 2, 10) fp32: 100 us against 28 us; 25 us at 22)."""
    if x.shape[-1] >= 16 or x.device.type != "cpu":
        return torch.softmax(x, dim=-1)
    e = (x - x.amax(dim=-1, keepdim=True)).exp_()
    return e.div_(e.sum(dim=-1, keepdim=True))


def _rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` with ``sin_signed = cat(-sin[:half], sin[half:])``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


class _Workspace:
    """What :func:`generate` keeps between calls on one model, as vLLM keeps its KV cache and weights.

    - The decoder's weights (the fused QKV weight, oneDNN-prepacked linears): rebuilt only when a
      parameter has changed, tracked by each parameter's storage and version counter (``sync_weights``
      copies in place, which bumps the versions). Rebuilding them took about 9 ms of a 450 ms config-B
      rollout of 128 rows.
    - On the CPU, the KV caches of the most recent shapes, reused as they are: prefill and every step
      write a slot before anything reads it. Fresh caches (24 MiB for 128 rows of config B) page-fault in
      again on every call: 4k-10k minor faults and 12-32 ms of system time per rollout, measured. On a
      GPU, PyTorch's caching allocator already reuses freed blocks, and a colocated trainer needs the
      memory back between rollouts, so nothing is kept there.

    Parameters created under ``torch.inference_mode`` have no version counter: their weights are then
    rebuilt at every call, as without a workspace.
    """

    #: distinct cache shapes kept (a recipe generates training rollouts and evaluations of other sizes)
    MAX_CACHE_SHAPES = 2

    def __init__(self) -> None:
        #: recording rollouts run so far (:class:`RolloutActivations` in its buffers are the last one's)
        self.recordings = 0
        self._weights_key: tuple | None = None
        self._weights: dict[tuple[int, bool], tuple[list[_Layer], _Linear]] = {}
        self._buffers: dict[tuple, list[Tensor]] = {}

    def weights(self, model: Any, rows_hint: int, prepack: bool) -> tuple[list[_Layer], _Linear]:
        """The decoder layers and LM head of ``model``'s current parameters."""
        params = list(model.parameters())
        key = None if any(p.is_inference() for p in params) else tuple((p.data_ptr(), p._version) for p in params)
        if key is None or key != self._weights_key:
            self._weights_key, self._weights = key, {}
        if (rows_hint, prepack) not in self._weights:
            self._weights[rows_hint, prepack] = (
                _layers(model, rows_hint, prepack),
                _Linear(model.get_output_embeddings().weight, None, rows_hint, prepack),
            )
        return self._weights[rows_hint, prepack]

    def buffers(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, count: int) -> list[Tensor]:
        """``count`` uninitialised tensors of ``shape``: on the CPU the same ones as the last call with these
        arguments, elsewhere new ones."""
        if torch.device(device).type != "cpu":
            return [torch.empty(shape, dtype=dtype, device=device) for _ in range(count)]
        key = (name, tuple(shape), dtype, str(device), count)
        found = self._buffers.pop(key, None)
        if found is None:
            found = list(_empty_on_huge_pages((count, *shape), dtype).unbind(0))
        self._buffers[key] = found  # most recently used last
        kept = [k for k in self._buffers if k[0] == name]
        for old in kept[: -self.MAX_CACHE_SHAPES]:
            del self._buffers[old]
        return found


#: the transparent huge page size on x86-64 (and on aarch64 with 4 KiB base pages)
HUGE_PAGE_BYTES = 2 << 20


def _empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """An uninitialised CPU tensor on memory advised for transparent huge pages (Linux ``madvise``);
    a plain ``torch.empty`` where that is not available or the tensor is under one huge page.

    The decode-attention kernel reads every (row, head)'s cache slots each step, thousands of 4 KiB
    pages per step on 4k pages: their TLB misses, and the hardware prefetcher's stop at every page
    boundary, made the kernel 10-17% slower (128 rows of config B, caches of 4 layers, measured).
    """
    nbytes = dtype.itemsize * int(torch.Size(shape).numel())
    if nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps ``region`` alive
    start = -raw.data_ptr() % HUGE_PAGE_BYTES  # huge pages back whole aligned 2 MiB ranges only
    return raw[start : start + nbytes].view(dtype).view(shape)


class _Decoder:
    """Runs the model over a fixed KV cache: ``prefill`` once, then ``step`` once per new token.

    Caches are ``(rows, kv_heads, total_len, head_dim)`` per layer; slot ``j`` holds token ``j`` of the
    left-padded prompt followed by the response, for every row alike (RoPE positions differ per row).
    With the CPU decode-attention kernel (:mod:`backends.cpu.kernels`) the key cache is stored
    transposed in blocks of 16 slots, ``(rows, kv_heads, ceil(total_len / 16), head_dim, 16)``, so that the
    kernel reads 16 slots per load; in memory the block index comes first, so block ``j`` of every row
    is one contiguous range. The caches come from the rollout's :class:`_Workspace` (reused between
    calls) or are allocated here.

    The working batch (the rows a step computes) shrinks through :meth:`keep_rows`. With the kernel its
    rows address the caches and ``key_bias`` by index (``rows``), so nothing is copied; without it the
    caches and ``key_bias`` are copied down to the kept rows.
    """

    def __init__(self, model: Any, rows: int, total_len: int, prepack: bool, workspace: _Workspace | None = None) -> None:
        workspace = workspace if workspace is not None else _Workspace()
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim**-0.5
        self.layers, self.lm_head = workspace.weights(model, rows, prepack)
        self.embed = model.get_input_embeddings().weight
        self.norm_w = model.model.norm.weight
        self.norm_eps = model.model.norm.variance_epsilon
        weight = self.embed
        self.dtype, self.device = weight.dtype, weight.device
        # cos/sin of every position from the model's own rotary module (handles rope scaling variants)
        positions = torch.arange(total_len, device=self.device)[None]
        cos, sin = model.model.rotary_emb(weight[:1][None], positions)
        half = self.head_dim // 2
        self.cos = cos[0]  # (L d)
        self.sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        # On CPU the attention math stays fp32 for a bf16 model: this CPU's small batched matmuls and
        # softmax are about 2x slower in bf16 (0.69 vs 0.29 ms per layer and token for 128 rows,
        # measured). The cache is fp32 too, except that the C kernel reads bf16 caches: a bf16 model's
        # keys and values are bf16 numbers, so they are then stored exactly at half the bytes.
        self.att_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        self.kernel = decode_attention_kernel(self.head_dim) if self.device.type == "cpu" else None
        bf16_cache = self.kernel is not None and self.kernel.bf16_cache and self.dtype == torch.bfloat16
        cache_dtype = torch.bfloat16 if bf16_cache else self.att_dtype
        # the kernel's caches hold whole blocks of 16 slots (a few unused slots past total_len)
        slots = -(-total_len // 16) * 16 if self.kernel is not None else total_len
        shape = (rows, self.num_kv, slots, self.head_dim)
        k_shape = (rows, self.num_kv, slots // 16, self.head_dim, 16) if self.kernel is not None else shape
        # uninitialised: prefill writes every prompt slot, and a step writes its slot before reading up
        # to it, so no slot is read before it is written
        if self.kernel is not None:
            # Stored slot-block-major, (T/16 rows kv d 16) permuted to the kernel's logical layout: one block
            # of every (row, kv head) is contiguous, so that a step reads each block as one stream
            # (measured 3.5-4% faster rollouts of 128 rows than row-major, with the same results).
            blocks, kv_, d_, s_ = k_shape[2], k_shape[1], k_shape[3], k_shape[4]
            stored = workspace.buffers("k", (blocks, rows, kv_, d_, s_), cache_dtype, self.device, len(self.layers))
            self.k_cache = [c.permute(1, 2, 0, 3, 4) for c in stored]
        else:
            self.k_cache = workspace.buffers("k", k_shape, cache_dtype, self.device, len(self.layers))
        self.v_cache = workspace.buffers("v", shape, cache_dtype, self.device, len(self.layers))
        group = self.num_heads // self.num_kv
        self.scratch = None if self.kernel is None else torch.empty(group * -(-total_len // 16) * 16, dtype=torch.float32)
        # a float32 model's decode step runs RoPE, the cache writes and attention in one kernel call, and
        # its RMSNorms in another (one pass each, where PyTorch runs several small elementwise kernels)
        self.fused_step = self.kernel is not None and self.dtype == torch.float32
        # and RMSNorm is one C pass (float32 or bfloat16 activations) wherever the decode kernel runs
        norm_kernel = norm_act_kernel() if self.kernel is not None else None
        self.norm_kernel = norm_kernel if norm_kernel is not None and norm_kernel.supports(self.embed) else None
        #: the cache row of each working row (kernel path; None = working row i is cache row i)
        self.rows: Tensor | None = None
        #: set by a recording rollout: every linear output goes there, unfused (no fused SiLU / residual add)
        self.recorder: _Recorder | None = None
        #: (cache rows, total_len) 0 for keys to attend to, -inf for prompt padding; set by prefill
        self.key_bias = torch.zeros((rows, total_len), dtype=self.att_dtype, device=self.device)

    @property
    def drops_rows_by_index(self) -> bool:
        """Whether :meth:`keep_rows` is free (an index into the caches) rather than a copy of them."""
        return self.kernel is not None

    def _rms(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if self.norm_kernel is not None and x.dim() == 2 and x.is_contiguous():
            return self.norm_kernel.rms_norm_forward(x, weight, eps)[0]
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def _mlp(self, x: Tensor, lw: _Layer, names: tuple[str, ...] | None = None) -> Tensor:
        h = self._rms(x, lw.ln2, lw.eps2)
        if names is None:
            return lw.down.add_to(x, lw.gate.silu(h).mul_(lw.up(h)))
        gate, up = lw.gate(h), lw.up(h)
        act = self.norm_kernel.swiglu_forward(gate, up) if self.norm_kernel is not None else F.silu(gate).mul_(up)
        down = lw.down(act)
        for name, out in zip(names[2:], (gate, up, down)):
            self.recorder.add(name, out)
        return x.add_(down)  # x: this step's own residual stream (the embedding's or an earlier add's output)

    def _attention_out(self, x: Tensor, att: Tensor, lw: _Layer, names: tuple[str, ...] | None) -> Tensor:
        """``x + o_proj(att)``, recording ``o_proj``'s output when recording."""
        if names is None:
            return lw.o.add_to(x, att)
        out = lw.o(att)
        self.recorder.add(names[1], out)
        return x.add_(out)

    def _logits(self, x: Tensor) -> Tensor:
        logits = self.lm_head(self._rms(x, self.norm_w, self.norm_eps))
        if self.recorder is not None:
            self.recorder.add(self.recorder.lm_head_name, logits)
        return logits

    def _names(self, i: int) -> tuple[str, ...] | None:
        return None if self.recorder is None else self.recorder.layer_names[i]

    def prefill(self, ids: Tensor, mask: Tensor, copies: int) -> Tensor:
        """Run ``(b0 p)`` left-padded prompts; fill cache rows ``[i*copies, (i+1)*copies)`` with prompt i
        (and their ``key_bias`` with the prompt's padding).

        Returns the last position's logits ``(b0 v)``.
        """
        b0, p = ids.shape
        h, kv, d = self.num_heads, self.num_kv, self.head_dim
        self.key_bias[:, :p].masked_fill_(~mask.repeat_interleave(copies, dim=0), float("-inf"))
        pos = (mask.long().cumsum(-1) - 1).clamp_(min=0)
        cos, sin = self.cos[pos][:, :, None], self.sin[pos][:, :, None]  # (b0 p 1 d)
        causal = torch.ones(p, p, dtype=torch.bool, device=ids.device).tril_()
        allowed = (causal[None] & mask[:, None, :]) | torch.eye(p, dtype=torch.bool, device=ids.device)
        bias = torch.zeros(allowed.shape, dtype=self.att_dtype, device=ids.device).masked_fill_(~allowed, float("-inf"))
        bias = bias[:, None]  # (b0 1 p p); a pad query sees itself only, so no row is empty (no NaN)
        x = F.embedding(ids, self.embed).view(b0 * p, -1)
        last_layer = len(self.layers) - 1
        for i, (lw, kc, vc) in enumerate(zip(self.layers, self.k_cache, self.v_cache)):
            names = self._names(i)
            qkv = lw.qkv(self._rms(x, lw.ln1, lw.eps1))
            if names is not None:
                self.recorder.add(names[0], qkv)
            qkv = qkv.view(b0, p, h + 2 * kv, d)
            qk = _rope(qkv[:, :, : h + kv], cos, sin).to(self.att_dtype)
            q = qk[:, :, :h].transpose(1, 2)
            k = qk[:, :, h:].transpose(1, 2)
            v = qkv[:, :, h + kv :].transpose(1, 2).to(self.att_dtype)
            if self.kernel is not None:  # keys in transposed blocks of 16 slots: (b kv T/16 d 16)
                blocks = kc.view(b0, copies, *kc.shape[1:]).transpose(-1, -2)  # (b0 copies kv T/16 16 d)
                for blk, start in enumerate(range(0, p, 16)):
                    n = min(16, p - start)
                    blocks[:, :, :, blk, :n] = k[:, None, :, start : start + n]
            else:
                kc.view(b0, copies, *kc.shape[1:])[:, :, :, :p] = k[:, None]
            vc.view(b0, copies, *vc.shape[1:])[:, :, :, :p] = v[:, None]
            if i == last_layer and names is None:
                # past the last layer's keys and values only the last position's output is read (its
                # logits): its query alone attends, and o_proj and the MLP run on its row alone (a
                # recording rollout runs every position: a trainer reads them all)
                q, bias, x = q[:, :, -1:], bias[:, :, -1:], x.view(b0, p, -1)[:, -1].contiguous()
            rows = x.shape[0]
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scale, enable_gqa=True)
            x = self._attention_out(x, att.transpose(1, 2).reshape(rows, h * d).to(self.dtype), lw, names)
            x = self._mlp(x, lw, names)
        if x.shape[0] != b0:
            x = x.view(b0, p, -1)[:, -1].contiguous()
        return self._logits(x)

    def step(self, tokens: Tensor, positions: Tensor, slot: int) -> Tensor:
        """One new token per working row: ``tokens (b)`` at RoPE ``positions (b)``, written to cache ``slot``."""
        b = tokens.shape[0]
        h, kv, d = self.num_heads, self.num_kv, self.head_dim
        x = F.embedding(tokens, self.embed)  # (b hidden)
        if self.fused_step:
            positions = positions.contiguous()
            for i, (lw, kc, vc) in enumerate(zip(self.layers, self.k_cache, self.v_cache)):
                names = self._names(i)
                qkv = lw.qkv(self._rms(x, lw.ln1, lw.eps1))
                if names is not None:
                    self.recorder.add(names[0], qkv)
                qkv = qkv.view(b, h + 2 * kv, d)
                att = self.kernel.step(qkv, self.cos, self.sin, positions, kc, vc, self.key_bias, slot, self.scale,
                                       qkv.new_empty(b, kv, h // kv, d), self.scratch, self.rows)
                x = self._mlp(self._attention_out(x, att.view(b, h * d), lw, names), lw, names)
            return self._logits(x)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # (b 1 d)
        bias = self.key_bias[:, None, None, : slot + 1]
        rows = slice(None) if self.rows is None else self.rows
        for i, (lw, kc, vc) in enumerate(zip(self.layers, self.k_cache, self.v_cache)):
            names = self._names(i)
            qkv = lw.qkv(self._rms(x, lw.ln1, lw.eps1))
            if names is not None:
                self.recorder.add(names[0], qkv)
            qkv = qkv.view(b, h + 2 * kv, d)
            qk = _rope(qkv[:, : h + kv], cos, sin)
            vc[rows, :, slot] = qkv[:, h + kv :]
            q = qk[:, :h].view(b, kv, h // kv, d).to(self.att_dtype)
            if self.kernel is not None:
                kc[rows, :, slot // 16, :, slot % 16] = qk[:, h:]
                att = self.kernel(q, kc, vc, self.key_bias, slot + 1, self.scale, q.new_empty(q.shape), self.scratch,
                                  self.rows)
            else:
                kc[:, :, slot] = qk[:, h:]
                scores = torch.matmul(q, kc[:, :, : slot + 1].transpose(-1, -2)).mul_(self.scale).add_(bias)
                att = torch.matmul(_softmax(scores), vc[:, :, : slot + 1])  # (b kv g d)
            x = self._attention_out(x, att.view(b, h * d).to(self.dtype), lw, names)
            x = self._mlp(x, lw, names)
        return self._logits(x)

    def keep_rows(self, index: Tensor) -> None:
        """Keep working rows ``index`` (int64, into the current working batch), in that order."""
        if self.drops_rows_by_index:
            self.rows = index if self.rows is None else self.rows[index]
            return
        self.k_cache = [c.index_select(0, index) for c in self.k_cache]
        self.v_cache = [c.index_select(0, index) for c in self.v_cache]
        self.key_bias = self.key_bias.index_select(0, index)


# --------------------------------------------------------------------------------------------------
# Generation


def _prepare_prompts(
    rollout: NativeRollout, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
) -> list[list[int]]:
    if isinstance(prompts, Tensor) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of token-id lists (unpadded), got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: nothing to generate")
    budget = rollout.max_context - sampling.max_new_tokens
    if budget < 1:
        raise ValueError(
            f"max_new_tokens={sampling.max_new_tokens} leaves no room for a prompt in the context of "
            f"{rollout.max_context} positions"
        )
    out = []
    for i, prompt in enumerate(prompts):
        ids = prompt.tolist() if isinstance(prompt, Tensor) else [int(t) for t in prompt]
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if len(ids) > budget:
            if not sampling.truncate_prompts:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens; with max_new_tokens={sampling.max_new_tokens} it needs "
                    f"{len(ids) + sampling.max_new_tokens} positions, more than the context of {rollout.max_context} "
                    "(set truncate_prompts=True to keep the last tokens)"
                )
            ids = ids[-budget:]
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= rollout.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {rollout.vocab_size}): min {lo}, max {hi}")
        out.append(ids)
    return out


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
    return _generate(rollout, prompts, sampling, group_ids=group_ids, seed=seed, generator=generator, record=False)[0]


def generate_recording(
    rollout: NativeRollout,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig = SamplingConfig(),
    *,
    group_ids: Tensor | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[RolloutBatch, RolloutActivations]:
    """:func:`generate` (the same tokens and log-probs for the same seed), plus the output of every linear
    layer for every token it ran, for a trainer to reuse instead of recomputing its forward pass
    (``backends.training.fsdp.update(..., activations=)``); the batch's ``rollout_rows`` say which
    rollout row each batch row is.

    The activations take about ``4 * tokens * layers * (width of q/k/v + hidden * 2 + intermediate * 2)``
    bytes (about 130 MB for 16 x 8 responses of 32 tokens on PLATFORM.md's config B), and the rollout
    runs its residual adds and SiLU outside the linear layers (it records their outputs before them).
    They carry the rollout's ``weights_tag`` (:func:`sync_weights`): a trainer reuses them only while its
    weights are those. The trainer that reads them (``backends.cpu.fused_modules``'s fused modules) runs on the CPU.
    """
    return _generate(rollout, prompts, sampling, group_ids=group_ids, seed=seed, generator=generator, record=True)


def _generate(
    rollout: NativeRollout, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *, group_ids: Tensor | None,
    seed: int | None, generator: torch.Generator | None, record: bool,
) -> tuple[RolloutBatch, RolloutActivations | None]:
    prompts = _prepare_prompts(rollout, prompts, sampling)
    device = rollout.device
    num_prompts, n = len(prompts), sampling.n
    group_ids = _check_group_ids(group_ids, num_prompts)
    if generator is None:
        generator = torch.Generator(device=device)
        generator.manual_seed(sampling.seed if seed is None else seed)

    recorder = None
    if record:
        p = max(len(x) for x in prompts)
        recorder = _Recorder(rollout.model, num_prompts * n, rollout.max_context, workspace=rollout.workspace,
                             layer_rows=num_prompts * p + num_prompts * n * sampling.max_new_tokens,
                             logit_rows=num_prompts + num_prompts * n * sampling.max_new_tokens)
    with torch.inference_mode():
        tokens, logprobs, prompt_ids, prompt_mask = _generate_tokens(rollout, prompts, sampling, generator, recorder)
    recorded = recorder.finish(rollout.weights_tag) if recorder is not None else None
    # fresh (non-inference) tensors, so the trainer may use them in autograd
    tokens, logprobs = tokens.clone(), logprobs.clone()
    prompt_ids, prompt_mask = prompt_ids.clone(), prompt_mask.clone()

    is_eos = torch.isin(tokens, torch.tensor(rollout.eos_token_ids, device=tokens.device))
    steps = tokens.shape[1]
    no_eos = torch.full_like(is_eos[:, 0], steps, dtype=torch.long)
    first_eos = torch.where(is_eos.any(-1), is_eos.float().argmax(-1), no_eos)
    lengths = (first_eos + 1).clamp(max=steps)
    t = int(lengths.max())
    response_mask = torch.arange(t, device=tokens.device)[None] < lengths[:, None]
    response_ids = tokens[:, :t].masked_fill(~response_mask, rollout.pad_token_id)
    rollout_logprobs = logprobs[:, :t].masked_fill(~response_mask, 0.0)

    batch = _rollout_batch(prompt_ids, prompt_mask, response_ids, response_mask, rollout_logprobs, n, group_ids)
    if recorded is not None:
        batch = batch.replace(rollout_rows=torch.arange(num_prompts * n, device=device))
    return batch, recorded


def _check_group_ids(group_ids: Tensor | None, num_prompts: int) -> Tensor | None:
    if group_ids is None:
        return None
    group_ids = torch.as_tensor(group_ids)
    if group_ids.shape != (num_prompts,) or group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(
            f"group_ids must be an integer tensor of shape ({num_prompts},), got {group_ids.dtype} {tuple(group_ids.shape)}"
        )
    return group_ids


def _left_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[Tensor, Tensor]:
    """``(num_prompts p)`` left-padded ids and their mask."""
    p = max(len(x) for x in prompts)
    prompt_ids = torch.full((len(prompts), p), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(prompts), p), dtype=torch.bool)
    for i, ids in enumerate(prompts):
        prompt_ids[i, p - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        prompt_mask[i, p - len(ids) :] = True
    return prompt_ids, prompt_mask


def _rollout_batch(
    prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor, rollout_logprobs: Tensor,
    n: int, group_ids: Tensor | None,
) -> RolloutBatch:
    """The validated batch: per-prompt ``(num_prompts p)`` tensors repeated for the ``n`` rows of each."""
    num_prompts, device = prompt_ids.shape[0], prompt_ids.device
    if group_ids is None:
        prompt_groups = torch.arange(num_prompts, device=device)
    else:
        prompt_groups = group_ids.to(device=device, dtype=torch.long)
    return validate(
        RolloutBatch(
            prompt_ids=prompt_ids.repeat_interleave(n, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(n, dim=0),
            response_ids=response_ids,
            response_mask=response_mask,
            group_ids=prompt_groups.repeat_interleave(n),
            rollout_logprobs=rollout_logprobs,
        )
    )


def _generate_tokens(
    rollout: NativeRollout, prompts: list[list[int]], sampling: SamplingConfig, generator: torch.Generator,
    recorder: _Recorder | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The decoding loop. Returns raw tokens and log-probs ``(b steps)`` (garbage after EOS) and the prompts.
    ``recorder``: where the decoder's linear outputs go, and which token each of them belongs to."""
    device = rollout.device
    num_prompts, n = len(prompts), sampling.n
    rows = num_prompts * n
    prompt_ids, prompt_mask = _left_pad(prompts, rollout.pad_token_id)
    p = prompt_ids.shape[1]
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    max_new = sampling.max_new_tokens
    total = p + max_new

    decoder = _Decoder(rollout.model, rows, total, rollout.prepack_cpu_weights, rollout.workspace)
    decoder.recorder = recorder
    if recorder is not None:  # the prefill keeps its real prompt tokens (prompt by prompt), every prompt's logits
        real_prompt_tokens = prompt_mask.reshape(-1).nonzero().squeeze(-1)
        recorder.begin_chunk(real_prompt_tokens, None)
    logits = decoder.prefill(prompt_ids, prompt_mask, copies=n).float().repeat_interleave(n, dim=0)

    next_pos = prompt_mask.sum(-1).repeat_interleave(n)  # RoPE position of each row's first response token
    if recorder is not None:
        chunk_row = torch.full((num_prompts, p), -1, dtype=torch.long, device=device)
        chunk_row[prompt_mask] = torch.arange(real_prompt_tokens.shape[0], device=device)
        row_mask = prompt_mask.repeat_interleave(n, dim=0)
        row_of = torch.arange(rows, device=device)[:, None].expand(rows, p)
        positions = (prompt_mask.long().cumsum(-1) - 1).repeat_interleave(n, dim=0)
        recorder.place(row_of[row_mask], positions[row_mask], chunk_row.repeat_interleave(n, dim=0)[row_mask], logits=False)
        recorder.place(torch.arange(rows, device=device), next_pos - 1,
                       torch.arange(num_prompts, device=device).repeat_interleave(n), logits=True)
        recorder.advance(real_prompt_tokens.shape[0], num_prompts)
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
        if recorder is not None:
            # this step keeps the rows still running (ascending): their input token is a response
            # token that a trainer runs (not a finished row's, nor a row's last); the record rows of
            # the prompts and then of the steps are a step-major packing's tokens (backends.packing)
            full_rows = torch.arange(token.shape[0], device=device) if active is None else active
            step_pos = next_pos + s
            keep_running = None if num_running == token.shape[0] else running.nonzero().squeeze(-1)
            if keep_running is not None:
                full_rows, step_pos = full_rows[keep_running], step_pos[keep_running]
            recorder.begin_chunk(keep_running, keep_running)
            kept = torch.arange(num_running, device=device)
            recorder.place(full_rows, step_pos, kept, logits=False)
            recorder.place(full_rows, step_pos, kept, logits=True)
            recorder.advance(num_running, num_running)
        logits = decoder.step(token, next_pos + s, p + s).float()
    return out_tokens[:, :steps], out_logprobs[:, :steps], prompt_ids, prompt_mask


#: copying compaction (the PyTorch path) waits until this fraction of the working rows has finished
COPY_COMPACT_FRACTION = 0.125
#: compaction by index keeps the running rows padded with finished ones to a multiple of this many rows:
#: oneDNN builds a GEMM kernel for every new row count (about 0.3 ms per weight shape, measured), so the
#: working batch takes few distinct sizes
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


def decode_responses(tokenizer: Any, batch: RolloutBatch, *, skip_special_tokens: bool = True) -> list[str]:
    """The text of each row's response (masked tokens only; EOS and other specials dropped by default)."""
    lengths = batch.response_mask.sum(-1).tolist()
    ids = batch.response_ids.tolist()
    return [tokenizer.decode(row[:length], skip_special_tokens=skip_special_tokens) for row, length in zip(ids, lengths)]

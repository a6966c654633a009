"""Per-device memory estimate of a training role (and a colocated rollout's KV cache), and settings that fit.

Run: ``python -m backends.training.memory_planner --model DIR --dp 8 --dtype bfloat16 --micro-batch 4 --seq-len 4096
--budget-gib 80 [--gradient-checkpointing] [--kv-seqs 256 --kv-len 4096] [--offload] [--device-gib 80
--vllm-util 0.6 --vllm-tp 2]`` (``--model`` takes a checkpoint dir or a ``config.json`` file; ``--tiny`` the
tiny test model, hidden 256 and 4 layers) prints a table, suggestions and, with ``--device-gib``, the
phases of a step colocated with a vLLM engine (:func:`colocated_step`).

What is counted, per device, for a Llama / Qwen2 decoder (``h`` hidden, ``i`` MLP width, ``L`` layers,
``V`` vocabulary, ``kv`` = key/value heads x head_dim, ``n`` attention heads, ``T`` tokens of a
micro-batch, ``P`` parameters; the sharded state is split evenly over ``dp * tp * pp`` devices):

- **parameters**: fp32 master weights (the reference role: compute dtype) ``P * 4 / shards``, plus
  the FSDP-gathered compute copy of the root (embeddings, final norm, untied lm_head: kept gathered
  for the step) and of two decoder layers (one computing, one prefetched) when ``dp > 1``; with
  ``offload`` (FSDP2's CPUOffloadPolicy) only that gathered copy, and no gradients or optimizer state. A
  critic holds a one-wide value head instead of the lm_head;
- **gradients**: as the master weights (fp32, sharded); none for the reference role;
- **optimizer**: AdamW keeps two fp32 moments per parameter (``8 P / shards``), SGD none;
- **activations** saved for backward by one micro-batch, counted from what a Hugging Face decoder
  layer saves (measured with ``saved_tensors_hooks``, tests/test_memory_planner.py): per token and
  layer, per RMSNorm its input upcast to fp32, the fp32 ``rsqrt``, the normalised and the weighted
  output (``h + 1`` fp32, ``2h`` compute dtype), the attention's q, k, v (repeated to every query head
  before SDPA on CPU), output and fp32 log-sum-exp, and the SwiGLU MLP's four ``i``-wide tensors. With
  gradient checkpointing a layer keeps only its input (``h``) and one layer's full set lives during
  its recompute. The padded attention mask (``b x s x s``) is saved once when ``padded``. Packed
  (``padded=False``) counts ``T`` positions for attention, as flash-attention varlen saves; the CPU's
  packed attention (backends/training/packed_attention.py) saves q, k, v and the output for the
  ``n x max_len`` positions of its left-aligned block, and for short blocks (its batched-matmul
  attention) the ``n x heads x max_len^2`` probabilities: the same for rows of equal length, more for
  ragged rows (up to 25% more in the tests), which the estimate does not count. Tensor parallel splits
  the per-layer activations by ``tp`` (no sequence parallel); pipeline parallel keeps ``L / pp`` layers
  and up to ``pp`` micro-batches in flight on the first stage (1F1B);
- **logits** of the kept positions (``V`` per token): the response tokens only (``logits_to_keep``).
  Taken in chunks (``logits_chunk_rows``, the engine's ``FSDPConfig.logits_chunk_mib``), the forward saves
  them in the compute dtype and the backward (``logits_backward``) adds their gradients (one per
  log-prob and entropy term) and one chunk's fp32 temporaries. Taken whole, the forward saves an fp32
  copy (and the softmax when entropy is computed) and the backward's peak holds 8 more fp32 copies with
  the entropy, 3 without. The reference role is a forward pass without gradients: no activations are
  kept, and its logits term is that pass's peak: the logits, their fp32 upcast and ``logsumexp``'s fp32
  temporary (of one chunk when chunked);
- **KV cache** of a colocated rollout: ``2 L kv x len x seqs`` values in the rollout dtype, sharded by tp
  (``kv_dtype``; on a CPU the native engine's attention, and so its cache, is fp32 for a bf16 model too).

A step colocated with vLLM (:func:`colocated_step`) peaks in one of three phases: the update (vLLM
asleep), the log-prob passes (one forward micro-batch beside the resident state) or the rollout (the
resident state, gradients freed, plus vLLM's ``gpu_memory_utilization`` share of the device, which holds
its weights, ``P * bytes / tp``, and its KV cache).

Not counted: allocator fragmentation, temporary buffers inside a kernel (e.g. an attention kernel's
workspace), communication buckets, the CUDA context (about 0.5-1 GiB on a GPU), vLLM's CUDA graphs
(outside its share): keep headroom (``headroom`` in :func:`suggest`, default 10%).
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Literal

import attrs

__all__ = [
    "ModelShape",
    "Parallelism",
    "Workload",
    "MemoryEstimate",
    "Suggestion",
    "estimate",
    "suggest",
    "largest_micro_batch",
    "ColocatedStep",
    "colocated_step",
    "vllm_weight_bytes",
    "kv_bytes_per_token",
    "format_table",
]

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _dtype_bytes(name: str) -> int:
    if name not in _BYTES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_BYTES)}")
    return _BYTES[name]


@attrs.frozen
class ModelShape:
    """The sizes of a Llama / Qwen2-style decoder that memory depends on."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool = True
    qkv_bias: bool = False  #: Qwen2 has biases on q, k, v

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelShape":
        """From a ``transformers`` config object (LlamaConfig, Qwen2Config, ...)."""
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
            if getattr(config, k, None) is None
        ]
        if missing:
            raise ValueError(f"the model config lacks {', '.join(missing)}: not a Llama/Qwen2-style decoder")
        heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=getattr(config, "model_type", "") == "qwen2" or bool(getattr(config, "attention_bias", False)),
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelShape":
        """From a local Hugging Face checkpoint dir, or a ``config.json`` file itself (reads that file only:
        a model's public config is enough to plan for it before its weights are downloaded)."""
        from transformers import AutoConfig

        if os.path.isfile(path) and str(path).endswith(".json"):
            return cls.from_hf_config(AutoConfig.from_pretrained(str(path)))
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"no config.json in {path!r}: not a Hugging Face checkpoint dir")
        return cls.from_hf_config(AutoConfig.from_pretrained(path))

    @classmethod
    def from_tiny(cls, config: Any, vocab_size: int) -> "ModelShape":
        """From a :class:`backends.models.TinyModelConfig` and its tokenizer's vocabulary size."""
        return cls(
            vocab_size=vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_layers,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            intermediate_size=config.intermediate_size,
            tie_word_embeddings=config.tie_word_embeddings,
            qkv_bias=config.arch == "qwen2",
        )

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.kv_width
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attention + 3 * h * self.intermediate_size + 2 * h

    @property
    def root_params(self) -> int:
        """Embeddings, final norm and (untied) lm_head."""
        embed = self.vocab_size * self.hidden_size
        return embed * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.root_params

    @property
    def critic_root_params(self) -> int:
        """A value model's (``*ForTokenClassification``, one label): embeddings, final norm, a 1-wide head
        with its bias; no lm_head."""
        return self.vocab_size * self.hidden_size + self.hidden_size + self.hidden_size + 1

    def role_params(self, role: str) -> tuple[int, int]:
        """``(all parameters, the root's)`` of the module a role holds (the critic has a value head)."""
        root = self.critic_root_params if role == "critic" else self.root_params
        return self.num_layers * self.layer_params + root, root


@attrs.frozen
class Parallelism:
    """Devices that shard one model: data-parallel FSDP shards, tensor- and pipeline-parallel sizes."""

    dp: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    tp: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    pp: int = attrs.field(default=1, validator=attrs.validators.ge(1))

    @property
    def shards(self) -> int:
        return self.dp * self.tp * self.pp


@attrs.frozen
class Workload:
    """What one device runs: role, dtypes, optimizer, micro-batch shape, checkpointing, rollout cache."""

    role: Literal["actor", "critic", "reference"] = "actor"
    compute_dtype: str = "float32"
    optimizer: Literal["adamw", "sgd", "none"] = "adamw"
    micro_batch_rows: int = 1
    seq_len: int = 512  #: prompt + response tokens per row (padded length, or mean length when packed)
    response_len: int | None = None  #: positions that reach the lm_head (default: seq_len)
    gradient_checkpointing: bool = False
    padded: bool = True  #: an attention mask is materialised (the padded path); False when packed
    with_entropy: bool = False
    kv_seqs: int = 0  #: sequences in a colocated rollout's KV cache
    kv_len: int = 0  #: tokens per cached sequence
    kv_dtype: str | None = None  #: default: compute_dtype
    #: FSDP2's CPUOffloadPolicy (FSDPConfig.offload): parameter shards, gradients and optimizer state in host
    #: memory; the device holds the gathered compute copies only
    offload: bool = False
    #: rows of logits per chunk of the log-prob / entropy pass (FSDPConfig.logits_chunk_mib); None: the whole
    #: micro-batch at once
    logits_chunk_rows: int | None = None

    def __attrs_post_init__(self) -> None:
        _dtype_bytes(self.compute_dtype)
        if self.kv_dtype is not None:
            _dtype_bytes(self.kv_dtype)
        if self.role not in ("actor", "critic", "reference"):
            raise ValueError(f"role must be 'actor', 'critic' or 'reference', got {self.role!r}")
        if self.optimizer not in ("adamw", "sgd", "none"):
            raise ValueError(f"optimizer must be 'adamw', 'sgd' or 'none', got {self.optimizer!r}")
        for name in ("micro_batch_rows", "seq_len", "kv_seqs", "kv_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"Workload.{name} must be >= 0, got {getattr(self, name)}")


@attrs.frozen
class MemoryEstimate:
    """Bytes per device, by kind."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    kv_cache: int
    #: part of ``activations``: one layer's saved tensors, alive only while gradient checkpointing
    #: recomputes that layer in backward (0 without checkpointing)
    recompute: int = 0
    #: beyond the saved ``logits``: the logits' gradients and softmax temporaries at the backward's peak
    logits_backward: int = 0

    @property
    def training_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        return self.training_state + self.activations + self.logits + self.logits_backward + self.kv_cache

    def as_dict(self) -> dict[str, int]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "logits": self.logits,
            "logits_backward": self.logits_backward,
            "kv_cache": self.kv_cache,
            "total": self.total,
        }


def activation_elements_per_token_layer(shape: ModelShape, compute_bytes: int) -> tuple[int, int]:
    """(elements in the compute dtype, elements in fp32) saved per token by one decoder layer."""
    h, i, q = shape.hidden_size, shape.intermediate_size, shape.num_heads * shape.head_dim
    # each of the two RMSNorms: its input upcast to fp32 and the rsqrt (fp32), the normalised and the
    # weighted output (compute dtype)
    norm_fp32, norm_compute = 2 * (h + 1), 2 * 2 * h
    # q, out, and k, v repeated to every query head (repeat_kv / repeat_interleave before SDPA on CPU;
    # a copy unless there is a single key/value head)
    kv = q if shape.num_kv_heads > 1 else shape.kv_width
    attention = 2 * q + 2 * kv
    lse = shape.num_heads  # fp32 log-sum-exp per head
    mlp = 4 * i  # gate, up, silu(gate), silu(gate) * up
    compute, fp32 = norm_compute + attention + mlp, norm_fp32 + lse
    return (compute + fp32, 0) if compute_bytes == 4 else (compute, fp32)


def _state_bytes(shape: ModelShape, parallel: Parallelism, work: Workload, cb: int) -> tuple[int, int, int]:
    """``(parameters, gradients, optimizer)`` bytes per device."""
    n_params, root = shape.role_params(work.role)
    p_local = math.ceil(n_params / parallel.shards)
    trainable = work.role != "reference"
    gathered = 0
    if parallel.dp > 1 or work.offload:  # FSDP gathers a compute copy: the root for the step, two layers at a time
        gathered = int((root + 2 * shape.layer_params) / (parallel.tp * parallel.pp) * cb)
    if work.offload:  # FSDP2's CPUOffloadPolicy: shards, gradients and the AdamW step stay in host memory
        return gathered, 0, 0
    params = p_local * (4 if trainable else cb) + gathered
    grads = p_local * 4 if trainable else 0
    moments = {"adamw": 2, "sgd": 0, "none": 0}[work.optimizer] if trainable else 0
    return params, grads, p_local * 4 * moments


def _activation_bytes(shape: ModelShape, parallel: Parallelism, work: Workload, cb: int) -> tuple[int, int, int, int]:
    """``(activations, logits, recompute, logits_backward)`` bytes per device of one micro-batch."""
    rows, s, h = work.micro_batch_rows, work.seq_len, shape.hidden_size
    tokens = rows * s
    keep = rows * (work.response_len if work.response_len is not None else s)
    # the critic's value head is one wide; the others' lm_head is the vocabulary wide
    width = 1 if work.role == "critic" else shape.vocab_size // parallel.tp
    entropy = 4 if work.with_entropy else 0
    chunk = None if work.logits_chunk_rows is None else min(work.logits_chunk_rows, keep)
    if work.role == "reference":  # forward only: the logits, their fp32 upcast, logsumexp's fp32 temporary
        if chunk is not None and width > 1:  # the upcast and temporaries of one chunk at a time
            return 0, keep * h * cb + keep * width * cb + chunk * width * 4 * 3, 0, 0
        return 0, keep * h * cb + keep * width * (cb + (4 if cb != 4 else 0) + 4 + entropy), 0, 0
    layers = math.ceil(shape.num_layers / parallel.pp)
    in_flight = parallel.pp  # 1F1B: the first stage holds up to pp micro-batches' activations
    compute_e, fp32_e = activation_elements_per_token_layer(shape, cb)
    per_layer = (compute_e * cb + fp32_e * 4) * tokens // parallel.tp
    recompute = 0
    if work.gradient_checkpointing:  # a layer keeps its input; one layer's set lives in its recompute
        stored, recompute = layers * tokens * h * cb, per_layer
    else:
        stored = layers * per_layer
    # shared by the layers: token ids (int64), rotary cos/sin, the padded path's attention mask;
    # the final norm (fp32 input and rsqrt, normalised output)
    shared = tokens * (8 + 2 * shape.head_dim * cb) + (rows * s * s * cb if work.padded else 0)
    final_norm = tokens * ((h + 1) * 4 + h * (cb if cb != 4 else 4))
    activations = (stored + recompute + shared + final_norm) * in_flight
    if chunk is not None and width > 1:
        # chunked (rlfunc/logits.py): the logits are saved as they are; backward writes the gradient of the
        # log-probs and of the entropy into logits-shaped tensors, one chunk's fp32 temporaries at a time
        logits = keep * h * cb + keep * width * cb
        backward = keep * width * cb * (2 if work.with_entropy else 1) + chunk * width * 4 * 3
        return int(activations), int(logits), int(recompute), int(backward)
    # lm_head input of the kept positions, their logits in fp32 (an upcast copy under bf16), softmax
    logits = keep * h * cb + keep * width * (4 + entropy)
    # at the backward's peak, fp32 logits-sized gradients and temporaries of the softmax, the entropy's
    # shifted logits and products: 10 fp32 copies in all with the entropy (an H200, bf16), 4 without (a CPU)
    backward = keep * width * 4 * (8 if work.with_entropy else 3) if width > 1 else 0
    return int(activations), int(logits), int(recompute), int(backward)


def estimate(shape: ModelShape, parallel: Parallelism = Parallelism(), work: Workload = Workload()) -> MemoryEstimate:
    """Per-device bytes of ``work`` on ``shape`` sharded by ``parallel`` (see the module docstring)."""
    cb = _dtype_bytes(work.compute_dtype)
    params, grads, optim = _state_bytes(shape, parallel, work, cb)
    activations, logits, recompute, logits_backward = _activation_bytes(shape, parallel, work, cb)
    kv_bytes = _dtype_bytes(work.kv_dtype or work.compute_dtype)
    kv = 2 * shape.num_layers * shape.kv_width * work.kv_len * work.kv_seqs * kv_bytes // (parallel.tp * parallel.pp)
    return MemoryEstimate(
        parameters=params,
        gradients=grads,
        optimizer=optim,
        activations=activations,
        logits=logits,
        kv_cache=kv,
        recompute=recompute,
        logits_backward=logits_backward,
    )


@attrs.frozen
class Suggestion:
    """Settings that fit a per-device memory budget."""

    gradient_checkpointing: bool
    micro_batch_rows: int  #: largest micro-batch (rows of ``seq_len`` tokens) that fits; 0 = none fits
    max_tokens_per_micro_batch: int  #: the same as a token budget (FSDPConfig.max_tokens_per_micro_batch)
    max_kv_seqs: int  #: rollout sequences of ``kv_len`` tokens whose KV cache fits beside the training state
    estimate: MemoryEstimate  #: at the suggested micro-batch
    reason: str


def chunk_rows_for(chunk_mib: float, vocab: int) -> int | None:
    """``Workload.logits_chunk_rows`` for ``FSDPConfig.logits_chunk_mib`` (the engine's rule) and a vocabulary."""
    return None if chunk_mib == 0 else max(1, int(chunk_mib * 2**20) // (4 * vocab))


def _largest_rows(shape: ModelShape, parallel: Parallelism, work: Workload, budget: float) -> int:
    """Binary search on micro-batch rows (memory grows monotonically with rows)."""
    fits = lambda rows: estimate(shape, parallel, attrs.evolve(work, micro_batch_rows=rows, kv_seqs=0)).total <= budget
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi) and hi < 1 << 20:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def suggest(
    shape: ModelShape, parallel: Parallelism, work: Workload, budget_bytes: int, *, headroom: float = 0.1
) -> Suggestion:
    """The largest micro-batch that fits ``budget_bytes`` (less ``headroom``), with checkpointing only
    when the model does not fit one row without it, or when checkpointing allows at least 4x the
    rows (bigger micro-batches pay on accelerators; the recompute costs about a third more compute)."""
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    budget = budget_bytes * (1 - headroom)
    plain = _largest_rows(shape, parallel, attrs.evolve(work, gradient_checkpointing=False), budget)
    ckpt = _largest_rows(shape, parallel, attrs.evolve(work, gradient_checkpointing=True), budget)
    if plain == 0 and ckpt == 0:
        use_ckpt, rows = True, 0
        reason = "nothing fits: even one row with checkpointing exceeds the budget; add shards (dp/tp/pp)"
    elif plain == 0:
        use_ckpt, rows, reason = True, ckpt, "one row does not fit without gradient checkpointing"
    elif ckpt >= 4 * plain:
        use_ckpt, rows, reason = True, ckpt, f"checkpointing fits {ckpt} rows instead of {plain}"
    else:
        use_ckpt, rows, reason = False, plain, f"fits {plain} rows without checkpointing ({ckpt} with)"
    chosen = attrs.evolve(work, gradient_checkpointing=use_ckpt, micro_batch_rows=max(rows, 1))
    est = estimate(shape, parallel, chosen)
    kv_one = estimate(shape, parallel, attrs.evolve(chosen, kv_seqs=1)).kv_cache
    # colocated rollout: the training state stays resident, activations are freed while generating
    free = budget - est.training_state
    max_kv = int(free // kv_one) if kv_one > 0 and free > 0 else 0
    return Suggestion(
        gradient_checkpointing=use_ckpt,
        micro_batch_rows=rows,
        max_tokens_per_micro_batch=rows * work.seq_len,
        max_kv_seqs=max_kv,
        estimate=est,
        reason=reason,
    )


def vllm_weight_bytes(shape: ModelShape, *, tp: int = 1, dtype: str = "bfloat16") -> int:
    """A vLLM engine's weights per device: every parameter in ``dtype``, split over its ``tp`` ranks."""
    return shape.num_params * _dtype_bytes(dtype) // tp


def kv_bytes_per_token(shape: ModelShape, *, tp: int = 1, dtype: str = "bfloat16") -> int:
    """One token's keys and values on one of an engine's ``tp`` devices (a KV head is replicated when
    there are fewer heads than ranks)."""
    heads = max(1, -(-shape.num_kv_heads // tp))
    return 2 * shape.num_layers * heads * shape.head_dim * _dtype_bytes(dtype)


@attrs.frozen
class ColocatedStep:
    """Per-device peaks of one RL step with the trainer and a vLLM engine on the same devices (vLLM asleep,
    its weights and KV cache freed, while the trainer computes)."""

    update: int  #: policy update: the trainer's estimate plus other roles' resident bytes
    logprob: int  #: log-prob passes: the trainer's resident state (gradients freed), other roles, one forward
    rollout: int  #: generation: the trainer's resident state, other roles, vLLM's share
    vllm_share: int  #: gpu_memory_utilization x the device: vLLM's weights, KV cache and activations
    vllm_weights: int
    kv_tokens: int  #: tokens of KV cache in the share beside the weights (an upper bound: less vLLM's activations)
    free_at_build: int  #: free when the engine is built (the optimizer state is created at the first update)

    @property
    def peak(self) -> int:
        return max(self.update, self.logprob, self.rollout)


def colocated_step(
    shape: ModelShape,
    parallel: Parallelism,
    work: Workload,
    *,
    device_bytes: int,
    vllm_utilization: float | None = None,
    vllm_tp: int = 1,
    vllm_dtype: str = "bfloat16",
    resident_bytes: int = 0,
    forward_bytes: int = 0,
) -> ColocatedStep:
    """The three phases of a colocated step for the trainer ``work`` (kv fields unused) on a device of
    ``device_bytes``. ``vllm_utilization``: the share of the whole device vLLM may take; ``None`` is the
    recipes' default, 90% of what is free when the engine is built, after the trainer's weights, AdamW
    moments (allocated when the optimizer is built, ``backends.training.optim.initialize_state``) and the
    other roles. ``resident_bytes``: other roles kept on the device
    (a reference's weights); ``forward_bytes``: the largest forward-only micro-batch of the log-prob passes
    (:func:`estimate` of a ``reference`` workload, less its parameters)."""
    est = estimate(shape, parallel, attrs.evolve(work, kv_seqs=0))
    resident = est.parameters + est.optimizer + resident_bytes  # gradients are freed after each update
    free_at_build = device_bytes - est.parameters - est.optimizer - resident_bytes
    share = int(0.9 * free_at_build if vllm_utilization is None else vllm_utilization * device_bytes)
    weights = vllm_weight_bytes(shape, tp=vllm_tp, dtype=vllm_dtype)
    per_token = kv_bytes_per_token(shape, tp=vllm_tp, dtype=vllm_dtype)
    return ColocatedStep(
        update=est.total + resident_bytes,
        logprob=resident + forward_bytes,
        rollout=resident + share,
        vllm_share=share,
        vllm_weights=weights,
        kv_tokens=max(share - weights, 0) // per_token,
        free_at_build=free_at_build,
    )


def largest_micro_batch(shape: ModelShape, parallel: Parallelism, work: Workload, budget_bytes: float) -> int:
    """The most rows of ``work.seq_len`` tokens whose estimate fits ``budget_bytes`` (0: none), with the
    workload's own checkpointing setting."""
    return _largest_rows(shape, parallel, work, budget_bytes)


def format_table(est: MemoryEstimate, title: str = "") -> str:
    gib = 2**30
    lines = [title] if title else []
    lines.append(f"{'':16s}{'GiB':>10s}{'MiB':>12s}")
    for name, value in est.as_dict().items():
        lines.append(f"{name:16s}{value / gib:10.3f}{value / 2**20:12.1f}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    """The command line of ``python -m backends.training.memory_planner``."""
    parser = argparse.ArgumentParser(description="Per-device memory estimate of a training role, and settings that fit")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="local Hugging Face checkpoint dir (config.json is read)")
    src.add_argument(
        "--tiny", action="store_true", help="the tiny test model (hidden 256, 4 layers) with the char tokenizer"
    )
    parser.add_argument("--role", default="actor", choices=["actor", "critic", "reference"])
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_BYTES), help="compute dtype")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "none"])
    parser.add_argument("--micro-batch", type=int, default=1, help="rows per micro-batch")
    parser.add_argument("--seq-len", type=int, default=1024, help="prompt + response tokens per row")
    parser.add_argument("--response-len", type=int, default=None)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--packed", action="store_true", help="packed sequences: no attention mask")
    parser.add_argument("--kv-seqs", type=int, default=0)
    parser.add_argument("--kv-len", type=int, default=0)
    parser.add_argument("--budget-gib", type=float, default=None, help="per-device memory for suggestions")
    parser.add_argument("--offload", action="store_true", help="FSDP2 CPU offload: shards and optimizer in host memory")
    parser.add_argument(
        "--device-gib",
        type=float,
        default=None,
        help="device memory: print the phases of a step colocated with a vLLM engine",
    )
    parser.add_argument(
        "--vllm-util",
        type=float,
        default=None,
        help="vLLM's share of the device (default: 90%% of what is free when it is built, after the "
        "trainer's weights and optimizer state)",
    )
    parser.add_argument("--vllm-tp", type=int, default=1, help="vLLM's tensor-parallel size")
    parser.add_argument(
        "--logits-chunk-mib",
        type=float,
        default=256.0,
        help="FSDPConfig.logits_chunk_mib (the recipes' default; 0: the log-probs of a whole micro-batch at once)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.tiny:
        from backends.models import TinyModelConfig, build_char_tokenizer

        shape = ModelShape.from_tiny(TinyModelConfig(), len(build_char_tokenizer()))
    else:
        shape = ModelShape.from_pretrained(args.model)
    parallel = Parallelism(dp=args.dp, tp=args.tp, pp=args.pp)
    work = Workload(
        role=args.role,
        compute_dtype=args.dtype,
        optimizer=args.optimizer,
        micro_batch_rows=args.micro_batch,
        seq_len=args.seq_len,
        response_len=args.response_len,
        gradient_checkpointing=args.gradient_checkpointing,
        padded=not args.packed,
        kv_seqs=args.kv_seqs,
        kv_len=args.kv_len,
        offload=args.offload,
        logits_chunk_rows=chunk_rows_for(args.logits_chunk_mib, shape.vocab_size // args.tp),
    )
    print(
        f"model: {shape.num_params / 1e6:.2f}M parameters, {shape.num_layers} layers, hidden {shape.hidden_size}, "
        f"vocab {shape.vocab_size}; dp={parallel.dp} tp={parallel.tp} pp={parallel.pp}; {work.compute_dtype}"
    )
    print(
        format_table(
            estimate(shape, parallel, work),
            f"\nper-device estimate: {work.role}, micro-batch {work.micro_batch_rows} x {work.seq_len} tokens"
            f"{', checkpointing' if work.gradient_checkpointing else ''}",
        )
    )
    if args.budget_gib is not None:
        s = suggest(shape, parallel, work, int(args.budget_gib * 2**30))
        print(f"\nbudget {args.budget_gib} GiB per device (10% headroom): {s.reason}")
        print(
            f"  gradient_checkpointing={str(s.gradient_checkpointing).lower()}  micro_batch_size={s.micro_batch_rows}  "
            f"max_tokens_per_micro_batch={s.max_tokens_per_micro_batch}"
        )
        if work.kv_len:
            print(
                f"  rollout KV cache: up to {s.max_kv_seqs} sequences of {work.kv_len} tokens beside the training state"
            )
    if args.device_gib is not None:
        _print_colocated(shape, parallel, work, args)


def _print_colocated(shape: ModelShape, parallel: Parallelism, work: Workload, args: argparse.Namespace) -> None:
    gib = 2**30
    device = args.device_gib * gib
    step = colocated_step(
        shape,
        parallel,
        work,
        device_bytes=int(device),
        vllm_utilization=args.vllm_util,
        vllm_tp=args.vllm_tp,
        vllm_dtype=work.compute_dtype,
    )
    verdict = (
        "fits" if step.peak <= 0.9 * device else "fits without headroom" if step.peak <= device else "does not fit"
    )
    print(
        f"\ncolocated with vLLM (tp={args.vllm_tp}) on a {args.device_gib} GiB device: "
        f"update {step.update / gib:.1f} GiB, log-probs {step.logprob / gib:.1f} GiB, "
        f"rollout {step.rollout / gib:.1f} GiB (vLLM share {step.vllm_share / gib:.1f} GiB, "
        f"weights {step.vllm_weights / gib:.1f} GiB, KV cache for {step.kv_tokens} tokens): {verdict}"
    )


if __name__ == "__main__":
    main()

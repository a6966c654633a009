"""The FSDP engine's values: how a role is sharded, cast and fed (:class:`FSDPConfig`) and a role's
model, optimizer and step count (:class:`TrainState`). The engine itself: :mod:`backends.training.fsdp`.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import torch
import torch.distributed as dist
from torch import nn

from backends.distributed.setup import DistEnv
from backends.training.optim import OptimConfig
from rlfunc import schedules

__all__ = [
    "ATTENTION_IMPLEMENTATIONS",
    "FSDPConfig",
    "TrainState",
    "attention_implementation",
    "compute_dtype",
    "needs_own_attention",
]

#: what ``FSDPConfig.attn_implementation`` may name (besides "auto")
ATTENTION_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flash_attention_3", "eager")


# --------------------------------------------------------------------------------------------- configs


@attrs.frozen
class FSDPConfig:
    """How the model is sharded, cast and fed (one per role)."""

    #: dtype of the forward/backward compute; "auto" = bfloat16 on GPU, float32 on CPU. Master weights
    #: and optimizer state stay fp32 for the actor; the reference stores its weights in this dtype.
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    #: dtype of the cross-rank gradient reduction
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    #: rows per micro-batch (used when max_tokens_per_micro_batch is not set)
    micro_batch_size: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    #: token budget per micro-batch (prompt + response tokens), overrides micro_batch_size when set
    max_tokens_per_micro_batch: int | None = None
    #: recompute decoder-layer activations in backward (HF gradient checkpointing, use_reentrant=False)
    gradient_checkpointing: bool = False
    #: free the gathered parameters after forward (saves memory, all-gathers again in backward)
    reshard_after_forward: bool = True
    #: drop, per micro-batch, prompt columns that are padding in every row and response columns after
    #: the last loss token. Results are unchanged, except for losses that depend on the padded length
    #: (seq-mean-token-sum-norm without an explicit ``horizon``): pass the horizon, or turn this off.
    trim_padding: bool = True
    #: packed sequences (verl's name): each micro-batch's rows, without padding, concatenated into one
    #: row with restarting position ids (backends/packing.py); flash-attention varlen on GPU, per-sequence
    #: SDPA elsewhere. Log-probs, values, losses and gradients equal the padded ones.
    use_remove_padding: bool = False
    #: with use_remove_padding: rows with the same prompt (a GRPO group's n samples) hold its tokens once
    #: in the packed row and attention reads them into every sequence of the group (backends/packing.py;
    #: same outputs and gradients, 7/8 fewer prompt tokens at n=8). Needs the packed-aware SDPA attention;
    #: with flash-attention varlen (GPU) prompts are not shared.
    share_prompts: bool = True
    #: before an update, redistribute the global batch across data-parallel ranks so that every rank
    #: gets the same number of rows and near-equal token counts (Karmarkar-Karp, rlfunc/balancing.py).
    #: Updates only: forward-only passes (compute_logprobs / compute_values) keep each rank's rows.
    balance_dp: bool = False
    #: how rows are grouped under a token budget (max_tokens_per_micro_batch): "sequential" fills
    #: micro-batches in row order; "balanced" uses the fewest micro-batches that fit, the same count on
    #: every rank, with near-equal token sums (Karmarkar-Karp; verl's use_dynamic_bsz)
    token_budget_grouping: Literal["sequential", "balanced"] = "sequential"
    #: actor and critic on a GPU: FSDP2's CPUOffloadPolicy (verl's param_offload + optimizer_offload):
    #: parameter shards, gradients and the AdamW step stay in host memory, each layer copied to the GPU
    #: for its compute. Refused on a CPU-only process. The reference has its own reference.param_offload.
    offload: bool = False
    #: load the whole checkpoint on every rank, then shard it (world size x the model in host memory at
    #: once); by default a sharded role is built on the meta device and the mesh's first rank reads the
    #: checkpoint and scatters each rank's shards (backends/training/sharded_loading.py)
    load_on_every_rank: bool = False
    #: the log-probs and entropies are taken from this many MiB of fp32 logits at a time (rlfunc/logits.py's
    #: chunked path, whose backward recomputes each chunk's softmax): the update keeps the logits alone, not
    #: their fp32 copy, softmax and gradients (about ten fp32 copies of a micro-batch's logits). 0: all at once
    logits_chunk_mib: float = attrs.field(default=256.0, validator=attrs.validators.ge(0))
    #: the model's attention: auto (flash_attention_2 on a GPU with the flash-attn package when the compute dtype
    #: is bf16 / fp16, which is all flash-attn runs; else sdpa), sdpa, flash_attention_2, flash_attention_3, eager.
    #: Packed rows on a CPU run the packed-aware attention
    #: (backends/training/packed_attention.py)
    attn_implementation: str = "auto"

    def __attrs_post_init__(self) -> None:
        if self.attn_implementation not in ("auto", *ATTENTION_IMPLEMENTATIONS):
            raise ValueError(
                f"FSDPConfig.attn_implementation must be auto or one of {', '.join(ATTENTION_IMPLEMENTATIONS)}, "
                f"got {self.attn_implementation!r}"
            )
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ValueError(
                f"FSDPConfig.max_tokens_per_micro_batch must be >= 1, got {self.max_tokens_per_micro_batch}"
            )
        if self.token_budget_grouping not in ("sequential", "balanced"):
            raise ValueError(
                f"FSDPConfig.token_budget_grouping must be 'sequential' or 'balanced', "
                f"got {self.token_budget_grouping!r}"
            )


def compute_dtype(cfg: FSDPConfig, device: torch.device) -> torch.dtype:
    """The forward/backward compute dtype of ``cfg`` on ``device`` ("auto": bfloat16 on GPU, else fp32)."""
    if cfg.param_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.param_dtype)


def attention_implementation(cfg: FSDPConfig, device: torch.device) -> str:
    """The attention the model is loaded with on ``device`` (see ``FSDPConfig.attn_implementation``); a flash
    attention where it cannot run is an error naming the setting. flash-attn computes in fp16 / bf16 only (its
    kernels refuse fp32 inputs at the first forward), so ``auto`` takes SDPA for an fp32 compute dtype."""
    name = cfg.attn_implementation
    half = compute_dtype(cfg, device) in (torch.float16, torch.bfloat16)
    if name == "auto":
        return "flash_attention_2" if device.type == "cuda" and half and _flash_attention_installed() else "sdpa"
    if name.startswith("flash_attention") and device.type != "cuda":
        raise ValueError(
            f"attn_implementation={name} needs a CUDA device (this process runs on {device.type}); use sdpa or auto"
        )
    if name.startswith("flash_attention") and not half:
        raise ValueError(
            f"attn_implementation={name} computes in fp16 / bf16 only, and param_dtype={cfg.param_dtype} "
            f"computes in {compute_dtype(cfg, device)}: use sdpa (or auto), or param_dtype=bfloat16"
        )
    if name.startswith("flash_attention") and not _flash_attention_installed(name):
        raise ValueError(
            f"attn_implementation={name} needs the flash-attn package (pip install flash-attn), or use sdpa / auto"
        )
    return name


def _flash_attention_installed(name: str = "flash_attention_2") -> bool:
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    return is_flash_attn_3_available() if name == "flash_attention_3" else is_flash_attn_2_available()


def needs_own_attention(cfg: FSDPConfig, device: torch.device) -> bool:
    """Packed rows need the packed-aware attention; so does bf16 on CPU, which it runs in fp32 or as
    bf16 matmuls (backends/training/packed_attention.py: PyTorch's bf16 CPU flash-attention backward is
    several times slower)."""
    return cfg.use_remove_padding or (device.type == "cpu" and compute_dtype(cfg, device) != torch.float32)


# ----------------------------------------------------------------------------------------------- state


@attrs.frozen(kw_only=True)
class TrainState:
    """One role's model (+ optimizer for the actor and the critic) and its step count.

    ``module`` and ``optimizer`` are mutated in place by :func:`update`; ``step`` is the number of
    updates done so far (the LR schedule's step).
    """

    module: nn.Module  # FSDP2-wrapped HF causal LM (a *ForTokenClassification value model for the critic)
    optimizer: torch.optim.Optimizer | None  # None for the reference role
    mesh: Any  # the 1-D data-parallel DeviceMesh ("dp")
    env: DistEnv
    fsdp_cfg: FSDPConfig
    optim_cfg: OptimConfig | None = None
    lr_schedule: schedules.LRSchedule | None = None  # from optim_cfg; evaluated at ``step``
    step: int = 0
    role: Literal["actor", "reference", "critic"] = "actor"
    log_prob_micro_batch_size: int | None = None  # default micro-batch size of compute_logprobs
    #: updates skipped for a non-finite loss / grad norm so far (optim.nonfinite=skip; kept in checkpoints)
    nonfinite_updates_skipped: int = 0
    #: a reference that shares the actor's LoRA-wrapped module: forwards run under ``disable_adapter()``
    #: (the base weights = the actor at step 0), see :func:`reference_from_lora_actor`
    adapter_disabled: bool = False

    def replace(self, **changes: Any) -> "TrainState":
        return attrs.evolve(self, **changes)

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    @property
    def dp_size(self) -> int:
        return self.mesh.size()

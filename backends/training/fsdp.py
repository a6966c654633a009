"""FSDP2 training engine for Hugging Face models: actor and critic (trainable), reference (forward-only).

Roles: the **actor** is a causal LM (log-probs of the response tokens); the **reference** is a
forward-only causal LM; the **critic** is the same backbone with a scalar value head
(``*ForTokenClassification``, ``num_labels=1``, as verl's critic) and its own optimizer. A critic
update's ``loss_fn`` sees ``outputs.values`` (``outputs.logprobs`` is None): the value at the position
that predicts each response token, i.e. ``values[:, p-1 : p+t-1]`` of the full sequence, verl's
``values[:, -response_length-1 : -1]``.

State is an explicit value. ``build_actor`` returns a :class:`TrainState`; ``update(state, batch,
loss_fn)`` returns ``(new_state, metrics)``. The module and the optimizer inside the state are
updated in place (they are FSDP-sharded and cannot be copied cheaply), so the old state object must
not be reused after an update; only ``step`` is a plain value that the new state carries forward.

Sharding: ``fully_shard`` on every decoder layer, then on the root (embeddings, final norm, lm_head,
tied or not), over a 1-D data-parallel ``DeviceMesh``. Parameters become ``DTensor``s sharded on dim 0;
gloo on CPU, NCCL on GPU, the same code. At world size 1 with fp32 compute (nothing to shard or cast)
the module stays a plain module.

One update (torchtitan-style, explicit):

0. optionally (``balance_dp``) redistribute the global batch over the ranks: equal rows, near-equal
   tokens (Karmarkar-Karp on the gathered sequence lengths);
1. split the rank's batch into micro-batches (``micro_batch_size`` rows, or a token budget, filled in
   row order or balanced: ``token_budget_grouping``); with ``use_remove_padding`` each micro-batch
   runs as one packed row (backends/packing.py);
2. count the loss tokens / sequences of the rank's batch and all-reduce them: the **global**
   :class:`rlfunc.Normalizers`; every rank also learns the largest micro-batch count, and ranks with
   fewer micro-batches run zero-weight dummy ones so the FSDP collectives line up;
3. per micro-batch: forward, ``loss_fn(outputs, micro_batch, norms)``, backward; gradients are reduced
   across ranks only on the last micro-batch. Because each micro-batch loss is divided by the global
   counts, the sum of all micro-batch losses over all ranks *is* the global-batch loss; FSDP's
   reduce-scatter averages over ranks, so each loss is multiplied by the data-parallel size before
   backward, and the reduced gradient is exactly the gradient of the global-batch loss;
4. global grad norm, clip, AdamW step at ``lr_at(optim_cfg, step)``.

Host syncs per update: one at the start (the global counts, needed to pick the number of micro-batches
and to detect an empty batch) and one at the end (all metrics in a single ``tolist()``).

Defined behaviour on bad input (each tested):

- **Empty batch** (``response_mask`` false everywhere on every rank): no forward, no backward, no
  optimizer step; parameters and optimizer state are untouched. ``state.step`` still advances (the LR
  schedule follows the recipe's step count, as in verl) and the metrics say ``update_skipped = 1``.
- **Non-finite loss or gradient norm** (NaN / inf anywhere): the optimizer step is skipped and the
  gradients are dropped, like verl's ``optimizer_step``; ``grad_norm`` / ``loss`` report the
  non-finite value and ``update_skipped = 1``; ``state.step`` advances.
- A row with an empty prompt raises (the first response token would have no context).

Log-probabilities are those of the model's raw distribution (temperature 1), the same convention as
the rollout engines' ``rollout_logprobs``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Mapping

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from backends.distributed.setup import DistEnv, device_mesh, init_distributed
from backends.distributed.sharded_state import full_state_dict, reshard
from backends.models import load_causal_lm, load_value_model
from backends.training.optim import OptimConfig, build_optimizer, lr_schedule, set_lr
from backends.cpu.fused_modules import replay_linear_outputs, use_fused_modules
from backends.packing import VARLEN_SDPA, PackedRows, enable_packed_attention, model_kwargs, pack_rows, unpack
from rlfunc import schedules
from rlfunc.aggregation import Normalizers, local_normalizers
from rlfunc.balancing import balanced_partition, token_budget_balanced_partition
from rlfunc.batch import RolloutBatch, batch_size, select, token_budget_partitions, validate
from rlfunc.logits import entropy_from_logits, logprobs_from_logits
from rlfunc.tree import pytree_dataclass, tree_map

if TYPE_CHECKING:
    from backends.rollout.native import RolloutActivations

__all__ = [
    "FSDPConfig",
    "TrainState",
    "ModelOutputs",
    "LossFn",
    "build_actor",
    "build_reference",
    "reference_from_lora_actor",
    "compile_layers",
    "build_critic",
    "compute_logprobs",
    "compute_values",
    "value_loss_fn",
    "update",
    "full_state_dict",
    "micro_batches",
    "micro_batch_groups",
    "balance_across_ranks",
    "global_normalizers",
]


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

    def __attrs_post_init__(self) -> None:
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ValueError(
                f"FSDPConfig.max_tokens_per_micro_batch must be >= 1, got {self.max_tokens_per_micro_batch}"
            )
        if self.token_budget_grouping not in ("sequential", "balanced"):
            raise ValueError(
                f"FSDPConfig.token_budget_grouping must be 'sequential' or 'balanced', got {self.token_budget_grouping!r}"
            )


def _compute_dtype(cfg: FSDPConfig, device: torch.device) -> torch.dtype:
    if cfg.param_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.param_dtype)


def _needs_own_attention(cfg: FSDPConfig, device: torch.device) -> bool:
    """Packed rows need the packed-aware attention; so does bf16 on CPU, which it runs in fp32 or as
    bf16 matmuls (backends/packing.py: PyTorch's bf16 CPU flash-attention backward is several times
    slower)."""
    return cfg.use_remove_padding or (device.type == "cpu" and _compute_dtype(cfg, device) != torch.float32)


# ----------------------------------------------------------------------------------------------- state


@pytree_dataclass
class ModelOutputs:
    """Per-token quantities of the response tokens under the current model (fp32).

    An actor / reference fills ``logprobs`` (and ``entropy`` on request); a critic fills ``values``
    only (``logprobs`` is None).
    """

    logprobs: Tensor | None = None  # (b t): log p(response_ids[i, j] | everything before it)
    entropy: Tensor | None = None  # (b t): entropy of the next-token distribution at that position
    values: Tensor | None = None  # (b t): critic's V at the position that predicts response_ids[i, j]


#: ``loss_fn(outputs, micro_batch, norms) -> (loss, metrics)``; ``loss`` must be a scalar normalised by
#: the *global* ``norms`` (see rlfunc.aggregate), metrics a dict of scalar tensors.
LossFn = Callable[[ModelOutputs, RolloutBatch, Normalizers], "tuple[Tensor, Mapping[str, Tensor]]"]


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


# ------------------------------------------------------------------------------------------- building


def _load_model(model: str | os.PathLike | nn.Module, dtype: torch.dtype) -> nn.Module:
    if isinstance(model, nn.Module):
        return model.to(dtype)
    module, _tokenizer = load_causal_lm(model, dtype=dtype, device="cpu")
    return module


def _enable_checkpointing(model: nn.Module) -> None:
    """HF activation checkpointing of every decoder layer, non-reentrant (needed under FSDP2)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (HF's ``_no_split_modules`` classes, e.g. Qwen2DecoderLayer)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        inner = getattr(getattr(model, "model", None), "layers", None)
        layers = list(inner) if inner is not None else []
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return layers


def _shard(
    model: nn.Module, mesh: Any, cfg: FSDPConfig, param_dtype: torch.dtype | None, *, param_offload: bool = False
) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if mesh.size() == 1 and param_dtype in (None, torch.float32) and not param_offload:
        # One rank, no cast, no offload: FSDP2 would only add its hooks and DTensor dispatch (about 10%
        # of a config-A update on CPU, measured), so the module stays plain. Everything downstream
        # (gradient sync, full weights, DCP checkpoints, which reshard across world sizes) takes both.
        return model
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=getattr(torch, cfg.reduce_dtype))
    # parameter offload keeps the shards in (pinned) host memory and copies them to the GPU per layer
    offload = CPUOffloadPolicy() if param_offload else OffloadPolicy()
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward, offload_policy=offload)
    # The root keeps its parameters (embeddings, final norm, lm_head) gathered after forward: backward
    # starts with the lm_head, so resharding it would only gather it again right away.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, offload_policy=offload)
    return model


def build_actor(
    model_path: str | os.PathLike | nn.Module,
    env: DistEnv | None = None,
    optim_cfg: OptimConfig = OptimConfig(),
    fsdp_cfg: FSDPConfig = FSDPConfig(),
    *,
    mesh: Any = None,
    lora: Any = None,
) -> TrainState:
    """Load a local HF checkpoint (or take an unsharded HF module), shard it with FSDP2, add AdamW.

    Every rank loads the full fp32 weights on CPU before sharding (fine for the models this runs on a
    CPU; a large model would be built on the meta device and loaded shard by shard).
    ``env`` defaults to ``backends.distributed.setup.init_distributed()``; the mesh is
    ``backends.distributed.setup.device_mesh(env)`` (all ranks data-parallel) unless ``mesh`` is given: a 1-D
    ``DeviceMesh`` over a subset of the ranks (a role's pool, see ``backends.distributed.placement``). Only the
    mesh's ranks call this.

    ``lora``: a ``peft.LoraConfig``; the model is wrapped with ``peft.get_peft_model`` before sharding,
    so only the adapter trains (the base weights are frozen and get no optimizer state). Its reference
    can then be the same module with the adapter disabled: :func:`reference_from_lora_actor`.
    """
    env = init_distributed() if env is None else env
    schedule = lr_schedule(optim_cfg)  # fail on a bad schedule before loading anything
    model = _load_model(model_path, torch.float32)
    if lora is not None:
        from peft import get_peft_model

        model = get_peft_model(model, lora)
    return _trainable_state(model, env, optim_cfg, fsdp_cfg, schedule, role="actor", mesh=mesh)


def _trainable_state(
    model: nn.Module, env: DistEnv, optim_cfg: OptimConfig, fsdp_cfg: FSDPConfig, schedule: Any, role: str,
    mesh: Any = None,
) -> TrainState:
    """Shard an unsharded fp32 model (master weights) and give it AdamW: the actor and the critic."""
    if _needs_own_attention(fsdp_cfg, env.device):
        enable_packed_attention(model)
    if env.device.type == "cpu":
        use_fused_modules(model)
    if fsdp_cfg.gradient_checkpointing:
        _enable_checkpointing(model)
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    mesh = device_mesh(env) if mesh is None else mesh
    model = _shard(model, mesh, fsdp_cfg, _compute_dtype(fsdp_cfg, env.device))
    model.train()
    optimizer = build_optimizer(model.parameters(), optim_cfg)
    return TrainState(
        module=model, optimizer=optimizer, mesh=mesh, env=env, fsdp_cfg=fsdp_cfg, optim_cfg=optim_cfg,
        lr_schedule=schedule, role=role,
    )


def _check_value_module(model: nn.Module) -> nn.Module:
    """A given module must be a one-label token classifier; its head dropout is turned off (as verl)."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    if not name.endswith("ForTokenClassification") or getattr(config, "num_labels", None) != 1:
        labels = getattr(config, "num_labels", None)
        raise ValueError(
            f"a critic module must be a *ForTokenClassification with num_labels=1 (a value model), got {name}"
            f" with num_labels={labels}; pass a HF dir to build one from a causal LM"
        )
    dropout = getattr(model, "dropout", None)
    if isinstance(dropout, nn.Dropout) and dropout.p != 0.0:
        model.dropout = nn.Dropout(0.0)
        config.classifier_dropout = 0.0
    return model


def build_critic(
    model_path: str | os.PathLike | nn.Module,
    env: DistEnv | None = None,
    optim_cfg: OptimConfig = OptimConfig(),
    fsdp_cfg: FSDPConfig = FSDPConfig(),
    *,
    value_head_init: Literal["normal", "zero"] = "normal",
    seed: int = 0,
    mesh: Any = None,
) -> TrainState:
    """The critic (verl's ``critic`` role): a value model sharded like the actor, with its own AdamW.

    ``model_path``: a local HF dir holding a value model (``*ForTokenClassification``, one label) or a
    causal LM, whose backbone is loaded under a new value head (``value_head_init`` / ``seed``: see
    :func:`backends.models.load_value_model`; the default draws it from HF's init distribution,
    N(0, initializer_range), with a seeded generator); or an unsharded one-label
    ``*ForTokenClassification`` module. Dropout before the head is 0. Train it with :func:`update` and a
    loss on ``outputs.values`` (:func:`value_loss_fn`); read values with :func:`compute_values`.
    ``mesh``: as in :func:`build_actor`.
    """
    env = init_distributed() if env is None else env
    schedule = lr_schedule(optim_cfg)
    if isinstance(model_path, nn.Module):
        model = _check_value_module(model_path.to(torch.float32))
    else:
        model, _tokenizer = load_value_model(
            model_path, dtype=torch.float32, device="cpu", value_head_init=value_head_init, seed=seed
        )
    return _trainable_state(model, env, optim_cfg, fsdp_cfg, schedule, role="critic", mesh=mesh)


def build_reference(
    model_path: str | os.PathLike | nn.Module,
    env: DistEnv | None = None,
    fsdp_cfg: FSDPConfig = FSDPConfig(),
    log_prob_micro_batch_size: int | None = None,
    *,
    mesh: Any = None,
    param_offload: bool = False,
    compile: bool = False,
) -> TrainState:
    """A forward-only copy of a model (verl's ``ref`` role): no optimizer, no gradients, eval mode.

    Its weights are stored in the compute dtype (no fp32 master copy), sharded like the actor's.
    ``log_prob_micro_batch_size`` (rows) is the default micro-batch size of :func:`compute_logprobs`.
    ``mesh``: as in :func:`build_actor`. ``param_offload``: FSDP2's ``CPUOffloadPolicy`` (shards in
    host memory, copied to the GPU layer by layer); it needs CUDA and is refused here otherwise, before
    loading anything. ``compile``: ``torch.compile`` each decoder layer's forward (per block, as
    torchtitan does under FSDP2); see :func:`compile_layers` for the fallback without a C++ compiler.
    """
    env = init_distributed() if env is None else env
    if log_prob_micro_batch_size is not None and log_prob_micro_batch_size < 1:
        raise ValueError(f"log_prob_micro_batch_size must be >= 1, got {log_prob_micro_batch_size}")
    if param_offload and env.device.type != "cuda":
        raise ValueError(
            "reference param_offload=True needs a CUDA device: FSDP2's CPUOffloadPolicy keeps the shards in host "
            f"memory and copies them to the GPU per layer; this process runs on {env.device.type!r} "
            "(on a CPU the parameters are already in host memory: leave param_offload off)"
        )
    dtype = _compute_dtype(fsdp_cfg, env.device)
    model = _load_model(model_path, dtype)
    if _needs_own_attention(fsdp_cfg, env.device):
        enable_packed_attention(model)
    if env.device.type == "cpu":
        use_fused_modules(model)
    model.requires_grad_(False)
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    mesh = device_mesh(env) if mesh is None else mesh
    model = _shard(model, mesh, fsdp_cfg, None, param_offload=param_offload)
    if compile:
        compile_layers(model)
    model.eval()
    return TrainState(
        module=model, optimizer=None, mesh=mesh, env=env, fsdp_cfg=fsdp_cfg, role="reference",
        log_prob_micro_batch_size=log_prob_micro_batch_size,
    )


def reference_from_lora_actor(actor: TrainState, log_prob_micro_batch_size: int | None = None) -> TrainState:
    """The reference as the LoRA actor's own module with the adapter disabled (verl's ``ref_in_actor``).

    The base weights are frozen under a LoRA adapter, so they *are* the policy at step 0: the reference's
    log-probs come from the same sharded module under ``peft``'s ``disable_adapter()``, and no second
    copy of the weights is built. ``actor`` must come from ``build_actor(..., lora=LoraConfig(...))``.
    """
    if actor.role != "actor":
        raise ValueError(f"reference_from_lora_actor needs an actor state, got a {actor.role!r} state")
    if not callable(getattr(actor.module, "disable_adapter", None)):
        raise ValueError(
            "the reference can share the actor's weights only when the actor trains a LoRA adapter "
            "(build_actor(..., lora=peft.LoraConfig(...))); this actor trains all its weights, so its step-0 "
            "weights are gone: build a separate reference (build_reference)"
        )
    if log_prob_micro_batch_size is not None and log_prob_micro_batch_size < 1:
        raise ValueError(f"log_prob_micro_batch_size must be >= 1, got {log_prob_micro_batch_size}")
    return TrainState(
        module=actor.module, optimizer=None, mesh=actor.mesh, env=actor.env, fsdp_cfg=actor.fsdp_cfg,
        role="reference", log_prob_micro_batch_size=log_prob_micro_batch_size, adapter_disabled=True,
    )


def compile_layers(model: nn.Module) -> bool:
    """``torch.compile`` every decoder layer in place; returns whether it did.

    Inductor's CPU backend builds C++ kernels: without a C++ compiler (``$CXX`` or ``g++`` on the
    PATH) every forward would fail at its first call, so the model stays eager and one warning says so.
    """
    import logging
    import shutil

    if _on_cpu(model) and shutil.which(os.environ.get("CXX", "g++")) is None:
        logging.getLogger("rlfunc.compile").warning(
            "reference compile=True: no C++ compiler found (CXX=%r, g++ not on PATH), which torch.compile's "
            "inductor backend needs on CPU; running the reference eagerly",
            os.environ.get("CXX"),
        )
        return False
    for layer in _decoder_layers(model):
        layer.compile()
    return True


def _on_cpu(model: nn.Module) -> bool:
    """Whether the model's parameters live on the CPU (local shards for an FSDP2 module)."""
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        return local.device.type == "cpu"
    return True


# ------------------------------------------------------------------------------------- micro-batching


def _check_batch(batch: RolloutBatch) -> None:
    validate(batch)
    if batch_size(batch) == 0:
        raise ValueError("the batch has no rows")
    has_prompt = batch.prompt_mask.any(dim=-1)
    if not bool(has_prompt.all()):
        row = int((~has_prompt).nonzero()[0])
        raise ValueError(
            f"row {row} has an empty prompt (prompt_mask all false): the model needs at least one prompt token"
        )


def _row_tokens(batch: RolloutBatch) -> list[int]:
    """Tokens per row as the token budget counts them: real prompt tokens + loss tokens."""
    return (batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).cpu().tolist()


def micro_batch_groups(
    batch: RolloutBatch,
    *,
    micro_batch_size: int | None = None,
    max_tokens: int | None = None,
    grouping: str = "sequential",
    min_parts: int = 1,
) -> list[list[int]]:
    """Row indices of each micro-batch: by a token budget (prompt + response tokens) if given, else by rows.

    ``grouping="balanced"`` (token budget only): the fewest micro-batches (at least ``min_parts``) that
    fit the budget, with near-equal token sums (rlfunc.balancing); ``"sequential"``: consecutive rows.
    """
    n = batch_size(batch)
    if max_tokens is not None:
        if grouping == "balanced":
            return token_budget_balanced_partition(_row_tokens(batch), max_tokens, min_parts=min_parts)
        if grouping != "sequential":
            raise ValueError(f"grouping must be 'sequential' or 'balanced', got {grouping!r}")
        return token_budget_partitions(torch.tensor(_row_tokens(batch)), max_tokens)
    if micro_batch_size is None or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)]


def micro_batches(
    batch: RolloutBatch,
    *,
    micro_batch_size: int | None = None,
    max_tokens: int | None = None,
    grouping: str = "sequential",
    min_parts: int = 1,
) -> list[RolloutBatch]:
    """Split rows into micro-batches (see :func:`micro_batch_groups`)."""
    groups = micro_batch_groups(
        batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens, grouping=grouping, min_parts=min_parts
    )
    return [_select_rows(batch, g) for g in groups]


def _select_rows(batch: RolloutBatch, rows: list[int]) -> RolloutBatch:
    """Rows of a micro-batch: a slice (a view, no copy) when they are consecutive."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return select(batch, slice(rows[0], rows[0] + len(rows)))
    return select(batch, rows)


_PLAN_FAILED = 2**40  # a micro-batch count no rank reaches: "my rows do not fit the token budget"


def _plan_micro_batches(
    batch: RolloutBatch | None, state: "TrainState", micro_batch_size: int | None = None
) -> list[list[int]]:
    """This rank's micro-batch row groups under the state's FSDP config (``None``: no rows).

    Under a token budget the ranks first agree (one small all-reduce): on a micro-batch count, so that
    under balanced grouping no rank runs dummy micro-batches unless its rows cannot be spread that
    far; and on failure, so that a row too long for the budget on one rank raises on every rank
    instead of leaving the others waiting in the next collective."""
    cfg = state.fsdp_cfg
    if micro_batch_size is not None or cfg.max_tokens_per_micro_batch is None:
        size = micro_batch_size if micro_batch_size is not None else cfg.micro_batch_size
        return micro_batch_groups(batch, micro_batch_size=size) if batch is not None else []
    budget, grouping = cfg.max_tokens_per_micro_batch, cfg.token_budget_grouping
    mine, error = [], None
    if batch is not None:
        try:
            mine = micro_batch_groups(batch, max_tokens=budget, grouping=grouping)
        except ValueError as e:
            mine, error = None, e
    agreed = _all_reduce_max(len(mine) if mine is not None else _PLAN_FAILED, state)
    if agreed >= _PLAN_FAILED:
        if error is not None:
            raise error
        raise ValueError(f"a row on another data-parallel rank does not fit max_tokens_per_micro_batch={budget}")
    if grouping == "balanced" and batch is not None:
        return micro_batch_groups(batch, max_tokens=budget, grouping="balanced", min_parts=agreed)
    return mine


def _pad_dim(x: Tensor, axis: int, size: int, left: bool) -> Tensor:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[axis] = extra
    pad = x.new_zeros(shape)
    return torch.cat([pad, x] if left else [x, pad], dim=axis)


def balance_across_ranks(batch: RolloutBatch, state: "TrainState") -> RolloutBatch:
    """Redistribute the global batch over the data-parallel ranks by token count (a collective).

    Every rank all-gathers the whole global batch (each leaf padded to the largest row count, prompt
    width (left) and response width (right) over ranks, then unpadded), splits its rows with
    :func:`rlfunc.balancing.balanced_partition` into ``dp`` parts of equal row count (when the row count
    divides, else of any count) and near-equal tokens, and keeps part ``rank``. The partition is a
    deterministic function of the gathered lengths, so the ranks agree without talking. The union of
    the rows over ranks is unchanged, so with global normalisers the update's gradient is unchanged.
    Gathering everything costs ``dp`` times this rank's batch in memory for a moment; RL batches are
    token ids and a few per-token floats, small next to the model.
    """
    world = state.dp_size
    if world == 1:
        return batch
    group, dev, home = state.dp_group, state.env.device, batch.response_ids.device
    n, p, t = batch.prompt_ids.shape[0], batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    sizes = [torch.zeros(3, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([n, p, t], dtype=torch.int64, device=dev), group=group)
    table = torch.stack(sizes).cpu().tolist()
    n_max, p_max, t_max = (max(row[j] for row in table) for j in range(3))

    def gather(x: Tensor, dims: list[str]) -> Tensor:
        x = x.to(dev)
        is_bool = x.dtype == torch.bool
        if is_bool:  # gloo has no bool collectives
            x = x.to(torch.uint8)
        x = _pad_dim(x, 0, n_max, left=False)
        if "p" in dims:
            x = _pad_dim(x, dims.index("p"), p_max, left=True)
        if "t" in dims:
            x = _pad_dim(x, dims.index("t"), t_max, left=False)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        full = torch.cat([part[:row[0]] for part, row in zip(parts, table)])
        return (full.bool() if is_bool else full).to(home)

    changes = {}
    for f in attrs.fields(type(batch)):
        value = getattr(batch, f.name)
        if value is not None:
            changes[f.name] = gather(value, (f.metadata.get("shape") or "").split())
    everyone = batch.replace(**changes)
    total = sum(row[0] for row in table)
    parts = balanced_partition(_row_tokens(everyone), world, equal_size=total % world == 0)
    return select(everyone, parts[dist.get_rank(group)])


def _slice_dims(batch: RolloutBatch, dim_name: str, index: slice) -> RolloutBatch:
    """Slice the ``dim_name`` axis ("p" or "t") of every field declared with it."""
    changes = {}
    for f in attrs.fields(type(batch)):
        value = getattr(batch, f.name)
        dims = (f.metadata.get("shape") or "").split()
        if value is None or dim_name not in dims:
            continue
        axis = dims.index(dim_name)
        changes[f.name] = value[(slice(None),) * axis + (index,)]
    return batch.replace(**changes)


def _trim(mb: RolloutBatch) -> RolloutBatch:
    """Drop all-padding prompt columns on the left and response columns after the last loss token."""
    first_prompt = int(mb.prompt_mask.any(0).int().argmax())
    has_loss = mb.response_mask.any(0)
    last_resp = int(has_loss.numel() - 1 - has_loss.flip(0).int().argmax()) if bool(has_loss.any()) else 0
    return _slice_dims(_slice_dims(mb, "p", slice(first_prompt, None)), "t", slice(0, last_resp + 1))


def _dummy(mb: RolloutBatch) -> RolloutBatch:
    """One row with no loss tokens: run by a rank with fewer micro-batches than the others so that
    every rank issues the same FSDP all-gathers and reduce-scatters. Its loss is also weighted by 0."""
    row = select(mb, slice(0, 1))
    return row.replace(response_mask=torch.zeros_like(row.response_mask))


def _to_device(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    return tree_map(lambda x: x.to(device, non_blocking=True) if isinstance(x, Tensor) else x, batch)


def _forward(
    module: nn.Module, mb: RolloutBatch, *, with_entropy: bool, role: str = "actor", packed: bool = False,
    share_prompts: bool = False, activations: RolloutActivations | None = None,
) -> ModelOutputs:
    """Log-probs (and entropies) of the response tokens; prompts are left-padded.

    The input is the prompt and all response columns but the last: position ``p - 1 + j`` predicts
    response token ``j``, and the last column's output would predict nothing (nor does any earlier
    token attend to it), so it is not computed. The response block is fully visible to attention:
    under the causal mask a real response token only sees tokens before it, so padding after it
    changes nothing, and this keeps the result independent of loss-masking edits to
    ``response_mask``. ``packed``: the same numbers from one packed row (:func:`_forward_packed`),
    with each distinct prompt held once if ``share_prompts``, and the linear layers' outputs taken
    from ``activations`` when given.
    """
    if packed:
        return _forward_packed(module, mb, with_entropy=with_entropy, role=role, share_prompts=share_prompts,
                               activations=activations)
    t = mb.response_ids.shape[1]
    input_ids = torch.cat([mb.prompt_ids, mb.response_ids[:, :-1]], dim=1)
    attention_mask = torch.cat([mb.prompt_mask, torch.ones_like(mb.response_mask[:, :-1])], dim=1)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if role == "critic":
        return _forward_values(module, input_ids, attention_mask, position_ids, t)
    out = module(
        input_ids=input_ids, attention_mask=attention_mask.long(), position_ids=position_ids,
        use_cache=False, logits_to_keep=t,
    )
    logits = out.logits  # (b t v): position p-1+j predicts response token j
    logprobs = logprobs_from_logits(logits, mb.response_ids)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return ModelOutputs(logprobs=logprobs, entropy=entropy)


def _forward_packed(
    module: nn.Module, mb: RolloutBatch, *, with_entropy: bool, role: str, share_prompts: bool = False,
    activations: RolloutActivations | None = None,
) -> ModelOutputs:
    """The micro-batch as one packed row (backends/packing.py): no compute on padding.

    Outputs are ``(b t)`` like the padded path's; positions after a row's last loss token hold 0
    (the padded path computes them and the losses mask them out). Only the positions that predict
    response tokens reach the lm_head (``logits_to_keep`` as an index tensor). ``share_prompts`` holds
    each distinct prompt once, when the model runs the packed-aware SDPA attention (which reads the
    shared layout; flash-attention varlen cannot).
    """
    reads_layouts = getattr(getattr(module, "config", None), "_attn_implementation", None) == VARLEN_SDPA
    # with recorded activations, pack in their order (a batch the rollout gave whole then reads them in place)
    packed: PackedRows = pack_rows(mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask,
                                   share_prompts=share_prompts and reads_layouts,
                                   step_major=activations is not None and reads_layouts)
    if role == "critic":
        out = module(**model_kwargs(packed))
        logits = out.logits
        if logits.dim() != 3 or logits.shape[-1] != 1:
            raise ValueError(f"a critic's model must output one value per token (b, s, 1), got {tuple(logits.shape)}")
        return ModelOutputs(values=unpack(logits[0, packed.predict_index, 0].float(), packed))
    replayed = _replayed_outputs(module, mb, packed, activations) if activations is not None else {}
    with replay_linear_outputs(replayed):
        out = module(**model_kwargs(packed), logits_to_keep=packed.predict_index)
    logits = out.logits[0]  # (N v): one row per kept response token
    logprobs = unpack(logprobs_from_logits(logits, packed.labels), packed)
    entropy = unpack(entropy_from_logits(logits), packed) if with_entropy else None
    return ModelOutputs(logprobs=logprobs, entropy=entropy)


def _replayed_outputs(
    module: nn.Module, mb: RolloutBatch, packed: PackedRows, activations: RolloutActivations
) -> dict[nn.Module, Callable[[tuple[int, ...]], Tensor]]:
    """Each linear module's recorded output for this packed micro-batch, produced when the module runs:
    the records' first rows themselves when they are the packed tokens in order (the micro-batch is
    the rollout's whole batch, packed step-major), else gathered."""
    rows = mb.rollout_rows.to(packed.token_rows.device)[packed.token_rows]
    positions = packed.position_ids[0]
    slots = activations.record_rows(rows, positions)
    logit_slots = activations.record_rows(rows[packed.predict_index], positions[packed.predict_index], logits=True)
    in_place = bool((slots == torch.arange(slots.shape[0], device=slots.device)).all())
    modules = dict(module.named_modules())
    missing = sorted(set(activations.outputs) - set(modules))
    if missing:
        raise ValueError(f"the recorded activations name modules this model does not have: {missing[:3]}")
    produce = {}
    for name, recorded in activations.outputs.items():
        if name == activations.lm_head_name:  # predicting positions repeat a shared prompt's last token: gathered
            produce[modules[name]] = functools.partial(_gather_rows, recorded, logit_slots)
        elif in_place:
            produce[modules[name]] = functools.partial(_leading_rows, recorded)
        else:
            produce[modules[name]] = functools.partial(_gather_rows, recorded, slots)
    return produce


def _leading_rows(source: Tensor, shape: tuple[int, ...]) -> Tensor:
    """The first rows of ``source`` viewed as ``shape`` (no copy)."""
    return source[: math.prod(shape) // source.shape[-1]].view(shape)


def _gather_rows(source: Tensor, index: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``source[index]`` as a new tensor of ``shape`` (same elements; ``index_select`` is several times
    faster than advanced indexing on CPU)."""
    out = source.new_empty(shape)
    torch.index_select(source, 0, index, out=out.view(-1, source.shape[-1]))
    return out


def _check_activations(state: TrainState, batch: RolloutBatch, activations: RolloutActivations) -> None:
    """Recorded rollout activations stand in for the forward's products only where they are its products."""
    cfg = state.fsdp_cfg
    if activations.weights_tag != state.step:
        raise ValueError(
            f"the rollout recorded these activations with the weights tagged {activations.weights_tag!r}; this "
            f"actor is at step {state.step}. They stand in for its forward pass only when the rollout ran its current "
            "weights: sync_weights(..., tag=actor.step) right before the rollout, and only the first update after it"
        )
    if state.role != "actor" or not cfg.use_remove_padding or cfg.balance_dp or state.env.device.type != "cpu":
        raise ValueError(
            "reusing rollout activations needs a CPU actor with packed rows (use_remove_padding=true) and rows that "
            f"stay on their rank (balance_dp=false); got role {state.role!r} on {state.env.device.type}, "
            f"use_remove_padding={cfg.use_remove_padding}, balance_dp={cfg.balance_dp}"
        )
    dtype = _compute_dtype(cfg, state.env.device)
    wrong = [n for n, t in activations.outputs.items() if t.dtype != dtype]
    if wrong:
        raise ValueError(f"recorded activations are {activations.outputs[wrong[0]].dtype}, the actor computes in {dtype}: "
                         "record with a rollout of the actor's compute dtype")
    if batch.rollout_rows is None:
        raise ValueError("the batch has no rollout_rows: it must come from the rollout that recorded the activations")


def _forward_values(
    module: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, t: int
) -> ModelOutputs:
    """Values of the response tokens: the head's output at positions p-1 .. p+t-2 (those that predict
    the response tokens; the input ends there), as verl's critic (``values[:, -t-1:-1]``). Same inputs
    as the log-prob pass."""
    out = module(
        input_ids=input_ids, attention_mask=attention_mask.long(), position_ids=position_ids, use_cache=False
    )
    logits = out.logits
    if logits.dim() != 3 or logits.shape[-1] != 1:
        raise ValueError(f"a critic's model must output one value per token (b, s, 1), got {tuple(logits.shape)}")
    return ModelOutputs(values=logits[:, -t:, 0].float())


# ---------------------------------------------------------------------------------------- log-probs


def compute_logprobs(
    state: TrainState,
    batch: RolloutBatch,
    *,
    with_entropy: bool = False,
    micro_batch_size: int | None = None,
) -> ModelOutputs:
    """Log-probs (``b t``, fp32, on the batch's device) of the response tokens, without gradients.

    Positions outside ``response_mask`` hold 0. Runs in eval mode (the actor returns to train mode
    afterwards), under ``torch.no_grad`` (``inference_mode`` breaks FSDP2 unsharding):
    FSDP all-gathers into buffers it reuses, and buffers created in inference mode cannot be written
    by the actor's next training forward. The returned tensors are ordinary tensors either way (safe
    to use in a loss). Micro-batch size: the argument, else the reference's
    ``log_prob_micro_batch_size``, else the FSDP config's token budget or rows. Every rank must make
    the same calls; the micro-batch count is agreed on with one small all-reduce.
    """
    if state.role == "critic":
        raise ValueError("compute_logprobs() needs an actor or reference state; for a critic use compute_values()")
    names = ("logprobs", "entropy") if with_entropy else ("logprobs",)
    out = _forward_only(state, batch, names, micro_batch_size=micro_batch_size, with_entropy=with_entropy)
    return ModelOutputs(logprobs=out["logprobs"], entropy=out.get("entropy"))


def compute_values(state: TrainState, batch: RolloutBatch, *, micro_batch_size: int | None = None) -> Tensor:
    """The critic's values (``b t``, fp32, on the batch's device) of the response tokens, without gradients.

    ``values[i, j]`` is the value head's output at the position that predicts ``response_ids[i, j]``
    (verl's critic convention); 0 outside ``response_mask``. Eval mode and ``torch.no_grad``, the
    critic returns to train mode afterwards. Micro-batch size: the argument, else the FSDP config's
    token budget or rows. A collective: every rank must call it (see :func:`compute_logprobs`).
    """
    if state.role != "critic":
        raise ValueError(f"compute_values() needs a critic state (build_critic); this is a {state.role!r} state")
    return _forward_only(state, batch, ("values",), micro_batch_size=micro_batch_size)["values"]


def _forward_only(
    state: TrainState,
    batch: RolloutBatch,
    names: tuple[str, ...],
    *,
    micro_batch_size: int | None,
    with_entropy: bool = False,
) -> dict[str, Tensor]:
    """Micro-batched forward without gradients; the ``names`` fields of ModelOutputs, ``(b t)`` each."""
    _check_batch(batch)
    cfg = state.fsdp_cfg
    groups = _plan_micro_batches(
        batch, state, micro_batch_size if micro_batch_size is not None else state.log_prob_micro_batch_size
    )
    n_max = _all_reduce_max(len(groups), state)
    out_device = batch.response_ids.device
    module = state.module
    was_training = module.training
    module.eval()
    adapter_off = module.disable_adapter() if state.adapter_disabled else contextlib.nullcontext()
    b, t = batch.response_ids.shape
    results = {name: torch.zeros(b, t, dtype=torch.float32, device=out_device) for name in names}
    try:
        # no_grad, not inference_mode: FSDP2's unshard bookkeeping needs version counters on its tensors
        with torch.no_grad(), adapter_off:
            for i in range(n_max):
                real = i < len(groups)
                mb = _select_rows(batch, groups[i]) if real else _dummy(_select_rows(batch, groups[0]))
                if cfg.trim_padding:
                    mb = _trim(mb)
                outputs = _forward(module, _to_device(mb, state.env.device), with_entropy=with_entropy,
                                   role=state.role, packed=cfg.use_remove_padding,
                                   share_prompts=cfg.share_prompts)
                if not real:
                    continue
                rows = torch.tensor(groups[i], device=out_device)
                tt = mb.response_ids.shape[1]
                for name in names:
                    # written into tensors made outside the context: they stay ordinary tensors
                    results[name][rows, :tt] = getattr(outputs, name).to(out_device)
    finally:
        module.train(was_training)
        reshard(module)
    mask = batch.response_mask.to(out_device)
    zero = torch.zeros((), dtype=torch.float32, device=out_device)
    # entropy is left as computed outside the mask (as before); log-probs and values are zeroed there
    return {name: (x if name == "entropy" else torch.where(mask, x, zero)) for name, x in results.items()}


# ------------------------------------------------------------------------------------------- update


def _all_reduce_max(n: int, state: TrainState) -> int:
    t = torch.tensor([n], dtype=torch.int64, device=state.env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=state.dp_group)
    return int(t.item())


def global_normalizers(mbs: list[RolloutBatch], group: dist.ProcessGroup | None = None) -> Normalizers:
    """Sum of ``local_normalizers(mb.response_mask)`` over micro-batches, all-reduced (SUM) over ``group``."""
    norms = [local_normalizers(mb.response_mask) for mb in mbs]
    total = norms[0]
    for n in norms[1:]:
        total = total + n
    packed = torch.stack([total.num_tokens, total.num_seqs])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return Normalizers(num_tokens=packed[0], num_seqs=packed[1])


def _gather_counts(local: Normalizers, num_micro_batches: int, state: TrainState) -> tuple[Normalizers, tuple[float, float, int]]:
    """Global normalisers (on the device) from this rank's ``local`` counts and, on the host,
    (num_tokens, num_seqs, largest micro-batch count over ranks): one all-gather and one host sync."""
    dev = state.env.device
    mine = torch.stack([
        local.num_tokens.to(dev, torch.float64),
        local.num_seqs.to(dev, torch.float64),
        torch.tensor(float(num_micro_batches), dtype=torch.float64, device=dev),
    ])
    everyone = [torch.empty_like(mine) for _ in range(state.dp_size)]
    dist.all_gather(everyone, mine, group=state.dp_group)
    table = torch.stack(everyone).cpu()
    norms = Normalizers(
        num_tokens=table[:, 0].sum().to(dev, torch.float32), num_seqs=table[:, 1].sum().to(dev, torch.float32)
    )
    return norms, (float(table[:, 0].sum()), float(table[:, 1].sum()), int(table[:, 2].max()))


_ENGINE_METRICS = ("loss", "grad_norm", "lr", "update_skipped", "num_tokens", "num_seqs", "num_micro_batches")


def _check_loss_output(loss: Any, metrics: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """A scalar tensor loss and a dict of scalar metrics whose names do not clash with the engine's."""
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar tensor loss, got {shape}")
    checked = {}
    for name, value in dict(metrics).items():
        if name in _ENGINE_METRICS:
            raise ValueError(
                f"loss_fn metric name {name!r} clashes with an engine metric ({', '.join(_ENGINE_METRICS)})"
            )
        value = torch.as_tensor(value)
        if value.numel() != 1:
            raise ValueError(f"loss_fn metric {name!r} must be a scalar, got shape {tuple(value.shape)}")
        checked[name] = value.detach().reshape(()).to(torch.float32)
    return loss.reshape(()), checked


def _check_critic_batch(batch: RolloutBatch, with_entropy: bool) -> None:
    if with_entropy:
        raise ValueError("with_entropy=True is for an actor: a critic's outputs have values only")
    if batch.returns is None:
        raise ValueError(
            "a critic update needs batch.returns (b t), the value targets (e.g. the returns of rlfunc.gae); it is None"
        )
    if batch.old_values is None:
        raise ValueError(
            "a critic update needs batch.old_values (b t), the critic's values when the batch was collected "
            "(compute_values(critic, batch)), for the clipped value loss; it is None"
        )


def value_loss_fn(
    *, clip_range: float | None = 0.5, agg: str = "token-mean", horizon: int | None = None
) -> LossFn:
    """The critic's ``loss_fn``: :func:`rlfunc.value_loss.value_loss` of ``outputs.values`` against
    ``mb.returns``, clipped around ``mb.old_values``, with the engine's global ``norms``.

    ``clip_range`` defaults to 0.5, verl's ``critic.cliprange_value``; ``agg`` is verl's
    ``critic.loss_agg_mode`` (default ``token-mean``). Metrics: ``vf_clipfrac``, ``vpred_mean``.
    """
    from rlfunc.value_loss import value_loss

    def loss_fn(outputs: ModelOutputs, mb: RolloutBatch, norms: Normalizers) -> tuple[Tensor, dict[str, Tensor]]:
        if outputs.values is None:
            raise ValueError("value_loss_fn needs a critic's outputs (outputs.values is None: is this an actor?)")
        return value_loss(
            outputs.values, mb.old_values, mb.returns, mb.response_mask,
            clip_range=clip_range, agg=agg, norms=norms, horizon=horizon,
        )

    return loss_fn


def update(
    state: TrainState,
    batch: RolloutBatch,
    loss_fn: LossFn,
    *,
    with_entropy: bool = False,
    skip_rows: Tensor | None = None,
    activations: RolloutActivations | None = None,
) -> tuple[TrainState, dict[str, float]]:
    """One optimizer step on this rank's share of the global batch; returns ``(new_state, metrics)``.

    ``loss_fn(outputs, micro_batch, norms) -> (loss, metrics)`` gets the model outputs of one
    micro-batch (``entropy`` is filled when ``with_entropy``), the micro-batch itself and the global
    normalisers, and must return a scalar loss normalised by them (``rlfunc.aggregate(..., norms)``).

    Metrics (plain floats, equal on every rank): ``loss`` = the global-batch loss (sum of micro-batch
    losses over micro-batches and ranks), ``grad_norm`` (global, before clipping), ``lr`` (used by this
    step), ``update_skipped`` (1 for an empty batch or a non-finite loss / grad norm), ``num_tokens``,
    ``num_seqs`` (the global normalisers), ``num_micro_batches``, and every ``loss_fn`` metric averaged
    over the micro-batches of all ranks (dummy micro-batches excluded).

    A **critic** state (:func:`build_critic`) gives ``loss_fn`` ``outputs.values`` (``logprobs`` is
    None; ``with_entropy`` is an error) and needs ``batch.returns`` (the targets) and
    ``batch.old_values`` (the values when the batch was collected, from :func:`compute_values`): a
    missing one is an error before any forward. :func:`value_loss_fn` is the PPO loss for it.

    ``skip_rows`` (``(b,)`` bool): rows whose loss and gradient the caller knows to be exactly zero
    (e.g. GRPO rows with zero advantage under a loss with no KL or entropy term: see
    :func:`rlfunc.zero_advantage_rows`). They count in the global normalisers as usual but get no
    forward or backward, so the gradient is unchanged (up to summation order) and the step is cheaper.
    ``loss_fn`` metrics (entropy, clip fraction, ...) then cover the rows that ran. If no rank has a
    row left, AdamW still steps on zero gradients, as it would have without the skip. With
    ``balance_dp`` every row runs (the same result, no saving).

    ``activations`` (``backends.rollout.native.generate_recording``, fp32 packed rows on CPU): the linear
    layers' outputs the rollout computed for these rows stand in for the forward's products, so the
    step runs the backward's GEMMs only (about a third fewer FLOPs; the same gradient to float
    rounding, tested). Only valid while the actor's weights are those the rollout ran: their tag must
    equal ``state.step`` (``sync_weights(..., tag=actor.step)``), and a second update on the same
    batch (PPO epochs, mini-batches) cannot reuse them.
    """
    if state.optimizer is None or state.optim_cfg is None or state.lr_schedule is None:
        raise ValueError(f"update() needs a trainable state with an optimizer; this is a {state.role!r} state")
    _check_batch(batch)
    if state.role == "critic":
        _check_critic_batch(batch, with_entropy)
    if activations is not None:
        _check_activations(state, batch, activations)
    cfg = state.fsdp_cfg
    module, optimizer = state.module, state.optimizer
    if skip_rows is not None:
        skip_rows = torch.as_tensor(skip_rows, dtype=torch.bool)
        if skip_rows.shape != (batch_size(batch),):
            raise ValueError(f"skip_rows must be a ({batch_size(batch)},) bool tensor, got shape {tuple(skip_rows.shape)}")
        if cfg.balance_dp:
            skip_rows = None  # rows move between ranks: run every row (the same result)
    if cfg.balance_dp:
        batch = balance_across_ranks(batch, state)
    counted = local_normalizers(batch.response_mask)  # every row counts in the normalisers
    run = batch
    if skip_rows is not None:
        kept = (~skip_rows).nonzero().squeeze(-1).tolist()
        run = _select_rows(batch, kept) if kept else None
    mbs = [_select_rows(run, g) for g in _plan_micro_batches(run, state)]
    norms, (num_tokens, num_seqs, n_max) = _gather_counts(counted, len(mbs), state)
    lr = schedules.lr_at(state.lr_schedule, state.step)
    base = {"lr": lr, "num_tokens": num_tokens, "num_seqs": num_seqs, "num_micro_batches": float(n_max)}
    new_state = state.replace(step=state.step + 1)
    if num_tokens == 0:
        # Nothing to learn from. Stepping AdamW on zero gradients would still move the parameters
        # (momentum, weight decay), so the step is skipped outright.
        return new_state, {"loss": 0.0, "grad_norm": 0.0, "update_skipped": 1.0, **base}

    module.train()
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), dtype=torch.float32, device=state.env.device)
    metric_sums: dict[str, Tensor] = {}
    n_real = 0
    for i in range(n_max):
        real = i < len(mbs)
        mb = mbs[i] if real else _dummy(mbs[0] if mbs else batch)
        if cfg.trim_padding:
            mb = _trim(mb)
        mb = _to_device(mb, state.env.device)
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(i == n_max - 1)
        outputs = _forward(module, mb, with_entropy=with_entropy, role=state.role, packed=cfg.use_remove_padding,
                           share_prompts=cfg.share_prompts, activations=activations if real else None)
        loss, metrics = loss_fn(outputs, mb, norms)
        loss, metrics = _check_loss_output(loss, metrics)
        # FSDP averages gradients over ranks; the losses are already global-normalised, so undo the mean.
        (loss * (state.dp_size if real else 0.0)).backward()
        for name, value in metrics.items():  # names from every call (a rank may run dummies only)
            metric_sums.setdefault(name, torch.zeros((), dtype=torch.float32, device=loss_sum.device))
            if real:
                metric_sums[name] = metric_sums[name] + value.to(loss_sum.device).float()
        if not real:
            continue
        n_real += 1
        loss_sum = loss_sum + loss.detach().float()

    # metrics: mean over every rank's real micro-batches (one all-reduce with the loss and the counts)
    names = sorted(metric_sums)
    count = torch.tensor(float(n_real), device=loss_sum.device)
    packed = torch.stack([loss_sum, count] + [metric_sums[k] for k in names])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=state.dp_group)
    packed = torch.cat([packed[:1], packed[2:] / packed[1].clamp(min=1.0)])

    if n_max == 0:  # every row of every rank skipped: the gradient is exactly zero, AdamW still steps
        for p in module.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    params = [p for p in module.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if isinstance(grad_norm, DTensor):  # a Partial (per-shard) norm: reduce it to the global one
        grad_norm = grad_norm.full_tensor()
    host = torch.cat([packed, grad_norm.reshape(1).float()]).tolist()  # the one metrics sync
    loss_value, metric_values, norm_value = host[0], host[1:-1], host[-1]

    skipped = not (math.isfinite(norm_value) and math.isfinite(loss_value))
    if not skipped:
        if state.optim_cfg.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(params, state.optim_cfg.clip_grad, grad_norm)
        set_lr(optimizer, lr)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    out = {"loss": loss_value, "grad_norm": norm_value, "update_skipped": float(skipped), **base}
    out.update(zip(names, metric_values))
    return new_state, out

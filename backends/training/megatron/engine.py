"""Megatron-core training engine (tensor + pipeline + data parallel): actor, reference and critic.

The same explicit-state interface as :mod:`backends.training.fsdp` and the same contract for losses
(:mod:`backends.training.common`):
``state, metrics = update(state, batch, loss_fn, with_entropy=...)`` (:mod:`backends.training.megatron.update`),
where ``loss_fn(outputs: ModelOutputs, micro_batch, norms: Normalizers) -> (loss, metrics)`` gets the
**global** normalisers; :func:`compute_logprobs`, :func:`compute_values`, :func:`full_state_dict` (full
HF tensors for a rollout engine) and :func:`export_hf` (an HF dir). The engine object over both modules
is :mod:`backends.training.megatron.train_engine`.

Layout: ``world = tp * pp * dp`` (megatron's ``parallel_state``). Each rank holds one pipeline stage
(``GPTModel(pre_process=..., post_process=...)``, :mod:`backends.training.megatron.model`) with ``1/tp`` of every
matrix, loaded from the HF checkpoint by :mod:`backends.training.megatron.convert`. Every rank of a
(tp, pp) replica gets the same rows; data-parallel replicas get different rows.

Bad configs (unsupported architecture, TP not dividing the heads / KV heads, PP not dividing the layers, world size not
divisible by tp * pp) raise before any weight is read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Literal

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn

from backends.distributed.setup import DistEnv, init_distributed
from backends.training.common import (
    LossFn,
    ModelOutputs,
    check_batch,
    micro_batches,
    to_device,
    trim_micro_batch,
    value_loss_fn,
)
from backends.training.megatron.convert import (
    HFSource,
    gather_hf_state,
    load_hf_into,
    read_hf_source,
    save_hf,
)
from backends.training.megatron.layout import ModelInput, layout_micro_batch
from backends.training.megatron.model import ModelShape, build_stage, model_shape
from backends.training.megatron.parallel import ParallelDims, check_sizes, init_model_parallel
from backends.training.megatron.pipeline import broadcast_from_last_stage, megatron_forward_backward, run_micro_batch
from backends.training.megatron.vocab_parallel import vocab_parallel_logprobs
from backends.training.optim import OptimConfig, build_optimizer, lr_schedule
from rlfunc import schedules
from rlfunc.batch import RolloutBatch

__all__ = [
    "MegatronConfig",
    "MegatronOptimConfig",
    "MegatronState",
    "ModelOutputs",
    "LossFn",
    "build_actor",
    "build_reference",
    "build_critic",
    "compute_logprobs",
    "compute_values",
    "value_loss_fn",
    "head_outputs",
    "full_state_dict",
    "export_hf",
    "fresh_optimizer",
    "broadcast_batch",
    "checkpoint_name",
]


@attrs.frozen
class MegatronOptimConfig:
    """Megatron's optimizer settings used on a GPU (verl's ``optim/megatron.yaml`` names). The
    learning rate, betas, weight decay, eps and clipping come from :class:`backends.training.optim.OptimConfig`."""

    optimizer: Literal["adam", "sgd"] = "adam"  #: megatron's optimizer
    use_distributed_optimizer: bool = True  #: shard optimizer state over data-parallel ranks (ZeRO-1)
    overlap_grad_reduce: bool = False  #: overlap the gradient reduce-scatter with the backward pass
    #: refused: megatron defers the updated parameters' all-gather to the next forward, but an RL step reads
    #: the full weights right after the update (the rollout's weight sync), so nothing could overlap it and
    #: the sync would send the previous step's weights
    overlap_param_gather: bool = attrs.field(default=False)
    grad_reduce_in_fp32: bool = True  #: reduce gradients in fp32

    @overlap_param_gather.validator
    def _no_deferred_param_gather(self, attribute: attrs.Attribute, value: bool) -> None:
        if value:
            raise ValueError(
                "overlap_param_gather=True is not supported: megatron would all-gather the updated parameters at the "
                "next forward pass, after the rollout's weight sync has already read them (stale weights); the "
                "all-gather cannot overlap anything in an RL step, so leave it off"
            )


@attrs.frozen
class MegatronConfig:
    """Parallel layout and feeding of one role."""

    tp: int = attrs.field(default=1, validator=attrs.validators.ge(1))  #: tensor-parallel size
    pp: int = attrs.field(default=1, validator=attrs.validators.ge(1))  #: pipeline stages
    #: rows per micro-batch (used when max_tokens_per_micro_batch is not set)
    micro_batch_size: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    max_tokens_per_micro_batch: int | None = None
    #: "bshd": left-aligned rows; "thd": packed sequences (remove-padding, megatron's PackedSeqParams)
    layout: Literal["bshd", "thd"] = attrs.field(default="bshd", validator=attrs.validators.in_(("bshd", "thd")))
    #: "auto" = bfloat16 on GPU, float32 on CPU (weights of the reference; compute of the actor on GPU)
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    #: "auto": megatron's schedules + DistributedOptimizer on CUDA, the gloo pipeline on CPU
    schedule: Literal["auto", "cpu", "megatron"] = attrs.field(
        default="auto", validator=attrs.validators.in_(("auto", "cpu", "megatron"))
    )
    trim_padding: bool = True  #: as FSDPConfig.trim_padding
    optim: MegatronOptimConfig = MegatronOptimConfig()
    seed: int = 0


@attrs.frozen(kw_only=True)
class MegatronState:
    """One role's pipeline stage (+ optimizer for the actor and the critic) and its step count.

    ``module`` and ``optimizer`` are updated in place by :func:`update`; ``step`` is the number of
    updates done (the LR schedule's step).
    """

    module: nn.Module  # this rank's GPTModel stage (megatron DDP-wrapped on the GPU schedule)
    optimizer: Any  # torch AdamW (CPU), megatron's optimizer (GPU), None for the reference
    env: DistEnv
    dims: ParallelDims
    shape: ModelShape
    hf_config: Any  # the source PretrainedConfig (export writes it back)
    cfg: MegatronConfig
    optim_cfg: OptimConfig | None = None
    lr_schedule: schedules.LRSchedule | None = None
    step: int = 0
    role: Literal["actor", "reference", "critic"] = "actor"
    log_prob_micro_batch_size: int | None = None
    #: updates skipped for a non-finite loss / grad norm so far (optim.nonfinite=skip)
    nonfinite_updates_skipped: int = 0

    def replace(self, **changes: Any) -> "MegatronState":
        return attrs.evolve(self, **changes)

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dims.dp_group

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def uses_megatron_schedule(self) -> bool:
        return _megatron_schedule(self.cfg)


# ------------------------------------------------------------------------------------- building


def _megatron_schedule(cfg: MegatronConfig) -> bool:
    """Megatron's own schedules and optimizer (CUDA), else the CPU gloo pipeline."""
    if cfg.schedule == "megatron" and not torch.cuda.is_available():
        raise RuntimeError("MegatronConfig.schedule='megatron' needs CUDA (megatron's schedules allocate on the GPU)")
    return cfg.schedule == "megatron" or (cfg.schedule == "auto" and torch.cuda.is_available())


def _dtype(cfg: MegatronConfig, device: torch.device) -> torch.dtype:
    if cfg.param_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.param_dtype)


def _prepare(
    model: Any, env: DistEnv | None, cfg: MegatronConfig
) -> tuple[DistEnv, Any, Any, ModelShape, ParallelDims]:
    """Validate everything that can fail cheaply, then set up the parallel groups."""
    config, source = read_hf_source(model, cfg.tp, cfg.pp)
    shape = model_shape(config)
    env = init_distributed() if env is None else env
    check_sizes(env.world_size, cfg.tp, cfg.pp)
    dims = init_model_parallel(cfg.tp, cfg.pp, seed=cfg.seed)
    return env, config, source, shape, dims


def _build(
    source: Any,
    shape: ModelShape,
    dims: ParallelDims,
    env: DistEnv,
    cfg: MegatronConfig,
    dtype: torch.dtype,
    *,
    value_head: bool = False,
) -> nn.Module:
    model = build_stage(
        shape,
        cfg.tp,
        cfg.pp,
        pre_process=dims.first_stage,
        post_process=dims.last_stage,
        value_head=value_head,
        params_dtype=dtype,
        device=env.device,
        tie_across_stages=_megatron_schedule(cfg),
    )
    load_hf_into(model, source, shape, dims, value_head=value_head)
    if _megatron_schedule(cfg):
        # megatron's pipeline schedule exchanges activation shapes first: micro-batches differ in
        # length. Set after construction: the config's own check of this flag is about MoE dispatch.
        model.config.variable_seq_lengths = True
    return model


def _megatron_ddp(model: nn.Module, cfg: MegatronConfig) -> nn.Module:
    """GPU: megatron's DistributedDataParallel wrapper, which owns the gradient buffers (each
    parameter's ``main_grad``) that its backward hooks fill and its optimizer reads."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.optim.grad_reduce_in_fp32,
        overlap_grad_reduce=cfg.optim.overlap_grad_reduce,
        overlap_param_gather=cfg.optim.overlap_param_gather,
        use_distributed_optimizer=cfg.optim.use_distributed_optimizer,
    )
    config = model.config
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_cfg, module=model)
    # What megatron's training loop wires up: the schedule reduces the DDP grad buffers (and the tied
    # embedding across stages) at the end, and accumulates without syncing before that.
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return ddp


def _megatron_optimizer(ddp: nn.Module, cfg: MegatronConfig, optim_cfg: OptimConfig, dtype: torch.dtype) -> Any:
    """GPU: megatron's (distributed) optimizer over ``ddp``'s parameters and gradient buffers."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt_cfg = OptimizerConfig(
        optimizer=cfg.optim.optimizer,
        lr=optim_cfg.lr,
        weight_decay=optim_cfg.weight_decay,
        adam_beta1=optim_cfg.betas[0],
        adam_beta2=optim_cfg.betas[1],
        adam_eps=optim_cfg.eps,
        clip_grad=optim_cfg.clip_grad if optim_cfg.clip_grad > 0 else 0.0,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=cfg.optim.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_cfg, [ddp])
    ddp.module.config.grad_scale_func = optimizer.scale_loss
    return optimizer


def _trainable(model: nn.Module, env, dims, shape, config, cfg, optim_cfg, schedule, role, dtype) -> MegatronState:
    model.train()
    state_kwargs = dict(
        env=env, dims=dims, shape=shape, hf_config=config, cfg=cfg, optim_cfg=optim_cfg, lr_schedule=schedule, role=role
    )
    if _megatron_schedule(cfg):
        ddp = _megatron_ddp(model, cfg)
        return MegatronState(module=ddp, optimizer=_megatron_optimizer(ddp, cfg, optim_cfg, dtype), **state_kwargs)
    return MegatronState(module=model, optimizer=build_optimizer(model.parameters(), optim_cfg), **state_kwargs)


def build_actor(
    model_path: str | os.PathLike | nn.Module,
    env: DistEnv | None = None,
    optim_cfg: OptimConfig = OptimConfig(),
    cfg: MegatronConfig = MegatronConfig(),
) -> MegatronState:
    """Load an HF Llama / Qwen2 causal LM (a local dir or an in-memory HF model) into this rank's
    megatron stage and give it AdamW. Master weights are fp32 on CPU."""
    schedule = lr_schedule(optim_cfg)
    env, config, source, shape, dims = _prepare(model_path, env, cfg)
    dtype = _dtype(cfg, env.device) if _megatron_schedule(cfg) else torch.float32
    model = _build(source, shape, dims, env, cfg, dtype)
    return _trainable(model, env, dims, shape, config, cfg, optim_cfg, schedule, "actor", dtype)


def build_reference(
    model_path: str | os.PathLike | nn.Module,
    env: DistEnv | None = None,
    cfg: MegatronConfig = MegatronConfig(),
    log_prob_micro_batch_size: int | None = None,
) -> MegatronState:
    """A forward-only copy (no optimizer, no gradients, eval mode, weights in the compute dtype)."""
    if log_prob_micro_batch_size is not None and log_prob_micro_batch_size < 1:
        raise ValueError(f"log_prob_micro_batch_size must be >= 1, got {log_prob_micro_batch_size}")
    env, config, source, shape, dims = _prepare(model_path, env, cfg)
    model = _build(source, shape, dims, env, cfg, _dtype(cfg, env.device))
    model.requires_grad_(False)
    model.eval()
    return MegatronState(
        module=model,
        optimizer=None,
        env=env,
        dims=dims,
        shape=shape,
        hf_config=config,
        cfg=cfg,
        role="reference",
        log_prob_micro_batch_size=log_prob_micro_batch_size,
    )


def build_critic(
    model_path: str | os.PathLike | nn.Module,
    env: DistEnv | None = None,
    optim_cfg: OptimConfig = OptimConfig(),
    cfg: MegatronConfig = MegatronConfig(),
    *,
    value_head_init: Literal["normal", "zero"] = "normal",
    seed: int = 0,
) -> MegatronState:
    """The critic: the backbone under a value head (hidden -> 1, with bias), with its own AdamW.

    ``model_path`` holds a value model (``score.*``: loaded) or a causal LM (a fresh head drawn exactly
    as :func:`backends.models.load_value_model` draws it: N(0, initializer_range) from a generator
    seeded by ``seed``, bias 0; or zeros), or is an in-memory HF model of either kind.
    """
    if value_head_init not in ("normal", "zero"):
        raise ValueError(f"value_head_init must be 'normal' or 'zero', got {value_head_init!r}")
    schedule = lr_schedule(optim_cfg)
    env, config, source, shape, dims = _prepare(model_path, env, cfg)
    extra = {}
    if "score.weight" not in source:
        g = torch.Generator().manual_seed(seed)
        std = getattr(config, "initializer_range", 0.02)
        weight = torch.randn((1, shape.hidden_size), generator=g, dtype=torch.float32).mul_(std)
        extra = {
            "score.weight": weight if value_head_init == "normal" else torch.zeros_like(weight),
            "score.bias": torch.zeros(1),
        }
    model = _build(HFSource(source, extra), shape, dims, env, cfg, torch.float32, value_head=True)
    return _trainable(model, env, dims, shape, config, cfg, optim_cfg, schedule, "critic", torch.float32)


def fresh_optimizer(state: MegatronState, optim: OptimConfig) -> MegatronState:
    """Same weights, a new optimizer and LR schedule (the recipe's RL phase after an SFT stage).

    On the GPU schedule the state's DDP wrapper stays: the new optimizer is built over its gradient
    buffers. (A second wrapper would point every ``main_grad`` at new buffers while the state's module,
    whose backward hooks cannot be removed, kept reducing and zeroing the old ones.)"""
    if state.uses_megatron_schedule:
        optimizer = _megatron_optimizer(state.module, state.cfg, optim, next(state.module.parameters()).dtype)
    else:
        optimizer = build_optimizer(state.module.parameters(), optim)
    return state.replace(optimizer=optimizer, optim_cfg=optim, lr_schedule=lr_schedule(optim), step=0)


# -------------------------------------------------------------------------------------- forward


def head_outputs(
    state: MegatronState, out: Tensor, inp: ModelInput, mb: RolloutBatch, with_entropy: bool
) -> ModelOutputs:
    """ModelOutputs ``(b t)`` from the last stage's output: vocab-parallel logits or values."""
    flat = out.reshape(-1, out.shape[-1])
    picked = flat[inp.predict_index.reshape(-1)].reshape(*inp.predict_index.shape, out.shape[-1])
    if state.role == "critic":
        return ModelOutputs(values=picked[..., 0].float())
    dims = state.dims
    v_local = out.shape[-1]
    logprobs, entropy = vocab_parallel_logprobs(
        picked,
        mb.response_ids,
        vocab_start=dims.tp_rank * v_local,
        vocab_size=state.shape.vocab_size,
        group=dims.tp_group if dims.tp > 1 else None,
        with_entropy=with_entropy,
    )
    return ModelOutputs(logprobs=logprobs, entropy=entropy)


def _micro_batches(state: MegatronState, batch: RolloutBatch, micro_batch_size: int | None) -> list[RolloutBatch]:
    cfg = state.cfg
    if micro_batch_size is not None:
        mbs = micro_batches(batch, micro_batch_size=micro_batch_size)
    elif state.log_prob_micro_batch_size is not None:
        mbs = micro_batches(batch, micro_batch_size=state.log_prob_micro_batch_size)
    else:
        mbs = micro_batches(batch, micro_batch_size=cfg.micro_batch_size, max_tokens=cfg.max_tokens_per_micro_batch)
    if cfg.trim_padding:
        mbs = [trim_micro_batch(mb) for mb in mbs]
    return [to_device(mb, state.env.device) for mb in mbs]


def _forward_only(
    state: MegatronState,
    batch: RolloutBatch,
    names: tuple[str, ...],
    *,
    micro_batch_size: int | None,
    with_entropy: bool = False,
) -> dict[str, Tensor]:
    check_batch(batch)
    mbs = _micro_batches(state, batch, micro_batch_size)
    out_device = batch.response_ids.device
    b, t = batch.response_ids.shape
    results = {name: torch.zeros(b, t, dtype=torch.float32, device=state.env.device) for name in names}
    module = state.module
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            row = 0
            for mb in mbs:
                inp = layout_micro_batch(mb, state.cfg.layout)
                n, tt = mb.response_ids.shape

                def head(out: Tensor, mb=mb, inp=inp) -> ModelOutputs:
                    return head_outputs(state, out, inp, mb, with_entropy)

                if state.uses_megatron_schedule:
                    got = megatron_forward_backward(
                        module,
                        [inp],
                        lambda o, i: (o.new_zeros(()), {"out": head(o)}),  # forward only: no loss
                        seq_length=inp.input_ids.shape[1],
                        micro_batch_size=inp.input_ids.shape[0],
                        forward_only=True,
                        loss_scale=1.0,
                    )
                    outputs = got[0]["out"] if got else None
                else:
                    outputs = run_micro_batch(
                        module,
                        state.dims,
                        inp,
                        head,
                        hidden_size=state.shape.hidden_size,
                        dtype=next(module.parameters()).dtype,
                        backward=False,
                    )
                if state.dims.last_stage:
                    for name in names:
                        results[name][row : row + n, :tt] = getattr(outputs, name)
                row += n
    finally:
        module.train(was_training)
    for name in names:
        results[name] = broadcast_from_last_stage(results[name], state.dims).to(out_device)
    mask = batch.response_mask.to(out_device)
    zero = torch.zeros((), dtype=torch.float32, device=out_device)
    return {name: (x if name == "entropy" else torch.where(mask, x, zero)) for name, x in results.items()}


def compute_logprobs(
    state: MegatronState, batch: RolloutBatch, *, with_entropy: bool = False, micro_batch_size: int | None = None
) -> ModelOutputs:
    """Log-probs (``b t``, fp32) of the response tokens, without gradients; on every rank (the last
    stage broadcasts). 0 outside ``response_mask``. A collective over the replica's ranks."""
    if state.role == "critic":
        raise ValueError("compute_logprobs() needs an actor or reference state; for a critic use compute_values()")
    names = ("logprobs", "entropy") if with_entropy else ("logprobs",)
    out = _forward_only(state, batch, names, micro_batch_size=micro_batch_size, with_entropy=with_entropy)
    return ModelOutputs(logprobs=out["logprobs"], entropy=out.get("entropy"))


def compute_logprobs_of_own_rows(
    state: MegatronState, batch: RolloutBatch, *, micro_batch_size: int | None = None
) -> Tensor:
    """Log-probs (``b t``) of *this rank's* rows when every rank brings different rows (an FSDP-style
    data-parallel recipe feeding a Megatron reference): the replica's ranks (its TP x PP group) gather
    their rows, run them together (TP / PP peers must see the same rows) and each keeps its own."""
    from backends.distributed.placement import concat_padded

    group = state.dims.model_parallel_group
    if dist.get_world_size(group) == 1:
        return compute_logprobs(state, batch, micro_batch_size=micro_batch_size).logprobs
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, batch, group=group)
    joint = compute_logprobs(state, concat_padded(gathered), micro_batch_size=micro_batch_size).logprobs
    me = dist.get_rank(group)
    start = sum(b.response_ids.shape[0] for b in gathered[:me])
    rows, t = batch.response_ids.shape
    return joint[start : start + rows, :t]


def compute_values(state: MegatronState, batch: RolloutBatch, *, micro_batch_size: int | None = None) -> Tensor:
    """The critic's values (``b t``) at the positions that predict the response tokens; 0 outside the mask."""
    if state.role != "critic":
        raise ValueError(f"compute_values() needs a critic state (build_critic); this is a {state.role!r} state")
    return _forward_only(state, batch, ("values",), micro_batch_size=micro_batch_size)["values"]


# ---------------------------------------------------------------------------------- full weights


def _stage_module(state: MegatronState) -> nn.Module:
    return state.module.module if state.uses_megatron_schedule and state.optimizer is not None else state.module


def full_state_dict(
    state: MegatronState,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    bucket_mb: float | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """Stream ``(hf_name, full_tensor)`` on every rank (TP gathered, stages broadcast), HF names and
    order, for a rollout engine's weight sync. A collective: every rank consumes it in step. ``bucket_mb``
    is the FSDP engine's setting and is not used here: tensor-parallel shards are gathered along each
    tensor's own axis and fused tensors split, one tensor at a time."""
    return gather_hf_state(
        _stage_module(state), state.shape, state.dims, value_head=state.role == "critic", dtype=dtype, device=device
    )


def export_hf(
    state: MegatronState,
    out_dir: str | os.PathLike,
    *,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the model as an HF dir (rank 0 writes; every rank must call); returns ``out_dir``. An
    existing ``out_dir`` is an error unless ``overwrite`` (as :func:`backends.checkpoint.hf_export.export_hf`)."""
    exists = Path(out_dir).exists()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # every rank has looked before rank 0 writes (tp = pp = 1 gathers nothing in between)
    if exists and not overwrite:
        raise FileExistsError(f"export dir {str(out_dir)!r} already exists (pass overwrite=True to replace it)")
    out = save_hf(
        full_state_dict(state, dtype=dtype, device="cpu"),
        state.hf_config,
        out_dir,
        value_head=state.role == "critic",
        tokenizer=tokenizer,
        write=state.env.is_main,
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return out


def checkpoint_name(state: MegatronState, role: str) -> str:
    """The name under which this rank saves and loads its part of ``role`` with
    :func:`backends.checkpoint.dcp.save_checkpoint` / ``load_checkpoint``.

    ``role`` when one rank holds the whole model (tp = pp = 1); else ``<role>.tp<i>.pp<j>``: each
    tensor- / pipeline-parallel shard (its stage's parameters and AdamW state) is a state of its own,
    which its data-parallel replicas save once, so a resume needs the same tp and pp (the recipes'
    config check names a change). Megatron's own schedule (GPU) keeps the optimizer state in its
    distributed optimizer's buffers, which this format does not read: refused, before any work.
    """
    if state.uses_megatron_schedule:
        raise NotImplementedError(
            "checkpoints of megatron's GPU schedule (its distributed optimizer) are not implemented: use "
            "actor.backend=fsdp, or checkpoint.every=0 and resume=never"
        )
    dims = state.dims
    return role if dims.tp * dims.pp == 1 else f"{role}.tp{dims.tp_rank}.pp{dims.pp_rank}"


def broadcast_batch(state: MegatronState, batch: RolloutBatch) -> RolloutBatch:
    """The replica's first rank's ``batch`` on every rank of its (tp x pp) group: tensor- and
    pipeline-parallel peers must train on the same rows (a recipe that samples per rank calls this)."""
    group = state.dims.model_parallel_group
    if dist.get_world_size(group) == 1:
        return batch
    box = [batch]
    dist.broadcast_object_list(box, src=min(dist.get_process_group_ranks(group)), group=group)
    return box[0]

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
The loss contract, the batch checks, micro-batching and the global counts are shared with the
megatron engine: :mod:`backends.training.common`.

Sharding: ``fully_shard`` on every decoder layer, then on the root (embeddings, final norm, lm_head,
tied or not), over a 1-D data-parallel ``DeviceMesh``. Parameters become ``DTensor``s sharded on dim 0;
gloo on CPU, NCCL on GPU, the same code. At world size 1 with fp32 compute and no offload (nothing to
shard, cast or offload) the module stays a plain module, moved to the mesh's device.

Loading: a sharded role read from a local HF dir is built with its parameters on the meta device,
sharded, and filled from the safetensors files, which only the mesh's first rank reads; it scatters
each rank's shards over the mesh's process group (:mod:`backends.training.sharded_loading`), so no
other rank ever holds the whole model. The older path (``from_pretrained`` on every rank, then
``fully_shard``) stays for what the new one does not cover: a given ``nn.Module``, a LoRA actor (peft
wraps the loaded model), the critic (a value head built from a causal LM by
:func:`backends.models.load_value_model`), a plain module at world size 1, a checkpoint without
safetensors files, and ``FSDPConfig.load_on_every_rank``.

One update (torchtitan-style, explicit):

0. optionally (``balance_dp``) redistribute the global batch over the ranks: equal rows, near-equal
   tokens (Karmarkar-Karp on the gathered sequence lengths; :mod:`backends.training.dp_balance`);
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
  non-finite value and ``update_skipped = 1``; ``state.step`` advances, and the running total
  ``nonfinite_updates_skipped`` grows by one. With ``optim.nonfinite=error`` the update raises
  :class:`~backends.training.common.NonFiniteUpdateError` instead (before the optimizer step, the
  gradients dropped): either way the weights never change.
- A row with an empty prompt raises (the first response token would have no context).

Log-probabilities are those of the model's raw distribution (temperature 1), the same convention as
the rollout engines' ``rollout_logprobs``.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from backends.distributed.setup import DistEnv, device_mesh, init_distributed
from backends.distributed.sharded_state import full_state_dict, reshard
from backends.models import load_value_model
from backends.training.common import (
    LossFn,
    ModelOutputs,
    agreed_token_budget_groups,
    all_reduce_max,
    check_batch,
    check_critic_batch,
    check_loss_output,
    dummy_micro_batch,
    gather_counts,
    global_normalizers,
    micro_batch_groups,
    micro_batches,
    nonfinite_policy,
    select_rows,
    to_device,
    trim_micro_batch,
    value_loss_fn,
)
from backends.training.dp_balance import balance_across_ranks
from backends.training.fsdp_sharding import check_offload, sharded_module
from backends.training.fsdp_state import (
    FSDPConfig,
    TrainState,
    attention_implementation,
    compute_dtype,
)
from backends.training.hf_forward import forward_micro_batch
from backends.training.hf_modules import (
    check_value_module,
    compile_layers,
    load_model,
)
from backends.training.memory_planner import chunk_rows_for
from backends.training.optim import OptimConfig, build_optimizer, lr_schedule, set_lr
from rlfunc import schedules
from rlfunc.aggregation import Normalizers, local_normalizers
from rlfunc.batch import RolloutBatch, batch_size, loss_tokens

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


# ------------------------------------------------------------------------------------------- building


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

    Master weights are fp32. A checkpoint dir is read shard by shard (see the module docstring,
    "Loading"); a given module, a LoRA actor and a plain world-size-1 module are loaded whole.
    ``env`` defaults to ``backends.distributed.setup.init_distributed()``; the mesh is
    ``backends.distributed.setup.device_mesh(env)`` (all ranks data-parallel) unless ``mesh`` is given: a 1-D
    ``DeviceMesh`` over a subset of the ranks (a role's pool, see ``backends.distributed.placement``). Only the
    mesh's ranks call this. ``fsdp_cfg.offload`` (GPU only, refused before loading elsewhere) keeps
    parameters, gradients and the optimizer step in host memory.

    ``lora``: a ``peft.LoraConfig``; the model is wrapped with ``peft.get_peft_model`` before sharding,
    so only the adapter trains (the base weights are frozen and get no optimizer state). Its reference
    can then be the same module with the adapter disabled: :func:`reference_from_lora_actor`.
    """
    env = init_distributed() if env is None else env
    schedule = lr_schedule(optim_cfg)  # fail on a bad schedule before loading anything
    check_offload(env, fsdp_cfg.offload, "FSDPConfig.offload=True")
    attention = attention_implementation(fsdp_cfg, env.device)  # a setting that cannot run fails before loading
    load = None if lora is None else (lambda: _with_lora(load_model(model_path, torch.float32, attention), lora))
    return _trainable_state(model_path, env, optim_cfg, fsdp_cfg, schedule, role="actor", mesh=mesh, load=load)


def _with_lora(model: nn.Module, lora: Any) -> nn.Module:
    """``model`` under a peft LoRA adapter (peft wraps a loaded model, so a LoRA actor is loaded whole)."""
    from peft import get_peft_model

    return get_peft_model(model, lora)


def _trainable_state(
    source: str | os.PathLike | nn.Module,
    env: DistEnv,
    optim_cfg: OptimConfig,
    fsdp_cfg: FSDPConfig,
    schedule: Any,
    role: str,
    mesh: Any = None,
    load: Any = None,
) -> TrainState:
    """Build and shard an fp32 model (master weights) and give it AdamW: the actor and the critic."""
    mesh = device_mesh(env) if mesh is None else mesh
    model = sharded_module(
        source,
        torch.float32,
        env,
        mesh,
        fsdp_cfg,
        param_dtype=compute_dtype(fsdp_cfg, env.device),
        trainable=True,
        param_offload=fsdp_cfg.offload,
        load=load,
    )
    model.train()
    optimizer = build_optimizer(model.parameters(), optim_cfg)
    return TrainState(
        module=model,
        optimizer=optimizer,
        mesh=mesh,
        env=env,
        fsdp_cfg=fsdp_cfg,
        optim_cfg=optim_cfg,
        lr_schedule=schedule,
        role=role,
    )


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
    ``mesh``: as in :func:`build_actor`. Every rank loads the whole value model before sharding (the
    value head and the checks of a causal-LM checkpoint are :func:`backends.models.load_value_model`'s).
    ``fsdp_cfg.offload``: as in :func:`build_actor`.
    """
    env = init_distributed() if env is None else env
    schedule = lr_schedule(optim_cfg)
    check_offload(env, fsdp_cfg.offload, "FSDPConfig.offload=True")

    def load() -> nn.Module:
        if isinstance(model_path, nn.Module):
            return check_value_module(model_path.to(torch.float32))
        model, _tokenizer = load_value_model(
            model_path,
            dtype=torch.float32,
            device="cpu",
            value_head_init=value_head_init,
            seed=seed,
            attn_implementation=attention_implementation(fsdp_cfg, env.device),
        )
        return model

    return _trainable_state(model_path, env, optim_cfg, fsdp_cfg, schedule, role="critic", mesh=mesh, load=load)


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

    Its weights are stored in the compute dtype (no fp32 master copy), sharded and loaded like the
    actor's (a checkpoint dir shard by shard: the module docstring, "Loading"). ``fsdp_cfg.offload``
    is the trainable roles' setting; the reference's is ``param_offload``.
    ``log_prob_micro_batch_size`` (rows) is the default micro-batch size of :func:`compute_logprobs`.
    ``mesh``: as in :func:`build_actor`. ``param_offload``: FSDP2's ``CPUOffloadPolicy`` (shards in
    host memory, copied to the GPU layer by layer); it needs CUDA and is refused here otherwise, before
    loading anything. ``compile``: ``torch.compile`` each decoder layer's forward (per block, as
    torchtitan does under FSDP2); see :func:`compile_layers` for the fallback without a C++ compiler.
    """
    env = init_distributed() if env is None else env
    if log_prob_micro_batch_size is not None and log_prob_micro_batch_size < 1:
        raise ValueError(f"log_prob_micro_batch_size must be >= 1, got {log_prob_micro_batch_size}")
    check_offload(env, param_offload, "reference param_offload=True")
    mesh = device_mesh(env) if mesh is None else mesh
    model = sharded_module(
        model_path,
        compute_dtype(fsdp_cfg, env.device),
        env,
        mesh,
        fsdp_cfg,
        param_dtype=None,
        trainable=False,
        param_offload=param_offload,
    )
    if compile:
        compile_layers(model)
    model.eval()
    return TrainState(
        module=model,
        optimizer=None,
        mesh=mesh,
        env=env,
        fsdp_cfg=fsdp_cfg,
        role="reference",
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
        module=actor.module,
        optimizer=None,
        mesh=actor.mesh,
        env=actor.env,
        fsdp_cfg=actor.fsdp_cfg,
        role="reference",
        log_prob_micro_batch_size=log_prob_micro_batch_size,
        adapter_disabled=True,
    )


# ------------------------------------------------------------------------------------- micro-batching


def _plan_micro_batches(
    batch: RolloutBatch | None, state: TrainState, micro_batch_size: int | None = None
) -> list[list[int]]:
    """This rank's micro-batch row groups under the state's FSDP config (``None``: no rows): by rows
    (``micro_batch_size``, else the config's), or under the config's token budget, agreed on by the
    ranks (:func:`backends.training.common.agreed_token_budget_groups`, a collective)."""
    cfg = state.fsdp_cfg
    if micro_batch_size is not None or cfg.max_tokens_per_micro_batch is None:
        size = micro_batch_size if micro_batch_size is not None else cfg.micro_batch_size
        return micro_batch_groups(batch, micro_batch_size=size) if batch is not None else []
    return agreed_token_budget_groups(
        batch,
        cfg.max_tokens_per_micro_batch,
        grouping=cfg.token_budget_grouping,
        group=state.dp_group,
        device=state.env.device,
    )


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
    check_batch(batch)
    cfg = state.fsdp_cfg
    groups = _plan_micro_batches(
        batch, state, micro_batch_size if micro_batch_size is not None else state.log_prob_micro_batch_size
    )
    n_max = all_reduce_max(len(groups), group=state.dp_group, device=state.env.device)
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
                mb = select_rows(batch, groups[i]) if real else dummy_micro_batch(select_rows(batch, groups[0]))
                if cfg.trim_padding:
                    mb = trim_micro_batch(mb)
                outputs = forward_micro_batch(
                    module,
                    to_device(mb, state.env.device),
                    with_entropy=with_entropy,
                    role=state.role,
                    packed=cfg.use_remove_padding,
                    share_prompts=cfg.share_prompts,
                    chunk_rows=chunk_rows(cfg, module),
                )
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
    # entropy is left as computed outside the mask; log-probs and values are zeroed there
    return {name: (x if name == "entropy" else torch.where(mask, x, zero)) for name, x in results.items()}


# ------------------------------------------------------------------------------------------- update


def update(
    state: TrainState,
    batch: RolloutBatch,
    loss_fn: LossFn,
    *,
    with_entropy: bool = False,
    skip_rows: Tensor | None = None,
) -> tuple[TrainState, dict[str, float]]:
    """One optimizer step on this rank's share of the global batch; returns ``(new_state, metrics)``.

    ``loss_fn(outputs, micro_batch, norms) -> (loss, metrics)`` gets the model outputs of one
    micro-batch (``entropy`` is filled when ``with_entropy``), the micro-batch itself and the global
    normalisers, and must return a scalar loss normalised by them (``rlfunc.aggregate(..., norms)``).

    Metrics (plain floats, equal on every rank): ``loss`` = the global-batch loss (sum of micro-batch
    losses over micro-batches and ranks), ``grad_norm`` (global, before clipping), ``lr`` (used by this
    step), ``update_skipped`` (1 for an empty batch or a non-finite loss / grad norm),
    ``nonfinite_updates_skipped`` (the running total of updates skipped for a non-finite value), ``num_tokens``,
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
    """
    if state.optimizer is None or state.optim_cfg is None or state.lr_schedule is None:
        raise ValueError(f"update() needs a trainable state with an optimizer; this is a {state.role!r} state")
    check_batch(batch)
    if state.role == "critic":
        check_critic_batch(batch, with_entropy)
    skip_rows = _checked_skip_rows(skip_rows, batch, state.fsdp_cfg)
    if state.fsdp_cfg.balance_dp:
        batch = balance_across_ranks(batch, state)
    counted = local_normalizers(loss_tokens(batch))  # every row counts in the normalisers, skipped or not
    mbs = _micro_batches_to_run(batch, skip_rows, state)
    norms, (num_tokens, num_seqs, n_max) = gather_counts(
        counted, len(mbs), group=state.dp_group, group_size=state.dp_size, device=state.env.device
    )
    lr = schedules.lr_at(state.lr_schedule, state.step)
    base = {"lr": lr, "num_tokens": num_tokens, "num_seqs": num_seqs, "num_micro_batches": float(n_max)}
    new_state = state.replace(step=state.step + 1)
    if num_tokens == 0:
        # Nothing to learn from. Stepping AdamW on zero gradients would still move the parameters
        # (momentum, weight decay), so the step is skipped outright.
        return nonfinite_policy(
            state, new_state, {"loss": 0.0, "grad_norm": 0.0, "update_skipped": 1.0, **base}, skipped=False
        )

    state.module.train()
    state.optimizer.zero_grad(set_to_none=True)
    sums = _forward_backward(state, mbs, n_max, loss_fn, norms, with_entropy=with_entropy, filler=batch)
    names, reduced = _mean_metrics(state, *sums)
    loss_value, metric_values, norm_value, skipped = _clip_and_step(state, reduced, lr, all_skipped=n_max == 0)
    out = {"loss": loss_value, "grad_norm": norm_value, "update_skipped": float(skipped), **base}
    out.update(zip(names, metric_values))
    return nonfinite_policy(state, new_state, out, skipped=skipped)  # skipped: the weights did not change


def _checked_skip_rows(skip_rows: Tensor | None, batch: RolloutBatch, cfg: FSDPConfig) -> Tensor | None:
    """``skip_rows`` as a ``(b,)`` bool tensor, or None when every row runs."""
    if skip_rows is None:
        return None
    skip_rows = torch.as_tensor(skip_rows, dtype=torch.bool)
    if skip_rows.shape != (batch_size(batch),):
        raise ValueError(f"skip_rows must be a ({batch_size(batch)},) bool tensor, got shape {tuple(skip_rows.shape)}")
    return None if cfg.balance_dp else skip_rows  # with balance_dp rows move between ranks: run every row


def _micro_batches_to_run(batch: RolloutBatch, skip_rows: Tensor | None, state: TrainState) -> list[RolloutBatch]:
    """This rank's micro-batches of the rows that are not skipped (possibly none)."""
    run: RolloutBatch | None = batch
    if skip_rows is not None:
        kept = (~skip_rows).nonzero().squeeze(-1).tolist()
        run = select_rows(batch, kept) if kept else None
    return [select_rows(run, g) for g in _plan_micro_batches(run, state)]


def _forward_backward(
    state: TrainState,
    mbs: list[RolloutBatch],
    n_max: int,
    loss_fn: LossFn,
    norms: Normalizers,
    *,
    with_entropy: bool,
    filler: RolloutBatch,
) -> tuple[Tensor, int, dict[str, Tensor]]:
    """Forward, ``loss_fn`` and backward of this rank's micro-batches, then zero-weight dummies (made
    from ``filler`` when the rank has none) up to ``n_max``. Gradients are reduced across ranks on the
    last micro-batch only. Returns the summed losses, the number of real micro-batches and the summed
    ``loss_fn`` metrics of the real ones."""
    cfg, module, device = state.fsdp_cfg, state.module, state.env.device
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    metric_sums: dict[str, Tensor] = {}
    for i in range(n_max):
        real = i < len(mbs)
        mb = mbs[i] if real else dummy_micro_batch(mbs[0] if mbs else filler)
        if cfg.trim_padding:
            mb = trim_micro_batch(mb)
        mb = to_device(mb, device)
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(i == n_max - 1)
        outputs = forward_micro_batch(
            module,
            mb,
            with_entropy=with_entropy,
            role=state.role,
            packed=cfg.use_remove_padding,
            share_prompts=cfg.share_prompts,
            chunk_rows=chunk_rows(cfg, module),
        )
        loss, metrics = loss_fn(outputs, mb, norms)
        loss, metrics = check_loss_output(loss, metrics)
        # FSDP averages gradients over ranks; the losses are already global-normalised, so undo the mean.
        (loss * (state.dp_size if real else 0.0)).backward()
        for name, value in metrics.items():  # names from every call (a rank may run dummies only)
            metric_sums.setdefault(name, torch.zeros((), dtype=torch.float32, device=device))
            if real:
                metric_sums[name] = metric_sums[name] + value.to(device).float()
        if real:
            loss_sum = loss_sum + loss.detach().float()
    return loss_sum, min(len(mbs), n_max), metric_sums


def _mean_metrics(
    state: TrainState, loss_sum: Tensor, n_real: int, metric_sums: dict[str, Tensor]
) -> tuple[list[str], Tensor]:
    """The metric names and, on the device, [global loss, each metric's mean over every rank's real
    micro-batches]: one all-reduce with the loss and the counts."""
    names = sorted(metric_sums)
    count = torch.tensor(float(n_real), device=loss_sum.device)
    packed = torch.stack([loss_sum, count] + [metric_sums[k] for k in names])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=state.dp_group)
    return names, torch.cat([packed[:1], packed[2:] / packed[1].clamp(min=1.0)])


def _clip_and_step(
    state: TrainState, reduced: Tensor, lr: float, *, all_skipped: bool
) -> tuple[float, list[float], float, bool]:
    """Global grad norm, clip and AdamW step, unless the loss or the norm is non-finite (then the
    gradients are dropped). Returns (loss, metric means, grad norm, skipped) from the one host sync."""
    module, optimizer = state.module, state.optimizer
    if all_skipped:  # every row of every rank skipped: the gradient is exactly zero, AdamW still steps
        for p in module.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    params = [p for p in module.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if isinstance(grad_norm, DTensor):  # a Partial (per-shard) norm: reduce it to the global one
        grad_norm = grad_norm.full_tensor()
    # with offload the gradients, and so their norm, live in host memory
    host = torch.cat([reduced, grad_norm.reshape(1).float().to(reduced.device)]).tolist()  # the one metrics sync
    loss_value, metric_values, norm_value = host[0], host[1:-1], host[-1]
    skipped = not (math.isfinite(norm_value) and math.isfinite(loss_value))
    if not skipped:
        if state.optim_cfg.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(params, state.optim_cfg.clip_grad, grad_norm)
        set_lr(optimizer, lr)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_value, metric_values, norm_value, skipped


def chunk_rows(cfg: FSDPConfig, module: nn.Module) -> int | None:
    """Logit rows per chunk of the log-prob / entropy pass for ``module``'s vocabulary (None: unchunked, or a
    model without a ``config.vocab_size``)."""
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    return chunk_rows_for(cfg.logits_chunk_mib, vocab) if isinstance(vocab, int) and vocab > 0 else None

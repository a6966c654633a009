"""The megatron engine's update: ``state, metrics = update(state, batch, loss_fn, with_entropy=...)``.

One update on CPU (torchtitan-style, explicit):

1. split the rank's rows into micro-batches; all-gather the loss-token / sequence counts over the
   data-parallel group: the global :class:`rlfunc.Normalizers` (one host sync);
2. per micro-batch, through the stages (:func:`backends.training.megatron.pipeline.run_micro_batch`): the last
   stage turns its vocab-parallel logits into log-probs / entropy without gathering the vocabulary
   (:mod:`backends.training.megatron.vocab_parallel`) or reads the value head, calls ``loss_fn``, backward;
3. sum the two copies' gradients of a tied embedding split across stages; sum gradients over
   data-parallel replicas (each loss is already normalised by the global counts, so the sum is the
   gradient of the global-batch loss);
4. global grad norm (TP shards and pipeline stages summed, replicated tensors counted once), clip,
   AdamW (:mod:`backends.training.optim`) at the rlfunc LR schedule's ``lr_at(step)``.

On a GPU (``MegatronConfig.schedule="auto"`` with CUDA) step 2 is megatron's own
``get_forward_backward_func`` schedule over a megatron ``DistributedDataParallel`` module and step 4
megatron's ``DistributedOptimizer`` built from
:class:`~backends.training.megatron.engine.MegatronOptimConfig` (verl's
``optim/megatron.yaml`` fields); the LR is still rlfunc's schedule, written into its param groups.

Defined behaviour matches the FSDP engine: an empty batch or a non-finite loss / grad norm skips the optimizer step and
drops the gradients (``update_skipped = 1``, ``step`` advances; ``optim.nonfinite=error``: raises; every rank agrees, on
the GPU schedule too, where megatron's optimizer alone would step on NaN gradients in bf16 / fp32); a row with an empty
prompt raises.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from backends.training.common import (
    LossFn,
    check_batch,
    check_critic_batch,
    check_loss_output,
    gather_counts,
    micro_batches,
    nonfinite_policy,
    to_device,
    trim_micro_batch,
)
from backends.training.megatron.convert import param_maps
from backends.training.megatron.engine import MegatronState, head_outputs
from backends.training.megatron.layout import layout_micro_batch
from backends.training.megatron.parallel import ParallelDims
from backends.training.megatron.pipeline import megatron_forward_backward, run_micro_batch
from backends.training.optim import set_lr
from rlfunc import schedules
from rlfunc.aggregation import local_normalizers
from rlfunc.batch import RolloutBatch, loss_tokens

__all__ = ["update"]


def _tied_across_stages(state: MegatronState) -> bool:
    """A tied embedding whose two copies (first and last stage) the CPU path keeps in sync itself."""
    return state.shape.tie_word_embeddings and state.dims.pp > 1 and state.role != "critic"


def _sync_grads(state: MegatronState) -> None:
    """Sum the tied embedding's two gradient copies (first and last stage) and sum over replicas."""
    from megatron.core import parallel_state as ps

    dims, params = state.dims, dict(state.module.named_parameters())
    if _tied_across_stages(state) and (dims.first_stage or dims.last_stage):
        name = "embedding.word_embeddings.weight" if dims.first_stage else "output_layer.weight"
        p = params[name]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=ps.get_embedding_group())
    if dims.dp > 1:
        for p in params.values():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=dims.dp_group)


def _grad_norm(state: MegatronState) -> Tensor:
    """Global L2 norm: TP shards and stages summed, TP-replicated tensors once, a tied copy once."""
    dims = state.dims
    sharded = {
        m.megatron
        for m in param_maps(state.shape, dims.pp, value_head=state.role == "critic")
        if m.stage == dims.pp_rank and m.tp_axis is not None
    }
    total = torch.zeros((), dtype=torch.float32, device=state.env.device)
    for name, p in state.module.named_parameters():
        if p.grad is None:
            continue
        if name == "output_layer.weight" and _tied_across_stages(state):
            continue  # the same tensor as the first stage's embedding
        if name in sharded or dims.tp_rank == 0:
            total = total + p.grad.float().pow(2).sum()
    if dims.tp * dims.pp > 1:
        dist.all_reduce(total, group=dims.model_parallel_group)
    return total.sqrt()


def update(
    state: MegatronState,
    batch: RolloutBatch,
    loss_fn: LossFn,
    *,
    with_entropy: bool = False,
    skip_rows: Tensor | None = None,
) -> tuple[MegatronState, dict[str, float]]:
    """One optimizer step on this replica's share of the global batch; returns ``(new_state, metrics)``.

    The contract of :func:`backends.training.fsdp.update`: the same metrics (``loss``, ``grad_norm``,
    ``lr``, ``update_skipped``, ``num_tokens``, ``num_seqs``, ``num_micro_batches`` and the loss's own,
    averaged over micro-batches then replicas), plain floats equal on every rank. ``skip_rows`` is
    accepted for the same signature and not used: every row runs (rows with an exactly zero loss and
    gradient, which is what the FSDP engine skips, do not change the result).
    """
    del skip_rows
    if state.optimizer is None or state.optim_cfg is None or state.lr_schedule is None:
        raise ValueError(f"update() needs a trainable state with an optimizer; this is a {state.role!r} state")
    check_batch(batch)
    if state.role == "critic":
        check_critic_batch(batch, with_entropy)
    cfg = state.cfg
    mbs = micro_batches(batch, micro_batch_size=cfg.micro_batch_size, max_tokens=cfg.max_tokens_per_micro_batch)
    norms, (num_tokens, num_seqs, n_max) = gather_counts(
        local_normalizers(loss_tokens(batch)),
        len(mbs),
        group=state.dp_group,
        group_size=state.dp_size,
        device=state.env.device,
    )
    if cfg.trim_padding:
        mbs = [trim_micro_batch(mb) for mb in mbs]
    mbs = [to_device(mb, state.env.device) for mb in mbs]
    lr = schedules.lr_at(state.lr_schedule, state.step)
    base = {"lr": lr, "num_tokens": num_tokens, "num_seqs": num_seqs, "num_micro_batches": float(n_max)}
    new_state = state.replace(step=state.step + 1)
    if num_tokens == 0:
        return nonfinite_policy(
            state, new_state, {"loss": 0.0, "grad_norm": 0.0, "update_skipped": 1.0, **base}, skipped=False
        )
    step = _update_megatron if state.uses_megatron_schedule else _update_cpu
    out = step(state, mbs, norms, loss_fn, with_entropy, lr)  # skipped: the weights did not change
    return nonfinite_policy(state, new_state, {**base, **out}, skipped=bool(out["update_skipped"]))


def _update_cpu(
    state: MegatronState, mbs: list[RolloutBatch], norms: Any, loss_fn: LossFn, with_entropy: bool, lr: float
) -> dict[str, float]:
    """CPU: the gloo pipeline per micro-batch, gradients summed here (tied copies, replicas), AdamW."""
    cfg = state.cfg
    module, optimizer, dims = state.module, state.optimizer, state.dims
    module.train()
    optimizer.zero_grad(set_to_none=True)
    dtype = next(module.parameters()).dtype
    loss_sum = torch.zeros((), dtype=torch.float32, device=state.env.device)
    metric_sums: dict[str, Tensor] = {}
    for mb in mbs:
        inp = layout_micro_batch(mb, cfg.layout)

        def head(out: Tensor, mb=mb, inp=inp):
            outputs = head_outputs(state, out, inp, mb, with_entropy)
            return check_loss_output(*loss_fn(outputs, mb, norms))

        got = run_micro_batch(module, dims, inp, head, hidden_size=state.shape.hidden_size, dtype=dtype, backward=True)
        if got is not None:
            loss, metrics = got
            loss_sum = loss_sum + loss.detach().float()
            for name, value in metrics.items():
                metric_sums[name] = metric_sums.get(name, 0.0) + value
    _sync_grads(state)

    host: dict[str, float] | None = None
    if dims.last_stage:
        names = sorted(metric_sums)
        packed = torch.stack([loss_sum] + [metric_sums[k] / max(len(mbs), 1) / dims.dp for k in names])
        if dims.dp > 1:
            dist.all_reduce(packed, group=dims.dp_group)
        host = dict(zip(["loss", *names], packed.tolist()))
    if dims.pp > 1:
        box = [host]
        dist.broadcast_object_list(box, src=dims.last_stage_rank, group=dims.pp_group)
        host = box[0]
    grad_norm = _grad_norm(state)
    norm_value = float(grad_norm)
    loss_value = host.pop("loss")
    skipped = _nonfinite_on_any_rank((loss_value, norm_value), dims, state.env.device)
    if not skipped:
        params = [p for p in module.parameters() if p.grad is not None]
        if state.optim_cfg.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(params, state.optim_cfg.clip_grad, grad_norm)
        set_lr(optimizer, lr)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss_value, "grad_norm": norm_value, "update_skipped": float(skipped), **host}


def _nonfinite_on_any_rank(values: tuple[float, ...], dims: ParallelDims, device: torch.device) -> bool:
    """Whether ``values`` (the loss, the grad norm) are non-finite on any rank of the layout: one flag,
    all-reduced (MAX) over the replica's tensor x pipeline ranks, then over the data-parallel replicas.
    Every rank takes the same skip-or-step decision, so none steps alone (its peers would wait in the
    optimizer's parameter all-gather, or the replicas would drift apart)."""
    flag = torch.tensor([0.0 if all(math.isfinite(v) for v in values) else 1.0], device=device)
    for group, size in ((dims.model_parallel_group, dims.tp * dims.pp), (dims.dp_group, dims.dp)):
        if size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _update_megatron(
    state: MegatronState, mbs: list[RolloutBatch], norms: Any, loss_fn: LossFn, with_entropy: bool, lr: float
) -> dict[str, float]:
    """GPU: megatron's schedule (DDP grads reduced by its finalize step) and its optimizer.

    The optimizer step is megatron's own ``step()`` taken apart (``prepare_grads``, clip,
    ``step_with_ready_grads``) with the FSDP engine's check in between: megatron looks for inf / NaN
    only with a loss scaler (fp16 or a set ``loss_scale``), so in bf16 or fp32 it would step on NaN
    gradients (its clipping compares with NaN and leaves them as they are)."""
    module, optimizer, dims = state.module, state.optimizer, state.dims
    inputs = [layout_micro_batch(mb, state.cfg.layout) for mb in mbs]
    module.train()
    module.zero_grad_buffer()
    optimizer.zero_grad()

    def head(out: Tensor, i: int):
        outputs = head_outputs(state, out, inputs[i], mbs[i], with_entropy)
        loss, metrics = check_loss_output(*loss_fn(outputs, mbs[i], norms))
        return loss, {"loss": loss.detach(), **metrics}

    extras = megatron_forward_backward(
        module,
        inputs,
        head,
        seq_length=max(x.input_ids.shape[1] for x in inputs),
        micro_batch_size=max(x.input_ids.shape[0] for x in inputs),
        forward_only=False,
        loss_scale=float(len(inputs) * dims.dp),
    )
    host: dict[str, float] | None = None
    if dims.last_stage:
        names = sorted(k for k in extras[0] if k != "loss")
        packed = torch.stack(
            [sum(e["loss"] for e in extras)] + [sum(e[k] for e in extras) / len(extras) / dims.dp for k in names]
        )
        dist.all_reduce(packed, group=dims.dp_group)
        host = dict(zip(["loss", *names], packed.tolist()))
    box = [host]
    dist.broadcast_object_list(box, src=dims.last_stage_rank, group=dims.pp_group)
    host = box[0]
    loss_value = host.pop("loss")
    found_inf = optimizer.prepare_grads()  # the reduced DDP grads -> the optimizer's main grads
    norm_value = float("nan") if found_inf else float(optimizer.get_grad_norm())  # global, before clipping
    skipped = _nonfinite_on_any_rank((loss_value, norm_value), dims, state.env.device)
    if skipped:  # as the FSDP engine: no step, the gradients dropped; ``step`` still advances (update())
        optimizer.zero_grad()
        module.zero_grad_buffer()
    else:
        if state.optim_cfg.clip_grad > 0:
            optimizer.clip_grad_norm(state.optim_cfg.clip_grad)
        set_lr(optimizer, lr)
        skipped = not optimizer.step_with_ready_grads()
    return {"loss": loss_value, "grad_norm": norm_value, "update_skipped": float(skipped), **host}

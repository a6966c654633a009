"""What the training engines share: the loss contract, batch checks, micro-batches and global counts.

The FSDP engine (:mod:`backends.training.fsdp`), the megatron engine
(:mod:`backends.training.megatron.engine`) and the reward model (:mod:`backends.training.reward_model`)
take the same :class:`rlfunc.batch.RolloutBatch` and give losses the same contract, so these pieces
have one home here.

**Loss contract.** ``loss_fn(outputs, micro_batch, norms) -> (loss, metrics)`` (:data:`LossFn`) gets
the :class:`ModelOutputs` of one micro-batch, the micro-batch itself and the **global**
:class:`rlfunc.Normalizers`; it returns a scalar loss normalised by them (``rlfunc.aggregate(...,
norms)``) and a dict of scalar metrics whose names do not clash with the engine's own
(:func:`check_loss_output`). Because every micro-batch loss is divided by the global counts, the sum
of all micro-batch losses over all ranks *is* the global-batch loss.

**Micro-batches.** A rank's rows are split by row count or by a token budget (prompt + response
tokens), filled in row order or balanced (:func:`micro_batch_groups`). Each micro-batch may drop its
all-padding prompt columns and the response columns after its last loss token
(:func:`trim_micro_batch`). A rank with fewer micro-batches than its peers runs zero-weight dummy ones
(:func:`dummy_micro_batch`) so that the collectives inside the forward and backward line up.

**Global counts.** The loss tokens / sequences of every rank's batch, summed: :func:`gather_counts`
(one all-gather, one host sync, which also tells every rank the largest micro-batch count) and
:func:`global_normalizers` (an all-reduce, kept on the device).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from rlfunc.aggregation import Normalizers, local_normalizers
from rlfunc.balancing import token_budget_balanced_partition
from rlfunc.batch import RolloutBatch, batch_size, loss_tokens, select, token_budget_partitions, validate
from rlfunc.tree import pytree_dataclass, tree_map

__all__ = [
    "ModelOutputs",
    "LossFn",
    "ENGINE_METRICS",
    "NonFiniteUpdateError",
    "nonfinite_policy",
    "check_batch",
    "check_critic_batch",
    "check_loss_output",
    "row_tokens",
    "micro_batch_groups",
    "micro_batches",
    "all_reduce_max",
    "agreed_token_budget_groups",
    "select_rows",
    "trim_micro_batch",
    "dummy_micro_batch",
    "to_device",
    "global_normalizers",
    "gather_counts",
    "value_loss_fn",
]


# ------------------------------------------------------------------------------------- the contract


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

#: the metrics every engine's ``update`` reports itself; a ``loss_fn`` metric may not reuse these names
ENGINE_METRICS = (
    "loss",
    "grad_norm",
    "lr",
    "update_skipped",
    "nonfinite_updates_skipped",
    "num_tokens",
    "num_seqs",
    "num_micro_batches",
)


class NonFiniteUpdateError(FloatingPointError):
    """A non-finite loss or gradient norm under ``optim.nonfinite=error`` (raised before the optimizer step)."""


def nonfinite_policy(state: Any, new_state: Any, metrics: dict, *, skipped: bool) -> tuple[Any, dict]:
    """An update's ``(new_state, metrics)`` after the ``optim.nonfinite`` policy: ``skipped`` says the engine
    skipped the optimizer step for a non-finite loss / grad norm (every rank's agreed decision; the weights
    did not change). ``skip``: count it in ``nonfinite_updates_skipped`` (a running total in the state and
    the metrics); ``error``: raise :class:`NonFiniteUpdateError`, naming the update and the values."""
    if skipped and state.optim_cfg.nonfinite == "error":
        raise_nonfinite(metrics["loss"], metrics["grad_norm"], step=state.step, role=state.role)
    total = state.nonfinite_updates_skipped + int(skipped)
    return new_state.replace(nonfinite_updates_skipped=total), {**metrics, "nonfinite_updates_skipped": float(total)}


def raise_nonfinite(loss: float, grad_norm: float, *, step: int, role: str) -> None:
    which = [name for name, v in (("loss", loss), ("grad norm", grad_norm)) if not math.isfinite(v)] or [
        "loss or grad norm on another rank"
    ]
    raise NonFiniteUpdateError(
        f"{role} update {step} (the engine's optimizer-step count, from 0): non-finite {' and '.join(which)} "
        f"(loss={loss}, grad_norm={grad_norm}); optim.nonfinite=error stops here, before the optimizer step, "
        f"so the weights are unchanged (optim.nonfinite=skip skips the update and counts it instead)"
    )


def check_batch(batch: RolloutBatch) -> None:
    """A valid batch with at least one row, and a prompt token in every row (the first response
    token would have no context otherwise)."""
    validate(batch)
    if batch_size(batch) == 0:
        raise ValueError("the batch has no rows")
    has_prompt = batch.prompt_mask.any(dim=-1)
    if not bool(has_prompt.all()):
        row = int((~has_prompt).nonzero()[0])
        raise ValueError(
            f"row {row} has an empty prompt (prompt_mask all false): the model needs at least one prompt token"
        )


def check_critic_batch(batch: RolloutBatch, with_entropy: bool) -> None:
    """A critic update needs the value targets and the values at collection time, and has no entropy."""
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


def check_loss_output(loss: Any, metrics: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """A scalar tensor loss and a dict of scalar metrics whose names do not clash with the engine's."""
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar tensor loss, got {shape}")
    checked = {}
    for name, value in dict(metrics).items():
        if name in ENGINE_METRICS:
            raise ValueError(
                f"loss_fn metric name {name!r} clashes with an engine metric ({', '.join(ENGINE_METRICS)})"
            )
        value = torch.as_tensor(value)
        if value.numel() != 1:
            raise ValueError(f"loss_fn metric {name!r} must be a scalar, got shape {tuple(value.shape)}")
        checked[name] = value.detach().reshape(()).to(torch.float32)
    return loss.reshape(()), checked


# ---------------------------------------------------------------------------------- micro-batches


def row_tokens(batch: RolloutBatch) -> list[int]:
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
            return token_budget_balanced_partition(row_tokens(batch), max_tokens, min_parts=min_parts)
        if grouping != "sequential":
            raise ValueError(f"grouping must be 'sequential' or 'balanced', got {grouping!r}")
        return token_budget_partitions(torch.tensor(row_tokens(batch)), max_tokens)
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
    return [select_rows(batch, g) for g in groups]


def all_reduce_max(n: int, *, group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The largest ``n`` over the ranks of ``group``."""
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


_PLAN_FAILED = 2**40  # a micro-batch count no rank reaches: "my rows do not fit the token budget"


def agreed_token_budget_groups(
    batch: RolloutBatch | None,
    max_tokens: int,
    *,
    grouping: str,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> list[list[int]]:
    """This rank's micro-batch row groups under a token budget (``batch=None``: no rows), a collective.

    The ranks first agree (one small all-reduce): on a micro-batch count, so that under balanced
    grouping no rank runs dummy micro-batches unless its rows cannot be spread that far; and on
    failure, so that a row too long for the budget on one rank raises on every rank instead of leaving
    the others waiting in the next collective."""
    mine, error = [], None
    if batch is not None:
        try:
            mine = micro_batch_groups(batch, max_tokens=max_tokens, grouping=grouping)
        except ValueError as e:
            mine, error = None, e
    agreed = all_reduce_max(len(mine) if mine is not None else _PLAN_FAILED, group=group, device=device)
    if agreed >= _PLAN_FAILED:
        if error is not None:
            raise error
        raise ValueError(f"a row on another data-parallel rank does not fit max_tokens_per_micro_batch={max_tokens}")
    if grouping == "balanced" and batch is not None:
        return micro_batch_groups(batch, max_tokens=max_tokens, grouping="balanced", min_parts=agreed)
    return mine


def select_rows(batch: RolloutBatch, rows: list[int]) -> RolloutBatch:
    """Rows of a micro-batch: a slice (a view, no copy) when they are consecutive."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return select(batch, slice(rows[0], rows[0] + len(rows)))
    return select(batch, rows)


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


def trim_micro_batch(mb: RolloutBatch) -> RolloutBatch:
    """Drop all-padding prompt columns on the left and response columns after the last loss token."""
    first_prompt = int(mb.prompt_mask.any(0).int().argmax())
    has_loss = mb.response_mask.any(0)
    last_resp = int(has_loss.numel() - 1 - has_loss.flip(0).int().argmax()) if bool(has_loss.any()) else 0
    return _slice_dims(_slice_dims(mb, "p", slice(first_prompt, None)), "t", slice(0, last_resp + 1))


def dummy_micro_batch(mb: RolloutBatch) -> RolloutBatch:
    """One row with no loss tokens: run by a rank with fewer micro-batches than the others so that
    every rank issues the same collectives (FSDP all-gathers and reduce-scatters). Its loss is also
    weighted by 0."""
    row = select(mb, slice(0, 1))
    no_loss = torch.zeros_like(row.response_mask)
    return row.replace(response_mask=no_loss, loss_mask=None if row.loss_mask is None else no_loss)


def to_device(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    """Every tensor of the batch on ``device`` (non-blocking copies)."""
    return tree_map(lambda x: x.to(device, non_blocking=True) if isinstance(x, Tensor) else x, batch)


# ---------------------------------------------------------------------------------- global counts


def global_normalizers(mbs: list[RolloutBatch], group: dist.ProcessGroup | None = None) -> Normalizers:
    """Sum of ``local_normalizers(loss_tokens(mb))`` over micro-batches, all-reduced (SUM) over ``group``."""
    norms = [local_normalizers(loss_tokens(mb)) for mb in mbs]
    total = norms[0]
    for n in norms[1:]:
        total = total + n
    packed = torch.stack([total.num_tokens, total.num_seqs])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return Normalizers(num_tokens=packed[0], num_seqs=packed[1])


def gather_counts(
    local: Normalizers,
    num_micro_batches: int,
    *,
    group: dist.ProcessGroup | None,
    group_size: int,
    device: torch.device,
) -> tuple[Normalizers, tuple[float, float, int]]:
    """Global normalisers (on ``device``) from this rank's ``local`` counts and, on the host,
    (num_tokens, num_seqs, largest micro-batch count over the ``group_size`` ranks of ``group``): one
    all-gather and one host sync."""
    mine = torch.stack(
        [
            local.num_tokens.to(device, torch.float64),
            local.num_seqs.to(device, torch.float64),
            torch.tensor(float(num_micro_batches), dtype=torch.float64, device=device),
        ]
    )
    everyone = [torch.empty_like(mine) for _ in range(group_size)]
    dist.all_gather(everyone, mine, group=group)
    table = torch.stack(everyone).cpu()
    norms = Normalizers(
        num_tokens=table[:, 0].sum().to(device, torch.float32), num_seqs=table[:, 1].sum().to(device, torch.float32)
    )
    return norms, (float(table[:, 0].sum()), float(table[:, 1].sum()), int(table[:, 2].max()))


# ------------------------------------------------------------------------------------ critic loss


def value_loss_fn(*, clip_range: float | None = 0.5, agg: str = "token-mean", horizon: int | None = None) -> LossFn:
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
            outputs.values,
            old_values=mb.old_values,
            returns=mb.returns,
            response_mask=loss_tokens(mb),
            clip_range=clip_range,
            agg=agg,
            norms=norms,
            horizon=horizon,
        )

    return loss_fn

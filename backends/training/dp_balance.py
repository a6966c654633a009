"""Data-parallel rebalancing: the global batch redistributed over the ranks by token count.

An update's gradient depends only on the union of the rows over the ranks (every loss is divided by
the global counts), so rows may move between ranks freely; moving them so that every rank holds
near-equal tokens evens out the ranks' forward/backward time (FSDPConfig.balance_dp).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from backends.distributed.placement import pad_to
from backends.training.common import row_tokens
from rlfunc.balancing import balanced_partition
from rlfunc.batch import RolloutBatch, select

__all__ = ["balance_across_ranks"]


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    """``x`` with zero rows appended up to ``rows`` (all-gather needs equal shapes on every rank)."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def balance_across_ranks(batch: RolloutBatch, state: Any) -> RolloutBatch:
    """Redistribute the global batch over the data-parallel ranks by token count (a collective).

    ``state``: an engine state with ``dp_size``, ``dp_group`` and ``env.device`` (a TrainState).
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
    widths = {"p": p_max, "t": t_max}

    def gather(x: Tensor, dims: tuple[str, ...]) -> Tensor:
        x = x.to(dev)
        is_bool = x.dtype == torch.bool
        if is_bool:  # gloo has no bool collectives
            x = x.to(torch.uint8)
        x = pad_to(_pad_rows(x, n_max), dims, widths)  # prompts padded on the left, responses on the right
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        full = torch.cat([part[: row[0]] for part, row in zip(parts, table)])
        return (full.bool() if is_bool else full).to(home)

    changes = {}
    for f in attrs.fields(type(batch)):
        value = getattr(batch, f.name)
        if value is not None:
            changes[f.name] = gather(value, tuple((f.metadata.get("shape") or "").split()))
    everyone = batch.replace(**changes)
    total = sum(row[0] for row in table)
    parts = balanced_partition(row_tokens(everyone), world, equal_size=total % world == 0)
    return select(everyone, parts[dist.get_rank(group)])

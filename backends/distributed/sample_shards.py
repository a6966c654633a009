"""Sampling a step's prompts on every rank once: the shards of a replica's prompts over its model-parallel ranks.

A data-parallel trainer (FSDP) gives each rank its own prompts. A megatron replica spans ``m = tp x pp`` ranks
that must train on the same rows; sampling the replica's whole share on each of them (then keeping one copy)
repeats the rollout ``m`` times (8 times at TP4 x PP2 on 8 GPUs). Instead each rank of the replica samples one
shard of the replica's prompts and the replica gathers the shards:

- shard ``dp_rank x m + j`` of ``dp x m`` for the replica's ``j``-th rank (:func:`sampling_shard`): every rank
  of the world samples what a data-parallel run on as many ranks samples on that rank (its prompts, its seed);
- :func:`gather_shards`: the replica's ranks exchange their scored shards, so each holds the same batch, the shards
  in the replica's rank order, the group ids of shard ``j`` shifted past those of the shards before it.

With ``m = 1`` (FSDP, or megatron at TP = PP = 1) both are the identity: the samples are those of before.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_map

from backends.distributed.placement import concat_padded

__all__ = ["sampling_shard", "gather_shards"]


def sampling_shard(dp_rank: int, dp_size: int, group: Any) -> tuple[int, int]:
    """``(shard, shards)`` of the step's prompts this rank samples: replica ``dp_rank`` of ``dp_size`` splits its share
    over the ranks of ``group`` (its model-parallel ranks; None: a replica of one rank)."""
    size = 1 if group is None else dist.get_world_size(group)
    mine = 0 if group is None else dist.get_rank(group)
    return dp_rank * size + mine, dp_size * size


def gather_shards(batch: Any, rows: Sequence[Any], group: Any) -> tuple[Any, list]:
    """The replica's batch and the example of each row from every rank of ``group``'s ``(batch, rows)``: rows in the
    group's rank order, prompts / responses padded to the widest, group ids made distinct (shard ``j``'s shifted by
    the groups of the shards before it). Tensors travel through host memory and come back on ``batch``'s device.
    A collective of ``group``; None or one rank: returned as given."""
    if group is None or dist.get_world_size(group) == 1:
        return batch, list(rows)
    device = batch.response_ids.device
    to_cpu = tree_map(lambda x: x.cpu() if isinstance(x, Tensor) else x, batch)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (to_cpu, list(rows)), group=group)
    shards, offset = [], 0
    for shard, _ in gathered:
        shards.append(shard.replace(group_ids=shard.group_ids + offset))
        offset += int(shard.group_ids.max()) + 1 if shard.group_ids.numel() else 0
    whole = concat_padded(shards)
    whole = tree_map(lambda x: x.to(device) if isinstance(x, Tensor) else x, whole)
    return whole, [r for _, shard_rows in gathered for r in shard_rows]

"""Collectives that work the same with or without a process group: this process's rank and the world size,
sums, maxima and broadcasts over all ranks, the global masked whitening of advantages, and the group of the
ranks that hold a train state.

Without a process group (or at world size 1) each one is the identity on this process, so a recipe's code
path is the same for one process and for many.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "world_rank",
    "world_size",
    "state_ranks",
    "all_reduce_sum",
    "all_reduce_max",
    "sum_and_max",
    "mean_over_ranks",
    "global_masked_whiten",
    "broadcast_object",
    "barrier",
]


def world_rank() -> int:
    """This process's rank in the default process group; 0 without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def world_size() -> int:
    """The number of ranks in the default process group; 1 without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def state_ranks(state: Any) -> tuple[Any, int, int]:
    """``(group, rank, size)`` of the ranks that hold ``state``: its mesh's process group (a role's pool
    under split placement, the world when colocated), this process's rank in it and their count. With
    no mesh: ``(None, world rank, world size)``; without a process group: ``(None, 0, 1)``."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 0, 1
    mesh = getattr(state, "mesh", None)
    group = mesh.get_group() if mesh is not None else None
    return group, dist.get_rank(group), dist.get_world_size(group)


def all_reduce_sum(tensor: Tensor, group: Any = None) -> Tensor:
    """Sum of ``tensor`` over all ranks (or those of ``group``), as a new tensor (the input is left unchanged)."""
    out = tensor.clone()
    if world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def all_reduce_max(tensor: Tensor, group: Any = None) -> Tensor:
    """Elementwise max of ``tensor`` over all ranks (or those of ``group``), as a new tensor."""
    out = tensor.clone()
    if world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def sum_and_max(sums: Tensor, maxima: Tensor, group: Any = None) -> tuple[Tensor, Tensor]:
    """``(all_reduce_sum(sums), all_reduce_max(maxima))`` of 1-d tensors in one collective: each rank's maxima go to
    its own row of a ``(ranks, len(maxima))`` block that the sum fills in (a zero plus a number is that number
    exactly), and the rows' max is taken here."""
    if world_size() == 1:
        return sums.clone(), maxima.clone()
    ranks = dist.get_world_size(group)
    block = maxima.new_zeros(ranks, maxima.numel())
    block[dist.get_rank(group)] = maxima
    out = torch.cat([sums.to(maxima.dtype), block.flatten()])
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out[: sums.numel()].to(sums.dtype), out[sums.numel() :].view(ranks, -1).amax(0)


def mean_over_ranks(metrics: dict[str, float], group: Any = None) -> dict[str, float]:
    """Each metric averaged over the ranks (of ``group``) that have it (one small object all-gather)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return metrics
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, metrics, group=group)
    keys = dict.fromkeys(k for m in every for k in m)
    return {k: sum(m[k] for m in every if k in m) / sum(k in m for m in every) for k in keys}


def global_masked_whiten(
    x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8, group: Any = None
) -> Tensor:
    """``rlfunc.masked_whiten`` with the mean and variance of the masked entries on *all* ranks (of ``group``).

    verl whitens advantages over the whole batch; with the batch split over data-parallel ranks that
    needs two small all-reduces (count and sum for the mean, then the centred sum of squares). Equal
    to whitening the concatenated batch; equal to the local version at world size 1.
    """
    from rlfunc import masked_moments, masked_whiten

    first = all_reduce_sum(masked_moments(x, mask), group)
    count, total = first[0], first[1]
    mean = total / count.clamp(min=1)
    centred_sq = all_reduce_sum(masked_moments(x, mask, center=mean), group)[2]
    var = torch.where(count > 1, centred_sq / (count - 1).clamp(min=1), torch.zeros_like(centred_sq))
    return masked_whiten(x, mask, shift_mean=shift_mean, eps=eps, stats=(mean, var))


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` (any picklable value) on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    """Wait until every rank gets here (nothing to wait for at world size 1)."""
    if world_size() > 1:
        dist.barrier()

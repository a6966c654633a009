"""The small collectives a checkpoint save or load runs between its ranks, over a gloo side-group.

Why a group of the checkpoint's own rather than the default group (and the helpers of
``backends.distributed.collectives``): an async save writes its shards from a background thread and runs
DCP's collectives there, so they must not share a group with the training's collectives, which keep
running on the default group meanwhile (two threads issuing collectives on one group can pair up the
wrong calls). And the values exchanged here (a temp-dir token, flags, JSON) are CPU tensors or objects,
which need gloo even when the default group is NCCL. Every rank creates the side-group at the same
point (``new_group`` is collective), once per default group.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist

from backends.distributed.collectives import world_size

__all__ = [
    "gloo_group",
    "gloo_barrier",
    "broadcast_hex",
    "all_ok",
    "all_state_meta",
    "all_merged",
    "first_message",
    "quiet_no_dist",
]

#: [the default group the side-group was made for, the side-group]; made again when the default group is
#: another one (a process that destroyed its group and made a new one)
_SIDE_GROUP: list[Any] = [None, None]


def gloo_group() -> Any:
    """A gloo group over all ranks for the checkpoint's CPU collectives and async DCP saves (created once
    per default group; a collective the first time)."""
    default = dist.distributed_c10d._get_default_group()
    if _SIDE_GROUP[0] is not default:
        _SIDE_GROUP[:] = [default, dist.new_group(backend="gloo")]
    return _SIDE_GROUP[1]


def gloo_barrier() -> None:
    """Wait for every rank, over the side-group (nothing to wait for at world size 1)."""
    if world_size() > 1:
        dist.barrier(group=gloo_group())


def broadcast_hex(value: str) -> str:
    """Rank 0's 32-hex-digit string on every rank (sent as bytes in a tensor: no pickling)."""
    if world_size() == 1:
        return value
    buf = torch.tensor(list(bytes.fromhex(value)) if value else [0] * 16, dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=gloo_group())
    return bytes(buf.tolist()).hex()


def all_ok(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank."""
    if world_size() == 1:
        return ok
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(flag, group=gloo_group())
    return int(flag) == 0


def all_state_meta(state_meta: dict[str, Any]) -> dict[str, Any]:
    """Every rank's ``{state name: metadata}`` merged, in rank order (a state held by several ranks is
    described alike by each). Under split placement a rank holds only its pool's states, and rank 0
    writes the marker for all of them."""
    return all_merged(state_meta)


def all_merged(values: dict[str, Any]) -> dict[str, Any]:
    """Every rank's JSON-able dict merged, in rank order (the first rank's value wins for a key several hold)."""
    world = world_size()
    if world == 1:
        return values
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, json.dumps(values), group=gloo_group())
    merged: dict[str, Any] = {}
    for text in gathered:
        for name, value in json.loads(text).items():
            merged.setdefault(name, value)
    return merged


def first_message(message: str | None) -> str | None:
    """The first rank's non-None ``message``, on every rank (None when no rank has one)."""
    if world_size() == 1:
        return message
    gathered = all_merged({} if message is None else {"message": message})
    return gathered.get("message")


@contextlib.contextmanager
def quiet_no_dist() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save in a single process" (that is the intent here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield

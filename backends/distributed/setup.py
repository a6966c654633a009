"""Process-group setup for torchrun (or a plain ``python`` process), device meshes, logging, seeding.
The collectives over the group are in :mod:`backends.distributed.collectives`.

One code path for CPU and GPU: gloo when CUDA is not available, NCCL (plus gloo for CPU tensors) when
it is. :func:`init_distributed` reads the torchrun environment; without one it still creates a
one-process group, so FSDP and collectives work unchanged at world size 1.
"""

from __future__ import annotations

import logging
import os
import random
import sys
from datetime import timedelta
from typing import Any, Sequence, TextIO

import attrs
import torch
import torch.distributed as dist

# The collectives live in backends.distributed.collectives; they are re-imported here so the names recipes
# and engines import from this module keep working (tests/test_distributed_setup.py holds it to that).
from backends.distributed.collectives import (  # noqa: F401 - re-exported
    all_reduce_max,
    all_reduce_sum,
    barrier,
    broadcast_object,
    global_masked_whiten,
    mean_over_ranks,
    state_ranks,
    sum_and_max,
    world_rank,
    world_size,
)
from backends.distributed.node_checks import check_gloo_interface

__all__ = [
    "DistEnv",
    "init_distributed",
    "device_mesh",
    "shutdown",
    "get_logger",
    "seed_everything",
]


@attrs.frozen
class DistEnv:
    """Where this process sits: its rank, the world size, its device and the collective backend.

    A role's pool under split placement (``backends.distributed.placement``) is described by a DistEnv too:
    ``rank`` / ``world_size`` are then the rank within the pool and the pool's size, and ``group`` is
    the pool's process group (None: the default group, all ranks).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  #: "gloo" or "nccl" (the backend of the process's device)
    group: Any = attrs.field(default=None, eq=False)  #: the ranks' process group; None = the default group

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs, writes checkpoints and prints."""
        return self.rank == 0


def _env_int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _pick_device(local_rank: int, device: str | None) -> tuple[torch.device, str]:
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("init_distributed(device='cuda') but CUDA is not available")
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(f"LOCAL_RANK={local_rank} but only {count} CUDA devices are visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    if kind != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return torch.device("cpu"), "gloo"


def init_distributed(*, device: str | None = None, timeout_s: float = 1800.0) -> DistEnv:
    """Join (or create) the default process group and return this process's :class:`DistEnv`.

    - Under torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set):
      ``init_process_group`` from the environment.
    - With no torchrun environment: a one-process group over a TCP store on a free local port.
    - If a default group already exists (a test harness, a second call): it is reused, and rank and
      world size are read from it (they must agree with the environment where it is set).

    ``device`` forces "cpu" or "cuda"; by default CUDA when available. On CUDA the device is
    ``cuda:LOCAL_RANK`` and the backend NCCL for CUDA tensors with gloo for CPU tensors
    (``"cpu:gloo,cuda:nccl"``); on CPU the backend is gloo.
    """
    local_rank = _env_int("LOCAL_RANK", 0)
    dev, backend = _pick_device(local_rank, device)
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        env_rank, env_world = _env_int("RANK"), _env_int("WORLD_SIZE")
        if env_rank is not None and env_rank != rank or env_world is not None and env_world != world:
            raise RuntimeError(
                f"the existing process group (rank {rank} of {world}) disagrees with the environment "
                f"(RANK={env_rank}, WORLD_SIZE={env_world})"
            )
        group_backend = str(dist.get_backend())
        backend = "nccl" if "nccl" in group_backend and dev.type == "cuda" else "gloo"
        return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=dev, backend=backend)

    pg_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is not None and world is not None:
        check_gloo_interface()  # a node other nodes cannot reach fails here, named, not in a hang
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = dev
        store = _attempt_store(world, timeout)
        if store is not None:
            kwargs["store"] = store
        dist.init_process_group(pg_backend, rank=rank, world_size=world, timeout=timeout, **kwargs)
    elif rank is None and world is None:
        # plain `python script.py`: a private single-process group (port 0 = the OS picks a free one)
        store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timeout)
        dist.init_process_group(pg_backend, store=store, rank=0, world_size=1, timeout=timeout)
        rank, world = 0, 1
    else:
        raise RuntimeError(f"RANK and WORLD_SIZE must be set together (RANK={rank}, WORLD_SIZE={world})")
    return DistEnv(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=dev, backend=backend
    )


def _attempt_store(world: int, timeout: timedelta) -> Any:
    """Under torchrun, the agent's TCPStore (``TORCHELASTIC_USE_AGENT_STORE``) outlives a failed attempt, and
    with ``--max-restarts`` the next attempt's ranks could read the dead ranks' addresses from it and fail to
    connect (pytorch#135712): the default group's keys get a prefix per attempt. None outside torchrun."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restart is None:
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"rlfunc/attempt_{restart}", store)


def device_mesh(env: DistEnv, shape: Sequence[int] | None = None, names: Sequence[str] = ("dp",)) -> Any:
    """A ``DeviceMesh`` over all ranks on ``env``'s device type; default shape ``(world_size,)``."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(shape) if shape is not None else (env.world_size,)
    names = tuple(names)
    if len(shape) != len(names):
        raise ValueError(f"device_mesh: shape {shape} has {len(shape)} dims but names {names} has {len(names)}")
    total = 1
    for s in shape:
        total *= s
    if total != env.world_size:
        raise ValueError(f"device_mesh: shape {shape} holds {total} ranks, the world has {env.world_size}")
    return init_device_mesh(env.device.type, shape, mesh_dim_names=names)


def shutdown(env: DistEnv | None = None) -> None:
    """Destroy the default process group if one exists (safe to call twice).

    Every rank first waits for the others: a rank that tears gloo down while a peer is still working
    (rank 0 writing the summary, say) can abort the peer's process ("terminate called without an
    active exception").
    """
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


class _RankFormatter(logging.Formatter):
    def __init__(self, rank: int) -> None:
        super().__init__(f"[rank {rank}] %(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def get_logger(name: str, env: DistEnv, *, stream: TextIO | None = None) -> logging.Logger:
    """A logger that logs INFO on rank 0 and only WARNING and above elsewhere, prefixed ``[rank N]``.

    Calling it again for the same name reconfigures the same logger (no duplicate handlers). It does
    not propagate to the root logger, so a root ``basicConfig`` does not print lines twice.
    """
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        if getattr(handler, "_rlfunc_rank_handler", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler._rlfunc_rank_handler = True  # type: ignore[attr-defined]
    handler.setFormatter(_RankFormatter(env.rank))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if env.is_main else logging.WARNING)
    logger.propagate = False
    return logger


def seed_everything(seed: int, rank_offset: int = 0) -> int:
    """Seed Python's ``random``, NumPy (if installed) and torch (CPU and CUDA) with ``seed + rank_offset``.

    Pass ``rank_offset=env.rank`` for per-rank streams (data shuffles, dropout), 0 for identical ones
    (model init). Returns the seed used. Sampling in the rollout engine uses its own generators.
    """
    effective = int(seed) + int(rank_offset)
    random.seed(effective)
    try:
        import numpy as np

        np.random.seed(effective % 2**32)
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    torch.manual_seed(effective)
    return effective

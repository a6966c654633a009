"""Run a function on N real processes joined by a real process group (the multi-rank test harness).

On CPU the group is gloo. Where CUDA has a GPU per rank it is ``cpu:gloo,cuda:nccl``: collectives on CUDA
tensors go through NCCL (what a GPU cluster runs), those on CPU tensors through gloo, and each rank uses
``cuda:<rank>``. ``RLFUNC_TEST_BACKEND`` overrides the choice (e.g. ``gloo``).
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_group_backend(world_size: int) -> str:
    """The process-group backend of the multi-rank tests (see the module doc)."""
    import torch

    override = os.environ.get("RLFUNC_TEST_BACKEND")
    if override:
        return override
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    try:
        import torch

        torch.set_num_threads(1)
        backend = process_group_backend(world_size)
        if "nccl" in backend:
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # plain pickle bytes: torch.multiprocessing would share the result's tensors through file
        # descriptors that the parent fetches from this process, which may have exited by then
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 300) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return results by rank.

    ``fn`` must be importable (a module-level function). A failure on any rank raises with its traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]

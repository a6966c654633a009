"""Weight sync from a 2-rank FSDP2 actor (fp32 master weights) into a bf16 native rollout engine: one
gather per tensor, as the recipes did before buckets, against bucketed sync at a few bucket sizes.

Run: ``.venv/bin/torchrun --standalone --nproc_per_node 2 benchmarks/bench_weight_sync.py [--repeats 7]
[--buckets-mb 1 16 64 512] [--models config-B larger] [--rss]``.

Settings, each streamed into the same ``build_native_rollout(..., dtype=bfloat16)`` engine by
``sync_weights``:

- ``one by one, fp32``: each distinct tensor gathered alone with ``DTensor.full_tensor()`` in its stored
  fp32, the engine casting to bf16 (the stream before buckets, kept here as :func:`one_by_one`);
- ``bucketed fp32 @ N``: ``full_state_dict(actor, bucket_mb=N)``: buckets, no cast before the gather;
- ``bucketed bf16 @ N``: ``full_state_dict(actor, dtype=bfloat16, bucket_mb=N)``: what the recipes pass.

Columns, per rank (rank 0 printed; the ranks are symmetric):

- ``collectives``: c10d collective ops dispatched during one sync (a dispatch mode sees eager and
  functional ones, so ``full_tensor()``'s count too);
- ``sent MB`` / ``received MB``: bytes this rank put into / took out of those all-gathers;
- ``time ms``: median wall time of a whole sync (gather, unpack, copy into the engine) over ``repeats``
  after one warm-up; the settings take turns, one sync each per round, the ranks started together by a
  barrier, so a drift in the machine's load spreads over all of them;
- ``peak MB``: the largest total of tensor storage allocated by the sync and alive at once (every op's
  new output storage is tracked through a weak reference until it is freed; the engine's weights and the
  trainer's shards are not new, so they do not count);
- ``rss MB`` (with ``--rss``): the rise of the process's peak resident memory during one sync
  (``/proc/self/status`` ``VmHWM`` after resetting it). The process is then started with glibc told to
  hand every block over 64 KiB straight back to the system (``MALLOC_MMAP_THRESHOLD_``), so freed
  tensors do not linger in the heap; that allocator faults fresh pages in for every large tensor, so
  the times of an ``--rss`` run are not the ones to quote. It sees what the tracker cannot: chiefly
  gloo's own staging buffer (gloo gathers into a buffer of its own the size of the output and copies
  out of it, so on CPU an all-gather's peak is about twice its output; NCCL gathers into the output).

The models: ``config-B`` (``TinyModelConfig()``: Qwen2, hidden 256, 4 layers, about 2.9M parameters)
and ``larger`` (hidden 1024, 8 layers, MLP 2816, about 90M parameters: 360 MB in fp32).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# --rss: glibc reads its malloc settings at start-up, so the process starts again with them set
MMAP_THRESHOLD = str(64 * 1024)
if "--rss" in sys.argv and os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.distributed.sharded_state import full_state_dict  # noqa: E402
from backends.models import TinyModelConfig, write_tiny_model  # noqa: E402

MODELS = {
    "config-B": TinyModelConfig(),
    "larger": TinyModelConfig(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=2816),
}


def one_by_one(module):
    """The stream before buckets: every distinct tensor gathered alone in its stored dtype."""
    canonical: dict[int, str] = {}
    tied_to = {n: canonical.setdefault(id(p), n) for n, p in module.named_parameters(remove_duplicate=False)}
    uses: dict[str, int] = {}
    for name in module.state_dict():
        uses[tied_to.get(name, name)] = uses.get(tied_to.get(name, name), 0) + 1
    cache: dict[str, torch.Tensor] = {}
    for name, value in module.state_dict().items():
        key = tied_to.get(name, name)
        full = cache.get(key)
        if full is None:
            full = (value.full_tensor() if isinstance(value, DTensor) else value).detach()
            if uses[key] > 1:
                cache[key] = full
        yield name, full


class SyncProbe(TorchDispatchMode):
    """Counts collective ops and their bytes, and tracks the peak of newly allocated, still alive storage."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives = 0
        self.sent = self.received = 0
        self.alive: dict[int, tuple[StorageWeakRef, int]] = {}  # data_ptr -> (weak ref, bytes)
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        if "c10d" in name and not any(s in name for s in ("wait_tensor", "_wrap_tensor_autograd")):
            self._count(name, args)
        # storage reached through an input (a view, an in-place op, a DTensor's local shard) is not new
        inputs = {_storage_ptr(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if type(t) is not torch.Tensor:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            known = self.alive.get(ptr)
            if ptr not in inputs and (known is None or known[0].expired()) and storage.nbytes() > 0:
                self.alive[ptr] = (StorageWeakRef(storage), storage.nbytes())
        self.alive = {p: e for p, e in self.alive.items() if not e[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.alive.values()))
        return out

    def _count(self, name: str, args: tuple) -> None:
        self.collectives += 1
        if name.startswith("c10d._allgather_base_"):  # (output, input, ...): eager all_gather_single
            output, inp = args[0], args[1]
            self.sent += inp.nbytes
            self.received += output.nbytes - inp.nbytes
        elif name.startswith("_c10d_functional.all_gather_into_tensor"):  # (input, group size, group): full_tensor()
            inp, size = args[0], args[1]
            self.sent += inp.nbytes
            self.received += (size - 1) * inp.nbytes


def _storage_ptr(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage (a DTensor's: its local shard's); None for a wrapper without one."""
    t = t._local_tensor if isinstance(t, DTensor) else t
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # a tensor subclass with no storage of its own (a functional collective's result)
        return None


def _cpu_model() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def _status_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def median_times(syncs: list, repeats: int) -> list[float]:
    """Median wall seconds of each of ``syncs`` over ``repeats`` rounds (one sync of each per round, after
    a warm-up round), every sync started on all ranks together."""
    times: list[list[float]] = [[] for _ in syncs]
    for _ in range(repeats + 1):
        for own, sync in zip(times, syncs):
            dist.barrier()
            t0 = time.perf_counter()
            sync()
            own.append(time.perf_counter() - t0)
    return [statistics.median(t[1:]) for t in times]


def probe(sync, rss: bool) -> dict:
    """Collectives, bytes, peak new storage (and with ``rss`` the peak RSS rise) of one ``sync()``."""
    with SyncProbe() as p:
        sync()
    out = {"collectives": p.collectives, "sent": p.sent, "received": p.received, "peak": p.peak}
    if rss:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size
        before = _status_kb("VmRSS")
        sync()
        out["rss"] = (_status_kb("VmHWM") - before) * 1024
    return out


def build(label: str, root: Path, buckets_mb: list[float]) -> tuple[int, list]:
    """The actor and a bf16 native engine of model ``label``; ``(parameters, [(setting, sync)])``."""
    from backends.distributed.setup import init_distributed
    from backends.rollout.native import build_native_rollout, sync_weights
    from backends.training.fsdp import build_actor

    env = init_distributed(device="cpu")
    path = root / label
    if env.rank == 0:
        write_tiny_model(path, MODELS[label])
    dist.barrier()
    actor = build_actor(path, env)
    rollout = build_native_rollout(path, dtype=torch.bfloat16)
    streams = [
        ("one by one, fp32", lambda: one_by_one(actor.module)),
        ("bucketed fp32 @ 512", lambda: full_state_dict(actor, bucket_mb=512)),
    ]
    for mb in buckets_mb:
        streams.append(
            (f"bucketed bf16 @ {mb:g}", lambda mb=mb: full_state_dict(actor, dtype=torch.bfloat16, bucket_mb=mb))
        )
    syncs = [(name, lambda stream=stream: sync_weights(rollout, stream())) for name, stream in streams]
    return sum(p.numel() for p in actor.module.parameters()), syncs


def print_table(label: str, params: int, rows: list[tuple[str, dict]]) -> None:
    print(
        f"\n{label}: {params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MB fp32), "
        f"{dist.get_world_size()} ranks, rank 0's view, {_cpu_model()}"
    )
    rss = "rss" in rows[0][1]
    print(
        f"{'setting':<22} {'collectives':>11} {'sent MB':>8} {'received MB':>11} {'time ms':>8} {'peak MB':>8}"
        + (f" {'rss MB':>7}" if rss else "")
    )
    for name, r in rows:
        print(
            f"{name:<22} {r['collectives']:>11} {r['sent'] / 2**20:>8.1f} {r['received'] / 2**20:>11.1f} "
            f"{r['time'] * 1e3:>8.1f} {r['peak'] / 2**20:>8.1f}" + (f" {r['rss'] / 2**20:>7.1f}" if rss else "")
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--buckets-mb", type=float, nargs="+", default=[1.0, 16.0, 64.0, 512.0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rss", action="store_true", help="also measure the peak RSS rise (see the docstring)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from backends.distributed.setup import init_distributed, shutdown

    env = init_distributed(device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(_shared_dir(tmp))  # rank 0 writes the models there
        for label in args.models:
            params, syncs = build(label, root, args.buckets_mb)
            times = median_times([sync for _, sync in syncs], args.repeats)
            rows = [(name, {**probe(sync, args.rss), "time": t}) for (name, sync), t in zip(syncs, times)]
            if env.rank == 0:
                print_table(label, params, rows)
    shutdown(env)


def _shared_dir(own: str) -> str:
    """Rank 0's temporary dir, on every rank (the ranks share one file system)."""
    box = [own]
    dist.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    main()

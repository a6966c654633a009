"""Checkpoint save / load time of the config-B actor (model + AdamW state): DCP vs torch.save vs orbax.

Run: ``.venv/bin/python benchmarks/bench_checkpoint.py [--repeats 5] [--world-sizes 1 2]``.

The config-B model (``backends.models.TinyModelConfig()`` defaults: Qwen2, hidden 256, 4 layers, about
2.9M parameters) is wrapped by ``build_actor`` (FSDP2) and stepped once so AdamW has its state (about
35 MB in fp32 in all). On 1 rank and on 2 gloo ranks (1 torch thread each), medians over ``repeats``:

- ``dcp (backends.checkpoint.dcp)``: ``save_checkpoint`` (every rank writes its shard, rank 0 the COMPLETE
  marker and the atomic rename; RNG and extra included) and ``load_checkpoint`` (validation + sharded
  read + ``set_state_dict``);
- ``dcp async``: ``save_checkpoint(async_save=True)``: the time the training loop is blocked (state
  dicts, RNG file, staging to CPU memory), then the rest until ``wait()`` returns (the write and the
  rename, which overlap with training in a real run);
- ``torch.save (gathered)``: the usual single-file way: gather the full model + optimizer state dicts
  on rank 0 (``get_state_dict(full_state_dict=True, cpu_offload=True)``), ``torch.save`` there; load =
  every rank ``torch.load(weights_only=True)`` + ``set_state_dict(full_state_dict=True)``;
- ``orbax (backends.checkpoint.orbax)``: the gathered state as an orbax PyTree (rank 0 writes, every rank reads).

Times are wall-clock seconds on rank 0 between two barriers, including the file system's work
(``fsync`` in DCP's writer). Quote them with the machine's load in mind.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.models import TinyModelConfig, write_tiny_model  # noqa: E402
from rlfunc.aggregation import aggregate  # noqa: E402
from rlfunc.batch import RolloutBatch  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402


def make_batch(rows: int, vocab: int, seed: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    p, t = 8, 16
    return RolloutBatch(
        prompt_ids=torch.randint(4, vocab, (rows, p), generator=g),
        prompt_mask=torch.ones(rows, p, dtype=torch.bool),
        response_ids=torch.randint(4, vocab, (rows, t), generator=g),
        response_mask=torch.ones(rows, t, dtype=torch.bool),
        group_ids=torch.arange(rows),
        advantages=torch.randn(rows, t, generator=g),
    )


def pg_loss(outputs, mb, norms):
    return aggregate(-mb.advantages * outputs.logprobs, mb.response_mask, mode="token-mean", norms=norms), {}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _worker(rank: int, world_size: int, model_dir: str, root: str, repeats: int, with_orbax: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from backends.checkpoint.dcp import load_checkpoint, save_checkpoint
    from backends.distributed.setup import init_distributed
    from backends.training.fsdp import build_actor, update
    from backends.training.optim import OptimConfig

    env = init_distributed()
    actor = build_actor(model_dir, env, OptimConfig(lr=1e-5))
    actor, _ = update(actor, make_batch(8, 60, rank), pg_loss)
    root_path = Path(root)
    results: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}

    def timed(name: str, fn) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        results.setdefault(name, []).append(time.perf_counter() - t0)

    extra = {"step": 1, "data_position": 128, "kl": torch.tensor([0.1])}
    for i in range(repeats):
        # DCP, synchronous
        ckpt_dir = root_path / f"dcp_{i}"
        timed("dcp save", lambda: save_checkpoint(ckpt_dir, 1, {"actor": actor}, extra, keep_last=1))
        timed("dcp load", lambda: load_checkpoint(ckpt_dir / "step_1", {"actor": actor}))
        sizes["dcp"] = dir_bytes(ckpt_dir / "step_1")

        # DCP, async: blocked time, then until the checkpoint is complete
        async_dir = root_path / f"async_{i}"
        box = {}

        def start_async() -> None:
            box["pending"] = save_checkpoint(async_dir, 1, {"actor": actor}, extra, async_save=True)

        timed("dcp async save: blocking part", start_async)
        timed("dcp async save: rest, to wait()", lambda: box["pending"].wait())

        # torch.save of the gathered state dicts on rank 0
        file = root_path / f"torch_{i}.pt"

        def torch_save() -> None:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            msd, osd = get_state_dict(actor.module, [actor.optimizer], options=options)
            if rank == 0:
                torch.save({"model": msd, "optim": osd, "extra": extra}, file)

        def torch_load() -> None:
            blob = torch.load(file, weights_only=True)
            set_state_dict(
                actor.module,
                [actor.optimizer],
                model_state_dict=blob["model"],
                optim_state_dict=blob["optim"],
                options=StateDictOptions(full_state_dict=True),
            )

        timed("torch.save (gathered)", torch_save)
        timed("torch.load (every rank)", torch_load)
        sizes["torch"] = file.stat().st_size

        if with_orbax:
            from backends.checkpoint.orbax import load_orbax, save_orbax

            opath = root_path / f"orbax_{i}"
            timed("orbax save (gathered)", lambda: save_orbax(actor, opath))
            timed("orbax load (every rank)", lambda: load_orbax(actor, opath))
            sizes["orbax"] = dir_bytes(opath)
        dist.barrier()
        if rank == 0:
            for p in (ckpt_dir, async_dir, file, root_path / f"orbax_{i}"):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    n_params = sum(p.numel() for p in actor.module.parameters())  # DTensor numel is the global size
    return {"times": results, "sizes": sizes, "params": n_params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--no-orbax", action="store_true", help="skip the orbax rows")
    args = parser.parse_args()
    with_orbax = not args.no_orbax
    if with_orbax:
        try:
            import orbax.checkpoint  # noqa: F401
        except ImportError:
            print("orbax-checkpoint is not installed: skipping the orbax rows")
            with_orbax = False

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_tiny_model(Path(tmp) / "model", TinyModelConfig()))
        table = {}
        for world in args.world_sizes:
            root = Path(tmp) / f"w{world}"
            root.mkdir()
            res = run_distributed(_worker, world, model_dir, str(root), args.repeats, with_orbax, timeout=1800)[0]
            table[world] = res

    params = next(iter(table.values()))["params"]
    print(
        f"\nconfig-B actor: {params / 1e6:.2f}M parameters + AdamW state; median of {args.repeats} repeats, "
        f"seconds (1 torch thread per rank; torch {torch.__version__}; {os.cpu_count()} CPUs)"
    )
    rows = list(next(iter(table.values()))["times"])
    header = f"{'':32}" + "".join(f"{f'{w} rank' + ('s' if w > 1 else ''):>12}" for w in table)
    print(header)
    for name in rows:
        print(f"{name:32}" + "".join(f"{statistics.median(table[w]['times'][name]):12.3f}" for w in table))
    print()
    for w, res in table.items():
        sizes = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in res["sizes"].items())
        print(f"on-disk size, {w} rank(s): {sizes}")
    med = {w: {k: statistics.median(v) for k, v in r["times"].items()} for w, r in table.items()}
    ratio = {w: m["dcp save"] / m["torch.save (gathered)"] for w, m in med.items()}
    print("dcp save / torch.save: " + ", ".join(f"{w} rank(s) {v:.2f}x" for w, v in ratio.items()))


if __name__ == "__main__":
    main()

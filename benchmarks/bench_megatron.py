"""Megatron backend on 2 CPU ranks: update step time vs the FSDP engine, packed (thd) vs rows (bshd),
and per-rank parameter bytes.

Run: ``.venv/bin/python benchmarks/bench_megatron.py [--layout tp2|pp2|dp2] [--steps 6] [--rows 64]``.

A config-B model (hidden 256, 4 layers, 4 heads, 2 KV heads). One process pair holds the FSDP2 actor
and a megatron actor with the chosen (tp, pp) layout at once; the three variants (FSDP, megatron
bshd, megatron thd) alternate step by step on the same global GRPO-shaped batch (8-token prompts,
responses of 1..32 tokens), so load from other work hits all alike. Medians over steps 2..N, and the
median of per-step ratios against FSDP. On a small shared machine the seconds are noisy: read the
ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.models import TinyModelConfig, build_char_tokenizer, write_tiny_model  # noqa: E402
from benchmarks.bench_fsdp_memory import make_batch, pg_loss  # noqa: E402
from rlfunc.batch import select  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}


def _bench(rank: int, world_size: int, model_dir: str, vocab: int, rows: int, steps: int, layout: str) -> dict:
    import attrs

    from backends.distributed.setup import init_distributed
    from backends.training import fsdp as F
    from backends.training.megatron import engine as M
    from backends.training.megatron import update as U
    from backends.training.optim import OptimConfig

    env = init_distributed()
    optim = OptimConfig(lr=1e-5)
    tp, pp = LAYOUTS[layout]
    batch = make_batch(rows, vocab)
    half = select(batch, slice(rank * rows // 2, (rank + 1) * rows // 2))
    fsdp = F.build_actor(model_dir, env, optim, F.FSDPConfig(micro_batch_size=16))
    mcfg = M.MegatronConfig(tp=tp, pp=pp, micro_batch_size=16)
    meg = M.build_actor(model_dir, env, optim, mcfg)
    meg_rows = batch if tp * pp == 2 else half
    params = {
        "fsdp": sum(p.to_local().numel() for p in fsdp.module.parameters()) * 4,
        "megatron": sum(p.numel() for p in meg.module.parameters()) * 4,
    }
    times: dict[str, list[float]] = {"fsdp": [], "megatron-bshd": [], "megatron-thd": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        fsdp, _ = F.update(fsdp, half, pg_loss)
        times["fsdp"].append(time.perf_counter() - t0)
        for kind in ("bshd", "thd"):
            meg = meg.replace(cfg=attrs.evolve(mcfg, layout=kind))
            t0 = time.perf_counter()
            meg, _ = U.update(meg, meg_rows, pg_loss)
            times[f"megatron-{kind}"].append(time.perf_counter() - t0)
    return {"times": times, "params": params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="tp2")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_char_tokenizer()
        model_dir = str(write_tiny_model(Path(tmp) / "b", TinyModelConfig(), tokenizer))
        ranks = run_distributed(_bench, 2, model_dir, len(tokenizer), args.rows, args.steps, args.layout, timeout=1800)
    times = ranks[0]["times"]
    print(
        f"layout {args.layout}, {args.rows} rows, config-B model, 2 ranks x 1 thread; seconds per update "
        f"(median of steps 2..{args.steps}) and median per-step ratio vs FSDP"
    )
    for name, ts in times.items():
        ratio = statistics.median(t / f for t, f in zip(ts[1:], times["fsdp"][1:]))
        print(f"  {name:14s} {statistics.median(ts[1:]):7.3f} s   x{ratio:.2f}")
    for r, out in enumerate(ranks):
        print(
            f"  rank {r} parameter bytes: fsdp {out['params']['fsdp'] / 2**20:.2f} MiB, "
            f"megatron {out['params']['megatron'] / 2**20:.2f} MiB"
        )


if __name__ == "__main__":
    main()

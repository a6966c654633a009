"""The first run on a GPU machine: the GRPO recipe end to end on every GPU here, and what it measured.

Run (after the ``gpu``-marked tests, as ``make test-gpu`` does):

    .venv/bin/python benchmarks/gpu_smoke.py                     # vLLM (bf16), then the native engine
    .venv/bin/python benchmarks/gpu_smoke.py --engines vllm --steps 50

Each engine gets one ``torchrun --nproc_per_node <GPUs> experiments/grpo.py`` run on the synthetic arithmetic
task (a tiny random Qwen2, a short SFT stage, then GRPO with FSDP2 in bf16 and truncated importance sampling),
and one line of numbers read from its ``metrics.jsonl``: tokens/s, step time, weight-sync time, peak GPU memory,
the rollout / trainer log-prob gap (max and mean over the loss tokens) and the held-out success before / after.
Paste the output into benchmarks/RESULTS.md with the date, the GPUs and the commit.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def recipe_args(data: Path, run_root: Path, engine: str, steps: int) -> list[str]:
    return [
        "preset=demo/arithmetic",
        f"run_root={run_root}",
        f"name=gpu_{engine}",
        f"steps={steps}",
        f"data.train_files={data / 'train.jsonl'}",
        f"data.val_files={data / 'val.jsonl'}",
        f"sft.files={data / 'sft.jsonl'}",
        "sft.steps=100",
        "eval.every=0",
        "logger=console,jsonl",
        f"rollout.engine={engine}",
        "actor.fsdp.param_dtype=bfloat16",
        "algo.rollout_is=token",
        *(["rollout.vllm.dtype=bfloat16"] if engine == "vllm" else ["rollout.dtype=bfloat16"]),
    ]


def summarize(run_dir: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 1 and "step_time_s" in r]  # step 1 pays one-off warm-up costs
    summary = json.loads((run_dir / "summary.json").read_text())
    median = lambda key: statistics.median(r[key] for r in steps) if all(key in r for r in steps) else float("nan")
    return {
        "tokens_per_s": median("tokens_per_s"),
        "step_s": median("step_time_s"),
        "sync_s": median("sync_time_s"),
        "rollout_s": median("rollout_time_s"),
        "update_s": median("update_time_s"),
        "gpu_gib": max((r.get("gpu_memory_gib", float("nan")) for r in steps), default=float("nan")),
        "gap_max": max((r.get("logprob_gap/max", float("nan")) for r in steps), default=float("nan")),
        "gap_mean": median("logprob_gap/mean"),
        "before": summary["eval_before"],
        "after": summary["eval_after"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--engines",
        default=None,
        help="comma-separated rollout engines (default: vllm where it is installed, then native)",
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--keep", default="", help="keep the runs under this dir (default: a temporary one)")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_smoke.py needs CUDA: no GPU is visible to torch here")
    gpus = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    from experiments.tasks.arithmetic import write_dataset

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="rlfunc-gpu-"))
    data = write_dataset(root / "data", sft_examples=6400)
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))  # keep the caller's
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "4"}
    torchrun = Path(sys.executable).with_name("torchrun")
    results = {}
    if args.engines is None:
        args.engines = "vllm,native" if importlib.util.find_spec("vllm") else "native"
        print(f"engines: {args.engines}" + ("" if "vllm" in args.engines else " (vllm is not installed here)"))
    for engine in [e.strip() for e in args.engines.split(",") if e.strip()]:
        cmd = [
            str(torchrun),
            "--standalone",
            "--nproc_per_node",
            str(gpus),
            str(ROOT / "experiments" / "grpo.py"),
            *recipe_args(data, root / "runs", engine, args.steps),
        ]
        print("$ " + " ".join(cmd), flush=True)
        out = subprocess.run(cmd, env=env, cwd=ROOT)
        if out.returncode != 0:
            results[engine] = {"failed": f"exit code {out.returncode}"}
            continue
        (run_dir,) = sorted((root / "runs").glob(f"gpu_{engine}-*"))[-1:]
        results[engine] = summarize(run_dir)

    print(
        f"\nGRPO on {gpus} x {', '.join(names)} (torch {torch.__version__}), "
        f"{args.steps} steps, bf16, medians of steps 2..N"
    )
    head = (
        "engine",
        "tokens/s",
        "step s",
        "rollout s",
        "update s",
        "sync s",
        "peak GiB",
        "gap max",
        "gap mean",
        "held-out",
    )
    print(" | ".join(head))
    for engine, r in results.items():
        if "failed" in r:
            print(f"{engine} | FAILED ({r['failed']})")
            continue
        print(
            f"{engine} | {r['tokens_per_s']:.0f} | {r['step_s']:.3f} | {r['rollout_s']:.3f} | {r['update_s']:.3f} | "
            f"{r['sync_s']:.3f} | {r['gpu_gib']:.2f} | {r['gap_max']:.3g} | {r['gap_mean']:.3g} | "
            f"{r['before']:.1%} -> {r['after']:.1%}"
        )
    if any("failed" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()

"""Split vs colocated placement: PPO step time of experiments/ppo.py on the same 4 ranks.

- colocated: actor, rollout, critic and reference on all 4 ranks (each model sharded 4 ways), the
  phases one after the other;
- split: actor + rollout on ranks 0-1, critic + reference on ranks 2-3 (each sharded 2 ways); the
  batch crosses between the pools and the critic update overlaps the actor update + weight sync.

The runs alternate (colocated, split, colocated, split, ...) so that drift of a shared machine hits
both sides alike; each run reports the median ``step_time_s`` of its steps after ``--skip`` warm-up
steps (rank 0's clock, which under split waits for the critic pool's metrics at the end of a step), and
the ratio is taken per round, then the median over rounds.

NOTE: with fewer than 4 free cores, 4 ranks oversubscribe the CPU, so the two pools cannot truly run
at the same time and the numbers are noisy. What
differs besides the overlap: colocated shards every model over 4 ranks (gloo all-gathers and weight
sync across 4 oversubscribed processes), split over 2; and a rank waiting in a collective gives its
core to the other pool. Read the ratio as the machine's it ran on, not as a cluster's speed-up.

    python benchmarks/bench_placement.py                       # 2 rounds, 6 steps each
    python benchmarks/bench_placement.py --rounds 3 -- rollout.n=16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RECIPE = ROOT / "experiments" / "ppo.py"
PHASES = (
    "rollout",
    "old_logprob",
    "to_critic_pool",
    "reference",
    "values",
    "advantages",
    "to_actor_pool",
    "critic_update",
    "actor_update",
    "weight_sync",
)
SIDES = {
    "colocated": ["placement.mode=colocated"],
    "split": ["placement.mode=split", "placement.actor_pool=2", "placement.critic_pool=2"],
}


def task_args(tmp: Path) -> list[str]:
    """The arithmetic task's files (written once into ``tmp``) as recipe overrides."""
    from experiments.tasks.arithmetic import write_dataset

    data = tmp / "data"
    if not (data / "train.jsonl").exists():
        write_dataset(data, sft_examples=256)
    return [
        f"data.train_files={data / 'train.jsonl'}",
        f"data.val_files={data / 'val.jsonl'}",
        f"sft.files={data / 'sft.jsonl'}",
    ]


def run(side: str, args: argparse.Namespace, tmp: Path, round_: int) -> dict:
    run_dir = tmp / f"{side}-{round_}"
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc_per_node",
        "4",
        str(RECIPE),
        "preset=demo/ppo_arithmetic",
        f"run_dir={run_dir}",
        *task_args(tmp),
        f"steps={args.steps}",
        "sft.steps=2",
        f"prompts_per_step={args.prompts}",
        f"rollout.n={args.n}",
        "eval.before_training=false",
        "export.hf=false",
        "algo.critic_warmup=0",
        *SIDES[side],
        *args.overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"the {side} run failed:\n{out.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > args.skip and "step_time_s" in r]
    return {
        "step_time_s": statistics.median(r["step_time_s"] for r in rows),
        **{p: statistics.median(r.get(f"time/{p}_s", 0.0) for r in rows) for p in PHASES},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip", type=int, default=1, help="warm-up steps left out")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (global)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("overrides", nargs="*", help="extra recipe overrides (key=value) for both sides")
    args = parser.parse_args()

    results: dict[str, list[dict]] = {"colocated": [], "split": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in ("colocated", "split") if r % 2 == 0 else ("split", "colocated"):
                results[side].append(run(side, args, Path(tmp), r))
                print(f"round {r} {side:9s}: step {results[side][-1]['step_time_s']:.3f} s", flush=True)

    print(
        f"\nPPO step on 4 ranks (recipe's default tiny model, {args.prompts} prompts x {args.n} samples, "
        f"median of steps {args.skip + 1}..{args.steps}, {args.rounds} alternating rounds); "
        "4 ranks on 2 cores oversubscribe the CPU, see the module docstring"
    )
    print(f"{'phase (s)':16s} {'colocated':>10s} {'split':>10s}")
    for key in ("step_time_s", *PHASES):
        c = statistics.median(x[key] for x in results["colocated"])
        s = statistics.median(x[key] for x in results["split"])
        print(f"{key:16s} {c:10.3f} {s:10.3f}")
    ratios = [c["step_time_s"] / s["step_time_s"] for c, s in zip(results["colocated"], results["split"])]
    print(
        f"\ncolocated / split step time: {statistics.median(ratios):.2f}x (per round: "
        + ", ".join(f"{x:.2f}" for x in ratios)
        + "; > 1 means split is faster)"
    )
    print(
        "under split, critic_update (critic pool) and actor_update + weight_sync (actor pool) overlap; "
        "to_critic_pool / to_actor_pool include waiting for the other pool"
    )


if __name__ == "__main__":
    main()

"""PPO step time split by phase, on the config-B model (TinyModelConfig defaults: hidden 256, 4 layers).

Runs experiments/ppo.py (which records ``time/<phase>_s`` per step in metrics.jsonl) and
prints the per-phase mean over the measured steps (the first ``--skip`` steps are warm-up).

    python benchmarks/bench_ppo_phases.py                         # 1 process
    python benchmarks/bench_ppo_phases.py --nproc 2               # torchrun, 2 ranks (rank 0's times)
    python benchmarks/bench_ppo_phases.py --steps 8 -- rollout.n=16   # extra recipe overrides after --

Phases: rollout (sampling + reward), old_logprob (actor forward), reference (forward), values (critic
forward), advantages (token rewards, KL penalty, GAE, whitening), critic_update, actor_update,
weight_sync (FSDP shards -> rollout engine). ``other`` = step time minus the phases (metrics, logging).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RECIPE = ROOT / "experiments" / "ppo.py"
PHASES = ("rollout", "old_logprob", "reference", "values", "advantages", "critic_update", "actor_update", "weight_sync")
# config B: the TinyModelConfig defaults (the demo preset's is a smaller model)
CONFIG_B = [
    "model.tiny.hidden_size=256",
    "model.tiny.num_layers=4",
    "model.tiny.num_heads=4",
    "model.tiny.num_kv_heads=2",
    "model.tiny.intermediate_size=688",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the mean")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (global)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per process")
    parser.add_argument("overrides", nargs="*", help="extra recipe overrides (key=value)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        launcher = (
            [sys.executable]
            if args.nproc == 1
            else [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", str(args.nproc)]
        )
        from experiments.tasks.arithmetic import write_dataset

        data = write_dataset(Path(tmp) / "data", sft_examples=256)
        cmd = [
            *launcher,
            str(RECIPE),
            "preset=demo/ppo_arithmetic",
            f"run_dir={run_dir}",
            *CONFIG_B,
            f"steps={args.steps}",
            f"data.train_files={data / 'train.jsonl'}",
            f"data.val_files={data / 'val.jsonl'}",
            f"sft.files={data / 'sft.jsonl'}",
            "sft.steps=2",
            f"prompts_per_step={args.prompts}",
            f"rollout.n={args.n}",
            "eval.before_training=false",
            "export.hf=false",
            "algo.critic_warmup=0",
            *args.overrides,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"the recipe failed:\n{out.stderr[-4000:]}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if r["step"] > args.skip and "step_time_s" in r]

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in rows) / len(rows)

    step = mean("step_time_s")
    print(
        f"PPO step phases: config-B model, {args.prompts} prompts x {args.n} samples, {args.nproc} rank(s), "
        f"{args.threads} thread(s)/rank, mean of {len(rows)} steps (rank 0)"
    )
    print(f"{'phase':<16}{'seconds':>10}{'share':>9}")
    for phase in PHASES:
        t = mean(f"time/{phase}_s")
        print(f"{phase:<16}{t:>10.3f}{t / step:>9.1%}")
    other = step - sum(mean(f"time/{p}_s") for p in PHASES)
    print(f"{'other':<16}{other:>10.3f}{other / step:>9.1%}")
    print(f"{'step':<16}{step:>10.3f}{1:>9.1%}")
    print(f"tokens/s (prompt + response, all ranks): {mean('tokens_per_s'):.0f}")


if __name__ == "__main__":
    main()

"""The cost of the step fingerprints (``debug.fingerprints``): the fingerprint's own time against the step's, on the
demo's model and on config B, with a run without fingerprints as the peer in the same invocation.

    python benchmarks/bench_fingerprints.py [--steps 30]

Each case runs the GRPO recipe (the demo on 2 ranks as `make demo` does, config B on one process; one torch thread
per rank), fingerprints on and off, on the arithmetic task, with the same seed. It prints the median step time of
each (steps 2..N), the median time of the fingerprint itself (``time/fingerprint_s``, rank 0's: hashing the batch,
the losses and every weight, and the write) and its ratio to the step. The on / off step-time ratio is printed too;
on a shared machine it is noisier than the direct measurement.
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

#: the demo's model and batch (experiments/presets/demo/arithmetic.yaml) and config B (benchmarks/RESULTS.md)
CASES = {
    "demo": ["preset=demo/arithmetic", "prompts_per_step=32", "rollout.n=16", "rollout.max_new_tokens=6"],
    "B": [
        "model.tiny.hidden_size=256",
        "model.tiny.num_layers=4",
        "model.tiny.num_heads=4",
        "model.tiny.num_kv_heads=2",
        "model.tiny.intermediate_size=688",
        "prompts_per_step=16",
        "rollout.n=8",
        "rollout.max_new_tokens=32",
        "data.max_prompt_length=16",
        "reward.fn=arithmetic",
        "actor.fsdp.micro_batch_size=64",
    ],
}


#: ranks per case: the demo as `make demo` runs it (2 ranks), config B on one process as its other benchmarks
NPROC = {"demo": 2, "B": 1}


def run_case(case: str, fingerprints: bool, steps: int, data: Path, root: Path) -> list[dict]:
    name = f"{case}_{'on' if fingerprints else 'off'}"
    ranks = NPROC[case]
    launcher = (
        [sys.executable]
        if ranks == 1
        else [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", str(ranks)]
    )
    cmd = [
        *launcher,
        str(ROOT / "experiments" / "grpo.py"),
        *CASES[case],
        f"name={name}",
        f"steps={steps}",
        f"run_root={root}",
        f"data.train_files={data / 'train.jsonl'}",
        f"data.val_files={data / 'val.jsonl'}",
        "sft.files=",
        "eval.before_training=false",
        "eval.every=0",
        "eval.max_prompts=8",
        "checkpoint.every=0",
        "logger=[jsonl]",
        "export.hf=false",
        f"debug.fingerprints={str(fingerprints).lower()}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    (run_dir,) = root.glob(f"{name}-*")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] > 1 and "step_time_s" in r]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--cases", default="demo,B")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from experiments.tasks.arithmetic import write_dataset

    with tempfile.TemporaryDirectory(prefix="rlfunc-fingerprints-") as tmp:
        data = write_dataset(Path(tmp) / "data")
        print(f"{'case':<6}{'step on ms':>12}{'step off ms':>13}{'on/off':>8}{'fingerprint ms':>16}{'share':>8}")
        for case in args.cases.split(","):
            on = run_case(case, True, args.steps, data, Path(tmp) / "runs")
            off = run_case(case, False, args.steps, data, Path(tmp) / "runs")
            step_on = statistics.median(r["step_time_s"] for r in on)
            step_off = statistics.median(r["step_time_s"] for r in off)
            fingerprint = statistics.median(r["time/fingerprint_s"] for r in on)
            print(
                f"{case:<6}{step_on * 1e3:>12.1f}{step_off * 1e3:>13.1f}{step_on / step_off:>8.3f}"
                f"{fingerprint * 1e3:>16.2f}{fingerprint / step_on:>8.2%}"
            )


if __name__ == "__main__":
    main(sys.argv[1:])

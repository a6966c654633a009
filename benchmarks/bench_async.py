"""Asynchronous GRPO (or PPO: ``--recipe ppo``) on a split placement against synchronous runs, on 2 ranks, from one
SFT'd start.

- (a) ``sync`` colocated: both ranks sample and train (the default recipe);
- (b) ``sync`` on the split placement: rank 1 samples, rank 0 trains (``offpolicy.rollout_ranks=1``);
- (c) ``one_step_off`` on that split: batch ``s`` is sampled while update ``s - 1`` trains;
- (d) ``bounded`` with ``max_staleness=2``.

Every run starts from the same policy: the arithmetic task's tiny model after the demo's SFT stage (done once,
``--sft-steps``). Its answers are a few tokens long; with ``--long-tail`` the SFT responses restate the answer a
heavy-tailed number of times before it (``--think-mean`` on average, at most ``--think-max``; see
experiments/tasks/arithmetic.py), so most responses are short and a few are long, and ``rollout.max_new_tokens``
grows to fit. Each run trains ``--steps`` steps of the recipe (GRPO with ``preset=demo/arithmetic``, PPO with
``preset=demo/ppo_arithmetic``) and reports, from its metrics: the RL loop's time (the trainer's step times plus
weight pushes), samples per second, the median rollout wait and update time per step, the mean and largest response
length, and the held-out success before, after the steps and at a fixed wall time (``--wall-s``, default the
shortest run's loop time): the last evaluation (every ``--eval-every`` steps) within that much loop time. The
colocated loop's time leaves its evaluations out, while a split run's rollout pool evaluates in its sampling time,
which its trainer may wait for: the fixed-wall-time read slightly favours the colocated run.

Then the yardsticks: the ideal overlap measured in (b), (rollout + update) / max(rollout, update); (c)'s and
(d)'s speed-up over (b) and its share of that ideal; and the prediction of ``backends.training.async_planner``
(per-token rollout and update costs fitted on (b)'s steps, applied to each run's own token counts) beside the
measured loop time. Not a timed test: it prints numbers. Paste the output into benchmarks/RESULTS.md with the date,
the machine and the command.

    python benchmarks/bench_async.py                                   # a, b, c, d; seeds 0,1,2 for a and c
    python benchmarks/bench_async.py --configs b,c --seeds 0 --steps 40
    python benchmarks/bench_async.py --long-tail --steps 150            # long-tailed response lengths
    python benchmarks/bench_async.py -- algo.rollout_is=token          # extra overrides for every run
    python benchmarks/bench_async.py --recipe ppo --configs b,c --seeds 0 --steps 60
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
#: recipe -> (script, the preset of its runs); the shared start is the GRPO demo's SFT stage either way
RECIPES = {
    "grpo": (ROOT / "experiments" / "grpo.py", "demo/arithmetic"),
    "ppo": (ROOT / "experiments" / "ppo.py", "demo/ppo_arithmetic"),
}
CONFIGS = {
    "a": ("sync, colocated", [], 0),
    "b": ("sync, split 1+1", ["offpolicy.rollout_ranks=1", "offpolicy.mode=sync"], 0),
    "c": ("one_step_off, split 1+1", ["offpolicy.rollout_ranks=1", "offpolicy.mode=one_step_off"], 1),
    "d": (
        "bounded k=2, split 1+1",
        ["offpolicy.rollout_ranks=1", "offpolicy.mode=bounded", "offpolicy.max_staleness=2"],
        2,
    ),
}
MANY_SEEDS = ("a", "c")  # the three-seed configurations; b and d run the first seed only


def torchrun(recipe: Path, args: list[str], log: Path) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
    }
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2", str(recipe), *args]
    with open(log, "w") as out:
        done = subprocess.run(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{log.read_text()[-3000:]}")


def only_run_dir(root: Path, name: str) -> Path:
    (run_dir,) = sorted(root.glob(f"{name}-*"))[-1:]
    return run_dir


def read_run(run_dir: Path, split: bool) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1 and "step_time_s" in r]
    for r in steps:  # PPO's colocated loop logs its phases as time/<phase>_s
        r.setdefault("rollout_time_s", r.get("time/rollout_s", 0.0))
    summary = json.loads((run_dir / "summary.json").read_text())
    # colocated step_time_s holds the weight sync; the split trainer logs its push as sync_time_s beside it
    loop = [r["step_time_s"] + (r.get("sync_time_s", 0.0) if split else 0.0) for r in steps]
    elapsed = list(itertools.accumulate(loop))
    key = next((k for r in rows for k in r if k.startswith("val/mean@")), None)
    # (loop seconds so far, held-out success) at every evaluation: what a fixed wall time would have ended with
    evals = [(0.0, summary["eval_before"])] + [(t, r[key]) for t, r in zip(elapsed, steps) if key in r]
    # the actor update's sequences; PPO's critic warm-up steps update the critic alone, on the same batch
    samples = sum(r["num_seqs"] if "num_seqs" in r else r["critic/num_seqs"] for r in steps)
    tokens = [r["num_tokens"] if "num_tokens" in r else r["critic/num_tokens"] for r in steps]
    return {
        "steps": len(steps),
        "loop_s": sum(loop),
        "samples_per_s": samples / sum(loop),
        "rollout_s": statistics.median(r["rollout_time_s"] for r in steps),
        "update_s": statistics.median(r["step_time_s"] - r["rollout_time_s"] for r in steps),
        "push_s": statistics.median(r.get("sync_time_s", 0.0) for r in steps),
        "length": statistics.mean(r["response_length"] for r in steps),
        "longest": statistics.mean(r["response_length_max"] for r in steps),
        "before": summary["eval_before"],
        "after": summary["eval_after"],
        "evals": evals,
        "per_step": [
            (n, r["rollout_time_s"], r["step_time_s"] - r["rollout_time_s"], r.get("sync_time_s", 0.0))
            for n, r in zip(tokens, steps)
        ],
    }


def held_out_at(run: dict, wall_s: float) -> float:
    """The held-out success of the last evaluation within ``wall_s`` seconds of the run's loop."""
    return [score for t, score in run["evals"] if t <= wall_s][-1]


def predict(b: dict, run: dict, lag: int) -> float:
    """The planner's loop time for ``run``'s token counts with costs fitted on (b)'s steps."""
    from backends.training.async_planner import fit_costs, simulate_split

    tokens_b, rollout_b, update_b, push_b = zip(*b["per_step"])
    rollout_cost, update_cost = fit_costs(tokens_b, rollout_b), fit_costs(tokens_b, update_b)
    tokens = [t for t, *_ in run["per_step"]]
    return simulate_split(
        [rollout_cost(t) for t in tokens], [update_cost(t) for t in tokens], statistics.mean(push_b), lag=lag
    ).total_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="grpo")
    parser.add_argument("--configs", default="a,b,c,d")
    parser.add_argument("--seeds", default="0,1,2", help="for (a) and (c); (b) and (d) run the first")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--sft-steps", type=int, default=300, help="SFT updates of the shared start (the demo's)")
    parser.add_argument("--long-tail", action="store_true", help="heavy-tailed response lengths (filler thoughts)")
    parser.add_argument("--think-mean", type=float, default=3.0, help="--long-tail: restatements of the answer, mean")
    parser.add_argument("--think-max", type=int, default=12, help="--long-tail: restatements of the answer, most")
    parser.add_argument(
        "--eval-every", type=int, default=25, help="held-out evaluation every N steps (the fixed-wall-time read)"
    )
    parser.add_argument(
        "--wall-s",
        type=float,
        default=0.0,
        help="the fixed wall time of the held-out comparison (default: the shortest run's loop time)",
    )
    parser.add_argument("--keep", default="", help="keep the runs under this dir (default: a temporary one)")
    parser.add_argument("overrides", nargs="*", help="extra recipe overrides for every run (after --)")
    args = parser.parse_args()
    from experiments.tasks.arithmetic import write_dataset

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="rlfunc-async-"))
    think = {"think_mean": args.think_mean, "think_max": args.think_max} if args.long_tail else {}
    data = write_dataset(root / "data", **think)
    recipe, preset = RECIPES[args.recipe]
    common = [
        f"data.train_files={data / 'train.jsonl'}",
        f"data.val_files={data / 'val.jsonl'}",
        f"eval.every={args.eval_every}",
        "logger=jsonl",
        "checkpoint.every=0",
    ]
    if args.long_tail:  # room for the longest thought (answers up to 3 digits and a comma), "####" and the answer
        common.append(f"rollout.max_new_tokens={4 * args.think_max + 8}")
    print(f"start: {args.sft_steps} SFT steps -> {root / 'start'}", flush=True)
    torchrun(
        RECIPES["grpo"][0],
        [
            "preset=demo/arithmetic",
            *common,
            f"run_root={root / 'start'}",
            "name=start",
            f"sft.files={data / 'sft.jsonl'}",
            f"sft.steps={args.sft_steps}",
            "steps=1",
            "eval.max_prompts=8",
        ],
        root / "start.log",
    )
    start = only_run_dir(root / "start", "start") / "sft_model"
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[str, list[dict]] = {}
    for key in [c.strip() for c in args.configs.split(",") if c.strip()]:
        title, extra, _ = CONFIGS[key]
        for seed in seeds if key in MANY_SEEDS else seeds[:1]:
            name = f"{key}_seed{seed}"
            torchrun(
                recipe,
                [
                    f"preset={preset}",
                    *common,
                    f"run_root={root / 'runs'}",
                    f"name={name}",
                    f"model.path={start}",
                    "sft.files=",
                    f"steps={args.steps}",
                    f"seed={seed}",
                    *extra,
                    *args.overrides,
                ],
                root / f"{name}.log",
            )
            results.setdefault(key, []).append(read_run(only_run_dir(root / "runs", name), split=bool(extra)))
            r = results[key][-1]
            print(
                f"({key}) {title}, seed {seed}: {r['loop_s']:.1f} s loop, {r['samples_per_s']:.1f} samples/s, "
                f"held-out {r['before']:.1%} -> {r['after']:.1%}",
                flush=True,
            )
    report(
        results,
        args.steps,
        args.recipe.upper(),
        args.wall_s or min(r["loop_s"] for runs in results.values() for r in runs),
    )


def report(results: dict[str, list[dict]], steps: int, recipe: str, wall_s: float) -> None:
    print(
        f"\n{steps} {recipe} steps per run; medians per step; held-out: mean over seeds (min..max), after the steps "
        f"and at a fixed wall time of {wall_s:.1f} s of loop (the last evaluation by then)"
    )
    print(
        "config | seeds | loop s | samples/s | rollout wait s | update s | push s | resp. length mean / batch max | "
        f"held-out after {steps} steps | held-out at {wall_s:.0f} s"
    )
    for key, runs in results.items():
        after, at_wall = [r["after"] for r in runs], [held_out_at(r, wall_s) for r in runs]
        mean = lambda k: statistics.mean(r[k] for r in runs)
        print(
            f"({key}) {CONFIGS[key][0]} | {len(runs)} | {mean('loop_s'):.1f} | {mean('samples_per_s'):.1f} | "
            f"{mean('rollout_s'):.3f} | {mean('update_s'):.3f} | {mean('push_s'):.3f} | "
            f"{mean('length'):.1f} / {mean('longest'):.1f} | "
            f"{statistics.mean(after):.1%} ({min(after):.1%}..{max(after):.1%}) | "
            f"{statistics.mean(at_wall):.1%} ({min(at_wall):.1%}..{max(at_wall):.1%})"
        )
    if "b" not in results:
        return
    from backends.training.async_planner import ideal_overlap

    b = results["b"][0]
    _, rollout_b, update_b, push_b = zip(*b["per_step"])
    ideal = ideal_overlap(rollout_b, update_b, push_b)
    print(f"\nideal overlap measured in (b): (rollout + update) / max(rollout, update) = {ideal:.2f}x")
    for key in ("c", "d"):
        for i, run in enumerate(results.get(key, [])):
            speedup = b["loop_s"] / run["loop_s"]
            predicted = predict(b, run, CONFIGS[key][2])
            print(
                f"({key}) run {i}: speed-up over (b) {speedup:.2f}x = {speedup / ideal:.0%} of the ideal; "
                f"planner: {predicted:.1f} s loop predicted, {run['loop_s']:.1f} s measured "
                f"({b['loop_s'] / predicted:.2f}x predicted speed-up)"
            )


if __name__ == "__main__":
    main()

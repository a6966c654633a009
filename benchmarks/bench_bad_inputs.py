"""Time to error of bad inputs a user gives the GRPO recipe: each case is a command line of ``experiments/grpo.py``
(a small tiny model, 2 steps) run as a user runs it, from a repository root, so one version can be compared with
another (issue 36's before / after table).

Run: ``.venv/bin/python benchmarks/bench_bad_inputs.py [--root ROOT] [CASE-SUBSTRING ...]`` (ROOT: the repository
whose code runs, default this one). Writes its data under ``$TMPDIR/bench_bad_inputs``. Prints one JSON line per
case: the exit code, the wall seconds from start to exit (imports included), the peak RSS (``/usr/bin/time``, MB) and
the line that explains the exit: the error, or for the cases that should warn, the warning.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATA = Path(tempfile.gettempdir()) / "bench_bad_inputs"
WARNING = re.compile(
    r"WARNING.*(held-out data is training|empty content|fewer than prompts_per_step"
    r"|rollout\.n=1 with)"
)
ERROR = re.compile(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception)\b|^error:")


def chat_row(i: int) -> dict:
    return {"prompt": [{"role": "user", "content": f"{i}+{i}="}], "answer": str(2 * i)}


def write_jsonl(name: str, rows: list) -> str:
    (DATA / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(DATA / name)


def cases() -> dict[str, list[str]]:
    """The bad inputs (written under DATA) as the overrides that bring them in."""
    DATA.mkdir(exist_ok=True)
    (DATA / "array.json").write_text(json.dumps([chat_row(i) for i in range(4)], indent=2))
    (DATA / "deep.jsonl").write_text(json.dumps(chat_row(1)) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    (DATA / "f").write_text("x")
    (DATA / "gen.py").write_text("def fn(r, g):\n    yield 1.0\n")
    (DATA / "unpick.py").write_text("def fn(r, g):\n    return (x for x in [1.0])\n")
    (DATA / "algo.py").write_text(
        "def positional(scores, group_ids):\n    return scores - scores.mean(), scores\n"
        "def centered(scores, *, group_ids, response_mask):\n    return scores - scores.mean(), scores\n"
        "def loss_positional(logprobs, old_logprobs, advantages):\n    return -(logprobs * advantages).mean(), {}\n"
        "def loss_float(logprobs, **kwargs):\n    return 0.5, {}\n"
    )
    empty_content = {"prompt": [{"role": "system", "content": ""}, {"role": "user", "content": "1+1="}], "answer": "2"}
    train = write_jsonl("train.jsonl", [chat_row(i) for i in range(8)])
    big = write_jsonl("big.jsonl", [chat_row(1), {"prompt": "7" * 5_000_000, "answer": "1"}])
    null = write_jsonl("null.jsonl", [chat_row(1), {"prompt": "2+2=", "answer": None}])
    empty = write_jsonl("empty.jsonl", [chat_row(i) for i in range(7)] + [empty_content])
    few = write_jsonl("few.jsonl", [chat_row(i) for i in range(3)])
    return {
        "data-huge-prompt (5 MB)": [f"data.train_files={big}"],
        "data-huge-prompt-truncated (5 MB, left)": [f"data.train_files={big}", "data.truncation=left"],
        "data-json-array-file": [f"data.train_files={DATA / 'array.json'}"],
        "data-deep-json": [f"data.train_files={DATA / 'deep.jsonl'}"],
        "data-null-answer": [f"data.train_files={null}"],
        "checkpoint-keep-last-zero": ["checkpoint.every=1", "checkpoint.keep_last=0"],
        "checkpoint-dir-under-a-file": ["checkpoint.every=1", f"checkpoint.dir={DATA / 'f' / 'ckpt'}"],
        "checkpoint-dir-unwritable": ["checkpoint.every=1", "checkpoint.dir=/proc/rlfunc-ckpt"],
        "reward-generator-function": [f"reward.fn={DATA / 'gen.py'}:fn"],
        "reward-unpicklable-result-in-a-worker": [f"reward.fn={DATA / 'unpick.py'}:fn"],
        "algo-estimator-wrong-signature": [f"algo.estimator={DATA / 'algo.py'}:positional"],
        "algo-estimator-wrong-shape": [f"algo.estimator={DATA / 'algo.py'}:centered"],
        "algo-loss-wrong-signature": [f"algo.policy_loss={DATA / 'algo.py'}:loss_positional"],
        "algo-loss-returns-a-float": [f"algo.policy_loss={DATA / 'algo.py'}:loss_float"],
        "algo-reference-misspelt": [f"algo.estimator={DATA / 'algo.py'}:centred"],
        "algo-passk-with-one-sample": ["algo.estimator=grpo_passk", "rollout.n=1"],
        "algo.policy_loss=sapo (built-in)": ["algo.policy_loss=sapo"],
        "warn: train = val": [f"data.val_files={train}"],
        "warn: empty message content": [f"data.train_files={empty}"],
        "warn: fewer rows than a step": [f"data.train_files={few}"],
        "warn: rollout.n=1 with grpo": ["rollout.n=1"],
    }


def base_overrides() -> list[str]:
    """A run that gets through 2 steps in seconds when nothing is wrong."""
    val = write_jsonl("val.jsonl", [chat_row(i) for i in range(8, 12)])
    return [
        f"data.train_files={DATA / 'train.jsonl'}",
        f"data.val_files={val}",
        "reward.fn=exact",
        "steps=2",
        "prompts_per_step=4",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        "data.max_prompt_length=32",
        "eval.n=1",
        "export.hf=false",
        "logger=jsonl",
        f"run_root={DATA / 'runs'}",
        "model.tiny.hidden_size=64",
        "model.tiny.num_layers=1",
        "model.tiny.num_heads=2",
        "model.tiny.num_kv_heads=1",
        "model.tiny.intermediate_size=64",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--root", default=str(Path(__file__).resolve().parents[1]), help="the repository whose code runs"
    )
    parser.add_argument("only", nargs="*", help="run only the cases whose name holds one of these")
    args = parser.parse_args(argv)
    root = Path(args.root)
    table = cases()
    base = base_overrides()
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for name, extra in table.items():
        if args.only and not any(o in name for o in args.only):
            continue
        cmd = ["/usr/bin/time", "-f", "MAXRSS_KB=%M", sys.executable, "experiments/grpo.py", *base, *extra]
        t0 = time.time()
        try:
            out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
            rc, text = out.returncode, out.stdout + out.stderr
        except subprocess.TimeoutExpired:
            rc, text = "timeout", ""
        lines = [line for line in text.splitlines() if line.strip() and not line.startswith("MAXRSS")]
        errors = [line for line in lines if ERROR.search(line.strip())]
        warnings = [line for line in lines if WARNING.search(line)]
        rss = re.findall(r"MAXRSS_KB=(\d+)", text)
        print(
            json.dumps(
                {
                    "case": name,
                    "rc": rc,
                    "s": round(time.time() - t0, 1),
                    "rss_mb": int(rss[-1]) // 1024 if rss else None,
                    "line": (errors[-1] if errors else warnings[0] if warnings else "")[:400],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()

"""Where two runs part: the first step whose fingerprints differ, and within it the first stage and tensor.

    python -m backends.loop.bisect runs/grpo-a runs/grpo-b

reads both runs' ``fingerprints/rank<r>.jsonl`` (written every step with ``debug.fingerprints=true``, the default) and
prints the first difference in the order a step makes its tensors (:data:`backends.loop.fingerprints.STAGES`:
samples -> scores -> log-probs -> advantages -> loss -> gradient -> weights), with its size (the two sums and
absolute maxima), or that the runs agree bit for bit on every step both logged. Exit status 0 when they agree, 1
when they differ, 2 on bad input.

When both runs recorded that step (``debug.record_steps`` / ``record_every``), it is replayed
(:mod:`backends.loop.replay`) on each side, which shows whether each run's step follows from its recorded inputs
(a nondeterministic run does not), and, when the difference is in the training half of the step, the first run's
step again under the second run's settings (the keys that differ in their ``config.json``): identical to the
second run's step means those settings, in this step, are the cause, not anything before it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs

from backends.checkpoint.fingerprint import flatten_config
from backends.loop.fingerprints import STAGES, read_run
from backends.loop.records import read_record, record_dir
from backends.loop.vocabulary import RESUMABLE_KEYS

__all__ = ["Difference", "changed_settings", "first_difference", "read_fingerprints", "replay_sides", "main"]


@attrs.frozen
class Difference:
    """The first place two runs differ."""

    step: int
    stage: str  #: one of STAGES, or "steps" when one run logged a step the other did not
    tensor: str  #: the tensor's name (``name@rank`` with several ranks)
    a: dict | None  #: its fingerprint in the first run (None: absent there)
    b: dict | None

    def describe(self) -> str:
        if self.stage == "steps":
            return f"step {self.step}: logged by only one of the runs ({self.tensor})"
        where = f"step {self.step}, stage {self.stage}, tensor {self.tensor}"
        if self.a is None or self.b is None:
            return f"{where}: present in only one of the runs"
        if self.a["shape"] != self.b["shape"]:
            return f"{where}: shape {self.a['shape']} vs {self.b['shape']}"
        return (
            f"{where}: sum {self.a['sum']:.9g} vs {self.b['sum']:.9g} "
            f"(difference {self.b['sum'] - self.a['sum']:.3g}), "
            f"absmax {self.a['absmax']:.9g} vs {self.b['absmax']:.9g}"
        )


def read_fingerprints(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """A run's fingerprints by step (every rank's merged); a missing file or a bad line is an error naming it."""
    return read_run(run_dir)


def first_difference(a: dict[int, dict], b: dict[int, dict]) -> Difference | None:
    """The first step, stage and tensor whose fingerprints differ between two runs' rows; None if none does."""
    for step in sorted(set(a) | set(b)):
        if step not in a or step not in b:
            return Difference(
                step=step, stage="steps", tensor="first run" if step in a else "second run", a=None, b=None
            )
        for stage in STAGES:
            fa, fb = a[step].get(stage, {}), b[step].get(stage, {})
            for name in [*fa, *(n for n in fb if n not in fa)]:
                if fa.get(name) is None or fb.get(name) is None or fa[name]["hash"] != fb[name]["hash"]:
                    return Difference(step=step, stage=stage, tensor=name, a=fa.get(name), b=fb.get(name))
    return None


def changed_settings(a: str | Path, b: str | Path) -> list[str]:
    """``key=value`` for every setting of run ``b`` that differs from run ``a``'s (their ``config.json``), leaving
    out those that only say where things go (:data:`backends.loop.vocabulary.RESUMABLE_KEYS`)."""
    ca, cb = (flatten_config(json.loads((Path(d) / "config.json").read_text())) for d in (a, b))
    return [
        f"{key}={_setting_text(cb[key])}"
        for key in sorted(cb)
        if key.split(".")[0] not in RESUMABLE_KEYS and ca.get(key) != cb[key]
    ]


def _setting_text(value: Any) -> str:
    """A config value as a command line override spells it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def replay_sides(a: Path, b: Path, difference: Difference) -> list[str]:
    """The replays of the first differing step (see the module docstring), one line each; a note when the step
    was not recorded in both runs."""
    step = difference.step
    if difference.stage == "steps" or not all(record_dir(d, step).is_dir() for d in (a, b)):
        return [f"(step {step} was not recorded in both runs: debug.record_steps=[{step}] records it for a replay)"]
    lines = [_replay(a, step), _replay(b, step)]
    if difference.stage in ("samples", "scores"):
        lines.append(
            f"the runs sampled or scored step {step} differently: that happens before the training half a replay "
            "runs again (compare the runs' seeds, data, engine and reward settings)"
        )
    else:
        lines.append(_replay(a, step, changed_settings(a, b), against=b))
    return lines


def _replay(run_dir: Path, step: int, overrides: list[str] = (), against: Path | None = None) -> str:
    """``python -m backends.loop.replay`` on as many ranks as the step was recorded on: its verdict line."""
    ranks = read_record(run_dir, step)["world_size"]
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    if ranks > 1:
        launcher += ["--nproc_per_node", str(ranks)]
    command = [*launcher, "-m", "backends.loop.replay", str(run_dir), "--step", str(step), *overrides]
    if against is not None:
        command += ["--against", str(against)]
    out = subprocess.run(command, capture_output=True, text=True)
    verdicts = [line for line in out.stdout.splitlines() if line.startswith("replay of ")]
    if out.returncode not in (0, 1) or not verdicts:
        return f"replay of step {step} of {run_dir} failed (exit {out.returncode}): {out.stderr.strip()[-800:]}"
    return verdicts[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backends.loop.bisect", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", type=Path, help="a run dir (with fingerprints/)")
    parser.add_argument("run_b", type=Path, help="the run dir to compare it with")
    parser.add_argument("--no-replay", action="store_true", help="do not replay a recorded differing step")
    args = parser.parse_args(argv)
    try:
        a, b = read_fingerprints(args.run_a), read_fingerprints(args.run_b)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    difference = first_difference(a, b)
    if difference is None:
        print(f"identical: {len(a)} step(s), every stage and tensor bit for bit")
        return 0
    print(f"first difference: {difference.describe()}")
    if not args.no_replay:
        print("\n".join(replay_sides(args.run_a, args.run_b, difference)))
    return 1


if __name__ == "__main__":
    sys.exit(main())

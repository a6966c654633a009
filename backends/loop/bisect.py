"""Where two runs part: the first step whose fingerprints differ, and within it the first stage and tensor.

    python -m backends.loop.bisect runs/grpo-a runs/grpo-b

reads both runs' ``fingerprints/rank<r>.jsonl`` (written every step with ``debug.fingerprints=true``, the default) and
prints the first difference in the order a step makes its tensors (:data:`backends.loop.fingerprints.STAGES`:
samples -> scores -> log-probs -> advantages -> loss -> gradient -> weights), with its size (the two sums and
absolute maxima), or that the runs agree bit for bit on every step both logged. Exit status 0 when they agree, 1
when they differ, 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import attrs

from backends.loop.fingerprints import STAGES, read_run

__all__ = ["Difference", "first_difference", "read_fingerprints", "main"]


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backends.loop.bisect", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", help="a run dir (with fingerprints/)")
    parser.add_argument("run_b", help="the run dir to compare it with")
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
    return 1


if __name__ == "__main__":
    sys.exit(main())

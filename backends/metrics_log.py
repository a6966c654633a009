"""Per-step metrics of a run: console line, ``metrics.jsonl``, TensorBoard, and a reward-curve PNG.

Only the main rank writes; the other ranks get a logger whose methods do nothing, so recipes call it
unconditionally.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

__all__ = ["MetricsLog", "plot_curves", "read_jsonl"]


class MetricsLog:
    """Append-only metrics sink for one run directory."""

    def __init__(self, run_dir: str | os.PathLike, *, enabled: bool = True, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def _plain(v: Any) -> Any:
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(rows: list[Mapping[str, Any]], keys: list[str], out_png: str | os.PathLike, *, title: str = "") -> None:
    """Plot ``keys`` against ``step`` (one panel each) into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in keys if any(k in r for r in rows)]
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.4 * max(1, len(keys))), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            ax.plot(*zip(*pts), marker=".", linewidth=1)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    if title:
        axes[0, 0].set_title(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)

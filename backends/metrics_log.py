"""Per-step metrics of a run, to the sinks a config names: console, ``metrics.jsonl``, TensorBoard, Weights & Biases.

``logger=console,jsonl,tensorboard,wandb`` picks the sinks (wandb is an optional extra: ``pip install wandb``;
``WANDB_MODE=offline`` keeps it off the network). Only the main rank writes; the other ranks get a logger
whose methods do nothing, so recipes call it unconditionally. :func:`plot_curves` draws a reward-curve PNG
from ``metrics.jsonl``, and :func:`write_generations` dumps sampled responses as JSONL.
"""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["LOGGERS", "MetricsLog", "plot_curves", "plot_panels", "read_jsonl", "write_generations"]

#: the sinks ``logger=`` may name
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")


class MetricsLog:
    """Append-only metrics sink for one run directory.

    ``console_keys``: the metrics of the console line (printed every ``console_every`` steps and at any step
    that has one of ``always_keys``, e.g. an evaluation).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        enabled: bool = True,
        loggers: Iterable[str] = ("jsonl", "tensorboard"),
        run_name: str = "",
        config: Mapping[str, Any] | None = None,
        console_keys: Sequence[str] = (),
        console_every: int = 10,
        always_keys: Sequence[str] = (),
    ) -> None:
        loggers = tuple(loggers)
        unknown = [name for name in loggers if name not in LOGGERS]
        if unknown:
            raise ValueError(f"logger: unknown sink(s) {unknown}; choose from {', '.join(LOGGERS)}")
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.console = "console" in loggers
        self.console_keys, self.console_every, self.always_keys = tuple(console_keys), console_every, tuple(always_keys)
        self._jsonl = self._tb = self._wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if "jsonl" in loggers:
            self._jsonl = _JsonlAppender(self.run_dir / "metrics.jsonl")
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if "wandb" in loggers:
            try:
                import wandb
            except ImportError:
                raise ValueError(
                    "logger=wandb needs the wandb package (pip install wandb, or the `wandb` extra)"
                ) from None
            self._wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "rlfunc"),
                name=run_name or self.run_dir.name,
                dir=str(self.run_dir),
                config=dict(config or {}),
                reinit="finish_previous",
            )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        if self._jsonl is not None:
            self._jsonl.append(json.dumps(row))
        numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(numbers, step=max(step, 0))
        if self.console and (step % self.console_every == 0 or any(k in row for k in self.always_keys)):
            shown = [k for k in (*self.console_keys, *self.always_keys) if k in numbers]
            if shown:
                print(f"step {step:5d} " + " ".join(f"{k}={numbers[k]:.4g}" for k in shown), flush=True)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class _JsonlAppender:
    """Appends whole lines to a JSONL file: a row is on disk in full or not at all.

    Each row is one ``write`` of its bytes to an ``O_APPEND`` descriptor (no buffer that could keep half a
    row to flush later). A write that fails part-way (a full disk) is cut back off the file before the
    error is raised, so the rows before it stay intact and the next row starts on a line of its own.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, line: str) -> None:
        data = (line + "\n").encode()
        size = os.fstat(self._fd).st_size
        try:
            written = 0
            while written < len(data):
                written += os.write(self._fd, data[written:])
        except OSError as e:
            try:
                os.ftruncate(self._fd, size)
            except OSError:
                pass
            reason = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
            raise OSError(
                e.errno,
                f"writing a metrics row to {str(self.path)!r} failed: {reason}; the rows logged before it are intact",
                str(self.path),
            ) from e

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _plain(v: Any) -> Any:
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_generations(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write ``rows`` (prompt, response, reward, ...) as JSONL to ``path`` (written whole, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({k: _plain(v) for k, v in row.items()}, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


def plot_panels(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> list[str]:
    """The keys :func:`plot_curves` draws: those with a number in some row that is not the same in every row that has
    it (a metric constant for the run, such as an on-policy run's ``clip_frac``, says nothing as a curve)."""
    panels = []
    for key in keys:
        values = {r[key] for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)}
        if len(values) > 1:
            panels.append(key)
    return panels


def plot_curves(rows: list[Mapping[str, Any]], keys: list[str], out_png: str | os.PathLike, *, title: str = "") -> None:
    """Plot ``keys`` against ``step`` (one panel each, each over the steps that have it: the SFT stage's negative
    steps, the RL steps) into a PNG, leaving out what :func:`plot_panels` leaves out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = plot_panels(rows, keys) or keys[:1]
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.4 * max(1, len(keys))), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            ax.plot(*zip(*pts), marker=".", linewidth=1)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step (the SFT stage's are negative)")
    if title:
        axes[0, 0].set_title(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)

"""A recipe's peak GPU memory per phase of each step: rollout, log-prob passes, update, weight sync, eval.

Run in place of the recipe's script, with the recipe's module first:

    torchrun --standalone --nproc_per_node 1 benchmarks/phase_memory.py grpo preset=... [overrides]

Each phase the recipe marks for its watchdog (``backends.distributed.watchdog.phase``) resets the CUDA peak on
entry and prints one line on exit: ``MEM <phase> step=N start=<GiB> peak=<GiB> end=<GiB>``
(``torch.cuda.memory_allocated`` at entry and exit, ``max_memory_allocated`` in between). The update phase
also holds the log-prob passes: the line ``MEM logprobs`` is their peak, printed (and the peak reset) when
the optimizer steps begin. A phase nested in another (the reward inside the rollout) hands its peak on to the
outer one, whose line covers both.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from backends.distributed import watchdog  # noqa: E402

GIB = 2**30
_phase, _waiting_on = watchdog.phase, watchdog.waiting_on
_open_peaks: list[int] = []  #: per open phase, outermost first: its peak before the CUDA peak was last reset


def _reset_peak() -> None:
    """Reset the CUDA peak, first handing it to every open phase."""
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    _open_peaks[:] = [max(p, peak) for p in _open_peaks]
    torch.cuda.reset_peak_memory_stats()


@contextlib.contextmanager
def phase(kind: str, **kwargs: Any) -> Iterator[None]:
    _reset_peak()
    start = torch.cuda.memory_allocated()
    _open_peaks.append(start)
    try:
        with _phase(kind, **kwargs):
            yield
    finally:
        _reset_peak()
        peak = _open_peaks.pop()
    print(
        f"MEM {kind} step={kwargs.get('step')} start={start / GIB:.2f} peak={peak / GIB:.2f} "
        f"end={torch.cuda.memory_allocated() / GIB:.2f}",
        flush=True,
    )


def waiting_on(op: str) -> None:
    if "update" in op and _open_peaks:  # the recipes' log-prob passes are done; the optimizer steps begin
        torch.cuda.synchronize()
        print(
            f"MEM logprobs peak={torch.cuda.max_memory_allocated() / GIB:.2f} "
            f"now={torch.cuda.memory_allocated() / GIB:.2f}",
            flush=True,
        )
        _reset_peak()
    _waiting_on(op)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-") or "=" in sys.argv[1]:
        sys.exit("usage: phase_memory.py RECIPE [overrides], RECIPE one of grpo, ppo, custom_algorithm")
    if not torch.cuda.is_available():
        sys.exit("phase_memory.py needs CUDA: no GPU is visible to torch here")
    recipe = importlib.import_module(f"experiments.{sys.argv[1]}")
    watchdog.phase, watchdog.waiting_on = phase, waiting_on
    recipe.main(sys.argv[2:])


if __name__ == "__main__":
    main()

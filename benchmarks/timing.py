"""Timing helper shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall-clock seconds of ``reps`` calls of ``fn``, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)

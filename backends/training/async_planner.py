"""What an asynchronous split-placement run should gain over a synchronous one: a small event simulation of
the rollout pool and the trainer pool under the split loop's fixed schedule, driven by per-step costs.

The schedule is the one ``backends/loop/split.py`` runs with lag ``L`` (``sync`` 0, ``one_step_off`` 1,
``bounded`` ``max_staleness``):

- the rollout pool samples batch ``s`` with weights version ``max(0, s - 1 - L)``; it receives version ``v >= 1``
  just before sampling batch ``v + 1 + L`` (after the last batch, the remaining versions in order);
- the trainer updates on batch ``s`` once it has arrived and update ``s - 1`` is pushed, then pushes version
  ``s``. The push is a broadcast, so it completes only when the rollout pool takes part in it: a trainer that
  finishes while the rollout pool is still sampling waits for it.

Costs per step: ``rollout_s`` (sampling, scoring and the batch's transfer), ``train_s`` (the old log-probs,
advantages and the optimizer steps), ``push_s`` (gathering and broadcasting the weights). A synchronous run
takes the sum of the three per step; the ideal asynchronous one ``max(rollout, train + push)``.
:func:`fit_costs` turns the per-step times and token counts measured in one run into per-token costs, so the
gain of a run with other response lengths can be predicted (``benchmarks/bench_async.py`` compares the
prediction with a measurement).
"""

from __future__ import annotations

from typing import Sequence

import attrs

__all__ = ["SimulatedRun", "StepCost", "fit_costs", "ideal_overlap", "simulate_split"]


@attrs.frozen
class SimulatedRun:
    total_s: float  #: from the first rollout's start to the last push's end
    trainer_idle_s: float  #: trainer time spent waiting for batches or for the rollout pool to take the weights
    rollout_idle_s: float  #: rollout time spent waiting for weights
    batch_ready_s: tuple[float, ...]  #: when each batch reached the trainer
    pushed_s: tuple[float, ...]  #: when each weights version reached the rollout pool


def per_step(cost: Sequence[float] | float, steps: int) -> list[float]:
    """One cost per step: a scalar repeated ``steps`` times, or the given sequence as floats."""
    return [float(cost)] * steps if isinstance(cost, (int, float)) else [float(x) for x in cost]


def simulate_split(
    rollout_s: Sequence[float], train_s: Sequence[float], push_s: Sequence[float] | float = 0.0, *, lag: int
) -> SimulatedRun:
    """The split loop's timeline for ``len(rollout_s)`` steps with lag ``lag`` (see the module docstring)."""
    steps = len(rollout_s)
    push = per_step(push_s, steps)
    if len(train_s) != steps or len(push) != steps:
        raise ValueError(f"rollout_s, train_s and push_s need one cost per step: {steps}, {len(train_s)}, {len(push)}")
    if lag < 0:
        raise ValueError(f"lag must be >= 0, got {lag}")
    if min([*rollout_s, *train_s, *push], default=0.0) < 0:
        raise ValueError("costs must be >= 0")
    ready = [0.0] * (steps + 1)  # ready[s]: batch s sampled (index 0 unused)
    pushed = [0.0] * (steps + 1)  # pushed[v]: version v received by the rollout pool (version 0 at time 0)
    rollout_idle = trainer_idle = 0.0

    def sample(s: int) -> None:
        nonlocal rollout_idle
        version = s - 1 - lag
        start = ready[s - 1] if version < 1 else max(ready[s - 1], pushed[version])
        rollout_idle += start - ready[s - 1]
        ready[s] = start + rollout_s[s - 1]

    for s in range(1, min(lag + 1, steps) + 1):  # sampled with version 0, no wait
        sample(s)
    for v in range(1, steps + 1):
        if v + lag <= steps and v + lag > lag + 1:
            sample(v + lag)  # needs version v - 1, pushed in the previous iteration
        start = max(pushed[v - 1], ready[v])
        trainer_idle += start - pushed[v - 1]
        done = start + train_s[v - 1]
        taken = max(done, ready[min(v + lag, steps)])  # the pool joins the broadcast once it sampled batch v + lag
        trainer_idle += taken - done
        pushed[v] = taken + push[v - 1]
    return SimulatedRun(
        total_s=pushed[steps] if steps else 0.0,
        trainer_idle_s=trainer_idle,
        rollout_idle_s=rollout_idle,
        batch_ready_s=tuple(ready[1:]),
        pushed_s=tuple(pushed[1:]),
    )


def ideal_overlap(rollout_s: Sequence[float], train_s: Sequence[float], push_s: Sequence[float] | float = 0.0) -> float:
    """The issue's yardstick: (rollout + update) / max(rollout, update), summed over the steps of a synchronous run."""
    push = per_step(push_s, len(rollout_s))
    rollout, update = sum(rollout_s), sum(t + p for t, p in zip(train_s, push))
    return (rollout + update) / max(rollout, update) if max(rollout, update) > 0 else 1.0


@attrs.frozen
class StepCost:
    """An affine cost in a step's token count: ``fixed_s + per_token_s * tokens``."""

    fixed_s: float
    per_token_s: float

    def __call__(self, tokens: float) -> float:
        return max(0.0, self.fixed_s + self.per_token_s * tokens)


def fit_costs(tokens: Sequence[float], seconds: Sequence[float]) -> StepCost:
    """Least-squares affine fit of per-step ``seconds`` on per-step ``tokens``; a step count too small or token
    counts too alike for a slope give the mean cost per token instead."""
    n = len(tokens)
    if n != len(seconds) or n == 0:
        raise ValueError(f"need one time per token count and at least one step, got {n} and {len(seconds)}")
    mean_t, mean_s = sum(tokens) / n, sum(seconds) / n
    var = sum((t - mean_t) ** 2 for t in tokens)
    if n < 3 or var <= 1e-9 * max(mean_t * mean_t, 1.0) * n:
        return StepCost(0.0, mean_s / mean_t if mean_t > 0 else 0.0)
    slope = sum((t - mean_t) * (s - mean_s) for t, s in zip(tokens, seconds)) / var
    return StepCost(mean_s - slope * mean_t, slope)

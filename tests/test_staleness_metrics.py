"""One set of staleness metrics: the step's tokens (every recipe) and the split loop's bound, all ``staleness/*``,
with no name given twice."""

from __future__ import annotations

import torch

import rlfunc as rf
from backends.distributed.sample_channel import StalenessBound
from backends.loop.algorithm import stamp_policy_version


def _batch(rows: int = 4, length: int = 3) -> rf.RolloutBatch:
    return rf.RolloutBatch(
        prompt_ids=torch.ones(rows, 2, dtype=torch.long),
        prompt_mask=torch.ones(rows, 2, dtype=torch.bool),
        response_ids=torch.ones(rows, length, dtype=torch.long),
        response_mask=torch.ones(rows, length, dtype=torch.bool),
        group_ids=torch.arange(rows),
    )


def test_the_step_and_the_bound_log_one_set_of_staleness_metrics():
    batch, step = stamp_policy_version(_batch(), 3, current=5)
    assert (batch.policy_version == 3).all()
    bound = StalenessBound(max_staleness=2)
    assert bound.admit(4, 3) and bound.admit(5, 3) and not bound.admit(6, 3)
    run = bound.metrics()
    assert all(key.startswith("staleness/") for key in [*step, *run]) and not set(step) & set(run)
    assert {k: float(v) for k, v in step.items()} == {
        "staleness/min": 2.0,
        "staleness/mean": 2.0,
        "staleness/max": 2.0,
        "staleness/frac_0": 0.0,
        "staleness/frac_1": 0.0,
        "staleness/frac_2": 1.0,
        "staleness/frac_ge_3": 0.0,
    }
    assert run == {
        "staleness/accepted": 2.0,
        "staleness/rejected": 1.0,
        "staleness/bound": 2.0,
        "staleness/run_mean": 1.5,
        "staleness/run_max": 2.0,
    }

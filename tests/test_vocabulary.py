"""backends/loop/vocabulary.py: each built-in's typed knob section is that rlfunc function's own keyword arguments, with
rlfunc's defaults, and the loop's call reaches the function with them. Pure Python, no model: well under a second."""

from __future__ import annotations

import inspect

import attrs
import pytest

import rlfunc as rf
from backends.loop.vocabulary import EstimatorArgs, PolicyLossArgs, estimator_knobs, loss_knobs
from experiments.grpo import group_estimators

#: what the loop passes to every policy loss / group estimator (not a knob)
LOOP_KEYWORDS = {
    "old_logprobs",
    "advantages",
    "response_mask",
    "behaviour_logprobs",
    "is_weights",
    "agg",
    "norms",
    "horizon",
    "seed",
    "generator",
    "group_ids",
}


def _knobs(fn) -> dict:
    params = list(inspect.signature(fn).parameters.values())[1:]
    return {p.name: p.default for p in params if p.name not in LOOP_KEYWORDS}


@pytest.mark.parametrize("name", sorted(rf.POLICY_LOSSES))
def test_each_loss_section_is_the_losses_own_knobs_with_its_defaults(name):
    assert name in attrs.fields_dict(PolicyLossArgs), f"algo.policy_loss_args has no section for {name}"
    assert loss_knobs(PolicyLossArgs(), name) == _knobs(rf.POLICY_LOSSES[name])


@pytest.mark.parametrize("name", sorted(group_estimators()[0]))
def test_each_estimator_section_is_the_estimators_own_knobs_with_its_defaults(name):
    assert name in attrs.fields_dict(EstimatorArgs), f"algo.estimator_args has no section for {name}"
    assert estimator_knobs(EstimatorArgs(), name) == _knobs(rf.ADVANTAGE_ESTIMATORS[name])


def test_aliases_and_references_read_the_right_section():
    assert loss_knobs(PolicyLossArgs(), "clip-cov") == loss_knobs(PolicyLossArgs(), "clip_cov")
    assert loss_knobs(PolicyLossArgs(), "vanilla")["dual_clip"] == 3.0
    assert loss_knobs(PolicyLossArgs(), "ppo")["dual_clip"] is None
    assert estimator_knobs(EstimatorArgs(), "grpo_vectorized") == estimator_knobs(EstimatorArgs(), "grpo")
    assert loss_knobs(PolicyLossArgs(), "my_losses.py:mine") == {} == estimator_knobs(EstimatorArgs(), "pkg.m:fn")

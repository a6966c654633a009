"""Multi-turn trajectories in the pure core: per-turn rewards on tokens, and every estimator, loss and aggregation
mode treating the observation tokens (holes in the loss mask) as absent."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import rlfunc as rf

pytestmark = pytest.mark.multiturn


def test_turn_rewards_land_on_each_turns_last_model_token():
    turn_rewards = torch.tensor([[1.0, 2.0, 3.0], [5.0, 7.0, 0.0]])
    turn_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2], [0, 0, 1, 1, 1, 0, 0, 0]])
    loss_mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1], [1, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    out = rf.turn_rewards_to_tokens(turn_rewards, turn_ids=turn_ids, loss_mask=loss_mask)
    # row 1's second turn was cut before the model spoke: its reward has no token and is dropped
    assert out.tolist() == [[0, 1, 0, 0, 0, 2, 0, 3], [0, 5, 0, 0, 0, 0, 0, 0]]


@st.composite
def trajectories(draw):
    """A batch whose loss mask has holes (observations) between runs of model tokens, and the same batch with
    the holes squeezed out (every row's model tokens moved to the front)."""
    b = draw(st.integers(1, 4))
    t = draw(st.integers(2, 10))
    mask = torch.tensor(draw(st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=b, max_size=b)))
    mask[:, 0] = True  # every row has a model token
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    values = {name: torch.randn(b, t, generator=g) for name in ("logprobs", "old", "adv", "ref", "x")}
    return mask, values


def _squeeze(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The masked-in entries of each row moved to its front, the rest 0; and the matching prefix mask."""
    lengths = mask.sum(-1)
    dense_mask = torch.arange(mask.shape[1])[None] < lengths[:, None]
    out = torch.zeros_like(x)
    out[dense_mask] = x[mask]
    return out, dense_mask


AGGS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@given(trajectories(), st.sampled_from(AGGS))
@settings(max_examples=40, deadline=None)
def test_aggregation_ignores_the_holes(traj, agg):
    mask, v = traj
    norms = rf.local_normalizers(mask)
    squeezed, dense = _squeeze(v["x"], mask)
    holes = rf.aggregate(v["x"], mask=mask, mode=agg, norms=norms, horizon=mask.shape[1])
    packed = rf.aggregate(squeezed, mask=dense, mode=agg, norms=rf.local_normalizers(dense), horizon=mask.shape[1])
    torch.testing.assert_close(holes, packed)


@given(trajectories(), st.sampled_from(sorted(rf.POLICY_LOSSES)))
@settings(max_examples=60, deadline=None)
def test_no_policy_loss_reads_the_observation_tokens(traj, name):
    """Whatever sits at the observation positions (log-probs, old log-probs, advantages), the loss and its gradient
    at the model tokens are the same."""
    mask, v = traj
    loss_fn = rf.POLICY_LOSSES[name]
    norms = rf.local_normalizers(mask)

    def run(fill: float) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs = torch.where(mask, v["logprobs"] * 0.1, fill).requires_grad_()
        old = torch.where(mask, v["old"] * 0.1 + logprobs.detach(), -fill)
        adv = torch.where(mask, v["adv"], 3 * fill)
        loss, _ = loss_fn(
            logprobs,
            old_logprobs=old,
            advantages=adv,
            response_mask=mask,
            norms=norms,
            agg="token-mean",
            horizon=mask.shape[1],
        )
        (grad,) = torch.autograd.grad(loss, logprobs)
        return loss.detach(), grad

    base_loss, base_grad = run(0.0)
    other_loss, other_grad = run(-5.0)
    torch.testing.assert_close(other_loss, base_loss)
    torch.testing.assert_close(other_grad, base_grad)
    assert not base_grad[~mask].any()


@given(trajectories(), st.sampled_from(["k1", "k2", "k3"]))
@settings(max_examples=30, deadline=None)
def test_the_kl_loss_ignores_the_holes(traj, kind):
    mask, v = traj
    norms = rf.local_normalizers(mask)
    squeezed_lp, dense = _squeeze(v["logprobs"], mask)
    squeezed_ref, _ = _squeeze(v["ref"], mask)
    holes, _ = rf.kl_loss(v["logprobs"], ref_logprobs=v["ref"], mask=mask, kind=kind, agg="token-mean", norms=norms)
    packed, _ = rf.kl_loss(
        squeezed_lp,
        ref_logprobs=squeezed_ref,
        mask=dense,
        kind=kind,
        agg="token-mean",
        norms=rf.local_normalizers(dense),
    )
    torch.testing.assert_close(holes, packed)


@given(trajectories())
@settings(max_examples=30, deadline=None)
def test_group_estimators_and_gae_skip_the_holes(traj):
    mask, v = traj
    b = mask.shape[0]
    scores, groups = v["x"][:, 0], torch.arange(b) // 2
    squeezed_values, dense = _squeeze(v["ref"], mask)
    for name in ("grpo", "rloo", "reinforce_pp_baseline"):
        estimator = rf.ADVANTAGE_ESTIMATORS[name]
        holes, _ = estimator(scores, group_ids=groups, response_mask=mask)
        packed, _ = estimator(scores, group_ids=groups, response_mask=dense)
        torch.testing.assert_close(_squeeze(holes, mask)[0], packed, msg=name)
        assert not holes[~mask].any()
    rewards = torch.where(mask, v["x"], 0.0)
    holes, _ = rf.gae(rewards, values=v["ref"], response_mask=mask, gamma=0.99, lam=0.9)
    packed, _ = rf.gae(_squeeze(rewards, mask)[0], values=squeezed_values, response_mask=dense, gamma=0.99, lam=0.9)
    torch.testing.assert_close(_squeeze(holes, mask)[0], packed)

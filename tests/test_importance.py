"""Tests for rlfunc.importance: truncated importance weights for the rollout / trainer mismatch."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from rlfunc.aggregation import local_normalizers
from rlfunc.importance import IS_LEVELS, rollout_is_weights
from rlfunc.policy_loss_registry import get_policy_loss
from rlfunc.policy_losses import ppo_policy_loss

GOLDEN = pathlib.Path(__file__).parent / "golden" / "importance.safetensors"


def close(a, b, tol=1e-6):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@st.composite
def logprob_pairs(draw):
    b = draw(st.integers(1, 5))
    t = draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    spread = draw(st.floats(0.0, 3.0))
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, t, generator=g) * 5
    trainer = rollout + torch.randn(b, t, generator=g) * spread
    mask = torch.rand(b, t, generator=g) > 0.3
    return trainer, rollout, mask


# ---------------------------------------------------------------------------------------------------------
# hand-computed values


def test_token_level_hand_computed():
    trainer = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    rollout = torch.tensor([[-2.0, -1.0, -0.5, -0.1]])
    mask = torch.tensor([[True, True, True, False]])
    w, m = rollout_is_weights(trainer, rollout_logprobs=rollout, response_mask=mask, upper=2.0)
    # ratios e^1 (truncated to 2), e^-1, 1, masked -> 0
    close(w, torch.tensor([[2.0, math.exp(-1), 1.0, 0.0]]))
    close(m["is_truncated_frac"], torch.tensor(1 / 3))
    close(m["is_weight_max"], torch.tensor(math.e))
    close(m["is_weight_mean"], torch.tensor((2.0 + math.exp(-1) + 1.0) / 3))
    close(m["is_log_ratio_mean"], torch.tensor(0.0))


def test_sequence_level_hand_computed():
    trainer = torch.tensor([[-1.0, -1.0, -9.0], [-1.0, -3.0, -2.0]])
    rollout = torch.tensor([[-1.5, -1.2, -0.0], [-1.0, -1.0, -2.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    w, _ = rollout_is_weights(trainer, rollout_logprobs=rollout, response_mask=mask, level="sequence", upper=5.0)
    row0 = math.exp(0.5 + 0.2)  # product of the masked tokens' ratios
    row1 = math.exp(-2.0)
    close(w, torch.tensor([[row0, row0, 0.0], [row1, row1, row1]]))


def test_icepop_zeroes_outside_the_band():
    trainer = torch.tensor([[-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.0, -1.5, -0.5]])  # ratios 1, e^0.5 = 1.65, e^-0.5 = 0.61
    mask = torch.ones(1, 3, dtype=torch.bool)
    w, m = rollout_is_weights(trainer, rollout_logprobs=rollout, response_mask=mask, upper=1.5, lower=0.7)
    close(w, torch.tensor([[1.0, 0.0, 0.0]]))
    close(m["is_truncated_frac"], torch.tensor(2 / 3))


def test_log_ratio_beyond_the_safety_bound_stays_finite():
    trainer = torch.tensor([[-1.0, -200.0]])
    rollout = torch.tensor([[-200.0, -1.0]])
    w, m = rollout_is_weights(
        trainer, rollout_logprobs=rollout, response_mask=torch.ones(1, 2, dtype=torch.bool), upper=1e12
    )
    close(w, torch.tensor([[math.exp(20.0), math.exp(-20.0)]]), tol=1e-3)
    assert torch.isfinite(m["is_k3_mean"])


# ---------------------------------------------------------------------------------------------------------
# properties


@settings(max_examples=60, deadline=None)
@given(pair=logprob_pairs(), level=st.sampled_from(IS_LEVELS), upper=st.floats(0.1, 10.0))
def test_weights_are_bounded_masked_and_detached(pair, level, upper):
    trainer, rollout, mask = pair
    trainer = trainer.clone().requires_grad_()
    w, m = rollout_is_weights(trainer, rollout_logprobs=rollout, response_mask=mask, level=level, upper=upper)
    assert w.shape == trainer.shape and not w.requires_grad
    assert torch.all(w >= 0) and torch.all(w <= upper * (1 + 1e-6))
    assert torch.all(w[~mask] == 0)
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())
    # truncation is the only change: below the cap the weight is the exact ratio
    raw = torch.exp(trainer.detach() - rollout)
    if level == "sequence":
        raw = torch.exp(torch.where(mask, trainer.detach() - rollout, 0).sum(-1, keepdim=True)).expand_as(raw)
    keep = mask & (raw <= upper)
    close(w[keep], raw[keep], tol=1e-4)


@settings(max_examples=40, deadline=None)
@given(pair=logprob_pairs(), level=st.sampled_from(IS_LEVELS))
def test_identical_logprobs_give_unit_weights(pair, level):
    _, rollout, mask = pair
    w, m = rollout_is_weights(rollout, rollout_logprobs=rollout, response_mask=mask, level=level, upper=1.0)
    close(w, mask.float())
    assert float(m["is_truncated_frac"]) == 0.0 and float(m["is_k3_mean"]) == 0.0


@settings(max_examples=40, deadline=None)
@given(pair=logprob_pairs())
def test_sequence_weight_is_constant_along_each_row(pair):
    trainer, rollout, mask = pair
    w, _ = rollout_is_weights(trainer, rollout_logprobs=rollout, response_mask=mask, level="sequence", upper=3.0)
    per_row_max = torch.where(mask, w, -1.0).amax(-1, keepdim=True)
    assert torch.all(torch.where(mask, w == per_row_max, True))


@settings(max_examples=40, deadline=None)
@given(pair=logprob_pairs(), junk=st.sampled_from([float("nan"), float("inf"), -1e30]))
def test_padding_never_reaches_the_weights(pair, junk):
    trainer, rollout, mask = pair
    w, m = rollout_is_weights(trainer, rollout_logprobs=rollout, response_mask=mask, level="sequence")
    w2, m2 = rollout_is_weights(
        torch.where(mask, trainer, junk),
        rollout_logprobs=torch.where(mask, rollout, junk),
        response_mask=mask,
        level="sequence",
    )
    close(w2, w)
    for k in m:
        close(m2[k], m[k])


def test_vmap_matches_the_loop():
    g = torch.Generator().manual_seed(0)
    trainer, rollout = -torch.rand(3, 4, 5, generator=g), -torch.rand(3, 4, 5, generator=g)
    mask = torch.rand(3, 4, 5, generator=g) > 0.2
    fn = lambda a, b, c: rollout_is_weights(a, rollout_logprobs=b, response_mask=c, level="sequence", upper=1.3)[0]
    close(torch.func.vmap(fn)(trainer, rollout, mask), torch.stack([fn(*x) for x in zip(trainer, rollout, mask)]))


# ---------------------------------------------------------------------------------------------------------
# use in the policy losses


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "gpg"])
def test_unit_weights_leave_every_loss_unchanged(name):
    g = torch.Generator().manual_seed(1)
    lp = (-torch.rand(4, 6, generator=g)).requires_grad_()
    old, adv = -torch.rand(4, 6, generator=g), torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.2
    w, _ = rollout_is_weights(old, rollout_logprobs=old, response_mask=mask)
    loss_fn = get_policy_loss(name)
    plain, _ = loss_fn(lp, old_logprobs=old, advantages=adv, response_mask=mask, norms=local_normalizers(mask))
    weighted, _ = loss_fn(
        lp, old_logprobs=old, advantages=adv, response_mask=mask, norms=local_normalizers(mask), is_weights=w
    )
    close(weighted, plain)


def test_weights_scale_each_tokens_gradient():
    g = torch.Generator().manual_seed(2)
    old, adv = -torch.rand(3, 5, generator=g), torch.randn(3, 5, generator=g)
    rollout = old + torch.randn(3, 5, generator=g) * 0.5
    mask = torch.ones(3, 5, dtype=torch.bool)
    w, _ = rollout_is_weights(old, rollout_logprobs=rollout, response_mask=mask, upper=1.5)
    lp = old.clone().requires_grad_()  # on-policy: ratio 1, no PPO clipping, gradient is -w * adv / count
    loss, _ = ppo_policy_loss(
        lp, old_logprobs=old, advantages=adv, response_mask=mask, norms=local_normalizers(mask), is_weights=w
    )
    loss.backward()
    close(lp.grad, -w * adv / mask.sum())


# ---------------------------------------------------------------------------------------------------------
# verl 0.9.1 parity (tests/golden/make_importance_golden.py)


def test_matches_verl():
    golden = load_file(str(GOLDEN))
    trainer, rollout, mask = golden["is/trainer_logprobs"], golden["is/rollout_logprobs"], golden["is/mask"]
    cases = [k for k in golden if k.count("/") == 2]
    assert len(cases) == 6
    for key in cases:
        _, level, threshold = key.split("/")
        lower, upper = (None, float(threshold)) if "_" not in threshold else map(float, threshold.split("_"))
        w, _ = rollout_is_weights(
            trainer, rollout_logprobs=rollout, response_mask=mask, level=level, upper=upper, lower=lower
        )
        close(w, golden[key], tol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# bad input


def test_bad_inputs_raise_clear_errors():
    x, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="unknown importance-sampling level 'seq'"):
        rollout_is_weights(x, rollout_logprobs=x, response_mask=m, level="seq")
    with pytest.raises(ValueError, match="upper must be > 0"):
        rollout_is_weights(x, rollout_logprobs=x, response_mask=m, upper=0.0)
    with pytest.raises(ValueError, match="lower must be in"):
        rollout_is_weights(x, rollout_logprobs=x, response_mask=m, upper=1.0, lower=2.0)
    with pytest.raises(ValueError, match="rollout_logprobs has shape"):
        rollout_is_weights(x, rollout_logprobs=torch.zeros(2, 4), response_mask=m)
    with pytest.raises(TypeError, match="bool mask"):
        rollout_is_weights(x, rollout_logprobs=x, response_mask=m.float())
    with pytest.raises(ValueError, match="non-finite"):
        rollout_is_weights(torch.full((2, 3), float("nan")), rollout_logprobs=x, response_mask=m)

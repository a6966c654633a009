"""Tests for rlfunc.policy_losses: hand-computed cases, properties, and parity with verl 0.9.1 (golden file)."""

from __future__ import annotations

import functools
import inspect
import json
import math
from pathlib import Path

import chex
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

from rlfunc.aggregation import AGG_MODES, Normalizers, aggregate, local_normalizers
from rlfunc.policy_loss_registry import POLICY_LOSSES, get_policy_loss
from rlfunc.policy_losses import (
    cispo_policy_loss,
    clip_cov_policy_loss,
    gmpo_policy_loss,
    gpg_policy_loss,
    gspo_policy_loss,
    kl_cov_policy_loss,
    ppo_policy_loss,
    sapo_policy_loss,
    vanilla_policy_loss,
)

GOLDEN = Path(__file__).parent / "golden" / "losses.safetensors"
HYP = settings(max_examples=25, deadline=None)

# Settings for each loss under which it is a function of its tensor arguments alone and additive over
# rows given the global normalisers (clip-cov picks nothing with these bounds).
ALL_LOSSES = {
    "ppo": functools.partial(ppo_policy_loss, clip_low=0.2, clip_high=0.28, dual_clip=3.0),
    "gspo": functools.partial(gspo_policy_loss, clip_low=0.003, clip_high=0.004),
    "sapo": sapo_policy_loss,
    "cispo": functools.partial(cispo_policy_loss, clip_low=0.2, clip_high=0.28),
    "gpg": gpg_policy_loss,
    "gmpo": gmpo_policy_loss,
    "clip_cov": functools.partial(clip_cov_policy_loss, clip_cov_lb=1e6, clip_cov_ub=2e6),
    "kl_cov": functools.partial(kl_cov_policy_loss, kl_cov_ratio=0.1),
}
# Clip-Cov / KL-Cov select tokens with per-call statistics: not additive over micro-batches (as verl).
ROW_ADDITIVE = [name for name in ALL_LOSSES if name not in ("clip_cov", "kl_cov")]


def make_batch(seed: int, b: int = 4, t: int = 6, *, log_ratio_scale: float = 0.5, p_mask: float = 0.75):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3.0
    logprobs = old + log_ratio_scale * torch.randn(b, t, generator=g)
    advantages = torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) < p_mask
    is_weights = torch.exp(0.3 * torch.randn(b, t, generator=g))
    return logprobs, old, advantages, mask, is_weights


def loss_and_grad(fn, logprobs, old_logprobs, advantages, response_mask, **kwargs):
    lp = logprobs.detach().clone().requires_grad_(True)
    loss, metrics = fn(lp, old_logprobs=old_logprobs, advantages=advantages, response_mask=response_mask, **kwargs)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------------------------------
# hand-computed


def _ppo_hand_inputs():
    ratio = torch.tensor([[1.5, 0.5, 1.1, 4.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    logprobs = old + ratio.log()
    advantages = torch.tensor([[1.0, -1.0, 2.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    return ratio, logprobs, old, advantages, mask


def test_ppo_hand_computed_with_dual_clip():
    ratio, logprobs, old, advantages, mask = _ppo_hand_inputs()
    loss, grad, metrics = loss_and_grad(ppo_policy_loss, logprobs, old, advantages, mask, clip_low=0.2, dual_clip=3.0)
    # token 0: A>0, r=1.5 clipped to 1.2 -> -1.2, no grad; token 1: A<0, r=0.5 clipped to 0.8 -> 0.8, no grad;
    # token 2: unclipped -> -2.2, grad -A r = -2.2; token 3: A<0, r=4 > c=3 -> dual clip 3.0, no grad
    close(loss, torch.tensor((-1.2 + 0.8 - 2.2 + 3.0) / 4))
    close(grad, torch.tensor([[0.0, 0.0, -2.2 / 4, 0.0]]))
    close(metrics["clip_frac"], torch.tensor(0.5))
    close(metrics["dual_clip_frac"], torch.tensor(0.25))
    close(metrics["ppo_kl"], -ratio.log().mean())


def test_ppo_hand_computed_without_dual_clip_and_clip_higher():
    ratio, logprobs, old, advantages, mask = _ppo_hand_inputs()
    loss, grad, metrics = loss_and_grad(
        ppo_policy_loss, logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.6, agg="token-sum"
    )
    # token 0 now inside [0.8, 1.6]: -1.5 with grad -1.5; token 3 unbounded: 4.0 with grad 4.0
    close(loss, torch.tensor(-1.5 + 0.8 - 2.2 + 4.0))
    close(grad, torch.tensor([[-1.5, 0.0, -2.2, 4.0]]))
    close(metrics["clip_frac"], torch.tensor(0.25))
    close(metrics["dual_clip_frac"], torch.tensor(0.0))


def test_ppo_large_log_ratio_is_clamped_like_verl():
    # log r = +-30 is clamped to +-20 before exp: finite loss, zero grad there
    old = torch.zeros(1, 2)
    logprobs = torch.tensor([[-30.0, 30.0]])
    advantages = torch.tensor([[-1.0, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, grad, metrics = loss_and_grad(ppo_policy_loss, logprobs, old, advantages, mask, agg="token-sum")
    close(loss, torch.tensor(0.8 + math.exp(20.0)), tol=1e-6)
    assert torch.equal(grad, torch.zeros(1, 2))
    close(metrics["ppo_kl"], torch.tensor(0.0))


def test_sapo_hand_computed_gate():
    old = torch.zeros(1, 3)
    logprobs = torch.log(torch.tensor([[1.0, 2.0, 0.5]]))
    advantages = torch.tensor([[1.0, 1.0, -2.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, grad, _ = loss_and_grad(sapo_policy_loss, logprobs, old, advantages, mask, tau_pos=1.0, tau_neg=2.0)
    sig = torch.sigmoid
    per_token = torch.stack(
        [-4 * sig(torch.tensor(0.0)), -4 * sig(torch.tensor(1.0)), 2.0 * 2 * sig(torch.tensor(-1.0))]
    )
    close(loss, per_token.mean())
    # d/dlogp [-(4/tau) sigma(tau (r-1)) A] = -4 sigma'(tau (r-1)) r A
    dsig = lambda x: sig(torch.tensor(x)) * (1 - sig(torch.tensor(x)))
    expected = torch.stack([-4 * dsig(0.0), -4 * dsig(1.0) * 2.0, 4 * dsig(-1.0) * 0.5 * 2.0]) / 3
    close(grad, expected.reshape(1, 3))


def test_cispo_keeps_gradient_of_clipped_tokens():
    old = torch.zeros(1, 3)
    logprobs = torch.log(torch.tensor([[2.0, 0.1, 1.05]]))
    advantages = torch.tensor([[1.0, -1.0, 3.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, grad, metrics = loss_and_grad(cispo_policy_loss, logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.3)
    weight = torch.tensor([[1.3, 0.8, 1.05]])
    close(loss, (-(weight * advantages) * logprobs).mean())
    close(grad, -(weight * advantages) / 3)  # REINFORCE with a detached weight: never zero
    close(metrics["clip_frac"], torch.tensor(2 / 3))


def test_gmpo_hand_computed():
    old = torch.zeros(2, 3)
    log_ratio = torch.tensor([[0.5, -0.1, 0.0], [-0.5, 0.1, 0.3]])
    advantages = torch.tensor([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    loss, _, metrics = loss_and_grad(
        gmpo_policy_loss, old + log_ratio, old, advantages, mask, clip_low=0.2, clip_high=0.2
    )
    # row 0 (A>0): upper clip 0.5 -> 0.2, mean over 2 tokens (0.2 - 0.1)/2; row 1 (A<0): lower clip -0.5 -> -0.2
    seq0 = -2.0 * math.exp((0.2 - 0.1) / 2)
    seq1 = 1.0 * math.exp((-0.2 + 0.1 + 0.3) / 3)
    close(loss, torch.tensor((seq0 + seq1) / 2))
    # as verl, a token counts when its log-ratio leaves the range on either side (0.3 in row 1 does,
    # though for A < 0 only the lower side changes the loss)
    close(metrics["clip_frac"], torch.tensor(1 / 5))
    close(metrics["clip_frac_lower"], torch.tensor(2 / 5))


def test_kl_cov_penalises_the_top_covariance_tokens():
    logprobs, old, advantages, mask, _ = make_batch(3, 4, 8, p_mask=1.0)
    n = int(mask.sum())
    loss, _, metrics = loss_and_grad(
        kl_cov_policy_loss, logprobs, old, advantages, mask, kl_cov_ratio=2.5 / n, ppo_kl_coef=0.7
    )
    cov = (advantages - advantages.mean()) * (logprobs - logprobs.mean())
    top2 = torch.zeros(n, dtype=torch.bool)
    top2[cov.reshape(-1).topk(2).indices] = True
    log_ratio = logprobs - old
    expected = (-advantages * log_ratio.exp() + 0.7 * log_ratio.abs() * top2.reshape(4, 8)).mean()
    close(loss, expected)
    close(metrics["kl_cov_frac"], torch.tensor(2 / n))
    close(metrics["ppo_kl_abs"], log_ratio.abs().mean())


# ----------------------------------------------------------------------------------------------------
# properties


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("name", ["ppo", "gspo", "kl_cov", "clip_cov"])
def test_ratio_one_gives_minus_aggregated_advantages(name, agg):
    _, old, advantages, mask, _ = make_batch(0)
    loss, _ = ALL_LOSSES[name](old.clone(), old_logprobs=old, advantages=advantages, response_mask=mask, agg=agg)
    close(loss, -aggregate(advantages, mask, mode=agg))


def test_gmpo_ratio_one_gives_minus_mean_sequence_advantage():
    _, old, advantages, mask, _ = make_batch(1)
    loss, _ = gmpo_policy_loss(old.clone(), old_logprobs=old, advantages=advantages, response_mask=mask)
    close(loss, -aggregate(advantages, mask, mode="seq-mean-token-mean"))


@pytest.mark.parametrize("agg", AGG_MODES)
def test_on_policy_gradient_is_the_policy_gradient(agg):
    # at r = 1 every PPO-family loss has REINFORCE's gradient -A * d log pi (SAPO by f'(1) = 1)
    _, old, advantages, mask, _ = make_batch(2)
    _, reference, _ = loss_and_grad(gpg_policy_loss, old, old, advantages, mask, agg=agg)
    for name in ["ppo", "gspo", "sapo", "cispo", "clip_cov", "kl_cov"]:
        _, grad, _ = loss_and_grad(ALL_LOSSES[name], old, old, advantages, mask, agg=agg)
        close(grad, reference)


def _reference_ppo(logprobs, old, advantages, mask, low, high, c):
    """The textbook max/min form (as verl writes it), per token."""
    log_ratio = torch.clamp(logprobs - old, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip1 = torch.maximum(loss1, loss2)
    per_token = clip1 if c is None else torch.where(advantages < 0, torch.minimum(clip1, -advantages * c), clip1)
    return aggregate(per_token, mask, mode="token-sum")


@HYP
@given(
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([0.1, 0.5, 2.0, 15.0]),
    low=st.floats(0.0, 0.9),
    high=st.floats(0.0, 3.0),
    c=st.sampled_from([None, 1.5, 3.0, 10.0]),
)
def test_ppo_matches_the_textbook_form(seed, scale, low, high, c):
    logprobs, old, advantages, mask, _ = make_batch(seed, 3, 7, log_ratio_scale=scale)
    loss, grad, _ = loss_and_grad(
        ppo_policy_loss, logprobs, old, advantages, mask, clip_low=low, clip_high=high, dual_clip=c, agg="token-sum"
    )
    ref_loss, ref_grad, _ = loss_and_grad(
        lambda lp, *, old_logprobs, advantages, response_mask: (
            _reference_ppo(lp, old_logprobs, advantages, response_mask, low, high, c),
            {},
        ),
        logprobs,
        old,
        advantages,
        mask,
    )
    close(loss, ref_loss, tol=1e-4)
    close(grad, ref_grad, tol=1e-4)


@HYP
@given(
    seed=st.integers(0, 2**31 - 1), low=st.floats(0.05, 0.5), high=st.floats(0.05, 0.5), c=st.sampled_from([None, 2.0])
)
def test_ppo_gradient_is_zero_exactly_where_clipping_applies(seed, low, high, c):
    logprobs, old, advantages, mask, _ = make_batch(seed, 4, 8, log_ratio_scale=0.6)
    _, grad, metrics = loss_and_grad(
        ppo_policy_loss, logprobs, old, advantages, mask, clip_low=low, clip_high=high, dual_clip=c
    )
    ratio = torch.exp(logprobs - old)
    upper_clipped = (advantages > 0) & (ratio > 1 + high)
    lower_clipped = (advantages < 0) & (ratio < 1 - low)
    dual_clipped = (advantages < 0) & (ratio > c) if c is not None else torch.zeros_like(mask)
    frozen = (upper_clipped | lower_clipped | dual_clipped) & mask
    assert torch.all(grad[frozen] == 0)
    live = mask & ~frozen & (advantages != 0)
    assert torch.all(grad[live] != 0)
    close(grad[live], (-advantages * ratio)[live] / mask.sum())
    close(metrics["clip_frac"], ((upper_clipped | lower_clipped) & mask).sum() / mask.sum().clamp(min=1))
    close(metrics["dual_clip_frac"], (dual_clipped & mask).sum() / mask.sum().clamp(min=1))


@HYP
@given(seed=st.integers(0, 2**31 - 1), c=st.sampled_from([1.1, 2.0, 3.0]))
def test_dual_clip_only_touches_negative_advantages(seed, c):
    logprobs, old, advantages, mask, _ = make_batch(seed, 4, 8, log_ratio_scale=1.5)
    positive = advantages.abs()
    with_dual = loss_and_grad(ppo_policy_loss, logprobs, old, positive, mask, dual_clip=c)
    without = loss_and_grad(ppo_policy_loss, logprobs, old, positive, mask)
    assert torch.equal(with_dual[0], without[0]) and torch.equal(with_dual[1], without[1])
    # with negative advantages each token's loss is bounded by -c A
    negative = -advantages.abs()
    for i, j in mask[:2, :4].nonzero().tolist():
        one = torch.zeros_like(mask)
        one[i, j] = True
        loss, _ = ppo_policy_loss(
            logprobs, old_logprobs=old, advantages=negative, response_mask=one, dual_clip=c, agg="token-sum"
        )
        assert loss <= -c * negative[i, j] + 1e-5


@pytest.mark.parametrize("name", list(ALL_LOSSES))
def test_padding_with_nan_changes_nothing(name):
    fn = ALL_LOSSES[name]
    if name == "clip_cov":  # pick every candidate: the random keys depend on the padded shape
        fn = functools.partial(clip_cov_policy_loss, clip_cov_ratio=1.0, clip_cov_lb=-10.0, clip_cov_ub=10.0)
    logprobs, old, advantages, mask, weights = make_batch(5, 4, 6)
    b, t = mask.shape
    pad = lambda x, v: torch.cat(
        [torch.cat([x, torch.full((b, 3), v, dtype=x.dtype)], 1), torch.full((2, t + 3), v, dtype=x.dtype)], 0
    )
    nan = float("nan")
    big = (pad(logprobs, nan), pad(old, nan), pad(advantages, nan), pad(mask, False), pad(weights, nan))
    for agg in AGG_MODES:
        loss, grad, metrics = loss_and_grad(
            fn, logprobs, old, advantages, mask, agg=agg, horizon=10, is_weights=weights
        )
        loss_p, grad_p, metrics_p = loss_and_grad(fn, *big[:4], agg=agg, horizon=10, is_weights=big[4])
        close(loss_p, loss)
        assert not torch.isnan(grad_p).any()
        close(grad_p[:b, :t], grad)
        assert torch.all(grad_p[b:] == 0) and torch.all(grad_p[:, t:] == 0)
        for k in metrics:
            close(metrics_p[k], metrics[k])


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("name", ROW_ADDITIVE)
def test_micro_batches_with_global_normalizers_match_the_full_batch(name, agg):
    fn = ALL_LOSSES[name]
    logprobs, old, advantages, mask, weights = make_batch(7, 7, 6)
    mask[3] = False  # an empty row in one micro-batch
    horizon = 8
    full_loss, full_grad, _ = loss_and_grad(
        fn, logprobs, old, advantages, mask, agg=agg, horizon=horizon, is_weights=weights
    )
    splits = [slice(0, 2), slice(2, 5), slice(5, 7)]
    norms = functools.reduce(lambda a, b: a + b, [local_normalizers(mask[s]) for s in splits])
    lp = logprobs.clone().requires_grad_(True)
    total = sum(
        fn(
            lp[s],
            old_logprobs=old[s],
            advantages=advantages[s],
            response_mask=mask[s],
            agg=agg,
            norms=norms,
            horizon=horizon,
            is_weights=weights[s],
        )[0]
        for s in splits
    )
    total.backward()
    close(total.detach(), full_loss)
    close(lp.grad, full_grad)


@pytest.mark.parametrize("name", list(ALL_LOSSES))
def test_func_grad_equals_autograd(name):
    fn = ALL_LOSSES[name]
    logprobs, old, advantages, mask, weights = make_batch(11)
    _, expected, metrics = loss_and_grad(fn, logprobs, old, advantages, mask, is_weights=weights)
    grad, aux = torch.func.grad(
        lambda lp: fn(lp, old_logprobs=old, advantages=advantages, response_mask=mask, is_weights=weights), has_aux=True
    )(logprobs)
    close(grad, expected)
    assert aux.keys() == metrics.keys()


@pytest.mark.parametrize("name", list(ALL_LOSSES) + ["ppo_no_dual_clip"])
def test_vmap_over_a_leading_dim_equals_a_loop(name):
    fn = ppo_policy_loss if name == "ppo_no_dual_clip" else ALL_LOSSES[name]
    if name == "clip_cov":  # every candidate picked: no dependence on the random draw
        fn = functools.partial(clip_cov_policy_loss, clip_cov_ratio=1.0, clip_cov_lb=-10.0, clip_cov_ub=10.0)
    batches = [make_batch(s) for s in range(3)]
    stacked = [torch.stack(xs) for xs in zip(*batches, strict=True)]
    loss, metrics = torch.vmap(
        lambda lp, o, a, m, w: fn(lp, old_logprobs=o, advantages=a, response_mask=m, is_weights=w),
        randomness="different",
    )(*stacked)
    for k, (lp, o, a, m, w) in enumerate(batches):
        loss_k, metrics_k = fn(lp, old_logprobs=o, advantages=a, response_mask=m, is_weights=w)
        close(loss[k], loss_k)
        for key in metrics_k:
            close(metrics[key][k], metrics_k[key])


@pytest.mark.parametrize("name", list(ALL_LOSSES))
def test_empty_mask_gives_zero_loss_and_finite_grads(name):
    logprobs, old, advantages, _, weights = make_batch(13)
    logprobs[0, 0] = float("nan")
    mask = torch.zeros_like(logprobs, dtype=torch.bool)
    for agg in AGG_MODES:
        loss, grad, metrics = loss_and_grad(
            ALL_LOSSES[name], logprobs, old, advantages, mask, agg=agg, is_weights=weights
        )
        assert loss == 0
        assert torch.equal(grad, torch.zeros_like(grad))
        assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", list(ALL_LOSSES))
def test_metrics_are_detached_scalar_tensors(name):
    logprobs, old, advantages, mask, _ = make_batch(17)
    loss, metrics = ALL_LOSSES[name](
        logprobs.requires_grad_(True), old_logprobs=old, advantages=advantages, response_mask=mask
    )
    assert loss.shape == () and loss.requires_grad
    for key, value in metrics.items():
        assert isinstance(value, torch.Tensor) and value.shape == () and not value.requires_grad, key


@pytest.mark.parametrize("name", ROW_ADDITIVE + ["kl_cov"])
def test_is_weights_scale_the_per_token_loss_and_get_no_gradient(name):
    fn = ALL_LOSSES[name]
    logprobs, old, advantages, mask, _ = make_batch(19)
    weights = torch.full_like(logprobs, 2.5, requires_grad=True)
    loss, _ = fn(logprobs, old_logprobs=old, advantages=advantages, response_mask=mask, is_weights=weights)
    plain, _ = fn(logprobs, old_logprobs=old, advantages=advantages, response_mask=mask)
    close(loss, 2.5 * plain)
    assert not loss.requires_grad  # only weights required grad, and they are detached


def test_clip_cov_is_deterministic_in_its_seed_and_picks_k_tokens():
    logprobs, old, advantages, mask, _ = make_batch(23, 8, 32, log_ratio_scale=0.05, p_mask=1.0)
    kwargs = dict(clip_cov_ratio=0.02, clip_cov_lb=-100.0, clip_cov_ub=100.0)  # every token a candidate
    a = loss_and_grad(clip_cov_policy_loss, logprobs, old, advantages, mask, seed=3, **kwargs)
    b = loss_and_grad(clip_cov_policy_loss, logprobs, old, advantages, mask, seed=3, **kwargs)
    g = torch.Generator().manual_seed(3)
    c = loss_and_grad(clip_cov_policy_loss, logprobs, old, advantages, mask, generator=g, **kwargs)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[0], c[0])
    n = int(mask.sum())
    k = int(0.02 * n)  # 5 of 256
    close(a[2]["clip_frac"], torch.tensor(k / n))
    # picked tokens have no gradient; everything else has PPO's
    _, ppo_grad, _ = loss_and_grad(ppo_policy_loss, logprobs, old, advantages, mask)
    zeroed = (a[1] == 0) & (ppo_grad != 0)
    assert int(zeroed.sum()) == k
    others = [
        loss_and_grad(clip_cov_policy_loss, logprobs, old, advantages, mask, seed=s, **kwargs)[1] for s in range(4, 8)
    ]
    assert any(not torch.equal(o == 0, a[1] == 0) for o in others)  # another seed, another pick


def test_clip_cov_picks_only_candidates():
    logprobs, old, advantages, mask, _ = make_batch(29, 6, 10)
    cov = (advantages - advantages[mask].mean()) * (logprobs - logprobs[mask].mean())
    lb, ub = 0.3, 0.9
    ratio = torch.exp(logprobs - old)
    ppo_clipped = (-advantages * ratio.clamp(0.8, 1.2)) > (-advantages * ratio)
    candidates = mask & (cov > lb) & (cov < ub) & ~ppo_clipped
    _, grad, metrics = loss_and_grad(
        clip_cov_policy_loss, logprobs, old, advantages, mask, clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub
    )
    close(metrics["clip_frac"], candidates.sum() / mask.sum())
    assert torch.all(grad[candidates] == 0)


# ----------------------------------------------------------------------------------------------------
# errors and registry


def test_shape_mismatch_names_the_argument():
    logprobs, old, advantages, mask, _ = make_batch(0)
    with pytest.raises(ValueError, match="advantages"):
        ppo_policy_loss(logprobs, old_logprobs=old, advantages=advantages[:, :-1], response_mask=mask)
    with pytest.raises(ValueError, match="is_weights"):
        ppo_policy_loss(
            logprobs, old_logprobs=old, advantages=advantages, response_mask=mask, is_weights=advantages[:-1]
        )
    with pytest.raises(ValueError, match="logprobs"):
        gspo_policy_loss(logprobs[0], old_logprobs=old[0], advantages=advantages[0], response_mask=mask[0])


@pytest.mark.parametrize("name", list(ALL_LOSSES))
def test_float_mask_is_rejected(name):
    logprobs, old, advantages, mask, _ = make_batch(0)
    with pytest.raises(TypeError, match="bool"):
        ALL_LOSSES[name](logprobs, old_logprobs=old, advantages=advantages, response_mask=mask.float())


def test_bad_settings_are_rejected():
    logprobs, old, advantages, mask, _ = make_batch(0)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(logprobs, old_logprobs=old, advantages=advantages, response_mask=mask, dual_clip=1.0)
    with pytest.raises(ValueError, match="clip_low"):
        ppo_policy_loss(logprobs, old_logprobs=old, advantages=advantages, response_mask=mask, clip_low=1.0)
    with pytest.raises(ValueError, match="clip_high"):
        cispo_policy_loss(logprobs, old_logprobs=old, advantages=advantages, response_mask=mask, clip_high=-0.1)
    with pytest.raises(ValueError, match="tau"):
        sapo_policy_loss(logprobs, old_logprobs=old, advantages=advantages, response_mask=mask, tau_neg=0.0)
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        ppo_policy_loss(logprobs, old_logprobs=old, advantages=advantages, response_mask=mask, agg="mean")
    with pytest.raises(TypeError, match="floating"):
        ppo_policy_loss(logprobs, old_logprobs=old, advantages=advantages.long(), response_mask=mask)


def test_registry_knows_verl_names():
    for verl_name in ["vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo"]:
        assert callable(get_policy_loss(verl_name))
    assert get_policy_loss("ppo") is ppo_policy_loss
    assert get_policy_loss("vanilla") is vanilla_policy_loss  # verl's defaults: test_vanilla_defaults_are_verls
    assert get_policy_loss("geo_mean") is gmpo_policy_loss
    assert get_policy_loss("clip-cov") is clip_cov_policy_loss
    with pytest.raises(TypeError):
        POLICY_LOSSES["mine"] = ppo_policy_loss  # type: ignore[index]


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown policy loss 'grpo'.*ppo.*gspo.*geo_mean"):
        get_policy_loss("grpo")


# ----------------------------------------------------------------------------------------------------
# verl parity (tests/golden/make_losses_golden.py)

# our metric name -> verl's key, per loss
VERL_METRICS = {
    "vanilla": {
        "clip_frac": "actor/pg_clipfrac",
        "dual_clip_frac": "actor/pg_clipfrac_lower",
        "ppo_kl": "actor/ppo_kl",
    },
    "gspo": {"clip_frac": "actor/pg_clipfrac", "ppo_kl": "actor/ppo_kl"},
    "sapo": {"ppo_kl": "actor/ppo_kl"},
    "cispo": {"clip_frac": "actor/pg_clipfrac", "ppo_kl": "actor/ppo_kl"},
    "gpg": {},
    "clip_cov": {"clip_frac": "actor/pg_clipfrac", "ppo_kl": "actor/ppo_kl"},
    "kl_cov": {"ppo_kl_abs": "actor/ppo_kl"},
    "geo_mean": {
        "clip_frac": "actor/pg_clipfrac",
        "clip_frac_lower": "actor/pg_clipfrac_lower",
        "ppo_kl": "actor/ppo_kl",
    },
}


def _golden():
    tensors = load_file(str(GOLDEN))
    with safe_open(str(GOLDEN), "pt") as f:
        cases = json.loads(f.metadata()["cases"])
    return tensors, cases


_TENSORS, _CASES = _golden()
POLICY_CASES = [(i, c) for i, c in enumerate(_CASES) if c["kind"] == "policy"]


def golden_inputs(tensors, name):
    prefix = f"inputs/{name}/"
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def golden_norms(global_info, mask):
    """verl's global batch info as our Normalizers and horizon (verl falls back to local counts)."""
    norms = None
    if "batch_num_tokens" in global_info or "global_batch_size" in global_info:
        local = local_normalizers(mask)
        norms = Normalizers(
            num_tokens=torch.tensor(float(global_info.get("batch_num_tokens", local.num_tokens))),
            num_seqs=torch.tensor(float(global_info.get("global_batch_size", local.num_seqs))),
        )
    return norms, global_info.get("loss_scale_factor")


@pytest.mark.parametrize("index,case", POLICY_CASES, ids=[f"{i}-{c['loss']}-{c['agg']}" for i, c in POLICY_CASES])
def test_matches_verl(index, case):
    inp = golden_inputs(_TENSORS, case["inputs"])
    norms, horizon = golden_norms(case["global_info"], inp["response_mask"])
    ours = dict(case["ours"])
    if case["verl"].get("clip_ratio_c", 3.0) >= 1e9:  # verl's dual clip cannot be off: a huge clip_ratio_c never bites
        ours.setdefault("dual_clip", None)
    loss, grad, metrics = loss_and_grad(
        get_policy_loss(case["loss"]),
        inp["log_prob"],
        inp["old_log_prob"],
        inp["advantages"],
        inp["response_mask"],
        agg=case["agg"],
        norms=norms,
        horizon=horizon,
        is_weights=inp["is_weights"] if case["is_weights"] else None,
        **ours,
    )
    close(loss, _TENSORS[f"case{index}/loss"])
    close(grad, _TENSORS[f"case{index}/grad"])
    mapping = VERL_METRICS[case["loss"]]
    for ours, theirs in mapping.items():
        close(metrics[ours], _TENSORS[f"case{index}/metric/{theirs}"])
    for theirs in set(case["metrics"]) - set(mapping.values()):  # verl's constant placeholders
        assert _TENSORS[f"case{index}/metric/{theirs}"] == 0


VANILLA_VERL_DEFAULT_CASES = [
    (i, c) for i, c in POLICY_CASES if c["loss"] == "vanilla" and c["verl"].get("clip_ratio_c") == 3.0
]


@pytest.mark.parametrize("index,case", VANILLA_VERL_DEFAULT_CASES, ids=[str(i) for i, _ in VANILLA_VERL_DEFAULT_CASES])
def test_vanilla_defaults_are_verls(index, case):
    """``POLICY_LOSSES["vanilla"]`` called without ``dual_clip`` gives verl's numbers at verl's clip_ratio_c=3.0."""
    inp = golden_inputs(_TENSORS, case["inputs"])
    norms, horizon = golden_norms(case["global_info"], inp["response_mask"])
    ours = {k: v for k, v in case["ours"].items() if k != "dual_clip"}
    loss, grad, metrics = loss_and_grad(
        get_policy_loss("vanilla"),
        inp["log_prob"],
        inp["old_log_prob"],
        inp["advantages"],
        inp["response_mask"],
        agg=case["agg"],
        norms=norms,
        horizon=horizon,
        is_weights=inp["is_weights"] if case["is_weights"] else None,
        **ours,
    )
    close(loss, _TENSORS[f"case{index}/loss"])
    close(grad, _TENSORS[f"case{index}/grad"])
    close(metrics["dual_clip_frac"], _TENSORS[f"case{index}/metric/actor/pg_clipfrac_lower"])
    assert inspect.signature(vanilla_policy_loss).parameters["dual_clip"].default == 3.0
    assert inspect.signature(ppo_policy_loss).parameters["dual_clip"].default is None


def test_golden_file_is_small_and_covers_every_loss():
    assert GOLDEN.stat().st_size < 200_000
    assert {c["loss"] for _, c in POLICY_CASES} == set(VERL_METRICS)
    chex.assert_shape(_TENSORS["inputs/with_empty/log_prob"], (8, 16))

"""Tests for rlfunc.kl: estimators, KL loss, KL reward penalty, controllers."""

from __future__ import annotations

import math
import pathlib

import chex
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from rlfunc.aggregation import AGG_MODES, Normalizers, local_normalizers
from rlfunc.kl import (
    KL_KINDS,
    KLControllerState,
    adaptive_kl_controller,
    apply_kl_penalty_to_rewards,
    fixed_kl_controller,
    kl_loss,
    kl_penalty,
    update_kl_controller,
)
from rlfunc.tree import tree_leaves, tree_map

GOLDEN = load_file(str(pathlib.Path(__file__).parent / "golden" / "kl.safetensors"))
BASE_KINDS = [k for k in KL_KINDS if not k.endswith("+")]


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------------------
# kl_penalty: hand-computed values


def test_hand_computed_values():
    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-2.0, -1.0, -0.5]])
    # log r = ref - lp = [-1, 1, 0]
    close(kl_penalty(lp, ref_logprobs=ref, kind="k1"), torch.tensor([[1.0, -1.0, 0.0]]))
    close(kl_penalty(lp, ref_logprobs=ref, kind="abs"), torch.tensor([[1.0, 1.0, 0.0]]))
    close(kl_penalty(lp, ref_logprobs=ref, kind="k2"), torch.tensor([[0.5, 0.5, 0.0]]))
    e = math.e
    close(kl_penalty(lp, ref_logprobs=ref, kind="k3"), torch.tensor([[1 / e - 1 + 1, e - 1 - 1, 0.0]]))


@pytest.mark.parametrize(("alias", "canonical"), [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3"), ("kl+", "k1+")])
def test_aliases(alias, canonical):
    lp, ref = torch.randn(3, 4), torch.randn(3, 4)
    close(kl_penalty(lp, ref_logprobs=ref, kind=alias), kl_penalty(lp, ref_logprobs=ref, kind=canonical), tol=0)


def test_k3_clamps_like_verl():
    lp = torch.tensor([-1.0, -30.0, -3.0, -15.0])
    ref = torch.tensor([-30.0, -1.0, -15.0, -3.0])
    out = kl_penalty(lp, ref_logprobs=ref, kind="k3")
    # log r = -29 -> clamped to -20 -> e^-20 + 19 -> clamped to 10; log r = 29 -> 20 -> e^20 - 21 -> 10
    close(out, torch.tensor([10.0, 10.0, 10.0, 10.0]))
    lp = lp.clone().requires_grad_()
    kl_penalty(lp, ref_logprobs=ref, kind="k3").sum().backward()
    assert torch.all(lp.grad == 0)  # no gradient through the clamps


def test_zero_when_equal_and_nonnegative():
    lp = torch.randn(5, 6)
    for kind in BASE_KINDS:
        chex.assert_trees_all_close(kl_penalty(lp, ref_logprobs=lp, kind=kind), torch.zeros(5, 6))
    ref = torch.randn(5, 6)
    for kind in ("abs", "k2", "k3"):
        assert torch.all(kl_penalty(lp, ref_logprobs=ref, kind=kind) >= 0)


def test_bf16_inputs_computed_in_fp32():
    lp, ref = torch.randn(4, 5), torch.randn(4, 5)
    out = kl_penalty(lp.bfloat16(), ref_logprobs=ref.bfloat16(), kind="k3")
    assert out.dtype == torch.float32
    close(out, kl_penalty(lp.bfloat16().float(), ref_logprobs=ref.bfloat16().float(), kind="k3"), tol=0)
    assert kl_penalty(lp.double(), ref_logprobs=ref.double(), kind="k3").dtype == torch.float64


# ---------------------------------------------------------------------------------------------------------
# verl parity (golden file from tests/golden/make_kl_golden.py)


@pytest.mark.parametrize("kind", [k.split("/")[1] for k in GOLDEN if k.startswith("kl/") and k.endswith("/value")])
def test_kl_penalty_matches_verl(kind):
    lp = GOLDEN["kl/logprobs"].clone().requires_grad_()
    value = kl_penalty(lp, ref_logprobs=GOLDEN["kl/ref_logprobs"], kind=kind)
    (value * GOLDEN["kl/weights"]).sum().backward()
    close(value.detach(), GOLDEN[f"kl/{kind}/value"])
    close(lp.grad, GOLDEN[f"kl/{kind}/grad"])


def test_golden_covers_all_kinds():
    covered = {k.split("/")[1] for k in GOLDEN if k.startswith("kl/") and k.endswith("/value")}
    assert covered == set(KL_KINDS)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_kl_loss_matches_verl(mode):
    loss, metrics = kl_loss(
        GOLDEN["kl/logprobs"],
        ref_logprobs=GOLDEN["kl/ref_logprobs"],
        mask=GOLDEN["kl_loss/mask"],
        kind="low_var_kl",
        agg=mode,
    )
    close(loss, GOLDEN[f"kl_loss/{mode}"])
    close(metrics["kl_loss"], GOLDEN[f"kl_loss/{mode}"])


def test_kl_loss_default_kind_is_verls_and_k1():
    mask = GOLDEN["kl_loss/mask"]
    loss, _ = kl_loss(GOLDEN["kl/logprobs"], ref_logprobs=GOLDEN["kl/ref_logprobs"], mask=mask)
    close(loss, GOLDEN["kl_loss/token-mean"])
    loss, _ = kl_loss(GOLDEN["kl/logprobs"], ref_logprobs=GOLDEN["kl/ref_logprobs"], mask=mask, kind="k1")
    close(loss, GOLDEN["kl_loss/token-mean/k1"])


@pytest.mark.parametrize("kind", ["kl", "low_var_kl"])
def test_reward_penalty_and_adaptive_controller_match_verl(kind):
    mask = GOLDEN["reward_kl/mask"]
    ctrl = adaptive_kl_controller(init_beta=0.05, target_kl=0.02, horizon=100)
    close(ctrl.beta, GOLDEN[f"reward_kl/{kind}/beta_before"], tol=1e-12)
    rewards, observed = apply_kl_penalty_to_rewards(
        GOLDEN["reward_kl/scores"],
        logprobs=GOLDEN["reward_kl/old_logprobs"],
        ref_logprobs=GOLDEN["reward_kl/ref_logprobs"],
        mask=mask,
        beta=ctrl.beta,
        kind=kind,
    )
    assert rewards.dtype == torch.float32 and observed.shape == ()
    close(rewards, GOLDEN[f"reward_kl/{kind}/token_rewards"])
    close(observed.double(), GOLDEN[f"reward_kl/{kind}/observed_kl"])
    new = update_kl_controller(ctrl, observed_kl=observed, n_steps=mask.shape[0])
    close(new.beta, GOLDEN[f"reward_kl/{kind}/beta_after"], tol=1e-9)


def test_adaptive_controller_sequence_matches_verl():
    state = adaptive_kl_controller(0.1, target_kl=0.03, horizon=500)
    betas = []
    for kl, n in zip(GOLDEN["ctrl/observed_kl"], GOLDEN["ctrl/n_steps"]):
        state = update_kl_controller(state, observed_kl=kl, n_steps=int(n))
        betas.append(state.beta)
    # float64 state: agrees with verl's Python floats to rounding, over 40 updates
    close(torch.stack(betas), GOLDEN["ctrl/betas"], tol=1e-12)


def test_fixed_controller_matches_verl():
    state = fixed_kl_controller(0.07)
    new = update_kl_controller(state, observed_kl=0.5, n_steps=8)
    close(new.beta, GOLDEN["ctrl/fixed_beta"], tol=0)
    assert new is state and not state.is_adaptive


# ---------------------------------------------------------------------------------------------------------
# Controllers: hand-computed, purity, pytree


def test_adaptive_update_hand_computed():
    s = adaptive_kl_controller(0.2, target_kl=0.1, horizon=10)
    # error = clip(0.15/0.1 - 1 = 0.5 -> 0.2); beta = 0.2 * (1 + 0.2 * 5 / 10) = 0.22
    up = update_kl_controller(s, observed_kl=torch.tensor(0.15), n_steps=5)
    close(up.beta, torch.tensor(0.22, dtype=torch.float64), tol=1e-12)
    # error = 0.09/0.1 - 1 = -0.1 (not clipped); beta = 0.2 * (1 - 0.1 * 2 / 10) = 0.196
    down = update_kl_controller(s, observed_kl=0.09, n_steps=torch.tensor(2))
    close(down.beta, torch.tensor(0.196, dtype=torch.float64), tol=1e-12)
    # clipped below: 0/0.1 - 1 = -1 -> -0.2
    close(update_kl_controller(s, observed_kl=0.0, n_steps=10).beta, torch.tensor(0.16, dtype=torch.float64), tol=1e-12)
    assert float(s.beta) == pytest.approx(0.2)  # input untouched
    assert up.target_kl is s.target_kl and up.horizon is s.horizon


def test_controller_state_is_a_pytree():
    s = adaptive_kl_controller(0.1, target_kl=0.05, horizon=100)
    assert len(tree_leaves(s)) == 3
    assert len(tree_leaves(fixed_kl_controller(0.1))) == 1
    moved = tree_map(lambda x: x.float(), s)
    assert isinstance(moved, KLControllerState) and moved.beta.dtype == torch.float32
    with pytest.raises(attrs_frozen_error()):
        s.beta = torch.tensor(1.0)  # type: ignore[misc]


def attrs_frozen_error():
    import attrs

    return attrs.exceptions.FrozenInstanceError


def test_controller_under_torch_func():
    # grad of the new beta w.r.t. the observed KL: beta * n / (H * target) inside the clip range
    s = adaptive_kl_controller(0.1, target_kl=0.05, horizon=100)
    g = torch.func.grad(lambda kl: update_kl_controller(s, observed_kl=kl, n_steps=10).beta)(
        torch.tensor(0.055, dtype=torch.float64)
    )
    close(g, torch.tensor(0.1 * 10 / (100 * 0.05), dtype=torch.float64), tol=1e-12)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: adaptive_kl_controller(0.1, target_kl=0.0, horizon=10), "target_kl"),
        (lambda: adaptive_kl_controller(0.1, target_kl=0.1, horizon=0), "horizon"),
        (lambda: adaptive_kl_controller(-0.1, target_kl=0.1, horizon=10), "init_beta"),
        (lambda: fixed_kl_controller(-1.0), "beta"),
        (lambda: fixed_kl_controller(float("nan")), "finite"),
        (
            lambda: update_kl_controller(
                adaptive_kl_controller(0.1, target_kl=0.1, horizon=10), observed_kl=float("nan"), n_steps=4
            ),
            "observed_kl",
        ),
        (
            lambda: update_kl_controller(
                adaptive_kl_controller(0.1, target_kl=0.1, horizon=10), observed_kl=torch.ones(3), n_steps=4
            ),
            "scalar",
        ),
    ],
)
def test_controller_bad_inputs(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ---------------------------------------------------------------------------------------------------------
# Straight-through variants


@pytest.mark.parametrize("kind", ["k1+", "k3+", "abs+", "k2+"])
def test_straight_through_value_and_gradient(kind):
    lp0, ref = torch.randn(3, 5), torch.randn(3, 5)
    lp = lp0.clone().requires_grad_()
    value = kl_penalty(lp, ref_logprobs=ref, kind=kind)
    close(value.detach(), kl_penalty(lp0, ref_logprobs=ref, kind=kind[:-1]))
    value.sum().backward()
    lp2 = lp0.clone().requires_grad_()
    kl_penalty(lp2, ref_logprobs=ref, kind="k2").sum().backward()
    close(lp.grad, lp2.grad)
    close(lp.grad, lp0 - ref)  # d/dlp 0.5 (lp - ref)^2


def test_monte_carlo_estimators_approach_true_kl():
    """E_{y~p}[k1] = E_{y~p}[k3] = KL(p||q); k3 has lower variance; E[grad k2] = grad KL."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(6, generator=g) * 0.5
    q_logits = torch.randn(6, generator=g) * 0.5
    logp_all, logq_all = torch.log_softmax(theta, -1), torch.log_softmax(q_logits, -1)
    true_kl = (logp_all.exp() * (logp_all - logq_all)).sum()
    n = 200_000
    y = torch.multinomial(logp_all.exp(), n, replacement=True, generator=g)
    lp, lq = logp_all[y], logq_all[y]
    for kind in ("k1", "k3"):
        est = kl_penalty(lp, ref_logprobs=lq, kind=kind)
        stderr = est.std() / math.sqrt(n)
        assert abs(est.mean() - true_kl) < 5 * stderr, (kind, est.mean(), true_kl, stderr)
    assert kl_penalty(lp, ref_logprobs=lq, kind="k3").std() < kl_penalty(lp, ref_logprobs=lq, kind="k1").std()

    # gradient: mean over samples of grad_theta k2(y) (y held fixed) ~ grad_theta KL(p_theta || q)
    def mean_k2(th, kind):
        logp = torch.log_softmax(th, -1)
        return kl_penalty(logp[y], ref_logprobs=logq_all[y], kind=kind).mean()

    def exact_kl(th):
        logp = torch.log_softmax(th, -1)
        return (logp.exp() * (logp - logq_all)).sum()

    g_true = torch.func.grad(exact_kl)(theta)
    for kind in ("k2", "k1+", "k3+"):
        g_est = torch.func.grad(mean_k2)(theta, kind)
        assert torch.allclose(g_est, g_true, atol=0.01), (kind, g_est, g_true)
    # k1's expected gradient is 0, not grad KL
    assert torch.func.grad(mean_k2)(theta, "k1").abs().max() < 0.01 < g_true.abs().max()


# ---------------------------------------------------------------------------------------------------------
# Functional contract: torch.func, vmap, purity


@pytest.mark.parametrize("kind", KL_KINDS)
def test_func_grad_equals_autograd(kind):
    lp0, ref = torch.randn(3, 4), torch.randn(3, 4)
    mask = torch.rand(3, 4) > 0.3
    fn = lambda lp: kl_loss(lp, ref_logprobs=ref, mask=mask, kind=kind)[0]
    g_func = torch.func.grad(fn)(lp0)
    lp = lp0.clone().requires_grad_()
    fn(lp).backward()
    close(g_func, lp.grad)


@pytest.mark.parametrize("kind", ["k1", "k3", "k2+"])
def test_vmap_equals_loop(kind):
    lp, ref = torch.randn(4, 6), torch.randn(4, 6)
    mask = torch.rand(4, 6) > 0.3
    per_example = lambda a, b, m: kl_loss(
        a[None], ref_logprobs=b[None], mask=m[None], kind=kind, agg="seq-mean-token-mean"
    )[0]
    batched = torch.func.vmap(per_example)(lp, ref, mask)
    looped = torch.stack([per_example(lp[i], ref[i], mask[i]) for i in range(4)])
    close(batched, looped)
    close(
        torch.func.vmap(lambda a, b: kl_penalty(a, ref_logprobs=b, kind=kind))(lp, ref),
        kl_penalty(lp, ref_logprobs=ref, kind=kind),
    )


def test_inputs_not_modified():
    lp, ref, rewards = torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 5)
    mask = torch.ones(2, 5, dtype=torch.bool)
    copies = [x.clone() for x in (lp, ref, rewards)]
    apply_kl_penalty_to_rewards(rewards, logprobs=lp, ref_logprobs=ref, mask=mask, beta=0.3, kind="k3")
    kl_loss(lp, ref_logprobs=ref, mask=mask)
    for x, c in zip((lp, ref, rewards), copies):
        assert torch.equal(x, c)


# ---------------------------------------------------------------------------------------------------------
# kl_loss / apply_kl_penalty_to_rewards: semantics


def test_kl_loss_global_normalizers_accumulate():
    lp, ref = torch.randn(6, 5), torch.randn(6, 5)
    mask = torch.rand(6, 5) > 0.4
    full, _ = kl_loss(lp, ref_logprobs=ref, mask=mask, kind="k3", agg="token-mean")
    norms = local_normalizers(mask)
    parts = [
        kl_loss(lp[i : i + 2], ref_logprobs=ref[i : i + 2], mask=mask[i : i + 2], kind="k3", norms=norms)[0]
        for i in (0, 2, 4)
    ]
    close(sum(parts), full)
    assert isinstance(norms, Normalizers)


def test_kl_loss_metrics_are_detached_tensors():
    lp = torch.randn(2, 4, requires_grad=True)
    loss, metrics = kl_loss(lp, ref_logprobs=torch.randn(2, 4), mask=torch.ones(2, 4, dtype=torch.bool), kind="k1")
    assert loss.requires_grad
    assert set(metrics) == {"kl_loss", "kl_mean"}
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in metrics.values())


def test_nan_outside_mask_does_not_leak():
    lp, ref, rewards = torch.randn(2, 4), torch.randn(2, 4), torch.zeros(2, 4)
    mask = torch.tensor([[True, True, False, False], [True, False, False, False]])
    lp[~mask] = float("nan")
    rewards[~mask] = float("inf")
    new, observed = apply_kl_penalty_to_rewards(rewards, logprobs=lp, ref_logprobs=ref, mask=mask, beta=0.1)
    assert torch.isfinite(new[mask]).all() and torch.isfinite(observed)
    loss, _ = kl_loss(lp, ref_logprobs=ref, mask=mask)
    assert torch.isfinite(loss)


def test_reward_penalty_hand_computed():
    lp = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    ref = torch.tensor([[-1.5, -0.5, -1.0], [-2.0, -3.0, -2.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    new, observed = apply_kl_penalty_to_rewards(rewards, logprobs=lp, ref_logprobs=ref, mask=mask, beta=0.5, kind="k1")
    # k1 = lp - ref = [[0.5, -0.5, (0)], [0, 1, 0]]
    close(new, torch.tensor([[-0.25, 1.25, 0.0], [0.0, -0.5, 2.0]]))
    close(observed, torch.tensor((0.0 + 1.0 / 3.0) / 2.0))
    # all-masked sequence counts as 0 in the batch mean (as verl)
    _, observed = apply_kl_penalty_to_rewards(
        rewards, logprobs=lp, ref_logprobs=ref, mask=torch.zeros_like(mask), beta=0.5
    )
    assert observed == 0


def test_reward_penalty_beta_tensor_keeps_dtype():
    rewards = torch.zeros(2, 3)
    new, _ = apply_kl_penalty_to_rewards(
        rewards,
        logprobs=torch.randn(2, 3),
        ref_logprobs=torch.randn(2, 3),
        mask=torch.ones(2, 3, dtype=torch.bool),
        beta=fixed_kl_controller(0.1).beta,
    )
    assert new.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------
# Bad inputs


def test_unknown_kind_lists_known():
    with pytest.raises(ValueError, match="known kinds: .*k3.*low_var_kl"):
        kl_penalty(torch.zeros(2), ref_logprobs=torch.zeros(2), kind="full")
    with pytest.raises(ValueError, match="unknown KL estimator kind"):
        kl_loss(torch.zeros(1, 2), ref_logprobs=torch.zeros(1, 2), mask=torch.ones(1, 2, dtype=torch.bool), kind="k4")


def test_shape_mismatch():
    with pytest.raises(ValueError, match="ref_logprobs has shape"):
        kl_penalty(torch.zeros(2, 3), ref_logprobs=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="mask has shape"):
        kl_loss(torch.zeros(2, 3), ref_logprobs=torch.zeros(2, 3), mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="token_rewards has shape"):
        apply_kl_penalty_to_rewards(
            torch.zeros(3, 3),
            logprobs=torch.zeros(2, 3),
            ref_logprobs=torch.zeros(2, 3),
            mask=torch.ones(2, 3, dtype=torch.bool),
            beta=0.1,
        )


def test_bad_dtypes():
    with pytest.raises(TypeError, match="torch.bool mask"):
        kl_loss(torch.zeros(2, 3), ref_logprobs=torch.zeros(2, 3), mask=torch.ones(2, 3))
    with pytest.raises(TypeError, match="floating-point"):
        kl_penalty(torch.zeros(2, 3, dtype=torch.long), ref_logprobs=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="beta"):
        apply_kl_penalty_to_rewards(
            torch.zeros(1, 2),
            logprobs=torch.zeros(1, 2),
            ref_logprobs=torch.zeros(1, 2),
            mask=torch.ones(1, 2, dtype=torch.bool),
            beta=torch.ones(2),
        )


def test_nan_inside_mask_raises():
    mask = torch.ones(2, 3, dtype=torch.bool)
    lp = torch.zeros(2, 3)
    lp[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"logprobs contains NaN at index \(1, 2\)"):
        kl_loss(lp, ref_logprobs=torch.zeros(2, 3), mask=mask)
    with pytest.raises(ValueError, match="ref_logprobs contains NaN"):
        apply_kl_penalty_to_rewards(torch.zeros(2, 3), logprobs=torch.zeros(2, 3), ref_logprobs=lp, mask=mask, beta=0.1)
    rewards = torch.zeros(2, 3)
    rewards[0, 1] = float("inf")
    with pytest.raises(ValueError, match="token_rewards contains a non-finite value"):
        apply_kl_penalty_to_rewards(
            rewards, logprobs=torch.zeros(2, 3), ref_logprobs=torch.zeros(2, 3), mask=mask, beta=0.1
        )


def test_inf_ref_logprob_is_legal_for_k3():
    # a token the reference rules out: k3 is bounded by the clamp, k1 is +inf
    lp, ref = torch.tensor([[-1.0]]), torch.tensor([[float("-inf")]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, _ = kl_loss(lp, ref_logprobs=ref, mask=mask, kind="k3")
    assert loss == 10.0


# ---------------------------------------------------------------------------------------------------------
# Properties


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-30, 0, allow_nan=False), min_size=1, max_size=8),
    st.lists(st.floats(-30, 0, allow_nan=False), min_size=1, max_size=8),
    st.sampled_from(KL_KINDS),
)
def test_property_estimators(lp_list, ref_list, kind):
    n = min(len(lp_list), len(ref_list))
    lp = torch.tensor(lp_list[:n], dtype=torch.float64)
    ref = torch.tensor(ref_list[:n], dtype=torch.float64)
    out = kl_penalty(lp, ref_logprobs=ref, kind=kind)
    base = kind.rstrip("+")
    assert torch.isfinite(out).all()
    if base in ("abs", "k2", "mse", "k3", "low_var_kl"):
        assert (out >= 0).all()
    if base in ("k3", "low_var_kl"):
        assert (out <= 10).all()
        # the clamped identity r - 1 - log r, written out independently
        log_r = (ref - lp).clamp(-20, 20)
        expected = (log_r.exp() - 1 - log_r).clamp(max=10)
        torch.testing.assert_close(out, expected)
    # swapping the arguments flips k1 and leaves abs/k2 unchanged
    if base in ("abs", "k2", "mse"):
        torch.testing.assert_close(out, kl_penalty(ref, ref_logprobs=lp, kind=kind))
    if base in ("k1", "kl"):
        torch.testing.assert_close(out, -kl_penalty(ref, ref_logprobs=lp, kind=kind))

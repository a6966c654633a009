"""Tests for rlfunc.advantages: hand-computed cases, properties, verl parity (golden file), bad inputs."""

from __future__ import annotations

import functools
import math
import pathlib

import chex
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from rlfunc.advantages import (
    ADVANTAGE_ESTIMATOR_ALIASES,
    ADVANTAGE_ESTIMATORS,
    discounted_reverse_cumsum,
    gae,
    get_advantage_estimator,
    gpg,
    grpo,
    grpo_passk,
    opo,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
    rloo,
)
from rlfunc.masked import masked_whiten

GOLDEN = pathlib.Path(__file__).parent / "golden" / "advantages.safetensors"
ATOL = 1e-5
PROPS = settings(max_examples=30, deadline=None)


def close(actual, expected, atol=ATOL, rtol=0.0):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------------------------------
# Float64 loop references with verl's skip-masked-positions semantics
# ----------------------------------------------------------------------------------------------------


def ref_gae(rewards, values, mask, gamma, lam):
    r, v, m = rewards.double(), values.double(), mask
    adv = torch.zeros_like(r)
    for i in range(r.shape[0]):
        next_value, running = 0.0, 0.0
        for t in reversed(range(r.shape[1])):
            if not m[i, t]:
                continue
            delta = r[i, t] + gamma * next_value - v[i, t]
            running = delta + gamma * lam * running
            adv[i, t] = running
            next_value = v[i, t]
    ret = torch.where(m, adv + v, torch.zeros_like(adv))
    return adv, ret


def ref_reward_to_go(rewards, mask, gamma):
    r = rewards.double()
    out = torch.zeros_like(r)
    for i in range(r.shape[0]):
        running = 0.0
        for t in reversed(range(r.shape[1])):
            if mask[i, t]:
                running = r[i, t] + gamma * running
                out[i, t] = running
    return out


OUTCOME = {
    "grpo": grpo,
    "drgrpo": functools.partial(grpo, norm_by_std=False),
    "rloo": rloo,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "opo": opo,
    "gpg": gpg,
}


# ----------------------------------------------------------------------------------------------------
# Hand-computed cases
# ----------------------------------------------------------------------------------------------------


def test_gae_hand_computed():
    r = torch.tensor([[1.0, 0.0, 2.0]])
    v = torch.tensor([[0.5, 0.2, 0.1]])
    m = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae(r, values=v, response_mask=m, gamma=0.9, lam=0.8)
    # deltas: 2 - 0.1 = 1.9;  0 + 0.9*0.1 - 0.2 = -0.11;  1 + 0.9*0.2 - 0.5 = 0.68;  gamma*lam = 0.72
    a2 = 1.9
    a1 = -0.11 + 0.72 * a2
    a0 = 0.68 + 0.72 * a1
    close(adv, torch.tensor([[a0, a1, a2]]))
    close(ret, torch.tensor([[a0 + 0.5, a1 + 0.2, a2 + 0.1]]))
    assert adv is not ret and adv.data_ptr() != ret.data_ptr()


def test_gae_skips_masked_positions():
    # The middle token is an observation: its reward and (NaN) value are ignored, the bootstrap value
    # and the running advantage are carried across it.
    r = torch.tensor([[1.0, 99.0, 2.0, 5.0]])
    v = torch.tensor([[0.5, float("nan"), 0.1, float("inf")]])
    m = torch.tensor([[True, False, True, False]])
    adv, ret = gae(r, values=v, response_mask=m, gamma=0.9, lam=0.8)
    a2 = 2.0 - 0.1
    a0 = (1.0 + 0.9 * 0.1 - 0.5) + 0.72 * a2
    close(adv, torch.tensor([[a0, 0.0, a2, 0.0]]))
    close(ret, torch.tensor([[a0 + 0.5, 0.0, a2 + 0.1, 0.0]]))


def test_gae_lam_zero_is_td_error():
    r = torch.tensor([[1.0, 2.0, 3.0]])
    v = torch.tensor([[0.1, 0.2, 0.3]])
    adv, _ = gae(r, values=v, response_mask=torch.ones(1, 3, dtype=torch.bool), gamma=0.5, lam=0.0)
    close(adv, torch.tensor([[1.0 + 0.5 * 0.2 - 0.1, 2.0 + 0.5 * 0.3 - 0.2, 3.0 - 0.3]]))


def test_reinforce_pp_hand_computed():
    r = torch.tensor([[1.0, 7.0, 0.0, 2.0]])
    m = torch.tensor([[True, False, True, True]])
    adv, ret = reinforce_pp(r, response_mask=m, gamma=0.5)
    close(ret, torch.tensor([[1.0 + 0.5 * (0.0 + 0.5 * 2.0), 0.0, 1.0, 2.0]]))
    close(adv, ret)
    assert adv.data_ptr() != ret.data_ptr()


def test_grpo_hand_computed():
    s = torch.tensor([1.0, 0.0, 1.0, 0.5])
    g = torch.tensor([5, 5, 5, 9])
    m = torch.tensor([[True, True], [True, False], [True, True], [False, True]])
    adv, ret = grpo(s, group_ids=g, response_mask=m)
    std = math.sqrt(1.0 / 3.0)  # unbiased std of [1, 0, 1]
    per_seq = torch.tensor([(1 / 3) / (std + 1e-6), (-2 / 3) / (std + 1e-6), (1 / 3) / (std + 1e-6), 0.5 / (1 + 1e-6)])
    close(adv, per_seq[:, None] * m)
    close(ret, adv)
    assert adv.data_ptr() != ret.data_ptr()
    adv_dr, _ = grpo(s, group_ids=g, response_mask=m, norm_by_std=False)
    close(adv_dr, torch.tensor([1 / 3, -2 / 3, 1 / 3, 0.5])[:, None] * m)


def test_grpo_equal_scores_give_zero():
    adv, _ = grpo(
        torch.full((4,), 0.7),
        group_ids=torch.zeros(4, dtype=torch.long),
        response_mask=torch.ones(4, 2, dtype=torch.bool),
    )
    close(adv, torch.zeros(4, 2))


def test_rloo_hand_computed():
    s = torch.tensor([1.0, 0.0, 1.0, 3.0])
    g = torch.tensor([2, 2, 2, 8])
    m = torch.ones(4, 1, dtype=torch.bool)
    adv, _ = rloo(s, group_ids=g, response_mask=m)
    close(adv[:, 0], torch.tensor([1.0 - 0.5, 0.0 - 1.0, 1.0 - 0.5, 3.0]))  # singleton keeps its score
    adv0, _ = rloo(s, group_ids=g, response_mask=m, singletons="zero")
    close(adv0[:, 0], torch.tensor([0.5, -1.0, 0.5, 0.0]))


def test_reinforce_pp_baseline_opo_gpg_hand_computed():
    m = torch.tensor([[True, False, False], [True, True, True], [True, True, False], [True, True, True]])
    s = torch.tensor([1.0, 0.0, 0.0, 0.0])
    g = torch.tensor([0, 0, 0, 0])
    close(reinforce_pp_baseline(s, group_ids=g, response_mask=m)[0][:, 0], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    # OPO: lengths [1, 3, 2, 3]; baseline = (1 * 1) / 9
    close(opo(s, group_ids=g, response_mask=m)[0][:, 0], torch.tensor([1 - 1 / 9, -1 / 9, -1 / 9, -1 / 9]))
    # GPG: alpha = 4 / (one non-zero score) = 4; mean 0.25
    close(gpg(s, group_ids=g, response_mask=m)[0][:, 0], torch.tensor([3.0, -1.0, -1.0, -1.0]))
    close(gpg(s, group_ids=g, response_mask=m, f_norm=2.0)[0][:, 0], torch.tensor([1.5, -0.5, -0.5, -0.5]))


def test_grpo_passk_hand_computed():
    s = torch.tensor([0.0, 1.0, 0.5, 1.0, 1.0])
    g = torch.tensor([4, 4, 4, 6, 6])
    m = torch.ones(5, 1, dtype=torch.bool)
    adv, _ = grpo_passk(s, group_ids=g, response_mask=m)
    # group 4: best is index 1, margin 1 - 0.5, std of [0, 1, 0.5] = 0.5; group 6: tie at the top -> 0
    close(adv[:, 0], torch.tensor([0.0, 0.5 / (0.5 + 1e-6), 0.0, 0.0, 0.0]))
    adv, _ = grpo_passk(s, group_ids=g, response_mask=m, norm_by_std=False)
    close(adv[:, 0], torch.tensor([0.0, 0.5, 0.0, 0.0, 0.0]))


def test_remax_hand_computed():
    m = torch.tensor([[True, True, False], [True, False, False]])
    adv, ret = remax(torch.tensor([1.0, 0.0]), baseline_scores=torch.tensor([0.25, 0.5]), response_mask=m)
    close(adv, torch.tensor([[0.75, 0.75, 0.0], [-0.5, 0.0, 0.0]]))
    close(ret, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))


def test_outcome_zero_outside_mask_and_bf16_promoted():
    m = torch.tensor([[True, False], [False, False], [True, True]])
    s = torch.tensor([1.0, 2.0, 4.0], dtype=torch.bfloat16)
    for fn in OUTCOME.values():
        adv, ret = fn(s, group_ids=torch.tensor([0, 0, 0]), response_mask=m)
        assert adv.dtype == torch.float32 and ret.dtype == torch.float32
        assert not adv[~m].any() and not ret[~m].any()


def test_discounted_reverse_cumsum_long_and_extreme_discounts():
    # t = 1100 needs three levels of blocks; no overflow for any discount, c = 0 is the identity.
    x = torch.randn(3, 1100, generator=torch.Generator().manual_seed(0))
    full = torch.ones_like(x, dtype=torch.bool)
    for c in [1.0, 0.999, 0.5, 1e-3, 0.0]:
        out = discounted_reverse_cumsum(x, discount=c)
        expected = ref_reward_to_go(x, full, c).float()
        scale = max(1.0, float(expected.abs().max()))
        close(out, expected, atol=2e-6 * scale)
    close(discounted_reverse_cumsum(x, discount=0.0), x, atol=0.0)


def test_scan_stays_exact_when_fp32_matmuls_may_be_reduced():
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 10
    expected = ref_reward_to_go(x, torch.ones_like(x, dtype=torch.bool), 0.99).float()
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")  # allows bf16 / TF32 inside fp32 matmuls
        out = discounted_reverse_cumsum(x, discount=0.99)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert out.dtype == torch.float32
    close(out, expected, atol=1e-4)


def test_gae_dtypes():
    gen = torch.Generator().manual_seed(7)
    r = torch.randn(3, 70, generator=gen, dtype=torch.float64)
    v = torch.randn(3, 70, generator=gen, dtype=torch.float64)
    m = torch.arange(70)[None, :] < torch.tensor([[70], [33], [5]])
    adv, ret = gae(r, values=v, response_mask=m, gamma=0.99, lam=0.95)
    ref_adv, ref_ret = ref_gae(r, v, m, 0.99, 0.95)
    assert adv.dtype == torch.float64
    close(adv, ref_adv, atol=1e-12)
    close(ret, ref_ret, atol=1e-12)
    adv16, ret16 = gae(r.bfloat16(), values=v.bfloat16(), response_mask=m, gamma=0.99, lam=0.95)
    assert adv16.dtype == torch.float32 and ret16.dtype == torch.float32
    ref16, _ = ref_gae(r.bfloat16(), v.bfloat16(), m, 0.99, 0.95)
    close(adv16, ref16.float(), atol=1e-4)


def test_inputs_are_not_modified():
    gen = torch.Generator().manual_seed(2)
    r, v = torch.randn(3, 40, generator=gen), torch.randn(3, 40, generator=gen)
    m = torch.rand(3, 40, generator=gen) > 0.3
    copies = [r.clone(), v.clone(), m.clone()]
    gae(r, values=v, response_mask=m, gamma=0.9, lam=0.9)
    reinforce_pp(r, response_mask=m, gamma=0.9)
    m_prefix = torch.arange(40)[None, :] < torch.tensor([[40], [7], [0]])
    gae(r, values=v, response_mask=m_prefix, gamma=0.9, lam=0.9)
    reinforce_pp(r, response_mask=m_prefix, gamma=0.9)
    discounted_reverse_cumsum(r, discount=0.9)
    discounted_reverse_cumsum(r[:, :32], discount=0.9)
    s, g = torch.randn(3, generator=gen), torch.tensor([1, 1, 2])
    s_copy, g_copy = s.clone(), g.clone()
    for fn in OUTCOME.values():
        fn(s, group_ids=g, response_mask=m)
    for before, after in zip(copies + [s_copy, g_copy], [r, v, m, s, g]):
        assert torch.equal(before, after)


# ----------------------------------------------------------------------------------------------------
# Properties
# ----------------------------------------------------------------------------------------------------


@st.composite
def token_batch(draw, max_b=5, max_t=80):
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    seed = draw(st.integers(0, 2**31 - 1))
    # right padding, left padding, one span anywhere (fast path); holes inside responses (general path)
    kind = draw(st.sampled_from(["right", "left", "span", "holes", "sparse"]))
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, t, generator=gen)
    values = torch.randn(b, t, generator=gen)
    pos = torch.arange(t)[None, :]
    start = torch.randint(0, t + 1, (b, 1), generator=gen)
    end = torch.randint(0, t + 1, (b, 1), generator=gen)
    if kind == "right":
        mask = pos < end
    elif kind == "left":
        mask = pos >= start
    elif kind == "span":
        mask = (pos >= torch.minimum(start, end)) & (pos < torch.maximum(start, end))
    else:
        keep = 0.8 if kind == "holes" else 0.4
        mask = (pos < end) & (torch.rand(b, t, generator=gen) < keep)
    return rewards, values, mask


@st.composite
def outcome_batch(draw, max_b=24):
    b = draw(st.integers(1, max_b))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    n_groups = draw(st.integers(1, b))
    id_values = torch.randint(-(10**12), 10**12, (n_groups,), generator=gen)  # arbitrary, sparse ids
    group_ids = id_values[torch.randint(0, n_groups, (b,), generator=gen)]
    binary = draw(st.booleans())
    scores = (torch.rand(b, generator=gen) < 0.5).float() if binary else torch.randn(b, generator=gen)
    t = draw(st.integers(1, 6))
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return scores, group_ids, mask


@PROPS
@given(token_batch(), st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.0]), st.sampled_from([1.0, 0.95, 0.5, 0.0]))
def test_gae_matches_loop_reference(batch, gamma, lam):
    r, v, m = batch
    adv, ret = gae(r, values=v, response_mask=m, gamma=gamma, lam=lam)
    ref_adv, ref_ret = ref_gae(r, v, m, gamma, lam)
    close(adv, ref_adv.float(), atol=2e-5)
    close(ret, ref_ret.float(), atol=2e-5)


@PROPS
@given(token_batch())
def test_gae_gamma_lam_one_is_reward_to_go_minus_value(batch):
    r, v, m = batch
    adv, ret = gae(r, values=v, response_mask=m, gamma=1.0, lam=1.0)
    rtg = ref_reward_to_go(r, m, 1.0).float()
    close(adv, torch.where(m, rtg - v, torch.zeros_like(v)), atol=2e-5)
    close(ret, rtg, atol=2e-5)


@PROPS
@given(token_batch(), st.sampled_from([1.0, 0.9, 0.3]))
def test_reinforce_pp_matches_loop_reference(batch, gamma):
    r, _, m = batch
    adv, ret = reinforce_pp(r, response_mask=m, gamma=gamma)
    close(ret, ref_reward_to_go(r, m, gamma).float(), atol=2e-5)
    close(adv, ret, atol=0.0)


@PROPS
@given(token_batch(), st.integers(1, 40))
def test_masked_padding_columns_change_nothing(batch, extra):
    r, v, m = batch
    b, t = r.shape
    junk = torch.full((b, extra), float("nan"))
    r2, v2 = torch.cat([r, junk], 1), torch.cat([v, junk], 1)
    m2 = torch.cat([m, torch.zeros(b, extra, dtype=torch.bool)], 1)
    for fn in [
        lambda r, v, m: gae(r, values=v, response_mask=m, gamma=0.99, lam=0.95),
        lambda r, v, m: reinforce_pp(r, response_mask=m, gamma=0.9),
    ]:
        a1, r1 = fn(r, v, m)
        a2, ret2 = fn(r2, v2, m2)
        # Equal up to rounding: the scan's blocks may fall differently on the longer rows.
        close(a2[:, :t], a1, atol=1e-5, rtol=1e-5)
        close(ret2[:, :t], r1, atol=1e-5, rtol=1e-5)
        assert not a2[:, t:].any() and not ret2[:, t:].any()
    scores, ids = torch.randn(b), torch.arange(b) % 2
    for fn in OUTCOME.values():
        a1, _ = fn(scores, group_ids=ids, response_mask=m)
        a2, _ = fn(scores, group_ids=ids, response_mask=m2)
        close(a2[:, :t], a1, atol=0.0)
        assert not a2[:, t:].any()


@PROPS
@given(outcome_batch())
def test_grpo_and_rloo_sum_to_zero_in_groups(batch):
    scores, group_ids, mask = batch
    full = torch.ones(scores.shape[0], 1, dtype=torch.bool)
    for fn in [grpo, rloo, OUTCOME["drgrpo"], reinforce_pp_baseline, gpg]:
        per_seq = fn(scores, group_ids=group_ids, response_mask=full)[0][:, 0].double()
        for gid in group_ids.unique():
            members = group_ids == gid
            if members.sum() > 1:
                assert abs(float(per_seq[members].sum())) < 1e-4 * max(1.0, float(per_seq[members].abs().max()))


@PROPS
@given(outcome_batch())
def test_permuting_rows_permutes_outputs(batch):
    scores, group_ids, mask = batch
    perm = torch.randperm(scores.shape[0], generator=torch.Generator().manual_seed(int(scores.shape[0])))
    for fn in OUTCOME.values():
        adv, ret = fn(scores, group_ids=group_ids, response_mask=mask)
        adv_p, ret_p = fn(scores[perm], group_ids=group_ids[perm], response_mask=mask[perm])
        # Only the summation order inside a group changes.
        close(adv_p, adv[perm], atol=1e-5, rtol=1e-5)
        close(ret_p, ret[perm], atol=1e-5, rtol=1e-5)


@PROPS
@given(token_batch())
def test_gae_permuting_rows_permutes_outputs(batch):
    r, v, m = batch
    perm = torch.randperm(r.shape[0], generator=torch.Generator().manual_seed(0))
    adv, ret = gae(r, values=v, response_mask=m, gamma=0.9, lam=0.8)
    adv_p, ret_p = gae(r[perm], values=v[perm], response_mask=m[perm], gamma=0.9, lam=0.8)
    close(adv_p, adv[perm], atol=1e-6, rtol=1e-6)  # vectorised float order differs with the row layout
    close(ret_p, ret[perm], atol=1e-6, rtol=1e-6)


@PROPS
@given(outcome_batch())
def test_relabelling_group_ids_changes_nothing(batch):
    scores, group_ids, mask = batch
    relabelled = group_ids * 3 - 7  # injective, order-preserving or not makes no difference
    flipped = -group_ids
    for fn in OUTCOME.values():
        expected, _ = fn(scores, group_ids=group_ids, response_mask=mask)
        close(fn(scores, group_ids=relabelled, response_mask=mask)[0], expected, atol=0.0)
        close(fn(scores, group_ids=flipped, response_mask=mask)[0], expected, atol=0.0)
        small = torch.unique(group_ids, return_inverse=True)[1].to(torch.int32)
        close(fn(scores, group_ids=small, response_mask=mask)[0], expected, atol=0.0)


def test_singleton_modes():
    s = torch.tensor([1.0, 2.0, 3.0])
    g = torch.tensor([0, 0, 1])
    m = torch.ones(3, 1, dtype=torch.bool)
    estimators = [grpo, rloo, reinforce_pp_baseline, opo, gpg]
    for fn in estimators:
        name = fn.__name__
        assert float(fn(s, group_ids=g, response_mask=m, singletons="zero")[0][2, 0]) == 0.0
        assert float(fn(s, group_ids=g, response_mask=m)[0][2, 0]) != 0.0  # baseline 0 (and std 1): verl's convention
        message = rf"{name}: group_ids has a group of one response \(response 2, group id 1\)"
        with pytest.raises(ValueError, match=message):
            fn(s, group_ids=g, response_mask=m, singletons="error")
        with pytest.raises(ValueError, match="unknown singletons mode 'bogus'; known modes: no_baseline, zero, error"):
            fn(s, group_ids=g, response_mask=m, singletons="bogus")


# ----------------------------------------------------------------------------------------------------
# torch.func
# ----------------------------------------------------------------------------------------------------


def test_gae_func_grad_equals_autograd():
    gen = torch.Generator().manual_seed(3)
    r, v = torch.randn(3, 70, generator=gen), torch.randn(3, 70, generator=gen)
    m = torch.rand(3, 70, generator=gen) > 0.2
    w = torch.randn(3, 70, generator=gen)

    def objective(rewards, values):
        adv, ret = gae(rewards, values=values, response_mask=m, gamma=0.99, lam=0.9)
        return (adv * w).sum() + (ret * ret).sum()

    g_r, g_v = torch.func.grad(objective, argnums=(0, 1))(r, v)
    r_, v_ = r.clone().requires_grad_(), v.clone().requires_grad_()
    a_r, a_v = torch.autograd.grad(objective(r_, v_), (r_, v_))
    close(g_r, a_r, atol=1e-6)
    close(g_v, a_v, atol=1e-6)
    # Masked positions get no gradient.
    assert not g_r[~m].any() and not g_v[~m].any()
    # d A_t / d r_s = (gamma lam)^(#valid between) for valid s >= t: check one entry by hand.
    one = torch.ones(1, 3, dtype=torch.bool)
    first_advantage = lambda rr: gae(rr, values=torch.zeros(1, 3), response_mask=one, gamma=0.5, lam=0.5)[0][0, 0]
    grad_r0 = torch.func.grad(first_advantage)(torch.zeros(1, 3))
    close(grad_r0, torch.tensor([[1.0, 0.25, 0.0625]]))


def test_gae_autograd_fast_path_equals_func_grad_general_path():
    # Outside torch.func a mask without holes takes the fast path; under torch.func.grad every mask
    # takes the general (compressing) path. Both must give the same gradients.
    gen = torch.Generator().manual_seed(6)
    r, v = torch.randn(4, 90, generator=gen), torch.randn(4, 90, generator=gen)
    m = torch.arange(90)[None, :] < torch.tensor([[90], [50], [1], [0]])
    m[1] = torch.arange(90) >= 30  # left padding
    w = torch.randn(4, 90, generator=gen)

    def objective(rewards, values):
        adv, ret = gae(rewards, values=values, response_mask=m, gamma=0.97, lam=0.9)
        return (adv * w).sum() + (ret * w * w).sum()

    g_r, g_v = torch.func.grad(objective, argnums=(0, 1))(r, v)
    r_, v_ = r.clone().requires_grad_(), v.clone().requires_grad_()
    a_r, a_v = torch.autograd.grad(objective(r_, v_), (r_, v_))
    close(g_r, a_r, atol=1e-5)
    close(g_v, a_v, atol=1e-5)
    x = torch.randn(3, 100, generator=gen)
    f = lambda y: (discounted_reverse_cumsum(y, discount=0.9) * x).sum()
    x_ = x.clone().requires_grad_()
    close(torch.func.grad(f)(x), torch.autograd.grad(f(x_), x_)[0], atol=1e-5)


def test_outcome_func_grad_equals_autograd():
    s = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.3])
    g = torch.tensor([3, 3, 3, 9, 9])
    m = torch.ones(5, 2, dtype=torch.bool)
    w = torch.arange(10.0).reshape(5, 2)
    for fn in [grpo, rloo, reinforce_pp_baseline, opo]:
        obj = lambda x: (fn(x, group_ids=g, response_mask=m)[0] * w).sum()
        s_ = s.clone().requires_grad_()
        close(torch.func.grad(obj)(s), torch.autograd.grad(obj(s_), s_)[0], atol=1e-6)


def test_gae_vmap_equals_loop():
    gen = torch.Generator().manual_seed(4)
    r, v = torch.randn(4, 50, generator=gen), torch.randn(4, 50, generator=gen)
    m = torch.rand(4, 50, generator=gen) > 0.25

    def single(rewards, values, mask):  # one sequence: (t,) each
        adv, ret = gae(rewards[None], values=values[None], response_mask=mask[None], gamma=0.95, lam=0.9)
        return adv[0], ret[0]

    adv_v, ret_v = torch.func.vmap(single)(r, v, m)
    loop = [single(r[i], v[i], m[i]) for i in range(4)]
    close(adv_v, torch.stack([a for a, _ in loop]), atol=1e-6)
    close(ret_v, torch.stack([x for _, x in loop]), atol=1e-6)
    close(adv_v, gae(r, values=v, response_mask=m, gamma=0.95, lam=0.9)[0], atol=1e-6)


def test_reinforce_pp_vmap_and_grpo_vmap_over_batches():
    gen = torch.Generator().manual_seed(5)
    r = torch.randn(3, 2, 40, generator=gen)
    m = torch.rand(3, 2, 40, generator=gen) > 0.3
    out = torch.func.vmap(lambda rr, mm: reinforce_pp(rr, response_mask=mm, gamma=0.9)[1])(r, m)
    close(out, torch.stack([reinforce_pp(r[i], response_mask=m[i], gamma=0.9)[1] for i in range(3)]), atol=1e-6)
    s = torch.randn(3, 6, generator=gen)
    g = torch.tensor([4, 4, 1, 1, 1, 7])
    mo = torch.ones(6, 2, dtype=torch.bool)
    out = torch.func.vmap(lambda ss: grpo(ss, group_ids=g, response_mask=mo)[0])(s)
    close(out, torch.stack([grpo(s[i], group_ids=g, response_mask=mo)[0] for i in range(3)]), atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# verl 0.9.1 parity (tests/golden/make_advantages_golden.py)
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def golden():
    return load_file(str(GOLDEN))


def test_golden_gae(golden):
    r, v, m = golden["token/rewards"], golden["token/values"], golden["token/mask"]
    for k in range(4):
        gamma, lam = golden[f"gae{k}/gamma_lam"].tolist()
        adv, ret = gae(r, values=v, response_mask=m, gamma=gamma, lam=lam)
        # verl whitens inside and leaves carried values outside the mask; compare on the mask.
        close(masked_whiten(adv, m)[m], golden[f"gae{k}/advantages_whitened"][m])
        close(ret[m], golden[f"gae{k}/returns"][m])
        assert not adv[~m].any() and not ret[~m].any()


def test_golden_reinforce_pp(golden):
    r, m = golden["token/rewards"], golden["token/mask"]
    for k in range(2):
        (gamma,) = golden[f"rpp{k}/gamma"].tolist()
        adv, ret = reinforce_pp(r, response_mask=m, gamma=gamma)
        close(ret, golden[f"rpp{k}/returns"])  # verl zeroes returns outside the mask too
        close(masked_whiten(adv, m), golden[f"rpp{k}/advantages_whitened"])


@pytest.mark.parametrize(
    "name, fn, ids_key",
    [
        ("grpo", grpo, "ids_loop"),
        ("drgrpo", functools.partial(grpo, norm_by_std=False), "ids_loop"),
        ("grpo_vectorized", grpo, "ids_vec"),
        ("rloo", rloo, "ids_loop"),
        ("rloo_vectorized", functools.partial(rloo, singletons="zero"), "ids_vec"),
        ("opo", opo, "ids_loop"),
        ("gpg", gpg, "ids_loop"),
    ],
)
def test_golden_outcome(golden, name, fn, ids_key):
    s, m = golden["outcome/scores"], golden["token/mask"]
    adv, ret = fn(s, group_ids=golden[f"outcome/{ids_key}"], response_mask=m)
    close(adv, golden[f"{name}/advantages"])
    close(ret, golden[f"{name}/returns"])


def test_golden_reinforce_pp_baseline(golden):
    m = golden["token/mask"]
    adv, _ = reinforce_pp_baseline(golden["outcome/scores"], group_ids=golden["outcome/ids_loop"], response_mask=m)
    close(masked_whiten(adv, m), golden["rppb_whitened/advantages"])


def test_golden_remax(golden):
    m = golden["token/mask"]
    adv, ret = remax(golden["outcome/scores"], baseline_scores=golden["remax/baselines"], response_mask=m)
    close(adv[m], golden["remax/advantages"][m])
    close(ret[m], golden["remax/returns"][m])


def test_golden_passk(golden):
    s, ids, m = golden["passk/scores"], golden["passk/ids"], golden["token/mask"]
    close(grpo_passk(s, group_ids=ids, response_mask=m)[0], golden["passk/advantages"])
    close(grpo_passk(s, group_ids=ids, response_mask=m, norm_by_std=False)[0], golden["passk_nostd/advantages"])
    chex.assert_trees_all_close(grpo_passk(s, group_ids=ids, response_mask=m)[1], golden["passk/returns"], atol=ATOL)


def test_golden_aliases_resolve_to_the_same_numbers(golden):
    s, m = golden["outcome/scores"], golden["token/mask"]
    ids = golden["outcome/ids_vec"]
    close(
        get_advantage_estimator("grpo_vectorized")(s, group_ids=ids, response_mask=m)[0],
        golden["grpo_vectorized/advantages"],
    )
    # verl's rloo_vectorized gives a group of one 0 (its loop version gives it its score): with its own defaults
    rloo_vectorized = get_advantage_estimator("rloo_vectorized")
    close(rloo_vectorized(s, group_ids=ids, response_mask=m)[0], golden["rloo_vectorized/advantages"])
    singleton = torch.tensor([0, 0, 1]), torch.tensor([1.0, 2.0, 5.0]), torch.ones(3, 2, dtype=torch.bool)
    close(rloo_vectorized(singleton[1], group_ids=singleton[0], response_mask=singleton[2])[0][2], torch.zeros(2))
    close(rloo(singleton[1], group_ids=singleton[0], response_mask=singleton[2])[0][2], torch.full((2,), 5.0))


# ----------------------------------------------------------------------------------------------------
# Registry and bad inputs
# ----------------------------------------------------------------------------------------------------


def test_registry():
    assert set(ADVANTAGE_ESTIMATORS) == {
        "gae",
        "grpo",
        "grpo_passk",
        "rloo",
        "rloo_vectorized",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "remax",
        "opo",
        "gpg",
    }
    for name, fn in ADVANTAGE_ESTIMATORS.items():
        assert get_advantage_estimator(name) is fn
    assert get_advantage_estimator("reinforce_plus_plus") is reinforce_pp
    assert get_advantage_estimator("reinforce_plus_plus_baseline") is reinforce_pp_baseline
    assert set(ADVANTAGE_ESTIMATOR_ALIASES.values()) <= set(ADVANTAGE_ESTIMATORS)
    with pytest.raises(TypeError):
        ADVANTAGE_ESTIMATORS["mine"] = gae  # read-only


def test_unknown_name_lists_known_names():
    expected = r"unknown advantage estimator 'ppo_magic'; known: gae, gpg, grpo, grpo_passk, opo, reinforce_pp, "
    with pytest.raises(ValueError, match=expected):
        get_advantage_estimator("ppo_magic")


def test_bad_token_inputs():
    r, v, m = torch.zeros(2, 5), torch.zeros(2, 5), torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"values must have shape \(2, 5\) \[b t\], got \(2, 4\)"):
        gae(r, values=v[:, :4], response_mask=m, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"response_mask must have shape \(2, 5\)"):
        gae(r, values=v, response_mask=m[:1], gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"token_rewards must have shape \(b, t\)"):
        reinforce_pp(r[0], response_mask=m[0], gamma=1.0)
    with pytest.raises(TypeError, match="response_mask must be a torch.bool mask, got torch.float32"):
        gae(r, values=v, response_mask=m.float(), gamma=1.0, lam=1.0)
    bad = r.clone()
    bad[1, 3] = float("inf")
    with pytest.raises(ValueError, match=r"token_rewards contains a non-finite value \(inf\) at index \(1, 3\)"):
        gae(bad, values=v, response_mask=m, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"token_rewards contains a non-finite value"):
        reinforce_pp(bad, response_mask=m, gamma=1.0)
    bad_v = v.clone()
    bad_v[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"values contains a non-finite value \(nan\) at index \(0, 0\)"):
        gae(r, values=bad_v, response_mask=m, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"gamma must lie in \[0, 1\], got 1.5"):
        gae(r, values=v, response_mask=m, gamma=1.5, lam=1.0)
    with pytest.raises(ValueError, match=r"lam must lie in \[0, 1\], got -0.1"):
        gae(r, values=v, response_mask=m, gamma=1.0, lam=-0.1)
    with pytest.raises(TypeError, match="token_rewards must be a floating-point tensor"):
        reinforce_pp(torch.zeros(2, 5, dtype=torch.long), response_mask=m, gamma=1.0)


def test_bad_outcome_inputs():
    s, g, m = torch.zeros(4), torch.tensor([0, 0, 1, 1]), torch.ones(4, 3, dtype=torch.bool)
    for name, fn in OUTCOME.items():
        with pytest.raises(ValueError, match=r"group_ids must have shape \(4,\) \[b\], got \(3,\)"):
            fn(s, group_ids=g[:3], response_mask=m)
        with pytest.raises(ValueError, match=r"response_mask must have shape \(4, t\)"):
            fn(s, group_ids=g, response_mask=m[:2])
        with pytest.raises(TypeError, match="response_mask must be a torch.bool mask"):
            fn(s, group_ids=g, response_mask=m.float())
        with pytest.raises(TypeError, match="group_ids must be an integer tensor"):
            fn(s, group_ids=g.float(), response_mask=m)
        nan = s.clone()
        nan[2] = float("nan")
        with pytest.raises(ValueError, match=r"scores contains a non-finite value \(nan\) at index \(2,\)"):
            fn(nan, group_ids=g, response_mask=m)
        inf = s.clone()
        inf[0] = float("-inf")
        with pytest.raises(ValueError, match="scores contains a non-finite value"):
            fn(inf, group_ids=g, response_mask=m)
    with pytest.raises(ValueError, match=r"grpo_passk needs at least 2 responses per group.*response 3, group id 9"):
        grpo_passk(s, group_ids=torch.tensor([0, 0, 0, 9]), response_mask=m)
    with pytest.raises(ValueError, match=r"baseline_scores must have shape \(4,\)"):
        remax(s, baseline_scores=s[:2], response_mask=m)
    with pytest.raises(ValueError, match="baseline_scores contains a non-finite value"):
        remax(s, baseline_scores=torch.tensor([0.0, float("nan"), 0.0, 0.0]), response_mask=m)


def test_zero_advantage_rows():
    from rlfunc.advantages import zero_advantage_rows

    adv = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, -0.0, 0.0], [0.5, 0.5, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]], dtype=torch.bool)
    # row 0: its only non-zero advantage is masked out; row 3: no loss token at all
    assert zero_advantage_rows(adv, mask).tolist() == [True, True, False, True, False]
    with pytest.raises(ValueError, match="same|match"):
        zero_advantage_rows(adv[:, :2], mask)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(2, 8), st.integers(0, 10_000))
def test_grpo_groups_with_one_reward_are_exactly_the_zero_advantage_rows(groups, n, seed):
    """GRPO: a row's advantages are all 0 exactly when every sample of its group got the same score."""
    from rlfunc.advantages import grpo, zero_advantage_rows

    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 2, (groups * n,), generator=g).float()
    group_ids = torch.arange(groups).repeat_interleave(n)
    mask = torch.ones(groups * n, 5, dtype=torch.bool)
    adv, _ = grpo(scores, group_ids=group_ids, response_mask=mask)
    same = torch.tensor([scores[group_ids == i].unique().numel() == 1 for i in range(groups)])[group_ids]
    assert torch.equal(zero_advantage_rows(adv, mask), same)

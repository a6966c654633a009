"""Off-policy corrections: masked importance sampling, the geometric ratio level, decoupled PPO, staleness.

Properties (hypothesis): with identical log-probs (staleness 0) every correction is the identity; bounds and
masks are respected; padding never matters; extreme finite inputs give no NaN; gradients reach only the
current log-probs. References: verl's ``rollout_corr_helper.compute_rollout_rejection_mask`` (+ token veto)
and AReaL's decoupled ``ppo_actor_loss_fn``, re-derived here token by token in plain Python.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlfunc as rf
from rlfunc.aggregation import local_normalizers
from rlfunc.importance import CORRECTION_LEVELS, rollout_is_weights, rollout_rejection_mask, staleness
from rlfunc.offpolicy import decoupled_ppo_policy_loss
from rlfunc.policy_loss_registry import (
    LOGPROB_KINDS,
    POLICY_LOSS_LOGPROBS,
    POLICY_LOSSES,
    check_logprobs_supplied,
    get_policy_loss,
)
from rlfunc.policy_losses import ppo_policy_loss

pytestmark = pytest.mark.offpolicy


def close(a, b, tol=1e-6):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@st.composite
def triples(draw, max_spread=3.0):
    """(current, proximal, behaviour, advantages, mask): log-probs a few nats apart, a random mask."""
    b = draw(st.integers(1, 5))
    t = draw(st.integers(1, 7))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    spread = draw(st.floats(0.0, max_spread))
    behaviour = -torch.rand(b, t, generator=g) * 5
    proximal = behaviour + torch.randn(b, t, generator=g) * spread
    current = proximal + torch.randn(b, t, generator=g) * spread * 0.3
    advantages = torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.3
    return current, proximal, behaviour, advantages, mask


def _row_log_ratio(log_ratio: list[float], keep: list[bool], level: str) -> list[float]:
    """Plain-Python ratio of each token at ``level`` (the verl formulas), clamped to +-20."""
    kept = [x for x, k in zip(log_ratio, keep) if k]
    if level == "token":
        values = log_ratio
    elif level == "sequence":
        values = [sum(kept)] * len(log_ratio)
    else:
        values = [sum(kept) / len(kept) if kept else 0.0] * len(log_ratio)
    return [min(max(v, -20.0), 20.0) for v in values]


# ---------------------------------------------------------------------------------------------------------
# identity at staleness 0


@settings(max_examples=40, deadline=None)
@given(x=triples(), level=st.sampled_from(CORRECTION_LEVELS), upper=st.floats(1.0, 10.0))
def test_identical_logprobs_leave_weights_and_mask_unchanged(x, level, upper):
    _, proximal, _, _, mask = x
    w, wm = rollout_is_weights(proximal, rollout_logprobs=proximal, response_mask=mask, level=level, upper=upper)
    close(w, mask.float())
    keep, m = rollout_rejection_mask(
        proximal, rollout_logprobs=proximal, response_mask=mask, level=level, upper=upper, token_veto=0.5
    )
    assert keep.dtype == torch.bool and torch.equal(keep, mask)
    assert all(float(v) == 0.0 for v in m.values()), m
    assert float(wm["is_truncated_frac"]) == 0.0


@settings(max_examples=40, deadline=None)
@given(
    x=triples(),
    clip_high=st.floats(0.1, 0.5),
    dual=st.sampled_from([None, 3.0]),
    agg=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]),
)
def test_decoupled_ppo_is_ppo_when_proximal_is_behaviour(x, clip_high, dual, agg):
    current, proximal, _, adv, mask = x
    norms = local_normalizers(mask)
    kw = dict(
        advantages=adv, response_mask=mask, clip_low=0.2, clip_high=clip_high, dual_clip=dual, agg=agg, norms=norms
    )
    lp1, lp2, lp3 = (current.clone().requires_grad_() for _ in range(3))
    ref, ref_m = ppo_policy_loss(lp1, old_logprobs=proximal, **kw)
    same, m = decoupled_ppo_policy_loss(lp2, old_logprobs=proximal, behaviour_logprobs=proximal.clone(), **kw)
    none, _ = decoupled_ppo_policy_loss(lp3, old_logprobs=proximal, **kw)
    (ref + same + none).backward()
    close(same, ref, 1e-5)
    close(none, ref, 1e-5)
    close(lp2.grad, lp1.grad, 1e-5)
    close(lp3.grad, lp1.grad, 1e-5)
    for key in ref_m:
        close(m[key], ref_m[key], 1e-5)
    assert float(m["behaviour_capped_frac"]) == 0.0 and float(m["behaviour_kl"]) == 0.0
    close(m["behaviour_weight_mean"], torch.tensor(float(mask.any())))


@settings(max_examples=30, deadline=None)
@given(x=triples(), current=st.integers(0, 50))
def test_staleness_zero_when_every_token_is_current(x, current):
    *_, mask = x
    age, m = staleness(torch.full(mask.shape, current), current_version=current, response_mask=mask)
    assert age.dtype == torch.int64 and not age.any()
    nonempty = float(mask.any())
    assert float(m["staleness_max"]) == float(m["staleness_min"]) == float(m["staleness_mean"]) == 0.0
    assert float(m["staleness_frac_0"]) == nonempty
    assert float(m["staleness_frac_1"]) == float(m["staleness_frac_ge_3"]) == 0.0


# ---------------------------------------------------------------------------------------------------------
# masked importance sampling (rejection) and the geometric level


@settings(max_examples=60, deadline=None)
@given(
    x=triples(),
    level=st.sampled_from(CORRECTION_LEVELS),
    upper=st.floats(1.05, 6.0),
    lower=st.one_of(st.none(), st.floats(0.0, 1.0)),
)
def test_rejection_keeps_exactly_the_tokens_within_the_bounds(x, level, upper, lower):
    _, trainer, rollout, _, mask = x
    keep, m = rollout_rejection_mask(
        trainer, rollout_logprobs=rollout, response_mask=mask, level=level, upper=upper, lower=lower
    )
    lo = 1.0 / upper if lower is None else lower
    assert not (keep & ~mask).any()
    log_ratio = torch.where(mask, trainer - rollout, 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    elif level == "geometric":
        log_ratio = (log_ratio.sum(-1) / mask.sum(-1).clamp(min=1))[:, None].expand_as(log_ratio)
    ratio = torch.exp(log_ratio.clamp(-20, 20))
    inside = (ratio >= lo) & (ratio <= upper)
    borderline = mask & (((ratio - lo).abs() < 1e-5) | ((ratio - upper).abs() < 1e-5))
    assert torch.equal((keep == (mask & inside)) | borderline, torch.ones_like(mask))
    if level != "token":  # a row is kept or dropped whole
        assert torch.all(torch.where(mask, keep == keep.any(-1, keepdim=True), True))
    close(m["rs_masked_frac"], ((mask & ~keep).sum() / mask.sum().clamp(min=1)).float())
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())


def _verl_rejection(trainer, rollout, mask, level, upper, lower, veto):
    """verl's compute_rollout_rejection_mask (+ the token veto), row by row in plain Python."""
    lower = 1.0 / upper if lower is None else lower
    out, masked, seq_masked = [], 0, 0
    for tr, ro, mk in zip(trainer.tolist(), rollout.tolist(), mask.tolist()):
        lr = [a - b for a, b in zip(tr, ro)]
        w = [math.exp(v) for v in _row_log_ratio(lr, mk, level)]
        row = [bool(k) and lower <= x <= upper for x, k in zip(w, mk)]
        if veto is not None and any(k and v < math.log(veto) for v, k in zip(lr, mk)):
            row = [False] * len(row)
        masked += sum(k and not r for k, r in zip(mk, row))
        seq_masked += any(k and not r for k, r in zip(mk, row))
        out.append(row)
    n_tok, n_seq = max(int(mask.sum()), 1), max(int(mask.any(-1).sum()), 1)
    return torch.tensor(out, dtype=torch.bool), masked / n_tok, seq_masked / n_seq


@settings(max_examples=60, deadline=None)
@given(
    x=triples(),
    level=st.sampled_from(CORRECTION_LEVELS),
    upper=st.sampled_from([1.5, 2.0, 5.0]),
    lower=st.sampled_from([None, 0.5, 0.0]),
    veto=st.sampled_from([None, 1e-2, 0.3]),
)
def test_rejection_matches_the_verl_formula(x, level, upper, lower, veto):
    _, trainer, rollout, _, mask = x
    trainer, rollout = trainer.double(), rollout.double()  # away from float ties at the bounds
    keep, m = rollout_rejection_mask(
        trainer, rollout_logprobs=rollout, response_mask=mask, level=level, upper=upper, lower=lower, token_veto=veto
    )
    ref, frac, seq_frac = _verl_rejection(trainer, rollout, mask, level, upper, lower, veto)
    assert torch.equal(keep, ref)
    assert math.isclose(float(m["rs_masked_frac"]), frac, abs_tol=1e-9)
    assert math.isclose(float(m["rs_seq_masked_frac"]), seq_frac, abs_tol=1e-9)


def test_rejection_hand_computed():
    trainer = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.0, -1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-2.0, -1.0, -0.5, -0.1], [-1.2, -1.2, -1.2, -1.2]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    # token ratios row 0: e, 1/e, 1 (padding ignored); row 1: e^0.2 each
    keep, m = rollout_rejection_mask(trainer, rollout_logprobs=rollout, response_mask=mask, upper=2.0)
    assert keep.tolist() == [[False, False, True, False], [True] * 4]
    close(m["rs_masked_frac"], torch.tensor(2 / 7))
    close(m["rs_frac_high"], torch.tensor(1 / 7))
    close(m["rs_frac_low"], torch.tensor(1 / 7))
    close(m["rs_seq_masked_frac"], torch.tensor(0.5))
    # geometric: row 0 mean log ratio 0 -> kept; row 1 e^0.2 -> kept with upper 2, dropped with upper 1.1
    keep, _ = rollout_rejection_mask(
        trainer, rollout_logprobs=rollout, response_mask=mask, level="geometric", upper=1.1
    )
    assert keep.tolist() == [[True, True, True, False], [False] * 4]
    # sequence: row 0 sum 0 -> kept, row 1 e^0.8 ~ 2.23 > 2 -> dropped
    keep, _ = rollout_rejection_mask(trainer, rollout_logprobs=rollout, response_mask=mask, level="sequence")
    assert keep.tolist() == [[True, True, True, False], [False] * 4]
    # veto: row 0 holds a token with ratio 1/e < 0.5
    keep, m = rollout_rejection_mask(
        trainer, rollout_logprobs=rollout, response_mask=mask, level="sequence", upper=3.0, token_veto=0.5
    )
    assert keep.tolist() == [[False] * 4, [True] * 4]
    close(m["rs_veto_frac"], torch.tensor(0.5))


@settings(max_examples=60, deadline=None)
@given(x=triples(), upper=st.floats(0.5, 10.0), icepop=st.booleans())
def test_geometric_weights_match_the_row_geometric_mean(x, upper, icepop):
    _, trainer, rollout, _, mask = x
    lower = min(0.5, upper / 2) if icepop else None
    w, _ = rollout_is_weights(
        trainer.double(),
        rollout_logprobs=rollout.double(),
        response_mask=mask,
        level="geometric",
        upper=upper,
        lower=lower,
    )
    for i, (tr, ro, mk) in enumerate(zip(trainer.double().tolist(), rollout.double().tolist(), mask.tolist())):
        lr = _row_log_ratio([a - b for a, b in zip(tr, ro)], mk, "geometric")
        for j, k in enumerate(mk):
            raw = math.exp(lr[j])
            want = 0.0 if not k else (min(raw, upper) if lower is None else raw * (lower <= raw <= upper))
            assert math.isclose(float(w[i, j]), want, rel_tol=1e-9, abs_tol=1e-12), (i, j)


@settings(max_examples=40, deadline=None)
@given(x=triples(), level=st.sampled_from(CORRECTION_LEVELS), junk=st.sampled_from([float("nan"), float("inf"), -1e30]))
def test_padding_never_reaches_the_mask_or_the_weights(x, level, junk):
    _, trainer, rollout, _, mask = x
    jt, jr = torch.where(mask, trainer, junk), torch.where(mask, rollout, junk)
    keep, m = rollout_rejection_mask(trainer, rollout_logprobs=rollout, response_mask=mask, level=level, token_veto=0.1)
    keep2, m2 = rollout_rejection_mask(jt, rollout_logprobs=jr, response_mask=mask, level=level, token_veto=0.1)
    assert torch.equal(keep, keep2)
    for k in m:
        close(m2[k], m[k])
    w, _ = rollout_is_weights(trainer, rollout_logprobs=rollout, response_mask=mask, level=level)
    w2, _ = rollout_is_weights(jt, rollout_logprobs=jr, response_mask=mask, level=level)
    close(w2, w)


@settings(max_examples=30, deadline=None)
@given(x=triples(max_spread=1e4), level=st.sampled_from(CORRECTION_LEVELS))
def test_extreme_finite_log_ratios_stay_finite(x, level):
    current, trainer, rollout, adv, mask = x
    w, wm = rollout_is_weights(trainer, rollout_logprobs=rollout, response_mask=mask, level=level, upper=1e9)
    keep, m = rollout_rejection_mask(
        trainer, rollout_logprobs=rollout, response_mask=mask, level=level, token_veto=1e-9
    )
    assert torch.isfinite(w).all() and all(torch.isfinite(v) for v in {**wm, **m}.values())
    lp = current.clone().requires_grad_()
    loss, lm = decoupled_ppo_policy_loss(
        lp, old_logprobs=trainer, behaviour_logprobs=rollout, advantages=adv, response_mask=mask, dual_clip=3.0
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all() and all(torch.isfinite(v) for v in lm.values())


def test_vmap_matches_the_loop():
    g = torch.Generator().manual_seed(0)
    trainer, rollout = -torch.rand(3, 4, 5, generator=g), -torch.rand(3, 4, 5, generator=g)
    mask = torch.rand(3, 4, 5, generator=g) > 0.2

    def rs(a, b, c):
        return rollout_rejection_mask(
            a, rollout_logprobs=b, response_mask=c, level="geometric", upper=1.2, token_veto=0.5
        )[0]

    def geo(a, b, c):
        return rollout_is_weights(a, rollout_logprobs=b, response_mask=c, level="geometric", upper=1.1)[0]

    for fn in (rs, geo):
        assert torch.equal(
            torch.func.vmap(fn)(trainer, rollout, mask), torch.stack([fn(*x) for x in zip(trainer, rollout, mask)])
        )


def test_rejection_bad_inputs_raise_clear_errors():
    x, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="unknown importance-sampling level 'geo'"):
        rollout_rejection_mask(x, rollout_logprobs=x, response_mask=m, level="geo")
    with pytest.raises(ValueError, match="lower must be in"):
        rollout_rejection_mask(x, rollout_logprobs=x, response_mask=m, upper=1.0, lower=2.0)
    with pytest.raises(ValueError, match="upper must be > 0"):
        rollout_rejection_mask(x, rollout_logprobs=x, response_mask=m, upper=0.0)
    with pytest.raises(ValueError, match="token_veto must be > 0"):
        rollout_rejection_mask(x, rollout_logprobs=x, response_mask=m, token_veto=0.0)
    with pytest.raises(TypeError, match="bool mask"):
        rollout_rejection_mask(x, rollout_logprobs=x, response_mask=m.float())
    with pytest.raises(TypeError, match="positional argument"):
        rollout_rejection_mask(x, x, m)  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------------------
# decoupled PPO


def _areal_reference(current, proximal, behaviour, adv, mask, eps_low, eps_high, c_clip, cap):
    """AReaL's decoupled ppo_actor_loss_fn with a token mean, token by token in plain Python."""
    total = 0.0
    for cur, prox, beh, a_row, m_row in zip(*(x.tolist() for x in (current, proximal, behaviour, adv, mask))):
        for c, p, b, a, k in zip(cur, prox, beh, a_row, m_row):
            if not k:
                continue
            r = math.exp(c - p)
            loss = max(-a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high))
            if c_clip is not None and a < 0:
                loss = min(loss, -c_clip * a)
            w = math.exp(p - b)
            total += loss * (0.0 if cap is not None and w > cap else w)
    return total / max(int(mask.sum()), 1)


@settings(max_examples=60, deadline=None)
@given(
    x=triples(max_spread=0.7),
    eps_high=st.sampled_from([0.2, 0.28]),
    dual=st.sampled_from([None, 3.0]),
    cap=st.sampled_from([None, 1.5, 5.0]),
)
def test_decoupled_ppo_matches_the_areal_formula(x, eps_high, dual, cap):
    current, proximal, behaviour, adv, mask = (v.double() if v.is_floating_point() else v for v in x)
    loss, m = decoupled_ppo_policy_loss(
        current,
        old_logprobs=proximal,
        behaviour_logprobs=behaviour,
        advantages=adv,
        response_mask=mask,
        clip_low=0.2,
        clip_high=eps_high,
        dual_clip=dual,
        behaviour_weight_cap=cap,
        norms=local_normalizers(mask),
    )
    ref = _areal_reference(current, proximal, behaviour, adv, mask, 0.2, eps_high, dual, cap)
    assert math.isclose(float(loss), ref, rel_tol=1e-9, abs_tol=1e-12)
    w = torch.exp(proximal - behaviour)
    capped = mask & (w > cap) if cap is not None else torch.zeros_like(mask)
    assert math.isclose(float(m["behaviour_capped_frac"]), int(capped.sum()) / max(int(mask.sum()), 1), rel_tol=1e-6)


@settings(max_examples=40, deadline=None)
@given(x=triples(max_spread=1.0), cap=st.sampled_from([None, 1.2, 3.0]))
def test_decoupled_ppo_is_ppo_with_behaviour_weights(x, cap):
    current, proximal, behaviour, adv, mask = x
    w, _ = rollout_is_weights(
        proximal, rollout_logprobs=behaviour, response_mask=mask, upper=cap or 1e30, lower=None if cap is None else 0.0
    )
    norms = local_normalizers(mask)
    kw = dict(old_logprobs=proximal, advantages=adv, response_mask=mask, norms=norms, dual_clip=2.5)
    lp1, lp2 = current.clone().requires_grad_(), current.clone().requires_grad_()
    ref, _ = ppo_policy_loss(lp1, is_weights=w, **kw)
    got, _ = decoupled_ppo_policy_loss(lp2, behaviour_logprobs=behaviour, behaviour_weight_cap=cap, **kw)
    (ref + got).backward()
    close(got, ref, 1e-5)
    close(lp2.grad, lp1.grad, 1e-5)
    if cap is not None:  # capped tokens carry neither loss nor gradient
        assert not lp2.grad[mask & (torch.exp(proximal - behaviour) > cap * (1 + 1e-6))].any()


@settings(max_examples=30, deadline=None)
@given(x=triples(max_spread=1.0), junk=st.sampled_from([float("nan"), float("inf"), -1e30]))
def test_decoupled_gradients_reach_only_the_current_logprobs_and_never_the_padding(x, junk):
    current, proximal, behaviour, adv, mask = x
    iw = torch.rand(mask.shape, generator=torch.Generator().manual_seed(0)) + 0.5

    def run(fill):
        lp = torch.where(mask, current, fill).requires_grad_()
        others = [torch.where(mask, v, fill).requires_grad_() for v in (proximal, behaviour, iw)]
        loss, m = decoupled_ppo_policy_loss(
            lp,
            old_logprobs=others[0],
            behaviour_logprobs=others[1],
            is_weights=others[2],
            advantages=torch.where(mask, adv, fill),
            response_mask=mask,
            behaviour_weight_cap=4.0,
        )
        grads = torch.autograd.grad(loss, [lp, *others], allow_unused=True)
        assert all(g is None or not g.any() for g in grads[1:])
        assert all(not v.requires_grad for v in m.values())
        return loss.detach(), grads[0], m

    base, base_grad, base_m = run(0.0)
    other, other_grad, other_m = run(junk)
    close(other, base)
    close(other_grad, base_grad)
    assert not base_grad[~mask].any()
    for k in base_m:
        close(other_m[k], base_m[k])


def test_decoupled_ppo_works_under_torch_func_grad_and_vmap():
    g = torch.Generator().manual_seed(3)
    cur, prox = -torch.rand(3, 4, 5, generator=g), -torch.rand(3, 4, 5, generator=g)
    beh, adv = prox + 0.3 * torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    mask = torch.rand(3, 4, 5, generator=g) > 0.2

    def loss(lp, p, b, a, m):
        return decoupled_ppo_policy_loss(
            lp, old_logprobs=p, behaviour_logprobs=b, advantages=a, response_mask=m, behaviour_weight_cap=2.0
        )[0]

    batched = torch.func.vmap(torch.func.grad(loss))(cur, prox, beh, adv, mask)
    for i in range(3):
        lp = cur[i].clone().requires_grad_()
        loss(lp, prox[i], beh[i], adv[i], mask[i]).backward()
        close(batched[i], lp.grad)


def test_decoupled_ppo_is_registered_and_keyword_only():
    assert get_policy_loss("decoupled_ppo") is decoupled_ppo_policy_loss is rf.decoupled_ppo_policy_loss
    assert get_policy_loss("decoupled-ppo") is decoupled_ppo_policy_loss
    assert "decoupled_ppo" in rf.ADVANTAGE_PROPORTIONAL_LOSSES
    x = torch.zeros(2, 3)
    with pytest.raises(TypeError, match="positional argument"):
        decoupled_ppo_policy_loss(x, x, x, x)  # type: ignore[misc]
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="behaviour_weight_cap must be > 0"):
        decoupled_ppo_policy_loss(x, old_logprobs=x, advantages=x, response_mask=m, behaviour_weight_cap=0.0)
    with pytest.raises(ValueError, match=r"behaviour_logprobs must have shape \(2, 3\)"):
        decoupled_ppo_policy_loss(
            x, old_logprobs=x, behaviour_logprobs=torch.zeros(2, 4), advantages=x, response_mask=m
        )
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        decoupled_ppo_policy_loss(x, old_logprobs=x, advantages=x, response_mask=m, dual_clip=1.0)


# ---------------------------------------------------------------------------------------------------------
# which log-probs a loss needs


def test_every_registered_loss_declares_its_logprobs():
    assert set(POLICY_LOSS_LOGPROBS) == set(POLICY_LOSSES)
    for name, needed in POLICY_LOSS_LOGPROBS.items():
        assert needed[0] == "current" and set(needed) <= set(LOGPROB_KINDS), name
    assert POLICY_LOSS_LOGPROBS["decoupled_ppo"] == ("current", "proximal", "behaviour")
    assert POLICY_LOSS_LOGPROBS["gpg"] == ("current",)
    with pytest.raises(TypeError):
        POLICY_LOSS_LOGPROBS["ppo"] = ("current",)  # type: ignore[index]


def test_a_configuration_without_the_needed_logprobs_is_refused():
    check_logprobs_supplied("ppo", available=("current", "proximal"))
    check_logprobs_supplied(ppo_policy_loss, available=("current", "proximal"))
    check_logprobs_supplied("gpg", available=("current",))
    check_logprobs_supplied("decoupled-ppo", available=LOGPROB_KINDS)
    with pytest.raises(ValueError, match="needs the behaviour log-probs"):
        check_logprobs_supplied("decoupled_ppo", available=("current", "proximal"))
    with pytest.raises(ValueError, match="needs the proximal log-probs"):
        check_logprobs_supplied(decoupled_ppo_policy_loss, available=("current", "behaviour"))
    with pytest.raises(ValueError, match="unknown log-prob kinds"):
        check_logprobs_supplied("ppo", available=("current", "old"))
    with pytest.raises(ValueError, match="unknown policy loss"):
        check_logprobs_supplied("my_loss", available=LOGPROB_KINDS)

    def my_loss(logprobs, **kw):
        raise AssertionError("never called")

    check_logprobs_supplied(my_loss, available=("current", "proximal"))
    my_loss.logprobs_needed = ("current", "behaviour")
    with pytest.raises(ValueError, match="needs the behaviour log-probs"):
        check_logprobs_supplied(my_loss, available=("current", "proximal"))


# ---------------------------------------------------------------------------------------------------------
# policy versions and staleness


def _batch(b=4, t=5, **extra):
    g = torch.Generator().manual_seed(0)
    return rf.RolloutBatch(
        prompt_ids=torch.randint(0, 9, (b, 3), generator=g),
        prompt_mask=torch.ones(b, 3, dtype=torch.bool),
        response_ids=torch.randint(0, 9, (b, t), generator=g),
        response_mask=torch.rand(b, t, generator=g) > 0.3,
        group_ids=torch.arange(b) // 2,
        **extra,
    )


def test_policy_version_travels_with_the_rows():
    version = torch.arange(20).reshape(4, 5) // 3
    batch = rf.validate(_batch(policy_version=version))
    assert torch.equal(rf.select(batch, [2, 0]).policy_version, version[[2, 0]])
    parts = rf.split(batch, 2)
    assert torch.equal(parts[1].policy_version, version[2:])
    assert torch.equal(rf.concat(parts).policy_version, version)
    assert _batch().policy_version is None
    with pytest.raises(TypeError, match="policy_version must have a int dtype"):
        rf.validate(_batch(policy_version=version.float()))
    with pytest.raises(ValueError, match="policy_version must have shape"):
        rf.validate(_batch(policy_version=version[:, :4]))


@settings(max_examples=50, deadline=None)
@given(x=triples(), current=st.integers(5, 9), bins=st.integers(2, 6), seed=st.integers(0, 1000))
def test_staleness_counts_versions_behind_the_current_one(x, current, bins, seed):
    *_, mask = x
    version = torch.randint(0, current + 1, mask.shape, generator=torch.Generator().manual_seed(seed))
    age, m = staleness(version, current_version=torch.tensor(current), response_mask=mask, bins=bins)
    assert torch.equal(age, torch.where(mask, current - version, 0))
    ages = (current - version)[mask].tolist()
    if ages:
        assert float(m["staleness_min"]) == min(ages) and float(m["staleness_max"]) == max(ages)
        assert math.isclose(float(m["staleness_mean"]), sum(ages) / len(ages), rel_tol=1e-6)
    hist = [float(m[f"staleness_frac_{k}"]) for k in range(bins - 1)] + [float(m[f"staleness_frac_ge_{bins - 1}"])]
    want = [sum(a == k for a in ages) for k in range(bins - 1)] + [sum(a >= bins - 1 for a in ages)]
    for h, w in zip(hist, want):
        assert math.isclose(h, w / max(len(ages), 1), rel_tol=1e-6)
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())


def test_staleness_edge_cases_and_transforms():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    age, m = staleness(torch.zeros(2, 3, dtype=torch.int32), current_version=4, response_mask=mask)
    assert not age.any() and all(float(v) == 0.0 for v in m.values())
    _, m = staleness(
        torch.zeros(0, 3, dtype=torch.long), current_version=1, response_mask=torch.zeros(0, 3, dtype=torch.bool)
    )
    assert all(float(v) == 0.0 for v in m.values())
    g = torch.Generator().manual_seed(1)
    version, mask = torch.randint(0, 4, (3, 2, 5), generator=g), torch.rand(3, 2, 5, generator=g) > 0.3
    fn = lambda v, k: staleness(v, current_version=4, response_mask=k)[1]["staleness_mean"]  # noqa: E731
    close(torch.func.vmap(fn)(version, mask), torch.stack([fn(v, k) for v, k in zip(version, mask)]))
    with pytest.raises(TypeError, match="integer tensor"):
        staleness(version[0].float(), current_version=4, response_mask=mask[0])
    with pytest.raises(TypeError, match="current_version"):
        staleness(version[0], current_version=torch.tensor(4.0), response_mask=mask[0])
    with pytest.raises(ValueError, match="bins must be >= 2"):
        staleness(version[0], current_version=4, response_mask=mask[0], bins=1)
    with pytest.raises(TypeError, match="positional argument"):
        staleness(version[0], 4, mask[0])  # type: ignore[misc]

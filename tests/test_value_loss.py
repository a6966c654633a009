"""Tests for rlfunc.value_loss: hand-computed cases, properties, and parity with verl 0.9.1 (golden file)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

from rlfunc.aggregation import AGG_MODES, Normalizers, aggregate, local_normalizers
from rlfunc.value_loss import value_loss

GOLDEN = Path(__file__).parent / "golden" / "losses.safetensors"
HYP = settings(max_examples=25, deadline=None)


def make_batch(seed: int, b: int = 4, t: int = 6, *, p_mask: float = 0.75):
    g = torch.Generator().manual_seed(seed)
    old_values = torch.randn(b, t, generator=g)
    values = old_values + 0.4 * torch.randn(b, t, generator=g)
    returns = old_values + torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) < p_mask
    return values, old_values, returns, mask


def loss_and_grad(values, old_values, returns, response_mask, **kwargs):
    v = values.detach().clone().requires_grad_(True)
    loss, metrics = value_loss(v, old_values=old_values, returns=returns, response_mask=response_mask, **kwargs)
    (grad,) = torch.autograd.grad(loss, v)
    return loss.detach(), grad, metrics


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_hand_computed():
    values = torch.tensor([[1.0, 2.0, 1.0]])
    old_values = torch.tensor([[0.0, 2.0, 0.0]])
    returns = torch.tensor([[0.0, 3.0, 2.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, grad, metrics = loss_and_grad(values, old_values, returns, mask, clip_range=0.2)
    # token 0: unclipped error 1 beats clipped 0.2 -> 1, grad 2*(1-0);
    # token 1: no move -> error 1, grad 2*(2-3);
    # token 2: clipped prediction 0.2 is further from 2 (1.8^2 = 3.24 > 1) -> clipped wins, no grad
    close(loss, torch.tensor(0.5 * (1.0 + 1.0 + 3.24) / 3))
    close(grad, torch.tensor([[0.5 * 2.0 / 3, 0.5 * -2.0 / 3, 0.0]]))
    close(metrics["vf_clipfrac"], torch.tensor(1 / 3))
    close(metrics["vpred_mean"], torch.tensor(4 / 3))


@pytest.mark.parametrize("agg", AGG_MODES)
def test_unclipped_is_half_squared_error(agg):
    values, old_values, returns, mask = make_batch(0)
    loss, metrics = value_loss(
        values, old_values=old_values, returns=returns, response_mask=mask, clip_range=None, agg=agg
    )
    close(loss, 0.5 * aggregate((values - returns) ** 2, mask, mode=agg))
    assert metrics["vf_clipfrac"] == 0


@HYP
@given(seed=st.integers(0, 2**31 - 1), clip=st.floats(0.0, 2.0), agg=st.sampled_from(AGG_MODES))
def test_no_move_means_no_clipping(seed, clip, agg):
    _, old_values, returns, mask = make_batch(seed)
    loss, grad, metrics = loss_and_grad(old_values, old_values, returns, mask, clip_range=clip, agg=agg)
    ref_loss, ref_grad, _ = loss_and_grad(old_values, old_values, returns, mask, clip_range=None, agg=agg)
    close(loss, ref_loss)
    close(grad, ref_grad)
    assert metrics["vf_clipfrac"] == 0


@HYP
@given(seed=st.integers(0, 2**31 - 1), clip=st.floats(0.01, 1.0))
def test_clipped_loss_is_pessimistic_and_matches_the_textbook_form(seed, clip):
    values, old_values, returns, mask = make_batch(seed)
    loss, grad, _ = loss_and_grad(values, old_values, returns, mask, clip_range=clip, agg="token-sum")
    plain, _ = value_loss(
        values, old_values=old_values, returns=returns, response_mask=mask, clip_range=None, agg="token-sum"
    )
    assert loss >= plain - 1e-6
    clipped = torch.max(torch.min(values, old_values + clip), old_values - clip)
    per_token = 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    close(loss, per_token[mask].sum())
    # the gradient is zero where the clipped error wins and the prediction left the trust region
    frozen = mask & ((clipped - returns) ** 2 > (values - returns) ** 2)
    assert torch.all(grad[frozen] == 0)


def test_padding_with_nan_changes_nothing():
    values, old_values, returns, mask = make_batch(5, 4, 6)
    b, t = mask.shape
    pad = lambda x, v: torch.cat(
        [torch.cat([x, torch.full((b, 3), v, dtype=x.dtype)], 1), torch.full((2, t + 3), v, dtype=x.dtype)], 0
    )
    nan = float("nan")
    for clip in (0.2, None):
        for agg in AGG_MODES:
            loss, grad, metrics = loss_and_grad(values, old_values, returns, mask, clip_range=clip, agg=agg, horizon=10)
            loss_p, grad_p, metrics_p = loss_and_grad(
                pad(values, nan),
                pad(old_values, nan),
                pad(returns, nan),
                pad(mask, False),
                clip_range=clip,
                agg=agg,
                horizon=10,
            )
            close(loss_p, loss)
            assert not torch.isnan(grad_p).any()
            close(grad_p[:b, :t], grad)
            for k in metrics:
                close(metrics_p[k], metrics[k])


@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batches_with_global_normalizers_match_the_full_batch(agg):
    values, old_values, returns, mask = make_batch(7, 7, 6)
    mask[4] = False
    full_loss, full_grad, _ = loss_and_grad(values, old_values, returns, mask, agg=agg, horizon=8)
    splits = [slice(0, 3), slice(3, 4), slice(4, 7)]
    norms = functools.reduce(lambda a, b: a + b, [local_normalizers(mask[s]) for s in splits])
    v = values.clone().requires_grad_(True)
    total = sum(
        value_loss(
            v[s], old_values=old_values[s], returns=returns[s], response_mask=mask[s], agg=agg, norms=norms, horizon=8
        )[0]
        for s in splits
    )
    total.backward()
    close(total.detach(), full_loss)
    close(v.grad, full_grad)


def test_func_grad_equals_autograd():
    values, old_values, returns, mask = make_batch(11)
    _, expected, _ = loss_and_grad(values, old_values, returns, mask)
    grad, metrics = torch.func.grad(
        lambda v: value_loss(v, old_values=old_values, returns=returns, response_mask=mask), has_aux=True
    )(values)
    close(grad, expected)
    assert set(metrics) == {"vf_clipfrac", "vpred_mean"}


@pytest.mark.parametrize("clip", [0.2, None])
def test_vmap_over_a_leading_dim_equals_a_loop(clip):
    batches = [make_batch(s) for s in range(3)]
    stacked = [torch.stack(xs) for xs in zip(*batches, strict=True)]
    loss, metrics = torch.vmap(
        lambda v, o, r, m: value_loss(v, old_values=o, returns=r, response_mask=m, clip_range=clip)
    )(*stacked)
    for k, (v, o, r, m) in enumerate(batches):
        loss_k, metrics_k = value_loss(v, old_values=o, returns=r, response_mask=m, clip_range=clip)
        close(loss[k], loss_k)
        for key in metrics_k:
            close(metrics[key][k], metrics_k[key])


def test_empty_mask_gives_zero_loss_and_finite_grads():
    values, old_values, returns, _ = make_batch(13)
    values[0, 0] = float("nan")
    mask = torch.zeros_like(values, dtype=torch.bool)
    for clip in (0.2, None):
        for agg in AGG_MODES:
            loss, grad, metrics = loss_and_grad(values, old_values, returns, mask, clip_range=clip, agg=agg)
            assert loss == 0
            assert torch.equal(grad, torch.zeros_like(grad))
            assert all(torch.isfinite(m) for m in metrics.values())


def test_metrics_are_detached_scalar_tensors():
    values, old_values, returns, mask = make_batch(17)
    loss, metrics = value_loss(values.requires_grad_(True), old_values=old_values, returns=returns, response_mask=mask)
    assert loss.shape == () and loss.requires_grad
    for value in metrics.values():
        assert isinstance(value, torch.Tensor) and value.shape == () and not value.requires_grad


def test_errors():
    values, old_values, returns, mask = make_batch(0)
    with pytest.raises(ValueError, match="returns"):
        value_loss(values, old_values=old_values, returns=returns[:, :-1], response_mask=mask)
    with pytest.raises(ValueError, match="values"):
        value_loss(values[0], old_values=old_values[0], returns=returns[0], response_mask=mask[0])
    with pytest.raises(TypeError, match="bool"):
        value_loss(values, old_values=old_values, returns=returns, response_mask=mask.float())
    with pytest.raises(ValueError, match="clip_range"):
        value_loss(values, old_values=old_values, returns=returns, response_mask=mask, clip_range=-0.1)
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        value_loss(values, old_values=old_values, returns=returns, response_mask=mask, agg="sum")


# ----------------------------------------------------------------------------------------------------
# verl parity (tests/golden/make_losses_golden.py)


def _golden():
    tensors = load_file(str(GOLDEN))
    with safe_open(str(GOLDEN), "pt") as f:
        cases = json.loads(f.metadata()["cases"])
    return tensors, [(i, c) for i, c in enumerate(cases) if c["kind"] == "value"]


_TENSORS, VALUE_CASES = _golden()


@pytest.mark.parametrize(
    "index,case",
    VALUE_CASES,
    ids=[f"{i}-{c['agg']}-clip{c['clip_range']}-{'global' if c['global_info'] else 'local'}" for i, c in VALUE_CASES],
)
def test_matches_verl(index, case):
    prefix = f"inputs/{case['inputs']}/"
    inp = {k[len(prefix) :]: v for k, v in _TENSORS.items() if k.startswith(prefix)}
    mask = inp["response_mask"]
    info = case["global_info"]
    norms = None
    if info:
        norms = Normalizers(
            num_tokens=torch.tensor(float(info["batch_num_tokens"])),
            num_seqs=torch.tensor(float(info["global_batch_size"])),
        )
    loss, grad, metrics = loss_and_grad(
        inp["values"],
        inp["old_values"],
        inp["returns"],
        mask,
        clip_range=case["clip_range"],
        agg=case["agg"],
        norms=norms,
        horizon=info.get("loss_scale_factor"),
    )
    close(loss, _TENSORS[f"case{index}/loss"])
    close(grad, _TENSORS[f"case{index}/grad"])
    close(metrics["vf_clipfrac"], _TENSORS[f"case{index}/metric/vf_clipfrac"])


def test_golden_covers_every_mode():
    assert {c["agg"] for _, c in VALUE_CASES} == set(AGG_MODES)
    assert any(c["clip_range"] is None for _, c in VALUE_CASES)

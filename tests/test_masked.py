import chex
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import rlfunc as rf


def test_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 6.0]])
    m = torch.tensor([[True, True, True], [True, False, True]])
    assert rf.masked_sum(x, m) == 16.0
    assert rf.masked_mean(x, m) == 16.0 / 5
    torch.testing.assert_close(rf.masked_mean(x, m, dim=-1), torch.tensor([2.0, 5.0]))
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0, 6.0])
    torch.testing.assert_close(rf.masked_var(x, m), vals.var())
    torch.testing.assert_close(rf.masked_var(x, m, unbiased=False), vals.var(unbiased=False))
    torch.testing.assert_close(rf.masked_var(x, m, dim=-1), torch.tensor([1.0, 2.0]))


def test_nan_outside_mask_never_leaks_into_values_or_grads():
    x = torch.tensor([[1.0, float("nan"), 3.0, float("inf")]], requires_grad=True)
    m = torch.tensor([[True, False, True, False]])
    for fn in (rf.masked_sum, rf.masked_mean, rf.masked_var):
        out = fn(x, m)
        assert torch.isfinite(out)
        (g,) = torch.autograd.grad(out, x)
        assert torch.isfinite(g).all() and (g[~m] == 0).all()
    w = rf.masked_whiten(x, m)
    assert torch.isfinite(w).all()


def test_empty_mask_is_defined():
    x = torch.randn(2, 3)
    m = torch.zeros(2, 3, dtype=torch.bool)
    assert rf.masked_sum(x, m) == 0 and rf.masked_mean(x, m) == 0 and rf.masked_var(x, m) == 0
    assert (rf.masked_whiten(x, m) == 0).all()
    single = torch.tensor([[True, False, False], [False, False, False]])
    assert rf.masked_var(x, single) == 0


def test_float_mask_is_rejected_with_a_clear_error():
    with pytest.raises(TypeError, match=r"mask must be a torch.bool mask, got torch.float32"):
        rf.masked_mean(torch.ones(2, 2), torch.ones(2, 2))
    with pytest.raises(ValueError, match="mask has shape"):
        rf.masked_mean(torch.ones(2, 2), torch.ones(2, 3, dtype=torch.bool))


arrays = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=8),
    elements=st.floats(-100, 100, width=32),
)


@settings(max_examples=50, deadline=None)
@given(arrays, st.data())
def test_whiten_has_zero_mean_unit_var_and_padding_changes_nothing(x, data):
    x = torch.from_numpy(x)
    m = torch.from_numpy(data.draw(hnp.arrays(np.bool_, x.shape)))
    w = rf.masked_whiten(x, m)
    if m.sum() >= 2 and rf.masked_var(x, m) > 1e-2:
        assert abs(float(rf.masked_mean(w, m))) < 1e-4
        assert abs(float(rf.masked_var(w, m)) - 1) < 1e-3
    # appending masked padding (even NaN) leaves the results unchanged
    xp = torch.cat([x, torch.full((x.shape[0], 3), float("nan"))], dim=1)
    mp = torch.cat([m, torch.zeros(x.shape[0], 3, dtype=torch.bool)], dim=1)
    # fp32 sums in a different order: errors scale with the magnitude of the entries, not of the result
    # (a mean near 0 of entries near 100 has no small *relative* error)
    scale = max(1.0, float(x.abs().max()))
    chex.assert_trees_all_close(rf.masked_mean(xp, mp), rf.masked_mean(x, m), rtol=1e-6, atol=1e-6 * scale)
    chex.assert_trees_all_close(rf.masked_var(xp, mp), rf.masked_var(x, m), rtol=1e-5, atol=1e-6 * scale**2)
    if rf.masked_var(x, m) > 1e-4 * scale**2:  # below that, whitening amplifies float rounding of the mean
        chex.assert_trees_all_close(rf.masked_whiten(xp, mp)[:, : x.shape[1]], w, rtol=1e-4, atol=1e-4)


def test_func_transforms():
    x = torch.randn(3, 4)
    m = torch.rand(3, 4) > 0.4
    g = torch.func.grad(lambda x: rf.masked_var(x, m))(x)
    xx = x.clone().requires_grad_()
    (g2,) = torch.autograd.grad(rf.masked_var(xx, m), xx)
    torch.testing.assert_close(g, g2)
    v = torch.func.vmap(rf.masked_mean)(x, m)
    torch.testing.assert_close(v, torch.stack([rf.masked_mean(a, b) for a, b in zip(x, m)]))


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.integers(1, 5), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_whiten_from_combined_shard_moments_equals_whole_batch(rows, cols, shards, seed):
    """Two-pass moments summed over row shards reproduce whitening of the concatenated batch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows * shards, cols, generator=g, dtype=torch.float64) * 3 + 1
    m = torch.rand(rows * shards, cols, generator=g) < 0.7
    m[0, 0] = m[1, 0] = True  # at least two entries: a defined variance
    parts = list(zip(x.split(rows), m.split(rows)))
    first = sum(rf.masked_moments(xs, ms) for xs, ms in parts)
    mean = first[1] / first[0]
    var = sum(rf.masked_moments(xs, ms, center=mean) for xs, ms in parts)[2] / (first[0] - 1)
    whole = rf.masked_whiten(x, m)
    sharded = torch.cat([rf.masked_whiten(xs, ms, stats=(mean, var)) for xs, ms in parts])
    torch.testing.assert_close(sharded, whole, rtol=1e-10, atol=1e-10)


def test_whiten_stats_must_be_scalars():
    x, m = torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="stats must be two 0-d tensors"):
        rf.masked_whiten(x, m, stats=(torch.zeros(2), torch.ones(())))


def test_bool_dim_is_rejected_with_a_pointer_to_unbiased():
    """verl's ``masked_var(x, mask, True)`` means ``unbiased=True``: positionally it is refused (``dim`` is
    keyword-only), and ``dim=True`` points at ``unbiased``."""
    x, mask = torch.randn(3, 4), torch.rand(3, 4) > 0.3
    for op in (rf.masked_var, rf.masked_mean, rf.masked_sum):
        with pytest.raises(TypeError, match="positional argument"):
            op(x, mask, True)
        for dim in (True, False, (0, True)):
            with pytest.raises(TypeError, match=r"dim must be an int.*pass unbiased= by keyword"):
                op(x, mask, dim=dim)
    torch.testing.assert_close(rf.masked_var(x, mask, unbiased=True), rf.masked_var(x, mask))
    assert rf.masked_var(x, mask, dim=1).shape == (3,)
    assert rf.masked_mean(x, mask, dim=(0, 1)).shape == ()

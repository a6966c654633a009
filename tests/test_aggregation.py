import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlfunc as rf


def test_hand_computed_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[True, True, False], [True, False, False]])
    assert rf.aggregate(loss, m, mode="token-mean") == 7.0 / 3
    assert rf.aggregate(loss, m, mode="token-sum") == 7.0
    assert rf.aggregate(loss, m, mode="seq-mean-token-sum") == 3.5
    assert rf.aggregate(loss, m, mode="seq-mean-token-mean") == (1.5 + 4.0) / 2
    assert rf.aggregate(loss, m, mode="seq-mean-token-sum-norm") == 7.0 / 2 / 3
    assert rf.aggregate(loss, m, mode="seq-mean-token-sum-norm", horizon=10) == 7.0 / 2 / 10


def test_unknown_mode_and_empty_mask():
    loss = torch.ones(2, 3)
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'; known modes: token-mean"):
        rf.aggregate(loss, torch.ones(2, 3, dtype=torch.bool), mode="mean")
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for mode in rf.AGG_MODES:
        assert rf.aggregate(loss, empty, mode=mode) == 0


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 9), st.integers(1, 7), st.integers(1, 4), st.sampled_from(rf.AGG_MODES), st.integers(0, 10**6))
def test_micro_batches_with_global_normalizers_equal_the_full_batch(b, t, chunks, mode, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, generator=g, requires_grad=True)
    m = torch.rand(b, t, generator=g) > 0.4
    full = rf.aggregate(x * x, m, mode=mode, horizon=t)
    (g_full,) = torch.autograd.grad(full, x)
    parts = torch.arange(b).tensor_split(min(chunks, b))
    norms = sum((rf.local_normalizers(m[i]) for i in parts[1:]), rf.local_normalizers(m[parts[0]]))
    total = sum(rf.aggregate(x[i] * x[i], m[i], mode=mode, norms=norms, horizon=t) for i in parts)
    (g_parts,) = torch.autograd.grad(total, x)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(g_parts, g_full)

"""DAPO's pieces: dynamic sampling's group filter, overlong reward shaping, overlong filtering."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

import rlfunc as rf

pytestmark = pytest.mark.data


def test_overlong_penalty_hand_computed():
    # L_max = 10, buffer 4: no penalty up to 6 tokens, then -1/4 per token, -1 at 10 (times the factor)
    lengths = torch.tensor([0, 6, 7, 8, 10, 12])
    out = rf.overlong_penalty(lengths, max_response_length=10, buffer_length=4, penalty_factor=1.0)
    assert out.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    half = rf.overlong_penalty(lengths, max_response_length=10, buffer_length=4, penalty_factor=0.5)
    torch.testing.assert_close(half, out * 0.5)


@given(st.integers(1, 64), st.data(), st.floats(0.0, 2.0))
def test_overlong_penalty_equals_verls_formula_within_the_budget(max_len, data, factor):
    buffer = data.draw(st.integers(1, max_len))
    lengths = data.draw(st.lists(st.integers(0, max_len), min_size=1, max_size=16))
    out = rf.overlong_penalty(
        torch.tensor(lengths), max_response_length=max_len, buffer_length=buffer, penalty_factor=factor
    )
    expected_len = max_len - buffer  # verl's DAPORewardManager
    verl = [min(-(n - expected_len) / buffer * factor, 0.0) for n in lengths]
    torch.testing.assert_close(out, torch.tensor(verl, dtype=torch.float32), atol=1e-6, rtol=0)


def test_overlong_penalty_rejects_a_bad_buffer():
    with pytest.raises(ValueError, match="buffer_length must be in"):
        rf.overlong_penalty(torch.tensor([1]), max_response_length=4, buffer_length=5)
    with pytest.raises(ValueError, match="penalty_factor must be >= 0"):
        rf.overlong_penalty(torch.tensor([1]), max_response_length=4, buffer_length=2, penalty_factor=-1)


def test_informative_groups_hand_computed():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.0, 0.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 3, 3, 4])
    # group 0 mixed, group 1 all 1, group 2 a single sample (kept, as verl), group 3 all 0, group 4 single
    assert rf.informative_groups(scores, group_ids=groups).tolist() == [
        True,
        True,
        False,
        False,
        True,
        False,
        False,
        True,
    ]


@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from([0.0, 0.5, 1.0])), min_size=1, max_size=40), st.randoms())
def test_informative_groups_keeps_exactly_the_groups_that_disagree(rows, rnd):
    groups = torch.tensor([g for g, _ in rows])
    scores = torch.tensor([s for _, s in rows])
    keep = rf.informative_groups(scores, group_ids=groups)
    for g in set(groups.tolist()):
        members = scores[groups == g].tolist()
        want = len(members) == 1 or len(set(members)) > 1
        assert keep[groups == g].tolist() == [want] * len(members)
    perm = list(range(len(rows)))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    assert torch.equal(rf.informative_groups(scores[perm], group_ids=groups[perm]), keep[perm])


def test_truncated_responses():
    ids = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [5, 6, 7, 2], [0, 0, 0, 0], [5, 9, 0, 0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    out = rf.truncated_responses(ids, response_mask=mask, eos_token_ids=(2, 9))
    assert out.tolist() == [False, True, False, True, False]
    with pytest.raises(ValueError, match="eos_token_ids is empty"):
        rf.truncated_responses(ids, response_mask=mask, eos_token_ids=())


def test_overlong_penalty_is_vmappable():
    lengths = torch.tensor([[3, 9], [10, 1]])
    fn = lambda x: rf.overlong_penalty(x, max_response_length=10, buffer_length=4)
    torch.testing.assert_close(torch.func.vmap(fn)(lengths), fn(lengths))

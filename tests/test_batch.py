import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

import rlfunc as rf


def make_batch(b=4, p=3, t=5, **extra):
    g = torch.Generator().manual_seed(0)
    return rf.RolloutBatch(
        prompt_ids=torch.randint(0, 9, (b, p), generator=g),
        prompt_mask=torch.ones(b, p, dtype=torch.bool),
        response_ids=torch.randint(0, 9, (b, t), generator=g),
        response_mask=torch.rand(b, t, generator=g) > 0.3,
        group_ids=torch.arange(b) // 2,
        **extra,
    )


def test_pytree_round_trip_and_none_fields_are_empty_subtrees():
    batch = make_batch(scores=torch.ones(4))
    leaves, spec = tree_flatten(batch)
    assert len(leaves) == 6  # five required fields + scores; None fields carry no leaf
    back = tree_unflatten(leaves, spec)
    assert type(back) is rf.RolloutBatch
    for a, b in zip(rf.tree_leaves(batch), rf.tree_leaves(back)):
        assert a is b
    assert back.values is None


def test_tree_map_and_replace_are_pure():
    batch = make_batch()
    doubled = rf.tree_map(lambda x: x * 2, batch)
    assert torch.equal(doubled.prompt_ids, batch.prompt_ids * 2)
    new = batch.replace(scores=torch.zeros(4))
    assert batch.scores is None and new.scores is not None
    with pytest.raises(AttributeError):
        batch.scores = torch.zeros(4)


def test_validate_names_field_and_shapes():
    batch = make_batch()
    assert rf.validate(batch) is batch
    with pytest.raises(ValueError, match=r"RolloutBatch.scores must have shape \(4,\) \[b\], got \(3,\)"):
        rf.validate(batch.replace(scores=torch.ones(3)))
    with pytest.raises(ValueError, match=r"RolloutBatch.advantages must have shape \(4, 5\)"):
        rf.validate(batch.replace(advantages=torch.ones(4, 6)))
    with pytest.raises(TypeError, match="response_mask must have a bool dtype"):
        rf.validate(batch.replace(response_mask=batch.response_mask.float()))
    with pytest.raises(TypeError, match="group_ids must have a int dtype"):
        rf.validate(batch.replace(group_ids=batch.group_ids.float()))


def test_select_split_concat():
    batch = make_batch(b=7, scores=torch.arange(7.0))
    assert torch.equal(rf.select(batch, [6, 0]).scores, torch.tensor([6.0, 0.0]))
    parts = rf.split(batch, 3)
    assert [rf.batch_size(x) for x in parts] == [3, 2, 2]
    assert [rf.batch_size(x) for x in rf.split(batch, chunk_size=3)] == [3, 3, 1]
    joined = rf.concat(parts)
    for a, b in zip(rf.tree_leaves(batch), rf.tree_leaves(joined)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="num_chunks"):
        rf.split(batch, 8)
    with pytest.raises(ValueError, match="different fields"):
        rf.concat([parts[0], parts[1].replace(values=torch.zeros(2, 5))])


def test_split_by_token_budget_keeps_order_and_budget():
    tokens = torch.tensor([3, 4, 2, 6, 1, 1])
    assert rf.token_budget_partitions(tokens, 7) == [[0, 1], [2], [3, 4], [5]]
    batch = make_batch(b=6, scores=torch.arange(6.0))
    parts = rf.split_by_token_budget(batch, tokens, 7)
    assert torch.equal(rf.concat(parts).scores, batch.scores)
    with pytest.raises(ValueError, match="row 3 has 6 tokens"):
        rf.token_budget_partitions(tokens, 5)


def test_batch_size_disagreement_is_an_error():
    with pytest.raises(ValueError, match="disagree"):
        rf.batch_size({"a": torch.zeros(2), "b": torch.zeros(3)})


def test_vmap_over_a_batch_pytree():
    batch = make_batch()
    per_row = torch.func.vmap(lambda b: rf.masked_sum(b.response_ids.float(), b.response_mask))(batch)
    expected = torch.stack([rf.masked_sum(r.float(), m) for r, m in zip(batch.response_ids, batch.response_mask)])
    torch.testing.assert_close(per_row, expected)

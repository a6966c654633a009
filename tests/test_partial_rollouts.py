"""Partial rollouts in the native engine (backends.rollout.scheduler's chunk boundaries): a generation takes new
weights at a boundary and its unfinished rows continue under them, every token stamped with the version that
sampled it, its log-prob under those weights; and the off-policy corrections of rlfunc.importance see the versions.

Two tiny random-init Qwen2 models of one shape (the old and the new weights), written once for the module; each
test builds its own engine (its weights are overwritten), about 0.1 s. The whole file runs in a few seconds on one
core.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

import rlfunc as rf
from backends.loop.algorithm import stamp_policy_version
from backends.models import TinyModelConfig, load_causal_lm, write_tiny_model
from backends.rollout.native import BatchingLimits, SamplingConfig, build_native_rollout, generate
from backends.rollout.scheduler import ContinuousBatcher
from tests.test_native_engine import TEXTS, TINY  # sharp, position-dependent distributions
from tests.test_rollout_native import trainer_logprobs  # an fp32 HF forward over prompt + response

pytestmark = pytest.mark.native_engine

CHUNK = 3  #: decode iterations between boundaries


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(path of the old weights, HF old model, HF new model, the new weights by HF name, tokenizer, EOS ids)."""
    root = tmp_path_factory.mktemp("partial")
    old = write_tiny_model(root / "old", TinyModelConfig(arch="qwen2", seed=0, **TINY))
    new = write_tiny_model(root / "new", TinyModelConfig(arch="qwen2", seed=1, **TINY))
    old_model, tok = load_causal_lm(old)
    new_model, _ = load_causal_lm(new)
    # rows end at many lengths: some before the first boundary, some after it, some at max_new_tokens
    eos = [tok.eos_token_id] + [tok.convert_tokens_to_ids(c) for c in "0123456789"]
    weights = {k: v.clone() for k, v in new_model.state_dict().items()}
    return old, old_model, new_model, weights, tok, eos


@attrs.define
class NewWeightsAt:
    """The caller's side of partial rollouts in these tests: at boundary ``at`` (1 = the first) copy ``weights``
    into the engine and count one version up; at every other boundary keep the weights."""

    rollout: Any
    weights: dict
    chunk_tokens: int = CHUNK
    at: int = 1
    current: int = 0
    boundaries: int = 0

    def version(self) -> int:
        return self.current

    def at_boundary(self):
        self.boundaries += 1
        if self.boundaries != self.at:
            return None
        self.current += 1
        self.rollout = self.rollout.sync_weights(self.weights.items())
        return self.rollout


def _engine(models, **kwargs):
    path, _, _, _, tok, eos = models
    return build_native_rollout(path, tok, eos_token_ids=eos, **kwargs)


def _prompts(tok):
    return [tok.encode(text) for text in TEXTS]


SAMPLING = SamplingConfig(n=2, max_new_tokens=10, seed=3)


def _partial_batch(models, limits=BatchingLimits(), at=1):
    rollout = _engine(models, batching_limits=limits)
    updates = NewWeightsAt(rollout, models[3], at=at)
    batch = generate(rollout.with_weight_updates(updates), _prompts(models[4]), SAMPLING)
    return batch, updates


def test_a_row_crossing_the_boundary_has_the_old_version_before_it_and_the_new_after(models):
    """Every row starts together (one slot each): tokens 0..CHUNK-1 come from the old weights (version 0), the rest
    from the new (version 1); a row that ended before the boundary keeps version 0 alone."""
    batch, updates = _partial_batch(models)
    assert updates.boundaries >= 1 and updates.current == 1
    mask, version = batch.response_mask, batch.policy_version
    assert version is not None and version.shape == batch.response_ids.shape and version.dtype == torch.long
    position = torch.arange(version.shape[1]).expand_as(version)
    expected = (position >= CHUNK).long()
    assert torch.equal(version[mask], expected[mask])
    lengths = mask.sum(-1)
    short, crossing = lengths <= CHUNK, lengths > CHUNK
    assert short.any() and crossing.any()  # both kinds of rows are in the batch
    assert (version[short][mask[short]] == 0).all()
    for row in crossing.nonzero().squeeze(-1).tolist():
        row_versions = version[row][mask[row]].tolist()
        assert row_versions == [0] * CHUNK + [1] * (len(row_versions) - CHUNK), row


def test_rows_admitted_after_the_boundary_are_all_new(models):
    """Fewer slots than rows: rows start at different iterations; each row's versions never go down, rows admitted
    after the boundary hold the new version only, and some rows hold both."""
    batch, _ = _partial_batch(models, BatchingLimits(max_slots=4, block_size=4))
    mask, version = batch.response_mask, batch.policy_version
    for row in range(version.shape[0]):
        v = version[row][mask[row]]
        assert (v[1:] >= v[:-1]).all(), row
    first = version[:, 0]
    mixed = (version.masked_fill(~mask, 1) == 0).any(-1) & (version.masked_fill(~mask, 0) == 1).any(-1)
    assert (first == 1).any() and (first == 0).any() and mixed.any()


@pytest.mark.parametrize(
    "limits",
    [
        BatchingLimits(),
        BatchingLimits(max_slots=4, block_size=4),
        BatchingLimits(max_slots=6, prefill_tokens=8),
        BatchingLimits(max_slots=4, block_size=4, prefill_tokens=3),
    ],
    ids=["all-slots", "few-slots", "small-refill-groups", "prefill-chunks-of-3"],
)
def test_logprobs_before_the_boundary_are_the_old_weights_and_after_it_the_new(models, limits):
    """Each token's behaviour log-prob equals an fp32 HF forward of the weights that sampled it over the prefix.
    After the boundary the new weights' forward is only matched when the caches were computed again: keys and values
    of the old weights (a stale cache) give log-probs off by far more than the tolerance (the last assert shows how
    far the two weights' log-probs lie apart)."""
    _, old_model, new_model, _, _, _ = models
    batch, _ = _partial_batch(models, limits)
    mask, version = batch.response_mask, batch.policy_version
    old_lp, new_lp = trainer_logprobs(old_model, batch), trainer_logprobs(new_model, batch)
    before, after = mask & (version == 0), mask & (version == 1)
    assert before.any() and after.any()
    assert (batch.rollout_logprobs - old_lp)[before].abs().max() < 1e-5
    assert (batch.rollout_logprobs - new_lp)[after].abs().max() < 1e-5
    assert (old_lp - new_lp)[after].abs().max() > 0.1


def test_boundaries_that_keep_the_weights_change_nothing(models):
    """A boundary that loads nothing leaves the call as it is (bit for bit); a boundary that loads the same weights
    again recomputes the caches and samples the same tokens: the uniforms are keyed by (seed, row, token index),
    not by where the boundaries fell."""
    prompts = _prompts(models[4])
    plain = generate(_engine(models), prompts, SAMPLING)
    rollout = _engine(models)
    nothing = generate(rollout.with_weight_updates(NewWeightsAt(rollout, {}, at=0)), prompts, SAMPLING)
    assert torch.equal(plain.response_ids, nothing.response_ids)
    assert torch.equal(plain.rollout_logprobs, nothing.rollout_logprobs)
    assert (nothing.policy_version == 0).all()
    rollout = _engine(models)
    same = {k: v.clone() for k, v in rollout.model.state_dict().items()}
    for chunk in (1, 2, 5):
        updates = NewWeightsAt(rollout, same, chunk_tokens=chunk)
        reloaded = generate(rollout.with_weight_updates(updates), prompts, SAMPLING)
        assert updates.current == 1
        assert torch.equal(plain.response_ids, reloaded.response_ids), chunk
        torch.testing.assert_close(plain.rollout_logprobs, reloaded.rollout_logprobs, rtol=0, atol=1e-5)


def test_the_corrections_see_the_versions(models):
    """The batch as the trainer stamps it keeps the engine's per-token versions (not the batch's start version),
    the staleness histogram counts its tokens by age, and the truncated importance weights against the new weights'
    log-probs are 1 on the tokens the new weights sampled and not on the old weights' tokens."""
    _, _, new_model, _, _, _ = models
    batch, _ = _partial_batch(models)
    stamped, metrics = stamp_policy_version(batch, 0, current=1)
    assert torch.equal(stamped.policy_version, batch.policy_version)
    mask, version = batch.response_mask, batch.policy_version
    new_share = (version[mask] == 1).float().mean()
    torch.testing.assert_close(metrics["staleness/frac_0"], new_share)
    torch.testing.assert_close(metrics["staleness/frac_1"], 1 - new_share)
    assert metrics["staleness/min"] == 0.0 and metrics["staleness/max"] == 1.0
    weights, _ = rf.rollout_is_weights(
        trainer_logprobs(new_model, batch), rollout_logprobs=batch.rollout_logprobs, response_mask=mask, upper=1e6
    )
    after, before = mask & (version == 1), mask & (version == 0)
    torch.testing.assert_close(weights[after], torch.ones_like(weights[after]), rtol=0, atol=1e-4)
    assert ((weights[before] - 1).abs() > 1e-2).float().mean() > 0.5
    # without engine versions the trainer stamps the whole batch with its version, as before
    plain, _ = stamp_policy_version(batch.replace(policy_version=None), 0, current=1)
    assert (plain.policy_version == 0).all()


@pytest.mark.parametrize(
    "limits", [BatchingLimits(), BatchingLimits(max_slots=4, block_size=4)], ids=["all-slots", "few-slots"]
)
def test_overlapped_steps_take_the_boundarys_weights_as_waiting_steps_do(models, limits, monkeypatch):
    """The batcher as it runs on CUDA (the next decode step queued before the sampled tokens are read), on the CPU:
    a boundary sees the rows the waiting batcher sees, so the tokens, versions and log-probs are the same."""
    waiting, _ = _partial_batch(models, limits)
    init = ContinuousBatcher.__init__

    def overlapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.overlap = True

    monkeypatch.setattr(ContinuousBatcher, "__init__", overlapped)
    batch, updates = _partial_batch(models, limits)
    assert updates.current == 1
    assert torch.equal(batch.response_ids, waiting.response_ids)
    assert torch.equal(batch.policy_version, waiting.policy_version)
    torch.testing.assert_close(batch.rollout_logprobs, waiting.rollout_logprobs, rtol=0, atol=1e-5)


def test_the_lockstep_loop_refuses_partial_rollouts(models):
    rollout = _engine(models, batching="lockstep")
    with pytest.raises(ValueError, match="partial rollouts need rollout.native.batching=continuous"):
        rollout.with_weight_updates(NewWeightsAt(rollout, {}))

"""The continuous-batching decode step at fixed shapes (backends.rollout.decode_graphs): padded to a bucket of rows
and spanning the whole block table, it must sample what the step at the working rows' own shapes samples, write
nothing outside the null block for its padding rows, and, on a GPU, replay from CUDA graphs.

One tiny random-init Qwen2 (hidden 64, 2 layers) for the module; the CPU tests take about a second.
"""

from __future__ import annotations

import warnings

import attrs
import pytest
import torch

from backends.models import TinyModelConfig, load_causal_lm, write_tiny_model
from backends.rollout.decode_graphs import PaddedDecodeStep, key_bucket, row_bucket
from backends.rollout.native import BatchingLimits, SamplingConfig, build_native_rollout, generate
from backends.rollout.scheduler import ContinuousBatcher
from tests.test_native_engine import TEXTS, TINY
from tests.test_partial_rollouts import NewWeightsAt
from tests.test_rollout_native import trainer_logprobs

pytestmark = pytest.mark.native_engine

TINY_MODEL = TinyModelConfig(arch="qwen2", **TINY)  # sharp, position-dependent distributions


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model dir, HF model, tokenizer, EOS ids: every digit and a-j, so rows end at many lengths)."""
    path = write_tiny_model(tmp_path_factory.mktemp("qwen2"), TINY_MODEL)
    model, tok = load_causal_lm(path)
    eos = [tok.eos_token_id] + [tok.convert_tokens_to_ids(c) for c in "0123456789abcdefghij"]
    return path, model, tok, eos


@pytest.fixture(scope="module")
def partial_models(setup, tmp_path_factory):
    """(setup's model dir as the old weights, its HF model, another HF model of that shape, its weights by HF name,
    tokenizer, EOS ids)."""
    path, old_model, tok, eos = setup
    new_model, _ = load_causal_lm(write_tiny_model(tmp_path_factory.mktemp("new"), attrs.evolve(TINY_MODEL, seed=1)))
    weights = {k: v.clone() for k, v in new_model.state_dict().items()}
    return path, old_model, new_model, weights, tok, eos


def _prompts(tok, count: int) -> list[list[int]]:
    return [tok.encode(f"{i * 37 % 100}+{i}=" if i % 3 else f"{i}" * (1 + i % 9)) for i in range(count)]


def test_row_buckets_are_powers_of_two_up_to_the_slots():
    assert [row_bucket(b, 64) for b in (1, 2, 3, 4, 5, 9, 33, 64)] == [1, 2, 4, 4, 8, 16, 64, 64]
    assert row_bucket(7, 6) == 6 and row_bucket(0, 8) == 1


def test_key_buckets_are_powers_of_two_blocks_up_to_the_table():
    wanted = {1: 8, 8: 8, 9: 16, 17: 32, 33: 64, 100: 128, 256: 256, 257: 512, 513: 520, 520: 520}
    assert {n: key_bucket(n, 8, 520) for n in wanted} == wanted
    assert key_bucket(5, 4, 6) == 6


def test_the_padded_step_samples_what_the_eager_step_samples(setup):
    """Rows end at many lengths, so the working rows take many counts that are not powers of two: the padding
    rows write into the spare slot's null block, every row attends over a bucket of keys (several buckets, up to
    the whole block table), and still the tokens are the eager step's and the log-probs equal to float rounding;
    every block comes back."""
    path, _, tok, eos = setup
    rollout = build_native_rollout(path, tok, eos_token_ids=eos)
    prompts = _prompts(tok, 11)
    sampling = SamplingConfig(n=3, max_new_tokens=20, seed=3)
    limits = BatchingLimits(max_slots=13, block_size=4)
    with torch.inference_mode():
        eager = ContinuousBatcher(rollout, prompts, sampling, 3, limits)
        want_tokens, want_logprobs = eager.run()
        padded = ContinuousBatcher(rollout, prompts, sampling, 3, limits)
        padded.graphed_step = step = PaddedDecodeStep(padded.decoder, padded.cache, padded.max_len)
        keys, step_paged = [], padded.decoder.step_paged
        padded.decoder.step_paged = lambda *args: keys.append(args[-1]) or step_paged(*args)
        tokens, logprobs = padded.run()
    assert len(set(keys)) >= 3 and set(keys) <= {4, 8, 16, padded.max_len}, (set(keys), padded.max_len)
    assert step.cache.spare_slot == 13 and not padded.cache.block_table[13].any()
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=1e-5)
    pool = padded.cache.pool
    assert len(pool.free) == pool.usable and pool.reserved == 0 and not any(pool.refcount)


@pytest.mark.parametrize(
    "step", ["eager", "padded", pytest.param("graphed", marks=pytest.mark.gpu)], ids=lambda s: f"{s}-step"
)
def test_overlapped_steps_sample_what_waiting_steps_sample(setup, step):
    """What the batcher does on CUDA (run on the CPU too): the next decode step is queued before the sampled tokens
    are read, so a row that sampled its EOS steps once more. Each run feeds every row one step per token it sampled
    after its first, plus, when overlapped, one for each row that ended on its EOS before its token limit; every
    block comes back; and the tokens are those of the batcher that waits for them (on the CPU all of them, the
    log-probs equal to float rounding; on a GPU a batch of another size may round a product differently, so 95%)."""
    path, _, tok, eos = setup
    rollout = build_native_rollout(path, tok, eos_token_ids=eos, device="cuda" if step == "graphed" else "cpu")
    prompts = _prompts(tok, 11)
    sampling = SamplingConfig(n=3, max_new_tokens=20, seed=3)
    limits = BatchingLimits(max_slots=13, block_size=4)
    ends = torch.tensor(eos)
    runs = {}
    for overlap in (False, True):
        with torch.inference_mode():
            batcher = ContinuousBatcher(rollout, prompts, sampling, 3, limits)
            batcher.overlap = overlap
            if step == "padded":
                batcher.graphed_step = PaddedDecodeStep(batcher.decoder, batcher.cache, batcher.max_len)
            assert (batcher.graphed_step is not None) == (step != "eager")
            fed, grow = [], batcher.cache.grow
            batcher.cache.grow = lambda slots, positions: fed.append(len(slots)) or grow(slots, positions)
            tokens, logprobs = batcher.run()
        pool = batcher.cache.pool
        assert len(pool.free) == pool.usable and pool.reserved == 0 and not any(pool.refcount), overlap
        assert sorted(batcher.free_slots) == list(range(13)), overlap
        tokens, logprobs = tokens.cpu(), logprobs.cpu()
        is_end = torch.isin(tokens, ends)
        lengths = torch.where(is_end.any(-1), is_end.float().argmax(-1) + 1, sampling.max_new_tokens)
        early = int((lengths < sampling.max_new_tokens).sum())
        assert early > 0 and sum(fed) == int((lengths - 1).sum()) + (early if overlap else 0), overlap
        runs[overlap] = tokens, logprobs
    (tokens, logprobs), (want_tokens, want_logprobs) = runs[True], runs[False]
    if step == "graphed":
        width = min(tokens.shape[1], want_tokens.shape[1])
        assert float((tokens[:, :width] == want_tokens[:, :width]).float().mean()) > 0.95
    else:
        assert torch.equal(tokens, want_tokens)
        torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=1e-5)


def test_the_fused_attention_samples_what_the_matmuls_sample(setup):
    """The decode attention a GPU runs (one scaled_dot_product_attention, a KV head's query heads as its queries),
    run on the CPU in the padded step: the tokens of the two batched matmuls, the log-probs equal to float rounding."""
    path, _, tok, eos = setup
    rollout = build_native_rollout(path, tok, eos_token_ids=eos)
    prompts = _prompts(tok, 11)
    sampling = SamplingConfig(n=3, max_new_tokens=20, seed=3)
    runs = {}
    for fused in (False, True):
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("error")  # no fall back to the matmuls
            batcher = ContinuousBatcher(rollout, prompts, sampling, 3, BatchingLimits(max_slots=13, block_size=4))
            assert batcher.cache.fused_attention is False  # the CPU default
            batcher.cache.fused_attention = fused
            batcher.graphed_step = PaddedDecodeStep(batcher.decoder, batcher.cache, batcher.max_len)
            runs[fused] = batcher.run()
        assert batcher.cache.fused_attention is fused
    assert torch.equal(runs[True][0], runs[False][0])
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_the_decode_step_replays_from_cuda_graphs_with_the_trainers_logprobs(setup):
    """On CUDA the continuous engine captures one graph per bucket of rows and replays it: the log-probs of what it
    samples are the HF model's fp32 forward's, and the samples are the eager step's but where a longer reduction's
    rounding moves a uniform across a CDF step."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path, model, tok, eos = setup
    rollout = build_native_rollout(path, tok, eos_token_ids=eos, device="cuda")
    prompts = _prompts(tok, 24)
    sampling = SamplingConfig(n=4, max_new_tokens=24, seed=5)
    with torch.inference_mode():
        batcher = ContinuousBatcher(rollout, prompts, sampling, 5, rollout.batching_limits)
        batcher.run()
    graphed = batcher.graphed_step
    assert graphed is not None and graphed.failed is None, graphed and graphed.failed
    assert len(graphed.graphs) >= 2  # rows ended, so smaller buckets were captured and replayed

    batch = generate(rollout, prompts, sampling)
    eager = generate(attrs.evolve(rollout, batching_limits=BatchingLimits(cuda_graphs=False)), prompts, sampling)
    same = (batch.response_ids == eager.response_ids) | ~(batch.response_mask | eager.response_mask)
    assert float(same.float().mean()) > 0.95
    gap = (batch.rollout_logprobs - trainer_logprobs(model, batch)).abs().masked_fill(~batch.response_mask, 0.0).max()
    assert float(gap) < 1e-4


@pytest.mark.gpu
def test_decode_iterations_make_no_implicit_device_sync(setup):
    """No host sync per token or per admission: under PyTorch's sync debug mode, a call of 48 new tokens makes no more
    implicit synchronisations than a call of 16, nor does one whose 64 rows stream through 8 slots (a prefill at
    many iterations): an iteration's one read of the sampled tokens waits on an event, its host-to-device copies
    are queued from pinned memory, and a prefill finds its prompts' tokens with ``nonzero_static``. Rows end at many
    lengths, so the working batch shrinks along the way. Eager steps, so no graph capture (which synchronises) blurs
    the count."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path, _, tok, eos = setup
    rollout = build_native_rollout(
        path, tok, eos_token_ids=eos, device="cuda", batching_limits=BatchingLimits(cuda_graphs=False)
    )
    prompts = _prompts(tok, 16)

    def syncs(max_new: int, slots: int | None = None) -> int:
        sampling = SamplingConfig(n=4, max_new_tokens=max_new, seed=2)
        limits = attrs.evolve(rollout.batching_limits, max_slots=slots)
        generate(rollout, prompts, sampling)  # warm: first-call set-up synchronises
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with torch.inference_mode():
                    batcher = ContinuousBatcher(rollout, prompts, sampling, 2, limits)
                    batcher.run()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert batcher.overlap and batcher.iterations >= max_new // 2
        return sum("synchroniz" in str(w.message) for w in caught)

    short, long, streamed = syncs(16), syncs(48), syncs(48, slots=8)
    assert long == short == streamed, (short, long, streamed)


@pytest.mark.gpu
def test_new_weights_at_a_boundary_are_replayed_by_new_graphs(partial_models):
    """Partial rollouts on CUDA: after the boundary's weights the graphs are captured again (a graph replays the
    weights it captured), so the tokens after it carry the new weights' log-probs and those before the old ones'."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path, old_model, new_model, weights, tok, eos = partial_models
    rollout = build_native_rollout(path, tok, eos_token_ids=eos, device="cuda")
    updates = NewWeightsAt(rollout, weights)
    sampling = SamplingConfig(n=2, max_new_tokens=10, seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = generate(rollout.with_weight_updates(updates), [tok.encode(t) for t in TEXTS], sampling)
    assert not [w for w in caught if "CUDA graphs" in str(w.message)]  # the captures after the boundary worked
    mask, version = batch.response_mask, batch.policy_version
    before, after = mask & (version == 0), mask & (version == 1)
    assert updates.current == 1 and before.any() and after.any()
    assert (batch.rollout_logprobs - trainer_logprobs(old_model, batch))[before].abs().max() < 1e-4
    assert (batch.rollout_logprobs - trainer_logprobs(new_model, batch))[after].abs().max() < 1e-4

"""The native engine as a serving engine: continuous batching over a paged KV cache whose blocks a prompt's
samples share (backends.rollout.scheduler, backends.rollout.paged_kv, backends.rollout.row_random).

One tiny random-init Qwen2 (hidden 64, 2 layers), written and loaded once for the module; the whole file runs in
a few seconds on one core (the 1,000-request run is the longest, about 1-2 s).
"""

from __future__ import annotations

import attrs
import pytest
import torch

from backends.models import TinyModelConfig, load_causal_lm, write_tiny_model
from backends.rollout import scheduler
from backends.rollout.native import BatchingLimits, SamplingConfig, build_native_rollout, generate
from backends.rollout.paged_kv import BlockPool, PagedKVCache, blocks_for_request
from backends.rollout.row_random import fmix32, row_uniforms
from backends.rollout.scheduler import ContinuousBatcher
from rlfunc.logits import logprobs_from_logits

pytestmark = pytest.mark.native_engine

TINY = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=128,
    max_position_embeddings=96,
    initializer_range=0.2,  # sharp, position-dependent distributions
)
TEXTS = ["1+2=", "12+34=", "7+80=", "99+99=", "1", "123456789+987654321=", "5+5=", "0+0="]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(HF model, tokenizer, a rollout whose EOS set is every digit and a-j, so rows end at many lengths)."""
    path = write_tiny_model(tmp_path_factory.mktemp("qwen2"), TinyModelConfig(arch="qwen2", **TINY))
    model, tok = load_causal_lm(path)
    eos = [tok.eos_token_id] + [tok.convert_tokens_to_ids(c) for c in "0123456789abcdefghij"]
    return model, tok, build_native_rollout(path, tok, eos_token_ids=eos)


def _prompts(tok, count=len(TEXTS)):
    """TEXTS, then short sums: prompts of many lengths."""
    return [tok.encode(TEXTS[i] if i < len(TEXTS) else f"{i}+{i % 7}=") for i in range(count)]


# --------------------------------------------------------------------------------------------------
# Keyed uniforms


def _reference_uniform(seed: int, row: int, draw: int) -> float:
    """row_random's hash with Python's unbounded ints: the int64 tensors must compute the same words."""
    m = 0xFFFFFFFF

    def mix(x):
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & m
        x ^= x >> 13
        x = (x * 0xC2B2AE35) & m
        return x ^ (x >> 16)

    seed &= (1 << 64) - 1
    key = mix(mix((seed & m) ^ 0x9E3779B9) ^ (seed >> 32))
    h = mix((row & m) ^ key)
    h = mix(((h + 0x9E3779B9) & m) ^ (draw & m))
    return (mix(h ^ key) >> 8) / 2**24


def test_row_uniforms_match_a_python_reference_and_are_uniform():
    keys = [(0, 0, 0), (-1, 5, 3), (2**63 - 1, 2**32 - 1, 7), (12345, 1023, 255), (-(2**40), 77, 0)]
    for seed, row, draw in keys:
        got = row_uniforms(seed, torch.tensor([row]), torch.tensor([draw]))
        assert got.item() == _reference_uniform(seed, row, draw)
    assert fmix32(torch.tensor([2**32 - 1])).item() == fmix32(2**32 - 1)
    rows = torch.arange(1000).repeat_interleave(100)
    u = row_uniforms(7, rows, torch.arange(100).repeat(1000))
    assert u.dtype == torch.float32 and 0.0 <= float(u.min()) and float(u.max()) < 1.0
    counts = torch.histc(u, bins=20, min=0.0, max=1.0)
    expected = u.numel() / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 50.0, chi2  # 19 degrees of freedom: 50 is far in the tail (p < 1e-4)
    # neighbouring keys are uncorrelated
    corr = torch.corrcoef(torch.stack([u.view(1000, 100)[:, :-1].flatten(), u.view(1000, 100)[:, 1:].flatten()]))
    assert abs(float(corr[0, 1])) < 0.01
    assert not torch.equal(row_uniforms(7, rows[:100], 0), row_uniforms(8, rows[:100], 0))


# --------------------------------------------------------------------------------------------------
# Same samples as the lock-step engine


LIMITS = {
    "all-at-once": BatchingLimits(),
    "few-slots-small-blocks": BatchingLimits(max_slots=6, block_size=4),
    "prefill-chunks-of-1": BatchingLimits(max_slots=9, block_size=2, prefill_tokens=1),
    "prefill-chunks-of-5": BatchingLimits(max_slots=6, block_size=4, prefill_tokens=5),
}


@pytest.mark.parametrize("limits", LIMITS.values(), ids=LIMITS.keys())
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(n=3, max_new_tokens=14, seed=4),
        SamplingConfig(n=2, max_new_tokens=10, temperature=0.7, top_k=8, top_p=0.9, seed=5),
    ],
    ids=["t1", "t0.7-k8-p0.9"],
)
def test_continuous_batching_gives_the_lockstep_samples(setup, limits, sampling):
    """Rows stream through fewer slots than rows, prompts of many lengths share partial blocks, and still each
    row samples the tokens the lock-step engine samples: its uniforms are keyed by (seed, row, draw), and its
    logits differ only by float rounding of other batch shapes (which would change a token only if a uniform
    fell within about 1e-6 of a CDF step)."""
    _, tok, rollout = setup
    prompts = _prompts(tok, 12)
    lockstep = generate(attrs.evolve(rollout, batching="lockstep"), prompts, sampling)
    continuous = generate(attrs.evolve(rollout, batching_limits=limits), prompts, sampling)
    assert (~lockstep.response_mask).any() and lockstep.response_mask.all(-1).any()  # short and long rows
    assert torch.equal(lockstep.response_ids, continuous.response_ids)
    assert torch.equal(lockstep.response_mask, continuous.response_mask)
    assert torch.equal(lockstep.prompt_ids, continuous.prompt_ids)
    torch.testing.assert_close(lockstep.rollout_logprobs, continuous.rollout_logprobs, rtol=0, atol=1e-5)


def test_logprobs_match_an_fp32_hf_forward(setup):
    model, tok, rollout = setup
    limits = BatchingLimits(max_slots=5, block_size=4)
    batch = generate(attrs.evolve(rollout, batching_limits=limits), _prompts(tok, 10), SamplingConfig(n=2, seed=2))
    mask = batch.attention_mask
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=mask.long(), position_ids=position_ids).logits
    p = batch.prompt_ids.shape[1]
    recomputed = logprobs_from_logits(logits[:, p - 1 : -1], batch.response_ids)
    diff = (recomputed - batch.rollout_logprobs)[batch.response_mask].abs().max().item()
    assert diff < 1e-5, diff


# --------------------------------------------------------------------------------------------------
# Blocks: shared, copied on write, freed


def _cache(num_blocks: int, block_size: int, slots: int = 8, max_len: int = 32) -> PagedKVCache:
    layers, kv, d = 2, 1, 4
    k = [torch.randn(kv, num_blocks * block_size, d) for _ in range(layers)]
    v = [torch.randn(kv, num_blocks * block_size, d) for _ in range(layers)]
    rope = (torch.ones(max_len, d), torch.zeros(max_len, d))
    return PagedKVCache(
        k,
        v,
        slots=slots,
        max_len=max_len,
        block_size=block_size,
        num_heads=2,
        att_dtype=torch.float32,
        rope=rope,
        scale=0.5,
        device=torch.device("cpu"),
    )


def test_a_prompts_samples_share_its_blocks_and_copy_the_partial_one_on_write():
    cache = _cache(num_blocks=20, block_size=4)
    slots = [0, 1, 2, 3]
    cache.admit(slots, prompt_len=6, max_new_tokens=5)  # 2 prompt blocks (the second holds 2 of 4 tokens)
    prompt_blocks = cache.blocks[0]
    assert len(prompt_blocks) == 2 and all(cache.blocks[s] == prompt_blocks for s in slots)
    assert [cache.pool.refcount[b] for b in prompt_blocks] == [4, 4]
    assert cache.pool.usable - len(cache.pool.free) == 2  # held: the prompt's blocks, once
    # promised: per sample, the blocks of positions 6..9 outside the full prompt block: 2 (copy + one more), but
    # the partial block, taken already, is one sample's own
    assert cache.pool.reserved == 4 * 2 - 1 == blocks_for_request(6, 4, 5, 4) - 2
    partial = prompt_blocks[1]
    before = [pool[:, partial * 4 : partial * 4 + 2].clone() for pool in (*cache.k, *cache.v)]
    cache.grow(torch.tensor(slots), torch.tensor([6, 6, 6, 6]))  # each sample's first own token
    tails = [cache.blocks[s][1] for s in slots]
    assert tails[:3] != [partial] * 3 and len(set(tails)) == 4 and tails[3] == partial  # the last holder keeps it
    assert all(cache.blocks[s][0] == prompt_blocks[0] for s in slots)  # the full block stays shared
    assert cache.pool.refcount[prompt_blocks[0]] == 4 and cache.pool.refcount[partial] == 1
    for s, tail in zip(slots, tails):  # the copies hold the prompt's two tokens (and zeros), the table points there
        for pool, old in zip((*cache.k, *cache.v), before):
            assert torch.equal(pool[:, tail * 4 : tail * 4 + 2], old)
            assert tail == partial or not pool[:, tail * 4 + 2 : tail * 4 + 4].any()
        assert cache.block_table[s, :2].tolist() == [prompt_blocks[0], tail]
    cache.grow(torch.tensor(slots), torch.tensor([8, 8, 8, 8]))  # a block boundary: a fresh block each
    assert all(len(cache.blocks[s]) == 3 for s in slots) and cache.pool.reserved == 4 * 2 - 1 - 3 - 4 == 0
    assert cache.reserve == [0] * 4 + [0] * 4
    assert all(cache.block_table[s, 2].item() == cache.blocks[s][2] for s in slots)
    for s in slots:
        cache.release(s)
    assert len(cache.pool.free) == cache.pool.usable and cache.pool.reserved == 0 and not any(cache.pool.refcount)
    assert not cache.block_table.any()


@pytest.mark.parametrize("order", ["both-end-first", "one-ends-one-writes", "one-copies-one-ends"])
def test_rows_that_end_before_writing_return_their_promises(order):
    """Samples that end at their first token (an EOS) never write into the shared partial block: whichever order
    they end and write in, every block and promise comes back."""
    cache = _cache(num_blocks=12, block_size=4)
    cache.admit([0, 1], prompt_len=6, max_new_tokens=5)
    assert cache.pool.reserved == 2 * 2 - 1
    if order == "both-end-first":
        cache.release(0)
        cache.release(1)
    elif order == "one-ends-one-writes":
        cache.release(0)
        cache.grow(torch.tensor([1]), torch.tensor([6]))  # the last holder: in place, no block taken
        assert len(cache.pool.free) == cache.pool.usable - 2 and cache.reserve[1] == 1
        cache.release(1)
    else:
        cache.grow(torch.tensor([0]), torch.tensor([6]))  # a copy
        cache.release(1)  # the partial block's last holder, never written: it goes back to the pool
        assert cache.pool.reserved == cache.reserve[0] == 1
        cache.release(0)
    assert len(cache.pool.free) == cache.pool.usable and cache.pool.reserved == 0 and not any(cache.pool.refcount)


def test_block_pool_refuses_double_frees_and_unpromised_blocks():
    pool = BlockPool(3)
    assert pool.usable == 2 and pool.available == 2
    block = pool.take()
    assert block == 1 and pool.refcount[1] == 1
    assert pool.drop(block) and pool.free[-1] == 1
    with pytest.raises(RuntimeError, match="dropped more often"):
        pool.drop(block)
    pool.refcount[1] = 0
    pool.reserved = 2
    with pytest.raises(RuntimeError, match="no unreserved block"):
        pool.take()
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_no_block_leaks_over_1000_requests(setup):
    """1,000 prompts x 2 samples through 24 slots of 4-token blocks: every block, promise and slot comes back,
    the batch never exceeds its slots or its pool, and the samples are still the lock-step engine's."""
    _, tok, rollout = setup
    prompts = _prompts(tok, 1000)
    sampling = SamplingConfig(n=2, max_new_tokens=4, seed=1)
    # 40 blocks of 4 tokens (2 layers x (k, v) x 1 head x 32 dims x 4 bytes = 512 bytes a token): admission waits
    # for blocks as well as for slots
    limits = BatchingLimits(max_slots=24, block_size=4, kv_cache_gib=40 * 4 * 512 / 2**30)
    with torch.inference_mode():
        batcher = ContinuousBatcher(rollout, prompts, sampling, 1, limits)
        tokens, _ = batcher.run()
    cache = batcher.cache
    assert len(cache.pool.free) == cache.pool.usable and cache.pool.reserved == 0 and not any(cache.pool.refcount)
    assert sorted(batcher.free_slots) == list(range(24)) and not cache.block_table.any()
    assert batcher.peak_rows <= 24 and batcher.peak_blocks <= cache.pool.usable
    assert batcher.iterations > 2000 * 1 / 24  # rows streamed through the slots
    lockstep = generate(attrs.evolve(rollout, batching="lockstep"), prompts, sampling)
    t = lockstep.response_ids.shape[1]
    assert torch.equal(tokens[:, :t].masked_fill(~lockstep.response_mask, tok.pad_token_id), lockstep.response_ids)


def test_samples_of_a_prompt_hold_fewer_blocks_than_copies_would(setup):
    """One long prompt, 8 samples: the pool's peak is the prompt's blocks once plus each sample's own, not 8
    copies of the prompt (what the lock-step engine's contiguous cache holds)."""
    _, tok, rollout = setup
    prompt = tok.encode("123456789+987654321=" * 3)  # 60 tokens: 3 full blocks of 16 and a partial one
    sampling = SamplingConfig(n=8, max_new_tokens=8, seed=0)
    with torch.inference_mode():
        batcher = ContinuousBatcher(rollout, [prompt], sampling, 0, BatchingLimits(block_size=16))
        batcher.run()
    assert len(prompt) == 60
    own = -(-(60 + 8 - 1) // 16) - 60 // 16  # positions 60..66: the partial block's copy and one more
    assert own == 2
    assert batcher.peak_blocks <= 4 + 8 * own < 8 * -(-(60 + 8 - 1) // 16)


# --------------------------------------------------------------------------------------------------
# Limits


def test_a_request_larger_than_the_cache_is_refused_before_any_work(setup, monkeypatch):
    _, tok, rollout = setup

    def no_work(*args, **kwargs):
        raise AssertionError("the decoder was built before the request was refused")

    monkeypatch.setattr(scheduler, "Decoder", no_work)
    prompts = [tok.encode("1+1="), tok.encode("12345678901234567890+1=")]
    # 512 KV bytes a token (2 layers x (k, v) x 1 head x 32 dims x 4 bytes): 8 KiB a 16-token block; 9 blocks,
    # one of them the null block; prompt 0 needs 8 (2 own per sample), prompt 1 its full block and 2 own per sample
    small = attrs.evolve(rollout, batching_limits=BatchingLimits(kv_cache_gib=9 * 8192 / 2**30, block_size=16))
    with pytest.raises(
        ValueError,
        match=r"prompt 1 \(23 tokens, n=4 samples, max_new_tokens=16\) needs 9 KV-cache "
        r"blocks of 16 tokens, more than the whole cache holds \(8 blocks\).*"
        r"kv_cache_gib",
    ):
        generate(small, prompts, SamplingConfig(n=4, max_new_tokens=16))
    with pytest.raises(ValueError, match=r"rollout\.native\.max_slots=2 is fewer than rollout\.n=4"):
        generate(attrs.evolve(rollout, batching_limits=BatchingLimits(max_slots=2)), prompts, SamplingConfig(n=4))
    with pytest.raises(ValueError, match="BatchingLimits.block_size must be positive"):
        BatchingLimits(block_size=0)


@pytest.mark.parametrize("text", ["1+22=", "1234567+", "12345678+1"], ids=["partial", "full", "full+partial"])
def test_the_default_cache_holds_a_prompts_samples_exactly(setup, text):
    """The default pool holds every slot at its longest; a request filling every slot fits it exactly, whether
    or not its prompt ends in a partial block (whose last holder writes into it rather than a copy)."""
    _, tok, rollout = setup
    prompt = tok.encode(text)
    with torch.inference_mode():
        batcher = ContinuousBatcher(rollout, [prompt], SamplingConfig(n=4, max_new_tokens=6), 0, BatchingLimits())
        batcher.run()
    usable = batcher.cache.pool.usable
    assert usable == 4 * -(-(len(prompt) + 6) // 8)
    assert batcher.peak_blocks <= blocks_for_request(len(prompt), 4, 6, 8) <= usable
    assert batcher.cache.pool.reserved == 0 and len(batcher.cache.pool.free) == usable


def test_long_prompts_are_fed_in_chunks_within_the_prefill_budget(setup):
    """Chunked prefill: no iteration computes more prompt tokens than ``prefill_tokens`` (a prompt longer than that
    is fed a chunk per iteration while the running rows go on decoding), and every prompt token is computed once
    (a prompt's samples share its blocks). The samples are the lock-step engine's (the LIMITS cases above)."""
    _, tok, rollout = setup
    prompts = _prompts(tok, 12)
    assert max(map(len, prompts)) > 3 * 6
    limits = BatchingLimits(max_slots=6, block_size=4, prefill_tokens=6)
    fed, per_iteration = [], []
    with torch.inference_mode():
        batcher = ContinuousBatcher(rollout, prompts, SamplingConfig(n=2, max_new_tokens=8, seed=6), 6, limits)
        prefill, extend = batcher.decoder.prefill, batcher.decoder.extend_paged
        batcher.decoder.prefill = lambda ids, mask, copies: fed.append(int(mask.sum())) or prefill(ids, mask, copies)

        def counted_extend(tokens, slots, positions, valid, length):
            fed.append(int(valid.sum()))
            return extend(tokens, slots, positions, valid, length)

        batcher.decoder.extend_paged = counted_extend
        while batcher.busy:
            fed.clear()
            batcher.step()
            per_iteration.append(sum(fed))
    assert max(per_iteration) == 6 and sum(per_iteration) == sum(map(len, prompts))
    assert sum(1 for tokens in per_iteration if tokens == 6) >= 3  # the longest prompt took several chunks


def test_more_prompts_than_slots_all_complete(setup):
    _, tok, rollout = setup
    prompts = _prompts(tok, 30)
    sampling = SamplingConfig(n=2, max_new_tokens=12, seed=3)
    with torch.inference_mode():
        batcher = ContinuousBatcher(rollout, prompts, sampling, 3, BatchingLimits(max_slots=4, block_size=8))
        tokens, logprobs = batcher.run()
    assert batcher.peak_rows == 4 and not batcher.waiting
    assert tokens.shape == (60, 12) and bool((logprobs[:, 0] < 0).all())  # every row sampled its first token
    eos = torch.tensor(rollout.eos_token_ids)
    ended = torch.isin(tokens, eos).any(-1)
    full = (logprobs < 0).all(-1)
    assert bool((ended | full).all())  # every row ended at an EOS or ran to max_new_tokens


def test_each_prompt_stops_at_its_own_limit(setup):
    """Per-prompt limits (a server's requests each carry their own): a row samples what it samples under one shared
    limit, up to its own limit, and nothing after it; every block comes back; bad limits are refused by name."""
    _, tok, rollout = setup
    prompts = _prompts(tok, 10)
    sampling = SamplingConfig(n=2, max_new_tokens=16, seed=6)
    limits = [1 + 3 * i % 16 for i in range(len(prompts))]
    with torch.inference_mode():
        shared, shared_lp, _ = scheduler.generate_continuous(rollout, prompts, sampling, 6, BatchingLimits())
        batcher = ContinuousBatcher(rollout, prompts, sampling, 6, BatchingLimits(max_slots=6), max_new_tokens=limits)
        tokens, logprobs = batcher.run()
    assert tokens.shape[1] <= max(limits)
    eos = torch.tensor(rollout.eos_token_ids)
    for row in range(tokens.shape[0]):
        limit = limits[row // 2]
        ended = torch.isin(shared[row, :limit], eos).nonzero()
        length = int(ended[0]) + 1 if ended.numel() else limit
        assert torch.equal(tokens[row, :length], shared[row, :length]), row
        torch.testing.assert_close(logprobs[row, :length], shared_lp[row, :length], rtol=0, atol=1e-5)
        assert (logprobs[row, length:] == 0).all() and (tokens[row, length:] == tok.pad_token_id).all(), row
    pool = batcher.cache.pool
    assert len(pool.free) == pool.usable and pool.reserved == 0
    for bad, match in (([4] * 9, "10 prompts"), ([4] * 9 + [0], r"max_new_tokens\[9\] is 0")):
        with pytest.raises(ValueError, match=match):
            ContinuousBatcher(rollout, prompts, sampling, 6, BatchingLimits(), max_new_tokens=bad)


# --------------------------------------------------------------------------------------------------
# Config: rollout.native.*


def test_rollout_native_keys_reach_the_engine(setup, tmp_path):
    from backends.config import ConfigError, apply_overrides
    from backends.rollout.api import build_rollout
    from experiments import grpo

    model, tok, _ = setup
    path = tmp_path / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    overrides = [
        "rollout.native.batching=lockstep",
        "rollout.native.block_size=4",
        "rollout.native.max_slots=16",
        "rollout.native.kv_cache_gib=0.5",
        "rollout.native.prefill_tokens=64",
        "rollout.native.cuda_graphs=false",
        "rollout.native.overlap_steps=false",
    ]
    cfg = apply_overrides(grpo.Config(), overrides, presets_dir=grpo.PRESETS, renamed=grpo.RENAMED_GRPO)
    rollout = build_rollout(cfg.rollout, path, tok)
    assert rollout.batching == "lockstep"
    assert rollout.batching_limits == BatchingLimits(
        max_slots=16, prefill_tokens=64, block_size=4, kv_cache_gib=0.5, cuda_graphs=False, overlap_steps=False
    )
    assert build_rollout(grpo.Config().rollout, path, tok).batching == "continuous"
    for bad, named in (
        ("rollout.native.block_size=0", "rollout.native.block_size must be positive, got 0"),
        ("rollout.native.batching=eager", "rollout.native.batching"),
    ):
        with pytest.raises(ConfigError, match=named):
            apply_overrides(grpo.Config(), [bad], presets_dir=grpo.PRESETS, renamed=grpo.RENAMED_GRPO)

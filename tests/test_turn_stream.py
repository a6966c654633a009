"""Multi-turn rows continued as soon as their environment answered (backends.rollout.native_turns), through the agent
loop and directly. A tiny fp32 model (hidden 64, 2 layers) built once per module; each test costs about a second on
one CPU core (the hand-off test waits for no timeout: its slow environment is released by a fast one)."""

from __future__ import annotations

import threading

import attrs
import pytest
import torch

from backends.data import Example, prompt_token_ids
from backends.models import CHAT_TOKENS, TinyModelConfig, build_char_tokenizer, load_causal_lm, write_tiny_model
from backends.rollout.agent_loop import run_episodes
from backends.rollout.api import RolloutConfig, build_rollout
from backends.rollout.common import SamplingConfig
from backends.rollout.decode_graphs import PaddedDecodeStep
from backends.rollout.environments import MultiTurnConfig, Observation
from backends.rollout.native_turns import NativeTurnStream
from backends.rollout.scheduler import BatchingLimits

pytestmark = pytest.mark.native_engine

TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=96, initializer_range=0.2
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A char tokenizer, the model's path, and a continuous-batching native rollout whose EOS set holds the
    digits, letters and rare bytes, so a random model's turns end after a few tokens, at varied steps."""
    tok = build_char_tokenizer()
    path = write_tiny_model(tmp_path_factory.mktemp("stream"), TINY, tok)
    rollout = build_rollout(RolloutConfig(), path, tok)
    rare = range(tok.convert_tokens_to_ids(CHAT_TOKENS[-1]) + 1, len(tok))
    eos = (tok.eos_token_id, *tok.convert_tokens_to_ids(list("0123456789abcdefghijklmnopqrstuvwxyz")), *rare)
    return tok, path, attrs.evolve(rollout, eos_token_ids=eos)


def examples(tok, texts=("1+2=", "12+34=", "7*8=")):
    return [
        Example(
            prompt_ids=tuple(prompt_token_ids([{"role": "user", "content": t}], tok)),
            ground_truth=None,
            source="s",
            columns={},
            where=f"test.jsonl:{i + 1}",
        )
        for i, t in enumerate(texts)
    ]


@attrs.define
class Counting:
    """Answers with a tool message naming the turn until its third turn, then is done; 0.5 reward a turn."""

    seen: list = attrs.Factory(list)

    def step(self, response: str) -> Observation:
        self.seen.append(response)
        if len(self.seen) >= 3:
            return Observation(done=True, reward=0.5)
        return Observation(messages=[{"role": "tool", "content": f"t{len(self.seen)}"}], reward=0.5)


def episodes(rollout, tok, *, seed=0, factory=Counting, temperature=1.0, n=2, max_total_tokens=64, workers=8):
    cfg = MultiTurnConfig(max_turns=3, max_total_tokens=max_total_tokens, call_timeout_s=10.0, workers=workers)
    sampling = SamplingConfig(n=n, temperature=temperature, max_new_tokens=6)
    return run_episodes(rollout, examples(tok), tok, sampling, cfg, lambda e: factory(), seed=seed)


@pytest.mark.parametrize("seed,temperature", [(0, 1.0), (1, 1.0), (2, 1.0), (0, 0.0)])
def test_streamed_trajectories_are_the_turn_by_turn_ones(setup, seed, temperature):
    """The same seed gives the same tokens, turns, masks and rewards on both paths: each row draws its k-th sample
    from the same uniform, and the logits differ by float rounding only (checked: the log-probs)."""
    tok, _, rollout = setup
    streamed = episodes(rollout, tok, seed=seed, temperature=temperature)
    turn_by_turn = episodes(attrs.evolve(rollout, batching="lockstep"), tok, seed=seed, temperature=temperature)
    a, b = streamed.batch, turn_by_turn.batch
    for name in ("response_ids", "response_mask", "loss_mask", "turn_ids", "token_rewards", "prompt_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, rtol=0, atol=1e-5)
    assert streamed.turns == turn_by_turn.turns and streamed.finished == turn_by_turn.finished
    assert streamed.metrics == turn_by_turn.metrics and max(streamed.turns) == 3


@pytest.mark.parametrize("overlap", [False, True], ids=["waiting", "overlapped"])
def test_the_stream_through_the_padded_step_gives_the_same_trajectories(setup, monkeypatch, overlap):
    """The stream as it runs on CUDA, through the agent loop on the CPU: its branch for a decode step replayed from a
    CUDA graph (the working rows' step at fixed shapes, the resumed rows' tokens in a forward of their own), with
    and without each step queued before the sampled tokens are read. The same trajectories, the log-probs equal to
    float rounding, and the padded step did run."""
    tok, _, rollout = setup
    eager = episodes(rollout, tok, seed=3).batch
    init, padded = NativeTurnStream.__init__, []

    def with_padded_step(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.graphed_step = PaddedDecodeStep(self.decoder, self.cache, self.max_len)
        self.overlap = overlap
        padded.append(self.graphed_step)

    monkeypatch.setattr(NativeTurnStream, "__init__", with_padded_step)
    original_run, calls = PaddedDecodeStep.run, []

    def counted_run(self, bucket, keys):
        calls.append((bucket, keys))
        return original_run(self, bucket, keys)

    monkeypatch.setattr(PaddedDecodeStep, "run", counted_run)
    streamed = episodes(rollout, tok, seed=3).batch
    assert padded and calls
    for name in ("response_ids", "response_mask", "loss_mask", "turn_ids", "token_rewards"):
        assert torch.equal(getattr(streamed, name), getattr(eager, name)), name
    torch.testing.assert_close(streamed.rollout_logprobs, eager.rollout_logprobs, rtol=0, atol=1e-5)


def test_streamed_logprobs_equal_an_fp32_forward_over_the_conversation(setup):
    tok, path, rollout = setup
    batch = episodes(rollout, tok, seed=4).batch
    model, _ = load_causal_lm(path)
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], 1)
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids).logits.float()
    p = batch.prompt_ids.shape[1]
    logp = torch.log_softmax(logits[:, p - 1 : -1], -1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
    own = batch.loss_mask
    assert own.sum() > 20 and (batch.turn_ids[own] > 0).any()  # later turns are checked too
    torch.testing.assert_close(batch.rollout_logprobs[own], logp[own], rtol=0, atol=2e-5)


def test_a_row_continues_while_another_waits_for_its_environment(setup):
    """Row 0's environment answers its first turn only once another row's environment has read that row's second
    turn: the other row sampled a whole turn while row 0 waited. The turn-by-turn loop would wait for row 0's answer
    before any second turn (and here time out)."""
    tok, _, rollout = setup
    released = threading.Event()
    made = []

    @attrs.define
    class HandOff(Counting):
        row: int = 0

        def step(self, response: str) -> Observation:
            if self.row == 0 and not self.seen:
                assert released.wait(8), "no other row reached its second turn while row 0 waited"
            elif len(self.seen) == 1:
                released.set()  # this row's second turn ended: it continued without row 0
            return super().step(response)

    def factory():
        made.append(HandOff(row=len(made)))
        return made[-1]

    out = episodes(rollout, tok, seed=0, factory=factory)
    assert released.is_set() and len(made[0].seen) >= 1
    assert max(len(env.seen) for env in made[1:]) >= 2 and out.turns[0] >= 1


def drive(stream: NativeTurnStream, rows: int, forced: list[int], turns: int) -> dict:
    """The agent loop's part, minimal: every ended turn is answered at once with ``forced`` until ``turns`` turns;
    returns every ended turn, ``{(row, turn): (tokens, logprobs, sampled, finished)}``."""
    out, done = {}, [0] * rows
    for r in range(rows):
        stream.resume(r, [], 4)
    while stream.busy:
        for turn in stream.step():
            out[turn.row, done[turn.row]] = (turn.tokens, turn.logprobs, turn.sampled, turn.finished)
            done[turn.row] += 1
            if done[turn.row] < turns:
                stream.resume(turn.row, forced, 4)
            else:
                stream.close(turn.row)
    return out


def test_closed_rows_free_their_blocks_and_waiting_prompts_take_their_slots(setup):
    """Twelve prompts x 2 samples through 4 slots, three turns each: every row runs all its turns, prompts wait
    for free slots, and once every row is closed the cache holds no block and promises none."""
    tok, _, rollout = setup
    prompts = [list(e.prompt_ids) for e in examples(tok, [f"{i}+{i}=" for i in range(12)])]
    limits = BatchingLimits(max_slots=4, block_size=4)
    stream = NativeTurnStream(
        rollout, prompts, SamplingConfig(n=2, max_new_tokens=4), seed=0, max_slots=20, limits=limits
    )
    try:
        turns = drive(stream, 24, forced=tok.encode("ok"), turns=3)
        pool = stream.cache.pool
        assert sorted(turns) == [(row, turn) for row in range(24) for turn in range(3)] and not stream.waiting
        assert len(pool.free) == pool.usable and pool.reserved == 0 and sorted(stream.free_slots) == [0, 1, 2, 3]
        assert stream.peak_blocks <= pool.usable
    finally:
        stream.end()
    with pytest.raises(RuntimeError, match="the stream has ended"):
        stream.step()


@pytest.mark.parametrize("step", ["eager", "padded"])
@pytest.mark.parametrize("answer", ["ok", ""], ids=["observation", "no-observation"])
def test_the_overlapped_stream_gives_the_waiting_streams_turns(setup, step, answer):
    """The stream as it runs on CUDA (each decode step queued before the sampled tokens are read), on the CPU: a row
    whose turn ended has fed its last token already and starts its next turn from that step's logits (resumed with
    no observation, from those logits alone), and a row whose conversation is full (the second engine's turns all
    run to their limit: 4 + 2 + 4 + 2 + 4 = max_slots) feeds nothing more. The turns are the waiting stream's,
    every block comes back."""
    tok, _, rollout = setup
    prompts = [list(e.prompt_ids) for e in examples(tok, [f"{i}*{i}=" for i in range(6)])]
    full = attrs.evolve(rollout, eos_token_ids=(tok.eos_token_id,))
    for engine in (rollout, full):
        runs = {}
        for overlap in (False, True):
            limits = BatchingLimits(max_slots=5, block_size=4)
            stream = NativeTurnStream(
                engine, prompts, SamplingConfig(n=2, max_new_tokens=4), seed=1, max_slots=16, limits=limits
            )
            stream.overlap = overlap
            if step == "padded":
                stream.graphed_step = PaddedDecodeStep(stream.decoder, stream.cache, stream.max_len)
            try:
                runs[overlap] = drive(stream, 12, forced=tok.encode(answer) if answer else [], turns=3)
                pool = stream.cache.pool
                assert len(pool.free) == pool.usable and pool.reserved == 0, overlap
            finally:
                stream.end()
        if engine is full and answer:
            assert max(stream.added) == 16  # some conversations filled their slots
        assert runs[True].keys() == runs[False].keys() and len(runs[True]) == 36
        for key, (tokens, logprobs, sampled, finished) in runs[False].items():
            got = runs[True][key]
            assert (got[0], got[2], got[3]) == (tokens, sampled, finished), key
            assert max(abs(a - b) for a, b in zip(got[1], logprobs)) < 1e-5, key


def test_the_stream_path_and_slots_fewer_than_rows_give_the_same_trajectories(setup):
    tok, _, rollout = setup
    few = attrs.evolve(rollout, batching_limits=BatchingLimits(max_slots=2))
    a, b = episodes(rollout, tok, seed=5).batch, episodes(few, tok, seed=5).batch
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.loss_mask, b.loss_mask)


def test_a_conversation_larger_than_the_cache_is_refused(setup):
    tok, _, rollout = setup
    small = attrs.evolve(rollout, batching_limits=BatchingLimits(kv_cache_gib=2e-5, block_size=4))
    with pytest.raises(ValueError, match=r"conversations of prompt 0 .* raise rollout.native.kv_cache_gib"):
        episodes(small, tok, max_total_tokens=200)


def test_resume_and_close_errors(setup):
    tok, _, rollout = setup
    prompts = [list(e.prompt_ids) for e in examples(tok)]
    stream = rollout.start_turn_stream(prompts, SamplingConfig(n=1), seed=0, max_slots=8)
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
    finally:
        stream.end()
    lockstep = attrs.evolve(rollout, batching="lockstep")
    assert lockstep.start_turn_stream(prompts, SamplingConfig(), seed=0, max_slots=8) is None  # turn by turn

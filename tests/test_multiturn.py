"""Multi-turn rollouts: environments and tools, the agent loop, token-in / token-out, loss masks, SFT on traces.

The engines' session calls have their own tests (test_rollout_session.py, test_rollout_vllm_session.py); here
the agent loop drives them with environments and the result is checked the way a trainer reads it.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import attrs
import pytest
import torch

import rlfunc as rf
from backends.config import ConfigError
from backends.data import Example, prompt_token_ids
from backends.models import CHAT_TOKENS, TinyModelConfig, build_char_tokenizer, write_tiny_model
from backends.rollout.agent_loop import EnvironmentStepError, run_episodes, sample
from backends.rollout.api import RolloutConfig, build_rollout
from backends.rollout.common import SamplingConfig, answer_texts
from backends.rollout.environments import (
    MultiTurnConfig,
    Observation,
    ToolEnvironment,
    argument_errors,
    environment_factory,
    observation_token_ids,
    parse_tool_calls,
    tool_schema,
)
from backends.training.sft import SFTConfig, load_sft_examples, nll_loss, sft_batch
from experiments.tasks import calculator

pytestmark = pytest.mark.multiturn

TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=96, initializer_range=0.2
)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    return a + b


def fail(x: str) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("the tool broke")


def sleepy(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"


def undocumented(x: int) -> int:
    return x


# ------------------------------------------------------------------------------------------ tools


def test_parse_tool_calls_valid_malformed_and_string_arguments():
    text = (
        'think <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> then '
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
        '<tool_call>{not json}</tool_call><tool_call>["add"]</tool_call>'
        '<tool_call>{"name": "add", "arguments": 5}</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert calls[:2] == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert "not valid JSON" in calls[2] and '{"name": ..., "arguments"' in calls[3] and "JSON object" in calls[4]


def test_tool_environment_answers_every_failure_with_an_error_message():
    env = ToolEnvironment({"add": add, "fail": fail, "sleepy": sleepy}, timeout_s=0.3)
    ok = env.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>')
    assert [m["content"] for m in ok.messages] == ["42"] and ok.messages[0]["role"] == "tool" and not ok.done
    assert ok.metrics == {"tool_calls": 1.0, "tool_call_errors": 0.0}
    cases = {
        '<tool_call>{"name": "mul", "arguments": {}}</tool_call>': "no tool named 'mul'",
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>': "missing argument 'b'",
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": "2"}}</tool_call>': "'b' must be integer",
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}</tool_call>': "unknown argument 'c'",
        '<tool_call>{"name": "fail", "arguments": {"x": "y"}}</tool_call>': "raised RuntimeError: the tool broke",
        '<tool_call>{"name": "sleepy", "arguments": {"seconds": 8}}</tool_call>': "did not return within 0.3 s",
        '<tool_call>{"name": "add"': "not closed",
        "<tool_call>nope</tool_call>": "not valid JSON",
    }
    for text, error in cases.items():
        t0 = time.time()
        obs = env.step(text)
        assert time.time() - t0 < 6.0  # a hanging tool costs its timeout, not its run time (8 s)
        assert not obs.done and obs.metrics["tool_call_errors"] == 1.0, text
        assert obs.messages[0]["content"].startswith("error: ") and error in obs.messages[0]["content"], obs.messages
    final = env.step("42")
    assert final.done and not final.messages and final.metrics["tool_calls"] == 0.0


def test_tool_schema_and_argument_checks():
    schema = tool_schema(add)
    assert schema["function"]["name"] == "add" and schema["function"]["parameters"]["required"] == ["a", "b"]
    assert argument_errors(schema, {"a": 1, "b": 2}) == []
    assert argument_errors(schema, {"a": True, "b": 2.5}) == [
        "argument 'a' must be integer, got true",
        "argument 'b' must be integer, got 2.5",
    ]
    with pytest.raises(ConfigError, match="undocumented.*docstring"):
        tool_schema(undocumented)


def test_environment_factory_resolves_tools_at_start_up(tmp_path):
    factory = environment_factory(MultiTurnConfig(max_turns=2, tools=("tests.test_multiturn:add",)))
    env = factory(Example(prompt_ids=(1,), ground_truth=None, source="s", columns={}, where="x"))
    assert isinstance(env, ToolEnvironment) and set(env.tools) == {"add"}
    with pytest.raises(ConfigError, match="needs rollout.multi_turn.tools"):
        environment_factory(MultiTurnConfig(max_turns=2))
    with pytest.raises(ConfigError, match="has no attribute .nothing_here."):
        environment_factory(MultiTurnConfig(max_turns=2, tools=("tests.test_multiturn:nothing_here",)))
    with pytest.raises(ConfigError, match="docstring"):
        environment_factory(MultiTurnConfig(max_turns=2, tools=("tests.test_multiturn:undocumented",)))


def test_the_build_md_environment_example_runs(tmp_path):
    """The documented example (BUILD.md, "Multi-turn rollouts, environments and tools") is real code that works."""
    doc = (Path(__file__).resolve().parents[1] / "BUILD.md").read_text()
    code = doc.split("```python\n# my_env.py\n", 1)[1].split("```", 1)[0]
    assert len(code.splitlines()) < 40
    (tmp_path / "my_env.py").write_text(code)
    row = Example(prompt_ids=(1,), ground_truth="42", source="s", columns={}, where="guess.jsonl:line 1")
    game = environment_factory(MultiTurnConfig(max_turns=6, environment=f"{tmp_path / 'my_env.py'}:make_game"))(row)
    assert [m["content"] for m in game.step("50").messages] == ["lower"]
    assert game.step(" 7?").reward < 0
    assert game.step("42").done
    tools = environment_factory(MultiTurnConfig(max_turns=3, tools=(f"{tmp_path / 'my_env.py'}:population",)))(row)
    answer = tools.step('<tool_call>{"name": "population", "arguments": {"city": "Oslo"}}</tool_call>')
    assert answer.messages[0]["role"] == "tool" and "710000" in answer.messages[0]["content"]


def test_observation_tokens_are_the_chat_templates_framing():
    tok = build_char_tokenizer()
    ids = observation_token_ids([{"role": "tool", "content": "42"}], tok)
    assert tok.convert_ids_to_tokens(ids) == ["<|tool|>", "4", "2", "<eos>", "<|assistant|>"]


# ------------------------------------------------------------------------------------------ the agent loop


@attrs.define
class ScriptedEnv:
    """Answers the first ``turns - 1`` model turns with a tool message naming the turn, then is done; records
    what it saw. A turn reward of 0.25 each."""

    turns: int = 3
    seen: list = attrs.Factory(list)

    def step(self, response: str) -> Observation:
        self.seen.append(response)
        if len(self.seen) >= self.turns:
            return Observation(done=True, reward=0.25)
        return Observation(messages=[{"role": "tool", "content": f"t{len(self.seen)}"}], reward=0.25)


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """A tiny fp32 model and a native rollout whose EOS set includes digits and letters (turns end after a
    few tokens, at varied steps)."""
    tok = build_char_tokenizer()
    path = write_tiny_model(tmp_path_factory.mktemp("mt"), TINY, tok)
    rollout = build_rollout(RolloutConfig(), path, tok)
    rollout = attrs.evolve(
        rollout,
        eos_token_ids=(
            tok.eos_token_id,
            *tok.convert_tokens_to_ids(list("0123456789abcdefghijklmnopqrstuvwxyz")),
            *rare_byte_ids(tok),
        ),
    )
    return tok, path, rollout


def rare_byte_ids(tok) -> range:
    """The byte tokens after the chat tokens (bytes outside the common characters): ending a turn on them too keeps
    a random model's turns as short as they were with a character vocabulary."""
    return range(tok.convert_tokens_to_ids(CHAT_TOKENS[-1]) + 1, len(tok))


def _examples(tok, texts=("1+2=", "12+34=", "7*8=")):
    return [
        Example(
            prompt_ids=tuple(prompt_token_ids([{"role": "user", "content": t}], tok)),
            ground_truth="3",
            source="s",
            columns={},
            where=f"test.jsonl:{i + 1}",
        )
        for i, t in enumerate(texts)
    ]


def _check_token_in_token_out(tok, batch, envs, examples, n, eos):
    """Every row's response is exactly its model turns and the observation tokens between them: the sampled
    tokens (loss_mask 1, and what the environment read) and the chat template's rendering of each observation
    (loss_mask 0), nothing re-encoded; turn ids count the turns."""
    for r in range(rf.batch_size(batch)):
        length = int(batch.response_mask[r].sum())
        ids = batch.response_ids[r, :length].tolist()
        own = batch.loss_mask[r, :length].tolist()
        turns = batch.turn_ids[r, :length].tolist()
        assert not batch.loss_mask[r, length:].any() and batch.rollout_logprobs[r][~batch.loss_mask[r]].abs().max() == 0
        env = envs[r]
        at = 0
        for turn, seen in enumerate(env.seen):
            if turn:  # the observation that answered the previous turn
                obs = observation_token_ids([{"role": "tool", "content": f"t{turn}"}], tok)
                assert ids[at : at + len(obs)] == obs and own[at : at + len(obs)] == [False] * len(obs)
                assert turns[at : at + len(obs)] == [turn] * len(obs)
                at += len(obs)
            end = at
            while end < length and own[end]:
                end += 1
            model_turn = ids[at:end]
            assert turns[at:end] == [turn] * (end - at) and model_turn, (r, turn)
            assert tok.decode([t for t in model_turn if t not in eos], skip_special_tokens=False) == seen
            at = end
        if len(env.seen) < int(batch.turn_ids[r, length - 1]) + 1:  # a last turn cut by a budget: nothing read it
            at = length
        assert at == length  # nothing else in the row
        prompt = list(examples[r // n].prompt_ids)
        assert batch.prompt_ids[r][batch.prompt_mask[r]].tolist() == prompt


def _run(
    native,
    seed=0,
    *,
    max_total_tokens=64,
    max_new_tokens=6,
    factory=None,
    n=2,
    on_error="error",
    timeout=5.0,
    workers=8,
):
    tok, _, rollout = native
    envs = []

    def make(example):
        envs.append(ScriptedEnv() if factory is None else factory(example))
        return envs[-1]

    cfg = MultiTurnConfig(
        max_turns=3, max_total_tokens=max_total_tokens, on_error=on_error, call_timeout_s=timeout, workers=workers
    )
    examples = _examples(tok)
    episodes = run_episodes(
        rollout,
        examples,
        tok,
        SamplingConfig(n=n, temperature=1.0, max_new_tokens=max_new_tokens),
        cfg,
        make,
        seed=seed,
    )
    return episodes, envs, examples


def test_native_trajectories_are_token_in_token_out_and_reproducible(native):
    tok, _, _ = native
    episodes, envs, examples = _run(native)
    batch = episodes.batch
    _check_token_in_token_out(tok, batch, envs, examples, n=2, eos=set(native[2].eos_token_ids))
    assert max(episodes.turns) == 3 and episodes.metrics["multi_turn/turns"] == sum(episodes.turns) / 6
    # every turn the environment answered got its 0.25, on that turn's last model token
    for r, (rewards, env) in enumerate(zip(episodes.turn_rewards, envs)):
        assert rewards == [0.25] * len(env.seen)
        assert float(batch.token_rewards[r].sum()) == pytest.approx(0.25 * len(env.seen))
        assert (batch.token_rewards[r] != 0).sum() == len(env.seen) and not (
            batch.token_rewards[r] * ~batch.loss_mask[r]
        ).any()
    again, _, _ = _run(native)
    assert torch.equal(again.batch.response_ids, batch.response_ids) and torch.equal(
        again.batch.loss_mask, batch.loss_mask
    )
    other, _, _ = _run(native, seed=1)
    assert not torch.equal(other.batch.response_ids, batch.response_ids)


def test_answer_texts_read_the_last_model_turn(native):
    tok, _, _ = native
    episodes, envs, _ = _run(native)
    answered = 0
    for r, (text, env, turns) in enumerate(zip(answer_texts(tok, episodes.batch), envs, episodes.turns)):
        if len(env.seen) == turns:  # the last turn ended with EOS and the environment read it
            answered += 1
            # the environment read the turn with specials kept; the reward reads it with them dropped
            # (this test's EOS set has ordinary characters, which the reward's decode keeps)
            own = episodes.batch.response_ids[r][episodes.batch.loss_mask[r]]
            ending = "" if int(own[-1]) == tok.eos_token_id else tok.decode([int(own[-1])])
            assert text == tok.decode(tok.encode(env.seen[-1]), skip_special_tokens=True) + ending
    assert answered


def test_token_budget_cuts_a_trajectory(native):
    tok, _, _ = native
    episodes, envs, examples = _run(native, max_total_tokens=16, max_new_tokens=6)
    batch = episodes.batch
    lengths = batch.response_mask.sum(-1) + batch.prompt_mask.sum(-1)
    assert int(lengths.max()) <= 16
    assert not all(episodes.finished)  # some trajectory ran out of tokens before its environment was done
    _check_token_in_token_out(tok, batch, envs, examples, n=2, eos=set(native[2].eos_token_ids))


def test_environment_that_raises_or_hangs(native):
    class Raising:
        def step(self, response):
            raise KeyError("bad state")

    release, answered = threading.Event(), []

    class Hanging:  # answers only once the test releases it: a rollout that waited for one would not return
        def step(self, response):
            release.wait(120)
            answered.append(1)

    with pytest.raises(EnvironmentStepError, match=r"test.jsonl:\d+ raised KeyError.*on_error=end"):
        _run(native, factory=lambda e: Raising())
    # a trajectory whose first turn ended (EOS) met the environment, which raised: it ends there
    episodes, _, _ = _run(native, factory=lambda e: Raising(), on_error="end")
    met = sum(episodes.finished) / len(episodes.finished)
    assert met > 0 and episodes.metrics["multi_turn/errors"] == met and all(t == 1 for t in episodes.turns)
    try:
        episodes, _, _ = _run(native, factory=lambda e: Hanging(), on_error="end", timeout=0.5)
        assert not answered and episodes.metrics["multi_turn/timeouts"] == sum(episodes.finished) / len(
            episodes.finished
        )
        # one worker, every step hangs: the steps queued behind the first time out too, without waiting for it
        episodes, _, _ = _run(native, factory=lambda e: Hanging(), on_error="end", timeout=0.2, workers=1)
        assert not answered and episodes.metrics["multi_turn/timeouts"] == sum(episodes.finished) / len(
            episodes.finished
        )
        with pytest.raises(EnvironmentStepError, match="did not answer within rollout.multi_turn.call_timeout_s=0.5"):
            _run(native, factory=lambda e: Hanging(), timeout=0.5)
        assert not answered
    finally:
        release.set()


def test_environment_must_return_an_observation(native):
    class Wrong:
        def step(self, response):
            return "a string"

    with pytest.raises(EnvironmentStepError, match="returned str, not an Observation"):
        _run(native, factory=lambda e: Wrong())


def test_a_prompt_longer_than_the_budget_is_an_error(native):
    with pytest.raises(ValueError, match="test.jsonl:2 fills rollout.multi_turn.max_total_tokens=9"):
        _run(native, max_total_tokens=9)


def test_single_turn_sample_is_generate(native):
    tok, _, rollout = native
    sampling = SamplingConfig(n=2, max_new_tokens=5)
    one = sample(rollout, _examples(tok), tok, sampling, seed=3).batch
    ref = rollout.generate([list(e.prompt_ids) for e in _examples(tok)], sampling, seed=3)
    assert torch.equal(one.response_ids, ref.response_ids) and one.loss_mask is None and one.turn_ids is None


# ------------------------------------------------------------------------------------------ the loss


def test_masked_tokens_change_nothing_in_the_gradient(native):
    """Tool output does not leak into the loss: a policy loss over a multi-turn batch has the same gradient
    when every non-model position's targets (advantages, old log-probs) are replaced by garbage, and when
    the observation tokens after the last model turn are replaced by other tokens. (Tokens the model
    reads before a later model turn condition that turn, so they matter, as they should.)"""
    tok, path, _ = native
    from backends.models import load_causal_lm

    model, _ = load_causal_lm(path)
    episodes, _, _ = _run(native)
    batch = episodes.batch
    # a trailing observation on every row (as an environment's last message would leave)
    tail = torch.tensor(observation_token_ids([{"role": "tool", "content": "99"}], tok))
    b, t = batch.response_ids.shape
    ids = torch.full((b, t + len(tail)), tok.pad_token_id)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    own = torch.zeros_like(mask)
    for r in range(b):
        n = int(batch.response_mask[r].sum())
        ids[r, :n], ids[r, n : n + len(tail)] = batch.response_ids[r, :n], tail
        mask[r, : n + len(tail)] = True
        own[r, :n] = batch.loss_mask[r, :n]
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(b, t + len(tail), generator=gen)
    old = -torch.rand(b, t + len(tail), generator=gen)

    def grads(response_ids, advantages, old_logprobs):
        model.zero_grad()
        full = torch.cat([batch.prompt_ids, response_ids], 1)
        attn = torch.cat([batch.prompt_mask, mask], 1)
        logits = model(input_ids=full, attention_mask=attn.long()).logits[:, batch.prompt_ids.shape[1] - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, response_ids[..., None]).squeeze(-1)
        loss, _ = rf.ppo_policy_loss(logp, old_logprobs=old_logprobs, advantages=advantages, response_mask=own)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    base = grads(ids, adv, old)
    garbage_targets = grads(ids, torch.where(own, adv, 1e3), torch.where(own, old, -7.0))
    tail_mask = mask & ~own & (torch.arange(ids.shape[1]) >= (batch.response_mask.sum(-1, keepdim=True)))
    other_tokens = grads(torch.where(tail_mask, torch.randint(4, 90, ids.shape, generator=gen), ids), adv, old)
    assert torch.equal(base, garbage_targets)
    torch.testing.assert_close(other_tokens, base, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------ SFT on traces and the task


def test_sft_conversations_train_on_assistant_turns_only(tmp_path):
    tok = build_char_tokenizer(words=calculator.TOKENIZER_WORDS)
    rows = list(calculator.sft_conversations([(123, 456)], 3, direct=0.0, wrong_operand=0.0, wrong_copy=0.0, seed=0))
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = load_sft_examples(SFTConfig(files=(str(tmp_path / "sft.jsonl"),), messages_key="messages"), tok)
    e = examples[0]
    pieces = tok.convert_ids_to_tokens(list(e.response_ids))
    trained = "".join(p for p, m in zip(pieces, e.loss_mask) if m)
    read = "".join(p for p, m in zip(pieces, e.loss_mask) if not m)
    assert trained == calculator.tool_call(123, 456) + "<eos>" + "56088<eos>"
    assert read == "<|tool|>56088<eos><|assistant|>"
    assert len(tok.encode(calculator.tool_call(123, 456))) == 11  # markers and the JSON's fixed text: one token each
    batch = sft_batch(examples, tok.pad_token_id)
    assert torch.equal(rf.loss_tokens(batch)[0, : len(e.loss_mask)], torch.tensor(e.loss_mask))
    logprobs = -torch.rand(batch.response_ids.shape)
    norms = rf.Normalizers(num_tokens=rf.loss_tokens(batch).sum().float(), num_seqs=torch.tensor(3.0))
    out = attrs.make_class("Out", ["logprobs"])(logprobs)
    loss, _ = nll_loss(out, batch, norms)
    assert float(loss) == pytest.approx(float(-(logprobs * rf.loss_tokens(batch)).sum() / rf.loss_tokens(batch).sum()))


def test_sft_conversation_errors_name_the_row(tmp_path):
    tok = build_char_tokenizer()
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(Exception, match=r"bad.jsonl:line 1: .*assistant turn"):
        load_sft_examples(SFTConfig(files=(str(tmp_path / "bad.jsonl"),), messages_key="messages"), tok)


def test_calculator_task_files_and_tool(tmp_path):
    out = calculator.write_dataset(tmp_path, calculator.CalculatorTask(num_train=500, num_heldout=50), sft_examples=400)
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    val = [json.loads(line) for line in (out / "val.jsonl").read_text().splitlines()]
    assert len(train) == 500 and len(val) == 50
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in val}
    a, b = map(int, val[0]["prompt"][0]["content"].rstrip("=").split("*"))
    assert val[0]["answer"] == str(a * b)
    env = ToolEnvironment({"multiply": calculator.multiply})
    assert env.step(calculator.tool_call(a, b)).messages[0]["content"] == str(a * b)
    sft = [json.loads(line) for line in (out / "sft.jsonl").read_text().splitlines()]
    correct = 0
    for row in sft:  # each trace is well formed; about a third of them end with the right product
        messages = row["messages"]
        a, b = map(int, messages[0]["content"].rstrip("=").split("*"))
        correct += messages[-1]["content"] == str(a * b)
        if len(messages) == 4:
            ((name, args),) = parse_tool_calls(messages[1]["content"])
            assert name == "multiply" and messages[2]["content"] == str(args["a"] * args["b"])
    assert 0.2 < correct / len(sft) < 0.55


# ------------------------------------------------------------------------------------------ the trainer reads the same


def _trainer_agreement(rank, world_size, model_dir):
    from backends.distributed.setup import init_distributed
    from backends.rollout.native import build_native_rollout
    from backends.training.fsdp import FSDPConfig, build_actor, compute_logprobs
    from backends.training.optim import OptimConfig

    env = init_distributed()
    tok = build_char_tokenizer()
    actor = build_actor(model_dir, env, OptimConfig(lr=1e-3, total_training_steps=1), FSDPConfig(micro_batch_size=3))
    rollout = build_native_rollout(model_dir, tok)
    rollout = attrs.evolve(
        rollout, eos_token_ids=(tok.eos_token_id, *tok.convert_tokens_to_ids(list("0123456789abcdefghij")))
    )
    envs = []

    def make(example):
        envs.append(ScriptedEnv())
        return envs[-1]

    examples = _examples(tok, ("1+2=", "12+34=") if rank == 0 else ("5*5=", "40-2=", "9="))
    episodes = run_episodes(
        rollout,
        examples,
        tok,
        SamplingConfig(n=2, max_new_tokens=6),
        MultiTurnConfig(max_turns=3, max_total_tokens=48),
        make,
        seed=rank,
    )
    batch = episodes.batch
    _check_token_in_token_out(tok, batch, envs, examples, n=2, eos=set(rollout.eos_token_ids))
    trainer = compute_logprobs(actor, batch).logprobs
    own = batch.loss_mask
    return (
        float((trainer - batch.rollout_logprobs).abs()[own].max()),
        max(episodes.turns),
        int((~own & batch.response_mask).sum()),
    )


@pytest.mark.distributed
def test_trainer_logprobs_of_multi_turn_trajectories_equal_the_rollouts(tmp_path):
    """2 gloo ranks, each with its own trajectories: the FSDP trainer's fp32 log-probs of every model token
    equal the native engine's within 1e-5, observation tokens between the turns included in what it reads."""
    from tests.distributed import run_distributed

    model_dir = write_tiny_model(tmp_path / "m", TINY, build_char_tokenizer())
    results = run_distributed(_trainer_agreement, 2, str(model_dir))
    assert all(turns > 1 and observed > 0 for _, turns, observed in results), results  # real multi-turn rows
    assert max(gap for gap, _, _ in results) < 1e-5, results


MALFORMED_TURNS = {
    "missing closing brace": '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}</tool_call>',
    "missing closing brace and marker": '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}',
    "closing marker without an opening one": '{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
    "a second opening before the close": (
        '<tool_call>{"name": "add"<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    ),
    "extra text after the JSON": '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}}</tool_call>',
    "arguments string cut short": '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2"}</tool_call>',
    "empty call": "<tool_call></tool_call>",
}


@pytest.mark.parametrize("name", MALFORMED_TURNS)
def test_every_malformed_tool_call_gets_an_error_observation(name):
    """A turn with a tool-call marker never ends the conversation silently: each malformed call is answered with an
    error message the model reads, and counted."""
    env = ToolEnvironment({"add": add})
    obs = env.step(MALFORMED_TURNS[name])
    assert not obs.done and obs.messages, name
    assert obs.metrics["tool_call_errors"] >= 1.0 and all(m["role"] == "tool" for m in obs.messages)
    assert any(m["content"].startswith("error: ") for m in obs.messages), obs.messages


def test_a_valid_call_beside_an_unclosed_one_answers_both():
    env = ToolEnvironment({"add": add})
    obs = env.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><tool_call>{"name": "add"')
    assert [m["content"] for m in obs.messages][0] == "5" and "not closed" in obs.messages[1]["content"]
    assert obs.metrics == {"tool_calls": 2.0, "tool_call_errors": 1.0}

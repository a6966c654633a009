"""Agents by base_url (backends/rollout/agents.py): the user's agent function, written with the ``openai`` client,
samples through a server of the run's in-process engine, and the batch holds exactly the tokens it sampled.

What it costs: one tiny in-process engine and an in-process server thread (no extra process) for the module; the
deadline test waits two seconds for its hung agent; the recipe test (slow) is two GRPO steps on a forked rank
(about 20 s, most of it the recipe's start-up); the learning run (slow, distributed) about 50 s on 2 quiet cores and up
to about two minutes under other work, half of it the SFT stage; its longer variant (long) about 2 minutes on quiet
cores.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter

import attrs
import httpx
import pytest
import torch

from backends.data import Example, prompt_token_ids
from backends.loop.sampling import score_batch
from backends.loop.vocabulary import RLConfig
from backends.models import TinyModelConfig, build_char_tokenizer, load_tokenizer, write_tiny_model
from backends.rewards import RewardScorer
from backends.rollout.agent_loop import sample
from backends.rollout.agents import AgentRunner, agent_runner
from backends.rollout.api import RolloutConfig, build_rollout
from backends.rollout.common import SamplingConfig
from tests.recipes import GRPO, TINY_MODEL, arithmetic_data, data_args, metrics, run, the_run_dir
from tests.test_recipe_multiturn import calculator_run
from tests.test_rollout_server import STRIP_REASONING_TEMPLATE

openai = pytest.importorskip("openai", reason="the agent tests talk through the openai client (the train extra)")

from experiments.agents.calculator_react import calculate, run_tool  # noqa: E402 (imports openai)

pytestmark = pytest.mark.service

TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=96, initializer_range=0.2
)

#: api key -> what each call of that trajectory returned: (prompt ids, sampled ids, log-probs)
CALLS: dict[str, list[tuple[list[int], list[int], list[float]]]] = {}
RELEASE = threading.Event()


def three_calls(row, *, base_url, api_key, model):
    """Three model calls, each answered by a message of the row's ``follow_up`` role (tool by default); returns a
    reward for the rows whose answer is 12."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [dict(m) for m in row["prompt"]]
    calls = []
    for i in range(3):
        reply = client.chat.completions.create(model=model, messages=messages, logprobs=True)
        choice = reply.choices[0]
        calls.append((reply.prompt_token_ids, choice.token_ids, [t.logprob for t in choice.logprobs.content]))
        messages += [
            {"role": "assistant", "content": choice.message.content},
            {"role": row.get("follow_up", "tool"), "content": f"r{i}"},
        ]
    CALLS[api_key] = calls
    return 0.5 if row["ground_truth"] == "12" else None


def _sampled_rows(batch) -> list[str]:
    """Each row as (every id the trainer reads, the ids that carry loss, their log-probs), as JSON."""
    rows = []
    for r in range(batch.response_ids.shape[0]):
        prompt = batch.prompt_ids[r][batch.prompt_mask[r]].tolist()
        response = batch.response_ids[r][batch.response_mask[r]].tolist()
        loss = batch.loss_mask[r][batch.response_mask[r]].tolist()
        logprobs = batch.rollout_logprobs[r][batch.response_mask[r]].tolist()
        sampled = [t for t, m in zip(response, loss) if m]
        rows.append(json.dumps([prompt + response, sampled, [lp for lp, m in zip(logprobs, loss) if m]]))
        assert [lp for lp, m in zip(logprobs, loss) if not m] == [0.0] * (len(loss) - sum(loss))
    return rows


def _agents_calls() -> list[str]:
    """Each recorded trajectory as (the last call's prompt and reply, every reply's ids, their log-probs)."""
    seen = []
    for calls in CALLS.values():
        last_prompt, last_ids, _ = calls[-1]
        for earlier, later in zip(calls, calls[1:]):  # each call read the one before it, as sampled
            assert later[0][: len(earlier[0]) + len(earlier[1])] == earlier[0] + earlier[1]
        seen.append(
            json.dumps([last_prompt + last_ids, sum((c[1] for c in calls), []), sum((c[2] for c in calls), [])])
        )
    return seen


def misbehaving(row, *, base_url, api_key, model):
    kind = row["behaviour"]
    if kind == "raise":
        raise RuntimeError("the agent's own bug")
    if kind == "silent":
        return 1.0  # a reward without a single model call
    if kind == "hang":
        RELEASE.wait(30)
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model=model, messages=row["prompt"], max_tokens=3)
    return None


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = write_tiny_model(tmp_path_factory.mktemp("agents") / "model", TINY, build_char_tokenizer())
    tokenizer = load_tokenizer(model_dir)
    return build_rollout(RolloutConfig(), model_dir, tokenizer), tokenizer


def _examples(tokenizer, answers, behaviours=None):
    out = []
    for i, answer in enumerate(answers):
        messages = [{"role": "user", "content": f"{i}+{answer}="}]
        columns = {"behaviour": behaviours[i]} if behaviours else {}
        out.append(
            Example(
                prompt_ids=tuple(prompt_token_ids(messages, tokenizer)),
                ground_truth=answer,
                source="test",
                columns=columns,
                where=f"row {i}",
                prompt=messages,
            )
        )
    return out


def test_the_batch_holds_exactly_the_tokens_the_agents_sampled(engine):
    rollout, tokenizer = engine
    runner = AgentRunner(fn=three_calls, deadline_s=60.0, workers=4)
    CALLS.clear()
    try:
        episodes = sample(
            rollout,
            _examples(tokenizer, ["12", "30"]),
            tokenizer,
            SamplingConfig(n=2, max_new_tokens=5),
            seed=3,
            environments=runner,
            group_ids=torch.tensor([7, 8]),
        )
    finally:
        runner.close()
    batch = episodes.batch
    assert batch.group_ids.tolist() == [7, 7, 8, 8] and len(CALLS) == 4
    assert episodes.metrics["agent/dropped"] == 0.0 and episodes.metrics["agent/calls"] == 3.0
    assert episodes.given_rewards == [0.5, 0.5, None, None]
    for r in range(4):
        assert batch.turn_ids[r][batch.response_mask[r]].max().item() == 2
    assert Counter(_sampled_rows(batch)) == Counter(_agents_calls())


def test_exact_tokens_through_a_chat_template_that_strips_earlier_reasoning(engine, tmp_path):
    """The run's chat template renders a reply before the last user message without its reasoning (here: all of
    it), so a re-rendered history never starts with the sampled ids; the batch still holds exactly those."""
    rollout, tokenizer = engine
    template = tmp_path / "strip_reasoning.jinja"
    template.write_text(STRIP_REASONING_TEMPLATE)
    runner = agent_runner(
        "tests.test_rollout_agents:three_calls", deadline_s=60.0, workers=4, chat_template=str(template)
    )
    examples = [attrs.evolve(e, columns={"follow_up": "user"}) for e in _examples(tokenizer, ["5", "6"])]
    CALLS.clear()
    try:
        episodes = runner.sample(rollout, examples, tokenizer, SamplingConfig(n=2, max_new_tokens=5), seed=9)
        reused = httpx.get(
            runner.server.url + "/stats", headers={"Authorization": f"Bearer {runner.server.policy.trainer_token}"}
        ).json()
    finally:
        runner.close()
    assert episodes.metrics["agent/dropped"] == 0.0 and reused["agent/prefix_reused"] == 8  # 2 later calls x 4
    assert Counter(_sampled_rows(episodes.batch)) == Counter(_agents_calls())


def test_the_same_seed_samples_the_same_trajectories_whatever_order_the_threads_call_in(engine):
    rollout, tokenizer = engine
    batches = []
    for workers in (1, 4):  # one at a time, then interleaved
        runner = AgentRunner(fn=three_calls, deadline_s=60.0, workers=workers)
        try:
            batches.append(
                runner.sample(
                    rollout, _examples(tokenizer, ["3"]), tokenizer, SamplingConfig(n=4, max_new_tokens=4), seed=5
                )
            )
        finally:
            runner.close()
    for name in ("prompt_ids", "response_ids", "loss_mask", "turn_ids"):
        assert torch.equal(getattr(batches[0].batch, name), getattr(batches[1].batch, name)), name
    # four threads' calls share engine calls, one thread's run alone: a batch of another shape may round the
    # log-probs differently, never the sampled tokens (backends/rollout/server_batching.py)
    torch.testing.assert_close(batches[0].batch.rollout_logprobs, batches[1].batch.rollout_logprobs, rtol=0, atol=1e-5)


def test_agents_that_raise_hang_or_never_call_are_counted_and_dropped(engine, caplog):
    rollout, tokenizer = engine
    caplog.set_level(logging.WARNING, logger="rlfunc.agents")
    RELEASE.clear()
    runner = AgentRunner(fn=misbehaving, deadline_s=2.0, workers=4)
    examples = _examples(tokenizer, ["1", "2", "3", "4"], ["ok", "raise", "silent", "hang"])
    try:
        episodes = runner.sample(rollout, examples, tokenizer, SamplingConfig(n=1, max_new_tokens=4), seed=0)
    finally:
        RELEASE.set()
        runner.close()
    m = episodes.metrics
    assert (m["agent/errors"], m["agent/no_calls"], m["agent/timeouts"], m["agent/dropped"]) == (0.25, 0.25, 0.25, 0.75)
    kept = episodes.batch.response_mask.any(-1).tolist()
    assert kept == [True, False, False, False] and episodes.finished == kept
    assert not episodes.batch.loss_mask[1:].any() and episodes.given_rewards == [None] * 4
    assert (
        "2 of 4 agent trajectories failed and were dropped; the first, of row 1: RuntimeError: the agent's own bug"
        in (caplog.text)
    )


def test_an_agents_reward_replaces_the_reward_functions_score(engine):
    rollout, tokenizer = engine
    cfg = RLConfig()
    cfg = attrs.evolve(cfg, reward=attrs.evolve(cfg.reward, fn=("arithmetic",)))
    scorer = RewardScorer(cfg.reward)
    examples = _examples(tokenizer, ["12", "30"])
    batch = rollout.generate([list(e.prompt_ids) for e in examples], SamplingConfig(n=1, max_new_tokens=3), seed=0)
    try:
        plain, _ = score_batch(batch, examples, scorer, tokenizer, cfg, rollout.eos_token_ids)
        given, _ = score_batch(
            batch, examples, scorer, tokenizer, cfg, rollout.eos_token_ids, given_rewards=[0.75, None]
        )
    finally:
        scorer.close()
    assert given.scores.tolist() == [0.75, plain.scores[1].item()]


def test_a_bad_agent_reference_fails_at_start_up():
    with pytest.raises(Exception, match="rollout.agent"):
        agent_runner("experiments/agents/calculator_react.py:walk", deadline_s=1.0, workers=1)


def test_the_calculator_tool_parses_arithmetic_and_never_evaluates():
    assert calculate("3*(4+5)-10/3") == 24 and calculate("-2*-3") == 6
    assert run_tool('{"name": "multiply", "arguments": {"a": 347, "b": 291}}') == "100977"
    assert run_tool('{"name": "calculate", "arguments": {"expression": "__import__(\'os\')"}}').startswith("error:")
    assert run_tool("not json").startswith("error: JSONDecodeError")


@pytest.mark.slow
def test_grpo_steps_through_the_react_agent(tmp_path):
    """The recipe with rollout.agent: the ReAct agent's trajectories are the batch of each step (no SFT stage, so
    the tiny model never calls the tool: one call per trajectory)."""
    data = arithmetic_data(tmp_path / "data")
    out = run(
        GRPO,
        f"run_root={tmp_path / 'runs'}",
        *data_args(data, sft_steps=0),
        *TINY_MODEL,
        "steps=2",
        "prompts_per_step=4",
        "rollout.n=2",
        "eval.every=0",
        "eval.max_prompts=4",
        "export.hf=false",
        "rollout.agent=experiments/agents/calculator_react.py:run",
        "rollout.agent_deadline_s=60",
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = metrics(the_run_dir(tmp_path / "runs", "grpo"))
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["agent/calls"] >= 1.0 and r["agent/dropped"] == 0.0 for r in rows)


@pytest.mark.slow
@pytest.mark.distributed
def test_grpo_through_the_react_agent_learns_the_calculator(tmp_path):
    """The calculator preset's SFT stage on noisy tool-use traces, then 12 GRPO steps of 8 prompts x 8 trajectories
    that are the ReAct agent's (experiments/agents/calculator_react.py, the openai client, its own tool), its calls
    sharing engine calls on the server: held-out success (64 prompts, 4 samples each) rises by 15 points or more.
    Seeds 0, 1 and 2 rose by 34, 24 and 27 points. (test_recipe_multiturn.py runs the preset with the built-in tool
    environment.)"""
    summary, rows = calculator_run(
        tmp_path,
        "rollout.agent=experiments/agents/calculator_react.py:run",
        "rollout.multi_turn.max_turns=1",
        "steps=12",
        "prompts_per_step=8",
    )
    assert summary["eval_after"] >= summary["eval_before"] + 0.15, summary
    assert len(rows) == 12 and all(r["agent/dropped"] == 0.0 for r in rows)
    assert rows[-1]["agent/calls"] > 1.5  # it calls the tool, then answers


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.distributed
def test_a_longer_grpo_run_through_the_react_agent_learns_more(tmp_path):
    """The same through 40 steps of 16 prompts x 8 trajectories: held-out success rises by 30 points or more and ends
    at 0.6 or more (seed 0: 0.266 -> 0.707 and 0.715 in two runs, against 0.609 after the short run)."""
    summary, rows = calculator_run(
        tmp_path,
        "rollout.agent=experiments/agents/calculator_react.py:run",
        "rollout.multi_turn.max_turns=1",
        "steps=40",
        timeout=900,
    )
    assert summary["eval_after"] >= summary["eval_before"] + 0.3 and summary["eval_after"] >= 0.6, summary
    assert len(rows) == 40 and all(r["agent/dropped"] == 0.0 for r in rows)

"""The agent loop: multi-turn trajectories of a batch of prompts, token in and token out.

Each prompt gets ``sampling.n`` trajectories. Turn by turn, the engine continues every live trajectory by one
model turn (:meth:`backends.rollout.engine.Session.continue_turn`: the native engine keeps each row's KV cache, vLLM
reuses its prefix cache), the environments answer the turns that ended (concurrently, each step under
``multi_turn.call_timeout_s``), and their answers become the next turn's forced tokens
(:func:`backends.rollout.environments.observation_token_ids`). A trajectory ends when its environment says
done, at ``multi_turn.max_turns`` model turns, or at ``multi_turn.max_total_tokens`` tokens. An engine with a
:class:`~backends.rollout.engine.TurnStream` (the native engine with continuous batching, an in-process vLLM engine
of one rank) runs the same turns without the lock-step: a trajectory's next turn starts as soon as its environment
answered, while the others are still in theirs.

The result is an ordinary :class:`rlfunc.RolloutBatch` whose response holds every token after the prompt:
``response_mask`` marks them all (the trainer reads them), ``loss_mask`` the model's own (sampled) tokens only,
``turn_ids`` the turn each token belongs to (a turn: the observation that precedes it, then the model's reply),
``rollout_logprobs`` the sampled tokens' log-probs (0 elsewhere), ``token_rewards`` each turn's environment
reward on that turn's last model token (:func:`rlfunc.turn_rewards_to_tokens`). The trainer's input ids are
exactly the sampled and observation tokens; no text is re-tokenised. A reward function reads the last model
turn (:func:`backends.rollout.common.answer_texts`).

:func:`sample` is what a recipe calls: ``generate`` when ``multi_turn.max_turns`` is 1, else the agent loop.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import time
from typing import Any, Callable, Sequence

import attrs
import torch

from backends.data import Example
from backends.rollout.common import SamplingConfig, assemble_batch, left_pad
from backends.rollout.engine import RolloutEngine, TurnStream
from backends.rollout.environments import Environment, MultiTurnConfig, Observation, observation_token_ids
from rlfunc.batch import RolloutBatch
from rlfunc.turns import turn_rewards_to_tokens

__all__ = ["EnvironmentStepError", "Episodes", "run_episodes", "sample"]


class EnvironmentStepError(RuntimeError):
    """An environment step that raised or did not return in time (``multi_turn.on_error=error``)."""


@attrs.frozen
class Episodes:
    """A batch of multi-turn trajectories and what happened in them."""

    batch: RolloutBatch  #: see the module doc
    turn_rewards: list[list[float]]  #: each trajectory's per-turn environment rewards
    turns: list[int]  #: model turns per trajectory
    #: the environment ended the trajectory (done, or a turn it did not answer) before a budget cut it
    finished: list[bool]
    #: per trajectory, averaged over the batch: multi_turn/turns, multi_turn/finished and the environments'
    #: own metrics as multi_turn/<name> (tool_calls, tool_call_errors, errors, timeouts), plus
    #: multi_turn/tool_call_validity (the share of tool calls that ran)
    metrics: dict[str, float]
    #: per trajectory: the reward its agent returned (backends.rollout.agents), which replaces the reward
    #: functions' score; None: the reward functions score it. None for the whole batch without agents.
    given_rewards: list[float | None] | None = None


def sample(
    rollout: RolloutEngine,
    examples: Sequence[Example],
    tokenizer: Any,
    sampling: SamplingConfig,
    *,
    seed: int,
    multi_turn: MultiTurnConfig = MultiTurnConfig(),
    environments: Callable[[Example], Environment] | None = None,
    group_ids: torch.Tensor | None = None,
    chat_template: str = "auto",
) -> Episodes:
    """``sampling.n`` samples of each example: one response (``multi_turn.max_turns`` 1), or a multi-turn
    trajectory through ``environments(example)`` (:func:`run_episodes`), or, when ``environments`` is the run's
    agents (:class:`backends.rollout.agents.AgentRunner`: it has a ``sample`` method), their trajectories."""
    agents = getattr(environments, "sample", None)
    if agents is not None:
        return agents(rollout, examples, tokenizer, sampling, seed=seed, group_ids=group_ids)
    if multi_turn.max_turns == 1:
        batch = rollout.generate([list(e.prompt_ids) for e in examples], sampling, seed=seed, group_ids=group_ids)
        rows = len(examples) * sampling.n
        # what an engine of servers reports of them (its restarts); the in-process engines have no such method
        server_metrics = getattr(rollout, "server_metrics", None)
        metrics = server_metrics() if server_metrics is not None else {}
        return Episodes(
            batch=batch,
            turn_rewards=[[] for _ in range(rows)],
            turns=[1] * rows,
            finished=[True] * rows,
            metrics=metrics,
        )
    if environments is None:
        raise ValueError("multi-turn sampling (rollout.multi_turn.max_turns > 1) needs an environment factory")
    return run_episodes(
        rollout,
        examples,
        tokenizer,
        sampling,
        multi_turn,
        environments,
        seed=seed,
        chat_template=chat_template,
        group_ids=group_ids,
    )


def run_episodes(
    rollout: RolloutEngine,
    examples: Sequence[Example],
    tokenizer: Any,
    sampling: SamplingConfig,
    cfg: MultiTurnConfig,
    factory: Callable[[Example], Environment],
    *,
    seed: int,
    chat_template: str = "auto",
    group_ids: torch.Tensor | None = None,
) -> Episodes:
    """Trajectories of ``examples`` (``sampling.n`` each, rows in ``generate``'s order); see the module doc.

    ``sampling.max_new_tokens`` bounds each model turn, ``cfg.max_total_tokens`` the whole trajectory. Every
    turn calls the engine, with or without live rows: a tensor-parallel vLLM engine needs its ranks in step.
    """
    prompts = [list(e.prompt_ids) for e in examples]
    rows = [examples[i] for i in range(len(examples)) for _ in range(sampling.n)]
    if not rows:
        raise ValueError("run_episodes needs at least one example")
    budget = [cfg.max_total_tokens - len(list(e.prompt_ids)) for e in rows]
    if min(budget) < 1:
        worst = rows[budget.index(min(budget))]
        raise ValueError(
            f"the prompt of {worst.where} fills rollout.multi_turn.max_total_tokens={cfg.max_total_tokens} on its own"
        )
    envs = [factory(e) for e in rows]
    # the native engine advances every row one cache slot per step, so a batch's turns can take up to
    # max_turns x the budget slots; both engines need the prompt plus the slots to fit their context
    slots = min(cfg.max_turns * max(budget), rollout.max_context - max(len(p) for p in prompts))
    state = _Rows(len(rows), rollout.eos_token_ids)
    start_stream = getattr(rollout, "start_turn_stream", None)
    stream = start_stream(prompts, sampling, seed=seed, max_slots=slots) if start_stream is not None else None
    if stream is not None:
        calls = _EnvironmentCalls(envs, rows, cfg)
        try:
            observe = functools.partial(observation_token_ids, tokenizer=tokenizer, chat_template=chat_template)
            _stream_episodes(stream, calls, state, budget, sampling, cfg, tokenizer, observe)
        finally:
            calls.shutdown()
            stream.end()
        return state.episodes(prompts, sampling, rollout.pad_token_id, group_ids)
    session = rollout.start_session(prompts, sampling, seed=seed, max_slots=slots)
    forced: list[list[int]] = [[] for _ in rows]
    calls = _EnvironmentCalls(envs, rows, cfg)
    try:
        for turn in range(cfg.max_turns):
            # a trajectory whose observation alone would exhaust its budget is cut here
            active = [state.live[r] and budget[r] > len(forced[r]) for r in range(len(rows))]
            state.cut([r for r in range(len(rows)) if state.live[r] and not active[r]])
            forced = [f if is_active else [] for f, is_active in zip(forced, active)]
            limits = [
                min(budget[r] - len(forced[r]), sampling.max_new_tokens) if active[r] else 0 for r in range(len(rows))
            ]
            session, out = session.continue_turn(forced, active=active, max_new_tokens=limits)
            state.record(out, turn, active)
            forced = [[] for _ in rows]
            for r in range(len(rows)):
                budget[r] -= len(out.tokens[r])
            # a token limit ended the turn
            state.cut([r for r in range(len(rows)) if active[r] and not out.finished[r]])
            answered = [r for r in range(len(rows)) if active[r] and out.finished[r]]
            for r in answered:
                calls.submit(r, state.turn_text(r, tokenizer))
            while calls.pending:
                calls.collect(block=True)
            for r, obs in sorted(calls.take().items()):
                state.observe(r, obs)
                if obs.done or not obs.messages:
                    state.end(r, finished=True)
                elif turn + 1 == cfg.max_turns:
                    state.end(r, finished=False)  # out of turns while the environment still had something to say
                else:
                    forced[r] = observation_token_ids(obs.messages, tokenizer, chat_template=chat_template)
    finally:
        calls.shutdown()
        session.end()
    return state.episodes(prompts, sampling, rollout.pad_token_id, group_ids)


def _stream_episodes(
    stream: TurnStream,
    calls: "_EnvironmentCalls",
    state: "_Rows",
    budget: list[int],
    sampling: SamplingConfig,
    cfg: MultiTurnConfig,
    tokenizer: Any,
    observe: Callable[[Any], list[int]],
) -> None:
    """:func:`run_episodes` over an engine's :class:`TurnStream`: the same turns, limits and endings as the
    turn-by-turn loop, but a row's environment is called as soon as its turn ended and its next turn starts as soon
    as the answer is there, while the engine steps the rows still in theirs."""

    def begin_turn(r: int, forced: list[int]) -> None:
        if budget[r] <= len(forced):  # its observation alone would exhaust its budget
            state.cut([r])
            stream.close(r)
            return
        stream.resume(r, forced, min(budget[r] - len(forced), sampling.max_new_tokens))

    for r in range(len(budget)):
        begin_turn(r, [])
    while stream.busy or calls.pending:
        for turn in stream.step() if stream.busy else []:
            r = turn.row
            state.record_row(r, turn.tokens, turn.logprobs, turn.sampled, state.turns[r])
            budget[r] -= len(turn.tokens)
            if turn.finished:
                calls.submit(r, state.turn_text(r, tokenizer))
            else:  # a token limit ended the turn
                state.cut([r])
                stream.close(r)
        calls.collect(block=not stream.busy)
        for r, obs in sorted(calls.take().items()):
            state.observe(r, obs)
            if obs.done or not obs.messages:
                state.end(r, finished=True)
                stream.close(r)
            elif state.turns[r] == cfg.max_turns:
                state.end(r, finished=False)  # out of turns while the environment still had something to say
                stream.close(r)
            else:
                begin_turn(r, observe(obs.messages))


class _EnvironmentCalls:
    """Environment steps of model turns that ended, run concurrently on ``cfg.workers`` threads, each within
    ``cfg.call_timeout_s`` of starting. A step still queued behind hung ones times out too, once the steps ahead
    of it could have run (``call_timeout_s`` per round of ``cfg.workers`` steps, plus one), so this never waits
    without bound."""

    def __init__(self, envs: list[Environment], examples: list[Example], cfg: MultiTurnConfig) -> None:
        self.envs, self.examples, self.cfg = envs, examples, cfg
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=cfg.workers)
        self.started: dict[int, float] = {}
        self.queue_deadline: dict[Any, float] = {}
        self.futures: dict[Any, int] = {}  #: pending step -> its row
        self.answers: dict[int, Observation] = {}

    @property
    def pending(self) -> bool:
        return bool(self.futures)

    def submit(self, r: int, text: str) -> None:
        def step() -> Any:
            self.started[r] = time.monotonic()
            return self.envs[r].step(text)

        self.started.pop(r, None)
        rounds = math.ceil((len(self.futures) + 1) / self.cfg.workers) + 1
        future = self.pool.submit(step)
        self.futures[future] = r
        self.queue_deadline[future] = time.monotonic() + self.cfg.call_timeout_s * rounds

    def collect(self, *, block: bool) -> None:
        """Gather the steps that answered or ran out of time; ``block``: wait until at least one did."""
        while self.futures:
            deadlines = {
                f: self.started[r] + self.cfg.call_timeout_s if r in self.started else self.queue_deadline[f]
                for f, r in self.futures.items()
            }
            timeout = max(0.0, min(deadlines.values()) - time.monotonic()) if block else 0.0
            done, _ = concurrent.futures.wait(
                self.futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )
            now = time.monotonic()
            gathered = False
            for f in list(self.futures):
                r = self.futures[f]
                if f in done:
                    try:
                        answer = f.result()
                    except Exception as e:
                        answer = _failed(self.cfg, self.examples[r], f"raised {type(e).__name__}: {e}", "errors")
                elif now >= deadlines[f]:
                    f.cancel()  # a queued step never starts; a running one is left to finish on its own
                    answer = _failed(
                        self.cfg,
                        self.examples[r],
                        f"did not answer within rollout.multi_turn.call_timeout_s={self.cfg.call_timeout_s:g}",
                        "timeouts",
                    )
                else:
                    continue
                del self.futures[f], self.queue_deadline[f]
                if not isinstance(answer, Observation):
                    raise EnvironmentStepError(
                        f"the environment of {self.examples[r].where} returned {type(answer).__name__}, not an "
                        "Observation"
                    )
                self.answers[r] = answer
                gathered = True
            if gathered or not block:
                return

    def take(self) -> dict[int, Observation]:
        """The answers gathered since the last call, by row."""
        answers, self.answers = self.answers, {}
        return answers

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _failed(cfg: MultiTurnConfig, example: Example, what: str, metric: str) -> Observation:
    if cfg.on_error == "error":
        raise EnvironmentStepError(
            f"the environment of {example.where} {what} (rollout.multi_turn.on_error=end ends such "
            "trajectories and counts them instead)"
        )
    return Observation(done=True, metrics={metric: 1.0})


class _Rows:
    """Per trajectory: the tokens after the prompt, which were sampled, their log-probs and turns, and the
    environment's answers."""

    def __init__(self, count: int, eos_token_ids: Sequence[int]) -> None:
        self.eos = set(int(i) for i in eos_token_ids)
        self.tokens: list[list[int]] = [[] for _ in range(count)]
        self.sampled: list[list[bool]] = [[] for _ in range(count)]
        self.logprobs: list[list[float]] = [[] for _ in range(count)]
        self.turn: list[list[int]] = [[] for _ in range(count)]
        self.last_turn: list[list[int]] = [[] for _ in range(count)]
        self.live = [True] * count
        self.finished = [False] * count
        self.turn_rewards: list[list[float]] = [[] for _ in range(count)]
        self.turns = [0] * count
        #: per row, the environment's metrics of each answer: summed in row order, whenever the answers came
        self.row_metrics: list[list[Any]] = [[] for _ in range(count)]

    def end(self, r: int, *, finished: bool) -> None:
        self.live[r], self.finished[r] = False, finished

    def cut(self, rows: list[int]) -> None:
        for r in rows:
            self.end(r, finished=False)

    def record(self, out: Any, turn: int, active: list[bool]) -> None:
        for r, is_active in enumerate(active):
            if is_active:
                self.record_row(r, out.tokens[r], out.logprobs[r], out.sampled[r], turn)

    def record_row(self, r: int, tokens: list[int], logprobs: list[float], sampled: list[bool], turn: int) -> None:
        self.tokens[r] += tokens
        self.sampled[r] += sampled
        self.logprobs[r] += logprobs
        self.turn[r] += [turn] * len(tokens)
        self.last_turn[r] = [t for t, s in zip(tokens, sampled) if s]
        self.turns[r] += 1

    def turn_text(self, r: int, tokenizer: Any) -> str:
        """The model's latest turn as the environment reads it: markers such as ``<tool_call>`` kept (they may be
        special tokens), the end-of-turn token dropped."""
        return tokenizer.decode([t for t in self.last_turn[r] if t not in self.eos], skip_special_tokens=False)

    def observe(self, r: int, obs: Observation) -> None:
        self.turn_rewards[r].append(float(obs.reward))
        self.row_metrics[r].append(obs.metrics)

    def episodes(
        self, prompts: list[list[int]], sampling: SamplingConfig, pad: int, group_ids: torch.Tensor | None
    ) -> Episodes:
        b, t = len(self.tokens), max(1, max(len(x) for x in self.tokens))
        response_ids = torch.full((b, t), pad, dtype=torch.long)
        response_mask = torch.zeros((b, t), dtype=torch.bool)
        loss_mask = torch.zeros((b, t), dtype=torch.bool)
        logprobs = torch.zeros((b, t), dtype=torch.float32)
        turn_ids = torch.zeros((b, t), dtype=torch.long)
        for r in range(b):
            n = len(self.tokens[r])
            response_ids[r, :n] = torch.tensor(self.tokens[r], dtype=torch.long)
            response_mask[r, :n] = True
            loss_mask[r, :n] = torch.tensor(self.sampled[r], dtype=torch.bool)
            logprobs[r, :n] = torch.tensor(self.logprobs[r], dtype=torch.float32)
            turn_ids[r, :n] = torch.tensor(self.turn[r], dtype=torch.long)
        prompt_ids, prompt_mask = left_pad(prompts, pad)
        k = max(1, max(len(x) for x in self.turn_rewards))
        rewards = torch.tensor([x + [0.0] * (k - len(x)) for x in self.turn_rewards], dtype=torch.float32)
        token_rewards = turn_rewards_to_tokens(rewards, turn_ids=turn_ids, loss_mask=loss_mask)
        batch = assemble_batch(
            prompt_ids, prompt_mask, response_ids, response_mask, logprobs, n=sampling.n, group_ids=group_ids
        ).replace(loss_mask=loss_mask, turn_ids=turn_ids, token_rewards=token_rewards)
        totals = {"errors": 0.0, "timeouts": 0.0}
        for answers in self.row_metrics:
            for metrics in answers:
                for key, value in metrics.items():
                    totals[key] = totals.get(key, 0.0) + float(value)
        metrics = {f"multi_turn/{key}": value / b for key, value in totals.items()}
        metrics["multi_turn/turns"] = sum(self.turns) / b
        metrics["multi_turn/finished"] = sum(self.finished) / b
        if "tool_calls" in totals:
            metrics["multi_turn/tool_call_validity"] = 1.0 - totals.get("tool_call_errors", 0.0) / max(
                totals["tool_calls"], 1.0
            )
        return Episodes(
            batch=batch, turn_rewards=self.turn_rewards, turns=self.turns, finished=self.finished, metrics=metrics
        )

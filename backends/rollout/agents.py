"""Agents by base_url: a user's agent function talks to the policy through an OpenAI-compatible endpoint, and the
trainer gets the exact tokens it sampled.

``rollout.agent=path/to/my_agent.py:run`` names a function ::

    def run(row: dict, *, base_url: str, api_key: str, model: str) -> float | None

called once per trajectory (``rollout.n`` per prompt) with the data row (its columns, ``prompt`` as the row gives
it and ``ground_truth``), and a ``base_url`` / ``api_key`` / ``model`` for the ``openai`` client (or any framework
that speaks its chat API). The key identifies the trajectory: the rollout server
(:mod:`backends.rollout.server`) records the exact prompt ids, sampled ids, log-probs and policy version of every
call made with it (:mod:`backends.rollout.trajectories`). The function returns the trajectory's reward, or None
to leave it to the reward functions (which score the last reply, as with environments).

The agents run in threads (``rollout.agent_workers`` at a time), each under ``rollout.agent_deadline_s`` from its
start; the server refuses a trajectory's calls after its deadline. A trajectory whose agent raised, did not return
in time, never called the model, or sent a history the record no longer holds (``agent/prefix_mismatch``) is
dropped: it stays a row of the batch (so every rank's batch keeps its shape) with no response token, so it carries
no loss, and it is counted (``agent/errors``, ``agent/timeouts``, ``agent/no_calls``, ``agent/prefix_mismatch``;
``agent/dropped`` in all). Its score still enters its group's statistics as the reward functions give an empty
answer.

The trajectories become a :class:`rlfunc.RolloutBatch` as the agent loop's do
(:mod:`backends.rollout.agent_loop`): prompt = the first call's prompt ids; response = every later id, with
``loss_mask`` on the sampled ids only, ``turn_ids`` the call each id belongs to, ``rollout_logprobs`` the sampled
ids' log-probs (0 elsewhere).

An in-process engine is served by a :class:`backends.rollout.server.ThreadedServer` of this process, started on
the first step: the loop keeps syncing that engine's weights as before, and the server samples with the engine
value of the current step.
"""

from __future__ import annotations

import logging
import math
import queue
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs
import torch

from backends.config import resolve_function
from backends.data import Example
from backends.rollout import server_client
from backends.rollout.agent_loop import Episodes
from backends.rollout.common import SamplingConfig, assemble_batch, left_pad

__all__ = ["AgentRunner", "agent_row", "agent_runner", "run_agents"]

#: the outcomes of a trajectory that drop it, counted as agent/<name>
DROPS = ("errors", "timeouts", "no_calls", "prefix_mismatch")


def agent_row(example: Example) -> dict[str, Any]:
    """What an agent function receives of a data row: its columns, ``prompt`` and ``ground_truth``."""
    return {**dict(example.columns), "prompt": example.prompt, "ground_truth": example.ground_truth}


log = logging.getLogger("rlfunc.agents")


@attrs.define
class _Outcome:
    reward: float | None = None
    failure: str | None = None  #: one of DROPS, or None
    error: str | None = None  #: what the agent raised
    started: float | None = None
    done: bool = False


def _call_agent(fn: Callable, row: dict, url: str, key: str, model: str, outcome: _Outcome, deadline_s: float) -> None:
    try:
        reward = fn(row, base_url=url + "/v1", api_key=key, model=model)
        if reward is not None:
            reward = float(reward)
            if not math.isfinite(reward):
                raise ValueError(f"the agent returned a reward of {reward}")
        outcome.reward = reward
    except Exception as e:
        late = outcome.started is not None and time.monotonic() > outcome.started + deadline_s
        outcome.failure, outcome.error = ("timeouts" if late else "errors"), f"{type(e).__name__}: {e}"
    outcome.done = True


def run_agents(
    url: str,
    token: str,
    examples: Sequence[Example],
    fn: Callable[..., float | None],
    *,
    n: int,
    deadline_s: float,
    workers: int,
    model: str,
    pad_token_id: int,
    group_ids: torch.Tensor | None = None,
    id_prefix: str | None = None,
    served: Any = None,
) -> Episodes:
    """``n`` trajectories of each of ``examples`` by ``fn`` against the server at ``url`` (rows in ``generate``'s
    order); see the module doc. ``token``: the server's trainer token (registers and reads the trajectories);
    ``served``: the :class:`~backends.rollout.server.ServedPolicy` when that server runs in this process (the trainer
    opens and reads back the trajectories without HTTP; the agents still call it at ``url``)."""
    if not examples:
        raise ValueError("run_agents needs at least one example")
    prefix = id_prefix or secrets.token_hex(6)
    rows = [examples[i] for i in range(len(examples)) for _ in range(n)]
    ids = [f"{prefix}-{r}" for r in range(len(rows))]
    outcomes = [_Outcome() for _ in rows]
    todo: queue.Queue[int] = queue.Queue()
    for r in range(len(rows)):
        todo.put(r)
    cancelled = threading.Event()
    ours: list[BaseException] = []  # a registration the server refused: the run's fault, not the agent's

    def worker() -> None:
        while not cancelled.is_set():
            try:
                r = todo.get_nowait()
            except queue.Empty:
                return
            outcomes[r].started = time.monotonic()  # before registering: the wait below counts it as running
            try:
                key = _open(url, token, ids[r], deadline_s, served)
            except Exception as e:
                ours.append(e)
                outcomes[r].failure, outcomes[r].done = "errors", True
                cancelled.set()
                return
            _call_agent(fn, agent_row(rows[r]), url, key, model, outcomes[r], deadline_s)

    # daemon threads: an agent that hangs past its deadline is left behind without holding up the process's exit
    threads = [threading.Thread(target=worker, daemon=True, name=f"agent-{i}") for i in range(min(workers, len(rows)))]
    for thread in threads:
        thread.start()
    queue_deadline = time.monotonic() + deadline_s * (math.ceil(len(rows) / len(threads)) + 1)
    while not all(o.done for o in outcomes):
        now = time.monotonic()
        running = [o for o in outcomes if not o.done and o.started is not None]
        if now > queue_deadline or (todo.empty() and all(now > o.started + deadline_s for o in running)):
            break
        time.sleep(0.01)
    cancelled.set()
    if ours:
        raise ours[0]
    # what each agent did, as of now: one still running is late, whatever it does next
    outcomes = [
        attrs.evolve(o) if o.done else attrs.evolve(o, failure="timeouts", error="did not return in time")
        for o in outcomes
    ]
    records = [_collect(url, token, i, o, served) for i, o in zip(ids, outcomes)]
    failed = [(row, o) for row, o in zip(rows, outcomes) if o.failure in ("errors", "timeouts")]
    if failed:
        row, first = failed[0]
        log.warning(
            "%d of %d agent trajectories failed and were dropped; the first, of %s: %s",
            len(failed),
            len(rows),
            row.where,
            first.error,
        )
    return _episodes(rows, records, outcomes, n, pad_token_id, group_ids)


def _open(url: str, token: str, trajectory_id: str, deadline_s: float, served: Any) -> str:
    """A trajectory opened on the server; the agent key that identifies it."""
    if served is None:
        return server_client.register_trajectory(url, token, trajectory_id, deadline_s=deadline_s)
    from backends.rollout.server import open_trajectory

    return open_trajectory(served, trajectory_id, deadline_s)["api_key"]


def _collect(url: str, token: str, trajectory_id: str, outcome: _Outcome, served: Any = None) -> dict[str, Any] | None:
    """The trajectory's record (None when it was never registered), and the trajectory closed on the server."""
    if served is not None:
        from backends.rollout.server import close_trajectory

        record = served.recorder.snapshot(trajectory_id)
        if record is None:
            return None
        close_trajectory(served, trajectory_id)
    else:
        try:
            record = server_client.trajectory_tokens(url, token, trajectory_id)
        except server_client.ServerError as e:
            if e.status == 404:
                return None
            raise
        server_client.close_trajectory(url, token, trajectory_id)
    if outcome.failure is None:
        if record["broken"] is not None:
            outcome.failure = "prefix_mismatch"
        elif record["calls"] == 0:
            outcome.failure = "no_calls"
    return record


def _episodes(
    rows: list[Example],
    records: list[dict[str, Any] | None],
    outcomes: list[_Outcome],
    n: int,
    pad: int,
    group_ids: torch.Tensor | None,
) -> Episodes:
    kept = [o.failure is None and rec is not None for o, rec in zip(outcomes, records)]
    prompts = [
        list(rec["prompt_ids"]) if keep else list(example.prompt_ids) for keep, rec, example in zip(kept, records, rows)
    ]
    lengths = [len(rec["response_ids"]) if keep else 0 for keep, rec in zip(kept, records)]
    b, t = len(rows), max(1, max(lengths))
    response_ids = torch.full((b, t), pad, dtype=torch.long)
    response_mask = torch.zeros((b, t), dtype=torch.bool)
    loss_mask = torch.zeros((b, t), dtype=torch.bool)
    logprobs = torch.zeros((b, t), dtype=torch.float32)
    turn_ids = torch.zeros((b, t), dtype=torch.long)
    for r, (keep, rec) in enumerate(zip(kept, records)):
        if not keep:
            continue
        k = lengths[r]
        response_ids[r, :k] = torch.tensor(rec["response_ids"], dtype=torch.long)
        response_mask[r, :k] = True
        loss_mask[r, :k] = torch.tensor(rec["loss_mask"], dtype=torch.bool)
        logprobs[r, :k] = torch.tensor(rec["logprobs"], dtype=torch.float32)
        turn_ids[r, :k] = torch.tensor(rec["turn_ids"], dtype=torch.long)
    prompt_ids, prompt_mask = left_pad(prompts, pad)
    groups = torch.arange(len(rows) // n) if group_ids is None else torch.as_tensor(group_ids, dtype=torch.long)
    batch = assemble_batch(
        prompt_ids, prompt_mask, response_ids, response_mask, logprobs, n=1, group_ids=groups.repeat_interleave(n)
    ).replace(loss_mask=loss_mask, turn_ids=turn_ids)
    counts = {name: sum(o.failure == name for o in outcomes) for name in DROPS}
    metrics = {f"agent/{name}": count / b for name, count in counts.items()}
    metrics["agent/dropped"] = sum(not keep for keep in kept) / b
    metrics["agent/calls"] = sum(rec["calls"] for rec in records if rec is not None) / b
    return Episodes(
        batch=batch,
        turn_rewards=[[] for _ in rows],
        turns=[rec["calls"] if rec is not None else 0 for rec in records],
        finished=kept,
        metrics=metrics,
        given_rewards=[o.reward if keep else None for o, keep in zip(outcomes, kept)],
    )


@attrs.define(eq=False)
class AgentRunner:
    """The agents of a run (``rollout.agent``) and the in-process server their calls reach, started on first use."""

    fn: Callable[..., float | None]
    deadline_s: float
    workers: int
    chat_template: str | None = None  #: the run's chat template text (None: the tokenizer's)
    #: the agents' calls join the engine's running batch where it can (else: gathered calls; the server's option)
    request_streams: bool = True
    server: Any = None  #: the :class:`backends.rollout.server.ThreadedServer`, once started
    rounds: int = 0

    def sample(
        self,
        rollout: Any,
        examples: Sequence[Example],
        tokenizer: Any,
        sampling: SamplingConfig,
        *,
        seed: int,
        group_ids: torch.Tensor | None = None,
    ) -> Episodes:
        """``sampling.n`` agent trajectories of each of ``examples`` on ``rollout`` (the engine of this step)."""
        policy = self._serve(tokenizer).policy
        # the engine value of this step, with its weights; calls without options sample as the run does
        policy.engine, policy.version, policy.seed = rollout, rollout.weights_version, seed
        policy.defaults = attrs.evolve(sampling, n=1)
        self.rounds += 1
        try:
            return run_agents(
                self.server.url,
                policy.trainer_token,
                examples,
                self.fn,
                n=sampling.n,
                deadline_s=self.deadline_s,
                workers=self.workers,
                model=policy.model_name,
                pad_token_id=rollout.pad_token_id,
                group_ids=group_ids,
                id_prefix=f"s{seed}-r{self.rounds}",
                served=policy,
            )
        finally:
            # the engine's request stream ends with the round: its cache's memory goes back before the trainer runs
            policy.batcher.settle()

    def _serve(self, tokenizer: Any) -> Any:
        if self.server is None:
            from backends.rollout.server import ServedPolicy, ThreadedServer
            from backends.rollout.server_weights import WeightStaging

            policy = ServedPolicy(
                engine=None,
                tokenizer=tokenizer,
                model_name="policy",
                trainer_token=server_client.new_token(),
                staging=WeightStaging(expected={}),  # the trainer syncs the engine itself: nothing is pushed here
                chat_template=self.chat_template,
                request_streams=self.request_streams,
            )
            self.server = ThreadedServer(policy)
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def agent_runner(agent: str, *, deadline_s: float, workers: int, chat_template: str = "auto") -> AgentRunner:
    """The runner of ``rollout.agent``'s function (resolved now, so a bad reference fails at start-up);
    ``chat_template``: ``data.chat_template`` (auto: the tokenizer's; a path: that file)."""
    fn = resolve_function(agent, {}, "rollout.agent")
    template = None if chat_template in ("auto", "none") else Path(chat_template).read_text()
    return AgentRunner(fn=fn, deadline_s=deadline_s, workers=workers, chat_template=template)

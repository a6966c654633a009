"""Multi-turn rows on the vLLM engine, each continued as soon as its environment answered (the vLLM engine's
:class:`~backends.rollout.engine.TurnStream`), where a turn-by-turn session (:mod:`backends.rollout.vllm_session`)
makes every row's next turn wait for the slowest row's turn and the slowest environment.

A row's turn is one vLLM request (``n=1``, its whole token history plus the observation as ``prompt_token_ids``),
added to the engine while other rows' turns are running (``LLMEngine.add_request``), and the stream steps the engine
one iteration at a time (``LLMEngine.step``), as ``vllm.LLM`` drives it inside its own ``generate``
(:func:`~backends.rollout.vllm_requests.add_final_only`). vLLM's scheduler admits each turn into the running batch
and its prefix cache holds the history that earlier turns computed (whole blocks only: 128 tokens on the CPU).

A row's ``k``-th turn has the seed the session gives it (:func:`~backends.rollout.vllm_session.turn_seed` of the
session's seed, the row and ``k``), and vLLM draws a seeded request's tokens from a generator of its own, so the
stream samples the session's tokens for the same seed, prompts and observations, whenever each turn runs; log-probs
agree to float rounding. The rows, their checks and the token bookkeeping are the session's: the tokens the trainer
reads are exactly the ids sampled or given, nothing decoded and encoded again.

Not for a tensor-parallel engine (``VLLMRollout.start_turn_stream`` returns None there; the agent loop takes the
session, whose calls the ranks of a group make together).
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import attrs

from backends.rollout.common import EndedTurn, SamplingConfig, checked_turn
from backends.rollout.vllm_requests import add_final_only, finished_outputs, ready_to_sample, to_sampling_params
from backends.rollout.vllm_session import start_session, turn_seed

__all__ = ["VLLMTurnStream"]

_streams = itertools.count()  #: numbers each stream's request ids apart from an earlier stream's


@attrs.define
class _Turn:
    """A row's turn under way: its request, the forced tokens it began with."""

    request_id: str
    forced: list[int]


class VLLMTurnStream:
    """The rows of a multi-turn rollout on the vLLM engine, continued turn by turn, each on its own time (see the
    module docstring). Rows are in ``generate``'s order (prompt ``i``'s ``n`` samples are rows ``i*n .. i*n+n-1``).
    Not thread-safe: one caller resumes and steps it, and nothing else uses the engine until :meth:`end`."""

    def __init__(
        self, rollout: Any, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *, seed: int, max_slots: int
    ) -> None:
        session = start_session(rollout, prompts, sampling, seed=seed, max_slots=max_slots)  # checks as the session
        ready_to_sample(rollout)
        self.rollout, self.sampling, self.seed, self.max_slots = rollout, session.sampling, session.seed, max_slots
        self.engine = rollout.llm.llm_engine
        self.tokens = [list(t) for t in session.tokens]  #: each row's prompt, then every token its turns added
        self.prompt_lengths = session.prompt_lengths
        self.turns = [0] * len(self.tokens)  #: turns each row has begun
        self.closed = [False] * len(self.tokens)
        self.running: dict[int, _Turn] = {}  #: row -> its turn under way
        self.row_of: dict[str, int] = {}  #: a running turn's request id -> its row
        self.name = f"turns-{next(_streams)}"
        self.ended = False

    @property
    def busy(self) -> bool:
        """Some row is in a turn: :meth:`step` has work."""
        return bool(self.running)

    def resume(self, row: int, forced: Sequence[int], max_new_tokens: int) -> None:
        """Start ``row``'s next turn: feed it ``forced`` (given tokens, never sampled: an observation), then sample up
        to an EOS or ``max_new_tokens`` tokens. Its first turn has no forced tokens."""
        if self.ended:
            raise RuntimeError("VLLMTurnStream.resume: the stream has ended")
        forced = checked_turn(
            "VLLMTurnStream.resume",
            row,
            forced,
            max_new_tokens,
            closed=self.closed,
            in_turn=self.running.__contains__,
            added=lambda r: len(self.tokens[r]) - self.prompt_lengths[r],
            vocab_size=self.rollout.vocab_size,
            max_slots=self.max_slots,
        )
        one_turn = attrs.evolve(self.sampling, n=1, max_new_tokens=max_new_tokens)
        params = to_sampling_params(
            one_turn, self.rollout.eos_token_ids, seed=turn_seed(self.seed, row, self.turns[row])
        )
        request_id = f"{self.name}-{row}-{self.turns[row]}"
        add_final_only(self.rollout, [request_id], [self.tokens[row] + forced], [params])
        self.running[row] = _Turn(request_id, forced)
        self.row_of[request_id] = row
        self.turns[row] += 1

    def step(self) -> list[EndedTurn]:
        """One engine iteration over the rows in their turns: the turns that ended in it."""
        ended = []
        for output in finished_outputs(self.engine, self.row_of, len(self.running), "running turns"):
            row = self.row_of.pop(output.request_id)
            forced = self.running.pop(row).forced
            completion = output.outputs[0]
            new = list(completion.token_ids)
            self.tokens[row] += forced + new
            ended.append(
                EndedTurn(
                    row=row,
                    tokens=forced + new,
                    logprobs=[0.0] * len(forced) + [float(lp[t].logprob) for lp, t in zip(completion.logprobs, new)],
                    sampled=[False] * len(forced) + [True] * len(new),
                    # "stop": an EOS id (or a VLLMSamplingConfig stop string) ended the turn; "length": its limit
                    finished=completion.finish_reason == "stop",
                )
            )
        return ended

    def close(self, row: int) -> None:
        """``row``'s trajectory is over (closing twice is a no-op); vLLM keeps its finished turns' KV blocks only as
        prefix-cache entries, which it evicts when it needs the room."""
        if row in self.running:
            raise ValueError(f"VLLMTurnStream.close: row {row} is still in its turn")
        self.closed[row] = True

    def end(self) -> None:
        """Abort the turns still running (the caller gave up on them: an error, a deadline); the stream cannot
        resume rows afterwards."""
        unfinished = [turn.request_id for turn in self.running.values()]
        self.running.clear()
        self.row_of.clear()
        self.ended = True
        if unfinished:
            self.engine.abort_request(unfinished, internal=False)

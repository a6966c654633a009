"""Per-trajectory token records of a rollout server: the exact ids an agent's calls fed and sampled.

An agent talks to the policy through OpenAI-style calls (:mod:`backends.rollout.server`); each of its
trajectories is one :class:`Trajectory`. The first call's prompt ids are the trajectory's prompt; every later
token is a response token: the ids a call added before sampling (the agent's new user / tool messages: no loss),
then the ids it sampled (loss, with their log-probs and the policy version that sampled them). The trainer reads
these ids, never a re-tokenisation of the conversation's text.

A chat call sends the whole history as messages, which the chat template renders to ids again. When that
rendering starts with the ids already recorded, the call continues the record. When it does not (a template that
strips earlier ``<think>`` blocks, whitespace normalisation) but the messages are the recorded ones (the history
sent before plus the replies the server gave), the recorded ids stand for the history and only the new messages'
ids are appended: those are the rendering of the new messages after the history (:func:`appended_ids`). When the
history itself changed (an edited or dropped message), no single token sequence holds the conversation: the
trajectory is marked broken, counted (``agent/prefix_mismatch``) and served from the new rendering, and the
trainer drops it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import attrs

__all__ = [
    "Trajectory",
    "TrajectoryRecorder",
    "appended_ids",
    "same_history",
]

#: ``(messages, add_generation_prompt) -> ids``: a chat template's rendering, tokenised
Render = Callable[[list[dict[str, Any]], bool], list[int]]


@attrs.define
class Trajectory:
    """One agent trajectory's record (see the module doc); changed only under its recorder's lock."""

    id: str
    deadline: float | None  #: ``time.monotonic()`` after which its calls are refused; None: no deadline
    prompt_ids: list[int] | None = None  #: the first call's prompt (None until the first call)
    response_ids: list[int] = attrs.field(factory=list)  #: every id after the prompt
    loss_mask: list[bool] = attrs.field(factory=list)  #: per response id: True for a sampled one
    logprobs: list[float] = attrs.field(factory=list)  #: per response id: its raw log-prob (0.0 when not sampled)
    versions: list[int] = attrs.field(factory=list)  #: per response id: the policy version that sampled it (-1: not)
    turn_ids: list[int] = attrs.field(factory=list)  #: per response id: the call (turn) it belongs to
    calls: int = 0  #: model calls recorded
    #: the chat history the next call should start with: the last call's messages plus the reply it got
    messages: list[dict[str, Any]] | None = None
    broken: str | None = None  #: why the record no longer holds the conversation (None: it does)
    last_reply: str | None = None  #: the text of the last sampled reply
    last_finished: bool = False  #: the last reply ended with an end-of-turn token (else its length cap cut it)

    def context(self) -> list[int]:
        """Every id recorded so far: prompt, then response."""
        return list(self.prompt_ids or []) + self.response_ids

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "prompt_ids": self.prompt_ids or [],
            "response_ids": self.response_ids,
            "loss_mask": [int(m) for m in self.loss_mask],
            "logprobs": self.logprobs,
            "versions": self.versions,
            "turn_ids": self.turn_ids,
            "calls": self.calls,
            "broken": self.broken,
            "last_reply": self.last_reply,
        }


def _message_key(message: dict[str, Any]) -> tuple[str, str]:
    content = message.get("content")
    return str(message.get("role")), "" if content is None else str(content)


def same_history(recorded: Sequence[dict[str, Any]], sent: Sequence[dict[str, Any]]) -> bool:
    """Whether ``sent`` starts with the ``recorded`` messages (role and content each; extra keys ignored)."""
    if len(sent) < len(recorded):
        return False
    return all(_message_key(a) == _message_key(b) for a, b in zip(recorded, sent))


def _replies_emptied(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**m, "content": ""} if m.get("role") == "assistant" else dict(m) for m in messages]


def appended_ids(
    render: Render, messages: list[dict[str, Any]], history_length: int, *, last_sampled: int | None, finished: bool
) -> list[int] | None:
    """The ids that follow the recorded ones when ``messages[:history_length]`` is the recorded history: the end
    of the last reply as the chat template closes it (less the end-of-turn token the model sampled, if it did),
    then the new messages with the generation prompt. None when the template's renderings share no prefix.

    The history is rendered with its assistant replies emptied: a template that rewrites earlier replies (strips
    their reasoning) renders an empty reply the same wherever it stands, so the new messages' ids follow a
    common prefix, and the recorded ids stand for the replies themselves.
    """
    history = _replies_emptied(messages[:history_length])
    if not history or history[-1].get("role") != "assistant":
        return None
    before_reply = render(history[:-1], True)
    head = render(history, False)
    whole = render(history + list(messages[history_length:]), True)
    if head[: len(before_reply)] != before_reply or whole[: len(head)] != head:
        return None
    closing = head[len(before_reply) :]
    if finished and closing and closing[0] == last_sampled:
        closing = closing[1:]
    return closing + whole[len(head) :]


class TrajectoryRecorder:
    """The trajectories of one server, by id, with the counts of what happened to them. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, Trajectory] = {}
        self.counts = {"agent/calls": 0, "agent/prefix_reused": 0, "agent/prefix_mismatch": 0}

    def register(self, trajectory_id: str, deadline_s: float | None) -> Trajectory:
        if not trajectory_id:
            raise ValueError("a trajectory needs a non-empty id")
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"trajectory {trajectory_id!r}: deadline_s must be > 0, got {deadline_s}")
        with self._lock:
            if trajectory_id in self._by_id:
                raise ValueError(f"trajectory {trajectory_id!r} is already registered on this server")
            deadline = None if deadline_s is None else time.monotonic() + deadline_s
            trajectory = Trajectory(id=trajectory_id, deadline=deadline)
            self._by_id[trajectory_id] = trajectory
            return trajectory

    def get(self, trajectory_id: str) -> Trajectory | None:
        with self._lock:
            return self._by_id.get(trajectory_id)

    def snapshot(self, trajectory_id: str) -> dict[str, Any] | None:
        with self._lock:
            trajectory = self._by_id.get(trajectory_id)
            return None if trajectory is None else trajectory.to_json()

    def forget(self, trajectory_id: str) -> bool:
        with self._lock:
            return self._by_id.pop(trajectory_id, None) is not None

    def chat_prompt(self, trajectory: Trajectory, messages: list[dict[str, Any]], render: Render) -> list[int]:
        """The prompt ids of a chat call of ``trajectory`` (see the module doc); marks it broken when the history
        changed."""
        rendered = render(messages, True)
        with self._lock:
            if trajectory.prompt_ids is None or trajectory.broken is not None:
                return rendered
            recorded = trajectory.context()
            if rendered[: len(recorded)] == recorded:
                return rendered
            history = trajectory.messages or []
            last_sampled = trajectory.response_ids[-1] if trajectory.response_ids else None
            finished = trajectory.last_finished
        # rendering is the slow part: outside the lock (one trajectory's calls come from one agent, in order)
        tail = None
        if same_history(history, messages):
            tail = appended_ids(render, messages, len(history), last_sampled=last_sampled, finished=finished)
        with self._lock:
            if tail is None:
                self._break(trajectory, "the chat history sent differs from the recorded one (an edited message)")
                return rendered
            self.counts["agent/prefix_reused"] += 1
            return trajectory.context() + tail

    def completion_prompt(self, trajectory: Trajectory, prompt_ids: list[int]) -> list[int]:
        """The prompt ids of a completion call of ``trajectory``: as sent; marks it broken when they do not start
        with the recorded ids."""
        with self._lock:
            if trajectory.prompt_ids is not None and trajectory.broken is None:
                recorded = trajectory.context()
                if prompt_ids[: len(recorded)] != recorded:
                    self._break(trajectory, "the prompt does not start with the trajectory's recorded ids")
        return prompt_ids

    def record(
        self,
        trajectory: Trajectory,
        prompt_ids: list[int],
        sampled_ids: list[int],
        logprobs: list[float],
        version: int,
        *,
        messages: list[dict[str, Any]] | None = None,
        reply: str = "",
        finished: bool = False,
    ) -> None:
        """One call of ``trajectory``: it fed ``prompt_ids`` and sampled ``sampled_ids`` with ``logprobs`` under
        policy ``version``; ``messages`` (chat calls): the history it was given, to which the reply is added;
        ``finished``: the reply ended with an end-of-turn token."""
        if len(sampled_ids) != len(logprobs):
            raise ValueError(f"{len(sampled_ids)} sampled ids but {len(logprobs)} log-probs")
        with self._lock:
            self.counts["agent/calls"] += 1
            if trajectory.broken is not None:
                return
            turn = trajectory.calls
            if trajectory.prompt_ids is None:
                trajectory.prompt_ids = list(prompt_ids)
            else:
                recorded = len(trajectory.prompt_ids) + len(trajectory.response_ids)
                added = prompt_ids[recorded:]
                trajectory.response_ids += added
                trajectory.loss_mask += [False] * len(added)
                trajectory.logprobs += [0.0] * len(added)
                trajectory.versions += [-1] * len(added)
                trajectory.turn_ids += [turn] * len(added)
            trajectory.response_ids += list(sampled_ids)
            trajectory.loss_mask += [True] * len(sampled_ids)
            trajectory.logprobs += [float(x) for x in logprobs]
            trajectory.versions += [int(version)] * len(sampled_ids)
            trajectory.turn_ids += [turn] * len(sampled_ids)
            trajectory.calls += 1
            trajectory.last_reply = reply
            trajectory.last_finished = finished
            if messages is not None:
                trajectory.messages = [dict(m) for m in messages] + [{"role": "assistant", "content": reply}]

    def _break(self, trajectory: Trajectory, why: str) -> None:
        trajectory.broken = why
        self.counts["agent/prefix_mismatch"] += 1

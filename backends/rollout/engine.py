"""The rollout engine interface: what the agent loop, the evaluation, the recipes and the weight bridge call,
whichever engine samples.

A :class:`RolloutEngine` is the engine's state value (``NativeRollout``, ``VLLMRollout``): its methods sample from
it, and those that change it return the new value (``rollout = rollout.sync_weights(tensors)``), as everywhere in
the shim. A multi-turn :class:`Session` is a value too (``session, turn = session.continue_turn(...)``). Both are
:class:`typing.Protocol` s: the engines implement them structurally, and nothing outside an engine's own modules
asks which engine it has.

An engine is registered by name (``rollout.engine=...``) in :data:`backends.rollout.api.ROLLOUT_ENGINES` with a
:class:`RolloutEngineSpec`: how it is built from the rollout config, the settings it refuses before any work, the
dtype it keeps weights in (so the trainer gathers them in it, also on ranks that hold no engine), and what it can
do (LoRA adapters, running on a pool of some of the ranks). A new engine is one module with its state class, its
session class and its spec, plus that one entry.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import attrs
import torch
from torch import Tensor

from backends.rollout.common import EndedRequest, EndedTurn, SamplingConfig, TurnOutput
from rlfunc.batch import RolloutBatch

__all__ = ["RequestStream", "RolloutEngine", "RolloutEngineSpec", "Session", "TurnStream"]


@runtime_checkable
class Session(Protocol):
    """A multi-turn session: rows whose context continues across turns; only the newest value continues."""

    def continue_turn(
        self, forced: Sequence[Sequence[int]], *, active: Sequence[bool], max_new_tokens: Sequence[int]
    ) -> tuple["Session", TurnOutput]:
        """Feed each active row its ``forced`` tokens, then sample its next turn (up to EOS or its
        ``max_new_tokens``): the new session and what the call added (token in, token out)."""
        ...

    def end(self) -> None:
        """Free what the session holds."""
        ...


@runtime_checkable
class TurnStream(Protocol):
    """An optional engine ability: multi-turn rows continued each on its own time. The agent loop
    (:func:`backends.rollout.agent_loop.run_episodes`) steps it and hands a row its next turn as soon as that row's
    environment has answered, while other rows are still in theirs; an engine whose ``start_turn_stream`` is missing
    or returns None gets the turn-by-turn :class:`Session`. A stream changes in place (it is the engine's running
    state, as a server's), so it is not a value: one caller steps it."""

    @property
    def busy(self) -> bool:
        """Some row is in a turn (resumed, or sampling)."""
        ...

    def resume(self, row: int, forced: Sequence[int], max_new_tokens: int) -> None:
        """Start ``row``'s next turn: feed ``forced``, then sample up to an EOS or ``max_new_tokens`` tokens."""
        ...

    def step(self) -> list[EndedTurn]:
        """One engine iteration over the rows in their turns: the turns that ended in it."""
        ...

    def close(self, row: int) -> None:
        """``row``'s trajectory is over: free what it holds."""
        ...

    def end(self) -> None:
        """Free what the stream holds."""
        ...


@runtime_checkable
class RequestStream(Protocol):
    """An optional engine ability: sampling requests that join a running batch as they come (a rollout server's
    agents' calls), each with its own prompts, ``n``, token limit and seed, under one set of sampling options and
    the weights the engine holds when the stream starts. A server steps it from one thread
    (:class:`backends.rollout.server_batching.EngineBatcher`); an engine whose ``start_request_stream`` is missing or
    returns None runs each gathered set of requests as one ``generate``."""

    @property
    def busy(self) -> bool:
        """Some request is queued or sampling."""
        ...

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens it did not compute: a prefix cache held their keys and values (0 without one)."""
        ...

    def add(self, key: Any, prompts: Sequence[Sequence[int]], *, n: int, max_new_tokens: int, seed: int) -> None:
        """Queue a request (``ValueError`` if it can never run, and nothing queued): :meth:`step` returns it under
        ``key``, its rows the tokens ``generate`` samples for it alone with ``seed``."""
        ...

    def step(self) -> list[EndedRequest]:
        """One engine iteration: the requests whose every row ended in it."""
        ...

    def end(self) -> None:
        """Free what the stream holds."""
        ...


@runtime_checkable
class RolloutEngine(Protocol):
    """A rollout engine's state: sampling, multi-turn sessions, weight sync, memory release and shutdown."""

    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    max_context: int  #: prompt + response tokens must fit in this many positions
    weights_version: int  #: counts weight syncs

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig = SamplingConfig(),
        *,
        group_ids: Tensor | None = None,
        seed: int | None = None,
    ) -> RolloutBatch:
        """``sampling.n`` responses per prompt as a :class:`rlfunc.RolloutBatch` (raw sampled-token log-probs)."""
        ...

    def start_session(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *, seed: int, max_slots: int
    ) -> Session:
        """A multi-turn session over ``prompts`` (``sampling.n`` rows each, in ``generate``'s order);
        ``max_slots``: the most tokens the session adds to a row after its prompt."""
        ...

    def sync_weights(self, named_tensors: Iterable[tuple[str, Tensor]], *, strict: bool = True) -> "RolloutEngine":
        """Full HF-named tensors into the engine (checked; see the engine); the new state."""
        ...

    def sync_adapter(
        self, adapter: Mapping[str, Tensor], *, rank: int, alpha: float, target_modules: Sequence[str], version: int
    ) -> "RolloutEngine":
        """A LoRA adapter's factors alone (peft names), the base weights staying as built; an engine without
        adapters refuses (its spec says ``adapter_sync`` is never on)."""
        ...

    def release_memory(self) -> "RolloutEngine":
        """Once a step's sampling is done: let the trainer have the engine's memory until the next weight sync."""
        ...

    def shutdown(self) -> None:
        """Release what the engine holds beyond Python objects; after the last collective, before the process
        group is destroyed."""
        ...

    def logprob_numerics(self) -> str | None:
        """A label of how the engine computes log-probs: a training engine with the same label computes the same
        numbers (:meth:`backends.training.engine.TrainEngine.logprob_numerics`). None: numerics of its own."""
        ...


def _never(cfg: Any) -> bool:
    return False


def _one_set_of_weights(cfg: Any) -> str:
    return "it samples each response under one set of weights (it cannot take new ones in the middle)"


@attrs.frozen
class RolloutEngineSpec:
    """A rollout engine's registration (:data:`backends.rollout.api.ROLLOUT_ENGINES`)."""

    #: ``(cfg, model_path, tokenizer, *, seed, max_context, device) -> RolloutEngine`` (every rank calls it)
    build: Callable[..., RolloutEngine]
    #: ``(cfg) -> None``: refuse, when the config is read, settings this engine cannot run
    check_config: Callable[[Any], None]
    weight_dtype: Callable[[Any], torch.dtype]  #: ``(cfg) -> dtype`` the engine keeps its weights in
    engine_type: type  #: the engine's state class (a :class:`RolloutEngine`)
    session_type: type | None  #: its multi-turn session class (a :class:`Session`); None: none (check_config refuses)
    #: ``(cfg) -> bool``: the trainer sends a LoRA actor's adapter alone (else merged full weights)
    adapter_sync: Callable[[Any], bool] = _never
    #: ``(cfg, rank) -> cfg``: the config with the engine set up for adapters of ``rank`` (when ``adapter_sync``)
    with_adapter_rank: Callable[[Any, int], Any] | None = None
    #: why the engine cannot be built on a pool of some of the ranks (None: it can)
    pool_refusal: str | None = None
    #: ``build`` takes ``group=``: the process group of the ranks that build the engine together (None: every rank)
    takes_group: bool = False
    #: ``(cfg) -> None | str``: None where the engine does partial rollouts (its value has
    #: ``with_weight_updates(updates)``: generation takes newer weights at chunk boundaries, the batch carries
    #: ``policy_version (b t)``), else why not
    partial_rollouts: Callable[[Any], str | None] = _one_set_of_weights

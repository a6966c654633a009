"""Multi-turn sessions on the vLLM engine: each row's token history, continued one model turn at a time.

A session keeps, per row (``sampling.n`` rows per prompt, in ``generate``'s order), every token the rows
have so far: the prompt, then each call's forced tokens (an environment's observation, fed to the model,
not sampled) and sampled tokens. :func:`continue_session` sends each active row's whole history plus its
forced tokens to vLLM as ``prompt_token_ids`` (one request per row, ``n=1``), so the tokens the trainer
later reads are exactly the ids that were sampled or forced: nothing is decoded and re-encoded.

Re-submitting the history costs little: the engine is built with prefix caching, so the KV blocks that an
earlier turn computed (prompt, and the sampled tokens vLLM cached when that request finished) are reused
and only the new tail is prefilled. vLLM caches whole blocks only (128 tokens on CPU, 16 by default on
GPU), so a history shorter than one block is recomputed. ``session.cached_tokens`` /
``session.prompt_tokens`` count the hits (vLLM's ``num_cached_tokens`` of each request).

Randomness: row ``r`` in turn ``t`` samples with its own vLLM seed, a function of the session seed, ``r``
and ``t`` only, so the same seed, prompts, forced tokens and weights reproduce a session whatever else the
engine runs beside it; turn 0 uses the seeds ``generate`` gives the same rows, so a first turn with no
forced tokens samples what ``generate`` samples.

Tensor parallel: the engine is shared by the ranks of its TP group; :func:`continue_session` gathers every
peer's requests, submits them all on each rank and keeps this rank's outputs (as ``generate`` does), so
every rank of the group must call it the same number of times, with or without active rows of its own.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs
from torch import Tensor

from backends.rollout.common import SamplingConfig, TurnOutput, prepare_prompts
from backends.rollout.vllm_requests import as_sampling_config, gather_tp_inputs, run_requests, to_sampling_params

__all__ = ["VLLMSession", "start_session", "continue_session", "end_session", "turn_seed"]

#: seeds of consecutive turns of one row lie this far apart (more rows than this would overlap the next turn's)
_TURN_STRIDE = 2**40


@attrs.frozen
class VLLMSession:
    """A multi-turn session's state; :func:`continue_session` returns a new one (this one stays valid).

    ``tokens[row]`` is the row's prompt, then every token added since, in order (lists that no call
    mutates). ``cached_tokens`` of ``prompt_tokens`` (this rank's requests, over the session) came from
    vLLM's prefix cache instead of being recomputed.
    """

    rollout: Any  #: the VLLMRollout it samples from (backends.rollout.vllm, which imports this module)
    sampling: SamplingConfig
    seed: int
    max_slots: int  #: tokens after the prompt the session may add per row
    prompt_lengths: tuple[int, ...]  #: per row
    tokens: list[list[int]]
    turn: int = 0  #: continue_session calls so far
    prompt_tokens: int = 0  #: token ids this rank's requests submitted as prompts, over the session
    cached_tokens: int = 0  #: of which vLLM found the KV in its prefix cache (its ``num_cached_tokens``)

    @property
    def num_rows(self) -> int:
        return len(self.tokens)

    def continue_turn(
        self, forced: Sequence[Sequence[int]], *, active: Sequence[bool], max_new_tokens: Sequence[int]
    ) -> tuple[VLLMSession, TurnOutput]:
        """The :class:`backends.rollout.engine.Session` protocol: :func:`continue_session`."""
        return continue_session(self, forced, active=active, max_new_tokens=max_new_tokens)

    def end(self) -> None:
        end_session(self)


def turn_seed(seed: int, row: int, turn: int) -> int:
    """The vLLM seed of ``row`` in ``turn`` (turn 0: ``generate``'s seed for that row; vLLM seeds sample ``j``
    of a request with ``seed + j``, and generate's rows of prompt ``i`` start at ``seed * 1_000_003 + i * n``)."""
    return (seed * 1_000_003 + row + turn * _TURN_STRIDE) % 2**62


def start_session(
    rollout: Any,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig | Mapping[str, Any],
    *,
    seed: int,
    max_slots: int,
) -> VLLMSession:
    """A session of ``sampling.n`` rows per prompt (``generate``'s row order); nothing is generated yet.

    ``max_slots`` bounds the tokens the whole session may add to each row (forced and sampled), and each
    prompt plus ``max_slots`` must fit the context (``rollout.max_context``), so no turn can run past it;
    prompts are checked as the native engine's ``start_session`` checks them (``truncate_prompts`` keeps
    the last tokens that fit). ``sampling.max_new_tokens`` is not used: each turn's limit is
    :func:`continue_session`'s. With a tensor-parallel engine, inputs refused on one rank raise on every
    rank of its group.
    """
    error, session = None, None
    try:
        session = _new_session(rollout, prompts, sampling, seed=seed, max_slots=max_slots)
    except (TypeError, ValueError) as e:
        if rollout.tp_group is None:
            raise
        error = e
    if rollout.tp_group is not None:
        gather_tp_inputs(rollout, None, error, caller="start_session")
    return session


def _new_session(
    rollout: Any,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig | Mapping[str, Any],
    *,
    seed: int,
    max_slots: int,
) -> VLLMSession:
    sampling = as_sampling_config(sampling)
    context = rollout.max_context
    if isinstance(max_slots, bool) or not isinstance(max_slots, int) or not 1 <= max_slots < context:
        raise ValueError(
            f"max_slots must be an int in [1, {context}) (the rollout's max_context is {context} "
            f"positions), got {max_slots!r}"
        )
    if not sampling.truncate_prompts and isinstance(prompts, Sequence):
        for i, prompt in enumerate(prompts):
            if len(prompt) + max_slots > context:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens; with max_slots={max_slots} the session needs "
                    f"{len(prompt) + max_slots} positions, more than the context of max_context={context} (lower "
                    "max_slots or set truncate_prompts=True to keep the last tokens)"
                )
    checked = prepare_prompts(
        prompts, attrs.evolve(sampling, max_new_tokens=max_slots), max_context=context, vocab_size=rollout.vocab_size
    )
    rows = [ids for ids in checked for _ in range(sampling.n)]
    return VLLMSession(
        rollout=rollout,
        sampling=sampling,
        seed=int(seed),
        max_slots=max_slots,
        prompt_lengths=tuple(len(r) for r in rows),
        tokens=[list(r) for r in rows],
    )


def _token_ids(tokens: Sequence[int], vocab_size: int, what: str) -> list[int]:
    """``tokens`` as a list of ints, each in the vocabulary."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (Sequence, Tensor)):
        raise TypeError(f"{what} must be a list of token ids, got {type(tokens).__name__}")
    ids = tokens.tolist() if isinstance(tokens, Tensor) else [int(t) for t in tokens]
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"{what} has token ids outside [0, {vocab_size}): min {min(ids)}, max {max(ids)}")
    return ids


def continue_session(
    session: VLLMSession, forced: Sequence[Sequence[int]], *, active: Sequence[bool], max_new_tokens: Sequence[int]
) -> tuple[VLLMSession, TurnOutput]:
    """Each active row: append ``forced[row]``, then sample one turn (until an EOS, or ``max_new_tokens[row]``
    tokens; 0 samples nothing). Inactive rows add nothing: their ``max_new_tokens`` is ignored and, as with
    the native engine, they must have no forced tokens. Returns the new session and what was added.

    One vLLM request per active row (``n=1``, ``prompt_token_ids`` = its history plus its forced tokens),
    all submitted together. Refused before the engine runs: a row whose added tokens (forced plus up to
    ``max_new_tokens`` sampled) would exceed the session's ``max_slots``, which :func:`start_session` fitted
    into the context. A level-2-slept engine whose weights no sync restored refuses, as in ``generate``.
    """
    rollout = session.rollout
    error, wanted = None, []
    try:
        wanted = _check_turn(session, forced, active, max_new_tokens)
    except (TypeError, ValueError) as e:
        if rollout.tp_group is None:
            raise
        error = e
    requests, params = [], []
    # (row, forced tokens, max_tokens) of each of this rank's active rows; only rows with max_tokens > 0 submit
    mine = [(row, ids, limit) for row, ids, limit in wanted if limit > 0]
    specs = [(session.tokens[row] + ids, limit, turn_seed(session.seed, row, session.turn)) for row, ids, limit in mine]
    peers, me = [(session.sampling, specs)], 0
    if rollout.tp_group is not None:
        peers, me = gather_tp_inputs(rollout, (session.sampling, specs), error, caller="continue_session")
    for peer_sampling, peer_specs in peers:
        for ids, limit, seed in peer_specs:
            requests.append({"prompt_token_ids": ids})
            one_turn = attrs.evolve(peer_sampling, n=1, max_new_tokens=limit)
            params.append(to_sampling_params(one_turn, rollout.eos_token_ids, seed=seed))
    outputs = run_requests(rollout, requests, params) if requests else []
    start = sum(len(peer_specs) for _, peer_specs in peers[:me])
    return _apply_turn(session, wanted, dict(zip([row for row, _, _ in mine], outputs[start : start + len(mine)])))


def _check_turn(
    session: VLLMSession, forced: Sequence[Sequence[int]], active: Sequence[bool], max_new_tokens: Sequence[int]
) -> list[tuple[int, list[int], int]]:
    """``(row, forced ids, max_tokens)`` of each active row, after the checks named in continue_session."""
    rows, rollout = session.num_rows, session.rollout
    for name, value in (("forced", forced), ("active", active), ("max_new_tokens", max_new_tokens)):
        if not hasattr(value, "__len__") or len(value) != rows:
            got = len(value) if hasattr(value, "__len__") else type(value).__name__
            raise ValueError(f"continue_session: {name} must have one entry per row ({rows}), got {got}")
    wanted = []
    for row in range(rows):
        ids = _token_ids(forced[row], rollout.vocab_size, f"continue_session: the forced tokens of row {row}")
        if not bool(active[row]):
            if ids:  # the native engine refuses them too: an observation silently dropped would be lost
                raise ValueError(f"continue_session: row {row} is inactive but has {len(ids)} forced tokens")
            continue
        limit = int(max_new_tokens[row])
        if limit < 0:
            raise ValueError(f"continue_session: max_new_tokens[{row}] = {limit} is negative")
        added = len(session.tokens[row]) - session.prompt_lengths[row]
        if added + len(ids) + limit > session.max_slots:
            raise ValueError(
                f"continue_session: row {row} has added {added} tokens; {len(ids)} forced plus up to {limit} sampled "
                f"would exceed the session's max_slots={session.max_slots}"
            )
        wanted.append((row, ids, limit))
    return wanted


def _apply_turn(
    session: VLLMSession, wanted: list[tuple[int, list[int], int]], outputs: dict[int, Any]
) -> tuple[VLLMSession, TurnOutput]:
    """The new session and the turn's output, from each active row's forced ids and vLLM output (if it sampled)."""
    rows = session.num_rows
    tokens: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    sampled: list[list[bool]] = [[] for _ in range(rows)]
    finished = [False] * rows
    prompt_tokens = cached_tokens = 0
    for row, ids, _ in wanted:
        tokens[row], logprobs[row], sampled[row] = list(ids), [0.0] * len(ids), [False] * len(ids)
        out = outputs.get(row)
        if out is None:
            continue
        completion = out.outputs[0]
        new = list(completion.token_ids)
        tokens[row] += new
        logprobs[row] += [float(lp[tok].logprob) for lp, tok in zip(completion.logprobs, new)]
        sampled[row] += [True] * len(new)
        # "stop": an EOS id (or a VLLMSamplingConfig stop string) ended the turn; "length": the budget cut it
        finished[row] = completion.finish_reason == "stop"
        prompt_tokens += len(out.prompt_token_ids)
        cached_tokens += int(out.num_cached_tokens or 0)
    history = [session.tokens[row] + tokens[row] if tokens[row] else session.tokens[row] for row in range(rows)]
    new_session = attrs.evolve(
        session,
        tokens=history,
        turn=session.turn + 1,
        prompt_tokens=session.prompt_tokens + prompt_tokens,
        cached_tokens=session.cached_tokens + cached_tokens,
    )
    return new_session, TurnOutput(tokens=tokens, logprobs=logprobs, sampled=sampled, finished=finished)


def end_session(session: VLLMSession) -> None:
    """End ``session``. Nothing to free: vLLM keeps a finished request's KV blocks only as prefix-cache
    entries, which it evicts when it needs the room (and ``sync_weights`` resets). Present so a driver ends
    sessions of either engine alike."""
    if not isinstance(session, VLLMSession):
        raise TypeError(f"end_session: not a VLLMSession: {type(session).__name__}")

"""Multi-turn sessions of the native engine (:mod:`backends.rollout.native`, which imports this module).

A session prefills its prompts once and then continues every row's KV cache across turns. Every
decoder step writes one token per row into one shared cache slot: a row with something to feed (a
forced token, or the token it just sampled) feeds it at its own RoPE position; a row with nothing to
feed (inactive this call, or its turn already ended) feeds a dummy whose slot is masked for that row
(``Decoder.step(..., masked=)``) and whose position is not advanced, so no row ever attends to a dummy
and the cache never needs re-prefilling. Rows never leave the working batch.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch
from torch import Tensor

from backends.rollout.common import SamplingConfig, TurnOutput, left_pad, prepare_prompts, sample_tokens
from backends.rollout.decoder import Decoder

__all__ = ["NativeSession", "start_session", "continue_session", "end_session", "session_prompts"]


@attrs.define(eq=False)
class _LiveCache:
    """What calls change in place, shared by every session value of one :func:`start_session`."""

    decoder: Decoder | None  #: None once the session has ended
    slot: int  #: the next free cache slot: only the session value whose ``slot`` it is may continue


@attrs.frozen
class NativeSession:
    """A multi-turn session of a :class:`~backends.rollout.native.NativeRollout`: rows whose KV caches continue
    across turns.

    :func:`continue_session` returns the next value; the cache they refer to is changed in place, so only
    the newest value continues (an older one raises), and a failed call leaves its input usable. Do not
    sync weights during a session: its cache holds keys and values of the weights it started with.
    """

    #: the NativeRollout it samples from (backends.rollout.native, which imports this module)
    rollout: Any = attrs.field(eq=False, repr=False)
    sampling: SamplingConfig  #: temperature, top-k, top-p (``n`` copies per prompt; ``max_new_tokens`` unused)
    #: per row: the prompt's tokens, then every token the calls added, in order
    tokens: tuple[tuple[int, ...], ...]
    prompt_slots: int  #: cache slots the left-padded prompts take
    max_slots: int  #: cache slots after the prompts that the whole session may use
    slot: int  #: the next cache slot a step writes
    #: per row: its last sampled token (it ended a turn) while not yet fed to the model; the next call feeds it first
    unfed: tuple[int | None, ...]
    #: (rows,) int64: each row's RoPE position for its next fed token (the number of its tokens fed so far)
    positions: Tensor = attrs.field(eq=False, repr=False)
    #: (rows v) fp32: each row's next-token logits after the tokens fed so far
    logits: Tensor = attrs.field(eq=False, repr=False)
    #: (rows,) int64: tokens each row has sampled in the session (the ``uniforms`` column of its next sample)
    num_sampled: Tensor = attrs.field(eq=False, repr=False)
    generator: torch.Generator = attrs.field(eq=False, repr=False)
    #: (rows, max_slots + 1) fp32 from ``generator``: row r's k-th sample of the session inverts the CDF at
    #: ``uniforms[r, k]``, so its samples do not depend on the other rows; None when greedy
    uniforms: Tensor | None = attrs.field(eq=False, repr=False)
    live: _LiveCache = attrs.field(eq=False, repr=False)

    @property
    def slots_left(self) -> int:
        """Cache slots the session may still write (one per step of a call: see :func:`continue_session`)."""
        return self.max_slots - (self.slot - self.prompt_slots)

    def continue_turn(
        self, forced: Sequence[Sequence[int]], *, active: Sequence[bool], max_new_tokens: Sequence[int]
    ) -> tuple[NativeSession, TurnOutput]:
        return continue_session(self, forced, active=active, max_new_tokens=max_new_tokens)

    def end(self) -> None:
        end_session(self)


def session_prompts(
    rollout: Any, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, max_slots: int
) -> list[list[int]]:
    """The prompts, checked as ``generate`` checks them, with ``max_slots`` in place of ``max_new_tokens``."""
    context = rollout.max_context
    if not 1 <= max_slots < context:
        raise ValueError(
            f"max_slots must be in [1, {context}) (the rollout's context is {context} positions), got {max_slots}"
        )
    if not sampling.truncate_prompts and isinstance(prompts, Sequence):
        for i, prompt in enumerate(prompts):
            if len(prompt) + max_slots > context:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens; with max_slots={max_slots} the session needs "
                    f"{len(prompt) + max_slots} positions, more than the context of {context} (lower max_slots "
                    "or set truncate_prompts=True to keep the last tokens)"
                )
    slots_as_budget = attrs.evolve(sampling, max_new_tokens=max_slots)
    return prepare_prompts(prompts, slots_as_budget, max_context=context, vocab_size=rollout.vocab_size)


def start_session(
    rollout: Any, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *, seed: int, max_slots: int
) -> NativeSession:
    """Prefill ``prompts`` once and open a multi-turn session over ``sampling.n`` rows per prompt.

    Rows are in :func:`generate`'s order (prompt i's ``n`` copies consecutive). ``max_slots``: the cache
    slots after the prompts that the whole session may use; a call that needs more raises an error
    naming it. Randomness comes only from a fresh generator seeded with ``seed``: the same seed, prompts,
    forced tokens and weights give the same session. The session allocates its own caches, so ``generate``
    may run on the same rollout between its turns; :func:`end_session` releases them.
    """
    prompts = session_prompts(rollout, prompts, sampling, max_slots)
    n, device = sampling.n, rollout.device
    rows = len(prompts) * n
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    prompt_ids, prompt_mask = left_pad(prompts, rollout.pad_token_id)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    p = prompt_ids.shape[1]
    with torch.inference_mode():
        decoder = Decoder(
            rollout.model, rows, p + max_slots, rollout.prepack_cpu_weights, rollout.workspace, own_cache=True
        )
        logits = decoder.prefill(prompt_ids, prompt_mask, copies=n).float().repeat_interleave(n, dim=0)
        uniforms = None
        if sampling.temperature > 0.0:
            # one uniform per row and per sample it can draw: every sample but its latest one takes a slot
            uniforms = torch.rand((rows, max_slots + 1), generator=generator, device=device)
    return NativeSession(
        rollout=rollout,
        sampling=sampling,
        tokens=tuple(tuple(prompts[r // n]) for r in range(rows)),
        prompt_slots=p,
        max_slots=max_slots,
        slot=p,
        unfed=(None,) * rows,
        positions=prompt_mask.sum(-1).repeat_interleave(n),
        logits=logits,
        num_sampled=torch.zeros(rows, dtype=torch.long, device=device),
        generator=generator,
        uniforms=uniforms,
        live=_LiveCache(decoder=decoder, slot=p),
    )


def end_session(session: NativeSession) -> None:
    """Release the session's caches; continuing it (or any value of it) afterwards raises."""
    if session.live.decoder is not None:
        session.live.decoder.release()
        session.live.decoder = None


def _check_turn(
    session: NativeSession, forced: Sequence[Sequence[int]], active: Sequence[bool], max_new_tokens: Sequence[int]
) -> tuple[list[list[int]], list[bool], list[int]]:
    """The call's arguments as plain lists, checked against the session."""
    if session.live.decoder is None:
        raise RuntimeError("continue_session: the session has ended (end_session was called)")
    if session.live.slot != session.slot:
        raise RuntimeError("continue_session: a stale session value; continue the one the last call returned")
    rows, vocab = len(session.tokens), session.rollout.vocab_size
    for name, value in (("forced", forced), ("active", active), ("max_new_tokens", max_new_tokens)):
        if len(value) != rows:
            raise ValueError(f"continue_session: {name} needs one entry per row ({rows}), got {len(value)}")
    forced = [row.tolist() if isinstance(row, Tensor) else [int(t) for t in row] for row in forced]
    active = [bool(a) for a in active]
    budgets = [int(m) for m in max_new_tokens]
    for row, (ids, act, budget) in enumerate(zip(forced, active, budgets)):
        if ids and not act:
            raise ValueError(f"continue_session: row {row} is inactive but has {len(ids)} forced tokens")
        if ids and not 0 <= min(ids) <= max(ids) < vocab:
            raise ValueError(f"continue_session: row {row}'s forced tokens are outside [0, {vocab})")
        if budget < 0:
            raise ValueError(f"continue_session: max_new_tokens[{row}] must be >= 0, got {budget}")
    return forced, active, budgets


def continue_session(
    session: NativeSession, forced: Sequence[Sequence[int]], *, active: Sequence[bool], max_new_tokens: Sequence[int]
) -> tuple[NativeSession, TurnOutput]:
    """Continue every active row by one turn: feed its ``forced`` tokens (given, never sampled: an
    observation, a tool result), then sample until an EOS or ``max_new_tokens[row]`` sampled tokens.

    Inactive rows add nothing (empty lists, ``finished`` False) and must have no forced tokens. A row's
    sampled log-probs are raw (temperature 1), as :func:`generate`'s ``rollout_logprobs``; forced tokens
    get 0.0. The token that ended a row's turn is fed at the start of its next active call, so a call
    takes at most ``max over active rows of (pending + len(forced) + max(max_new_tokens - 1, 0))`` steps
    (pending: 1 if the row sampled in an earlier call, else 0), one cache slot each; when
    :attr:`NativeSession.slots_left` runs out it raises a ``ValueError`` naming ``max_slots``, and the input
    session stays usable (retry it with smaller budgets, or end it).
    """
    forced, active, budgets = _check_turn(session, forced, active, max_new_tokens)
    rows, device = len(session.tokens), session.rollout.device
    pending = [[u] if act and u is not None else [] for u, act in zip(session.unfed, active)]
    queues = [pend + ids for pend, ids in zip(pending, forced)]
    queue = torch.full((rows, max(1, *map(len, queues))), session.rollout.pad_token_id, dtype=torch.long)
    for row, ids in enumerate(queues):
        queue[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    plan = _TurnPlan(
        queue=queue.to(device),
        queue_len=torch.tensor(list(map(len, queues)), dtype=torch.long, device=device),
        first_out=torch.tensor(list(map(len, pending)), dtype=torch.long, device=device),
        in_turn=torch.tensor(active, dtype=torch.bool, device=device),
        budget=torch.tensor(budgets, dtype=torch.long, device=device),
    )
    with torch.inference_mode():
        turn = _run_turn(session, plan)
    out = _turn_output(turn.events, turn.finished)
    ends = turn.last_sample.tolist()
    unfed = tuple(int(e) if e >= 0 else (None if act else u) for e, act, u in zip(ends, active, session.unfed))
    session.live.slot = turn.slot
    new = attrs.evolve(
        session,
        tokens=tuple(old + tuple(added) for old, added in zip(session.tokens, out.tokens)),
        slot=turn.slot,
        unfed=unfed,
        positions=turn.positions,
        logits=turn.logits,
        num_sampled=turn.num_sampled,
    )
    return new, out


@attrs.frozen
class _TurnPlan:
    """One call's work per row, on the device."""

    queue: Tensor  #: (rows q) int64: the tokens to feed before sampling (the unfed one, then the forced ones)
    queue_len: Tensor  #: (rows,) int64
    first_out: Tensor  #: (rows,) int64: queue index of the first forced token (earlier ones were added before)
    in_turn: Tensor  #: (rows,) bool: the active rows
    budget: Tensor  #: (rows,) int64: max_new_tokens


@attrs.frozen
class _TurnResult:
    #: per step: token, log-prob and kind (0: nothing added, 1: forced, 2: sampled), each (rows,)
    events: list[tuple[Tensor, Tensor, Tensor]]
    last_sample: Tensor  #: (rows,) int64: the sampled token that ended each row's turn, unfed; -1 if none
    finished: Tensor  #: (rows,) bool: the turn ended with an EOS
    positions: Tensor
    logits: Tensor
    num_sampled: Tensor
    slot: int


#: a step runs every row while more than this share of them is in its turn; below it, only those rows (gathering
#: their caches costs about what computing the others would save)
_FULL_STEP_FRACTION = 0.75


def _run_turn(session: NativeSession, plan: _TurnPlan) -> _TurnResult:
    """The step loop of one call: each step, every row still in its turn samples (when it has nothing left
    to feed) and feeds one token; the others feed a masked dummy. Ends when no row is in its turn."""
    rollout, sampling, decoder = session.rollout, session.sampling, session.live.decoder
    rows, device = plan.queue.shape[0], plan.queue.device
    eos = torch.tensor(rollout.eos_token_ids, device=device)
    row_index = torch.arange(rows, device=device)
    logits, positions, num_sampled = session.logits, session.positions.clone(), session.num_sampled.clone()
    in_turn = plan.in_turn.clone()
    fed = torch.zeros(rows, dtype=torch.long, device=device)  # queue tokens fed so far
    sampled = torch.zeros(rows, dtype=torch.long, device=device)  # tokens sampled this call
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    last_sample = torch.full((rows,), -1, dtype=torch.long, device=device)
    events: list[tuple[Tensor, Tensor, Tensor]] = []
    slot = session.slot
    if _fits_a_chunk(session, plan):
        logits, positions, fed, slot, events = _feed_queues(session, plan, logits, positions)
    while True:
        queue_empty = fed >= plan.queue_len
        in_turn &= ~(queue_empty & (sampled >= plan.budget))  # a zero budget: nothing to sample
        sampling_now = in_turn & queue_empty
        uniform = None
        if session.uniforms is not None:
            uniform = session.uniforms.gather(1, num_sampled.clamp(max=session.max_slots)[:, None])
        drawn = sample_tokens(logits, sampling, None, uniform=uniform)
        logprob = torch.log_softmax(logits, dim=-1).gather(-1, drawn[:, None]).squeeze(-1)
        token = torch.where(sampling_now, drawn, plan.queue[row_index, fed.clamp(max=plan.queue.shape[1] - 1)])
        sampled += sampling_now
        num_sampled += sampling_now
        is_eos = sampling_now & torch.isin(drawn, eos)
        ends = is_eos | (sampling_now & (sampled >= plan.budget))
        finished |= is_eos
        last_sample = torch.where(ends, drawn, last_sample)
        forced_out = in_turn & ~sampling_now & (fed >= plan.first_out)
        kind = torch.where(sampling_now, 2, forced_out.long())
        events.append((token, torch.where(sampling_now, logprob, 0.0), kind))
        in_turn &= ~ends
        if not bool(in_turn.any()):
            break
        if slot - session.prompt_slots >= session.max_slots:
            raise ValueError(
                f"continue_session: the session needs more than max_slots={session.max_slots} cache slots (this "
                f"call had {session.slots_left} left): start it with a larger max_slots or give smaller budgets"
            )
        fed += in_turn & ~sampling_now
        feed = torch.where(in_turn, token, rollout.pad_token_id)
        stepping = in_turn.nonzero().squeeze(1)
        if stepping.numel() > _FULL_STEP_FRACTION * rows:
            stepped = decoder.step(feed, positions, slot, masked=~in_turn).float()
            logits = torch.where(in_turn[:, None], stepped, logits)
        else:  # most rows' turns are over: step only the rest (turns end at different lengths)
            stepped = decoder.step(feed[stepping], positions[stepping], slot, masked=~in_turn, rows=stepping).float()
            logits = logits.index_copy(0, stepping, stepped)
        positions += in_turn
        slot += 1
    return _TurnResult(
        events=events,
        last_sample=last_sample,
        finished=finished,
        positions=positions,
        logits=logits,
        num_sampled=num_sampled,
        slot=slot,
    )


def _fits_a_chunk(session: NativeSession, plan: _TurnPlan) -> bool:
    """Whether the queues go in as one chunk: there are some, and the chunk plus the longest turn still fit the
    session's slots (a chunk takes its widest queue's slots on every row, where one step per token lets short
    queues start sampling early; when that would not fit, the step loop feeds them)."""
    width = plan.queue.shape[1] if bool(plan.queue_len.gt(0).any()) else 0
    return 0 < width and session.slot + width + int(plan.budget.max()) <= session.prompt_slots + session.max_slots


def _feed_queues(
    session: NativeSession, plan: _TurnPlan, logits: Tensor, positions: Tensor
) -> tuple[Tensor, Tensor, Tensor, int, list[tuple[Tensor, Tensor, Tensor]]]:
    """Every active row's queue (its unfed token, then its forced ones) in one forward over the cache: an
    observation costs one pass, not one decode step per token. Returns the logits after each row's queue, the
    new positions, the tokens fed, the next slot and the events (kind 1 for forced tokens, 0 for the rest)."""
    width = plan.queue.shape[1]
    offsets = torch.arange(width, device=positions.device)
    valid = (offsets < plan.queue_len[:, None]) & plan.in_turn[:, None]
    chunk_positions = positions[:, None] + torch.minimum(offsets, (plan.queue_len - 1).clamp(min=0)[:, None])
    stepped = session.live.decoder.extend(plan.queue, chunk_positions, session.slot, valid).float()
    fed_any = valid.any(-1)
    logits = torch.where(fed_any[:, None], stepped, logits)
    fed = valid.sum(-1)
    kinds = (valid & (offsets >= plan.first_out[:, None])).long()
    zeros = torch.zeros(plan.queue.shape[0], device=positions.device)
    events = [(plan.queue[:, j], zeros, kinds[:, j]) for j in range(width)]
    return logits, positions + fed, fed, session.slot + width, events


def _turn_output(events: list[tuple[Tensor, Tensor, Tensor]], finished: Tensor) -> TurnOutput:
    """The per-row lists of a call from its per-step events."""
    tokens, logprobs, kinds = (torch.stack(column, dim=1).tolist() for column in zip(*events))
    out_tokens, out_logprobs, out_sampled = [], [], []
    for row_tokens, row_logprobs, row_kinds in zip(tokens, logprobs, kinds):
        keep = [j for j, k in enumerate(row_kinds) if k]
        out_tokens.append([row_tokens[j] for j in keep])
        out_logprobs.append([row_logprobs[j] for j in keep])
        out_sampled.append([row_kinds[j] == 2 for j in keep])
    return TurnOutput(
        tokens=out_tokens, logprobs=out_logprobs, sampled=out_sampled, finished=[bool(f) for f in finished.tolist()]
    )

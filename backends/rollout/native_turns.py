"""Multi-turn trajectories on the native engine's continuous batching: a row continues as soon as its environment
has answered, while other rows are still in their turns (:class:`NativeTurnStream`, the native engine's
:class:`backends.rollout.engine.TurnStream`).

The turn-by-turn session (:mod:`backends.rollout.native_session`) runs every live row's turn in one call, so each
turn waits for the batch's longest turn and then for its slowest environment. Here the agent loop drives the engine
one iteration at a time (:meth:`NativeTurnStream.step`, as vLLM's ``LLMEngine.step``) and hands a row its next turn
(:meth:`NativeTurnStream.resume`) whenever its environment has answered. Each iteration:

1. admits waiting prompts into free slots of a paged KV cache (:mod:`backends.rollout.paged_kv`) and prefills each
   once: its ``n`` rows share its blocks, as in ``generate``. A row's slot promises the blocks of its whole
   conversation (``max_slots`` tokens after the prompt), so a running row never waits for memory; a conversation
   that can never fit is refused before any work, naming ``rollout.native.kv_cache_gib``;
2. feeds each resumed row its pending tokens (the token that ended its last turn, then its environment's
   observation) in one forward over the row's own blocks (:meth:`Decoder.extend_paged`);
3. samples one token for every row in its turn; a row whose turn ended (EOS, or its turn's token limit) leaves the
   working batch but keeps its slot and blocks until the agent loop closes it (:meth:`NativeTurnStream.close`);
4. runs one decode step of the rows still in their turns (on CUDA replayed from a CUDA graph:
   :mod:`backends.rollout.decode_graphs`).

The bookkeeping is the host's; an iteration reads the device once, for the sampled tokens and their log-probs. On
CUDA (``rollout.native.overlap_steps``) steps 3 and 4 overlap as in :mod:`backends.rollout.scheduler`: the decode
step of every sampled row is queued before the tokens are read, so a row whose turn just ended has fed its last
token already (what its next turn would feed first) and keeps that step's logits for its next turn; a row whose
conversation is full is left out, as it has no next turn.

Randomness: row ``r``'s ``k``-th sampled token of the conversation inverts its CDF at ``uniforms[r, k]``, the
table the turn-by-turn session draws from the same seed, so both paths sample the same tokens from the same logits,
whichever rows share an iteration and whenever an environment answered. The logits themselves are computed in other
batch shapes (a row's observation in a chunk with other rows', decode steps with other rows), which changes them by
float rounding only: a token differs only where a uniform falls within that rounding of a CDF boundary.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

import torch
from torch import Tensor

from backends.rollout.common import (
    EndedTurn,
    HostCopy,
    SamplingConfig,
    checked_turn,
    left_pad,
    on_device,
    sample_tokens,
)
from backends.rollout.decoder import Decoder
from backends.rollout.native_session import session_prompts
from backends.rollout.paged_kv import blocks_for_request
from backends.rollout.scheduler import DEFAULT_MAX_SLOTS, BatchingLimits, paged_decoder, pool_blocks

__all__ = ["NativeTurnStream"]


class NativeTurnStream:
    """The rows of a multi-turn rollout on a paged KV cache, continued turn by turn, each on its own time (see the
    module docstring). Rows are in ``generate``'s order (prompt ``i``'s ``n`` samples are rows ``i*n .. i*n+n-1``).

    Not thread-safe; the caches are the stream's own, so ``generate`` may run on the same rollout while it is open.
    """

    def __init__(
        self,
        rollout: Any,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        *,
        seed: int,
        max_slots: int,
        limits: BatchingLimits,
    ) -> None:
        self.prompts = session_prompts(rollout, prompts, sampling, max_slots)
        self.rollout, self.sampling, self.max_slots = rollout, sampling, max_slots
        self.n, self.device = sampling.n, rollout.device
        rows = len(self.prompts) * self.n
        slots = min(rows, limits.max_slots or DEFAULT_MAX_SLOTS)
        if slots < self.n:
            raise ValueError(
                f"rollout.native.max_slots={slots} is fewer than rollout.n={self.n}: a prompt's samples are admitted "
                "together, so the slots must hold n rows at least"
            )
        bs = limits.block_size
        self.max_len = max_len = max(map(len, self.prompts)) + max_slots  #: the positions a row may reach
        num_blocks = pool_blocks(rollout, limits, slots, max_len)
        self.needs = [blocks_for_request(len(p), self.n, max_slots, bs) for p in self.prompts]
        for i, need in enumerate(self.needs):
            if need > num_blocks - 1:
                raise ValueError(
                    f"the conversations of prompt {i} ({len(self.prompts[i])} tokens, n={self.n}, up to {max_slots} "
                    f"tokens of turns and observations each) need {need} KV-cache blocks of {bs} tokens, more than the "
                    f"whole cache holds ({max(num_blocks - 1, 0)} blocks): raise rollout.native.kv_cache_gib, or "
                    "lower rollout.n or rollout.multi_turn.max_total_tokens"
                )
        decoder, self.cache, self.graphed_step = paged_decoder(
            rollout, limits, slots, max_len, num_blocks, own_cache=True
        )
        self.decoder: Decoder | None = decoder
        #: queue each decode step before reading the tokens it feeds (see the module docstring)
        self.overlap = self.device.type == "cuda" and limits.overlap_steps
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        # the turn-by-turn session's table (backends.rollout.native_session.start_session): the same draws per row
        self.uniforms = None
        if sampling.temperature > 0.0:
            self.uniforms = torch.rand((rows, max_slots + 1), generator=generator, device=self.device)
        self.eos_ids = set(rollout.eos_token_ids)
        self.waiting = collections.deque(range(len(self.prompts)))
        self.free_slots = list(range(slots - 1, -1, -1))
        self.slot_of = [-1] * rows  #: each row's cache slot; -1: not admitted yet, or closed
        self.closed = [False] * rows
        self.position = [0] * rows  #: tokens in each row's cache
        self.added = [0] * rows  #: tokens each row's turns added after its prompt (fed, sampled, given)
        self.num_sampled = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.unfed: list[int | None] = [None] * rows  #: the token that ended a row's last turn, not yet fed
        self.queue: list[list[int] | None] = [None] * rows  #: a resumed row's given tokens; None: not resumed
        self.limit = [0] * rows  #: the sampled tokens a resumed row's turn may take
        self.parked: dict[int, Tensor] = {}  #: next-token logits of admitted rows not yet resumed
        self.turn: dict[int, tuple[list[int], list[float], list[bool]]] = {}  #: the open turns' outputs so far
        # the working rows (in a turn, with next-token logits), in the order the decode step computes them
        self.work_rows: list[int] = []
        self.work_logits = torch.zeros(0, rollout.vocab_size, device=self.device)
        self.iterations = 0
        self.peak_blocks = 0  #: the most blocks held at once

    # ---------------------------------------------------------------------------------------------- the caller's side

    @property
    def busy(self) -> bool:
        """Some row is in a turn: :meth:`step` has work."""
        return any(q is not None for q in self.queue) or bool(self.work_rows)

    def resume(self, row: int, forced: Sequence[int], max_new_tokens: int) -> None:
        """Start ``row``'s next turn: feed it ``forced`` (given tokens, never sampled: an observation), then sample up
        to an EOS or ``max_new_tokens`` tokens. Its first turn has no forced tokens."""
        self._check_open()
        forced = checked_turn(
            "NativeTurnStream.resume",
            row,
            forced,
            max_new_tokens,
            closed=self.closed,
            in_turn=lambda r: self.queue[r] is not None or r in self.turn,
            added=self.added.__getitem__,
            vocab_size=self.rollout.vocab_size,
            max_slots=self.max_slots,
        )
        self.queue[row], self.limit[row] = forced, max_new_tokens
        self.turn[row] = ([], [], [])

    def close(self, row: int) -> None:
        """``row``'s trajectory is over: its slot and blocks go back to the cache (closing twice is a no-op)."""
        if self.queue[row] is not None or row in self.work_rows:
            raise ValueError(f"NativeTurnStream.close: row {row} is still in its turn")
        self.closed[row] = True
        self.parked.pop(row, None)
        slot = self.slot_of[row]
        if slot >= 0 and self.decoder is not None:
            self.cache.release(slot)
            self.free_slots.append(slot)
            self.slot_of[row] = -1

    def end(self) -> None:
        """Release the caches; the stream cannot step afterwards."""
        if self.decoder is not None:
            self.decoder.release()
            self.decoder = None

    def step(self) -> list[EndedTurn]:
        """One iteration (see the module docstring): the turns that ended in it."""
        self._check_open()
        with torch.inference_mode():
            self._admit()
            feeding = self._take_resumed()
            if not self.work_rows and not feeding:
                return []
            self.iterations += 1
            self.peak_blocks = max(self.peak_blocks, self.cache.pool.usable - len(self.cache.pool.free))
            if not self.work_rows:
                self._forward(None, feeding)
                return []
            sampled_rows = list(self.work_rows)
            token, sampled = self._sample()
            if not self.overlap:
                ended, keep = self._end_turns(sampled_rows, sampled.values())
                if len(keep) < len(sampled_rows):
                    token = token[on_device(keep, self.device)]
                self._forward(token, feeding)
                return ended
            # the step is queued before the tokens reach the host: every row feeds the token it sampled, except a
            # row whose conversation is full (it has no next turn, and its blocks hold no position for that token)
            fed = [i for i, r in enumerate(sampled_rows) if self.added[r] < self.max_slots]
            if len(fed) < len(sampled_rows):
                index = on_device(fed, self.device)
                self.work_rows = [sampled_rows[i] for i in fed]
                self.work_logits, token = self.work_logits[index], token[index]
            self._forward(token, feeding)
            ended, _ = self._end_turns(sampled_rows, sampled.values())
        return ended

    # ---------------------------------------------------------------------------------------------- one iteration

    def _check_open(self) -> None:
        if self.decoder is None:
            raise RuntimeError("NativeTurnStream: the stream has ended (end was called)")

    def _admit(self) -> None:
        """Prefill the waiting prompts that fit (slots and blocks) once each; their rows' logits parked."""
        admitted, pool = [], self.cache.pool
        while self.waiting and len(self.free_slots) >= self.n and self.needs[self.waiting[0]] <= pool.available:
            i = self.waiting.popleft()
            slots = [self.free_slots.pop() for _ in range(self.n)]
            self.cache.admit(slots, len(self.prompts[i]), self.max_slots)
            admitted.append((i, slots))
        if not admitted:
            return
        prompts = [self.prompts[i] for i, _ in admitted]
        ids, mask = left_pad(prompts, self.rollout.pad_token_id)
        ids, mask = on_device(ids, self.device), on_device(mask, self.device)
        first_slots = on_device([slots[0] for _, slots in admitted], self.device)
        self.cache.begin_prefill(first_slots, mask, sum(map(len, prompts)))
        logits = self.decoder.prefill(ids, mask, copies=1).float()
        for (i, slots), row_logits in zip(admitted, logits):
            for j, slot in enumerate(slots):
                row = i * self.n + j
                self.slot_of[row], self.position[row] = slot, len(self.prompts[i])
                self.parked[row] = row_logits

    def _take_resumed(self) -> list[tuple[int, list[int]]]:
        """Resumed, admitted rows: those with nothing to feed (a first turn) join the working batch with their
        prompt's logits; the others, with the tokens they feed (the one that ended their last turn, then the given
        ones), are returned."""
        ready = [r for r, q in enumerate(self.queue) if q is not None and self.slot_of[r] >= 0]
        parked, feeding = [], []
        for r in ready:
            pending = ([self.unfed[r]] if self.unfed[r] is not None else []) + self.queue[r]
            out_tokens, out_logprobs, out_sampled = self.turn[r]
            out_tokens += self.queue[r]
            out_logprobs += [0.0] * len(self.queue[r])
            out_sampled += [False] * len(self.queue[r])
            self.added[r] += len(self.queue[r])
            self.queue[r], self.unfed[r] = None, None
            if pending:
                feeding.append((r, pending))
                self.parked.pop(r, None)
            else:
                parked.append(r)
        if parked:
            self.work_rows += parked
            self.work_logits = torch.cat([self.work_logits, torch.stack([self.parked.pop(r) for r in parked])])
        return feeding

    def _forward(self, token: Tensor | None, feeding: list[tuple[int, list[int]]]) -> None:
        """The working rows' decode step (each feeds its entry of ``token``, the token it just sampled) and the
        resumed rows' tokens, in one forward where the step is not replayed from a CUDA graph; the resumed rows join
        the working batch."""
        if not self.work_rows and not feeding:
            return  # every working row's turn ended, and no row resumed: the next rows come with later answers
        step = self._step_inputs(token) if self.work_rows else None
        chunk = self._chunk_inputs(feeding) if feeding else None
        if step is not None and chunk is not None and self.graphed_step is None:
            logits = self.decoder.step_and_extend_paged(step, chunk)
        else:
            parts = []
            if step is not None:
                if self.graphed_step is not None:
                    parts.append(self.graphed_step(*step).float())  # read now: a replay overwrites its logits
                else:
                    parts.append(self.decoder.step_paged(*step))
            if chunk is not None:
                parts.append(self.decoder.extend_paged(*chunk))
            logits = torch.cat(parts)
        for r in self.work_rows:
            self.position[r] += 1
        for r, pending in feeding:
            self.position[r] += len(pending)
        self.work_rows += [r for r, _ in feeding]
        self.work_logits = logits.float()

    def _chunk_inputs(self, feeding: list[tuple[int, list[int]]]) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
        """Tokens, slots, positions and valid marks ``(b c)`` of the rows' pending tokens, their blocks grown, and
        the keys the chunk attends (its longest row's positions, from the host's bookkeeping: no device read)."""
        width = max(len(p) for _, p in feeding)
        tokens = torch.full((len(feeding), width), self.rollout.pad_token_id, dtype=torch.long)
        for i, (_, pending) in enumerate(feeding):
            tokens[i, : len(pending)] = torch.tensor(pending, dtype=torch.long)
        lengths = torch.tensor([len(p) for _, p in feeding], dtype=torch.long)
        start = torch.tensor([self.position[r] for r, _ in feeding], dtype=torch.long)
        offsets = torch.arange(width)
        valid = offsets[None] < lengths[:, None]
        positions = start[:, None] + torch.minimum(offsets[None], (lengths - 1)[:, None])
        slot_list = [self.slot_of[r] for r, _ in feeding]
        for j in range(width):  # each position's block made the row's own, one position per slot at a time
            rows = [i for i, (_, pending) in enumerate(feeding) if j < len(pending)]
            self.cache.grow([slot_list[i] for i in rows], [self.position[feeding[i][0]] + j for i in rows])
        slots = on_device(slot_list, self.device)
        tokens, positions, valid = on_device([tokens.tolist(), positions.tolist(), valid.long().tolist()], self.device)
        valid = valid.bool()
        return tokens, slots, positions, valid, max(self.position[r] + len(pending) for r, pending in feeding)

    def _step_inputs(self, token: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
        """Tokens, slots and positions of the working rows' decode step, their blocks grown, and the keys the step
        attends (its longest row's positions, from the host's bookkeeping: no device read)."""
        slot_list = [self.slot_of[r] for r in self.work_rows]
        position_list = [self.position[r] for r in self.work_rows]
        self.cache.grow(slot_list, position_list)  # host lists: its bookkeeping reads nothing from the device
        slots, positions = on_device([slot_list, position_list], self.device)  # one copy
        return token, slots, positions, max(position_list) + 1

    def _sample(self) -> tuple[Tensor, HostCopy]:
        """One token for every working row (each row's count of conversation tokens goes up by one): the tokens on
        the device, and their copy to the host with their log-probs (float64 holds both exactly: one read)."""
        rows = on_device(self.work_rows, self.device)
        logits = self.work_logits
        uniform = None
        if self.uniforms is not None:
            uniform = self.uniforms[rows, self.num_sampled[rows].clamp(max=self.max_slots)][:, None]
        token = sample_tokens(logits, self.sampling, None, uniform=uniform)
        logprob = torch.log_softmax(logits, dim=-1).gather(-1, token[:, None]).squeeze(-1)
        self.num_sampled[rows] += 1
        for r in self.work_rows:
            self.added[r] += 1
        return token, HostCopy(torch.stack([token.double(), logprob.double()]))

    def _end_turns(self, rows: list[int], sampled: list[list[float]]) -> tuple[list[EndedTurn], list[int]]:
        """Record the tokens and log-probs ``sampled`` of ``rows`` (the rows just sampled, in order) in their turns;
        the turns that ended (EOS, or the turn's token limit) leave the working batch. Returns them, and the indices
        of the working rows kept. A row still in the working batch fed its last token in the step after its sample
        (overlapped), so its next turn starts from that step's logits; the others keep the token to feed it."""
        tokens, logprobs = sampled
        working = {r: k for k, r in enumerate(self.work_rows)}
        ended, gone = [], set()
        for r, t, lp in zip(rows, map(int, tokens), logprobs):
            out_tokens, out_logprobs, out_sampled = self.turn[r]
            out_tokens.append(t), out_logprobs.append(lp), out_sampled.append(True)
            eos = t in self.eos_ids
            if not (eos or sum(out_sampled) >= self.limit[r]):
                continue
            if self.overlap and r in working:
                self.parked[r] = self.work_logits[working[r]]
            else:
                self.unfed[r] = t
            del self.turn[r]
            gone.add(r)
            ended.append(EndedTurn(r, out_tokens, out_logprobs, out_sampled, finished=eos))
        keep = [k for k, r in enumerate(self.work_rows) if r not in gone]
        if len(keep) < len(self.work_rows):
            self.work_rows = [self.work_rows[k] for k in keep]
            self.work_logits = self.work_logits[on_device(keep, self.device)]
        return ended, keep

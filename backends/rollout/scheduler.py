"""Continuous batching for the native engine: a fixed number of slots, requests admitted as rows finish.

A request is one prompt and its samples (``n``, each with its own draw key and token limit): a call's prompts are
queued when the batcher is built, and a batch left open (a rollout server's: :mod:`backends.rollout.native_requests`)
takes more while it runs (:meth:`ContinuousBatcher.submit`). Each iteration (:meth:`ContinuousBatcher.step`):

1. admits waiting requests, in order, while their samples find free slots, the paged cache can promise their
   longest possible length (:func:`backends.rollout.paged_kv.blocks_for_request`) and their prompts fit what is
   left of the iteration's prefill budget (``prefill_tokens``) after the next chunk of a prompt being fed in chunks
   (below);
2. prefills the admitted prompts together, once per prompt (the samples share its blocks); with ``prefix_cache``, a
   prompt whose first blocks are cached feeds only the tokens after them, as one chunk attending over them
   (:meth:`backends.rollout.paged_kv.PagedKVCache.cached_prefix`);
3. samples one token for every working row (the new rows from their prompt's last logits), with the uniform keyed
   by the row's key (a call's seed and the row's index in it) and its number of tokens so far
   (:func:`backends.rollout.row_random.keyed_uniforms`);
4. frees the rows that ended (EOS, or their request's ``max_new_tokens`` tokens) and their slots and blocks (with
   ``prefix_cache``, their full blocks remembered first);
5. runs one decode step of the rows still running, each at its own position (on CUDA replayed from a CUDA graph
   of the step at fixed shapes: :mod:`backends.rollout.decode_graphs`).

So a short row's slot takes the next request at once instead of idling until the batch's longest row ends, and
more requests than slots stream through a bounded cache. The prefill of new prompts and the decode step of running
rows are two forwards of one iteration (not one packed forward). A prompt longer than ``prefill_tokens`` is fed in
chunks of at most that many tokens, one per iteration, each attending over the chunks before it (chunked prefill,
as vLLM and SGLang schedule it): an iteration's prefill work stays bounded, so the running rows keep decoding beside
a long prompt, and no attention mask grows with the square of the whole prompt.

The bookkeeping (slots, positions, tokens drawn, blocks) and the outputs are the host's, in lists: an iteration
waits for the device once, for the tokens it sampled (to see the EOS) and their log-probs, and writes it once per
tensor it builds. On CUDA (``overlap``) steps 4
and 5 swap: the decode step of every row below its limit is queued first, the tokens are read while it runs, and a
row that sampled its EOS has stepped once for nothing (its logits are dropped). The host then never holds the
device idle between two steps (TensorRT-LLM's overlap scheduler and SGLang's zero-overhead scheduler make the same
trade: one extra step per finished row); on a CPU, where a step runs as it is called, nothing overlaps and the
batcher waits for the tokens first.

**Partial rollouts** (``updates``, a :class:`WeightUpdates`): every ``updates.chunk_tokens`` iterations the batcher
stops at a chunk boundary and hands control to the caller (``updates.at_boundary()``), which may copy newer
weights into the engine. The unfinished rows then continue under them: their tokens so far stay, and their keys
and values are computed again from the prompt and those tokens (one prefill of the whole sequence per row, as
AReaL and SGLang recompute the cache after a weight update), because keys and values of the old weights must not
be attended by the new ones; the prefill's last logits are the next token's under the new weights. Each token
records the version of the weights that sampled it (``versions``), and its log-prob is under those weights.
The uniforms stay keyed by (seed, row, token index), so a row's draws do not depend on where the boundaries fell;
with unchanged weights at every boundary the tokens are the ones a call without ``updates`` samples.

Rows are numbered as :func:`backends.rollout.native.generate` numbers them (prompt ``i``'s samples are rows
``i*n .. i*n+n-1``), so the lock-step loop and this one draw the same uniforms for the same row and token.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Protocol

import attrs
import torch
from torch import Tensor

from backends.rollout.common import HostCopy, SamplingConfig, left_pad, on_device, sample_tokens
from backends.rollout.decode_graphs import GraphedDecodeStep
from backends.rollout.decoder import Decoder
from backends.rollout.paged_kv import PagedKVCache, blocks_for_request, pool_blocks_for_budget, request_too_large
from backends.rollout.row_random import RowKeys, keyed_uniforms, seed_word

__all__ = [
    "BatchingLimits",
    "ContinuousBatcher",
    "WeightUpdates",
    "generate_continuous",
    "paged_decoder",
    "pool_blocks",
]


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"BatchingLimits.{attribute.name} must be positive, got {value}")


@attrs.frozen
class BatchingLimits:
    """How much continuous batching runs at once (``NativeRollout.batching_limits``)."""

    #: rows decoded together (each a slot); None: every row of the call, up to :data:`DEFAULT_MAX_SLOTS`
    max_slots: int | None = attrs.field(default=None, validator=_positive)
    #: the most prompt tokens one iteration computes (a longer prompt is fed in chunks of this many)
    prefill_tokens: int = attrs.field(default=4096, validator=_positive)
    #: tokens per KV-cache block: a decode step gathers whole blocks, so the longest row's last block is padding; on
    #: a CPU 8 ran config B's decode faster than 16 or 4 (less padding, blocks still long enough to copy fast)
    block_size: int = attrs.field(default=8, validator=_positive)
    #: keys and values of the pool, in GiB; None: enough for ``max_slots`` rows at their longest
    kv_cache_gib: float | None = attrs.field(default=None, validator=_positive)
    #: on CUDA, replay the decode step from CUDA graphs (:mod:`backends.rollout.decode_graphs`)
    cuda_graphs: bool = True
    #: on CUDA, queue each decode step before reading the tokens sampled before it (see the module docstring)
    overlap_steps: bool = True
    #: a batch left open (a rollout server's) keeps its ended rows' full blocks for prompts that start with them
    prefix_cache: bool = True


#: the default number of slots: rows beyond it wait for a free one
DEFAULT_MAX_SLOTS = 1024


class WeightUpdates(Protocol):
    """The caller's side of a generation that may take new weights at chunk boundaries (partial rollouts)."""

    chunk_tokens: int  #: decode iterations between two boundaries

    def version(self) -> int:
        """The version of the weights the engine holds now (what the next sampled tokens are stamped with)."""
        ...

    def at_boundary(self) -> Any | None:
        """Called at a chunk boundary: copy newer weights into the engine's model (in place, as ``sync_weights``
        does) and return the engine's new value, or return None to go on with the weights it has."""
        ...


@attrs.define
class _Working:
    """The running rows, in the order the decode step computes them: host lists of length ``b`` (the scheduler's
    bookkeeping never reads the device) and their next-token logits on the device."""

    slot: list[int]  #: cache slot
    row: list[int]  #: row of the output
    position: list[int]  #: position of the next token to feed (the tokens the row holds)
    drawn: list[int]  #: tokens sampled so far
    logits: Tensor  #: (b v) fp32: next-token logits

    def select(self, index: list[int], logits: Tensor) -> _Working:
        """Rows ``index``, in that order, with ``logits``."""
        return _Working(*([values[i] for i in index] for values in self._lists()), logits)

    def keep(self, index: list[int]) -> None:
        """Keep rows ``index``, in that order."""
        if len(index) != self.logits.shape[0]:
            self.logits = self.logits[on_device(index, self.logits.device)]
        self.slot, self.row, self.position, self.drawn = ([values[i] for i in index] for values in self._lists())

    def extend(self, other: _Working) -> None:
        for mine, theirs in zip(self._lists(), other._lists()):
            mine.extend(theirs)
        self.logits = torch.cat([self.logits, other.logits])

    def _lists(self) -> tuple[list[int], ...]:
        return self.slot, self.row, self.position, self.drawn


@attrs.define
class _Row:
    """One sample: what it continues, how far, how its draws are keyed, and what it sampled (on the host)."""

    prompt: list[int]
    limit: int  #: the most tokens it samples
    key_word: int  #: its uniforms are keyed by (key_word, key_row, token index): :func:`keyed_uniforms`
    key_row: int
    tokens: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    versions: list[int] = attrs.field(factory=list)  #: of the weights that sampled each token


@attrs.frozen
class _Group:
    """One prompt's samples: admitted together, they share the prompt's blocks."""

    prompt: list[int]
    rows: list[int]
    max_new: int
    need: int  #: blocks promised at admission (:func:`backends.rollout.paged_kv.blocks_for_request`)


@attrs.define
class _Filling:
    """An admitted prompt too long for one iteration's prefill budget: fed in chunks, one per iteration, until its
    samples join the working rows."""

    group: _Group
    slots: list[int]
    fed: int  #: prompt tokens whose keys and values are in its blocks


def _call_keys(seed: int | RowKeys, rows: range) -> list[tuple[int, int]]:
    """The draw keys of a call's ``rows`` seeded ``seed``: what :func:`row_uniforms` keys them by."""
    if isinstance(seed, RowKeys):
        if rows.stop > len(seed.rows):
            raise ValueError(f"RowKeys has {len(seed.rows)} rows; the call samples {rows.stop} at least")
        return [(seed.words[r], seed.rows[r]) for r in rows]
    word = seed_word(seed)
    return [(word, r) for r in rows]


def _prompt_limits(max_new_tokens: list[int] | None, prompts: int, default: int) -> list[int]:
    """Each prompt's most new tokens: ``max_new_tokens`` (checked) or ``default`` for all."""
    if max_new_tokens is None:
        return [default] * prompts
    if len(max_new_tokens) != prompts:
        raise ValueError(f"max_new_tokens has {len(max_new_tokens)} limits for {prompts} prompts: give one per prompt")
    bad = [(i, m) for i, m in enumerate(max_new_tokens) if not isinstance(m, int) or isinstance(m, bool) or m < 1]
    if bad:
        raise ValueError(f"max_new_tokens[{bad[0][0]}] is {bad[0][1]!r}: each prompt's limit must be an int >= 1")
    return list(max_new_tokens)


def pool_blocks(rollout: Any, limits: BatchingLimits, slots: int, max_len: int) -> int:
    """Blocks of a paged cache (the null block included) for ``slots`` rows of at most ``max_len`` positions:
    ``limits.kv_cache_gib`` worth, or, without a budget, every slot at its longest as if no block were shared."""
    bs = limits.block_size
    if limits.kv_cache_gib is None:
        return slots * -(-max_len // bs) + 1
    cfg = rollout.model.config
    # the decoder keeps keys and values in fp32 on the CPU, in the weights' dtype elsewhere
    weight_dtype = rollout.model.get_input_embeddings().weight.dtype
    return pool_blocks_for_budget(
        limits.kv_cache_gib,
        layers=cfg.num_hidden_layers,
        kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        block_size=bs,
        itemsize=4 if rollout.device.type == "cpu" else weight_dtype.itemsize,
    )


def paged_decoder(
    rollout: Any, limits: BatchingLimits, slots: int, max_len: int, num_blocks: int, *, own_cache: bool
) -> tuple[Decoder, PagedKVCache, GraphedDecodeStep | None]:
    """A decoder of ``rollout``'s model over an empty paged cache of ``num_blocks`` blocks (the null block
    included) for ``slots`` rows of at most ``max_len`` positions, and, on CUDA with ``limits.cuda_graphs``, its
    decode step replayed from CUDA graphs (None else). ``own_cache``: the cache is this decoder's alone, not the
    engine's shared one, so it outlives the engine's other calls."""
    make_cache = functools.partial(
        PagedKVCache.allocate, slots=slots, max_len=max_len, num_blocks=num_blocks, block_size=limits.block_size
    )
    decoder = Decoder(
        rollout.model,
        slots,
        max_len,
        rollout.prepack_cpu_weights,
        rollout.workspace,
        make_cache=make_cache,
        own_cache=own_cache,
    )
    cache: PagedKVCache = decoder.cache
    cache.reset()
    graphed = rollout.device.type == "cuda" and limits.cuda_graphs
    return decoder, cache, GraphedDecodeStep(decoder, cache, max_len) if graphed else None


class ContinuousBatcher:
    """A scheduler over one paged cache: its queued prompts, slots and outputs (see the module docstring).

    Built with ``prompts`` (a call's: :meth:`run` samples them all), or with none and ``slots``, ``max_len`` and
    perhaps ``num_blocks`` (the pool's, null block included; :func:`pool_blocks` else) given,
    as a batch that stays open (``own_cache``: its cache outlives the engine's other calls): :meth:`submit` queues a
    prompt's samples at any time, :meth:`step` runs one iteration and names the rows that ended in it, :meth:`pop`
    hands over and forgets their outputs.
    """

    def __init__(
        self,
        rollout: Any,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        seed: int | RowKeys,
        limits: BatchingLimits,
        updates: WeightUpdates | None = None,
        max_new_tokens: list[int] | None = None,
        *,
        slots: int | None = None,
        max_len: int | None = None,
        num_blocks: int | None = None,
        own_cache: bool = False,
        prefix_cache: bool = False,
    ) -> None:
        self.rollout, self.sampling = rollout, sampling
        if updates is not None and not (isinstance(updates.chunk_tokens, int) and updates.chunk_tokens > 0):
            raise ValueError(f"WeightUpdates.chunk_tokens must be a positive int, got {updates.chunk_tokens!r}")
        self.updates = updates
        device, n = rollout.device, sampling.n
        self.device = device
        # each prompt's most new tokens per sample (a request's own limit, as a server's requests have)
        max_new = _prompt_limits(max_new_tokens, len(prompts), sampling.max_new_tokens)
        rows = len(prompts) * n
        self.slots = slots or min(rows, limits.max_slots or DEFAULT_MAX_SLOTS)
        if prompts and self.slots < n:
            raise ValueError(
                f"rollout.native.max_slots={self.slots} is fewer than rollout.n={n}: a prompt's samples are admitted "
                "together, so the slots must hold n rows at least"
            )
        self.max_len = max_len or max((len(p) + m for p, m in zip(prompts, max_new)), default=sampling.max_new_tokens)
        self.block_size = limits.block_size
        num_blocks = num_blocks or pool_blocks(rollout, limits, self.slots, self.max_len)
        for i, (prompt, m) in enumerate(zip(prompts, max_new)):  # before any memory is taken
            self._check_fits(i, len(prompt), n, m, num_blocks - 1)
        # caches of their own where other calls may run on the engine while this batch lives: partial rollouts (the
        # caller may generate, an evaluation, at a boundary) and a batch left open (``own_cache``)
        self.decoder, self.cache, self.graphed_step = paged_decoder(
            rollout, limits, self.slots, self.max_len, num_blocks, own_cache=own_cache or updates is not None
        )
        #: queue each decode step before reading the tokens sampled before it (on CUDA, where the device runs
        #: behind the host): the rows that just sampled their EOS step once more, for nothing, and in exchange the
        #: device never waits for the host's bookkeeping between two steps
        self.overlap = device.type == "cuda" and limits.overlap_steps
        self.prefill_tokens = limits.prefill_tokens
        self.waiting: collections.deque[_Group] = collections.deque()
        self.filling: list[_Filling] = []  #: admitted prompts being fed in chunks (at most one at a time)
        self.free_slots = list(range(self.slots - 1, -1, -1))
        self.eos = set(rollout.eos_token_ids)
        self.rows: dict[int, _Row] = {}  #: output row -> its sample, until popped
        self.next_row = 0
        self.work = _Working([], [], [], [], torch.zeros(0, rollout.vocab_size, device=device))
        self.version = updates.version() if updates is not None else 0  #: of the weights sampling now
        self.start_version = self.version
        self.weight_loads = 0  #: boundaries at which new weights were taken
        self.refilled_tokens = 0  #: tokens whose keys and values were computed again under new weights
        self.iterations = 0
        self.peak_blocks = 0  #: the most blocks held at once
        self.peak_rows = 0  #: the most rows decoded together
        #: an ended row's full blocks stay cached for later prompts that start with the same tokens
        self.prefix_cache = prefix_cache
        self.cached_tokens = 0  #: prompt tokens not prefilled: their blocks were cached
        self.versions: Tensor | None = None  #: after :meth:`run`: the version that sampled each token
        self.last_boundary = 0  #: the iteration count of the last chunk boundary (an iteration may only fill)
        for i, (prompt, m) in enumerate(zip(prompts, max_new)):
            self.submit(prompt, m, _call_keys(seed, range(i * n, i * n + n)), index=i)

    @property
    def busy(self) -> bool:
        """Some prompt waits or some row is sampling."""
        return bool(self.waiting or self.work.row or self.filling)

    def submit(
        self, prompt: list[int], max_new_tokens: int, keys: list[tuple[int, int]], *, index: int = 0
    ) -> list[int]:
        """Queue ``len(keys)`` samples of ``prompt``, each of at most ``max_new_tokens`` tokens, the ``j``-th drawing
        with ``keys[j]`` (a seed's hash word and a row: :func:`keyed_uniforms`); their output rows. Refuses (naming
        prompt ``index``) what can never run here."""
        need = self.check(prompt, max_new_tokens, len(keys), index=index)
        rows = list(range(self.next_row, self.next_row + len(keys)))
        self.next_row += len(keys)
        for row, (word, key_row) in zip(rows, keys):
            self.rows[row] = _Row(prompt, max_new_tokens, word, key_row)
        self.waiting.append(_Group(prompt, rows, max_new_tokens, need))
        return rows

    def check(self, prompt: list[int], max_new_tokens: int, n: int, *, index: int = 0) -> int:
        """Refuse (naming prompt ``index``) ``n`` samples of ``prompt`` that can never run here; else the KV-cache
        blocks they need."""
        if n < 1 or n > self.slots:
            raise ValueError(
                f"prompt {index}: n={n} samples, but the batch has {self.slots} slots: a prompt's samples are "
                "admitted together"
            )
        if len(prompt) + max_new_tokens > self.max_len:
            raise ValueError(
                f"prompt {index} ({len(prompt)} tokens) with max_new_tokens={max_new_tokens} needs "
                f"{len(prompt) + max_new_tokens} positions, more than the {self.max_len} this batch holds"
            )
        return self._check_fits(index, len(prompt), n, max_new_tokens, self.cache.pool.usable)

    def _check_fits(self, index: int, prompt_len: int, n: int, max_new: int, usable: int) -> int:
        need = blocks_for_request(prompt_len, n, max_new, self.block_size)
        if need > usable:
            raise ValueError(request_too_large(index, prompt_len, n, max_new, need, max(usable, 0), self.block_size))
        return need

    def run(self) -> tuple[Tensor, Tensor]:
        """Every queued prompt sampled: raw tokens and log-probs ``(rows steps)`` on the host, as the lock-step loop
        returns them (tokens past a row's last are padding, log-probs 0); ``self.versions`` alike."""
        while self.busy:
            self.step()
        tokens, logprobs, self.versions = self.outputs(range(self.next_row))
        return tokens, logprobs

    def outputs(self, rows: Any) -> tuple[Tensor, Tensor, Tensor]:
        """Tokens, log-probs and versions ``(len(rows) t)`` of output ``rows``, ``t`` the most any of them sampled."""
        samples = [self.rows[r] for r in rows]
        width = max((len(s.tokens) for s in samples), default=0)

        def padded(name: str, fill: Any, dtype: torch.dtype) -> Tensor:
            values = [getattr(s, name) + [fill] * (width - len(s.tokens)) for s in samples]
            return torch.tensor(values, dtype=dtype).reshape(len(samples), width)

        return (
            padded("tokens", self.rollout.pad_token_id, torch.long),
            padded("logprobs", 0.0, torch.float32),
            padded("versions", self.start_version, torch.long),
        )

    def pop(self, rows: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`outputs` of ``rows``, which ended, forgotten here."""
        out = self.outputs(rows)
        for row in rows:
            del self.rows[row]
        return out

    def step(self) -> list[int]:
        """One iteration (admit, prefill, sample, release, decode): the output rows that ended in it."""
        work = self.work
        chunk = self.updates.chunk_tokens if self.updates is not None else 0
        if chunk and self.iterations and self.iterations % chunk == 0 and self.iterations != self.last_boundary:
            self.last_boundary = self.iterations
            self._boundary(work)
        filled, spent = self._fill(self.prefill_tokens)
        admitted = self._admit(self.prefill_tokens - spent)
        for part in (filled, self._prefill(admitted) if admitted else None):
            if part is not None:
                work.extend(part)
        if not work.row:
            if self.waiting and not self.filling:
                raise RuntimeError("continuous batching: requests wait but none can be admitted (a check was skipped)")
            return []
        self.iterations += 1
        self.peak_blocks = max(self.peak_blocks, self.cache.pool.usable - len(self.cache.pool.free))
        self.peak_rows = max(self.peak_rows, len(work.row))
        samples = [self.rows[r] for r in work.row]
        token, logprob = self._sample(work, samples)
        sampled, scores = HostCopy(token), HostCopy(logprob)
        below_limit = [i for i, (d, s) in enumerate(zip(work.drawn, samples)) if d < s.limit]
        if self.overlap:
            # the next step is queued before this step's tokens reach the host: a row that sampled its EOS
            # steps once more (its logits are dropped), and the device does not wait for the bookkeeping
            stepped = self._step(work, token, below_limit)
            tokens = sampled.values()
            going = [j for j, i in enumerate(below_limit) if tokens[i] not in self.eos]
            ended = sorted(set(range(len(tokens))) - {below_limit[j] for j in going})
            stepped.keep(going)
        else:
            tokens = sampled.values()
            running = [i for i in below_limit if tokens[i] not in self.eos]
            ended = sorted(set(range(len(tokens))) - set(running))
            stepped = None
        for sample, t, lp in zip(samples, tokens, scores.values()):
            sample.tokens.append(t)
            sample.logprobs.append(lp)
            sample.versions.append(self.version)
        if self.prefix_cache:
            for i in ended:
                self.cache.remember(work.slot[i], samples[i].prompt + samples[i].tokens, work.position[i])
        self._release(work, ended)
        self.work = stepped if stepped is not None else self._step(work, token, running)
        return [work.row[i] for i in ended]

    def _release(self, work: _Working, index: list[int]) -> None:
        """Working rows ``index`` have ended: their slots and blocks are free (a decode step already queued that
        still writes into them runs before any later use of them: the device runs its work in order)."""
        for i in index:
            self.cache.release(work.slot[i])
            self.free_slots.append(work.slot[i])

    def _step(self, work: _Working, token: Tensor, index: list[int]) -> _Working:
        """One decode step of working rows ``index``, each fed its entry of ``token (b)``: those rows, one position
        further, with the step's logits."""
        if not index:
            return work.select(index, work.logits[:0])
        if len(index) != len(work.row):
            token = token[on_device(index, self.device)]
        stepped = work.select(index, work.logits)
        self.cache.grow(stepped.slot, stepped.position)
        slots, positions = on_device([stepped.slot, stepped.position], self.device)  # one copy
        longest = max(stepped.position) + 1
        if self.graphed_step is not None:
            logits = self.graphed_step(token, slots, positions, longest)
        else:
            logits = self.decoder.step_paged(token, slots, positions, longest)
        # read before the next step: a graph's logits are overwritten there
        stepped.logits = logits.float()
        stepped.position = [p + 1 for p in stepped.position]
        return stepped

    def _admit(self, budget: int) -> list[tuple[_Group, list[int], list[int]]]:
        """Waiting prompts that fit now, each with its slots and its cached first blocks, their tokens to compute
        within ``budget``. A prompt longer than the whole prefill budget is admitted to be fed in chunks
        (``self.filling``, one such prompt at a time) and ends the admissions."""
        admitted = []
        cache, bs = self.cache, self.block_size
        while self.waiting:
            group = self.waiting[0]
            n, prompt_len = len(group.rows), len(group.prompt)
            cached = cache.cached_prefix(group.prompt) if self.prefix_cache else []
            need = cache.admission_need(prompt_len, n, group.max_new, cached) if cached else group.need
            if len(self.free_slots) < n or need > cache.pool.available:
                break
            rest = prompt_len - len(cached) * bs
            chunked = rest > self.prefill_tokens
            if (chunked and self.filling) or (not chunked and rest > budget):
                break
            self.waiting.popleft()
            slots = [self.free_slots.pop() for _ in range(n)]
            cache.admit(slots, prompt_len, group.max_new, cached)
            if chunked:
                self.cached_tokens += len(cached) * bs
                self.filling.append(_Filling(group, slots, len(cached) * bs))
                break
            admitted.append((group, slots, cached))
            budget -= rest
        return admitted

    def _fill(self, budget: int) -> tuple[_Working | None, int]:
        """Feed the next chunk of each prompt being fed in chunks, within ``budget`` tokens: the samples of those
        fed whole now (or None), and the tokens fed."""
        feeds, spent = [], 0
        for filling in self.filling:
            take = min(len(filling.group.prompt) - filling.fed, budget - spent)
            if take <= 0:
                break
            feeds.append((filling.group, filling.slots, filling.fed, filling.fed + take))
            filling.fed += take
            spent += take
        if not feeds:
            return None, 0
        logits = self._feed(feeds)
        done = [i for i, (group, _, _, end) in enumerate(feeds) if end == len(group.prompt)]
        self.filling = [f for f in self.filling if f.fed < len(f.group.prompt)]
        if not done:
            return None, spent
        index = on_device(done, self.device) if len(done) != len(feeds) else None
        finished = [(feeds[i][0], feeds[i][1]) for i in done]
        return self._new_rows(finished, logits if index is None else logits[index]), spent

    def _prefill(self, admitted: list[tuple[_Group, list[int], list[int]]]) -> _Working:
        """Compute the admitted prompts' keys and values once each (past their cached blocks); their samples as new
        working rows."""
        fresh = [(group, slots) for group, slots, cached in admitted if not cached]
        resumed = [(group, slots, cached) for group, slots, cached in admitted if cached]
        parts = []
        if fresh:
            prompts = [group.prompt for group, _ in fresh]
            ids, mask = left_pad(prompts, self.rollout.pad_token_id)
            ids, mask = on_device(ids, self.device), on_device(mask, self.device)
            first_slots = on_device([slots[0] for _, slots in fresh], self.device)
            self.cache.begin_prefill(first_slots, mask, sum(map(len, prompts)))
            parts.append(self._new_rows(fresh, self.decoder.prefill(ids, mask, copies=1)))
        if resumed:
            groups = [(group, slots) for group, slots, _ in resumed]
            starts = [len(cached) * self.block_size for _, _, cached in resumed]
            self.cached_tokens += sum(starts)
            feeds = [(group, slots, start, len(group.prompt)) for (group, slots), start in zip(groups, starts)]
            parts.append(self._new_rows(groups, self._feed(feeds)))
        for part in parts[1:]:
            parts[0].extend(part)
        return parts[0]

    def _new_rows(self, groups: list[tuple[_Group, list[int]]], logits: Tensor) -> _Working:
        """The samples of ``groups`` (prompts and their slots) as working rows, from each prompt's last logits."""
        counts = [len(group.rows) for group, _ in groups]
        logits = logits.float()
        if len(set(counts)) == 1:
            logits = logits.repeat_interleave(counts[0], dim=0)
        else:  # the output size given: the device need not be read for it
            logits = logits.repeat_interleave(on_device(counts, self.device), dim=0, output_size=sum(counts))
        slot = [s for _, slots in groups for s in slots]
        row = [r for group, _ in groups for r in group.rows]
        position = [len(group.prompt) for group, _ in groups for _ in group.rows]
        return _Working(slot, row, position, [0] * len(row), logits)

    def _feed(self, feeds: list[tuple[_Group, list[int], int, int]]) -> Tensor:
        """Feed each ``(group, slots, start, end)``'s prompt tokens ``[start, end)`` to its first slot, as one chunk
        attending over the positions before it (cached blocks, or earlier chunks): the logits ``(len(feeds) v)``
        after each chunk's last token."""
        chunks = [group.prompt[start:end] for group, _, start, end in feeds]
        width = max(map(len, chunks))
        tokens = [c + [self.rollout.pad_token_id] * (width - len(c)) for c in chunks]
        positions = [[start + min(j, len(c) - 1) for j in range(width)] for (_, _, start, _), c in zip(feeds, chunks)]
        valid = [[int(j < len(c)) for j in range(width)] for c in chunks]
        tokens, positions, valid = on_device([tokens, positions, valid], self.device)  # one copy
        slots = on_device([slots[0] for _, slots, _, _ in feeds], self.device)
        longest = max(end for _, _, _, end in feeds)
        return self.decoder.extend_paged(tokens, slots, positions, valid.bool(), longest)

    def _sample(self, work: _Working, samples: list[_Row]) -> tuple[Tensor, Tensor]:
        """One token per working row (whose samples are ``samples``) and its log-prob; counts it in ``work.drawn``."""
        uniform = None
        if self.sampling.temperature > 0.0:
            words, rows, drawn = on_device(  # one copy
                [[s.key_word for s in samples], [s.key_row for s in samples], work.drawn], self.device
            )
            uniform = keyed_uniforms(words, rows, drawn)[:, None]
        token = sample_tokens(work.logits, self.sampling, None, uniform=uniform)
        logprob = torch.log_softmax(work.logits, dim=-1).gather(-1, token[:, None]).squeeze(-1)
        work.drawn = [d + 1 for d in work.drawn]
        return token, logprob

    def _boundary(self, work: _Working) -> None:
        """A chunk boundary: the caller may load new weights; if it did, the working rows continue under them."""
        with torch.inference_mode(False):  # the caller's weight sync and evaluation run as they would outside
            new = self.updates.at_boundary()
        if new is None:
            return
        if new.model is not self.rollout.model:
            raise RuntimeError(
                "WeightUpdates.at_boundary returned an engine over another model: new weights must be copied into "
                "the model this generation decodes (sync_weights copies them in place)"
            )
        self.rollout, self.version = new, self.updates.version()
        self.weight_loads += 1
        self.decoder.reload_weights()
        if self.graphed_step is not None:
            self.graphed_step.forget()
        if work.row:
            work.logits = self._refill(work)
        for filling in self.filling:  # the chunks fed so far hold the old weights' keys and values
            filling.fed = 0

    def _refill(self, work: _Working) -> Tensor:
        """Prefill each working row's prompt and tokens so far again, into its own blocks, under the weights the
        model holds now; the next-token logits ``(b v)`` fp32. Rows are prefilled in groups of at most
        ``prefill_tokens`` tokens (at least one row a group)."""
        device = self.device
        sequences = [self.rows[r].prompt + self.rows[r].tokens for r in work.row]
        if any(len(q) != p for q, p in zip(sequences, work.position)):
            raise RuntimeError("continuous batching: a row's cache does not hold its prompt and sampled tokens")
        groups, start, tokens = [], 0, 0
        for i, q in enumerate(sequences):
            if i > start and tokens + len(q) > self.prefill_tokens:
                groups.append((start, i))
                start, tokens = i, 0
            tokens += len(q)
        groups.append((start, len(sequences)))
        logits = []
        for lo, hi in groups:
            ids, mask = left_pad(sequences[lo:hi], self.rollout.pad_token_id)
            ids, mask = on_device(ids, device), on_device(mask, device)
            self.cache.begin_refill(on_device(work.slot[lo:hi], device), mask)
            logits.append(self.decoder.prefill(ids, mask, copies=1).float())
        self.refilled_tokens += sum(map(len, sequences))
        return torch.cat(logits)


def generate_continuous(
    rollout: Any,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    seed: int | RowKeys,
    limits: BatchingLimits,
    updates: WeightUpdates | None = None,
    max_new_tokens: list[int] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Raw tokens, log-probs and the version of the weights that sampled each token ``(rows steps)`` of
    ``prompts`` (checked) through continuous batching; prompt ``i``'s samples stop after ``max_new_tokens[i]``
    tokens if given (``sampling.max_new_tokens`` else), their tokens past it are padding."""
    batcher = ContinuousBatcher(rollout, prompts, sampling, seed, limits, updates, max_new_tokens)
    tokens, logprobs = batcher.run()
    return tokens, logprobs, batcher.versions

"""Requests admitted into the native engine's running batch (backends/rollout/native_requests.py) and a rollout
server's worker that feeds them in as they come (backends/rollout/server_batching.py): a request that joins while
others sample gets the tokens a call of its own samples, is answered when its own rows end, and a weight push lets
the running rows end, then serves its requests with the new weights.

What it costs: one tiny random-init Qwen2 (hidden 64, 2 layers) for the module; each test samples a few hundred
tokens (a few seconds in all).
"""

from __future__ import annotations

import threading
import time

import attrs
import pytest
import torch

from backends.models import TinyModelConfig, load_tokenizer, write_tiny_model
from backends.rollout import server_client
from backends.rollout.native import BatchingLimits, SamplingConfig, build_native_rollout
from backends.rollout.native_requests import stream_pool_blocks
from backends.rollout.server import ServedPolicy, ThreadedServer, build_app
from backends.rollout.server_weights import WeightStaging, expected_tensors
from tests.test_native_engine import TINY

pytestmark = [pytest.mark.native_engine, pytest.mark.service]

TINY_MODEL = TinyModelConfig(arch="qwen2", **TINY)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model dir, tokenizer, a model dir of other weights of that shape)."""
    root = tmp_path_factory.mktemp("stream")
    path = write_tiny_model(root / "model", TINY_MODEL)
    other = write_tiny_model(root / "other", attrs.evolve(TINY_MODEL, seed=1))
    return path, load_tokenizer(path), other


def _prompts(tok, count: int) -> list[list[int]]:
    return [tok.encode(f"{i * 37 % 100}+{i}=" if i % 3 else f"{i}" * (1 + i % 9)) for i in range(count)]


def _assert_same(rows, batch) -> None:
    """``rows`` (a request's answer) hold ``batch``'s rows: tokens exactly, log-probs to float rounding."""
    lengths = batch.response_mask.sum(-1)
    assert rows.response_mask.sum(-1).tolist() == lengths.tolist()
    t = int(lengths.max())
    assert torch.equal(rows.response_ids[:, :t], batch.response_ids[:, :t])
    torch.testing.assert_close(rows.logprobs[:, :t], batch.rollout_logprobs[:, :t], rtol=0, atol=1e-5)


def _assert_alone(rollout, rows, prompts, n: int, max_new: int, seed: int) -> None:
    """``rows`` are what ``generate`` samples for the request alone."""
    _assert_same(rows, rollout.generate(prompts, SamplingConfig(n=n, max_new_tokens=max_new), seed=seed))


def _assert_blocks_back(pool) -> None:
    """Every block is free, or kept by the prefix cache alone (one holder), and nothing is promised."""
    assert len(pool.free) + len(pool.kept) == pool.usable and pool.reserved == 0
    assert all(pool.refcount[b] == (1 if b in pool.kept else 0) for b in range(1, pool.num_blocks))
    assert set(pool.kept) == pool.cached


def test_requests_that_join_a_running_batch_sample_what_they_would_alone(setup):
    """Requests of their own n, token limit and seed join at several iterations, more rows than the batch has
    slots; each ends when its rows end (the short ones that came late before the long one that came first), with
    the rows of a call of its own, and every block comes back."""
    path, tok, _ = setup
    rollout = build_native_rollout(path, tok, batching_limits=BatchingLimits(block_size=4))
    prompts = _prompts(tok, 8)
    requests = {  # key: (prompts, n, max_new_tokens, seed, the iteration it joins at)
        "long": (prompts[0:2], 2, 40, 11, 0),
        "three": (prompts[2:3], 3, 6, 12, 2),
        "many": (prompts[3:7], 1, 9, 13, 3),
        "last": (prompts[7:8], 2, 4, 14, 20),
    }
    stream = rollout.start_request_stream(SamplingConfig(), max_rows=8)
    ended, order, iteration = {}, [], 0
    while len(ended) < len(requests):
        for key, (some, n, max_new, seed, at) in requests.items():
            if at == iteration:
                assert stream.busy == (key != "long"), key  # the others join rows that are sampling
                stream.add(key, some, n=n, max_new_tokens=max_new, seed=seed)
        for request in stream.step():
            ended[request.key] = request
            order.append(request.key)
        iteration += 1
        assert iteration < 500
    assert order[-1] == "long" and order.index("last") < order.index("long"), order
    assert stream.batcher.peak_rows == 8 and not stream.busy and stream.requests == 0
    _assert_blocks_back(stream.batcher.cache.pool)
    assert not stream.batcher.rows  # outputs handed over are forgotten
    stream.end()
    for key, (some, n, max_new, seed, _) in requests.items():
        _assert_alone(rollout, ended[key], some, n, max_new, seed)


def test_a_request_that_can_never_run_is_refused_alone(setup):
    path, tok, _ = setup
    per_block = 2 * TINY["num_layers"] * TINY["num_kv_heads"] * 32 * 4 * 4  # keys and values, head 32, fp32
    limits = BatchingLimits(block_size=4, kv_cache_gib=11 * per_block / 2**30)  # 10 blocks and the null block
    rollout = build_native_rollout(path, tok, max_context=64, batching_limits=limits)
    stream = rollout.start_request_stream(SamplingConfig(), max_rows=4)
    prompt = tok.encode("1+2=")
    refusals = [
        (([prompt], 5, 4), "n=5 samples, but the batch has 4 slots"),
        (([prompt], 1, 63), "more than the context of 64"),
        (([prompt, [5, 10**6]], 1, 4), r"prompt 1 has token ids outside \[0, "),
        (([prompt], 4, 30), "needs .* KV-cache blocks of 4 tokens, more than the whole cache holds"),
        (([], 1, 4), "prompts is empty"),
    ]
    for (some, n, max_new), match in refusals:
        with pytest.raises(ValueError, match=match):
            stream.add("bad", some, n=n, max_new_tokens=max_new, seed=0)
        assert not stream.busy and stream.requests == 0, match  # nothing of it queued
    stream.add("good", [prompt], n=2, max_new_tokens=5, seed=3)
    with pytest.raises(ValueError, match="already in the stream"):
        stream.add("good", [prompt], n=1, max_new_tokens=5, seed=4)
    ended = []
    while stream.busy:
        ended += stream.step()
    stream.end()
    assert [e.key for e in ended] == ["good"]
    _assert_alone(rollout, ended[0], [prompt], 2, 5, 3)


@attrs.define
class PacedStream:
    """A real request stream that stops before its second step until the test lets it go (``pace.go``)."""

    stream: object
    pace: object
    steps: int = 0

    @property
    def busy(self):
        return self.stream.busy

    @property
    def cached_tokens(self):
        return self.stream.cached_tokens

    def add(self, key, prompts, **kwargs):
        self.stream.add(key, prompts, **kwargs)

    def step(self):
        if self.steps == 1:
            self.pace.stepping.set()
            assert self.pace.go.wait(30)
        self.steps += 1
        ended = self.stream.step()
        self.pace.ended_rows += [len(e.response_ids) for e in ended]
        return ended

    def end(self):
        self.stream.end()


@attrs.define
class FailingStream(PacedStream):
    """A paced stream whose engine fails at its third step."""

    def step(self):
        if self.steps == 2:
            raise RuntimeError("the device fell off the bus")
        return super().step()


@attrs.define
class Paced:
    """The served engine, whose request streams are ``stream_type`` s: the test knows a request is sampling while
    it sends the next. Records the row count of each request as it ends, and the streams opened."""

    engine: object
    stream_type: type = PacedStream
    stepping: threading.Event = attrs.field(factory=threading.Event)
    go: threading.Event = attrs.field(factory=threading.Event)
    ended_rows: list[int] = attrs.field(factory=list)
    opened: list[PacedStream] = attrs.field(factory=list)

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def start_request_stream(self, sampling, *, max_rows):
        self.opened.append(self.stream_type(self.engine.start_request_stream(sampling, max_rows=max_rows), self))
        return self.opened[-1]


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _sample_in_thread(policy, results, key, prompts, sampling, seed) -> threading.Thread:
    def call():
        results[key] = policy.batcher.sample(prompts, sampling, seed)

    thread = threading.Thread(target=call)
    thread.start()
    return thread


def _policy(engine, tok, model_dir=None) -> ServedPolicy:
    expected = expected_tensors(model_dir, torch.float32) if model_dir is not None else {}
    return ServedPolicy(
        engine=engine, tokenizer=tok, model_name="tiny", trainer_token="trainer", staging=WeightStaging(expected)
    )


def test_a_request_sent_while_another_samples_joins_it_and_is_answered_first(setup):
    path, tok, _ = setup
    rollout = build_native_rollout(path, tok)
    long_prompt, short_prompt = _prompts(tok, 2)
    paced = Paced(rollout)
    policy = _policy(paced, tok)
    build_app(policy)  # the server's worker, wired to the policy's engine
    try:
        results = {}
        long = _sample_in_thread(policy, results, "long", [long_prompt], SamplingConfig(n=2, max_new_tokens=40), 5)
        assert paced.stepping.wait(30)  # the long request's rows are sampling
        short = _sample_in_thread(policy, results, "short", [short_prompt], SamplingConfig(n=1, max_new_tokens=3), 6)
        _wait_for(lambda: policy.batcher.pending == 2, "the short request reaches the worker")
        paced.go.set()
        short.join(60), long.join(60)
    finally:
        policy.batcher.close()
    stats = policy.batcher.stats
    assert stats["engine/streams"] == 1 and stats["engine/joined"] == 1 and stats["engine/calls"] == 0, stats
    assert paced.ended_rows == [1, 2]  # the short request (one row) ended first
    for key, prompt, n, max_new, seed in (("long", long_prompt, 2, 40, 5), ("short", short_prompt, 1, 3, 6)):
        assert results[key].version == 0
        _assert_alone(rollout, results[key], [prompt], n, max_new, seed)


def test_a_weight_push_lets_the_running_rows_end_and_serves_what_waits_under_the_new_weights(setup):
    """The push's commit holds new requests; the request sampling when it came ends under the old weights (version
    0), the one sent meanwhile waits and samples the new ones (version 1), in a stream of its own."""
    path, tok, other = setup
    rollout = build_native_rollout(path, tok)
    prompts = _prompts(tok, 2)
    old = rollout.generate([prompts[0]], SamplingConfig(n=2, max_new_tokens=30), seed=5)
    paced = Paced(rollout)
    policy = _policy(paced, tok, path)
    server = ThreadedServer(policy)
    try:
        results = {}
        first = _sample_in_thread(policy, results, "first", [prompts[0]], SamplingConfig(n=2, max_new_tokens=30), 5)
        assert paced.stepping.wait(30)
        new_weights = dict(build_native_rollout(other, tok).model.state_dict())
        push = threading.Thread(
            target=server_client.push_weights, args=([server.url], iter(new_weights.items()), 1, "trainer")
        )
        push.start()
        _wait_for(lambda: policy.batcher.stats["engine/paused"] == 1, "the commit holds new requests")
        second = _sample_in_thread(policy, results, "second", [prompts[1]], SamplingConfig(n=1, max_new_tokens=6), 7)
        _wait_for(lambda: policy.batcher.pending == 2, "the second request reaches the worker")
        paced.go.set()
        for thread in (first, push, second):
            thread.join(60)
    finally:
        server.stop()
    assert policy.version == 1 and policy.engine is not paced
    assert results["first"].version == 0 and results["second"].version == 1
    stats = policy.batcher.stats
    assert stats["engine/streams"] == 2 and stats["engine/joined"] == 0 and stats["engine/paused"] == 0, stats
    _assert_same(results["first"], old)
    _assert_alone(policy.engine, results["second"], [prompts[1]], 1, 6, 7)
    assert not torch.equal(
        policy.engine.generate([prompts[0]], SamplingConfig(n=2, max_new_tokens=30), seed=5).rollout_logprobs,
        old.rollout_logprobs,
    )


def test_an_engine_failure_reaches_every_call_in_the_stream_and_the_server_goes_on(setup):
    """Never a hang: the calls in a stream whose engine fails hear why, and the next call opens a new stream."""
    path, tok, _ = setup
    rollout = build_native_rollout(path, tok)
    paced = Paced(rollout, stream_type=FailingStream)
    policy = _policy(paced, tok)
    build_app(policy)
    prompts = _prompts(tok, 3)
    try:
        errors = {}

        def call(key, prompt):
            try:
                policy.batcher.sample([prompt], SamplingConfig(n=1, max_new_tokens=20), 1)
            except RuntimeError as e:
                errors[key] = str(e)

        threads = [threading.Thread(target=call, args=(0, prompts[0]))]
        threads[0].start()
        assert paced.stepping.wait(30)
        threads.append(threading.Thread(target=call, args=(1, prompts[1])))
        threads[1].start()
        _wait_for(lambda: policy.batcher.pending == 2, "the second call reaches the worker")
        paced.go.set()
        for thread in threads:
            thread.join(60)
        assert errors == {0: "the device fell off the bus", 1: "the device fell off the bus"}
        paced.stream_type = PacedStream  # the engine works again
        rows = policy.batcher.sample([prompts[2]], SamplingConfig(n=1, max_new_tokens=4), 2)
    finally:
        policy.batcher.close()
    _assert_alone(rollout, rows, [prompts[2]], 1, 4, 2)
    assert policy.batcher.stats["engine/streams"] == 2 and [type(s) for s in paced.opened] == [
        FailingStream,
        PacedStream,
    ]


def _run(stream, key, prompts, n: int, max_new: int, seed: int):
    """Add one request to an idle stream and step it to its end: the ended request."""
    stream.add(key, prompts, n=n, max_new_tokens=max_new, seed=seed)
    ended = []
    while stream.busy:
        ended += stream.step()
    assert [e.key for e in ended] == [key]
    return ended[0]


def test_an_agents_next_call_computes_only_what_follows_its_last(setup):
    """The prefix cache: a call that sends the conversation again (the last call's prompt and reply, then a tool's
    answer) reuses the full blocks the last call's row wrote and computes the rest; its samples are those of a call
    of its own (tokens exactly; log-probs to rounding: cached keys came from decode steps, a fresh call's from one
    prefill). A call that shares only the first block of a prompt reuses that block alone."""
    path, tok, _ = setup
    rollout = build_native_rollout(path, tok, batching_limits=BatchingLimits(block_size=4))
    stream = rollout.start_request_stream(SamplingConfig(), max_rows=4)
    first = tok.encode("12+34=") * 3  # 18 tokens
    reply = _run(stream, "first", [first], 1, 12, 1)
    said = reply.response_ids[0, : int(reply.response_mask.sum())].tolist()
    assert len(said) == 12  # no EOS: its row wrote 18 + 11 positions, 7 full blocks
    assert stream.batcher.cached_tokens == 0
    follow_up = first + said + tok.encode("=46")
    again = _run(stream, "again", [follow_up], 2, 6, 2)
    assert stream.batcher.cached_tokens == 7 * 4
    alone = rollout.generate([follow_up], SamplingConfig(n=2, max_new_tokens=6), seed=2)
    lengths = alone.response_mask.sum(-1)
    assert again.response_mask.sum(-1).tolist() == lengths.tolist()
    assert torch.equal(again.response_ids[:, : int(lengths.max())], alone.response_ids[:, : int(lengths.max())])
    torch.testing.assert_close(again.logprobs, alone.rollout_logprobs[:, : again.logprobs.shape[1]], rtol=0, atol=1e-4)
    other = first[:4] + tok.encode("99+99=99")
    _run(stream, "other", [other], 1, 3, 3)
    assert stream.batcher.cached_tokens == 7 * 4 + 4
    _assert_blocks_back(stream.batcher.cache.pool)
    stream.end()


def test_cached_blocks_give_way_to_new_calls_least_recently_used_first(setup):
    """A small cache: the blocks kept for earlier calls are taken back (oldest first) when a new call needs them, so
    the cache never refuses or stalls a call that fits; a call whose prefix was evicted computes it again."""
    path, tok, _ = setup
    per_block = 2 * TINY["num_layers"] * TINY["num_kv_heads"] * 32 * 4 * 4
    limits = BatchingLimits(block_size=4, kv_cache_gib=17 * per_block / 2**30)  # 16 blocks
    rollout = build_native_rollout(path, tok, batching_limits=limits)
    stream = rollout.start_request_stream(SamplingConfig(), max_rows=2)
    prompts = [tok.encode(f"{i}{i}+{i}{i}=") * 2 for i in range(1, 5)]  # 12 tokens each: 3 full blocks
    for i, prompt in enumerate(prompts):
        _run(stream, i, [prompt], 1, 9, i)  # writes 20 positions: 5 full blocks kept
        pool = stream.batcher.cache.pool
        assert len(pool.kept) <= pool.usable
        _assert_blocks_back(pool)
    cached_before = stream.batcher.cached_tokens
    again = _run(stream, "last again", [prompts[-1]], 1, 4, 9)  # the newest prefix survived
    assert stream.batcher.cached_tokens == cached_before + 8  # (12 - 1) // 4 = 2 blocks
    _assert_alone(rollout, again, [prompts[-1]], 1, 4, 9)
    first_again = _run(stream, "first again", [prompts[0]], 1, 4, 8)  # the oldest was evicted
    assert stream.batcher.cached_tokens == cached_before + 8
    _assert_alone(rollout, first_again, [prompts[0]], 1, 4, 8)
    stream.end()


def test_no_block_leaks_over_many_calls_with_shared_prefixes(setup):
    """Calls that join while others run, share prefixes of several lengths, and evict each other's blocks from a
    small cache: after them every block is free or kept by the cache alone, and the cache kept reusing blocks."""
    path, tok, _ = setup
    per_block = 2 * TINY["num_layers"] * TINY["num_kv_heads"] * 32 * 4 * 4
    limits = BatchingLimits(block_size=4, kv_cache_gib=41 * per_block / 2**30)  # 40 blocks
    rollout = build_native_rollout(path, tok, batching_limits=limits)
    stream = rollout.start_request_stream(SamplingConfig(), max_rows=6)
    stems = [tok.encode(f"{i}+{i}=") * (1 + i) for i in range(5)]
    calls, ended = 0, []
    for iteration in range(400):
        if calls < 120 and iteration % 2 == 0:
            stem = stems[calls % 5]
            stream.add(
                calls, [stem + tok.encode(str(calls % 7))], n=1 + calls % 2, max_new_tokens=3 + calls % 5, seed=calls
            )
            calls += 1
        ended += stream.step()
        if calls == 120 and not stream.busy:
            break
    assert len(ended) == 120 and not stream.busy
    assert stream.batcher.cached_tokens > 0
    _assert_blocks_back(stream.batcher.cache.pool)
    stream.end()


def test_a_streams_cache_takes_at_most_half_the_free_device_memory(setup):
    """Without rollout.native.kv_cache_gib a stream's pool holds every slot at the whole context, but on a device at
    most half its free memory (a server's default context is the model's, which can be far longer than its calls);
    a budget, when given, is the budget."""
    path, tok, _ = setup
    rollout = build_native_rollout(path, tok, batching_limits=BatchingLimits(block_size=4))
    per_block = 2 * TINY["num_layers"] * TINY["num_kv_heads"] * 32 * 4 * 4
    full = 8 * 96 // 4 + 1
    assert stream_pool_blocks(rollout, 8, 96, None) == full  # on a CPU: no free-memory bound
    assert stream_pool_blocks(rollout, 8, 96, 2 * 40 * per_block) == 40
    assert stream_pool_blocks(rollout, 8, 96, 10**12) == full
    budget = BatchingLimits(block_size=4, kv_cache_gib=30 * per_block / 2**30)
    assert stream_pool_blocks(attrs.evolve(rollout, batching_limits=budget), 8, 96, 2 * 40 * per_block) == 30

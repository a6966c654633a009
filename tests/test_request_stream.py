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
    pool = stream.batcher.cache.pool
    assert len(pool.free) == pool.usable and pool.reserved == 0 and not any(pool.refcount)
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

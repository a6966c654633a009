"""Concurrent agents' calls share engine calls (backends/rollout/server_batching.py) and each samples what a call of
its own samples (backends/rollout/row_random.py's RowKeys).

What it costs: one tiny in-process native engine and an in-process server thread for the module; each test makes a
few calls of at most six tokens (a second or two in all).
"""

from __future__ import annotations

import threading
import time

import attrs
import openai
import pytest
import torch

from backends.data import prompt_token_ids
from backends.models import TinyModelConfig, build_char_tokenizer, load_tokenizer, write_tiny_model
from backends.rollout.api import RolloutConfig, build_rollout
from backends.rollout.common import SamplingConfig
from backends.rollout.row_random import RowKeys
from backends.rollout.server import ServedPolicy, ThreadedServer
from backends.rollout.server_weights import WeightStaging
from backends.rollout.vllm_requests import prompt_seed

pytestmark = pytest.mark.service

TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=96, initializer_range=0.2
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = write_tiny_model(tmp_path_factory.mktemp("batching") / "model", TINY, build_char_tokenizer())
    tokenizer = load_tokenizer(model_dir)
    return build_rollout(RolloutConfig(), model_dir, tokenizer), tokenizer


@pytest.fixture(scope="module", params=["stream", "gathered"])
def served(engine, request):
    """A server whose worker runs a request stream (continuous batching), or gathered calls (lock-step)."""
    rollout, tokenizer = engine
    policy = ServedPolicy(
        engine=rollout if request.param == "stream" else attrs.evolve(rollout, batching="lockstep"),
        tokenizer=tokenizer,
        model_name="tiny",
        trainer_token="trainer-token",
        staging=WeightStaging(expected={}),
        defaults=SamplingConfig(n=1, max_new_tokens=6),
    )
    server = ThreadedServer(policy)
    try:
        yield server
    finally:
        server.stop()


def _assert_same_rows(batched, alone, rows):
    """``rows`` of ``batched`` hold ``alone``'s tokens (exactly) and log-probs (to rounding)."""
    for i, j in enumerate(rows):
        k = int(alone.response_mask[i].sum())
        assert batched.response_mask[j].sum().item() == k
        assert batched.response_ids[j, :k].tolist() == alone.response_ids[i, :k].tolist()
        torch.testing.assert_close(batched.rollout_logprobs[j, :k], alone.rollout_logprobs[i, :k], rtol=0, atol=1e-5)


@pytest.mark.parametrize("batching", ["lockstep", "continuous"])
def test_row_keys_give_each_request_the_samples_of_a_call_of_its_own(engine, batching):
    rollout, _ = engine
    rollout = attrs.evolve(rollout, batching=batching)
    first, second = [[5, 6, 7], [9, 10]], [[11, 12, 13, 14]]
    sampling = SamplingConfig(n=2, max_new_tokens=8)
    keys = RowKeys.of_requests([3, 8], [4, 2])
    together = rollout.generate(first + second, sampling, seed=keys)
    _assert_same_rows(together, rollout.generate(first, sampling, seed=3), [0, 1, 2, 3])
    _assert_same_rows(together, rollout.generate(second, sampling, seed=8), [4, 5])
    # the other order: the rows move, their samples do not
    swapped = rollout.generate(second + first, sampling, seed=RowKeys.of_requests([8, 3], [2, 4]))
    _assert_same_rows(swapped, rollout.generate(first, sampling, seed=3), [2, 3, 4, 5])


def test_row_keys_give_a_vllm_request_the_seed_of_a_call_of_its_own():
    keys = RowKeys.of_requests([3, 8], [4, 2])  # request 0: prompts 0-1, request 1: prompt 2; n = 2
    assert [prompt_seed(keys, i, 2) for i in range(3)] == [
        prompt_seed(3, 0, 2),
        prompt_seed(3, 1, 2),
        prompt_seed(8, 0, 2),
    ]


def test_row_keys_name_a_mismatch():
    with pytest.raises(ValueError, match="RowKeys: 1 seeds for 2 rows"):
        RowKeys(seeds=[1], rows=[0, 1])


def _hold_the_engine_until_all_are_queued(server, calls: list[threading.Thread]) -> None:
    """Start ``calls`` while the engine is held, and let it go once each has reached the batcher (the worker has
    taken the first of them, perhaps with others that came with it, and waits for the engine)."""
    policy = server.policy
    policy.batcher.settle()  # the last test's request stream ends now, not after its linger
    with policy.engine_lock:
        for thread in calls:
            thread.start()
        deadline = time.monotonic() + 30
        while policy.batcher.pending < len(calls):
            assert time.monotonic() < deadline, f"{policy.batcher.pending} of {len(calls)} requests reached the batcher"
            time.sleep(0.01)
    for thread in calls:
        thread.join(60)


def test_concurrent_calls_share_engine_calls_and_sample_what_they_would_alone(engine, served):
    rollout, tokenizer = engine
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="trainer-token", max_retries=0)
    caps = [6, 6, 6, 4, 6, 4, 6, 6]  # two token limits: they never share a gathered call
    replies: dict[int, object] = {}

    def call(i: int) -> None:
        messages = [{"role": "user", "content": f"{i}+{i}="}]
        replies[i] = client.chat.completions.create(model="tiny", messages=messages, max_tokens=caps[i], seed=100 + i)

    before = dict(served.policy.batcher.stats)
    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    _hold_the_engine_until_all_are_queued(served, threads)
    stats = {k: v - before[k] for k, v in served.policy.batcher.stats.items() if k != "engine/largest_call"}
    assert stats["engine/requests"] == 8, stats
    if served.policy.engine.batching == "continuous":
        # one stream: a call's token limit is its own, and the calls that came while it ran joined it
        assert stats["engine/streams"] == 1 and stats["engine/calls"] == 0, stats
        assert served.policy.batcher.stats["engine/largest_call"] == 8
    else:
        # the worker's first call took what had come (some calls of one option); what queued behind it shares one
        # call per option
        assert stats["engine/calls"] <= 3 and stats["engine/streams"] == 0, stats
        assert served.policy.batcher.stats["engine/largest_call"] >= 3
    for i in range(8):
        prompt = prompt_token_ids([{"role": "user", "content": f"{i}+{i}="}], tokenizer)
        alone = rollout.generate([prompt], SamplingConfig(n=1, max_new_tokens=caps[i]), seed=100 + i)
        k = int(alone.response_mask.sum())
        assert replies[i].choices[0].token_ids == alone.response_ids[0, :k].tolist(), i


def test_a_refused_request_does_not_fail_the_calls_batched_with_it(engine, served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="trainer-token", max_retries=0)
    outcomes: dict[int, object] = {}

    def call(i: int) -> None:
        prompt = [5, 6, 10**6] if i == 2 else [5, 6, 7 + i]  # 10**6: outside the tiny vocabulary
        try:
            outcomes[i] = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, seed=i).choices[0]
        except openai.BadRequestError as e:
            outcomes[i] = e

    _hold_the_engine_until_all_are_queued(served, [threading.Thread(target=call, args=(i,)) for i in range(4)])
    assert isinstance(outcomes[2], openai.BadRequestError), outcomes[2]
    assert "token ids outside [0, 266)" in str(outcomes[2]), outcomes[2]
    assert all(len(outcomes[i].token_ids) >= 1 for i in (0, 1, 3))

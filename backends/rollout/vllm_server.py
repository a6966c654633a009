"""vLLM rollout servers: vLLM's own OpenAI server in a process of its own, and the trainer's client for it.

:func:`start_vllm_server` runs ``python -m vllm.entrypoints.openai.api_server`` on a model dir with what rlfunc needs
switched on: the weight-update routes (``VLLM_SERVER_DEV_MODE=1``, :mod:`backends.rollout.vllm_transfer`), the
token-in / token-out ``/inference/v1/generate`` (``--enable-scale-out``), the run's tokens on every route
(``--middleware`` :class:`backends.rollout.server_auth.RunTokenAuth`), the loopback address unless a host is given.
Agents use the same server's ``/v1/chat/completions`` and ``/v1/completions`` with the agent token.

:class:`ServerClient` is the trainer's side: the loop's batched generate with token ids, log-probs and the version of
every token (:meth:`ServerClient.generate`); health and version; and the four calls of vLLM's
``VLLMWeightSyncClient`` protocol (``vllm/distributed/weight_transfer/clients.py``) with the run's token, which
vLLM's own HTTP client does not send. :class:`WeightPusher` pushes a version of the weights to one server.

A server that exits or does not answer is named with its URL, exit code and the tail of its log
(:class:`RolloutServerError`); nothing waits without a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import attrs
import httpx
import torch

from backends.rollout.server_auth import RunTokens

__all__ = [
    "GenerateResult",
    "RolloutServer",
    "RolloutServerError",
    "ServerClient",
    "VLLMServerConfig",
    "WeightPusher",
    "checkpoint_shapes",
    "complete_set",
    "port_is_free",
    "server_command",
    "start_vllm_server",
    "transfer_backend",
]


class RolloutServerError(RuntimeError):
    """A rollout server that failed to start, died, or answered with an error; the message names it.
    ``unreachable``: it did not answer at all (connection refused or cut, no answer in time), as a dead or frozen
    server does, rather than refusing the request."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


@attrs.frozen
class VLLMServerConfig:
    """How a vLLM rollout server is started."""

    dtype: str = "float32"
    max_model_len: int = 256
    seed: int = 0
    kv_cache_gib: int = 1  #: CPU only (``VLLM_CPU_KVCACHE_SPACE``)
    enforce_eager: bool = True
    host: str = "127.0.0.1"  #: the loopback address unless the servers must be reached from other hosts
    #: auto: vLLM's NCCL engine where CUDA is, the gloo engine (backends.rollout.vllm_transfer) elsewhere
    weight_transfer: str = "auto"
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 600.0
    extra_args: tuple[str, ...] = ()  #: more ``vllm serve`` arguments


def transfer_backend(name: str = "auto") -> str:
    """The weight-transfer engine ``name`` stands for: ``auto`` is vLLM's NCCL engine where CUDA is, rlfunc's gloo
    engine elsewhere."""
    if name != "auto":
        return name
    return "nccl" if torch.cuda.is_available() else "rlfunc_gloo"  # backends.rollout.vllm_transfer.GLOO_BACKEND


def server_command(model_dir: str | Path, cfg: VLLMServerConfig, port: int) -> list[str]:
    """The server's command line (no secrets: the tokens go in the environment)."""
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--dtype",
        cfg.dtype,
        "--max-model-len",
        str(cfg.max_model_len),
        "--seed",
        str(cfg.seed),
        "--enable-scale-out",
        "--weight-transfer-config",
        json.dumps({"backend": transfer_backend(cfg.weight_transfer)}),
        "--middleware",
        "backends.rollout.server_auth.RunTokenAuth",
        "--logprobs-mode",
        "raw_logprobs",  # the sampled tokens' log-probs under the model itself: the trainer's quantity
        "--disable-log-stats",
    ]
    if cfg.enforce_eager:
        command.append("--enforce-eager")
    return [*command, *cfg.extra_args]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    """Whether a server may listen on ``port`` (as vLLM binds: SO_REUSEADDR, so a dead server's port counts)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


@attrs.define
class RolloutServer:
    """A started server process: its URL, its log, its tokens."""

    process: subprocess.Popen
    url: str
    log_path: Path
    tokens: RunTokens = attrs.field(repr=False)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def client(self, *, agent: bool = False, timeout_s: float = 600.0) -> ServerClient:
        return ServerClient(self.url, self.tokens.agent if agent else self.tokens.trainer, timeout_s=timeout_s)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> None:
        """Until ``/health`` answers; a server that exits first, or is not up by ``timeout_s``, is an error."""
        deadline = time.monotonic() + timeout_s
        client = self.client(timeout_s=5.0)
        while True:
            code = self.process.poll()
            if code is not None:
                raise RolloutServerError(
                    f"rollout server {self.url} exited with code {code} while starting; its log "
                    f"({self.log_path}) ends:\n{self.log_tail()}"
                )
            try:
                if client.healthy():
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RolloutServerError(
                    f"rollout server {self.url} did not answer /health within {timeout_s:.0f} s; its log "
                    f"({self.log_path}) ends:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def stop(self, grace_s: float = 20.0) -> None:
        """The server and vLLM's engine processes under it (its process group): asked, then killed."""
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.process.pid, signal.SIGKILL)  # what is left of the group: an engine core, its workers
        self.process.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def start_vllm_server(
    model_dir: str | Path,
    cfg: VLLMServerConfig,
    tokens: RunTokens,
    *,
    log_path: str | Path,
    port: int | None = None,
    environ: dict[str, str] | None = None,
    wait: bool = True,
) -> RolloutServer:
    """A vLLM rollout server on ``model_dir`` in a process of its own, ready (``wait``) to serve."""
    port = port or _free_port(cfg.host)
    env = {
        **os.environ,
        **(environ or {}),
        **tokens.environ(),
        "VLLM_SERVER_DEV_MODE": "1",  # the weight-update and pause routes
        # idle connections kept longer than a client pools them (httpx: 5 s, vLLM's default here: 5 s), so that no
        # request goes out on a connection the server is closing
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "75",
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib),
    }
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            server_command(model_dir, cfg, port), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = RolloutServer(process=process, url=f"http://{cfg.host}:{port}", log_path=log_path, tokens=tokens)
    if wait:
        server.wait_ready(cfg.startup_timeout_s)
    return server


@attrs.frozen
class GenerateResult:
    """One sampled continuation: its token ids, their log-probs and the weight version of each token."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[str]
    finish_reason: str | None


class ServerClient:
    """The trainer's (or, with the agent token, an agent's) HTTP client of one rollout server."""

    def __init__(self, url: str, token: str, *, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout_s,
            trust_env=False,
            # an idle connection is dropped before a server (vLLM's default: after 5 s) may close it under a request
            limits=httpx.Limits(keepalive_expiry=2.0),
        )
        self.pending_version: str | None = None  #: what finish_weight_update names the weights being sent

    def __repr__(self) -> str:
        return f"ServerClient({self.url})"

    def move_to(self, url: str) -> None:
        """Send to ``url`` from now on (a restarted server on another port); the token stays."""
        url = url.rstrip("/")
        if url != self.url:
            self.url, self.http.base_url = url, url

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise RolloutServerError(
                f"rollout server {self.url}{path}: {type(e).__name__}: {e}", unreachable=True
            ) from e
        if response.status_code >= 400:
            raise RolloutServerError(
                f"rollout server {self.url}{path} answered {response.status_code}: {response.text[:2000]}"
            )
        return response.json() if response.content else None

    def healthy(self) -> bool:
        return self.http.get("/health").status_code == 200

    def weight_version(self) -> str:
        return self.request("GET", "/weight_info")["weight_version"]

    def world_size(self) -> int:
        """The server's workers (vLLM's tensor x pipeline x data parallel size)."""
        return int(self.request("GET", "/get_world_size")["world_size"])

    def pause(self, mode: str = "keep") -> None:
        self.request("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        self.request("POST", "/resume")

    def reset_prefix_cache(self) -> None:
        """Drop the prefix cache (vLLM's weight update keeps it); refused while requests hold blocks."""
        if not self.request("POST", "/reset_prefix_cache")["success"]:
            raise RolloutServerError(f"rollout server {self.url}: its prefix cache could not be reset (blocks in use)")

    # vLLM's VLLMWeightSyncClient protocol (vllm/distributed/weight_transfer/clients.py)
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.request("POST", "/init_weight_transfer_engine", json={"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.request("POST", "/shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self.request("POST", "/start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.request("POST", "/update_weights", json={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.pending_version
        self.request("POST", "/finish_weight_update", json={"weight_version": version} if version else None)

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        n: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> list[GenerateResult]:
        """``n`` continuations of ``prompt_ids``: the sampled ids, the log-prob of each under the server's raw
        distribution, and the weight version that sampled each."""
        sampling = {
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "logprobs": 0,
            "stop_token_ids": list(stop_token_ids),
        }
        if seed is not None:
            sampling["seed"] = seed
        body = {"token_ids": list(prompt_ids), "sampling_params": sampling, "output_mode": "tokens"}
        out = self.request("POST", "/inference/v1/generate", json=body)
        return [_result(choice) for choice in sorted(out["choices"], key=lambda c: c["index"])]


def _result(choice: dict) -> GenerateResult:
    ids = list(choice.get("token_ids") or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    logprobs = [float(c["logprob"]) for c in content]
    if len(logprobs) != len(ids):
        raise RolloutServerError(f"the server returned {len(ids)} token ids but {len(logprobs)} log-probs")
    versions: list[str] = [""] * len(ids)
    for span in choice.get("weight_versions") or []:  # tokens [start, end) came from weights labelled version
        versions[span["start"] : span["end"]] = [str(span["version"])] * (span["end"] - span["start"])
    return GenerateResult(
        token_ids=ids, logprobs=logprobs, versions=versions, finish_reason=choice.get("finish_reason")
    )


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint a server was started on, with its shape (read from the safetensors headers,
    no tensor data): the set a complete push must send."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files (a rollout server loads an HF safetensors dir)")
    shapes = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def complete_set(named: list[tuple[str, torch.Tensor]], expected: dict[str, tuple[int, ...]]) -> list:
    """``named`` checked against the checkpoint's tensors before anything is sent: an unknown name, a missing one or
    another shape is an error naming it (vLLM's workers stop their server on an unknown name, and keep a layer's old
    weights when a tensor of it is missing). A tied ``lm_head.weight``, which the checkpoint does not store, is sent
    too: vLLM's layerwise reload loads the head from it."""
    unknown = [n for n, _ in named if n not in expected and n != "lm_head.weight"]
    missing = sorted(set(expected) - {n for n, _ in named})
    shapes = [
        f"{n} {tuple(t.shape)} (the server's: {expected[n]})"
        for n, t in named
        if n in expected and tuple(t.shape) != expected[n]
    ]
    problems = [
        *([f"not in the server's model: {', '.join(unknown[:5])}"] if unknown else []),
        *([f"missing: {', '.join(missing[:5])}"] if missing else []),
        *([f"another shape: {'; '.join(shapes[:5])}"] if shapes else []),
    ]
    if problems:
        raise RolloutServerError(
            "refused before sending a tensor, the server keeps its weights: " + "; ".join(problems)
        )
    return named


class WeightPusher:
    """Pushes versions of the weights to one server through vLLM's weight-transfer API (see
    :mod:`backends.rollout.vllm_transfer`): the group is formed once, then each :meth:`push` checks the set against
    the server's checkpoint (:func:`complete_set`), pauses the server (running requests frozen, not dropped), sends
    every tensor, finishes the update under its version, drops the prefix cache (vLLM's update keeps it) and
    resumes. Only the trainer's rank 0 builds one."""

    def __init__(
        self,
        client: ServerClient,
        *,
        backend: str,
        expected: dict[str, tuple[int, ...]],
        master_address: str = "127.0.0.1",
    ) -> None:
        from backends.rollout.vllm_transfer import (
            GlooTrainerInitInfo,
            GlooTrainerWeightTransferEngine,
            TensorSource,
        )

        self.client = client
        self.expected = expected
        world_size = 1 + client.world_size()
        source = TensorSource([])
        if backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import (
                NCCLTrainerInitInfo,
                NCCLTrainerWeightTransferEngine,
            )

            info = NCCLTrainerInitInfo(master_address, _free_port(master_address), world_size, rank=0)
            self.engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
        else:
            info = GlooTrainerInitInfo(master_address, world_size, rank=0)
            self.engine = GlooTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | str) -> None:
        from backends.rollout.vllm_transfer import TensorSource

        self.engine.source = TensorSource(complete_set(list(named_tensors), self.expected))
        self.client.pending_version = str(version)
        self.client.pause("keep")
        try:
            self.engine.send_weights()
            self.client.reset_prefix_cache()  # cached keys / values of the old weights must not serve the new
        except RolloutServerError as e:
            # the model may hold part of the new set (or its server stopped): it is not resumed on it
            raise RolloutServerError(
                f"{e}\n(weight push of version {version} failed; {self.client.url} stays paused until a complete push)",
                unreachable=e.unreachable,
            ) from e
        self.client.resume()

    def close(self) -> None:
        self.engine.shutdown()

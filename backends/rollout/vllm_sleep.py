"""Sleep and wake of an in-process vLLM engine, by vLLM's own rules: which memory pools are asleep, what each
sleep level keeps, and which calls need which pool mapped.

vLLM (v1) allocates its GPU memory through the CuMem allocator in tagged pools. Read at vLLM 0.32.0
(``vllm/device_allocator/cumem.py``, ``sleep_mode_backend.py``, ``v1/executor/abstract.py``,
``v1/worker/gpu_worker.py``, ``v1/engine/core.py``, ``lora/worker_manager.py``, ``lora/model_manager.py``) and,
for the older allocator, ``vllm/device_allocator/cumem.py`` at vllm-project/vllm commit 010c211:

- two pools can sleep, ``"weights"`` and ``"kv_cache"`` (``abstract.SLEEP_TAGS``). The weights pool holds the
  model *and* vLLM's LoRA slot buffers: ``GPUWorker.load_model`` builds the model, LoRA layers included,
  inside ``_maybe_get_memory_pool_context(tag="weights")``;
- ``LLM.sleep(level)`` puts both to sleep (``Executor.sleep`` adds both tags to ``sleeping_tags``; a second
  sleep is ignored with a warning). ``CuMemBackend.suspend`` copies the weights pool to host memory only at
  level 1; level 2 discards it, and the KV cache is discarded at either level;
- ``LLM.wake_up(tags)`` maps the named pools again and copies back what level 1 saved. ``Executor.wake_up``
  refuses (a warning, and *nothing* woken) when a named tag is not asleep; ``tags=None`` reaches every worker as
  None, and the older ``CuMemAllocator.wake_up`` then maps *every* allocation of the process again, mapped or
  not: a CUDA error, or a second copy of the weights. So the state below is kept here, and vLLM only ever gets
  an explicit list of pools that are asleep;
- sleeping pauses the scheduler, and ``EngineCore.wake_up`` resumes it only once no pool is asleep: a
  ``generate`` with the KV cache (or the weights) still asleep never finishes (0.32) or reads unmapped memory
  (the older allocator);
- loading weights (``reload_weights``) and loading a LoRA adapter (``add_lora``:
  ``LRUCacheWorkerLoRAManager.add_adapter`` -> ``LoRAModelManager.activate_adapter`` copies the factors into
  the slot buffers) write into the weights pool: it must be mapped first.

The order a step follows is the one the colocated peers use on GPUs every day (TRL's ``GRPOTrainer`` with
``vllm_mode="colocate"`` and ``vllm_enable_sleep_mode``: ``wake_up(tags=["weights"])``, load, then
``wake_up(tags=["kv_cache"])`` before ``generate``; verl's vLLM sharding manager: the same, the KV cache woken
once the trainer's copy of the weights is released): sleep after sampling, wake the weights for a sync, wake the
KV cache at the next generation.

The engine is one object shared by every copy of the rollout state, so its sleep state is too: a
:class:`SleepState` is mutated in place (as vLLM's own ``sleeping_tags`` is).
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch

__all__ = ["SLEEP_POOLS", "SleepState", "sleep_engine", "wake_pools"]

#: the memory pools vLLM can put to sleep and wake one by one (``vllm.v1.executor.abstract.SLEEP_TAGS``)
SLEEP_POOLS = ("weights", "kv_cache")


@attrs.define
class SleepState:
    """What is asleep in one vLLM engine: the pools, and whether a level-2 sleep discarded the weights (then
    only a complete weight load makes them usable again, whether or not the pool has been woken)."""

    asleep: set[str] = attrs.Factory(set)
    weights_discarded: bool = False

    @property
    def sleeping(self) -> bool:
        return bool(self.asleep)


def wake_pools(llm: Any, state: SleepState, pools: Sequence[str]) -> None:
    """Map ``pools`` of ``llm`` again, those that are asleep and only those (see the module doc: vLLM never gets
    ``None`` or a pool that is awake). Allocator blocks the trainer freed go back to the device first (TRL does the
    same before its wake)."""
    unknown = [p for p in pools if p not in SLEEP_POOLS]
    if unknown:
        raise ValueError(f"unknown vLLM memory pool(s) {unknown}: the pools that sleep are {list(SLEEP_POOLS)}")
    todo = [p for p in SLEEP_POOLS if p in pools and p in state.asleep]
    if not todo:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    llm.wake_up(tags=todo)
    state.asleep.difference_update(todo)


def sleep_engine(llm: Any, state: SleepState, level: int) -> None:
    """Put both pools of ``llm`` to sleep at ``level`` (1: the weights offloaded to host memory, 2: discarded).

    A pool left asleep by an interrupted step (the weights woken for a sync that failed, the KV cache never woken)
    is woken first: vLLM's sleep acts on the pools it finds mapped, and the older allocator unmaps every allocation
    again, asleep or not."""
    if level not in (1, 2):
        raise ValueError(f"vLLM sleep level must be 1 or 2, got {level}")
    if state.asleep == set(SLEEP_POOLS):
        return
    wake_pools(llm, state, SLEEP_POOLS)
    llm.sleep(level=level)
    state.asleep.update(SLEEP_POOLS)
    if level == 2:
        state.weights_discarded = True

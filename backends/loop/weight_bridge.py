"""The weight bridge: how a :class:`~backends.training.engine.TrainEngine`'s policy reaches a
:class:`~backends.rollout.engine.RolloutEngine`, and whether the two compute the same log-probs.

One :class:`WeightBridge` per run, made from the rollout config (:func:`weight_bridge`), holds what a sync needs
besides the two engines:

- the dtype the rollout engine keeps its weights in (``rollout.dtype`` for the native engine,
  ``rollout.vllm.dtype`` for vLLM, each engine's spec says which): the trainer gathers in it, half the bytes for
  bf16, also on ranks that hold no rollout engine (a split run's trainer pool);
- the bucket size of the gather (``rollout.sync_bucket_mb``; verl's ``update_weights_bucket_megabytes``);
- full weights or a LoRA adapter: with an engine that takes adapters and asks for them
  (``rollout.vllm.lora_sync=adapter``), a LoRA actor sends its adapter's factors alone and the base weights stay as
  the engine loaded them; otherwise the merged full tensors.

:meth:`WeightBridge.sync` moves them (a collective of the trainer's ranks), :meth:`WeightBridge.weights` gives the
full tensors to a caller that ships them itself (the split loop's broadcast), :meth:`WeightBridge.logprobs_agree`
is the parity check (the rollout's sampled-token log-probs can stand in for the trainer's only where both
engines compute the same numbers) and :func:`logprob_gap` measures what they differ by.
"""

from __future__ import annotations

from typing import Any, Iterable

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

import rlfunc as rf
from backends.config import ConfigError
from backends.distributed.collectives import all_reduce_sum
from backends.rollout.api import ROLLOUT_ENGINES, RolloutConfig, rollout_engine_spec
from backends.rollout.engine import RolloutEngine
from backends.training.engine import TrainEngine
from backends.training.lora import LoraConfig, adapter_state_dict

__all__ = ["WeightBridge", "check_adapter_sync", "logprob_gap", "weight_bridge"]


@attrs.frozen
class WeightBridge:
    """How the policy's weights travel to the rollout engine (see the module doc)."""

    dtype: torch.dtype  #: the rollout engine's weight dtype: the trainer gathers in it
    bucket_mb: float  #: MiB of gathered tensors per collective
    adapter: LoraConfig | None = None  #: the LoRA adapter sent alone; None: merged full weights

    def weights(self, engine: TrainEngine, actor: Any) -> Iterable[tuple[str, Tensor]]:
        """The policy's full HF-named tensors, in the rollout's dtype, gathered in buckets (a collective of the
        actor's ranks: every one consumes the whole stream)."""
        return engine.full_state_dict(actor, dtype=self.dtype, bucket_mb=self.bucket_mb)

    def sync(self, rollout: RolloutEngine, engine: TrainEngine, actor: Any, *, version: int) -> RolloutEngine:
        """The actor's weights (``version``: the number of updates they hold) into ``rollout``; the new rollout."""
        if self.adapter is not None:
            factors = adapter_state_dict(actor, dtype=self.dtype, bucket_mb=self.bucket_mb)
            return rollout.sync_adapter(
                factors,
                rank=self.adapter.rank,
                alpha=self.adapter.alpha,
                target_modules=self.adapter.target_modules,
                version=version,
            )
        return rollout.sync_weights(self.weights(engine, actor))

    def logprobs_agree(self, engine: TrainEngine, actor: Any, rollout: RolloutEngine) -> bool:
        """Whether the rollout's log-probs of its sampled tokens are the trainer's (same weights, same numerics:
        both engines name the same numerics, e.g. the fp32 HF forward). Elsewhere (bf16, vLLM's kernels) a PPO
        ratio built on them would be numeric noise around 1, so the trainer recomputes them."""
        numerics = engine.logprob_numerics(actor)
        return numerics is not None and numerics == rollout.logprob_numerics()


def weight_bridge(cfg: RolloutConfig, lora: LoraConfig | None = None) -> WeightBridge:
    """The bridge ``cfg`` (the rollout config) describes, for an actor with ``lora`` (None or rank 0: full weights);
    the same on every rank, whether it holds a rollout engine or not."""
    spec = rollout_engine_spec(cfg)
    bucket = cfg.sync_bucket_mb if cfg.sync_bucket_mb is not None else (512.0 if torch.cuda.is_available() else 16.0)
    adapter = lora if lora is not None and lora.rank > 0 and spec.adapter_sync(cfg) else None
    return WeightBridge(dtype=spec.weight_dtype(cfg), bucket_mb=bucket, adapter=adapter)


def check_adapter_sync(cfg: RolloutConfig, lora: LoraConfig) -> RolloutConfig:
    """Refuse an adapter sync (``rollout.vllm.lora_sync=adapter``) without a LoRA actor or on an engine that does not
    take adapters; with both, the rollout config with the engine set up for adapters of the actor's rank."""
    asking = [name for name, spec in ROLLOUT_ENGINES.items() if spec.adapter_sync(cfg)]
    if not asking:
        return cfg
    if lora.rank == 0 or cfg.engine not in asking:
        raise ConfigError(
            f"rollout.vllm.lora_sync=adapter needs a LoRA actor (actor.lora.rank > 0, got {lora.rank}) "
            f"and an engine that takes adapters (rollout.engine={' or '.join(asking)}, got "
            f"{cfg.engine!r})"
        )
    return rollout_engine_spec(cfg).with_adapter_rank(cfg, lora.rank)


def logprob_gap(batch: rf.RolloutBatch, on_policy: bool, group: Any = None) -> dict[str, float]:
    """How far the rollout engine's log-probs of the sampled tokens are from the trainer's (verl's
    ``rollout_probs_diff``): the max and mean absolute difference over every rank's (of ``group``) loss tokens.
    Nothing when the trainer did not recompute them (the on-policy shortcut of :meth:`WeightBridge.logprobs_agree`)."""
    if on_policy or batch.rollout_logprobs is None:
        return {}
    mask = rf.loss_tokens(batch)
    gap = torch.where(mask, (batch.old_logprobs - batch.rollout_logprobs.to(batch.old_logprobs.device)).abs(), 0.0)
    peak = gap.amax().reshape(1) if gap.numel() else gap.new_zeros(1)
    gap_sum, tokens = all_reduce_sum(torch.stack([gap.sum(), mask.sum().to(gap.dtype)]), group=group).tolist()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    return {"logprob_gap/max": float(peak), "logprob_gap/mean": gap_sum / max(tokens, 1.0)}

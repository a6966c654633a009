"""A fingerprint of every step: what went in and what came out, per tensor, cheap enough to log every step.

Each tensor's fingerprint is two position-weighted sums of its bits (a hash: equal tensors give equal hashes, and a
changed bit, a swapped pair of elements or a changed shape changes it) and two floats that size a difference (the
sum and the absolute maximum). They are computed where the tensor lives (one reduction each on the GPU), stacked,
and read back with one transfer per step, so the cost is a pass over the weights and the batch.

A step's record groups the tensors by stage, in the order the step makes them (:data:`STAGES`), so that comparing two
runs names the first stage that differs: the sampled tokens and masks, the scores, the log-probs (old, reference,
values), the advantages and returns, the losses, the gradient norms and the updated weights. With several ranks each
rank's tensors are keyed ``name@rank``; the leader writes one line per step to ``fingerprints.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["STAGES", "FingerprintLog", "batch_fingerprints", "fingerprint_tensors", "module_tensors", "scalars"]

#: the stages of a step, in the order the step makes them
STAGES = ("samples", "scores", "logprobs", "advantages", "loss", "gradient", "weights")
#: which batch fields belong to which stage
BATCH_STAGES = {
    "samples": ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "loss_mask", "rollout_logprobs"),
    "scores": ("scores", "token_rewards"),
    "logprobs": ("old_logprobs", "ref_logprobs", "values"),
    "advantages": ("advantages", "returns"),
}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(x: Tensor) -> Tensor:
    """The tensor's elements as int64 bit patterns (floats reinterpreted, not converted)."""
    flat = x.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.to(torch.int64)
    if flat.is_floating_point() or flat.is_complex():
        flat = flat.view(_INT_OF_SIZE[flat.element_size()])
    return flat.to(torch.int64)


def fingerprint_tensors(tensors: Mapping[str, Tensor]) -> dict[str, dict[str, Any]]:
    """``{name: {"hash", "sum", "absmax", "shape"}}`` of every tensor, read back with two transfers."""
    if not tensors:
        return {}
    hashes, floats = [], []
    for x in tensors.values():
        bits = _bits(x)
        position = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64)
        hashes.append(torch.stack([bits.sum(), (bits * position).sum()]).cpu())
        values = x.detach().double() if x.numel() else torch.zeros(1, dtype=torch.float64, device=x.device)
        floats.append(torch.stack([values.sum(), values.abs().max()]).cpu())
    hashes, floats = torch.stack(hashes).tolist(), torch.stack(floats).tolist()
    return {
        name: {"hash": f"{h1 % 2**64:016x}{h2 % 2**64:016x}", "sum": s, "absmax": m, "shape": list(x.shape)}
        for (name, x), (h1, h2), (s, m) in zip(tensors.items(), hashes, floats)
    }


def batch_fingerprints(batch: Any) -> dict[str, dict[str, dict[str, Any]]]:
    """The batch's fields by stage (``samples``, ``scores``, ``logprobs``, ``advantages``); absent fields are left
    out."""
    out = {}
    for stage, names in BATCH_STAGES.items():
        fields = {n: getattr(batch, n) for n in names if getattr(batch, n, None) is not None}
        out[stage] = fingerprint_tensors(fields)
    return out


def module_tensors(prefix: str, module: Any) -> dict[str, Tensor]:
    """A module's parameters by ``prefix.name``, each rank's own shard (a DTensor's local tensor)."""
    out = {}
    for name, p in module.named_parameters():
        out[f"{prefix}.{name}"] = p.to_local() if hasattr(p, "to_local") else p
    return out


def scalars(metrics: Mapping[str, Any], names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Metrics (a loss, a gradient norm) as fingerprints: the value itself is the hash."""
    out = {}
    for name in names:
        if name in metrics:
            value = float(metrics[name])
            out[name] = {"hash": repr(value), "sum": value, "absmax": abs(value), "shape": []}
    return out


class FingerprintLog:
    """``fingerprints.jsonl`` in the run dir: one line per step, every rank's fingerprints gathered to the leader
    (a collective of ``group``)."""

    def __init__(self, run_dir: Path, *, enabled: bool, group: Any = None) -> None:
        self.path = Path(run_dir) / "fingerprints.jsonl"
        self.enabled, self.group = enabled, group

    def log(self, step: int, stages: dict[str, dict[str, dict[str, Any]]]) -> None:
        if not self.enabled:
            return
        ranks = [stages]
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            ranks = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(ranks, stages, group=self.group)
            if dist.get_rank(self.group) != 0:
                return
        many = len(ranks) > 1
        merged = {
            stage: {
                (f"{name}@{r}" if many else name): fp
                for r, mine in enumerate(ranks)
                for name, fp in mine.get(stage, {}).items()
            }
            for stage in STAGES
        }
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **merged}) + "\n")

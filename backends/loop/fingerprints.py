"""A fingerprint of every step: what went in and what came out, per tensor, cheap enough to log every step.

Each tensor's fingerprint is two position-weighted sums of its bits (a hash: equal tensors give equal hashes, and a
changed bit or a swapped pair of different elements changes it; the shape is recorded beside it) and two floats
that size a difference (the sum and the absolute maximum). They are computed where the tensor lives (a few
reductions each, no copy of the tensor), stacked, and read back with one transfer per step, so the cost is a few
reads of the weights and the batch.

A step's record groups the tensors by stage, in the order the step makes them (:data:`STAGES`), so that comparing two
runs names the first stage that differs: the sampled tokens and masks, the scores, the log-probs (old, reference,
values), the advantages and returns, the losses, the gradient norms and the updated weights. With several ranks each
rank writes its own line per step to ``fingerprints/rank<r>.jsonl``, and a reader merges them with each rank's tensors
keyed ``name@rank``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Hashable, Iterable, Mapping

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "STAGES",
    "FingerprintLog",
    "merge_ranks",
    "rank_files",
    "read_run",
    "batch_tensors",
    "fingerprint_stages",
    "fingerprint_tensors",
    "gather_fingerprints",
    "module_tensors",
    "scalars",
]

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


def _bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer type of a dtype's width: its elements' bits are read as it (floats reinterpreted, not converted)."""
    if dtype == torch.bool:
        return torch.uint8
    if dtype.is_floating_point or dtype.is_complex:
        return _INT_OF_SIZE[torch.empty((), dtype=dtype).element_size()]
    return dtype


def _columns(n: int) -> int:
    """The row length a tensor of ``n`` elements is hashed in: the largest power of two up to 64 that divides it."""
    return next(c for c in (64, 32, 16, 8, 4, 2, 1) if n % c == 0)


@attrs.frozen
class _Layout:
    """Which tensor each row and column sum of a group belongs to, and its weight (its position in that tensor, from
    1)."""

    row_tensor: Tensor
    row_weight: Tensor
    column_tensor: Tensor
    column_weight: Tensor


#: layouts kept (the weights' is the same every step; the batch's changes with its lengths)
_LAYOUTS_KEPT = 16
_layouts: dict[tuple, _Layout] = {}


def _layout(rows: tuple[int, ...], columns: tuple[int, ...], device: Any) -> _Layout:
    key = (rows, columns, device)
    if key not in _layouts:

        def numbering(sizes: tuple[int, ...]) -> tuple[Tensor, Tensor]:
            counts = torch.tensor(sizes, dtype=torch.int64)
            owner = torch.repeat_interleave(torch.arange(len(sizes)), counts)
            position = torch.arange(int(counts.sum())) - (counts.cumsum(0) - counts)[owner] + 1
            return owner.to(device), position.to(device)

        if len(_layouts) >= _LAYOUTS_KEPT:
            del _layouts[next(iter(_layouts))]
        _layouts[key] = _Layout(*numbering(rows), *numbering(columns))
    return _layouts[key]


def _group_stats(flats: list[Tensor]) -> tuple[Tensor, Tensor]:
    """The fingerprints of non-empty tensors of one dtype on one device: ``[k, 2]`` int64 hashes (by row, by column;
    see :func:`fingerprint_tensors`) and ``[k, 3]`` float64 ``[sum, min, max]``.

    Each tensor costs four reductions (its row sums, column sums, sum, min and max); the weighting of the sums and
    the stacking are done once for the group, so that many small tensors cost little more than their bytes."""
    row_sums, column_sums, sums, lows, highs = [], [], [], [], []
    dtype = flats[0].dtype
    bits_dtype = _bits_dtype(dtype)
    # 32-bit sums that wrap around (a hash needs no more, and they run several times faster than 64-bit ones)
    accumulate = torch.int32 if flats[0].element_size() <= 4 else torch.int64
    for flat in flats:  # as few dispatches per tensor as its reductions need: on a CPU each costs microseconds
        blocks = flat.view(bits_dtype).view(-1, _columns(flat.numel()))
        row_sums.append(blocks.sum(1, dtype=accumulate))
        column_sums.append(blocks.sum(0, dtype=accumulate))
        values = flat.view(torch.uint8) if dtype == torch.bool else flat
        if dtype in (torch.float16, torch.bfloat16):
            values = values.float()
        sums.append(values.sum())
        low, high = torch.aminmax(values)
        lows.append(low)
        highs.append(high)
    layout = _layout(tuple(r.numel() for r in row_sums), tuple(c.numel() for c in column_sums), flats[0].device)
    k = len(flats)
    hashes = torch.zeros(k, 2, dtype=torch.int64, device=flats[0].device)
    hashes[:, 0].index_add_(0, layout.row_tensor, torch.cat(row_sums).to(torch.int64) * layout.row_weight)
    hashes[:, 1].index_add_(0, layout.column_tensor, torch.cat(column_sums).to(torch.int64) * layout.column_weight)
    floats = torch.stack([torch.stack(sums), torch.stack(lows), torch.stack(highs)], 1).double()
    return hashes, floats


@torch.inference_mode()  # no autograd bookkeeping on a parameter's reductions
def fingerprint_tensors(tensors: Mapping[Hashable, Tensor]) -> dict[Hashable, dict[str, Any]]:
    """``{name: {"hash", "sum", "absmax", "shape"}}`` of every tensor, read back with one transfer per device.

    The hash is two int64 sums of the tensor's bits, seen as rows of up to 64 elements: the row sums weighted by
    their row and the column sums weighted by their column. A changed element changes both; two swapped elements of
    different values change one or the other. A few reads of each tensor, no copy of it; tensors of one dtype are
    finished together (:func:`_group_stats`)."""
    if not tensors:
        return {}
    flats = [x.reshape(-1) for x in tensors.values()]  # under inference mode: no autograd, no detach needed
    groups: dict[tuple[torch.dtype, Any], list[int]] = {}
    for i, flat in enumerate(flats):
        if flat.numel():
            groups.setdefault((flat.dtype, flat.device), []).append(i)
    read = [([0, 0], [0.0, 0.0, 0.0]) for _ in flats]  # an empty tensor's
    for members in groups.values():
        hashes, floats = _group_stats([flats[i] for i in members])
        for i, h, f in zip(members, hashes.cpu().tolist(), floats.cpu().tolist()):
            read[i] = (h, f)
    return {
        name: {
            "hash": f"{h1 % 2**64:016x}{h2 % 2**64:016x}:{x.numel()}",
            "sum": total,
            "absmax": max(-low, high),
            "shape": list(x.shape),
        }
        for (name, x), ((h1, h2), (total, low, high)) in zip(tensors.items(), read)
    }


def batch_tensors(batch: Any) -> dict[str, dict[str, Tensor]]:
    """The batch's fields by stage (``samples``, ``scores``, ``logprobs``, ``advantages``); absent fields are left
    out."""
    return {
        stage: {n: getattr(batch, n) for n in names if getattr(batch, n, None) is not None}
        for stage, names in BATCH_STAGES.items()
    }


def fingerprint_stages(stages: Mapping[str, Mapping[str, Tensor]]) -> dict[str, dict[str, dict[str, Any]]]:
    """:func:`fingerprint_tensors` of tensors by stage, all at once (one group per dtype across the stages)."""
    flat = fingerprint_tensors({(stage, name): x for stage, tensors in stages.items() for name, x in tensors.items()})
    out: dict[str, dict[str, dict[str, Any]]] = {stage: {} for stage in stages}
    for (stage, name), fp in flat.items():
        out[stage][name] = fp
    return out


@torch.no_grad()  # a DTensor's to_local is a differentiable op: no graph for a fingerprint
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


def merge_ranks(ranks: list[dict]) -> dict[str, dict]:
    """Every rank's fingerprints of a step in one record: tensors keyed ``name@rank`` with several ranks."""
    many = len(ranks) > 1
    return {
        stage: {
            (f"{name}@{r}" if many else name): fp
            for r, mine in enumerate(ranks)
            for name, fp in mine.get(stage, {}).items()
        }
        for stage in STAGES
    }


def gather_fingerprints(stages: dict[str, dict[str, dict[str, Any]]], group: Any = None) -> dict | None:
    """Every rank's (of ``group``) fingerprints in one record (:func:`merge_ranks`) on the group's first rank, None
    elsewhere. A collective of ``group``."""
    ranks = [stages]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        ranks = [None] * dist.get_world_size(group)
        dist.all_gather_object(ranks, stages, group=group)
        if dist.get_rank(group) != 0:
            return None
    return merge_ranks(ranks)


class FingerprintLog:
    """``fingerprints/rank<r>.jsonl`` in the run dir: one line per step from each rank of the actor's pool, written by
    that rank (no collective: a step waits for no other rank to log); :func:`read_run` merges them."""

    def __init__(self, run_dir: Path, *, enabled: bool, rank: int = 0) -> None:
        self.path = Path(run_dir) / "fingerprints" / f"rank{rank}.jsonl"
        self.enabled = enabled

    def log(self, step: int, stages: dict[str, dict[str, dict[str, Any]]]) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **stages}) + "\n")


def rank_files(run_dir: str | Path) -> list[Path]:
    """A run's fingerprint files, by rank."""
    files = list((Path(run_dir) / "fingerprints").glob("rank*.jsonl"))
    return sorted(files, key=lambda p: int(p.stem.removeprefix("rank")))


def read_run(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """A run's fingerprints by step, every rank's merged (:func:`merge_ranks`); a missing file or a bad line is an
    error naming it."""
    files = rank_files(run_dir)
    if not files:
        raise FileNotFoundError(
            f"{Path(run_dir) / 'fingerprints'}: no fingerprints (a run writes them with debug.fingerprints=true)"
        )
    per_rank = []
    for path in files:
        rows = {}
        for number, line in enumerate(path.read_text().splitlines(), 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON line ({e})") from None
            rows[row["step"]] = row
        per_rank.append(rows)
    steps = sorted(set().union(*per_rank))
    return {s: {"step": s, **merge_ranks([rows.get(s, {}) for rows in per_rank])} for s in steps}

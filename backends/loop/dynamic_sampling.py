"""DAPO's dynamic sampling: fill a share of a step's batch with groups whose scores differ, over sampling rounds.

One :class:`GroupFiller` per share (a data rank's in the colocated loop, each served trainer's on a rollout rank of
the split loop). Every round the caller samples and scores a round of prompts and hands the batch to
:meth:`GroupFiller.add`, which keeps the first informative groups up to the share; rounds continue while any
filler of any rank in the agreement is short (:func:`any_short`: the same number of rounds everywhere) or until
``algo.max_sampling_rounds``. A share still short then fills up with the last round's other groups (zero
advantage: no gradient under GRPO). :func:`round_seed` is every round's sampling seed, the same in both loops.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

import rlfunc as rf
from backends.distributed.collectives import all_reduce_sum
from backends.distributed.placement import concat_padded

__all__ = ["GroupFiller", "any_short", "first_groups", "round_seed", "rounds_metrics"]


def round_seed(seed: int, step: int, rounds: int, dp_size: int, dp_rank: int) -> int:
    """The sampling seed of data rank ``dp_rank``'s share in round ``rounds`` of ``step``. The colocated loop and the
    split loop (where trainer ``t`` takes data rank ``t``'s place) both use it, so a split run samples what the
    colocated run would, whatever the number of rollout ranks."""
    return ((seed * 1_000_003 + step) * 64 + rounds) * dp_size + dp_rank


def rounds_metrics(rounds: int, drawn: int, informative: float) -> dict[str, float]:
    """The logged ``sampling/*`` metrics of one step's dynamic sampling."""
    return {
        "sampling/rounds": float(rounds),
        "sampling/prompts_drawn": float(drawn),
        "sampling/informative_groups": informative,
    }


def first_groups(group_ids: torch.Tensor, keep: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices of the first ``count`` groups (in row order) among the rows ``keep`` marks, and the rest."""
    chosen: list[int] = []
    for g in group_ids[keep].tolist():
        if g not in chosen and len(chosen) < count:
            chosen.append(g)
    taken = torch.isin(group_ids, torch.tensor(chosen, dtype=group_ids.dtype)) & keep
    return taken.nonzero().squeeze(-1), (~taken).nonzero().squeeze(-1)


class GroupFiller:
    """The informative groups of one share (``share`` groups) collected over rounds, and the last round's rest."""

    def __init__(self, share: int) -> None:
        self.share = share
        self.kept: list[tuple[rf.RolloutBatch, list]] = []
        self.num_kept = 0
        self.spare: tuple[rf.RolloutBatch, list] | None = None

    @property
    def short(self) -> bool:
        return self.num_kept < self.share

    def add(self, batch: rf.RolloutBatch, rows: Sequence[Any]) -> None:
        """A scored round (``rows``: the example of each row): keep its first informative groups the share still
        needs; the rest are the spare a short share fills up from."""
        informative = rf.informative_groups(batch.scores, group_ids=batch.group_ids)
        take, rest = first_groups(batch.group_ids, informative, self.share - self.num_kept)
        self.kept.append((rf.select(batch, take), [rows[i] for i in take.tolist()]))
        self.spare = (rf.select(batch, rest), [rows[i] for i in rest.tolist()])
        self.num_kept += len(set(batch.group_ids[take].tolist()))

    def result(self) -> tuple[rf.RolloutBatch, list, float]:
        """The share's batch, the example of each row and the fraction of its groups that are informative."""
        informative = self.num_kept / self.share
        kept = list(self.kept)
        if self.short and self.spare is not None:  # the cap was reached: fill up with uninformative groups
            batch, rows = self.spare
            fill, _ = first_groups(batch.group_ids, torch.ones(len(rows), dtype=torch.bool), self.share - self.num_kept)
            kept.append((rf.select(batch, fill), [rows[i] for i in fill.tolist()]))
        batch = concat_padded([b for b, _ in kept if rf.batch_size(b) > 0] or [kept[0][0]])
        return batch, [r for _, part in kept for r in part], informative


def any_short(fillers: Sequence[GroupFiller], group: Any = None) -> bool:
    """Whether a filler of any rank of ``group`` is still short (a collective of ``group``: every rank runs the
    same number of rounds)."""
    short = torch.tensor([float(any(f.short for f in fillers))])
    return all_reduce_sum(short, group=group).item() > 0

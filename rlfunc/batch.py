"""Immutable batch pytrees and the row operations on them (select, split, concatenate, validate).

A batch is a frozen ``attrs`` class registered as a torch pytree (see :func:`rlfunc.tree.pytree_dataclass`).
Every tensor field has its row (sequence) dimension first, so the row operations below work on any
such class, not only :class:`RolloutBatch`. Field shapes are declared in einops notation with
``shape_field("b t")`` and checked by :func:`validate`, which names the field, the expected and the
actual shape.
"""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

import attrs
import torch
from torch import Tensor

from rlfunc.checks import check_finite_fast, check_shape, is_transformed
from rlfunc.tree import pytree_dataclass, tree_leaves, tree_map, tree_structure

__all__ = [
    "RolloutBatch",
    "loss_tokens",
    "shape_field",
    "validate",
    "batch_size",
    "select",
    "split",
    "split_by_token_budget",
    "token_budget_partitions",
    "concat",
]

B = TypeVar("B")


def shape_field(dims: str, *, dtype: str | None = None, optional: bool = True) -> Any:
    """An attrs field whose tensor has the einops-style shape ``dims`` (``"b t"``, ``"b"``)."""
    meta = {"shape": dims, "dtype": dtype}
    if optional:
        return attrs.field(default=None, metadata=meta)
    return attrs.field(metadata=meta)


@pytree_dataclass
class RolloutBatch:
    """Prompts, sampled responses and everything computed about them during one RL step.

    ``b`` counts sequences (``n`` samples per prompt are ``n`` rows sharing a ``group_id``), ``p`` is the
    left-padded prompt length and ``t`` the right-padded response length. Masks are ``torch.bool``.
    Per-token fields are aligned with ``response_ids``: ``old_logprobs[i, j]`` is the log-probability of
    ``response_ids[i, j]`` given everything before it.
    """

    prompt_ids: Tensor = shape_field("b p", dtype="int", optional=False)
    prompt_mask: Tensor = shape_field("b p", dtype="bool", optional=False)
    response_ids: Tensor = shape_field("b t", dtype="int", optional=False)
    response_mask: Tensor = shape_field("b t", dtype="bool", optional=False)
    group_ids: Tensor = shape_field("b", dtype="int", optional=False)
    rollout_logprobs: Tensor | None = shape_field("b t", dtype="float")  # from the rollout engine
    old_logprobs: Tensor | None = shape_field("b t", dtype="float")  # recomputed by the trainer
    ref_logprobs: Tensor | None = shape_field("b t", dtype="float")
    values: Tensor | None = shape_field("b t", dtype="float")
    old_values: Tensor | None = shape_field("b t", dtype="float")
    token_rewards: Tensor | None = shape_field("b t", dtype="float")
    #: the response tokens that carry loss, when not all of them do (DAPO's overlong filter, the tool and
    #: environment tokens of a multi-turn trajectory); None: every ``response_mask`` token. The model
    #: still reads (attends to) every ``response_mask`` token. See :func:`loss_tokens`.
    loss_mask: Tensor | None = shape_field("b t", dtype="bool")
    #: multi-turn trajectories: the turn each response token belongs to (a turn: the observation that precedes
    #: it, then the model's reply), counting from 0
    turn_ids: Tensor | None = shape_field("b t", dtype="int")
    #: asynchronous rollout: the version of the policy weights that sampled each response token (the number
    #: of optimizer updates behind them; a trajectory may span several versions when the weights change
    #: mid-generation); None: every token comes from the weights being trained. See
    #: :func:`rlfunc.importance.staleness`.
    policy_version: Tensor | None = shape_field("b t", dtype="int")
    scores: Tensor | None = shape_field("b", dtype="float")  # one verifiable score per sequence
    advantages: Tensor | None = shape_field("b t", dtype="float")
    returns: Tensor | None = shape_field("b t", dtype="float")

    @property
    def input_ids(self) -> Tensor:
        """``(b, p + t)`` prompt followed by response, as the model reads it."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)


def loss_tokens(batch: RolloutBatch) -> Tensor:
    """``(b t)`` bool: the tokens losses and their normalisers count, ``loss_mask`` if set, else ``response_mask``."""
    return batch.response_mask if batch.loss_mask is None else batch.loss_mask


_DTYPE_OK = {
    "int": lambda d: not d.is_floating_point and d != torch.bool and not d.is_complex,
    "bool": lambda d: d == torch.bool,
    "float": lambda d: d.is_floating_point,
}


#: float fields that may hold -inf at a loss token (the log-probability of an impossible token); NaN never
_MAY_BE_INFINITE = frozenset({"rollout_logprobs", "old_logprobs", "ref_logprobs"})


def validate(batch: B) -> B:
    """Check every present field against its declared shape and dtype, and its float values at the loss
    tokens (NaN there, or inf in anything but a log-probability, would make the loss NaN); return the batch
    unchanged. Values outside the loss tokens (padding) may be anything."""
    bound: dict[str, int] = {}
    cls_name = type(batch).__name__
    floats = []
    for f in attrs.fields(type(batch)):
        value = getattr(batch, f.name)
        dims = f.metadata.get("shape")
        if value is None or dims is None:
            continue
        check_shape(f"{cls_name}.{f.name}", value, dims, bound)
        kind = f.metadata.get("dtype")
        if kind is not None and not _DTYPE_OK[kind](value.dtype):
            raise TypeError(f"{cls_name}.{f.name} must have a {kind} dtype, got {value.dtype}")
        if kind == "float":
            floats.append((f.name, value, dims))
    _check_values(batch, cls_name, floats)
    return batch


def _check_values(batch: Any, cls_name: str, floats: list[tuple[str, Tensor, str]]) -> None:
    mask = getattr(batch, "loss_mask", None)
    mask = getattr(batch, "response_mask", None) if mask is None else mask
    for name, value, dims in floats:
        usable = isinstance(mask, Tensor) and mask.dtype == torch.bool and mask.shape == value.shape
        where = mask if dims == "b t" and usable else None
        if is_transformed(value):
            continue
        if name in _MAY_BE_INFINITE:
            nan = torch.isnan(value) if where is None else torch.isnan(value) & where
            if bool(nan.any()):
                idx = tuple(nan.nonzero()[0].tolist())
                raise ValueError(f"{cls_name}.{name} is NaN at index {idx}, a loss token")
        else:
            check_finite_fast(f"{cls_name}.{name} (at the loss tokens)", value, where)


def batch_size(batch: Any) -> int:
    """Number of rows: the leading dim shared by every tensor leaf."""
    sizes = {leaf.shape[0] for leaf in tree_leaves(batch) if isinstance(leaf, Tensor)}
    if len(sizes) != 1:
        raise ValueError(f"batch leaves disagree on the row dimension: sizes {sorted(sizes)}")
    return sizes.pop()


def select(batch: B, index: Tensor | slice | Sequence[int]) -> B:
    """Rows ``index`` of every tensor leaf (an index tensor, a list of ints or a slice)."""
    if isinstance(index, Sequence) and not isinstance(index, Tensor):
        index = torch.as_tensor(index, dtype=torch.long)
    return tree_map(lambda x: x[index] if isinstance(x, Tensor) else x, batch)


def split(batch: B, num_chunks: int | None = None, *, chunk_size: int | None = None) -> list[B]:
    """Split rows into ``num_chunks`` near-equal micro-batches, or chunks of ``chunk_size`` rows."""
    n = batch_size(batch)
    if (num_chunks is None) == (chunk_size is None):
        raise ValueError("give exactly one of num_chunks and chunk_size")
    if num_chunks is not None:
        if not 1 <= num_chunks <= n:
            raise ValueError(f"num_chunks must be in [1, {n}] for a batch of {n} rows, got {num_chunks}")
        base, extra = divmod(n, num_chunks)
        sizes = [base + (i < extra) for i in range(num_chunks)]
    else:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        sizes = [min(chunk_size, n - s) for s in range(0, n, chunk_size)]
    out, start = [], 0
    for size in sizes:
        out.append(select(batch, slice(start, start + size)))
        start += size
    return out


def token_budget_partitions(tokens_per_row: Tensor, max_tokens: int) -> list[list[int]]:
    """Group consecutive rows so each group's token total stays within ``max_tokens`` (order kept).

    A row longer than the budget cannot be placed and raises.
    """
    counts = tokens_per_row.tolist()
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, c in enumerate(counts):
        if c > max_tokens:
            raise ValueError(f"row {i} has {int(c)} tokens, more than the micro-batch budget max_tokens={max_tokens}")
        if current and total + c > max_tokens:
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += c
    if current:
        groups.append(current)
    return groups


def split_by_token_budget(batch: B, tokens_per_row: Tensor, max_tokens: int) -> list[B]:
    """Micro-batches of consecutive rows with at most ``max_tokens`` tokens each."""
    return [select(batch, g) for g in token_budget_partitions(tokens_per_row, max_tokens)]


def concat(batches: Sequence[B]) -> B:
    """Concatenate batches of one type along rows. Tensors of different time length are not padded."""
    if not batches:
        raise ValueError("concat needs at least one batch")
    first = batches[0]
    structure = tree_structure(first)
    for b in batches[1:]:
        if type(b) is not type(first):
            raise TypeError(f"cannot concatenate {type(first).__name__} with {type(b).__name__}")
        if tree_structure(b) != structure:
            raise ValueError(
                f"cannot concatenate batches with different fields set: {structure} vs {tree_structure(b)}"
            )
    return tree_map(lambda *xs: torch.cat(xs, dim=0), *batches)

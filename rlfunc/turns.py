"""Multi-turn trajectories: per-turn rewards placed on tokens.

A multi-turn trajectory's response interleaves the model's turns with the observations that answer them; the
batch marks the model's tokens in ``loss_mask`` and the turn of every token in ``turn_ids``. Everything else in
the core already works on such holes in a mask (estimators, losses and aggregation count only the masked-in
tokens; ``tests/test_turns.py`` checks each against the same trajectory with the holes squeezed out).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlfunc.checks import check_mask, check_same_shape, check_shape

__all__ = ["turn_rewards_to_tokens"]


def turn_rewards_to_tokens(turn_rewards: Tensor, *, turn_ids: Tensor, loss_mask: Tensor) -> Tensor:
    """``(b k), (b t), (b t) -> (b t)``: each turn's reward on the last model token of that turn, 0 elsewhere.

    The token-level rewards a PPO / GAE recipe adds its outcome reward to (verl's ``token_level_scores`` of a
    multi-turn rollout). A turn with no model token (cut before the model spoke) drops its reward; turns past
    ``k`` have none.
    """
    check_shape("turn_rewards", turn_rewards, "b k")
    check_shape("turn_ids", turn_ids, f"{turn_rewards.shape[0]} t")
    check_same_shape("turn_ids", turn_ids, loss_mask=loss_mask)
    check_mask("loss_mask", loss_mask)
    b, t = turn_ids.shape
    k = turn_rewards.shape[1]
    positions = torch.arange(t, device=turn_ids.device).expand(b, t)
    # the last model token of each turn: the largest position per (row, turn) among the loss tokens
    in_range = loss_mask & (turn_ids >= 0) & (turn_ids < k)
    index = turn_ids.clamp(0, max(k - 1, 0))
    last = torch.full((b, max(k, 1)), -1, dtype=torch.long, device=turn_ids.device)
    last = last.scatter_reduce(1, index, torch.where(in_range, positions, -1), reduce="amax")
    is_last = in_range & (positions == last.gather(1, index))
    return torch.where(
        is_last, turn_rewards.to(torch.float32).gather(1, index), torch.zeros((), device=turn_ids.device)
    )

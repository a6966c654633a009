r"""DAPO's sampling and shaping pieces (Yu et al. 2025, https://arxiv.org/abs/2503.14476), as pure functions.

- **Dynamic sampling** keeps only the groups whose samples got different rewards: a group where every
  sample scored the same has zero group-relative advantage and no gradient, so the recipe draws more
  prompts until the batch is full of informative groups (:func:`informative_groups`).
- **Overlong reward shaping** penalises a response softly as it runs into the last ``buffer_length``
  tokens of the length budget (:func:`overlong_penalty`, the paper's eq. 13).
- **Overlong filtering** takes responses that hit the budget without ending (truncated) out of the loss
  (:func:`truncated_responses`), so the model is not punished for an answer it was not allowed to finish.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from rlfunc.checks import check_mask, check_same_shape, check_shape

__all__ = ["informative_groups", "overlong_penalty", "truncated_responses"]


def informative_groups(scores: Tensor, *, group_ids: Tensor) -> Tensor:
    """``(b,)`` bool: the rows of groups whose scores are not all equal, plus groups of a single row.

    The filter of DAPO's dynamic sampling and verl's ``filter_groups`` (a group is kept when the standard
    deviation of its scores is positive, or when it has one sample). Scores compare exactly.
    """
    check_shape("scores", scores, "b")
    check_same_shape("scores", scores, group_ids=group_ids)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    num_groups = counts.shape[0]
    low = torch.full((num_groups,), float("inf"), dtype=scores.dtype, device=scores.device)
    high = torch.full((num_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    low = low.scatter_reduce(0, inverse, scores, reduce="amin")
    high = high.scatter_reduce(0, inverse, scores, reduce="amax")
    keep = (high > low) | (counts == 1)
    return keep[inverse]


def overlong_penalty(
    response_lengths: Tensor,
    *,
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> Tensor:
    r"""DAPO's soft overlong punishment, added to each response's reward (float, same shape as the lengths).

    .. math::
        R(y) = \begin{cases} 0 & |y| \le L_{max} - L_{cache} \\
               \frac{(L_{max} - L_{cache}) - |y|}{L_{cache}} & L_{max} - L_{cache} < |y| \le L_{max} \\
               -1 & |y| > L_{max} \end{cases}

    times ``penalty_factor``, with :math:`L_{max}` = ``max_response_length`` and :math:`L_{cache}` =
    ``buffer_length``. Equals verl's ``DAPORewardManager`` shaping (``min(-exceed / buffer * factor, 0)``)
    wherever the length is within the budget, which a sampler's lengths always are.
    """
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"buffer_length must be in (0, max_response_length={max_response_length}], got {buffer_length}"
        )
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    lengths = response_lengths.to(torch.float32)
    exceed = lengths - (max_response_length - buffer_length)
    return (-(exceed / buffer_length).clamp(min=0.0, max=1.0)) * penalty_factor


def truncated_responses(response_ids: Tensor, *, response_mask: Tensor, eos_token_ids: Sequence[int]) -> Tensor:
    """``(b,)`` bool: responses whose last token is not an end-of-sequence token (cut off by the length
    budget; an empty response counts as truncated). Responses are right-padded, ``response_mask`` marks
    their tokens."""
    check_shape("response_ids", response_ids, "b t")
    check_same_shape("response_ids", response_ids, response_mask=response_mask)
    check_mask("response_mask", response_mask)
    if not eos_token_ids:
        raise ValueError("eos_token_ids is empty")
    lengths = response_mask.sum(-1)
    last = response_ids.gather(1, (lengths - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ended = torch.isin(last, torch.tensor(list(eos_token_ids), device=response_ids.device)) & (lengths > 0)
    return ~ended

r"""Outcome advantage estimators: one score per response, a baseline from its group (or a greedy rollout).

:func:`grpo`, :func:`grpo_passk`, :func:`rloo`, :func:`reinforce_pp_baseline`, :func:`opo`, :func:`gpg`
take ``scores`` ``(b,)`` and integer ``group_ids`` ``(b,)`` naming the prompt each response answers;
:func:`remax` takes the greedy response's score instead of a group. Ids are arbitrary integers (not
necessarily contiguous, sorted, small or non-negative; verl's vectorised estimators allocate
``max(id) + 1`` slots and fail on negative ids); groups are found with a sort and segment sums, with no
numpy, no Python loop over sequences and no host sync beyond the input checks.

Every estimator returns two distinct tensors ``(advantages, returns)`` of shape ``(b, t)``: the
per-response advantage broadcast over the response tokens, 0 outside ``response_mask``. None of them
whitens (:func:`rlfunc.masked.masked_whiten` does, where the algorithm wants it).

Where verl 0.9.1 computes the same quantity the numbers agree in fp32 to 1e-5 on the response mask.
Differences, all deliberate:

- outside ``response_mask`` every output is 0 (verl's ReMax leaves cumulative values there, which no
  loss reads);
- a group with a single response has no baseline. By default (``singletons="no_baseline"``) its
  baseline is 0 and its std 1, as in verl's loop implementations; ``"zero"`` gives such a response a
  0 advantage instead (verl's ``rloo_vectorized``) and ``"error"`` raises;
- outputs are computed and returned in at least float32 (bf16 scores are promoted);
- ``returns`` equal the advantages (verl's convention: no critic reads them), but are a separate
  tensor, so writing into one never changes the other (verl returns one tensor twice); ReMax's returns
  are the scores.

Bad inputs raise with the argument named: shapes (via :mod:`rlfunc.checks`), a non-bool mask, float
group ids, NaN/inf scores (skipped under ``torch.func`` transforms).

Every argument after ``scores`` is keyword-only: verl's positional orders differ from ours, and a
positional port would silently compute something else.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from rlfunc.checks import bind, check_finite_fast, check_floating, check_mask, is_transformed
from rlfunc.masked import mask_weights

__all__ = ["grpo", "grpo_passk", "rloo", "reinforce_pp_baseline", "opo", "gpg", "remax"]

Singletons = Literal["no_baseline", "zero", "error"]
_SINGLETON_MODES = ("no_baseline", "zero", "error")

# ----------------------------------------------------------------------------------------------------
# Outcome estimators: groups from integer ids, segment sums
# ----------------------------------------------------------------------------------------------------


def _dense_group_index(group_ids: Tensor) -> Tensor:
    """Map arbitrary integer ids to ``0 .. G-1`` (``G <= b``) by sorting; no host sync, no unique()."""
    b = group_ids.shape[0]
    order = torch.argsort(group_ids, stable=True)
    sorted_ids = torch.gather(group_ids, 0, order)
    starts = torch.cat(
        [torch.ones(min(b, 1), dtype=torch.bool, device=group_ids.device), sorted_ids[1:] != sorted_ids[:-1]]
    )
    dense_sorted = torch.cumsum(starts, dim=0) - 1
    return torch.zeros_like(dense_sorted).scatter(0, order, dense_sorted)


def _segment_sum(x: Tensor, group: Tensor) -> Tensor:
    """Per-group sums of ``x`` ``(b,)``, indexed by dense group id (length ``b``; unused ids hold 0)."""
    return torch.zeros_like(x).index_add(0, group, x)


def _per_sample(stat: Tensor, group: Tensor) -> Tensor:
    return torch.gather(stat, 0, group)


class _Groups(NamedTuple):
    """Per-response statistics of its group: count, sum, mean, unbiased variance (two-pass, as ``torch.std``)."""

    index: Tensor  # (b,) dense group id
    count: Tensor
    total: Tensor
    mean: Tensor
    var: Tensor

    @property
    def singleton(self) -> Tensor:
        return self.count < 2


def _group_stats(scores: Tensor, group_ids: Tensor) -> _Groups:
    index = _dense_group_index(group_ids)
    count = _segment_sum(torch.ones_like(scores), index)
    total = _segment_sum(scores, index)
    mean = total / count.clamp(min=1)
    centered = scores - _per_sample(mean, index)
    var = _segment_sum(centered * centered, index) / (count - 1).clamp(min=1)
    return _Groups(index, *(_per_sample(stat, index) for stat in (count, total, mean, var)))


def _check_outcome_inputs(scores: Tensor, group_ids: Tensor | None, response_mask: Tensor) -> None:
    specs = {"scores": (scores, "b"), "response_mask": (response_mask, "b t")}
    if group_ids is not None:
        specs["group_ids"] = (group_ids, "b")
    bind(specs)
    check_mask("response_mask", response_mask)
    check_floating("scores", scores)
    check_finite_fast("scores", scores)
    if group_ids is not None and (
        group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool
    ):
        raise TypeError(
            f"group_ids must be an integer tensor (one id per prompt), got {group_ids.dtype}; "
            "map string uids to integers once, outside the hot path"
        )


def _first_singleton(groups: _Groups, group_ids: Tensor) -> str:
    i = int(groups.singleton.nonzero()[0, 0])
    return f"response {i}, group id {int(group_ids[i])}"


def _check_singletons(mode: str, groups: _Groups, group_ids: Tensor, name: str) -> None:
    if mode not in _SINGLETON_MODES:
        raise ValueError(f"unknown singletons mode {mode!r}; known modes: {', '.join(_SINGLETON_MODES)}")
    if mode == "error" and not is_transformed(groups.count) and bool(groups.singleton.any()):
        raise ValueError(
            f"{name}: group_ids has a group of one response ({_first_singleton(groups, group_ids)}), "
            "which has no baseline. Sample several responses per prompt, or pass "
            "singletons='no_baseline' or 'zero'"
        )


def _baseline_for(groups: _Groups, baseline: Tensor) -> Tensor:
    """verl's singleton convention: a group of one has baseline 0."""
    return torch.where(groups.singleton, torch.zeros_like(baseline), baseline)


def _finish(per_seq: Tensor, groups: _Groups | None, mode: str, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    if groups is not None and mode == "zero":
        per_seq = torch.where(groups.singleton, torch.zeros_like(per_seq), per_seq)
    # Scores are finite (checked), so a 0/1 multiply masks exactly and is faster than selecting.
    keep = mask_weights(response_mask, per_seq.dtype)
    advantages = keep * per_seq.unsqueeze(-1)
    if is_transformed(per_seq) or is_transformed(keep) or (per_seq.requires_grad and torch.is_grad_enabled()):
        return advantages, keep * per_seq.unsqueeze(-1)
    return advantages, keep.mul_(per_seq.unsqueeze(-1))  # reuse our own temporary for the second output


def _work(scores: Tensor) -> Tensor:
    return scores.to(torch.promote_types(scores.dtype, torch.float32))


def grpo(
    scores: Tensor,
    *,
    group_ids: Tensor,
    response_mask: Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    singletons: Singletons = "no_baseline",
) -> tuple[Tensor, Tensor]:
    r"""GRPO group-relative advantage (Shao et al. 2024, https://arxiv.org/abs/2402.03300).

    For response :math:`i` of group :math:`g` with scores :math:`\{s_j\}_{j \in g}`:

    .. math:: A_i = \frac{s_i - \mathrm{mean}_g(s)}{\mathrm{std}_g(s) + \epsilon}

    with the unbiased (Bessel) std, broadcast over the response tokens. ``norm_by_std=False`` gives
    Dr.GRPO's :math:`A_i = s_i - \mathrm{mean}_g(s)` (Liu et al. 2025, https://arxiv.org/abs/2503.20783).
    :math:`\epsilon` is added to the std (not a floor), as in verl; a group whose scores are all equal
    gets advantage 0.

    Matches verl 0.9.1 ``compute_grpo_outcome_advantage`` and ``..._vectorized`` (``scores`` =
    ``token_level_rewards.sum(-1)``, ``index`` = ``group_ids``). A group of one (``singletons=
    "no_baseline"``, the default) gets mean 0 and std 1, i.e. :math:`A = s / (1 + \epsilon)`, as verl;
    ``"zero"`` gives it 0, ``"error"`` raises.

    Args:
        scores: ``(b,)`` float, one outcome score per response.
        group_ids: ``(b,)`` integer, equal ids for responses to the same prompt (any integers).
        response_mask: ``(b, t)`` bool.

    Returns:
        ``(advantages, returns)``, ``(b, t)`` each, equal values, 0 outside the mask.
    """
    _check_outcome_inputs(scores, group_ids, response_mask)
    s = _work(scores)
    groups = _group_stats(s, group_ids)
    _check_singletons(singletons, groups, group_ids, "grpo")
    centered = s - _baseline_for(groups, groups.mean)
    if norm_by_std:
        std = torch.where(groups.singleton, torch.ones_like(s), groups.var.sqrt())
        centered = centered / (std + eps)
    return _finish(centered, groups, singletons, response_mask)


def grpo_passk(
    scores: Tensor,
    *,
    group_ids: Tensor,
    response_mask: Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    r"""Pass@k advantage in GRPO form (Chen et al. 2025, https://arxiv.org/abs/2503.19595).

    Only the best response of each group is credited, with the margin over the runner-up:

    .. math:: A_{i^*} = \frac{s_{(1)} - s_{(2)}}{\mathrm{std}_g(s) + \epsilon}, \qquad A_i = 0 \ (i \ne i^*)

    where :math:`s_{(1)} \ge s_{(2)}` are the two largest scores of the group and :math:`i^*` attains
    the maximum (the first such index; on a tie the margin is 0, so which one is irrelevant).
    ``norm_by_std=False`` drops the division. Matches verl 0.9.1
    ``compute_grpo_passk_outcome_advantage`` (which reads the flag from its config).

    Every group needs at least 2 responses (ValueError otherwise, as verl; under ``torch.func``
    transforms the check is skipped and a group of one gets 0).
    """
    _check_outcome_inputs(scores, group_ids, response_mask)
    s = _work(scores)
    groups = _group_stats(s, group_ids)
    if not is_transformed(groups.count) and bool(groups.singleton.any()):
        raise ValueError(
            "grpo_passk needs at least 2 responses per group; group_ids has a group of one "
            f"({_first_singleton(groups, group_ids)})"
        )
    b = s.shape[0]
    neg_inf = torch.full_like(s, float("-inf"))
    group_max = torch.gather(neg_inf.scatter_reduce(0, groups.index, s, "amax", include_self=True), 0, groups.index)
    positions = torch.arange(b, device=s.device)
    candidates = torch.where(s == group_max, positions, torch.full_like(positions, b))
    first_max = torch.full_like(positions, b).scatter_reduce(0, groups.index, candidates, "amin", include_self=True)
    is_best = positions == torch.gather(first_max, 0, groups.index)
    others = torch.where(is_best, neg_inf, s)
    runner_up_g = neg_inf.scatter_reduce(0, groups.index, others, "amax", include_self=True)
    runner_up = torch.gather(runner_up_g, 0, groups.index)
    margin = torch.where(groups.singleton, torch.zeros_like(s), group_max - runner_up)
    if norm_by_std:
        margin = margin / (groups.var.sqrt() + eps)
    per_seq = torch.where(is_best, margin, torch.zeros_like(s))
    return _finish(per_seq, None, "no_baseline", response_mask)


def rloo(
    scores: Tensor,
    *,
    group_ids: Tensor,
    response_mask: Tensor,
    singletons: Singletons = "no_baseline",
) -> tuple[Tensor, Tensor]:
    r"""REINFORCE Leave-One-Out (Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740).

    The baseline of each response is the mean score of the *other* responses of its group:

    .. math:: A_i = s_i - \frac{1}{n_g - 1}\sum_{j \in g, j \ne i} s_j = \frac{n_g}{n_g - 1}\,(s_i - \mathrm{mean}_g(s))

    Matches verl 0.9.1 ``compute_rloo_outcome_advantage``. A group of one has no other response: by
    default (``"no_baseline"``) its advantage is its score, as verl's ``rloo``; ``singletons="zero"``
    gives 0, as verl's ``rloo_vectorized``; ``"error"`` raises.
    """
    _check_outcome_inputs(scores, group_ids, response_mask)
    s = _work(scores)
    groups = _group_stats(s, group_ids)
    _check_singletons(singletons, groups, group_ids, "rloo")
    loo = (groups.count * s - groups.total) / (groups.count - 1).clamp(min=1)
    per_seq = torch.where(groups.singleton, s, loo)
    return _finish(per_seq, groups, singletons, response_mask)


def reinforce_pp_baseline(
    scores: Tensor,
    *,
    group_ids: Tensor,
    response_mask: Tensor,
    singletons: Singletons = "no_baseline",
) -> tuple[Tensor, Tensor]:
    r"""REINFORCE++-baseline (Hu 2025, https://arxiv.org/abs/2501.03262): group-mean baseline.

    .. math:: A_i = s_i - \mathrm{mean}_g(s)

    broadcast over the response tokens. The algorithm then whitens over the whole batch; do that with
    ``rlfunc.masked_whiten(advantages, response_mask)``, which gives verl 0.9.1's
    ``compute_reinforce_plus_plus_baseline_outcome_advantage`` (verl whitens inside the estimator and
    returns the whitened tensor as returns too; here returns are the unwhitened advantages).
    A group of one has baseline 0 by default (verl).
    """
    _check_outcome_inputs(scores, group_ids, response_mask)
    s = _work(scores)
    groups = _group_stats(s, group_ids)
    _check_singletons(singletons, groups, group_ids, "reinforce_pp_baseline")
    return _finish(s - _baseline_for(groups, groups.mean), groups, singletons, response_mask)


def opo(
    scores: Tensor,
    *,
    group_ids: Tensor,
    response_mask: Tensor,
    singletons: Singletons = "no_baseline",
) -> tuple[Tensor, Tensor]:
    r"""On-Policy RL with Optimal reward baseline (Hao et al. 2025, https://arxiv.org/abs/2505.23585).

    The baseline is the length-weighted mean score of the group, the variance-minimising baseline
    when the gradient norm grows with the response length :math:`\ell_j` (number of mask tokens):

    .. math:: A_i = s_i - \frac{\sum_{j \in g} \ell_j s_j}{\sum_{j \in g} \ell_j}

    Matches verl 0.9.1 ``compute_opo_outcome_advantage``. A group of one has baseline 0 by default
    (verl); a group whose responses are all empty has baseline 0 (verl: 0/0 = NaN, but those
    responses have no tokens to carry it).
    """
    _check_outcome_inputs(scores, group_ids, response_mask)
    s = _work(scores)
    groups = _group_stats(s, group_ids)
    _check_singletons(singletons, groups, group_ids, "opo")
    lengths = response_mask.sum(dim=-1).to(s.dtype)
    weighted = _per_sample(_segment_sum(lengths * s, groups.index), groups.index)
    total_len = _per_sample(_segment_sum(lengths, groups.index), groups.index)
    baseline = torch.where(total_len > 0, weighted / total_len.clamp(min=1), torch.zeros_like(s))
    return _finish(s - _baseline_for(groups, baseline), groups, singletons, response_mask)


def gpg(
    scores: Tensor,
    *,
    group_ids: Tensor,
    response_mask: Tensor,
    f_norm: float = 1.0,
    singletons: Singletons = "no_baseline",
) -> tuple[Tensor, Tensor]:
    r"""Group Policy Gradient advantage (Chu et al. 2025, https://arxiv.org/abs/2504.02546).

    .. math::
        A_i = \alpha\,\frac{s_i - \mathrm{mean}_g(s)}{F_{norm}}, \qquad
        \alpha = \frac{B}{\max(1, \#\{j : s_j \ne 0\})}

    where :math:`B` is the batch size and :math:`\alpha` corrects for the share of responses with a
    non-zero score (GPG's gradient-estimation bias correction; counted over this call's batch).
    Matches verl 0.9.1 ``compute_gpg_outcome_advantage`` (no std normalisation there either).
    A group of one has baseline 0 by default (verl).
    """
    _check_outcome_inputs(scores, group_ids, response_mask)
    s = _work(scores)
    groups = _group_stats(s, group_ids)
    _check_singletons(singletons, groups, group_ids, "gpg")
    alpha = s.shape[0] / (s != 0).sum().clamp(min=1).to(s.dtype)
    per_seq = alpha * (s - _baseline_for(groups, groups.mean)) / f_norm
    return _finish(per_seq, groups, singletons, response_mask)


def remax(scores: Tensor, *, baseline_scores: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    r"""ReMax (Li et al. 2023, https://arxiv.org/abs/2310.10505): the greedy response as baseline.

    .. math:: A_i = s_i - s^{greedy}_i, \qquad R_i = s_i

    broadcast over the response tokens, with :math:`s^{greedy}_i` the score of the greedy
    (argmax-decoded) response to the same prompt. Returns ``(advantages, returns)``; unlike the other
    outcome estimators the returns are the scores themselves (verl: the reward-to-go).

    Matches verl 0.9.1 ``compute_remax_outcome_advantage`` on the mask when the outcome reward sits on a
    response token (verl sums token rewards from the end; outside the mask it leaves cumulative
    values, here 0). Token-level rewards (e.g. KL-in-reward) are not an outcome: use
    ``reinforce_pp(rewards, response_mask=mask, gamma=1.0)`` minus the baseline for that.
    """
    _check_outcome_inputs(scores, None, response_mask)
    bind({"scores": (scores, "b"), "baseline_scores": (baseline_scores, "b")})
    check_floating("baseline_scores", baseline_scores)
    check_finite_fast("baseline_scores", baseline_scores)
    s = _work(scores)
    keep = response_mask.view(torch.uint8)  # finite scores: a 0/1 multiply masks exactly
    returns = s.unsqueeze(-1) * keep
    advantages = (s - baseline_scores.to(s.dtype)).unsqueeze(-1) * keep
    return advantages, returns

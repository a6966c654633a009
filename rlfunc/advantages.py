r"""Advantage estimators: pure functions returning ``(advantages, returns)``.

Two families share one contract:

- token-level estimators (:func:`gae`, :func:`reinforce_pp`) take per-token rewards ``(b, t)``;
- outcome estimators (:func:`grpo`, :func:`grpo_passk`, :func:`rloo`, :func:`reinforce_pp_baseline`,
  :func:`opo`, :func:`gpg`, :func:`remax`) take one score per sequence ``(b,)`` and, except ReMax, integer
  ``group_ids`` ``(b,)`` naming the prompt each response answers. Ids are arbitrary integers (not
  necessarily contiguous, sorted, small or non-negative; verl's vectorised estimators allocate
  ``max(id) + 1`` slots and fail on negative ids); groups are found with a sort and segment sums, with
  no numpy, no Python loop over sequences and no host sync beyond the input checks.

Every estimator returns two distinct tensors ``(advantages, returns)`` of shape ``(b, t)``, 0 outside
``response_mask``. None of them whitens: whitening is :func:`rlfunc.masked.masked_whiten`, applied by
the caller where the algorithm wants it (verl whitens inside GAE, REINFORCE++ and REINFORCE++-baseline;
``masked_whiten(ours, mask)`` gives verl's numbers on the mask).

Where verl 0.9.1 computes the same quantity the numbers agree in fp32 to 1e-5 on the response mask.
Differences, all deliberate:

- outside ``response_mask`` every output is 0 (verl's GAE and ReMax leave carried or cumulative values
  at masked positions, which no loss reads);
- a group with a single response has no baseline. By default (``singletons="no_baseline"``) its
  baseline is 0 and its std 1, as in verl's loop implementations; ``"zero"`` gives such a response a
  0 advantage instead (verl's ``rloo_vectorized``) and ``"error"`` raises;
- outputs are computed and returned in at least float32 (bf16 scores are promoted);
- ``returns`` of outcome estimators equal the advantages (verl's convention: no critic reads them),
  but are a separate tensor, so writing into one never changes the other (verl returns one tensor
  twice); ReMax's returns are the scores;
- token-level estimators are differentiable and work under ``torch.func`` (verl runs under no_grad).

The input checks synchronise with the host (finite-ness, and for GAE / REINFORCE++ whether the mask has
holes, which picks the fast path); under ``torch.func`` transforms they are skipped and the general path
is taken.

Bad inputs raise with the argument named: shapes (via :mod:`rlfunc.checks`), a non-bool mask, float
group ids, NaN/inf rewards or scores (skipped under ``torch.func`` transforms), discounts outside
[0, 1], unknown estimator names.
"""

from __future__ import annotations

import types
from typing import Callable, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from rlfunc.checks import bind, check_finite, check_floating, check_mask, check_same_shape, is_transformed

__all__ = [
    "gae",
    "reinforce_pp",
    "grpo",
    "grpo_passk",
    "rloo",
    "reinforce_pp_baseline",
    "opo",
    "gpg",
    "remax",
    "discounted_reverse_cumsum",
    "zero_advantage_rows",
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_ESTIMATOR_ALIASES",
    "get_advantage_estimator",
]

Singletons = Literal["no_baseline", "zero", "error"]
_SINGLETON_MODES = ("no_baseline", "zero", "error")

# Block length of the blocked scan. 32 was fastest on CPU at t = 512 and 2048 (matmuls of (.., 32) x
# (32, 32) are cheap; the carry between blocks is the same scan, one level up, over t / 32 block heads).
_BLOCK = 32


# ----------------------------------------------------------------------------------------------------
# The scan: y_t = x_t + c * y_{t+1}, y_T = 0, over the last axis
# ----------------------------------------------------------------------------------------------------


def _fp32_matmul_is_exact(device: torch.device) -> bool:
    """False when fp32 matmuls may run in TF32 / bf16 (``set_float32_matmul_precision`` and friends)."""
    try:
        if torch.get_float32_matmul_precision() != "highest":
            return False
        backend = {"cuda": torch.backends.cuda, "cpu": torch.backends.mkldnn}.get(device.type)
        precision = getattr(getattr(backend, "matmul", None), "fp32_precision", "none")
        return precision in ("none", "ieee")
    except (RuntimeError, AttributeError):  # mixed legacy/new precision APIs: assume the worst
        return False


def _scan_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    work = torch.promote_types(dtype, torch.float32)
    if work == torch.float32 and not _fp32_matmul_is_exact(device):
        work = torch.float64
    return work


def _discount_matrix(n: int, discount: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``M[j, i] = c^(j - i)`` for ``j >= i``, else 0, so that ``(x @ M)_i = sum_{j>=i} c^(j-i) x_j``.

    Powers are taken in float64 and those below the smallest normal float32 are flushed to 0 (the
    true terms are negligible, and subnormals make CPU matmuls slow).
    """
    i = torch.arange(n, dtype=torch.float64, device=device)
    lag = i[:, None] - i[None, :]
    powers = torch.tensor(discount, dtype=torch.float64, device=device) ** lag.clamp(min=0)
    keep = (lag >= 0) & (powers >= torch.finfo(torch.float32).tiny)
    return torch.where(keep, powers, torch.zeros((), dtype=torch.float64, device=device)).to(dtype)


def _scan(x: Tensor, discount: float, *, owned: bool = False) -> Tensor:
    """The blocked scan. ``owned=True`` lets it write into ``x`` (a temporary of the caller's)."""
    b, t = x.shape
    if t <= _BLOCK:
        return x @ _discount_matrix(t, discount, x.dtype, x.device)
    nb = -(-t // _BLOCK)
    if nb * _BLOCK != t:
        x = F.pad(x, (0, nb * _BLOCK - t))  # zeros at the end add nothing to a reverse sum; a new tensor
    elif not owned:
        x = x.clone()
    blocks = x.reshape(b, nb, _BLOCK)
    matrix = _discount_matrix(_BLOCK, discount, x.dtype, x.device)
    # y at the start of block k: Y_k = h_k + c^B Y_{k+1}, with h_k = sum_i c^i x_{k,i} the block's own
    # part: the same scan one level up, over t / B block heads.
    heads = _scan(blocks @ matrix[:, 0], discount**_BLOCK, owned=True)
    # Adding c * Y_{k+1} to the last entry of block k makes the within-block matmul produce the full
    # y_{k,i} = local_{k,i} + c^(B-i) Y_{k+1}: one matmul, no separate carry pass.
    blocks[:, :-1, -1] += discount * heads[:, 1:]
    y = (blocks @ matrix).reshape(b, nb * _BLOCK)
    return y if nb * _BLOCK == t else y[:, :t]


def discounted_reverse_cumsum(x: Tensor, discount: float) -> Tensor:
    r"""Discounted reward-to-go along the last axis: :math:`y_t = \sum_{s \ge t} c^{s-t} x_s`.

    Equivalently the reverse recursion :math:`y_t = x_t + c\,y_{t+1}`, :math:`y_T = 0`, computed without a
    Python loop over time: the time axis is cut into blocks of 32 steps, each block is solved by a
    matmul with the triangular matrix :math:`M_{ji} = c^{j-i}` and the block results are chained by
    the same scan over the block heads (with discount :math:`c^{32}`), recursively. Every power has a
    non-negative exponent, so nothing overflows for any ``t`` (unlike the closed form
    :math:`c^{-t}\,\mathrm{revcumsum}(c^t x_t)`), and the error is that of an fp32 sum of the same
    terms, typically smaller than the sequential loop's.

    Computed in at least float32; in float64 when fp32 matmuls are allowed to use TF32 / bf16
    (``torch.set_float32_matmul_precision``), so that setting cannot degrade the result.
    ``x`` is ``(b, t)``; returns ``(b, t)`` in the working dtype.
    """
    check_floating("x", x)
    bind({"x": (x, "b t")})
    discount = float(discount)
    work = _scan_dtype(x.dtype, x.device)
    out = _scan(x.to(work), discount)
    return out.to(torch.promote_types(x.dtype, torch.float32))


# ----------------------------------------------------------------------------------------------------
# Masked positions: compress each row's valid positions to the front, scan, scatter back
# ----------------------------------------------------------------------------------------------------


def _compress(x: Tensor, mask: Tensor, position: Tensor) -> Tensor:
    """Move ``x[i, t]`` for valid ``t`` to column ``position[i, t]`` (its rank among the valid ones).

    Invalid positions go to an extra dump column that is dropped; the valid ones fill columns
    ``0 .. n_i - 1`` in order and the rest of the row is 0.
    """
    b, t = x.shape
    src = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    index = torch.where(mask, position, torch.full_like(position, t))
    buf = torch.zeros(b, t + 1, dtype=x.dtype, device=x.device)
    return buf.scatter(1, index, src)[:, :t]


def _expand(y: Tensor, mask: Tensor, position: Tensor) -> Tensor:
    """Inverse of :func:`_compress`: back to the original columns, 0 outside ``mask``."""
    gathered = torch.gather(y, 1, position.clamp(min=0))
    return torch.where(mask, gathered, torch.zeros((), dtype=y.dtype, device=y.device))


def _check_finite_fast(name: str, x: Tensor, where: Tensor | None = None) -> bool:
    """:func:`rlfunc.checks.check_finite`, after a one-pass screen: a finite sum proves every entry finite.

    Only when the sum is not finite (a NaN/inf somewhere, possibly outside ``where``, or an overflow)
    does the exact, masked check run. Skipped under ``torch.func`` transforms, as ``check_finite``.
    Returns whether every entry of ``x`` (inside the mask or not) is known to be finite, in which case
    masking may multiply by 0 instead of selecting.
    """
    if is_transformed(x) or (where is not None and is_transformed(where)):
        return False
    if bool(torch.isfinite(x.sum())):
        return True
    check_finite(name, x, where=where)
    return False


def _keep(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """The bool mask as 0/1 of ``dtype``. Through a uint8 view: bool kernels are several times slower on CPU."""
    return mask.view(torch.uint8).to(dtype)


def _has_holes(mask: Tensor) -> bool:
    """Whether some row's valid positions are not one contiguous run (multi-turn observation tokens).

    Rows with one run (right and/or left padding) need no compression: masked positions after the run
    contribute nothing to a reverse scan and those before it are zeroed on output. Always True under
    ``torch.func`` transforms, where a data-dependent branch is not allowed (the general path is exact
    for every mask).
    """
    if is_transformed(mask):
        return True
    if mask.shape[1] < 2:
        return False
    # int32 sums: summing a bool tensor would first copy it to int64.
    run_starts = (mask[:, 1:] > mask[:, :-1]).sum(dim=1, dtype=torch.int32) + mask[:, 0]
    return bool((run_starts > 1).any())


def _check_discount(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {value}")
    return value


def _check_token_inputs(token_rewards: Tensor, response_mask: Tensor, values: Tensor | None = None) -> bool:
    """Shapes, dtypes and finite-ness; returns whether all entries are finite (see _check_finite_fast)."""
    specs = {"token_rewards": (token_rewards, "b t"), "response_mask": (response_mask, "b t")}
    if values is not None:
        specs["values"] = (values, "b t")
    bind(specs)
    check_mask("response_mask", response_mask)
    check_floating("token_rewards", token_rewards)
    if values is not None:
        check_floating("values", values)
    finite = _check_finite_fast("token_rewards", token_rewards, where=response_mask)
    if values is not None:
        finite = _check_finite_fast("values", values, where=response_mask) and finite
    return finite


def gae(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    r"""Generalized Advantage Estimation (Schulman et al. 2015, https://arxiv.org/abs/1506.02438).

    Over the valid (``response_mask``) positions :math:`t_1 < \dots < t_n` of each row:

    .. math::
        \delta_k = r_{t_k} + \gamma V_{t_{k+1}} - V_{t_k}, \qquad V_{t_{n+1}} = 0,

        A_{t_k} = \sum_{j \ge k} (\gamma\lambda)^{j-k} \delta_j, \qquad R_{t_k} = A_{t_k} + V_{t_k}.

    Masked positions are skipped, not treated as zero-reward steps: the bootstrap value and the
    running advantage are carried across them (observation tokens in a multi-turn response), as in
    verl 0.9.1's ``compute_gae_advantage_return``. Rewards and values at masked positions are ignored,
    even NaN.

    Computed with :func:`discounted_reverse_cumsum` (blocked matmul scan), no Python loop over time:
    about 15-25x faster than verl's loop on one CPU thread at (256, 512) and (1024, 2048)
    (``benchmarks/bench_core_vs_verl.py``), same numbers to fp32 rounding. Masks whose valid positions
    form one run per row (left and/or right padding) take a fast path; masks with holes are compressed
    first (valid positions moved to the front of each row, scanned, moved back).

    Differences from verl: no whitening (verl returns ``masked_whiten(A)``; apply
    :func:`rlfunc.masked.masked_whiten` for that), advantages and returns are 0 outside the mask (verl
    leaves the carried values there), and the function is differentiable (verl runs under no_grad).

    Args:
        token_rewards: ``(b, t)`` float, per-token rewards (outcome score on the last token, KL
            penalty, ...).
        values: ``(b, t)`` float, critic values :math:`V_t`.
        response_mask: ``(b, t)`` bool, the positions the policy generated.
        gamma: discount :math:`\gamma \in [0, 1]`.
        lam: GAE :math:`\lambda \in [0, 1]`.

    Returns:
        ``(advantages, returns)``, each ``(b, t)``, 0 outside the mask.
    """
    all_finite = _check_token_inputs(token_rewards, response_mask, values)
    gamma = _check_discount("gamma", gamma)
    lam = _check_discount("lam", lam)
    work = _scan_dtype(torch.promote_types(token_rewards.dtype, values.dtype), token_rewards.device)
    out_dtype = torch.promote_types(torch.promote_types(token_rewards.dtype, values.dtype), torch.float32)

    zero = torch.zeros((), dtype=work, device=token_rewards.device)
    rewards, values = token_rewards.to(work), values.to(work)
    discount = gamma * lam

    if _has_holes(response_mask):
        position = torch.cumsum(response_mask, dim=1) - 1
        rewards_c = _compress(rewards, response_mask, position)
        values_c = _compress(values, response_mask, position)
        next_values_c = F.pad(values_c[:, 1:], (0, 1))  # 0 after the last valid position
        deltas_c = rewards_c + gamma * next_values_c - values_c  # 0 beyond the row's valid count
        advantages_c = _scan(deltas_c, discount, owned=True)
        advantages = _expand(advantages_c, response_mask, position)
        returns = _expand(advantages_c + values_c, response_mask, position)
    else:
        # One run of valid positions per row: zero everything outside it and scan in place. The value
        # after the run's last token reads as 0; positions before the run are zeroed on output.
        # In-place ops only touch temporaries made here.
        if all_finite:  # multiplying by 0/1 is safe (and faster than selecting)
            keep = _keep(response_mask, work)
            values_z = values * keep
            deltas = (rewards - values).mul_(keep)
        else:  # NaN/inf outside the mask: select
            values_z = torch.where(response_mask, values, zero)
            deltas = torch.where(response_mask, rewards - values_z, zero)
        deltas[:, :-1].add_(values_z[:, 1:], alpha=gamma)  # + gamma * V_{t+1}, no copy for the shift
        scanned = _scan(deltas, discount, owned=True)
        advantages = scanned.mul_(keep) if all_finite else torch.where(response_mask, scanned, zero)
        returns = advantages + values_z
    return advantages.to(out_dtype), returns.to(out_dtype)


def reinforce_pp(token_rewards: Tensor, response_mask: Tensor, *, gamma: float) -> tuple[Tensor, Tensor]:
    r"""REINFORCE++ (Hu 2025, https://arxiv.org/abs/2501.03262): discounted reward-to-go per token.

    .. math:: G_{t_k} = \sum_{j \ge k} \gamma^{j-k} r_{t_j}

    over the valid positions :math:`t_1 < \dots < t_n` of each row (masked positions are skipped and
    their rewards ignored, as in verl 0.9.1's ``compute_reinforce_plus_plus_outcome_advantage``).

    Returns ``(advantages, returns)`` with both equal to :math:`G` on the mask and 0 outside it.
    REINFORCE++ then whitens the advantages over the whole batch; that step is
    ``rlfunc.masked_whiten(advantages, response_mask)``, which reproduces verl's advantages (verl
    whitens inside the estimator). Same blocked scan as :func:`gae`, no loop over time.

    Args:
        token_rewards: ``(b, t)`` float.
        response_mask: ``(b, t)`` bool.
        gamma: discount in [0, 1].
    """
    all_finite = _check_token_inputs(token_rewards, response_mask)
    gamma = _check_discount("gamma", gamma)
    work = _scan_dtype(token_rewards.dtype, token_rewards.device)
    out_dtype = torch.promote_types(token_rewards.dtype, torch.float32)
    rewards = token_rewards.to(work)
    zero = torch.zeros((), dtype=work, device=rewards.device)
    if _has_holes(response_mask):
        position = torch.cumsum(response_mask, dim=1) - 1
        compressed = _compress(rewards, response_mask, position)
        returns = _expand(_scan(compressed, gamma, owned=True), response_mask, position)
    elif all_finite:
        keep = _keep(response_mask, work)
        returns = _scan(rewards * keep, gamma, owned=True).mul_(keep)
    else:
        masked = torch.where(response_mask, rewards, zero)
        returns = torch.where(response_mask, _scan(masked, gamma, owned=True), zero)
    returns = returns.to(out_dtype)
    return returns.clone(), returns


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
    _check_finite_fast("scores", scores)
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
    keep = _keep(response_mask, per_seq.dtype)
    advantages = keep * per_seq.unsqueeze(-1)
    if is_transformed(per_seq) or is_transformed(keep) or (per_seq.requires_grad and torch.is_grad_enabled()):
        return advantages, keep * per_seq.unsqueeze(-1)
    return advantages, keep.mul_(per_seq.unsqueeze(-1))  # reuse our own temporary for the second output


def _work(scores: Tensor) -> Tensor:
    return scores.to(torch.promote_types(scores.dtype, torch.float32))


def grpo(
    scores: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    *,
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
    group_ids: Tensor,
    response_mask: Tensor,
    *,
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
    group_ids: Tensor,
    response_mask: Tensor,
    *,
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
    group_ids: Tensor,
    response_mask: Tensor,
    *,
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
    group_ids: Tensor,
    response_mask: Tensor,
    *,
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
    group_ids: Tensor,
    response_mask: Tensor,
    *,
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


def remax(scores: Tensor, baseline_scores: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    r"""ReMax (Li et al. 2023, https://arxiv.org/abs/2310.10505): the greedy response as baseline.

    .. math:: A_i = s_i - s^{greedy}_i, \qquad R_i = s_i

    broadcast over the response tokens, with :math:`s^{greedy}_i` the score of the greedy
    (argmax-decoded) response to the same prompt. Returns ``(advantages, returns)``; unlike the other
    outcome estimators the returns are the scores themselves (verl: the reward-to-go).

    Matches verl 0.9.1 ``compute_remax_outcome_advantage`` on the mask when the outcome reward sits on a
    response token (verl sums token rewards from the end; outside the mask it leaves cumulative
    values, here 0). Token-level rewards (e.g. KL-in-reward) are not an outcome: use
    ``reinforce_pp(rewards, mask, gamma=1.0)`` minus the baseline for that.
    """
    _check_outcome_inputs(scores, None, response_mask)
    bind({"scores": (scores, "b"), "baseline_scores": (baseline_scores, "b")})
    check_floating("baseline_scores", baseline_scores)
    _check_finite_fast("baseline_scores", baseline_scores)
    s = _work(scores)
    keep = response_mask.view(torch.uint8)  # finite scores: a 0/1 multiply masks exactly
    returns = s.unsqueeze(-1) * keep
    advantages = (s - baseline_scores.to(s.dtype)).unsqueeze(-1) * keep
    return advantages, returns


# ----------------------------------------------------------------------------------------------------
# Names
# ----------------------------------------------------------------------------------------------------

ADVANTAGE_ESTIMATORS: types.MappingProxyType[str, Callable[..., tuple[Tensor, Tensor]]] = types.MappingProxyType(
    {
        "gae": gae,
        "grpo": grpo,
        "grpo_passk": grpo_passk,
        "rloo": rloo,
        "reinforce_pp": reinforce_pp,
        "reinforce_pp_baseline": reinforce_pp_baseline,
        "remax": remax,
        "opo": opo,
        "gpg": gpg,
    }
)
"""Canonical name -> estimator. Read-only. Signatures differ by family (token-level vs outcome)."""

ADVANTAGE_ESTIMATOR_ALIASES: types.MappingProxyType[str, str] = types.MappingProxyType(
    {
        "reinforce_plus_plus": "reinforce_pp",
        "reinforce_plus_plus_baseline": "reinforce_pp_baseline",
        "grpo_vectorized": "grpo",
        "rloo_vectorized": "rloo",
    }
)
"""verl's names that differ from ours -> our name. ``rloo_vectorized`` maps to :func:`rloo`; verl's
vectorised RLOO gives a group of one 0, which is ``rloo(..., singletons="zero")``. Dr.GRPO is
``grpo(..., norm_by_std=False)``."""


def get_advantage_estimator(name: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """The estimator called ``name`` (ours or verl's spelling); ValueError listing the known names."""
    try:
        return ADVANTAGE_ESTIMATORS[ADVANTAGE_ESTIMATOR_ALIASES.get(name, name)]
    except (KeyError, TypeError):
        known = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        aliases = ", ".join(f"{a} -> {c}" for a, c in sorted(ADVANTAGE_ESTIMATOR_ALIASES.items()))
        raise ValueError(f"unknown advantage estimator {name!r}; known: {known} (verl aliases: {aliases})") from None


def zero_advantage_rows(advantages: Tensor, mask: Tensor) -> Tensor:
    """``(b,)`` bool: rows whose advantage is exactly 0 on every loss token (or that have none).

    Under a policy loss that is a multiple of the advantage per token (PPO clip, dual clip, GSPO,
    CISPO, ...) with no KL or entropy term, such a row adds exactly 0 to the loss and its gradient:
    in GRPO, every group whose samples all got the same reward. An engine may skip them
    (``backends.training.fsdp.update(skip_rows=...)``) while they still count in the normalisers.
    """
    check_mask("mask", mask)
    check_same_shape("mask", mask, advantages=advantages)
    return ~((advantages != 0) & mask).any(dim=-1)

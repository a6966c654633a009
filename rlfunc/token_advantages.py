r"""Token-level advantage estimators: GAE and REINFORCE++ over per-token rewards ``(b, t)``.

Both are reverse discounted scans along the response, computed by :func:`discounted_reverse_cumsum` (a
blocked matmul scan, no Python loop over time). Masked positions are skipped, not treated as zero-reward
steps: the running sums are carried across them (observation tokens in a multi-turn response), as in
verl 0.9.1. Both return two distinct tensors ``(advantages, returns)`` of shape ``(b, t)``, 0 outside
``response_mask``, in at least float32; both are differentiable and work under ``torch.func`` (verl runs
under no_grad). Neither whitens: apply :func:`rlfunc.masked.masked_whiten` where the algorithm wants it
(verl whitens inside GAE and REINFORCE++; ``masked_whiten(ours, mask)`` gives verl's numbers on the mask).

The input checks synchronise with the host (finite-ness, and whether the mask has holes, which picks
the fast path); under ``torch.func`` transforms they are skipped and the general path is taken. Bad
inputs raise with the argument named: shapes, a non-bool mask, NaN/inf rewards or values on the mask,
discounts outside [0, 1].

Every argument after the first tensor is keyword-only: verl's positional orders differ from ours, and a
positional port would silently compute something else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlfunc.checks import bind, check_finite_fast, check_floating, check_mask, is_transformed
from rlfunc.masked import mask_weights

__all__ = ["gae", "reinforce_pp", "discounted_reverse_cumsum"]

# Block length of the blocked scan: small enough that the (B, B) triangular matmul wastes little work
# on its zero half, large enough that the carry between blocks (the same scan one level up, over
# t / B block heads) stays short.
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


def discounted_reverse_cumsum(x: Tensor, *, discount: float) -> Tensor:
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
    """Shapes, dtypes and finite-ness; returns whether all entries are finite (see check_finite_fast)."""
    specs = {"token_rewards": (token_rewards, "b t"), "response_mask": (response_mask, "b t")}
    if values is not None:
        specs["values"] = (values, "b t")
    bind(specs)
    check_mask("response_mask", response_mask)
    check_floating("token_rewards", token_rewards)
    if values is not None:
        check_floating("values", values)
    finite = check_finite_fast("token_rewards", token_rewards, where=response_mask)
    if values is not None:
        finite = check_finite_fast("values", values, where=response_mask) and finite
    return finite


def gae(
    token_rewards: Tensor,
    *,
    values: Tensor,
    response_mask: Tensor,
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

    Computed with :func:`discounted_reverse_cumsum` (blocked matmul scan), no Python loop over time
    (``benchmarks/bench_core_vs_verl.py`` compares it with verl's loop), same numbers to fp32
    rounding. Masks whose valid positions
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
            keep = mask_weights(response_mask, work)
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


def reinforce_pp(token_rewards: Tensor, *, response_mask: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
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
        keep = mask_weights(response_mask, work)
        returns = _scan(rewards * keep, gamma, owned=True).mul_(keep)
    else:
        masked = torch.where(response_mask, rewards, zero)
        returns = torch.where(response_mask, _scan(masked, gamma, owned=True), zero)
    returns = returns.to(out_dtype)
    return returns.clone(), returns

"""Start-up checks of the algorithm pieces a recipe's config names: each is called once on a small synthetic batch,
as the loop will call it, before any model is built, so that a wrong signature or result fails in a second with an
error naming the config key and the function, not at step 1 after the model, the data and the SFT stage.

The calls (a function of your own is named by reference, ``algo.estimator=my_pkg.advantages:centered``):

- an advantage estimator: ``fn(scores, *, group_ids, response_mask, **kwargs) -> (advantages, returns)``; ``scores``
  ``(b,)`` float, ``group_ids`` ``(b,)`` int (the samples of one prompt share an id), ``response_mask`` ``(b t)``
  bool; ``advantages`` and ``returns`` are ``(b t)`` float tensors;
- a policy loss: ``fn(logprobs, *, old_logprobs, advantages, response_mask, clip_low, clip_high, agg, norms, horizon,
  is_weights, **kwargs) -> (loss, metrics)``; ``logprobs`` ``(b t)`` (with gradients), ``norms`` the global
  :class:`rlfunc.Normalizers`, ``is_weights`` ``(b t)`` or None; ``loss`` a scalar tensor that carries the gradient,
  ``metrics`` a dict of names to numbers or scalar tensors. Declare ``logprobs_needed`` on the function when it
  needs more than the current and proximal log-probs.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable

import torch

import rlfunc as rf
from backends.config import ConfigError
from backends.training.common import ModelOutputs

__all__ = ["check_estimator", "check_policy_loss", "group_size_warnings", "synthetic_batch"]

ESTIMATOR_CALL = "fn(scores, *, group_ids, response_mask, **kwargs) -> (advantages, returns)"
LOSS_CALL = (
    "fn(logprobs, *, old_logprobs, advantages, response_mask, behaviour_logprobs, is_weights, agg, norms, "
    "horizon, seed, **its knobs) -> (loss, metrics)"
)


def synthetic_batch(groups: int = 2, group_size: int = 2, length: int = 3) -> rf.RolloutBatch:
    """``groups`` prompts of ``group_size`` samples with ``length`` response tokens (the last row's last token
    padding), the sampling log-probs and scores filled in: what the loop hands an estimator and a loss."""
    b = groups * group_size
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(b, length, dtype=torch.bool)
    mask[-1, -1] = False
    logprobs = -torch.rand(b, length, generator=g) - 0.1
    return rf.RolloutBatch(
        prompt_ids=torch.ones(b, 2, dtype=torch.long),
        prompt_mask=torch.ones(b, 2, dtype=torch.bool),
        response_ids=torch.ones(b, length, dtype=torch.long),
        response_mask=mask,
        group_ids=torch.arange(groups).repeat_interleave(group_size),
        scores=torch.arange(b, dtype=torch.float32) % 2,
        old_logprobs=logprobs,
        rollout_logprobs=logprobs,
    )


def _refuse(key: str, spec: str, call: str, problem: str, batch: str = "a small synthetic batch") -> ConfigError:
    return ConfigError(
        f"{key}={spec!r} does not fit the call the recipe makes, {call}: {problem} (checked at start-up on {batch})"
    )


def check_estimator(
    estimator: Callable[..., Any], kwargs: dict[str, Any], *, key: str, spec: str, group_size: int
) -> None:
    """Call ``estimator`` on a synthetic batch with groups of ``group_size`` (``rollout.n``) samples; a
    :class:`ConfigError` naming ``key`` and ``spec`` if the call fails or its result is not two ``(b t)`` tensors."""
    batch = synthetic_batch(group_size=group_size)
    groups = f"a synthetic batch of 2 groups of rollout.n={group_size} samples"
    try:
        result = estimator(batch.scores, group_ids=batch.group_ids, response_mask=batch.response_mask, **kwargs)
    except Exception as e:  # noqa: BLE001 - a user's function may raise anything: name it
        raise _refuse(key, spec, ESTIMATOR_CALL, f"the call raised {type(e).__name__}: {e}", groups) from e
    shape = tuple(batch.response_mask.shape)
    if not isinstance(result, tuple) or len(result) != 2:
        raise _refuse(key, spec, ESTIMATOR_CALL, f"it returned {type(result).__name__}, not (advantages, returns)")
    for name, value in zip(("advantages", "returns"), result):
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or not value.is_floating_point():
            got = (
                f"{value.dtype} of shape {tuple(value.shape)}"
                if isinstance(value, torch.Tensor)
                else type(value).__name__
            )
            raise _refuse(
                key, spec, ESTIMATOR_CALL, f"its {name} must be a float tensor of shape {shape} (b t), got {got}"
            )


def check_policy_loss(loss_fn: Callable[..., Any], *, key: str, spec: str) -> None:
    """Call the loop's loss (``loss_fn(outputs, micro_batch, norms)``, which calls the policy loss named by ``key``)
    on a synthetic micro-batch and differentiate it; a :class:`ConfigError` naming ``key`` and ``spec`` if the call
    fails, or its result is not ``(scalar loss with a gradient, dict of metrics)``."""
    batch = synthetic_batch()
    shape = batch.response_mask.shape
    batch = batch.replace(advantages=torch.linspace(-1.0, 1.0, batch.response_mask.numel()).reshape(shape))
    logprobs = (batch.old_logprobs + 0.01).requires_grad_(True)
    norms = rf.local_normalizers(rf.loss_tokens(batch))
    try:
        result = loss_fn(ModelOutputs(logprobs=logprobs, entropy=torch.ones_like(logprobs)), batch, norms)
    except Exception as e:  # noqa: BLE001 - a user's function may raise anything: name it
        raise _refuse(key, spec, LOSS_CALL, f"the call raised {type(e).__name__}: {e}") from e
    if not isinstance(result, tuple) or len(result) != 2:
        raise _refuse(key, spec, LOSS_CALL, f"it returned {type(result).__name__}, not (loss, metrics)")
    loss, metrics = result
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
        got = (
            f"a tensor of shape {tuple(loss.shape)}{'' if loss.requires_grad else ' without a gradient'}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise _refuse(
            key, spec, LOSS_CALL, f"its loss must be a scalar tensor that carries the gradient of logprobs, got {got}"
        )
    if not isinstance(metrics, dict) or not all(
        isinstance(v, numbers.Real) or (isinstance(v, torch.Tensor) and v.numel() == 1) for v in metrics.values()
    ):
        raise _refuse(key, spec, LOSS_CALL, f"its metrics must be a dict of names to numbers, got {str(metrics)[:120]}")
    loss.backward()
    if logprobs.grad is None:
        raise _refuse(key, spec, LOSS_CALL, "its loss does not depend on logprobs (no gradient reaches them)")


def group_size_warnings(group_size: int, *, key: str, spec: str) -> list[str]:
    """The warning for ``rollout.n=1`` under a group estimator: a group of one sample has no baseline (the built-ins
    then use the raw score as the advantage), which is rarely what a group-relative run means."""
    if group_size > 1:
        return []
    return [
        f"rollout.n=1 with the group estimator {key}={spec}: every group holds one sample, so there is no "
        "group baseline (the advantage is the raw score, or 0 where the estimator centres it); use rollout.n >= 2"
    ]

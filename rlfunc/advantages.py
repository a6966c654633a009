"""The advantage estimators by name, and the rows a zero advantage leaves out of a loss.

The estimators live in :mod:`rlfunc.token_advantages` (GAE, REINFORCE++: per-token rewards) and
:mod:`rlfunc.outcome_advantages` (GRPO and relatives: one score per response); both are re-exported
here, so ``from rlfunc.advantages import grpo`` keeps working.
"""

from __future__ import annotations

import types
from typing import Callable

from torch import Tensor

from rlfunc.checks import check_mask, check_same_shape
from rlfunc.outcome_advantages import gpg, grpo, grpo_passk, opo, reinforce_pp_baseline, remax, rloo
from rlfunc.signatures import with_defaults
from rlfunc.token_advantages import discounted_reverse_cumsum, gae, reinforce_pp

__all__ = [
    "gae",
    "reinforce_pp",
    "grpo",
    "grpo_passk",
    "rloo",
    "rloo_vectorized",
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

AdvantageEstimator = Callable[..., tuple[Tensor, Tensor]]

rloo_vectorized = with_defaults(
    rloo,
    "rloo_vectorized",
    """verl's ``rloo_vectorized``: :func:`rloo` with verl's singleton rule, a group of one gets advantage 0.

    verl's ``compute_rloo_vectorized_outcome_advantage`` (verl/trainer/ppo/core_algos.py) multiplies the
    leave-one-out advantage by ``(c > 1)`` (``c`` the group's size), where its loop version
    ``compute_rloo_outcome_advantage`` leaves a lone response its score; this is ``rloo(...,
    singletons="zero")``. Everything else is :func:`rloo`'s.
    """,
    singletons="zero",
)

ADVANTAGE_ESTIMATORS: types.MappingProxyType[str, AdvantageEstimator] = types.MappingProxyType(
    {
        "gae": gae,
        "grpo": grpo,
        "grpo_passk": grpo_passk,
        "rloo": rloo,
        "rloo_vectorized": rloo_vectorized,  # verl's name and singleton rule
        "reinforce_pp": reinforce_pp,
        "reinforce_pp_baseline": reinforce_pp_baseline,
        "remax": remax,
        "opo": opo,
        "gpg": gpg,
    }
)
"""The built-in estimators by canonical name: a read-only mapping (``types.MappingProxyType``).

Signatures differ by family: token-level ``fn(token_rewards, *, values=..., response_mask=..., ...)``,
outcome ``fn(scores, *, group_ids=..., response_mask=..., ...)``; every argument after the first tensor
is keyword-only.

Nothing registers into it: rlfunc holds no mutable global state. A user's own estimator is named in a
recipe config by reference (``package.module:function`` or ``path/to/file.py:function``) and resolved
outside rlfunc (``backends.config``); the names here are the built-ins only.
"""

ADVANTAGE_ESTIMATOR_ALIASES: types.MappingProxyType[str, str] = types.MappingProxyType(
    {
        "reinforce_plus_plus": "reinforce_pp",
        "reinforce_plus_plus_baseline": "reinforce_pp_baseline",
        "grpo_vectorized": "grpo",
    }
)
"""verl's names that differ from ours -> our name, where the two compute the same (read-only). verl's
``rloo_vectorized`` treats a group of one unlike its ``rloo`` and is an estimator of its own,
:data:`rloo_vectorized`. Dr.GRPO is ``grpo(..., norm_by_std=False)``."""


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The built-in estimator called ``name`` (ours or verl's spelling); ValueError listing the known names.

    Only :data:`ADVANTAGE_ESTIMATORS` is searched: a user's own estimator is resolved from its
    ``module:function`` reference outside rlfunc.
    """
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

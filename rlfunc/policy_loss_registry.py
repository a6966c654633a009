"""The built-in policy losses by name (:data:`POLICY_LOSSES`), the log-probs each needs, and the name lookup.

Every loss here takes the uniform call of :mod:`rlfunc.policy_losses` (and ``decoupled_ppo``, from
:mod:`rlfunc.offpolicy`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from rlfunc.offpolicy import decoupled_ppo_policy_loss
from rlfunc.policy_losses import (
    PolicyLossFn,
    cispo_policy_loss,
    clip_cov_policy_loss,
    gmpo_policy_loss,
    gpg_policy_loss,
    gspo_policy_loss,
    kl_cov_policy_loss,
    ppo_policy_loss,
    sapo_policy_loss,
    vanilla_policy_loss,
)

__all__ = [
    "POLICY_LOSSES",
    "LOGPROB_KINDS",
    "POLICY_LOSS_LOGPROBS",
    "check_logprobs_supplied",
    "ADVANTAGE_PROPORTIONAL_LOSSES",
    "get_policy_loss",
]

POLICY_LOSSES: Mapping[str, PolicyLossFn] = MappingProxyType(
    {
        "ppo": ppo_policy_loss,
        "vanilla": vanilla_policy_loss,  # verl's name and defaults
        "gspo": gspo_policy_loss,
        "sapo": sapo_policy_loss,
        "cispo": cispo_policy_loss,
        "gpg": gpg_policy_loss,
        "clip_cov": clip_cov_policy_loss,
        "kl_cov": kl_cov_policy_loss,
        "gmpo": gmpo_policy_loss,
        "geo_mean": gmpo_policy_loss,  # verl's name
        "decoupled_ppo": decoupled_ppo_policy_loss,  # AReaL's decoupled loss, rlfunc.offpolicy
    }
)
"""The built-in policy losses by name: a read-only mapping (``types.MappingProxyType``). verl's
``policy_loss.loss_mode`` names are keys too, with verl's defaults (``vanilla`` has dual clip on at 3.0;
``ppo`` is the same loss with it off). Every loss takes the uniform call of the module docstring.

Nothing registers into it: rlfunc holds no mutable global state. A user's own loss is named in a recipe
config by reference (``package.module:function`` or ``path/to/file.py:function``) and resolved outside
rlfunc (``backends.config``); the names here are the built-ins only.
"""

#: Policy losses whose per-token term is a multiple of the token's advantage, so a row whose
#: advantages are all 0 adds exactly 0 to the loss and the gradient (see ``zero_advantage_rows``).
#: Not clip_cov / kl_cov: they pick tokens by a covariance over the whole batch.
ADVANTAGE_PROPORTIONAL_LOSSES = frozenset("ppo vanilla gspo sapo cispo gpg gmpo geo_mean decoupled_ppo".split())

#: Log-probs a loss may read: ``"current"`` (``logprobs``), ``"proximal"`` (``old_logprobs``, the trainer's recompute
#: at the start of the update) and ``"behaviour"`` (``behaviour_logprobs``, of the policy that sampled the tokens).
LOGPROB_KINDS: tuple[str, ...] = ("current", "proximal", "behaviour")
#: The log-probs each built-in loss needs: GPG reads no ratio, decoupled PPO all three.
POLICY_LOSS_LOGPROBS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {name: LOGPROB_KINDS[:2] for name in POLICY_LOSSES} | {"gpg": LOGPROB_KINDS[:1], "decoupled_ppo": LOGPROB_KINDS}
)


def check_logprobs_supplied(loss: str | PolicyLossFn, *, available: tuple[str, ...] | frozenset[str]) -> None:
    """At start-up: ``ValueError`` if a configuration supplies fewer log-probs than ``loss`` needs.

    ``loss``: a built-in's name or function, or a user's function (its ``logprobs_needed`` attribute,
    default ``("current", "proximal")``); ``available``: the :data:`LOGPROB_KINDS` the recipe computes.
    """
    fn = get_policy_loss(loss) if isinstance(loss, str) else loss
    builtin = [name for name, f in POLICY_LOSSES.items() if f is fn]
    needed = POLICY_LOSS_LOGPROBS[builtin[0]] if builtin else getattr(fn, "logprobs_needed", LOGPROB_KINDS[:2])
    if unknown := sorted((set(needed) | set(available)) - set(LOGPROB_KINDS)):
        raise ValueError(f"unknown log-prob kinds {unknown}; known: {', '.join(LOGPROB_KINDS)}")
    if missing := [kind for kind in needed if kind not in available]:
        raise ValueError(f"policy loss {loss!r} needs the {', '.join(missing)} log-probs, not supplied here")


def get_policy_loss(name: str) -> PolicyLossFn:
    """The built-in policy loss called ``name`` (``"clip-cov"`` and ``"clip_cov"`` are the same name).

    Only :data:`POLICY_LOSSES` is searched (ValueError listing its names otherwise): a user's own loss
    is resolved from its ``module:function`` reference outside rlfunc.
    """
    key = name.replace("-", "_") if isinstance(name, str) else name
    if key not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; known policy losses: {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[key]

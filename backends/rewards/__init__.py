"""Reward functions for sampled responses: the built-ins by name, a user's own by reference, and the scorer
that runs them (routing by data source, weights, worker processes, time limits, error policy).

The reward-model role (a learned scorer) is :mod:`backends.training.reward_model`.
"""

import importlib
from typing import Any

#: name -> the module of this package that defines it. Imported on first use, so that a reward worker process
#: (backends.rewards.workers) imports only what its functions need, not torch with the scorer.
_HOMES = {
    "BUILTIN_REWARDS": "builtins",
    "builtin_reward": "builtins",
    "math_reward": "builtins",
    "RewardConfig": "scorer",
    "RewardError": "scorer",
    "RewardResult": "scorer",
    "RewardScorer": "scorer",
    "resolve_reward": "scorer",
}

__all__ = [
    "BUILTIN_REWARDS",
    "RewardConfig",
    "RewardError",
    "RewardResult",
    "RewardScorer",
    "builtin_reward",
    "math_reward",
    "resolve_reward",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'backends.rewards' has no attribute {name!r}")
    return getattr(importlib.import_module(f"backends.rewards.{_HOMES[name]}"), name)

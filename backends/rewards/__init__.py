"""Reward functions for sampled responses: the built-ins by name, a user's own by reference, and the scorer
that runs them (routing by data source, weights, worker processes, time limits, error policy).

The reward-model role (a learned scorer) is :mod:`backends.training.reward_model`.
"""

from backends.rewards.builtins import BUILTIN_REWARDS, builtin_reward, math_reward
from backends.rewards.scorer import RewardConfig, RewardError, RewardResult, RewardScorer, resolve_reward

__all__ = [
    "BUILTIN_REWARDS", "RewardConfig", "RewardError", "RewardResult", "RewardScorer", "builtin_reward", "math_reward",
    "resolve_reward",
]

"""rlfunc: the pure functional core of RL post-training for language models.

Every public function is exported here, e.g. ``rlfunc.gae``, ``rlfunc.ppo_policy_loss``,
``rlfunc.masked_whiten``. Nothing in this package touches distributed process groups, modules, files or
global state; the registries (``ADVANTAGE_ESTIMATORS``, ``POLICY_LOSSES``, ``REWARD_FUNCTIONS``) are
read-only mappings of the built-ins, and a user's own function is resolved from its ``module:function``
reference outside this package.

Losses, estimators and corrections take every argument after the first tensor by keyword
(``rlfunc.ppo_policy_loss(logprobs, old_logprobs=..., advantages=..., response_mask=...)``): verl orders
several of them differently, and a positional port would silently compute something else.
"""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("rlfunc")
except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.1.0"

from rlfunc.tree import *  # noqa: F401,F403
from rlfunc.checks import *  # noqa: F401,F403
from rlfunc.batch import *  # noqa: F401,F403
from rlfunc.masked import *  # noqa: F401,F403
from rlfunc.aggregation import *  # noqa: F401,F403
from rlfunc.logits import *  # noqa: F401,F403
from rlfunc.policy_losses import *  # noqa: F401,F403
from rlfunc.policy_loss_registry import *  # noqa: F401,F403
from rlfunc.value_loss import *  # noqa: F401,F403
from rlfunc.kl import *  # noqa: F401,F403
from rlfunc.schedules import *  # noqa: F401,F403
from rlfunc.rewards import *  # noqa: F401,F403
from rlfunc.token_advantages import *  # noqa: F401,F403
from rlfunc.outcome_advantages import *  # noqa: F401,F403
from rlfunc.advantages import *  # noqa: F401,F403
from rlfunc.importance import *  # noqa: F401,F403
from rlfunc.dapo import *  # noqa: F401,F403
from rlfunc.turns import *  # noqa: F401,F403

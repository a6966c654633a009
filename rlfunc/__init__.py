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

from rlfunc.advantages import *
from rlfunc.aggregation import *
from rlfunc.batch import *
from rlfunc.checks import *
from rlfunc.dapo import *
from rlfunc.importance import *
from rlfunc.kl import *
from rlfunc.logits import *
from rlfunc.masked import *
from rlfunc.outcome_advantages import *
from rlfunc.policy_loss_registry import *
from rlfunc.policy_losses import *
from rlfunc.rewards import *
from rlfunc.schedules import *
from rlfunc.token_advantages import *
from rlfunc.tree import *
from rlfunc.turns import *
from rlfunc.value_loss import *

"""rlfunc: the pure functional core of RL post-training for language models.

Every public function is exported here, e.g. ``rlfunc.gae``, ``rlfunc.ppo_policy_loss``,
``rlfunc.masked_whiten``. Nothing in this package touches distributed process groups, modules, files or
global state.
"""

from rlfunc.tree import *  # noqa: F401,F403
from rlfunc.checks import *  # noqa: F401,F403
from rlfunc.batch import *  # noqa: F401,F403
from rlfunc.masked import *  # noqa: F401,F403
from rlfunc.aggregation import *  # noqa: F401,F403
from rlfunc.logits import *  # noqa: F401,F403
from rlfunc.policy_losses import *  # noqa: F401,F403
from rlfunc.value_loss import *  # noqa: F401,F403
from rlfunc.kl import *  # noqa: F401,F403
from rlfunc.schedules import *  # noqa: F401,F403
from rlfunc.rewards import *  # noqa: F401,F403
from rlfunc.advantages import *  # noqa: F401,F403
from rlfunc.importance import *  # noqa: F401,F403

"""Generate tests/golden/kl.safetensors from verl 0.9.1 (run with the verl venv):

    /work/peer-verl/bin/python tests/golden/make_kl_golden.py            # writes the golden file
    /work/peer-verl/bin/python tests/golden/make_kl_golden.py --print    # also prints the schedule and
                                                                         # gsm8k values hard-coded in
                                                                         # tests/test_schedules.py, test_rewards.py

Contents (fp32 unless noted; tiny shapes, well under 200 KB):
- ``kl/logprobs``, ``kl/ref_logprobs`` (b t), ``kl/weights`` (b t) and for every kind K of verl's
  ``core_algos.kl_penalty``: ``kl/K/value`` and ``kl/K/grad`` (the gradient of ``sum(weights * value)``
  w.r.t. logprobs). The inputs include log-ratios beyond verl's clamps.
- ``kl_loss/mask`` (b t, bool) and ``kl_loss/<agg>`` for ``agg_loss(kl_penalty(.., "low_var_kl"), ..)``.
- ``reward_kl/*``: verl's ``ray_trainer.apply_kl_penalty`` with an ``AdaptiveKLController``: token scores,
  the new token rewards, the observed KL and the coefficient before/after the update (float64).
- ``ctrl/*``: a sequence of ``AdaptiveKLController.update`` calls (observed KLs, n_steps, betas, float64).
- ``logits/*``: ``logprobs_from_logits`` and ``entropy_from_logits`` values and gradients (fp32 logits),
  plus verl's bf16 ``logprobs_from_logits`` output for bf16 logits (to document the difference).

``ray_trainer`` cannot be imported in the CPU verl venv (it needs torchdata), so ``apply_kl_penalty`` is
taken from the verl source file by name with ``ast`` and executed against verl's own ``core_algos`` and
``masked_mean``; nothing of verl's is copied into this repository.
"""

from __future__ import annotations

import ast
import math
import pathlib
import sys

import torch
from safetensors.torch import save_file

import verl.trainer.ppo.core_algos as core_algos
import verl.trainer.ppo.ray_trainer as _unused  # noqa: F401  (only to fail loudly if this becomes importable)

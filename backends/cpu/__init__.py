"""Process-wide CPU settings for training and rollout (:mod:`backends.cpu.runtime`).

``tune_process()``: the allocator and oneDNN cache settings, called explicitly by recipes before any model
is built. Code outside this package imports it from here, never from the submodule.
"""

from __future__ import annotations

from backends.cpu.runtime import tune_process

__all__ = ["tune_process"]

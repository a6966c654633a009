"""The train state the checkpoint tests save: what ``backends.checkpoint`` needs of a role (a module, an optimizer
or none, a step, ``replace()``)."""

from __future__ import annotations

from typing import Any

import attrs
import torch


@attrs.frozen
class State:
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    step: int = 0

    def replace(self, **changes: Any) -> State:
        return attrs.evolve(self, **changes)

"""The actor's optimizer (torch AdamW) and its learning-rate schedule, configured like verl's ``optim/fsdp.yaml``.

The schedule is a pure function of the training step (:mod:`rlfunc.schedules`): :func:`lr_at` returns
the learning rate to use for update number ``step`` (0-based). The engine writes it into the
optimizer's param groups right before each ``optimizer.step()``, so there is no ``LambdaLR`` object to
checkpoint or keep in sync:
resuming at step ``k`` gives the learning rate of step ``k``. verl's ``LambdaLR`` gives the same
sequence (it sets ``lr * lambda(0)`` at construction and advances once after every update).
"""

from __future__ import annotations

from typing import Any, Iterable, Literal

import attrs
import torch

from rlfunc import schedules
from rlfunc.schedules import LRSchedule

__all__ = [
    "OptimConfig",
    "warmup_steps",
    "lr_schedule",
    "lr_multiplier",
    "lr_at",
    "build_optimizer",
    "initialize_state",
    "set_lr",
    "with_total_steps",
    "fresh_optimizer",
]


def _positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise ValueError(f"OptimConfig.{attribute.name} must be > 0, got {value}")


def _non_negative(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if value < 0:
        raise ValueError(f"OptimConfig.{attribute.name} must be >= 0, got {value}")


def _ratio(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"OptimConfig.{attribute.name} must be in [0, 1], got {value}")


@attrs.frozen
class OptimConfig:
    """AdamW and its LR schedule (field names and meaning follow verl's ``optim/fsdp.yaml``)."""

    #: peak learning rate
    lr: float = attrs.field(default=1e-6, validator=_positive)
    #: Adam (beta1, beta2)
    betas: tuple[float, float] = (0.9, 0.999)
    #: decoupled weight decay (AdamW), applied to every parameter
    weight_decay: float = attrs.field(default=0.01, validator=_non_negative)
    #: Adam epsilon
    eps: float = attrs.field(default=1e-8, validator=_non_negative)
    #: max global L2 norm of the gradient; <= 0 turns clipping off (the norm is still reported)
    clip_grad: float = 1.0
    #: warm-up steps; <= 0 means "use lr_warmup_steps_ratio * total_training_steps"
    lr_warmup_steps: int = -1
    #: warm-up length as a fraction of total_training_steps (used when lr_warmup_steps <= 0)
    lr_warmup_steps_ratio: float = attrs.field(default=0.0, validator=_ratio)
    #: "constant" (after warm-up) or "cosine" (decay to min_lr_ratio * lr at total_training_steps)
    lr_scheduler_type: Literal["constant", "cosine"] = attrs.field(
        default="constant", validator=attrs.validators.in_(("constant", "cosine"))
    )
    #: floor of the cosine schedule, as a fraction of lr
    min_lr_ratio: float = attrs.field(default=0.0, validator=_ratio)
    #: number of cosine waves over the decay phase (0.5: one half-cosine from lr down to the floor)
    num_cycles: float = 0.5
    #: total number of updates; the recipe sets it (needed by "cosine" and by lr_warmup_steps_ratio)
    total_training_steps: int = -1
    #: verl's flag: True counts steps from 0 (the first update is step 0); False from 1 (torchtitan)
    zero_indexed_step: bool = True
    #: a non-finite loss or gradient norm: "skip" the optimizer step (the weights stay; counted in the
    #: nonfinite_updates_skipped metric) or "error" (raise before the optimizer step, naming the update and the value)
    nonfinite: Literal["skip", "error"] = attrs.field(default="skip", validator=attrs.validators.in_(("skip", "error")))

    def __attrs_post_init__(self) -> None:
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"OptimConfig.betas must be two numbers in [0, 1), got {self.betas}")


def warmup_steps(cfg: OptimConfig) -> int:
    """Number of warm-up steps: ``lr_warmup_steps`` if positive, else ``int(ratio * total_training_steps)``."""
    if cfg.lr_warmup_steps > 0:
        return cfg.lr_warmup_steps
    if cfg.lr_warmup_steps_ratio > 0 and cfg.total_training_steps <= 0:
        raise ValueError(
            "OptimConfig.lr_warmup_steps_ratio > 0 needs total_training_steps > 0 "
            f"(got total_training_steps={cfg.total_training_steps}); set it or use lr_warmup_steps"
        )
    return int(cfg.lr_warmup_steps_ratio * max(cfg.total_training_steps, 0))


def lr_schedule(cfg: OptimConfig) -> LRSchedule:
    """The :class:`rlfunc.LRSchedule` these settings describe (verl's FSDP engine semantics).

    Raises if the schedule needs ``total_training_steps`` (cosine, or a warm-up ratio) and it is unset.
    """
    if cfg.lr_scheduler_type == "cosine" and cfg.total_training_steps <= 0:
        raise ValueError(
            f"lr_scheduler_type='cosine' needs OptimConfig.total_training_steps > 0, got {cfg.total_training_steps}"
        )
    warmup_steps(cfg)  # validates the ratio / total combination
    return LRSchedule.from_verl_fsdp(attrs.asdict(cfg))


def lr_multiplier(cfg: OptimConfig, step: int) -> float:
    r"""Factor applied to ``cfg.lr`` at update ``step`` (0-based); see :func:`rlfunc.schedules.lr_multiplier`.

    Warm-up linear from 0 over :func:`warmup_steps`; then 1 (``constant``) or
    :math:`\max(r, \tfrac{1-r}{2}\cos(2\pi k p) + \tfrac{1+r}{2})` (``cosine``) with
    :math:`p = (s - W)/(T - W)`, :math:`r` = ``min_lr_ratio``, :math:`k` = ``num_cycles``.
    """
    return schedules.lr_multiplier(lr_schedule(cfg), step)


def lr_at(cfg: OptimConfig, step: int) -> float:
    """Learning rate of update ``step`` (0-based): ``cfg.lr * lr_multiplier(cfg, step)``."""
    return schedules.lr_at(lr_schedule(cfg), step)


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``params`` (plain tensors or FSDP2's sharded DTensors).

    Its lr starts at ``cfg.lr``; whoever steps it sets each step's scheduled lr first (:func:`set_lr`).
    On CPU and CUDA it is PyTorch's fused implementation (one kernel over all parameters): on CPU,
    without it, ``AdamW`` falls back to a per-parameter loop, several times slower over FSDP2's
    DTensors.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("build_optimizer got no trainable parameters (all have requires_grad=False)")
    lr_schedule(cfg)  # validate the schedule settings now rather than at the first update
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused or None
    )
    initialize_state(optimizer)
    return optimizer


def initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate the optimizer's state now instead of at its first step, exactly as that step would.

    PyTorch's AdamW creates its two moments per parameter lazily, at the first ``step()``. A colocated
    rollout engine that is built before then sizes itself to the memory still free, and the moments would
    then arrive on top of it. One step with zero gradients at lr 0 allocates them, leaves the parameters as
    they are (an update and decoupled weight decay both scale with lr) and the moments at zero, and the
    step counters are put back to 0, so the next step is the first, as it would have been.
    """
    if optimizer.state:
        return
    lrs = []
    for group in optimizer.param_groups:
        lrs.append(group["lr"])
        group["lr"] = 0.0
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0
    optimizer.zero_grad(set_to_none=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Write ``lr`` into every param group (the schedule lives outside the optimizer)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def with_total_steps(cfg: OptimConfig, total_steps: int) -> OptimConfig:
    """``cfg`` with ``total_training_steps`` set (the recipe knows the number of updates, the YAML does not)."""
    return attrs.evolve(cfg, total_training_steps=total_steps)


def fresh_optimizer(state: Any, optim: OptimConfig) -> Any:
    """Same weights, a new AdamW and LR schedule: the RL phase does not inherit a previous (SFT) stage's moments."""
    return state.replace(
        optimizer=build_optimizer(state.module.parameters(), optim),
        optim_cfg=optim,
        lr_schedule=lr_schedule(optim),
        step=0,
    )

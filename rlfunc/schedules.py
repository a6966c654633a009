r"""Learning-rate schedules as pure functions of the optimizer step (Python floats, no tensors).

:class:`LRSchedule` is a frozen config; ``schedule(step)`` (or :func:`lr_at`) gives the learning rate and
:func:`lr_multiplier` the ratio to the peak ``lr``, which is what ``torch.optim.lr_scheduler.LambdaLR``
wants (``LambdaLR(opt, functools.partial(lr_multiplier, schedule))`` with the optimizer's lr set to
``schedule.lr``). With :math:`W` warm-up steps, :math:`T` total (decay) steps, :math:`s` the step and
:math:`m` the minimum ratio:

- warm-up (:math:`s < W`): linear from ``warmup_init_ratio`` to 1
- ``constant``: 1
- ``cosine``: :math:`\max(m, m + (1 - m) \tfrac12 (1 + \cos(2\pi c\,p)))`, :math:`p = (s - W)/(T - W)`,
  :math:`c` = ``num_cycles`` (0.5: one half-wave from 1 down to :math:`m`); SGDR,
  https://arxiv.org/abs/1608.03983
- ``linear``: :math:`m + (1 - m)(1 - p)`
- ``inverse-square-root``: :math:`\max(m, \sqrt{\max(W,1) / \max(s,1)})` (``total_steps`` unused; Megatron
  drops to ``min_lr`` past ``lr_decay_steps``, we keep decaying)
- ``wsd`` (warm-up, stable, decay): 1 until :math:`T - D`, then decays to :math:`m` over the last
  :math:`D` = ``wsd_decay_steps`` steps in the shape ``wsd_decay_style`` (MiniCPM,
  https://arxiv.org/abs/2404.06395)

These are verl 0.9.1's schedules: ``constant`` and ``cosine`` with ``min_lr_ratio``, ``num_cycles``,
``zero_indexed_step`` as its FSDP engine (``get_constant_schedule_with_warmup``,
``get_cosine_schedule_with_warmup``), ``linear`` / ``inverse-square-root`` / ``wsd`` and the warm-up
start (``lr_warmup_init``) as its Megatron engine (Megatron-core's ``OptimizerParamScheduler``); see
:meth:`LRSchedule.from_verl_fsdp` and :meth:`LRSchedule.from_verl_megatron`. Same numbers for every step
``0 <= s <= T``. Past ``T`` we hold the value reached at ``T`` (Megatron holds ``min_lr``; verl's FSDP
cosine keeps following the cosine, which with ``num_cycles=0.5`` climbs back up towards the peak).
"""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping, get_args

import attrs

__all__ = ["LRStyle", "LR_STYLES", "WSDDecayStyle", "LRSchedule", "lr_at", "lr_multiplier"]

LRStyle = Literal["constant", "cosine", "linear", "inverse-square-root", "wsd"]
LR_STYLES: tuple[str, ...] = get_args(LRStyle)
WSDDecayStyle = Literal["linear", "cosine", "exponential", "minus_sqrt"]
_WSD_DECAY_STYLES: tuple[str, ...] = get_args(WSDDecayStyle)
_DECAYING = ("cosine", "linear", "wsd")


def _in_choices(choices: tuple[str, ...], what: str):
    def check(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            raise ValueError(f"unknown {what} {value!r} for {attribute.name}; known: {', '.join(choices)}")

    return check


def _ratio(_inst: Any, attribute: attrs.Attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise ValueError(f"{attribute.name} must be in [0, 1], got {value!r}")


def _non_negative_int(_inst: Any, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name} must be an int >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class LRSchedule:
    """A learning-rate schedule: the peak ``lr`` and the shape of the multiplier over steps.

    Fields (verl's FSDP / Megatron option names in brackets):

    - ``lr`` [``lr``]: the peak learning rate (> 0).
    - ``style`` [``lr_scheduler_type`` / ``warmup_style``, ``lr_decay_style``]: one of :data:`LR_STYLES`.
    - ``warmup_steps`` [``lr_warmup_steps``]: steps of linear warm-up (already resolved: see
      :meth:`from_verl_fsdp` for ``lr_warmup_steps_ratio``).
    - ``total_steps`` [``total_training_steps``, ``lr_decay_steps``]: the step at which decay ends;
      required (> ``warmup_steps``) for the decaying styles.
    - ``min_lr_ratio`` [``min_lr_ratio``, ``min_lr / lr``]: the floor of the decay, as a fraction of ``lr``.
    - ``warmup_init_ratio`` [``init_lr_ratio``, ``lr_warmup_init / lr``]: where the warm-up starts.
    - ``num_cycles`` [``num_cycles``]: cosine waves over the decay (0.5 = one half-wave down).
    - ``zero_indexed_step`` [``zero_indexed_step``]: if False the schedule is evaluated at ``step + 1``
      (torchtitan's convention: the first update already uses the first warm-up increment).
    - ``wsd_decay_steps``, ``wsd_decay_style`` [``lr_wsd_decay_steps``, ``lr_wsd_decay_style``]: for ``wsd``.
    """

    lr: float
    style: LRStyle = attrs.field(default="constant", validator=_in_choices(LR_STYLES, "lr schedule style"))
    warmup_steps: int = attrs.field(default=0, validator=_non_negative_int)
    total_steps: int | None = None
    min_lr_ratio: float = attrs.field(default=0.0, validator=_ratio)
    warmup_init_ratio: float = attrs.field(default=0.0, validator=_ratio)
    num_cycles: float = 0.5
    zero_indexed_step: bool = True
    wsd_decay_steps: int | None = None
    wsd_decay_style: WSDDecayStyle = attrs.field(
        default="exponential", validator=_in_choices(_WSD_DECAY_STYLES, "wsd decay style")
    )

    def __attrs_post_init__(self) -> None:
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"lr must be a float > 0, got {self.lr!r}")
        if self.style in _DECAYING:
            if self.total_steps is None or isinstance(self.total_steps, bool) or not isinstance(self.total_steps, int):
                raise ValueError(f"style {self.style!r} needs total_steps (an int), got {self.total_steps!r}")
            if self.total_steps <= self.warmup_steps:
                raise ValueError(
                    f"total_steps ({self.total_steps}) must be greater than warmup_steps ({self.warmup_steps})"
                )
        if self.style == "cosine" and not (isinstance(self.num_cycles, (int, float)) and self.num_cycles > 0):
            raise ValueError(f"num_cycles must be > 0, got {self.num_cycles!r}")
        if self.style == "wsd":
            d = self.wsd_decay_steps
            if isinstance(d, bool) or not isinstance(d, int) or not 0 < d <= self.total_steps - self.warmup_steps:
                raise ValueError(
                    f"style 'wsd' needs wsd_decay_steps in [1, total_steps - warmup_steps = "
                    f"{self.total_steps - self.warmup_steps}], got {d!r}"
                )

    def __call__(self, step: int) -> float:
        """The learning rate at optimizer step ``step`` (0 for the first update)."""
        return lr_at(self, step)

    # -----------------------------------------------------------------------------------------------
    # Builders from verl's optimizer configs (plain mappings, e.g. ``OmegaConf.to_container(cfg.optim)``)

    @classmethod
    def from_verl_fsdp(cls, optim: Mapping[str, Any], *, total_training_steps: int | None = None) -> "LRSchedule":
        """Build from verl's ``optim/fsdp.yaml`` keys, resolving the warm-up as verl's FSDP engine does.

        ``lr_warmup_steps <= 0`` (or missing) means ``int(lr_warmup_steps_ratio * total_training_steps)``;
        the deprecated ``warmup_style`` overrides ``lr_scheduler_type``; ``min_lr_ratio: null`` is 0.
        ``total_training_steps`` (injected by verl's trainer at run time) may be given here instead.
        """
        total = total_training_steps if total_training_steps is not None else optim.get("total_training_steps", -1)
        style = optim.get("warmup_style") or optim.get("lr_scheduler_type", "constant")
        if style not in ("constant", "cosine"):
            raise ValueError(f"verl's FSDP engine supports lr_scheduler_type constant or cosine, got {style!r}")
        warmup = optim.get("lr_warmup_steps", -1)
        if warmup is None or warmup <= 0:
            warmup = int(optim.get("lr_warmup_steps_ratio", 0.0) * total)
        min_ratio = optim.get("min_lr_ratio")
        return cls(
            lr=float(optim["lr"]),
            style=style,
            warmup_steps=max(0, warmup),
            total_steps=total if total is not None and total > 0 else None,
            min_lr_ratio=0.0 if min_ratio is None else float(min_ratio),
            num_cycles=float(optim.get("num_cycles", 0.5)),
            zero_indexed_step=bool(optim.get("zero_indexed_step", True)),
        )

    @classmethod
    def from_verl_megatron(cls, optim: Mapping[str, Any], *, total_training_steps: int | None = None) -> "LRSchedule":
        """Build from verl's ``optim/megatron.yaml`` keys, as ``get_megatron_optimizer_param_scheduler``.

        ``lr_decay_steps: null`` means ``total_training_steps``; ``lr_warmup_steps <= 0`` (or null) with a
        ``lr_warmup_steps_ratio`` means ``int(ratio * lr_decay_steps)``; ``lr_warmup_init`` and ``min_lr``
        are absolute learning rates (converted to ratios of ``lr``). The WSD decay steps are
        ``lr_wsd_decay_steps``.
        """
        total = total_training_steps if total_training_steps is not None else optim.get("total_training_steps", -1)
        decay_steps = optim.get("lr_decay_steps") or total
        warmup = optim.get("lr_warmup_steps")
        if optim.get("lr_warmup_steps_ratio") is not None and (warmup is None or warmup <= 0):
            warmup = int(optim["lr_warmup_steps_ratio"] * decay_steps)
        lr = float(optim["lr"])
        style = optim.get("lr_decay_style", "constant")
        style = {"WSD": "wsd", "inverse_square_root": "inverse-square-root"}.get(style, style)
        return cls(
            lr=lr,
            style=style,
            warmup_steps=max(0, warmup or 0),
            total_steps=decay_steps if decay_steps is not None and decay_steps > 0 else None,
            min_lr_ratio=float(optim.get("min_lr", 0.0)) / lr,
            warmup_init_ratio=float(optim.get("lr_warmup_init", 0.0)) / lr,
            wsd_decay_steps=optim.get("lr_wsd_decay_steps"),
            wsd_decay_style=optim.get("lr_wsd_decay_style") or "exponential",
        )


def lr_multiplier(schedule: LRSchedule, step: int) -> float:
    """The learning rate at ``step`` divided by ``schedule.lr`` (the ``LambdaLR`` factor)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    s = step if schedule.zero_indexed_step else step + 1
    w, m = schedule.warmup_steps, schedule.min_lr_ratio
    if s < w:
        return schedule.warmup_init_ratio + (1.0 - schedule.warmup_init_ratio) * (s / w)
    style = schedule.style
    if style == "constant":
        return 1.0
    if style == "inverse-square-root":
        return max(m, math.sqrt(max(w, 1)) / math.sqrt(max(s, 1)))
    t = schedule.total_steps
    s = min(s, t)  # hold the value reached at total_steps
    progress = (s - w) / (t - w)
    if style == "cosine":
        # m + (1 - m)(1 + cos)/2, written as verl writes it so the floats agree to the last bit
        x = math.cos(math.pi * float(schedule.num_cycles) * 2.0 * progress)
        return max(m, x * ((1.0 - m) * 0.5) + (1.0 + m) * 0.5)
    if style == "linear":
        return m + (1.0 - m) * (1.0 - progress)
    # wsd: stable at 1 until the last wsd_decay_steps steps
    d = schedule.wsd_decay_steps
    if s <= t - d:
        return 1.0
    r = (s - (t - d)) / d
    coeff = {
        "linear": lambda: 1.0 - r,
        "cosine": lambda: 0.5 * (1.0 + math.cos(math.pi * r)),
        "exponential": lambda: 2.0 * 0.5**r - 1.0,
        "minus_sqrt": lambda: 1.0 - math.sqrt(r),
    }[schedule.wsd_decay_style]()
    return m + (1.0 - m) * coeff


def lr_at(schedule: LRSchedule, step: int) -> float:
    """The learning rate at optimizer step ``step`` (0 for the first update)."""
    return schedule.lr * lr_multiplier(schedule, step)

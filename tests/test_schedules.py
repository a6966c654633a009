"""Tests for rlfunc.schedules."""

from __future__ import annotations

import functools
import math

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfunc.schedules import LR_STYLES, LRSchedule, lr_at, lr_multiplier

# verl 0.9.1's LambdaLR multipliers for steps 0.. (printed by
# `/work/peer-verl/bin/python tests/golden/make_kl_golden.py --print`).
VERL_FSDP = {
    # get_constant_schedule_with_warmup(num_warmup_steps=4)
    "constant_warmup": [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    # get_cosine_schedule_with_warmup(num_warmup_steps=3, num_training_steps=12, min_lr_ratio=0.1)
    "cosine": [
        0.0,
        0.3333333333333333,
        0.6666666666666666,
        1.0,
        0.9728616793536589,
        0.8947199994035402,
        0.7750000000000001,
        0.6281416799501187,
        0.4718583200498814,
        0.3250000000000002,
        0.20528000059645996,
        0.12713832064634129,
        0.10000000000000003,
    ],
    # (num_warmup_steps=0, num_training_steps=10)
    "cosine_no_warmup": [
        1.0,
        0.9755282581475768,
        0.9045084971874737,
        0.7938926261462366,
        0.6545084971874737,
        0.5,
        0.34549150281252633,
        0.2061073738537635,
        0.09549150281252633,
        0.024471741852423234,
        0.0,
    ],
    # (num_warmup_steps=2, num_training_steps=10, num_cycles=1.0, min_lr_ratio=0.2)
    "cosine_cycles": [
        0.0,
        0.5,
        1.0,
        0.882842712474619,
        0.6,
        0.31715728752538097,
        0.2,
        0.3171572875253809,
        0.5999999999999999,
        0.882842712474619,
        1.0,
    ],
    # (num_warmup_steps=3, num_training_steps=12, min_lr_ratio=0.1, zero_indexed_step=False)
    "cosine_one_indexed": [
        0.3333333333333333,
        0.6666666666666666,
        1.0,
        0.9728616793536589,
        0.8947199994035402,
        0.7750000000000001,
        0.6281416799501187,
        0.4718583200498814,
        0.3250000000000002,
        0.20528000059645996,
        0.12713832064634129,
        0.10000000000000003,
        0.12713832064634123,
    ],
    # (num_warmup_steps=4, num_training_steps=12, init_lr_ratio=0.25)
    "cosine_init": [
        0.25,
        0.4375,
        0.625,
        0.8125,
        1.0,
        0.9619397662556434,
        0.8535533905932737,
        0.6913417161825449,
        0.5,
        0.30865828381745514,
        0.14644660940672627,
        0.03806023374435663,
        0.0,
    ],
}

OURS = {
    "constant_warmup": LRSchedule(lr=1.0, style="constant", warmup_steps=4),
    "cosine": LRSchedule(lr=1.0, style="cosine", warmup_steps=3, total_steps=12, min_lr_ratio=0.1),
    "cosine_no_warmup": LRSchedule(lr=1.0, style="cosine", total_steps=10),
    "cosine_cycles": LRSchedule(
        lr=1.0, style="cosine", warmup_steps=2, total_steps=10, num_cycles=1.0, min_lr_ratio=0.2
    ),
    "cosine_one_indexed": LRSchedule(
        lr=1.0, style="cosine", warmup_steps=3, total_steps=12, min_lr_ratio=0.1, zero_indexed_step=False
    ),
    "cosine_init": LRSchedule(lr=1.0, style="cosine", warmup_steps=4, total_steps=12, warmup_init_ratio=0.25),
}


@pytest.mark.parametrize("name", list(VERL_FSDP))
def test_matches_verl_fsdp_schedules(name):
    sched = OURS[name]
    for step, want in enumerate(VERL_FSDP[name]):
        evaluated_at = step if sched.zero_indexed_step else step + 1
        if sched.total_steps is not None and evaluated_at > sched.total_steps:
            continue  # past the end: see test_holds_after_total_steps
        assert lr_multiplier(sched, step) == pytest.approx(want, rel=1e-12, abs=1e-15), (name, step)


def test_holds_after_total_steps():
    # verl's FSDP cosine keeps following the wave past total_steps (0.127 at step 12 of cosine_one_indexed);
    # we hold the final value, as Megatron does.
    sched = OURS["cosine_one_indexed"]
    assert lr_multiplier(sched, 12) == pytest.approx(0.1)
    assert lr_multiplier(sched, 1000) == pytest.approx(0.1)
    assert lr_multiplier(OURS["cosine"], 50) == pytest.approx(0.1)
    assert lr_multiplier(LRSchedule(lr=1.0, style="linear", total_steps=5, min_lr_ratio=0.3), 9) == pytest.approx(0.3)


def test_lr_scales_the_multiplier_and_call():
    sched = attrs.evolve(OURS["cosine"], lr=3e-4)
    for step in range(15):
        assert lr_at(sched, step) == sched(step) == pytest.approx(3e-4 * lr_multiplier(OURS["cosine"], step))


def test_from_verl_fsdp_config():
    optim = {  # verl/trainer/config/optim/fsdp.yaml with overrides
        "lr": 1e-6,
        "lr_warmup_steps_ratio": 0.25,
        "total_training_steps": 12,
        "lr_warmup_steps": -1,
        "min_lr_ratio": 0.1,
        "num_cycles": 0.5,
        "lr_scheduler_type": "cosine",
        "zero_indexed_step": True,
        "warmup_style": None,
    }
    sched = LRSchedule.from_verl_fsdp(optim)
    assert sched.warmup_steps == 3 and sched.total_steps == 12 and sched.style == "cosine"
    assert [sched(s) / 1e-6 for s in range(13)] == pytest.approx(VERL_FSDP["cosine"], rel=1e-12)
    # explicit warm-up steps win over the ratio; deprecated warmup_style overrides lr_scheduler_type
    sched = LRSchedule.from_verl_fsdp({**optim, "lr_warmup_steps": 4, "warmup_style": "constant", "min_lr_ratio": None})
    assert sched.style == "constant" and sched.warmup_steps == 4
    assert [sched.__call__(s) / 1e-6 for s in range(13)] == pytest.approx(VERL_FSDP["constant_warmup"])
    # defaults of fsdp.yaml: constant, no warm-up, total steps injected later
    sched = LRSchedule.from_verl_fsdp(
        {"lr": 1e-3, "total_training_steps": -1, "lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.0}
    )
    assert sched(0) == sched(100) == 1e-3
    with pytest.raises(ValueError, match="constant or cosine"):
        LRSchedule.from_verl_fsdp({**optim, "lr_scheduler_type": "linear"})
    with pytest.raises(ValueError, match="total_steps"):
        LRSchedule.from_verl_fsdp({**optim, "total_training_steps": -1}, total_training_steps=None)
    assert LRSchedule.from_verl_fsdp({**optim, "total_training_steps": -1}, total_training_steps=12).total_steps == 12


# Megatron-core's OptimizerParamScheduler.get_lr (used by verl's Megatron engine), computed by hand:
# lr=1, min_lr=0.1, lr_warmup_init=0.2, warmup 2, decay steps 10.
def _megatron_reference(style, s, lr=1.0, min_lr=0.1, init=0.2, warmup=2, decay=10, wsd_steps=4, wsd_style="linear"):
    if warmup > 0 and s <= warmup:
        return init + (lr - init) * s / warmup
    if style == "constant":
        return lr
    if s > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(s, 1)))
    ratio = (s - warmup) / (decay - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # WSD
        start = decay - wsd_steps
        if s <= start:
            coeff = 1.0
        else:
            r = (s - start) / wsd_steps
            coeff = {
                "linear": 1 - r,
                "cosine": 0.5 * (math.cos(math.pi * r) + 1),
                "exponential": 2 * 0.5**r - 1,
                "minus_sqrt": 1 - math.sqrt(r),
            }[wsd_style]
    return min_lr + coeff * (lr - min_lr)


def test_megatron_hand_values():
    linear = LRSchedule(lr=1.0, style="linear", warmup_steps=2, total_steps=10, min_lr_ratio=0.1, warmup_init_ratio=0.2)
    # warm-up 0.2 -> 1 over 2 steps, then linear 1 -> 0.1 over 8 steps
    assert [round(linear(s), 10) for s in range(12)] == [
        0.2,
        0.6,
        1.0,
        0.8875,
        0.775,
        0.6625,
        0.55,
        0.4375,
        0.325,
        0.2125,
        0.1,
        0.1,
    ]
    cosine = attrs.evolve(linear, style="cosine")
    assert cosine(6) == pytest.approx(0.55)  # half-way: (1 + 0.1) / 2
    isqrt = attrs.evolve(linear, style="inverse-square-root", total_steps=None)
    assert isqrt(8) == pytest.approx(0.5)  # sqrt(2 / 8)
    assert isqrt(10**6) == pytest.approx(0.1)  # floored at min


@pytest.mark.parametrize(
    ("style", "wsd_style"),
    [(s, "linear") for s in ("constant", "linear", "cosine", "inverse-square-root")]
    + [("WSD", w) for w in ("linear", "cosine", "exponential", "minus_sqrt")],
)
def test_matches_megatron_param_scheduler(style, wsd_style):
    optim = {  # verl/trainer/config/optim/megatron.yaml keys
        "lr": 2.0,
        "lr_warmup_steps_ratio": 0.2,
        "total_training_steps": 10,
        "lr_warmup_steps": -1,
        "lr_warmup_init": 0.4,
        "lr_decay_steps": None,
        "lr_decay_style": style,
        "min_lr": 0.2,
        "lr_wsd_decay_style": wsd_style,
        "lr_wsd_decay_steps": 4,
    }
    sched = LRSchedule.from_verl_megatron(optim)
    assert sched.warmup_steps == 2 and sched.total_steps == 10
    last = 10 if style == "inverse-square-root" else 14  # Megatron's inverse-sqrt drops to min_lr past decay
    for s in range(last + 1):
        want = _megatron_reference(style, s, lr=2.0, min_lr=0.2, init=0.4, wsd_style=wsd_style)
        assert sched(s) == pytest.approx(want, rel=1e-12), (style, s)


def test_megatron_aliases():
    base = {"lr": 1.0, "total_training_steps": 10, "lr_decay_style": "inverse_square_root", "lr_warmup_steps": 2}
    assert LRSchedule.from_verl_megatron(base).style == "inverse-square-root"
    sched = LRSchedule.from_verl_megatron({**base, "lr_decay_steps": 8, "lr_decay_style": "cosine"})
    assert sched.total_steps == 8 and sched(8) == 0.0


def test_lambda_lr_integration():
    sched = LRSchedule(lr=0.5, style="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=sched.lr)
    lam = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(lr_multiplier, sched))
    seen = []
    for _ in range(8):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        lam.step()
    assert seen == pytest.approx([sched(s) for s in range(8)])


@settings(max_examples=50, deadline=None)
@given(
    style=st.sampled_from(LR_STYLES),
    warmup=st.integers(0, 20),
    extra=st.integers(1, 50),
    min_ratio=st.floats(0.0, 1.0),
    init_ratio=st.floats(0.0, 1.0),
    step=st.integers(0, 200),
)
def test_property_bounds_and_endpoints(style, warmup, extra, min_ratio, init_ratio, step):
    total = warmup + extra
    sched = LRSchedule(
        lr=1e-3,
        style=style,
        warmup_steps=warmup,
        total_steps=total,
        min_lr_ratio=min_ratio,
        warmup_init_ratio=init_ratio,
        wsd_decay_steps=max(1, extra // 2),
    )
    m = lr_multiplier(sched, step)
    assert min(min_ratio, init_ratio) - 1e-12 <= m <= 1.0 + 1e-12
    assert lr_multiplier(sched, warmup) == pytest.approx(1.0)  # end of warm-up is the peak
    if warmup > 0:
        assert lr_multiplier(sched, 0) == pytest.approx(init_ratio)
    if style in ("cosine", "linear", "wsd"):
        assert lr_multiplier(sched, total) == pytest.approx(min_ratio, abs=1e-12)
        # monotone non-increasing after warm-up (num_cycles 0.5)
        assert lr_multiplier(sched, max(step, warmup) + 1) <= lr_multiplier(sched, max(step, warmup)) + 1e-12


def test_bad_configs():
    with pytest.raises(ValueError, match="unknown lr schedule style 'poly'.*known: constant"):
        LRSchedule(lr=1.0, style="poly")
    with pytest.raises(ValueError, match="needs total_steps"):
        LRSchedule(lr=1.0, style="cosine")
    with pytest.raises(ValueError, match="greater than warmup_steps"):
        LRSchedule(lr=1.0, style="linear", warmup_steps=5, total_steps=5)
    with pytest.raises(ValueError, match="lr must be"):
        LRSchedule(lr=0.0)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        LRSchedule(lr=1.0, min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="warmup_steps"):
        LRSchedule(lr=1.0, warmup_steps=-1)
    with pytest.raises(ValueError, match="wsd_decay_steps"):
        LRSchedule(lr=1.0, style="wsd", total_steps=10)
    with pytest.raises(ValueError, match="unknown wsd decay style"):
        LRSchedule(lr=1.0, style="wsd", total_steps=10, wsd_decay_steps=2, wsd_decay_style="step")
    with pytest.raises(ValueError, match="num_cycles"):
        LRSchedule(lr=1.0, style="cosine", total_steps=10, num_cycles=0)
    with pytest.raises(ValueError, match="step must be"):
        lr_at(LRSchedule(lr=1.0), -1)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        LRSchedule(lr=1.0).lr = 2.0  # type: ignore[misc]

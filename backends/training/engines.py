"""The training engines by name (``actor.backend=...``): ``fsdp`` (FSDP2, data parallel) or ``megatron``
(megatron-core tensor / pipeline / data parallel). Each makes a :class:`backends.training.engine.TrainEngine`,
so ``actor.backend=megatron actor.tp=2`` is the only change a run needs.

A new engine is a module with a class that implements :class:`~backends.training.engine.TrainEngine` and a
factory ``(*, fsdp, tp, pp, micro_batch_size, key) -> engine`` that refuses settings it cannot run, plus one
entry in :data:`TRAIN_ENGINES`. The factories import their engine when called: megatron-core is loaded only by
a run that asks for it.
"""

from __future__ import annotations

from typing import Any, Callable

from backends.training.engine import TrainEngine

__all__ = ["TRAIN_ENGINES", "registered_engine", "select_engine"]


def _fsdp(**settings: Any) -> TrainEngine:
    from backends.training.fsdp_engine import make_fsdp_engine

    return make_fsdp_engine(**settings)


def _megatron(**settings: Any) -> TrainEngine:
    from backends.training.megatron.train_engine import make_megatron_engine

    return make_megatron_engine(**settings)


#: name -> factory ``(*, fsdp, tp, pp, micro_batch_size, key) -> TrainEngine``
TRAIN_ENGINES: dict[str, Callable[..., TrainEngine]] = {"fsdp": _fsdp, "megatron": _megatron}


def select_engine(
    backend: str, *, fsdp: Any = None, tp: int = 1, pp: int = 1, micro_batch_size: int | None = None, key: str = "actor"
) -> TrainEngine:
    """The engine called ``backend``; ``fsdp`` is the FSDPConfig (its micro-batch size is reused by megatron unless
    ``micro_batch_size`` is given), ``tp`` / ``pp`` megatron's sizes; ``key``: the config section that names the
    engine (``actor``, ``reference``), for the messages of settings it refuses."""
    factory = TRAIN_ENGINES.get(backend)
    if factory is None:
        raise ValueError(f"unknown backend {backend!r} ({key}.backend); choose one of {tuple(TRAIN_ENGINES)}")
    return factory(fsdp=fsdp, tp=tp, pp=pp, micro_batch_size=micro_batch_size, key=key)


def registered_engine(instance: Any, attribute: Any, value: str) -> None:
    """An attrs validator for a config field that names a training engine: an unknown name fails when the
    config is read, not when the engine is built after the data and the SFT stage."""
    if value not in TRAIN_ENGINES:
        raise ValueError(f"{value!r} is not one of {', '.join(map(repr, TRAIN_ENGINES))}")

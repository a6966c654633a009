"""backends.checkpoint.hf_export: a trained FSDP2 model exported as a HF dir gives the same log-probs once reloaded.

The FSDP checks run on 2 real gloo ranks (tests/distributed.py): an actor (Qwen2, tied embeddings), an
untied Llama actor and a value model (``*ForTokenClassification``, one label) are trained for one step,
exported, and their outputs on the FSDP model are compared in this process with the exported dir
loaded by ``transformers`` (fp32, 1e-5). File-level checks and bad input run in this process on
plain (unsharded) models.
"""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest
import torch
from safetensors import safe_open

from backends.checkpoint.hf_export import export_hf, hf_model_class
from backends.models import TinyModelConfig, build_char_tokenizer, build_tiny_model, load_causal_lm
from backends.training.optim import OptimConfig
from rlfunc.batch import RolloutBatch
from tests.distributed import run_distributed

pytestmark = pytest.mark.checkpoint

TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_position_embeddings=64, seed=1
)
UNTIED_LLAMA = attrs.evolve(TINY, arch="llama", tie_word_embeddings=False, seed=2)
OPTIM = OptimConfig(lr=1e-2, eps=1e-6)


def make_batch(seed: int = 0, rows: int = 4) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    p, t = 5, 6
    prompt_lens = torch.tensor([5, 2, 4, 1])[:rows]
    return RolloutBatch(
        prompt_ids=torch.randint(4, 60, (rows, p), generator=g),
        prompt_mask=torch.arange(p).flip(0)[None, :] < prompt_lens[:, None],
        response_ids=torch.randint(4, 60, (rows, t), generator=g),
        response_mask=torch.arange(t)[None, :] < torch.tensor([6, 3, 1, 5])[:rows, None],
        group_ids=torch.arange(rows),
        advantages=torch.randn(rows, t, generator=g),
    )


def hf_logprobs(model, batch: RolloutBatch) -> torch.Tensor:
    """Plain HF forward over prompt + response; log-probs of the response tokens, 0 outside the mask."""
    attention_mask = batch.attention_mask.long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    p, t = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    logp = torch.log_softmax(logits[:, p - 1 : p + t - 1].float(), dim=-1)
    chosen = logp.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    return torch.where(batch.response_mask, chosen, 0.0)


def hf_values(model, batch: RolloutBatch) -> torch.Tensor:
    attention_mask = batch.attention_mask.long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=batch.input_ids, attention_mask=attention_mask, position_ids=position_ids).logits.float()


def _pg_loss(outputs, mb, norms):
    from rlfunc.aggregation import aggregate

    return aggregate(-mb.advantages * outputs.logprobs, mb.response_mask, mode="token-mean", norms=norms), {}


# ------------------------------------------------------------------------------- 2 ranks, FSDP2 export


def _export_worker(rank: int, world_size: int, qwen_dir: str, llama_dir: str, out_root: str) -> dict:
    from transformers import AutoConfig, AutoModelForTokenClassification

    from backends.distributed.setup import init_distributed
    from backends.training.fsdp import build_actor, build_critic, compute_logprobs, update

    env = init_distributed()
    tokenizer = build_char_tokenizer(model_max_length=64)
    batch = make_batch(0)
    out = {}
    for name, model_dir in (("qwen2", qwen_dir), ("llama", llama_dir)):
        actor = build_actor(model_dir, env, OPTIM)
        actor, _ = update(actor, make_batch(1 + rank), _pg_loss)  # the exported weights are trained ones
        path = export_hf(actor, f"{out_root}/{name}", tokenizer=tokenizer)
        out[name] = {"path": str(path), "logprobs": compute_logprobs(actor, batch).logprobs.numpy()}

    config = AutoConfig.from_pretrained(qwen_dir, num_labels=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        value_module = AutoModelForTokenClassification.from_config(config)
    critic = build_critic(value_module, env, OPTIM)
    critic.module.eval()
    values = hf_values(critic.module, batch)
    path = export_hf(critic, f"{out_root}/critic")
    out["critic"] = {"path": str(path), "values": values.numpy()}
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from backends.models import write_tiny_model

    root = tmp_path_factory.mktemp("hf_export")
    qwen_dir = str(write_tiny_model(root / "qwen2", TINY))
    llama_dir = str(write_tiny_model(root / "llama", UNTIED_LLAMA))
    results = run_distributed(_export_worker, 2, qwen_dir, llama_dir, str(root / "out"))
    return {"qwen2": qwen_dir, "llama": llama_dir}, results


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_exported_actor_gives_the_fsdp_logprobs(exported, name):
    from transformers import AutoModelForCausalLM

    sources, results = exported
    r0, r1 = results[0][name], results[1][name]
    assert r0["path"] == r1["path"]
    np.testing.assert_array_equal(r0["logprobs"], r1["logprobs"])
    model = AutoModelForCausalLM.from_pretrained(r0["path"], dtype=torch.float32, local_files_only=True).eval()
    got = hf_logprobs(model, make_batch(0)).numpy()
    np.testing.assert_allclose(got, r0["logprobs"], atol=1e-5, rtol=0)
    # it is the trained model, not the initial one
    initial, _ = load_causal_lm(sources[name])
    assert np.abs(hf_logprobs(initial, make_batch(0)).numpy() - got).max() > 1e-3
    # and our own loader (used by the engines and vLLM-style rollouts) takes it, tokenizer included
    again, tokenizer = load_causal_lm(r0["path"])
    assert tokenizer.decode(tokenizer.encode("12+34=46")) == "12+34=46"


@pytest.mark.distributed
def test_exported_files(exported):
    _, results = exported
    qwen, llama = results[0]["qwen2"]["path"], results[0]["llama"]["path"]
    config = json.loads(open(f"{qwen}/config.json").read())
    assert config["architectures"] == ["Qwen2ForCausalLM"]  # not FSDP's wrapper class name
    assert config["use_cache"] is True and config["tie_word_embeddings"] is True
    with safe_open(f"{qwen}/model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: stored once
    with safe_open(f"{llama}/model.safetensors", "pt") as f:
        assert "lm_head.weight" in f.keys()
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
    assert json.loads(open(f"{llama}/config.json").read())["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.distributed
def test_exported_value_model(exported):
    from transformers import AutoModelForTokenClassification

    _, results = exported
    r0, r1 = results[0]["critic"], results[1]["critic"]
    np.testing.assert_array_equal(r0["values"], r1["values"])
    model = AutoModelForTokenClassification.from_pretrained(r0["path"], local_files_only=True).eval()
    assert type(model).__name__ == "Qwen2ForTokenClassification" and model.config.num_labels == 1
    np.testing.assert_allclose(hf_values(model, make_batch(0)).numpy(), r0["values"], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------ one process, plain


@attrs.frozen
class PlainState:
    module: torch.nn.Module


def test_plain_module_export_and_bf16(tmp_path):
    from transformers import AutoModelForCausalLM

    model = build_tiny_model(TINY)
    path = export_hf(PlainState(model), tmp_path / "fp32", tokenizer=build_char_tokenizer())
    reloaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    for k, v in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[k], v), k
    assert (path / "tokenizer.json").is_file() and (path / "generation_config.json").is_file()

    path = export_hf(PlainState(model), tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.embed_tokens.weight")
    assert w.dtype == torch.bfloat16 and torch.equal(w, model.model.embed_tokens.weight.detach().to(torch.bfloat16))
    assert not (path / "tokenizer.json").exists()  # no tokenizer given
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16", "fp32"]  # no temp dirs left


def test_existing_dir_needs_overwrite(tmp_path):
    a, b = build_tiny_model(TINY), build_tiny_model(attrs.evolve(TINY, seed=9))
    path = export_hf(PlainState(a), tmp_path / "out")
    with pytest.raises(FileExistsError, match="already exists.*overwrite=True"):
        export_hf(PlainState(b), tmp_path / "out")
    export_hf(PlainState(b), tmp_path / "out", overwrite=True)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("model.norm.weight"), b.model.norm.weight.detach())
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_not_a_hf_model(tmp_path):
    with pytest.raises(TypeError, match="not a Hugging Face PreTrainedModel"):
        export_hf(PlainState(torch.nn.Linear(2, 2)), tmp_path / "x")
    with pytest.raises(TypeError, match=r"needs a train state with a \.module"):
        export_hf(object(), tmp_path / "x")
    with pytest.raises(ValueError, match="floating torch.dtype"):
        export_hf(PlainState(build_tiny_model(TINY)), tmp_path / "x", dtype=torch.int8)
    assert not (tmp_path / "x").exists()


def test_model_class_looks_through_fsdp():
    model = build_tiny_model(TINY)
    assert hf_model_class(model).__name__ == "Qwen2ForCausalLM"

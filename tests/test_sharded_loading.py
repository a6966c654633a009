"""Loading a checkpoint straight into FSDP2 shards (backends/training/sharded_loading.py) gives exactly the
model the older path (``from_pretrained`` on every rank, then ``fully_shard``) gives; the unsharded
world-size-1 module lives on the mesh's device; offload is refused off a GPU before anything loads.

The multi-rank checks run on real gloo ranks (tests/distributed.py), all cases in one spawn.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from backends.models import TinyModelConfig, build_char_tokenizer, build_tiny_model
from backends.training.fsdp import FSDPConfig
from backends.training.optim import OptimConfig
from rlfunc.aggregation import aggregate
from rlfunc.batch import RolloutBatch, select
from tests.distributed import run_distributed

pytestmark = pytest.mark.loading

OPTIM = OptimConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0, eps=1e-5)
# hidden 64 over 2 ranks; vocab (89 tokens) and the kv projections (32 rows) split unevenly over 3
BASE = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=96, max_position_embeddings=64)
#: name -> (arch, tied embeddings, max_shard_size of save_pretrained: None = one file)
CASES = {
    "qwen2-tied": ("qwen2", True, None),
    "qwen2-untied-split": ("qwen2", False, "60KB"),
    "llama-tied-split": ("llama", True, "60KB"),
    "llama-untied": ("llama", False, None),
}


def write_checkpoint(out: Path, arch: str, tied: bool, max_shard_size: str | None, seed: int = 5) -> str:
    config = TinyModelConfig(arch=arch, tie_word_embeddings=tied, seed=seed, **BASE)
    tokenizer = build_char_tokenizer(model_max_length=config.max_position_embeddings)
    model = build_tiny_model(config, tokenizer)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: write_checkpoint(root / name, *spec) for name, spec in CASES.items()}


def make_batch(rank: int, world_size: int, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens = [4, 2, 5, 3, 1, 5], [6, 3, 1, 5, 2, 4]
    b, p, t = len(prompt_lens), max(prompt_lens), max(response_lens)
    batch = RolloutBatch(
        prompt_ids=torch.randint(4, 80, (b, p), generator=g),
        prompt_mask=torch.arange(p).flip(0)[None, :] < torch.tensor(prompt_lens)[:, None],
        response_ids=torch.randint(4, 80, (b, t), generator=g),
        response_mask=torch.arange(t)[None, :] < torch.tensor(response_lens)[:, None],
        group_ids=torch.arange(b),
        advantages=torch.randn(b, t, generator=g),
    )
    n = b // world_size
    return select(batch, slice(rank * n, (rank + 1) * n))


def pg_loss(outputs, mb, norms):
    return aggregate(-mb.advantages * outputs.logprobs, mb.response_mask, mode="token-mean", norms=norms), {}


# ------------------------------------------------------------------------------ single process


def test_parameters_on_meta_keeps_buffers_real():
    from transformers import AutoModelForCausalLM

    from backends.training.sharded_loading import parameters_on_meta

    real = build_tiny_model(TinyModelConfig(**BASE))
    with parameters_on_meta():
        empty = AutoModelForCausalLM.from_config(real.config, dtype=torch.float32)
    assert all(p.device.type == "meta" for p in empty.parameters())
    assert empty.lm_head.weight is empty.model.embed_tokens.weight  # tied on meta too
    buffers = dict(real.named_buffers())
    assert buffers.keys() == dict(empty.named_buffers()).keys() and buffers
    for name, buf in empty.named_buffers():
        assert buf.device.type == "cpu" and torch.equal(buf, buffers[name]), name
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # the patch is gone after the context


def test_safetensors_files_follow_the_index(tmp_path):
    from backends.training.sharded_loading import safetensors_files

    split = Path(write_checkpoint(tmp_path / "split", "qwen2", False, "60KB"))
    files = safetensors_files(split)
    weight_map = json.loads((split / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    assert files == {name: split / f for name, f in weight_map.items()}
    single = Path(write_checkpoint(tmp_path / "single", "llama", True, None))
    assert set(safetensors_files(single)) == set(load_file(single / "model.safetensors"))
    assert safetensors_files(tmp_path) is None  # no safetensors: the caller loads the old way


def _plan_for(directory: Path):
    from backends.training.sharded_loading import checkpoint_plan, empty_causal_lm, safetensors_files

    return checkpoint_plan(empty_causal_lm(directory, torch.float32), safetensors_files(directory))


def test_checkpoint_plan_names_unknown_missing_and_misshapen_tensors(tmp_path):
    directory = Path(write_checkpoint(tmp_path / "m", "qwen2", True, None))
    weights = directory / "model.safetensors"
    tensors = load_file(weights)
    plan = _plan_for(directory)
    assert [name for name, _, _ in plan] == [n for n, _ in build_tiny_model(TinyModelConfig(**BASE)).named_parameters()]

    # old Llama checkpoints store each layer's rotary inv_freq; Hugging Face drops it, so does the plan
    save_file({**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16)}, weights)
    assert len(_plan_for(directory)) == len(plan)

    save_file({**tensors, "model.extra.weight": torch.ones(2)}, weights)
    with pytest.raises(ValueError, match=r"no parameter for: \['model.extra.weight'\]"):
        _plan_for(directory)
    save_file({k: v for k, v in tensors.items() if k != "model.norm.weight"}, weights)
    with pytest.raises(ValueError, match=r"missing the weights of .* \['model.norm.weight'\]"):
        _plan_for(directory)
    save_file({**tensors, "model.norm.weight": torch.ones(3)}, weights)
    with pytest.raises(ValueError, match=r"wrong shape: \['model.norm.weight: checkpoint \(3,\), model \(64,\)'\]"):
        _plan_for(directory)
    # a tied checkpoint may store the shared tensor under the lm_head's name instead
    renamed = {("lm_head.weight" if k == "model.embed_tokens.weight" else k): v for k, v in tensors.items()}
    save_file(renamed, weights)
    assert ("model.embed_tokens.weight", "lm_head.weight") in [(n, s) for n, s, _ in _plan_for(directory)]


@pytest.fixture(scope="module")
def env():
    from backends.distributed.setup import init_distributed

    return init_distributed(device="cpu")


def test_plain_world_size_one_module_moves_to_the_mesh_device(env):
    """At world size 1 in fp32 the module stays unsharded: it is moved to the mesh's device, which
    ``fully_shard`` would otherwise have done (on a GPU, an unmoved module stayed on the CPU)."""
    from backends.distributed.setup import device_mesh
    from backends.training.fsdp_sharding import shard_module
    from backends.training.sharded_loading import mesh_device

    mesh = device_mesh(env)
    assert mesh.size() == 1 and mesh_device(mesh) == torch.device("cpu")
    model = build_tiny_model(TinyModelConfig(**BASE))
    moved_to = []
    to = model.to
    model.to = lambda *args, **kwargs: moved_to.append((args, kwargs)) or to(*args, **kwargs)
    assert shard_module(model, mesh, FSDPConfig(), None) is model
    assert moved_to == [((torch.device("cpu"),), {})]
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters())


def test_offload_is_refused_off_a_gpu_before_loading(env, tmp_path):
    from backends.training.fsdp import build_actor, build_critic, build_reference

    absent = tmp_path / "no-such-model"  # loading it first would raise FileNotFoundError instead
    for build in (build_actor, build_critic):
        with pytest.raises(ValueError, match=r"FSDPConfig.offload=True needs a CUDA device.*runs on 'cpu'"):
            build(absent, env, OPTIM, FSDPConfig(offload=True))
    with pytest.raises(ValueError, match=r"reference param_offload=True needs a CUDA device"):
        build_reference(absent, env, param_offload=True)


def test_one_rank_bf16_reference_loads_the_same_weights(env, checkpoints):
    """At world size 1 a bf16 reference is still sharded (for the cast): the meta path with one rank."""
    from backends.training.fsdp import build_reference, compute_logprobs, full_state_dict

    path = checkpoints["llama-tied-split"]
    new = build_reference(path, env, FSDPConfig(param_dtype="bfloat16"))
    old = build_reference(path, env, FSDPConfig(param_dtype="bfloat16", load_on_every_rank=True))
    assert _same_tensors(dict(full_state_dict(new)), dict(full_state_dict(old))) == []
    assert _same_tensors(dict(new.module.named_buffers()), dict(old.module.named_buffers())) == []
    batch = make_batch(0, 1)
    assert torch.equal(compute_logprobs(new, batch).logprobs, compute_logprobs(old, batch).logprobs)


def _gpu_roles_worker(rank, world_size, path):
    """On one GPU (its own process and process group): an fp32 actor and reference, which stay unsharded,
    live on the GPU; an offloaded actor (sharded on one rank, loaded the meta way) keeps its shards in
    host memory and takes the same step as a resident one."""
    from backends.distributed.setup import init_distributed
    from backends.training.fsdp import build_actor, build_reference, compute_logprobs, full_state_dict, update

    env = init_distributed(device="cuda")
    fp32 = FSDPConfig(param_dtype="float32")
    actor, reference = build_actor(path, env, OPTIM, fp32), build_reference(path, env, fp32)
    out = {
        "devices": [
            sorted({t.device.type for t in [*s.module.parameters(), *s.module.buffers()]}) for s in (actor, reference)
        ]
    }
    batch = make_batch(0, 1)
    out["logprob_gap"] = float(
        (compute_logprobs(actor, batch).logprobs - compute_logprobs(reference, batch).logprobs).abs().max()
    )
    offloaded = build_actor(path, env, OPTIM, attrs.evolve(fp32, offload=True))
    out["offloaded_on"] = next(offloaded.module.parameters()).to_local().device.type
    out["offloaded_buffers_on"] = sorted({b.device.type for b in offloaded.module.buffers()})
    _, m_off = update(offloaded, batch, pg_loss)
    _, m_res = update(actor, batch, pg_loss)
    out["losses"] = (m_off["loss"], m_res["loss"])
    out["weight_gap"] = max(
        float((a.cpu() - b.cpu()).abs().max())
        for (_, a), (_, b) in zip(full_state_dict(offloaded), full_state_dict(actor))
    )
    return out


@pytest.mark.gpu
def test_unsharded_and_offloaded_roles_on_a_gpu(checkpoints):
    out = run_distributed(_gpu_roles_worker, 1, checkpoints["qwen2-untied-split"])[0]
    assert out["devices"] == [["cuda"], ["cuda"]]
    assert out["logprob_gap"] < 1e-5
    assert out["offloaded_on"] == "cpu" and out["offloaded_buffers_on"] == ["cuda"]
    assert out["losses"][0] == pytest.approx(out["losses"][1], rel=1e-5)
    assert out["weight_gap"] < 1e-5


# ------------------------------------------------------------------------------------ multi-rank


def _same_tensors(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ (value, dtype or presence); empty when identical."""
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]


class _CountReads:
    """Counts, while active, whole-model loads (``fsdp_sharding.load_model``) and the tensors the sharded
    loader reads from safetensors files (``get_tensor``; reading headers does not count)."""

    def __enter__(self):
        import backends.training.fsdp_sharding as fsdp_sharding
        import backends.training.sharded_loading as loading

        self.loads = self.tensors = 0
        self._saved = loading.safe_open, fsdp_sharding.load_model
        safe_open, load_model = self._saved
        counter = self

        class Counted:
            def __init__(self, *args, **kwargs):
                self._inner = safe_open(*args, **kwargs)

            def __enter__(self):
                self._handle = self._inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self._inner.__exit__(*exc)

            def get_tensor(self, name):
                counter.tensors += 1
                return self._handle.get_tensor(name)

            def get_slice(self, name):
                return self._handle.get_slice(name)

            def keys(self):
                return self._handle.keys()

        def counted_load_model(*args, **kwargs):
            counter.loads += 1
            return load_model(*args, **kwargs)

        loading.safe_open, fsdp_sharding.load_model = Counted, counted_load_model
        return self

    def __exit__(self, *exc):
        import backends.training.fsdp_sharding as fsdp_sharding
        import backends.training.sharded_loading as loading

        loading.safe_open, fsdp_sharding.load_model = self._saved


def _compare_actor(path, env, mesh, rank, world_size, fsdp_cfg):
    from backends.training.fsdp import build_actor, compute_logprobs, full_state_dict, update

    old_cfg = attrs.evolve(fsdp_cfg, load_on_every_rank=True)
    with _CountReads() as reads:
        new = build_actor(path, env, OPTIM, fsdp_cfg, mesh=mesh)
    old = build_actor(path, env, OPTIM, old_cfg, mesh=mesh)
    out = {
        "weights": _same_tensors(dict(full_state_dict(new)), dict(full_state_dict(old))),
        "reads": (reads.loads, reads.tensors),
        "num_params": len(list(new.module.parameters())),
        "buffers": _same_tensors(dict(new.module.named_buffers()), dict(old.module.named_buffers())),
        "sharded": {type(p).__name__ for p in new.module.parameters()},
        "requires_grad": all(p.requires_grad for p in new.module.parameters()),
    }
    module = new.module
    out["tied"] = module.lm_head.weight is module.model.embed_tokens.weight
    batch = make_batch(rank, world_size)
    out["logprobs"] = torch.equal(compute_logprobs(new, batch).logprobs, compute_logprobs(old, batch).logprobs)
    new, m_new = update(new, batch, pg_loss)
    old, m_old = update(old, batch, pg_loss)
    out["metrics"] = m_new == m_old
    out["updated"] = _same_tensors(dict(full_state_dict(new)), dict(full_state_dict(old)))
    return out


def _compare_reference(path, env, mesh, rank, world_size, fsdp_cfg):
    from backends.training.fsdp import build_reference, compute_logprobs, full_state_dict

    old_cfg = attrs.evolve(fsdp_cfg, load_on_every_rank=True)
    with _CountReads() as reads:
        new = build_reference(path, env, fsdp_cfg, mesh=mesh)
    old = build_reference(path, env, old_cfg, mesh=mesh)
    batch = make_batch(rank, world_size, seed=1)
    return {
        "weights": _same_tensors(dict(full_state_dict(new)), dict(full_state_dict(old))),
        "reads": (reads.loads, reads.tensors),
        "num_params": len(list(new.module.parameters())),
        "buffers": _same_tensors(dict(new.module.named_buffers()), dict(old.module.named_buffers())),
        "frozen": not any(p.requires_grad for p in new.module.parameters()),
        "dtype": {p.dtype for p in new.module.parameters()},
        "logprobs": torch.equal(compute_logprobs(new, batch).logprobs, compute_logprobs(old, batch).logprobs),
    }


def _two_rank_worker(rank, world_size, checkpoints):
    from backends.distributed.setup import device_mesh, init_distributed

    env = init_distributed()
    mesh = device_mesh(env)
    out = {}
    for name, path in checkpoints.items():
        out[name] = {
            "actor": _compare_actor(path, env, mesh, rank, world_size, FSDPConfig(micro_batch_size=2)),
            "reference": _compare_reference(path, env, mesh, rank, world_size, FSDPConfig()),
        }
    # the engine's changes before sharding (checkpointing, packed attention) and a bf16 reference
    path = checkpoints["qwen2-untied-split"]
    out["checkpointed-packed"] = {
        "actor": _compare_actor(
            path, env, mesh, rank, world_size, FSDPConfig(gradient_checkpointing=True, use_remove_padding=True)
        )
    }
    out["bf16-reference"] = {
        "reference": _compare_reference(path, env, mesh, rank, world_size, FSDPConfig(param_dtype="bfloat16"))
    }
    return out


def _pool_worker(rank, world_size, path):
    """A mesh over global ranks 1 and 2 only (a role's pool under split placement): its first rank, which
    reads the checkpoint, is global rank 1, and the shards travel over the pool's own group."""
    from torch.distributed.device_mesh import DeviceMesh

    from backends.distributed.setup import DistEnv, init_distributed

    world = init_distributed()
    mesh = DeviceMesh("cpu", torch.tensor([1, 2]), mesh_dim_names=("dp",))  # collective over the world
    if rank == 0:
        return None
    env = DistEnv(
        rank=rank - 1,
        world_size=2,
        local_rank=world.local_rank,
        device=world.device,
        backend=world.backend,
        group=mesh.get_group(),
    )
    return {"actor": _compare_actor(path, env, mesh, rank - 1, 2, FSDPConfig(micro_batch_size=2))}


def _assert_identical(result: dict, *, first: bool) -> None:
    """The new path's model equals the old one's, and it was built the new way: no whole-model load on
    any rank; the mesh's first rank read each parameter's tensor once (tied ones once), the others none."""
    for role, checks in result.items():
        loads, tensors = checks["reads"]
        assert loads == 0, role
        assert tensors == (checks["num_params"] if first else 0), (role, tensors)
        assert checks["weights"] == [] and checks["buffers"] == [], (role, checks)
        assert checks["logprobs"] is True, role
        if role == "actor":
            assert checks["sharded"] == {"DTensor"} and checks["requires_grad"]
            assert checks["metrics"] is True and checks["updated"] == [], checks
        else:
            assert checks["frozen"]


@pytest.fixture(scope="module")
def two_ranks(checkpoints):
    return run_distributed(_two_rank_worker, 2, checkpoints)


@pytest.mark.distributed
@pytest.mark.parametrize("case", [*CASES, "checkpointed-packed", "bf16-reference"])
def test_sharded_loading_equals_loading_on_every_rank(two_ranks, case):
    """Same full weights, buffers, log-probs and one identical update as the model loaded on every rank."""
    for rank, rank_result in enumerate(two_ranks):
        _assert_identical(rank_result[case], first=rank == 0)


@pytest.mark.distributed
def test_tied_embeddings_stay_tied(two_ranks):
    for rank_result in two_ranks:
        assert rank_result["qwen2-tied"]["actor"]["tied"] and rank_result["llama-tied-split"]["actor"]["tied"]
        assert not rank_result["qwen2-untied-split"]["actor"]["tied"]


@pytest.mark.distributed
def test_bf16_reference_is_stored_in_bf16(two_ranks):
    assert all(r["bf16-reference"]["reference"]["dtype"] == {torch.bfloat16} for r in two_ranks)


@pytest.mark.distributed
def test_a_pool_of_ranks_loads_from_its_own_first_rank(checkpoints):
    results = run_distributed(_pool_worker, 3, checkpoints["llama-untied"])
    assert results[0] is None
    for rank, rank_result in enumerate(results[1:], start=1):
        _assert_identical(rank_result, first=rank == 1)

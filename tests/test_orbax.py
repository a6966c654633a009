"""backends.checkpoint.orbax: the full train state through orbax-checkpoint equals the DCP state exactly.

In this process: plain (unsharded) tiny models in fp32 and bf16 with a stepped AdamW, the tree layout
JAX users see, and bad input. On 2 real gloo ranks: an FSDP2 actor saved with DCP and with orbax;
loading either one into a fresh sharded actor gives bit-identical model and optimizer state, and the
orbax arrays equal the DCP state's full tensors.
"""

from __future__ import annotations

import copy
import functools

import attrs
import numpy as np
import pytest
import torch

pytest.importorskip("orbax.checkpoint")

from backends.checkpoint.orbax import (  # noqa: E402
    load_orbax,
    read_orbax,
    save_orbax,
    to_numpy,
    to_torch,
    tree_to_torch,
)
from backends.models import TinyModelConfig, build_tiny_model  # noqa: E402
from backends.training.optim import OptimConfig  # noqa: E402
from tests.checkpoint_state import State
from tests.distributed import run_distributed  # noqa: E402

pytestmark = pytest.mark.checkpoint

TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_position_embeddings=64, seed=1
)


@functools.lru_cache(maxsize=None)
def _built(seed: int, dtype: torch.dtype, train_steps: int):
    model = build_tiny_model(attrs.evolve(TINY, seed=seed)).to(dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(seed)
    for _ in range(train_steps):
        ids = torch.randint(4, 60, (2, 6), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def make_state(seed: int = 1, dtype: torch.dtype = torch.float32, train_steps: int = 1, step: int = 0) -> State:
    model, opt = copy.deepcopy(_built(seed, dtype, train_steps))
    return State(model, opt, step)


def snapshot(state: State) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in state.module.state_dict().items()}
    names = {p: n for n, p in state.module.named_parameters()}
    for p, s in state.optimizer.state.items():
        for k, v in s.items():
            out[f"optim/{names[p]}/{k}"] = v.detach().clone()
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# --------------------------------------------------------------------------------------- one process


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_exact(tmp_path, dtype):
    state = make_state(dtype=dtype, step=5)
    path = save_orbax(state, tmp_path / "orbax")
    fresh = make_state(seed=4, dtype=dtype, train_steps=2)
    fresh.optimizer.param_groups[0]["lr"] = 1e-3
    loaded = load_orbax(fresh, path)
    assert loaded.step == 5 and loaded.module is fresh.module
    assert_same(snapshot(loaded), snapshot(state))
    assert fresh.optimizer.param_groups[0]["lr"] == 1e-2
    assert fresh.optimizer.param_groups[0]["betas"] == (0.9, 0.95)  # a tuple again


def test_tree_layout_for_jax(tmp_path):
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    state = make_state(dtype=torch.bfloat16, step=3)
    tree, meta = read_orbax(save_orbax(state, tmp_path / "orbax"))
    assert sorted(tree) == ["opt_state", "params", "step"] and int(tree["step"]) == 3
    layer0 = tree["params"]["model"]["layers"]["0"]  # string keys, nested by the parameter names' dots
    w = layer0["mlp"]["up_proj"]["weight"]
    assert isinstance(w, np.ndarray) and w.dtype == ml_dtypes.bfloat16 and w.shape == (128, 64)
    assert np.array_equal(w.view(np.int16), to_numpy(state.module.model.layers[0].mlp.up_proj.weight).view(np.int16))
    assert sorted(tree["opt_state"]) == ["exp_avg", "exp_avg_sq", "step"]
    assert tree["opt_state"]["exp_avg"]["model"]["norm"]["weight"].shape == (64,)
    assert meta["optimizer_class"] == "AdamW" and meta["param_groups"][0]["betas"] == [0.9, 0.95]
    params = jax.tree.map(jnp.asarray, tree["params"])
    assert params["model"]["embed_tokens"]["weight"].dtype == jnp.bfloat16
    model_sd, optim, step = tree_to_torch(tree)
    assert step == 3 and torch.equal(model_sd["model.norm.weight"], state.module.model.norm.weight.detach())
    assert set(optim["model.norm.weight"]) == {"exp_avg", "exp_avg_sq", "step"}


def test_numpy_conversion_is_bit_exact():
    x = torch.randn(7, 3).to(torch.bfloat16)
    assert torch.equal(to_torch(to_numpy(x)), x) and to_torch(to_numpy(x)).dtype == torch.bfloat16
    y = torch.tensor([1.5, float("nan"), -0.0], dtype=torch.float64)
    assert torch.equal(to_torch(to_numpy(y)).view(torch.int64), y.view(torch.int64))


def test_never_stepped_optimizer(tmp_path):
    state = make_state(train_steps=0)
    tree, meta = read_orbax(save_orbax(state, tmp_path / "orbax"))
    assert "opt_state" not in tree and meta["optimizer_state"] == "empty"
    assert len(state.optimizer.state) == 0  # saving did not initialise it
    used = make_state(seed=3)
    load_orbax(used, tmp_path / "orbax")
    assert len(used.optimizer.state) == 0
    assert torch.equal(used.module.model.norm.weight, state.module.model.norm.weight)


def test_bad_input(tmp_path):
    import orbax.checkpoint as ocp

    state = make_state()
    path = save_orbax(state, tmp_path / "orbax")
    with pytest.raises(FileExistsError, match="already exists.*overwrite=True"):
        save_orbax(state, path)
    save_orbax(make_state(seed=2), path, overwrite=True)
    assert torch.equal(
        load_orbax(make_state(), path).module.model.norm.weight, make_state(seed=2).module.model.norm.weight
    )
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_orbax(make_state(), tmp_path / "nothing")
    with ocp.PyTreeCheckpointer() as ck:
        ck.save((tmp_path / "foreign").absolute(), args=ocp.args.PyTreeSave({"w": np.zeros(2)}))
    with pytest.raises(ValueError, match="not an rlfunc train state"):
        load_orbax(make_state(), tmp_path / "foreign")
    other = State(build_tiny_model(attrs.evolve(TINY, intermediate_size=96)), None)
    with pytest.raises(
        ValueError,
        match=r"another model:\n  shape of model.layers.0.mlp.down_proj.weight: "
        r"checkpoint \(64, 128\), model \(64, 96\)",
    ):
        load_orbax(other, path)
    save_orbax(State(state.module, None), tmp_path / "no_optim")
    with pytest.raises(ValueError, match="no optimizer state"):
        load_orbax(make_state(), tmp_path / "no_optim")
    sgd = State(state.module, torch.optim.SGD(state.module.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="saved with optimizer AdamW.*uses SGD"):
        load_orbax(sgd, path)


# --------------------------------------------------------------------------------------- 2 ranks, FSDP2


def _pg_loss(outputs, mb, norms):
    from rlfunc.aggregation import aggregate

    return aggregate(-mb.advantages * outputs.logprobs, mb.response_mask, mode="token-mean", norms=norms), {}


def _batch(seed: int):
    from rlfunc.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    return RolloutBatch(
        prompt_ids=torch.randint(4, 60, (4, 4), generator=g),
        prompt_mask=torch.ones(4, 4, dtype=torch.bool),
        response_ids=torch.randint(4, 60, (4, 5), generator=g),
        response_mask=torch.ones(4, 5, dtype=torch.bool),
        group_ids=torch.arange(4),
        advantages=torch.randn(4, 5, generator=g),
    )


def _full(state) -> dict[str, np.ndarray]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(state.module, [state.optimizer], options=StateDictOptions(full_state_dict=True))
    out = {f"params.{k}": to_numpy(v) for k, v in msd.items()}
    for fqn, entries in osd["state"].items():
        out.update({f"opt_state.{k}.{fqn}": to_numpy(v) for k, v in entries.items()})
    return out


def _orbax_worker(rank: int, world_size: int, model_dir: str, root: str) -> dict:
    from backends.checkpoint.dcp import load_checkpoint, save_checkpoint
    from backends.distributed.setup import init_distributed
    from backends.training.fsdp import build_actor, update

    env = init_distributed()
    optim = OptimConfig(lr=1e-3, eps=1e-6)
    actor = build_actor(model_dir, env, optim)
    for i in range(2):
        actor, _ = update(actor, _batch(i + 10 * rank), _pg_loss)
    dcp_path = save_checkpoint(f"{root}/dcp", actor.step, {"actor": actor})
    orbax_path = save_orbax(actor, f"{root}/orbax")
    from_dcp = load_checkpoint(dcp_path, {"actor": build_actor(model_dir, env, optim)})[0]["actor"]
    from_orbax = load_orbax(build_actor(model_dir, env, optim), orbax_path)
    return {
        "orbax_path": str(orbax_path),
        "dcp": _full(from_dcp),
        "orbax": _full(from_orbax),
        "steps": (from_dcp.step, from_orbax.step),
    }


@pytest.mark.distributed
def test_fsdp_orbax_equals_dcp(tmp_path):
    from backends.models import write_tiny_model

    model_dir = str(write_tiny_model(tmp_path / "model", TINY))
    results = run_distributed(_orbax_worker, 2, model_dir, str(tmp_path))
    for r in results:
        assert r["steps"] == (2, 2)
        assert r["dcp"].keys() == r["orbax"].keys()
        for k in r["dcp"]:
            assert r["dcp"][k].dtype == r["orbax"][k].dtype and np.array_equal(r["dcp"][k], r["orbax"][k]), k
    tree, _ = read_orbax(results[0]["orbax_path"])
    flat = {f"params.{k}": v for k, v in tree_to_torch(tree)[0].items()}
    flat.update(
        {f"opt_state.{key}.{fqn}": v for fqn, entries in tree_to_torch(tree)[1].items() for key, v in entries.items()}
    )
    assert flat.keys() == results[0]["dcp"].keys()
    for k, v in flat.items():
        assert np.array_equal(to_numpy(v), results[0]["dcp"][k]), k

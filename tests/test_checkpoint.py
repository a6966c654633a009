"""backends.checkpoint.dcp: DCP round trips, atomic saves that survive crashes, retention, resume, bad input.

Most checks run in this process on a plain (unsharded) tiny HF model with no process group: the save
and load code is the same one FSDP uses (DCP over plain tensors). The FSDP2 checks (exact round trip
of sharded model + optimizer + per-rank RNG, resharding 2 -> 1, async save over 2 ranks, an exact
continuation of training after a reload) run on real gloo ranks (tests/distributed.py).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pickle
import random
import shutil
import subprocess
import sys

import attrs
import numpy as np
import pytest
import torch

import backends.checkpoint.dcp as ckpt
from backends.checkpoint.dcp import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    PendingCheckpoint,
    checkpoint_info,
    flatten_config,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from backends.models import TinyModelConfig, build_tiny_model
from backends.training.optim import OptimConfig
from tests.checkpoint_state import State
from tests.distributed import run_distributed

pytestmark = pytest.mark.checkpoint

TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_position_embeddings=64, seed=1
)
OTHER_SHAPES = attrs.evolve(TINY, intermediate_size=96)
OTHER_LAYERS = attrs.evolve(TINY, num_layers=3)


@functools.lru_cache(maxsize=None)
def _built(cfg: TinyModelConfig, seed: int, train_steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_tiny_model(attrs.evolve(cfg, seed=seed)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(seed)
    for _ in range(train_steps):
        ids = torch.randint(4, 60, (2, 6), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def make_state(cfg: TinyModelConfig = TINY, *, seed: int = 1, train_steps: int = 1, step: int = 0) -> State:
    """A fresh copy of a tiny HF model (+ AdamW after ``train_steps`` steps); built once per arguments."""
    model, opt = copy.deepcopy(_built(cfg, seed, train_steps))
    return State(model, opt, step)


def make_small_state(seed: int = 0) -> State:
    """A two-layer MLP with a stepped AdamW (for child processes: no transformers import)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return State(model, opt)


def snapshot(state: State) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in state.module.state_dict().items()}
    if state.optimizer is not None:
        names = {p: n for n, p in state.module.named_parameters()}
        for p, s in state.optimizer.state.items():
            for k, v in s.items():
                out[f"optim/{names[p]}/{k}"] = v.detach().clone()
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


EXTRA = {
    "step": 7,
    "data_position": 123,
    "kl_ctrl": {"value": torch.tensor(0.05, dtype=torch.float64), "history": torch.arange(5, dtype=torch.int64)},
    "bf16": torch.randn(3, 2).to(torch.bfloat16),
    "lr_note": "constant",
    "flags": [True, None, 1.5, [2, "x"]],
}


def assert_extra_equal(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys()
        for k in want:
            assert_extra_equal(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, list) and len(got) == len(want)
        for x, y in zip(got, want):
            assert_extra_equal(x, y)
    else:
        assert got == want and type(got) is type(want)


# --------------------------------------------------------------------------------- round trips (1 process)


def test_round_trip_model_optimizer_extra_exact(tmp_path):
    state = make_state(train_steps=2, step=7)
    before = snapshot(state)
    path = save_checkpoint(tmp_path, 7, {"actor": state}, EXTRA, config={"algo": "grpo"})
    assert path == tmp_path / "step_7"
    assert sorted(os.listdir(path)) == [".metadata", "COMPLETE", "__0_0.distcp", "rng"]

    fresh = make_state(seed=5, train_steps=1)
    states, extra = load_checkpoint(path, {"actor": fresh}, config={"algo": "grpo"})
    assert states["actor"].step == 7 and fresh.step == 0  # a new state object; the old one is not mutated
    assert states["actor"].module is fresh.module  # weights were loaded in place
    assert_same(snapshot(states["actor"]), before)
    assert_extra_equal(extra, EXTRA)
    group = states["actor"].optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.95) and isinstance(group["betas"], tuple)
    assert group["lr"] == 1e-2 and group["weight_decay"] == 0.1

    marker = json.loads((path / "COMPLETE").read_text())
    assert marker["step"] == 7 and marker["world_size"] == 1 and marker["states"]["actor"]["model_type"] == "qwen2"
    assert marker["config_hash"] == ckpt.config_hash({"algo": "grpo"})


def test_training_continues_identically_after_reload(tmp_path):
    a = make_state(train_steps=2)
    path = save_checkpoint(tmp_path, 2, {"actor": a})
    b = load_checkpoint(path, {"actor": make_state(seed=9, train_steps=3)})[0]["actor"]
    ids = torch.randint(4, 60, (2, 6), generator=torch.Generator().manual_seed(3))
    for s in (a, b):
        s.module(input_ids=ids, labels=ids).loss.backward()
        s.optimizer.step()
    assert_same(snapshot(a), snapshot(b))


def test_rng_states_restored(tmp_path):
    state = make_state()
    random.seed(11), np.random.seed(12), torch.manual_seed(13)
    random.random(), np.random.rand(), torch.randn(3), np.random.randn()  # numpy keeps a cached gaussian
    path = save_checkpoint(tmp_path, 1, {"actor": state})
    want = (random.random(), np.random.rand(), np.random.randn(), torch.randn(4))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    load_checkpoint(path, {"actor": state})
    got = (random.random(), np.random.rand(), np.random.randn(), torch.randn(4))
    assert got[:3] == want[:3] and torch.equal(got[3], want[3])
    torch.manual_seed(0)
    load_checkpoint(path, {"actor": state}, restore_rng=False)
    assert not torch.equal(torch.randn(4), want[3])


def test_never_stepped_optimizer_stays_empty(tmp_path):
    """DCP's get_state_dict would step an empty AdamW (step counter 1): the save must not do that."""
    state = make_state(train_steps=0)
    path = save_checkpoint(tmp_path, 0, {"actor": state})
    assert len(state.optimizer.state) == 0
    assert json.loads((path / "COMPLETE").read_text())["states"]["actor"]["optimizer"] == "empty"
    used = make_state(seed=3, train_steps=1)
    load_checkpoint(path, {"actor": used})
    assert len(used.optimizer.state) == 0
    assert_same(snapshot(used), snapshot(state))


def test_several_states_and_loading_a_subset(tmp_path):
    actor, critic = make_state(seed=1), make_state(OTHER_SHAPES, seed=2, step=4)
    path = save_checkpoint(tmp_path, 4, {"actor": actor, "critic": critic})
    assert checkpoint_info(path).state_names == ("actor", "critic")
    fresh_critic = make_state(OTHER_SHAPES, seed=8)
    states, _ = load_checkpoint(path, {"critic": fresh_critic})
    assert list(states) == ["critic"] and states["critic"].step == 4
    assert_same(snapshot(fresh_critic), snapshot(critic))
    with pytest.raises(CheckpointMismatchError, match=r"no state named 'reward'.*holds: 'actor', 'critic'"):
        load_checkpoint(path, {"reward": make_state()})


def test_state_without_optimizer_loads_the_model_only(tmp_path):
    actor = make_state()
    path = save_checkpoint(tmp_path, 1, {"actor": actor})
    ref = State(build_tiny_model(attrs.evolve(TINY, seed=4)), None)
    load_checkpoint(path, {"actor": ref})
    for k, v in ref.module.state_dict().items():
        assert torch.equal(v, actor.module.state_dict()[k])
    # ... but an optimizer cannot be filled from a checkpoint that has none
    path2 = save_checkpoint(tmp_path, 2, {"actor": ref})
    with pytest.raises(CheckpointMismatchError, match="no optimizer state"):
        load_checkpoint(path2, {"actor": make_state()})


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's note, from its writer thread
def test_async_save_without_process_group(tmp_path):
    state = make_state(step=3)
    before = snapshot(state)
    pending = save_checkpoint(tmp_path, 3, {"actor": state}, {"pos": 1}, async_save=True)
    assert isinstance(pending, PendingCheckpoint)
    # the state is staged: training may go on while the files are written
    for p in state.module.parameters():
        p.data.add_(1.0)
    assert pending.wait() == tmp_path / "step_3" and pending.done()
    fresh = make_state(seed=6)
    states, extra = load_checkpoint(tmp_path / "step_3", {"actor": fresh})
    assert_same(snapshot(fresh), before) and extra == {"pos": 1}
    # a second async save waits for nothing; the next save / load waits for it by itself
    pending = save_checkpoint(tmp_path, 4, {"actor": state}, async_save=True)
    assert latest_checkpoint(tmp_path) in (tmp_path / "step_3", tmp_path / "step_4")
    save_checkpoint(tmp_path, 5, {"actor": state})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_3", "step_4", "step_5"]


# --------------------------------------------------------------------------- atomicity, retention, resume


def test_crash_before_rename_keeps_previous_checkpoint(tmp_path, monkeypatch):
    state = make_state()
    good = save_checkpoint(tmp_path, 1, {"actor": state}, {"pos": 1})

    def boom(*args, **kwargs):
        raise OSError("simulated crash after the shards were written")

    monkeypatch.setattr(ckpt, "commit_checkpoint", boom)
    with pytest.raises(CheckpointError, match="failed: OSError: simulated crash.*temp dir step_2.tmp-.* was removed"):
        save_checkpoint(tmp_path, 2, {"actor": state}, {"pos": 2})
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]  # the failed save's temp dir is gone (its space too)
    assert latest_checkpoint(tmp_path) == good == resolve_resume("auto", tmp_path)
    assert load_checkpoint(good, {"actor": make_state(seed=3)})[1] == {"pos": 1}
    save_checkpoint(tmp_path, 3, {"actor": state})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_3"]  # the temp dir was cleaned


def test_crash_during_dcp_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    state = make_state()
    good = save_checkpoint(tmp_path, 5, {"actor": state})

    def failing_save(*args, **kwargs):
        raise RuntimeError("simulated I/O error while writing shards")

    monkeypatch.setattr(dcp, "save", failing_save)
    with pytest.raises(CheckpointError, match="RuntimeError: simulated I/O error"):
        save_checkpoint(tmp_path, 6, {"actor": state})
    assert latest_checkpoint(tmp_path) == good


_KILLED_CHILD = """
import os, sys, torch
import backends.checkpoint.dcp as ckpt
from tests.test_checkpoint import make_small_state
state = make_small_state()
ckpt.save_checkpoint(sys.argv[1], 1, {"actor": state}, {"pos": 1})
for p in state.module.parameters():
    p.data.add_(1.0)
ckpt.commit_checkpoint = lambda *args, **kwargs: os._exit(17)  # killed after the shards, before COMPLETE + rename
ckpt.save_checkpoint(sys.argv[1], 2, {"actor": state}, {"pos": 2})
"""


def test_process_killed_mid_save_keeps_previous_checkpoint(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_CHILD, str(tmp_path)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 17, proc.stderr
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1"
    assert any(p.name.startswith("step_2.tmp-") for p in tmp_path.iterdir())
    fresh = make_small_state(seed=2)
    _, extra = load_checkpoint(tmp_path / "step_1", {"actor": fresh})
    assert extra == {"pos": 1}
    assert_same(snapshot(fresh), snapshot(make_small_state()))  # step 1's weights, not the +1 ones


def test_stale_temp_dir_is_ignored_and_cleaned(tmp_path):
    state = make_state()
    (tmp_path / "step_9.tmp-0123abcd").mkdir(parents=True)
    (tmp_path / "step_9.tmp-0123abcd" / "__0_0.distcp").write_bytes(b"half written")
    (tmp_path / "step_8").mkdir()  # a step dir without COMPLETE (e.g. copied by hand, half done)
    assert latest_checkpoint(tmp_path) is None and resolve_resume("auto", tmp_path) is None
    save_checkpoint(tmp_path, 2, {"actor": state})
    assert not (tmp_path / "step_9.tmp-0123abcd").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_2"


def test_retention_keeps_newest_k(tmp_path):
    state = make_state()
    for step in (1, 2, 3, 10, 11):
        save_checkpoint(tmp_path, step, {"actor": state}, keep_last=3)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_3", "step_10", "step_11"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10", "step_11", "step_3"]  # nothing else left
    save_checkpoint(tmp_path, 12, {"actor": state})  # keep_last=None keeps everything
    assert len(list_checkpoints(tmp_path)) == 4


def test_latest_and_resume_semantics(tmp_path):
    state = make_state()
    assert latest_checkpoint(tmp_path / "nothing_here") is None
    assert resolve_resume("auto", tmp_path / "nothing_here") is None  # start fresh
    for step in (9, 10, 2):
        save_checkpoint(tmp_path, step, {"actor": state})
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10"  # numeric, not lexicographic order
    assert resolve_resume("auto", tmp_path) == tmp_path / "step_10"
    assert resolve_resume(True, tmp_path) == tmp_path / "step_10"
    for off in (None, False, "", "never", "none"):
        assert resolve_resume(off, tmp_path) is None
    assert resolve_resume(str(tmp_path / "step_2")) == tmp_path / "step_2"
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        resolve_resume(str(tmp_path / "step_3"))
    with pytest.raises(CheckpointCorruptError, match="checkpoint root.*step_10.*resume='auto'"):
        resolve_resume(str(tmp_path))
    with pytest.raises(ValueError, match="ckpt_dir"):
        resolve_resume("auto")


def test_saving_a_step_again_replaces_it(tmp_path):
    a, b = make_state(seed=1), make_state(seed=2)
    save_checkpoint(tmp_path, 3, {"actor": a})
    save_checkpoint(tmp_path, 3, {"actor": b})
    fresh = make_state(seed=7)
    load_checkpoint(tmp_path / "step_3", {"actor": fresh})
    assert_same(snapshot(fresh), snapshot(b))
    assert [p.name for p in tmp_path.iterdir()] == ["step_3"]


# -------------------------------------------------------------------------------------------- bad input


@pytest.fixture
def saved(tmp_path):
    state = make_state()
    path = save_checkpoint(tmp_path, 1, {"actor": state}, config={"actor.lr": 1e-6, "algo": "grpo", "n": 8})
    return path, state


def _unchanged(state: State, before: dict) -> None:
    assert_same(snapshot(state), before)


def test_missing_dir(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "step_4", {"actor": make_state()})
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointNotFoundError, match="not a directory"):
        load_checkpoint(tmp_path / "file", {"actor": make_state()})


def test_corrupt_dirs(saved, tmp_path):
    path, _ = saved
    target = make_state(seed=3)
    before = snapshot(target)
    broken = tmp_path / "no_marker"
    shutil.copytree(path, broken)
    (broken / "COMPLETE").unlink()
    with pytest.raises(CheckpointCorruptError, match="no COMPLETE marker"):
        load_checkpoint(broken, {"actor": target})
    shutil.copytree(path, tmp_path / "no_metadata")
    (tmp_path / "no_metadata" / ".metadata").unlink()
    with pytest.raises(CheckpointCorruptError, match="no DCP .metadata"):
        load_checkpoint(tmp_path / "no_metadata", {"actor": target})
    shutil.copytree(path, tmp_path / "bad_json")
    (tmp_path / "bad_json" / "COMPLETE").write_text("{not json")
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        load_checkpoint(tmp_path / "bad_json", {"actor": target})
    shutil.copytree(path, tmp_path / "other_format")
    (tmp_path / "other_format" / "COMPLETE").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointCorruptError, match="not an rlfunc checkpoint"):
        load_checkpoint(tmp_path / "other_format", {"actor": target})
    _unchanged(target, before)


def test_metadata_is_never_unpickled_beyond_dcp_classes(saved, tmp_path):
    path, _ = saved
    evil = tmp_path / "evil"
    shutil.copytree(path, evil)
    flag = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {flag}",))

    (evil / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointCorruptError, match="refusing to load posix.system"):
        load_checkpoint(evil, {"actor": make_state()})
    assert not flag.exists()


@pytest.mark.parametrize(
    "other, what",
    [
        (OTHER_SHAPES, "shape of model.layers.0.mlp"),
        (OTHER_LAYERS, "in the model but not in the checkpoint: model.layers.2"),
    ],
)
def test_checkpoint_of_another_model(saved, other, what):
    path, _ = saved
    target = make_state(other, seed=3)
    before = snapshot(target)
    with pytest.raises(CheckpointMismatchError, match="state 'actor' is of another model") as err:
        load_checkpoint(path, {"actor": target})
    assert what in str(err.value)
    _unchanged(target, before)


def test_same_shapes_other_model_config_warns(saved):
    path, state = saved
    target = make_state(attrs.evolve(TINY, rope_theta=5e5), seed=3)
    with pytest.warns(UserWarning, match=r"model config differs in 1 key\(s\):\n  rope.*10000.0.*500000.0"):
        load_checkpoint(path, {"actor": target})
    assert_same(snapshot(target), snapshot(state))  # the weights fit, so they were loaded


def test_incompatible_config_names_the_keys(saved):
    path, _ = saved
    target = make_state(seed=3)
    before = snapshot(target)
    with pytest.raises(CheckpointMismatchError, match="2 key") as err:
        load_checkpoint(path, {"actor": target}, config={"actor.lr": 1e-5, "algo": "grpo", "n": 8, "new_key": 1})
    msg = str(err.value)
    assert "actor.lr: checkpoint 1e-06, now 1e-05" in msg and "new_key: checkpoint <not set>, now 1" in msg
    assert "algo" not in msg
    _unchanged(target, before)
    load_checkpoint(path, {"actor": target}, config={"algo": "grpo", "actor": {"lr": 1e-6}, "n": 8})  # nested ok
    load_checkpoint(path, {"actor": make_state()})  # config=None: no check


def test_other_optimizer_class(saved):
    path, _ = saved
    state = make_state()
    sgd = State(state.module, torch.optim.SGD(state.module.parameters(), lr=0.1))
    with pytest.raises(CheckpointMismatchError, match="saved with optimizer AdamW.*uses SGD"):
        load_checkpoint(path, {"actor": sgd})


def test_bad_save_arguments(tmp_path):
    state = make_state(train_steps=0)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        save_checkpoint(tmp_path, -1, {"actor": state})
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, 1, {"actor": state}, keep_last=0)
    with pytest.raises(ValueError, match="non-empty dict"):
        save_checkpoint(tmp_path, 1, {})
    with pytest.raises(ValueError, match="state name 'a/b'"):
        save_checkpoint(tmp_path, 1, {"a/b": state})
    with pytest.raises(TypeError, match="no .module"):
        save_checkpoint(tmp_path, 1, {"actor": object()})
    with pytest.raises(TypeError, match=r"extra\['kl'\] has a int key 3; keys must be str"):
        save_checkpoint(tmp_path, 1, {"actor": state}, {"kl": {3: 1.0}})
    with pytest.raises(TypeError, match=r"extra\['arr'\] is a ndarray.*convert arrays to tensors"):
        save_checkpoint(tmp_path, 1, {"actor": state}, {"arr": np.zeros(3)})
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # rejected before anything was written


def test_flatten_config():
    flat = flatten_config({"actor": {"optim": OptimConfig(lr=1e-5)}, "n": 8, "dtype": torch.bfloat16})
    assert flat["actor.optim.lr"] == 1e-5 and flat["actor.optim.betas"] == [0.9, 0.999]
    assert flat["n"] == 8 and flat["dtype"] == "torch.bfloat16"
    assert ckpt.config_hash(flat) == ckpt.config_hash(dict(reversed(list(flat.items()))))
    with pytest.raises(TypeError, match="config must be a mapping"):
        flatten_config([1, 2])


def test_the_whole_api_is_importable_from_dcp():
    """The errors, listing, fingerprint and RNG helpers live in modules of their own; backends.checkpoint.dcp
    re-exports every public name, the same objects."""
    import backends.checkpoint.errors as errors
    import backends.checkpoint.files as files
    import backends.checkpoint.fingerprint as fingerprint
    import backends.checkpoint.rng as rng

    homes = {name: module for module in (errors, files, fingerprint, rng) for name in module.__all__}
    for name in ckpt.__all__:
        assert hasattr(ckpt, name), name
        if name in homes:
            assert getattr(ckpt, name) is getattr(homes[name], name), name


# ------------------------------------------------------------------------------------------ FSDP2, 2 ranks

FSDP_OPTIM = OptimConfig(lr=1e-3, eps=1e-6)


def _batch(seed: int, rows: int = 4):
    from rlfunc.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    p, t = 4, 5
    return RolloutBatch(
        prompt_ids=torch.randint(4, 60, (rows, p), generator=g),
        prompt_mask=torch.ones(rows, p, dtype=torch.bool),
        response_ids=torch.randint(4, 60, (rows, t), generator=g),
        response_mask=torch.arange(t)[None, :] < torch.randint(1, t + 1, (rows, 1), generator=g),
        group_ids=torch.arange(rows),
        advantages=torch.randn(rows, t, generator=g),
    )


def _pg_loss(outputs, mb, norms):
    from rlfunc.aggregation import aggregate

    return aggregate(-mb.advantages * outputs.logprobs, mb.response_mask, mode="token-mean", norms=norms), {}


def _full_snapshot(state) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(state.module, [state.optimizer], options=options)
    out = {f"model/{k}": v.clone() for k, v in msd.items()}
    out.update({f"optim/{k}": v.clone() for k, v in osd.items() if isinstance(v, torch.Tensor)})
    return out


def _np(tree):
    """Tensors -> numpy for the trip back to the parent (shared-memory tensors die with the worker)."""
    if isinstance(tree, dict):
        return {k: _np(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_np(v) for v in tree)
    return tree.detach().cpu().numpy().copy() if isinstance(tree, torch.Tensor) else tree


def _pt(tree):
    if isinstance(tree, dict):
        return {k: _pt(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_pt(v) for v in tree)
    return torch.from_numpy(tree) if isinstance(tree, np.ndarray) else tree


def _fsdp_worker(rank: int, world_size: int, model_dir: str, ckpt_dir: str) -> dict:
    from backends.distributed.setup import init_distributed
    from backends.training.fsdp import build_actor, update

    env = init_distributed()
    actor = build_actor(model_dir, env, FSDP_OPTIM)
    for i in range(2):
        actor, _ = update(actor, _batch(10 * i + rank), _pg_loss)
    kl = torch.tensor([0.1, 0.2])
    torch.manual_seed(100 + rank)  # per-rank RNG streams
    random.seed(200 + rank)
    path = save_checkpoint(
        ckpt_dir,
        actor.step,
        {"actor": actor},
        {"step": actor.step, "data_position": 64, "kl": kl},
        keep_last=2,
        config={"world": "any"},
    )
    saved = _full_snapshot(actor)
    draws = (torch.rand(3), random.random())

    fresh = build_actor(model_dir, env, FSDP_OPTIM)
    torch.manual_seed(0), random.seed(0)
    states, extra = load_checkpoint(path, {"actor": fresh}, config={"world": "any"})
    loaded = _full_snapshot(states["actor"])
    redraws = (torch.rand(3), random.random())

    # one more update from the original and from the reloaded state: identical results
    actor, m1 = update(actor, _batch(99 + rank), _pg_loss)
    reloaded, m2 = update(states["actor"], _batch(99 + rank), _pg_loss)
    after = (_full_snapshot(actor), _full_snapshot(reloaded))

    # async save over the dedicated gloo group, renamed once rank 0's write completes
    pending = save_checkpoint(
        ckpt_dir, actor.step, {"actor": actor}, {"step": actor.step}, keep_last=2, async_save=True
    )
    actor, _ = update(actor, _batch(7 + rank), _pg_loss)  # training goes on meanwhile
    async_path = pending.wait()
    names = [p.name for p in list_checkpoints(ckpt_dir)]
    return _np(
        {
            "path": str(path),
            "saved": saved,
            "loaded": loaded,
            "draws": draws,
            "redraws": redraws,
            "extra": extra,
            "step": states["actor"].step,
            "after": after,
            "losses": (m1["loss"], m2["loss"]),
            "async_path": str(async_path),
            "names": names,
        }
    )


def _reshard_worker(rank: int, world_size: int, model_dir: str, path: str) -> dict:
    from backends.distributed.setup import init_distributed
    from backends.training.fsdp import build_actor

    env = init_distributed()
    fresh = build_actor(model_dir, env, FSDP_OPTIM)
    with pytest.warns(UserWarning, match="no RNG state for rank 1") if rank == 1 else _nullcontext():
        states, extra = load_checkpoint(path, {"actor": fresh})
    return _np({"loaded": _full_snapshot(states["actor"]), "extra": extra, "step": states["actor"].step})


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    from backends.models import write_tiny_model

    root = tmp_path_factory.mktemp("ckpt_fsdp")
    model_dir = str(write_tiny_model(root / "model", TINY))
    ckpt_dir = str(root / "ckpts")
    results = _pt(run_distributed(_fsdp_worker, 2, model_dir, ckpt_dir))
    return model_dir, ckpt_dir, results


@pytest.mark.distributed
def test_fsdp_round_trip_exact_on_two_ranks(fsdp_run):
    _, _, results = fsdp_run
    for r in results:
        assert r["saved"].keys() == r["loaded"].keys()
        assert any(k.endswith("exp_avg_sq") for k in r["saved"])
        assert_same(r["loaded"], r["saved"])
        assert r["step"] == 2
        assert_extra_equal(r["extra"], {"step": 2, "data_position": 64, "kl": torch.tensor([0.1, 0.2])})
        assert r["redraws"][1] == r["draws"][1] and torch.equal(r["redraws"][0], r["draws"][0])
    assert results[0]["draws"][1] != results[1]["draws"][1]  # each rank got its own RNG back


@pytest.mark.distributed
def test_fsdp_training_continues_identically_after_reload(fsdp_run):
    for r in fsdp_run[2]:
        assert r["losses"][0] == r["losses"][1]
        assert_same(*r["after"])


@pytest.mark.distributed
def test_fsdp_async_save_and_retention(fsdp_run):
    _, ckpt_dir, results = fsdp_run
    for r in results:
        assert r["async_path"].endswith("step_3")
        assert r["names"] == ["step_2", "step_3"]
    assert checkpoint_info(results[0]["async_path"]).world_size == 2


@pytest.mark.distributed
def test_reshard_two_ranks_to_one_plain_model(fsdp_run):
    """The 2-rank FSDP checkpoint loads into this process's unsharded model and AdamW (world size 1)."""
    model_dir, _, results = fsdp_run
    from backends.models import load_causal_lm

    model, _ = load_causal_lm(model_dir)
    opt = torch.optim.AdamW(
        model.parameters(), lr=FSDP_OPTIM.lr, eps=FSDP_OPTIM.eps, weight_decay=FSDP_OPTIM.weight_decay
    )
    states, extra = load_checkpoint(results[0]["path"], {"actor": State(model, opt)})
    assert states["actor"].step == 2 and extra["data_position"] == 64
    got = {f"model/{k}": v for k, v in model.state_dict().items()}
    names = {p: n for n, p in model.named_parameters()}
    got.update({f"optim/state.{names[p]}.{k}": v for p, s in opt.state.items() for k, v in s.items()})
    assert_same(got, results[0]["saved"])


@pytest.mark.distributed
@pytest.mark.slow
def test_reshard_two_ranks_to_one_fsdp(fsdp_run):
    model_dir, _, results = fsdp_run
    (one,) = _pt(run_distributed(_reshard_worker, 1, model_dir, results[0]["path"]))
    assert_same(one["loaded"], results[0]["saved"])
    assert one["step"] == 2 and one["extra"]["data_position"] == 64


@pytest.mark.distributed
@pytest.mark.slow
def test_reshard_one_rank_to_two(tmp_path):
    from backends.models import write_tiny_model

    model_dir = str(write_tiny_model(tmp_path / "model", TINY))
    state = make_state(seed=5)  # other weights than the model dir's (seed 1)
    path = save_checkpoint(tmp_path / "ck", 0, {"actor": State(state.module, None)})
    # a 1-rank plain checkpoint has no optimizer; load just the model into a 2-rank reference-like state
    results = _pt(run_distributed(_reshard_model_worker, 2, model_dir, str(path)))
    for r in results:
        for k, v in r.items():
            assert torch.equal(v, state.module.state_dict()[k]), k


def _reshard_model_worker(rank: int, world_size: int, model_dir: str, path: str) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from backends.distributed.setup import init_distributed
    from backends.training.fsdp import build_reference

    env = init_distributed()
    ref = build_reference(model_dir, env)
    with pytest.warns(UserWarning, match="no RNG state for rank 1") if rank == 1 else _nullcontext():
        load_checkpoint(path, {"actor": ref})
    return _np(dict(get_model_state_dict(ref.module, options=StateDictOptions(full_state_dict=True))))

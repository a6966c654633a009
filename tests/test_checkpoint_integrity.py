"""Checkpoints carry a SHA-256 per tensor chunk and per other file, recorded at save and checked at load.

Damaged bytes, finite or not, are an error naming the file and the tensor before a byte reaches a model;
``resume=auto`` passes over a damaged newest checkpoint for the one before it, loudly; a cut-off RNG file is an
error naming its path even in a checkpoint without hashes. The 2-rank case runs on real gloo ranks.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from backends.checkpoint.dcp import load_checkpoint, save_checkpoint
from backends.checkpoint.errors import CheckpointCorruptError
from backends.checkpoint.integrity import damage, describe_items
from backends.checkpoint.resume import newest_whole_checkpoint
from backends.checkpoint.rng import read_rng_file
from tests.checkpoint_state import State
from tests.distributed import run_distributed

pytestmark = [pytest.mark.faults, pytest.mark.checkpoint]


def make_state(seed: int) -> State:
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    return State(module, optimizer, seed)


def overwrite(path: Path, name: str, data: bytes, world_size: int = 1) -> tuple[str, int]:
    """Write ``data`` over the middle of tensor ``name``'s bytes in the checkpoint ``path``; its file and offset."""
    item = next(i for i in describe_items(path, world_size) if i[0] == name)
    _, file, offset, length = item
    at = offset + length // 2 - len(data) // 2
    with open(path / file, "r+b") as f:
        f.seek(at)
        f.write(data)
    return file, at


def finite_floats(n: int) -> bytes:
    return struct.pack(f"<{n}f", *([0.5] * n))


def test_the_marker_records_a_hash_per_tensor_and_file(tmp_path):
    path = save_checkpoint(tmp_path, 1, {"actor": make_state(0)}, {"step": 1})
    recorded = json.loads((path / "COMPLETE").read_text())["integrity"]
    assert recorded["algorithm"] == "sha256"
    names = set(recorded["items"])
    assert {
        "actor/model/0.weight",
        "actor/optim/state.0.weight.exp_avg",
        ".metadata",
        "rng/rank_0.safetensors",
    } <= names
    assert damage(path) is None


@pytest.mark.parametrize("payload", ["finite floats", "NaN bytes"])
def test_damaged_tensor_bytes_are_named_at_load(tmp_path, payload):
    path = save_checkpoint(tmp_path, 1, {"actor": make_state(0)}, {"step": 1})
    data = finite_floats(16) if payload == "finite floats" else struct.pack("<16f", *([float("nan")] * 16))
    overwrite(path, "actor/model/0.weight", data)
    target = make_state(1)
    before = {k: v.clone() for k, v in target.module.state_dict().items()}
    with pytest.raises(
        CheckpointCorruptError,
        match=r"tensor 'actor/model/0\.weight' \(bytes \d+\.\.\d+ of '__0_0\.distcp'\) "
        r"does not match the sha256 recorded when it was saved",
    ):
        load_checkpoint(path, {"actor": target})
    for k, v in target.module.state_dict().items():  # nothing was read into the model
        assert torch.equal(v, before[k]), k


def test_a_cut_rng_file_is_named_with_or_without_hashes(tmp_path):
    path = save_checkpoint(tmp_path, 1, {"actor": make_state(0)}, {"step": 1})
    rng = path / "rng" / "rank_0.safetensors"
    rng.write_bytes(rng.read_bytes()[:100])
    with pytest.raises(CheckpointCorruptError, match=r"file 'rng/rank_0\.safetensors' does not match"):
        load_checkpoint(path, {"actor": make_state(1)})
    with pytest.raises(CheckpointCorruptError, match=rf"the RNG file '{rng}' of rank 0 cannot be read"):
        read_rng_file(path, 0)  # what a checkpoint written before hashes were recorded meets


def test_resume_auto_passes_over_a_damaged_newest_checkpoint_loudly(tmp_path, capsys):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"actor": make_state(step)}, {"step": step})
    overwrite(tmp_path / "step_3", "actor/optim/state.0.weight.exp_avg", finite_floats(4))
    assert newest_whole_checkpoint(tmp_path) == tmp_path / "step_2"
    err = capsys.readouterr().err
    assert "WARNING resume=auto: passing over a damaged checkpoint" in err
    assert "tensor 'actor/optim/state.0.weight.exp_avg'" in err and f"resuming from '{tmp_path / 'step_2'}'" in err
    states, extra = load_checkpoint(tmp_path / "step_2", {"actor": make_state(9)})
    assert extra["step"] == 2

    (tmp_path / "step_2" / "COMPLETE").write_text("{")
    overwrite(tmp_path / "step_1", "actor/model/2.bias", finite_floats(1))
    with pytest.raises(
        CheckpointCorruptError, match=r"every checkpoint in .* is damaged:\n  .*step_3.*\n  .*step_2.*\n  .*step_1"
    ):
        newest_whole_checkpoint(tmp_path)


def _two_rank_damage(rank: int, world_size: int, root: str) -> str:
    from backends.checkpoint.integrity import describe_items as items

    path = save_checkpoint(Path(root), 1, {"actor": make_state(0)}, {"step": 1})
    torch.distributed.barrier()
    if rank == 0:  # damage a chunk that rank 1 wrote and that rank 1 checks at load
        recorded = json.loads((path / "COMPLETE").read_text())["integrity"]["items"]
        assert any(file == "__1_0.distcp" for file, *_ in recorded.values())
        name = next(n for n, (file, *_rest) in recorded.items() if file == "__1_0.distcp")
        overwrite(path, name, finite_floats(1), world_size)
        assert [i[0] for i in items(path, world_size)].count(name) == 1
    torch.distributed.barrier()
    try:
        load_checkpoint(path, {"actor": make_state(1)})
    except CheckpointCorruptError as e:
        return str(e)
    return "loaded"


@pytest.mark.distributed
def test_two_ranks_record_and_check_their_shares(tmp_path):
    messages = run_distributed(_two_rank_damage, 2, str(tmp_path), timeout=120)
    assert messages[0] == messages[1] and "of '__1_0.distcp') does not match the sha256" in messages[0]

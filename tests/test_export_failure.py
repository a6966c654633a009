"""A failed final export (a full disk) keeps the trained weights: the error names the export dir and the cause,
an earlier export stays whole, and the recipes' last stage keeps (or, with checkpoints off, writes) the last
step's checkpoint and names it.

The full disk is simulated where safetensors writes the weight file (it writes from Rust, out of reach of a
Python file object): the write puts down part of the file and then fails with ENOSPC, as a full disk does.
"""

from __future__ import annotations

import errno
from pathlib import Path

import attrs
import pytest
import torch
import transformers.modeling_utils

from backends.checkpoint.dcp import load_checkpoint, save_checkpoint
from backends.checkpoint.hf_export import ExportError, export_hf
from backends.loop.stages import RunPaths, export_final
from backends.models import TinyModelConfig, build_tiny_model
from tests.checkpoint_state import State

pytestmark = pytest.mark.faults

TINY = TinyModelConfig(
    hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=64
)


@pytest.fixture
def full_disk(monkeypatch):
    def save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 1024)  # what fitted
        raise OSError(errno.ENOSPC, "No space left on device", str(filename))

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_file)


def run_paths(tmp_path: Path) -> RunPaths:
    run_dir = tmp_path / "run"
    return RunPaths(
        run_dir=run_dir,
        ckpt_dir=run_dir / "checkpoints",
        model_path=run_dir / "base_model",
        policy_path=run_dir / "base_model",
        resume_from=None,
        must_match={},
    )


def test_a_full_disk_is_an_export_error_naming_the_dir_and_the_earlier_export_stays(tmp_path, monkeypatch):
    state = State(build_tiny_model(TINY))
    out = export_hf(state, tmp_path / "final_model")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def save_file(tensors, filename, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device", str(filename))

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_file)
    with pytest.raises(
        ExportError,
        match=rf"exporting the model to '{out}' failed: no space left on device "
        rf"\({tmp_path}/final_model\.tmp-[0-9a-f]+/model\.safetensors\)",
    ):
        export_hf(state, out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the earlier export is whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final_model"]  # no temp dir left


def test_with_checkpoints_off_the_weights_are_saved_and_named(tmp_path, full_disk):
    run, state = run_paths(tmp_path), State(build_tiny_model(TINY))

    def save(step: int) -> None:
        save_checkpoint(run.ckpt_dir, step, {"actor": state}, {"step": step})

    with pytest.raises(ExportError) as caught:
        export_final(lambda: export_hf(state, run.run_dir / "final_model"), run, 7, save)
    message = str(caught.value)
    assert f"exporting the model to '{run.run_dir / 'final_model'}' failed: no space left on device" in message
    assert f"The trained weights are kept in the checkpoint {run.ckpt_dir / 'step_7'}" in message
    assert f"resume=auto run_dir={run.run_dir}" in message
    other = State(build_tiny_model(attrs.evolve(TINY, seed=5)))
    states, _ = load_checkpoint(run.ckpt_dir / "step_7", {"actor": other})
    for k, v in state.module.state_dict().items():
        assert torch.equal(states["actor"].module.state_dict()[k], v), k


def test_the_last_checkpoint_is_kept_and_named_and_a_failed_save_is_said(tmp_path, full_disk):
    run, state = run_paths(tmp_path), State(build_tiny_model(TINY))
    save_checkpoint(run.ckpt_dir, 4, {"actor": state}, {"step": 4})
    saves = []
    with pytest.raises(ExportError, match=rf"kept in the checkpoint {run.ckpt_dir / 'step_4'}"):
        export_final(lambda: export_hf(state, run.run_dir / "final_model"), run, 4, saves.append)
    assert saves == [] and (run.ckpt_dir / "step_4" / "COMPLETE").is_file()  # the existing one, not a new save

    def failing_save(step: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(ExportError, match=r"saving the trained weights as the checkpoint .*step_9 failed too: OSError"):
        export_final(lambda: export_hf(state, run.run_dir / "final_model"), run, 9, failing_save)
    with pytest.raises(ExportError, match=r"no checkpoint of step 9 holds the trained weights"):
        export_final(lambda: export_hf(state, run.run_dir / "final_model"), run, 9, None)

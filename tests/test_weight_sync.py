"""Bucketed weight sync (backends.distributed.sharded_state.full_state_dict): the same weights as gathering
each tensor alone, one collective per bucket, over the state's own group, into a real rollout engine.

The reference stream is the one the recipes used before buckets: each tensor gathered alone with
``DTensor.full_tensor()`` in its stored fp32 and then cast (:func:`_one_by_one`). Collectives are counted
twice over real calls: a wrapper around ``torch.distributed.all_gather_single`` (``all_gather_into_tensor``
before torch 2.13) that records each call and then makes it, and a dispatch mode that sees every c10d op
(eager or functional, as ``full_tensor()`` issues them), so no other collective can hide. Models are tiny
random Qwen2 / Llama checkpoints with an odd MLP width, so that dim-0 shards are uneven over two ranks.
"""

from __future__ import annotations

import contextlib
import math

import attrs
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from backends.distributed.sharded_state import DEFAULT_BUCKET_MB, full_state_dict, lora_scaling, merged_lora
from backends.models import TinyModelConfig, write_tiny_model
from backends.training.engines import select_engine
from tests.distributed import run_distributed

pytestmark = pytest.mark.loading

# intermediate_size 97: gate/up projections of 97 rows split 49 + 48 over two ranks
TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=97, max_position_embeddings=64, seed=3
)
UNTIED_LLAMA = attrs.evolve(TINY, arch="llama", tie_word_embeddings=False)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_sync")
    return write_tiny_model(root / "tied", TINY), write_tiny_model(root / "untied", UNTIED_LLAMA)


# ------------------------------------------------------------------------------------ measurement


class _CollectiveOps(TorchDispatchMode):
    """Records every c10d collective op dispatched while active (eager ``dist.*`` and functional ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "c10d" in name and not any(s in name for s in ("wait_tensor", "_wrap_tensor_autograd")):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counted_collectives():
    """``(calls, ops)``: ``calls`` holds ``(group ranks, sent elements, gathered elements, dtype)`` of each
    ``dist.all_gather_single`` call (each then made for real), ``ops`` every c10d op dispatched."""
    calls: list[tuple] = []
    # torch 2.13 renamed it all_gather_single (the old name calls the new one)
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    real = getattr(dist, name)

    def counting(output_tensor, input_tensor, group=None, async_op=False):
        ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        calls.append((ranks, input_tensor.numel(), output_tensor.numel(), input_tensor.dtype))
        return real(output_tensor, input_tensor, group=group, async_op=async_op)

    with pytest.MonkeyPatch.context() as patch, _CollectiveOps() as mode:
        patch.setattr(dist, name, counting)
        yield calls, mode.ops


def _one_by_one(module, dtype=None):
    """The stream before buckets: every distinct tensor gathered alone in its stored dtype, then cast."""
    canonical: dict[int, str] = {}
    tied_to = {n: canonical.setdefault(id(p), n) for n, p in module.named_parameters(remove_duplicate=False)}
    done: dict[str, torch.Tensor] = {}
    for name, value in module.state_dict().items():
        key = tied_to.get(name, name)
        if key not in done:
            full = value.full_tensor() if isinstance(value, DTensor) else value
            done[key] = full.detach().to(dtype or full.dtype)
        yield name, done[key]


def _padded_bytes(module, itemsize: int) -> list[int]:
    """Gathered bytes of each distinct sharded tensor, state-dict order, each rank's part padded to
    ``torch.chunk``'s chunk size (the spec of a bucket's buffer)."""
    distinct = dict(module.named_parameters())  # one name per tied parameter
    out = []
    for name, value in module.state_dict().items():
        if name in distinct and isinstance(value, DTensor):
            world = value.device_mesh.size()
            rows = value.shape[0]
            out.append(world * -(-rows // world) * math.prod(value.shape[1:]) * itemsize)
    return out


def _expected_buckets(sizes: list[int], bucket_bytes: int) -> int:
    """Greedy packing in order; a tensor larger than a bucket is a bucket of its own."""
    buckets, filled = 0, None
    for size in sizes:
        if filled is None or filled + size > bucket_bytes:
            buckets, filled = buckets + 1, size
        else:
            filled += size
    return buckets


def _differences(got, expected) -> list[str]:
    """Names that differ between two ``(name, tensor)`` lists: order, dtype or a single bit."""
    if [n for n, _ in got] != [n for n, _ in expected]:
        return ["<names or order>"]
    return [n for (n, a), (_, b) in zip(got, expected) if a.dtype != b.dtype or not torch.equal(a, b)]


# ------------------------------------------------------------------------------------ workers


def _bucket_sizes_mb(module, itemsize: int) -> dict[str, float]:
    """Bucket sizes (MiB) relative to the model: many small buckets, exactly one, and one smaller than the
    largest tensor."""
    sizes = _padded_bytes(module, itemsize) or [1]
    largest = max(sizes)
    return {"many": 2.5 * largest / 2**20, "one": DEFAULT_BUCKET_MB, "below_largest": 0.5 * largest / 2**20}


def _compare_streams(module) -> dict:
    """Per (dtype, bucket size): differences to the one-by-one stream and the collectives each made."""
    out = {}
    for dtype_name, dtype in DTYPES.items():
        with counted_collectives() as (_, reference_ops):
            reference = list(_one_by_one(module, dtype))
        out[(dtype_name, "one_by_one")] = {"ops": len(reference_ops)}
        sizes = _padded_bytes(module, dtype.itemsize)
        for label, mb in _bucket_sizes_mb(module, dtype.itemsize).items():
            with counted_collectives() as (calls, ops):
                got = list(full_state_dict(module, dtype=dtype, bucket_mb=mb))
            tied = dict(got)
            out[(dtype_name, label)] = {
                "differences": _differences(got, reference),
                "calls": calls,
                "ops": len(ops),
                "expected_buckets": _expected_buckets(sizes, int(mb * 2**20)),
                "bucket_bytes": int(mb * 2**20),
                "largest_bytes": max(sizes, default=0),
                "lm_head_is_embedding": tied["lm_head.weight"] is tied["model.embed_tokens.weight"],
            }
    return out


def _rollout_runs(actor, model_dir) -> dict:
    """The native engine synced from the old stream and from the bucketed one: weights and samples."""
    from backends.rollout.native import SamplingConfig, build_native_rollout, generate, sync_weights

    sampling = SamplingConfig(n=2, max_new_tokens=8, seed=11)
    out = {}
    for dtype_name, dtype in DTYPES.items():
        checkpoint = build_native_rollout(model_dir, dtype=dtype)
        # before buckets the recipes passed the fp32 stream and the engine cast it
        old = sync_weights(build_native_rollout(model_dir, dtype=dtype), _one_by_one(actor.module))
        new = sync_weights(
            build_native_rollout(model_dir, dtype=dtype), full_state_dict(actor, dtype=dtype, bucket_mb=1e-3)
        )
        old_sd, new_sd, ckpt_sd = (r.model.state_dict() for r in (old, new, checkpoint))
        old_batch, new_batch = (generate(r, PROMPTS, sampling) for r in (old, new))
        out[dtype_name] = {
            "weights_differ": [n for n in old_sd if not torch.equal(old_sd[n], new_sd[n])],
            "moved_from_checkpoint": sum(not torch.equal(new_sd[n], ckpt_sd[n]) for n in new_sd),
            "tokens": (old_batch.response_ids, new_batch.response_ids),
            "logprobs": (old_batch.rollout_logprobs, new_batch.rollout_logprobs),
            "versions": (old.weights_version, new.weights_version),
        }
    return out


def _trained_actor(model_dir, env, rank, **kwargs):
    from backends.training.fsdp import FSDPConfig, build_actor, update
    from backends.training.optim import OptimConfig
    from tests.test_reference import make_batch, pg_loss

    actor = build_actor(model_dir, env, OptimConfig(lr=1e-2, weight_decay=0.0), FSDPConfig(), **kwargs)
    actor, metrics = update(actor, make_batch(rank), pg_loss)  # the weights move away from the checkpoint
    assert metrics["update_skipped"] == 0.0
    return actor


def _lora_streams(model_dir, env, rank) -> dict:
    """A LoRA actor: bucketed merged weights against the merge of the one-by-one stream."""
    from backends.training.lora import LoraConfig

    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    actor = _trained_actor(model_dir, env, rank, **cfg.build_kwargs(select_engine("fsdp")))
    scaling = lora_scaling(actor.module)
    out = {}
    for dtype_name, dtype in DTYPES.items():
        reference = list(merged_lora(_one_by_one(actor.module, dtype), scaling))
        with counted_collectives() as (calls, _):
            got = list(full_state_dict(actor, dtype=dtype, bucket_mb=1e-2))
        out[dtype_name] = {
            "differences": _differences(got, reference),
            "names": [n for n, _ in got],
            "buckets": len(calls),
        }
    return out


def _odd_shapes(env) -> dict:
    """A bare module with tensors of fewer rows than ranks (an empty shard) and uneven splits."""
    from torch.distributed.fsdp import fully_shard

    from backends.distributed.setup import device_mesh

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 1), torch.nn.Linear(1, 5), torch.nn.Linear(5, 7))
    fully_shard(module, mesh=device_mesh(env))
    local_rows = [v.to_local().shape[0] for v in module.state_dict().values()]
    reference = list(_one_by_one(module, torch.bfloat16))
    return {
        "local_rows": local_rows,
        "differences": {
            mb: _differences(list(full_state_dict(module, dtype=torch.bfloat16, bucket_mb=mb)), reference)
            for mb in (1e-6, 1e-4, DEFAULT_BUCKET_MB)
        },
    }


def _sync_worker(rank: int, world_size: int, tied_dir, untied_dir) -> dict:
    from backends.distributed.setup import init_distributed

    env = init_distributed(device="cpu")
    out: dict = {}
    for label, path in (("tied", tied_dir), ("untied", untied_dir)):
        actor = _trained_actor(path, env, rank)
        out[label] = _compare_streams(actor.module)
        out[label + "_sharded"] = any(isinstance(p, DTensor) for p in actor.module.parameters())
    out["rollout"] = _rollout_runs(actor, untied_dir)
    out["lora"] = _lora_streams(tied_dir, env, rank)
    if world_size > 1:
        out["odd"] = _odd_shapes(env)
    return out


def _pool_worker(rank: int, world_size: int, model_dir) -> dict:
    """Split placement: the actor lives on ranks 1 and 2; rank 0 takes part only in creating the mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    from backends.distributed.setup import DistEnv, init_distributed

    world = init_distributed(device="cpu")
    pool = (1, 2)
    mesh = DeviceMesh("cpu", torch.tensor(pool), mesh_dim_names=("dp",))  # collective over the world
    if rank not in pool:
        return {}
    env = DistEnv(
        rank=pool.index(rank),
        world_size=len(pool),
        local_rank=world.local_rank,
        device=world.device,
        backend=world.backend,
        group=mesh.get_group(),
    )
    actor = _trained_actor(model_dir, env, rank, mesh=mesh)
    reference = list(_one_by_one(actor.module, torch.bfloat16))
    with counted_collectives() as (calls, ops):
        got = list(full_state_dict(actor, dtype=torch.bfloat16, bucket_mb=1e-2))
    return {"differences": _differences(got, reference), "calls": calls, "ops": len(ops)}


@pytest.fixture(scope="module")
def two_ranks(model_dirs):
    return run_distributed(_sync_worker, 2, *model_dirs)


@pytest.fixture(scope="module")
def one_rank(model_dirs):
    return run_distributed(_sync_worker, 1, *model_dirs)


# ------------------------------------------------------------------------------------ tests


@pytest.mark.distributed
@pytest.mark.parametrize("model", ["tied", "untied"])
def test_bucketed_sync_is_bit_identical_on_two_ranks(two_ranks, model):
    for rank, result in enumerate(two_ranks):
        assert result[model + "_sharded"]
        for (dtype, label), r in result[model].items():
            if label != "one_by_one":
                assert r["differences"] == [], (rank, dtype, label)
                assert r["lm_head_is_embedding"] == (model == "tied"), (rank, dtype, label)


@pytest.mark.distributed
@pytest.mark.parametrize("model", ["tied", "untied"])
def test_one_collective_per_bucket(two_ranks, model):
    """Each sync makes exactly as many collectives as it has buckets, all over the FSDP mesh's group, sending
    this rank's shards in the target dtype; the one-by-one stream makes one per distinct tensor."""
    result = two_ranks[0][model]
    for dtype, torch_dtype in DTYPES.items():
        per_tensor = result[(dtype, "one_by_one")]["ops"]
        buckets = {label: result[(dtype, label)] for label in ("many", "one", "below_largest")}
        for label, r in buckets.items():
            assert len(r["calls"]) == r["ops"] == r["expected_buckets"], (dtype, label)
            assert all(
                ranks == (0, 1) and sent * 2 == gathered and d == torch_dtype for ranks, sent, gathered, d in r["calls"]
            ), (dtype, label)
        assert buckets["one"]["ops"] == 1
        assert 1 < buckets["many"]["ops"] < per_tensor
        # a tensor larger than the bucket still travels, alone
        below = buckets["below_largest"]
        assert below["largest_bytes"] > below["bucket_bytes"]
        assert max(2 * sent * torch_dtype.itemsize for _, sent, _, _ in below["calls"]) == below["largest_bytes"]
        assert per_tensor == len(_expected_names(model)) - (model == "tied")


def _expected_names(model: str) -> list[str]:
    from backends.models import build_tiny_model

    return list(build_tiny_model(TINY if model == "tied" else UNTIED_LLAMA).state_dict())


@pytest.mark.distributed
def test_bf16_sync_moves_half_the_bytes(two_ranks):
    result = two_ranks[0]["untied"]
    fp32, bf16 = result[("float32", "one")]["calls"], result[("bfloat16", "one")]["calls"]
    assert fp32[0][2] == bf16[0][2]  # the same elements...
    assert bf16[0][3].itemsize * 2 == fp32[0][3].itemsize  # ...at half the bytes each


@pytest.mark.distributed
def test_one_rank_needs_no_collective(one_rank):
    (result,) = one_rank
    for model in ("tied", "untied"):
        assert not result[model + "_sharded"]
        for (dtype, label), r in result[model].items():
            assert r["ops"] == 0, (model, dtype, label)
            if label != "one_by_one":
                assert r["differences"] == [] and r["calls"] == [], (model, dtype, label)


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_native_rollout_samples_the_same_tokens(two_ranks, one_rank, dtype):
    for result in (*two_ranks, *one_rank):
        r = result["rollout"][dtype]
        assert r["weights_differ"] == []
        assert r["moved_from_checkpoint"] > 0  # the sync brought trained weights, not the checkpoint's
        assert r["versions"] == (1, 1)
        assert torch.equal(*r["tokens"])
        assert torch.equal(*r["logprobs"])


@pytest.mark.distributed
def test_lora_actor_streams_merged_weights(two_ranks, one_rank):
    base_names = _expected_names("tied")
    for result in (*two_ranks, *one_rank):
        for dtype, r in result["lora"].items():
            assert r["differences"] == [], dtype
            assert sorted(r["names"]) == sorted(base_names)  # no peft prefix, no factors
    assert all(r["buckets"] > 1 for r in two_ranks[0]["lora"].values())


@pytest.mark.distributed
def test_empty_and_uneven_shards(two_ranks):
    rows = [result["odd"]["local_rows"] for result in two_ranks]
    assert rows == [[1, 1, 3, 3, 4, 4], [0, 0, 2, 2, 3, 3]]
    for result in two_ranks:
        assert all(d == [] for d in result["odd"]["differences"].values())


@pytest.mark.distributed
def test_split_placement_gathers_over_the_pool(model_dirs):
    results = run_distributed(_pool_worker, 3, model_dirs[0], timeout=240)
    assert results[0] == {}
    for result in results[1:]:
        assert result["differences"] == []
        assert result["calls"] and all(ranks == (1, 2) for ranks, *_ in result["calls"])
        assert result["ops"] == len(result["calls"])


def test_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="bucket_mb"):
        next(full_state_dict(torch.nn.Linear(2, 2), bucket_mb=0))

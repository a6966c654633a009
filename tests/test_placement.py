"""Split vs colocated placement: pool layout errors, exact batch transfer between pools, equal updates.

Multi-rank checks run on 4 real gloo ranks (tests/distributed.py, or torchrun for the recipe). On this
2-core machine 4 ranks oversubscribe the CPU: the models are tiny and the runs short.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch

from backends.distributed.placement import PlacementConfig, PlacementError, pool_ranks
from rlfunc.batch import RolloutBatch, concat
from tests.distributed import run_distributed
from tests.recipes import PPO, TINY_MODEL, arithmetic_data, data_args, run, the_run_dir

pytestmark = pytest.mark.placement

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------- layouts


def test_pool_ranks_default_and_explicit():
    assert pool_ranks(PlacementConfig(), 4) == {"actor": (0, 1, 2, 3), "critic": (0, 1, 2, 3)}
    assert pool_ranks(PlacementConfig(mode="split"), 4) == {"actor": (0, 1), "critic": (2, 3)}
    assert pool_ranks(PlacementConfig(mode="split", actor_pool=1), 4) == {"actor": (0,), "critic": (1, 2, 3)}
    assert pool_ranks(PlacementConfig(mode="split", critic_pool=1), 4) == {"actor": (0, 1, 2), "critic": (3,)}


@pytest.mark.parametrize(
    "cfg, world, message",
    [
        (PlacementConfig(mode="split", actor_pool=2, critic_pool=3), 4, "must cover every rank exactly once"),
        (PlacementConfig(mode="split", actor_pool=1, critic_pool=1), 4, "must cover every rank exactly once"),
        (PlacementConfig(mode="split", actor_pool=4), 4, "empty pool"),
        (PlacementConfig(mode="split"), 1, "needs at least 2 ranks"),
        (PlacementConfig(actor_pool=2), 4, "are for placement.mode=split"),
    ],
)
def test_bad_layouts_raise_clear_errors(cfg, world, message):
    with pytest.raises(PlacementError, match=message):
        pool_ranks(cfg, world)


def test_bad_mode_is_a_config_error():
    from backends.config import ConfigError, apply_overrides

    with pytest.raises(ConfigError, match="placement.mode='spilt' is not one of"):
        apply_overrides(PlacementConfigHolder(), ["placement.mode=spilt"])
    with pytest.raises(ConfigError, match="placement.actor_pool"):
        apply_overrides(PlacementConfigHolder(), ["placement.actor_pool=-1"])


@attrs.frozen
class PlacementConfigHolder:
    placement: PlacementConfig = PlacementConfig()


# ---------------------------------------------------------------------------------- batch transfer


def make_source_batch(rank: int, rows: int) -> RolloutBatch:
    """Rank-specific widths and contents (prompts left-padded, responses right-padded)."""
    g = torch.Generator().manual_seed(100 + rank)
    p, t = 3 + rank, 6 - rank
    prompt_lens = torch.randint(1, p + 1, (rows,), generator=g)
    response_lens = torch.randint(0, t + 1, (rows,), generator=g)
    prompt_mask = torch.arange(p).flip(0)[None, :] < prompt_lens[:, None]
    response_mask = torch.arange(t)[None, :] < response_lens[:, None]
    return RolloutBatch(
        prompt_ids=torch.randint(4, 60, (rows, p), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(4, 60, (rows, t), generator=g) * response_mask,
        response_mask=response_mask,
        group_ids=torch.arange(rows) + 1000 * rank,
        old_logprobs=-torch.rand(rows, t, generator=g, dtype=torch.float32) * response_mask,
        scores=torch.rand(rows, generator=g),
    )


def _pad_rows(batch: RolloutBatch, p: int, t: int) -> RolloutBatch:
    from backends.distributed.placement import pad_to

    changes = {}
    for f in attrs.fields(RolloutBatch):
        value = getattr(batch, f.name)
        if value is not None:
            changes[f.name] = pad_to(value, tuple(f.metadata["shape"].split()), {"p": p, "t": t})
    return batch.replace(**changes)


def expected_share(src_ranks, rows, dst_index, dst_count):
    """What destination ``dst_index`` must hold: its near-equal slice of the sources' rows, padded to the
    widest source row it receives."""
    sources = [make_source_batch(r, rows[r]) for r in src_ranks]
    total = sum(rows[r] for r in src_ranks)
    base, extra = divmod(total, dst_count)
    sizes = [base + (j < extra) for j in range(dst_count)]
    lo = sum(sizes[:dst_index])
    hi = lo + sizes[dst_index]
    start, parts = 0, []
    for b in sources:
        n = b.prompt_ids.shape[0]
        a, z = max(lo, start), min(hi, start + n)
        if a < z:
            parts.append(b if (a, z) == (start, start + n) else _select(b, a - start, z - start))
        start += n
    p = max(x.prompt_ids.shape[1] for x in parts)
    t = max(x.response_ids.shape[1] for x in parts)
    return concat([_pad_rows(x, p, t) for x in parts])


def _select(b, a, z):
    from rlfunc.batch import select

    return select(b, slice(a, z))


def assert_batches_equal(x: RolloutBatch, y: RolloutBatch) -> None:
    for f in attrs.fields(RolloutBatch):
        a, b = getattr(x, f.name), getattr(y, f.name)
        assert (a is None) == (b is None), f.name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, (f.name, a.shape, b.shape)
            assert torch.equal(a, b), f.name


# (source ranks, destination ranks, rows per rank): pools of different sizes, both directions
TRANSFERS = [((0,), (1, 2, 3)), ((0, 1, 2), (3,)), ((0, 1), (2, 3)), ((2, 3), (0,)), ((1,), (0, 2))]
ROWS = {0: 5, 1: 3, 2: 4, 3: 2}


def _transfer_worker(rank: int, world_size: int) -> list[str]:
    from backends.distributed.placement import redistribute

    checked = []
    for src, dst in TRANSFERS:
        mine = make_source_batch(rank, ROWS[rank]) if rank in src else None
        out = redistribute(mine, src, dst)
        if rank in dst:
            assert_batches_equal(out, expected_share(src, ROWS, dst.index(rank), len(dst)))
            checked.append(f"{src}->{dst}")
        else:
            assert out is None
        # and back: every source rank gets exactly its own rows, shapes included
        back = redistribute(out, dst, src, like=mine)
        if rank in src:
            assert_batches_equal(back, mine)
            checked.append(f"{dst}->{src} round trip")
    # a mismatch of present fields between source ranks is an error on every rank
    mine = make_source_batch(rank, 2)
    if rank == 1:
        mine = mine.replace(scores=None)
    try:
        redistribute(mine if rank in (0, 1) else None, (0, 1), (2, 3))
    except ValueError as e:
        assert "disagree" in str(e)
        checked.append("mismatch error")
    # a source without a batch fails on every rank, not only on itself
    try:
        redistribute(None if rank == 0 else make_source_batch(rank, 2), (0, 1), (2, 3))
    except ValueError as e:
        assert "rank 0 is a source but has no batch" in str(e)
        checked.append("missing batch error")
    return checked


@pytest.mark.distributed
def test_redistribute_between_pools_of_different_sizes_is_exact():
    results = run_distributed(_transfer_worker, 4, timeout=240)
    assert all("mismatch error" in r and "missing batch error" in r for r in results)
    assert sum(len(r) for r in results) == sum(len(s) + len(d) for s, d in TRANSFERS) + 8


# ---------------------------------------------------------------------------------- equal updates

TINY = [
    "steps=3",
    "prompts_per_step=4",
    "rollout.n=4",
    "eval.max_prompts=8",
    *TINY_MODEL,
    "algo.ppo_mini_batch_size=2",
    "algo.ppo_epochs=2",
    "algo.critic_warmup=1",
    "algo.kl_ctrl=adaptive",
    "actor.optim.lr=3e-4",
    "critic.optim.lr=1e-3",
]


def _run_recipe(run_root: Path, data_dir: Path, nproc: int, *extra: str) -> Path:
    out = run(PPO, f"run_root={run_root}", *data_args(data_dir), *TINY, *extra, nproc=nproc)
    assert out.returncode == 0, out.stderr[-4000:]
    return the_run_dir(run_root, "ppo")


@pytest.mark.slow
@pytest.mark.distributed
def test_split_and_colocated_make_the_same_updates(tmp_path):
    data_dir = arithmetic_data(tmp_path / "data")
    """Colocated on 2 ranks vs split 2 + 2 on 4 ranks, same seeds: the actor pool samples the same data
    (its ranks play the colocated ranks' part), the critic pool's ranks get the same rows, so the actor and
    critic after 3 PPO steps (2 epochs x 2 mini-batches each, critic warm-up 1) must match.

    Tolerance: 1e-6 absolute on every parameter (each role is sharded over 2 ranks in both runs, so the
    arithmetic is the same, and the two runs agree exactly). Both export the actor's train state
    as orbax (under split the actor pool gathers and writes it): the same params, AdamW state and step."""
    from safetensors.torch import load_file

    colocated = _run_recipe(tmp_path / "colocated", data_dir, 2, "export.orbax=true")
    split = _run_recipe(
        tmp_path / "split",
        data_dir,
        4,
        "placement.mode=split",
        "placement.actor_pool=2",
        "placement.critic_pool=2",
        "export.orbax=true",
    )
    from backends.checkpoint.orbax import _flatten, read_orbax

    (tree_c, meta_c), (tree_s, meta_s) = read_orbax(colocated / "actor_orbax"), read_orbax(split / "actor_orbax")
    flat_c, flat_s = _flatten(tree_c), _flatten(tree_s)
    assert flat_c.keys() == flat_s.keys() and any(k.startswith("opt_state") for k in flat_c)
    assert meta_s["optimizer_state"] == "saved" and meta_s["param_shapes"] == meta_c["param_shapes"]
    assert int(tree_s["step"]) == int(tree_c["step"]) > 0
    for key in flat_c:
        torch.testing.assert_close(
            torch.as_tensor(flat_s[key]), torch.as_tensor(flat_c[key]), atol=1e-6, rtol=0, msg=key
        )
    for role in ("final_model", "final_critic"):
        a, b = load_file(colocated / role / "model.safetensors"), load_file(split / role / "model.safetensors")
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=f"{role} {name}")
    # the update really moved the weights away from the SFT stage's
    warm = load_file(split / "sft_model" / "model.safetensors")
    actor = load_file(split / "final_model" / "model.safetensors")
    assert max((warm[k] - actor[k]).abs().max().item() for k in warm) > 1e-5
    rows_c = [json.loads(x) for x in (colocated / "metrics.jsonl").read_text().splitlines()]
    rows_s = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()]
    rows_c, rows_s = ([r for r in rows if r["step"] > 0 and "step_time_s" in r] for rows in (rows_c, rows_s))
    assert [r["step"] for r in rows_s] == [1, 2, 3]
    for rc, rs in zip(rows_c, rows_s):
        for key in ("loss", "critic/loss", "kl_reward", "kl_coef", "reward_mean", "values_mean"):
            if key in rc:
                assert rs[key] == pytest.approx(rc[key], abs=1e-6), key
    summary = json.loads((split / "summary.json").read_text())
    assert summary["placement"] == "split" and summary["world_size"] == 4

"""FSDP2 engine: multi-rank updates equal one big single-process update; full weights, log-probs, roles.

The distributed checks run on 2 real gloo ranks (tests/distributed.py). Spawning costs a few seconds,
so each group of related checks runs once in a module-scoped fixture and several tests read its result.
The single-process references here use a plain (unsharded) Hugging Face model and torch AdamW.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from backends.models import TinyModelConfig, load_causal_lm, write_tiny_model
from backends.training.common import trim_micro_batch
from backends.training.fsdp import FSDPConfig, ModelOutputs, micro_batches
from backends.training.optim import OptimConfig, build_optimizer, lr_at, lr_multiplier, warmup_steps
from rlfunc.aggregation import aggregate, local_normalizers
from rlfunc.batch import RolloutBatch, select
from tests.distributed import run_distributed

# ------------------------------------------------------------------------------------------ fixtures

TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_position_embeddings=64, seed=1
)
# Per-row prompt / response lengths of the global batch (12 rows, 6 per rank). Row 3 has no loss token.
PROMPT_LENS = [6, 3, 5, 2, 4, 6, 1, 5, 3, 6, 2, 4]
RESPONSE_LENS = [7, 1, 4, 0, 7, 2, 3, 6, 5, 1, 7, 2]
NUM_TOKENS, NUM_SEQS = float(sum(RESPONSE_LENS)), float(sum(r > 0 for r in RESPONSE_LENS))
# eps=1e-5 rather than AdamW's 1e-8: at this random init some gradient entries are ~1e-9, where Adam's
# step g / (|g| + eps) turns fp32 summation noise (any change of micro-batching, even on one rank) into
# a visible change of that entry's step; a larger eps keeps the parameters comparable at a tight
# tolerance after a few steps. The gradients themselves are compared separately.
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0, eps=1e-5)


def make_batch(seed: int = 0, prompt_lens=PROMPT_LENS, response_lens=RESPONSE_LENS, vocab: int = 80) -> RolloutBatch:
    """Left-padded prompts, right-padded responses, random advantages; padding holds junk token ids."""
    g = torch.Generator().manual_seed(seed)
    b, p, t = len(prompt_lens), max(prompt_lens), max(max(response_lens), 1)
    prompt_mask = torch.arange(p).flip(0)[None, :] < torch.tensor(prompt_lens)[:, None]
    response_mask = torch.arange(t)[None, :] < torch.tensor(response_lens)[:, None]
    return RolloutBatch(
        prompt_ids=torch.randint(4, vocab, (b, p), generator=g),
        prompt_mask=prompt_mask,
        response_ids=torch.randint(4, vocab, (b, t), generator=g),
        response_mask=response_mask,
        group_ids=torch.arange(b) // 3,
        advantages=torch.randn(b, t, generator=g),
    )


def rank_rows(batch: RolloutBatch, rank: int, world_size: int) -> RolloutBatch:
    n = batch.prompt_ids.shape[0] // world_size
    return select(batch, slice(rank * n, (rank + 1) * n))


def pg_loss(outputs: ModelOutputs, mb: RolloutBatch, norms, mode: str = "token-mean"):
    """A REINFORCE-style loss aggregated with the global normalisers."""
    loss = aggregate(-mb.advantages * outputs.logprobs, mb.response_mask, mode=mode, norms=norms)
    return loss, {"seen_num_tokens": norms.num_tokens, "seen_num_seqs": norms.num_seqs}


def hf_logprobs(model, batch: RolloutBatch, with_entropy: bool = False):
    """Plain HF forward over prompt + response, log_softmax, gather the response tokens."""
    attention_mask = batch.attention_mask.long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch.input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    p, t = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    logp = torch.log_softmax(logits[:, p - 1 : p + t - 1].float(), dim=-1)
    chosen = logp.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return chosen
    return chosen, -(logp.exp() * logp).sum(-1)


def reference_updates(model_dir, batches, mode: str, optim_cfg: OptimConfig = OPTIM):
    """Single process, whole batch, no accumulation: forward, loss, backward, clip, AdamW at lr_at(step)."""
    torch.manual_seed(0)
    model, _ = load_causal_lm(model_dir)
    model.train()
    optimizer = build_optimizer(model.parameters(), optim_cfg)
    losses, norms, grads = [], [], []
    for step, batch in enumerate(batches):
        logprobs = hf_logprobs(model, batch)
        loss = aggregate(-batch.advantages * logprobs, batch.response_mask, mode=mode)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), optim_cfg.clip_grad)))
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        for group in optimizer.param_groups:
            group["lr"] = lr_at(optim_cfg, step)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return params, losses, norms, grads


def _numpy(tree):
    if isinstance(tree, dict):
        return {k: _numpy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_numpy(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().float().numpy().copy()
    return tree


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max(float(np.abs(np.asarray(a[k]) - np.asarray(b[k])).max()) for k in a)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", TINY))


# --------------------------------------------------------------------- workers (module level: spawned)


def _env():
    from backends.distributed.setup import init_distributed

    return init_distributed()  # reuses the harness's gloo group


def _parity_worker(rank, world_size, model_dir, optim=OPTIM):
    """Two updates per configuration on this rank's half of the global batch."""
    from backends.training.fsdp import build_actor, full_state_dict, global_normalizers, update

    env = _env()
    batches = [make_batch(0), make_batch(1)]
    configs = {
        "token-mean": ("token-mean", FSDPConfig(micro_batch_size=4)),  # 6 rows -> micro-batches of 4 + 2
        "seq-mean-token-mean": ("seq-mean-token-mean", FSDPConfig(micro_batch_size=4)),
        # token budget: the ranks end up with different micro-batch counts (dummy micro-batches)
        "token-budget": ("seq-mean-token-mean", FSDPConfig(max_tokens_per_micro_batch=14)),
    }
    out = {}
    for name, (mode, fsdp_cfg) in configs.items():
        state = build_actor(model_dir, env, optim, fsdp_cfg)
        seen = []

        def loss_fn(outputs, mb, norms, mode=mode, seen=seen):
            local_tokens = float(local_normalizers(mb.response_mask).num_tokens)
            seen.append((float(norms.num_tokens), float(norms.num_seqs), local_tokens))
            return pg_loss(outputs, mb, norms, mode)

        grads = []
        names = {id(p): n for n, p in state.module.named_parameters()}

        def record_grads(optimizer, args, kwargs, grads=grads, names=names):  # after clipping, before the step
            grads.append({names[id(p)]: p.grad.full_tensor() for g in optimizer.param_groups for p in g["params"]})

        state.optimizer.register_step_pre_hook(record_grads)
        metrics = []
        for batch in batches:
            state, m = update(state, rank_rows(batch, rank, world_size), loss_fn)
            metrics.append(m)
        out[name] = {
            "params": _numpy(dict(full_state_dict(state))),
            "metrics": metrics,
            "seen": seen,
            "step": state.step,
            "grads": _numpy(grads),
        }
    local = rank_rows(make_batch(0), rank, world_size)
    norms = global_normalizers(micro_batches(local, micro_batch_size=4))
    out["global_normalizers"] = (float(norms.num_tokens), float(norms.num_seqs))
    return out


def _weights_worker(rank, world_size, model_dir, untied_dir):
    """full_state_dict, compute_logprobs, and the reference role."""
    from backends.training.fsdp import build_actor, build_reference, compute_logprobs, full_state_dict, update

    env = _env()
    local = rank_rows(make_batch(0), rank, world_size)
    out = {}
    actor = build_actor(model_dir, env, OPTIM, FSDPConfig(micro_batch_size=4))
    import torch.distributed as dist

    # count the real all-gathers of the sync (the bucketed stream's collective), then call through
    gathers, all_gather = [], dist.all_gather_single
    dist.all_gather_single = lambda *a, **k: gathers.append(1) or all_gather(*a, **k)
    try:
        out["full"] = _numpy(dict(full_state_dict(actor)))
    finally:
        dist.all_gather_single = all_gather
    out["num_gathers"] = len(gathers)
    shard_types = {type(p).__name__ for p in actor.module.parameters()}
    out["shard_types"] = sorted(shard_types)
    lp = compute_logprobs(actor, local, with_entropy=True)
    out["actor_logprobs"] = _numpy((lp.logprobs, lp.entropy))
    out["actor_training_after"] = actor.module.training
    out["untied_full"] = _numpy(dict(full_state_dict(build_actor(untied_dir, env, OPTIM, FSDPConfig()))))

    ref = build_reference(model_dir, env, FSDPConfig(micro_batch_size=4), log_prob_micro_batch_size=2)
    rows_seen = []
    ref.module.register_forward_pre_hook(
        lambda m, args, kwargs: rows_seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    before = [p.to_local().clone() for p in ref.module.parameters()]
    ref_lp = compute_logprobs(ref, local)
    out["ref_rows_seen"] = list(rows_seen)
    rows_seen.clear()
    compute_logprobs(ref, local, micro_batch_size=5)
    out["ref_rows_seen_override"] = list(rows_seen)
    out["ref_logprobs"] = _numpy(ref_lp.logprobs)
    out["ref_logprobs_requires_grad"] = ref_lp.logprobs.requires_grad
    out["ref_logprobs_is_inference"] = ref_lp.logprobs.is_inference()
    weight = torch.ones_like(ref_lp.logprobs, requires_grad=True)
    (weight * ref_lp.logprobs).sum().backward()  # usable in a loss (an inference tensor would raise)
    out["ref_unchanged"] = all(torch.equal(a, p.to_local()) for a, p in zip(before, ref.module.parameters()))
    out["ref_no_grads"] = all(p.grad is None and not p.requires_grad for p in ref.module.parameters())
    out["ref_optimizer"] = ref.optimizer
    out["ref_training"] = ref.module.training
    try:
        update(ref, local, pg_loss)
        out["ref_update_error"] = None
    except ValueError as e:
        out["ref_update_error"] = str(e)
    return out


def _nan_loss(outputs, mb, norms):
    loss, metrics = pg_loss(outputs, mb, norms)
    return loss * float("nan"), metrics


def _clashing_loss(outputs, mb, norms):
    loss, _ = pg_loss(outputs, mb, norms)
    return loss, {"loss": loss}


def _vector_loss(outputs, mb, norms):
    return outputs.logprobs.sum(-1), {}


def _ppo_loss(outputs, mb, norms):
    from rlfunc.policy_losses import ppo_policy_loss

    return ppo_policy_loss(
        outputs.logprobs,
        old_logprobs=mb.old_logprobs,
        advantages=mb.advantages,
        response_mask=mb.response_mask,
        clip_low=0.2,
        clip_high=0.28,
        agg="token-mean",
        norms=norms,
    )


def _local_params(state):
    return [p.to_local().detach().clone() for p in state.module.parameters()]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _behaviour_worker(rank, world_size, model_dir):
    """LR schedule per step, bad input, gradient checkpointing."""
    from backends.training.fsdp import build_actor, compute_logprobs, full_state_dict, update

    env = _env()
    local = rank_rows(make_batch(0), rank, world_size)
    out = {}

    # LR schedule: 2 warm-up steps then cosine to step 5.
    sched = OptimConfig(
        lr=1e-3, lr_warmup_steps=2, lr_scheduler_type="cosine", total_training_steps=5, min_lr_ratio=0.1
    )
    state = build_actor(model_dir, env, sched, FSDPConfig(micro_batch_size=4))
    p0 = _local_params(state)
    lrs, unchanged_after_first = [], None
    for step in range(5):
        state, m = update(state, local, pg_loss)
        lrs.append(m["lr"])
        if step == 0:
            unchanged_after_first = _same(p0, _local_params(state))
    out["lrs"], out["lr_unchanged_after_first"], out["sched_step"] = lrs, unchanged_after_first, state.step

    # Empty responses everywhere: a defined no-op.
    state = build_actor(model_dir, env, OPTIM, FSDPConfig(micro_batch_size=4))
    p0 = _local_params(state)
    empty = local.replace(response_mask=torch.zeros_like(local.response_mask))
    state, m = update(state, empty, pg_loss)
    out["empty_metrics"] = m
    out["empty_unchanged"] = _same(p0, _local_params(state))
    # the optimizer state (allocated at build) is as built: no step counted, no moment moved
    out["empty_optimizer_state"] = sum(
        float(s["step"]) + float(_local(s["exp_avg"]).abs().sum()) for s in state.optimizer.state.values()
    )
    out["empty_step"] = state.step

    # NaN loss: step skipped, gradients dropped, the next good update works.
    state, m = update(state, local, _nan_loss)
    out["nan_metrics"] = m
    out["nan_unchanged"] = _same(p0, _local_params(state))
    out["nan_grads_cleared"] = all(p.grad is None for p in state.module.parameters())
    state, m = update(state, local, pg_loss)
    out["after_nan_metrics"] = m
    out["after_nan_changed"] = not _same(p0, _local_params(state))
    out["after_nan_step"] = state.step

    errors = {}
    for name, fn, batch in [
        ("empty_prompt", pg_loss, local.replace(prompt_mask=torch.zeros_like(local.prompt_mask))),
        ("bool_mask", pg_loss, local.replace(response_mask=local.response_mask.float())),
        ("metric_clash", _clashing_loss, local),
        ("vector_loss", _vector_loss, local),
    ]:
        try:
            update(state, batch, fn)
            errors[name] = None
        except (ValueError, TypeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    out["errors"] = errors

    # Gradient checkpointing gives the same update (two steps).
    results, layer_calls = {}, {}
    for gc in (False, True):
        state = build_actor(model_dir, env, OPTIM, FSDPConfig(micro_batch_size=4, gradient_checkpointing=gc))
        calls, layer = [], state.module.model.layers[0]
        # count forward runs by wrapping forward (module hooks do not fire during checkpoint recompute)
        layer.forward = lambda *a, calls=calls, f=layer.forward, **k: (calls.append(1), f(*a, **k))[1]
        for seed in (0, 1):
            state, m = update(state, rank_rows(make_batch(seed), rank, world_size), pg_loss)
        results[gc] = (_numpy(dict(full_state_dict(state))), m)
        layer_calls[gc] = len(calls)
    out["gc"], out["gc_layer_calls"] = results, layer_calls

    # PPO with old log-probs from compute_logprobs: on-policy at the first update (ratio exactly 1).
    state = build_actor(model_dir, env, OPTIM, FSDPConfig(micro_batch_size=4))
    ppo_batch = local.replace(old_logprobs=compute_logprobs(state, local).logprobs)
    out["ppo_metrics"] = []
    for _ in range(3):
        state, m = update(state, ppo_batch, _ppo_loss)
        out["ppo_metrics"].append(m)

    # skip_rows: zero-advantage rows skipped (all of rank 0's, three of rank 1's) give the full update;
    # rank 0 then runs dummy micro-batches only, rank 1 fewer than without the skip.
    from rlfunc.advantages import zero_advantage_rows

    adv = local.advantages.clone()
    adv[: adv.shape[0] if rank == 0 else 3] = 0.0
    budget = FSDPConfig(max_tokens_per_micro_batch=20)  # rank 0 plans no rows but joins the budget's all-reduce
    for name, advantages, fsdp_cfg in (
        ("some", adv, FSDPConfig(micro_batch_size=2)),
        ("some_budget", adv, budget),
        ("all", torch.zeros_like(adv), FSDPConfig(micro_batch_size=2)),
    ):
        batch = local.replace(advantages=advantages)
        skip = zero_advantage_rows(batch.advantages, batch.response_mask)
        runs = {}
        for use_skip in (False, True):
            state = build_actor(model_dir, env, OPTIM, fsdp_cfg)
            for _ in range(2):
                state, m = update(state, batch, pg_loss, skip_rows=skip if use_skip else None)
            runs[use_skip] = (_numpy(dict(full_state_dict(state))), m)
        out[f"skip_{name}"] = {"runs": runs, "skipped": int(skip.sum()), "rows": int(skip.shape[0])}

    # A row longer than the token budget on one rank only (rank 0's first row has 13 tokens): every rank
    # raises, the other one does not wait in a collective.
    out["budget_errors"] = {}
    for grouping in ("sequential", "balanced"):
        state = build_actor(
            model_dir, env, OPTIM, FSDPConfig(max_tokens_per_micro_batch=12, token_budget_grouping=grouping)
        )
        try:
            update(state, local, pg_loss)
            out["budget_errors"][grouping] = None
        except ValueError as e:
            out["budget_errors"][grouping] = str(e)

    # bf16 compute (fp32 master weights) runs and stays close to fp32.
    state = build_actor(model_dir, env, OPTIM, FSDPConfig(micro_batch_size=4, param_dtype="bfloat16"))
    state, m = update(state, local, pg_loss)
    out["bf16_metrics"] = m
    out["bf16_param_dtype"] = str(next(state.module.parameters()).dtype)
    return out


def _all_checks_worker(rank, world_size, model_dir, untied_dir):
    return {
        "parity": _parity_worker(rank, world_size, model_dir),
        "weights": _weights_worker(rank, world_size, model_dir, untied_dir),
        "behaviour": _behaviour_worker(rank, world_size, model_dir),
    }


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    return str(
        write_tiny_model(
            tmp_path_factory.mktemp("untied") / "model",
            TinyModelConfig(
                hidden_size=64,
                num_layers=2,
                num_heads=2,
                num_kv_heads=1,
                intermediate_size=128,
                max_position_embeddings=64,
                tie_word_embeddings=False,
                seed=2,
            ),
        )
    )


@pytest.fixture(scope="module")
def two_ranks(model_dir, untied_dir):
    """One spawn of 2 gloo ranks runs every distributed check (spawning and importing cost ~10 s)."""
    return run_distributed(_all_checks_worker, 2, model_dir, untied_dir)


@pytest.fixture
def parity(two_ranks):
    return [r["parity"] for r in two_ranks]


@pytest.fixture
def weights(two_ranks, untied_dir):
    return [r["weights"] for r in two_ranks], untied_dir


@pytest.fixture
def behaviour(two_ranks):
    return [r["behaviour"] for r in two_ranks]


# ---------------------------------------------------------------------- update parity (2 ranks)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name,mode",
    [
        ("token-mean", "token-mean"),
        ("seq-mean-token-mean", "seq-mean-token-mean"),
        ("token-budget", "seq-mean-token-mean"),
    ],
)
def test_two_rank_accumulated_update_equals_single_process(parity, model_dir, name, mode):
    ref_params, ref_losses, ref_norms, ref_grads = reference_updates(model_dir, [make_batch(0), make_batch(1)], mode)
    ref_params, ref_grads = _numpy(ref_params), _numpy(ref_grads)
    for rank in range(2):
        got = parity[rank][name]
        diff = _max_diff(got["params"], ref_params)
        assert diff < 1e-6, f"{name} rank {rank}: max |param diff| = {diff:.3g}"
        for step in range(2):  # the clipped gradient handed to AdamW, relative to its largest entry
            scale = max(float(np.abs(g).max()) for g in ref_grads[step].values())
            grad_diff = _max_diff(got["grads"][step], ref_grads[step]) / scale
            assert grad_diff < 1e-5, f"{name} rank {rank} step {step}: max relative |grad diff| = {grad_diff:.3g}"
        for step in range(2):
            m = got["metrics"][step]
            assert m["loss"] == pytest.approx(ref_losses[step], rel=1e-5, abs=1e-6)
            assert m["grad_norm"] == pytest.approx(ref_norms[step], rel=1e-5)
            assert m["update_skipped"] == 0.0
        assert got["step"] == 2
    # clipping was active (norm above clip_grad), so the comparison also covers clip_grad_norm_
    assert max(ref_norms) > OPTIM.clip_grad
    # the weights moved: a no-op update would not be a test
    init = _numpy({k: v for k, v in load_causal_lm(model_dir)[0].state_dict().items()})
    assert _max_diff(init, ref_params) > 1e-4


@pytest.mark.distributed
def test_token_budget_gives_ranks_different_micro_batch_counts():
    # precondition of the "token-budget" case above: the dummy micro-batch path is exercised
    counts = [len(micro_batches(rank_rows(make_batch(0), r, 2), max_tokens=14)) for r in range(2)]
    assert counts[0] != counts[1], counts


@pytest.mark.distributed
def test_global_normalizers_under_dp_and_accumulation(parity):
    for rank in range(2):
        assert parity[rank]["global_normalizers"] == (NUM_TOKENS, NUM_SEQS)
        for name in ("token-mean", "seq-mean-token-mean", "token-budget"):
            got = parity[rank][name]
            # every loss_fn call (each micro-batch, dummies included) saw the global counts
            assert {(a, b) for a, b, _ in got["seen"]} == {(NUM_TOKENS, NUM_SEQS)}
            for m in got["metrics"]:
                assert (m["num_tokens"], m["num_seqs"]) == (NUM_TOKENS, NUM_SEQS)
                assert (m["seen_num_tokens"], m["seen_num_seqs"]) == (NUM_TOKENS, NUM_SEQS)
    # the per-micro-batch local counts add up, over micro-batches and ranks, to the global count
    for name in ("token-mean", "token-budget"):
        per_step = [sum(c for _, _, c in parity[r][name]["seen"]) for r in range(2)]
        assert sum(per_step) == 2 * NUM_TOKENS  # two updates
    assert parity[0]["token-mean"]["metrics"][0]["num_micro_batches"] == 2.0


# ----------------------------------------------------------------- full weights, log-probs, reference


@pytest.mark.distributed
def test_full_state_dict_equals_unsharded_weights(weights, model_dir):
    results, untied_dir = weights
    assert results[0]["shard_types"] == ["DTensor"]
    for path, key in ((model_dir, "full"), (untied_dir, "untied_full")):
        expected = _numpy(load_causal_lm(path)[0].state_dict())
        for rank in range(2):
            got = results[rank][key]
            assert list(got) == list(expected)  # every HF name, in order
            assert _max_diff(got, expected) == 0.0
    tied = results[0]["full"]
    assert "lm_head.weight" in tied
    np.testing.assert_array_equal(tied["lm_head.weight"], tied["model.embed_tokens.weight"])
    assert results[0]["num_gathers"] == 1  # the whole tiny model in one bucket (tied weights gathered once)
    untied = results[0]["untied_full"]
    assert not np.array_equal(untied["lm_head.weight"], untied["model.embed_tokens.weight"])


@pytest.mark.distributed
def test_compute_logprobs_equals_plain_hf_forward(weights, model_dir):
    results, _ = weights
    model = load_causal_lm(model_dir)[0]
    batch = make_batch(0)
    with torch.no_grad():
        expected_lp, expected_ent = hf_logprobs(model, batch, with_entropy=True)
    for rank in range(2):
        local = rank_rows(batch, rank, 2)
        rows = slice(rank * 6, rank * 6 + 6)
        mask = local.response_mask.numpy()
        lp, ent = results[rank]["actor_logprobs"]
        np.testing.assert_allclose(lp[mask], expected_lp[rows].numpy()[mask], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(ent[mask], expected_ent[rows].numpy()[mask], atol=1e-5, rtol=1e-5)
        assert (lp[~mask] == 0).all()
        np.testing.assert_allclose(results[rank]["ref_logprobs"], lp, atol=1e-6)
    assert results[0]["actor_training_after"] is True


@pytest.mark.distributed
def test_reference_role(weights):
    results, _ = weights
    for r in results:
        assert r["ref_optimizer"] is None
        assert r["ref_training"] is False
        assert r["ref_no_grads"] and r["ref_unchanged"]
        assert r["ref_logprobs_requires_grad"] is False and r["ref_logprobs_is_inference"] is False
        assert r["ref_rows_seen"] == [2, 2, 2]  # log_prob_micro_batch_size=2 over 6 rows
        assert r["ref_rows_seen_override"] == [5, 1]
        assert "reference" in r["ref_update_error"]


# ------------------------------------------------------------ schedule, bad input, checkpointing


@pytest.mark.distributed
def test_lr_schedule_applied_per_step(behaviour):
    # warm-up 2 steps (0, 0.5 lr), then cosine from lr to 0.1 lr over steps 2..5
    cos = lambda s: max(0.1, 0.45 * math.cos(math.pi * (s - 2) / 3) + 0.55)
    expected = [0.0, 5e-4] + [1e-3 * cos(s) for s in (2, 3, 4)]
    for r in behaviour:
        assert r["lrs"] == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert r["lr_unchanged_after_first"]  # lr 0 at step 0: AdamW moves nothing
        assert r["sched_step"] == 5


def _local(x):
    """A tensor's local part (a DTensor's shard, or the tensor itself)."""
    return x.to_local() if hasattr(x, "to_local") else x


@pytest.mark.distributed
def test_empty_response_batch_is_a_skipped_step(behaviour):
    for r in behaviour:
        m = r["empty_metrics"]
        assert m["update_skipped"] == 1.0 and m["num_tokens"] == 0.0 and m["loss"] == 0.0
        assert r["empty_unchanged"] and r["empty_optimizer_state"] == 0.0
        assert r["empty_step"] == 1


def assert_nonfinite_step_skipped(r: dict, *, grads_dropped_key: str, step_after: int) -> None:
    """A worker's record of a NaN-loss update (no step, gradients dropped, ``update_skipped = 1``)
    followed by a finite one (a real step; ``step`` is ``step_after`` afterwards). Shared by the FSDP
    and Megatron engines' tests."""
    m = r["nan_metrics"]
    assert m["update_skipped"] == 1.0 and math.isnan(m["loss"]) and not math.isfinite(m["grad_norm"])
    assert r["nan_unchanged"] and r[grads_dropped_key]
    good = r["after_nan_metrics"]
    assert good["update_skipped"] == 0.0 and math.isfinite(good["loss"]) and math.isfinite(good["grad_norm"])
    assert r["after_nan_changed"] and r["after_nan_step"] == step_after


@pytest.mark.distributed
def test_nan_loss_skips_the_step(behaviour):
    for r in behaviour:
        assert_nonfinite_step_skipped(r, grads_dropped_key="nan_grads_cleared", step_after=3)


@pytest.mark.distributed
def test_bad_input_errors(behaviour):
    errors = behaviour[0]["errors"]
    assert "empty prompt" in errors["empty_prompt"]
    assert "bool" in errors["bool_mask"]
    assert "clashes" in errors["metric_clash"]
    assert "scalar" in errors["vector_loss"]


@pytest.mark.distributed
def test_gradient_checkpointing_gives_the_same_update(behaviour):
    for r in behaviour:
        (off, m_off), (on, m_on) = r["gc"][False], r["gc"][True]
        assert _max_diff(off, on) < 1e-6
        # 2 updates x 2 micro-batches; checkpointing recomputes each layer's forward in backward
        assert r["gc_layer_calls"] == {False: 4, True: 8}
        assert m_on["loss"] == pytest.approx(m_off["loss"], rel=1e-6)


@pytest.mark.distributed
def test_ppo_loss_on_policy_ratio_is_one(behaviour):
    # compute_logprobs (eval, no grad) and the update's training forward agree: PPO starts on-policy
    for r in behaviour:
        first, _, third = r["ppo_metrics"]
        assert abs(first["ppo_kl"]) < 1e-6 and first["clip_frac"] == 0.0
        assert first["update_skipped"] == 0.0 and math.isfinite(first["loss"])
        assert third["ppo_kl"] != 0.0  # the policy moved away from the old log-probs


@pytest.mark.distributed
def test_bf16_compute_runs(behaviour):
    for r in behaviour:
        assert r["bf16_param_dtype"] == "torch.float32"  # master weights stay fp32
        assert math.isfinite(r["bf16_metrics"]["loss"]) and r["bf16_metrics"]["update_skipped"] == 0.0


# ------------------------------------------------------------------------------- single process


def test_lr_multiplier_matches_verl_formulas():
    const = OptimConfig(lr=2.0, lr_warmup_steps=4)
    assert [lr_multiplier(const, s) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_at(const, 1) == 0.5
    cos = OptimConfig(lr_scheduler_type="cosine", total_training_steps=10, lr_warmup_steps_ratio=0.2)
    assert warmup_steps(cos) == 2
    assert lr_multiplier(cos, 2) == pytest.approx(1.0)
    assert lr_multiplier(cos, 6) == pytest.approx(0.5)  # half-way through the decay
    assert lr_multiplier(cos, 10) == pytest.approx(0.0, abs=1e-12)
    floor = OptimConfig(lr_scheduler_type="cosine", total_training_steps=10, min_lr_ratio=0.2)
    assert lr_multiplier(floor, 10) == pytest.approx(0.2)
    one_indexed = OptimConfig(lr_scheduler_type="cosine", total_training_steps=10, zero_indexed_step=False)
    zero_indexed = OptimConfig(lr_scheduler_type="cosine", total_training_steps=10)
    assert lr_multiplier(one_indexed, 4) == pytest.approx(lr_multiplier(zero_indexed, 5))


def test_optim_config_errors():
    with pytest.raises(ValueError, match="total_training_steps"):
        lr_at(OptimConfig(lr_scheduler_type="cosine"), 0)
    with pytest.raises(ValueError, match="total_training_steps"):
        warmup_steps(OptimConfig(lr_warmup_steps_ratio=0.1))
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        OptimConfig(lr_scheduler_type="linear")
    with pytest.raises(ValueError, match="lr must be > 0"):
        OptimConfig(lr=0.0)
    with pytest.raises(ValueError, match="betas"):
        OptimConfig(betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="no trainable"):
        build_optimizer([torch.nn.Parameter(torch.ones(2), requires_grad=False)], OptimConfig())
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        FSDPConfig(max_tokens_per_micro_batch=0)


def test_micro_batches_and_trim():
    batch = make_batch(0)
    assert [mb.prompt_ids.shape[0] for mb in micro_batches(batch, micro_batch_size=5)] == [5, 5, 2]
    budget = micro_batches(batch, max_tokens=14)
    tokens = [int(mb.prompt_mask.sum() + mb.response_mask.sum()) for mb in budget]
    assert max(tokens) <= 14 and sum(tokens) == sum(PROMPT_LENS) + sum(RESPONSE_LENS)
    with pytest.raises(ValueError, match="more than the micro-batch budget"):
        micro_batches(batch, max_tokens=5)
    # rows 1..3: prompts of 3, 5, 2 tokens (2 padding columns drop), responses of 1, 4, 0 tokens
    trimmed = trim_micro_batch(select(batch, slice(1, 4)))
    assert trimmed.prompt_ids.shape == (3, 5) and trimmed.response_ids.shape == (3, 4)
    assert trimmed.advantages.shape == (3, 4)
    assert torch.equal(trimmed.response_mask, batch.response_mask[1:4, :4])
    # all-empty responses keep one column
    empty = select(batch, [3])
    assert trim_micro_batch(empty).response_ids.shape == (1, 1)


@pytest.mark.distributed
def test_a_row_over_the_token_budget_on_one_rank_fails_on_every_rank(behaviour):
    for grouping in ("sequential", "balanced"):
        assert "budget" in behaviour[0]["budget_errors"][grouping]
        assert "another data-parallel rank" in behaviour[1]["budget_errors"][grouping]


@pytest.mark.distributed
@pytest.mark.parametrize("which", ["some", "some_budget", "all"])
def test_skipping_zero_advantage_rows_leaves_the_update_unchanged(behaviour, model_dir, which):
    """Rows with all-zero advantages skipped (rank 0: every row, so it runs dummies only) equal the
    update that runs them; with every row skipped on both ranks AdamW still steps (weight decay)."""
    checks = [b[f"skip_{which}"] for b in behaviour]
    assert checks[0]["skipped"] == checks[0]["rows"]  # rank 0 skips all its rows in both cases
    assert 0 < checks[1]["skipped"] < checks[1]["rows"] or which == "all"
    for c in checks:
        (full, m_full), (skipped, m_skip) = c["runs"][False], c["runs"][True]
        assert max(float(np.abs(full[k] - skipped[k]).max()) for k in full) < 1e-6
        for key in ("loss", "grad_norm", "num_tokens", "num_seqs"):
            assert m_skip[key] == pytest.approx(m_full[key], rel=1e-5, abs=1e-7)
        if which == "all":
            assert m_full["grad_norm"] == 0.0 and m_skip["num_micro_batches"] == 0.0
    first = behaviour[0]["skip_all"]["runs"][True][0]
    initial = {k: v.float().numpy() for k, v in load_causal_lm(model_dir)[0].state_dict().items()}
    assert max(float(np.abs(first[k] - initial[k]).max()) for k in first) > 0  # weight decay moved them


# ------------------------------------------------------------------ non-finite policy (optim.nonfinite)


@pytest.mark.parametrize("policy", ["skip", "error"])
def test_nonfinite_policy_on_one_process(model_dir, policy, tmp_path):
    """A NaN loss (a NaN advantages batch is refused earlier, by the batch checks) through the real engine update (one
    process): ``skip`` leaves the weights as they were and counts the update in the running total
    ``nonfinite_updates_skipped``; ``error`` raises naming the update and the non-finite value, before any optimizer
    step. Either way the weights never change."""
    import attrs

    from backends.distributed.setup import init_distributed
    from backends.training.common import NonFiniteUpdateError
    from backends.training.fsdp import build_actor, update

    state = build_actor(
        model_dir, init_distributed(), attrs.evolve(OPTIM, nonfinite=policy), FSDPConfig(micro_batch_size=4)
    )
    batch = make_batch(0)
    params = lambda: [_local(p).detach().clone() for p in state.module.parameters()]
    p0 = params()
    if policy == "error":
        with pytest.raises(NonFiniteUpdateError, match=r"actor update 0 .*non-finite loss and grad norm"):
            update(state, batch, _nan_loss)
        assert _same(p0, params()) and all(p.grad is None for p in state.module.parameters())
        assert not any(s for s in state.optimizer.state.values() if float(s.get("step", 0)) > 0)
        return
    totals = []
    for _ in range(2):
        state, m = update(state, batch, _nan_loss)
        assert m["update_skipped"] == 1.0 and math.isnan(m["loss"])
        totals.append(m["nonfinite_updates_skipped"])
    assert totals == [1.0, 2.0] and state.nonfinite_updates_skipped == 2 and state.step == 2
    assert _same(p0, params())
    state, m = update(state, batch, pg_loss)  # a finite update steps, the running total stays
    assert m["update_skipped"] == 0.0 and m["nonfinite_updates_skipped"] == 2.0 and not _same(p0, params())
    from backends.checkpoint.dcp import load_checkpoint, save_checkpoint  # the total survives a checkpoint

    save_checkpoint(tmp_path, 3, {"actor": state}, {"step": 3})
    fresh = build_actor(model_dir, init_distributed(), OPTIM, FSDPConfig(micro_batch_size=4))
    states, _ = load_checkpoint(tmp_path / "step_3", {"actor": fresh})
    assert states["actor"].nonfinite_updates_skipped == 2 and states["actor"].step == 3

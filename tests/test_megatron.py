"""Megatron-core backend on 2 real gloo ranks: TP=2 / PP=2 / DP=2 equal the HF model and the FSDP engine.

Each spawned worker checks several layouts one after another in the same processes (megatron's
parallel state is global: it is destroyed and re-created between layouts). The tiny models have an
odd vocabulary (83, padded to 84 for TP=2), head_dim 32, 2 KV heads (TP=2 gives one per rank) and two
layers (PP=2 gives one per stage); one is a tied Qwen2 (qkv bias), one an untied Llama.
"""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest
import torch

from backends.models import TinyModelConfig, load_causal_lm, load_value_model, write_tiny_model
from rlfunc.aggregation import aggregate
from tests.distributed import run_distributed
from tests.test_fsdp_engine import (
    OPTIM,
    _max_diff,
    _nan_loss,
    _numpy,
    _ppo_loss,
    assert_nonfinite_step_skipped,
    hf_logprobs,
    make_batch,
    pg_loss,
    rank_rows,
    reference_updates,
)

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

QWEN = TinyModelConfig(
    arch="qwen2",
    hidden_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=192,
    max_position_embeddings=64,
    seed=3,
)
LLAMA = TinyModelConfig(
    arch="llama",
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=2,
    intermediate_size=96,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    rope_theta=5e5,
    seed=4,
)
LAYOUTS = [(2, 1), (1, 2), (1, 1)]  # (tp, pp) on 2 ranks: TP=2, PP=2, DP=2


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    return {"qwen2": str(write_tiny_model(root / "qwen2", QWEN)), "llama": str(write_tiny_model(root / "llama", LLAMA))}


# --------------------------------------------------------------------- workers (module level: spawned)


def _hf_grads(model_dir, batch):
    model, _ = load_causal_lm(model_dir)
    model.train()
    loss = aggregate(-batch.advantages * hf_logprobs(model, batch), batch.response_mask, mode="token-mean")
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if model.config.tie_word_embeddings:
        grads["lm_head.weight"] = grads["model.embed_tokens.weight"]
    return grads


def _megatron_grads(state, batch):
    """The engine's accumulated, stage/replica-synced gradients, gathered in HF names."""
    from backends.training.common import gather_counts
    from backends.training.megatron import engine as E
    from backends.training.megatron import update as U
    from backends.training.megatron.convert import gather_hf_state
    from backends.training.megatron.layout import layout_micro_batch
    from backends.training.megatron.pipeline import run_micro_batch
    from rlfunc.aggregation import local_normalizers

    mbs = E._micro_batches(state, batch, 4)  # 12 rows -> 3 micro-batches
    norms = gather_counts(
        local_normalizers(batch.response_mask),
        len(mbs),
        group=state.dp_group,
        group_size=state.dp_size,
        device=state.env.device,
    )[0]
    for mb in mbs:
        inp = layout_micro_batch(mb, state.cfg.layout)

        def head(out, mb=mb, inp=inp):
            return pg_loss(E.head_outputs(state, out, inp, mb, False), mb, norms)

        run_micro_batch(
            state.module, state.dims, inp, head, hidden_size=state.shape.hidden_size, dtype=torch.float32, backward=True
        )
    U._sync_grads(state)
    with torch.no_grad():
        saved = {n: p.detach().clone() for n, p in state.module.named_parameters()}
        for p in state.module.parameters():
            p.copy_(p.grad)
        grads = {k: v.clone() for k, v in gather_hf_state(state.module, state.shape, state.dims)}  # (views)
        for n, p in state.module.named_parameters():
            p.copy_(saved[n])
            p.grad = None
    return grads


def _logits(state, batch):
    """Full-vocab logits (b s v) of left-aligned rows, gathered over TP for the test only."""
    import torch.distributed as dist

    from backends.training.megatron.layout import layout_micro_batch
    from backends.training.megatron.pipeline import run_micro_batch

    inp = layout_micro_batch(batch, "bshd")
    with torch.no_grad():
        out = run_micro_batch(
            state.module,
            state.dims,
            inp,
            lambda o: o,
            hidden_size=state.shape.hidden_size,
            dtype=torch.float32,
            backward=False,
        )
    if out is None:
        return None
    if state.dims.tp > 1:
        parts = [torch.empty_like(out) for _ in range(state.dims.tp)]
        dist.all_gather(parts, out.contiguous(), group=state.dims.tp_group)
        out = torch.cat(parts, -1)
    return out[..., : state.shape.vocab_size], inp


def _hf_aligned_logits(model, batch, inp):
    """HF logits at the left-aligned positions (HF runs the left-padded rows with position_ids); valid:
    the real prompt and response tokens (HF's attention mask hides response padding, the engine's not)."""
    attention_mask = batch.attention_mask.long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch.input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    p = batch.prompt_ids.shape[1]
    plen = batch.prompt_mask.sum(-1)
    out = torch.zeros(inp.input_ids.shape + (logits.shape[-1],))
    valid = torch.zeros(inp.input_ids.shape, dtype=torch.bool)
    for i in range(batch.prompt_ids.shape[0]):
        n = int(plen[i]) + batch.response_ids.shape[1]
        out[i, :n] = logits[i, p - int(plen[i]) :]
        valid[i, : int(plen[i]) + int(batch.response_mask[i].sum())] = True
    return out, valid


def _parity_worker(rank, world_size, dirs):
    from backends.distributed.setup import init_distributed
    from backends.training.megatron import engine as E
    from backends.training.megatron import update as U
    from backends.training.megatron.parallel import destroy_model_parallel

    env = init_distributed()
    batch = make_batch(0)
    results = {}
    for arch, model_dir in dirs.items():
        hf, _ = load_causal_lm(model_dir)
        with torch.no_grad():
            hf_lp, hf_ent = hf_logprobs(hf, batch, with_entropy=True)
        hf_grads = _hf_grads(model_dir, batch)
        ref_params, ref_losses, ref_norms, _ = reference_updates(model_dir, [batch, make_batch(1)], "token-mean")
        original = dict(hf.state_dict())
        for tp, pp in LAYOUTS:
            key = f"{arch}-tp{tp}-pp{pp}"
            r = results[key] = {}
            state = E.build_actor(model_dir, env, OPTIM, E.MegatronConfig(tp=tp, pp=pp, micro_batch_size=4))
            local = batch if tp * pp == 2 else rank_rows(batch, rank, world_size)  # dp=2: half the rows each
            got = _logits(state, batch)
            if got is not None:
                logits, inp = got
                with torch.no_grad():
                    want, valid = _hf_aligned_logits(hf, batch, inp)
                r["logits"] = float((logits - want)[valid].abs().max())
            for layout in ("bshd", "thd"):
                s = state.replace(cfg=E.MegatronConfig(tp=tp, pp=pp, micro_batch_size=5, layout=layout))
                out = E.compute_logprobs(s, batch, with_entropy=True)
                m = batch.response_mask
                r[f"logprobs_{layout}"] = float((out.logprobs - torch.where(m, hf_lp, 0.0)).abs().max())
                r[f"entropy_{layout}"] = float((out.entropy - hf_ent)[m].abs().max())
            if tp * pp == 2:
                grads = _megatron_grads(state, batch)
                r["grads"] = max(float((grads[n] - g).abs().max()) for n, g in hf_grads.items())
                r["grad_names"] = sorted(set(grads) ^ set(hf_grads))
            # round trip before any update: exact, and the dir loads in transformers
            out_dir = f"{model_dir}-export-{key}"
            E.export_hf(state, out_dir)
            if env.is_main:
                from transformers import AutoModelForCausalLM

                sd = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True).state_dict()
                r["roundtrip_exact"] = set(sd) == set(original) and all(torch.equal(sd[k], original[k]) for k in sd)
                r["roundtrip_config"] = json.load(open(f"{out_dir}/config.json"))["architectures"]
            try:  # every rank refuses to export over the dir (none writes, none waits for the others)
                E.export_hf(state, out_dir)
                r["export_again"] = "written"
            except FileExistsError:
                r["export_again"] = "refused"
            E.export_hf(state, out_dir, overwrite=True)
            metrics = []
            for b in (batch, make_batch(1)):
                b_local = b if tp * pp == 2 else rank_rows(b, rank, world_size)
                state, m = U.update(state, b_local, pg_loss)
                metrics.append(m)
            r["metrics"] = metrics
            params = _numpy(dict(E.full_state_dict(state)))
            r["params"] = _max_diff({k: v for k, v in params.items() if k in ref_params}, _numpy(ref_params))
            r["ref_norms"], r["ref_losses"] = ref_norms, ref_losses
            del local
            destroy_model_parallel()
    return results


def _roles_worker(rank, world_size, dirs):
    """Critic (values, update, export) and reference on TP=2, then PP=2; PPO update vs the FSDP engine."""
    from backends.distributed.setup import init_distributed
    from backends.training import fsdp as F
    from backends.training.megatron import engine as E
    from backends.training.megatron import update as U
    from backends.training.megatron.parallel import destroy_model_parallel

    env = init_distributed()
    model_dir = dirs["qwen2"]
    batch = make_batch(0)
    out = {}
    value_model, _ = load_value_model(model_dir, seed=7)
    attention_mask = batch.attention_mask.long()
    with torch.no_grad():
        v = value_model(
            input_ids=batch.input_ids,
            attention_mask=attention_mask,
            position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        ).logits[..., 0]
    p, t = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    want_values = torch.where(batch.response_mask, v[:, p - 1 : p + t - 1], 0.0)
    for tp, pp in [(2, 1), (1, 2)]:
        key = f"tp{tp}-pp{pp}"
        critic = E.build_critic(model_dir, env, OPTIM, E.MegatronConfig(tp=tp, pp=pp, micro_batch_size=4), seed=7)
        values = E.compute_values(critic, batch)
        out[f"values-{key}"] = float((values - want_values).abs().max())
        vb = batch.replace(
            returns=torch.randn(batch.response_ids.shape, generator=torch.Generator().manual_seed(2)), old_values=values
        )
        critic, m = U.update(critic, vb, E.value_loss_fn())
        out[f"critic_metrics-{key}"] = m
        E.export_hf(critic, f"{model_dir}-critic-{key}")
        if env.is_main:
            loaded, _ = load_value_model(f"{model_dir}-critic-{key}")
            out[f"critic_export-{key}"] = type(loaded).__name__
        ref = E.build_reference(model_dir, env, E.MegatronConfig(tp=tp, pp=pp), log_prob_micro_batch_size=3)
        out[f"ref_no_grads-{key}"] = all(not q.requires_grad for q in ref.module.parameters())
        try:
            U.update(ref, batch, pg_loss)
        except ValueError as e:
            out[f"ref_update_error-{key}"] = str(e)
        destroy_model_parallel()

    # one PPO update (rlfunc's clipped loss) with Megatron TP=2 vs the FSDP engine, same global batch
    ppo_batch = batch.replace(old_logprobs=None)
    ref = E.build_reference(model_dir, env, E.MegatronConfig(tp=2))
    ppo_batch = ppo_batch.replace(old_logprobs=E.compute_logprobs(ref, batch).logprobs - 0.05 * batch.advantages.tanh())
    destroy_model_parallel()
    actor = E.build_actor(model_dir, env, OPTIM, E.MegatronConfig(tp=2, micro_batch_size=4))
    actor, mm = U.update(actor, ppo_batch, _ppo_loss)
    megatron_params = _numpy(dict(E.full_state_dict(actor)))
    destroy_model_parallel()
    fsdp = F.build_actor(model_dir, env, OPTIM, F.FSDPConfig(micro_batch_size=4))
    fsdp, fm = F.update(fsdp, rank_rows(ppo_batch, rank, world_size), _ppo_loss)
    fsdp_params = _numpy(dict(F.full_state_dict(fsdp)))
    out["ppo_params"] = _max_diff(megatron_params, fsdp_params)
    out["ppo_metrics"] = (mm, fm)
    return out


@pytest.fixture(scope="module")
def parity(model_dirs):
    return run_distributed(_parity_worker, 2, model_dirs, timeout=600)


@pytest.fixture(scope="module")
def roles(model_dirs):
    return run_distributed(_roles_worker, 2, model_dirs, timeout=600)


# ------------------------------------------------------------------------------------------- tests


def _keys(arch):
    return [f"{arch}-tp{tp}-pp{pp}" for tp, pp in LAYOUTS]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_logits_and_logprobs_equal_hf(parity, arch):
    for key in _keys(arch):
        last = [r[key] for r in parity if "logits" in r[key]]
        assert last, key
        for r in last:
            assert r["logits"] < 1e-5, (key, r["logits"])
        for r in parity:  # every rank gets the log-probs (the last stage broadcasts)
            for layout in ("bshd", "thd"):
                assert r[key][f"logprobs_{layout}"] < 1e-5, (key, layout, r[key])
                assert r[key][f"entropy_{layout}"] < 1e-5, (key, layout, r[key])


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gradients_equal_hf(parity, arch):
    for key in _keys(arch)[:2]:  # TP=2 and PP=2 (the tied embedding's two copies summed across stages)
        for r in parity:
            assert r[key]["grad_names"] == [], r[key]["grad_names"]
            assert r[key]["grads"] < 1e-5, (key, r[key]["grads"])


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_updates_equal_single_process_hf(parity, arch):
    """Two AdamW steps (grad accumulation over 3 micro-batches, clipping, LR schedule) on TP=2, PP=2
    and DP=2 give the single-process HF model's parameters, loss and grad norm."""
    for key in _keys(arch):
        for r in parity:
            res = r[key]
            assert res["params"] < 2e-6, (key, res["params"])
            for m, loss, norm in zip(res["metrics"], res["ref_losses"], res["ref_norms"]):
                assert m["update_skipped"] == 0.0
                assert m["loss"] == pytest.approx(loss, abs=1e-6)
                assert m["grad_norm"] == pytest.approx(norm, rel=1e-5)
                assert m["seen_num_tokens"] == m["num_tokens"]
        assert parity[0][key]["metrics"] == parity[1][key]["metrics"]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_hf_round_trip_is_exact_and_loads_in_transformers(parity, arch):
    want = "Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"
    for key in _keys(arch):
        assert parity[0][key]["roundtrip_exact"] is True, key
        assert parity[0][key]["roundtrip_config"] == [want]
        assert [r[key]["export_again"] for r in parity] == ["refused", "refused"], key  # an existing dir, no overwrite


def test_critic_values_update_and_export(roles):
    for key in ("tp2-pp1", "tp1-pp2"):
        for r in roles:
            assert r[f"values-{key}"] < 1e-5, (key, r[f"values-{key}"])
            m = r[f"critic_metrics-{key}"]
            assert m["update_skipped"] == 0.0 and np.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
        assert roles[0][f"critic_metrics-{key}"] == roles[1][f"critic_metrics-{key}"]
        assert roles[0][f"critic_export-{key}"] == "Qwen2ForTokenClassification"


def test_reference_role(roles):
    for key in ("tp2-pp1", "tp1-pp2"):
        for r in roles:
            assert r[f"ref_no_grads-{key}"]
            assert "needs a trainable state" in r[f"ref_update_error-{key}"]


def test_ppo_update_equals_fsdp_engine(roles):
    """rlfunc's PPO loss: one Megatron TP=2 update == one FSDP2 update (2 ranks) on the same global batch."""
    for r in roles:
        assert r["ppo_params"] < 2e-6, r["ppo_params"]
        mm, fm = r["ppo_metrics"]
        assert mm["loss"] == pytest.approx(fm["loss"], abs=1e-6)
        assert mm["grad_norm"] == pytest.approx(fm["grad_norm"], rel=1e-5)
        assert mm["clip_frac"] == pytest.approx(fm["clip_frac"], abs=1e-6)


def _nonfinite_worker(rank, world_size, model_dir):
    """The skip decision on every layout when only one rank sees a non-finite value; then a NaN loss
    through the engine (TP=2): no step, gradients dropped, the next update steps."""
    from backends.distributed.setup import init_distributed
    from backends.training.megatron import engine as E
    from backends.training.megatron import update as U
    from backends.training.megatron.parallel import destroy_model_parallel, init_model_parallel

    env = init_distributed()
    out = {}
    nan, inf = float("nan"), float("inf")
    for tp, pp in LAYOUTS:  # the flag crosses the TP group, the PP group, the DP group
        dims = init_model_parallel(tp, pp)
        out[f"tp{tp}-pp{pp}"] = {
            "nan_loss_on_rank_1": U._nonfinite_on_any_rank((nan if rank == 1 else 1.0, 2.0), dims, env.device),
            "inf_norm_on_rank_0": U._nonfinite_on_any_rank((1.0, inf if rank == 0 else 2.0), dims, env.device),
            "finite_everywhere": U._nonfinite_on_any_rank((1.0 + rank, 2.0), dims, env.device),
        }
        destroy_model_parallel()

    state = E.build_actor(model_dir, env, OPTIM, E.MegatronConfig(tp=2, micro_batch_size=4))
    before = [p.detach().clone() for p in state.module.parameters()]
    batch = make_batch(0)
    state, m = U.update(state, batch, _nan_loss)
    out["nan_metrics"] = m
    out["nan_unchanged"] = all(torch.equal(a, p) for a, p in zip(before, state.module.parameters()))
    out["nan_grads_dropped"] = all(p.grad is None for p in state.module.parameters())
    state, m = U.update(state, batch, pg_loss)
    out["after_nan_metrics"] = m
    out["after_nan_changed"] = not all(torch.equal(a, p) for a, p in zip(before, state.module.parameters()))
    out["after_nan_step"] = state.step
    out["skipped_totals"] = (out["nan_metrics"]["nonfinite_updates_skipped"], m["nonfinite_updates_skipped"])
    # optim.nonfinite=error: raises on every rank, naming the update, before any optimizer step
    import attrs

    state = E.build_actor(
        model_dir, env, attrs.evolve(OPTIM, nonfinite="error"), E.MegatronConfig(tp=2, micro_batch_size=4)
    )
    before = [p.detach().clone() for p in state.module.parameters()]
    try:
        U.update(state, batch, _nan_loss)
        out["error"] = None
    except FloatingPointError as e:
        out["error"] = str(e)
    out["error_unchanged"] = all(torch.equal(a, p) for a, p in zip(before, state.module.parameters()))
    destroy_model_parallel()
    return out


def test_non_finite_loss_or_grad_norm_on_one_rank_skips_the_step_on_every_rank(model_dirs):
    """As the FSDP engine: no step, gradients dropped, ``update_skipped = 1``, ``step`` advances; every
    rank takes the same decision (the GPU schedule's megatron optimizer relies on this check)."""
    results = run_distributed(_nonfinite_worker, 2, model_dirs["qwen2"])
    for r in results:
        for tp, pp in LAYOUTS:
            flags = r[f"tp{tp}-pp{pp}"]
            want = {"nan_loss_on_rank_1": True, "inf_norm_on_rank_0": True, "finite_everywhere": False}
            assert flags == want, (tp, pp, flags)
        assert_nonfinite_step_skipped(r, grads_dropped_key="nan_grads_dropped", step_after=2)
        assert r["skipped_totals"] == (1.0, 1.0)  # optim.nonfinite=skip: a running total
        assert "actor update 0 " in r["error"] and "non-finite loss" in r["error"] and r["error_unchanged"]


# ------------------------------------------------------------------------ bad input (single process)


def test_unsupported_architectures_and_sizes_fail_before_loading(tmp_path):
    from backends.training.megatron.engine import MegatronConfig, build_actor
    from backends.training.megatron.model import check_parallel_sizes, model_shape

    with pytest.raises(ValueError, match="unsupported architecture model_type='gpt2'"):
        model_shape({"model_type": "gpt2", "n_embd": 64})
    with pytest.raises(ValueError, match="sliding-window"):
        model_shape(
            {
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 4096,
                "hidden_size": 64,
                "num_attention_heads": 2,
            }
        )
    with pytest.raises(ValueError, match="unsupported architecture model_type='mistral'"):
        model_shape({"model_type": "mistral", "sliding_window": 4096})
    shape = model_shape(
        QWEN
        and {
            "model_type": "qwen2",
            "vocab_size": 83,
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 192,
        }
    )
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=4"):
        check_parallel_sizes(shape, 3, 1)
    with pytest.raises(ValueError, match="tp=4 does not divide num_key_value_heads=2"):
        check_parallel_sizes(shape, 4, 1)
    with pytest.raises(ValueError, match="pp=3 does not divide num_hidden_layers=2"):
        check_parallel_sizes(shape, 1, 3)
    # through the engine: the error comes from config.json alone (no weights file is needed to fail)
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture model_type='gpt2'"):
        build_actor(model_dir, cfg=MegatronConfig(tp=2))
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 83,
                "hidden_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 192,
            }
        )
    )
    with pytest.raises(ValueError, match="tp=4 does not divide num_key_value_heads=2"):
        build_actor(model_dir, cfg=MegatronConfig(tp=4))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_actor(tmp_path / "missing")


def test_engine_selection_errors():
    from backends.training.engines import select_engine

    with pytest.raises(ValueError, match="unknown backend 'megatorn'"):
        select_engine("megatorn")
    with pytest.raises(ValueError, match="actor.tp=2 / actor.pp=1 need actor.backend=megatron"):
        select_engine("fsdp", tp=2)
    assert select_engine("megatron", tp=2).config.tp == 2


# ------------------------------------------------------------------------------- the GRPO recipe


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["actor.tp=2", "actor.pp=2"])
def test_grpo_recipe_runs_on_megatron(tmp_path, layout):
    """experiments/grpo.py with actor.backend=megatron on 2 torchrun ranks (actor and reference on megatron,
    the SFT stage through the megatron engine, weights synced into the native rollout engine every step)."""
    from tests.recipes import GRPO, TINY_MODEL, arithmetic_data, data_args, metrics, run, the_run_dir

    data = arithmetic_data(tmp_path / "data")
    out = run(
        GRPO,
        f"run_root={tmp_path / 'runs'}",
        *data_args(data),
        *TINY_MODEL,
        "model.tiny.num_kv_heads=2",
        "model.tiny.num_layers=2",
        "steps=3",
        "prompts_per_step=4",
        "rollout.n=4",
        "eval.max_prompts=8",
        "algo.kl_loss_coef=0.01",
        "actor.backend=megatron",
        layout,
        nproc=2,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    run_dir = the_run_dir(tmp_path / "runs", "grpo")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["world_size"] == 2
    rl = metrics(run_dir)
    assert [r["step"] for r in rl] == [1, 2, 3]
    for key in ("reward_mean", "kl_loss", "entropy", "grad_norm", "loss"):
        assert key in rl[-1] and np.isfinite(rl[-1][key]), key
    assert [r["step"] for r in metrics(run_dir, rl_only=False) if "sft_loss" in r]  # the SFT stage ran on megatron
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run_dir / "sft_model", local_files_only=True)  # exported by megatron
    AutoModelForCausalLM.from_pretrained(run_dir / "final_model", local_files_only=True)


@pytest.mark.slow
def test_ppo_recipe_runs_on_megatron(tmp_path):
    """experiments/ppo.py with the actor and the critic on megatron (TP=2, 2 torchrun ranks): the critic
    learns values, the KL controller runs, both roles export HF dirs transformers loads."""
    from tests.recipes import PPO, TINY_MODEL, arithmetic_data, data_args, metrics, run, the_run_dir

    data = arithmetic_data(tmp_path / "data")
    out = run(
        PPO,
        f"run_root={tmp_path / 'runs'}",
        *data_args(data),
        *TINY_MODEL,
        "model.tiny.num_kv_heads=2",
        "model.tiny.num_layers=2",
        "steps=3",
        "prompts_per_step=4",
        "rollout.n=4",
        "eval.max_prompts=8",
        "algo.critic_warmup=1",
        "algo.kl_ctrl=adaptive",
        "actor.backend=megatron",
        "actor.tp=2",
        nproc=2,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    run_dir = the_run_dir(tmp_path / "runs", "ppo")
    rl = metrics(run_dir)
    assert [r["step"] for r in rl] == [1, 2, 3]
    for key in ("reward_mean", "critic/loss", "kl_reward", "kl_coef", "values_mean", "loss", "grad_norm", "entropy"):
        assert key in rl[-1] and np.isfinite(rl[-1][key]), key
    assert "loss" not in rl[0]  # critic warm-up: the actor waits a step
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    AutoModelForCausalLM.from_pretrained(run_dir / "final_model", local_files_only=True)
    AutoModelForTokenClassification.from_pretrained(run_dir / "final_critic", local_files_only=True)


# ----------------------------------------------------------------------------------- GPU (megatron's)


@pytest.mark.gpu
def test_megatron_schedule_and_distributed_optimizer_on_gpu(model_dirs):
    """On CUDA the engine runs megatron's own schedule, DDP and DistributedOptimizer (one process)."""
    from backends.distributed.setup import init_distributed
    from backends.training.megatron import engine as E
    from backends.training.megatron import update as U
    from backends.training.megatron.parallel import destroy_model_parallel

    env = init_distributed()
    cfg = E.MegatronConfig(param_dtype="float32", micro_batch_size=4)
    batch = make_batch(0)
    for layout in ("bshd", "thd"):
        actor = E.build_actor(model_dirs["qwen2"], env, OPTIM, attrs.evolve(cfg, layout=layout))
        assert actor.uses_megatron_schedule
        out = E.compute_logprobs(actor, batch, with_entropy=True)
        hf, _ = load_causal_lm(model_dirs["qwen2"])
        with torch.no_grad():
            want = hf_logprobs(hf, batch)
        m = batch.response_mask
        assert float((out.logprobs.cpu() - torch.where(m, want, 0.0)).abs().max()) < 1e-4
        actor, metrics = U.update(actor, batch, pg_loss)
        assert metrics["update_skipped"] == 0.0 and np.isfinite(metrics["grad_norm"])
        assert len(dict(E.full_state_dict(actor))) == len(hf.state_dict())
        destroy_model_parallel()


@pytest.mark.gpu
def test_megatron_optimizer_skips_a_non_finite_step_on_gpu(model_dirs):
    """bf16 has no loss scaler, so megatron's optimizer would step on NaN gradients: the engine's check
    skips the step and drops the gradients (DDP buffers zeroed), as the FSDP engine does."""
    from backends.distributed.setup import init_distributed
    from backends.training.megatron import engine as E
    from backends.training.megatron import update as U
    from backends.training.megatron.parallel import destroy_model_parallel

    env = init_distributed()
    actor = E.build_actor(model_dirs["qwen2"], env, OPTIM, E.MegatronConfig(param_dtype="bfloat16", micro_batch_size=4))
    assert actor.uses_megatron_schedule
    batch = make_batch(0)
    before = {k: v.clone() for k, v in E.full_state_dict(actor)}
    actor, m = U.update(actor, batch, _nan_loss)
    assert m["update_skipped"] == 1.0 and np.isnan(m["loss"]) and not np.isfinite(m["grad_norm"])
    assert all(torch.equal(before[k], v) for k, v in E.full_state_dict(actor))
    assert all(not bool(b.grad_data.any()) for b in actor.module.buffers)
    actor, m = U.update(actor, batch, pg_loss)
    assert m["update_skipped"] == 0.0 and np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]) and actor.step == 2
    assert any(not torch.equal(before[k], v) for k, v in E.full_state_dict(actor))
    destroy_model_parallel()


@pytest.mark.gpu
def test_fresh_optimizer_keeps_the_ddp_wrapper_and_its_gradient_buffers_on_gpu(model_dirs):
    """After an SFT stage the new megatron optimizer reads the gradient buffers that the state's own
    DDP module fills, reduces and zeroes (not those of a second wrapper)."""
    from backends.distributed.setup import init_distributed
    from backends.training.megatron import engine as E
    from backends.training.megatron import update as U
    from backends.training.megatron.parallel import destroy_model_parallel

    env = init_distributed()
    actor = E.build_actor(model_dirs["qwen2"], env, OPTIM, E.MegatronConfig(param_dtype="bfloat16", micro_batch_size=4))
    batch = make_batch(0)
    actor, _ = U.update(actor, batch, pg_loss)
    fresh = E.fresh_optimizer(actor, OPTIM)
    assert fresh.module is actor.module and fresh.optimizer is not actor.optimizer and fresh.step == 0
    buffers = {b.grad_data.untyped_storage().data_ptr() for b in fresh.module.buffers}
    params = [p for p in fresh.module.module.parameters() if p.requires_grad]
    assert params and all(p.main_grad.untyped_storage().data_ptr() in buffers for p in params)
    assert fresh.module.module.config.grad_scale_func == fresh.optimizer.scale_loss
    before = {k: v.clone() for k, v in E.full_state_dict(fresh)}
    fresh, m = U.update(fresh, batch, pg_loss)
    assert m["update_skipped"] == 0.0 and np.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in E.full_state_dict(fresh))
    destroy_model_parallel()


def _rollout_agreement_worker(rank, world_size, model_dir, tp, pp):
    """Update the Megatron actor, sync it into the native rollout engine, and compare the engine's
    sampled-token log-probs with the trainer's for the same tokens (both fp32)."""
    import functools

    import rlfunc as rf
    from backends.distributed.setup import init_distributed
    from backends.models import load_tokenizer
    from backends.rollout.native import SamplingConfig, build_native_rollout, generate, sync_weights
    from backends.training.engines import select_engine
    from backends.training.fsdp import FSDPConfig
    from backends.training.megatron.parallel import destroy_model_parallel
    from backends.training.optim import OptimConfig

    env = init_distributed()
    engine = select_engine("megatron", fsdp=FSDPConfig(micro_batch_size=8), tp=tp, pp=pp)
    actor = engine.build_actor(model_dir, env, OptimConfig(lr=1e-3))
    tokenizer = load_tokenizer(model_dir)
    rollout = build_native_rollout(model_dir, tokenizer)
    prompts = [tokenizer.encode(f"{a}+{b}=") for a, b in zip(range(10, 14), range(1, 5))]
    loss = functools.partial(rf.get_policy_loss("vanilla"), clip_low=0.2, clip_high=0.28, agg="token-mean")
    moved, gaps = [], []
    for step in range(2):
        batch = engine.share_batch(actor, generate(rollout, prompts, SamplingConfig(n=2, max_new_tokens=5), seed=step))
        adv = torch.randn(batch.response_ids.shape[0], generator=torch.Generator().manual_seed(step))[:, None]
        batch = batch.replace(old_logprobs=batch.rollout_logprobs, advantages=adv * batch.response_mask)
        actor, _ = engine.update(
            actor,
            batch,
            lambda out, mb, norms: loss(
                out.logprobs,
                old_logprobs=mb.old_logprobs,
                advantages=mb.advantages,
                response_mask=mb.response_mask,
                norms=norms,
            ),
        )
        before = {k: v.clone() for k, v in rollout.model.state_dict().items()}
        rollout = sync_weights(rollout, engine.full_state_dict(actor))
        moved.append(max(float((v - before[k]).abs().max()) for k, v in rollout.model.state_dict().items()))
        fresh = engine.share_batch(
            actor, generate(rollout, prompts, SamplingConfig(n=2, max_new_tokens=5), seed=10 + step)
        )
        trainer = engine.compute_logprobs(actor, fresh).logprobs
        gaps.append(float(((trainer - fresh.rollout_logprobs).abs() * fresh.response_mask).max()))
    destroy_model_parallel()
    return {"moved": moved, "gaps": gaps}


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_rollout_logprobs_agree_with_the_megatron_trainer_after_weight_sync(model_dirs, tp, pp):
    for result in run_distributed(_rollout_agreement_worker, 2, model_dirs["qwen2"], tp, pp):
        assert min(result["moved"]) > 1e-5  # every sync brought new weights
        assert max(result["gaps"]) < 1e-5, result["gaps"]


def _megatron_reference_worker(rank, world_size, model_dir):
    """Each rank brings different rows (an FSDP-style recipe); the TP=2 reference serves both."""
    from backends.distributed.setup import init_distributed
    from backends.training.fsdp import FSDPConfig
    from backends.training.megatron.parallel import destroy_model_parallel
    from backends.training.reference import ReferenceConfig, build_reference_role, reference_engine

    env = init_distributed()
    local = make_batch(rank, prompt_lens=[(3, 5), (2,)][rank], response_lens=[(4, 2), (6,)][rank])
    cfg, fsdp = ReferenceConfig(backend="megatron", tp=2), FSDPConfig(micro_batch_size=2)
    got = reference_engine(cfg, fsdp).own_rows_logprobs(build_reference_role(cfg, model_dir, env, fsdp), local)
    model, _ = load_causal_lm(model_dir)
    with torch.no_grad():
        want = hf_logprobs(model, local) * local.response_mask
    destroy_model_parallel()
    return {"shape": tuple(got.shape), "want_shape": tuple(want.shape), "gap": float((got - want).abs().max())}


def test_megatron_reference_serves_each_ranks_own_rows(model_dirs):
    for result in run_distributed(_megatron_reference_worker, 2, model_dirs["qwen2"]):
        assert result["shape"] == result["want_shape"]
        assert result["gap"] < 1e-5, result


def test_deferred_parameter_gather_is_refused():
    """megatron's overlap_param_gather would leave the updated weights un-gathered until the next forward, after
    the rollout's weight sync read them: refused with the reason."""
    from backends.training.megatron.engine import MegatronOptimConfig

    with pytest.raises(ValueError, match="overlap_param_gather=True is not supported: .*stale weights"):
        MegatronOptimConfig(overlap_param_gather=True)
    assert MegatronOptimConfig(overlap_grad_reduce=True).overlap_grad_reduce

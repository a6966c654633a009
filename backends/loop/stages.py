"""The stages every recipe shares, around its RL loop: the run dir and resume point, the data, the optional
SFT stage, held-out evaluation, generation dumps, the final export and the summary.

A recipe starts ``prepare_run`` -> ``run_tokenizer`` -> ``load_run_data`` (and its own checks) -> ``commit_run``:
nothing of a run dir is written or removed before the last check has passed.

A recipe's config extends :class:`backends.loop.vocabulary.RunConfig`, the sections these read (``model``,
``data``, ``reward``, ``eval``, ``sft``, ``checkpoint``, ``logger``, ...) declared once, so each recipe keeps only
its own algorithm and loop.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs
import torch.distributed as dist

import rlfunc as rf
from backends.checkpoint.files import checkpoint_info
from backends.checkpoint.hf_export import ExportError
from backends.checkpoint.resume import checkpoint_dir, fork_point, resume_point, truncate_metrics
from backends.config import ConfigError, config_to_dict
from backends.data import Example, PromptStream, data_warnings, load_examples
from backends.distributed import watchdog
from backends.distributed.node_checks import check_shared_paths
from backends.distributed.setup import barrier
from backends.loop.fingerprints import rank_files
from backends.loop.vocabulary import RunConfig
from backends.metrics_log import LOGGERS, MetricsLog, plot_curves, read_jsonl, write_generations
from backends.models import build_char_tokenizer, check_model_dir, load_tokenizer, write_tiny_model
from backends.rewards import BUILTIN_REWARDS, RewardScorer
from backends.rollout.api import ROLLOUT_ENGINES
from backends.rollout.common import decode_responses
from backends.rollout.environments import tool_schemas
from backends.rollout.evaluation import evaluate
from backends.training.sft import SFTExample, load_sft_examples, run_sft, sft_optim, sft_steps

__all__ = [
    "SHARED_REGISTRIES",
    "checkpoint_or_stop",
    "commit_run",
    "export_final",
    "RunData",
    "RunPaths",
    "dump_generations",
    "evaluate_policy",
    "load_run_data",
    "metrics_log",
    "prepare_run",
    "run_tokenizer",
    "start_actor",
    "summarize",
    "warn_once",
]


#: the built-in names of the keys every recipe has, which its --help lists
SHARED_REGISTRIES = {"reward.fn": tuple(BUILTIN_REWARDS), "logger": LOGGERS, "rollout.engine": tuple(ROLLOUT_ENGINES)}


@attrs.frozen
class RunPaths:
    """Where this run reads and writes, and the checkpoint it resumes from (``None``: a fresh start)."""

    run_dir: Path
    ckpt_dir: Path
    model_path: Path  #: the base model: model.path, or the tiny model written into the run dir
    #: the policy RL starts from as an HF dir: the SFT stage's export when there is one, else the base model.
    #: The rollout engine and the reference start from it; a resume loads the checkpoint into its architecture.
    policy_path: Path
    resume_from: Path | None
    must_match: dict  #: the config a checkpoint must have been written with (and this run's are written with)
    forked_from: Path | None = None  #: the run dir of the checkpoint a fork starts from

    @property
    def loaded_config(self) -> dict | None:
        """The config the checkpoint this run starts from must have (None: a fork's, whose model keys
        :func:`backends.checkpoint.resume.fork_point` checked)."""
        return None if self.forked_from is not None else self.must_match


def prepare_run(cfg: RunConfig, env: Any, resumable_keys: Sequence[str]) -> RunPaths:
    """The resume point (checked against this config before anything is built) and the run dir, the same on every
    rank. Nothing is written here: :func:`commit_run` writes once every start-up check has passed, so a typo never
    costs an existing run its records. A fresh start in the dir of a finished run is refused."""
    must_match = {k: v for k, v in config_to_dict(cfg).items() if k not in resumable_keys}
    resume_from, run_dir = resume_point(
        cfg.resume, cfg.checkpoint, run_dir=cfg.run_dir, run_root=cfg.run_root, name=cfg.name, must_match=must_match
    )
    if resume_from is None and (run_dir / "summary.json").is_file():
        how = (
            "it has no checkpoint to continue from (resume=auto found none)"
            if cfg.resume == "auto"
            else "continue it with resume=auto (from its last checkpoint)"
        )
        raise ConfigError(
            f"run_dir={str(run_dir)!r} holds a finished run (its summary.json): a fresh start would "
            f"overwrite its records; {how}, or give another run_dir"
        )
    forked_from = None
    if resume_from is None and cfg.fork_from:
        resume_from, forked_from = fork_point(cfg.fork_from, run_dir=run_dir, model=must_match["model"])
    if cfg.model.path:
        check_model_dir(Path(cfg.model.path))
    model_path = Path(cfg.model.path) if cfg.model.path else run_dir / "base_model"
    return RunPaths(
        run_dir=run_dir,
        ckpt_dir=checkpoint_dir(cfg.checkpoint, run_dir),
        model_path=model_path,
        policy_path=run_dir / "sft_model" if cfg.sft.files else model_path,
        resume_from=resume_from,
        must_match=must_match,
        forked_from=forked_from,
    )


def run_tokenizer(cfg: RunConfig, run: RunPaths) -> Any:
    """The run's tokenizer, with nothing written yet: ``model.path``'s or a resumed run's base model's, else the
    tiny model's, built as :func:`commit_run` will write it (it gives the same ids loaded back: the tokenizer
    tests check it)."""
    if run.forked_from is not None and not cfg.model.path:
        return load_tokenizer(run.forked_from / "base_model")
    if cfg.model.path or run.resume_from is not None:
        return load_tokenizer(run.model_path)
    return build_char_tokenizer(words=cfg.model.tiny_words, model_max_length=cfg.model.tiny.max_position_embeddings)


def commit_run(cfg: RunConfig, env: Any, run: RunPaths, tokenizer: Any) -> None:
    """After every start-up check: rank 0 writes the run dir (the config and, without ``model.path``, the tiny
    base model with ``tokenizer``); a fresh start begins a new metrics log, a resumed one drops what the crashed
    run logged after its checkpoint."""
    if env.is_main:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        resumed_at = checkpoint_info(run.resume_from).step if run.resume_from else None
        if run.forked_from is not None:
            start_fork(cfg, run)
        # what the crashed run (or a forked run after the fork's step) wrote after the checkpoint goes
        for log in [run.run_dir / "metrics.jsonl", *rank_files(run.run_dir)]:
            truncate_metrics(log, resumed_at)
        if run.resume_from is None or run.forked_from is not None:
            (run.run_dir / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
            if not cfg.model.path and run.forked_from is None:
                write_tiny_model(run.model_path, cfg.model.tiny, tokenizer)
    barrier()
    check_shared_paths(run.run_dir, {"model.path": run.model_path, **shared_inputs(cfg)})  # a node that does not


def start_fork(cfg: RunConfig, run: RunPaths) -> None:
    """A fork's run dir from its parent's: the models it starts from (hard links where the file system allows) and
    the logs up to the fork's step (cut by the caller), so that the fork stands alone (resume, replay, export) and
    a bisect against the parent compares whole histories."""
    parent = run.forked_from
    models = ([] if cfg.model.path else ["base_model"]) + ["sft_model"]
    for name in models:
        if (parent / name).is_dir() and not (run.run_dir / name).exists():
            shutil.copytree(parent / name, run.run_dir / name, copy_function=_link_or_copy)
    for log in [parent / "metrics.jsonl", *rank_files(parent)]:
        target = run.run_dir / log.relative_to(parent)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, target)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def shared_inputs(cfg: RunConfig) -> dict[str, Path]:
    """The data files every rank reads, by the setting that names them (``data.train_files[0]``, ...)."""
    keys = {
        "data.train_files": cfg.data.train_files,
        "data.val_files": cfg.data.val_files,
        "eval.files": cfg.eval.files,
        "sft.files": cfg.sft.files,
    }
    return {f"{key}[{i}]": Path(p) for key, files in keys.items() for i, p in enumerate(files or ())}


@attrs.frozen
class RunData:
    """Everything read from data files, checked before any model is built."""

    train: list[Example]
    val: list[Example]
    sft: list[SFTExample]


def load_run_data(
    cfg: RunConfig, tokenizer: Any, scorer: RewardScorer, log: Any, *, needs_train: bool = True
) -> RunData:
    """The training prompts, the held-out prompts (``eval.files``, else ``data.val_files``) and the SFT
    examples; a bad file, row or length is an error naming it, before any model is built."""
    if needs_train and not cfg.data.train_files:
        raise ConfigError(
            "data.train_files is empty: give your training data (.jsonl / .parquet / a saved datasets "
            "dir; see the README), or steps=0 for an evaluation-only run"
        )
    train, val, reports = [], [], {}
    tools = tool_schemas(cfg.rollout.multi_turn)  # the schemas of a multi-turn run's tools, shown to the model
    if needs_train:
        train, report = reports["training"] = load_examples(cfg.data.train_files, cfg.data, tokenizer, tools=tools)
        log.info(
            f"training data: {report.kept} prompts from {report.rows} rows of {', '.join(cfg.data.train_files)}"
            f" ({report.filtered} longer than data.max_prompt_length={cfg.data.max_prompt_length} filtered out,"
            f" {report.truncated} truncated)"
        )
    val_files = cfg.eval.files or cfg.data.val_files
    if val_files:
        val, report = reports["held-out"] = load_examples(val_files, cfg.data, tokenizer, tools=tools)
        log.info(f"held-out data: {report.kept} prompts from {', '.join(val_files)} ({report.filtered} filtered out)")
    elif not needs_train:
        raise ConfigError("an evaluation-only run (steps=0) needs held-out data: eval.files or data.val_files")
    warn_once(
        log,
        data_warnings(
            cfg.data.train_files if needs_train else (),
            val_files,
            {name: r for name, (_, r) in reports.items()},
            prompts_per_step=cfg.prompts_per_step,
        ),
    )
    scorer.check_sources(sorted({e.source for e in train + val}))
    sft = (
        load_sft_examples(cfg.sft, tokenizer, chat_template=cfg.data.chat_template, tools=tools)
        if cfg.sft.files
        else []
    )
    if sft:
        log.info(f"SFT data: {len(sft)} examples from {', '.join(cfg.sft.files)}")
    return RunData(train=train, val=val, sft=sft)


def warn_once(log: Any, warnings: Sequence[str]) -> None:
    """Each warning once per run: on the first rank (every rank computes the same ones)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        for warning in warnings:
            log.warning(warning)


def start_actor(
    cfg: RunConfig,
    roles: Any,
    run: RunPaths,
    data: RunData,
    tokenizer: Any,
    rl_optim: Any,
    metrics_log: MetricsLog,
    *,
    build_kwargs: dict | None = None,
    before_sft_update: Callable[[int], None] | None = None,
) -> None:
    """The actor on its pool (``roles``: :class:`backends.training.roles.Roles`) with the RL optimizer. A fresh start
    with SFT data runs the SFT stage through the same engine (loss on the response tokens) and exports the result as
    the policy RL starts from (every pool builds from it); a resume builds that policy's architecture, which the
    checkpoint's weights then load into. ``before_sft_update(step)`` is called before each SFT update."""
    kwargs = build_kwargs or {}
    if run.resume_from is not None or not data.sft:
        roles.build_actor(run.policy_path, rl_optim, **kwargs)
        return
    engine, steps = roles.actor_engine, sft_steps(cfg.sft, len(data.sft))
    roles.build_actor(run.model_path, sft_optim(cfg.sft, steps), **kwargs)
    stream = PromptStream(data.sft, seed=cfg.seed)

    def next_examples(step: int) -> list:
        if before_sft_update is not None:
            before_sft_update(step)
        return stream.take(cfg.sft.batch_size)

    roles.map_actor(
        lambda actor: run_sft(
            actor,
            next_examples,
            attrs.evolve(cfg.sft, steps=steps),
            pad_token_id=tokenizer.pad_token_id,
            data_parallel=engine.data_parallel(actor),
            update_fn=engine.update,
            metrics_log=metrics_log,
            show_progress=roles.placement.world.is_main,
        )
    )
    roles.map_actor(lambda actor: engine.fresh_optimizer(actor, rl_optim))
    roles.run_on("actor", None, engine.export_hf, roles.actor, run.policy_path, tokenizer=tokenizer)
    roles.placement.barrier()  # the policy is on disk for every pool


def evaluate_policy(
    rollout: Any,
    tokenizer: Any,
    data: RunData,
    scorer: RewardScorer,
    cfg: RunConfig,
    env: Any,
    environments: Any = None,
) -> dict[str, float]:
    """Held-out metrics (:mod:`backends.rollout.evaluation`), ``{}`` without held-out data; multi-turn recipes
    pass their environment factory."""
    if not data.val:
        return {}
    return evaluate(
        rollout,
        tokenizer,
        data.val,
        scorer,
        cfg.eval,
        env,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=cfg.seed * 7919 + 10_007,
        multi_turn=cfg.rollout.multi_turn,
        environments=environments,
        chat_template=cfg.data.chat_template,
    )


def metrics_log(cfg: RunConfig, run: RunPaths, env: Any, console_keys: Sequence[str]) -> MetricsLog:
    """The run's metrics sinks (``logger=...``), writing on the main rank only."""
    return MetricsLog(
        run.run_dir,
        enabled=env.is_main,
        loggers=cfg.logger,
        run_name=run.run_dir.name,
        config=config_to_dict(cfg),
        console_keys=console_keys,
        console_every=cfg.log_every,
        always_keys=(f"val/mean@{cfg.eval.n}",),
    )


def dump_generations(
    run: RunPaths, step: int, tokenizer: Any, batch: rf.RolloutBatch, rows: Sequence[Example], group: Any = None
) -> None:
    """``runs/<run>/generations/step_<step>.jsonl``: every sample of the step (all ranks, gathered to rank 0)
    with its prompt, response (a multi-turn trajectory whole, tool-call markers and observations included),
    ground truth, source, score and (sequence-mean) advantage."""
    mask = rf.loss_tokens(batch)
    # null where the sampling ranks do not know it (PPO's split: the critic lives on the trainer pool)
    advantage = (
        rf.masked_mean(batch.advantages, mask, dim=-1).tolist() if batch.advantages is not None else [None] * len(rows)
    )
    prompts = [tokenizer.decode(ids[m].tolist()) for ids, m in zip(batch.prompt_ids, batch.prompt_mask)]
    mine = [
        {
            "prompt": p,
            "response": r,
            "ground_truth": e.ground_truth,
            "data_source": e.source,
            "score": s,
            "advantage": a,
        }
        for p, r, e, s, a in zip(
            prompts,
            decode_responses(tokenizer, batch, skip_special_tokens=batch.turn_ids is None),
            rows,
            batch.scores.tolist(),
            advantage,
        )
    ]
    gathered = [mine]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
    if not dist.is_initialized() or dist.get_rank() == (dist.get_global_rank(group, 0) if group is not None else 0):
        write_generations(
            run.run_dir / "generations" / f"step_{step}.jsonl", [row for part in gathered for row in part]
        )


def summarize(
    cfg: RunConfig,
    run: RunPaths,
    env: Any,
    before: dict[str, float],
    after: dict[str, float],
    *,
    steps: int,
    wall: float,
    title: str,
    extra: dict | None = None,
) -> dict:
    """The run's summary (``summary.json``, the curves PNG and one verdict line, written by rank 0);
    ``extra`` adds the recipe's own entries."""
    key = f"val/mean@{cfg.eval.n}"
    summary = {
        "eval_before": before.get(key),
        "eval_after": after.get(key),
        "eval_metric": f"held-out success (score >= reward.max_score={cfg.reward.max_score:g}): mean over "
        f"{cfg.eval.n} samples per prompt at temperature {cfg.eval.temperature:g}",
        "before": before,
        "after": after,
        "algorithm": title,
        "steps": steps,
        "wall_seconds": round(wall, 1),
        "world_size": env.world_size,
        "resumed_from": str(run.resume_from) if run.resume_from is not None else None,
        "run_dir": str(run.run_dir),
        **(extra or {}),
    }
    if env.is_main:
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        metrics_file = run.run_dir / "metrics.jsonl"
        if metrics_file.exists():
            # the SFT stage's loss, then RL's curves; those constant for the run are left out
            curves = [
                "sft_loss",
                "reward_mean",
                key,
                "kl",
                "entropy",
                "clip_frac",
                "multi_turn/turns",
                "multi_turn/tool_call_validity",
            ]
            plot_curves(list(read_jsonl(metrics_file)), curves, run.run_dir / "reward_curve.png", title=title)
        if before and after:
            verdict = "rose" if after[key] > before[key] else "did NOT rise"
            print(
                f"\nheld-out success {before[key]:.1%} -> {after[key]:.1%}: it {verdict} ({steps} {title} steps, "
                f"{wall:.0f} s, {env.world_size} rank(s)); see {run.run_dir}",
                flush=True,
            )
        elif after:
            print(f"\nheld-out success {after[key]:.1%} ({steps} steps); see {run.run_dir}", flush=True)
    return summary


def export_final(export: Callable[[], Any], run: Any, steps: int, save: Callable[[int], None] | None) -> None:
    """The final export. If it fails, the trained weights stay on disk: the last step's checkpoint is kept, or,
    with checkpoints off, ``save(steps)`` writes one now (``save=None``: the caller cannot), and the error names it,
    the export dir and how to export again. Call on every rank that exports (and saves)."""
    try:
        export()
    except ExportError as e:
        final = run.ckpt_dir / f"step_{steps}"
        if not (final / "COMPLETE").is_file():
            if save is None:
                raise ExportError(
                    f"{e}; no checkpoint of step {steps} holds the trained weights "
                    "(checkpoint.every=0): they are lost with this process"
                ) from e
            try:
                save(steps)
            except Exception as saving:  # noqa: BLE001 - a full disk fails both; said in one error
                raise ExportError(
                    f"{e}; saving the trained weights as the checkpoint {final} failed too: "
                    f"{type(saving).__name__}: {saving}"
                ) from e
        raise ExportError(
            f"{e}. The trained weights are kept in the checkpoint {final}: export them again (once the "
            f"cause is fixed) with resume=auto run_dir={run.run_dir}"
        ) from e


def checkpoint_or_stop(step: int, steps: int, cfg: RunConfig, run: Any, save: Any, log: Any) -> bool:
    """At the end of ``step``: ``save(step)`` on the ``checkpoint.every`` schedule, then whether the run stops
    here because some rank got SIGTERM or Ctrl-C (every rank agrees; the step is checkpointed when checkpoints
    are on, and one line says how to continue)."""
    saved = bool(cfg.checkpoint.every) and (step % cfg.checkpoint.every == 0 or step == steps)
    if saved:
        save(step)
    if not watchdog.stop_agreed(step):
        return False
    if cfg.checkpoint.every and not saved:
        save(step)
    where = f"run_dir={run.run_dir}" + (f" checkpoint.dir={cfg.checkpoint.dir}" if cfg.checkpoint.dir else "")
    log.warning(watchdog.preemption_note(step, run.ckpt_dir if cfg.checkpoint.every else None, resume_args=where))
    return True

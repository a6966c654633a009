"""The catalogue of bad inputs: each one, given to the public API a run goes through, is an error that
names the problem and where it is (the file and row, the config key, the model or checkpoint dir, the
batch field), never a silent NaN, a raw traceback of some library's internals or a hang.

One row per bad input: ``Case(id, build, error, names)``. ``build(tmp, ctx)`` writes the bad input under
``tmp`` and calls the real entry point; ``error`` is the exception type a user sees and ``names`` the
regexes its message must match (the problem and where it is). The docs' table "What rlfunc checks for
you" lists the same rows.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import attrs
import pytest
import torch

import rlfunc as rf
from backends.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError
from backends.config import ConfigError, apply_overrides
from backends.data import DataConfig, DataError, load_examples
from backends.models import TinyModelConfig, build_char_tokenizer, load_causal_lm, load_tokenizer, write_tiny_model
from backends.rewards import RewardConfig, RewardError, RewardScorer
from tests.checkpoint_state import State

pytestmark = pytest.mark.badinput

TINY = TinyModelConfig(
    hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=64
)


# ------------------------------------------------------------------------------------------ helpers


class Ctx:
    """What several cases share, built once per module: a tokenizer, a tiny model dir, a checkpoint."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tok = build_char_tokenizer()

    @functools.cached_property
    def model_dir(self) -> Path:
        return write_tiny_model(self.root / "tiny", TINY)

    @functools.cached_property
    def checkpoint(self) -> Path:
        from backends.checkpoint.dcp import save_checkpoint

        return save_checkpoint(
            self.root / "ckpt",
            2,
            {"actor": small_state()},
            {"step": 2, "run_dir": str(self.root)},
            config={"actor.optim.lr": 1e-6, "rollout.n": 8},
        )

    def copy_model(self, tmp: Path, name: str = "model") -> Path:
        return Path(shutil.copytree(self.model_dir, tmp / name))

    def copy_checkpoint(self, tmp: Path) -> Path:
        return Path(shutil.copytree(self.checkpoint, tmp / "ckpt" / self.checkpoint.name))


def small_state() -> State:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    return State(model, opt)


def _attention(name: str, dtype: str) -> str:
    """The attention an FSDP role on a GPU would load with (a device object only: the choice reads its type)."""
    from backends.training.fsdp_state import FSDPConfig, attention_implementation

    return attention_implementation(FSDPConfig(param_dtype=dtype, attn_implementation=name), torch.device("cuda", 0))


def grpo_config(*overrides: str) -> Any:
    from experiments import grpo

    return apply_overrides(grpo.Config(), list(overrides), presets_dir=grpo.PRESETS, renamed=grpo.RENAMED_GRPO)


def ppo_config(*overrides: str) -> Any:
    from experiments import ppo

    return apply_overrides(ppo.Config(), list(overrides), presets_dir=ppo.PRESETS, renamed=ppo.RENAMED_PPO)


def jsonl(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def parquet(path: Path, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def load(files: list[str], ctx: Ctx, tok: Any = None, **cfg: Any) -> Any:
    return load_examples(files, DataConfig(**cfg), ctx.tok if tok is None else tok)


def edit_json(path: Path, **changes: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def pyfile(tmp: Path, name: str, source: str) -> Path:
    path = tmp / name
    path.write_text(source)
    return path


def score(tmp: Path, ctx: Ctx, fn_source: str, *, n_rows: int = 2, responses: int | None = None) -> Any:
    """Score ``responses`` (default: one per row) of a small data file with the reward ``fn`` in a file."""
    file = pyfile(tmp, "my_reward.py", fn_source)
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(n_rows)]
    examples, _ = load([jsonl(tmp / "train.jsonl", rows)], ctx)
    scorer = RewardScorer(RewardConfig(fn=(f"{file}:fn",), workers=0))
    return scorer.score(["0"] * (n_rows if responses is None else responses), examples)


def batch(b: int = 2, p: int = 3, t: int = 4, **fields: Any) -> rf.RolloutBatch:
    base = dict(
        prompt_ids=torch.ones(b, p, dtype=torch.long),
        prompt_mask=torch.ones(b, p, dtype=torch.bool),
        response_ids=torch.ones(b, t, dtype=torch.long),
        response_mask=torch.ones(b, t, dtype=torch.bool),
        group_ids=torch.arange(b),
        advantages=torch.zeros(b, t),
        old_logprobs=torch.full((b, t), -1.0),
    )
    return rf.RolloutBatch(**{**base, **fields})


def with_nan(shape: tuple[int, int], at: tuple[int, int]) -> torch.Tensor:
    x = torch.full(shape, -1.0)
    x[at] = float("nan")
    return x


def multi_turn(tmp: Path, **kw: Any) -> Any:
    from backends.rollout.environments import MultiTurnConfig, environment_factory

    return environment_factory(MultiTurnConfig(max_turns=2, **kw))


# -------------------------------------------------------------------------------------------- cases


@attrs.frozen
class Case:
    id: str
    build: Callable[[Path, Ctx], Any]
    error: type[BaseException]
    names: tuple[str, ...]  #: regexes the message must match: the problem, and where it is
    #: the docs' row: (input, what is checked)
    doc: tuple[str, str] = ("", "")


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _model_with(tmp: Path, ctx: Ctx, **config: Any) -> Path:
    path = ctx.copy_model(tmp)
    edit_json(path / "config.json", **config)
    return path


def _tokenizer_dir(tmp: Path, tok: Any) -> Path:
    tok.save_pretrained(tmp / "tok")
    return tmp / "tok"


def _no_pad_no_eos(tmp: Path, ctx: Ctx) -> Any:
    tok = build_char_tokenizer()
    tok.pad_token, tok.eos_token = None, None
    return load_tokenizer(_tokenizer_dir(tmp, tok))


def _big_tokenizer(tmp: Path, ctx: Ctx) -> Any:
    path = ctx.copy_model(tmp)
    build_char_tokenizer(words=[f"word{i}" for i in range(40)]).save_pretrained(path)
    return load_causal_lm(path)


def _resume(resume: str, tmp: Path, must_match: dict | None = None) -> Any:
    from backends.checkpoint.resume import CheckpointConfig, resume_point

    return resume_point(
        resume,
        CheckpointConfig(),
        run_dir="",
        run_root=str(tmp / "runs"),
        name="x",
        must_match=must_match if must_match is not None else {"actor.optim.lr": 1e-6, "rollout.n": 8},
    )


def _fork(fork_from: str, tmp: Path, model: dict) -> Any:
    from backends.checkpoint.resume import fork_point

    return fork_point(fork_from, run_dir=tmp / "fork", model=model)


def _load_ckpt(path: Path) -> Any:
    from backends.checkpoint.dcp import load_checkpoint

    return load_checkpoint(path, {"actor": small_state()})


def _cut_data_file(tmp: Path, ctx: Ctx) -> Any:
    path = ctx.copy_checkpoint(tmp)
    for data in path.glob("*.distcp"):
        _truncate(data, 1 / 3)
    return _load_ckpt(path)


def _bad_marker(tmp: Path, ctx: Ctx) -> Any:
    path = ctx.copy_checkpoint(tmp)
    (path / "COMPLETE").write_text('{"format": "rlfunc.dcp-checkpoint", "st')
    return _load_ckpt(path)


def _overwrite_tensor(tmp: Path, ctx: Ctx, name: str, value: float) -> Any:
    """Two floats of ``value`` written over the middle of tensor ``name``'s bytes on disk, then a load."""
    import struct

    from backends.checkpoint.integrity import describe_items

    path = ctx.copy_checkpoint(tmp)
    _, file, offset, length = next(item for item in describe_items(path, 1) if item[0] == name)
    with open(path / file, "r+b") as f:
        f.seek(offset + length // 2)
        f.write(struct.pack("<2f", value, value))
    return _load_ckpt(path)


def _cut_rng_file(tmp: Path, ctx: Ctx) -> Any:
    path = ctx.copy_checkpoint(tmp)
    _truncate(path / "rng" / "rank_0.safetensors", 1 / 3)
    return _load_ckpt(path)


def _tmp_checkpoint_dir(tmp: Path, ctx: Ctx) -> Any:
    path = tmp / "ckpt" / "step_3.tmp-1a2b3c"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"")
    return _resume(str(path), tmp)


def _ppo_loss(**fields: torch.Tensor) -> Any:
    b = batch(**fields)
    rf.validate(b)
    return rf.ppo_policy_loss(
        torch.full((2, 4), -1.0), old_logprobs=b.old_logprobs, advantages=b.advantages, response_mask=b.response_mask
    )


CHAT = [{"role": "user", "content": "2+2="}]
TOOL_NO_DOC = "def add(a: int, b: int) -> int:\n    return a + b\n"

CASES = [
    # ---------------------------------------------------------------------------------------- config
    Case(
        "config-unknown-key",
        lambda tmp, ctx: grpo_config("actor.optim.lrr=1e-5"),
        ConfigError,
        (r"unknown config key 'actor\.optim\.lrr'", r"did you mean actor\.optim\.lr\b"),
        ("a misspelt key (actor.optim.lrr=1e-5)", "every key against the recipe's config; the closest keys"),
    ),
    Case(
        "config-wrong-type",
        lambda tmp, ctx: grpo_config("rollout.n=eight"),
        ConfigError,
        (r"rollout\.n='eight'", "is not an integer"),
        ("rollout.n=eight", "each value parses as its key's type"),
    ),
    Case(
        "config-bad-choice",
        lambda tmp, ctx: grpo_config("data.truncation=middle"),
        ConfigError,
        (r"data\.truncation='middle'", r"is not one of 'error', 'left', 'right', 'filter'"),
        ("data.truncation=middle", "a choice key's value is one of its choices"),
    ),
    Case(
        "config-unknown-estimator",
        lambda tmp, ctx: __import__("experiments.grpo").grpo.resolve_algorithm(
            grpo_config("algo.estimator=grpoo").algo
        ),
        ConfigError,
        (r"algo\.estimator='grpoo' is not a built-in name", "did you mean grpo"),
        ("algo.estimator=grpoo", "estimator / policy loss names at start-up, before any work"),
    ),
    Case(
        "config-unknown-policy-loss",
        lambda tmp, ctx: __import__("experiments.grpo").grpo.resolve_algorithm(
            grpo_config("algo.policy_loss=vanila").algo
        ),
        ConfigError,
        (r"algo\.policy_loss='vanila' is not a built-in name", "did you mean vanilla"),
        ("algo.policy_loss=vanila", "the same, for the policy loss"),
    ),
    Case(
        "config-renamed-kl-coef",
        lambda tmp, ctx: grpo_config("algo.kl_coef=0.01"),
        ConfigError,
        (r"algo\.kl_coef was renamed: use algo\.kl_loss_coef",),
        ("algo.kl_coef=0.01 (GRPO)", "an old spelling names the new key"),
    ),
    Case(
        "config-renamed-ppo-clip",
        lambda tmp, ctx: ppo_config("algo.clip_ratio_c=3.0"),
        ConfigError,
        (r"algo\.clip_ratio_c was renamed: use algo\.policy_loss_args\.ppo\.dual_clip",),
        ("algo.clip_ratio_c=3.0 (PPO)", "the same, in every recipe and preset"),
    ),
    Case(
        "config-unknown-loss-knob",
        lambda tmp, ctx: grpo_config("algo.policy_loss_args.kl_cov.tau_pos=2"),
        ConfigError,
        (
            r"unknown config key 'algo\.policy_loss_args\.kl_cov\.tau_pos'",
            r"the section algo\.policy_loss_args\.kl_cov has kl_cov_ratio, ppo_kl_coef",
        ),
        ("algo.policy_loss_args.kl_cov.tau_pos=2", "a loss's knobs are its own; the error lists them"),
    ),
    Case(
        "config-negative-lr",
        lambda tmp, ctx: grpo_config("actor.optim.lr=-1e-6"),
        ConfigError,
        (r"actor\.optim\.lr", r"-1e-06"),
        ("actor.optim.lr=-1e-6", "numbers in their range (lr > 0, ...)"),
    ),
    Case(
        "config-zero-prompt-length",
        lambda tmp, ctx: grpo_config("data.max_prompt_length=0"),
        ConfigError,
        (r"data\.max_prompt_length", r"must be >= 1"),
        ("data.max_prompt_length=0", "the same, for lengths"),
    ),
    Case(
        "config-preset-not-found",
        lambda tmp, ctx: grpo_config("preset=optim/adamw"),
        ConfigError,
        (r"unknown preset 'optim/adamw'", r"available presets: .*optim/fsdp"),
        ("preset=optim/adamw", "a preset exists; lists the available ones"),
    ),
    Case(
        "config-preset-bad-key",
        lambda tmp, ctx: (
            pyfile(tmp, "typo.yaml", "lr: 1.0e-5\nclip_gard: 1.0\n"),
            apply_overrides(__import__("experiments.grpo").grpo.Config(), ["actor.optim=@typo"], presets_dir=tmp),
        ),
        ConfigError,
        (r"preset 'typo' applied at 'actor\.optim'", r"clip_gard", r"did you mean actor\.optim\.clip_grad"),
        ("a preset file with a misspelt key", "a preset's keys like the command line's, naming the preset"),
    ),
    Case(
        "config-contradictory-model",
        lambda tmp, ctx: grpo_config("model.tiny.num_heads=3"),
        ConfigError,
        (r"model\.tiny\.num_heads", r"hidden_size=256 is not divisible by num_heads=3"),
        ("model.tiny.num_heads=3 (hidden size 256)", "keys that must agree with each other"),
    ),
    Case(
        "config-contradictory-reward-weights",
        lambda tmp, ctx: RewardScorer(RewardConfig(fn=("exact",), weights=(1.0, 0.5))),
        ConfigError,
        (r"reward\.weights has 2 entries for 1 reward\.fn",),
        ("reward.weights with 2 entries for 1 reward.fn", "the same"),
    ),
    Case(
        "config-batch-not-divisible",
        lambda tmp, ctx: __import__("backends.loop.rl_loop").loop.rl_loop.num_mini_batches(
            grpo_config("prompts_per_step=6"), 4
        ),
        ConfigError,
        (r"prompts_per_step=6 must be divisible by the world size 4",),
        ("prompts_per_step=6 on 4 ranks", "the batch splits over the ranks"),
    ),
    Case(
        "config-negative-steps",
        lambda tmp, ctx: grpo_config("steps=-1"),
        ConfigError,
        (r"steps: 'steps' must be >= 0: -1",),
        ("steps=-1", "a step count is >= 0 (0: evaluate only)"),
    ),
    Case(
        "config-zero-prompts-per-step",
        lambda tmp, ctx: grpo_config("prompts_per_step=0"),
        ConfigError,
        (r"^prompts_per_step: 'prompts_per_step' must be >= 1: 0$",),
        ("prompts_per_step=0", "the key itself is named"),
    ),
    Case(
        "config-vllm-on-a-split",
        lambda tmp, ctx: __import__("backends.loop.split").loop.split.check_offpolicy(
            grpo_config("offpolicy.rollout_ranks=1", "offpolicy.mode=one_step_off", "rollout.engine=vllm"), 2
        ),
        ConfigError,
        (
            r"rollout\.engine=vllm with offpolicy\.rollout_ranks=1",
            r"process groups over every rank",
            r"What works: rollout\.engine=native",
        ),
        (
            "`rollout.engine=vllm` with `offpolicy.rollout_ranks=1` (or PPO's `placement.mode=split`)",
            "vLLM runs colocated only (it builds its groups over the whole world)",
        ),
    ),
    Case(
        "config-flash-attention-fp32",
        lambda tmp, ctx: _attention("flash_attention_2", "float32"),
        ValueError,
        (r"attn_implementation=flash_attention_2 computes in fp16 / bf16 only, and param_dtype=float32",),
        (
            "`actor.fsdp.attn_implementation=flash_attention_2` with `param_dtype=float32`",
            "flash-attn computes in bf16 / fp16 (auto takes sdpa for fp32)",
        ),
    ),
    Case(
        "node-hostname-loopback",
        lambda tmp, ctx: __import__("backends.distributed.node_checks").distributed.node_checks.check_gloo_interface(
            {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, hostname="localhost"
        ),
        RuntimeError,
        (r"node localhost \(rank 9 of a 16-rank run", r"a loopback address", r"GLOO_SOCKET_IFNAME"),
        (
            "a node of a multi-node run whose hostname resolves to 127.x (or `GLOO_SOCKET_IFNAME` naming no interface)",
            "gloo can bind to an address other nodes reach, before the group forms",
        ),
    ),
    # ------------------------------------------------------------------------------------ data files
    Case(
        "data-missing-file",
        lambda tmp, ctx: load([str(tmp / "nope.jsonl")], ctx),
        DataError,
        (r"nope\.jsonl: no such file",),
        ("a data file that is not there", "every file exists"),
    ),
    Case(
        "data-bad-json-line",
        lambda tmp, ctx: (
            tmp.joinpath("d.jsonl").write_text('{"prompt": "a", "answer": "b"}\n\n{"prompt": "c", answer}\n'),
            load([str(tmp / "d.jsonl")], ctx),
        ),
        DataError,
        (r"d\.jsonl:line 3: not valid JSON",),
        ("a JSONL line that is not JSON", "every line parses"),
    ),
    Case(
        "data-not-utf8",
        lambda tmp, ctx: (
            tmp.joinpath("d.jsonl").write_bytes(b'{"prompt": "a", "answer": "b"}\n{"prompt": "\xff"}\n'),
            load([str(tmp / "d.jsonl")], ctx),
        ),
        DataError,
        (r"d\.jsonl:line 2: not UTF-8 text",),
        ("a JSONL file that is not UTF-8", "every line decodes"),
    ),
    Case(
        "data-row-not-object",
        lambda tmp, ctx: load([jsonl(tmp / "d.jsonl", [["a", "b"]])], ctx),
        DataError,
        (r"d\.jsonl:line 1: a row must be a JSON object, got list",),
        ("a JSON list as a row", "every row is an object"),
    ),
    Case(
        "data-missing-prompt",
        lambda tmp, ctx: load(
            [jsonl(tmp / "d.jsonl", [{"prompt": "a", "answer": "b"}, {"question": "c", "answer": "d"}])], ctx
        ),
        DataError,
        (r"d\.jsonl:line 2: no column 'prompt'", r"has \['answer', 'question'\]"),
        ("a row without the prompt column", "every row has data.prompt_key; lists its columns"),
    ),
    Case(
        "data-missing-answer",
        lambda tmp, ctx: load([parquet(tmp / "d.parquet", [{"prompt": "a", "label": "b"}])], ctx),
        DataError,
        (r"d\.parquet\[row 0\]: no column 'answer'",),
        ("a row without the answer column", "every row has data.answer_key"),
    ),
    Case(
        "data-empty-file",
        lambda tmp, ctx: (tmp.joinpath("d.jsonl").write_text("\n"), load([str(tmp / "d.jsonl")], ctx)),
        DataError,
        (r"no rows in .*d\.jsonl",),
        ("an empty data file", "the files hold rows"),
    ),
    Case(
        "data-bad-message",
        lambda tmp, ctx: load([jsonl(tmp / "d.jsonl", [{"prompt": [{"text": "hi"}], "answer": "b"}])], ctx),
        DataError,
        (r"d\.jsonl:line 1: prompt\[0\] must be a \{'role': \.\.\., 'content': \.\.\.\} message",),
        ("a chat message without role / content", "every message of a chat prompt"),
    ),
    Case(
        "data-bad-role",
        lambda tmp, ctx: load(
            [jsonl(tmp / "d.jsonl", [{"prompt": [{"role": "bot", "content": "hi"}], "answer": "b"}])], ctx
        ),
        DataError,
        (r"d\.jsonl:line 1: prompt\[0\] has role 'bot'", "known roles: system, user, assistant, tool"),
        ("a message with an unknown role", "the same"),
    ),
    Case(
        "data-prompt-too-long",
        lambda tmp, ctx: load(
            [jsonl(tmp / "d.jsonl", [{"prompt": "x" * 40, "answer": "b"}])], ctx, max_prompt_length=16
        ),
        DataError,
        (
            r"d\.jsonl:line 1: the prompt has 40 tokens, more than data\.max_prompt_length=16",
            r"data\.truncation=left\|right\|filter",
        ),
        ("a prompt longer than data.max_prompt_length (truncation=error)", "every prompt's token count"),
    ),
    Case(
        "data-unknown-format",
        lambda tmp, ctx: (tmp.joinpath("d.csv").write_text("prompt,answer\n"), load([str(tmp / "d.csv")], ctx)),
        DataError,
        (r"d\.csv: unknown data format '\.csv'",),
        ("a .csv file", "the file format"),
    ),
    Case(
        "data-parquet-wrong-type",
        lambda tmp, ctx: load([parquet(tmp / "d.parquet", [{"prompt": 7, "answer": "b"}])], ctx),
        DataError,
        (r"d\.parquet\[row 0\]: prompt must be a string or a non-empty list of messages, got int",),
        ("a parquet prompt column of integers", "the prompt column's type"),
    ),
    Case(
        "data-not-parquet",
        lambda tmp, ctx: (tmp.joinpath("d.parquet").write_text("not parquet"), load([str(tmp / "d.parquet")], ctx)),
        DataError,
        (r"d\.parquet: cannot read as parquet",),
        ("a damaged .parquet file", "the file reads"),
    ),
    # ------------------------------------------------------------------------------------- tokenizers
    Case(
        "tokenizer-no-chat-template",
        lambda tmp, ctx: load(
            [jsonl(tmp / "d.jsonl", [{"prompt": "a", "answer": "b"}, {"prompt": CHAT, "answer": "4"}])],
            ctx,
            tok=(t := build_char_tokenizer(), setattr(t, "chat_template", None), t)[-1],
        ),
        DataError,
        (r"d\.jsonl:line 2: the tokenizer has no chat template", r"data\.chat_template="),
        ("a chat prompt and a tokenizer without a chat template", "a chat template is there when a row needs one"),
    ),
    Case(
        "tokenizer-broken-template",
        lambda tmp, ctx: load(
            [jsonl(tmp / "d.jsonl", [{"prompt": CHAT, "answer": "4"}])],
            ctx,
            chat_template=str(pyfile(tmp, "t.jinja", "{% for m in messages %}{{ m['content'] }")),
        ),
        DataError,
        (r"d\.jsonl:line 1: the chat template .*t\.jinja failed", "TemplateSyntaxError"),
        ("a chat template file that does not parse", "the template renders, naming it and the row"),
    ),
    Case(
        "tokenizer-missing-files",
        lambda tmp, ctx: (tmp.joinpath("m").mkdir(), load_tokenizer(tmp / "m")),
        FileNotFoundError,
        (r"'.*/m' has no tokenizer files",),
        ("a dir without tokenizer files", "the tokenizer files exist"),
    ),
    Case(
        "tokenizer-damaged-file",
        lambda tmp, ctx: (
            build_char_tokenizer().save_pretrained(tmp / "tok"),
            (tmp / "tok" / "tokenizer.json").write_text("{"),
            load_tokenizer(tmp / "tok"),
        ),
        ValueError,
        (r"cannot load the tokenizer in '.*/tok'",),
        ("a truncated tokenizer.json", "the tokenizer loads"),
    ),
    Case(
        "tokenizer-no-pad-no-eos",
        _no_pad_no_eos,
        ValueError,
        (r"tokenizer in '.*/tok' has neither a pad token nor an eos token",),
        ("a tokenizer with neither pad nor eos token", "a pad token (the eos token when there is none)"),
    ),
    Case(
        "tokenizer-bigger-than-model",
        _big_tokenizer,
        ValueError,
        (r"tokenizer in '.*/model' has 306 tokens but the model embeds only 266",),
        ("a tokenizer of another (larger) vocabulary", "every token id has an embedding row"),
    ),
    # ----------------------------------------------------------------------------------- model dirs
    Case(
        "model-missing-dir",
        lambda tmp, ctx: load_causal_lm(tmp / "nope"),
        FileNotFoundError,
        (r"model directory '.*/nope' does not exist",),
        ("model.path that does not exist", "the dir exists"),
    ),
    Case(
        "model-no-config",
        lambda tmp, ctx: (ctx.copy_model(tmp).joinpath("config.json").unlink(), load_causal_lm(tmp / "model")),
        FileNotFoundError,
        (r"'.*/model' has no config\.json",),
        ("a dir without config.json", "it is a HF checkpoint dir"),
    ),
    Case(
        "model-config-not-json",
        lambda tmp, ctx: (
            ctx.copy_model(tmp).joinpath("config.json").write_text("{oops"),
            load_causal_lm(tmp / "model"),
        ),
        ValueError,
        (r"'.*/model/config\.json' is not valid JSON",),
        ("a config.json that is not JSON", "config.json parses"),
    ),
    Case(
        "model-unsupported-arch",
        lambda tmp, ctx: load_causal_lm(_model_with(tmp, ctx, model_type="gpt2")),
        ValueError,
        (r"unsupported model_type 'gpt2' in '.*/model/config\.json'", "supported: llama, qwen2"),
        ("a GPT-2 checkpoint", "model_type is a supported family"),
    ),
    Case(
        "model-no-weights",
        lambda tmp, ctx: (ctx.copy_model(tmp).joinpath("model.safetensors").unlink(), load_causal_lm(tmp / "model")),
        FileNotFoundError,
        (r"'.*/model' has a config\.json but no weights",),
        ("a dir without weight files", "weights exist"),
    ),
    Case(
        "model-truncated-safetensors",
        lambda tmp, ctx: (_truncate(ctx.copy_model(tmp) / "model.safetensors"), load_causal_lm(tmp / "model")),
        ValueError,
        (r"cannot load the model in '.*/model'", "SafetensorError"),
        ("a cut-off model.safetensors", "the weight files read"),
    ),
    Case(
        "model-shape-mismatch",
        lambda tmp, ctx: load_causal_lm(_model_with(tmp, ctx, intermediate_size=96)),
        ValueError,
        (
            r"weights in '.*/model' do not fit its config\.json",
            r"model\.layers\.0\.mlp\.down_proj\.weight: file \(64, 64\), config\.json \(64, 96\)",
        ),
        ("config.json sizes that do not match the weights", "every weight's shape, naming it"),
    ),
    Case(
        "model-config-rejected",
        lambda tmp, ctx: load_causal_lm(_model_with(tmp, ctx, num_hidden_layers=2)),
        ValueError,
        (r"cannot load the model in '.*/model'", "num_hidden_layers"),
        ("a config.json transformers refuses", "the config loads, naming the dir"),
    ),
    # ---------------------------------------------------------------------------------------- rewards
    Case(
        "reward-unknown-name",
        lambda tmp, ctx: RewardScorer(RewardConfig(fn=("gsm8kk",))),
        ConfigError,
        (r"reward\.fn='gsm8kk' is not a built-in name", "did you mean gsm8k"),
        ("reward.fn=gsm8kk", "reward names at start-up"),
    ),
    Case(
        "reward-bad-module",
        lambda tmp, ctx: RewardScorer(RewardConfig(fn=("no_such_pkg.rewards:score",))),
        ConfigError,
        (r"reward\.fn='no_such_pkg\.rewards:score': no module named 'no_such_pkg'",),
        ("reward.fn=no_such_pkg.rewards:score", "module references import"),
    ),
    Case(
        "reward-missing-function",
        lambda tmp, ctx: RewardScorer(
            RewardConfig(fn=(f"{pyfile(tmp, 'r.py', 'def other(r, g): return 0.0')}:score",))
        ),
        ConfigError,
        (r"reward\.fn='.*r\.py:score': file '.*r\.py' has no attribute 'score'",),
        ("reward.fn=r.py:score (no such function)", "file references resolve"),
    ),
    Case(
        "reward-wrong-signature",
        lambda tmp, ctx: RewardScorer(
            RewardConfig(fn=(f"{pyfile(tmp, 'r.py', 'def score(response): return 0.0')}:score",))
        ),
        ConfigError,
        (r"reward\.fn='.*r\.py:score'", r"takes 1 positional argument"),
        ("a reward function taking only the response", "its signature fits fn(response, ground_truth, **columns)"),
    ),
    Case(
        "reward-returns-nan",
        lambda tmp, ctx: score(tmp, ctx, "def fn(r, g):\n    return float('nan') if g == '2' else 1.0\n"),
        RewardError,
        (r"my_reward\.py:fn' returned nan on .*train\.jsonl:line 2", "must be finite"),
        ("a reward that returns NaN", "every score is a finite number, naming the row"),
    ),
    Case(
        "reward-beyond-float32",
        lambda tmp, ctx: score(tmp, ctx, "def fn(r, g):\n    return -1e308 if g == '2' else 1e308\n"),
        RewardError,
        (r"my_reward\.py:fn' returned 1e\+308 on .*train\.jsonl:line 1", r"finite in float32.*3\.403e\+38"),
        ("a reward of 1e308 (inf in float32)", "scores fit float32, where they are kept; never a success"),
    ),
    Case(
        "reward-weighted-sum-beyond-float32",
        lambda tmp, ctx: RewardScorer(RewardConfig(fn=("exact",), weights=(1e39,))).score(
            ["2"], load([jsonl(tmp / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}])], ctx)[0]
        ),
        RewardError,
        (r"weighted sum of the reward functions on .*d\.jsonl:line 1 is 1e\+39", r"reward\.weights=\[1e\+39\]"),
        ("reward.weights=[1e39]", "the weighted sum fits float32 too"),
    ),
    Case(
        "reward-returns-none",
        lambda tmp, ctx: score(tmp, ctx, "def fn(r, g):\n    pass\n"),
        RewardError,
        (r"returned NoneType None on .*train\.jsonl:line 1",),
        ("a reward that returns None", "the same"),
    ),
    Case(
        "reward-raises",
        lambda tmp, ctx: score(tmp, ctx, "def fn(r, g):\n    return 1 / (int(g) - 2)\n"),
        RewardError,
        (r"raised ZeroDivisionError: division by zero on .*train\.jsonl:line 2", r"reward\.on_error=zero"),
        ("a reward that raises", "the error names the function and the row"),
    ),
    Case(
        "reward-calls-sys-exit",
        lambda tmp, ctx: score(tmp, ctx, "import sys\ndef fn(r, g):\n    sys.exit(3)\n"),
        RewardError,
        (r"my_reward\.py:fn' called sys\.exit\(3\).* on .*train\.jsonl:line 1",),
        (
            "a reward that calls sys.exit (in-process; in a worker, tests/test_reward_workers.py)",
            "an error of the call, not the trainer's end",
        ),
    ),
    Case(
        "reward-wrong-length",
        lambda tmp, ctx: score(tmp, ctx, "def fn(r, g):\n    return 0.0\n", responses=3),
        ValueError,
        (r"RewardScorer\.score: 3 responses for 2 examples",),
        ("3 responses for 2 rows", "one response per row"),
    ),
    # ------------------------------------------------------------------------------ environments / tools
    Case(
        "tool-without-docstring",
        lambda tmp, ctx: multi_turn(tmp, tools=(f"{pyfile(tmp, 'tools.py', TOOL_NO_DOC)}:add",)),
        ConfigError,
        (r"tool 'add' has no usable JSON schema", "docstring"),
        ("a tool without a docstring", "every tool has a JSON schema"),
    ),
    Case(
        "tool-bad-reference",
        lambda tmp, ctx: multi_turn(tmp, tools=(f"{pyfile(tmp, 'tools.py', TOOL_NO_DOC)}:sub",)),
        ConfigError,
        (r"rollout\.multi_turn\.tools='.*tools\.py:sub': file '.*tools\.py' has no attribute 'sub'",),
        ("rollout.multi_turn.tools=tools.py:sub", "tool references resolve"),
    ),
    Case(
        "tools-missing",
        lambda tmp, ctx: multi_turn(tmp),
        ConfigError,
        (r"rollout\.multi_turn\.environment=tools needs rollout\.multi_turn\.tools",),
        ("multi-turn tools without tools", "the tool environment has tools"),
    ),
    Case(
        "environment-not-found",
        lambda tmp, ctx: multi_turn(tmp, environment="no_such_envs:make"),
        ConfigError,
        (r"rollout\.multi_turn\.environment='no_such_envs:make': no module named 'no_such_envs'",),
        ("rollout.multi_turn.environment=no_such_envs:make", "the environment reference resolves"),
    ),
    # ---------------------------------------------------------------------------------- checkpoints
    Case(
        "resume-missing-dir",
        lambda tmp, ctx: _resume(str(tmp / "ckpt" / "step_9"), tmp),
        SystemExit,
        (r"CheckpointNotFoundError: checkpoint '.*/ckpt/step_9' does not exist",),
        ("resume=<a step dir that is not there>", "the checkpoint exists"),
    ),
    Case(
        "resume-incomplete-tmp-dir",
        _tmp_checkpoint_dir,
        SystemExit,
        (r"'.*/step_3\.tmp-1a2b3c' is not a complete checkpoint: it has no COMPLETE marker",),
        ("resume=<an interrupted save's tmp dir>", "the checkpoint is complete"),
    ),
    Case(
        "resume-other-config",
        lambda tmp, ctx: _resume(str(ctx.copy_checkpoint(tmp)), tmp, {"actor.optim.lr": 1e-5, "rollout.n": 8}),
        SystemExit,
        (
            r"CheckpointMismatchError: cannot resume from '.*/step_2': it was written with a different config",
            r"actor\.optim\.lr: checkpoint 1e-06, now 1e-05",
        ),
        ("resuming with another config", "the config matches, naming every differing key"),
    ),
    Case(
        "vllm-server-nowhere",
        lambda tmp, ctx: grpo_config("rollout.engine=vllm_server", "rollout.vllm_server.count=0"),
        ConfigError,
        (r"rollout.engine=vllm_server needs rollout.vllm_server.count > 0 or rollout.vllm_server.urls",),
        ("rollout.engine=vllm_server with no server started or named", "a server to sample from"),
    ),
    Case(
        "vllm-server-multi-turn",
        lambda tmp, ctx: grpo_config("rollout.engine=vllm_server", "rollout.multi_turn.max_turns=2"),
        ConfigError,
        (r"rollout.engine=vllm_server has no multi-turn sessions",),
        ("rollout.engine=vllm_server with multi-turn rollouts", "the engine has sessions"),
    ),
    Case(
        "fork-and-resume",
        lambda tmp, ctx: grpo_config("fork_from=runs/a/checkpoints/step_2", "resume=runs/b/checkpoints/step_3"),
        ConfigError,
        (r"fork_from='runs/a/checkpoints/step_2' starts a new run .* resume='runs/b/checkpoints/step_3' continues",),
        ("fork_from with resume=<a step dir>", "one starting checkpoint"),
    ),
    Case(
        "fork-another-model",
        lambda tmp, ctx: _fork(str(ctx.copy_checkpoint(tmp)), tmp, {"tiny": {"hidden_size": 64}}),
        SystemExit,
        (
            r"CheckpointMismatchError: cannot fork from '.*/step_2': it was written for another model",
            r"model\.tiny\.hidden_size: checkpoint <not set>, now 64",
        ),
        ("fork_from=<a checkpoint of another model>", "the model keys match, naming every differing key"),
    ),
    Case(
        "checkpoint-root-not-step",
        lambda tmp, ctx: _load_ckpt(ctx.copy_checkpoint(tmp).parent),
        CheckpointCorruptError,
        (r"'.*/ckpt' is a checkpoint root, not a checkpoint", "newest: step_2"),
        ("the checkpoint root instead of a step dir", "the path is one checkpoint"),
    ),
    Case(
        "checkpoint-bad-marker",
        _bad_marker,
        CheckpointCorruptError,
        (r"'.*/step_2/COMPLETE' is not valid JSON",),
        ("a damaged COMPLETE marker", "the marker parses"),
    ),
    Case(
        "checkpoint-cut-data-file",
        _cut_data_file,
        CheckpointCorruptError,
        (r"checkpoint '.*/step_2': data file '__0_0\.distcp' is cut off",),
        ("a cut-off .distcp data file", "every data file is whole"),
    ),
    Case(
        "checkpoint-overwritten-bytes",
        lambda tmp, ctx: _overwrite_tensor(tmp, ctx, "actor/model/0.weight", 0.5),
        CheckpointCorruptError,
        (
            r"checkpoint '.*/step_2' is damaged: tensor 'actor/model/0\.weight' \(bytes \d+\.\.\d+ of "
            r"'__0_0\.distcp'\) does not match the sha256 recorded when it was saved",
        ),
        (
            "finite floats written over a tensor's bytes",
            "a hash per tensor, recorded at save, before any byte is loaded",
        ),
    ),
    Case(
        "checkpoint-nan-bytes",
        lambda tmp, ctx: _overwrite_tensor(tmp, ctx, "actor/optim/state.0.weight.exp_avg", float("nan")),
        CheckpointCorruptError,
        (r"tensor 'actor/optim/state\.0\.weight\.exp_avg' .* does not match the sha256",),
        ("NaN bytes in an optimizer moment", "the same"),
    ),
    Case(
        "checkpoint-cut-rng-file",
        _cut_rng_file,
        CheckpointCorruptError,
        (r"checkpoint '.*/step_2' is damaged: file 'rng/rank_0\.safetensors' does not match",),
        ("a cut-off RNG file", "the RNG files are hashed too, named by path"),
    ),
    Case(
        "checkpoint-other-model",
        lambda tmp, ctx: __import__("backends.checkpoint.dcp").checkpoint.dcp.load_checkpoint(
            ctx.copy_checkpoint(tmp), {"actor": State(torch.nn.Linear(8, 4), None)}
        ),
        CheckpointMismatchError,
        (r"state 'actor' is of another model",),
        ("a checkpoint of another model", "parameter names / shapes"),
    ),
    # ---------------------------------------------------------------------------------------- batches
    Case(
        "batch-shape-mismatch",
        lambda tmp, ctx: rf.validate(batch(response_mask=torch.ones(2, 5, dtype=torch.bool))),
        ValueError,
        (r"RolloutBatch\.response_mask must have shape \(2, 4\)", r"got \(2, 5\)"),
        ("response_mask (2, 5) for response_ids (2, 4)", "every field's shape, naming it"),
    ),
    Case(
        "batch-float-mask",
        lambda tmp, ctx: rf.validate(batch(response_mask=torch.ones(2, 4))),
        TypeError,
        (r"RolloutBatch\.response_mask must have a bool dtype, got torch\.float32",),
        ("a float mask", "masks are bool"),
    ),
    Case(
        "batch-float-ids",
        lambda tmp, ctx: rf.validate(batch(response_ids=torch.ones(2, 4))),
        TypeError,
        (r"RolloutBatch\.response_ids must have a int dtype, got torch\.float32",),
        ("float token ids", "every field's dtype"),
    ),
    Case(
        "batch-group-ids-length",
        lambda tmp, ctx: rf.validate(batch(group_ids=torch.arange(3))),
        ValueError,
        (r"RolloutBatch\.group_ids must have shape \(2,\)",),
        ("3 group ids for 2 rows", "the row count"),
    ),
    Case(
        "batch-nan-advantage",
        lambda tmp, ctx: _ppo_loss(advantages=with_nan((2, 4), (1, 2))),
        ValueError,
        (r"RolloutBatch\.advantages .*non-finite value \(nan\) at index \(1, 2\)",),
        ("NaN in advantages at a loss token", "float fields are finite at the loss tokens"),
    ),
    Case(
        "batch-nan-logprob",
        lambda tmp, ctx: _ppo_loss(old_logprobs=with_nan((2, 4), (0, 3))),
        ValueError,
        (r"RolloutBatch\.old_logprobs is NaN at index \(0, 3\), a loss token",),
        ("NaN in old_logprobs at a loss token", "the same"),
    ),
    Case(
        "loss-clip-out-of-range",
        lambda tmp, ctx: rf.ppo_policy_loss(
            torch.zeros(2, 4),
            old_logprobs=torch.zeros(2, 4),
            advantages=torch.zeros(2, 4),
            response_mask=torch.ones(2, 4, dtype=torch.bool),
            clip_low=1.5,
        ),
        ValueError,
        (r"clip_low must be in \[0, 1\), got 1\.5",),
        ("clip_low=1.5", "the clip range"),
    ),
    Case(
        "rollout-request-larger-than-the-kv-cache",
        lambda tmp, ctx: _generate_in_a_small_kv_cache(ctx),
        ValueError,
        (
            r"prompt 1 \(40 tokens, n=2 samples, max_new_tokens=16\) needs 9 KV-cache blocks of 8 tokens, more than "
            r"the whole cache holds \(8 blocks\)",
            r"rollout\.native\.kv_cache_gib",
        ),
        (
            "`rollout.native.kv_cache_gib=0.000018` and a prompt whose 2 samples can never fit it",
            "each request against the native engine's whole KV cache, before any decoding",
        ),
    ),
]


def _generate_in_a_small_kv_cache(ctx: Ctx) -> Any:
    from backends.rollout.native import BatchingLimits, SamplingConfig, build_native_rollout

    rollout = build_native_rollout(ctx.model_dir, batching_limits=BatchingLimits(kv_cache_gib=0.000018))
    prompts = [[5, 6, 7], list(range(3, 43))]
    return rollout.generate(prompts, SamplingConfig(n=2, max_new_tokens=16))


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return Ctx(tmp_path_factory.mktemp("bad_inputs"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_input_is_an_error_that_names_it(case, tmp_path, ctx):
    with pytest.raises(case.error) as caught:
        case.build(tmp_path, ctx)
    message = str(caught.value)
    missing = [pattern for pattern in case.names if not re.search(pattern, message)]
    assert not missing, f"{case.id}: the message does not match {missing}:\n{message}"


def test_the_catalogue_covers_every_kind_of_input():
    kinds = {c.id.split("-")[0] for c in CASES}
    assert {
        "config",
        "data",
        "model",
        "tokenizer",
        "reward",
        "tool",
        "environment",
        "resume",
        "checkpoint",
        "batch",
    } <= kinds
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)


def test_nan_in_padding_is_not_an_error_and_leaves_the_loss_finite():
    """The other side of the NaN checks: padding (outside the loss tokens) may hold anything."""
    mask = torch.tensor([[True, True, False, False], [True, True, True, False]])
    advantages, old = with_nan((2, 4), (0, 3)), with_nan((2, 4), (1, 3))
    b = rf.validate(batch(response_mask=mask, advantages=advantages, old_logprobs=old))
    loss, _ = rf.ppo_policy_loss(
        torch.full((2, 4), -1.0, requires_grad=True),
        old_logprobs=b.old_logprobs,
        advantages=b.advantages,
        response_mask=b.response_mask,
    )
    assert torch.isfinite(loss)

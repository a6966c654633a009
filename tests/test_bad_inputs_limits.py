"""The catalogue of bad inputs, continued: limits checked before any work, and the start-up checks of what a user
brings (a huge or malformed data file, an unusable checkpoint setting, a reward, estimator or loss that does not fit
the call the recipe makes). Each is an error naming the problem and where it is, raised by the deciding function a run
goes through at start-up, before a model is built; and the inputs that are allowed but probably not meant are
warnings, given once.

Same style as ``tests/test_bad_inputs.py``: one ``Case(id, build, error, names, doc)`` per bad input, ``build(tmp)``
writes it and calls the real entry point; BUILD.md's table "What rlfunc checks for you" has the same rows.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Callable

import attrs
import pytest

from backends.config import ConfigError, apply_overrides
from backends.data import DataConfig, DataError, LoadReport, data_warnings, load_examples, max_token_bytes
from backends.models import build_char_tokenizer
from backends.rewards import RewardConfig, RewardError, RewardScorer

pytestmark = pytest.mark.badinput

TOK = build_char_tokenizer()


def grpo_config(*overrides: str) -> Any:
    from experiments import grpo

    return apply_overrides(grpo.Config(), list(overrides), presets_dir=grpo.PRESETS)


def jsonl(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def pyfile(tmp: Path, name: str, source: str) -> Path:
    path = tmp / name
    path.write_text(source)
    return path


def load(files: list[str], tok: Any = None, **cfg: Any) -> Any:
    return load_examples(files, DataConfig(**cfg), TOK if tok is None else tok)


ROW = {"prompt": "1+1=", "answer": "2"}
MEGABYTE_PROMPT = "7" * 1_000_000


def _huge_row(tmp: Path, prompt: Any = MEGABYTE_PROMPT, **cfg: Any) -> Any:
    return load([jsonl(tmp / "d.jsonl", [ROW, {"prompt": prompt, "answer": "b"}])], max_prompt_length=16, **cfg)


def _text_file(tmp: Path, name: str, text: str) -> Any:
    (tmp / name).write_text(text)
    return load([str(tmp / name)])


def _parquet_null_answer(tmp: Path) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([ROW, {"prompt": "2+2=", "answer": None}]), tmp / "d.parquet")
    return load([str(tmp / "d.parquet")])


def _resume_with(tmp: Path, ckpt_dir: str) -> Any:
    from backends.checkpoint.resume import CheckpointConfig, resume_point

    return resume_point(
        "never",
        CheckpointConfig(every=10, dir=ckpt_dir),
        run_dir="",
        run_root=str(tmp / "runs"),
        name="x",
        must_match={},
    )


def _unwritable_dir(tmp: Path) -> str:
    """A dir no file can be created in: read-only by its mode, or (root ignores modes) a path under /proc."""
    if os.geteuid() == 0:
        return "/proc/rlfunc-checkpoints"
    locked = tmp / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    return str(locked / "checkpoints")


def _score_with(tmp: Path, source: str, workers: int = 0) -> Any:
    file = pyfile(tmp, "my_reward.py", source)
    examples, _ = load([jsonl(tmp / "train.jsonl", [ROW, {"prompt": "2+2=", "answer": "4"}])])
    scorer = RewardScorer(RewardConfig(fn=(f"{file}:fn",), workers=workers))
    try:
        return scorer.score(["2", "4"], examples)
    finally:
        scorer.close()


def _algorithm(tmp: Path, source: str, *overrides: str) -> None:
    """The GRPO recipe's start-up: resolve the estimator and the loss, then call them on a synthetic batch."""
    from experiments import grpo

    pyfile(tmp, "my_algo.py", source)
    cfg = grpo_config(*(o.replace("@", str(tmp) + "/") for o in overrides))
    grpo.group_relative(cfg)


ESTIMATOR_POSITIONAL = "def centered(scores, group_ids):\n    return scores - scores.mean(), scores\n"
ESTIMATOR_PER_ROW = "def centered(scores, *, group_ids, response_mask):\n    return scores - scores.mean(), scores\n"
LOSS_POSITIONAL = "def my_loss(logprobs, old_logprobs, advantages):\n    return -(logprobs * advantages).mean(), {}\n"
LOSS_FLOAT = "def my_loss(logprobs, **kwargs):\n    return 0.5, {}\n"
GENERATOR_REWARD = "def fn(r, g):\n    yield 1.0\n"
ASYNC_REWARD = "async def fn(r, g):\n    return 1.0\n"


@attrs.frozen
class Case:
    id: str
    build: Callable[[Path], Any]
    error: type[BaseException]
    names: tuple[str, ...]  #: regexes the message must match: the problem, and where it is
    doc: tuple[str, str] = ("", "")  #: the docs' row: (input, what is checked)


CASES = [
    # ----------------------------------------------------------------------------------- data: limits
    Case(
        "data-huge-prompt",
        _huge_row,
        DataError,
        (
            r"d\.jsonl:line 2: the prompt is 1,000,000 bytes of text, more than data\.max_prompt_length=16 tokens "
            r"of at most \d+ bytes each can hold",
            "refused before tokenising",
        ),
        (
            "a 1 MB prompt with data.max_prompt_length=16",
            "the prompt's bytes against what max_prompt_length tokens can spell, before tokenising",
        ),
    ),
    Case(
        "data-huge-prompt-truncated",
        lambda tmp: _huge_row(tmp, truncation="left"),
        DataError,
        (r"d\.jsonl:line 2: the prompt is 1,000,000 bytes of text; data\.truncation=left cuts prompts up to 64 x",),
        ("the same with data.truncation=left", "prompts up to 64 x that bound are cut; longer ones are refused"),
    ),
    Case(
        "data-huge-chat-prompt",
        lambda tmp: _huge_row(
            tmp, [{"role": "system", "content": "x" * 600_000}, {"role": "user", "content": "y" * 400_000}]
        ),
        DataError,
        (r"d\.jsonl:line 2: the prompt is 1,000,000 bytes of text",),
        ("a chat prompt of 1 MB over two messages", "every message's content counts"),
    ),
    Case(
        "data-json-array-file",
        lambda tmp: _text_file(tmp, "d.json", json.dumps([ROW, ROW], indent=2)),
        DataError,
        (
            r"d\.json:line 1: not valid JSON",
            r"the file looks like one JSON array",
            r"JSON Lines: one JSON object per line",
        ),
        ("a .json file holding one JSON array", "data files are JSON Lines; the error says so"),
    ),
    Case(
        "data-json-array-one-line",
        lambda tmp: _text_file(tmp, "d.json", json.dumps([ROW, ROW])),
        DataError,
        (r"d\.json:line 1: a row must be a JSON object, got list", r"JSON Lines"),
        ("the same array on one line", "the same"),
    ),
    Case(
        "data-deep-json",
        lambda tmp: _text_file(tmp, "d.jsonl", json.dumps(ROW) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n"),
        DataError,
        (r"d\.jsonl:line 2: the JSON is nested too deeply to read",),
        ("a line of 100,000 nested arrays", "the parser's recursion limit, naming the file and line"),
    ),
    Case(
        "data-null-answer",
        lambda tmp: load([jsonl(tmp / "d.jsonl", [ROW, {"prompt": "2+2=", "answer": None}])]),
        DataError,
        (r"d\.jsonl:line 2: answer is null",),
        ("a row with answer: null", "every row's ground truth, at load"),
    ),
    Case(
        "data-null-answer-parquet",
        _parquet_null_answer,
        DataError,
        (r"d\.parquet\[row 1\]: answer is null",),
        ("the same in parquet", "the same"),
    ),
    # ------------------------------------------------------------------------------------ checkpoints
    Case(
        "checkpoint-keep-last-zero",
        lambda tmp: grpo_config("checkpoint.keep_last=0"),
        ConfigError,
        (r"checkpoint\.keep_last", r"must be >= 1"),
        ("checkpoint.keep_last=0", "at least one checkpoint is kept"),
    ),
    Case(
        "checkpoint-dir-under-a-file",
        lambda tmp: (tmp.joinpath("f").write_text("x"), _resume_with(tmp, str(tmp / "f" / "ckpt"))),
        SystemExit,
        (r"NotADirectoryError: the checkpoint dir .* '.*/f/ckpt' cannot be created: '.*/f' is a file",),
        ("checkpoint.dir below a regular file", "the checkpoint dir can be created, at start-up"),
    ),
    Case(
        "checkpoint-dir-unwritable",
        lambda tmp: _resume_with(tmp, _unwritable_dir(tmp)),
        SystemExit,
        (r"PermissionError: the checkpoint dir .* cannot be written: creating a file in '.*' failed",),
        ("checkpoint.dir in a read-only place", "a probe file can be written there, at start-up"),
    ),
    # ---------------------------------------------------------------------------------------- rewards
    Case(
        "reward-generator-function",
        lambda tmp: RewardScorer(RewardConfig(fn=(f"{pyfile(tmp, 'r.py', GENERATOR_REWARD)}:fn",))),
        ConfigError,
        (r"reward\.fn='.*r\.py:fn' is a generator function \(it yields\)", "return, not yield"),
        ("a reward function that yields", "the function is a plain one, at start-up"),
    ),
    Case(
        "reward-async-function",
        lambda tmp: RewardScorer(RewardConfig(fn=(f"{pyfile(tmp, 'r.py', ASYNC_REWARD)}:fn",))),
        ConfigError,
        (r"reward\.fn='.*r\.py:fn' is an async function",),
        ("an async reward function", "the same"),
    ),
    Case(
        "reward-unpicklable-result-in-a-worker",
        lambda tmp: _score_with(tmp, "def fn(r, g):\n    return (x for x in [1.0])\n", workers=1),
        RewardError,
        (r"reward function '.*my_reward\.py:fn' returned generator <generator object", r"train\.jsonl:line 1"),
        ("a reward returning a generator object, in a worker process", "named like any result that is not a number"),
    ),
    # ------------------------------------------------------------------------------------- algorithm
    Case(
        "algo-estimator-wrong-signature",
        lambda tmp: _algorithm(tmp, ESTIMATOR_POSITIONAL, "algo.estimator=@my_algo.py:centered"),
        ConfigError,
        (
            r"algo\.estimator='.*my_algo\.py:centered' does not fit the call the recipe makes, "
            r"fn\(scores, \*, group_ids, response_mask, \*\*kwargs\) -> \(advantages, returns\)",
            r"unexpected keyword argument 'response_mask'",
        ),
        ("an estimator fn(scores, group_ids)", "called once on a synthetic batch at start-up, before the model"),
    ),
    Case(
        "algo-estimator-wrong-shape",
        lambda tmp: _algorithm(tmp, ESTIMATOR_PER_ROW, "algo.estimator=@my_algo.py:centered"),
        ConfigError,
        (r"its advantages must be a float tensor of shape \(16, 3\) \(b t\), got torch\.float32 of shape \(16,\)",),
        ("an estimator returning one advantage per row", "its results' shapes"),
    ),
    Case(
        "algo-loss-wrong-signature",
        lambda tmp: _algorithm(tmp, LOSS_POSITIONAL, "algo.policy_loss=@my_algo.py:my_loss"),
        ConfigError,
        (
            r"algo\.policy_loss='.*my_algo\.py:my_loss' does not fit the call the recipe makes, fn\(logprobs, \*, "
            r"old_logprobs, advantages, response_mask, behaviour_logprobs, is_weights, agg, norms, horizon, seed",
            r"raised TypeError",
        ),
        ("a policy loss without the keyword arguments", "called once on a synthetic micro-batch at start-up"),
    ),
    Case(
        "algo-loss-returns-a-float",
        lambda tmp: _algorithm(tmp, LOSS_FLOAT, "algo.policy_loss=@my_algo.py:my_loss"),
        ConfigError,
        (r"its loss must be a scalar tensor that carries the gradient of logprobs, got float",),
        ("a policy loss returning a float", "a differentiable scalar and a dict of metrics"),
    ),
    Case(
        "algo-reference-misspelt",
        lambda tmp: _algorithm(tmp, ESTIMATOR_PER_ROW, "algo.estimator=@my_algo.py:centred"),
        ConfigError,
        (r"file '.*my_algo\.py' has no attribute 'centred'; did you mean centered\?",),
        ("algo.estimator=my_algo.py:centred", "the closest names in the file"),
    ),
    Case(
        "algo-passk-with-one-sample",
        lambda tmp: _algorithm(tmp, "", "algo.estimator=grpo_passk", "rollout.n=1"),
        ConfigError,
        (r"algo\.estimator='grpo_passk'", r"needs at least 2 responses per group", r"groups of rollout\.n=1 samples"),
        ("algo.estimator=grpo_passk rollout.n=1", "the estimator on groups of rollout.n samples"),
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_input_is_an_error_that_names_it(case, tmp_path):
    try:
        with pytest.raises(case.error) as caught:
            case.build(tmp_path)
    finally:
        for locked in tmp_path.glob("locked"):
            locked.chmod(0o700)  # let pytest clean it up
    message = str(caught.value)
    missing = [pattern for pattern in case.names if not re.search(pattern, message)]
    assert not missing, f"{case.id}: the message does not match {missing}:\n{message}"


def test_the_catalogue_has_a_doc_row_per_case():
    assert len({c.id for c in CASES}) == len(CASES) and all(all(c.doc) for c in CASES)


# --------------------------------------------------------------------------- limits: what is not tokenised


class _CountingTokenizer:
    """The real char tokenizer, recording how many characters each call was given."""

    def __init__(self) -> None:
        self.tok, self.seen = build_char_tokenizer(), []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)

    def __call__(self, text: str, **kw: Any) -> Any:
        self.seen.append(len(text))
        return self.tok(text, **kw)

    def apply_chat_template(self, messages: Any, **kw: Any) -> Any:
        self.seen.append(sum(len(m["content"]) for m in messages))
        return self.tok.apply_chat_template(messages, **kw)


@pytest.mark.parametrize("truncation", ["error", "filter"])
def test_a_prompt_over_the_byte_bound_never_reaches_the_tokenizer(tmp_path, truncation):
    """50 MB of prompt is decided by its bytes: an error, or filtered out, in well under a second of tokenising."""
    tok = _CountingTokenizer()
    path = jsonl(tmp_path / "d.jsonl", [ROW, {"prompt": "7" * 50_000_000, "answer": "b"}, ROW])
    t0 = time.perf_counter()
    if truncation == "error":
        with pytest.raises(DataError, match=r"line 2: the prompt is 50,000,000 bytes"):
            load_examples([path], DataConfig(max_prompt_length=16), tok)
    else:
        examples, report = load_examples([path], DataConfig(max_prompt_length=16, truncation="filter"), tok)
        assert (len(examples), report.filtered, report.rows) == (2, 1, 3)
    assert max(tok.seen) == len("1+1=") and time.perf_counter() - t0 < 20


def test_the_byte_bound_never_refuses_a_prompt_that_fits(tmp_path):
    """At the bound itself a prompt is still tokenised (and then judged by its token count), and under left / right
    truncation prompts far past max_prompt_length are cut as before."""
    per_token = max_token_bytes(TOK)
    assert per_token == len("<|assistant|>")  # the char tokenizer's longest token
    cfg = DataConfig(max_prompt_length=16, truncation="left")
    examples, report = load_examples(
        [jsonl(tmp_path / "d.jsonl", [{"prompt": "12345" * 100, "answer": "b"}])], cfg, TOK
    )
    assert report.truncated == 1 and examples[0].prompt_ids == tuple(TOK("12345" * 100)["input_ids"][-16:])
    at_bound = "1" * (16 * per_token)
    at_bound_file = jsonl(tmp_path / "e.jsonl", [{"prompt": at_bound, "answer": "b"}])
    with pytest.raises(DataError, match=rf"the prompt has {16 * per_token} tokens, more than data\.max_prompt_length"):
        load_examples([at_bound_file], DataConfig(max_prompt_length=16), TOK)


# ------------------------------------------------------------------------------------------ warnings


def test_warnings_for_train_as_val_empty_messages_and_too_few_prompts(tmp_path):
    train = jsonl(
        tmp_path / "train.jsonl",
        [ROW, {"prompt": [{"role": "system", "content": ""}, {"role": "user", "content": "2+2="}], "answer": "4"}],
    )
    _, report = load([train])
    assert (report.empty_contents, report.first_empty_content) == (1, f"{train}:line 2 prompt[0]")
    another_spelling = str(tmp_path / "." / "train.jsonl")
    warnings = data_warnings([train], [another_spelling], {"training": report, "held-out": report}, prompts_per_step=32)
    text = "\n".join(warnings)
    assert len(warnings) == 4, text
    assert "the held-out data is training data" in text and str(Path(train).resolve()) in text
    assert f"1 training row(s) have a chat message with empty content (the first: {train}:line 2 prompt[0])" in text
    assert "the training data has 2 prompt(s), fewer than prompts_per_step=32" in text
    ok = LoadReport(rows=64, kept=64, filtered=0, truncated=0)
    assert data_warnings([train], [str(tmp_path / "val.jsonl")], {"training": ok}, prompts_per_step=32) == []


def test_rollout_n_1_with_a_group_estimator_is_a_warning():
    from backends.loop.algorithm_checks import group_size_warnings

    assert group_size_warnings(8, key="algo.estimator", spec="grpo") == []
    [warning] = group_size_warnings(1, key="algo.estimator", spec="rloo")
    assert "rollout.n=1 with the group estimator algo.estimator=rloo" in warning and "rollout.n >= 2" in warning


def test_a_run_logs_its_data_warnings_once(tmp_path):
    """load_run_data, what every recipe calls, logs each warning once (on the first rank)."""
    from backends.loop.stages import load_run_data

    train = jsonl(tmp_path / "train.jsonl", [ROW] * 3)
    cfg = grpo_config(f"data.train_files={train}", f"data.val_files={train}", "reward.fn=exact")
    stream = io.StringIO()
    log = logging.getLogger("test_bad_inputs_limits")
    handler = logging.StreamHandler(stream)
    log.addHandler(handler)
    try:
        load_run_data(cfg, TOK, RewardScorer(cfg.reward), log)
    finally:
        log.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert sum("the held-out data is training data" in line for line in lines) == 1, lines
    assert sum("fewer than prompts_per_step=32" in line for line in lines) == 1, lines


def test_every_builtin_estimator_and_loss_passes_the_start_up_call():
    """The synthetic call refuses no built-in the recipe accepts (sapo, gpg and kl_cov take no clip keywords)."""
    import rlfunc as rf
    from experiments import grpo

    estimators, _ = grpo.group_estimators()
    for estimator in estimators:
        for loss in rf.POLICY_LOSSES:
            cfg = grpo_config(f"algo.estimator={estimator}", f"algo.policy_loss={loss}")
            grpo.group_relative(cfg)

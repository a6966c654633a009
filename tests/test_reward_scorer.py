"""Reward functions by name and by reference: routing, weights, columns, worker processes, time limits, errors."""

from __future__ import annotations

import math

import pytest

from backends.config import ConfigError
from backends.data import Example
from backends.rewards import RewardConfig, RewardError, RewardScorer, math_reward

pytestmark = pytest.mark.data

USER_FILE = '''
import math
import time


def reverse_score(response, ground_truth, *, level=0):
    """1 for the exact reversal; the row's `level` column arrives as a keyword."""
    return {"score": float(response.strip() == ground_truth), "level": float(level)}


def length_penalty(response, ground_truth, **columns):
    return -0.1 * len(response) + (0.5 if columns.get("data_source") == "rev" else 0.0)


def explode(response, ground_truth):
    if response == "boom":
        raise ValueError("cannot score this")
    return 1.0


def slow(response, ground_truth):
    if response == "slow":
        time.sleep(30)
    return 1.0


def busy(response, ground_truth):
    if response == "busy":
        while True:
            pass
    return 1.0


def not_a_number(response, ground_truth):
    return float("nan") if response == "nan" else ("text" if response == "text" else 1.0)


def stuck(response, ground_truth):
    import signal

    if response == "stuck":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(30)
    return 1.0


def one_argument(response):
    return 1.0
'''


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_rewards.py"
    path.write_text(USER_FILE)
    return path


def example(gt="cba", source="rev", row=1, **columns):
    return Example(
        prompt_ids=(1, 2),
        ground_truth=gt,
        source=source,
        columns={"data_source": source, **columns},
        where=f"train.jsonl:line {row}",
    )


def test_builtins_by_name():
    scorer = RewardScorer(RewardConfig(fn=("exact",)))
    assert scorer.score([" cba\n", "abc"], [example(), example()]).scores.tolist() == [1.0, 0.0]
    gsm = RewardScorer(RewardConfig(fn=("gsm8k",)))
    assert gsm.score(["so #### 72", "#### 7"], [example(gt="72"), example(gt="72")]).scores.tolist() == [1.0, 0.0]
    fmt = RewardScorer(RewardConfig(fn=("format",), format_pattern=r"<answer>\d+</answer>"))
    assert fmt.score(["<answer>12</answer>", "12"], [example(), example()]).scores.tolist() == [1.0, 0.0]
    assert scorer.workers == 0  # built-ins run in this process by default


def test_math_verify_compares_answers_symbolically():
    assert math_reward(r"the answer is $\boxed{\frac{1}{2}}$", "0.5") == 1.0
    assert math_reward(r"so $x = \boxed{1 + x}$", "x+1") == 1.0
    assert math_reward(r"$\boxed{3}$", r"\frac{6}{2}") == 1.0
    assert math_reward(r"$\boxed{4}$", "3") == 0.0
    assert math_reward("no answer here", "3") == 0.0


def test_user_function_gets_the_columns_it_names_and_extras_are_logged(user_file):
    scorer = RewardScorer(RewardConfig(fn=(f"{user_file}:reverse_score",), workers=0))
    result = scorer.score(["cba", "abc"], [example(level=3, other="x"), example(level=5)])
    assert result.scores.tolist() == [1.0, 0.0]
    assert result.extras["reverse_score/level"] == [3.0, 5.0]
    assert result.metrics() == {"reward/reverse_score": 0.5, "reward/reverse_score/level": 4.0, "reward/errors": 0.0}


def test_several_functions_are_weighted_and_sources_are_routed(user_file):
    cfg = RewardConfig(
        fn=(f"{user_file}:reverse_score", f"{user_file}:length_penalty"),
        weights=(1.0, 2.0),
        by_source=("math=exact",),
        workers=0,
    )
    scorer = RewardScorer(cfg)
    result = scorer.score(
        ["cba", "4", "5"], [example(), example(gt="4", source="math"), example(gt="4", source="math")]
    )
    assert result.scores.tolist() == pytest.approx([1.0 + 2.0 * (-0.3 + 0.5), 1.0, 0.0])
    assert result.parts["exact"] == [None, 1.0, 0.0] and result.parts["length_penalty"][1:] == [None, None]
    scorer.check_sources(["rev", "math", "anything"])  # reward.fn covers the rest
    routed_only = RewardScorer(RewardConfig(by_source=("math=exact", "rev=exact")))
    with pytest.raises(ConfigError, match="no reward function for data_source 'gsm'"):
        routed_only.check_sources(["math", "gsm"])


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (RewardConfig(), "reward.fn is empty: name a built-in reward"),
        (RewardConfig(fn=("exact",), weights=(1.0, 2.0)), "reward.weights has 2 entries for 1 reward.fn entries"),
        (RewardConfig(fn=("gsm9k",)), "reward.fn='gsm9k' is not a built-in name; did you mean gsm8k"),
        (RewardConfig(fn=("nowhere.py:f",)), "no file"),
        (RewardConfig(by_source=("math",)), "reward.by_source entry 'math' must look like source=function"),
    ],
)
def test_bad_config_fails_at_start_up(cfg, message):
    with pytest.raises(ConfigError, match=message):
        RewardScorer(cfg)


def test_a_function_of_the_wrong_shape_fails_at_start_up(user_file):
    with pytest.raises(ConfigError, match="called as fn\\(response, ground_truth, \\*\\*columns\\)"):
        RewardScorer(RewardConfig(fn=(f"{user_file}:one_argument",)))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_raising_function_names_the_row_or_counts_a_zero(user_file, workers):
    cfg = RewardConfig(fn=(f"{user_file}:explode",), workers=workers)
    scorer = RewardScorer(cfg)
    try:
        with pytest.raises(RewardError, match=r"explode' raised ValueError: cannot score this on train.jsonl:line 7"):
            scorer.score(["ok", "boom"], [example(row=6), example(row=7)])
    finally:
        scorer.close()
    lenient = RewardScorer(RewardConfig(fn=(f"{user_file}:explode",), workers=workers, on_error="zero"))
    try:
        result = lenient.score(["ok", "boom", "ok"], [example(), example(), example()])
    finally:
        lenient.close()
    assert result.scores.tolist() == [1.0, 0.0, 1.0] and result.errors == 1 and result.metrics()["reward/errors"] == 1.0


@pytest.mark.parametrize(("workers", "fn"), [(0, "slow"), (1, "slow"), (1, "busy")])
def test_a_call_past_its_time_limit_is_stopped(user_file, workers, fn):
    cfg = RewardConfig(fn=(f"{user_file}:{fn}",), workers=workers, timeout_s=0.5, on_error="zero")
    scorer = RewardScorer(cfg)
    try:
        result = scorer.score(["ok", fn, "ok"], [example(), example(), example()])
        assert result.scores.tolist() == [1.0, 0.0, 1.0] and result.errors == 1
        strict = RewardScorer(RewardConfig(fn=(f"{user_file}:{fn}",), workers=workers, timeout_s=0.5))
        with pytest.raises(RewardError, match=rf":{fn}' ran longer than reward.timeout_s=0.5 on train.jsonl:line 4"):
            strict.score([fn], [example(row=4)])
        strict.close()
        assert scorer.score(["ok"], [example()]).scores.tolist() == [1.0]  # the pool works after a stop
    finally:
        scorer.close()


def test_a_hung_worker_is_replaced(user_file, monkeypatch):
    """A call stuck where the in-worker alarm cannot reach it (the function blocks SIGALRM, as C code that
    never returns to Python would) is stopped past its deadline: its worker is killed and a new worker runs the
    calls after it."""
    import backends.rewards.workers as workers_module

    monkeypatch.setattr(workers_module, "KILL_AFTER_S", 0.5)
    scorer = RewardScorer(RewardConfig(fn=(f"{user_file}:stuck",), workers=1, timeout_s=0.2, on_error="zero"))
    try:
        result = scorer.score(["stuck", "ok"], [example(), example()])
        assert result.scores.tolist() == [0.0, 1.0] and result.errors == 1
        assert scorer.score(["ok"], [example()]).scores.tolist() == [1.0]
    finally:
        scorer.close()
    strict = RewardScorer(RewardConfig(fn=(f"{user_file}:stuck",), workers=1, timeout_s=0.2))
    try:
        with pytest.raises(
            RewardError, match="'.*stuck' did not return within reward.timeout_s=0.2 \\(its worker was stopped\\)"
        ):
            strict.score(["stuck"], [example()])
    finally:
        strict.close()


@pytest.mark.parametrize(
    ("response", "message"),
    [
        ("nan", "returned nan on train.jsonl:line 1; a reward must be finite"),
        ("text", "returned str 'text' on train.jsonl:line 1; a reward is a number or a dict with a 'score' number"),
    ],
)
def test_nan_or_a_wrong_type_is_always_an_error(user_file, response, message):
    scorer = RewardScorer(RewardConfig(fn=(f"{user_file}:not_a_number",), workers=0, on_error="zero"))
    with pytest.raises(RewardError, match=message):
        scorer.score([response], [example()])


def test_a_dict_without_score_is_an_error(tmp_path):
    (tmp_path / "r.py").write_text("def f(response, ground_truth):\n    return {'acc': 1.0}\n")
    scorer = RewardScorer(RewardConfig(fn=(f"{tmp_path / 'r.py'}:f",), workers=0))
    with pytest.raises(RewardError, match=r"returned a dict without 'score' on train.jsonl:line 1 \(keys: \['acc'\]\)"):
        scorer.score(["x"], [example()])


def test_workers_compute_what_the_process_computes(user_file):
    cfg = RewardConfig(fn=(f"{user_file}:reverse_score", f"{user_file}:length_penalty"), weights=(1.0, 0.5))
    pooled = RewardScorer(cfg)
    assert pooled.workers == 2  # user functions go to worker processes by default
    responses = ["cba", "abc", "c", "cba "]
    rows = [example(level=i) for i in range(4)]
    try:
        a = pooled.score(responses, rows)
    finally:
        pooled.close()
    b = RewardScorer(RewardConfig(fn=cfg.fn, weights=cfg.weights, workers=0)).score(responses, rows)
    assert a.scores.tolist() == b.scores.tolist() and a.extras == b.extras
    assert all(math.isfinite(x) for x in a.scores.tolist())

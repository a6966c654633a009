import pytest

from experiments.tasks.arithmetic import ArithmeticTask


def test_heldout_never_in_training_stream_and_stream_is_seeded():
    task = ArithmeticTask(max_operand=9, max_second_operand=9, num_heldout=20)
    held = {p.prompt for p in task.heldout()}
    assert len(held) == 20
    drawn = task.train_stream(seed=1).take(2000)
    assert not held & {p.prompt for p in drawn}
    assert all(p.answer == sum(map(int, p.prompt[:-1].split("+"))) for p in drawn)
    assert drawn[:50] == task.train_stream(seed=1).take(50)
    assert drawn[:50] != task.train_stream(seed=2).take(50)


def test_stream_resumes_from_its_position():
    task = ArithmeticTask()
    s = task.train_stream(seed=3)
    s.take(37)
    resumed = task.train_stream(seed=3, drawn=s.drawn)
    assert resumed.take(10) == s.take(10)


def test_bad_heldout_size():
    with pytest.raises(ValueError, match="num_heldout"):
        ArithmeticTask(max_operand=2, max_second_operand=2, num_heldout=9)


def test_wrong_answers_fraction_and_offsets():
    import random

    from experiments.tasks.arithmetic import WarmStartConfig, with_wrong_answers

    problems = ArithmeticTask().train_stream(seed=0).take(4000)
    noisy = with_wrong_answers(problems, 0.4, random.Random(0))
    assert [p.prompt for p in noisy] == [p.prompt for p in problems]
    changed = [(p.answer, q.answer) for p, q in zip(problems, noisy) if p.answer != q.answer]
    assert 0.37 < len(changed) / len(problems) < 0.43
    assert all(1 <= abs(a - b) <= 9 and b >= 0 for a, b in changed)
    assert with_wrong_answers(problems, 0.0, random.Random(0)) == problems
    assert with_wrong_answers(problems, 0.4, random.Random(0)) == noisy  # seeded
    with pytest.raises(ValueError, match="wrong_answer_fraction"):
        WarmStartConfig(wrong_answer_fraction=1.0)


def test_warm_start_config_is_the_sft_stage_plus_label_noise():
    from backends.config import apply_overrides, config_keys
    from backends.training.sft import SFTConfig
    from experiments.tasks.arithmetic import WarmStartConfig

    cfg = WarmStartConfig(wrong_answer_fraction=0.5)
    assert isinstance(cfg, SFTConfig)
    assert config_keys(WarmStartConfig) == [*config_keys(SFTConfig), "wrong_answer_fraction"]
    cfg = apply_overrides(cfg, ["steps=7", "optim.lr=1e-2", "wrong_answer_fraction=0.25"])
    assert (cfg.steps, cfg.optim.lr, cfg.wrong_answer_fraction) == (7, 1e-2, 0.25)


def test_sft_examples_are_prompt_then_answer_and_eos():
    from backends.models import build_char_tokenizer
    from experiments.tasks.arithmetic import Problem, sft_examples

    tokenizer = build_char_tokenizer()
    (example,) = sft_examples([Problem(prompt="12+3=", answer=15)], tokenizer)
    assert list(example.prompt_ids) == tokenizer.encode("12+3=")
    assert list(example.response_ids) == tokenizer.encode("15") + [tokenizer.eos_token_id]

"""The arithmetic task as data files: held-out pairs never in training, seeded noisy SFT answers, the recipe's
format."""

import json

import pytest

from experiments.tasks.arithmetic import ArithmeticTask, chat_row, main, sft_rows, write_dataset


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_heldout_pairs_are_never_training_prompts(tmp_path):
    task = ArithmeticTask(max_operand=9, max_second_operand=9, num_heldout=20)
    out = write_dataset(tmp_path, task, sft_examples=500)
    train, val, sft = _read(out / "train.jsonl"), _read(out / "val.jsonl"), _read(out / "sft.jsonl")
    prompts = lambda rows: {r["prompt"][0]["content"] for r in rows}
    assert len(val) == 20 and len(train) == 80 and not prompts(val) & prompts(train)
    assert not prompts(val) & prompts(sft)
    for row in train + val:
        a, b = map(int, row["prompt"][0]["content"][:-1].split("+"))
        assert row["answer"] == str(a + b) and row["data_source"] == "arithmetic"
        assert row["prompt"][0]["role"] == "user"


def test_sft_answers_are_wrong_by_the_fraction_and_seeded():
    problems = ArithmeticTask().train()
    rows = list(sft_rows(problems, 4000, 0.4, seed=0))
    wrong = []
    for row in rows:
        a, b = map(int, row["prompt"][0]["content"][:-1].split("+"))
        if int(row["response"]) != a + b:
            wrong.append((a + b, int(row["response"])))
    assert 0.37 < len(wrong) / len(rows) < 0.43
    assert all(1 <= abs(x - y) <= 9 and y >= 0 for x, y in wrong)
    assert rows == list(sft_rows(problems, 4000, 0.4, seed=0))
    assert rows != list(sft_rows(problems, 4000, 0.4, seed=1))
    assert all(
        int(r["response"]) == sum(map(int, r["prompt"][0]["content"][:-1].split("+")))
        for r in sft_rows(problems, 200, 0.0, seed=0)
    )
    with pytest.raises(ValueError, match="wrong_answer_fraction"):
        list(sft_rows(problems, 1, 1.0, seed=0))


def test_long_tailed_thoughts_keep_the_answers_and_the_reward():
    """With ``think_mean``, responses restate the answer a heavy-tailed number of times (up to the cap) before
    ``####<answer>``; the answers are those of the plain rows (same seed), and the built-in reward accepts the
    format."""
    from rlfunc.rewards import arithmetic_reward

    problems = ArithmeticTask().train()
    plain = list(sft_rows(problems, 4000, 0.4, seed=0))
    long = list(sft_rows(problems, 4000, 0.4, seed=0, think_mean=3.0, think_max=12))
    counts = []
    for p, row in zip(plain, long):
        thought, answer = row["response"].split("####")
        assert row["prompt"] == p["prompt"] and answer == p["response"]
        assert thought == f"{answer}," * thought.count(",")
        counts.append(thought.count(","))
        a, b = map(int, row["prompt"][0]["content"][:-1].split("+"))
        assert arithmetic_reward(row["response"], a + b) == (1.0 if int(answer) == a + b else 0.0)
    counts.sort()
    median, p90 = counts[len(counts) // 2], counts[int(0.9 * len(counts))]
    assert median == 1 and p90 >= 5 and max(counts) == 12  # most short, a long tail, capped
    assert 0.03 < counts.count(12) / len(counts) < 0.05  # the Lomax tail past the cap: (1 + 12 / 3) ** -2 = 4%
    with pytest.raises(ValueError, match="think_mean"):
        list(sft_rows(problems, 1, 0.0, seed=0, think_mean=-1.0))


def test_bad_heldout_size():
    with pytest.raises(ValueError, match="num_heldout"):
        ArithmeticTask(max_operand=2, max_second_operand=2, num_heldout=9)


def test_the_files_load_as_recipe_data(tmp_path):
    """The task's files go through the same loading code as a user's: chat template, answers, SFT examples."""
    from backends.data import DataConfig, load_examples
    from backends.models import build_char_tokenizer
    from backends.training.sft import SFTConfig, load_sft_examples

    main(["--out", str(tmp_path), "--max-operand", "9", "--num-heldout", "10", "--sft-examples", "16"])
    tok = build_char_tokenizer()
    examples, report = load_examples([str(tmp_path / "val.jsonl")], DataConfig(max_prompt_length=16), tok)
    assert report.kept == 10 and examples[0].source == "arithmetic"
    first = _read(tmp_path / "val.jsonl")[0]
    assert (
        list(examples[0].prompt_ids)
        == tok.apply_chat_template(first["prompt"], add_generation_prompt=True)["input_ids"]
    )
    assert examples[0].ground_truth == first["answer"]
    sft = load_sft_examples(SFTConfig(files=(str(tmp_path / "sft.jsonl"),)), tok)
    row = _read(tmp_path / "sft.jsonl")[0]
    assert tok.decode(list(sft[0].response_ids)) == row["response"] + "<eos>"
    assert chat_row(ArithmeticTask.make(2, 3))["answer"] == "5"

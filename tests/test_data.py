"""Prompt data from files: formats, chat templates, checks that name the file and row, truncation, the stream."""

from __future__ import annotations

import json

import pytest

from backends.data import DataConfig, DataError, PromptStream, load_examples, prompt_token_ids, read_rows
from backends.models import build_char_tokenizer

pytestmark = pytest.mark.data

ROWS = [
    {"prompt": [{"role": "user", "content": "reverse: abc"}], "answer": "cba", "data_source": "rev", "level": 1},
    {"prompt": "reverse: hello", "answer": "olleh", "data_source": "rev", "level": 2},
    {
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}],
        "answer": "4",
        "level": 3,
    },
]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_jsonl_parquet_and_a_saved_dataset_give_the_same_examples(tmp_path, tok):
    import datasets

    uniform = [ROWS[0], {**ROWS[2], "data_source": "math"}]  # a parquet column holds one type: all chats here
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(uniform).save_to_disk(str(saved))
    cfg = DataConfig()
    a, _ = load_examples([write_jsonl(tmp_path / "d.jsonl", uniform)], cfg, tok)
    b, _ = load_examples([write_parquet(tmp_path / "d.parquet", uniform)], cfg, tok)
    c, _ = load_examples([str(saved)], cfg, tok)
    for x, y, z in zip(a, b, c):
        assert x.prompt_ids == y.prompt_ids == z.prompt_ids
        assert x.ground_truth == y.ground_truth == z.ground_truth
        assert x.source == y.source == z.source
        assert x.columns["level"] == y.columns["level"] == z.columns["level"]
    assert a[1].where.endswith("d.jsonl:line 2") and b[1].where.endswith("d.parquet[row 1]")


def test_chat_prompts_are_the_chat_templates_ids_and_strings_are_encoded_as_is(tmp_path, tok):
    examples, report = load_examples([write_jsonl(tmp_path / "d.jsonl", ROWS)], DataConfig(), tok)
    assert report.rows == report.kept == 3
    want = tok.apply_chat_template(ROWS[0]["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"]
    assert list(examples[0].prompt_ids) == want
    assert tok.decode(list(examples[0].prompt_ids)) == "<|user|>reverse: abc<eos><|assistant|>"
    assert list(examples[1].prompt_ids) == tok("reverse: hello")["input_ids"]
    assert tok.decode(list(examples[2].prompt_ids)) == "<|system|>be brief<eos><|user|>2+2=<eos><|assistant|>"
    # the other columns reach the reward; the source defaults to "default"
    assert examples[0].columns == {"data_source": "rev", "level": 1} and examples[0].ground_truth == "cba"
    assert examples[2].source == "default"


def test_a_jinja_template_file_replaces_the_tokenizers(tmp_path, tok):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}({{ m['content'] }}){% endfor %}")
    ids = prompt_token_ids([{"role": "user", "content": "hi"}], tok, chat_template=str(template))
    assert tok.decode(ids) == "(hi)"
    with pytest.raises(DataError, match="data.chat_template=none"):
        prompt_token_ids([{"role": "user", "content": "hi"}], tok, chat_template="none")
    with pytest.raises(DataError, match="no such template file"):
        load_examples([write_jsonl(tmp_path / "d.jsonl", ROWS)], DataConfig(chat_template="nope.jinja"), tok)


def test_verl_nested_answer_column(tmp_path, tok):
    row = {
        "prompt": [{"role": "user", "content": "1+1="}],
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "data_source": "openai/gsm8k",
        "extra_info": {"index": 7},
    }
    (example,), _ = load_examples(
        [write_parquet(tmp_path / "v.parquet", [row])], DataConfig(answer_key="reward_model.ground_truth"), tok
    )
    assert example.ground_truth == "2" and example.source == "openai/gsm8k"
    assert example.columns["reward_model"]["style"] == "rule" and example.columns["extra_info"] == {"index": 7}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "x", "answer": "1"}\n{"prompt": "y", "answer": \n', "d.jsonl:line 2: not valid JSON"),
        ('{"prompt": "x", "answer": "1"}\n[1, 2]\n', "d.jsonl:line 2: a row must be a JSON object, got list"),
        ('{"prompt": "x", "answer": "1"}\n\n{"question": "y", "answer": "2"}\n', "d.jsonl:line 3: no column 'prompt'"),
        ('{"prompt": "x"}\n', "d.jsonl:line 1: no column 'answer' (the row has ['prompt'])"),
        ('{"prompt": "", "answer": "1"}\n', "d.jsonl:line 1: prompt is an empty string"),
        (
            '{"prompt": 7, "answer": "1"}\n',
            "d.jsonl:line 1: prompt must be a string or a non-empty list of messages, got int",
        ),
        (
            '{"prompt": [{"role": "robot", "content": "x"}], "answer": "1"}\n',
            "d.jsonl:line 1: prompt[0] has role 'robot'",
        ),
        (
            '{"prompt": [{"content": "x"}], "answer": "1"}\n',
            "d.jsonl:line 1: prompt[0] must be a {'role': ..., 'content': ...} message",
        ),
        (
            '{"prompt": [{"role": "user", "content": 5}], "answer": "1"}\n',
            "d.jsonl:line 1: prompt[0].content must be a string, got int",
        ),
    ],
)
def test_a_bad_row_is_an_error_naming_the_file_and_row(tmp_path, tok, content, message):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(DataError) as info:
        load_examples([str(path)], DataConfig(), tok)
    assert message in str(info.value)


def test_bad_files(tmp_path, tok):
    with pytest.raises(DataError, match="no such file or directory"):
        list(read_rows(tmp_path / "missing.jsonl"))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown data format '.csv'"):
        list(read_rows(tmp_path / "d.csv"))
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="bad.parquet: cannot read as parquet"):
        list(read_rows(tmp_path / "bad.parquet"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no rows in"):
        load_examples([str(tmp_path / "empty.jsonl")], DataConfig(), tok)
    (tmp_path / "adir").mkdir()
    with pytest.raises(DataError, match="not a dataset saved with datasets' save_to_disk"):
        list(read_rows(tmp_path / "adir"))


def test_a_saved_dataset_dict_names_its_splits(tmp_path):
    import datasets

    saved = tmp_path / "dd"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:1]), "test": datasets.Dataset.from_list(ROWS[:1])}
    ).save_to_disk(str(saved))
    with pytest.raises(DataError, match=r"a DatasetDict with splits \['train', 'test'\]; give one split's dir"):
        list(read_rows(saved))
    assert len(list(read_rows(saved / "train"))) == 1


def test_overlong_prompts_under_each_truncation_mode(tmp_path, tok):
    rows = [{"prompt": "abcdefghij", "answer": "1"}, {"prompt": "abc", "answer": "2"}]
    files = [write_jsonl(tmp_path / "d.jsonl", rows)]
    with pytest.raises(
        DataError, match=r"d.jsonl:line 1: the prompt has 10 tokens, more than data.max_prompt_length=5"
    ):
        load_examples(files, DataConfig(max_prompt_length=5), tok)
    left, report = load_examples(files, DataConfig(max_prompt_length=5, truncation="left"), tok)
    assert tok.decode(list(left[0].prompt_ids)) == "fghij" and report.truncated == 1
    right, _ = load_examples(files, DataConfig(max_prompt_length=5, truncation="right"), tok)
    assert tok.decode(list(right[0].prompt_ids)) == "abcde"
    kept, report = load_examples(files, DataConfig(max_prompt_length=5, truncation="filter"), tok)
    assert [e.ground_truth for e in kept] == ["2"] and (report.rows, report.kept, report.filtered) == (2, 1, 1)
    with pytest.raises(DataError, match="all 2 rows .* were filtered out"):
        load_examples(files, DataConfig(max_prompt_length=2, truncation="filter"), tok)


def test_the_stream_is_seeded_epoch_by_epoch_and_resumes_exactly(tmp_path, tok):
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(10)]
    examples, _ = load_examples([write_jsonl(tmp_path / "d.jsonl", rows)], DataConfig(), tok)
    stream = PromptStream(examples, seed=3)
    first = [e.ground_truth for e in stream.take(10)]
    second = [e.ground_truth for e in stream.take(10)]
    assert sorted(first) == sorted(second) == sorted(str(i) for i in range(10))  # every row once per epoch
    assert first != second and first != [str(i) for i in range(10)]  # reshuffled each epoch
    assert [e.ground_truth for e in PromptStream(examples, seed=3).take(10)] == first
    assert [e.ground_truth for e in PromptStream(examples, seed=4).take(10)] != first
    stream = PromptStream(examples, seed=3)
    stream.take(13)
    resumed = PromptStream(examples, seed=3, drawn=stream.drawn)
    assert [e.ground_truth for e in resumed.take(12)] == [e.ground_truth for e in stream.take(12)]
    assert resumed.epoch == 2
    ordered = PromptStream(examples, seed=3, shuffle=False)
    assert [e.ground_truth for e in ordered.take(12)] == [str(i) for i in range(10)] + ["0", "1"]
    assert ordered.steps_per_epoch(4) == 3

"""GSM8K as a user downloads it -> the recipes' format (on a small synthetic file of the same schema)."""

from __future__ import annotations

import json

import pytest

from backends.data import DataConfig, DataError, load_examples
from backends.models import build_char_tokenizer
from backends.rewards import RewardConfig, RewardScorer
from experiments.data.gsm8k import INSTRUCTION, convert, final_answer

pytestmark = pytest.mark.data

ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A farm has 1,200 hens and sells 8. How many left?", "answer": "1200 - 8 = 1192\n#### 1,192"},
]


def test_final_answer():
    assert final_answer("so 5 * 2 = 10\n#### 10") == "10"
    assert final_answer("#### -1,234.5") == "-1234.5"
    with pytest.raises(ValueError, match="no '#### <number>'"):
        final_answer("no final answer")


@pytest.mark.parametrize("source_format", ["parquet", "jsonl"])
def test_convert_and_train_on_it(tmp_path, source_format):
    source = tmp_path / f"train.{source_format}"
    if source_format == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS), source)
    else:
        source.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert convert(source, tmp_path / "out" / "train.parquet") == 2
    tok = build_char_tokenizer(model_max_length=512)
    examples, _ = load_examples([str(tmp_path / "out" / "train.parquet")], DataConfig(), tok)
    assert [e.ground_truth for e in examples] == ["7", "1192"] and {e.source for e in examples} == {"openai/gsm8k"}
    import pyarrow.parquet as pq

    written = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert written[0]["prompt"] == [{"role": "user", "content": f"{ROWS[0]['question']} {INSTRUCTION}"}]
    assert examples[1].columns["extra_info"]["split"] == "train" and examples[1].columns["extra_info"]["index"] == 1
    scores = RewardScorer(RewardConfig(fn=("gsm8k",))).score(["3+4=7 #### 7", "#### 1200"], examples).scores
    assert scores.tolist() == [1.0, 0.0]


def test_a_row_without_a_final_answer_is_named(tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "q", "answer": "no number"}) + "\n")
    with pytest.raises(DataError, match="bad.jsonl:line 1: the solution has no"):
        convert(tmp_path / "bad.jsonl", tmp_path / "out.jsonl")

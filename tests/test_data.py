"""veRL-layout datasets: each kind of bad row is named by file, row and problem."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rpk.data import DataError, load_files
from rpk.sched.cursor import CursorMismatch, PromptCursor


class CharTokenizer:
    """A chat tokenizer stand-in: renders 'role: content' lines, one id per character."""

    def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=False):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in conversation)
        return text + ("assistant: " if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def row(content="what is 1+1?", **over):
    r = {
        "prompt": [{"role": "user", "content": content}],
        "data_source": "rpk/arith",
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"index": 0},
    }
    r.update(over)
    return r


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_and_parquet_load_the_same(tmp_path):
    rows = [row(f"q{i}", reward_model={"ground_truth": str(i)}) for i in range(5)]
    a = load_files([write_jsonl(tmp_path / "d.jsonl", rows)], CharTokenizer(), 256)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    b = load_files([tmp_path / "d.parquet"], CharTokenizer(), 256)
    assert [p.text for p in a] == [p.text for p in b]
    assert [p.ground_truth for p in a] == ["0", "1", "2", "3", "4"]
    assert a[0].text == "user: q0\nassistant: "
    assert a[0].token_ids == tuple(ord(c) for c in a[0].text)
    assert a[3].uid.endswith("d.jsonl:line 4") and a[3].extra_info == {"index": 0}
    assert b[3].uid.endswith("d.parquet:row 4")


@pytest.mark.parametrize(
    "bad, problem",
    [
        ({k: v for k, v in row().items() if k != "prompt"}, "missing column 'prompt'"),
        ({k: v for k, v in row().items() if k != "reward_model"}, "missing column 'reward_model'"),
        (row(prompt="just a string"), "'prompt' must be a non-empty list of chat messages"),
        (row(prompt=[]), "'prompt' must be a non-empty list of chat messages"),
        (row(prompt=[{"role": "user", "content": 5}]), "'prompt'[0] must be a message"),
        (row(data_source=3), "'data_source' must be a non-empty string"),
        (row(reward_model={"style": "rule"}), "'reward_model' must be an object with a 'ground_truth'"),
        (row(reward_model={"ground_truth": None}), "'reward_model.ground_truth' is null"),
        (row(extra_info="x"), "'extra_info' must be an object"),
        (row("x" * 300), "prompt is 318 tokens, longer than data.max_prompt_tokens=256"),
        ([1, 2], "expected an object, got list"),
    ],
)
def test_each_bad_row_names_file_row_and_problem(tmp_path, bad, problem):
    path = write_jsonl(tmp_path / "train.jsonl", [row(), row(), bad, row()])
    with pytest.raises(DataError) as info:
        load_files([path], CharTokenizer(), 256)
    msg = str(info.value)
    assert f"{path}: line 3: {problem}" in msg  # the file's own line number
    assert "line 1:" not in msg and "line 4:" not in msg


def test_invalid_json_missing_file_and_unknown_type(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps(row()) + "\n\n{oops\n")
    with pytest.raises(DataError, match=r"x.jsonl: line 3: not valid JSON"):
        load_files([p], CharTokenizer(), 256)
    with pytest.raises(DataError, match="no such file"):
        load_files([tmp_path / "nope.jsonl"], CharTokenizer(), 256)
    (tmp_path / "y.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        load_files([tmp_path / "y.csv"], CharTokenizer(), 256)


def test_non_utf8_jsonl_is_one_line_naming_file_and_line(tmp_path):
    p = tmp_path / "latin.jsonl"
    p.write_bytes(json.dumps(row()).encode() + b"\n" + json.dumps(row()).encode()[:-2] + b"\xe9\"}\n")
    with pytest.raises(DataError) as info:
        load_files([p], CharTokenizer(), 256)
    assert str(info.value).startswith(f"{p}: line 2: not UTF-8")
    assert "\n" not in str(info.value)


def test_parquet_rows_count_from_1_and_a_missing_column_is_reported_once(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    good = tmp_path / "good.parquet"
    pq.write_table(pa.Table.from_pylist([row(), row(data_source=""), row()]), good)
    with pytest.raises(DataError) as info:
        load_files([good], CharTokenizer(), 256)
    assert f"{good}: row 2: 'data_source' must be a non-empty string" in str(info.value)
    assert str(info.value).startswith("1 bad row(s)")
    lacking = tmp_path / "lacking.parquet"
    rows = [{k: v for k, v in row().items() if k != "reward_model"} for _ in range(50)]
    pq.write_table(pa.Table.from_pylist(rows), lacking)
    with pytest.raises(DataError) as info:
        load_files([lacking], CharTokenizer(), 256)
    assert str(info.value).count("reward_model") == 1
    assert str(info.value).startswith(f"{lacking}: no column 'reward_model'")


def test_many_bad_rows_are_listed_up_to_a_limit(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [row(data_source="")] * 25)
    with pytest.raises(DataError) as info:
        load_files([path], CharTokenizer(), 256)
    msg = str(info.value)
    assert msg.startswith("25 bad row(s)") and "and 15 more bad rows" in msg


def test_cursor_visits_each_prompt_once_per_epoch_and_resumes():
    c = PromptCursor(size=10, seed=1)
    seen = c.take(7) + c.take(3)
    assert sorted(seen) == list(range(10)) and c.epoch == 1 and c.position == 0
    c.take(4)
    state = c.state_dict()
    d = PromptCursor(size=10, seed=1)
    d.load_state_dict(state)
    assert c.take(9) == d.take(9)
    with pytest.raises(CursorMismatch, match="dataset has 11"):
        PromptCursor(size=11, seed=1).load_state_dict(state)

"""Benchmark rows that are not what the formatting reads, by value type and by file format: each is one line naming
the benchmark, the file, the row and the field and what to give, never a prompt made of a wrong value (a string
split into one-character MT-Bench turns, a null become the text "None") nor a traceback.

The tables are made from the declaration (dflash_core.published.benchmarks: each benchmark's fields and their kind),
so a field added there is covered by a row here."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from dflash_core.published.benchmarks import (
    BENCHMARKS,
    OPTIONAL_TEXT,
    TEXT,
    TURNS,
    BenchmarkError,
    read_data_option,
)
from dflash_eval.cli import app
from dflash_eval.services.benchmark_data import load_rows
from tests.published_rows import rows

# Values that are no value of each kind, as JSON gives them (a description the message says, the value).
NOT_TEXT = [("null (no value)", None), ("a number (5)", 5), ("a boolean (true)", True), ("a list of 1", ["a"]),
            ("an object", {"text": "a"})]
WRONG = {
    TEXT: [*NOT_TEXT, ("an empty string", ""), ("an empty string", "   ")],
    OPTIONAL_TEXT: [v for v in NOT_TEXT if v[1] is not None],
    TURNS: [("a string ('Tell me a story.')", "Tell me a story."), ("an object", {"1": "Tell me a story."}),
            ("null (no value)", None), ("a number (2)", 2), ("an empty list", []),
            ("turn 2 is null (no value)", ["Tell me a story.", None]), ("turn 1 is an empty string", [""])],
}
FIELDS = [(name, field, kind) for name, b in BENCHMARKS.items() for field, kind in b.fields.items()]


def test_every_field_the_formatting_reads_has_a_kind_with_rows_below():
    assert {kind for _, _, kind in FIELDS} <= set(WRONG)


def _one_row(name: str, field: str, value) -> dict:
    row = rows(name, 1)[0]
    if name == "mt-bench":  # (stand-in rows are the hub's: its `prompt` is the turns)
        row = {**row, "prompt": list(row["prompt"])}
    return {**row, field: value}


@pytest.mark.parametrize(("name", "field", "says", "value"),
                         [(n, f, says, v) for n, f, kind in FIELDS for says, v in WRONG[kind]],
                         ids=lambda x: repr(x)[:30] if not isinstance(x, str) else x)
def test_a_field_of_another_kind_is_one_line_naming_row_and_field(tmp_path, name, field, says, value):
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps(_one_row(name, field, value)) + "\n")
    with pytest.raises(BenchmarkError) as refused:
        load_rows(BENCHMARKS[name], data)
    message = str(refused.value)
    assert message.startswith(f"{name}: --data {data}: row 0: field {field!r} must be ") and says in message, message
    assert "\n" not in message and f"give {BENCHMARKS[name].hub_id}'s" in message


@pytest.mark.parametrize("name", sorted({n for n, _, kind in FIELDS if kind == OPTIONAL_TEXT}))
def test_an_optional_text_may_be_empty_or_null(tmp_path, name):
    (field,) = [f for n, f, kind in FIELDS if n == name and kind == OPTIONAL_TEXT]
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps(_one_row(name, field, value)) + "\n" for value in ("", None)))
    loaded = load_rows(BENCHMARKS[name], data)
    assert all(BENCHMARKS[name].format_turns(r.fields) for r in loaded.rows)


# ---- the same, by file format: what each format can hold

def _jsonl(path: Path, *lines) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _parquet(path: Path, column) -> Path:
    pq.write_table(pa.table({"question": column, "answer": ["1"] * len(column)}), path)
    return path


def _saved(path: Path, column) -> Path:
    from datasets import Dataset, DatasetDict

    DatasetDict({"test": Dataset.from_dict({"question": column, "answer": ["1"] * len(column)})}).save_to_disk(path)
    return path


def _damaged(path: Path, name: str) -> Path:
    _saved(path, ["What is 1 + 1?"])
    target = path / name if name == "dataset_dict.json" else path / "test" / name
    target.write_text("{ not json")
    return path


FORMATS = {
    "jsonl: a number": (lambda d: _jsonl(d / "test.jsonl", {"question": 5}), "field 'question' must be a non-empty "
                                                                                  "string, got a number (5)"),
    "jsonl: null": (lambda d: _jsonl(d / "test.jsonl", {"question": None}), "got null (no value)"),
    "jsonl: a list": (lambda d: _jsonl(d / "test.jsonl", {"question": ["a", "b"]}), "got a list of 2"),
    "jsonl: a line that is a string": (lambda d: _jsonl(d / "test.jsonl", '"hello"'),
                                       "row 0 is a string ('hello'), not a record of fields"),
    "jsonl: a line that is a number": (lambda d: _jsonl(d / "test.jsonl", "5"), "row 0 is a number (5), not a record"),
    "jsonl: a line that is a list": (lambda d: _jsonl(d / "test.jsonl", '["question"]'), "row 0 is a list of 1, not"),
    "jsonl: a line that is no JSON": (lambda d: _jsonl(d / "test.jsonl", {"question": "a"}, "{question"),
                                      "cannot read {d}/test.jsonl: line 2 is not JSON"),
    "json: an array of strings": (lambda d: (d / "test.json").write_text('["a", "b"]') and d / "test.json",
                                  "row 0 is a string ('a'), not a record of fields"),
    "parquet: a number column": (lambda d: _parquet(d / "test.parquet", [1, 2]), "got a number (1)"),
    "parquet: a null": (lambda d: _parquet(d / "test.parquet", ["a", None]), "row 1: field 'question' must be a "
                                                                            "non-empty string, got null"),
    "parquet: a list column": (lambda d: _parquet(d / "test.parquet", [["a"], ["b"]]), "got a list of 1"),
    "csv: a row without the field": (lambda d: (d / "test.csv").write_text("answer,question\n1,a\n2\n") and
                                     d / "test.csv", "row 1: field 'question' must be a non-empty string, got null"),
    "csv: no such column": (lambda d: (d / "test.csv").write_text("answer,q\n1,a\n") and d / "test.csv",
                            "row 0 has no field 'question' (its fields: answer, q)"),
    "save_to_disk: a number column": (lambda d: _saved(d / "saved", [1, 2]), "got a number (1)"),
    "save_to_disk: a null": (lambda d: _saved(d / "saved", ["a", None]), "row 1: field 'question' must be a "
                                                                        "non-empty string, got null"),
    "save_to_disk: a damaged state.json": (lambda d: _damaged(d / "saved", "state.json"),
                                           "--data {d}/saved is a damaged save_to_disk folder"),
    "save_to_disk: a damaged dataset_dict.json": (lambda d: _damaged(d / "saved", "dataset_dict.json"),
                                                  "--data {d}/saved is a damaged save_to_disk folder"),
}


@pytest.mark.parametrize("case", FORMATS)
def test_a_bad_row_of_each_format_is_one_line(tmp_path, case):
    write, says = FORMATS[case]
    data = write(tmp_path)
    with pytest.raises(BenchmarkError) as refused:
        load_rows(BENCHMARKS["gsm8k"], data)
    message = str(refused.value)
    assert message.startswith("gsm8k: ") and says.format(d=tmp_path) in message and "\n" not in message, message


# ---- --data itself

@pytest.mark.parametrize(("data", "says"), [
    ("gsm8k=", "--data gsm8k=: no path after 'gsm8k='; give the folder or file of gsm8k's local copy"),
    ("gsm8k= ,math500=/b", "--data gsm8k=: no path after 'gsm8k='"),
    ("gsm8k=/a,gsm8k=/b", "--data: gsm8k is given twice (/a and /b); give one local copy per benchmark"),
    ("/a,/b", "--data /a: 2 benchmarks are evaluated"),
])
def test_a_data_option_without_a_path_or_with_a_benchmark_twice_is_refused(data, says):
    with pytest.raises(BenchmarkError) as refused:
        read_data_option(data, ["gsm8k", "math500"] if "math500" in data or data == "/a,/b" else ["gsm8k"])
    assert str(refused.value).startswith(says)


def test_an_empty_data_path_never_reads_the_current_folder(tmp_path, monkeypatch):
    """`--data gsm8k=$UNSET` once read the working folder recursively and took a stray test.jsonl for GSM8K."""
    _jsonl(tmp_path / "test.jsonl", {"question": "a stray file"})
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["prompts", "gsm8k", "--data", "gsm8k="])
    assert result.exit_code == 2 and result.output.strip().splitlines() == [
        "error: --data gsm8k=: no path after 'gsm8k='; give the folder or file of gsm8k's local copy (an unset shell "
        "variable gives an empty path)"], result.output


# ---- through the command line: `prompts` (no target needed) and `run` (refused before Prefect starts)

@pytest.mark.parametrize(("row", "says"), [
    ({"prompt": "Tell me a story."}, "field 'prompt' must be a list of user turns (strings), got a string"),
    ({"prompt": {"turn": "Tell me a story."}}, "field 'prompt' must be a list of user turns (strings), got an "
                                               "object"),
])
def test_prompts_refuses_an_mt_bench_row_that_is_no_list_of_turns(tmp_path, row, says):
    data = _jsonl(tmp_path / "question.jsonl", row)
    result = CliRunner().invoke(app, ["prompts", "mt-bench", "--data", str(data)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: mt-bench: --data {data}: row 0: ") and says in lines[0]


@pytest.mark.parametrize(("prompts", "says"), [
    ("GSM8K", "error: --prompts GSM8K: the benchmarks are named in lower case: give gsm8k"),
    ("gsm9k", "error: gsm9k: no such prompt file, and neither a prompt suite nor a published benchmark (did you mean "
              "gsm8k?); give a path to a JSONL file, a suite (math, code, chat, multiturn) or published benchmarks "
              "(gsm8k, math500,"),
])
def test_a_benchmark_misnamed_is_named_as_one(prompts, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no file of that name
    result = CliRunner().invoke(app, ["prompts", prompts, "--data", "x"] if prompts == "GSM8K" else ["prompts", prompts])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith(says), result.output


def test_a_run_on_a_null_humaneval_prompt_stops_before_anything_is_stored(tiny, tmp_path):
    data = _jsonl(tmp_path / "HumanEval.jsonl", {**rows("humaneval", 1)[0], "prompt": None})
    store = tmp_path / "store"
    result = CliRunner().invoke(app, ["run", "--target", str(tiny.target_dir), "--drafter",
                                      str(tiny.drafter_steps[-1]), "--prompts", "humaneval", "--data", str(data),
                                      "--store", str(store)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and lines[-1] == (
        f"error: humaneval: --data {data}: row 0: field 'prompt' must be a non-empty string, got null (no value); "
        "give openai/openai_humaneval's test split in its own layout and field names"), result.output
    assert not any("Flow run" in line or "temporary server" in line for line in lines)  # before Prefect started
    assert not store.exists()

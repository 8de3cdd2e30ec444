"""Evaluations on published benchmarks through the command line: tau per benchmark in z-lab's layout (the table,
--out JSON), the protocol recorded and keyed, MT-Bench's second turn templated after the target's own first answer,
`dflash-eval prompts` showing exactly what the run fed, and bad benchmark data refused before anything is written."""

import json
import shutil

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from dflash_core.prompts import turn_prompt_ids
from dflash_core.target import read_target_config
from dflash_eval.cli import app
from dflash_eval.storage import Store, read_json
from dflash_eval.storage.schema import Stage
from dflash_eval.tasks.references import PromptChoice, load_prompts
from tests.published_rows import write_layout

pytestmark = [pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("benchmarks")
    return ",".join(f"{name}={write_layout(name, root)}" for name in ("gsm8k", "mt-bench"))


def options(tiny, data: str, protocol: str) -> list[str]:
    return ["--target", str(tiny.target_dir), "--prompts", "gsm8k,mt-bench", "--data", data, "--protocol", protocol,
            "--max-samples", "3", "--max-new-tokens", "12"]


@pytest.fixture(scope="module")
def evaluated(tiny, data, prefect_api_url, tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    result = CliRunner().invoke(app, ["run", "--drafter", str(tiny.drafter_steps[-1]), *options(tiny, data, "dflash-0.1"),
                                      "--store", str(root / "store"), "--out", str(root / "results.json")],
                                env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    return result.output, json.loads((root / "results.json").read_text()), root / "store"


@pytest.mark.slow
def test_a_run_reports_tau_per_benchmark_in_zlabs_layout(evaluated):
    output, results, _ = evaluated
    block = results["benchmarks"]
    assert results["protocol"] == block["protocol"] == "dflash-0.1" and results["max_new_tokens"] == 12
    assert [(r["name"], r["group"], r["prompts"], r["responses"]) for r in block["rows"]] == [
        ("gsm8k", "Math", 3, 3), ("mt-bench", "Chat", 3, 6)]  # each MT-Bench turn is a response
    for row in block["rows"]:
        low, high = row["ci95"]
        assert low <= row["tau"] <= high and not row["protocol_subset"] and row["published"] is None
    assert list(block["groups"]) == ["Math", "Chat"]
    # tau over all the benchmarks' responses is their responses' mean, as per benchmark
    mean = sum(r["tau"] * r["responses"] for r in block["rows"]) / 9
    assert results["tau_macro"] == pytest.approx(mean)
    assert "tau by benchmark" in output and "GSM8K" in output and "MT-Bench" in output
    assert "protocol dflash-0.1" in output and "GSM8K: not the dflash-0.1 subset: 3 of the 150 rows in --data" in output


@pytest.mark.slow
def test_the_second_turn_follows_the_targets_own_first_answer_as_the_protocol_templates_it(evaluated, tiny, data):
    _, results, store = evaluated
    entry = Store(store).entry(Stage.REFERENCES, results["keys"]["references"])
    tokenizer = AutoTokenizer.from_pretrained(tiny.target_dir)
    prompt_set = load_prompts(PromptChoice("gsm8k,mt-bench", protocol="dflash-0.1", data=data, max_samples=3),
                              str(tiny.target_dir))
    stored = {read_json(f)["id"]: read_json(f) for f in entry.glob("seq_*.json")}
    assert set(stored) == {p.id for p in prompt_set.prompts}
    for prompt in prompt_set.prompts:
        turns = stored[prompt.id]["turns"]
        assert turns[0]["token_ids"][:turns[0]["prompt_len"]] == list(prompt.input_ids)
        if prompt.turns:  # MT-Bench: turn 2 holds the target's decoded first answer, templated by dflash-0.1
            first = turns[0]["token_ids"][turns[0]["prompt_len"]:turns[0]["completion_end"]]
            answer = tokenizer.decode(first, skip_special_tokens=True)
            assert turns[1]["token_ids"][:turns[1]["prompt_len"]] == turn_prompt_ids(tokenizer, prompt, [answer])
    # dflash-0.1 stops at generation_config's eos ids
    assert prompt_set.stop_token_ids == list(read_target_config(tiny.target_dir).eos_token_ids)


@pytest.mark.slow
def test_prompts_shows_what_the_run_fed(evaluated, tiny, data):
    _, results, store = evaluated
    shown = CliRunner().invoke(app, ["prompts", "gsm8k,mt-bench", "--target", str(tiny.target_dir), "--data", data,
                                     "--protocol", "dflash-0.1", "--max-samples", "3", "--json"])
    assert shown.exit_code == 0, shown.output
    listed = json.loads(shown.output)
    entry = Store(store).entry(Stage.REFERENCES, results["keys"]["references"])
    fed = {read_json(f)["id"]: read_json(f)["turns"][0] for f in entry.glob("seq_*.json")}
    assert {p["id"] for p in listed["prompts"]} == set(fed)
    for p in listed["prompts"]:
        assert p["input_ids"] == fed[p["id"]]["token_ids"][:fed[p["id"]]["prompt_len"]]
        assert p["messages"][0]["role"] == "user" and p["text"].startswith("<|im_start|>user\n")
    assert listed["protocol"] == "dflash-0.1" and [b["name"] for b in listed["benchmarks"]] == ["gsm8k", "mt-bench"]


@pytest.mark.slow
def test_another_protocol_is_another_series_of_references(evaluated, tiny, data, tmp_path):
    _, results, store = evaluated
    again = CliRunner().invoke(app, ["stage", "references", "--drafter", str(tiny.drafter_steps[-1]),
                                     *options(tiny, data, "zlab-2026-04"), "--store", str(store)])
    assert again.exit_code == 0, again.output
    stage_folder = Store(store).entry(Stage.REFERENCES, results["keys"]["references"]).parent.parent
    assert len([p for p in stage_folder.glob("*/*") if p.is_dir()]) == 2  # zlab-2026-04's beside dflash-0.1's


@pytest.mark.parametrize(("extra", "says"), [
    (["--data", "gsm8k=/nonexistent,mt-bench=/nonexistent"], "error: gsm8k: --data /nonexistent does not exist"),
    (["--prompts", "mbpp", "--protocol", "zlab-2026-01"], "error: mbpp: cannot load google-research-datasets/mbpp"),
])
def test_bad_benchmark_data_is_one_line_and_nothing_is_written(tiny, tmp_path, extra, says):
    store = tmp_path / "store"
    args = ["run", "--drafter", str(tiny.drafter_steps[-1]), "--target", str(tiny.target_dir), "--prompts",
            "gsm8k,mt-bench", "--store", str(store), *extra]
    result = CliRunner().invoke(app, args, env={"HF_ENDPOINT": "https://hub.invalid", "HF_DATASETS_OFFLINE": None,
                                                "HF_HUB_OFFLINE": None})
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(says), result.output
    assert not store.exists()


@pytest.mark.slow
def test_a_published_pair_gets_the_published_tau_beside_with_the_gap_named(tiny, data, prefect_api_url, tmp_path):
    """The tiny target named as Qwen3-8B and its drafter as z-lab's Qwen3-8B-DFlash-b16: z-lab's GSM8K and MT-Bench
    taus at temperature 0 stand beside ours, the gap beyond our interval is named, and what differs from the
    published setting is listed."""
    drafter = tmp_path / "z-lab" / "Qwen3-8B-DFlash-b16"
    shutil.copytree(tiny.drafter_steps[-1], drafter)
    result = CliRunner().invoke(app, ["run", "--drafter", str(drafter), *options(tiny, data, "zlab-2026-01"),
                                      "--name", "Qwen/Qwen3-8B", "--store", str(tmp_path / "store"),
                                      "--out", str(tmp_path / "results.json")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results.json").read_text())
    block = results["benchmarks"]
    assert results["drafter"]["step"] is None  # "b16" in a model's name is no training step
    gsm8k, mt_bench = block["rows"]
    assert (gsm8k["published"]["tau"], mt_bench["published"]["tau"]) == (6.55, 4.25)
    assert gsm8k["published"]["gap"] == pytest.approx(gsm8k["tau"] - 6.55) and gsm8k["published"]["beyond_ci"]
    assert "block size 8, published 16" in gsm8k["published"]["differs"]
    assert "max new tokens 12, published 2048" in gsm8k["published"]["differs"]
    assert "rows: not the zlab-2026-01 subset" in gsm8k["published"]["differs"]  # 3 stand-in rows
    assert block["groups"]["Math"]["published"] == 6.55
    assert f"GSM8K: tau {gsm8k['tau']:.2f} is {6.55 - gsm8k['tau']:.2f} below the published 6.55, beyond our 95% CI" \
        in result.output
    assert "published: z-lab/dflash README at bb48ef9" in result.output

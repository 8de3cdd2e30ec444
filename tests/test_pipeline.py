"""The Prefect pipeline end to end on the tiny trained run: caching that agrees with the store,
resumption after SIGKILL, concurrent runs on one store, and the command line.

Flows run in-process against the session's Prefect test server; command-line runs are real
`dflash-eval` processes reporting to the same server.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_core.decoding import speculative_decode
from dflash_core.drafter import load_drafter
from dflash_core.target import load_target, read_target_config
from tests.tiny_models import SHORT_PROMPTS

pytestmark = pytest.mark.slow

N_PROMPTS = SHORT_PROMPTS  # the prompts in `tiny.prompts` (conftest's `tiny`: the tiny run, first prompts)
MAX_NEW = 64
STAGES = ("fetch", "references", "features", "drafts", "scores")


def arguments(tiny, store, step=-1):
    return dict(target=str(tiny.target_dir), drafter=str(tiny.drafter_steps[step]), prompts=str(tiny.prompts),
                max_new_tokens=MAX_NEW, store=str(store))


def evaluate(tiny, store, step=-1, **kwargs):
    from tests.evaluations import run_evaluation

    settings = {**arguments(tiny, store, step), **kwargs}
    if kwargs.get("references"):  # (the completions file holds the prompts)
        del settings["prompts"]
    state = run_evaluation(**settings, return_state=True)
    return state.result(), state.state_details.flow_run_id


def cli(tiny, store, *extra, step=-1, api_url, runner=("-m", "dflash_eval.cli"), **popen):
    args = arguments(tiny, store, step)
    command = [sys.executable, *runner, *extra, "--target", args["target"], "--drafter", args["drafter"],
               "--prompts", args["prompts"], "--max-new-tokens", str(MAX_NEW), "--store", args["store"]]
    env = {**os.environ, "PREFECT_API_URL": api_url}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def run_to_results(tiny, store, out: Path, *, api_url, **kwargs) -> dict:
    """`dflash-eval run ... --out out` in its own process, to the end: its results (the test fails with the
    command's output if it fails)."""
    process = cli(tiny, store, "run", "--out", str(out), api_url=api_url, **kwargs)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    return json.loads(out.read_text())


def files_of(directory: Path) -> dict[str, tuple[str, int]]:
    """relative path -> (sha256, mtime_ns) of every file under directory (lock files aside)."""
    return {
        str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*")) if p.is_file() and not p.name.endswith(".lock")
    }


def task_states(flow_run_id) -> dict[str, str]:
    """task name -> state name of a flow run, read back through Prefect's API."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name.rsplit("-", 1)[0]: run.state.name for run in runs}  # run names are "<task>-<3 hex>"


def entry_dir(store: Path, stage: str) -> Path:
    """The one entry folder of `stage` in the store (beside it lie lock files)."""
    (entry,) = [p for p in store.glob(f"{stage}/*/*") if p.is_dir()]
    return entry


def zarr_array_markers(store: Path) -> dict[str, int]:
    """features.zarr/layer_i/seq_n -> mtime_ns of its zarr.json (rewritten whenever the array is)."""
    zarr_root = entry_dir(store, "features") / "features.zarr"
    return {str(p.parent.relative_to(zarr_root)): p.stat().st_mtime_ns for p in zarr_root.glob("layer_*/seq_*/zarr.json")}


def test_new_checkpoint_runs_only_fetch_drafts_and_scores(tiny, tmp_path, prefect_api_url):
    store = tmp_path / "store"
    first, _ = evaluate(tiny, store, step=0)
    assert first["stages"] == dict.fromkeys(STAGES, "ran")
    references, features = files_of(store / "references"), files_of(store / "features")

    second, flow_run_id = evaluate(tiny, store, step=-1)
    assert second["stages"] == {"fetch": "ran", "references": "cached", "features": "cached", "drafts": "ran", "scores": "ran"}
    # Prefect shows the store's hits as Cached
    states = task_states(flow_run_id)
    assert states == {"fetch": "Completed", "references": "Cached", "features": "Cached", "drafts": "Completed",
                      "scores": "Completed"}
    # the same references and features, not even rewritten
    assert files_of(store / "references") == references and files_of(store / "features") == features
    assert second["keys"]["references"] == first["keys"]["references"]
    assert second["keys"]["features"] == first["keys"]["features"]

    # results: what the issue asks for, and tau rising with training
    for field in ("tau_macro", "tau_pooled", "block_size", "histogram", "clipped_last_steps", "clipping_note"):
        assert field in second
    assert second["drafter"]["key"] == second["keys"]["fetch"] != first["drafter"]["key"]
    assert second["drafter"]["step"] == tiny.record["steps"][-1]
    assert second["tau_macro"] > first["tau_macro"] + 0.3
    assert sum(int(k) * n for k, n in second["histogram"].items()) == second["n_tokens"]

    # the acceptance lengths are those of real speculative decoding with the target in the loop
    target = load_target(tiny.target_dir, dtype=torch.float32)
    drafter = load_drafter(tiny.drafter_steps[-1])
    eos = json.loads((tiny.target_dir / "config.json").read_text())["eos_token_id"]
    assert read_target_config(tiny.target_dir).eos_token_ids == (eos,)  # the references' stop token
    prompts = [json.loads(line) for line in tiny.prompts.read_text().splitlines()]
    for prompt, scored in zip(prompts[:5], second["per_prompt"]):
        online = speculative_decode(target, drafter, prompt["input_ids"], MAX_NEW, [eos])
        assert scored["id"] == prompt["id"]
        assert scored["acceptance_lengths"] == online.acceptance_lengths

    # the same checkpoint again, with the dtype that --dtype auto resolved to (the tiny target is float32):
    # nothing runs, the same results
    assert (second["dtype"], second["dtype_requested"], second["dtype_note"]) == ("float32", "auto", None)
    third, _ = evaluate(tiny, store, step=-1, dtype="float32")
    assert third["stages"] == dict.fromkeys(STAGES, "cached")
    assert (third["dtype"], third["dtype_requested"]) == ("float32", "float32")
    ignored = ("stages", "dtype_requested")
    assert {k: v for k, v in third.items() if k not in ignored} == {k: v for k, v in second.items() if k not in ignored}


def test_progress_of_long_stages_is_published_to_prefect(tiny, tmp_path, prefect_api_url):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    _, flow_run_id = evaluate(tiny, tmp_path / "store")
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    # on the run's page, without a key (the Artifacts page keeps each series' results, not every run's progress)
    progress = {a.description.split(":")[0]: (a.key, a.data) for a in artifacts if a.type == "progress"}
    assert progress == {stage: (None, 100.0) for stage in ("references", "features", "drafts")}


def test_other_layer_ids_extract_only_the_layers_not_held(tiny, tmp_path, prefect_api_url):
    store = tmp_path / "store"
    first, _ = evaluate(tiny, store)
    held = zarr_array_markers(store)
    assert {name.split("/")[0] for name in held} == {"layer_1", "layer_2"}
    mask = json.loads((tiny.drafter_steps[-1] / "config.json").read_text())["dflash_config"]["mask_token_id"]
    other = _drafter_with(tmp_path, tiny, dflash_config={"target_layer_ids": [0, 2], "mask_token_id": mask})

    from tests.evaluations import run_evaluation

    results = run_evaluation(**{**arguments(tiny, store), "drafter": str(other)})
    assert results["layer_ids"] == [0, 2] and results["stages"]["features"] == "ran"
    assert results["keys"]["features"] == first["keys"]["features"]  # one entry holds every layer
    after = zarr_array_markers(store)
    assert {name for name in after if name not in held} == {f"layer_0/seq_{n}" for n in range(N_PROMPTS)}
    assert all(after[name] == mtime for name, mtime in held.items())  # layers 1 and 2 untouched
    record = json.loads((entry_dir(store, "features") / "entry.json").read_text())["record"]
    assert record["layer_ids"] == [0, 1, 2]


def test_deleted_features_rerun_only_what_is_missing(tiny, tmp_path, prefect_api_url):
    store = tmp_path / "store"
    before, _ = evaluate(tiny, store)
    features_entry = entry_dir(store, "features")
    arrays = zarr_array_markers(store)
    bytes_before = files_of(features_entry / "features.zarr")

    # one sequence of one layer: only that array is written again, and drafts stay valid (same key)
    shutil.rmtree(features_entry / "features.zarr" / "layer_2" / "seq_3")
    again, _ = evaluate(tiny, store)
    assert again["stages"] == {"fetch": "cached", "references": "cached", "features": "ran", "drafts": "cached",
                               "scores": "cached"}
    after = zarr_array_markers(store)
    assert {name for name in arrays if after[name] != arrays[name]} == {"layer_2/seq_3"}
    assert {k: v[0] for k, v in files_of(features_entry / "features.zarr").items()} == \
        {k: v[0] for k, v in bytes_before.items()}

    # the whole entry: extracted again, bit for bit the same
    shutil.rmtree(features_entry)
    again, _ = evaluate(tiny, store)
    assert again["stages"]["features"] == "ran" and again["stages"]["drafts"] == "cached"
    assert {k: v[0] for k, v in files_of(features_entry / "features.zarr").items()} == \
        {k: v[0] for k, v in bytes_before.items()}

    # a deleted drafts entry reruns drafts (and nothing upstream)
    shutil.rmtree(entry_dir(store, "drafts"))
    again, _ = evaluate(tiny, store)
    assert [s for s, status in again["stages"].items() if status == "ran"] == ["drafts"]
    assert again["per_prompt"] == before["per_prompt"]


def test_killed_extraction_resumes_without_redoing_finished_sequences(tiny, tmp_path, prefect_api_url):
    store = tmp_path / "store"
    killed = cli(tiny, store, "run", runner=("-m", "tests.killed_run", "5"), api_url=prefect_api_url)
    output, _ = killed.communicate(timeout=300)
    assert killed.returncode == -9, output
    features_entry = entry_dir(store, "features")
    assert not (features_entry / "entry.json").exists()  # nothing reads as complete
    finished = zarr_array_markers(store)
    complete = {name for name in finished
                if json.loads((features_entry / "features.zarr" / name / "zarr.json").read_text())["attributes"]["complete"]}
    assert len(complete) == 5

    results = run_to_results(tiny, store, tmp_path / "resumed.json", api_url=prefect_api_url)
    assert results["stages"]["references"] == "cached" and results["stages"]["features"] == "ran"
    after = zarr_array_markers(store)
    assert all(after[name] == finished[name] for name in complete)  # not recomputed
    assert len(after) == 2 * N_PROMPTS

    # identical to an uninterrupted run
    clean, _ = evaluate(tiny, tmp_path / "clean")
    clean_entry = entry_dir(tmp_path / "clean", "features")
    assert {k: v[0] for k, v in files_of(features_entry / "features.zarr").items()} == \
        {k: v[0] for k, v in files_of(clean_entry / "features.zarr").items()}
    assert results["per_prompt"] == clean["per_prompt"]


def test_two_concurrent_runs_share_one_store(tiny, tmp_path, prefect_api_url):
    store = tmp_path / "store"
    runs = [cli(tiny, store, "run", "--out", str(tmp_path / f"run{i}.json"), api_url=prefect_api_url) for i in (0, 1)]
    outputs = [run.communicate(timeout=400)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    a, b = (json.loads((tmp_path / f"run{i}.json").read_text()) for i in (0, 1))
    assert a["per_prompt"] == b["per_prompt"] and a["keys"] == b["keys"]
    for stage in STAGES:  # each shared stage computed by exactly one of them
        assert sorted([a["stages"][stage], b["stages"][stage]]) == ["cached", "ran"], stage
    for stage in STAGES:
        assert len(list(store.glob(f"{stage}/*/*/entry.json"))) == 1


def test_command_line_run_and_stage(tiny, tmp_path, prefect_api_url):
    store = tmp_path / "store"
    process = cli(tiny, store, "run", "--out", str(tmp_path / "results.json"), runner=("-m", "dflash_eval.cli"),
                  api_url=prefect_api_url)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    results = json.loads((tmp_path / "results.json").read_text())
    assert f"tau macro {results['tau_macro']:.3f}" in output
    assert "unary head" not in output and "selector" not in output  # a DFlash drafter: no selector to show
    assert results["block_size"] == 8 and len(results["per_prompt"]) == N_PROMPTS
    assert all(p["id"] and p["acceptance_lengths"] for p in results["per_prompt"])

    process = cli(tiny, store, "stage", "features", "--refresh", "--out", str(tmp_path / "stage.json"),
                  api_url=prefect_api_url)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    stage = json.loads((tmp_path / "stage.json").read_text())
    assert stage["stages"] == {"references": "cached", "features": "ran"}
    assert stage["keys"]["features"] == results["keys"]["features"]


def test_demo_prints_tau_per_saved_step(tiny_qwen3_run, tmp_path, prefect_api_url):
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    result = CliRunner().invoke(app, ["demo", "--store", str(tmp_path / "store"), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    taus = [json.loads((tmp_path / "out" / f"{p.name}.json").read_text())["tau_macro"] for p in tiny_qwen3_run.drafter_steps]
    assert taus == sorted(taus) and taus[-1] >= 2.5
    for path, tau in zip(tiny_qwen3_run.drafter_steps, taus):
        assert f"{path.name:<10}  {tau:9.3f}" in result.output


def _drafter_with(tmp_path, tiny, **config_changes):
    """A copy of the final drafter checkpoint with config.json fields replaced."""
    directory = tmp_path / "drafter"
    shutil.copytree(tiny.drafter_steps[-1], directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(config_changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _config_only(tmp_path, tiny):
    directory = tmp_path / "config_only"
    directory.mkdir()
    shutil.copy(tiny.drafter_steps[-1] / "config.json", directory)
    return directory


def _headless_target(tmp_path, tiny):
    """The tiny target (untied) without its lm_head, as a base-model save_pretrained leaves it."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "headless"
    shutil.copytree(tiny.target_dir, directory)
    tensors = load_file(directory / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def _truncated_weights(tmp_path, tiny) -> Path:
    directory = tmp_path / "truncated"
    shutil.copytree(tiny.drafter_steps[-1], directory)
    with open(directory / "model.safetensors", "r+b") as f:
        f.truncate(5000)  # past the header (2.4 KB), short of the weights
    return directory


def _target_with(tmp_path, tiny, **config_changes):
    """A copy of the tiny target with config.json fields replaced."""
    directory = tmp_path / "target"
    shutil.copytree(tiny.target_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **config_changes}))
    return directory


def _truncated_target(tmp_path, tiny):
    directory = tmp_path / "truncated_target"
    shutil.copytree(tiny.target_dir, directory)
    with open(directory / "model.safetensors", "r+b") as f:
        f.truncate(300_000)  # past the header, short of the weights (as an interrupted copy leaves it)
    return directory


def _a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("not a folder\n")
    return path


def _json_file(tmp_path, content):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(content))
    return path


def _completions(tmp_path, *lines):
    path = tmp_path / "completions.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _bad_prompts(tmp_path, tiny, bad_line):
    lines = tiny.prompts.read_text().splitlines()
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([lines[0], bad_line, *lines[1:]]) + "\n")
    return path


BAD_INPUTS = {
    # name: (function(tmp_path, tiny) -> {option: value}, what the message must say)
    "missing target": (lambda t, tiny: {"--target": str(t / "nowhere")}, "nowhere is not a directory"),
    "target without config": (lambda t, tiny: {"--target": str(t)}, "no config.json"),
    "missing drafter": (lambda t, tiny: {"--drafter": str(t / "no_run" / "step_1")}, "step_1 is not a folder, and neither is"),
    "drafter not saved (yet)": (lambda t, tiny: {"--drafter": str(t / "step_1"), "--checkpoint-wait": "1"},
                                "step_1 (yet); gave up after waiting 1 s"),
    "drafter without weights": (lambda t, tiny: {"--drafter": str(_config_only(t, tiny))}, "holds no drafter weights"),
    "drafter with broken weights": (lambda t, tiny: {"--drafter": str(_truncated_weights(t, tiny))},
                                    "model.safetensors has 5000 bytes where its header describes"),
    "drafter for another hidden size": (
        lambda t, tiny: {"--drafter": str(_drafter_with(t, tiny, hidden_size=128))},
        "hidden_size 128 != target hidden_size"),
    "drafter for another vocabulary": (lambda t, tiny: {"--drafter": str(_drafter_with(t, tiny, vocab_size=1000))},
                                       "drafter vocab_size 1000 != target vocab_size 512"),
    "drafter layer ids past the target": (
        lambda t, tiny: {"--drafter": str(_drafter_with(t, tiny, dflash_config={"target_layer_ids": [1, 9],
                                                                                "mask_token_id": 3}))},
        "include [9], but the target's text model has only 4 layers"),
    "missing prompts": (lambda t, tiny: {"--prompts": str(t / "none.jsonl")}, "none.jsonl: no such prompt file"),
    "prompts line not JSON": (lambda t, tiny: {"--prompts": str(_bad_prompts(t, tiny, '{"id": "x", "text": '))},
                              "bad.jsonl:2"),
    "prompt id out of vocabulary": (
        lambda t, tiny: {"--prompts": str(_bad_prompts(t, tiny, '{"id": "x", "input_ids": [5, 100000]}'))},
        "bad.jsonl:2"),
    "too many new tokens": (lambda t, tiny: {"--max-new-tokens": "100000"}, "exceeds the target's"),
    "unknown dtype": (lambda t, tiny: {"--dtype": "float16"}, "--dtype must be one of auto, float32, bfloat16"),
    "target saved without its head": (lambda t, tiny: {"--target": str(_headless_target(t, tiny))},
                                      "under model.* and no lm_head.weight"),
    "negative temperature": (lambda t, tiny: {"--temperature": "-0.5"}, "--temperature must lie in [0, 2], got -0.5"),
    "top-p of 0": (lambda t, tiny: {"--temperature": "0.6", "--top-p": "0"}, "--top-p must lie in (0, 1], got 0.0"),
    "top-p above 1": (lambda t, tiny: {"--temperature": "0.6", "--top-p": "1.5"}, "--top-p must lie in (0, 1]"),
    "negative top-k": (lambda t, tiny: {"--temperature": "0.6", "--top-k": "-1"}, "--top-k must be at least 0, got -1"),
    "no samples": (lambda t, tiny: {"--temperature": "0.6", "--samples": "0"}, "--samples must lie in [1, 1000], got 0"),
    "samples of greedy": (lambda t, tiny: {"--samples": "4"}, "greedy completions (temperature 0) are all the same"),
    "lookahead when sampled": (lambda t, tiny: {"--temperature": "0.6", "--lookahead": None},
                               "--lookahead applies to greedy references"),
    "block size above the drafter's": (lambda t, tiny: {"--block-size": "16"},
                                       "block size 16: use 2 .. 8, the drafter's block size"),
    "a swept block size above the drafter's": (lambda t, tiny: {"--block-sizes": "4,16"}, "block size 16: use 2 .. 8"),
    "block sizes that are not numbers": (lambda t, tiny: {"--block-sizes": "4,eight"}, "give whole numbers separated"),
    "step cost without a swept size": (
        lambda t, tiny: {"--block-sizes": "2,4", "--step-cost": str(_json_file(t, {"2": 1.05}))},
        "no cost for block size 4"),
    "references outside the vocabulary": (
        lambda t, tiny: {"--references": str(_completions(t, {"id": "a", "input_ids": [5], "completion_ids": [6, 9999]}))},
        "completions.jsonl:1: field 'completion_ids': id 9999 is not below the target's vocabulary size 512"),
    "references with an empty completion": (
        lambda t, tiny: {"--references": str(_completions(t, {"id": "a", "input_ids": [5], "completion_ids": []}))},
        "completions.jsonl:1: field 'completion_ids': is empty"),
    "references with a server": (
        lambda t, tiny: {"--references": str(_completions(t, {"id": "a", "input_ids": [5], "completion_ids": [6]})),
                         "--reference": "sglang+http://127.0.0.1:9"}, "--references FILE gives the completions"),
    "malformed reference": (lambda t, tiny: {"--reference": "vllm://host:8000"},
                            "use local, sglang+http://HOST:PORT or openai+http://HOST:PORT/v1"),
    "target config with a string for a number": (
        lambda t, tiny: {"--target": str(_target_with(t, tiny, hidden_size="192"))},
        "config.json: Field 'hidden_size' expected int, got str"),
    "target weights cut short": (lambda t, tiny: {"--target": str(_truncated_target(t, tiny))},
                                 "model.safetensors has 300000 bytes where its header describes"),
    "store is a file": (lambda t, tiny: {"--store": str(_a_file(t))}, "/work/file is a file, not a folder"),
    "store under a file": (lambda t, tiny: {"--store": str(_a_file(t) / "store")},
                           "/work/file/store cannot be created: "),
    # root may write anywhere os.access can tell, but nothing can be created in /proc: found by trying
    "store that cannot be created": (lambda t, tiny: {"--store": "/proc/dflash-store"},
                                     "--store: /proc/dflash-store cannot be created"),
    "out under a file": (lambda t, tiny: {"--out": str(_a_file(t) / "results.json")}, "file is a file, not a folder"),
    "out is a folder": (lambda t, tiny: {"--out": str(t)}, "is a folder; give a file name"),
    "prompts given as a directory": (lambda t, tiny: {"--prompts": str(t)}, "is a directory, not a prompt file"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_refused_with_a_clear_message_and_the_store_untouched(case, tiny, tmp_path):
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    make_options, message = BAD_INPUTS[case]
    (tmp_path / "work").mkdir()
    options = {"--target": str(tiny.target_dir), "--drafter": str(tiny.drafter_steps[-1]),
               "--prompts": str(tiny.prompts), "--store": str(tmp_path / "store"),
               **make_options(tmp_path / "work", tiny)}
    if "--references" in options:  # a completions file holds its prompts: --prompts beside it is refused
        del options["--prompts"]
    result = CliRunner().invoke(app, ["run", *[x for pair in options.items() for x in pair if x is not None]])
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]  # after what it logged (e.g. waiting for a checkpoint)
    assert last.startswith("error: ") and message in last, result.output
    assert not (tmp_path / "store").exists()


def test_history_shows_tau_by_step_the_best_and_a_regression(tiny, tmp_path, prefect_api_url):
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    store = tmp_path / "store"
    evaluate(tiny, store, step=0)
    evaluate(tiny, store, step=-1)
    # a later save that is as bad as the first one: step_500 holds step_100's weights
    relapse = tmp_path / "run" / "step_500"
    shutil.copytree(tiny.drafter_steps[0], relapse)
    config = json.loads((relapse / "config.json").read_text())
    (relapse / "config.json").write_text(json.dumps({**config, "note": "relapse"}))  # another checkpoint's content
    from tests.evaluations import run_evaluation

    run_evaluation(**{**arguments(tiny, store), "drafter": str(relapse)})

    result = CliRunner().invoke(app, ["history", "--store", str(store)])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if "step_" in line]
    assert [row.split("│")[1].strip() for row in rows] == ["100", "400", "500"]
    assert "best" in rows[1] and "REGRESSION" in rows[2] and "REGRESSION" not in rows[0] + rows[1]
    # DFlash drafters: no unary head column, nor its keys for scripts
    assert "unary head" not in result.output
    listed = json.loads(CliRunner().invoke(app, ["history", "--store", str(store), "--json"]).stdout)
    assert not [row for row in listed["series"][0]["rows"] if "unary_tau_macro" in row or "selector_lift" in row]


def test_a_dflash2_drafter_shows_its_selector_on_the_command_line_and_in_history(dflash2_evaluated,
                                                                                   tiny_dflash2_run):
    """`run` prints the unary head alone's tau, the selector's lift and shares, and a row per draft position;
    `history` (and its --json) the unary head's tau and the lift by step: scores.json's values."""
    from typer.testing import CliRunner

    from dflash_core.generations.dflash2 import SelectorSection
    from dflash_core.sections import Context
    from dflash_eval.cli import app
    from dflash_eval.reporting.history import history
    from dflash_eval.storage import Store
    from tests.evaluations import stored_scores

    evaluated = dflash2_evaluated
    results = evaluated.results[-1]
    selector = stored_scores(evaluated.store, results)["selector"]
    run = CliRunner().invoke(app, ["run", "--target", str(tiny_dflash2_run.target_dir), "--drafter",
                                   results["drafter"]["source"], "--prompts", results["prompts"], "--max-new-tokens",
                                   str(MAX_NEW), "--store", str(evaluated.store)], env={"COLUMNS": "200"})
    assert run.exit_code == 0, run.output
    low, high = selector["unary_tau_macro_ci95"]
    lift_low, lift_high = selector["lift_ci95"]
    overall = selector["overall"]
    assert (f"unary head alone (its argmax): tau macro {selector['unary_tau_macro']:.3f} (95% CI {low:.2f}-"
            f"{high:.2f}), pooled {selector['unary_tau_pooled']:.3f}; selector lift {selector['lift']:+.3f} (paired "
            f"95% CI {lift_low:+.2f} to {lift_high:+.2f})") in run.output
    assert (f"of {sum(selector['position_counts']['reached'])} draft positions compared: selector's draft accepted "
            f"{overall['selector_accuracy']:.1%}, head's argmax would have been {overall['argmax_accuracy']:.1%}, "
            f"reference among the K candidates {overall['candidate_recall']:.1%}") in run.output
    lines = [line.split() for line in run.output.splitlines()]
    for k, reached in enumerate(selector["position_counts"]["reached"], start=1):
        assert [str(k), str(reached), f"{selector['selector_accuracy'][k - 1]:.1%}",
                f"{selector['argmax_accuracy'][k - 1]:.1%}", f"{selector['candidate_recall'][k - 1]:.1%}"] in lines
    # with sampled drafts the head alone drafts from its q, and the counts are expectations
    unary, shares = SelectorSection(selector).lines(Context(sampled=True))
    assert unary.startswith("unary head alone (drafts sampled from its q): ") and " expected draft positions" in shares

    selectors = [stored_scores(evaluated.store, r)["selector"] for r in evaluated.results]
    (group,) = history(Store(evaluated.store))
    assert [(row.values["unary_tau_macro"], row.values["selector_lift"]) for row in group.rows] == \
        [(s["unary_tau_macro"], s["lift"]) for s in selectors]
    shown = CliRunner().invoke(app, ["history", "--store", str(evaluated.store)])
    assert shown.exit_code == 0, shown.output
    header = next(line for line in shown.output.splitlines() if "tau pooled" in line)
    assert [cell.strip() for cell in header.split("┃")][5:8] == ["tau pooled", "unary head", "lift"]
    rows = [[cell.strip() for cell in line.split("│")] for line in shown.output.splitlines() if "step_" in line]
    assert [row[6:8] for row in rows] == [[f"{s['unary_tau_macro']:.3f}", f"{s['lift']:+.3f}"] for s in selectors]
    listed = json.loads(CliRunner().invoke(app, ["history", "--store", str(evaluated.store), "--json"]).stdout)
    assert [(row["unary_tau_macro"], row["selector_lift"]) for row in listed["series"][0]["rows"]] == \
        [(s["unary_tau_macro"], s["lift"]) for s in selectors]

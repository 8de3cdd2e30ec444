"""Inputs that were accepted silently, crashed late or misled, now refused up front: each is one line naming the
option, file or line and what to give instead, exit code 2, nothing stored, before Prefect starts. The settings'
bounds and rules, a baseline (a finished checkpoint: never waited for), an MLflow URI MLflow cannot use,
completions without a decode step; and a refusal inside the flow (weights that are not finite) said once."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_bad_input import RUN, one_line

COMPLETIONS = "--references FILE holds the prompts with their completions: leave out --prompts, which would never be read"


@pytest.mark.parametrize(("args", "says"), [
    ([*RUN, "--max-new-tokens", "1"], "error: --max-new-tokens must be at least 2, got 1"),
    ([*RUN, "--max-new-tokens", "0"], "error: --max-new-tokens must be at least 2, got 0"),
    ([*RUN, "--temperature", "0.6", "--samples", "1000000000"], "error: --samples must lie in [1, 1000], got 1000000000"),
    ([*RUN, "--references", "r.jsonl"], f"error: {COMPLETIONS}"),
    ([*RUN[:-1], "gsm8k", "--references", "r.jsonl"], f"error: {COMPLETIONS}"),
    ([*RUN[:-1], "gsm8k", "--data", "gsm8k=/a,gsm8k=/b"],
     "error: --data: gsm8k is given twice (/a and /b); give one local copy per benchmark"),
    ([*RUN[:-1], "gsm8k", "--data", "gsm8k="], "error: --data gsm8k=: no path after 'gsm8k='"),
    ([*RUN[:-1], "GSM8K", "--data", "/a"], "error: --prompts GSM8K: the benchmarks are named in lower case: give gsm8k"),
])
def test_a_setting_out_of_its_bounds_or_rules_is_one_line(tmp_path, args, says):
    assert one_line([*args, "--store", str(tmp_path / "store")]).startswith(says)
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize(("parameters", "says"), [
    ({"inputs": {"target": "t", "prompts": "p", "max_new_tokens": 1}}, "inputs.max_new_tokens must be at least 2"),
    ({"inputs": {"target": "t", "prompts": "p"}, "serving": {"temperature": 0.6, "samples": 10 ** 9}},
     "serving.samples must lie in [1, 1000]"),
    ({"inputs": {"target": "t", "prompts": "p", "references": "r.jsonl"}},
     "inputs.references FILE holds the prompts with their completions: leave out inputs.prompts"),
])
def test_a_deployments_parameters_are_refused_alike(parameters, says):
    from dflash_eval.flows.checks import InputError, check_evaluation

    with pytest.raises(InputError) as refused:
        check_evaluation({**parameters, "drafter": "d"})
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value)


def test_an_mlflow_uri_mlflow_cannot_use_is_refused_up_front(tmp_path):
    pytest.importorskip("mlflow")
    assert one_line([*RUN, "--mlflow", "notascheme://x", "--store", str(tmp_path / "store")]) == (
        "error: --mlflow notascheme://x: MLflow has no tracking store for this URI; give http://HOST:PORT of `mlflow "
        "server`, file:DIR, a database URI (sqlite:///FILE, postgresql://...) or databricks")
    assert not (tmp_path / "store").exists()


# ---- a baseline is a finished checkpoint: refused at once, named as the baseline

@pytest.mark.parametrize(("baseline", "says"), [
    ("{drafters}/stpe_400", "error: --baseline {drafters}/stpe_400: no such folder (did you mean step_400?); give a "
                            "finished drafter checkpoint's folder or its relay URL"),
    ("{tmp}/published", "error: --baseline {tmp}/published: no such folder; give a finished drafter checkpoint's "
                        "folder or its relay URL"),
    ("{prompts}", "error: baseline checkpoint {prompts} is not a folder: pass a checkpoint folder or a relay URL"),
], ids=["mistyped", "missing", "a file"])
def test_a_bad_baseline_is_refused_at_once_as_the_baseline(tiny, tmp_path, baseline, says):
    names = {"drafters": tiny.drafter_steps[-1].parent, "tmp": tmp_path, "prompts": tiny.prompts}
    started = time.monotonic()
    line = one_line(["run", "--target", str(tiny.target_dir), "--drafter", str(tiny.drafter_steps[-1]), "--prompts",
                     str(tiny.prompts), "--baseline", baseline.format(**names), "--store", str(tmp_path / "store")])
    assert line.startswith(says.format(**names)), line
    assert not line.startswith("error: drafter")  # named as the baseline, not as the drafter evaluated
    assert time.monotonic() - started < 60  # not --checkpoint-wait's 300 s
    assert not (tmp_path / "store").exists()


def test_completions_too_short_for_a_decode_step_are_refused_up_front(tiny, tmp_path):
    references = tmp_path / "completions.jsonl"
    references.write_text("".join(json.dumps({"id": f"p{n}", "input_ids": [5, 6, n], "completion_ids": [7]}) + "\n"
                                  for n in range(3)))
    line = one_line(["run", "--target", str(tiny.target_dir), "--drafter", str(tiny.drafter_steps[-1]),
                     "--references", str(references), "--store", str(tmp_path / "store")])
    assert line == (f"error: --references {references}: no completion holds two tokens, so none has a decode step to "
                    "score (the target's first token, then one to verify a draft against); give longer completions")
    assert not (tmp_path / "store").exists()


# ---- a refusal inside the flow: said once, by the command's last line

@pytest.mark.slow  # a process of its own, through the flow
def test_weights_refused_in_the_flow_are_said_once_without_a_stray_traceback(tiny, tmp_path, prefect_api_url):
    drafter = tmp_path / "step_400"
    drafter.mkdir()
    for file in tiny.drafter_steps[-1].iterdir():
        if file.is_file():
            (drafter / file.name).write_bytes(file.read_bytes())
    weights = load_file(drafter / "model.safetensors")
    weights["fc.weight"][0, 0] = float("nan")
    save_file({k: v.contiguous() for k, v in weights.items()}, drafter / "model.safetensors",
              metadata={"format": "pt"})
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url, "PREFECT_LOGGING_LEVEL": "INFO", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "dflash_eval.cli", "run", "--target", str(tiny.target_dir),
                           "--drafter", str(drafter), "--prompts", str(tiny.prompts), "--max-new-tokens", "8",
                           "--store", str(tmp_path / "store")], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    output = done.stdout
    refusal = "weight fc.weight has 1 of"
    assert done.returncode == 2, output
    (error,) = [line for line in output.splitlines() if line.startswith("error: ")]
    assert error.startswith(f"error: drafter {drafter}: {refusal}"), output
    assert output.count(refusal) == 1, output  # not repeated by Prefect's lines before it
    assert "NoneType: None" not in output and "Traceback" not in output, output
    assert torch.isnan(load_file(drafter / "model.safetensors")["fc.weight"]).any()

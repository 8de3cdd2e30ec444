"""Record deepspec/ and deepspec_loop.json: DeepSpec's own saves and evaluator loop (github deepseek-ai/DeepSpec,
commit afdfa7c, MIT) with a tiny trained DSpark drafter.

What it writes. Two drafters for the tiny Qwen3 target of the DFlash golden case (`dflash010/target/`, reused as it
is), each built and saved by DeepSpec's own code, weights in bfloat16 (loaded and run in float32: the cast is exact):

- `deepspec/dspark/`: the tiny DSpark drafter (the `qwen3_dspark` tiny run's step_400: block 7, every slot drafting,
  a vanilla Markov head of rank 32, a confidence head reading it; tests/trained_runs.py), rebuilt as DeepSpec's trainer
  builds it (what `Qwen3DSparkTrainer._build_draft_model` calls: `build_draft_config(target_config, model_args)` and
  its `Qwen3DSparkModel`; the trainer's package itself imports triton), the trained weights loaded (none missing but the embedding and head, none unexpected), cast to
  the trainer's precision (bfloat16), `initialize_embeddings_and_head` from the target, `save_pretrained` as its
  checkpoint manager calls it;
- `deepspec/dflash/`: DeepSpec's DFlash (its dflash configs: `markov_rank 0`, `confidence_head_alpha 0`), the same
  drafter's backbone alone (the DSpark weights less the Markov and confidence heads), saved the same way.

What it records (deepspec_loop.json), from DeepSpec's evaluator loop: `generate_decoding_sample`
(deepspec/eval/base_evaluator.py) with its `Qwen3DSparkEvaluator`'s own `_init_context`, `_propose` (which drafts
with `forward_dspark_draft_block` and `build_dspark_proposal`), `_update` and `_post_verify`, called through its
`generate_one_sample`, on CPU in float32, over the prompts of the DFlash golden case (the tiny run's first 8 held-out
prompts), MAX_NEW_TOKENS new tokens, the target's eos as stop ids (`resolve_stop_token_ids`), the drafter's block:

- `greedy` (temperature 0), per drafter and confidence threshold (DSpark: 0 and THRESHOLD, which shortens steps;
  DFlash: 0), one run per prompt: the tokens after the prompt, their count, and per verify step the acceptance
  length, the proposal length (drafts verified: DeepSpec's `effective_proposal_length`) and the drafts accepted;
- `sampled`: the DSpark drafter at temperature 1 (DeepSpec's protocol: drafts sampled from the Markov walk,
  rejection sampling), threshold 0, R runs per prompt, each seeded with DeepSpec's `seed_all(seed)` right before its
  call (`seeds`, the same list for every prompt): per run the acceptance lengths, proposal lengths and output count;
- `metrics`: DeepSpec's own summary of each setting (`allreduce_response_metrics`, `build_metrics_row`: pooled
  acceptance length, drafts per proposal, verify_rate, accept rate by position);
- `confidence`: what its `ConfidenceHeadRecorder` reports at threshold 0 (it records nothing at another threshold),
  greedy and sampled: per position the ECE, AUC, Brier score, mean prediction and target, and the reliability bins
  (20), of the cumulative product of the confidences against the accepted prefix;
- `metadata`: versions, DeepSpec's commit, sha256 of each model.safetensors, the prompts, the settings, and
  `summary`: tau per setting (mean over runs of each run's mean acceptance length, then over prompts) with its
  standard error over runs (prompts held fixed).

DeepSpec's code runs as it is, imported from a checkout of its repository (never copied into this one). The
adaptations, each needed to run it on a CPU and none in the loop's logic: (1) device: the evaluator is made without
its `__init__` (`init_dist` starts NCCL on CUDA and `build_models` loads bfloat16 models onto it) and given CPU
models, a gloo process group of one rank standing in for NCCL (the metrics' all-reduce); (2) dtype: the target and the
drafters are loaded in float32 (DeepSpec's evaluator loads them in bfloat16), with the SDPA attention it asks for;
(3) timer: none to adapt (DeepSpec's loop times nothing). DeepSpec's own `build_models` check,
`assert_no_final_target_layer`, is run as it runs it.

It runs in a venv with DeepSpec's requirements.txt, torch 2.13.0 CPU for its CUDA torch 2.9.1 (and no triton),
transformers 5.10.2 as pinned, from a checkout of DeepSpec at afdfa7c (its eval_datasets and paper are not needed):

    python3 -m venv /tmp/deepspec-venv
    /tmp/deepspec-venv/bin/pip install torch==2.13.0 transformers==5.10.2 numpy PyYAML tqdm tensorboard matplotlib \\
        typing_extensions sentencepiece safetensors prettytable
    OMP_NUM_THREADS=1 /tmp/deepspec-venv/bin/python tests/golden/make_deepspec_golden.py \\
        --deepspec /tmp/deepspec-src [<qwen3_dspark tiny run>/drafter/step_400] [--runs 200]

With a checkpoint folder it first (re)writes deepspec/dspark and deepspec/dflash from it; without one it reuses the
saves already here. It imports only torch, transformers, safetensors and DeepSpec (nothing from this repository).
"""

import argparse
import hashlib
import json
import math
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import safetensors
import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
TARGET = HERE / "dflash010" / "target"  # the DFlash golden case's target
OUT = HERE / "deepspec"
GOLDEN = HERE / "deepspec_loop.json"
PROMPTS_FROM = HERE / "dflash010_loop.json"  # the DFlash golden case's prompts (the tiny run's first 8 held out)
MAX_NEW_TOKENS = 48
THRESHOLD = 0.3  # a confidence threshold that shortens steps (about two in three on these prompts)
SAMPLED_TEMPERATURE = 1.0  # DeepSpec's eval.py default
SEED_BASE = 980_406  # DeepSpec's eval.py seed; run r of every prompt is seeded SEED_BASE + r
SAVED_TOKEN_HEAD = ("embed_tokens.weight", "lm_head.weight")
HEADS = ("markov_head.", "confidence_head.")
DRAFTERS = ("dspark", "dflash")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def model_args(run_config: dict, drafter: str):
    """DeepSpec's `model` config section (config/dspark/*.py, config/dflash/*.py) for the tiny drafter, as a
    ConfigNode (what its trainer passes build_draft_config)."""
    from deepspec.utils.config import ConfigNode

    args = ConfigNode(target_model_name_or_path=str(TARGET), block_size=run_config["block_size"],
                      num_draft_layers=run_config["num_hidden_layers"],
                      target_layer_ids=run_config["target_layer_ids"], mask_token_id=run_config["mask_token_id"],
                      num_anchors=run_config["num_anchors"], loss_decay_gamma=4.0)
    if drafter == "dspark":
        args.update(markov_rank=run_config["markov_rank"], markov_head_type=run_config["markov_head_type"],
                    confidence_head_alpha=1.0, confidence_head_with_markov=run_config["confidence_head_with_markov"])
    else:  # its dflash configs: "Disable markov head", "Disable confidence head"
        args.update(markov_rank=0, confidence_head_alpha=0.0)
    return args


def write_saves(checkpoint: Path) -> None:
    """deepspec/dspark and deepspec/dflash from the tiny run's DSpark save, by DeepSpec's own trainer code."""
    # what Qwen3DSparkTrainer._build_draft_model does (its package imports triton, for EAGLE-3's loss, at import)
    from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel
    from deepspec.modeling.dspark.qwen3.config import build_draft_config

    run_config = json.loads((checkpoint / "config.json").read_text())
    if run_config.get("architectures") != ["Qwen3DSparkModel"]:
        raise SystemExit(f"{checkpoint}: architectures {run_config.get('architectures')}, not ['Qwen3DSparkModel']")
    trained = {k: v for k, v in load_file(checkpoint / "model.safetensors").items() if k not in SAVED_TOKEN_HEAD}
    target_config = transformers.AutoConfig.from_pretrained(TARGET)
    # its trainer's build_models: the target at the training precision, its embedding and head copied in, frozen
    target = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.bfloat16).eval()
    for name in DRAFTERS:
        model = Qwen3DSparkModel(build_draft_config(target_config=target_config,
                                                    model_args=model_args(run_config, name)))
        weights = trained if name == "dspark" else {k: v for k, v in trained.items() if not k.startswith(HEADS)}
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and sorted(missing) == sorted(SAVED_TOKEN_HEAD), (name, missing, unexpected)
        model = model.to(dtype=torch.bfloat16)
        model.initialize_embeddings_and_head(embed_tokens=target.get_input_embeddings(),
                                             lm_head=target.get_output_embeddings(), freeze=True)
        if (OUT / name).exists():
            shutil.rmtree(OUT / name)
        model.save_pretrained(OUT / name, state_dict=model.state_dict())  # as its checkpoint manager saves it


def load_drafter(name: str):
    """A save here as the evaluator loads it (Qwen3DSparkModel.from_pretrained, SDPA), in float32; every stored weight
    loaded, none left to its random init."""
    from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel

    drafter, info = Qwen3DSparkModel.from_pretrained(OUT / name, dtype=torch.float32, attn_implementation="sdpa",
                                                     output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    state = drafter.state_dict()
    stored = load_file(OUT / name / "model.safetensors")
    assert sorted(stored) == sorted(state), name
    for key, tensor in stored.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(state[key], tensor.float()), key
    return drafter.eval()


def evaluator(target, drafter, name: str, temperature: float, threshold: float):
    """DeepSpec's Qwen3DSparkEvaluator on CPU models (adaptation 1: its __init__ is not run; what it and build_models
    set is set here, the recorder by its own _build_confidence_head_recorder)."""
    from deepspec.eval.base_evaluator import assert_no_final_target_layer
    from deepspec.eval.dspark import Qwen3DSparkEvaluator

    assert_no_final_target_layer(target, drafter.target_layer_ids)  # as its build_models checks
    ev = Qwen3DSparkEvaluator.__new__(Qwen3DSparkEvaluator)
    ev.args = SimpleNamespace(target_name_or_path=str(TARGET), draft_name_or_path=str(OUT / name),
                              max_new_tokens=MAX_NEW_TOKENS, temperature=temperature, confidence_threshold=threshold,
                              tensorboard_dir=None, step=None, seed=SEED_BASE, tasks=[])
    ev.device, ev.global_rank, ev.world_size = torch.device("cpu"), 0, 1
    ev.target_model, ev.draft_model, ev.tokenizer = target, drafter, None
    ev.metrics_rows = []
    ev.confidence_head_recorder = ev._build_confidence_head_recorder()
    return ev


def run_setting(ev, prompts: list[dict], stop_ids: list[int], seeds: list[int]) -> tuple[list[list], dict, dict | None]:
    """Every prompt run once per seed through the evaluator's own generate_one_sample: the responses per prompt, its
    metrics row and (threshold 0, a confidence head) its recorder's row."""
    from deepspec.utils import seed_all

    recorder = ev.confidence_head_recorder
    if recorder is not None:
        recorder.start()
    responses = []
    for prompt in prompts:
        runs = []
        for seed in seeds:
            seed_all(seed)
            runs.append(ev.generate_one_sample(input_ids=torch.tensor([prompt["input_ids"]]), stop_token_ids=stop_ids))
        responses.append(runs)
    summary = ev.allreduce_response_metrics([r for runs in responses for r in runs])
    row = ev.build_metrics_row(dataset_name="tiny", metric_summary=summary)
    confidence = recorder.finish(dataset_name="tiny", metric_summary=summary) if recorder is not None else None
    return responses, row, confidence


def step_record(response, num_input_tokens: int) -> dict:
    return {"output_ids": response.output_ids[0, num_input_tokens:].tolist(),
            "num_output_tokens": int(response.num_output_tokens),
            "acceptance_lengths": list(map(int, response.acceptance_lengths)),
            "proposal_lengths": list(map(int, response.proposal_lengths)),
            "accepted_draft_lengths": list(map(int, response.accepted_draft_lengths))}


def target_greedy(target, prompt: list[int], stop_ids: list[int]) -> list[int]:
    """The target alone, argmax, full forward each step: what temperature 0 must reproduce."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(MAX_NEW_TOKENS):
            ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] in stop_ids:
                break
    return ids[len(prompt):]


def tau_summary(per_prompt_runs: list[list[list[int]]]) -> dict:
    """Mean over runs of each run's mean acceptance length, then over prompts; SE over runs, prompts held fixed. A run
    without a step (its first token a stop) is left out of its prompt's mean (and counted)."""
    means, variances, empty = [], [], 0
    for runs in per_prompt_runs:
        run_means = [sum(a) / len(a) for a in runs if a]
        empty += len(runs) - len(run_means)
        m = sum(run_means) / len(run_means)
        means.append(m)
        variances.append(sum((x - m) ** 2 for x in run_means) / max(len(run_means) - 1, 1) / len(run_means))
    return {"tau": sum(means) / len(means), "se": math.sqrt(sum(variances)) / len(means),
            "tau_per_prompt": [round(m, 4) for m in means], "runs_without_steps": empty}


def render(obj, indent: int = 0) -> str:
    """JSON with dicts and lists of dicts laid out one item a line, every other list on one line."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(k)}: {render(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        return "[\n" + ",\n".join(inner + render(x, indent + 1) for x in obj) + "\n" + pad + "]"
    return json.dumps(obj, separators=(",", ":"))


def finite(obj):
    """The recorder's NaNs (an AUC with one class only) as null, so the file stays JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", type=Path,
                        help="the qwen3_dspark tiny run's drafter/step_400; omit to reuse the saves already here")
    parser.add_argument("--deepspec", type=Path, default=Path("/tmp/deepspec-src"), help="a DeepSpec checkout")
    parser.add_argument("--runs", type=int, default=200, help="seeded runs per prompt, sampled")
    args = parser.parse_args()
    started = time.perf_counter()
    torch.set_num_threads(1)
    sys.path.insert(0, str(args.deepspec))
    commit = subprocess.run(["git", "-C", str(args.deepspec), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    # adaptation 1: the metrics' and the recorder's all-reduce over a gloo group of one rank (DeepSpec: NCCL)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    from deepspec.eval.base_evaluator import resolve_stop_token_ids

    prompts = json.loads(PROMPTS_FROM.read_text())["metadata"]["prompts"]
    if args.checkpoint is not None:
        write_saves(args.checkpoint)
    # adaptation 2: float32 (its evaluator loads bfloat16), SDPA as its evaluator asks
    target = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32,
                                                               attn_implementation="sdpa").eval()
    drafters = {name: load_drafter(name) for name in DRAFTERS}
    stop_ids = resolve_stop_token_ids(target, None)

    greedy, metrics, confidence, summary = {}, {}, {}, {}
    settings = [("dspark", 0.0), ("dspark", THRESHOLD), ("dflash", 0.0)]
    for name, threshold in settings:
        key = f"{name}_t{threshold:g}"
        ev = evaluator(target, drafters[name], name, 0.0, threshold)
        responses, metrics[key], row = run_setting(ev, prompts, stop_ids, [SEED_BASE])
        if row is not None:
            confidence[f"greedy_{key}"] = row
        runs = []
        for prompt, (response,) in zip(prompts, responses):
            record = step_record(response, len(prompt["input_ids"]))
            record["equals_target_argmax"] = record["output_ids"] == target_greedy(target, prompt["input_ids"],
                                                                                   stop_ids)
            if not record["equals_target_argmax"]:
                print(f"warning: {key} {prompt['id']}: greedy output differs from the target's own argmax",
                      file=sys.stderr)
            runs.append({"id": prompt["id"], **record})
        greedy[key] = runs
        summary[f"greedy_{key}"] = {"tau": tau_summary([[r["acceptance_lengths"]] for r in runs])["tau"],
                                    "pooled_acceptance_length": metrics[key]["acceptance_length"]}
        print(f"greedy {key} ({time.perf_counter() - started:.0f}s): {summary[f'greedy_{key}']}")

    seeds = [SEED_BASE + r for r in range(args.runs)]
    ev = evaluator(target, drafters["dspark"], "dspark", SAMPLED_TEMPERATURE, 0.0)
    responses, metrics["sampled_dspark_t0"], confidence["sampled_dspark_t0"] = run_setting(ev, prompts, stop_ids, seeds)
    rows = [{"id": prompt["id"], **{field: [r[field] for r in map(lambda x: step_record(x, len(prompt["input_ids"])),
                                                                 runs)]
                                    for field in ("acceptance_lengths", "proposal_lengths", "num_output_tokens")}}
            for prompt, runs in zip(prompts, responses)]
    stats = tau_summary([row["acceptance_lengths"] for row in rows])
    summary["sampled_dspark_t0"] = {**stats, "pooled_acceptance_length": metrics["sampled_dspark_t0"]["acceptance_length"]}
    sampled = [{"drafter": "dspark", "temperature": SAMPLED_TEMPERATURE, "top_k": 0, "top_p": 1.0,
                "confidence_threshold": 0.0, "seeds": seeds, "prompts": rows}]
    print(f"sampled ({time.perf_counter() - started:.0f}s): tau {stats['tau']:.4f} +- {stats['se']:.4f}")

    metadata = {
        "source": f"github deepseek-ai/DeepSpec {commit} (MIT): deepspec.eval.base_evaluator.generate_decoding_sample "
                  "through Qwen3DSparkEvaluator.generate_one_sample (its _init_context, _propose -> "
                  "forward_dspark_draft_block, build_dspark_proposal, _update, _post_verify), allreduce_response_metrics, "
                  "build_metrics_row, ConfidenceHeadRecorder; saves by build_draft_config and Qwen3DSparkModel (as "
                  "Qwen3DSparkTrainer._build_draft_model), initialize_embeddings_and_head, save_pretrained",
        "adaptations": ["device: the evaluator made without __init__ (init_dist: NCCL on CUDA) and given CPU models; "
                        "a gloo process group of one rank for its all-reduce",
                        "dtype: target and drafters loaded in float32 (its evaluator: bfloat16), SDPA as it asks",
                        "timer: none (its loop times nothing)"],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "safetensors": safetensors.__version__, "python": platform.python_version(),
                     "deepspec": commit},
        "models": {"target": "dflash010/target",
                   "drafters": {name: f"deepspec/{name}" for name in DRAFTERS},
                   "drafter_from": "the qwen3_dspark tiny run's step_400 (tests/trained_runs.py); dflash: its "
                                   "backbone alone (markov_rank 0, no confidence head)",
                   "weights": "bfloat16 on disk, loaded as float32",
                   "sha256": {"target/model.safetensors": sha256(TARGET / "model.safetensors"),
                              **{f"{name}/model.safetensors": sha256(OUT / name / "model.safetensors")
                                 for name in DRAFTERS}}},
        "max_new_tokens": MAX_NEW_TOKENS,
        "stop_token_ids": stop_ids,
        "block_size": int(drafters["dspark"].block_size),
        "threshold": THRESHOLD,
        "seeding": "deepspec.utils.seed_all(seed) right before each generate_one_sample call",
        "runs_per_prompt": args.runs,
        "seconds": round(time.perf_counter() - started, 1),
        "summary": summary,
        "prompts": prompts,
    }
    GOLDEN.write_text(render(finite({"metadata": metadata, "greedy": greedy, "sampled": sampled, "metrics": metrics,
                                     "confidence": confidence})) + "\n")
    dist.destroy_process_group()
    print(f"wrote {GOLDEN} in {metadata['seconds']}s")


if __name__ == "__main__":
    main()

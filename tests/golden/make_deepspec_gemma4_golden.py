"""Record deepspec_gemma4/ and deepspec_gemma4_loop.json: DeepSpec's Gemma 4 DSpark drafter (github deepseek-ai/DeepSpec,
commit afdfa7c, MIT: deepspec/modeling/dspark/gemma4) built, trained, saved and run by its own code on a tiny Gemma 4
target. The Qwen3 counterpart is make_deepspec_golden.py; its helpers are imported from there.

What it writes (tests/golden/deepspec_gemma4/), weights in bfloat16 (loaded and run in float32: the cast is exact):

- `target/`: a tiny random Gemma 4 (`Gemma4ForConditionalGeneration`, no towers, as transformers 5.10.2 builds and
  saves it): 128 tokens, hidden size 96, 4 layers (sliding, full, sliding, full), full layers of global_head_dim 32
  with `attention_k_eq_v` (one key head whose raw projection is also the value), Gemma 4's proportional RoPE on a
  quarter of each full head, final_logit_softcapping FINAL_LOGIT_SOFTCAP (low, so that the cap bends the drafter's
  logits before its Markov bias is added), a word-level tokenizer t0 .. t127 (t1 is eos), generation_config.json;
- `dspark/step_STEPS/`: the drafter as DeepSpec's checkpoint manager saves it (`config.json`, `model.safetensors` by
  `save_pretrained(checkpoint_dir, state_dict=...)`, and the `train_config.py` it copies beside; not its
  `training_state.rank0.pt`, the optimizer state a resume reads): built as its trainer builds it
  (`Gemma4DSparkTrainer._build_draft_model`'s `build_draft_config(AutoConfig of the target, model args)` and
  `Gemma4DSparkModel`): block 7, 2 layers reading target layers 1 and 2, a vanilla Markov head of rank 16, a confidence
  head reading it; `initialize_embeddings_and_head` from the target; each layer's `layer_scalar` buffer set to
  LAYER_SCALARS (DeepSpec leaves it at 1: set so that a reader that ignored it would fail); trained TRAIN_STEPS steps
  by its own `forward` and `compute_dspark_loss` (its DSpark config's loss weights) on the target's greedy
  continuations of random prompts; cast to the trainer's precision (bfloat16) and saved;
- `prompts.jsonl`: the 8 held-out prompts of 16 tokens.

What it records (deepspec_gemma4_loop.json), from DeepSpec's evaluator loop (`generate_decoding_sample` through its
`Gemma4DSparkEvaluator.generate_one_sample`: `_init_context`, `_propose` -> `forward_dspark_draft_block`,
`build_dspark_proposal`, `_update`, `_post_verify`), greedy (temperature 0), at confidence threshold 0 and THRESHOLD:
per prompt the output tokens and per verify step the acceptance length, the proposal length (drafts verified), the
drafts accepted, the block's drafts (all 7 of the Markov walk, seen by wrapping the model's `sample_draft_tokens`) and
its confidences (sigmoid of `predict_confidence_step`, seen the same way); per prompt the target's own greedy tokens
past max_new_tokens (`lookahead`, up to a stop token), which DeepSpec's last step verifies; DeepSpec's metrics row per
setting; and `shapes`: for configs that switch on what the tiny drafter does not use (`attention_k_eq_v` false,
`use_double_wide_mlp` with KV-shared layers), the draft config DeepSpec builds and its model's tensor shapes.

The adaptations, each needed to run DeepSpec on a CPU and none in the loop's logic: (1) device: the evaluator is made
without its `__init__` (`init_dist` starts NCCL on CUDA) and given CPU models, a gloo group of one rank for the
all-reduces; (2) dtype: target and drafter loaded in float32 (its evaluator: bfloat16), SDPA as it asks; (3) timer:
none (its loop times nothing); (4) training only: FlexAttention has no backward on CPU, so the training forward's
block mask (`create_dspark_attention_mask`) is given as the dense boolean mask of the same mask_mod, the model's
attention set to SDPA for it (the evaluator's own path, which passes no mask, is untouched).

Run in the venv of make_deepspec_golden.py (DeepSpec's requirements, torch 2.13.0 CPU, transformers 5.10.2), from the
repository root, on one thread (trained weights depend on the thread count):

    OMP_NUM_THREADS=1 /tmp/deepspec-venv/bin/python tests/golden/make_deepspec_gemma4_golden.py \\
        --deepspec /tmp/deepspec-src

It imports torch, transformers, safetensors, tokenizers and DeepSpec, and the helpers of make_deepspec_golden.py
(nothing else from this repository).
"""

import argparse
import copy
import json
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
from make_deepspec_golden import finite, render, run_setting, sha256, step_record  # (this folder is sys.path[0])
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
OUT = HERE / "deepspec_gemma4"
TARGET = OUT / "target"
TRAIN_STEPS = 600
SAVE = OUT / "dspark" / f"step_{TRAIN_STEPS}"
GOLDEN = HERE / "deepspec_gemma4_loop.json"

VOCAB_SIZE = 128
HIDDEN = 96
EOS = 1
MASK_TOKEN_ID = VOCAB_SIZE - 1
PROMPT_IDS = range(2, MASK_TOKEN_ID)  # 0 pads, 1 is eos, the last id is the drafter's mask token
PROMPT_LEN = 16
TRAIN_PROMPTS = 256
EVAL_PROMPTS = 8
MAX_NEW_TOKENS = 48
LOOKAHEAD = 8  # the target's greedy tokens past max_new_tokens: DeepSpec's last step verifies a whole block
FINAL_LOGIT_SOFTCAP = 2.0
LAYER_SCALARS = (0.75, 1.25)  # bfloat16-exact
THRESHOLD = 0.855  # a confidence threshold that shortens some steps (the tiny drafter is 0.84 to 0.87 confident)
SEED = 20260606

TEXT_CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, num_hidden_layers=4, intermediate_size=192, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
    layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4, max_position_embeddings=256,
    final_logit_softcapping=FINAL_LOGIT_SOFTCAP, hidden_size_per_layer_input=0, vocab_size_per_layer_input=VOCAB_SIZE,
    initializer_range=0.04, eos_token_id=EOS, bos_token_id=None, pad_token_id=0)

# DeepSpec's `model` section (config/dspark/dspark_gemma4_12b.py) for the tiny drafter, and its `train` settings here
MODEL_ARGS = dict(block_size=7, num_draft_layers=2, target_layer_ids=[1, 2], mask_token_id=MASK_TOKEN_ID,
                  num_anchors=16, markov_rank=16, markov_head_type="vanilla", confidence_head_alpha=1.0,
                  confidence_head_with_markov=True, loss_decay_gamma=4.0, ce_loss_alpha=0.1, l1_loss_alpha=0.9)
TRAIN = dict(lr=3e-3, local_batch_size=8, max_train_steps=TRAIN_STEPS, precision="bf16")

# configs that switch on what the tiny drafter does not use: DeepSpec's tensor shapes for each (`shapes`)
VARIANTS = {
    "k_and_v": dict(attention_k_eq_v=False),
    "double_wide_mlp": dict(use_double_wide_mlp=True, num_kv_shared_layers=1),
}


def build_draft_model(target_config):
    """Gemma4DSparkTrainer._build_draft_model's two lines (deepspec/trainer/dspark_trainer.py; the trainer package
    itself imports triton, which a CPU venv has not): its build_draft_config and its Gemma4DSparkModel."""
    from deepspec.modeling.dspark.gemma4 import Gemma4DSparkModel, build_draft_config

    return Gemma4DSparkModel(build_draft_config(target_config=target_config, model_args=model_args()))


def model_args(**overrides):
    from deepspec.utils.config import ConfigNode

    return ConfigNode(target_model_name_or_path=str(TARGET), **{**MODEL_ARGS, **overrides})


def tokenizer():
    """A word-level tokenizer of the ids (t0 .. t127; t1 is eos)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    words = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB_SIZE)}, unk_token="t0"))
    words.pre_tokenizer = WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t0",
                                                eos_token=f"t{EOS}")


def to_bfloat16(folder: Path) -> None:
    weights = folder / "model.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(weights).items()}, weights,
              metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_target() -> None:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, GenerationConfig

    torch.manual_seed(SEED)
    config = Gemma4Config(text_config=TEXT_CONFIG, vision_config=None, audio_config=None, initializer_range=0.04,
                          tie_word_embeddings=True)
    model = Gemma4ForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=EOS, pad_token_id=0)
    shutil.rmtree(TARGET, ignore_errors=True)
    model.save_pretrained(TARGET)
    to_bfloat16(TARGET)
    tokenizer().save_pretrained(TARGET)


def load_target():
    # adaptation 2: float32 (its evaluator loads bfloat16), SDPA as its evaluator asks
    return transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32,
                                                             attn_implementation="sdpa").eval()


def prompts(n: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor(PROMPT_IDS)
    return [ids[torch.randint(len(ids), (PROMPT_LEN,), generator=generator)].tolist() for _ in range(n)]


@torch.inference_mode()
def greedy_tokens(target, prompt: list[int], n: int, stop_ids: list[int] | None) -> list[int]:
    """The target alone, argmax, a full forward each token: n tokens after the prompt, ending at a stop token (kept)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
        if stop_ids and ids[-1] in stop_ids:
            break
    return ids[len(prompt):]


@torch.inference_mode()
def training_data(target) -> dict:
    """The target's greedy continuations of TRAIN_PROMPTS random prompts (MAX_NEW_TOKENS tokens, eos or not) with what
    DeepSpec's target cache holds for them (scripts/data/prepare_target_cache.py): the tapped layers' outputs, the text
    model's last hidden state, the loss mask (1 on the continuation)."""
    ids = torch.tensor(prompts(TRAIN_PROMPTS, seed=1))
    for _ in range(MAX_NEW_TOKENS):
        ids = torch.cat([ids, target(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    out = target(input_ids=ids, output_hidden_states=True)
    text_model = target.model.language_model
    last = text_model(input_ids=ids).last_hidden_state
    from deepspec.modeling.dspark.common import extract_context_feature

    loss_mask = torch.ones(ids.shape)
    loss_mask[:, :PROMPT_LEN] = 0
    return {"input_ids": ids, "target_hidden_states": extract_context_feature(out.hidden_states,
                                                                               MODEL_ARGS["target_layer_ids"]),
            "target_last_hidden_states": last, "loss_mask": loss_mask}


def dense_dspark_mask(*, anchor_positions, block_keep_mask, seq_len, block_size, device):
    """Adaptation 4: the boolean mask [B, 1, Q, KV] DeepSpec's mask_mod (create_dspark_attention_mask) describes, for
    SDPA (FlexAttention has no backward on CPU)."""
    bsz, num_blocks = anchor_positions.shape
    assert bool(block_keep_mask.all()), "every sampled block is kept (a masked row would make SDPA NaN)"
    q_idx = torch.arange(num_blocks * block_size, device=device)[None, :, None]
    kv_idx = torch.arange(seq_len + num_blocks * block_size, device=device)[None, None, :]
    b = torch.arange(bsz, device=device)[:, None, None]
    q_block_id = q_idx // block_size
    anchor_pos = anchor_positions[b, q_block_id]
    mask_context = (kv_idx < seq_len) & (kv_idx < anchor_pos)
    mask_draft = (kv_idx >= seq_len) & (q_block_id == (kv_idx - seq_len) // block_size)
    return ((mask_context | mask_draft) & block_keep_mask[b, q_block_id])[:, None]


def write_drafter(target) -> None:
    """The drafter as DeepSpec's trainer builds, trains (its forward and loss, adaptation 4) and saves it."""
    import deepspec.modeling.dspark.gemma4.modeling as gemma4_modeling
    from deepspec.modeling.dspark.gemma4.config import TRAIN_ATTN_IMPLEMENTATION
    from deepspec.modeling.dspark.loss import compute_dspark_loss

    target_config = transformers.AutoConfig.from_pretrained(TARGET)  # as its trainer's build_models reads it
    torch.manual_seed(SEED + 1)
    model = build_draft_model(target_config)
    model.initialize_embeddings_and_head(embed_tokens=target.get_input_embeddings(),
                                         lm_head=target.get_output_embeddings(), freeze=True)
    for layer, scalar in zip(model.layers, LAYER_SCALARS):
        layer.layer_scalar.fill_(scalar)
    data = training_data(target)
    model.config._attn_implementation = "sdpa"
    gemma4_modeling.create_dspark_attention_mask = dense_dspark_mask
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=TRAIN["lr"],
                                  weight_decay=0.0)
    generator = torch.Generator().manual_seed(SEED + 2)
    model.train()
    for step in range(TRAIN_STEPS):
        rows = torch.randint(TRAIN_PROMPTS, (TRAIN["local_batch_size"],), generator=generator)
        outputs = model(**{k: v[rows] for k, v in data.items()})
        loss = compute_dspark_loss(outputs=outputs, loss_decay_gamma=MODEL_ARGS["loss_decay_gamma"],
                                   ce_loss_alpha=MODEL_ARGS["ce_loss_alpha"], l1_loss_alpha=MODEL_ARGS["l1_loss_alpha"],
                                   confidence_head_alpha=MODEL_ARGS["confidence_head_alpha"])
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == TRAIN_STEPS - 1:
            print(f"step {step}: loss {loss.item():.4f}")
    model.eval()
    model.config._attn_implementation = TRAIN_ATTN_IMPLEMENTATION  # as build_draft_config set it
    model = model.to(dtype=torch.bfloat16)  # the trainer's precision
    shutil.rmtree(SAVE.parent, ignore_errors=True)
    model.save_pretrained(SAVE, state_dict=model.state_dict())  # as its checkpoint manager saves it
    (SAVE / "train_config.py").write_text(  # what its save_train_config copies beside: the run's config file
        "# the tiny Gemma 4 DSpark drafter of tests/golden/make_deepspec_gemma4_golden.py (DeepSpec's config layout)\n"
        "from deepspec.trainer import Gemma4DSparkTrainer\n\n"
        f"model = dict(target_model_name_or_path='../../target', **{MODEL_ARGS!r})\n"
        f"train = dict(trainer_cls=Gemma4DSparkTrainer, **{TRAIN!r})\n")


def load_drafter():
    """The save as the evaluator loads it (Gemma4DSparkModel.from_pretrained, SDPA), in float32; every stored weight
    loaded, none left to its random init."""
    from deepspec.modeling.dspark.gemma4 import Gemma4DSparkModel

    drafter, info = Gemma4DSparkModel.from_pretrained(SAVE, dtype=torch.float32, attn_implementation="sdpa",
                                                      output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    state = drafter.state_dict()
    stored = load_file(SAVE / "model.safetensors")
    assert sorted(stored) == sorted(state)
    for key, tensor in stored.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(state[key], tensor.float()), key
    assert [float(layer.layer_scalar) for layer in drafter.layers] == list(LAYER_SCALARS)
    return drafter.eval()


def evaluator(target, drafter, threshold: float):
    """DeepSpec's Gemma4DSparkEvaluator on CPU models (adaptation 1: its __init__ is not run; what it and build_models
    set is set here, the recorder by its own _build_confidence_head_recorder)."""
    from deepspec.eval.base_evaluator import assert_no_final_target_layer
    from deepspec.eval.dspark import Gemma4DSparkEvaluator

    assert_no_final_target_layer(target, drafter.target_layer_ids)  # as its build_models checks
    ev = Gemma4DSparkEvaluator.__new__(Gemma4DSparkEvaluator)
    ev.args = SimpleNamespace(target_name_or_path=str(TARGET), draft_name_or_path=str(SAVE),
                              max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, confidence_threshold=threshold,
                              tensorboard_dir=None, step=None, seed=SEED, tasks=[])
    ev.device, ev.global_rank, ev.world_size = torch.device("cpu"), 0, 1
    ev.target_model, ev.draft_model, ev.tokenizer = target, drafter, None
    ev.metrics_rows = []
    ev.confidence_head_recorder = ev._build_confidence_head_recorder()
    return ev


def watch_blocks(drafter) -> tuple[list, list]:
    """Every block's drafts (the whole Markov walk) and confidences, as the evaluator's build_dspark_proposal gets them
    from the model (its sample_draft_tokens and predict_confidence_step, wrapped on this instance; what they return
    is unchanged)."""
    walks, confidences = [], []
    sample, predict = drafter.sample_draft_tokens, drafter.predict_confidence_step

    def sample_draft_tokens(*args, **kwargs):
        tokens, logits = sample(*args, **kwargs)
        walks.append(tokens[0].tolist())
        return tokens, logits

    def predict_confidence_step(*args, **kwargs):
        out = predict(*args, **kwargs)
        confidences.append(out.float().sigmoid().reshape(-1).tolist())
        return out

    drafter.sample_draft_tokens, drafter.predict_confidence_step = sample_draft_tokens, predict_confidence_step
    return walks, confidences


def shapes(target_config) -> dict:
    """Per variant, the draft config DeepSpec builds from the target's config with the variant's fields and its model's
    tensor shapes."""
    out = {}
    for name, fields in VARIANTS.items():
        config = copy.deepcopy(target_config)
        for key, value in fields.items():
            setattr(config.text_config, key, value)
        model = build_draft_model(config)
        out[name] = {"fields": fields, "config": json.loads(model.config.to_json_string()),  # as config.json holds it
                     "shapes": {k: list(v.shape) for k, v in model.state_dict().items()}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspec", type=Path, default=Path("/tmp/deepspec-src"), help="a DeepSpec checkout")
    parser.add_argument("--reuse", action="store_true", help="reuse the target and drafter saved here (no training)")
    args = parser.parse_args()
    started = time.perf_counter()
    torch.set_num_threads(1)
    sys.path.insert(0, str(args.deepspec))
    commit = subprocess.run(["git", "-C", str(args.deepspec), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    # adaptation 1: the loss's, the metrics' and the recorder's all-reduces over a gloo group of one rank (NCCL)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29534", rank=0, world_size=1)
    from deepspec.eval.base_evaluator import resolve_stop_token_ids

    if not args.reuse:
        write_target()
    target = load_target()
    if not args.reuse:
        write_drafter(target)
    held_out = prompts(EVAL_PROMPTS, seed=2)
    with open(OUT / "prompts.jsonl", "w") as f:
        for i, p in enumerate(held_out):
            f.write(json.dumps({"id": f"gemma4-{i}", "input_ids": p}) + "\n")
    prompt_rows = [{"id": f"gemma4-{i}", "input_ids": p} for i, p in enumerate(held_out)]
    stop_ids = resolve_stop_token_ids(target, None)
    drafter = load_drafter()
    walks, confidences = watch_blocks(drafter)
    greedy, metrics, summary = {}, {}, {}
    for threshold in (0.0, THRESHOLD):
        key = f"dspark_t{threshold:g}"
        walks.clear()
        confidences.clear()
        responses, metrics[key], _ = run_setting(evaluator(target, drafter, threshold), prompt_rows, stop_ids,
                                                 [SEED])
        runs, seen = [], 0
        for prompt, (response,) in zip(prompt_rows, responses):
            record = step_record(response, len(prompt["input_ids"]))
            steps = len(record["acceptance_lengths"])
            record["drafts"] = walks[seen:seen + steps]
            record["confidences"] = confidences[seen:seen + steps]
            seen += steps
            reference = greedy_tokens(target, prompt["input_ids"], MAX_NEW_TOKENS + LOOKAHEAD, stop_ids)
            record["equals_target_argmax"] = reference[:len(record["output_ids"])] == record["output_ids"] and (
                len(record["output_ids"]) == MAX_NEW_TOKENS or record["output_ids"][-1] in stop_ids)
            record["lookahead"] = reference[len(record["output_ids"]):]
            if not record["equals_target_argmax"]:
                print(f"warning: {key} {prompt['id']}: greedy output differs from the target's own argmax",
                      file=sys.stderr)
            runs.append({"id": prompt["id"], **record})
        assert seen == len(walks) == len(confidences)
        greedy[key] = runs
        steps = [a for r in runs for a in r["acceptance_lengths"]]
        verified = [p for r in runs for p in r["proposal_lengths"]]
        summary[key] = {"tau": sum(sum(r["acceptance_lengths"]) / len(r["acceptance_lengths"]) for r in runs)
                        / len(runs), "pooled_acceptance_length": metrics[key]["acceptance_length"],
                        "steps": len(steps), "step_lengths": sorted(set(steps)),
                        "steps_shortened": sum(p < MODEL_ARGS["block_size"] for p in verified)}
        print(f"greedy {key} ({time.perf_counter() - started:.0f}s): {summary[key]}")

    metadata = {
        "source": f"github deepseek-ai/DeepSpec {commit} (MIT): deepspec.eval.base_evaluator.generate_decoding_sample "
                  "through Gemma4DSparkEvaluator.generate_one_sample (its _init_context, _propose -> "
                  "forward_dspark_draft_block, build_dspark_proposal, _update, _post_verify), allreduce_response_metrics, "
                  "build_metrics_row; the save by Gemma4DSparkTrainer._build_draft_model (build_draft_config, "
                  "Gemma4DSparkModel), initialize_embeddings_and_head, its forward and compute_dspark_loss, "
                  "save_pretrained",
        "adaptations": ["device: the evaluator made without __init__ (init_dist: NCCL on CUDA) and given CPU models; "
                        "a gloo process group of one rank for its all-reduces",
                        "dtype: target and drafter loaded in float32 (its evaluator: bfloat16), SDPA as it asks",
                        "timer: none (its loop times nothing)",
                        "training only: the block mask given densely to SDPA (FlexAttention has no CPU backward)"],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "safetensors": safetensors.__version__, "python": platform.python_version(),
                     "deepspec": commit},
        "models": {"target": "deepspec_gemma4/target", "drafter": f"deepspec_gemma4/dspark/{SAVE.name}",
                   "weights": "bfloat16 on disk, loaded as float32", "layer_scalars": list(LAYER_SCALARS),
                   "training": {**TRAIN, "model": MODEL_ARGS, "prompts": TRAIN_PROMPTS, "optimizer": "AdamW",
                                "max_grad_norm": 1.0},
                   "sha256": {"target/model.safetensors": sha256(TARGET / "model.safetensors"),
                              "drafter/model.safetensors": sha256(SAVE / "model.safetensors")}},
        "max_new_tokens": MAX_NEW_TOKENS,
        "lookahead": LOOKAHEAD,
        "stop_token_ids": stop_ids,
        "block_size": int(drafter.block_size),
        "threshold": THRESHOLD,
        "seconds": round(time.perf_counter() - started, 1),
        "summary": summary,
        "prompts": prompt_rows,
    }
    record = {"metadata": metadata, "greedy": greedy, "metrics": metrics,
              "shapes": shapes(transformers.AutoConfig.from_pretrained(TARGET))}
    GOLDEN.write_text(render(finite(record)) + "\n")
    dist.destroy_process_group()
    print(f"wrote {GOLDEN} in {metadata['seconds']}s")


if __name__ == "__main__":
    main()

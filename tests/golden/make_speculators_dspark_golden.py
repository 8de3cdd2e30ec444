"""Record speculators_dspark/ and speculators_dspark_golden.json: the tiny DSpark drafter saved by vLLM's `speculators`
0.9.0, and what speculators' own DSpark model drafts at every block of the DeepSpec golden references.

What it writes. The tiny DSpark drafter of the DeepSpec golden case (`deepspec/dspark/`, DeepSpec's own save: block
7, every slot drafting, a vanilla Markov head of rank 32, a confidence head reading it; make_deepspec_golden.py), for
the tiny Qwen3 target of the DFlash golden case (`dflash010/target/`), built with speculators' own classes and written
by its own training-checkpoint code as a speculators run folder (`speculators_dspark/dspark/`, one save, `0/`):

- the config as `speculators train --speculator-type dspark --draft-config <DeepSpec's save>` builds it: the decoder
  config read from DeepSpec's config.json by its `load_draft_transformer_layer_config` (the `--draft-config` path),
  the TrainConfig of the run (`aux_hidden_state_layer_ids` = DeepSpec's `target_layer_ids` + 1, since speculators' id
  L reads HF `hidden_states[L]`; DeepSpec's mask token and block; `sample_from_anchor` left to its dspark default,
  true; DeepSpec's markov_rank, markov_head_type, enable_confidence_head and confidence_head_with_markov), the model
  made by `DSparkDraftModel.from_training_args`, which loads the verifier-owned weights itself (embed_tokens, lm_head,
  verifier_norm, verifier_lm_head: not saved by DeepSpec's rules but by speculators', which leaves embed_tokens and
  lm_head out of the save);
- the trained weights: DeepSpec's save's (bfloat16, the same tensor names in both formats) less its copies of the
  target's embedding and head, loaded with `load_state_dict` (no trained weight missing, none unexpected);
- the run folder: `TrainConfig.save` (run.yaml, train_command.txt) and the trainer's own `Trainer.maybe_save_checkpoint`
  (`SingleGPUCheckpointer`: `0/` with config.json, model.safetensors in bfloat16, optimizer and scheduler states,
  training_state.json; the link `epoch0_end`), as make_speculators_golden.py writes its DFlash runs.

Golden values (speculators_dspark_golden.json): speculators' own model loaded from the save
(`SpeculatorModel.from_pretrained`, float32 compute from the bfloat16 weights, eager attention, CPU), through its
training forward's own steps: `_backbone_forward` (the anchors forced through the loss mask, as
make_speculators_golden.py does), then its Markov head and confidence head as `DSparkDraftModel.forward` applies
them, over the 8 references of the DeepSpec golden case (prompt + DeepSpec's greedy output_ids at threshold 0,
deepspec_loop.json), the target's hidden states computed here (transformers, float32). For every anchor a (the block's
first token, slot 0 = token a, slots 1..6 the mask token, the context the target's hidden states before a; slot k
drafts the token at a + k + 1) from prompt_len - 1 to len - 8 (every drafted position has a reference token):

- `drafts`: the greedy Markov walk, slot by slot (`markov_head.block_bias` given the token before: the anchor at
  slot 0, then the token drafted at the slot before; argmax of the biased logits), what a DSpark server drafts;
- `teacher_forced`: the argmax of the forward's biased logits, each slot given the reference's token before it (what
  `DSparkDraftModel.forward` computes, `prev_token_ids = block_tokens`); `backbone`: the argmax of the logits alone;
- `confidence`: the forward's confidence head, sigmoid, teacher-forced;
- `near_ties`: [sequence, anchor, slot, margin] wherever the top two biased logits of the walk differ by less than
  NEAR_TIE.

It runs in the venv make_speculators_golden.py describes (speculators 0.9.0 with transformers 5.25.0, from its
helpers, which it imports), after make_deepspec_golden.py:

    OMP_NUM_THREADS=1 /tmp/specvenv/bin/python tests/golden/make_speculators_dspark_golden.py

It imports only torch, transformers, safetensors, speculators and make_speculators_golden.py beside it (nothing else
from this repository). The saves' `speculators_config.verifier.name_or_path` is "../dflash010/target", resolved from
speculators_dspark/ (the working directory while it runs), as in the DFlash runs.
"""

import json
import os
import platform
import shutil
import time
import warnings
from importlib.metadata import version
from pathlib import Path

import torch
from make_speculators_golden import (  # (beside this script: the target's states, the save and load helpers)
    NEAR_TIE,
    TARGET,
    VERIFIER,
    VERIFIER_FILLED,
    aux_states,
    fake_trainer,
    load_save,
    margin,
    sha256,
    target_states,
)
from safetensors.torch import load_file
from speculators.models.dspark import DSparkDraftModel
from speculators.train.cli import load_draft_transformer_layer_config
from speculators.train.config.schema import TrainConfig
from speculators.train.trainer import Trainer

HERE = Path(__file__).resolve().parent
DEEPSPEC = HERE / "deepspec" / "dspark"
LOOP = HERE / "deepspec_loop.json"
OUT = HERE / "speculators_dspark"
GOLDEN = HERE / "speculators_dspark_golden.json"
NAME = "dspark"
SAVED_TOKEN_HEAD = ("embed_tokens.weight", "lm_head.weight")  # DeepSpec's copies of the target's


def load_sequences() -> list[dict]:
    loop = json.loads(LOOP.read_text())
    prompts = {p["id"]: p["input_ids"] for p in loop["metadata"]["prompts"]}
    return [{"id": g["id"], "prompt_len": len(prompts[g["id"]]), "input_ids": prompts[g["id"]] + g["output_ids"]}
            for g in loop["greedy"]["dspark_t0"]]


def train_config(deepspec: dict) -> TrainConfig:
    cli = {
        "speculator_type": "dspark", "verifier_name_or_path": VERIFIER, "draft_config": str(DEEPSPEC),
        "target_layer_ids": [i + 1 for i in deepspec["target_layer_ids"]],
        "mask_token_id": deepspec["mask_token_id"], "block_size": deepspec["block_size"],
        "draft_attn_impl": "eager", "loss_implementation": "eager",
        "markov_rank": deepspec["markov_rank"], "markov_head_type": deepspec["markov_head_type"],
        "enable_confidence_head": deepspec["enable_confidence_head"],
        "confidence_head_with_markov": deepspec["confidence_head_with_markov"],
        "epochs": 1, "save_path": NAME,
    }
    return TrainConfig.from_sources(cli=cli, argv=["python", "tests/golden/make_speculators_dspark_golden.py"])


def build() -> tuple[DSparkDraftModel, TrainConfig]:
    """The drafter as `speculators train --draft-config` constructs it, with the DeepSpec save's trained weights."""
    deepspec = json.loads((DEEPSPEC / "config.json").read_text())
    cfg = train_config(deepspec)
    args = cfg.flatten()
    layer_config = load_draft_transformer_layer_config(args["draft_config"], VERIFIER)
    args["draft_vocab_size"] = layer_config.vocab_size
    model = DSparkDraftModel.from_training_args(verifier_config=layer_config, **args)
    weights = {k: v for k, v in load_file(DEEPSPEC / "model.safetensors").items() if k not in SAVED_TOKEN_HEAD}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= VERIFIER_FILLED, (unexpected, missing)
    assert model.config.sample_from_anchor and model.markov_head is not None and model.confidence_head is not None
    return model.eval(), cfg


def write_run(model, cfg: TrainConfig) -> Path:
    root = Path(NAME)
    cfg.save(str(root))
    Trainer.maybe_save_checkpoint(fake_trainer(model, root), 0)  # the end-of-epoch save, 0/ and epoch0_end
    return root / "0"


@torch.no_grad()
def drafts_of(model, seq: dict, state: dict) -> dict:
    B = model.block_size
    ids = state["ids"]
    T = ids.shape[1]
    anchors = list(range(seq["prompt_len"] - 1, T - B))
    loss_mask = torch.zeros(1, T)
    loss_mask[0, anchors] = 1
    hidden, logits, _, _, idx = model._backbone_forward(
        hidden_states=aux_states(model, state), input_ids=ids, loss_mask=loss_mask,
        verifier_last_hidden_states=state["last"], document_ids=torch.zeros(1, T, dtype=torch.long),
        max_anchors=len(anchors))
    assert idx.view(-1, B)[:, 0].tolist() == anchors
    hidden, logits = hidden.view(len(anchors), B, -1), logits.view(len(anchors), B, -1)
    # DSparkDraftModel.forward's own steps (sample_from_anchor: slot k's previous token is the block's token k)
    block_tokens = ids[0, idx].view(len(anchors), B)
    previous = model.markov_head.prev_embeddings(block_tokens)
    biased = logits + model.markov_head.block_bias(prev_token_ids=block_tokens, hidden_states=hidden,
                                                   prev_emb=previous)
    confidence = model.confidence_head(torch.cat([hidden, previous.to(hidden.dtype)], dim=-1)).sigmoid()
    out = {"id": seq["id"], "first_anchor": anchors[0], "drafts": [], "teacher_forced": biased.argmax(-1).tolist(),
           "backbone": logits.argmax(-1).tolist(), "confidence": confidence.tolist(), "near_ties": []}
    for j, a in enumerate(anchors):  # the greedy walk from the anchor
        token, walk = block_tokens[j, :1], []
        for k in range(B):
            step = logits[j, k:k + 1] + model.markov_head.block_bias(prev_token_ids=token[:, None],
                                                                     hidden_states=hidden[j:j + 1, k:k + 1])[0]
            token = step.argmax(-1)
            walk.append(int(token))
            if (m := margin(step[0])) < NEAR_TIE:
                out["near_ties"].append([seq["id"], a, k, m])
        out["drafts"].append(walk)
    return out


def agreement(per_seq: list[dict], sequences: list[dict], key: str) -> dict:
    """Per slot: how often the draft equals the reference token it predicts (a + k + 1); the mean accepted prefix."""
    hits: dict[int, list[int]] = {}
    prefix = []
    for rec, seq in zip(per_seq, sequences, strict=True):
        for j, draft in enumerate(rec[key]):
            a = rec["first_anchor"] + j
            ok = [tok == seq["input_ids"][a + k + 1] for k, tok in enumerate(draft)]
            for k, o in enumerate(ok):
                hits.setdefault(k, []).append(int(o))
            prefix.append(next((k for k, o in enumerate(ok) if not o), len(ok)))
    return {"slot_accuracy": {str(s): round(sum(h) / len(h), 4) for s, h in sorted(hits.items())},
            "mean_accepted_prefix": round(sum(prefix) / len(prefix), 4), "blocks": len(prefix)}


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    started = time.time()
    sequences = load_sequences()
    states = target_states(sequences)  # (asserts each reference is the target's greedy continuation)
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir()
    os.chdir(OUT)  # the save's verifier path, ../dflash010/target, is resolved from here
    model, cfg = build()
    save = write_run(model, cfg)
    loaded = load_save(save)
    records = [drafts_of(loaded, seq, state) for seq, state in zip(sequences, states, strict=True)]
    config = json.loads((save / "config.json").read_text())
    golden = {
        "metadata": {
            "source": "speculators 0.9.0 (vLLM): load_draft_transformer_layer_config (--draft-config), TrainConfig, "
                      "DSparkDraftModel.from_training_args, Trainer.maybe_save_checkpoint; drafts by "
                      "SpeculatorModel.from_pretrained of the save, _backbone_forward, its markov_head and "
                      "confidence_head as DSparkDraftModel.forward applies them; "
                      "tests/golden/make_speculators_dspark_golden.py",
            "versions": {p: version(p) for p in ("speculators", "torch", "transformers", "safetensors")}
            | {"python": platform.python_version()},
            "verifier": {"path": "dflash010/target", "recorded_in_saves_as": VERIFIER,
                         "sha256": {"model.safetensors": sha256(TARGET / "model.safetensors")}},
            "drafter_from": {"deepspec/dspark/model.safetensors": sha256(DEEPSPEC / "model.safetensors")},
            "save": f"speculators_dspark/{NAME}/0",
            "config": {k: config.get(k) for k in (
                "speculators_model_type", "block_size", "mask_token_id", "aux_hidden_state_layer_ids",
                "sample_from_anchor", "markov_rank", "markov_head_type", "enable_confidence_head",
                "confidence_head_with_markov")},
            "anchor_convention": "anchor a = the block's first token's position; context = the target's hidden "
                                 "states before a; slot k drafts the token at a + k + 1 (k = 0..B-1); per_sequence[i] "
                                 "is sequences[i], its drafts[j] the block anchored at first_anchor + j (every a from "
                                 "prompt_len - 1 to len - B - 1)",
            "near_tie": NEAR_TIE,
            "agreement": {key: agreement(records, sequences, key) for key in ("drafts", "teacher_forced", "backbone")},
            "seconds": round(time.time() - started, 1),
        },
        "sequences": sequences,
        "per_sequence": records,
    }
    GOLDEN.write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    for key, value in golden["metadata"]["agreement"].items():
        print(f"{key}: per slot {value['slot_accuracy']}, mean accepted prefix {value['mean_accepted_prefix']} over "
              f"{value['blocks']} blocks")
    print(f"near ties {sum(len(r['near_ties']) for r in records)}; wrote {GOLDEN} in {golden['metadata']['seconds']}s")


if __name__ == "__main__":
    main()

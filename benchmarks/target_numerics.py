"""Where the target's numerics can change a tau, measured on the target family matrix (tests/golden/families/):

1. attention: the features under SDPA and under eager side by side (the largest difference, relative to the
   features' RMS) and the replay's steps over the same references with each (steps that differ, tau of each);
2. MoE routing: each token's experts when its block is verified in one forward with the cache (blocks of the
   drafter's size along the reference, as a step whose drafts all match verifies them) against the full
   teacher-forced forward that extracts the features, in float32 and in bfloat16: the share of (token, MoE layer)
   pairs routed to another expert set, and of positions whose greedy next token differs.

Each family's references are the greedy outputs z-lab's loop recorded (tests/golden/families_loop.json). Prints one
table per measurement (docs/targets.md quotes them):

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.target_numerics
"""

import json
from pathlib import Path

import torch

from dflash_core.drafter import load_drafter
from dflash_core.features import extract_features
from dflash_core.metrics import tau_macro
from dflash_core.replay import Reference, replay
from dflash_core.target import Target, choose_attention, load_target

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden"
FAMILIES = GOLDEN / "families"


def references(name: str) -> list[Reference]:
    runs = json.loads((GOLDEN / "families_loop.json").read_text())["families"][name]["greedy"]
    return [Reference(len(r["input_ids"]), r["input_ids"] + r["output_ids"]) for r in runs]


def attention_side_by_side(name: str) -> str | None:
    """One table row: SDPA against eager features and steps, float32; None for a target without SDPA."""
    target_dir = FAMILIES / name / "target"
    if choose_attention(target_dir) != "sdpa":
        return None
    refs, drafter = references(name), load_drafter(FAMILIES / name / "drafter")
    taus, steps, features = [], [], []
    for attention in ("sdpa", "eager"):
        target = load_target(target_dir, dtype=torch.float32, attention=attention)
        feats = extract_features(target, [r.token_ids for r in refs], drafter.target_layer_ids)
        results = replay(drafter, target.embed_weight, target.head_weight, refs, feats)
        features.append(feats)
        steps.append([list(zip(r.starts, r.acceptance_lengths)) for r in results])
        taus.append(tau_macro([r for r in results if r.acceptance_lengths]))
    relative = max(float((a - b).abs().max() / a.float().pow(2).mean().sqrt()) for a, b in zip(*features))
    differing = sum(a != b for a, b in zip(*steps))
    return f"| {name} | {relative:.1e} | {differing} of {len(refs)} | {taus[0]:.3f} / {taus[1]:.3f} |"


def routed_experts(target: Target, ref: Reference, block: int) -> tuple[list[list[frozenset]], list[list[frozenset]],
                                                                          int, int]:
    """Each MoE layer's expert sets per token ([layer][token]) from one teacher-forced forward and from block-by-block
    verification after the prompt's prefill, then how many completion positions' next-token argmax differs between
    the two, out of how many."""
    ids, prompt = list(ref.token_ids), ref.prompt_len
    routers = [m for _, m in target.backbone.named_modules() if type(m).__name__.lower().endswith("router")]
    seen: list[list[torch.Tensor]] = [[] for _ in routers]
    hooks = [r.register_forward_hook(lambda m, a, out, i=i: seen[i].append(out[2].detach()))
             for i, r in enumerate(routers)]
    try:
        full_logits = target.forward(torch.tensor([ids])).require_logits()[0]
        full = [[frozenset(row.tolist()) for row in s.pop()] for s in seen]
        cache = target.new_cache()
        pieces = [target.forward(torch.tensor([ids[:prompt]]), cache=cache).require_logits()[0]]
        for start in range(prompt, len(ids), block):
            pieces.append(target.forward(torch.tensor([ids[start:start + block]]), cache=cache).require_logits()[0])
        blocks = [[frozenset(row.tolist()) for step in s for row in step] for s in seen]
    finally:
        for h in hooks:
            h.remove()
    argmax_differs = int((torch.cat(pieces).argmax(-1) != full_logits.argmax(-1))[prompt - 1:].sum())
    return full, blocks, argmax_differs, len(ids) - prompt


def routing_row(name: str) -> str | None:
    target_dir = FAMILIES / name / "target"
    block = json.loads((FAMILIES / name / "drafter" / "config.json").read_text())["block_size"]
    cells = []
    for dtype in (torch.float32, torch.bfloat16):
        target = load_target(target_dir, dtype=dtype, attention=choose_attention(target_dir))
        if not any(type(m).__name__.lower().endswith("router") for m in target.backbone.modules()):
            return None
        rerouted = pairs = flipped = positions = 0
        for ref in references(name):
            full, blocks, differs, compared = routed_experts(target, ref, block)
            for layer_full, layer_blocks in zip(full, blocks):  # the completion's tokens (the blocks verified)
                rerouted += sum(a != b for a, b in zip(layer_full[ref.prompt_len:], layer_blocks[ref.prompt_len:]))
                pairs += len(layer_full) - ref.prompt_len
            flipped, positions = flipped + differs, positions + compared
        cells.append(f"{rerouted / pairs:.2%} ({rerouted} of {pairs}) | {flipped / positions:.2%}")
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    torch.set_num_threads(1)
    names = sorted(p.name for p in FAMILIES.iterdir() if p.is_dir())
    print("SDPA against eager, float32 (families whose text model takes SDPA):\n")
    print("| family | largest feature difference / RMS | prompts whose steps differ | tau SDPA / eager |")
    print("|---|---|---|---|")
    for name in names:
        if row := attention_side_by_side(name):
            print(row)
    print("\nBlock verification against teacher forcing, MoE targets (token, layer pairs routed to other experts | "
          "positions whose greedy next token differs):\n")
    print("| family | float32 rerouted | float32 argmax | bfloat16 rerouted | bfloat16 argmax |")
    print("|---|---|---|---|---|")
    for name in names:
        if row := routing_row(name):
            print(row)


if __name__ == "__main__":
    main()

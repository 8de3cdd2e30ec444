"""Core speed: offline replay vs the online loop, feature extraction vs a bare forward pass.

Builds, in memory, a ~100M-parameter Qwen3 target and a ~10M-parameter DFlash drafter (random
weights), then measures in one process and prints ratios against baselines run in the same process:

  replay vs online:  the same prompts decoded by speculative_decode (target in the loop) and replayed
                     offline from cached features (target: replay >= 10x faster once features exist)
  extraction vs forward: extract_features over the references vs the target's bare forward over the
                     same tokens (target: at most 1.15x)
  sampled:           the online loop at --temperature (SGLang's and vLLM's rejection rule), --samples
                     runs per prompt, vs the replay over what it emitted (the same >= 10x as greedy;
                     a sampled evaluation costs --samples times the references, features and replay)

Run: .venv/bin/python benchmarks/bench_core.py [--prompts 8] [--new-tokens 96] [--threads 2]
     [--temperature 0.6 --samples 2]
"""

import argparse
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_core.decoding import greedy_decode, speculative_decode
from dflash_core.drafter import DFlashDrafter
from dflash_core.drafter_config import DrafterConfig
from dflash_core.features import extract_features
from dflash_core.replay import Reference, replay
from dflash_core.sampling import Sampling
from dflash_core.target import Target


def build_models(vocab: int, block_size: int):
    torch.manual_seed(0)
    target_cfg = Qwen3Config(vocab_size=vocab, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                             num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                             max_position_embeddings=4096, tie_word_embeddings=False)
    target = Target.from_model(Qwen3ForCausalLM(target_cfg))
    layer_ids = [1, 5, 9]  # the DFlash fallback for 12 layers and 3 ids
    drafter_raw = {
        "hidden_size": 768, "num_hidden_layers": 1, "num_attention_heads": 12, "num_key_value_heads": 4,
        "head_dim": 64, "intermediate_size": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "block_size": block_size, "num_target_layers": 12,
        "dflash_config": {"target_layer_ids": layer_ids, "mask_token_id": vocab - 1},
    }
    drafter = DFlashDrafter(DrafterConfig.from_dict(drafter_raw)).eval()
    return target, drafter


def count(module) -> float:
    return sum(p.numel() for p in module.parameters()) / 1e6


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--samples", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, drafter = build_models(args.vocab, args.block_size)
    print(f"target {count(target.model):.0f}M params, drafter {count(drafter):.1f}M params, "
          f"{args.prompts} prompts x ({args.prompt_len} + {args.new_tokens}) tokens, block {args.block_size}, "
          f"{args.threads} threads")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, args.vocab - 1, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]

    references = [Reference(len(p), greedy_decode(target, p, args.new_tokens)) for p in prompts]
    sequences = [r.token_ids for r in references]

    online, t_online = timed(lambda: [speculative_decode(target, drafter, p, args.new_tokens) for p in prompts])
    features, t_extract = timed(lambda: extract_features(target, sequences, drafter.target_layer_ids))
    replayed, t_replay = timed(lambda: replay(drafter, target.embed_weight, target.head_weight, references, features))
    assert [r.acceptance_lengths for r in replayed] == [o.acceptance_lengths for o in online], "replay != online"

    def bare_forward(with_head):
        with torch.no_grad():
            for s in sequences:
                ids = torch.tensor([s])
                target.model(ids) if with_head else target.backbone(input_ids=ids)

    bare_forward(True)  # warm-up
    features, t_extract = timed(lambda: extract_features(target, sequences, drafter.target_layer_ids))
    _, t_forward = timed(lambda: bare_forward(True))
    _, t_backbone = timed(lambda: bare_forward(False))
    _, t_all_positions = timed(lambda: replay(drafter, target.embed_weight, target.head_weight, references,
                                              features, all_positions=True))

    steps = sum(len(o.acceptance_lengths) for o in online)
    print(f"online loop (target in the loop):  {t_online:7.2f} s  ({steps} steps)")
    print(f"offline replay, decode mode:       {t_replay:7.2f} s   -> {t_online / t_replay:5.1f}x faster than online")
    print(f"offline replay, all positions:     {t_all_positions:7.2f} s  ({sum(len(s) - r.prompt_len - 1 for s, r in zip(sequences, references))} blocks)")
    print(f"feature extraction (layers {drafter.target_layer_ids}): {t_extract:6.2f} s")
    print(f"bare forward with lm_head:         {t_forward:7.2f} s   -> extraction / forward = {t_extract / t_forward:.2f}x")
    print(f"bare backbone forward (no head):   {t_backbone:7.2f} s   -> extraction / backbone = {t_extract / t_backbone:.2f}x")

    sampling = Sampling(args.temperature, top_k=20, top_p=0.95)
    runs = [(p, k) for p in prompts for k in range(args.samples)]
    sampled, t_sampled = timed(lambda: [
        speculative_decode(target, drafter, p, args.new_tokens, sampling=sampling, rule="rejection",
                           generator=torch.Generator().manual_seed(k)) for p, k in runs])
    emitted = [Reference(o.prompt_len, o.output_ids) for o in sampled]
    emitted_features, t_sampled_extract = timed(
        lambda: extract_features(target, [r.token_ids for r in emitted], drafter.target_layer_ids))
    replayed, t_sampled_replay = timed(lambda: replay(drafter, target.embed_weight, target.head_weight, emitted,
                                                      emitted_features))
    assert [r.acceptance_lengths for r in replayed] == [o.acceptance_lengths for o in sampled], "replay != online"
    sampled_steps = sum(len(o.acceptance_lengths) for o in sampled)
    print(f"online loop, {sampling.describe()}, {args.samples} per prompt: {t_sampled:7.2f} s  ({sampled_steps} steps)")
    print(f"offline replay of its output:      {t_sampled_replay:7.2f} s   -> {t_sampled / t_sampled_replay:5.1f}x "
          f"faster than online; per sample {t_sampled_replay / args.samples:.2f} s of replay, "
          f"{t_sampled_extract / args.samples:.2f} s of extraction")


if __name__ == "__main__":
    main()

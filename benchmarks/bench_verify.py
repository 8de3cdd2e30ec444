"""What verifying every read costs the drafts stage: sha256 of each feature array against its marker
(FeatureReader, VERIFY_READS) and, for a checkpoint fetched by an earlier run (a cache hit: one fetched
by this run was hashed at its commit), of the drafter checkpoint's files before loading them.

Measures, in one process, the drafts stage's own work at a realistic-ish shape (random weights; the
defaults are a 2-layer drafter of hidden size 1024 over 5 target layers, a 32k vocabulary, block 16,
prompts of 256 tokens with completions of 256, float32 features, which are twice the bytes of bf16
ones to hash): reading the features of every prompt from the store without and with verification
(best of 3, warm page cache), the replay itself, and hashing the drafter's safetensors. Prints
verification's extra time as a fraction of the stage without it.

A random drafter accepts almost nothing (tau ~ 1), so the replay drafts one block per completion
token; a trained one with tau 4-6 drafts 4-6x fewer blocks while reading the same features, so the
fraction is also printed for such a tau (replay time scaled by measured tau / tau). Smaller shapes
(hidden size, vocabulary, drafter layers) make the replay cheaper per feature byte, so they overstate
the fraction: the defaults are on the small side of real drafters (hidden 2560-5120, vocabulary 152k).
The weights are hashed once per stage, so their share also shrinks with the number of prompts (4 here,
hundreds in a real evaluation). Measured on CPUs: on a GPU the replay is far faster while hashing stays
on the CPU (~1.7 GB/s with SHA-NI), so measure there before relying on the fraction.

Run: .venv/bin/python benchmarks/bench_verify.py [--hidden 1024] [--vocab 32768] [--sequences 4]
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch

from dflash_core.drafter import DFlashDrafter, save_drafter
from dflash_core.drafter_config import DrafterConfig
from dflash_core.replay import Reference, replay
from dflash_eval.storage import file_sha256
from dflash_eval.storage.feature_store import FeatureStore


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--drafter-layers", type=int, default=2)
    parser.add_argument("--target-layers", type=int, default=5, help="feature layers the drafter reads")
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    H, V, K = args.hidden, args.vocab, args.target_layers
    layer_ids = list(range(1, 2 * K, 2))
    raw = {
        "hidden_size": H, "num_hidden_layers": args.drafter_layers, "num_attention_heads": H // 128,
        "num_key_value_heads": max(1, H // 512), "head_dim": 128, "intermediate_size": 3 * H, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "block_size": args.block, "num_target_layers": 2 * K + 2, "max_position_embeddings": 1 << 15,
        "dflash_config": {"target_layer_ids": layer_ids, "mask_token_id": V - 1},
    }
    drafter = DFlashDrafter(DrafterConfig.from_dict(raw)).eval()
    embed, head = torch.randn(V, H) * 0.02, torch.randn(V, H) * 0.02
    T = args.prompt + args.completion
    references = [Reference(args.prompt, torch.randint(0, V - 1, (T,)).tolist()) for _ in range(args.sequences)]

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        save_drafter(drafter, tmp / "drafter")
        features = FeatureStore(tmp / "features.zarr")
        for n in range(args.sequences):
            features.write_layers(layer_ids, n, torch.randn(K, T, H))
        feature_mb = sum(p.stat().st_size for p in (tmp / "features.zarr").rglob("c/*/*")) / 1e6

        def read(verify):
            return [features.read(layer_ids, n, verify=verify) for n in range(args.sequences)]

        read(True)  # page cache warm
        feats, t_read = min((timed(lambda: read(False)) for _ in range(3)), key=lambda r: r[1])
        _, t_read_verified = min((timed(lambda: read(True)) for _ in range(3)), key=lambda r: r[1])
        weights = tmp / "drafter" / "model.safetensors"
        _, t_hash_weights = min((timed(lambda: file_sha256(weights)) for _ in range(3)), key=lambda r: r[1])
        with torch.inference_mode():
            results, t_replay = timed(lambda: replay(drafter, embed, head, references, feats))
        weights_mb = weights.stat().st_size / 1e6

    steps = sum(len(r.acceptance_lengths) for r in results)
    tau = sum(sum(r.acceptance_lengths) for r in results) / steps
    print(f"shape: drafter {args.drafter_layers} layers, hidden {H}, vocab {V}, block {args.block}; "
          f"{K} feature layers; {args.sequences} prompts of {args.prompt} + {args.completion} tokens; "
          f"{args.threads} threads")
    print(f"features: {feature_mb:.0f} MB float32; drafter weights: {weights_mb:.0f} MB")
    print(f"read features    {t_read:7.3f} s   verified {t_read_verified:7.3f} s   (+{t_read_verified - t_read:.3f} s)")
    print(f"hash weights     {t_hash_weights:7.3f} s")
    print(f"replay           {t_replay:7.3f} s   ({steps} blocks, measured tau {tau:.2f})")
    features_extra = t_read_verified - t_read
    for label, stage in [(f"measured tau {tau:.2f}", t_read + t_replay)] + [
            (f"tau {t} (replay scaled by {tau:.2f}/{t})", t_read + t_replay * tau / t) for t in (4, 6)]:
        print(f"verification / drafts stage at {label}: features {features_extra / stage:.2%}; "
              f"+ weights {t_hash_weights / stage:.2%} if the checkpoint was fetched by an earlier run")
    # the weights are hashed once per stage: their share shrinks with the number of prompts drafted


if __name__ == "__main__":
    main()

"""The heavy stages at the Qwen3.6-27B shape, bf16, on this machine's CPU cores.

  drafts      the drafts stage's replay (dflash_core.replay) with the published Qwen3.6-27B drafter's
              shape: hidden 5120, 5 layers (4 sliding of window 2048, 1 full), 32 heads of 128, 4 kv
              heads, intermediate 17408, vocab 248320, block 16. Random weights, so every step accepts
              one token (one block per completion token). Prints GFLOP/s against a bf16 GEMM of the
              same shapes (the layer's projections at M = blocks per batch x block size), run in the
              same process: the share of the time spent in useful matrix work.
  extraction  feature extraction (dflash_core.features) over a few real-width Qwen3.5 text layers
              (hidden 5120: Gated DeltaNet linear attention x3, then full attention, as the target's
              64 layers repeat), against a bf16 GEMM of those layers' projections at the same M.
  long        one --long-tokens prompt (8k by default) through the same layers, then through the
              drafts stage: the peak memory of the longest prompts; off unless asked for (minutes).
  sampled     the drafts stage with sampled drafts (--draft-sample-method probabilistic) against greedy drafts,
              the same references in the same process: every start position is scored (one block per
              completion token, as random weights give greedy drafts too), the head at every draft position
              until one q cannot draft (q at the temperature only: every position, the worst case; with top-k
              20 and top-p 0.95: most blocks stop after the first), and the expectation's dynamic programming.
              The target's probabilities of the tokens are drawn uniform in [0.05, 1].
  dflash2     the drafts stage (the replay call, as drafts times it) of a DFlash2 drafter at the published
              Qwen3.8-27B-DFlash2 shape (docs/real-scale.md: hidden 5120, 5 layers all sliding of
              window 2048, non-causal within the block, 32 heads of 128, 8 kv heads, block 8, conv kernel 2,
              group 16, selector rank 256, top-K 16, vocab 248320; intermediate 17408 is not published, the
              Qwen3.6 drafter's is used) against a DFlash drafter with the same backbone (the same tensors,
              without the convolutions and selector), the same references and features, timed alternately in
              one process (--repeats each, the fastest kept). DFlash2's replay also replays its unary head
              alone and counts per-position selector hits. Two cases: random references (no draft accepted),
              and accepting ones, built from DFlash2's own greedy drafts over the features (its selector walk
              accepts every draft while its unary walk and DFlash, whose argmax is rarely the selector's draft,
              step a token at a time: the walks part). Prints DFlash2/DFlash of each (aim <= 1.3x); above it, or
              with --profile, where the time goes (backbone and convolutions, head, logits, selector, walks).
  dspark      the drafts stage (the replay call) of a DSpark drafter in DeepSpec's convention (Qwen3DSparkModel, its
              fields at the top level, block_size 7 with every slot drafting: up to 8 tokens a step; markov_rank 256
              vanilla and the confidence head reading the Markov embedding, as DeepSpec's released Qwen3 DSpark
              configs) on the Qwen3.6-27B drafter's backbone (the drafts stage's shape above), against a DFlash drafter
              holding the same backbone tensors (DFlashDraftModel read with drafts_from_anchor: the same 7 slots and
              8-token blocks, without the Markov and confidence heads), the same references and features, timed
              alternately in one process (--repeats each, the fastest kept), with a third run of DSpark at a confidence
              threshold of 0.5 (replay's verify_threshold: the walk goes on past the first rejected draft while the
              slots clear it). DSpark's replay also replays its backbone's argmax alone and counts per-position Markov
              hits. Two cases as dflash2's: random references, and accepting ones built from DSpark's own Markov walk
              over the features. Prints DSpark/DFlash of each (aim <= 1.15x), and at the threshold; above the aim,
              or with --profile, where the time goes (backbone, head matmuls, Markov head, confidence head, the walk past the
              rejected draft, walks).
  agreement   the drafts stage in bf16 against float32 on the same float32 features, with the tiny
              trained run (real acceptance; built or reused from ~/.cache/dflash-eval/tiny): fraction of
              identical acceptance lengths at every position, and the tau difference.

Each stage runs in a fresh child process of this script, so the peak RSS printed is that stage's
own. The drafts stage's FLOPs are the arithmetic it cannot do without (replay_gflop: work past a
block's first mismatch does not count); extraction's are counted by torch's FlopCounterMode (its
overhead is well under 1% here: a few thousand ops, each milliseconds long). Then the table
extrapolates a full evaluation to a box of C cores (assumptions printed with it).

Run: .venv/bin/python benchmarks/bench_realshape.py [--threads 2] [--refs 8] [--long-tokens 8192]
     [--stages drafts,extraction,agreement,sampled,dflash2,dspark,long] [--repeats 2] [--profile]
     DSpark against DFlash on a shared 2-core box: --stages dspark --threads 1 --refs 2 --repeats 2
"""

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

HIDDEN, VOCAB, BLOCK = 5120, 248320, 16
FEATURE_LAYERS = (1, 16, 31, 46, 61)


def real_shape_drafter(layers: int = 5, vocab: int = VOCAB, device="cpu", dtype=torch.bfloat16):
    """The published Qwen3.6-27B drafter's shape (sliding layers, then one full) with random weights (std
    0.02 normal, norms 1); fewer layers or a smaller vocabulary for smoke runs (benchmarks/gpu_check.py)."""
    from dflash_core.drafter import DFlashDrafter
    from dflash_core.drafter_config import DrafterConfig

    config = DrafterConfig.from_dict({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": HIDDEN,
        "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "intermediate_size": 17408, "rms_norm_eps": 1e-6, "rope_theta": 1e7, "max_position_embeddings": 262144,
        "vocab_size": vocab, "block_size": BLOCK, "num_target_layers": 64,
        "layer_types": ["sliding_attention"] * (layers - 1) + ["full_attention"], "sliding_window": 2048,
        "dflash_config": {"target_layer_ids": list(FEATURE_LAYERS), "mask_token_id": min(248070, vocab - 1)},
    }, source="the Qwen3.6-27B drafter shape")
    # built on the meta device, then filled in bf16 directly (a float32 init of 1.7B parameters is minutes)
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    drafter = drafter.to(dtype).to_empty(device=device).eval()
    drafter.rotary = Qwen3RotaryEmbedding(config.rope).to(device)  # float32 rope frequencies, as load_drafter keeps
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.02) if p.ndim == 2 else p.fill_(1.0)
    return drafter

TARGET_LAYERS = ["linear_attention"] * 3 + ["full_attention"]  # one repeat of Qwen3.6-27B's 64 layers
# Extraction's cost per token at 2k tokens against 512 (attention grows with length): measured here, one 8k
# prompt cost 1.38x per token what 4 x 512 did; interpolated linearly to 2k.
LONGER_AT_2K = 1.08


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def gemm_rate(shapes: list[tuple[int, int]], m: int, repeats: int = 3) -> float:
    """GFLOP/s of bf16 F.linear over `shapes` ([out, in] weights, as nn.Linear holds them) at M rows."""
    weights = [random_bf16(o, i) for o, i in shapes]
    x = {i: random_bf16(m, i, std=1.0) for _, i in shapes}
    for w in weights:  # warm-up
        F.linear(x[w.shape[1]], w)
    start = time.perf_counter()
    for _ in range(repeats):
        for w in weights:
            F.linear(x[w.shape[1]], w)
    seconds = (time.perf_counter() - start) / repeats
    return sum(2 * m * o * i for o, i in shapes) / seconds / 1e9


def counted(fn):
    """(result, seconds, GFLOP) of fn()."""
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        start = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - start
    return out, seconds, counter.get_total_flops() / 1e9


def random_bf16(*shape, std=0.02) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.bfloat16).normal_(0, std)


def random_case(n_refs: int, prompt_len: int, new_tokens: int):
    """(drafter, embedding, head, references, features) at the real shape, random, the replay warmed up."""
    torch.manual_seed(0)
    drafter = real_shape_drafter()
    embed, head, refs, features = random_inputs(n_refs, prompt_len, new_tokens, len(FEATURE_LAYERS))
    warm_up(drafter, embed, head, refs, features)
    return drafter, embed, head, refs, features


def random_inputs(n_refs: int, prompt_len: int, new_tokens: int, feature_layers: int):
    """(embedding, head, references, features): random, bf16, at the real width and vocabulary."""
    from dflash_core.replay import Reference

    embed, head = random_bf16(VOCAB, HIDDEN), random_bf16(VOCAB, HIDDEN)
    length = prompt_len + new_tokens
    refs = [Reference(prompt_len, torch.randint(0, VOCAB, (length,)).tolist()) for _ in range(n_refs)]
    features = [torch.randn(feature_layers, length, HIDDEN, dtype=torch.bfloat16) for _ in range(n_refs)]
    return embed, head, refs, features


def warm_up(drafter, embed, head, refs, features) -> None:
    """One short replay (two decode steps of the first reference)."""
    from dflash_core.replay import Reference, replay

    prompt_len = refs[0].prompt_len
    short = Reference(prompt_len, refs[0].token_ids[:prompt_len + 2])
    with torch.no_grad():
        replay(drafter, embed, head, [short], [features[0][:, :prompt_len + 2]])


def stage_drafts(n_refs: int, prompt_len: int, new_tokens: int) -> dict:
    from dflash_core.replay import replay

    drafter, embed, head, refs, features = random_case(n_refs, prompt_len, new_tokens)
    start = time.perf_counter()
    with torch.no_grad():
        results = replay(drafter, embed, head, refs, features)
    seconds = time.perf_counter() - start
    layer = drafter.layers[0]
    shapes = [tuple(m.weight.shape) for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                              layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                                              layer.mlp.down_proj)]
    rate = gemm_rate(shapes, m=min(n_refs, 64) * BLOCK)
    return {"seconds": seconds, "blocks": sum(len(r.acceptance_lengths) for r in results),
            "gflop": replay_gflop(drafter.cfg, refs, results, VOCAB), "gemm_gflops": rate, "peak_rss_gb": peak_rss_gb()}


def stage_sampled(n_refs: int, prompt_len: int, new_tokens: int) -> dict:
    from dflash_core.replay import replay
    from dflash_core.sampled_drafts import SampledDrafts
    from dflash_core.sampling import Sampling

    drafter, embed, head, refs, features = random_case(n_refs, prompt_len, new_tokens)
    probs = [0.05 + 0.95 * torch.rand(prompt_len + new_tokens) for _ in range(n_refs)]

    def timed(**kwargs) -> tuple[float, int]:
        start = time.perf_counter()
        with torch.no_grad():
            results = replay(drafter, embed, head, refs, features, **kwargs)
        return time.perf_counter() - start, sum(len(r.acceptance_lengths) for r in results)

    greedy_seconds, greedy_blocks = timed()
    sampled = []
    for q in (Sampling(0.6), Sampling(0.6, 20, 0.95)):
        seconds, _ = timed(sampled=SampledDrafts(q, probs, list(range(n_refs))))
        sampled.append({"q": q.describe(), "seconds": seconds, "blocks": n_refs * (new_tokens - 1)})
    return {"greedy_seconds": greedy_seconds, "greedy_blocks": greedy_blocks, "sampled": sampled,
            "peak_rss_gb": peak_rss_gb()}


# The published Qwen3.8-27B-DFlash2 drafter (docs/real-scale.md, "DFlash2's drafts stage"): 5 layers, all sliding
# of window 2048, top-level is_causal false, 32 / 8 heads of 128, block 8, target layers [5, 19, 33, 47, 61] of 64,
# conv kernel 2 and group 16, selector rank 256 and top-K 16. Its intermediate size is not published: the Qwen3.6-27B
# drafter's (17408) stands in.
DFLASH2_BLOCK = 8
DFLASH2_FEATURE_LAYERS = (5, 19, 33, 47, 61)
DFLASH2_FIELDS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
DFLASH2_AIM = 1.3  # DFlash2's drafts stage at most this many times DFlash's


def dflash2_shape_config(architecture: str, layers: int = 5, vocab: int = VOCAB):
    """The Qwen3.8-27B-DFlash2 drafter's config; with architecture DFlashDraftModel, the same backbone as DFlash."""
    from dflash_core.drafter_config import DrafterConfig

    dflash = {"target_layer_ids": list(DFLASH2_FEATURE_LAYERS), "mask_token_id": min(248070, vocab - 1),
              **(DFLASH2_FIELDS if architecture == "DFlash2DraftModel" else {})}
    return DrafterConfig.from_dict({
        "architectures": [architecture], "model_type": "qwen3", "hidden_size": HIDDEN,
        "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 17408, "rms_norm_eps": 1e-6, "rope_theta": 1e7, "max_position_embeddings": 262144,
        "vocab_size": vocab, "block_size": DFLASH2_BLOCK, "num_target_layers": 64, "is_causal": False,
        "layer_types": ["sliding_attention"] * layers, "sliding_window": 2048, "dflash_config": dflash,
    }, source="the Qwen3.8-27B-DFlash2 drafter shape")


def dflash2_pair(layers: int = 5, vocab: int = VOCAB, device="cpu", dtype=torch.bfloat16):
    """(DFlash2 drafter, DFlash drafter) at the Qwen3.8-27B-DFlash2 shape, random (std 0.02 normal matrices, norms 1,
    convolutions' base taps 1 at offset 0 and small further back, codebooks std 1 normal as CandidateSelector starts
    them: the selector's choice then stands well clear of bf16's rounding, which at std 0.02 ties the top candidates
    and lets a block's batch change the choice). The DFlash drafter holds the DFlash2 one's backbone tensors
    themselves (no copy): the same weights, without convolutions and selector."""
    from dflash_core.drafter import DFlashDrafter

    with torch.device("meta"):  # filled in bf16 directly, as real_shape_drafter does
        dflash2 = DFlashDrafter(dflash2_shape_config("DFlash2DraftModel", layers, vocab), "non_causal")
        dflash = DFlashDrafter(dflash2_shape_config("DFlashDraftModel", layers, vocab), "non_causal")
    dflash2 = dflash2.to(dtype).to_empty(device=device).eval()
    with torch.no_grad():
        for name, p in dflash2.named_parameters():
            if name.endswith("base_kernel"):  # [2, kernel, H]
                p.normal_(0, 0.02)[:, 0] += 1.0
            elif name.endswith("codebook"):
                p.normal_(0, 1.0)
            elif name.endswith("kernel_projection.weight"):
                p.normal_(0, 0.002)
            elif p.ndim == 2:
                p.normal_(0, 0.02)
            else:
                p.fill_(1.0)
    shared = dflash2.state_dict()
    dflash.load_state_dict({name: shared[name] for name in dflash.state_dict()}, assign=True)
    dflash.eval()
    for drafter in (dflash2, dflash):  # float32 rope frequencies, as load_drafter keeps
        drafter.rotary = Qwen3RotaryEmbedding(drafter.cfg.rope).to(device)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(dflash.parameters(), (shared[n] for n, _ in
                                                                                  dflash.named_parameters())))
    return dflash2, dflash


# A DSpark drafter (DeepSpec's Qwen3DSparkModel) on the Qwen3.6-27B drafter's backbone (real_shape_drafter's shape:
# hidden 5120, 5 layers, 4 sliding of window 2048 and 1 full, 32 / 4 heads of 128, intermediate 17408), in DeepSpec's
# config layout: its fields at the top level, no dflash_config, block_size 7 with every slot drafting (7 drafts, up to
# 8 tokens a step). Its heads as DeepSpec's released Qwen3 DSpark configs (4B, 8B and 14B) give them: markov_rank 256,
# markov_head_type vanilla, the confidence head on, reading the Markov embedding too.
DSPARK_BLOCK = 7
DSPARK_FIELDS = {"markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
                 "confidence_head_with_markov": True}
DSPARK_AIM = 1.15  # DSpark's drafts stage at most this many times DFlash's
DSPARK_THRESHOLD = 0.5  # the confidence threshold of the third timed run (replay's verify_threshold)


def dspark_shape_config(architecture: str, layers: int = 5, vocab: int = VOCAB):
    """A DeepSpec DSpark drafter's config at the Qwen3.6-27B drafter's shape; with architecture DFlashDraftModel, the
    same backbone without the heads, read with drafts_from_anchor as DeepSpec's saves are (every slot drafts), so its
    blocks are DSpark's: 7 slots, up to 8 tokens a step."""
    import dataclasses

    from dflash_core.drafter_config import DrafterConfig

    dspark = architecture == "Qwen3DSparkModel"
    config = DrafterConfig.from_dict({
        "architectures": [architecture], "model_type": "qwen3", "hidden_size": HIDDEN,
        "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "intermediate_size": 17408, "rms_norm_eps": 1e-6, "attention_bias": False, "hidden_act": "silu",
        "rope_parameters": {"rope_theta": 1e7, "rope_type": "default"}, "max_position_embeddings": 262144,
        "vocab_size": vocab, "block_size": DSPARK_BLOCK, "num_target_layers": 64,
        "target_layer_ids": list(FEATURE_LAYERS), "mask_token_id": min(248070, vocab - 1),
        "layer_types": ["sliding_attention"] * (layers - 1) + ["full_attention"], "sliding_window": 2048,
        "use_sliding_window": True, "dtype": "bfloat16", "tie_word_embeddings": False,
        **(DSPARK_FIELDS if dspark else {}),
    }, source=f"the Qwen3.6-27B drafter shape as a DeepSpec {architecture}")
    assert config.drafts_from_anchor == dspark
    return config if dspark else dataclasses.replace(config, drafts_from_anchor=True)


def dspark_pair(layers: int = 5, vocab: int = VOCAB, device="cpu", dtype=torch.bfloat16):
    """(DSpark drafter, DFlash drafter) at the Qwen3.6-27B drafter's shape, random: std 0.02 normal matrices, norms 1,
    as real_shape_drafter; the Markov embedding markov_w1 std 1 and markov_w2 std 0.5 (the bias of a slot's logits
    about std 8 against the backbone's 1.4: the Markov walk's drafts stand clear of bf16's rounding, and of the
    backbone's argmax, which rarely is the walk's draft); the confidence head's bias 0 (each slot clears a 0.5
    threshold about half the time). The DFlash drafter (DFlashDraftModel, drafts_from_anchor) holds the DSpark one's
    backbone tensors themselves (no copy): the same weights and blocks, without the Markov and confidence heads."""
    from dflash_core.drafter import DFlashDrafter

    with torch.device("meta"):  # filled in bf16 directly, as real_shape_drafter does
        dspark = DFlashDrafter(dspark_shape_config("Qwen3DSparkModel", layers, vocab))
        dflash = DFlashDrafter(dspark_shape_config("DFlashDraftModel", layers, vocab))
    dspark = dspark.to(dtype).to_empty(device=device).eval()
    with torch.no_grad():
        for name, p in dspark.named_parameters():
            if name == "markov_head.markov_w1.weight":
                p.normal_(0, 1.0)
            elif name == "markov_head.markov_w2.weight":
                p.normal_(0, 0.5)
            elif name == "confidence_head.proj.bias":
                p.zero_()
            elif p.ndim == 2:
                p.normal_(0, 0.02)
            else:
                p.fill_(1.0)
    shared = dspark.state_dict()
    assert set(shared) - set(dflash.state_dict()) == {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                                                      "confidence_head.proj.weight", "confidence_head.proj.bias"}
    dflash.load_state_dict({name: shared[name] for name in dflash.state_dict()}, assign=True)
    dflash.eval()
    for drafter in (dspark, dflash):  # float32 rope frequencies, as load_drafter keeps
        drafter.rotary = Qwen3RotaryEmbedding(drafter.cfg.rope).to(device)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(dflash.parameters(), (shared[n] for n, _ in
                                                                                  dflash.named_parameters())))
    assert dspark.block_size == dflash.block_size and dspark.cfg.drafts_from_anchor and dflash.cfg.drafts_from_anchor
    return dspark, dflash


class ReplayProfile:
    """Inclusive seconds in the replay's parts, by wrapping them (class attributes, restored on exit). The wrappers
    cost microseconds a call; the parts they time cost milliseconds."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.blocks = 0
        self._restore: list = []

    def _add(self, label: str, seconds: float) -> None:
        self.seconds[label] = self.seconds.get(label, 0.0) + seconds
        self.calls[label] = self.calls.get(label, 0) + 1

    def _wrap(self, owner, attribute: str, label: str) -> None:
        original = owner.__dict__[attribute]
        function = original.__func__ if isinstance(original, staticmethod) else original

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._add(label, time.perf_counter() - start)
        setattr(owner, attribute, staticmethod(timed) if isinstance(original, staticmethod) else timed)
        self._restore.append((owner, attribute, original))

    def __enter__(self):
        from dflash_core import drafter as d
        from dflash_core import replay as r
        from dflash_core.generations import dflash2, dspark

        profile = self
        for owner, attribute, label in (
                (r.BlockScorer, "__init__", "context"), (r.BlockScorer, "_hidden", "hidden"),
                (r.BlockScorer, "_accept", "accept"), (r.BlockScorer, "_count_choices", "count_choices"),
                (d.DFlashDrafter, "forward", "forward"), (d.DFlashDrafter, "draft", "draft"),
                (d.DFlashDrafter, "_head", "head"), (d.DFlashDrafter, "_processed", "processed"),
                (dflash2.CandidateSelector, "forward", "selector"), (dflash2.DynamicConv, "convolve", "convolve"),
                (dspark.MarkovHead, "forward", "markov"), (dspark.DSpark, "confidences", "confidences")):
            self._wrap(owner, attribute, label)
        past = r.BlockScorer.__dict__["_verified_past_the_accepted"]

        def timed_past(*args, **kwargs):  # DSpark's walk past the first draft not accepted: its parts as "past <part>"
            before, calls, start = dict(profile.seconds), dict(profile.calls), time.perf_counter()
            try:
                return past(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                for label in [label for label in profile.calls if not label.startswith("past")]:
                    if profile.calls[label] != calls.get(label, 0):
                        profile.seconds["past " + label] = (profile.seconds.get("past " + label, 0.0)
                                                            + profile.seconds[label] - before.get(label, 0.0))
                        profile.calls["past " + label] = (profile.calls.get("past " + label, 0)
                                                          + profile.calls[label] - calls.get(label, 0))
                profile._add("past", elapsed)
        r.BlockScorer._verified_past_the_accepted = timed_past
        self._restore.append((r.BlockScorer, "_verified_past_the_accepted", past))
        around = dflash2.DynamicConv.__dict__["around"]

        def timed_around(conv, sublayer, x):  # the convolutions' own time: around, less its sublayer
            inner = 0.0

            def timed_sublayer(h):
                nonlocal inner
                start = time.perf_counter()
                try:
                    return sublayer(h)
                finally:
                    inner += time.perf_counter() - start
            start = time.perf_counter()
            try:
                return around(conv, timed_sublayer, x)
            finally:
                profile._add("conv", time.perf_counter() - start - inner)
        dflash2.DynamicConv.around = timed_around
        self._restore.append((dflash2.DynamicConv, "around", around))
        tokens = d.Drafts.__dict__["tokens"]

        def timed_tokens(drafts):
            start = time.perf_counter()
            try:
                return tokens.fget(drafts)
            finally:
                profile._add("tokens", time.perf_counter() - start)
        d.Drafts.tokens = property(timed_tokens)
        self._restore.append((d.Drafts, "tokens", tokens))
        score = r.BlockScorer.__dict__["score"]

        def counted_score(scorer, blocks, *args, **kwargs):
            profile.blocks += len(blocks)
            return score(scorer, blocks, *args, **kwargs)
        r.BlockScorer.score = counted_score
        self._restore.append((r.BlockScorer, "score", score))
        return self

    def __exit__(self, *exc):
        for owner, attribute, original in reversed(self._restore):
            setattr(owner, attribute, original)

    def parts(self, total: float) -> dict[str, float]:
        """Exclusive seconds per part of a replay that took `total`."""
        t = self.seconds.get
        conv, convolve, draft = t("conv", 0.0), t("convolve", 0.0), t("draft", 0.0)
        processed, selector, tokens = t("processed", 0.0), t("selector", 0.0), t("tokens", 0.0)
        return {
            "context keys/values (fc, k/v projections)": t("context", 0.0),
            "backbone layers (attention, MLP, norms)": t("forward", 0.0) - conv,
            "convolutions: kernel projections": conv - convolve,
            "convolutions: taps (convolve)": convolve,
            "block inputs (embeddings, padded context)": t("hidden", 0.0) - t("forward", 0.0),
            "head matmul + argmax": draft - processed - selector,
            "float32 logits for the selector": processed,
            "selector: top-K, codebooks, scores": selector,
            "selector walk: choosing drafts (Drafts.tokens)": tokens,
            "both walks' matching (_accept, less the above)": t("accept", 0.0) - draft - tokens - t("count_choices", 0.0),
            "selector_positions counts": t("count_choices", 0.0),
            "replay's decode loop and results": total - t("context", 0.0) - t("hidden", 0.0) - t("accept", 0.0),
        }

    def dspark_parts(self, total: float) -> dict[str, float]:
        """Exclusive seconds per part of a DSpark (or DFlash) replay that took `total`: the parts DSpark adds to DFlash's
        (the Markov head, the float32 logits it biases, the confidence head, the walk past the first draft not accepted
        under a verify threshold) apart from the backbone's."""
        t = self.seconds.get

        def walk(prefix: str) -> dict[str, float]:
            head, processed, markov = t(prefix + "head", 0.0), t(prefix + "processed", 0.0), t(prefix + "markov", 0.0)
            return {"head": head, "processed": processed, "markov": markov,
                    "rest": t(prefix + "draft", 0.0) - head - processed - markov,
                    "confidences": t(prefix + "confidences", 0.0), "tokens": t(prefix + "tokens", 0.0)}

        everything, past = walk(""), walk("past ")
        inside = {name: everything[name] - past[name] for name in everything}  # outside the walk past the accepted
        past_total = t("past", 0.0)
        return {
            "context keys/values (fc, k/v projections)": t("context", 0.0),
            "backbone layers (attention, MLP, norms)": t("forward", 0.0),
            "block inputs (embeddings, padded context)": t("hidden", 0.0) - t("forward", 0.0),
            "head matmul (hidden @ lm_head.T)": inside["head"],
            "float32 logits of the head (_processed)": inside["processed"],
            "Markov head (markov_w1 rows, markov_w2 to [.., V])": inside["markov"],
            "biased logits (+ bias), argmax (draft, less the above)": inside["rest"],
            "Markov walk's argmax (Drafts.tokens)": inside["tokens"],
            "confidence head (confidences)": inside["confidences"],
            "walk past the rejected draft: head matmul": past["head"],
            "walk past the rejected draft: float32 logits": past["processed"],
            "walk past the rejected draft: Markov head, + bias": past["markov"] + past["rest"],
            "walk past the rejected draft: argmax (tokens)": past["tokens"],
            "walk past the rejected draft: confidence head": past["confidences"],
            "walk past the rejected draft: the rest": past_total - sum(past.values()),
            "both walks' matching (_accept, less the above)": t("accept", 0.0) - t("draft", 0.0) - t("tokens", 0.0)
            - t("count_choices", 0.0) - t("confidences", 0.0) - past_total + t("past draft", 0.0)
            + t("past tokens", 0.0) + t("past confidences", 0.0),
            "markov_positions counts (_count_choices)": t("count_choices", 0.0),
            "replay's decode loop and results": total - t("context", 0.0) - t("hidden", 0.0) - t("accept", 0.0),
        }


def accepting_references(drafter, embed, head, refs, features) -> list:
    """refs rewritten so that the drafter's own greedy walk accepts every draft: from the prompt on, each block's B-1
    drafts, then the random token already there as the bonus. The features are random and do not depend on the
    tokens, and a block sees only its anchor and the context before it, so one batch per step drafts every
    reference's block (the scorer's tokens, filled in place, are the references so far). In bf16 a block's hidden
    states depend on the blocks batched with it (by up to 0.09 of 0.8 here), enough to change near-tied drafts, so
    each is drafted in the batch replay scores it in: beside the unary walk's blocks, one token further each step (the
    selector's draft is rarely the head's argmax)."""
    from dflash_core.replay import BlockScorer, Reference

    scorer = BlockScorer(drafter, embed, head, refs, features)
    prompt_len, length, B = refs[0].prompt_len, len(refs[0].token_ids), scorer.B
    for step, start in enumerate(range(prompt_len, length - 1, B)):
        blocks = sorted({(i, p) for i in range(len(refs)) for p in (start, prompt_len + step)}, key=lambda b: (b[1], b[0]))
        drafts = dict(zip(blocks, scorer.draft_tokens(blocks)))
        for i, tokens in enumerate(scorer.tokens):
            tokens[start + 1:start + B] = torch.tensor(drafts[(i, start)][:length - start - 1])
    return [Reference(ref.prompt_len, tokens.tolist()) for ref, tokens in zip(refs, scorer.tokens)]


def stage_dflash2(n_refs: int, prompt_len: int, new_tokens: int, repeats: int, profile: bool) -> dict:
    torch.manual_seed(0)
    dflash2, dflash = dflash2_pair()
    embed, head, refs, features = random_inputs(n_refs, prompt_len, new_tokens, len(DFLASH2_FEATURE_LAYERS))
    drafters = {"DFlash": dflash, "DFlash2": dflash2}
    for drafter in drafters.values():
        warm_up(drafter, embed, head, refs, features)
    start = time.perf_counter()
    accepting = accepting_references(dflash2, embed, head, refs, features)
    out = {"building_seconds": time.perf_counter() - start}
    for case, case_refs in (("random", refs), ("accepting", accepting)):
        out[case] = dflash2_case(drafters, embed, head, case_refs, features, repeats, profile)
    out["peak_rss_gb"] = peak_rss_gb()
    return out


def dflash2_case(drafters: dict, embed, head, refs, features, repeats: int, profile: bool) -> dict:
    """Both drafters' replays of refs, timed alternately (the fastest of repeats kept); their steps, blocks and taus;
    where the time goes when asked for or above the aim."""
    from dflash_core.replay import replay

    def timed(drafter) -> tuple[float, list]:
        start = time.perf_counter()
        with torch.no_grad():
            results = replay(drafter, embed, head, refs, features)
        return time.perf_counter() - start, results

    def tau(results) -> float:
        return sum(map(sum, (r.acceptance_lengths for r in results))) / sum(len(r.acceptance_lengths) for r in results)

    seconds: dict[str, list[float]] = {name: [] for name in drafters}
    results = {}
    for _ in range(repeats):  # alternately, so another process's load falls on both alike
        for name, drafter in drafters.items():
            elapsed, results[name] = timed(drafter)
            seconds[name].append(elapsed)
    out = {"seconds": seconds, "ratio": min(seconds["DFlash2"]) / min(seconds["DFlash"]),
           "blocks": sum(len(r.acceptance_lengths) for r in results["DFlash"]),
           "dflash2_blocks": sum(len(r.acceptance_lengths) for r in results["DFlash2"]),
           "unary_blocks": sum(len(r.base.acceptance_lengths) for r in results["DFlash2"]),
           "scored_blocks": sum(len(set(r.starts) | set(r.base.starts)) for r in results["DFlash2"]),
           "taus": {name: tau(rs) for name, rs in results.items()},
           "unary_tau": tau([r.base for r in results["DFlash2"]])}
    if profile or out["ratio"] > DFLASH2_AIM:
        out["profile"] = {}
        for name, drafter in drafters.items():
            with ReplayProfile() as p:
                elapsed, _ = timed(drafter)
            out["profile"][name] = {"seconds": elapsed, "blocks_scored": p.blocks, "parts": p.parts(elapsed),
                                    "calls": p.calls}
    return out


def dflash2_lines(found: dict, args) -> list[str]:
    lines = [f"dflash2: the drafts stage (replay) at the Qwen3.8-27B-DFlash2 shape, {args.refs} references x "
             f"({args.prompt_len} + {args.new_tokens}) tokens, block {DFLASH2_BLOCK}, fastest of {args.repeats}; "
             f"peak RSS {found['peak_rss_gb']:.1f} GB"]
    for case, title in (("random", "random references (no draft accepted)"),
                        ("accepting", f"accepting references (DFlash2's selector walk accepts every draft; built in "
                                      f"{found['building_seconds']:.1f} s)")):
        d = found[case]
        best = {name: min(times) for name, times in d["seconds"].items()}
        lines.append(f"  {title}:")
        for name, label in (("DFlash", "DFlash  (same backbone)"), ("DFlash2", "DFlash2 (selector + unary walk)")):
            steps, blocks = (d["blocks"], d["blocks"]) if name == "DFlash" else (d["dflash2_blocks"], d["scored_blocks"])
            unary = f"; unary walk {d['unary_blocks']} steps, tau {d['unary_tau']:.2f}" if name == "DFlash2" else ""
            lines.append(f"    {label}: {best[name]:.2f} s ({', '.join(f'{t:.2f}' for t in d['seconds'][name])}); "
                         f"{steps} steps, tau {d['taus'][name]:.2f}, {best[name] / steps * 1e3:.0f} ms per step; "
                         f"{blocks} blocks scored, {best[name] / blocks * 1e3:.0f} ms per block{unary}")
        verdict = "within" if d["ratio"] <= DFLASH2_AIM else "ABOVE"
        per_block = best["DFlash2"] / d["scored_blocks"] / (best["DFlash"] / d["blocks"])
        lines.append(f"    DFlash2/DFlash: {d['ratio']:.2f}x ({verdict} the {DFLASH2_AIM}x aim); per scored block "
                     f"{per_block:.2f}x")
        if "profile" in d:
            lines.extend(profile_lines(d["profile"]))
    lines.append("  (random weights. Random references: no draft is accepted, so both walks start the same blocks and the\n"
                 "   head and selector run at position 1 only. Accepting references: DFlash2's selector walk accepts\n"
                 "   every draft, so its head and selector run at every position of its blocks, while its unary walk and\n"
                 "   DFlash, whose argmax is rarely the selector's draft, score a block at every start: the walks part as\n"
                 "   far as they can, the most a DFlash2 replay of these references can do. Per step: the replay's time\n"
                 "   over the steps of the drafter's own walk)")
    return lines


def profile_lines(prof: dict) -> list[str]:
    lines = ["    where the time goes (one more replay each, timed by part; exclusive seconds):",
             f"      {'part':<50} {'DFlash':>8} {'DFlash2':>8} {'extra':>8}"]
    extra_total = prof["DFlash2"]["seconds"] - prof["DFlash"]["seconds"]
    for part, v2 in prof["DFlash2"]["parts"].items():
        v1 = prof["DFlash"]["parts"][part]
        lines.append(f"      {part:<50} {v1:8.2f} {v2:8.2f} {v2 - v1:+8.2f}")
    lines.append(f"      {'total':<50} {prof['DFlash']['seconds']:8.2f} {prof['DFlash2']['seconds']:8.2f} "
                 f"{extra_total:+8.2f} (blocks scored {prof['DFlash']['blocks_scored']} and "
                 f"{prof['DFlash2']['blocks_scored']})")
    return lines


def stage_dspark(n_refs: int, prompt_len: int, new_tokens: int, repeats: int, profile: bool) -> dict:
    torch.manual_seed(0)
    dspark, dflash = dspark_pair()
    embed, head, refs, features = random_inputs(n_refs, prompt_len, new_tokens, len(FEATURE_LAYERS))
    for drafter in (dflash, dspark):
        warm_up(drafter, embed, head, refs, features)
    start = time.perf_counter()
    accepting = accepting_references(dspark, embed, head, refs, features)
    out = {"building_seconds": time.perf_counter() - start}
    for case, case_refs in (("random", refs), ("accepting", accepting)):
        out[case] = dspark_case(dspark, dflash, embed, head, case_refs, features, repeats, profile)
    out["peak_rss_gb"] = peak_rss_gb()
    return out


def dspark_case(dspark, dflash, embed, head, refs, features, repeats: int, profile: bool) -> dict:
    """DFlash's, DSpark's and DSpark's at the confidence threshold DSPARK_THRESHOLD replays of refs, timed alternately
    (the fastest of repeats kept); their steps, blocks scored, taus, verified drafts; where the time goes when asked
    for or above the aim."""
    from dflash_core.replay import replay

    runs = {"DFlash": (dflash, 0.0), "DSpark": (dspark, 0.0), f"DSpark t={DSPARK_THRESHOLD}": (dspark, DSPARK_THRESHOLD)}

    def timed(name: str) -> tuple[float, list]:
        drafter, threshold = runs[name]
        start = time.perf_counter()
        with torch.no_grad():
            results = replay(drafter, embed, head, refs, features, verify_threshold=threshold)
        return time.perf_counter() - start, results

    def tau(results) -> float:
        return sum(map(sum, (r.acceptance_lengths for r in results))) / sum(len(r.acceptance_lengths) for r in results)

    seconds: dict[str, list[float]] = {name: [] for name in runs}
    results = {}
    for _ in range(repeats):  # alternately, so another process's load falls on all alike
        for name in runs:
            elapsed, results[name] = timed(name)
            seconds[name].append(elapsed)
    best = {name: min(times) for name, times in seconds.items()}
    out = {"seconds": seconds,
           "ratios": {name: best[name] / best["DFlash"] for name in runs if name != "DFlash"},
           "steps": {name: sum(len(r.acceptance_lengths) for r in rs) for name, rs in results.items()},
           "scored_blocks": {name: sum(len(set(r.starts) | set(r.base.starts if r.base else ())) for r in rs)
                             for name, rs in results.items()},
           "taus": {name: tau(rs) for name, rs in results.items()},
           "backbone_tau": tau([r.base for r in results["DSpark"]]),
           "verified": {name: sum(map(sum, (r.verified_drafts for r in rs))) / sum(len(r.verified_drafts) for r in rs)
                        for name, rs in results.items() if rs[0].verified_drafts is not None}}
    if profile or out["ratios"]["DSpark"] > DSPARK_AIM:
        out["profile"] = {}
        for name in runs:
            with ReplayProfile() as p:
                elapsed, _ = timed(name)
            out["profile"][name] = {"seconds": elapsed, "blocks_scored": p.blocks, "parts": p.dspark_parts(elapsed),
                                    "calls": p.calls}
    return out


def dspark_lines(found: dict, args) -> list[str]:
    lines = [f"dspark: the drafts stage (replay) of a DSpark drafter (DeepSpec's Qwen3DSparkModel, markov_rank "
             f"{DSPARK_FIELDS['markov_rank']} vanilla, confidence head with Markov) on the Qwen3.6-27B drafter's backbone, "
             f"against DFlash with the same backbone tensors, {args.refs} references x ({args.prompt_len} + "
             f"{args.new_tokens}) tokens, {DSPARK_BLOCK} slots (every slot drafts: up to {DSPARK_BLOCK + 1} tokens a "
             f"step), fastest of {args.repeats}; peak RSS {found['peak_rss_gb']:.1f} GB"]
    threshold = f"DSpark t={DSPARK_THRESHOLD}"
    for case, title in (("random", "random references (no draft accepted)"),
                        ("accepting", f"accepting references (DSpark's Markov walk accepts every draft; built in "
                                      f"{found['building_seconds']:.1f} s)")):
        d = found[case]
        best = {name: min(times) for name, times in d["seconds"].items()}
        lines.append(f"  {title}:")
        for name, label in (("DFlash", "DFlash (same backbone)"), ("DSpark", "DSpark (Markov + backbone walk)"),
                            (threshold, f"DSpark, verify threshold {DSPARK_THRESHOLD}")):
            verified = f", {d['verified'][name]:.2f} drafts verified per step" if name in d["verified"] else ""
            backbone = f"; backbone walk tau {d['backbone_tau']:.2f}" if name == "DSpark" else ""
            lines.append(f"    {label}: {best[name]:.2f} s ({', '.join(f'{t:.2f}' for t in d['seconds'][name])}); "
                         f"{d['steps'][name]} steps, tau {d['taus'][name]:.2f}{verified}; {d['scored_blocks'][name]} "
                         f"blocks scored, {best[name] / d['scored_blocks'][name] * 1e3:.0f} ms per block{backbone}")
        for name, label in (("DSpark", "DSpark/DFlash"), (threshold, f"DSpark/DFlash at threshold {DSPARK_THRESHOLD}")):
            ratio = d["ratios"][name]
            per_block = ratio * d["scored_blocks"]["DFlash"] / d["scored_blocks"][name]
            # the aim is DSpark's against DFlash's as both are served by default; a threshold adds what DFlash never
            # does: the drafts each step verifies past its first rejected draft need the head at slots past it
            aim = (f"aim <= {DSPARK_AIM}x: {'within' if ratio <= DSPARK_AIM else 'ABOVE'}" if name == "DSpark"
                   else "no aim: it also counts the drafts verified past the first rejected one")
            lines.append(f"    {label}: {ratio:.2f}x ({aim}); per scored block {per_block:.2f}x")
        if "profile" in d:
            lines.extend(dspark_profile_lines(d["profile"]))
    lines.append("  (random weights, the Markov bias dominating the backbone's logits. Random references: no draft is\n"
                 "   accepted, so every walk starts the same blocks and the heads run at position 1 (at the threshold the\n"
                 "   walk goes on past the rejected draft while the slots clear it). Accepting references: DSpark's Markov\n"
                 "   walk accepts every draft, so its heads run at every position of its blocks, while its backbone walk\n"
                 "   and DFlash, whose argmax is rarely the walk's draft, score a block at every start: the most a DSpark\n"
                 "   replay of these references can do beyond DFlash's)")
    return lines


def dspark_profile_lines(prof: dict) -> list[str]:
    names = list(prof)
    lines = ["    where the time goes (one more replay each, timed by part; exclusive seconds):",
             f"      {'part':<56} " + " ".join(f"{n:>14}" for n in names)]
    for part in prof[names[0]]["parts"]:
        lines.append(f"      {part:<56} " + " ".join(f"{prof[n]['parts'][part]:14.2f}" for n in names))
    lines.append(f"      {'total':<56} " + " ".join(f"{prof[n]['seconds']:14.2f}" for n in names))
    lines.append(f"      {'blocks scored':<56} " + " ".join(f"{prof[n]['blocks_scored']:14d}" for n in names))
    for label, key in (("head matmuls (passes over lm_head)", "head"), ("  of them past the rejected draft", "past head"),
                       ("Markov head calls", "markov")):
        lines.append(f"      {label:<56} " + " ".join(f"{prof[n]['calls'].get(key, 0):14d}" for n in names))
    return lines


def replay_gflop(cfg, refs, results, vocab: int) -> float:
    """The arithmetic a replay cannot do without, in GFLOP: context projections once per reference; per
    block its layers and its attention over the context it sees, and the lm_head at the positions up to
    the first mismatch (positions past it cannot change the answer, so they count as waste)."""
    H, B, n_kv, hd, heads = cfg.hidden_size, cfg.block_size, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    per_token_layer = 2 * H * (heads * hd + 2 * n_kv * hd) + 2 * heads * hd * H + 6 * H * cfg.intermediate_size
    flop = 0
    for ref, result in zip(refs, results):
        context = len(ref.token_ids) - 1
        flop += 2 * context * (len(cfg.target_layer_ids) * H * H + cfg.num_layers * H * 2 * n_kv * hd)
        for start, step, rejected in zip(result.starts, result.acceptance_lengths, result.rejected_drafts):
            flop += cfg.num_layers * B * per_token_layer
            for kind in cfg.layer_types:
                seen = start if kind == "full_attention" else min(start, cfg.sliding_window)
                flop += 4 * B * heads * hd * (seen + B)
            compared = min(B - 1, len(ref.token_ids) - 1 - start)
            flop += 2 * H * vocab * (step if rejected != -1 else compared)
    return flop / 1e9


def real_target(layers: int):
    """A Qwen3.5 text model at Qwen3.6-27B's width with `layers` of its layers (random bf16 weights)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from dflash_core.target import Target

    config = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=17408, num_hidden_layers=layers,
        layer_types=(TARGET_LAYERS * layers)[:layers], num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=48, max_position_embeddings=262144, tie_word_embeddings=True,  # the head is not run
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = Qwen3_5ForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    return Target.from_model(model)


def linear_shapes(module: torch.nn.Module) -> list[tuple[int, int]]:
    return [tuple(m.weight.shape) for m in module.modules() if isinstance(m, torch.nn.Linear)]


def stage_extraction(n_prompts: int, tokens: int) -> dict:
    from dflash_core.features import extract_features

    target = real_target(len(TARGET_LAYERS))
    sequences = [torch.randint(0, VOCAB, (tokens,)) for _ in range(n_prompts)]
    layer_ids = list(range(len(TARGET_LAYERS)))
    extract_features(target, [s[:32] for s in sequences[:1]], layer_ids)  # warm-up
    _, seconds, gflop = counted(lambda: extract_features(target, sequences, layer_ids))
    per_type = {}
    for kind in ("linear_attention", "full_attention"):
        layer = target.backbone.layers[TARGET_LAYERS.index(kind)]
        per_type[kind] = linear_shapes(layer)
    m = min(n_prompts, 8) * tokens  # tasks/features.py extracts 8 sequences per forward pass
    shapes = [s for kind in TARGET_LAYERS for s in per_type[kind]]
    rate = gemm_rate(shapes, m=min(m, 1024), repeats=1)
    return {"seconds": seconds, "gflop": gflop, "gemm_gflops": rate, "tokens": n_prompts * tokens,
            "layers": len(TARGET_LAYERS), "peak_rss_gb": peak_rss_gb()}


def stage_agreement() -> dict:
    from dflash_core.decoding import greedy_decode
    from dflash_core.drafter import load_drafter
    from dflash_core.features import extract_features
    from dflash_core.replay import Reference, replay
    from dflash_core.target import load_target
    from dflash_eval.tiny.build import TinyBuildSettings, default_cache_root, tiny_run

    run = tiny_run(default_cache_root(), TinyBuildSettings(arch="qwen3"))
    target = load_target(run.target_dir, dtype=torch.float32)
    eos = json.loads((run.target_dir / "config.json").read_text())["eos_token_id"]
    prompts = [json.loads(line)["input_ids"] for line in run.prompts_file.read_text().splitlines()]
    max_new = run.record["settings"]["max_new_tokens"]
    refs = [Reference(len(p), greedy_decode(target, p, max_new, [eos])) for p in prompts]
    layer_ids = load_drafter(run.drafter_steps[-1]).target_layer_ids
    features = extract_features(target, [r.token_ids for r in refs], layer_ids)
    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        drafter = load_drafter(run.drafter_steps[-1], dtype=dtype)
        results = replay(drafter, target.embed_weight, target.head_weight, refs, features, all_positions=True)
        per_prompt = [sum(r.acceptance_lengths) / len(r.acceptance_lengths) for r in results]
        out[name] = {"all_positions": [a for r in results for a in r.all_positions],
                     "tau": sum(per_prompt) / len(per_prompt)}
    same = sum(a == b for a, b in zip(out["float32"]["all_positions"], out["bfloat16"]["all_positions"]))
    return {"positions": len(out["float32"]["all_positions"]), "identical": same,
            "tau_float32": out["float32"]["tau"], "tau_bfloat16": out["bfloat16"]["tau"], "peak_rss_gb": peak_rss_gb()}


def child(args) -> None:
    torch.set_num_threads(args.threads)
    if args.stage == "drafts":
        result = stage_drafts(args.refs, args.prompt_len, args.new_tokens)
    elif args.stage == "extraction":
        result = stage_extraction(args.extract_prompts, args.extract_tokens)
    elif args.stage == "long-extraction":
        result = stage_extraction(1, args.long_tokens)
    elif args.stage == "long-drafts":
        result = stage_drafts(1, args.long_tokens, args.new_tokens)
    elif args.stage == "sampled":
        result = stage_sampled(args.refs, args.prompt_len, args.new_tokens)
    elif args.stage == "dflash2":
        result = stage_dflash2(args.refs, args.prompt_len, args.new_tokens, args.repeats, args.profile)
    elif args.stage == "dspark":
        result = stage_dspark(args.refs, args.prompt_len, args.new_tokens, args.repeats, args.profile)
    else:
        result = stage_agreement()
    print("RESULT " + json.dumps(result))


def run_child(stage: str, argv: list[str]) -> dict:
    done = subprocess.run([sys.executable, __file__, "--stage", stage, *argv], capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"stage {stage} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def extrapolation(drafts: dict, extraction: dict, threads: int) -> str:
    """A full evaluation's cost on a C-core box, from the rates measured here."""
    per_token_layer = extraction["seconds"] / extraction["tokens"] / extraction["layers"]  # one repeat's mix
    per_block = drafts["seconds"] / drafts["blocks"]
    rows = ["| cores | extraction, 64 layers: 100 prompts x 1k tokens | 1k prompts x 2k tokens | "
            "drafts stage per checkpoint: 100 prompts x 1k tokens, tau 1 | at tau 5 |",
            "|---|---|---|---|---|"]
    for cores in (threads, 32, 64, 128):
        scale = threads / cores
        ext_small = per_token_layer * 64 * 100 * 1024 * scale
        ext_large = per_token_layer * 64 * 1000 * 2048 * scale * LONGER_AT_2K
        drafts_tau1 = per_block * 100 * 1024 * scale
        rows.append(f"| {cores} | {hours(ext_small)} | {hours(ext_large)} | {hours(drafts_tau1)} | "
                    f"{hours(drafts_tau1 / 5)} |")
    return "\n".join(rows)


def rate_line(result: dict) -> str:
    rate = result["gflop"] / result["seconds"]
    return (f"  {rate:.0f} GFLOP/s vs {result['gemm_gflops']:.0f} GFLOP/s bf16 GEMM of the same shapes: ratio "
            f"{rate / result['gemm_gflops']:.2f}; peak RSS {result['peak_rss_gb']:.1f} GB")


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--refs", type=int, default=8, help="references replayed together (drafts)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--extract-prompts", type=int, default=4)
    parser.add_argument("--extract-tokens", type=int, default=512)
    parser.add_argument("--long-tokens", type=int, default=8192)
    parser.add_argument("--stages", default="drafts,extraction,agreement")
    parser.add_argument("--repeats", type=int, default=2,
                        help="dflash2, dspark: timed replays of each drafter, alternately")
    parser.add_argument("--profile", action="store_true",
                        help="dflash2, dspark: where the time goes, whatever the ratio")
    parser.add_argument("--stage", help=argparse.SUPPRESS)  # a child process runs one stage
    args = parser.parse_args()
    if args.stage:
        return child(args)

    argv = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
            if name not in ("stage", "stages", "profile")] + (["--profile"] if args.profile else [])
    stages = [part for stage in args.stages.split(",") for part in
              (("long-extraction", "long-drafts") if stage == "long" else (stage,))]
    found = {stage: run_child(stage, argv) for stage in stages}
    print(f"{args.threads} threads, bf16\n")
    for stage, refs, prompt_len in (("drafts", args.refs, args.prompt_len), ("long-drafts", 1, args.long_tokens)):
        if stage in found:
            d = found[stage]
            print(f"{stage}: {refs} references x ({prompt_len} + {args.new_tokens}) tokens, {d['blocks']} blocks in "
                  f"{d['seconds']:.1f} s ({d['seconds'] / d['blocks'] * 1e3:.0f} ms per block)")
            print(rate_line(d) + " (target >= 0.75)")
    for stage in ("extraction", "long-extraction"):
        if stage in found:
            e = found[stage]
            print(f"{stage}: {e['layers']} layers (Gated DeltaNet x3 + full attention) over {e['tokens']} tokens in "
                  f"{e['seconds']:.1f} s ({e['tokens'] / e['seconds']:.0f} tokens/s through the {e['layers']} layers)")
            print(rate_line(e))
    if "sampled" in found:
        d = found["sampled"]
        print(f"greedy drafts: {d['greedy_blocks']} blocks in {d['greedy_seconds']:.1f} s "
              f"({d['greedy_seconds'] / d['greedy_blocks'] * 1e3:.0f} ms per block)")
        for q in d["sampled"]:
            print(f"sampled drafts, q {q['q']}: {q['blocks']} blocks in {q['seconds']:.1f} s "
                  f"({q['seconds'] / q['blocks'] * 1e3:.0f} ms per block): {q['seconds'] / d['greedy_seconds']:.2f}x "
                  "greedy drafts' time (for a trained drafter, greedy drafts score one block per step, sampled ones "
                  "one per token: tau x this)")
    if "dflash2" in found:
        print("\n".join(dflash2_lines(found["dflash2"], args)))
    if "dspark" in found:
        print("\n".join(dspark_lines(found["dspark"], args)))
    if "agreement" in found:
        a = found["agreement"]
        print(f"bf16 vs float32 drafts (tiny trained run, same float32 features): {a['identical']}/{a['positions']} "
              f"acceptance lengths identical ({a['identical'] / a['positions']:.1%}); tau {a['tau_float32']:.3f} "
              f"(float32) vs {a['tau_bfloat16']:.3f} (bf16), difference {a['tau_bfloat16'] - a['tau_float32']:+.3f}")
    if "drafts" in found and "extraction" in found:
        print("\nExtrapolated from these rates: linear in tokens, layers and cores (per-core throughput as here;\n"
              "a real box scales sub-linearly once memory bandwidth binds), 64 target layers in the 3:1 mix\n"
              "measured, +8% per token at 2k tokens (attention), drafts stage per block as measured (tau 5: 5x fewer blocks):\n")
        print(extrapolation(found["drafts"], found["extraction"], args.threads))


if __name__ == "__main__":
    main()

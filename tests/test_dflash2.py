"""DFlash2 drafters (z-lab's DFlash2DraftModel): a grouped dynamic convolution around every attention and MLP sublayer,
within the block, and a candidate selector that walks the unary head's top K from the anchor.

- The config's four DFlash2 fields are read (dflash_config first, then the top level) and required; the checkpoint's
  codebooks load as published (bare tensors) and as a trainer's nn.Embedding saves them (`.weight`), not both.
- The convolution is the formula written out (a loop over positions and taps, no code shared) and block-local.
- The replay equals the online loop with the target in it, step by step, on random and trained DFlash2 drafters; its
  unary replay equals the replay of the same drafter with its selector removed; its per-position counts equal a
  brute-force count over the steps taken; a trained selector changes drafts.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3ForCausalLM

from dflash_core.decoding import greedy_decode, speculative_decode
from dflash_core.drafter import DrafterError, load_drafter, save_drafter
from dflash_core.drafter_config import DrafterConfig, DrafterConfigWarning
from dflash_core.features import extract_features
from dflash_core.generations.dflash import DFlash
from dflash_core.generations.dflash2 import DFlash2, DynamicConv, shapes_of
from dflash_core.replay import BlockScorer, Reference, replay
from dflash_core.target import Target, load_target, read_target_config
from tests.drafters import drafter_config, random_drafter
from tests.tiny_models import qwen3_config

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 24
STOP = 3
DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5}


def dflash2_config(**kwargs) -> dict:
    raw = drafter_config(hidden_size=64, num_layers=2, block_size=6, layer_ids=(1, 2), mask_token_id=0,
                         vocab_size=VOCAB, architectures=["DFlash2DraftModel"], **kwargs)
    raw["dflash_config"].update(DFLASH2)
    return raw


def prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def qwen3_target():
    torch.manual_seed(0)
    return Target.from_model(Qwen3ForCausalLM(qwen3_config(vocab_size=VOCAB, num_hidden_layers=4, initializer_range=0.2)))


def references_of(target, prompt_list, max_new_tokens=40) -> list[Reference]:
    return [Reference(len(p), greedy_decode(target, p, max_new_tokens, stop_token_ids=[STOP])) for p in prompt_list]


# ---- the config and the checkpoint -------------------------------------------------------------


def test_the_four_fields_are_read_from_dflash_config_first_then_the_top_level():
    raw = dflash2_config()
    cfg = DrafterConfig.from_dict(raw)
    assert (cfg.architecture, cfg.generation.NAME) == ("DFlash2DraftModel", "DFlash2")
    shapes = shapes_of(cfg)
    assert (shapes.conv_kernel_size, shapes.conv_group_size, shapes.selector_rank, shapes.selector_top_k) == (3, 8, 6, 5)
    top = dflash2_config(selector_top_k=7)  # at the top level (as some exports write it) and in dflash_config
    with pytest.warns(DrafterConfigWarning, match="selector_top_k = 5 and top-level selector_top_k = 7 differ"):
        assert shapes_of(DrafterConfig.from_dict(top)).selector_top_k == 5
    del top["dflash_config"]["selector_top_k"]
    assert shapes_of(DrafterConfig.from_dict(top)).selector_top_k == 7
    assert DrafterConfig.from_dict(drafter_config()).generation.NAME == "DFlash"


@pytest.mark.parametrize("edit,message", [
    (lambda r: r["dflash_config"].pop("selector_rank"), "a DFlash2DraftModel needs dflash_config.selector_rank"),
    (lambda r: r["dflash_config"].update(conv_group_size=24), "conv_group_size 24 does not divide hidden_size 64"),
    (lambda r: r["dflash_config"].update(selector_top_k=25), "selector_top_k 25 exceeds vocab_size 24"),
    (lambda r: r["dflash_config"].update(conv_kernel_size=0), "conv_kernel_size"),
    (lambda r: r.pop("vocab_size"), "needs vocab_size"),
])
def test_a_dflash2_config_without_what_its_math_needs_is_refused_by_name(edit, message):
    raw = dflash2_config()
    edit(raw)
    with pytest.raises(DrafterError, match=message):
        DrafterConfig.from_dict(raw)


def test_codebooks_load_bare_as_published_and_with_weight_as_trainers_save_them(tmp_path):
    drafter = random_drafter(dflash2_config(), seed=3)
    save_drafter(drafter, tmp_path / "bare")
    names = load_file(tmp_path / "bare" / "model.safetensors").keys()
    assert set(DFlash2.KEY_RENAMES.values()) <= names and not set(DFlash2.KEY_RENAMES) & names  # the published contract: bare tensors
    assert {"layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight",
            "candidate_selector.hidden_projection.weight"} <= names

    embedding = tmp_path / "embedding"  # nn.Embedding's names, as a trainer's state dict holds them
    embedding.mkdir()
    (embedding / "config.json").write_text((tmp_path / "bare" / "config.json").read_text())
    weights = load_file(tmp_path / "bare" / "model.safetensors")
    save_file({next((e for e, b in DFlash2.KEY_RENAMES.items() if b == k), k): v for k, v in weights.items()},
              embedding / "model.safetensors")
    for folder in ("bare", "embedding"):
        loaded = load_drafter(tmp_path / folder)
        mine = dict(drafter.named_parameters())
        assert all(torch.equal(p, mine[name]) for name, p in loaded.named_parameters())

    both = tmp_path / "both"  # the two names of one codebook: which one is meant is not ours to guess
    both.mkdir()
    (both / "config.json").write_text((tmp_path / "bare" / "config.json").read_text())
    save_file({**weights, "candidate_selector.successor_codebook.weight": weights["candidate_selector.successor_codebook"].clone()},
              both / "model.safetensors")
    with pytest.raises(DrafterError, match=r"DFlash2DraftModel with 2 layers.*unexpected \['candidate_selector\."
                                           r"successor_codebook.weight'\]"):
        load_drafter(both)


def test_dflash_weights_under_a_dflash2_config_are_refused_with_what_is_missing(tmp_path):
    save_drafter(random_drafter(drafter_config(hidden_size=64, block_size=6, layer_ids=(1, 2), mask_token_id=0,
                                               vocab_size=VOCAB)), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dflash2_config()))
    with pytest.raises(DrafterError, match=r"do not match a DFlash2DraftModel.*missing \['candidate_selector"):
        load_drafter(tmp_path)


# ---- the convolution ---------------------------------------------------------------------------


def test_the_convolution_is_the_formula_within_the_block():
    torch.manual_seed(0)
    conv = DynamicConv(hidden_size=16, kernel_size=3, group_size=4)
    torch.nn.init.normal_(conv.base_kernel)
    N, B, H, G = 2, 5, 16, 4
    x = torch.randn(N, B, H)
    dynamic = torch.randn(N, B, 3, H // G)
    base = conv.base_kernel[0].detach()
    expected = torch.zeros(N, B, H)
    for n in range(N):
        for t in range(B):
            for o in range(3):
                if t - o < 0:
                    continue  # the taps never reach past the block's first position
                for c in range(H):
                    expected[n, t, c] += (base[o, c] + dynamic[n, t, o, c // G]) * x[n, t - o, c]
    torch.testing.assert_close(conv.convolve(x, dynamic, base), expected)

    # around(): the sublayer sees its convolved input, and position t depends on positions <= t only
    def sublayer(h):
        return h * 2

    y = conv.around(sublayer, x)
    changed = x.clone()
    changed[:, 3:] += 1.0
    assert torch.equal(conv.around(sublayer, changed)[:, :3], y[:, :3])
    assert not torch.equal(conv.around(sublayer, changed)[:, 3:], y[:, 3:])


# ---- the replay against the online loop ----------------------------------------------------------


def assert_replay_equals_online(target, drafter, prompt_list, max_new_tokens=40):
    refs = references_of(target, prompt_list, max_new_tokens)
    features = extract_features(target, [r.token_ids for r in refs], drafter.target_layer_ids)
    replayed = replay(drafter, target.embed_weight, target.head_weight, refs, features)
    lengths = []
    for p, ref, rp in zip(prompt_list, refs, replayed):
        on = speculative_decode(target, drafter, p, max_new_tokens, stop_token_ids=[STOP])
        assert on.output_ids == list(ref.token_ids), "speculative decoding must emit exactly the greedy continuation"
        assert (rp.starts, rp.acceptance_lengths) == (on.starts, on.acceptance_lengths)
        lengths += on.acceptance_lengths
    assert max(lengths) > 1 and min(lengths) == 1, f"acceptance lengths do not vary: {lengths}"
    return refs, features, replayed


@pytest.mark.parametrize("semantics", ["causal", "non_causal"])
def test_replay_equals_the_online_loop_step_by_step(qwen3_target, semantics):
    raw = dflash2_config(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    drafter = random_drafter(raw, seed=11, sliding_semantics=semantics, scale=3.0)
    assert_replay_equals_online(qwen3_target, drafter, prompts())


def test_the_unary_replay_is_the_same_drafter_with_its_selector_removed(qwen3_target):
    """ReplayResult.base: the steps the head's argmax alone would take as the drafts (the convolutions kept)."""
    drafter = random_drafter(dflash2_config(), seed=5, scale=3.0)
    refs, features, replayed = assert_replay_equals_online(qwen3_target, drafter, prompts(seed=1))
    del drafter.candidate_selector
    drafter.generation = DFlash()  # the backbone alone drafts: its argmax
    alone = replay(drafter, qwen3_target.embed_weight, qwen3_target.head_weight, refs, features)
    for r, a in zip(replayed, alone):
        assert (r.base.starts, r.base.acceptance_lengths) == (a.starts, a.acceptance_lengths)
        assert r.base.base is None and a.base is None
    assert any(r.acceptance_lengths != a.acceptance_lengths for r, a in zip(replayed, alone)), \
        "the selector never changed a step: the comparison proves nothing"


def test_selector_counts_equal_a_count_over_the_steps_taken(qwen3_target):
    """Per draft position, over the positions the decode steps compared: reached, the selector's draft accepted, the
    head's argmax equal to the reference, the reference among the K candidates; counted here block by block from the
    drafter's logits. The position a reference ends at is left out (metrics.position_counts leaves a clipped last
    step's last position out)."""
    drafter = random_drafter(dflash2_config(), seed=7, scale=3.0)
    refs = references_of(qwen3_target, prompts(seed=2))
    features = extract_features(qwen3_target, [r.token_ids for r in refs], drafter.target_layer_ids)
    replayed = replay(drafter, qwen3_target.embed_weight, qwen3_target.head_weight, refs, features)
    scorer = BlockScorer(drafter, qwen3_target.embed_weight, qwen3_target.head_weight, refs, features)
    B, K = drafter.block_size, shapes_of(drafter.cfg).selector_top_k
    counted = DFlash2.COUNTS
    totals = [0] * len(counted)
    for s, (ref, result) in enumerate(zip(refs, replayed)):
        expected = [[0] * len(counted) for _ in range(B - 1)]
        for start in result.starts:
            tokens = ref.token_ids
            (walk,) = scorer.draft_tokens([(s, start)])
            hidden = scorer._hidden([(s, start)], scorer._truth([(s, start)]))[0]  # [B, H]
            for k in range(1, min(B, len(tokens) - 1 - start)):
                logits = drafter.logits(hidden[k], qwen3_target.head_weight)
                truth = tokens[start + k]
                expected[k - 1] = [a + b for a, b in zip(expected[k - 1], [
                    1, walk[k - 1] == truth, int(logits.argmax()) == truth, truth in logits.topk(K).indices.tolist()])]
                if walk[k - 1] != truth:
                    break
        assert result.position_counts == expected
        totals = [t + sum(row[c] for row in expected) for c, t in enumerate(totals)]
    reached, selector, argmax, in_top_k = totals
    assert reached > selector > 0 and reached > argmax > 0 and in_top_k > selector and in_top_k > argmax


# ---- a trained DFlash2 drafter, online and through the pipeline -----------------------------------


@pytest.fixture(scope="module")
def trained(tiny_dflash2):
    prompts = [json.loads(line)["input_ids"] for line in tiny_dflash2.prompts.read_text().splitlines()]
    return (load_target(tiny_dflash2.target_dir, dtype=torch.float32), load_drafter(tiny_dflash2.drafter_steps[-1]),
            list(read_target_config(tiny_dflash2.target_dir).eos_token_ids), prompts)


@pytest.mark.slow
def test_a_trained_selector_drafts_what_the_online_loop_drafts_and_beats_its_head(trained):
    """On the trained tiny run: the replay takes the online loop's steps (long ones among them), and the selector's
    walk reaches a higher tau than the unary head's argmax alone on the same references."""
    from dflash_core.metrics import tau_macro

    target, drafter, eos, prompts = trained
    refs = [Reference(len(p), greedy_decode(target, p, 48, eos)) for p in prompts]
    features = extract_features(target, [r.token_ids for r in refs], drafter.target_layer_ids)
    replayed = replay(drafter, target.embed_weight, target.head_weight, refs, features)
    for p, r in zip(prompts, replayed):
        online = speculative_decode(target, drafter, p, 48, eos)
        assert (r.starts, r.acceptance_lengths) == (online.starts, online.acceptance_lengths)
    assert max(a for r in replayed for a in r.acceptance_lengths) == drafter.block_size
    selected, alone = tau_macro(replayed), tau_macro([r.base for r in replayed])
    assert selected > 3.0 and selected > alone, (selected, alone)


@pytest.mark.slow
def test_the_pipeline_reports_the_selector_beside_its_unary_head(dflash2_evaluated, trained):
    """A DFlash2 checkpoint through the flow: tau is the selector's walk; `selector` holds the unary head's tau, the
    lift and the per-position shares, each what the replay of the same references gives."""
    from dflash_core.metrics import tau_macro

    results = dflash2_evaluated.results[-1]  # the last save, on the same prompts as `trained`
    target, drafter, eos, prompts = trained
    refs = [Reference(len(p), greedy_decode(target, p, 64, eos)) for p in prompts]
    replayed = replay(drafter, target.embed_weight, target.head_weight, refs,
                      extract_features(target, [r.token_ids for r in refs], drafter.target_layer_ids))
    assert [p["acceptance_lengths"] for p in results["per_prompt"]] == [r.acceptance_lengths for r in replayed]
    selector = results["selector"]
    assert selector["unary_tau_macro"] == pytest.approx(tau_macro([r.base for r in replayed]))
    assert selector["lift"] == pytest.approx(results["tau_macro"] - selector["unary_tau_macro"])
    low, high = selector["lift_ci95"]
    assert low <= selector["lift"] <= high
    counts = selector["position_counts"]
    assert counts["reached"] == [sum(r.position_counts[k][0] for r in replayed) for k in range(drafter.block_size - 1)]
    for k, reached in enumerate(counts["reached"]):
        # the steps' own counts, less the positions a reference ends at (left out here, compared there)
        assert reached <= results["position_counts"]["reached"][k]
        assert counts["selector"][k] <= results["position_counts"]["accepted"][k]
        assert selector["selector_accuracy"][k] == pytest.approx(counts["selector"][k] / reached)
        assert selector["candidate_recall"][k] >= selector["selector_accuracy"][k]
        assert selector["candidate_recall"][k] >= selector["argmax_accuracy"][k]


@pytest.mark.slow
def test_a_specforge_save_of_a_dflash2_drafter_scores_as_its_folder_directly_and_through_a_relay(
        tiny_dflash2, tmp_path, prefect_api_url):
    """SpecForge's run layout (its 0.2.0 wheel's CheckpointManager.save; that wheel trains DFlash only, so the drafter
    module under `draft_model` is ours, in bf16, with its codebooks named as an nn.Embedding names them, as a
    trainer's module may): scored from the step folder with --drafter-config, and from a relay serving the run folder,
    it gives the published folder's acceptance lengths."""
    from specforge.training.checkpoint import CheckpointManager
    from specforge.training.strategies.base import DFlashTrainStrategy
    from torch import nn

    from dflash_eval.services.relay.server import RelayServer
    from tests.evaluations import run_evaluation

    trained_step = tiny_dflash2.drafter_steps[-1]
    wrapper = nn.Module()
    wrapper.draft_model = load_drafter(trained_step, dtype=torch.bfloat16)
    embedding_names = {bare: name for name, bare in DFlash2.KEY_RENAMES.items()}
    state = {embedding_names.get(name, name): tensor
             for name, tensor in DFlashTrainStrategy(wrapper).checkpoint_state_filter(wrapper.state_dict()).items()}
    assert "candidate_selector.successor_codebook.weight" in state
    out = tmp_path / "out"
    CheckpointManager(str(out), "run1").save({"draft_state_dict": state, "global_step": 400, "strategy": "dflash",
                                               "run_id": "run1", "world_size": 1}, 400)
    config = tmp_path / "draft_config.json"
    config.write_text((trained_step / "config.json").read_text())

    def evaluate(drafter, **kwargs) -> dict:
        return run_evaluation(target=str(tiny_dflash2.target_dir), drafter=str(drafter), prompts=str(tiny_dflash2.prompts),
                              max_new_tokens=32, store=str(tmp_path / "store"), dtype="bfloat16", **kwargs)

    folder = tmp_path / "published"  # the published format of the same bf16 weights
    save_drafter(load_drafter(trained_step, dtype=torch.bfloat16), folder)
    published = evaluate(folder)
    assert published["tau_macro"] > 2.5 and "selector" in published
    step = evaluate(out / "run1-step400", drafter_config=str(config))
    assert step["drafter"]["layout"] == "specforge" and step["drafter"]["step"] == 400
    assert [p["acceptance_lengths"] for p in step["per_prompt"]] == [p["acceptance_lengths"] for p in published["per_prompt"]]
    assert step["selector"] == published["selector"]

    (out / "config.json").write_text(config.read_text())  # a run folder holds its drafter config
    with RelayServer(out, state_dir=tmp_path / "relay", settle_seconds=0) as relay:
        relayed = evaluate(f"{relay.url}/run1-step400")
    assert relayed["drafter"]["key"] == step["drafter"]["key"] and relayed["stages"]["drafts"] == "cached"

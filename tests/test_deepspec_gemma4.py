"""DeepSpec's Gemma 4 DSpark drafter (github deepseek-ai/DeepSpec, afdfa7c: `Gemma4DSparkModel`) read and run by
dflash_core's own code (dflash_core/gemma4_backbone.py), against DeepSpec's own loop: a tiny random Gemma 4 target and
a drafter built, trained, saved and run greedily by DeepSpec's code (tests/golden/make_deepspec_gemma4_golden.py, in a
venv with DeepSpec's requirements: the models in tests/golden/deepspec_gemma4/, what its loop emitted in
tests/golden/deepspec_gemma4_loop.json). Nothing here imports DeepSpec.

- the save is read as DeepSpec built it: the Gemma 4 backbone (heads of global_head_dim, one key head that is also the
  value, proportional RoPE, four norms a layer and its layer_scalar, sqrt(hidden) on the embeddings, the logits'
  softcap), the DSpark heads, every slot drafting; DeepSpec's tensor shapes for the configs the tiny drafter does not
  use (keys and values apart, double-wide MLPs); Gemma 4's RMSNorm, RoPE and activation as transformers computes them;
- greedy, at confidence threshold 0 and at the recorded threshold (which shortens some steps): the replay over the
  target's greedy text (with the tokens past max_new_tokens that DeepSpec's last step verifies) takes every step
  DeepSpec's loop took, and drafts its blocks' drafts (the whole Markov walk) with its confidences; the online loop,
  target in the loop, takes its steps too (its last step clipped at max_new_tokens, as ours clips it);
- each Gemma 4 piece matters: without the embedding scale, the softcap or the layer scalars the steps are not
  DeepSpec's;
- configs DeepSpec's own model refuses (the MoE block, per-layer inputs) are refused in one line naming the field.
"""

import dataclasses
import json
import math
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash_core.decoding import decode, speculative_decode
from dflash_core.drafter import DFlashDrafter, load_drafter
from dflash_core.drafter_config import DrafterConfig, DrafterConfigWarning, DrafterError, read_drafter_config
from dflash_core.features import extract_features
from dflash_core.gemma4_backbone import MLP, RMSNorm, Rotary, shape_of
from dflash_core.generations.dspark import heads_of
from dflash_core.replay import BlockScorer, Reference, replay

pytestmark = pytest.mark.usefixtures("one_thread")

GOLDEN_DIR = Path(__file__).parent / "golden"
MODELS = GOLDEN_DIR / "deepspec_gemma4"
GOLDEN = json.loads((GOLDEN_DIR / "deepspec_gemma4_loop.json").read_text())
META = GOLDEN["metadata"]
SAVE = GOLDEN_DIR / META["models"]["drafter"]
PROMPTS = [p["input_ids"] for p in META["prompts"]]
THRESHOLD = META["threshold"]
SETTINGS = {"dspark_t0": 0.0, f"dspark_t{THRESHOLD:g}": THRESHOLD}  # recorded key -> confidence threshold


@pytest.fixture(scope="module")
def target():
    from dflash_core.target import load_target

    return load_target(MODELS / "target", dtype=torch.float32)


@pytest.fixture(scope="module")
def drafter():
    return load_drafter(SAVE)


def references(target, key: str) -> list[Reference]:
    """DeepSpec's greedy outputs of one setting, each checked to be the target's own greedy text, with the target's
    tokens past max_new_tokens (lookahead, up to a stop token) that its last step verified."""
    refs = []
    for prompt, run in zip(PROMPTS, GOLDEN["greedy"][key]):
        assert prompt + run["output_ids"] == decode(target, prompt, META["max_new_tokens"], META["stop_token_ids"])
        tokens = prompt + run["output_ids"] + run["lookahead"]
        refs.append(Reference(len(prompt), tokens, len(prompt) + len(run["output_ids"]) if run["lookahead"] else None))
    return refs


def deepspec_steps(key: str) -> list[list[tuple[int, int]]]:
    """Per run, DeepSpec's (start, acceptance length) steps that start before the output's last token (DeepSpec takes
    one more, from it, when the output is one token short of max_new_tokens; nothing is left to draft there)."""
    out = []
    for prompt, run in zip(PROMPTS, GOLDEN["greedy"][key]):
        end = len(prompt) + run["num_output_tokens"]
        starts = (len(prompt) + np.cumsum([0] + run["acceptance_lengths"][:-1])).tolist()
        out.append([(s, a) for s, a in zip(starts, run["acceptance_lengths"]) if s + 1 < end])
    return out


def steps_of(result) -> list[tuple[int, int]]:
    return list(zip(result.starts, result.acceptance_lengths))


def blocks_at_deepspec_s_steps(drafter, target, refs, features, runs) -> tuple[list, list[torch.Tensor]]:
    """Per run, our drafts (the greedy Markov walk from the anchor, all block_size of them) and confidences (each
    given the draft before it) of the block at each of DeepSpec's steps: [steps][block_size], [steps, block_size]."""
    scorer = BlockScorer(drafter, target.embed_weight, target.head_weight, refs, features)
    all_drafts, all_confidences = [], []
    for s, (ref, run, feats) in enumerate(zip(refs, runs, features)):
        starts = (ref.prompt_len + np.cumsum([0] + run["acceptance_lengths"][:-1])).tolist()
        drafts = scorer.draft_tokens([(s, p) for p in starts])
        anchors = torch.tensor([ref.token_ids[p] for p in starts])
        block = torch.full((len(starts), drafter.block_size), drafter.mask_token_id)
        block[:, 0] = anchors
        with torch.no_grad():
            hidden = drafter.forward_in_sequence(F.embedding(block, target.embed_weight), torch.tensor(starts),
                                                 drafter.context_kv(feats))
            previous = torch.cat([anchors[:, None], torch.tensor(drafts)[:, :-1]], dim=1)
            all_confidences.append(drafter.generation.confidences(drafter, hidden, previous))
        all_drafts.append(drafts)
    return all_drafts, all_confidences


def replayed(drafter, target, key: str, threshold: float):
    refs = references(target, key)
    features = extract_features(target, [r.token_ids for r in refs], drafter.target_layer_ids)
    return refs, features, replay(drafter, target.embed_weight, target.head_weight, refs, features,
                                  verify_threshold=threshold)


# ----------------------------------------------------------------------------------------------
# The save


def test_the_save_is_read_as_deepspec_built_it(target, drafter):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DrafterConfigWarning)  # every field of the save is read or known to not matter
        cfg = read_drafter_config(SAVE)
    raw = json.loads((SAVE / "config.json").read_text())
    assert (cfg.source_format, cfg.architecture, cfg.generation.NAME, cfg.backbone) == (
        "deepspec", "Gemma4DSparkModel", "DSpark", "gemma4")
    assert cfg.drafts_from_anchor and (cfg.block_size, cfg.verified_tokens(cfg.block_size)) == (7, 8)
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == (raw["global_head_dim"], 4, 1) != (raw["head_dim"], 4, 2)
    shape = shape_of(cfg)
    assert shape.k_eq_v and shape.intermediate_sizes == (raw["intermediate_size"],) * 2
    assert (shape.rope_type, shape.partial_rotary_factor) == ("proportional", 0.25)
    assert shape.embed_scale == math.sqrt(raw["hidden_size"]) and cfg.final_logit_softcapping == 2.0
    assert cfg.layer_types == ("full_attention", "full_attention") and cfg.is_causal is None
    heads = heads_of(cfg)
    assert (heads.markov_rank, heads.markov_head_type, heads.confidence_head, heads.confidence_with_markov) == (
        16, "vanilla", True, True)
    # every weight DeepSpec saved, the target's embedding and head beside (equal to the target's), none else
    from safetensors.torch import load_file

    saved = load_file(SAVE / "model.safetensors")
    assert sorted(drafter.state_dict()) == sorted(k for k in saved if k not in ("embed_tokens.weight", "lm_head.weight"))
    assert "layers.0.self_attn.v_proj.weight" not in saved and "layers.0.layer_scalar" in saved
    assert [float(layer.layer_scalar) for layer in drafter.layers] == META["models"]["layer_scalars"]
    assert torch.equal(drafter.saved_token_head["embed_tokens.weight"].float(), target.embed_weight)
    assert torch.equal(drafter.saved_token_head["lm_head.weight"].float(), target.head_weight)
    assert GOLDEN["greedy"]["dspark_t0"][0]["proposal_lengths"][0] == 7  # its loop verified 7 drafts a step


@pytest.mark.parametrize("variant", list(GOLDEN["shapes"]))
def test_deepspec_s_shapes_for_configs_the_tiny_drafter_does_not_use(variant, tmp_path):
    """attention_k_eq_v false (a v_proj, num_key_value_heads key heads), use_double_wide_mlp with a KV-shared layer
    (transformers 5.10.2 doubles the drafter's last layer's MLP): the tensors DeepSpec's model has."""
    recorded = GOLDEN["shapes"][variant]
    (tmp_path / "config.json").write_text(json.dumps(recorded["config"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DrafterConfigWarning)  # every field DeepSpec writes is known
        cfg = read_drafter_config(tmp_path)
    with torch.device("meta"):
        ours = {name: list(t.shape) for name, t in DFlashDrafter(cfg).state_dict().items()}
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    assert {**ours, "embed_tokens.weight": [vocab, hidden], "lm_head.weight": [vocab, hidden]} == recorded["shapes"]


def test_gemma4_s_norm_rope_and_mlp_are_transformers_own(target, drafter):
    """Gemma 4's RMSNorm (x * (mean(x^2) + eps)^-0.5 times the weight, not 1 + weight: transformers 5.24 and 5.10.2
    alike), the full-attention RoPE of the target's own text model, and its MLP activation, bit for bit."""
    from transformers.activations import ACT2FN
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    torch.manual_seed(0)
    x = torch.randn(3, 5, 96)
    for with_scale in (True, False):
        theirs, ours = Gemma4RMSNorm(96, eps=1e-6, with_scale=with_scale), RMSNorm(96, 1e-6, with_scale=with_scale)
        if with_scale:
            weight = torch.randn(96)
            theirs.weight.data.copy_(weight)
            ours.weight.data.copy_(weight)  # type: ignore[union-attr]
        assert torch.equal(theirs(x), ours(x))
    positions = torch.arange(40)[None]
    text_model = target.model.model.language_model
    cos, sin = text_model.rotary_emb(x, positions, layer_type="full_attention")
    ours_cos, ours_sin = Rotary(drafter.cfg)(x, positions)
    assert torch.equal(cos, ours_cos) and torch.equal(sin, ours_sin)
    mlp = MLP(96, 192)
    gated = mlp.gate_proj(x)
    assert torch.equal(mlp(x), mlp.down_proj(ACT2FN["gelu_pytorch_tanh"](gated) * mlp.up_proj(x)))
    assert drafter.cfg.raw["hidden_activation"] == target.text_config.hidden_activation == "gelu_pytorch_tanh"


def test_the_embedding_scale_is_rounded_to_the_dtype_as_gemma_s_embedding_rounds_it(drafter):
    x = torch.randn(2, 7, 96).to(torch.bfloat16)
    scaled = drafter.backbone.scale_embeddings(x, drafter.cfg)
    assert torch.equal(scaled, x * torch.tensor(math.sqrt(96)).to(torch.bfloat16))  # 9.8125, not 9.798
    assert not torch.equal(scaled, x * math.sqrt(96))


# ----------------------------------------------------------------------------------------------
# Greedy, step by step


@pytest.mark.slow
@pytest.mark.parametrize("key", SETTINGS)
def test_the_replay_takes_deepspec_s_steps_and_drafts_its_drafts(target, drafter, key):
    threshold = SETTINGS[key]
    refs, features, ours = replayed(drafter, target, key, threshold)
    expected = deepspec_steps(key)
    assert [steps_of(r) for r in ours] == expected
    runs = GOLDEN["greedy"][key]
    lengths = [a for steps in expected for _, a in steps]
    assert len(lengths) >= 150 and set(lengths) >= {1, 2, 3, 4, 8}  # steps of every kind, whole blocks accepted
    # every block's drafts (the whole Markov walk from the anchor) and confidences, as DeepSpec's loop drafted them
    drafts, confidences = blocks_at_deepspec_s_steps(drafter, target, refs, features, runs)
    for mine, theirs, confidence, run in zip(drafts, [run["drafts"] for run in runs], confidences, runs):
        assert mine == theirs
        torch.testing.assert_close(confidence, torch.tensor(run["confidences"]), rtol=0, atol=1e-5)
    if threshold:
        verified = [p for run in runs for p in run["proposal_lengths"]]
        assert sum(v < META["block_size"] for v in verified) >= 10  # the threshold shortens steps
        for r, run, steps in zip(ours, runs, expected):  # DeepSpec's drafts verified, where they decided the step
            for (start, accepted), mine, theirs in zip(steps, r.verified_drafts, run["proposal_lengths"]):
                assert mine == theirs or min(mine, theirs) >= accepted, (start, mine, theirs)
    else:
        assert all(r.verified_drafts is None for r in ours)


@pytest.mark.slow
@pytest.mark.parametrize("key", SETTINGS)
def test_the_online_loop_takes_deepspec_s_steps(target, drafter, key):
    max_new = META["max_new_tokens"]
    for prompt, run, steps in zip(PROMPTS, GOLDEN["greedy"][key], deepspec_steps(key)):
        online = speculative_decode(target, drafter, prompt, max_new, META["stop_token_ids"],
                                    verify_threshold=SETTINGS[key])
        assert online.output_ids == prompt + run["output_ids"]
        end = len(prompt) + max_new  # our loop clips its last step there; DeepSpec's takes it whole
        assert steps_of(online) == [(s, min(a, end - 1 - s)) for s, a in steps]


@pytest.mark.slow
@pytest.mark.parametrize("change", ["no embedding scale", "no softcap", "layer scalars 1", "no v_norm",
                                    "q and k norms 1 + weight"])
def test_each_gemma4_piece_matters(target, change):
    """Without what each piece does, the drafts or the confidences leave DeepSpec's: the golden case sees every one."""
    drafter = load_drafter(SAVE)
    if change == "no embedding scale":
        drafter.backbone = type(drafter.backbone)()
        drafter.backbone.scale_embeddings = lambda x, cfg: x  # type: ignore[method-assign]
    elif change == "no softcap":
        drafter.cfg = dataclasses.replace(drafter.cfg, final_logit_softcapping=None)
    elif change == "layer scalars 1":
        for layer in drafter.layers:
            layer.layer_scalar.fill_(1.0)
    elif change == "no v_norm":
        for layer in drafter.layers:
            layer.self_attn.v_norm = torch.nn.Identity()
    else:  # Gemma 3's convention (x * (1 + weight)), which Gemma 4's RMSNorm does not follow
        for layer in drafter.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.data += 1
    key = "dspark_t0"
    refs, features, ours = replayed(drafter, target, key, 0.0)
    runs = GOLDEN["greedy"][key]
    drafts, confidences = blocks_at_deepspec_s_steps(drafter, target, refs, features, runs)
    moved = max(float((c - torch.tensor(run["confidences"])).abs().max()) for c, run in zip(confidences, runs))
    assert [steps_of(r) for r in ours] != deepspec_steps(key) or drafts != [run["drafts"] for run in runs] \
        or moved > 1e-3, change


# ----------------------------------------------------------------------------------------------
# Bad input


def edited_save(tmp_path: Path, edit) -> Path:
    folder = tmp_path / "step"
    shutil.copytree(SAVE, folder)
    raw = json.loads((folder / "config.json").read_text())
    edit(raw)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize(("edit", "says"), [
    (lambda c: c.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
     "enable_moe_block = true: Gemma 4's MoE block, which DeepSpec's Gemma4DSparkModel does not build"),
    (lambda c: c.update(hidden_size_per_layer_input=16),
     "hidden_size_per_layer_input = 16: Gemma 4's per-layer inputs, which DeepSpec's Gemma4DSparkModel does not build"),
    (lambda c: c.pop("global_head_dim"), "a Gemma4DSparkModel config needs global_head_dim"),
    (lambda c: c.update(hidden_activation="silu"), "hidden_activation \"silu\""),
    (lambda c: c["rope_parameters"]["full_attention"].update(rope_type="yarn"),
     "rope_parameters.full_attention.rope_type \"yarn\""),
    (lambda c: c["rope_parameters"]["full_attention"].update(partial_rotary_factor=1.5),
     "rope_parameters.full_attention.partial_rotary_factor must be a number in (0, 1], got 1.5"),
    (lambda c: c.update(layer_types=["sliding_attention", "full_attention"]), "layer_types [\"sliding_attention\""),
    (lambda c: c.update(input_embedding_scale=8.0), "input_embedding_scale: a Gemma4DSparkModel scales"),
], ids=["moe block", "per-layer inputs", "no global_head_dim", "activation", "rope type", "rotary factor",
        "sliding layer", "embedding scale"])
def test_what_deepspec_s_model_does_not_build_is_refused_in_one_line(tmp_path, edit, says):
    with pytest.raises(DrafterError) as refused:
        read_drafter_config(edited_save(tmp_path, edit))
    message = str(refused.value)
    assert says in message and "\n" not in message and message.startswith(str(tmp_path / "step" / "config.json"))


@pytest.mark.parametrize(("edit", "field"), [
    (lambda c: c.update(enable_moe_block=True), "enable_moe_block"),
    (lambda c: c.update(hidden_size_per_layer_input=16), "hidden_size_per_layer_input"),
], ids=["moe block", "per-layer inputs"])
def test_the_cli_refuses_them_in_one_line_exit_2_and_no_store(tmp_path, edit, field):
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    store = tmp_path / "store"
    result = CliRunner().invoke(app, ["run", "--target", str(MODELS / "target"), "--drafter",
                                      str(edited_save(tmp_path, edit)), "--prompts", str(MODELS / "prompts.jsonl"),
                                      "--store", str(store)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert field in lines[0] and not store.exists()


def test_a_qwen3_style_config_keeps_its_backbone():
    raw = json.loads((GOLDEN_DIR / "deepspec" / "dspark" / "config.json").read_text())
    cfg = DrafterConfig.from_dict(raw)
    assert cfg.backbone == "qwen3" and cfg.backbone_fields == {} and cfg.rope is not None

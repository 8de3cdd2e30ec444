"""Drafters saved by vLLM's trainer library, speculators 0.9.0 (dflash_core.speculators_format), against what
speculators' own model drafts.

The saves in tests/golden/speculators/ are run folders written by speculators' own code (its trainer's checkpointer
and logger; tests/golden/make_speculators_golden.py, run once in a venv with the speculators wheel): a DFlash drafter
at the full vocabulary (two saves), one with a reduced vocabulary of 64 tokens (its own head and d2t/t2d), one whose
anchor slot drafts too (sample_from_anchor), and a DFlash2 one (two saves), against the DFlash golden case's target
(tests/golden/dflash010/target). tests/golden/speculators_golden.json holds what speculators' model drafted at every
block of the golden references:

- the config is read as the published one it describes (aux ids one lower, the reduced head, the anchor slot, the
  sliding semantics), and the refusal of draft_vocab_size no longer fires on a full-vocabulary save;
- the drafts equal speculators' own, block by block (except where its own logits were within 1e-3 of a tie);
- the replay equals the online loop with the target in it, step by step, for each drafter.
"""

import json
from pathlib import Path

import pytest
import torch

from dflash_core.decoding import greedy_decode, speculative_decode
from dflash_core.drafter import load_drafter
from dflash_core.drafter_config import DrafterError, read_drafter_config
from dflash_core.features import extract_features
from dflash_core.generations.dflash2 import shapes_of
from dflash_core.replay import BlockScorer, Reference, replay

pytestmark = pytest.mark.usefixtures("one_thread")

GOLDEN_DIR = Path(__file__).parent / "golden"
SAVES = GOLDEN_DIR / "speculators"
GOLDEN = json.loads((GOLDEN_DIR / "speculators_golden.json").read_text())
SEQUENCES = GOLDEN["sequences"]
DRAFTERS = list(GOLDEN["drafters"])  # dflash, dflash_reduced, dflash_anchor, dflash2
STOP = json.loads((GOLDEN_DIR / "dflash010_loop.json").read_text())["metadata"]["stop_token_ids"]
SAVED = [(name, save) for name in DRAFTERS for save in GOLDEN["drafters"][name]["saves"]]


@pytest.fixture(scope="module")
def target():
    from dflash_core.target import load_target

    return load_target(GOLDEN_DIR / "dflash010" / "target", dtype=torch.float32)


def test_a_speculators_config_is_read_as_the_published_one_it_describes():
    full = read_drafter_config(SAVES / "dflash" / "0")
    raw = json.loads((SAVES / "dflash" / "0" / "config.json").read_text())
    assert full.source_format == "speculators" and full.architecture == "DFlashDraftModel"
    assert list(full.target_layer_ids) == [i - 1 for i in raw["aux_hidden_state_layer_ids"]]  # hidden_states[L] = z-lab L-1
    assert full.draft_vocab_size is None  # full vocabulary: the target's head (the old refusal does not fire)
    assert (full.block_size, full.mask_token_id, full.sliding_semantics) == (8, raw["mask_token_id"], "causal")
    assert full.verifier_architectures == ("Qwen3ForCausalLM",)

    reduced = read_drafter_config(SAVES / "dflash_reduced" / "0")
    assert reduced.draft_vocab_size == 64
    anchor = read_drafter_config(SAVES / "dflash_anchor" / "0")
    assert anchor.drafts_from_anchor and anchor.verified_tokens(8) == 9
    dflash2 = read_drafter_config(SAVES / "dflash2" / "0")
    assert dflash2.generation.NAME == "DFlash2" and dflash2.sliding_semantics == "non_causal"
    assert (shapes_of(dflash2).conv_kernel_size, shapes_of(dflash2).selector_top_k) == (2, 16)


@pytest.mark.parametrize("edit,message", [
    (lambda r: r.update(aux_hidden_state_layer_ids=[0, 2]), "id 0 is the target's embeddings"),
    (lambda r: r.update(speculators_model_type="eagle3"), "speculators_model_type 'eagle3'"),
    (lambda r: r.update(draft_vocab_size=64), "a DFlash2 selector chooses among the full vocabulary"),
    (lambda r: r.update(some_new_switch=True), r"speculators fields \['some_new_switch'\] are not read"),
    (lambda r: r["transformer_layer_config"].update(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_what_a_speculators_config_says_and_is_not_computed_here_is_refused_by_name(tmp_path, edit, message):
    raw = json.loads((SAVES / "dflash2" / "0" / "config.json").read_text())
    edit(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DrafterError, match=message):
        read_drafter_config(tmp_path)


@pytest.mark.parametrize("name,save", SAVED, ids=[f"{n}-{s}" for n, s in SAVED])
def test_the_drafts_equal_what_speculators_own_model_drafts(target, name, save):
    drafter = load_drafter(SAVES / name / save)
    recorded = GOLDEN["drafters"][name]["saves"][save]
    near_ties = {(seq, anchor, slot) for seq, anchor, slot, _ in recorded["near_ties"]}
    refs = [Reference(s["prompt_len"], s["input_ids"]) for s in SEQUENCES]
    scorer = BlockScorer(drafter, target.embed_weight, target.head_weight, refs,
                         extract_features(target, [r.token_ids for r in refs], drafter.target_layer_ids))
    compared, differing = 0, []
    for s, (sequence, theirs) in enumerate(zip(SEQUENCES, recorded["per_sequence"])):
        anchors = [theirs["first_anchor"] + j for j in range(len(theirs["drafts"]))]
        ours = scorer.draft_tokens([(s, a) for a in anchors])
        for anchor, mine, expected in zip(anchors, ours, theirs["drafts"]):
            compared += len(expected)
            differing += [(sequence["id"], anchor, slot) for slot, (a, b) in enumerate(zip(mine, expected)) if a != b]
    assert compared > 1500 and set(differing) <= near_ties, differing[:5]


@pytest.mark.parametrize("name", DRAFTERS)
def test_the_replay_equals_the_online_loop_with_the_target_in_it(target, name):
    drafter = load_drafter(SAVES / name / "0")
    prompts = [s["input_ids"][:s["prompt_len"]] for s in SEQUENCES]
    refs = [Reference(len(p), greedy_decode(target, p, 40, STOP)) for p in prompts]
    replayed = replay(drafter, target.embed_weight, target.head_weight, refs,
                      extract_features(target, [r.token_ids for r in refs], drafter.target_layer_ids))
    lengths = []
    for p, r in zip(prompts, replayed):
        online = speculative_decode(target, drafter, p, 40, STOP)
        assert (r.starts, r.acceptance_lengths) == (online.starts, online.acceptance_lengths)
        lengths += r.acceptance_lengths
    assert max(lengths) > 2 or name == "dflash_anchor"
    assert max(lengths) <= drafter.cfg.verified_tokens(drafter.block_size)


@pytest.mark.slow
def test_a_run_folder_of_speculators_saves_is_evaluated_save_by_save_beside_its_trainer_s_log(tmp_path,
                                                                                            prefect_api_url):
    """The DFlash2 run folder (saves 0/ and 1/, epoch links and checkpoint_best to them, the trainer's TensorBoard
    log in logs/): each save once, in step order, with the steps its training_state.json gives; what the trainer
    logged at that step beside tau (its eal, full_acc, position_{i}_acc and the selector's own numbers); the same
    save through a relay is the same checkpoint, and only the drafter's files are fetched."""
    import shutil

    from dflash_eval.cli.evaluation import checkpoints_named
    from dflash_eval.services.relay.server import RelayServer
    from dflash_eval.storage import Store
    from tests.evaluations import run_evaluation

    run = tmp_path / "dflash2"
    shutil.copytree(SAVES / "dflash2", run, symlinks=True)  # (our TensorBoard run is written beside the trainer's)
    saves = checkpoints_named([str(run)], str(tmp_path / "store"), settle_seconds=0)
    assert saves == [str(run.resolve() / "0"), str(run.resolve() / "1")]  # the links are no saves of their own
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": s["id"], "input_ids": s["input_ids"][:s["prompt_len"]]}) + "\n"
                               for s in SEQUENCES))

    def evaluate(drafter: str) -> dict:
        return run_evaluation(target=str(GOLDEN_DIR / "dflash010" / "target"), drafter=drafter, prompts=str(prompts),
                              max_new_tokens=40, store=str(tmp_path / "store"))

    results = [evaluate(save) for save in saves]
    assert [r["drafter"]["step"] for r in results] == [4, 6] and {r["drafter"]["layout"] for r in results} == {"speculators"}
    assert all("selector" in r and r["tau_macro"] > 2 for r in results)
    logged = GOLDEN["drafters"]["dflash2"]["tensorboard"]["read_back"]
    (scalars,) = [run_log["scalars"] for run_log in logged.values() if "val/eal_epoch" in run_log["scalars"]]
    at_step = results[1]["training"]["at_step"]
    assert at_step["trainer_acceptance_metric"] == "val/eal_epoch"
    assert at_step["trainer_acceptance"] == pytest.approx(scalars["val/eal_epoch"][-1][1])
    assert at_step["per_position_metric"] == "val/position_{k}_acc_epoch" and len(at_step["per_position_accuracy"]) == 7
    assert at_step["selector_accuracy"] == pytest.approx(scalars["val/teacher_forced_selector_acc_epoch"][-1][1])
    assert at_step["candidate_recall"] is not None and at_step["oracle_acceptance"] is not None
    held = Path(Store(tmp_path / "store").entry("fetch", results[1]["drafter"]["key"])) / "checkpoint"
    assert sorted(p.name for p in held.iterdir()) == ["config.json", "model.safetensors", "training_state.json"]

    with RelayServer(run, state_dir=tmp_path / "relay", settle_seconds=0) as relay:
        assert [c["path"] for c in relay.list_checkpoints()] == ["0", "1"]
        relayed = evaluate(f"{relay.url}/1")
    assert relayed["drafter"]["key"] == results[1]["drafter"]["key"] and relayed["stages"]["drafts"] == "cached"


def test_a_reduced_vocabulary_drafts_and_samples_only_its_own_tokens(target):
    """The reduced head's drafts and its q (sampled drafts, accepted by rejection sampling against the target's p)
    live on the kept tokens only, at their target ids, and q sums to 1 there."""
    from dflash_core.sampling import Sampling

    drafter = load_drafter(SAVES / "dflash_reduced" / "0")
    kept = set(drafter.target_ids.tolist())
    assert len(kept) == 64 and set(GOLDEN["drafters"]["dflash_reduced"]["draft_vocab"]["target_ids"]) == kept
    hidden = torch.randn(5, drafter.cfg.hidden_size)
    drafts = drafter.draft(hidden, target.head_weight, torch.zeros(5, dtype=torch.long), logits=True)
    assert set(drafts.tokens.tolist()) <= kept
    q = drafts.probabilities(Sampling(temperature=1.0, top_k=20))
    assert set(q.nonzero()[:, 1].tolist()) <= kept and torch.allclose(q.sum(-1), torch.ones(5))


def test_a_save_trained_against_another_verifier_is_named(tmp_path):
    """The verifier a save names is not loaded (the target given is used), but one of another architecture is
    named before anything runs."""
    import shutil

    from dflash_core.drafter_config import DrafterConfigWarning
    from dflash_eval.flows.checks import check_evaluation

    save = tmp_path / "save"
    shutil.copytree(SAVES / "dflash" / "0", save)
    raw = json.loads((save / "config.json").read_text())
    raw["speculators_config"]["verifier"] = {"architectures": ["LlamaForCausalLM"], "name_or_path": "meta/llama"}
    (save / "config.json").write_text(json.dumps(raw))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "input_ids": SEQUENCES[0]["input_ids"][:8]}) + "\n")
    with pytest.warns(DrafterConfigWarning, match=r"trained against a LlamaForCausalLM .* is a Qwen3ForCausalLM"):
        check_evaluation({"drafter": str(save), "inputs": {"target": str(GOLDEN_DIR / "dflash010" / "target"),
                                                           "prompts": str(prompts)},
                          "checkpoints": {"checkpoint_wait": 0, "settle_seconds": 0},
                          "output": {"store": str(tmp_path / "store")}})

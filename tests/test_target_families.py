"""Every target family that published DFlash-family drafters serve (tests/target_families.py), each a tiny random
target saved as its published checkpoints are, with a DFlash drafter trained on its greedy continuations
(tests/golden/families/), against z-lab's own loop: PyPI `dflash` 0.1.0 run once on each pair, target in the loop
(tests/golden/make_families_golden.py wrote what it emitted: families_loop.json).

- the text decoder is found through every wrapper, its layer count is the text config's, and its features are
  Hugging Face's `hidden_states[i + 1]` of the whole model's forward (towers and all);
- the attention implementation: SDPA where the text model takes it, else eager (gpt-oss), as the package's loader
  chose; SDPA forced on gpt-oss is refused in one line;
- the replay over the package's greedy outputs takes its steps, one by one, on every whole block (the package shortens
  its last verify blocks to the tokens left; serving stacks, and the replay, do not), and so does our online loop
  with the target in it; both outputs are the target's own greedy decoding;
- the whole flow (`dflash-eval run`) stores those steps for every family;
- bad input (a config transformers cannot build, layer ids beyond the text model's layers, a tap on its last
  layer): one line naming the file and field, exit code 2, no store.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_core.decoding import greedy_decode, speculative_decode
from dflash_core.drafter import load_drafter
from dflash_core.features import extract_features
from dflash_core.replay import Reference, replay
from dflash_core.target import choose_attention, load_target
from tests.target_families import FAMILIES, LAYERS

pytestmark = pytest.mark.usefixtures("one_thread")

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN = json.loads((GOLDEN_DIR / "families_loop.json").read_text())
MAX_NEW_TOKENS = GOLDEN["metadata"]["max_new_tokens"]


def folder(family: str) -> Path:
    return GOLDEN_DIR / "families" / family


def whole_block_steps(family: str) -> list[list[tuple[int, int]]]:
    """Per prompt, the package loop's (start, acceptance length) steps whose verify block was whole."""
    record = GOLDEN["families"][family]
    out = []
    for run in record["greedy"]:
        prompt_len = len(run["input_ids"])
        starts = (prompt_len + np.cumsum([0] + run["acceptance_lengths"][:-1])).tolist()
        out.append([(s, a) for s, a in zip(starts, run["acceptance_lengths"])
                    if s + record["block_size"] <= prompt_len + MAX_NEW_TOKENS])
    return out


def taken(results, expected: list[list[tuple[int, int]]]) -> list[bool]:
    """Per prompt, whether a replay's (or decode's) steps begin with the package's whole-block steps."""
    return [list(zip(r.starts, r.acceptance_lengths))[:len(w)] == w for r, w in zip(results, expected)]


def test_the_matrix_is_the_recorded_one_and_every_family_drafts():
    assert set(GOLDEN["families"]) == set(FAMILIES)
    for name, record in GOLDEN["families"].items():
        assert all(run["equals_target_argmax"] for run in record["greedy"]), name  # the package's loop is lossless
        lengths = {a for steps in whole_block_steps(name) for _, a in steps}
        assert len(lengths) >= 3 and max(lengths) >= 4, (name, lengths)  # steps of several lengths, long ones too
        assert sum(map(len, whole_block_steps(name))) >= 40, name
        config = json.loads((folder(name) / "target" / "config.json").read_text())
        assert config["architectures"] == [FAMILIES[name].architecture]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """(name, target, drafter) of one family, in float32 (the stored weights are bfloat16: the cast is exact)."""
    name = request.param
    target_dir = folder(name) / "target"
    target = load_target(target_dir, dtype=torch.float32, attention=choose_attention(target_dir))
    return name, target, load_drafter(folder(name) / "drafter")


def test_the_text_decoder_is_found_through_the_wrapper(family):
    name, target, _ = family
    assert target.num_layers == LAYERS == target.text_config.num_hidden_layers
    assert target.attention == GOLDEN["families"][name]["attention"]  # what transformers' own default chose
    run = GOLDEN["families"][name]["greedy"][0]
    ids = torch.tensor([run["input_ids"] + run["output_ids"]])
    with torch.no_grad():
        full = target.model(input_ids=ids, output_hidden_states=True)
    ours = target.forward(ids, layer_ids=range(LAYERS))
    for i in range(LAYERS):  # the last too: transformers' hidden state after the final norm
        assert torch.equal(ours.features[i], full.hidden_states[i + 1]), (name, i)
    torch.testing.assert_close(ours.logits, full.logits, rtol=0, atol=0)


@pytest.mark.slow
def test_the_replay_and_the_online_loop_take_the_package_loop_s_steps(family):
    name, target, drafter = family
    record = GOLDEN["families"][name]
    stop = record["stop_token_ids"]
    references = []
    for run in record["greedy"]:
        tokens = run["input_ids"] + run["output_ids"]
        assert tokens == greedy_decode(target, run["input_ids"], MAX_NEW_TOKENS, stop)  # the target's greedy text
        references.append(Reference(len(run["input_ids"]), tokens))
    expected = whole_block_steps(name)
    features = extract_features(target, [r.token_ids for r in references], drafter.target_layer_ids)
    ours = replay(drafter, target.embed_weight, target.head_weight, references, features)
    assert taken(ours, expected) == [True] * len(references)
    online = [speculative_decode(target, drafter, run["input_ids"], MAX_NEW_TOKENS, stop) for run in record["greedy"]]
    assert [o.output_ids for o in online] == [r.token_ids for r in references]
    assert taken(online, expected) == [True] * len(references)


def test_sdpa_forced_on_a_target_without_it_is_refused():
    with pytest.raises(ValueError, match="GptOssForCausalLM does not support SDPA attention; use "
                                         "--attn-implementation eager"):
        choose_attention(folder("gpt_oss") / "target", "sdpa")
    assert choose_attention(folder("gpt_oss") / "target", "eager") == "eager"
    assert choose_attention(folder("gemma4_audio") / "target", "eager") == "eager"  # the text model's, towers aside


def evaluate(name: str, store: Path, **settings) -> dict:
    from tests.evaluations import run_evaluation

    return run_evaluation(target=str(folder(name) / "target"), drafter=str(folder(name) / "drafter"),
                          prompts=str(folder(name) / "prompts.jsonl"), max_new_tokens=MAX_NEW_TOKENS, dtype="float32",
                          store=str(store), **settings)


@pytest.mark.slow
def test_the_flow_stores_the_package_loop_s_steps_for_every_family(tmp_path, prefect_api_url):
    for name, record in GOLDEN["families"].items():
        results = evaluate(name, tmp_path / "store")
        assert results["attn_implementation"] == record["attention"], name
        stored = []
        for run, row in zip(record["greedy"], results["per_prompt"]):
            assert row["id"] == run["id"]
            starts = len(run["input_ids"]) + np.cumsum([0] + row["acceptance_lengths"][:-1])
            stored.append(list(zip(starts.tolist(), row["acceptance_lengths"])))
        assert [s[:len(w)] for s, w in zip(stored, whole_block_steps(name))] == whole_block_steps(name), name


@pytest.mark.slow
def test_an_attention_other_than_sdpa_is_part_of_the_keys(tmp_path, prefect_api_url):
    """auto and sdpa share the store's entries (SDPA is no part of a key: entries made before the choice existed keep
    theirs); eager extracts its own references and features."""
    auto = evaluate("llama3_1", tmp_path / "store")
    sdpa = evaluate("llama3_1", tmp_path / "store", attn_implementation="sdpa")
    eager = evaluate("llama3_1", tmp_path / "store", attn_implementation="eager")
    assert (auto["attn_implementation"], sdpa["attn_implementation"], eager["attn_implementation"]) == (
        "sdpa", "sdpa", "eager")
    assert sdpa["keys"] == auto["keys"] and sdpa["stages"]["features"] == "cached"
    for stage in ("references", "features"):
        assert eager["keys"][stage] != auto["keys"][stage] and eager["stages"][stage] == "ran"


def edited_copy(source: Path, to: Path, edit) -> Path:
    """A copy of a model folder whose config.json `edit` changed (a dict -> None)."""
    import shutil

    shutil.copytree(source, to)
    config = json.loads((to / "config.json").read_text())
    edit(config)
    (to / "config.json").write_text(json.dumps(config))
    return to


@pytest.mark.parametrize(("which", "edit", "says"), [
    ("target", lambda c: c.update(hidden_act="gelu_new_typo"),
     "target: {target}/config.json: transformers cannot build LlamaForCausalLM from it: "),
    ("target", lambda c: c.update(model_type="llama_typo"), "target: {target}/config.json: transformers cannot read it"),
    ("drafter", lambda c: c["dflash_config"].update(target_layer_ids=[1, 7]),
     "config.json target_layer_ids [1, 7] include [7], but the target's text model has only 4 layers (0..3)"),
    ("drafter", lambda c: c["dflash_config"].update(target_layer_ids=[1, 3]),
     "config.json target_layer_ids [1, 3] tap layer 3, the target's last"),
], ids=["unbuildable config", "unknown model type", "layer beyond the text model", "tap on the last layer"])
def test_bad_input_gets_one_line_exit_2_and_no_store(tmp_path, which, edit, says):
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    models = {name: folder("llama3_1") / name for name in ("target", "drafter")}
    models[which] = edited_copy(models[which], tmp_path / which, edit)
    store = tmp_path / "store"
    result = CliRunner().invoke(app, ["run", "--target", str(models["target"]), "--drafter", str(models["drafter"]),
                                      "--prompts", str(folder("llama3_1") / "prompts.jsonl"), "--store", str(store)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert says.format(target=models["target"]) in lines[0]
    assert not store.exists()

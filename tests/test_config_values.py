"""Every value a drafter checkpoint gives, by value class, through the real loaders: a config's numbers (z-lab's
published format and SpecForge's exports, and speculators 0.9.0's), a speculators config's objects, a reduced
vocabulary's token maps. Each bad value is refused with one message naming the file and the field and saying what
to give instead (dflash_core.config_values); a few go through `dflash-eval run` (one line, exit 2, no store).

The tables say what each field must be; `test_every_field_the_loaders_read_has_a_row` holds them to the loaders'
own lists of fields, so a field added there without a row here fails."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from dflash_core.drafter import load_drafter
from dflash_core.drafter_config import READ_FIELDS, SWITCHES, DrafterError, dflash_fields, read_drafter_config
from dflash_core.speculators_format import TRANSLATED
from dflash_eval.cli import app
from tests.drafters import drafter_config

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

GOLDEN = Path(__file__).parent / "golden"
SPECULATORS = GOLDEN / "speculators"

# What a field must be, and the values of each class that break it (JSON writes NaN and Infinity as such, and
# Python's JSON reader takes them back: the loader sees them as a config on disk holds them).
NAN, INF = float("nan"), float("inf")
BAD = {
    "integer >= 0": [("NaN", NAN), ("Infinity", INF), ("negative", -1), ("bool", True), ("string", "8"),
                     ("fraction", 1.5)],
    "integer >= 1": [("NaN", NAN), ("Infinity", INF), ("negative", -1), ("zero", 0), ("bool", True),
                     ("string", "8"), ("fraction", 1.5)],
    "integer >= 2": [("NaN", NAN), ("Infinity", INF), ("negative", -1), ("one", 1), ("bool", True),
                     ("string", "8"), ("fraction", 2.5)],
    "number above 0": [("NaN", NAN), ("Infinity", INF), ("-Infinity", -INF), ("negative", -1.0), ("zero", 0),
                       ("bool", True), ("string", "1.0")],
    "number >= 0": [("NaN", NAN), ("Infinity", INF), ("negative", -2.0), ("bool", True), ("string", "1.0")],
    "boolean": [("one", 1), ("zero", 0), ("string", "true"), ("NaN", NAN)],
    "switch off at 0": [("bool", False), ("NaN", NAN), ("one", 1)],
    "switch off at 1": [("bool", True), ("NaN", NAN), ("Infinity", INF), ("half", 0.5)],
    "switch off at false": [("zero", 0), ("string", "false"), ("true", True)],
}

# Published config fields: where each lives -> what it must be. dflash_fields() live in dflash_config (read there
# first); "rope_parameters.factor" and its like inside that object; "target_layer_ids[]", the list's elements.
PUBLISHED = {
    "hidden_size": "integer >= 1", "num_hidden_layers": "integer >= 1", "num_attention_heads": "integer >= 1",
    "num_key_value_heads": "integer >= 1", "head_dim": "integer >= 1", "intermediate_size": "integer >= 1",
    "vocab_size": "integer >= 1", "draft_vocab_size": "integer >= 1", "sliding_window": "integer >= 1",
    "max_window_layers": "integer >= 0", "max_position_embeddings": "integer >= 1", "rms_norm_eps": "number above 0",
    "rope_theta": "number above 0", "attention_bias": "boolean", "use_sliding_window": "boolean",
    "is_causal": "boolean", "partial_rotary_factor": "switch off at 1",
    "attention_sink_bias": "switch off at false", "add_swa_attention_sink_bias": "switch off at false",
    "add_full_attention_sink_bias": "switch off at false",
    "rope_parameters.rope_theta": "number above 0", "rope_parameters.factor": "number above 0",
    "rope_scaling.factor": "number above 0", "rope_scaling.original_max_position_embeddings": "number above 0",
    "dflash_config.block_size": "integer >= 2", "dflash_config.mask_token_id": "integer >= 0",
    "dflash_config.num_target_layers": "integer >= 1", "dflash_config.swa_window_size": "integer >= 1",
    "dflash_config.input_embedding_scale": "number above 0", "dflash_config.output_multiplier": "number above 0",
    "dflash_config.final_logit_softcapping": "number >= 0", "dflash_config.target_layer_ids[]": "integer >= 0",
    "dflash_config.causal": "boolean", "dflash_config.use_swa": "boolean",
    "dflash_config.pure_draft_prefix_len": "switch off at 0", "dflash_config.shift_label": "switch off at false",
    "dflash_config.attention_sink_bias": "switch off at false",
}
DFLASH2 = {f"dflash_config.{key}": "integer >= 1"
           for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
# Fields that hold no number, each covered elsewhere: read as strings, lists or objects (test_drafter_config.py,
# test_dflash2.py; the objects' numbers above), or refused whenever set (projector_type, quantization_config).
NOT_NUMBERS = {"architectures", "hidden_act", "layer_types", "rope_scaling", "rope_parameters", "dflash_config",
               "mask_token", "target_layer_ids", "projector_type", "quantization_config",
               "markov_head_type"}  # (a name: test_deepspec_golden.py)
# DSpark's own fields, as DeepSpec's saves and speculators' DSpark saves give them (at the top level)
DSPARK = {"markov_rank": "integer >= 0", "enable_confidence_head": "boolean", "confidence_head_with_markov": "boolean"}
DSPARK_SAVES = {"deepspec": GOLDEN / "deepspec" / "dspark", "speculators": GOLDEN / "speculators_dspark" / "dspark" / "0"}

# A speculators config: its own top-level fields -> what each must be (the Qwen3 fields under
# transformer_layer_config are the published ones: PUBLISHED's top-level rows are run there too).
SPECULATORS_NUMBERS = {
    "block_size": "integer >= 2", "mask_token_id": "integer >= 0", "draft_vocab_size": "integer >= 1",
    "target_hidden_size": "integer >= 1", "aux_hidden_state_layer_ids[]": "integer >= 0",
    "sample_from_anchor": "boolean", "sliding_window_non_causal": "boolean",
}
SPECULATORS_DFLASH2 = {key.removeprefix("dflash_config."): kind for key, kind in DFLASH2.items()}
# ... and its objects and lists, given as what they are not: (field, value, what the message says)
SPECULATORS_SHAPES = [
    ("speculators_config", "dflash", "speculators_config must be an object"),
    ("speculators_config", ["dflash"], "speculators_config must be an object"),
    ("speculators_config.verifier", "Qwen/Qwen3-8B", "speculators_config.verifier must be an object"),
    ("speculators_config.verifier", 3, "speculators_config.verifier must be an object"),
    ("speculators_config.verifier.architectures", "Qwen3ForCausalLM",
     "speculators_config.verifier.architectures must be a list of model class names"),
    ("speculators_config.verifier.architectures", [1], "speculators_config.verifier.architectures must be a list"),
    ("transformer_layer_config", "qwen3", "a speculators config needs transformer_layer_config"),
    ("aux_hidden_state_layer_ids", "2,3", "aux_hidden_state_layer_ids must be a non-empty list"),
    ("aux_hidden_state_layer_ids", [2, 2], "aux_hidden_state_layer_ids must name each layer once, got [2, 2]"),
    ("aux_hidden_state_layer_ids", [], "aux_hidden_state_layer_ids must be a non-empty list"),
    ("draft_vocab_size", 10**6, "draft_vocab_size must be an integer from 1 to transformer_layer_config.vocab_size"),
    ("speculators_model_type", 5, "speculators_model_type 5"),
]
NOT_SPECULATORS_NUMBERS = {"speculators_model_type", "transformer_layer_config", "aux_hidden_state_layer_ids",
                           "speculators_config"}


def put(raw: dict, where: str, value) -> None:
    """Set the field at `where` ("a", "a.b", "a[]": the list's first element) of a config to `value`."""
    *path, last = where.split(".")
    for part in path:
        raw = raw.setdefault(part, {})
    if last.endswith("[]"):
        raw[last[:-2]][0] = value
    else:
        raw[last] = value


def published_base(where: str) -> dict:
    """A published config the field at `where` is read from: DFlash2's fields on a DFlash2 config, a RoPE object's
    fields in an object of the type that reads them."""
    raw = drafter_config()
    if where in DFLASH2:
        raw.update(architectures=["DFlash2DraftModel"], vocab_size=64, dflash_config={
            **raw["dflash_config"], "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 8})
    if where.startswith("rope_parameters."):
        raw.update(rope_theta=None, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    if where.startswith("rope_scaling."):
        raw["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}
    return raw


def refusal(tmp_path: Path, raw: dict) -> str:
    """The one-line DrafterError read_drafter_config gives for `raw` written as tmp_path/config.json."""
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DrafterError) as refused:
        read_drafter_config(tmp_path)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'config.json'}: ") and "\n" not in message, message
    return message


def said_as(where: str) -> str:
    """How a message names the field at `where`."""
    return where.removesuffix("[]")


def cases(table: dict[str, str]) -> list:
    return [pytest.param(where, value, kind, id=f"{where}-{label}")
            for where, kind in table.items() for label, value in BAD[kind]]


@pytest.mark.parametrize("where,value,kind", cases({**PUBLISHED, **DFLASH2}))
def test_a_published_config_number_of_the_wrong_class_is_refused_naming_the_field(tmp_path, where, value, kind):
    raw = published_base(where)
    put(raw, where, value)
    message = refusal(tmp_path, raw)
    assert said_as(where) in message, message
    assert what_to_give(where, kind) in message, message


def what_to_give(where: str, kind: str) -> str:
    """What a refusal of the field at `where` says to give instead."""
    if kind.startswith("switch"):
        return "Supported: "
    if where.endswith("[]"):
        return f"{said_as(where)} must be a non-empty list of layer indices >= 0"
    return f"{said_as(where)} must be " + ("true, false or null" if kind == "boolean" else
                                          f"a finite {kind}" if "number" in kind else f"an {kind}")


def speculators_base(where: str) -> dict:
    name = "dflash2" if where in SPECULATORS_DFLASH2 else "dflash_reduced" if where == "draft_vocab_size" else "dflash"
    return json.loads((SPECULATORS / name / "0" / "config.json").read_text())


@pytest.mark.parametrize("where,value,kind", cases({**SPECULATORS_NUMBERS, **SPECULATORS_DFLASH2}))
def test_a_speculators_config_number_of_the_wrong_class_is_refused_naming_the_field(tmp_path, where, value, kind):
    raw = speculators_base(where)
    put(raw, where, value)
    message = refusal(tmp_path, raw)
    assert what_to_give(where, kind) in message and "dflash_config" not in message, message


@pytest.mark.parametrize("where,value,kind", cases({  # (draft_vocab_size: the top-level one is read)
    key: kind for key, kind in PUBLISHED.items() if "." not in key and not kind.startswith("switch")
    and key != "draft_vocab_size"}))
def test_a_number_of_the_wrong_class_in_transformer_layer_config_is_refused_naming_the_field(tmp_path, where, value,
                                                                                             kind):
    raw = speculators_base(where)
    put(raw["transformer_layer_config"], where, value)
    message = refusal(tmp_path, raw)
    assert what_to_give(where, kind) in message, message


@pytest.mark.parametrize("where,value,says", SPECULATORS_SHAPES, ids=[f"{w}-{json.dumps(v)}" for w, v, _ in
                                                                      SPECULATORS_SHAPES])
def test_a_speculators_field_of_the_wrong_shape_is_refused_naming_it(tmp_path, where, value, says):
    raw = speculators_base(where)
    put(raw, where, value)
    assert says in refusal(tmp_path, raw)


@pytest.mark.parametrize("save", list(DSPARK_SAVES))
@pytest.mark.parametrize("where,value,kind", cases(DSPARK))
def test_a_dspark_config_value_of_the_wrong_class_is_refused_naming_the_field(tmp_path, save, where, value, kind):
    raw = json.loads((DSPARK_SAVES[save] / "config.json").read_text())
    put(raw, where, value)
    message = refusal(tmp_path, raw)
    assert what_to_give(where, kind) in message, message


def test_every_field_the_loaders_read_has_a_row():
    published = {key.removeprefix("dflash_config.").split(".")[0].removesuffix("[]")
                 for key in {**PUBLISHED, **DFLASH2, **DSPARK}}
    assert not set(READ_FIELDS) - published - NOT_NUMBERS, "published fields without a row"
    assert not set(dflash_fields()) - published - NOT_NUMBERS, "dflash_config fields without a row"
    assert not set(SWITCHES) - published - NOT_NUMBERS, "switches without a row"
    speculators = {key.split(".")[0].removesuffix("[]") for key in SPECULATORS_NUMBERS} | set(SPECULATORS_DFLASH2)
    assert not set(TRANSLATED) - speculators - NOT_SPECULATORS_NUMBERS, "speculators fields without a row"


@pytest.mark.parametrize("where,value", [("dflash_config.final_logit_softcapping", 0),
                                         ("dflash_config.final_logit_softcapping", 30.0),
                                         ("dflash_config.output_multiplier", 0.5), ("max_window_layers", 0),
                                         ("partial_rotary_factor", 1.0), ("dflash_config.mask_token_id", 0)])
def test_the_good_values_at_the_edges_are_read(tmp_path, where, value):
    raw = published_base(where)
    put(raw, where, value)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    read_drafter_config(tmp_path)


def test_a_cap_of_0_is_none_and_a_cap_above_0_is_read():
    from dflash_core.drafter_config import DrafterConfig

    def cap(value):
        return DrafterConfig.from_dict(drafter_config(dflash_config={"target_layer_ids": [0, 1], "mask_token_id": 1,
                                                                     "final_logit_softcapping": value}))
    assert cap(0).final_logit_softcapping is None and cap(None).final_logit_softcapping is None
    assert cap(30).final_logit_softcapping == 30.0


# ----------------------------------------------------------------------------------------------
# A reduced vocabulary's token maps: d2t (target id = draft id + d2t[draft id]) and t2d (the target ids kept)


def damaged_maps(tmp_path: Path, damage) -> Path:
    save = tmp_path / "save"
    shutil.copytree(SPECULATORS / "dflash_reduced" / "0", save)
    weights = load_file(save / "model.safetensors")
    damage(weights)
    save_file(weights, save / "model.safetensors")
    return save


def with_twos(weights):
    t2d = weights["t2d"].to(torch.int64)
    t2d[t2d.nonzero()[0]] = 2  # a kept token marked 2
    weights["t2d"] = t2d


TOKEN_MAPS = [
    ("float d2t", lambda w: w.update(d2t=w["d2t"].float() + 0.5), "d2t is float32: it must hold integer offsets"),
    ("bool d2t", lambda w: w.update(d2t=w["d2t"] != 0), "d2t is bool: it must hold integer offsets"),
    ("int64 t2d holding 2s", with_twos, "t2d is int64 holding 2: it must mark each target token kept or not"),
    ("float t2d", lambda w: w.update(t2d=w["t2d"].float()), "t2d is float32: it must mark each target token"),
    ("int64 t2d of -1s", lambda w: w.update(t2d=-w["t2d"].to(torch.int64)), "t2d is int64 holding -1"),
    ("d2t one short", lambda w: w.update(d2t=w["d2t"][:-1].contiguous()), "weight d2t has shape [63], expected [64]"),
    ("t2d one long", lambda w: w.update(t2d=torch.cat([w["t2d"], w["t2d"][:1]])),
     "weight t2d has shape [513], expected [512]"),
    ("d2t past the vocabulary", lambda w: w["d2t"].__setitem__(-1, 10**6), "d2t maps draft tokens outside"),
    ("t2d keeping another token", lambda w: w["t2d"].__setitem__(int((~w["t2d"]).nonzero()[0]), True),
     "d2t and t2d disagree"),
]


@pytest.mark.parametrize("damage,says", [case[1:] for case in TOKEN_MAPS], ids=[case[0] for case in TOKEN_MAPS])
def test_a_damaged_token_map_is_refused_naming_it(tmp_path, damage, says):
    save = damaged_maps(tmp_path, damage)
    with pytest.raises(DrafterError, match="^" + str(save)) as refused:
        load_drafter(save)
    assert says in str(refused.value)


def test_an_int64_t2d_of_zeros_and_ones_is_read_as_the_bool_one(tmp_path):
    save = damaged_maps(tmp_path, lambda w: w.update(t2d=w["t2d"].to(torch.int64)))
    assert torch.equal(load_drafter(save).t2d, load_drafter(SPECULATORS / "dflash_reduced" / "0").t2d)


# ----------------------------------------------------------------------------------------------
# Through the command line: one line, exit 2, before anything is stored (the input checks read the config)


def one_line(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def edited_save(tmp_path: Path, source: Path, edit) -> Path:
    save = tmp_path / "drafter"
    shutil.copytree(source, save)
    raw = json.loads((save / "config.json").read_text())
    edit(raw)
    (save / "config.json").write_text(json.dumps(raw))
    return save


@pytest.mark.parametrize("source,edit,sampled,says", [
    (GOLDEN / "dflash010" / "drafter", lambda r: r["dflash_config"].update(output_multiplier=INF), True,
     "dflash_config.output_multiplier must be a finite number above 0, got Infinity"),
    (GOLDEN / "dflash010" / "drafter", lambda r: r["dflash_config"].update(final_logit_softcapping=NAN), True,
     "dflash_config.final_logit_softcapping must be a finite number >= 0, got NaN"),
    (GOLDEN / "dflash010" / "drafter", lambda r: r.update(rope_theta=-10000), False,
     "rope_theta must be a finite number above 0, got -10000"),
    (GOLDEN / "dflash010" / "drafter", lambda r: r["dflash_config"].update(input_embedding_scale=NAN), False,
     "dflash_config.input_embedding_scale must be a finite number above 0, got NaN"),
    (SPECULATORS / "dflash" / "0", lambda r: r.update(speculators_config="dflash"), False,
     "speculators_config must be an object"),
    (SPECULATORS / "dflash" / "0", lambda r: r["speculators_config"].update(verifier="Qwen/Qwen3-8B"), False,
     "speculators_config.verifier must be an object"),
    (SPECULATORS / "dflash_reduced" / "0", lambda r: r.update(draft_vocab_size=True), False,
     "draft_vocab_size must be an integer >= 1, got true"),
    (SPECULATORS / "dflash" / "0", lambda r: r.update(aux_hidden_state_layer_ids=[3, 3]), False,
     "aux_hidden_state_layer_ids must name each layer once"),
], ids=["output_multiplier-Infinity", "softcap-NaN", "rope_theta-negative", "input_embedding_scale-NaN",
        "speculators_config-string", "verifier-string", "draft_vocab_size-true", "aux-ids-repeated"])
def test_a_bad_config_value_stops_the_run_in_one_line_and_nothing_is_stored(tmp_path, source, edit, sampled, says):
    save = edited_save(tmp_path, source, edit)
    references = tmp_path / "references.jsonl"
    references.write_text(json.dumps({"id": "p", "input_ids": [5, 6, 7, 8], "completion_ids": [9, 10, 11]}) + "\n")
    store = tmp_path / "store"
    line = one_line(["run", "--target", str(GOLDEN / "dflash010" / "target"), "--drafter", str(save),
                     "--references", str(references), "--store", str(store), "--settle-seconds", "0",
                     *(["--temperature", "0.6", "--draft-sample-method", "probabilistic"] if sampled else [])])
    assert line.startswith(f"error: drafter: {save} config.json (checkpoint): ") and says in line, line
    assert not store.exists()


@pytest.mark.slow
def test_a_damaged_token_map_stops_the_run_in_one_line_and_leaves_no_fetch_entry(tmp_path, prefect_api_url):
    """The weights are read only at the fetch (inside the flow): the refusal is its last line, and nothing of the
    checkpoint stays in the store (docs/store.md)."""
    from dflash_eval.storage import Store

    save = damaged_maps(tmp_path, lambda w: w.update(d2t=w["d2t"].float() + 0.5))
    references = tmp_path / "references.jsonl"
    references.write_text(json.dumps({"id": "p", "input_ids": [5, 6, 7, 8], "completion_ids": [9, 10, 11]}) + "\n")
    store = tmp_path / "store"
    result = CliRunner().invoke(app, ["run", "--target", str(GOLDEN / "dflash010" / "target"), "--drafter", str(save),
                                      "--references", str(references), "--store", str(store),
                                      "--settle-seconds", "0"])
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith(f"error: drafter {save}: ") and "d2t is float32: it must hold integer offsets" in last, last
    assert Store(store).keys("fetch") == []
    assert [p.name for p in (store / "fetch").rglob("*") if p.is_file()] == []

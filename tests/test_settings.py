"""The evaluation's settings, declared once (flows/settings.py): the command line's options, --config's keys, the
flow's parameters and their form, and the checks all come from that one declaration; each rule is checked once,
before any work, in one line naming the settings as the user gave them; the served setting is one value with one
label, its block size chosen only when it is not the drafter's own. None needs a model or a server."""

import json
import re

import pytest
from typer.testing import CliRunner

from dflash_core.drafter_config import chosen_block_size
from dflash_core.sampling import Sampling, Served
from dflash_eval.cli import app
from dflash_eval.flows.settings import (
    GROUPS,
    SETTINGS,
    Evaluation,
    Settings,
    SettingsError,
    by_group,
    flag_name,
    parameter_name,
)

BASE = {"inputs": {"target": "t", "prompts": "p"}}


def options_of(command: list[str]) -> set[str]:
    """The options a command's help lists (the flag that begins each option's line)."""
    output = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "400"}).output
    found = (re.match(r"^\s*(?:\*\s+)?(--[a-z-]+)", line.replace("│", " ")) for line in output.splitlines())
    return {match.group(1) for match in found if match}


def test_every_setting_is_an_option_of_the_commands_that_evaluate_and_nothing_else_is():
    declared = {s.flag for s in SETTINGS.values()}
    by_hand_only = {s.flag for s in SETTINGS.values() if s.cli.by_hand_only}
    assert options_of(["run"]) == declared | {"--drafter", "--out", "--diagnostics", "--config", "--help"}
    assert options_of(["stage"]) == declared | {"--drafter", "--out", "--refresh", "--config", "--help"}
    assert options_of(["watch"]) == declared - by_hand_only | {"--relay", "--out", "--config", "--help"}
    assert "--report-dir" in by_hand_only and "--report-dir" not in options_of(["serve"])
    assert declared - by_hand_only <= options_of(["serve"])


def test_the_flow_s_parameters_are_the_groups_and_their_form_is_the_declaration():
    from prefect.utilities.callables import parameter_schema

    from dflash_eval.flows.evaluate import RERUN_FLOWS, evaluate_checkpoint
    from tests.evaluations import setting_schema

    schema = parameter_schema(evaluate_checkpoint.fn).model_dump()
    assert list(schema["properties"]) == ["drafter", *GROUPS, "until", "refresh"]
    assert schema["required"] == ["drafter", "inputs"]
    for name, setting in SETTINGS.items():
        shown = setting_schema(schema, setting.group, name)
        assert shown["description"] == setting.field.description, name
    assert setting_schema(schema, "serving", "top_p")["exclusiveMinimum"] == 0
    assert setting_schema(schema, "inputs", "max_new_tokens")["minimum"] == 2  # a decode step needs two tokens
    rerun = parameter_schema(RERUN_FLOWS["drafts"].fn).model_dump()
    assert list(rerun["properties"]) == ["drafter", *GROUPS]  # the stage is fixed: the form cannot change it


@pytest.mark.parametrize(("given", "on_the_command_line", "as_parameters"), [
    ({"serving": {"temperature": 0.5, "top_p": 1.5}}, "--top-p must lie in (0, 1], got 1.5",
     "serving.top_p must lie in (0, 1], got 1.5"),
    ({"serving": {"samples": 3}}, "--samples 3: greedy completions (temperature 0) are all the same; set "
     "--temperature above 0", "serving.samples 3: greedy completions (temperature 0) are all the same; set "
     "serving.temperature above 0"),
    ({"generation": {"lookahead": True}, "serving": {"temperature": 0.6}}, "--lookahead applies to greedy "
     "references", "generation.lookahead applies to greedy references"),
    ({"compute": {"dtype": "float16", "threads": 0}}, "--dtype must be one of auto, float32, bfloat16, got "
     "'float16'; --threads must be at least 1, got 0", "compute.dtype must be one of auto, float32, bfloat16, "
     "got 'float16'; compute.threads must be at least 1, got 0"),
    ({"serving": {"draft_sample_method": "probabilistic"}}, "--draft-sample-method probabilistic samples drafts at "
     "the served temperature", "serving.draft_sample_method probabilistic samples drafts at the served temperature"),
    ({"serving": {"draft_truncation": False}}, "--draft-truncation applies to probabilistic drafts",
     "serving.draft_truncation applies to probabilistic drafts"),
    ({"inputs": {"target": "t"}}, "give --prompts (a suite or a prompt file), or --references FILE",
     "give inputs.prompts (a suite or a prompt file), or inputs.references FILE"),
    ({"compute": {"dask": "tcp://x:1"}}, "compute.dask is no setting (the compute group hold: dtype, attn_implementation, "
     "device, threads, replay_group, dask_address)", "compute.dask is no setting"),
])
def test_a_broken_rule_names_each_setting_as_the_user_gave_it(given, on_the_command_line, as_parameters):
    values = {**BASE, **given, "inputs": {**BASE["inputs"], **given.get("inputs", {})}}
    if "prompts" not in given.get("inputs", {"prompts": 1}):
        values["inputs"].pop("prompts")
    with pytest.raises(SettingsError) as by_flag:
        Settings.checked(values, flag_name)
    assert on_the_command_line in str(by_flag.value)
    with pytest.raises(SettingsError) as by_parameter:
        Settings.checked(values, parameter_name)
    assert as_parameters in str(by_parameter.value) and "--" not in str(by_parameter.value)


def test_a_deployment_s_settings_are_checked_before_anything_is_read():
    """Through the flow's own check (a run a deployment started): the settings' rules first, so a broken rule is
    said even when the target does not exist, and nothing is created."""
    from dflash_eval.flows.checks import InputError, check_evaluation

    with pytest.raises(InputError, match=r"^serving.top_p must lie in \(0, 1\], got 1.5$"):
        check_evaluation({"drafter": "/nowhere", **BASE, "serving": {"temperature": 0.6, "top_p": 1.5}})
    with pytest.raises(InputError, match="^target t is not a directory"):  # the rules hold: the files are next
        check_evaluation({"drafter": "/nowhere", **BASE, "serving": {"temperature": 0.6, "top_p": 0.95}})


def test_a_templated_parameter_of_an_unset_variable_takes_its_default():
    settings = Settings.checked({"inputs": {"target": "t", "prompts": "p", "target_name": ""},
                                 "generation": {"reference": "", "reference_api_key_file": ""},
                                 "compute": {"dask_address": "", "threads": ""}})
    assert settings.generation.reference == "local" and settings.generation.reference_api_key_file is None
    assert settings.compute.dask_address is None and settings.compute.threads is None
    assert settings.inputs.target_name is None
    with pytest.raises(SettingsError, match="inputs.target is required"):
        Settings.checked({"inputs": {"target": "", "prompts": "p"}})


def test_on_the_command_line_a_bound_is_checked_once_and_named_by_its_flag(tmp_path):
    config = tmp_path / "team.toml"
    config.write_text('temperature = 0.6\ntop-p = 1.5\nblock-sizes = "2,4"\n')
    result = CliRunner().invoke(app, ["run", "--config", str(config), "--target", "t", "--drafter", "d",
                                      "--prompts", "p"])
    assert result.exit_code == 2 and result.output == "error: --top-p must lie in (0, 1], got 1.5\n", result.output
    # every setting is a key of the file, by its option's name: these hold, and the target is what is refused next
    config.write_text('temperature = 0.6\ntop-p = 0.95\nsamples = 2\nblock-sizes = "2,4"\ndask = ""\nname = "x"\n')
    result = CliRunner().invoke(app, ["run", "--config", str(config), "--target", str(tmp_path / "none"),
                                      "--drafter", "d", "--prompts", "p"])
    assert result.exit_code == 2 and f"target {tmp_path / 'none'} is not a directory" in result.output


def test_the_command_line_holds_as_set_only_what_the_user_gave(monkeypatch):
    """`watch` passes on only what it was given, so the evaluations keep their deployment's other settings."""
    from dflash_eval.cli import serving

    seen = {}
    monkeypatch.setattr(serving, "start_local_server", lambda: None)
    monkeypatch.setattr("dflash_eval.flows.watch.watch_relay", lambda relay, settings: seen.update(settings) or [])
    monkeypatch.setenv("DFLASH_SETTLE_SECONDS", "7")
    result = CliRunner().invoke(app, ["watch", "--relay", "http://relay:8700", "--target", "/t", "--prompts", "p",
                                      "--max-new-tokens", "256", "--temperature", "0.6"])
    assert result.exit_code == 0, result.output
    # the default given again is given; a variable of the environment is given; the rest is the deployment's
    assert seen == {"inputs": {"target": "/t", "prompts": "p", "max_new_tokens": 256},
                    "serving": {"temperature": 0.6}, "checkpoints": {"settle_seconds": 7.0}}


def test_settings_given_by_name_are_put_in_their_groups():
    assert by_group({"drafter": "d", "target": "t", "top_p": 0.9, "dask_address": "a", "until": "drafts"}) == {
        "drafter": "d", "inputs": {"target": "t"}, "serving": {"top_p": 0.9}, "compute": {"dask_address": "a"},
        "until": "drafts"}
    with pytest.raises(SettingsError, match="topp is no setting"):
        by_group({"topp": 0.9})
    evaluation = Evaluation.checked({"drafter": "d", **BASE})
    assert evaluation.parameters()["compute"].replay_group == 64 and evaluation.until == "scores"


def test_the_served_setting_is_one_value_with_one_label():
    sampled = Sampling(0.6, 20, 0.95)
    cases = [(Served(), "greedy", []),
             (Served(block_size=4), "greedy, blocks of 4", ["block-size:4"]),
             (Served(sampled, 8, 1), "T=0.6 top-k 20 top-p 0.95, 8 samples per prompt, seed 1",
              ["sampling:T=0.6 top-k 20 top-p 0.95", "samples:8"]),
             (Served(given=True, block_size=2), "given completions, blocks of 2", ["references:given", "block-size:2"]),
             (Served(sampled, 8, 1, draft_sample_method="probabilistic"),
              "T=0.6 top-k 20 top-p 0.95, 8 samples per prompt, seed 1, sampled drafts",
              ["sampling:T=0.6 top-k 20 top-p 0.95", "samples:8", "drafts:probabilistic"]),
             (Served(sampled, 8, 1, 4, draft_sample_method="probabilistic", draft_truncation=False),
              "T=0.6 top-k 20 top-p 0.95, 8 samples per prompt, seed 1, sampled drafts (q at the temperature only), "
              "blocks of 4", ["sampling:T=0.6 top-k 20 top-p 0.95", "samples:8", "drafts:probabilistic",
                              "block-size:4"])]
    for served, label, tags in cases:
        assert served.label == label and served.tags() == tags
        assert served.default == (label == "greedy")
        as_json = served.to_json()
        assert as_json["label"] == label and json.loads(json.dumps(as_json)) == as_json
    # what the store's records say gives the same value back
    record = {**sampled.identity(), "samples": 8, "seed": 1}
    assert Served.from_record(record, block_size=4) == Served(sampled, 8, 1, 4)
    assert Served.from_record(None, given=True) == Served(given=True)
    temperature_only = {"q": Sampling(0.6).identity(), "seed": 1}
    assert Served.from_record(record, draft_sampling=temperature_only) == Served(
        sampled, 8, 1, draft_sample_method="probabilistic", draft_truncation=False)
    assert Served(sampled, draft_sample_method="probabilistic", draft_truncation=False).draft_q == Sampling(0.6)
    assert Served(sampled).draft_q is None


# The drafts entry's keys of a sampled-draft setting, as the drafts stage computed them before the setting had one
# typed form (DraftSampling): a store's entries must keep them (q with the served truncation, then at T only).
SAMPLED_DRAFTS_KEYS = {True: "dc73dfe79af5e3c444adba2e952ad7fc00c112066936791814eb9906d8378923",
                       False: "5e5992b9933df72104c8bbae07ffe56cd89bc19dc7c21416d40aaef7a4798464"}


@pytest.mark.parametrize("truncation", [True, False])
def test_a_sampled_draft_setting_is_one_value_stored_as_before(truncation):
    from dflash_core.sampling import DraftSampling
    from dflash_eval.tasks.drafts import drafts_key

    served = Served(Sampling(0.6, 20, 0.95), 8, 3, 4, draft_sample_method="probabilistic", draft_truncation=truncation)
    drafts = served.draft_sampling
    assert drafts == DraftSampling(served.draft_q, 3) and Served(Sampling(0.6)).draft_sampling is None
    # the drafts record's `draft_sampling` and the key's `sampled_drafts`: the same dict as ever
    q = {"temperature": 0.6, "top_k": 20 if truncation else 0, "top_p": 0.95 if truncation else 1.0, "min_p": 0.0}
    assert drafts.to_record() == {"q": q, "seed": 3} and DraftSampling.from_record(drafts.to_record()) == drafts
    key = drafts_key("c" * 64, "f" * 64, (1, 3), 4, "causal", False, "float32", "cpu", 64, drafts)
    assert key == SAMPLED_DRAFTS_KEYS[truncation]
    # read back from the store's records, the setting is the one served (its truncation too)
    record = {**Sampling(0.6, 20, 0.95).identity(), "samples": 8, "seed": 3}
    assert Served.from_record(record, block_size=4, draft_sampling=drafts.to_record()) == served
    assert Served.from_record(record, block_size=4, draft_sampling=drafts) == served


def test_the_block_is_resolved_once_from_the_request_and_the_drafter():
    from dataclasses import replace

    from dflash_core.blocks import Block, resolve_block
    from dflash_core.drafter_config import DrafterConfig
    from tests.drafters import drafter_config

    config = DrafterConfig.from_dict(drafter_config(block_size=8))
    assert resolve_block(None, config) == resolve_block(8, config) == Block(8, 8, 8)
    assert resolve_block(None, config).chosen is None and resolve_block(4, config).chosen == 4
    assert resolve_block(4, replace(config, drafts_from_anchor=True)) == Block(8, 4, 5)  # the anchor's slot drafts
    with pytest.raises(ValueError, match="block size 16: use 2 .. 8"):
        resolve_block(16, config)


def test_a_block_size_is_chosen_only_when_it_is_not_the_drafter_s_own():
    assert chosen_block_size(None, 8) is None
    assert chosen_block_size(8, 8) is None  # the drafter's own: the same keys, series, tags and name as none
    assert chosen_block_size(4, 8) == 4
    with pytest.raises(ValueError, match="block size 16: use 2 .. 8"):
        chosen_block_size(16, 8)

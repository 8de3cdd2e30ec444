"""`prompts`: exactly what a run feeds the target, prompt by prompt, before anything is computed."""

import json
from typing import TYPE_CHECKING, Annotated

import typer

from .common import fail
from .options import example, setting_option

app = typer.Typer()

if TYPE_CHECKING:
    Protocol = str | None
    Data = str | None
    MaxSamples = int | None
    Reasoning = str | None
    Thinking = bool
else:
    Protocol, Data, MaxSamples, Reasoning, Thinking = (
        setting_option(name) for name in ("protocol", "data", "max_samples", "reasoning", "thinking"))


@app.command("prompts", epilog=example("dflash-eval prompts gsm8k --target models/Qwen3-8B --protocol dflash-0.1 "
                                       "--max-samples 2"))
def prompts(
    name: Annotated[str, typer.Argument(help=(
        "What --prompts takes: published benchmarks (gsm8k, math500, ..., zlab-paper), a suite or a JSONL file."))],
    target: Annotated[str | None, typer.Option("--target", help=(
        "The target folder: its chat template and tokenizer give the templated text and the token ids (without "
        "it, published benchmarks show their messages only)."))] = None,
    protocol: Protocol = None,
    data: Data = None,
    max_samples: MaxSamples = None,
    reasoning: Reasoning = None,
    thinking: Thinking = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object: the set, then every prompt.")] = False,
):
    """Show what a run with these options feeds the target: each prompt's id, benchmark or category, messages,
    templated text and token ids, with the protocol, the stop ids and where each benchmark's rows came from."""
    from pydantic import ValidationError

    from dflash_core.prompts import PromptError, resolve_prompts
    from dflash_core.published.benchmarks import BenchmarkError, benchmark_names, read_data_option
    from dflash_eval.flows.settings import Inputs, SettingsError, flag_name, settings_error
    from dflash_eval.services.benchmark_data import benchmark_conversations

    try:  # the rules `run` checks (a protocol with a suite, --thinking with benchmarks): one line naming each option
        checked = Inputs.model_validate({"target": target or ".", "prompts": name, "protocol": protocol,
                                         "data": data, "max_samples": max_samples, "reasoning": reasoning,
                                         "thinking": thinking})
    except ValidationError as e:
        fail(settings_error(e, flag_name))
    try:
        names = benchmark_names(name)
        if target is None:
            if names is None:
                resolve_prompts(name)  # a name that is neither a suite nor a file is said as such
                fail(f"{name} is a suite or a prompt file: give --target, whose tokenizer reads it")
            conversations, uses = benchmark_conversations(names, protocol, read_data_option(data, names), max_samples)
            shown = {"protocol": protocol or "zlab-2026-01", "benchmarks": [u.to_json() for u in uses],
                     "prompts": [{"id": c.id, "category": c.benchmark, "turns": list(c.turns)} for c in conversations]}
        else:
            shown = _templated(name, target, checked)
    except (PromptError, BenchmarkError, SettingsError) as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps(shown, ensure_ascii=False, indent=1))
    else:
        _print(shown)


def _templated(name: str, target: str, inputs) -> dict:
    """The prompt set as the references stage reads it, with each prompt's text and ids."""
    from transformers import AutoTokenizer

    from dflash_eval.flows.checks import InputError, check_target, prompt_choice
    from dflash_eval.tasks.references import load_prompts

    try:
        check_target(target)
    except InputError as e:
        fail(str(e))
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompt_set = load_prompts(prompt_choice(inputs), target, tokenizer)
    shown: dict = {"prompts_option": name, "stop_token_ids": prompt_set.stop_token_ids}
    if prompt_set.benchmarks is not None:
        shown.update(prompt_set.benchmarks.to_json())
    turns = {c.id: c.turns for c in prompt_set.benchmarks.conversations} if prompt_set.benchmarks else {}
    shown["prompts"] = []
    for p in prompt_set.prompts:
        item: dict = {"id": p.id, "category": p.category}
        user_turns = turns.get(p.id) or p.turns
        if user_turns:
            item["messages"] = [{"role": "user", "content": user_turns[0]}]
            item["turns"] = list(user_turns)
        item["text"] = tokenizer.decode(list(p.input_ids))
        item["input_ids"] = list(p.input_ids)
        shown["prompts"].append(item)
    return shown


def _print(shown: dict) -> None:
    from rich.console import Console

    console = Console()
    if "protocol" in shown:
        console.print(f"protocol {shown['protocol']}" + (f", template arguments {shown['template_kwargs']}"
                                                         if "template_kwargs" in shown else ""), markup=False)
        for use in shown["benchmarks"]:
            console.print(f"  {use['name']}: {use['note']}", markup=False)
    if "stop_token_ids" in shown:
        console.print(f"stop token ids {shown['stop_token_ids']}", markup=False)
    for item in shown["prompts"]:
        console.rule(f"{item['id']}  ({item['category'] or 'no category'})")
        for k, turn in enumerate(item.get("turns", []), start=1):
            later = " (templated after the target's own answers to the turns before)" if k > 1 else ""
            console.print(f"user turn {k}{later}:", style="bold")
            console.print(turn, markup=False)
        if "text" in item:
            console.print("templated text:", style="bold")
            console.print(repr(item["text"]), markup=False)
            console.print(f"token ids ({len(item['input_ids'])}): {item['input_ids']}", markup=False)

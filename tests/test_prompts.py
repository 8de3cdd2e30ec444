"""Prompt sets: JSONL read into token ids with a real (tiny, trained) tokenizer with a chat template
(conftest's `tokenizer`)."""

import copy
import json
import re

import pytest
from tokenizers import processors

from dflash_core.prompts import (
    PROMPT_SUITES,
    Prompt,
    PromptError,
    prompt_set_identity,
    read_completions,
    read_prompts,
    resolve_prompts,
    turn_prompt_ids,
)
from dflash_eval.tiny import target as tiny_target

# A Qwen3-like template that reads `enable_thinking`: an empty think block when thinking is off.
THINKING_TEMPLATE = tiny_target.CHAT_TEMPLATE + (
    "{%- if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
    "{{- 'NO THINK\\n' }}"
    "{%- endif %}"
)


def write(tmp_path, *lines, name="prompts.jsonl"):
    """Write lines (dicts become JSON, strings are written as they are) and return the path."""
    path = tmp_path / name
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def error_of(path, tokenizer, **kwargs) -> str:
    with pytest.raises(PromptError) as info:
        read_prompts(path, tokenizer, **kwargs)
    return str(info.value)


def chat_ids(tokenizer, messages, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --- each kind of prompt


def test_each_kind_gives_the_expected_ids(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort a list of numbers."}]
    path = write(
        tmp_path,
        {"id": "t", "category": "code", "text": "def fibonacci(n):"},
        {"id": "m", "category": "chat", "messages": messages},
        {"id": "u", "turns": ["Write a haiku about tokenizers."]},
        {"id": "i", "input_ids": [5, 0, 299, 17]},
    )
    prompts = read_prompts(path, tokenizer)

    text_ids = tokenizer("def fibonacci(n):")["input_ids"]
    assert prompts[0] == Prompt("t", tuple(text_ids), "code", 1, "text")
    assert len(text_ids) > 3  # real tokenisation, not a stub

    expected = chat_ids(tokenizer, messages)
    assert prompts[1] == Prompt("m", tuple(expected), "chat", 2, "messages")
    assert tokenizer.decode(expected) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSort a list of numbers.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )

    one_user = chat_ids(tokenizer, [{"role": "user", "content": "Write a haiku about tokenizers."}])
    assert prompts[2] == Prompt("u", tuple(one_user), None, 3, "turns")
    assert prompts[2].input_ids[0] == tokenizer.convert_tokens_to_ids(tiny_target.IM_START_TOKEN)

    assert prompts[3] == Prompt("i", (5, 0, 299, 17), None, 4, "input_ids")


def test_text_gets_default_special_tokens_and_chat_template_adds_none(tmp_path, tokenizer):
    # A tokenizer that adds a BOS token (here the eos id, as some targets do) to plain text.
    with_bos = copy.deepcopy(tokenizer)
    bos = tokenizer.eos_token_id
    with_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tiny_target.EOS_TOKEN} $A", special_tokens=[(tiny_target.EOS_TOKEN, bos)]
    )
    path = write(tmp_path, {"id": "t", "text": "Sort"}, {"id": "u", "turns": ["Sort"]})
    text, turn = read_prompts(path, with_bos)
    assert text.input_ids == (bos, *tokenizer("Sort")["input_ids"])
    assert turn.input_ids == read_prompts(path, tokenizer)[1].input_ids  # the template's tokens only
    assert bos not in turn.input_ids


def test_turn_equals_the_same_single_user_message(tmp_path, tokenizer):
    content = "Sort a list of numbers."
    path = write(tmp_path, {"id": 1, "turns": [content]}, {"id": 2, "messages": [{"role": "user", "content": content}]})
    turn, message = read_prompts(path, tokenizer)
    assert turn.input_ids == message.input_ids
    assert (turn.source, message.source) == ("turns", "messages")


def test_thinking_flag_reaches_the_chat_template(tmp_path, tokenizer):
    thinking_tokenizer = copy.deepcopy(tokenizer)
    thinking_tokenizer.chat_template = THINKING_TEMPLATE
    path = write(tmp_path, {"id": "a", "turns": ["Be brief."]})
    off = read_prompts(path, thinking_tokenizer)[0].input_ids
    on = read_prompts(path, thinking_tokenizer, thinking=True)[0].input_ids
    assert thinking_tokenizer.decode(off).endswith("<|im_start|>assistant\nNO THINK\n")
    assert thinking_tokenizer.decode(on).endswith("<|im_start|>assistant\n")
    assert off != on


def test_int_ids_blank_lines_and_extra_fields(tmp_path, tokenizer):
    path = write(
        tmp_path,
        "",
        {"id": 7, "text": "Sort", "reference_answer": "ignored", "category": None},
        "   ",
        "",
        {"id": "7b", "input_ids": [1, 2], "category": "math"},
        "",
    )
    first, second = read_prompts(path, tokenizer)
    assert (first.id, first.line, first.category) == ("7", 2, None)
    assert (second.id, second.line, second.category) == ("7b", 5, "math")


def test_prompt_set_identity_leaves_out_lines_and_sources(tmp_path, tokenizer):
    ids = tokenizer("Sort a list")["input_ids"]
    text_path = write(tmp_path, {"id": "a", "category": "c", "text": "Sort a list"}, name="a.jsonl")
    ids_path = write(tmp_path, "", {"id": "a", "category": "c", "input_ids": ids}, name="b.jsonl")
    as_text = read_prompts(text_path, tokenizer)
    as_ids = read_prompts(ids_path, tokenizer)
    assert prompt_set_identity(as_text) == [{"id": "a", "category": "c", "input_ids": ids}]
    assert prompt_set_identity(as_ids) == prompt_set_identity(as_text)
    assert json.loads(json.dumps(prompt_set_identity(as_text))) == prompt_set_identity(as_text)


def test_vocab_size_bounds_ids(tmp_path, tokenizer):
    path = write(tmp_path, {"id": "a", "input_ids": [3, 299]})
    assert read_prompts(path, tokenizer, vocab_size=300)[0].input_ids == (3, 299)
    message = error_of(path, tokenizer, vocab_size=299)
    assert message.startswith(f"{path}:1: field 'input_ids': ")
    assert "299" in message and "vocabulary size 299" in message


# --- errors: file


def test_missing_file(tmp_path, tokenizer):
    path = tmp_path / "nope.jsonl"
    message = error_of(path, tokenizer)
    assert str(path) in message and "not found" in message


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, tokenizer, content):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    message = error_of(path, tokenizer)
    assert message.startswith(f"{path}: no prompts")


def test_not_json(tmp_path, tokenizer):
    path = write(tmp_path, {"id": "a", "text": "x"}, "", '{"id": "b", "text": "y"')
    message = error_of(path, tokenizer)
    assert message.startswith(f"{path}:3: not valid JSON")


def test_not_an_object(tmp_path, tokenizer):
    path = write(tmp_path, {"id": "a", "text": "x"}, '["b", "y"]')
    message = error_of(path, tokenizer)
    assert message.startswith(f"{path}:2: expected a JSON object, got a list")


# --- errors: id and category


def test_missing_id(tmp_path, tokenizer):
    message = error_of(write(tmp_path, {"text": "x"}), tokenizer)
    assert "prompts.jsonl:1: field 'id': missing" in message


@pytest.mark.parametrize("bad", [1.5, True, None, ["a"], ""])
def test_bad_id_type(tmp_path, tokenizer, bad):
    message = error_of(write(tmp_path, {"id": "ok", "text": "x"}, {"id": bad, "text": "x"}), tokenizer)
    assert "prompts.jsonl:2: field 'id': must" in message


def test_duplicate_id_names_both_lines(tmp_path, tokenizer):
    # an int id and the same string are the same id
    path = write(tmp_path, {"id": 3, "text": "x"}, {"id": "b", "text": "y"}, "", {"id": "3", "input_ids": [1]})
    message = error_of(path, tokenizer)
    assert message.startswith(f"{path}:4: field 'id': duplicate id '3', already used on line 1")


def test_bad_category(tmp_path, tokenizer):
    message = error_of(write(tmp_path, {"id": "a", "text": "x", "category": 3}), tokenizer)
    assert "prompts.jsonl:1: field 'category': must be a string" in message


# --- errors: prompt fields


def test_no_prompt_field(tmp_path, tokenizer):
    message = error_of(write(tmp_path, {"id": "a", "prompt": "x"}), tokenizer)
    assert "prompts.jsonl:1: " in message and "exactly one of" in message and "found none" in message


def test_two_prompt_fields_are_named(tmp_path, tokenizer):
    message = error_of(write(tmp_path, {"id": "a", "text": "x", "input_ids": [1]}), tokenizer)
    assert "prompts.jsonl:1: " in message and "found 'text' and 'input_ids'" in message


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("text", ["x"], "must be a string, got a list"),
        ("text", None, "must be a string, got null"),
        ("messages", "hi", "must be a list"),
        ("messages", [], "empty list"),
        ("messages", ["hi"], "message 0 must be an object"),
        ("messages", [{"role": "user", "content": "a"}, {"content": "b"}], 'message 1 needs a "role"'),
        ("messages", [{"role": "user", "content": ["a"]}], 'message 0 needs a "content" that is a string'),
        ("turns", "hi", "must be a list of strings"),
        ("turns", [], "empty list"),
        ("turns", [3], "turn 0 must be a string"),
        ("input_ids", "1 2", "must be a list of non-negative integers"),
        ("input_ids", [1, -2], "item 1 is -2"),
        ("input_ids", [1, 2.5], "item 1 is 2.5"),
        ("input_ids", [True], "item 0 is true"),
    ],
)
def test_wrong_types_name_the_field(tmp_path, tokenizer, field, value, expected):
    path = write(tmp_path, {"id": "ok", "text": "x"}, {"id": "a", field: value})
    message = error_of(path, tokenizer)
    assert message.startswith(f"{path}:2: field '{field}': ")
    assert expected in message




@pytest.mark.parametrize("field, value", [("text", ""), ("input_ids", [])])
def test_empty_prompt(tmp_path, tokenizer, field, value):
    message = error_of(write(tmp_path, {"id": "a", field: value}), tokenizer)
    assert f"prompts.jsonl:1: field '{field}': the prompt is empty" in message


@pytest.mark.parametrize("field, value", [("messages", [{"role": "user", "content": "x"}]), ("turns", ["x"])])
def test_no_chat_template(tmp_path, tokenizer, field, value):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    path = write(tmp_path, {"id": "a", "text": "fine"}, {"id": "b", field: value})
    assert read_prompts(write(tmp_path, {"id": "a", "text": "fine"}, name="ok.jsonl"), plain)[0].id == "a"
    message = error_of(path, plain)
    assert message.startswith(f"{path}:2: field '{field}': the target's tokenizer has no chat template")
    assert "`text`" in message and "`input_ids`" in message


def test_chat_template_failure_names_the_line(tmp_path, tokenizer):
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = "{{- raise_exception('roles must alternate') }}"
    message = error_of(write(tmp_path, {"id": "a", "messages": [{"role": "user", "content": "x"}]}), strict)
    assert "prompts.jsonl:1: field 'messages': the chat template failed" in message
    assert "roles must alternate" in message


# --- multi-turn prompts

TURNS = ["Write a haiku about tokenizers.", "Sort a list of numbers.", "Be brief."]


def test_multi_turn_prompt_is_the_first_turn_with_all_turns_kept(tmp_path, tokenizer):
    path = write(
        tmp_path,
        {"id": "mt", "category": "multiturn", "turns": TURNS},
        {"id": "one", "turns": [TURNS[0]]},
        {"id": "m", "messages": [{"role": "user", "content": TURNS[0]}]},
        {"id": "t", "text": "Sort"},
    )
    multi, one, message, text = read_prompts(path, tokenizer)
    first = chat_ids(tokenizer, [{"role": "user", "content": TURNS[0]}])
    assert multi == Prompt("mt", tuple(first), "multiturn", 1, "turns", tuple(TURNS))
    assert one.input_ids == multi.input_ids and one.turns == ()
    assert message.turns == () and text.turns == ()


def test_turn_prompt_ids_puts_the_answers_between_the_turns(tmp_path, tokenizer):
    (prompt,) = read_prompts(write(tmp_path, {"id": "mt", "turns": TURNS}), tokenizer)
    answer = "def fibonacci(n): return a"
    expected = chat_ids(
        tokenizer,
        [
            {"role": "user", "content": TURNS[0]},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": TURNS[1]},
        ],
    )
    second = turn_prompt_ids(tokenizer, prompt, [answer])
    assert second == expected
    assert all(isinstance(token, int) for token in second)
    assert second[: len(prompt.input_ids)] == list(prompt.input_ids)  # turn 1's prompt is a prefix here
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    assert any(second[i : i + len(answer_ids)] == answer_ids for i in range(len(second)))
    assert tokenizer.decode(second).endswith(f"<|im_start|>user\n{TURNS[1]}<|im_end|>\n<|im_start|>assistant\n")

    third = turn_prompt_ids(tokenizer, prompt, (answer, "Sorted."))
    assert tokenizer.decode(third).count("<|im_start|>assistant\n") == 3
    assert tokenizer.decode(third).endswith(f"{TURNS[2]}<|im_end|>\n<|im_start|>assistant\n")


def test_turn_prompt_ids_passes_thinking(tmp_path, tokenizer):
    thinking_tokenizer = copy.deepcopy(tokenizer)
    thinking_tokenizer.chat_template = THINKING_TEMPLATE
    (prompt,) = read_prompts(write(tmp_path, {"id": "mt", "turns": TURNS[:2]}), thinking_tokenizer)
    off = turn_prompt_ids(thinking_tokenizer, prompt, ["Sorted."])
    on = turn_prompt_ids(thinking_tokenizer, prompt, ["Sorted."], thinking=True)
    assert thinking_tokenizer.decode(off).endswith("<|im_start|>assistant\nNO THINK\n")
    assert thinking_tokenizer.decode(on).endswith("<|im_start|>assistant\n") and off != on


def test_turn_prompt_ids_range_errors(tmp_path, tokenizer):
    path = write(tmp_path, {"id": "mt", "turns": TURNS[:2]}, {"id": "one", "turns": ["Sort"]}, {"id": "t", "text": "x"})
    multi, one, text = read_prompts(path, tokenizer)
    with pytest.raises(ValueError, match="turn 1's prompt is `input_ids`"):
        turn_prompt_ids(tokenizer, multi, [])  # k = 1
    with pytest.raises(ValueError, match="has 2 turns; 2 answers ask for turn 3"):
        turn_prompt_ids(tokenizer, multi, ["a", "b"])
    for single in (one, text):
        with pytest.raises(ValueError, match="single-turn"):
            turn_prompt_ids(tokenizer, single, ["a"])
    with pytest.raises(ValueError, match="single string"):
        turn_prompt_ids(tokenizer, multi, "a")
    with pytest.raises(ValueError, match="answer 0 must be a string"):
        turn_prompt_ids(tokenizer, multi, [[1, 2]])


def test_prompt_set_identity_covers_the_turns(tmp_path, tokenizer):
    a = read_prompts(write(tmp_path, {"id": "mt", "turns": TURNS[:2]}, name="a.jsonl"), tokenizer)
    b = read_prompts(write(tmp_path, {"id": "mt", "turns": [TURNS[0], "Be brief."]}, name="b.jsonl"), tokenizer)
    assert a[0].input_ids == b[0].input_ids
    assert prompt_set_identity(a)[0]["turns"] == TURNS[:2]
    assert prompt_set_identity(a) != prompt_set_identity(b)
    single = read_prompts(write(tmp_path, {"id": "s", "turns": [TURNS[0]]}, name="c.jsonl"), tokenizer)
    assert "turns" not in prompt_set_identity(single)[0]


# --- shipped suites


@pytest.mark.parametrize("name", PROMPT_SUITES)
def test_each_suite_reads(tokenizer, name):
    path = resolve_prompts(name)
    assert path.name == f"{name}.jsonl" and path.is_file()
    prompts = read_prompts(path, tokenizer)
    assert len(prompts) >= 20
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.id.startswith(f"{name}-") for p in prompts)
    assert {p.category for p in prompts} == {name}
    if name == "multiturn":
        assert all(p.source == "turns" and len(p.turns) == 2 for p in prompts)
        for p in prompts:
            assert len(turn_prompt_ids(tokenizer, p, ["An answer."])) > len(p.input_ids)
    else:
        assert all(p.turns == () for p in prompts)


def test_suites_are_package_data():
    from importlib import resources

    suites = resources.files("dflash_core").joinpath("prompt_suites")
    for name in PROMPT_SUITES:
        assert suites.joinpath(f"{name}.jsonl").is_file()
        assert resolve_prompts(name).read_bytes() == suites.joinpath(f"{name}.jsonl").read_bytes()


def test_resolve_prompts_path_and_unknown_name(tmp_path):
    path = write(tmp_path, {"id": "a", "text": "x"})
    assert resolve_prompts(str(path)) == path
    with pytest.raises(PromptError) as info:
        resolve_prompts("maths")
    message = str(info.value)
    assert "maths" in message and all(name in message for name in PROMPT_SUITES)
    with pytest.raises(PromptError, match="math, code, chat, multiturn"):
        resolve_prompts(str(tmp_path / "missing.jsonl"))


# --- completions you already have (--references FILE)


def test_completions_as_ids_and_as_text(tmp_path, tokenizer):
    path = write(tmp_path, {"id": "a", "input_ids": [5, 6], "completion_ids": [7, 8], "category": "code"},
                 {"id": "b", "text": "def f(x):", "completion": " return x"},
                 {"id": "a", "input_ids": [5, 6], "completion_ids": [9]})
    a0, b, a1 = read_completions(path, tokenizer, vocab_size=len(tokenizer))
    assert (a0.id, a0.prompt, a0.input_ids, a0.completion_ids, a0.retokenized) == ("a#s0", "a", (5, 6), (7, 8), False)
    assert (a1.id, a1.prompt, a1.completion_ids) == ("a#s1", "a", (9,))
    assert (b.id, b.prompt, b.retokenized) == ("b", None, True)
    assert list(b.input_ids) == tokenizer("def f(x):")["input_ids"]
    assert list(b.completion_ids) == tokenizer.encode(" return x", add_special_tokens=False)


@pytest.mark.parametrize("line, expected", [
    ({"id": "a", "input_ids": [5], "completion_ids": []}, "prompts.jsonl:1: field 'completion_ids': is empty"),
    ({"id": "a", "input_ids": [5], "completion_ids": [5, 100000]}, "field 'completion_ids': id 100000 is not below"),
    ({"id": "a", "input_ids": [5, 100000], "completion_ids": [5]}, "field 'input_ids': token 1 is id 100000"),
    ({"id": "a", "completion_ids": [5]}, "needs 'input_ids' beside it"),
    ({"id": "a", "text": "x", "completion": ""}, "field 'completion': is empty"),
    ({"id": "a", "text": "x", "completion": 5}, "field 'completion': must be a string"),
    ({"id": "a", "text": "x"}, "a completion needs 'input_ids' and 'completion_ids'"),
    ({"input_ids": [5], "completion_ids": [6]}, "field 'id': missing"),
])
def test_bad_completion_lines_name_the_line_and_field(tmp_path, tokenizer, line, expected):
    path = write(tmp_path, line)
    with pytest.raises(PromptError, match=re.escape(expected)):
        read_completions(path, tokenizer, vocab_size=len(tokenizer))


@pytest.mark.parametrize("line", [
    {"id": "a", "input_ids": [5], "completion_ids": "5 6"},
    {"id": "a", "input_ids": [5], "completion_ids": [5, -1]},
    {"id": "a", "input_ids": [5], "completion_ids": [5, 6.0]},
])
def test_bad_completion_ids_are_named_as_completion_ids(tmp_path, tokenizer, line):
    with pytest.raises(PromptError, match="prompts.jsonl:1: field 'completion_ids': "):
        read_completions(write(tmp_path, line), tokenizer, vocab_size=len(tokenizer))


def _given(pid, prompt=(5, 6), completion=(7, 8)):
    return {"id": pid, "input_ids": list(prompt), "completion_ids": list(completion)}


# Lines whose ids collide: each references a completion by its id (`<id>#s<k>` for the samples of an id that
# repeats), so no two may end up with one id, and the lines of one id are samples of one prompt.
@pytest.mark.parametrize(("lines", "says"), [
    ([_given("p00"), _given("p00"), _given("p00#s0")],
     "prompts.jsonl:3: field 'id': 'p00#s0' names two completions: line 1's (sample 0 of 'p00', an id that repeats) "
     "and line 3's (its id); give one of them another id"),
    ([_given("p00#s1"), _given("p00"), _given("p00")],
     "prompts.jsonl:3: field 'id': 'p00#s1' names two completions: line 1's (its id) and line 3's (sample 1 of "
     "'p00', an id that repeats)"),
    ([_given("p00"), _given("p00", prompt=(5, 9))],
     "prompts.jsonl:2: field 'id': 'p00' is also line 1's id, with another prompt: the lines of one id are samples "
     "of one prompt; give this prompt an id of its own"),
    ([_given(7), _given("7", prompt=(1,))], "prompts.jsonl:2: field 'id': '7' is also line 1's id, with another "
                                            "prompt"),
    ([{"id": "q", "text": "def f(x):", "completion": " return x"}, {"id": "q", "text": "def g(x):", "completion": " x"}],
     "prompts.jsonl:2: field 'id': 'q' is also line 1's id, with another prompt"),
], ids=["a sample's id given", "a given id a later sample takes", "one id, two prompts", "an int and a string id",
        "one id, two text prompts"])
def test_completion_ids_that_collide_are_refused_naming_both_lines(tmp_path, tokenizer, lines, says):
    with pytest.raises(PromptError) as refused:
        read_completions(write(tmp_path, *lines), tokenizer, vocab_size=len(tokenizer))
    assert str(refused.value).startswith(f"{tmp_path}/{says}"), str(refused.value)


def test_samples_of_one_prompt_share_its_id_and_unique_ids_stand_beside_them(tmp_path, tokenizer):
    found = read_completions(write(tmp_path, _given("p00"), _given("p01"), _given("p00", completion=(9,)),
                                   _given("p00#s9")), tokenizer, vocab_size=len(tokenizer))
    assert [(c.id, c.prompt) for c in found] == [("p00#s0", "p00"), ("p01", None), ("p00#s1", "p00"),
                                                ("p00#s9", None)]

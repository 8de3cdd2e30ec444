"""Prompt sets: JSONL read into token ids with a real (tiny, trained) tokenizer with a chat template."""

import copy
import json

import pytest
from tokenizers import processors

from dflash_core import tiny_target
from dflash_core.prompts import Prompt, PromptError, prompt_set_identity, read_prompts

TRAINING_TEXT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    "Write a haiku about tokenizers. Sort a list of numbers. Be brief and answer the user.\n"
) * 20

# A Qwen3-like template that reads `enable_thinking`: an empty think block when thinking is off.
THINKING_TEMPLATE = tiny_target.CHAT_TEMPLATE + (
    "{%- if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
    "{{- 'NO THINK\\n' }}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_target.train_tokenizer(TRAINING_TEXT, vocab_size=300)


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


def test_several_turns_are_not_supported(tmp_path, tokenizer):
    message = error_of(write(tmp_path, {"id": "a", "turns": ["one", "two"]}), tokenizer)
    assert "prompts.jsonl:1: field 'turns': has 2 turns" in message
    assert "target's own answers between turns" in message and "one turn per line" in message


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

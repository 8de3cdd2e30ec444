"""Evaluation prompt sets: a JSONL file read into token ids with the target's tokenizer.

One JSON object per line (blank lines are skipped). Each object has an `id` (a
string, or an int that becomes a string; unique in the file), an optional
`category` (a string) and exactly one of four prompt fields:

    {"id": "p1", "category": "code", "text": "def fibonacci(n):"}
    {"id": "p2", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort a list."}]}
    {"id": 3, "turns": ["Write a haiku about tokenizers."]}
    {"id": "p4", "input_ids": [151644, 872, 198, 9707]}

- `text` is used verbatim: `tokenizer(text)["input_ids"]`, with the tokenizer's
  default special tokens (e.g. a BOS token where the tokenizer adds one).
- `messages` is rendered with the target's chat template, with the generation
  prompt added (`add_generation_prompt=True`) and `enable_thinking` passed to the
  template (Qwen3-style templates read it; others ignore it).
- `turns` is z-lab's format: the user turns of a conversation, a list of strings.
  One turn is the same as `messages` with one user message.
- `input_ids` are used as they are.

Other fields are ignored. Every problem raises `PromptError` naming the file,
the 1-based line and the field.

Multi-turn conversations (`turns` with several strings, e.g.
`{"id": "mt-1", "turns": ["Write a limerick.", "Now make it about cats."]}`) are
ONE `Prompt`: its `input_ids` are the first turn's prompt (the chat template over
[user turn 1], exactly as a single turn) and its `turns` field holds all the user
turns. Later turns need the target's own answers to the earlier ones, which only
exist once the target has answered: `turn_prompt_ids(tokenizer, prompt, answers)`
gives the prompt for turn k = len(answers) + 1, the chat template over
[user 1, assistant answers[0], user 2, ..., user k] with the generation prompt
added. The answers are the target's decoded reference answers (greedy, special
tokens skipped) to turns 1 .. k-1. Single-turn prompts (and `text`, `messages`,
`input_ids` prompts) have `turns == ()`.

Prompt suites ship with the package in `dflash_core/prompt_suites/` (`PROMPT_SUITES`:
math, code, chat, multiturn); `resolve_prompts(name_or_path)` turns a suite name or a
path into the JSONL file to read.

Completions you already have (`read_completions`, for `--references FILE`): one line per
completion, a prompt and what the target answered, e.g. a server's logged outputs at its
serving settings:

    {"id": "p1", "input_ids": [151644, 872], "completion_ids": [40, 1079, 151645]}
    {"id": "p2", "messages": [{"role": "user", "content": "Sort a list."}], "completion": "Use sorted()."}

`input_ids` + `completion_ids` are used as they are. A `text` or `messages` prompt (as above)
with a `completion` text is tokenized with the target's tokenizer, the completion without
special tokens, and flagged as re-tokenized (the ids a server emitted may differ). An id may
repeat: its lines are samples of one prompt (`<id>#s<k>`, k from 0 in file order), so they hold
the same prompt; a line whose id is one a sample takes (`p00#s0` beside two `p00`) is refused.
"""

import difflib
import json
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPT_FIELDS = ("text", "messages", "turns", "input_ids")

SUITES_DIR = Path(__file__).resolve().parent / "prompt_suites"
PROMPT_SUITES = ("math", "code", "chat", "multiturn")


class PromptError(ValueError):
    """A prompt file that cannot be read: the message names the file, line and field, and what to do."""


@dataclass(frozen=True)
class ChatFormat:
    """How a published protocol templates and tokenizes a conversation (dflash_core.published.protocols): the
    chat template rendered to text with the generation prompt and these arguments, then encoded with or without
    the tokenizer's special tokens. A prompt without one is templated straight to ids with `enable_thinking`."""

    template_kwargs: tuple[tuple[str, Any], ...] = ()
    special_tokens: bool = False

    def text(self, tokenizer, messages: list[dict]) -> str:
        """The templated text of `messages`."""
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **dict(self.template_kwargs))

    def ids(self, tokenizer, messages: list[dict]) -> list[int]:
        """The token ids the protocol feeds the target for `messages`."""
        return [int(t) for t in tokenizer.encode(self.text(tokenizer, messages),
                                                 add_special_tokens=self.special_tokens)]

    def identity(self) -> dict:
        return {"template_kwargs": dict(self.template_kwargs), "special_tokens": self.special_tokens}


@dataclass(frozen=True)
class Prompt:
    """One prompt of a set: its token ids and where it came from."""

    id: str
    input_ids: tuple[int, ...]
    category: str | None
    line: int  # 1-based line in the file
    source: str  # the field the prompt came from: "text", "messages", "turns" or "input_ids"
    # All the user turns of a multi-turn prompt (input_ids is the first turn's prompt);
    # empty for single-turn prompts and for text/messages/input_ids prompts.
    turns: tuple[str, ...] = ()
    chat: ChatFormat | None = None  # a published benchmark's prompt: how its protocol templates every turn


def _type_name(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Line:
    """Builds errors for one line of the file."""

    def __init__(self, path: Path, number: int):
        self.path = path
        self.number = number

    def error(self, message: str, field: str | None = None) -> PromptError:
        where = f"{self.path}:{self.number}: "
        if field is not None:
            where += f"field '{field}': "
        return PromptError(where + message)


def _read_id(record: dict, at: _Line) -> str:
    if "id" not in record:
        raise at.error("missing; give each prompt a unique string or integer id", "id")
    value = record["id"]
    if _is_int(value):
        return str(value)
    if not isinstance(value, str):
        raise at.error(f"must be a string or an integer, got {_type_name(value)}", "id")
    if not value:
        raise at.error("must not be empty; give each prompt a unique string or integer id", "id")
    return value


def _read_category(record: dict, at: _Line) -> str | None:
    value = record.get("category")
    if value is not None and not isinstance(value, str):
        raise at.error(f"must be a string (or left out), got {_type_name(value)}", "category")
    return value


def _validate_messages(messages, at: _Line) -> list[dict]:
    if not isinstance(messages, list):
        raise at.error(
            f'must be a list of {{"role": ..., "content": ...}} objects, got {_type_name(messages)}', "messages"
        )
    if not messages:
        raise at.error("is an empty list; give at least one message, e.g. one user message", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise at.error(
                f'message {i} must be an object {{"role": ..., "content": ...}}, got {_type_name(message)}', "messages"
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise at.error(
                f'message {i} needs a "role" that is a non-empty string (e.g. "user"), got {_type_name(role)}',
                "messages",
            )
        content = message.get("content")
        if not isinstance(content, str):
            raise at.error(f'message {i} needs a "content" that is a string, got {_type_name(content)}', "messages")
    return [dict(message) for message in messages]


def _read_turns(turns, at: _Line) -> list[str]:
    if not isinstance(turns, list):
        raise at.error(f"must be a list of strings (the user turns), got {_type_name(turns)}", "turns")
    if not turns:
        raise at.error("is an empty list; give one user turn", "turns")
    for i, turn in enumerate(turns):
        if not isinstance(turn, str):
            raise at.error(f"turn {i} must be a string, got {_type_name(turn)}", "turns")
    return turns


def _conversation(turns: Sequence[str], answers: Sequence[str]) -> list[dict]:
    """[user turns[0], assistant answers[0], user turns[1], ...] ending with user turn len(answers) + 1."""
    messages = [{"role": "user", "content": turns[0]}]
    for answer, turn in zip(answers, turns[1:]):
        messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": turn})
    return messages


_NO_CHAT_TEMPLATE = (
    "the target's tokenizer has no chat template; write the prompt as `text` (the exact string, "
    "template included) or as `input_ids` instead"
)


def _chat_template_ids(tokenizer, messages: list[dict], thinking: bool) -> list[int]:
    result = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, enable_thinking=thinking
    )
    # transformers 5 returns a BatchEncoding (a mapping); older versions a list of ids.
    ids = result["input_ids"] if isinstance(result, Mapping) else result
    return [int(token) for token in ids]


def _apply_chat_template(tokenizer, messages: list[dict], thinking: bool, field: str, at: _Line) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise at.error(_NO_CHAT_TEMPLATE, field)
    try:
        return _chat_template_ids(tokenizer, messages, thinking)
    except Exception as error:  # a template may raise on messages it does not accept (e.g. role order)
        raise at.error(f"the chat template failed on these messages: {error}", field) from error


def _read_input_ids(value, at: _Line, field: str = "input_ids") -> list[int]:
    if not isinstance(value, list):
        raise at.error(f"must be a list of non-negative integers, got {_type_name(value)}", field)
    for i, token in enumerate(value):
        if not _is_int(token) or token < 0:
            raise at.error(
                f"item {i} is {json.dumps(token)}; token ids must be non-negative integers", field
            )
    return value


def _read_record(record: dict, at: _Line, tokenizer, thinking: bool, vocab_size: int | None) -> Prompt:
    prompt_id = _read_id(record, at)
    category = _read_category(record, at)
    found = [name for name in PROMPT_FIELDS if name in record]
    if len(found) != 1:
        others = [name for name in record if name not in ("id", "category")]
        what = (f"none of them (its fields: {', '.join(repr(n) for n in others) or 'none'})" if not found
                else " and ".join(f"'{name}'" for name in found))
        raise at.error(
            f"a prompt needs exactly one of 'text', 'messages', 'turns' or 'input_ids'; found {what}; "
            "keep one prompt field per line"
        )
    (source,) = found
    value = record[source]
    if source == "text":
        if not isinstance(value, str):
            raise at.error(f"must be a string, got {_type_name(value)}", "text")
        ids = tokenizer(value)["input_ids"]
    elif source == "messages":
        ids = _apply_chat_template(tokenizer, _validate_messages(value, at), thinking, source, at)
    elif source == "turns":
        turns = _read_turns(value, at)
        ids = _apply_chat_template(tokenizer, _conversation(turns, []), thinking, source, at)
    else:
        ids = _read_input_ids(value, at)
    ids = tuple(int(token) for token in ids)
    all_turns = tuple(value) if source == "turns" and len(value) > 1 else ()
    if not ids:
        raise at.error("the prompt is empty (no tokens); give it some content or remove the line", source)
    if vocab_size is not None:
        for i, token in enumerate(ids):
            if token >= vocab_size:
                raise at.error(
                    f"token {i} is id {token}, not below the target's vocabulary size {vocab_size}; "
                    "the ids must come from the target's own tokenizer",
                    source,
                )
    return Prompt(id=prompt_id, input_ids=ids, category=category, line=at.number, source=source, turns=all_turns)


def _json_objects(path: Path, kind: str) -> Iterator[tuple[_Line, dict]]:
    """(line, object) for every non-blank line of a JSONL file; `kind` ("prompt file", "completions file")
    names it in the PromptError a missing, unreadable or malformed file or line raises."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise PromptError(f"{path}: {kind} not found; check the path") from None
    except IsADirectoryError:
        raise PromptError(f"{path} is a directory, not a {kind}; give the JSONL file in it") from None
    except OSError as error:
        raise PromptError(f"{path}: cannot read the {kind}: {error}") from error
    for number, raw in enumerate(data.split(b"\n"), start=1):
        at = _Line(path, number)
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as error:
            raise at.error(f"not valid UTF-8 ({error}); save the file as UTF-8") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise at.error(
                f"not valid JSON ({error.msg} at column {error.colno}); write one JSON object per line"
            ) from None
        if not isinstance(record, dict):
            raise at.error(f"expected a JSON object, got {_type_name(record)}; write one JSON object per line")
        yield at, record


def read_prompts(path, tokenizer, *, thinking: bool = False, vocab_size: int | None = None) -> list[Prompt]:
    """Read a JSONL prompt set (see the module docstring) into token ids, in file order.

    `tokenizer` is the target's Hugging Face tokenizer; `thinking` is passed to its chat
    template as `enable_thinking` for `messages`/`turns` prompts; with `vocab_size`, every
    token id must be below it. The first problem in the file raises `PromptError`.
    """
    prompts: list[Prompt] = []
    first_line_of: dict[str, int] = {}
    for at, record in _json_objects(Path(path), "prompt file"):
        prompt = _read_record(record, at, tokenizer, thinking, vocab_size)
        if prompt.id in first_line_of:
            raise at.error(
                f"duplicate id {prompt.id!r}, already used on line {first_line_of[prompt.id]}; ids must be unique "
                "in the file",
                "id",
            )
        first_line_of[prompt.id] = at.number
        prompts.append(prompt)
    if not prompts:
        raise PromptError(f"{path}: no prompts (the file is empty or only blank lines); write one JSON object per line")
    return prompts


def turn_prompt_ids(tokenizer, prompt: Prompt, answers: Sequence[str], thinking: bool = False) -> list[int]:
    """Token ids of the prompt for turn k = len(answers) + 1 of a multi-turn `prompt`.

    The chat template over [user turn 1, assistant answers[0], user turn 2, ..., user turn k],
    with the generation prompt added and `enable_thinking=thinking` (as `read_prompts`), or as the prompt's
    `chat` format says (a published benchmark's).
    `answers` are the target's own decoded answers to turns 1 .. k-1. Turn 1's prompt is
    `prompt.input_ids`; this is for 1 < k <= len(prompt.turns). Raises `ValueError` for k
    out of that range, an answer that is not a string, or a tokenizer without a chat template.
    """
    if isinstance(answers, str):
        # ValueError, as documented for every bad answer: callers catch one kind
        raise ValueError(  # noqa: TRY004
            "answers must be a sequence of strings (one per earlier turn), got a single string")
    answers = list(answers)
    k = len(answers) + 1
    if not prompt.turns:
        raise ValueError(
            f"prompt {prompt.id!r} is a single-turn prompt; its only prompt is `input_ids` "
            f"(asked for turn {k} with {len(answers)} answers)"
        )
    if not 1 < k <= len(prompt.turns):
        raise ValueError(
            f"prompt {prompt.id!r} has {len(prompt.turns)} turns; {len(answers)} answers ask for turn {k}; "
            f"give between 1 and {len(prompt.turns) - 1} answers (turn 1's prompt is `input_ids`)"
        )
    for i, answer in enumerate(answers):
        if not isinstance(answer, str):
            raise ValueError(  # noqa: TRY004
                f"answer {i} must be a string (the decoded answer), got {_type_name(answer)}")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"prompt {prompt.id!r}: {_NO_CHAT_TEMPLATE}")
    if prompt.chat is not None:
        return prompt.chat.ids(tokenizer, _conversation(prompt.turns, answers))
    return _chat_template_ids(tokenizer, _conversation(prompt.turns, answers), thinking)


def prompt_set_identity(prompts: list[Prompt]) -> list[dict]:
    """What identifies a prompt set, as JSON-able data: `[{"id", "category", "input_ids"[, "turns"]}]` in order.

    A cache key over the prompt set hashes this; the line numbers and source fields are left
    out, so the same prompts written another way (e.g. `text` or `input_ids`) give the same key.
    A multi-turn prompt adds its user `turns` (its later prompts depend on them), and a published
    benchmark's prompt its `chat` format (so do they); other prompts have neither key, so their
    identity is unchanged.
    """
    identity = []
    for p in prompts:
        item: dict[str, Any] = {"id": p.id, "category": p.category, "input_ids": list(p.input_ids)}
        if p.turns:
            item["turns"] = list(p.turns)
        if p.chat is not None:
            item["chat"] = p.chat.identity()
        identity.append(item)
    return identity


def resolve_prompts(name_or_path: str) -> Path:
    """The JSONL file for a shipped suite name (see `PROMPT_SUITES`) or a path to a user's file.

    A suite name always means the shipped suite (write `./math` for a local file named `math`);
    anything else must be an existing file, or `PromptError` lists the suites.
    """
    name_or_path = str(name_or_path)
    if name_or_path in PROMPT_SUITES:
        suite = SUITES_DIR / f"{name_or_path}.jsonl"
        if not suite.is_file():
            raise PromptError(f"prompt suite {name_or_path!r} is missing from the installation ({suite})")
        return suite
    path = Path(name_or_path)
    if path.is_file():
        return path
    if path.is_dir():
        raise PromptError(f"{name_or_path} is a directory, not a prompt file; give the JSONL file in it (or a suite: "
                          f"{', '.join(PROMPT_SUITES)})")
    from .published.benchmarks import ALIASES, BENCHMARKS  # (they import nothing of this module)

    near = difflib.get_close_matches(name_or_path.lower(), [*PROMPT_SUITES, *BENCHMARKS, *ALIASES], n=1, cutoff=0.6)
    raise PromptError(
        f"{name_or_path}: no such prompt file, and neither a prompt suite nor a published benchmark"
        + (f" (did you mean {near[0]}?)" if near else "") + f"; give a path to a JSONL file, a suite "
        f"({', '.join(PROMPT_SUITES)}) or published benchmarks ({', '.join([*BENCHMARKS, *ALIASES])})"
    )


@dataclass(frozen=True)
class GivenCompletion:
    """One line of a completions file (`read_completions`): a prompt and the target's completion of it."""

    id: str  # the line's id, `<id>#s<k>` when the id repeats (samples of one prompt)
    prompt: str | None  # the repeated id the line samples; None when it is unique in the file
    category: str | None
    input_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    retokenized: bool  # given as text: tokenized here, so not necessarily the ids the server emitted


def _read_completion(record: dict, at: _Line, tokenizer, thinking: bool, vocab_size: int | None):
    """(id, category, prompt ids, completion ids, retokenized) of one completions line."""
    if "completion_ids" in record:
        if "input_ids" not in record:
            raise at.error("needs 'input_ids' beside it (the prompt as token ids); or give the prompt as 'text' "
                           "or 'messages' with a 'completion' text", "completion_ids")
        prompt = _read_record({k: record[k] for k in ("id", "category", "input_ids") if k in record}, at, tokenizer,
                              thinking, vocab_size)
        completion = _read_input_ids(record["completion_ids"], at, "completion_ids")
        field, retokenized = "completion_ids", False
    elif "completion" in record:
        prompt_fields = {k: record[k] for k in ("id", "category", "text", "messages") if k in record}
        prompt = _read_record(prompt_fields, at, tokenizer, thinking, vocab_size)
        if not isinstance(record["completion"], str):
            raise at.error(f"must be a string, got {_type_name(record['completion'])}", "completion")
        completion = tokenizer.encode(record["completion"], add_special_tokens=False)
        field, retokenized = "completion", True
    else:
        raise at.error("a completion needs 'input_ids' and 'completion_ids' (token ids), or a 'text' or 'messages' "
                       "prompt and a 'completion' text")
    if not completion:
        raise at.error("is empty: a reference needs at least one completion token; leave the line out", field)
    if vocab_size is not None and (bad := [t for t in completion if t >= vocab_size]):
        raise at.error(f"id {bad[0]} is not below the target's vocabulary size {vocab_size}; the ids must come "
                       "from the target's own tokenizer", field)
    return prompt.id, prompt.category, prompt.input_ids, tuple(int(t) for t in completion), retokenized


def read_completions(path, tokenizer, *, thinking: bool = False, vocab_size: int | None = None) -> list[GivenCompletion]:
    """Read a completions file (see the module docstring), in file order; the first problem raises
    `PromptError` naming the file, line and field. Lines that share an id are samples of one prompt, so they must
    share its prompt; and no two completions may end up with one id (`p00#s0` given beside a `p00` that repeats)."""
    path = Path(path)
    lines = []
    for at, record in _json_objects(path, "completions file"):
        lines.append((at, *_read_completion(record, at, tokenizer, thinking, vocab_size)))
    if not lines:
        raise PromptError(f"{path}: no completions (the file is empty or only blank lines); write one JSON object "
                          "per line")
    counts = Counter(line_id for _, line_id, *_ in lines)
    first_of: dict[str, tuple[int, tuple[int, ...]]] = {}  # an id: its first line and prompt
    named: dict[str, tuple[int, str]] = {}  # a completion's id: its line, and how the line came to it
    seen: dict[str, int] = {}  # samples of each id so far
    completions = []
    for at, line_id, category, input_ids, completion_ids, retokenized in lines:
        first_line, first_prompt = first_of.setdefault(line_id, (at.number, input_ids))
        if input_ids != first_prompt:
            raise at.error(f"{line_id!r} is also line {first_line}'s id, with another prompt: the lines of one id "
                           "are samples of one prompt; give this prompt an id of its own", "id")
        k = seen[line_id] = seen.get(line_id, -1) + 1
        repeated = counts[line_id] > 1
        completion_id = f"{line_id}#s{k}" if repeated else line_id
        how = f"sample {k} of {line_id!r}, an id that repeats" if repeated else "its id"
        if completion_id in named:
            other, other_how = named[completion_id]
            raise at.error(f"{completion_id!r} names two completions: line {other}'s ({other_how}) and line "
                           f"{at.number}'s ({how}); give one of them another id", "id")
        named[completion_id] = (at.number, how)
        completions.append(GivenCompletion(completion_id, line_id if repeated else None, category, input_ids,
                                           completion_ids, retokenized))
    return completions

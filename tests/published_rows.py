"""Synthetic rows of the published benchmarks z-lab's DFlash benchmark reads, in each dataset's own schema.

What it is for. z-lab's benchmark code (tests/golden/make_published_golden.py runs three versions of it) turns
published Hugging Face datasets into prompts; the golden values it records, and the tests that compare our code
with them, need those datasets without the network. `rows(name)` gives deterministic stand-in rows with every
column of the real dataset (real names, real types), `write_layout(name, folder)` writes them as the hub
repository lays them out (same config folders, split file names and formats), so the real loading code runs on
them. Every row is identifiable: the field the prompt is made from carries `#NNNNN`, the row's index (for
livecodebench: its index in test.jsonl .. test6.jsonl read one after the other). The texts are short but vary:
newlines, braces, backslashes, a non-ASCII row, empty alpaca inputs and livecodebench starter codes.

    from tests.published_rows import DATASETS, rows, write_layout
    folder = write_layout("gsm8k", tmp_path)   # tmp_path/openai/gsm8k/main/test-00000-of-00001.parquet
"""

import json
from pathlib import Path

import datasets
import pyarrow.parquet as pq
from datasets import Features, List, Value

DATASETS = ("gsm8k", "math500", "aime24", "aime25", "alpaca", "mt-bench", "humaneval", "mbpp", "lbpp",
            "swe-bench", "livecodebench")

# The hub repository each dataset is published in (its layout is mirrored under write_layout's folder).
HUB_IDS = {
    "gsm8k": "openai/gsm8k",
    "math500": "HuggingFaceH4/MATH-500",
    "aime24": "HuggingFaceH4/aime_2024",
    "aime25": "MathArena/aime_2025",
    "alpaca": "tatsu-lab/alpaca",
    "mt-bench": "HuggingFaceH4/mt_bench_prompts",
    "humaneval": "openai/openai_humaneval",
    "mbpp": "google-research-datasets/mbpp",
    "lbpp": "CohereLabs/lbpp",
    "swe-bench": "princeton-nlp/SWE-bench_Lite",
    "livecodebench": "livecodebench/code_generation_lite",
}

# How many rows rows(name) gives by default: enough that the benchmark scripts' sample counts pick a subset.
COUNTS = {"gsm8k": 150, "math500": 140, "aime24": 30, "aime25": 30, "humaneval": 20, "mbpp": 140,
          "livecodebench": 150, "swe-bench": 130, "mt-bench": 10, "alpaca": 140, "lbpp": 20}

LIVECODEBENCH_FILES = ("test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl")

S, I64 = Value("string"), Value("int64")
FEATURES = {
    "gsm8k": Features({"question": S, "answer": S}),
    "math500": Features({"problem": S, "solution": S, "answer": S, "subject": S, "level": I64, "unique_id": S}),
    "aime24": Features({"id": I64, "problem": S, "solution": S, "answer": S, "url": S, "year": S}),
    "aime25": Features({"problem_idx": I64, "problem": S, "answer": I64, "problem_type": List(S)}),
    "alpaca": Features({"instruction": S, "input": S, "output": S, "text": S}),
    "mt-bench": Features({"prompt": List(S), "prompt_id": I64, "category": S, "reference": List(S)}),
    "humaneval": Features({"task_id": S, "prompt": S, "canonical_solution": S, "test": S, "entry_point": S}),
    "mbpp": Features({"source_file": S, "task_id": Value("int32"), "prompt": S, "code": S,
                      "test_imports": List(S), "test_list": List(S)}),
    "lbpp": Features({"task_id": S, "language": S, "title": S, "instruction": S, "completion": S, "test_file": S,
                      "test_list": List(S), "signature": S, "categories": List(S), "test_setup": S}),
    "swe-bench": Features({name: S for name in (
        "repo", "instance_id", "base_commit", "patch", "test_patch", "problem_statement", "hints_text",
        "created_at", "version", "FAIL_TO_PASS", "PASS_TO_PASS", "environment_setup_commit")}),
    "livecodebench": Features({name: S for name in (
        "question_title", "question_content", "platform", "question_id", "contest_id", "contest_date",
        "starter_code", "difficulty", "public_test_cases", "private_test_cases", "metadata")}),
}
# mbpp's other config: the same tasks, another schema (proves the loader picks `sanitized`).
MBPP_FULL = Features({"task_id": Value("int32"), "text": S, "code": S, "test_list": List(S),
                      "test_setup_code": S, "challenge_test_list": List(S)})

NAMES = ("Ada", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran")
SUBJECTS = ("Algebra", "Geometry", "Number Theory", "Precalculus", "Prealgebra", "Counting & Probability")
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
REPOS = ("django/django", "sympy/sympy", "astropy/astropy", "psf/requests", "pytest-dev/pytest")
PLATFORMS = ("leetcode", "atcoder", "leetcode", "codeforces")


def _tag(i: int) -> str:
    return f"#{i:05d}"


def _gsm8k(i):
    who, a, b = NAMES[i % 7], 3 + i % 11, 2 + i % 5
    question = f"Question {_tag(i)}: {who} has {a} apples and buys {b} more. How many apples are there now?"
    if i % 5 == 3:
        question += "\nAnswer with a number."
    if i % 7 == 2:
        question = f"Question {_tag(i)}: the set {{{a}, {b}}} has two elements; what is their sum?"
    if i == 7:
        question = f"Question {_tag(i)}: José buys {a} crêpes at 2 € each — how many euros does he pay?"
    return {"question": question, "answer": f"{who} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b}.\n#### {a + b}"}


def _math500(i):
    subject, a, b = SUBJECTS[i % 6], 1 + i % 9, 2 + i % 7
    problem = f"Problem {_tag(i)}: Compute $\\frac{{{a}}}{{{b}}} + {i % 4}$."
    if i % 4 == 1:
        problem += "\nExpress your answer as a common fraction."
    return {"problem": problem, "solution": f"We add: $\\frac{{{a}}}{{{b}}} + {i % 4} = \\boxed{{{a + b * (i % 4)}/{b}}}$.",
            "answer": f"\\frac{{{a + b * (i % 4)}}}{{{b}}}", "subject": subject, "level": 1 + i % 5,
            "unique_id": f"test/{subject.lower().replace(' ', '_')}/{100 + i}.json"}


def _aime24(i):
    part, number = ("I", "II")[i // 15], 1 + i % 15
    return {"id": 60 + i, "problem": f"AIME problem {_tag(i)}: find the remainder when ${i + 2}^{{{i + 3}}}$ is divided by $1000$.",
            "solution": f"By repeated squaring the remainder is $\\boxed{{{(i * 37) % 1000}}}$.",
            "answer": str((i * 37) % 1000),
            "url": f"https://artofproblemsolving.com/wiki/index.php/2024_AIME_{part}_Problems/Problem_{number}",
            "year": "2024"}


def _aime25(i):
    kinds = (["Algebra"], ["Geometry"], ["Combinatorics", "Number Theory"])[i % 3]
    return {"problem_idx": i + 1, "problem": f"Problem {_tag(i)}: let $n = {i + 5}$. Find the number of subsets of $\\{{1, \\dots, n\\}}$ of size $3$ modulo $1000$.",
            "answer": (i * 53) % 1000, "problem_type": kinds}


def _alpaca(i):
    instruction = f"Instruction {_tag(i)}: " + ("Summarize the text." if i % 2 else "Name a color of the rainbow.")
    given = f"Text {i}: the {{quick}} fox\njumps over C:\\dogs." if i % 2 else ""
    output = f"Output {i}."
    head = "Below is an instruction that describes a task"
    if given:
        text = (f"{head}, paired with an input that provides further context. Write a response that appropriately "
                f"completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{given}\n\n### Response:\n{output}")
    else:
        text = (f"{head}. Write a response that appropriately completes the request.\n\n"
                f"### Instruction:\n{instruction}\n\n### Response:\n{output}")
    return {"instruction": instruction, "input": given, "output": output, "text": text}


def _mt_bench(i):
    category = CATEGORIES[i % 8]
    first = f"Turn one {_tag(i)}: write a short {category} piece about the number {i}."
    if i == 3:
        first += "\nUse a dict like {\"k\": 1} and a path like C:\\tmp."
    return {"prompt": [first, f"Now rewrite your previous answer for {category} {i} in two sentences."],
            "prompt_id": 1000 + i * 37, "category": category,
            "reference": [f"Reference {i}a", f"Reference {i}b"] if category in ("math", "reasoning", "coding") else []}


def _humaneval(i):
    prompt = (f"\n\ndef func_{i}(x: int) -> int:\n    \"\"\" Case {_tag(i)}: return x plus {i}.\n"
              f"    >>> func_{i}(1)\n    {i + 1}\n    \"\"\"\n")
    return {"task_id": f"HumanEval/{i}", "prompt": prompt, "canonical_solution": f"    return x + {i}\n",
            "test": f"\n\nMETADATA = {{}}\n\n\ndef check(candidate):\n    assert candidate(1) == {i + 1}\n",
            "entry_point": f"func_{i}"}


def _mbpp(i):
    return {"source_file": "Benchmark Questions Verification V2.ipynb", "task_id": 11 + i,
            "prompt": f"Write a function {_tag(i)} that returns the {i % 4 + 1}-th power of a number.",
            "code": f"def power_{i}(x):\n    return x ** {i % 4 + 1}",
            "test_imports": ["import math"] if i % 3 == 0 else [],
            "test_list": [f"assert power_{i}(2) == {2 ** (i % 4 + 1)}", f"assert power_{i}(1) == 1"]}


def _mbpp_full(i):
    return {"task_id": 11 + i, "text": f"Full config text {i}: write a function.", "code": "def f():\n    pass",
            "test_list": ["assert f() is None"], "test_setup_code": "", "challenge_test_list": []}


def _lbpp(i):
    return {"task_id": f"lbpp/{i}", "language": "python", "title": f"merge_intervals_{i}",
            "instruction": f"Task {_tag(i)}: write merge_{i}(xs: list[tuple[int, int]]) that merges overlapping intervals.\nReturn a list.",
            "completion": f"def merge_{i}(xs):\n    return sorted(xs)\n", "test_file": f"def test_{i}():\n    assert merge_{i}([]) == []\n",
            "test_list": [f"assert merge_{i}([]) == []"], "signature": f"def merge_{i}(xs: list[tuple[int, int]]) -> list:",
            "categories": ["lists", "sorting"] if i % 2 else ["lists"], "test_setup": ""}


def _swe_bench(i):
    repo = REPOS[i % 5]
    statement = f"Issue {_tag(i)}: `{repo.split('/')[1]}.utils.parse` fails on input {{'a': {i}}}.\n\nSteps: call parse('x\\\\y')."
    return {"repo": repo, "instance_id": f"{repo.replace('/', '__')}-{10000 + i}", "base_commit": f"{i:040x}",
            "patch": f"diff --git a/utils.py b/utils.py\n+    return {i}\n", "test_patch": "diff --git a/test_utils.py b/test_utils.py\n",
            "problem_statement": statement, "hints_text": "" if i % 3 else f"Hint {i}.",
            "created_at": f"2023-{1 + i % 12:02d}-{1 + i % 28:02d}T10:00:00Z", "version": f"{3 + i % 2}.{i % 3}",
            "FAIL_TO_PASS": json.dumps([f"tests/test_utils.py::test_{i}"]), "PASS_TO_PASS": "[]",
            "environment_setup_commit": f"{i + 1:040x}"}


def _livecodebench(i):
    platform = PLATFORMS[i % 4]
    content = f"Problem {_tag(i)}: given an array nums of length n, return the sum of nums[i] * {i % 9 + 1}.\n\nConstraints: 1 <= n <= 10^5"
    starter = f"class Solution:\n    def solve_{i}(self, nums: List[int]) -> int:\n        " if platform == "leetcode" else ""
    return {"question_title": f"sum-times-{i}", "question_content": content, "platform": platform,
            "question_id": str(3000 + i) if platform == "leetcode" else f"abc{300 + i}_a", "contest_id": f"contest-{i // 4}",
            "contest_date": f"2024-{1 + i % 12:02d}-{1 + i % 28:02d}T00:00:00", "starter_code": starter,
            "difficulty": ("easy", "medium", "hard")[i % 3],
            "public_test_cases": json.dumps([{"input": "[1, 2]", "output": str(3 * (i % 9 + 1)), "testtype": "functional"}]),
            "private_test_cases": f"eJzLSM3JyVcozy/KSVEEAB{i:04d}",
            "metadata": json.dumps({"func_name": f"solve_{i}"}) if starter else "{}"}


ROW = {"gsm8k": _gsm8k, "math500": _math500, "aime24": _aime24, "aime25": _aime25, "alpaca": _alpaca,
       "mt-bench": _mt_bench, "humaneval": _humaneval, "mbpp": _mbpp, "lbpp": _lbpp, "swe-bench": _swe_bench,
       "livecodebench": _livecodebench}


def rows(name: str, count: int | None = None) -> list[dict]:
    """`count` rows (default COUNTS[name]) of dataset `name` in its schema; row i carries `#{i:05d}`."""
    return [ROW[name](i) for i in range(COUNTS[name] if count is None else count)]


def _parquet(rows_: list[dict], features: Features, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)  # (the Arrow table keeps the features as hub files do)
    pq.write_table(datasets.Dataset.from_list(rows_, features=features).data.table, path)


def _jsonl(rows_: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows_), encoding="utf-8")


def write_layout(name: str, folder, count: int | None = None) -> Path:
    """Write rows(name, count) under folder/<hub id>/ as the hub repository holds them; return that folder."""
    root = Path(folder) / HUB_IDS[name]
    data, features = rows(name, count), FEATURES[name]
    one = "-00000-of-00001.parquet"
    if name == "gsm8k":
        _parquet(data, features, root / "main" / f"test{one}")
    elif name == "math500":
        _jsonl(data, root / "test.jsonl")
    elif name in ("aime24", "aime25", "mt-bench"):
        _parquet(data, features, root / "data" / f"train{one}")
    elif name == "alpaca":
        _parquet(data, features, root / "data" / "train-00000-of-00001-a09b74b3ef9c3b56.parquet")
    elif name == "humaneval":
        _parquet(data, features, root / "openai_humaneval" / f"test{one}")
    elif name == "mbpp":
        _parquet(data, features, root / "sanitized" / f"test{one}")
        _parquet([_mbpp_full(i) for i in range(len(data))], MBPP_FULL, root / "full" / f"test{one}")
    elif name == "lbpp":
        _parquet(data, features, root / "python" / "test.parquet")
    elif name == "swe-bench":
        _parquet(data, features, root / "data" / f"test{one}")
        _parquet([_swe_bench(10_000 + i) for i in range(5)], features, root / "data" / f"dev{one}")
    elif name == "livecodebench":
        per_file, extra = divmod(len(data), len(LIVECODEBENCH_FILES))
        start = 0
        for k, file_name in enumerate(LIVECODEBENCH_FILES):
            end = start + per_file + (k < extra)
            _jsonl(data[start:end], root / file_name)
            start = end
    else:
        raise ValueError(f"unknown dataset {name!r}")
    return root

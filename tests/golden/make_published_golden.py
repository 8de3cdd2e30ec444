"""Record published_prompts.json: how z-lab's own benchmark code turns the published benchmarks into prompts.

What it records. Three versions of z-lab's DFlash benchmark ("protocols"), each run through its real entry point
on the synthetic rows of tests/published_rows.py, laid out as the hub repositories lay them out:

- `zlab-2026-01`: github.com/z-lab/dflash at 98bde5f (the paper era): `benchmark.py`'s `main()` with the
  per-dataset sample counts of its `run_benchmark.sh`, datasets loaded by `model/utils.py`'s
  `load_and_process_dataset` (11 datasets), `dataset.shuffle(seed=0).select(range(n))` when a dataset has more
  rows than n, the chat template with `enable_thinking=False`, `tokenizer.encode(text)` (default special
  tokens), stop ids `[tokenizer.eos_token_id]`.
- `zlab-2026-04`: github.com/z-lab/dflash at 44947fb: `dflash/benchmark.py`'s `main()` with `--backend
  transformers` (`_run_transformers`; 5 datasets, cached as JSONL under its CACHE_DIR, pointed at a temporary
  folder), `--max-samples` left out or 16, and `--enable-thinking` (gsm8k, all rows).
- `dflash-0.1`: the PyPI wheel `dflash` 0.1.0: `dflash.cli.main(["benchmark", "transformers", ...])`
  (`_run_transformers`: `random.Random(42)` order even without --max-samples, `encode(...,
  add_special_tokens=False)`, stop ids from the target's generation_config), `--reasoning` left out (5 datasets),
  off and on (gsm8k and mt-bench), and high with a template that reads `reasoning_effort` (gsm8k, mt-bench).

Per case (`<protocol>|<tokenizer>|<reasoning>|<max samples>`) and dataset, in the order the code runs them:
the row (its index in rows(name); livecodebench: in test.jsonl .. test6.jsonl read in turn), the user turns the
code formatted, the token ids it fed the target for each turn (turn k after the fake answer to turns 1 .. k-1)
and the stop ids it passed. `subsets`: the rows each protocol's selection picks, in run order, at the REAL
published row counts with the protocol's sample count (a synthetic dataset of that many rows, run through the
same entry point). `metadata`: versions, commits, the fake answer, the generation_config eos list, the
tokenizers, the template arguments each case passed.

Only the hardware and the models are replaced: torch.cuda.set_device (a no-op), the "cuda:0" device of 0.1.0's
warmup (torch.device gives the CPU while the run lasts), model loading (a fake target with a `device` and a
`generation_config`, a fake drafter with a `block_size` and a `mask_token_id`), and `dflash_generate`, replaced
by a recorder that keeps each call's input ids and stop ids and answers `input ids + ANSWER's ids + eos` (so
the code decodes it, with skip_special_tokens, into the next turn's assistant message). The tokenizer is ours
(AutoTokenizer.from_pretrained / load_transformers_models hand it out, wrapped to note the messages it
renders), and `datasets.load_dataset` (in the namespace each version calls it from) maps z-lab's hub ids and
URLs onto the local layout, calling the real `datasets.load_dataset` ("parquet" / "json", data_files=...). No
z-lab code is copied into this repository: the git trees are exported to a temporary folder, the wheel is
imported where it is installed.

The tokenizers (saved under published/, read with AutoTokenizer.from_pretrained): `chatml/` is the tiny
target's tokenizer (the one dflash010/target/ was trained with: a tiny run's target/ folder) with a ChatML
template that reads `enable_thinking` (an empty think block when it is false, as Qwen3's does); `bos/` the same
vocabulary plus `<|begin_of_text|>` (id 512), which `encode` puts first (a post-processor) and the template
writes first too (as Llama 3's does), so `encode(text)` gives two BOS ids and `add_special_tokens=False` one;
`effort/` chatml with a template that reads `reasoning_effort` and not `enable_thinking`.

Run it once, in a venv with what the three versions import (CPU torch):

    python3 -m venv /tmp/zlabvenv
    /tmp/zlabvenv/bin/pip install torch==2.13.0 'transformers>=4.57,<6' datasets numpy tqdm rich loguru requests
    /tmp/zlabvenv/bin/pip install --no-deps dflash==0.1.0        # (or the downloaded wheel)
    git clone https://github.com/z-lab/dflash /tmp/zlab-dflash
    /tmp/zlabvenv/bin/python tests/golden/make_published_golden.py --zlab-repo /tmp/zlab-dflash \\
        [--tokenizer-from ~/.cache/dflash-eval/tiny/<key>/target]

Without --tokenizer-from it rebuilds bos/ and effort/ from the chatml/ already here. It imports only torch,
transformers, tokenizers, datasets and z-lab's code, and tests/published_rows.py (nothing else from this
repository). Each case runs in a fresh interpreter (z-lab's modules keep global state: random seeds, caches).
"""

import argparse
import contextlib
import copy
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))
from tests.published_rows import COUNTS, DATASETS, HUB_IDS, LIVECODEBENCH_FILES, write_layout  # noqa: E402

GOLDEN = HERE / "published_prompts.json"
TOKENIZERS = HERE / "published"
PAPER_COMMIT, HEAD_COMMIT = "98bde5f", "44947fb"
ANSWER = "The answer is 42. Done."
GENERATION_EOS = [2, 0]  # the fake target's generation_config.eos_token_id: <|im_end|>, <|endoftext|> (as Qwen3's)
BLOCK_SIZE, MASK_TOKEN_ID = 16, 3
BOS_TOKEN = "<|begin_of_text|>"
# run_benchmark.sh at 98bde5f (lbpp is not in it: no --max-samples)
RUN_BENCHMARK_COUNTS = {"gsm8k": 128, "math500": 128, "aime24": 30, "aime25": 30, "humaneval": 164, "mbpp": 128,
                        "livecodebench": 128, "swe-bench": 128, "mt-bench": 80, "alpaca": 128, "lbpp": None}
LATER_DATASETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")  # zlab-2026-04 and dflash-0.1
REASONING_DATASETS = ("gsm8k", "mt-bench")  # dflash-0.1's --reasoning off/on/high cases (one and two turns)
# The published datasets' real row counts (mbpp: the sanitized test split; livecodebench: release v6, 6 files)
REAL_COUNTS = {"gsm8k": 1319, "math500": 500, "aime24": 30, "aime25": 30, "humaneval": 164, "mbpp": 257,
               "mt-bench": 80, "alpaca": 52002, "swe-bench": 300, "livecodebench": 1055}
SUBSET_SAMPLES = 128  # zlab-2026-04 and dflash-0.1 subsets: --max-samples 128
MODEL = {"zlab-2026-01": "Qwen/Qwen3-4B", "zlab-2026-04": "Qwen/Qwen3-Coder-30B-A3B-Instruct",
         "dflash-0.1": "Qwen/Qwen3-8B"}  # names only (the checks of 44947fb read it); the tokenizer is ours

# The tiny target's ChatML template, and what each folder adds to it.
CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
TEMPLATES = {
    "chatml": CHATML,
    "bos": "{{- bos_token }}" + CHATML,
    "effort": (
        "{%- if reasoning_effort is defined %}{{- '<|im_start|>system\\nReasoning: ' + reasoning_effort + "
        "'<|im_end|>\\n' }}{%- endif %}" + CHATML.split("{%- if enable_thinking")[0] + "{%- endif %}"
    ),
}


# --------------------------------------------------------------------------- tokenizers


def build_tokenizers(source: Path | None) -> None:
    """published/chatml, bos, effort from `source` (a tiny run's target/ folder) or from the chatml/ here."""
    from tokenizers import AddedToken, Tokenizer, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    base = AutoTokenizer.from_pretrained(source or TOKENIZERS / "chatml")
    specials = {"eos_token": base.eos_token, "pad_token": base.pad_token, "mask_token": base.mask_token,
                "extra_special_tokens": list(base.extra_special_tokens), "clean_up_tokenization_spaces": False}
    with tempfile.TemporaryDirectory() as scratch:
        base.save_pretrained(scratch)
        backend = Tokenizer.from_file(str(Path(scratch) / "tokenizer.json"))
    folders = {}
    for name in ("chatml", "effort"):
        folders[name] = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(backend.to_str()),
                                                chat_template=TEMPLATES[name], **specials)
    with_bos = Tokenizer.from_str(backend.to_str())
    with_bos.add_special_tokens([AddedToken(BOS_TOKEN, special=True, normalized=False)])
    bos_id = with_bos.token_to_id(BOS_TOKEN)
    with_bos.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)])
    folders["bos"] = PreTrainedTokenizerFast(tokenizer_object=with_bos, bos_token=BOS_TOKEN,
                                             chat_template=TEMPLATES["bos"], **specials)
    for name, tokenizer in folders.items():
        if (TOKENIZERS / name).exists():
            shutil.rmtree(TOKENIZERS / name)
        tokenizer.save_pretrained(TOKENIZERS / name)
    # what the folders are for, checked as the tests will load them
    chatml, bos = (AutoTokenizer.from_pretrained(TOKENIZERS / name) for name in ("chatml", "bos"))
    assert chatml.encode("x y") == chatml.encode("x y", add_special_tokens=False)
    assert bos.encode("x y") == [bos_id] + chatml.encode("x y") == [bos_id] + bos.encode("x y", add_special_tokens=False)
    assert chatml.get_vocab() == {k: v for k, v in bos.get_vocab().items() if k != BOS_TOKEN}


def tokenizer_metadata() -> dict:
    from transformers import AutoTokenizer

    info = {}
    for name in ("chatml", "bos", "effort"):
        tokenizer = AutoTokenizer.from_pretrained(TOKENIZERS / name)
        info[name] = {"folder": f"tests/golden/published/{name}", "vocab_size": len(tokenizer),
                      "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id,
                      "encode_adds": tokenizer.encode("x", add_special_tokens=True)[:-len(tokenizer.encode("x", add_special_tokens=False))] or [],
                      "template_reads": [word for word in ("enable_thinking", "reasoning_effort", "bos_token")
                                         if word in tokenizer.chat_template]}
    return info


# --------------------------------------------------------------------------- the worker: one case, fresh process


class Recording:
    """The tokenizer, noting each chat template call's messages and arguments."""

    def __init__(self, tokenizer):
        self._tokenizer, self.renders = tokenizer, []

    def apply_chat_template(self, messages, **kwargs):
        self.renders.append((copy.deepcopy(messages), dict(kwargs)))
        return self._tokenizer.apply_chat_template(messages, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


class FakeModel:
    """A target (device, generation_config) or drafter (block_size, mask_token_id): no weights."""

    def __init__(self, **fields):
        import torch

        self.device = torch.device("cpu")
        self.__dict__.update(fields)

    def to(self, *args, **kwargs):
        return self

    def eval(self):
        return self


def fake_target():
    return FakeModel(generation_config=SimpleNamespace(eos_token_id=list(GENERATION_EOS)),
                     config=SimpleNamespace(model_type="qwen3"))


def fake_drafter():
    return FakeModel(block_size=BLOCK_SIZE, mask_token_id=MASK_TOKEN_ID, config=SimpleNamespace())


def local_load_dataset(real, hub: Path):
    """datasets.load_dataset for z-lab's calls, on the local layout (the real function, on local files)."""
    files_of = {
        ("openai/gsm8k", "main"): ("parquet", "main/{split}-*.parquet"),
        ("HuggingFaceH4/MATH-500", None): ("json", "{split}.jsonl"),
        ("HuggingFaceH4/aime_2024", None): ("parquet", "data/{split}-*.parquet"),
        ("MathArena/aime_2025", None): ("parquet", "data/{split}-*.parquet"),
        ("tatsu-lab/alpaca", None): ("parquet", "data/{split}-*.parquet"),
        ("HuggingFaceH4/mt_bench_prompts", None): ("parquet", "data/{split}-*.parquet"),
        ("openai/openai_humaneval", None): ("parquet", "openai_humaneval/{split}-*.parquet"),
        ("google-research-datasets/mbpp", "sanitized"): ("parquet", "sanitized/{split}-*.parquet"),
        ("princeton-nlp/SWE-bench_Lite", None): ("parquet", "data/{split}-*.parquet"),
    }
    url_prefix = "https://huggingface.co/datasets/"

    def load_dataset(path, name=None, *, split=None, data_files=None, **kwargs):
        assert not kwargs, kwargs
        if path in ("parquet", "json"):  # lbpp, livecodebench: files by URL
            def local(url):
                repo, _, file = url.removeprefix(url_prefix).partition("/resolve/main/")
                assert url.startswith(url_prefix) and (hub / repo / file).is_file(), url
                return str(hub / repo / file)
            data_files = {key: [local(u) for u in ([urls] if isinstance(urls, str) else urls)]
                          for key, urls in data_files.items()}
            return real(path, data_files=data_files, split=split)
        assert data_files is None and split is not None, (path, name, split)
        kind, pattern = files_of[(path, name)]
        files = sorted(str(f) for f in (hub / path).glob(pattern.format(split=split)))
        assert files, (path, name, split)
        return real(kind, data_files={split: files}, split=split)

    return load_dataset


def recorder(real_generate, tokenizer: Recording, answer_ids: list[int], calls: list):
    """dflash_generate's stand-in: note the call, answer input + ANSWER + eos."""
    import torch

    signature = inspect.signature(real_generate)

    def dflash_generate(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        input_ids = arguments["input_ids"]
        assert input_ids.shape[0] == 1 and input_ids.dtype == torch.long
        messages, template_kwargs = tokenizer.renders[-1]
        calls.append({"input_ids": input_ids[0].tolist(), "stop_token_ids": arguments.get("stop_token_ids"),
                      "block_size": arguments.get("block_size"), "messages": messages,
                      "template_kwargs": template_kwargs})
        output_ids = torch.cat([input_ids, torch.tensor([answer_ids], dtype=torch.long)], dim=1)
        return SimpleNamespace(output_ids=output_ids, num_input_tokens=input_ids.shape[1],
                               num_output_tokens=len(answer_ids), time_to_first_token=1.0,
                               time_per_output_token=1.0, acceptance_lengths=[1])

    return dflash_generate


def conversations(calls: list) -> tuple[list[dict], list[dict]]:
    """The calls of one run as conversations (each turn: the calls for block sizes 1 and 16 agree), and the
    warmup calls (dflash-0.1: no stop ids)."""
    warmups = [c for c in calls if c["stop_token_ids"] is None]
    turns: list[list[dict]] = []
    for call in (c for c in calls if c["stop_token_ids"] is not None):
        if turns and turns[-1][0]["messages"] == call["messages"]:
            turns[-1].append(call)
        else:
            turns.append([call])
    result: list[dict] = []
    for turn in turns:
        assert sorted(c["block_size"] for c in turn) == [1, BLOCK_SIZE], [c["block_size"] for c in turn]
        assert all(c["input_ids"] == turn[0]["input_ids"] and c["stop_token_ids"] == turn[0]["stop_token_ids"]
                   for c in turn)
        call = turn[0]
        users = [m["content"] for m in call["messages"] if m["role"] == "user"]
        assistants = [m["content"] for m in call["messages"] if m["role"] == "assistant"]
        assert assistants == [ANSWER] * (len(users) - 1), assistants  # the fake answer, decoded, came back
        if len(users) == 1:  # a new conversation: its row from the `#NNNNN` of the row's prompt field
            row = int(re.search(r"#(\d{5})", users[0]).group(1))
            result.append({"row": row, "turns": [], "input_ids": [], "stop_token_ids": list(call["stop_token_ids"])})
        entry = result[-1]
        assert entry["turns"] == users[:-1] and entry["stop_token_ids"] == list(call["stop_token_ids"])
        entry["turns"] = users
        entry["input_ids"].append(call["input_ids"])
    return result, warmups


def worker(spec: dict) -> dict:
    scratch = Path(spec["scratch"])
    import datasets
    import torch
    import transformers

    hub = scratch / "hub"
    for name in spec["datasets"]:
        write_layout(name, hub, spec["rows"].get(name))
    tokenizer = Recording(transformers.AutoTokenizer.from_pretrained(TOKENIZERS / spec["tokenizer"]))
    answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert tokenizer.decode(answer_ids, skip_special_tokens=True) == ANSWER
    calls: list = []
    loader = local_load_dataset(datasets.load_dataset, hub)
    torch.cuda.set_device = lambda *args, **kwargs: None
    transformers.AutoModelForCausalLM.from_pretrained = staticmethod(lambda *args, **kwargs: fake_target())
    transformers.AutoTokenizer.from_pretrained = staticmethod(lambda *args, **kwargs: tokenizer)
    protocol, results, settings = spec["protocol"], {}, set()

    if protocol == "zlab-2026-01":
        sys.path.insert(0, spec["tree"])
        import benchmark
        import model.utils

        benchmark.dflash_generate = recorder(benchmark.dflash_generate, tokenizer, answer_ids, calls)
        benchmark.DFlashDraftModel = SimpleNamespace(from_pretrained=lambda *args, **kwargs: fake_drafter())
        model.utils.load_dataset = loader
        entry_point = benchmark.main
    elif protocol == "zlab-2026-04":
        sys.path.insert(0, spec["tree"])
        import dflash.benchmark
        import dflash.model

        assert Path(dflash.benchmark.__file__).is_relative_to(spec["tree"])
        dflash.benchmark.CACHE_DIR = scratch / "cache"
        dflash.model.dflash_generate = recorder(dflash.model.dflash_generate, tokenizer, answer_ids, calls)
        dflash.model.DFlashDraftModel = SimpleNamespace(from_pretrained=lambda *args, **kwargs: fake_drafter())
        datasets.load_dataset = loader
        entry_point = dflash.benchmark.main
    else:
        import dflash.benchmark
        import dflash.cli
        import dflash.model

        assert version("dflash") == "0.1.0"
        dflash.model.dflash_generate = recorder(dflash.model.dflash_generate, tokenizer, answer_ids, calls)
        dflash.benchmark.load_transformers_models = lambda *args: (fake_target(), fake_drafter(), tokenizer)
        datasets.load_dataset = loader

    for name in spec["datasets"]:
        calls.clear()
        count = spec["max_samples"].get(name)
        if protocol == "zlab-2026-01":
            argv = ["benchmark.py", "--model-name-or-path", MODEL[protocol], "--draft-name-or-path",
                    "z-lab/Qwen3-4B-DFlash-b16", "--dataset", name, "--max-new-tokens", "2048", "--temperature", "0.0"]
        elif protocol == "zlab-2026-04":
            argv = ["benchmark", "--backend", "transformers", "--model", MODEL[protocol], "--draft-model",
                    "z-lab/Qwen3-Coder-30B-A3B-DFlash", "--dataset", name]
            argv += ["--enable-thinking"] if spec["reasoning"] == "on" else []
        else:
            argv = ["dflash", "benchmark", "transformers", "--model", MODEL[protocol], "--draft",
                    "z-lab/Qwen3-8B-DFlash-b16", "--dataset", name]
            argv += ["--reasoning", spec["reasoning"]] if spec["reasoning"] != "none" else []
        argv += ["--max-samples", str(count)] if count is not None else []
        real_device = torch.device
        with contextlib.ExitStack() as stack:
            stack.callback(setattr, sys, "argv", sys.argv)
            sys.argv = argv
            if protocol == "dflash-0.1":  # its warmup goes to torch.device("cuda:0"): the CPU here
                torch.device = lambda spec, *args: real_device("cpu") if str(spec).startswith("cuda") else real_device(spec, *args)
                stack.callback(setattr, torch, "device", real_device)
                dflash.cli.main(argv[1:])  # (argv[0] is the program's name)
            else:
                entry_point()
        entries, warmups = conversations(calls)
        if protocol == "dflash-0.1":  # one warmup per block size, on the first prompt's first turn
            assert [w["input_ids"] for w in warmups] == [entries[0]["input_ids"][0]] * 2
        else:
            assert not warmups
        results[name] = entries
        settings |= {json.dumps(c["template_kwargs"], sort_keys=True) for c in calls}
    return {"datasets": results, "template_kwargs": [json.loads(s) for s in sorted(settings)]}


# --------------------------------------------------------------------------- the cases


def cases() -> dict[str, dict]:
    """key -> spec (protocol, tokenizer, reasoning, max samples per dataset, datasets)."""
    found = {}
    for tokenizer in ("chatml", "bos"):
        found[f"zlab-2026-01|{tokenizer}|off|run_benchmark.sh"] = {
            "protocol": "zlab-2026-01", "tokenizer": tokenizer, "reasoning": "off",
            "max_samples": RUN_BENCHMARK_COUNTS, "datasets": list(DATASETS)}
    for reasoning, samples, names in (("off", None, LATER_DATASETS), ("off", 16, LATER_DATASETS),
                                      ("on", None, ("gsm8k",))):
        found[f"zlab-2026-04|chatml|{reasoning}|{samples or 'default'}"] = {
            "protocol": "zlab-2026-04", "tokenizer": "chatml", "reasoning": reasoning,
            "max_samples": dict.fromkeys(names, samples), "datasets": list(names)}
    variants = [(t, r) for t in ("chatml", "bos") for r in ("none", "off", "on")] + [("effort", "high")]
    for tokenizer, reasoning in variants:
        names = LATER_DATASETS if reasoning == "none" else REASONING_DATASETS  # (the file stays under 3 MB)
        for samples in (None, 16):
            found[f"dflash-0.1|{tokenizer}|{reasoning}|{samples or 'default'}"] = {
                "protocol": "dflash-0.1", "tokenizer": tokenizer, "reasoning": reasoning,
                "max_samples": dict.fromkeys(names, samples), "datasets": list(names)}
    return found


def subset_specs() -> dict[str, dict]:
    """Per protocol: the run at the real published row counts (lbpp has no published count to use)."""
    first = [n for n in DATASETS if n in REAL_COUNTS]
    return {
        "zlab-2026-01": {"protocol": "zlab-2026-01", "tokenizer": "chatml", "reasoning": "off", "datasets": first,
                         "max_samples": {n: RUN_BENCHMARK_COUNTS[n] for n in first}},
        **{protocol: {"protocol": protocol, "tokenizer": "chatml", "reasoning": reasoning,
                      "datasets": list(LATER_DATASETS), "max_samples": dict.fromkeys(LATER_DATASETS, SUBSET_SAMPLES)}
           for protocol, reasoning in (("zlab-2026-04", "off"), ("dflash-0.1", "none"))},
    }


SELECTION = {  # what the recorded orders are (checked against every case and subset by check_selection)
    "zlab-2026-01": "n > k: numpy.random.default_rng(0).permutation(n)[:k] (datasets' shuffle(seed=0).select); else all rows in order",
    "zlab-2026-04": "n > k: random.seed(0) (set in _run_transformers, after the import's random.seed(42)), "
                    "random.shuffle(list(range(n)))[:k]; else (k None or n <= k) all rows in order",
    "dflash-0.1": "order = list(range(n)); random.Random(42).shuffle(order); order[:k] (k None: all n, still shuffled)",
}


def expected_order(protocol: str, n: int, k: int | None) -> list[int]:
    import random

    import numpy

    order = list(range(n))
    if protocol == "dflash-0.1":
        random.Random(42).shuffle(order)
        return order[:k]
    if k is None or n <= k:
        return order
    if protocol == "zlab-2026-01":
        return numpy.random.default_rng(0).permutation(n)[:k].tolist()
    random.seed(0)
    random.shuffle(order)
    return order[:k]


def check_selection(golden_cases: dict, subsets: dict) -> None:
    for key, per_dataset in golden_cases.items():
        protocol, spec = key.split("|")[0], cases()[key]
        for name, entries in per_dataset.items():
            assert [e["row"] for e in entries] == expected_order(protocol, COUNTS[name], spec["max_samples"][name]), key
    for protocol, per_dataset in subsets.items():
        for name, subset in per_dataset.items():
            assert subset["order"] == expected_order(protocol, subset["rows"], subset["max_samples"]), (protocol, name)


def run_worker(spec: dict, trees: dict, log) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        spec = {**spec, "scratch": scratch, "tree": trees.get(spec["protocol"])}
        spec_file, out_file = Path(scratch) / "spec.json", Path(scratch) / "out.json"
        spec_file.write_text(json.dumps(spec))
        env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(Path(scratch) / "hf"),
                   TOKENIZERS_PARALLELISM="false")  # one process, no hub, a fresh datasets cache
        subprocess.run([sys.executable, __file__, "--worker", str(spec_file), str(out_file)], check=True,
                       stdout=log, stderr=subprocess.STDOUT, cwd=scratch, env=env)
        return json.loads(out_file.read_text())


def dump(golden: dict) -> str:
    """JSON with one line per recorded prompt (the file is committed: small diffs, readable)."""
    line = lambda value: json.dumps(value, ensure_ascii=False, separators=(",", ":"))  # noqa: E731
    cases_text = ",\n".join(
        f" {json.dumps(key)}: {{\n" + ",\n".join(
            f"  {json.dumps(name)}: [\n" + ",\n".join(f"   {line(entry)}" for entry in entries) + "\n  ]"
            for name, entries in per_dataset.items()) + "\n }"
        for key, per_dataset in golden["cases"].items())
    subsets_text = ",\n".join(
        f" {json.dumps(protocol)}: {{\n" + ",\n".join(f"  {json.dumps(name)}: {line(subset)}" for name, subset in per.items())
        + "\n }" for protocol, per in golden["subsets"].items())
    return ("{\n\"metadata\": " + json.dumps(golden["metadata"], indent=1, ensure_ascii=False)
            + ",\n\"cases\": {\n" + cases_text + "\n},\n\"subsets\": {\n" + subsets_text + "\n}\n}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer-from", type=Path, help="a tiny run's target/ folder (default: published/chatml)")
    parser.add_argument("--zlab-repo", type=Path, required=True,
                        help="a git clone (or mirror) of github.com/z-lab/dflash, holding both commits recorded")
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec_file, out_file = args.worker
        out_file.write_text(json.dumps(worker(json.loads(spec_file.read_text()))))
        return
    started = time.perf_counter()
    build_tokenizers(args.tokenizer_from)
    commits = {protocol: subprocess.run(["git", "-C", str(args.zlab_repo), "rev-parse", short], check=True,
                                        capture_output=True, text=True).stdout.strip()
               for protocol, short in (("zlab-2026-01", PAPER_COMMIT), ("zlab-2026-04", HEAD_COMMIT))}
    log_path = Path(tempfile.gettempdir()) / "make_published_golden.log"
    print(f"(the runs' output: {log_path})")
    with tempfile.TemporaryDirectory() as trees_root, open(log_path, "w") as log:
        trees = {}
        for protocol, commit in commits.items():
            trees[protocol] = str(Path(trees_root) / protocol)
            os.makedirs(trees[protocol])
            archive = subprocess.run(["git", "-C", str(args.zlab_repo), "archive", commit], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", trees[protocol]], input=archive, check=True)
        golden_cases, settings = {}, {}
        for key, spec in cases().items():
            print(f"[case] {key}", flush=True)
            result = run_worker({**spec, "rows": {}}, trees, log)
            golden_cases[key], settings[key] = result["datasets"], result["template_kwargs"]
        subsets = {}
        for protocol, spec in subset_specs().items():
            print(f"[subsets] {protocol}", flush=True)
            result = run_worker({**spec, "rows": REAL_COUNTS}, trees, log)
            subsets[protocol] = {
                name: {"rows": REAL_COUNTS[name], "max_samples": spec["max_samples"][name],
                       "order": [entry["row"] for entry in entries]}
                for name, entries in result["datasets"].items()}
    check_selection(golden_cases, subsets)
    import datasets
    import pyarrow
    import tokenizers
    import torch
    import transformers

    metadata = {
        "recorded_by": "tests/golden/make_published_golden.py",
        "versions": {"python": sys.version.split()[0], "datasets": datasets.__version__, "pyarrow": pyarrow.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                     "torch": torch.__version__, "dflash": version("dflash")},
        "zlab_commits": {**commits, "dflash-0.1": "PyPI dflash==0.1.0"},
        "answer": ANSWER,
        "answer_note": "every dflash_generate call answers input ids + ANSWER's ids (add_special_tokens=False) + the tokenizer's eos id",
        "generation_config_eos_token_id": GENERATION_EOS,
        "tokenizers": tokenizer_metadata(),
        "rows": {name: COUNTS[name] for name in DATASETS},
        "hub_ids": HUB_IDS,
        "livecodebench_files": list(LIVECODEBENCH_FILES),
        "run_benchmark_counts": RUN_BENCHMARK_COUNTS,
        "model_names_passed": MODEL,
        "case_template_kwargs": settings,
        "selection": SELECTION,
        "key": "<protocol>|<tokenizer folder>|<reasoning: off/on/none/high>|<max samples: default (none given), a number, "
               "or run_benchmark.sh (98bde5f's per-dataset counts, run_benchmark_counts)>",
    }
    GOLDEN.write_text(dump({"metadata": metadata, "cases": golden_cases, "subsets": subsets}), encoding="utf-8")
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size / 1e6:.2f} MB) in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

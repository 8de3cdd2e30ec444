"""References stage: the target's completions of every prompt, one file per prompt (resumable).

Greedy, or sampled (dflash_core.sampling): then `samples` completions per prompt, each a reference of
its own named `<id>#s<k>`, each request seeded from (seed, prompt id, sample, turn). The replay over a
sampled completion gives the acceptance lengths of the online loop that emitted it, so tau at a
temperature is the mean over samples.

A multi-turn prompt gives one reference per turn: turn k's prompt holds the target's own answers to
turns 1..k-1. Its items are named `<id>#<k>` (`<id>#s<j>#<k>` when sampled).

A server's entry holds `fingerprint.json`: the server's fingerprint (what its model does, not what it
calls itself) when the entry was begun. It is taken again when the entry is resumed and before it is
committed; a different one stops the run (ServerModelChanged), so one entry never holds references of
two models. The local backend needs none: the weights it decodes with are the ones whose content
digest is in the key, so other weights at the same path get an entry of their own.
"""

import functools
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from prefect import task
from prefect.cache_policies import NONE
from prefect.states import State
from transformers import AutoTokenizer

from dflash_core.checkpoint_files import model_name
from dflash_core.choices import DEFAULT_ATTENTION
from dflash_core.prompts import (
    Prompt,
    prompt_set_identity,
    read_completions,
    read_prompts,
    resolve_prompts,
    turn_prompt_ids,
)
from dflash_core.published.benchmarks import benchmark_names, read_data_option
from dflash_core.published.prompt_set import BenchmarkPromptSet
from dflash_core.replay import Reference
from dflash_core.sampling import GREEDY, Sampling, sample_seed
from dflash_core.target import read_target_config
from dflash_eval.services.benchmark_data import benchmark_prompts
from dflash_eval.services.reference.backends import (
    TOKENIZER_LOCK,
    BackendError,
    HTTPBackend,
    LocalBackend,
    ServerModelChanged,
    fingerprint_difference,
    open_backend,
)
from dflash_eval.storage import Store, key_of, read_json, write_json_atomic
from dflash_eval.storage.schema import ReferencesRecord, Stage

from .progress import StageProgress, stage_logger
from .stage import cached, get_or_compute
from .target import attention_identity, loaded_target, target_key
from .threads import compute_threads, parameter_count

STAGE = Stage.REFERENCES
FINGERPRINT_FILE = "fingerprint.json"  # the server's fingerprint when the entry was begun


@dataclass(frozen=True)
class ReferenceSet:
    """References of a prompt set, held in the store."""

    key: str
    path: str  # the entry folder: seq_<n>.json per prompt and sample
    n_prompts: int
    n: int  # references (a multi-turn prompt has one per turn, each sample its own)
    lookahead: int  # greedy tokens kept past each completion's end
    samples: int = 1  # completions per prompt (1 when greedy)
    sampling: Sampling = GREEDY  # how they were sampled (the target's probabilities of their tokens follow it)
    benchmarks: dict | None = None  # published benchmarks: the protocol and each benchmark's rows (prompt_set.to_json)


@dataclass(frozen=True)
class ReferenceItem:
    """One reference, as stored."""

    id: str
    category: str | None
    reference: Reference  # prompt + completion (+ lookahead) token ids
    finish: str  # "stop" (a stop token) or "length" (max_new_tokens reached)
    verified: bool  # False: a server returned text whose re-tokenisation did not round-trip
    prompt: str | None = None  # sampled: the prompt (and turn) this is a sample of; None when greedy


@dataclass(frozen=True)
class PromptChoice:
    """What names the prompt set: `--prompts` (a suite, a JSONL file, or published benchmarks) and what applies
    to it: `thinking` to a suite or file; the protocol, local copies (`data`: "[NAME=]PATH,..."), rows per
    benchmark and reasoning setting to published benchmarks (dflash_core.published)."""

    prompts: str
    thinking: bool = False
    protocol: str | None = None
    data: str | None = None
    max_samples: int | None = None
    reasoning: str | None = None


@dataclass(frozen=True)
class PromptSet:
    """The prompts, where their decoding stops, and, for published benchmarks, what each contributed."""

    prompts: list[Prompt]
    stop_token_ids: list[int]
    benchmarks: BenchmarkPromptSet | None = None


def load_prompts(choice: PromptChoice, target_dir: str, tokenizer=None) -> PromptSet:
    """Read the prompt set with the target's tokenizer (loaded unless given): a suite or file (PromptError naming the
    file and line) or published benchmarks (BenchmarkError naming the dataset)."""
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(target_dir)
    config = read_target_config(target_dir)
    names = benchmark_names(choice.prompts)
    if names is None:
        prompts = read_prompts(resolve_prompts(choice.prompts), tokenizer, thinking=choice.thinking,
                               vocab_size=config.vocab_size)
        return PromptSet(prompts, list(config.eos_token_ids))
    benchmarks = benchmark_prompts(names, tokenizer, protocol=choice.protocol, data=read_data_option(choice.data, names),
                                   max_samples=choice.max_samples, reasoning=choice.reasoning,
                                   generation_eos=config.eos_token_ids, vocab_size=config.vocab_size)
    return PromptSet(benchmarks.prompts, benchmarks.stop_token_ids, benchmarks)


def references_here(store: Store, refs: ReferenceSet) -> ReferenceSet:
    """`refs` as this machine holds them: its entry folder found through the store (on a Dask worker, the
    worker's own copy of a store on object storage)."""
    return replace(refs, path=str(store.local_entry(STAGE, refs.key)))


def load_references(refs: ReferenceSet) -> list[ReferenceItem]:
    """Read a reference set back from the store, in prompt (then turn) order."""
    items = []
    for n in range(refs.n_prompts * refs.samples):
        record = read_json(Path(refs.path) / f"seq_{n}.json")
        for k, turn in enumerate(record["turns"], start=1):
            suffix = "" if len(record["turns"]) == 1 else f"#{k}"
            prompt = None if record.get("prompt") is None else record["prompt"] + suffix
            reference = Reference(turn["prompt_len"], turn["token_ids"], turn["completion_end"])
            items.append(ReferenceItem(record["id"] + suffix, record["category"], reference, turn["finish"],
                                       turn["verified"], prompt))
    return items


def generate_turns(backend, tokenizer, prompt: Prompt, max_new_tokens: int, stop_ids: list[int],
                   lookahead: int, thinking: bool, sampling: Sampling = GREEDY, seed: int = 0,
                   sample: int = 0) -> list[dict]:
    """Every turn of one prompt (sample `sample` of it when sampled): prompt ids, completion (+ lookahead)
    ids, where the completion ends."""
    turns: list[dict] = []
    answers: list[str] = []
    for k in range(max(1, len(prompt.turns))):
        if k == 0:
            prompt_ids = list(prompt.input_ids)
        else:
            with TOKENIZER_LOCK:
                prompt_ids = turn_prompt_ids(tokenizer, prompt, answers, thinking)
        if lookahead:
            # past the stop token too (greedy: the tokens before it are the same), then cut there
            completion = backend.generate(prompt_ids, max_new_tokens + lookahead, [])
        else:
            completion = backend.generate(prompt_ids, max_new_tokens, stop_ids, sampling,
                                          None if sampling.greedy else sample_seed(seed, prompt.id, sample, k))
        ids = completion.token_ids
        if not ids:
            raise BackendError(f"prompt {prompt.id} turn {k + 1}: the reference backend returned no token")
        end = next((i + 1 for i, t in enumerate(ids[:max_new_tokens]) if t in stop_ids), min(len(ids), max_new_tokens))
        turns.append({"prompt_len": len(prompt_ids), "token_ids": prompt_ids + ids, "completion_end": len(prompt_ids) + end,
                      "finish": "stop" if ids[end - 1] in stop_ids else "length", "verified": completion.verified})
        with TOKENIZER_LOCK:
            answers.append(tokenizer.decode(ids[:end], skip_special_tokens=True))
    return turns


def _served_as(backend) -> str:
    return ", ".join(f"{k} {v}" for k, v in backend.identity.items() if k != "kind" and v is not None)


def _refresh_hint() -> str:
    return ("`dflash-eval stage references --refresh` with the same options (flow parameter refresh: "
            "[\"references\"]) starts the entry anew with the model served now")


def begin_fingerprint(entry: Path, backend, reference: str) -> dict:
    """The server's fingerprint now. An entry without references stores it; one with references (a
    resumed entry) must have been begun with the same fingerprint, else ServerModelChanged, which
    names the server and what to do: its references and the ones to come must be one model's."""
    now = backend.fingerprint()
    kept = sorted(entry.glob("seq_*.json"))
    stored = entry / FINGERPRINT_FILE
    if kept and stored.exists():
        problem = fingerprint_difference(read_json(stored)["fingerprint"], now)
        if problem is not None:
            raise ServerModelChanged(
                f"reference server {reference} ({_served_as(backend)}): its model changed since this references "
                f"entry was begun: {problem}. The entry's {len(kept)} finished references came from the model it "
                f"served then and are not completed with another model's: serve that model again to resume the "
                f"entry, or {_refresh_hint()}. Entry: {entry}")
        return now
    if kept:  # begun before entries held a fingerprint: which model wrote them cannot be checked
        stage_logger().warning(f"{entry}: {len(kept)} references of an entry begun without a model fingerprint "
                               "are discarded and generated again (their model cannot be checked)")
        for path in kept:
            path.unlink()
    write_json_atomic(stored, {"backend": backend.identity, "fingerprint": now})
    return now


def check_fingerprint_unchanged(entry: Path, backend, reference: str, begun: dict, written: list[int]) -> None:
    """Before commit: the server must still give the fingerprint the entry was begun with. If it does not
    (the server was swapped during the run), the references this run wrote may come from either model:
    they are removed and ServerModelChanged is raised; nothing is committed."""
    problem = fingerprint_difference(begun, backend.fingerprint())
    if problem is None:
        return
    for n in written:
        (entry / f"seq_{n}.json").unlink(missing_ok=True)
    raise ServerModelChanged(
        f"reference server {reference} ({_served_as(backend)}): its model changed during this run: {problem}. "
        f"The {len(written)} references this run generated may come from either model: they were removed and "
        f"nothing was committed. Rerun once the server serves the target's model; {_refresh_hint()}. "
        f"Entry: {entry}")


@task(name="references", cache_policy=NONE, persist_result=False)
def generate_references(
    target_dir: str,
    choice: PromptChoice,
    max_new_tokens: int,
    store_location: str,
    reference: str = "local",
    lookahead: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
    concurrency: int = 8,
    refresh: bool = False,
    reference_api_key_file: str | None = None,
    sampling: Sampling = GREEDY,
    samples: int = 1,
    seed: int = 0,
    given: str | None = None,
    target_name: str | None = None,
    attention: str = DEFAULT_ATTENTION,
):
    """Completions from the target in this process (reference="local") or a server (see
    dflash_eval.services.reference.backends): greedy, or `samples` per prompt sampled with `sampling`, seeded from
    `seed`. lookahead > 0 (greedy only) also keeps that many greedy tokens past each completion's end,
    so its last decode step is scored against a whole block. `given`: a completions file
    (dflash_core.prompts.read_completions) whose completions are stored instead (`choice` names no prompts then; its
    `thinking` templates the file's messages; `sampling`, the settings they were sampled at when drafts are sampled). Published benchmarks' prompts stop where their protocol stops.
    reference_api_key_file: a file holding the server's API key (else $DFLASH_REFERENCE_API_KEY);
    the key is sent, never part of the references' key. target_name: how series titles call the target
    (default: tasks.target.model_name), recorded when the entry is made, never part of its key."""
    store = Store(store_location)
    target_name = target_name or model_name(target_dir)
    if given is not None:
        return store_given_references(given, target_dir, store, choice.thinking, refresh, target_name, sampling)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompt_set = load_prompts(choice, target_dir, tokenizer)
    prompts, stop_ids, thinking = prompt_set.prompts, prompt_set.stop_token_ids, choice.thinking
    # the prompts' ids, chat format and stop ids are keyed already; the protocol keeps its series apart
    benchmarks = prompt_set.benchmarks.to_json() if prompt_set.benchmarks else None
    backend: LocalBackend | HTTPBackend
    if reference == "local":
        local = backend = LocalBackend(lambda: loaded_target(target_dir, dtype, device, attention),
                                       {"kind": "transformers", "dtype": dtype, "device": torch.device(device).type,
                                        **attention_identity(attention)})

        @functools.cache  # once, on the first prompt decoded (cached references load no target)
        def target_parameters() -> int:
            return parameter_count(local.load_target().model)

        def decoding_threads():
            # one token per forward: a small target decodes faster on fewer threads (tasks/threads.py)
            return compute_threads(work_per_op=target_parameters())
    else:
        backend = open_backend(reference, tokenizer, api_key_file=reference_api_key_file, concurrency=concurrency)
        decoding_threads = nullcontext  # the server decodes; this process only tokenizes
    # (flows/checks.py refuses samples > 1 when greedy, and lookahead when sampled); greedy: {"temperature": 0.0}, the key greedy entries always had
    sampled = None if sampling.greedy else {**sampling.identity(), "samples": samples, "seed": seed}
    key = key_of({
        "prompts": prompt_set_identity(prompts), "thinking": thinking,
        "target": target_key(target_dir, store), "backend": backend.identity,
        "sampling": sampled or sampling.identity(), "max_new_tokens": max_new_tokens, "stop_token_ids": stop_ids,
        "lookahead": lookahead, **({"protocol": benchmarks["protocol"]} if benchmarks else {}),
    })
    units = [(n, k) for n in range(len(prompts)) for k in range(samples)]  # file i = n * samples + k
    if sampled and reference != "local":
        stage_logger().info(f"sampling {samples} completion(s) per prompt ({sampling.describe()}) from {reference}, "
                            f"each request with its own seed; a server that ignores seeds still gives valid "
                            f"samples (the stored completions are what is replayed), only not the same ones "
                            f"again")

    def compute(entry: Path) -> dict:
        # before the resume point is read: a changed server stops here, or empties an unverifiable entry
        fingerprint = None if reference == "local" else begin_fingerprint(entry, backend, reference)
        todo = [i for i in range(len(units)) if not (entry / f"seq_{i}.json").exists()]  # resume
        written = []
        failed = threading.Event()

        def one_unit(i):
            if failed.is_set():  # after a failure, start no new prompt (those running still finish)
                return None
            n, k = units[i]
            with decoding_threads():  # on this worker thread, which is where torch runs the decoding
                return generate_turns(backend, tokenizer, prompts[n], max_new_tokens, stop_ids, lookahead, thinking,
                                      sampling, seed, k)

        failure = None
        what = "greedy references" if sampling.greedy else f"references ({sampling.describe()}, {samples} per prompt)"
        pool = ThreadPoolExecutor(max_workers=backend.concurrency)
        try:
            with StageProgress(STAGE, what, len(units)) as progress:
                running = {pool.submit(one_unit, i): i for i in todo}
                done = len(units) - len(todo)
                for future in as_completed(running):
                    if future.exception() is not None:
                        failure = failure or future.exception()
                        failed.set()
                    elif future.result() is not None:  # every finished prompt is kept: a rerun resumes
                        i = running[future]
                        prompt = prompts[units[i][0]]
                        record = {"id": prompt.id, "category": prompt.category, "turns": future.result()}
                        if sampled:
                            record.update(id=f"{prompt.id}#s{units[i][1]}", prompt=prompt.id)
                        write_json_atomic(entry / f"seq_{i}.json", record)
                        written.append(i)
                        done += 1
                        progress.update(done)
        except BaseException:
            # stopped here (Ctrl-C, SIGTERM): start no other unit and wait for none, queued or running (a leaving
            # `with` would run every queued one first: minutes with many samples); what was written is kept
            failed.set()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        if failure is not None:
            raise failure
        if fingerprint is not None:
            check_fingerprint_unchanged(entry, backend, reference, fingerprint, written)
        n_items = samples * sum(max(1, len(p.turns)) for p in prompts)
        unverified = sum(not t["verified"] for i in range(len(units))
                         for t in read_json(entry / f"seq_{i}.json")["turns"])
        return ReferencesRecord(
            n_prompts=len(prompts), n=n_items, prompts=choice.prompts, target=str(target_dir),
            backend=backend.identity, max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop_ids),
            lookahead=lookahead, unverified=unverified,
            backend_fingerprint=None if fingerprint is None else key_of(fingerprint), sampling=sampled,
            target_name=target_name, benchmarks=benchmarks,
        ).to_record()

    outcome = get_or_compute(store, STAGE, key, compute, refresh=refresh)
    record = ReferencesRecord.from_record(outcome.record)
    refs = ReferenceSet(key=key, path=str(store.entry(STAGE, key)), n_prompts=record.n_prompts, n=record.n,
                        lookahead=record.lookahead, samples=(record.sampling or {}).get("samples", 1),
                        sampling=sampling, benchmarks=record.benchmarks)
    return refs if outcome.computed else cached(refs)


def store_given_references(path: str, target_dir: str, store: Store, thinking: bool = False,
                           refresh: bool = False, target_name: str | None = None,
                           sampling: Sampling = GREEDY) -> ReferenceSet | State:
    """The references stage for completions you already have: the file's completions, stored as a references
    entry keyed by their content (and the target's, whose tokenizer read them), one seq_<n>.json per line.
    `sampling`: the settings they were sampled at, which sampled drafts need (the target's probability of each token
    is extracted at them with the features): keyed and recorded when not greedy, so that the same completions at
    other settings are another entry, and their series says at which."""
    target_config = read_target_config(target_dir)
    completions = read_completions(path, AutoTokenizer.from_pretrained(target_dir), thinking=thinking,
                                   vocab_size=target_config.vocab_size)
    stop_ids = set(target_config.eos_token_ids)
    key = key_of({"given": [asdict(c) for c in completions], "thinking": thinking,
                  "target": target_key(target_dir, store),
                  **({} if sampling.greedy else {"sampling": sampling.identity()})})  # (greedy: keys as they were)

    def compute(entry: Path) -> dict:
        for n, c in enumerate(completions):
            turn = {"prompt_len": len(c.input_ids), "token_ids": [*c.input_ids, *c.completion_ids],
                    "completion_end": None, "finish": "stop" if c.completion_ids[-1] in stop_ids else "length",
                    "verified": not c.retokenized}
            write_json_atomic(entry / f"seq_{n}.json", {"id": c.id, "prompt": c.prompt, "category": c.category,
                                                        "turns": [turn]})
        return ReferencesRecord(
            n_prompts=len(completions), n=len(completions), prompts=str(path), target=str(target_dir),
            backend={"kind": "given", "file": str(path)}, max_new_tokens=max(len(c.completion_ids) for c in completions),
            stop_token_ids=tuple(sorted(stop_ids)), lookahead=0, unverified=sum(c.retokenized for c in completions),
            target_name=target_name or model_name(target_dir),
            sampling=None if sampling.greedy else sampling.identity(),
        ).to_record()

    outcome = get_or_compute(store, STAGE, key, compute, refresh=refresh)
    refs = ReferenceSet(key=key, path=str(store.entry(STAGE, key)), n_prompts=len(completions), n=len(completions),
                        lookahead=0, sampling=sampling)
    return refs if outcome.computed else cached(refs)

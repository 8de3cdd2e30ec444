"""A published benchmark prompt set: the rows a protocol takes of each benchmark, as prompts of the target.

`prompt_set_of` takes each benchmark's rows from a row source (dflash_eval.services.benchmark_data reads them from
the hub, a local copy or a package), lets the protocol pick and order them, formats their user turns and templates
and tokenizes the first turn as the protocol does; later turns
(MT-Bench's second) are templated the same way once the target has answered the first
(dflash_core.prompts.turn_prompt_ids reads the prompt's `chat` format).

Each benchmark is described (`BenchmarkUse`): where its rows came from and whether they are the protocol's own
subset. A set that is not (another source with fewer rows, another count) says so in its `note`, which every
place that shows its tau repeats: it never passes for the published subset.
"""

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from ..prompts import ChatFormat, Prompt
from .benchmarks import Benchmark, BenchmarkError, LoadedRows
from .protocols import DEFAULT_PROTOCOL, PROTOCOLS


@dataclass(frozen=True)
class BenchmarkUse:
    """How one benchmark was evaluated: its rows' source and count, and whether they are the protocol's subset."""

    name: str
    title: str
    group: str
    source: str
    rows: int  # rows read
    split_rows: int | None  # rows of the split on the hub, where known
    prompts: int  # rows the protocol took
    protocol_subset: bool
    note: str  # one line: what was evaluated, e.g. "the zlab-2026-01 subset: 128 of 1319 rows (hub openai/gsm8k)"

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class BenchmarkPromptSet:
    """The prompts of a benchmark set, how they end, and what each benchmark contributed."""

    protocol: str
    prompts: list[Prompt]
    stop_token_ids: list[int]
    uses: list[BenchmarkUse]
    template_kwargs: dict
    conversations: list["Conversation"]  # each prompt's user turns, in the prompts' order

    def to_json(self) -> dict:
        """The protocol, its template arguments and each benchmark's use, as the references record keeps them."""
        return {"protocol": self.protocol, "template_kwargs": self.template_kwargs,
                "benchmarks": [u.to_json() for u in self.uses]}


def _note(protocol: str, rows: int, prompts: int, split_rows: int | None, source: str, whole: bool,
          count: int | None, default_count: int | None) -> tuple[bool, str]:
    """(whether the prompts are the protocol's own subset, the line that says what they are)."""
    if not whole:
        split = f" (the {'file' if protocol == 'deepspec' else 'split'} has {split_rows})" if split_rows else ""
        return False, f"not the {protocol} subset: {prompts} of the {rows} rows in {source}{split}"
    if PROTOCOLS[protocol].counted and count != default_count:
        script = "eval.py" if protocol == "deepspec" else "its run script"
        return False, (f"not the {protocol} subset: {prompts} of {rows} rows, where {script} takes "
                       f"{default_count or 'all'} ({source})")
    return True, f"the {protocol} subset: {prompts} of {rows} rows ({source})"


@dataclass(frozen=True)
class Conversation:
    """One row as the protocol asks it: its id (`<benchmark>/<row index>`), its benchmark and its user turns."""

    id: str
    benchmark: str
    turns: tuple[str, ...]


# Where a benchmark's rows come from: called once per benchmark, after the protocol's own checks (so that a
# protocol refused is said before any dataset is read); returns them checked (benchmarks.checked_rows).
RowSource = Callable[[Benchmark], LoadedRows]


def conversations_of(names: Sequence[str], rows_of: RowSource, protocol: str | None = None,
                     max_samples: int | None = None) -> tuple[list[Conversation], list[BenchmarkUse]]:
    """The rows `protocol` (default zlab-2026-01) takes of each benchmark in `names`, in its order, as user turns,
    and how each benchmark was used: `rows_of` gives a benchmark's rows; `max_samples` caps the rows of each
    (default: the protocol's count). Needs no tokenizer. Raises BenchmarkError naming the dataset."""
    chosen = PROTOCOLS[protocol or DEFAULT_PROTOCOL]
    if outside := [n for n in names if n not in chosen.names]:
        others = [p.name for p in PROTOCOLS.values() if all(n in p.names for n in outside)]
        raise BenchmarkError(f"{', '.join(outside)}: not among {chosen.name}'s datasets "
                             f"({', '.join(chosen.names)}); use --protocol {' or '.join(others) or 'zlab-2026-01'}"
                             + (" (all eleven)" if others[:1] == ["zlab-2026-01"] else ""))
    for name in names:  # before any dataset is read
        if why := chosen.refusal(name):
            raise BenchmarkError(f"{name}: {chosen.name} cannot run it: {why}; leave it out")
    conversations, uses = [], []
    for name in names:
        benchmark = chosen.benchmark(name)
        loaded = rows_of(benchmark)
        default_count = chosen.default_count(name)
        count = max_samples if max_samples is not None else default_count
        selected = chosen.select(loaded.rows, count)
        split_rows = benchmark.rows if benchmark.rows is not None else (len(loaded.rows) if loaded.whole else None)
        subset, note = _note(chosen.name, len(loaded.rows), len(selected), split_rows, loaded.source, loaded.whole,
                             count, default_count)
        uses.append(BenchmarkUse(name, benchmark.title, benchmark.group, loaded.source, len(loaded.rows), split_rows,
                                 len(selected), subset, note))
        for row in selected:
            turns = benchmark.format_turns(row.fields)
            if not turns or not all(isinstance(t, str) and t for t in turns):
                raise BenchmarkError(f"{name}: {loaded.source}: row {row.index} gives no user turn to ask")
            conversations.append(Conversation(f"{name}/{row.index}", name, tuple(turns)))
    return conversations, uses


def prompt_set_of(names: Sequence[str], tokenizer, rows_of: RowSource, *, protocol: str | None = None,
                  max_samples: int | None = None, reasoning: str | None = None, generation_eos: Sequence[int] = (),
                  vocab_size: int | None = None) -> BenchmarkPromptSet:
    """The prompts of benchmarks `names` (benchmarks.ORDER) under `protocol` (conversations_of, `rows_of`
    giving each benchmark's rows), their first turns templated and tokenized as the protocol does with the target's
    `tokenizer`; `reasoning` as the protocol reads it; `generation_eos`: the target's generation_config eos ids.
    Raises BenchmarkError naming the dataset on any problem."""
    chosen = PROTOCOLS[protocol or DEFAULT_PROTOCOL]
    if getattr(tokenizer, "chat_template", None) is None:
        raise BenchmarkError("the target's tokenizer has no chat template; the published protocols template every "
                             "prompt with it")
    kwargs = chosen.template_kwargs(reasoning, str(tokenizer.chat_template))
    chat = ChatFormat(tuple(sorted(kwargs.items())), chosen.special_tokens)
    conversations, uses = conversations_of(names, rows_of, chosen.name, max_samples)
    prompts = []
    for n, c in enumerate(conversations):
        ids = tuple(chat.ids(tokenizer, [{"role": "user", "content": c.turns[0]}]))
        if vocab_size is not None and any(t >= vocab_size for t in ids):
            raise BenchmarkError(f"{c.id}: tokenizes to ids beyond the target's vocabulary {vocab_size}: the "
                                 "tokenizer is not the target's")
        prompts.append(Prompt(id=c.id, input_ids=ids, category=c.benchmark, line=n + 1, source="benchmark",
                              turns=c.turns if len(c.turns) > 1 else (), chat=chat))
    return BenchmarkPromptSet(chosen.name, prompts, chosen.stop_token_ids(tokenizer, generation_eos), uses, kwargs,
                              conversations)

"""The acceptance lengths z-lab published, and how ours compares with them.

tau here is what z-lab prints: per response (each MT-Bench turn is one) the mean of accepted + 1 over its decode
steps, averaged over responses, which is our `tau_macro`. A published number stands beside ours only where the
target and drafter are the published pair and the served setting is the published one; what else differs
(protocol, subset, block size, new tokens) is said beside it.
"""

from dataclasses import dataclass

# z-lab/dflash README at bb48ef9 (2026-01-05): B200, transformers backend, thinking off, 2048 new tokens, block 16,
# the run script's subsets (zlab-2026-01). Columns as GROUPS orders them.
_PAPER_COLUMNS = ("gsm8k", "math500", "aime24", "aime25", "humaneval", "mbpp", "livecodebench", "swe-bench",
                  "mt-bench", "alpaca")
_PAPER_TABLE = {
    ("Qwen3-4B", "Qwen3-4B-DFlash-b16", 0.0): (6.50, 7.84, 7.47, 7.28, 6.63, 6.19, 6.97, 3.70, 4.35, 3.10),
    ("Qwen3-8B", "Qwen3-8B-DFlash-b16", 0.0): (6.55, 7.87, 7.48, 7.31, 6.55, 6.00, 7.12, 3.69, 4.25, 3.16),
    ("Qwen3-4B", "Qwen3-4B-DFlash-b16", 1.0): (5.98, 6.67, 4.97, 5.01, 6.05, 5.55, 6.60, 3.09, 4.03, 2.99),
    ("Qwen3-8B", "Qwen3-8B-DFlash-b16", 1.0): (6.04, 6.57, 5.06, 5.03, 5.40, 5.17, 6.79, 2.82, 3.74, 2.88),
}
PAPER_SOURCE = "z-lab/dflash README at bb48ef9 (B200, transformers backend)"


@dataclass(frozen=True)
class PublishedTau:
    """One published tau and the setting it was measured in."""

    target: str  # the Hub repository's name, without its organisation
    drafter: str
    benchmark: str
    tau: float
    temperature: float
    top_p: float
    top_k: int
    block_size: int
    protocol: str
    max_new_tokens: int
    reasoning: str | None  # as --reasoning names it; None: thinking off (the zlab protocols)
    prompts: int | None  # the rows measured (the subset's size)
    source: str


PUBLISHED: tuple[PublishedTau, ...] = (
    *(PublishedTau(target, drafter, name, tau, temperature, 1.0, 0, 16, "zlab-2026-01", 2048, None, None,
                   PAPER_SOURCE)
      for (target, drafter, temperature), taus in _PAPER_TABLE.items() for name, tau in zip(_PAPER_COLUMNS, taus)),
    # the model card's README command: `dflash benchmark openai` with 128 prompts, concurrency 1
    PublishedTau("Qwen3.8-27B", "Qwen3.8-27B-DFlash2", "gsm8k", 5.46, 1.0, 0.95, 20, 8, "dflash-0.1", 4096, "xhigh",
                 128, "Qwen3.8-27B-DFlash2 model card (quoted in xLLM #2279)"),
)


def _drafts(entry: PublishedTau) -> str:
    """How the published run drew its drafts, as --draft-sample-method names it."""
    from .protocols import PROTOCOLS
    return "probabilistic" if entry.temperature > 0 and PROTOCOLS[entry.protocol].sampled_drafts else "greedy"


def _short(name: str | None) -> str:
    return (name or "").rstrip("/").rsplit("/", 1)[-1].lower()


@dataclass(frozen=True)
class Setting:
    """What our run measured, to be set beside a published setting."""

    target: str | None  # the target's name (its Hub id where known)
    drafter: str | None  # the drafter's
    temperature: float
    top_p: float
    top_k: int
    block_size: int
    protocol: str
    max_new_tokens: int
    reasoning: str | None
    draft_sample_method: str = "greedy"


def published_for(benchmark: str, setting: Setting) -> tuple[PublishedTau, list[str]] | None:
    """The published tau for this benchmark, target, drafter and temperature, with what else differs from its
    setting (each a short phrase, e.g. "block size 8, published 16"); None when none was published."""
    for entry in PUBLISHED:
        if (entry.benchmark == benchmark and _short(setting.target) == entry.target.lower()
                and _short(setting.drafter) == entry.drafter.lower() and setting.temperature == entry.temperature):
            differs = [f"{what} {ours}, published {theirs}" for what, ours, theirs in (
                ("protocol", setting.protocol, entry.protocol),
                ("top-p", setting.top_p, entry.top_p), ("top-k", setting.top_k, entry.top_k),
                ("block size", setting.block_size, entry.block_size),
                ("max new tokens", setting.max_new_tokens, entry.max_new_tokens),
                ("reasoning", setting.reasoning or "off", entry.reasoning or "off"),
                ("drafts", setting.draft_sample_method, _drafts(entry)),
            ) if ours != theirs]
            return entry, differs
    return None


def compare(tau: float, ci95: tuple[float, float] | list[float], entry: PublishedTau, differs: list[str]) -> dict:
    """Ours beside the published value: the gap (ours minus published) and whether it lies beyond our 95% CI."""
    low, high = ci95
    beyond = not low <= entry.tau <= high
    return {"tau": entry.tau, "source": entry.source, "protocol": entry.protocol, "temperature": entry.temperature,
            "prompts": entry.prompts, "gap": tau - entry.tau, "beyond_ci": beyond, "differs": differs}


def beside_published(by_benchmark: dict, prompt_set: dict, setting: Setting) -> dict:
    """The results' `benchmarks`: per benchmark (z-lab's group order) our tau, interval and responses, where its
    rows came from and whether they are the protocol's subset, and the published tau beside it where there is one;
    per group its Average. `by_benchmark`: metrics.benchmark_summary's; `prompt_set`: the references' record of
    the set (prompt_set.BenchmarkPromptSet.to_json)."""
    from .benchmarks import BENCHMARKS, GROUPS

    uses = {use["name"]: use for use in prompt_set["benchmarks"]}
    order = sorted(uses, key=lambda n: (GROUPS.index(uses[n]["group"]), list(BENCHMARKS).index(n)))
    rows = []
    for name in order:
        ours = by_benchmark["benchmarks"].get(name)
        if ours is None:
            continue
        row = {**uses[name], "tau": ours["tau"], "ci95": list(ours["ci95"]), "responses": ours["responses"],
               "published": None}
        if found := published_for(name, setting):
            entry, differs = found
            if not uses[name]["protocol_subset"]:
                differs = [*differs, f"rows: not the {entry.protocol} subset"]
            row["published"] = compare(ours["tau"], ours["ci95"], entry, differs)
        rows.append(row)
    groups = {}
    for group in GROUPS:
        if group not in by_benchmark["groups"]:
            continue
        average = by_benchmark["groups"][group]
        members = [r for r in rows if r["group"] == group]
        published = [r["published"]["tau"] for r in members if r["published"]]
        groups[group] = {"tau": average["tau"], "ci95": list(average["ci95"]), "benchmarks": average["benchmarks"],
                         "published": sum(published) / len(published) if len(published) == len(members) else None}
    return {"protocol": prompt_set["protocol"], "template_kwargs": prompt_set.get("template_kwargs", {}),
            "rows": rows, "groups": groups}

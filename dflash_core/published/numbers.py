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
class Setting:
    """What a tau was measured in: the pair, the served setting and the protocol (ours, or a published run's)."""

    target: str | None  # the target's name (its Hub id where known; a published one's without its organisation)
    drafter: str | None  # the drafter's
    temperature: float
    top_p: float
    top_k: int
    block_size: int
    protocol: str
    max_new_tokens: int
    reasoning: str | None  # as --reasoning names it; None: thinking off (the zlab protocols)
    draft_sample_method: str = "greedy"


# how a difference of setting is said, by field: "block size 8, published 16"
_SAID = {"protocol": "protocol", "top_p": "top-p", "top_k": "top-k", "block_size": "block size",
         "max_new_tokens": "max new tokens", "reasoning": "reasoning", "draft_sample_method": "drafts"}


@dataclass(frozen=True)
class PublishedTau:
    """One published tau and the setting it was measured in."""

    benchmark: str
    tau: float
    setting: Setting
    prompts: int | None  # the rows measured (the subset's size)
    source: str


def _published(target: str, drafter: str, temperature: float, top_p: float, top_k: int, block_size: int,
               protocol: str, max_new_tokens: int, reasoning: str | None) -> Setting:
    """A published run's setting, its drafts drawn as its protocol draws them at its temperature."""
    from .protocols import PROTOCOLS
    sampled = temperature > 0 and PROTOCOLS[protocol].sampled_drafts
    return Setting(target, drafter, temperature, top_p, top_k, block_size, protocol, max_new_tokens, reasoning,
                   "probabilistic" if sampled else "greedy")


PUBLISHED: tuple[PublishedTau, ...] = (
    *(PublishedTau(name, tau, _published(target, drafter, temperature, 1.0, 0, 16, "zlab-2026-01", 2048, None), None,
                   PAPER_SOURCE)
      for (target, drafter, temperature), taus in _PAPER_TABLE.items() for name, tau in zip(_PAPER_COLUMNS, taus)),
    # the model card's README command: `dflash benchmark openai` with 128 prompts, concurrency 1
    PublishedTau("gsm8k", 5.46, _published("Qwen3.8-27B", "Qwen3.8-27B-DFlash2", 1.0, 0.95, 20, 8, "dflash-0.1", 4096,
                                           "xhigh"), 128, "Qwen3.8-27B-DFlash2 model card (quoted in xLLM #2279)"),
)


def _short(name: str | None) -> str:
    return (name or "").rstrip("/").rsplit("/", 1)[-1].lower()


def _said(name: str, value) -> object:
    return value or "off" if name == "reasoning" else value


def published_for(benchmark: str, setting: Setting) -> tuple[PublishedTau, list[str]] | None:
    """The published tau for this benchmark, target, drafter and temperature, with what else differs from its
    setting (each a short phrase, e.g. "block size 8, published 16"); None when none was published."""
    for entry in PUBLISHED:
        theirs = entry.setting
        if (entry.benchmark == benchmark and _short(setting.target) == _short(theirs.target)
                and _short(setting.drafter) == _short(theirs.drafter) and setting.temperature == theirs.temperature):
            differs = [f"{said} {_said(name, getattr(setting, name))}, published {_said(name, getattr(theirs, name))}"
                       for name, said in _SAID.items()
                       if _said(name, getattr(setting, name)) != _said(name, getattr(theirs, name))]
            return entry, differs
    return None


def compare(tau: float, ci95: tuple[float, float] | list[float], entry: PublishedTau, differs: list[str]) -> dict:
    """Ours beside the published value: the gap (ours minus published) and whether it lies beyond our 95% CI."""
    low, high = ci95
    beyond = not low <= entry.tau <= high
    return {"tau": entry.tau, "source": entry.source, "protocol": entry.setting.protocol,
            "temperature": entry.setting.temperature, "prompts": entry.prompts, "gap": tau - entry.tau,
            "beyond_ci": beyond, "differs": differs}


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
                differs = [*differs, f"rows: not the {entry.setting.protocol} subset"]
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

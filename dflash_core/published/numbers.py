"""The acceptance lengths z-lab and DeepSpec published, and how ours compares with them.

z-lab's tau is per response (each MT-Bench turn is one) the mean of accepted + 1 over its decode steps, averaged
over responses, which is our `tau_macro`. DeepSpec's (the DSpark paper's Table 1) is pooled: accepted + 1 summed
over every step of every response of a task, over the number of steps, which is our `tau_pooled`; its published
numbers are set beside our pooled tau (its protocol's `published_tau`). A published number stands beside ours only
where the target and drafter are the published pair and the served setting is the published one; what else
differs (protocol, subset, block size, new tokens) is said beside it.
"""

from dataclasses import dataclass

from .protocols import DEEPSPEC_COUNTS  # (eval.py's counts: each of its files holds at least as many rows)

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

# The DSpark paper (DeepSeek-AI and Peking University, 2026; DSpark_paper.pdf in github deepseek-ai/DeepSpec), Table 1:
# tau (bonus token included) at T = 1.0, block 7 (seven drafts a step), the confidence scheduler off, by DeepSpec's
# eval.py (protocol deepspec: its counts, 2048 new tokens, thinking off), pooled over each task's steps. Drafters:
# the released deepseek-ai/{dflash,dspark}_<target>_block7 (DeepSpec's README: the checkpoints of Table 1); its
# Eagle3 rows are left out (no DFlash-family drafter). Columns as the table orders them; Alpaca is published though
# DeepSpec's files hold no alpaca.jsonl (protocols.DEEPSPEC_MISSING).
_DSPARK_COLUMNS = ("gsm8k", "math500", "aime25", "mbpp", "humaneval", "livecodebench", "mt-bench", "alpaca",
                   "arena-hard-v2")
_DSPARK_TABLE = {
    ("Qwen3-4B", "dflash_qwen3_4b_block7"): (5.40, 4.85, 4.15, 4.40, 4.74, 4.18, 3.07, 2.96, 2.83),
    ("Qwen3-4B", "dspark_qwen3_4b_block7"): (6.11, 5.70, 4.89, 5.13, 5.38, 4.86, 3.64, 3.54, 3.29),
    ("Qwen3-8B", "dflash_qwen3_8b_block7"): (5.33, 4.91, 4.07, 4.36, 4.64, 4.39, 3.11, 2.98, 2.81),
    ("Qwen3-8B", "dspark_qwen3_8b_block7"): (6.17, 5.78, 5.01, 5.16, 5.52, 5.17, 3.72, 3.58, 3.21),
    ("Qwen3-14B", "dflash_qwen3_14b_block7"): (5.41, 4.84, 3.98, 4.44, 4.59, 4.33, 3.10, 2.94, 2.72),
    ("Qwen3-14B", "dspark_qwen3_14b_block7"): (6.21, 5.74, 4.94, 5.26, 5.43, 5.02, 3.70, 3.58, 3.13),
    # the paper's Gemma4-12B is google/gemma-4-12B-it (DeepSpec's README)
    ("gemma-4-12B-it", "dflash_gemma4_12b_block7"): (5.45, 5.04, 4.22, 4.39, 4.95, 3.70, 2.98, 2.84, 2.59),
    ("gemma-4-12B-it", "dspark_gemma4_12b_block7"): (6.05, 5.78, 5.12, 5.11, 5.64, 4.51, 3.49, 3.35, 2.92),
}
DSPARK_SOURCE = "DSpark paper, Table 1 (github deepseek-ai/DeepSpec at afdfa7c, DeepSpec's eval.py)"


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
    *(PublishedTau(name, tau, _published(target, drafter, 1.0, 1.0, 0, 7, "deepspec", 2048, None),
                   DEEPSPEC_COUNTS[name], DSPARK_SOURCE)
      for (target, drafter), taus in _DSPARK_TABLE.items() for name, tau in zip(_DSPARK_COLUMNS, taus)),
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


def compare(tau: float, ci95: tuple[float, float] | list[float], entry: PublishedTau, differs: list[str],
            measure: str = "macro") -> dict:
    """Ours beside the published value: the gap (ours minus published) and whether it lies beyond our 95% CI.
    `tau` and `ci95` are our tau of the kind the published one is (`measure`: "macro" or "pooled")."""
    low, high = ci95
    beyond = not low <= entry.tau <= high
    return {"tau": entry.tau, "source": entry.source, "protocol": entry.setting.protocol,
            "temperature": entry.setting.temperature, "prompts": entry.prompts, "gap": tau - entry.tau,
            "beyond_ci": beyond, "differs": differs, "measure": measure}


def _pooled(summary: dict) -> dict:
    """Our pooled tau and its interval where the scores hold them (scores made before they did have neither)."""
    return {"tau_pooled": summary["tau_pooled"], "pooled_ci95": list(summary["pooled_ci95"])} \
        if "tau_pooled" in summary else {}


def _beside(ours: dict, entry: PublishedTau, differs: list[str]) -> dict:
    """Ours beside the published entry, compared as it was averaged: a pooled publication (its protocol's
    `published_tau`, DeepSpec's) against our pooled tau, else against our per-response tau."""
    from .protocols import PROTOCOLS

    if PROTOCOLS[entry.setting.protocol].published_tau == "pooled":
        if "tau_pooled" in ours:
            return compare(ours["tau_pooled"], ours["pooled_ci95"], entry, differs, "pooled")
        differs = [*differs, "tau per response (these scores hold no pooled tau per benchmark), published pooled"]
    return compare(ours["tau"], ours["ci95"], entry, differs)


def beside_published(by_benchmark: dict, prompt_set: dict, setting: Setting) -> dict:
    """The results' `benchmarks`: per benchmark (z-lab's group order) our tau, interval and responses (and our
    pooled tau where the scores hold it), where its rows came from and whether they are the protocol's subset, and
    the published tau beside it where there is one (`measure`: which of ours it is compared with); per group its
    Average. `by_benchmark`: metrics.benchmark_summary's; `prompt_set`: the references' record of the set
    (prompt_set.BenchmarkPromptSet.to_json)."""
    from .benchmarks import GROUPS, ORDER

    uses = {use["name"]: use for use in prompt_set["benchmarks"]}
    order = sorted(uses, key=lambda n: (GROUPS.index(uses[n]["group"]), ORDER.index(n)))
    rows = []
    for name in order:
        ours = by_benchmark["benchmarks"].get(name)
        if ours is None:
            continue
        row = {**uses[name], "tau": ours["tau"], "ci95": list(ours["ci95"]), "responses": ours["responses"],
               **_pooled(ours), "published": None}
        if found := published_for(name, setting):
            entry, differs = found
            if not uses[name]["protocol_subset"]:
                differs = [*differs, f"rows: not the {entry.setting.protocol} subset"]
            row["published"] = _beside(ours, entry, differs)
        rows.append(row)
    groups = {}
    for group in GROUPS:
        if group not in by_benchmark["groups"]:
            continue
        average = by_benchmark["groups"][group]
        members = [r for r in rows if r["group"] == group]
        published = [r["published"]["tau"] for r in members if r["published"]]
        measures = {r["published"]["measure"] for r in members if r["published"]}
        groups[group] = {"tau": average["tau"], "ci95": list(average["ci95"]), "benchmarks": average["benchmarks"],
                         **_pooled(average),
                         "published": sum(published) / len(published) if len(published) == len(members)
                         and len(measures) == 1 else None,
                         # which of our Averages the published one is set beside (its members' measure)
                         **({"measure": measures.pop()} if len(measures) == 1 else {})}
    return {"protocol": prompt_set["protocol"], "template_kwargs": prompt_set.get("template_kwargs", {}),
            "rows": rows, "groups": groups}

"""Sampling as it is served: the target's next-token distribution at a temperature, after top-k, top-p
and min-p, and the two rules serving stacks verify a drafted block with.

The distribution, in SGLang's order (transformers' logits processors give the same probabilities):

    p = softmax(logits / temperature)
    top-k:  keep the k most likely tokens (ties with the k-th kept)             0 = off
    top-p:  keep the most likely tokens whose mass before each is < top_p      1 = off
    min-p:  keep tokens with p >= min_p * max(p)                               0 = off

each step renormalising what it keeps. Temperature 0 is greedy: the most likely token, always.

With greedy drafts (SGLang, vLLM's default draft_sample_method "greedy", z-lab's paper-era benchmark) a stack
drafts the drafter's argmax, also at temperature > 0, and verifies by one of:

- "match" (z-lab `dflash_generate`): the target samples a token at every block position; a draft is
  accepted while it equals the target's sample; the target's sample at the first mismatch is emitted.
- "rejection" (SGLang `tree_speculative_sampling_target_only` with no draft probabilities; vLLM's
  rejection sampler with `draft_prob = 1`): a draft d is accepted with probability p(d); on rejection a
  token is sampled from p without d.

Both emit samples of the target's own distribution (lossless), and under both a draft is accepted iff it
equals the token emitted at its position. So the offline replay over the tokens an online loop emitted
gives exactly that loop's acceptance lengths, at any temperature.

With sampled drafts (dflash 0.1.0, vLLM's "probabilistic") each draft is drawn from the drafter's q and accepted
by rejection sampling (`verify_sampled_block`); the replay's rule for them is in dflash_core.sampled_drafts.
"""

import hashlib
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import torch

from .choices import DraftSampleMethod

Verification = Literal["match", "rejection"]
VERIFICATIONS: tuple[Verification, ...] = ("match", "rejection")

# The temperatures a target is sampled at: 0 (greedy), or one in [MIN_TEMPERATURE, MAX_TEMPERATURE], the range the
# serving stacks both serve as given. Below it they differ: vLLM (vllm/sampling_params.py) is greedy below
# _SAMPLING_EPS = 1e-5 and raises any other temperature below _MAX_TEMP = 1e-2 to 1e-2 ("may cause numerical errors
# nan or inf"), SGLang (python/sglang/srt/sampling/sampling_params.py) is greedy below _SAMPLING_EPS = 1e-6 and
# samples at any other; so a temperature there is refused (give 0 for greedy), not mapped to either. Above it vLLM
# refuses ("temperature must be in [0, 2]", as OpenAI's API bounds it) and the distribution is close to uniform.
# flows/settings.py states the same bounds (it imports no torch); tests/test_bad_input.py checks they agree.
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 2.0


@dataclass(frozen=True)
class Sampling:
    """Sampling settings (SGLang's names): temperature 0 is greedy, and then the others must be off."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off (SGLang and vLLM also take -1)
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        # (an evaluation's settings are checked with the user's names first: flows/settings.py)
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):  # also NaN
            raise ValueError(f"temperature must be 0 (greedy) or lie in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                             f"got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a whole number, 0 (off) or more, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must lie in [0, 1) (0 = off), got {self.min_p}")
        if self.greedy and (self.top_k, self.top_p, self.min_p) != (0, 1.0, 0.0):
            raise ValueError("top_k, top_p and min_p apply at a temperature above 0: at temperature 0 "
                             "decoding is greedy")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def identity(self) -> dict:
        """What the references' key holds of the settings ({"temperature": 0.0} for greedy, as always)."""
        return {"temperature": 0.0} if self.greedy else {k: float(v) if k != "top_k" else v
                                                         for k, v in asdict(self).items()}

    @classmethod
    def from_identity(cls, identity: dict) -> "Sampling":
        """The settings an identity() (or a record holding one, with more keys) describes."""
        return cls(**{k: identity[k] for k in ("temperature", "top_k", "top_p", "min_p") if k in identity})

    def describe(self) -> str:
        """For names and logs: "greedy", or e.g. "T=0.6 top-k 20 top-p 0.95"."""
        if self.greedy:
            return "greedy"
        parts = [f"T={self.temperature:g}"]
        parts += [f"top-k {self.top_k}"] if self.top_k else []
        parts += [f"top-p {self.top_p:g}"] if self.top_p < 1 else []
        parts += [f"min-p {self.min_p:g}"] if self.min_p else []
        return " ".join(parts)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution tokens are sampled from, float32, for logits [..., V] (greedy: one-hot argmax)."""
        logits = logits.float()
        if self.greedy:
            return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        scores = logits / self.temperature
        if self.top_k and self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        p = scores.softmax(-1)
        if self.top_p < 1:
            sorted_p, order = p.sort(-1, descending=True)
            before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
            drop = before >= self.top_p
            drop[..., 0] = False  # the most likely token always stays
            p = p.masked_fill(drop.scatter(-1, order, drop), 0.0)
            p = p / p.sum(-1, keepdim=True)
        if self.min_p:
            p = p.masked_fill(p < self.min_p * p.amax(-1, keepdim=True), 0.0)
            p = p / p.sum(-1, keepdim=True)
        return p

    def probability_of(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """probabilities(logits) [..., V] at `tokens` [...]: each token's probability as served, float32 [...]. With
        top-k only the k candidates are normalised and sorted (the whole vocabulary only where a tie at the k-th
        logit keeps more than k, as probabilities() keeps them)."""
        if self.greedy:
            return (logits.argmax(-1) == tokens).float()
        scores = logits.float() / self.temperature
        if not self.top_k or self.top_k >= scores.shape[-1]:
            return self.probabilities(logits).gather(-1, tokens[..., None])[..., 0]
        values, candidates = scores.topk(self.top_k, dim=-1)  # sorted, most likely first
        if bool(((scores == values[..., -1:]).sum(-1) > 1).any()):
            return self.probabilities(logits).gather(-1, tokens[..., None])[..., 0]
        p = values.softmax(-1)
        if self.top_p < 1:
            drop = p.cumsum(-1) - p >= self.top_p  # mass of the more likely candidates
            drop[..., 0] = False
            p = p.masked_fill(drop, 0.0)
            p = p / p.sum(-1, keepdim=True)
        if self.min_p:
            p = p.masked_fill(p < self.min_p * p[..., :1], 0.0)
            p = p / p.sum(-1, keepdim=True)
        return (p * (candidates == tokens[..., None])).sum(-1)

    def sample(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """One token per row of logits [..., V] ([...] long): the argmax when greedy, else a draw."""
        if self.greedy:
            return logits.argmax(-1)
        return draw(self.probabilities(logits), generator)


GREEDY = Sampling()


@dataclass(frozen=True)
class DraftSampling:
    """Drafts sampled from the drafter's q and accepted by rejection sampling (dflash 0.1.0, vLLM's
    draft_sample_method="probabilistic"): one value from the input checks (Served.draft_sampling) through the drafts
    stage to its store entry, which holds it as `to_record()` gives it."""

    q: Sampling  # how the drafter's logits become the distribution each draft is drawn from
    seed: int = 0  # of the acceptance coins (each reference's follow from it and the reference's id)

    def to_record(self) -> dict[str, Any]:
        """The one form stored: the drafts key's `sampled_drafts` and the drafts record's `draft_sampling`. The same
        dict as before this type existed ({"q": q.identity(), "seed": seed}), so stores keep their entries."""
        return {"q": self.q.identity(), "seed": self.seed}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "DraftSampling":
        """The value a drafts record's `draft_sampling` (to_record's dict) holds."""
        return cls(Sampling.from_identity(record["q"]), record.get("seed", 0))


@dataclass(frozen=True)
class Served:
    """How the target is served, which is what a tau answers for: the sampling of its completions, how many per
    prompt and their seed, the tokens it verifies per step, and how the drafts are drawn. One value with one label,
    which results, series, run names and tags all read."""

    sampling: Sampling = GREEDY
    samples: int = 1  # completions per prompt
    seed: int = 0  # of the sampled completions (and of the acceptance coins of sampled drafts)
    block_size: int | None = None  # tokens verified per step when not the drafter's own block size; None: its own
    given: bool = False  # the completions were given (a file), not generated: how they were sampled is not known
    # "greedy": the drafter's argmax, accepted iff emitted (SGLang, vLLM's default); "probabilistic": sampled from
    # the drafter's q and accepted by rejection sampling (dflash 0.1.0, vLLM's draft_sample_method="probabilistic")
    draft_sample_method: DraftSampleMethod = "greedy"
    draft_truncation: bool = True  # probabilistic: q gets the served top-k, top-p and min-p too (else T alone)
    # a drafter with a confidence head (DSpark) verifies only the drafts before the first it is less confident of
    # than this, as DeepSpec's evaluator and the serving stacks' DSpark threshold do; 0: every draft
    confidence_threshold: float = 0.0

    @property
    def draft_q(self) -> "Sampling | None":
        """How the drafter's logits become q when drafts are sampled (None: greedy drafts)."""
        if self.draft_sample_method == "greedy":
            return None
        return self.sampling if self.draft_truncation else Sampling(self.sampling.temperature)

    @property
    def draft_sampling(self) -> DraftSampling | None:
        """The sampled drafts this setting asks for, as the drafts stage takes them (None: greedy drafts): q, and
        the setting's seed for the acceptance coins."""
        q = self.draft_q
        return None if q is None else DraftSampling(q, self.seed)

    @property
    def label(self) -> str:
        """"greedy", "T=0.6 top-k 20, 8 samples per prompt, seed 0", "given completions" (", T=0.6 top-k 20" with
        sampled drafts over them), then ", sampled drafts"
        (with " (q at the temperature only)" where that differs) when drafts are sampled, then ", blocks of 4" when a
        block size is chosen, then ", confidence threshold 0.5" when one is set."""
        if self.given:  # (sampling settings only where sampled drafts need them: the target's p and the drafter's q)
            made = "given completions" + ("" if self.sampling.greedy else f", {self.sampling.describe()}")
        elif self.sampling.greedy:
            made = "greedy"
        else:
            made = f"{self.sampling.describe()}, {self.samples} samples per prompt, seed {self.seed}"
        q = self.draft_q
        if q is not None:
            made += ", sampled drafts" + ("" if q == self.sampling else " (q at the temperature only)")
        return (made + (f", blocks of {self.block_size}" if self.block_size else "")
                + (f", confidence threshold {self.confidence_threshold:g}" if self.confidence_threshold else ""))

    @property
    def default(self) -> bool:
        """Greedy at the drafter's own block size: what names and messages need not mention."""
        return self.label == "greedy"

    def tags(self) -> list[str]:
        """Prefect tags of a run served so, to filter by (none when greedy at the drafter's block size)."""
        tags = []
        if self.given:
            tags += ["references:given", *([] if self.sampling.greedy else [f"sampling:{self.sampling.describe()}"])]
        elif not self.sampling.greedy:
            tags += [f"sampling:{self.sampling.describe()}", f"samples:{self.samples}"]
        if self.draft_sample_method != "greedy":
            tags.append(f"drafts:{self.draft_sample_method}")
        if self.block_size:
            tags.append(f"block-size:{self.block_size}")
        if self.confidence_threshold:
            tags.append(f"confidence-threshold:{self.confidence_threshold:g}")
        return tags

    def to_json(self) -> dict:
        """What results hold of it: the label, then every value (the confidence threshold where one is set: a
        drafter without a confidence head has none, and results without it read as they did)."""
        threshold = {"confidence_threshold": self.confidence_threshold} if self.confidence_threshold else {}
        return {"label": self.label, "references": "given" if self.given else "greedy" if self.sampling.greedy
                else "sampled", **asdict(self.sampling), "samples": self.samples, "seed": self.seed,
                "block_size": self.block_size, "draft_sample_method": self.draft_sample_method,
                "draft_truncation": self.draft_truncation, **threshold}

    @classmethod
    def from_record(cls, sampling: dict | None, given: bool = False, block_size: int | None = None,
                    draft_sampling: DraftSampling | dict | None = None,
                    confidence_threshold: float | None = None) -> "Served":
        """The served setting a references record's `sampling` (None: greedy), whether its completions were given,
        and a drafts record's chosen block size, draft sampling (None: greedy drafts; its record's dict, or the
        value) and confidence threshold (None: none) describe."""
        served = cls(given=given, block_size=block_size) if sampling is None else cls(  # (given: the settings only)
            Sampling.from_identity(sampling), sampling.get("samples", 1), sampling.get("seed", 0), block_size, given)
        served = replace(served, confidence_threshold=confidence_threshold or 0.0)
        if draft_sampling is None:
            return served
        drafts = (draft_sampling if isinstance(draft_sampling, DraftSampling)
                  else DraftSampling.from_record(draft_sampling))
        # the record holds q, not the setting that made it: q is the served sampling whole unless truncation was off
        return replace(served, draft_sample_method="probabilistic", draft_truncation=drafts.q == served.sampling)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [..., V]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def verify_block(drafts: list[int], logits: torch.Tensor, sampling: Sampling, rule: Verification,
                 generator: torch.Generator | None) -> list[int]:
    """The tokens one speculative step emits: the accepted drafts, then the target's token after them.

    drafts: the B-1 drafted tokens; logits [B, V]: the target's logits after the block's first token and
    after each draft (row j predicts the token at draft position j). The result has 1..B tokens, and its
    first len - 1 are the accepted drafts."""
    if sampling.greedy or rule == "match":
        posterior = sampling.sample(logits, generator).tolist()  # the target's token at every position
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == posterior[accepted]:
            accepted += 1
        return drafts[:accepted] + [posterior[accepted]]
    if rule != "rejection":
        raise ValueError(f"verification rule {rule!r}: use one of {', '.join(VERIFICATIONS)}")
    probs = sampling.probabilities(logits)
    for j, d in enumerate(drafts):
        u = torch.rand((), generator=generator, device=probs.device)
        if u < probs[j, d]:
            continue
        residual = probs[j].clone()
        residual[d] = 0.0  # p without the rejected draft (draw renormalises)
        return drafts[:j] + [int(draw(residual, generator))]
    return drafts + [int(draw(probs[len(drafts)], generator))]


def verify_sampled_block(drafts: list[int], draft_probs: torch.Tensor, logits: torch.Tensor, sampling: Sampling,
                         generator: torch.Generator | None) -> list[int]:
    """What one speculative step emits when the drafts were sampled from the drafter's q (dflash 0.1.0's and vLLM's
    probabilistic drafting): draft j is accepted while u * q_j(d) < p_j(d), u ~ U(0, 1); at the first rejection the
    token is drawn from normalise((p_j - q_j)+) (from p_j should that hold no mass), and with every draft accepted
    the bonus from the next p. draft_probs [B-1, V]: q at each draft position; logits [B, V] as verify_block's."""
    probs = sampling.probabilities(logits)
    for j, d in enumerate(drafts):
        u = torch.rand((), generator=generator, device=probs.device)
        if u * draft_probs[j, d] < probs[j, d]:
            continue
        residual = (probs[j] - draft_probs[j]).clamp_min(0.0)
        return drafts[:j] + [int(draw(residual if residual.sum() > 0 else probs[j], generator))]
    return drafts + [int(draw(probs[len(drafts)], generator))]


def sample_seed(seed: int, *item) -> int:
    """The seed of one sampled completion request: from the run's seed and what names the request (the
    prompt's id, the sample's index, the turn), so each is reproducible alone, whatever order or process
    asks for it. Below 2**31: every server takes it (some seed numpy, which wants 32 bits)."""
    digest = hashlib.sha256("\0".join(map(str, (seed, *item))).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF

"""Request and method configuration: frozen dataclasses validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class Method(str, Enum):
    """Who proposes draft tokens. ``AR`` is plain autoregressive decoding (no proposer);
    ``DRAFT`` a draft model; ``PROMPT_LOOKUP`` n-gram lookup in the context; ``SUFFIX``
    suffix matching with continuation frequencies; ``HYBRID`` a lookup when it matches well,
    the draft model otherwise."""

    AR = "ar"
    DRAFT = "draft"
    PROMPT_LOOKUP = "prompt-lookup"
    SUFFIX = "suffix"
    HYBRID = "hybrid"

    @property
    def needs_draft_model(self) -> bool:
        return self in (Method.DRAFT, Method.HYBRID)

    @classmethod
    def parse(cls, value: "str | Method") -> "Method":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"method {value!r} is not one of {[m.value for m in cls]}") from None


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and how to sample it (the target's distribution is what comes out).

    temperature 0 is greedy decoding. ``top_k`` 0 and ``top_p`` 1 disable those filters.
    ``repetition_penalty`` follows transformers (CTRL, arXiv:1909.05858): logits of tokens
    already in the context are divided by it when positive, multiplied when negative.
    ``eos_token_ids``: None = the model's default EOS ids; () = no EOS at all.
    ``stop``: strings that end generation (the text is cut before them, like OpenAI/vLLM).
    ``min_new_tokens``: EOS is masked until that many tokens were generated.
    ``seed``: per-request seed for sampling; None draws a fresh random seed.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        def bad(name, allowed):
            raise ValueError(f"{name}={getattr(self, name)!r} is invalid; allowed: {allowed}")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            bad("max_new_tokens", "an integer >= 1")
        if not is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            bad("min_new_tokens", f"an integer from 0 to max_new_tokens ({self.max_new_tokens})")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            bad("temperature", "a finite number >= 0 (0 = greedy)")
        if not is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (0 = off)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            bad("top_p", "a number in (0, 1] (1 = off)")
        if not (isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0
                and math.isfinite(self.repetition_penalty)):
            bad("repetition_penalty", "a finite number > 0 (1 = off)")
        if self.seed is not None and not (is_int(self.seed) and 0 <= self.seed < 2**63):
            bad("seed", "an integer from 0 to 2**63-1, or None")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (tuple, list)):
            bad("stop", "a string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "non-empty strings")
        if self.eos_token_ids is not None:
            ids = (self.eos_token_ids,) if isinstance(self.eos_token_ids, int) else tuple(self.eos_token_ids)
            if any(not is_int(i) or i < 0 for i in ids):
                bad("eos_token_ids", "non-negative token ids")
            object.__setattr__(self, "eos_token_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class KSchedule(str, Enum):
    """How the speculation length K is chosen each round (:mod:`specdecode.schedule`)."""

    FIXED = "fixed"
    HEURISTIC = "heuristic"
    AUTO = "auto"


# K when none is given: a draft model pays per drafted token, lookups almost nothing (a
# hybrid's lookup proposes up to K, its draft model at most DEFAULT_K[DRAFT])
DEFAULT_K = {Method.DRAFT: 6, Method.HYBRID: 16, Method.PROMPT_LOOKUP: 16, Method.SUFFIX: 16}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed and verified.

    ``num_speculative_tokens`` is the speculation length K (draft tokens per verify pass;
    None = the method's default, :data:`DEFAULT_K`): fixed, or the starting K of the
    heuristic schedule; ``max_speculative_tokens`` caps K under the heuristic and auto
    schedules. ``draft_p_min``: a draft model stops drafting below this top probability.
    ``max_ngram`` / ``min_ngram``: prompt lookup's n-gram sizes (default 5..2, BENCHMARKS.md).
    ``suffix_cache``: "request" or "session" (also match earlier outputs).
    """

    method: Method = Method.DRAFT
    num_speculative_tokens: int | None = None
    schedule: KSchedule = KSchedule.FIXED
    max_speculative_tokens: int = 16
    draft_p_min: float | None = None
    max_ngram: int = 5
    min_ngram: int = 2
    suffix_cache: str = "request"

    def __post_init__(self):
        object.__setattr__(self, "method", Method.parse(self.method))
        try:
            object.__setattr__(self, "schedule", KSchedule(self.schedule))
        except ValueError:
            raise ValueError(f"speculation length schedule {self.schedule!r} is invalid; allowed: "
                             f"{[s.value for s in KSchedule]}") from None
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", DEFAULT_K.get(self.method, 1))
        for name in ("num_speculative_tokens", "max_speculative_tokens"):
            k = getattr(self, name)
            if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 64:
                raise ValueError(f"{name} (K) = {k!r} is invalid; allowed: an integer 1..64")
        p = self.draft_p_min
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1):
            raise ValueError(f"draft_p_min = {p!r} is invalid; allowed: a number in [0, 1), or None")
        if p is not None and not self.method.needs_draft_model:
            raise ValueError(f"draft_p_min applies to a draft model; method {self.method.value!r} has none")
        if not (all(isinstance(n, int) and not isinstance(n, bool) for n in (self.min_ngram, self.max_ngram))
                and 1 <= self.min_ngram <= self.max_ngram <= 32):
            raise ValueError(f"n-gram sizes min_ngram={self.min_ngram!r} max_ngram={self.max_ngram!r} "
                             "are invalid; allowed: integers with 1 <= min_ngram <= max_ngram <= 32")
        if self.suffix_cache not in ("request", "session"):
            raise ValueError(f"suffix_cache = {self.suffix_cache!r} is invalid; allowed: 'request', 'session'")
        # an option the method cannot honour is an error, never silently ignored
        if self.suffix_cache != "request" and self.method not in (Method.SUFFIX, Method.HYBRID):
            raise ValueError(f"suffix_cache applies to the suffix and hybrid methods, not {self.method.value!r}")
        default_ngram = (SpeculativeConfig.min_ngram, SpeculativeConfig.max_ngram)
        if (self.min_ngram, self.max_ngram) != default_ngram and self.method is not Method.PROMPT_LOOKUP:
            raise ValueError(f"n-gram sizes apply to prompt lookup, not {self.method.value!r}")
        if self.max_speculative_tokens != 16 and self.schedule is KSchedule.FIXED:
            raise ValueError("max_speculative_tokens caps K for the 'heuristic' and 'auto' schedules; "
                             f"with a fixed K give num_speculative_tokens instead (got "
                             f"{self.max_speculative_tokens})")

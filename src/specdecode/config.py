"""Request configuration: frozen dataclasses validated on construction, and the one check of
a speculation length K. (A method's configuration, :class:`~specdecode.methods.SpeculativeConfig`,
lives with the method registry it is validated against.)"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

MAX_K = 64  # the largest speculation length K accepted anywhere
# outside them logits / temperature leave fp32's range (inf, then nan; or all 0, which the
# top-k / top-p filters then cannot tell apart)
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-20, 1e30
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)
ACCEPTANCE_RULES = ("gumbel", "rejection")


def check_k(name: str, k) -> int:
    """``k`` if it is a speculation length (an integer 1..MAX_K); else ValueError naming
    ``name`` and the allowed values."""
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
        raise ValueError(f"{name} = {k!r} is invalid; allowed: an integer 1..{MAX_K}")
    return k


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
    ``acceptance_rule`` (sampled requests): "gumbel", the drafter-invariant rule (the token at
    each position is the Gumbel-max sample of the target's distribution with noise keyed on
    (seed, position); a draft token is accepted when it equals it), under which a seeded
    request's output depends on the seed, prompt and target alone, whatever proposes and
    whatever K; or "rejection", speculative sampling (Leviathan et al., arXiv:2211.17192),
    whose acceptance is a little higher but whose text moves with the proposer and K. None
    = "gumbel" for seeded requests, "rejection" for unseeded ones (see :attr:`rule`;
    BENCHMARKS.md has the measured trade).
    ``logprobs``: None, or return each generated token's log-probability under the target
    plus the ``logprobs`` most likely alternatives (0..20), from the target's raw logits
    before temperature and filters (vLLM's default ``raw_logprobs``).
    ``grammar``: a :class:`~specdecode.grammar.Grammar` the output follows (structured
    output: tokens it refuses are masked before sampling at every position), or None.
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
    acceptance_rule: str | None = None
    logprobs: int | None = None
    grammar: object | None = None

    def __post_init__(self):
        def bad(name, allowed):
            raise ValueError(f"{name}={getattr(self, name)!r} is invalid; allowed: {allowed}")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            bad("max_new_tokens", "an integer >= 1")
        if not is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            bad("min_new_tokens", f"an integer from 0 to max_new_tokens ({self.max_new_tokens})")
        if not (isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
                and math.isfinite(self.temperature)
                and (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE)):
            bad("temperature", f"0 (greedy) or a number from {MIN_TEMPERATURE:g} to "
                f"{MAX_TEMPERATURE:g} (beyond them the scaled logits leave fp32's range)")
        if not is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "an integer >= 0, or -1 (0 and -1 = off, as vLLM's -1)")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            bad("top_p", "a number in (0, 1] (1 = off)")
        if not (isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0
                and math.isfinite(self.repetition_penalty)):
            bad("repetition_penalty", "a finite number > 0 (1 = off)")
        if self.seed is not None and not (is_int(self.seed) and -2**63 <= self.seed < 2**63):
            bad("seed", "an integer from -2**63 to 2**63-1 (OpenAI's range), or None")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (tuple, list)):
            bad("stop", "a string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "non-empty strings")
        for s in self.stop:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate: it could never match decoded text
                bad("stop", "valid UTF-8 text (a lone surrogate, e.g. a byte that was not UTF-8, "
                    "can never be generated)")
        if self.eos_token_ids is not None:
            ids = (self.eos_token_ids,) if isinstance(self.eos_token_ids, int) else tuple(self.eos_token_ids)
            if any(not is_int(i) or i < 0 for i in ids):
                bad("eos_token_ids", "non-negative token ids")
            object.__setattr__(self, "eos_token_ids", ids)
        if self.acceptance_rule not in (None, *ACCEPTANCE_RULES):
            bad("acceptance_rule", f"{', '.join(map(repr, ACCEPTANCE_RULES))} or None (gumbel when "
                "seeded, else rejection)")
        if self.logprobs is not None and not (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"None, or an integer from 0 to {MAX_LOGPROBS} (the alternatives per token)")
        if self.grammar is not None and not callable(getattr(self.grammar, "start", None)):
            bad("grammar", "None or a specdecode.grammar.Grammar")
        if self.grammar is not None and self.eos_token_ids == ():
            bad("eos_token_ids", "at least one EOS id with a response format (where its grammar is "
                "complete only EOS is allowed)")
        if self.grammar is not None and self.min_new_tokens:
            bad("min_new_tokens", "0 with a response format (its grammar decides where the output "
                "ends; masking EOS could leave no token allowed)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def rule(self) -> str:
        """The acceptance rule this request runs: "greedy" (temperature 0), else
        ``acceptance_rule``, by default "gumbel" when seeded and "rejection" when not."""
        if self.greedy:
            return "greedy"
        if self.acceptance_rule is not None:
            return self.acceptance_rule
        return "gumbel" if self.seed is not None else "rejection"


class KSchedule(str, Enum):
    """How the speculation length K is chosen each round (:mod:`specdecode.schedule`)."""

    FIXED = "fixed"
    HEURISTIC = "heuristic"
    AUTO = "auto"

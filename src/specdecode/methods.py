"""The method registry: every speculative decoding method, declared once.

A method is one :class:`MethodSpec` entry in :data:`METHODS`: its name, who proposes, how its
proposer is built, its default speculation length K (its proposer class's ``default_k``) and
which options it honours. The :class:`Method` enum, the CLI's ``--method`` choices and help,
the API's ``method=``, the bench's method list and options, and the validation of
:class:`SpeculativeConfig` are all read from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

from .config import MAX_K, KSchedule, check_k
from .models.loading import LoadedModel, check_compatible
from .profile import verify_profile
from .proposers import (DraftModelProposer, HybridProposer, PromptLookupProposer, Proposer,
                        SuffixProposer)
from .schedule import AutoK, FixedK, HeuristicK, Schedule

# option -> how messages name it; each method names the ones it honours (MethodSpec.options):
# draft (a draft model), draft_p_min (its p_min), ngram (prompt lookup's n-gram sizes),
# suffix_cache
OPTIONS = {
    "draft": "a draft model (draft=, assistant_model=, --draft and its --draft-* options) applies",
    "draft_p_min": "draft_p_min applies",
    "ngram": "n-gram sizes (min_ngram, max_ngram) apply",
    "suffix_cache": "suffix_cache applies",
}


@dataclass(frozen=True)
class MethodSpec:
    """One method.

    name: its name everywhere (``--method``, ``method=``, the bench, stats).
    summary: who proposes, one line (CLI and bench help).
    proposer: its proposer class (None: plain decoding); its ``default_k`` is the method's
        default K.
    build: (config, target, draft or None) -> the request's proposer (None for plain decoding).
    needs_draft_model: a draft model must be given (and is checked against the target).
    options: the :data:`OPTIONS` it honours; giving another is an error.
    """

    name: str
    summary: str
    proposer: type[Proposer] | None
    build: Callable[["SpeculativeConfig", LoadedModel, "LoadedModel | None"], "Proposer | None"]
    needs_draft_model: bool = False
    options: frozenset[str] = frozenset()

    @property
    def default_k(self) -> int | None:
        return self.proposer.default_k if self.proposer is not None else None


def _own_draft(target: LoadedModel, draft: LoadedModel):
    """The draft's model, with its own KV cache when it is the target itself (a fork
    sharing the weights)."""
    return draft.lm.fork() if draft.lm is target.lm else draft.lm


def _suffix(spec: "SpeculativeConfig", target: LoadedModel) -> SuffixProposer:
    """A new suffix proposer, or with ``suffix_cache="session"`` the one that lives as long
    as the loaded target (its counts of earlier outputs and its learned confidence)."""
    if spec.suffix_cache != "session":
        return SuffixProposer()
    return target.session_proposers.setdefault("suffix", SuffixProposer(cache="session"))


def _hybrid(spec: "SpeculativeConfig", target: LoadedModel, draft: LoadedModel) -> HybridProposer:
    # relative costs from the two models' forward-time profiles (measured once, cached)
    times = verify_profile(target, spec.max_speculative_tokens)
    return HybridProposer(_suffix(spec, target),
                          HybridProposer.draft_for(_own_draft(target, draft), spec.draft_p_min),
                          verify_cost=[t / times[0] for t in times],
                          draft_cost=verify_profile(draft, 0)[0] / times[0])


METHODS: dict[str, MethodSpec] = {m.name: m for m in (
    MethodSpec("ar", "nobody: plain autoregressive decoding (the baseline)", None,
               lambda spec, target, draft: None),
    MethodSpec("draft", "a draft model of the target's tokenizer drafts K tokens", DraftModelProposer,
               lambda spec, target, draft: DraftModelProposer(_own_draft(target, draft),
                                                              p_min=spec.draft_p_min),
               needs_draft_model=True, options=frozenset({"draft", "draft_p_min"})),
    MethodSpec("prompt-lookup", "copy what followed the last n tokens earlier in prompt + output",
               PromptLookupProposer,
               lambda spec, target, draft: PromptLookupProposer(spec.max_ngram, spec.min_ngram),
               options=frozenset({"ngram"})),
    MethodSpec("suffix", "the most frequent continuation of the longest matching suffix",
               SuffixProposer, lambda spec, target, draft: _suffix(spec, target),
               options=frozenset({"suffix_cache"})),
    MethodSpec("hybrid", "suffix matching or the draft model, whichever promises more tokens/s",
               HybridProposer, _hybrid, needs_draft_model=True,
               options=frozenset({"draft", "draft_p_min", "suffix_cache"})),
)}


class _MethodBase(str, Enum):
    @property
    def spec(self) -> MethodSpec:
        return METHODS[self.value]

    @property
    def needs_draft_model(self) -> bool:
        return self.spec.needs_draft_model

    @classmethod
    def parse(cls, value) -> "Method":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"method {value!r} is not one of {list(METHODS)}") from None


Method = _MethodBase("Method", {name.upper().replace("-", "_"): name for name in METHODS},
                     module=__name__)
Method.__doc__ = ("Who proposes draft tokens: one member per :data:`METHODS` entry "
                  "(``Method.AR`` is plain decoding, no proposer).")


def _inapplicable(option: str, method: str) -> str:
    """The error message for ``option`` given to a ``method`` that does not honour it."""
    honouring = " and ".join(repr(m.name) for m in METHODS.values() if option in m.options)
    return f"{OPTIONS[option]} to {honouring}, not {method!r}"


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed and verified.

    ``num_speculative_tokens`` is the speculation length K (draft tokens per verify pass;
    None = the method's default, ``METHODS[name].default_k``): fixed, or the starting K of
    the heuristic schedule; ``max_speculative_tokens`` caps K under the heuristic and auto
    schedules. The other fields are :data:`OPTIONS`, each honoured by the methods that name
    it: ``draft_p_min`` (None = the method's default), ``max_ngram`` / ``min_ngram``
    (``ngram``), ``suffix_cache``. Raises ValueError naming a bad value, or an option the
    method does not honour (never silently ignored).
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
        spec = self.method.spec
        if spec.proposer is None and self.num_speculative_tokens is not None:
            raise ValueError(f"method {spec.name!r} proposes nothing: a speculation length K "
                             f"(num_speculative_tokens={self.num_speculative_tokens!r}) does not apply")
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", spec.default_k or 1)
        check_k("num_speculative_tokens (K)", self.num_speculative_tokens)
        check_k("max_speculative_tokens (K)", self.max_speculative_tokens)
        p = self.draft_p_min
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1):
            raise ValueError(f"draft_p_min = {p!r} is invalid; allowed: a number in [0, 1), or None")
        if not (all(isinstance(n, int) and not isinstance(n, bool) for n in (self.min_ngram, self.max_ngram))
                and 1 <= self.min_ngram <= self.max_ngram <= 32):
            raise ValueError(f"n-gram sizes min_ngram={self.min_ngram!r} max_ngram={self.max_ngram!r} "
                             "are invalid; allowed: integers with 1 <= min_ngram <= max_ngram <= 32")
        if self.suffix_cache not in ("request", "session"):
            raise ValueError(f"suffix_cache = {self.suffix_cache!r} is invalid; allowed: 'request', 'session'")
        given = {"draft_p_min": p is not None,
                 "ngram": (self.min_ngram, self.max_ngram) != (SpeculativeConfig.min_ngram,
                                                               SpeculativeConfig.max_ngram),
                 "suffix_cache": self.suffix_cache != SpeculativeConfig.suffix_cache}
        for option, is_given in given.items():
            if is_given and option not in spec.options:
                raise ValueError(_inapplicable(option, spec.name))
        if self.max_speculative_tokens != 16 and self.schedule is KSchedule.FIXED:
            raise ValueError("max_speculative_tokens caps K for the 'heuristic' and 'auto' schedules; "
                             f"with a fixed K give num_speculative_tokens instead (got "
                             f"{self.max_speculative_tokens})")


def speculative_config(method: "str | Method | None", has_draft: bool,
                       num_speculative_tokens: int | str | None = None,
                       max_speculative_tokens: int = 16, draft_p_min: float | None = None,
                       max_ngram: int | None = None, suffix_cache: str = "request") -> SpeculativeConfig:
    """The :class:`SpeculativeConfig` of the API's / CLI's arguments: method None means
    "draft" when a draft model is given (``has_draft``), else "ar"; a draft model given to a
    method without one is an error, like every option a method does not honour; K is an integer, "heuristic" or "auto";
    ``max_ngram`` alone sets the shortest n-gram to min(2, max_ngram). Raises ValueError
    naming a bad or inapplicable value."""
    method = Method.parse(method) if method is not None else (Method.DRAFT if has_draft else Method.AR)
    if has_draft and "draft" not in method.spec.options:
        raise ValueError(f"{_inapplicable('draft', method.value)}: drop the draft model, or choose "
                         "one of those methods")
    schedule, k = KSchedule.FIXED, num_speculative_tokens
    if isinstance(k, str):
        if k not in (KSchedule.HEURISTIC.value, KSchedule.AUTO.value):
            raise ValueError(f"num_speculative_tokens={k!r} is invalid; allowed: an integer 1..{MAX_K}, "
                             "'heuristic' or 'auto'")
        schedule, k = KSchedule(k), None
    ngram = {}
    if max_ngram is not None:
        if "ngram" not in method.spec.options:
            raise ValueError(f"{_inapplicable('ngram', method.value)} (got max_ngram={max_ngram!r})")
        if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) or not 1 <= max_ngram <= 32:
            raise ValueError(f"max_ngram={max_ngram!r} (max_matching_ngram_size, --max-ngram) is "
                             "invalid; allowed: an integer 1..32")
        ngram = dict(max_ngram=max_ngram, min_ngram=min(SpeculativeConfig.min_ngram, max_ngram))
    return SpeculativeConfig(method, k, schedule, max_speculative_tokens, draft_p_min,
                             suffix_cache=suffix_cache, **ngram)


def build_proposer(spec: SpeculativeConfig, target: LoadedModel,
                   draft: LoadedModel | None) -> Proposer | None:
    """The proposer of ``spec.method`` for one request on ``target`` (None for plain
    decoding). Raises ValueError when the method needs a draft model and none is given,
    IncompatibleDraftError when the draft's tokenizer differs (checked once per pair)."""
    entry = spec.method.spec
    if entry.needs_draft_model:
        if draft is None:
            raise ValueError(f"method {entry.name!r} needs a draft model (draft= or assistant_model=)")
        check_compatible(target, draft)
    return entry.build(spec, target, draft if entry.needs_draft_model else None)


def build_schedule(spec: SpeculativeConfig, target: LoadedModel,
                   draft: LoadedModel | None = None) -> Schedule | None:
    """The K schedule of ``spec`` (None for plain decoding): fixed K, transformers'
    heuristic, or auto, which profiles the target's forward times T(1..max_k+1) and, for
    methods with a draft model, the draft's T(1) once (:func:`specdecode.profile.verify_profile`)."""
    if spec.method.spec.proposer is None:
        return None
    if spec.schedule is KSchedule.HEURISTIC:
        return HeuristicK(spec.num_speculative_tokens, spec.max_speculative_tokens)
    if spec.schedule is KSchedule.AUTO:
        draft_s = (verify_profile(draft, 0)[0]
                   if spec.method.needs_draft_model and draft is not None else 0.0)
        return AutoK(verify_profile(target, spec.max_speculative_tokens), spec.max_speculative_tokens,
                     draft_seconds_per_token=draft_s)
    return FixedK(spec.num_speculative_tokens)

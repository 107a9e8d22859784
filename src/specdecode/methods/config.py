""":class:`SpeculativeConfig`, how drafts are proposed and verified: its fields are the K
settings and every registered option's fields (:data:`~specdecode.methods.registry.OPTIONS`),
validated once when it is made; :func:`speculative_config` builds one from the API's and the
CLI's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass, replace

from ..config import MAX_K, KSchedule, check_k
from .options import split_method
from .registry import DEFAULT_METHOD, OPTIONS, Method, inapplicable


@dataclass(frozen=True)
class _KSettings:
    method: Method = DEFAULT_METHOD
    num_speculative_tokens: int | None = None
    schedule: KSchedule = KSchedule.FIXED
    max_speculative_tokens: int = 16
    # whether K was given (else the method's default, or what its start_k hook says)
    k_given: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        put = object.__setattr__
        put(self, "method", Method.parse(self.method))
        try:
            put(self, "schedule", KSchedule(self.schedule))
        except ValueError:
            raise ValueError(f"speculation length schedule {self.schedule!r} is invalid; allowed: "
                             f"{[s.value for s in KSchedule]}") from None
        spec = self.method.spec
        if not spec.speculates and (self.num_speculative_tokens is not None
                                    or self.schedule is not KSchedule.FIXED):
            k = self.num_speculative_tokens if self.num_speculative_tokens is not None else self.schedule.value
            raise ValueError(f"method {spec.name!r} proposes nothing: a speculation length K "
                             f"(num_speculative_tokens={k!r}) does not apply")
        put(self, "k_given", self.num_speculative_tokens is not None)
        if not self.k_given and self.schedule is KSchedule.FIXED:  # neither given: the method's
            put(self, "schedule", spec.schedule)
        if self.num_speculative_tokens is None:
            put(self, "num_speculative_tokens", spec.default_k or 1)
        check_k("num_speculative_tokens (K)", self.num_speculative_tokens)
        check_k("max_speculative_tokens (K)", self.max_speculative_tokens)
        for option in OPTIONS.values():
            if option.check is not None:
                for name, value in option.check(self).items():
                    put(self, name, value)
        for option in OPTIONS.values():
            if option.is_given(self) and option.name not in spec.option_names:
                raise ValueError(inapplicable(option.name, spec.name))
        if self.max_speculative_tokens != 16 and self.schedule is KSchedule.FIXED:
            raise ValueError("max_speculative_tokens caps K for the 'heuristic' and 'auto' schedules; "
                             f"with a fixed K give num_speculative_tokens instead (got "
                             f"{self.max_speculative_tokens})")


_DOC = """How drafts are proposed and verified.

``num_speculative_tokens`` is the speculation length K (draft tokens per verify pass; None =
the method's default, ``METHODS[name].default_k``): fixed, or the starting K of the heuristic
schedule; ``max_speculative_tokens`` caps K under the heuristic and auto schedules. With
neither a K nor a schedule given, the schedule is the method's (``METHODS[name].schedule``:
auto for the draft heads, else fixed). The other fields belong to the options
(:data:`~specdecode.methods.registry.OPTIONS`), each honoured by the methods that name it:

""" + "\n".join(f"- {o.doc}." for o in OPTIONS.values() if o.doc) + """

Raises ValueError naming a bad value, or an option the method does not honour (never
silently ignored).
"""

SpeculativeConfig = make_dataclass(
    "SpeculativeConfig",
    [(name, kind, field(default=default, kw_only=True))  # by name: their order is the registry's
     for o in OPTIONS.values() for name, kind, default in o.fields],
    bases=(_KSettings,), frozen=True, namespace={"__doc__": _DOC, "__module__": __name__})


# the option fields the API takes as keyword arguments (skip_layers=, head_dir=, ...): all but
# those speculative_config names itself (the n-gram sizes as max_matching_ngram_size)
KEYWORD_OPTIONS = tuple(name for o in OPTIONS.values() for name, _, _ in o.fields
                        if name not in ("draft_p_min", "max_ngram", "min_ngram", "suffix_cache"))


def speculative_config(method: "str | Method | SpeculativeConfig | None", has_draft: bool,
                       num_speculative_tokens: int | str | None = None,
                       max_speculative_tokens: int = 16, draft_p_min: float | None = None,
                       max_ngram: int | None = None, suffix_cache: str = "request",
                       **options) -> SpeculativeConfig:
    """The :class:`SpeculativeConfig` of the API's / CLI's arguments.

    Args:
        method: a name, a name with its own options (``"layer-skip:layers=3+5-8"``,
            :func:`~specdecode.methods.options.split_method`), a SpeculativeConfig whose method
            and own options are kept (the other fields are this call's: a server's method,
            parsed once), or None: :data:`DEFAULT_METHOD` ("hybrid") when a draft model is
            given (``has_draft``), else "ar".
        num_speculative_tokens: K, an integer, "heuristic" or "auto".
        max_ngram: alone sets the shortest n-gram to min(2, max_ngram).
        options: the method's own options by field name (:data:`KEYWORD_OPTIONS`), as its
            method string gives them.
    Raises:
        TypeError: a keyword that is no option (naming the allowed ones).
        ValueError: a bad or inapplicable value (a draft model given to a method without one,
            like every option a method does not honour).
    """
    unknown = sorted(set(options) - set(KEYWORD_OPTIONS))
    if unknown:
        raise TypeError(f"unexpected keyword argument{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}; "
                        f"a method's own options are {', '.join(KEYWORD_OPTIONS)}")
    own, base = {}, None
    if isinstance(method, SpeculativeConfig):
        base, method = method, method.method
    elif isinstance(method, str) and not isinstance(method, Method) and ":" in method:
        text, (method, own) = method, split_method(method)
        twice = sorted(set(own) & set(options))
        if twice:
            raise ValueError(f"{', '.join(twice)} given both in the method string {text!r} and as a "
                             "keyword: give it once")
    own = {**own, **options}
    method = Method.parse(method) if method is not None else (DEFAULT_METHOD if has_draft else Method.AR)
    if has_draft and "draft" not in method.spec.option_names:
        raise ValueError(f"{inapplicable('draft', method.value)}: drop the draft model, or choose "
                         "one of those methods")
    schedule, k = KSchedule.FIXED, num_speculative_tokens
    if isinstance(k, str):
        if k not in (KSchedule.HEURISTIC.value, KSchedule.AUTO.value):
            raise ValueError(f"num_speculative_tokens={k!r} is invalid; allowed: an integer 1..{MAX_K}, "
                             "'heuristic' or 'auto'")
        schedule, k = KSchedule(k), None
    ngram = dict(max_ngram=SpeculativeConfig.max_ngram, min_ngram=SpeculativeConfig.min_ngram)
    if max_ngram is not None:
        if "ngram" not in method.spec.option_names:
            raise ValueError(f"{inapplicable('ngram', method.value)} (got max_ngram={max_ngram!r})")
        if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) or not 1 <= max_ngram <= 32:
            raise ValueError(f"max_ngram={max_ngram!r} (max_matching_ngram_size, --max-ngram) is "
                             "invalid; allowed: an integer 1..32")
        ngram = dict(max_ngram=max_ngram, min_ngram=min(SpeculativeConfig.min_ngram, max_ngram))
    call = dict(num_speculative_tokens=k, schedule=schedule, max_speculative_tokens=max_speculative_tokens,
                draft_p_min=draft_p_min, suffix_cache=suffix_cache, **ngram)
    return replace(base, **call, **own) if base is not None else SpeculativeConfig(method, **call, **own)


def prompt_lookup_method(method: "str | Method | SpeculativeConfig | None"):
    """The method transformers' ``prompt_lookup_num_tokens=N`` runs: prompt lookup (with K =
    N), or a parsed config of it. Raises ValueError where ``method`` names another method."""
    named = method.method if isinstance(method, SpeculativeConfig) else method
    if named not in (None, Method.PROMPT_LOOKUP, Method.PROMPT_LOOKUP.value):
        raise ValueError(f"prompt_lookup_num_tokens selects prompt lookup; method="
                         f"{getattr(named, 'value', named)!r} conflicts")
    return method if isinstance(method, SpeculativeConfig) else Method.PROMPT_LOOKUP

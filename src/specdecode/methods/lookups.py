"""Lookup methods and their hybrids (docs/methods/lookups.md): prompt lookup and suffix
matching propose what followed the same text before, at no cost; the hybrid and ``self``
take a lookup's proposal or a draft's, whichever promises more tokens a second.
"""

from __future__ import annotations

from pathlib import Path

from ..models.loading import LoadedModel
from ..profile import draft_profile, prefill_profile, verify_profile
from ..proposers import HybridProposer, PromptLookupProposer, SuffixProposer
from ..proposers.hybrid import HybridTuning
from .draft import DRAFT, DRAFT_P_MIN, draft_proposer
from .draft import export_settings as draft_export_settings
from .self_spec import SKIP, layer_skip_draft, prepare_profile, profile_problem
from .self_spec import NO_EQUIVALENT
from .spec import Export, MethodSpec, Option, is_int

MAX_NGRAM, MIN_NGRAM = 5, 2


def _check_ngram(config) -> dict:
    lo, hi = config.min_ngram, config.max_ngram
    if not (is_int(lo) and is_int(hi) and 1 <= lo <= hi <= 32):
        raise ValueError(f"n-gram sizes min_ngram={lo!r} max_ngram={hi!r} are invalid; allowed: "
                         "integers with 1 <= min_ngram <= max_ngram <= 32")
    return {}


def _check_cache(config) -> dict:
    if config.suffix_cache not in ("request", "session"):
        raise ValueError(f"suffix_cache = {config.suffix_cache!r} is invalid; allowed: 'request', 'session'")
    return {}


NGRAM = Option(
    "ngram", "n-gram sizes (min_ngram, max_ngram) apply",
    (("max_ngram", int, MAX_NGRAM), ("min_ngram", int, MIN_NGRAM)),
    "``max_ngram`` / ``min_ngram``: the longest and shortest n-gram prompt lookup matches",
    check=_check_ngram)
SUFFIX_CACHE = Option(
    "suffix_cache", "suffix_cache applies", (("suffix_cache", str, "request"),),
    "``suffix_cache``: \"request\", or \"session\" to also match the outputs of earlier requests "
    "of the same loaded target", check=_check_cache)


def suffix_proposer(config, target: LoadedModel) -> SuffixProposer:
    """A new suffix proposer, or with ``suffix_cache="session"`` the one that lives as long
    as the loaded target (its counts of earlier outputs and its learned confidence)."""
    if config.suffix_cache != "session":
        return SuffixProposer()
    return target.session_proposers.setdefault("suffix", SuffixProposer(cache="session"))


def _hybrid(config, target: LoadedModel, draft: LoadedModel) -> HybridProposer:
    # relative costs from the two models' forward-time profiles (measured once, cached)
    times = verify_profile(target, config.max_speculative_tokens)
    member = draft_proposer(target, draft, config.draft_p_min, hybrid=True)
    own = draft_profile(draft)  # a parallel draft's proposal is one pass over more rows: T_d(n)
    return HybridProposer(suffix_proposer(config, target), member,
                          verify_cost=[t / times[0] for t in times], draft_cost=own[0] / times[0],
                          draft_prefill_cost=prefill_profile(draft) / times[0],
                          draft_pass_cost=[t / own[0] for t in own] if member.parallel else None)


def _measure_draft_prefill(config, target: LoadedModel, draft: LoadedModel | None = None) -> None:
    # the draft's feed cost, measured on the model itself before a batch holds a row of it
    if draft is not None:
        draft_profile(draft)
        prefill_profile(draft)


# the self method's hybrid never routes a lookup's round through the layer-skip draft: that
# check pass costs the draft's share of a verify pass of the whole proposal (0.6 T(17) with
# the default target's profile), where a draft model's cost a quarter; and a lookup takes a
# round whenever it promises more than the draft (margin 1): with a margin of 1.3 the self
# method trailed suffix matching alone on QA and translation (docs/EXPERIMENTS.md, the
# self method's tuning); nor does the draft read a lookup's proposal in its own rounds (a
# pass of up to 17 tokens)
SELF_TUNING = HybridTuning(check_below=0.0, lookup_margin=1.0, read_guess=False)


def _self_hybrid(config, target: LoadedModel, draft) -> HybridProposer:
    own, k = layer_skip_draft(config, target)
    times = verify_profile(target, config.max_speculative_tokens)
    return HybridProposer(suffix_proposer(config, target), HybridProposer.draft_for(own, config.draft_p_min),
                          verify_cost=[t / times[0] for t in times], draft_cost=own.cost,
                          draft_k=k, tuning=SELF_TUNING)


def _lookup_export(engine: str, k: int | None, draft_dir: Path | None, max_ngram: int,
                   min_ngram: int) -> tuple[str | None, dict | None, list[str], list[str]]:
    k = k or PromptLookupProposer.default_k
    if engine == "vllm":
        return "ngram", {"method": "ngram", "num_speculative_tokens": k,
                         "prompt_lookup_max": max_ngram, "prompt_lookup_min": min_ngram}, [], []
    return "NGRAM", None, ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(k)], \
        ["SGLang's NGRAM runs on CUDA only; it matches the prompt and the output so far, as prompt lookup does."]


def _suffix_export(engine: str, k: int | None, draft_dir: Path | None, max_ngram: int,
                   min_ngram: int) -> tuple[str | None, dict | None, list[str], list[str]]:
    if engine != "vllm":
        raise ValueError("SGLang has no suffix decoding: nothing reproduces it there; export "
                         "--method prompt-lookup (its NGRAM, the nearest), or suffix for vLLM")
    return "suffix", {"method": "suffix", "num_speculative_tokens": k or SuffixProposer.default_k}, [], \
        ["vLLM's suffix decoding needs the arctic-inference package on the serving machine "
         "(pip install arctic-inference)."]


def _hybrid_export(engine: str, *args) -> tuple[str | None, dict | None, list[str], list[str]]:
    name, config, flags, notes = draft_export_settings(engine, *args)
    return name, config, flags, [f"{engine} has no hybrid of lookup and draft model: the draft model "
                                 "half is exported (draft model speculation); lookups are left out.", *notes]


METHODS = (
    MethodSpec("prompt-lookup", "copy what followed the last n tokens earlier in prompt + output",
               PromptLookupProposer,
               lambda config, target, draft: PromptLookupProposer(config.max_ngram, config.min_ngram),
               options=(NGRAM,), export=Export(_lookup_export)),
    MethodSpec("suffix", "the most frequent continuation of the longest matching suffix",
               SuffixProposer, lambda config, target, draft: suffix_proposer(config, target),
               options=(SUFFIX_CACHE,), export=Export(_suffix_export)),
    MethodSpec("hybrid", "suffix matching or the draft model, whichever promises more tokens/s",
               HybridProposer, _hybrid, options=(DRAFT, DRAFT_P_MIN, SUFFIX_CACHE), needs_draft_model=True,
               prepare=_measure_draft_prefill, export=Export(_hybrid_export)),
)

SELF = MethodSpec(
    "self", "suffix matching or the layer-skip draft, whichever promises more tokens/s (no second model)",
    HybridProposer, _self_hybrid, options=(SKIP, DRAFT_P_MIN, SUFFIX_CACHE),
    options_help="self:layers=3+5-8:attn=3+5:mlp=7 or self:profile=FILE (its layer-skip draft's, as "
                 "layer-skip's)", prepare=prepare_profile,
    cannot_run=profile_problem, native_only=True, export=NO_EQUIVALENT)

"""Self-speculative methods (docs/methods/self-spec.md): the target drafts for itself, on its
own KV cache, with some layers skipped (layer-skip), its first layers only (early-exit) or
its own weights at a lower precision (self-draft).
"""

from __future__ import annotations

import warnings
from pathlib import Path

from ..layer_skip import SkipProfile, check_skips, default_profile, default_profile_path
from ..models.loading import LoadedModel, load
from ..models.quant import q4k_kernel
from ..proposers import DraftModelProposer
from .draft import DRAFT_P_MIN
from .spec import PRECISION, Export, Key, MethodSpec, Option, is_int, native_lm, one_of, path_value, positive

SELF_DRAFT_DTYPES = ("int8", "int4")
NO_EQUIVALENT = Export(refusal="vLLM and SGLang have no equivalent of {name} (the target drafting with "
                               "its own layers or weights): nothing reproduces it there")


def layer_list(value: str, key: str = "layers") -> tuple[int, ...]:
    """"3+5-8+12" (or with commas) -> (3, 5, 6, 7, 8, 12). Raises ValueError naming the
    option ``key`` and the syntax."""
    out = []
    try:
        if any(c.isspace() for c in value):  # "3 +5": int() took each part, spaces and all
            raise ValueError
        for part in value.replace(",", "+").split("+"):  # an empty part ("+3", "1,,2") is refused
            lo, dash, hi = part.partition("-")
            lo, hi = int(lo), int(hi if dash else lo)
            if hi < lo:
                raise ValueError
            out += range(lo, hi + 1)
    except ValueError:
        out = []
    if not out:
        raise ValueError(f"{key}={value!r} is invalid; allowed: layer indices joined by '+', "
                         f"ranges as A-B with A <= B, e.g. {key}=3+5-8+12") from None
    return tuple(out)


def skips_given(config) -> bool:
    """Whether skipped layers or sublayers are given (skip_layers, skip_attn, skip_mlp)."""
    return any(v is not None for v in (config.skip_layers, config.skip_attn, config.skip_mlp))


def _check_skip(config) -> dict:
    out = {}
    for name in ("skip_layers", "skip_attn", "skip_mlp"):
        value = getattr(config, name)
        if value is None:
            continue
        try:
            ok = not isinstance(value, (str, bytes)) and all(is_int(i) and i >= 0 for i in value)
        except TypeError:  # not iterable
            ok = False
        if not ok:
            raise ValueError(f"{name} = {value!r} is invalid; allowed: layer indices (integers >= 0)")
        out[name] = tuple(value)
    if out and config.skip_profile is not None:
        raise ValueError("give the skipped layers or a profile, not both: layers= or profile= in "
                         "a method string, skip_layers or skip_profile in the API (attn=, mlp=, "
                         "skip_attn and skip_mlp name skipped sublayers, as layers= does layers)")
    if config.skip_profile is not None and not isinstance(config.skip_profile, (str, Path, SkipProfile)):
        raise ValueError(f"skip_profile = {config.skip_profile!r} is invalid; allowed: a file path "
                         "(or a SkipProfile read from one)")
    return out


def _read_profile(config) -> dict:
    p = config.skip_profile
    return {} if p is None or isinstance(p, SkipProfile) else {"skip_profile": SkipProfile.load(p)}


SKIP = Option(
    "skip", "skipped layers (skip_layers=, skip_attn=, skip_mlp=, skip_profile=; layers=, attn=, mlp=, "
            "profile=) apply",
    (("skip_layers", "tuple[int, ...] | None", None), ("skip_profile", "str | Path | SkipProfile | None", None),
     ("skip_attn", "tuple[int, ...] | None", None), ("skip_mlp", "tuple[int, ...] | None", None)),
    "``skip_layers`` / ``skip_attn`` / ``skip_mlp`` / ``skip_profile``: the layers a layer-skip "
    "draft skips, the layers whose attention or MLP sublayer alone it skips (SWIFT, "
    "arXiv:2410.06916; combinable with skip_layers), or a ``tune-skip`` profile file (or the "
    "SkipProfile read from it); none: the target's cached default profile",
    {"layers": Key("3+5-8", lambda v: {"skip_layers": layer_list(v)}),
     "attn": Key("3+5", lambda v: {"skip_attn": layer_list(v, "attn")}),
     "mlp": Key("7", lambda v: {"skip_mlp": layer_list(v, "mlp")}),
     "profile": Key("FILE", lambda v: {"skip_profile": path_value(v)})},
    check=_check_skip, read=_read_profile)


def _check_exit(config) -> dict:
    e = config.exit_layer
    if e is not None and (not is_int(e) or e < 1):
        raise ValueError(f"exit_layer = {e!r} is invalid; allowed: an integer >= 1")
    return {}


EXIT_LAYER = Option(
    "exit_layer", "an exit layer (exit_layer=; layer=) applies", (("exit_layer", "int | None", None),),
    "``exit_layer``: early exit's E", {"layer": Key("E", lambda v: {"exit_layer": positive("layer", v)})},
    check=_check_exit)


def _check_dtype(config) -> dict:
    if config.self_draft_dtype not in (None, *SELF_DRAFT_DTYPES):
        raise ValueError(f"self_draft_dtype = {config.self_draft_dtype!r} is invalid; allowed: "
                         f"{', '.join(SELF_DRAFT_DTYPES)}")
    return {}


SELF_DRAFT_DTYPE = Option(
    "self_draft_dtype", "a self-draft precision (self_draft_dtype=; dtype=) applies",
    (("self_draft_dtype", "str | None", None),), "``self_draft_dtype``: int8 or int4; None: int4",
    {"dtype": Key("int8|int4", lambda v: {"self_draft_dtype": one_of("dtype", v, SELF_DRAFT_DTYPES)})},
    check=_check_dtype)


def _profile_name(profile: "str | Path | SkipProfile") -> str:
    return (profile.source or "(given)") if isinstance(profile, SkipProfile) else str(profile)


def _given_profile(config, n_layers: int) -> SkipProfile:
    """``config.skip_profile``, read from its file unless already read, checked against the
    target's ``n_layers``. Raises ValueError naming what is wrong."""
    p = config.skip_profile
    if isinstance(p, SkipProfile):
        p.check_layers(n_layers, _profile_name(p))
        return p
    return SkipProfile.load(p, n_layers)


def skip_choice(config, target: LoadedModel):
    """(skip_layers, skip_attn, skip_mlp, profile) of the layer-skip draft: those given, or
    those of the profile ``skip_profile``, or of the target's cached default profile (made
    on first use); profile None where the layers were given."""
    nl = native_lm(target, config.method.value).args.n_layers
    if skips_given(config):
        return (*check_skips(config.skip_layers, config.skip_attn, config.skip_mlp, nl), None)
    given = config.skip_profile
    profile = _given_profile(config, nl) if given is not None else default_profile(target)
    made_for, here = (profile.target, profile.weight_format), (target.name, target.lm.weight_format)
    if given is not None and profile.target and made_for != here:
        # the same layer count, another model or weight format: its choice of layers and its
        # K may not suit (the output is the same either way), so say so rather than refuse
        warnings.warn(f"layer-skip profile {_profile_name(given)} was tuned for {' '.join(made_for)}; "
                      f"this target is {' '.join(here)}: its layers and K may not suit it; make "
                      "one for it with `specdecode tune-skip --target NAME --out FILE`", stacklevel=3)
    return profile.skip, profile.skip_attn, profile.skip_mlp, profile


def layer_skip_draft(config, target: LoadedModel):
    """(draft, K): the layer-skip draft (a SelfDraft), all layers but the skipped ones of
    :func:`skip_choice`, with those attention and MLP sublayers skipped (SWIFT,
    arXiv:2410.06916), its ``cost`` the profile's measured one; and the K the profile
    predicts best (without a profile, layer-skip's default)."""
    lm = target.lm
    skip, attn, mlp, profile = skip_choice(config, target)
    draft = lm.self_draft([i for i in range(lm.args.n_layers) if i not in skip], skip_attn=attn, skip_mlp=mlp)
    if profile is not None:
        draft.cost = profile.draft_cost
    return draft, (profile.k if profile is not None else LAYER_SKIP.default_k)


def _exit_draft(config, target: LoadedModel):
    """The early-exit draft: the first ``exit_layer`` layers and the LM head (LayerSkip,
    arXiv:2404.16710). Its verify pass runs all layers over the round's K+1 tokens and
    overwrites the first E layers' entries the draft wrote, as for every self-draft, rather
    than starting at layer E from the draft's states (LayerSkip's cache reuse): a CPU verify
    pass reads each layer's weights once whatever its rows, so reuse would save at most
    (E/L)·(T(K+1) − T(1)) a round (about 0.15 T(1) at E = L/2 with the default target's
    T(5) = 1.3 T(1)), for a second verify path. Raises ValueError without E or for E
    outside 1..L-1."""
    lm = native_lm(target, "early-exit")
    nl = lm.args.n_layers
    if config.exit_layer is None:
        raise ValueError("method 'early-exit' needs its exit layer E: early-exit:layer=E "
                         f"(exit_layer=E), 1 <= E < {nl}")
    if not 1 <= config.exit_layer < nl:
        raise ValueError(f"exit layer {config.exit_layer} is out of range: allowed 1..{nl - 1} "
                         f"(this target has {nl} layers)")
    return lm.self_draft(list(range(config.exit_layer)))


def self_draft_problem(lm, dtype: str) -> str | None:
    """Why a self-draft in ``dtype`` cannot draft for the native model ``lm`` (None when it
    can): it must be of a lower precision than the target's weights, and int4 runs on the
    AVX512-VNNI and AVX2 kernels only."""
    own = PRECISION.get(lm.weight_format.split("-")[0])
    if own is None or PRECISION[dtype] >= own:
        lower = [d for d in SELF_DRAFT_DTYPES if own is not None and PRECISION[d] < own
                 and (d != "int4" or q4k_kernel()[0] is not None)]  # int4 runs on those kernels only
        return (f"a self-draft in {dtype} is not below this target's {lm.weight_format} "
                "weights, so it would cost as much as the target: "
                + (f"use dtype={' or '.join(lower)}" if lower else
                   "load the target in float32 or int8 for a self-draft" if own is None
                   or own <= PRECISION["int4"] or q4k_kernel()[0] is not None else
                   "no lower precision runs on this CPU (int4 needs the AVX512-VNNI or "
                   "the AVX2 kernel): use layer-skip or self (no second model) instead"))
    if dtype == "int4" and q4k_kernel()[0] is None:  # said here: load() would say "use int8"
        return (f"a self-draft in int4 needs the AVX512-VNNI or the AVX2 kernel, neither of "
                f"which is in use here ({q4k_kernel()[1]}): " + (
                    "use self-draft:dtype=int8" if own > PRECISION["int8"] else
                    f"int8 is no lower than this target's {lm.weight_format}, so on this "
                    "CPU use layer-skip or self (no second model) instead"))
    return None


def _lower_precision_draft(config, target: LoadedModel):
    """The self-draft of the target's weights at ``self_draft_dtype`` (default int4), loaded
    once from its files and kept on the loaded target (``LoadedModel.self_drafts``)."""
    lm = native_lm(target, "self-draft")
    dtype = config.self_draft_dtype or "int4"
    why = self_draft_problem(lm, dtype)
    if why is not None:
        raise ValueError(why)
    if dtype not in target.self_drafts:
        if target.path is None:
            raise ValueError("a self-draft loads the target's files again: this target has no path")
        target.self_drafts[dtype] = load(target.path, dtype=dtype, role="draft", tokenizer=False,
                                         backend="native").lm
    return lm.self_draft(None, target.self_drafts[dtype])


def on_own_cache(config, draft) -> DraftModelProposer:
    """A self-draft's proposer: lazy, for the target's own prefill fills the cache it reads."""
    return DraftModelProposer(draft, p_min=config.draft_p_min, lazy_prefill=True)


def prepare_profile(config, target: LoadedModel, draft=None) -> None:
    """Measure the target's default layer-skip profile now where no layers or profile are
    given (:func:`~specdecode.layer_skip.default_profile`): a batch holding the target
    cannot measure it later."""
    if not skips_given(config) and config.skip_profile is None:
        default_profile(target)


def profile_problem(config, target: LoadedModel) -> str | None:
    """Why a layer-skip draft cannot be built on the native ``target`` without measuring: a
    bad given profile, or no default profile made yet (None: it can)."""
    lm = target.lm
    if skips_given(config):
        return None
    try:
        if config.skip_profile is not None:
            _given_profile(config, lm.args.n_layers)
        else:
            SkipProfile.load(default_profile_path(target), lm.args.n_layers)
    except ValueError as e:
        if config.skip_profile is not None:
            return str(e)
        return (f"the target has no layer-skip profile yet: run `specdecode tune-skip --target "
                f"{target.name}` once (or start the server with --method {config.method.value}), then restart")
    return None


def _exit_problem(config, target: LoadedModel) -> str | None:
    return (None if config.exit_layer is not None else
            "it needs its exit layer E (early-exit:layer=E), which a method name cannot give")


def _dtype_problem(config, target: LoadedModel) -> str | None:
    return self_draft_problem(target.lm, config.self_draft_dtype or "int4")


def _profile_k(config, target: LoadedModel, draft) -> tuple[int, int]:
    # without a given K, the K the profile predicts best (the profile only: no draft built)
    if config.k_given:
        return config.num_speculative_tokens, 0
    profile = skip_choice(config, target)[3]
    return (profile.k if profile is not None else LAYER_SKIP.default_k), 0


LAYER_SKIP = MethodSpec(
    "layer-skip", "the target with some of its layers skipped drafts on its own KV cache", DraftModelProposer,
    lambda config, target, draft: on_own_cache(config, layer_skip_draft(config, target)[0]),
    options=(SKIP, DRAFT_P_MIN), k=1, start_k=_profile_k,
    options_help="layer-skip:layers=3+5-8 (the layers skipped; attn=3+5:mlp=7 skips only those layers' "
                 "attention or MLP sublayers) or layer-skip:profile=FILE (from `specdecode tune-skip`; "
                 "neither: the target's default profile, made once and cached)", prepare=prepare_profile,
    cannot_run=profile_problem, native_only=True, export=NO_EQUIVALENT)

METHODS = (
    LAYER_SKIP,
    MethodSpec("early-exit", "the target's first E layers and its LM head draft (early-exit checkpoints)",
               DraftModelProposer, lambda config, target, draft: on_own_cache(config, _exit_draft(config, target)),
               options=(EXIT_LAYER, DRAFT_P_MIN), options_help="early-exit:layer=E", k=3, cannot_run=_exit_problem, native_only=True,
               export=NO_EQUIVALENT),
    MethodSpec("self-draft", "the target's own weights at a lower precision draft on its KV cache",
               DraftModelProposer,
               lambda config, target, draft: on_own_cache(config, _lower_precision_draft(config, target)),
               options=(SELF_DRAFT_DTYPE, DRAFT_P_MIN), options_help="self-draft:dtype=int8|int4", k=4, export=NO_EQUIVALENT, cannot_run=_dtype_problem, native_only=True,
               cpu_only="its quantized copy uses the CPU kernels"),
)

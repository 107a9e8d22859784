"""The method registry: every speculative decoding method, declared once.

A method is one :class:`MethodSpec` entry in :data:`METHODS`: its name, who proposes, how its
proposer is built, its default speculation length K (its proposer class's ``default_k``) and
which options it honours. The :class:`Method` enum, the CLI's ``--method`` choices and help,
the API's ``method=``, the bench's method list and options, and the validation of
:class:`SpeculativeConfig` are all read from it.
"""

from __future__ import annotations

import difflib
import json
import os
import warnings
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Callable

import torch

from .config import MAX_K, KSchedule, check_k
from .heads import DEFAULT_HEAD_TIME, HEAD_ARCHS, Eagle3Head, MedusaHeads, aux_layers, default_head_dir
from .layer_skip import SkipProfile, check_skips, default_profile, default_profile_path
from .models.base import lm_device, module_device
from .models.loading import LoadedModel, check_compatible, load
from .models.native import SUPPORTED_MODEL_TYPES, auto_draft_vocab
from .models.quant import best_layout, q4k_kernel
from .profile import prefill_profile, verify_profile
from .proposers import (CrossTokenizerProposer, DraftModelProposer, HybridProposer,
                        Eagle3Proposer, MedusaProposer, PromptLookupProposer, Proposer, SuffixProposer)
from .proposers.hybrid import HybridTuning
from .schedule import AutoK, FixedK, HeuristicK, Schedule
from .tree import MAX_NODES, MAX_TREE_WIDTH
from .verify import LossyTypical

# option -> how messages name it; each method names the ones it honours (MethodSpec.options):
# draft (a draft model), draft_p_min (its p_min), ngram (prompt lookup's n-gram sizes),
# suffix_cache, skip (a layer-skip draft's layers), exit_layer, self_draft_dtype, tree (a
# draft tree's width), head (a Medusa or EAGLE-3 head's directory)
OPTIONS = {
    "draft": "a draft model (draft=, assistant_model=, --draft and its --draft-* options) applies",
    "draft_p_min": "draft_p_min applies",
    "ngram": "n-gram sizes (min_ngram, max_ngram) apply",
    "suffix_cache": "suffix_cache applies",
    "skip": "skipped layers (skip_layers=, skip_attn=, skip_mlp=, skip_profile=; layers=, attn=, mlp=, "
            "profile=) apply",
    "exit_layer": "an exit layer (exit_layer=; layer=) applies",
    "self_draft_dtype": "a self-draft precision (self_draft_dtype=; dtype=) applies",
    "tree": "a draft tree width (draft_tree_width=; tree=) applies",
    "tree_nodes": "a dynamic draft tree's size (tree_nodes=; nodes=) applies",
    "medusa_choices": "a Medusa tree's node list (medusa_choices=; choices=) applies",
    "head": "a draft head's directory (head_dir=; head=) applies",
    "lossy_typical": "Medusa's typical acceptance, which changes the output (lossy_typical=; lossy-typical=), applies",
}


@dataclass(frozen=True)
class MethodSpec:
    """One method.

    name: its name everywhere (``--method``, ``method=``, the bench, stats).
    summary: who proposes, one line (CLI and bench help).
    proposer: its proposer class (None: plain decoding); its ``default_k`` is the method's
        default K unless ``k`` gives another.
    build: (config, target, draft or None) -> the request's proposer (None for plain decoding).
    needs_draft_model: a draft model must be given (and is checked against the target).
    options: the :data:`OPTIONS` it honours; giving another is an error.
    schedule: its K schedule where no K and no schedule is given: fixed K, or for the draft
        heads auto (a head trained on a CPU's budget is weak, and their papers' fixed K of
        3-4 then verifies rows it rarely gets right, slower than plain decoding:
        BENCHMARKS.md section 11).
    """

    name: str
    summary: str
    proposer: type[Proposer] | None
    build: Callable[["SpeculativeConfig", LoadedModel, "LoadedModel | None"], "Proposer | None"]
    needs_draft_model: bool = False
    options: frozenset[str] = frozenset()
    k: int | None = None  # its default K where it is not its proposer class's
    schedule: KSchedule = KSchedule.FIXED

    @property
    def default_k(self) -> int | None:
        if self.proposer is None:
            return None
        return self.k or self.proposer.default_k


def _own_draft(target: LoadedModel, draft: LoadedModel):
    """The draft's model, with its own KV cache when it is the target itself (a fork
    sharing the weights)."""
    return draft.lm.fork() if draft.lm is target.lm else draft.lm


def draft_proposer(target: LoadedModel, draft: LoadedModel, p_min: float | None = None,
                   hybrid: bool = False, tree_width: int = 1) -> Proposer:
    """The draft model's proposer for this pair: token ids straight through when the two
    share a tokenizer, through text when they do not (:func:`check_compatible`'s mode).
    ``hybrid``: as the hybrid's member (:meth:`HybridProposer.draft_for`'s settings).
    ``tree_width`` > 1: draft trees (:class:`DraftModelProposer`), same tokenizer only (else
    ValueError)."""
    lm = _own_draft(target, draft)
    if check_compatible(target, draft) == "same":
        return HybridProposer.draft_for(lm, p_min) if hybrid else \
            DraftModelProposer(lm, p_min=p_min, tree_width=tree_width)
    if tree_width > 1:
        raise ValueError("draft trees need a draft of the target's tokenizer; this pair's "
                         "tokenizers differ (see `specdecode check-pair`): use tree=1")
    if p_min is None:
        p_min = HybridTuning.draft_p_min if hybrid else CrossTokenizerProposer.default_p_min
    return CrossTokenizerProposer(lm, target.tokenizer, draft.tokenizer, draft.eos_token_ids,
                                  p_min=p_min, lazy_prefill=hybrid)


def _medusa(spec: "SpeculativeConfig", target: LoadedModel) -> MedusaProposer:
    """The Medusa heads of ``spec.head_dir`` (default: the target's default heads) for this target,
    as a chain, with ``tree=W`` a tree (:meth:`MedusaProposer.siblings_tree`), or the static
    tree of ``spec.medusa_choices`` (``choices=FILE``). Raises ValueError for a tree the
    heads cannot draft (:class:`MedusaProposer`)."""
    heads = _loaded_head(spec, target, "medusa")
    w, nodes = spec.draft_tree_width, spec.medusa_choices
    if nodes is None and w > 1:
        nodes = MedusaProposer.siblings_tree(heads.num_heads, w)
    return MedusaProposer(heads, nodes, lossy_typical=spec.lossy_typical)


def _eagle3(spec: "SpeculativeConfig", target: LoadedModel) -> Eagle3Proposer:
    """The EAGLE-3 head of ``spec.head_dir`` (default: the target's default head) for this
    target, on the target's embedding; with ``tree=W`` the chain and its siblings as a tree,
    with ``nodes=N`` EAGLE-2's dynamic tree of N nodes (expanding ``tree`` nodes a depth, at
    least 2; ``nodes=auto``: :func:`tree_size` from the target's measured forward times)."""
    head = _loaded_head(spec, target, "eagle3")
    nodes = spec.tree_nodes
    if nodes == "auto":
        nodes = tree_size(verify_profile(target, MAX_K), spec.num_speculative_tokens)
    return Eagle3Proposer(head, aux_layers(target.lm.args.n_layers), spec.draft_tree_width, nodes)


def tree_size(times: list[float], k: int) -> int:
    """The most draft-tree nodes whose verify pass costs no more than a chain of K's (within
    5 %), from the target's measured forward times T(1..n) (``times[i]`` = T(i+1), seconds):
    on a CPU a pass of a few more rows is nearly free up to a kernel's block of rows, then
    costs more (BENCHMARKS.md section 11). At least K."""
    limit = times[min(k, len(times) - 1)] * 1.05
    return max([k] + [i for i in range(1, min(len(times), MAX_NODES + 1)) if times[i] <= limit])


def _loaded_head(spec: "SpeculativeConfig", target: LoadedModel, kind: str):
    """The ``kind`` head ``spec`` names, loaded once per loaded target and kept on it
    (``LoadedModel.heads``; a head rewritten on disk is read again): checked against the
    target, on its device, with int8 linears where the target is quantized on a CPU."""
    path = Path(head_dir_for(spec, target.name))
    lm = _native(target, kind)
    try:
        stamp = (path / "model.safetensors").stat().st_mtime_ns
    except OSError:
        stamp = None  # the loader says what is missing
    key = (kind, str(path.resolve()), stamp)
    if key in target.heads:
        return target.heads[key]
    device = module_device(lm)
    # the target's own tables (output layer, embedding), not copies: read in place, in its
    # dtype; Medusa's output layer over the first ids only, as a self-draft's (FR-Spec)
    if kind == "medusa":
        vocab = auto_draft_vocab(lm.args.vocab_size)
        head = MedusaHeads.load(path, lm.lm_head if vocab is None else lm.draft_head(vocab))
        if (head.dim, head.vocab_size) != (lm.args.dim, lm.vocab_size):
            raise ValueError(f"the Medusa heads in {path} are for hidden size {head.dim} and "
                             f"{head.vocab_size} tokens; this target has {lm.args.dim} and "
                             f"{lm.vocab_size}: give heads made for this target")
    else:
        if not aux_layers(lm.args.n_layers):
            raise ValueError(f"EAGLE-3 fuses three target layers; this target has {lm.args.n_layers} "
                             "(at least 7 needed)")
        head = Eagle3Head.load(path, lm.args, lm.model.embed_tokens)
    head.to(device)
    if _PRECISION.get(lm.weight_format.split("-")[0], 0) <= _PRECISION["int8"] and device.type == "cpu":
        head.quantize_(best_layout("draft"))  # a quantized target's head drafts in int8 too
    target.heads[key] = head.eval()
    return head


def head_dir_for(spec: "SpeculativeConfig", target: str) -> str | None:
    """The head directory ``spec``'s method reads for the target named ``target`` (a
    registry name or directory): ``spec.head_dir``, or the target's default head; None for
    a method without a head. Callable before the target is loaded, so that a missing head is
    said at once. Raises ValueError, saying how to make or give one, when the default head
    does not exist."""
    kind = spec.method.value
    if kind not in HEAD_ARCHS:
        return None
    if spec.head_dir is not None:
        return spec.head_dir
    path = default_head_dir(target, kind)
    if not (path / "config.json").exists():
        raise ValueError(f"method {kind!r} has no head for {target} yet: `specdecode train {kind} "
                         f"--target {target}` trains its default one into {path} ({DEFAULT_HEAD_TIME} "
                         f"for the 1.5B default target on 2 cores; `specdecode bench` does it when a run "
                         f"asks for {kind}), or give {kind}:head=DIR (Python: head_dir=DIR)")
    return str(path)


def _suffix(spec: "SpeculativeConfig", target: LoadedModel) -> SuffixProposer:
    """A new suffix proposer, or with ``suffix_cache="session"`` the one that lives as long
    as the loaded target (its counts of earlier outputs and its learned confidence)."""
    if spec.suffix_cache != "session":
        return SuffixProposer()
    return target.session_proposers.setdefault("suffix", SuffixProposer(cache="session"))


def _hybrid(spec: "SpeculativeConfig", target: LoadedModel, draft: LoadedModel) -> HybridProposer:
    # relative costs from the two models' forward-time profiles (measured once, cached)
    times = verify_profile(target, spec.max_speculative_tokens)
    return HybridProposer(_suffix(spec, target), draft_proposer(target, draft, spec.draft_p_min, hybrid=True),
                          verify_cost=[t / times[0] for t in times],
                          draft_cost=verify_profile(draft, 0)[0] / times[0],
                          draft_prefill_cost=prefill_profile(draft) / times[0])


def _native(target: LoadedModel, method: str):
    lm = target.lm
    if not hasattr(lm, "self_draft"):
        raise ValueError(f"method {method!r} drafts with the target's own layers, which needs the "
                         f"native runtime (model types {', '.join(SUPPORTED_MODEL_TYPES)}, backend "
                         f"'native' or 'auto'); this target runs on {type(lm).__name__}: use a "
                         "draft model or a lookup method for it")
    return lm


def _profile_name(profile: "str | Path | SkipProfile") -> str:
    return (profile.source or "(given)") if isinstance(profile, SkipProfile) else str(profile)


def _given_profile(spec: "SpeculativeConfig", n_layers: int) -> SkipProfile:
    """``spec.skip_profile``, read from its file unless already read (:func:`read_files`),
    checked against the target's ``n_layers``. Raises ValueError naming what is wrong."""
    p = spec.skip_profile
    if isinstance(p, SkipProfile):
        p.check_layers(n_layers, _profile_name(p))
        return p
    return SkipProfile.load(p, n_layers)


def _skip_choice(spec: "SpeculativeConfig", target: LoadedModel):
    """(skip_layers, skip_attn, skip_mlp, profile) of the layer-skip draft: those given, or
    those of the profile ``skip_profile``, or of the target's cached default profile (made
    on first use); profile None where the layers were given."""
    nl = _native(target, spec.method.value).args.n_layers
    if spec.skips_given:
        return (*check_skips(spec.skip_layers, spec.skip_attn, spec.skip_mlp, nl), None)
    profile = _given_profile(spec, nl) if spec.skip_profile is not None else default_profile(target)
    made_for, here = (profile.target, profile.weight_format), (target.name, target.lm.weight_format)
    if spec.skip_profile is not None and profile.target and made_for != here:
        # the same layer count, another model or weight format: its choice of layers and its
        # K may not suit (the output is the same either way), so say so rather than refuse
        warnings.warn(f"layer-skip profile {_profile_name(spec.skip_profile)} was tuned for {' '.join(made_for)}; "
                      f"this target is {' '.join(here)}: its layers and K may not suit it; make "
                      "one for it with `specdecode tune-skip --target NAME --out FILE`", stacklevel=3)
    return profile.skip, profile.skip_attn, profile.skip_mlp, profile


def _skip_k(profile: SkipProfile | None) -> int:
    # the K the profile predicts best; without a profile, the method's default
    return profile.k if profile is not None else METHODS["layer-skip"].default_k


def _layer_skip_draft(spec: "SpeculativeConfig", target: LoadedModel):
    """(draft, K): the layer-skip draft (a SelfDraft), all layers but the skipped ones of
    :func:`_skip_choice`, with those attention and MLP sublayers skipped (SWIFT,
    arXiv:2410.06916), its ``cost`` the profile's measured one; and the K the profile
    predicts best (without a profile, the method's default)."""
    lm = target.lm
    skip, attn, mlp, profile = _skip_choice(spec, target)
    draft = lm.self_draft([i for i in range(lm.args.n_layers) if i not in skip], skip_attn=attn, skip_mlp=mlp)
    if profile is not None:
        draft.cost = profile.draft_cost
    return draft, _skip_k(profile)


def _exit_draft(spec: "SpeculativeConfig", target: LoadedModel):
    """The early-exit draft: the first ``exit_layer`` layers and the LM head (LayerSkip,
    arXiv:2404.16710). Its verify pass runs all layers over the round's K+1 tokens and
    overwrites the first E layers' entries the draft wrote, as for every self-draft, rather
    than starting at layer E from the draft's states (LayerSkip's cache reuse): a CPU verify
    pass reads each layer's weights once whatever its rows, so reuse would save at most
    (E/L)·(T(K+1) − T(1)) a round (about 0.15 T(1) at E = L/2 with the default target's
    T(5) = 1.3 T(1)), for a second verify path. Raises ValueError without E or for E
    outside 1..L-1."""
    lm = _native(target, "early-exit")
    nl = lm.args.n_layers
    if spec.exit_layer is None:
        raise ValueError("method 'early-exit' needs its exit layer E: early-exit:layer=E "
                         f"(exit_layer=E), 1 <= E < {nl}")
    if not 1 <= spec.exit_layer < nl:
        raise ValueError(f"exit layer {spec.exit_layer} is out of range: allowed 1..{nl - 1} "
                         f"(this target has {nl} layers)")
    return lm.self_draft(list(range(spec.exit_layer)))


# precision ranks of weight formats: a self-draft must be of a lower one than its target
_PRECISION = {"float32": 4, "bfloat16": 3, "float16": 3, "int8": 2, "q4": 1, "int4": 1}
SELF_DRAFT_DTYPES = ("int8", "int4")


def _self_draft_problem(lm, dtype: str) -> str | None:
    """Why a self-draft in ``dtype`` cannot draft for the native model ``lm`` (None when it
    can): it must be of a lower precision than the target's weights, and int4 runs on the
    AVX512-VNNI and AVX2 kernels only."""
    own = _PRECISION.get(lm.weight_format.split("-")[0])
    if own is None or _PRECISION[dtype] >= own:
        lower = [d for d in SELF_DRAFT_DTYPES if own is not None and _PRECISION[d] < own
                 and (d != "int4" or q4k_kernel()[0] is not None)]  # int4 runs on those kernels only
        return (f"a self-draft in {dtype} is not below this target's {lm.weight_format} "
                "weights, so it would cost as much as the target: "
                + (f"use dtype={' or '.join(lower)}" if lower else
                   "load the target in float32 or int8 for a self-draft" if own is None
                   or own <= _PRECISION["int4"] or q4k_kernel()[0] is not None else
                   "no lower precision runs on this CPU (int4 needs the AVX512-VNNI or "
                   "the AVX2 kernel): use layer-skip or self (no second model) instead"))
    if dtype == "int4" and q4k_kernel()[0] is None:  # said here: load() would say "use int8"
        return (f"a self-draft in int4 needs the AVX512-VNNI or the AVX2 kernel, neither of "
                f"which is in use here ({q4k_kernel()[1]}): " + (
                    "use self-draft:dtype=int8" if own > _PRECISION["int8"] else
                    f"int8 is no lower than this target's {lm.weight_format}, so on this "
                    "CPU use layer-skip or self (no second model) instead"))
    return None


def _lower_precision_draft(spec: "SpeculativeConfig", target: LoadedModel):
    """The self-draft of the target's weights at ``self_draft_dtype`` (default int4), loaded
    once from its files and kept on the loaded target (``LoadedModel.self_drafts``)."""
    lm = _native(target, "self-draft")
    dtype = spec.self_draft_dtype or "int4"
    why = _self_draft_problem(lm, dtype)
    if why is not None:
        raise ValueError(why)
    if dtype not in target.self_drafts:
        if target.path is None:
            raise ValueError("a self-draft loads the target's files again: this target has no path")
        target.self_drafts[dtype] = load(target.path, dtype=dtype, role="draft", tokenizer=False,
                                         backend="native").lm
    return lm.self_draft(None, target.self_drafts[dtype])


def _self_draft(spec: "SpeculativeConfig", draft) -> DraftModelProposer:
    # lazy: the target's own prefill fills the cache the draft reads
    return DraftModelProposer(draft, p_min=spec.draft_p_min, lazy_prefill=True)


# the self method's hybrid never routes a lookup's round through the layer-skip draft: that
# check pass costs the draft's share of a verify pass of the whole proposal (0.6 T(17) with
# the default target's profile), where a draft model's cost a quarter; and a lookup takes a
# round whenever it promises more than the draft (margin 1): with a margin of 1.3 the self
# method trailed suffix matching alone on QA and translation (BENCHMARKS.md section 8); nor
# does the draft read a lookup's proposal in its own rounds (a pass of up to 17 tokens)
SELF_TUNING = HybridTuning(check_below=0.0, lookup_margin=1.0, read_guess=False)


def _self_hybrid(spec: "SpeculativeConfig", target: LoadedModel, draft) -> HybridProposer:
    own, k = _layer_skip_draft(spec, target)
    times = verify_profile(target, spec.max_speculative_tokens)
    return HybridProposer(_suffix(spec, target), HybridProposer.draft_for(own, spec.draft_p_min),
                          verify_cost=[t / times[0] for t in times], draft_cost=own.cost,
                          draft_k=k, tuning=SELF_TUNING)


METHODS: dict[str, MethodSpec] = {m.name: m for m in (
    MethodSpec("ar", "nobody: plain autoregressive decoding (the baseline)", None,
               lambda spec, target, draft: None),
    MethodSpec("draft", "a smaller model drafts K tokens (of another tokenizer: through text)",
               DraftModelProposer,
               lambda spec, target, draft: draft_proposer(target, draft, spec.draft_p_min,
                                                          tree_width=spec.draft_tree_width),
               needs_draft_model=True, options=frozenset({"draft", "draft_p_min", "tree"})),
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
    MethodSpec("layer-skip", "the target with some of its layers skipped drafts on its own KV cache",
               DraftModelProposer,
               lambda spec, target, draft: _self_draft(spec, _layer_skip_draft(spec, target)[0]),
               options=frozenset({"skip", "draft_p_min"}), k=1),
    MethodSpec("early-exit", "the target's first E layers and its LM head draft (early-exit checkpoints)",
               DraftModelProposer,
               lambda spec, target, draft: _self_draft(spec, _exit_draft(spec, target)),
               options=frozenset({"exit_layer", "draft_p_min"}), k=3),
    MethodSpec("self-draft", "the target's own weights at a lower precision draft on its KV cache",
               DraftModelProposer,
               lambda spec, target, draft: _self_draft(spec, _lower_precision_draft(spec, target)),
               options=frozenset({"self_draft_dtype", "draft_p_min"}), k=4),
    MethodSpec("medusa", "Medusa heads on the target's own last hidden state (head=DIR: vLLM's "
               "Medusa format; default: the target's own, from specdecode train medusa)", MedusaProposer,
               lambda spec, target, draft: _medusa(spec, target),
               options=frozenset({"head", "tree", "medusa_choices", "lossy_typical"}), k=3,
               schedule=KSchedule.AUTO),
    MethodSpec("eagle3", "an EAGLE-3 head on three of the target's own hidden states (head=DIR: the "
               "LlamaForCausalLMEagle3 format vLLM and SGLang load; default: the target's own, from "
               "specdecode train eagle3)", Eagle3Proposer,
               lambda spec, target, draft: _eagle3(spec, target),
               options=frozenset({"head", "tree", "tree_nodes"}), k=4, schedule=KSchedule.AUTO),
    MethodSpec("self", "suffix matching or the layer-skip draft, whichever promises more tokens/s "
               "(no second model)", HybridProposer, _self_hybrid,
               options=frozenset({"skip", "draft_p_min", "suffix_cache"})),
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
            near = difflib.get_close_matches(str(value).lower(), [*METHODS], n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ValueError(f"method {value!r} is not one of {list(METHODS)}{hint}") from None


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
    schedules. With neither a K nor a schedule given, the schedule is the method's
    (``METHODS[name].schedule``: auto for the draft heads, else fixed). The other fields are
    :data:`OPTIONS`, each honoured by the methods that name it: ``draft_p_min`` (None = the
    method's default), ``max_ngram`` / ``min_ngram`` (``ngram``), ``suffix_cache``,
    ``skip_layers`` / ``skip_attn`` / ``skip_mlp`` / ``skip_profile`` (``skip``: the layers a
    layer-skip draft skips, the layers whose attention or MLP sublayer alone it skips (SWIFT,
    arXiv:2410.06916; combinable with skip_layers), or a ``tune-skip`` profile file (or the SkipProfile read from
    it: :func:`read_files`); none: the target's cached default profile), ``exit_layer`` (early exit's E), ``self_draft_dtype``
    (int8 or int4; None: int4), ``draft_tree_width`` (``tree``: w > 1 verifies the draft's chain with its
    next w - 1 candidates at each depth as a draft tree; 1: no tree), ``tree_nodes``
    (``nodes``: an EAGLE-3 head's dynamic tree of that many nodes, or "auto": as many as
    verify at the cost of the chain's pass; None: none), ``head_dir``
    (``head``: the directory of the ``medusa`` or ``eagle3`` method's head), ``medusa_choices``
    (``choices=FILE``, a JSON file: Medusa's static tree as node paths of candidate ranks,
    e.g. ((0,), (1,), (0, 0)), Medusa's ``medusa_choices``; not with tree=W), ``lossy_typical``
    (``lossy-typical=EPS[/DELTA]``, medusa only: a :class:`~specdecode.verify.LossyTypical`,
    or its EPS as a number; None, the default: lossless. Sampled requests are then verified
    by Medusa's typical acceptance, which CHANGES THE OUTPUT). Raises ValueError naming a bad
    value, or an option the method does not honour (never silently ignored).
    """

    method: Method = Method.DRAFT
    num_speculative_tokens: int | None = None
    schedule: KSchedule = KSchedule.FIXED
    max_speculative_tokens: int = 16
    draft_p_min: float | None = None
    max_ngram: int = 5
    min_ngram: int = 2
    suffix_cache: str = "request"
    skip_layers: tuple[int, ...] | None = None
    skip_profile: str | Path | SkipProfile | None = None
    skip_attn: tuple[int, ...] | None = None
    skip_mlp: tuple[int, ...] | None = None
    exit_layer: int | None = None
    self_draft_dtype: str | None = None
    draft_tree_width: int = 1
    tree_nodes: int | str | None = None
    head_dir: str | None = None
    lossy_typical: LossyTypical | float | None = None
    medusa_choices: tuple[tuple[int, ...], ...] | None = None
    # whether K was given (else the method's default, or a cross-tokenizer draft's: see
    # build_schedule)
    k_given: bool = field(default=False, init=False, repr=False, compare=False)

    @property
    def skips_given(self) -> bool:
        """Whether skipped layers or sublayers are given (skip_layers, skip_attn, skip_mlp)."""
        return any(v is not None for v in (self.skip_layers, self.skip_attn, self.skip_mlp))

    def __post_init__(self):
        object.__setattr__(self, "method", Method.parse(self.method))
        try:
            object.__setattr__(self, "schedule", KSchedule(self.schedule))
        except ValueError:
            raise ValueError(f"speculation length schedule {self.schedule!r} is invalid; allowed: "
                             f"{[s.value for s in KSchedule]}") from None
        spec = self.method.spec
        if spec.proposer is None and (self.num_speculative_tokens is not None
                                      or self.schedule is not KSchedule.FIXED):
            k = self.num_speculative_tokens if self.num_speculative_tokens is not None else self.schedule.value
            raise ValueError(f"method {spec.name!r} proposes nothing: a speculation length K "
                             f"(num_speculative_tokens={k!r}) does not apply")
        object.__setattr__(self, "k_given", self.num_speculative_tokens is not None)
        if not self.k_given and self.schedule is KSchedule.FIXED:  # neither given: the method's
            object.__setattr__(self, "schedule", spec.schedule)
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
        for name in ("skip_layers", "skip_attn", "skip_mlp"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                ok = not isinstance(value, (str, bytes)) and all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
            except TypeError:  # not iterable
                ok = False
            if not ok:
                raise ValueError(f"{name} = {value!r} is invalid; allowed: layer indices (integers >= 0)")
            object.__setattr__(self, name, tuple(value))
        if self.skips_given and self.skip_profile is not None:
            raise ValueError("give the skipped layers or a profile, not both: layers= or profile= in "
                             "a method string, skip_layers or skip_profile in the API (attn=, mlp=, "
                             "skip_attn and skip_mlp name skipped sublayers, as layers= does layers)")
        if self.skip_profile is not None and not isinstance(self.skip_profile, (str, Path, SkipProfile)):
            raise ValueError(f"skip_profile = {self.skip_profile!r} is invalid; allowed: a file path "
                             "(or a SkipProfile read from one)")
        e = self.exit_layer
        if e is not None and (isinstance(e, bool) or not isinstance(e, int) or e < 1):
            raise ValueError(f"exit_layer = {e!r} is invalid; allowed: an integer >= 1")
        w = self.draft_tree_width
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_TREE_WIDTH:
            raise ValueError(f"draft_tree_width = {w!r} is invalid; allowed: an integer in 1..{MAX_TREE_WIDTH} "
                             "(1: no tree)")
        n = self.tree_nodes
        if n is not None and n != "auto" and (isinstance(n, bool) or not isinstance(n, int)
                                               or not 1 <= n <= MAX_NODES):
            raise ValueError(f"tree_nodes = {n!r} is invalid; allowed: an integer in 1..{MAX_NODES}, "
                             "'auto', or None (no dynamic tree)")
        c = self.medusa_choices
        if c is not None:
            try:
                c = tuple(tuple(int(r) if isinstance(r, int) and not isinstance(r, bool) else None
                                for r in node) for node in c)
            except TypeError:
                c = ((None,),)
            if not c or any(not node or None in node or min(node) < 0 for node in c):
                raise ValueError(f"medusa_choices = {self.medusa_choices!r} is invalid; allowed: a "
                                 "non-empty list of node paths, each a non-empty list of candidate ranks "
                                 "(integers >= 0), e.g. [[0], [1], [0, 0]] (Medusa's medusa_choices)")
            if w != 1:
                raise ValueError("give a Medusa tree's width (tree=W) or its node list (choices=FILE), not both")
            MedusaProposer.check_shape(list(c))  # (the heads' depth is checked when they load)
            object.__setattr__(self, "medusa_choices", c)
        t = self.lossy_typical
        if t is not None and not isinstance(t, LossyTypical):
            if isinstance(t, bool) or not isinstance(t, (int, float)):
                raise ValueError(f"lossy_typical = {t!r} is invalid; allowed: None (lossless), EPS (a "
                                 "number in (0, 1), e.g. 0.09) or a LossyTypical")
            object.__setattr__(self, "lossy_typical", LossyTypical(t))
        if self.self_draft_dtype not in (None, *SELF_DRAFT_DTYPES):
            raise ValueError(f"self_draft_dtype = {self.self_draft_dtype!r} is invalid; allowed: "
                             f"{', '.join(SELF_DRAFT_DTYPES)}")
        given = {"draft_p_min": p is not None,
                 "ngram": (self.min_ngram, self.max_ngram) != (SpeculativeConfig.min_ngram,
                                                               SpeculativeConfig.max_ngram),
                 "suffix_cache": self.suffix_cache != SpeculativeConfig.suffix_cache,
                 "skip": self.skips_given or self.skip_profile is not None,
                 "exit_layer": e is not None, "self_draft_dtype": self.self_draft_dtype is not None,
                 "tree": w != 1, "tree_nodes": n is not None, "head": self.head_dir is not None,
                 "lossy_typical": t is not None, "medusa_choices": c is not None}
        for option, is_given in given.items():
            if is_given and option not in spec.options:
                raise ValueError(_inapplicable(option, spec.name))
        if self.max_speculative_tokens != 16 and self.schedule is KSchedule.FIXED:
            raise ValueError("max_speculative_tokens caps K for the 'heuristic' and 'auto' schedules; "
                             f"with a fixed K give num_speculative_tokens instead (got "
                             f"{self.max_speculative_tokens})")


def _layer_list(value: str, key: str = "layers") -> tuple[int, ...]:
    """"3+5-8+12" (or with commas) -> (3, 5, 6, 7, 8, 12); errors name the option ``key``."""
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


def _positive(key: str, value: str, most: int | None = None, or_else: str = "") -> int:
    """A method option's integer 1..most (the option's own name in the error, and
    ``or_else``: the other values it allows)."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= (most or n):
        raise ValueError(f"{key}={value!r} is invalid; allowed: an integer "
                         + (f"1..{most}" if most else ">= 1") + or_else) from None
    return n


def _path(value: str) -> str:
    # a shell leaves "~" inside "medusa:head=~/heads" as it is
    return os.path.expanduser(value)


# the options a method name may carry ("layer-skip:layers=3+5-8"): key -> (its registry
# option, what its value is (for help texts), its SpeculativeConfig fields from the text)
METHOD_OPTIONS = {
    "layers": ("skip", "3+5-8", lambda v: {"skip_layers": _layer_list(v)}),
    "attn": ("skip", "3+5", lambda v: {"skip_attn": _layer_list(v, "attn")}),
    "mlp": ("skip", "7", lambda v: {"skip_mlp": _layer_list(v, "mlp")}),
    "profile": ("skip", "FILE", lambda v: {"skip_profile": _path(v)}),
    "layer": ("exit_layer", "E", lambda v: {"exit_layer": _positive("layer", v)}),
    "dtype": ("self_draft_dtype", "int8|int4", lambda v: {"self_draft_dtype": _one_of("dtype", v, SELF_DRAFT_DTYPES)}),
    "tree": ("tree", "W", lambda v: {"draft_tree_width": _positive("tree", v, MAX_TREE_WIDTH)}),
    "nodes": ("tree_nodes", "N|auto", lambda v: {"tree_nodes": v if v == "auto" else _positive("nodes", v, MAX_NODES, " or auto")}),
    "head": ("head", "DIR", lambda v: {"head_dir": _path(v)}),
    "choices": ("medusa_choices", "FILE", lambda v: {"medusa_choices": _medusa_choices_file(_path(v))}),
    "lossy-typical": ("lossy_typical", "EPS[/DELTA]", lambda v: {"lossy_typical": LossyTypical.parse(v)}),
}


# the options a bench row adds to a method name (``specdecode bench --methods draft:k=4``),
# and what gives each of them to generate and the API
BENCH_ROW_OPTIONS = {  # key -> (the command line's option, the Python API's argument)
    "k": ("--k", "num_speculative_tokens="), "max_k": ("--max-k", "max_speculative_tokens="),
    "p_min": ("--draft-p-min", "draft_p_min="), "ngram": ("--max-ngram", "max_matching_ngram_size="),
    "cache": (None, "suffix_cache="),  # generate runs one request: no session to keep
    "dtype": ("--draft-dtype", "load(draft, dtype=)"),
    "backend": ("--draft-backend", "load(draft, backend=)"), "model": ("--draft", "draft="),
    "rule": ("--acceptance-rule", "acceptance_rule="),
}


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is invalid; allowed: {', '.join(allowed)}")
    return value


def _medusa_choices_file(path: str) -> list:
    """A Medusa tree's node list from a JSON file (Medusa's ``medusa_choices``: a list of node
    paths of candidate ranks, e.g. ``[[0], [1], [0, 0]]``). Raises ValueError naming the file
    when it cannot be read or is not JSON (the nodes are checked by SpeculativeConfig)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"choices={path}: cannot read a Medusa tree from it ({e}); give a JSON file "
                         "of node paths such as [[0], [1], [0, 0]]") from None


def method_options(method: str, opts: dict) -> dict:
    """The SpeculativeConfig fields of a method's own options (consumed from ``opts``, a
    dict of key=value texts: layers=, attn=, mlp=, profile= for layer-skip and self, layer= for
    early-exit, dtype= for self-draft, tree= for draft, medusa and eagle3, nodes= for eagle3, head= for
    medusa and eagle3, choices= and lossy-typical= for medusa); keys
    the method does not honour are left in ``opts``. Raises ValueError for a bad value."""
    honoured = METHODS[method].options
    out = {}
    for key, (option, _, parse) in METHOD_OPTIONS.items():
        if option in honoured and key in opts:
            out.update(parse(opts.pop(key)))
    return out


def name_and_options(text: str) -> tuple[str, dict[str, str]]:
    """"draft:k=4:tree=2" -> ("draft", {"k": "4", "tree": "2"}): the one syntax of a method
    name with options (generate, the API, bench rows). Raises ValueError naming a part that
    is not key=value, an empty value or a key given twice."""
    name, *parts = text.split(":")
    opts = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"method option {part!r} in {text!r} must look like key=value")
        if not value:
            example = METHOD_OPTIONS[key][1] if key in METHOD_OPTIONS else "VALUE"
            raise ValueError(f"method option {key}= in {text!r} has no value; e.g. {key}={example}")
        if key in opts:
            raise ValueError(f"method option {key}= is given twice in {text!r}; give it once")
        opts[key] = value
    return name, opts


def _bench_row_hint(name: str, keys: list[str]) -> str:
    """Where the bench-row options ``keys`` given to method ``name`` go instead (generate,
    bench and the Python API take them as options of their own)."""
    return "".join(f" ({k}= is a bench row's option: give "
                   + (f"{cli} on the command line, " if (cli := BENCH_ROW_OPTIONS[k][0]) else "")
                   + f"{BENCH_ROW_OPTIONS[k][1]} in the Python API)" for k in keys)


def split_method(text: str, row_hint: Callable[[str, list[str]], str] = _bench_row_hint) -> tuple[str, dict]:
    """"layer-skip:layers=3+5-8" -> ("layer-skip", {"skip_layers": (3, 5, 6, 7, 8)}): a method
    name with its own options (:data:`METHOD_OPTIONS`). Raises ValueError naming an unknown
    method, or an option it does not take; for a bench row's option (:data:`BENCH_ROW_OPTIONS`)
    the message ends with ``row_hint(name, keys)``: where the caller takes it instead."""
    name, opts = name_and_options(text)
    Method.parse(name)
    fields = method_options(name, opts)
    if opts:
        mine = [k for k, (o, _, _) in METHOD_OPTIONS.items() if o in METHODS[name].options]
        rows = [k for k in sorted(opts) if k in BENCH_ROW_OPTIONS]
        raise ValueError(f"method {name!r} takes no option {sorted(opts)} in {text!r}; "
                         f"allowed: {', '.join(mine) or 'none'}" + (row_hint(name, rows) if rows else ""))
    return name, fields


def read_files(spec: SpeculativeConfig) -> SpeculativeConfig:
    """``spec`` with its file-valued options read now, once (the Medusa tree of ``choices=``
    is read when the text is parsed; this reads a layer-skip ``profile=``): a server keeps
    what it was started with, whatever happens to the files later. Raises ValueError naming
    a file that cannot be read or is not a profile (its layers are checked against the
    target when the draft is built)."""
    if spec.skip_profile is None or isinstance(spec.skip_profile, SkipProfile):
        return spec
    return replace(spec, skip_profile=SkipProfile.load(spec.skip_profile))


def speculative_config(method: "str | Method | SpeculativeConfig | None", has_draft: bool,
                       num_speculative_tokens: int | str | None = None,
                       max_speculative_tokens: int = 16, draft_p_min: float | None = None,
                       max_ngram: int | None = None, suffix_cache: str = "request") -> SpeculativeConfig:
    """The :class:`SpeculativeConfig` of the API's / CLI's arguments: method None means
    "draft" when a draft model is given (``has_draft``), else "ar"; a draft model given to a
    method without one is an error, like every option a method does not honour; a method may
    carry its own options (``"layer-skip:layers=3+5-8"``, :func:`split_method`), or be a
    SpeculativeConfig whose method and own options are kept (the other fields are this
    call's: a server's method, parsed once); K is an integer, "heuristic" or "auto";
    ``max_ngram`` alone sets the shortest n-gram to min(2, max_ngram). Raises ValueError
    naming a bad or inapplicable value."""
    own, base = {}, None
    if isinstance(method, SpeculativeConfig):
        base, method = method, method.method
    elif isinstance(method, str) and not isinstance(method, Method) and ":" in method:
        method, own = split_method(method)
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
    ngram = dict(max_ngram=SpeculativeConfig.max_ngram, min_ngram=SpeculativeConfig.min_ngram)
    if max_ngram is not None:
        if "ngram" not in method.spec.options:
            raise ValueError(f"{_inapplicable('ngram', method.value)} (got max_ngram={max_ngram!r})")
        if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) or not 1 <= max_ngram <= 32:
            raise ValueError(f"max_ngram={max_ngram!r} (max_matching_ngram_size, --max-ngram) is "
                             "invalid; allowed: an integer 1..32")
        ngram = dict(max_ngram=max_ngram, min_ngram=min(SpeculativeConfig.min_ngram, max_ngram))
    call = dict(num_speculative_tokens=k, schedule=schedule, max_speculative_tokens=max_speculative_tokens,
                draft_p_min=draft_p_min, suffix_cache=suffix_cache, **ngram)
    return replace(base, **call) if base is not None else SpeculativeConfig(method, **call, **own)


def prepare(spec: SpeculativeConfig, target: LoadedModel) -> None:
    """Measure now what ``spec``'s method measures once on ``target`` (the layer-skip
    profile of layer-skip and self without given layers, :func:`~specdecode.layer_skip.default_profile`):
    before a batched engine holds the target, which it then cannot measure; and load a draft
    head's method's head (kept on the target), so that a bad one is said at once. Raises
    ValueError for a head that is missing or not for this target."""
    if spec.method.value in ("layer-skip", "self") and not spec.skips_given \
            and spec.skip_profile is None:
        default_profile(target)
    if spec.method.value in HEAD_ARCHS:
        _loaded_head(spec, target, spec.method.value)


def cannot_run(spec: SpeculativeConfig, target: LoadedModel) -> str | None:
    """Why ``spec``'s method with its options cannot run on ``target`` as it stands (None
    when it can), without measuring or loading anything: for a server, whose requests name a
    method (with the options it was started with, else none), and whose batch holds the
    target so that nothing can be measured on it later (:func:`prepare`). Draft models and
    draft heads are checked elsewhere."""
    name = spec.method.value
    if name not in ("layer-skip", "self", "early-exit", "self-draft"):
        return None
    try:
        lm = _native(target, name)
    except ValueError as e:
        return str(e)
    if name == "early-exit":
        return (None if spec.exit_layer is not None else
                "it needs its exit layer E (early-exit:layer=E), which a method name cannot give")
    if name == "self-draft":
        return _self_draft_problem(lm, spec.self_draft_dtype or "int4")
    if spec.skips_given:
        return None
    try:
        if spec.skip_profile is not None:
            _given_profile(spec, lm.args.n_layers)
        else:
            SkipProfile.load(default_profile_path(target), lm.args.n_layers)
    except ValueError as e:
        if spec.skip_profile is not None:
            return str(e)
        return (f"the target has no layer-skip profile yet: run `specdecode tune-skip --target "
                f"{target.name}` once (or start the server with --method {name}), then restart")
    return None


def build_proposer(spec: SpeculativeConfig, target: LoadedModel,
                   draft: LoadedModel | None) -> Proposer | None:
    """The proposer of ``spec.method`` for one request on ``target`` (None for plain
    decoding). Raises ValueError when the method needs a draft model and none is given,
    IncompatibleDraftError when the draft's tokenizer differs and cannot be bridged
    (checked once per pair)."""
    entry = spec.method.spec
    device = lm_device(target.lm)
    if entry.proposer is not None and device.type != "cpu":
        if spec.method in (Method.EAGLE3, Method.MEDUSA, Method.SELF_DRAFT):
            raise ValueError(f"method {entry.name!r} runs on the CPU only (its draft heads or quantized "
                             f"copy use the CPU kernels); the target is on {device}: load it on the "
                             "CPU, or use a draft model, a lookup method or layer-skip")
    if entry.needs_draft_model:
        if draft is None:
            raise ValueError(f"method {entry.name!r} needs a draft model (draft= or assistant_model=)")
        check_compatible(target, draft)
    return entry.build(spec, target, draft if entry.needs_draft_model else None)


def build_schedule(spec: SpeculativeConfig, target: LoadedModel, draft: LoadedModel | None = None,
                   proposer: Proposer | None = None) -> Schedule | None:
    """The K schedule of ``spec`` (None for plain decoding): fixed K, transformers'
    heuristic (both from K where given, else the method's default; for a draft of another
    tokenizer than the target's, ``CrossTokenizerProposer.default_k``; for layer-skip with
    a profile, the K the profile predicts best), or auto, which profiles the target's
    forward times T(1..max_k+1) and, for methods with a draft model, the draft's T(1) once
    (:func:`specdecode.profile.verify_profile`); for the self-speculative methods, auto's
    first estimate of a draft step is the self-draft's ``cost`` (its share of the target's
    T(1)) from ``proposer``, the request's proposer, until the request's own round times
    replace it. Raises ValueError where building the layer-skip draft does (a bad profile)."""
    if spec.method.spec.proposer is None:
        return None
    k, lookahead = spec.num_speculative_tokens, 0
    if spec.method is Method.DRAFT and draft is not None and check_compatible(target, draft) == "cross":
        lookahead = CrossTokenizerProposer.lookahead
        if not spec.k_given:
            k = CrossTokenizerProposer.default_k  # the draft method's default K for this pair
    if spec.method is Method.LAYER_SKIP and not spec.k_given:
        k = _skip_k(_skip_choice(spec, target)[3])  # (the profile only: no draft built)
    if spec.schedule is KSchedule.HEURISTIC:
        return HeuristicK(k, spec.max_speculative_tokens)
    if spec.schedule is KSchedule.AUTO:
        times = verify_profile(target, spec.max_speculative_tokens)
        if spec.method.needs_draft_model and draft is not None:
            draft_s = verify_profile(draft, 0)[0]
        else:  # a lookup costs nothing; a self-draft its share of the target's pass
            costs = [m.cost for m in (proposer.models() if proposer is not None else ()) if hasattr(m, "cost")]
            draft_s = times[0] * costs[0] if costs else 0.0
        return AutoK(times, spec.max_speculative_tokens, draft_seconds_per_token=draft_s, lookahead=lookahead)
    return FixedK(k)

"""What a method is: a :class:`MethodSpec` with the :class:`Option` objects it honours and the
hooks the planner calls (docs/DESIGN.md, "The method registry").

A family module (``draft``, ``lookups``, ``self_spec``, ``heads``) declares its methods and
their options here once; the registry, :class:`~specdecode.methods.config.SpeculativeConfig`,
the ``name:key=value`` grammar, the CLI's help and the planner read everything from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import os
from typing import Any, Callable

from ..config import KSchedule
from ..models.base import SelfDrafting
from ..models.loading import LoadedModel
from ..models.native import SUPPORTED_MODEL_TYPES
from ..proposers import Proposer

# a SpeculativeConfig (methods/config.py), whose fields are built from these specs' options
SpeculativeConfig = Any


@dataclass(frozen=True)
class Key:
    """One ``key=value`` of a method string (``layer-skip:layers=3+5-8``).

    example: what its value looks like, for help texts and errors ("3+5-8", "FILE").
    parse: the value's text -> the SpeculativeConfig fields it sets; raises ValueError naming
        the key and what is allowed.
    """

    example: str
    parse: Callable[[str], dict[str, Any]]


@dataclass(frozen=True)
class Option:
    """A setting some methods honour and the others refuse (never silently ignored).

    name: how the registry names it (``MethodSpec.options``, the bench's option tables).
    applies: the refusal's words, "<what> applies" ("an exit layer (exit_layer=; layer=) applies").
    fields: its :class:`SpeculativeConfig` fields as (name, type, default); several options
        may share none.
    doc: what its fields mean, for SpeculativeConfig's docstring.
    keys: its ``key=value`` texts in a method string, in help order.
    check: (config) -> {field: normalised value}: validates its fields when a config is
        made; raises ValueError naming the bad value and what is allowed.
    given: (config) -> whether the option is set (default: a field differs from its default).
    read: (config) -> {field: value}: reads a file-valued field now, once
        (:func:`~specdecode.methods.plan.read_files`); None: nothing to read.
    """

    name: str
    applies: str
    fields: tuple[tuple[str, Any, Any], ...] = ()
    doc: str = ""
    keys: dict[str, Key] = field(default_factory=dict)
    check: Callable[[SpeculativeConfig], dict[str, Any]] | None = None
    given: Callable[[SpeculativeConfig], bool] | None = None
    read: Callable[[SpeculativeConfig], dict[str, Any]] | None = None

    def is_given(self, config: SpeculativeConfig) -> bool:
        if self.given is not None:
            return self.given(config)
        return any(getattr(config, name) != default for name, _, default in self.fields)


def _no_proposer(config, target, draft):
    return None


def _nothing(config, target, draft=None) -> None:
    return None


def _given_k(config, target, draft) -> tuple[int, int]:
    return config.num_speculative_tokens, 0


@dataclass(frozen=True)
class Export:
    """How a method is reproduced in another engine (:mod:`specdecode.export`).

    settings: (engine "vllm" | "sglang", K or None for the method's default, the exported
        draft's directory or None, max_ngram, min_ngram) -> (the engine's method name,
        vLLM's speculative config or None, SGLang's flags, notes); raises ValueError where the
        engine has no equivalent. None: nothing reproduces the method; ``refusal`` says why.
    refusal: with ``settings`` None, the error's words ({engine} is replaced).
    """

    settings: Callable[..., tuple[str | None, dict | None, list[str], list[str]]] | None = None
    refusal: str = ""


@dataclass(frozen=True)
class MethodSpec:
    """One method: who proposes, which options it honours and what it needs.

    name: its name everywhere (``--method``, ``method=``, the bench, stats).
    summary: who proposes, one line (CLI and bench help).
    proposer: its proposer class (None: plain decoding); its ``default_k`` is the method's
        default K unless ``k`` gives another.
    build: (config, target, draft or None) -> the request's proposer (None for plain decoding).
    options: the :class:`Option` objects it honours, in help order; any other is refused.
    options_help: its own ``key=value`` options as ``--method``'s help says them (every key
        it takes named).
    needs_draft_model: a draft model must be given (and is checked against the target).
    k: its default K where it is not its proposer class's.
    schedule: its K schedule where no K and no schedule is given.
    native_only: it drafts with the target's own layers or hidden states, which only the
        native runtime offers (:class:`~specdecode.models.base.SelfDrafting`).
    cpu_only: why it runs on the CPU only (None: on any device).
    start_k: (config, target, draft) -> (K where none was given, the draft's lookahead in
        tokens for the auto schedule); default: the config's K and none.
    prepare: (config, target, draft or None) -> None: measures or loads, once, what the
        method reads from the target (or the draft) before a batch holds them; raises
        ValueError for a bad head or profile.
    cannot_run: (config, target) -> why the method cannot run on this native target as it stands,
        without measuring or loading anything (None: it can).
    head_dir: (config, target name) -> the draft head's directory it reads (None: no head);
        raises ValueError saying how to make a missing default head.
    export: how other engines reproduce it.
    """

    name: str
    summary: str
    proposer: type[Proposer] | None
    build: Callable[[SpeculativeConfig, LoadedModel, LoadedModel | None], Proposer | None] = _no_proposer
    options: tuple[Option, ...] = ()
    options_help: str = ""
    needs_draft_model: bool = False
    k: int | None = None
    schedule: KSchedule = KSchedule.FIXED
    native_only: bool = False
    cpu_only: str | None = None
    start_k: Callable[[SpeculativeConfig, LoadedModel, LoadedModel | None], tuple[int, int]] = _given_k
    prepare: Callable[[SpeculativeConfig, LoadedModel, LoadedModel | None], None] = _nothing
    cannot_run: Callable[[SpeculativeConfig, LoadedModel], str | None] = _nothing
    head_dir: Callable[[SpeculativeConfig, str], str | None] = _nothing
    export: Export = Export(refusal="method {name} speculates nothing: there is nothing to export")

    @property
    def default_k(self) -> int | None:
        """Its default K (None: plain decoding, no K)."""
        if self.proposer is None:
            return None
        return self.k or self.proposer.default_k

    @property
    def speculates(self) -> bool:
        """Whether something proposes draft tokens (every method but plain decoding)."""
        return self.proposer is not None

    @property
    def option_names(self) -> frozenset[str]:
        return frozenset(o.name for o in self.options)

    def keys(self) -> dict[str, Key]:
        """The ``key=value`` texts its method string takes, in help order."""
        return {k: v for o in self.options for k, v in o.keys.items()}


def path_value(value: str) -> str:
    """A path option's value, with a leading ``~`` expanded (a shell leaves it inside
    ``medusa:head=~/heads``)."""
    return os.path.expanduser(value)


def positive(key: str, value: str, most: int | None = None, or_else: str = "") -> int:
    """A method option's integer 1..most. Raises ValueError naming the option ``key``, what is
    allowed and ``or_else`` (the other values it allows)."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= (most or n):
        raise ValueError(f"{key}={value!r} is invalid; allowed: an integer "
                         + (f"1..{most}" if most else ">= 1") + or_else) from None
    return n


def one_of(key: str, value: str, allowed: tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``; else ValueError naming ``key`` and those."""
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is invalid; allowed: {', '.join(allowed)}")
    return value


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# precision ranks of weight formats: a self-draft must be of a lower one than its target,
# and a draft head drafts in int8 for a target of int8 or lower
PRECISION = {"float32": 4, "bfloat16": 3, "float16": 3, "int8": 2, "q4": 1, "int4": 1}


def native_lm(target: LoadedModel, method: str):
    """The target's native model, for a method that drafts with the target's own layers.
    Raises ValueError naming the method and what to use instead when the target runs on
    another backend."""
    lm = target.lm
    if not isinstance(lm, SelfDrafting):
        raise ValueError(f"method {method!r} drafts with the target's own layers or hidden states, which needs the "
                         f"native runtime (model types {', '.join(SUPPORTED_MODEL_TYPES)}, backend "
                         f"'native' or 'auto'); this target runs on {type(lm).__name__}: use a "
                         "draft model or a lookup method for it")
    return lm

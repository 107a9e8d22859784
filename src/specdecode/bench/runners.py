"""The bench's methods: every entry of the method registry (:mod:`specdecode.methods`), run
through our engine, beside the peers: transformers' plain, assisted and prompt-lookup
generation, and llama.cpp's plain and prompt-lookup decoding of the target's GGUF file.
``--methods ar,draft:k=4:dtype=float32,...`` names them with options."""

from __future__ import annotations

import difflib
import json
import time
import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import ACCEPTANCE_RULES, KSchedule, SamplingParams
from ..engine import Engine
from ..grammar import Grammar, response_format_schema
from ..methods import (METHOD_OPTIONS, METHODS, PLAIN, SpeculativeConfig, build_proposer, build_schedule,
                       method_options, name_and_options, with_prediction)
from ..models import llamacpp
from ..models.loading import (BACKENDS, DTYPE_NAMES, LoadedModel, check_compatible, check_model_name,
                              default_eos_token_ids, float_model_path, load,
                              resolve_model_path)
from ..profile import verify_profile
from .workloads import Request


@dataclass
class Output:
    """One generation: its ids, wall time in seconds (prefill included), our engine's stats."""

    token_ids: list[int]
    seconds: float
    stats: dict | None = None


class BenchModels:
    """Loads each model once, on first use: ours (our target on ``backend``, drafts on theirs),
    transformers' and llama.cpp's."""

    def __init__(self, target: str, draft: str, dtype: str, backend: str = "auto",
                 device: torch.device | None = None):
        self.target_name, self.draft_name, self.dtype, self.backend = target, draft, dtype, backend
        self.device = device  # ours and transformers' models (None: the CPU); llama.cpp: the CPU
        self._cache: dict = {}

    def _get(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def target(self) -> LoadedModel:
        return self._get("target", lambda: load(self.target_name, dtype=self.dtype,
                                                backend=self.backend, device=self.device))

    def draft(self, dtype: str, backend: str = "auto", name: str | None = None) -> LoadedModel:
        """The draft ``name`` (default: the run's ``--draft``)."""
        name = name or self.draft_name

        def make():
            d = load(name, dtype=dtype, role="draft", backend=backend, device=self.device)
            check_compatible(self.target(), d)
            return d
        return self._get(("draft", name, dtype, backend), make)

    def eos_token_ids(self) -> tuple[int, ...]:
        """The target's EOS ids, for the peers: from our loaded target when it is loaded, else
        from its tokenizer and generation config alone (a peer's memory is then its own)."""
        if "target" in self._cache:
            return tuple(self._cache["target"].eos_token_ids)
        return self._get("eos", lambda: default_eos_token_ids(resolve_model_path(self.target_name)))

    def hf(self, which: str):
        from transformers import AutoModelForCausalLM

        path = float_model_path(self.target_name if which == "target" else self.draft_name)
        dtype = torch.bfloat16 if self.dtype == "bfloat16" else torch.float32
        return self._get(("hf", which), lambda: AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype).to(self.device or "cpu").eval())


    def llama(self, prompt_lookup: int = 0):
        """llama.cpp on the target's GGUF file, this process's thread count (see
        :func:`specdecode.models.llamacpp.load`)."""
        return self._get(("llama.cpp", prompt_lookup), lambda: llamacpp.load(
            self.target_name, torch.get_num_threads(), prompt_lookup))


# (prompt ids, max new tokens, the turn's Request) -> Output; the rows that take no prediction
# ignore it; only our rows take a response format (the CLI refuses peers on tasks with one)
Runner = Callable[[list[int], int, Request], Output]


def _int(opts: dict, key: str, default: int) -> int:
    value = opts.pop(key, default)
    try:
        return int(value)
    except ValueError:
        allowed = "an integer, 'heuristic' or 'auto'" if key == "k" else "an integer"
        raise ValueError(f"option {key}={value!r} is invalid; allowed: {allowed}") from None


def _float(value: str, key: str, allowed: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"option {key}={value!r} is invalid; allowed: {allowed}") from None


def _ngram(value: str) -> dict:
    lo, _, hi = value.partition("-")
    try:
        return {"min_ngram": int(lo), "max_ngram": int(hi or lo)}
    except ValueError:
        raise ValueError(f"option ngram={value!r} is invalid; allowed: MIN-MAX, e.g. ngram=1-3") from None


# bench option -> (the registry option it sets, its values for help, its SpeculativeConfig
# fields from the text)
OPTION_PARSERS: dict[str, tuple[str, str, Callable[[str], dict]]] = {
    "p_min": ("draft_p_min", "P", lambda v: {"draft_p_min": _float(v, "p_min", "a number in [0, 1)")}),
    "ngram": ("ngram", "MIN-MAX", _ngram),
    "cache": ("suffix_cache", "request|session", lambda v: {"suffix_cache": v}),
}


def speculative_config(name: str, opts: dict) -> SpeculativeConfig:
    """The SpeculativeConfig of method ``name`` with bench options (consumed from ``opts``):
    k=N|heuristic|auto and max_k=N (every speculative method), and the options the method's
    registry entry honours: p_min=P (draft_p_min), ngram=MIN-MAX, cache=request|session, and
    the method's own (:data:`specdecode.methods.METHOD_OPTIONS`: layers=, profile=, layer=,
    dtype= of self-draft).
    Raises ValueError naming a bad option."""
    k = opts.pop("k", None)
    schedule = KSchedule.FIXED
    if k in (KSchedule.HEURISTIC.value, KSchedule.AUTO.value):
        schedule, k = KSchedule(k), None
    elif k is not None:
        k = _int({"k": k}, "k", 0)
    kwargs = {}
    if "max_k" in opts:
        kwargs["max_speculative_tokens"] = _int(opts, "max_k", 16)
    for key, (_, _, parse) in OPTION_PARSERS.items():
        if key in opts:
            kwargs.update(parse(opts.pop(key)))
    kwargs.update(method_options(name, opts))
    return SpeculativeConfig(name, k, schedule, **kwargs)


def sampled_rule(opts: dict, temperature: float) -> str | None:
    """The acceptance rule of one of our methods in a sampled run (option ``rule=``,
    consumed; default gumbel, the rule of seeded requests), None in a greedy run. Raises
    ValueError for another value, or ``rule=`` in a greedy run (it would change nothing)."""
    rule = opts.pop("rule", None)
    if temperature == 0:
        if rule is not None:
            raise ValueError(f"option rule={rule} applies to sampled runs: add --temperature T")
        return None
    if rule not in (None, *ACCEPTANCE_RULES):
        raise ValueError(f"option rule={rule!r} is invalid; allowed: {', '.join(ACCEPTANCE_RULES)}")
    return rule or "gumbel"


def prompt_seed(prompt_ids: list[int]) -> int:
    """The sampling seed of one prompt in a sampled run: the same for every method (so that
    the gumbel rule's outputs can be compared with plain sampling's token for token)."""
    return zlib.crc32(bytes(str(prompt_ids), "ascii"))


# bench rows of our methods that must run a draft of another tokenizer:
# the method itself routes such a pair through text with no option; the row's name says so
CROSS_ROWS = {"draft-xtok": "draft", "hybrid-xtok": "hybrid"}


# the row options that make a method lossy (Medusa's typical acceptance): such a row changes
# the output by design, so it has no lossless check and the report marks it
LOSSY_KEYS = frozenset(key for key, (option, _, _) in METHOD_OPTIONS.items() if option == "lossy_typical")


def is_lossy(name: str, options: dict) -> bool:
    """Whether a row (``parse_methods``' name and options) runs a lossy rule."""
    return is_ours(name) and any(key in options for key in LOSSY_KEYS)


def _row_config(name: str, opts: dict, temperature: float
                ) -> tuple[str, SpeculativeConfig, str | None, dict, bool]:
    """One of our rows' options, consumed from ``opts`` without loading anything: (the
    registry method, its SpeculativeConfig, the sampled run's acceptance rule or None, the
    draft model's options ``dtype=``, ``backend=``, ``model=`` where it has one, whether the
    row reads the tasks' predicted outputs, ``prediction=on|off``). Raises ValueError naming
    a bad option, or ``lossy-typical=`` in a greedy run (it would change nothing there)."""
    predicted = opts.pop("prediction", "off")
    if predicted not in ("on", "off"):
        raise ValueError(f"option prediction={predicted!r} is invalid; allowed: on, off")
    rule = sampled_rule(opts, temperature)
    name = CROSS_ROWS.get(name, name)
    spec = speculative_config(name, opts) if METHODS[name].proposer is not None else SpeculativeConfig(name)
    if spec.lossy_typical is not None and temperature == 0:
        raise ValueError(f"option lossy-typical={spec.lossy_typical} applies to sampled runs (at temperature 0 "
                         "Medusa's typical acceptance is greedy verification, the row would be plain "
                         f"{name}): add --temperature T")
    draft_opts = {}
    if spec.method.needs_draft_model:
        draft_opts = {key: opts.pop(key) for key in ("dtype", "backend", "model") if key in opts}
        for key, allowed in (("dtype", DTYPE_NAMES), ("backend", BACKENDS)):
            if draft_opts.get(key, allowed[0]) not in allowed:
                raise ValueError(f"option {key}={draft_opts[key]!r} is invalid; allowed: {', '.join(allowed)}")
    return name, spec, rule, draft_opts, predicted == "on"


def row_options(name: str, temperature: float = 0.0) -> list[str]:
    """The option keys a bench row of method ``name`` (ours or a peer's) takes."""
    if not is_ours(name):
        return sorted(PEERS[name].options)
    method = METHODS[CROSS_ROWS.get(name, name)]
    keys = {"prediction"}
    if method.proposer is not None:
        keys |= {"k", "max_k"}
        keys |= {key for key, (option, _, _) in OPTION_PARSERS.items() if option in method.option_names}
        keys |= set(method.keys())
    if method.needs_draft_model:
        keys |= {"dtype", "backend", "model"}
    if name in CROSS_ROWS:
        keys.discard("tree")  # draft trees need the target's tokenizer
    if temperature > 0:
        keys.add("rule")
    return sorted(keys)


def _unknown(label: str, name: str, opts: dict, temperature: float) -> ValueError:
    allowed = row_options(name, temperature)
    return ValueError(f"method {label!r}: unknown option(s) {sorted(opts)}; {name} takes "
                      + (", ".join(f"{key}=" for key in allowed) if allowed else "no options"))


def check_rows(methods, temperature: float = 0.0) -> None:
    """Check every option of the rows (``parse_methods``' output) before a model is loaded:
    a bad ``k=``, ``rule=`` or ``model=``, or an option the row does not take, is said at
    once, not after the target's load. Raises ValueError naming the row and the option."""
    for label, name, options in methods:
        opts = dict(options)
        if is_ours(name):
            if name in CROSS_ROWS and "tree" in opts:
                raise ValueError(f"method {label!r}: draft trees need a draft of the target's "
                                 f"tokenizer; {name} runs one of another: drop tree=")
            try:
                draft_opts = _row_config(name, opts, temperature)[3]
                if "model" in draft_opts:
                    check_model_name(draft_opts["model"])
            except ValueError as e:
                raise ValueError(f"method {label!r}: {e}") from None
        else:
            opts = {key: value for key, value in opts.items() if key not in PEERS[name].options}
        if opts:
            raise _unknown(label, name, opts, temperature)


def ours(models: BenchModels, name: str, opts: dict, temperature: float = 0.0) -> Runner:
    """A runner of our engine for registry method ``name`` (options consumed from ``opts``;
    ``dtype=`` and ``backend=`` the draft's, default auto: see
    :func:`specdecode.models.loading.load`; ``model=`` another draft than the run's
    ``--draft`` (e.g. a distilled one, beside the original in the same run); ``rule=`` the acceptance rule when
    ``temperature`` > 0, see :func:`sampled_rule`; ``prediction=on``: a task's predicted
    output is proposed first, :func:`~specdecode.methods.with_prediction`). Sampled runs
    seed each prompt with :func:`prompt_seed`."""
    target = models.target()
    row = name
    name, spec, rule, draft_opts, predicted = _row_config(name, opts, temperature)
    draft = None
    if spec.method.needs_draft_model:
        draft_name = draft_opts.get("model") or models.draft_name
        draft = models.draft(draft_opts.get("dtype", "auto"), draft_opts.get("backend", "auto"), draft_name)
        if row in CROSS_ROWS and check_compatible(target, draft) != "cross":
            raise ValueError(f"{row} runs a draft of another tokenizer than the target's; "
                             f"{draft_name} has the target's: use {name}")
    proposer = build_proposer(spec, target, draft)
    schedule = build_schedule(spec, target, draft, proposer)
    engine = Engine(target.lm, proposer, schedule)
    times = verify_profile(target) if predicted else None  # (the run's profile, measured before)

    def run(prompt_ids, max_new_tokens, request=Request()):
        t0 = time.perf_counter()  # (compiling a schema is part of the request's time)
        grammar = Grammar.for_model(target, request.response_format)
        prediction = request.prediction
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                seed=prompt_seed(prompt_ids) if rule else None, acceptance_rule=rule,
                                grammar=grammar)
        own = engine
        if predicted and prediction is not None:  # (tokenizing it is part of the request's time)
            ids = target.tokenizer.encode(prediction, add_special_tokens=False)
            own = Engine(target.lm, *with_prediction(ids, proposer, schedule, times))
        gen = own.generate(prompt_ids, params, tuple(target.eos_token_ids) + request.stop_ids).run()
        return Output(gen.token_ids, time.perf_counter() - t0, gen.stats.to_dict())
    return run


def _hf(models: BenchModels, **generate_kwargs) -> Runner:
    hf = models.hf("target")

    def run(prompt_ids, max_new_tokens, request=Request()):
        eos = list(models.eos_token_ids()) + list(request.stop_ids)
        ids = torch.tensor([prompt_ids], device=hf.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=False, eos_token_id=eos, pad_token_id=eos[0] if eos else 0,
                              **generate_kwargs)
        return Output(out[0, len(prompt_ids):].tolist(), time.perf_counter() - t0)
    return run


def _hf_assisted(models, opts):
    kwargs = {"assistant_model": models.hf("draft")}
    if "k" in opts:
        kwargs["num_assistant_tokens"] = _int(opts, "k", 0)
    return _hf(models, **kwargs)


def _hf_assisted_xtok(models, opts):
    """transformers' Universal Assisted Generation: a draft of another tokenizer, its
    candidates re-tokenized through text (``assistant_tokenizer=``)."""
    from transformers import AutoTokenizer

    kwargs = {"assistant_model": models.hf("draft"),
              "tokenizer": AutoTokenizer.from_pretrained(resolve_model_path(models.target_name)),
              "assistant_tokenizer": AutoTokenizer.from_pretrained(resolve_model_path(models.draft_name))}
    if "k" in opts:
        kwargs["num_assistant_tokens"] = _int(opts, "k", 0)
    return _hf(models, **kwargs)


def _llamacpp(models: BenchModels, prompt_lookup: int) -> Runner:
    llm = models.llama(prompt_lookup)

    grammars = {}  # a schema's llama.cpp grammar, built once (its build is not timed)

    def run(prompt_ids, max_new_tokens, request=Request()):
        eos = tuple(models.eos_token_ids()) + request.stop_ids
        grammar = None
        if request.response_format is not None:
            schema = response_format_schema(request.response_format)
            key = json.dumps(schema, sort_keys=True)
            grammar = grammars.get(key) or grammars.setdefault(key, llamacpp.json_grammar(schema))
        t0 = time.perf_counter()
        ids = llamacpp.generate_greedy(llm, prompt_ids, max_new_tokens, eos, grammar)
        return Output(ids, time.perf_counter() - t0)
    return run


@dataclass(frozen=True)
class Peer:
    """A method of another project run beside ours: how to build its runner, its reference
    for the lossless check, and one line of help."""

    make: Callable[[BenchModels, dict], Runner]
    reference: str
    summary: str
    options: frozenset = frozenset()  # the row options it takes


PEERS: dict[str, Peer] = {
    "hf-ar": Peer(lambda models, opts: _hf(models), "hf-ar",
                  "transformers generate, greedy, same weights"),
    "hf-assisted": Peer(_hf_assisted, "hf-ar",
                        "transformers assisted generation with the same draft (k=num_assistant_tokens)",
                        frozenset({"k"})),
    "hf-assisted-xtok": Peer(_hf_assisted_xtok, "hf-ar",
                             "transformers assisted generation with a draft of another tokenizer "
                             "(assistant_tokenizer=: Universal Assisted Generation)", frozenset({"k"})),
    "hf-pld": Peer(lambda models, opts: _hf(models, prompt_lookup_num_tokens=_int(opts, "k", 10)), "hf-ar",
                   "transformers prompt lookup decoding (k=prompt_lookup_num_tokens, default 10)",
                   frozenset({"k"})),
    "llamacpp-ar": Peer(lambda models, opts: _llamacpp(models, 0), "llamacpp-ar",
                        "llama.cpp (llama-cpp-python) greedy decoding of the target's GGUF file "
                        "(optional extra: make llamacpp)"),
    "llamacpp-lookup": Peer(lambda models, opts: _llamacpp(models, _int(opts, "k", 10)), "llamacpp-ar",
                            "llama-cpp-python's prompt lookup decoding of that file (k=num_pred_tokens, "
                            "default 10)", frozenset({"k"})),
}
# transformers beside us (hf-assisted: the same draft), and the default method (hybrid)
DEFAULT_METHODS = "ar,hf-ar,hf-assisted,hf-pld,draft,hybrid"


def is_ours(name: str) -> bool:
    return name in METHODS or name in CROSS_ROWS


def parse_methods(spec: str) -> list[tuple[str, str, dict]]:
    """"ar,draft:k=4:dtype=float32" -> [(label, name, options)]. Raises ValueError naming a
    bad method or option."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, options = name_and_options(item)
        if not is_ours(name) and name not in PEERS:
            known = [*METHODS, *CROSS_ROWS, *PEERS]
            near = difflib.get_close_matches(name.lower(), known, n=1)
            raise ValueError(f"unknown method {name!r}; available: {', '.join(known)}"
                             + (f"; did you mean {near[0]!r}?" if near else ""))
        out.append((item, name, options))
    if not out:
        raise ValueError("no methods given")
    labels = [label for label, _, _ in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"a method is listed twice in {spec!r}")
    return out


def build_runners(models: BenchModels, methods,
                  temperature: float = 0.0) -> dict[str, tuple[Runner, str | None]]:
    """label -> (runner, label of its reference: ``ar`` for ours, ``hf-ar`` for the peers,
    None when the reference is not in the run or its tokens need not be equal: in a sampled
    run (``temperature`` > 0, ours only) a method of the rejection rule is equal to plain
    sampling in distribution only; gumbel methods are checked against ``ar`` when it is
    gumbel too; never for a lossy row, :func:`is_lossy`, whose output differs by design).
    Raises ValueError on unknown options, or peers in a sampled run."""
    runners = {}
    labels = [label for label, _, _ in methods]
    if temperature > 0:
        peers = [label for label, name, _ in methods if not is_ours(name)]
        if peers:
            raise ValueError(f"--temperature {temperature:g}: the peers {peers} run greedy here; "
                             "a sampled run takes our methods only")
        rules = {label: sampled_rule(dict(options), temperature) for label, _, options in methods}
    for label, name, options in methods:
        opts = dict(options)
        if is_ours(name):
            runner, ref = ours(models, name, opts, temperature), PLAIN
            if temperature > 0 and not (rules[label] == "gumbel" and rules.get(PLAIN) == "gumbel"):
                ref = None
            if is_lossy(name, options):
                ref = None
        else:
            runner, ref = PEERS[name].make(models, opts), PEERS[name].reference
        if opts:
            raise _unknown(label, name, opts, temperature)
        runners[label] = (runner, ref if ref in labels else None)
    return runners


def fixed_k(label: str) -> int | None:
    """Fixed speculation length K of one of our speculative methods (None: not speculative,
    or K changes from round to round)."""
    _, name, options = parse_methods(label)[0]
    if not is_ours(name):
        return None
    name = CROSS_ROWS.get(name, name)
    if METHODS[name].proposer is None:
        return None
    opts = dict(options)
    opts.pop("rule", None)  # (a sampled run's; K is the same)
    for key in LOSSY_KEYS:
        opts.pop(key, None)  # (likewise)
    spec = _row_config(name, opts, 0.0)[1]
    return spec.num_speculative_tokens if spec.schedule is KSchedule.FIXED else None

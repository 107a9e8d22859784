"""Python API: text in, text out, with transformers-style argument names accepted.

    import specdecode
    target = specdecode.load("qwen2.5-coder-1.5b-instruct")
    draft = specdecode.load("qwen2.5-coder-0.5b-instruct")
    out = specdecode.generate(target, "def fib(n):", draft=draft, max_new_tokens=64)
    print(out.text, out.stats.acceptance_rate)

Code written for transformers' assisted generation ports by renaming the call:
``assistant_model=``, ``do_sample=``, ``num_assistant_tokens=`` and ``eos_token_id=`` are
accepted with transformers' meaning, and so are ``prompt_lookup_num_tokens=``,
``max_matching_ngram_size=`` and ``assistant_confidence_threshold=``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator

import jinja2

from . import fim
from .batch import BatchEngine
from .config import SamplingParams
from .engine import Engine, Generation, TokenInfo
from .grammar import Grammar
from .methods import (KEYWORD_OPTIONS, Method, SpeculativeConfig, build_proposer, build_schedule, prepare, prompt_lookup_method,
                      speculative_config, with_prediction)
from .models.base import BatchLM, MeasuredDraft, lm_device
from .models.loading import DEFAULT_DTYPE, LoadedModel, check_compatible, load, parse_device
from .profile import verify_profile
from .stats import SpecDecodingStats
from .proposers import CrossTokenizerProposer, prediction_usage
from .text import IncrementalDetokenizer, TokenSpans


@dataclass
class GenerationResult:
    """text: the completion (special tokens skipped, cut before a stop string);
    token_ids: generated ids (an EOS that ended generation included); finish_reason: "stop"
    or "length"; prompt_token_ids: the prompt as the target saw it; token_info: one
    :class:`~specdecode.engine.TokenInfo` per generated id (who supplied it, its logprobs
    when asked for); accepted_prediction_tokens / rejected_prediction_tokens: with a
    prediction, its tokens that appear in the output in order, and the rest (OpenAI's
    usage fields, :func:`~specdecode.proposers.prediction_usage`); 0 without one."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: SpecDecodingStats
    prompt_token_ids: list[int] = field(default_factory=list)
    token_info: list[TokenInfo] = field(default_factory=list)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict(), "accepted_prediction_tokens": self.accepted_prediction_tokens,
                "rejected_prediction_tokens": self.rejected_prediction_tokens}


@dataclass
class StreamChunk:
    """One piece of a streamed completion: new text (UTF-8 safe, possibly empty) and the new
    token ids; the last chunk has ``result`` set (the whole :class:`GenerationResult`).

    token_info: one :class:`~specdecode.engine.TokenInfo` per new token id (who supplied it:
    accepted draft or lookup token, recovered, bonus or plain target token; its logprobs when
    asked for). spans: ``text`` cut into (piece, TokenInfo) runs by the token each
    character came from (a token whose text straddles two chunks appears in both);
    token_texts: each new token's own text (see :class:`~specdecode.text.TokenSpans`).
    stats: the request's :class:`~specdecode.stats.SpecDecodingStats` so far (live: it keeps
    counting; in a batch it may be a round or two ahead of this chunk).
    """

    text: str
    token_ids: list[int]
    result: GenerationResult | None = None
    token_info: list[TokenInfo] = field(default_factory=list)
    spans: list[tuple[str, TokenInfo]] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    stats: SpecDecodingStats | None = None


def _as_model(m, dtype: str, role: str = "target", device=None) -> LoadedModel:
    if not isinstance(m, LoadedModel):
        return load(m, dtype=dtype, role=role, device=device)
    if device is None:
        return m
    want, have = parse_device(device), lm_device(m.lm)
    if (want.type, want.index or 0) != (have.type, have.index or 0):  # a loaded model stays put
        raise ValueError(f"device={device!r}, but the {role} {m.name} is loaded on {have}: "
                         "leave device out, or load it there (specdecode.load(..., device=))")
    return m


def _sampling_params(*, max_new_tokens, min_new_tokens, temperature, do_sample, top_k, top_p,
                     repetition_penalty, seed, stop, eos_token_id,
                     acceptance_rule=None, logprobs=None) -> SamplingParams:
    if do_sample is False:
        temperature = 0.0
    elif temperature is None:
        temperature = 1.0 if do_sample else 0.0
    if isinstance(eos_token_id, int):
        eos_token_id = (eos_token_id,)
    return SamplingParams(
        max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, temperature=temperature,
        top_k=top_k or 0, top_p=1.0 if top_p is None else top_p,
        repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty, seed=seed,
        stop=() if stop is None else stop,  # SamplingParams names a bad value
        eos_token_ids=None if eos_token_id is None else tuple(eos_token_id),
        acceptance_rule=acceptance_rule, logprobs=logprobs)


def _prompt_ids(target: LoadedModel, prompt, input_ids, chat: bool, tools: list[dict] | None = None) -> list[int]:
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt (text or chat messages) and input_ids")
    if input_ids is not None:
        if isinstance(input_ids, (str, bytes)):
            raise ValueError("input_ids must be token ids (a list of ints or a tensor); pass text as prompt=")
        ids = input_ids.tolist() if hasattr(input_ids, "tolist") else list(input_ids)
        if ids and isinstance(ids[0], list):
            if len(ids) != 1:
                raise ValueError(f"input_ids holds {len(ids)} prompts; generate takes one")
            ids = ids[0]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"input_ids must be integer token ids, got {ids[:5]!r}...")
        return ids
    tok = target.tokenizer
    if tok is None:
        raise ValueError(f"target {target.name!r} was loaded without a tokenizer; pass input_ids")
    if chat or isinstance(prompt, list):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise ValueError(f"chat message {str(m)[:200]} must be a dict with string 'role' and 'content'")
            _check_utf8(m["role"], "a chat message's role")
            _check_utf8(m["content"], f"the {m['role']!r} message")
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"target {target.name!r} has no chat template; drop --chat / pass plain text")
        try:  # transformers renders templates in a sandboxed Jinja environment
            return list(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
        except (jinja2.TemplateError, TypeError, ValueError) as e:  # (a template fed odd fields)
            raise ValueError(f"the chat template of {target.name!r} failed ({type(e).__name__}: "
                             f"{str(e)[:200]}); fix the model's template or pass plain text") from None
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
    _check_utf8(prompt, "the prompt")
    return tok.encode(prompt)


def _check_utf8(text: str, what: str) -> None:
    """ValueError when ``text`` cannot be UTF-8 (a lone surrogate: in Python, a byte that was
    not UTF-8 where the text came from a file, argv or stdin), which tokenizers cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        origin = (f"the byte 0x{ord(bad) - 0xDC00:02X}, which is not UTF-8"
                  if 0xDC80 <= ord(bad) <= 0xDCFF else "a lone surrogate")
        raise ValueError(f"{what} is not valid UTF-8 text: character {e.start} is U+{ord(bad):04X} "
                         f"({origin}); give UTF-8 text") from None


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[:min(cuts)] if cuts else text


def stream(target, prompt=None, *, suffix: str | None = None, prediction: str | None = None,
           response_format: dict | Grammar | None = None, input_ids=None,
           draft=None, assistant_model=None,
           method: str | Method | SpeculativeConfig | None = None, chat: bool = False, max_new_tokens: int = 128,
           min_new_tokens: int = 0, temperature: float | None = None, do_sample: bool | None = None,
           top_k: int | None = 0, top_p: float | None = 1.0, repetition_penalty: float | None = 1.0,
           seed: int | None = None, acceptance_rule: str | None = None,
           stop: str | list[str] | None = None, logprobs: int | None = None,
           eos_token_id: int | list[int] | None = None,
           num_speculative_tokens: int | str | None = None, num_assistant_tokens: int | None = None,
           max_speculative_tokens: int = 16, draft_p_min: float | None = None,
           assistant_confidence_threshold: float | None = None,
           prompt_lookup_num_tokens: int | None = None, max_matching_ngram_size: int | None = None,
           suffix_cache: str = "request", dtype: str = DEFAULT_DTYPE, device: str | None = None,
           debug: bool = False, batch: BatchEngine | None = None, **options) -> Iterator[StreamChunk]:
    """Generate, yielding :class:`StreamChunk` pieces as each verify pass commits tokens.

    target / draft (alias ``assistant_model``): a :class:`LoadedModel` (from
    :func:`specdecode.load`) or anything :func:`load` accepts (name, directory, GGUF, hub id).
    prompt: text, or chat messages [{"role", "content"}]; ``chat=True`` applies the target's
    chat template to text. suffix: fill in the middle: ``prompt`` is the text before the gap,
    ``suffix`` the text after it, and the output the middle (the target's FIM tokens and
    llama.cpp server's layout: :mod:`specdecode.fim`; it ends where the model closes the gap
    or starts another file; FIMError for a model without FIM tokens). prediction: text the
    output is expected to repeat for the most part (OpenAI's Predicted Outputs: a file to
    rewrite), proposed for free where the output follows it
    (:class:`~specdecode.proposers.PredictionProposer`), with any method; the output is the
    method's all the same. response_format: OpenAI's ``{"type": "json_object"}`` or ``{"type":
    "json_schema", "json_schema": {"schema": {...}}}``: the output is plain constrained
    decoding of the target under that schema's grammar, whatever the method
    (:mod:`specdecode.grammar`; GrammarError for a schema that cannot be compiled); or a
    :class:`~specdecode.grammar.Grammar` compiled for this target (any llguidance grammar).
    input_ids: token ids
    instead of a prompt. dtype, device: how a
    target or draft given by name is loaded (:func:`~specdecode.models.loading.load`).
    method: "hybrid" (default when a draft is given, else "ar": plain decoding; each round
    suffix matching or the draft, whichever promises more, the draft only while its rounds
    are measured to pay), "draft", "prompt-lookup", "suffix", any other :class:`Method`, a
    name with its options ("medusa:head=DIR"), or a
    :class:`~specdecode.methods.SpeculativeConfig` (its method and options; K and the other
    arguments are this call's).
    ``"medusa:lossy-typical=EPS"`` is LOSSY: Medusa's typical acceptance changes the output
    of sampled requests (``stats.lossy`` says so); in a greedy request it is refused.
    num_speculative_tokens (alias ``num_assistant_tokens``): K, an integer (default 6 for
    draft models, 16 for lookups and the hybrid, whose draft model drafts at most 6),
    "heuristic" (transformers' schedule: +2 after a fully
    accepted round, −1 otherwise) or "auto" (K chosen each round from measured costs and
    acceptance); ``max_speculative_tokens`` caps the last two.
    draft_p_min (alias ``assistant_confidence_threshold``): stop drafting where the draft's
    top probability is below it (default: 0.5 for the hybrid and for a draft of another
    tokenizer than the target's, off otherwise; 0 = off).
    ``prompt_lookup_num_tokens=N`` (transformers) selects
    prompt lookup with K = N; ``max_matching_ngram_size``: its longest n-gram (default 5;
    the shortest is 2, or this if smaller).
    **options: a method's own options by their :class:`~specdecode.methods.SpeculativeConfig`
    names (``skip_layers=``, ``exit_layer=``, ``head_dir=``, ``draft_tree_width=``, ...:
    :data:`~specdecode.methods.KEYWORD_OPTIONS`), as its method string gives them.
    suffix_cache: "request", or "session" to also match the outputs of earlier requests of
    the same loaded target (the suffix and hybrid methods).
    temperature 0 / ``do_sample=False`` is greedy (the default); sampling is lossless for
    temperature, top_k, top_p and repetition_penalty. acceptance_rule (sampling): "gumbel"
    (the default with a seed: the output is a function of seed, prompt and target alone, the
    same as plain sampling with that seed whatever the method and K) or "rejection"
    (speculative sampling, arXiv:2211.17192; the default without a seed); see
    :class:`~specdecode.config.SamplingParams`.
    logprobs: None, or return each token's log-probability under the target's raw logits and
    this many most likely alternatives (0..20), in ``StreamChunk.token_info``.
    batch: a :class:`~specdecode.batch.BatchEngine` over this target's model to run the
    request in, beside the engine's other requests (the output is the same as alone);
    default: alone. In a batch, an integer ``num_speculative_tokens`` is kept every round;
    otherwise the batch's policy chooses each round's K, at most the schedule's.
    Text is emitted only once it is valid UTF-8 and cannot be the start of a stop string, so
    the concatenated chunks equal the non-streamed text. Raises ValueError on bad arguments,
    IncompatibleDraftError when the draft's tokenizer differs.
    """
    def one_of(a, a_name, b, b_name):
        if a is not None and b is not None:
            raise ValueError(f"give {a_name} or its alias {b_name}, not both")
        return a if a is not None else b

    k = one_of(num_speculative_tokens, "num_speculative_tokens", num_assistant_tokens,
               "num_assistant_tokens")
    if prompt_lookup_num_tokens is not None:
        method = prompt_lookup_method(method)
        k = one_of(k, "num_speculative_tokens", prompt_lookup_num_tokens, "prompt_lookup_num_tokens")
    draft = one_of(draft, "draft", assistant_model, "assistant_model")
    spec = speculative_config(
        method, draft is not None, k, max_speculative_tokens,
        one_of(draft_p_min, "draft_p_min", assistant_confidence_threshold,
               "assistant_confidence_threshold"),
        max_matching_ngram_size, suffix_cache, **options)
    own_k = isinstance(k, int) and not isinstance(k, bool)  # (the config fills in a default K)
    gen, tgt, params, prompt_ids, predicted = _start(
        target, prompt, input_ids, draft, spec, chat, suffix, prediction, response_format,
        dict(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, temperature=temperature,
             do_sample=do_sample, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
             seed=seed, stop=stop, eos_token_id=eos_token_id, acceptance_rule=acceptance_rule,
             logprobs=logprobs),
        dtype, device, debug, batch, own_k)
    tok = tgt.tokenizer
    eos = set(params.eos_token_ids if params.eos_token_ids is not None else tgt.eos_token_ids)

    def completion() -> str:
        """The whole text: an EOS that ended the request is not text (like vLLM); cut at stop."""
        ids = gen.token_ids
        if gen.finish_reason == "stop" and ids and ids[-1] in eos:
            ids = ids[:-1]
        text = _cut_at_stop(_decode(tok, ids), params.stop)
        # a request cut inside a multi-byte character leaves U+FFFD: drop the partial bytes
        return text.rstrip("\ufffd") if gen.finish_reason == "length" else text

    # text is emitted once it is complete UTF-8 and cannot be the start of a stop string; the
    # last block's comes from one decode of the whole output
    detok = IncrementalDetokenizer(lambda ids: _decode(tok, ids)) if tok is not None else None
    spans = TokenSpans(lambda ids: _decode(tok, ids)) if tok is not None else None
    sent, final = 0, None
    hold = max((len(s) for s in params.stop), default=1) - 1
    try:
        for new in gen:
            done = len(gen.token_ids) - len(new)
            info = gen.token_info[done:done + len(new)]
            if detok is None:
                yield StreamChunk("", new, token_info=info, stats=gen.stats)
                continue
            spans.add(new, info)
            if gen.finish_reason is not None:
                final = completion()
                delta = final[sent:]
            else:
                detok.add(new)  # no stop string yet: the engine would have ended the request
                text = detok.text
                delta = text[sent:max(sent, len(text) - hold)]
            yield StreamChunk(delta, new, token_info=info, spans=spans.split(delta, sent),
                              token_texts=spans.pieces[done:], stats=gen.stats)
            sent += len(delta)
    finally:  # a stream closed (or dropped) early frees its models now, not at garbage collection
        gen.close()
    text = "" if tok is None else final if final is not None else completion()
    result = GenerationResult(text, gen.token_ids, gen.finish_reason, gen.stats, prompt_ids,
                              gen.token_info[:len(gen.token_ids)])
    if predicted is not None:
        result.accepted_prediction_tokens, result.rejected_prediction_tokens = prediction_usage(
            predicted, gen.token_ids)
    yield StreamChunk(text[sent:], [], result, spans=spans.split(text[sent:], sent) if spans else [],
                      stats=gen.stats)


def generate(target, prompt=None, *, max_batch: int = 8, **kwargs) -> GenerationResult | list[GenerationResult]:
    """Generate a completion; same arguments as :func:`stream`. Returns a
    :class:`GenerationResult` (text, token_ids, finish_reason, stats).

    prompt may also be a list of prompts (strings, or chat-message lists): they run together
    in a :class:`~specdecode.batch.BatchEngine` of up to ``max_batch`` rows (native runtime),
    each the same output as alone (a seed applies to every prompt); returns one result per
    prompt, in order.
    """
    if isinstance(prompt, list) and not prompt:
        raise ValueError("prompt is an empty list: give a prompt, a list of chat messages, or a "
                         "list of prompts")
    if isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt):
        for i, p in enumerate(prompt):
            if not isinstance(p, (str, list)):
                raise ValueError(f"prompt[{i}] is of type {type(p).__name__}: a list of prompts holds "
                                 "strings or chat-message lists (one chat is a list of message "
                                 "dicts only)")
        return _generate_batch(target, prompt, max_batch, kwargs)
    for chunk in stream(target, prompt, **kwargs):
        if chunk.result is not None:
            return chunk.result
    raise RuntimeError("generation ended without a result")  # unreachable: stream always ends with one


def _generate_batch(target, prompts: list, max_batch: int, kwargs: dict) -> list[GenerationResult]:
    if kwargs.get("input_ids") is not None:
        raise ValueError("give a list of prompts or input_ids, not both")
    fim_suffix = kwargs.get("suffix")  # (fill in the middle's text after the gap)
    if fim_suffix is not None:
        raise ValueError("suffix= (fill in the middle) takes one prompt, the text before the gap, "
                         "not a list of prompts")
    if not (isinstance(max_batch, int) and max_batch >= 1):
        raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
    tgt = _as_model(target, kwargs.get("dtype", DEFAULT_DTYPE), device=kwargs.get("device"))
    ids = []
    for i, p in enumerate(prompts):
        try:
            ids.append(_prompt_ids(tgt, p, None, kwargs.get("chat", False)))
        except ValueError as e:
            raise ValueError(f"prompt[{i}]: {e}") from None
        if not ids[-1]:
            raise ValueError(f"prompt[{i}] is empty: give at least one token")
    new = kwargs.get("max_new_tokens", 128)
    max_len = min(tgt.lm.max_context, max(map(len, ids)) + (new if isinstance(new, int) else 0) + 1)
    method = kwargs.get("method")
    own = {key: value for key, value in kwargs.items() if key in KEYWORD_OPTIONS}
    spec = speculative_config(method, False, **own) if method is not None else None
    speculative = spec.method.spec.speculates if spec is not None else any(
        kwargs.get(a) is not None for a in ("draft", "assistant_model", "prompt_lookup_num_tokens"))
    # T(1..17) for the batch's K policy (and the hybrid's, auto K's cost model), measured
    # before the batch holds the target (once per machine, then cached on disk)
    times = verify_profile(tgt, max(16, kwargs.get("max_speculative_tokens", 16))) if speculative else None
    if spec is not None:
        prepare(spec, tgt)  # (the layer-skip profile, likewise)
    engine = BatchEngine(tgt.lm, min(max_batch, len(ids)), max(2, max_len), forward_seconds=times)
    rest = {k: v for k, v in kwargs.items() if k not in ("dtype", "device")}
    try:  # started together, consumed in turn: each next() steps every row in the batch
        # (each prompt as given, not its ids: a draft of another tokenizer reads a chat in
        # its own template, as alone)
        streams = [stream(tgt, p, batch=engine, **rest) for p in prompts]
        results: list[GenerationResult | None] = [None] * len(ids)
        live = set(range(len(ids)))
        while live:
            for i in sorted(live):
                chunk = next(streams[i])
                if chunk.result is not None:
                    results[i] = chunk.result
                    live.discard(i)
        return results
    finally:
        engine.close()


def _own_chat_view(proposer, draft: LoadedModel | None, prompt, chat: bool) -> None:
    """A draft of another tokenizer reads a chat in its own chat template, where it has one:
    its acceptance was 0.351 against 0.333 reading the target's rendered text (SmolLM2-135M
    for the Qwen2.5-Coder target, 6 Spec-Bench prompts: docs/EXPERIMENTS.md, drafts of
    another tokenizer)."""
    cross = proposer if isinstance(proposer, CrossTokenizerProposer) else getattr(proposer, "drafter", None)
    if not isinstance(cross, CrossTokenizerProposer) or not (chat or isinstance(prompt, list)):
        return
    tok = draft.tokenizer
    if tok is None or not getattr(tok, "chat_template", None) or prompt is None:
        return
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    try:
        cross.draft_prompt_ids = list(tok.apply_chat_template(messages, add_generation_prompt=True,
                                                              tokenize=True, return_dict=False))
    except Exception:  # noqa: BLE001 - a template that refuses these roles: the target's text
        cross.draft_prompt_ids = None


def _prediction_ids(target: LoadedModel, prediction: str | None, prompt_len: int) -> list[int] | None:
    """The prediction's token ids, as the output would be tokenized (None without one).
    Raises ValueError for a model without a tokenizer, text that is not UTF-8, or a
    prediction that does not fit the target's context after the prompt."""
    if prediction is None:
        return None
    if target.tokenizer is None:
        raise ValueError("prediction= needs the target's tokenizer (loaded with tokenizer=False)")
    _check_utf8(prediction, "the prediction")
    ids = target.tokenizer.encode(prediction, add_special_tokens=False)
    room = target.lm.max_context - prompt_len
    if len(ids) > room:
        raise ValueError(f"the prediction has {len(ids)} tokens, more than the {room} the target's "
                         f"context ({target.lm.max_context}) leaves after the prompt ({prompt_len})")
    return ids


def _start(target, prompt, input_ids, draft, spec: SpeculativeConfig, chat, suffix, prediction, response_format,
           sampling: dict,
           dtype, device, debug, batch=None, own_k=False
           ) -> tuple[Generation, LoadedModel, SamplingParams, list[int], list[int] | None]:
    params = _sampling_params(**sampling)
    if prediction is not None and not isinstance(prediction, str):
        raise ValueError(f"prediction must be text (the output expected), not {type(prediction).__name__}")
    if suffix is not None and (not isinstance(prompt, str) or chat or input_ids is not None
                               or not isinstance(suffix, str)):
        raise ValueError("suffix= (fill in the middle) takes text: prompt= the text before the "
                         "gap, suffix= the text after it; not chat, not input_ids")
    if spec.lossy_typical is not None and params.greedy:
        raise ValueError(f"lossy-typical={spec.lossy_typical} applies to sampled requests (temperature > 0): "
                         "at temperature 0 Medusa's typical acceptance is greedy verification, so it would "
                         "change nothing; give a temperature, or drop lossy-typical=")
    if spec.method.needs_draft_model and draft is None:
        raise ValueError(f"method {spec.method.value!r} needs a draft model (draft= or assistant_model=)")
    tgt = _as_model(target, dtype, device=device)
    drf = _as_model(draft, dtype, "draft", device) if spec.method.needs_draft_model else None
    grammar = Grammar.for_model(tgt, response_format)
    if grammar is not None:
        params = replace(params, grammar=grammar)  # (SamplingParams refuses min_new_tokens with it)
    if suffix is not None:
        _check_utf8(prompt, "the prompt")
        _check_utf8(suffix, "the suffix")
        prompt_ids = fim.infill_ids(tgt, prompt, suffix, n_predict=params.max_new_tokens)
        if params.eos_token_ids is None:  # the middle also ends where the model closes the gap
            params = replace(params, eos_token_ids=tuple(tgt.eos_token_ids) + fim.require_fim(tgt).stops)
    else:
        prompt_ids = _prompt_ids(tgt, prompt, input_ids, chat)
    decode = (lambda ids: _decode(tgt.tokenizer, ids)) if tgt.tokenizer is not None else None
    predicted = _prediction_ids(tgt, prediction, len(prompt_ids))
    if batch is None:
        proposer = build_proposer(spec, tgt, drf)
        _own_chat_view(proposer, drf, prompt, chat)
        schedule = build_schedule(spec, tgt, drf, proposer)
        times = verify_profile(tgt) if predicted is not None else None  # (measured once, cached)
        proposer, schedule = with_prediction(predicted, proposer, schedule, times)
        engine = Engine(tgt.lm, proposer, schedule, debug=debug)
        return engine.generate(prompt_ids, params, tgt.eos_token_ids, decode), tgt, params, prompt_ids, predicted
    if batch.target is not tgt.lm:
        raise ValueError("batch= is a BatchEngine over another model than this target's")
    if spec.suffix_cache == "session":
        raise ValueError("suffix_cache='session' shares one proposer between requests, which a "
                         "batch runs side by side: use suffix_cache='request' with batch=")
    # each row's draft model drafts on a row of the batch's cache for that draft, so that
    # the rows' draft passes run as one (BatchEngine.draft_view); a model without rows of
    # their own lengths drafts on a fork of its own
    draft_s = verify_profile(drf, 0)[0] if drf is not None else None  # (measured on the model itself)
    prepare(spec, tgt, drf)  # what it measures on the draft, on the model itself too
    positions = None if drf is None or check_compatible(tgt, drf) == "same" else \
        CrossTokenizerProposer.draft_positions(batch.max_len)
    view = batch.draft_view(drf.lm, positions) if drf is not None and isinstance(drf.lm, BatchLM) else \
        drf.lm.fork() if drf is not None else None
    own = replace(drf, lm=view, session_proposers={}) if drf is not None else None
    proposer = build_proposer(spec, tgt, own)
    _own_chat_view(proposer, drf, prompt, chat)
    schedule = build_schedule(spec, tgt, drf, proposer)
    if draft_s is None and proposer is not None and batch.forward_seconds:
        # a self-draft's cost: its share of the target's T(1)
        costs = [m.cost for m in proposer.models() if isinstance(m, MeasuredDraft)]
        draft_s = batch.forward_seconds[0] * costs[0] if costs else None
    proposer, schedule = with_prediction(predicted, proposer, schedule, batch.forward_seconds)
    gen = batch.add(prompt_ids, params, tgt.eos_token_ids, decode, proposer, schedule, draft_s, own_k)
    return gen, tgt, params, prompt_ids, predicted

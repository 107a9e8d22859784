"""Structured output: a grammar the output must follow (OpenAI's ``response_format``:
``json_object`` or a ``json_schema``), through llguidance (the grammar library; its token
masks and forced tokens; https://github.com/guidance-ai/llguidance).

Constrained decoding masks, at every position, the tokens the grammar does not allow there,
before the request's sampling (greedy, temperature, top-k, top-p). Speculation keeps that
output exactly: each row of a verify pass is masked as a one-token pass at its position
would be (the grammar's state after the committed tokens and the row's draft tokens before
it), so the acceptance rule sees the same processed distribution row by row. The grammar
also changes what is proposed, never what is kept: where it allows exactly one way on
(``{"`` then ``name`` then ``":`` after a schema's opening), those tokens are proposed for
free (llguidance returns them tokenized as the tokenizer would: the canonical split the
target is likely to take), and a point-mass draft is cut at its first token the grammar
refuses (that token could never be accepted).

JSON is laid out as ``json.dumps`` does by default (``", "`` between items, ``": "`` after
keys, no other whitespace), as vLLM's guidance backend lays it out without flexible
whitespace: a model left free to add whitespace can loop on newlines.
"""

from __future__ import annotations

import weakref

import llguidance
import llguidance.hf
import llguidance.torch
import torch

# how the JSON of a schema is laid out (llguidance's JSON options)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")

_tokenizers: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


class GrammarError(ValueError):
    """A response format that cannot be served (bad shape, a schema the grammar library
    cannot compile, a model without a tokenizer); the message names the field."""


def response_format_grammar(response_format) -> str | None:
    """The grammar (llguidance's JSON grammar text) of an OpenAI ``response_format``.

    Args:
        response_format: None or ``{"type": "text"}`` (no constraint); ``{"type":
            "json_object"}`` (any JSON object); ``{"type": "json_schema", "json_schema":
            {"name": ..., "schema": {...}, "strict": ...}}`` (JSON valid against the schema;
            strict or not, the output always is).

    Returns:
        The grammar text, or None for no constraint.

    Raises:
        GrammarError: naming the field that is missing or of the wrong type.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise GrammarError(f"response_format must be an object with a 'type' ({', '.join(RESPONSE_FORMATS)}), "
                           f"not {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMATS:
        raise GrammarError(f"response_format.type {kind!r} is not supported; allowed: {', '.join(RESPONSE_FORMATS)}")
    if kind == "text":
        return None
    return _json_grammar(response_format_schema(response_format))


def _json_grammar(schema: dict) -> str:
    """llguidance's grammar of a JSON schema (:data:`JSON_LAYOUT`); GrammarError for a
    schema it cannot take (a number beyond its range, ...)."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except (ValueError, TypeError, RecursionError) as e:
        raise GrammarError(f"the schema cannot be compiled: {e}") from None


def check_schema(schema: dict) -> None:
    """GrammarError (the library's message) for a JSON schema llguidance cannot compile."""
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(_json_grammar(schema))
    if failed:
        raise GrammarError(f"the schema cannot be compiled: {'; '.join(messages)}")


def response_format_schema(response_format: dict) -> dict:
    """The JSON schema of a ``json_object`` or ``json_schema`` response format (any object
    for ``json_object``; OpenAI's default, any JSON, for a ``json_schema`` without one).
    Raises GrammarError for a json_schema of the wrong shape."""
    if response_format.get("type") == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise GrammarError("response_format.json_schema must be an object with the JSON schema in "
                           "'schema' ({'name': ..., 'schema': {...}})")
    return spec.get("schema", {})


class Grammar:
    """A grammar compiled for one model's tokenizer; shared by requests (each gets its own
    :class:`GrammarState` from :meth:`start`).

    Args:
        grammar: llguidance grammar text (:func:`response_format_grammar`).
        tokenizer: the model's transformers tokenizer.
        vocab_size: V, the model's logit rows (may exceed the tokenizer's tokens).
        eos_token_ids: the model's EOS ids: the grammar allows them where it is complete.
        field: the request field named in errors.

    Raises:
        GrammarError: the library cannot compile the grammar (its message, naming ``field``).
    """

    def __init__(self, grammar: str, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 field: str = "response_format"):
        if tokenizer is None:
            raise GrammarError(f"{field} needs the target's tokenizer (it was loaded without one)")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = _ll_tokenizer(tokenizer, vocab_size, self.eos_token_ids)
        self.grammar = grammar
        try:
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        except (ValueError, TypeError, RecursionError) as e:
            failed, messages = True, [str(e)]
        if failed:
            raise GrammarError(f"{field}: the schema cannot be compiled: {'; '.join(messages)}")

    @classmethod
    def for_model(cls, model, response_format) -> "Grammar | None":
        """The grammar of ``response_format`` for a :class:`~specdecode.models.loading.LoadedModel`,
        or None when it sets no constraint; a Grammar given is returned as it is (one
        compiled for this model). Raises GrammarError (see the class)."""
        if isinstance(response_format, Grammar):
            return response_format
        grammar = response_format_grammar(response_format)
        if grammar is None:
            return None
        return cls(grammar, model.tokenizer, model.lm.vocab_size, model.eos_token_ids)

    def start(self, eos: frozenset[int] | tuple[int, ...] = ()) -> "GrammarState":
        """A request's state at the start of its output; ``eos``: the request's EOS ids
        (allowed where the grammar is complete; default: the model's)."""
        return GrammarState(self, tuple(eos) or self.eos_token_ids)

    def __repr__(self) -> str:
        return f"Grammar({self.grammar[:60]!r}...)"


def _ll_tokenizer(tokenizer, vocab_size: int, eos: tuple[int, ...]):
    """llguidance's view of a transformers tokenizer (built once per tokenizer and V: ~2 s
    for a 150k vocabulary)."""
    built = _tokenizers.setdefault(tokenizer, {})
    key = (vocab_size, eos)
    if key not in built:
        built[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos))
    return built[key]


class GrammarState:
    """One request's place in its grammar: the committed output so far.

    The engine asks for the rows' masks of a verify pass (:meth:`allowed`), the forced
    tokens (:meth:`forced`) and how much of a point-mass draft the grammar allows
    (:meth:`valid_prefix`), and commits each round's tokens (:meth:`commit`); the state then
    holds the committed output only (the drafts' are rolled back).
    """

    def __init__(self, grammar: Grammar, eos: tuple[int, ...]):
        self.grammar = grammar
        self.eos = eos
        self.matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.grammar)
        if self.matcher.is_error():
            raise GrammarError(f"response_format: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more but EOS."""
        return self.matcher.is_stopped()

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar allows only one way on from here, at most ``limit``
        (llguidance's canonical tokens of the forced bytes); [] when it allows a choice."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())[:limit]

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (after the committed output) the grammar allows in turn."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def allowed(self, paths: list[list[int]]) -> torch.Tensor:
        """The mask of each row of a verify pass.

        Args:
            paths: per row, the draft tokens before its position (a chain's row i:
                ``drafts[:i]``; a tree's node: its ancestors and itself).

        Returns:
            [len(paths), V] bool, True where the grammar allows the token at that row. A
            row after a draft token the grammar refuses is all True: that row is never
            used (the refused token is never accepted). Where the grammar is complete only
            the request's EOS ids are allowed.
        """
        m, v = self.matcher, self.grammar.vocab_size
        bitmask = llguidance.torch.allocate_token_bitmask(len(paths), v)
        for r, path in enumerate(paths):
            n = m.try_consume_tokens(path) if path else 0
            if n < len(path):
                bitmask[r] = -1
            elif m.is_stopped():
                bitmask[r] = 0
                for e in self.eos:
                    if e < v:
                        bitmask[r, e // 32] |= _bit(e % 32)
            else:
                llguidance.torch.fill_next_token_bitmask(m, bitmask, r)
            if n:
                m.rollback(n)
        bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.bool().reshape(len(paths), -1)[:, :v]

    def commit(self, tokens: list[int]) -> None:
        """The round's committed tokens (an EOS that ends the request included).

        Raises:
            RuntimeError: a token the grammar refuses (masks make that impossible: a bug).
        """
        body = [t for t in tokens if t not in self.eos]
        if body and not self.matcher.consume_tokens(body):
            raise RuntimeError(f"committed tokens {body} that the grammar refuses: "
                               f"{self.matcher.get_error()}")


def _bit(i: int) -> int:
    """The int32 value of bit i (bit 31 is negative)."""
    return (1 << i) - (1 << 32 if i == 31 else 0)


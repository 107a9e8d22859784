"""Incremental detokenization and stop strings: the same text as one decode of the whole
output, at a cost per token that does not grow with the output (docs/testing.md, streaming)."""

from __future__ import annotations

import random

import pytest

from helpers import local_tokenizer
from specdecode.text import IncrementalDetokenizer, StopStrings, TokenSpans


class CountingDecode:
    """decode() that counts how many ids it was asked to decode in all."""

    def __init__(self, tok):
        self.tok, self.ids_decoded = tok, 0

    def __call__(self, ids):
        self.ids_decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("block", [1, 3, 7])
def test_incremental_text_equals_one_decode(seed, block):
    tok = local_tokenizer()
    rng = random.Random(seed)
    # random ids (many are lone UTF-8 bytes of multi-byte characters) and real text
    ids = [rng.randrange(len(tok)) for _ in range(300)] + tok.encode("naïve café 🌍 你好, done.")
    decode = CountingDecode(tok)
    detok = IncrementalDetokenizer(decode)
    pieces = [detok.add(ids[i:i + block]) for i in range(0, len(ids), block)]
    full = tok.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == detok.text == full
    assert all("\ufffd" not in p[-1:] for p in pieces)  # never a piece of a character


def test_decoding_cost_is_linear_in_the_output():
    """The old stop-string check decoded the whole output after every token (quadratic):
    4,000 tokens cost 8 million decoded ids. Incremental: a few per token."""
    tok = local_tokenizer()
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 400)[:4000]
    decode = CountingDecode(tok)
    stop = StopStrings(("never appears",), decode)
    assert not any(stop.hit(t) for t in ids)
    assert decode.ids_decoded < 8 * len(ids)


def test_stop_string_found_at_its_own_token():
    tok = local_tokenizer()
    ids = tok.encode("Hello there, how are you today? The quick brown fox")
    text = tok.decode(ids)
    target = text.index("today") + len("today")
    stop = StopStrings(("today",), CountingDecode(tok))
    hit = next(i for i, t in enumerate(ids) if stop.hit(t))
    assert len(tok.decode(ids[:hit])) < target <= len(tok.decode(ids[:hit + 1]))


@pytest.mark.parametrize("seed", range(3))
def test_token_spans_cut_any_split_of_the_text_by_token(seed):
    """Streamed pieces of the text, cut wherever, are split into runs labelled by the token
    each character came from: the runs give back the text, and each token's characters are
    exactly its own text (a multi-byte character belongs to the token that completes it)."""
    from tiny_dirs import UNICODE_TEXT
    tok = local_tokenizer()
    ids = tok.encode(UNICODE_TEXT + " def f(x): return x")
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    text = decode(ids)
    rng = random.Random(seed)
    spans, runs, sent, fed = TokenSpans(decode), [], 0, 0
    while sent < len(text):
        step = rng.randint(1, 4)
        spans.add(ids[fed:fed + step], list(range(fed, fed + step)))
        fed += step
        end = spans.ends[-1] if fed < len(ids) else len(text)
        cut = rng.randint(sent, max(sent, end))  # a stream may hold some text back
        runs += spans.split(text[sent:cut], sent)
        sent = cut
    assert "".join(t for t, _ in runs) == text
    labels = [label for _, label in runs]
    assert labels == sorted(labels)
    for i in range(len(ids)):
        assert "".join(t for t, label in runs if label == i) == spans.pieces[i]
        assert spans.start_of(i) == sum(len(p) for p in spans.pieces[:i])
    assert any(p == "" for p in spans.pieces)  # some token only began a character

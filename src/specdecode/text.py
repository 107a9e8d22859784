"""Text from token ids as they are committed: incremental, UTF-8 safe detokenization, and the
stop-string check built on it. Both cost a few tokens' decoding per token, never a decode of
the whole output (which made long outputs quadratic)."""

from __future__ import annotations

from typing import Callable


class IncrementalDetokenizer:
    """The text of a growing list of token ids, decoded a window at a time.

    ``add(ids)`` appends ids and returns the text they complete. Each call decodes only the
    ids since the last emitted piece plus that piece's own ids, as context (tokenizers join
    pieces differently at their edges: a SentencePiece leading space, a byte-level BPE
    character split over two tokens), and emits the difference once it does not end in an
    incomplete UTF-8 character (U+FFFD). After the last ``add``, ``text`` equals
    ``decode(all ids)`` for tokenizers whose decoding of a sequence is the concatenation of
    its parts' (byte-level BPE, SentencePiece; what vLLM's and TGI's incremental
    detokenizers assume). ``decode``: ids -> text (e.g. ``tokenizer.decode(ids,
    skip_special_tokens=True)``).
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # ids[_prefix:_read] are the last emitted piece: context for the next
        self._read = 0

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        before = self.decode(self.ids[self._prefix:self._read]) if self._read > self._prefix else ""
        after = self.decode(self.ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self.text += delta
        self._prefix, self._read = self._read, len(self.ids)
        return delta


class StopStrings:
    """Finds the first generated token at which any stop string appears in the text.

    decode: token ids -> text. Checks each token of a block, so a stop string that starts
    early in a long accepted block, or spans tokens or blocks, is found at its own token.
    """

    def __init__(self, stop: tuple[str, ...], decode: Callable[[list[int]], str]):
        self.stop = stop
        self.longest = max(len(s) for s in stop)
        self._text = IncrementalDetokenizer(decode)
        self._checked = 0  # text length already searched

    def hit(self, token: int) -> bool:
        """Add the next generated token; True when a stop string now appears."""
        if not self._text.add([token]):
            return False
        text = self._text.text
        start = max(0, self._checked - self.longest)
        self._checked = len(text)
        return any(s in text[start:] for s in self.stop)


class TokenSpans:
    """Which token each character of a streamed text came from.

    ``add(ids, labels)`` appends generated tokens with one label each (e.g. a
    :class:`~specdecode.engine.TokenInfo`); each token's own text is what it completes when
    decoded one token at a time (:class:`IncrementalDetokenizer`: "" for a token that only
    begins a multi-byte character, the whole character at the token that ends it).
    ``split(text, start)`` cuts a piece of the output, ``text`` = characters ``start ..
    start + len(text)``, into (text, label) runs, one per token it overlaps; characters past
    the last token's text (where a tokenizer does not decode piecewise) go to the last label.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._text = IncrementalDetokenizer(decode)
        self.ends: list[int] = []  # character offset after token i's text
        self.pieces: list[str] = []  # token i's own text
        self.labels: list = []
        self._first = 0  # the first token whose text may overlap the next split

    def add(self, ids: list[int], labels: list) -> None:
        for tok, label in zip(ids, labels):
            self.pieces.append(self._text.add([tok]))
            self.ends.append(len(self._text.text))
            self.labels.append(label)

    def start_of(self, i: int) -> int:
        """Character offset where token i's text begins."""
        return self.ends[i - 1] if i else 0

    def split(self, text: str, start: int) -> list[tuple[str, object]]:
        out, pos, end = [], start, start + len(text)
        i = self._first
        while pos < end and i < len(self.ends):
            if self.ends[i] > pos:
                cut = min(self.ends[i], end)
                out.append((text[pos - start:cut - start], self.labels[i]))
                pos = cut
            if self.ends[i] <= pos:
                i += 1
        self._first = i
        if pos < end and self.labels:
            out.append((text[pos - start:], self.labels[-1]))
        return out

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

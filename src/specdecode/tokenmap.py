"""Token ids as bytes, for speculation between two tokenizers.

A draft of another tokenizer proposes text, not token ids; what the target can verify are its
own ids. Bytes are the common ground: every byte-level BPE token (GPT-2, Qwen2.5, SmolLM2,
Llama 3) and every SentencePiece token with byte fallback (Llama 2, Gemma) stands for a fixed
byte string, and a sequence of tokens for the concatenation of theirs — whatever UTF-8
characters it splits. :class:`TokenBytes` is that table for one tokenizer; :class:`VocabMap`
the exact map between two (a draft token whose bytes are exactly one target token's), which
the cross-tokenizer proposer uses for sampled requests (arXiv:2502.05202, token-level
intersection) and ``specdecode check-pair`` reports.
"""

from __future__ import annotations

import json
import re
import weakref
from functools import lru_cache

import torch


class UnsupportedTokenizerError(ValueError):
    """A tokenizer whose tokens cannot be mapped to bytes (a slow tokenizer, WordPiece...)."""


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted (what ByteLevel decodes)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_kind(tokenizer) -> str:
    """"bytelevel", "metaspace" (SentencePiece: ▁ for space, maybe <0xNN> byte fallback) or
    "plain" (a token is its own text). Raises UnsupportedTokenizerError otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UnsupportedTokenizerError(
            f"{type(tokenizer).__name__} is a slow (Python) tokenizer: speculation across "
            "tokenizers reads the fast tokenizer's decoder; load the model's tokenizer.json")
    decoder = json.loads(backend.to_str()).get("decoder")
    types: list[str] = []

    def walk(d):
        if d:
            types.append(d.get("type"))
            for sub in d.get("decoders", []) or []:
                walk(sub)
    walk(decoder)
    if "ByteLevel" in types:
        return "bytelevel"
    if {"Metaspace", "ByteFallback", "Replace"} & set(types):
        return "metaspace"
    if not types or set(types) <= {"Fuse", "Strip"}:
        return "plain"
    raise UnsupportedTokenizerError(
        f"the tokenizer's decoder ({'+'.join(types)}) does not map tokens to bytes one for one "
        "(byte-level BPE and SentencePiece tokenizers do): no speculation across tokenizers "
        "with it")


class TokenBytes:
    """The byte string of every token id of one (fast) tokenizer.

    ``table[i]``: the bytes token ``i`` stands for (UTF-8 for text, raw bytes for byte-level
    and byte-fallback tokens); special and added tokens stand for their content's UTF-8,
    except a BOS token the tokenizer adds in front of every text, which stands for nothing
    (a model's start marker, not text; ChatML's ``<|im_start|>``, named BOS but not added,
    stands for its text).
    ``special``: ids of special tokens (the tokenizer's ``all_special_ids`` and added tokens
    marked special). ``bos``: the BOS id the tokenizer adds in front of a text, or None.
    ``encode(text)``: ids without BOS or other added ids (``add_special_tokens=False``).
    Build with :meth:`of` (cached per tokenizer object). Raises UnsupportedTokenizerError for
    a tokenizer whose tokens are not byte strings (slow tokenizers, WordPiece).
    """

    def __init__(self, tokenizer):
        kind = _decoder_kind(tokenizer)
        vocab = tokenizer.get_vocab()
        added = {i: t for i, t in tokenizer.added_tokens_decoder.items()}
        size = max(len(tokenizer), max(vocab.values()) + 1)
        table = [b""] * size
        decoder = _byte_decoder()
        for token, i in vocab.items():
            if i in added:
                table[i] = added[i].content.encode()
            elif kind == "bytelevel":
                try:
                    table[i] = bytes(decoder[c] for c in token)
                except KeyError:  # a token outside the byte alphabet: its own text
                    table[i] = token.encode()
            elif kind == "metaspace" and (m := _BYTE_TOKEN.fullmatch(token)):
                table[i] = bytes([int(m.group(1), 16)])
            elif kind == "metaspace":
                table[i] = token.replace("\u2581", " ").encode()
            else:
                table[i] = token.encode()
        self.special = frozenset(set(tokenizer.all_special_ids)
                                 | {i for i, t in added.items() if t.special})
        probe = tokenizer("a", add_special_tokens=True)["input_ids"]
        bos = tokenizer.bos_token_id
        self.bos = bos if bos is not None and probe[:1] == [bos] else None
        if self.bos is not None:
            table[self.bos] = b""
        self.table = table
        self.tokenizer = tokenizer
        self.kind = kind

    _CACHE: "weakref.WeakKeyDictionary[object, TokenBytes]" = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, tokenizer) -> "TokenBytes":
        """The table of ``tokenizer``, built once per tokenizer object (0.2-0.5 s for 150k ids)."""
        try:
            return cls._CACHE[tokenizer]
        except (KeyError, TypeError):
            pass
        table = cls(tokenizer)
        try:
            cls._CACHE[tokenizer] = table
        except TypeError:
            pass
        return table

    def __len__(self) -> int:
        return len(self.table)

    def bytes_of(self, ids) -> bytes:
        """The bytes of a sequence of ids (ids past the table: nothing)."""
        t, n = self.table, len(self.table)
        return b"".join(t[i] for i in ids if 0 <= i < n)

    def encode(self, text: str) -> list[int]:
        """``text`` as ids, nothing added (no BOS); special tokens' texts become their ids."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_bytes(self, data: bytes) -> tuple[list[int], int, bool] | None:
        """The ids of ``data``'s longest prefix of valid UTF-8 characters, that prefix's
        length in bytes, and whether the rest is only a character cut short by the end (else
        ``data`` holds bytes that are not UTF-8 there); None where the ids do not stand for
        exactly those bytes (a normalizer changed the text, e.g. NFC, or a tokenizer that
        prepends a space)."""
        n, whole = utf8_prefix(data)
        if n == 0:
            return [], 0, whole
        ids = self.encode(data[:n].decode("utf-8"))
        return (ids, n, whole) if self.bytes_of(ids) == data[:n] else None


def utf8_prefix(data: bytes) -> tuple[int, bool]:
    """The length of ``data``'s longest valid UTF-8 prefix, and True when what follows it is
    at most a character cut short by the end of ``data`` (False: bytes that are not UTF-8)."""
    try:
        data.decode("utf-8")
        return len(data), True
    except UnicodeDecodeError as e:
        return e.start, e.reason == "unexpected end of data"


class VocabMap:
    """The exact map from a draft's token ids to a target's: draft token d maps to target
    token t when their bytes are equal (ordinary tokens to ordinary tokens, where several
    share the bytes the lowest id; special tokens to special tokens of the same content,
    e.g. both tokenizers' ``<|im_end|>``; empty tokens to nothing).

    ``to_target``: [V_draft] int64, t or -1. ``overlap``: how many draft ids map.
    ``special_to_target``: the special tokens' part of it, draft id -> target id.
    """

    def __init__(self, target: TokenBytes, draft: TokenBytes):
        ordinary: dict[bytes, int] = {}
        special: dict[bytes, int] = {}
        for t, b in enumerate(target.table):
            if b:
                (special if t in target.special else ordinary).setdefault(b, t)
        to_target = torch.full((len(draft.table),), -1, dtype=torch.long)
        self.special_to_target = {}
        for d, b in enumerate(draft.table):
            if not b:
                continue
            is_special = d in draft.special
            t = (special if is_special else ordinary).get(b)
            if t is not None:
                to_target[d] = t
                if is_special:
                    self.special_to_target[d] = t
        self.to_target = to_target
        self.overlap = int((to_target >= 0).sum())

    _CACHE: dict = {}

    @classmethod
    def of(cls, target: TokenBytes, draft: TokenBytes) -> "VocabMap":
        """The map of a pair, built once per pair of tables."""
        key = (id(target), id(draft))
        hit = cls._CACHE.get(key)
        if hit is None or hit[0]() is not target or hit[1]() is not draft:
            hit = (weakref.ref(target), weakref.ref(draft), cls(target, draft))
            cls._CACHE[key] = hit
        return hit[2]


def pair_mode(target_tokenizer, draft_tokenizer) -> str:
    """"same" when the two tokenizers have the same vocabulary and special tokens (token ids
    pass straight through), also when one lists padding tokens past the other's last id, as
    llama.cpp's converter pads a GGUF's token list to the embedding rows (``[PAD<id>]``: a
    Qwen2.5-7B file lists 152,064 tokens, a Qwen2.5-0.5B one 151,936); else "cross"
    (proposals go through text). Raises UnsupportedTokenizerError when they differ and one
    cannot be read as bytes."""
    tt, dt = target_tokenizer, draft_tokenizer
    if _same_but_padding(tt.get_vocab(), dt.get_vocab()) and tt.all_special_tokens == dt.all_special_tokens:
        return "same"
    TokenBytes.of(tt), TokenBytes.of(dt)
    return "cross"


def _same_but_padding(a: dict[str, int], b: dict[str, int]) -> bool:
    """Whether two vocabularies (token -> id) are equal, but for ``[PAD<id>]`` tokens that
    the larger lists past the smaller's ids."""
    small, large = sorted((a, b), key=len)
    return (all(large.get(t) == i for t, i in small.items())
            and all(t == f"[PAD{i}]" and i >= len(small) for t, i in large.items() if t not in small))


SAMPLE_TEXT = "def mean(xs):\n    return sum(xs) / len(xs)  # naïve, 🚀 Grüße 你好"


def compare_tokenizers(target_tokenizer, draft_tokenizer) -> dict:
    """What ``specdecode check-pair`` reports of two tokenizers: the mode a draft pairing
    would use and why, their sizes, BOS, EOS and special tokens, the share of the draft's
    vocabulary that maps to one target token exactly, which special tokens map, whether the
    chat templates are the same, and how each splits a sample text (tokens)."""
    tt, dt = target_tokenizer, draft_tokenizer
    out: dict = {"target_tokens": len(tt), "draft_tokens": len(dt)}
    try:
        mode = pair_mode(tt, dt)
    except UnsupportedTokenizerError as e:
        return {**out, "mode": "refused", "why": str(e)}
    if mode == "same":
        why = "the same vocabulary and special tokens: token ids pass straight through (the fast path)"
    else:
        why = ("different tokenizers that both map tokens to bytes: the draft drafts in its own "
               "tokens and its text is re-encoded by the target's tokenizer each round")
    t, d = TokenBytes.of(tt), TokenBytes.of(dt)
    vm = VocabMap.of(t, d)
    names = lambda tok, ids: sorted(tok.convert_ids_to_tokens(sorted(ids)))  # noqa: E731
    out.update(
        mode=mode, why=why,
        decoders={"target": t.kind, "draft": d.kind},
        bos_added={"target": tt.bos_token if t.bos is not None else None,
                   "draft": dt.bos_token if d.bos is not None else None},
        eos={"target": tt.eos_token, "draft": dt.eos_token},
        special={"target": names(tt, t.special), "draft": names(dt, d.special)},
        special_mapped={dt.convert_ids_to_tokens(a): tt.convert_ids_to_tokens(b)
                        for a, b in vm.special_to_target.items()},
        exact_overlap=vm.overlap, exact_overlap_share=round(vm.overlap / max(1, len(d)), 4),
        chat_template={"target": bool(getattr(tt, "chat_template", None)),
                       "draft": bool(getattr(dt, "chat_template", None)),
                       "same": getattr(tt, "chat_template", None) == getattr(dt, "chat_template", None)},
        sample_split={"text": SAMPLE_TEXT, "target": len(t.encode(SAMPLE_TEXT)),
                      "draft": len(d.encode(SAMPLE_TEXT)),
                      "round_trip": d.bytes_of(d.encode(SAMPLE_TEXT)) == SAMPLE_TEXT.encode()
                      and t.bytes_of(t.encode(SAMPLE_TEXT)) == SAMPLE_TEXT.encode()})
    return out

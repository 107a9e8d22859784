"""Paired speed ratios between methods of one bench run, per subtask and overall.

For each prompt (and turn) that both methods ran, the ratio is seconds(B) / seconds(A) — how
many times faster A was than B on that same prompt in the same run — and a cell is the
median over prompts. Usage:

    python benchmarks/paired_ratios.py benchmarks/<run>/records.jsonl A/B [C/D ...]

e.g. ``hybrid/draft prompt-lookup/hf-pld``. Prints a markdown table.
"""

from __future__ import annotations

import json
import statistics
import sys


def main(path: str, pairs: list[str]) -> None:
    records = [json.loads(line) for line in open(path) if line.strip()]
    key = lambda r: (r["subtask"], r["prompt_id"], r["turn"])  # noqa: E731
    seconds = {(r["method"],) + key(r): r["seconds"] for r in records}
    methods = {r["method"] for r in records}
    subtasks = sorted({r["subtask"] for r in records})

    def ratio(a: str, b: str, subtask: str | None = None) -> str:
        out = [seconds[(b,) + key(r)] / r["seconds"] for r in records
               if r["method"] == a and (subtask is None or r["subtask"] == subtask)
               and (b,) + key(r) in seconds]
        return f"{statistics.median(out):.2f}×" if out else "—"

    print("| pair | " + " | ".join(subtasks) + " | overall |")
    print("|---" * (len(subtasks) + 2) + "|")
    for pair in pairs:
        a, _, b = pair.partition("/")
        if a not in methods or b not in methods:
            raise SystemExit(f"{pair!r}: methods must be two of {sorted(methods)}, as A/B")
        print(f"| {a} / {b} | " + " | ".join(ratio(a, b, s) for s in subtasks) + f" | {ratio(a, b)} |")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2:])

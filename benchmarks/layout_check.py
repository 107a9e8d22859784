"""Compare two bench runs of the same command at two commits (issue 15's check that a change
of layout changed no output and no speed): identical token ids per generation, and per
prompt the ratio of each method's speedup over ``ar`` in one run to the same in the other
(both measured against plain decoding in their own run, so drift between runs cancels).

    python benchmarks/layout_check.py benchmarks/2026-12-01-layout-after benchmarks/2026-12-01-layout-before

A ``translation-rerun`` folder inside a run replaces that run's translation records (the
first translation prompt of the "after" run met another process on the machine).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def load(run: Path) -> dict:
    def read(p: Path) -> dict:
        return {(r["method"], r["subtask"], r["prompt_id"], r["turn"]): r
                for r in map(json.loads, p.read_text().splitlines())}
    records = read(run / "records.jsonl")
    rerun = run / "translation-rerun" / "records.jsonl"
    if rerun.exists():
        records = {k: v for k, v in records.items() if k[1] != "translation"} | read(rerun)
    return records


def main(a: str, b: str) -> None:
    new, old = load(Path(a)), load(Path(b))
    common = sorted(set(new) & set(old))
    same = sum(new[k]["token_ids"] == old[k]["token_ids"] for k in common)
    bad = [sum(r["identical"] is False for r in recs.values()) for recs in (new, old)]
    print(f"{len(common)} generations in both; identical token ids: {same}; lossless-check "
          f"mismatches: {bad[0]} and {bad[1]}")

    def tps(r):
        return r["new_tokens"] / r["seconds"]

    print("| method | speedup vs ar, A | speedup vs ar, B | A/B per prompt: median (min–max) |")
    print("|---|---|---|---|")
    for m in sorted({k[0] for k in common} - {"ar"}):
        keys = [k for k in common if k[0] == m]
        ra = [tps(new[k]) / tps(new[("ar",) + k[1:]]) for k in keys]
        rb = [tps(old[k]) / tps(old[("ar",) + k[1:]]) for k in keys]
        pair = [x / y for x, y in zip(ra, rb)]
        print(f"| {m} | {statistics.median(ra):.2f}× | {statistics.median(rb):.2f}× | "
              f"{statistics.median(pair):.3f} ({min(pair):.2f}–{max(pair):.2f}) |")
    ar = [tps(new[k]) / tps(old[k]) for k in common if k[0] == "ar"]
    print(f"| ar tokens/s A/B | | | {statistics.median(ar):.3f} ({min(ar):.2f}–{max(ar):.2f}) |")


if __name__ == "__main__":
    main(*sys.argv[1:3])

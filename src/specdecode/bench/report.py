"""The bench's report: per method × subtask summaries, markdown tables and a chart."""

from __future__ import annotations

import statistics
from pathlib import Path

from ..methods import PLAIN
from .workloads import SPEC_BENCH_SUBTASKS

BASES = (PLAIN, "hf-ar", "llamacpp-ar")  # the methods speedups are quoted against
SPEC_BENCH = "spec_bench"  # the group of Spec-Bench's six subtasks, when the run has more


def spec_bench_speedup(records: list, base: list) -> float | None:
    """Speedup as Spec-Bench's own evaluation computes it (hemingkx/Spec-Bench,
    evaluation/speed.py): per question, its turns' new tokens over their seconds (prefill
    included); the mean of that over the questions, over the same mean of ``base``'s
    records. Only questions both ran count. Unlike the median of per-prompt ratios, long
    answers (high tokens/s) weigh more than short ones. None when no question is shared."""
    def speeds(rs):
        q: dict[tuple, list[float]] = {}
        for r in rs:
            t = q.setdefault((r.subtask, r.prompt_id), [0, 0.0])
            t[0] += r.new_tokens
            t[1] += r.seconds
        return {k: tokens / seconds for k, (tokens, seconds) in q.items() if seconds > 0}
    ours, theirs = speeds(records), speeds(base)
    shared = [k for k in ours if k in theirs]
    if not shared:
        return None
    return statistics.fmean(ours[k] for k in shared) / statistics.fmean(theirs[k] for k in shared)


def _in_group(subtask: str, group: str) -> bool:
    return group == "overall" or subtask == group or (group == SPEC_BENCH and subtask in SPEC_BENCH_SUBTASKS)


def summarize(records: list) -> dict:
    """Per method × subtask (and "overall"; and "spec_bench", Spec-Bench's six subtasks
    together, when the run has other workloads too) of the run's records: tokens/s median
    and mean, speedup vs ar, hf-ar and llamacpp-ar (median of per-generation ratios),
    speedup vs ar as Spec-Bench computes it (:func:`spec_bench_speedup`), mean acceptance
    length, acceptance rate, time shares, mismatches, and ``lossy`` (the method changes the
    output by design: its mismatches are not a bug, and it has no lossless check)."""
    by_key = {(r.method, r.subtask, r.prompt_id, r.turn): r for r in records}
    out: dict[str, dict[str, dict]] = {}
    subtasks = sorted({r.subtask for r in records})
    groups = subtasks + ([SPEC_BENCH] if any(s in SPEC_BENCH_SUBTASKS for s in subtasks)
                         and not all(s in SPEC_BENCH_SUBTASKS for s in subtasks) else []) + ["overall"]
    for method in dict.fromkeys(r.method for r in records):
        out[method] = {}
        for sub in groups:
            rs = [r for r in records if r.method == method and _in_group(r.subtask, sub)]
            if not rs:
                continue
            row = {"n": len(rs),
                   "tokens_per_second_median": statistics.median(r.tokens_per_second for r in rs),
                   "tokens_per_second_mean": statistics.fmean(r.tokens_per_second for r in rs)}
            for base in BASES:
                ratios = [r.tokens_per_second / b.tokens_per_second for r in rs
                          if (b := by_key.get((base, r.subtask, r.prompt_id, r.turn))) and b.tokens_per_second]
                row[f"speedup_vs_{base}"] = statistics.median(ratios) if ratios else None
            # the same without prefill (which speculation cannot speed up): decode time only
            ratios = [(b.seconds - b.prefill_s) / (r.seconds - r.prefill_s) for r in rs
                      if r.prefill_s is not None and r.seconds > r.prefill_s
                      and (b := by_key.get((PLAIN, r.subtask, r.prompt_id, r.turn)))
                      and b.prefill_s is not None and b.new_tokens == r.new_tokens]
            row["decode_speedup_vs_ar"] = statistics.median(ratios) if ratios else None
            row["spec_bench_speedup_vs_ar"] = spec_bench_speedup(
                rs, [r for r in records if r.method == PLAIN and _in_group(r.subtask, sub)])
            row["prefill_share"] = (sum(r.prefill_s for r in rs) / sum(r.seconds for r in rs)
                                    if all(r.prefill_s is not None for r in rs) else None)
            passes = sum(r.num_verify_passes or 0 for r in rs)
            proposed = sum(r.num_draft_tokens or 0 for r in rs)
            accepted = sum(r.num_accepted_tokens or 0 for r in rs)
            seconds = sum(r.seconds for r in rs)
            # tokens per verify pass (a stop on an accepted draft token leaves its block without a bonus)
            row["mean_acceptance_length"] = sum(r.new_tokens for r in rs) / passes if passes else None
            row["acceptance_rate"] = accepted / proposed if proposed else None
            row["draft_share"] = (sum(r.draft_s or 0 for r in rs) / seconds
                                  if rs[0].draft_s is not None and seconds else None)
            row["verify_share"] = (sum(r.verify_s or 0 for r in rs) / seconds
                                   if rs[0].verify_s is not None and seconds else None)
            checked = [r for r in rs if r.identical is not None]
            row["mismatches"] = sum(not r.identical for r in checked) if checked else None
            row["lossy"] = any(r.lossy for r in rs)
            out[method][sub] = row
    return out


def _groups(summary: dict) -> list[str]:
    """The summary's subtasks in order, then its "spec_bench" and "overall" groups."""
    groups = {s for rows in summary.values() for s in rows}
    return sorted(groups - {SPEC_BENCH, "overall"}) + [g for g in (SPEC_BENCH, "overall") if g in groups]


def _gib(v) -> str:
    return "—" if v is None else f"{v / 2**30:.2f} GiB"


def _fmt(v, spec=".2f", suffix=""):
    return "—" if v is None else f"{v:{spec}}{suffix}"


def markdown_table(summary: dict, ceilings: dict[str, float | None], subtask: str = "overall") -> str:
    """The run's table for ``subtask``: one row per method; a column that no method fills
    (a peer not in the run, memory not measured) is left out."""
    columns = [  # (header, cell of a row r of method m)
        ("tok/s (median)", lambda m, r: f"{r['tokens_per_second_median']:.2f}"),
        ("speedup vs ar*", lambda m, r: _fmt(r["speedup_vs_ar"], ".2f", "×")),
        ("speedup vs hf-ar*", lambda m, r: _fmt(r["speedup_vs_hf-ar"], ".2f", "×")),
        ("vs llamacpp-ar*", lambda m, r: _fmt(r["speedup_vs_llamacpp-ar"], ".2f", "×")),
        ("ceiling", lambda m, r: _fmt(ceilings.get(m), ".2f", "×")),
        ("τ", lambda m, r: _fmt(r["mean_acceptance_length"])),
        ("acceptance", lambda m, r: _fmt(r["acceptance_rate"], ".0%")),
        ("draft / verify time", lambda m, r: f"{r['draft_share']:.0%} / {r['verify_share']:.0%}"
         if r["draft_share"] is not None else "—"),
        ("mismatches", lambda m, r: "lossy‡" if r.get("lossy") else _fmt(r["mismatches"], "d")),
        ("peak memory†", lambda m, r: _gib(r.get("peak_memory_bytes"))),
    ]
    rows = [(m, by[subtask]) for m, by in summary.items() if subtask in by]
    cells = [[cell(m, r) for _, cell in columns] for m, r in rows]
    keep = [i for i in range(len(columns)) if any(c[i] != "—" for c in cells)]
    lines = ["| method | " + " | ".join(columns[i][0] for i in keep) + " |", "|---" * (len(keep) + 1) + "|"]
    lines += [f"| {m} | " + " | ".join(c[i] for i in keep) + " |" for (m, _), c in zip(rows, cells)]
    shown = {columns[i][0] for i in keep}
    notes = [note for header, note in (
        ("*", "\\* median over prompts of the per-prompt ratio (paired), not a ratio of medians (so it "
              "may fall below 1 while the median tokens/s is higher)"),
        ("ceiling", "ceiling = (K+1)·T(1)/T(K+1), a perfect free proposer"),
        ("τ", "τ = mean acceptance length"),
        ("†", "† peak resident memory of a process running the method alone (its models, one "
              "generation of the longest prompt)"),
        ("‡", "‡ lossy: the method changes the output by design (Medusa's typical acceptance, "
              "lossy-typical=): not checked against ar, and its speed is not a lossless method's"))
        if any(header in h for h in shown) or (header == "‡" and any("‡" in c for row in cells for c in row))]
    if notes:
        lines.append("\n" + "; ".join(notes))
    return "\n".join(lines)


def subtask_table(summary: dict, key: str = "speedup_vs_ar") -> str | None:
    """Per method and subtask, ``key`` (a ratio); None when no method has it (its reference
    not in the run)."""
    subtasks = _groups(summary)
    lines = ["| method | " + " | ".join(subtasks) + " |", "|---" * (len(subtasks) + 1) + "|"]
    filled = False
    for method, rows in summary.items():
        cells = [_fmt(rows.get(s, {}).get(key), ".2f", "×") for s in subtasks]
        filled = filled or any(c != "—" for c in cells)
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if filled else None


SPEC_BENCH_METRIC = ("the mean over questions of a question's tokens/s (its turns together, prefill "
                     "included) over ar's, as Spec-Bench's evaluation/speed.py computes its speedups")


def spec_bench_table(summary: dict) -> str | None:
    """Per method but ar, speedup vs ar as Spec-Bench computes it (:data:`SPEC_BENCH_METRIC`)
    on each of Spec-Bench's subtasks in the run and on them together ("spec_bench", or
    "overall" when the run has nothing else); None when the run has none of them or no ar."""
    keep = set(SPEC_BENCH_SUBTASKS) | {SPEC_BENCH}
    rows = {m: {s: row for s, row in by.items() if s in keep} for m, by in summary.items() if m != PLAIN}
    if not any(rows.values()):
        return None
    if not any(SPEC_BENCH in by for by in summary.values()):  # only Spec-Bench ran
        rows = {m: {**rows[m], "overall": by["overall"]} for m, by in summary.items() if m != PLAIN}
    return subtask_table(rows, "spec_bench_speedup_vs_ar")


def plot(summary: dict, ceilings: dict, path: Path) -> None:
    """Bar chart of speedup vs ar per subtask per method, the ceiling as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    subtasks = _groups(summary)
    methods = [m for m in summary if m != PLAIN]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(subtasks)), 4))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        vals = [summary[m].get(s, {}).get("speedup_vs_ar") or 0 for s in subtasks]
        ax.bar([x + i * width for x in range(len(subtasks))], vals, width, label=m)
    top = max((c for c in ceilings.values() if c), default=None)
    if top:
        ax.axhline(top, ls="--", color="grey", label=f"ceiling (perfect free proposer) {top:.2f}×")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(subtasks))], subtasks, rotation=20)
    ax.set_ylabel("speedup vs ar (median)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

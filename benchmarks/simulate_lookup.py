"""Replay recorded greedy outputs through the lookup proposers, without running any model.

For greedy decoding, whether a proposed token is accepted depends only on the target's own
greedy continuation, which a bench run records (``ar`` in results.json / records.jsonl). So a
lookup proposer's verify passes, mean acceptance length and — with the T(n) a bench run
measured — its speedup over plain decoding can be computed exactly for those prompts, and
proposer settings compared in seconds. Usage:

    python benchmarks/simulate_lookup.py benchmarks/<run>/results.json [more runs...]  (reads records.jsonl beside it)

Prints, per subtask and setting: τ (tokens per verify pass) and the predicted speedup
Σ T(1) / Σ T(k_round + 1) (lookup drafting cost ignored: it is microseconds).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from specdecode.bench import workloads
from specdecode.models import registry
from specdecode.proposers import PromptLookupProposer, RequestState, SuffixProposer
from specdecode.config import SamplingParams
from specdecode.schedule import AutoK, FixedK, HeuristicK


def replay(proposer, prompt: list[int], output: list[int], k, times: list[float], cost=None,
           max_new_tokens: int | None = None):
    """Replay one recorded greedy output through ``proposer``; returns (verify passes,
    speedup Σ T(1) / Σ round costs). k: an int (fixed K) or a schedule (reset / next_k /
    update). ``cost(proposal, n)``: a round's cost for a proposal of n tokens (default
    T(n+1) from ``times``: lookups cost nothing to propose). ``max_new_tokens``: the
    recorded run's (default: 65 more than the output)."""
    schedule = FixedK(k) if isinstance(k, int) else k
    schedule.reset()
    state = RequestState(list(prompt), 0, SamplingParams(), (), None, 1 << 30)
    proposer.reset(state, len(prompt) + (max_new_tokens or len(output) + 65))
    passes, total, i = 0, 0.0, 0
    while i < len(output):
        kr = min(schedule.next_k(), len(output) - i)
        proposal = proposer.propose(state, kr) if kr else None
        draft = proposal.token_ids[0].tolist() if proposal is not None else []
        if draft and proposal.free and hasattr(schedule, "trim"):  # as the engine does
            draft = draft[:schedule.trim(len(draft))]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == output[i + accepted]:
            accepted += 1
        n = min(accepted + 1, len(output) - i)
        state.tokens += output[i:i + n]
        state.num_generated += n
        proposer.on_accept(state)
        i += n
        passes += 1
        t = times[min(len(draft), len(times) - 1)]
        total += cost(proposal, len(draft)) if cost is not None else t
        schedule.update(len(draft), accepted, 0.0, t)
    return passes, len(output) * times[0] / total


def load_cases(records: list[dict], tok) -> list[tuple[str, str, int, list[int], list[int]]]:
    """(subtask, prompt id, turn, prompt ids, recorded output) of every ``ar`` record, the
    prompt rebuilt as the bench built it (a second turn after ``ar``'s own first answer)."""
    tasks = {(t.subtask, t.prompt_id): t for t in
             workloads.load_spec_bench(workloads.SPEC_BENCH_PATH) + workloads.load_humaneval()
             + workloads.load_code_edit()}
    answers: dict = {}
    cases = []
    for r in sorted((r for r in records if r["method"] == "ar"), key=lambda r: r["turn"]):
        key = (r["subtask"], r["prompt_id"])
        prompt = workloads.prompt_ids(tok, tasks[key], r["turn"], answers.get(key, []))
        answers.setdefault(key, []).append(tok.decode(r["token_ids"], skip_special_tokens=True))
        cases.append((*key, r["turn"], prompt, r["token_ids"]))
    return cases


def main(paths: list[str]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(registry.fetch(registry.DEFAULT_TARGET))
    records, times = [], None
    for p in paths:
        p = Path(p)
        if p.suffix == ".json":
            data = json.loads(p.read_text())
            times = data["limit"]["forward_seconds"]
            log = p.with_name("records.jsonl")  # results.json holds no records: they are beside it
            records += [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        else:
            records += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    if times is None:
        raise SystemExit("give at least one results.json (for T(n))")
    cases = [(sub, prompt, out) for sub, _, _, prompt, out in load_cases(records, tok)]
    settings = {
        "prompt-lookup (default: recent, n=5..2, K=16)": lambda: (PromptLookupProposer(5, 2, "recent"), 16),
        "prompt-lookup, first match": lambda: (PromptLookupProposer(5, 2, "first"), 16),
        "prompt-lookup, n=3..1 (the earlier default)": lambda: (PromptLookupProposer(3, 1, "recent"), 16),
        "prompt-lookup, n=3..1, first match": lambda: (PromptLookupProposer(3, 1, "first"), 16),
        "prompt-lookup, n=5..1": lambda: (PromptLookupProposer(5, 1, "recent"), 16),
        "prompt-lookup, n=3..2": lambda: (PromptLookupProposer(3, 2, "recent"), 16),
        "prompt-lookup, K=8": lambda: (PromptLookupProposer(5, 2, "recent"), 8),
        "prompt-lookup, K=4": lambda: (PromptLookupProposer(5, 2, "recent"), 4),
        "prompt-lookup, K heuristic": lambda: (PromptLookupProposer(5, 2), HeuristicK(16)),
        "prompt-lookup, K auto": lambda: (PromptLookupProposer(5, 2), AutoK(times)),
        "suffix (default: min_confidence 0.1, K=16)": lambda: (SuffixProposer(16, 0.1), 16),
        "suffix, min_confidence 0.3": lambda: (SuffixProposer(16, 0.3), 16),
        "suffix, K=8": lambda: (SuffixProposer(16, 0.1), 8),
        "suffix, K auto": lambda: (SuffixProposer(16, 0.1), AutoK(times)),
    }
    subtasks = sorted({c[0] for c in cases})
    print(f"{len(cases)} recorded generations; T(1) = {times[0] * 1e3:.0f} ms")
    print("| setting | " + " | ".join(subtasks) + " | all |")
    print("|---" * (len(subtasks) + 2) + "|")
    for name, make in settings.items():
        cells, allr = [], []
        for sub in subtasks:
            rs = []
            for s, prompt, out in cases:
                if s == sub and out:
                    proposer, k = make()
                    passes, speedup = replay(proposer, prompt, out, k, times)
                    rs.append((len(out) / passes, speedup))
            allr += rs
            cells.append(f"{statistics.median(x[0] for x in rs):.2f} / {statistics.median(x[1] for x in rs):.2f}×")
        cells.append(f"{statistics.median(x[0] for x in allr):.2f} / {statistics.median(x[1] for x in allr):.2f}×")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])

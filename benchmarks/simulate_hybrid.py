"""Replay the hybrid's choices on recorded greedy outputs, at no bench noise.

A greedy request's output does not depend on the proposer, so for every position of a
recorded `ar` output two things are fixed: how many tokens the (int8) draft model's greedy
continuation would get accepted there, and what the suffix matcher would propose. Step 1
measures the first by running the draft at every position (cached in ``--cache``, ~15 s a
prompt). Step 2 replays the real ``HybridProposer`` on them, with a stand-in draft model
that drafts what the draft model would, and adds up each round's modelled cost (the
target's and the draft's profiled forward times, as the hybrid itself uses), for the hybrid
with each combination of ``--margins`` (``HybridProposer.LOOKUP_MARGIN``), ``--explore``
(``EXPLORE``) and ``--prior`` (``DRAFT_PRIOR_ALPHA``), beside the draft model alone at K = 6
and prompt lookup. Prints decode-only modelled speedups over plain decoding: medians per
subtask, overall, and the geometric mean. ``VERBOSE=1`` prints every round (source, length,
accepted). Usage:

    python benchmarks/simulate_hybrid.py benchmarks/<run>/records.jsonl --limit 2 \
        --margins 1,1.3 --explore 0,0.03

``--limit`` must be the run's, so that its prompts are rebuilt as the bench built them
(mt_bench's second turn is skipped). The draft model's numerics depend on how its input is
chunked (int8), so a real run's rounds drift from the replay's: a guide, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from specdecode import bench, registry
from specdecode.config import SamplingParams
from specdecode.proposers import DraftOutput, HybridProposer, PromptLookupProposer, RequestState, SuffixProposer
from specdecode.schedule import verify_profile

DRAFT_K = 6
VERBOSE = bool(os.environ.get("VERBOSE"))


def tasks_by_key(limit: int) -> dict:
    tasks = bench.load_spec_bench(bench.SPEC_BENCH_PATH, limit) + bench.load_humaneval(limit) \
        + bench.load_code_edit(limit)
    return {(t.subtask, t.prompt_id): t for t in tasks}


@torch.inference_mode()
def draft_accepts(lm, prompt: list[int], out: list[int]) -> list[int]:
    """a[j]: tokens of the draft's greedy continuation after prompt + out[:j] that equal out."""
    tokens = prompt + out
    lm.allocate(1, len(tokens) + DRAFT_K + 2)
    lm.forward(torch.tensor([prompt[:-1]]), num_logits=0)
    accepts = []
    for j in range(len(out)):
        n = len(prompt) + j  # cache holds tokens[:n-1]
        feed, a = tokens[n - 1], 0
        for i in range(DRAFT_K):
            guess = int(lm.forward(torch.tensor([[feed]]), num_logits=1)[0, -1].argmax())
            if n + i >= len(tokens) or guess != tokens[n + i]:
                break
            a, feed = a + 1, guess
        accepts.append(a)
        lm.rollback(n)
    return accepts


class ReplayDraft:
    """Stands in for DraftModelProposer: drafts out's next tokens as far as the draft model's
    greedy continuation would match them, then a wrong token."""

    def __init__(self, prompt_len: int, out: list[int], accepts: list[int]):
        self.prompt_len, self.out, self.accepts = prompt_len, out, accepts
        self.enabled, self.lazy_prefill, self.seq_len = True, True, 0
        self.draft = self
        self.fed = 0  # committed tokens the draft has processed (its prefill and catch-ups)

    def reset(self, state, max_total_len):
        self.seq_len = self.fed = 0

    def propose(self, state, d):
        n = len(state.tokens)
        j = n - self.prompt_len
        a = min(d, self.accepts[j])
        toks = self.out[j:j + a] + [(self.out[j + a] + 1) % 1000 if j + a < len(self.out) else 0] * (d - a)
        self.caught_up = n - 1 - self.fed
        self.fed = n - 1
        return DraftOutput(torch.tensor([toks[:d]]), torch.zeros(1, d, 1), "draft")

    def on_accept(self, state):
        self.fed = min(self.fed, len(state.tokens) - 1)
        self.seq_len = self.fed


def replay(proposer, prompt: list[int], out: list[int], k: int, cost) -> float:
    """Modelled decode time (units of T(1)) of greedy speculative decoding with ``proposer``."""
    state = RequestState(list(prompt), 0, SamplingParams(max_new_tokens=len(out)), (), None, 1 << 30)
    proposer.reset(state, len(prompt) + len(out))
    total, rounds = 0.0, []
    while len(state.tokens) < len(prompt) + len(out):
        j = len(state.tokens) - len(prompt)
        draft = proposer.propose(state, min(k, len(out) - j - 1))
        toks = draft.token_ids[0].tolist()
        acc = 0
        while acc < len(toks) and toks[acc] == out[j + acc]:
            acc += 1
        total += cost(draft.source, len(toks), proposer)
        rounds.append((draft.source[:1], len(toks), acc))
        state.tokens += out[j:j + acc + 1]
        state.num_generated = len(state.tokens) - len(prompt)
        proposer.on_accept(state)
    if VERBOSE:
        print(f"  {type(proposer).__name__}: {len(rounds)} rounds, cost {total:.1f}:",
              " ".join(f"{s}{n}/{a}" for s, n, a in rounds))
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records")
    p.add_argument("--margins", default="1", help="HybridProposer.LOOKUP_MARGIN values")
    p.add_argument("--prior", default="0.7", help="HybridProposer.DRAFT_PRIOR_ALPHA values")
    p.add_argument("--explore", default="0.03", help="HybridProposer.EXPLORE values")
    p.add_argument("--limit", type=int, default=5, help="the run's --limit (to rebuild its prompts)")
    p.add_argument("--cache", default=str(registry.cache_dir() / "draft_accepts.json"),
                   help="where step 1's results are kept (default: %(default)s)")
    args = p.parse_args()
    records = [json.loads(line) for line in open(args.records) if line.strip()]
    refs = {(r["subtask"], r["prompt_id"]): r["token_ids"] for r in records
            if r["method"] == "ar" and r["turn"] == 0}
    tasks = tasks_by_key(args.limit)
    models = bench.BenchModels(registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT, "float32")
    target, draft = models.target(), models.draft("int8")
    cache_path = Path(args.cache)
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    prompts = {}
    for key, out in refs.items():
        prompt = bench._prompt_ids(target.tokenizer, tasks[key], 0, [])
        prompts[key] = prompt
        name = f"{key[0]}/{key[1]}/{len(prompt)}/{len(out)}"
        if name not in cache:
            cache[name] = draft_accepts(draft.lm, prompt, out)
            cache_path.write_text(json.dumps(cache))
    times = verify_profile(target, 16)
    vc = [t / times[0] for t in times]
    c_draft = verify_profile(draft, 0)[0] / times[0]

    def t(n):
        return vc[n - 1] if n <= len(vc) else vc[-1] + (vc[-1] - vc[0]) / (len(vc) - 1) * (n - len(vc))

    def cost(source, n, proposer):
        if source == "draft":
            d = proposer.drafter if isinstance(proposer, HybridProposer) else proposer
            return n * c_draft + t(n + 1) + d.caught_up * 0.008
        return t(n + 1)

    rows: dict[str, dict[str, list[float]]] = {}
    for key, out in refs.items():
        prompt = prompts[key]
        accepts = cache[f"{key[0]}/{key[1]}/{len(prompt)}/{len(out)}"]
        ar = len(out) * 1.0
        if VERBOSE:
            print(key)
        res = {}
        d = ReplayDraft(len(prompt), out, accepts)
        res["draft"] = ar / replay(d, prompt, out, DRAFT_K, cost)
        res["prompt-lookup"] = ar / replay(PromptLookupProposer(), prompt, out, 16, cost)
        for m in args.margins.split(","):
            for e, a in ((e, a) for e in args.explore.split(",") for a in args.prior.split(",")):
                HybridProposer.LOOKUP_MARGIN, HybridProposer.EXPLORE = float(m), float(e)
                HybridProposer.DRAFT_PRIOR_ALPHA = float(a)
                h = HybridProposer(SuffixProposer(), ReplayDraft(len(prompt), out, accepts), verify_cost=vc,
                                   draft_cost=c_draft)
                res[f"hybrid margin={m} explore={e} prior={a}"] = ar / replay(h, prompt, out, 16, cost)
        for name, v in res.items():
            rows.setdefault(name, {}).setdefault(key[0], []).append(v)
    subtasks = sorted({k[0] for k in refs})
    print("| method | " + " | ".join(subtasks) + " | overall | geometric mean |")
    print("|---" * (len(subtasks) + 3) + "|")
    for name, by in rows.items():
        allv = [v for vs in by.values() for v in vs]
        print(f"| {name} | " + " | ".join(f"{statistics.median(by[s]):.2f}×" for s in subtasks)
              + f" | {statistics.median(allv):.2f}× | {statistics.geometric_mean(allv):.3f}× |")


if __name__ == "__main__":
    main()

"""Replay the hybrid's choices on recorded greedy outputs, at no bench noise.

A greedy request's output does not depend on the proposer, so for every position of a
recorded `ar` output two things are fixed: how many tokens the draft model's greedy
continuation would get accepted there, and what the suffix matcher would propose. Step 1
measures the first by running the draft at every position (cached in ``--cache``, ~15 s a
prompt). Step 2 replays the real ``HybridProposer`` on them, with a stand-in draft model
that drafts what the draft model would, and adds up each round's modelled cost (the
target's and the draft's profiled forward times, as the hybrid itself uses), for the hybrid
with each combination of ``--margins`` (``HybridTuning.lookup_margin``), ``--explore``
(``explore``), ``--prior`` (``draft_prior_alpha``), ``--cold`` (``cold_margin``) and
``--horizon`` (``horizon``), the draft's feeds charged at its measured prefill cost (or
``--prefill-cost``) and the hybrid told that (or ``--told-cost``),
beside the draft model alone at K = 6 and prompt lookup. Prints decode-only modelled
speedups over plain decoding: medians per subtask, overall, and the geometric mean. Usage:

    python benchmarks/simulate_hybrid.py benchmarks/<run>/records.jsonl --margins 1,1.3 --explore 0,0.03

Prompts (both turns) and the replay loop are ``simulate_lookup.py``'s. The draft model's
numerics depend on how its input is chunked (int8), so a real run's rounds drift from the
replay's: a guide, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch

from simulate_lookup import load_cases, replay
from specdecode.bench.runners import BenchModels
from specdecode.models import registry
from specdecode.proposers import DraftOutput, HybridProposer, HybridTuning, PromptLookupProposer, Proposer, SuffixProposer
from specdecode.profile import prefill_profile, verify_profile

DRAFT_K = 6


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


class ReplayDraft(Proposer):
    """Stands in for DraftModelProposer: drafts out's next tokens as far as the draft model's
    greedy continuation would match them, then a wrong token; ``caught_up``: the committed
    tokens its last round had to feed first (its lazy prefill, then what lookups skipped)."""

    name = "draft"
    reads_guess = True

    def __init__(self, prompt_len: int, out: list[int], accepts: list[int]):
        self.prompt_len, self.out, self.accepts = prompt_len, out, accepts
        self.seq_len = 0
        self.fed = self.caught_up = 0

    def unseen(self, state):
        return max(0, len(state.tokens) - 1 - self.seq_len)

    def reset(self, state, max_total_len):
        self.seq_len = self.fed = 0

    def propose(self, state, d):
        return self.propose_with_guess(state, d, [])

    def propose_with_guess(self, state, d, guess):
        """As DraftModelProposer.propose_with_guess (greedy, p_min not modelled): with a guess, the
        draft's continuation as far as it agrees with the guess, then on to d tokens."""
        n = len(state.tokens)
        j = n - self.prompt_len
        if guess:
            agreed = 0
            while agreed < min(len(guess), self.accepts[j]) and guess[agreed] == self.out[j + agreed]:
                agreed += 1
            d = max(d, agreed + 1)
        a = min(d, self.accepts[j])
        wrong = (self.out[j + a] + 1) % 1000 if j + a < len(self.out) else 0
        toks = (self.out[j:j + a] + [wrong] * (d - a))[:d]
        self.caught_up, self.fed = n - 1 - self.fed, n - 1
        return DraftOutput(torch.tensor([toks]), torch.zeros(1, d, 1), "draft")

    def on_accept(self, state):
        self.fed = min(self.fed, len(state.tokens) - 1)
        self.seq_len = self.fed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records")
    p.add_argument("--margins", default="1.3", help="HybridTuning.lookup_margin values")
    p.add_argument("--prior", default="0.7", help="HybridTuning.draft_prior_alpha values")
    p.add_argument("--explore", default="0.03", help="HybridTuning.explore values")
    p.add_argument("--cold", default="1.1", help="HybridTuning.cold_margin values")
    p.add_argument("--cache", default=str(registry.cache_dir() / "draft_accepts.json"),
                   help="where step 1's results are kept (default: %(default)s)")
    p.add_argument("--prefill-cost", type=float, default=None,
                   help="the draft's prefill per token / T(1), charged (default: the draft's "
                        "measured one, which the hybrid method is told)")
    p.add_argument("--told-cost", type=float, default=None,
                   help="the prefill cost told to the hybrid (default: the charged one)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="the recorded run's (default: 65 more than each output)")
    p.add_argument("--horizon", default=str(HybridTuning.horizon), help="HybridTuning.horizon values")
    p.add_argument("--dtype", default="auto", help="the target's dtype (that of the run recorded)")
    p.add_argument("--draft-dtype", default="auto", help="the draft's dtype (default: load()'s)")
    args = p.parse_args()
    records = [json.loads(line) for line in open(args.records) if line.strip()]
    models = BenchModels(registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT, args.dtype)
    target, draft = models.target(), models.draft(args.draft_dtype)
    cases = load_cases(records, target.tokenizer)
    cache_path = Path(args.cache)
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    accepts = []
    for sub, pid, _, prompt, out in cases:
        name = f"{sub}/{pid}/{len(prompt)}/{len(out)}/{draft.lm.weight_format}"
        if name not in cache:
            cache[name] = draft_accepts(draft.lm, prompt, out)
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            cache_path.write_text(json.dumps(cache))
        accepts.append(cache[name])
    times = verify_profile(target, 16)
    vc = [t / times[0] for t in times]  # T(n)/T(1): every cost in units of T(1)
    c_draft = verify_profile(draft, 0)[0] / times[0]
    prefill_cost = prefill_profile(draft) / times[0] if args.prefill_cost is None else args.prefill_cost
    told = prefill_cost if args.told_cost is None else args.told_cost
    print(f"draft prefill charged at {prefill_cost:.4f} T(1) a token, told {told:.4f}; a draft step "
          f"{c_draft:.3f} T(1)")

    def cost_of(drafter: ReplayDraft):
        def cost(proposal, n):
            t = vc[min(n, len(vc) - 1)]
            if proposal is not None and proposal.source == "draft":
                return n * c_draft + t + drafter.caught_up * prefill_cost
            return t
        return cost

    rows: dict[str, dict[str, list[float]]] = {}
    for (sub, _, _, prompt, out), acc in zip(cases, accepts):
        if not out:
            continue
        res = {}
        d = ReplayDraft(len(prompt), out, acc)
        res["draft"] = replay(d, prompt, out, DRAFT_K, vc, cost_of(d))[1]
        res["prompt-lookup"] = replay(PromptLookupProposer(), prompt, out, 16, vc)[1]
        for m in args.margins.split(","):
            for e, a, b, hz in ((e, a, b, hz) for e in args.explore.split(",") for a in args.prior.split(",")
                                for b in args.cold.split(",") for hz in args.horizon.split(",")):
                tuning = dataclasses.replace(HybridTuning(), lookup_margin=float(m), explore=float(e),
                                             draft_prior_alpha=float(a), cold_margin=float(b),
                                             horizon=int(hz))
                d = ReplayDraft(len(prompt), out, acc)
                h = HybridProposer(SuffixProposer(), d, verify_cost=vc, draft_cost=c_draft,
                                   draft_prefill_cost=told, tuning=tuning)
                res[f"hybrid margin={m} explore={e} prior={a} cold={b} horizon={hz}"] = \
                    replay(h, prompt, out, 16, vc, cost_of(d), args.max_new_tokens)[1]
        for name, v in res.items():
            rows.setdefault(name, {}).setdefault(sub, []).append(v)
    subtasks = sorted({c[0] for c in cases})
    print("| method | " + " | ".join(subtasks) + " | overall | geometric mean |")
    print("|---" * (len(subtasks) + 3) + "|")
    for name, by in rows.items():
        allv = [v for vs in by.values() for v in vs]
        print(f"| {name} | " + " | ".join(f"{statistics.median(by[s]):.2f}×" for s in subtasks)
              + f" | {statistics.median(allv):.2f}× | {statistics.geometric_mean(allv):.3f}× |")


if __name__ == "__main__":
    main()

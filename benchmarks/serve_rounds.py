"""`specdecode bench-serve` at one concurrency with every batched round logged: its rows,
whether it speculated and was a trial of the guard (batch.MeasuredRates), its tokens and
seconds, and every draft-model pass of the batch's rows (each row's tokens, seconds). Writes
OUT/rounds.json beside the bench's own files and prints the rounds per (rows, kind)
(BENCHMARKS.md section 7h): `python benchmarks/serve_rounds.py CONCURRENCY REQUESTS OUT`."""

import collections, json, sys, time
from specdecode import batch
from specdecode.cli import main

concurrency, requests, out = sys.argv[1], sys.argv[2], sys.argv[3]
rounds, drafts = [], []
record, run = batch.MeasuredRates.record, batch.DraftRows.run


def logged_record(self, rows, speculative, tokens, seconds):
    rounds.append((rows, speculative, speculative and self.trial, tokens, seconds))
    record(self, rows, speculative, tokens, seconds)


def logged_run(self, passes):
    t0 = time.perf_counter()
    logits = run(self, passes)
    drafts.append(([p[1].shape[1] for p in passes], time.perf_counter() - t0))
    return logits


batch.MeasuredRates.record, batch.DraftRows.run = logged_record, logged_run
main(["bench-serve", "--concurrency", concurrency, "--requests", requests, "--max-tokens", "64", "--out", out])
with open(f"{out}/rounds.json", "w") as f:
    json.dump({"rounds": rounds, "draft_passes": drafts}, f)
kinds = collections.defaultdict(lambda: [0, 0, 0.0])
for rows, spec, trial, tokens, seconds in rounds:
    k = kinds[(rows, spec, trial)]
    k[0], k[1], k[2] = k[0] + 1, k[1] + tokens, k[2] + seconds
print("rows speculative trial rounds tokens seconds tokens/s")
for (rows, spec, trial), (n, tokens, seconds) in sorted(kinds.items()):
    print(rows, spec, trial, n, tokens, round(seconds, 2), round(tokens / seconds, 1))
long = [s for sizes, s in drafts if max(sizes) > batch.SMALL_PASS]
print(f"draft passes {len(drafts)} ({sum(s for _, s in drafts):.2f} s), of which feeds of more than "
      f"{batch.SMALL_PASS} tokens {len(long)} ({sum(long):.2f} s); all rounds {sum(r[4] for r in rounds):.2f} s")

"""`specdecode bench-serve` at one concurrency with every batched round logged: the method of
its block, its rows, whether it speculated and was a trial of the guard (batch.MeasuredRates),
its tokens and seconds, and every draft-model pass of the batch's rows (each row's tokens,
seconds). Writes OUT/rounds.json beside the bench's own files and prints the rounds per
(method, rows, kind) and the draft passes per method (BENCHMARKS.md sections 7h, 7i):
`python benchmarks/serve_rounds.py CONCURRENCY REQUESTS OUT [REPEATS]`."""

import collections, json, sys, time
from specdecode import batch
from specdecode.bench import serving
from specdecode.cli import main

concurrency, requests, out = sys.argv[1], sys.argv[2], sys.argv[3]
repeats = sys.argv[4] if len(sys.argv) > 4 else "1"
rounds, drafts, block = [], [], ["?"]
record, run, run_level = batch.MeasuredRates.record, batch.DraftRows.run, serving.run_level


def logged_record(self, rows, speculative, tokens, seconds):
    rounds.append((block[0], rows, speculative, speculative and self.trial, tokens, seconds))
    record(self, rows, speculative, tokens, seconds)


def logged_run(self, passes):
    t0 = time.perf_counter()
    logits = run(self, passes)
    drafts.append((block[0], [p[1].shape[1] for p in passes], time.perf_counter() - t0))
    return logits


def logged_level(url, model, prompts, method, *args, **kwargs):
    block[0] = method
    return run_level(url, model, prompts, method, *args, **kwargs)


batch.MeasuredRates.record, batch.DraftRows.run, serving.run_level = logged_record, logged_run, logged_level
main(["bench-serve", "--concurrency", concurrency, "--requests", requests, "--max-tokens", "64",
      "--repeats", repeats, "--out", out])
with open(f"{out}/rounds.json", "w") as f:
    json.dump({"rounds": rounds, "draft_passes": drafts}, f)
kinds = collections.defaultdict(lambda: [0, 0, 0.0])
for method, rows, spec, trial, tokens, seconds in rounds:
    k = kinds[(method, rows, spec, trial)]
    k[0], k[1], k[2] = k[0] + 1, k[1] + tokens, k[2] + seconds
print("method rows speculative trial rounds tokens seconds ms/round")
for (method, rows, spec, trial), (n, tokens, seconds) in sorted(kinds.items()):
    print(method, rows, spec, trial, n, tokens, round(seconds, 2), round(1000 * seconds / n, 1))
for method in sorted({d[0] for d in drafts}):
    mine = [(sizes, s) for m, sizes, s in drafts if m == method]
    long = [s for sizes, s in mine if max(sizes) > batch.SMALL_PASS]
    print(f"{method}: draft passes {len(mine)} ({sum(s for _, s in mine):.2f} s), of which feeds of "
          f"more than {batch.SMALL_PASS} tokens {len(long)} ({sum(long):.2f} s); its rounds "
          f"{sum(r[5] for r in rounds if r[0] == method):.2f} s")

"""T(1..17) of a model (default: the default target) in one weight format (medians of 7, the sizes interleaved), its prefill time per token (256 tokens, median of 3), load time and peak RSS, in a process of its own:
`python benchmarks/forward_times.py q4|int8|int4|float32|bfloat16|llamacpp|llamacpp-all-logits [MODEL [ROLE]]` (BENCHMARKS.md section 0)."""

import json, resource, sys, time, torch
torch.set_num_threads(2)
kind = sys.argv[1]
if kind.startswith("llamacpp"):
    from specdecode.models import llamacpp, registry
    t0 = time.time()
    llm = llamacpp.load(sys.argv[2] if len(sys.argv) > 2 else registry.DEFAULT_TARGET, 2,
                        prompt_lookup=10 if kind == "llamacpp-all-logits" else 0)
    load_s = time.time() - t0
    ids = list(range(1000, 1300))
    def fwd(n):
        llm.n_tokens = 256
        t0 = time.perf_counter(); llm.eval(ids[256:256 + n]); return time.perf_counter() - t0
    def prefill():
        llm.reset(); t0 = time.perf_counter(); llm.eval(ids[:256]); return time.perf_counter() - t0
    prefill()
else:
    from specdecode.models.loading import load
    from specdecode.models import registry
    t0 = time.time()
    m = load(sys.argv[2] if len(sys.argv) > 2 else registry.DEFAULT_TARGET, dtype=kind, tokenizer=False, role=sys.argv[3] if len(sys.argv) > 3 else "target")
    load_s = time.time() - t0
    lm = m.lm
    lm.allocate(1, 400)
    ids = torch.randint(0, lm.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    def prefill():
        lm.rollback(0); t0 = time.perf_counter(); lm.forward(ids[:, :256], num_logits=0); return time.perf_counter() - t0
    prefill()
    def fwd(n):
        lm.rollback(256)
        t0 = time.perf_counter(); lm.forward(ids[:, 256:256 + n]); return time.perf_counter() - t0
sizes = (1, 2, 4, 8, 16, 17)
for n in sizes:
    fwd(n)
times = {n: [] for n in sizes}
for _ in range(7):  # the sizes interleaved: a machine that slows mid-run moves every T alike
    for n in sizes:
        times[n].append(fwd(n))
res = {n: sorted(ts)[3] for n, ts in times.items()}
prefill_s = sorted(prefill() for _ in range(3))[1]  # 256 tokens from an empty cache
print(json.dumps({"kind": kind, "load_s": round(load_s, 1), "T_ms": {n: round(v * 1e3, 1) for n, v in res.items()},
                  "prefill_ms_per_token": round(prefill_s / 256 * 1e3, 2),
                  "T8/T1": round(res[8] / res[1], 2), "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}))

"""Prefill time of the default target for prompts of 128, 512 and 1024 tokens, medians of 5,
2 threads, in a process of its own (BENCHMARKS.md, prefill):
`python benchmarks/prefill_times.py ours|llamacpp [MODEL]`. ours: q4, its long passes in bf16 on
the AMX tile unit (the default) and on the Q4_K kernel, alternating prompt by prompt in one
process (the paired ratio); llamacpp: llama.cpp on the same GGUF (prompt evaluation)."""

import json, sys, time, torch
torch.set_num_threads(2)
kind = sys.argv[1]
name = sys.argv[2] if len(sys.argv) > 2 else None
sizes = (128, 512, 1024)
ids = list(range(1000, 1000 + max(sizes)))
if kind == "llamacpp":
    from specdecode.models import llamacpp, registry
    llm = llamacpp.load(name or registry.DEFAULT_TARGET, 2, prompt_lookup=0)
    def prefill(n, _):
        llm.reset(); t0 = time.perf_counter(); llm.eval(ids[:n]); return time.perf_counter() - t0
    modes = ("llamacpp",)
else:
    from specdecode.models import quant, registry
    from specdecode.models.loading import load
    lm = load(name or registry.DEFAULT_TARGET, dtype="q4", tokenizer=False).lm
    lm.allocate(1, max(sizes) + 8)
    bf16_min = quant.PREFILL_MIN_TOKENS
    def prefill(n, mode):
        quant.PREFILL_MIN_TOKENS = bf16_min if mode == "bf16" else 10 ** 9
        lm.rollback(0); x = torch.tensor([ids[:n]])
        t0 = time.perf_counter(); lm.forward(x, num_logits=1); return time.perf_counter() - t0
    modes = ("bf16", "q4k") if quant.bf16_prefill() else ("q4k",)
times = {(n, m): [] for n in sizes for m in modes}
for n in sizes:
    for m in modes:
        prefill(n, m)
for _ in range(5):
    for n in sizes:
        for m in modes:
            times[(n, m)].append(prefill(n, m))
med = {k: sorted(v)[2] for k, v in times.items()}
out = {"kind": kind, "prefill_s": {f"{n}/{m}": round(med[(n, m)], 3) for n in sizes for m in modes},
       "tokens_per_s": {f"{n}/{m}": round(n / med[(n, m)], 1) for n in sizes for m in modes}}
if len(modes) == 2:
    out["bf16_over_q4k_time"] = {n: round(sorted(a / b for a, b in zip(times[(n, "bf16")], times[(n, "q4k")]))[2], 3)
                                 for n in sizes}
print(json.dumps(out))

"""Paired forward times of one model loaded int8 and q4 in one process, alternating passes:
`python benchmarks/paired_dtypes.py MODEL target|draft` (docs/EXPERIMENTS.md, the q4 entry)."""
import sys, time, torch
from specdecode.models.loading import load
torch.set_num_threads(2)
name, role = sys.argv[1], sys.argv[2]
models = {d: load(name, dtype=d, tokenizer=False, role=role).lm for d in ("int8", "q4")}
ids = torch.randint(0, 150000, (1, 300), generator=torch.Generator().manual_seed(0))
for lm in models.values():
    lm.allocate(1, 400); lm.forward(ids[:, :256], num_logits=0)
for n in (1, 2, 4, 8, 16):
    ts = {d: [] for d in models}
    for r in range(7):
        for d, lm in models.items():
            lm.rollback(256); t0 = time.perf_counter(); lm.forward(ids[:, 256:256 + n]); ts[d].append(time.perf_counter() - t0)
    med = {d: sorted(v)[3] * 1e3 for d, v in ts.items()}
    print(n, "  ".join(f"{d} {v:.1f} ms" for d, v in med.items()), f"q4/int8 {med['q4']/med['int8']:.2f}")

"""Paired forward times of one model with the int8 linears' passes of 2+ rows on the AMX tile
unit and on AVX512-VNNI, alternating passes in one process: `python benchmarks/amx_paired.py
DTYPE [MODEL [ROLE]]` (BENCHMARKS.md section 0). Also checks that both give the same logits bits."""
import sys, time, torch
from specdecode.models import quant, registry
from specdecode.models.loading import load
torch.set_num_threads(2)
dtype = sys.argv[1]
name = sys.argv[2] if len(sys.argv) > 2 else registry.DEFAULT_TARGET
lm = load(name, dtype=dtype, tokenizer=False, role=sys.argv[3] if len(sys.argv) > 3 else "target").lm
assert quant.set_amx(True), "no AMX here"
ids = torch.randint(0, 150000, (1, 300), generator=torch.Generator().manual_seed(0))
lm.allocate(1, 400); lm.forward(ids[:, :256], num_logits=0)
base = {}
for n in (1, 2, 4, 8, 12, 16):
    ts, out = {True: [], False: []}, {}
    for r in range(7):
        for on in (True, False):
            quant.set_amx(on); lm.rollback(256)
            t0 = time.perf_counter(); out[on] = lm.forward(ids[:, 256:256 + n]); ts[on].append(time.perf_counter() - t0)
    assert torch.equal(out[True], out[False]), n
    med = {on: sorted(v)[3] * 1e3 for on, v in ts.items()}
    base.setdefault(1, med)
    print(f"T({n}): amx {med[True]:.1f} ms (T/T1 {med[True] / base[1][True]:.2f})  "
          f"vnni {med[False]:.1f} ms (T/T1 {med[False] / base[1][False]:.2f})  amx/vnni {med[True] / med[False]:.2f}",
          flush=True)
quant.set_amx(True)

"""Paired forward times of one model with a CPU kernel on and off, alternating passes in one
process: `python benchmarks/kernel_paired.py amx|attention DTYPE [MODEL [ROLE]]`
(BENCHMARKS.md section 0). amx: the int8 and Q4_K linears' passes of a few rows on the AMX
tile unit against AVX512-VNNI (the same logits bits, checked); attention: the C++ attention
of decode and verify rows (attention.attend_rows) against the PyTorch per-row products
(attention.attend_prefixes; other bits, each internally row-exact)."""
import sys, time, torch
from specdecode.models import attention, native, quant, registry
from specdecode.models.loading import load
torch.set_num_threads(2)
switch, dtype = sys.argv[1], sys.argv[2]
name = sys.argv[3] if len(sys.argv) > 3 else registry.DEFAULT_TARGET
lm = load(name, dtype=dtype, tokenizer=False, role=sys.argv[4] if len(sys.argv) > 4 else "target").lm
kernel = attention.attention_kernel


def turn(on: bool):
    if switch == "amx":
        assert quant.set_amx(on) == on, "no AMX here"
    else:
        assert kernel(torch.device("cpu"), torch.float32, lm.args) is not None, "no kernel here"
        native.attention_kernel = kernel if on else (lambda *a: None)  # the name the forward reads


ids = torch.randint(0, 150000, (1, 300), generator=torch.Generator().manual_seed(0))
lm.allocate(1, 400)
lm.forward(ids[:, :256], num_logits=0)
base = {}
for n in (1, 2, 4, 8, 12, 16):
    ts, out = {True: [], False: []}, {}
    for r in range(7):
        for on in (True, False):
            turn(on)
            lm.rollback(256)
            t0 = time.perf_counter(); out[on] = lm.forward(ids[:, 256:256 + n]); ts[on].append(time.perf_counter() - t0)
    if switch == "amx":
        assert torch.equal(out[True], out[False]), n
    med = {on: sorted(v)[3] * 1e3 for on, v in ts.items()}
    base.setdefault(1, med)
    print(f"T({n}): {switch} on {med[True]:.1f} ms (T/T1 {med[True] / base[1][True]:.2f})  "
          f"off {med[False]:.1f} ms (T/T1 {med[False] / base[1][False]:.2f})  on/off {med[True] / med[False]:.2f}",
          flush=True)
turn(True)

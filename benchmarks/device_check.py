"""The device path, checked in one short run for a session lent an accelerator (CI has none):
`python benchmarks/device_check.py [DEVICE]` (default cuda; `cpu` runs it here). On the tests'
tiny random models, built on the spot (that machine fetches nothing): per dtype, whether the
target's verify rows there equal its one-token passes (models.base.rows_exact), then whether
each method that runs off the CPU gives plain decoding's greedy tokens on that device, alone
and in a batch of two prompts. One JSON line per check; exit status 1 if one crashed."""

import json
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import specdecode  # noqa: E402
from specdecode.models.base import rows_exact  # noqa: E402
from tiny_dirs import build_tiny_dirs  # noqa: E402

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
dirs = build_tiny_dirs(Path(tempfile.mkdtemp()))
PROMPTS = ["Hello there, how are you today? Hello there, how are", "def add(a, b):\n    return a + b\n"]
METHODS = ("draft", "prompt-lookup", "suffix", "hybrid", "layer-skip:layers=1", "draft-xtok")
failed = False


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


for dtype in ("float32", "bfloat16"):
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        target = specdecode.load(dirs["target"], dtype=dtype, device=device)
        drafts = {"draft": specdecode.load(dirs["draft"], dtype=dtype, device=device, role="draft"),
                  "draft-xtok": specdecode.load(dirs["foreign"], dtype=dtype, device=device, role="draft")}
    print(json.dumps({"check": "load", "device": device, "dtype": dtype, "rows_exact": rows_exact(target.lm),
                      "warnings": [str(w.message)[:100] for w in said]}), flush=True)
    plain = {p: specdecode.generate(target, p, method="ar", max_new_tokens=40).token_ids for p in PROMPTS}
    for method in METHODS:
        name = "draft" if method == "draft-xtok" else method
        draft = drafts["draft-xtok" if method == "draft-xtok" else "draft"] if name in ("draft", "hybrid") else None
        for prompt in PROMPTS:
            t0 = time.perf_counter()
            try:
                out = specdecode.generate(target, prompt, method=name, draft=draft, max_new_tokens=40)
                row = {"equal": out.token_ids == plain[prompt],
                       "first_difference": first_difference(out.token_ids, plain[prompt]),
                       "mean_acceptance_length": round(out.stats.mean_acceptance_length, 2)}
            except Exception as e:  # noqa: BLE001 - reported, the other checks go on
                failed, row = True, {"error": f"{type(e).__name__}: {e}"[:300],
                                     "where": traceback.format_exc().splitlines()[-3][:200]}
            print(json.dumps({"check": "generate", "dtype": dtype, "method": method, "prompt": PROMPTS.index(prompt),
                              "seconds": round(time.perf_counter() - t0, 2), **row}), flush=True)
    try:
        both = specdecode.generate(target, PROMPTS, method="prompt-lookup", max_new_tokens=40)
        row = {"equal": [r.token_ids == plain[p] for r, p in zip(both, PROMPTS)]}
    except Exception as e:  # noqa: BLE001
        failed, row = True, {"error": f"{type(e).__name__}: {e}"[:300]}
    print(json.dumps({"check": "batch", "dtype": dtype, **row}), flush=True)
sys.exit(1 if failed else 0)

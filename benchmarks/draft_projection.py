"""The speedup a one-token draft would give a target, projected from measured costs and a
measured acceptance (a projection: acceptance is only ever claimed on real models).

    python benchmarks/draft_projection.py CURVE TARGET_TIMES DRAFT_TIMES [--prompt 200]
                                          [--new 128 512] [--scale 1.0 0.8]

CURVE: a benchmarks/pard_curve.py ``curve.jsonl``; its last line's HumanEval ``ar_alpha_1..8``
are the default draft's own greedy chains, teacher-forced against the default target's
answers (the share of chains right in their first j tokens). TARGET_TIMES, DRAFT_TIMES: the
JSON lines benchmarks/forward_times.py prints (T(n), interpolated between the sizes
measured, and the prefill time per token). For K = 1..8 a round costs T_target(K+1) +
K T_draft(1) and keeps tau = 1 + alpha_1 + ... + alpha_K tokens, each alpha_j times
``--scale`` (1.0: the 1.5B pair's acceptance; 0.8: 20 % less). Decode only: tau T(1) over
the round's cost. End to end, N new tokens after a P-token prompt: plain decoding costs
P p_target + N T(1), speculation P (p_target + p_draft) + N / tau x the round's cost. Prints
one JSON line per (scale, N) with the best K of each.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def forward_times(path: Path):
    """(T(n) in ms, interpolated between the measured sizes; prefill ms a token, or None)
    of the last forward_times.py line in ``path``."""
    line = json.loads(Path(path).read_text().strip().splitlines()[-1])
    measured = {int(n): t for n, t in line["T_ms"].items()}
    sizes = sorted(measured)

    def t(n: float) -> float:
        lo = max([s for s in sizes if s <= n], default=sizes[0])
        hi = min([s for s in sizes if s >= n], default=sizes[-1])
        return measured[lo] if hi == lo else measured[lo] + (measured[hi] - measured[lo]) * (n - lo) / (hi - lo)

    return t, line.get("prefill_ms_per_token")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("curve", type=Path)
    p.add_argument("target_times", type=Path)
    p.add_argument("draft_times", type=Path)
    p.add_argument("--prompt", type=int, default=200, help="prompt tokens (default 200)")
    p.add_argument("--new", type=int, nargs="+", default=[128, 512], help="new tokens (default 128 512)")
    p.add_argument("--scale", type=float, nargs="+", default=[1.0, 0.8],
                   help="factors on every alpha_j (default 1.0 0.8)")
    a = p.parse_args(argv)
    last = json.loads(a.curve.read_text().strip().splitlines()[-1])
    alpha = [last["humaneval"][f"ar_alpha_{j}"] for j in range(1, 9)]
    tt, pt = forward_times(a.target_times)
    td, pd = forward_times(a.draft_times)
    if pt is None or pd is None:
        p.error("the forward-times lines lack prefill_ms_per_token: measure them again with "
                "benchmarks/forward_times.py")
    for scale in a.scale:
        for n in a.new:
            rows = []
            for k in range(1, 9):
                tau = 1 + scale * sum(alpha[:k])
                round_ms = tt(k + 1) + k * td(1)
                decode = tau * tt(1) / round_ms
                plain = a.prompt * pt + n * tt(1)
                spec = a.prompt * (pt + pd) + n / tau * round_ms
                rows.append({"k": k, "tau": round(tau, 2), "decode": round(decode, 2),
                             "end_to_end": round(plain / spec, 2)})
            best = max(rows, key=lambda r: r["end_to_end"])
            print(json.dumps({"projection": True, "scale": scale, "new_tokens": n, "prompt_tokens": a.prompt,
                              "best": best, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

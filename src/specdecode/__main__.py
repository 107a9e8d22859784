"""``specdecode`` (the console script) and ``python -m specdecode``: the command line, with a
Ctrl-C during its imports (PyTorch's take a second or more) ending it as one later would: one
line and exit code 130, no traceback."""

import sys

try:
    from .cli import main
except KeyboardInterrupt:  # (the package itself imports nothing heavy: see its __init__)
    main = None


def run() -> int:
    """The console script's entry: :func:`specdecode.cli.main`'s exit code, or 130 when
    interrupted while importing it."""
    if main is None:
        print("\ninterrupted while starting", file=sys.stderr)
        return 130  # cli.common.EXIT_INTERRUPTED (whose import was what got interrupted)
    return main()


if __name__ == "__main__":
    sys.exit(run())

"""What every subcommand shares: the --threads option, K and output-path arguments, and one rule for exit
codes (0 ok; 2 bad input, with one "error: ..." line on stderr; 1 a job that failed, e.g. a
model that could not be fetched; 130 interrupted)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from ..config import MAX_K, check_k
from ..methods import DEFAULT_METHOD, METHODS, Method, split_method
from ..models import registry
from ..models.auto_draft import pick_draft
from ..models.llamacpp import MissingExtraError
from ..models.loading import (BACKENDS, DEFAULT_DTYPE, DTYPE_NAMES, LoadedModel, check_compatible, load,
                              load_pair, parse_device)
from ..models.registry import ModelFetchError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 0, 1, 2, 130, 141
EXIT_CODES_HELP = ("exit codes: 0 ok, 1 a job failed (e.g. a model could not be fetched), 2 bad "
                   "input, 130 interrupted, 141 standard output closed by its reader (| head)")


def run_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a subcommand, turning the errors a user can cause into one line and an exit code:
    ValueError (bad input) -> 2, ModelFetchError, a missing optional extra or a missing file
    -> 1."""
    try:
        return func(args)
    except ValueError as e:  # IncompatibleDraftError and UnknownModelError included
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (ModelFetchError, MissingExtraError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED


def k_argument(value: str) -> int | str:
    """argparse type of --k: an integer 1..64, 'heuristic' or 'auto'."""
    if value in ("heuristic", "auto"):
        return value
    try:
        return check_k("--k", int(value))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer 1..{MAX_K}, 'heuristic' or 'auto', got {value!r}") from None


def max_k_argument(value: str) -> int:
    """argparse type of --max-k: an integer 1..64."""
    try:
        return check_k("--max-k", int(value))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer 1..{MAX_K}, got {value!r}") from None


def check_output(path: str, directory: bool) -> Path:
    """``path`` as a Path if a run can write its output there: a directory (``directory``) or
    a file that is missing or of that kind, under a directory that exists or can be made. Else
    ValueError saying what is wrong, so that a long run (training, tuning) does not end in a
    traceback with its work lost."""
    what = "directory" if directory else "file"
    if not str(path).strip():
        raise ValueError(f"the output path is empty: give a {what}")
    out = Path(path).expanduser()
    if not directory and str(path).endswith(("/", os.sep)):
        raise ValueError(f"{path} ends with a slash, which names a directory: give a file path, "
                         f"e.g. {out / 'profile.json'}")
    if out.exists() and out.is_dir() != directory:
        raise ValueError(f"{out} is a {'file' if directory else 'directory'}: give a {what} path"
                         + ("" if directory else f", e.g. {out / 'profile.json'}"))
    up = out if directory and out.is_dir() else out.parent
    while not up.exists():
        up = up.parent
    if not up.is_dir():
        raise ValueError(f"{up} is a file, so {out} cannot be created: give a {what} path in a directory")
    try:  # a file made and removed there: os.access says yes to root even where nobody can write (/proc)
        tempfile.TemporaryFile(dir=up).close()
    except OSError as e:
        raise ValueError(f"cannot write in {up} ({e.strerror or e}): give a {what} path you can write") from None
    return out


def _output_argument(directory: bool) -> Callable[[str], Path]:
    """The argparse type of an output directory or file option (:func:`check_output`)."""
    def parse(value: str) -> Path:
        try:
            return check_output(value, directory)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


output_dir_argument = _output_argument(directory=True)
output_file_argument = _output_argument(directory=False)


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: the cores idle at start, measured over 0.2 s; all "
                        "of them on an idle machine). A core that another process keeps busy "
                        "makes every thread wait for it at each step: on 2 cores with one busy, "
                        "2 threads ran at 8.8 tokens/s, 1 thread at 21.7")


def usable_cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def idle_cores(seconds: float = 0.2) -> float:
    """How many of this process's CPUs were idle over ``seconds`` (from /proc/stat; the
    number of usable CPUs where that cannot be read)."""
    usable = usable_cores()

    def sample():
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields[:8])  # idle + iowait, all but guest time

    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return float(usable)
    cpus = os.cpu_count() or usable
    free = (idle1 - idle0) / max(1, total1 - total0) * cpus
    return min(float(usable), free)


def apply_threads(args: argparse.Namespace) -> int:
    """Set torch's thread count: ``--threads``, else one per core idle at start (at least
    1); returns it. Raises ValueError for --threads < 1."""
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        threads = args.threads
        usable = usable_cores()
        if threads > usable:
            print(f"note: --threads {threads} is more than the {usable} usable cores; threads "
                  "beyond them wait for each other at every step (measured 10x slower)",
                  file=sys.stderr)
    else:
        threads = max(1, int(idle_cores() + 0.3))  # a core 70 % idle still counts
    torch.set_num_threads(threads)
    return threads


def method_arg(text: str) -> str:
    """--method's value, checked (a method name with its own options, see
    :func:`specdecode.methods.split_method`)."""
    try:
        split_method(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _server_row_hint(name: str, keys: list[str]) -> str:
    """Where a server takes the bench-row options ``keys`` given to its method ``name``
    (:func:`~specdecode.methods.split_method`'s ``row_hint``): its requests, its command
    line, or nowhere."""
    fixed = "not settable: the default holds"
    where = {"k": "a request's num_speculative_tokens (in its extra_body; without one the server "
                  "chooses each round's K)",
             "max_k": "not settable: the server chooses each round's K", "rule": "a request's acceptance_rule",
             "model": "--draft", "backend": "--draft-backend",
             "dtype": "--draft-dtype" if Method(name).needs_draft_model else "not this method's: "
                      "self-draft:dtype= drafts with the target's own lower-precision copy",
             "p_min": fixed, "ngram": fixed, "cache": fixed}
    return "; in a server " + "; ".join(f"{k}= is {where[k]}" for k in keys)


def server_method_arg(text: str) -> str:
    """A server's --method value, checked as :func:`method_arg` does, a bench row's option
    said to be a request's or the command line's (:func:`_server_row_hint`)."""
    try:
        split_method(text, _server_row_hint)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def method_of(args: argparse.Namespace) -> Method:
    """The Method of --method (without its options)."""
    return Method(split_method(args.method)[0])


def device_arg(value: str) -> torch.device:
    """The argparse type of --device (:func:`~specdecode.models.loading.parse_device`)."""
    try:
        return parse_device(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_model_arguments(p: argparse.ArgumentParser, default_method: Method = DEFAULT_METHOD,
                        server: bool = False) -> None:
    """--target, --draft, --method and the weights and backends of both (generate, serve;
    ``server``: --method is a server's, :func:`server_method_arg`)."""
    p.add_argument("--target", default=registry.DEFAULT_TARGET,
                   help=f"target model: a name from `specdecode models list`, a model directory, a "
                        f"GGUF file or a hub id (default: {registry.DEFAULT_TARGET})")
    p.add_argument("--draft", default=None,
                   help=f"draft model for --method draft or hybrid, same forms as --target "
                        f"(default: {registry.DEFAULT_DRAFT}); auto: the smallest model on this "
                        "machine (known, ollama's, the hub cache's) with the target's tokenizer, "
                        "else one of another tokenizer, else --method self, said on stderr")
    p.add_argument("--method", default=default_method.value, type=server_method_arg if server else method_arg,
                   metavar="METHOD[:KEY=VALUE...]",
                   help="who proposes: " + "; ".join(f"'{m.name}': {m.summary}" for m in METHODS.values())
                        + ". Own options: " + "; ".join(m.options_help for m in METHODS.values() if m.options_help)
                        + f". Default: {default_method.value}")
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=DTYPE_NAMES,
                   help="target weights. auto (default): q4 for a known model or a .gguf file on "
                        "an x86 CPU with AVX512-VNNI or AVX2, else int8. q4: the GGUF file's own Q4_K blocks, the "
                        "rest int8; int8: int8 weights; int4: 4-bit blocks quantized here (not the "
                        "GGUF's model). All take int8 activations per token, so "
                        "verify passes equal one-token passes bit for bit; quantized once and "
                        "cached. The output is this target's own plain decoding; float32 is "
                        "the reference, several times slower on CPU")
    p.add_argument("--draft-dtype", default=None, choices=DTYPE_NAMES,
                   help="draft weights; never changes the output, only speed and acceptance "
                        "(default auto: int4, every linear in 4-bit Q4_K blocks quantized here, on "
                        "an x86 CPU with AVX512-VNNI or AVX2; else int8)")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="whose forward passes run the target: auto (default: native, our "
                        "runtime, where the architecture allows; else transformers), native, "
                        "transformers, or llama.cpp (the GGUF file's own quantization; needs "
                        "`make llamacpp`). llama.cpp's batched passes round differently from "
                        "its one-token passes, so its speculative output equals its plain "
                        "decoding only up to that rounding")
    p.add_argument("--device", default=None, type=device_arg,
                   help="where both models run: cpu (default), cuda, cuda:N. Off the CPU, dtype "
                        "auto is float32, int8/q4/int4 (CPU kernels) and the draft heads are "
                        "refused, and a warning says when the target's verify rows there differ "
                        "from its one-token passes (probed at load: the output then equals plain "
                        "decoding up to that rounding, as with float weights on the CPU)")
    p.add_argument("--draft-backend", default=None, choices=BACKENDS,
                   help="the same for the draft model; never changes the output (llama.cpp's "
                        "one-token steps are the fastest on a CPU for a Q4/Q5 GGUF draft)")


def model_name(args: argparse.Namespace) -> str:
    """The id a server gives the --target model: its name, directory or file name."""
    return os.path.basename(os.path.normpath(str(args.target)))


def load_models(args: argparse.Namespace, method: Method) -> tuple[LoadedModel, LoadedModel | None]:
    """The target and, when ``method`` needs one or --draft names one, the draft, from the
    options of :func:`add_model_arguments` (see :func:`load_pair` for the errors)."""
    draft = args.draft or (registry.DEFAULT_DRAFT if method.needs_draft_model else None)
    auto = draft == "auto"
    target, drf = load_pair(args.target, None if auto else draft, args.dtype,
                            args.draft_dtype or DEFAULT_DTYPE, args.backend,
                            args.draft_backend or "auto", args.device)
    if auto:
        pick = pick_draft(target)
        print(f"draft auto: {pick.why}", file=sys.stderr)
        if pick.name is not None:
            drf = load(pick.name, dtype=args.draft_dtype or DEFAULT_DTYPE,
                       backend=args.draft_backend or "auto", role="draft", device=args.device)
            check_compatible(target, drf)
    if drf is not None and check_compatible(target, drf) == "cross":
        print(f"note: draft {drf.name} uses another tokenizer than target {target.name}: its "
              f"proposals reach the target through text (`specdecode check-pair {target.name} "
              f"{drf.name}` shows the details)", file=sys.stderr)
    return target, drf

"""``specdecode serve``: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from ..heads import read_head_dir
from ..methods import (Method, SpeculativeConfig, build_proposer, cannot_run, head_dir_for, prepare,
                       read_files, speculative_config)
from ..models import registry
from ..server import Metrics, Worker, create_app
from ..server.app import BODY_BYTES_PER_POSITION, GracefulServer
from .common import (EXIT_CODES_HELP, EXIT_INTERRUPTED, add_model_arguments, add_threads_argument, apply_threads,
                     load_models, model_name, run_command)

SERVE_HELP = """\
Serve the target over an OpenAI-compatible HTTP API with speculative decoding:
POST /v1/completions and /v1/chat/completions (streamed or not; logprobs from the target;
fill in the middle with `suffix` on completions), POST /infill (llama.cpp server's FIM
endpoint, for llama.vscode and llama.vim), GET /v1/models, GET /health (503 until the models are loaded), GET /metrics (Prometheus,
vLLM's speculation counter names), and at / a page to watch speculation: the answer streams
with each token shaded by who supplied it (accepted draft or lookup token, the target's
recovered or bonus token), beside the same prompt with speculation off. Output is the
target's own: greedy requests get its greedy decoding token for token, seeded sampled
requests its seeded plain sampling (the gumbel rule).

Defaults are OpenAI's (temperature 1, top_p 1; max_tokens 16 for completions, the rest of
the context for chat). Extra request fields (the openai client's extra_body): method,
num_speculative_tokens (K kept every round; without it the server chooses each round's K
for the whole batch, 0 where speculation does not pay), top_k, repetition_penalty,
min_tokens, acceptance_rule, return_token_sources (the page's view: each chunk's text in
runs by who supplied it, with the speculation counters). Up to --max-batch requests share
each verify pass (continuous batching; each output is still its solo run's), a bounded
queue holds the others. The draft model is loaded when --method needs
one or --draft names one; only then may requests ask for the draft and hybrid methods.
Each step the rows' draft passes run as one pass, each round's K per row is chosen for the
whole batch, and a round speculates only while that is measured faster than plain rounds.
The default method is ar (plain batched decoding) for now: measured with `specdecode
bench-serve` on 2-core CPUs, the hybrid made 0.98-1.13x plain batched decoding's throughput
at concurrency 1 and 0.95-1.06x at 4-8 (docs/EXPERIMENTS.md, the server under load;
medians of paired runs); a request may still ask for a method ("method" in extra_body;
GET /v1/models lists those it can run), and --method sets the default, with its own
options: requests naming that method run with them (--method medusa:head=DIR serves a head
you trained; files its options name, a choices= tree or a profile=, are read once, at the
start; a request cannot give options itself).

examples:
  specdecode serve
  specdecode serve --method hybrid   # speculation for every request
  specdecode serve --method medusa:head=runs/medusa   # a Medusa head of `specdecode train`
  curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "qwen2.5-coder-1.5b-instruct", "messages": [{"role": "user", "content": "hi"}]}'
"""


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server", description=SERVE_HELP,
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, default_method=Method.AR, server=True)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 serves "
                        "every network this machine is on: set --api-key then)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("SPECDECODE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: "
                        "$SPECDECODE_API_KEY, else none)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="requests (choices) that share each verify pass (default 8)")
    p.add_argument("--max-len", type=int, default=4096,
                   help="positions per request, prompt + max_tokens (default 4096, or the "
                        "model's context if smaller); the KV cache holds max-batch x max-len")
    p.add_argument("--max-queue", type=int, default=32,
                   help="requests that may wait; beyond them 429 with Retry-After (default 32)")
    p.add_argument("--shutdown-grace", type=float, default=5.0, metavar="SECONDS",
                   help="on Ctrl-C or SIGTERM: stop accepting, let requests in flight run this "
                        "long, then end them with finish_reason 'abort' and exit 130 saying how "
                        "many were cut; a second signal exits at once (default 5)")
    p.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                   help="the largest request body; 413 beyond it, before it is parsed (default: "
                        f"max-batch x max-len x {BODY_BYTES_PER_POSITION} bytes + 1 MiB, about 3 MiB)")
    add_threads_argument(p)
    p.set_defaults(func=lambda args: run_command(cmd_serve, args))


def served_config(text: str) -> SpeculativeConfig:
    """The config of a server's --method ``text`` (checked by argparse:
    :func:`~.common.server_method_arg`), its files read now, once
    (:func:`~specdecode.methods.read_files`). Raises ValueError naming a file that cannot be
    read."""
    return read_files(speculative_config(text, False))


def load_served(args: argparse.Namespace, methods: dict[str, SpeculativeConfig]):
    """(target, draft) for a server of ``methods`` (each method text as given, a name with
    its options, with its parsed config; the draft model when one needs it), after measuring
    what they measure once on the target (:func:`~specdecode.methods.prepare`: before the
    batch holds it). Raises ValueError for a method that cannot run on the target."""
    specs = list(methods.values())
    target, draft = load_models(args, next((s.method for s in specs if s.method.needs_draft_model),
                                           specs[0].method))
    if draft is None and any(s.method.needs_draft_model for s in specs):
        raise ValueError("--draft auto found no draft for this target on this machine: serve it with "
                         "--method self (or prompt-lookup), or give --draft")
    for text, spec in methods.items():
        try:
            prepare(spec, target)
            why = cannot_run(spec, target)
            if why is None:  # what only building says (a layer or exit layer the target lacks)
                build_proposer(spec, target, draft)
        except ValueError as e:
            why = str(e)
        if why is not None:
            raise ValueError(f"method {text} cannot run on this target: {why}")
    return target, draft


def cmd_serve(args: argparse.Namespace) -> int:
    """Raises ValueError for bad options (the models load after the server is up)."""
    import uvicorn  # here: the other commands do not need it

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0..65535, got {args.port}")
    for name in ("max_queue", "max_batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_len < 2:
        raise ValueError(f"--max-len must be >= 2, got {args.max_len}")
    if not 0 <= args.shutdown_grace <= 3600:
        raise ValueError(f"--shutdown-grace must be 0..3600 seconds, got {args.shutdown_grace}")
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    spec = served_config(args.method)  # (raises naming a bad option or file)
    method = spec.method
    head = head_dir_for(spec, args.target)  # a missing head is said before anything loads
    if head is not None:
        read_head_dir(head, method.value)  # (raises naming a directory that holds no such head)
    threads = apply_threads(args)
    name = model_name(args)
    worker = Worker(lambda: load_served(args, {args.method: spec}), Metrics(name), args.max_queue,
                    args.max_batch, args.max_len)
    worker.start()
    app = create_app(worker, name, spec, args.api_key, args.max_body_bytes)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"note: serving on {args.host}, beyond this machine"
              + ("" if args.api_key else ", without an API key (--api-key)"), file=sys.stderr)
    draft = args.draft or (registry.DEFAULT_DRAFT if method.needs_draft_model else None)
    print(f"# serving {name} (default method {args.method}; "
          + (f"draft {draft}; " if draft else "no draft model; ")
          + "GET /v1/models lists the methods a request may name"
          + f") on http://{args.host}:{args.port}; {threads} thread(s); /health turns 200 once "
          "the models are loaded", file=sys.stderr)
    server = GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=args.shutdown_grace + 5),
                            worker, args.shutdown_grace, EXIT_INTERRUPTED)

    def stop_if_the_models_fail():  # a server that can never serve ends, saying why
        error = worker.wait_loaded()
        if error is not None:
            print(f"error: the models failed to load: {error}", file=sys.stderr)
            server.should_exit = True

    threading.Thread(target=stop_if_the_models_fail, daemon=True).start()
    server.run()
    worker.stop()
    if server.stopped_by is not None:
        cut = worker.cut_requests
        print(f"stopped by {signal.Signals(server.stopped_by).name}: " + (
            f"{cut} request(s) still running after the {args.shutdown_grace:g} s grace were ended "
            "(finish_reason 'abort')" if cut else "no request was cut"), file=sys.stderr)
        return EXIT_INTERRUPTED
    return 1 if worker.error else 0


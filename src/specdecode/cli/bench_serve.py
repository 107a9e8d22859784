"""``specdecode bench-serve``: the server under load, speculation on and off in one run."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from .. import api
from ..bench import serving
from ..bench.workloads import SPEC_BENCH_PATH, load_spec_bench
from ..methods import METHODS, Method, SpeculativeConfig, speculative_config
from ..server import Metrics, Worker, create_app, serve_in_thread
from .serve import load_served, served_config
from .common import (EXIT_CODES_HELP, EXIT_INTERRUPTED, add_model_arguments, add_threads_argument,
                     apply_threads, method_of, model_name, output_dir_argument, run_command)

HELP = """\
Load-test the OpenAI-compatible server: closed-loop clients (each sends its next request when
its last one ends) at each concurrency, Spec-Bench questions as chat prompts, greedy, every
level with speculation on (--method) and off (--off-method) in the same run (--repeats pairs
of blocks, alternated, on a noisy machine). Reports
throughput, time to first token, time per output token (median, p90) and acceptance. Starts
the server itself on 127.0.0.1 (the model options below) unless --url names a running one.

examples:
  specdecode bench-serve --concurrency 1,2,4 --max-tokens 64 --out benchmarks/serve
  specdecode bench-serve --concurrency 1,4,8 --requests 8 --repeats 3 --check --out benchmarks/serve-paired
  specdecode bench-serve --method medusa:head=runs/medusa --concurrency 1,4,8 --check
  specdecode bench-serve --url http://127.0.0.1:8000 --model qwen2.5-coder-1.5b-instruct
"""


def _levels(value: str) -> list[int]:
    try:
        levels = [int(v) for v in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {value!r}") from None
    if not levels or min(levels) < 1 or max(levels) > 256:
        raise argparse.ArgumentTypeError(f"each concurrency must be 1..256, got {value!r}")
    return levels


def add_parser(sub) -> None:
    p = sub.add_parser("bench-serve", help="the server under load, speculation on and off",
                       description=HELP, epilog=EXIT_CODES_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, default_method=Method.HYBRID, server=True)
    p.add_argument("--off-method", default=Method.AR.value, choices=list(METHODS),
                   help="the method compared with --method (default ar: plain decoding)")
    p.add_argument("--url", default=None, help="a running server instead of starting one")
    p.add_argument("--model", default=None, help="the model id to send (default: the target's name)")
    p.add_argument("--api-key", default=os.environ.get("SPECDECODE_API_KEY"))
    p.add_argument("--concurrency", type=_levels, default=[1, 2, 4, 8, 16],
                   help="comma-separated levels (default 1,2,4,8,16)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level and method (default: twice the concurrency)")
    p.add_argument("--repeats", type=int, default=1,
                   help="pairs of on / off blocks a level, alternated (on off, off on, ...): the "
                        "on / off figure is the median of the pairs' ratios, with their range; "
                        "3 or more show whether a difference is more than the machine's noise "
                        "(default 1)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens a request (default 64)")
    p.add_argument("--limit", type=int, default=2, help="Spec-Bench questions per subtask (default 2)")
    p.add_argument("--dataset", default=str(SPEC_BENCH_PATH),
                   help="Spec-Bench question.jsonl (default: the copy shipped inside specdecode)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="the started server's batch (default: the highest concurrency)")
    p.add_argument("--check", action="store_true",
                   help="after the load, compare every response with the target's solo greedy "
                        "run of its prompt, and count errors and requests left running; and time "
                        "concurrency 1's requests again, each through the server then through "
                        "the library alone as `specdecode generate` runs it (the started "
                        "server only)")
    p.add_argument("--out", type=output_dir_argument, default=None, metavar="DIR",
                   help="write results.json and report.md here")
    add_threads_argument(p)
    p.set_defaults(func=lambda args: run_command(cmd_bench_serve, args))


def _beside_generate(results: dict, worker: Worker, url: str, model: str, prompts: list,
                     methods: tuple[SpeculativeConfig, ...], args: argparse.Namespace) -> None:
    """Concurrency 1's requests again, each through the server then through the library
    alone (what `specdecode generate` runs: a fork of the served target, its own KV cache),
    in turn, so that a drift of the machine moves both alike; adds the paired ratios
    (:func:`serving.beside_generate`)."""
    target = replace(worker.target, lm=worker.target.lm.fork(), session_proposers={})
    pairs = {}
    level = next(lv for lv in results["levels"] if lv["concurrency"] == 1)
    for spec in methods:  # (as served: parsed, its files read, once)
        m = spec.method
        draft = worker.draft if m.needs_draft_model else None
        for s in level[m.value]["samples"][:args.requests or 2]:  # one block's
            served = serving.request(url, model, prompts[s["prompt"]], m.value, args.max_tokens, args.api_key)
            t0 = time.perf_counter()
            alone = api.generate(target, prompts[s["prompt"]], method=spec, draft=draft,
                                 max_new_tokens=args.max_tokens)
            pairs.setdefault(m.value, []).append(((served.completion_tokens, served.e2e_s),
                                                  (len(alone.token_ids), time.perf_counter() - t0)))
    g = serving.beside_generate(results, pairs)
    print("# concurrency 1 / generate: " + ", ".join(f"{m} {r:.2f}x" for m, r in g.items()), file=sys.stderr)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Raises ValueError for bad options and for a missing or malformed --dataset."""
    if args.requests is not None and args.requests < 1:
        raise ValueError(f"--requests must be >= 1, got {args.requests}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        tasks = load_spec_bench(args.dataset, args.limit)
    except FileNotFoundError as e:  # a bad --dataset is bad input: exit 2
        raise ValueError(str(e)) from None
    prompts = [[{"role": "user", "content": t.turns[0]}] for t in tasks]
    if args.check and args.url is not None:
        raise ValueError("--check runs the solo runs on the server's own models: leave out --url")
    on, off = method_of(args), Method(args.off_method)
    if on == off:
        raise ValueError(f"--method and --off-method are both {on.value}: compare two methods "
                         "(--off-method ar is plain decoding)")
    uv = None
    if args.url is None:
        apply_threads(args)
        name = model_name(args)
        served, plain = served_config(args.method), speculative_config(off.value, False)
        worker = Worker(lambda: load_served(args, {args.method: served, off.value: plain}), Metrics(name),
                        1024, args.max_batch or max(args.concurrency), 2048)
        worker.start()
        uv, port = serve_in_thread(create_app(worker, name, served, args.api_key))
        url, model = f"http://127.0.0.1:{port}", args.model or name
        print(f"# loading {name} ...", file=sys.stderr)
        error = worker.wait_loaded()
        if error is not None:
            raise ValueError(f"the server could not load the models: {error}")
    else:
        if ":" in args.method:
            raise ValueError(f"--method {args.method}: with --url the running server's own --method "
                             "options hold (a request names a method only); give the method name")
        url, model = args.url, args.model or model_name(args)

    def progress(c, m, r):
        print(f"concurrency {c:>3} {m:<14} {r['throughput_tok_s']:8.2f} tok/s  TTFT "
              f"{r['ttft_median_s']:.3f} s  TPOT {r['tpot_median_s']} s  acceptance "
              f"{r['acceptance_rate']}", file=sys.stderr, flush=True)

    try:
        try:
            results = serving.run(url, model, prompts, on.value, off.value, args.concurrency,
                                  args.requests, args.max_tokens, args.api_key, progress, args.repeats)
        except KeyboardInterrupt:
            print("\ninterrupted: the load stopped with its requests in flight"
                  + ("" if uv is None else " (ended with the server)") + "; nothing was written",
                  file=sys.stderr)
            return EXIT_INTERRUPTED
        if args.check and 1 in args.concurrency:
            _beside_generate(results, worker, url, model, prompts, (served, plain), args)  # (--check: no --url)
        if args.check:  # what the worker still holds once every client has its answer
            time.sleep(1.0)
            left = len(worker._live) + len(worker._pending) + worker.waiting
    finally:
        if uv is not None:
            worker.stop()
            uv.should_exit = True
    if args.check:
        worker._thread.join(60)  # its batch closed: the target is free for the solo runs
        used = sorted({s["prompt"] for lv in results["levels"] for m in (on.value, off.value)
                       for s in lv[m]["samples"]})
        print(f"# --check: {len(used)} solo runs", file=sys.stderr)
        solo = {i: api.generate(worker.target, prompts[i], method="ar", max_new_tokens=args.max_tokens).text
                for i in used}
        c = serving.check(results, solo, left)
        print(f"# check: {c['mismatches']} mismatches in {c['compared']} responses, "
              f"{c['errors']} errors, {c['left_running']} left running", file=sys.stderr)
    results["command"] = "specdecode " + " ".join(sys.argv[1:])
    results["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    text = serving.report(results)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        (out / "report.md").write_text(text)
    summary = {str(lv["concurrency"]): lv["ratio_median"] for lv in results["levels"]}
    print(json.dumps({"on_over_off_throughput": summary}))
    errors = sum(lv[m]["errors"] for lv in results["levels"] for m in (on.value, off.value))
    if errors:  # a load test that lost requests has failed, whatever its figures
        print(f"error: {errors} requests failed (their errors are in the samples of results.json)",
              file=sys.stderr)
        return 1
    return 0

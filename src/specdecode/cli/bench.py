"""``specdecode bench``: the command line of :mod:`specdecode.bench`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..bench.run import RECORDS_LOG, check_run_settings, run_and_report
from ..bench.runners import (CROSS_ROWS, DEFAULT_METHODS, OPTION_PARSERS, PEERS, BenchModels, build_runners,
                             check_rows, is_ours, parse_methods)
from ..bench.workloads import (DEFAULT_WORKLOADS, SPEC_BENCH_PATH, SPEC_BENCH_SUBTASKS, SUBTASKS, WORKLOADS,
                               load_code_edit, load_fim, load_humaneval, load_json, load_spec_bench)
from ..config import SamplingParams
from ..methods import METHODS
from ..models import registry
from ..models.loading import BACKENDS, DEFAULT_DTYPE, DTYPE_NAMES
from ..train.run import KINDS as HEAD_KINDS, ensure_default_head
from .common import (EXIT_CODES_HELP, add_threads_argument, apply_threads, device_arg, output_dir_argument,
                     run_command, usable_cores)


def _help() -> str:
    def options(m):
        given = [f"{key}={values}" for key, (o, values, _) in OPTION_PARSERS.items() if o in m.option_names]
        given += [f"{key}={k.example}" for key, k in m.keys().items()]
        return f" ({', '.join(given)})" if given else ""

    ours = "\n".join(f"  {m.name:<14}{m.summary}{options(m)}" for m in METHODS.values())
    ours += "".join(f"\n  {row:<14}{base}, with a --draft of another tokenizer than the target's (a "
                    "row that says so; the method itself needs no option for such a pair)"
                    for row, base in CROSS_ROWS.items())
    peers = "\n".join(f"  {name:<17}{p.summary}" for name, p in PEERS.items())
    return f"""\
Benchmark decoding methods side by side on Spec-Bench and HumanEval, greedy (or sampled:
--temperature), batch size 1, interleaved per prompt, against our plain decoding (ar),
transformers (hf-*) and llama.cpp
(llamacpp-*, on the target's GGUF file), with the machine's ceiling for a perfect, free
proposer.

methods (--methods, comma-separated; options after colons, e.g. draft:k=4:dtype=float32):
{ours}
  (every one takes rule=gumbel|rejection, its acceptance rule, in a sampled run
  (--temperature), and prediction=on, a task's predicted output proposed first (code-edit's
  original code: OpenAI's Predicted Outputs), e.g. ar,hybrid,hybrid:prediction=on;
  each speculative one also takes k=N|heuristic|auto and max_k=N; those with a draft
  model dtype={"|".join(DTYPE_NAMES)}, the draft's dtype, default auto (int4 on an x86 CPU with
  AVX512-VNNI or AVX2, else int8),
  backend={"|".join(BACKENDS)}, whose forward passes run the draft, e.g.
  draft:backend=llama.cpp, and model=NAME|DIR, another draft than --draft, e.g. a distilled
  one beside the original: draft,draft:model=distilled)
{peers}

workloads (--workloads): spec-bench (mt_bench, translation, summarization, qa,
math_reasoning, rag), humaneval (code completion), code-edit (a HumanEval solution to
rewrite with type hints and a docstring: the answer repeats much of the prompt; its original
code is the rows' prediction with prediction=on), json (a HumanEval function described as
JSON under a schema, OpenAI's response_format: every row of ours decodes under the schema's
grammar, so ar is plain constrained decoding; llama.cpp rows decode under its own grammar of
the schema, the transformers rows take none), fim (a HumanEval
solution with 1-3 lines taken out, the text before and after the gap given, laid out as
llama.cpp's /infill lays it out: every row, peers too, completes the same FIM prompt and
stops where the model closes the gap).

example:
  specdecode bench --limit 5 --methods ar,hf-ar,hf-assisted,draft:k=6 --out bench-out
  specdecode bench --workloads code-edit --methods ar,hf-pld,prompt-lookup,suffix:k=auto
"""


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark methods side by side (Spec-Bench, HumanEval)",
                       description=_help(), epilog=EXIT_CODES_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=registry.DEFAULT_TARGET, help="target model (default %(default)s)")
    p.add_argument("--draft", default=registry.DEFAULT_DRAFT, help="draft model (default %(default)s)")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="default: %(default)s")
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help=f"comma-separated from: {', '.join(WORKLOADS)} (default: %(default)s)")
    p.add_argument("--dataset", default=str(SPEC_BENCH_PATH),
                   help="Spec-Bench question.jsonl (default: the copy shipped inside specdecode)")
    p.add_argument("--subtasks", default=None,
                   help=f"only these subtasks (comma-separated; Spec-Bench: {', '.join(SPEC_BENCH_SUBTASKS)})")
    p.add_argument("--limit", type=int, default=5, help="prompts per subtask, seeded choice (default 5)")
    p.add_argument("--humaneval-limit", type=int, default=None,
                   help="HumanEval (and code-edit, json, fim) problems (default: --limit)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt choice (default 0)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run each prompt this many times a method, the methods forwards then "
                        "backwards (A B C, C B A, ...), and keep each method's run of median time: "
                        "on a machine whose speed moves for minutes at a time, every method of a "
                        "prompt then meets the same conditions (default 1; N times as long)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="default %(default)s")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy, as Spec-Bench. T > 0: a sampled run of our methods "
                        "only, each prompt seeded alike for every method; the option rule=gumbel "
                        "(default) or rule=rejection chooses a method's acceptance rule, e.g. "
                        "--methods ar,draft,draft:rule=rejection; gumbel methods are checked "
                        "token for token against ar, except lossy rows (medusa:lossy-typical=EPS: "
                        "they change the output by design, and the report marks them lossy)")
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=DTYPE_NAMES,
                   help="our target's dtype for every method of ours (default auto: q4 for "
                        "a GGUF target on an x86 CPU with AVX512-VNNI or AVX2, else int8); the "
                        "transformers peers run float32 (bfloat16 when this is bfloat16)")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="whose forward passes run our target in every method of ours (default "
                        "auto: our native runtime). llama.cpp: its passes of the GGUF file; its "
                        "batched passes round differently from its one-token passes, and the "
                        "mismatches column counts where that changed our output against our ar "
                        "on the same backend")
    p.add_argument("--device", default="cpu", type=device_arg,
                   help="where our models and transformers' run: cpu (default), cuda, cuda:N (off "
                        "the CPU: dtype auto is float32, the CPU kernels' dtypes are refused, see "
                        "`specdecode generate --help`); llama.cpp's rows run on the CPU only, and "
                        "peak memory, a CPU process's, is not measured there")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                   help="after the timed run, measure each method's peak resident memory in a "
                        "process of its own (its models, one generation of the longest prompt; "
                        "some seconds per method; default on)")
    p.add_argument("--out", type=output_dir_argument, default=None, metavar="DIR",
                   help="write results.json, report.md and speedup.png here; every finished "
                        "prompt is also appended to records.jsonl as the run goes")
    p.add_argument("--resume", action="store_true",
                   help="continue the interrupted run in --out: prompts already in its "
                        "records.jsonl are not run again")
    add_threads_argument(p)
    p.set_defaults(func=lambda args: run_command(cmd_bench, args))


def cmd_bench(args: argparse.Namespace) -> int:
    """Raises ValueError for bad input (a missing dataset included),
    ModelFetchError when a model cannot be fetched."""
    threads = apply_threads(args)
    if args.threads is None and threads < usable_cores():
        print(f"note: only {threads} core(s) were idle at start; timings on a busy machine "
              "are not comparable (pass --threads N to fix the count)", file=sys.stderr)
    if args.resume and not args.out:
        raise ValueError("--resume needs --out DIR (the directory of the run to continue)")
    methods = parse_methods(args.methods)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not workloads:
        raise ValueError(f"unknown workload(s) {bad}; available: {', '.join(WORKLOADS)}")
    if args.limit < 1 or args.max_new_tokens < 1 or args.repeats < 1:
        raise ValueError("--limit, --max-new-tokens and --repeats must be >= 1")
    SamplingParams(temperature=args.temperature)  # names a bad value
    check_rows(methods, args.temperature)
    if args.device.type != "cpu":
        on_llama = [label for label, name, _ in methods if name.startswith("llamacpp")]
        if on_llama or args.backend == "llama.cpp":
            raise ValueError(f"--device {args.device}: llama.cpp runs on the CPU here "
                             f"({', '.join(on_llama) or '--backend llama.cpp'}); drop it or leave "
                             "out --device")
        if args.memory:
            print(f"note: peak memory is a CPU process's; not measured with --device {args.device}",
                  file=sys.stderr)
            args.memory = False
    tasks = []
    if "spec-bench" in workloads:
        try:
            tasks += load_spec_bench(args.dataset, args.limit, args.seed)
        except FileNotFoundError as e:  # a bad --dataset is bad input: exit 2
            raise ValueError(f"{e}; or leave Spec-Bench out: --workloads humaneval") from None
    if "humaneval" in workloads:
        tasks += load_humaneval(args.humaneval_limit or args.limit, args.seed)
    if "code-edit" in workloads:
        tasks += load_code_edit(args.humaneval_limit or args.limit, args.seed)
    if "json" in workloads:
        peers = [label for label, name, _ in methods if not is_ours(name) and not name.startswith("llamacpp")]
        if peers:
            raise ValueError(f"the json workload's answers follow a JSON schema, which {', '.join(peers)} "
                             "take no schema here (llama.cpp's rows do: its grammar): leave them out of "
                             "--methods, or json out of --workloads")
        tasks += load_json(args.humaneval_limit or args.limit, args.seed)
    if "fim" in workloads:
        tasks += load_fim(args.humaneval_limit or args.limit, args.seed)
    if args.subtasks:
        keep = {s.strip() for s in args.subtasks.split(",")}
        unknown = sorted(keep - set(SUBTASKS))
        if unknown:
            raise ValueError(f"unknown subtask(s) {unknown}; available: {', '.join(SUBTASKS)}")
        tasks = [t for t in tasks if t.subtask in keep]
        if not tasks:
            raise ValueError(f"no prompts left for subtasks {sorted(keep)}")
    if args.out and not args.resume and (Path(args.out) / RECORDS_LOG).exists():
        raise ValueError(f"{Path(args.out) / RECORDS_LOG} holds an earlier run: pass --resume "
                         "to continue it, or choose another --out")
    if args.out:
        check_run_settings(args)
    models = BenchModels(args.target, args.draft, args.dtype, args.backend, args.device)
    for _, name, options in methods:  # before any timing: a missing default head is trained once
        if name in HEAD_KINDS and "head" not in dict(options):
            ensure_default_head(name, models.target())
    runners = build_runners(models, methods, args.temperature)
    report = run_and_report(models, runners, tasks, args.max_new_tokens, args)
    print(json.dumps(report["overall_json"]))
    return 0



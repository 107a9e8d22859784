"""Running the bench: every task with every method, interleaved, with the lossless check
and the machine's limit; records are appended as prompts finish, so a run can be resumed.

In the spirit of Spec-Bench (Xia et al., arXiv:2401.07851): greedy decoding, batch size 1,
speedup = tokens/s of a method / tokens/s of plain decoding of the same target. Methods run
interleaved per prompt (A B C A B C ...) so that machine drift hits all alike; a warm-up
generation per method is excluded. Speedups are medians of per-prompt ratios (paired).
"""

from __future__ import annotations

import hashlib
import json
import resource
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import __version__
from ..models.loading import LoadedModel
from ..profile import measure_forward_times
from .memory import method_peak
from .report import SPEC_BENCH_METRIC, markdown_table, plot, spec_bench_table, subtask_table, summarize
from .runners import BenchModels, fixed_k, is_ours
from .workloads import Task, lay_out_fim, prompt_ids


@dataclass
class Record:
    """One generation: ``seconds`` is wall time including prefill; ``identical`` is the
    lossless check against the reference method (None when not applicable); ``lossy``: the
    method changed the output by design (Medusa's typical acceptance, ``lossy-typical=``):
    no lossless check, and its speed is not a lossless method's."""

    method: str
    subtask: str
    prompt_id: str
    turn: int
    prompt_tokens: int
    new_tokens: int
    seconds: float
    token_ids: list[int] = field(repr=False, default_factory=list)
    num_verify_passes: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    draft_s: float | None = None
    verify_s: float | None = None
    prefill_s: float | None = None
    identical: bool | None = None
    first_difference: int | None = None
    lossy: bool = False

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def ceiling(times: list[float], k: int) -> float:
    """Speedup of a perfect, free proposer at speculation length K: (K+1)·T(1)/T(K+1)."""
    if k >= len(times):
        raise ValueError(f"the ceiling at K={k} needs T({k + 1}); only T(1..{len(times)}) were measured")
    return (k + 1) * times[0] / times[k]


def weight_bytes(model: LoadedModel) -> int:
    """Bytes one decode step reads: every weight (parameters, int8 buffers, oneDNN-packed
    copies) except the input embedding table (of which one row is read), each storage
    counted once, so a tied output layer is counted once. The llama.cpp backend: every
    tensor of its file (the embedding table included)."""
    lm = model.lm
    if hasattr(lm, "weight_bytes"):
        return lm.weight_bytes
    module = lm if isinstance(lm, torch.nn.Module) else lm.hf
    if isinstance(lm, torch.nn.Module):
        emb, out = lm.model.embed_tokens, lm.lm_head
    else:
        emb, out = module.get_input_embeddings(), module.get_output_embeddings()

    def tensors(m):
        found = {t.data_ptr(): t for t in [*m.parameters(), *m.buffers()] if t.numel()}
        for sub in m.modules():  # oneDNN-packed linears hold their weight outside both
            packed = getattr(sub, "packed", None)
            if packed is not None:
                found[id(packed)] = packed
        return found

    every = tensors(module)
    for ptr in set(tensors(emb)) - set(tensors(out)):
        every.pop(ptr, None)
    return sum(t.numel() * t.element_size() for t in every.values())


RECORDS_LOG = "records.jsonl"
RUN_SETTINGS = ("target", "draft", "dtype", "backend", "device", "max_new_tokens", "seed", "dataset",
                "limit", "temperature", "repeats")


def check_run_settings(args) -> None:
    """--out DIR keeps the settings that make records comparable in DIR/run.json; --resume
    with other settings is refused (its records would not be comparable; another --limit
    chooses other prompts). A run.json written before ``limit`` (``backend``, ``temperature``,
    ``repeats``, ``device``) was kept is not checked for it."""
    path = Path(args.out) / "run.json"
    mine = {k: str(getattr(args, k)) for k in RUN_SETTINGS}
    if Path(args.dataset).is_file():  # the questions themselves, wherever the file lies
        mine["dataset"] = "sha256:" + hashlib.sha256(Path(args.dataset).read_bytes()).hexdigest()[:16]
    if args.resume and path.exists():
        try:
            theirs = json.loads(path.read_text())
        except ValueError:
            theirs = {}
        theirs.setdefault("limit", mine["limit"])
        theirs.setdefault("backend", "auto")
        theirs.setdefault("temperature", "0.0")
        theirs.setdefault("repeats", "1")
        theirs.setdefault("device", "cpu")
        diff = [f"{k} was {theirs.get(k)!r}, now {v!r}" for k, v in mine.items() if theirs.get(k) != v]
        if diff:
            raise ValueError(f"--resume: the run in {args.out} used other settings ({'; '.join(diff)}); "
                             "resume with the same ones, or choose another --out")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**mine, "version": __version__, "commit": _commit(), "command": command_line(),
                                "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))


def command_line() -> str:
    """The command that runs, as a user would type it (``specdecode bench ...``)."""
    return " ".join(["specdecode"] + [shlex.quote(a) for a in sys.argv[1:]])


def _commit() -> str | None:
    """The git commit of the code that runs (``git describe --always --dirty``) where the
    package runs from its own checkout; None for an installed copy (whose directory may sit
    inside some other repository, whose commit is not this code's: ``version`` says it)."""
    package = Path(__file__).resolve().parents[1]  # src/specdecode in a checkout
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             cwd=package, timeout=10)
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() / "src" / "specdecode" != package:
            return None
        proc = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, cwd=package, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def read_records(path: Path) -> list[Record]:
    """Records of ``path`` (one JSON object per line, as written during a run); a last line cut
    short by a killed run is ignored."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(Record(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue
    return out


def add_peak_memory(summary: dict, models: BenchModels, runners, tasks, tok, max_new_tokens,
                    temperature: float = 0.0) -> None:
    """Each method's peak resident memory (``peak_memory_bytes`` of its overall row), measured
    in a process of its own on the run's longest prompt (:mod:`specdecode.bench.memory`),
    one method after the other, after the timed run (so it cannot disturb the timings)."""
    from tqdm import tqdm

    ids = max((prompt_ids(tok, t, 0, []) for t in tasks), key=len)
    for label in tqdm(list(runners), desc="peak memory, a process per method", unit="method"):
        peak, err = method_peak(label, models.target_name, models.draft_name, models.dtype,
                                models.backend, ids, max_new_tokens, temperature)
        if err:
            print(f"note: peak memory of {label} not measured: {err}", file=sys.stderr)
        if "overall" in summary.get(label, {}):
            summary[label]["overall"]["peak_memory_bytes"] = peak


def first_difference(a: list[int], b: list[int]) -> int | None:
    """First index where two token lists differ (or the shorter length); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_bench(tasks: list[Task], runners: dict, tokenizer, max_new_tokens: int,
              progress: bool = True, on_mismatch=None, previous: list[Record] = (),
              on_task_done=None, repeats: int = 1) -> list[Record]:
    """Run every task with every method, interleaved; Ctrl-C (or SIGTERM, as a batch system
    or ``kill`` sends, when called from the main thread) stops and keeps what is done.

    ``repeats`` > 1: each prompt (and turn) runs that many times a method, the methods in
    turn forwards and backwards (A B C, C B A, ...), and a method's record is its run of
    median time (the lower one of an even count; its stats come with it): a machine whose
    speed moves for minutes at a time then slows every method of a prompt alike. Raises
    ValueError for repeats < 1 and RuntimeError when a method's repeats give other tokens.

    ``previous``: records of an interrupted run; a task whose every method × turn is among
    them is not run again (a partly done task is run again whole, so that its methods stay
    back to back). ``on_task_done(records)`` is called with each finished task's records."""
    from tqdm import tqdm

    if isinstance(repeats, bool) or not (isinstance(repeats, int) and repeats >= 1):
        raise ValueError(f"repeats={repeats!r} is invalid; allowed: an integer >= 1")
    have = {(r.method, r.subtask, r.prompt_id, r.turn): r for r in previous}

    def keys_of(task):
        return [(label, task.subtask, task.prompt_id, turn)
                for turn in range(len(task.turns)) for label in runners]

    records: list[Record] = []
    # a generation is a record: a prompt's turn by one method (with --repeats, each of N runs)
    bar = tqdm(total=sum(len(t.turns) for t in tasks) * len(runners), unit="gen", disable=not progress,
               desc="bench" if repeats == 1 else f"bench ({repeats} runs a generation)")
    i = 0
    on_term = None
    if threading.current_thread() is threading.main_thread():
        on_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for i, task in enumerate(tasks):
            keys = keys_of(task)
            if all(k in have for k in keys):
                records += [have[k] for k in keys]
                bar.update(len(keys))
                continue
            start = len(records)
            answers: dict[str, list[str]] = {label: [] for label in runners}
            for turn in range(len(task.turns)):
                done: dict[str, Record] = {}
                ids_of = {label: prompt_ids(tokenizer, task, turn, answers[label]) for label in runners}
                outs: dict[str, list] = {label: [] for label in runners}
                for r in range(repeats):
                    for label in (list(runners) if r % 2 == 0 else list(reversed(runners))):
                        outs[label].append(runners[label][0](ids_of[label], max_new_tokens,
                                                             task.request(turn)))
                for label, (_, ref) in runners.items():
                    ids = ids_of[label]
                    if any(o.token_ids != outs[label][0].token_ids for o in outs[label]):
                        raise RuntimeError(f"{label} gave other tokens when {task.prompt_id} "
                                           "ran again: its output is not reproducible, so "
                                           "--repeats cannot time it")
                    out = sorted(outs[label], key=lambda o: o.seconds)[(repeats - 1) // 2]
                    s = out.stats or {}
                    rec = Record(label, task.subtask, task.prompt_id, turn, len(ids),
                                 len(out.token_ids), out.seconds, out.token_ids,
                                 s.get("num_verify_passes"), s.get("num_draft_tokens"),
                                 s.get("num_accepted_tokens"), s.get("draft_s"), s.get("verify_s"),
                                 s.get("prefill_s"), lossy=bool(s.get("lossy")))
                    if ref is not None and ref != label and ref in done:
                        diff = first_difference(out.token_ids, done[ref].token_ids)
                        rec.identical, rec.first_difference = diff is None, diff
                        if diff is not None and on_mismatch is not None:
                            on_mismatch(rec, ref)
                    done[label] = rec
                    records.append(rec)
                    answers[label].append(tokenizer.decode(out.token_ids, skip_special_tokens=True))
                    bar.update(1)
            if on_task_done is not None:
                on_task_done(records[start:])
    except KeyboardInterrupt:
        print("\ninterrupted: reporting the results so far", file=sys.stderr)
        # and the finished tasks of the run being resumed that come after this one
        records += [have[k] for task in tasks[i + 1:] if all(k in have for k in keys_of(task))
                    for k in keys_of(task)]
    finally:
        bar.close()
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)
    return records


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM: stop like Ctrl-C, keeping the finished prompts


def run_and_report(models: BenchModels, runners, tasks, max_new_tokens, args) -> dict:
    target = models.target()
    tok = target.tokenizer
    tasks = lay_out_fim(target, tasks, max_new_tokens)
    # the limit, at the benchmark's typical context length
    lengths = sorted(len(prompt_ids(tok, t, 0, [])) for t in tasks)
    context = lengths[len(lengths) // 2] + max_new_tokens // 2
    ks = {label: fixed_k(label) for label in runners}
    # T(1..16), and up to T(K+1) for the largest fixed K of a method
    times = measure_forward_times(target.lm, context, max(16, 1 + max((k or 0 for k in ks.values()), default=0)))
    wbytes = weight_bytes(target)
    ceilings = {label: (ceiling(times, k) if k else None) for label, k in ks.items()}
    print(f"machine limit at {context} tokens of context: T(1) = {times[0] * 1e3:.0f} ms, "
          f"{wbytes / 1e9:.2f} GB of weights -> {wbytes / times[0] / 1e9:.1f} GB/s; "
          f"T(n)/T(1) for n=1..{len(times)}: " + " ".join(f"{t / times[0]:.2f}" for t in times), file=sys.stderr)
    print(f"ceiling (K+1)·T(1)/T(K+1) for K=1..{len(times) - 1}: "
          + " ".join(f"{ceiling(times, k):.2f}" for k in range(1, len(times))), file=sys.stderr)
    for label, (runner, _) in runners.items():  # warm-up, excluded
        runner(prompt_ids(tok, tasks[0], 0, []), 8, tasks[0].request(0))

    def loud(rec, ref):
        print(f"\nLOSSLESS CHECK FAILED: {rec.method} differs from {ref} on {rec.subtask}/"
              f"{rec.prompt_id} turn {rec.turn} at generated token {rec.first_difference}",
              file=sys.stderr)

    previous, on_task_done = [], None
    if args is not None and getattr(args, "out", None):
        log = Path(args.out) / RECORDS_LOG
        log.parent.mkdir(parents=True, exist_ok=True)
        if getattr(args, "resume", False) and log.exists():
            previous = read_records(log)
            print(f"resuming: {len(previous)} generations already in {log}", file=sys.stderr)
        else:
            log.write_text("")

        def append_records(task_records):
            with log.open("a") as f:
                for r in task_records:
                    f.write(json.dumps(asdict(r)) + "\n")
        on_task_done = append_records

    records = run_bench(tasks, runners, tok, max_new_tokens, on_mismatch=loud,
                        previous=previous, on_task_done=on_task_done,
                        repeats=getattr(args, "repeats", 1))
    summary = summarize(records)
    if records and args is not None and getattr(args, "memory", False):
        add_peak_memory(summary, models, runners, tasks, tok, max_new_tokens,
                        getattr(args, "temperature", 0.0))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    limit = {"context_tokens": context, "forward_seconds": times, "weight_bytes": wbytes,
             "bandwidth_gb_per_s": wbytes / times[0] / 1e9,
             "ceiling_by_k": {k: ceiling(times, k) for k in range(1, len(times))}}
    table = markdown_table(summary, ceilings)
    by_sub = subtask_table(summary)
    decode_by_sub = subtask_table({m: rows for m, rows in summary.items() if is_ours(m.split(":", 1)[0])},
                                  "decode_speedup_vs_ar")
    print(table)
    if by_sub:
        print()
        print(by_sub)
    if decode_by_sub:
        print("\nwithout prefill (decode time only; ours):\n")
        print(decode_by_sub)
    spec_bench = spec_bench_table(summary)
    if spec_bench:
        print(f"\nvs ar as Spec-Bench computes it ({SPEC_BENCH_METRIC}):\n")
        print(spec_bench)
    vs_llama = subtask_table(summary, "speedup_vs_llamacpp-ar") if "llamacpp-ar" in summary else None
    if vs_llama:
        print("\nvs llamacpp-ar (llama.cpp's plain decoding of the same GGUF):\n")
        print(vs_llama)
    # None when nothing was compared (no reference row in the run): not "0 mismatches"
    mismatches = sum(1 for r in records if r.identical is False) \
        if any(r.identical is not None for r in records) else None
    if mismatches:
        print(f"\nWARNING: {mismatches} generation(s) differ from their reference (lossless check failed)")
    overall = {m: {k: v for k, v in rows["overall"].items()} for m, rows in summary.items()
               if "overall" in rows}
    # rows that change the output by design: never counted as mismatches, never lossless
    lossy = [m for m, rows in summary.items() if rows.get("overall", {}).get("lossy")]
    if lossy:
        print(f"\nLOSSY: {', '.join(lossy)} change the output by design (Medusa's typical acceptance): "
              "not checked against ar, and their speedups are not those of lossless methods")
    overall_json = {"methods": overall, "ceiling": {m: c for m, c in ceilings.items()},
                    "mismatches": mismatches, "lossy_methods": lossy, "peak_rss_bytes": peak_rss}
    if args is not None and getattr(args, "out", None):
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({
            "command": command_line(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "threads": torch.get_num_threads(), "limit": limit, "summary": summary,
            "ceilings": ceilings, "peak_rss_bytes": peak_rss}, indent=1))  # records: RECORDS_LOG
        (out / "report.md").write_text(
            f"# specdecode bench\n\ncommand: `{command_line()}`\n\n"
            f"date: {time.strftime('%Y-%m-%d')}, threads: {torch.get_num_threads()}, "
            f"peak RSS {peak_rss / 2**30:.1f} GiB\n\n## Overall\n\n{table}\n\n"
            + (f"## Speedup vs ar per subtask\n\n{by_sub}\n\n" if by_sub else "")
            + (f"## Decode speedup vs ar per subtask (prefill excluded; ours)\n\n{decode_by_sub}\n"
               if decode_by_sub else "")
            + (f"\n## Speedup vs ar as Spec-Bench computes it\n\nHere a speedup is "
               f"{SPEC_BENCH_METRIC}.\n\n{spec_bench}\n" if spec_bench else "")
            + (f"\n## Speedup vs llamacpp-ar per subtask\n\n{vs_llama}\n" if vs_llama else ""))
        plot(summary, ceilings, out / "speedup.png")
        print(f"wrote {out}/results.json, report.md, speedup.png", file=sys.stderr)
    return {"summary": summary, "records": records, "limit": limit, "overall_json": overall_json}

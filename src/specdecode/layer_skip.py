"""Which layers the target's own draft skips (``--method layer-skip``, ``specdecode tune-skip``).

A layer-skip draft is the target with some decoder layers left out (the residual stream
passes through them), drafting on the target's own KV cache
(:class:`~specdecode.models.native.SelfDraft`); the full model verifies. Which layers to skip
is found on a few calibration prompts and written to a small JSON profile.

The search (:func:`tune_skip`), and why it is not Bayesian optimisation (SWIFT,
arXiv:2410.06916, and Draft & Verify, arXiv:2309.08168, use it: about a thousand
evaluations): each candidate is scored by its predicted speedup, acceptance x measured cost,
from an exact measurement, so a few dozen evaluations suffice:

1. Rank the layers by the draft's agreement with the target when that layer alone is
   skipped (one evaluation per layer, on a part of the calibration tokens).
2. Skip the n lowest-ranked layers for n = 2, 4, 6, ... (each a full evaluation), and stop
   when the predicted speedup has fallen twice in a row; then try n - 1 and n + 1 around
   the best. Layer importance is close to additive for the few layers that are worth skipping
   (the profile lists every evaluated candidate, so this can be checked).

The acceptance of a candidate is measured teacher-forced: for each position of the target's
own greedy continuation of a prompt, whether the draft, given the true context in the
target's cache, predicts the target's next token. The predicted speedup of a speculation
length K is (1 + mean accepted) / (K c + T(K+1)/T(1)), with the accepted length at each
position the run of agreeing positions from there (capped at K), c the draft pass's measured
cost over the target's T(1), and T from :func:`specdecode.profile.verify_profile`. It assumes
the draft's own keys of drafted tokens predict as well as the target's: an upper estimate.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch

from . import config
from .models.base import busy_lock
from .models.loading import LoadedModel
from .profile import profile_path, verify_profile

PROFILE_FORMAT = 1
MAX_K = 8  # speculation lengths the search considers

# written for calibration: none is a Spec-Bench or HumanEval prompt (the bench's prompts)
CALIBRATION_PROMPTS: tuple[tuple[str, str], ...] = (
    ("chat", "Explain in three short paragraphs how a hash table handles collisions."),
    ("chat", "Write a Python function that merges two sorted lists into one sorted list, "
             "with a short docstring."),
    ("chat", "Translate into French: The museum opens at nine and closes at six on weekdays, "
             "but it stays open until ten on Fridays."),
    ("chat", "A train leaves at 14:05 and arrives at 17:50. How long is the journey? "
             "Show your steps."),
    ("completion", "def parse_duration(text: str) -> int:\n    \"\"\"Return the number of seconds "
                   "in a duration such as '1h30m' or '45s'.\"\"\"\n"),
    ("chat", "Summarize the main differences between TCP and UDP for a new programmer."),
)


@dataclass(frozen=True)
class SkipProfile:
    """The layers a layer-skip draft skips, and what choosing them measured.

    skip: skipped layer indices (sorted). k: the speculation length K it predicts best.
    acceptance: the teacher-forced agreement of the draft's next token with the target's
    (0..1). draft_cost: a draft pass's time over the target's T(1). predicted_speedup: over
    plain decoding, from the cost model (module docstring). n_layers, target, weight_format:
    the model it was made for. calibration: prompts and tokens measured. search: every
    evaluated candidate (skip, acceptance, draft_cost, k, predicted_speedup).
    """

    skip: tuple[int, ...]
    k: int
    acceptance: float
    draft_cost: float
    predicted_speedup: float
    n_layers: int
    target: str = ""
    weight_format: str = ""
    calibration: dict | None = None
    search: tuple[dict, ...] = ()

    def layers(self) -> list[int]:
        """The layers the draft runs."""
        return [i for i in range(self.n_layers) if i not in self.skip]

    def to_json(self) -> str:
        """The profile as :meth:`save` writes it and :meth:`load` reads it."""
        return json.dumps(asdict(self) | {"format": PROFILE_FORMAT}, indent=1) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path, n_layers: int | None = None) -> "SkipProfile":
        """Read a profile ``tune-skip`` wrote. Raises ValueError naming the file and what is
        wrong (unreadable, another format, missing or unknown fields, a field of another type,
        layers outside the model's 0..n_layers-1)."""
        make = "make one with `specdecode tune-skip --target NAME --out FILE`"
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"layer-skip profile {path}: cannot be read ({e}); {make}") from None
        if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
            found = f"format {d.get('format')!r}" if isinstance(d, dict) else f"a JSON {type(d).__name__}"
            raise ValueError(f"layer-skip profile {path}: not a profile ({found}; a profile is a JSON "
                             f"object with format {PROFILE_FORMAT!r}); {make}")
        d = {k: v for k, v in d.items() if k != "format"}
        names = {f.name: f for f in fields(cls)}
        missing = [n for n, f in names.items() if f.default is MISSING and n not in d]
        unknown = sorted(set(d) - set(names))
        if missing or unknown:
            raise ValueError(f"layer-skip profile {path}: " + "; ".join(
                filter(None, [missing and f"missing {', '.join(missing)}", unknown and f"unknown fields "
                              f"{', '.join(unknown)}"])) + f"; {make}")
        types = {"skip": list, "k": int, "n_layers": int, "acceptance": (int, float), "draft_cost": (int, float),
                 "predicted_speedup": (int, float), "search": list}
        wrong = [n for n, t in types.items() if n in d and (not isinstance(d[n], t) or isinstance(d[n], bool))]
        if wrong:
            raise ValueError(f"layer-skip profile {path}: " + ", ".join(
                f"{n} = {d[n]!r} is not {'a list' if types[n] is list else 'a number'}" for n in wrong)
                + f"; {make}")
        if not 1 <= d["k"] <= config.MAX_K:
            raise ValueError(f"layer-skip profile {path}: k = {d['k']} is invalid; allowed 1..{config.MAX_K}; {make}")
        p = cls(**{**d, "skip": tuple(d["skip"]), "search": tuple(d.get("search", ()))})
        if n_layers is not None and p.n_layers != n_layers:
            raise ValueError(f"layer-skip profile {path} was made for a model of {p.n_layers} layers, "
                             f"this target has {n_layers}: run `specdecode tune-skip` for it")
        try:
            check_skip(p.skip, p.n_layers)
        except ValueError as e:
            raise ValueError(f"layer-skip profile {path}: {e}; {make}") from None
        return p


def check_skip(skip, n_layers: int) -> tuple[int, ...]:
    """``skip`` as a sorted tuple; ValueError unless it lists at least one layer, distinct
    layers of 0..n_layers-1, and leaves at least one to run."""
    if not skip:
        raise ValueError("no layer to skip: the draft would be the target itself; list the "
                         f"layers to skip (of 0..{n_layers - 1})")
    bad = [i for i in skip if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers]
    if bad or len(set(skip)) != len(skip):
        raise ValueError(f"skipped layers {list(skip)}: allowed: distinct layer indices in "
                         f"0..{n_layers - 1}")
    if len(skip) >= n_layers:
        raise ValueError(f"skipping all {n_layers} layers leaves no draft: skip fewer")
    return tuple(sorted(skip))


def calibration_samples(target: LoadedModel, max_new_tokens: int = 32,
                        prompts: tuple[tuple[str, str], ...] = CALIBRATION_PROMPTS) -> list[tuple[list[int], int]]:
    """(ids, prompt length) per calibration prompt (``(kind, text)``, kind "chat" applies the
    chat template when the tokenizer has one): the prompt's token ids followed by the
    target's greedy continuation (at most ``max_new_tokens`` tokens, ending at EOS)."""
    lm, tok, out = target.lm, target.tokenizer, []
    for kind, text in prompts:
        if kind == "chat" and getattr(tok, "chat_template", None):
            ids = list(tok.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False))
        else:
            ids = tok.encode(text)
        lm.allocate(1, len(ids) + max_new_tokens + 1)
        lm.forward(torch.tensor([ids[:-1]]), num_logits=0)
        n0, last = len(ids), ids[-1]
        for _ in range(max_new_tokens):
            last = int(lm.forward(torch.tensor([[last]]), num_logits=1)[0, -1].argmax())
            ids.append(last)
            if last in target.eos_token_ids:
                break
        out.append((ids, n0))
    return out


class _Evaluator:
    """Teacher-forced agreement of self-drafts with the target on calibration samples: the
    target's cache of each sample is built once and restored before each candidate."""

    def __init__(self, lm, samples):
        self.lm, self.samples, self.snapshots = lm, samples, []
        width = max(len(ids) for ids, _ in samples)
        lm.allocate(1, width)
        for ids, _ in samples:
            lm.rollback(0)
            lm.forward(torch.tensor([ids[:-1]]), num_logits=0)
            n = len(ids) - 1
            self.snapshots.append([(c.k[:, :, :n].clone(), c.v[:, :, :n].clone()) for c in lm.caches])

    def matches(self, layers: list[int], positions: int | None = None) -> list[list[bool]]:
        """For each sample, whether the draft over ``layers`` predicts each continuation token
        (the first ``positions`` of each, default all), in order."""
        lm, draft = self.lm, self.lm.self_draft(layers)
        out = []
        for (ids, n0), snap in zip(self.samples, self.snapshots):
            n = len(ids) - 1
            for c, (k, v) in zip(lm.caches, snap):
                c.k[:, :, :n], c.v[:, :, :n] = k, v
            last = n0 - 1 + (positions if positions is not None else n)
            hits = []
            # backwards: the draft's pass at position i writes slot i, which no later
            # (earlier-position) pass reads
            for i in range(min(n, last) - 1, n0 - 2, -1):
                lm.seq_len = i
                draft.allocate(1, lm.max_len)
                logits = draft.forward(torch.tensor([[ids[i]]]), num_logits=1)
                hits.append(int(logits[0, -1].argmax()) == ids[i + 1])
            out.append(hits[::-1])
        return out


def draft_cost(lm, layers: list[int], context: int = 128, repeats: int = 9) -> float:
    """A self-draft pass's time over a full one-token pass (``layers``: those it runs),
    interleaved, medians of ``repeats``, after ``context`` random cached tokens."""
    lm.allocate(1, context + 2)
    g = torch.Generator().manual_seed(0)
    lm.forward(torch.randint(0, lm.vocab_size, (1, context), generator=g), num_logits=0)
    draft, x = lm.self_draft(layers), torch.tensor([[1]])
    full, part = [], []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        lm.forward(x, num_logits=1)
        t1 = time.perf_counter()
        lm.rollback(context)
        draft.allocate(1, lm.max_len)
        draft.forward(x, num_logits=1)
        t2 = time.perf_counter()
        if r:  # the first round warms both up
            full.append(t1 - t0)
            part.append(t2 - t1)
    return statistics.median(part) / statistics.median(full)


def predicted_speedup(matches: list[list[bool]], cost: float, verify_ratio: list[float]) -> tuple[int, float]:
    """(best K, its predicted speedup over plain decoding): see the module docstring.
    verify_ratio[n-1] = T(n)/T(1) for n = 1..MAX_K+1."""
    runs = []
    for hits in matches:
        run = 0
        for h in reversed(hits):  # the run of agreeing positions starting at each position
            run = run + 1 if h else 0
            runs.append(run)
    if not runs:
        return 1, 0.0
    best = (1, 0.0)
    for k in range(1, min(MAX_K, len(verify_ratio) - 1) + 1):
        tokens = 1 + sum(min(r, k) for r in runs) / len(runs)
        speed = tokens / (k * cost + verify_ratio[k])
        if speed > best[1]:
            best = (k, speed)
    return best


def tune_skip(target: LoadedModel, max_new_tokens: int = 32, rank_positions: int = 12,
              progress: bool = True, prompts: tuple[tuple[str, str], ...] = CALIBRATION_PROMPTS) -> SkipProfile:
    """Choose the layers the target's layer-skip draft skips (module docstring): the
    candidate of the highest predicted speedup. Uses the target's KV cache (not while it
    generates); ``progress`` draws a bar on stderr. Raises ValueError for a target outside
    the native runtime (no layer subsets), RuntimeError while the target generates."""
    lm = target.lm
    if not hasattr(lm, "self_draft"):
        raise ValueError(f"layer skipping needs the native runtime; this target is {type(lm).__name__}")
    times = verify_profile(target, MAX_K)  # (takes the lock itself)
    lock = busy_lock(lm)
    if not lock.acquire(blocking=False):
        raise RuntimeError(f"{target.name} is generating (a batch or another request holds its KV "
                           "cache), so the layers its draft skips cannot be measured now: run "
                           "`specdecode tune-skip` first, or give the layers (layer-skip:layers=...)")
    try:
        return _tune(target, times, max_new_tokens, rank_positions, progress, prompts)
    finally:
        lock.release()


def _tune(target, times, max_new_tokens, rank_positions, progress, prompts) -> SkipProfile:
    from tqdm import tqdm

    lm = target.lm
    nl = lm.args.n_layers
    ratio = [t / times[0] for t in times]
    # at least one layer runs (the draft must have one); at most two thirds are skipped
    sizes = [n for n in range(2, (2 * nl) // 3 + 1, 2) if n < nl] or [1]
    bar = tqdm(total=len(prompts) + nl + len(sizes) + 2, desc="tune-skip", unit="eval",
               disable=not progress, leave=False)
    samples = []
    for p in prompts:
        samples += calibration_samples(target, max_new_tokens, (p,))
        bar.update()
    ev = _Evaluator(lm, samples)
    single = []
    for layer in range(nl):
        m = ev.matches([i for i in range(nl) if i != layer], rank_positions)
        hits = [h for row in m for h in row]
        single.append(sum(hits) / max(1, len(hits)))
        bar.update()
    order = sorted(range(nl), key=lambda i: (-single[i], i))  # most skippable first
    costs: dict[int, float] = {}
    evaluated: dict[int, dict] = {}

    def evaluate(n: int) -> float:
        if n not in evaluated:
            skip = tuple(sorted(order[:n]))
            layers = [i for i in range(nl) if i not in skip]
            m = ev.matches(layers)
            hits = [h for row in m for h in row]
            if n not in costs:
                costs[n] = draft_cost(lm, layers)
            k, speed = predicted_speedup(m, costs[n], ratio)
            evaluated[n] = dict(skip=list(skip), acceptance=round(sum(hits) / max(1, len(hits)), 4),
                                draft_cost=round(costs[n], 4), k=k, predicted_speedup=round(speed, 4))
            bar.update()
        return evaluated[n]["predicted_speedup"]

    falls, prev = 0, None
    for n in sizes:
        s = evaluate(n)
        falls = falls + 1 if prev is not None and s < prev else 0
        prev = s
        if falls == 2:
            break
    best = max(evaluated, key=lambda n: evaluated[n]["predicted_speedup"])
    for n in (best - 1, best + 1):
        if 1 <= n < nl:
            evaluate(n)
    bar.close()
    best = max(evaluated, key=lambda n: evaluated[n]["predicted_speedup"])
    e = evaluated[best]
    return SkipProfile(tuple(e["skip"]), e["k"], e["acceptance"], e["draft_cost"],
                       e["predicted_speedup"], nl, target.name, lm.weight_format,
                       dict(prompts=len(prompts), tokens=sum(len(i) - n for i, n in samples),
                            single_layer_agreement=[round(a, 4) for a in single]),
                       tuple(evaluated[n] for n in sorted(evaluated)))


def default_profile_path(target: LoadedModel) -> Path:
    """Where the target's default profile is cached."""
    return profile_path(target, "layer-skip", PROFILE_FORMAT)[1]


def default_profile(target: LoadedModel, progress: bool = True) -> SkipProfile:
    """The target's layer-skip profile, made by :func:`tune_skip` once and cached per model
    and machine (as the forward-time profiles are: :func:`specdecode.profile.profile_path`)."""
    path = default_profile_path(target)
    try:
        return SkipProfile.load(path, target.lm.args.n_layers)
    except ValueError:
        pass
    if progress:
        import sys
        print(f"layer-skip: choosing the layers {target.name} skips (once, about 2 minutes for the "
              f"default target on 2 cores; cached in {path}; an interrupted search starts over; "
              "layer-skip:layers=3+5-8 skips chosen layers without it)", file=sys.stderr)
    profile = tune_skip(target, progress=progress)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        profile.save(path)
    except OSError:
        pass  # a read-only cache only costs the search again next time
    return profile

"""Which layers the target's own draft skips (``--method layer-skip``, ``specdecode tune-skip``).

A layer-skip draft is the target with some decoder layers left out (the residual stream
passes through them), drafting on the target's own KV cache
(:class:`~specdecode.models.self_draft.SelfDraft`); the full model verifies. It may also leave out
single sublayers, a layer's attention or its MLP (SWIFT, arXiv:2410.06916, skips the two
separately): the residual stream passes through the skipped one. Which layers (and
sublayers) to skip is found on a few calibration prompts and written to a small JSON profile.

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

With ``sublayers`` (``tune-skip --sublayers``, opt-in) the candidates of both steps are each
layer's attention and MLP sublayers separately, 2 x n_layers of them: about twice the
evaluations; a layer both of whose sublayers are chosen is skipped whole. Step 1 then ranks
by agreement lost per weight skipped, (1 - agreement) / the sublayer's weights
(:func:`~specdecode.models.self_draft.sublayer_weights`), not by agreement alone: a one-token
pass is bound by the bytes of weights it reads, and an attention sublayer holds an eighth of
a layer's (5.5 M of 46.8 M parameters in the default target), so ranking by agreement alone
fills the draft with attention sublayers that save little. Each candidate's cost is
measured as a whole-layer one's is (:func:`draft_cost`).

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
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from . import config
from .models.base import SelfDrafting, busy_lock
from .models.loading import LoadedModel
from .models.self_draft import sublayer_weights
from .profile import profile_path, verify_profile

# Profile format 1. skip_attn and skip_mlp (skipped sublayers) came later within it: a
# profile without them skips whole layers only, and one that skips no sublayer is written
# without them, so older files load unchanged and files of whole layers read as before.
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

    skip: skipped layer indices (sorted). skip_attn, skip_mlp: layers (not in skip, sorted)
    whose attention, or MLP, sublayer alone is skipped (absent in older profiles: none). k:
    the speculation length K it predicts best.
    acceptance: the teacher-forced agreement of the draft's next token with the target's
    (0..1). draft_cost: a draft pass's time over the target's T(1). predicted_speedup: over
    plain decoding, from the cost model (module docstring). n_layers, target, weight_format:
    the model it was made for. calibration: prompts and tokens measured. search: every
    evaluated candidate (skip, acceptance, draft_cost, k, predicted_speedup; with sublayers also
    skip_attn, skip_mlp). source: the file :meth:`load` read it from ("" otherwise; not saved).
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
    skip_attn: tuple[int, ...] = ()
    skip_mlp: tuple[int, ...] = ()
    # the file it was read from (for messages; not written)
    source: str = field(default="", compare=False, repr=False)

    def layers(self) -> list[int]:
        """The layers the draft runs (some of them with a sublayer skipped: skip_attn,
        skip_mlp)."""
        return [i for i in range(self.n_layers) if i not in self.skip]

    def check_layers(self, n_layers: int, name: str) -> None:
        """Raises ValueError (naming the profile ``name``) unless it was made for a model of
        ``n_layers`` layers."""
        if self.n_layers != n_layers:
            raise ValueError(f"layer-skip profile {name} was made for a model of {self.n_layers} "
                             f"layers, this target has {n_layers}: run `specdecode tune-skip` for it")

    def to_json(self) -> str:
        """The profile as :meth:`save` writes it and :meth:`load` reads it (without
        skip_attn / skip_mlp when empty: see PROFILE_FORMAT)."""
        d = {k: v for k, v in asdict(self).items() if (v or k not in ("skip_attn", "skip_mlp")) and k != "source"}
        return json.dumps(d | {"format": PROFILE_FORMAT}, indent=1) + "\n"

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
        names = {f.name: f for f in fields(cls) if f.name != "source"}
        missing = [n for n, f in names.items() if f.default is MISSING and n not in d]
        unknown = sorted(set(d) - set(names))
        if missing or unknown:
            raise ValueError(f"layer-skip profile {path}: " + "; ".join(
                filter(None, [missing and f"missing {', '.join(missing)}", unknown and f"unknown fields "
                              f"{', '.join(unknown)}"])) + f"; {make}")
        types = {"skip": list, "skip_attn": list, "skip_mlp": list, "k": int, "n_layers": int, "acceptance": (int, float), "draft_cost": (int, float),
                 "predicted_speedup": (int, float), "search": list}
        wrong = [n for n, t in types.items() if n in d and (not isinstance(d[n], t) or isinstance(d[n], bool))]
        if wrong:
            raise ValueError(f"layer-skip profile {path}: " + ", ".join(
                f"{n} = {d[n]!r} is not {'a list' if types[n] is list else 'a number'}" for n in wrong)
                + f"; {make}")
        if not 1 <= d["k"] <= config.MAX_K:
            raise ValueError(f"layer-skip profile {path}: k = {d['k']} is invalid; allowed 1..{config.MAX_K}; {make}")
        p = cls(**{**d, "skip": tuple(d["skip"]), "search": tuple(d.get("search", ())),
                   "skip_attn": tuple(d.get("skip_attn", ())), "skip_mlp": tuple(d.get("skip_mlp", ())),
                   "source": str(path)})
        if n_layers is not None:
            p.check_layers(n_layers, str(path))
        try:
            skip, attn, mlp = check_skips(p.skip, p.skip_attn, p.skip_mlp, p.n_layers)
        except ValueError as e:
            raise ValueError(f"layer-skip profile {path}: {e}; {make}") from None
        return replace(p, skip=skip, skip_attn=attn, skip_mlp=mlp)


def check_skips(skip, skip_attn, skip_mlp, n_layers: int
                ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(skipped layers, skipped attention sublayers, skipped MLP sublayers) as sorted tuples,
    a layer whose attention and MLP are both listed moved to the skipped layers, and the
    sublayers of a skipped layer dropped (skipped with it). ValueError unless they list at
    least one layer or sublayer, each list distinct layers of 0..n_layers-1 (the message
    names the list and its values), and at least one layer runs."""
    skip, skip_attn, skip_mlp = (list(x or ()) for x in (skip, skip_attn, skip_mlp))
    if not (skip or skip_attn or skip_mlp):
        raise ValueError("no layer to skip: the draft would be the target itself; list the "
                         f"layers (or attention / MLP sublayers) to skip (of 0..{n_layers - 1})")
    for what, ids in (("skipped layers", skip), ("skipped attention sublayers", skip_attn),
                      ("skipped MLP sublayers", skip_mlp)):
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"{what} {ids}: allowed: distinct layer indices in 0..{n_layers - 1}")
    whole = set(skip) | (set(skip_attn) & set(skip_mlp))
    if len(whole) >= n_layers:
        raise ValueError(f"skipping all {n_layers} layers leaves no draft: skip fewer")
    return (tuple(sorted(whole)), tuple(sorted(set(skip_attn) - whole)),
            tuple(sorted(set(skip_mlp) - whole)))


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

    def matches(self, layers: list[int], positions: int | None = None, skip_attn=(),
                skip_mlp=()) -> list[list[bool]]:
        """For each sample, whether the draft over ``layers`` (with the attention sublayers of
        ``skip_attn`` and the MLP sublayers of ``skip_mlp`` skipped) predicts each
        continuation token (the first ``positions`` of each, default all), in order."""
        lm, draft = self.lm, self.lm.self_draft(layers, skip_attn=skip_attn, skip_mlp=skip_mlp)
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


def draft_cost(lm, layers: list[int], context: int = 128, repeats: int = 9, skip_attn=(),
               skip_mlp=()) -> float:
    """A self-draft pass's time over a full one-token pass (``layers``: those it runs;
    ``skip_attn``, ``skip_mlp``: its skipped sublayers), interleaved, medians of
    ``repeats``, after ``context`` random cached tokens."""
    lm.allocate(1, context + 2)
    g = torch.Generator().manual_seed(0)
    lm.forward(torch.randint(0, lm.vocab_size, (1, context), generator=g), num_logits=0)
    draft, x = lm.self_draft(layers, skip_attn=skip_attn, skip_mlp=skip_mlp), torch.tensor([[1]])
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
              progress: bool = True, prompts: tuple[tuple[str, str], ...] = CALIBRATION_PROMPTS,
              sublayers: bool = False) -> SkipProfile:
    """Choose the layers the target's layer-skip draft skips (module docstring): the
    candidate of the highest predicted speedup. ``sublayers``: the candidates are each
    layer's attention and MLP sublayers separately (about twice the evaluations). Uses the
    target's KV cache (not while it generates); ``progress`` draws a bar on stderr. Raises
    ValueError for a target outside the native runtime (no layer subsets), RuntimeError
    while the target generates."""
    lm = target.lm
    if not isinstance(lm, SelfDrafting):
        raise ValueError(f"layer skipping needs the native runtime; this target is {type(lm).__name__}")
    times = verify_profile(target, MAX_K)  # (takes the lock itself)
    lock = busy_lock(lm)
    if not lock.acquire(blocking=False):
        raise RuntimeError(f"{target.name} is generating (a batch or another request holds its KV "
                           "cache), so the layers its draft skips cannot be measured now: run "
                           "`specdecode tune-skip` first, or give the layers (layer-skip:layers=...)")
    try:
        return _tune(target, times, max_new_tokens, rank_positions, progress, prompts, sublayers)
    finally:
        lock.release()


def _tune(target, times, max_new_tokens, rank_positions, progress, prompts, sublayers=False) -> SkipProfile:
    from tqdm import tqdm

    lm = target.lm
    nl = lm.args.n_layers
    ratio = [t / times[0] for t in times]
    # the candidates: layers, or with sublayers (layer, 0) attention and (layer, 1) MLP
    units = [(i, part) for part in (0, 1) for i in range(nl)] if sublayers else list(range(nl))
    nu = len(units)
    # at least one layer runs (the draft must have one); at most two thirds are skipped
    sizes = [n for n in range(2, (2 * nu) // 3 + 1, 2) if n < nu] or [1]
    bar = tqdm(total=len(prompts) + nu + len(sizes) + 2, desc="tune-skip", unit="eval",
               disable=not progress, leave=False)
    samples = []
    for p in prompts:
        samples += calibration_samples(target, max_new_tokens, (p,))
        bar.update()
    ev = _Evaluator(lm, samples)

    def skips(chosen) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        if not sublayers:
            return tuple(sorted(chosen)), (), ()
        return check_skips((), [i for i, part in chosen if part == 0],
                           [i for i, part in chosen if part == 1], nl)

    def agreement(m) -> float:
        hits = [h for row in m for h in row]
        return sum(hits) / max(1, len(hits))

    single = []
    for unit in units:
        skip, attn, mlp = skips([unit])
        single.append(agreement(ev.matches([i for i in range(nl) if i not in skip], rank_positions,
                                           attn, mlp)))
        bar.update()
    # most skippable first: for whole layers (equal bytes) the best agreement; for sublayers
    # the least agreement lost per weight skipped (module docstring)
    weight = [sublayer_weights(lm.args)[unit[1]] for unit in units] if sublayers else [1] * nu
    order = sorted(range(nu), key=lambda u: ((1 - single[u]) / weight[u], u))
    evaluated: dict[int, dict] = {}

    def evaluate(n: int) -> float:
        if n not in evaluated:
            skip, attn, mlp = skips([units[u] for u in order[:n]])
            layers = [i for i in range(nl) if i not in skip]
            m = ev.matches(layers, None, attn, mlp)
            cost = draft_cost(lm, layers, skip_attn=attn, skip_mlp=mlp)
            k, speed = predicted_speedup(m, cost, ratio)
            evaluated[n] = dict(skip=list(skip), acceptance=round(agreement(m), 4),
                                draft_cost=round(cost, 4), k=k, predicted_speedup=round(speed, 4))
            if sublayers:
                evaluated[n] |= dict(skip_attn=list(attn), skip_mlp=list(mlp))
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
        if 1 <= n < nu:
            evaluate(n)
    bar.close()
    best = max(evaluated, key=lambda n: evaluated[n]["predicted_speedup"])
    e = evaluated[best]
    calibration = dict(prompts=len(prompts), tokens=sum(len(i) - n for i, n in samples))
    if sublayers:
        calibration["single_sublayer_agreement"] = dict(attn=[round(a, 4) for a in single[:nl]],
                                                         mlp=[round(a, 4) for a in single[nl:]])
    else:
        calibration["single_layer_agreement"] = [round(a, 4) for a in single]
    return SkipProfile(tuple(e["skip"]), e["k"], e["acceptance"], e["draft_cost"],
                       e["predicted_speedup"], nl, target.name, lm.weight_format, calibration,
                       tuple(evaluated[n] for n in sorted(evaluated)),
                       tuple(e.get("skip_attn", ())), tuple(e.get("skip_mlp", ())))


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

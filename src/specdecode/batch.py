"""Batched speculative decoding: many requests share each target forward (continuous
batching).

Every step, each active row contributes its last token plus its own K draft tokens (K may
differ per row, 0 included); one verify pass of rows of their own lengths
(:meth:`~specdecode.models.native.Transformer.forward_rows`) scores them all; each row then
runs exactly the per-request code of a request alone (:class:`~specdecode.engine.RequestRun`:
its acceptance rule, stop rules, seed and sampling parameters), and its cache row rolls back
to its own length. Requests join free rows between steps and leave when they end. A joining
request's prefill is the one-row passes of a request alone
(:meth:`~specdecode.models.native.Transformer.forward_row`), one chunk of at most
``PREFILL_CHUNK`` tokens a step (the chunks a request alone runs, so the same bits), so it
stalls the rows already generating by one chunk's pass at most; it takes part in the verify
pass of the step its prefill ends. With the native runtime's row-independent kernels (q4, int8, int4 on the CPU
kernel: linears, attention) a row's logits are bit for bit those of its request run alone,
so each output equals its solo run, greedy or seeded, whatever else is in the batch.
Draft heads (Medusa, EAGLE-3) get their row's hidden states of the prefill chunks and of
the accepted rows of each verify pass, as a request alone hands them over. A row's draft
tree takes its place in the same pass: its own tree mask and positions (the other rows:
causal, at their own positions), and afterwards only its accepted path's cache entries are
kept (:meth:`~specdecode.models.native.Transformer.compact` on its row), as alone.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .config import SamplingParams
from .costmodel import expected_tokens, relative_cost
from .engine import Generation, RequestRun, check_request, hold
from .heads import check_heads_target
from .models.base import BatchLM, BindableDraft
from .models.attention import SDPA_MIN_TOKENS
from .models.self_draft import SelfDraft
from .proposers import Proposer
from .schedule import FixedK, Schedule
from .stats import SpecDecodingStats
from .tree import check_tree_target


def choose_lengths(alphas: list[float], draft_seconds: list[float], wanted: list[int],
                   fixed: list[bool], forward_seconds: list[float],
                   overhead_s: float = 0.0, batched: list[bool] | None = None) -> list[int]:
    """Each row's K for one batched round: the lengths (k_i <= wanted_i) that maximise the
    batch's expected tokens per second,
    Σ_i E(k_i) / (T(Σ_i (k_i + 1)) + O + Σ_i c_i·k_i),
    with E(k) = 1 + α + ... + α^k per row (acceptance α_i; Leviathan et al.,
    arXiv:2211.17192 §3.1), T(n) the target's measured time for a pass of n tokens
    (``forward_seconds``, T(1..)), O the round's time outside the forward pass and the
    drafts (``overhead_s``: logits processing, acceptance, bookkeeping; it favours fewer,
    longer rounds) and c_i the row's drafting time per token (its draft model steps on its
    own; 0 for lookups). Rows marked ``batched`` draft in one pass with each other
    (:class:`DraftRows`): their drafting costs c·Σ_j T(m_j)/T(1), m_j the rows still drafting at
    step j, with the target's T(n)/T(1) standing in for the draft's (the same family of
    model on the same memory-bound CPU). Rows marked ``fixed`` keep k = wanted (a seeded request
    of the rejection rule: its draws depend on K). Greedy: one draft token at a time to the
    row where it raises the rate most, or to every open row at once where that raises it
    more, while it does. As the batch grows, T(n) grows and speculation turns off where it
    stops paying."""
    t1 = forward_seconds[0]
    costs = [t / t1 for t in forward_seconds]
    k = [w if f else 0 for w, f in zip(wanted, fixed)]

    together = batched or [False] * len(alphas)
    c_batched = max((c for c, b in zip(draft_seconds, together) if b), default=0.0)

    def rate(ks):
        tokens = sum(expected_tokens([a] * n, n) for a, n in zip(alphas, ks))
        drafting = sum(c * n for c, n, b in zip(draft_seconds, ks, together) if not b)
        steps = max((n for n, b in zip(ks, together) if b), default=0)
        drafting += c_batched * sum(relative_cost(costs, sum(1 for n, b in zip(ks, together) if b and n > j))
                                    for j in range(steps))
        seconds = t1 * relative_cost(costs, sum(n + 1 for n in ks)) + overhead_s + drafting
        return tokens / seconds

    best = rate(k)
    while True:
        step = None
        open_rows = [i for i, (n, w, f) in enumerate(zip(k, wanted, fixed)) if not f and n < w]
        # one more draft token for one row, or for every row at once (batched rows share
        # each draft step: one row alone may not pay for a step that all of them do)
        for move in [[i] for i in open_rows] + ([open_rows] if len(open_rows) > 1 else []):
            for i in move:
                k[i] += 1
            r = rate(k)
            for i in move:
                k[i] -= 1
            if r > best and (step is None or r > step[0]):
                step = (r, move)
        if step is None:
            return k
        best = step[0]
        for i in step[1]:
            k[i] += 1


class _Status:
    """What a row's :class:`RequestRun` writes its end into; copied to the request's
    :class:`Generation` when the block that ended it is handed out."""

    def __init__(self, gen: Generation):
        self.stats, self.token_info, self.finish_reason = gen.stats, gen.token_info, None


@dataclass
class _Waiting:
    gen: Generation
    status: _Status
    prompt: list[int]
    params: SamplingParams
    eos: frozenset
    decode: object
    proposer: Proposer | None
    schedule: Schedule | None
    draft_seconds: float | None
    fixed_k: bool


class MeasuredRates:
    """The batch's measured tokens per second in rounds with speculation and without, per
    number of active rows, and the choice between them: the one measured faster (tokens over
    seconds of its last ``window`` rounds: a round that fed a draft what it had skipped
    counts, and a lookup's rare long acceptances are not discarded as a median would), the
    other tried after ``explore_every`` rounds to keep its figure fresh (the gap doubles, up
    to ``8 * explore_every``, each time the trial leaves the choice as it was, and returns to
    ``explore_every`` when it changes it); plain rounds are measured
    first, then speculative ones, ``min_rounds`` each. A number of rows where speculation was
    not measured yet borrows the verdict of its neighbours, since speculation pays less as
    the batch grows (a verify pass of n tokens costs T(n), which grows with n): measured
    slower with fewer rows, it is not tried with more; measured faster with more, it is
    taken with fewer. It keeps the batch from running slower than plain decoding where the
    cost model misjudges: speculation must never make a server much slower than plain
    batched decoding (docs/server.md)."""

    def __init__(self, window: int = 16, min_rounds: int = 3, explore_every: int = 16):
        self.window, self.min_rounds, self.explore_every = window, min_rounds, explore_every
        self._rates: dict[tuple[int, bool], deque] = {}
        # per number of rows: rounds until the other kind is tried, the gap after that, and
        # the choice the last trial was made against
        self._explore: dict[int, list] = {}
        self.trial = False

    def rate(self, rows: int, speculative: bool) -> float | None:
        """Tokens/s of the last rounds of this kind at this batch size (None: fewer than
        ``min_rounds``)."""
        seen = self._rates.get((rows, speculative))
        if seen is None or len(seen) < self.min_rounds:
            return None
        return sum(t for t, _ in seen) / sum(s for _, s in seen)

    def speculate(self, rows: int) -> bool:
        """Whether this round (``rows`` active) should speculate. Sets ``trial``: True when it
        speculates without having been measured faster (a trial, whose speculation may not
        go on)."""
        self.trial = False
        off, on = self.rate(rows, False), self.rate(rows, True)
        if off is None:
            return False
        if on is None:
            verdicts = {r: self._faster(r) for r, s in self._rates if s}
            if any(v for r, v in verdicts.items() if r > rows):
                return True
            self.trial = not any(v is False for r, v in verdicts.items() if r < rows)
            return self.trial
        best = on >= off
        state = self._explore.setdefault(rows, [self.explore_every, self.explore_every, None])
        if state[2] is not None:  # the round after a trial: did it change the choice?
            state[1] = self.explore_every if best != state[2] else min(2 * state[1], 8 * self.explore_every)
            state[0], state[2] = state[1], None
        state[0] -= 1
        if state[0] > 0:
            return best
        state[2] = best
        self.trial = not best
        return not best

    def _faster(self, rows: int) -> bool | None:
        """Whether speculation was measured faster at this number of rows (None: not both
        measured)."""
        off, on = self.rate(rows, False), self.rate(rows, True)
        return None if off is None or on is None else on >= off

    def record(self, rows: int, speculative: bool, tokens: int, seconds: float) -> None:
        if seconds > 0:
            self._rates.setdefault((rows, speculative), deque(maxlen=self.window)).append((tokens, seconds))


PROBE_EVERY = 8  # rounds without drafts after which a row the policy stopped tries one again
# the acceptance a row is assumed to start from (the default pair's drafts are accepted 55-75 %
# of the time, BENCHMARKS.md), worth this many draft tokens of evidence
PRIOR_ALPHA, PRIOR_WEIGHT = 0.7, 8


@dataclass
class _Row:
    """A request in a row: its rounds, held proposer locks, admission time, generation,
    drafting cost per token and whether its K is its own (for the K policy)."""

    run: RequestRun
    locks: list
    t0: float
    gen: Generation
    draft_seconds: float | None
    fixed_k: bool = False
    prompt: list[int] | None = None  # the prompt while its prefill runs; None once it is done
    prefilled: int = 0  # prompt tokens in the row's cache so far
    # a draft head's prompt states (start, states) made by the prefill chunks so far: handed
    # over once the run begins (RequestRun.begin resets the proposer, which would drop them)
    prompt_hidden: list = field(default_factory=list)


# draft passes of up to this many tokens a row are batched (the attention kernel's range, so
# each row takes the path it takes alone); longer ones (a lazy prefill) run as that row alone,
# in the chunks a request alone runs
SMALL_PASS = SDPA_MIN_TOKENS


class DraftRows:
    """One draft model's KV cache with a row per batch row, so that the rows' draft passes
    run as one (a draft step of B rows costs about one of 1 row on a memory-bound CPU).

    draft: the draft's model (forked here: its weights shared, a cache of its own);
    :meth:`view` gives each request a model of its own (:class:`DraftRowView`) for its
    proposer; :meth:`run` runs the passes those views asked for. Each row's bits are those
    of the draft run alone (row-independent kernels; a long pass runs alone).
    """

    def __init__(self, draft, max_batch: int, max_len: int):
        self.lm = draft.fork()
        self.max_len = min(max_len, draft.max_context)
        self.lm.allocate(max_batch, self.max_len)

    def view(self) -> "DraftRowView":
        return DraftRowView(self)

    def _set_length(self, row: int, n: int) -> None:
        lengths = list(self.lm.row_lengths)
        lengths[row] = n
        self.lm.rollback_rows(lengths)

    def run(self, passes: list[tuple[int, torch.Tensor, int]]) -> list[torch.Tensor]:
        """Logits [1, n, V] of each (row, input_ids [1, T], n) pass: the short ones in one
        pass over the span of their rows, the long ones each alone."""
        out: list[torch.Tensor | None] = [None] * len(passes)
        short = [i for i, (_, ids, _) in enumerate(passes) if ids.shape[1] <= SMALL_PASS]
        for i, (row, ids, n) in enumerate(passes):
            if ids.shape[1] > SMALL_PASS:
                out[i] = self.lm.forward_row(row, ids, n)
        if short:
            rows = [passes[i][0] for i in short]
            first, stop = min(rows), max(rows) + 1
            width = max(passes[i][1].shape[1] for i in short)
            n_max = max(passes[i][2] for i in short)
            x = torch.zeros(stop - first, width, dtype=torch.long)
            lengths = [0] * (stop - first)
            for i in short:
                row, ids, _ = passes[i]
                x[row - first, :ids.shape[1]] = ids[0]
                lengths[row - first] = ids.shape[1]
            logits = self.lm.forward_span(first, stop, x, lengths, num_logits=n_max).logits
            for i in short:
                row, _, n = passes[i]
                out[i] = logits[row - first:row - first + 1, n_max - n:n_max]
        return out


class DraftRowView:
    """One request's draft model inside a :class:`DraftRows`: the CausalLM calls a
    :class:`~specdecode.proposers.DraftModelProposer` makes, on the row the batch gives the
    request (:meth:`bind`)."""

    def __init__(self, rows: DraftRows):
        self.rows, self.row = rows, None
        self.vocab_size = rows.lm.vocab_size
        self.max_context = rows.max_len
        self.weight_format = rows.lm.weight_format

    def bind(self, row: int) -> None:
        self.row = row
        self.rows._set_length(row, 0)

    @property
    def seq_len(self) -> int:
        return self.rows.lm.row_lengths[self.row]

    def allocate(self, batch: int, max_len: int) -> None:
        if batch != 1 or max_len > self.max_context:
            raise ValueError(f"a draft row holds one request of at most {self.max_context} "
                             f"positions, asked for {batch} x {max_len}")
        self.rows._set_length(self.row, 0)

    def forward(self, input_ids: torch.Tensor, num_logits: int | None = None) -> torch.Tensor:
        return self.rows.lm.forward_row(self.row, input_ids, num_logits)

    def rollback(self, length: int) -> None:
        self.rows._set_length(self.row, length)


def _hidden_keys(run: RequestRun) -> tuple[int, ...]:
    """The target hidden states a row's proposer reads (a draft head's), () for the others."""
    return tuple(run.proposer.hidden_keys) if run.proposer is not None else ()


class BatchEngine:
    """Runs many requests on one native target, ``max_batch`` rows at a time.

    target: a :class:`~specdecode.models.native.Transformer` (the batched pass needs rows of
    their own lengths; the transformers and llama.cpp adapters have none: ValueError).
    max_len: positions per row (prompt + new tokens of any request). Holds the target's busy
    lock until :meth:`close`. Each request brings its own proposer (one whose draft model has
    a KV cache of its own, e.g. a fork) and K schedule. forward_seconds: the target's
    measured T(1..n) (:func:`specdecode.profile.verify_profile`); with it, each round's K per
    row is chosen for the whole batch (:func:`choose_lengths`, at most what the row's own
    schedule asks), and a round speculates only while such rounds are measured faster than
    rounds without at this number of rows (:class:`MeasuredRates`, ``rates``); a lone row,
    and every row without it, takes its own schedule's K. debug: check every row's cache
    invariant after each step.
    """

    def __init__(self, target, max_batch: int, max_len: int, debug: bool = False,
                 forward_seconds: list[float] | None = None):
        if not isinstance(target, BatchLM):
            raise ValueError(f"batched decoding needs the native runtime (rows of their own "
                             f"lengths); this target is {type(target).__name__}")
        if not (isinstance(max_batch, int) and max_batch >= 1):
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if not (isinstance(max_len, int) and 2 <= max_len <= target.max_context):
            raise ValueError(f"max_len must be 2..{target.max_context} (the target's context), got {max_len!r}")
        self.target, self.max_len, self.debug = target, max_len, debug
        self.forward_seconds = forward_seconds
        self._held = hold([target], None)
        target.allocate(max_batch, max_len)
        self.rows: list[_Row | None] = [None] * max_batch
        self.waiting: deque[_Waiting] = deque()
        self._blocks: dict[Generation, deque] = {}  # blocks made, not yet handed out
        self._overhead_s = 0.0  # a round's time outside its forward pass and drafts (decayed mean)
        self.rates = MeasuredRates()
        self._draft_rows: dict[tuple, DraftRows] = {}  # (id(draft model), positions) -> its rows
        self.max_batch = max_batch

    def draft_view(self, draft, max_len: int | None = None) -> DraftRowView:
        """A model for one request's draft-model proposer whose passes this batch runs
        together with the other requests' passes of the same draft (``draft``: its model;
        one cache row per batch row, allocated on first use). max_len: the draft's positions
        a row (default the batch's: a draft of another tokenizer needs more, as alone)."""
        key = (id(draft), max_len or self.max_len)
        rows = self._draft_rows.get(key)
        if rows is None:
            rows = self._draft_rows[key] = DraftRows(draft, self.max_batch, key[1])
        return rows.view()

    def close(self) -> None:
        """Cancel every request still in flight or waiting and free the target."""
        for b, row in enumerate(self.rows):
            if row is not None:
                self._free(b)
        self.waiting.clear()
        for lock in self._held:
            lock.release()
        self._held = []

    def add(self, input_ids: list[int], params: SamplingParams, eos_token_ids: tuple[int, ...] = (),
            decode=None, proposer: Proposer | None = None,
            schedule: Schedule | None = None, draft_seconds_per_token: float | None = None,
            fixed_k: bool = False) -> Generation:
        """Queue a request (it joins at the next :meth:`step` with a free row); returns its
        :class:`~specdecode.engine.Generation`, whose ``token_ids``, ``finish_reason`` and
        ``stats`` fill in as steps run. draft_seconds_per_token: what one draft token costs
        this request (its draft model's T(1)), for the batch's K policy (default: a quarter
        of the target's T(1) with a draft model, 0 for lookups). fixed_k: the request chose
        its K itself: its schedule's K is used every round, not the policy's. Raises ValueError as
        :meth:`Engine.generate`, when prompt + max_new_tokens exceeds max_len, and for a
        proposer of draft trees on a target whose tree passes are not exact
        (:func:`~specdecode.tree.check_tree_target`)."""
        prompt, eos = check_request(self.target, input_ids, params, eos_token_ids, decode)
        if proposer is not None and proposer.makes_trees:
            check_tree_target(self.target)
        if proposer is not None and proposer.hidden_keys:
            check_heads_target(self.target)
        limit = min(self.target.max_context, len(prompt) + params.max_new_tokens)
        if limit > self.max_len:
            raise ValueError(f"the prompt ({len(prompt)} tokens) plus max_new_tokens "
                             f"({params.max_new_tokens}) exceeds this batch's {self.max_len} "
                             "positions per row")
        if proposer is not None and schedule is None:
            schedule = FixedK(proposer.default_k)
        gen = Generation(SpecDecodingStats())
        status = _Status(gen)
        self.waiting.append(_Waiting(gen, status, prompt, params, eos, decode, proposer,
                                     schedule if proposer is not None else None,
                                     draft_seconds_per_token, fixed_k))
        self._blocks[gen] = deque()
        gen._steps = self._pull(gen, status)
        return gen

    def _pull(self, gen: Generation, status: _Status):
        """The generation's blocks: steps the whole batch until this request has one (the
        others' blocks wait in their own queues); closed early, it cancels the request."""
        blocks = self._blocks[gen]
        try:
            while True:
                while not blocks and status.finish_reason is None:
                    if not self.step():
                        raise RuntimeError("the batched engine was closed before this request ended")
                if not blocks:
                    return
                block = blocks.popleft()
                if not blocks and status.finish_reason is not None:
                    gen.finish_reason = status.finish_reason  # as the engine alone: set with the last block
                yield block
        finally:
            self._cancel(gen)

    def _cancel(self, gen: Generation) -> None:
        self._blocks.pop(gen, None)
        self.waiting = deque(w for w in self.waiting if w.gen is not gen)
        for b, row in enumerate(self.rows):
            if row is not None and row.gen is gen:
                self._free(b)

    @property
    def active(self) -> int:
        return sum(r is not None for r in self.rows)

    def _admit(self) -> None:
        target = self.target
        for b in range(len(self.rows)):
            if self.rows[b] is not None or not self.waiting:
                continue
            w = self.waiting.popleft()
            locks = hold([], w.proposer)
            for m in (w.proposer.models() if w.proposer is not None else ()):
                if isinstance(m, BindableDraft):  # a draft row, or a self-draft on the target's row
                    m.bind(b)
            target.rollback_rows([0 if r == b else n for r, n in enumerate(target.row_lengths)])
            check = (lambda b=b: target.row_lengths[b]) if self.debug else None
            run = RequestRun(target, w.proposer, w.schedule, w.prompt, w.params, w.eos, w.decode,
                             w.gen.stats, w.status, check)
            self.rows[b] = _Row(run, locks, time.perf_counter(), w.gen, w.draft_seconds,
                                w.fixed_k, w.prompt)

    def _prefill(self) -> None:
        """The next prefill chunk of each joining row, up to PREFILL_CHUNK tokens in all this
        step (at least one chunk); rows whose prefill ends begin their rounds."""
        chunk = self.target.PREFILL_CHUNK
        budget = chunk
        for b, row in enumerate(self.rows):
            if row is None or row.prompt is None:
                continue
            todo = len(row.prompt) - 1 - row.prefilled  # the last prompt token starts the first round
            # chunks start at multiples of PREFILL_CHUNK, as a request alone cuts them
            n = min(todo, chunk - row.prefilled % chunk)
            if n > budget and budget < chunk:
                break
            if n > 0:
                ids = torch.tensor([row.prompt[row.prefilled:row.prefilled + n]])
                keys = _hidden_keys(row.run)
                if keys:  # a draft head reads the prompt's states (as the engine's prefill gives them)
                    out = self.target.forward_span(b, b + 1, ids, None, 0, output_hidden=keys)
                    row.prompt_hidden.append((row.prefilled, {k: h[0] for k, h in out.hidden.items()}))
                else:
                    self.target.forward_row(b, ids, num_logits=0)
                row.prefilled += n
                budget -= n
            if row.prefilled == len(row.prompt) - 1:
                row.prompt = None
                row.run.begin(row.t0)  # (resets the proposer: the prompt's states come after it, as alone)
                for start, hidden in row.prompt_hidden:
                    row.run.proposer.take_hidden(start, hidden)
                row.prompt_hidden = []
            if budget <= 0:
                break

    def _free(self, b: int) -> None:
        for lock in self.rows[b].locks:
            lock.release()
        self.rows[b] = None

    def step(self) -> list[tuple[Generation, list[int]]]:
        """One round for every active row (after admitting waiting requests): returns each
        row's (generation, tokens committed this round). Iterating a generation hands out its
        blocks (``token_ids`` and ``finish_reason`` fill in as in :class:`Engine`), stepping
        the batch as needed. Empty when nothing is left to run."""
        self._admit()
        self._prefill()
        active = [(b, row.run) for b, row in enumerate(self.rows) if row is not None and row.prompt is None]
        if not active:
            return [] if not self.active else [(row.gen, []) for row in self.rows if row is not None]
        target = self.target
        t_start = time.perf_counter()
        wanted = [run.wanted_k() for _, run in active]
        ks, trial = wanted, False
        # a lone row takes its own schedule's K, as the request alone would
        if self.forward_seconds is not None and any(wanted) and len(active) > 1:
            ks = self._policy(active, wanted) if self.rates.speculate(len(active)) else [
                w if not run.clocked or self.rows[b].fixed_k else 0 for (b, run), w in zip(active, wanted)]
            trial = self.rates.trial
        for b, run in active:
            if run.proposer is not None:  # (a seeded rejection-rule row chooses as if alone)
                run.proposer.share_passes(self.active if run.clocked else 1, not (trial and run.clocked))
        drafts = self._draft({b: run.propose_steps(k) for (b, run), k in zip(active, ks)})
        t_drafted = time.perf_counter()
        width = 1 + max(d.shape[1] for d in drafts.values())
        # only the span of rows from the first active one to the last is computed
        first, stop = active[0][0], active[-1][0] + 1
        x = torch.zeros(stop - first, width, dtype=torch.long)
        lengths = [0] * (stop - first)
        for b, run in active:
            k = drafts[b].shape[1]
            x[b - first, 0] = run.state.tokens[-1]
            x[b - first, 1:1 + k] = drafts[b][0]
            lengths[b - first] = k + 1
        mask, pos = self._tree_mask(active, first, stop, width)
        t_forward = time.perf_counter()
        keys = tuple(sorted({k for _, run in active for k in _hidden_keys(run)}))
        scored = target.forward_span(first, stop, x, lengths, output_hidden=keys, attn_mask=mask,
                                     position_ids=pos)
        logits = scored.logits
        t_scored = time.perf_counter()
        out = []
        for b, run in active:
            span = slice(b - first, b - first + 1), slice(0, lengths[b - first])
            hidden = {k: scored.hidden[k][span] for k in _hidden_keys(run)}
            start = len(run.state.tokens) - 1
            emitted = run.finish(logits[span], hidden or None)
            if run.tree is not None:  # only the accepted path's entries stay, as alone
                target.compact(b, start, [0] + [i + 1 for i in run.accepted_path])
            gen = self.rows[b].gen
            self._blocks[gen].append(emitted)
            out.append((gen, emitted))
        target.rollback_rows([0 if row is None else row.prefilled if row.prompt is not None
                              else len(row.run.state.tokens) - 1 for row in self.rows])
        for b, run in active:
            run.after_rollback()
        now = time.perf_counter()
        for b, run in active:
            run.stats.total_s = now - self.rows[b].t0
            if run.gen.finish_reason is not None:  # (the row's _Status)
                self._free(b)
        rest = (now - t_drafted) - (t_scored - t_forward)  # the round outside drafts and the pass
        self._overhead_s = 0.8 * self._overhead_s + 0.2 * max(0.0, rest)
        if len(active) > 1:  # (a lone row's K is its own schedule's, never the guard's)
            self.rates.record(len(active), width > 1, sum(len(e) for _, e in out), now - t_start)
        return out

    def _tree_mask(self, active: list[tuple[int, RequestRun]], first: int, stop: int,
                   width: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The pass's attention mask bool [stop-first, width, width] and positions int64
        [stop-first, width] when a row verifies a draft tree (its tree's; causal at its own
        positions for the others), else (None, None): the causal pass."""
        trees = [(b, run) for b, run in active if run.tree is not None]
        if not trees:
            return None, None
        mask = torch.ones(width, width, dtype=torch.bool).tril().repeat(stop - first, 1, 1)
        pos = torch.tensor(self.target.row_lengths[first:stop])[:, None] + torch.arange(width)
        for b, run in trees:
            n = run.tree.num_nodes + 1
            mask[b - first, :n, :n] = run.tree.attn_mask()
            pos[b - first, :n] = run.tree.position_ids(len(run.state.tokens) - 1)
        return mask, pos

    @staticmethod
    def _draft(steps: dict) -> dict[int, torch.Tensor]:
        """Each row's drafts, from its proposal's forward passes (``steps``: row -> generator,
        :meth:`~specdecode.engine.RequestRun.propose_steps`): every round of passes, those on
        the rows of one :class:`DraftRows` run as one, and so do self-drafts' of one target and
        layers (:meth:`SelfDraft.forward_together`); the others alone."""
        out, pending = {}, {}

        def advance(b, value=None):
            try:
                pending[b] = steps[b].send(value)
            except StopIteration as done:
                out[b] = done.value
                pending.pop(b, None)

        for b in steps:
            advance(b)
        while pending:
            results, groups = {}, {}
            own: dict[tuple, list] = {}  # self-drafts on the target's rows, by same_pass key
            for b, (model, ids, n) in pending.items():
                if isinstance(model, DraftRowView):
                    groups.setdefault(id(model.rows), (model.rows, []))[1].append((b, model.row, ids, n))
                elif isinstance(model, SelfDraft) and ids.shape[1] <= SMALL_PASS:
                    own.setdefault(model.same_pass(), []).append((b, model, ids, n))
                else:
                    results[b] = model.forward(ids, num_logits=n)
            for rows, passes in groups.values():
                for (b, *_), logits in zip(passes, rows.run([p[1:] for p in passes])):
                    results[b] = logits
            for passes in own.values():
                for (b, *_), logits in zip(passes, SelfDraft.forward_together([p[1:] for p in passes])):
                    results[b] = logits
            for b in list(pending):
                advance(b, results[b])
        return out

    def _policy(self, active: list[tuple[int, RequestRun]], wanted: list[int]) -> list[int]:
        alphas, draft_seconds, fixed, asked, batched = [], [], [], list(wanted), []
        t1 = self.forward_seconds[0]
        for i, (b, run) in enumerate(active):
            st = run.stats
            # a prior of PRIOR_ALPHA with the weight of PRIOR_WEIGHT draft tokens: a row's
            # first rejections do not end its speculation at once
            alphas.append((st.num_accepted_tokens + PRIOR_ALPHA * PRIOR_WEIGHT)
                          / (st.num_draft_tokens + PRIOR_WEIGHT))
            c = self.rows[b].draft_seconds
            if c is None:
                c = 0.25 * t1 if run.proposer is not None and run.proposer.models() else 0.0
            draft_seconds.append(c)
            recent = st.speculation_lengths[-PROBE_EVERY:]
            own = not run.clocked or self.rows[b].fixed_k  # its K is its own, as alone
            probe = not own and wanted[i] > 0 and len(recent) == PROBE_EVERY and not any(recent)
            if probe:  # the policy stopped this row: one draft token, to see if that changed
                asked[i] = 1
            fixed.append(probe or own)
            batched.append(run.proposer is not None and any(
                isinstance(m, (DraftRowView, SelfDraft)) for m in run.proposer.models()))
        return choose_lengths(alphas, draft_seconds, asked, fixed, self.forward_seconds,
                              self._overhead_s, batched)

    def run(self) -> None:
        """Step until every request has finished, then hand every generation its blocks."""
        while self.waiting or self.active:
            self.step()
        for gen in list(self._blocks):
            gen.run()

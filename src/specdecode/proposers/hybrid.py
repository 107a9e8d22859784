"""The hybrid: a policy over proposers that gives each round to whichever promises more
tokens per unit of time — free lookups, or one proposer that pays per drafted token."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..costmodel import chained_acceptance, expected_tokens, relative_cost
from ..models.base import CausalLM
from .base import DraftOutput, Forecast, Proposer, RequestState, Steps, run_alone
from .draft_model import DraftModelProposer


@dataclass(frozen=True)
class HybridTuning:
    """The hybrid's tuned constants. Their measurements are in docs/EXPERIMENTS.md."""

    prior_weight: float = 2.0
    """Weight, in rounds (or tokens), of the prior in every estimate the hybrid learns."""
    draft_prior_alpha: float = 0.85
    """Prior acceptance of the draft's first token before it has drafted in this request
    (greedy requests)."""
    sampled_prior_alpha: float = 0.75
    """The same for sampled requests: a sampled token matches the draft's less often (the
    draft's acceptance over long answers at T 1.0 here: 0.72-0.80)."""
    horizon: int = 4
    """Fewest tokens an answer is expected to go on for when spreading a draft's catch-up
    (never more than the request has left of its max_new_tokens); past it, as many as it
    has gone on for so far (an answer n tokens long is expected to go on for about n
    more): a feed is paid for certain, and short answers are common."""
    explore: float = 0.03
    """The draft drafts the longest length within this fraction of the best rate, so the
    positions past the best length keep being measured."""
    lookup_margin: float = 1.3
    """A lookup takes a round from the draft only if it promises this many times its rate."""
    probe_every: int = 8
    """Rounds without the draft before a draft given up after a bad start drafts once more
    (doubled after each probe that did not win on its merits)."""
    draft_p_min: float = 0.5
    """The draft stops at a token it gives less than this (the draft proposer the hybrid is
    built with, :meth:`HybridProposer.draft_for`; 0 = never)."""
    check_below: float = 0.9
    """A lookup round goes through the draft when the lookup expects to keep less than this
    share of its proposal (greedy, draft at most one token behind)."""
    read_guess: bool = True
    """Greedy: the draft reads the best lookup's proposal as a guess (see
    :class:`HybridProposer`); off for a draft whose pass over a whole proposal costs a large
    share of a verify pass (the layer-skip draft of the ``self`` method)."""
    cold_margin: float = 1.0
    """A draft that must first be fed more than two committed tokens drafts only if it beats
    plain decoding by this factor: that feed is paid for certain, its return only if the
    answer goes on."""
    measured_decay: float = 0.9
    """Weight the draft's measured gain (:attr:`HybridProposer.draft_pays`) keeps per draft
    round (about the last 1/(1 - x) rounds count)."""
    measured_slack: float = 1.0
    """Plain steps of time the draft's measured gain may fall below zero before the draft
    stops: a round's time on a shared machine moves by a tenth or more, and a draft stopped
    on one slow round is seldom measured again."""


class _LookupArm:
    """A free member and what this request taught about it: r = accepted / expected tokens
    of its forecasts (``counts`` = [accepted, promised]), and the forecast in flight."""

    def __init__(self, proposer: Proposer):
        self.proposer = proposer
        self.counts = [0.0, 0.0]
        self.pending: tuple[int, Forecast] | None = None


class HybridProposer(Proposer):
    """Each round, the proposal that promises the most tokens per unit of time: one of the
    free members' (lookups: prompt lookup, suffix matching) or the draft member's (a
    proposer that pays per drafted token: a draft model), each at the length that pays best.

    Members: any number of free proposers (``free`` True; each gives a :class:`Forecast`
    with calibrated confidences c_i, the probability its first i tokens are all accepted),
    and exactly one proposer that is not free. The policy, per round (SuffixDecoding's
    speculation length from confidence, arXiv:2411.04975; Leviathan et al.'s expected
    length, arXiv:2211.17192 §3.1):

    - A lookup's best length L maximises (1 + Σ_{i≤L} Π_{j≤i} min(1, r·p_j)) / T(L+1), with
      p_i = c_i/c_{i−1} and r what this request's forecasts of that lookup delivered over
      what they expected. Every forecast is scored against the committed tokens, used or not.
    - The draft's best length D ≤ min(K, ``draft_k``) maximises E(D) / (D·c_draft + T(D+1) +
      P), with α_i (its acceptance at position i given the ones before were accepted)
      estimated per position from this request's draft rounds, and P the cost of feeding it
      the committed tokens it has not seen (``draft_prefill_cost`` each), spread over the
      rounds the answer is expected to go on for (as many as it has so far, at least
      ``horizon``, at most what is left of max_new_tokens), and in a batch times the rows
      that feed holds up (:meth:`share_passes`: it runs as one long pass while every row
      waits; never on the batch's trial rounds, whose speculation may not go on, nor in a
      request's first round, whose first token a feed would delay). A draft that stops
      where it is unsure (p_min) proposes in a share q of its rounds (:attr:`draft_sure`);
      a round where it stops pays c_draft + T(1) + P for one token, so the rate is
      (q·E(D) + 1 − q) / (q·(D·c_draft + T(D+1)) + (1 − q)·(c_draft + T(1)) + P). The
      longest D within ``explore`` of the best rate is taken.
    - The draft drafts when its rate beats the best lookup's over ``lookup_margin`` and
      plain decoding's, 1/T(1) (by ``cold_margin`` when it must first catch up), or as a
      probe (see :class:`HybridTuning`); else the best lookup proposes its best L if that
      beats plain decoding; else nothing is proposed.
    - Pay or stop: where the engine reports round times (:meth:`observe`: alone, and not a
      seeded request of the rejection rule), each draft round without a feed is measured
      against plain decoding: its tokens times a plain step's time (its own verify pass
      over T(k+1)/T(1)) minus what the round took. While the decayed sum of those gains is
      below minus ``measured_slack`` plain steps (:attr:`draft_pays`: the times are noisy),
      the draft drafts only as a probe that needs no feed, whatever the model predicts: the
      model's costs and acceptance are estimates, the clock is what the user waits for.
    - Greedy requests, when the draft member ``reads_guess``: the best lookup's L tokens go
      to the draft as a guess, which it reads in one pass (keeping those it would have
      drafted too); a lookup round also goes through the draft that way when the draft has
      seen the committed tokens and the lookup expects to keep less than ``check_below`` of
      its proposal. A draft whose first token is the lookup's reports source
      "<lookup>+<draft>" (e.g. "suffix+draft").

    Costs are relative to T(1): ``verify_cost[n-1]`` = T(n)/T(1) (the target's profile;
    default :func:`~specdecode.costmodel.relative_cost`'s), ``draft_cost`` = one draft step /
    T(1), ``draft_prefill_cost`` = the draft's prefill per token / T(1) (the methods pass
    the two models' measured ones: :func:`~specdecode.profile.prefill_profile`; the defaults
    are those of the 0.5B draft for the 1.5B target measured here). A parallel draft
    (:attr:`Proposer.parallel`) pays one pass for D tokens: D·c_draft above becomes c_draft ×
    ``draft_pass_cost``'s T_d(D+1)/T_d(1) (the draft's own profile; default
    :func:`~specdecode.costmodel.relative_cost`'s), also where it stops. Choices depend only
    on the request's tokens, these costs and the times :meth:`observe` reports (none for a
    seeded request of the rejection rule, which is so reproducible with the same costs).
    The members are used as given: build the draft member with :meth:`draft_for` for the settings the hybrid was tuned with.
    Raises ValueError for members that are not one non-free proposer plus at least one free
    one, a verify_cost that is not positive, a negative draft_cost or draft_prefill_cost,
    or draft_k < 1.
    """

    name = "hybrid"
    default_k = 16

    def __init__(self, *members: Proposer, verify_cost: list[float] | None = None,
                 draft_cost: float = 0.12, draft_k: int = DraftModelProposer.default_k,
                 draft_prefill_cost: float = 0.04, tuning: HybridTuning = HybridTuning(),
                 draft_pass_cost: list[float] | None = None):
        lookups = [m for m in members if isinstance(m, Proposer) and m.free]
        drafts = [m for m in members if isinstance(m, Proposer) and not m.free]
        if len(drafts) != 1 or not lookups or len(lookups) + len(drafts) != len(members):
            raise ValueError(f"hybrid members {[type(m).__name__ for m in members]} are invalid; "
                             "allowed: proposers, at least one free one (a lookup) and exactly one "
                             "that is not free (a draft model)")
        if not (isinstance(draft_k, int) and draft_k >= 1):
            raise ValueError(f"hybrid draft_k={draft_k!r} is invalid; allowed: an integer >= 1")
        if not (isinstance(draft_prefill_cost, (int, float)) and draft_prefill_cost >= 0):
            raise ValueError(f"hybrid draft_prefill_cost={draft_prefill_cost!r} is invalid; "
                             "allowed: a number >= 0")
        if verify_cost is not None and not (isinstance(verify_cost, (list, tuple)) and verify_cost
                                            and all(isinstance(c, (int, float)) and c > 0
                                                    for c in verify_cost)):
            raise ValueError(f"hybrid verify_cost={verify_cost!r} is invalid; allowed: T(n)/T(1) "
                             "for n = 1, 2, ..., all > 0")
        if not (isinstance(draft_cost, (int, float)) and draft_cost >= 0):
            raise ValueError(f"hybrid draft_cost={draft_cost!r} is invalid; allowed: a number >= 0")
        if draft_pass_cost is not None and not (isinstance(draft_pass_cost, (list, tuple)) and draft_pass_cost
                                                and all(isinstance(c, (int, float)) and c > 0
                                                        for c in draft_pass_cost)):
            raise ValueError(f"hybrid draft_pass_cost={draft_pass_cost!r} is invalid; allowed: the "
                             "draft's T(n)/T(1) for n = 1, 2, ..., all > 0")
        self.lookups = [_LookupArm(m) for m in lookups]
        self.drafter = drafts[0]
        self.verify_cost, self.draft_cost, self.draft_pass_cost = verify_cost, draft_cost, draft_pass_cost
        self.draft_k, self.draft_prefill_cost = draft_k, draft_prefill_cost
        self.tuning = tuning
        self._max_total_len = self._prompt_len = 0
        self._greedy = True
        self._draft_counts = ([0.0] * draft_k, [0.0] * draft_k)  # per position: (reached, accepted)
        self._drafted: tuple[int, int] | None = None  # this round's draft: (start, proposed)
        self._own_rounds = [0.0, 0.0]  # the draft's rounds without a guess: [it proposed, all]
        self._idle, self._probe_every = 0, tuning.probe_every  # rounds since the draft drafted
        self._rows, self._feed = 1, True  # requests that share this round's passes; a feed allowed
        self._ledger = _DraftLedger(tuning.measured_decay)

    @staticmethod
    def draft_for(lm: CausalLM, p_min: float | None = None, mask_id: int | None = None) -> DraftModelProposer:
        """The draft-model member as the hybrid was tuned with it: prefilled only once it is
        first chosen (``lazy_prefill``), stopping below ``HybridTuning.draft_p_min`` unless
        ``p_min`` is given (0 = never stop); a parallel draft with ``mask_id``."""
        return DraftModelProposer(lm, p_min=HybridTuning.draft_p_min if p_min is None else p_min,
                                  lazy_prefill=True, mask_id=mask_id)

    def models(self) -> tuple[CausalLM, ...]:
        return tuple(lm for m in self._members() for lm in m.models())

    def check_invariant(self, state: RequestState) -> None:
        for m in self._members():
            m.check_invariant(state)

    def _members(self) -> list[Proposer]:
        return [arm.proposer for arm in self.lookups] + [self.drafter]

    @property
    def draft_alpha(self) -> list[float]:
        """α_i: the draft token at position i is accepted if the ones before it were, as
        estimated in this request (length draft_k)."""
        prior = self.tuning.draft_prior_alpha if self._greedy else self.tuning.sampled_prior_alpha
        return chained_acceptance(*self._draft_counts, prior, self.tuning.prior_weight)

    @property
    def draft_sure(self) -> float:
        """q: the share of the draft's own rounds (no guess) in which it proposed at least one
        token rather than stop unsure before its first (p_min), as estimated in this request
        (prior 1)."""
        proposed, asked = self._own_rounds
        w = self.tuning.prior_weight
        return (proposed + w) / (asked + w)

    @property
    def draft_pays(self) -> bool:
        """False while the measured gain of this request's draft rounds is below minus
        ``measured_slack`` plain steps (see the class's pay or stop); True before any was
        measured."""
        return self._ledger.gain >= -self.tuning.measured_slack * self._ledger.step

    def observe(self, draft_s: float, verify_s: float) -> None:
        if self._rows == 1:  # (a batch's passes are shared: its times are not this request's)
            self._ledger.time(draft_s, verify_s, self._t)

    def lookup_realism(self, i: int = 0) -> float:
        """r of lookup member i: this request's accepted / expected tokens of its forecasts,
        over the positions the committed tokens reached."""
        acc, promised = self.lookups[i].counts
        w = self.tuning.prior_weight
        return (acc + w) / (promised + w)

    def reset(self, state: RequestState, max_total_len: int) -> None:
        for m in self._members():
            m.reset(state, max_total_len)
        self._max_total_len, self._prompt_len = max_total_len, len(state.tokens)
        self._greedy = state.params.greedy
        self._draft_counts = ([0.0] * self.draft_k, [0.0] * self.draft_k)
        for arm in self.lookups:
            arm.counts, arm.pending = [0.0, 0.0], None
        self._drafted = None
        self._own_rounds = [0.0, 0.0]
        self._idle, self._probe_every = 0, self.tuning.probe_every
        self._ledger = _DraftLedger(self.tuning.measured_decay)

    def share_passes(self, rows: int, feed: bool = True) -> None:
        self._rows, self._feed = rows, feed

    def _t(self, n: int) -> float:
        return relative_cost(self.verify_cost, n)

    def _best_lookup(self, i: int, conf: list[float]) -> tuple[int, float]:
        """(L, tokens per unit of time) of lookup i's best length (0, 1.0: none beats plain)."""
        r = self.lookup_realism(i)
        best, promised, reach, before = (0, 1.0), 0.0, 1.0, 1.0
        for j, c in enumerate(conf, 1):
            reach *= min(1.0, r * c / before) if before > 0 else 0.0  # r·p_j, at most 1
            before = c
            promised += reach
            rate = (1 + promised) / self._t(j + 1)
            if rate > best[1]:
                best = (j, rate)
        return best

    def _best_draft(self, n: int, k: int, behind: int) -> tuple[int, float]:
        """(D, tokens per unit of time) of the best draft length (0, 0.0 if none), after n
        committed tokens of which the draft has not seen ``behind``."""
        if not self.drafter.active:
            return 0, 0.0
        alpha, q = self.draft_alpha, self.draft_sure
        horizon = max(1, min(self._max_total_len - n, max(self.tuning.horizon, n - self._prompt_len)))
        rates = []
        for d in range(1, min(k, self.draft_k) + 1):
            expected = q * expected_tokens(alpha, d) + 1 - q
            catch_up = behind * self.draft_prefill_cost * self._rows / max(1.0, horizon / expected)
            if self.drafter.parallel:  # one pass over ~2 fed tokens and d - 1 masks, stop or not
                step = stop = self.draft_cost * relative_cost(self.draft_pass_cost, d + 1)
            else:
                step, stop = d * self.draft_cost, self.draft_cost
            cost = q * (step + self._t(d + 1)) + (1 - q) * (stop + 1.0)
            rates.append((d, expected / (cost + catch_up)))
        if not rates:
            return 0, 0.0
        top = max(rate for _, rate in rates)
        return max((d, rate) for d, rate in rates if rate >= (1 - self.tuning.explore) * top)

    def propose(self, state: RequestState, k: int) -> DraftOutput:
        return run_alone(self.propose_steps(state, k))

    def propose_steps(self, state: RequestState, k: int) -> Steps:
        tune = self.tuning
        n = len(state.tokens)
        best = None  # (rate, length, arm, forecast) of the best lookup, the first on ties
        for i, arm in enumerate(self.lookups):
            fc = arm.proposer.forecast(state, k)
            arm.pending = (n, fc)
            length, rate = self._best_lookup(i, fc.confidence)
            if best is None or rate > best[0]:
                best = (rate, length, arm, fc)
        lookup_rate, length, arm, fc = best
        out = fc.tokens
        behind = self.drafter.unseen(state)  # committed tokens the draft has not seen
        d, draft_rate = self._best_draft(n, k, behind)
        cold = behind > 2  # the draft must first be fed what it skipped
        # the first round's output is the request's first token: never held up by a feed
        if cold and (not self._feed or state.num_generated == 0):
            d, draft_rate = 0, 0.0
        pays = self.draft_pays
        merit = pays and draft_rate > max(lookup_rate / tune.lookup_margin, tune.cold_margin if cold else 1.0)
        # a draft given up after a bad start (rejected, or unsure) is tried again now and then
        # (never one that was not fed yet: its catch-up prefill is left to the cost model);
        # once its rounds were measured to lose, never one that must first be fed what it
        # skipped meanwhile: the feed is a probe's surest cost, the model's promise what lost
        probe = (d > 0 and lookup_rate <= 1.0 and self._idle >= self._probe_every
                 and (self._draft_counts[0][0] > 0 or self._own_rounds[1] > 0)
                 and (pays or not cold))
        greedy = state.params.greedy and self.drafter.reads_guess and tune.read_guess
        sure = lookup_rate * self._t(length + 1) / (1 + length) if length else 1.0
        check = pays and greedy and d > 0 and length > 0 and k > 1 and behind <= 1 and sure < tune.check_below
        if merit or probe or check:
            guess = out[:min(length, k - 1)] if greedy else []
            if not guess:  # scoring only unused forecasts would bias the lookups' calibration
                for other in self.lookups:
                    other.proposer.discard_last_proposal()
            drafted = yield from self.drafter.propose_steps_with_guess(state, d, guess)
            m = drafted.token_ids.shape[1]
            # measured unless it fed the draft (a feed is the model's bet on the answer ahead)
            self._ledger.start(n, m if m else 0 if guess else length, measured=not cold)
            if not guess:  # its own round: did it propose, or stop unsure before its first token
                self._own_rounds[0] += m > 0
                self._own_rounds[1] += 1
            # a probe that stopped unsure is a probe all the same (else one each round after it)
            self._idle = 0
            self._probe_every = tune.probe_every if merit or check else 2 * self._probe_every
            if m:
                self._drafted = (n, min(m, self.draft_k))
                if guess and int(drafted.token_ids[0, 0]) == guess[0]:
                    drafted = replace(drafted, source=f"{arm.proposer.name}+{self.drafter.name}")
                return drafted
            if guess:  # the draft read the lookup's proposal and backs none of it
                return DraftOutput.empty()
        self._idle += self.drafter.active
        if length == 0:  # costs more than it promises; still scored, to keep learning
            return DraftOutput.empty()
        return DraftOutput.point_mass(out[:length], arm.proposer.name)

    def on_accept(self, state: RequestState) -> None:
        self._ledger.commit(len(state.tokens))
        if self._drafted is not None:
            start, proposed = self._drafted
            accepted = min(proposed, len(state.tokens) - start - 1)
            reached, acc = self._draft_counts
            for i in range(min(proposed, accepted + 1)):  # reached: the accepted, the first rejected
                reached[i] += 1
                acc[i] += i < accepted
            self._drafted = None
        for arm in self.lookups:
            if arm.pending is not None:
                # the forecast, used or not, against the committed tokens it reaches: position
                # i is accepted iff the committed token there is its token (greedy; the same
                # probability under sampling); it was expected with p_i = c_i / c_{i-1}
                start, fc = arm.pending
                before = 1.0
                for tok, got, c in zip(fc.tokens, state.tokens[start:], fc.confidence):
                    arm.counts[1] += c / before if before > 0 else 0.0
                    if tok != got:
                        break
                    arm.counts[0] += 1
                    before = c
                arm.pending = None
        for m in self._members():
            m.on_accept(state)


class _DraftLedger:
    """A request's measured gain from its draft rounds: per round, tokens committed times a
    plain step's time (the round's verify time / T(k+1), in units of T(1)) minus the round's
    time, summed with ``decay`` per round. ``start`` a round after ``n`` committed tokens
    that verifies k tokens, ``time`` it (the engine's report), ``commit`` it once the
    committed tokens are known; a round not started (or not timed) counts nothing."""

    def __init__(self, decay: float):
        self.decay, self.gain = decay, 0.0
        self.step = 0.0  # the last measured plain step's time
        self.round: tuple[int, int] | None = None  # (n, k) of the round in flight
        self.seconds: tuple[float, float] | None = None  # (round, plain step)

    def start(self, n: int, k: int, measured: bool = True) -> None:
        self.round, self.seconds = ((n, k) if measured else None), None

    def time(self, draft_s: float, verify_s: float, relative_cost) -> None:
        if self.round is not None and verify_s > 0:
            self.seconds = (draft_s + verify_s, verify_s / relative_cost(self.round[1] + 1))

    def commit(self, committed: int) -> None:
        if self.round is not None and self.seconds is not None:
            (n, _), (spent, self.step) = self.round, self.seconds
            self.gain = self.gain * self.decay + (committed - n) * self.step - spent
        self.round = self.seconds = None

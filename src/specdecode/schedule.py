"""Speculation length K per round: fixed, transformers' heuristic, or chosen from a cost model.

Every schedule is a :class:`Schedule`. The engine caps K further by the room left in the
context; a proposer may propose fewer tokens. The cost model's maths is
:mod:`specdecode.costmodel`; the machine's measured forward times, :mod:`specdecode.profile`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

from .config import check_k
from .costmodel import chained_acceptance, expected_tokens


class Schedule(ABC):
    """What the engine asks of a K schedule.

    ``reset()`` at the start of a request; ``next_k()`` before each round (0 = no
    speculation this round); ``trim(offered)`` after a free proposal (a lookup's,
    ``DraftOutput.free``) of ``offered`` tokens: how many of them to verify (default all);
    ``update(proposed, accepted, draft_s, verify_s)`` after each verify pass, with the number
    of draft tokens actually proposed (possibly 0) and the round's times in seconds — None
    for seeded sampled requests, whose K must not depend on the clock: the random draws of a
    round depend on K, and the same seed must give the same output.
    """

    name: ClassVar[str]

    def reset(self) -> None:
        """Start a request."""

    @abstractmethod
    def next_k(self) -> int:
        """K for the next round."""

    def trim(self, offered: int) -> int:
        """How many of a free proposal's ``offered`` tokens to verify."""
        return offered

    def update(self, proposed: int, accepted: int, draft_s: float | None, verify_s: float | None) -> None:
        """Learn from a verify pass."""


class FixedK(Schedule):
    """K tokens every round. Raises ValueError for K outside 1..64."""

    name = "fixed"

    def __init__(self, k: int):
        check_k("speculation length K", k)
        self.k = k

    def next_k(self) -> int:
        return self.k


class HeuristicK(Schedule):
    """transformers' heuristic schedule for K: start at ``start``; +2 after a round whose
    proposed tokens were all accepted, −1 otherwise (never below 1 or above ``max_k``).
    Rounds without a proposal change nothing. Restarts at ``start`` every request, like
    transformers' ``"heuristic_transient"`` (its ``"heuristic"`` carries K over to the next
    call). Raises ValueError for start or max_k outside 1..64."""

    name = "heuristic"

    def __init__(self, start: int, max_k: int = 16):
        check_k("starting K", start)
        check_k("max K", max_k)
        self.start, self.max_k = min(start, max_k), max_k
        self.k = self.start

    def reset(self) -> None:
        self.k = self.start

    def next_k(self) -> int:
        return self.k

    def update(self, proposed: int, accepted: int, draft_s: float | None, verify_s: float | None) -> None:
        if proposed:
            self.k = min(self.max_k, self.k + 2) if accepted == proposed else max(1, self.k - 1)


class AutoK(Schedule):
    """Choose K each round to maximise expected emitted tokens per second.

    Model (Leviathan et al., arXiv:2211.17192 §3.4, with a per-position acceptance rate
    instead of one i.i.d. α): with α_i the probability that draft i is accepted given that
    drafts 1..i−1 were, a round of K drafts emits E(K) = 1 + Σ_{i=1..K} Π_{j<=i} α_j tokens
    and costs C(K) = c_draft·(K + lookahead) + s·T(K+1) (C(0) = T(1)), where T(n) is the
    target's measured forward time for n tokens (``forward_seconds``, profiled once per
    machine: :func:`specdecode.profile.verify_profile`), c_draft the draft cost per proposed token (``draft_seconds_per_token``, e.g. the draft
    model's profiled T(1); 0 for lookups) and s = 1. When the engine passes round times, both
    follow what this request measures: c_draft the drafting time per proposed token, s the
    ratio of the observed verify times to the profile (context length, machine load). The
    chosen K is argmax E(K)/C(K) over 0..max_k.

    α_i is estimated online from exponentially decayed counts (``decay`` per round, ≈ the
    last 1/(1−decay) rounds) of how often position i was reached and accepted, shrunk toward
    α_{i−1} with weight ``prior_weight`` — so a position never tried yet inherits the rate of
    the one before it, and K can grow when drafts keep being accepted. K = 0 (no speculation,
    E = 1, C = T(1)) is chosen when no K pays for itself — text a lookup cannot predict;
    then one draft token is tried every ``probe_every`` rounds to notice when that changes.

    Free proposals (lookups: ``DraftOutput.free``) cost nothing to make, and how far they
    are right depends on how long a match they come from, which only the proposer knows.
    For them K is chosen after proposing: once a request has seen one, ``next_k`` returns
    max_k, the proposer offers what it has (its match length, at most max_k), and
    ``trim(offered)`` keeps the first K tokens, K = argmax E(K)/(s·T(K+1)) over 0..offered,
    with α_i estimated separately per offered length (buckets 1, 2–3, 4–7, 8–15, 16+; the
    prior for bucket [m, 2m) is m/(m+1)): a long copy in progress is verified whole, a
    one-token guess only where such guesses pay.
    ``lookahead``: draft tokens a round makes beyond the K it proposes (a greedy draft of
    another tokenizer drafts at least one more, to settle where its last target token ends:
    ``CrossTokenizerProposer.lookahead``), counted in C(K) for K >= 1 and in the measured
    cost per draft token (spread over K tokens instead, it makes small K look dear).
    Raises ValueError for
    a profile shorter than 2 sizes or max_k outside 1..64.
    """

    name = "auto"

    def __init__(self, forward_seconds: list[float], max_k: int = 16,
                 draft_seconds_per_token: float = 0.0, decay: float = 0.9,
                 prior_weight: float = 1.0, first_alpha: float = 0.85, probe_every: int = 8,
                 lookahead: int = 0):
        check_k("max K", max_k)
        if len(forward_seconds) < 2 or not all(_positive(t) for t in forward_seconds):
            raise ValueError(f"AutoK needs forward times T(1), T(2), ... in seconds (at least 2, "
                             f"all > 0), got {forward_seconds!r}")
        for name, value, ok in [
                ("draft_seconds_per_token", draft_seconds_per_token,
                 _finite(draft_seconds_per_token) and draft_seconds_per_token >= 0),
                ("decay", decay, _positive(decay) and decay <= 1),
                ("prior_weight", prior_weight, _positive(prior_weight)),
                ("first_alpha", first_alpha, _finite(first_alpha) and 0 <= first_alpha <= 1),
                ("probe_every", probe_every, isinstance(probe_every, int) and probe_every >= 1),
                ("lookahead", lookahead, isinstance(lookahead, int) and lookahead >= 0)]:
            if not ok:
                raise ValueError(f"AutoK {name}={value!r} is invalid")
        self.times = [float(t) for t in forward_seconds]
        self.draft_seconds_per_token = float(draft_seconds_per_token)
        self.max_k = min(max_k, len(self.times) - 1)
        self.decay, self.prior_weight, self.first_alpha = decay, prior_weight, first_alpha
        self.probe_every, self.lookahead = probe_every, lookahead
        self.reset()

    def reset(self) -> None:
        self.draft_per_token = self.draft_seconds_per_token
        self.scale = 1.0
        self._seen_draft = False
        self._after_idle = False  # the last costly round drafted nothing
        # (reached, accepted) counts per position (index i: position i, 1-based) and rounds
        # spent at K = 0, per offered-length bucket of free proposals; None: costly proposals
        self._counts: dict[int | None, tuple[list[float], list[float]]] = {}
        self._idle: dict[int | None, int] = {}
        self._seen_free = False
        self._bucket: int | None = None  # the bucket of the round in flight

    def alphas(self, bucket: int | None = None) -> list[float]:
        """[α_1, ..., α_max_k] under the current counts (of free proposals offering a length
        in ``bucket``, or of costly ones for None)."""
        reached, accepted = self.counts(bucket)
        # prior for free proposals: a match of m tokens is right about m/(m+1) of the time
        first = self.first_alpha if bucket is None else 2 ** (bucket - 1) / (2 ** (bucket - 1) + 1)
        return chained_acceptance(reached[1:], accepted[1:], first, self.prior_weight)

    def counts(self, bucket: int | None = None) -> tuple[list[float], list[float]]:
        """(reached, accepted): decayed counts per position 0..max_k (0 unused)."""
        if bucket not in self._counts:
            self._counts[bucket] = ([0.0] * (self.max_k + 1), [0.0] * (self.max_k + 1))
        return self._counts[bucket]

    def _probe(self, bucket: int | None, k: int) -> int:
        """K = 0 kept ``probe_every`` rounds in a row becomes 1: the text may have changed."""
        if k == 0:
            idle = self._idle.get(bucket, 0) + 1
            k, self._idle[bucket] = (1, 0) if idle >= self.probe_every else (0, idle)
        return k

    def expected_tokens(self, k: int, alphas: list[float] | None = None) -> float:
        """E(K): expected tokens emitted by a round of K drafts (bonus/recovered included)."""
        return expected_tokens(self.alphas() if alphas is None else alphas, k)

    def cost(self, k: int) -> float:
        """C(K) in seconds: drafting K tokens (and the lookahead ones) plus verifying K+1."""
        return self.draft_per_token * (k + self.lookahead if k else 0) + self.scale * self.times[k]

    def next_k(self) -> int:
        if self._seen_free:  # a lookup: it offers its match, trim() chooses
            return self.max_k
        alphas = self.alphas()
        k = max(range(0, self.max_k + 1), key=lambda k: self.expected_tokens(k, alphas) / self.cost(k))
        return self._probe(None, k)

    def trim(self, offered: int) -> int:
        """How many of the ``offered`` tokens of a free proposal (a lookup's) to verify:
        argmax over K = 0..offered of E(K)/(s·T(K+1)), α from rounds that offered a similar
        length. 0 = verify none (plain decoding this round); a bucket kept at 0 tries one
        token every ``probe_every`` rounds."""
        self._seen_free = True
        offered = min(offered, self.max_k)
        if offered <= 0:
            self._bucket = None
            return 0
        bucket = offered.bit_length()
        self._bucket = bucket
        alphas = self.alphas(bucket)
        k = max(range(0, offered + 1),
                key=lambda k: self.expected_tokens(k, alphas) / (self.scale * self.times[k]))
        return self._probe(bucket, k)

    def update(self, proposed: int, accepted: int, draft_s: float | None, verify_s: float | None) -> None:
        bucket, self._bucket = self._bucket, None
        reached, acc = self.counts(bucket)
        if proposed:
            self._idle[bucket] = 0
            d = self.decay
            reached[:] = [r * d for r in reached]
            acc[:] = [a * d for a in acc]
        for i in range(1, min(proposed, accepted + 1, self.max_k) + 1):
            reached[i] += 1
            if i <= accepted:
                acc[i] += 1
        if proposed and draft_s is not None and bucket is None and not self._after_idle:
            # a round after rounds without drafts also fed the draft every token committed
            # meanwhile: counted per drafted token, that catch-up made a one-token probe cost
            # twice a draft step and kept K at 0 (q4 target, int4 draft: mean K 0.14)
            per_token = draft_s / (proposed + self.lookahead)
            self.draft_per_token = (per_token if not self._seen_draft
                                    else 0.8 * self.draft_per_token + 0.2 * per_token)
            self._seen_draft = True
        if bucket is None:
            self._after_idle = not proposed
        n = min(proposed + 1, len(self.times))
        if verify_s is not None and verify_s > 0:
            self.scale = 0.8 * self.scale + 0.2 * (verify_s / self.times[n - 1])


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _positive(x) -> bool:
    return _finite(x) and x > 0

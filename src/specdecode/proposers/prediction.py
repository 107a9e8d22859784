"""Predicted outputs (OpenAI's ``prediction: {"type": "content", ...}``): text the user
expects most of the output to repeat (a file an editor asks to rewrite), proposed for free."""

from __future__ import annotations

from ..costmodel import chained_acceptance, expected_tokens, relative_cost
from ..models.base import CausalLM
from .base import DraftOutput, Proposer, RequestState, Steps, run_alone


class PredictionProposer(Proposer):
    """The prediction's tokens as a free proposal, following the output as it diverges
    from the prediction and re-joins it; another proposer (``inner``, the request's method)
    proposes in the rounds where the prediction has nothing to offer.

    Alignment: a pointer into the prediction at the token the output is expected to say
    next. Each committed token equal to the prediction's at the pointer moves it on; any
    other loses it. While it is lost, after each round the output's last tokens are looked
    for in the prediction (the longest of 4, 3, 2 or 1 tokens that occurs; of its places,
    the first at or after where the pointer was lost, else the last before it), so that an
    edit inside a file keeps the rest of the file proposable. Past the prediction's end, or
    while lost, ``inner`` proposes (or nothing without one).

    Length: the prediction's next L ≤ k tokens from the pointer, L maximising E(L) / T(L+1)
    (E from the acceptance α_i at each position i, learned in this request; T(n)/T(1) the
    target's ``verify_cost``; Leviathan et al., arXiv:2211.17192 §3.1, as the hybrid sizes a
    draft), learned apart for a pointer that re-joined in the last ``fresh`` committed
    tokens (an edit may go on) and one that has followed longer: a round where the output
    leaves the prediction costs a verify pass over L + 1 tokens, several times T(1) on a CPU.

    Only what is proposed changes: the acceptance rule and so the output are the method's.

    Args:
        prediction: the prediction's token ids, tokenized as the output would be.
        inner: the method's own proposer, or None (plain decoding where the prediction has
            nothing to offer).
        verify_cost: the target's T(n)/T(1) for n = 1, 2, ... (None:
            :func:`~specdecode.costmodel.relative_cost`'s default).
    """

    name = "prediction"
    default_k = 16
    longest_match = 4  # output tokens matched to re-join the prediction
    fresh = 4  # a pointer that re-joined within this many committed tokens is a fresh one
    prior_alpha = 0.9  # α before this request has measured any (a prediction is mostly right)
    prior_weight = 2.0  # its weight, in rounds

    def __init__(self, prediction: list[int], inner: Proposer | None = None,
                 verify_cost: list[float] | None = None):
        self.prediction = list(prediction)
        self.inner = inner
        self.verify_cost = verify_cost
        # the engine reads these of the request's proposer: the inner method's
        self.hidden_keys = inner.hidden_keys if inner is not None else ()
        self.lossy_typical = inner.lossy_typical if inner is not None else None
        self._places: dict[int, list[int]] = {}
        for i, t in enumerate(self.prediction):
            self._places.setdefault(t, []).append(i)
        self._start = self._seen = 0
        self._at: int | None = 0  # the prediction's index of the next output token; None: lost
        self._lost_at = 0
        self._run = 0  # committed tokens the pointer has followed since it (re-)joined
        self._counts = self._new_counts()
        self._proposed: tuple[int, list[int], int] | None = None  # (committed then, tokens, kind) in flight

    def _new_counts(self) -> list[tuple[list[float], list[float]]]:
        """Per kind of pointer (0: fresh, 1: followed longer), per position: (reached, accepted)."""
        return [([0.0] * self.default_k, [0.0] * self.default_k) for _ in range(2)]

    def reset(self, state: RequestState, max_total_len: int) -> None:
        self._start = self._seen = len(state.tokens)
        self._at, self._lost_at, self._run = 0, 0, self.fresh  # the output starts where it does
        self._counts, self._proposed = self._new_counts(), None
        if self.inner is not None:
            self.inner.reset(state, max_total_len)

    def _follow(self, tokens: list[int]) -> int | None:
        """Move the pointer over the committed tokens not yet read; returns it (None: lost)."""
        p = self.prediction
        for t in tokens[self._seen:]:
            if self._at is not None and self._at < len(p) and p[self._at] == t:
                self._at += 1
                self._run += 1
            elif self._at is not None:
                self._lost_at, self._at = self._at, None
        if self._at is None and len(tokens) > self._seen:
            self._at = self._rejoin(tokens[self._start:])
            self._run = 0
        self._seen = len(tokens)
        return self._at

    def _length(self, kind: int, k: int) -> int:
        """L ≤ k maximising E(L) / T(L+1) for this kind of pointer (see the class docstring)."""
        alpha = chained_acceptance(*self._counts[kind], self.prior_alpha, self.prior_weight)
        rates = [(expected_tokens(alpha, n) / relative_cost(self.verify_cost, n + 1), n)
                 for n in range(min(k, self.default_k) + 1)]
        return max(rates)[1]

    def _rejoin(self, out: list[int]) -> int | None:
        """The prediction's index after the longest run of ``out``'s last tokens found in it
        (see the class docstring), or None."""
        if not out:
            return None
        for m in range(min(self.longest_match, len(out)), 0, -1):
            tail = out[-m:]
            ends = [i + 1 for i in self._places.get(tail[-1], ())
                    if i + 1 >= m and self.prediction[i + 1 - m:i + 1] == tail]
            if ends:
                after = [e for e in ends if e >= self._lost_at]
                return after[0] if after else ends[-1]
        return None

    def propose(self, state: RequestState, k: int) -> DraftOutput:
        return run_alone(self.propose_steps(state, k))

    def propose_steps(self, state: RequestState, k: int) -> Steps:
        at = self._follow(state.tokens)
        self._proposed = None
        if at is not None and at < len(self.prediction):
            kind = int(self._run >= self.fresh)
            tokens = self.prediction[at:at + self._length(kind, min(k, len(self.prediction) - at))]
            if tokens:
                self._proposed = (len(state.tokens), tokens, kind)
                return DraftOutput.point_mass(tokens, self.name)
        if self.inner is None:
            return DraftOutput.empty()
        return (yield from self.inner.propose_steps(state, k))

    def on_accept(self, state: RequestState) -> None:
        if self._proposed is not None:
            n, tokens, kind = self._proposed
            got = state.tokens[n:n + len(tokens)]
            accepted = next((i for i, (a, b) in enumerate(zip(got, tokens)) if a != b), len(got))
            reached, acc = self._counts[kind]
            for i in range(min(len(tokens), accepted + 1)):  # the accepted, and the first rejected
                reached[i] += 1
                acc[i] += i < accepted
            self._proposed = None
        if self.inner is not None:
            self.inner.on_accept(state)

    # -- the rest is the inner method's

    def take_hidden(self, start, hidden) -> None:
        if self.inner is not None:
            self.inner.take_hidden(start, hidden)

    def models(self) -> tuple[CausalLM, ...]:
        return self.inner.models() if self.inner is not None else ()

    @property
    def makes_trees(self) -> bool:
        return self.inner is not None and self.inner.makes_trees

    def check_invariant(self, state: RequestState) -> None:
        if self.inner is not None:
            self.inner.check_invariant(state)

    def observe(self, draft_s: float, verify_s: float) -> None:
        if self.inner is not None:
            self.inner.observe(draft_s, verify_s)

    def share_passes(self, rows: int, feed: bool = True) -> None:
        if self.inner is not None:
            self.inner.share_passes(rows, feed)


def prediction_usage(prediction: list[int], output: list[int]) -> tuple[int, int]:
    """OpenAI's ``accepted_prediction_tokens`` and ``rejected_prediction_tokens``: the
    prediction's tokens that appear in the output, in order (the length of a longest common
    subsequence of the two id lists), and the rest of the prediction. Bit-parallel LCS
    (Hyyrö, "Bit-parallel LCS-length computation revisited", 2004): O(len(output) ·
    len(prediction) / word) with Python's integers as the bit vectors.

    Returns:
        (accepted, rejected), accepted + rejected = len(prediction).
    """
    n = len(prediction)
    if not n or not output:
        return 0, n
    where: dict[int, int] = {}
    for i, t in enumerate(prediction):
        where[t] = where.get(t, 0) | (1 << i)
    full = (1 << n) - 1
    v = full
    for t in output:
        u = v & where.get(t, 0)
        v = ((v + u) | (v - u)) & full
    accepted = n - v.bit_count()
    return accepted, n - accepted

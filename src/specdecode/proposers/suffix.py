"""Suffix matching: the most frequent continuation of the longest matching context."""

from __future__ import annotations

import collections

from .base import DraftOutput, Forecast, Proposer, RequestState


class ContinuationCounts:
    """How often each token followed each context of 1..depth tokens: the counts a suffix
    tree of bounded depth holds (SuffixDecoding, arXiv:2411.04975; llama.cpp's n-gram cache).

    ``add(tokens, start)`` counts the continuations at positions start..len-1 (contexts may
    reach back before ``start``); ``longest(seq)`` returns the length of the longest suffix of
    ``seq`` seen as a context and its entry [total, most frequent token, its count, counts],
    kept up to date on every add so that a lookup never scans the counts.
    """

    def __init__(self, depth: int):
        self.depth = depth
        self.table: dict[tuple[int, ...], list] = {}

    def add(self, tokens: list[int], start: int = 0) -> None:
        for p in range(max(start, 1), len(tokens)):
            nxt = tokens[p]
            for m in range(1, min(self.depth, p) + 1):
                entry = self.table.get(key := tuple(tokens[p - m:p]))
                if entry is None:
                    self.table[key] = [1, nxt, 1, {nxt: 1}]
                    continue
                counts = entry[3]
                c = counts[nxt] = counts.get(nxt, 0) + 1
                entry[0] += 1
                if c > entry[2]:
                    entry[1], entry[2] = nxt, c

    def longest(self, seq: list[int]) -> tuple[int, list | None]:
        for m in range(min(self.depth, len(seq)), 0, -1):
            entry = self.table.get(tuple(seq[-m:]))
            if entry is not None:
                return m, entry
        return 0, None


_M_BUCKETS = (1, 2, 3, 5, 8, 16, 64)  # match lengths: 1, 2, 3, 4-5, 6-8, 9-16, 17+


def _cell(m: int, freq: float) -> tuple[int, int]:
    return (next(i for i, top in enumerate(_M_BUCKETS) if m <= top),
            0 if freq >= 0.999 else 1 if freq >= 0.5 else 2)


class SuffixProposer(Proposer):
    """Suffix matching over the request (prompt + generated text) and, with
    ``cache="session"``, over the outputs of this proposer's earlier requests, in the spirit
    of SuffixDecoding (Oliaro et al., arXiv:2411.04975) and llama.cpp's n-gram cache.

    Each proposed token is the most frequent continuation of the longest context (up to
    ``depth`` tokens) seen before. Its confidence — the probability it is accepted given the
    ones before it were — is learned online per (match length, empirical frequency) cell
    from how this proposer's past proposals fared against the committed tokens, starting from
    the prior frequency·m/(m+1) (a one-token match is a weak hint, a long one nearly a copy).
    The speculation length follows from the confidence: drafting stops when the product of
    confidences falls below ``min_confidence``, or at k tokens. Counts are updated
    incrementally as tokens are committed. The calibration starts afresh with each request
    (so a seeded sampled request gives the same output every time), except with
    ``cache="session"``, where it is kept with the session's counts: proposals then depend on
    earlier requests, and a seed reproduces a sampled output only after the same earlier
    requests. The session keeps the most recent outputs: once they pass
    ``max_session_tokens`` tokens (default 20,000: up to 135 MiB of counts at depth 16), the
    oldest are dropped until half remain and the counts are rebuilt (SuffixDecoding bounds
    its global tree the same way, oldest requests first). Proposals are point masses (probs
    None). Raises ValueError for depth outside 1..64, min_confidence outside [0, 1), an
    unknown cache or max_session_tokens < 1.
    """

    name = "suffix"
    free = True
    PRIOR_WEIGHT = 2.0

    def __init__(self, depth: int = 16, min_confidence: float = 0.1, cache: str = "request",
                 max_session_tokens: int = 20_000):
        if not (isinstance(depth, int) and 1 <= depth <= 64):
            raise ValueError(f"suffix depth={depth!r} is invalid; allowed: an integer 1..64")
        if not (isinstance(min_confidence, (int, float)) and 0 <= min_confidence < 1):
            raise ValueError(f"suffix min_confidence={min_confidence!r} is invalid; allowed: [0, 1)")
        if cache not in ("request", "session"):
            raise ValueError(f"suffix cache={cache!r} is invalid; allowed: 'request', 'session'")
        if isinstance(max_session_tokens, bool) or not (isinstance(max_session_tokens, int)
                                                        and max_session_tokens >= 1):
            raise ValueError(f"suffix max_session_tokens={max_session_tokens!r} is invalid; "
                             "allowed: an integer >= 1")
        self.depth, self.min_confidence, self.cache = depth, min_confidence, cache
        self.max_session_tokens = max_session_tokens
        self.session = ContinuationCounts(depth)
        self._outputs: collections.deque[list[int]] = collections.deque()  # what session counts
        self.calibration: dict[tuple[int, int], list[float]] = {}  # cell -> [accepted, reached]
        self._request = ContinuationCounts(depth)
        self._counted = 0
        self._previous: tuple[list[int], int] | None = None  # (tokens, prompt length)
        self._pending: tuple[int, list[int], list[tuple[int, int]]] | None = None

    def reset(self, state: RequestState, max_total_len: int) -> None:
        if self.cache == "session":
            if self._previous is not None:
                tokens, prompt_len = self._previous
                self._remember(tokens[prompt_len:])
            self._previous = (state.tokens, len(state.tokens))
        else:
            self.calibration = {}
        self._request = ContinuationCounts(self.depth)
        self._counted = 0
        self._pending = None
        self._update(state.tokens)

    def _remember(self, output: list[int]) -> None:
        """Count a finished request's output in the session, dropping the oldest past the cap."""
        self._outputs.append(output)
        self.session.add(output)
        held = sum(map(len, self._outputs))
        if held > self.max_session_tokens:
            while held > self.max_session_tokens // 2:
                held -= len(self._outputs.popleft())
            self.session = ContinuationCounts(self.depth)
            for kept in self._outputs:
                self.session.add(kept)

    def _update(self, tokens: list[int]) -> None:
        self._request.add(tokens, self._counted)
        self._counted = len(tokens)

    def _probability(self, m: int, freq: float) -> tuple[float, tuple[int, int]]:
        cell = _cell(m, freq)
        acc, reached = self.calibration.get(cell, (0.0, 0.0))
        prior = freq * m / (m + 1)
        return (acc + self.PRIOR_WEIGHT * prior) / (reached + self.PRIOR_WEIGHT), cell

    def forecast(self, state: RequestState, k: int) -> Forecast:
        """Up to k tokens and the confidence of each prefix (non-increasing)."""
        tokens = state.tokens
        self._update(tokens)
        tables = (self._request, self.session) if self.cache == "session" else (self._request,)
        seq = tokens[-self.depth:]
        out: list[int] = []
        conf: list[float] = []
        cells: list[tuple[int, int]] = []
        c = 1.0
        for _ in range(k):
            best = None
            for table in tables:
                m, entry = table.longest(seq)
                if entry is not None and (best is None or m > best[0]):
                    best = (m, entry)
            if best is None:
                break
            m, (total, tok, n, _) = best
            p, cell = self._probability(m, n / total)
            c *= p
            if c < self.min_confidence:
                break
            out.append(tok)
            conf.append(c)
            cells.append(cell)
            seq = seq[1:] + [tok] if len(seq) == self.depth else seq + [tok]
        self._pending = (len(tokens), out, cells)
        return Forecast(out, conf)

    def propose(self, state: RequestState, k: int) -> DraftOutput:
        out = self.forecast(state, k).tokens
        return DraftOutput.point_mass(out, self.name) if out else DraftOutput.empty()

    def on_accept(self, state: RequestState) -> None:
        """Learn from the last proposal: each token is scored against the committed token at
        its position (for a proposal not verified — a hybrid's unused one — this is whether
        it would have been accepted under greedy decoding, and has the same probability under
        sampling) up to the first miss."""
        if self._pending is not None:
            start, out, cells = self._pending
            committed = state.tokens[start:]
            for tok, got, cell in zip(out, committed, cells):
                stats = self.calibration.setdefault(cell, [0.0, 0.0])
                stats[1] += 1
                if tok != got:
                    break
                stats[0] += 1
            self._pending = None
        self._update(state.tokens)

    def discard_last_proposal(self) -> None:
        self._pending = None

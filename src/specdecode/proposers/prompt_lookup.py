"""Prompt lookup: propose what followed the last n tokens earlier in the text."""

from __future__ import annotations

from .base import DraftOutput, Forecast, Proposer, RequestState


class PromptLookupProposer(Proposer):
    """Prompt lookup decoding (Saxena 2023; transformers ``prompt_lookup_num_tokens``, vLLM
    ``ngram``): find the last n committed tokens, n from ``max_ngram`` down to ``min_ngram``,
    earlier in the prompt + generated text, and propose the k tokens that followed them.

    The index maps each n-gram to where its continuation starts and is updated incrementally
    as tokens are committed (each token is indexed once; a round costs O(max_ngram), never a
    rescan of the context). ``match="recent"`` keeps the latest occurrence of an n-gram,
    ``"first"`` the earliest (transformers' choice); recent is the default because the text
    being copied is usually the one just quoted or just written (BENCHMARKS.md measures both).
    The proposal is as long as the match, at most k: the matched n-gram is extended backward
    (up to 64 tokens) to measure how long the text has been following the earlier passage —
    a one-token match proposes one token, a copy in progress up to k (SuffixDecoding's
    speculation length α·match length with α = 1, arXiv:2411.04975; BENCHMARKS.md measures
    it). A continuation that runs into the end of the text keeps copying its own proposed
    tokens (an overlapping copy), so a repeating pattern is proposed for all k tokens.
    Default n = 5..2: a one-token match is too weak a hint to pay for a verify pass, and
    longer n-grams pick the right passage in edits and summaries (replayed outputs,
    BENCHMARKS.md). Proposals are point masses (probs None): lossless for greedy and sampling
    alike. Raises ValueError for n-gram sizes outside 1 <= min_ngram <= max_ngram <= 32 or an
    unknown ``match``.
    """

    name = "prompt-lookup"
    free = True

    def __init__(self, max_ngram: int = 5, min_ngram: int = 2, match: str = "recent"):
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int)
                and not isinstance(min_ngram, bool) and not isinstance(max_ngram, bool)
                and 1 <= min_ngram <= max_ngram <= 32):
            raise ValueError(f"prompt lookup n-gram sizes min={min_ngram!r} max={max_ngram!r} are "
                             "invalid; allowed: integers with 1 <= min <= max <= 32")
        if match not in ("recent", "first"):
            raise ValueError(f"prompt lookup match={match!r} is invalid; allowed: 'recent', 'first'")
        self.max_ngram, self.min_ngram, self.match = max_ngram, min_ngram, match
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0

    def reset(self, state: RequestState, max_total_len: int) -> None:
        self._index = {}
        self._indexed = 0
        self._update(state.tokens)

    def _update(self, tokens: list[int]) -> None:
        # index the n-grams ending at p for every p whose continuation (p + 1) is committed
        recent = self.match == "recent"
        for p in range(self._indexed, len(tokens) - 1):
            for n in range(self.min_ngram, min(self.max_ngram, p + 1) + 1):
                key = tuple(tokens[p + 1 - n:p + 1])
                if recent:
                    self._index[key] = p + 1
                else:
                    self._index.setdefault(key, p + 1)
        self._indexed = max(self._indexed, len(tokens) - 1)

    MAX_MATCH = 64

    def lookup(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """(up to k proposed tokens, match length; 0 = no match)."""
        self._update(tokens)
        end = len(tokens)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            pos = self._index.get(tuple(tokens[-n:]))
            if pos is not None:
                m = n  # tokens[pos-m:pos] == tokens[end-m:end]; extend it backward
                while m < min(k, self.MAX_MATCH) and pos - m > 0 and tokens[pos - m - 1] == tokens[end - m - 1]:
                    m += 1
                out: list[int] = []
                for j in range(pos, pos + min(k, m)):
                    out.append(tokens[j] if j < end else out[j - end])
                return out, m
        return [], 0

    def forecast(self, state: RequestState, k: int) -> Forecast:
        """The proposal with the confidence of a copy: a match of m tokens is taken to be
        right with probability m/(m+1) per token (SuffixDecoding's prior, arXiv:2411.04975),
        so the first i tokens are all accepted with (m/(m+1))^i."""
        out, m = self.lookup(state.tokens, k)
        p = m / (m + 1)
        return Forecast(out, [p ** i for i in range(1, len(out) + 1)])

    def propose(self, state: RequestState, k: int) -> DraftOutput:
        out, _ = self.lookup(state.tokens, k)
        return DraftOutput.point_mass(out, self.name) if out else DraftOutput.empty()

    def on_accept(self, state: RequestState) -> None:
        self._update(state.tokens)

"""Proposers: anything that proposes draft tokens for the target to verify.

A proposer has three methods (DESIGN.md): ``reset`` at the start of a request, ``propose``
each round, ``on_accept`` after verification. "No draft this round" is an empty tensor.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from .backends import CausalLM
from .config import SamplingParams
from .sampling import process_logits, sample, to_probs
from .schedule import chained_acceptance, expected_tokens


@dataclass(frozen=True)
class DraftOutput:
    """Draft tokens of one round.

    token_ids: [B,k] int64, k >= 0 (k == 0: no draft this round).
    probs: [B,k,V] the distributions the tokens were sampled from, or None when each token
        is a point mass (greedy drafts, lookups) — the verifier must know exactly which.
    source: which proposer supplied the tokens (a hybrid's stats count accepted tokens per source).
    free: True when the tokens cost nothing to propose (lookups), so the K schedule may cut
        the proposal short after seeing it (``trim``); False for a draft model's tokens.
    """

    token_ids: torch.Tensor
    probs: torch.Tensor | None = None
    source: str = ""
    free: bool = False

    @classmethod
    def empty(cls, batch: int = 1) -> "DraftOutput":
        return cls(torch.empty(batch, 0, dtype=torch.long))

    @classmethod
    def point_mass(cls, tokens: list[int], source: str) -> "DraftOutput":
        """Deterministic proposals (lookups): [1,k] ids, no distribution."""
        return cls(torch.tensor([tokens], dtype=torch.long).reshape(1, len(tokens)), None, source, True)


@dataclass
class RequestState:
    """What a proposer may read about the request in flight (B = 1 for now).

    tokens: committed token ids (prompt + generated), a Python list.
    num_generated: how many of them were generated.
    """

    tokens: list[int]
    num_generated: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None
    target_vocab_size: int


class Proposer(Protocol):
    def reset(self, state: RequestState, max_total_len: int) -> None:
        """Start a request: ``state.tokens`` is the prompt; at most ``max_total_len`` tokens."""

    def propose(self, state: RequestState, k: int) -> DraftOutput:
        """Propose up to k draft tokens to follow ``state.tokens``."""

    def on_accept(self, state: RequestState) -> None:
        """``state.tokens`` now holds the committed tokens after verification."""


class DraftModelProposer:
    """A smaller model of the same tokenizer proposes K tokens autoregressively.

    Greedy requests: the draft's argmax (a point-mass proposal). Sampled requests: drafts are
    drawn from the draft's distribution after the same processing (temperature, top-k/p,
    repetition penalty) and that exact distribution is returned for the acceptance rule.

    The draft's cache always holds a prefix of the committed tokens: each round first feeds
    the committed tokens it has not seen (the whole prompt on the first round, or the last
    accepted draft + the bonus token), and ``on_accept`` rolls back the rejected tail.
    Speculation turns off for the request (empty drafts, nothing counted) when the draft's
    context is full or a committed token lies beyond the draft's embedding rows.

    p_min: stop drafting at the first position where the draft's most likely token (after the
    request's processing) has probability below p_min; that token is not proposed (llama.cpp
    ``--draft-p-min``; transformers' ``assistant_confidence_threshold``). None = always K.
    lazy_prefill: do not prefill the prompt at ``reset``; the first ``propose`` feeds it (a
    hybrid that may never need the draft model saves the draft's prefill). Unseen tokens are
    fed as all but the last, then the last alone, when they start the sequence or number
    more than two (a lazy prefill, or a catch-up after lookup rounds; as ``reset`` does): an int8
    draft quantizes each call's activations with one scale, and the prompt's first token
    (outsized activations) coarsens the last position's logits when they share a call. Fed
    in one call, the int8 0.5B draft's first token matched the target's on 16 of 23 bench
    prompts; split, on 18 (the hybrid's lazy prefill had lost the first round of short QA
    answers this way).
    Raises ValueError for p_min outside [0, 1).
    """

    def __init__(self, draft: CausalLM, p_min: float | None = None, lazy_prefill: bool = False):
        if p_min is not None and not (isinstance(p_min, (int, float)) and 0 <= p_min < 1):
            raise ValueError(f"draft p_min={p_min!r} is invalid; allowed: a number in [0, 1), or None")
        self.draft = draft
        self.p_min = p_min
        self.lazy_prefill = lazy_prefill
        self.enabled = False
        self._limit = 0

    def reset(self, state: RequestState, max_total_len: int) -> None:
        self._limit = min(self.draft.max_context, max_total_len)
        prompt = state.tokens
        self.enabled = len(prompt) - 1 <= self._limit and max(prompt) < self.draft.vocab_size
        if not self.enabled:
            return
        self.draft.allocate(1, self._limit)
        if len(prompt) > 1 and not self.lazy_prefill:
            self.draft.forward(torch.tensor([prompt[:-1]]), num_logits=0)

    def propose(self, state: RequestState, k: int, guess: list[int] | None = None) -> DraftOutput:
        """Draft tokens [1, m] (with their distributions [1, m, V] when sampling); m ≤ k
        without a guess, ≤ max(k, len(guess) + 1) with one, 0 when the draft is off or unsure.

        guess (greedy requests; ignored when sampling): tokens another proposer expects next
        (at most the round's K − 1). The draft reads them in one forward pass and keeps the
        prefix that is its own argmax at every position (p_min does not apply where both
        expect the same token), then, where it first differs, its own token if it is sure of
        it (top probability ≥ p_min), and so after the whole guess; from its own token it
        drafts on one token at a time up to k tokens in all. Where it is unsure of its own
        token, the proposal ends before it.
        """
        n = len(state.tokens)
        if self._limit - n + 1 <= 0:
            self.enabled = False  # the draft's context is full
        params, v = state.params, state.target_vocab_size
        guess = list(guess or []) if params.greedy else []
        cap = min(max(k, len(guess) + 1) if guess else k, self._limit - n + 1)
        if not self.enabled or cap <= 0:
            return DraftOutput.empty()
        k, guess = min(k, cap), guess[:cap - 1]  # the cache holds the guess and the committed tokens
        new = state.tokens[self.draft.seq_len:]
        if max(new + guess) >= self.draft.vocab_size:
            self.enabled = False
            return DraftOutput.empty()
        if len(new) > 2 or (len(new) == 2 and self.draft.seq_len == 0):  # see the class docstring
            self.draft.forward(torch.tensor([new[:-1]]), num_logits=0)
            new = new[-1:]
        context = torch.tensor([state.tokens + guess])
        ids, dists = [], []
        if guess:
            logits = self.draft.forward(torch.tensor([new + guess]), num_logits=len(guess) + 1)
            own = False  # the last token is the draft's own (not in the guess)
            for i in range(min(len(guess) + 1, cap)):
                row = process_logits(logits[:, i:i + 1, :v], params, context[:, :n + i], None,
                                     state.num_generated + i, state.eos_token_ids)[:, 0]
                tok = row.argmax(-1)
                if i < len(guess) and int(tok) == guess[i]:
                    ids.append(tok)  # both expect it: kept however sure the draft is
                    continue
                if not self._unsure(row):
                    ids.append(tok)  # the draft's own token, where it is sure
                    own = True
                break
            self.draft.rollback(n - 1 + len(ids))  # the kept guess tokens stay in the cache
            if not own:
                return self._output(ids, dists)  # the draft is unsure of its own next token
            context = torch.cat([context[:, :n + len(ids) - 1], ids[-1][:, None]], 1)
            new = [int(ids[-1])]  # the draft drafts on from its own token
        feed = torch.tensor([new])
        for i in range(len(ids), k):
            logits = self.draft.forward(feed, num_logits=1)[..., :v]
            logits = process_logits(logits, params, context, None, state.num_generated + i,
                                    state.eos_token_ids)[:, 0]
            probs = None if params.greedy else to_probs(logits, params)
            if self._unsure(logits, probs):
                break
            if probs is None:
                tok = logits.argmax(-1)
            else:
                tok = sample(probs, state.generator)
                dists.append(probs)
            ids.append(tok)
            feed = tok[:, None]
            context = torch.cat([context, feed], 1)
        return self._output(ids, dists)

    def _unsure(self, logits: torch.Tensor, probs: torch.Tensor | None = None) -> bool:
        """Whether the draft's top probability ([1, V] logits, or the sampled request's
        probs) is below p_min."""
        if self.p_min is None:
            return False
        return float((torch.softmax(logits.float(), -1) if probs is None else probs).max()) < self.p_min

    @staticmethod
    def _output(ids: list, dists: list) -> DraftOutput:
        if not ids:
            return DraftOutput.empty()
        return DraftOutput(torch.stack(ids, 1), torch.stack(dists, 1) if dists else None, "draft")

    def on_accept(self, state: RequestState) -> None:
        if self.enabled:
            self.draft.rollback(min(self.draft.seq_len, len(state.tokens) - 1))


class PromptLookupProposer:
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

    def propose(self, state: RequestState, k: int) -> DraftOutput:
        out, _ = self.lookup(state.tokens, k)
        return DraftOutput.point_mass(out, self.name) if out else DraftOutput.empty()

    def on_accept(self, state: RequestState) -> None:
        self._update(state.tokens)


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


class SuffixProposer:
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

    def continuation(self, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
        """Up to k tokens and the confidence of each prefix (non-increasing)."""
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
        return out, conf

    def propose(self, state: RequestState, k: int) -> DraftOutput:
        out, _ = self.continuation(state.tokens, k)
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

    def forget_proposal(self) -> None:
        """Do not learn from the last proposal (it was not used)."""
        self._pending = None


class HybridProposer:
    """Suffix matching when its proposal promises more tokens per unit of time than the draft
    model, the draft model otherwise, each at the length that pays best this round.

    Each round the lookup proposes first (free, up to K tokens) with calibrated confidences
    c_i (the probability its first i tokens are all accepted), so p_i = c_i/c_{i−1} is the
    probability token i is accepted once the ones before it were. r scales them: what this
    request's lookup proposals delivered over what the p_i expected (prior 1, weight
    ``PRIOR_WEIGHT`` tokens). Every round's proposal counts, used or not: each position the
    round's committed tokens reach is checked against them (a greedy acceptance, the same
    probability under sampling) up to the first miss. So a lookup that keeps over-promising
    (numbers repeated in arithmetic) loses its turns to the draft model, and one that would
    have been right (a copy begins) wins them back. The best lookup length L maximises
    (1 + Σ_{i≤L} Π_{j≤i} min(1, r·p_j)) / T(L+1). The draft model's acceptance at position i
    given the ones before were accepted, α_i, is estimated from this request's draft rounds
    (per position, because a draft's misses come in bursts: past the first tokens it is
    usually right; prior weight ``PRIOR_WEIGHT`` rounds, prior mean α_{i−1}'s estimate, and
    ``DRAFT_PRIOR_ALPHA`` for α_0, so positions not drafted yet look like the last one that
    was, and a draft doing well is tried further); drafting D ≤ min(K, ``draft_k``) tokens
    promises E(D) = Σ_{i=0..D} Π_{j<i} α_j tokens (Leviathan et al., arXiv:2211.17192, §3.1,
    with α per position) for D·c_draft + T(D+1) + P, where P is the cost of feeding the draft
    the B committed tokens it has not seen (it is prefilled lazily, only once it is first
    chosen, and skips the rounds the lookup serves), B·``draft_prefill_cost``, spread over
    the rounds left. The rounds left assume the answer goes on for as many tokens as it has
    so far (at least ``HORIZON``, at most what max_new_tokens allows): a short answer to a
    long prompt (RAG) does not pay a long prefill for a few rounds. The draft's best D is the
    longest whose rate is within ``EXPLORE`` (3 %) of the highest: positions past the chosen
    length are not measured, so without this one early miss at position 5 would keep its
    estimate low and every later round at 4 tokens (on mock drafts right 84 % of the time,
    this cut the modelled time of a request by up to 12 % and never raised it). The draft
    model drafts its best D when that rate beats both the lookup's best over
    ``LOOKUP_MARGIN`` (1.3) and plain decoding's, 1/T(1) (by ``COLD_MARGIN``, 10 %, when the
    draft must first be fed more than two committed tokens: that feed is paid for certain,
    its return only if the answer goes on; on RAG prompt 513 a draft 4 % better than plain
    decoding by this model was fed 763 tokens, 1.5 s, for the answer's last round. Replayed
    on 45 recorded outputs (modelled decode speed over plain), 10 % changed three: RAG
    1.12× from 0.99×, summarization 1.22× from 1.18× and 3.41× from 3.42×; 20 % lost code
    editing up to 28 %); else the lookup proposes its best L
    if that beats plain decoding, and nothing is proposed if not. The margin: a lookup's
    promise rests on a few of this request's proposals, and one that fails where the draft
    would have been accepted loses a whole round; replayed on 30 recorded outputs
    (``benchmarks/simulate_hybrid.py``) it raised the modelled speed by 0.2–0.8 % (geometric
    means) and lost only on summarization (1 %). A draft given up after a bad start (its rate below plain decoding's) would
    never be measured again, so once it has drafted, every ``PROBE_EVERY`` (8) rounds
    without it and without a useful lookup it drafts once more; each such probe doubles
    the wait for the next, and a draft chosen on its merits resets it.
    Costs are relative to T(1): ``verify_cost[n-1]`` = T(n)/T(1) (the target's profile,
    :func:`~specdecode.schedule.verify_profile`; default 1 + 0.08·(n−1)), ``draft_cost`` =
    one draft step / T(1) (the draft's profiled T(1) over the target's; default 0.12),
    ``draft_prefill_cost`` = the draft's prefill time per token / T(1) (default 0.008: the
    int8 0.5B draft vs the fp32 1.5B target on this project's CPU, about 2 ms a token against
    0.24 s). Every choice depends only on the request's tokens and these costs, never on the
    clock during a request, so a seeded sampled request is reproducible with the same costs:
    through the API, on one machine once its forward-time profile is cached (the first use
    measures it; a cache that cannot be written means a new profile, and possibly other
    choices, in every process). ``DraftOutput.source`` tells the engine's stats
    which proposer supplied each round; the draft's cache catches up on the tokens it skipped
    the next time it drafts.
    Greedy requests: the draft reads the lookup's proposal. In a round the draft takes, the
    lookup's best L tokens (at most K − 1) go to it as a guess (``DraftModelProposer.propose``):
    it reads them in one forward pass, keeps those it would have drafted itself and drafts on
    from its own token where they part, so it proposes its own greedy continuation in fewer
    draft steps. A round the lookup takes goes through the draft the same way when the draft
    has seen the committed tokens (at most one behind, so the read costs one draft pass over
    L + 1 tokens) and the lookup expects to lose more than 10 % of it, (1 + E_L)/(1 + L) <
    ``CHECK_BELOW`` (0.9): where they part, the draft's own token is proposed if it is sure
    of it (top probability ≥ its p_min), and nothing after the shared tokens if not. A
    lookup sure of its proposal (code copied in an edit) is not read: on 5 code-edit prompts
    the read never changed such a proposal and cost 5 %. When the draft's first token is the
    lookup's, the round's source is ``"suffix+draft"``. Under sampling the draft's tokens are
    drawn, not compared, and nothing is read.
    The draft model stops drafting at a token whose probability is below ``DRAFT_P_MIN``
    (0.5) unless its ``p_min`` was set (0 = never stop): its misses are where it is unsure.
    Measured against p_min unset, interleaved on the same prompts (int8 0.5B draft, fp32 1.5B
    target; medians of per-prompt ratios): math 1.06× (8 prompts) and 1.06× (5 others),
    translation 1.01× and 1.07×, HumanEval 0.99× (5).
    Raises ValueError for a verify_cost that is not positive, a negative draft_cost or
    draft_prefill_cost, or draft_k < 1.
    """

    name = "hybrid"
    PRIOR_WEIGHT = 2.0
    DRAFT_PRIOR_ALPHA = 0.7
    HORIZON = 16
    EXPLORE = 0.03
    LOOKUP_MARGIN = 1.3
    PROBE_EVERY = 8
    DRAFT_P_MIN = 0.5
    CHECK_BELOW = 0.9
    COLD_MARGIN = 1.1

    def __init__(self, lookup: SuffixProposer, draft: DraftModelProposer,
                 verify_cost: list[float] | None = None, draft_cost: float = 0.12, draft_k: int = 6,
                 draft_prefill_cost: float = 0.008):
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
        draft.lazy_prefill = True  # the draft is fed the prompt only if it is ever chosen
        if draft.p_min is None:
            draft.p_min = self.DRAFT_P_MIN
        self.lookup, self.drafter = lookup, draft
        self.verify_cost, self.draft_cost = verify_cost, draft_cost
        self.draft_k, self.draft_prefill_cost = draft_k, draft_prefill_cost
        self._max_total_len = self._prompt_len = 0
        self._draft_counts = ([0.0] * draft_k, [0.0] * draft_k)  # per position: (reached, accepted)
        self._lookup_counts = [0.0, 0.0]  # this request's lookup proposals: [accepted, promised]
        self._drafted: tuple[int, int] | None = None  # this round's draft: (start, proposed)
        self._looked_up: tuple[int, list[int], list[float]] | None = None  # (start, tokens, conf)
        self._idle, self._probe_every = 0, self.PROBE_EVERY  # rounds since the draft drafted

    @property
    def draft(self) -> CausalLM:
        return self.drafter.draft

    @property
    def enabled(self) -> bool:
        return self.drafter.enabled

    @property
    def draft_alpha(self) -> list[float]:
        """α_i: the draft token at position i is accepted if the ones before it were, as
        estimated in this request (length draft_k)."""
        return chained_acceptance(*self._draft_counts, self.DRAFT_PRIOR_ALPHA, self.PRIOR_WEIGHT)

    @property
    def lookup_realism(self) -> float:
        """r: this request's lookup tokens accepted / expected, over the positions reached."""
        acc, promised = self._lookup_counts
        return (acc + self.PRIOR_WEIGHT) / (promised + self.PRIOR_WEIGHT)

    def reset(self, state: RequestState, max_total_len: int) -> None:
        self.lookup.reset(state, max_total_len)
        self.drafter.reset(state, max_total_len)
        self._max_total_len, self._prompt_len = max_total_len, len(state.tokens)
        self._draft_counts = ([0.0] * self.draft_k, [0.0] * self.draft_k)
        self._lookup_counts = [0.0, 0.0]
        self._drafted = self._looked_up = None
        self._idle, self._probe_every = 0, self.PROBE_EVERY

    def _t(self, n: int) -> float:
        """T(n)/T(1)."""
        if self.verify_cost is None:
            return 1 + 0.08 * (n - 1)
        c = self.verify_cost
        if n <= len(c):
            return c[n - 1]  # beyond the profile: its mean slope, never falling below T(len)
        return c[-1] + max(0.0, (c[-1] - c[0]) / max(1, len(c) - 1)) * (n - len(c))

    def _best_lookup(self, conf: list[float]) -> tuple[int, float]:
        """(L, tokens per unit of time) of the best lookup length (0, 1.0: none beats plain)."""
        r = self.lookup_realism
        best, promised, reach, before = (0, 1.0), 0.0, 1.0, 1.0
        for i, c in enumerate(conf, 1):
            reach *= min(1.0, r * c / before) if before > 0 else 0.0  # r·p_i, at most 1
            before = c
            promised += reach
            rate = (1 + promised) / self._t(i + 1)
            if rate > best[1]:
                best = (i, rate)
        return best

    def _best_draft(self, n: int, k: int) -> tuple[int, float]:
        """(D, tokens per unit of time) of the best draft length (0, 0.0 if none)."""
        if not self.drafter.enabled:
            return 0, 0.0
        alpha = self.draft_alpha
        behind = max(0, n - 1 - self.draft.seq_len)  # committed tokens the draft has not seen
        horizon = max(1, min(self._max_total_len - n, max(self.HORIZON, n - self._prompt_len)))
        rates = []
        for d in range(1, min(k, self.draft_k) + 1):
            expected = expected_tokens(alpha, d)
            catch_up = behind * self.draft_prefill_cost / max(1.0, horizon / expected)
            rates.append((d, expected / (d * self.draft_cost + self._t(d + 1) + catch_up)))
        if not rates:
            return 0, 0.0
        top = max(rate for _, rate in rates)
        return max((d, rate) for d, rate in rates if rate >= (1 - self.EXPLORE) * top)

    def propose(self, state: RequestState, k: int) -> DraftOutput:
        out, conf = self.lookup.continuation(state.tokens, k)
        n = len(state.tokens)
        self._looked_up = (n, out, conf)
        length, lookup_rate = self._best_lookup(conf)
        d, draft_rate = self._best_draft(n, k)
        behind = n - 1 - self.draft.seq_len  # committed tokens the draft has not seen
        cold = behind > 2  # the draft must first be fed what it skipped
        merit = draft_rate > max(lookup_rate / self.LOOKUP_MARGIN, self.COLD_MARGIN if cold else 1.0)
        # a draft given up after a bad start is tried again now and then (never one that was
        # not fed yet: its catch-up prefill is left to the cost model)
        probe = (d > 0 and lookup_rate <= 1.0 and self._idle >= self._probe_every
                 and self._draft_counts[0][0] > 0)
        # greedy: a draft that has seen the committed tokens reads a lookup proposal that is
        # not sure, (1 + E_L) / (1 + L) below CHECK_BELOW
        greedy = state.params.greedy
        sure = lookup_rate * self._t(length + 1) / (1 + length) if length else 1.0
        check = (greedy and d > 0 and length > 0 and k > 1 and behind <= 1
                 and sure < self.CHECK_BELOW)
        if merit or probe or check:
            guess = out[:min(length, k - 1)] if greedy else []
            if not guess:
                self.lookup.forget_proposal()  # scoring only unused proposals would bias its calibration
            drafted = self.drafter.propose(state, d, guess)
            m = drafted.token_ids.shape[1]
            if m:
                self._drafted = (n, min(m, self.draft_k))
                self._idle = 0
                self._probe_every = self.PROBE_EVERY if merit or check else 2 * self._probe_every
                if guess and int(drafted.token_ids[0, 0]) == guess[0]:
                    drafted = replace(drafted, source="suffix+draft")
                return drafted
            if guess:  # the draft read the lookup's proposal and backs none of it
                return DraftOutput.empty()
        self._idle += self.drafter.enabled
        if length == 0:  # costs more than it promises; still scored, to keep learning
            return DraftOutput.empty()
        return DraftOutput.point_mass(out[:length], self.lookup.name)

    def on_accept(self, state: RequestState) -> None:
        if self._drafted is not None:
            start, proposed = self._drafted
            accepted = min(proposed, len(state.tokens) - start - 1)
            reached, acc = self._draft_counts
            for i in range(min(proposed, accepted + 1)):  # reached: the accepted, the first rejected
                reached[i] += 1
                acc[i] += i < accepted
            self._drafted = None
        if self._looked_up is not None:
            # the lookup's proposal, used or not, against the committed tokens it reaches:
            # position i is accepted iff the committed token there is its token (greedy; the
            # same probability under sampling); it was expected with p_i = c_i / c_{i-1}
            start, out, conf = self._looked_up
            before = 1.0
            for tok, got, c in zip(out, state.tokens[start:], conf):
                self._lookup_counts[1] += c / before if before > 0 else 0.0
                if tok != got:
                    break
                self._lookup_counts[0] += 1
                before = c
            self._looked_up = None
        self.lookup.on_accept(state)
        self.drafter.on_accept(state)

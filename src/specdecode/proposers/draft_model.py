"""Draft-model speculation: a smaller model of the target's tokenizer drafts K tokens."""

from __future__ import annotations

import torch

from ..models.base import CausalLM
from ..sampling import process_logits, sample, to_probs
from ..tree import DraftTree
from .base import DraftOutput, Proposer, RequestState, Steps, run_alone


class DraftModelProposer(Proposer):
    """A smaller model of the same tokenizer proposes K tokens autoregressively.

    Greedy requests: the draft's argmax (a point-mass proposal). Sampled requests, rejection
    rule: drafts are drawn from the draft's distribution after the same processing
    (temperature, top-k/p, repetition penalty) and that exact distribution is returned for
    the acceptance rule. Gumbel rule: the Gumbel-max sample of that distribution with the
    target's noise of the same position (a point mass: the verifier needs no distribution).

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
    (outsized activations) coarsens the last position's logits when they share a call.
    tree_width: w > 1 proposes a draft tree to greedy and Gumbel-rule requests: the drafted
    chain, and at each of its depths the draft's next w - 1 most likely tokens (after the
    request's processing, and its noise under the Gumbel rule) as leaves beside it, so that
    where the target rejects the chain's token for one of those it keeps that token and the
    bonus after it. They come from the logits the chain's draft steps computed anyway (no
    extra draft pass); the verify pass has 1 + w * (drafted tokens) rows. Sampled requests of
    the rejection rule get the chain. 1 (default): no tree.
    mask_id: a parallel draft's mask token (PARD, arXiv:2504.18583; vLLM's ``pard_token``):
    the draft then proposes in one pass over the committed tokens it has not seen followed
    by k − 1 mask tokens, the row of the last committed token giving the first draft token
    and the mask at each next position the token after it (greedy: argmax; sampled: drawn from
    that row's processed distribution, which is returned; Gumbel rule: with the target's noise
    of that position; p_min and trees as above, per row). The masks' cache entries are rolled
    back after the pass. None (default): one pass per draft token.
    Raises ValueError for p_min outside [0, 1), a tree_width outside 1..8 or a mask_id outside
    the draft's embedding rows.
    """

    name = "draft"
    default_k = 6
    reads_guess = True

    def __init__(self, draft: CausalLM, p_min: float | None = None, lazy_prefill: bool = False,
                 tree_width: int = 1, mask_id: int | None = None):
        if p_min is not None and not (isinstance(p_min, (int, float)) and 0 <= p_min < 1):
            raise ValueError(f"draft p_min={p_min!r} is invalid; allowed: a number in [0, 1), or None")
        if isinstance(tree_width, bool) or not isinstance(tree_width, int) or not 1 <= tree_width <= 8:
            raise ValueError(f"draft tree_width={tree_width!r} is invalid; allowed: an integer in "
                             "1..8 (1: no tree)")
        if mask_id is not None and (isinstance(mask_id, bool) or not isinstance(mask_id, int)
                                    or not 0 <= mask_id < draft.vocab_size):
            raise ValueError(f"draft mask_id={mask_id!r} is invalid; allowed: an embedding row of the "
                             f"draft, 0..{draft.vocab_size - 1}, or None (not a parallel draft)")
        self.draft = draft
        self.mask_id = mask_id
        self.p_min = p_min
        self.tree_width = tree_width
        self._proposed_at, self._chain = 0, []  # the last proposal: len(tokens) then, its ids
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

    def models(self) -> tuple[CausalLM, ...]:
        return (self.draft,)

    @property
    def makes_trees(self) -> bool:
        return self.tree_width > 1

    @property
    def parallel(self) -> bool:
        """Whether one pass proposes all the tokens (a parallel draft: ``mask_id``)."""
        return self.mask_id is not None

    @property
    def active(self) -> bool:
        return self.enabled

    def check_invariant(self, state: RequestState) -> None:
        if self.enabled:
            assert self.draft.seq_len <= len(state.tokens) - 1, (self.draft.seq_len, len(state.tokens))

    def unseen(self, state: RequestState) -> int:
        return max(0, len(state.tokens) - 1 - self.draft.seq_len)

    def propose(self, state: RequestState, k: int) -> DraftOutput:
        """Draft tokens [1, m] (with their distributions [1, m, V] when sampling), m ≤ k; 0
        when the draft is off or unsure of its first token."""
        return run_alone(self.propose_steps_with_guess(state, k, []))

    def propose_with_guess(self, state: RequestState, k: int, guess: list[int]) -> DraftOutput:
        """See :meth:`propose_steps_with_guess` (its passes run one by one)."""
        return run_alone(self.propose_steps_with_guess(state, k, guess))

    def propose_steps(self, state: RequestState, k: int) -> Steps:
        return self.propose_steps_with_guess(state, k, [])

    def propose_steps_with_guess(self, state: RequestState, k: int, guess: list[int]) -> Steps:
        """Draft tokens [1, m] (with their distributions [1, m, V] when sampling); m ≤ k
        without a guess, ≤ max(k, len(guess) + 1) with one, 0 when the draft is off or unsure;
        as a generator of the draft's forward passes (:meth:`Proposer.propose_steps`).

        guess (greedy requests; ignored when sampling): tokens another proposer expects next
        (at most the round's K − 1). The draft reads them in one forward pass and keeps the
        prefix that is its own argmax at every position (p_min does not apply where both
        expect the same token), then, where it first differs, its own token if it is sure of
        it (top probability ≥ p_min), and so after the whole guess; from its own token it
        drafts on one token at a time up to k tokens in all. Where it is unsure of its own
        token, the proposal ends before it.
        """
        n = len(state.tokens)
        self._proposed_at, self._chain = n, []
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
        # see the class docstring; a parallel draft reads what it has not seen in its one pass
        first = self.draft.seq_len == 0 and len(new) > 1
        if first or (len(new) > 2 and not self.parallel):
            yield self.draft, torch.tensor([new[:-1]]), 0
            new = new[-1:]
        if self.parallel:
            return (yield from self._parallel(state, k, guess, new))
        context = torch.tensor([state.tokens + guess])
        ids, dists, alts = [], [], {}  # alts: depth -> the tree's other candidates there
        if guess:
            logits = yield self.draft, torch.tensor([new + guess]), len(guess) + 1
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
                return self._output(ids, dists, alts)  # the draft is unsure of its own next token
            context = torch.cat([context[:, :n + len(ids) - 1], ids[-1][:, None]], 1)
            new = [int(ids[-1])]  # the draft drafts on from its own token
        feed = torch.tensor([new])
        for i in range(len(ids), k):
            logits = (yield self.draft, feed, 1)[..., :v]
            tok = self._own_token(state, logits, context, i, ids, dists, alts)
            if tok is None:
                break
            feed = tok[:, None]
            context = torch.cat([context, feed], 1)
        return self._output(ids, dists, alts)

    def _own_token(self, state: RequestState, logits: torch.Tensor, context: torch.Tensor, i: int,
                   ids: list, dists: list, alts: dict) -> torch.Tensor | None:
        """The draft's own token [1] at draft position i (after ``context`` [1, n + i]) from
        its logits [1, 1, V] there, appended to ``ids`` (its distribution to ``dists`` when
        sampled, a tree's other candidates to ``alts``); None where it is unsure (p_min)."""
        params, n = state.params, len(state.tokens)
        if state.grammar is not None:  # only what the grammar allows after the drafts so far,
            # masked before the sampling filters as the target's rows are
            allowed = state.grammar.allowed([[int(t) for t in ids]])[:, :logits.shape[-1]]
            logits = logits.masked_fill(~allowed[:, None], float("-inf"))
        logits = process_logits(logits, params, context, None, state.num_generated + i,
                                state.eos_token_ids)[:, 0]
        if state.grammar is not None and not bool(torch.isfinite(logits).any()):
            return None  # (nothing the grammar allows is left to draft)
        # noise exists for sampled requests of the gumbel rule only (never greedy)
        probs = None if params.greedy or state.noise is not None else to_probs(logits, params)
        if self._unsure(logits, probs):
            return None
        if state.noise is not None:  # the target's noise at position n + i
            scored = logits + state.noise.rows(n + i, 1, logits.device)[..., :logits.shape[-1]]
            tok = scored.argmax(-1)  # gumbel_sample's token
        elif probs is None:
            scored = logits
            tok = logits.argmax(-1)
        else:
            tok = sample(probs, state.generator)
            dists.append(probs)
        if probs is None and self.tree_width > 1:
            top = scored[0].topk(min(self.tree_width, scored.shape[-1])).indices.tolist()
            alts[i] = [t for t in top if t != int(tok) and scored[0, t] > float("-inf")][:self.tree_width - 1]
        ids.append(tok)
        return tok

    def _parallel(self, state: RequestState, k: int, guess: list[int], new: list[int]) -> Steps:
        """A parallel draft's proposal (see the class docstring): one pass over ``new`` (the
        committed tokens the draft has not seen), the guess and k − 1 − len(guess) masks.
        Where the draft backs the whole guess, the masks after it draft on; where it first
        differs, its own token there ends the proposal (the masks read the guess)."""
        n, v = len(state.tokens), state.target_vocab_size
        masks = max(0, k - 1 - len(guess))
        logits = yield self.draft, torch.tensor([new + guess + [self.mask_id] * masks]), len(guess) + 1 + masks
        context = torch.tensor([state.tokens + guess])
        ids, dists, alts = [], [], {}
        for i in range(len(guess) + 1 + masks):
            row = logits[:, i:i + 1, :v]
            if i < len(guess):
                tok = process_logits(row, state.params, context[:, :n + i], None, state.num_generated + i,
                                     state.eos_token_ids)[:, 0].argmax(-1)
                if int(tok) == guess[i]:
                    ids.append(tok)  # both expect it: kept however sure the draft is
                    continue
                self._own_token(state, row, context[:, :n + i], i, ids, dists, alts)
                break
            tok = self._own_token(state, row, context, i, ids, dists, alts)
            if tok is None:
                break
            context = torch.cat([context, tok[:, None]], 1)
        kept = next((i for i, t in enumerate(guess) if i >= len(ids) or int(ids[i]) != t), len(guess))
        self.draft.rollback(n + kept)  # the committed tokens and the guess it backs; no mask
        return self._output(ids, dists, alts)

    def _unsure(self, logits: torch.Tensor, probs: torch.Tensor | None = None) -> bool:
        """Whether the draft's top probability ([1, V] logits, or the sampled request's
        probs) is below p_min."""
        if self.p_min is None:
            return False
        return float((torch.softmax(logits.float(), -1) if probs is None else probs).max()) < self.p_min

    def _output(self, ids: list, dists: list, alts: dict) -> DraftOutput:
        self._chain = [int(t) for t in ids]  # the cache holds the committed tokens + ids[:-1]
        if not ids:
            return DraftOutput.empty()
        if not alts:
            return DraftOutput(torch.stack(ids, 1), torch.stack(dists, 1) if dists else None, "draft")
        tokens, parents, parent = [], [], -1
        for i, tok in enumerate(ids):  # the chain's node first, then its siblings (leaves)
            here = [int(tok)] + alts.get(i, [])
            tokens, parents, parent = tokens + here, parents + [parent] * len(here), len(tokens)
        tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
        return DraftOutput(tree.token_ids[None], None, "draft", tree=tree)

    def on_accept(self, state: RequestState) -> None:
        if self.enabled:
            # the drafted tokens stay cached as far as they were committed: a tree's target
            # may have kept a sibling of the chain's token, which the draft never read
            n, chain = self._proposed_at, self._chain
            kept = next((i for i, t in enumerate(chain) if n + i >= len(state.tokens)
                         or state.tokens[n + i] != t), len(chain))
            self.draft.rollback(min(self.draft.seq_len, n + kept, len(state.tokens) - 1))

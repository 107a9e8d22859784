"""Proposers: anything that proposes draft tokens for the target to verify.

A proposer has three methods (DESIGN.md): ``reset`` at the start of a request, ``propose``
each round, ``on_accept`` after verification. "No draft this round" is an empty tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .backends import CausalLM
from .config import SamplingParams
from .sampling import process_logits, sample, to_probs


@dataclass(frozen=True)
class DraftOutput:
    """Draft tokens of one round.

    token_ids: [B,k] int64, k >= 0 (k == 0: no draft this round).
    probs: [B,k,V] the distributions the tokens were sampled from, or None when each token
        is a point mass (greedy drafts, lookups) — the verifier must know exactly which.
    """

    token_ids: torch.Tensor
    probs: torch.Tensor | None = None

    @classmethod
    def empty(cls, batch: int = 1) -> "DraftOutput":
        return cls(torch.empty(batch, 0, dtype=torch.long))


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
    """

    def __init__(self, draft: CausalLM):
        self.draft = draft
        self.enabled = False
        self._limit = 0

    def reset(self, state: RequestState, max_total_len: int) -> None:
        self._limit = min(self.draft.max_context, max_total_len)
        prompt = state.tokens
        self.enabled = len(prompt) - 1 <= self._limit and max(prompt) < self.draft.vocab_size
        if not self.enabled:
            return
        self.draft.allocate(1, self._limit)
        if len(prompt) > 1:
            self.draft.forward(torch.tensor([prompt[:-1]]), num_logits=0)

    def propose(self, state: RequestState, k: int) -> DraftOutput:
        n = len(state.tokens)
        k = min(k, self._limit - n + 1)
        if not self.enabled or k <= 0:
            return DraftOutput.empty()
        new = state.tokens[self.draft.seq_len:]
        if max(new) >= self.draft.vocab_size:
            self.enabled = False
            return DraftOutput.empty()
        params, v = state.params, state.target_vocab_size
        feed = torch.tensor([new])
        context = torch.tensor([state.tokens])
        ids, dists = [], []
        for i in range(k):
            logits = self.draft.forward(feed, num_logits=1)[..., :v]
            logits = process_logits(logits, params, context, None, state.num_generated + i,
                                    state.eos_token_ids)[:, 0]
            if params.greedy:
                tok = logits.argmax(-1)
            else:
                probs = to_probs(logits, params)
                tok = sample(probs, state.generator)
                dists.append(probs)
            ids.append(tok)
            feed = tok[:, None]
            context = torch.cat([context, feed], 1)
        return DraftOutput(torch.stack(ids, 1), torch.stack(dists, 1) if dists else None)

    def on_accept(self, state: RequestState) -> None:
        if self.enabled:
            self.draft.rollback(min(self.draft.seq_len, len(state.tokens) - 1))

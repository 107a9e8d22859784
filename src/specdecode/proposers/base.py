"""The proposer contract: everything the engine and the hybrid may ask of a proposer.

A proposer proposes draft tokens for the target to verify (docs/DESIGN.md): ``reset`` at the start
of a request, ``propose`` each round, ``on_accept`` after verification. "No draft this round"
is an empty tensor. Every other capability the engine or a policy over proposers (the hybrid)
uses is declared here with a default, so a new proposer overrides only what it has.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Generator

import torch

from ..config import SamplingParams
from ..sampling import GumbelNoise
from ..models.base import CausalLM
from ..tree import DraftTree
from ..verify import LossyTypical


@dataclass(frozen=True)
class DraftOutput:
    """Draft tokens of one round.

    token_ids: [B,k] int64, k >= 0 (k == 0: no draft this round).
    probs: [B,k,V] the distributions the tokens were sampled from, or None when each token
        is a point mass (greedy drafts, lookups) — the verifier must know exactly which.
    source: which proposer supplied the tokens (a hybrid's stats count accepted tokens per source).
    free: True when the tokens cost nothing to propose (lookups), so the K schedule may cut
        the proposal short after seeing it (``Schedule.trim``); False for a draft model's tokens.
    tree: a draft tree (:class:`~specdecode.tree.DraftTree`) of point-mass candidates,
        verified in one tree pass; then ``token_ids`` is its tokens [1, N] and ``probs`` None.
    """

    token_ids: torch.Tensor
    probs: torch.Tensor | None = None
    source: str = ""
    free: bool = False
    tree: DraftTree | None = None

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
    generator: the request's random stream (the rejection rule's draws, a sampled draft's).
    noise: the request's Gumbel noise under the gumbel acceptance rule, else None: a draft
        model proposes ``argmax(its processed logits + noise of that position)`` to agree
        with the target's sample there as often as it can.
    grammar: the request's :class:`~specdecode.grammar.GrammarState` (structured output),
        else None: a draft model masks its own logits with it, so that it proposes only
        tokens the target's masked rows can accept.
    """

    tokens: list[int]
    num_generated: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None
    target_vocab_size: int
    noise: GumbelNoise | None = None
    grammar: object | None = None


@dataclass(frozen=True)
class Forecast:
    """What a free proposer (a lookup) would propose now, before anyone decides to use it.

    tokens: up to k proposed token ids.
    confidence: [len(tokens)] floats, confidence[i] = the probability that tokens[0..i] are
        all accepted (non-increasing, in (0, 1]).
    """

    tokens: list[int]
    confidence: list[float]


class Proposer(ABC):
    """Base of every proposer.

    Required: ``name`` (stats and ``DraftOutput.source``), ``propose``. ``default_k``: the
    speculation length K used when none is given (a proposer that pays per drafted token
    wants a short one; lookups, whose proposals are free, a long one). ``free``: proposals
    cost nothing to make (lookups); a free proposer must implement :meth:`forecast`, which
    the hybrid reads. The rest has defaults for proposers that hold no model and learn
    nothing from their proposals.
    """

    name: ClassVar[str]
    default_k: ClassVar[int] = 16
    free: ClassVar[bool] = False
    # the target's hidden states this proposer reads (draft heads): keys of forward_rows'
    # output_hidden (FINAL, layer indices); the engine then runs the target through
    # forward_rows and calls take_hidden after the prefill and after every verify pass
    hidden_keys: tuple[int, ...] = ()
    # None: the engine verifies this proposer's drafts with the lossless rules. A
    # LossyTypical (medusa:lossy-typical=EPS): with Medusa's typical acceptance in sampled
    # requests, which changes their output (greedy requests keep greedy verification)
    lossy_typical: LossyTypical | None = None

    def reset(self, state: RequestState, max_total_len: int) -> None:
        """Start a request: ``state.tokens`` is the prompt; at most ``max_total_len`` tokens."""

    @abstractmethod
    def propose(self, state: RequestState, k: int) -> DraftOutput:
        """Propose up to k draft tokens to follow ``state.tokens``."""

    def on_accept(self, state: RequestState) -> None:
        """``state.tokens`` now holds the committed tokens after verification."""

    def take_hidden(self, start: int, hidden: dict[int, torch.Tensor]) -> None:
        """For proposers with ``hidden_keys``: the target's hidden states (one [n, dim]
        tensor per key) of the positions start .. start+n-1, whose tokens are committed and
        whose states no earlier call gave: after the prefill, every prompt position but the
        last; after a verify pass, the rows of the accepted path (the first is the position
        of the pass's first token). Their last row predicted the last committed token.
        Called after ``reset`` and, for a verify pass, before ``on_accept``; a later call's
        ``start`` may be below an earlier call's end only for positions whose state changed
        (it never does in the engines here)."""

    def models(self) -> tuple[CausalLM, ...]:
        """The models whose KV caches this proposer uses: the engine holds them for the whole
        request (one request at a time per model) and refuses the target among them."""
        return ()

    @property
    def makes_trees(self) -> bool:
        """Whether this proposer may return draft trees (``DraftOutput.tree``): the engine
        then checks that the target verifies trees exactly (:func:`~specdecode.tree.check_tree_target`)."""
        return False

    @property
    def parallel(self) -> bool:
        """Whether one pass of its model proposes all of a round's tokens (a parallel draft),
        so that a proposal's cost hardly grows with its length. Default: False."""
        return False

    @property
    def active(self) -> bool:
        """False once the proposer can propose nothing more in this request (a draft model
        whose context is full, or that met a token outside its vocabulary)."""
        return True

    def check_invariant(self, state: RequestState) -> None:
        """Raise AssertionError when the proposer's own position disagrees with the committed
        tokens (the engine calls it after every round in debug mode)."""

    # -- what a policy over proposers (the hybrid) uses

    def forecast(self, state: RequestState, k: int) -> Forecast:
        """A free proposer's proposal of up to k tokens with its confidences (see
        :class:`Forecast`); the next ``on_accept`` scores it against the committed tokens
        whether or not it was verified. Raises NotImplementedError for proposers that are
        not free."""
        raise NotImplementedError(f"{type(self).__name__} is not a free proposer: it has no forecast")

    def discard_last_proposal(self) -> None:
        """The last forecast was neither verified nor read by another proposer: a proposer
        that learns from its proposals must not learn from this one."""

    def share_passes(self, rows: int, feed: bool = True) -> None:
        """This round's passes are shared by ``rows`` requests (a batch's active rows, 1
        alone; the batched engine calls it before each proposal of a request whose output
        does not depend on its proposals). A proposer whose long passes (a draft's catch-up)
        hold up every row may charge them ``rows`` times; ``feed`` False: this round is the
        batch's trial of speculation, which may not go on, so a draft that must first be fed
        what it skipped does not draft. Default: ignored."""

    def observe(self, draft_s: float, verify_s: float) -> None:
        """The round just verified took ``draft_s`` seconds to propose and ``verify_s`` to
        verify (the target's pass and the acceptance rule); called after each verify pass,
        before :meth:`on_accept`, only for requests whose output cannot depend on the clock
        (not for a seeded request of the rejection rule, whose random draws depend on what
        is proposed). A proposer that chooses what to propose from modelled costs may
        calibrate them here. Default: ignored."""

    def unseen(self, state: RequestState) -> int:
        """Committed tokens the proposer must first process before it can propose (a draft
        model's catch-up after rounds it skipped; 0 for lookups)."""
        return 0

    reads_guess: ClassVar[bool] = False

    def propose_with_guess(self, state: RequestState, k: int, guess: list[int]) -> DraftOutput:
        """Propose up to k tokens after reading ``guess`` (tokens another proposer expects
        next, greedy requests only), keeping those this proposer would have proposed too.
        Proposers with ``reads_guess`` False ignore the guess."""
        return self.propose(state, k)

    # -- the proposal as the forward passes it needs (a batch runs many requests' as one)

    def propose_steps(self, state: RequestState, k: int) -> "Steps":
        """:meth:`propose` as a generator of the forward passes it needs: it yields
        ``(model, input_ids [1, T], num_logits)``, is sent that pass's logits [1, num_logits,
        V], and returns the DraftOutput (:func:`run_alone` runs it alone; the batched engine
        runs the passes of many requests' draft models as one). Default: no pass."""
        return self.propose(state, k)
        yield  # noqa: unreachable (a generator that needs no pass)

    def propose_steps_with_guess(self, state: RequestState, k: int, guess: list[int]) -> "Steps":
        """:meth:`propose_with_guess` as :meth:`propose_steps` does it."""
        return self.propose_with_guess(state, k, guess)
        yield  # noqa: unreachable


Steps = Generator[tuple, torch.Tensor, DraftOutput]


def run_alone(steps: Steps) -> DraftOutput:
    """Run a proposal's forward passes one by one on their models; returns its DraftOutput."""
    try:
        model, ids, n = next(steps)
        while True:
            model, ids, n = steps.send(model.forward(ids, num_logits=n))
    except StopIteration as done:
        return done.value

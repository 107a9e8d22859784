"""The speculative decoding loop (DESIGN.md), as a generator of token ids.

Each round: the proposer proposes k draft tokens; the target scores ``last + drafts`` in one
verify pass; :func:`~specdecode.sampling.rejection_sample` keeps an accepted prefix plus one
recovered or bonus token; stop conditions are checked on every token of that block; both
caches roll back to the committed length. Plain autoregressive decoding is the same loop
with no proposer (k = 0 every round), so both share every line of stop handling.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .backends import CausalLM
from .config import SamplingParams
from .proposers import Proposer, RequestState
from .sampling import process_logits, rejection_sample, to_probs
from .schedule import FixedK


@dataclass
class SpecDecodingStats:
    """Counters of one or more requests, after vLLM's SpecDecodingStats plus phase timers.

    num_drafts: verify passes that checked at least one draft token.
    num_draft_tokens / num_accepted_tokens: proposed / accepted draft tokens that reached the
        output (tokens after a stop inside a block are not counted as accepted).
    accepted_per_position[i]: drafts accepted at position i of their block.
    num_verify_passes: target forward passes after prefill (each emits >= 1 token).
    by_proposer: per proposer that supplied drafts (a hybrid has several):
        {name: {"num_drafts", "num_draft_tokens", "num_accepted_tokens"}}.
    speculation_lengths: K of every round of a speculative request (0: the schedule or the
        room left chose not to speculate; for a lookup whose proposal the schedule trimmed,
        the K it kept), to see a K schedule at work.
    Times in seconds: prefill_s (target + draft prefill), draft_s, verify_s (target forward +
    acceptance rule), total_s (wall time of the whole request).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    by_proposer: dict[str, dict[str, int]] = field(default_factory=dict)
    speculation_lengths: list[int] = field(default_factory=list)
    num_verify_passes: int = 0
    num_generated_tokens: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 when nothing was proposed; None in to_dict)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify pass: 1 + accepted / verify passes (1.0 = plain decoding)."""
        return 1.0 + self.num_accepted_tokens / self.num_verify_passes if self.num_verify_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens / total wall time, prefill included."""
        return self.num_generated_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def other_s(self) -> float:
        return max(0.0, self.total_s - self.prefill_s - self.draft_s - self.verify_s)

    def record_round(self, proposed: int, accepted: int, source: str = "") -> None:
        self.num_verify_passes += 1
        if proposed:
            self.num_drafts += 1
            self.num_draft_tokens += proposed
            self.num_accepted_tokens += accepted
            mine = self.by_proposer.setdefault(source or "draft", {
                "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0})
            mine["num_drafts"] += 1
            mine["num_draft_tokens"] += proposed
            mine["num_accepted_tokens"] += accepted
            if len(self.accepted_per_position) < proposed:
                self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
            for i in range(accepted):
                self.accepted_per_position[i] += 1

    def merge(self, other: "SpecDecodingStats") -> "SpecDecodingStats":
        """Pool two requests' counters (rates become Σaccepted / Σproposed)."""
        out = SpecDecodingStats()
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_verify_passes",
                     "num_generated_tokens", "prefill_s", "draft_s", "verify_s", "total_s"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        pad = lambda xs: xs + [0] * (n - len(xs))  # noqa: E731
        out.accepted_per_position = [a + b for a, b in zip(pad(self.accepted_per_position),
                                                           pad(other.accepted_per_position))]
        for src in (self.by_proposer, other.by_proposer):
            for name, counts in src.items():
                mine = out.by_proposer.setdefault(name, dict.fromkeys(counts, 0))
                for key, v in counts.items():
                    mine[key] += v
        out.speculation_lengths = self.speculation_lengths + other.speculation_lengths
        return out

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "by_proposer": {name: dict(c) for name, c in self.by_proposer.items()},
            "mean_speculation_length": (round(sum(self.speculation_lengths)
                                              / len(self.speculation_lengths), 3)
                                        if self.speculation_lengths else None),
            "num_verify_passes": self.num_verify_passes,
            "num_generated_tokens": self.num_generated_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4) if self.num_draft_tokens else None,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "prefill_s": round(self.prefill_s, 4),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "other_s": round(self.other_s, 4),
            "total_s": round(self.total_s, 4),
        }


_LOCKS: "weakref.WeakKeyDictionary[object, threading.Lock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _busy_lock(model) -> threading.Lock:
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.Lock()
        return lock


class StopStrings:
    """Finds the first generated token at which any stop string appears in the text.

    decode: token ids -> text. Checks each token of a block, so a stop string that starts
    early in a long accepted block, or spans tokens or blocks, is found at its own token.
    """

    def __init__(self, stop: tuple[str, ...], decode: Callable[[list[int]], str]):
        self.stop = stop
        self.decode = decode
        self.longest = max(len(s) for s in stop)
        self._checked = 0  # text length already searched

    def hit(self, generated: list[int]) -> bool:
        text = self.decode(generated)
        start = max(0, min(self._checked, len(text)) - self.longest - 4)
        self._checked = len(text)
        return any(s in text[start:] for s in self.stop)


class Generation:
    """One request in flight: iterate to get each round's new token ids (a list[int]).

    After iteration: ``token_ids`` (generated ids, EOS included when it ended the request),
    ``finish_reason`` ("stop": EOS or stop string, "length": max_new_tokens or context
    limit) and ``stats`` (:class:`SpecDecodingStats`).
    """

    def __init__(self, stats: SpecDecodingStats):
        self._steps: Iterator[list[int]] = iter(())
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stats = stats

    def __iter__(self) -> Iterator[list[int]]:
        for new in self._steps:
            self.token_ids += new
            yield new

    def close(self) -> None:
        """Cancel the request: stops it and frees the models for the next one (idempotent).
        A paused, unclosed generation keeps its models busy (their KV caches are its)."""
        self._steps.close()

    def run(self) -> "Generation":
        """Consume the whole generation; returns self."""
        for _ in self:
            pass
        return self


class Engine:
    """Runs requests on a target with an optional proposer.

    target: a :class:`~specdecode.backends.CausalLM`; proposer: None for plain decoding.
    num_speculative_tokens: K, the most draft tokens per verify pass, or a K schedule
    (:mod:`specdecode.schedule`: reset / next_k / update) that picks K each round.
    debug: assert the cache invariant after every round (target cache length == committed
    tokens − 1; the proposer's cache a prefix of it).
    """

    def __init__(self, target: CausalLM, proposer: Proposer | None = None,
                 num_speculative_tokens=4, debug: bool = False):
        self.target = target
        self.proposer = proposer
        k = num_speculative_tokens
        if proposer is None:
            k = None  # plain decoding: nothing to schedule
        elif isinstance(k, int) and not isinstance(k, bool):
            k = FixedK(k)
        elif not all(callable(getattr(k, m, None)) for m in ("reset", "next_k", "update")):
            raise ValueError(f"num_speculative_tokens={k!r} is invalid; allowed: an integer 1..64 "
                             "or a K schedule (specdecode.schedule: FixedK, HeuristicK, AutoK)")
        if proposer is not None and getattr(proposer, "draft", None) is target:
            raise ValueError("the proposer's draft model is the target itself, whose KV cache the "
                             "target needs: give the draft its own cache, e.g. "
                             "DraftModelProposer(target.fork()) (a fork shares the weights)")
        self.schedule = k
        self.debug = debug

    def generate(self, input_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (),
                 decode: Callable[[list[int]], str] | None = None) -> Generation:
        """Start a request; iterate the returned :class:`Generation` to run it.

        input_ids: the prompt, a non-empty list of ids < the target's vocab size.
        eos_token_ids: used when ``params.eos_token_ids`` is None.
        decode: ids -> text, required when ``params.stop`` is set.
        Raises ValueError for an empty or out-of-vocabulary prompt, a prompt that fills the
        target's context, or stop strings without ``decode``.
        """
        if torch.is_tensor(input_ids) and input_ids.dim() > 1:
            raise ValueError(f"input_ids must be one prompt (1-D), got shape {tuple(input_ids.shape)}")
        prompt = [int(t) for t in (input_ids.tolist() if torch.is_tensor(input_ids) else input_ids)]
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        v = self.target.vocab_size
        if min(prompt) < 0 or max(prompt) >= v:
            raise ValueError(f"prompt token ids must be in [0, {v}), got min {min(prompt)} max {max(prompt)}")
        if len(prompt) >= self.target.max_context:
            raise ValueError(f"the prompt has {len(prompt)} tokens but the target's context is "
                             f"{self.target.max_context}; shorten it to leave room for new tokens")
        bad_eos = [e for e in (params.eos_token_ids or ()) if e >= v]
        if bad_eos:
            raise ValueError(f"eos_token_ids {bad_eos} are outside the target's vocabulary [0, {v})")
        if params.stop and decode is None:
            raise ValueError("stop strings need a tokenizer (decode) to be checked")
        eos = params.eos_token_ids if params.eos_token_ids is not None else tuple(eos_token_ids)
        stats = SpecDecodingStats()
        gen = Generation(stats)
        gen._steps = self._loop(prompt, params, frozenset(eos), decode, stats, gen)
        return gen

    def _loop(self, *args):
        """Hold each model's KV cache, and the proposer's per-request state, for the whole
        request: one request at a time per loaded model and per proposer (a second one would
        silently corrupt the first one's cache or lookup index)."""
        held = []
        try:
            model = ("model", "KV cache", "load a second copy of the model")
            for obj, (what, state, remedy) in (
                    (self.target, model), (getattr(self.proposer, "draft", None), model),
                    (self.proposer, ("proposer", "per-request state", "give each engine its own proposer"))):
                if obj is None:
                    continue
                lock = _busy_lock(obj)
                if not lock.acquire(blocking=False):
                    raise RuntimeError(
                        f"this {what} is already generating another request (its {state} is in "
                        f"use): finish or close() the other generation/stream first, or {remedy} "
                        "for concurrent requests")
                held.append(lock)
            yield from self._rounds(*args)
        finally:
            for lock in held:
                lock.release()

    def _rounds(self, prompt, params: SamplingParams, eos: frozenset, decode, stats, gen):
        t0 = time.perf_counter()
        generator = torch.Generator()
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        limit = min(self.target.max_context, len(prompt) + params.max_new_tokens)
        state = RequestState(list(prompt), 0, params, tuple(sorted(eos)), generator,
                             self.target.vocab_size)
        stopper = StopStrings(params.stop, decode) if params.stop else None
        target, proposer = self.target, self.proposer

        target.allocate(1, limit)
        if len(prompt) > 1:
            target.forward(torch.tensor([prompt[:-1]]), num_logits=0)
        schedule = self.schedule
        # a seeded sampled request must not let the clock choose K (its draws depend on K)
        clocked = params.greedy or params.seed is None
        if proposer is not None:
            proposer.reset(state, limit)
            schedule.reset()
        stats.prefill_s = time.perf_counter() - t0
        try:
            while True:
                n = len(state.tokens)
                k = min(schedule.next_k(), limit - n - 1) if proposer is not None else 0
                t1 = time.perf_counter()
                draft = proposer.propose(state, k) if k > 0 else None
                drafts = draft.token_ids if draft is not None else torch.empty(1, 0, dtype=torch.long)
                if draft is not None and draft.free and drafts.shape[1] and hasattr(schedule, "trim"):
                    k = schedule.trim(drafts.shape[1])  # a lookup's K is chosen once it is seen
                    drafts = drafts[:, :k]
                if proposer is not None:
                    stats.speculation_lengths.append(k)
                t2 = time.perf_counter()
                k = drafts.shape[1]
                if k and bool(((drafts < 0) | (drafts >= target.vocab_size)).any()):
                    raise ValueError(f"the proposer returned token ids outside the target's vocabulary "
                                     f"[0, {target.vocab_size}): {drafts[0].tolist()}")
                logits = target.forward(torch.cat([torch.tensor([[state.tokens[-1]]]), drafts], 1))
                context = torch.tensor([state.tokens]) if params.repetition_penalty != 1.0 else None
                probs = to_probs(process_logits(logits, params, context, drafts, state.num_generated,
                                                state.eos_token_ids), params)
                out, num_accepted = rejection_sample(
                    drafts, draft.probs if draft is not None else None, probs, generator)
                accepted = int(num_accepted[0])
                block = out[0, :accepted + 1].tolist()
                t3 = time.perf_counter()
                stats.draft_s += t2 - t1
                stats.verify_s += t3 - t2
                if proposer is not None:
                    if clocked:
                        schedule.update(k, accepted, t2 - t1, t3 - t2)
                    else:
                        schedule.update(k, accepted, None, None)

                emitted = []
                for tok in block:
                    emitted.append(tok)
                    state.tokens.append(tok)
                    state.num_generated += 1
                    if tok in eos or (stopper is not None
                                      and stopper.hit(state.tokens[len(prompt):])):
                        gen.finish_reason = "stop"
                        break
                stats.record_round(k, min(accepted, len(emitted)), draft.source if k else "")
                stats.num_generated_tokens += len(emitted)
                if gen.finish_reason is None and len(state.tokens) >= limit:
                    gen.finish_reason = "length"
                target.rollback(len(state.tokens) - 1)
                if proposer is not None:
                    proposer.on_accept(state)
                if self.debug:
                    self._check_invariant(state)
                stats.total_s = time.perf_counter() - t0
                yield emitted
                if gen.finish_reason is not None:
                    return
        finally:
            stats.total_s = time.perf_counter() - t0

    def _check_invariant(self, state: RequestState) -> None:
        n = len(state.tokens)
        assert self.target.seq_len == n - 1, (self.target.seq_len, n)
        draft = getattr(self.proposer, "draft", None)
        if draft is not None and getattr(self.proposer, "enabled", False):
            assert draft.seq_len <= n - 1, (draft.seq_len, n)

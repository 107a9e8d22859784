"""The speculative decoding loop (docs/DESIGN.md), as a generator of token ids.

Each round: the proposer proposes k draft tokens; the target scores ``last + drafts`` in one
verify pass; the request's acceptance rule (:func:`~specdecode.verify.rejection_sample`,
:func:`~specdecode.verify.greedy_verify` for greedy requests, its T -> 0 case, or
:func:`~specdecode.verify.gumbel_verify` for ``SamplingParams.rule == "gumbel"``) keeps an
accepted prefix plus one recovered or bonus token; stop conditions are checked on every
token of that block; both caches roll back to the committed length. Plain autoregressive decoding is the same loop
with no proposer (k = 0 every round), so both share every line of stop handling. A proposer
with ``lossy_typical`` set (``medusa:lossy-typical=EPS``) has its drafts in sampled requests
verified by Medusa's typical acceptance instead (:func:`~specdecode.verify.typical_verify`),
which changes the output; its stats say ``lossy``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch

from .config import SamplingParams, check_k
from .heads import check_heads_target
from .models.base import CausalLM, busy_lock
from .proposers import Proposer, RequestState
from .proposers.base import DraftOutput, run_alone
from .sampling import GumbelNoise, process_logits, to_probs
from .schedule import FixedK, Schedule
from .stats import SpecDecodingStats
from .text import StopStrings
from .tree import MAX_NODES, check_tree_target
from .verify import (greedy_verify, greedy_verify_tree, gumbel_verify, rejection_sample, typical_verify,
                     typical_verify_tree, verify_tree)


TOKEN_KINDS = ("accepted", "recovered", "bonus", "target")
GRAMMAR_SOURCE = "grammar"  # the proposer named for tokens the grammar forces
# the most forced tokens verified in one pass (the lookups' K): a long forced run (a schema's
# long constant) goes over several, each within the passes whose rows are exact
MAX_FORCED = 16


@dataclass
class TokenInfo:
    """Who supplied one generated token, and its log-probability when asked for.

    kind: "accepted" (a draft or lookup token the target accepted; ``proposer`` names which,
    ``DraftOutput.source``), "recovered" (the target's token where it rejected a draft
    token), "bonus" (the target's extra token after a fully accepted draft) or "target" (a
    round with no draft tokens: plain decoding). logprob: the token's log-probability under
    the target's raw logits (natural log), top_logprobs: the most likely (token id, log
    probability) pairs, most likely first; both None unless ``SamplingParams.logprobs``.
    """

    kind: str
    proposer: str = ""
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class Generation:
    """One request in flight: iterate to get each round's new token ids (a list[int]).

    After iteration: ``token_ids`` (generated ids, EOS included when it ended the request),
    ``token_info`` (one :class:`TokenInfo` per generated id), ``finish_reason`` ("stop": EOS
    or stop string, "length": max_new_tokens or context limit) and ``stats``
    (:class:`SpecDecodingStats`). ``token_info`` may run ahead of ``token_ids`` in a batch
    (rows committed but not yet handed out): index it by position.
    """

    def __init__(self, stats: SpecDecodingStats):
        self._steps: Iterator[list[int]] = iter(())
        self.token_ids: list[int] = []
        self.token_info: list[TokenInfo] = []
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

    target: a :class:`~specdecode.models.base.CausalLM`; proposer: a
    :class:`~specdecode.proposers.Proposer`, or None for plain decoding.
    num_speculative_tokens: K, the most draft tokens per verify pass (default: the
    proposer's ``default_k``), or a :class:`~specdecode.schedule.Schedule` that picks K each
    round. debug: assert the cache invariant after every round (target cache length ==
    committed tokens − 1; the proposer's own position a prefix of it).
    Raises ValueError for a K outside 1..64 or a proposer that drafts with the target itself.
    """

    def __init__(self, target: CausalLM, proposer: Proposer | None = None,
                 num_speculative_tokens: int | Schedule | None = None, debug: bool = False):
        self.target = target
        self.proposer = proposer
        k = num_speculative_tokens
        if proposer is None:
            k = None  # plain decoding: nothing to schedule
        elif k is None:
            k = FixedK(proposer.default_k)
        elif not isinstance(k, Schedule):
            k = FixedK(check_k("num_speculative_tokens (K)", k))
        if proposer is not None and proposer.makes_trees:
            check_tree_target(target)
        if proposer is not None and proposer.hidden_keys:
            check_heads_target(target)
        if proposer is not None and any(m is target for m in proposer.models()):
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
        prompt, eos = check_request(self.target, input_ids, params, eos_token_ids, decode)
        stats = SpecDecodingStats()
        gen = Generation(stats)
        gen._steps = self._loop(prompt, params, eos, decode, stats, gen)
        return gen

    def _loop(self, *args):
        """Hold each model's KV cache, and the proposer's per-request state, for the whole
        request: one request at a time per loaded model and per proposer (a second one would
        silently corrupt the first one's cache or lookup index)."""
        held = hold([self.target], self.proposer)
        try:
            yield from self._rounds(*args)
        finally:
            for lock in held:
                lock.release()

    def _rounds(self, prompt, params: SamplingParams, eos: frozenset, decode, stats, gen):
        t0 = time.perf_counter()
        target = self.target
        run = RequestRun(target, self.proposer, self.schedule, prompt, params, eos, decode,
                         stats, gen, (lambda: target.seq_len) if self.debug else None)
        target.allocate(1, run.limit)
        hidden = tuple(self.proposer.hidden_keys) if self.proposer is not None else ()
        prefill = None
        if len(prompt) > 1 and hidden:
            prefill = target.forward_rows(torch.tensor([prompt[:-1]]), num_logits=0, output_hidden=hidden)
        elif len(prompt) > 1:
            target.forward(torch.tensor([prompt[:-1]]), num_logits=0)
        run.begin(t0)
        if prefill is not None:
            self.proposer.take_hidden(0, {key: h[0] for key, h in prefill.hidden.items()})
            del prefill
        try:
            while True:
                drafts = run.propose(run.wanted_k())
                last, tree = run.state.tokens[-1], run.tree
                if tree is None and not hidden:
                    emitted = run.finish(target.forward(torch.cat([torch.tensor([[last]]), drafts], 1)))
                elif tree is None:
                    out = target.forward_rows(torch.cat([torch.tensor([[last]]), drafts], 1),
                                              output_hidden=hidden)
                    emitted = run.finish(out.logits, out.hidden)
                else:  # one tree pass; the accepted path's cache entries kept
                    start = len(run.state.tokens) - 1
                    out = target.forward_rows(tree.input_ids(last)[None], attn_mask=tree.attn_mask(),
                                              position_ids=tree.position_ids(start), output_hidden=hidden)
                    emitted = run.finish(out.logits, out.hidden)
                    target.compact(0, start, [0] + [i + 1 for i in run.accepted_path])
                target.rollback(len(run.state.tokens) - 1)
                run.after_rollback()
                stats.total_s = time.perf_counter() - t0
                yield emitted
                if gen.finish_reason is not None:
                    return
        finally:
            stats.total_s = time.perf_counter() - t0


def check_request(target: CausalLM, input_ids, params: SamplingParams,
                  eos_token_ids: tuple[int, ...], decode) -> tuple[list[int], frozenset]:
    """The prompt as a list of ints and the request's EOS ids, or ValueError (see
    :meth:`Engine.generate`)."""
    if torch.is_tensor(input_ids) and input_ids.dim() > 1:
        raise ValueError(f"input_ids must be one prompt (1-D), got shape {tuple(input_ids.shape)}")
    prompt = [int(t) for t in (input_ids.tolist() if torch.is_tensor(input_ids) else input_ids)]
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    v = target.vocab_size
    if min(prompt) < 0 or max(prompt) >= v:
        raise ValueError(f"prompt token ids must be in [0, {v}), got min {min(prompt)} max {max(prompt)}")
    if len(prompt) >= target.max_context:
        raise ValueError(f"the prompt has {len(prompt)} tokens but the target's context is "
                         f"{target.max_context}; shorten it to leave room for new tokens")
    bad_eos = [e for e in (params.eos_token_ids or ()) if e >= v]
    if bad_eos:
        raise ValueError(f"eos_token_ids {bad_eos} are outside the target's vocabulary [0, {v})")
    if params.stop and decode is None:
        raise ValueError("stop strings need a tokenizer (decode) to be checked")
    eos = params.eos_token_ids if params.eos_token_ids is not None else tuple(eos_token_ids)
    return prompt, frozenset(eos)


def hold(models: list, proposer: Proposer | None) -> list:
    """Acquire (non-blocking) the busy locks of these models and of the proposer and its
    models; returns the locks, or raises RuntimeError naming what is already generating."""
    model = ("model", "KV cache", "load a second copy of the model")
    prop = ("proposer", "per-request state", "give each engine its own proposer")
    objects = [(m, model) for m in models]
    if proposer is not None:
        objects += [(m, model) for m in proposer.models()] + [(proposer, prop)]
    held = []
    try:
        for obj, (what, state, remedy) in objects:
            lock = busy_lock(obj)
            if not lock.acquire(blocking=False):
                raise RuntimeError(
                    f"this {what} is already generating another request (its {state} is in "
                    f"use): finish or close() the other generation/stream first, or {remedy} "
                    "for concurrent requests")
            held.append(lock)
    except BaseException:
        for lock in held:
            lock.release()
        raise
    return held


class RequestRun:
    """One request's rounds apart from the target's forward passes, which the engine runs
    (alone, :class:`Engine`, or with other requests' rows, :class:`~specdecode.batch.BatchEngine`):
    :meth:`propose` the drafts, the engine scores ``last token + drafts`` ([1, k+1] logits),
    :meth:`finish` applies the acceptance rule and the stop rules to the block, the engine
    rolls the target's cache back to ``len(state.tokens) - 1``, :meth:`after_rollback`.

    cache_len: () -> the target's cached positions for this request, checked against the
    committed tokens after every round (debug), or None to skip the check.
    """

    def __init__(self, target: CausalLM, proposer: Proposer | None, schedule: Schedule | None,
                 prompt: list[int], params: SamplingParams, eos: frozenset, decode, stats,
                 gen: Generation, cache_len=None):
        self.target, self.proposer, self.schedule = target, proposer, schedule
        self.params, self.eos, self.stats, self.gen = params, eos, stats, gen
        self.cache_len = cache_len
        generator = torch.Generator()
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        self.noise = None
        if params.rule == "gumbel":  # an unseeded request draws its noise's seed
            seed = params.seed if params.seed is not None else int(
                torch.randint(0, 2**63 - 1, (1,), generator=generator))
            self.noise = GumbelNoise(seed, target.vocab_size)
        self.generator = generator
        # Medusa's typical acceptance (lossy) where the proposer asks for it, in sampled
        # requests only: at temperature 0 it is greedy verification, which stays
        self.typical = proposer.lossy_typical if proposer is not None and not params.greedy else None
        stats.lossy = stats.lossy or self.typical is not None
        self.limit = min(target.max_context, len(prompt) + params.max_new_tokens)
        # the request's place in its response format's grammar (structured output)
        self.grammar = params.grammar.start(tuple(sorted(eos))) if params.grammar is not None else None
        self.state = RequestState(list(prompt), 0, params, tuple(sorted(eos)), generator,
                                  target.vocab_size, self.noise, self.grammar)
        self.stopper = StopStrings(params.stop, decode) if params.stop else None
        self._forced = False  # this round's drafts are the tokens the grammar forces
        # a seeded request of the rejection rule must not let the clock choose K (its draws
        # depend on K); greedy and gumbel outputs do not
        self.clocked = params.rule != "rejection" or params.seed is None
        self._draft = None
        self.tree = None  # this round's draft tree, if the proposer made one
        self.accepted_path: list[int] = []  # its accepted nodes, after finish

    def begin(self, t0: float) -> None:
        """After the target's prefill of all but the prompt's last token (started at t0)."""
        if self.proposer is not None:
            self.proposer.reset(self.state, self.limit)
            self.schedule.reset()
        self.stats.prefill_s = time.perf_counter() - t0

    def wanted_k(self) -> int:
        """The K this request's schedule asks for this round (0 without a proposer), within
        the room left; call once a round, before :meth:`propose`."""
        if self.proposer is None:
            return 0
        return max(0, min(self.schedule.next_k(), self.limit - len(self.state.tokens) - 1))

    def propose(self, k: int) -> torch.Tensor:
        """This round's draft tokens [1, k'] (k' <= k; k' may be 0): at most ``k`` (from
        :meth:`wanted_k`, or fewer where a batch's policy says so)."""
        return run_alone(self.propose_steps(k))

    def propose_steps(self, k: int):
        """:meth:`propose` as a generator of the proposer's forward passes
        (:meth:`~specdecode.proposers.Proposer.propose_steps`); returns the draft tokens."""
        state, schedule, proposer = self.state, self.schedule, self.proposer
        t1, wanted = time.perf_counter(), k
        # what the grammar forces is proposed for free, with any method (plain decoding, no
        # proposer, stays plain constrained decoding)
        forced = self.grammar.forced(min(MAX_FORCED, self.limit - len(state.tokens) - 1)) \
            if self.grammar is not None and proposer is not None else []
        self._forced = bool(forced)
        if forced:
            draft, wanted = DraftOutput.point_mass(forced, GRAMMAR_SOURCE), len(forced)
        else:
            draft = (yield from proposer.propose_steps(state, k)) if k > 0 else None
        drafts = draft.token_ids if draft is not None else torch.empty(1, 0, dtype=torch.long)
        if draft is not None and draft.free and drafts.shape[1] and not forced:
            k = schedule.trim(drafts.shape[1])  # a lookup's K is chosen once it is seen
            drafts = drafts[:, :k]
        if self.grammar is not None and draft is not None and draft.probs is None and draft.tree is None:
            # a point-mass token the grammar refuses is never accepted: propose up to it
            drafts = drafts[:, :self.grammar.valid_prefix(drafts[0].tolist())]
        self._t1, self._t2 = t1, time.perf_counter()
        k = drafts.shape[1]
        if proposer is not None:
            self.stats.speculation_lengths.append(k)  # what was verified, not what was asked for
        v = self.target.vocab_size
        if k and bool(((drafts < 0) | (drafts >= v)).any()):
            raise ValueError(f"the proposer returned token ids outside the target's vocabulary "
                             f"[0, {v}): {drafts[0].tolist()}")
        self.tree = draft.tree if draft is not None and k else None
        if self.tree is not None:
            if self.tree.num_nodes != k or draft.probs is not None:
                raise ValueError("a proposer's draft tree must come with its tokens as token_ids "
                                 "[1, N] and no probs (point-mass candidates)")
            # no deeper than the K asked for, no more nodes than the cache has room for (it is
            # sized for chains) or than an exact pass holds
            self.tree = self.tree.trim(wanted, min(MAX_NODES, self.limit - len(self.state.tokens)))
            drafts = self.tree.token_ids[None]
            k = drafts.shape[1]
            self.stats.speculation_lengths[-1] = k
        elif k > wanted:  # a proposer that gave more than it was asked for
            drafts = drafts[:, :wanted]
            k = wanted
            self.stats.speculation_lengths[-1] = k
            if draft.probs is not None:
                draft = replace(draft, token_ids=drafts, probs=draft.probs[:, :k])
        self._draft, self._drafts = draft, drafts
        return drafts

    def finish(self, logits: torch.Tensor, hidden: dict[int, torch.Tensor] | None = None) -> list[int]:
        """The block this round commits, from the verify pass's logits [1, k+1, V] (a tree
        pass: [1, N+1, V]); sets ``gen.finish_reason`` when the request ends. hidden: the
        pass's hidden states ([1, k+1, dim] each, by ``output_hidden`` key), for a proposer
        that reads them: it gets the accepted path's rows."""
        state, params, stats, gen = self.state, self.params, self.stats, self.gen
        draft, drafts, noise = self._draft, self._drafts, self.noise
        n, k = len(state.tokens), drafts.shape[1]
        raw = logits
        if self.grammar is not None:
            logits = self._constrain(logits)
        if self.tree is not None:
            block, rows = self._finish_tree(logits)
            accepted = len(block) - 1
        else:
            context = torch.tensor([state.tokens]) if params.repetition_penalty != 1.0 else None
            processed = process_logits(logits, params, context, drafts, state.num_generated,
                                       state.eos_token_ids)
            if self.typical is not None and k:  # (a round without drafts samples as the rule says)
                out, num_accepted = typical_verify(drafts, to_probs(processed, params), self.typical)
            elif noise is not None:  # the tokens of positions n .. n+k are fixed by the noise
                out, num_accepted = gumbel_verify(drafts, processed, noise.rows(n, k + 1, processed.device)[None])
            elif params.greedy:
                out, num_accepted = greedy_verify(drafts, processed)
            else:
                out, num_accepted = rejection_sample(drafts, draft.probs if draft is not None else None,
                                                     to_probs(processed, params), self.generator)
            accepted = int(num_accepted[0])
            block, rows = out[0, :accepted + 1].tolist(), list(range(accepted + 1))
        t1, t2, t3 = self._t1, self._t2, time.perf_counter()
        stats.draft_s += t2 - t1
        stats.verify_s += t3 - t2
        if self.proposer is not None and not self._forced:  # a tree's K is its depth: the longest path it offered
            depth = k if self.tree is None else self.tree.depth
            if self.clocked:
                self.schedule.update(depth, accepted, t2 - t1, t3 - t2)
                self.proposer.observe(t2 - t1, t3 - t2)
            else:
                self.schedule.update(depth, accepted, None, None)
        if hidden:
            self.proposer.take_hidden(n - 1, {key: h[0, rows] for key, h in hidden.items()})
        emitted = []
        for tok in block:
            emitted.append(tok)
            state.tokens.append(tok)
            state.num_generated += 1
            if tok in self.eos or (self.stopper is not None and self.stopper.hit(tok)):
                gen.finish_reason = "stop"
                break
        if self.grammar is not None:
            self.grammar.commit(emitted)
        source = (draft.source or self.proposer.name) if k else ""
        if k == 0:
            last = "target"
        elif self.tree is not None:  # a bonus after a leaf, else a recovered token
            last = "recovered" if self.tree.children(rows[-1]) else "bonus"
        else:
            last = "recovered" if accepted < k else "bonus"
        self.gen.token_info += self._info(raw[:, rows], emitted, accepted, source, last)
        stats.record_round(k, min(accepted, len(emitted)), source,
                           None if self.tree is None else self.tree.depth)
        stats.num_generated_tokens += len(emitted)
        if gen.finish_reason is None and len(state.tokens) >= self.limit:
            gen.finish_reason = "length"
        return emitted

    def _constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """The verify pass's logits [1, R, V] with each row's tokens the grammar refuses at
        its position set to -inf (a chain's row i: after the committed tokens and drafts[:i];
        a tree's row: after its node's path)."""
        if self.tree is not None:
            tokens = self.tree.token_ids.tolist()
            paths = [[tokens[i] for i in self.tree.path(r - 1)] for r in range(logits.shape[1])]
        else:
            drafts = self._drafts[0].tolist()
            paths = [drafts[:i] for i in range(logits.shape[1])]
        allowed = self.grammar.allowed(paths).to(logits.device)
        if allowed.shape[-1] < logits.shape[-1]:  # logit rows past the model's vocabulary
            allowed = torch.nn.functional.pad(allowed, (0, logits.shape[-1] - allowed.shape[-1]))
        return logits.masked_fill(~allowed[None, :, :logits.shape[-1]], float("-inf"))

    def _finish_tree(self, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """The block a tree pass commits (accepted path + recovered or bonus token) and the
        pass rows that predicted each of its tokens; sets ``accepted_path``. logits: the
        pass's [1, N+1, V]. Each row is processed with its own context (the committed tokens
        and the row's ancestors) at its own depth, as a linear verify pass processes its
        rows."""
        state, params, tree, noise = self.state, self.params, self.tree, self.noise
        n, tokens = len(state.tokens), tree.token_ids.tolist()
        depth = [0] + tree.depths().tolist()
        if params.repetition_penalty == 1.0 and state.num_generated >= params.min_new_tokens:
            # no processor sees the context or the position: every row processed alike
            processed = process_logits(logits, params, None, None, state.num_generated,
                                       state.eos_token_ids)[0]
        else:
            rows = []
            for r in range(tree.num_nodes + 1):
                context = None if params.repetition_penalty == 1.0 else \
                    torch.tensor([state.tokens + [tokens[i] for i in tree.path(r - 1)]])
                rows.append(process_logits(logits[:, r:r + 1], params, context, None,
                                           state.num_generated + depth[r], state.eos_token_ids)[0, 0])
            processed = torch.stack(rows)
        if self.typical is not None:
            path, last = typical_verify_tree(tree, to_probs(processed[None], params)[0], self.typical)
        elif noise is not None:  # row r's token is at position n + its depth
            noise_rows = noise.rows(n, max(depth) + 1, processed.device)[torch.tensor(depth)]
            path, last = greedy_verify_tree(tree, processed + noise_rows[:, :processed.shape[-1]])
        elif params.greedy:
            path, last = greedy_verify_tree(tree, processed)
        else:
            path, last = verify_tree(tree, to_probs(processed[None], params)[0], self.generator)
        self.accepted_path = path
        return [tokens[i] for i in path] + [last], [0] + [i + 1 for i in path]

    def _info(self, logits: torch.Tensor, emitted: list[int], accepted: int, source: str,
              last: str) -> list[TokenInfo]:
        """The block's :class:`TokenInfo`; logits: the verify pass's rows that predicted the
        block's tokens [1, accepted + 1, V]; last: the kind of the token after the accepted."""
        out = [TokenInfo("accepted", source) if i < accepted else TokenInfo(last)
               for i in range(len(emitted))]
        n = self.params.logprobs
        if n is not None and emitted:
            lp = torch.log_softmax(logits[0, :len(emitted)].float(), dim=-1)
            own = lp.gather(1, torch.tensor(emitted, device=lp.device)[:, None])[:, 0].tolist()
            top = lp.topk(n, dim=-1) if n else None
            for i, info in enumerate(out):
                info.logprob = own[i]
                info.top_logprobs = list(zip(top.indices[i].tolist(), top.values[i].tolist())) if n else []
        return out

    def after_rollback(self) -> None:
        """Once the target's cache holds the committed tokens but the last."""
        if self.noise is not None:
            self.noise.forget_before(len(self.state.tokens))
        if self.proposer is not None:
            self.proposer.on_accept(self.state)
        if self.cache_len is not None:
            n, held = len(self.state.tokens), self.cache_len()
            assert held == n - 1, (held, n)
            if self.proposer is not None:
                self.proposer.check_invariant(self.state)

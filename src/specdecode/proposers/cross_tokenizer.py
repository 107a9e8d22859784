"""Draft models of another tokenizer: the draft drafts in its own tokens, the target verifies
its own, and text (as bytes) carries the proposal from one to the other."""

from __future__ import annotations

import torch

from ..models.base import CausalLM
from ..sampling import process_logits, sample, to_probs
from ..tokenmap import TokenBytes, VocabMap
from .base import DraftOutput, Proposer, RequestState, Steps, run_alone

# draft tokens re-encoded each round before the new text (a token boundary that moves once
# more text follows is re-aligned; the cache keeps everything before)
LOOKBEHIND = 3
# committed target tokens encoded in front of the draft's text, so that the draft's first
# target token is split as it would be after them (e.g. a word's continuation)
WINDOW = 4


def _cumulative(start: int, table: list[bytes], ids: list[int]) -> list[int]:
    ends, at = [], start
    for i in ids:
        at += len(table[i])
        ends.append(at)
    return ends


class CrossTokenizerProposer(Proposer):
    """A draft model of any tokenizer (Universal Assisted Generation's text bridge, with
    token-level intersection for sampling: Timor et al., arXiv:2502.05202).

    The draft's context is the committed text in the draft's own tokens: the target's
    committed tokens as bytes (:class:`~specdecode.tokenmap.TokenBytes`), encoded by the
    draft's tokenizer once, then each round only from ``LOOKBEHIND`` draft tokens before the
    new text (a token boundary that moved is re-aligned there); the draft's KV cache keeps the
    longest prefix it shares with that context, so a round feeds only what changed, never the
    whole context again. Its BOS (where its tokenizer adds one) stands once at position 0;
    the target's BOS stands for no text; the draft's positions are its own. A character split
    over tokens waits until its last byte is committed.

    Proposals, by the request's acceptance rule:

    - greedy: the draft drafts greedily until its text spans k + 1 target tokens (at most
      2 (k + 1) draft tokens); their text, after the last ``WINDOW`` committed target
      tokens' text, is encoded by the target's tokenizer, and the target tokens that follow
      the window's (at the same byte boundary) are proposed as point
      masses, all but the last (whose text the draft's next token could still extend) unless
      the draft ended at an end-of-sequence token, which is proposed as the target's
      equivalent (same content, else the request's first EOS id), or stopped unsure (p_min)
      with a best next token whose text leaves the last one whole (:meth:`_settled`).
    - sampled, rejection rule: each draft token is sampled from the draft's processed
      distribution q. Where it is one target token exactly (same bytes:
      :class:`~specdecode.tokenmap.VocabMap`), it is proposed with the distribution it was
      drawn from given that it is such a token, q restricted to the exactly mapped tokens and
      renormalised, carried over to their target ids. A token that is not is proposed as
      point masses (its text encoded by the target's tokenizer, as for greedy) and ends the
      proposal. Each branch's tokens are verified with the distribution they were drawn from
      in that branch, and which branch is taken does not depend on the verifier's draws, so
      the output is distributed as the target's (Leviathan et al., arXiv:2211.17192, applied
      per branch).
    - sampled, gumbel rule: each draft token is the Gumbel-max sample, under the target's
      noise of that position, of q restricted to the exactly mapped tokens (the target's
      noise of token t scores the draft tokens that map to t); point masses, one target
      token per draft token.

    Speculation turns off for the request (empty drafts, nothing counted) when the draft's
    context is full, a tokenizer changes the bytes it encodes (a normalizer), or the
    committed bytes are not UTF-8 (no text to carry over).
    p_min: stop drafting where the draft's top probability is below it (None: never; the
    draft method's default is ``default_p_min``, :func:`specdecode.methods.draft_proposer`).
    lazy_prefill: the first ``propose`` feeds the prompt, not ``reset``.
    ``draft_prompt_ids`` (set before a request, for that request only): the prompt in the
    draft's own tokens (e.g. the conversation in the draft's own chat template) instead of
    the target's prompt text re-encoded; the generated text is aligned after it.
    Raises UnsupportedTokenizerError (a ValueError) for tokenizers whose tokens are not byte
    strings, ValueError for p_min outside [0, 1).
    """

    name = "draft"
    # SmolLM2 -> Qwen, HumanEval answers of 512 tokens (docs/EXPERIMENTS.md, a draft of another tokenizer): K 6 with drafting
    # stopped below a top probability of 0.4 took 1.05-1.06x less time than a fixed K 3 in
    # two runs of 10 problems (its drafts are accepted about half the time: a confident run
    # goes on, an unsure token ends the proposal before it costs a draft step); once a stop
    # kept its last drafted token (_settled), 0.5 took 1.5 % and 4 % less time than 0.4 on
    # two sets of 6 problems
    default_k = 6
    default_p_min = 0.5
    # greedy drafts at least one token past the K it proposes (see the class docstring): what
    # the auto schedule adds to a round's draft cost (schedule.AutoK)
    lookahead = 1

    def __init__(self, draft: CausalLM, target_tokenizer, draft_tokenizer,
                 draft_eos_token_ids: tuple[int, ...] = (), p_min: float | None = None,
                 lazy_prefill: bool = False):
        if p_min is not None and not (isinstance(p_min, (int, float)) and 0 <= p_min < 1):
            raise ValueError(f"draft p_min={p_min!r} is invalid; allowed: a number in [0, 1), or None")
        self.draft = draft
        self.tb, self.db = TokenBytes.of(target_tokenizer), TokenBytes.of(draft_tokenizer)
        self.vmap = VocabMap.of(self.tb, self.db)
        self.draft_eos = tuple(draft_eos_token_ids)
        self.p_min, self.lazy_prefill = p_min, lazy_prefill
        self.enabled = False
        self.draft_prompt_ids: list[int] | None = None

    # -- the committed text and the draft's context

    @staticmethod
    def draft_positions(target_positions: int) -> int:
        """The draft's positions for a request of ``target_positions`` target positions: a
        draft token stands for at least one byte, and a target token for a few, so twice the
        target's (+ 64) bound the draft's; past them, speculation turns off."""
        return 2 * target_positions + 64

    def reset(self, state: RequestState, max_total_len: int) -> None:
        self.enabled = True
        self.committed, self.ends, self.seen = bytearray(), [], 0
        self._commit(state.tokens)
        own, self.draft_prompt_ids = self.draft_prompt_ids, None  # for this request only
        if own is not None:  # the prompt as the draft's own tokens: never re-encoded
            self.ctx, self.ctx_end = list(own), [len(self.committed)] * len(own)
        else:
            self.ctx = [self.db.bos] if self.db.bos is not None else []
            self.ctx_end = [0] * len(self.ctx)
        self.fixed = len(self.ctx)
        self.cached: list[int] = []  # what the draft's KV cache holds
        self._limit = min(self.draft.max_context, self.draft_positions(max_total_len))
        self.draft.allocate(1, self._limit)
        eos = list(state.eos_token_ids)
        self.to_target = self.vmap.to_target.clone()
        for e in self.draft_eos:  # the draft's end of sequence is the request's
            if 0 <= e < len(self.to_target) and self.to_target[e] < 0 and eos:
                self.to_target[e] = eos[0]
        n = min(len(self.to_target), self.draft.vocab_size)
        self.exact = torch.nonzero(self.to_target[:n] >= 0).flatten()  # draft ids that map
        self.exact_to = self.to_target[self.exact]
        if not self.lazy_prefill:
            self._align()
            if self.enabled and len(self.ctx) > 1:
                self.draft.forward(torch.tensor([self.ctx[:-1]]), num_logits=0)
                self.cached = self.ctx[:-1]

    def _commit(self, tokens: list[int]) -> None:
        table = self.tb.table
        for t in tokens[len(self.ends):]:
            self.committed += table[t] if 0 <= t < len(table) else b""
            self.ends.append(len(self.committed))

    def _align(self) -> None:
        """Extend the draft's context to the committed bytes (whole characters), re-encoding
        from LOOKBEHIND tokens before its end."""
        j = max(self.fixed, len(self.ctx) - LOOKBEHIND)
        start = self.ctx_end[j - 1] if j > 0 else 0
        while j > self.fixed and start < len(self.committed) and self.committed[start] & 0xC0 == 0x80:
            j -= 1  # the token starts inside a character (byte tokens): from the character's start
            start = self.ctx_end[j - 1] if j > 0 else 0
        enc = self.db.encode_bytes(bytes(self.committed[start:]))
        if enc is None or not enc[2]:  # the text cannot be carried over (see the class docstring)
            self.enabled = False
            return
        ids = enc[0]
        self.ctx = self.ctx[:j] + ids
        self.ctx_end = self.ctx_end[:j] + _cumulative(start, self.db.table, ids)
        if len(self.ctx) >= self._limit:
            self.enabled = False

    def models(self) -> tuple[CausalLM, ...]:
        return (self.draft,)

    @property
    def active(self) -> bool:
        return self.enabled

    def unseen(self, state: RequestState) -> int:
        return max(0, len(state.tokens) - self.seen)

    def check_invariant(self, state: RequestState) -> None:
        if self.enabled:
            assert self.draft.seq_len == len(self.cached), (self.draft.seq_len, len(self.cached))
            start = self.ctx_end[self.fixed - 1] if self.fixed else 0
            end = self.ctx_end[-1] if self.ctx_end else 0
            assert self.db.bytes_of(self.ctx[self.fixed:]) == bytes(self.committed[start:end])

    def on_accept(self, state: RequestState) -> None:
        self._commit(state.tokens)

    # -- proposals

    def propose(self, state: RequestState, k: int) -> DraftOutput:
        """Target token ids [1, m] (with distributions [1, m, V] for the rejection rule),
        m ≤ k; 0 when the draft is off or unsure of its first token."""
        return run_alone(self.propose_steps(state, k))

    def propose_steps(self, state: RequestState, k: int) -> Steps:
        """:meth:`propose` as a generator of the draft's forward passes
        (:meth:`Proposer.propose_steps`)."""
        self._commit(state.tokens)
        self.seen = len(state.tokens)
        if self.enabled:
            self._align()
        if not self.enabled or k <= 0 or not self.ctx:
            return DraftOutput.empty()
        params = state.params
        # the committed bytes past the draft's context: the first bytes of a character it
        # waits for (see _align); a sampled draft token would stand at the wrong position
        lag = len(self.committed) - (self.ctx_end[-1] if self.ctx_end else 0)
        if lag and not params.greedy:
            return DraftOutput.empty()
        # greedy: until the drafted text spans k + 1 target tokens (the last one's end is not
        # settled), at most 2 (k + 1) draft tokens
        steps = min(2 * (k + 1) if params.greedy else k, self._limit - len(self.ctx))
        if steps <= 0:
            self.enabled = False
            return DraftOutput.empty()
        c = 0  # the cache keeps the longest prefix it shares with the context (one token fed at least)
        top = min(len(self.cached), len(self.ctx) - 1)
        while c < top and self.cached[c] == self.ctx[c]:
            c += 1
        self.draft.rollback(c)
        # what changed since the last round goes in the first draft step's pass (a pass of a
        # few tokens costs what a pass of one does; a draft's logits need match nothing)
        new = self.ctx[c:]
        self.cached = list(self.ctx)
        vd = min(self.draft.vocab_size, len(self.to_target))
        context = list(self.ctx)
        drafted: list[int] = []
        ids: list[int] = []  # target ids, for the sampled rules
        rows: list[torch.Tensor] = []  # their distributions (rejection rule)
        end: int | None = None  # the target id of a drafted end-of-sequence token
        text_tail: list[int] = []  # a sampled draft token that is not one target token
        feed = torch.tensor([new])
        n = len(state.tokens)
        mapped, mapped_of = [], 0  # greedy: the target ids of drafted[:mapped_of]
        unsure: int | None = None  # the draft's best next token where it stopped unsure
        for i in range(steps):
            logits = (yield self.draft, feed, 1)[:, -1:, :vd].float()
            processed = process_logits(logits, params, torch.tensor([context]), None,
                                       state.num_generated + i, self.draft_eos)[:, 0]
            probs = None if params.greedy or state.noise is not None else to_probs(processed, params)
            if self.p_min is not None and float(
                    (torch.softmax(processed, -1) if probs is None else probs).max()) < self.p_min:
                if params.greedy:  # only greedy proposals are settled by it (no sync otherwise)
                    unsure = int(processed.argmax(-1))
                break
            if params.greedy:
                d = int(processed.argmax(-1))
            elif state.noise is not None:
                scores = processed[0, self.exact] + state.noise.rows(n + i, 1)[0, self.exact_to]
                best = int(scores.argmax())
                if scores[best] == float("-inf"):
                    break
                d = int(self.exact[best])
            else:
                d = int(sample(probs, state.generator))
            if d in self.db.special or d in self.draft_eos:
                t = int(self.to_target[d]) if d < len(self.to_target) else -1
                if t >= 0:
                    end = t
                    if not params.greedy:
                        ids.append(t)
                        if probs is not None:
                            rows.append(self._exact_row(probs))
                break
            if not params.greedy:
                t = int(self.to_target[d])
                if t < 0:  # not one target token: its text as point masses, then stop
                    text_tail = [d]
                    break
                ids.append(t)
                if probs is not None:
                    rows.append(self._exact_row(probs))
            drafted.append(d)
            context.append(d)
            if params.greedy and len(drafted) > k:
                mapped, mapped_of = self._to_target(state, [], drafted), len(drafted)
                if mapped is None or len(mapped) > k:
                    break
            if i + 1 < steps:
                self.cached.append(d)
                feed = torch.tensor([[d]])
        if params.greedy:
            if mapped_of != len(drafted):
                mapped = self._to_target(state, [], drafted) if drafted else []
            if mapped is None:
                return DraftOutput.empty()
            if end is not None:
                mapped = mapped + [end]
            elif not (mapped and unsure is not None and self._settled(state, drafted, mapped, unsure)):
                mapped = mapped[:-1]
            return self._output(mapped[:k], [])
        if text_tail:
            tail = self._to_target(state, ids, text_tail) or []
            ids += tail[:-1]
            rows += [torch.nn.functional.one_hot(torch.tensor(t), len(self.tb)).float()
                     for t in tail[:-1]]
        return self._output(ids[:k], rows[:k])

    def _settled(self, state: RequestState, drafted: list[int], mapped: list[int], nxt: int) -> bool:
        """Whether the last of ``mapped`` (the target ids of ``drafted``) stays one token when
        the text goes on with ``nxt``, the draft's best next token where it stopped unsure:
        its distribution is already computed, so this costs no draft step, and a round that
        stopped proposes the last token it drafted instead of dropping it as one that the next
        text could still extend (a guess: verification decides, the output cannot change).
        An end of text (a special or end-of-sequence token) settles it."""
        if nxt in self.db.special or nxt in self.draft_eos:
            return True
        ext = self._to_target(state, [], drafted + [nxt])
        return ext is not None and ext[:len(mapped)] == mapped and len(ext) > len(mapped)

    def _exact_row(self, probs: torch.Tensor) -> torch.Tensor:
        """q restricted to the draft tokens that are one target token each, renormalised, as
        a distribution over the target's ids [V_target]."""
        q = probs[0, self.exact]
        row = torch.zeros(len(self.tb), dtype=q.dtype)
        row.index_add_(0, self.exact_to, q / q.sum())
        return row

    def _to_target(self, state: RequestState, proposed: list[int], drafted: list[int]) -> list[int] | None:
        """The target's ids for the text of ``drafted`` (draft ids, from the end of the
        draft's context: past the committed bytes of a character the draft waits for, which
        its text must begin with) after the committed tokens and ``proposed`` (target ids
        already proposed this round): encoded after the
        last WINDOW committed tokens' text (back to the last special token at most), and
        cut where the window's text ends; where no target token ends there, the drafted
        text encoded alone; None when neither can be encoded."""
        text = self.db.bytes_of(drafted)
        lag = bytes(self.committed[self.ctx_end[-1] if self.ctx_end else 0:])
        if not text.startswith(lag):  # the draft disagrees with the committed character
            return None
        text = text[len(lag):]
        tokens = state.tokens
        w0 = max(0, len(tokens) - WINDOW)
        for i in range(len(tokens) - 1, w0 - 1, -1):
            if tokens[i] in self.tb.special:
                w0 = i + 1
                break
        start = self.ends[w0 - 1] if w0 > 0 else 0
        window = bytes(self.committed[start:]) + self.tb.bytes_of(proposed)
        enc = self.tb.encode_bytes(window + text)
        if enc is None:
            return None
        ids, at = enc[0], 0
        for m, t in enumerate(ids):
            if at == len(window):
                return ids[m:]
            at += len(self.tb.table[t])
        # the text merges with the window's last token, which the target did not choose:
        # its own tokens for the drafted text alone
        alone = self.tb.encode_bytes(text)
        return alone[0] if alone is not None and alone[1] else None

    def _output(self, ids: list[int], rows: list[torch.Tensor]) -> DraftOutput:
        if not ids:
            return DraftOutput.empty()
        probs = torch.stack(rows)[None] if rows else None
        return DraftOutput(torch.tensor([ids], dtype=torch.long), probs, "draft")

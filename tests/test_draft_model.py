"""The draft-model proposer: p_min, reading another proposer's guess, lazy prefill."""

from __future__ import annotations

import pytest
import torch

from helpers import MockLM, hashed_logits
from specdecode.config import SamplingParams
from specdecode.methods import SpeculativeConfig
from specdecode.proposers import (DraftModelProposer, PromptLookupProposer, RequestState,
                                  SuffixProposer)
from helpers import PROMPTS, noisy_draft, random_draft, ref, run, target
from lookups import COPY_PROMPT, GREEDY128


def test_draft_p_min_stops_drafting_and_stays_lossless():
    prompt = PROMPTS["twenty"]
    expected = list(ref(tuple(prompt), GREEDY128))
    free, _ = run(target(), DraftModelProposer(noisy_draft()), 6, prompt, GREEDY128)
    strict, _ = run(target(), DraftModelProposer(noisy_draft(), p_min=0.9), 6, prompt, GREEDY128)
    assert free.token_ids == strict.token_ids == expected
    assert strict.stats.num_draft_tokens < free.stats.num_draft_tokens
    assert strict.stats.acceptance_rate > free.stats.acceptance_rate
    # every proposed token had top probability >= p_min: with p_min ~1 nothing is proposed
    never, _ = run(target(), DraftModelProposer(noisy_draft(), p_min=0.999999), 6, prompt, GREEDY128)
    assert never.token_ids == expected and never.stats.num_draft_tokens == 0


@pytest.mark.parametrize("bad", [1.0, -0.1, "0.5", float("nan")])
def test_draft_p_min_validation(bad):
    with pytest.raises(ValueError, match="p_min"):
        DraftModelProposer(random_draft(), p_min=bad)


GUESS_PROMPT = [(i * 7) % 50 for i in range(10)]


def _drafter(fn, p_min=None, params=GREEDY128):
    drafter = DraftModelProposer(MockLM(50, fn), p_min=p_min)
    state = RequestState(list(GUESS_PROMPT), 0, params, (), torch.Generator().manual_seed(3), 50)
    drafter.reset(state, 200)
    drafter.draft.forward_sizes.clear()
    return drafter, state


@pytest.mark.parametrize("agree", [0, 2, 5])
def test_draft_reads_a_guess_in_one_pass(agree):
    """The guess's first ``agree`` tokens are the draft's own greedy tokens, the next is not:
    the proposal is still the draft's greedy continuation (the agreed tokens, its own token,
    then drafting on up to k = 4; all 5 agreed: the guess and the draft's next token), read
    in one pass over the guess, and the cache holds the committed tokens and all of the
    proposal but its last token (as after autoregressive drafting)."""
    fn = hashed_logits(50, "d")
    drafter, state = _drafter(fn)
    own = drafter.propose(state, 8).token_ids[0].tolist()
    drafter, state = _drafter(fn)
    guess = own[:5] if agree == 5 else own[:agree] + [(own[agree] + 1) % 50] + own[agree + 1:5]
    out = drafter.propose_with_guess(state, 4, guess).token_ids[0].tolist()
    want = own[:6] if agree == 5 else own[:4]
    assert out == want
    assert drafter.draft.forward_sizes == [len(guess) + 1] + [1] * (len(want) - agree - 1)
    assert drafter.draft.tokens == GUESS_PROMPT + want[:-1]


def test_draft_guess_keeps_what_both_expect_and_stops_where_the_draft_is_unsure():
    """p_min does not cut tokens the draft and the guess agree on; an own token the draft is
    unsure of ends the proposal. Sampled requests ignore the guess."""
    sure = hashed_logits(50, "d")
    unsure = lambda toks: sure(toks) * 0.05  # same argmax, top probability below 0.5
    drafter, state = _drafter(sure)
    own = drafter.propose(state, 8).token_ids[0].tolist()
    drafter, state = _drafter(unsure, p_min=0.5)
    assert drafter.propose_with_guess(state, 4, own[:3]).token_ids[0].tolist() == own[:3]
    drafter, state = _drafter(unsure, p_min=0.5)
    assert drafter.propose_with_guess(state, 4, [(own[0] + 1) % 50]).token_ids.shape[1] == 0
    assert drafter.draft.tokens == GUESS_PROMPT[:-1]  # nothing kept in its cache
    sampled = SamplingParams(max_new_tokens=10, temperature=1.0, seed=3)
    a = _drafter(sure, params=sampled)
    b = _drafter(sure, params=sampled)
    assert torch.equal(a[0].propose_with_guess(a[1], 4, own[:3]).token_ids, b[0].propose(b[1], 4).token_ids)


@pytest.mark.parametrize("make,match", [
    (lambda: PromptLookupProposer(2, 3), "min=3 max=2"),
    (lambda: PromptLookupProposer(3, 0), "min=0"),
    (lambda: PromptLookupProposer(True, True), "min=True max=True"),
    (lambda: SpeculativeConfig("prompt-lookup", max_ngram=True, min_ngram=True), "max_ngram=True"),
    (lambda: PromptLookupProposer(3, 1, "frequent"), "match='frequent'"),
    (lambda: SuffixProposer(0), "depth=0"),
    (lambda: SuffixProposer(8, 1.0), "min_confidence=1.0"),
    (lambda: SuffixProposer(8, 0.1, "global"), "cache='global'"),
    (lambda: SuffixProposer(8, 0.1, "session", 0), "max_session_tokens=0"),
])
def test_lookup_options_are_validated(make, match):
    with pytest.raises(ValueError, match=match):
        make()


class ChunkSensitiveLM(MockLM):
    """Like an int8 draft with one activation scale per call: when a call feeds the first
    position together with others, its last row's logits are off (the argmax moves)."""

    def forward(self, input_ids, num_logits=None):
        spans_start = self.seq_len == 0 and input_ids.shape[1] > 1
        out = super().forward(input_ids, num_logits)
        if spans_start and out.shape[1]:
            out[0, -1] = out[0, -1].roll(1)
        return out


@pytest.mark.parametrize("n_prompt", [2, 3, 12])
def test_lazy_prefill_drafts_what_an_eager_prefill_drafts(n_prompt):
    prompt = COPY_PROMPT[:n_prompt]
    drafts = []
    for lazy in (False, True):
        state = RequestState(list(prompt), 0, SamplingParams(), (), None, 50)
        proposer = DraftModelProposer(ChunkSensitiveLM(50, hashed_logits(50, "chunk")), lazy_prefill=lazy)
        proposer.reset(state, 100)
        drafts.append(proposer.propose(state, 4).token_ids.tolist())
    assert drafts[0] == drafts[1]

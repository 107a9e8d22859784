"""The hybrid: a policy over free proposers and one draft model (its choices, stats per
proposer, costs, tuning; greedy equality, a draft equal to its target and the sampling
distribution for it, docs/testing.md). Expected outputs always come from plain decoding of
the same target."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from helpers import MockLM, hashed_logits
from specdecode.config import SamplingParams
from specdecode.engine import Engine
from specdecode.proposers import (DraftModelProposer, Forecast, HybridProposer, HybridTuning,
                                  PromptLookupProposer, RequestState, SuffixProposer)
from helpers import PROMPTS, noisy_draft, random_draft, ref, run, target
from lossless import EV, N_RUNS, assert_lossless, engine_joint, mock_draft, mock_target
from lookups import COPY_PROMPT, GREEDY128, L_PROMPT, copying_logits, lookup


@pytest.fixture(autouse=True)
def modelled_costs_only(monkeypatch):
    """The policy on its declared costs: mock models' wall times mean nothing, so the
    calibration by measured round times is left out here (tests/test_hybrid_measured.py)."""
    monkeypatch.setattr(HybridProposer, "observe", lambda self, draft_s, verify_s: None)


def test_hybrid_uses_both_and_reports_each():
    tgt = MockLM(50, copying_logits(50))
    # a draft that knows the copying rule only sometimes: a noisy version of the same logits
    noisy = MockLM(50, lambda toks: copying_logits(50)(toks) + hashed_logits(50, "n", 3.0)(toks))
    prompt = [30 + i for i in range(12)]  # no repeats: the copying target begins to repeat
    params = SamplingParams(max_new_tokens=60)
    gen, _ = run(tgt, HybridProposer(SuffixProposer(8, 0.05), HybridProposer.draft_for(noisy)), 4,
                 prompt, params)
    assert gen.token_ids == Engine(tgt).generate(prompt, params).run().token_ids
    by = gen.stats.by_proposer
    assert set(by) == {"suffix", "draft", "suffix+draft"}  # the last: lookup tokens the draft read
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert sum(c[key] for c in by.values()) == getattr(gen.stats, key)
    assert gen.stats.to_dict()["by_proposer"] == by


@pytest.mark.parametrize("kwargs,words", [
    (dict(verify_cost=-1), "verify_cost=-1"), (dict(verify_cost=[1.0, 0.0]), "verify_cost=[1.0, 0.0]"),
    (dict(verify_cost=[]), "verify_cost=[]"), (dict(draft_cost=-0.5), "draft_cost=-0.5"),
    (dict(draft_k=0), "draft_k=0"), (dict(draft_prefill_cost=-1), "draft_prefill_cost=-1")])
def test_hybrid_rejects_bad_costs(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        HybridProposer(SuffixProposer(), HybridProposer.draft_for(random_draft()), **kwargs)


def test_hybrid_draft_model_drafts_at_most_draft_k():
    prompt = PROMPTS["twenty"]
    proposer = HybridProposer(SuffixProposer(8, 0.05), HybridProposer.draft_for(noisy_draft()), draft_k=3)
    gen, _ = run(target(), proposer, 12, prompt, GREEDY128)
    assert gen.token_ids == list(ref(tuple(prompt), GREEDY128))
    by = gen.stats.by_proposer["draft"]
    assert by["num_drafts"] > 5 and by["num_draft_tokens"] <= 3 * by["num_drafts"]


def test_hybrid_with_the_target_as_draft_accepts_every_draft_round():
    """The draft's cache catches up after lookup rounds: if it fell out of step, draft
    rounds would start being rejected (greedy equality alone would not notice)."""
    tgt = target()
    prompt = PROMPTS["repetitive"]
    params = SamplingParams(max_new_tokens=520)
    gen, blocks = run(tgt, HybridProposer(SuffixProposer(8, 0.05), HybridProposer.draft_for(tgt.fork())),
                      4, prompt, params)
    assert gen.token_ids == list(ref(tuple(prompt), params))
    by = gen.stats.by_proposer
    assert by["draft"]["num_drafts"] > 20 and by.get("suffix", {}).get("num_drafts", 0) > 0
    assert by["draft"]["num_accepted_tokens"] == by["draft"]["num_draft_tokens"]


def test_hybrid_draft_reads_the_lookup_proposal():
    """Once the draft has seen the committed tokens, a lookup proposal goes through it
    (greedy): the hybrid proposes the draft's greedy continuation, the lookup's tokens where
    the two agree ("suffix+draft"). The target copies its text but deviates in a fifth of
    the contexts, where the lookup misses; the draft is the target's twin, so every round
    it read is accepted in full."""
    tfn = _sometimes_wrong(copying_logits(50), "x", 0.2)
    tgt = MockLM(50, tfn)
    params = SamplingParams(max_new_tokens=80)
    twin = DraftModelProposer(MockLM(50, lambda toks: tfn(toks) * 10))
    gen, _ = run(tgt, HybridProposer(SuffixProposer(8, 0.05), twin), 8, COPY_PROMPT, params)
    assert gen.token_ids == Engine(tgt).generate(COPY_PROMPT, params).run().token_ids
    by = gen.stats.by_proposer
    assert by["suffix+draft"]["num_drafts"] > 3
    for source in set(by) - {"suffix"}:
        assert by[source]["num_accepted_tokens"] == by[source]["num_draft_tokens"]


def test_hybrid_without_read_guess_never_hands_the_draft_a_guess():
    """HybridTuning(read_guess=False, check_below=0) (the self method's): the draft drafts
    from its own tokens only; the output is still the target's."""
    tfn = _sometimes_wrong(copying_logits(50), "x", 0.2)
    tgt = MockLM(50, tfn)
    params = SamplingParams(max_new_tokens=80)
    guesses = {True: [], False: []}

    class Spy(DraftModelProposer):
        def propose_steps_with_guess(self, state, k, guess):
            guesses[self.reading].append(list(guess))
            return (yield from super().propose_steps_with_guess(state, k, guess))

    for reading in (True, False):
        twin = Spy(MockLM(50, lambda toks: tfn(toks) * 10))
        twin.reading = reading
        tuning = HybridTuning() if reading else HybridTuning(read_guess=False, check_below=0.0)
        gen, _ = run(tgt, HybridProposer(SuffixProposer(8, 0.05), twin, tuning=tuning), 8,
                     COPY_PROMPT, params)
        assert gen.token_ids == Engine(tgt).generate(COPY_PROMPT, params).run().token_ids
        assert "suffix+draft" not in gen.stats.by_proposer or reading
    assert any(guesses[True]) and guesses[False] and not any(guesses[False])


def test_draft_turns_itself_off_when_its_context_is_full_and_the_hybrid_looks_up():
    tgt = MockLM(50, copying_logits(50))
    params = SamplingParams(max_new_tokens=60)
    drafter = DraftModelProposer(MockLM(50, copying_logits(50), max_context=30))
    gen, _ = run(tgt, drafter, 4, COPY_PROMPT, params)
    assert gen.token_ids == Engine(tgt).generate(COPY_PROMPT, params).run().token_ids
    assert not drafter.enabled  # turned off once prompt + output passed its 30 positions
    assert 0 < gen.stats.num_draft_tokens <= 30
    # a hybrid whose draft is off keeps proposing from the lookup
    proposer = HybridProposer(SuffixProposer(8, 0.05), HybridProposer.draft_for(MockLM(50, copying_logits(50),
                                                                                 max_context=30)))
    gen, _ = run(tgt, proposer, 4, COPY_PROMPT, params)
    assert gen.token_ids == Engine(tgt).generate(COPY_PROMPT, params).run().token_ids
    assert gen.stats.by_proposer["suffix"]["num_accepted_tokens"] > 30


def _amortised_run(cost: float, tuning: HybridTuning = HybridTuning(), rows: int = 1, feed: bool = True,
                   max_new: int = 120, sampled: bool = False):
    tgt = MockLM(50, hashed_logits(50, "t"))
    prompt = [(i * 7) % 50 for i in range(41)]
    draft = MockLM(50, hashed_logits(50, "t"))  # the target's twin: every draft is accepted
    hybrid = HybridProposer(SuffixProposer(8, 0.99), HybridProposer.draft_for(draft, p_min=0.0),
                            draft_prefill_cost=cost, tuning=tuning)
    hybrid.share_passes(rows, feed)
    params = SamplingParams(max_new_tokens=max_new, **(dict(temperature=1.0, seed=5) if sampled else {}))
    gen, _ = run(tgt, hybrid, 6, prompt, params)
    assert gen.token_ids == Engine(tgt).generate(prompt, params).run().token_ids
    first_fed_at = draft.forward_sizes[0] - (len(prompt) - 1) if draft.forward_sizes else None
    return first_fed_at, gen.stats.by_proposer.get("draft", {}).get("num_accepted_tokens", 0)


def test_hybrid_amortises_the_draft_prefill_over_the_answer_so_far():
    """A long prompt's draft prefill is paid only once the answer has gone on long enough to
    spread it (RAG: 800 prompt tokens, a 15-token answer), not over max_new_tokens: before
    that the draft is not fed at all. Numbers (default costs, prior acceptance 0.7, a cold
    margin of 10 %, a horizon of 16 tokens): 40 unseen prompt tokens at 0.12 T(1) each beat plain decoding by the
    margin from about 35 generated tokens on; spread over max_new_tokens they would from the
    start. With no margin, a draft that beats plain decoding barely is fed at once: after the
    first token, which no feed holds up (fed at 1)."""
    tuning = HybridTuning(draft_prior_alpha=0.7, cold_margin=1.1, horizon=16)
    first_fed_at, accepted = _amortised_run(0.12, tuning)
    assert 25 <= first_fed_at <= 50
    assert accepted >= 0.8 * (120 - first_fed_at)  # then it serves most of the answer
    assert _amortised_run(0.18, tuning) == (None, 0)  # dearer: never pays within 120 tokens
    assert _amortised_run(0.12, dataclasses.replace(tuning, cold_margin=1.0))[0] == 1
    # a horizon of 64 spreads a feed over 64 tokens from the start: fed at once,
    # but never over more tokens than the request has left: with 16 to go, never fed
    assert _amortised_run(0.12, dataclasses.replace(tuning, horizon=64))[0] == 1
    assert _amortised_run(0.12, dataclasses.replace(tuning, horizon=64), max_new=16) == (None, 0)
    assert _amortised_run(0.01, dataclasses.replace(tuning, horizon=64), max_new=16)[0] == 1


def test_a_sampled_request_feeds_the_draft_on_a_prior_of_its_own():
    """Before the draft has drafted, its acceptance is a prior: greedy requests take
    ``draft_prior_alpha``, sampled ones ``sampled_prior_alpha`` (lower: a sampled token
    matches the draft's less often), so a feed the greedy prior pays at once waits, under
    sampling, for an answer long enough to spread it."""
    tuning = HybridTuning(draft_prior_alpha=0.85, sampled_prior_alpha=0.7, cold_margin=1.0, horizon=16)
    assert _amortised_run(0.18, tuning)[0] == 1
    late, accepted = _amortised_run(0.18, tuning, sampled=True)
    assert 10 <= late <= 100 and accepted > 0  # (the twin's drafts are accepted once fed)
    equal = dataclasses.replace(tuning, sampled_prior_alpha=0.85)
    assert _amortised_run(0.18, equal, sampled=True)[0] == 1
    h = HybridProposer(SuffixProposer(8, 0.99), HybridProposer.draft_for(MockLM(50, hashed_logits(50, "t"))),
                       tuning=tuning)
    for params, prior in ((SamplingParams(), 0.85), (SamplingParams(temperature=0.7, seed=1), 0.7)):
        h.reset(RequestState([1, 2, 3], 0, params, (), None, 50), 64)
        assert h.draft_alpha[0] == prior


def test_hybrid_charges_a_catch_up_to_every_row_it_holds_up():
    """In a batch the draft's feed runs as one long pass while every row waits, so the hybrid
    charges it once per row sharing the pass (share_passes): the feed that pays at once for
    a request alone (cost 0.04 T(1) a token, no margin) waits for a longer answer with 4
    rows, and with 16 is never paid within 120 tokens; on the batch's trial rounds, never."""
    tuning = HybridTuning(draft_prior_alpha=0.7, cold_margin=1.0, horizon=16)
    assert _amortised_run(0.04, tuning)[0] == 1
    first_fed_at, accepted = _amortised_run(0.04, tuning, rows=4)
    assert 10 <= first_fed_at <= 60 and accepted >= 0.8 * (120 - first_fed_at)
    assert _amortised_run(0.04, tuning, rows=16) == (None, 0)
    # the batch's trial rounds, whose speculation may not go on, never feed it
    assert _amortised_run(0.04, tuning, feed=False) == (None, 0)


def test_hybrid_drafts_as_far_as_the_draft_is_accepted():
    """The draft length follows the draft's acceptance in this request: the target's twin
    drafts draft_k tokens a round; an unrelated draft is soon given short rounds, then none."""
    tgt = target()
    prompt = PROMPTS["twenty"]
    expected = list(ref(tuple(prompt), GREEDY128))
    twin = HybridProposer(SuffixProposer(8, 0.99), HybridProposer.draft_for(tgt.fork(), p_min=0.0), draft_k=6)
    gen, _ = run(tgt, twin, 8, prompt, GREEDY128)
    by = gen.stats.by_proposer["draft"]
    assert gen.token_ids == expected and min(twin.draft_alpha) > 0.9
    assert by["num_draft_tokens"] > 5 * by["num_drafts"]
    other = HybridProposer(SuffixProposer(8, 0.99), HybridProposer.draft_for(random_draft(), p_min=0.0), draft_k=6)
    gen, _ = run(tgt, other, 8, prompt, GREEDY128)
    by = gen.stats.by_proposer["draft"]
    assert gen.token_ids == expected and other.draft_alpha[0] < 0.3
    assert by["num_drafts"] <= 12 and by["num_draft_tokens"] < 3 * by["num_drafts"]  # of 128 tokens


def test_hybrid_draft_stops_where_it_is_unsure():
    """By default the hybrid's draft stops at a token to which it gives less than
    HybridTuning.draft_p_min (0.5): a draft that agrees with the target but is never sure
    proposes nothing; a sure one drafts; a p_min set by the caller (0: never stop) is kept;
    the hybrid changes nothing of the members it is given."""
    tfn = hashed_logits(50, "t")
    tgt = MockLM(50, tfn)
    prompt = [(i * 7) % 50 for i in range(10)]
    params = SamplingParams(max_new_tokens=60)
    expected = Engine(tgt).generate(prompt, params).run().token_ids
    unsure, sure = (lambda toks: tfn(toks) * 0.05), (lambda toks: tfn(toks) * 10)  # same argmax
    for fn, p_min, drafts in ((unsure, None, False), (unsure, 0.0, True), (sure, None, True)):
        drafter = HybridProposer.draft_for(MockLM(50, fn), p_min=p_min)
        hybrid = HybridProposer(SuffixProposer(8, 0.99), drafter)
        assert drafter.p_min == (HybridTuning.draft_p_min if p_min is None else p_min)
        assert drafter.lazy_prefill
        gen, _ = run(tgt, hybrid, 8, prompt, params)
        assert gen.token_ids == expected
        assert ("draft" in gen.stats.by_proposer) == drafts


def test_hybrid_stops_asking_a_draft_that_is_never_sure():
    """A round where the draft paid a step and stopped unsure (p_min) lowers the share of
    rounds it proposes in (draft_sure), and a probe that stopped is a probe all the same: a
    draft that is never sure is asked a few times, then only probed now and then. The
    previous hybrid learnt nothing from such rounds and paid a draft step in every round of
    the answer (the layer-skip draft of `self` on a long chat answer: 207 draft steps for
    101 proposals in 342 rounds, 0.89x plain decoding)."""
    tfn = hashed_logits(50, "t")
    tgt = MockLM(50, tfn)
    prompt = [(i * 7) % 50 for i in range(10)]
    params = SamplingParams(max_new_tokens=150)
    expected = Engine(tgt).generate(prompt, params).run().token_ids
    # a step of half a verify pass (the layer-skip draft) is worth asking for only while it is
    # sure in most rounds; one of 0.12 (a small draft model) while it is in a few
    for cost, most in ((0.5, 10), (0.12, 50)):
        unsure = MockLM(50, lambda toks: tfn(toks) * 0.05)  # the target's argmax, never sure of it
        hybrid = HybridProposer(SuffixProposer(8, 0.99), HybridProposer.draft_for(unsure), draft_cost=cost)
        gen, _ = run(tgt, hybrid, 8, prompt, params)
        assert gen.token_ids == expected
        assert "draft" not in gen.stats.by_proposer and gen.stats.num_verify_passes > 100
        steps = len(unsure.forward_sizes) - 1  # its lazy prefill, then one step a round it was asked
        assert 1 <= steps <= most, (cost, steps)
        assert hybrid.draft_sure <= 0.3
        assert hybrid.draft_alpha[0] == HybridTuning.draft_prior_alpha  # no proposal: nothing to score
    # unsure for the first 30 tokens of the answer, sure after them: given up, probed, and
    # drafting again (a draft that had never proposed was never probed: no draft round at all)
    late = MockLM(50, lambda toks: tfn(toks) * (0.05 if len(toks) < 40 else 10))
    hybrid = HybridProposer(SuffixProposer(8, 0.99), HybridProposer.draft_for(late), draft_cost=0.5)
    gen, _ = run(tgt, hybrid, 8, prompt, params)
    assert gen.token_ids == expected
    assert gen.stats.by_proposer["draft"]["num_accepted_tokens"] > 60


def _sometimes_wrong(logits_fn, salt: str, p: float):
    """The target's logits with the top token moved, in a fixed ≈ ``p`` share of contexts:
    a draft whose tokens are accepted about 1 − p of the time, at every position alike."""
    def fn(tokens):
        x = logits_fn(tokens)
        h = hashlib.sha256((salt + repr(tokens[-4:])).encode()).digest()[0] / 256
        return torch.roll(x, 1) if h < p else x
    return fn


@pytest.mark.parametrize("salt", "abcdef")
def test_hybrid_keeps_measuring_positions_past_its_draft_length(salt):
    """A draft right ~84 % of the time at every position, with this project's CPU profile:
    lengths 5 and 6 pay about equally and best. An early miss at position 5 must not freeze
    that position's estimate and keep every later round at 4 tokens (the previous hybrid
    drafted 4.0-5.4 tokens a round on 5 of these 6 drafts)."""
    profile = [1.0, 1.29, 1.32, 1.40, 1.45, 1.52, 1.60, 1.70, 1.76]
    tfn = hashed_logits(50, "t")
    tgt = MockLM(50, tfn)
    hybrid = HybridProposer(SuffixProposer(8, 0.99), HybridProposer.draft_for(MockLM(50, _sometimes_wrong(tfn, salt, 0.16)), p_min=0.0),
                            verify_cost=profile, draft_cost=0.127, draft_prefill_cost=0.0)
    prompt = [(i * 7) % 50 for i in range(10)]
    params = SamplingParams(max_new_tokens=300)
    gen, _ = run(tgt, hybrid, 8, prompt, params)
    assert gen.token_ids == Engine(tgt).generate(prompt, params).run().token_ids
    by = gen.stats.by_proposer["draft"]
    assert 0.5 < gen.stats.acceptance_rate < 0.8  # neither a twin nor useless
    assert by["num_draft_tokens"] / by["num_drafts"] > 5.5


def test_hybrid_tries_a_draft_again_after_giving_it_up():
    """A draft that is wrong for the first tokens of the answer and right after them: the
    hybrid stops drafting after a bad start, then tries it again now and then (after 8
    rounds without it, then 16, ...) and goes back to drafting once it is accepted. The
    previous hybrid never drafted again (about 0 accepted draft tokens here)."""
    tfn = hashed_logits(50, "t")
    tgt = MockLM(50, tfn)
    prompt = [(i * 7) % 50 for i in range(10)]
    bad_start = MockLM(50, lambda toks: torch.roll(tfn(toks), 1) if len(toks) < 22 else tfn(toks))
    hybrid = HybridProposer(SuffixProposer(8, 0.99), HybridProposer.draft_for(bad_start, p_min=0.0))
    params = SamplingParams(max_new_tokens=150)
    gen, _ = run(tgt, hybrid, 8, prompt, params)
    assert gen.token_ids == Engine(tgt).generate(prompt, params).run().token_ids
    by = gen.stats.by_proposer["draft"]
    assert by["num_accepted_tokens"] > 100 and hybrid.draft_alpha[0] > 0.7  # bad start included
    # a draft that is never right is tried again less and less often
    never = HybridProposer(SuffixProposer(8, 0.99),
                           HybridProposer.draft_for(MockLM(50, lambda toks: torch.roll(tfn(toks), 1)), p_min=0.0))
    gen, _ = run(tgt, never, 8, prompt, params)
    assert gen.token_ids == Engine(tgt).generate(prompt, params).run().token_ids
    # a few rounds until its estimate falls below the prior's pull, then probes after 8, 16, 32, 64 rounds
    assert 3 <= gen.stats.by_proposer["draft"]["num_drafts"] <= 12


def test_hybrid_costs_beyond_the_profile_never_fall():
    """A noisy profile may end lower than it starts; extrapolating its slope past the end
    must not reach zero or below (a division by it would crash the request)."""
    hybrid = HybridProposer(SuffixProposer(), HybridProposer.draft_for(random_draft()), verify_cost=[1.0, 0.5])
    assert [hybrid._t(n) for n in (1, 2, 3, 40)] == [1.0, 0.5, 0.5, 0.5]
    tgt = MockLM(50, copying_logits(50))
    hybrid = HybridProposer(SuffixProposer(8, 0.05), HybridProposer.draft_for(MockLM(50, copying_logits(50))),
                            verify_cost=[2.0, 1.0])
    params = SamplingParams(max_new_tokens=60)
    gen, _ = run(tgt, hybrid, 16, COPY_PROMPT, params)
    assert gen.token_ids == Engine(tgt).generate(COPY_PROMPT, params).run().token_ids


class _Overconfident(SuffixProposer):
    """A lookup that proposes k copies of token 0 and swears each is 95 % sure."""

    def forecast(self, state, k):
        self._update(state.tokens)
        self._pending = None
        return Forecast([0] * k, [0.95 ** (i + 1) for i in range(k)])


def test_hybrid_stops_trusting_a_lookup_that_over_promises():
    """What the lookup's used proposals delivered scales its later promises: a lookup whose
    confidences are wrong loses its turns to the draft model after a round or two."""
    tgt = target()
    prompt = PROMPTS["twenty"]
    hybrid = HybridProposer(_Overconfident(8, 0.0), HybridProposer.draft_for(tgt.fork(), p_min=0.0))
    gen, _ = run(tgt, hybrid, 8, prompt, GREEDY128)
    assert gen.token_ids == list(ref(tuple(prompt), GREEDY128))
    by = gen.stats.by_proposer
    assert by["suffix"]["num_drafts"] <= 2 and hybrid.lookup_realism() < 0.5
    assert by["draft"]["num_drafts"] > 10


@pytest.mark.parametrize("n", range(20, 3 * 8 + 2))
def test_max_new_tokens_up_to_3k_plus_1(n):
    tgt = MockLM(50, copying_logits(50))
    params = SamplingParams(max_new_tokens=n)
    for kind in ("lookup-recent", "suffix"):
        gen, _ = run(tgt, lookup(kind), 8, COPY_PROMPT, params)
        assert gen.token_ids == Engine(tgt).generate(COPY_PROMPT, params).run().token_ids
        assert len(gen.token_ids) == n and gen.finish_reason == "length"


@pytest.mark.slow
def test_hybrid_sampled_output_follows_target():
    """Rounds from the lookup (point masses) and from a draft model (its distribution) mixed
    in one request: the joint of the first two tokens is the target's."""
    params = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=5)
    # here the lookup must win some rounds against a free draft: no margin, a modest prior
    hybrid = HybridProposer(SuffixProposer(8, 0.0), HybridProposer.draft_for(mock_draft(), p_min=0.0),
                            draft_cost=0.0, tuning=HybridTuning(lookup_margin=1.0, draft_prior_alpha=0.7))
    engine = Engine(mock_target(), hybrid, 3, debug=True)
    counts = torch.zeros(EV * EV, dtype=torch.long)
    sources = set()
    for seed in range(N_RUNS):
        gen = engine.generate(L_PROMPT, dataclasses.replace(params, seed=seed)).run()
        a, b = gen.token_ids[:2]
        counts[a * EV + b] += 1
        sources |= set(gen.stats.by_proposer)
    assert sources == {"suffix", "draft"}
    assert_lossless(counts.reshape(EV, EV), engine_joint(params, L_PROMPT))


def test_hybrid_prefills_its_draft_only_when_it_drafts():
    prompt = list(COPY_PROMPT)
    state = RequestState(list(prompt), 0, SamplingParams(), (), None, 50)
    plain = DraftModelProposer(MockLM(50, copying_logits(50)))
    plain.reset(state, 200)
    assert plain.draft.seq_len == len(prompt) - 1  # eager: prefilled at reset
    hybrid = HybridProposer(SuffixProposer(8, 0.05), HybridProposer.draft_for(MockLM(50, copying_logits(50))))
    hybrid.reset(state, 200)
    assert hybrid.drafter.draft.seq_len == 0
    tgt = MockLM(50, copying_logits(50))
    params = SamplingParams(max_new_tokens=60)
    expected = Engine(tgt).generate(prompt, params).run().token_ids
    # drafting once: after the first token (the first round never feeds the draft), the
    # draft is fed what it skipped in one catch-up (all but the last committed token, then
    # the last one with the lookup's guess)
    gen, _ = run(tgt, hybrid, 8, prompt, params)
    assert gen.token_ids == expected and gen.stats.by_proposer["suffix+draft"]["num_drafts"] >= 1
    assert hybrid.drafter.draft.forward_sizes[0] == len(prompt)
    # a draft whose prefill is dear next to what the lookup promises is never fed at all
    dear = HybridProposer(SuffixProposer(8, 0.05), HybridProposer.draft_for(MockLM(50, copying_logits(50))),
                          draft_prefill_cost=10.0)
    gen, _ = run(tgt, dear, 8, prompt, params)
    assert gen.token_ids == expected and "draft" not in gen.stats.by_proposer
    assert dear.drafter.draft.forward_sizes == []


@pytest.mark.parametrize("members", ["prompt-lookup+draft", "prompt-lookup+suffix+draft"])
def test_hybrid_combines_any_lookups_with_a_draft(members):
    """Not only suffix + draft model: prompt lookup (its forecast's confidence from its match
    length) or several lookups at once. Greedy output is the target's; each lookup that
    supplied tokens is counted under its own name."""
    tgt = MockLM(50, copying_logits(50))
    params = SamplingParams(max_new_tokens=80)
    expected = Engine(tgt).generate(COPY_PROMPT, params).run().token_ids
    lookups = [PromptLookupProposer()] + ([SuffixProposer(8, 0.05)] if "suffix" in members else [])
    hybrid = HybridProposer(*lookups, HybridProposer.draft_for(random_draft_mock()))
    gen, _ = run(tgt, hybrid, 16, COPY_PROMPT, params)
    assert gen.token_ids == expected
    used = set(gen.stats.by_proposer)
    assert "prompt-lookup" in used or "prompt-lookup+draft" in used
    assert used <= {"prompt-lookup", "suffix", "draft", "prompt-lookup+draft", "suffix+draft"}


def random_draft_mock():
    return MockLM(50, hashed_logits(50, "unrelated"))


@pytest.mark.parametrize("members", [
    lambda: (SuffixProposer(),),  # no draft
    lambda: (HybridProposer.draft_for(random_draft_mock()),),  # no lookup
    lambda: (SuffixProposer(), HybridProposer.draft_for(random_draft_mock()),
             HybridProposer.draft_for(random_draft_mock())),  # two drafts
    lambda: (SuffixProposer(), "draft"),  # not a proposer
])
def test_hybrid_members_are_validated(members):
    with pytest.raises(ValueError, match="hybrid members .* allowed: proposers, at least one free one"):
        HybridProposer(*members())


def test_prompt_lookup_forecast_confidence_follows_the_match_length():
    state = RequestState([1, 2, 3, 4, 9, 1, 2, 3, 4], 0, GREEDY128, (), None, 10)
    lookup_ = PromptLookupProposer()
    lookup_.reset(state, 100)
    fc = lookup_.forecast(state, 3)
    assert fc.tokens == [9, 1, 2]  # the copy of what followed "1 2 3 4"
    p = 4 / 5  # a 4-token match
    assert fc.confidence == pytest.approx([p, p * p, p ** 3])

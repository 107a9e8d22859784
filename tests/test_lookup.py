"""Proposers that need no model (prompt lookup, suffix matching), the hybrid, draft p_min and
the K schedules (TESTPACK §1, 3, 5, 7, 10 for each). Expected outputs always come from plain
decoding of the same target; every engine asserts the cache invariant (debug=True)."""

from __future__ import annotations

import dataclasses
import hashlib
import random

import pytest
import torch

from helpers import MockLM, hashed_logits
from specdecode.config import SamplingParams
from specdecode.methods import SpeculativeConfig
from specdecode.engine import Engine
from specdecode.proposers import (ContinuationCounts, DraftModelProposer, DraftOutput, Forecast,
                                  HybridProposer, HybridTuning, PromptLookupProposer, Proposer,
                                  RequestState, SuffixProposer)
from specdecode.schedule import AutoK, FixedK, HeuristicK
from test_engine import PROMPTS, V, noisy_draft, random_draft, ref, run, target
from test_sampling import EV, N_RUNS, _mock_target, assert_lossless, engine_joint

GREEDY128 = SamplingParams(max_new_tokens=128)


def lookup(kind: str):
    if kind == "lookup-recent":
        return PromptLookupProposer(3, 1, "recent")
    if kind == "lookup-first":
        return PromptLookupProposer(3, 1, "first")
    if kind == "lookup-2-5":
        return PromptLookupProposer(5, 2)
    if kind == "suffix":
        return SuffixProposer(8, 0.05)
    if kind == "hybrid":
        return HybridProposer(SuffixProposer(8, 0.05), HybridProposer.draft_for(noisy_draft()))
    raise ValueError(kind)


KINDS = ["lookup-recent", "lookup-first", "lookup-2-5", "suffix", "hybrid"]


# ----------------------------------------------------------------------------------------
# §1 greedy equality, on the tiny random decoder (rarely repeats) and a copying target
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 5, 8])
@pytest.mark.parametrize("prompt_name", list(PROMPTS))
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equality(kind, prompt_name, k):
    prompt = PROMPTS[prompt_name]
    expected = ref(tuple(prompt), GREEDY128)
    gen, _ = run(target(), lookup(kind), k, prompt, GREEDY128)
    assert gen.token_ids == list(expected) and gen.finish_reason == "length"
    if prompt_name == "repetitive" and kind != "hybrid":
        assert gen.stats.num_draft_tokens > 0  # the lookup really proposed


@pytest.mark.parametrize("schedule", ["heuristic", "auto"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equality_with_k_schedules(kind, schedule):
    prompt = PROMPTS["repetitive"]
    sched = HeuristicK(3, 12) if schedule == "heuristic" else AutoK(_linear_times(17), 16)
    gen, _ = run(target(), lookup(kind), sched, prompt, GREEDY128)
    assert gen.token_ids == list(ref(tuple(prompt), GREEDY128))
    assert max(gen.stats.speculation_lengths) <= (12 if schedule == "heuristic" else 16)


def _linear_times(n, t1=0.2, slope=0.02):
    return [t1 + slope * i for i in range(n)]


PERIOD = 7


def copying_logits(vocab: int, period: int = PERIOD, scale: float = 8.0):
    """A target that continues a text by repeating it with the given period (what a model
    does when it quotes its prompt): the next token is the one ``period`` positions back."""
    def fn(tokens):
        out = torch.zeros(vocab)
        out[tokens[-period] if len(tokens) >= period else (len(tokens) * 31) % vocab] = scale
        return out
    return fn


COPY_PROMPT = [5, 9, 13, 2, 40, 41, 7] * 3 + [11, 12]


def test_lookup_on_copied_text_accepts_nearly_everything():
    """Guard on the proposers themselves: when the target copies its context, a lookup that
    works proposes the right tokens (a broken index would still be lossless, only slow).
    The text changed after its first occurrences (the prompt ends with two new tokens that
    the copy then repeats): the most recent match follows the change, the first one lags —
    why ``match="recent"`` is the default."""
    tgt = MockLM(50, copying_logits(50))
    params = SamplingParams(max_new_tokens=100)
    expected = Engine(tgt).generate(COPY_PROMPT, params).run().token_ids
    tau = {}
    for kind in ("lookup-recent", "lookup-first", "suffix"):
        gen, blocks = run(tgt, lookup(kind), 8, COPY_PROMPT, params)
        assert gen.token_ids == expected
        tau[kind] = gen.stats.mean_acceptance_length
        assert gen.stats.acceptance_rate > 0.9
    assert tau["lookup-recent"] > 7 and tau["suffix"] > 7
    assert tau["lookup-first"] < tau["lookup-recent"] - 1


def test_no_match_proposes_nothing_and_counts_no_drafts():
    """A prompt with no repeated token and a target that only emits new tokens: nothing to
    look up, so no draft is proposed or counted (§10), and the output is plain decoding's."""
    vocab = 400
    fresh = lambda tokens: torch.nn.functional.one_hot(  # noqa: E731
        torch.tensor(max(tokens) + 1), vocab).float() * 5
    tgt = MockLM(vocab, fresh)
    prompt = list(range(20))
    params = SamplingParams(max_new_tokens=60)
    expected = Engine(tgt).generate(prompt, params).run().token_ids
    for kind in ("lookup-recent", "suffix"):
        gen, blocks = run(tgt, lookup(kind), 5, prompt, params)
        assert gen.token_ids == expected
        assert gen.stats.num_draft_tokens == 0 and gen.stats.num_drafts == 0
        assert gen.stats.by_proposer == {} and len(blocks) == 60


# ----------------------------------------------------------------------------------------
# §3 EOS inside a block copied from the prompt; no EOS configured
# ----------------------------------------------------------------------------------------

EOS_PROMPT = [5, 9, 13, 2, 40, 41, 7] * 2 + [5, 9, 13]


@pytest.mark.parametrize("kind", ["lookup-recent", "suffix", "lookup-first"])
@pytest.mark.parametrize("eos_token", [2, 40, 41, 7])
def test_eos_inside_a_copied_block(kind, eos_token):
    """The copying target emits the prompt's period again; declaring one of its tokens EOS
    puts the EOS in the middle of a block the lookup proposes (it is in the prompt): output
    == plain decoding cut at the EOS, finish "stop", nothing after it."""
    tgt = MockLM(50, copying_logits(50))
    params = SamplingParams(max_new_tokens=64)
    plain = Engine(tgt).generate(EOS_PROMPT, params, ()).run().token_ids
    j = plain.index(eos_token)
    gen, blocks = run(tgt, lookup(kind), 8, EOS_PROMPT, params, eos=(eos_token,))
    assert gen.token_ids == plain[:j + 1]
    assert gen.finish_reason == "stop"
    assert gen.stats.num_draft_tokens > 0


@pytest.mark.parametrize("kind", ["lookup-recent", "suffix"])
def test_no_eos_configured_runs_to_max_new_tokens(kind):
    tgt = MockLM(50, copying_logits(50))
    params = SamplingParams(max_new_tokens=77, eos_token_ids=())
    gen, _ = run(tgt, lookup(kind), 8, EOS_PROMPT, params, eos=(2,))
    assert gen.token_ids == Engine(tgt).generate(EOS_PROMPT, params).run().token_ids
    assert len(gen.token_ids) == 77 and gen.finish_reason == "length"


@pytest.mark.parametrize("n", range(1, 20))
def test_max_new_tokens_exact_with_long_copied_blocks(n):
    tgt = MockLM(50, copying_logits(50))
    params = SamplingParams(max_new_tokens=n)
    gen, _ = run(tgt, lookup("lookup-recent"), 8, COPY_PROMPT, params)
    assert gen.token_ids == Engine(tgt).generate(COPY_PROMPT, params).run().token_ids
    assert len(gen.token_ids) == n


# ----------------------------------------------------------------------------------------
# §7 context limit: K clamped, lookups never run past the cache
# ----------------------------------------------------------------------------------------

def test_target_context_limit_with_lookup():
    tgt = MockLM(50, copying_logits(50), max_context=60)
    params = SamplingParams(max_new_tokens=100)
    gen, _ = run(tgt, lookup("lookup-recent"), 8, COPY_PROMPT, params)
    assert len(COPY_PROMPT) + len(gen.token_ids) == 60 and gen.finish_reason == "length"
    assert gen.token_ids == Engine(tgt).generate(COPY_PROMPT, params).run().token_ids


# ----------------------------------------------------------------------------------------
# §5 sampling with point-mass proposals is exactly the target's distribution
# ----------------------------------------------------------------------------------------

L_PROMPT = [2, 3, 1, 2, 3]  # the last token occurred before: the lookups propose [1, 2, ...]


@pytest.mark.parametrize("kind,params", [
    ("lookup-recent", SamplingParams(max_new_tokens=3, temperature=1.0, top_k=4, repetition_penalty=1.2)),
    ("suffix", SamplingParams(max_new_tokens=3, temperature=0.6, top_p=0.9)),
], ids=["lookup-T1-top_k4-rep1.2", "suffix-T0.6-top_p0.9"])
def test_sampled_output_with_point_mass_proposals_follows_target(kind, params):
    engine = Engine(_mock_target(), lookup(kind), 3, debug=True)
    counts = torch.zeros(EV * EV, dtype=torch.long)
    proposed = accepted = 0
    for seed in range(N_RUNS):
        gen = engine.generate(L_PROMPT, dataclasses.replace(params, seed=seed)).run()
        a, b = gen.token_ids[:2]
        counts[a * EV + b] += 1
        proposed += gen.stats.num_draft_tokens
        accepted += gen.stats.num_accepted_tokens
    assert proposed >= N_RUNS and 0 < accepted < proposed  # speculation ran, both outcomes
    assert_lossless(counts.reshape(EV, EV), engine_joint(params, L_PROMPT))


# ----------------------------------------------------------------------------------------
# the index and the counts are what a full rescan would give
# ----------------------------------------------------------------------------------------

def _naive_lookup(tokens, k, max_n, min_n, match):
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        key = tokens[-n:]
        starts = [p for p in range(len(tokens) - n) if tokens[p:p + n] == key]
        if starts:
            pos = (max(starts) if match == "recent" else min(starts)) + n
            m = n  # how far back the text keeps matching the earlier passage
            while m < k and pos - m - 1 >= 0 and tokens[pos - m - 1] == tokens[-m - 1]:
                m += 1
            out = []
            for j in range(pos, pos + min(k, m)):
                out.append(tokens[j] if j < len(tokens) else out[j - len(tokens)])
            return out
    return []


@pytest.mark.parametrize("match", ["recent", "first"])
@pytest.mark.parametrize("ngram", [(1, 3), (2, 4), (1, 1)])
def test_incremental_index_equals_a_rescan(match, ngram):
    rng = random.Random(hash((match, ngram)) % 1000)
    tokens = [rng.randrange(6) for _ in range(5)]
    p = PromptLookupProposer(ngram[1], ngram[0], match)
    state = RequestState(tokens, 0, SamplingParams(), (), None, 10)
    p.reset(state, 10**6)
    for _ in range(300):
        k = rng.randrange(1, 9)
        assert p.propose(state, k).token_ids[0].tolist() == _naive_lookup(tokens, k, ngram[1], ngram[0], match)
        tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]  # commit 1..3 tokens
        p.on_accept(state)


def test_continuation_counts_equal_a_rescan_and_pick_the_most_frequent():
    rng = random.Random(3)
    tokens = [rng.randrange(5) for _ in range(200)]
    counts = ContinuationCounts(4)
    counts.add(tokens[:50])
    counts.add(tokens, 50)  # incremental, as commits arrive
    for m in range(1, 5):
        for p in range(m, len(tokens)):
            ctx = tuple(tokens[p - m:p])
            naive = sum(1 for q in range(m, len(tokens)) if tuple(tokens[q - m:q]) == ctx
                        and tokens[q] == tokens[p])
            total, best, best_n, by_token = counts.table[ctx]
            assert by_token[tokens[p]] == naive
            assert total == sum(by_token.values()) and best_n == max(by_token.values())
            assert by_token[best] == best_n
    s = SuffixProposer(4, 0.0)
    state = RequestState([1, 2, 9, 1, 2, 9, 1, 2, 7, 1, 2], 0, SamplingParams(), (), None, 10)
    s.reset(state, 100)
    # "1 2" was followed by 9 twice and 7 once: 9 is proposed, then the copy goes on
    assert s.propose(state, 1).token_ids.tolist() == [[9]]
    out, conf = s.forecast(state, 4).tokens, s.forecast(state, 4).confidence
    assert out[0] == 9 and all(a >= b for a, b in zip(conf, conf[1:]))


def test_suffix_confidence_sets_the_speculation_length():
    state = RequestState([4, 5, 6, 7, 8, 1, 4, 5], 0, SamplingParams(), (), None, 10)
    strict, loose = SuffixProposer(8, 0.6), SuffixProposer(8, 0.01)
    strict.reset(state, 100)
    loose.reset(state, 100)
    assert 0 < strict.propose(state, 8).token_ids.shape[1] < loose.propose(state, 8).token_ids.shape[1]


def test_suffix_confidence_is_learned_from_outcomes():
    """Proposals that keep failing lower the confidence of their kind of match until none is
    proposed; proposals that keep succeeding raise it (longer proposals). The calibration
    carries over between requests only with the session cache; per request it starts afresh
    (a seeded sampled request must not depend on earlier ones)."""
    def rounds(right: bool, cache: str = "session") -> list[int]:
        s = SuffixProposer(8, 0.2, cache)
        lengths = []
        for _ in range(12):
            state = RequestState([5, 6, 7, 8, 5, 6], 0, SamplingParams(), (), None, 10)
            s.reset(state, 100)
            out = s.propose(state, 6).token_ids[0].tolist()
            lengths.append(len(out))
            state.tokens += out if right else [40]  # the target agrees, or not
            s.on_accept(state)
        return lengths
    failing, succeeding = rounds(False), rounds(True)
    assert failing[0] > 0 and failing[-1] == 0
    assert set(rounds(False, "request")) == {failing[0]}
    assert succeeding[-1] >= succeeding[0] and succeeding[-1] == 6 > failing[0] - 1


def test_suffix_session_cache_uses_earlier_outputs():
    """The second identical request is proposed its own earlier output (not in its prompt)."""
    tgt = target()
    prompt = PROMPTS["twenty"]
    expected = list(ref(tuple(prompt), GREEDY128))
    first = SuffixProposer(16, 0.05, cache="session")
    engine = Engine(tgt, first, 8, debug=True)
    one = engine.generate(prompt, GREEDY128).run()
    two = engine.generate(prompt, GREEDY128).run()
    assert one.token_ids == two.token_ids == expected
    assert two.stats.num_accepted_tokens > one.stats.num_accepted_tokens + 60
    per_request = Engine(tgt, SuffixProposer(16, 0.05), 8).generate(prompt, GREEDY128).run()
    assert per_request.stats.num_accepted_tokens == one.stats.num_accepted_tokens


def test_suffix_session_cache_keeps_only_the_latest_outputs():
    """Past max_session_tokens the oldest outputs leave the session (down to half the cap):
    the counts stay bounded, and what is kept is still proposed."""
    sfx = SuffixProposer(4, 0.0, cache="session", max_session_tokens=40)
    old_text, new_text = [1, 2, 3, 4, 5, 6, 7, 8], [30, 31, 32, 33, 34, 35, 36, 37]

    def request(output):
        state = RequestState([99], 0, GREEDY128, (), None, 100)
        sfx.reset(state, 200)
        state.tokens += output  # as committed by the engine
        sfx.on_accept(state)

    request(old_text)
    for _ in range(5):
        request(new_text)
    request([])  # counts the last output
    def forecast(tokens):
        return sfx.forecast(RequestState(tokens, 0, GREEDY128, (), None, 100), 3).tokens

    assert forecast([50, 1, 2, 3]) == []  # the oldest output was dropped
    assert forecast([50, 30, 31, 32]) == [33, 34, 35]
    assert sum(map(len, sfx._outputs)) <= 40
    sizes = []
    for i in range(30):  # many more requests, each new text: the table stops growing
        request([100 + 8 * i + j for j in range(8)])
        sizes.append(len(sfx.session.table))
    assert max(sizes[10:]) <= max(sizes[:10])


# ----------------------------------------------------------------------------------------
# hybrid: stats per proposer
# ----------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------
# draft p_min
# ----------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------
# a draft reading another proposer's guess
# ----------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------
# K schedules
# ----------------------------------------------------------------------------------------

def test_heuristic_schedule_follows_transformers():
    h = HeuristicK(5, max_k=9)
    seq = []
    for proposed, accepted in [(5, 5), (7, 7), (9, 9), (9, 9), (9, 3), (8, 0), (0, 0), (7, 0),
                               (6, 0), (5, 0), (4, 0), (3, 0), (2, 0), (1, 0), (1, 1)]:
        seq.append(h.next_k())
        h.update(proposed, accepted, 0.0, 0.0)
    assert seq == [5, 7, 9, 9, 9, 8, 7, 7, 6, 5, 4, 3, 2, 1, 1]
    assert h.next_k() == 3
    h.reset()
    assert h.next_k() == 5


def test_auto_expected_tokens_is_leviathans_formula():
    a = AutoK(_linear_times(9), 8, first_alpha=0.7)
    for k in range(9):  # no data: every α_i is the prior 0.7
        assert a.expected_tokens(k) == pytest.approx((1 - 0.7 ** (k + 1)) / (1 - 0.7))


def test_auto_grows_k_when_everything_is_accepted_and_shrinks_when_nothing_is():
    times = _linear_times(17, 0.2, 0.03)
    a = AutoK(times, 16)
    for _ in range(40):
        k = a.next_k()
        a.update(k, k, 0.0, times[k])
    assert a.next_k() == 16
    seen = []
    for _ in range(40):
        k = a.next_k()
        seen.append(k)
        a.update(k, 0, 0.0, times[k])
    # nothing accepted: K falls to 0 (no speculation), probing one token every 8 rounds
    assert seen[-16:].count(0) >= 14 and set(seen[-16:]) <= {0, 1}


def test_auto_k_accounts_for_draft_cost():
    """Each draft accepted with probability 0.7 (given the ones before): a free proposer is
    worth about 6 tokens a round on this cost curve, a draft costing a quarter of T(1) per
    token about 2."""
    times = _linear_times(17, 0.2, 0.005)
    rng = random.Random(0)
    picks = {}
    for per_token in (0.0, 0.05):
        a = AutoK(times, 16)
        for _ in range(400):
            k = a.next_k()
            accepted = 0
            while accepted < k and rng.random() < 0.7:
                accepted += 1
            a.update(k, accepted, per_token * k, times[k])
        picks[per_token] = a.next_k()
    assert 4 <= picks[0.0] <= 9 and 1 <= picks[0.05] <= 3


def test_auto_trims_free_proposals_by_offered_length():
    """Lookups: K is chosen after the proposal is seen, from how proposals of that length
    fared. Long ones that keep being accepted are verified whole; one-token guesses that are
    always wrong are dropped (one probe every 8 rounds) without touching the long ones."""
    times = _linear_times(17, 0.2, 0.01)
    a = AutoK(times, 16)
    assert a.next_k() < 16  # before any lookup: the cost model's K
    for _ in range(30):
        k = a.trim(16)
        a.update(k, k, 0.0, times[k])
        k = a.trim(1)
        a.update(k, 0, 0.0, times[k])
    assert a.next_k() == 16  # a lookup offers everything it has
    assert a.trim(16) == 16 and a.trim(12) == 12  # 8..15 inherits nothing from 16: prior 8/9
    a.update(12, 12, 0.0, times[12])
    ones = []
    for _ in range(16):
        ones.append(a.trim(1))
        a.update(ones[-1], 0, 0.0, times[ones[-1]])
    assert ones.count(0) == 14 and ones.count(1) == 2
    a.reset()
    assert a.next_k() < 16


def test_auto_trims_a_proposal_where_its_acceptance_runs_out():
    """Proposals of 16 whose first 3 tokens are always right and the 4th always wrong: K = 3
    or 4 (the 4th costs one more token of verify pass for nothing, the rest would too)."""
    times = _linear_times(17, 0.2, 0.02)
    a = AutoK(times, 16)
    for _ in range(40):
        k = a.trim(16)
        a.update(k, min(k, 3), 0.0, times[k])
    assert 3 <= a.trim(16) <= 4


def test_engine_trims_only_free_proposals():
    """The engine asks the schedule to trim lookups' proposals, never a draft model's (whose
    tokens are already paid for and whose K the schedule chose before drafting)."""
    class TrimToOne(FixedK):
        calls = 0

        def trim(self, offered):
            TrimToOne.calls += 1
            return 1

    prompt = PROMPTS["repetitive"]
    expected = list(ref(tuple(prompt), GREEDY128))
    gen, _ = run(target(), PromptLookupProposer(), TrimToOne(8), prompt, GREEDY128)
    assert gen.token_ids == expected and TrimToOne.calls > 0
    assert gen.stats.num_draft_tokens == gen.stats.num_drafts == TrimToOne.calls  # one each
    assert gen.stats.speculation_lengths.count(1) == TrimToOne.calls
    TrimToOne.calls = 0
    gen, _ = run(target(), DraftModelProposer(noisy_draft()), TrimToOne(4), prompt, GREEDY128)
    assert gen.token_ids == expected and TrimToOne.calls == 0 and gen.stats.num_draft_tokens > 100


def test_schedules_validate():
    for bad in (0, 65, 2.5, True):
        with pytest.raises(ValueError, match="K"):
            FixedK(bad)
    with pytest.raises(ValueError, match="forward times"):
        AutoK([0.1], 4)


# ----------------------------------------------------------------------------------------
# review gaps: §2 for the hybrid, §3 stops and limits, §4 penalty, §5 seeds and the hybrid,
# §6/§7 a draft that runs out, §10 K per round, error paths
# ----------------------------------------------------------------------------------------

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


def _amortised_run(cost: float, tuning: HybridTuning = HybridTuning()):
    tgt = MockLM(50, hashed_logits(50, "t"))
    prompt = [(i * 7) % 50 for i in range(41)]
    draft = MockLM(50, hashed_logits(50, "t"))  # the target's twin: every draft is accepted
    hybrid = HybridProposer(SuffixProposer(8, 0.99), HybridProposer.draft_for(draft, p_min=0.0),
                            draft_prefill_cost=cost, tuning=tuning)
    params = SamplingParams(max_new_tokens=120)
    gen, _ = run(tgt, hybrid, 6, prompt, params)
    assert gen.token_ids == Engine(tgt).generate(prompt, params).run().token_ids
    first_fed_at = draft.forward_sizes[0] - (len(prompt) - 1) if draft.forward_sizes else None
    return first_fed_at, gen.stats.by_proposer.get("draft", {}).get("num_accepted_tokens", 0)


def test_hybrid_amortises_the_draft_prefill_over_the_answer_so_far():
    """A long prompt's draft prefill is paid only once the answer has gone on long enough to
    spread it (RAG: 800 prompt tokens, a 15-token answer), not over max_new_tokens: before
    that the draft is not fed at all. Numbers (default costs, prior acceptance 0.7): 40
    unseen prompt tokens at 0.12 T(1) each beat plain decoding by cold_margin (10 %) from
    about 35 generated tokens on; spread over max_new_tokens they would from the start. With
    no margin, a draft that beats plain decoding barely is fed at once."""
    first_fed_at, accepted = _amortised_run(0.12)
    assert 25 <= first_fed_at <= 50
    assert accepted >= 0.8 * (120 - first_fed_at)  # then it serves most of the answer
    assert _amortised_run(0.18) == (None, 0)  # dearer: never pays within 120 tokens
    assert _amortised_run(0.12, HybridTuning(cold_margin=1.0))[0] == 0


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
    assert by["num_drafts"] <= 8 and by["num_draft_tokens"] < 3 * by["num_drafts"]


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
    assert by["num_accepted_tokens"] > 100 and hybrid.draft_alpha[0] > 0.8
    # a draft that is never right is tried again less and less often
    never = HybridProposer(SuffixProposer(8, 0.99),
                           HybridProposer.draft_for(MockLM(50, lambda toks: torch.roll(tfn(toks), 1)), p_min=0.0))
    gen, _ = run(tgt, never, 8, prompt, params)
    assert gen.token_ids == Engine(tgt).generate(prompt, params).run().token_ids
    assert 3 <= gen.stats.by_proposer["draft"]["num_drafts"] <= 10  # probes after 8, 16, 32, 64 rounds


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


def _letters(ids):
    return "".join(chr(97 + i % 26) for i in ids)


@pytest.mark.parametrize("start,length", [(13, 4), (16, 3), (3, 2), (2, 1)])
def test_stop_string_inside_a_copied_block(start, length):
    """The copying target writes the prompt's period again; a stop string taken from that
    text falls in the middle of an accepted lookup block, or spans two blocks."""
    tgt = MockLM(50, copying_logits(50))
    text = _letters(Engine(tgt).generate(COPY_PROMPT, SamplingParams(max_new_tokens=60)).run().token_ids)
    stop = text[start:start + length]
    params = SamplingParams(max_new_tokens=60, stop=(stop,))
    plain = Engine(tgt).generate(COPY_PROMPT, params, (), _letters).run()
    assert plain.finish_reason == "stop" and len(plain.token_ids) < 60
    for kind in ("lookup-recent", "suffix"):
        gen, blocks = run(tgt, lookup(kind), 8, COPY_PROMPT, params, decode=_letters)
        assert gen.token_ids == plain.token_ids and gen.finish_reason == "stop"
        assert max(len(b) for b in blocks) > 1  # blocks of several tokens were accepted


def test_several_eos_ids_and_min_new_tokens_with_lookups():
    tgt = MockLM(50, copying_logits(50))
    plain = Engine(tgt).generate(EOS_PROMPT, SamplingParams(max_new_tokens=64)).run().token_ids
    assert plain.index(2) < 10 and plain.index(40) < plain.index(41)
    for params, eos in [(SamplingParams(max_new_tokens=64), (41, 40)),
                        (SamplingParams(max_new_tokens=64, min_new_tokens=10), (2,))]:
        expected = Engine(tgt).generate(EOS_PROMPT, params, eos).run()
        for kind in ("lookup-recent", "suffix"):
            gen, _ = run(tgt, lookup(kind), 8, EOS_PROMPT, params, eos=eos)
            assert gen.token_ids == expected.token_ids and gen.finish_reason == expected.finish_reason
    # the first of the two EOS ids ends it; min_new_tokens masks the EOS the copy would emit
    # at token 1, so the lookup's proposals (which contain it) must be rejected there
    assert len(Engine(tgt).generate(EOS_PROMPT, SamplingParams(max_new_tokens=64), (41, 40)).run()
               .token_ids) == plain.index(40) + 1
    masked = Engine(tgt).generate(EOS_PROMPT, SamplingParams(max_new_tokens=64, min_new_tokens=10), (2,)).run()
    assert 2 not in masked.token_ids[:10]


@pytest.mark.parametrize("kind", ["lookup-recent", "suffix", "hybrid"])
def test_greedy_repetition_penalty_with_lookups(kind):
    prompt = PROMPTS["repetitive"]
    params = SamplingParams(max_new_tokens=100, repetition_penalty=1.4)
    expected = Engine(target()).generate(prompt, params).run().token_ids
    assert expected != list(ref(tuple(prompt), SamplingParams(max_new_tokens=100)))  # it matters
    gen, _ = run(target(), lookup(kind), 5, prompt, params)
    assert gen.token_ids == expected


def _sampled_runs(make_engine, seeds, fresh: bool):
    engine = make_engine()
    out = []
    for seed in seeds:
        e = make_engine() if fresh else engine
        out.append(e.generate(PROMPTS["repetitive"], SamplingParams(
            max_new_tokens=60, temperature=0.9, seed=seed)).run().token_ids)
    return out


@pytest.mark.parametrize("make", [
    lambda: Engine(target(), HybridProposer(SuffixProposer(8, 0.05), HybridProposer.draft_for(noisy_draft())), 4),
    lambda: Engine(target(), PromptLookupProposer(), AutoK(_linear_times(17), 16)),
    lambda: Engine(target(), DraftModelProposer(noisy_draft()), AutoK(_linear_times(17), 16, 0.01)),
    lambda: Engine(target(), SuffixProposer(8, 0.05), HeuristicK(4)),
], ids=["hybrid", "lookup-auto", "draft-auto", "suffix-heuristic"])
def test_same_seed_same_output_with_adaptive_choices(make):
    """K and the hybrid's choice change which random draws a round makes: with a seed they
    must not depend on the clock or on earlier requests."""
    a = _sampled_runs(make, [1, 2, 1], fresh=False)
    b = _sampled_runs(make, [1, 2, 1], fresh=True)
    assert a[0] == a[2] == b[0] == b[2] and a[1] == b[1] and a[0] != a[1]


def test_hybrid_sampled_output_follows_target():
    """Rounds from the lookup (point masses) and from a draft model (its distribution) mixed
    in one request: the joint of the first two tokens is the target's."""
    from test_sampling import _mock_draft

    params = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=5)
    # here the lookup must win some rounds against a free draft: no margin
    hybrid = HybridProposer(SuffixProposer(8, 0.0), HybridProposer.draft_for(_mock_draft(), p_min=0.0),
                            draft_cost=0.0, tuning=HybridTuning(lookup_margin=1.0))
    engine = Engine(_mock_target(), hybrid, 3, debug=True)
    counts = torch.zeros(EV * EV, dtype=torch.long)
    sources = set()
    for seed in range(N_RUNS):
        gen = engine.generate(L_PROMPT, dataclasses.replace(params, seed=seed)).run()
        a, b = gen.token_ids[:2]
        counts[a * EV + b] += 1
        sources |= set(gen.stats.by_proposer)
    assert sources == {"suffix", "draft"}
    assert_lossless(counts.reshape(EV, EV), engine_joint(params, L_PROMPT))


def test_speculation_lengths_count_rounds_without_speculation():
    """A proposer that is always wrong: auto K falls to 0 (no speculation) in most rounds, and
    those rounds count in the mean K."""
    from helpers import ScriptedProposer

    prompt = PROMPTS["twenty"]
    expected = list(ref(tuple(prompt), GREEDY128))
    gen, blocks = run(target(), ScriptedProposer(len(prompt), expected, V, right=0),
                      AutoK(_linear_times(17, 0.2, 0.05), 16), prompt, GREEDY128)
    assert gen.token_ids == expected
    lengths = gen.stats.speculation_lengths
    assert len(lengths) == len(blocks) and lengths.count(0) > len(lengths) // 2
    assert gen.stats.to_dict()["mean_speculation_length"] == pytest.approx(sum(lengths) / len(lengths), abs=1e-3)


class _BadIds(Proposer):
    name = "bad"

    def propose(self, state, k):
        return DraftOutput.point_mass([1, V + 5][:k], "bad")


def test_engine_rejects_bad_schedules_and_out_of_vocabulary_proposals():
    for bad in ("auto", 4.0, True, 0, 65):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            Engine(target(), PromptLookupProposer(), bad)
    Engine(target(), None, None)  # plain decoding needs no K
    with pytest.raises(ValueError, match=f"outside the target's vocabulary \\[0, {V}\\)"):
        Engine(target(), _BadIds(), 4).generate([1, 2, 3], GREEDY128).run()


def test_verify_profile_busy_model_and_bad_cache_files(tmp_path, monkeypatch):
    from specdecode.models import LoadedModel
    from specdecode import profile as schedule
    from specdecode.profile import verify_profile

    monkeypatch.setattr(schedule, "PROFILE_DIR", tmp_path)
    model = LoadedModel(MockLM(30, hashed_logits(30), max_context=64), name="mock")
    busy = Engine(model.lm).generate([1, 2, 3], SamplingParams(max_new_tokens=5))
    next(iter(busy))  # paused mid-request: its KV cache is in use
    with pytest.raises(RuntimeError, match="generating another request"):
        verify_profile(model, 4)
    busy.close()
    before = len(model.lm.forward_sizes)
    times = verify_profile(model, 4)
    assert len(times) == 5 and model.lm.forward_sizes[before] == 64 - 5  # context fits the model
    (path,) = tmp_path.glob("*.json")
    for junk in ("[]", "null", '{"forward_seconds": [0, 0, 0, 0, 0]}', "{not json"):
        path.write_text(junk)
        fresh = LoadedModel(MockLM(30, hashed_logits(30), max_context=64), name="mock")
        again = verify_profile(fresh, 4)
        assert len(again) == 5 and all(t > 0 for t in again) and fresh.lm.forward_sizes  # measured


def test_inapplicable_options_raise():
    from specdecode.config import KSchedule
    from specdecode.methods import SpeculativeConfig

    with pytest.raises(ValueError, match="suffix_cache applies"):
        SpeculativeConfig("draft", suffix_cache="session")
    with pytest.raises(ValueError, match="n-gram sizes .* apply to 'prompt-lookup', not 'suffix'"):
        SpeculativeConfig("suffix", max_ngram=4)
    with pytest.raises(ValueError, match="max_speculative_tokens caps K"):
        SpeculativeConfig("draft", 4, KSchedule.FIXED, 8)
    with pytest.raises(ValueError, match="draft_p_min applies to 'draft' and 'hybrid'"):
        SpeculativeConfig("suffix", draft_p_min=0.5)


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
    # drafting once: the draft is fed what it skipped in one catch-up (all but the last
    # token, then the last alone, as an eager prefill would), then one a round
    gen, _ = run(tgt, hybrid, 8, prompt, params)
    assert gen.token_ids == expected and gen.stats.by_proposer["draft"]["num_drafts"] >= 1
    assert hybrid.drafter.draft.forward_sizes[:2] == [len(prompt) - 1, 1]
    # a draft whose prefill is dear next to what the lookup promises is never fed at all
    dear = HybridProposer(SuffixProposer(8, 0.05), HybridProposer.draft_for(MockLM(50, copying_logits(50))),
                          draft_prefill_cost=10.0)
    gen, _ = run(tgt, dear, 8, prompt, params)
    assert gen.token_ids == expected and "draft" not in gen.stats.by_proposer
    assert dear.drafter.draft.forward_sizes == []


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

"""Proposers that need no model: prompt lookup and suffix matching, and the lookup kinds
through the engine (greedy equality, events inside an accepted block, the sampling
distribution and context limits for each, docs/testing.md; the hybrid is among the kinds).
Expected outputs always come from plain decoding of the same target; every engine asserts
the cache invariant (debug=True)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from helpers import MockLM
from specdecode.config import SamplingParams
from specdecode.engine import Engine
from specdecode.proposers import (ContinuationCounts, DraftModelProposer, HybridProposer,
                                  PromptLookupProposer, RequestState, SuffixProposer)
from specdecode.schedule import AutoK, HeuristicK
from helpers import PROMPTS, noisy_draft, ref, run, target
from lossless import EV, N_RUNS, assert_lossless, engine_joint, mock_target
from lookups import (COPY_PROMPT, EOS_PROMPT, GREEDY128, KINDS, L_PROMPT, copying_logits,
                     linear_times, lookup)


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
    sched = HeuristicK(3, 12) if schedule == "heuristic" else AutoK(linear_times(17), 16)
    gen, _ = run(target(), lookup(kind), sched, prompt, GREEDY128)
    assert gen.token_ids == list(ref(tuple(prompt), GREEDY128))
    assert max(gen.stats.speculation_lengths) <= (12 if schedule == "heuristic" else 16)


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
    look up, so no draft is proposed or counted, and the output is plain decoding's."""
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
        # nothing proposed: mean K 0 (it said 9.2 for prompt lookup on "Hello": the K asked for)
        assert gen.stats.to_dict()["mean_speculation_length"] == 0


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


def test_target_context_limit_with_lookup():
    tgt = MockLM(50, copying_logits(50), max_context=60)
    params = SamplingParams(max_new_tokens=100)
    gen, _ = run(tgt, lookup("lookup-recent"), 8, COPY_PROMPT, params)
    assert len(COPY_PROMPT) + len(gen.token_ids) == 60 and gen.finish_reason == "length"
    assert gen.token_ids == Engine(tgt).generate(COPY_PROMPT, params).run().token_ids


@pytest.mark.slow
@pytest.mark.parametrize("kind,params", [
    ("lookup-recent", SamplingParams(max_new_tokens=3, temperature=1.0, top_k=4, repetition_penalty=1.2)),
    ("suffix", SamplingParams(max_new_tokens=3, temperature=0.6, top_p=0.9)),
], ids=["lookup-T1-top_k4-rep1.2", "suffix-T0.6-top_p0.9"])
def test_sampled_output_with_point_mass_proposals_follows_target(kind, params):
    engine = Engine(mock_target(), lookup(kind), 3, debug=True)
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
    lambda: Engine(target(), PromptLookupProposer(), AutoK(linear_times(17), 16)),
    lambda: Engine(target(), DraftModelProposer(noisy_draft()), AutoK(linear_times(17), 16, 0.01)),
    lambda: Engine(target(), SuffixProposer(8, 0.05), HeuristicK(4)),
], ids=["hybrid", "lookup-auto", "draft-auto", "suffix-heuristic"])
def test_same_seed_same_output_with_adaptive_choices(make):
    """K and the hybrid's choice change which random draws a round makes: with a seed they
    must not depend on the clock or on earlier requests."""
    a = _sampled_runs(make, [1, 2, 1], fresh=False)
    b = _sampled_runs(make, [1, 2, 1], fresh=True)
    assert a[0] == a[2] == b[0] == b[2] and a[1] == b[1] and a[0] != a[1]

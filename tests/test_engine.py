"""The speculative loop, on tiny fp32 decoders and mock models: greedy equality, a draft
equal to its target, events inside an accepted block, the repetition penalty, context
limits and vocabulary sizes, metrics (the fault kinds of docs/testing.md).

Every engine runs with ``debug=True`` (the cache invariant is asserted after every round).
Expected outputs are always derived from plain decoding of the same target (``reference``),
never hard-coded.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from helpers import (PROMPTS, V, MockLM, randint, ScriptedProposer, hashed_logits, noisy_draft, random_draft,
                     ref, reference, run, target, tiny_model)
from specdecode.config import SamplingParams
from specdecode.engine import Engine
from specdecode.stats import SpecDecodingStats
from specdecode.proposers import DraftModelProposer, DraftOutput, PromptLookupProposer, Proposer

def make_proposer(kind, prompt, script, k):
    if kind == "random-draft":
        return DraftModelProposer(random_draft())
    if kind == "noisy-draft":
        return DraftModelProposer(noisy_draft())
    if kind == "same-model-draft":
        return DraftModelProposer(target().fork())
    if kind == "all-right":
        return ScriptedProposer(len(prompt), list(script), V, right=None)
    if kind == "all-wrong":
        return ScriptedProposer(len(prompt), list(script), V, right=0)
    if kind == "right-half":
        return ScriptedProposer(len(prompt), list(script), V, right=k // 2)
    raise ValueError(kind)


class Recording(Proposer):
    """Wraps a proposer and records how many draft tokens each propose() really returned."""

    name = "recording"

    def __init__(self, inner):
        self.inner = inner
        self.proposed: list[int] = []

    def models(self):
        return self.inner.models()

    def check_invariant(self, state):
        self.inner.check_invariant(state)

    def reset(self, state, max_total_len):
        self.inner.reset(state, max_total_len)

    def propose(self, state, k):
        out = self.inner.propose(state, k)
        assert out.token_ids.shape[0] == 1 and out.token_ids.shape[1] <= k
        self.proposed.append(out.token_ids.shape[1])
        return out

    def on_accept(self, state):
        self.inner.on_accept(state)


GREEDY128 = SamplingParams(max_new_tokens=128)


# ----------------------------------------------------------------------------------------
# greedy equality
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 5, 8])
@pytest.mark.parametrize("prompt_name", list(PROMPTS))
@pytest.mark.parametrize("kind", ["random-draft", "noisy-draft", "same-model-draft",
                                  "all-right", "all-wrong", "right-half"])
def test_greedy_equality(kind, prompt_name, k):
    prompt = PROMPTS[prompt_name]
    expected = ref(tuple(prompt), GREEDY128)
    assert len(expected) == 128
    gen, blocks = run(target(), make_proposer(kind, prompt, expected, k), k, prompt, GREEDY128)
    assert gen.token_ids == list(expected)
    assert gen.finish_reason == "length"
    s = gen.stats
    assert s.num_draft_tokens > 0
    if kind == "all-right":
        assert s.acceptance_rate == 1.0
    if kind == "all-wrong":
        assert s.num_accepted_tokens == 0 and max(len(b) for b in blocks) == 1
    if kind == "right-half":
        assert s.num_accepted_tokens == (k // 2) * (len(blocks) - 1) + (len(blocks[-1]) - 1)


def test_greedy_equality_noisy_draft_mixes_accepts_and_rejects():
    """Guard on the test itself: the noisy draft really exercises partial acceptance."""
    prompt = tuple(PROMPTS["twenty"])
    gen, blocks = run(target(), DraftModelProposer(noisy_draft()), 5, prompt, GREEDY128)
    assert 0.2 < gen.stats.acceptance_rate < 0.9
    assert len({len(b) for b in blocks}) >= 4


# ----------------------------------------------------------------------------------------
# draft == target
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_same_model_draft_every_round_emits_k_plus_1(k):
    n = 131
    prompt = tuple(PROMPTS["twenty"])
    gen, blocks = run(target(), DraftModelProposer(target().fork()), k, prompt,
                      SamplingParams(max_new_tokens=n))
    assert gen.token_ids == list(ref(tuple(prompt), SamplingParams(max_new_tokens=n)))
    assert len(gen.token_ids) == n and gen.finish_reason == "length"
    assert all(len(b) == k + 1 for b in blocks[:-1])
    assert len(blocks) == math.ceil(n / (k + 1))
    s = gen.stats
    assert s.acceptance_rate == 1.0
    assert s.num_accepted_tokens == s.num_draft_tokens == n - len(blocks)
    assert s.mean_acceptance_length == pytest.approx(n / len(blocks))


LONG_RUN_PROMPT = randint(20, 8)


def _min_top2_gap(prompt, tokens):
    """Smallest gap between the two largest logits along a greedy trajectory (one forward)."""
    m = tiny_model(0)
    seq = list(prompt) + list(tokens)
    m.allocate(1, len(seq))
    top = m.forward(torch.tensor([seq[:-1]]))[0, len(prompt) - 1:].topk(2).values
    return (top[:, 0] - top[:, 1]).min().item()


def test_same_model_draft_acceptance_does_not_decay_over_600_tokens():
    k, n = 4, 600
    prompt = LONG_RUN_PROMPT
    # test setup: no near-tie that fp32 rounding of a 1- vs 5-token forward could flip
    assert _min_top2_gap(prompt, ref(tuple(prompt), SamplingParams(max_new_tokens=n))) > 1e-3
    gen, blocks = run(target(), DraftModelProposer(target().fork()), k, prompt,
                      SamplingParams(max_new_tokens=n))
    assert gen.token_ids == list(ref(tuple(prompt), SamplingParams(max_new_tokens=n)))
    assert len(gen.token_ids) == n
    full = blocks[:-1]
    assert all(len(b) == k + 1 for b in full)
    # the rounds that produced the last 100 tokens accepted everything
    tail, count = [], 0
    for b in reversed(full):
        tail.append(len(b) - 1)
        count += len(b)
        if count >= 100:
            break
    assert tail and all(a == k for a in tail)
    # per position: every full round accepted it, the last (clamped) round its first L-1
    last = len(blocks[-1])
    assert gen.stats.accepted_per_position == [len(full) + (i < last - 1) for i in range(k)]


def test_same_model_draft_sampled_acceptance_is_total():
    """Sampled (T = 0.8, top-k, top-p, repetition penalty, min_new_tokens) with a mock model as
    its own draft: draft and target logits are bit-identical, so p == q and every draft must be
    accepted — any difference in how the draft and the verify pass process logits (temperature,
    filters, penalty context, EOS mask) shows as a rejection."""
    k, n = 4, 300
    v = 24
    tgt = MockLM(v, hashed_logits(v, "same", scale=2.0, window=2))
    params = SamplingParams(max_new_tokens=n, temperature=0.8, top_k=12, top_p=0.95,
                            repetition_penalty=1.3, min_new_tokens=150, seed=3)
    gen, blocks = run(tgt, DraftModelProposer(tgt.fork()), k, [1, 2, 3], params, eos=(0,))
    assert len(gen.token_ids) > 150 and 0 not in gen.token_ids[:150]
    assert all(len(b) == k + 1 for b in blocks[:-1])
    s = gen.stats
    assert s.num_draft_tokens == k * len(blocks)
    # all accepted; a block cut by EOS counts only the drafts that reached the output
    assert s.num_accepted_tokens == sum(min(k, len(b)) for b in blocks)
    if gen.finish_reason == "length" or len(blocks[-1]) > k:
        assert s.acceptance_rate == 1.0


def test_same_tiny_model_draft_sampled_keeps_accepting():
    k, n = 4, 520
    prompt = LONG_RUN_PROMPT
    gen, blocks = run(target(), DraftModelProposer(target().fork()), k, prompt,
                      SamplingParams(max_new_tokens=n, temperature=1.0, seed=0))
    assert len(gen.token_ids) == n
    assert gen.stats.acceptance_rate > 0.99
    assert sum(len(b) == k + 1 for b in blocks[-25:-1]) >= 23


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("prompt_name,k", [("twenty", 4), ("twenty", 8), ("long", 5), ("twenty", 64)])
def test_one_token_forward_equals_first_row_of_verify_forward(prompt_name, k, pack):
    """Logits for position t: a 1-token forward vs row 0 of a (K+1)-token forward (the verify
    pass), at many cache offsets; every row of the block vs its own 1-token forward."""
    model = tiny_model(0, pack=pack)
    prompt = PROMPTS[prompt_name]
    seq = list(prompt) + list(ref(tuple(prompt), GREEDY128))
    p, m = len(prompt), 40 + k
    model.allocate(1, p + m + 1)
    model.forward(torch.tensor([prompt[:-1]]), num_logits=0)
    singles = torch.cat([model.forward(torch.tensor([[seq[i]]]))[0] for i in range(p - 1, p - 1 + m)])
    model.allocate(1, p + m + 1)
    model.forward(torch.tensor([prompt[:-1]]), num_logits=0)
    for pos in range(p - 1, p - 1 + m - k):
        block = model.forward(torch.tensor([seq[pos:pos + k + 1]]))[0]
        assert block.shape == (k + 1, V)
        want = singles[pos - (p - 1): pos - (p - 1) + k + 1]
        torch.testing.assert_close(block[0], want[0], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(block, want, rtol=1e-5, atol=1e-4)
        assert torch.equal(block.argmax(-1), want.argmax(-1))
        model.rollback(pos + 1)  # keep one token, as after a rejection at position 0


# ----------------------------------------------------------------------------------------
# events inside an accepted block
# ----------------------------------------------------------------------------------------

EVENT_PROMPT = PROMPTS["twenty"]


def _first_appearances(seq, upto):
    return [j for j in range(min(upto, len(seq))) if seq[j] not in seq[:j]]


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("kind", ["all-right", "same-model-draft"])
def test_eos_at_every_position_of_a_block(kind, k):
    g = list(ref(tuple(EVENT_PROMPT), SamplingParams(max_new_tokens=60)))
    js = _first_appearances(g, 3 * k + 3)
    assert {j % (k + 1) for j in js} == set(range(k + 1)), "test setup: cover every offset"
    for j in js:
        eos = (g[j],)
        params = SamplingParams(max_new_tokens=60)
        assert list(ref(tuple(EVENT_PROMPT), params, eos)) == g[: j + 1]
        gen, blocks = run(target(), make_proposer(kind, EVENT_PROMPT, g, k), k, EVENT_PROMPT,
                          params, eos)
        assert gen.token_ids == g[: j + 1], j
        assert gen.finish_reason == "stop"
        s = gen.stats
        assert s.num_generated_tokens == j + 1
        # every round proposed K (all right); accepted counts only drafts that reached the output
        assert s.num_draft_tokens == k * len(blocks)
        assert s.num_accepted_tokens == sum(min(k, len(b)) for b in blocks)
        assert all(len(b) == k + 1 for b in blocks[:-1])
        # an EOS on an accepted draft token ends its block without a bonus token: tokens per
        # verify pass, not 1 + accepted / passes (which said 2.0 for 1 token in 1 pass)
        assert s.mean_acceptance_length == pytest.approx((j + 1) / len(blocks)), j


def test_several_eos_ids_and_unused_ids():
    k = 4
    g = list(ref(tuple(EVENT_PROMPT), SamplingParams(max_new_tokens=60)))
    js = _first_appearances(g, 40)
    unused = next(t for t in range(V) if t not in g)
    for j1, j2 in [(js[3], js[7]), (js[6], js[4]), (js[9], js[10])]:
        eos = (g[j1], unused, g[j2])
        first = min(j1, j2)
        for proposer in (make_proposer("all-right", EVENT_PROMPT, g, k),
                         DraftModelProposer(target().fork())):
            gen, _ = run(target(), proposer, k, EVENT_PROMPT, SamplingParams(max_new_tokens=60), eos)
            assert gen.token_ids == g[: first + 1] and gen.finish_reason == "stop"
        # given in SamplingParams instead of to generate(): same
        gen, _ = run(target(), DraftModelProposer(target().fork()), k, EVENT_PROMPT,
                     SamplingParams(max_new_tokens=60, eos_token_ids=eos))
        assert gen.token_ids == g[: first + 1] and gen.finish_reason == "stop"


def test_no_eos_configured_runs_to_max_new_tokens():
    k, n = 4, 60
    g = list(ref(tuple(EVENT_PROMPT), SamplingParams(max_new_tokens=n)))
    for proposer in (make_proposer("all-right", EVENT_PROMPT, g, k), DraftModelProposer(target().fork())):
        gen, _ = run(target(), proposer, k, EVENT_PROMPT, SamplingParams(max_new_tokens=n), ())
        assert gen.token_ids == g and gen.finish_reason == "length"
    # SamplingParams.eos_token_ids=() means "no EOS at all", overriding the engine's default
    gen, _ = run(target(), DraftModelProposer(target().fork()), k, EVENT_PROMPT,
                 SamplingParams(max_new_tokens=n, eos_token_ids=()), (g[3],))
    assert gen.token_ids == g and gen.finish_reason == "length"
    # and an explicit list in SamplingParams replaces the default
    j = _first_appearances(g, 60)[8]
    gen, _ = run(target(), DraftModelProposer(target().fork()), k, EVENT_PROMPT,
                 SamplingParams(max_new_tokens=n, eos_token_ids=(g[j],)), (g[3],))
    assert gen.token_ids == g[: j + 1] and gen.finish_reason == "stop"


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("kind", ["all-right", "same-model-draft", "all-wrong", "right-half",
                                  "noisy-draft"])
def test_max_new_tokens_every_value(kind, k):
    g = list(ref(tuple(EVENT_PROMPT), SamplingParams(max_new_tokens=3 * k + 1)))
    for m in range(1, 3 * k + 2):
        params = SamplingParams(max_new_tokens=m)
        gen, blocks = run(target(), make_proposer(kind, EVENT_PROMPT, g, k), k, EVENT_PROMPT, params)
        assert gen.token_ids == g[:m], m
        assert gen.finish_reason == "length"
        assert gen.stats.num_generated_tokens == m
        if kind in ("all-right", "same-model-draft"):
            assert len(blocks) == math.ceil(m / (k + 1))


@pytest.mark.parametrize("k", [2, 4])
def test_eos_in_the_block_that_reaches_max_new_tokens_is_stop(k):
    g = list(ref(tuple(EVENT_PROMPT), SamplingParams(max_new_tokens=40)))
    for j in _first_appearances(g, 2 * k + 2):
        for m in range(j + 1, j + k + 2):
            for proposer in (make_proposer("all-right", EVENT_PROMPT, g, k),
                             DraftModelProposer(target().fork())):
                gen, _ = run(target(), proposer, k, EVENT_PROMPT, SamplingParams(max_new_tokens=m),
                             (g[j],))
                assert gen.token_ids == g[: j + 1], (j, m)
                assert gen.finish_reason == "stop", (j, m)


EOS = 0


def _eos_loving_mock(v=16):
    """A mock LM whose argmax is EOS (0) at every step, by a wide margin."""
    base = hashed_logits(v, "eos", scale=1.0, window=2)

    def fn(tokens):
        logits = base(tokens).clone()
        logits[EOS] = 20.0
        return logits
    return MockLM(v, fn)


@pytest.mark.parametrize("k", [2, 4])
def test_min_new_tokens_masks_eos_for_exactly_m_tokens(k):
    mock = _eos_loving_mock()
    prompt = [3, 5, 7]
    for m in range(0, 3 * k + 2):
        params = SamplingParams(max_new_tokens=50, min_new_tokens=m)
        plain = reference(mock, prompt, params, (EOS,)).token_ids
        assert len(plain) == m + 1 and plain[-1] == EOS and EOS not in plain[:-1]
        for proposer in (DraftModelProposer(mock.fork()),
                         ScriptedProposer(len(prompt), plain, 16, right=None),
                         ScriptedProposer(len(prompt), plain, 16, right=0)):
            gen, blocks = run(mock, proposer, k, prompt, params, (EOS,))
            assert gen.token_ids == plain, m
            assert gen.finish_reason == "stop"
        # sampled: EOS has probability 0 before m tokens, and ~1 afterwards
        gen, _ = run(mock, DraftModelProposer(mock.fork()), k, prompt,
                     dataclasses.replace(params, temperature=1.0, seed=m), (EOS,))
        assert len(gen.token_ids) == m + 1 and gen.token_ids[-1] == EOS and EOS not in gen.token_ids[:-1]


def letters(ids):
    return "".join(chr(65 + i % 26) for i in ids)


def words(ids):
    return "".join(f"w{i} " for i in ids)


def _stop_index(g, decode, stops):
    """The generated-token index at which a stop string first appears in the text."""
    for i in range(len(g)):
        if any(s in decode(g[: i + 1]) for s in stops):
            return i
    return None


@pytest.mark.parametrize("kind", ["all-right", "same-model-draft"])
def test_stop_strings_inside_and_across_blocks(kind):
    k = 8
    n = 90
    g = list(ref(tuple(EVENT_PROMPT), SamplingParams(max_new_tokens=n)))
    text = letters(g)
    cases = []
    # (a) starts at the first token of a long accepted block, ends early in it
    for r in range(1, 8):
        s = r * (k + 1)
        hit = next((length for length in (2, 3, 4) if text.find(text[s:s + length]) == s), None)
        if hit:
            cases.append(("early-in-block", (text[s:s + hit],), letters, s + hit - 1))
            break
    # (b) spans the boundary of two blocks
    for r in range(1, 8):
        s = r * (k + 1) - 1
        hit = next((length for length in (2, 3, 4) if text.find(text[s:s + length]) == s), None)
        if hit:
            cases.append(("across-blocks", (text[s:s + hit],), letters, s + hit - 1))
            break
    # (c) multi-character tokens: the tail of one token's text and the head of the next
    wtext = [f"w{i} " for i in g]
    for s in range(k + 2, 5 * (k + 1)):
        stop = wtext[s][1:] + wtext[s + 1][:2]
        if _stop_index(g, words, (stop,)) == s + 1:
            cases.append(("across-tokens", (stop,), words, s + 1))
            break
    assert [c[0] for c in cases] == ["early-in-block", "across-blocks", "across-tokens"]
    early = cases[0]
    assert early[3] % (k + 1) < k - 2  # the stop completes early, the block goes on
    # (d) two stop strings: the earlier one wins
    late = (text[70:73],)
    cases.append(("two-stops", late + early[1], letters, _stop_index(g, letters, late + early[1])))
    for name, stops, decode, want in cases:
        assert want is not None and want == _stop_index(g, decode, stops), name
        gen, blocks = run(target(), make_proposer(kind, EVENT_PROMPT, g, k), k, EVENT_PROMPT,
                          SamplingParams(max_new_tokens=n, stop=stops), decode=decode)
        assert gen.token_ids == g[: want + 1], name
        assert gen.finish_reason == "stop", name
        assert gen.stats.num_generated_tokens == want + 1


def test_stop_string_at_the_last_allowed_token_is_stop():
    k = 4
    g = list(ref(tuple(EVENT_PROMPT), SamplingParams(max_new_tokens=40)))
    text = letters(g)
    s = next(i for i in range(5, 30) if text.find(text[i:i + 3]) == i)
    want = s + 2
    for m in (want + 1, want + 2):
        for proposer in (make_proposer("all-right", EVENT_PROMPT, g, k), DraftModelProposer(target().fork())):
            gen, _ = run(target(), proposer, k, EVENT_PROMPT,
                         SamplingParams(max_new_tokens=m, stop=(text[s:s + 3],)), decode=letters)
            assert gen.token_ids == g[: want + 1] and gen.finish_reason == "stop"


UTF8_TEXT = "Hi \u2603 snow, \u2603! \u65e5\u672c\u8a9e ok \U0001f600 done"


def _byte_mock(data: bytes, prompt_len: int):
    """Greedy output: the bytes of ``data`` (vocab 256, one byte per token)."""
    def fn(tokens):
        idx = len(tokens) - prompt_len
        logits = torch.zeros(256)
        logits[data[idx] if idx < len(data) else 32] = 10.0
        return logits
    return MockLM(256, fn)


def utf8(ids):
    return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("k", [4, 8])
def test_stop_strings_with_multibyte_characters_split_across_tokens(k):
    """Byte tokens: a character's bytes span tokens (and blocks); partial characters decode
    as U+FFFD and must neither match nor hide a stop string."""
    data = UTF8_TEXT.encode()
    prompt = [72, 105]
    mock = _byte_mock(data, len(prompt))
    g = list(data) + [32] * 10
    for stop in ("\u2603!", "\u672c", "w, \u2603", "\U0001f600 d", "\u8a9e o"):
        sb = stop.encode()
        want = data.find(sb) + len(sb) - 1
        assert _stop_index(g, utf8, (stop,)) == want
        for proposer in (ScriptedProposer(len(prompt), g, 256),
                         DraftModelProposer(mock.fork())):
            gen, _ = run(mock, proposer, k, prompt,
                         SamplingParams(max_new_tokens=len(data) + 5, stop=(stop,)), decode=utf8)
            assert gen.token_ids == g[: want + 1], stop
            assert gen.finish_reason == "stop"
            assert "\ufffd" not in utf8(gen.token_ids)


def test_one_engine_serves_requests_of_different_lengths():
    """Caches are reallocated / reset between requests: each equals its own reference."""
    engine = Engine(target(), DraftModelProposer(noisy_draft()), 5, debug=True)
    for name in ("long", "one", "twenty", "long", "repetitive", "one"):
        prompt = PROMPTS[name]
        params = SamplingParams(max_new_tokens=40)
        gen = engine.generate(prompt, params).run()
        assert gen.token_ids == list(ref(tuple(prompt), params)), name
        assert gen.stats.num_draft_tokens > 0


def test_stop_strings_need_decode():
    with pytest.raises(ValueError):
        Engine(target(), None, debug=True).generate([1, 2], SamplingParams(stop=("x",)))


# ----------------------------------------------------------------------------------------
# repetition penalty: a rejected draft leaves no trace
# ----------------------------------------------------------------------------------------

PENALTIES = [0.7, 1.3, 2.0]


@pytest.mark.parametrize("penalty", PENALTIES)
@pytest.mark.parametrize("kind", ["all-wrong", "right-half", "random-draft", "noisy-draft",
                                  "same-model-draft"])
def test_repetition_penalty_speculative_equals_plain(kind, penalty):
    k = 4
    prompt = PROMPTS["repetitive"]
    params = SamplingParams(max_new_tokens=96, repetition_penalty=penalty)
    expected = list(ref(tuple(prompt), params))
    gen, _ = run(target(), make_proposer(kind, prompt, expected, k), k, prompt, params)
    assert gen.token_ids == expected
    assert gen.stats.num_draft_tokens > 0


def test_different_penalties_give_different_outputs():
    k = 4
    prompt = PROMPTS["repetitive"]
    outs = []
    for penalty in [1.0] + PENALTIES:
        params = SamplingParams(max_new_tokens=64, repetition_penalty=penalty)
        gen, _ = run(target(), DraftModelProposer(noisy_draft()), k, prompt, params)
        assert gen.token_ids == list(ref(tuple(prompt), params))
        outs.append(tuple(gen.token_ids))
    assert len(set(outs)) == len(outs)
    # penalty 0.7 rewards repetition, 2.0 punishes it
    assert len(set(outs[1])) < len(set(outs[0])) < len(set(outs[3]))


# ----------------------------------------------------------------------------------------
# context limits, vocabulary sizes
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("same_weights", [True, False])
@pytest.mark.parametrize("sampled", [False, True])
def test_draft_with_short_context(same_weights, sampled):
    ctx = 40
    draft = tiny_model(0 if same_weights else 1, max_position_embeddings=ctx)
    prompt = tuple(PROMPTS["twenty"])
    params = SamplingParams(max_new_tokens=128, temperature=1.0 if sampled else 0.0, seed=1)
    rec = Recording(DraftModelProposer(draft))
    gen, blocks = run(target(), rec, 4, prompt, params)
    assert len(gen.token_ids) == 128 and gen.finish_reason == "length"
    if not sampled:
        assert gen.token_ids == list(ref(tuple(prompt), params))
    s = gen.stats
    assert s.num_draft_tokens == sum(rec.proposed) > 0
    assert s.num_drafts == sum(1 for x in rec.proposed if x)
    # the draft never holds more than its context: proposals end once it is full
    assert len(prompt) + sum(len(b) for b in blocks[: s.num_drafts]) <= ctx + 5 + 1
    assert rec.proposed[-1] == 0 and s.num_verify_passes > s.num_drafts
    if same_weights and not sampled:
        assert s.acceptance_rate == 1.0


def test_prompt_longer_than_draft_context():
    draft = tiny_model(0, max_position_embeddings=40)
    prompt = randint(60, 3)
    params = SamplingParams(max_new_tokens=40)
    gen, blocks = run(target(), DraftModelProposer(draft), 4, prompt, params)
    assert gen.token_ids == list(ref(tuple(prompt), params))
    s = gen.stats
    assert s.num_drafts == s.num_draft_tokens == s.num_accepted_tokens == 0
    assert s.acceptance_rate == 0.0 and s.mean_acceptance_length == 1.0


CTX = 64


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("kind", ["same-model-draft", "all-right", "all-wrong"])
def test_target_context_limit(kind, k):
    """Prompts near the target's context: exactly context - prompt tokens come out."""
    limited = tiny_model(0, max_position_embeddings=CTX)
    base = randint(CTX, 4)
    for p in range(CTX - 2 * k - 3, CTX):
        prompt = base[:p]
        g = list(ref(tuple(prompt), SamplingParams(max_new_tokens=CTX)))[: CTX - p]
        if kind == "same-model-draft":
            proposer = DraftModelProposer(limited.fork())
        else:
            proposer = make_proposer(kind, prompt, g, k)
        for n in (CTX, CTX - p, CTX - p + 1):
            gen, _ = run(limited, proposer, k, prompt, SamplingParams(max_new_tokens=n))
            assert gen.token_ids == g, (p, n)
            assert gen.finish_reason == "length"
            assert p + len(gen.token_ids) == CTX
            assert gen.stats.num_generated_tokens == CTX - p


def test_eos_at_every_position_near_the_target_context_limit():
    k = 4
    limited = tiny_model(0, max_position_embeddings=CTX)
    prompt = randint(CTX - 2 * k - 3, 4)
    g = list(ref(tuple(prompt), SamplingParams(max_new_tokens=CTX)))[: CTX - len(prompt)]
    js = _first_appearances(g, len(g))
    assert len(js) >= k
    for j in js:
        for proposer in (DraftModelProposer(limited.fork()), make_proposer("all-right", prompt, g, k)):
            gen, _ = run(limited, proposer, k, prompt, SamplingParams(max_new_tokens=100), (g[j],))
            assert gen.token_ids == g[: j + 1] and gen.finish_reason == "stop"


def test_prompt_that_fills_the_context_is_refused():
    limited = tiny_model(0, max_position_embeddings=CTX)
    engine = Engine(limited, DraftModelProposer(limited.fork()), 4, debug=True)
    for p in (CTX, CTX + 3):
        with pytest.raises(ValueError):
            engine.generate(randint(p, 5), SamplingParams(max_new_tokens=4)).run()
    gen = engine.generate(randint(CTX - 1, 5), SamplingParams(max_new_tokens=4)).run()
    assert len(gen.token_ids) == 1 and gen.finish_reason == "length"


def test_cancel_at_every_round_near_the_limit_then_reuse():
    """The consumer stops iterating after r rounds (cancel) near the context limit; the same
    engine then serves a new request exactly."""
    k = 4
    limited = tiny_model(0, max_position_embeddings=CTX)
    prompt = randint(CTX - 3 * k, 6)
    params = SamplingParams(max_new_tokens=100)
    g = list(ref(tuple(prompt), SamplingParams(max_new_tokens=CTX)))[: CTX - len(prompt)]
    engine = Engine(limited, DraftModelProposer(limited.fork()), k, debug=True)
    full = engine.generate(prompt, params).run()
    assert full.token_ids == g
    rounds = full.stats.num_verify_passes
    for r in range(1, rounds + 1):
        gen = engine.generate(prompt, params)
        for i, _ in enumerate(gen):
            if i + 1 == r:
                break
        assert gen.token_ids == g[: len(gen.token_ids)]
        if r < rounds:  # paused, not closed: the models are still its own
            with pytest.raises(RuntimeError, match="already generating"):
                engine.generate(prompt[:-2], params).run()
        gen.close()
        again = engine.generate(prompt[:-2], params).run()
        assert again.token_ids == list(ref(tuple(prompt[:-2]), SamplingParams(max_new_tokens=CTX)))[
            : CTX - len(prompt) + 2]


def test_a_proposer_serves_one_request_at_a_time():
    """Two engines on different targets sharing one lookup proposer: interleaving their
    requests would mix two requests' lookup indexes (an IndexError deep in the proposer, or
    wrong proposals). The second request is refused with what to do; after the first
    finishes, the proposer serves the next one."""
    shared = PromptLookupProposer()
    a, b = Engine(target(), shared, 4), Engine(tiny_model(1), shared, 4)
    params = SamplingParams(max_new_tokens=30)
    first = a.generate(PROMPTS["repetitive"], params)
    next(iter(first))
    with pytest.raises(RuntimeError, match="proposer is already generating.*its own proposer"):
        b.generate(PROMPTS["twenty"], params).run()
    first.run()
    assert first.token_ids == list(ref(tuple(PROMPTS["repetitive"]), params))
    assert len(b.generate(PROMPTS["twenty"], params).run().token_ids) == 30


def test_a_draft_model_that_is_the_target_itself_is_refused():
    tgt = target()
    with pytest.raises(ValueError, match=r"draft model is the target itself.*fork\(\)"):
        Engine(tgt, DraftModelProposer(tgt), 4)
    Engine(tgt, DraftModelProposer(tgt.fork()), 4)  # its own cache: fine


def test_invalid_prompts_are_refused_with_value_error():
    engine = Engine(target(), DraftModelProposer(random_draft()), 4, debug=True)
    for bad in ([], [V], [-1, 3], [1, 2, 1000]):
        with pytest.raises(ValueError):
            engine.generate(bad, SamplingParams(max_new_tokens=4)).run()
    # a 1-D tensor is accepted and equals the list form
    gen = engine.generate(torch.tensor([5, 6, 7]), SamplingParams(max_new_tokens=8)).run()
    assert gen.token_ids == list(ref((5, 6, 7), SamplingParams(max_new_tokens=8)))


def test_batch_shaped_tensor_prompt_is_refused_with_value_error():
    """A [1, N] tensor (what tokenizers return) must be refused clearly: Engine.generate has an
    explicit ValueError("input_ids must be one prompt (1-D) ...") for it."""
    engine = Engine(target(), DraftModelProposer(random_draft()), 4, debug=True)
    with pytest.raises(ValueError, match="1-D"):
        engine.generate(torch.tensor([[5, 6, 7]]), SamplingParams(max_new_tokens=4))


def _resized_copy(model, vocab):
    """A draft with the target's weights and ``vocab`` embedding rows (rows cut, or new random
    rows appended), like Qwen2.5's 151,936- vs 152,064-row checkpoints."""
    d = tiny_model(0, vocab_size=vocab)
    src = model.state_dict()
    with torch.no_grad():
        for name, p in d.named_parameters():
            w = src[name]
            if w.shape == p.shape:
                p.copy_(w)
            else:
                r = min(vocab, w.shape[0])
                p[:r] = w[:r]
    return d


@pytest.mark.parametrize("vocab", [90, 100])
def test_draft_with_different_vocab_size(vocab):
    prompt = tuple(PROMPTS["twenty"])
    expected = list(ref(tuple(prompt), GREEDY128))
    assert any(t >= 90 for t in expected)  # the 90-row draft meets tokens it lacks
    for draft in (_resized_copy(target(), vocab), tiny_model(1, vocab_size=vocab)):
        rec = Recording(DraftModelProposer(draft))
        gen, _ = run(target(), rec, 4, prompt, GREEDY128)
        assert gen.token_ids == expected
        assert gen.stats.num_draft_tokens == sum(rec.proposed) > 0
    copy = _resized_copy(target(), vocab)
    if vocab > V:  # same weights on the shared rows: the extra rows must never be proposed
        gen, _ = run(target(), DraftModelProposer(copy), 4, prompt, GREEDY128)
        assert gen.stats.acceptance_rate == 1.0
    # sampled: works, stays in the target's vocabulary
    params = SamplingParams(max_new_tokens=128, temperature=1.0, seed=2)
    gen, _ = run(target(), DraftModelProposer(copy), 4, prompt, params)
    assert len(gen.token_ids) == 128 and max(gen.token_ids) < V
    if vocab > V:
        assert gen.stats.acceptance_rate > 0.99


# ----------------------------------------------------------------------------------------
# metrics
# ----------------------------------------------------------------------------------------

MV = 32


def _schedule_mock(prompt_len, eos_index):
    """Greedy output: a fixed token per position, EOS (0) at generated index ``eos_index``."""
    def fn(tokens):
        idx = len(tokens) - prompt_len
        winner = EOS if idx == eos_index else 1 + (len(tokens) * 7) % (MV - 1)
        logits = torch.zeros(MV)
        logits[winner] = 10.0
        return logits
    return MockLM(MV, fn)


def _metrics_run(k, a, rounds):
    prompt = [5, 6, 7]
    mock = _schedule_mock(len(prompt), rounds * (a + 1) - 1)
    params = SamplingParams(max_new_tokens=rounds * (k + 1) + k + 5)
    plain = reference(mock, prompt, params, (EOS,)).token_ids
    assert len(plain) == rounds * (a + 1) and plain[-1] == EOS
    gen, blocks = run(mock, ScriptedProposer(len(prompt), plain, MV, right=a), k, prompt, params, (EOS,))
    assert gen.token_ids == plain and gen.finish_reason == "stop"
    assert [len(b) for b in blocks] == [a + 1] * rounds
    return gen.stats


@pytest.mark.parametrize("k,a", [(1, 0), (1, 1), (4, 0), (4, 1), (4, 2), (4, 3), (4, 4),
                                 (8, 3), (8, 8)])
def test_acceptance_rate_and_length_with_a_right_of_k(k, a):
    rounds = 5
    s = _metrics_run(k, a, rounds)
    assert s.num_verify_passes == s.num_drafts == rounds
    assert s.num_draft_tokens == rounds * k
    assert s.num_accepted_tokens == rounds * a
    assert s.accepted_per_position == [rounds] * a + [0] * (k - a)
    assert s.acceptance_rate == pytest.approx(a / k, abs=1e-12)
    assert s.mean_acceptance_length == pytest.approx(1 + a, abs=1e-12)
    assert s.num_generated_tokens == rounds * (a + 1)
    d = s.to_dict()
    assert d["acceptance_rate"] == round(a / k, 4) and d["mean_acceptance_length"] == round(1 + a, 4)


def test_merge_pools_counts_not_ratios():
    s1 = _metrics_run(4, 1, 6)   # 6 / 24
    s2 = _metrics_run(4, 4, 2)   # 8 / 8
    s3 = _metrics_run(2, 1, 3)   # 3 / 6, shorter accepted_per_position
    m = s1.merge(s2)
    assert m.num_draft_tokens == 32 and m.num_accepted_tokens == 14
    assert m.acceptance_rate == pytest.approx(14 / 32)
    assert m.acceptance_rate != pytest.approx((s1.acceptance_rate + s2.acceptance_rate) / 2)
    assert m.num_verify_passes == 8 and m.num_drafts == 8
    assert m.mean_acceptance_length == pytest.approx(1 + 14 / 8)
    assert m.num_generated_tokens == s1.num_generated_tokens + s2.num_generated_tokens
    assert m.accepted_per_position == [8, 2, 2, 2]
    m3 = m.merge(s3)
    assert m3.accepted_per_position == [11, 2, 2, 2]
    assert m3.acceptance_rate == pytest.approx(17 / 38)
    assert s3.merge(m).accepted_per_position == [11, 2, 2, 2]
    e = SpecDecodingStats().merge(s1)
    assert (e.num_draft_tokens, e.num_accepted_tokens, e.accepted_per_position) == \
        (s1.num_draft_tokens, s1.num_accepted_tokens, s1.accepted_per_position)
    # merging does not modify its inputs
    assert s1.num_draft_tokens == 24 and s2.accepted_per_position == [2, 2, 2, 2]


class EveryOtherRound(Proposer):
    """Proposes nothing on every other round."""

    name = "every-other-round"

    def __init__(self, inner):
        self.inner, self.calls, self.proposed = inner, 0, []

    def reset(self, state, max_total_len):
        self.inner.reset(state, max_total_len)

    def propose(self, state, k):
        self.calls += 1
        out = self.inner.propose(state, k) if self.calls % 2 else DraftOutput.empty()
        self.proposed.append(out.token_ids.shape[1])
        return out

    def on_accept(self, state):
        self.inner.on_accept(state)


def test_rounds_with_nothing_proposed_count_no_drafts():
    k = 4
    prompt = tuple(PROMPTS["twenty"])
    expected = list(ref(tuple(prompt), GREEDY128))
    for inner in (ScriptedProposer(len(prompt), expected, V), DraftModelProposer(target().fork())):
        prop = EveryOtherRound(inner)
        gen, blocks = run(target(), prop, k, prompt, GREEDY128)
        assert gen.token_ids == expected
        s = gen.stats
        assert s.num_drafts == sum(1 for x in prop.proposed if x)
        assert s.num_draft_tokens == sum(prop.proposed)
        assert s.num_verify_passes == len(blocks) == len(prop.proposed)
        assert s.acceptance_rate == 1.0
        assert s.mean_acceptance_length == pytest.approx(1 + s.num_accepted_tokens / len(blocks))
        # a round with nothing proposed has K 0 in the mean K, whatever the schedule asked for
        assert s.speculation_lengths == prop.proposed
    # plain decoding: nothing proposed at all
    plain = reference(target(), prompt, GREEDY128)
    s = plain.stats
    assert s.num_drafts == s.num_draft_tokens == s.num_accepted_tokens == 0
    assert s.accepted_per_position == [] and s.acceptance_rate == 0.0
    assert s.mean_acceptance_length == 1.0 and s.num_verify_passes == 128


# ----------------------------------------------------------------------------------------
# the debug invariant catches broken rollbacks
# ----------------------------------------------------------------------------------------

class NoRollbackProposer(DraftModelProposer):
    def on_accept(self, state):
        pass


class OverTrimmingTarget:
    """Wraps a model; rollback trims one position too many."""

    def __init__(self, model):
        self.m = model
        self.vocab_size, self.max_context = model.vocab_size, model.max_context

    @property
    def seq_len(self):
        return self.m.seq_len

    def allocate(self, batch, max_len):
        self.m.allocate(batch, max_len)

    def forward(self, ids, num_logits=None):
        return self.m.forward(ids, num_logits)

    def rollback(self, length):
        self.m.rollback(max(0, length - 1))


def test_debug_invariant_catches_a_draft_that_does_not_roll_back():
    prompt = tuple(PROMPTS["twenty"])
    engine = Engine(target(), NoRollbackProposer(random_draft()), 4, debug=True)
    with pytest.raises(AssertionError):
        engine.generate(prompt, GREEDY128).run()


def test_debug_invariant_catches_a_target_rollback_that_trims_too_much():
    prompt = tuple(PROMPTS["twenty"])
    engine = Engine(OverTrimmingTarget(tiny_model(0)), DraftModelProposer(random_draft()), 4, debug=True)
    with pytest.raises(AssertionError):
        engine.generate(prompt, GREEDY128).run()


def test_default_k_is_the_proposers():
    """Without a K the engine drafts the proposer's default_k tokens a round (6 for a draft
    model, the configured default; it was 4 here and 6 through the API)."""
    prompt = tuple(PROMPTS["twenty"])
    expected = list(ref(tuple(prompt), GREEDY128))
    for proposer, k in ((DraftModelProposer(target().fork()), 6),
                         (ScriptedProposer(len(prompt), expected, V), ScriptedProposer.default_k)):
        gen = Engine(target(), proposer).generate(prompt, GREEDY128)
        gen.run()
        assert gen.token_ids == expected and max(gen.stats.speculation_lengths) == k


@pytest.mark.parametrize("right", [None, 0, 2])
def test_token_info_names_who_supplied_each_token(right):
    """Per round with K=4 drafts of which ``right`` are correct: that many "accepted" tokens
    (the scripted proposer's), then the target's "recovered" token, or "bonus" after a fully
    accepted draft; plain decoding's tokens are all "target"."""
    prompt, params = tuple(PROMPTS["twenty"]), SamplingParams(max_new_tokens=17)
    script = ref(prompt, params)
    gen, blocks = run(target(), ScriptedProposer(len(prompt), list(script), V, right=right), 4,
                      prompt, params)
    assert tuple(gen.token_ids) == script
    kinds = [i.kind for i in gen.token_info]
    assert len(kinds) == len(script)
    n = 0
    for block, k in zip(blocks, gen.stats.speculation_lengths):  # K shrinks near the cap
        got = kinds[n:n + len(block)]
        accepted = k if right is None else min(right, k)
        want = ["accepted"] * min(accepted, len(block))
        if len(block) > accepted:
            want.append("target" if k == 0 else "bonus" if accepted == k else "recovered")
        assert got == want, (got, want)
        assert all(i.proposer == "scripted" for i in gen.token_info[n:n + len(block)] if i.kind == "accepted")
        n += len(block)
    assert sum(k == "accepted" for k in kinds) == gen.stats.num_accepted_tokens
    plain, _ = run(target(), None, None, prompt, params)
    assert {i.kind for i in plain.token_info} == {"target"}
    assert all(i.logprob is None for i in plain.token_info)


def test_logprobs_are_the_targets_own_raw_log_probabilities():
    """Each token's logprob (and its top alternatives, most likely first) equals log_softmax of
    the target's logits at its position in one pass over the whole sequence, also with
    temperature (raw, as vLLM), whether the token was drafted or not."""
    prompt = tuple(PROMPTS["twenty"])
    for params in (SamplingParams(max_new_tokens=12, logprobs=3),
                   SamplingParams(max_new_tokens=12, logprobs=0, temperature=0.8, seed=5)):
        plain = ref(prompt, dataclasses.replace(params, logprobs=None)) if params.greedy else None
        script = plain or tuple(run(target(), None, None, prompt, params)[0].token_ids)
        gen, _ = run(target(), ScriptedProposer(len(prompt), list(script), V, right=2), 4, prompt, params)
        assert tuple(gen.token_ids) == script
        full = target()
        full.allocate(1, len(prompt) + len(script))
        seq = list(prompt) + list(script)
        logits = full.forward(torch.tensor([seq[:-1]]))[0, len(prompt) - 1:]
        want = torch.log_softmax(logits.float(), -1)
        for i, (tok, info) in enumerate(zip(script, gen.token_info)):
            assert info.logprob == pytest.approx(float(want[i, tok]), abs=1e-4)
            assert info.logprob < 0
            assert len(info.top_logprobs) == params.logprobs
            top = want[i].topk(params.logprobs)
            assert [t for t, _ in info.top_logprobs] == top.indices.tolist()
            if params.greedy and params.logprobs:
                assert info.top_logprobs[0][0] == tok
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)

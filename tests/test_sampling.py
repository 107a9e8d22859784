"""The acceptance rule and logits processing (docs/testing.md: the sampling distribution,
and the repetition penalty and other processors for the sampler).

- ``rejection_sample`` with fixed ±10 logits (certain outcomes), point-mass vs one-hot drafts,
  drafts of a narrower vocabulary, greedy verification as the T -> 0 case.
- Losslessness: the first two emitted tokens of many vectorised requests follow the *target*
  distribution (chi-square, p = 0.001) at several temperatures, with top-k / top-p / repetition
  penalty; biased schemes (soft probabilities for a greedy draft, target at the wrong
  temperature, draft probabilities other than the drawn ones, top-k ignored by the target) are
  detected, so the test has power. (Verifying a sampled draft as a point mass is lossless —
  checked too, so the test does not flag valid schemes.)
  The same check end to end through the engine with a mock target and a different mock draft.
- ``process_logits`` equals transformers' processors, is stateless per block position, and
  masks EOS for exactly the positions ``min_new_tokens`` asks for.
- Seeds: same seed -> same output, different seeds / unseeded -> different outputs.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from helpers import tiny_model
from lossless import (E_PROMPT, EV, N_RUNS, assert_lossless, chi2_critical, chi2_stat, engine_joint,
                      mock_draft, mock_target, probs_of)
from specdecode.config import SamplingParams
from specdecode.engine import Engine
from specdecode.proposers import DraftModelProposer
from specdecode.sampling import GumbelNoise, gumbel_sample, process_logits, to_probs
from specdecode.verify import greedy_verify, gumbel_verify, rejection_sample




# ----------------------------------------------------------------------------------------
# chi-square machinery (no scipy): statistic, and the p = 0.001 critical value from the
# regularised upper incomplete gamma function, cross-checked against printed tables.
# ----------------------------------------------------------------------------------------

# ----------------------------------------------------------------------------------------
# rejection_sample: certain outcomes
# ----------------------------------------------------------------------------------------

def _certain_case(v=16, k=4, seed=0):
    """Rows b = 0..k: drafts right on the first b tokens; at position b the target puts +10 on
    a different token (recovered) — row k has all drafts right and a +10 bonus token."""
    g = torch.Generator().manual_seed(seed)
    b = k + 1
    drafts = torch.randint(0, v, (b, k), generator=g)
    want = torch.randint(0, v, (b, k + 1), generator=g)  # the target's near-certain token
    for row in range(b):
        want[row, :row] = drafts[row, :row]
        if row < k and want[row, row] == drafts[row, row]:
            want[row, row] = (drafts[row, row] + 1) % v
    logits = torch.full((b, k + 1, v), -10.0)
    logits.scatter_(2, want[..., None], 10.0)
    return drafts, logits.softmax(-1), want


@pytest.mark.parametrize("k", [1, 3, 4, 8])
def test_certain_outcomes_point_mass_and_one_hot(k):
    v = 16
    drafts, p, want = _certain_case(v, k, seed=k)
    one_hot = torch.nn.functional.one_hot(drafts, v).float()
    for draft_probs in (None, one_hot):
        out, na = rejection_sample(drafts, draft_probs, p, torch.Generator().manual_seed(1))
        assert out.shape == (k + 1, k + 1) and out.dtype == torch.long
        assert na.tolist() == list(range(k + 1))
        for row in range(k + 1):
            # accepted prefix, then the recovered (row < k) or bonus (row == k) token
            assert out[row, :row].tolist() == drafts[row, :row].tolist()
            assert out[row, row].item() == want[row, row].item()
            assert (out[row, row + 1:] == -1).all()


def test_certain_outcomes_soft_draft():
    """A sampled draft with soft q: target +10 on the draft token -> accepted whatever q(x) is
    (p/q >= 1); target -10 on it -> rejected and the recovered token is the target's."""
    v, k = 12, 3
    drafts, p, want = _certain_case(v, k, seed=7)
    q = torch.rand(k + 1, k, v, generator=torch.Generator().manual_seed(3)) + 0.1
    q.scatter_(2, drafts[..., None], 2.0)
    q = q / q.sum(-1, keepdim=True)
    out, na = rejection_sample(drafts, q, p, torch.Generator().manual_seed(2))
    assert na.tolist() == list(range(k + 1))
    for row in range(k + 1):
        assert out[row, : row + 1].tolist() == want[row, : row + 1].tolist()
        assert (out[row, row + 1:] == -1).all()


def test_k_zero_samples_from_target():
    p = torch.zeros(3, 1, 8)
    p[0, 0, 5] = p[1, 0, 2] = p[2, 0, 7] = 1.0
    out, na = rejection_sample(torch.empty(3, 0, dtype=torch.long), None, p, None)
    assert out[:, 0].tolist() == [5, 2, 7] and na.tolist() == [0, 0, 0]


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError):
        rejection_sample(torch.zeros(1, 3, dtype=torch.long), None, torch.ones(1, 3, 8) / 8, None)


def test_narrow_draft_vocab_rows_it_lacks_have_q_zero():
    """Draft vocab V' < V: the target's +10 token lies beyond the draft's rows -> recovered
    token is that token; a draft token it shares with +10 -> accepted."""
    v, vd, k = 20, 14, 3
    drafts = torch.tensor([[2, 5, 9], [2, 5, 9]])
    q = torch.full((2, k, vd), 1.0 / vd)
    logits = torch.full((2, k + 1, v), -10.0)
    logits[0, 0, 18] = 10.0  # row 0: the target wants a token the draft cannot propose
    logits[1, 0, 2] = logits[1, 1, 5] = 10.0
    logits[1, 2, 19] = 10.0  # row 1: two accepted, then a token beyond V'
    p = logits.softmax(-1)
    out, na = rejection_sample(drafts, q, p, torch.Generator().manual_seed(0))
    assert na.tolist() == [0, 2]
    assert out[0].tolist() == [18, -1, -1, -1]
    assert out[1].tolist() == [2, 5, 19, -1]


def test_chi2_critical_values_match_tables():
    table = {1: 10.828, 2: 13.816, 5: 20.515, 10: 29.588, 20: 45.315, 30: 59.703, 35: 66.619}
    for df, x in table.items():
        assert chi2_critical(df) == pytest.approx(x, abs=2e-3)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_greedy_verification_accepts_exactly_the_matching_prefix(k):
    """Greedy = one-hot target via to_probs(temperature 0): for every j, drafts equal to the
    argmax on the first j positions and wrong at j -> exactly j accepted + the argmax at j."""
    v = 32
    params = SamplingParams(temperature=0.0)
    g = torch.Generator().manual_seed(k)
    for j in range(k + 1):
        logits = torch.randn(4, k + 1, v, generator=g)
        p = to_probs(process_logits(logits, params, torch.zeros(4, 1, dtype=torch.long), None, 0, ()),
                     params)
        assert ((p == 0) | (p == 1)).all() and (p.sum(-1) == 1).all()
        argmax = logits.argmax(-1)
        drafts = argmax[:, :k].clone()
        if j < k:
            drafts[:, j] = (drafts[:, j] + 1 + torch.randint(0, v - 1, (4,), generator=g)) % v
            drafts[:, j + 1:] = torch.randint(0, v, (4, k - j - 1), generator=g)
        for draft_probs in (None, torch.nn.functional.one_hot(drafts, v).float()):
            out, na = rejection_sample(drafts, draft_probs, p, torch.Generator().manual_seed(j))
            assert (na == j).all()
            assert (out[:, :j] == argmax[:, :j]).all()
            assert (out[:, j] == argmax[:, j]).all()
            assert (out[:, j + 1:] == -1).all()
        # greedy_verify, the engine's rule for greedy requests: the same blocks, no draws
        fast, fast_na = greedy_verify(drafts, logits)
        assert torch.equal(fast, out) and torch.equal(fast_na, na)


# ----------------------------------------------------------------------------------------
# Losslessness: the joint distribution of the first two emitted tokens
# ----------------------------------------------------------------------------------------

V = 6
B = 30000
PREFIX = [1, 4]


def _tables(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, generator=g) * 1.2,  # logits of token 1
            torch.randn(V, V, generator=g) * 1.2,  # logits of token 2 given token 1 = row
            torch.randn(V, generator=g))  # logits of any later position (bonus)


TARGET = _tables(100)
DRAFT = _tables(200)


def target_joint(params: SamplingParams) -> torch.Tensor:
    """[V,V] P(first = a, second = b) of plain decoding with ``params`` (by enumeration)."""
    l1, l2, _ = TARGET
    prefix = torch.tensor([PREFIX])
    p1 = probs_of(l1[None, None], params, prefix, None)[0, 0]
    rows = [probs_of(l2[a][None, None], params, torch.tensor([PREFIX + [a]]), None)[0, 0]
            for a in range(V)]
    return p1[:, None] * torch.stack(rows)


def _draw(probs: torch.Tensor, greedy: bool, g) -> torch.Tensor:
    return probs.argmax(-1) if greedy else torch.multinomial(probs, 1, generator=g)[:, 0]


def _round(first_ctx: torch.Tensor | None, k: int, params_t, params_d, mode, g, params_q=None):
    """One vectorised speculative round for B requests. first_ctx: None (no token generated
    yet) or [B] the first generated token. Drafts are drawn the way ``mode`` says; the target
    block is processed in one ``process_logits`` call as the engine does.
    Returns (out [B,k+1], num_accepted [B])."""
    (t1, t2, t3), (d1, d2, d3) = TARGET, DRAFT
    n = B
    prefix = torch.tensor([PREFIX]).expand(n, -1)
    ctx = prefix if first_ctx is None else torch.cat([prefix, first_ctx[:, None]], 1)
    offset = 0 if first_ctx is None else 1  # index of the generated token position 0 predicts

    def logits_at(pos, table1, table2, table3, tokens):
        # tokens: the generated tokens so far (list of [B] tensors)
        if pos == 0:
            return table1.expand(n, V)
        if pos == 1:
            return table2[tokens[0]]
        return table3.expand(n, V)

    gen_tokens = [] if first_ctx is None else [first_ctx]
    ids, qs = [], []
    dctx = ctx
    for i in range(k):
        dl = logits_at(offset + i, d1, d2, d3, gen_tokens + ids)
        q = to_probs(process_logits(dl[:, None], params_d, dctx, None, 0, ()), params_d)[:, 0]
        x = _draw(q, mode in ("greedy_point", "greedy_soft"), g)
        if params_q is not None:  # report a distribution other than the one drawn from
            q = to_probs(process_logits(dl[:, None], params_q, dctx, None, 0, ()), params_q)[:, 0]
        ids.append(x)
        qs.append(q)
        dctx = torch.cat([dctx, x[:, None]], 1)
    drafts = torch.stack(ids, 1)
    logits = torch.stack([logits_at(offset + i, t1, t2, t3, gen_tokens + ids) for i in range(k + 1)], 1)
    p = to_probs(process_logits(logits, params_t, ctx, drafts, 0, ()), params_t)
    draft_probs = None if mode in ("greedy_point", "sampled_as_point") else torch.stack(qs, 1)
    return rejection_sample(drafts, draft_probs, p, g)


def sample_two_tokens(params_t, params_d=None, mode="sampled", k=2, seed=0, params_q=None):
    """First two emitted tokens of B independent requests: one round of K drafts, and for the
    rows that emitted only one token a second round of one draft. Returns [V,V] counts."""
    params_d = params_d or params_t
    g = torch.Generator().manual_seed(seed)
    out, na = _round(None, k, params_t, params_d, mode, g, params_q)
    first = out[:, 0]
    out2, _ = _round(first, 1, params_t, params_d, mode, g, params_q)
    second = torch.where(na >= 1, out[:, 1], out2[:, 0])
    assert (first >= 0).all() and (second >= 0).all()
    return torch.bincount(first * V + second, minlength=V * V).reshape(V, V)


SETTINGS = {
    "T0.5": SamplingParams(temperature=0.5),
    "T1": SamplingParams(temperature=1.0),
    "T2": SamplingParams(temperature=2.0),
    "T1-top_k3": SamplingParams(temperature=1.0, top_k=3),
    "T0.7-top_p0.8": SamplingParams(temperature=0.7, top_p=0.8),
    "T1.5-top_k4-top_p0.9": SamplingParams(temperature=1.5, top_k=4, top_p=0.9),
    "T1-rep1.5": SamplingParams(temperature=1.0, repetition_penalty=1.5),
}


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_sampled_draft_output_follows_target(name, k):
    params = SETTINGS[name]
    joint = target_joint(params)
    counts = sample_two_tokens(params, mode="sampled", k=k, seed=list(SETTINGS).index(name) * 10 + k)
    assert counts.sum() == B
    assert_lossless(counts, joint)


@pytest.mark.parametrize("name", ["T0.5", "T2", "T1-top_k3"])
def test_greedy_point_mass_draft_output_follows_target(name):
    """A greedy draft (argmax, point mass, draft_probs=None) under a sampled target: lossless."""
    params = SETTINGS[name]
    assert_lossless(sample_two_tokens(params, mode="greedy_point", seed=11), target_joint(params))


def test_narrow_draft_vocab_is_lossless():
    """Draft distributions over V' = V - 2 rows (as a draft with fewer embedding rows gives):
    the missing rows count as q = 0 and the output still follows the target."""
    params = SamplingParams(temperature=1.0)
    joint = target_joint(params)
    assert joint[:, V - 2:].sum() > 0.1  # the target really uses the rows the draft lacks
    g = torch.Generator().manual_seed(5)
    (t1, t2, t3), (d1, d2, _) = TARGET, DRAFT
    prefix = torch.tensor([PREFIX]).expand(B, -1)
    q1 = d1[: V - 2].softmax(-1).expand(B, -1)
    x1 = torch.multinomial(q1, 1, generator=g)[:, 0]
    q2 = d2[x1][:, : V - 2].softmax(-1)
    x2 = torch.multinomial(q2, 1, generator=g)[:, 0]
    drafts = torch.stack([x1, x2], 1)
    p = probs_of(torch.stack([t1.expand(B, V), t2[x1], t3.expand(B, V)], 1), params, prefix, drafts)
    out, na = rejection_sample(drafts, torch.stack([q1, q2], 1), p, g)
    first = out[:, 0]
    qf = d2[first][:, : V - 2].softmax(-1)
    y = torch.multinomial(qf, 1, generator=g)[:, 0]
    p2 = probs_of(torch.stack([t2[first], t3.expand(B, V)], 1),
                params, torch.cat([prefix, first[:, None]], 1), y[:, None])
    out2, _ = rejection_sample(y[:, None], qf[:, None], p2, g)
    second = torch.where(na >= 1, out[:, 1], out2[:, 0])
    counts = torch.bincount(first * V + second, minlength=V * V).reshape(V, V)
    assert_lossless(counts, joint)


# ----------------------------------------------------------------------------------------
# The gumbel rule (drafter-invariant): the same joint, drafts guessed with the target's noise
# ----------------------------------------------------------------------------------------

def sample_two_tokens_gumbel(params_t, params_d=None, k=2, seed=0, shared_noise=False):
    """First two emitted tokens of B requests under the gumbel rule: Gumbel noise per request
    and position (positions 0, 1, 2: [B,3,V]); the draft proposes argmax(its logits + the
    noise of that position); one round of K drafts, then for rows that emitted one token a
    round of one draft at position 1 with position 1's noise. ``shared_noise``: a broken
    scheme that gives every position position 0's noise. Returns [V,V] counts."""
    params_d = params_d or params_t
    g = torch.Generator().manual_seed(seed)
    noise = -torch.rand(B, 3, V, generator=g).clamp_min(1e-30).log().neg().log()
    if shared_noise:
        noise = noise[:, :1].expand(B, 3, V)
    (t1, t2, t3), (d1, d2, d3) = TARGET, DRAFT
    prefix = torch.tensor([PREFIX]).expand(B, -1)

    def rows(tables, first, upto):  # logits of positions 0..upto-1 after token 0 = first
        l1, l2, l3 = tables
        out = [l1.expand(B, V), l2[first] if first is not None else None, l3.expand(B, V)]
        return out[:upto]

    # round 1: drafts at positions 0..k-1
    ids, ctx = [], prefix
    for i in range(k):
        dl = (d1.expand(B, V) if i == 0 else d2[ids[0]] if i == 1 else d3.expand(B, V))
        proc = process_logits(dl[:, None], params_d, ctx, None, 0, ())[:, 0]
        ids.append(gumbel_sample(proc, noise[:, i]))
        ctx = torch.cat([ctx, ids[-1][:, None]], 1)
    drafts = torch.stack(ids, 1)
    logits = torch.stack([t1.expand(B, V), t2[drafts[:, 0]]] + [t3.expand(B, V)] * (k - 1), 1)
    proc = process_logits(logits, params_t, prefix, drafts, 0, ())
    out, na = gumbel_verify(drafts, proc, noise[:, :k + 1])
    first = out[:, 0]
    # round 2 (rows with one token): a draft at position 1, then the target at 1 and 2
    ctx1 = torch.cat([prefix, first[:, None]], 1)
    y = gumbel_sample(process_logits(d2[first][:, None], params_d, ctx1, None, 0, ())[:, 0], noise[:, 1])
    proc2 = process_logits(torch.stack([t2[first], t3.expand(B, V)], 1), params_t, ctx1, y[:, None], 0, ())
    out2, _ = gumbel_verify(y[:, None], proc2, noise[:, 1:3])
    second = torch.where(na >= 1, out[:, 1], out2[:, 0])
    assert (first >= 0).all() and (second >= 0).all()
    return torch.bincount(first * V + second, minlength=V * V).reshape(V, V)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_gumbel_rule_output_follows_target(name, k):
    params = SETTINGS[name]
    counts = sample_two_tokens_gumbel(params, k=k, seed=list(SETTINGS).index(name) * 10 + k + 500)
    assert counts.sum() == B
    assert_lossless(counts, target_joint(params))


def test_gumbel_rule_with_a_draft_at_another_temperature_follows_target():
    """The draft's own processing only moves its agreement, never the output."""
    t2 = SETTINGS["T2"]
    assert_lossless(sample_two_tokens_gumbel(t2, params_d=SETTINGS["T0.5"], seed=41), target_joint(t2))


def test_power_gumbel_noise_shared_between_positions_is_detected():
    """Noise keyed on something other than the position (here: position 0's for every
    position) couples the tokens: the joint is no longer the target's."""
    params = SETTINGS["T1"]
    _far_above(sample_two_tokens_gumbel(params, shared_noise=True, seed=43), target_joint(params))


def test_gumbel_verify_certain_outcomes_and_matching_prefix():
    """±10 logits make each position's sample certain whatever the noise: drafts right on
    the first b tokens keep exactly b, then the target's token; padded with -1."""
    k = 4
    drafts, probs, want = _certain_case(k=k)
    logits = probs.log()
    noise = -torch.rand(logits.shape, generator=torch.Generator().manual_seed(2)).log().neg().log()
    out, na = gumbel_verify(drafts, logits, noise)
    assert na.tolist() == list(range(k + 1))
    for row in range(k + 1):
        assert out[row, :row + 1].tolist() == want[row, :row + 1].tolist()
        assert (out[row, row + 1:] == -1).all()
    empty, na0 = gumbel_verify(torch.empty(1, 0, dtype=torch.long), logits[:1, :1], noise[:1, :1])
    assert na0.tolist() == [0] and empty.tolist() == [[want[0, 0].item()]]
    with pytest.raises(ValueError, match="must both be"):
        gumbel_verify(drafts, logits[:, :k], noise)


def test_gumbel_noise_is_keyed_on_seed_and_position_only():
    a, b = GumbelNoise(7, 50), GumbelNoise(7, 50)
    forward = a.rows(10, 6)
    b.rows(13, 2)  # asked in another order, some twice, some forgotten in between
    b.forget_before(14)
    assert torch.equal(torch.cat([b.rows(10, 3), b.rows(13, 3)]), forward)
    assert not torch.equal(GumbelNoise(8, 50).rows(10, 6), forward)
    assert not torch.equal(forward[0], forward[1])
    assert forward.dtype == torch.float32 and torch.isfinite(forward).all()
    assert a.rows(3, 0).shape == (0, 50)


def _far_above(counts, joint, factor=10.0):
    stat, df = chi2_stat(counts, joint)
    assert stat > factor * chi2_critical(df), f"bias not detected: chi2 = {stat:.1f} (df {df})"


def test_power_greedy_draft_with_soft_probs_is_detected():
    params = SETTINGS["T1"]
    _far_above(sample_two_tokens(params, mode="greedy_soft", seed=3), target_joint(params))


def test_power_target_at_wrong_temperature_is_detected():
    """Target probabilities computed at T = 1 when the request says T = 2 (draft at T = 2)."""
    t2, t1 = SETTINGS["T2"], SETTINGS["T1"]
    counts = sample_two_tokens(t1, params_d=t2, mode="sampled", seed=4)
    _far_above(counts, target_joint(t2))


def test_power_draft_probs_not_the_drawn_distribution_is_detected():
    """Drafts drawn at T = 0.5 but reported with their T = 1 probabilities."""
    params = SETTINGS["T1"]
    counts = sample_two_tokens(params, params_d=SETTINGS["T0.5"], params_q=params, seed=6)
    _far_above(counts, target_joint(params))


def test_sampled_drafts_verified_as_point_masses_stay_lossless():
    """Verifying any draft token as a point mass (q = one-hot) is valid whatever it was drawn
    from (it only lowers acceptance): the chi-square test must not flag it."""
    params = SETTINGS["T1"]
    assert_lossless(sample_two_tokens(params, mode="sampled_as_point", seed=6), target_joint(params))


def test_power_top_k_ignored_by_target_is_detected():
    params = SETTINGS["T1-top_k3"]
    counts = sample_two_tokens(SETTINGS["T1"], params_d=params, mode="sampled", seed=8)
    with pytest.raises(AssertionError, match="probability-0"):
        chi2_stat(counts, target_joint(params))


# ----------------------------------------------------------------------------------------
# The same, end to end: Engine + DraftModelProposer over mock models
# ----------------------------------------------------------------------------------------

T2_TOP_K = SamplingParams(max_new_tokens=3, temperature=2.0, top_k=5, repetition_penalty=1.3)
T06_TOP_P = SamplingParams(max_new_tokens=3, temperature=0.6, top_p=0.9)


@pytest.mark.slow
@pytest.mark.parametrize("params,draft_vocab,rule,mask_id", [
    (T2_TOP_K, EV, "rejection", None), (T2_TOP_K, EV, "gumbel", None),
    (T06_TOP_P, EV - 1, "rejection", None), (T06_TOP_P, EV - 1, "gumbel", None),
    (T2_TOP_K, EV, "rejection", EV - 1),
], ids=["T2-top_k5-rep1.3-rejection", "T2-top_k5-rep1.3-gumbel", "T0.6-top_p0.9-draft-vocab-5-rejection",
        "T0.6-top_p0.9-draft-vocab-5-gumbel", "T2-top_k5-rep1.3-rejection-parallel-draft"])
def test_engine_output_follows_target(params, draft_vocab, rule, mask_id):
    """20k seeded requests (3 tokens, K = 2; the first two are counted) through the engine with a different draft model: the
    joint of the two tokens is the target's (the verify pass must process the target's logits
    exactly as the request says and the draft must report the distribution it sampled from:
    for a parallel draft, the mask row's, from which its second token is drawn in the same pass)."""
    target, draft = mock_target(), mock_draft(draft_vocab)
    engine = Engine(target, DraftModelProposer(draft, mask_id=mask_id), 2, debug=True)
    counts = torch.zeros(EV * EV, dtype=torch.long)
    proposed = 0
    for seed in range(N_RUNS):
        gen = engine.generate(E_PROMPT, dataclasses.replace(params, seed=seed,
                                                            acceptance_rule=rule)).run()
        a, b = gen.token_ids[:2]
        counts[a * EV + b] += 1
        proposed += gen.stats.num_draft_tokens
    assert proposed > N_RUNS  # speculation really ran
    assert_lossless(counts.reshape(EV, EV), engine_joint(params))


# ----------------------------------------------------------------------------------------
# process_logits
# ----------------------------------------------------------------------------------------

def _hf_reference(logits_row, input_ids, params: SamplingParams, prompt_len, eos):
    scores = logits_row.clone()
    procs = []
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.min_new_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, params.min_new_tokens, list(eos)))
    if not params.greedy:
        procs.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            procs.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            procs.append(TopPLogitsWarper(params.top_p))
    for proc in procs:
        scores = proc(input_ids, scores)
    return scores


HF_PARAMS = [
    SamplingParams(temperature=0.7, top_k=10, top_p=0.9, repetition_penalty=1.3),
    SamplingParams(temperature=1.5, top_p=0.5, repetition_penalty=0.8),
    SamplingParams(temperature=1.0, top_k=5, repetition_penalty=2.0),
    SamplingParams(temperature=0.9, top_k=7, top_p=0.6, repetition_penalty=1.2, min_new_tokens=4),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, min_new_tokens=3),
]


@pytest.mark.parametrize("params", HF_PARAMS, ids=lambda p: (
    f"T{p.temperature}-k{p.top_k}-p{p.top_p}-rep{p.repetition_penalty}-min{p.min_new_tokens}"))
def test_process_logits_matches_transformers(params):
    """Each block position i equals transformers' processors applied with input_ids =
    prefix + block_ids[:i] (repetition penalty, min-new-tokens, temperature, top-k, top-p)."""
    g = torch.Generator().manual_seed(0)
    b, t, v, prompt_len, gen_before = 3, 5, 50, 6, 1
    logits = torch.randn(b, t, v, generator=g) * 3
    prefix = torch.randint(0, 12, (b, prompt_len + gen_before), generator=g)  # repeats likely
    block = torch.randint(0, 15, (b, t - 1), generator=g)
    eos = (3, 7)
    ours = process_logits(logits, params, prefix, block, gen_before, eos)
    for i in range(t):
        ids = torch.cat([prefix, block[:, :i]], 1)
        ref = _hf_reference(logits[:, i], ids, params, prompt_len, eos)
        torch.testing.assert_close(ours[:, i], ref, rtol=1e-6, atol=1e-6)
    if params.repetition_penalty != 1.0:  # the penalty really changed something
        assert not torch.equal(ours, process_logits(logits, SamplingParams(
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
            min_new_tokens=params.min_new_tokens), prefix, block, gen_before, eos))


def test_penalty_position_sees_exactly_prefix_and_earlier_drafts():
    """Stateless: block position i is penalised for prefix + block_ids[:i] only — not for
    its own draft token or later ones (which may be rejected), and equals a 1-token call."""
    v, pen = 20, 2.0
    params = SamplingParams(temperature=1.0, repetition_penalty=pen)
    logits = torch.full((1, 4, v), 3.0)
    prefix = torch.tensor([[1, 2]])
    block = torch.tensor([[5, 6, 7]])
    out = process_logits(logits, params, prefix, block, 0, ())[0]
    penalized = torch.zeros(4, v, dtype=torch.bool)
    penalized[:, [1, 2]] = True
    penalized[1:, 5] = True
    penalized[2:, 6] = True
    penalized[3:, 7] = True
    torch.testing.assert_close(out, torch.where(penalized, 3.0 / pen, 3.0))
    # rejected drafts leave no trace: a block verified with garbage drafts (8), then a
    # rejection at position 1 (draft 6 replaced by 9): the next block sees only committed tokens
    process_logits(logits, params, prefix, torch.tensor([[8, 8, 8]]), 0, ())
    nxt = process_logits(logits[:, :2], params, torch.tensor([[1, 2, 5, 9]]), torch.tensor([[4]]), 0, ())
    for i in range(2):
        one = process_logits(logits[:, :1], params, torch.tensor([[1, 2, 5, 9] + [4][:i]]), None, 0, ())
        torch.testing.assert_close(nxt[:, i], one[:, 0])
    assert nxt[0, 0, 6] == 3.0 and nxt[0, 0, 8] == 3.0 and nxt[0, 0, 9] == 3.0 / pen
    # negative logits are multiplied (CTRL / transformers)
    neg = process_logits(-logits[:, :1], params, prefix, None, 0, ())[0, 0]
    assert neg[1] == -3.0 * pen and neg[0] == -3.0


def test_min_new_tokens_masks_eos_at_exactly_the_right_block_positions():
    v, t = 16, 6
    eos = (3, 9, 40)  # 40 is beyond V: ignored, no crash
    logits = torch.randn(2, t, v, generator=torch.Generator().manual_seed(1))
    prefix, block = torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, t - 1, dtype=torch.long)
    for base in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.3)):
        free = process_logits(logits, base, prefix, block, 0, eos)
        assert torch.isfinite(free).all()
        for m in range(0, 12):
            params = dataclasses.replace(base, min_new_tokens=m)
            for gen_before in range(0, 10):
                out = process_logits(logits, params, prefix, block, gen_before, eos)
                for i in range(t):
                    if gen_before + i < m:  # masked: both EOS ids -inf, all else unchanged
                        assert torch.isneginf(out[:, i, [3, 9]]).all(), (m, gen_before, i)
                        keep = [x for x in range(v) if x not in (3, 9)]
                        assert torch.equal(out[:, i, keep], free[:, i, keep])
                    else:
                        assert torch.equal(out[:, i], free[:, i]), (m, gen_before, i)
    # no EOS configured: nothing is masked
    out = process_logits(logits, SamplingParams(min_new_tokens=5), prefix, None, 0, ())
    assert torch.equal(out, logits)


# ----------------------------------------------------------------------------------------
# Seeds, through the engine with a draft model
# ----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _seed_models():
    return tiny_model(0, scale=1.0), tiny_model(1, scale=1.0)


def _sampled(seed, n=48, rule=None):
    target, draft = _seed_models()
    engine = Engine(target, DraftModelProposer(draft), 3, debug=True)
    gen = engine.generate(list(range(10, 30)), SamplingParams(
        max_new_tokens=n, temperature=1.0, seed=seed, acceptance_rule=rule)).run()
    assert len(gen.token_ids) == n and gen.stats.num_draft_tokens > 0
    return gen.token_ids


@pytest.mark.parametrize("rule", ["gumbel", "rejection"])
def test_same_seed_same_output(rule):
    assert _sampled(123, rule=rule) == _sampled(123, rule=rule)
    assert _sampled(7, rule=rule) == _sampled(7, rule=rule)


@pytest.mark.parametrize("rule", ["gumbel", "rejection"])
def test_different_seeds_different_outputs(rule):
    outs = [tuple(_sampled(s, rule=rule)) for s in range(5)]
    assert len(set(outs)) == 5


@pytest.mark.parametrize("rule", [None, "gumbel", "rejection"])
def test_unseeded_requests_differ(rule):
    assert _sampled(None, rule=rule) != _sampled(None, rule=rule)


def test_default_rule_is_gumbel_with_a_seed_and_rejection_without():
    assert SamplingParams(temperature=1.0, seed=1).rule == "gumbel"
    assert SamplingParams(temperature=1.0).rule == "rejection"
    assert SamplingParams(temperature=1.0, acceptance_rule="rejection", seed=1).rule == "rejection"
    assert SamplingParams(temperature=1.0, acceptance_rule="gumbel").rule == "gumbel"
    assert SamplingParams(seed=1, acceptance_rule="gumbel").rule == "greedy"


# ----------------------------------------------------------------------------------------
# Seeded output that no proposer can change (docs/testing.md)
# ----------------------------------------------------------------------------------------

INVARIANT_PROMPTS = {"twenty": list(range(10, 30)), "repetitive": [11, 23, 5, 42, 17] * 8}


def _invariance_proposers(target, draft):
    """(label, proposer, K or schedule): every proposer kind, fixed and changing K."""
    from specdecode.proposers import HybridProposer, PromptLookupProposer, SuffixProposer
    from specdecode.schedule import AutoK, HeuristicK

    times = [0.01 * (1 + 0.1 * i) for i in range(17)]
    return [
        ("draft K=1", DraftModelProposer(draft.fork()), 1),
        ("draft K=3", DraftModelProposer(draft.fork()), 3),
        ("draft K=6 p_min", DraftModelProposer(draft.fork(), p_min=0.3), 6),
        ("self-draft K=4", DraftModelProposer(target.fork()), 4),
        ("draft heuristic", DraftModelProposer(draft.fork()), HeuristicK(2, 8)),
        ("draft auto", DraftModelProposer(draft.fork()), AutoK(times, 16, draft_seconds_per_token=0.002)),
        ("prompt-lookup", PromptLookupProposer(), 8),
        ("suffix", SuffixProposer(), 8),
        ("hybrid", HybridProposer(SuffixProposer(), DraftModelProposer(draft.fork()),
                                  verify_cost=[1 + 0.05 * i for i in range(17)], draft_cost=0.3), 16),
    ]


@pytest.mark.parametrize("int8", [None, "kn"], ids=["fp32", "int8"])
@pytest.mark.parametrize("prompt", list(INVARIANT_PROMPTS))
@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=40, temperature=1.0, seed=7),
    SamplingParams(max_new_tokens=40, temperature=0.7, top_p=0.9, top_k=20, seed=123,
                   repetition_penalty=1.2, acceptance_rule="gumbel"),
], ids=["T1", "T0.7-top_p-top_k-rep"])
def test_a_seeded_request_gives_the_same_tokens_whatever_speculates(int8, prompt, params):
    """Same seed, prompt and target: the same token ids as plain sampling with that seed,
    with every proposer (a different draft model, the target's own weights, lookups, the
    hybrid) and every K schedule, on the real fp32 and int8 kernels."""
    target = tiny_model(0, scale=1.0, int8=int8)
    draft = tiny_model(1, scale=1.0, int8=int8)
    ids = INVARIANT_PROMPTS[prompt]
    plain = Engine(target).generate(ids, params).run().token_ids
    assert len(plain) == 40
    drafted = 0
    for label, proposer, k in _invariance_proposers(target, draft):
        gen = Engine(target, proposer, k, debug=True).generate(ids, params).run()
        assert gen.token_ids == plain, label
        drafted += gen.stats.num_draft_tokens
        if label == "self-draft K=4":  # the same weights and noise: every draft accepted
            assert gen.stats.acceptance_rate == 1.0 and gen.stats.num_draft_tokens > 0
    assert drafted > 100
    other = Engine(target).generate(ids, dataclasses.replace(params, seed=params.seed + 1)).run()
    assert other.token_ids != plain


def test_a_seeded_request_of_the_rejection_rule_moves_with_k():
    """Why the gumbel rule is the default for seeded requests: under speculative sampling
    the same seed gives other tokens at another K (each rule is lossless in distribution)."""
    target, draft = _seed_models()
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=7, acceptance_rule="rejection")
    outs = {tuple(Engine(target, DraftModelProposer(draft), k).generate(list(range(10, 30)), params)
                  .run().token_ids) for k in (1, 3, 6)}
    assert len(outs) > 1

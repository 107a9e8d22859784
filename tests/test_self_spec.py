"""Self-speculative decoding: the target drafts for itself (layer skipping, early exit, its
own weights at a lower precision) on its own KV cache, and the output stays the target's."""

from __future__ import annotations

import dataclasses
import json
import warnings
from unittest.mock import patch

import pytest
import torch

import specdecode

from helpers import KERNEL_SHAPES, PROMPTS, randint, ref, run, tiny_model
from lossless import EV, N_RUNS, assert_lossless, probs_of
from specdecode.config import SamplingParams
from specdecode.engine import Engine
from specdecode.layer_skip import SkipProfile, _Evaluator, predicted_speedup, tune_skip
from specdecode import layer_skip, methods
from specdecode.methods import (Method, SpeculativeConfig, build_proposer, build_schedule, read_files, speculative_config,
                                split_method)
from specdecode.profile import verify_profile
from specdecode.models.loading import LoadedModel
from specdecode.models import fused, native, quant
from specdecode.models.self_draft import SelfDraft, sublayer_weights
from specdecode.proposers import DraftModelProposer

GREEDY = SamplingParams(max_new_tokens=40)
LAYERS = 4


def _target(int8=None, seed=0, **kw):
    return tiny_model(seed, n_layers=LAYERS, int8=int8, **kw)


def _cache(lm, n):
    """The first n positions of every layer's keys and values (row 0)."""
    return [(c.k[0, :, :n].clone(), c.v[0, :, :n].clone()) for c in lm.caches]


class _Recording(DraftModelProposer):
    """Records the target's cache after every round (on_accept runs after the rollback)."""

    def __init__(self, target, layers, weights=None, **skips):
        super().__init__(target.self_draft(layers, weights, **skips), lazy_prefill=True)
        self.target, self.snapshots = target, []

    def on_accept(self, state):
        super().on_accept(state)
        self.snapshots.append((len(state.tokens) - 1, _cache(self.target, self.target.seq_len)))


def _assert_no_trace(snapshots, full, exact: bool) -> None:
    """Every round's cache (positions 0..n-1 the target reads) equals plain decoding's
    ``full`` cache: bit for bit where ``exact`` (int8), else to fp32 rounding."""
    for n, snap in snapshots:
        for (k, v), (k0, v0) in zip(snap, full):
            if exact:
                assert torch.equal(k, k0[:, :n]) and torch.equal(v, v0[:, :n])
            else:
                torch.testing.assert_close(k, k0[:, :n], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(v, v0[:, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("int8", [None, "kn"], ids=["fp32", "int8"])
@pytest.mark.parametrize("layers", [[0, 2], [0], [0, 1, 2, 3]], ids=["skip-1-3", "exit-1", "all"])
def test_self_draft_is_lossless_and_leaves_no_trace_in_the_cache(int8, layers):
    """Greedy output equals plain decoding; after every round the cache the target reads
    equals what plain decoding built for the same tokens (int8: bit for bit, fp32: to
    rounding, as its verify rows do)."""
    tgt, prompt = _target(int8), PROMPTS["twenty"]
    plain = Engine(tgt, None, None).generate(prompt, GREEDY).run()
    full = _cache(tgt, tgt.seq_len)
    proposer = _Recording(tgt, layers)
    gen, blocks = run(tgt, proposer, 3, prompt, GREEDY)
    assert gen.token_ids == plain.token_ids
    assert gen.stats.num_draft_tokens > 0 and len(proposer.snapshots) == len(blocks)
    if layers == [0, 1, 2, 3]:  # the full model as its own draft: every draft is accepted
        assert gen.stats.acceptance_rate == 1.0
    for n, _ in proposer.snapshots:
        assert n == tgt.seq_len or n <= len(prompt) + len(plain.token_ids)
    _assert_no_trace(proposer.snapshots, full, exact=bool(int8))


SUBLAYER_SKIPS = [  # (layers run, skipped attention sublayers, skipped MLP sublayers)
    (None, (1, 2), ()), (None, (), (1, 3)), ([0, 1, 3], (3,), (0,)), ([0, 2], (0,), (0, 2))]


@pytest.mark.parametrize("int8", [None, "kn", "vnni"], ids=["fp32", "int8", "int8-fused"])
@pytest.mark.parametrize("layers,attn,mlp", SUBLAYER_SKIPS, ids=["attn-1-2", "mlp-1-3", "mixed", "mostly-mlp"])
def test_sublayer_self_draft_is_lossless_and_leaves_no_trace_in_the_cache(int8, layers, attn, mlp,
                                                                          monkeypatch):
    """A draft that skips attention and/or MLP sublayers (SWIFT, arXiv:2410.06916): greedy
    output equals plain decoding, and after every round the cache the target reads equals
    plain decoding's (int8: bit for bit; "int8-fused": the layer stack in one C call, its
    sublayer flags; the others: the modules)."""
    fused_here = int8 == "vnni" and quant.vnni_kernel()[0] is not None
    tgt = tiny_model(0, n_layers=LAYERS, int8="vnni" if fused_here else int8 and "kn",
                     **(KERNEL_SHAPES if int8 == "vnni" else {}))
    flags, real = [], fused.run
    monkeypatch.setattr(fused, "run", lambda *args: flags.append(args[-2:]) or real(*args))
    prompt = PROMPTS["twenty"]
    plain = Engine(tgt, None, None).generate(prompt, GREEDY).run()
    full = _cache(tgt, tgt.seq_len)
    proposer = _Recording(tgt, layers, skip_attn=attn, skip_mlp=mlp)
    gen, blocks = run(tgt, proposer, 3, prompt, GREEDY)
    assert gen.token_ids == plain.token_ids
    assert gen.stats.num_draft_tokens > 0 and len(proposer.snapshots) == len(blocks)
    assert gen.stats.acceptance_rate < 1.0  # the skips change the draft
    if fused_here:  # the draft passes ran through the stack, with their flags (without the
        # AVX512-VNNI kernel this case runs int8 "kn" modules, as the one above)
        assert (frozenset(attn), frozenset(mlp)) in flags
    _assert_no_trace(proposer.snapshots, full, exact=bool(int8))


def test_sublayer_self_draft_checks_its_sublayers_and_estimates_its_cost():
    tgt = _target()
    a, m = sublayer_weights(tgt.args)
    assert tgt.self_draft([0, 2]).cost == 0.5
    assert tgt.self_draft(None, skip_attn=(1,), skip_mlp=(2, 3)).cost == pytest.approx(
        (4 * (a + m) - a - 2 * m) / (4 * (a + m)))
    for kw, words in [(dict(skip_attn=(4,)), r"skip_attn=\[4\]: allowed: .*0..3"),
                      (dict(skip_mlp=(2, 1)), r"skip_mlp=\[2, 1\]: allowed: sorted unique"),
                      (dict(layers=[0, 2], skip_attn=(1,)), r"skip_attn=\[1\]: .*\(\[0, 2\]\)")]:
        with pytest.raises(ValueError, match=words):
            tgt.self_draft(**kw)
    # drafts of other sublayers never share a pass (SelfDraft.forward_together)
    assert tgt.self_draft(None, skip_attn=(1,)).same_pass() != tgt.self_draft(None, skip_mlp=(1,)).same_pass()


def test_a_draft_that_wrote_below_the_targets_length_would_be_caught():
    """The cache check above fails when the draft's entries are left where the target reads:
    here the draft's pass is kept (no verify over that slot) by writing it at the target's
    length and then advancing the target over it."""
    tgt = _target("kn")
    prompt = PROMPTS["twenty"]
    tgt.allocate(1, 64)
    tgt.forward(torch.tensor([prompt[:-1]]), num_logits=0)
    draft = tgt.self_draft([0])
    draft.allocate(1, 64)
    draft.forward(torch.tensor([prompt[-1:]]), num_logits=1)
    layer0 = tgt.caches[0].k[0, :, len(prompt) - 1].clone()
    tgt.forward(torch.tensor([prompt[-1:]]), num_logits=1)  # the verify pass overwrites the slot
    assert torch.equal(layer0, tgt.caches[0].k[0, :, len(prompt) - 1])  # layer 0 runs alike
    # a skipped layer's entry in the last layer differs from the draft's residual stream
    other = tiny_model(0, n_layers=LAYERS, int8="kn")
    other.allocate(1, 64)
    other.forward(torch.tensor([prompt[:-1]]), num_logits=0)
    d2 = other.self_draft([0, 3])
    d2.allocate(1, 64)
    d2.forward(torch.tensor([prompt[-1:]]), num_logits=1)
    stale = other.caches[3].k[0, :, len(prompt) - 1].clone()
    other.forward(torch.tensor([prompt[-1:]]), num_logits=1)
    assert not torch.equal(stale, other.caches[3].k[0, :, len(prompt) - 1])


def test_self_draft_at_a_lower_precision_is_lossless():
    """self-draft: the fp32 target's int8 copy drafts on the fp32 target's cache."""
    tgt = _target()
    weights = _target("kn")
    prompt = PROMPTS["twenty"]
    plain = Engine(tgt, None, None).generate(prompt, GREEDY).run()
    full = _cache(tgt, tgt.seq_len)
    proposer = _Recording(tgt, None, weights)
    gen, _ = run(tgt, proposer, 4, prompt, GREEDY)
    assert gen.token_ids == plain.token_ids
    assert gen.stats.acceptance_rate > 0.8  # the same weights, rounded: nearly always right
    # the int8 copy wrote its drafts into the fp32 target's buffers: none is left where the
    # target reads, after any round
    assert proposer.snapshots
    _assert_no_trace(proposer.snapshots, full, exact=False)


def test_self_draft_rejects_weights_of_another_shape_or_dtype():
    tgt = _target()
    with pytest.raises(ValueError, match="architecture"):
        tgt.self_draft(None, tiny_model(0, n_layers=2))
    with pytest.raises(ValueError, match="must agree"):
        tgt.self_draft(None, _target().to(torch.bfloat16))
    with pytest.raises(ValueError, match="allowed: sorted unique"):
        tgt.self_draft([2, 1])
    with pytest.raises(ValueError, match="allowed: sorted unique"):
        tgt.self_draft([0, LAYERS])


def test_layer_skip_in_the_batched_engine_equals_each_solo_run():
    """Rows with their own layer-skip drafts on their own cache rows: each output is its
    solo run's (the draft of one row never touches another's)."""
    from specdecode.batch import BatchEngine

    tgt = _target("kn")
    prompts = [PROMPTS["twenty"], PROMPTS["repetitive"], PROMPTS["one"], randint(30, 9)]
    solo = [Engine(tgt, None, None).generate(p, GREEDY).run().token_ids for p in prompts]
    together = []
    real = SelfDraft.forward_together

    def spy(passes):
        together.append(len(passes))
        return real(passes)

    SelfDraft.forward_together = staticmethod(spy)
    try:
        engine = BatchEngine(tgt, 4, 200, debug=True)
        # two rows skip layers 1 and 3, one layer 3 only, one exits after layer 0
        layers = [[0, 2], [0, 1, 2], [0, 2], [0]]
        gens = [engine.add(p, GREEDY, proposer=DraftModelProposer(tgt.self_draft(ls), lazy_prefill=True))
                for p, ls in zip(prompts, layers)]
        engine.run()
        engine.close()
    finally:
        SelfDraft.forward_together = staticmethod(real)
    assert [g.token_ids for g in gens] == solo
    assert all(g.stats.num_draft_tokens > 0 for g in gens)
    assert max(together) == 2  # the two rows of the same layers drafted in one pass


SAMPLING_CASES = [  # (draft, acceptance rule, sampling settings): each kind, several warpers
    ("layer-skip", "rejection", dict(temperature=1.3, top_k=5)),
    ("layer-skip", "gumbel", dict(temperature=1.3, top_k=5)),
    ("self-draft", "rejection", dict(temperature=0.5, top_p=0.9)),
    ("self-draft", "gumbel", dict(temperature=2.0)),
    ("self", "rejection", dict(temperature=1.0, top_k=4)),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind,rule,settings", SAMPLING_CASES,
                         ids=[f"{d}-{r}-" + "-".join(f"{k}{v}" for k, v in o.items()) for d, r, o in SAMPLING_CASES])
def test_self_speculative_sampling_follows_the_target(kind, rule, settings):
    """20k seeded requests of a 6-token, 2-layer model: the joint of the first two tokens is
    the target's (enumerated with one-token passes through the engine's own warpers), with
    each self-speculative draft: one of its two layers (layer-skip), its int8 copy
    (self-draft), and suffix matching or layer-skip (self, the hybrid)."""
    tgt = tiny_model(3, vocab_size=EV, scale=1.0)
    params = SamplingParams(max_new_tokens=3, **settings)
    prompt = [2, 3]

    def probs(ids):
        tgt.allocate(1, 8)
        logits = tgt.forward(torch.tensor([ids]), num_logits=1)[:, -1:].clone()
        return probs_of(logits, params, torch.tensor([ids]), None)[0, 0].double()

    p1 = probs(prompt)
    joint = p1[:, None] * torch.stack([probs(prompt + [a]) for a in range(EV)])
    if kind == "layer-skip":
        proposer = DraftModelProposer(tgt.self_draft([0]), lazy_prefill=True)
    elif kind == "self-draft":
        copy = tiny_model(3, vocab_size=EV, scale=1.0, int8="kn")
        proposer = DraftModelProposer(tgt.self_draft(None, copy), lazy_prefill=True)
    else:
        target = LoadedModel(lm=tgt, tokenizer=None, name="tiny", eos_token_ids=())
        proposer = build_proposer(SpeculativeConfig("self", skip_layers=(1,)), target, None)
    engine = Engine(tgt, proposer, 2, debug=True)
    counts = torch.zeros(EV, EV, dtype=torch.long)
    proposed = 0
    for seed in range(N_RUNS):
        gen = engine.generate(prompt, dataclasses.replace(params, seed=seed, acceptance_rule=rule)).run()
        counts[gen.token_ids[0], gen.token_ids[1]] += 1
        proposed += gen.stats.num_draft_tokens
    assert proposed > N_RUNS // 4  # the draft took part in the rounds that decided the two tokens
    assert_lossless(counts, joint)


# -- choosing the layers

def _loaded(lm):
    from helpers import local_tokenizer

    return LoadedModel(lm=lm, tokenizer=local_tokenizer(), name="tiny", eos_token_ids=())


def test_teacher_forced_agreement_is_exact_for_the_full_model_and_measures_skips():
    lm = _target("kn")
    samples = [(PROMPTS["twenty"] + list(ref(tuple(PROMPTS["twenty"]), GREEDY, (), lm))[:20], 20)]
    ev = _Evaluator(lm, samples)
    assert ev.matches(list(range(LAYERS))) == [[True] * 20]
    # the agreement of a skip = an actual one-step draft in the engine's position
    some = ev.matches([0, 3])[0]
    ids, n0 = samples[0]
    draft = lm.self_draft([0, 3])
    for i, hit in enumerate(some):
        lm.allocate(1, 64)
        lm.forward(torch.tensor([ids[:n0 - 1 + i]]), num_logits=0)
        draft.allocate(1, 64)
        tok = int(draft.forward(torch.tensor([[ids[n0 - 1 + i]]]), num_logits=1)[0, -1].argmax())
        assert hit == (tok == ids[n0 + i])
    assert not all(some)  # the tiny model's layers matter: the measure sees it


def test_predicted_speedup_follows_the_cost_model():
    # always right, free: K = MAX_K tokens a pass over a verify of equal cost
    k, s = predicted_speedup([[True] * 50], 0.0, [1.0] * 10)
    assert k == 8 and s == pytest.approx(1 + 8 * 42 / 50 + sum(range(1, 9)) / 50)
    # never right: K = 1 costs a draft pass for nothing
    k, s = predicted_speedup([[False] * 10], 0.5, [1.0] * 10)
    assert k == 1 and s == pytest.approx(1 / 1.5)


def test_tune_skip_writes_a_profile_the_method_loads(tmp_path):
    from helpers import local_tokenizer

    lm = _target("kn", vocab_size=len(local_tokenizer()))
    target = _loaded(lm)
    prompts = (("completion", "a b c d e f"), ("completion", "g h i j k"))
    profile = tune_skip(target, max_new_tokens=12, progress=False, prompts=prompts)
    assert profile.n_layers == LAYERS and profile.skip and len(profile.skip) < LAYERS
    best = max(profile.search, key=lambda e: e["predicted_speedup"])
    assert list(profile.skip) == best["skip"] and profile.k == best["k"]
    assert len(profile.calibration["single_layer_agreement"]) == LAYERS
    path = tmp_path / "p.json"
    profile.save(path)
    assert SkipProfile.load(path, LAYERS) == profile
    spec = speculative_config(f"layer-skip:profile={path}", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tuned for this very target: nothing to say
        proposer = build_proposer(spec, target, None)
    assert proposer.draft.layers == profile.layers()
    # the same layer count, another model: used (lossless either way), with a warning naming both
    other = LoadedModel(lm=lm, tokenizer=target.tokenizer, name="other-model", eos_token_ids=())
    with pytest.warns(UserWarning, match=f"p.json was tuned for tiny {lm.weight_format}; this target is "
                                         f"other-model {lm.weight_format}.*tune-skip"):
        assert build_proposer(spec, other, None).draft.layers == profile.layers()
    gen, _ = run(lm, proposer, spec.num_speculative_tokens, PROMPTS["twenty"], GREEDY)
    assert gen.token_ids == Engine(lm, None, None).generate(PROMPTS["twenty"], GREEDY).run().token_ids


def test_skip_profile_errors_name_the_file_and_the_fix(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="bad.json.*tune-skip"):
        SkipProfile.load(bad)
    good = SkipProfile((1,), 3, 0.9, 0.5, 1.1, 4)
    good.save(tmp_path / "g.json")
    with pytest.raises(ValueError, match="4 layers, this target has 28"):
        SkipProfile.load(tmp_path / "g.json", 28)
    d = json.loads((tmp_path / "g.json").read_text())
    d["skip"] = [9]
    (tmp_path / "g.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="0..3"):
        SkipProfile.load(tmp_path / "g.json")
    # malformed profiles: one line naming what is wrong (were KeyError / TypeError / AttributeError)
    good_d = json.loads(good.to_json())
    for edit, words in [(lambda d: d.pop("skip"), "missing skip"), (lambda d: d.pop("format"), "not a profile"),
                        (lambda d: d.update(extra=1), "unknown fields extra"),
                        (lambda d: d.update(skip=3), "skip = 3 is not a list"),
                        (lambda d: d.update(k="4"), "k = '4' is not a number"),
                        (lambda d: d.update(k=0), "k = 0 is invalid; allowed 1..64"),
                        (lambda d: d.update(skip=[1, "2"]), "skipped layers"),
                        (lambda d: d.update(skip=[]), "no layer to skip")]:
        d = json.loads(json.dumps(good_d))
        edit(d)
        (tmp_path / "m.json").write_text(json.dumps(d))
        with pytest.raises(ValueError, match=f"m.json: .*{words}.*tune-skip"):
            SkipProfile.load(tmp_path / "m.json")
    (tmp_path / "m.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a profile \\(a JSON list; a profile is a JSON object"):
        SkipProfile.load(tmp_path / "m.json")


def test_sublayer_profiles_round_trip_and_old_files_still_load(tmp_path):
    """skip_attn / skip_mlp in a profile: saved and loaded alike; a profile without them
    (every older file) loads with none and is written without them; a layer whose two
    sublayers are listed is a skipped layer; bad lists are named."""
    sub = SkipProfile((0,), 2, 0.8, 0.6, 1.2, LAYERS, skip_attn=(1, 3), skip_mlp=(2,))
    sub.save(tmp_path / "s.json")
    assert SkipProfile.load(tmp_path / "s.json", LAYERS) == sub
    assert sub.layers() == [1, 2, 3]
    whole = SkipProfile((1,), 3, 0.9, 0.5, 1.1, LAYERS)
    assert "skip_attn" not in whole.to_json() and "skip_mlp" not in whole.to_json()
    old = {"skip": [1], "k": 3, "acceptance": 0.9, "draft_cost": 0.5, "predicted_speedup": 1.1,
           "n_layers": LAYERS, "target": "", "weight_format": "", "calibration": None, "search": [],
           "format": 1}  # a profile as tune-skip wrote it before sublayers
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = SkipProfile.load(tmp_path / "old.json", LAYERS)
    assert loaded == whole and loaded.skip_attn == loaded.skip_mlp == ()
    # sublayers only (no whole layer), and both sublayers of one layer
    for extra, expect in [(dict(skip=[], skip_attn=[2]), ((), (2,), ())),
                          (dict(skip=[], skip_attn=[1, 2], skip_mlp=[2]), ((2,), (1,), ())),
                          (dict(skip=[1], skip_attn=[1, 3]), ((1,), (3,), ()))]:
        (tmp_path / "e.json").write_text(json.dumps(old | extra))
        p = SkipProfile.load(tmp_path / "e.json", LAYERS)
        assert (p.skip, p.skip_attn, p.skip_mlp) == expect
    for extra, words in [(dict(skip_attn=[9]), r"skipped attention sublayers \[9\]: allowed: .*0..3"),
                         (dict(skip_mlp=[1, 1]), r"skipped MLP sublayers \[1, 1\]: allowed: distinct"),
                         (dict(skip_mlp="2"), "skip_mlp = '2' is not a list"),
                         (dict(skip=[], skip_attn=[], skip_mlp=[]), "no layer to skip"),
                         (dict(skip=[0, 1], skip_attn=[2, 3], skip_mlp=[2, 3]), "leaves no draft")]:
        (tmp_path / "e.json").write_text(json.dumps(old | extra))
        with pytest.raises(ValueError, match=f"e.json: .*{words}.*tune-skip"):
            SkipProfile.load(tmp_path / "e.json", LAYERS)


def test_tune_skip_over_sublayers_writes_a_profile_the_method_loads(tmp_path):
    from helpers import local_tokenizer

    lm = _target("kn", vocab_size=len(local_tokenizer()))
    target = _loaded(lm)
    prompts = (("completion", "a b c d e f"), ("completion", "g h i j k"))
    calls = []
    real = layer_skip.draft_cost

    def spy(lm_, layers, *args, **kw):
        calls.append((tuple(layers), kw.get("skip_attn", ()), kw.get("skip_mlp", ())))
        return real(lm_, layers, *args, **kw)

    layer_skip.draft_cost = spy
    try:
        profile = tune_skip(target, max_new_tokens=12, progress=False, prompts=prompts, sublayers=True)
    finally:
        layer_skip.draft_cost = real
    agreement = profile.calibration["single_sublayer_agreement"]
    assert len(agreement["attn"]) == len(agreement["mlp"]) == LAYERS
    assert profile.skip or profile.skip_attn or profile.skip_mlp
    best = max(profile.search, key=lambda e: e["predicted_speedup"])
    assert (list(profile.skip), list(profile.skip_attn), list(profile.skip_mlp), profile.k) == \
        (best["skip"], best["skip_attn"], best["skip_mlp"], best["k"])
    # each candidate's cost was measured with its sublayers skipped
    assert len(calls) == len(profile.search)
    assert sorted(calls) == sorted((tuple(i for i in range(LAYERS) if i not in e["skip"]), tuple(e["skip_attn"]),
                                    tuple(e["skip_mlp"])) for e in profile.search)
    assert any(e["skip_attn"] or e["skip_mlp"] for e in profile.search)
    # the candidates grow by the least agreement lost per weight skipped: an attention
    # sublayer here holds fewer bytes than an MLP one
    weight = {(i, part): sublayer_weights(lm.args)[part] for i in range(LAYERS) for part in (0, 1)}
    assert weight[(0, 0)] < weight[(0, 1)]
    single = {(i, part): agreement[name][i] for i in range(LAYERS) for part, name in ((0, "attn"), (1, "mlp"))}
    order = sorted(single, key=lambda u: ((1 - single[u]) / weight[u], u))

    def units(e):
        return {(i, part) for i in e["skip"] for part in (0, 1)} | {(i, 0) for i in e["skip_attn"]} | \
            {(i, 1) for i in e["skip_mlp"]}
    two = [units(e) for e in profile.search if len(units(e)) == 2]
    assert two == [set(order[:2])]
    path = tmp_path / "p.json"
    profile.save(path)
    assert SkipProfile.load(path, LAYERS) == profile
    spec = speculative_config(f"layer-skip:profile={path}", False)
    proposer = build_proposer(spec, target, None)
    d = proposer.draft
    assert (d.layers, d.skip_attn, d.skip_mlp, d.cost) == (profile.layers(), profile.skip_attn, profile.skip_mlp,
                                                             profile.draft_cost)
    gen, _ = run(lm, proposer, spec.num_speculative_tokens, PROMPTS["twenty"], GREEDY)
    assert gen.token_ids == Engine(lm, None, None).generate(PROMPTS["twenty"], GREEDY).run().token_ids


# -- the methods' options

def test_method_strings_carry_their_own_options():
    assert split_method("layer-skip:layers=3+5-7") == ("layer-skip", {"skip_layers": (3, 5, 6, 7)})
    assert split_method("early-exit:layer=2") == ("early-exit", {"exit_layer": 2})
    assert split_method("self-draft:dtype=int8") == ("self-draft", {"self_draft_dtype": "int8"})
    spec = speculative_config("layer-skip:layers=1", False, 2)
    assert spec.skip_layers == (1,) and spec.num_speculative_tokens == 2
    assert SpeculativeConfig("layer-skip").num_speculative_tokens == 1
    with pytest.raises(ValueError, match="takes no option.*allowed: layer"):
        split_method("early-exit:layers=2")
    with pytest.raises(ValueError, match="allowed: layer indices joined by"):
        split_method("layer-skip:layers=a")
    # were accepted as "skip nothing", or the last of two values
    for text, words in [("layer-skip:layers=5-3", "A <= B"), ("layer-skip:layers=3-", "layers='3-'"), ("layer-skip:layers=+", "layers='\\+'"),
                        ("layer-skip:layers=+3", "layers='\\+3'"), ("layer-skip:layers=1,,2", "layers='1,,2'"),
                        ("layer-skip:layers=3 +5", "layers='3 \\+5'"),
                        ("layer-skip:layers=", "no value; e.g. layers=3"), ("eagle3:head=", "no value"),
                        ("layer-skip:layers=1:layers=2", "twice"), ("self:profile=", "no value")]:
        with pytest.raises(ValueError, match=words):
            split_method(text)
    # a bench row's option names what gives it here
    with pytest.raises(ValueError, match=r"k= is a bench row's option: give --k on the command line, num_speculative_tokens= in the Python API"):
        split_method("draft:k=4")
    for key in methods.BENCH_ROW_OPTIONS:  # every bench row option has its hint
        with pytest.raises(ValueError, match=f"{key}= is a bench row's option: give .*in the Python API"):
            split_method(f"draft:{key}=1")
    for k in ("auto", "heuristic", 3):
        with pytest.raises(ValueError, match="'ar' proposes nothing"):
            speculative_config("ar", False, k)
    with pytest.raises(ValueError, match="int8, int4"):
        SpeculativeConfig("self-draft", self_draft_dtype="int2")
    with pytest.raises(ValueError, match="layers= or profile= in a method string, skip_layers or skip_profile"):
        SpeculativeConfig("layer-skip", skip_layers=(1,), skip_profile="x.json")
    with pytest.raises(ValueError, match="'layer-skip' and 'self', not 'draft'"):
        SpeculativeConfig("draft", skip_layers=(1,))


def test_sublayer_options_parse_build_and_name_bad_values():
    """attn= and mlp= (skip_attn, skip_mlp): parsed, combinable with layers=, for layer-skip
    and self only; a layer with both sublayers listed is skipped whole; bad values named."""
    assert split_method("layer-skip:attn=3+5:mlp=7") == ("layer-skip", {"skip_attn": (3, 5), "skip_mlp": (7,)})
    assert split_method("self:layers=1:attn=2-3") == ("self", {"skip_layers": (1,), "skip_attn": (2, 3)})
    spec = speculative_config("layer-skip:mlp=0+2", False)
    assert spec.skip_mlp == (0, 2) and spec.skip_layers is None and methods.skips_given(spec)
    for text, words in [("layer-skip:attn=x", r"attn='x' is invalid; .*e.g. attn=3\+5-8\+12"),
                        ("layer-skip:mlp=2-1", r"mlp='2-1' is invalid"), ("layer-skip:attn=", "no value"),
                        ("early-exit:attn=1", "takes no option.*allowed: layer"),
                        ("draft:mlp=1", r"takes no option \['mlp'\]")]:
        with pytest.raises(ValueError, match=words):
            split_method(text)
    for kw, words in [(dict(skip_attn="3"), "skip_attn = '3' is invalid; allowed: layer indices"),
                      (dict(skip_mlp=(-1,)), r"skip_mlp = \(-1,\) is invalid"),
                      (dict(skip_mlp=3), "skip_mlp = 3 is invalid"),
                      (dict(skip_attn=(True,)), r"skip_attn = \(True,\) is invalid"),
                      (dict(skip_attn=(1,), skip_profile="x.json"), "not both")]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig("layer-skip", **kw)
    with pytest.raises(ValueError, match="'layer-skip' and 'self', not 'early-exit'"):
        SpeculativeConfig("early-exit", exit_layer=1, skip_attn=(1,))
    target = _loaded(_target("kn"))
    d = build_proposer(SpeculativeConfig("layer-skip", skip_layers=(3,), skip_attn=(0, 1), skip_mlp=(1, 2)),
                       target, None).draft
    assert (d.layers, d.skip_attn, d.skip_mlp) == ([0, 2], (0,), (2,))  # layer 1: both sublayers
    for kw, words in [(dict(skip_attn=(7,)), r"skipped attention sublayers \[7\]: allowed: .*0..3"),
                      (dict(skip_mlp=(1, 1)), r"skipped MLP sublayers \[1, 1\]"),
                      (dict(skip_layers=(0, 1), skip_attn=(2, 3), skip_mlp=(2, 3)), "leaves no draft")]:
        with pytest.raises(ValueError, match=words):
            build_proposer(SpeculativeConfig("layer-skip", **kw), target, None)
    # the self method's hybrid drafts with them too
    hybrid = build_proposer(SpeculativeConfig("self", skip_attn=(1,)), target, None)
    assert [(m.layers, m.skip_attn) for m in hybrid.models() if hasattr(m, "skip_attn")] == [([0, 1, 2, 3], (1,))]


def test_methods_build_their_self_drafts_and_refuse_bad_values(monkeypatch):
    lm = _target("kn")
    target = _loaded(lm)
    ls = build_proposer(SpeculativeConfig("layer-skip", skip_layers=(1, 3)), target, None)
    assert ls.draft.layers == [0, 2] and ls.draft.target is lm
    ee = build_proposer(SpeculativeConfig("early-exit", exit_layer=2), target, None)
    assert ee.draft.layers == [0, 1]
    with pytest.raises(ValueError, match="early-exit:layer=E"):
        build_proposer(SpeculativeConfig("early-exit"), target, None)
    with pytest.raises(ValueError, match="allowed 1..3"):
        build_proposer(SpeculativeConfig("early-exit", exit_layer=4), target, None)
    with pytest.raises(ValueError, match="0..3"):
        build_proposer(SpeculativeConfig("layer-skip", skip_layers=(7,)), target, None)
    with pytest.raises(ValueError, match="leaves no draft"):
        build_proposer(SpeculativeConfig("layer-skip", skip_layers=(0, 1, 2, 3)), target, None)
    # an int8 target's int8 copy would cost as much: int4 is allowed (where its kernel runs), int8 refused
    monkeypatch.setattr(methods.self_spec, "q4k_kernel", lambda: (object(), ""))
    with pytest.raises(ValueError, match="not below this target's int8.*dtype=int4"):
        build_proposer(SpeculativeConfig("self-draft", self_draft_dtype="int8"), target, None)
    # on a CPU without the int4 kernel (from a new-user pass: the two messages sent the user
    # back and forth between int8 and int4)
    monkeypatch.setattr(methods.self_spec, "q4k_kernel", lambda: (None, "a test"))
    for dtype in ("int4", "int8"):
        with pytest.raises(ValueError, match="use layer-skip or self"):
            build_proposer(SpeculativeConfig("self-draft", self_draft_dtype=dtype), target, None)
    assert "AVX512-VNNI" in methods.cannot_run(SpeculativeConfig("self-draft"), target)
    from specdecode.models.hf import HFCausalLM
    with pytest.raises(ValueError, match="native runtime"):
        build_proposer(SpeculativeConfig("layer-skip", skip_layers=(1,)),
                       LoadedModel(lm=HFCausalLM.__new__(HFCausalLM), name="hf"), None)


def test_the_default_profile_is_made_before_a_batch_holds_the_target():
    """A batch of prompts with method "self": its profile is measured before the batched
    engine holds the target (which no measurement may touch), and each output is the target's."""
    import specdecode
    from helpers import local_tokenizer
    from specdecode.layer_skip import default_profile_path

    lm = _target("kn", seed=4, vocab_size=len(local_tokenizer()))
    target = _loaded(lm)
    target.path = None
    prompts = ["def add(a, b):", "The capital of France"]
    plain = [specdecode.generate(target, p, max_new_tokens=12).token_ids for p in prompts]
    out = specdecode.generate(target, prompts, method="self", max_new_tokens=12)
    assert [r.token_ids for r in out] == plain
    assert default_profile_path(target).exists()
    # while a request holds the target, no profile can be measured: a clear error
    gen = Engine(lm, None, None).generate([5, 6, 7], GREEDY)
    next(iter(gen))
    with pytest.raises(RuntimeError, match="run `specdecode tune-skip` first"):
        tune_skip(target, max_new_tokens=4, progress=False)
    gen.close()


@pytest.mark.parametrize("int8", [None, "kn"], ids=["fp32", "int8"])
def test_a_self_drafts_head_over_the_first_ids_keeps_their_logits_and_the_output(int8, monkeypatch):
    """A self-draft whose LM head covers the first ``vocab`` token ids (FR-Spec): those
    logits are the whole head's bits, the others -inf (never drafted), and the output stays
    plain decoding's. "auto" restricts a vocabulary more than twice DRAFT_VOCAB only; bad
    values are named."""
    tgt, prompt = _target(int8), PROMPTS["twenty"]
    n = len(prompt) - 1
    tgt.allocate(1, 64)
    tgt.forward(torch.tensor([prompt[:-1]]), num_logits=0)
    x = torch.tensor([[prompt[-1]]])
    whole = tgt.self_draft([0, 2], vocab=None).forward(x, 1)
    part = tgt.self_draft([0, 2], vocab=32).forward(x, 1)
    assert tgt.seq_len == n and part.shape == whole.shape == (1, 1, 96)
    assert torch.equal(part[..., :32], whole[..., :32]) and torch.isneginf(part[..., 32:]).all()
    assert tgt.self_draft([0]).vocab is None  # 96 ids: not twice DRAFT_VOCAB
    monkeypatch.setattr(native, "DRAFT_VOCAB", 32)
    assert tgt.self_draft([0]).vocab == 32
    plain = Engine(tgt, None, None).generate(prompt, GREEDY).run()
    proposer = DraftModelProposer(tgt.self_draft([0, 2]), lazy_prefill=True)
    gen, _ = run(tgt, proposer, 3, prompt, GREEDY)
    assert gen.token_ids == plain.token_ids and gen.stats.num_draft_tokens > 0
    for bad in (8, 33, 112, True, "all"):
        with pytest.raises(ValueError, match="vocab="):
            tgt.self_draft([0], vocab=bad)


def test_the_k_controls_drive_the_self_speculative_methods(tmp_path):
    """layer-skip takes the K its profile predicts best unless K is given; auto's first
    estimate of a draft step is the self-draft's share of the target's T(1) (not free);
    heuristic and auto K keep every self-speculative method's output the target's."""
    lm = _target("kn")
    target = _loaded(lm)
    profile = SkipProfile((1,), 3, 0.9, 0.4, 1.1, LAYERS, target="tiny", weight_format=lm.weight_format)
    path = tmp_path / "p.json"
    profile.save(path)
    spec = speculative_config(f"layer-skip:profile={path}", False)
    proposer = build_proposer(spec, target, None)
    built = []
    with patch.object(type(lm), "self_draft", lambda *a, **kw: built.append(a)):
        assert build_schedule(spec, target, None, proposer).k == 3
    assert built == []  # the K is the profile's: the schedule builds no second draft
    assert build_schedule(speculative_config(f"layer-skip:profile={path}", False, 2), target, None, proposer).k == 2
    assert build_schedule(speculative_config("layer-skip:layers=0+2+3", False), target, None).k == 1  # no profile
    auto = build_schedule(speculative_config(f"layer-skip:profile={path}", False, "auto"), target, None, proposer)
    t1 = verify_profile(target, auto.max_k)[0]
    assert auto.draft_seconds_per_token == pytest.approx(0.4 * t1)
    exit_spec = speculative_config("early-exit:layer=2", False, "auto")
    exit_auto = build_schedule(exit_spec, target, None, build_proposer(exit_spec, target, None))
    assert exit_auto.draft_seconds_per_token == pytest.approx(t1 * 2 / LAYERS)  # its share of layers

    plain = Engine(lm, None, None).generate(PROMPTS["twenty"], GREEDY).run().token_ids
    for method in (f"layer-skip:profile={path}", "early-exit:layer=2", f"self:profile={path}"):
        for k in ("heuristic", "auto"):
            spec = speculative_config(method, False, k)
            proposer = build_proposer(spec, target, None)
            gen = Engine(lm, proposer, build_schedule(spec, target, None, proposer)).generate(
                PROMPTS["twenty"], GREEDY).run()
            assert gen.token_ids == plain, (method, k)
            assert gen.stats.num_draft_tokens > 0, (method, k)


def test_a_parsed_method_keeps_its_options_and_its_files_read_once(tmp_path, monkeypatch):
    """read_files reads a profile= file once: the draft built after the file is deleted is the
    profile's (a server keeps what it started with); speculative_config given a parsed
    config keeps its method and own options and takes the call's K; a profile read for
    another layer count is refused as the file is. A path option's "~" is the home
    directory (a shell leaves it inside "layer-skip:profile=~/p.json")."""
    lm = _target("kn")
    target = _loaded(lm)
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "p.json"
    SkipProfile((1,), 3, 0.9, 0.4, 1.1, LAYERS, target="tiny", weight_format=lm.weight_format).save(path)
    assert split_method("medusa:head=~/h")[1] == {"head_dir": str(tmp_path / "h")}
    served = read_files(speculative_config("layer-skip:profile=~/p.json", False))
    assert isinstance(served.skip_profile, SkipProfile) and read_files(served) is served
    path.unlink()
    spec = speculative_config(served, False, 2)
    assert spec.method is Method.LAYER_SKIP and spec.skip_profile == served.skip_profile
    assert spec.num_speculative_tokens == 2 and spec.k_given
    proposer = build_proposer(spec, target, None)
    assert proposer.draft.layers == [i for i in range(LAYERS) if i != 1]
    assert build_schedule(speculative_config(served, False), target, None, proposer).k == 3  # the profile's K
    gen, _ = run(lm, proposer, 2, PROMPTS["twenty"], GREEDY)
    assert gen.token_ids == Engine(lm, None, None).generate(PROMPTS["twenty"], GREEDY).run().token_ids
    with pytest.raises(ValueError, match="a draft model .* not 'layer-skip'"):
        speculative_config(served, True)
    with pytest.raises(ValueError, match=f"profile {path} was made for a model of {LAYERS + 1} layers, "
                                         f"this target has {LAYERS}"):
        build_proposer(dataclasses.replace(served, skip_profile=dataclasses.replace(
            served.skip_profile, n_layers=LAYERS + 1)), target, None)
    # prompt_lookup_num_tokens selects prompt lookup: a parsed config of another method conflicts
    ids = PROMPTS["twenty"]
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens selects prompt lookup; method='layer-skip' conflicts"):
        specdecode.generate(target, input_ids=ids, method=served, prompt_lookup_num_tokens=3)
    lookup = specdecode.generate(target, input_ids=ids, method=speculative_config("prompt-lookup", False),
                                 prompt_lookup_num_tokens=3, max_new_tokens=12)
    assert lookup.token_ids == specdecode.generate(target, input_ids=ids, method="ar", max_new_tokens=12).token_ids
    with pytest.raises(ValueError, match="p.json: cannot be read"):
        read_files(speculative_config(f"layer-skip:profile={path}", False))

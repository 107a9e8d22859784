"""Medusa's typical acceptance (LOSSY, opt-in: ``medusa:lossy-typical=EPS``): the rule on toy
distributions, the longest accepted path of a tree with ancestor closure, greedy verification
at temperature 0, off by default, lossy where it runs, the errors, and its marks in the stats,
the bench and the CLI (Cai et al., arXiv:2401.10774, section 2.3.1)."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from helpers import KERNEL_SHAPES, PROMPTS, MockLM, hashed_logits, run, tiny_model
from specdecode.config import SamplingParams
from specdecode.engine import Engine
from specdecode.heads import MedusaHeads
from specdecode.methods import Method, SpeculativeConfig, speculative_config, split_method
from specdecode.proposers import DraftOutput, MedusaProposer, Proposer
from specdecode.stats import SpecDecodingStats
from specdecode.tree import DraftTree
from specdecode.verify import (LossyTypical, greedy_verify, greedy_verify_tree, typical_verify,
                               typical_verify_tree, verify_tree)

MEDUSA = LossyTypical(0.09, 0.3)  # Medusa's posterior_threshold and posterior_alpha


def _entropy(p: list[float]) -> float:
    return -sum(x * math.log(x) for x in p if x > 0)


# --------------------------------------------------------------------------- the rule

def test_threshold_is_min_of_eps_and_delta_times_exp_minus_entropy():
    flat = [0.25] * 4  # exp(-H) = 1/4: delta/4 = 0.075 < eps
    peaked = [0.97, 0.01, 0.01, 0.01]  # exp(-H) = 0.845: 0.3 * 0.845 > eps, so eps
    got = MEDUSA.threshold(torch.tensor([flat, peaked]))
    assert got.tolist() == pytest.approx([0.075, 0.09], rel=1e-6)
    mid = [0.5, 0.3, 0.2]
    assert float(MEDUSA.threshold(torch.tensor(mid))) == pytest.approx(
        min(0.09, 0.3 * math.exp(-_entropy(mid))), rel=1e-6)
    # zeros (top-k / top-p cut tokens) add nothing to the entropy
    assert float(MEDUSA.threshold(torch.tensor([0.5, 0.5, 0.0, 0.0]))) == pytest.approx(0.09)
    assert float(LossyTypical(0.5, 0.3).threshold(torch.tensor([0.5, 0.5, 0.0, 0.0]))) == pytest.approx(0.15)
    assert LossyTypical(0.09).delta == pytest.approx(0.3)  # delta defaults to sqrt(eps), as Medusa advises


def test_a_token_above_the_threshold_is_accepted_one_below_rejected():
    # chosen logits at T = 1: p = softmax([3, 2, 0, -1]) = [0.70, 0.26, 0.035, 0.013]
    logits = torch.tensor([3.0, 2.0, 0.0, -1.0])
    p = logits.softmax(-1)
    thr = float(MEDUSA.threshold(p))
    assert thr == pytest.approx(0.09)  # peaked enough that eps is the threshold
    assert p[1] > thr > p[2]
    for token, accepted in ((0, 1), (1, 1), (2, 0), (3, 0)):
        out, n = typical_verify(torch.tensor([[token]]), torch.stack([p, p])[None], MEDUSA)
        assert int(n[0]) == accepted, token
        assert out[0].tolist() == ([token, 0] if accepted else [0, -1])  # then the argmax


def test_the_threshold_depends_on_the_entropy():
    """The same probability 0.08 passes in a flat distribution (low threshold) and fails in
    a peaked one (threshold eps): and the temperature moves it across."""
    flat = torch.full((12,), 1 / 12)  # 0.083 > min(0.09, 0.3 / 12)
    peaked = torch.tensor([0.84, 0.08, 0.08])  # 0.08 < min(0.09, 0.3 * exp(-H)) = 0.09
    assert float(MEDUSA.threshold(flat)) == pytest.approx(0.025)
    assert typical_verify(torch.tensor([[1]]), torch.stack([flat, flat])[None], MEDUSA)[1].item() == 1
    assert typical_verify(torch.tensor([[1]]), torch.stack([peaked, peaked])[None], MEDUSA)[1].item() == 0
    logits = torch.tensor([4.0, 2.0, 1.0, 0.0])
    hot, cold = (logits / 2.0).softmax(-1), (logits / 0.5).softmax(-1)
    assert typical_verify(torch.tensor([[1]]), torch.stack([hot, hot])[None], MEDUSA)[1].item() == 1
    assert typical_verify(torch.tensor([[1]]), torch.stack([cold, cold])[None], MEDUSA)[1].item() == 0


def test_chain_keeps_the_prefix_of_passing_drafts_then_the_argmax():
    probs = torch.tensor([[[0.5, 0.4, 0.1, 0.0], [0.1, 0.1, 0.05, 0.75], [0.2, 0.3, 0.5, 0.0],
                           [0.0, 0.0, 0.0, 1.0]],
                          [[0.6, 0.3, 0.1, 0.0], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 1.0, 0.0],
                           [0.0, 1.0, 0.0, 0.0]]])
    drafts = torch.tensor([[1, 2, 2],    # 0.4 passes, 0.05 fails (then 0.5 would pass: cut)
                           [1, 0, 2]])   # all pass: the bonus is the argmax of the last row
    out, n = typical_verify(drafts, probs, MEDUSA)
    assert n.tolist() == [1, 3]
    assert out.tolist() == [[1, 3, -1, -1], [1, 0, 2, 1]]
    with pytest.raises(ValueError, match=r"expected \[2,4,V\]"):
        typical_verify(drafts, probs[:, :3], MEDUSA)


def _one_hot(logits):
    return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)


def test_at_temperature_zero_it_is_greedy_verification():
    """With the one-hot target of greedy decoding (H = 0, threshold eps) only the argmax
    passes, and the token after is the argmax: exactly greedy verification, chain and tree."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(3, 5, 7, generator=g)
        drafts = torch.where(torch.rand(3, 4, generator=g) < 0.6, logits[:, :4].argmax(-1),
                             torch.randint(0, 7, (3, 4), generator=g))
        got = typical_verify(drafts, _one_hot(logits), MEDUSA)
        want = greedy_verify(drafts, logits)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        tree = DraftTree(torch.randint(0, 7, (6,), generator=g), torch.tensor([-1, -1, 0, 0, 1, 2]))
        rows = torch.randn(7, 7, generator=g)
        for i, parent in enumerate(tree.parents.tolist()):  # about half the nodes the argmax
            if torch.rand((), generator=g) < 0.5:
                rows[parent + 1, tree.token_ids[i]] += 5.0
        assert typical_verify_tree(tree, _one_hot(rows), MEDUSA) == greedy_verify_tree(tree, rows)


# --------------------------------------------------------------------------- trees

def _row(**tokens):
    p = torch.zeros(6)
    for t, v in tokens.items():
        p[int(t[1:])] = v
    return p


def test_the_longest_path_whose_every_ancestor_passed():
    #        root
    #    n0 (t1)      n1 (t2)
    #    n2 (t3)      n3 (t4)
    #    n4 (t5)
    tree = DraftTree(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([-1, -1, 0, 1, 2]))
    rows = torch.stack([
        _row(t0=0.5, t1=0.05, t2=0.45),   # root: n0 (0.05) fails, n1 (0.45) passes
        _row(t0=0.5, t3=0.5),             # after n0: n2 passes (but n0 failed)
        _row(t0=0.4, t4=0.6),             # after n1: n3 passes
        _row(t5=1.0),                     # after n2: n4 passes (but n0 failed)
        _row(t0=0.3, t3=0.7),             # after n3: the token after the path (argmax t3)
        _row(t0=1.0)])
    assert typical_verify_tree(tree, rows, MEDUSA) == ([1, 3], 3)
    # the deeper branch once its root passes too
    rows[0] = _row(t0=0.4, t1=0.3, t2=0.3)
    assert typical_verify_tree(tree, rows, MEDUSA) == ([0, 2, 4], 0)
    # nothing passes: no path, the root's argmax
    rows[0] = _row(t0=0.96, t1=0.02, t2=0.02)
    assert typical_verify_tree(tree, rows, MEDUSA) == ([], 0)


def test_ties_in_length_go_to_the_more_likely_path_as_in_medusa():
    # two paths of depth 2: n0 -> n2 (0.4 * 0.5) and n1 -> n3 (0.6 * 0.9), listed second
    tree = DraftTree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, -1, 0, 1]))
    rows = torch.stack([_row(t1=0.4, t2=0.6), _row(t3=0.5, t0=0.5), _row(t4=0.9, t0=0.1),
                        _row(t5=1.0), _row(t0=1.0)])
    assert typical_verify_tree(tree, rows, MEDUSA) == ([1, 3], 0)
    rows[2] = _row(t4=0.3, t0=0.7)  # now 0.6 * 0.3 < 0.4 * 0.5
    assert typical_verify_tree(tree, rows, MEDUSA) == ([0, 2], 5)


def test_a_chain_tree_agrees_with_the_chain_rule():
    g = torch.Generator().manual_seed(3)
    for _ in range(30):
        probs = (torch.randn(5, 9, generator=g) * 1.5).softmax(-1)
        drafts = torch.multinomial(probs[:4], 1, generator=g)[:, 0]
        out, n = typical_verify(drafts[None], probs[None], MEDUSA)
        path, token = typical_verify_tree(DraftTree.chain(drafts), probs, MEDUSA)
        assert path == list(range(int(n[0]))) and token == int(out[0, int(n[0])])


def test_tree_errors_name_the_problem():
    tree = DraftTree(torch.tensor([1, 9]), torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="node 1 holds token 9, outside the vocabulary of 6"):
        typical_verify_tree(tree, torch.full((3, 6), 1 / 6), MEDUSA)
    with pytest.raises(ValueError, match=r"expected \[3,V\]"):
        typical_verify_tree(tree, torch.full((2, 6), 1 / 6), MEDUSA)


def test_it_is_lossy_a_point_mass_where_the_target_samples():
    """p = [0.6, 0.4]: the lossless rule accepts the draft token 1 with probability 0.4 (the
    output is distributed as p); typical acceptance accepts it every time."""
    tree = DraftTree.chain([1])
    probs = torch.tensor([[0.6, 0.4], [0.5, 0.5]])
    g = torch.Generator().manual_seed(0)
    lossless = sum(verify_tree(tree, probs, g)[0] == [0] for _ in range(2000)) / 2000
    assert lossless == pytest.approx(0.4, abs=0.04)
    assert all(typical_verify_tree(tree, probs, MEDUSA)[0] == [0] for _ in range(10))


# --------------------------------------------------------------------------- the option and its errors

def test_off_by_default():
    assert SpeculativeConfig(Method.MEDUSA).lossy_typical is None
    assert split_method("medusa:tree=2")[1] == {"draft_tree_width": 2}
    assert speculative_config("medusa", False).lossy_typical is None
    assert Proposer.lossy_typical is None
    assert MedusaProposer(MedusaHeads(8, 16, 2)).lossy_typical is None
    assert SpecDecodingStats().lossy is False and SpecDecodingStats().to_dict()["lossy"] is False


def test_the_method_option_parses_eps_and_delta():
    assert split_method("medusa:lossy-typical=0.09") == ("medusa", {"lossy_typical": LossyTypical(0.09, 0.3)})
    assert split_method("medusa:lossy-typical=0.2/0.5")[1]["lossy_typical"] == LossyTypical(0.2, 0.5)
    spec = speculative_config("medusa:head=/x:tree=2:lossy-typical=0.09", False)
    assert spec.lossy_typical == MEDUSA and spec.draft_tree_width == 2 and spec.head_dir == "/x"
    assert SpeculativeConfig("medusa", lossy_typical=0.16).lossy_typical == LossyTypical(0.16, 0.4)
    assert str(MEDUSA) == "0.09/0.3"


@pytest.mark.parametrize("text, match", [
    ("medusa:lossy-typical=0", r"eps = 0.0 is invalid; allowed: a number in \(0, 1\)"),
    ("medusa:lossy-typical=1", r"eps = 1.0 is invalid; allowed: a number in \(0, 1\)"),
    ("medusa:lossy-typical=nan", r"eps = nan is invalid"),
    ("medusa:lossy-typical=0.09/0", r"delta = 0.0 is invalid; allowed: a number in \(0, 1\]"),
    ("medusa:lossy-typical=0.09/1.5", r"delta = 1.5 is invalid; allowed: a number in \(0, 1\]"),
    ("medusa:lossy-typical=high", r"lossy-typical='high' is invalid; allowed: EPS or EPS/DELTA"),
    ("medusa:lossy-typical=0.1/0.2/0.3", r"lossy-typical='0.1/0.2/0.3' is invalid; allowed: EPS or EPS/DELTA"),
    ("medusa:lossy-typical=", r"lossy-typical= in .* has no value; e.g. lossy-typical=EPS\[/DELTA\]"),
    ("eagle3:lossy-typical=0.09", r"method 'eagle3' takes no option \['lossy-typical'\] in 'eagle3:lossy-typical=0.09'; allowed: tree, nodes, head$"),
    ("draft:lossy-typical=0.09", r"method 'draft' takes no option \['lossy-typical'\]"),
])
def test_bad_values_are_named(text, match):
    with pytest.raises(ValueError, match=match):
        split_method(text)


def test_config_and_proposer_errors():
    with pytest.raises(ValueError, match=r"Medusa's typical acceptance, which changes the output .* "
                                         r"applies to 'medusa', not 'draft'"):
        SpeculativeConfig(Method.DRAFT, lossy_typical=0.09)
    with pytest.raises(ValueError, match=r"lossy_typical = 'yes' is invalid; allowed: None \(lossless\)"):
        SpeculativeConfig(Method.MEDUSA, lossy_typical="yes")
    with pytest.raises(ValueError, match=r"lossy_typical = True is invalid"):
        SpeculativeConfig(Method.MEDUSA, lossy_typical=True)
    with pytest.raises(ValueError, match=r"eps = 2 is invalid"):
        SpeculativeConfig(Method.MEDUSA, lossy_typical=2)
    with pytest.raises(ValueError, match=r"lossy_typical = 0.09 is invalid; allowed: None \(lossless\) or a LossyTypical"):
        MedusaProposer(MedusaHeads(8, 16, 2), lossy_typical=0.09)


def test_the_api_refuses_it_for_greedy_requests_before_loading_anything():
    import specdecode
    with pytest.raises(ValueError, match=r"lossy-typical=0.09/0.3 applies to sampled requests \(temperature > 0\): "
                                         r"at temperature 0 Medusa's typical acceptance is greedy verification"):
        specdecode.generate("no-such-model-here", "hi", method="medusa:lossy-typical=0.09")


# --------------------------------------------------------------------------- through the engine

class SecondBest(Proposer):
    """Proposes, k times over, the target's second most likely token after the tokens so far
    (it reads the mock target's logits function): a token a lossless rule keeps only as often
    as the target samples it."""

    name = "second-best"
    default_k = 3

    def __init__(self, logits_fn, temperature, lossy_typical=None):
        self.logits_fn, self.temperature, self.lossy_typical = logits_fn, temperature, lossy_typical

    def propose(self, state, k):
        tokens, out = list(state.tokens), []
        for _ in range(k):
            out.append(int(self.logits_fn(tokens).topk(2).indices[1]))
            tokens.append(out[-1])
        return DraftOutput(torch.tensor([out]))


def _mock(vocab=24):
    fn = hashed_logits(vocab, "typical", scale=1.0)
    return MockLM(vocab, fn), fn


def test_through_the_engine_it_changes_sampled_output_and_says_lossy():
    target, fn = _mock()
    prompt = [3, 1, 4, 1, 5]
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=7)  # gumbel: plain sampling's tokens
    plain, _ = run(target, None, None, prompt, params)
    lossless, _ = run(target, SecondBest(fn, 1.0), 3, prompt, params)
    assert lossless.token_ids == plain.token_ids and not lossless.stats.lossy
    lossy, _ = run(target, SecondBest(fn, 1.0, MEDUSA), 3, prompt, params)
    assert lossy.stats.lossy and lossy.stats.to_dict()["lossy"] is True
    assert lossy.token_ids != plain.token_ids  # it IS lossy
    assert lossy.stats.acceptance_rate > lossless.stats.acceptance_rate
    # every accepted draft token was the second most likely one: the sampled text is gone
    second = [i for i, info in enumerate(lossy.token_info) if info.kind == "accepted"]
    ctx = prompt + lossy.token_ids
    assert second and all(lossy.token_ids[i] == int(fn(ctx[:len(prompt) + i]).topk(2).indices[1])
                          for i in second)
    # the same with the rejection rule (unseeded): lossy again, and marked
    unseeded = run(target, SecondBest(fn, 1.0, MEDUSA), 3, prompt,
                   SamplingParams(max_new_tokens=20, temperature=1.0))[0]
    assert unseeded.stats.lossy


def test_through_the_engine_at_temperature_zero_it_is_greedy_and_not_lossy():
    target, fn = _mock()
    prompt = [2, 7, 1, 8]
    params = SamplingParams(max_new_tokens=30)
    plain, _ = run(target, None, None, prompt, params)
    gen, _ = run(target, SecondBest(fn, 0.0, MEDUSA), 3, prompt, params)
    assert gen.token_ids == plain.token_ids and not gen.stats.lossy
    assert gen.stats.num_draft_tokens > 0


def _heads(model, num_heads=3, seed=4):
    g = torch.Generator().manual_seed(seed)
    heads = MedusaHeads(model.args.dim, model.args.vocab_size, num_heads)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return heads


@pytest.mark.parametrize("tree", [None, [(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0)]], ids=["chain", "tree"])
def test_medusa_heads_lossy_alone_and_in_a_batch(tree):
    """Medusa's proposer with the option on the native kernels: at temperature 0 plain
    greedy decoding's output; sampled, marked lossy, and a batch row's output is its run
    alone (the rule is deterministic given the drafts)."""
    from specdecode.batch import BatchEngine
    from specdecode.schedule import FixedK

    target = tiny_model(0, int8="nk", **KERNEL_SHAPES)
    assert tree is None or target.exact_trees, "this project's machines run the CPU attention kernels"
    heads = _heads(target)
    prompt = PROMPTS["twenty"]
    greedy = SamplingParams(max_new_tokens=30)
    plain, _ = run(target, None, None, prompt, greedy)
    gen, _ = run(target, MedusaProposer(heads, tree, MEDUSA), 3, prompt, greedy)
    assert gen.token_ids == plain.token_ids and not gen.stats.lossy
    sampled = SamplingParams(max_new_tokens=30, temperature=1.5, seed=1)
    alone, _ = run(target, MedusaProposer(heads, tree, MEDUSA), 3, prompt, sampled)
    assert alone.stats.lossy and alone.stats.num_draft_tokens > 0
    # a hot, flat target: random heads' tokens pass the low threshold, and almost never
    # equal the target's sample (lossless: 1.0 token a pass; measured 3.75 against 1.03)
    hot = SamplingParams(max_new_tokens=30, temperature=20.0, seed=1)
    lossy = run(target, MedusaProposer(heads, tree, MEDUSA), 3, prompt, hot)[0]
    lossless = run(target, MedusaProposer(heads, tree), 3, prompt, hot)[0]
    assert lossy.stats.mean_acceptance_length > 2.5 > 1.5 > lossless.stats.mean_acceptance_length
    assert lossy.token_ids != lossless.token_ids and lossy.stats.lossy and not lossless.stats.lossy
    batch = BatchEngine(target.fork(), 2, 128, debug=True)
    try:
        rows = [batch.add(list(prompt), sampled, proposer=MedusaProposer(heads, tree, MEDUSA), schedule=FixedK(3)),
                batch.add(list(prompt[:7]), greedy)]
        batch.run()
        assert rows[0].token_ids == alone.token_ids and rows[0].stats.lossy and not rows[1].stats.lossy
    finally:
        batch.close()


# --------------------------------------------------------------------------- where output is reported

def test_stats_merge_keeps_the_mark():
    a, b = SpecDecodingStats(), SpecDecodingStats(lossy=True)
    assert a.merge(b).lossy and b.merge(a).lossy and not a.merge(a).lossy


def test_the_bench_refuses_it_in_greedy_runs_and_never_checks_it_as_lossless(monkeypatch):
    from specdecode.bench import runners
    from specdecode.bench.report import markdown_table, summarize
    from specdecode.bench.run import Record

    methods = runners.parse_methods("ar,medusa,medusa:lossy-typical=0.09")
    with pytest.raises(ValueError, match=r"method 'medusa:lossy-typical=0.09': option lossy-typical=0.09/0.3 "
                                         r"applies to sampled runs .* add --temperature T"):
        runners.check_rows(methods, 0.0)
    runners.check_rows(methods, 0.8)
    assert runners.fixed_k("medusa:k=3:lossy-typical=0.09") == 3
    assert runners.fixed_k("medusa:lossy-typical=0.09") is None  # the heads' default K schedule: auto
    assert runners.is_lossy("medusa", {"lossy-typical": "0.09"}) and not runners.is_lossy("medusa", {})

    def fake_ours(models, name, opts, temperature=0.0):
        opts.clear()
        return lambda ids, n: None
    monkeypatch.setattr(runners, "ours", fake_ours)
    refs = {label: ref for label, (_, ref) in runners.build_runners(None, methods, 0.8).items()}
    assert refs == {"ar": "ar", "medusa": "ar", "medusa:lossy-typical=0.09": None}

    records = [Record(m, "qa", "1", 0, 5, 10, 1.0, identical=None if m != "medusa" else True, lossy=lossy)
               for m, lossy in (("ar", False), ("medusa", False), ("medusa:lossy-typical=0.09", True))]
    summary = summarize(records)
    assert summary["medusa:lossy-typical=0.09"]["overall"]["lossy"] is True
    assert summary["medusa"]["overall"]["lossy"] is False and summary["medusa"]["overall"]["mismatches"] == 0
    table = markdown_table(summary, {})
    line = next(row for row in table.splitlines() if row.startswith("| medusa:lossy-typical"))
    assert "lossy‡" in line and "‡ lossy: the method changes the output by design" in table
    assert "‡" not in markdown_table(summarize(records[:2]), {})


def test_the_cli_stats_line_says_lossy(capsys):
    from specdecode.cli.generate import _print_stats

    stats = SpecDecodingStats(num_generated_tokens=4, num_verify_passes=2, lossy=True).to_dict()
    _print_stats("medusa", stats, "length", sys.stdout)
    assert "LOSSY: Medusa's typical acceptance" in capsys.readouterr().out
    _print_stats("medusa", SpecDecodingStats(num_generated_tokens=4).to_dict(), "length", sys.stdout)
    assert "LOSSY" not in capsys.readouterr().out

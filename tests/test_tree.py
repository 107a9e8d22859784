"""Draft trees (specdecode.tree) and the acceptance rules over them (verify_tree,
greedy_verify_tree): the tree's mask and positions, certain outcomes, greedy equality with the
linear rule, and the sampling distribution test of docs/testing.md for top-k (point-mass) and SpecInfer
(i.i.d. sampled) children, with a power check that a biased use of the rule is detected."""

from __future__ import annotations

import functools

import pytest
import torch

from helpers import KERNEL_SHAPES, PROMPTS, MockLM, TreeMockLM, hashed_logits, run, tiny_model
from lossless import assert_lossless, chi2_critical, chi2_stat, probs_of
from specdecode.batch import BatchEngine
from specdecode.config import SamplingParams
from specdecode.engine import Engine
from specdecode.proposers import DraftModelProposer, DraftOutput, PromptLookupProposer, Proposer
from specdecode.schedule import FixedK, HeuristicK
from specdecode.tree import DraftTree
from specdecode.verify import greedy_verify, greedy_verify_tree, verify_tree

# root -> a(0), b(1); a -> c(2), d(3); d -> e(4)
TREE = DraftTree(torch.tensor([5, 3, 2, 7, 1]), torch.tensor([-1, -1, 0, 0, 3]))


def test_mask_positions_and_paths_of_a_small_tree():
    m = TREE.attn_mask()
    sees = {i: m[i].nonzero()[:, 0].tolist() for i in range(6)}
    assert sees == {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 1, 4, 5]}
    assert TREE.position_ids(10).tolist() == [10, 11, 11, 12, 12, 13]
    assert TREE.input_ids(9).tolist() == [9, 5, 3, 2, 7, 1]
    assert TREE.path(4) == [0, 3, 4] and TREE.path(1) == [1] and TREE.path(-1) == []
    assert TREE.children(0) == (0, 1) and TREE.children(1) == (2, 3) and TREE.children(5) == ()


def test_a_chain_is_the_causal_mask():
    chain = DraftTree.chain([4, 4, 2])
    assert torch.equal(chain.attn_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert chain.position_ids(3).tolist() == [3, 4, 5, 6]
    assert DraftTree.chain([]).attn_mask().tolist() == [[True]]


@pytest.mark.parametrize("tokens,parents,match", [
    ([1, 2], [-1, 1], "node 1 has parent 1"),
    ([1, 2], [-1, -2], "node 1 has parent -2"),
    ([1, 2], [-1], "2 token_ids but 1 parents"),
    ([1, -3], [-1, 0], "token_ids must be >= 0"),
])
def test_bad_trees_are_refused_with_the_bad_value(tokens, parents, match):
    with pytest.raises(ValueError, match=match):
        DraftTree(torch.tensor(tokens), torch.tensor(parents))


def test_bad_tensors_and_rows_are_refused():
    with pytest.raises(ValueError, match="int64 vector"):
        DraftTree(torch.tensor([1.0]), torch.tensor([-1]))
    with pytest.raises(ValueError, match=r"expected \[6,V\]"):
        greedy_verify_tree(TREE, torch.zeros(5, 8))
    with pytest.raises(ValueError, match=r"draft_probs has shape"):
        verify_tree(TREE, torch.full((6, 8), 1 / 8), None, torch.zeros(2, 8))
    with pytest.raises(ValueError, match="outside the vocabulary of 4"):
        verify_tree(TREE, torch.full((6, 4), 0.25), None)
    with pytest.raises(ValueError, match="not in the tree"):
        TREE.path(5)


def _certain(rows):
    """logits [len(rows), 8]: +10 at each row's chosen token, -10 elsewhere."""
    out = torch.full((len(rows), 8), -10.0)
    out[torch.arange(len(rows)), torch.tensor(rows)] = 10.0
    return out


@pytest.mark.parametrize("rows,path,token", [
    ([3, 2, 6, 0, 1, 5], [1], 6),        # root picks b (3); b is a leaf: bonus 6
    ([5, 7, 0, 0, 1, 4], [0, 3, 4], 4),  # a, then d, then e, then bonus from e's row
    ([5, 2, 0, 0, 0, 0], [0, 2], 0),     # a, then c (2), c is a leaf
    ([6, 0, 0, 0, 0, 0], [], 6),         # no child of the root matches: recovered 6
    ([5, 4, 0, 0, 0, 0], [0], 4),        # a, then neither c nor d: recovered 4
])
def test_certain_outcomes_follow_the_one_possible_path(rows, path, token):
    logits = _certain(rows)
    assert greedy_verify_tree(TREE, logits) == (path, token)
    probs = logits.softmax(-1)
    for seed in range(5):
        assert verify_tree(TREE, probs, torch.Generator().manual_seed(seed)) == (path, token)
    # sampled children: q spread evenly; the outcome is still certain
    q = torch.full((6, 8), 1 / 8)
    assert verify_tree(TREE, probs, torch.Generator().manual_seed(0), q) == (path, token)


def test_greedy_over_a_chain_is_the_linear_greedy_rule():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        k = int(torch.randint(0, 5, (), generator=g))
        logits = torch.randn(k + 1, 5, generator=g)
        drafts = torch.where(torch.rand(k, generator=g) < 0.7, logits[:k].argmax(-1),
                             torch.randint(0, 5, (k,), generator=g))
        out, na = greedy_verify(drafts[None], logits[None])
        path, token = greedy_verify_tree(DraftTree.chain(drafts), logits)
        assert path == list(range(int(na))) and token == int(out[0, na])


def test_greedy_takes_the_first_of_duplicate_siblings_and_the_longest_path():
    tree = DraftTree(torch.tensor([2, 2, 3]), torch.tensor([-1, -1, 1]))
    logits = _certain([2, 3, 3, 0])
    assert greedy_verify_tree(tree, logits) == ([0], 3)  # node 1 (under it: 3) is not tried
    # top-k candidates as point masses with a one-hot target: the same as greedy
    assert verify_tree(tree, torch.nn.functional.one_hot(logits.argmax(-1), 8).float(), None) == ([0], 3)


# ----------------------------------------------------------------------------------------
# Losslessness: the joint distribution of the first two emitted tokens through trees
# ----------------------------------------------------------------------------------------

V = 6
B = 20000
PREFIX = (1, 4)


def _tables(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, generator=g) * 1.2, torch.randn(V, V, generator=g) * 1.2,
            torch.randn(V, generator=g))


TARGET, DRAFT = _tables(100), _tables(200)


def _logits(tables, gen: tuple) -> torch.Tensor:
    """The toy model's logits after generated tokens ``gen``: position 0, 1 (given the first
    token), then one fixed row."""
    return tables[0] if not gen else tables[1][gen[0]] if len(gen) == 1 else tables[2]


@functools.lru_cache(maxsize=None)
def _dist(which: str, params: SamplingParams, gen: tuple) -> torch.Tensor:
    """The processed distribution after PREFIX + gen (the context of a tree node: the
    committed tokens and the node's ancestors, which the repetition penalty sees)."""
    tables = TARGET if which == "target" else DRAFT
    return probs_of(_logits(tables, gen)[None, None], params, torch.tensor([PREFIX + gen]), None)[0, 0]


def target_joint(params):
    p1 = _dist("target", params, ())
    return p1[:, None] * torch.stack([_dist("target", params, (a,)) for a in range(V)])


def _round(gen: tuple, params, mode, g, width=2, depth=2):
    """One tree round after ``gen``: a full tree of ``width`` children a node, ``depth``
    levels, top-k of the draft (mode "topk": point masses) or i.i.d. draws from it
    ("sampled"; "topk-as-soft": top-k verified with the draft's soft q, a biased use).
    Returns the emitted tokens (path + recovered or bonus)."""
    tokens, parents, ctx = [], [], [gen]  # ctx[r]: generated tokens up to pass row r
    frontier = [-1]
    for _ in range(depth):
        nxt = []
        for parent in frontier:
            q = _dist("draft", params, ctx[parent + 1])
            kids = torch.topk(q, width).indices.tolist() if mode.startswith("topk") else \
                torch.multinomial(q, width, replacement=True, generator=g).tolist()
            for x in kids:
                tokens.append(x)
                parents.append(parent)
                ctx.append(ctx[parent + 1] + (x,))
                nxt.append(len(tokens) - 1)
        frontier = nxt
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
    p = torch.stack([_dist("target", params, c) for c in ctx])
    q = None if mode == "topk" else torch.stack([_dist("draft", params, c) for c in ctx])
    path, last = verify_tree(tree, p, g, q)
    return [tokens[i] for i in path] + [last]


def sample_two_tokens(params, mode, seed):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V, dtype=torch.long)
    for _ in range(B):
        out = _round((), params, mode, g)
        if len(out) < 2:
            out += _round((out[0],), params, mode, g)
        counts[out[0], out[1]] += 1
    return counts


SETTINGS = {
    "T1": SamplingParams(temperature=1.0),
    "T0.5": SamplingParams(temperature=0.5),
    "T2-top_k4": SamplingParams(temperature=2.0, top_k=4),
    "T1-rep1.5": SamplingParams(temperature=1.0, repetition_penalty=1.5),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["topk", "sampled"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_tree_output_follows_target(name, mode):
    params = SETTINGS[name]
    counts = sample_two_tokens(params, mode, seed=list(SETTINGS).index(name) * 2 + (mode == "topk"))
    assert counts.sum() == B
    assert_lossless(counts, target_joint(params))


@pytest.mark.slow
def test_power_top_k_children_verified_with_soft_probs_is_detected():
    """Deterministic candidates given soft draft probabilities (a top-k proposer that reports
    its q): the output leaves the target's distribution, and the test above sees it."""
    params = SETTINGS["T1"]
    stat, df = chi2_stat(sample_two_tokens(params, "topk-as-soft", seed=7), target_joint(params))
    assert stat > chi2_critical(df)


# ----------------------------------------------------------------------------------------
# Draft trees in the engine: a draft model's chain with its next candidates beside it
# ----------------------------------------------------------------------------------------

def _tree_target():
    return tiny_model(0, int8="nk", **KERNEL_SHAPES)


MOCK_V = 96
_mock_target_logits = hashed_logits(MOCK_V, "tree-target")
_mock_noise = hashed_logits(MOCK_V, "tree-draft")


def _mock_draft_logits(tokens):
    """The mock target's logits plus as much noise: the draft agrees with the target at
    times, and its runner-up is sometimes the target's token where it does not."""
    return _mock_target_logits(tokens) + _mock_noise(tokens)


# the targets the engine's tree tests run on: "kernel", the int8 tiny target, whose tree
# passes are exact where the CPU attention kernel runs them (x86-64 with AVX2 or AVX512 and a
# C++ compiler: a property of the platform; elsewhere the target says it has no exact trees
# and the engine refuses them); "mock", a TreeMockLM, exact by construction on every machine
TREE_TARGETS = ["kernel", "mock"]


def _pair(kind: str):
    """(target, draft) of TREE_TARGETS ``kind``."""
    if kind == "kernel":
        return _tree_target(), _draft()
    return TreeMockLM(MOCK_V, _mock_target_logits), MockLM(MOCK_V, _mock_draft_logits)


def _assert_trees_refused(target, draft, params: SamplingParams):
    """What holds on a target without exact tree passes: the engine refuses a tree proposer
    (saying why), and the same proposer's chain runs the request (with plain decoding's very
    tokens where the rule fixes them: greedy, or seeded Gumbel)."""
    assert not target.exact_trees
    with pytest.raises(ValueError, match="draft trees need a target"):
        Engine(target, DraftModelProposer(draft.fork(), tree_width=2), 4)
    plain, _ = run(target, None, None, PROMPTS["twenty"], params)
    chain, _ = run(target, DraftModelProposer(draft.fork()), 4, PROMPTS["twenty"], params)
    assert len(chain.token_ids) == params.max_new_tokens and chain.stats.num_draft_tokens > 0
    if params.greedy or params.rule == "gumbel":
        assert chain.token_ids == plain.token_ids


def _draft():
    """The target's float weights with noise: its argmax agrees with the target's at times,
    and its runner-up is sometimes the target's token where it does not."""
    d = tiny_model(0, **KERNEL_SHAPES)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.035)
    return d


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=60),
                                    SamplingParams(max_new_tokens=60, repetition_penalty=1.3),
                                    SamplingParams(max_new_tokens=60, temperature=0.8, seed=5)],
                         ids=["greedy", "greedy-penalty", "gumbel"])
@pytest.mark.parametrize("kind", TREE_TARGETS)
def test_tree_drafts_keep_the_target_output_and_take_siblings(params, kind):
    """Greedy (with and without a repetition penalty, which sees each node's own path) and
    seeded Gumbel-rule requests give plain decoding's tokens through draft trees; with a draft
    that disagrees with the target at times, the trees' siblings save verify passes. Where the
    target cannot run exact tree passes, the engine refuses the tree."""
    target, draft = _pair(kind)
    prompt = PROMPTS["twenty"]
    if not target.exact_trees:
        _assert_trees_refused(target, draft, params)
    else:
        plain, _ = run(target, None, None, prompt, params)
        chain, _ = run(target, DraftModelProposer(draft.fork()), 4, prompt, params)
        tree, _ = run(target, DraftModelProposer(draft.fork(), tree_width=3), 4, prompt, params)
        assert chain.token_ids == plain.token_ids
        assert tree.token_ids == plain.token_ids
        assert tree.stats.num_verify_passes < chain.stats.num_verify_passes
        kinds = {i.kind for i in tree.token_info}
        assert "accepted" in kinds and kinds <= {"accepted", "recovered", "bonus", "target"}


@pytest.mark.parametrize("kind", TREE_TARGETS)
def test_tree_logprobs_come_from_the_rows_of_the_path(kind):
    target, draft = _pair(kind)
    params = SamplingParams(max_new_tokens=30, logprobs=2)
    if not target.exact_trees:
        _assert_trees_refused(target, draft, params)
    else:
        prompt = PROMPTS["twenty"]
        plain, _ = run(target, None, None, prompt, params)
        tree, _ = run(target, DraftModelProposer(draft, tree_width=2), 4, prompt, params)
        assert tree.token_ids == plain.token_ids
        assert "accepted" in {i.kind for i in tree.token_info}
        assert tree.stats.num_draft_tokens > 4 * tree.stats.num_drafts  # siblings were verified
        for a, b in zip(tree.token_info, plain.token_info):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]


@pytest.mark.parametrize("kind", TREE_TARGETS)
def test_rejection_rule_requests_get_the_chain_and_bad_widths_are_refused(kind):
    target, draft = _pair(kind)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=3, acceptance_rule="rejection")
    if target.exact_trees:
        gen, _ = run(target, DraftModelProposer(draft, tree_width=3), 4, PROMPTS["twenty"], params)
        assert len(gen.token_ids) == 20 and gen.stats.num_draft_tokens > 0
        # the chain: K tokens a round at most (a tree of width 3 would verify up to 12)
        assert max(gen.stats.speculation_lengths) <= 4
    else:
        _assert_trees_refused(target, draft, params)
    for bad in (0, 9, 2.0, True):
        with pytest.raises(ValueError, match="tree_width"):
            DraftModelProposer(tiny_model(0), tree_width=bad)
    with pytest.raises(ValueError, match="draft trees need a target"):
        Engine(MockLM(8, lambda ctx: torch.zeros(8)), DraftModelProposer(tiny_model(0), tree_width=2), 3)


def test_draft_trees_in_a_batch_each_row_equal_to_its_request_alone():
    """Tree rows (greedy, seeded Gumbel, seeded rejection: its draws read the tree's
    siblings) share verify passes with chain and plain rows, on draft rows of one cache; each
    output is its request's alone, and the trees did verify siblings. A target whose tree
    passes are not exact refuses a tree row."""
    target, draft = _tree_target(), _draft()
    assert target.exact_trees, "this project's machines run the CPU attention kernels"
    twenty = PROMPTS["twenty"]
    greedy = SamplingParams(max_new_tokens=30)
    reqs = [(twenty, greedy, 3, 4),
            (twenty[:6], SamplingParams(max_new_tokens=30, temperature=0.9, seed=5), 2, 3),
            (twenty * 2, SamplingParams(max_new_tokens=25, temperature=1.0, seed=3,
                                        acceptance_rule="rejection"), 3, 3),
            ([9], greedy, 2, 2),
            (twenty[4:], greedy, 1, 4),  # a chain beside the trees
            (twenty[2:], greedy, None, None)]

    def proposer(width, model):
        return None if width is None else DraftModelProposer(model, tree_width=width)

    want = [Engine(target.fork(), proposer(w, draft.fork()), k).generate(p, params).run()
            for p, params, w, k in reqs]
    batch = BatchEngine(target.fork(), 4, 160, debug=True)
    try:
        gens = [batch.add(p, params, proposer=proposer(w, batch.draft_view(draft)),
                          schedule=None if k is None else FixedK(k)) for p, params, w, k in reqs]
        batch.add(twenty, greedy, proposer=PromptLookupProposer(), schedule=FixedK(3)).run()
        batch.run()
        for g, w in zip(gens, want):
            assert g.token_ids == w.token_ids
        assert all(g.stats.num_draft_tokens > 0 for g in gens[:5])
        # siblings were verified: more draft tokens a round than a chain of K = 4 has
        assert gens[0].stats.num_draft_tokens > 4 * gens[0].stats.num_drafts
    finally:
        batch.close()
    inexact = tiny_model(0, head_dim=12)  # a head size no attention kernel runs, on any machine
    assert not inexact.exact_trees
    batch = BatchEngine(inexact, 2, 64)
    try:
        with pytest.raises(ValueError, match="draft trees need a target"):
            batch.add(twenty, greedy, proposer=DraftModelProposer(_draft(), tree_width=2))
    finally:
        batch.close()


def test_prune_keeps_parents_and_renumbers():
    kept = TREE.prune(torch.tensor([True, True, False, True, True]))
    assert kept.token_ids.tolist() == [5, 3, 7, 1] and kept.parents.tolist() == [-1, -1, 0, 2]
    assert TREE.prune(TREE.depths() <= 1).token_ids.tolist() == [5, 3]
    with pytest.raises(ValueError, match="without its parent"):
        TREE.prune(torch.tensor([False, True, True, False, False]))


@pytest.mark.parametrize("kind", TREE_TARGETS)
def test_trees_beyond_an_exact_pass_are_pruned_and_stay_exact(kind):
    """A tree of 8 x 9 nodes would make a 73-row pass, past what the exact attention kernel
    runs: the engine verifies its first 64 nodes, and logprobs stay bit for bit plain
    decoding's."""
    target, draft = _pair(kind)
    params = SamplingParams(max_new_tokens=100, logprobs=1)  # room for 64 nodes at first
    if not target.exact_trees:
        _assert_trees_refused(target, draft, params)
    else:
        plain, _ = run(target, None, None, PROMPTS["twenty"], params)
        gen, _ = run(target, DraftModelProposer(draft, tree_width=8), 9, PROMPTS["twenty"], params)
        assert gen.token_ids == plain.token_ids
        assert max(gen.stats.speculation_lengths) == 64
        assert [i.logprob for i in gen.token_info] == [i.logprob for i in plain.token_info]


@pytest.mark.parametrize("kind", TREE_TARGETS)
def test_the_k_schedules_see_the_tree_depth(kind):
    """Heuristic K grows after fully accepted paths of a tree as after a fully accepted chain
    (a draft that is the target itself is always right)."""
    target, draft = _pair(kind)
    params = SamplingParams(max_new_tokens=120)
    if not target.exact_trees:
        _assert_trees_refused(target, draft, params)
    else:
        passes = {}
        for w in (1, 2):
            gen = Engine(target, DraftModelProposer(target.fork(), tree_width=w), HeuristicK(4)) \
                .generate(PROMPTS["twenty"], params).run()
            passes[w] = gen.stats.num_verify_passes
        assert passes[2] <= passes[1]


def test_a_proposer_that_gives_more_than_k_is_cut_to_k():
    class Greedy(Proposer):
        name = "greedy"

        def propose(self, state, k):
            return DraftOutput(torch.arange(10)[None])

    gen, _ = run(_tree_target(), Greedy(), 2, PROMPTS["twenty"], SamplingParams(max_new_tokens=5))
    assert len(gen.token_ids) == 5 and max(gen.stats.speculation_lengths) <= 2


def test_trim_keeps_the_first_child_chain_first():
    assert TREE.trim(5, 10) is TREE
    cut = TREE.trim(3, 3)  # the chain a -> c is kept whole, then b
    assert cut.token_ids.tolist() == [5, 3, 2] and cut.parents.tolist() == [-1, -1, 0]
    assert TREE.trim(3, 2).token_ids.tolist() == [5, 2]  # the chain only
    assert TREE.trim(1, 5).token_ids.tolist() == [5, 3]

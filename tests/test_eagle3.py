"""EAGLE-3 heads (specdecode.heads.Eagle3Head, proposers/eagle3.py, train/eagle3.py): the
checkpoint layout vLLM and SGLang load, the draft vocabulary, the proposer's cache equal to
the training-time test's attention, lossless output on the real kernels, training."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from transformers import LlamaForCausalLM

import specdecode
from helpers import KERNEL_SHAPES, PROMPTS, MockLM, run, tiny_model
from specdecode.config import MAX_K, SamplingParams
from specdecode.engine import Engine
from specdecode.methods import SpeculativeConfig, speculative_config, tree_size
from specdecode.export import check_head_tensors, head_tensor_table
from specdecode.heads import EAGLE3_ARCH, Eagle3Head, aux_layers, default_head_dir, draft_vocabulary
from specdecode.models.native import ModelArgs
from specdecode.models.quant import Int8Linear
from specdecode.profile import verify_profile
from specdecode.proposers import Eagle3Proposer
from specdecode.proposers.base import RequestState
from specdecode.train.eagle3 import chain_acceptance, eagle3_task, unroll
from specdecode.train.features import TOPK, Sequence
from specdecode.train.loop import train
from tiny_dirs import _llama_config, _randomize, local_tokenizer, tiny_dirs_in

# docs/methods/heads.md's table for the default target (Qwen2.5-Coder-1.5B: hidden 1536, 12 heads, 2 KV
# heads, head_dim 128, 151,936 ids), with intermediate size I and draft vocabulary N
QWEN_1_5B = ModelArgs(vocab_size=151936, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
                      intermediate_size=8960, norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768)


def golden_tensors(i: int, n: int) -> dict[str, tuple[tuple[int, ...], str]]:
    return {"fc.weight": ((1536, 4608), "bfloat16"),
            "midlayer.input_layernorm.weight": ((1536,), "bfloat16"),
            "midlayer.hidden_norm.weight": ((1536,), "bfloat16"),
            "midlayer.self_attn.q_proj.weight": ((1536, 3072), "bfloat16"),
            "midlayer.self_attn.k_proj.weight": ((256, 3072), "bfloat16"),
            "midlayer.self_attn.v_proj.weight": ((256, 3072), "bfloat16"),
            "midlayer.self_attn.o_proj.weight": ((1536, 1536), "bfloat16"),
            "midlayer.post_attention_layernorm.weight": ((1536,), "bfloat16"),
            "midlayer.mlp.gate_proj.weight": ((i, 1536), "bfloat16"),
            "midlayer.mlp.up_proj.weight": ((i, 1536), "bfloat16"),
            "midlayer.mlp.down_proj.weight": ((1536, i), "bfloat16"),
            "norm.weight": ((1536,), "bfloat16"),
            "lm_head.weight": ((n, 1536), "bfloat16"),
            "d2t": ((n,), "int64"),
            "t2d": ((151936,), "bool")}


def test_the_default_targets_head_has_the_layout_vllm_and_sglang_load(tmp_path):
    ids = torch.arange(0, 151936, 37)[:512]
    head = Eagle3Head(QWEN_1_5B, ids, torch.zeros(151936, 1536), intermediate_size=1024)
    out = head.save(tmp_path / "e3", trained_on="test")
    tensors = load_file(str(out / "model.safetensors"))
    got = {k: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in tensors.items()}
    assert got == golden_tensors(1024, 512)
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    assert torch.equal(d2t + torch.arange(512), ids) and int(t2d.sum()) == 512 and bool(t2d[ids].all())
    config = json.loads((out / "config.json").read_text())
    assert config == {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                      "hidden_size": 1536, "intermediate_size": 1024, "num_hidden_layers": 1,
                      "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128,
                      "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1e6,
                      "max_position_embeddings": 32768, "attention_bias": False,
                      "tie_word_embeddings": False, "vocab_size": 151936, "draft_vocab_size": 512,
                      "torch_dtype": "bfloat16", "trained_on": "test"}
    assert "eagle_aux_hidden_state_layer_ids" not in config  # the engines' defaults apply
    # the table `specdecode export` checks a head against is the same one
    assert {n: (s, str(d).removeprefix("torch.")) for n, (s, d) in head_tensor_table("eagle3", config).items()} \
        == golden_tensors(1024, 512)
    check_head_tensors("eagle3", config, tensors)
    assert aux_layers(28) == [1, 13, 24]


def _args(**kw):
    base = dict(vocab_size=96, dim=32, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=48)
    return ModelArgs(**{**base, **kw})


def _random_head(args, n=40, seed=0, embed=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(args.vocab_size, generator=g)[:n].sort().values
    embed = torch.randn(args.vocab_size, args.dim, generator=g) if embed is None else embed
    head = Eagle3Head(args, ids, embed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "norm" not in name else 0.1) + ("norm" in name))
    return head


def test_save_and_load_round_trip_and_errors(tmp_path):
    args = _args()
    head = _random_head(args)
    out = head.save(tmp_path / "h", dtype=torch.float32)
    back = Eagle3Head.load(out, args, head.embed)
    for k, v in head.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    with pytest.raises(ValueError, match="for another target .*hidden_size 32, the target's 64"):
        Eagle3Head.load(out, _args(dim=64, head_dim=16), torch.zeros(96, 64))
    config = json.loads((out / "config.json").read_text())
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "architectures": ["MedusaModel"]}))
    (tmp_path / "m" / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"does not hold an EAGLE-3 head \(LlamaForCausalLMEagle3\): it holds Medusa heads: use medusa:head="):
        Eagle3Head.load(tmp_path / "m", args, head.embed)
    with pytest.raises(ValueError, match="is not a directory of an EAGLE-3 head"):
        Eagle3Head.load(tmp_path / "nothing", args, head.embed)
    with pytest.raises(ValueError, match="sorted unique target ids"):
        Eagle3Head(args, torch.tensor([3, 2]), head.embed)
    assert EAGLE3_ARCH == "LlamaForCausalLMEagle3"


def test_the_draft_vocabulary_is_the_most_frequent_ids_ascending():
    counts = torch.tensor([0, 5, 1, 5, 9, 0, 2.0])
    assert draft_vocabulary(counts, 3).tolist() == [1, 3, 4]
    assert draft_vocabulary(counts, 5).tolist() == [1, 2, 3, 4, 6]
    assert draft_vocabulary(counts, 6).tolist() == [0, 1, 2, 3, 4, 6]  # ties: the lower id
    with pytest.raises(ValueError, match="allowed: 1..7"):
        draft_vocabulary(counts, 8)


def test_the_proposers_cache_reproduces_the_training_time_test():
    """The chain the proposer drafts from its incremental cache is the one the training-time
    test computes for the same position, step for step (teacher-forced on the chain's own
    tokens): training and inference see the same attention."""
    args = _args()
    head = _random_head(args, n=96)  # every id in the draft vocabulary
    g = torch.Generator().manual_seed(3)
    n, k = 12, 4
    tokens = torch.randint(0, 96, (n,), generator=g).tolist()
    aux = torch.randn(n + k, 3 * args.dim, generator=g)
    prop = Eagle3Proposer(head, [1, 3, 4])
    state = RequestState(list(tokens), 0, SamplingParams(), (), None, 96)
    prop.reset(state, 64)
    prop.take_hidden(0, {1: aux[:5, :32], 3: aux[:5, 32:64], 4: aux[:5, 64:]})  # two calls, as
    prop.take_hidden(5, {1: aux[5:n - 1, :32], 3: aux[5:n - 1, 32:64], 4: aux[5:n - 1, 64:]})  # the engine
    drafts = prop.propose(state, k).token_ids[0].tolist()
    assert len(drafts) == k
    ex = {"tokens": torch.tensor(tokens + drafts), "start": torch.tensor(1), "aux": aux}
    with torch.no_grad():
        t, steps = unroll(head, ex, k)
    assert t.tolist() == list(range(n + k - 1))  # start 1: every chain
    want = [int(head.draft_ids[logits[n - 2].argmax()]) for logits, _ in steps]
    assert drafts == want
    # a verify pass that accepts two tokens: the cache's speculative rows are rebuilt from
    # the real states of the accepted positions
    state.tokens += drafts[:2] + [7]
    prop.take_hidden(n - 1, {1: aux[n - 1:n + 2, :32], 3: aux[n - 1:n + 2, 32:64], 4: aux[n - 1:n + 2, 64:]})
    again = prop.propose(state, 2).token_ids[0].tolist()
    ex = {"tokens": torch.tensor(state.tokens + again), "start": torch.tensor(1), "aux": aux}
    with torch.no_grad():
        _, steps = unroll(head, ex, 2)
    assert again == [int(head.draft_ids[logits[n + 1].argmax()]) for logits, _ in steps]


def test_the_training_time_test_skips_only_chains_that_cannot_reach_the_answer():
    """With the answer starting at ``start``, unroll runs the chains t >= start-2 only, and
    each equals the same chain of the full unroll (the prompt still gives step 0's keys)."""
    args = _args()
    head = _random_head(args, n=96)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 96, (20,), generator=g)
    aux = torch.randn(20, 3 * args.dim, generator=g)
    with torch.no_grad():
        t_all, full = unroll(head, {"tokens": tokens, "start": torch.tensor(0), "aux": aux}, 3)
        t, part = unroll(head, {"tokens": tokens, "start": torch.tensor(9), "aux": aux}, 3)
    assert t_all.tolist() == list(range(19)) and t.tolist() == list(range(7, 19))
    for (a, _), (b, valid) in zip(full, part):
        torch.testing.assert_close(b, a[7:], rtol=1e-5, atol=1e-5)
    # step 0 reads x[t+1], every one there; step 2 reads x[t+3], there for t <= 16
    assert part[0][1].tolist() == [True] * 12 and part[2][1].tolist() == [True] * 10 + [False] * 2


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=40),
                                    SamplingParams(max_new_tokens=40, temperature=0.9, seed=2)],
                         ids=["greedy", "gumbel"])
@pytest.mark.parametrize("int8_head", [False, True], ids=["fp32-head", "int8-head"])
@pytest.mark.parametrize("tree", [1, 3, "nodes7"], ids=["chain", "tree3", "dynamic7"])
def test_eagle3_output_equals_plain_decoding_on_the_int8_target(params, int8_head, tree):
    target = tiny_model(0, int8="nk", n_layers=8, **KERNEL_SHAPES)  # trees on the exact kernel
    args = target.args
    head = _random_head(args, n=60, seed=4)
    if int8_head:  # what methods.py does for a quantized CPU target
        head.quantize_("nk")
    proposer = Eagle3Proposer(head, aux_layers(8), tree_width=tree) if isinstance(tree, int) else \
        Eagle3Proposer(head, aux_layers(8), tree_width=2, tree_nodes=7)
    if proposer.makes_trees and not target.exact_trees:  # no CPU attention kernel here: trees refused
        with pytest.raises(ValueError, match="draft trees need a target"):
            Engine(target, proposer, 3)
        return
    plain, _ = run(target, None, None, PROMPTS["twenty"], params)
    gen, _ = run(target, proposer, 3, PROMPTS["twenty"], params)
    assert gen.token_ids == plain.token_ids
    assert gen.stats.num_draft_tokens > 0
    if tree == 3:  # three candidates a depth: the pass verified three times the chain's tokens
        assert gen.stats.num_draft_tokens >= 3 * gen.stats.num_verify_passes


def test_the_dynamic_tree_keeps_the_most_likely_paths_of_the_heads_own_steps():
    """EAGLE-2's tree from a random head: N nodes, parents first, depth <= K; every node is
    among the W most likely tokens of the head's step along its parent's path (the
    training-time test's step, teacher-forced on that path: the head's tree attention is its
    chain's). The method takes it as eagle3:nodes=N (tree=W the expansion width); others
    refuse it."""
    args = _args()
    head = _random_head(args, n=96, seed=2)
    g = torch.Generator().manual_seed(9)
    n = 10
    tokens = torch.randint(0, 96, (n,), generator=g).tolist()
    aux = torch.randn(n + 4, 3 * args.dim, generator=g)
    prop = Eagle3Proposer(head, [1, 3, 4], tree_width=2, tree_nodes=6)
    assert prop.makes_trees
    state = RequestState(list(tokens), 0, SamplingParams(), (), None, 96)
    prop.reset(state, 64)
    prop.take_hidden(0, {1: aux[:n - 1, :32], 3: aux[:n - 1, 32:64], 4: aux[:n - 1, 64:]})
    tree = prop.propose(state, 3).tree
    parents, toks = tree.parents.tolist(), tree.token_ids.tolist()
    assert len(toks) == 6 and all(p < i for i, p in enumerate(parents))
    depth = [0] * 6
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    assert max(depth) <= 3 and depth == sorted(depth)

    def path(i):
        out = []
        while i >= 0:
            out.append(toks[i])
            i = parents[i]
        return out[::-1]

    for i, p in enumerate(parents):
        before = path(p) if p >= 0 else []
        ex = {"tokens": torch.tensor(tokens + before + [0]), "start": torch.tensor(1), "aux": aux}
        with torch.no_grad():
            _, steps = unroll(head, ex, len(before) + 1)
        logits = steps[len(before)][0][n - 2]  # the chain from the last real row, this depth
        top2 = head.draft_ids[logits.topk(2).indices].tolist()
        assert toks[i] in top2, (i, before)
    with pytest.raises(ValueError, match="tree_nodes=0 is invalid"):
        Eagle3Proposer(head, [1, 3, 4], tree_nodes=0)
    spec = speculative_config("eagle3:nodes=6:tree=3", False)
    assert (spec.tree_nodes, spec.draft_tree_width) == (6, 3)
    with pytest.raises(ValueError, match="nodes"):
        speculative_config("draft:nodes=6", True)
    # the option as the user wrote it (was draft_tree_width / tree_nodes in the error)
    with pytest.raises(ValueError, match="nodes='65' is invalid; allowed: an integer 1..64"):
        speculative_config("eagle3:nodes=65", False)
    with pytest.raises(ValueError, match="tree='9' is invalid; allowed: an integer 1..8"):
        speculative_config("eagle3:tree=9", False)
    with pytest.raises(ValueError, match="tree_nodes = 65 is invalid"):
        SpeculativeConfig("eagle3", tree_nodes=65)
    assert speculative_config("eagle3:nodes=auto", False).tree_nodes == "auto"


def _head_of_chosen_logits(head: Eagle3Head, table: dict[int, dict[int, float]]) -> Eagle3Head:
    """Make the logits of ``head``'s steps ours: a row reading target id t gets the logits
    ``table[t]`` ({target id: logit}) and -200 at every other draft id (whose exp underflows:
    the log-probabilities are the chosen logits' log-softmax among themselves, exactly 0 for
    a lone logit 0 beside -100s). The head's steps still run (cache rows, tree attention);
    only their logits are replaced."""
    index = {t: i for i, t in enumerate(head.draft_ids.tolist())}
    project, finish, read = head.project, head.finish, []

    def recording_project(ids, hidden, positions):
        read[:] = ids.tolist()
        return project(ids, hidden, positions)

    def chosen_finish(attn, residual):
        pre, logits = finish(attn, residual)
        out = torch.full_like(logits, -200.0)
        for r, tok in enumerate(read[len(read) - len(out):]):
            for t, logit in table.get(tok, {}).items():
                out[r, index[t]] = logit
        return pre, out

    head.project, head.finish = recording_project, chosen_finish
    return head


def _dynamic_tree_of(table_of_names: dict, nodes: int, seed: int = 2):
    """The dynamic tree (tree_width 2, K = 3) that a head whose logits ``table_of_names``
    chooses ({name read: {child name: logit}}, "root" for the last committed token) drafts
    with ``nodes`` nodes; returns (its nodes as names, their parents as indices)."""
    args = _args()
    head = _random_head(args, n=60, seed=seed)
    g = torch.Generator().manual_seed(9)
    n = 10
    tokens = torch.randint(0, 96, (n,), generator=g).tolist()
    names = sorted({c for kids in table_of_names.values() for c in kids} | set(table_of_names) - {"root"})
    free = [t for t in head.draft_ids.tolist() if t != tokens[-1]]
    ids = dict(zip(names, free))  # each name a draft-vocabulary id of its own
    ids["root"] = tokens[-1]
    table = {ids[r]: {ids[c]: v for c, v in kids.items()} for r, kids in table_of_names.items()}
    prop = Eagle3Proposer(_head_of_chosen_logits(head, table), [1, 3, 4], tree_width=2, tree_nodes=nodes)
    aux = torch.randn(n, 3 * args.dim, generator=g)
    state = RequestState(list(tokens), 0, SamplingParams(), (), None, 96)
    prop.reset(state, 64)
    prop.take_hidden(0, {1: aux[:n - 1, :32], 3: aux[:n - 1, 32:64], 4: aux[:n - 1, 64:]})
    tree = prop.propose(state, 3).tree
    back = {t: name for name, t in ids.items()}
    return [back.get(t, t) for t in tree.token_ids.tolist()], tree.parents.tolist()


def _tree(names: list[str], parent_of: dict[str, str | None]) -> tuple[list[str], list[int]]:
    return names, [names.index(parent_of[x]) if parent_of[x] else -1 for x in names]


def test_the_dynamic_tree_keeps_the_best_nodes_by_cumulative_log_probability():
    """EAGLE-2's rerank on a head whose logits we choose, so that the best N nodes are known:
    root A 0.6, B 0.4; A -> A1 0.99, A2 0.01; B -> B1 0.55, B2 0.45; depth 3 expands the two
    best of depth 2 (A1, B1): A1 -> A1a 0.9, A1b 0.1; B1 -> B1a 0.95, B1b 0.05. By cumulative
    log-probability: A, A1, A1a, B, B1, B1a, B2, A1b, B1b, A2. Each N keeps the N best (not the
    first N made: A, B, A1, A2, ...), ordered by depth, most likely first within a depth."""
    p = {"root": {"A": 0.6, "B": 0.4}, "A": {"A1": 0.99, "A2": 0.01}, "B": {"B1": 0.55, "B2": 0.45},
         "A1": {"A1a": 0.9, "A1b": 0.1}, "B1": {"B1a": 0.95, "B1b": 0.05},
         "A2": {"A2a": 0.9, "A2b": 0.1}, "B2": {"B2a": 0.9, "B2b": 0.1}}  # (A2, B2: never expanded)
    table = {r: {c: math.log(v) for c, v in kids.items()} for r, kids in p.items()}
    parent_of = {c: (None if r == "root" else r) for r, kids in p.items() for c in kids}
    want = {1: ["A"], 2: ["A", "A1"], 3: ["A", "A1", "A1a"], 4: ["A", "B", "A1", "A1a"],
            5: ["A", "B", "A1", "B1", "A1a"], 6: ["A", "B", "A1", "B1", "A1a", "B1a"],
            7: ["A", "B", "A1", "B1", "B2", "A1a", "B1a"],
            10: ["A", "B", "A1", "B1", "B2", "A2", "A1a", "B1a", "A1b", "B1b"]}
    for n, names in want.items():
        assert _dynamic_tree_of(table, n) == _tree(names, parent_of), n
    # 12 nodes: all ten made, no more (A2 and B2 were not expanded)
    assert sorted(_dynamic_tree_of(table, 12)[0]) == sorted(want[10])


def test_the_dynamic_tree_keeps_every_kept_nodes_parent_when_scores_tie():
    """A child of probability 1 scores exactly its parent's cumulative log-probability (a
    child never scores above its parent): the rerank keeps the parent first (ties go to
    the shallower node, then the one made first), so every N gives a tree whose nodes'
    parents are all kept. Root X 1, Y e^-100; X -> X1 1, X2 e^-100; Y -> Y1 1; X1 -> X1a 1;
    X2 -> X2a 1: scores X = X1 = X1a = 0, then Y = X2 = Y1 = X1b = X2a = -100 (in the order
    made within a depth)."""
    table = {"root": {"X": 0.0, "Y": -100.0}, "X": {"X1": 0.0, "X2": -100.0}, "Y": {"Y1": 0.0, "Y2": -100.0},
             "X1": {"X1a": 0.0, "X1b": -100.0}, "X2": {"X2a": 0.0, "X2b": -100.0}}
    parent_of = {c: (None if r == "root" else r) for r, kids in table.items() for c in kids}
    want = {1: ["X"], 2: ["X", "X1"], 3: ["X", "X1", "X1a"], 4: ["X", "Y", "X1", "X1a"],
            5: ["X", "Y", "X1", "X2", "X1a"], 6: ["X", "Y", "X1", "X2", "Y1", "X1a"],
            7: ["X", "Y", "X1", "X2", "Y1", "X1a", "X1b"], 8: ["X", "Y", "X1", "X2", "Y1", "X1a", "X1b", "X2a"]}
    for n, names in want.items():
        got = _dynamic_tree_of(table, n)
        assert got == _tree(names, parent_of), n
        assert all(p < i for i, p in enumerate(got[1]))  # each node's parent kept, before it


def test_the_automatic_tree_size_is_what_verifies_at_the_chains_cost():
    # T(1..9): flat to 7 rows, then a step (a kernel's block of rows)
    times = [1.0, 1.1, 1.2, 1.25, 1.3, 1.32, 1.34, 1.66, 1.7]
    assert tree_size(times, 4) == 6  # T(7) = 1.34 <= 1.05 T(5)
    assert tree_size(times, 2) == 3  # T(4) = 1.25 <= 1.05 T(3) = 1.26
    assert tree_size(times, 8) == 8  # never below K
    assert tree_size([1.0, 2.0, 3.0], 1) == 1


def test_an_eagle3_tree_is_the_chain_with_its_siblings():
    """tree_width 3: each depth holds the chain's token (the head's top-1, the parent of the
    next depth) and the next two candidates as leaves; the chain is the tree_width-1 chain."""
    args = _args()
    head = _random_head(args, n=96)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 96, (10,), generator=g).tolist()
    aux = torch.randn(10, 3 * args.dim, generator=g)
    drafts = []
    for w in (1, 3):
        prop = Eagle3Proposer(head, [1, 3, 4], tree_width=w)
        state = RequestState(list(tokens), 0, SamplingParams(), (), None, 96)
        prop.reset(state, 64)
        prop.take_hidden(0, {1: aux[:9, :32], 3: aux[:9, 32:64], 4: aux[:9, 64:]})
        drafts.append(prop.propose(state, 3))
    chain, tree = drafts[0].token_ids[0].tolist(), drafts[1].tree
    assert drafts[1].token_ids[0].tolist() == tree.token_ids.tolist()
    assert tree.parents.tolist() == [-1, -1, -1, 0, 0, 0, 3, 3, 3]
    assert tree.token_ids[[0, 3, 6]].tolist() == chain
    assert len(set(tree.token_ids[:3].tolist())) == 3
    with pytest.raises(ValueError, match="tree_width=9 is invalid"):
        Eagle3Proposer(head, [1, 3, 4], tree_width=9)


def test_a_head_on_the_targets_own_embedding_module_reads_it_in_place():
    """Serving reads the quantized target's int8 embedding table itself: the head's steps equal
    those of a head given that table dequantized, the module is no part of the head (not
    saved, not a parameter), and the output stays plain decoding's."""
    target = tiny_model(0, int8="nk", n_layers=8)
    args = target.args
    table = target.model.embed_tokens
    assert type(table).__name__ == "Int8Embedding"
    copy = _random_head(args, n=60, seed=4, embed=table(torch.arange(args.vocab_size)))
    head = _random_head(args, n=60, seed=4, embed=table)
    assert head.embed is None and not any(t is table.qweight for t in head.state_dict().values())
    ids, hidden, pos = torch.tensor([3, 17, 59]), torch.randn(3, args.dim), torch.tensor([0, 1, 2])
    with torch.no_grad():
        for a, b in zip(head.project(ids, hidden, pos), copy.project(ids, hidden, pos)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert set(head.state_dict()) == set(copy.state_dict())
    params = SamplingParams(max_new_tokens=40)
    plain, _ = run(target, None, None, PROMPTS["twenty"], params)
    gen, _ = run(target, Eagle3Proposer(head, aux_layers(8)), 3, PROMPTS["twenty"], params)
    assert gen.token_ids == plain.token_ids and gen.stats.num_draft_tokens > 0
    with pytest.raises(ValueError, match="embedding module gives"):
        Eagle3Head(_args(), torch.tensor([1, 2]), torch.nn.Embedding(50, _args().dim))


def test_the_int8_head_drafts_what_the_fp32_head_drafts():
    """quantize_ swaps every linear for int8 and keeps the head's choices: the step's top-1
    draft token agrees with the fp32 head's on nearly every row (a broken quantization, a
    wrong layout or scale, agrees on a few percent)."""
    args = _args(dim=64, head_dim=16, intermediate_size=128)
    head = _random_head(args, n=90, seed=5)
    g = torch.Generator().manual_seed(6)
    ids, hidden, pos = torch.randint(0, 96, (200,), generator=g), torch.randn(200, 64, generator=g), torch.zeros(200, dtype=torch.long)
    with torch.no_grad():
        def top1():
            q, k, v, r = head.project(ids, head.fc(torch.cat([hidden] * 3, -1)), pos)
            attn = v.repeat_interleave(q.shape[0] // v.shape[0], dim=0)  # each row sees itself only
            return head.finish(attn, r)[1].argmax(-1)
        before = top1()
        head.quantize_("nk")
        after = top1()
    assert all(isinstance(m, Int8Linear) for m in (head.fc, head.lm_head, head.midlayer.self_attn.q_proj,
                                                   head.midlayer.mlp.down_proj))
    assert (before == after).float().mean() >= 0.9


def test_eagle3_needs_the_native_runtime_and_a_head(tmp_path_factory, tmp_path):
    head = _random_head(_args())
    with pytest.raises(ValueError, match="native runtime"):
        Engine(MockLM(96, lambda ctx: torch.zeros(96)), Eagle3Proposer(head, [1, 3, 4]), 2)
    with pytest.raises(ValueError, match="three target layers"):
        Eagle3Proposer(head, [])
    target = specdecode.load(tiny_dirs_in(tmp_path_factory)["target"])
    with pytest.raises(ValueError, match=r"no head for .* yet: .*or give eagle3:head=DIR"):
        specdecode.generate(target, "x", method="eagle3", max_new_tokens=2)
    with pytest.raises(ValueError, match="this target has 2"):
        specdecode.generate(target, "x", method=f"eagle3:head={tmp_path}", max_new_tokens=2)


def test_training_lowers_the_loss_and_raises_held_out_acceptance(tmp_path):
    """The training-time test on sequences of a fixed pattern (a draft can learn it): the
    loss falls and the held-out greedy acceptance length rises."""
    args = _args()
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(96, 32, generator=g)
    cycle = torch.tensor([5, 17, 29, 41, 53, 65, 77, 89])

    def seq(offset, t=40):
        tokens = cycle[(torch.arange(t) + offset) % 8]
        nxt = cycle[(torch.arange(t) + offset + 1) % 8]
        ids = torch.stack([nxt] + [(nxt + r) % 96 for r in range(1, TOPK)], 1)
        logp = torch.log_softmax(torch.tensor([4.0] + [0.0] * (TOPK - 1)), 0).expand(t, TOPK)
        return Sequence(tokens, 4, torch.zeros(t, 32), torch.randn(t, 96, generator=g) * 0.1, ids, logp)

    train_seqs, held = [seq(i) for i in range(8)], [seq(3, 30)]
    head = Eagle3Head(args, draft_vocabulary(torch.bincount(cycle, minlength=96).float(), 16), embed)
    task = eagle3_task(head, train_seqs, held, {"target": "toy"}, steps=2, eval_steps=3)
    before = chain_acceptance(head, [{"tokens": held[0].tokens, "start": torch.tensor(4), "aux": held[0].aux}], 3)
    result = train(task, tmp_path / "e3", epochs=6, batch_size=2, lr=1e-2, progress=False)
    losses = [h["loss"] for h in result["history"]]
    assert losses[-1] < 0.5 * losses[0], losses
    assert result["history"][-1]["acceptance_length"] > before["acceptance_length"] + 1.0
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert config["architectures"] == [EAGLE3_ARCH] and config["training"]["target"] == "toy"


def _deep_target_dir(root, layers: int = 8, hidden: int = 64):
    """A random Llama of ``layers`` layers (EAGLE-3 needs 7) and head size 16 (the attention
    kernels' shapes: exact draft trees), with the test tokenizer."""
    config = _llama_config(len(local_tokenizer()), hidden=hidden)
    config.num_hidden_layers = layers
    model = LlamaForCausalLM(config)
    _randomize(model, seed=0)
    model.save_pretrained(root)
    local_tokenizer().save_pretrained(root)
    return root


def test_the_eagle3_method_through_the_api(tmp_path, monkeypatch):
    """``method="eagle3:head=DIR"`` loads the head on the target's own embedding (int8 linears
    for an int8 target, fp32 for an fp32 one), and keeps plain decoding's output as a chain,
    a tree (tree=W), a dynamic tree (nodes=N) and a dynamic tree of the size the target's
    measured forward times give (nodes=auto), alone and for a list of prompts (the batched
    engine); without head= it reads the target's default head."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))  # its own default heads
    target = specdecode.load(_deep_target_dir(tmp_path / "target"))
    lm = target.lm
    assert lm.weight_format.startswith("int8") and lm.exact_trees
    head = _random_head(lm.args, n=300, seed=3, embed=lm.model.embed_tokens(torch.arange(lm.vocab_size)))
    saved = head.save(tmp_path / "e3")
    prompt = "def add(a, b):"
    plain = specdecode.generate(target, prompt, method="ar", max_new_tokens=24)
    for method, nodes in ((f"eagle3:head={saved}", 4), (f"eagle3:head={saved}:tree=3", 12),
                          (f"eagle3:head={saved}:nodes=6:tree=3", 6)):
        out = specdecode.generate(target, prompt, method=method, max_new_tokens=24, num_speculative_tokens=4)
        assert out.token_ids == plain.token_ids, method
        # the first round's draft: K = 4 tokens, or the tree's nodes
        assert out.stats.speculation_lengths[0] == nodes and out.stats.num_draft_tokens > 0, method
        # without a K, auto schedules it (the heads' default): the same output
        out = specdecode.generate(target, prompt, method=method, max_new_tokens=24)
        assert out.token_ids == plain.token_ids and out.stats.num_draft_tokens > 0, method
    # a list of prompts runs in the batched engine (a dynamic tree): each equals its plain decoding
    prompts = [prompt, "x = [1, 2, 3", "Hello there"]
    many = specdecode.generate(target, prompts, method=f"eagle3:head={saved}:nodes=6", max_new_tokens=24)
    assert [r.token_ids for r in many] == [specdecode.generate(target, p, method="ar", max_new_tokens=24).token_ids
                                           for p in prompts]
    assert sum(r.stats.num_draft_tokens for r in many) > 0
    # nodes=auto: the most nodes a pass verifies at the chain's cost, from the target's
    # forward times T(1..n) (here set: flat up to 8 rows, then a step): 7 (T(8) <= 1.05 T(5))
    target.forward_seconds = [0.01] * 8 + [0.02] * (MAX_K + 1 - 8)
    assert verify_profile(target, MAX_K) == target.forward_seconds
    out = specdecode.generate(target, prompt, method=f"eagle3:head={saved}:nodes=auto", max_new_tokens=24,
                              num_speculative_tokens=4)
    assert out.token_ids == plain.token_ids and out.stats.speculation_lengths[0] == 7
    loaded = list(target.heads.values())
    assert len(loaded) == 1  # loaded once for all five
    assert all(isinstance(m, Int8Linear) for m in (loaded[0].fc, loaded[0].lm_head, loaded[0].midlayer.mlp.up_proj))
    assert torch.equal(loaded[0].draft_ids, head.draft_ids) and loaded[0].embed is None  # the target's own table
    # without head=: the target's default head
    head.save(default_head_dir(target.name, "eagle3"))
    out = specdecode.generate(target, prompt, method="eagle3", max_new_tokens=24)
    assert out.token_ids == plain.token_ids and out.stats.num_draft_tokens > 0
    assert len(target.heads) == 2 and any(str(default_head_dir(target.name, "eagle3").resolve()) in key
                                          for key in target.heads)
    # an fp32 target keeps the head in fp32
    fp32 = specdecode.load(tmp_path / "target", dtype="float32")
    out = specdecode.generate(fp32, prompt, method=f"eagle3:head={saved}", max_new_tokens=24)
    assert out.token_ids == specdecode.generate(fp32, prompt, method="ar", max_new_tokens=24).token_ids
    assert type(next(iter(fp32.heads.values())).fc) is torch.nn.Linear

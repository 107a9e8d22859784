"""Medusa draft heads (specdecode.heads, proposers/medusa.py): the module, vLLM's directory
format, the hidden state the engine hands over, and lossless output through chains and static
trees on the real kernels; Medusa and EAGLE-3 heads made perfect at their logits (every draft
accepted), alone and in the batched engine."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import specdecode
from helpers import KERNEL_SHAPES, MockLM, PROMPTS, run, tiny_model
from specdecode.batch import BatchEngine
from specdecode.config import SamplingParams
from specdecode.engine import Engine
from specdecode.heads import Eagle3Head, MedusaHeads, aux_layers, default_head_dir, draft_vocabulary
from specdecode.methods import SpeculativeConfig, build_proposer, speculative_config
from specdecode.models import quant
from specdecode.models import native
from specdecode.models.native import FINAL
from specdecode.proposers import Eagle3Proposer, MedusaProposer, PromptLookupProposer
from specdecode.schedule import FixedK


def _random_heads(model, num_heads=3, seed=0, shared=False):
    g = torch.Generator().manual_seed(seed)
    lm = model.lm_head.weight if hasattr(model.lm_head, "weight") else None
    heads = MedusaHeads(model.args.dim, model.args.vocab_size, num_heads,
                        lm_head=lm.detach() if shared else None)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return heads


def test_identity_blocks_with_the_target_projection_guess_the_target_token():
    """Medusa's initialisation: zero blocks and the target's lm_head, so each head's logits
    are the target's own logits from the same hidden state."""
    lm = torch.randn(50, 16)
    heads = MedusaHeads(16, 50, 2, lm_head=lm)
    h = torch.randn(4, 16)
    out = heads(h)
    assert out.shape == (2, 4, 50)
    torch.testing.assert_close(out[0], h @ lm.t())
    torch.testing.assert_close(out[1], h @ lm.t())


@pytest.mark.parametrize("shared", [False, True])
def test_save_writes_vllm_medusa_format_and_load_reads_it_back(tmp_path, shared):
    model = tiny_model(0)
    heads = _random_heads(model, shared=shared)
    out = heads.save(tmp_path / "medusa", trained_on="test")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["medusa_fc_bias"] is True
    assert config["num_heads"] == 3 and config["hidden_size"] == model.args.dim
    assert config["original_lm_head"] is shared and config["trained_on"] == "test"
    names = set(load_file(str(out / "model.safetensors")))
    umask = os.umask(0)
    os.umask(umask)  # readable as any new file (safetensors alone writes 0600: a vLLM container cannot read it)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    blocks = {f"blocks.{i}.layers.0.{k}" for i in range(3) for k in ("weight", "bias")}
    assert names == blocks | ({"lm_heads.0.weight"} if shared else {f"lm_heads.{i}.weight" for i in range(3)})
    back = MedusaHeads.load(out)
    with torch.no_grad():  # what bf16 on disk keeps of the weights
        for p in heads.parameters():
            p.copy_(p.bfloat16().float())
        if shared:
            heads.shared_lm_head.copy_(heads.shared_lm_head.bfloat16().float())
    h = torch.randn(2, model.args.dim)
    assert torch.equal(back(h), heads(h))
    assert back.original_lm_head is shared
    exact = MedusaHeads.load(heads.save(tmp_path / "fp32", dtype=torch.float32))
    assert torch.equal(exact(h), heads(h))


def test_load_names_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="is not a directory of Medusa heads"):
        MedusaHeads.load(tmp_path / "nothing")
    out = MedusaHeads(8, 20, 2).save(tmp_path / "m")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_heads": 3}))
    with pytest.raises(ValueError, match="does not hold 3 Medusa heads"):
        MedusaHeads.load(out)
    (out / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"does not hold Medusa heads \(MedusaModel\): its config.json names architectures \['LlamaForCausalLM'\]"):
        MedusaHeads.load(out)
    with pytest.raises(ValueError, match="shared lm_head has shape"):
        MedusaHeads(8, 20, 2, lm_head=torch.zeros(20, 9))
    with pytest.raises(ValueError, match="num_heads=0"):
        MedusaHeads(8, 20, 0)
    (out / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match="does not hold Medusa heads"):
        MedusaHeads.load(out)


def test_heads_without_fc_bias_load_as_vllm_loads_them(tmp_path):
    """vLLM drops the blocks' biases unless the config says medusa_fc_bias: true."""
    heads = _random_heads(tiny_model(0), num_heads=2)
    out = heads.save(tmp_path / "m", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "medusa_fc_bias": False}))
    back = MedusaHeads.load(out)
    assert all(not layer.bias.any() for block in back.blocks for layer in block.layers)
    assert torch.equal(back.blocks[0].layers[0].weight, heads.blocks[0].layers[0].weight)


@pytest.mark.parametrize("tree,match", [([(0, 0)], "no parent"), ([()], "invalid"), ([], "empty"),
                                        ([(0,), (20,)], "invalid"),
                                        ([(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)], "invalid"),
                                        ([(0,), (0,)], "repeat"), ([(-1,)], "invalid")])
def test_bad_trees_are_refused(tree, match):
    with pytest.raises(ValueError, match=match):
        MedusaProposer(MedusaHeads(8, 20, 3), tree)


class _Spy(MedusaProposer):
    """Records, after every verify pass, the hidden state handed over and the last token."""

    def __init__(self, heads, tree=None):
        super().__init__(heads, tree)
        self.seen = []

    def reset(self, state, max_total_len):
        super().reset(state, max_total_len)
        self.state = state

    def take_hidden(self, start, hidden):
        super().take_hidden(start, hidden)
        if start == 0:  # the prefill's: every prompt position but the last
            self.prefill = hidden[FINAL].clone()
        else:
            self.seen.append(hidden[FINAL][-1].clone())

    def on_accept(self, state):
        self.seen[-1] = (self.seen[-1], state.tokens[-1])


def test_the_hidden_state_is_the_one_that_predicted_the_last_committed_token():
    """With the target's own projection and identity blocks, head 0's argmax on the hidden
    state handed over is the last committed token (greedy): the engine gives the row that
    predicted it, in chains and in trees."""
    target = tiny_model(0, **KERNEL_SHAPES)  # fp32: the heads' projection is the target's exactly
    for tree in (None, [(0,), (1,), (0, 0)]):
        spy = _Spy(MedusaHeads(target.args.dim, target.args.vocab_size, 2,
                               lm_head=target.lm_head.weight.detach()), tree)
        if tree is not None and not target.exact_trees:
            continue
        gen, _ = run(target, spy, 2, PROMPTS["twenty"], SamplingParams(max_new_tokens=20))
        assert len(spy.seen) == gen.stats.num_verify_passes
        for h, last in spy.seen:
            assert int(spy.heads(h)[0].argmax()) == last
        prompt = PROMPTS["twenty"]
        target.allocate(1, len(prompt))
        want = target.forward_rows(torch.tensor([prompt[:-1]]), output_hidden=(FINAL,)).hidden[FINAL][0]
        torch.testing.assert_close(spy.prefill, want, rtol=0, atol=0)


class _Counting(torch.nn.Module):
    """A module that passes to ``inner`` and records the input shape of every call."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, []
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x):
        self.calls.append(tuple(x.shape))
        return self.inner(x)


def test_heads_read_the_targets_own_lm_head_once_for_all_heads():
    """Served heads with ``original_lm_head`` read the target's own (here int8) lm_head
    module in place: their logits are that module's on the stacked block outputs, from one
    call for all heads (a drafting step reads the table once, not once per head); they hold
    no copy of the table; moving or quantizing the heads leaves the target's module alone;
    they cannot be saved (they lack the table); a module of another size is refused."""
    target = tiny_model(0, int8="nk", **KERNEL_SHAPES)
    table = _random_heads(target, num_heads=3, seed=5, shared=False)  # random blocks to copy
    own = _Counting(target.lm_head)
    heads = MedusaHeads(target.args.dim, target.vocab_size, 3, lm_head=own)
    heads.load_state_dict({k: v for k, v in table.state_dict().items() if k.startswith("blocks.")})
    assert set(heads.state_dict()) == {k for k in table.state_dict() if k.startswith("blocks.")}
    assert not any(t.numel() >= target.vocab_size * target.args.dim for t in heads.buffers())
    h = torch.randn(2, target.args.dim)
    with torch.no_grad():
        got = heads(h)
        want = target.lm_head(torch.stack([b(h) for b in heads.blocks])).float()
    assert own.calls == [(3, 2, target.args.dim)]
    torch.testing.assert_close(got, want[..., :target.vocab_size], rtol=0, atol=0)
    kind = type(target.lm_head)
    heads.to("cpu").quantize_("nk")
    assert type(target.lm_head) is kind and heads._target_lm_head is own
    assert type(heads.blocks[0].layers[0]).__name__ == "Int8Linear"
    with pytest.raises(ValueError, match="read the target's own lm_head module"):
        heads.save("/nonexistent")
    with pytest.raises(ValueError, match=r"maps .* features; .* give heads made for this target"):
        MedusaHeads(target.args.dim + 8, target.vocab_size, 2, lm_head=target.lm_head)
    # a head over the first ids only (a draft head, FR-Spec): the other ids are never drafted
    first = quant.first_rows(target.lm_head, 16)
    part = MedusaHeads(target.args.dim, target.vocab_size, 3, lm_head=first)
    part.load_state_dict({k: v for k, v in table.state_dict().items() if k.startswith("blocks.")})
    with torch.no_grad():
        got = part(h)
        assert part(h, 2).shape == (2, 2, target.vocab_size)
    torch.testing.assert_close(got[..., :16], want[..., :16], rtol=0, atol=0)
    assert torch.all(got[..., 16:] == -torch.inf)


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=40),
                                    SamplingParams(max_new_tokens=40, temperature=0.9, seed=2)],
                         ids=["greedy", "gumbel"])
@pytest.mark.parametrize("tree", [None, [(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0)]],
                         ids=["chain", "tree"])
def test_medusa_output_equals_plain_decoding_on_the_int8_target(params, tree):
    target = tiny_model(0, int8="nk", **KERNEL_SHAPES)
    proposer = MedusaProposer(_random_heads(target, seed=4), tree)
    if tree is not None and not target.exact_trees:
        with pytest.raises(ValueError, match="draft trees need a target"):
            Engine(target, proposer, 3)
        return
    plain, _ = run(target, None, None, PROMPTS["twenty"], params)
    gen, _ = run(target, proposer, 3, PROMPTS["twenty"], params)
    assert gen.token_ids == plain.token_ids
    assert gen.stats.num_draft_tokens > 0


def test_heads_run_in_the_batched_engine_each_row_equal_to_its_request_alone():
    """Medusa and EAGLE-3 rows beside plain and lookup rows, greedy and seeded, prompts of
    several lengths (a one-token one: no state for its first round), chains and draft trees
    (Medusa's static tree, EAGLE-3's siblings and its dynamic tree): each row's output is its
    request's alone; the heads drafted. Heads need the native runtime."""
    target = tiny_model(0, int8="nk", n_layers=8, **KERNEL_SHAPES)
    assert target.exact_trees, "this project's machines run the CPU attention kernels"
    args = target.args
    medusa = _random_heads(target, num_heads=3, seed=2)
    g = torch.Generator().manual_seed(4)
    eagle = Eagle3Head(args, torch.randperm(args.vocab_size, generator=g)[:60].sort().values,
                       torch.randn(args.vocab_size, args.dim, generator=g))
    with torch.no_grad():
        for name, p in eagle.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "norm" not in name else 0.1) + ("norm" in name))
    greedy, seeded = SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=30, temperature=0.9, seed=3)
    twenty = PROMPTS["twenty"]
    reqs = [(twenty, greedy, lambda: MedusaProposer(medusa), 3),
            (twenty[:5], seeded, lambda: Eagle3Proposer(eagle, aux_layers(8)), 3),
            (twenty * 3, greedy, lambda: Eagle3Proposer(eagle, aux_layers(8)), 2),
            ([7], greedy, lambda: MedusaProposer(medusa), 2),
            (twenty[3:], greedy, lambda: None, None),
            (twenty * 2, seeded, lambda: PromptLookupProposer(), 4),
            (twenty[1:], greedy, lambda: MedusaProposer(medusa, MedusaProposer.siblings_tree(3, 2)), 3),
            (twenty[:9], seeded, lambda: Eagle3Proposer(eagle, aux_layers(8), tree_width=3), 3),
            (twenty * 2, greedy, lambda: Eagle3Proposer(eagle, aux_layers(8), tree_width=2, tree_nodes=5), 3)]
    want = [Engine(target.fork(), make(), k).generate(p, params).run() for p, params, make, k in reqs]
    batch = BatchEngine(target.fork(), 4, 160, debug=True)
    try:
        gens = [batch.add(p, params, proposer=make(), schedule=None if k is None else FixedK(k))
                for p, params, make, k in reqs]
        batch.run()
        for g_, w in zip(gens, want):
            assert g_.token_ids == w.token_ids
        assert all(g_.stats.num_draft_tokens > 0 for i, g_ in enumerate(gens) if i != 4)
    finally:
        batch.close()
    heads = MedusaHeads(8, 8, 2)
    with pytest.raises(ValueError, match="native runtime"):
        Engine(MockLM(8, lambda ctx: torch.zeros(8)), MedusaProposer(heads), 2)
    assert FINAL == -1


def test_the_medusa_method_through_the_api(tmp_path, tmp_path_factory, monkeypatch):
    """``method="medusa:head=DIR"`` loads the heads, checks them against the target, and
    keeps plain decoding's output, as a chain or a tree, alone or for a list of prompts (the
    batched engine); without head= it reads the target's default heads, says
    how to make them when they are missing; with another target's heads it says what to give."""
    from transformers import LlamaForCausalLM
    from tiny_dirs import _llama_config, _randomize, local_tokenizer
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))  # its own default heads
    model = LlamaForCausalLM(_llama_config(len(local_tokenizer()), hidden=64))  # head_dim 16: exact trees
    _randomize(model, seed=0)
    model.save_pretrained(tmp_path / "target")
    local_tokenizer().save_pretrained(tmp_path / "target")
    target = specdecode.load(tmp_path / "target")
    lm = target.lm
    assert lm.exact_trees, "this project's machines run the CPU attention kernels"
    heads = _random_heads(lm, num_heads=2, seed=1).save(tmp_path / "heads")
    prompt = "def add(a, b):"
    plain = specdecode.generate(target, prompt, method="ar", max_new_tokens=24)
    for method in (f"medusa:head={heads}", f"medusa:head={heads}:tree=2"):
        out = specdecode.generate(target, prompt, method=method, max_new_tokens=24)
        assert out.token_ids == plain.token_ids
        assert out.stats.num_draft_tokens > 0
    # heads sharing the output layer (original_lm_head) read the target's own module, no copy
    shared = MedusaHeads(lm.args.dim, lm.vocab_size, 2, lm_head=model.lm_head.weight.detach()[:lm.vocab_size])
    shared.load_state_dict(_random_heads(lm, num_heads=2, seed=3).state_dict(), strict=False)
    shared = shared.save(tmp_path / "shared")
    out = specdecode.generate(target, prompt, method=f"medusa:head={shared}", max_new_tokens=24)
    assert out.token_ids == plain.token_ids and out.stats.num_draft_tokens > 0
    loaded = [h for key, h in target.heads.items() if key[1] == str(shared.resolve())]
    assert len(loaded) == 1 and loaded[0]._target_lm_head is lm.lm_head
    assert "shared_lm_head" not in dict(loaded[0].named_buffers())
    # a target of a large vocabulary gives them its output layer over the first ids only,
    # as a self-draft's (native.DRAFT_VOCAB: 32,768 of the default target's 151,936)
    monkeypatch.setattr(native, "DRAFT_VOCAB", 32)
    assert lm.args.vocab_size > 64
    first = MedusaHeads.load(shared).save(tmp_path / "first")
    out = specdecode.generate(target, prompt, method=f"medusa:head={first}", max_new_tokens=24)
    assert out.token_ids == plain.token_ids
    loaded = [h for key, h in target.heads.items() if key[1] == str(first.resolve())]
    assert loaded[0]._target_lm_head.out_features == 32 and loaded[0]._target_lm_head is lm.draft_head(32)
    monkeypatch.undo()
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    # a list of prompts runs in the batched engine, trees included: each equals its plain decoding
    prompts = [prompt, "x = [1, 2, 3", "Hello there"]
    many = specdecode.generate(target, prompts, method=f"medusa:head={heads}:tree=2", max_new_tokens=24)
    assert [r.token_ids for r in many] == [specdecode.generate(target, p, method="ar", max_new_tokens=24).token_ids
                                           for p in prompts]
    # Medusa's own node lists (medusa_choices) from a JSON file: the tree the proposer drafts
    choices = tmp_path / "choices.json"
    choices.write_text("[[0], [1], [0, 0], [0, 1], [2]]")
    out = specdecode.generate(target, prompt, method=f"medusa:head={heads}:choices={choices}", max_new_tokens=24)
    assert out.token_ids == plain.token_ids and out.stats.num_draft_tokens > 0
    spec = speculative_config(f"medusa:head={heads}:choices={choices}", False)
    assert build_proposer(spec, target, None).nodes == [(0,), (1,), (2,), (0, 0), (0, 1)]
    for text, message in [("[[0], [1, 0], [0, 0, 0]]", r"node \(1, 0\) has no parent \(1,\)"),
                          ("[[0], [-1]]", "medusa_choices = .* is invalid; allowed: a non-empty list"),
                          ("[]", "medusa_choices = .* is invalid"), ("[[0], [0, 0], [0, 0, 0]]", "allowed: a tuple of 1..2 candidate ranks"),
                          ("{", "cannot read a Medusa tree from it")]:
        choices.write_text(text)
        with pytest.raises(ValueError, match=message):
            specdecode.generate(target, prompt, method=f"medusa:head={heads}:choices={choices}", max_new_tokens=4)
    with pytest.raises(ValueError, match=r"tree=W\) or its node list \(choices=FILE\), not both"):
        SpeculativeConfig("medusa", draft_tree_width=2, medusa_choices=[[0]])
    # what makes a node list no tree is said when it is parsed (a server's start), not at a request
    with pytest.raises(ValueError, match=r"node \(2, 0\) has no parent \(2,\)"):
        SpeculativeConfig("medusa", medusa_choices=[[0], [2, 0]])
    with pytest.raises(ValueError, match="nodes repeat"):
        SpeculativeConfig("medusa", medusa_choices=[[0], [0]])
    with pytest.raises(ValueError, match="node list .* applies to 'medusa', not 'eagle3'"):
        SpeculativeConfig("eagle3", medusa_choices=[[0]])
    with pytest.raises(ValueError, match=r"no head for .* yet: `specdecode train medusa --target"):
        specdecode.generate(target, prompt, method="medusa", max_new_tokens=4)
    # without head= the method reads the target's default heads (where `train` writes them)
    _random_heads(lm, num_heads=2, seed=1).save(default_head_dir(target.name, "medusa"))
    out = specdecode.generate(target, prompt, method="medusa", max_new_tokens=24)
    assert out.token_ids == plain.token_ids and out.stats.num_draft_tokens > 0
    for shared in (None, torch.zeros(lm.vocab_size, lm.args.dim + 8)):
        other = MedusaHeads(lm.args.dim + 8, lm.vocab_size, 2, lm_head=shared).save(tmp_path / "other")
        with pytest.raises(ValueError, match="give heads made for this target"):
            specdecode.generate(target, prompt, method=f"medusa:head={other}", max_new_tokens=4)


def test_default_head_dir_per_target_and_kind(tmp_path, monkeypatch):
    """Known names keep their name; directories their base name and a hash of the full path
    (two checkouts named alike do not share a head); another kind is refused."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    assert default_head_dir("qwen2.5-coder-1.5b-instruct", "eagle3") == \
        tmp_path / "cache" / "heads" / "qwen2.5-coder-1.5b-instruct-eagle3"
    a, b = default_head_dir(str(tmp_path / "x" / "m"), "medusa"), default_head_dir(str(tmp_path / "y" / "m"), "medusa")
    assert a.name.startswith("m-") and a.name.endswith("-medusa") and a != b
    assert default_head_dir(str(tmp_path / "x" / "m"), "medusa") == a
    with pytest.raises(ValueError, match="'hydra' is not one of"):
        default_head_dir("qwen2.5-coder-1.5b-instruct", "hydra")


# ----------------------------------------------------------------------------------------
# Perfect heads: every draft token accepted (the heads' real steps run; only their logits
# are made to favour the target's own continuation)
# ----------------------------------------------------------------------------------------

BOOST = 20.0  # above a row's largest logit: the token is the head's top-1 with probability ~1


def _rounds(prompt_len: int, max_new: int, k: int) -> list[tuple[int, int]]:
    """(committed tokens before the round, K of the round) of every round of a request whose
    drafts are all accepted: each round commits K + 1 tokens, K cut only where the request
    ends (RequestRun.wanted_k). The fewest rounds a request of these lengths can take."""
    out, n, limit = [], prompt_len, prompt_len + max_new
    while n < limit:
        kk = min(k, limit - n - 1)
        out.append((n, kk))
        n += kk + 1
    return out


def _target_states(target, tokens: list[int], keys) -> dict[int, torch.Tensor]:
    """The target's hidden states ``keys`` of the rows 0..len(tokens)-1 in one pass (a fork:
    the target's own cache untouched)."""
    ref = target.fork()
    ref.allocate(1, len(tokens) + 1)
    return {k: h[0] for k, h in ref.forward_rows(torch.tensor([tokens]), num_logits=0,
                                                 output_hidden=tuple(keys)).hidden.items()}


def _eagle3_head(target, ids: torch.Tensor, seed: int) -> Eagle3Head:
    """A random EAGLE-3 head of draft vocabulary ``ids`` on the target's own embedding module
    (as the method loads one)."""
    g = torch.Generator().manual_seed(seed)
    head = Eagle3Head(target.args, ids, target.model.embed_tokens)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "norm" not in name else 0.1) + ("norm" in name))
    return head.eval()


def _perfect_eagle3(head: Eagle3Head, full: list[int]) -> Eagle3Head:
    """Make ``head`` a perfect drafter of ``full`` (prompt + the target's own output) at its
    logits: each step it finishes for a row at position q that reads full[q+1] (the token
    the target wrote there) gets full[q+2]'s logit raised BOOST above its largest. The
    head's real steps run (its cache rows, chain steps, tree expansion, dynamic-tree scores);
    only the logits differ."""
    index = {t: i for i, t in enumerate(head.draft_ids.tolist())}
    project, finish, rows = head.project, head.finish, []

    def recording_project(ids, hidden, positions):
        rows[:] = list(zip(ids.tolist(), positions.tolist()))
        return project(ids, hidden, positions)

    def perfect_finish(attn, residual):
        pre, logits = finish(attn, residual)
        logits = logits.clone()
        for r, (tok, q) in enumerate(rows[len(rows) - len(logits):]):  # the rows finished
            if q + 2 < len(full) and tok == full[q + 1]:
                logits[r, index[full[q + 2]]] = logits[r].max() + BOOST
        return pre, logits

    head.project, head.finish = recording_project, perfect_finish
    return head


def _perfect_medusa(heads: MedusaHeads, full: list[int], finals: torch.Tensor, seen: list) -> MedusaHeads:
    """Make ``heads`` perfect drafters of ``full`` at their logits: the hidden state the
    proposer gives them is looked up among the target's final states of ``full``
    (``finals`` [len(full) - 1, dim]; row p predicts full[p+1]); head i's logit of
    full[p+2+i] is raised BOOST above its largest. Appends (p, distance to that state) to
    ``seen`` per call."""
    forward = heads.forward

    def perfect(hidden, num_heads=None):
        logits = forward(hidden, num_heads).clone()
        d = (finals - hidden.float()).norm(dim=-1)
        p = int(d.argmin())
        seen.append((p, float(d[p]) / float(finals[p].norm())))
        for i in range(len(logits)):
            if p + 2 + i < len(full):
                logits[i, full[p + 2 + i]] = logits[i].max() + BOOST
        return logits

    heads.forward = perfect
    return heads


def _assert_eagle3_cache_is_the_targets(prop: Eagle3Proposer, target, full: list[int], cached: int):
    """The head's KV cache after the request: its rows 0..cached-1 (``cached``: every position
    committed before the last round's proposal) are the head's step 0 on the target's real
    states, as one pass over the committed tokens gives them, not the rows its chains wrote
    there from their own ``pre`` states (each accepted draft's position held one)."""
    assert prop._cached == cached
    states = _target_states(target, full[:cached], prop.hidden_keys)
    feats = torch.cat([states[i] for i in prop.hidden_keys], -1)
    with torch.no_grad():
        _, k, v, _ = prop.head.project(torch.tensor(full[1:cached + 1]), prop.head.fc(feats.float()),
                                       torch.arange(cached))
    torch.testing.assert_close(prop._k[:, :cached], k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(prop._v[:, :cached], v, rtol=1e-4, atol=1e-4)


PERFECT = {  # the perfect proposers (_perfect_proposer): name -> the K they run with
    "eagle3-chain": 4, "eagle3-tree3": 4, "eagle3-dynamic7": 4, "medusa-chain": 3, "medusa-tree": 3}


def _perfect_proposer(kind: str, target, full: list[int], prompt_len: int, seen: list, seed: int = 4):
    """A proposer of PERFECT ``kind`` whose random head is made a perfect drafter of ``full``
    (EAGLE-3: draft vocabulary the 48 most frequent tokens of the output; Medusa: 3 heads,
    its lookups appended to ``seen``)."""
    if kind.startswith("eagle3"):
        counts = torch.bincount(torch.tensor(full[prompt_len:]), minlength=target.args.vocab_size)
        head = _perfect_eagle3(_eagle3_head(target, draft_vocabulary(counts.float(), 48), seed), full)
        width, nodes = {"eagle3-chain": (1, None), "eagle3-tree3": (3, None), "eagle3-dynamic7": (2, 7)}[kind]
        return Eagle3Proposer(head, aux_layers(target.args.n_layers), tree_width=width, tree_nodes=nodes)
    finals = _target_states(target, full[:-1], (FINAL,))[FINAL]
    heads = _perfect_medusa(_random_heads(target, num_heads=3, seed=seed), full, finals, seen)
    return MedusaProposer(heads, None if kind == "medusa-chain" else
                          [(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0)])


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=40),
                                    SamplingParams(max_new_tokens=40, temperature=0.9, seed=2)],
                         ids=["greedy", "gumbel"])
@pytest.mark.parametrize("kind", list(PERFECT))
def test_a_perfect_head_has_every_draft_accepted_and_keeps_the_output(params, kind):
    """A head whose logits favour the target's own continuation (from plain decoding with the
    same parameters: the greedy tokens, or the seeded Gumbel-rule ones): every round's chain,
    or the tree's path to its full depth, is accepted, so the request takes the fewest verify
    passes, and the output is plain decoding's. The engine hands over the right states
    after several accepted rows: Medusa's is the accepted path's last row (the one that
    predicted the last committed token), EAGLE-3's cache rows of every committed position
    are rebuilt from the target's real states."""
    target = tiny_model(0, int8="nk", n_layers=8, **KERNEL_SHAPES)
    prompt, k = PROMPTS["twenty"], PERFECT[kind]
    plain, _ = run(target, None, None, prompt, params)
    full = prompt + plain.token_ids
    seen = []
    proposer = _perfect_proposer(kind, target, full, len(prompt), seen)
    if proposer.makes_trees and not target.exact_trees:  # no CPU attention kernel here: trees refused
        with pytest.raises(ValueError, match="draft trees need a target"):
            Engine(target, proposer, k)
        return
    gen, blocks = run(target, proposer, k, prompt, params)
    assert gen.token_ids == plain.token_ids
    rounds = _rounds(len(prompt), params.max_new_tokens, k)
    assert [len(b) - 1 for b in blocks] == [kk for _, kk in rounds]  # every round: K accepted + bonus
    assert gen.stats.num_verify_passes == len(rounds) < plain.stats.num_verify_passes // k
    assert {i.kind for i in gen.token_info} == {"accepted", "bonus"}  # nothing recovered
    assert gen.stats.num_accepted_tokens == sum(kk for _, kk in rounds)
    if not proposer.makes_trees:  # a chain: every drafted token accepted
        assert gen.stats.num_accepted_tokens == gen.stats.num_draft_tokens
    else:  # a tree verified more nodes than its accepted path
        assert gen.stats.num_draft_tokens > gen.stats.num_accepted_tokens
    if kind.startswith("medusa"):  # each round read the state of the row before the last committed token
        assert [p for p, _ in seen] == [n - 2 for n, _ in rounds]
        assert max(d for _, d in seen) < 1e-4
    else:
        _assert_eagle3_cache_is_the_targets(proposer, target, full, rounds[-1][0] - 1)


def test_perfect_heads_in_the_batched_engine_have_every_draft_accepted():
    """The same perfect heads as rows of one batch (chains, EAGLE-3's siblings tree and
    dynamic tree, Medusa's static tree; greedy and seeded; beside a plain row; more requests
    than rows): each row's output is its request's plain decoding, every round accepts its
    full K, and the head states handed over in the batch's passes are the target's."""
    target = tiny_model(0, int8="nk", n_layers=8, **KERNEL_SHAPES)
    assert target.exact_trees, "this project's machines run the CPU attention kernels"
    greedy, seeded = SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=30, temperature=0.9, seed=3)
    twenty = PROMPTS["twenty"]
    reqs = [(twenty, greedy, "eagle3-chain"), (twenty[:7], seeded, "eagle3-tree3"),
            (twenty * 2, greedy, "eagle3-dynamic7"), (twenty[2:], greedy, "medusa-chain"),
            (twenty[5:], seeded, "medusa-tree"), (twenty[1:], greedy, None)]
    fulls = [p + Engine(target.fork()).generate(p, params).run().token_ids for p, params, _ in reqs]
    seen = [[] for _ in reqs]
    proposers = [None if kind is None else _perfect_proposer(kind, target, full, len(p), s, seed=i)
                 for i, ((p, _, kind), full, s) in enumerate(zip(reqs, fulls, seen))]
    batch = BatchEngine(target.fork(), 4, 160, debug=True)
    try:
        gens = [batch.add(p, params, proposer=prop, schedule=None if kind is None else FixedK(PERFECT[kind]))
                for (p, params, kind), prop in zip(reqs, proposers)]
        batch.run()
    finally:
        batch.close()
    for (p, params, kind), full, gen, prop, s in zip(reqs, fulls, gens, proposers, seen):
        assert gen.token_ids == full[len(p):], kind
        if kind is None:
            continue
        rounds = _rounds(len(p), params.max_new_tokens, PERFECT[kind])
        assert gen.stats.num_verify_passes == len(rounds), kind
        assert gen.stats.num_accepted_tokens == sum(kk for _, kk in rounds), kind
        assert {i.kind for i in gen.token_info} == {"accepted", "bonus"}, kind
        if kind.startswith("medusa"):
            assert [q for q, _ in s] == [n - 2 for n, _ in rounds] and max(d for _, d in s) < 1e-4
        else:
            _assert_eagle3_cache_is_the_targets(prop, target, full, rounds[-1][0] - 1)

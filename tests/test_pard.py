"""The parallel draft's training layout (PARD, arXiv:2504.18583): every row of one
teacher-forced pass equals what the draft computes at inference (context, then masks), the
conditional drop-token keeps nested anchors, and the held-out acceptance counts chains as a
verify pass would keep them."""

import pytest
import torch

from specdecode.train.pard import ParallelDraft, mask_token_id, parallel_acceptance, parallel_layout

from tiny_dirs import TINY, hf_model_dir, local_tokenizer

MASK = TINY["vocab_size"] - 1


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    return hf_model_dir(tmp_path_factory.mktemp("pard"), "qwen2-bias-tied").float().eval()


def _inference_logits(model, mask_embedding, prefix: torch.Tensor, masks: int) -> torch.Tensor:
    """What the parallel draft computes when proposing: ``prefix`` then ``masks`` mask tokens,
    one causal pass; logits [len(prefix) + masks, V]."""
    embeds = model.get_input_embeddings()(prefix)
    embeds = torch.cat([embeds, mask_embedding.expand(masks, -1)])
    return model(inputs_embeds=embeds[None]).logits[0]


def test_every_row_of_the_training_layout_equals_its_inference_pass(tiny_draft):
    module = ParallelDraft(tiny_draft, MASK, k=4)
    with torch.no_grad():
        module.mask_embedding.normal_(0, 1.0)  # a mask unlike any token: wrong rows would show
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, MASK, (14,), generator=g)
    layout = parallel_layout(len(tokens), 5, 4, keep=0.7, keep_min=0.3, generator=g)
    with torch.no_grad():
        got = module.logits(tokens, layout)
        checked = 0
        for r in range(len(layout["token"])):
            a, s = int(layout["anchor"][r]), int(layout["segment"][r])
            want = _inference_logits(tiny_draft, module.mask_embedding, tokens[:a + 1], s)[-1]
            assert (got[r] - want).abs().max() <= 1e-4, (a, s)
            checked += s > 0
    assert checked >= 10 and int(layout["segment"].max()) == 3


def test_drop_token_keeps_nested_anchors_and_predicts_the_right_tokens():
    layout = parallel_layout(40, 10, 8, keep=0.7, keep_min=0.2, generator=torch.Generator().manual_seed(0))
    seg, anc, tgt = layout["segment"], layout["anchor"], layout["target"]
    counts = [int((seg == s).sum()) for s in range(8)]
    assert counts[0] == 40 and counts[1] < 30 and counts[7] >= 1
    for s in range(2, 8):  # every anchor kept in s is in s-1
        assert set(anc[seg == s].tolist()) <= set(anc[seg == s - 1].tolist())
    masks = seg > 0
    assert torch.equal(tgt[masks], anc[masks] + seg[masks] + 1)
    assert (tgt[~masks][:9] == -1).all() and torch.equal(tgt[~masks][9:39], torch.arange(10, 40))
    full = parallel_layout(40, 10, 8)
    assert [int((full["segment"] == s).sum()) for s in range(1, 8)] == [30 - s for s in range(1, 8)]
    with pytest.raises(ValueError, match="bad layout"):
        parallel_layout(5, 9, 4)


def test_held_out_acceptance_counts_the_chains_a_verify_pass_keeps(tiny_draft):
    """On a sequence that is the draft's own greedy text every one-token chain is right; the
    parallel chains are then counted against a brute-force run of each anchor's proposal."""
    module = ParallelDraft(tiny_draft, MASK, k=3)
    ids = tiny_draft.generate(torch.tensor([[5, 9, 17]]), max_new_tokens=20, do_sample=False,
                              pad_token_id=0)[0]
    got = parallel_acceptance(module, [{"tokens": ids, "start": torch.tensor(3)}], k=3)
    assert got["ar_alpha_1"] == got["ar_alpha_3"] == 1.0 and got["ar_acceptance_length"] == 4.0
    lengths = []
    with torch.no_grad():
        for a in range(2, len(ids) - 3):
            guess = _inference_logits(tiny_draft, module.mask_embedding, ids[:a + 1], 2).argmax(-1)[-3:]
            right = (guess == ids[a + 1:a + 4]).int().cumprod(0)
            lengths.append(1 + int(right.sum()))
    assert got["acceptance_length"] == pytest.approx(sum(lengths) / len(lengths))
    assert got["alpha_1"] == 1.0 and got["alpha_3"] <= got["alpha_2"]


def test_the_mask_token_is_a_row_no_token_uses():
    t = local_tokenizer()
    assert mask_token_id(t, len(t) + 4) == len(t)
    with pytest.raises(ValueError, match="spare row"):
        mask_token_id(t, len(t))

    class FromGGUF:  # a tokenizer that lists every row, the unused ones as llama.cpp's "[PAD<id>]"
        all_special_ids = [5, 7]

        def __len__(self):
            return 16

        def convert_ids_to_tokens(self, ids):
            return [f"[PAD{i}]" if i >= 12 else f"tok{i}" for i in ids]

    assert mask_token_id(FromGGUF(), 16) == 12


def test_train_pard_end_to_end_writes_a_draft_that_names_its_mask_token(tmp_path_factory, tmp_path, capsys):
    """`specdecode train pard` on the tiny pair: measured before and after each epoch per
    position, saved as a model directory whose config names the mask token and whose table
    holds the trained mask embedding; resumable; refused for a draft without a spare row."""
    import json

    from safetensors.torch import load_file

    import specdecode
    from specdecode.cli import main
    from tiny_dirs import VOCAB, tiny_dirs_in

    dirs = tiny_dirs_in(tmp_path_factory)
    out = tmp_path / "pard"
    args = ["train", "pard", "--target", str(dirs["target"]), "--draft", str(dirs["wide"]),
            "--out", str(out), "--data", "stdlib", "--max-prompts", "40", "--max-new-tokens", "12",
            "--epochs", "2", "--layers", "1", "--lr", "1e-3"]
    assert main(args) == 0
    printed = capsys.readouterr()
    assert "before: acceptance_length" in printed.err and "alpha_8" in printed.err
    assert "pard.json" in printed.out
    saved = json.loads((out / "pard.json").read_text())
    assert saved["mask_token"] == VOCAB and len(saved["history"]) == 2
    assert all(0.0 <= e[f"alpha_{j}"] <= 1.0 for e in saved["history"] for j in range(1, 9))
    assert json.loads((out / "config.json").read_text())["pard_token"] == VOCAB
    table = load_file(out / "model.safetensors")["model.embed_tokens.weight"]
    source = load_file(dirs["wide"] / "model.safetensors")["model.embed_tokens.weight"]
    assert table[VOCAB].abs().sum() > 0 and torch.equal(source[VOCAB], torch.zeros_like(source[VOCAB]))
    assert main(args) == 0 and "already trained" in capsys.readouterr().out
    # the adapted model is a draft like any other: speculation with it keeps the target's output
    target = specdecode.load(dirs["target"])
    plain = specdecode.generate(target, "def add(a, b):", method="ar", max_new_tokens=16)
    spec = specdecode.generate(target, "def add(a, b):", method="draft",
                               draft=specdecode.load(out, role="draft"), max_new_tokens=16)
    assert spec.token_ids == plain.token_ids
    assert main(args[:4] + ["--draft", str(dirs["draft"]), "--out", str(tmp_path / "f")] + args[8:]) == 2
    assert "spare row" in capsys.readouterr().err and not (tmp_path / "f" / "features").exists()


# --- the parallel draft at inference (DraftModelProposer with a mask token) ---------------

V, MASK_ID = 50, 49  # a counting target emits 0..48: the mask row is never a token


def _counting(tokens):
    """The target: the next token is the last one + 1 (mod 49), surely."""
    out = torch.zeros(V)
    out[(tokens[-1] + 1) % MASK_ID] = 5.0
    return out


def _parallel_counting(wrong_at: int | None = None):
    """A parallel draft of the counting target: after m masks it predicts the token m + 1
    ahead of the last real one; with ``wrong_at`` = j, the mask rows j and later are unsure
    (flat logits)."""
    def fn(tokens):
        m = 0
        while tokens[-1 - m] == MASK_ID:
            m += 1
        out = torch.zeros(V)
        if wrong_at is None or m < wrong_at:
            out[(tokens[-1 - m] + 1 + m) % MASK_ID] = 5.0
        return out
    return fn


@pytest.mark.parametrize("tree", [1, 2])
def test_a_parallel_draft_proposes_a_round_in_one_pass(tree):
    """Each round is one draft pass over the tokens the last round committed and K - 1
    masks; every token is kept (the draft is right), the output is plain decoding's, and
    the draft's cache never keeps a mask (checked after every round in debug mode: it holds
    a prefix of the committed tokens). Also as a draft tree (siblings from the same rows)."""
    from helpers import MockLM, TreeMockLM
    from specdecode.config import SamplingParams
    from specdecode.engine import Engine
    from specdecode.proposers import DraftModelProposer

    params = SamplingParams(max_new_tokens=41)
    draft = MockLM(V, _parallel_counting())
    proposer = DraftModelProposer(draft, mask_id=MASK_ID, tree_width=tree)
    assert proposer.parallel and not DraftModelProposer(draft).parallel
    gen = Engine(TreeMockLM(V, _counting), proposer, 4, debug=True).generate([3, 4, 5], params).run()
    assert gen.token_ids == [(6 + i) % MASK_ID for i in range(41)]
    # 5 tokens a round (a tree's siblings are verified too, never kept here)
    assert gen.stats.num_accepted_tokens == 32 and gen.stats.num_verify_passes == 9
    assert (gen.stats.num_draft_tokens == 32) == (tree == 1)
    # the prompt's first tokens, then one pass a round: 1 fed + 3 masks, then 5 fed + 3
    # masks (the last round has one token left to make: no draft)
    assert draft.forward_sizes == [2, 4] + [8] * 7
    assert MASK_ID not in draft.tokens


def test_a_parallel_draft_stops_where_it_is_unsure_and_reads_a_guess():
    """p_min applies per row (the proposal ends before the first unsure mask); a guess the
    draft backs is kept and the masks after it draft on; where the draft first differs from
    the guess, its own token there ends the proposal. One pass each; afterwards the cache
    holds the committed tokens and the guess tokens it backs, no mask."""
    from helpers import MockLM
    from specdecode.config import SamplingParams
    from specdecode.proposers import DraftModelProposer, RequestState

    def fresh(fn, p_min=None):
        drafter = DraftModelProposer(MockLM(V, fn), p_min=p_min, mask_id=MASK_ID)
        state = RequestState([3, 4, 5], 0, SamplingParams(), (), None, V)
        drafter.reset(state, 100)
        drafter.draft.forward_sizes.clear()
        return drafter, state

    drafter, state = fresh(_parallel_counting(wrong_at=2), p_min=0.5)
    assert drafter.propose(state, 6).token_ids[0].tolist() == [6, 7]  # masks 2.. unsure
    assert drafter.draft.forward_sizes == [6] and drafter.draft.tokens == [3, 4, 5]
    drafter, state = fresh(_parallel_counting())
    out = drafter.propose_with_guess(state, 6, [6, 7, 8])
    assert out.token_ids[0].tolist() == [6, 7, 8, 9, 10, 11]  # the guess, its next, 2 masks
    assert drafter.draft.forward_sizes == [1 + 3 + 2] and drafter.draft.tokens == [3, 4, 5, 6, 7, 8]
    drafter, state = fresh(_parallel_counting())
    out = drafter.propose_with_guess(state, 6, [6, 9, 10])
    assert out.token_ids[0].tolist() == [6, 7]  # backs 6, differs at 9: its own 7 ends it
    assert drafter.draft.tokens == [3, 4, 5, 6]
    with pytest.raises(ValueError, match="mask_id"):
        DraftModelProposer(MockLM(V, _counting), mask_id=V)


def test_the_hybrid_prices_a_parallel_draft_by_its_one_pass():
    """With a draft step at 0.6 of a target pass, a draft of one token a pass pays for one
    token at most; a parallel draft's proposal costs one pass over more rows, so the hybrid
    gives it a longer one (same draft, same acceptance prior)."""
    from helpers import MockLM
    from specdecode.config import SamplingParams
    from specdecode.proposers import DraftModelProposer, HybridProposer, PromptLookupProposer, RequestState

    lengths = {}
    for mask in (None, MASK_ID):
        member = HybridProposer.draft_for(MockLM(V, _parallel_counting()), mask_id=mask)
        hybrid = HybridProposer(PromptLookupProposer(), member, draft_cost=0.6,
                                draft_pass_cost=[1.0 + 0.05 * i for i in range(8)])
        state = RequestState([3, 4, 5, 6], 1, SamplingParams(), (), None, V)
        hybrid.reset(state, 100)
        lengths[mask] = hybrid.propose(state, 6).token_ids.shape[1]
    assert 1 <= lengths[None] < lengths[MASK_ID]
    with pytest.raises(ValueError, match="draft_pass_cost"):
        HybridProposer(PromptLookupProposer(), DraftModelProposer(MockLM(V, _counting)), draft_pass_cost=[0.0])


def test_a_parallel_draft_directory_drafts_in_one_pass_and_keeps_the_output(tmp_path_factory, tmp_path):
    """A model directory whose config names ``pard_token`` loads as a parallel draft; with
    it the draft method (chain and tree), the hybrid and a batch give plain decoding's
    tokens, greedy and seeded sampled; a pard_token that is not a row of the model is
    refused at load, naming it."""
    import json
    import shutil

    import specdecode
    from specdecode.batch import BatchEngine
    from tiny_dirs import VOCAB, tiny_dirs_in

    dirs = tiny_dirs_in(tmp_path_factory)
    target = specdecode.load(dirs["target"])
    draft = specdecode.load(dirs["pard"], role="draft")
    assert draft.pard_token == VOCAB and specdecode.load(dirs["wide"], role="draft").pard_token is None
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):"
    for params in ({}, {"temperature": 0.8, "seed": 3}):
        plain = specdecode.generate(target, prompt, method="ar", max_new_tokens=24, **params).token_ids
        for method in ("draft", "draft:tree=2", "hybrid"):
            out = specdecode.generate(target, prompt, method=method, draft=draft, max_new_tokens=24, **params)
            assert out.token_ids == plain, (method, params)
            assert out.stats.num_draft_tokens > 0 or method == "hybrid"
        batch = BatchEngine(target.lm, 2, 256)
        try:
            out = specdecode.generate(target, prompt, method="draft", draft=draft, max_new_tokens=24,
                                      batch=batch, **params)
            assert out.token_ids == plain and out.stats.num_draft_tokens > 0
        finally:
            batch.close()
    bad = tmp_path / "bad"
    shutil.copytree(dirs["pard"], bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "pard_token": config["vocab_size"]}))
    with pytest.raises(ValueError, match="pard_token"):
        specdecode.load(bad, role="draft")

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

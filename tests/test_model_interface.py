"""The extended interface of the native decoder (per-row cache lengths, batched rows, tree
masks, hidden states, layer subsets, cache compaction) equals transformers in fp32: max abs
logit diff <= 3e-5 against transformers and against the same rows run alone (hidden states:
3e-5 of their largest magnitude), for both the dense and the oneDNN-packed linears. (fp32
sums in another order differ by a few ulps: a tree pass of two padded rows differed from the
rows run alone by 1.1e-5 on a Sapphire Rapids CPU; a mask or position error moves logits by
0.1 or more. Bit-equality is the int8 kernels' property, tested in test_quant.py.)"""

import copy

import pytest
import torch
import transformers
from torch import nn

from specdecode.models.base import (BatchLM, BindableDraft, CausalLM, ForwardOutput, MeasuredDraft, RowsLM,
                                    SelfDrafting)
from specdecode.models.hf import HFCausalLM
from specdecode.models.native import FINAL, ModelArgs, Transformer

TOL = 3e-5
V = 96
ARGS = dict(vocab_size=V, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
            intermediate_size=48, qkv_bias=True, max_position_embeddings=256)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models are ~10x slower with 2 threads on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A random transformers Qwen2 (GQA, qkv bias) with the weights of a native model."""
    torch.manual_seed(0)
    native = Transformer(ModelArgs(**ARGS))
    with torch.no_grad():
        for name, p in native.named_parameters():
            p.normal_(1.0 if name.endswith("layernorm.weight") or name == "model.norm.weight"
                      else 0.0, 0.3)
    config = transformers.Qwen2Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.load_state_dict(native.state_dict(), strict=False)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in native.state_dict().items())
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path)
    model.path = path
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "packed"])
def lm(request, hf):
    return Transformer.from_pretrained(hf.path, pack=request.param)


def ids(*shape, seed=0):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


def ref(hf_model, seq, **kw):
    """transformers on one whole sequence (a list of ids): (logits [T,V], hidden states)."""
    with torch.no_grad():
        out = hf_model(torch.tensor([seq]), output_hidden_states=True, use_cache=False, **kw)
    return out.logits[0], [h[0] for h in out.hidden_states]


def diff(a, b):
    return (a - b).abs().max().item()


def hdiff(a, b):
    """diff relative to the size of a hidden state (the residual stream grows to ~10 here)."""
    return diff(a, b) / max(1.0, b.abs().max().item())


def test_forward_is_forward_rows_and_seq_len_is_kept(lm, hf):
    m = lm.fork()
    m.allocate(1, 64)
    x = ids(1, 20)
    full = m(x)
    assert diff(full[0], ref(hf, x[0].tolist())[0]) <= TOL
    assert m.seq_len == 20 and m.row_lengths == [20]
    m.rollback(12)
    out = m.forward_rows(x[:, 12:], num_logits=3)
    assert isinstance(out, ForwardOutput) and out.hidden == {}
    assert out.logits.shape == (1, 3, V) and diff(out.logits, full[:, 17:]) <= TOL
    m.rollback(12)
    assert torch.equal(m(x[:, 12:], num_logits=3), out.logits)  # one code path
    m.seq_len = 12  # a plain pointer write, as before
    assert m.row_lengths == [12] and diff(m(x[:, 12:]), full[:, 12:]) <= TOL


def test_ragged_rows_equal_rows_alone_and_transformers(lm, hf):
    """Three rows of different cached lengths, padded, in passes of different widths and
    positions (short passes: grouped matmuls; a 70-token pass: the fused kernel)."""
    prompts = [ids(5, seed=1).tolist(), ids(70, seed=2).tolist(), ids(2, seed=3).tolist()]
    steps = [[ids(3, seed=4).tolist(), ids(1, seed=5).tolist(), ids(4, seed=6).tolist()],
             [ids(2, seed=7).tolist(), ids(2, seed=8).tolist(), ids(2, seed=9).tolist()]]
    m = lm.fork()
    m.allocate(3, 96)

    def batch(rows):
        w = max(map(len, rows))
        x = torch.full((3, w), V - 1)
        for b, r in enumerate(rows):
            x[b, :len(r)] = torch.tensor(r)
        return x, [len(r) for r in rows]

    x, lens = batch(prompts)
    got = [m.forward_rows(x, lens).logits]
    assert m.row_lengths == [5, 70, 2]
    with pytest.raises(ValueError, match=r"seq_len is undefined: the rows hold \[5, 70, 2\]"):
        m.seq_len
    for step in steps:
        x, lens = batch(step)
        got.append(m.forward_rows(x, lens).logits)
    assert m.row_lengths == [10, 73, 8]
    x, lens = batch([[7], [8, 9, 10], [11, 12]])
    last2 = m.forward_rows(x, lens, num_logits=2).logits  # each row's own last two
    for b in range(3):
        seq = prompts[b] + steps[0][b] + steps[1][b]
        alone = lm.fork()
        alone.allocate(1, 96)
        mine = [alone(torch.tensor([prompts[b]]))[0]] + [alone(torch.tensor([s[b]]))[0]
                                                         for s in steps]
        expect, _ = ref(hf, seq)
        for g, a, part in zip(got, mine, [prompts[b], steps[0][b], steps[1][b]]):
            assert diff(g[b, :len(part)], a) <= TOL
        assert diff(torch.cat([g[b, :len(p)] for g, p in
                               zip(got, [prompts[b], steps[0][b], steps[1][b]])]), expect) <= TOL
        if lens[b] >= 2:
            expect, _ = ref(hf, seq + x[b, :lens[b]].tolist())
            assert diff(last2[b], expect[-2:]) <= TOL
    # per-row rollback, then one full-width pass from three different starts
    m.rollback_rows([4, 71, 9])
    assert m.row_lengths == [4, 71, 9]
    x = ids(3, 2, seed=10)
    out = m.forward_rows(x, num_logits=1).logits
    for b, keep in enumerate([4, 71, 9]):
        seq = (prompts[b] + steps[0][b] + steps[1][b] + [[7], [8, 9, 10], [11, 12]][b])[:keep]
        assert diff(out[b, 0], ref(hf, seq + x[b].tolist())[0][-1]) <= TOL
    m.rollback(3)
    assert m.row_lengths == [3, 3, 3] and m.seq_len == 3


def tree_mask(parents):
    """Ancestor-or-self mask [T, T] and depths of a tree given by parent offsets (-1: root)."""
    t = len(parents)
    mask, depth = torch.eye(t, dtype=torch.bool), []
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        if p >= 0:
            mask[i] |= mask[p]
    return mask, torch.tensor(depth)


def path(parents, i):
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


# root, two children, a grandchild under the first child
PARENTS = [-1, 0, 0, 1]


def test_tree_pass_equals_each_path(lm, hf):
    """Two rows of different cached lengths verify a tree each in one pass: every node's
    logits are those of the prompt plus its root-to-node path run plainly."""
    prompts = [ids(6, seed=11).tolist(), ids(3, seed=12).tolist()]
    nodes = ids(2, 4, seed=13)
    mask, depth = tree_mask(PARENTS)
    m = lm.fork()
    m.allocate(2, 32)
    x = torch.tensor([prompts[0], prompts[1] + [0, 0, 0]])
    m.forward_rows(x, [6, 3], num_logits=0)
    pos = torch.tensor([[6], [3]]) + depth
    out = m.forward_rows(nodes, attn_mask=mask, position_ids=pos)
    assert m.row_lengths == [10, 7]
    plain = lm.fork()
    plain.allocate(1, 32)
    for b in range(2):
        for i in range(4):
            seq = prompts[b] + nodes[b, path(PARENTS, i)].tolist()
            plain.rollback(0)
            assert diff(out.logits[b, i], plain(torch.tensor([seq]))[0, -1]) <= TOL
            assert diff(out.logits[b, i], ref(hf, seq)[0][-1]) <= TOL
    # a [B,T,T] mask, positions [T], and a 70-node random forest (the fused-kernel path)
    g = torch.Generator().manual_seed(14)
    parents = [int(torch.randint(-1, i, (), generator=g)) for i in range(70)]  # -1 or earlier
    big, d = tree_mask(parents)
    m.allocate(1, 96)
    m(torch.tensor([prompts[0]]), num_logits=0)
    x = ids(1, 70, seed=14)
    out = m.forward_rows(x, attn_mask=big[None], position_ids=6 + d).logits
    for i in (0, 1, 37, 69):
        seq = prompts[0] + x[0, path(parents, i)].tolist()
        assert diff(out[0, i], ref(hf, seq)[0][-1]) <= TOL


def test_compact_keeps_the_accepted_path(lm, hf):
    prompts = [ids(6, seed=15).tolist(), ids(4, seed=16).tolist()]
    nodes, nxt = ids(2, 4, seed=17), ids(2, 1, seed=18)
    mask, depth = tree_mask(PARENTS)
    m = lm.fork()
    m.allocate(2, 32)
    m.forward_rows(torch.tensor([prompts[0], prompts[1] + [0, 0]]), [6, 4], num_logits=0)
    m.forward_rows(nodes, attn_mask=mask, position_ids=torch.tensor([[6], [4]]) + depth)
    accepted = [[0, 1, 3], [0, 2]]  # row 0: root, child 1, grandchild; row 1: root, child 2
    m.compact(0, 6, accepted[0])
    m.compact(1, 4, accepted[1])
    assert m.row_lengths == [9, 6]
    out = m.forward_rows(nxt, num_logits=1).logits
    for b in range(2):
        seq = prompts[b] + nodes[b, accepted[b]].tolist() + nxt[b].tolist()
        plain = lm.fork()
        plain.allocate(1, 32)
        assert diff(out[b, 0], plain(torch.tensor([seq]))[0, -1]) <= TOL
        assert diff(out[b, 0], ref(hf, seq)[0][-1]) <= TOL
    m.compact(0, 9, [0])  # in place: the length only
    m.compact(1, 2, [])  # same as rolling back to 2
    assert m.row_lengths == [10, 2]


def test_hidden_states_match_transformers(lm, hf):
    """Key i: the residual after layer i (transformers' hidden_states[i+1]; the last layer's
    is un-normed there, so normed here to compare); key FINAL: the final norm's output."""
    seq = ids(1, 12, seed=19)
    logits, hs = ref(hf, seq[0].tolist())
    m = lm.fork()
    m.allocate(1, 32)
    m(seq[:, :8], num_logits=0)
    out = m.forward_rows(seq[:, 8:], output_hidden=(0, 1, 2, FINAL))
    assert set(out.hidden) == {0, 1, 2, FINAL}
    for i in (0, 1):
        assert hdiff(out.hidden[i][0], hs[i + 1][8:]) <= TOL
    assert hdiff(hf.model.norm(out.hidden[2])[0], hs[3][8:]) <= TOL
    assert hdiff(out.hidden[FINAL][0], hs[-1][8:]) <= TOL
    assert diff(out.logits[0], logits[8:]) <= TOL
    # ragged rows: the valid positions of each row
    m.allocate(2, 32)
    x = torch.stack([seq[0], torch.cat([seq[0, :7], torch.zeros(5, dtype=torch.long)])])
    out = m.forward_rows(x, [12, 7], output_hidden=(1, FINAL))
    assert out.hidden[1].shape == (2, 12, 32)
    _, hs7 = ref(hf, seq[0, :7].tolist())
    assert hdiff(out.hidden[1][0], hs[2]) <= TOL and hdiff(out.hidden[1][1, :7], hs7[2]) <= TOL
    assert hdiff(out.hidden[FINAL][1, :7], hs7[-1]) <= TOL


def test_layer_subset_equals_transformers_with_those_layers(lm, hf):
    """layers=[0, 2] equals transformers with layer 1 removed; a full pass over positions a
    subset pass wrote is refused until they are rolled back (the self-speculation cycle)."""
    sub = copy.deepcopy(hf)
    sub.model.layers = nn.ModuleList([sub.model.layers[0], sub.model.layers[2]])
    sub.config.num_hidden_layers = 2
    sub.config.layer_types = sub.config.layer_types[:2]
    seq = ids(1, 14, seed=20)
    m = lm.fork()
    m.allocate(1, 32)
    got = [m.forward_rows(seq[:, :9], layers=[0, 2], output_hidden=(2, FINAL))]
    got += [m.forward_rows(seq[:, t:t + 1], layers=[0, 2]) for t in range(9, 11)]
    expect, hs = ref(sub, seq[0, :11].tolist())
    assert diff(torch.cat([o.logits for o in got], 1)[0], expect) <= TOL
    assert hdiff(got[0].hidden[FINAL][0], hs[-1][:9]) <= TOL
    with pytest.raises(ValueError, match=r"layer 1 holds 0 positions of row 0, which holds 11"):
        m(seq[:, 11:12])
    assert m.seq_len == 11
    m.rollback(0)  # the subset's positions are gone: the full model can run again
    full = m(seq[:, :9])
    assert diff(full[0], ref(hf, seq[0, :9].tolist())[0]) <= TOL
    # draft 3 tokens with the subset, roll back, verify them with every layer
    for t in range(9, 12):
        m.forward_rows(seq[:, t:t + 1], layers=[0, 2])
    with pytest.raises(ValueError, match="roll the row back to 9 before running layer 1"):
        m.forward_rows(seq[:, 12:13], layers=[1])
    m.forward_rows(seq[:, 12:13], layers=[0, 2])  # the subset itself may go on
    m.rollback(9)
    assert diff(m(seq[:, 9:])[0], ref(hf, seq[0].tolist())[0][9:]) <= TOL


def test_sublayer_skips_equal_the_residual_stream_without_them(lm, hf):
    """skip_attn=[1], skip_mlp=[2] equals transformers with layer 1's attention output and
    layer 2's MLP output zeroed (their o_proj, down_proj weights: the residual stream passes
    through unchanged), and differs from the full model; a skipped attention writes no cache
    (a full pass over its positions is refused until rolled back), a skipped MLP alone
    writes its layer's keys and values as the full pass does."""
    cut = copy.deepcopy(hf)
    with torch.no_grad():
        cut.model.layers[1].self_attn.o_proj.weight.zero_()
        cut.model.layers[2].mlp.down_proj.weight.zero_()
    seq = ids(1, 12, seed=22)
    m = lm.fork()
    m.allocate(1, 32)
    got = [m.forward_rows(seq[:, :8], skip_attn=[1], skip_mlp=[2], output_hidden=(1, FINAL))]
    got += [m.forward_rows(seq[:, t:t + 1], skip_attn=[1], skip_mlp=[2]) for t in range(8, 10)]
    expect, hs = ref(cut, seq[0, :10].tolist())
    logits = torch.cat([o.logits for o in got], 1)[0]
    assert diff(logits, expect) <= TOL
    assert hdiff(got[0].hidden[1][0], hs[2][:8]) <= TOL and hdiff(got[0].hidden[FINAL][0], hs[-1][:8]) <= TOL
    assert diff(logits, ref(hf, seq[0, :10].tolist())[0]) > 0.1  # the skips are not ignored
    assert m._layer_lengths == [[10], [0], [10]]
    with pytest.raises(ValueError, match="layer 1 holds 0 positions of row 0, which holds 10"):
        m(seq[:, 10:11])
    m.forward_rows(seq[:, 10:11], skip_attn=[1])  # a draft with it skipped may go on
    m.rollback(0)
    assert diff(m(seq[:, :12])[0], ref(hf, seq[0].tolist())[0]) <= TOL
    # the MLP of the last layer alone skipped: every layer's keys and values are the full pass's
    mlp_only = lm.fork()
    mlp_only.allocate(1, 32)
    mlp_only.forward_rows(seq[:, :9], skip_mlp=[2])
    assert mlp_only._layer_lengths is None and mlp_only.seq_len == 9
    for c, c0 in zip(mlp_only.caches, m.caches):
        assert diff(c.k[:, :, :9], c0.k[:, :, :9]) <= TOL and diff(c.v[:, :, :9], c0.v[:, :, :9]) <= TOL


def test_chunked_forward_rows_keeps_hidden_states(lm):
    m = lm.fork()
    m.allocate(1, 64)
    x = ids(1, 40, seed=21)
    one = m.forward_rows(x, num_logits=5, output_hidden=(1, FINAL))
    m.PREFILL_CHUNK = 16  # on the fork only
    m.rollback(0)
    chunked = m.forward_rows(x, num_logits=5, output_hidden=(1, FINAL))
    assert diff(one.logits, chunked.logits) <= TOL
    assert all(hdiff(one.hidden[k], chunked.hidden[k]) <= TOL for k in (1, FINAL))


def test_bad_input_raises_value_errors(lm):
    m = lm.fork()
    m.allocate(2, 16)
    m.forward_rows(ids(2, 4), [4, 2])
    x = ids(2, 3)
    mask, depth = tree_mask([-1, 0, 0])
    pos = 4 + depth
    cases = [
        (lambda: m.forward_rows(ids(6)), r"input_ids must be \[B, T\]"),
        (lambda: m.forward_rows(ids(1, 3)), "input_ids has 1 rows, the KV cache 2"),
        (lambda: m.forward_rows(x + m.vocab_size), r"token ids must be in 0..\d+ \(the model's vocabulary"),
        (lambda: m.forward_rows(x - 200), "input_ids hold -"),
        (lambda: m.forward_rows(x.float()), "must be integer token ids"),
        (lambda: m.forward_rows(x, [3]), "got 1 lengths for 2 rows"),
        (lambda: m.forward_rows(x, [3, 4]), r"lengths\[1\]=4 is out of range \(allowed: 0..3"),
        (lambda: m.forward_rows(x, num_logits=4), r"num_logits=4 is out of range \(allowed: 0..3"),
        (lambda: m.forward_rows(ids(2, 13)), "overflow: 4\\+13 positions > allocated 16 in row 0"),
        (lambda: m.forward_rows(x, attn_mask=mask[:2, :2], position_ids=pos),
         r"attn_mask must be bool \[3, 3\] or \[2, 3, 3\]"),
        (lambda: m.forward_rows(x, attn_mask=mask.float(), position_ids=pos), "torch.float32"),
        (lambda: m.forward_rows(x, attn_mask=mask & False, position_ids=pos), "diagonal"),
        (lambda: m.forward_rows(x, attn_mask=mask), "needs explicit position_ids"),
        (lambda: m.forward_rows(x, position_ids=pos[:2]), r"position_ids must be integer \[3\]"),
        (lambda: m.forward_rows(x, position_ids=pos.float()), "position_ids must be integer"),
        (lambda: m.forward_rows(x, position_ids=pos + 20), r"span 24..25: allowed 0..15"),
        (lambda: m.forward_rows(x, layers=[0, 3]), r"layers=\[0, 3\]: each must be .* 0..2"),
        (lambda: m.forward_rows(x, layers=[2, 0]), "sorted and unique"),
        (lambda: m.forward_rows(x, layers=[0, 0]), "sorted and unique"),
        (lambda: m.forward_rows(x, output_hidden=(3,)), "output_hidden key 3 is not allowed"),
        (lambda: m.forward_rows(x, layers=[0, 2], output_hidden=(1,)),
         r"layer that runs \(\[0, 2\]"),
        (lambda: m.forward_rows(x, skip_attn=[3]), r"skip_attn=\[3\]: allowed: distinct layers that run \(0..2"),
        (lambda: m.forward_rows(x, layers=[0, 2], skip_mlp=[1]), r"skip_mlp=\[1\]: .*\(\[0, 2\]\)"),
        (lambda: m.forward_rows(x, skip_attn=[0, 0]), r"skip_attn=\[0, 0\]: allowed: distinct"),
        (lambda: m.forward_rows(x, skip_mlp=[True]), r"skip_mlp=\[True\]"),
        (lambda: m.rollback_rows([1]), "got 1 lengths for 2 cache rows"),
        (lambda: m.rollback_rows([1, 3]), r"cannot roll back row 1 to 3: it holds 2 .*0..2"),
        (lambda: m.rollback(3), "cannot roll back to 3: cache holds 2 positions in its shortest"),
        (lambda: m.compact(2, 0, [0]), r"row 2 is not a cache row \(allowed: 0..1\)"),
        (lambda: m.compact(0, 5, [0]), r"start 5 is out of range for row 0 \(allowed: 0..4"),
        (lambda: m.compact(0, 1, [0, 3]),
         r"keep=\[0, 3\] must be strictly increasing offsets in 0..2"),
        (lambda: m.compact(0, 1, [1, 0]), "strictly increasing"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    assert m.row_lengths == [4, 2]  # nothing ran


def test_the_native_decoder_declares_every_capability_and_the_adapter_none(lm, hf):
    """What the engine asks by isinstance (models/base.py's protocols): the native decoder and
    its self-draft have it, the transformers adapter has only CausalLM's four methods."""
    assert all(isinstance(lm, p) for p in (CausalLM, RowsLM, BatchLM, SelfDrafting))
    draft = lm.self_draft([0])
    assert isinstance(draft, MeasuredDraft) and isinstance(draft, BindableDraft)
    adapter = HFCausalLM(hf)
    assert isinstance(adapter, CausalLM)
    assert not any(isinstance(adapter, p) for p in (RowsLM, BatchLM, SelfDrafting, MeasuredDraft, BindableDraft))

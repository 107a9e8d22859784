"""The decoder layer stack in one C call (models/fused.py) gives the modules' bits."""

from __future__ import annotations

import pytest
import torch

from specdecode.models import fused, quant
from specdecode.models.native import FINAL, RMSNorm

from helpers import KERNEL_SHAPES, tiny_model


KINDS = ("avx2-nk", "avx2-q4k", "avx2-mixed", "vnni", "q4k", "mixed")


@pytest.fixture(params=KINDS)
def kind(request, monkeypatch):
    """The kernel and weights under test: on the AVX2 library as the kernel in use (also on
    CPUs where the VNNI one would be) "avx2-nk" (int8 "nk" linears), "avx2-q4k" (Q4_K
    linears, dtype int4) or "avx2-mixed" (both in one layer, as a q4 target's Q6_K tensors
    are int8), or the same on the AVX512-VNNI kernel: "vnni" (int8 linears in that layout),
    "q4k" or "mixed". The kind, or None where this CPU lacks its kernel (then the tests
    check that the modules run)."""
    if request.param.startswith("avx2-"):
        lib = quant.avx2_library()
        monkeypatch.setattr(quant, "vnni_kernel", lambda: (None, "a test of the AVX2 kernel"))
        monkeypatch.setattr(quant, "avx2_kernel", lambda: lib)
        return request.param if lib is not None else None
    return request.param if quant.vnni_kernel()[0] is not None else None


def _model(kind, **kw):
    if kind in (None, "avx2-nk"):
        m = tiny_model(seed=3, int8="nk", n_layers=3, **kw)
    elif kind == "vnni":
        m = tiny_model(seed=3, int8="vnni", n_layers=3, **KERNEL_SHAPES, **kw)
    else:
        layout = "nk" if kind.startswith("avx2-") else "vnni"
        m = tiny_model(seed=3, int8=layout, int4=True, n_layers=3, **KERNEL_SHAPES, **kw)
        if kind.endswith("mixed"):
            for layer in m.model.layers[:2]:
                for holder, name in ((layer.self_attn, "v_proj"), (layer.mlp, "down_proj")):
                    lin = getattr(holder, name)
                    setattr(holder, name, quant.Int8Linear.from_float(
                        lin.weight(), getattr(lin, "bias", None), layout))
    m.allocate(3, 64)
    return m


def _pair(kind, **kw):
    """The same weights twice: one runs the fused stack, one the modules."""
    a, b = _model(kind, **kw), _model(kind, **kw)
    b.__dict__["_no_fuse"] = True
    return a, b


def _run(m, *args, **kw):
    if m.__dict__.get("_no_fuse"):
        real = fused.stack
        fused.stack = lambda model: None
        try:
            return m.forward_rows(*args, **kw)
        finally:
            fused.stack = real
    assert fused.stack(m) is not None
    return m.forward_rows(*args, **kw)


def _same_caches(a, b, lengths):
    for ca, cb in zip(a.caches, b.caches):
        for row, n in enumerate(lengths):
            assert torch.equal(ca.k[row, :, :n], cb.k[row, :, :n])
            assert torch.equal(ca.v[row, :, :n], cb.v[row, :, :n])


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_fused_stack_gives_the_modules_bits(kind, qkv_bias):
    """Prefill, one-token steps and verify passes, rows of their own lengths and starts, and
    explicit positions: the same logits, final hidden state and cache, bit for bit."""
    if kind is None:  # no kernel of this kind here: an int8 model fuses on the AVX2 one or not at all
        assert (fused.stack(_model(kind)) is None) == (quant.avx2_kernel() is None)
        return
    a, b = _pair(kind, qkv_bias=qkv_bias)
    g = torch.Generator().manual_seed(0)
    ids = lambda t: torch.randint(0, 96, (3, t), generator=g)  # noqa: E731
    steps = [(ids(9), None), (ids(1), None), (ids(5), None), (ids(4), [4, 1, 0]),
             (ids(1), [1, 1, 1]), (ids(6), [2, 6, 3])]
    for x, lengths in steps:
        oa = _run(a, x, lengths, output_hidden=(FINAL,))
        ob = _run(b, x, lengths, output_hidden=(FINAL,))
        assert torch.equal(oa.logits, ob.logits) and torch.equal(oa.hidden[FINAL], ob.hidden[FINAL])
        assert a.row_lengths == b.row_lengths
        _same_caches(a, b, a.row_lengths)
    pos = torch.tensor([[40, 41, 42]] * 3)
    x = ids(3)
    oa, ob = _run(a, x, position_ids=pos), _run(b, x, position_ids=pos)
    assert torch.equal(oa.logits, ob.logits)
    _same_caches(a, b, a.row_lengths)


def test_fused_verify_rows_equal_one_token_passes(kind):
    """The property speculative decoding rests on, on the fused stack: each row of a 6-token
    pass equals the one-token pass at its position."""
    if kind is None:
        return
    m = _model(kind)
    m.allocate(1, 64)
    prompt = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    new = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    _run(m, prompt, num_logits=0)
    together = _run(m, new).logits
    m.rollback(7)
    alone = torch.cat([_run(m, new[:, i:i + 1]).logits for i in range(6)], 1)
    assert torch.equal(together, alone)


def test_fused_layer_subsets_and_hidden_states(kind):
    """A pass over a subset of layers, and a pass that asks for layers' hidden states, run
    fused with the modules' bits (the hidden states included)."""
    if kind is None:
        return
    a, b = _pair(kind)
    x = torch.randint(0, 96, (3, 4), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_run(a, x, layers=[0, 2]).logits, _run(b, x, layers=[0, 2]).logits)
    a.rollback(0), b.rollback(0)
    called = []
    real = fused.run
    fused.run = lambda *args: called.append(1) or real(*args)
    try:
        oa = a.forward_rows(x, output_hidden=(0, 2, FINAL))
    finally:
        fused.run = real
    ob = _run(b, x, output_hidden=(0, 2, FINAL))
    assert called and torch.equal(oa.logits, ob.logits)
    assert sorted(oa.hidden) == sorted(ob.hidden) == [FINAL, 0, 2]
    for key in ob.hidden:
        assert torch.equal(oa.hidden[key], ob.hidden[key])
    assert not torch.equal(oa.hidden[0], oa.hidden[2])


def test_fused_sublayer_skips_give_the_modules_bits(kind):
    """A draft pass with attention and MLP sublayers skipped (the kernel's layer-list flags,
    fused.SKIP_ATTN / SKIP_MLP) runs fused with the modules' bits: logits, hidden states,
    the cache, and which layers hold the new positions (a skipped attention writes none);
    rows of their own lengths included. And the flags are not ignored: each changes the
    logits."""
    if kind is None:
        return
    a, b = _pair(kind)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 96, (3, 6), generator=g)
    for m in (a, b):
        _run(m, x, [6, 4, 5])
    step = torch.randint(0, 96, (3, 3), generator=g)
    called = []
    real = fused.run
    fused.run = lambda *args: called.append(args) or real(*args)
    try:
        oa = a.forward_rows(step, [3, 2, 3], skip_attn=[1], skip_mlp=[0, 2], output_hidden=(0, 1, FINAL))
    finally:
        fused.run = real
    ob = _run(b, step, [3, 2, 3], skip_attn=[1], skip_mlp=[0, 2], output_hidden=(0, 1, FINAL))
    assert called and called[0][-2:] == (frozenset({1}), frozenset({0, 2}))  # through the stack
    assert torch.equal(oa.logits, ob.logits)
    for key in ob.hidden:
        assert torch.equal(oa.hidden[key], ob.hidden[key])
    _same_caches(a, b, [9, 6, 8])
    # layer 1's attention did not run: it holds none of the new positions, the others all
    assert a._layer_lengths == b._layer_lengths == [[9, 6, 8], [6, 4, 5], [9, 6, 8]]
    # each flag changes the pass (fused), and the modules agree on each
    a.rollback_rows([6, 4, 5]), b.rollback_rows([6, 4, 5])
    full = _run(a, step, [3, 2, 3]).logits
    for skips in (dict(skip_attn=[1]), dict(skip_mlp=[2]), dict(skip_attn=[0], skip_mlp=[0])):
        a.rollback_rows([6, 4, 5]), b.rollback_rows([6, 4, 5])
        got = _run(a, step, [3, 2, 3], **skips).logits
        assert torch.equal(got, _run(b, step, [3, 2, 3], **skips).logits)
        assert not torch.equal(got[0], full[0])
    # both sublayers of a layer skipped = the layer skipped
    a.rollback_rows([6, 4, 5])
    assert torch.equal(got, _run(a, step, [3, 2, 3], layers=[1, 2]).logits)


def test_fused_tree_passes_give_the_modules_bits(kind):
    """Draft-tree passes (a mask and depth positions per row, rows of their own lengths) run
    fused with the modules' bits: logits, hidden states and the cache of every node."""
    if kind is None or not _model(kind).exact_trees:
        return
    a, b = _pair(kind)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 96, (3, 6), generator=g)
    for m in (a, b):
        _run(m, prompt, [6, 4, 5], num_logits=0)
    # node 0 the root, 1 and 2 its children, 3 a child of 1
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    depth = torch.tensor([0, 1, 1, 2])
    pos = torch.tensor(a.row_lengths)[:, None] + depth
    x = torch.randint(0, 96, (3, 4), generator=g)
    oa = _run(a, x, [4, 4, 3], attn_mask=tree, position_ids=pos, output_hidden=(1,))
    ob = _run(b, x, [4, 4, 3], attn_mask=tree, position_ids=pos, output_hidden=(1,))
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    assert torch.equal(oa.logits[valid], ob.logits[valid])
    assert torch.equal(oa.hidden[1][valid], ob.hidden[1][valid])
    _same_caches(a, b, a.row_lengths)


def test_fused_stack_follows_new_weights(kind):
    """Weights assigned after a pass (a buffer replaced, a module swapped) are what the next
    pass uses: the stack is rebuilt, never run on stale pointers."""
    if kind is None:
        return
    m = _model(kind)
    first = fused.stack(m)
    assert fused.stack(m) is first
    lin = m.model.layers[1].mlp.down_proj
    lin.qweight = lin.qweight.clone()
    second = fused.stack(m)
    assert second is not first and second.current(m.model.layers)
    m._apply(lambda t: t.clone())  # every tensor replaced, no assignment hook
    third = fused.stack(m)
    assert third is not second and third.current(m.model.layers)
    m.model.layers[2].post_attention_layernorm.weight = torch.nn.Parameter(torch.ones(m.args.dim))
    assert fused.stack(m) is not third
    dim = m.args.dim
    m.model.layers[0].self_attn.q_proj = quant.Int8Linear.from_float(torch.randn(dim, dim), None, "kn")
    assert fused.stack(m) is None  # a layout the kernel does not run: the modules
    float_model = tiny_model(**KERNEL_SHAPES)
    float_model.allocate(1, 8)
    assert fused.stack(float_model) is None  # nn.Linear: the modules


def test_fused_prefill_is_cut_into_stack_passes_with_the_bits_of_any_cut(kind, monkeypatch):
    """A prefill longer than a verify pass runs as passes of at most 64 tokens through the
    stack; the cache and logits it leaves equal those of the same prompt fed in other cuts
    (one token at a time included): the decode kernel's attention, row by row. (On a CPU
    with AMX-BF16 long passes take the tile unit's bf16 prefill instead, uncut: kept off
    here, so that the cut is tested on every CPU.)"""
    if kind is None:
        return
    monkeypatch.setattr(quant, "bf16_prefill", lambda: False)
    m = _model(kind)
    m.allocate(1, 256)
    prompt = torch.randint(0, 96, (1, 150), generator=torch.Generator().manual_seed(6))
    sizes = []
    real = fused.run
    fused.run = lambda model, st, x, *args: sizes.append(x.shape[1]) or real(model, st, x, *args)
    try:
        whole = m.forward_rows(prompt).logits
    finally:
        fused.run = real
    assert sizes == [64, 64, 22]
    cache = [(c.k[:, :, :150].clone(), c.v[:, :, :150].clone()) for c in m.caches]
    for cuts in ([70, 80], [1] * 150):
        m.rollback(0)
        logits = torch.cat([m.forward_rows(p).logits for p in prompt.split(cuts, 1)], 1)
        assert torch.equal(logits, whole)
        for (k, v), c in zip(cache, m.caches):
            assert torch.equal(k, c.k[:, :, :150]) and torch.equal(v, c.v[:, :, :150])


def test_rmsnorm_kernel_rows_are_independent_and_autograd_takes_torch(kind):
    """The modules' RMSNorm on the kernel (``sd_rmsnorm``): each row's bits its own, within
    an fp32 rounding of the formula; with autograd on a tensor that needs gradients it runs
    PyTorch's operators, so that gradients flow."""
    if kind is None:
        return
    norm = RMSNorm(40, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        together = norm(x)
        alone = torch.cat([norm(x[i:i + 1]) for i in range(5)])
    assert torch.equal(together, alone)
    ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.allclose(together, ref, rtol=1e-5, atol=1e-6)
    x.requires_grad_(True)
    out = norm(x)
    out.sum().backward()
    assert out.grad_fn is not None and x.grad is not None and norm.weight.grad is not None

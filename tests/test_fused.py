"""The decoder layer stack in one C call (models/fused.py) gives the modules' bits."""

from __future__ import annotations

import pytest
import torch

from specdecode.models import fused, quant
from specdecode.models.native import FINAL

from helpers import tiny_model


@pytest.fixture
def avx2(monkeypatch):
    """The AVX2 library as the kernel in use, also on CPUs where the VNNI one would be (the
    fused stack exists only for it); None on CPUs without AVX2."""
    lib = quant.avx2_library()
    monkeypatch.setattr(quant, "avx2_kernel", lambda: lib)
    return lib


def _model(**kw):
    m = tiny_model(seed=3, int8="nk", n_layers=3, **kw)
    m.allocate(3, 64)
    return m


def _pair(**kw):
    """The same weights twice: one runs the fused stack, one the modules."""
    a, b = _model(**kw), _model(**kw)
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
def test_fused_stack_gives_the_modules_bits(avx2, qkv_bias):
    """Prefill, one-token steps and verify passes, rows of their own lengths and starts, and
    explicit positions: the same logits, final hidden state and cache, bit for bit."""
    if avx2 is None:
        assert fused.stack(_model()) is None  # no kernel: the modules run
        return
    a, b = _pair(qkv_bias=qkv_bias)
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


def test_fused_verify_rows_equal_one_token_passes(avx2):
    """The property speculative decoding rests on, on the fused stack: each row of a 6-token
    pass equals the one-token pass at its position."""
    if avx2 is None:
        return
    m = _model()
    m.allocate(1, 64)
    prompt = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    new = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    _run(m, prompt, num_logits=0)
    together = _run(m, new).logits
    m.rollback(7)
    alone = torch.cat([_run(m, new[:, i:i + 1]).logits for i in range(6)], 1)
    assert torch.equal(together, alone)


def test_fused_layer_subsets_and_hidden_requests(avx2):
    """A pass over a subset of layers runs them fused with the modules' bits; a pass that
    asks for a layer's hidden state runs the modules."""
    if avx2 is None:
        return
    a, b = _pair()
    x = torch.randint(0, 96, (3, 4), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_run(a, x, layers=[0, 2]).logits, _run(b, x, layers=[0, 2]).logits)
    a.rollback(0), b.rollback(0)
    called = []
    real = fused.run
    fused.run = lambda *args: called.append(1) or real(*args)
    try:
        out = a.forward_rows(x, output_hidden=(1,))
    finally:
        fused.run = real
    assert not called and torch.equal(out.logits, _run(b, x, output_hidden=(1,)).logits)


def test_fused_stack_follows_new_weights(avx2):
    """Weights assigned after a pass (a buffer replaced, a module swapped) are what the next
    pass uses: the stack is rebuilt, never run on stale pointers."""
    if avx2 is None:
        return
    m = _model()
    first = fused.stack(m)
    assert fused.stack(m) is first
    lin = m.model.layers[1].mlp.down_proj
    lin.qweight = lin.qweight.clone()
    second = fused.stack(m)
    assert second is not first and second.current(m.model.layers)
    m.model.layers[0].self_attn.q_proj = quant.Int8Linear.from_float(torch.randn(32, 32), None, "kn")
    assert fused.stack(m) is None  # a layout the kernel does not run: the modules

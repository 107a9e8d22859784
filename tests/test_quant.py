"""The int8 (W8A8) runtime: per-row quantization, rows that do not depend on each other bit
for bit (linears, attention, the whole forward), both weight layouts giving the same bits,
speculative output equal to the int8 target's plain decoding, and the on-disk cache."""

import os
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import specdecode
from specdecode.config import SamplingParams
from specdecode.models import attention, load, native, quant
from specdecode.models.attention import Prefixes, attend_prefixes, attend_rows, attention_kernel
from specdecode.models.kv_cache import KVCache
from specdecode.models.native import ModelArgs, Transformer
from specdecode.proposers import DraftModelProposer, PromptLookupProposer

from helpers import KERNEL_SHAPES, PROMPTS, run, tiny_model
from tiny_dirs import hf_model_dir, q4k_target_dir, random_q4k_blocks, write_tiny_gguf


def test_quantize_rows_bounds_the_error_and_handles_zero_rows():
    w = torch.randn(64, 300) * torch.logspace(-3, 2, 64)[:, None]
    w[5] = 0
    q, s = quant.quantize_rows(w)
    assert q.dtype == torch.int8 and s.shape == (64,) and q.abs().max() <= quant.QMAX
    assert torch.all((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 * (1 + 1e-6))
    assert s[5] == 1 and not q[5].any()
    assert torch.equal(q.abs().amax(1)[torch.arange(64) != 5], torch.full((63,), 127, dtype=torch.int8))


def test_the_vnni_kernel_is_built_on_a_cpu_that_has_vnni():
    """This project's machines have AVX512-VNNI and g++: the fast kernel must be in use
    there (elsewhere the reason it is not is reported)."""
    lib, why = quant.vnni_kernel()
    flags = open("/proc/cpuinfo").read()
    if "avx512_vnni" in flags and shutil.which("g++"):
        assert lib is not None, why
        assert quant.best_layout("target") == quant.best_layout("draft") == "vnni"
    else:
        assert lib is None and why


Q4K = quant.q4k_kernel()[0] is not None


def q4k_refused(run) -> bool:
    """Q4_K and int4 weights run on the AVX512-VNNI or the AVX2 kernel: where neither is in
    use, ``run()`` must fail with an error that names them (then True: that is what this CPU
    does); where one is, False (the test goes on)."""
    if Q4K:
        return False
    with pytest.raises((RuntimeError, ValueError), match="VNNI"):
        run()
    return True


def _int4_forward(model) -> torch.Tensor:
    model.allocate(1, 4)
    return model.forward(torch.tensor([[1, 2]]))


def _cpu_flags() -> list[str]:
    return next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo")
                 if ln.startswith("flags")), [])


def test_amx_is_used_exactly_where_the_cpu_has_it():
    """On a CPU with AMX-INT8 (and the kernel built) passes of 2+ rows run on the tile unit
    unless turned off; elsewhere set_amx(True) reports that it is not in use."""
    has = quant.vnni_kernel()[0] is not None and "amx_int8" in _cpu_flags()
    try:
        assert quant.set_amx(True) is has and quant.amx_in_use() is has
        assert quant.set_amx(False) is False and quant.amx_in_use() is False
    finally:
        quant.set_amx(True)


@pytest.mark.parametrize("k, n", [(1536, 48), (128, 4864), (8960, 32)])
def test_amx_and_vnni_give_the_same_bits(k, n):
    """The tile unit's passes (2+ rows, K a multiple of 64) against the AVX512 ones: the same
    int32 sums and float steps, so the same bits, for every row count around its 16-row
    tiles and for an odd number of 16-channel blocks. (Where the CPU has no AMX both runs
    take the AVX512 path and the test checks row independence alone.)"""
    torch.manual_seed(1)
    w, b = torch.randn(n, k), torch.randn(n)
    lin = quant.Int8Linear.from_float(w, b, "vnni")
    assert lin.layout == "vnni"
    x = torch.randn(33, k) * torch.logspace(-1, 1, 33)[:, None]
    out = {}
    try:
        for on in (True, False):
            quant.set_amx(on)
            out[on] = {rows: lin(x[:rows]) for rows in (1, 2, 5, 8, 15, 16, 17, 33)}
    finally:
        quant.set_amx(True)
    for rows, y in out[True].items():
        assert torch.equal(y, out[False][rows]), rows
        assert torch.equal(y, out[True][33][:rows]), rows  # each row its own


@pytest.mark.parametrize("shape", [(48, 40), (1536, 256), (200, 1001), (64, 48), (896, 4864)])
def test_int8_linear_rows_are_independent_and_layouts_agree(shape):
    """Every layout, both kernels: the same bits, and each row's output its own."""
    k, n = shape
    torch.manual_seed(0)
    w, b = torch.randn(n, k), torch.randn(n)
    lin = {lay: quant.Int8Linear.from_float(w, b, lay) for lay in quant.LAYOUTS}
    assert lin["vnni"].layout == ("vnni" if k % 16 == 0 and n % 16 == 0 else "kn")
    assert all(torch.equal(m.weight_kn(), lin["kn"].qweight) for m in lin.values())
    x = torch.randn(17, k) * torch.logspace(-2, 2, 17)[:, None]  # rows of very different scales
    x[3, 5] = 1e-39  # a subnormal
    full = lin["kn"](x)
    for lay in quant.LAYOUTS:
        assert torch.equal(full, lin[lay](x)), lay
        for i in range(17):
            assert torch.equal(full[i:i + 1], lin[lay](x[i:i + 1])), (lay, i)
        for rows in (2, 8, 9, 16):
            assert torch.equal(full[:rows], lin[lay](x[:rows])), (lay, rows)
    ref = x @ w.t() + b
    assert ((full - ref).norm(dim=1) / ref.norm(dim=1)).max() < 0.02
    y = lin["kn"](torch.zeros(2, k))  # an all-zero row: exactly the bias
    assert torch.equal(y, b.expand(2, n))


def test_attend_prefixes_equals_masked_attention():
    torch.manual_seed(0)
    b, h, kv, d, start, t = 1, 12, 2, 16, 37, 9
    q = torch.randn(b, h, t, d)
    k, v = torch.randn(b, kv, start + t, d), torch.randn(b, kv, start + t, d)
    mask = torch.ones(t, start + t, dtype=torch.bool).tril(start)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = attend_prefixes(q, k, v, start)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for i in range(t):  # row i equals the one-token pass at its position
        alone = attend_prefixes(q[:, :, i:i + 1], k[:, :, :start + i + 1], v[:, :, :start + i + 1],
                                start + i)
        assert torch.equal(got[:, :, i:i + 1], alone)


def _attention_args(h, kv, d):
    return ModelArgs(vocab_size=8, dim=h * d, n_layers=1, n_heads=h, n_kv_heads=kv,
                     head_dim=d, intermediate_size=8)


@pytest.mark.parametrize("h,kv,d", [(12, 2, 128), (4, 4, 64), (24, 2, 80), (2, 1, 256), (3, 1, 16), (4, 2, 8), (2, 1, 40)])
def test_attention_kernel_equals_attention_and_rows_are_independent(h, kv, d):
    """The C++ attention of decode/verify rows (sd_attend) against PyTorch's, for group sizes
    1-12 (12: several passes over the values), head dims 8-256 (256: two value chunks; 8 and
    40 the AVX2 kernel's only) and
    prefixes of 1 to 83 slots (16-key blocks with and without a tail); then every row alone,
    and rows of their own lengths in one call, give the same bits as the rows in one pass."""
    lib = attention_kernel(torch.device("cpu"), torch.float32, _attention_args(h, kv, d))
    if lib is None:  # no kernel on this CPU (the kernel test above says why), or the AVX512
        # kernel and a head dim it does not take: the torch path
        assert (quant.vnni_kernel()[0] is None and quant.avx2_kernel() is None) or d % 16
        return
    torch.manual_seed(0)
    b, length, start, t = 2, 96, 66, 17
    cache = KVCache(b, kv, length, d, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    q = torch.randn(b, h, t, d) * 2
    lens = torch.arange(start + 1, start + t + 1).expand(b, t).contiguous()
    got = attend_rows(Prefixes(lib, lens), q, cache)
    assert got.shape == (b, t, h, d)
    ref = attend_prefixes(q, cache.k[:, :, :start + t], cache.v[:, :, :start + t], start)
    torch.testing.assert_close(got, ref.transpose(1, 2), rtol=2e-6, atol=2e-6)
    for i in range(t):
        alone = attend_rows(Prefixes(lib, lens[:1, i:i + 1].contiguous()),
                            q[:1, :, i:i + 1].contiguous(), cache)
        assert torch.equal(alone[0, 0], got[0, i]), i
    short = torch.tensor([[1, 2, 3], [15, 16, 17]])  # rows of their own lengths, one call
    mixed = attend_rows(Prefixes(lib, short), q[:, :, :3].contiguous(), cache)
    for row in range(b):
        for i in range(3):
            n = int(short[row, i])
            one = attend_rows(Prefixes(lib, torch.tensor([[n]])), q[row:row + 1, :, i:i + 1].contiguous(),
                              cache if row == 0 else _row_cache(cache, row))
            assert torch.equal(one[0, 0], mixed[row, i]), (row, i)
            ref = attend_prefixes(q[row:row + 1, :, i:i + 1], cache.k[row:row + 1, :, :n],
                                  cache.v[row:row + 1, :, :n], n - 1)
            torch.testing.assert_close(mixed[row, i], ref[0, :, 0], rtol=2e-6, atol=2e-6)


def test_silu_mul_kernel_equals_pytorch():
    """The MLP's fused activation (sd_silu_mul) against F.silu(gate) * up: within 2 ulp-ish
    relative error over a wide range, 0 and the overflow ends exact, any length (tails of
    1-15 floats; one call over 16,384 floats runs on both threads)."""
    lib = attention.cpu_kernels(torch.device("cpu"), torch.float32)
    if lib is None:
        assert quant.vnni_kernel()[0] is None
        return
    torch.manual_seed(0)
    for n in (1, 15, 17, 16384 + 5):
        g = torch.randn(n) * 12
        g[:5] = torch.tensor([0.0, -100.0, -89.0, 89.0, 100.0])[:n]
        u = torch.randn(n)
        h = torch.empty(n)
        lib.sd_silu_mul(g.data_ptr(), u.data_ptr(), n, h.data_ptr())
        ref = torch.nn.functional.silu(g) * u
        torch.testing.assert_close(h, ref, rtol=1e-6, atol=1e-30)
        if n >= 5:
            assert h[0] == 0 and h[1] == 0 and h[4] == ref[4]
    mlp = native.MLP(_attention_args(2, 1, 16))  # the module takes the kernel path
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        ref = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        torch.testing.assert_close(mlp(x), ref, rtol=1e-5, atol=1e-6)


def _row_cache(cache: KVCache, row: int) -> KVCache:
    one = KVCache(1, cache.k.shape[1], cache.k.shape[2], cache.k.shape[3], torch.float32, "cpu")
    one.k.copy_(cache.k[row:row + 1])
    one.v.copy_(cache.v[row:row + 1])
    return one


def test_int8_rows_of_their_own_lengths_equal_each_row_alone_bit_for_bit():
    """Rows of different cached lengths in one pass (the batched engine's pass) give each row
    the logits of that row run alone, bit for bit: the int8 kernels and the attention kernel
    keep rows apart (elsewhere the masked PyTorch path is close, not equal)."""
    model = tiny_model(4, int8="kn", **KERNEL_SHAPES)
    exact = attention_kernel(torch.device("cpu"), torch.float32, model.args) is not None
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 30, 4)]
    steps = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(50 + n)) for n in (3, 1, 5)]
    batch = model.fork()
    batch.allocate(3, 64)
    for rows in (prompts, steps):
        x = torch.zeros(3, max(map(len, rows)), dtype=torch.long)
        for b, r in enumerate(rows):
            x[b, :len(r)] = r
        out = batch.forward_rows(x, [len(r) for r in rows]).logits
    for b in range(3):
        alone = model.fork()
        alone.allocate(1, 64)
        alone(prompts[b][None])
        want = alone(steps[b][None])[0]
        got = out[b, :len(steps[b])]
        if exact:
            assert torch.equal(got, want), b
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", quant.LAYOUTS)
@pytest.mark.parametrize("tied", [False, True])
def test_int8_verify_pass_rows_equal_one_token_passes_bit_for_bit(layout, tied):
    """The property lossless speculation rests on, on the real int8 kernels: every row of a
    (K+1)-token verify pass equals the one-token pass at its position, at many offsets."""
    model = tiny_model(0, int8=layout, tie_embeddings=tied, dim=64, head_dim=16,
                       n_kv_heads=1, intermediate_size=96)  # shapes the VNNI kernel takes
    assert model.weight_format == f"int8-{layout}"
    seq = torch.randint(0, 96, (1, 160), generator=torch.Generator().manual_seed(1))
    p = 20
    model.allocate(1, 200)
    model.forward(seq[:, :p], num_logits=0)
    singles = torch.cat([model.forward(seq[:, i:i + 1])[0] for i in range(p, 150)])
    for k in (1, 3, 8, 16, 64):
        model.rollback(p)  # refill in passes of up to 65 rows: the same cache as the singles
        for s in range(p, 150, 65):
            model.forward(seq[:, s:min(150, s + 65)], num_logits=0)
        for pos in reversed(range(p, 150 - k - 1, 7)):  # the cache always holds pos
            model.rollback(pos)
            block = model.forward(seq[:, pos:pos + k + 1])[0]
            assert torch.equal(block, singles[pos - p:pos - p + k + 1]), (k, pos)


def test_int8_tree_pass_rows_equal_one_token_passes_bit_for_bit():
    """A draft tree verified in one pass (two rows of their own cached lengths): every node's
    row has the bits of the one-token passes along its root-to-node path, and after
    compaction to an accepted path the next step has plain decoding's bits, where the
    attention kernel runs trees (attention.tree_kernel: both CPU kernels). Elsewhere the target
    says it has no exact trees (and the engine refuses them)."""
    from specdecode.tree import DraftTree
    model = tiny_model(5, int8="nk", **KERNEL_SHAPES)
    kernel = attention_kernel(torch.device("cpu"), torch.float32, model.args)
    exact = attention.tree_kernel(kernel)
    assert model.exact_trees == exact
    if not exact:  # the engine refuses draft trees on such a target (test_tree.py)
        return
    g = torch.Generator().manual_seed(3)
    parents = torch.tensor([-1, -1, 0, 0, 2, 1, 4, 4, 6, -1, 9, 5])
    prompts = [torch.randint(0, 96, (n,), generator=g) for n in (23, 9)]
    trees = [DraftTree(torch.randint(0, 96, (12,), generator=g), parents) for _ in prompts]
    roots = [7, 50]
    batch = model.fork()
    batch.allocate(2, 64)
    x = torch.zeros(2, 23, dtype=torch.long)
    x[0], x[1, :9] = prompts[0], prompts[1]
    batch.forward_rows(x, [23, 9], num_logits=0)
    ids = torch.stack([t.input_ids(r) for t, r in zip(trees, roots)])
    pos = torch.stack([t.position_ids(len(p)) for t, p in zip(trees, prompts)])
    out = batch.forward_rows(ids, attn_mask=trees[0].attn_mask(), position_ids=pos).logits

    def plain(b, tokens):  # one-token passes (the decode path) after the prompt
        m = model.fork()
        m.allocate(1, 64)
        m.forward(prompts[b][None], num_logits=0)
        return [m.forward(torch.tensor([[tok]]))[0, -1] for tok in tokens][-1]

    for b, (tree, root) in enumerate(zip(trees, roots)):
        for row in range(13):
            path = tree.path(row - 1)
            want = plain(b, [root] + tree.token_ids[path].tolist())
            assert torch.equal(out[b, row], want), (b, row)
    path = trees[0].path(8)  # 0 -> 2 -> 4 -> 6 -> 8
    batch.compact(0, 23, [0] + [i + 1 for i in path])
    batch.compact(1, 9, [0])
    nxt = batch.forward_rows(torch.tensor([[11], [12]]), num_logits=1).logits[:, 0]
    want = [plain(0, [roots[0]] + trees[0].token_ids[path].tolist() + [11]), plain(1, [roots[1], 12])]
    for b in range(2):
        assert torch.equal(nxt[b], want[b]), b


def test_int8_layouts_give_the_same_logits():
    models = [tiny_model(3, int8=lay) for lay in quant.LAYOUTS]
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    for m in models:
        m.allocate(1, 64)
    want = models[0](ids)
    assert all(torch.equal(m(ids), want) for m in models[1:])


def test_tied_nk_model_shares_the_embedding_table():
    m = tiny_model(0, int8="nk", tie_embeddings=True)
    assert m.lm_head.qweight.data_ptr() == m.model.embed_tokens.qweight.data_ptr()


def test_int8_is_close_to_fp32_and_really_quantized():
    fp32, int8 = tiny_model(2), tiny_model(2, int8="kn")
    ids = torch.arange(30)[None]
    for m in (fp32, int8):
        m.allocate(1, 32)
    a, b = fp32(ids), int8(ids)
    assert not torch.equal(a, b)
    assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] > 0.99


@pytest.mark.parametrize("kind", ["draft", "lookup"])
def test_speculative_output_equals_int8_plain_decoding(kind):
    """Greedy speculation on an int8 target reproduces that target's own plain decoding
    (not the fp32 model's), with a float draft of the same weights that disagrees at times."""
    target = tiny_model(0, int8=quant.best_layout("target"))
    for name in ("twenty", "long"):
        prompt = PROMPTS[name]
        params = SamplingParams(max_new_tokens=80)
        plain, _ = run(target, PromptLookupProposer(), 1, prompt, params)  # K=1, one row checked
        target.allocate(1, len(prompt) + 90)
        target.forward(torch.tensor([prompt[:-1]]), num_logits=0)
        ar = [prompt[-1]]
        for _ in range(80):
            ar.append(int(target.forward(torch.tensor([[ar[-1]]]))[0, -1].argmax()))
        assert plain.token_ids == ar[1:]
        proposer = DraftModelProposer(tiny_model(0)) if kind == "draft" else PromptLookupProposer()
        gen, _ = run(target, proposer, 6, prompt, params)
        assert gen.token_ids == ar[1:], name
        if kind == "draft":
            assert 0.3 < gen.stats.acceptance_rate < 1.0  # fp32 draft vs int8 target


def test_int8_weights_are_cached_once_and_rebuilt_when_broken(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    hf_model_dir(tmp_path / "m", "qwen2-bias-tied")
    ids = torch.arange(25)[None]
    first = Transformer.from_pretrained(tmp_path / "m", dtype="int8")
    first.allocate(1, 32)
    want = first(ids)
    files = list((tmp_path / "cache" / "int8").iterdir())
    assert len(files) == 1 and files[0].suffix == ".safetensors"  # no partial file left

    calls = []
    real = quant.quantize_state
    monkeypatch.setattr(quant, "quantize_state", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    again = Transformer.from_pretrained(tmp_path / "m", dtype="int8")
    again.allocate(1, 32)
    assert torch.equal(again(ids), want) and calls == []  # read from the cache

    files[0].write_bytes(files[0].read_bytes()[:100])  # truncated
    rebuilt = Transformer.from_pretrained(tmp_path / "m", dtype="int8")
    rebuilt.allocate(1, 32)
    assert torch.equal(rebuilt(ids), want) and calls == [1]
    assert len(list((tmp_path / "cache" / "int8").iterdir())) == 1

    save_file({"x": torch.zeros(2)}, files[0])  # readable, but not this model's tensors
    again = Transformer.from_pretrained(tmp_path / "m", dtype="int8")
    again.allocate(1, 32)
    assert torch.equal(again(ids), want) and calls == [1, 1]  # quantized again, not refused

    Transformer.from_pretrained(tmp_path / "m", dtype="int8", layout="kn")  # its own entry
    assert len(list((tmp_path / "cache" / "int8").iterdir())) == 2
    if quant.q4k_kernel()[0] is not None:  # int4 is another entry, not the int8 one
        Transformer.from_pretrained(tmp_path / "m", dtype="int4")
        names = sorted(f.name for f in (tmp_path / "cache" / "int8").iterdir())
        assert len(names) == 3 and sum("-int4-" in n for n in names) == 1


def test_int8_of_a_changed_checkpoint_is_quantized_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    hf = hf_model_dir(tmp_path / "m", "llama-gqa-untied")
    a = Transformer.from_pretrained(tmp_path / "m", dtype="int8")
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"] * 2
    save_file(state, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    b = Transformer.from_pretrained(tmp_path / "m", dtype="int8")
    assert torch.equal(b.lm_head.wscale, a.lm_head.wscale * 2)


def test_unwritable_cache_still_loads(tmp_path, monkeypatch, capsys):
    (tmp_path / "cache").write_text("a file where the cache directory should be")
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    hf_model_dir(tmp_path / "m", "mistral")
    m = Transformer.from_pretrained(tmp_path / "m", dtype="int8")
    assert m.weight_format == f"int8-{quant.best_layout('target')}"
    assert "could not cache the int8 weights" in capsys.readouterr().err


def test_bad_dtype_role_and_layout_are_refused(tmp_path):
    hf_model_dir(tmp_path, "mistral")
    with pytest.raises(ValueError, match=r"dtype 'int3' is not one of \['auto', 'int8', 'q4', 'int4', 'float32'"):
        load(tmp_path, dtype="int3")
    with pytest.raises(ValueError, match="dtype int4 runs on the native backend only"):
        load(tmp_path, dtype="int4", backend="transformers")
    with pytest.raises(ValueError, match="dtype None is not one of"):
        load(tmp_path, dtype=None)
    with pytest.raises(ValueError, match="role 'verifier' is not one of"):
        load(tmp_path, role="verifier")
    with pytest.raises(ValueError, match="layout 'mk' is not one of"):
        Transformer.from_pretrained(tmp_path, dtype="int8", layout="mk")
    with pytest.raises(ValueError, match="quantize needs a float model"):
        tiny_model(0, pack=True).quantize()


def test_default_load_is_int8_and_the_draft_int4_in_the_one_token_layout(tmp_path):
    hf_model_dir(tmp_path, "qwen2-bias-tied")
    t, d = specdecode.load_pair(tmp_path, tmp_path)
    assert t.lm.weight_format == f"int8-{quant.best_layout('target')}"
    q4k = quant.q4k_kernel()[0] is not None  # a draft gets int4 where a kernel runs it
    assert d.lm.weight_format == f"{'int4' if q4k else 'int8'}-{quant.best_layout('draft')}"
    assert any(isinstance(m, quant.Q4KLinear) for m in d.lm.modules()) == q4k
    hf = load(tmp_path, backend="transformers", role="draft", tokenizer=False)
    assert hf.lm.weight_format == f"int8-{quant.best_layout('draft')}"
    assert any(isinstance(m, quant.Int8Linear) for m in hf.lm.hf.modules())


# ----------------------------------------------------------------------------------------
# q4: a GGUF file's own Q4_K blocks
# ----------------------------------------------------------------------------------------

def _q4k_linear(n, k, seed=0, bias=True):
    m = quant.Q4KLinear(k, n, bias)
    for name, t in quant.q4k_buffers(random_q4k_blocks(n, k, seed)).items():
        setattr(m, name, t)
    if bias:
        m.bias = torch.randn(n)
    return m


def test_q4k_buffers_dequantize_as_gguf_does():
    raw = random_q4k_blocks(32, 512, seed=3)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    assert torch.equal(_q4k_linear(32, 512, 3, bias=False).weight(), torch.from_numpy(want))


def _conversion_libraries():
    """Every kernel library this CPU can load (the VNNI one and the AVX2 one where both run):
    each carries its own copy of the load-time conversions (cpu_convert.h)."""
    libs = [lib for lib in (quant.vnni_kernel()[0], quant.avx2_library()) if lib is not None]
    assert libs or "avx2" not in _cpu_flags()  # (a CPU without AVX2: no kernel, nothing to test)
    return libs


def _blocks_with_awkward_scales(qtype: str, rows: int, blocks: int, seed: int):
    """Random rows of ``qtype`` blocks whose fp16 scales include zeros, subnormals and
    normal values of both signs, and one all-zero row."""
    kind = gguf.GGMLQuantizationType[qtype]
    size = gguf.GGML_QUANT_SIZES[kind][1]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    choices = np.array([0.0, 3e-7, -2e-6, 6e-8, 1e-3, -0.02, 0.5], dtype=np.float16)  # 3e-7 etc.: subnormal
    for at in ((0, 2) if qtype == "Q4_K" else (size - 2,)):
        raw[..., at:at + 2] = rng.choice(choices, (rows, blocks))[..., None].view(np.uint8)
    raw[3] = 0  # an all-zero row: scale 1, q 0
    return kind, raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_the_kernels_int8_rows_are_quantize_rows_of_the_dequantized_rows(qtype):
    """``sd_rows_int8`` (a model's Q4_K / Q6_K weights made int8 at load) gives the bits of
    the PyTorch path: the gguf package's dequantization, then :func:`quant.quantize_rows`."""
    kind, raw = _blocks_with_awkward_scales(qtype, 40, 3, seed=5)
    w = torch.from_numpy(gguf.quants.dequantize(raw, kind).astype(np.float32))
    want_q, want_s = quant.quantize_rows(w)
    for lib in _conversion_libraries():
        q, s = torch.empty(40, 768, dtype=torch.int8), torch.empty(40)
        assert lib.sd_rows_int8(int(kind), torch.from_numpy(raw).data_ptr(), 40, 3, q.data_ptr(), s.data_ptr()) == 0
        assert torch.equal(s, want_s) and torch.equal(q, want_q)
        assert lib.sd_rows_int8(int(gguf.GGMLQuantizationType.Q5_K), 0, 0, 0, 0, 0) == -1  # not its type


def test_the_kernels_q4k_repack_is_the_blocks_rearranged():
    """``sd_q4k_repack`` of every library gives buffers that dequantize to the gguf
    package's weights (awkward scales included), and the same bytes from each library."""
    kind, raw = _blocks_with_awkward_scales("Q4_K", 32, 2, seed=6)
    want = torch.from_numpy(gguf.quants.dequantize(raw, kind))
    got = []
    for lib in _conversion_libraries():
        out = {k: torch.empty(shape, dtype=dtype) for k, shape, dtype in (
            ("qweight", (2, 16, 4, 16, 4), torch.uint8), ("d", (2, 2, 16), torch.int16),
            ("dmin", (2, 2, 16), torch.int16), ("sc", (2, 16, 16), torch.uint8), ("mn", (2, 16, 16), torch.uint8))}
        lib.sd_q4k_repack(torch.from_numpy(raw).data_ptr(), 32, 2, *(out[k].data_ptr() for k in quant.Q4K_BUFFERS))
        assert torch.equal(quant.q4k_dequantize(out), want)
        got.append(out)
    assert all(torch.equal(o[k], got[0][k]) for o in got for k in quant.Q4K_BUFFERS)


@pytest.mark.parametrize("shape", [(48, 256), (256, 768)])
def test_q4k_linear_equals_its_reference_and_rows_are_independent(shape):
    """The kernel against the arithmetic it documents (exact int32 sums per group of 32,
    then f = (f + A*sum) - B*gsum, times the row's scale), and each row its own."""
    n, k = shape
    lin = _q4k_linear(n, k, seed=1)
    x = torch.randn(17, k) * torch.logspace(-2, 2, 17)[:, None]
    if q4k_refused(lambda: lin(x)):
        return
    y = lin(x)
    for rows in (1, 2, 8, 9, 16):
        assert torch.equal(lin(x[:rows]), y[:rows]), rows
    for i in range(17):
        assert torch.equal(lin(x[i:i + 1]), y[i:i + 1]), i
    amax = x.abs().amax(1, keepdim=True)
    xs = amax / quant.QMAX
    xq = torch.round(x / xs).clamp(-127, 127)
    w = lin.weight()
    q = quant.q4k_dequantize({**{b: getattr(lin, b) for b in quant.Q4K_BUFFERS},
                              "d": torch.full_like(lin.d, 15360),  # fp16 1.0
                              "dmin": torch.zeros_like(lin.dmin),
                              "sc": torch.ones_like(lin.sc)})  # the 4-bit values alone
    sums = torch.einsum("ngk,mgk->mng", q.view(n, k // 32, 32).double(),
                        xq.view(17, k // 32, 32).double()).float()
    d = lin.d.view(torch.float16).float().transpose(1, 2).reshape(n, -1).repeat_interleave(8, 1)
    dmin = lin.dmin.view(torch.float16).float().transpose(1, 2).reshape(n, -1).repeat_interleave(8, 1)
    a = d * lin.sc.float().transpose(1, 2).reshape(n, -1)
    b = dmin * lin.mn.float().transpose(1, 2).reshape(n, -1)
    gsum = xq.view(17, k // 32, 32).sum(-1)
    f = torch.zeros(17, n)
    for g in range(k // 32):
        f = (f + a[:, g] * sums[:, :, g]) - b[:, g] * gsum[:, g:g + 1]
    assert torch.equal(y, f * xs + lin.bias)
    assert ((y - (x @ w.t() + lin.bias)).norm() / (x @ w.t()).norm()) < 0.02


@pytest.mark.parametrize("n, k", [(48, 256), (32, 1536), (16, 8960)])
def test_q4k_amx_and_vnni_give_the_same_bits(n, k):
    """The Q4_K kernel's passes of 9+ rows on the tile unit (two groups of 32 per step, 16
    rows per tile) against the AVX512 ones, and each row its own. (Where the CPU has no AMX
    both runs take the AVX512 path.)"""
    lin = _q4k_linear(n, k, seed=2)
    x = torch.randn(33, k) * torch.logspace(-1, 1, 33)[:, None]
    if q4k_refused(lambda: lin(x)):
        return
    out = {}
    try:
        for on in (True, False):
            quant.set_amx(on)
            out[on] = {rows: lin(x[:rows]) for rows in (1, 2, 3, 7, 8, 9, 16, 17, 33)}
    finally:
        quant.set_amx(True)
    for rows, y in out[True].items():
        assert torch.equal(y, out[False][rows]), rows
        assert torch.equal(y, out[True][33][:rows]), rows


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("q4")
    src = q4k_target_dir(root / "src")
    write_tiny_gguf(src, root / "tiny-q4.gguf", q4k=True)
    return root / "tiny-q4.gguf"


def test_q4_target_keeps_the_gguf_blocks_and_its_verify_rows_equal_one_token_passes(
        q4_gguf, tmp_path, monkeypatch):
    """A Llama GGUF with Q4_K linears (q and k rows permuted as llama.cpp writes them): its
    q4 model holds exactly the converted weights, picked by dtype auto, and every row of a
    verify pass equals the one-token pass at its position, bit for bit."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    m = specdecode.load(q4_gguf)
    lm = m.lm
    if q4k_refused(lambda: load(q4_gguf, dtype="q4")):
        assert lm.weight_format == "int8-nk"  # auto: int8 on the AVX2 kernel
        return
    assert lm.weight_format == f"q4-{quant.best_layout('target')}"
    fp32 = Transformer.from_pretrained(m.path, pack=False)  # the converted weights
    linears = {n: mod for n, mod in lm.named_modules() if isinstance(mod, quant.Q4KLinear)}
    assert len(linears) == 2 * 7  # every linear of both layers (the embedding is tied)
    for name, mod in linears.items():
        assert torch.equal(mod.weight(), fp32.get_submodule(name).weight), name
    seq = torch.randint(0, lm.vocab_size, (1, 100), generator=torch.Generator().manual_seed(0))
    lm.allocate(1, 128)
    lm.forward(seq[:, :30], num_logits=0)
    singles = torch.cat([lm.forward(seq[:, i:i + 1])[0] for i in range(30, 70)])
    for k in (1, 4, 9, 16):
        for pos in (45, 38, 30):
            lm.rollback(pos)
            assert torch.equal(lm.forward(seq[:, pos:pos + k + 1])[0], singles[pos - 30:pos - 30 + k + 1]), (k, pos)
        lm.rollback(30)  # refill in passes of 10: the same cache as the singles
        for s in range(30, 70, 10):
            lm.forward(seq[:, s:s + 10], num_logits=0)
    plain = specdecode.generate(m, "def add(a, b):", method="ar", max_new_tokens=40)
    spec = specdecode.generate(m, "def add(a, b):", method="prompt-lookup", max_new_tokens=40)
    assert spec.token_ids == plain.token_ids


def test_a_q4_state_is_made_from_the_file_at_each_load_never_copied(q4_gguf, tmp_path, monkeypatch):
    """dtype q4 reads the file's blocks at each load: nothing of the weights goes to the
    cache, a q4 copy an earlier version cached is deleted (its disk space freed), and the
    loads give the same bits."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    if q4k_refused(lambda: load(q4_gguf, dtype="q4")):
        return
    first = load(q4_gguf, dtype="q4", tokenizer=False).lm.state_dict()
    int8 = tmp_path / "cache" / "int8"
    assert list(int8.glob("*.safetensors")) == []
    ident = [quant.FORMAT_VERSION, quant.best_layout("target"), True, str(q4_gguf.resolve()),
             q4_gguf.stat().st_size, q4_gguf.stat().st_mtime_ns]
    stale = int8 / f"{q4_gguf.stem}-q4-{quant.hashlib.sha256(repr(ident).encode()).hexdigest()[:16]}.safetensors"
    save_file({"x": torch.zeros(1)}, stale)  # what an earlier version would read (not a state)
    again = load(q4_gguf, dtype="q4", tokenizer=False).lm.state_dict()
    assert not stale.exists()
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


def test_q4_refuses_what_it_cannot_load(q4_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    hf_model_dir(tmp_path / "dir", "mistral")
    if q4k_refused(lambda: load(q4_gguf, dtype="q4")):
        return
    with pytest.raises(ValueError, match="dtype q4 reads a GGUF file's Q4_K blocks"):
        load(tmp_path / "dir", dtype="q4", tokenizer=False)
    assert load(tmp_path / "dir", tokenizer=False).lm.weight_format.startswith("int8")  # auto
    with pytest.raises(ValueError, match="native backend only"):
        load(q4_gguf, dtype="q4", backend="transformers")
    f32 = tmp_path / "f32.gguf"
    write_tiny_gguf(q4k_target_dir(tmp_path / "src"), f32)  # no Q4_K tensor in it
    with pytest.raises(ValueError, match="has no Q4_K weights"):
        load(f32, dtype="q4")
    monkeypatch.setenv("SPECDECODE_INT8_KERNEL", "torch")
    quant.vnni_kernel.cache_clear()
    try:
        with pytest.raises(ValueError, match="needs the AVX512-VNNI or the AVX2 kernel"):
            load(q4_gguf, dtype="q4")
        assert load(q4_gguf).lm.weight_format == "int8-kn"  # auto without the kernel
    finally:
        monkeypatch.delenv("SPECDECODE_INT8_KERNEL")
        quant.vnni_kernel.cache_clear()


def test_whether_a_gguf_has_q4k_is_read_once(q4_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    assert quant.has_q4k(q4_gguf)
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a: pytest.fail("read the header again"))
    assert quant.has_q4k(q4_gguf)  # from <cache>/int8/q4k-files.json


def test_a_broken_cached_kernel_is_built_again(tmp_path):
    """A truncated .so in the cache is built again (in a fresh process: this one keeps the
    library it loaded), for the kernel library this CPU uses (VNNI or AVX2)."""
    env = {**os.environ, "SPECDECODE_CACHE": str(tmp_path / "cache")}
    code = ("from specdecode.models import quant; lib = quant.vnni_kernel()[0] or "
            "quant.avx2_library(); print(lib is not None)")
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if first.stdout.startswith("False"):  # a CPU without AVX2: no kernel to break
        assert "avx2" not in _cpu_flags()
        return
    assert first.stdout.strip() == "True", first.stderr
    (built,) = (tmp_path / "cache" / "kernels").iterdir()
    built.write_bytes(built.read_bytes()[:100])
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert again.stdout.strip() == "True", again.stderr
    assert built.stat().st_size > 1000


def test_without_a_compiler_a_model_still_loads_and_says_what_to_install(tmp_path):
    """No C++ compiler (an empty PATH, no $CXX), in a fresh process with an empty cache: the
    model loads and decodes on torch's int8 product, and stderr says what to install and
    what runs meanwhile (not a silent fall to a path many times slower), once a kernel."""
    hf_model_dir(tmp_path / "m", "llama-gqa-untied")
    code = ("import specdecode, torch; m = specdecode.load(%r, tokenizer=False); "
            "m.lm.allocate(1, 8); print(m.lm.weight_format, bool(torch.isfinite(m.lm(torch.tensor([[1, 2]]))).all()))"
            % str(tmp_path / "m"))
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(SPECDECODE_CACHE=str(tmp_path / "cache"), PATH=str(tmp_path / "empty"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["int8-kn", "True"]
    if "avx2" in _cpu_flags():  # (elsewhere no kernel is built, compiler or not)
        notes = [ln for ln in proc.stderr.splitlines() if ln.startswith("note:") and "kernel is not in use" in ln]
        assert 1 <= len(notes) <= 2, proc.stderr  # (the AVX512-VNNI kernel's, then the AVX2 one's)
        assert all("no C++ compiler" in n and "apt install g++" in n and "torch._int_mm" in n for n in notes)


def test_a_draft_q4_that_cannot_load_is_refused_before_the_target_loads(tmp_path, monkeypatch):
    hf_model_dir(tmp_path, "mistral")
    calls = []
    monkeypatch.setattr(Transformer, "from_pretrained", lambda *a, **k: calls.append(a))
    with pytest.raises(ValueError, match=r"^draft '.*': dtype q4 "):
        specdecode.load_pair(tmp_path, tmp_path, draft_dtype="q4")
    assert calls == []


# ----------------------------------------------------------------------------------------
# int4: every linear in Q4_K blocks quantized here
# ----------------------------------------------------------------------------------------

def _q4k_reference(lin: quant.Q4KLinear, x: torch.Tensor) -> torch.Tensor:
    """What both Q4_K kernels compute, step by step in fp32 torch operations (each IEEE-exact
    and unfused): x's rows quantized alone, per group of 32 the exact integer sums of q * xq
    and of xq, f = (f + (d * sc) * sum) - (dmin * m) * gsum over the groups in order, then
    f * xs + bias. The kernels must give these bits on any CPU."""
    nb, groups = lin.qweight.shape[:2]
    n, k = nb * 16, groups * 32
    qw = lin.qweight.long().permute(0, 3, 1, 2, 4)  # [nb, 16, g, 4, 4]: byte (v, b) of group g
    q = torch.stack([qw & 15, qw >> 4], 4).reshape(n, k)  # k = 32 g + 8 v + 4 half + b
    per = lambda t, size: t.permute(0, 2, 1).reshape(n, -1).repeat_interleave(size // 32, 1)  # noqa: E731
    d = per(lin.d.view(torch.float16).float(), 256)
    dmin = per(lin.dmin.view(torch.float16).float(), 256)
    a, bm = d * per(lin.sc.float(), 32), dmin * per(lin.mn.float(), 32)  # [n, groups]
    xq, xs = quant.quantize_rows(torch.nn.functional.pad(x, (0, k - x.shape[1])))
    sums = (xq.long().view(-1, 1, groups, 32) * q.view(1, n, groups, 32)).sum(-1)  # [M, n, groups]
    gsum = xq.long().view(-1, groups, 32).sum(-1)  # [M, groups]
    f = torch.zeros(x.shape[0], n)
    for g in range(groups):
        f = (f + a[:, g] * sums[:, :, g].float()) - bm[:, g] * gsum[:, g:g + 1].float()
    f = f * xs[:, None]
    return f if lin.bias is None else f + lin.bias


@pytest.mark.parametrize("n,k", [(48, 96), (32, 896), (64, 512), (16, 256)])
def test_q4k_kernel_gives_the_bits_of_its_reference_on_any_cpu(n, k):
    """The Q4_K linear of the kernel in use (AVX512-VNNI, or AVX2 with its own integer
    sequence) equals :func:`_q4k_reference` bit for bit, so a q4 or int4 model gives the same
    logits on both kinds of CPU; extreme activations (rows scaled 1e-3..1e3) included."""
    if q4k_refused(lambda: _int4_linear(48, 96)[1](torch.randn(1, 96))):
        return
    _, lin = _int4_linear(n, k, seed=n + k)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(k)) * torch.logspace(-3, 3, 11)[:, None]
    assert torch.equal(lin(x), _q4k_reference(lin, x))
    lin.bias = None
    assert torch.equal(lin(x[:3]), _q4k_reference(lin, x[:3]))


def test_q4k_avx2_kernel_gives_the_vnni_kernels_bits():
    """Where both kernels build (an AVX512-VNNI CPU also has AVX2), one linear through each:
    the same bits for 1..9 rows."""
    vnni, avx2 = quant.vnni_kernel()[0], quant.avx2_library()
    if vnni is None or avx2 is None:
        assert quant.q4k_kernel()[0] is not None or avx2 is None
        return
    _, lin = _int4_linear(64, 512, seed=9)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(9))
    for m in range(1, 10):
        out = [torch.empty(m, 64) for _ in range(2)]
        for lib, y in zip((vnni, avx2), out):
            lib.sd_q4k_linear_x(x.data_ptr(), m, 512, 512, *quant._pointers(lin, (*quant.Q4K_BUFFERS, "bias")),
                                64, y.data_ptr())
        assert torch.equal(out[0], out[1]), m


def _int4_linear(n, k, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    lin = quant.Q4KLinear(k, n, True)
    for name, t in quant.q4k_quantize(w).items():
        setattr(lin, name, t)
    lin.bias = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1))
    return w, lin


@pytest.mark.parametrize("shape", [(48, 96), (32, 896), (64, 512)])
def test_q4k_quantize_is_close_pads_with_zeros_and_stays_on_its_grid(shape):
    n, k = shape
    w, lin = _int4_linear(n, k)
    kp = -(-k // 256) * 256
    assert lin.padded_in == kp and lin.qweight.shape == (n // 16, kp // 32, 4, 16, 4)
    full = quant.q4k_dequantize({b: getattr(lin, b) for b in quant.Q4K_BUFFERS})
    assert full.shape == (n, kp) and not full[:, k:].any()
    err = (lin.weight() - w).norm() / w.norm()
    assert 0 < err < 0.12, err  # 4 bits a weight: about 1/15 of each group's range
    # the blocks are exact Q4_K values: quantizing their dequantization changes nothing
    again = quant.q4k_quantize(lin.weight())
    assert torch.equal(quant.q4k_dequantize(again)[:, :k], lin.weight())


def test_a_padded_q4k_linear_equals_the_padded_product_and_rows_are_independent():
    if q4k_refused(lambda: _int4_linear(48, 96, seed=3)[1](torch.randn(1, 96))):
        return
    w, lin = _int4_linear(48, 96, seed=3)
    wide = quant.Q4KLinear(256, 48, True)
    for b in (*quant.Q4K_BUFFERS, "bias"):
        setattr(wide, b, getattr(lin, b))
    x = torch.randn(17, 96) * torch.logspace(-2, 2, 17)[:, None]
    y = lin(x)
    assert torch.equal(y, wide(torch.nn.functional.pad(x, (0, 160))))
    for i in range(17):
        assert torch.equal(lin(x[i:i + 1]), y[i:i + 1]), i
    assert torch.equal(lin(x[:8]), y[:8])


@pytest.mark.parametrize("tied", [False, True])
def test_int4_verify_pass_rows_equal_one_token_passes_bit_for_bit(tied):
    if q4k_refused(lambda: _int4_forward(tiny_model(0, int8="vnni", int4=True))):
        return
    model = tiny_model(0, int8="vnni", int4=True, tie_embeddings=tied, dim=64, head_dim=16,
                       n_kv_heads=1, intermediate_size=96)
    assert model.weight_format == "int4-vnni"
    assert sum(isinstance(m, quant.Q4KLinear) for m in model.modules()) == 2 * 7 + 1
    seq = torch.randint(0, 96, (1, 90), generator=torch.Generator().manual_seed(2))
    model.allocate(1, 100)
    model.forward(seq[:, :10], num_logits=0)
    singles = torch.cat([model.forward(seq[:, i:i + 1])[0] for i in range(10, 80)])
    for k in (1, 4, 8, 16):
        model.rollback(10)  # refilled in passes of up to 65 rows (attend_prefixes): the
        for s in range(10, 80, 65):  # same cache as the singles left
            model.forward(seq[:, s:min(80, s + 65)], num_logits=0)
        for pos in reversed(range(10, 80 - k - 1, 9)):  # the cache always holds pos
            model.rollback(pos)
            assert torch.equal(model.forward(seq[:, pos:pos + k + 1])[0],
                               singles[pos - 10:pos - 10 + k + 1]), (k, pos)


def test_int4_draft_and_int4_target_keep_the_targets_plain_decoding():
    """An int4 draft proposes for an int8 target, and a float draft for an int4 target:
    greedy output is each target's own plain decoding."""
    if q4k_refused(lambda: _int4_forward(tiny_model(0, int8="vnni", int4=True))):
        return
    prompt, params = PROMPTS["twenty"], SamplingParams(max_new_tokens=60)
    for target, draft in ((tiny_model(0, int8="vnni"), tiny_model(0, int8="vnni", int4=True)),
                          (tiny_model(0, int8="vnni", int4=True), tiny_model(0))):
        plain, _ = run(target, PromptLookupProposer(), 1, prompt, params)
        gen, _ = run(target, DraftModelProposer(draft), 5, prompt, params)
        assert gen.token_ids == plain.token_ids
        assert gen.stats.acceptance_rate > 0.1  # accepted at times (4 bits on a tiny random model)


def _long_pass_reference(x: torch.Tensor, w: torch.Tensor, bias) -> torch.Tensor:
    """What a long pass computes on the tile unit, in float64: x and the weight rounded to
    bf16 (nearest, ties to even), their products summed, plus the bias."""
    y = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().t()
    return (y if bias is None else y + bias.double()).float()


def test_long_pass_bounds_keep_every_verify_pass_on_the_exact_kernels():
    """A verify pass has at most SDPA_MIN_TOKENS tokens a row; prefill chunks are longer."""
    assert attention.SDPA_MIN_TOKENS < quant.PREFILL_MIN_TOKENS < Transformer.PREFILL_CHUNK


def _long_pass_linears():
    q4k = _int4_linear(64, 512, seed=6)[1]
    torch.manual_seed(6)
    i8 = quant.Int8Linear.from_float(torch.randn(96, 512), torch.randn(96), "vnni")
    wide = _int4_linear(32, 8960, seed=7)[1]  # K of the 1.5B target's down_proj
    return {"q4k": (q4k, q4k.weight()), "int8": (i8, i8.weight_kn().t().float() * i8.wscale[:, None]),
            "q4k-wide": (wide, wide.weight())}


@pytest.mark.parametrize("kind", ["q4k", "int8", "q4k-wide"])
def test_long_passes_multiply_in_bf16_where_the_cpu_has_amx_bf16(kind):
    """Passes of more than PREFILL_MIN_TOKENS tokens a row: on a CPU with AMX-BF16 (and AMX
    on), the product of the bf16-rounded x and weights summed in fp32 (to fp32's rounding:
    a weight rounded otherwise, or a product rounded to bf16, is 1e-3 off), each row's bits
    its own whatever the pass's other rows; with AMX off, or elsewhere, the integer kernel's
    bits. Shorter passes keep the integer kernel's bits either way."""
    lin, w = _long_pass_linears()[kind]
    t = quant.PREFILL_MIN_TOKENS + 21  # 117 rows: 16-row blocks and a partial one
    x = torch.randn(1, t, lin.in_features, generator=torch.Generator().manual_seed(8))
    if kind.startswith("q4k") and q4k_refused(lambda: lin(x)):
        return
    on = "amx_bf16" in _cpu_flags() and quant.vnni_kernel()[0] is not None
    try:
        quant.set_amx(True)
        assert quant.bf16_prefill() is (on and quant.amx_in_use())
        long_on, short_on = lin(x), lin(x[:, :quant.PREFILL_MIN_TOKENS])
        rows_on = lin(x[:, 3:quant.PREFILL_MIN_TOKENS + 4])  # other rows around them
        quant.set_amx(False)
        assert not quant.bf16_prefill()
        long_off = lin(x)
    finally:
        quant.set_amx(True)
    exact = lin(x[0]).unsqueeze(0)  # 2-D: the integer kernel's rows
    assert torch.equal(long_off, exact) and torch.equal(short_on, exact[:, :quant.PREFILL_MIN_TOKENS])
    if quant.bf16_prefill():
        ref = _long_pass_reference(x, w, lin.bias)
        assert ((long_on - ref).norm() / ref.norm()) < 1e-5
        assert torch.equal(rows_on, long_on[:, 3:quant.PREFILL_MIN_TOKENS + 4])
        assert not torch.equal(long_on, exact)
    else:
        assert torch.equal(long_on, exact)


@pytest.mark.parametrize("rows,k,n", [(1, 1536, 8960), (5, 96, 37), (7, 64, 9), (8, 33, 3), (17, 272, 64),
                                      (130, 64, 31), (3, 7, 5), (45, 4133, 70), (33, 2080, 33), (40, 2070, 5)])
def test_avx2_int8_product_is_exact_and_rows_are_independent(rows, k, n):
    """cpu_kernels_avx2.cpp's int8 product (what CPUs with AVX2 but without the VNNI kernel
    run): the exact int32 product, whatever the shape (tails of k not a multiple of 16, odd
    n, row blocks of 8 and their rest; prefill's cache blocks: slices of k, channel blocks and
    their rests), each row the same alone."""
    lib = quant.avx2_library()
    assert lib is not None or "avx2" not in _cpu_flags()
    if lib is None:
        return
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    y = torch.empty(rows, n, dtype=torch.int32)
    lib.sd_int8_mm_nk(x.data_ptr(), rows, k, w.data_ptr(), n, y.data_ptr())
    assert torch.equal(y.long(), x.long() @ w.long().t())
    one = torch.empty(1, n, dtype=torch.int32)
    lib.sd_int8_mm_nk(x[-1:].contiguous().data_ptr(), 1, k, w.data_ptr(), n, one.data_ptr())
    assert torch.equal(one[0], y[-1])


def test_cpus_without_the_vnni_kernel_run_int8_on_the_avx2_kernel():
    """Where the VNNI kernel is not in use, the int8 linears take the "nk" layout and the AVX2
    kernel (not torch._int_mm, which ran the default target at 0.36 tokens/s), with the same
    bits as torch._int_mm; the attention and silu kernels come from the same library."""
    if quant.vnni_kernel()[0] is not None:
        assert quant.avx2_kernel() is None and quant.best_layout("target") == "vnni"
        return
    assert quant.avx2_kernel() is not None or "avx2" not in _cpu_flags()
    if quant.avx2_kernel() is None:
        return
    assert quant.best_layout("target") == quant.best_layout("draft") == "nk"
    assert attention.cpu_kernels(torch.device("cpu"), torch.float32) is quant.avx2_kernel()
    for k, bias in ((80, torch.randn(48)), (83, None)):  # 83: the quantization's scalar tail
        lin = quant.Int8Linear.from_float(torch.randn(48, k), bias, layout="nk")
        x = torch.randn(3, 5, k) * torch.logspace(-3, 3, 5)[:, None]
        x[0, 0] = 0.0  # an all-zero row: scale 1
        xq, xs = quant.quantize_rows(x.reshape(-1, k))
        ref = torch._int_mm(xq, lin.weight_kn()).float() * xs[:, None] * lin.wscale
        ref = ref + lin.bias if bias is not None else ref
        assert torch.equal(lin(x).reshape(-1, 48), ref)
        assert torch.equal(lin(x[1:2, 2:3]).reshape(-1, 48), ref[7:8])  # a row alone


@pytest.mark.parametrize("kind", ["float", "kn", "nk", "vnni", "q4k"])
def test_first_rows_give_the_full_linears_outputs_bit_for_bit(kind):
    """A draft's restricted LM head (quant.first_rows): its outputs are the full linear's
    first m, bit for bit, in every weight format; a bad m or module is named."""
    g = torch.Generator().manual_seed(3)
    w, b, x = torch.randn(64, 256, generator=g), torch.randn(64, generator=g), torch.randn(5, 256, generator=g)
    if kind == "float":
        lin = torch.nn.Linear(256, 64)
        with torch.no_grad():
            lin.weight.copy_(w)
            lin.bias.copy_(b)
    elif kind == "q4k":
        lin = quant.Q4KLinear(256, 64, True)
        for name, t in quant.q4k_quantize(w).items():
            setattr(lin, name, t)
        lin.bias = b
    else:
        lin = quant.Int8Linear.from_float(w, b, layout=kind)
        assert lin.layout == kind
    sub = quant.first_rows(lin, 32)
    assert type(sub) is type(lin) and sub.out_features == 32
    if kind == "q4k" and quant.vnni_kernel()[0] is None:  # Q4_K runs on that kernel only: the blocks
        assert torch.equal(sub.weight(), lin.weight()[:32]) and torch.equal(sub.bias, lin.bias[:32])
    else:
        assert torch.equal(sub(x), lin(x)[:, :32])
    for m in (0, 24, 80, 32.0):
        with pytest.raises(ValueError, match="multiple of 16"):
            quant.first_rows(lin, m)
    with pytest.raises(ValueError, match="Int8Linear, Q4KLinear or nn.Linear"):
        quant.first_rows(torch.nn.Embedding(4, 4), 16)

"""The native decoder equals transformers (fp32, max abs diff <= 1e-4), its cache rolls back by
pointer, and the transformers adapter serves the same interface."""

import json

import pytest
import torch
import transformers

from specdecode.models import registry
from specdecode.models import HFCausalLM, load
from specdecode.models.loading import float_model_path
from specdecode.models.native import ModelArgs, Transformer

from tiny_dirs import CONFIGS, TINY, hf_model_dir

TOL = 1e-4

@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("pack", [False, True])
def test_logits_equal_transformers(tmp_path, name, pack):
    hf = hf_model_dir(tmp_path, name)
    ids = torch.randint(0, TINY["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    assert ref.abs().max() > 1.0  # a meaningful comparison
    model = Transformer.from_pretrained(tmp_path, pack=pack)
    assert (model.args.rope_scaling is not None) == (name in ("llama3-rope-scaling", "phi3-longrope-partial"))
    model.allocate(1, 64)
    assert (model(ids) - ref).abs().max() <= TOL
    # the same positions again, fed as prefill + 1-token steps + (K+1)-token blocks after rollback
    model.rollback(0)
    model(ids[:, :10], num_logits=0)
    for t in range(10, 14):
        assert (model(ids[:, t:t + 1]) - ref[:, t:t + 1]).abs().max() <= TOL
    for start, size in [(14, 5), (16, 9), (20, 1), (21, 19)]:
        model.rollback(start)
        assert (model(ids[:, start:start + size]) - ref[:, start:start + size]).abs().max() <= TOL
    assert model.seq_len == 40


@pytest.mark.parametrize("num_logits", [None, 0, 1, 7, 30])
def test_chunked_prefill_equals_transformers(tmp_path, num_logits):
    """A prefill longer than PREFILL_CHUNK runs in chunks (here 16 tokens; 40 = 16 + 16 + 8):
    the same logits for the last num_logits positions and the same cache as one pass."""
    hf = hf_model_dir(tmp_path, "llama-gqa-untied")
    ids = torch.randint(0, TINY["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
    model = Transformer.from_pretrained(tmp_path)
    model.PREFILL_CHUNK = 16
    model.allocate(1, 64)
    model(ids[:, :3], num_logits=0)
    calls = []
    model.model.embed_tokens.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[1]))
    out = model(ids[:, 3:], num_logits=num_logits)  # 37 tokens after 3 cached: 16 + 16 + 5
    assert calls == [16, 16, 5]
    n = 37 if num_logits is None else num_logits
    assert out.shape == (1, n, TINY["vocab_size"]) and model.seq_len == 40
    assert n == 0 or (out - ref[:, 40 - n:]).abs().max() <= TOL
    model.rollback(39)
    assert (model(ids[:, 39:]) - ref[:, 39:]).abs().max() <= TOL  # the cache is right
    with pytest.raises(ValueError, match="overflow"):
        model(torch.zeros(1, 30, dtype=torch.long))  # nothing is run when it cannot all fit
    assert model.seq_len == 40


@pytest.mark.real
def test_smollm2_logits_equal_transformers():
    path = registry.fetch("smollm2-135m-instruct")  # the GGUF file's metadata: read natively
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        float_model_path("smollm2-135m-instruct"), dtype=torch.float32).eval()  # transformers' reading
    ids = torch.randint(0, 49152, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    model = load(path, dtype="float32", tokenizer=False).lm
    assert isinstance(model, Transformer)
    model.allocate(1, 64)
    model(ids[:, :40], num_logits=0)
    got = torch.cat([model(ids[:, 40:41]), model(ids[:, 41:48])], 1)
    assert (got - ref[:, 40:48]).abs().max() <= TOL


def test_rollback_and_overflow_errors(tmp_path):
    hf_model_dir(tmp_path, "qwen2-bias-tied")
    model = Transformer.from_pretrained(tmp_path)
    model.allocate(1, 8)
    model(torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="cannot roll back to 6"):
        model.rollback(6)
    with pytest.raises(ValueError, match="overflow"):
        model(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        model.allocate(1, TINY["max_position_embeddings"] + 1)


def test_fork_has_its_own_cache(tmp_path):
    hf_model_dir(tmp_path, "llama-gqa-untied")
    a = Transformer.from_pretrained(tmp_path)
    b = a.fork()
    a.allocate(1, 32)
    b.allocate(1, 32)
    ids = torch.arange(10)[None]
    la = a(ids)
    b(torch.zeros(1, 3, dtype=torch.long))
    assert a.seq_len == 10 and b.seq_len == 3
    b.rollback(0)
    assert torch.equal(b(ids), la)
    assert b.model is a.model  # weights shared, not copied


def test_hf_adapter_matches_native(tmp_path):
    hf_model_dir(tmp_path, "qwen2-bias-tied")
    native = Transformer.from_pretrained(tmp_path, pack=False)
    adapter = load(tmp_path, backend="transformers", dtype="float32", tokenizer=False).lm
    assert isinstance(adapter, HFCausalLM) and adapter.vocab_size == TINY["vocab_size"]
    ids = torch.randint(0, TINY["vocab_size"], (1, 30), generator=torch.Generator().manual_seed(2))
    for m in (native, adapter):
        m.allocate(1, 64)
    ref = native.forward(ids)
    assert adapter.forward(ids[:, :20], num_logits=0).shape == (1, 0, TINY["vocab_size"])
    adapter.rollback(12)
    assert (adapter.forward(ids[:, 12:30]) - ref[:, 12:30]).abs().max() <= TOL
    assert adapter.seq_len == 30


def test_hf_adapter_rolls_back_past_a_sliding_window(tmp_path):
    """A Gemma 3 with a 4-token sliding window: transformers' sliding cache layer cannot be
    cropped once the window is full (every speculative method crashed past 512 tokens with
    gemma3-270m), crop failed on a cache no forward had filled, and without a registered mask
    function the window was not applied at all. Rollbacks past the window and to 0 before any
    forward give the logits of one full pass of transformers' own attention."""
    hf = hf_model_dir(tmp_path, "gemma3-sliding-window")
    ids = torch.randint(0, TINY["vocab_size"], (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits
    lm = HFCausalLM(hf)
    assert lm.row_exact_attention
    lm.allocate(1, 64)
    lm.rollback(0)
    lm.forward(ids[:, :20], num_logits=0)
    for start, size in [(14, 5), (6, 9), (15, 1), (16, 14)]:
        lm.rollback(start)
        out = lm.forward(ids[:, start:start + size])
        assert (out - ref[:, start:start + size]).abs().max() <= TOL, (start, size)
    assert lm.seq_len == 30
    lm.rollback(0)
    assert (lm.forward(ids) - ref).abs().max() <= TOL


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "torch"])
@pytest.mark.parametrize("name", ["qwen2-bias-tied", "llama-mha-head-dim", "gemma3-sliding-window"])
def test_hf_adapter_int8_verify_rows_equal_one_token_passes_bit_for_bit(tmp_path, monkeypatch, name, kernel):
    """The transformers backend with int8 linears: its attention function (rows_attention)
    gives each row of a verify pass the bits of the one-token pass there, so speculation
    reproduces that backend's plain decoding (transformers' SDPA did not: logits moved); in a
    sliding-window layer too, with rows whose window starts at other positions."""
    from specdecode.models import attention

    if not kernel:
        monkeypatch.setattr(attention, "cpu_kernels", lambda *a: None)
    hf_model_dir(tmp_path, name)
    lm = load(tmp_path, backend="transformers", dtype="int8", tokenizer=False).lm
    assert isinstance(lm, HFCausalLM) and lm.row_exact_attention and lm.weight_format.startswith("int8")
    ids = torch.randint(0, TINY["vocab_size"], (1, 70), generator=torch.Generator().manual_seed(3))
    lm.allocate(1, 96)
    lm.forward(ids[:, :20], num_logits=0)
    singles = torch.cat([lm.forward(ids[:, i:i + 1])[0] for i in range(20, 70)])
    for k in (1, 4, 8):
        lm.rollback(20)
        for i in range(20, 70):  # refilled as the singles filled it
            lm.forward(ids[:, i:i + 1], num_logits=0)
        for pos in reversed(range(20, 70 - k - 1, 9)):  # the cache always holds pos
            lm.rollback(pos)
            block = lm.forward(ids[:, pos:pos + k + 1])[0]
            assert torch.equal(block, singles[pos - 20:pos - 20 + k + 1]), (k, pos)


def test_gemma2_soft_capping_runs_through_transformers(tmp_path):
    """Gemma 2 (attention logit soft-capping, which SDPA lacks: it failed outright) through
    the transformers adapter: its logits are transformers' own eager model's, and its
    speculative output equals its plain decoding."""
    from specdecode import generate

    hf = hf_model_dir(tmp_path, "gemma2-softcap")
    hf.set_attn_implementation("eager")
    ids = torch.randint(0, TINY["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits
    m = load(tmp_path, dtype="float32", tokenizer=False)
    assert isinstance(m.lm, HFCausalLM)
    m.lm.allocate(1, 32)
    assert (m.lm.forward(ids) - ref).abs().max() <= TOL
    prompt = ids[0].tolist()
    plain = generate(m, input_ids=prompt, method="ar", max_new_tokens=12, eos_token_id=[])
    spec = generate(m, input_ids=prompt, method="prompt-lookup", max_new_tokens=12, eos_token_id=[])
    assert spec.token_ids == plain.token_ids


def test_gemma3_of_4b_and_up_reads_its_text_model(tmp_path):
    """A Gemma 3 directory of 4B and up (Gemma3ForConditionalGeneration: the text model's
    config nested in text_config, its weights beside a vision tower, linear RoPE scaling on
    the global layers): the native decoder reads the text model alone and gives the logits
    of transformers' model on text; its int8 verify rows equal one-token passes past the
    window. Settings it does not run are refused naming the backend that does."""
    text = {**TINY, "head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name and (p.dim() > 1 or "norm" in name):
                p.normal_(0, 0.2)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, TINY["vocab_size"], (1, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    model = Transformer.from_pretrained(tmp_path, pack=False)
    assert model.args.sliding_layers == (0,) and dict(model.args.rope_scaling)["factor"] == 4.0
    model.allocate(1, 32)
    assert ref.abs().max() > 1.0 and (model(ids) - ref).abs().max() <= TOL
    q = Transformer.from_pretrained(tmp_path, dtype="int8")
    q.allocate(1, 32)
    q(ids[:, :10], num_logits=0)
    singles = torch.cat([q(ids[:, i:i + 1])[0] for i in range(10, 30)])
    for start, k in [(10, 5), (13, 9), (21, 9)]:
        q.rollback(start)
        assert torch.equal(q(ids[:, start:start + k])[0], singles[start - 10:start - 10 + k]), (start, k)
    for bad, match in [({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
                       ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0,
                                                                "rope_theta": 1e6},
                                             "sliding_attention": {"rope_type": "default",
                                                                   "rope_theta": 1e4}}}, "'yarn'")]:
        with pytest.raises(ValueError, match=match):
            ModelArgs.from_hf_config({"model_type": "gemma3_text", **TINY, **bad})


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "torch"])
def test_gemma3_tree_rows_see_their_window(tmp_path, monkeypatch, kernel):
    """Two rows of other cached lengths, both past a 4-token window, verify a draft tree
    each in one pass (the C kernel's windowed slots, or PyTorch's masked products): every
    node's logits are transformers' for the prompt plus its root-to-node path; a prefill
    longer than SDPA_MIN_TOKENS (the fused kernel's windowed mask) too."""
    from specdecode.models import attention

    if not kernel:
        monkeypatch.setattr(attention, "cpu_kernels", lambda *a: None)
    hf = hf_model_dir(tmp_path, "gemma3-sliding-window")
    model = Transformer.from_pretrained(tmp_path, pack=False)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in (10, 7)]
    nodes = torch.randint(0, TINY["vocab_size"], (2, 4), generator=g)
    parents = [-1, 0, 0, 1]
    mask = torch.tensor([[j == i or j == 0 or (i == 3 and j == 1) for j in range(4)] for i in range(4)])
    depth = torch.tensor([0, 1, 1, 2])
    model.allocate(2, 32)
    model.forward_rows(torch.tensor([prompts[0], prompts[1] + [0, 0, 0]]), [10, 7], num_logits=0)
    out = model.forward_rows(nodes, attn_mask=mask, position_ids=torch.tensor([[10], [7]]) + depth)
    for b in range(2):
        for i in range(4):
            path = [i]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            seq = prompts[b] + nodes[b, path[::-1]].tolist()
            with torch.no_grad():
                ref = hf(torch.tensor([seq])).logits[0, -1]
            assert (out.logits[b, i] - ref).abs().max() <= TOL, (b, i)
    long = torch.randint(0, TINY["vocab_size"], (1, 90), generator=g)
    with torch.no_grad():
        ref = hf(long).logits
    model.allocate(1, 96)
    assert (model(long) - ref).abs().max() <= TOL


def test_model_args_errors(tmp_path):
    with pytest.raises(ValueError, match="not one of the natively supported"):
        ModelArgs.from_hf_config({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="not a multiple"):
        ModelArgs(vocab_size=8, dim=8, n_layers=1, n_heads=3, n_kv_heads=2, head_dim=4,
                  intermediate_size=8)
    with pytest.raises(ValueError, match="n_layers must be positive"):
        ModelArgs(vocab_size=8, dim=8, n_layers=0, n_heads=2, n_kv_heads=2, head_dim=4,
                  intermediate_size=8)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="backend='transformers'"):
        load(tmp_path, backend="native", tokenizer=False)
    with pytest.raises(ValueError, match="dtype 'float64'"):
        load(tmp_path, dtype="float64")
    with pytest.raises(ValueError, match="backend 'onnx'"):
        load(tmp_path, backend="onnx")


def test_bf16_without_onednn_bf16_kernels_stays_unpacked(tmp_path, monkeypatch):
    """On AVX2-only CPUs oneDNN has no bf16 linear: the default leaves bf16 linears unpacked
    (and the model runs: close to its fp32 logits) and pack=True says what to do."""
    from specdecode.models import native
    hf_model_dir(tmp_path, "qwen2-bias-tied")
    monkeypatch.setattr(native, "_onednn_bf16", lambda: False)
    model = Transformer.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert not any(isinstance(m, native.PackedLinear) for m in model.modules())
    assert any(isinstance(m, torch.nn.Linear) for m in model.modules())
    ids = torch.arange(1, 9)[None]
    model.allocate(1, 16)
    ref = Transformer.from_pretrained(tmp_path, pack=False)
    ref.allocate(1, 16)
    want = ref(ids)
    assert (model(ids).float() - want).abs().max() <= 0.05 * want.abs().max()
    with pytest.raises(ValueError, match="pack=False or use dtype float32"):
        Transformer.from_pretrained(tmp_path, dtype=torch.bfloat16, pack=True)
    packed = Transformer.from_pretrained(tmp_path, dtype=torch.float32)
    assert any(isinstance(m, native.PackedLinear) for m in packed.modules())

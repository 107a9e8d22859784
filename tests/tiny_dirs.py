"""Tiny model directories that ``specdecode.load`` accepts (random weights, the test
tokenizer), built once per session: the API, CLI and bench tests share them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from helpers import ASCII_TEXT, PROMPT, UNICODE_TEXT, local_tokenizer  # noqa: F401 (re-exported)

VOCAB = len(local_tokenizer())  # the test tokenizer's size == embedding rows of the tiny target
WIDE_VOCAB = VOCAB + 128  # same tokenizer, more embedding rows (like Qwen2.5 151,936 vs 152,064)
EOS = 2  # <|im_end|>


def _randomize(model, seed: int, std: float = 0.3, final_norm: float = 4.0) -> None:
    """Weights N(0, std), unit norms, a sharpened final norm: diverse greedy text, no near-ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        model.model.norm.weight.fill_(final_norm)


def _add_noise(model, seed: int = 1, std: float = 0.01) -> None:
    """A draft of a target: its weights plus N(0, std) noise (norms kept), in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn(p.shape, generator=g) * std)


def _llama_config(vocab_size: int, hidden: int = 32):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=EOS,
                       bos_token_id=1)


def _foreign_tokenizer():
    """A genuinely different byte-level BPE tokenizer (trained here, 300-odd tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator([PROMPT + " " + ASCII_TEXT] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def q4k_target_dir(root: Path) -> Path:
    """A random 2-layer Llama of hidden size 256 (shapes Q4_K takes), the test tokenizer."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(_llama_config(VOCAB, hidden=256))
    _randomize(model, seed=5, std=0.1)
    model.save_pretrained(root)
    local_tokenizer().save_pretrained(root)
    return root


def build_tiny_dirs(root: Path) -> dict[str, Path]:
    """Tiny model directories that ``specdecode.load`` accepts.

    target: random 2-layer Llama, one row per token of the test tokenizer (:func:`local_tokenizer`).
    draft: the target's weights plus noise (another seed): same tokenizer, accepts part of
        each block, so blocks end at varying positions and rollback is exercised.
    wide: the target's weights with 128 extra (zero) embedding rows: same tokenizer.
    wide_draft: the same with large random extra rows (they dominate the draft's raw logits).
    pard: ``wide`` as a parallel draft: its config names its first spare row (VOCAB) as the
        mask token ``pard_token`` (untrained: a zero embedding).
    gpt2: a GPT-2 (not a native architecture), the same tokenizer.
    foreign: a different tokenizer (and vocabulary size).
    """
    from transformers import LlamaForCausalLM

    tok = local_tokenizer()
    dirs = {name: root / name for name in ("target", "draft", "wide", "wide_draft", "pard", "gpt2", "foreign")}
    target = LlamaForCausalLM(_llama_config(VOCAB))
    _randomize(target, seed=0)
    target.save_pretrained(dirs["target"])

    draft = LlamaForCausalLM(_llama_config(VOCAB))
    draft.load_state_dict(target.state_dict())
    _add_noise(draft)
    draft.save_pretrained(dirs["draft"])

    wide = LlamaForCausalLM(_llama_config(WIDE_VOCAB))
    state = dict(target.state_dict())
    emb = state["model.embed_tokens.weight"]
    state["model.embed_tokens.weight"] = torch.cat([emb, torch.zeros(WIDE_VOCAB - VOCAB, emb.shape[1])])
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    wide.load_state_dict(state)
    wide.save_pretrained(dirs["wide"])
    wide.config.pard_token = VOCAB
    wide.save_pretrained(dirs["pard"])
    del wide.config.pard_token

    # as a draft: the same, but its extra rows would win every argmax if the draft's logits
    # were not cut to the target's width
    loud = torch.randn(WIDE_VOCAB - VOCAB, emb.shape[1], generator=torch.Generator().manual_seed(4)) * 3.0
    state["model.embed_tokens.weight"] = state["lm_head.weight"] = torch.cat([emb, loud])
    wide.load_state_dict(state)
    wide.save_pretrained(dirs["wide_draft"])

    for name in ("target", "draft", "wide", "wide_draft", "pard"):
        tok.save_pretrained(dirs[name])

    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=1024, n_embd=32, n_layer=2,
                                      n_head=4, bos_token_id=1, eos_token_id=EOS))
    gpt2.save_pretrained(dirs["gpt2"])
    tok.save_pretrained(dirs["gpt2"])

    ftok = _foreign_tokenizer()
    foreign = LlamaForCausalLM(_llama_config(len(ftok), hidden=16))
    _randomize(foreign, seed=3)
    foreign.save_pretrained(dirs["foreign"])
    ftok.save_pretrained(dirs["foreign"])
    return dirs


_DIRS: dict[str, Path] = {}


def tiny_dirs_in(tmp_path_factory) -> dict[str, Path]:
    """Build the tiny model dirs once per session (shared with test_cli.py)."""
    if not _DIRS:
        _DIRS.update(build_tiny_dirs(tmp_path_factory.mktemp("tiny_models")))
    return _DIRS


# transformers models without a tokenizer, one per architecture switch of the native decoder
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

CONFIGS = {
    "llama-gqa-untied": (transformers.LlamaConfig, dict(tie_word_embeddings=False)),
    "llama3-rope-scaling": (transformers.LlamaConfig, dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    "qwen2-bias-tied": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None)),
    "llama-mha-head-dim": (transformers.LlamaConfig, dict(num_key_value_heads=4, head_dim=32)),
    "qwen3-qk-norm-head-dim": (transformers.Qwen3Config, dict(head_dim=32, tie_word_embeddings=True)),
    # Gemma 3: a 4-token window on the first layer, 1 + w norms, GeGLU, its own score scale
    "gemma3-sliding-window": (transformers.Gemma3TextConfig, dict(
        head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    # Phi-4-mini's switches: fused qkv and gate_up, partial rotary, LongRoPE, tied embeddings
    "phi3-longrope-partial": (transformers.Phi3Config, dict(
        tie_word_embeddings=True, pad_token_id=0, max_position_embeddings=256,
        original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "original_max_position_embeddings": 64,
                         "short_factor": [1.0 + 0.1 * i for i in range(6)],
                         "long_factor": [2.0 + 0.5 * i for i in range(6)]})),
}
# architectures only the transformers adapter runs
HF_ONLY_CONFIGS = {
    "gemma2-softcap": (transformers.Gemma2Config, dict(
        head_dim=16, sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
}


def hf_model_dir(tmp_path, name):
    """Save a random tiny transformers model of config ``name`` (CONFIGS, HF_ONLY_CONFIGS) in
    ``tmp_path``; returns it."""
    cls, extra = {**CONFIGS, **HF_ONLY_CONFIGS}[name]
    torch.manual_seed(0)
    config = cls(**{**TINY, **extra})
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger weights than the default init, so that logits are not ~0
        for name, p in hf.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            elif "norm" in name and isinstance(config, transformers.Gemma3TextConfig):
                p.normal_(0, 0.2)  # Gemma's are 1 + w: w = 0 would not test the offset
    hf.save_pretrained(tmp_path)
    return hf


def write_tiny_gguf(src: Path, out: Path, q4k: bool = False, qtype: str | None = None,
                    chat_template: str | None = None, metadata: dict | None = None) -> None:
    """Write the tiny HF model in ``src`` (llama or qwen2) as a GGUF file, laid out as
    llama.cpp's converter writes it (its tensor names from gguf's name map, llama's q/k rows
    permuted for its rope layout, metadata keys, tokenizer, merges and chat template).
    Tensors are F32, except: ``q4k``: every linear weight of a shape Q4_K takes (inputs a
    multiple of 256) becomes random Q4_K blocks; ``qtype`` (a GGML type name): every 2-D
    weight whose row fits the type's blocks is stored in it (quantized by the gguf package,
    or random blocks with bounded fp16 scales for the types it cannot quantize). ``metadata``:
    more integer keys (e.g. ``tokenizer.ggml.fim_pre_token_id``)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    cfg = json.loads((src / "config.json").read_text())
    tj = json.loads((src / "tokenizer.json").read_text())
    nh, nkv, arch = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["model_type"]
    gemma = arch == "gemma3_text"
    arch = "gemma3" if gemma else arch
    rope = cfg.get("rope_parameters") or {}
    if gemma:
        rope = rope["full_attention"]

    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // nh
    if gemma:  # as llama.cpp's Gemma 3 converter writes them
        w.add_sliding_window(cfg["sliding_window"])
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(rotary)
    if rope.get("rope_type") == "longrope":  # as llama.cpp's converter writes Phi-3's
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(0)  # all F32
    tokens = sorted(tj["model"]["vocab"], key=tj["model"]["vocab"].get)
    special = {a["id"] for a in tj["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(EOS)
    w.add_unk_token_id(0)
    w.add_pad_token_id(EOS)
    w.add_add_bos_token(False)
    for key, value in (metadata or {}).items():
        w.add_uint32(key, value)
    template = src / "chat_template.jinja"
    if chat_template or template.is_file():
        w.add_chat_template(chat_template or template.read_text())
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg["num_hidden_layers"])
    for key, t in load_file(src / "model.safetensors").items():
        a = t.float().numpy()
        base, _, suffix = key.rpartition(".")
        name = f"{names.get_name(base)}.{suffix}"
        if arch == "llama" and suffix == "weight" and base.endswith(("q_proj", "k_proj")):
            a = permute(a, nh if base.endswith("q_proj") else nkv)
        if gemma and key.endswith("norm.weight"):  # llama.cpp stores Gemma's norms as 1 + w
            a = a + 1
        if q4k and a.ndim == 2 and key != "model.embed_tokens.weight" and a.shape[1] % 256 == 0:
            w.add_tensor(name, random_q4k_blocks(*a.shape, seed=sum(name.encode()) + len(name)),
                         raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        elif qtype and a.ndim == 2 and a.shape[1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0] == 0:
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, quantized(a, kind, seed=sum(name.encode())), raw_dtype=kind)
        else:
            w.add_tensor(name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# where each k-quant block keeps its fp16 scales (byte offsets), for random blocks
_FP16_AT = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def quantized(a, kind, seed: int = 0):
    """float [rows, cols] stored as the GGML type ``kind``: the gguf package's quantization,
    or, for types it cannot quantize (the k-quants), random blocks whose fp16 scales are
    ~1e-3 (finite weights of magnitude ~0.1)."""
    import gguf
    import numpy as np

    if kind.name not in _FP16_AT:  # the types the gguf package quantizes
        return gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), kind)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    rows, blocks = a.shape[0], a.shape[1] // block
    b = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for at in _FP16_AT[kind.name]:
        b[:, :, at:at + 2] = rng.uniform(0.5e-3, 2e-3, (rows, blocks, 1)).astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)


def gguf_source_dir(root: Path, arch: str = "llama", tied: bool = True) -> Path:
    """A random 2-layer model of hidden size 256 (rows every GGML block size takes) in
    transformers layout with the test tokenizer: llama, qwen2 (q/k/v biases), qwen3
    (per-head q/k norms, a head size of 32, not 256 / 4), phi3 (Phi-4-mini's switches:
    fused linears, partial rotary, LongRoPE) or gemma3 (6 layers: llama.cpp's pattern of 5
    sliding-window layers, here of 8 positions, then a global one with linear RoPE scaling;
    1 + w norms, GeGLU, a head size of 64)."""
    config = _llama_config(VOCAB, hidden=256)
    if arch == "gemma3":
        config = transformers.Gemma3TextConfig(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
            max_position_embeddings=256, sliding_window=8, eos_token_id=EOS, bos_token_id=1,
            pad_token_id=EOS, rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    elif arch == "phi3":
        config = transformers.Phi3Config(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            original_max_position_embeddings=64, eos_token_id=EOS, bos_token_id=1, pad_token_id=EOS,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                             "original_max_position_embeddings": 64,
                             "short_factor": [1.0 + 0.05 * i for i in range(24)],
                             "long_factor": [2.0 + 0.5 * i for i in range(24)]})
    elif arch in ("qwen2", "qwen3"):
        cls = transformers.Qwen2Config if arch == "qwen2" else transformers.Qwen3Config
        config = cls(**{k: getattr(config, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "eos_token_id", "bos_token_id")},
                     **({"head_dim": 32} if arch == "qwen3" else {}))
    config.tie_word_embeddings = tied
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomize(model, seed=6, std=0.1)
    if arch == "gemma3":  # its norms are 1 + w: w ~ 0.1, the final one sharpened as _randomize's
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
            model.model.norm.weight.fill_(3.0)
    model.save_pretrained(root)
    local_tokenizer().save_pretrained(root)
    return root


def random_q4k_blocks(rows: int, cols: int, seed: int = 0):
    """Random llama.cpp ``block_q4_K`` rows: uint8 [rows, cols / 256 * 144], weights of
    magnitude ~0.1 (fp16 d and dmin about 1e-4, random 6-bit scales and 4-bit values)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    b[:, :, 0:2] = rng.uniform(0.5e-4, 2e-4, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    b[:, :, 2:4] = rng.uniform(0.5e-4, 2e-4, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)


FIM_TOKENS = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
              "<|file_sep|>"]  # Qwen2.5-Coder's


def fim_dirs(root: Path) -> dict[str, Path]:
    """A random 2-layer Llama target and its noisy draft (as :func:`build_tiny_dirs`'s) whose
    tokenizer is the test tokenizer plus Qwen2.5-Coder's FIM special tokens."""
    from transformers import LlamaForCausalLM

    tok = local_tokenizer()
    tok = type(tok).from_pretrained(_saved(tok, root / "base"))
    tok.add_special_tokens({"additional_special_tokens": FIM_TOKENS})
    dirs = {"target": root / "target", "draft": root / "draft"}
    target = LlamaForCausalLM(_llama_config(len(tok)))
    _randomize(target, seed=0)
    target.save_pretrained(dirs["target"])
    _add_noise(target)
    target.save_pretrained(dirs["draft"])
    for d in dirs.values():
        tok.save_pretrained(d)
    return dirs


def _saved(tok, path: Path) -> Path:
    tok.save_pretrained(path)
    return path

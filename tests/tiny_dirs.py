"""Tiny model directories that ``specdecode.load`` accepts (random weights, the test
tokenizer), built once per session: the API, CLI and bench tests share them."""

from __future__ import annotations

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


def build_tiny_dirs(root: Path) -> dict[str, Path]:
    """Tiny model directories that ``specdecode.load`` accepts.

    target: random 2-layer Llama, one row per token of the test tokenizer (:func:`local_tokenizer`).
    draft: the target's weights plus noise (another seed): same tokenizer, accepts part of
        each block, so blocks end at varying positions and rollback is exercised.
    wide: the target's weights with 128 extra (zero) embedding rows: same tokenizer.
    wide_draft: the same with large random extra rows (they dominate the draft's raw logits).
    gpt2: a GPT-2 (not a native architecture), the same tokenizer.
    foreign: a different tokenizer (and vocabulary size).
    """
    from transformers import LlamaForCausalLM

    tok = local_tokenizer()
    dirs = {name: root / name for name in ("target", "draft", "wide", "wide_draft", "gpt2", "foreign")}
    target = LlamaForCausalLM(_llama_config(VOCAB))
    _randomize(target, seed=0)
    target.save_pretrained(dirs["target"])

    draft = LlamaForCausalLM(_llama_config(VOCAB))
    draft.load_state_dict(target.state_dict())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
    draft.save_pretrained(dirs["draft"])

    wide = LlamaForCausalLM(_llama_config(WIDE_VOCAB))
    state = dict(target.state_dict())
    emb = state["model.embed_tokens.weight"]
    state["model.embed_tokens.weight"] = torch.cat([emb, torch.zeros(WIDE_VOCAB - VOCAB, emb.shape[1])])
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    wide.load_state_dict(state)
    wide.save_pretrained(dirs["wide"])

    # as a draft: the same, but its extra rows would win every argmax if the draft's logits
    # were not cut to the target's width
    loud = torch.randn(WIDE_VOCAB - VOCAB, emb.shape[1], generator=torch.Generator().manual_seed(4)) * 3.0
    state["model.embed_tokens.weight"] = state["lm_head.weight"] = torch.cat([emb, loud])
    wide.load_state_dict(state)
    wide.save_pretrained(dirs["wide_draft"])

    for name in ("target", "draft", "wide", "wide_draft"):
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
}


def hf_model_dir(tmp_path, name):
    """Save a random tiny transformers model of config ``name`` (CONFIGS) in ``tmp_path``; returns it."""
    cls, extra = CONFIGS[name]
    torch.manual_seed(0)
    config = cls(**{**TINY, **extra})
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger weights than the default init, so that logits are not ~0
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    hf.save_pretrained(tmp_path)
    return hf

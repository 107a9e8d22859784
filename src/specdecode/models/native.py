"""Compact PyTorch decoder for the Llama family (Llama, Qwen2, Qwen3, Mistral, SmolLM2,
Phi-3) and Gemma 3.

The shape follows gpt-fast's ``model.py``: a frozen :class:`ModelArgs`, a preallocated
:class:`~.kv_cache.KVCache` and a plain forward. What ``transformers`` hides and speculative decoding
needs is explicit here: the cache is a buffer plus a position pointer, so rolling back
rejected draft tokens is ``rollback(n)`` (no copy), and logits can be computed for only the
last positions (prefill needs none). For draft heads, draft trees, layer skipping and batched
serving, :meth:`Transformer.forward_rows` runs rows of their own cache lengths, a tree mask
over the new tokens, a subset of the layers, and returns chosen hidden states;
:meth:`Transformer.rollback_rows` and :meth:`Transformer.compact` edit the cache per row
(their bookkeeping: :mod:`.kv_cache`).

Parameter names match ``transformers``' Llama/Qwen2/Mistral checkpoints, so a safetensors
file saved by ``save_pretrained`` loads with ``load_state_dict`` unchanged. Logits equal
``transformers``' within fp32 rounding (tested: max abs diff <= 1e-4; the forward_rows
features <= 1e-5, ``tests/test_model_interface.py``).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import fused, gguf_file, quant
from .attention import (SDPA_MIN_TOKENS, Prefixes, _softmax, attend_prefixes, attend_rows, attention_kernel,
                        cpu_kernels, tree_kernel, tree_slots, window_prefixes)
from .base import ForwardOutput
from .kv_cache import CacheRows, KVCache
from .self_draft import SelfDraft

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3", "gemma3_text")


def read_json(path: Path) -> dict:
    """A model directory's JSON file (config.json, generation_config.json) as a dict.
    Raises ValueError naming the file when it is not a JSON object."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or re-download the model "
                         "directory") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, expected an object "
                         "({...}); fix or re-download the model directory")
    return value


@dataclass(frozen=True)
class ModelArgs:
    """Architecture of a Llama-family decoder; built from a Hugging Face ``config.json``.

    The switches that separate the family members: ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3:
    an RMSNorm over each head's query and key before RoPE), ``head_dim`` of its own (Qwen3:
    not width / heads), ``fused`` (Phi-3: one ``qkv_proj`` and one ``gate_up_proj``),
    ``rotary_dim`` < ``head_dim`` (Phi-4-mini's partial rotary: the rest of each head passes
    unrotated), ``tie_embeddings`` (small Qwen2.5 and Qwen3, SmolLM2, Phi-4-mini),
    ``rope_theta`` / ``rope_scaling`` (Llama 3 ``llama3`` scaling; Phi-3's ``longrope``, its
    short factors and attention factor: the context is then its original one, where those
    hold), ``n_kv_heads < n_heads`` (grouped-query attention).

    Gemma 3's: ``sandwich_norms`` (an RMSNorm after attention and one after the MLP as well
    as before each), ``activation`` "gelu_tanh" (GeGLU), ``embed_scale`` (the embedding
    times sqrt(width)), ``attn_scale`` (``query_pre_attn_scalar`` ** -0.5 instead of
    head_dim ** -0.5), and ``sliding_layers`` that attend to the last ``sliding_window``
    positions only, with RoPE base ``local_rope_theta`` (the other layers: ``rope_theta`` and
    ``rope_scaling``, linear on 4B and up). Its RMSNorm weights are stored as llama.cpp's
    converter stores them, 1 + w (a Hugging Face checkpoint's w gets 1 added when read).
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, float | str], ...] | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    fused: bool = False
    rotary_dim: int = 0  # 0: head_dim
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    sandwich_norms: bool = False
    activation: str = "silu"  # or "gelu_tanh"
    embed_scale: float = 1.0
    attn_scale: float = 0.0  # 0: head_dim ** -0.5
    sliding_window: int = 0  # 0: none
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float = 10000.0

    @property
    def rotated(self) -> int:
        """The dimensions of each head that RoPE rotates."""
        return self.rotary_dim or self.head_dim

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelArgs.{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"ModelArgs.activation={self.activation!r}; allowed: silu, gelu_tanh")
        if self.sliding_layers and self.sliding_window <= 0:
            raise ValueError(f"sliding_layers {list(self.sliding_layers)} need a sliding_window > 0")

    @property
    def scale(self) -> float:
        """The attention scores' factor."""
        return self.attn_scale or self.head_dim ** -0.5

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelArgs":
        """Build from a ``config.json`` dict of model_type llama, qwen2, qwen3, mistral, phi3,
        gemma3_text or gemma3 (its ``text_config``: the text model of 4B and up).

        Raises ValueError for other model types (use the transformers adapter for those),
        and for settings the native decoder does not run (soft-capping, bidirectional
        attention, other RoPE scalings).
        """
        mt = config.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {mt!r} is not one of the natively supported {SUPPORTED_MODEL_TYPES}; "
                "load it with backend='transformers'")
        if mt in ("gemma3", "gemma3_text"):
            return cls._from_gemma3(config)
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        n_heads = config["num_attention_heads"]
        dim = config["hidden_size"]
        max_pos = config.get("max_position_embeddings", 4096)
        if rope_type not in (None, "default"):
            if rope_type not in ("llama3", "longrope"):
                raise ValueError(f"rope scaling type {rope_type!r} is not supported natively "
                                 "(supported: default, llama3, longrope); load with backend='transformers'")
            keep = ("rope_theta", "partial_rotary_factor")
            scaling = tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                   for k, v in rope.items() if k not in keep))
            if rope_type == "longrope":
                # transformers switches every position to the long factors once a sequence
                # passes the original context (the cached keys keep the short ones): the
                # context is the original one, where one set of factors holds throughout
                original = rope.get("original_max_position_embeddings") or config.get(
                    "original_max_position_embeddings") or max_pos
                factor = max_pos / original
                scaling += (("attention_factor", rope.get("attention_factor") or (
                    math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0)),)
                max_pos = min(max_pos, original)
        head_dim = config.get("head_dim") or dim // n_heads
        partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        if mt == "mistral" and config.get("sliding_window"):
            # Full attention equals sliding-window attention up to the window length.
            max_pos = min(max_pos, config["sliding_window"])
        return cls(
            vocab_size=config["vocab_size"],
            dim=dim,
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            intermediate_size=config["intermediate_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            qkv_bias=mt == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=mt == "qwen3",
            fused=mt == "phi3",
            rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=max_pos,
        )

    @classmethod
    def _from_gemma3(cls, config: dict) -> "ModelArgs":
        """Gemma 3's text model (see the class docstring), its config completed with
        transformers' defaults (the 4B-and-up ``config.json`` names a few fields only)."""
        from transformers import Gemma3TextConfig

        text = config.get("text_config") if config.get("model_type") == "gemma3" else config
        if not isinstance(text, dict):
            raise ValueError("a gemma3 config.json needs a text_config object (the text model's "
                             "settings); fix or re-download the model directory")
        text = Gemma3TextConfig(**{k: v for k, v in text.items() if k != "model_type"}).to_dict()
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if text.get(key):
                raise ValueError(f"{key}={text[key]} is not run natively; load with backend='transformers'")
        if text.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention is not run natively; load with "
                             "backend='transformers'")
        rope = text["rope_parameters"]
        full, local = rope["full_attention"], rope["sliding_attention"]
        scaling = None
        if full.get("rope_type", "default") == "linear":
            scaling = (("factor", float(full["factor"])), ("rope_type", "linear"))
        elif full.get("rope_type", "default") != "default":
            raise ValueError(f"rope scaling type {full['rope_type']!r} on gemma3 is not supported "
                             "natively (supported: default, linear); load with backend='transformers'")
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope scaling type {local['rope_type']!r} on gemma3's sliding layers "
                             "is not supported natively; load with backend='transformers'")
        if text.get("hidden_activation") not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {text.get('hidden_activation')!r} on gemma3 is not "
                             "run natively (gelu_pytorch_tanh is); load with backend='transformers'")
        dim = text["hidden_size"]
        return cls(
            vocab_size=text["vocab_size"], dim=dim, n_layers=text["num_hidden_layers"],
            n_heads=text["num_attention_heads"], n_kv_heads=text["num_key_value_heads"],
            head_dim=text["head_dim"], intermediate_size=text["intermediate_size"],
            norm_eps=text["rms_norm_eps"], rope_theta=float(full["rope_theta"]), rope_scaling=scaling,
            qkv_bias=bool(text.get("attention_bias")), qk_norm=True,
            tie_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
            max_position_embeddings=text["max_position_embeddings"], sandwich_norms=True,
            activation="gelu_tanh", embed_scale=dim ** 0.5,
            attn_scale=text["query_pre_attn_scalar"] ** -0.5,
            sliding_window=text["sliding_window"] or 0,
            sliding_layers=tuple(i for i, kind in enumerate(text["layer_types"])
                                 if kind == "sliding_attention") if text["sliding_window"] else (),
            local_rope_theta=float(local["rope_theta"]),
        )


def rope_inv_freq(args: ModelArgs, local: bool = False) -> torch.Tensor:
    """Rotary inverse frequencies [rotated dims / 2] (fp32), with Llama 3 scaling, Phi-3's
    LongRoPE short factors or linear scaling when configured (transformers' arithmetic);
    ``local``: those of the sliding-window layers (base ``local_rope_theta``, unscaled)."""
    d = args.rotated
    base = args.local_rope_theta if local else args.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if args.rope_scaling is None or local:
        return inv_freq
    s = dict(args.rope_scaling)
    if s.get("rope_type", s.get("type")) == "linear":
        return inv_freq / s["factor"]
    if s.get("rope_type", s.get("type")) == "longrope":
        return 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32)
                      * args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_scale(args: ModelArgs) -> float:
    """The factor on cos and sin (LongRoPE's attention factor; else 1)."""
    return float(dict(args.rope_scaling or ()).get("attention_factor", 1.0))


class PackedLinear(nn.Module):
    """``nn.Linear`` with its weight reordered once into oneDNN's blocked layout (CPU only).

    PyTorch's default CPU GEMM is slow for the few-row inputs of decoding: on a 2-core AVX-512
    machine a [5,1536]x[1536,8960] product takes ~2x the time of a single row, which would eat
    the whole gain of a verify pass. oneDNN's ``mkldnn_linear`` on a prepacked weight keeps it
    close to one row (measured on Qwen2.5-1.5B fp32: T(1) 0.36 -> 0.23 s, T(5) 0.73 -> 0.31 s).
    The arithmetic stays fp32 (or bf16 for bf16 weights).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features = linear.out_features
        self.packed = linear.weight.detach().to_mkldnn()
        self.bias = None if linear.bias is None else linear.bias.detach().to_mkldnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._C._nn.mkldnn_linear(x.reshape(-1, shape[-1]).contiguous().to_mkldnn(),
                                       self.packed, self.bias).to_dense()
        return y.view(*shape[:-1], self.out_features)


def _onednn_bf16() -> bool:
    """Whether oneDNN's bf16 linear runs on this CPU (it needs AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; on AVX2-only CPUs ``mkldnn_linear`` raises for bf16)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else False


def pack_linears(module: nn.Module) -> None:
    """Replace every ``nn.Linear`` under ``module`` by a :class:`PackedLinear` (frees the dense
    weight unless something else, e.g. a tied embedding, still holds it)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child))
        else:
            pack_linears(child)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = cpu_kernels(x.device, x.dtype) if self.weight.dtype == torch.float32 else None
        if lib is not None and not (torch.is_grad_enabled() and (
                x.requires_grad or self.weight.requires_grad)):
            # sd_rmsnorm: the bits of the fused layers (models/fused.py); no autograd there
            x = x.contiguous()
            out = torch.empty_like(x)
            lib.sd_rmsnorm(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
                           self.weight.data_ptr(), self.eps, out.data_ptr())
            return out
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, window: int = 0):
        super().__init__()
        self.args = args
        self.window = window  # >0: each query sees the last ``window`` positions only
        hd = args.head_dim
        if args.fused:  # Phi-3: the three in one linear, q rows first, then k, then v
            self.qkv_proj = nn.Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * hd, bias=args.qkv_bias)
        else:
            self.q_proj = nn.Linear(args.dim, args.n_heads * hd, bias=args.qkv_bias)
            self.k_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
            self.v_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(hd, args.norm_eps)
            self.k_norm = RMSNorm(hd, args.norm_eps)

    def forward(self, x, cos, sin, where, mask, cache: KVCache):
        """cos, sin: [T, D] or [B, 1, T, D]; where: see :meth:`~.kv_cache.KVCache.update`; mask: None
        (causal over the new tokens, all cached slots visible, or the last ``window`` of
        them), bool [T, end] or [B, 1, T, end], True where a query sees a key, or
        :class:`~.attention.Prefixes` (for a sliding-window layer: already windowed)."""
        b, t, _ = x.shape
        a = self.args
        if a.fused:
            q, k, v = self.qkv_proj(x).split([a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim,
                                              a.n_kv_heads * a.head_dim], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(b, t, a.n_heads, a.head_dim)
        k = k.reshape(b, t, a.n_kv_heads, a.head_dim)
        if a.qk_norm:  # Qwen3, Gemma 3: each head's query and key normalized, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.reshape(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = cache.update(where, k, v)
        if isinstance(mask, Prefixes):  # decode / verify rows on the CPU: the C++ kernel
            y = attend_rows(mask, q, cache, a.scale)
            return self.o_proj(y.view(b, t, a.n_heads * a.head_dim))
        if t > SDPA_MIN_TOKENS:  # long prefill: the fused kernel
            # in bf16 where the linears of the pass multiply in bf16 (quant.takes_bf16):
            # 4x faster on the tile unit
            dt = torch.bfloat16 if quant.takes_bf16(self.o_proj, x) else q.dtype
            y = F.scaled_dot_product_attention(q.to(dt), k.to(dt), v.to(dt), attn_mask=mask,
                                               enable_gqa=a.n_kv_heads != a.n_heads,
                                               scale=a.scale).to(q.dtype)
        elif mask is None and isinstance(where, int):  # decode / verify of one chain
            y = attend_prefixes(q, k, v, where, a.scale, self.window)
        else:  # rows of their own lengths, trees: grouped matmuls, no copy of the cache
            g = a.n_heads // a.n_kv_heads
            q = q.reshape(b, a.n_kv_heads, g * t, a.head_dim)
            scores = (q @ k.transpose(-1, -2)) * a.scale
            if mask is not None:  # the g query heads of a group are stacked along the T axis
                mask = mask.repeat((1,) * (mask.dim() - 2) + (g, 1))
                scores = scores.masked_fill(~mask, float("-inf"))
            y = (_softmax(scores).to(q.dtype) @ v).view(b, a.n_heads, t, a.head_dim)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, a.n_heads * a.head_dim))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding (the Hugging Face layout, no weight permutation) of the
    first cos.shape[-1] dimensions of each head; the rest pass unrotated (partial rotary)."""
    d = cos.shape[-1]
    if d < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :d], cos, sin), x[..., d:]), dim=-1)
    half = d // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gelu = args.activation == "gelu_tanh"  # GeGLU (Gemma), else SwiGLU
        if args.fused:  # Phi-3: gate rows, then up rows, in one linear
            self.gate_up_proj = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)
        else:
            self.gate_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
            self.up_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x):
        if "gate_up_proj" in self._modules:
            gate, up = (t.contiguous() for t in self.gate_up_proj(x).chunk(2, dim=-1))
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.gelu:
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        lib = cpu_kernels(gate.device, gate.dtype)
        if lib is None or not (gate.is_contiguous() and up.is_contiguous()):
            return self.down_proj(F.silu(gate) * up)
        h = torch.empty_like(gate)  # silu(gate) * up in one pass (sd_silu_mul)
        lib.sd_silu_mul(gate.data_ptr(), up.data_ptr(), gate.numel(), h.data_ptr())
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int = 0):
        super().__init__()
        self.sliding = index in args.sliding_layers
        self.self_attn = Attention(args, args.sliding_window if self.sliding else 0)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        # Llama: the MLP's input norm; with sandwich norms (Gemma) the attention output's
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        if args.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(args.dim, args.norm_eps)
            self.post_feedforward_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, where, mask, cache, attn: bool = True, mlp: bool = True):
        """attn, mlp: False skips that sublayer, the residual stream passing through it
        (SWIFT, arXiv:2410.06916, skips attention and MLP sublayers separately); a skipped
        attention writes nothing to ``cache``."""
        sandwich = "pre_feedforward_layernorm" in self._modules
        if attn:
            h = self.self_attn(self.input_layernorm(x), cos, sin, where, mask, cache)
            x = x + (self.post_attention_layernorm(h) if sandwich else h)
        if not mlp:
            return x
        if sandwich:
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    """Holds the parameters under the ``model.`` prefix, as in transformers checkpoints."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)


FINAL = -1  # the ``output_hidden`` key of the final norm's output (the lm_head's input)

# A draft's LM head (a self-draft's, Medusa heads') covers only the first DRAFT_VOCAB token
# ids of a vocabulary more than twice as large (FR-Spec, arXiv:2502.14856, restricts a
# draft's head to frequent tokens): byte-level BPE numbers its merges in the order it
# learned them, the most frequent pairs first, so the lowest ids are the most used (the
# default target's first 32,768 of 151,936 cover 90-96 % of its answers' tokens:
# docs/EXPERIMENTS.md, a self-draft's head over frequent tokens). Its head then reads a fifth of the bytes; a token outside it is
# never drafted, and the verify pass, which has the whole vocabulary, still emits it: the
# output does not change.
DRAFT_VOCAB = 32768


# where a multimodal checkpoint (Gemma 3 of 4B and up) keeps its text model's weights, by the
# transformers version that saved it, and the towers the text model does not use
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                 "model.multi_modal_projector.")


def hf_text_weights(pairs, config: dict):
    """A Hugging Face checkpoint's (name, tensor) pairs as the native decoder names and
    stores them: a multimodal checkpoint's text model under ``model.`` and ``lm_head.`` (its
    vision tower and projector left out), and Gemma's RMSNorm weights w as 1 + w (Gemma
    multiplies by 1 + w; llama.cpp's converter stores it so, as the decoder reads it).
    Other checkpoints pass unchanged."""
    gemma = config.get("model_type") in ("gemma3", "gemma3_text")
    for name, t in pairs:
        if name.startswith(_OTHER_TOWERS):
            continue
        for prefix, to in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = to + name[len(prefix):]
                break
        if gemma and name.endswith("norm.weight"):
            t = t.float() + 1.0
        yield name, t


def auto_draft_vocab(vocab_size: int) -> int | None:
    """The first token ids a draft's LM head covers by default: ``DRAFT_VOCAB`` for a
    vocabulary more than twice that, else None (all)."""
    return DRAFT_VOCAB if vocab_size > 2 * DRAFT_VOCAB else None


class Transformer(CacheRows, nn.Module):
    """Llama-family decoder with a pointer-rollback KV cache.

    Use: ``allocate(batch, max_len)`` once, then ``forward(input_ids [B,T], num_logits)``
    appends T tokens at positions ``seq_len .. seq_len+T-1`` and returns logits
    [B, num_logits, V] for the last ``num_logits`` of them (fp32 of the model dtype);
    ``rollback(n)`` forgets every position from n on.

    For draft heads, draft trees, layer skipping and batched serving, each row keeps its own
    length (``row_lengths``; ``seq_len`` is their common value) and :meth:`forward_rows` takes
    per-row lengths, explicit positions, a mask over the new tokens, a subset of layers and
    returns hidden states; :meth:`rollback_rows` and :meth:`compact` edit single rows.
    ``forward`` is ``forward_rows(...).logits``: one code path.

    Chunked prefill: more than ``PREFILL_CHUNK`` (512) tokens are run as consecutive forward
    passes of at most 512 tokens, as llama.cpp's default micro-batch (``--ubatch-size``)
    does. On this project's 2-core CPU an 800-token prefill took 11.0 s in 512-token chunks
    against 12.3 s in one pass for the fp32 1.5B target, and 1.47 s against 1.69 s for the
    int8 0.5B draft (medians of 3; 256-token chunks: 11.2 s and 1.58 s): the activations of
    a smaller chunk stay in the CPU's caches. A chunk that ends within ``FUSED_PREFILL_MAX``
    (2,048) slots runs, where the fused layer stack applies (models/fused.py) and the tile
    unit does not take long passes (:func:`quant.bf16_prefill`), as passes of at most
    ``SDPA_MIN_TOKENS - 1`` (64) tokens through the stack: its attention is the decode
    kernel's, row by row, so a prompt's cache has the same bits however it is cut, and it
    is faster than SDPA's passes up to there (docs/EXPERIMENTS.md).
    """

    PREFILL_CHUNK = 512
    FUSED_PREFILL_MAX = 2048

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = _Body(args)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.row_lengths: list[int] = [0]  # valid cached positions per row; replaced, never mutated
        # None while every layer's cache holds row_lengths; after a pass that skipped layers,
        # [layer][row] -> positions that layer holds (see forward_rows' ``layers``)
        self._layer_lengths: list[list[int]] | None = None
        self.max_len = 0
        self.caches: list[KVCache] = []  # one per layer; not registered, see fork()
        self._cos = self._sin = None
        self._local_rope = None  # (cos, sin) of the sliding-window layers, when they differ
        self.weight_format = str(torch.get_default_dtype()).removeprefix("torch.")

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def device(self) -> torch.device:
        """Where the weights and the KV cache live (:class:`~.base.CausalLM`)."""
        return self.model.norm.weight.device

    @property
    def max_context(self) -> int:
        return self.args.max_position_embeddings

    def tie_weights(self):
        if self.args.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def allocate(self, batch: int, max_len: int):
        """(Re)allocate KV buffers for ``batch`` rows of ``max_len`` positions and reset."""
        if max_len > self.args.max_position_embeddings:
            raise ValueError(f"max_len={max_len} exceeds the model's context of "
                             f"{self.args.max_position_embeddings} tokens")
        w = self.model.norm.weight  # the activations' dtype and device (int8 models: fp32)
        a = self.args
        if self.max_len < max_len or not self.caches or self.caches[0].k.shape[0] != batch:
            self.caches = [KVCache(batch, a.n_kv_heads, max_len, a.head_dim, w.dtype, w.device)
                           for _ in range(a.n_layers)]
            self.max_len = max_len
            pos = torch.arange(max_len, dtype=torch.float32, device=w.device)
            scale = rope_scale(a)

            def tables(inv_freq):
                freqs = torch.outer(pos, inv_freq.to(w.device))
                emb = torch.cat((freqs, freqs), dim=-1)
                return (emb.cos() * scale).to(w.dtype), (emb.sin() * scale).to(w.dtype)
            self._cos, self._sin = tables(rope_inv_freq(a))
            self._local_rope = tables(rope_inv_freq(a, local=True)) if a.sliding_layers else None
        self.row_lengths, self._layer_lengths = [0] * batch, None

    def _apply(self, fn, recurse=True):
        # .to(), .float() and the like replace tensors without the assignment hooks that tell
        # the fused layer stack its pointers are stale (models/fused.py): drop it
        self.__dict__.pop("_layer_stack", None)
        return super()._apply(fn, recurse)

    def fork(self) -> "Transformer":
        """A second handle on the same weights with its own (empty) KV cache: lets one model
        be its own draft without the two sharing cache state."""
        other = copy.copy(self)
        other.caches, other.max_len = [], 0
        other.row_lengths, other._layer_lengths = [0], None
        return other

    def self_draft(self, layers: list[int] | None = None,
                   weights: "Transformer | None" = None, vocab: int | str | None = "auto",
                   skip_attn=(), skip_mlp=()) -> "SelfDraft":
        """This model as its own draft model, drafting on its own KV cache: see
        :class:`~.self_draft.SelfDraft`. vocab "auto": :func:`auto_draft_vocab`."""
        if vocab == "auto":
            vocab = auto_draft_vocab(self.args.vocab_size)
        return SelfDraft(self, layers, weights, vocab, skip_attn, skip_mlp)

    def draft_head(self, m: int) -> nn.Module:
        """The LM head over token ids 0..m-1 only (:func:`~specdecode.models.quant.first_rows`:
        each logit the full head's bits for that token), made once and kept while the head's
        tensors stay the same."""
        head = self.lm_head
        key = (m, id(head), *(t.data_ptr() for t in (*head.buffers(), *head.parameters())))
        cached = self.__dict__.get("_draft_head")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_draft_head"] = (key, quant.first_rows(head, m))
        return cached[1]

    @property
    def exact_trees(self) -> bool:
        """Whether a tree pass computes each node's row as a verify pass of its path would
        (tree passes of up to SDPA_MIN_TOKENS tokens on the attention kernel that also runs
        trees, :func:`~.attention.tree_kernel`): trees then keep the exactness chains have, the bits of
        one-token passes on the int8 kernels."""
        w = self.model.norm.weight  # the caches' dtype and device (see allocate)
        return tree_kernel(attention_kernel(w.device, w.dtype, self.args))

    def forward(self, input_ids: torch.Tensor, num_logits: int | None = None) -> torch.Tensor:
        """Append ``input_ids`` [B, T] to every row at seq_len..seq_len+T-1; return fp32
        logits [B, num_logits, V] of the last num_logits positions (all T when None)."""
        return self.forward_rows(input_ids, num_logits=num_logits).logits

    @torch.inference_mode()
    def forward_rows(self, input_ids: torch.Tensor, lengths: list[int] | None = None,
                     num_logits: int | None = None, attn_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None, output_hidden=(),
                     layers: list[int] | None = None, head: nn.Module | None = None,
                     skip_attn=(), skip_mlp=()) -> ForwardOutput:
        """Append new tokens to each row, rows with their own lengths and positions.

        input_ids: [B, T] token ids (B = the allocated batch). Row b appends its first
        ``lengths[b]`` tokens (default T; the rest is padding: computed, never cached) to
        cache slots row_lengths[b] .. row_lengths[b]+lengths[b]-1. Each new token sees all
        of its row's cached positions and, among the new tokens, those ``attn_mask`` allows:
        bool [B, T, T] or [T, T], True at [i, j] where token i sees token j (a draft tree:
        its ancestors and itself; the diagonal must be True); default causal.
        position_ids: int [B, T] or [T], absolute RoPE positions of the new tokens (a tree
        node at depth d: row_lengths[b] + d); default row_lengths[b] + 0..T-1; required with
        attn_mask. Cache slots stay consecutive whatever the positions (see :meth:`compact`).
        num_logits: n in 0..T. Default: logits [B, T, V] aligned with input_ids (padding
        positions unspecified); n: [B, n, V] of each row's last n new tokens, the last at
        index n-1 (entries before a row's first new token unspecified).
        output_hidden: keys of the hidden states to return (see :class:`~.base.ForwardOutput`):
        layer indices in ``layers`` and/or FINAL (-1).
        layers: sorted unique layer indices in 0..n_layers-1 to run, for layer skipping
        (default all). A skipped layer's cache gets nothing for the new positions; a later
        pass that runs that layer raises ValueError until those positions are rolled back
        (draft with a subset, roll back, verify with all layers).
        head: the output layer instead of the model's LM head (a draft's restricted one,
        :meth:`draft_head`): logits [.., m] over its m rows.
        skip_attn, skip_mlp: layers (of those that run) whose attention, or MLP, sublayer is
        skipped, the residual stream passing through it (SWIFT, arXiv:2410.06916). A layer
        whose attention is skipped reads and writes no cache: for the cache it is a skipped
        layer (see ``layers``); one whose MLP only is skipped writes its keys and values as a
        layer that runs.

        Runs in chunks of PREFILL_CHUNK when T exceeds it, unless lengths differ or
        attn_mask is given. Raises ValueError, before anything runs, for input that is not
        [B, T] integer ids in the vocabulary of the allocated batch, lengths or num_logits out
        of range, a cache overflow,
        a mask or positions of the wrong shape, dtype or range, bad layer or hidden keys, or
        a layer whose cache misses positions of a row (see ``layers``).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        starts = self.row_lengths
        if b != len(starts):
            raise ValueError(f"input_ids has {b} rows, the KV cache {len(starts)} "
                             "(allocate(batch, max_len) sets it)")
        if input_ids.is_floating_point() or input_ids.is_complex():
            raise ValueError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        if input_ids.numel():
            low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # one read to the host
            if low < 0 or high >= self.args.vocab_size:
                raise ValueError(f"input_ids hold {low if low < 0 else high}: token ids must be "
                                 f"in 0..{self.args.vocab_size - 1} (the model's vocabulary)")
        if lengths is None:
            lens, ragged = [t] * b, False
        else:
            lens = list(lengths)
            if len(lens) != b:
                raise ValueError(f"got {len(lens)} lengths for {b} rows")
            for row, n in enumerate(lens):
                if not (isinstance(n, int) and 0 <= n <= t):
                    raise ValueError(f"lengths[{row}]={n!r} is out of range (allowed: 0..{t}, "
                                     "the width of input_ids)")
            ragged = lens.count(t) != b
        for row, (s, n) in enumerate(zip(starts, lens)):
            if s + n > self.max_len:
                raise ValueError(f"KV cache overflow: {s}+{n} positions > allocated "
                                 f"{self.max_len}" + (f" in row {row}" if b > 1 else ""))
        n = t if num_logits is None else num_logits
        if not (isinstance(n, int) and 0 <= n <= t):
            raise ValueError(f"num_logits={num_logits!r} is out of range (allowed: 0..{t})")
        skip_attn, skip_mlp = tuple(skip_attn), tuple(skip_mlp)
        run, attn_run = self._check_layers(layers, output_hidden, lens, skip_attn, skip_mlp)
        skip_attn, skip_mlp = frozenset(skip_attn), frozenset(skip_mlp)
        # ids (and masks, positions, built from them) may come from anywhere: the engine makes
        # them on the CPU; they go where the weights are
        input_ids = input_ids.to(self.device)
        dev = input_ids.device
        start_t = valid = None  # rows' starts, non-padding tokens: made where a path needs them
        if attn_mask is not None or position_ids is not None:
            tok = torch.arange(t, device=dev)
            valid = tok < torch.tensor(lens, device=dev)[:, None]
            attn_mask, position_ids = self._check_tree(attn_mask, position_ids, valid)
        step = self._chunk(t, max(starts) + t) if not ragged and attn_mask is None else t
        if t > step:  # see the class docstring
            outs = []
            for s in range(0, t, step):
                e = min(t, s + step)
                pos = None if position_ids is None else position_ids[:, s:e]
                outs.append(self.forward_rows(input_ids[:, s:e], None, max(0, e - max(s, t - n)),
                                              None, pos, output_hidden, layers, head, skip_attn,
                                              skip_mlp))
            hidden = {k: torch.cat([o.hidden[k] for o in outs], 1) for k in outs[0].hidden}
            return ForwardOutput(torch.cat([o.logits for o in outs], 1), hidden)

        s0 = starts[0]
        same_start = starts.count(s0) == b
        if same_start and not ragged:  # the single-request path: slices, no index tensors
            where, end = s0, s0 + t
        else:
            tok = torch.arange(t, device=dev)
            start_t, len_t = torch.tensor(starts, device=dev), torch.tensor(lens, device=dev)
            valid = tok < len_t[:, None]
            rows, toks = valid.nonzero(as_tuple=True)
            end = max(s + n_ for s, n_ in zip(starts, lens))
            where = (rows, start_t[rows] + toks, toks, end)
        if position_ids is None and same_start:
            qpos = torch.arange(s0, s0 + t, device=dev).expand(b, t)

            def rope(cos, sin):
                return cos[s0:s0 + t], sin[s0:s0 + t]
        else:
            pos = start_t[:, None] + tok if position_ids is None else position_ids
            if ragged:  # padding may run past the RoPE table
                pos = pos.masked_fill(~valid, 0)
            qpos = pos

            def rope(cos, sin):
                return cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
        cos, sin = rope(self._cos, self._sin)
        kernel = attention_kernel(dev, self.caches[0].k.dtype, self.args) \
            if t <= SDPA_MIN_TOKENS else None
        if attn_mask is not None and tree_kernel(kernel):  # a tree on the decode kernel
            lens_t, slots_t = tree_slots(attn_mask, starts, valid)
            mask = Prefixes(kernel, lens_t, slots_t)
        elif kernel is not None and attn_mask is None:  # causal, each row its own prefix
            if same_start and not ragged:
                lens_t = torch.arange(s0 + 1, s0 + t + 1).expand(b, t).contiguous()
            else:  # padding queries see slot 0: computed, never used
                lens_t = (start_t[:, None] + tok + 1).masked_fill(~valid, 1)
            mask = Prefixes(kernel, lens_t)
        elif attn_mask is None and same_start and not ragged:
            mask = None  # causal over the new tokens (attend_prefixes); all cached visible
            if t > SDPA_MIN_TOKENS:
                mask = torch.ones(t, end, dtype=torch.bool, device=dev).tril(s0)
        else:
            if same_start and not ragged:
                start_t, len_t = torch.tensor(starts, device=dev), torch.tensor(lens, device=dev)
            tree = attn_mask if attn_mask is not None else \
                torch.ones(t, t, dtype=torch.bool, device=dev).tril()
            rel = torch.arange(end, device=dev) - start_t[:, None]  # [B, end]: slot - row start
            new = (rel >= 0) & (rel < len_t[:, None])
            col = rel.clamp(0, max(t - 1, 0))[:, None].expand(b, t, end)
            sees = tree.expand(b, t, t).gather(2, col)  # [B, T, end]: tree[b, i, slot's offset]
            # padding queries see every slot: never a fully masked (NaN) row
            mask = ((rel < 0)[:, None] | (sees & new[:, None]) | ~valid[:, :, None])[:, None]
        local = self._windowed(mask, qpos, t, dev, start_t, valid)
        local_rope = rope(*self._local_rope) if self._local_rope is not None else (cos, sin)

        x = self.model.embed_tokens(input_ids)
        if self.args.embed_scale != 1.0:  # Gemma: times sqrt(width), in the weights' dtype
            x = x * torch.tensor(self.args.embed_scale, dtype=x.dtype)
        want, hidden = output_hidden, {}
        layer_stack = fused.stack(self) if isinstance(mask, Prefixes) else None
        if layer_stack is not None:  # the same bits in one C call (models/fused.py)
            if same_start and not ragged:
                slots = torch.arange(s0, s0 + t).expand(b, t)
            else:
                slots = (start_t[:, None] + tok).masked_fill(~valid, -1)
            pos = slots if position_ids is None else position_ids
            hidden = {i: x.new_empty(x.shape) for i in run if i in want}
            x = fused.run(self, layer_stack, x, run, self.caches,
                          pos.masked_fill(~valid, 0) if ragged else pos, slots, mask.lens,
                          mask.slots, hidden, skip_attn, skip_mlp)
        else:
            blocks = zip(self.model.layers, self.caches) if layers is None else \
                ((self.model.layers[i], self.caches[i]) for i in layers)
            for i, (layer, cache) in zip(run, blocks):
                if layer.sliding:
                    x = layer(x, *local_rope, where, local, cache, i not in skip_attn, i not in skip_mlp)
                else:
                    x = layer(x, cos, sin, where, mask, cache, i not in skip_attn, i not in skip_mlp)
                if want and i in want:
                    hidden[i] = x
        if want and FINAL in want:
            hidden[FINAL] = self.model.norm(x)
        self._advance(attn_run, layers is not None or bool(skip_attn), lens)

        head = self.lm_head if head is None else head
        if n == 0:
            logits = x.new_zeros(b, 0, head.out_features)
        elif not ragged or num_logits is None:
            logits = head(self.model.norm(x[:, t - n:])).float()
        else:
            idx = (len_t[:, None] - n + torch.arange(n, device=dev)).clamp(min=0)
            x = x.gather(1, idx[:, :, None].expand(b, n, x.shape[-1]))
            logits = head(self.model.norm(x)).float()
        # the engine's side of the model boundary is the CPU (no-ops there): see models/base.py
        return ForwardOutput(logits.cpu(), {key: h.cpu() for key, h in hidden.items()})

    def _windowed(self, mask, qpos: torch.Tensor, t: int, dev, start_t, valid):
        """The mask of the sliding-window layers for a pass whose other layers take ``mask``
        (forward_rows' forms): each query at position p sees the keys at p-window+1..p of
        what ``mask`` shows it. qpos: int64 [B, T] the queries' positions; start_t, valid:
        the rows' starts and non-padding tokens, given with a [B, 1, T, end] mask. None
        stays None: :func:`~.attention.attend_prefixes` windows itself (``Attention.window``)."""
        w = self.args.sliding_window
        if not self.args.sliding_layers or mask is None:
            return mask
        if isinstance(mask, Prefixes):
            return window_prefixes(mask, qpos, w)
        keys = torch.arange(mask.shape[-1], device=dev)
        if mask.dim() == 2:  # [T, end]: one chain's prefill
            return mask & (keys > qpos[0, :, None] - w)
        rel = keys - start_t[:, None]  # a key's position: its slot's, or its new token's
        keypos = torch.where((rel >= 0) & (rel < t), qpos.gather(1, rel.clamp(0, t - 1)), keys)
        sees = (qpos[:, None, :, None] - keypos[:, None, None, :]) < w
        return (mask & sees) | ~valid[:, None, :, None]

    def _chunk(self, t: int, end: int) -> int:
        """The longest pass that a prefill of t tokens a row, ending at slot ``end``, runs as
        (see the class docstring)."""
        if t > self.PREFILL_CHUNK:
            return self.PREFILL_CHUNK
        k = self.caches[0].k
        if t > SDPA_MIN_TOKENS and end <= self.FUSED_PREFILL_MAX and not quant.bf16_prefill() \
                and attention_kernel(k.device, k.dtype, self.args) is not None \
                and fused.stack(self) is not None:
            return SDPA_MIN_TOKENS - 1
        return t

    def _check_layers(self, layers, output_hidden, lens, skip_attn=(), skip_mlp=()
                      ) -> tuple[range | list[int], range | list[int]]:
        """Validate ``layers``, ``output_hidden`` and the skipped sublayers; return the layers
        to run and those of them whose attention runs (which read and write the cache)."""
        nl = self.args.n_layers
        run = range(nl)
        if layers is not None:
            run = list(layers)
            if not all(isinstance(i, int) and 0 <= i < nl for i in run):
                raise ValueError(f"layers={run}: each must be a layer index in 0..{nl - 1}")
            if any(a >= b for a, b in zip(run, run[1:])):
                raise ValueError(f"layers={run} must be sorted and unique")
        for k in output_hidden:
            if not (k == FINAL or (isinstance(k, int) and k in run)):
                raise ValueError(f"output_hidden key {k!r} is not allowed: FINAL (-1) or a layer "
                                 f"that runs ({'0..' + str(nl - 1) if layers is None else run})")
        for name, sub in (("skip_attn", skip_attn), ("skip_mlp", skip_mlp)):
            sub = list(sub)
            if not all(isinstance(i, int) and not isinstance(i, bool) and i in run for i in sub) \
                    or len(set(sub)) != len(sub):
                raise ValueError(f"{name}={sub}: allowed: distinct layers that run "
                                 f"({'0..' + str(nl - 1) if layers is None else run})")
        attn_run = [i for i in run if i not in set(skip_attn)] if skip_attn else run
        if self._layer_lengths is not None:
            for i in attn_run:
                rows = zip(self._layer_lengths[i], self.row_lengths, lens)
                for row, (held, s, n) in enumerate(rows):
                    if n and held != s:
                        raise ValueError(
                            f"layer {i} holds {held} positions of row {row}, which holds {s}: "
                            f"a pass that skipped layer {i} wrote {held}..{s - 1}; roll the row "
                            f"back to {held} before running layer {i}")
        return run, attn_run

    def _check_tree(self, attn_mask, position_ids, valid):
        """Validate the mask and positions of new tokens (``valid`` [B, T]: not padding);
        return them as [B, T, T] bool / [B, T] long (or None)."""
        b, t = valid.shape
        if attn_mask is not None:
            if attn_mask.dtype != torch.bool or attn_mask.shape not in ((t, t), (b, t, t)):
                raise ValueError(f"attn_mask must be bool [{t}, {t}] or [{b}, {t}, {t}], got "
                                 f"{attn_mask.dtype} {list(attn_mask.shape)}")
            attn_mask = attn_mask.to(valid.device).expand(b, t, t)
            if not (attn_mask.diagonal(dim1=1, dim2=2) | ~valid).all():
                raise ValueError("attn_mask must be True on its diagonal (a token sees itself)")
            if position_ids is None:
                raise ValueError("attn_mask needs explicit position_ids (a tree node at depth d "
                                 "sits at position row_length + d)")
        if position_ids is not None:
            if position_ids.is_floating_point() or position_ids.is_complex() or \
                    position_ids.shape not in ((t,), (b, t)):
                raise ValueError(f"position_ids must be integer [{t}] or [{b}, {t}], got "
                                 f"{position_ids.dtype} {list(position_ids.shape)}")
            position_ids = position_ids.to(valid.device, torch.long).expand(b, t)
            p = position_ids[valid]
            if p.numel() and not (p.min() >= 0 and p.max() < self.max_len):
                raise ValueError(f"position_ids span {p.min().item()}..{p.max().item()}: allowed "
                                 f"0..{self.max_len - 1} (the allocated max_len)")
        return attn_mask, position_ids

    def quantize(self, layout: str | None = None, int4: bool = False) -> "Transformer":
        """Turn this float model into the int8 model ``from_pretrained(dtype="int8")`` would
        load (models/quant.py; ``int4``: dtype "int4"'s), in place; returns it. layout: see
        from_pretrained. Raises ValueError for a model whose linears are already packed or
        quantized, or an unknown layout."""
        layout = layout or quant.best_layout("target", self.model.norm.weight.device)
        if any(isinstance(m, (PackedLinear, quant.Int8Linear)) for m in self.modules()):
            raise ValueError("quantize needs a float model with plain nn.Linear layers "
                             "(load it with pack=False)")
        if layout not in quant.LAYOUTS:
            raise ValueError(f"layout {layout!r} is not one of {quant.LAYOUTS}")
        state = quant.quantize_state(self.state_dict().items(), layout, self.args.tie_embeddings,
                                     int4=int4)
        return self._assign_int8(state, layout, "the model's weights", "int4" if int4 else "int8")

    def _assign_int8(self, state: dict, layout: str, what: str, kind: str = "int8") -> "Transformer":
        q4k = quant.q4k_modules(state)
        quant.swap_modules(self, layout, q4k)
        missing, unexpected = self.load_state_dict(state, strict=False, assign=True)
        self._check_loaded(missing, unexpected, ("lm_head.qweight", "lm_head.wscale"), what)
        if self.args.tie_embeddings and layout == "nk" and "lm_head" not in q4k:
            emb = self.model.embed_tokens
            self.lm_head.qweight, self.lm_head.wscale = emb.qweight, emb.wscale
        self.weight_format = f"{kind if kind == 'int4' else 'q4' if q4k else 'int8'}-{layout}"
        return self

    def _check_loaded(self, missing, unexpected, tied: tuple[str, ...], what: str):
        missing = [m for m in missing if not (self.args.tie_embeddings and m in tied)]
        if missing or unexpected:
            raise ValueError(f"{what} do not match the architecture: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | str = torch.float32,
                        pack: bool | None = None, layout: str | None = None) -> "Transformer":
        """Load from a directory holding ``config.json`` and ``*.safetensors`` (transformers
        layout), or from the metadata directory of a GGUF file
        (:func:`~specdecode.models.gguf_file.write_metadata_dir`), whose weights are read
        from the file itself, one tensor at a time.

        dtype: a torch dtype (a float copy of the weights: 4 bytes a parameter in float32),
        or "int8": row-independent W8A8 linears and an int8 embedding (models/quant.py),
        converted from the weights once and cached, never holding a float copy of the
        model. layout: the int8 weights' layout (``quant.LAYOUTS``; default
        ``quant.best_layout("target")``: "vnni" on CPUs with AVX512-VNNI, else "kn"); it
        changes speed only, not a bit of the output. dtype "q4" (a GGUF file only): the
        same, except that every weight the file holds as Q4_K stays those blocks
        (:class:`~specdecode.models.quant.Q4KLinear`) and its other weights become int8,
        read from the file at each load (seconds; not cached).
        dtype "int4": every linear as Q4_K blocks quantized here
        (:func:`~specdecode.models.quant.q4k_quantize`), the embedding table int8: a cheaper
        draft, or a target whose output is its own plain decoding. Both need a Q4_K kernel
        (:func:`~specdecode.models.quant.q4k_kernel`). pack: reorder float linear weights
        for oneDNN (:class:`PackedLinear`); default: when the dtype is float32, or bfloat16
        on a CPU where oneDNN has bf16 kernels (AVX-512 or AVX-NE-CONVERT; elsewhere bf16
        stays ``nn.Linear``).
        Raises ValueError for an unsupported architecture or layout, dtype q4 without a GGUF
        file, pack=True with bfloat16 on a CPU without oneDNN bf16 kernels, weights that do
        not match the architecture, or a GGUF file that is damaged or holds a tensor type not
        read here; FileNotFoundError when the weights lack.
        """
        path = Path(path)
        config = read_json(path / "config.json")
        args = ModelArgs.from_hf_config(config)
        with torch.device("meta"):
            model = cls(args)
        source = gguf_file.source_of(path)
        if source is not None:
            names = list(model.state_dict())
            sources, label = [source], source.stem

            def weights():  # (the header's copy in the directory: no parse)
                return gguf_file.of_directory(path).weights(names, args.n_layers, args.n_heads, args.n_kv_heads)
        else:
            sources, label = sorted(path.glob("*.safetensors")), path.name
            if not sources:
                raise FileNotFoundError(f"no *.safetensors weights in {path}")

            def weights():
                return hf_text_weights(quant.safetensors_weights(sources), config)
        if dtype == "q4" and source is None:
            raise ValueError("dtype q4 keeps the Q4_K blocks of a GGUF file: load the .gguf file "
                             "(or a known model); this directory has safetensors weights")
        if dtype in ("q4", "int4"):
            quant.require_q4k(f"dtype {dtype}")
        if dtype in ("int8", "q4", "int4"):
            layout = layout or quant.best_layout("target")
            if layout not in quant.LAYOUTS:
                raise ValueError(f"layout {layout!r} is not one of {quant.LAYOUTS}")
            what = f"weights of {source or path}"
            state = quant.int8_state(sources, weights, layout, args.tie_embeddings, label, dtype)
            try:
                return model._assign_int8(state, layout, what, dtype).eval()
            except ValueError:  # a cached file of other tensors (edited, or another version)
                with torch.device("meta"):
                    model = cls(args)
                state = quant.int8_state(sources, weights, layout, args.tie_embeddings, label, dtype,
                                         rebuild=True)
                return model._assign_int8(state, layout, what, dtype).eval()
        state = {k: v.float().to(dtype) for k, v in weights()}
        if args.tie_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        model._check_loaded(missing, unexpected, ("lm_head.weight",), f"weights in {source or path}")
        model.tie_weights()
        model.weight_format = str(dtype).removeprefix("torch.")
        if pack is None:
            pack = dtype == torch.float32 or dtype == torch.bfloat16 and _onednn_bf16()
            pack = pack and torch.backends.mkldnn.is_available()
        elif pack and dtype == torch.bfloat16 and not _onednn_bf16():
            raise ValueError("pack=True with bfloat16 weights needs a CPU with AVX-512 (BW, VL, "
                             "DQ) or AVX-NE-CONVERT for oneDNN's bf16 kernels; this one has "
                             "neither: pass pack=False or use dtype float32")
        if pack:
            pack_linears(model)
        return model.eval()

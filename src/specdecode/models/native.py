"""Compact PyTorch decoder for the Llama family (Llama, Qwen2, Mistral, SmolLM2).

The shape follows gpt-fast's ``model.py``: a frozen :class:`ModelArgs`, a preallocated
:class:`KVCache` and a plain forward. What ``transformers`` hides and speculative decoding
needs is explicit here: the cache is a buffer plus a position pointer, so rolling back
rejected draft tokens is ``rollback(n)`` (no copy), and logits can be computed for only the
last positions (prefill needs none).

Parameter names match ``transformers``' Llama/Qwen2/Mistral checkpoints, so a safetensors
file saved by ``save_pretrained`` loads with ``load_state_dict`` unchanged. Logits equal
``transformers``' within fp32 rounding (tested: max abs diff <= 1e-4).
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

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SDPA_MIN_TOKENS = 64  # forwards of more new tokens use the fused attention kernel


@dataclass(frozen=True)
class ModelArgs:
    """Architecture of a Llama-family decoder; built from a Hugging Face ``config.json``.

    The switches that separate the family members: ``qkv_bias`` (Qwen2), ``tie_embeddings``
    (small Qwen2.5, SmolLM2), ``rope_theta`` / ``rope_scaling`` (Llama 3 ``llama3`` scaling),
    ``n_kv_heads < n_heads`` (grouped-query attention).
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
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelArgs.{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelArgs":
        """Build from a ``config.json`` dict of model_type llama, qwen2 or mistral.

        Raises ValueError for other model types (use the transformers adapter for those).
        """
        mt = config.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {mt!r} is not one of the natively supported {SUPPORTED_MODEL_TYPES}; "
                "load it with backend='transformers'")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type not in (None, "default"):
            if rope_type != "llama3":
                raise ValueError(f"rope scaling type {rope_type!r} is not supported natively "
                                 "(supported: default, llama3); load with backend='transformers'")
            scaling = tuple(sorted((k, v) for k, v in rope.items() if k != "rope_theta"))
        n_heads = config["num_attention_heads"]
        dim = config["hidden_size"]
        max_pos = config.get("max_position_embeddings", 4096)
        if mt == "mistral" and config.get("sliding_window"):
            # Full attention equals sliding-window attention up to the window length.
            max_pos = min(max_pos, config["sliding_window"])
        return cls(
            vocab_size=config["vocab_size"],
            dim=dim,
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=config.get("head_dim") or dim // n_heads,
            intermediate_size=config["intermediate_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            qkv_bias=mt == "qwen2" or bool(config.get("attention_bias", False)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=max_pos,
        )


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim/2] (fp32), with Llama 3 scaling when configured."""
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.int64)
                                          .float() / args.head_dim))
    if args.rope_scaling is None:
        return inv_freq
    s = dict(args.rope_scaling)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


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


def quantize_int8(model: nn.Module) -> nn.Module:
    """Dynamic int8 quantization of every ``nn.Linear`` (per-output-channel weight scales,
    activations quantized per call; fbgemm kernels). About 3x faster than fp32 for one-row
    decoding on AVX-512 VNNI CPUs; meant for draft models, whose precision never changes the
    output of speculative decoding, only the acceptance rate."""
    import warnings

    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's notice that the API moves to torchao
        return quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, inplace=True)


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
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class KVCache:
    """Preallocated key/value buffers [B, n_kv_heads, max_len, head_dim] for one layer.

    The number of valid positions is kept by the model (``Transformer.seq_len``), so rolling
    back is moving that pointer; stale entries past it are overwritten by the next forward.
    """

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [B, H_kv, T, D] at positions start..start+T-1; return views up to there."""
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        hd = args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * hd, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.n_heads * hd, args.dim, bias=False)

    def forward(self, x, cos, sin, start: int, mask, cache: KVCache):
        b, t, _ = x.shape
        a = self.args
        q = self.q_proj(x).view(b, t, a.n_heads, a.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = cache.update(start, k, v)
        if t > SDPA_MIN_TOKENS:  # long prefill: the fused kernel
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                               enable_gqa=a.n_kv_heads != a.n_heads)
        else:  # decode / verify: grouped matmuls, no copy of the cache (faster on CPU)
            g = a.n_heads // a.n_kv_heads
            q = q.reshape(b, a.n_kv_heads, g * t, a.head_dim)
            scores = (q @ k.transpose(-1, -2)) * (a.head_dim ** -0.5)
            if mask is not None:
                scores = scores.masked_fill(~mask.repeat(g, 1), float("-inf"))
            # (softmax over a length-1 axis is pathologically slow on CPU in torch 2.13)
            probs = scores.float().softmax(-1) if scores.shape[-1] > 1 else torch.ones_like(scores)
            y = (probs.to(q.dtype) @ v).view(b, a.n_heads, t, a.head_dim)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, a.n_heads * a.head_dim))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding (the Hugging Face layout, no weight permutation)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, start, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    """Holds the parameters under the ``model.`` prefix, as in transformers checkpoints."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)


class Transformer(nn.Module):
    """Llama-family decoder with a pointer-rollback KV cache.

    Use: ``allocate(batch, max_len)`` once, then ``forward(input_ids [B,T], num_logits)``
    appends T tokens at positions ``seq_len .. seq_len+T-1`` and returns logits
    [B, num_logits, V] for the last ``num_logits`` of them (fp32 of the model dtype);
    ``rollback(n)`` forgets every position from n on.

    Chunked prefill: more than ``PREFILL_CHUNK`` (512) tokens are run as consecutive forward
    passes of at most 512 tokens, as llama.cpp's default micro-batch (``--ubatch-size``)
    does. On this project's 2-core CPU an 800-token prefill took 11.0 s in 512-token chunks
    against 12.3 s in one pass for the fp32 1.5B target, and 1.47 s against 1.69 s for the
    int8 0.5B draft (medians of 3; 256-token chunks: 11.2 s and 1.58 s): the activations of
    a smaller chunk stay in the CPU's caches.
    """

    PREFILL_CHUNK = 512

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = _Body(args)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.seq_len = 0
        self.max_len = 0
        self.caches: list[KVCache] = []  # one per layer; not registered, see fork()
        self._cos = self._sin = None

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

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
        w = self.model.embed_tokens.weight
        a = self.args
        if self.max_len < max_len or not self.caches or self.caches[0].k.shape[0] != batch:
            self.caches = [KVCache(batch, a.n_kv_heads, max_len, a.head_dim, w.dtype, w.device)
                           for _ in range(a.n_layers)]
            self.max_len = max_len
            pos = torch.arange(max_len, dtype=torch.float32, device=w.device)
            freqs = torch.outer(pos, rope_inv_freq(a).to(w.device))
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin = emb.cos().to(w.dtype), emb.sin().to(w.dtype)
        self.seq_len = 0

    def fork(self) -> "Transformer":
        """A second handle on the same weights with its own (empty) KV cache: lets one model
        be its own draft without the two sharing cache state."""
        other = copy.copy(self)
        other.caches, other.seq_len, other.max_len = [], 0, 0
        return other

    def rollback(self, length: int):
        """Keep only the first ``length`` cached positions (0 <= length <= seq_len)."""
        if not 0 <= length <= self.seq_len:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.seq_len} positions")
        self.seq_len = length

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, num_logits: int | None = None) -> torch.Tensor:
        b, t = input_ids.shape
        start = self.seq_len
        if start + t > self.max_len:
            raise ValueError(f"KV cache overflow: {start}+{t} positions > allocated {self.max_len}")
        n = t if num_logits is None else num_logits
        if t > self.PREFILL_CHUNK:  # chunked prefill (see the class docstring)
            out = []
            for s in range(0, t, self.PREFILL_CHUNK):
                e = min(t, s + self.PREFILL_CHUNK)
                out.append(self.forward(input_ids[:, s:e], max(0, e - max(s, t - n))))
            return torch.cat(out, 1)
        cos = self._cos[start:start + t]
        sin = self._sin[start:start + t]
        mask = None
        if t > 1:  # causal over the new tokens; every cached position is visible
            mask = torch.ones(t, start + t, dtype=torch.bool, device=input_ids.device).tril(start)
        x = self.model.embed_tokens(input_ids)
        for layer, cache in zip(self.model.layers, self.caches):
            x = layer(x, cos, sin, start, mask, cache)
        self.seq_len = start + t
        if n == 0:
            return x.new_zeros(b, 0, self.args.vocab_size)
        return self.lm_head(self.model.norm(x[:, t - n:])).float()

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | str = torch.float32,
                        pack: bool | None = None) -> "Transformer":
        """Load from a directory holding ``config.json`` and ``*.safetensors`` (transformers layout).

        dtype: a torch dtype, or "int8" for fp32 weights with int8 dynamic quantization of
        the linear layers (:func:`quantize_int8`; drafts only). pack: reorder linear weights
        for oneDNN (:class:`PackedLinear`); default: when the dtype is float32 or bfloat16.
        Raises ValueError for an unsupported architecture, FileNotFoundError when files lack.
        """
        from safetensors.torch import load_file

        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        args = ModelArgs.from_hf_config(config)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {path}")
        with torch.device("meta"):
            model = cls(args)
        state = {}
        for f in files:
            state.update(load_file(f))
        if args.tie_embeddings:
            state.pop("lm_head.weight", None)
        int8 = dtype == "int8"
        dtype = torch.float32 if int8 else dtype
        state = {k: v.to(dtype) for k, v in state.items()}
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        missing = [m for m in missing if not (args.tie_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weights in {path} do not match the {config.get('model_type')} "
                             f"architecture: missing {missing[:5]}, unexpected {unexpected[:5]}")
        model.tie_weights()
        if int8:
            return quantize_int8(model.eval())
        if pack is None:
            pack = dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()
        if pack:
            pack_linears(model)
        return model.eval()

"""Draft heads: small modules on the target's own hidden states that guess the tokens after
the next one, so that drafting costs almost nothing next to a draft model's forward passes.
Two kinds: :class:`MedusaHeads` and :class:`Eagle3Head` (below).

:class:`MedusaHeads` (Medusa-1, Cai et al., arXiv:2401.10774): head i reads the target's
final hidden state h at the last committed token's predecessor (the lm_head input that
predicted that token) and guesses the token i + 1 places after it: a residual block
``x + silu(W x + b)`` (``num_layers`` of them), then a vocabulary projection, its own or the
target's (``original_lm_head``). The directory format is vLLM's Medusa checkpoint
(``vllm/model_executor/models/medusa.py``; docs/methods/heads.md): ``config.json`` with
``"architectures": ["MedusaModel"]`` and ``medusa_fc_bias: true`` (without it vLLM drops the
blocks' biases), and ``model.safetensors`` with ``blocks.{i}.layers.{j}.weight`` / ``.bias``
and ``lm_heads.{i}.weight`` (one ``lm_heads.0.weight`` holding the target's projection when
``original_lm_head`` is true).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from .models import registry
from .models.base import RowsLM, module_device
from .models.loading import save_tensors
from .models.native import ModelArgs, apply_rope, rope_inv_freq
from .models.quant import quantize_linears


MEDUSA_ARCH = "MedusaModel"
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
# each head kind's architecture in config.json, and how messages name such a head
HEAD_ARCHS = {"medusa": MEDUSA_ARCH, "eagle3": EAGLE3_ARCH}
HEAD_NAMES = {"medusa": "Medusa heads", "eagle3": "an EAGLE-3 head"}
# how long the default recipe takes for the 1.5B default target on 2 cores, answers included
# (the messages that offer to train one say it; docs/EXPERIMENTS.md, the draft heads, has
# the measurements)
DEFAULT_HEAD_TIME = "75-105 minutes"


def default_head_dir(target: str, kind: str) -> Path:
    """Where the default ``kind`` head ("medusa" or "eagle3") of ``target`` (a registry name
    or a model directory) lives: <specdecode cache>/heads/NAME-KIND, for a directory its
    base name and a hash of its absolute path. ``specdecode train KIND`` writes there without
    ``--out``; the methods read it without ``head=``. Raises ValueError for another kind."""
    if kind not in HEAD_ARCHS:
        raise ValueError(f"head kind {kind!r} is not one of {list(HEAD_ARCHS)}")
    return registry.cache_dir() / "heads" / f"{cache_name(target)}-{kind}"


def cache_name(model: str) -> str:
    """A model's name in the paths of what is made for it: a registry name as it is, a
    directory's base name and a hash of its absolute path."""
    if model in registry.KNOWN_MODELS:
        return model
    path = Path(model).expanduser().resolve()
    return f"{path.name}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def read_head_dir(path: str | Path, kind: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of the directory of a ``kind`` head ("medusa" or "eagle3"):
    ``config.json`` + ``model.safetensors``. Raises ValueError for a missing or unreadable
    file, or a head of the other kind (naming the method and export that take it)."""
    path = Path(path)
    archs, names = HEAD_ARCHS, HEAD_NAMES
    try:
        config = json.loads((path / "config.json").read_text())
        tensors = load_file(str(path / "model.safetensors"))
    except (OSError, json.JSONDecodeError, RuntimeError) as e:
        reason = f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(f"{path} is not a directory of {names[kind]} (config.json and model.safetensors; "
                         f"`specdecode train {kind} --out DIR` makes one): {reason}") from None
    got = config.get("architectures") if isinstance(config, dict) else None
    if got != [archs[kind]]:
        other = next((k for k, a in archs.items() if got == [a]), None)
        hint = (f"it holds {names[other]}: use {other}:head={path} (specdecode export {other} ...)"
                if other else f"its config.json names architectures {got!r}")
        raise ValueError(f"{path} does not hold {names[kind]} ({archs[kind]}): {hint}")
    return config, tensors


class DraftHead(nn.Module):
    """What both head kinds share: int8 serving."""

    def quantize_(self, layout: str) -> "DraftHead":
        """Replace every linear the head holds (not the target's modules it reads) by its int8
        :class:`~specdecode.models.quant.Int8Linear` in ``layout``, in place: a drafting step
        reads a quarter of the bytes (a step is memory-bound on a CPU: an fp32 EAGLE-3 head is
        about a fifth of an int8 135M target's weights). Drafts only: the output stays the
        target's. Not for training (the int8 weights are buffers). Returns the head."""
        quantize_linears(self, layout)
        return self


class ResidualBlock(nn.Module):
    """``num_layers`` times x <- x + silu(W x + b), W [dim, dim] (Medusa's ResBlock)."""

    def __init__(self, dim: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=True) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + nn.functional.silu(layer(x))
        return x


class MedusaHeads(DraftHead):
    """``num_heads`` Medusa heads over hidden states of size ``dim``.

    lm_head: None to give each head its own projection [vocab_size, dim] (zeros until trained
    or loaded), or the target's projection shared by every head (``original_lm_head``: a head
    is then only its residual block, ``num_layers * dim * (dim + 1)`` parameters): its weight
    [vocab_size, dim] (kept as an fp32 buffer, not saved with the blocks' state: for
    training), or the target's own lm_head module ([..., dim] -> [..., N]; an ``nn.Linear``
    or the int8 / Q4_K linear of a quantized target), read in place, so that serving the
    heads costs no second copy of the vocabulary (0.9 GB in fp32 for the default target) and
    a drafting step reads the target's quantized table once for all heads. A module of N <
    vocab_size outputs covers the first N ids only (the target's
    :meth:`~specdecode.models.native.Transformer.draft_head`, FR-Spec arXiv:2502.14856): the
    other ids get -inf and are never drafted. The blocks start as the identity (zero weights
    and biases), Medusa's initialisation: with the target's projection, every head first
    guesses the token the target itself would predict next.
    Raises ValueError for sizes that are not positive integers, a lm_head weight of another
    shape, or a lm_head module whose in_features is not ``dim``.
    """

    def __init__(self, dim: int, vocab_size: int, num_heads: int, num_layers: int = 1,
                 lm_head: torch.Tensor | nn.Module | None = None):
        super().__init__()
        for name, v in (("dim", dim), ("vocab_size", vocab_size), ("num_heads", num_heads),
                        ("num_layers", num_layers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Medusa {name}={v!r} is invalid; allowed: an integer >= 1")
        if isinstance(lm_head, nn.Module):
            got = (getattr(lm_head, "in_features", None), getattr(lm_head, "out_features", None))
            if got[0] != dim or not isinstance(got[1], int) or got[1] < 1:
                raise ValueError(f"the target's lm_head module maps {got[0]} -> {got[1]} features; "
                                 f"Medusa heads of size {dim} need {dim} -> the token ids: give "
                                 "heads made for this target")
        elif lm_head is not None and tuple(lm_head.shape) != (vocab_size, dim):
            raise ValueError(f"the shared lm_head has shape {tuple(lm_head.shape)}, expected "
                             f"[{vocab_size}, {dim}] (vocab_size, dim)")
        self.dim, self.vocab_size, self.num_layers = dim, vocab_size, num_layers
        self.blocks = nn.ModuleList(ResidualBlock(dim, num_layers) for _ in range(num_heads))
        for p in self.blocks.parameters():
            nn.init.zeros_(p)
        self.original_lm_head = lm_head is not None
        # the target's module, outside the heads' modules: never saved, moved, trained or quantized
        self.__dict__["_target_lm_head"] = lm_head if isinstance(lm_head, nn.Module) else None
        if self.original_lm_head:
            if self._target_lm_head is None:
                self.register_buffer("shared_lm_head", lm_head.detach().float().clone(), persistent=False)
            self.lm_heads = nn.ModuleList()
        else:
            self.lm_heads = nn.ModuleList(nn.Linear(dim, vocab_size, bias=False) for _ in range(num_heads))
            for p in self.lm_heads.parameters():
                nn.init.zeros_(p)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None,
                first_ids: int | None = None) -> torch.Tensor:
        """hidden [..., dim] (the target's final normed hidden states) -> logits
        [num_heads, ..., vocab_size] fp32: head i's guess of the token i + 2 places after the
        hidden state's position. ``num_heads``: the first that many heads only (default all).
        ``first_ids``: logits of token ids 0..first_ids-1 only, [num_heads, ..., first_ids]
        (training over the ids that served heads draft: the target's table scored over
        those rows alone)."""
        if hidden.shape[-1] != self.dim:
            raise ValueError(f"hidden states of size {hidden.shape[-1]} given to Medusa heads of "
                             f"size {self.dim}")
        blocks = self.blocks[:num_heads] if num_heads is not None else self.blocks
        dev = module_device(self.blocks)
        h = hidden.to(dev).float()
        x = torch.stack([block(h) for block in blocks])  # [H, ..., dim]
        own = self._target_lm_head
        if own is not None:  # one pass over the table for every head (a step is memory-bound)
            logits = own(x.to(module_device(own), hidden.dtype))[..., :self.vocab_size].float().to(dev)
            if logits.shape[-1] < self.vocab_size:  # a head over the first ids: the rest never drafted
                logits = nn.functional.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=-torch.inf)
        elif self.original_lm_head:
            logits = x @ self.shared_lm_head[:first_ids].t()
        else:
            logits = torch.stack([head(xi) for head, xi in zip(self.lm_heads, x)])
        return logits if first_ids is None else logits[..., :first_ids]

    def save(self, out: str | Path, dtype: torch.dtype = torch.bfloat16, **extra) -> Path:
        """Write the heads as a vLLM Medusa directory (see the module docstring); ``extra``
        goes into config.json (e.g. what the heads were trained on). Returns the directory."""
        if self._target_lm_head is not None:
            raise ValueError("these Medusa heads read the target's own lm_head module, which they do "
                             "not hold: save the heads built with the target's lm_head weight")
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {f"blocks.{i}.layers.{j}.{kind}": getattr(layer, kind).detach().to(dtype).contiguous()
                   for i, block in enumerate(self.blocks) for j, layer in enumerate(block.layers)
                   for kind in ("weight", "bias")}
        if self.original_lm_head:
            tensors["lm_heads.0.weight"] = self.shared_lm_head.to(dtype).contiguous()
        else:
            tensors.update({f"lm_heads.{i}.weight": h.weight.detach().to(dtype).contiguous()
                            for i, h in enumerate(self.lm_heads)})
        save_tensors(tensors, out / "model.safetensors", metadata={"format": "pt"})
        config = {"architectures": [MEDUSA_ARCH], "model_type": "medusa", "hidden_size": self.dim,
                  "vocab_size": self.vocab_size, "truncated_vocab_size": self.vocab_size,
                  "num_heads": self.num_heads, "num_hidden_layers": self.num_layers,
                  "medusa_fc_bias": True, "original_lm_head": self.original_lm_head,
                  "torch_dtype": str(dtype).removeprefix("torch."), **extra}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return out

    @classmethod
    def load(cls, path: str | Path, lm_head: nn.Module | None = None) -> "MedusaHeads":
        """Heads from a vLLM Medusa directory (fp32); without ``medusa_fc_bias: true`` in its
        config the blocks have no biases, as vLLM loads them. ``lm_head``: the target's own
        lm_head module, which heads with ``original_lm_head`` then read instead of the
        directory's copy of it (ignored for heads with their own projections). A
        ``token_map`` (vLLM's truncated draft vocabulary) is not read: served here, heads
        draft over the target's first ids. Raises ValueError naming what is wrong: a missing
        or unreadable file, another architecture, tensors of the wrong names or shapes, or a
        lm_head module of another size."""
        path = Path(path)
        config, tensors = read_head_dir(path, "medusa")
        try:
            dim, vocab = int(config["hidden_size"]), int(config["vocab_size"])
            heads, layers = int(config["num_heads"]), int(config.get("num_hidden_layers", 1))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}/config.json lacks or has a bad {e}") from None
        # vLLM's truncated draft vocabulary: here heads draft over the target's first ids
        # (methods.heads.loaded_head), which is what heads trained here export as token_map
        tensors.pop("token_map", None)
        shared = tensors.get("lm_heads.0.weight") if config.get("original_lm_head") else None
        if shared is not None and lm_head is not None:
            shared = lm_head
        m = cls(dim, vocab, heads, layers, lm_head=shared.float() if isinstance(shared, torch.Tensor) else shared)
        state = {k: v.float() for k, v in tensors.items() if not (m.original_lm_head and k.startswith("lm_heads."))}
        want = m.state_dict()
        if not config.get("medusa_fc_bias", False):  # vLLM's default: blocks without biases
            state = {k: v for k, v in state.items() if not k.endswith(".bias")}
            state.update({k: torch.zeros_like(t) for k, t in want.items() if k.endswith(".bias")})
        if set(state) != set(want) or any(state[k].shape != want[k].shape for k in want):
            bad = sorted(set(state) ^ set(want)) or [k for k in want if state[k].shape != want[k].shape]
            raise ValueError(f"{path}/model.safetensors does not hold {heads} Medusa heads of "
                             f"size {dim} x {vocab}: check {bad[:4]}")
        m.load_state_dict(state)
        return m


def check_heads_target(target) -> None:
    """Raise ValueError unless ``target`` returns hidden states with its passes (the native
    runtime's ``forward_rows``), which draft heads read."""
    if not isinstance(target, RowsLM):
        raise ValueError(f"draft heads read the target's hidden states, which the native runtime "
                         f"gives; this target is {type(target).__name__} (load it with "
                         "backend='native')")


def aux_layers(n_layers: int) -> list[int]:
    """EAGLE-3's three captured layers for a target of ``n_layers`` decoder layers, as indices
    of our ``output_hidden`` (the residual stream after layer i): vLLM's and SGLang's default
    (transformers ``hidden_states`` indices 2, n/2 and n-3, i.e. the outputs of layers 1,
    n/2-1 and n-4; 1, 13, 24 for 28 layers); none below 7 layers, where they would not be
    three distinct layers."""
    return [1, n_layers // 2 - 1, n_layers - 4] if n_layers >= 7 else []


def draft_vocabulary(counts: torch.Tensor, size: int) -> torch.Tensor:
    """EAGLE-3's reduced draft vocabulary: the ``size`` target ids with the highest
    ``counts`` [V] (ties: the lower id), sorted ascending (int64 [size]). Raises ValueError
    for a size outside 1..V."""
    v = counts.numel()
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= v:
        raise ValueError(f"draft vocabulary size {size!r} is invalid; allowed: 1..{v} (the target's vocabulary)")
    order = torch.sort(-counts.double(), stable=True).indices[:size]  # stable: ties keep the lower id
    return order.sort().values.to(torch.int64)


class Eagle3Head(DraftHead):
    """EAGLE-3 draft head (Li et al., arXiv:2503.01840), in the layout vLLM and SGLang load
    as ``LlamaForCausalLMEagle3`` (docs/methods/heads.md;
    ``vllm/model_executor/models/llama_eagle3.py``).

    One step reads a token id x (its embedding: the target's own, not part of the head) and
    a hidden state h [dim] at RoPE position p:
    ``r = h; a = attn(cat(input_layernorm(emb(x)), hidden_norm(h)), p)`` over the head's KV
    cache, ``r = o_proj(a) + r``, ``pre = mlp(post_attention_layernorm(r)) + r``; the logits
    over the draft vocabulary are ``lm_head(norm(pre))`` and ``pre`` is the h of the next
    step. The first step's h is ``fc(cat(g1, g2, g3))``, the target's residual streams after
    three layers (:func:`aux_layers`) at the position before x.
    The draft vocabulary holds ``draft_ids`` (target ids, ascending): draft id i is target
    id ``i + d2t[i]``; ``t2d`` [V] marks the target ids it holds.

    Built from the target's ModelArgs (heads, head size, RoPE, norm eps) and its embedding:
    a table [V, dim] (kept as an fp32 buffer, not saved: for training), or the target's own
    embedding module (ids [...] -> [..., dim]; an ``nn.Embedding`` or the int8 table of a
    quantized target), read in place, so that serving a head costs no second copy of the
    vocabulary (0.9 GB in fp32 for the default target). ``intermediate_size`` defaults to
    the target's. Raises ValueError for draft ids that are not sorted unique ids below V, or
    an embedding of another shape.
    """

    def __init__(self, args: ModelArgs, draft_ids: torch.Tensor, embed: torch.Tensor | nn.Module,
                 intermediate_size: int | None = None):
        super().__init__()
        ids = torch.as_tensor(draft_ids, dtype=torch.int64)
        v, d = args.vocab_size, args.dim
        if ids.dim() != 1 or not len(ids) or bool((ids[1:] <= ids[:-1]).any()) \
                or int(ids.min()) < 0 or int(ids.max()) >= v:
            raise ValueError(f"draft_ids must be sorted unique target ids in 0..{v - 1}")
        if isinstance(embed, nn.Module):
            dev = module_device(embed)
            try:
                shape = tuple(embed(torch.tensor([v - 1], device=dev)).shape)
            except (IndexError, RuntimeError):
                shape = "fewer rows"
            if shape != (1, d):
                raise ValueError(f"the target embedding module gives {shape} for id {v - 1}, "
                                 f"expected [1, {d}] (a table of {v} rows of {d})")
        elif tuple(embed.shape) != (v, d):
            raise ValueError(f"the target embedding has shape {tuple(embed.shape)}, expected [{v}, {d}]")
        self.args = args
        inter = intermediate_size or args.intermediate_size
        hd, nh, nkv = args.head_dim, args.n_heads, args.n_kv_heads
        self.fc = nn.Linear(3 * d, d, bias=False)
        self.midlayer = nn.Module()
        m = self.midlayer
        m.input_layernorm = nn.RMSNorm(d, eps=args.norm_eps)
        m.hidden_norm = nn.RMSNorm(d, eps=args.norm_eps)
        m.post_attention_layernorm = nn.RMSNorm(d, eps=args.norm_eps)
        m.self_attn = nn.Module()
        m.self_attn.q_proj = nn.Linear(2 * d, nh * hd, bias=False)
        m.self_attn.k_proj = nn.Linear(2 * d, nkv * hd, bias=False)
        m.self_attn.v_proj = nn.Linear(2 * d, nkv * hd, bias=False)
        m.self_attn.o_proj = nn.Linear(nh * hd, d, bias=False)
        m.mlp = nn.Module()
        m.mlp.gate_proj = nn.Linear(d, inter, bias=False)
        m.mlp.up_proj = nn.Linear(d, inter, bias=False)
        m.mlp.down_proj = nn.Linear(inter, d, bias=False)
        self.norm = nn.RMSNorm(d, eps=args.norm_eps)
        self.lm_head = nn.Linear(d, len(ids), bias=False)
        self.register_buffer("d2t", ids - torch.arange(len(ids)))
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[ids] = True
        self.register_buffer("t2d", t2d)
        if isinstance(embed, nn.Module):
            # the target's module, outside the head's modules: never saved, moved or trained
            self.__dict__["_target_embedding"] = embed
            self.embed = None
        else:
            self.__dict__["_target_embedding"] = None
            self.register_buffer("embed", embed.detach().float(), persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    @property
    def embed_device(self) -> torch.device:
        """Where the embedding the head reads lives (the target's, for a module)."""
        own = self._target_embedding
        if own is None:
            return self.embed.device
        return module_device(own)

    @property
    def draft_ids(self) -> torch.Tensor:
        """The target ids of the draft vocabulary, int64 [N] ascending."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., head_dim] for int positions [...]."""
        f = positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq
        f = torch.cat([f, f], dim=-1)
        return f.cos(), f.sin()

    def project(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """The attention inputs of a step: ids [T], hidden [T, dim], positions [T] ->
        q [H, T, hd], k and v [KV, T, hd] (RoPE applied), and the residual [T, dim]."""
        a, m = self.args, self.midlayer
        own = self._target_embedding
        e = self.embed[ids] if own is None else own(ids.to(self.embed_device)).float().to(hidden.device)
        x = torch.cat([m.input_layernorm(e), m.hidden_norm(hidden)], dim=-1)
        cos, sin = self.rope(positions)
        t = len(ids)
        q = m.self_attn.q_proj(x).view(t, a.n_heads, a.head_dim).transpose(0, 1)
        k = m.self_attn.k_proj(x).view(t, a.n_kv_heads, a.head_dim).transpose(0, 1)
        v = m.self_attn.v_proj(x).view(t, a.n_kv_heads, a.head_dim).transpose(0, 1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, hidden

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [H, T, hd] (the attention output), residual [T, dim] -> (pre [T, dim], the
        next step's hidden; logits [T, N] over the draft vocabulary)."""
        m = self.midlayer
        r = m.self_attn.o_proj(attn.transpose(0, 1).reshape(attn.shape[1], -1)) + residual
        x = m.post_attention_layernorm(r)
        pre = m.mlp.down_proj(nn.functional.silu(m.mlp.gate_proj(x)) * m.mlp.up_proj(x)) + r
        return pre, self.lm_head(self.norm(pre))

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Attention scores q [H, T, hd] x k [KV, S, hd] -> [H, T, S] (grouped-query: query
        head h reads key head h // (H / KV)), scaled by 1/sqrt(hd)."""
        g = q.shape[0] // k.shape[0]
        return (q @ k.repeat_interleave(g, dim=0).transpose(1, 2)) * self.args.head_dim ** -0.5

    def mix(self, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention probabilities p [H, T, S] x values v [KV, S, hd] -> [H, T, hd]."""
        return p @ v.repeat_interleave(p.shape[0] // v.shape[0], dim=0)

    def save(self, out: str | Path, dtype: torch.dtype = torch.bfloat16, **extra) -> Path:
        """Write the head as a ``LlamaForCausalLMEagle3`` directory (config.json and
        model.safetensors: exactly the tensors of docs/methods/heads.md's table, weights in
        ``dtype``, d2t int64, t2d bool); ``extra`` goes into config.json. Returns the
        directory."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: (t.to(dtype) if t.is_floating_point() else t).contiguous()
                   for k, t in self.state_dict().items()}
        save_tensors(tensors, out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(self.config(dtype, **extra), indent=2) + "\n")
        return out

    def config(self, dtype: torch.dtype = torch.bfloat16, **extra) -> dict:
        """The config.json of :meth:`save`."""
        a = self.args
        return {"architectures": [EAGLE3_ARCH], "model_type": "llama", "hidden_size": a.dim,
                "intermediate_size": self.midlayer.mlp.gate_proj.out_features, "num_hidden_layers": 1,
                "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads,
                "head_dim": a.head_dim, "hidden_act": "silu",
                # a GGUF's float32 eps (9.999999747e-06) written as the float it stands for
                "rms_norm_eps": float(f"{a.norm_eps:.7g}"),
                "rope_theta": a.rope_theta, "max_position_embeddings": a.max_position_embeddings,
                "attention_bias": False, "tie_word_embeddings": False, "vocab_size": a.vocab_size,
                "draft_vocab_size": len(self.d2t), "torch_dtype": str(dtype).removeprefix("torch."),
                **extra}

    @classmethod
    def load(cls, path: str | Path, args: ModelArgs, embed: torch.Tensor | nn.Module) -> "Eagle3Head":
        """A head from a ``LlamaForCausalLMEagle3`` directory, for the target of ``args`` and
        ``embed`` (its table or module, as for the constructor). Raises ValueError naming what is wrong: a missing or
        unreadable file, another architecture, a head made for another target (hidden size,
        vocabulary, attention shape) or tensors of the wrong names or shapes."""
        path = Path(path)
        config, tensors = read_head_dir(path, "eagle3")
        want = {"hidden_size": args.dim, "vocab_size": args.vocab_size, "num_attention_heads": args.n_heads,
                "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim}
        bad = {k: (config.get(k), v) for k, v in want.items() if config.get(k) != v}
        if bad:
            raise ValueError(f"the EAGLE-3 head in {path} is for another target ("
                             + ", ".join(f"{k} {a!r}, the target's {b!r}" for k, (a, b) in bad.items())
                             + "): give a head made for this target")
        if "d2t" not in tensors or tensors["d2t"].dim() != 1:
            raise ValueError(f"{path}/model.safetensors has no d2t [draft_vocab_size] tensor")
        ids = tensors["d2t"].long() + torch.arange(len(tensors["d2t"]))
        try:
            head = cls(args, ids, embed, int(config.get("intermediate_size", args.intermediate_size)))
        except ValueError as e:
            raise ValueError(f"{path}: its d2t does not map to target ids ({e})") from None
        expect = head.state_dict()
        if set(tensors) != set(expect) or any(tensors[k].shape != expect[k].shape for k in expect):
            wrong = sorted(set(tensors) ^ set(expect)) or [k for k in expect if tensors[k].shape != expect[k].shape]
            raise ValueError(f"{path}/model.safetensors does not hold an EAGLE-3 head for this "
                             f"target: check {wrong[:4]}")
        head.load_state_dict({k: (t.float() if t.is_floating_point() else t) for k, t in tensors.items()})
        return head

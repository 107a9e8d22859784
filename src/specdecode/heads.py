"""Draft heads: small modules on the target's own hidden states that guess the tokens after
the next one, so that drafting costs almost nothing next to a draft model's forward passes.

:class:`MedusaHeads` (Medusa-1, Cai et al., arXiv:2401.10774): head i reads the target's
final hidden state h at the last committed token's predecessor (the lm_head input that
predicted that token) and guesses the token i + 1 places after it: a residual block
``x + silu(W x + b)`` (``num_layers`` of them), then a vocabulary projection, its own or the
target's (``original_lm_head``). The directory format is vLLM's Medusa checkpoint
(``vllm/model_executor/models/medusa.py``; ../shared/docs/HEADS.md): ``config.json`` with
``"architectures": ["MedusaModel"]`` and ``medusa_fc_bias: true`` (without it vLLM drops the
blocks' biases), and ``model.safetensors`` with ``blocks.{i}.layers.{j}.weight`` / ``.bias``
and ``lm_heads.{i}.weight`` (one ``lm_heads.0.weight`` holding the target's projection when
``original_lm_head`` is true).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn


class ResidualBlock(nn.Module):
    """``num_layers`` times x <- x + silu(W x + b), W [dim, dim] (Medusa's ResBlock)."""

    def __init__(self, dim: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=True) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + nn.functional.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """``num_heads`` Medusa heads over hidden states of size ``dim``.

    lm_head: None to give each head its own projection [vocab_size, dim] (zeros until trained
    or loaded), or the target's projection weight [vocab_size, dim], shared by every head
    (``original_lm_head``: a head is then only its residual block, ``num_layers * dim * (dim
    + 1)`` parameters). The blocks start as the identity (zero weights and biases), Medusa's
    initialisation: with the target's projection, every head first guesses the token the
    target itself would predict next.
    Raises ValueError for sizes that are not positive integers or a lm_head of another shape.
    """

    def __init__(self, dim: int, vocab_size: int, num_heads: int, num_layers: int = 1,
                 lm_head: torch.Tensor | None = None):
        super().__init__()
        for name, v in (("dim", dim), ("vocab_size", vocab_size), ("num_heads", num_heads),
                        ("num_layers", num_layers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Medusa {name}={v!r} is invalid; allowed: an integer >= 1")
        if lm_head is not None and tuple(lm_head.shape) != (vocab_size, dim):
            raise ValueError(f"the shared lm_head has shape {tuple(lm_head.shape)}, expected "
                             f"[{vocab_size}, {dim}] (vocab_size, dim)")
        self.dim, self.vocab_size, self.num_layers = dim, vocab_size, num_layers
        self.blocks = nn.ModuleList(ResidualBlock(dim, num_layers) for _ in range(num_heads))
        for p in self.blocks.parameters():
            nn.init.zeros_(p)
        self.original_lm_head = lm_head is not None
        if self.original_lm_head:
            self.register_buffer("shared_lm_head", lm_head.detach().float().clone(), persistent=False)
            self.lm_heads = nn.ModuleList()
        else:
            self.lm_heads = nn.ModuleList(nn.Linear(dim, vocab_size, bias=False) for _ in range(num_heads))
            for p in self.lm_heads.parameters():
                nn.init.zeros_(p)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., dim] (the target's final normed hidden states) -> logits
        [num_heads, ..., vocab_size] fp32: head i's guess of the token i + 2 places after the
        hidden state's position."""
        if hidden.shape[-1] != self.dim:
            raise ValueError(f"hidden states of size {hidden.shape[-1]} given to Medusa heads of "
                             f"size {self.dim}")
        h = hidden.float()
        outs = []
        for i, block in enumerate(self.blocks):
            x = block(h)
            outs.append(x @ self.shared_lm_head.t() if self.original_lm_head else self.lm_heads[i](x))
        return torch.stack(outs)

    def save(self, out: str | Path, dtype: torch.dtype = torch.bfloat16, **extra) -> Path:
        """Write the heads as a vLLM Medusa directory (see the module docstring); ``extra``
        goes into config.json (e.g. what the heads were trained on). Returns the directory."""
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
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": self.dim,
                  "vocab_size": self.vocab_size, "truncated_vocab_size": self.vocab_size,
                  "num_heads": self.num_heads, "num_hidden_layers": self.num_layers,
                  "medusa_fc_bias": True, "original_lm_head": self.original_lm_head,
                  "torch_dtype": str(dtype).removeprefix("torch."), **extra}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return out

    @classmethod
    def load(cls, path: str | Path) -> "MedusaHeads":
        """Heads from a vLLM Medusa directory (fp32); without ``medusa_fc_bias: true`` in its
        config the blocks have no biases, as vLLM loads them. Raises ValueError naming what is wrong:
        a missing or unreadable file, another architecture, or tensors of the wrong names or
        shapes."""
        path = Path(path)
        try:
            config = json.loads((path / "config.json").read_text())
            tensors = load_file(str(path / "model.safetensors"))
        except (OSError, json.JSONDecodeError, RuntimeError) as e:
            raise ValueError(f"{path} is not a Medusa heads directory: {e}") from None
        if not isinstance(config, dict) or config.get("architectures") != ["MedusaModel"]:
            got = config.get("architectures") if isinstance(config, dict) else config
            raise ValueError(f"{path}/config.json is for {got!r}, not ['MedusaModel']")
        try:
            dim, vocab = int(config["hidden_size"]), int(config["vocab_size"])
            heads, layers = int(config["num_heads"]), int(config.get("num_hidden_layers", 1))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}/config.json lacks or has a bad {e}") from None
        shared = tensors.get("lm_heads.0.weight") if config.get("original_lm_head") else None
        m = cls(dim, vocab, heads, layers, lm_head=shared.float() if shared is not None else None)
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
    if not hasattr(target, "forward_rows"):
        raise ValueError(f"draft heads read the target's hidden states, which the native runtime "
                         f"gives; this target is {type(target).__name__} (load it with "
                         "backend='native')")

"""Row-independent int8 weights and activations (W8A8) for the native decoder.

Speculative decoding is lossless only if the rows of a verify pass equal one-token passes.
A dynamically quantized linear that picks one activation scale for the whole call (fbgemm's
``quantize_dynamic``) breaks that: a row's output depends on the other rows. Here every row
(token) is quantized on its own, symmetric, with the scale max|x|/127, and the int8 x int8
product accumulates in int32 (``torch._int_mm``), which is exact whatever the order, so a row
comes out bit for bit the same alone or in a batch. The weight is int8 with one symmetric
scale per output channel, as in LLM.int8()/SmoothQuant's W8A8 (arXiv 2208.07339,
2211.10438) without their outlier handling. The integer product costs nearly the same for 1
and 16 rows on a VNNI CPU, which is what a verify pass wants.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from . import registry

QMAX = 127  # symmetric int8: -127..127 (no -128, so negation stays in range)
FORMAT_VERSION = 1  # of the cached int8 weights; bump when quantize_state changes


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization with one scale per row.

    w: float [N, K]. Returns (q int8 [N, K], scale fp32 [N]) with w ~= q * scale[:, None];
    an all-zero row gets scale 1 (its q is 0).
    """
    w = w.float()
    amax = w.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


LAYOUTS = ("kn", "nk")


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with int8 W (per-output-channel scales) and per-row int8 activations.

    x: float [..., in_features] (fp32 or bf16) -> [..., out_features] in x's dtype, computed
    in fp32 from the exact int32 product. Each row of x is quantized alone (see the module
    docstring), so every output row depends only on its own input row, bit for bit.

    ``layout`` only changes speed, never a bit of the result (integer products are exact):
    "kn" stores the weight as [in, out], for which ``torch._int_mm`` costs nearly the same
    for 1 and 16 rows (a target's verify pass); "nk" stores [out, in] (``nn.Linear``'s
    layout, shareable with a tied embedding), about 1.5x faster for one row and 1.4x slower
    for several (a draft's one-token steps). Buffers: ``qweight`` int8 in that layout,
    ``wscale`` fp32 [out], ``bias`` fp32 [out] or None. Built by :meth:`from_float`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, layout: str = "kn",
                 device=None):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
        self.in_features, self.out_features, self.layout = in_features, out_features, layout
        shape = (in_features, out_features) if layout == "kn" else (out_features, in_features)
        self.register_buffer("qweight", torch.empty(shape, dtype=torch.int8, device=device))
        self.register_buffer("wscale", torch.empty(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=torch.float32, device=device)
                             if bias else None)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   layout: str = "kn") -> "Int8Linear":
        """Quantize a float weight [out, in] (and bias [out]) of an ``nn.Linear``."""
        out_f, in_f = weight.shape
        m = cls(in_f, out_f, bias is not None, layout, device=weight.device)
        q, m.wscale = quantize_rows(weight)
        m.qweight = q.t().contiguous() if layout == "kn" else q
        if bias is not None:
            m.bias = bias.detach().float()
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        amax = x2.abs().amax(dim=-1, keepdim=True)
        xs = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
        xq = torch.round(x2 / xs).clamp_(-QMAX, QMAX).to(torch.int8)
        w = self.qweight if self.layout == "kn" else self.qweight.t()
        y = torch._int_mm(xq, w).float() * xs * self.wscale
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"layout={self.layout}, W8A8 per-row")


class Int8Embedding(nn.Module):
    """Embedding table stored as int8 rows with one fp32 scale per token (4x smaller than
    fp32). ids: int [...] -> fp32 [..., dim], row id = qweight[id] * wscale[id]."""

    def __init__(self, num_embeddings: int, dim: int, device=None):
        super().__init__()
        self.register_buffer("qweight", torch.empty(num_embeddings, dim, dtype=torch.int8,
                                                    device=device))
        self.register_buffer("wscale", torch.empty(num_embeddings, dtype=torch.float32,
                                                   device=device))

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "Int8Embedding":
        m = cls(*weight.shape, device=weight.device)
        m.qweight, m.wscale = quantize_rows(weight)
        return m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].float() * self.wscale[ids].unsqueeze(-1)


def swap_modules(model: nn.Module, layout: str) -> None:
    """Replace every ``nn.Linear`` under ``model`` by an empty :class:`Int8Linear` of the
    given layout and every ``nn.Embedding`` by an empty :class:`Int8Embedding`, on the same
    device: for a model built on the meta device whose :func:`quantize_state` is loaded next
    (``load_state_dict(..., assign=True)``)."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child.in_features, child.out_features,
                                            child.bias is not None, layout, child.weight.device))
        elif isinstance(child, nn.Embedding):
            setattr(model, name, Int8Embedding(child.num_embeddings, child.embedding_dim,
                                               child.weight.device))
        else:
            swap_modules(child, layout)


def quantize_linears(model: nn.Module, layout: str = "nk") -> nn.Module:
    """Replace every ``nn.Linear`` of a loaded float model (any architecture, e.g. a
    transformers model) by its :class:`Int8Linear`, in place; returns ``model``."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear.from_float(child.weight.detach(), child.bias, layout))
        else:
            quantize_linears(child, layout)
    return model


def quantize_state(tensors: Iterable[tuple[str, torch.Tensor]], layout: str,
                   tie_embeddings: bool) -> dict[str, torch.Tensor]:
    """The int8 state dict of a Llama-family checkpoint, one tensor at a time.

    tensors: (name, tensor) pairs in transformers naming. Every 2-D ``*.weight`` becomes
    ``*.qweight`` int8 + ``*.wscale`` fp32 [rows] (``model.embed_tokens`` row-major, the
    linears in ``layout``); everything else (norms, biases) becomes fp32. With tied
    embeddings the checkpoint's ``lm_head.weight`` is ignored; in layout "kn" the lm_head
    gets its own transposed copy of the embedding's int8 table, in "nk" none (the loader
    ties the two)."""
    state: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        if name == "lm_head.weight" and tie_embeddings:
            continue
        if name.endswith(".weight") and t.dim() == 2:
            base = name[: -len(".weight")]
            q, state[base + ".wscale"] = quantize_rows(t)
            row_major = layout == "nk" or base.endswith("embed_tokens")
            state[base + ".qweight"] = q if row_major else q.t().contiguous()
        else:
            state[name] = t.float()
    if tie_embeddings and layout == "kn":
        state["lm_head.qweight"] = state["model.embed_tokens.qweight"].t().contiguous()
        state["lm_head.wscale"] = state["model.embed_tokens.wscale"].clone()
    return state


def _stream(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        with safe_open(f, "pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def int8_state(files: list[Path], layout: str, tie_embeddings: bool,
               progress: bool = True) -> dict[str, torch.Tensor]:
    """:func:`quantize_state` of the float safetensors ``files``, cached on disk.

    The first call streams the files (one float tensor in memory at a time: no float copy
    of the model) and writes ``<specdecode cache>/int8/<dir>-<key>.safetensors`` (key: the
    files' paths, sizes and mtimes, the layout, the tying, FORMAT_VERSION); later calls read
    it (about 1 byte per parameter). A cache file that cannot be read is rebuilt; one that
    cannot be written is skipped with a note on stderr. Raises SafetensorError/OSError for
    unreadable source files.
    """
    ident = [FORMAT_VERSION, layout, tie_embeddings]
    for f in files:
        st = f.resolve().stat()
        ident += [str(f.resolve()), st.st_size, st.st_mtime_ns]
    key = hashlib.sha256(repr(ident).encode()).hexdigest()[:16]
    path = registry.cache_dir() / "int8" / f"{files[0].parent.name}-{key}.safetensors"
    if path.is_file():
        try:
            return load_file(path)
        except (SafetensorError, OSError):
            path.unlink(missing_ok=True)
    if progress:
        print(f"quantizing {files[0].parent.name} to int8 (once; cached in {path.parent})...",
              file=sys.stderr)
    state = quantize_state(_stream(files), layout, tie_embeddings)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(state, tmp, metadata={"format": f"specdecode-int8-{FORMAT_VERSION}"})
        os.replace(tmp, path)
    except OSError as e:
        print(f"note: could not cache the int8 weights in {path.parent} ({e}); they will be "
              "quantized again next time", file=sys.stderr)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return state

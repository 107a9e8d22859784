"""Row-independent int8 weights and activations (W8A8) for the native decoder.

Speculative decoding is lossless only if the rows of a verify pass equal one-token passes.
A dynamically quantized linear that picks one activation scale for the whole call (fbgemm's
``quantize_dynamic``) breaks that: a row's output depends on the other rows. Here every row
(token) is quantized on its own, symmetric, with the scale max|x|/127, and the int8 x int8
product accumulates in int32 (``torch._int_mm``), which is exact whatever the order, so a row
comes out bit for bit the same alone or in a batch. The weight is int8 with one symmetric
scale per output channel, as in LLM.int8()/SmoothQuant's W8A8 (arXiv 2208.07339,
2211.10438) without their outlier handling.

Two kernels compute the same bits. On x86 CPUs with AVX512-VNNI, ``int8_vnni.cpp`` (built
with the system C++ compiler at first use and cached, loaded with ctypes) streams weights
packed for ``vpdpbusd`` once for up to 8 rows, the shape of a verify pass; elsewhere
``torch._int_mm``. Set ``SPECDECODE_INT8_KERNEL=torch`` to use the latter anyway.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from . import registry

QMAX = 127  # symmetric int8: -127..127 (no -128, so negation stays in range)
FORMAT_VERSION = 2  # of the cached int8 weights; bump when quantize_state changes
KERNEL_SOURCE = Path(__file__).with_name("int8_vnni.cpp")
KERNEL_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-fopenmp",
                "-ffp-contract=off", "-shared", "-fPIC")
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")


@functools.cache
def vnni_kernel() -> tuple[ctypes.CDLL | None, str]:
    """The compiled ``int8_vnni.cpp`` and "", or None and why it is not used.

    Built once per source and compiler into ``<specdecode cache>/kernels/`` (about a second
    with g++), then loaded from there. Never raises: a CPU without AVX512-VNNI, no C++
    compiler, a failed build, or ``SPECDECODE_INT8_KERNEL=torch`` give None (the
    ``torch._int_mm`` path computes the same bits).
    """
    if os.environ.get("SPECDECODE_INT8_KERNEL", "").lower() == "torch":
        return None, "SPECDECODE_INT8_KERNEL=torch"
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"not an x86-64 CPU ({platform.machine()})"
    try:
        flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo")
                      if ln.startswith("flags")), [])
    except OSError:
        flags = []
    lacking = [f for f in _CPU_FLAGS if f not in flags]
    if lacking:
        return None, f"the CPU lacks {', '.join(lacking)}"
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        return None, "no C++ compiler (install g++)"
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
        key = hashlib.sha256(KERNEL_SOURCE.read_bytes() + repr((KERNEL_FLAGS, version)).encode())
        out = registry.cache_dir() / "kernels" / f"int8_vnni-{key.hexdigest()[:16]}.so"
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
                built = Path(tmp) / out.name
                proc = subprocess.run([cxx, *KERNEL_FLAGS, "-o", str(built), str(KERNEL_SOURCE)],
                                      capture_output=True, text=True, timeout=600)
                if proc.returncode != 0:
                    return None, f"{cxx} failed: {proc.stderr.strip()[-300:]}"
                os.replace(built, out)
        lib = ctypes.CDLL(str(out))
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building or loading the kernel failed: {e}"
    P, I = ctypes.c_void_p, ctypes.c_int64
    lib.sd_quantize_rows.argtypes = [P, I, I, P, P, P]
    lib.sd_quantize_rows.restype = None
    lib.sd_int8_linear.argtypes = [P, P, P, I, I, P, P, P, I, P]
    lib.sd_int8_linear.restype = None
    return lib, ""


def vnni_fits(in_features: int, out_features: int) -> bool:
    """Whether the VNNI kernel takes a linear of this shape (both multiples of 16)."""
    return in_features % 16 == 0 and out_features % 16 == 0


def best_layout(role: str, device: torch.device | str = "cpu") -> str:
    """The fastest layout for a target's verify passes (role "target") or a draft's
    one-token steps ("draft") on ``device``: "vnni" where the kernel runs, else "kn" / "nk"."""
    if torch.device(device).type == "cpu" and vnni_kernel()[0] is not None:
        return "vnni"
    return "kn" if role == "target" else "nk"


def pack(q: torch.Tensor, layout: str) -> torch.Tensor:
    """An int8 weight [out, in] in the storage of ``layout`` (see :class:`Int8Linear`)."""
    if layout == "nk":
        return q
    if layout == "kn":
        return q.t().contiguous()
    n, k = q.shape
    u = (q.to(torch.int16) + 128).to(torch.uint8)
    return u.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()


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


LAYOUTS = ("vnni", "kn", "nk")


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with int8 W (per-output-channel scales) and per-row int8 activations.

    x: float [..., in_features] (fp32 or bf16) -> [..., out_features] in x's dtype, computed
    in fp32 from the exact int32 product. Each row of x is quantized alone (see the module
    docstring), so every output row depends only on its own input row, bit for bit.

    ``layout`` only changes speed, never a bit of the result (integer products are exact,
    and both kernels take the same float steps): "vnni" packs the weight for the AVX512-VNNI
    kernel (``qweight`` uint8 [out/16, in/4, 16, 4] holding w + 128; shapes of multiples of
    16, else it falls back to "kn"), fastest for 1 to 17 rows; the ``torch._int_mm`` layouts
    "kn" ([in, out]: nearly the same cost for 1 and 16 rows) and "nk" ([out, in]: faster for
    one row, slower for several). Buffers: ``qweight``, ``wscale`` fp32 [out], ``bias`` fp32
    [out] or None. Built by :meth:`from_float`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, layout: str = "kn",
                 device=None):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
        if layout == "vnni" and not vnni_fits(in_features, out_features):
            layout = "kn"
        self.in_features, self.out_features, self.layout = in_features, out_features, layout
        shape, dtype = {"kn": ((in_features, out_features), torch.int8),
                        "nk": ((out_features, in_features), torch.int8),
                        "vnni": ((out_features // 16, in_features // 4, 16, 4), torch.uint8)}[layout]
        self.register_buffer("qweight", torch.empty(shape, dtype=dtype, device=device))
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
        m.qweight = pack(q, m.layout)
        if bias is not None:
            m.bias = bias.detach().float()
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        lib = vnni_kernel()[0] if self.layout == "vnni" else None
        if lib is not None and x2.device.type == "cpu":
            x2 = x2.contiguous()
            m, k, n = x2.shape[0], self.in_features, self.out_features
            xq = torch.empty(m, k, dtype=torch.int8)
            xs, xsum = torch.empty(m), torch.empty(m, dtype=torch.int32)
            y = torch.empty(m, n)
            lib.sd_quantize_rows(x2.data_ptr(), m, k, xq.data_ptr(), xs.data_ptr(), xsum.data_ptr())
            lib.sd_int8_linear(xq.data_ptr(), xs.data_ptr(), xsum.data_ptr(), m, k,
                               self.qweight.data_ptr(), self.wscale.data_ptr(),
                               0 if self.bias is None else self.bias.data_ptr(), n, y.data_ptr())
            return y.to(x.dtype).view(*shape[:-1], n)
        amax = x2.abs().amax(dim=-1, keepdim=True)
        xs = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
        xq = torch.round(x2 / xs).clamp_(-QMAX, QMAX).to(torch.int8)
        y = torch._int_mm(xq, self.weight_kn()).float() * xs * self.wscale
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def weight_kn(self) -> torch.Tensor:
        """The int8 weight as an [in, out] matrix (a view, or a copy for "vnni")."""
        if self.layout == "kn":
            return self.qweight
        if self.layout == "nk":
            return self.qweight.t()
        w = (self.qweight.to(torch.int16) - 128).to(torch.int8)  # [out/16, in/4, 16, 4]
        return w.permute(1, 3, 0, 2).reshape(self.in_features, self.out_features)

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
            if base.endswith("embed_tokens"):
                state[base + ".qweight"] = q
            else:
                lay = layout if layout != "vnni" or vnni_fits(t.shape[1], t.shape[0]) else "kn"
                state[base + ".qweight"] = pack(q, lay)
        else:
            state[name] = t.float()
    if tie_embeddings and layout != "nk":
        q = state["model.embed_tokens.qweight"]
        lay = layout if layout != "vnni" or vnni_fits(q.shape[1], q.shape[0]) else "kn"
        state["lm_head.qweight"] = pack(q, lay)
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

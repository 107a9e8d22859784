"""Row-independent int8 weights and activations (W8A8) for the native decoder.

Speculative decoding is lossless only if the rows of a verify pass equal one-token passes.
A dynamically quantized linear that picks one activation scale for the whole call (fbgemm's
``quantize_dynamic``) breaks that: a row's output depends on the other rows. Here every row
(token) is quantized on its own, symmetric, with the scale max|x|/127, and the int8 x int8
product accumulates in int32 (``torch._int_mm``), which is exact whatever the order, so a row
comes out bit for bit the same alone or in a batch. The weight is int8 with one symmetric
scale per output channel, as in LLM.int8()/SmoothQuant's W8A8 (arXiv 2208.07339,
2211.10438) without their outlier handling.

Two kernels compute the same bits. On x86 CPUs with AVX512-VNNI, ``cpu_kernels.cpp`` (built
with the system C++ compiler at first use and cached, loaded with ctypes) streams weights
packed for ``vpdpbusd`` once for up to 8 rows, the shape of a verify pass, and on CPUs
with AMX-INT8 runs passes of a few rows (int8 2+, Q4_K 9+) on the tile unit (the same integer
sums, the same float steps: the same bits; :func:`set_amx`, ``SPECDECODE_AMX=0`` to keep to
AVX512); on CPUs with AVX2 only, ``cpu_kernels_avx2.cpp`` (the same integer sums for the
"nk" layout, and the Q4_K linears with the AVX512 kernel's bits, :func:`avx2_kernel`);
elsewhere ``torch._int_mm`` (and no Q4_K: :func:`q4k_kernel`). Set
``SPECDECODE_INT8_KERNEL=torch`` to use the latter anyway.

Long passes (prefill chunks: more than ``PREFILL_MIN_TOKENS`` tokens a row, never a verify
pass) are bound by arithmetic, not by reading the weights: on CPUs with AMX-BF16 they
multiply in bf16 on the tile unit, the weights dequantized panel by panel in the kernel,
faster than the integer kernels and closer to the unquantized product (no int8
activations); each row's bits are still its own (:func:`_bf16_linear`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from . import gguf_file, registry

QMAX = 127  # symmetric int8: -127..127 (no -128, so negation stays in range)
FORMAT_VERSION = 2  # of the cached int8 weights; bump when quantize_state changes
KERNEL_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
KERNEL_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-fopenmp",
                "-ffp-contract=off", "-shared", "-fPIC")
AMX_FLAGS = ("-mamx-tile", "-mamx-int8", "-mamx-bf16")  # only the tile code uses them; dropped if g++ lacks them
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")


@functools.cache
def cpu_flags() -> tuple[str, ...]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()  # read and closed (was left open)
        return tuple(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    except OSError:
        return ()


@functools.cache
def vnni_kernel() -> tuple[ctypes.CDLL | None, str]:
    """The compiled ``cpu_kernels.cpp`` and "", or None and why it is not used.

    Built once per source and compiler into ``<specdecode cache>/kernels/`` (about a second
    with g++), then loaded from there. Never raises: a CPU without AVX512-VNNI, no C++
    compiler, a failed build, or ``SPECDECODE_INT8_KERNEL=torch`` give None (the
    ``torch._int_mm`` path computes the same bits).
    """
    if os.environ.get("SPECDECODE_INT8_KERNEL", "").lower() == "torch":
        return None, "SPECDECODE_INT8_KERNEL=torch"
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"not an x86-64 CPU ({platform.machine()})"
    flags = cpu_flags()
    lacking = [f for f in _CPU_FLAGS if f not in flags]
    if lacking:
        return None, f"the CPU lacks {', '.join(lacking)}"
    lib, why = _compiled(KERNEL_SOURCE, (KERNEL_FLAGS + AMX_FLAGS, KERNEL_FLAGS))
    if lib is None:
        return _unavailable(why)
    P, I = ctypes.c_void_p, ctypes.c_int64
    lib.sd_int8_linear_x.argtypes = [P, I, I, P, P, P, I, P]
    lib.sd_int8_linear_x.restype = None
    lib.sd_q4k_linear_x.argtypes = [P, I, I, I, P, P, P, P, P, P, I, P]
    lib.sd_q4k_linear_x.restype = None
    lib.sd_attend.argtypes = [P, I, I, I, I, I, I, I, P, P, I, I, P, ctypes.c_float, P]
    lib.sd_attend.restype = None
    lib.sd_attend_slots.argtypes = [P, I, I, I, I, I, I, I, P, P, I, I, P, P, I, ctypes.c_float, P]
    lib.sd_attend_slots.restype = None
    lib.sd_silu_mul.argtypes = [P, P, I, P]
    lib.sd_silu_mul.restype = None
    _layer_argtypes(lib, "sd_layers")
    _convert_argtypes(lib)
    lib.sd_int8_linear_bf16.argtypes = [P, I, I, P, P, P, I, P]
    lib.sd_int8_linear_bf16.restype = None
    lib.sd_q4k_linear_bf16.argtypes = [P, I, I, I, P, P, P, P, P, P, I, P]
    lib.sd_q4k_linear_bf16.restype = None
    lib.sd_amx_bf16_in_use.argtypes = []
    lib.sd_amx_bf16_in_use.restype = ctypes.c_int
    lib.sd_set_amx.argtypes = [ctypes.c_int]
    lib.sd_set_amx.restype = ctypes.c_int
    lib.sd_amx_in_use.argtypes = []
    lib.sd_amx_in_use.restype = ctypes.c_int
    lib.sd_set_amx(int(os.environ.get("SPECDECODE_AMX", "1") != "0"))
    return lib, ""


AVX2_SOURCE = Path(__file__).with_name("cpu_kernels_avx2.cpp")
AVX2_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")


def avx2_kernel() -> ctypes.CDLL | None:
    """The kernels of CPUs with AVX2 but not the AVX512-VNNI kernel (:func:`avx2_library`);
    None where the VNNI kernel is in use, or with ``SPECDECODE_INT8_KERNEL=torch``."""
    if vnni_kernel()[0] is not None or os.environ.get("SPECDECODE_INT8_KERNEL", "").lower() == "torch":
        return None
    return avx2_library()


@functools.cache
def avx2_library() -> ctypes.CDLL | None:
    """The compiled ``cpu_kernels_avx2.cpp`` (the exact int8 product, the Q4_K linear,
    attention and silu), built and cached as :func:`vnni_kernel` is, on any x86-64 CPU with
    AVX2, FMA and F16C (every AVX2 CPU from Intel and AMD has all three); None on
    other CPUs, without a C++ compiler, or when the build fails (said once on stderr)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = cpu_flags()
    if "avx2" not in flags or "fma" not in flags or "f16c" not in flags:
        return None
    lib, why = _compiled(AVX2_SOURCE, (AVX2_FLAGS,))
    if lib is None:
        print(f"note: the AVX2 kernel is not in use ({why}); meanwhile int8 runs on "
              "torch._int_mm, many times slower, and q4 and int4 are unavailable", file=sys.stderr)
        return None
    P, I = ctypes.c_void_p, ctypes.c_int64
    lib.sd_int8_mm_nk.argtypes = [P, I, I, P, I, P]
    lib.sd_int8_mm_nk.restype = None
    lib.sd_int8_linear_nk_x.argtypes = [P, I, I, P, P, P, I, P]
    lib.sd_int8_linear_nk_x.restype = None
    lib.sd_q4k_linear_x.argtypes = [P, I, I, I, P, P, P, P, P, P, I, P]
    lib.sd_q4k_linear_x.restype = None
    lib.sd_attend.argtypes = [P, I, I, I, I, I, I, I, P, P, I, I, P, ctypes.c_float, P]
    lib.sd_attend.restype = None
    lib.sd_attend_slots.argtypes = [P, I, I, I, I, I, I, I, P, P, I, I, P, P, I, ctypes.c_float, P]
    lib.sd_attend_slots.restype = None
    lib.sd_silu_mul.argtypes = [P, P, I, P]
    lib.sd_silu_mul.restype = None
    _layer_argtypes(lib, "sd_layers")
    _convert_argtypes(lib)
    return lib


def _convert_argtypes(lib: ctypes.CDLL) -> None:
    """Declare a kernel's load-time conversions of GGUF blocks (``cpu_convert.h``)."""
    P, I = ctypes.c_void_p, ctypes.c_int64
    lib.sd_q4k_repack.argtypes = [P, I, I, P, P, P, P, P]
    lib.sd_q4k_repack.restype = None
    lib.sd_rows_int8.argtypes = [ctypes.c_int, P, I, I, P, P]
    lib.sd_rows_int8.restype = ctypes.c_int


def _layer_argtypes(lib: ctypes.CDLL, stack: str) -> None:
    """Declare ``sd_rmsnorm`` and the layer stack ``stack`` (``cpu_layers.h``) of a kernel."""
    P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.sd_rmsnorm.argtypes = [P, I, I, P, F, P]
    lib.sd_rmsnorm.restype = None
    fn = getattr(lib, stack)
    fn.argtypes = [P, I, I, I, P, P, P, I, I, I, I, I, I, F, P, P, P, P, P, P, I, P, F]
    fn.restype = None


def set_amx(on: bool) -> bool:
    """Run the int8 and Q4_K linears' passes of a few rows or more on the AMX tile unit (on)
    or on AVX512-VNNI;
    returns whether the tile unit is in use (False where the CPU, Linux or the compiler
    lacks AMX-INT8, or without the kernel). Either gives the same bits; the choice changes
    only speed, so forward-time profiles are keyed on it (:func:`amx_in_use`)."""
    lib = vnni_kernel()[0]
    return bool(lib is not None and lib.sd_set_amx(int(on)))


def amx_in_use() -> bool:
    """Whether passes of a few rows run on the AMX tile unit now (see :func:`set_amx`)."""
    lib = vnni_kernel()[0]
    return bool(lib is not None and lib.sd_amx_in_use())


# Passes of more tokens a row than this (prefill chunks; a verify pass has at most
# attention.SDPA_MIN_TOKENS = 65) of the int8 and Q4_K linears multiply in bf16 on the AMX tile
# unit (cpu_kernels.cpp, sd_q4k_linear_bf16): bound by arithmetic at such sizes, they run at
# the tile unit's bf16 rate instead of the integer kernels' (the per-group float steps of
# Q4_K leave its int8 tiles idle); docs/EXPERIMENTS.md, prefill on AMX. From 66 to 96 tokens both cost
# about the same on the 1.5B target (the panels' dequantization is not yet paid back).
PREFILL_MIN_TOKENS = 96


def bf16_prefill() -> bool:
    """Whether long passes (more than ``PREFILL_MIN_TOKENS`` tokens a row) of the int8 and
    Q4_K linears multiply in bf16 on the tile unit: the CPU has AMX-BF16, the kernel was built
    with it, and the tile unit is in use (:func:`set_amx`; ``SPECDECODE_AMX=0`` keeps every
    pass on the integer kernels)."""
    lib = vnni_kernel()[0]
    return bool(lib is not None and lib.sd_amx_bf16_in_use())


def _long_pass(x: torch.Tensor, out_features: int, in_features: int) -> bool:
    return (x.dim() == 3 and x.shape[1] > PREFILL_MIN_TOKENS and x.device.type == "cpu"
            and in_features % 32 == 0 and out_features % 32 == 0 and bf16_prefill())


def takes_bf16(linear: nn.Module, x: torch.Tensor) -> bool:
    """Whether this int8 or Q4_K ``linear`` runs the pass of ``x`` in bf16 (see
    :func:`bf16_prefill`)."""
    return (isinstance(linear, Q4KLinear) or (isinstance(linear, Int8Linear) and linear.layout == "vnni")) \
        and _long_pass(x, linear.out_features, linear.in_features)


def _bf16_linear(linear: nn.Module, x: torch.Tensor, run) -> torch.Tensor:
    """A long pass (x [B, T, in], T > PREFILL_MIN_TOKENS) of an int8 or Q4_K linear on the
    tile unit: ``run(x pointer, rows, y pointer)`` calls the kernel. fp32 in and out (x
    rounded to bf16 inside, products summed in fp32). Each row's output is its own, bit for
    bit (a fixed order of sums whatever the other rows); it differs from the integer
    kernels' (a verify pass, at most attention.SDPA_MIN_TOKENS tokens, never comes here)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float().contiguous()
    y = torch.empty(x2.shape[0], linear.out_features)
    run(x2.data_ptr(), x2.shape[0], y.data_ptr())
    return y.to(x.dtype).view(*shape[:-1], linear.out_features)


def _compiled(source: Path, flag_sets: tuple) -> tuple[ctypes.CDLL | None, str]:
    """``source`` compiled with the first of ``flag_sets`` that builds and loaded, and "";
    or None and why not. Built once per source (with the headers beside it), flags and
    compiler into
    ``<specdecode cache>/kernels/`` (about a second with g++), then loaded from there; a
    cached build that does not load is built again, once. Never raises."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        return None, ("no C++ compiler (g++ or c++ on PATH, or $CXX): install one (Debian/Ubuntu: "
                      "apt install g++; Fedora: dnf install gcc-c++) and run again")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
        headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
        key = hashlib.sha256(source.read_bytes() + headers + repr((flag_sets, version)).encode())
        out = registry.cache_dir() / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"
        failed = None if out.is_file() else _build(cxx, out, source, flag_sets)
        if failed:
            return None, failed
        try:
            return ctypes.CDLL(str(out)), ""
        except OSError:  # a broken cached build
            out.unlink(missing_ok=True)
        failed = _build(cxx, out, source, flag_sets)
        return (None, failed) if failed else (ctypes.CDLL(str(out)), "")
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building or loading {source.name} failed: {e}"


def _build(cxx: str, out: Path, source: Path, flag_sets: tuple) -> str | None:
    """Compile ``source`` into ``out`` (via a temporary file: never half written) with the
    first of ``flag_sets`` that builds (the VNNI kernel's: without AMX for an older g++);
    returns why it failed, or None."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        for flags in flag_sets:
            proc = subprocess.run([cxx, *flags, "-o", str(built), str(source)],
                                  capture_output=True, text=True, timeout=600)
            if proc.returncode == 0:
                break
        if proc.returncode != 0:
            return f"{cxx} failed: {proc.stderr.strip()[-300:]}"
        os.replace(built, out)
    return None


def q4k_kernel() -> tuple[ctypes.CDLL | None, str]:
    """(the kernel library that runs Q4_K linears, q4 and int4: the AVX512-VNNI one, else the
    AVX2 one, or None; why not, when None)."""
    lib, why = vnni_kernel()
    if lib is None:
        lib = avx2_kernel()
        if lib is None:
            why = f"{why}; and the AVX2 kernel is not in use either"
    return lib, why


def require_q4k(what: str) -> ctypes.CDLL:
    """The kernel that runs Q4_K (:func:`q4k_kernel`), or ValueError saying that ``what``
    needs it and to use int8."""
    lib, why = q4k_kernel()
    if lib is None:
        raise ValueError(f"{what} needs the AVX512-VNNI or the AVX2 kernel, neither of which is in "
                         f"use here ({why}); use dtype int8")
    return lib


def _unavailable(why: str) -> tuple[None, str]:
    """A CPU that could run the kernel but cannot get it: say so once (it runs ~1.5x
    slower without it, and q4 needs it)."""
    print(f"note: the AVX512-VNNI kernel is not in use ({why}); int8 runs on torch._int_mm, "
          "q4 is unavailable", file=sys.stderr)
    return None, why


def _int8_dir() -> Path:
    return registry.cache_dir() / "int8"


def layout_for(layout: str, in_features: int, out_features: int) -> str:
    """``layout``, or "kn" where "vnni" does not take the shape (both multiples of 16)."""
    if layout == "vnni" and (in_features % 16 or out_features % 16):
        return "kn"
    return layout


def best_layout(role: str, device: torch.device | str = "cpu") -> str:
    """The fastest layout for a target's verify passes (role "target") or a draft's
    one-token steps ("draft") on ``device``: "vnni" where the kernel runs, else "kn" / "nk"."""
    if torch.device(device).type == "cpu" and vnni_kernel()[0] is not None:
        return "vnni"
    if torch.device(device).type == "cpu" and avx2_kernel() is not None:
        return "nk"  # the AVX2 kernel's
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


def quantize_rows(w: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization with one scale per row.

    Args:
        w: float [N, K].
        out: (q int8 [N, K], scale fp32 [N]) to write into; then ``w`` (fp32) is used as
            scratch and overwritten (no new memory for a slice of a large weight).

    Returns:
        (q int8 [N, K], scale fp32 [N]) with w ~= q * scale[:, None]; an all-zero row gets
        scale 1 (its q is 0).
    """
    if out is None:
        w = w.float()
        out = torch.empty(w.shape, dtype=torch.int8), torch.empty(w.shape[0])
        x = torch.empty_like(w)  # w is the caller's
    else:
        x = w
    amax = torch.maximum(w.amax(-1), w.amin(-1).neg())  # max |w| without a tensor of |w|
    q, scale = out
    torch.where(amax > 0, amax / QMAX, torch.ones_like(amax), out=scale)
    torch.div(w, scale[:, None], out=x).round_().clamp_(-QMAX, QMAX)
    q.copy_(x)
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
        layout = layout_for(layout, in_features, out_features)
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
        n = self.out_features
        lib = vnni_kernel()[0] if self.layout == "vnni" else None
        if lib is not None and _long_pass(x, n, self.in_features):
            return _bf16_linear(self, x, lambda xp, m, yp: lib.sd_int8_linear_bf16(
                xp, m, self.in_features, *_pointers(self, ("qweight", "wscale", "bias")), n, yp))
        x2 = x.reshape(-1, shape[-1]).float()
        if lib is not None and x2.device.type == "cpu":
            x2 = x2.contiguous()
            y = torch.empty(x2.shape[0], n)
            lib.sd_int8_linear_x(x2.data_ptr(), x2.shape[0], self.in_features, *_pointers(
                self, ("qweight", "wscale", "bias")), n, y.data_ptr())
            return y.to(x.dtype).view(*shape[:-1], n)
        avx2 = avx2_kernel() if self.layout == "nk" and x2.device.type == "cpu" else None
        if avx2 is not None:  # these steps in one call (cpu_kernels_avx2.cpp): the same bits
            x2 = x2.contiguous()
            y = torch.empty(x2.shape[0], n)
            avx2.sd_int8_linear_nk_x(x2.data_ptr(), x2.shape[0], self.in_features, *_pointers(
                self, ("qweight", "wscale", "bias")), n, y.data_ptr())
            return y.to(x.dtype).view(*shape[:-1], n)
        xq, xs = quantize_rows(x2)  # the kernel's steps (cpu_kernels.cpp, sd_quantize_rows)
        y = torch._int_mm(xq, self.weight_kn()).float() * xs[:, None] * self.wscale
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*shape[:-1], n)

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


def _pointers(module: nn.Module, names: tuple[str, ...]) -> tuple[int, ...]:
    """Data pointers of a module's buffers (0 for None), kept on the module while the same
    tensors are assigned: a call of the kernel then costs one crossing from Python."""
    buffers = module._buffers  # not getattr: nn.Module's lookup costs a microsecond a name
    tensors = tuple(buffers[k] for k in names)
    cached = module.__dict__.get("_kernel_args")
    if cached is None or len(cached[0]) != len(tensors) or any(
            a is not b for a, b in zip(cached[0], tensors)):
        cached = (tensors, tuple(0 if t is None else t.data_ptr() for t in tensors))
        module.__dict__["_kernel_args"] = cached
    return cached[1]


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


class Q4KLinear(nn.Module):
    """A linear whose weight is a GGUF file's Q4_K blocks, as they are, with per-row int8
    activations (the AVX512-VNNI or the AVX2 kernel, the same bits on both: ``sd_q4k_linear``
    in ``cpu_kernels.cpp``, ``sd_q4k_linear_x`` in ``cpu_kernels_avx2.cpp``).

    w[n, k] = d * sc * q - dmin * m (q 4-bit, sc and m 6-bit per 32 inputs, d and dmin fp16
    per 256: llama.cpp's ``block_q4_K``), so the weights equal gguf-py's dequantization (and
    our fp32 conversion of the file) exactly; each 32-input group's product is an exact int32
    sum, combined in a fixed float order, so every output row depends only on its input row,
    bit for bit. x: float [..., in] -> [..., out] in x's dtype. Shapes: out % 16 == 0; the
    blocks cover K = in rounded up to a multiple of 256, the weights of the padding inputs
    0 (:func:`q4k_quantize`; a GGUF file's blocks always have in % 256 == 0), and x gets
    zeros there, which change neither its scale nor any sum. Buffers (per block of 16
    output channels): ``qweight`` uint8 [out/16, K/32, 4, 16, 4] (two 4-bit values a
    byte), ``d``, ``dmin`` int16 (fp16 bits) [out/16, K/256, 16], ``sc``, ``mn`` uint8
    [out/16, K/32, 16], ``bias`` fp32 or None. Raises RuntimeError when run without either
    kernel (:func:`q4k_kernel`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None):
        super().__init__()
        if out_features % 16:
            raise ValueError(f"a Q4_K linear needs out % 16 == 0, got [{out_features}, {in_features}]")
        self.in_features, self.out_features = in_features, out_features
        self.padded_in = -(-in_features // 256) * 256
        nb, g = out_features // 16, self.padded_in // 32

        def buf(shape, dtype):
            return torch.empty(shape, dtype=dtype, device=device)

        self.register_buffer("qweight", buf((nb, g, 4, 16, 4), torch.uint8))
        self.register_buffer("d", buf((nb, g // 8, 16), torch.int16))
        self.register_buffer("dmin", buf((nb, g // 8, 16), torch.int16))
        self.register_buffer("sc", buf((nb, g, 16), torch.uint8))
        self.register_buffer("mn", buf((nb, g, 16), torch.uint8))
        self.register_buffer("bias", buf((out_features,), torch.float32) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib, why = q4k_kernel()
        if lib is None:
            raise RuntimeError(f"Q4_K weights need the AVX512-VNNI or the AVX2 kernel, neither of "
                               f"which is in use ({why}); load the model with dtype int8")
        shape = x.shape
        n = self.out_features
        if lib is vnni_kernel()[0] and _long_pass(x, n, self.in_features):
            return _bf16_linear(self, x, lambda xp, m, yp: lib.sd_q4k_linear_bf16(
                xp, m, self.in_features, self.padded_in, *_pointers(self, (*Q4K_BUFFERS, "bias")), n, yp))
        x2 = x.reshape(-1, shape[-1]).float().contiguous()
        y = torch.empty(x2.shape[0], n)
        lib.sd_q4k_linear_x(x2.data_ptr(), x2.shape[0], self.in_features, self.padded_in,
                            *_pointers(self, (*Q4K_BUFFERS, "bias")), n, y.data_ptr())
        return y.to(x.dtype).view(*shape[:-1], n)

    def weight(self) -> torch.Tensor:
        """The weight dequantized to fp32 [out, in] (gguf-py's arithmetic)."""
        return q4k_dequantize({k: getattr(self, k) for k in Q4K_BUFFERS})[:, :self.in_features]


Q4K_BUFFERS = ("qweight", "d", "dmin", "sc", "mn")


def first_rows(linear: nn.Module, m: int) -> nn.Module:
    """A linear of the same kind holding ``linear``'s first ``m`` output rows (m a multiple
    of 16, at most its out_features), copied as they are: each output is the bits of the
    full linear's for that row (the kernels compute every output row on its own). For a
    draft's restricted LM head (:meth:`~specdecode.models.native.Transformer.draft_head`).
    Takes :class:`Int8Linear` (any layout), :class:`Q4KLinear` and ``nn.Linear``; raises
    ValueError for another module or a bad ``m``."""
    out = linear.out_features if isinstance(linear, (Int8Linear, Q4KLinear, nn.Linear)) else None
    if out is None:
        raise ValueError(f"first_rows takes an Int8Linear, Q4KLinear or nn.Linear, got {type(linear).__name__}")
    if not (isinstance(m, int) and 16 <= m <= out and m % 16 == 0):
        raise ValueError(f"first_rows: m={m!r}; allowed: a multiple of 16 in 16..{out}")
    bias = getattr(linear, "bias", None)
    if isinstance(linear, nn.Linear):
        sub = nn.Linear(linear.in_features, m, bias=bias is not None, device=linear.weight.device,
                        dtype=linear.weight.dtype)
        with torch.no_grad():
            sub.weight.copy_(linear.weight[:m])
            if bias is not None:
                sub.bias.copy_(bias[:m])
        return sub.requires_grad_(False)
    if isinstance(linear, Int8Linear):
        sub = Int8Linear(linear.in_features, m, bias is not None, linear.layout, device=linear.wscale.device)
        q = linear.qweight  # vnni: [out/16, in/4, 16, 4]; kn: [in, out]; nk: [out, in]
        sub.qweight = (q[:, :m] if linear.layout == "kn" else q[:m // 16] if linear.layout == "vnni"
                       else q[:m]).contiguous().clone()
        sub.wscale = linear.wscale[:m].clone()
    else:
        sub = Q4KLinear(linear.in_features, m, bias is not None, device=linear.qweight.device)
        for name in Q4K_BUFFERS:  # each [out/16, ...]
            setattr(sub, name, getattr(linear, name)[:m // 16].clone())
    if bias is not None:
        sub.bias = bias[:m].clone()
    return sub


def q4k_dequantize(buffers: dict[str, torch.Tensor]) -> torch.Tensor:
    """fp32 [out, in] of :class:`Q4KLinear` buffers, computed as gguf-py dequantizes Q4_K:
    (d * sc) * q - dmin * m."""
    qw = buffers["qweight"]  # [nb, g, v, j, b]
    nb, g = qw.shape[0], qw.shape[1]
    out_f, in_f = nb * 16, g * 32
    packed = qw.permute(0, 3, 1, 2, 4)  # [nb, j, g, v, b]
    q = torch.stack((packed & 15, packed >> 4), 4).reshape(out_f, in_f)

    def per_row(t):  # [nb, groups, 16] -> fp32 [out, groups]
        return t.float().transpose(1, 2).reshape(out_f, -1)

    d, dmin = (per_row(buffers[k].view(torch.float16)).repeat_interleave(8, 1) for k in ("d", "dmin"))
    a, b = d * per_row(buffers["sc"]), dmin * per_row(buffers["mn"])
    return a.repeat_interleave(32, 1) * q.float() - b.repeat_interleave(32, 1)


def q4k_fits(in_features: int, out_features: int) -> bool:
    """Whether a linear of this shape can hold Q4_K blocks in :class:`Q4KLinear`."""
    return in_features % 256 == 0 and out_features % 16 == 0


def q4k_buffers(raw, out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A :class:`Q4KLinear`'s buffers (without bias) from the rows of a GGUF Q4_K tensor, the
    same blocks rearranged (:func:`_q4k_pack`'s layout), byte for byte from the file's bytes,
    by the kernel library (``sd_q4k_repack`` in ``cpu_convert.h``, on all threads).

    Args:
        raw: uint8 [out, in / 256 * 144] (144-byte ``block_q4_K`` per 256 inputs), numpy or
            torch; out % 16 == 0.
        out: the buffers to write into (e.g. views of a whole weight's for these rows);
            None: new tensors.

    Returns:
        ``qweight``, ``d``, ``dmin``, ``sc``, ``mn`` as :class:`Q4KLinear` holds them.

    Raises:
        ValueError: neither kernel library is in use (:func:`require_q4k`).
    """
    lib = require_q4k("Q4_K weights")
    raw = torch.as_tensor(raw).contiguous()
    n, nb = raw.shape[0], raw.shape[1] // 144
    if out is None:
        out = {k: torch.empty(shape, dtype=dtype) for k, shape, dtype in (
            ("qweight", (n // 16, nb * 8, 4, 16, 4), torch.uint8),
            ("d", (n // 16, nb, 16), torch.int16), ("dmin", (n // 16, nb, 16), torch.int16),
            ("sc", (n // 16, nb * 8, 16), torch.uint8), ("mn", (n // 16, nb * 8, 16), torch.uint8))}
    lib.sd_q4k_repack(raw.data_ptr(), n, nb, *(out[k].data_ptr() for k in Q4K_BUFFERS))
    return out


def _int8_rows(t) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [rows, in], scale fp32 [rows]) of a weight by :func:`quantize_rows`, a slice
    at a time (:func:`_by_slices`); a GGUF tensor of Q4_K or Q6_K blocks straight from its
    bytes by the kernel library (``sd_rows_int8``: the same bits, several times faster)
    where one is in use."""
    lib, kind = q4k_kernel()[0], getattr(t, "type", None)
    if lib is None or kind not in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
        return tuple(_by_slices(t, lambda w, out: dict(zip("qs", quantize_rows(
            w, out and (out["q"], out["s"]))))).values())
    k = t.shape[1]

    def convert(raw, out):
        raw = torch.from_numpy(raw).contiguous()
        out = out or {"q": torch.empty(raw.shape[0], k, dtype=torch.int8), "s": torch.empty(raw.shape[0])}
        lib.sd_rows_int8(int(kind), raw.data_ptr(), raw.shape[0], k // 256, out["q"].data_ptr(),
                         out["s"].data_ptr())
        return out

    return tuple(_by_slices(t, convert, raw=True).values())


def _q4k_pack(q, d, dmin, sc, mn) -> dict[str, torch.Tensor]:
    """:class:`Q4KLinear` buffers from q uint8 [n, k] (0..15, inputs in order), d and dmin
    int16 (fp16 bits) [n, k/256], sc and mn uint8 [n, k/32]."""
    n, k = q.shape
    q = q.view(n // 16, 16, k // 32, 4, 2, 4)

    def blocks(a, per):  # [n, k / per] -> [n / 16, k / per, 16]
        return a.reshape(n // 16, 16, k // per).transpose(1, 2).contiguous()

    return {"qweight": (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).contiguous(),
            "d": blocks(d, 256), "dmin": blocks(dmin, 256), "sc": blocks(sc, 32), "mn": blocks(mn, 32)}


def q4k_quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """:class:`Q4KLinear` buffers of a float weight [out, in] (out % 16 == 0), quantized here
    to llama.cpp's Q4_K arithmetic: per 32 inputs a 4-bit grid from the group's minimum
    (offset dmin*m, m 6-bit) to its maximum (step d*sc, sc 6-bit), d and dmin fp16 per 256
    inputs; round to nearest (llama.cpp searches the scales further: ``make_qkx2_quants``).
    Inputs are padded with zero weights to a multiple of 256. For dtype int4, whose output
    is the plain decoding of that quantized model (a draft's weights change only its
    acceptance). Each row's blocks depend on that row alone."""
    n, k = w.shape
    kp = -(-k // 256) * 256
    w = nn.functional.pad(w.float(), (0, kp - k)).view(n, kp // 32, 32)
    lo = w.amin(-1).clamp(max=0).neg()  # [n, g]: the offset is -dmin*m <= 0
    step = (w.amax(-1) + lo) / 15
    sup = lambda t: t.view(n, kp // 256, 8)  # noqa: E731 - groups of a superblock
    d = (sup(step).amax(-1) / 63).half()
    dmin = (sup(lo).amax(-1) / 63).half()
    dd, dm = d.float().repeat_interleave(8, 1), dmin.float().repeat_interleave(8, 1)
    sc = torch.where(dd > 0, step / dd.clamp(min=1e-30), 0).round().clamp(0, 63)
    mn = torch.where(dm > 0, lo / dm.clamp(min=1e-30), 0).round().clamp(0, 63)
    a, b = (dd * sc)[..., None], (dm * mn)[..., None]
    q = torch.where(a > 0, (w + b) / a.clamp(min=1e-30), 0).round().clamp(0, 15)
    return _q4k_pack(q.to(torch.uint8).view(n, kp), d.view(torch.int16), dmin.view(torch.int16),
                     sc.to(torch.uint8), mn.to(torch.uint8))


def has_q4k(gguf_path: Path) -> bool:
    """Whether a GGUF file holds a Q4_K weight :class:`Q4KLinear` takes. Reading a GGUF
    header takes seconds (gguf-py parses the whole vocabulary), so the answer is kept per
    file (path, size, mtime) in ``<specdecode cache>/int8/q4k-files.json``."""
    st = Path(gguf_path).resolve().stat()
    key = f"{Path(gguf_path).resolve()}|{st.st_size}|{st.st_mtime_ns}"
    memo_path = _int8_dir() / "q4k-files.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if isinstance(memo, dict) and isinstance(memo.get(key), bool):
        return memo[key]
    found = any(t.type == gguf.GGMLQuantizationType.Q4_K and len(t.shape) == 2 and q4k_fits(t.shape[1], t.shape[0])
                for t in gguf_file.open_file(gguf_path).tensors.values())
    memo = memo if isinstance(memo, dict) else {}
    memo[key] = found
    with contextlib.suppress(OSError):
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_name(f".{memo_path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, memo_path)
    return found


def swap_modules(model: nn.Module, layout: str, q4k: frozenset[str] = frozenset()) -> None:
    """Replace every ``nn.Linear`` under ``model`` by an empty :class:`Int8Linear` of the
    given layout and every ``nn.Embedding`` by an empty :class:`Int8Embedding`, on the same
    device: for a model built on the meta device whose :func:`quantize_state` is loaded next
    (``load_state_dict(..., assign=True)``). Linears whose module path is in ``q4k`` become
    :class:`Q4KLinear` instead."""
    _swap(model, layout, q4k, "")


def _swap(model: nn.Module, layout: str, q4k: frozenset[str], prefix: str) -> None:
    for name, child in model.named_children():
        path = prefix + name
        if isinstance(child, nn.Linear):
            cls = Q4KLinear if path in q4k else Int8Linear
            args = () if path in q4k else (layout,)
            setattr(model, name, cls(child.in_features, child.out_features,
                                     child.bias is not None, *args, device=child.weight.device))
        elif isinstance(child, nn.Embedding):
            setattr(model, name, Int8Embedding(child.num_embeddings, child.embedding_dim,
                                               child.weight.device))
        else:
            _swap(child, layout, q4k, path + ".")


def quantize_linears(model: nn.Module, layout: str = "nk") -> nn.Module:
    """Replace every ``nn.Linear`` of a loaded float model (any architecture, e.g. a
    transformers model) by its :class:`Int8Linear`, in place; returns ``model``."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear.from_float(child.weight.detach(), child.bias, layout))
        else:
            quantize_linears(child, layout)
    return model


SLICE_VALUES = 1 << 22  # weights converted at a time (16 MiB in fp32)


def _by_slices(t, convert, raw: bool = False) -> dict[str, torch.Tensor]:
    """``convert`` of each slice of about ``SLICE_VALUES`` weights (whole rows, a multiple
    of 16 of them) of the weight ``t`` (a torch tensor, or a lazily read GGUF tensor),
    written into tensors allocated once: the float weight (``raw``: the GGUF tensor's bytes)
    is never whole in memory, and each slice is read (and dequantized) into the same
    buffers. ``convert(rows, out)`` maps rows (fp32 [r, in], a scratch tensor it may
    overwrite; or raw bytes) to a dict of tensors whose first dimension is r or r / 16
    (every conversion here is row by row): ``out`` is None for the first slice, then the
    outputs' views for the slice's rows, which ``convert`` may fill and return (else what it
    returns is copied there)."""
    n, out, per = t.shape[0], {}, {}
    step = max(16, SLICE_VALUES // t.shape[1] // 16 * 16)
    buf = None
    for a in range(0, n, step):
        b = min(a + step, n)
        if isinstance(t, torch.Tensor):
            buf = torch.empty(min(step, n), t.shape[1]) if buf is None else buf
            rows = buf[:b - a].copy_(t[a:b])
        elif raw:
            buf = np.empty(min(step, n) * (t.nbytes // n), np.uint8) if buf is None else buf
            rows = t.raw(a, b, out=buf)
        else:
            if buf is None:
                buf = (np.empty(min(step, n) * (t.nbytes // n), np.uint8), torch.empty(min(step, n), t.shape[1]))
            rows = t.dequantize(t.raw(a, b, out=buf[0]), out=buf[1])
        views = {k: v[a // per[k]:b // per[k]] for k, v in out.items()} if out else None
        for k, v in convert(rows, views).items():
            if k not in out:
                per[k] = (b - a) // v.shape[0]
                out[k] = torch.empty((n // per[k], *v.shape[1:]), dtype=v.dtype)
                views = {**(views or {}), k: out[k][a // per[k]:b // per[k]]}
            if v is not views[k]:
                views[k].copy_(v)
    return out


def _is_q4k(t) -> bool:
    """A lazily read GGUF weight held as Q4_K blocks of a shape :class:`Q4KLinear` takes."""
    return (not isinstance(t, torch.Tensor) and t.type == gguf.GGMLQuantizationType.Q4_K
            and t.dim() == 2 and q4k_fits(t.shape[1], t.shape[0]))


def quantize_state(tensors: Iterable[tuple[str, object]], layout: str, tie_embeddings: bool,
                   keep_q4k: bool = False, int4: bool = False) -> dict[str, torch.Tensor]:
    """The int8 state dict of a Llama-family checkpoint, one tensor at a time.

    tensors: (name, weight) pairs in transformers naming; a weight is a torch tensor or a
    lazily read GGUF tensor (:class:`~specdecode.models.gguf_file.GGUFTensor`), converted a
    slice of rows at a time. Every 2-D ``*.weight`` becomes ``*.qweight`` int8 +
    ``*.wscale`` fp32 [rows] (``model.embed_tokens`` row-major, the linears in ``layout``,
    see :func:`pack`); everything else (norms, biases) becomes fp32. ``keep_q4k`` (dtype
    q4): a GGUF weight stored as Q4_K blocks becomes the buffers of a :class:`Q4KLinear`
    instead, as they are. ``int4``: every linear whose out % 16 == 0 (the lm_head too, tied
    or not) gets Q4_K blocks quantized here (:func:`q4k_quantize`). The embedding table
    stays int8; with tied embeddings the lm_head takes the table's Q4_K blocks (kept or
    quantized), or in layout "nk" nothing (the loader ties it to the int8 table), or else
    its own copy of that table in the layout; a checkpoint's ``lm_head.weight`` is ignored.
    """
    state: dict[str, torch.Tensor] = {}
    tied_blocks = None
    for name, t in tensors:
        if name == "lm_head.weight" and tie_embeddings:
            continue
        base = name[: -len(".weight")]
        if not (name.endswith(".weight") and t.dim() == 2):
            state[name] = t.float()
            continue
        embedding = base.endswith("embed_tokens")
        blocks = None
        if embedding and not tie_embeddings:
            pass  # the table itself is int8; only a tied lm_head takes blocks
        elif int4 and t.shape[0] % 16 == 0:
            blocks = _by_slices(t, lambda w, out: q4k_quantize(w))
        elif keep_q4k and _is_q4k(t):
            blocks = _by_slices(t, q4k_buffers, raw=True)
        if embedding:
            tied_blocks = blocks
        elif blocks is not None:
            state.update({f"{base}.{k}": v for k, v in blocks.items()})
            continue
        q, state[base + ".wscale"] = _int8_rows(t)
        state[base + ".qweight"] = q if embedding else pack(q, layout_for(layout, *reversed(q.shape)))
    if tied_blocks is not None:
        state.update({f"lm_head.{k}": v for k, v in tied_blocks.items()})
    elif tie_embeddings and layout != "nk":
        q = state["model.embed_tokens.qweight"]
        state["lm_head.qweight"] = pack(q, layout_for(layout, q.shape[1], q.shape[0]))
        state["lm_head.wscale"] = state["model.embed_tokens.wscale"].clone()
    return state


def q4k_modules(state: dict[str, torch.Tensor]) -> frozenset[str]:
    """Module paths that hold Q4_K blocks in a :func:`quantize_state` dict."""
    return frozenset(k[: -len(".dmin")] for k in state if k.endswith(".dmin"))


def safetensors_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of safetensors files, one tensor in memory at a time."""
    for f in files:
        with safe_open(f, "pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def int8_state(sources: list[Path], weights, layout: str, tie_embeddings: bool, label: str,
               kind: str = "int8", progress: bool = True, rebuild: bool = False) -> dict[str, torch.Tensor]:
    """:func:`quantize_state` of ``weights()`` ((name, weight) pairs: torch tensors, or lazily
    read GGUF tensors), one tensor at a time (no float copy of the model).

    kind: "int8", "q4" (a GGUF file's Q4_K blocks kept, the rest int8) or "int4". A q4
    state is made from the file at each load (its Q4_K blocks are only rearranged: seconds,
    and a copy would double the model's disk space). An int8 or int4 state is made once and
    cached in ``<specdecode cache>/int8/<label>-<kind>-<key>.safetensors`` (key: the
    ``sources`` files' paths, sizes and mtimes, the layout, the tying, FORMAT_VERSION;
    about 1 byte per parameter); later calls read it. A cache file that cannot be read is
    rebuilt, as is any with ``rebuild`` (the loader's answer to a cached file that does not
    fit the model); one that cannot be written is skipped with a note on stderr; a
    concurrent writer of the same file is harmless (each writes its own temp file and
    renames it). ``progress``: a bar on stderr when the work takes more than a few seconds.
    Raises SafetensorError/OSError for unreadable source files, ValueError for a GGUF tensor
    of a type not read here.
    """
    if kind not in ("int8", "q4", "int4"):
        raise ValueError(f"kind {kind!r} is not one of int8, q4, int4")
    ident = [FORMAT_VERSION, layout, tie_embeddings] + (["int4"] if kind == "int4" else [])
    for f in sources:
        st = f.resolve().stat()
        ident += [str(f.resolve()), st.st_size, st.st_mtime_ns]
    key = hashlib.sha256(repr(ident).encode()).hexdigest()[:16]
    path = _int8_dir() / f"{label}-{kind}-{key}.safetensors"

    def prepared():
        bar = tqdm(weights(), desc=f"reading {label}'s weights" if kind == "q4" else
                   f"preparing {label} as {kind} weights (once; cached in {path.parent})",
                   unit=" tensors", delay=3, leave=False, disable=not progress)
        with bar:
            return quantize_state(bar, layout, tie_embeddings, keep_q4k=kind == "q4", int4=kind == "int4")

    if rebuild or kind == "q4":  # (a q4 state cached by an earlier version: its space freed)
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
    if kind == "q4":
        return prepared()
    if path.is_file():
        try:
            return load_file(path)
        except (SafetensorError, OSError):
            path.unlink(missing_ok=True)
    state = prepared()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(state, tmp, metadata={"format": f"specdecode-{kind}-{FORMAT_VERSION}"})
        os.replace(tmp, path)
    except OSError as e:
        print(f"note: could not cache the {kind} weights in {path.parent} ({e}); they will be "
              "quantized again next time", file=sys.stderr)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return state

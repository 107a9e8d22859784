"""Attention of the native decoder, and which kernel runs it: the C++ kernels
(``cpu_kernels.cpp``, ``cpu_kernels_avx2.cpp``) for fp32 on the CPU (:func:`cpu_kernels`,
:func:`attention_kernel`), each query over its own prefix of the cache or a draft tree's
slots (:class:`Prefixes`, :func:`attend_rows`, :func:`tree_slots`), else PyTorch's products
in the shapes of a one-token pass (:func:`attend_prefixes`). The transformers adapter's
attention (models/hf.py) takes the same paths.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import quant
from .kv_cache import KVCache

# Forwards of more new tokens use the fused attention kernel; up to it, which covers every
# verify pass (K <= MAX_K = 64, plus one), :func:`attend_prefixes`.
SDPA_MIN_TOKENS = 65


class Prefixes(NamedTuple):
    """Query (b, t) sees cache slots 0..lens[b, t]-1: the attention of decode and verify
    rows, chains of their own lengths included, run by :func:`attend_rows`; or, with
    ``slots``, the slots slots[b, t, 0..lens[b, t]-1] in that order (a draft tree's node: the
    committed slots, then its ancestors and itself; see :func:`tree_slots`).

    lib: the loaded ``cpu_kernels.cpp`` or ``cpu_kernels_avx2.cpp``; lens: int64 [B, T],
    contiguous, each in 1..max_len; slots: None or int64 [B, T, S], contiguous.
    """

    lib: object
    lens: torch.Tensor
    slots: torch.Tensor | None = None


def tree_slots(tree: torch.Tensor, starts: list[int], valid: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots each new token of a tree pass sees, in slot order: its row's committed slots
    0..start-1, then the new tokens its mask row allows (ancestors and itself) at start + j.

    tree: bool [B, T, T] (the pass's attn_mask); starts: each row's cache length before the
    pass; valid: bool [B, T], False for padding (which sees slot 0 only: computed, never
    used). Returns (lens int64 [B, T], slots int64 [B, T, max(starts) + T]) for
    :class:`Prefixes`.
    """
    b, t, _ = tree.shape
    width = max(starts) + t
    slots = torch.zeros(b, t, width, dtype=torch.long)
    lens = torch.ones(b, t, dtype=torch.long)
    new = torch.arange(t)
    for row, start in enumerate(starts):
        sees = tree[row].cpu() & valid[row].cpu()[None]
        # the visible new tokens first, in order; the rest (past the count, never read) 0
        tail = torch.where(sees, start + new, width).sort(1).values
        slots[row, :, :start] = torch.arange(start)
        slots[row, :, start:start + t] = tail.masked_fill(tail == width, 0)
        lens[row] = torch.where(valid[row].cpu(), start + sees.sum(1), 1)
    return lens, slots


def window_prefixes(prefixes: Prefixes, positions: torch.Tensor, window: int) -> Prefixes:
    """The slots each query of ``prefixes`` sees in a sliding-window layer: those of
    positions p-window+1..p for a query at position p (Gemma 3's local layers; transformers'
    sliding-window mask, llama.cpp's standard SWA), as slots (the kernel's
    ``sd_attend_slots``), so that every pass of the layer takes the same path.

    prefixes: a chain's (slot = position) or a draft tree's (:func:`tree_slots`: the
    committed slots, slot = position, then the new tokens the query sees, all within the
    window); positions: int64 [B, T], each query's position (padding: any). Returns
    :class:`Prefixes` with lens [B, T] <= window and slots [B, T, min(width, window)].
    """
    b, t = prefixes.lens.shape
    lens = prefixes.lens
    slots = prefixes.slots if prefixes.slots is not None else \
        torch.arange(int(lens.max())).expand(b, t, -1)
    width = min(slots.shape[2], window)
    # the committed slots before the window (the first in each query's list), never all
    drop = torch.minimum(positions.to(lens.device) + 1 - window, lens - 1).clamp(min=0)
    idx = (drop[..., None] + torch.arange(width)).clamp(max=slots.shape[2] - 1)
    return Prefixes(prefixes.lib, (lens - drop).contiguous(), slots.gather(2, idx).contiguous())


def cpu_kernels(device: torch.device, dtype: torch.dtype):
    """The loaded ``cpu_kernels.cpp`` (AVX512) or ``cpu_kernels_avx2.cpp`` for fp32 tensors on
    the CPU, or None (another device or dtype, or no kernel on this CPU: then PyTorch's
    operators)."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    return quant.vnni_kernel()[0] or quant.avx2_kernel()


def attention_kernel(device: torch.device, dtype: torch.dtype, args):
    """The C++ attention kernel for a cache of this device and dtype, or None (see
    :func:`attention_kernel_for`). args: the model's
    :class:`~specdecode.models.native.ModelArgs` (head_dim, n_heads, n_kv_heads)."""
    return attention_kernel_for(device, dtype, args.head_dim, args.n_heads // args.n_kv_heads)


def attention_kernel_for(device: torch.device, dtype: torch.dtype, head_dim: int, group: int):
    """The C++ attention kernel for these tensors, or None (see :func:`cpu_kernels`; also
    head_dim not a multiple of 16, or of 8 for the AVX2 kernel, or over 256 query heads per
    KV head): then the PyTorch paths, :func:`attend_prefixes`."""
    lib = cpu_kernels(device, dtype)
    if lib is None or head_dim % (8 if lib is quant.avx2_kernel() else 16) or group > 256:
        return None
    return lib


def tree_kernel(lib) -> bool:
    """Whether this attention kernel (:func:`attention_kernel`) also runs tree passes
    (``sd_attend_slots``, in both CPU kernel files), so that a tree node's row has the bits of
    the one-token pass of its path. Elsewhere (no CPU kernel: another device, dtype or head
    size) a tree pass takes PyTorch's masked path, whose bits may differ from the decode
    kernel's."""
    return lib is not None and hasattr(lib, "sd_attend_slots")


def attend_rows(prefixes: Prefixes, q: torch.Tensor, cache: KVCache,
                scale: float | None = None) -> torch.Tensor:
    """Attention of each query over its own prefix of the cache, on the CPU (``sd_attend``).

    q: fp32 [B, H, T, D] (RoPE applied, D contiguous); cache: the layer's (or any object
    with contiguous fp32 ``k``, ``v`` [B, H_kv, L, D]), the new tokens written; scale: of
    the scores, default D ** -0.5. Returns fp32 [B, T, H, D] (``o_proj``'s input order: no
    transpose copy).
    Each (row, KV head) is computed by one thread, in an order that depends only on its own
    query, keys and values (fp32 dot products, softmax with its own max, the value sum in
    slot order), so a row is the same bit for bit alone or among any others, at any thread
    count: the one-token pass and every row of a verify pass, or of a batch of requests of
    their own lengths, compute it alike. 1.5-2x less time than :func:`attend_prefixes`'
    per-row products in an 8-row pass (docs/EXPERIMENTS.md).
    """
    b, h, t, d = q.shape
    if q.stride(3) != 1:
        q = q.contiguous()
    out = torch.empty(b, t, h, d)
    kc, lens = cache.k, prefixes.lens
    scale = d ** -0.5 if scale is None else scale
    if prefixes.slots is None:
        prefixes.lib.sd_attend(q.data_ptr(), b, t, h, d, q.stride(0), q.stride(2), q.stride(1),
                               kc.data_ptr(), cache.v.data_ptr(), kc.shape[1], kc.shape[2],
                               lens.data_ptr(), scale, out.data_ptr())
    else:
        sl = prefixes.slots
        prefixes.lib.sd_attend_slots(q.data_ptr(), b, t, h, d, q.stride(0), q.stride(2),
                                     q.stride(1), kc.data_ptr(), cache.v.data_ptr(), kc.shape[1],
                                     kc.shape[2], lens.data_ptr(), sl.data_ptr(), sl.shape[2],
                                     scale, out.data_ptr())
    return out


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    # softmax over a length-1 axis is pathologically slow on CPU in torch 2.13
    return scores.float().softmax(-1) if scores.shape[-1] > 1 else torch.ones_like(scores)


def attend_prefixes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                    scale: float | None = None, window: int = 0) -> torch.Tensor:
    """Causal attention of T new tokens at positions start..start+T-1, each row computed as
    the one-token pass at its position computes it.

    q: [B, H, T, D] (RoPE applied); k, v: [B, H_kv, start+T, D] (the cache, new tokens
    included); scale: of the scores, default D ** -0.5; window: > 0 for a sliding-window
    layer, whose query at position p sees p-window+1..p only. Returns [B, H, T, D]. Query i attends to slots 0..start+i through products
    of exactly the shapes a one-token pass there uses ([g, D] x [D, start+i+1] per group of
    g = H / H_kv heads), so its floating-point result is the same bit for bit. One product
    over all T rows and start+T keys (with the future masked) is faster, but the order of its
    reductions changes with T and with the key count, and the last-bit differences it leaves
    become different int8 roundings downstream (models/quant.py), then different logits:
    measured on Qwen2.5-Coder-1.5B W8A8, a 9-row verify pass moved logits by up to 1.2 and
    flipped an argmax. This costs ~4-9 % of an 8-row verify pass at 200-1,000 cached tokens.
    """
    b, h, t, d = q.shape
    kv = k.shape[1]
    qg = q.view(b, kv, h // kv, t, d)
    scale = d ** -0.5 if scale is None else scale
    rows = []
    for i in range(t):
        n = start + i + 1
        lo = max(0, n - window) if window else 0
        scores = (qg[:, :, :, i] @ k[:, :, lo:n].transpose(-1, -2)) * scale
        rows.append(_softmax(scores).to(q.dtype) @ v[:, :, lo:n])  # [B, kv, g, D]
    return torch.stack(rows, 3).view(b, h, t, d)

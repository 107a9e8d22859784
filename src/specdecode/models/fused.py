"""The decoder layer stack of a quantized model in one C call (``cpu_layers.h``).

A decode step of a small model is mostly Python: each of its ~10 operators a layer costs
tens of microseconds of module calls, views and allocations, against a few of arithmetic
(most of the SmolLM2-135M draft's step on either kernel; docs/EXPERIMENTS.md).
``run_layers`` runs the whole stack (norms, the W8A8 or Q4_K linears, RoPE, the cache
writes, attention, SiLU, residual adds) in one call, through the same kernel functions and in the same IEEE operations as the modules of ``native.py``
(whose RMSNorm calls the same ``sd_rmsnorm``), so a pass gives the same bits either way:
tested in ``tests/test_fused.py``, row by row, with rows of their own lengths, trees, layer
subsets and hidden states.

Both kernels have it, ``sd_layers``: ``cpu_kernels.cpp`` (CPUs with AVX512-VNNI) for linears
that are :class:`quant.Int8Linear` in the "vnni" layout or :class:`quant.Q4KLinear` (mixed
freely: a q4 target's Q6_K tensors are int8), ``cpu_kernels_avx2.cpp`` (AVX2 CPUs) for
Int8Linear in the "nk" layout and Q4KLinear, mixed alike. Used by :meth:`native.Transformer.forward_rows`
for decode, verify and draft-tree passes (the :class:`attention.Prefixes` attention), hidden
states of chosen layers included, and prefill in passes of 64 tokens
(:meth:`native.Transformer._chunk`), of a model whose every layer fits; every other pass
(prefill past 2,048 slots or on the tile unit, float models, Qwen3's per-head query and key
norms, Phi-3's fused linears and partial rotary, other devices) runs the modules.
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as _module

from . import quant

# Bumped by every assignment of a module, parameter or buffer to a module in this process
# (torch's global registration hooks), so that a stack knows in one comparison that no
# weight it points into can have been replaced since it last looked.
_generation = 0


def _assigned(*_) -> None:
    global _generation
    _generation += 1


for _register in (_module.register_module_module_registration_hook,
                  _module.register_module_parameter_registration_hook,
                  _module.register_module_buffer_registration_hook):
    _register(_assigned)

_LINEARS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
            ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"),
            ("mlp", "down_proj"))
_INT8 = ("qweight", "wscale", "bias")
_Q4K = (*quant.Q4K_BUFFERS, "bias")


def _words(lin) -> tuple[list[int], tuple[str, ...], int]:
    """A linear's words for the stack (``LW`` in cpu_layers.h): the words before its
    buffers' pointers (kind, padded inputs), its buffers' names, and its words in all (8: the
    pointers padded with zeros)."""
    if isinstance(lin, quant.Q4KLinear):
        return [1, lin.padded_in], _Q4K, 8
    return [0, 0], _INT8, 8


class LayerStack:
    """The weights' pointers of a model's decoder layers for the layer-stack kernel, with the
    tensors they point into (kept alive and compared by identity, so that a model whose
    buffers are reassigned gets a new stack, see :func:`stack`).

    pointers: int64 [n_layers, 2 + 7 * words a linear]; fn: the kernel's stack function.
    """

    def __init__(self, layers, fn):
        rows, refs = [], []
        for layer in layers:
            row = []
            for key in ("input_layernorm", "post_attention_layernorm"):
                norm = layer._modules[key]
                row.append(norm.weight.data_ptr())
                refs += [(layer._modules, key, norm), (norm._parameters, "weight", norm.weight)]
            for parent, name in _LINEARS:
                holder = layer._modules[parent]
                lin = holder._modules[name]
                refs += [(layer._modules, parent, holder), (holder._modules, name, lin)]
                head, names, width = _words(lin)
                for key in names:
                    t = lin._buffers.get(key)
                    head.append(0 if t is None else t.data_ptr())
                    refs.append((lin._buffers, key, t))
                row += head + [0] * (width - len(head))
            rows.append(row)
        self.pointers = torch.tensor(rows, dtype=torch.int64)
        self.fn = fn
        self._generation = _generation
        self._refs = refs  # (the dict holding a module or tensor, its name, what it held)
        self._layers = list(layers)

    def current(self, layers) -> bool:
        """Whether the model's layers still hold the modules and tensors this stack points
        into: one comparison when nothing was assigned to any module since the last check,
        else each reference in turn (~1 ms for 30 layers, a seventh of a small draft's step)."""
        if len(layers) != len(self._layers) or any(a is not b for a, b in zip(layers, self._layers)):
            return False
        if self._generation == _generation:
            return True
        if not all(d.get(k) is t for d, k, t in self._refs):
            return False
        self._generation = _generation
        return True


def _norms_fit(layer, norm_type: type) -> bool:
    if "q_norm" in layer.self_attn._modules or "qkv_proj" in layer.self_attn._modules:
        return False  # Qwen3's per-head norms, Phi-3's fused linears: not in the kernel
    return all(type(n) is norm_type and n.weight.dtype == torch.float32
               and n.weight.device.type == "cpu"
               for n in (layer.input_layernorm, layer.post_attention_layernorm))


def _fits(lin, layout: str) -> bool:
    return (isinstance(lin, quant.Q4KLinear) or isinstance(lin, quant.Int8Linear)
            and lin.layout == layout) and lin.qweight.device.type == "cpu"


def _kernel() -> tuple[object, str] | None:
    """(the stack function, the int8 layout it runs) of the kernel in use, or None."""
    lib = quant.vnni_kernel()[0]
    if lib is not None:
        return lib.sd_layers, "vnni"
    lib = quant.avx2_kernel()
    if lib is not None:
        return lib.sd_layers, "nk"
    return None


def stack(model) -> LayerStack | None:
    """The :class:`LayerStack` of a :class:`native.Transformer` (built once, rebuilt when its
    weights change), or None when the fused kernel does not apply: no CPU kernel in use
    (:func:`quant.vnni_kernel`, :func:`quant.avx2_kernel`), an fp32-less cache, or layers
    the kernel does not run (see the module docstring)."""
    kernel = _kernel()
    if kernel is None:
        return None
    fn, layout = kernel
    layers = model.model.layers
    held = model.__dict__.get("_layer_stack")
    if held is not None and held.fn is fn and held.current(layers):
        return held
    norm_type = type(model.model.norm)
    # (the kernel rotates whole heads, from the model's cos and sin tables)
    a = model.args  # (Gemma's sandwich norms, GeGLU, scale and windows are not in the kernel)
    plain = not (a.sandwich_norms or a.sliding_layers or a.attn_scale) and a.activation == "silu"
    ok = plain and a.rotated == a.head_dim and model.caches[0].k.dtype == torch.float32 and all(
        _norms_fit(layer, norm_type) and all(_fits(getattr(getattr(layer, p), n), layout) for p, n in _LINEARS)
        for layer in layers)
    built = LayerStack(layers, fn) if ok else None
    model.__dict__["_layer_stack"] = built
    return built


# flags of an entry of the kernel's layer list (``which`` in cpu_layers.h), above the layer
# index: skip the layer's attention, or its MLP, sublayer (the residual passes through)
SKIP_ATTN = 1 << 32
SKIP_MLP = 1 << 33


def run(model, layer_stack: LayerStack, x: torch.Tensor, run_layers, caches, pos: torch.Tensor,
        slots: torch.Tensor, lens: torch.Tensor, seen: torch.Tensor | None = None,
        hidden: dict[int, torch.Tensor] | None = None, skip_attn=(), skip_mlp=()) -> torch.Tensor:
    """Run the decoder layers ``run_layers`` (indices) of ``model`` over x, in place.

    x: fp32 [B, T, dim] (the embeddings of the new tokens); caches: the model's per-layer
    :class:`kv_cache.KVCache` (the rows of this pass); pos: int64 [B, T] RoPE positions;
    slots: int64 [B, T] cache slots, -1 for padding; lens: int64 [B, T] the slots each query
    sees (``Prefixes.lens``); seen: None (slots 0..lens-1) or a draft tree's int64 [B, T, S]
    (``Prefixes.slots``); hidden: layer index -> an fp32 [B, T, dim] tensor that gets the
    residual stream after that layer (contiguous; layers in ``run_layers``); skip_attn,
    skip_mlp: layers of ``run_layers`` whose attention (which then writes no cache) or MLP
    sublayer is skipped, passed as the flags :data:`SKIP_ATTN` and :data:`SKIP_MLP` of their
    entries. Returns x, the residual stream after the last layer.
    """
    a = model.args
    b, t, dim = x.shape
    x = x.contiguous()
    k0 = caches[0].k
    cache_ptrs = torch.tensor([[c.k.data_ptr(), c.v.data_ptr()] for c in caches], dtype=torch.int64)
    which = list(run_layers)
    hid = None
    if hidden:
        hid = torch.tensor([hidden[i].data_ptr() if i in hidden else 0 for i in which],
                           dtype=torch.int64)
    which = torch.tensor([i | (SKIP_ATTN if i in skip_attn else 0) | (SKIP_MLP if i in skip_mlp else 0)
                          for i in which], dtype=torch.int64)
    pos, slots, lens = pos.contiguous(), slots.contiguous(), lens.contiguous()
    layer_stack.fn(x.data_ptr(), b, t, dim, layer_stack.pointers.data_ptr(),
                   cache_ptrs.data_ptr(), which.data_ptr(), which.numel(), a.n_heads,
                   a.n_kv_heads, a.head_dim, a.intermediate_size, k0.shape[2], a.norm_eps,
                   model._cos.data_ptr(), model._sin.data_ptr(), pos.data_ptr(),
                   slots.data_ptr(), lens.data_ptr(), 0 if seen is None else seen.data_ptr(),
                   0 if seen is None else seen.shape[2], 0 if hid is None else hid.data_ptr(),
                   a.head_dim ** -0.5)
    return x

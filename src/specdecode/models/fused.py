"""The decoder layer stack of an int8 "nk" model in one C call, on CPUs with AVX2 only.

A decode step of a small model is mostly Python: each of its ~10 operators a layer costs
tens of microseconds of module calls, views and allocations, against a few of arithmetic.
For the 30-layer SmolLM2-135M draft that was ~35 of the step's ~45 ms. ``sd_layers_nk``
(``cpu_kernels_avx2.cpp``) runs the whole stack (norms, the W8A8 linears, RoPE, the cache
writes, attention, SiLU, residual adds) in one call, through the same kernel functions and
in the same IEEE operations as the modules of ``native.py`` (whose RMSNorm uses the same
``sd_rmsnorm`` there), so a pass gives the same bits either way: tested in
``tests/test_fused.py``, row by row, with rows of their own lengths and layer subsets.

Used by :meth:`native.Transformer.forward_rows` for decode and verify passes (the
:class:`native.Prefixes` attention) of a model whose every layer has RMSNorms and
:class:`quant.Int8Linear` linears in the "nk" layout, when no per-layer hidden state is
asked for; every other pass runs the modules.
"""

from __future__ import annotations

import torch

from . import quant

_LINEARS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
            ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"),
            ("mlp", "down_proj"))


class LayerStack:
    """The weights' pointers of a model's decoder layers for ``sd_layers_nk``, with the
    tensors they point into (kept alive and compared by identity, so that a model whose
    buffers are reassigned gets a new stack, see :func:`stack`).

    pointers: int64 [n_layers, 23] (see ``sd_layers_nk``).
    """

    def __init__(self, layers):
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
                for key in ("qweight", "wscale", "bias"):
                    t = lin._buffers.get(key)
                    row.append(0 if t is None else t.data_ptr())
                    refs.append((lin._buffers, key, t))
            rows.append(row)
        self.pointers = torch.tensor(rows, dtype=torch.int64)
        self._refs = refs  # (the dict holding a module or tensor, its name, what it held)
        self._layers = list(layers)

    def current(self, layers) -> bool:
        """Whether the model's layers still hold the modules and tensors this stack points
        into (~0.1 ms for 30 layers, under 1 % of a draft step: dictionary lookups, no module
        attribute access)."""
        return len(layers) == len(self._layers) and all(
            a is b for a, b in zip(layers, self._layers)) and all(
            d.get(k) is t for d, k, t in self._refs)


def _fits(layers, norm_type: type, dtype: torch.dtype) -> bool:
    """Whether every layer has fp32 RMSNorms (``norm_type``: native.RMSNorm, the model's final
    norm's type) and "nk" int8 linears (what the kernel runs)."""
    for layer in layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if type(norm) is not norm_type or norm.weight.dtype != torch.float32 or \
                    norm.weight.device.type != "cpu":
                return False
        for parent, name in _LINEARS:
            lin = getattr(getattr(layer, parent), name)
            if not (isinstance(lin, quant.Int8Linear) and lin.layout == "nk"
                    and lin.qweight.device.type == "cpu"):
                return False
    return dtype == torch.float32


def stack(model) -> LayerStack | None:
    """The :class:`LayerStack` of a :class:`native.Transformer` (built once, rebuilt when its
    weights change), or None when the fused kernel does not apply: no AVX2 kernel in use
    (:func:`quant.avx2_kernel`), or layers the kernel does not run (see the module
    docstring)."""
    if quant.avx2_kernel() is None:
        return None
    layers = model.model.layers
    held = model.__dict__.get("_layer_stack")
    if held is not None and held.current(layers):
        return held
    fits = _fits(layers, type(model.model.norm), model.caches[0].k.dtype)
    built = LayerStack(layers) if fits else None
    model.__dict__["_layer_stack"] = built
    return built


def run(model, layer_stack: LayerStack, x: torch.Tensor, run_layers, caches, pos: torch.Tensor,
        slots: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Run the decoder layers ``run_layers`` (indices) of ``model`` over x, in place.

    x: fp32 [B, T, dim] (the embeddings of the new tokens); caches: the model's per-layer
    :class:`native.KVCache` (the rows of this pass); pos: int64 [B, T] RoPE positions;
    slots: int64 [B, T] cache slots, -1 for padding; lens: int64 [B, T] the slots each query
    sees (``Prefixes.lens``). Returns x, the residual stream after the last layer.
    """
    a = model.args
    lib = quant.avx2_kernel()
    b, t, dim = x.shape
    x = x.contiguous()
    k0 = caches[0].k
    cache_ptrs = torch.tensor([[c.k.data_ptr(), c.v.data_ptr()] for c in caches], dtype=torch.int64)
    which = torch.tensor(list(run_layers), dtype=torch.int64)
    pos, slots, lens = pos.contiguous(), slots.contiguous(), lens.contiguous()
    lib.sd_layers_nk(x.data_ptr(), b, t, dim, layer_stack.pointers.data_ptr(),
                     cache_ptrs.data_ptr(), which.data_ptr(), which.numel(), a.n_heads,
                     a.n_kv_heads, a.head_dim, a.intermediate_size, k0.shape[2], a.norm_eps,
                     model._cos.data_ptr(), model._sin.data_ptr(), pos.data_ptr(),
                     slots.data_ptr(), lens.data_ptr(), a.head_dim ** -0.5)
    return x

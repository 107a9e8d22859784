"""Adapter that serves any ``transformers`` causal LM through :class:`~.base.CausalLM`."""

from __future__ import annotations

import functools
import sys
from types import SimpleNamespace

import torch

from . import attention

ROWS_ATTENTION = "specdecode_rows"


def rows_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask, dropout: float = 0.0, scaling: float | None = None,
                   is_causal: bool | None = None, **kwargs):
    """A ``transformers`` attention function (``AttentionInterface``) whose rows are the
    one-token passes': each of the T new queries attends to its own prefix of the cache (the
    last ``sliding_window`` positions of it in a sliding-window layer), computed as the native
    decoder does (:func:`attention.attend_rows` on the CPU in fp32, else
    :func:`attention.attend_prefixes`), so a verify pass gives every row the bits a one-token
    pass gives it. transformers' own SDPA runs all T rows in one masked product, whose
    reduction order changes with T: with int8 linears those last-bit differences became other
    activation roundings and moved logits by up to 4.4 (SmolLM2-135M, 8 cached tokens), and
    past Gemma 3's 512-token window other greedy tokens.

    query: [B, H, T, D], key/value: [B, H_kv, S, D] (S = cached + T, the new tokens last,
    every position kept: :class:`HFCausalLM` gives sliding layers full caches; rows of one
    length, as this adapter runs them). Returns ([B, T, H, D], None). Prefill
    (T > attention.SDPA_MIN_TOKENS), dropout and position biases go to transformers' SDPA
    function with its mask, soft-capping (Gemma 2) to the model's own eager function
    (row-exactness is a decode property; those models' verify rows may then differ from
    one-token passes in the last bits).
    """
    t, s = query.shape[2], key.shape[2]
    if kwargs.get("softcap") is not None:  # (Gemma 2) SDPA has no soft-capping: the model's own eager
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
        if attention_mask is None or attention_mask.dtype == torch.bool:  # eager adds a float mask
            pos, keys = torch.arange(s - t, s)[:, None], torch.arange(s)[None]
            seen = (keys <= pos) & (keys > pos - kwargs["sliding_window"] if kwargs.get("sliding_window")
                                    else True)  # (SDPA's mask may be None: causal implied)
            if attention_mask is not None:
                seen = seen.to(attention_mask.device) & attention_mask
            attention_mask = torch.zeros(seen.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~seen.to(query.device), float("-inf"))
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if (t > attention.SDPA_MIN_TOKENS or dropout or kwargs.get("position_bias") is not None):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    window = kwargs.get("sliding_window")
    if not window or window >= s:
        return _attend_prefixes(query, key, value, scaling), None
    # row i (position s - t + i) sees its last `window` keys: each row alone, as its one-token
    # pass runs it
    rows = [_attend_prefixes(query[:, :, i:i + 1], key[:, :, max(0, p - window + 1):p + 1],
                             value[:, :, max(0, p - window + 1):p + 1], scaling)
            for i, p in enumerate(range(s - t, s))]
    return torch.cat(rows, dim=1), None


def _attend_prefixes(query, key, value, scaling):
    """Query i of T over keys 0..S-T+i; [B, H, T, D], [B, H_kv, S, D] -> [B, T, H, D]."""
    (b, h, t, d), s = query.shape, key.shape[2]
    lib = attention.attention_kernel_for(query.device, query.dtype, d, h // key.shape[1])
    if lib is not None:
        lens = torch.arange(s - t + 1, s + 1).expand(b, t).contiguous()
        cache = SimpleNamespace(k=key.contiguous(), v=value.contiguous())
        return attention.attend_rows(attention.Prefixes(lib, lens), query, cache, scaling)
    return attention.attend_prefixes(query, key, value, s - t, scaling).transpose(1, 2).contiguous()


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface  # here: importing specdecode stays light
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ROWS_ATTENTION, rows_attention)
    # without a mask function transformers passes no mask at all, and the SDPA fallback of a
    # sliding-window layer attended to the whole prefix (Gemma 3 gave other logits)
    AttentionMaskInterface.register(ROWS_ATTENTION, sdpa_mask)


class HFCausalLM:
    """Adapter over a ``transformers`` causal LM; rollback uses ``DynamicCache.crop``.

    Sliding-window layers (Gemma 2/3, Mistral) get full cache layers: transformers' sliding
    layer keeps only the window and cannot be cropped once it is full, which a speculative
    rollback needs at any length; the sliding mask still limits what each query sees.

    Serves every architecture the native decoder does not cover (slower, and no draft-tree
    masks or layer skipping, which later methods need). Models that take an attention
    function (``AttentionInterface``, most current architectures) get :func:`rows_attention`,
    so that with row-independent linears (int8) a verify pass's rows equal one-token passes
    bit for bit; ``row_exact_attention`` says whether this model took it.
    """

    def __init__(self, hf_model, weight_format: str | None = None):
        self.hf = hf_model.eval()
        _register()
        if self.hf.config._attn_implementation != ROWS_ATTENTION:
            try:
                self.hf.set_attn_implementation(ROWS_ATTENTION)
            except (ValueError, ImportError, AttributeError):
                pass  # an architecture without attention functions: its own attention
        self.row_exact_attention = self.hf.config._attn_implementation == ROWS_ATTENTION
        cfg = hf_model.config
        self.vocab_size = hf_model.get_output_embeddings().out_features  # also when int8-quantized
        self.weight_format = weight_format or str(hf_model.dtype).removeprefix("torch.")
        self.max_context = getattr(cfg, "max_position_embeddings", None) or 1 << 20
        self.seq_len = 0
        self._cache = None

    def allocate(self, batch: int, max_len: int) -> None:
        if max_len > self.max_context:
            raise ValueError(f"max_len={max_len} exceeds the model's context of {self.max_context} tokens")
        self._cache = self._new_cache()
        self.seq_len = 0

    def _new_cache(self):
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=self.hf.config)
        cache.layers = [DynamicLayer() if getattr(layer, "is_sliding", False) else layer
                        for layer in cache.layers]
        return cache

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, num_logits: int | None = None) -> torch.Tensor:
        t = input_ids.shape[1]
        n = t if num_logits is None else num_logits
        out = self.hf(input_ids=input_ids.to(self.device), cache=self._cache, use_cache=True,
                      logits_to_keep=max(n, 1))
        self.seq_len += t
        return out.logits[:, out.logits.shape[1] - n:].float().cpu()  # the CPU side: models/base.py

    @property
    def device(self) -> torch.device:
        """Where the model's weights and cache live (:class:`~.base.CausalLM`)."""
        return self.hf.device

    def fork(self) -> "HFCausalLM":
        return HFCausalLM(self.hf, self.weight_format)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.seq_len:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.seq_len} positions")
        if length == 0:  # also before the first forward, whose layers crop cannot cut yet
            self._cache = self._new_cache()
        elif length < self.seq_len:
            self._cache.crop(length - self.seq_len)  # transformers 5: a negative count to remove
        self.seq_len = length

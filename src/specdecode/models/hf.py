"""Adapter that serves any ``transformers`` causal LM through :class:`~.base.CausalLM`."""

from __future__ import annotations

import torch


class HFCausalLM:
    """Adapter over a ``transformers`` causal LM; rollback uses ``DynamicCache.crop``.

    Serves every architecture the native decoder does not cover (slower, and no draft-tree
    masks or layer skipping, which later methods need).
    """

    def __init__(self, hf_model, weight_format: str | None = None):
        self.hf = hf_model.eval()
        cfg = hf_model.config
        self.vocab_size = hf_model.get_output_embeddings().out_features  # also when int8-quantized
        self.weight_format = weight_format or str(hf_model.dtype).removeprefix("torch.")
        self.max_context = getattr(cfg, "max_position_embeddings", None) or 1 << 20
        self.seq_len = 0
        self._cache = None

    def allocate(self, batch: int, max_len: int) -> None:
        from transformers import DynamicCache

        if max_len > self.max_context:
            raise ValueError(f"max_len={max_len} exceeds the model's context of {self.max_context} tokens")
        self._cache = DynamicCache(config=self.hf.config)
        self.seq_len = 0

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, num_logits: int | None = None) -> torch.Tensor:
        t = input_ids.shape[1]
        n = t if num_logits is None else num_logits
        out = self.hf(input_ids=input_ids, past_key_values=self._cache, use_cache=True,
                      logits_to_keep=max(n, 1))
        self.seq_len += t
        return out.logits[:, out.logits.shape[1] - n:].float()

    def fork(self) -> "HFCausalLM":
        return HFCausalLM(self.hf, self.weight_format)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.seq_len:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.seq_len} positions")
        self._cache.crop(length - self.seq_len)  # transformers 5: a negative count to remove
        self.seq_len = length

"""The native decoder's KV cache: per-layer key/value buffers (:class:`KVCache`) and the
bookkeeping of its rows (:class:`CacheRows`): each row's number of valid positions, rolling
rows back, compacting an accepted tree path, running a span of rows, and the layers a pass
over a subset of layers left behind.

Rolling back is moving a row's pointer (no copy): stale entries past it are overwritten by
the next forward.
"""

from __future__ import annotations

import torch

from .base import ForwardOutput


class KVCache:
    """Preallocated key/value buffers [B, n_kv_heads, max_len, head_dim] for one layer.

    The number of valid positions of each row is kept by the model
    (``Transformer.row_lengths``), so rolling back is moving that pointer; stale entries past
    it are overwritten by the next forward.
    """

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def rows(self, start: int, stop: int) -> "KVCache":
        """The cache of rows start..stop-1: views of these buffers (the batch is outermost)."""
        view = KVCache.__new__(KVCache)
        view.k, view.v = self.k[start:stop], self.v[start:stop]
        return view

    def update(self, where, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [B, H_kv, T, D]; return views [B, H_kv, end, D] of slots 0..end-1.

        where: an int ``start`` (every row writes its T tokens at start..start+T-1, end =
        start+T), or index tensors ``(rows, slots, toks, end)`` [N] (token toks[i] of row
        rows[i] goes to slot slots[i]; rows of their own lengths, padding never written).
        """
        if isinstance(where, int):
            end = where + k.shape[2]
            self.k[:, :, where:end] = k
            self.v[:, :, where:end] = v
        else:
            rows, slots, toks, end = where
            self.k[rows, :, slots] = k[rows, :, toks]
            self.v[rows, :, slots] = v[rows, :, toks]
        return self.k[:, :, :end], self.v[:, :, :end]


class CacheRows:
    """The row bookkeeping of :class:`~specdecode.models.native.Transformer` (a mixin: its
    methods read and replace the model's cache state below; ``forward_rows``, the pass
    itself, is the model's).

    State: ``caches``, one :class:`KVCache` per layer; ``max_len``, their positions;
    ``row_lengths``, valid cached positions per row (replaced, never mutated);
    ``_layer_lengths``, None while every layer's cache holds row_lengths, after a pass that
    skipped layers [layer][row] -> positions that layer holds. Also read: the model's
    ``args.n_layers`` and the device of its RoPE table ``_cos``.
    """

    caches: list[KVCache]
    max_len: int
    row_lengths: list[int]
    _layer_lengths: list[list[int]] | None

    @property
    def seq_len(self) -> int:
        """Positions in the KV cache, the same in every row (the single-request interface).

        Raises ValueError when the rows hold different numbers (read ``row_lengths``).
        Setting it moves every row's pointer, unchecked, as it always did.
        """
        r = self.row_lengths
        if len(r) > 1 and r.count(r[0]) != len(r):
            raise ValueError(f"seq_len is undefined: the rows hold {r} positions; read row_lengths")
        return r[0]

    @seq_len.setter
    def seq_len(self, length: int):
        self._set_lengths([length] * len(self.row_lengths))

    def _set_lengths(self, lengths: list[int]):
        self.row_lengths = lengths
        if self._layer_lengths is not None:
            ll = [[min(h, n) for h, n in zip(held, lengths)] for held in self._layer_lengths]
            self._layer_lengths = None if all(h == lengths for h in ll) else ll

    def rollback(self, length: int):
        """Keep only the first ``length`` cached positions of every row
        (0 <= length <= the shortest row's length; ValueError otherwise)."""
        r = self.row_lengths
        if not 0 <= length <= min(r):
            ragged = "" if r.count(r[0]) == len(r) else f" in its shortest row (rows: {r})"
            raise ValueError(f"cannot roll back to {length}: cache holds {min(r)} "
                             f"positions{ragged}")
        self._set_lengths([length] * len(r))

    def rollback_rows(self, lengths: list[int]):
        """Keep only the first ``lengths[b]`` cached positions of row b, for each row.

        Raises ValueError unless there is one int per row with 0 <= lengths[b] <= row_lengths[b].
        """
        r = self.row_lengths
        if len(lengths) != len(r):
            raise ValueError(f"rollback_rows got {len(lengths)} lengths for {len(r)} cache rows")
        for row, (n, held) in enumerate(zip(lengths, r)):
            if not (isinstance(n, int) and 0 <= n <= held):
                raise ValueError(f"cannot roll back row {row} to {n!r}: it holds {held} "
                                 f"positions (allowed: 0..{held})")
        self._set_lengths(list(lengths))

    @torch.inference_mode()  # the caches may be inference tensors (allocated under it)
    def compact(self, row: int, start: int, keep: list[int]):
        """Keep only some of the positions a pass wrote from ``start`` on in one row.

        After a tree pass that wrote slots start..start+T-1 of ``row`` (T = row_lengths[row] -
        start), the entries at offsets ``keep`` (strictly increasing, each in 0..T-1; for an
        accepted root-to-leaf path, node keep[i] at depth i, so that its RoPE position
        start+i is also its new slot) move to slots start, start+1, ... and the row's length
        becomes start+len(keep), in every layer's cache. Raises ValueError for a row outside
        0..B-1, a start outside 0..row_lengths[row], or offsets that break those rules.
        """
        r = self.row_lengths
        if not (isinstance(row, int) and 0 <= row < len(r)):
            raise ValueError(f"compact: row {row!r} is not a cache row (allowed: 0..{len(r) - 1})")
        if not (isinstance(start, int) and 0 <= start <= r[row]):
            raise ValueError(f"compact: start {start!r} is out of range for row {row} "
                             f"(allowed: 0..{r[row]}, its length)")
        t = r[row] - start
        keep = list(keep)
        if not all(isinstance(o, int) and 0 <= o < t for o in keep) or \
                any(a >= b for a, b in zip(keep, keep[1:])):
            raise ValueError(f"compact: keep={keep} must be strictly increasing offsets in "
                             f"0..{t - 1} (row {row} holds {t} positions from start {start})")
        n = len(keep)
        if keep != list(range(n)):  # else already in place
            src = torch.tensor(keep, device=self._cos.device) + start
            for c in self.caches:
                for buf in (c.k[row], c.v[row]):
                    buf[:, start:start + n] = buf[:, src]
        if self._layer_lengths is not None:
            # a layer skipped by part of the pass holds only a prefix of the offsets
            for held in self._layer_lengths:
                if held[row] > start:
                    held[row] = start + sum(1 for o in keep if o < held[row] - start)
        self._set_lengths(r[:row] + [start + n] + r[row + 1:])

    def forward_row(self, row: int, input_ids: torch.Tensor,
                    num_logits: int | None = None) -> torch.Tensor:
        """Append ``input_ids`` [1, T] to one row as a one-row model would (the pass a request
        run alone makes: the same code path and bits, prefill chunks included), the other rows
        untouched; returns that pass's logits [1, num_logits, V]. For a batched engine's
        prefill of a joining request. Raises ValueError for a row outside 0..B-1, after a
        pass over a subset of layers that is not rolled back, or as :meth:`forward_rows`."""
        if not (isinstance(row, int) and 0 <= row < len(self.row_lengths)):
            raise ValueError(f"row {row!r} is not a cache row (allowed: 0..{len(self.row_lengths) - 1})")
        return self.forward_span(row, row + 1, input_ids, None, num_logits).logits

    def forward_span(self, start: int, stop: int, input_ids: torch.Tensor,
                     lengths: list[int] | None = None, num_logits: int | None = None,
                     output_hidden=(), attn_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None) -> ForwardOutput:
        """:meth:`forward_rows` over cache rows ``start .. stop-1`` only (input_ids [stop-start,
        T], lengths, attn_mask and position_ids per row of the span; output_hidden as there), the other rows untouched and
        not computed: a batch whose active rows are few does not pay for the idle ones' padding. Rows are
        independent in the native kernels, so each row's bits are those of the whole-batch
        pass. Raises ValueError for a span outside 0..B, after a pass over a subset of layers
        that is not rolled back, or as :meth:`forward_rows`."""
        b = len(self.row_lengths)
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= b):
            raise ValueError(f"rows {start!r}..{stop!r} are not a span of cache rows (allowed: 0 <= "
                             f"start < stop <= {b})")
        if self._layer_lengths is not None:
            raise ValueError("a pass over a span of rows after a pass over a subset of layers: roll it back first")
        caches, row_lengths = self.caches, self.row_lengths
        self.caches, self.row_lengths = [c.rows(start, stop) for c in caches], row_lengths[start:stop]
        try:
            out = self.forward_rows(input_ids, lengths, num_logits, attn_mask, position_ids, output_hidden)
            new = self.row_lengths
        finally:
            self.caches, self.row_lengths, self._layer_lengths = caches, row_lengths, None
        self.row_lengths = row_lengths[:start] + new + row_lengths[stop:]
        return out

    def _advance(self, run, partial: bool, lens):
        """Move the row pointers past the new tokens; track layers a pass skipped (``run``:
        the layers that wrote the cache; ``partial``: whether some did not)."""
        new = [s + n for s, n in zip(self.row_lengths, lens)]
        if partial or self._layer_lengths is not None:
            ll = self._layer_lengths or [list(self.row_lengths) for _ in range(self.args.n_layers)]
            ll = [list(h) for h in ll]
            for i in run:
                ll[i] = [e if n else h for e, h, n in zip(new, ll[i], lens)]
            self._layer_lengths = None if all(h == new for h in ll) else ll
        self.row_lengths = new

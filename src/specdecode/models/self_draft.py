"""The native decoder as its own draft model (:class:`SelfDraft`, made by
:meth:`~specdecode.models.native.Transformer.self_draft`): a subset of its layers or
sublayers and/or a lower-precision copy of its weights, drafting on the target's own KV
cache; and the share of the weights such a draft reads (:func:`sublayer_share`), its cost
until measured.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only: the model a self-draft drafts for
    from .native import ModelArgs, Transformer


def sublayer_share(args: ModelArgs, layers, skip_attn=(), skip_mlp=()) -> float:
    """The share of the decoder layers' weights a pass over ``layers`` reads when the
    attention sublayers of ``skip_attn`` and the MLP sublayers of ``skip_mlp`` are skipped
    (a memory-bound pass's cost over a full one's, before it is measured)."""
    a, m = sublayer_weights(args)
    read = sum((0 if i in skip_attn else a) + (0 if i in skip_mlp else m) for i in layers)
    return read / (args.n_layers * (a + m))


def sublayer_weights(args: ModelArgs) -> tuple[int, int]:
    """The weights of one layer's attention (q, k, v, o) and MLP (gate, up, down) sublayers."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    return args.dim * (2 * q + 2 * kv), 3 * args.dim * args.intermediate_size


class SelfDraft:
    """The target as its own draft model (self-speculative decoding): a subset of its layers
    (layer skipping, Draft & Verify arXiv:2309.08168, SWIFT arXiv:2410.06916; early exit,
    LayerSkip arXiv:2404.16710) and/or its weights at a lower precision (``weights``: a
    quantized copy, QSpec arXiv:2410.11305), drafting on the target's own KV cache.

    The CausalLM a :class:`~specdecode.proposers.DraftModelProposer` drives (``seq_len``,
    ``allocate``, ``forward``, ``rollback``), with no cache of its own and no prefill:

    - The committed prefix is read from the target's cache, which holds the full model's
      keys and values of every committed token but the last (the engine's invariant). So
      ``seq_len`` is never below the target's length: the draft is always caught up.
    - Drafted tokens are written into the target's buffers past the target's length, in
      the layers the draft runs only. A slot at or past a row's length is invisible to the
      target, and the verify pass of the round (the last token + every draft token)
      overwrites each slot the draft wrote before the target's length passes it: the draft
      never leaves a trace in the cache the target reads (tests compare it with plain
      decoding's after every round).

    target: the native Transformer that verifies. layers: sorted unique layer indices to run
    (None: all; the final norm and LM head always run). skip_attn, skip_mlp: layers of those
    whose attention, or MLP, sublayer the draft skips, the residual stream passing through
    it (SWIFT, arXiv:2410.06916, skips the two separately): a layer whose attention is
    skipped writes no keys or values (for the cache it is a skipped layer, whose drafted
    slots the verify pass fills), one whose MLP only is skipped writes them as the other
    layers the draft runs do (overwritten by the verify pass alike). weights: a Transformer of the same
    architecture whose layers and head draft instead of the target's (its activations'
    dtype must be the target's cache dtype). vocab: the first token ids its LM head covers
    (None: all; :meth:`~specdecode.models.native.Transformer.self_draft` turns "auto" into
    ``DRAFT_VOCAB`` for a vocabulary more than twice that, else all); its logits of the
    other ids are -inf. Rows: row 0 of a one-row target, or the row a
    batched engine gives the request (:meth:`bind`).
    Raises ValueError for bad layers or sublayers, weights of another shape or dtype, or a
    bad vocab.
    """

    def __init__(self, target: Transformer, layers: list[int] | None = None,
                 weights: Transformer | None = None, vocab: int | None = None,
                 skip_attn=(), skip_mlp=()):
        nl = target.args.n_layers
        if layers is not None:
            layers = list(layers)
            if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < nl for i in layers) \
                    or any(a >= b for a, b in zip(layers, layers[1:])):
                raise ValueError(f"layers={layers}: allowed: sorted unique layer indices in 0..{nl - 1}")
        runs = range(nl) if layers is None else layers
        for name, sub in (("skip_attn", skip_attn), ("skip_mlp", skip_mlp)):
            sub = list(sub)
            if not all(isinstance(i, int) and not isinstance(i, bool) and i in runs for i in sub) \
                    or any(a >= b for a, b in zip(sub, sub[1:])):
                raise ValueError(f"{name}={sub}: allowed: sorted unique layer indices of the layers "
                                 f"the draft runs ({'0..' + str(nl - 1) if layers is None else layers})")
        self.skip_attn, self.skip_mlp = tuple(skip_attn), tuple(skip_mlp)
        source = target if weights is None else weights
        if weights is not None:
            if (weights.args.n_layers, weights.args.dim, weights.args.n_kv_heads, weights.args.head_dim,
                    weights.args.vocab_size) != (nl, target.args.dim, target.args.n_kv_heads,
                                                 target.args.head_dim, target.args.vocab_size):
                raise ValueError("the self-draft's weights must be the target's architecture "
                                 "(layers, width, KV heads, vocabulary)")
            if weights.model.norm.weight.dtype != target.model.norm.weight.dtype:
                raise ValueError(f"the self-draft's activations are {weights.model.norm.weight.dtype}, "
                                 f"the target's KV cache {target.model.norm.weight.dtype}: they must agree")
        self.target, self.layers = target, layers
        self._lm = copy.copy(source)  # its own pointers; weights shared, caches set per pass
        self.row, self._len = 0, 0
        # a draft pass's cost over the target's T(1): the share of the layers' weights it
        # reads until measured (layer_skip.draft_cost; the layer-skip methods set it from
        # their profile)
        self.cost = sublayer_share(target.args, runs, self.skip_attn, self.skip_mlp)
        v = target.args.vocab_size
        if vocab is not None and not (isinstance(vocab, int) and not isinstance(vocab, bool)
                                      and 16 <= vocab <= v and vocab % 16 == 0):
            raise ValueError(f"vocab={vocab!r}: allowed: 'auto', None (the whole vocabulary) or a "
                             f"multiple of 16 in 16..{v} (the first token ids the draft's head covers)")
        self.vocab = vocab
        self._head = source.draft_head(vocab) if vocab is not None else None
        self.vocab_size = target.vocab_size
        self.max_context = target.max_context
        self.weight_format = source.weight_format

    def bind(self, row: int) -> None:
        """Draft on row ``row`` of a batched target (its request's row)."""
        self.row, self._len = row, 0

    @property
    def seq_len(self) -> int:
        return max(self._len, self.target.row_lengths[self.row])

    def allocate(self, batch: int, max_len: int) -> None:
        if batch != 1 or max_len > self.target.max_len:
            raise ValueError(f"a self-draft drafts one request inside the target's cache of "
                             f"{self.target.max_len} positions, asked for {batch} x {max_len}")
        self._len = 0

    def forward(self, input_ids: torch.Tensor, num_logits: int | None = None) -> torch.Tensor:
        """Append input_ids [1, T] at seq_len.. in the layers that draft; logits [1, n, V]
        (all T when num_logits is None)."""
        n = input_ids.shape[1] if num_logits is None else num_logits
        return SelfDraft.forward_together([(self, input_ids, n)])[0]

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.seq_len:
            raise ValueError(f"cannot roll back to {length}: the self-draft holds {self.seq_len} positions")
        self._len = length

    def same_pass(self) -> tuple:
        """Drafts with equal keys (one target, layers and weights) can run their rows' passes
        as one (:meth:`forward_together`)."""
        return (id(self.target), tuple(self.layers or ()), self.layers is None, id(self._lm.model), self.vocab,
                self.skip_attn, self.skip_mlp)

    @staticmethod
    def forward_together(passes: list[tuple["SelfDraft", torch.Tensor, int]]) -> list[torch.Tensor]:
        """Each (draft, input_ids [1, T], n) pass of drafts of one :meth:`same_pass` key, on
        their own rows (a batched engine's requests), as one pass over the span of those rows
        (a draft step of B rows costs about one of 1 row on a memory-bound CPU); returns each
        pass's logits [1, n, V]. Rows are independent in the native kernels: each row's bits
        are those of its pass alone. Raises ValueError for two passes on one row."""
        d0 = passes[0][0]
        t, lm = d0.target, d0._lm
        rows = [d.row for d, _, _ in passes]
        if len(set(rows)) != len(rows):
            raise ValueError(f"two self-draft passes on one row: rows {rows}")
        first, stop = min(rows), max(rows) + 1
        width, n_max = max(ids.shape[1] for _, ids, _ in passes), max(n for _, _, n in passes)
        x = torch.zeros(stop - first, width, dtype=torch.long)
        lengths = [0] * (stop - first)
        starts = list(t.row_lengths[first:stop])
        for d, ids, _ in passes:
            x[d.row - first, :ids.shape[1]] = ids[0]
            lengths[d.row - first] = ids.shape[1]
            starts[d.row - first] = d.seq_len
            if d.seq_len + ids.shape[1] > t.max_len:
                raise ValueError(f"KV cache overflow: {d.seq_len}+{ids.shape[1]} positions > "
                                 f"allocated {t.max_len} in row {d.row}")
        lm.caches = [c.rows(first, stop) for c in t.caches]
        lm.max_len, lm._cos, lm._sin = t.max_len, t._cos, t._sin
        lm.row_lengths, lm._layer_lengths = starts, None
        logits = lm.forward_rows(x, lengths, num_logits=n_max, layers=d0.layers, head=d0._head,
                                 skip_attn=d0.skip_attn, skip_mlp=d0.skip_mlp).logits
        if d0._head is not None:  # tokens past the draft's head are never drafted
            full = logits.new_full((*logits.shape[:2], t.args.vocab_size), float("-inf"))
            full[..., :d0.vocab] = logits
            logits = full
        out = []
        for d, ids, n in passes:
            d._len = starts[d.row - first] + ids.shape[1]
            out.append(logits[d.row - first:d.row - first + 1, n_max - n:n_max])
        return out

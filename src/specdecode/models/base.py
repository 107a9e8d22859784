"""What the engine and the proposers need from a model (:class:`CausalLM`), and the lock that
lets a model serve one request at a time.

Backends: our native Llama-family decoder (:class:`specdecode.models.native.Transformer`) and
:class:`specdecode.models.hf.HFCausalLM`, an adapter over any ``transformers`` causal LM.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class CausalLM(Protocol):
    """What the engine needs from a model (one request, one row).

    Attributes: ``vocab_size`` (embedding rows = logits width V), ``max_context`` (positions),
    ``seq_len`` (positions now in the KV cache), ``weight_format`` (what the weights are:
    "float32", "bfloat16", "int8-kn", ...; part of the profile's cache key); optionally
    ``device`` (where the weights live; none: the CPU, :func:`lm_device`).

    The model is the device boundary: ``forward`` takes token ids from any device (the
    engine and the proposers make them on the CPU) and returns logits on the CPU, so that
    the acceptance rule, sampling and every proposer run on the CPU whatever the model's
    device (a few hundred KB of logits a row copied back from an accelerator).

    What draft heads, draft trees, layer skipping and batching need beyond it is declared by
    the capability protocols below (:class:`RowsLM`, :class:`BatchLM`, :class:`SelfDrafting`;
    of drafts: :class:`MeasuredDraft`, :class:`BindableDraft`): the native decoder
    (:class:`~specdecode.models.native.Transformer`) has them all, the transformers and
    llama.cpp adapters none. Ask with ``isinstance(model, RowsLM)`` and the like, never by
    probing for an attribute.
    """

    vocab_size: int
    max_context: int
    seq_len: int
    weight_format: str

    def allocate(self, batch: int, max_len: int) -> None:
        """Prepare an empty KV cache for ``batch`` rows of up to ``max_len`` positions."""

    def forward(self, input_ids: torch.Tensor, num_logits: int | None = None) -> torch.Tensor:
        """Append ``input_ids`` [B,T] to the cache; return fp32 logits [B,num_logits,V] on
        the CPU of the last ``num_logits`` positions (all T when None, none when 0)."""

    def rollback(self, length: int) -> None:
        """Forget every cached position from ``length`` on."""

    def fork(self) -> "CausalLM":
        """Another handle on the same weights with its own KV cache."""


@dataclass
class ForwardOutput:
    """What :meth:`RowsLM.forward_rows` returns (the native decoder:
    :meth:`~specdecode.models.native.Transformer.forward_rows`).

    logits: fp32 [B, n, V] for n = num_logits positions (see forward_rows). hidden: the
    requested hidden states, each [B, T, dim] in the model dtype, for every new token (padding
    positions hold unspecified values): key i in 0..n_layers-1 is the residual stream after
    decoder layer i, before any norm (transformers' ``output_hidden_states`` entry i+1 for
    i < n_layers-1; transformers has no un-normed entry for the last layer); key
    :data:`~specdecode.models.native.FINAL` (-1) is the final norm's output, transformers' last entry.
    """

    logits: torch.Tensor
    hidden: dict[int, torch.Tensor]


@runtime_checkable
class RowsLM(Protocol):
    """A model whose passes take rows of their own lengths, a mask over the new tokens (a
    draft tree) and explicit positions, and return hidden states: what draft heads, draft
    trees and feature recording need (the native decoder; the rules in full:
    :meth:`~specdecode.models.native.Transformer.forward_rows`).

    ``exact_trees``: whether a tree pass gives each node's row the bits of the one-token
    passes along its path (draft trees are refused otherwise,
    :func:`specdecode.tree.check_tree_target`).
    """

    exact_trees: bool

    def forward_rows(self, input_ids: torch.Tensor, lengths: list[int] | None = None,
                     num_logits: int | None = None, attn_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None, output_hidden=()) -> ForwardOutput:
        """Append the first ``lengths[b]`` (default T) of ``input_ids`` [B, T] to row b; each
        new token sees its row's cached positions and the new tokens ``attn_mask`` (bool
        [B, T, T] or [T, T], default causal) allows, at RoPE positions ``position_ids`` (int
        [B, T] or [T], required with a mask). Returns fp32 logits [B, num_logits, V] on the
        CPU and the hidden states [B, T, dim] of the keys in ``output_hidden`` (layer
        indices; -1: the final norm's output)."""

    def compact(self, row: int, start: int, keep: list[int]) -> None:
        """In ``row``, move the entries a pass wrote at offsets ``keep`` from ``start`` on (an
        accepted tree path, strictly increasing) to slots start, start+1, ...; the row then
        holds start + len(keep) positions."""


@runtime_checkable
class BatchLM(RowsLM, Protocol):
    """A :class:`RowsLM` whose KV cache holds B rows of their own lengths that can be run and
    rolled back one span of rows at a time: what the batched engine
    (:class:`~specdecode.batch.BatchEngine`) and its draft rows need.

    ``row_lengths``: positions cached per row (a list of B ints; replaced, never mutated).
    ``PREFILL_CHUNK``: the most tokens a row's prefill runs in one pass (longer prompts run
    in chunks of it; a batch cuts joining requests' prompts alike).
    """

    row_lengths: list[int]
    PREFILL_CHUNK: int

    def forward_span(self, start: int, stop: int, input_ids: torch.Tensor,
                     lengths: list[int] | None = None, num_logits: int | None = None,
                     output_hidden=(), attn_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None) -> ForwardOutput:
        """:meth:`RowsLM.forward_rows` over rows ``start .. stop-1`` only (input_ids
        [stop-start, T]), the other rows untouched and not computed."""

    def forward_row(self, row: int, input_ids: torch.Tensor,
                    num_logits: int | None = None) -> torch.Tensor:
        """Append ``input_ids`` [1, T] to one row as a one-row model would; logits
        [1, num_logits, V]."""

    def rollback_rows(self, lengths: list[int]) -> None:
        """Keep only the first ``lengths[b]`` cached positions of row b, for each row."""


@runtime_checkable
class SelfDrafting(Protocol):
    """A model that can be its own draft model (layer skipping, a lower-precision copy of its
    weights), drafting on its own KV cache (:class:`~specdecode.models.self_draft.SelfDraft`).

    ``args``: its architecture (a :class:`~specdecode.models.native.ModelArgs`), which the
    draft's layers and sublayers are chosen from (``n_layers``, the sublayers' weights).
    """

    args: object

    def self_draft(self, layers: list[int] | None = None, weights=None,
                   vocab: int | str | None = "auto", skip_attn=(), skip_mlp=()) -> CausalLM:
        """The draft that runs ``layers`` (None: all) of this model, skipping the attention
        sublayers of ``skip_attn`` and the MLP sublayers of ``skip_mlp``, with ``weights``'
        layers (None: its own) and a head over the first ``vocab`` token ids."""


@runtime_checkable
class MeasuredDraft(Protocol):
    """A draft model whose pass cost is known before it drafts (a self-draft).

    ``cost``: one draft pass's time over the target's one-token pass T(1), a fraction (the
    share of the target's weights it reads until measured, then the measured ratio).
    """

    cost: float


@runtime_checkable
class BindableDraft(Protocol):
    """A draft model that drafts on the row a batched engine gives its request (a draft row
    of the batch's draft cache, or a self-draft on the target's row)."""

    def bind(self, row: int) -> None:
        """Draft on row ``row`` from now on, starting empty."""


_LOCKS: "weakref.WeakKeyDictionary[object, threading.Lock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def busy_lock(obj) -> threading.Lock:
    """The lock held while ``obj`` (a model, whose KV cache belongs to the request in flight,
    or a proposer, whose per-request state does) serves a request. Non-blocking acquires
    only: a second request is refused, never queued."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(obj)
        if lock is None:
            lock = _LOCKS[obj] = threading.Lock()
        return lock


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter or buffer (a model's weights, a head, an
    embedding table: everything that drafts for a target must sit on its device)."""
    return next(itertools.chain(module.parameters(), module.buffers())).device


def lm_device(lm) -> torch.device:
    """Where a :class:`CausalLM` runs: its ``device``, or the CPU for one without it."""
    return torch.device(getattr(lm, "device", "cpu"))


def rows_exact(lm, rows: int = 5, context: int = 12, seed: int = 0) -> bool:
    """Whether a verify pass of ``rows`` tokens gives each row the logits of its one-token
    pass bit for bit, probed on ``lm`` with random ids after ``context`` cached ones: the
    property speculative output rests on (a verify pass must score every draft exactly as
    plain decoding would). Proven by tests for the CPU kernels of the integer formats; not so
    for float weights (PyTorch's GEMMs, on the CPU too, may change kernels with the row
    count): :func:`~.loading.load` probes a model off the CPU with it. Uses the
    model's KV cache (allocate(1, ...)): call it between requests. Raises ValueError for a
    model whose context is shorter than ``context + rows``."""
    if context + rows > lm.max_context:
        raise ValueError(f"rows_exact needs {context + rows} positions; the model has {lm.max_context}")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, lm.vocab_size, (1, context + rows), generator=g)
    lm.allocate(1, context + rows)
    lm.forward(ids[:, :context], num_logits=0)
    together = lm.forward(ids[:, context:])
    lm.rollback(context)
    alone = torch.cat([lm.forward(ids[:, i:i + 1]) for i in range(context, context + rows)], 1)
    lm.rollback(0)
    return torch.equal(together, alone)

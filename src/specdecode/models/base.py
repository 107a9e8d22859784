"""What the engine and the proposers need from a model (:class:`CausalLM`), and the lock that
lets a model serve one request at a time.

Backends: our native Llama-family decoder (:class:`specdecode.models.native.Transformer`) and
:class:`specdecode.models.hf.HFCausalLM`, an adapter over any ``transformers`` causal LM.
"""

from __future__ import annotations

import itertools
import threading
import weakref
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
    device (a few hundred KB of logits a row copied back from an accelerator). The native decoder also offers what draft
    heads, draft trees, layer skipping and batching need (rows with their own lengths,
    attention masks, hidden states, a subset of layers, compaction:
    :meth:`~specdecode.models.native.Transformer.forward_rows`); the transformers adapter
    does not.
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

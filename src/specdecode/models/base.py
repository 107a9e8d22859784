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
    "float32", "bfloat16", "int8-kn", ...; part of the profile's cache key). The native decoder also offers what draft
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
        """Append ``input_ids`` [B,T] to the cache; return fp32 logits [B,num_logits,V]
        of the last ``num_logits`` positions (all T when None, none when 0)."""

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

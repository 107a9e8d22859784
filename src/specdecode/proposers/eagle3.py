"""EAGLE-3: a one-layer draft head on three of the target's own hidden states proposes a
chain (Li et al., arXiv:2503.01840)."""

from __future__ import annotations

import torch

from ..heads import Eagle3Head
from .base import DraftOutput, Proposer, RequestState


class Eagle3Proposer(Proposer):
    """Proposes the greedy chain of an :class:`~specdecode.heads.Eagle3Head`.

    The head keeps its own KV cache, one slot per position. After the prefill and after
    every verify pass the engine hands over the target's residual streams after the
    ``aux_layers`` for the newly committed positions (``take_hidden``); at the next
    ``propose`` each such position p becomes a cache row built from them and the token
    x[p+1] (the head's step 0 on the target's real states: the rows a previous round
    drafted from its own approximations are overwritten, the pitfall that cost vLLM 8-15 %
    acceptance length). The last real row's output guesses the token after the last
    committed one; each further chain step reads the step before's token and ``pre`` state
    at the next position. Candidates are point masses (lossless for every acceptance rule).
    A one-token prompt's first round drafts nothing (no state yet).

    aux_layers: the target layers the head was trained on
    (:func:`~specdecode.heads.aux_layers`). Raises ValueError for a layer list that
    is not three layers.
    """

    name = "eagle3"
    default_k = 4

    def __init__(self, head: Eagle3Head, aux_layers: list[int]):
        if len(aux_layers) != 3:
            raise ValueError(f"EAGLE-3 fuses three target layers, got {aux_layers!r} (a target of "
                             "at least 7 layers is needed)")
        self.head = head.eval()
        self.hidden_keys = tuple(aux_layers)
        self._draft_ids = head.draft_ids  # draft id -> target id
        self._k = self._v = None
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending: tuple[int, torch.Tensor] | None = None
        self._cached = 0

    def reset(self, state: RequestState, max_total_len: int) -> None:
        a = self.head.args
        shape = (a.n_kv_heads, max_total_len + 1, a.head_dim)
        self._k = torch.zeros(shape, device=self.head.d2t.device)
        self._v = torch.zeros_like(self._k)
        self._pending, self._cached, self._last = None, 0, None

    def take_hidden(self, start: int, hidden: dict[int, torch.Tensor]) -> None:
        feats = torch.cat([hidden[i] for i in self.hidden_keys], dim=-1)
        self._cached = min(self._cached, start)
        if self._pending is not None:
            ps, old = self._pending
            if ps + len(old) >= start >= ps:  # contiguous (or overlapping): keep the earlier rows
                feats = torch.cat([old[:start - ps], feats])
                start = ps
        self._pending = (start, feats)

    def _step(self, ids: torch.Tensor, hidden: torch.Tensor, start: int):
        """Rows at positions start.. (len(ids) of them) written into the cache and attending
        to the slots up to their own: returns (pre, logits) of the last row."""
        head = self.head
        n = len(ids)
        pos = torch.arange(start, start + n, device=ids.device)
        q, k, v, residual = head.project(ids, hidden, pos)
        self._k[:, start:start + n] = k
        self._v[:, start:start + n] = v
        keys, vals = self._k[:, :start + n], self._v[:, :start + n]
        s = head.scores(q, keys)
        if n > 1:
            slot = torch.arange(start + n, device=ids.device)
            s = s.masked_fill(slot[None, None, :] > pos[None, :, None], float("-inf"))
        attn = head.mix(torch.softmax(s, dim=-1), vals)
        pre, logits = head.finish(attn[:, -1:], residual[-1:])
        return pre, logits[0]

    def propose(self, state: RequestState, k: int) -> DraftOutput:
        if k <= 0 or (self._pending is None and self._cached == 0):
            return DraftOutput.empty()
        head, tokens, ids_map = self.head, state.tokens, self._draft_ids
        with torch.no_grad():
            if self._pending is not None:
                ps, feats = self._pending
                self._pending = None
                ids = torch.tensor(tokens[ps + 1:ps + 1 + len(feats)])
                pre, logits = self._step(ids, head.fc(feats.float()), ps)
                self._cached = ps + len(feats)
                self._last = (pre, logits)
            pre, logits = self._last
            pos = self._cached - 1  # the last real row's position (it predicted tokens[-1])
            out = []
            for i in range(k):
                tok = int(ids_map[int(logits.argmax())])
                out.append(tok)
                if i + 1 == k or pos + 2 + i >= self._k.shape[1]:
                    break
                pre, logits = self._step(torch.tensor([tok]), pre, pos + 1 + i)
        return DraftOutput(torch.tensor([out]), None, self.name)

"""EAGLE-3: a one-layer draft head on three of the target's own hidden states proposes a
chain, or the chain with its siblings as a draft tree (Li et al., arXiv:2503.01840)."""

from __future__ import annotations

import torch

from ..heads import Eagle3Head
from ..tree import DraftTree
from .base import DraftOutput, Proposer, RequestState


class Eagle3Proposer(Proposer):
    """Proposes the greedy chain of an :class:`~specdecode.heads.Eagle3Head` (or, with
    ``tree_width``, a tree around it).

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
    (:func:`~specdecode.heads.aux_layers`). tree_width: w > 1 proposes a draft tree: the
    chain, and at each of its depths the head's next w - 1 most likely tokens as leaves
    beside it (from the logits the chain's steps computed anyway: no extra head step; the
    verify pass has 1 + w * (drafted tokens) rows), so that where the target rejects the
    chain's token for one of those it keeps it and the bonus token after it; the shape of
    ``draft:tree=W``. It needs a target with exact tree passes
    (:func:`~specdecode.tree.check_tree_target`). 1 (default): the chain.
    Raises ValueError for a layer list that is not three layers, or a tree_width outside 1..8.
    """

    name = "eagle3"
    default_k = 4

    def __init__(self, head: Eagle3Head, aux_layers: list[int], tree_width: int = 1):
        if len(aux_layers) != 3:
            raise ValueError(f"EAGLE-3 fuses three target layers, got {aux_layers!r} (a target of "
                             "at least 7 layers is needed)")
        if isinstance(tree_width, bool) or not isinstance(tree_width, int) or not 1 <= tree_width <= 8:
            raise ValueError(f"eagle3 tree_width={tree_width!r} is invalid; allowed: an integer in "
                             "1..8 (1: no tree)")
        self.tree_width = tree_width
        self.head = head.eval()
        self.hidden_keys = tuple(aux_layers)
        self._draft_ids = head.draft_ids  # draft id -> target id
        self._k = self._v = None
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending: tuple[int, torch.Tensor] | None = None
        self._cached = 0

    @property
    def makes_trees(self) -> bool:
        return self.tree_width > 1

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
            out, alts = [], []  # alts: per depth, the tree's other candidates there
            for i in range(k):
                top = ids_map[logits.topk(min(self.tree_width, len(logits))).indices].tolist()
                out.append(top[0])
                alts.append(top[1:])
                if i + 1 == k or pos + 2 + i >= self._k.shape[1]:
                    break
                pre, logits = self._step(torch.tensor([top[0]]), pre, pos + 1 + i)
        if not self.makes_trees:
            return DraftOutput(torch.tensor([out]), None, self.name)
        tokens, parents, parent = [], [], -1
        for tok, others in zip(out, alts):  # the chain's node first, then its siblings (leaves)
            here = [tok] + others
            tokens, parents, parent = tokens + here, parents + [parent] * len(here), len(tokens)
        tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
        return DraftOutput(tree.token_ids[None], None, self.name, tree=tree)

"""EAGLE-3: a one-layer draft head on three of the target's own hidden states proposes a
chain, the chain with its siblings, or EAGLE-2's dynamic tree (Li et al., arXiv:2503.01840,
arXiv:2406.16858)."""

from __future__ import annotations

import torch

from ..heads import Eagle3Head
from ..tree import MAX_NODES, DraftTree
from .base import DraftOutput, Proposer, RequestState


class Eagle3Proposer(Proposer):
    """Proposes the greedy chain of an :class:`~specdecode.heads.Eagle3Head` (or, with
    ``tree_width``, a tree around it; with ``tree_nodes``, a dynamic tree).

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
    (:func:`~specdecode.tree.check_tree_target`). 1 (default): the chain. tree_nodes: N
    proposes EAGLE-2's dynamic tree of N nodes instead (:meth:`_dynamic_tree`, expanding
    max(2, tree_width) paths a depth); None (default): no dynamic tree.
    Raises ValueError for a layer list that is not three layers, a tree_width outside 1..8 or
    a tree_nodes outside 1..MAX_NODES.
    """

    name = "eagle3"
    default_k = 4

    def __init__(self, head: Eagle3Head, aux_layers: list[int], tree_width: int = 1,
                 tree_nodes: int | None = None):
        if len(aux_layers) != 3:
            raise ValueError(f"EAGLE-3 fuses three target layers, got {aux_layers!r} (a target of "
                             "at least 7 layers is needed)")
        if isinstance(tree_width, bool) or not isinstance(tree_width, int) or not 1 <= tree_width <= 8:
            raise ValueError(f"eagle3 tree_width={tree_width!r} is invalid; allowed: an integer in "
                             "1..8 (1: no tree)")
        if tree_nodes is not None and (isinstance(tree_nodes, bool) or not isinstance(tree_nodes, int)
                                       or not 1 <= tree_nodes <= MAX_NODES):
            raise ValueError(f"eagle3 tree_nodes={tree_nodes!r} is invalid; allowed: an integer in "
                             f"1..{MAX_NODES}, or None (no dynamic tree)")
        self.tree_width, self.tree_nodes = tree_width, tree_nodes
        self.head = head.eval()
        self.hidden_keys = tuple(aux_layers)
        self._draft_ids = head.draft_ids  # draft id -> target id
        self._k = self._v = None
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending: tuple[int, torch.Tensor] | None = None
        self._cached = 0

    @property
    def makes_trees(self) -> bool:
        return self.tree_width > 1 or self.tree_nodes is not None

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
            if self.tree_nodes is not None:
                return self._dynamic_tree(pre, logits, pos, k)
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

    def _dynamic_tree(self, pre: torch.Tensor, logits: torch.Tensor, pos: int, k: int) -> DraftOutput:
        """EAGLE-2's dynamic draft tree (Li et al., arXiv:2406.16858): the root's W most likely
        tokens, then at each depth up to K the W nodes of the depth before with the highest
        cumulative log-probability of their path are fed to the head together (each attending
        to the committed rows and its own ancestors, as a chain step would) and each gets its
        W most likely children; of every node made, the ``tree_nodes`` of highest cumulative
        log-probability are kept (a node scores no higher than its parent, so they form a
        tree). W = ``tree_width`` (at least 2)."""
        head, ids_map = self.head, self._draft_ids
        w = max(2, self.tree_width)
        k = min(k, self._k.shape[1] - pos - 1)  # positions the head's cache can hold
        keys, vals = self._k[:, :pos + 1], self._v[:, :pos + 1]  # the committed rows
        # every node: (score, depth, parent, draft id); fed: node -> (k, v, pre) once fed
        logp = torch.log_softmax(logits.float(), -1)
        top = logp.topk(min(w, len(logp)))
        nodes = [(float(sc), 1, -1, int(i)) for sc, i in zip(top.values, top.indices)]
        layer = list(range(len(nodes)))
        fed: dict[int, tuple] = {-1: (None, None, pre[0])}
        for depth in range(2, k + 1):
            chosen = sorted(layer, key=lambda n: -nodes[n][0])[:w]
            pres = torch.stack([fed[nodes[n][2]][2] for n in chosen])  # each parent's state
            toks = ids_map[torch.tensor([nodes[n][3] for n in chosen])]
            q, kk, vv, residual = head.project(toks, pres, torch.full((len(chosen),), pos + depth - 1))
            for j, n in enumerate(chosen):
                fed[n] = (kk[:, j], vv[:, j], None)
            # each chosen node's keys: the committed rows, then its path (ancestors and itself)
            paths = [self._path(n, nodes) for n in chosen]
            pk = torch.stack([torch.stack([fed[a][0] for a in path], 1) for path in paths], 1)  # [KV, W, d, hd]
            pv = torch.stack([torch.stack([fed[a][1] for a in path], 1) for path in paths], 1)
            g = q.shape[0] // kk.shape[0]
            s_c = head.scores(q, keys)  # [H, W, C]
            s_p = torch.einsum("hwd,hwjd->hwj", q, pk.repeat_interleave(g, 0)) * head.args.head_dim ** -0.5
            p = torch.softmax(torch.cat([s_c, s_p], -1), -1)
            c = keys.shape[1]
            attn = head.mix(p[..., :c], vals) + torch.einsum("hwj,hwjd->hwd", p[..., c:], pv.repeat_interleave(g, 0))
            new_pre, out = head.finish(attn, residual)
            layer = []
            for j, n in enumerate(chosen):
                fed[n] = fed[n][:2] + (new_pre[j],)
                lp = torch.log_softmax(out[j].float(), -1).topk(min(w, out.shape[-1]))
                for sc, i in zip(lp.values, lp.indices):
                    layer.append(len(nodes))
                    nodes.append((nodes[n][0] + float(sc), depth, n, int(i)))
        # the best tree_nodes nodes, parents first (a tie keeps the shallower node first)
        order = sorted(range(len(nodes)), key=lambda n: (-nodes[n][0], nodes[n][1], n))
        keep: list[int] = []
        for n in order:
            if len(keep) == self.tree_nodes:
                break
            if nodes[n][2] < 0 or nodes[n][2] in keep:
                keep.append(n)
        keep.sort(key=lambda n: (nodes[n][1], -nodes[n][0]))  # by depth; siblings most likely first
        index = {n: i for i, n in enumerate(keep)}
        tokens = ids_map[torch.tensor([nodes[n][3] for n in keep])]
        parents = torch.tensor([index[nodes[n][2]] if nodes[n][2] >= 0 else -1 for n in keep])
        tree = DraftTree(tokens, parents)
        return DraftOutput(tree.token_ids[None], None, self.name, tree=tree)

    @staticmethod
    def _path(n: int, nodes: list[tuple]) -> list[int]:
        """The fed nodes from depth 1 down to node n."""
        path = []
        while n >= 0:
            path.append(n)
            n = nodes[n][2]
        return path[::-1]

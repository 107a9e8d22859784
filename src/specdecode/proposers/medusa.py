"""Medusa: draft heads on the target's own last hidden state propose a chain or a static tree
(Cai et al., arXiv:2401.10774)."""

from __future__ import annotations

import torch

from ..heads import MedusaHeads
from ..models.native import FINAL
from ..tree import DraftTree
from ..verify import LossyTypical
from .base import DraftOutput, Proposer, RequestState


class MedusaProposer(Proposer):
    """Proposes from :class:`~specdecode.heads.MedusaHeads`: no forward pass of any model,
    only the heads on the target's final hidden state of the row that predicted the last
    committed token (the engine hands it over after the prefill and every verify pass,
    ``take_hidden``).

    tree: Medusa's static tree as node paths of candidate ranks, e.g. ``[(0,), (1,), (0, 0)]``:
    node (r1, ..., rd) sits at depth d and holds head d-1's (r_d + 1)-th most likely token;
    every node's path without its last rank must be a node too. None (default): the chain of
    each head's most likely token, a linear draft of up to K tokens that any native target
    verifies; a tree with ranks above 0 needs a target with exact tree passes
    (:func:`~specdecode.tree.check_tree_target`). A round drafts nodes of depth <= K only. The
    candidates are point masses (lossless for every acceptance rule). The first round of a
    one-token prompt drafts nothing (no hidden state yet).
    lossy_typical: None (default: lossless), or a :class:`~specdecode.verify.LossyTypical`:
    the engine then verifies this proposer's drafts in sampled requests with Medusa's typical
    acceptance (:func:`~specdecode.verify.typical_verify`, over a tree
    :func:`~specdecode.verify.typical_verify_tree`), which CHANGES THE OUTPUT (not the
    target's sampling distribution); greedy requests keep greedy verification.
    Raises ValueError for an empty or malformed tree, one deeper than the heads, ranks
    beyond their vocabulary, or a lossy_typical that is not a LossyTypical or None.
    """

    name = "medusa"
    default_k = 3
    hidden_keys = (FINAL,)

    def __init__(self, heads: MedusaHeads, tree: list[tuple[int, ...]] | None = None,
                 lossy_typical: LossyTypical | None = None):
        if lossy_typical is not None and not isinstance(lossy_typical, LossyTypical):
            raise ValueError(f"lossy_typical = {lossy_typical!r} is invalid; allowed: None (lossless) or "
                             "a LossyTypical, e.g. LossyTypical(0.09)")
        self.lossy_typical = lossy_typical
        self.heads = heads.eval()
        h, v = heads.num_heads, heads.vocab_size
        nodes = [tuple(p) for p in tree] if tree is not None else [(0,) * d for d in range(1, h + 1)]
        if not nodes:
            raise ValueError("the Medusa tree is empty: give at least one node, e.g. [(0,)]")
        for p in nodes:
            if not p or len(p) > h or any(isinstance(r, bool) or not isinstance(r, int)
                                          or not 0 <= r < v for r in p):
                raise ValueError(f"Medusa tree node {p!r} is invalid; allowed: a tuple of 1..{h} "
                                 f"candidate ranks in 0..{v - 1} (one per depth)")
        self.check_shape(nodes)
        self.nodes = sorted(nodes, key=lambda p: (len(p), p))
        self._hidden: torch.Tensor | None = None

    @staticmethod
    def check_shape(nodes: list[tuple[int, ...]]) -> None:
        """Raises ValueError for a node list that is not a tree: a node whose parent (its
        path less the last rank) is missing, or a node given twice."""
        for p in nodes:
            if len(p) > 1 and p[:-1] not in nodes:
                raise ValueError(f"Medusa tree node {p!r} has no parent {p[:-1]!r} in the tree")
        if len(set(nodes)) != len(nodes):
            raise ValueError("Medusa tree nodes repeat")

    @staticmethod
    def siblings_tree(num_heads: int, width: int) -> list[tuple[int, ...]]:
        """The chain of each head's most likely token with the next ``width`` - 1 candidates
        of each head beside it (the shape of ``draft:tree=W``)."""
        return [(0,) * (d - 1) + (r,) for d in range(1, num_heads + 1) for r in range(width)]

    @property
    def makes_trees(self) -> bool:
        return any(r > 0 for p in self.nodes for r in p)

    def reset(self, state: RequestState, max_total_len: int) -> None:
        self._hidden = None

    def take_hidden(self, start: int, hidden: dict[int, torch.Tensor]) -> None:
        self._hidden = hidden[FINAL][-1]

    def propose(self, state: RequestState, k: int) -> DraftOutput:
        if self._hidden is None or k <= 0:
            return DraftOutput.empty()
        nodes = [p for p in self.nodes if len(p) <= k]
        with torch.no_grad():
            logits = self.heads(self._hidden, max(len(p) for p in nodes))  # [depth, V]
        v = min(logits.shape[-1], state.target_vocab_size)
        ranked = logits[:, :v].topk(min(v, 1 + max(max(p) for p in nodes)), dim=-1).indices.tolist()
        tokens = [ranked[len(p) - 1][p[-1]] for p in nodes]
        if not self.makes_trees:
            return DraftOutput(torch.tensor([tokens]), None, self.name)
        index = {p: i for i, p in enumerate(nodes)}
        parents = [index[p[:-1]] if len(p) > 1 else -1 for p in nodes]
        tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
        return DraftOutput(tree.token_ids[None], None, self.name, tree=tree)

"""Draft trees: several candidate continuations verified in one target forward pass.

A proposer that offers more than one candidate per position (the top-k of a draft model or a
draft head, SpecInfer's i.i.d. samples) arranges them as a tree below the root, the last
committed token. The verify pass feeds the root and every node at once, each node attending
to the committed context, its ancestors and itself (:meth:`DraftTree.attn_mask`) at the
position of its depth (:meth:`DraftTree.position_ids`); row 0 of the pass gives the
distribution after the root and row i + 1 the one after node i. The acceptance rules over a
tree are :func:`specdecode.verify.verify_tree` and :func:`specdecode.verify.greedy_verify_tree`;
they return the accepted root-to-node path, whose cache entries
:meth:`specdecode.models.native.Transformer.compact` keeps.

Sources: SpecInfer (Miao et al., arXiv:2305.09781, token-tree verification), Medusa (Cai et
al., arXiv:2401.10774, static trees), EAGLE-2 (Li et al., arXiv:2406.16858, dynamic trees).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .models.base import RowsLM


# The most nodes a tree pass verifies: a pass of MAX_NODES + 1 rows is the longest the exact
# attention kernel runs (attention.SDPA_MIN_TOKENS); the engine prunes bigger trees.
MAX_NODES = 64
MAX_TREE_WIDTH = 8  # the widest draft tree: candidates kept per node (draft_tree_width, tree=W)


@dataclass(frozen=True, eq=False)
class DraftTree:
    """N draft nodes below the root, parents before children.

    token_ids: int64 [N], the token of each node.
    parents: int64 [N]; parents[i] in -1..i-1, the node's parent (-1: a child of the root).
    Siblings are tried in index order by the sampling rule, so a proposer lists the children
    it trusts most first. A linear draft of K tokens is the chain ``parents = [-1, 0, 1, ...]``
    (:meth:`chain`).

    Raises ValueError for tensors that are not int64 vectors of one length, or a parent that
    is not an earlier node or -1 (naming the node and its parent).
    """

    token_ids: torch.Tensor
    parents: torch.Tensor
    _children: tuple = field(init=False, repr=False, compare=False)
    _depths: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        t, p = self.token_ids, self.parents
        for name, x in (("token_ids", t), ("parents", p)):
            if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype != torch.long:
                got = f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"DraftTree {name} must be an int64 vector, got {got}")
        if t.shape != p.shape:
            raise ValueError(f"DraftTree has {t.numel()} token_ids but {p.numel()} parents")
        if t.numel() and t.min() < 0:
            raise ValueError(f"DraftTree token_ids must be >= 0, got {t.min().item()}")
        kids: list[list[int]] = [[] for _ in range(t.numel() + 1)]
        depths: list[int] = []
        for i, parent in enumerate(p.tolist()):
            if not -1 <= parent < i:
                raise ValueError(f"DraftTree node {i} has parent {parent}: allowed -1 (the root) "
                                 f"to {i - 1} (parents come before their children)")
            kids[parent + 1].append(i)
            depths.append(1 if parent < 0 else depths[parent] + 1)
        object.__setattr__(self, "_children", tuple(tuple(k) for k in kids))
        object.__setattr__(self, "_depths", tuple(depths))

    @classmethod
    def chain(cls, token_ids: list[int] | torch.Tensor) -> "DraftTree":
        """The tree of a linear draft: node i is the child of node i - 1."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        return cls(ids, torch.arange(ids.numel(), dtype=torch.long) - 1)

    @property
    def num_nodes(self) -> int:
        """N, the draft nodes (the verify pass has N + 1 rows, the root's included)."""
        return self.token_ids.numel()

    def children(self, row: int) -> tuple[int, ...]:
        """The nodes whose parent is pass row ``row`` (0: the root; i + 1: node i)."""
        return self._children[row]

    def depths(self) -> torch.Tensor:
        """int64 [N]: 1 for a child of the root, its parent's depth + 1 otherwise."""
        return torch.tensor(self._depths, dtype=torch.long)

    @property
    def depth(self) -> int:
        """The longest root-to-leaf path, in nodes (0 for an empty tree)."""
        return max(self._depths, default=0)

    def input_ids(self, root_token: int) -> torch.Tensor:
        """int64 [N + 1]: the verify pass's tokens, the root (last committed token) first."""
        return torch.cat([torch.tensor([root_token], dtype=torch.long), self.token_ids])

    def position_ids(self, start: int) -> torch.Tensor:
        """int64 [N + 1]: the RoPE positions of the pass, ``start`` (the root's) + depth."""
        return start + torch.cat([torch.zeros(1, dtype=torch.long), self.depths()])

    def attn_mask(self) -> torch.Tensor:
        """bool [N + 1, N + 1]: True at [i, j] where pass row i sees row j (the root, its
        ancestors and itself); the committed context is visible to every row besides."""
        n = self.num_nodes
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        mask[0, 0] = True
        for i, parent in enumerate(self.parents.tolist()):
            mask[i + 1] = mask[parent + 1]
            mask[i + 1, i + 1] = True
        return mask

    def prune(self, keep: torch.Tensor) -> "DraftTree":
        """The tree of the nodes where ``keep`` (bool [N]) is True, renumbered in order; a
        kept node's parent must be kept too (ValueError otherwise). ``keep = arange(N) < n``
        (the first n nodes) and ``depths() <= d`` always qualify."""
        keep = torch.as_tensor(keep, dtype=torch.bool)
        if keep.shape != self.token_ids.shape:
            raise ValueError(f"prune: keep has shape {list(keep.shape)}, expected [{self.num_nodes}]")
        new = torch.cumsum(keep.long(), 0) - 1  # old index -> new index
        parents = self.parents[keep]
        orphans = (parents >= 0) & ~keep[parents.clamp(min=0)]
        if orphans.any():
            raise ValueError("prune would keep a node without its parent")
        return DraftTree(self.token_ids[keep], torch.where(parents >= 0, new[parents.clamp(min=0)], -1))

    def trim(self, depth: int, nodes: int) -> "DraftTree":
        """This tree cut to paths of at most ``depth`` nodes and at most ``nodes`` nodes in
        all: the chain of first children first (a proposer's most trusted path), then the
        other nodes in order while they fit (self when nothing is cut)."""
        depth = min(depth, nodes)
        parents, depths = self.parents.tolist(), self._depths
        chain, node = set(), -1
        while self.children(node + 1) and len(chain) < depth:
            node = self.children(node + 1)[0]
            chain.add(node)
        keep, extra = [], nodes - len(chain)
        for i, parent in enumerate(parents):
            ok = depths[i] <= depth and (parent < 0 or keep[parent])
            if ok and i not in chain:
                ok, extra = extra > 0, extra - 1
            keep.append(ok)
        return self if all(keep) else self.prune(torch.tensor(keep, dtype=torch.bool))

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node`` (-1: the empty path). Raises
        ValueError for a node outside -1..N-1."""
        if not (isinstance(node, int) and -1 <= node < self.num_nodes):
            raise ValueError(f"node {node!r} is not in the tree (allowed: -1..{self.num_nodes - 1})")
        out = []
        while node >= 0:
            out.append(node)
            node = int(self.parents[node])
        return out[::-1]


def check_tree_target(target) -> None:
    """Raise ValueError unless ``target`` (a :class:`~specdecode.models.base.CausalLM`)
    verifies draft trees with the bits of its one-token passes
    (:attr:`~specdecode.models.native.Transformer.exact_trees`), so that trees keep its output
    exactly its own decoding."""
    if not (isinstance(target, RowsLM) and target.exact_trees):
        raise ValueError(
            "draft trees need a target whose tree passes give the bits of its one-token passes: "
            "the native runtime on a CPU with its attention kernel (AVX512 or AVX2, fp32 activations); this target "
            f"({type(target).__name__}, {getattr(target, 'weight_format', '?')}) cannot, so its "
            "output would not be exactly its own decoding. Use a draft tree width of 1 (no tree)")


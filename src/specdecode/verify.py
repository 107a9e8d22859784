"""The acceptance rules of speculative decoding, pure functions of tensors: which draft
tokens the target keeps, and the one recovered or bonus token after them — speculative
sampling (:func:`rejection_sample`; :func:`greedy_verify`, its T -> 0 case), the
drafter-invariant Gumbel rule (:func:`gumbel_verify`), and both over a draft tree
(:func:`verify_tree`, :func:`greedy_verify_tree`)."""

from __future__ import annotations

import torch

from .sampling import sample
from .tree import DraftTree


def rejection_sample(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, generator: torch.Generator | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: keep a prefix of the drafts, then one recovered or bonus token.

    Leviathan et al. 2023 (arXiv:2211.17192, Algorithm 1) and Chen et al. 2023
    (arXiv:2302.01318): draft token x_i is accepted with probability min(1, p_i(x)/q_i(x)),
    p = target, q = draft. At the first rejection a *recovered* token is drawn from
    norm(max(0, p_i - q_i)); when all K are accepted a *bonus* token is drawn from p_K.
    The output is distributed exactly as the target's sampling distribution.

    draft_token_ids: [B,K] int64 (K may be 0).
    draft_probs: [B,K,V'] the distributions the drafts were drawn from (V' <= V; missing
        rows count as probability 0), or None for a point-mass proposal (prompt lookup,
        greedy draft): q_i = one-hot(x_i).
    target_probs: [B,K+1,V] processed target distributions (one-hot rows for greedy).
    Returns (output_ids [B,K+1] int64 padded with -1 after the emitted tokens,
    num_accepted [B] int64 in 0..K). Emitted per row: num_accepted + 1 tokens.
    """
    b, k = draft_token_ids.shape
    v = target_probs.shape[-1]
    if target_probs.shape[:2] != (b, k + 1):
        raise ValueError(f"target_probs has shape {tuple(target_probs.shape)}, expected [{b},{k + 1},V]")
    if draft_probs is not None and draft_probs.shape[-1] < v:
        draft_probs = torch.nn.functional.pad(draft_probs, (0, v - draft_probs.shape[-1]))
    ids = draft_token_ids[..., None]
    p = target_probs[:, :k].gather(2, ids)[..., 0]
    q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(2, ids)[..., 0]
    u = torch.rand(b, k, generator=generator, device=p.device)
    accepted = u * q < p  # u < p/q without dividing by q
    num_accepted = accepted.long().cumprod(1).sum(1)

    rows = torch.arange(b, device=p.device)
    p_next = target_probs[rows, num_accepted]  # [B,V]: p at the first rejection, or p_K
    if draft_probs is None:
        q_next = torch.zeros_like(p_next)
        rejected = num_accepted < k
        q_next[rows[rejected], draft_token_ids[rows[rejected], num_accepted[rejected]]] = 1.0
    else:
        padded = torch.cat([draft_probs, draft_probs.new_zeros(b, 1, v)], 1)  # q_K := 0 (bonus)
        q_next = padded[rows, num_accepted]
    residual = (p_next - q_next).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual, p_next)  # p == q: rejection had probability 0
    last = sample(residual, generator)

    out = torch.full((b, k + 1), -1, dtype=torch.long, device=p.device)
    keep = torch.arange(k + 1, device=p.device)[None] < num_accepted[:, None]
    out[:, :k] = torch.where(keep[:, :k], draft_token_ids, out[:, :k])
    out[rows, num_accepted] = last
    return out, num_accepted


def gumbel_verify(draft_token_ids: torch.Tensor, target_logits: torch.Tensor,
                  noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter-invariant verification (Daliri, Musco and Suresh, arXiv:2408.07978): the
    target's token at each position is its Gumbel-max sample ``argmax(logits + noise)``;
    draft tokens are kept while they equal it, and the sample at the first mismatch (or
    after all K) is the recovered or bonus token. With the noise keyed on (seed, position)
    (:class:`~specdecode.sampling.GumbelNoise`) the output is exactly plain Gumbel-max
    sampling of the target, token for token, whatever proposed the drafts and however many:
    so distributed as the target's sampling, and the same text for one seed with every
    proposer and K. A draft model that samples with the same noise agrees with the target
    with probability at least (1 - TV) / (1 + TV) (TV: total variation distance between
    the two distributions), against 1 - TV for :func:`rejection_sample`.

    draft_token_ids: [B,K] int64 (K may be 0); no draft distribution is needed.
    target_logits: [B,K+1,V] processed logits (temperature, top-k/p applied; -inf excluded).
    noise: [B,K+1,V'] (V' >= V) the Gumbel noise of those positions.
    Returns (output_ids [B,K+1] int64 padded with -1 after the emitted tokens,
    num_accepted [B] int64 in 0..K), as :func:`rejection_sample`.
    """
    b, k = draft_token_ids.shape
    if target_logits.shape[:2] != (b, k + 1) or noise.shape[:2] != (b, k + 1):
        raise ValueError(f"target_logits {tuple(target_logits.shape)} and noise {tuple(noise.shape)} "
                         f"must both be [{b},{k + 1},V]")
    # the greedy rule on the perturbed logits: their argmax is the Gumbel-max sample
    return greedy_verify(draft_token_ids, target_logits + noise[..., :target_logits.shape[-1]])


def greedy_verify(draft_token_ids: torch.Tensor, target_logits: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: draft tokens are kept while they equal the target's argmax, and
    the argmax at the first mismatch (or after all K) is the recovered or bonus token. It is
    :func:`rejection_sample` with the one-hot target of greedy decoding (T -> 0: a draft
    token other than the argmax has p = 0 and is rejected, the argmax has p = 1 and is
    kept, and the residual at a rejection is the argmax's one-hot), without its random
    draws and its multinomial over the vocabulary (3.3 ms a row for 151,936 tokens).

    draft_token_ids: [B,K] int64; target_logits: [B,K+1,V] processed logits. Returns
    (output_ids [B,K+1] padded with -1, num_accepted [B]) as :func:`rejection_sample`.
    """
    b, k = draft_token_ids.shape
    if target_logits.shape[:2] != (b, k + 1):
        raise ValueError(f"target_logits has shape {tuple(target_logits.shape)}, expected [{b},{k + 1},V]")
    best = target_logits.argmax(-1)  # [B,K+1]
    num_accepted = (draft_token_ids == best[:, :k]).long().cumprod(1).sum(1)
    keep = torch.arange(k + 1, device=best.device)[None] <= num_accepted[:, None]
    return torch.where(keep, best, torch.full_like(best, -1)), num_accepted



def _check_tree_rows(tree: DraftTree, rows: torch.Tensor, name: str):
    if not isinstance(tree, DraftTree):
        raise ValueError(f"tree must be a DraftTree, got {type(tree).__name__}")
    if rows.dim() != 2 or rows.shape[0] != tree.num_nodes + 1:
        raise ValueError(f"{name} has shape {tuple(rows.shape)}, expected [{tree.num_nodes + 1},V] "
                         "(the root's row, then one per node)")


def verify_tree(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None,
                draft_probs: torch.Tensor | None = None) -> tuple[list[int], int]:
    """Speculative sampling over a draft tree: the accepted root-to-node path, then one
    recovered or bonus token; the output is distributed exactly as the target's sampling.

    Walks down from the root. At a node with target distribution p (its pass row), the
    children are tried in index order: child x with proposal q is accepted with probability
    min(1, p(x) / q(x)); on rejection p becomes norm(max(0, p - q)) and the next child is
    tried. An accepted child becomes the current node; when every child is rejected the
    recovered token is drawn from what is left of p, and at a leaf the bonus token from its p.
    SpecInfer's multi-step speculative sampling (Miao et al., arXiv:2305.09781, Theorem 4.2);
    with point-mass proposals it is EAGLE-2's rule for top-k children (a rejected candidate's
    probability removed from p and p renormalised), exact for any candidates chosen without
    looking at the target.

    tree: the drafts; target_probs: [N+1,V] processed target distributions of the pass rows
        (row 0 after the root, row i+1 after node i; one-hot rows for greedy).
    draft_probs: None when every child is a point mass (top-k or greedy candidates: q =
        one-hot(x)); or [N+1,V'] (V' <= V, missing tokens count as probability 0): row r is
        the distribution from which the children of pass row r were drawn, independently and
        with replacement (SpecInfer). It must be the distribution they were drawn from:
        soft probabilities for deterministic candidates bias the output.
    Returns (path, token): the accepted nodes from the root's child down (possibly empty) and
    the recovered or bonus token. Raises ValueError for rows of the wrong shape.
    """
    _check_tree_rows(tree, target_probs, "target_probs")
    v = target_probs.shape[-1]
    if draft_probs is not None:
        _check_tree_rows(tree, draft_probs, "draft_probs")
        if draft_probs.shape[-1] < v:
            draft_probs = torch.nn.functional.pad(draft_probs, (0, v - draft_probs.shape[-1]))
    tokens = tree.token_ids.tolist()
    path, row = [], 0
    while True:
        p = target_probs[row]
        for child in tree.children(row):
            x = tokens[child]
            if x >= v:
                raise ValueError(f"node {child} holds token {x}, outside the vocabulary of {v}")
            q = None if draft_probs is None else draft_probs[row]
            qx = 1.0 if q is None else float(q[x])
            u = float(torch.rand((), generator=generator, device=p.device))
            if u * qx < float(p[x]):  # u < p(x) / q(x) without dividing by q(x)
                path.append(child)
                row = child + 1
                break
            if q is None:
                residual = p.clone()
                residual[x] = 0.0
            else:
                residual = (p - q).clamp_min(0)
            mass = residual.sum()
            if mass > 0:  # else p == q: that rejection had probability 0
                p = residual / mass
        else:
            return path, int(sample(p[None], generator)[0])


def greedy_verify_tree(tree: DraftTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy verification over a draft tree: from the root, follow the child whose token is
    the target's argmax at the current node (the first such child, for duplicates) while there
    is one; then the argmax there is the recovered or bonus token. The longest accepted path,
    and the same output as greedy decoding of the target. With logits plus Gumbel noise keyed
    on each row's position (root position + depth) it is :func:`gumbel_verify` over a tree.

    target_logits: [N+1,V] processed logits of the pass rows (see :func:`verify_tree`).
    Returns (path, token) as :func:`verify_tree`. Raises ValueError for rows of the wrong shape.
    """
    _check_tree_rows(tree, target_logits, "target_logits")
    best = target_logits.argmax(-1).tolist()
    tokens = tree.token_ids.tolist()
    path, row = [], 0
    while True:
        nxt = next((c for c in tree.children(row) if tokens[c] == best[row]), None)
        if nxt is None:
            return path, best[row]
        path.append(nxt)
        row = nxt + 1

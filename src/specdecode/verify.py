"""The acceptance rules of speculative decoding, pure functions of tensors: which draft
tokens the target keeps, and the one recovered or bonus token after them — speculative
sampling (:func:`rejection_sample`; :func:`greedy_verify`, its T -> 0 case), the
drafter-invariant Gumbel rule (:func:`gumbel_verify`), and both over a draft tree
(:func:`verify_tree`, :func:`greedy_verify_tree`). All of these are lossless. One rule is
not, and runs only where asked for by name: Medusa's typical acceptance
(:class:`LossyTypical`, :func:`typical_verify`, :func:`typical_verify_tree`), which changes
the output of sampled requests."""

from __future__ import annotations

import math
from dataclasses import dataclass

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


@dataclass(frozen=True)
class LossyTypical:
    """Medusa's typical acceptance: a LOSSY acceptance rule, which changes the output.

    Cai et al., "Medusa" (arXiv:2401.10774), section 2.3.1; the Medusa repo's
    ``evaluate_posterior`` (``posterior_threshold`` = eps, ``posterior_alpha`` = delta). At
    sampling temperature T > 0 a drafted token x after a prefix is accepted when

        p(x) > min(eps, delta * exp(-H(p)))

    where p is the target's distribution after that prefix as the request samples it (every
    logits processor applied: temperature, top-k/p, penalties) and H(p) = -sum p log p its
    entropy (nats; Medusa's code takes log(p + 1e-5), a slightly smaller H; here the exact
    one): a flat distribution (high H) accepts less likely tokens, a peaked one only tokens
    near its top. Candidates are not compared with a sample of the target, so
    the output is NOT distributed as the target's sampling: faster (longer accepted runs),
    but another text. At T = 0 Medusa verifies greedily; so does this library (the engine
    keeps greedy verification for greedy requests: lossless).

    eps: in (0, 1), the threshold's cap (Medusa's default 0.09); delta: in (0, 1], the
    scale of the entropy-dependent threshold (default sqrt(eps), as Medusa recommends: 0.3
    for 0.09). Raises ValueError naming a bad value and what is allowed.
    """

    eps: float = 0.09
    delta: float | None = None

    def __post_init__(self):
        def number(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not (number(self.eps) and 0 < self.eps < 1):
            raise ValueError(f"lossy-typical eps = {self.eps!r} is invalid; allowed: a number in (0, 1) "
                             "(Medusa's posterior_threshold, e.g. 0.09)")
        if self.delta is None:
            object.__setattr__(self, "delta", math.sqrt(self.eps))
        elif not (number(self.delta) and 0 < self.delta <= 1):
            raise ValueError(f"lossy-typical delta = {self.delta!r} is invalid; allowed: a number in (0, 1] "
                             "(Medusa's posterior_alpha, e.g. 0.3), or none (sqrt(eps))")
        object.__setattr__(self, "eps", float(self.eps))
        object.__setattr__(self, "delta", float(self.delta))

    @classmethod
    def parse(cls, text: str) -> "LossyTypical":
        """A method option's value: "EPS" (delta = sqrt(EPS)) or "EPS/DELTA", e.g. "0.09"
        or "0.09/0.3". Raises ValueError naming the text and what is allowed."""
        parts = text.split("/")
        try:
            if len(parts) > 2:
                raise ValueError
            values = [float(x) for x in parts]
        except ValueError:
            raise ValueError(f"lossy-typical={text!r} is invalid; allowed: EPS or EPS/DELTA, numbers "
                             "with 0 < EPS < 1 and 0 < DELTA <= 1, e.g. lossy-typical=0.09 "
                             "(Medusa's default; DELTA = sqrt(EPS))") from None
        return cls(*values)

    def __str__(self) -> str:
        return f"{self.eps:g}/{self.delta:g}"

    def threshold(self, probs: torch.Tensor) -> torch.Tensor:
        """min(eps, delta * exp(-H(p))) of each distribution: probs [..., V] -> [...]."""
        entropy = torch.special.entr(probs.float()).sum(-1)  # -p log p, 0 where p = 0
        return torch.clamp(self.delta * torch.exp(-entropy), max=self.eps)


def typical_verify(draft_token_ids: torch.Tensor, target_probs: torch.Tensor, rule: LossyTypical
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """LOSSY: Medusa's typical acceptance (:class:`LossyTypical`) over a chain of drafts.
    Draft token x_i is kept while p_i(x_i) > min(eps, delta * exp(-H(p_i))) (``rule``),
    p_i the target's distribution before it; after the accepted prefix comes the target's
    most likely token there, argmax p (as Medusa's ``generate`` does: its next round's first
    candidate is the argmax of the last accepted position's logits). No random draw: the
    output is a function of the drafts and the target, not a sample of the target.

    draft_token_ids: [B,K] int64 (K may be 0); target_probs: [B,K+1,V] the processed target
    distributions (sampled requests: ``to_probs`` of the processed logits). Returns
    (output_ids [B,K+1] padded with -1, num_accepted [B]) as :func:`rejection_sample`.
    Raises ValueError for rows of the wrong shape.
    """
    b, k = draft_token_ids.shape
    if target_probs.shape[:2] != (b, k + 1):
        raise ValueError(f"target_probs has shape {tuple(target_probs.shape)}, expected [{b},{k + 1},V]")
    p = target_probs[:, :k].gather(2, draft_token_ids[..., None])[..., 0]  # [B,K]
    accepted = p > rule.threshold(target_probs[:, :k])
    num_accepted = accepted.long().cumprod(1).sum(1)
    rows = torch.arange(b, device=p.device)
    last = target_probs[rows, num_accepted].argmax(-1)
    out = torch.full((b, k + 1), -1, dtype=torch.long, device=p.device)
    keep = torch.arange(k, device=p.device)[None] < num_accepted[:, None]
    out[:, :k] = torch.where(keep, draft_token_ids, out[:, :k])
    out[rows, num_accepted] = last
    return out, num_accepted


def typical_verify_tree(tree: DraftTree, target_probs: torch.Tensor, rule: LossyTypical
                        ) -> tuple[list[int], int]:
    """LOSSY: Medusa's typical acceptance (:class:`LossyTypical`) over a draft tree.

    Node i (token x below pass row r, its parent's) passes when p_r(x) > min(eps, delta *
    exp(-H(p_r))); a node is accepted when it and every ancestor pass (ancestor closure).
    The accepted path is the deepest accepted node's root-to-node path, ties broken as
    Medusa breaks them, by the higher sum of log p along the path (then the node listed
    first); the token after it is the target's argmax at the path's last row (Medusa's
    ``generate``). No random draw.

    tree: the drafts; target_probs: [N+1,V] processed target distributions of the pass rows
    (row 0 after the root, row i+1 after node i). Returns (path, token) as
    :func:`verify_tree`. Raises ValueError for rows of the wrong shape or a node's token
    outside the vocabulary.
    """
    _check_tree_rows(tree, target_probs, "target_probs")
    v = target_probs.shape[-1]
    parents = tree.parents.tolist()
    if tree.num_nodes and int(tree.token_ids.max()) >= v:
        node = int(tree.token_ids.argmax())
        raise ValueError(f"node {node} holds token {int(tree.token_ids[node])}, outside the vocabulary of {v}")
    rows = tree.parents + 1  # [N] the pass row each node's token follows
    p = target_probs[rows, tree.token_ids]  # [N]
    passed = (p > rule.threshold(target_probs)[rows]).tolist()
    logp = torch.log(p.double()).tolist()  # finite where passed: p > threshold > 0
    depths = tree.depths().tolist()
    score: list[float | None] = []  # the path's sum of log p where the node is accepted
    best, best_key = -1, (0, 0.0)
    for i, parent in enumerate(parents):
        ok = passed[i] and (parent < 0 or score[parent] is not None)
        score.append((logp[i] + (score[parent] if parent >= 0 else 0.0)) if ok else None)
        if ok and (depths[i], score[i]) > best_key:
            best, best_key = i, (depths[i], score[i])
    return tree.path(best), int(target_probs[best + 1].argmax())

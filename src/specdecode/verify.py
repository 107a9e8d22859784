"""The acceptance rules of speculative decoding, pure functions of tensors: which draft
tokens the target keeps, and the one recovered or bonus token after them — speculative
sampling (:func:`rejection_sample`; :func:`greedy_verify`, its T -> 0 case) and the
drafter-invariant Gumbel rule (:func:`gumbel_verify`). A tree verifier joins them here."""

from __future__ import annotations

import torch

from .sampling import sample


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


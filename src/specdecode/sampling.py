"""Logits processing and sampling, as pure functions of tensors (the acceptance rule that
uses them is :mod:`specdecode.verify`).

Processing matches transformers' order: repetition penalty, min-new-tokens EOS mask, then
temperature, top-k, top-p. Every function is stateless: the repetition-penalty context is
recomputed from the committed tokens plus the draft tokens before each position, so a
rejected draft token can never leave a trace in sampler state.
"""

from __future__ import annotations

import hashlib

import torch

from .config import SamplingParams


def process_logits(logits: torch.Tensor, params: SamplingParams, prefix_ids: torch.Tensor,
                   block_ids: torch.Tensor | None, num_generated: int,
                   eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """Apply the request's logits processors to a block of positions.

    logits: [B,T,V] fp32, the model's logits for T consecutive positions.
    prefix_ids: [B,L] tokens before the block (prompt + generated so far); position i of the
        block also sees ``block_ids[:, :i]`` ([B,T-1] or None when T == 1).
    num_generated: tokens generated before position 0 of the block (for ``min_new_tokens``).
    Returns processed logits [B,T,V] (-inf for excluded tokens); greedy requests skip the
    temperature/top-k/top-p warpers, which cannot change the argmax.
    """
    b, t, v = logits.shape
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        present = torch.zeros(b, t, v, dtype=torch.bool, device=logits.device)
        present[:, :] = _presence(prefix_ids, v)[:, None]
        if t > 1 and block_ids is not None:
            ids = block_ids[:, : t - 1].clamp(max=v - 1)
            seen = torch.zeros(b, t - 1, v, device=logits.device).scatter_(2, ids[..., None], 1.0)
            present[:, 1:] |= seen.cumsum(1) > 0
        pen = params.repetition_penalty
        penalized = torch.where(logits < 0, logits * pen, logits / pen)
        logits = torch.where(present, penalized, logits)
    if num_generated < params.min_new_tokens and eos_token_ids:
        masked = min(t, params.min_new_tokens - num_generated)
        eos = torch.tensor([e for e in eos_token_ids if e < v], dtype=torch.long)
        logits[:, :masked, eos] = float("-inf")
    if params.greedy:
        return logits
    logits = logits / params.temperature
    if params.top_k and params.top_k < v:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - params.top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _presence(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B,L] token ids -> [B,V] bool, True where the token occurs."""
    out = torch.zeros(ids.shape[0], vocab, dtype=torch.bool, device=ids.device)
    return out.scatter_(1, ids.clamp(max=vocab - 1), True)


def to_probs(processed: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed logits [..., V] -> the distribution sampled from [..., V] (fp32).

    Greedy requests give the one-hot of the argmax: greedy verification is then exactly the
    rejection rule below with a point-mass target (the T -> 0 limit).
    """
    if params.greedy:
        return torch.zeros_like(processed).scatter_(-1, processed.argmax(-1, keepdim=True), 1.0)
    return processed.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row from probs [B,V]; returns [B] int64."""
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


class GumbelNoise:
    """Gumbel noise of one seeded request, keyed on (seed, position): the noise of the token
    at sequence position p is the same whoever asks for it and whenever, so that
    ``argmax(processed_logits + noise)`` is one fixed sample of the target's distribution at
    p (the Gumbel-max trick) — drawn by plain decoding, by a verify pass, or guessed by a
    draft model using the same noise (drafter-invariant speculative decoding: Daliri, Musco
    and Suresh, "Coupling without Communication and Drafter-Invariant Speculative
    Decoding", arXiv:2408.07978).

    seed: any integer; vocab_size: V, the width of the noise rows. Rows are drawn on the CPU
    (mt19937 seeded with blake2b(seed, position)), so the noise is the same on every device,
    in fp32: G = -log(-log(u)), u uniform in [2^-126, 1) at fp32's 2^-24 resolution (a token's
    probability moves by less than 1e-7 from it). Rows of positions before
    :meth:`forget_before` are dropped; others are kept until then (a rejected draft's
    positions are asked for again next round).
    """

    def __init__(self, seed: int, vocab_size: int):
        self.seed, self.vocab_size = int(seed), int(vocab_size)
        self._rows: dict[int, torch.Tensor] = {}

    def _row(self, position: int) -> torch.Tensor:
        row = self._rows.get(position)
        if row is None:
            key = hashlib.blake2b(f"{self.seed}:{position}".encode(), digest_size=8).digest()
            g = torch.Generator().manual_seed(int.from_bytes(key, "little"))
            u = torch.rand(self.vocab_size, generator=g).clamp_min_(torch.finfo(torch.float32).tiny)
            row = self._rows[position] = u.log_().neg_().log_().neg_()
        return row

    def rows(self, start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Noise of positions start .. start+count-1: [count, V] fp32 on ``device``."""
        if count == 0:
            return torch.empty(0, self.vocab_size, device=device)
        return torch.stack([self._row(p) for p in range(start, start + count)]).to(device)

    def forget_before(self, position: int) -> None:
        """Drop the rows of positions < ``position`` (committed tokens: never asked again)."""
        for p in [p for p in self._rows if p < position]:
            del self._rows[p]


def gumbel_sample(processed: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The Gumbel-max sample of each row: processed logits [..., V'] (V' <= V, -inf for
    excluded tokens) and noise [..., V] -> token ids [...] int64, distributed as
    softmax(processed)."""
    return (processed + noise[..., :processed.shape[-1]]).argmax(-1)

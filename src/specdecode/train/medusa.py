"""Training Medusa-1 heads by self-distillation (Cai et al., arXiv:2401.10774; their
"self-distillation" variant): the heads learn the target's own distribution of the token
i + 2 places after each recorded position, from the target's greedy answers.

Each example is one answer position t of a recorded sequence (the position that predicts
the first answer token onwards) with, for head i, the target's top-k log-probabilities at
position t + i + 1 (which predict token t + i + 2): the loss is the cross-entropy of head
i's distribution against the target's renormalised top-k, weighted 0.8^i as in Medusa's
training code (later heads are harder and matter less). Where the served heads draft over
the first token ids only (:func:`specdecode.models.native.auto_draft_vocab`: 32,768 of the
default target's 151,936), they train over those ids too: the softmax over those rows of
the target's table alone (about a fifth of the step's arithmetic), the target's top-k
renormalised over its ids among them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..heads import MedusaHeads
from .features import Sequence
from .loop import Task

HEAD_DECAY = 0.8


def medusa_examples(seqs: list[Sequence], num_heads: int) -> dict[str, torch.Tensor]:
    """The examples of ``seqs`` as tensors, one row per answer position t (see the module
    docstring): ``hidden`` fp32 [N, dim], ``label_ids`` int64 [N, H, TOPK], ``label_logp``
    fp32 [N, H, TOPK], ``next_tokens`` int64 [N, H] (the recorded token t + i + 2, -1 past
    the end) and ``valid`` bool [N, H] (whether position t + i + 1 exists)."""
    hidden, ids, logp, nxt, valid = [], [], [], [], []
    for s in seqs:
        t_len = len(s.tokens)
        pos = torch.arange(max(0, s.start - 1), t_len - 1)
        if not len(pos):
            continue
        j = pos[:, None] + torch.arange(1, num_heads + 1)  # [n, H]: position whose distribution is the label
        ok = j <= t_len - 1
        jc = j.clamp(max=t_len - 1)
        hidden.append(s.final[pos].float())
        ids.append(s.topk_ids[jc])
        logp.append(s.topk_logp[jc].float())
        tok = torch.where(j + 1 <= t_len - 1, s.tokens[(j + 1).clamp(max=t_len - 1)], -1)
        nxt.append(torch.where(ok, tok, -1))
        valid.append(ok)
    if not hidden:
        return {}
    return {"hidden": torch.cat(hidden), "label_ids": torch.cat(ids), "label_logp": torch.cat(logp),
            "next_tokens": torch.cat(nxt), "valid": torch.cat(valid)}


def first_ids_labels(ex: dict[str, torch.Tensor], first_ids: int) -> dict[str, torch.Tensor]:
    """The examples ``ex`` (:func:`medusa_examples`) with labels over token ids
    0..first_ids-1 only: the target's top-k ids beyond get log-probability -inf (weight 0
    once renormalised), and a (position, head) without any id among them is not ``valid``."""
    if not ex:
        return ex
    inside = ex["label_ids"] < first_ids  # [N, H, TOPK]
    some = inside.any(-1)
    logp = torch.where(inside, ex["label_logp"], -torch.inf)
    return {**ex, "label_ids": torch.where(inside, ex["label_ids"], 0),
            "label_logp": torch.where(some[..., None], logp, 0.0), "valid": ex["valid"] & some}


def medusa_loss(heads: MedusaHeads, batch: dict[str, torch.Tensor],
                first_ids: int | None = None) -> torch.Tensor:
    """The weighted soft cross-entropy of the heads on a batch (see the module docstring);
    ``first_ids``: over token ids 0..first_ids-1 only (labels from :func:`first_ids_labels`)."""
    logq = torch.log_softmax(heads(batch["hidden"], first_ids=first_ids), dim=-1)  # [H, B, V]
    h = logq.shape[0]
    ids = batch["label_ids"].transpose(0, 1)  # [H, B, TOPK]
    p = torch.softmax(batch["label_logp"].transpose(0, 1), dim=-1)
    ce = -(p * logq.gather(-1, ids)).sum(-1)  # [H, B]
    mask = batch["valid"].transpose(0, 1).float()
    w = HEAD_DECAY ** torch.arange(h, dtype=torch.float32, device=ce.device)[:, None]
    return (ce * mask * w).sum() / (mask * w).sum().clamp(min=1)


@torch.no_grad()
def chain_acceptance(heads: MedusaHeads, ex: dict[str, torch.Tensor], chunk: int = 256,
                     first_ids: int | None = None) -> dict:
    """Teacher-forced measures on held-out examples: ``acceptance_length``, the mean tokens a
    greedy verify pass of the heads' top-1 chain would emit from each position (1 + the
    leading heads whose top-1 equals the recorded token; the bonus token included), and
    ``head{i}_top1`` per head; ``first_ids``: top-1 among token ids 0..first_ids-1, as the
    heads draft when served so. {} without examples."""
    if not ex:
        return {}
    hits, kw = [], {} if first_ids is None else {"first_ids": first_ids}
    for a in range(0, len(ex["hidden"]), chunk):
        top = heads(ex["hidden"][a:a + chunk], **kw).argmax(-1).transpose(0, 1)  # [b, H]
        hits.append(top == ex["next_tokens"][a:a + chunk])
    hit = torch.cat(hits)  # [N, H]
    leading = hit.int().cumprod(dim=1).sum(dim=1).float()
    out = {"acceptance_length": 1 + leading.mean().item()}
    has = ex["next_tokens"] >= 0
    for i in range(hit.shape[1]):
        if has[:, i].any():
            out[f"head{i + 1}_top1"] = hit[has[:, i], i].float().mean().item()
    return out


def medusa_task(heads: MedusaHeads, train_seqs: list[Sequence], held_seqs: list[Sequence],
                info: dict, first_ids: int | None = None) -> Task:
    """The :class:`~specdecode.train.loop.Task` that trains ``heads`` on ``train_seqs`` and
    measures ``held_seqs`` after each epoch; ``info`` (target, data) goes into the saved
    config under ``training``. ``first_ids``: train and measure over token ids
    0..first_ids-1 only (the module docstring; None: all)."""
    ex = medusa_examples(train_seqs, heads.num_heads)
    held = medusa_examples(held_seqs, heads.num_heads)
    if first_ids is not None:
        ex = first_ids_labels(ex, first_ids)
    n = len(ex["hidden"]) if ex else 0

    def collate(idx: list[int]) -> dict[str, torch.Tensor]:
        i = torch.tensor(idx)
        return {k: v[i] for k, v in ex.items()}

    def save(module: MedusaHeads, out: Path, summary: dict) -> None:
        module.save(out, training=summary)

    return Task(heads, list(range(n)), collate, lambda m, batch: medusa_loss(m, batch, first_ids),
                lambda m: chain_acceptance(m, held, first_ids=first_ids), save, info)

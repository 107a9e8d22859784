"""Training an EAGLE-3 head by self-distillation with the training-time test (Li et al.,
arXiv:2503.01840, section 3.2; the shape of SpecForge's and the EAGLE repo's trainers).

One example is one recorded sequence. Every position t (whose next token x[t+1] is known)
starts a draft chain, all of them at once:

- step 0 reads x[t+1] and the fused target features fc(g[t]) at RoPE position t, attending
  causally to step 0 of positions <= t: the head's KV cache as the engine builds it from
  the target's real states;
- step i >= 1 reads x[t+1+i] (the recorded token: at inference a step runs only after the
  steps before it were accepted, so its input is that token) and the step before's
  ``pre`` state at position t+i, attending to step 0 of positions <= t and to steps 1..i of
  its own chain only, exactly the keys its cache holds at inference.

Step i's distribution is trained against the target's at position t+1+i (which predicts
x[t+2+i]), restricted to the draft vocabulary and renormalised, weighted 0.8^i as in the
EAGLE repo; rows before the answer, or whose target top-k has no draft-vocabulary token,
are left out. Held-out: the same unrolled chains with top-1 inputs give the greedy
acceptance length exactly (a step's input is the recorded token whenever the steps before
it were right).
"""

from __future__ import annotations

from pathlib import Path

import torch

from torch import nn

from ..heads import Eagle3Head
from .features import Sequence
from .loop import Task

STEP_DECAY = 0.8


def _as_example(s: Sequence) -> dict[str, torch.Tensor]:
    return {"tokens": s.tokens, "start": torch.tensor(s.start), "aux": s.aux,
            "topk_ids": s.topk_ids, "topk_logp": s.topk_logp}


def unroll(head: Eagle3Head, ex: dict[str, torch.Tensor], steps: int):
    """Run the training-time test on one sequence of T tokens (R = T-1 rows, one chain per
    position t). Only the chains that can reach an answer position are run (t >= first =
    start-2, clamped to 0..R-1); the prompt's other positions give step 0's keys and values
    only, as the head's cache holds them at inference. Returns (t [R'] the chains' positions
    first..R-1, per step i a pair (logits [R', N] over the draft vocabulary; valid bool [R']:
    the step's input token x[t+1+i] and label position t+1+i exist and that position is an
    answer position, i.e. t+1+i >= start-1))."""
    tokens, aux = ex["tokens"], ex["aux"].float()
    t_len, start = len(tokens), int(ex["start"])
    rows = t_len - 1
    first = min(max(0, start - 2), rows - 1)
    every = torch.arange(rows, device=tokens.device)
    t = every[first:]
    causal = every[None, :] <= t[:, None]  # [R', R]
    q, k0, v0, residual = head.project(tokens[every + 1], head.fc(aux[:rows]), every)
    q, residual = q[:, first:], residual[first:]
    out, diag_k, diag_v = [], [], []
    for i in range(steps):
        valid = (t + 1 + i <= t_len - 1) & (t + 1 + i >= start - 1)
        if i == 0:
            p = torch.softmax(head.scores(q, k0).masked_fill(~causal, float("-inf")), dim=-1)
            attn = head.mix(p, v0)
        else:
            q, k, v, residual = head.project(tokens[(t + 1 + i).clamp(max=t_len - 1)], hidden, t + i)
            diag_k.append(k)
            diag_v.append(v)
            g = q.shape[0] // k.shape[0]
            s0 = head.scores(q, k0).masked_fill(~causal, float("-inf"))  # [H, R', R]
            sd = torch.stack([(q * kj.repeat_interleave(g, 0)).sum(-1) for kj in diag_k], -1) \
                * head.args.head_dim ** -0.5  # [H, R', i]
            p = torch.softmax(torch.cat([s0, sd], -1), dim=-1)
            attn = head.mix(p[..., :rows], v0) + sum(
                p[..., rows + j, None] * vj.repeat_interleave(g, 0) for j, vj in enumerate(diag_v))
        hidden, logits = head.finish(attn, residual)
        out.append((logits, valid))
    return t, out


def _target_to_draft(head: Eagle3Head) -> torch.Tensor:
    index = torch.full((len(head.t2d),), -1, dtype=torch.int64, device=head.t2d.device)
    index[head.draft_ids] = torch.arange(len(head.d2t), device=head.t2d.device)
    return index


def eagle3_loss(head: Eagle3Head, batch: list[dict[str, torch.Tensor]], steps: int) -> torch.Tensor:
    """The weighted soft cross-entropy of the unrolled steps over a batch of sequences."""
    index = _target_to_draft(head)
    total, weight = 0.0, 0.0
    for ex in batch:
        rows = len(ex["tokens"]) - 1
        t, chains = unroll(head, ex, steps)
        for i, (logits, valid) in enumerate(chains):
            j = (t + 1 + i).clamp(max=rows)
            ids = index[ex["topk_ids"][j]]  # [R, TOPK] draft ids, -1 outside the draft vocabulary
            inside = ids >= 0
            p = torch.softmax(ex["topk_logp"][j].float().masked_fill(~inside, float("-inf")), -1)
            ok = valid & inside.any(-1)
            if not ok.any():
                continue
            logq = torch.log_softmax(logits[ok], -1)
            ce = -(p[ok].nan_to_num(0.0) * logq.gather(-1, ids[ok].clamp(min=0))).sum(-1)
            w = STEP_DECAY ** i
            total = total + w * ce.sum()
            weight += w * int(ok.sum())
    if not isinstance(total, torch.Tensor):  # nothing to learn from in this batch
        return sum(p.sum() for p in head.parameters()) * 0.0
    return total / weight


@torch.no_grad()
def chain_acceptance(head: Eagle3Head, examples: list[dict[str, torch.Tensor]], steps: int = 5) -> dict:
    """Held-out greedy measures: ``acceptance_length``, the mean tokens per verify pass of
    the head's top-1 chain of ``steps`` tokens from every answer position (the bonus token
    included), and ``step{i}_top1``. {} without examples."""
    ids = head.draft_ids
    leads, hits = [], [[] for _ in range(steps)]
    for ex in examples:
        tokens, start = ex["tokens"], int(ex["start"])
        rows = len(tokens) - 1
        t, chains = unroll(head, ex, steps)
        ok_rows = t >= start - 1  # chains that start at an answer position
        right = []
        for i, (logits, _) in enumerate(chains):
            has = t + 2 + i <= len(tokens) - 1
            guess = ids[logits.argmax(-1)]
            r = torch.where(has, guess == tokens[(t + 2 + i).clamp(max=rows)], False)
            right.append(r)
            hits[i].append(r[ok_rows & has])
        lead = torch.stack(right, 1).int().cumprod(1).sum(1)
        leads.append(lead[ok_rows & (t + 2 <= rows)].float())
    if not leads or not torch.cat(leads).numel():
        return {}
    out = {"acceptance_length": 1 + torch.cat(leads).mean().item()}
    for i, h in enumerate(hits):
        h = torch.cat(h)
        if h.numel():
            out[f"step{i + 1}_top1"] = h.float().mean().item()
    return out


def eagle3_task(head: Eagle3Head, train_seqs: list[Sequence], held_seqs: list[Sequence], info: dict,
                steps: int = 3, eval_steps: int = 5) -> Task:
    """The :class:`~specdecode.train.loop.Task` that trains ``head`` with ``steps`` unrolled
    steps on ``train_seqs`` (one example per sequence) and measures ``held_seqs`` with
    chains of ``eval_steps``; ``info`` goes into the saved config under ``training``.
    Raises ValueError when the sequences carry no EAGLE-3 features (a target of under 7
    layers) or for steps outside 1..8."""
    if not 1 <= steps <= 8:
        raise ValueError(f"training-time test steps must be 1..8, got {steps}")
    if any(s.aux.shape[-1] != 3 * head.args.dim for s in train_seqs + held_seqs):
        raise ValueError("the recorded features have no EAGLE-3 layers for this head (the target "
                         "needs at least 7 layers, and the head its hidden size)")
    train = [_as_example(s) for s in train_seqs if len(s.tokens) >= 3]
    held = [_as_example(s) for s in held_seqs if len(s.tokens) >= 3]

    def save(module: TrainingTimeTest, out: Path, summary: dict) -> None:
        module.head.save(out, training=summary)

    return Task(TrainingTimeTest(head, steps), train, lambda batch: batch, lambda m, b: m(b),
                lambda m: chain_acceptance(m.head, held, eval_steps), save, info)


class TrainingTimeTest(nn.Module):
    """``forward(batch)`` = :func:`eagle3_loss` of the head: the loss computed in a forward
    call, so that a data-parallel wrapper (``accelerate launch``) sees it."""

    def __init__(self, head: Eagle3Head, steps: int):
        super().__init__()
        self.head, self.steps = head, steps

    def forward(self, batch: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        return eagle3_loss(self.head, batch, self.steps)

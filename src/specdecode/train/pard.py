"""Adapting the draft model into a parallel draft (PARD, An et al., arXiv:2504.18583): a draft
that proposes K tokens in one forward pass. At inference its input is the context followed by
K-1 copies of one mask token (``pard_token``, an id the tokenizer never emits) at the next
positions; the row of the last real token predicts the next token as before, and the mask at
position t+j predicts the token at t+j+1. A round then costs the draft one pass over the newly
accepted tokens and K-1 masks instead of K one-token steps. The acceptance rule is unchanged:
a parallel draft is a proposer like any other and the output stays the target's.

Training (conditional drop-token, PARD section 3): one sequence x_0..x_{T-1} is laid out as
segment 0, its own tokens (causal), followed by segments s = 1..K-1 of mask tokens, one per
*anchor* a (the last real token a chain starts from) at position a+s, predicting x_{a+s+1}. A
mask row (s, a) attends to the real tokens 0..a and to the masks (1..s, a) of its own anchor:
exactly what it sees at inference. Segment s keeps a random share max(keep^s, keep_min) of
the anchors, nested (an anchor kept in segment s is kept in every segment below it), so a
sequence costs about 1 + sum_s max(keep^s, keep_min) times its length (~3.4x for K = 8 at
PARD's 0.7 / 0.2) instead of K times.

Loss, at every row that predicts an answer token (the real rows as in
:mod:`specdecode.train.draft`, and every mask row): the forward KL to the target's recorded
top-16 distribution of that token, summed over rows and divided by the rows (the target's
answers are its greedy text, so its first choice there is the token itself).

Trained: the mask token's embedding (a separate vector while training, written into the
embedding table's row ``pard_token`` on save) and the top ``layers`` decoder layers with the
final norm; the gradient reaches the embedding through every layer.

Held-out (:func:`parallel_acceptance`): from every answer position, the draft's greedy chain
of K tokens read off one teacher-forced pass (row a, then the masks of anchor a) against the
target's greedy answer: ``alpha_j``, the share of chains whose first j tokens are all right,
for j = 1..K, beside the same for the draft's ordinary one-token chain (``ar_alpha_j``).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .draft import PARD_FILE, _as_example, save_draft_dir, topk_cross_entropy
from .features import Sequence
from .loop import Task

PARD_K = 8  # chains of up to 8 tokens (PARD's para_num)
PARD_KEEP = 0.7  # conditional drop-token: segment s keeps max(keep^s, keep_min) of the anchors
PARD_KEEP_MIN = 0.2


def mask_token_id(tokenizer, vocab_size: int) -> int:
    """The first embedding row no text ever encodes to (PARD's ``pard_token``): the first row
    past the tokenizer's tokens, or, where the tokenizer lists every row (a GGUF's does), the
    first of the ``[PAD<id>]`` placeholders llama.cpp's converter writes for unused rows:
    151665 for Qwen2.5 either way (151,936 rows, 151,665 real tokens). Raises ValueError
    when there is none (vocab_size: the embedding table's rows)."""
    used = len(tokenizer)
    if used < vocab_size:
        return used
    first = max(tokenizer.all_special_ids or [0]) + 1
    for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(first, vocab_size))), first):
        if piece == f"[PAD{i}]":
            return i
    raise ValueError(f"the draft's embedding table has {vocab_size} rows and its tokenizer uses every "
                     "one: a parallel draft needs a spare row for its mask token")


def parallel_layout(length: int, start: int, k: int, keep: float = 1.0, keep_min: float = 0.0,
                    generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """The rows of one training sequence (see the module docstring).

    Args:
        length: the sequence's tokens T. start: its first answer token's index (anchors are
            start-1 .. T-2). k: the longest chain (segments 1..k-1 of masks).
        keep, keep_min: segment s keeps ceil(anchors x max(keep^s, keep_min)) anchors (1.0:
            all), drawn with ``generator``.
    Returns:
        ``token`` [N]: the index into the sequence a row reads, -1 for a mask;
        ``position`` [N]: its position id; ``target`` [N]: the index of the token it predicts,
        -1 where none (a prompt row, the last row); ``anchor`` [N], ``segment`` [N];
        ``allowed`` [N, N] bool: row r may attend to column c.
    Raises:
        ValueError: for k < 1, start outside 0..length or length < 1.
    """
    if k < 1 or length < 1 or not 0 <= start <= length:
        raise ValueError(f"bad layout: length {length}, start {start}, k {k}")
    pos = torch.arange(length)
    anchor, segment = [pos], [torch.zeros(length, dtype=torch.long)]
    first = max(0, start - 1)
    alive = torch.arange(first, length - 1)
    for s in range(1, k):
        alive = alive[alive + s + 1 < length]  # the token it predicts exists
        n = len(alive)
        if keep < 1.0 and n:  # a share of all the anchors segment s could have, from those alive
            share = max(keep ** s, keep_min) * max(0, length - 1 - s - first)
            take = min(n, math.ceil(share))
            alive = alive[torch.randperm(n, generator=generator)[:take]].sort().values
        if not len(alive):
            break
        anchor.append(alive)
        segment.append(torch.full_like(alive, s))
    anchor, segment = torch.cat(anchor), torch.cat(segment)
    real = segment == 0
    position = anchor + segment
    target = position + 1
    target[(target >= length) | (real & (target < start))] = -1
    token = torch.where(real, anchor, torch.full_like(anchor, -1))
    allowed = (real[None, :] & (anchor[None, :] <= anchor[:, None])) | (
        ~real[None, :] & (anchor[None, :] == anchor[:, None]) & (segment[None, :] <= segment[:, None]))
    return {"token": token, "position": position, "target": target, "anchor": anchor,
            "segment": segment, "allowed": allowed}


class ParallelDraft(torch.nn.Module):
    """A transformers causal LM with a trainable mask-token embedding: ``forward(batch)`` is the
    training loss (in a forward call, so that a data-parallel wrapper sees it).

    Args:
        model: the draft (its trainable layers already chosen).
        mask_id: the embedding row the mask token takes (:func:`mask_token_id`).
        k, keep, keep_min: the layout of training sequences (:func:`parallel_layout`).
    """

    def __init__(self, model, mask_id: int, k: int = PARD_K, keep: float = PARD_KEEP,
                 keep_min: float = PARD_KEEP_MIN, seed: int = 0):
        super().__init__()
        self.model, self.mask_id, self.k, self.keep, self.keep_min = model, mask_id, k, keep, keep_min
        table = model.get_input_embeddings().weight
        # the mean real token's embedding: a neutral start that the layers already read
        self.mask_embedding = torch.nn.Parameter(table[:mask_id].detach().float().mean(0).to(table.dtype))
        self._generator = torch.Generator().manual_seed(seed)

    def logits(self, tokens: torch.Tensor, layout: dict[str, torch.Tensor]) -> torch.Tensor:
        """The draft's logits [N, V] at every row of ``layout`` for the sequence ``tokens`` [T]."""
        ids = tokens[layout["token"].clamp(min=0)]
        embeds = self.model.get_input_embeddings()(ids)
        mask = (layout["token"] < 0)[:, None]
        embeds = torch.where(mask, self.mask_embedding.to(embeds.dtype), embeds)
        bias = torch.zeros(layout["allowed"].shape, dtype=embeds.dtype, device=embeds.device)
        bias = bias.masked_fill(~layout["allowed"], torch.finfo(embeds.dtype).min)
        hidden = self.model.get_decoder()(inputs_embeds=embeds[None], attention_mask=bias[None, None],
                                          position_ids=layout["position"][None]).last_hidden_state[0]
        return self.model.get_output_embeddings()(hidden).float()

    def forward(self, batch: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        total, count = 0.0, 0
        self.rows_read = 0  # the rows of the batch's passes (training cost: rows, not tokens)
        for ex in batch:
            tokens, start = ex["tokens"], int(ex["start"])
            layout = parallel_layout(len(tokens), start, self.k, self.keep, self.keep_min, self._generator)
            layout = {k: v.to(tokens.device) for k, v in layout.items()}
            rows = (layout["target"] >= 0).nonzero()[:, 0]
            self.rows_read += len(layout["token"])
            before = layout["target"][rows] - 1  # the recorded distribution of token t sits at t-1
            total = total + topk_cross_entropy(self.logits(tokens, layout)[rows], ex["topk_ids"][before],
                                               ex["topk_logp"][before])
            count += len(rows)
        return total / max(count, 1)

    @torch.no_grad()
    def write_mask_row(self) -> None:
        """Write the trained mask embedding into the embedding table's row ``mask_id`` (with tied
        embeddings the output row changes too: the proposer never proposes that id)."""
        self.model.get_input_embeddings().weight[self.mask_id] = self.mask_embedding


@torch.no_grad()
def parallel_acceptance(module: ParallelDraft, examples: list[dict[str, torch.Tensor]],
                        k: int = PARD_K) -> dict[str, float]:
    """Held-out greedy acceptance of the parallel draft's chains of ``k`` tokens, and of the
    draft's own one-token chains, on recorded sequences (the target's greedy answers; see the
    module docstring). Returns ``alpha_1..alpha_k``, ``ar_alpha_1..ar_alpha_k`` (shares of
    chains right in their first j tokens), ``acceptance_length`` (1 + the sum of alpha_j:
    tokens a verify pass of a k-token parallel chain keeps, the bonus token included) and
    ``ar_acceptance_length``; {} without an anchor that has k tokens after it."""
    hits, ar_hits = [], []
    for ex in examples:
        tokens, start = ex["tokens"], int(ex["start"])
        layout = parallel_layout(len(tokens), start, k)
        guess = module.logits(tokens, layout).argmax(-1)
        right = torch.zeros(len(tokens), k, dtype=torch.bool)  # [anchor, j]
        rows = layout["target"] >= 0
        right[layout["anchor"][rows], layout["segment"][rows]] = guess[rows] == tokens[layout["target"][rows]]
        anchors = torch.arange(max(0, start - 1), len(tokens) - k)  # those with k tokens after them
        if not len(anchors):
            continue
        hits.append(right[anchors].int().cumprod(1))
        # the one-token chain from a: its j-th guess is the real row a+j's
        ar = right[:, 0].int()
        ar_hits.append(torch.stack([ar[anchors + j] for j in range(k)], 1).cumprod(1))
    if not hits:
        return {}
    alpha, ar_alpha = torch.cat(hits).float().mean(0), torch.cat(ar_hits).float().mean(0)
    out = {"acceptance_length": 1 + alpha.sum().item(), "ar_acceptance_length": 1 + ar_alpha.sum().item()}
    out.update({f"alpha_{j + 1}": alpha[j].item() for j in range(k)})
    out.update({f"ar_alpha_{j + 1}": ar_alpha[j].item() for j in range(k)})
    return out


def pard_task(model, source: str | Path, mask_id: int, train_seqs: list[Sequence],
              held_seqs: list[Sequence], info: dict, k: int = PARD_K, seed: int = 0) -> Task:
    """The :class:`~specdecode.train.loop.Task` that adapts the transformers causal LM ``model``
    (loaded from the directory ``source``, its trainable layers set) into a parallel draft with
    mask token ``mask_id``, on ``train_seqs``, measuring ``held_seqs``. Each save writes a model
    directory: the weights with the mask row written, ``config.json`` naming ``pard_token``
    (vLLM's name for it), ``source``'s tokenizer files, and ``pard.json`` (``info`` and the
    run's history)."""
    module = ParallelDraft(model, mask_id, k, seed=seed)
    module.model.config.pard_token = mask_id
    train = [_as_example(s) for s in train_seqs if len(s.tokens) - s.start >= 2]
    held = held_out_examples(held_seqs, k)

    def save(m: ParallelDraft, out: Path, summary: dict) -> None:
        table = m.model.get_input_embeddings().weight
        row = table[mask_id].detach().clone()
        m.write_mask_row()
        save_draft_dir(m.model, source, out, PARD_FILE, summary)
        with torch.no_grad():
            table[mask_id] = row  # training goes on with the table as it was

    return Task(module, train, lambda batch: batch, lambda m, b: m(b),
                lambda m: parallel_acceptance(m, held, k), save, info)


def held_out_examples(seqs: list[Sequence], k: int = PARD_K) -> list[dict[str, torch.Tensor]]:
    """What :func:`parallel_acceptance` measures on: the recorded sequences with an anchor
    that has ``k`` tokens after it."""
    return [{"tokens": s.tokens, "start": torch.tensor(s.start)} for s in seqs if len(s.tokens) > k + 1]

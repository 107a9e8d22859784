"""Distilling the draft model toward the target (DistillSpec, Zhou et al., arXiv:2310.08461):
the draft learns the target's next-token distribution on the target's own answers, so that
more of its proposals are accepted. The output cannot change: a distilled draft is a draft
like any other, and the acceptance rule keeps speculative decoding lossless with it.

Data: the sequences recorded for the heads (:mod:`specdecode.train.features`), prompt + the
target's greedy answer with the target's top-16 next-token log-probabilities at every
position. DistillSpec finds on-policy data (the draft's own samples) best by a small margin
over the target's answers; the target's answers are shared with the heads and cost nothing
more once recorded.

Loss at every row that predicts an answer token: the forward KL D(p_target || q_draft) over
the target's top-16 tokens, ``-sum_i p_i log q_i`` with the target's own probabilities p_i
(not renormalised: the mass beyond the top 16 was not recorded), averaged over the batch's
rows; forward KL is among DistillSpec's best divergences for greedy decoding. Tokens the
draft's vocabulary lacks (a target with more rows) are left out.

Trained: the last ``layers`` decoder layers and the final norm; the embeddings, the output
projection and the layers below stay as they are, which keeps the run within a CPU's reach
(the gradient stops at the first trained layer) and the draft close to the model it was.

Held-out: :func:`greedy_acceptance`, the tokens per verify pass of the draft's greedy chains
of K tokens on the target's greedy answers. It is exact from one teacher-forced pass: a
chain's i-th token is drafted from the recorded tokens whenever the tokens before it were
right, and the target's greedy token is the recorded one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from .features import Sequence
from ..models.loading import usual_mode
from .loop import Task

DISTILL_FILE = "distillation.json"
PARD_FILE = "pard.json"  # a parallel draft's (specdecode.train.pard)
SUMMARY_FILES = (DISTILL_FILE, PARD_FILE)
# what save_pretrained writes: the rest of the draft's directory (tokenizer, chat template) is copied
WEIGHT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")


def _decoder_layers(model) -> torch.nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no list of decoder layers (model.layers) to "
                         "train; distillation supports Llama-family drafts")
    return layers


def trainable_layers(model, layers: int) -> int:
    """Freeze every parameter of the transformers causal LM ``model`` except its last
    ``layers`` decoder layers and final norm; returns the trainable parameter count. Raises
    ValueError for a count outside 1..(the draft's layers)."""
    stack = _decoder_layers(model)
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= len(stack):
        raise ValueError(f"--layers {layers!r} is invalid; allowed: an integer 1..{len(stack)} (the "
                         "draft's decoder layers, counted from the top)")
    model.requires_grad_(False)
    stack[-layers:].requires_grad_(True)
    norm = getattr(model.get_decoder(), "norm", None)
    if norm is not None:
        norm.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _as_example(s: Sequence) -> dict[str, torch.Tensor]:
    return {"tokens": s.tokens, "start": torch.tensor(s.start), "topk_ids": s.topk_ids,
            "topk_logp": s.topk_logp}


def _answer_logits(model, ex: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [R]: the positions start-1..T-1 that predict answer tokens or what follows the
    answer, the draft's logits there [R, V_draft])."""
    tokens, start = ex["tokens"], int(ex["start"])
    rows = torch.arange(max(0, start - 1), len(tokens), device=tokens.device)
    hidden = model.get_decoder()(input_ids=tokens[None]).last_hidden_state[0]
    return rows, model.get_output_embeddings()(hidden[rows]).float()


def distill_loss(model, batch: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The forward KL over the target's top-16 (see the module docstring), averaged over the
    answer rows of a batch of sequences (each: ``tokens`` [T], ``start``, ``topk_ids`` /
    ``topk_logp`` [T, 16])."""
    total, count = 0.0, 0
    for ex in batch:
        rows, logits = _answer_logits(model, ex)
        total = total + topk_cross_entropy(logits, ex["topk_ids"][rows], ex["topk_logp"][rows])
        count += len(rows)
    return total / max(count, 1)


def topk_cross_entropy(logits: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor) -> torch.Tensor:
    """``-sum_i p_i log q_i`` summed over rows: the draft's logits [R, V_draft] against the
    target's recorded top-k ids and log-probabilities [R, k] (p not renormalised; ids beyond
    the draft's vocabulary left out). The forward KL up to the target's entropy."""
    logq = torch.log_softmax(logits, -1)
    inside = topk_ids < logq.shape[-1]
    p = topk_logp.float().exp() * inside
    return -(p * logq.gather(-1, topk_ids.clamp(max=logq.shape[-1] - 1))).sum()


@torch.no_grad()
def greedy_acceptance(model, examples: list[dict[str, torch.Tensor]], k: int = 5) -> dict:
    """Held-out greedy measures of a draft on recorded sequences: ``acceptance_length``, the
    mean tokens per verify pass of its greedy chains of ``k`` tokens from every answer
    position (the bonus token included), and ``top1``, the share of positions whose first
    drafted token is the target's. {} without examples."""
    leads, hits = [], []
    for ex in examples:
        tokens = ex["tokens"]
        rows, logits = _answer_logits(model, ex)
        rows, logits = rows[:-1], logits[:-1]  # the last row's next token was not recorded
        if not len(rows):
            continue
        right = (logits.argmax(-1) == tokens[rows + 1]).int()
        hits.append(right)
        # from each row, the run of right guesses (at most k): the tokens its chain gets accepted
        window = torch.cat([right, right.new_zeros(k - 1)]).unfold(0, k, 1)  # [R, k]: rows i..i+k-1
        leads.append(window.cumprod(1).sum(1).float())
    if not leads:
        return {}
    return {"acceptance_length": 1 + torch.cat(leads).mean().item(),
            "top1": torch.cat(hits).float().mean().item()}


def draft_task(model, source: str | Path, train_seqs: list[Sequence], held_seqs: list[Sequence],
               info: dict, k: int = 5) -> Task:
    """The :class:`~specdecode.train.loop.Task` that distils the transformers causal LM
    ``model`` (its trainable parameters set by :func:`trainable_layers`), loaded from the
    directory ``source``, on ``train_seqs`` (one example per sequence), measuring
    ``held_seqs`` with chains of ``k`` tokens. Each save writes a model directory that
    ``--draft`` loads: the weights, ``source``'s tokenizer files and chat template, and
    ``distillation.json`` (``info`` with the run's history)."""
    source = Path(source)
    train = [_as_example(s) for s in train_seqs if len(s.tokens) >= 2]
    held = [_as_example(s) for s in held_seqs if len(s.tokens) >= 2]

    def save(module: Distillation, out: Path, summary: dict) -> None:
        save_draft_dir(module.model, source, out, DISTILL_FILE, summary)

    return Task(Distillation(model), train, lambda batch: batch, lambda m, b: m(b),
                lambda m: greedy_acceptance(m.model, held, k), save, info)


def save_draft_dir(model, source: str | Path, out: Path, summary_file: str, summary: dict) -> None:
    """Write a trained draft as a model directory ``--draft`` loads: the transformers
    ``model``'s weights and config, the other files of its ``source`` directory (tokenizer,
    chat template; not an earlier run's summary), and ``summary`` as ``summary_file``."""
    source = Path(source)
    model.save_pretrained(out)
    for weights in out.glob("*.safetensors"):
        usual_mode(weights)
    for name in _copied_files(source):
        if name not in SUMMARY_FILES:
            shutil.copy2(source / name, out / name)
    (out / summary_file).write_text(json.dumps(summary, indent=1) + "\n")


class Distillation(torch.nn.Module):
    """``forward(batch)`` = :func:`distill_loss` of the draft: the loss computed in a forward
    call, so that a data-parallel wrapper (``accelerate launch``) sees it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        return distill_loss(self.model, batch)


def _copied_files(source: str | Path) -> list[str]:
    """The draft directory's files other than its weights (tokenizer, chat template)."""
    return [f.name for f in Path(source).iterdir() if f.is_file() and f.name not in WEIGHT_FILES
            and not f.name.endswith(".safetensors")]


def source_files(source: str | Path) -> list[str]:
    """The names a trained draft's directory holds besides the weights: the source
    directory's other files and the run's summary (``distillation.json`` or ``pard.json``)."""
    return _copied_files(source) + list(SUMMARY_FILES)

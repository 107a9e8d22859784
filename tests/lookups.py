"""What the proposer tests share: the kinds of lookup proposer they are parametrised over,
and targets whose text repeats."""

from __future__ import annotations

import torch

from specdecode.config import SamplingParams
from specdecode.proposers import HybridProposer, PromptLookupProposer, SuffixProposer
from helpers import noisy_draft


GREEDY128 = SamplingParams(max_new_tokens=128)


def lookup(kind: str):
    if kind == "lookup-recent":
        return PromptLookupProposer(3, 1, "recent")
    if kind == "lookup-first":
        return PromptLookupProposer(3, 1, "first")
    if kind == "lookup-2-5":
        return PromptLookupProposer(5, 2)
    if kind == "suffix":
        return SuffixProposer(8, 0.05)
    if kind == "hybrid":
        return HybridProposer(SuffixProposer(8, 0.05), HybridProposer.draft_for(noisy_draft()))
    raise ValueError(kind)


KINDS = ["lookup-recent", "lookup-first", "lookup-2-5", "suffix", "hybrid"]


def linear_times(n, t1=0.2, slope=0.02):
    return [t1 + slope * i for i in range(n)]


PERIOD = 7


def copying_logits(vocab: int, period: int = PERIOD, scale: float = 8.0):
    """A target that continues a text by repeating it with the given period (what a model
    does when it quotes its prompt): the next token is the one ``period`` positions back."""
    def fn(tokens):
        out = torch.zeros(vocab)
        out[tokens[-period] if len(tokens) >= period else (len(tokens) * 31) % vocab] = scale
        return out
    return fn


COPY_PROMPT = [5, 9, 13, 2, 40, 41, 7] * 3 + [11, 12]


EOS_PROMPT = [5, 9, 13, 2, 40, 41, 7] * 2 + [5, 9, 13]


L_PROMPT = [2, 3, 1, 2, 3]  # the last token occurred before: the lookups propose [1, 2, ...]

"""Distribution tests' machinery: a chi-square test (no scipy) of sampled counts against a
known distribution, and mock target/draft models whose joint distribution of the first two
tokens is computed exactly by enumeration."""

from __future__ import annotations

import functools

import torch

from helpers import MockLM
from specdecode.config import SamplingParams
from specdecode.sampling import process_logits, to_probs

ALPHA = 1e-3


@functools.lru_cache(maxsize=None)
def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    """x with P(chi2_df > x) = alpha (bisection on Q(df/2, x/2))."""
    sf = lambda x: torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),  # noqa: E731
                                           torch.tensor(x / 2, dtype=torch.float64)).item()
    lo, hi = 0.0, 10.0 * df + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if sf(mid) > alpha:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic of ``counts`` against ``probs`` (same shape, flattened).

    Cells of probability 0 must be empty (asserted). Cells with expected count < 5 are pooled
    into one bin (merged into the largest bin if the pool itself stays < 5).
    Returns (statistic, degrees of freedom).
    """
    counts = counts.flatten().double()
    probs = probs.flatten().double()
    n = counts.sum()
    zero = probs <= 0
    assert counts[zero].sum() == 0, f"{int(counts[zero].sum())} samples of probability-0 tokens"
    counts, probs = counts[~zero], probs[~zero] / probs[~zero].sum()
    exp = probs * n
    small = exp < 5
    obs_b = list(counts[~small])
    exp_b = list(exp[~small])
    if small.any():
        o, e = counts[small].sum(), exp[small].sum()
        if e >= 5 or not exp_b:
            obs_b.append(o)
            exp_b.append(e)
        else:
            i = max(range(len(exp_b)), key=lambda j: exp_b[j])
            obs_b[i] += o
            exp_b[i] += e
    obs_t, exp_t = torch.stack(obs_b), torch.stack(exp_b)
    return float(((obs_t - exp_t) ** 2 / exp_t).sum()), len(obs_b) - 1


def assert_lossless(counts, joint):
    stat, df = chi2_stat(counts, joint)
    crit = chi2_critical(df)
    assert stat < crit, f"joint of 2 tokens: chi2 = {stat:.1f} > {crit:.1f} (df {df})"
    stat1, df1 = chi2_stat(counts.sum(1), joint.sum(1))
    assert stat1 < chi2_critical(df1), f"first token: chi2 = {stat1:.1f} (df {df1})"
    stat2, df2 = chi2_stat(counts.sum(0), joint.sum(0))
    assert stat2 < chi2_critical(df2), f"second token: chi2 = {stat2:.1f} (df {df2})"


def probs_of(logit_rows: torch.Tensor, params: SamplingParams, prefix: torch.Tensor,
             block: torch.Tensor | None):
    """The request's distribution [B,T,V] from raw logit rows, as the engine computes it."""
    return to_probs(process_logits(logit_rows, params, prefix, block, 0, ()), params)


EV = 6
E_PROMPT = [2, 3]
N_RUNS = 20000


def _table_logits(vocab, seed):
    """logits_fn: a fixed random distribution per last-two-tokens context (a cheap lookup)."""
    table = torch.randn(EV, EV, vocab, generator=torch.Generator().manual_seed(seed)) * 1.2
    return lambda tokens: table[tokens[-2] if len(tokens) > 1 else 0, tokens[-1]]


def mock_target():
    return MockLM(EV, _table_logits(EV, 1))


def mock_draft(vocab=EV):
    return MockLM(vocab, _table_logits(vocab, 2))


def engine_joint(params, prompt=E_PROMPT):
    """The target's joint distribution of the first two tokens after ``prompt``."""
    fn = mock_target().logits_fn
    p1 = probs_of(fn(prompt)[None, None], params, torch.tensor([prompt]), None)[0, 0]
    rows = [probs_of(fn(prompt + [a])[None, None], params, torch.tensor([prompt + [a]]), None)[0, 0]
            for a in range(EV)]
    return p1[:, None] * torch.stack(rows)

"""The expected-length cost model shared by the K schedule and the hybrid: how many tokens a
round of K drafts emits given per-position acceptance rates, and what a verify pass of n
tokens costs relative to one token.
"""

from __future__ import annotations


def chained_acceptance(reached, accepted, first_alpha: float, prior_weight: float) -> list[float]:
    """Per-position acceptance α_1, α_2, ... from counts of how often each position was
    reached and accepted: α_i = (accepted_i + w·α_{i−1}) / (reached_i + w), with α_0 =
    ``first_alpha`` and w = ``prior_weight`` — a position seldom reached inherits the rate of
    the one before it (a draft's misses come in bursts, so K can grow while drafts keep
    being accepted)."""
    out, prev = [], first_alpha
    for r, a in zip(reached, accepted):
        prev = (a + prior_weight * prev) / (r + prior_weight)
        out.append(prev)
    return out


def expected_tokens(alphas: list[float], k: int) -> float:
    """E(K) = 1 + Σ_{i=1..K} Π_{j<=i} α_j: tokens a round of K drafts emits, bonus or
    recovered token included (Leviathan et al., arXiv:2211.17192 §3.1, α per position)."""
    total, run = 1.0, 1.0
    for a in alphas[:k]:
        run *= a
        total += run
    return total


def relative_cost(costs: list[float] | None, n: int) -> float:
    """T(n)/T(1) from a profile ``costs`` = [T(1)/T(1), T(2)/T(1), ...]; past the profile, its
    mean slope, never below the last entry; with no profile, 1 + 0.08·(n−1) (this project's
    fp32 target on oneDNN kernels)."""
    if costs is None:
        return 1 + 0.08 * (n - 1)
    if n <= len(costs):
        return costs[n - 1]
    return costs[-1] + max(0.0, (costs[-1] - costs[0]) / max(1, len(costs) - 1)) * (n - len(costs))

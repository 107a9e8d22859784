"""Speculation length K per round: fixed, transformers' heuristic, or chosen from a cost model.

A schedule has ``reset()`` (start of a request), ``next_k()`` (K for the next round; 0 =
no speculation this round) and ``update(proposed, accepted, draft_s, verify_s)`` (after each
verify pass, with the number of draft tokens actually proposed, possibly 0). The engine caps
K further by the room left in the context; a proposer may propose fewer tokens.
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
from pathlib import Path

import torch

MAX_K = 64


def _check_k(name: str, k, low: int = 1) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or not low <= k <= MAX_K:
        raise ValueError(f"{name} = {k!r} is invalid; allowed: an integer {low}..{MAX_K}")


class FixedK:
    """K tokens every round. Raises ValueError for K outside 1..64."""

    name = "fixed"

    def __init__(self, k: int):
        _check_k("speculation length K", k)
        self.k = k

    def reset(self) -> None:
        pass

    def next_k(self) -> int:
        return self.k

    def update(self, proposed: int, accepted: int, draft_s: float, verify_s: float) -> None:
        pass


class HeuristicK:
    """transformers' ``num_assistant_tokens_schedule="heuristic"``: start at ``start``; +2
    after a round whose proposed tokens were all accepted, −1 otherwise (never below 1 or
    above ``max_k``). Rounds without a proposal change nothing. Restarts per request."""

    name = "heuristic"

    def __init__(self, start: int, max_k: int = 16):
        _check_k("starting K", start)
        _check_k("max K", max_k)
        self.start, self.max_k = min(start, max_k), max_k
        self.k = self.start

    def reset(self) -> None:
        self.k = self.start

    def next_k(self) -> int:
        return self.k

    def update(self, proposed: int, accepted: int, draft_s: float, verify_s: float) -> None:
        if proposed:
            self.k = min(self.max_k, self.k + 2) if accepted == proposed else max(1, self.k - 1)


class AutoK:
    """Choose K each round to maximise expected emitted tokens per second.

    Model (Leviathan et al., arXiv:2211.17192 §3.4, with a per-position acceptance rate
    instead of one i.i.d. α): with α_i the probability that draft i is accepted given that
    drafts 1..i−1 were, a round of K drafts emits E(K) = 1 + Σ_{i=1..K} Π_{j<=i} α_j tokens
    and costs C(K) = c_draft·K + s·T(K+1), where T(n) is the target's measured forward time
    for n tokens (``forward_seconds``, profiled once per machine: :func:`verify_profile`),
    c_draft the measured draft cost per proposed token and s the ratio of the verify times
    observed in this request to the profile (context length, machine load). The chosen K is
    argmax E(K)/C(K) over 1..max_k.

    α_i is estimated online from exponentially decayed counts (``decay`` per round, ≈ the
    last 1/(1−decay) rounds) of how often position i was reached and accepted, shrunk toward
    α_{i−1} with weight ``prior_weight`` — so a position never tried yet inherits the rate of
    the one before it, and K can grow when drafts keep being accepted. K = 0 (no speculation,
    E = 1, C = T(1)) is chosen when no K pays for itself — text a lookup cannot predict;
    then one draft token is tried every ``probe_every`` rounds to notice when that changes.
    Raises ValueError for
    a profile shorter than 2 sizes or max_k outside 1..64.
    """

    name = "auto"

    def __init__(self, forward_seconds: list[float], max_k: int = 16, decay: float = 0.9,
                 prior_weight: float = 1.0, first_alpha: float = 0.6, probe_every: int = 8):
        _check_k("max K", max_k)
        if len(forward_seconds) < 2 or min(forward_seconds) <= 0:
            raise ValueError("AutoK needs forward times T(1), T(2), ... (positive seconds)")
        self.times = list(forward_seconds)
        self.max_k = min(max_k, len(self.times) - 1)
        self.decay, self.prior_weight, self.first_alpha = decay, prior_weight, first_alpha
        self.probe_every = probe_every
        self.reset()

    def reset(self) -> None:
        self.reached = [0.0] * (self.max_k + 1)  # index i: position i (1-based)
        self.accepted = [0.0] * (self.max_k + 1)
        self.draft_per_token = 0.0
        self.scale = 1.0
        self._seen_draft = False
        self._idle = 0

    def alphas(self) -> list[float]:
        """[α_1, ..., α_max_k] under the current counts."""
        out, prev = [], self.first_alpha
        for i in range(1, self.max_k + 1):
            a = (self.accepted[i] + self.prior_weight * prev) / (self.reached[i] + self.prior_weight)
            out.append(a)
            prev = a
        return out

    def expected_tokens(self, k: int, alphas: list[float] | None = None) -> float:
        """E(K): expected tokens emitted by a round of K drafts (bonus/recovered included)."""
        alphas = self.alphas() if alphas is None else alphas
        total, run = 1.0, 1.0
        for a in alphas[:k]:
            run *= a
            total += run
        return total

    def cost(self, k: int) -> float:
        """C(K) in seconds: drafting K tokens plus verifying K+1."""
        return self.draft_per_token * k + self.scale * self.times[k]

    def next_k(self) -> int:
        alphas = self.alphas()
        k = max(range(0, self.max_k + 1), key=lambda k: self.expected_tokens(k, alphas) / self.cost(k))
        if k == 0:
            self._idle += 1
            if self._idle >= self.probe_every:  # look again: the text may have changed
                self._idle, k = 0, 1
        return k

    def update(self, proposed: int, accepted: int, draft_s: float, verify_s: float) -> None:
        if proposed:
            self._idle = 0
            d = self.decay
            self.reached = [r * d for r in self.reached]
            self.accepted = [a * d for a in self.accepted]
        for i in range(1, min(proposed, accepted + 1, self.max_k) + 1):
            self.reached[i] += 1
            if i <= accepted:
                self.accepted[i] += 1
        if proposed:
            per_token = draft_s / proposed
            self.draft_per_token = (per_token if not self._seen_draft
                                    else 0.8 * self.draft_per_token + 0.2 * per_token)
            self._seen_draft = True
        n = min(proposed + 1, len(self.times))
        if verify_s > 0:
            self.scale = 0.8 * self.scale + 0.2 * (verify_s / self.times[n - 1])


def measure_forward_times(lm, context_len: int, max_n: int = 16, repeats: int = 5,
                          warmup: int = 3) -> list[float]:
    """T(n) in seconds for n = 1..max_n new tokens after ``context_len`` cached tokens.

    Sizes are measured round-robin (1, 2, ..., max_n, 1, 2, ...) after ``warmup`` untimed
    rounds, and each T(n) is the median of ``repeats``, so that drift and a cold first call
    hit every n alike. Returns [T(1), ..., T(max_n)]."""
    lm.allocate(1, context_len + max_n)
    g = torch.Generator().manual_seed(0)
    lm.forward(torch.randint(0, lm.vocab_size, (1, context_len), generator=g), num_logits=0)
    ids = torch.randint(0, lm.vocab_size, (1, max_n), generator=g)
    samples: list[list[float]] = [[] for _ in range(max_n)]
    for r in range(warmup + repeats):
        for n in range(1, max_n + 1):
            t0 = time.perf_counter()
            lm.forward(ids[:, :n])
            if r >= warmup:
                samples[n - 1].append(time.perf_counter() - t0)
            lm.rollback(context_len)
    return [statistics.median(s) for s in samples]


PROFILE_CONTEXT = 256


def verify_profile(model, max_k: int = 16, cache_dir: Path | None = None) -> list[float]:
    """The target's forward times T(1..max_k+1) in seconds for :class:`AutoK`, measured once
    (about 2·(max_k+1) forward passes at 256 tokens of context) and cached on disk per model,
    dtype, thread count, torch version and CPU, and in memory on the loaded model.
    ``model``: a :class:`~specdecode.backends.LoadedModel`."""
    from . import registry

    n = max_k + 1
    cached = getattr(model, "_verify_profile", None)
    if cached is not None and len(cached) >= n:
        return cached[:n]
    lm = model.lm
    module = lm if isinstance(lm, torch.nn.Module) else getattr(lm, "hf", None)
    first = next(module.parameters(), None) if module is not None else None
    dtype = str(first.dtype) if first is not None else type(lm).__name__
    key = json.dumps([str(model.path or model.name), dtype, torch.get_num_threads(), torch.__version__,
                      platform.machine(), platform.processor(), _cpu_model(), n])
    path = (cache_dir or registry.cache_dir() / "profiles") / (
        hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
    times = None
    try:
        times = json.loads(path.read_text())["forward_seconds"]
    except (OSError, ValueError, KeyError):
        pass
    if not (isinstance(times, list) and len(times) == n):
        times = measure_forward_times(lm, PROFILE_CONTEXT, n, repeats=2, warmup=1)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"key": key, "forward_seconds": times}))
            tmp.replace(path)
        except OSError:
            pass  # a read-only cache only costs the profile again next time
    model._verify_profile = times
    return times


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""

"""Counters of speculative decoding, after vLLM's SpecDecodingStats, plus phase timers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Counters of one or more requests, after vLLM's SpecDecodingStats plus phase timers.

    num_drafts: verify passes that checked at least one draft token.
    num_draft_tokens / num_accepted_tokens: proposed / accepted draft tokens that reached the
        output (tokens after a stop inside a block are not counted as accepted).
    accepted_per_position[i]: drafts accepted at position i of their block.
    num_verify_passes: target forward passes after prefill (each emits >= 1 token).
    by_proposer: per proposer that supplied drafts (a hybrid has several):
        {name: {"num_drafts", "num_draft_tokens", "num_accepted_tokens"}}.
    speculation_lengths: the draft tokens verified in every round of a speculative request
        (0: the schedule or the room left chose not to speculate, or the proposer had nothing
        to propose; for a lookup whose proposal the schedule trimmed, the K it kept), to see
        a K schedule at work.
    Times in seconds: prefill_s (target + draft prefill), draft_s, verify_s (target forward +
    acceptance rule), total_s (wall time of the whole request).
    lossy: True when a request's drafts were verified by a lossy rule (Medusa's typical
        acceptance, ``medusa:lossy-typical=EPS``, in a sampled request): its output is not
        the target's decoding or sampling distribution, and its speed not a lossless one.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    by_proposer: dict[str, dict[str, int]] = field(default_factory=dict)
    speculation_lengths: list[int] = field(default_factory=list)
    num_verify_passes: int = 0
    num_generated_tokens: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    lossy: bool = False

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 when nothing was proposed; None in to_dict)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify pass (1.0 = plain decoding): 1 + accepted / verify passes,
        except where a stop (EOS, stop string) falls on an accepted draft token, whose block
        then has no recovered or bonus token: counted from the tokens emitted, it stays exact."""
        return self.num_generated_tokens / self.num_verify_passes if self.num_verify_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens / total wall time, prefill included."""
        return self.num_generated_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def other_s(self) -> float:
        return max(0.0, self.total_s - self.prefill_s - self.draft_s - self.verify_s)

    def record_round(self, proposed: int, accepted: int, source: str = "",
                     depth: int | None = None) -> None:
        """One verify pass: ``proposed`` draft tokens (a tree's nodes), ``accepted`` of them
        along the accepted path; ``depth``: the tree's depth (default: ``proposed``, a chain),
        the positions ``accepted_per_position`` counts."""
        self.num_verify_passes += 1
        if proposed:
            self.num_drafts += 1
            self.num_draft_tokens += proposed
            self.num_accepted_tokens += accepted
            mine = self.by_proposer.setdefault(source or "draft", {
                "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0})
            mine["num_drafts"] += 1
            mine["num_draft_tokens"] += proposed
            mine["num_accepted_tokens"] += accepted
            depth = proposed if depth is None else depth
            if len(self.accepted_per_position) < depth:
                self.accepted_per_position += [0] * (depth - len(self.accepted_per_position))
            for i in range(accepted):
                self.accepted_per_position[i] += 1

    def merge(self, other: "SpecDecodingStats") -> "SpecDecodingStats":
        """Pool two requests' counters (rates become Σaccepted / Σproposed)."""
        out = SpecDecodingStats()
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_verify_passes",
                     "num_generated_tokens", "prefill_s", "draft_s", "verify_s", "total_s"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        pad = lambda xs: xs + [0] * (n - len(xs))  # noqa: E731
        out.accepted_per_position = [a + b for a, b in zip(pad(self.accepted_per_position),
                                                           pad(other.accepted_per_position))]
        for src in (self.by_proposer, other.by_proposer):
            for name, counts in src.items():
                mine = out.by_proposer.setdefault(name, dict.fromkeys(counts, 0))
                for key, v in counts.items():
                    mine[key] += v
        out.speculation_lengths = self.speculation_lengths + other.speculation_lengths
        out.lossy = self.lossy or other.lossy
        return out

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "by_proposer": {name: dict(c) for name, c in self.by_proposer.items()},
            "mean_speculation_length": (round(sum(self.speculation_lengths)
                                              / len(self.speculation_lengths), 3)
                                        if self.speculation_lengths else None),
            "num_verify_passes": self.num_verify_passes,
            "num_generated_tokens": self.num_generated_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4) if self.num_draft_tokens else None,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "prefill_s": round(self.prefill_s, 4),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "other_s": round(self.other_s, 4),
            "total_s": round(self.total_s, 4),
            "lossy": self.lossy,
        }

"""The hybrid's pay or stop (``HybridProposer.observe``, ``draft_pays``): a draft whose
rounds are measured slower than plain decoding stops drafting, whatever its declared costs
promise; one that costs what it declares keeps drafting; a seeded request of the rejection
rule is never judged by the clock (its draws depend on what is proposed). Wall times come
from mock models that sleep in every forward pass."""

from __future__ import annotations

import time

from helpers import MockLM, hashed_logits
from specdecode.config import SamplingParams
from specdecode.engine import Engine
from specdecode.proposers import HybridProposer, SuffixProposer

V = 50
PROMPT = [(i * 7 + 3) % V for i in range(12)]


class SleepingLM(MockLM):
    """A mock model whose every forward pass takes at least ``seconds`` of wall time."""

    def __init__(self, logits_fn, seconds: float):
        super().__init__(V, logits_fn)
        self.seconds = seconds

    def forward(self, input_ids, num_logits=None):
        time.sleep(self.seconds)
        return super().forward(input_ids, num_logits)

    def fork(self) -> "SleepingLM":
        return SleepingLM(self.logits_fn, self.seconds)


def _run(draft_seconds: float, params: SamplingParams, target_seconds: float = 0.004):
    """(output ids, draft tokens proposed, the hybrid) for a draft that agrees with the target
    on every token, declared at a tenth of a target pass a step."""
    fn = hashed_logits(V, "measured")
    target = SleepingLM(fn, target_seconds)
    hybrid = HybridProposer(SuffixProposer(8, 0.99), HybridProposer.draft_for(SleepingLM(fn, draft_seconds), p_min=0.0),
                            draft_cost=0.1, draft_prefill_cost=0.01)
    gen = Engine(target, hybrid, 8).generate(PROMPT, params).run()
    return gen.token_ids, gen.stats.by_proposer.get("draft", {}).get("num_draft_tokens", 0), hybrid


def test_a_draft_dearer_than_declared_stops_being_chosen():
    params = SamplingParams(max_new_tokens=120)
    expected = Engine(MockLM(V, hashed_logits(V, "measured"))).generate(PROMPT, params).run().token_ids
    # each draft step really costs twice a verify pass: drafting cannot pay, whatever it accepts
    dear, dear_drafts, hybrid = _run(0.008, params)
    assert dear == expected
    assert not hybrid.draft_pays
    # its declared cost: a step a tenth of a pass, every draft accepted (drafts every round)
    cheap, cheap_drafts, hybrid = _run(0.0004, params)
    assert cheap == expected
    assert hybrid.draft_pays
    # the dear one: its first two rounds (the first feeds it, the second is measured), then
    # no probe: every later one would first have to feed it what it skipped
    assert cheap_drafts >= 80 and dear_drafts <= 12, (cheap_drafts, dear_drafts)


def test_a_seeded_rejection_request_is_not_calibrated_by_the_clock():
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, acceptance_rule="rejection")
    first, drafts, hybrid = _run(0.008, params)
    assert hybrid.draft_pays  # no round time was reported
    assert drafts >= 20  # the declared costs decide: the dear draft drafts on
    assert _run(0.008, params)[0] == first

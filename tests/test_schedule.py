"""K schedules (fixed, heuristic, auto), the forward-time profile, and the engine's checks of
what schedules and proposers hand it; option validation of the method registry."""

from __future__ import annotations

import random

import pytest

from helpers import MockLM, hashed_logits
from specdecode.config import SamplingParams
from specdecode.methods import SpeculativeConfig, speculative_config
from specdecode.engine import Engine
from specdecode.proposers import DraftModelProposer, DraftOutput, PromptLookupProposer, Proposer
from specdecode.schedule import AutoK, FixedK, HeuristicK
from helpers import PROMPTS, V, noisy_draft, ref, run, target
from lookups import GREEDY128, linear_times


def test_heuristic_schedule_follows_transformers():
    h = HeuristicK(5, max_k=9)
    seq = []
    for proposed, accepted in [(5, 5), (7, 7), (9, 9), (9, 9), (9, 3), (8, 0), (0, 0), (7, 0),
                               (6, 0), (5, 0), (4, 0), (3, 0), (2, 0), (1, 0), (1, 1)]:
        seq.append(h.next_k())
        h.update(proposed, accepted, 0.0, 0.0)
    assert seq == [5, 7, 9, 9, 9, 8, 7, 7, 6, 5, 4, 3, 2, 1, 1]
    assert h.next_k() == 3
    h.reset()
    assert h.next_k() == 5


def test_auto_expected_tokens_is_leviathans_formula():
    a = AutoK(linear_times(9), 8, first_alpha=0.7)
    for k in range(9):  # no data: every α_i is the prior 0.7
        assert a.expected_tokens(k) == pytest.approx((1 - 0.7 ** (k + 1)) / (1 - 0.7))


def test_auto_grows_k_when_everything_is_accepted_and_shrinks_when_nothing_is():
    times = linear_times(17, 0.2, 0.03)
    a = AutoK(times, 16)
    for _ in range(40):
        k = a.next_k()
        a.update(k, k, 0.0, times[k])
    assert a.next_k() == 16
    seen = []
    for _ in range(40):
        k = a.next_k()
        seen.append(k)
        a.update(k, 0, 0.0, times[k])
    # nothing accepted: K falls to 0 (no speculation), probing one token every 8 rounds
    assert seen[-16:].count(0) >= 14 and set(seen[-16:]) <= {0, 1}


def test_auto_k_accounts_for_draft_cost():
    """Each draft accepted with probability 0.7 (given the ones before): a free proposer is
    worth about 6 tokens a round on this cost curve, a draft costing a quarter of T(1) per
    token about 2."""
    times = linear_times(17, 0.2, 0.005)
    rng = random.Random(0)
    picks = {}
    for per_token in (0.0, 0.05):
        a = AutoK(times, 16)
        for _ in range(400):
            k = a.next_k()
            accepted = 0
            while accepted < k and rng.random() < 0.7:
                accepted += 1
            a.update(k, accepted, per_token * k, times[k])
        picks[per_token] = a.next_k()
    assert 4 <= picks[0.0] <= 9 and 1 <= picks[0.05] <= 3


def test_auto_trims_free_proposals_by_offered_length():
    """Lookups: K is chosen after the proposal is seen, from how proposals of that length
    fared. Long ones that keep being accepted are verified whole; one-token guesses that are
    always wrong are dropped (one probe every 8 rounds) without touching the long ones."""
    times = linear_times(17, 0.2, 0.01)
    a = AutoK(times, 16)
    assert a.next_k() < 16  # before any lookup: the cost model's K
    for _ in range(30):
        k = a.trim(16)
        a.update(k, k, 0.0, times[k])
        k = a.trim(1)
        a.update(k, 0, 0.0, times[k])
    assert a.next_k() == 16  # a lookup offers everything it has
    assert a.trim(16) == 16 and a.trim(12) == 12  # 8..15 inherits nothing from 16: prior 8/9
    a.update(12, 12, 0.0, times[12])
    ones = []
    for _ in range(16):
        ones.append(a.trim(1))
        a.update(ones[-1], 0, 0.0, times[ones[-1]])
    assert ones.count(0) == 14 and ones.count(1) == 2
    a.reset()
    assert a.next_k() < 16


def test_auto_trims_a_proposal_where_its_acceptance_runs_out():
    """Proposals of 16 whose first 3 tokens are always right and the 4th always wrong: K = 3
    or 4 (the 4th costs one more token of verify pass for nothing, the rest would too)."""
    times = linear_times(17, 0.2, 0.02)
    a = AutoK(times, 16)
    for _ in range(40):
        k = a.trim(16)
        a.update(k, min(k, 3), 0.0, times[k])
    assert 3 <= a.trim(16) <= 4


def test_engine_trims_only_free_proposals():
    """The engine asks the schedule to trim lookups' proposals, never a draft model's (whose
    tokens are already paid for and whose K the schedule chose before drafting)."""
    class TrimToOne(FixedK):
        calls = 0

        def trim(self, offered):
            TrimToOne.calls += 1
            return 1

    prompt = PROMPTS["repetitive"]
    expected = list(ref(tuple(prompt), GREEDY128))
    gen, _ = run(target(), PromptLookupProposer(), TrimToOne(8), prompt, GREEDY128)
    assert gen.token_ids == expected and TrimToOne.calls > 0
    assert gen.stats.num_draft_tokens == gen.stats.num_drafts == TrimToOne.calls  # one each
    assert gen.stats.speculation_lengths.count(1) == TrimToOne.calls
    TrimToOne.calls = 0
    gen, _ = run(target(), DraftModelProposer(noisy_draft()), TrimToOne(4), prompt, GREEDY128)
    assert gen.token_ids == expected and TrimToOne.calls == 0 and gen.stats.num_draft_tokens > 100


def test_schedules_validate():
    for bad in (0, 65, 2.5, True):
        with pytest.raises(ValueError, match="K"):
            FixedK(bad)
    with pytest.raises(ValueError, match="forward times"):
        AutoK([0.1], 4)


def test_speculation_lengths_count_rounds_without_speculation():
    """A proposer that is always wrong: auto K falls to 0 (no speculation) in most rounds, and
    those rounds count in the mean K."""
    from helpers import ScriptedProposer

    prompt = PROMPTS["twenty"]
    expected = list(ref(tuple(prompt), GREEDY128))
    gen, blocks = run(target(), ScriptedProposer(len(prompt), expected, V, right=0),
                      AutoK(linear_times(17, 0.2, 0.05), 16), prompt, GREEDY128)
    assert gen.token_ids == expected
    lengths = gen.stats.speculation_lengths
    assert len(lengths) == len(blocks) and lengths.count(0) > len(lengths) // 2
    assert gen.stats.to_dict()["mean_speculation_length"] == pytest.approx(sum(lengths) / len(lengths), abs=1e-3)


class _BadIds(Proposer):
    name = "bad"

    def propose(self, state, k):
        return DraftOutput.point_mass([1, V + 5][:k], "bad")


def test_engine_rejects_bad_schedules_and_out_of_vocabulary_proposals():
    for bad in ("auto", 4.0, True, 0, 65):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            Engine(target(), PromptLookupProposer(), bad)
    Engine(target(), None, None)  # plain decoding needs no K
    with pytest.raises(ValueError, match=f"outside the target's vocabulary \\[0, {V}\\)"):
        Engine(target(), _BadIds(), 4).generate([1, 2, 3], GREEDY128).run()


def test_verify_profile_busy_model_and_bad_cache_files(tmp_path, monkeypatch):
    from specdecode.models import LoadedModel
    from specdecode import profile as schedule
    from specdecode.profile import verify_profile

    monkeypatch.setattr(schedule, "PROFILE_DIR", tmp_path)
    model = LoadedModel(MockLM(30, hashed_logits(30), max_context=64), name="mock")
    busy = Engine(model.lm).generate([1, 2, 3], SamplingParams(max_new_tokens=5))
    next(iter(busy))  # paused mid-request: its KV cache is in use
    with pytest.raises(RuntimeError, match="generating another request"):
        verify_profile(model, 4)
    busy.close()
    before = len(model.lm.forward_sizes)
    times = verify_profile(model, 4)
    assert len(times) == 5 and model.lm.forward_sizes[before] == 64 - 5  # context fits the model
    (path,) = tmp_path.glob("*.json")
    for junk in ("[]", "null", '{"forward_seconds": [0, 0, 0, 0, 0]}', "{not json"):
        path.write_text(junk)
        fresh = LoadedModel(MockLM(30, hashed_logits(30), max_context=64), name="mock")
        again = verify_profile(fresh, 4)
        assert len(again) == 5 and all(t > 0 for t in again) and fresh.lm.forward_sizes  # measured


def test_profiles_of_another_device_are_kept_apart(tmp_path, monkeypatch):
    """A model's forward times on an accelerator are not its times on the CPU: the cache key
    names the device (and the accelerator), so a run on one never reads the other's (the
    K schedule and the hybrid would steer by them). The CPU's key is unchanged, so the
    profiles cached before this are still read."""
    import json
    import torch
    from specdecode.models import LoadedModel
    from specdecode.profile import _cpu_model, profile_path

    monkeypatch.setattr("specdecode.profile.PROFILE_DIR", tmp_path)
    plain = LoadedModel(MockLM(30, hashed_logits(30)), name="mock")
    on_cpu = LoadedModel(MockLM(30, hashed_logits(30)), name="mock")
    on_cpu.lm.device = torch.device("cpu")
    elsewhere = LoadedModel(MockLM(30, hashed_logits(30)), name="mock")
    elsewhere.lm.device = torch.device("meta")
    key, path = profile_path(plain, "what")
    assert (key, path) == profile_path(on_cpu, "what")
    assert json.loads(key)[-2:] == [_cpu_model(), "what"]  # the key's shape before devices
    other_key, other_path = profile_path(elsewhere, "what")
    assert other_path != path and json.loads(other_key)[-3:] == ["meta", "meta", "what"]


def test_prefill_profile_is_measured_once_and_is_the_hybrids_feed_cost(tmp_path, monkeypatch):
    """prefill_profile: seconds per token of a PREFILL_TOKENS-token pass into an empty cache,
    measured on the model (refused while it generates), then read from memory or the cache
    file; the hybrid method charges a draft's feed at that over the target's T(1)."""
    from specdecode import profile
    from specdecode.methods import build_proposer
    from specdecode.models import LoadedModel

    monkeypatch.setattr(profile, "PROFILE_DIR", tmp_path)
    draft = LoadedModel(MockLM(V, hashed_logits(V), max_context=256), name="draft")
    busy = Engine(draft.lm).generate([1, 2, 3], SamplingParams(max_new_tokens=5))
    next(iter(busy))
    with pytest.raises(RuntimeError, match="generating another request"):
        profile.prefill_profile(draft)
    busy.close()
    before = len(draft.lm.forward_sizes)
    per_token = profile.prefill_profile(draft)
    assert per_token > 0 and draft.lm.forward_sizes[before:] == [profile.PREFILL_TOKENS] * 4
    assert profile.prefill_profile(draft) == per_token and len(draft.lm.forward_sizes) == before + 4
    fresh = LoadedModel(MockLM(V, hashed_logits(V), max_context=256), name="draft")
    assert profile.prefill_profile(fresh) == per_token and not fresh.lm.forward_sizes  # from disk
    tgt = LoadedModel(MockLM(V, hashed_logits(V), max_context=256), name="target")
    hybrid = build_proposer(SpeculativeConfig("hybrid"), tgt, draft)
    t1 = profile.verify_profile(tgt, 16)[0]
    assert hybrid.draft_prefill_cost == pytest.approx(per_token / t1)
    assert hybrid.draft_cost == pytest.approx(profile.verify_profile(draft, 0)[0] / t1)


def test_inapplicable_options_raise():
    from specdecode.config import KSchedule

    with pytest.raises(ValueError, match="suffix_cache applies"):
        SpeculativeConfig("draft", suffix_cache="session")
    with pytest.raises(ValueError, match="n-gram sizes .* apply to 'prompt-lookup', not 'suffix'"):
        SpeculativeConfig("suffix", max_ngram=4)
    with pytest.raises(ValueError, match="max_speculative_tokens caps K"):
        SpeculativeConfig("draft", 4, KSchedule.FIXED, 8)
    with pytest.raises(ValueError, match="draft_p_min applies to 'draft' and 'hybrid'"):
        SpeculativeConfig("suffix", draft_p_min=0.5)


def test_the_draft_heads_default_to_auto_k_and_a_given_k_is_fixed():
    """With neither K nor a schedule given, the draft heads' methods schedule K by auto (a
    head trained here is weak: its papers' K of 3-4 made `eagle3` 0.81x plain decoding)
    from their default K; a K given fixes it; the other methods stay at a fixed K; the CLI's
    method strings and the bench rows take the same defaults."""
    from specdecode.config import KSchedule

    for name, k in (("eagle3", 4), ("medusa", 3)):
        spec = SpeculativeConfig(name)
        assert (spec.schedule, spec.num_speculative_tokens, spec.k_given) == (KSchedule.AUTO, k, False)
        assert SpeculativeConfig(name, 2).schedule is KSchedule.FIXED
        assert SpeculativeConfig(name, schedule="heuristic").schedule is KSchedule.HEURISTIC
        assert SpeculativeConfig(name, max_speculative_tokens=6).max_speculative_tokens == 6
        assert speculative_config(f"{name}:head=/x", False).schedule is KSchedule.AUTO
        assert speculative_config(f"{name}:head=/x", False, num_speculative_tokens=1).schedule is KSchedule.FIXED
    for name in ("draft", "layer-skip", "suffix", "prompt-lookup", "self"):
        assert SpeculativeConfig(name).schedule is KSchedule.FIXED


def test_auto_k_does_not_count_a_probes_catch_up_as_draft_cost():
    """A round after rounds without drafts feeds the draft everything committed meanwhile;
    that time is not a cost per drafted token (counted so, a one-token probe cost twice a
    draft step and kept K at 0 for good). Ordinary rounds still update the cost."""
    a = AutoK(linear_times(9), 8, draft_seconds_per_token=0.3)
    a.next_k()
    a.update(0, 0, 0.0, 1.0)  # a round without drafts
    a.next_k()
    a.update(1, 1, 1.5, 1.1)  # the probe: catch-up + one step
    assert a.draft_per_token == pytest.approx(0.3)
    a.next_k()
    a.update(4, 4, 1.6, 1.2)  # a round after a drafting one: 0.4 a token, measured
    assert a.draft_per_token == pytest.approx(0.4)


def test_auto_counts_the_lookahead_draft_tokens_once_a_round():
    """A draft of another tokenizer drafts one token past the K it proposes: with
    ``lookahead=1`` auto measures the true cost per draft token and charges the extra one once
    a round; without, that cost spread over K tokens looks like a dearer draft."""
    times = linear_times(17, 0.1, 0.01)
    c = 0.03
    aware = AutoK(times, 16, draft_seconds_per_token=c, lookahead=1)
    naive = AutoK(times, 16, draft_seconds_per_token=c)
    for sched in (aware, naive):
        for _ in range(30):
            k = max(1, sched.next_k())
            sched.update(k, min(k, 2), c * (k + 1), times[k])
    assert aware.draft_per_token == pytest.approx(c)
    assert naive.draft_per_token > 1.2 * c
    assert aware.cost(2) == pytest.approx(3 * c + times[2]) and aware.cost(0) == times[0]
    with pytest.raises(ValueError, match="lookahead"):
        AutoK(times, 16, lookahead=-1)

"""The batched engine: requests of different prompts, lengths, methods, K and sampling share
each verify pass, join and leave between steps, and each output equals its request run alone,
token for token, on the real int8 kernels (linears and attention: rows independent bit for
bit) — greedy and seeded sampled, whatever else is in the batch."""

from __future__ import annotations

import pytest
import torch

from specdecode.batch import BatchEngine
from specdecode.config import SamplingParams
from specdecode.engine import Engine
from specdecode.models import quant
from specdecode.models.attention import attention_kernel
from specdecode.proposers import DraftModelProposer, PromptLookupProposer, SuffixProposer
from specdecode.schedule import FixedK

from helpers import KERNEL_SHAPES, tiny_model

@pytest.fixture(scope="module")
def target():
    return tiny_model(0, int8="kn", **KERNEL_SHAPES)


@pytest.fixture(scope="module")
def draft():
    """The target's weights plus noise, in int8: it disagrees with the target at times."""
    noisy = tiny_model(0, **KERNEL_SHAPES)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in noisy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return noisy.quantize("kn")


def prompt(n, seed):
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cases(draft):
    """(prompt, params, proposer factory, K) of mixed requests; a factory takes the draft
    model to draft with (default: a fork of the draft, as a request alone has)."""
    greedy = lambda n: SamplingParams(max_new_tokens=n)  # noqa: E731
    sampled = lambda n, seed: SamplingParams(max_new_tokens=n, temperature=0.8, seed=seed)  # noqa: E731
    rep = [11, 23, 5, 42, 17] * 6
    on_draft = lambda m=None: DraftModelProposer(m if m is not None else draft.fork())  # noqa: E731
    return [
        (prompt(9, 1), greedy(30), lambda m=None: None, None),
        (prompt(40, 2), greedy(25), on_draft, 4),
        (rep, greedy(40), lambda m=None: PromptLookupProposer(), 8),
        (prompt(3, 3), sampled(30, 7), on_draft, 3),
        (rep[:17], greedy(20), lambda m=None: SuffixProposer(), 6),
        (prompt(70, 4), sampled(20, 9), lambda m=None: PromptLookupProposer(), 5),
        ([5], greedy(12), on_draft, 2),
        # the rejection rule's draws depend on the draft's probabilities: the batched draft
        # pass must give each row the bits of its draft alone
        (prompt(20, 5), SamplingParams(max_new_tokens=24, temperature=0.9, seed=4,
                                       acceptance_rule="rejection"), on_draft, 3),
    ]


def solo(target, p, params, proposer, k):
    return Engine(target.fork(), proposer, k, debug=True).generate(p, params).run()


@pytest.mark.parametrize("max_batch", [1, 3, 8])
def test_each_row_equals_its_request_alone(target, draft, max_batch):
    exact = attention_kernel(torch.device("cpu"), torch.float32, target.args) is not None
    assert exact, "this project's machines run the CPU kernels"
    reqs = cases(draft)
    want = [solo(target, p, params, make(), k) for p, params, make, k in reqs]
    model = target.fork()
    engine = BatchEngine(model, max_batch, 160, debug=True)
    try:
        # the draft-model rows draft on the batch's rows of one draft cache (one pass a step)
        gens = [engine.add(p, params, proposer=make(engine.draft_view(draft)),
                           schedule=None if k is None else FixedK(k)) for p, params, make, k in reqs]
        (rows,) = engine._draft_rows.values()
        sizes, run = [], rows.run
        rows.run = lambda passes: (sizes.append(len(passes)), run(passes))[1]
        steps = 0
        while engine.waiting or engine.active:
            out = engine.step()
            assert len(out) <= max_batch
            steps += 1
        for g in gens:  # hands out the blocks the steps made
            assert [t for block in g for t in block] == g.token_ids
        for g, w, (p, params, _, _) in zip(gens, want, reqs):
            assert g.token_ids == w.token_ids, p[:5]
            assert g.finish_reason == w.finish_reason
            assert g.stats.num_generated_tokens == len(g.token_ids)
        speculative = [g for g, (_, _, make, _) in zip(gens, reqs) if make() is not None]
        assert sum(g.stats.num_draft_tokens for g in speculative) > 0
        assert any(g.stats.num_accepted_tokens < g.stats.num_draft_tokens for g in speculative)
        if max_batch > 1:  # requests really shared passes, the draft's too
            assert steps < sum(w.stats.num_verify_passes for w in want)
            assert max(sizes) > 1
    finally:
        engine.close()


def test_rows_join_as_others_leave_and_a_closed_engine_frees_the_target(target):
    model = target.fork()
    engine = BatchEngine(model, 2, 64)
    params = [SamplingParams(max_new_tokens=n) for n in (3, 10, 5)]
    gens = [engine.add(prompt(4, i), p) for i, p in enumerate(params)]
    engine.step()
    assert engine.active == 2 and len(engine.waiting) == 1
    for _ in range(3):  # plain decoding: a token a step; the first request leaves after 3
        engine.step()
    assert engine.active == 2 and not engine.waiting
    assert len(gens[0].run().token_ids) == 3 and gens[0].finish_reason == "length"
    assert gens[1].finish_reason is None  # set when its last block is handed out
    engine.run()
    assert [len(g.token_ids) for g in gens] == [3, 10, 5]
    assert [g.finish_reason for g in gens] == ["length"] * 3
    with pytest.raises(RuntimeError, match="already generating"):
        Engine(model).generate([1, 2], SamplingParams(max_new_tokens=2)).run()
    engine.close()
    assert len(Engine(model).generate([1, 2], SamplingParams(max_new_tokens=2)).run().token_ids) == 2


def test_iterating_one_generation_steps_the_whole_batch_and_closing_it_cancels(target):
    """The pull model the API's streams use: consuming one request advances all rows; a
    generation closed early leaves its row at once."""
    engine = BatchEngine(target.fork(), 4, 64)
    try:
        gens = [engine.add(prompt(5, i), SamplingParams(max_new_tokens=n))
                for i, n in enumerate((8, 20, 20))]
        assert len(gens[0].run().token_ids) == 8
        assert engine.active == 2  # the others ran alongside: 8 tokens each, waiting
        it = iter(gens[1])
        assert len(next(it)) == 1
        gens[1].close()
        assert engine.active == 1
        assert len(gens[2].run().token_ids) == 20
        assert engine.active == 0
    finally:
        engine.close()


def test_bad_input(target):
    with pytest.raises(ValueError, match="max_batch"):
        BatchEngine(target.fork(), 0, 64)
    engine = BatchEngine(target.fork(), 1, 32)
    try:
        with pytest.raises(ValueError, match="exceeds this batch's 32 positions"):
            engine.add(prompt(20, 0), SamplingParams(max_new_tokens=20))
        with pytest.raises(ValueError, match="empty"):
            engine.add([], SamplingParams(max_new_tokens=2))
    finally:
        engine.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import specdecode
    from tiny_dirs import tiny_dirs_in

    dirs = tiny_dirs_in(tmp_path_factory)
    return specdecode.load(dirs["target"]), specdecode.load(dirs["draft"]), dirs


@pytest.mark.parametrize("method", ["ar", "draft", "prompt-lookup", "suffix", "hybrid"])
def test_generate_over_a_list_of_prompts_equals_each_alone(pair, method):
    """The offline batch API: specdecode.generate(target, [prompt, ...]) runs them in one
    BatchEngine; text, tokens and finish reasons equal the prompts run one by one."""
    import specdecode

    target, draft, _ = pair
    prompts = ["def add(a, b):", "Hello there, how are you today?", "x = [1, 2, 3",
               [{"role": "user", "content": "hi"}], "def add(a, b):"]
    kw = dict(max_new_tokens=24, method=method, draft=draft if method in ("draft", "hybrid") else None)
    many = specdecode.generate(target, prompts, max_batch=3, **kw)
    assert len(many) == len(prompts)
    for got, p in zip(many, prompts):
        want = specdecode.generate(target, p, **kw)
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
        assert got.prompt_token_ids == want.prompt_token_ids
    # (whether rows drafted is the batch policy's call from this machine's forward times:
    # a draft as large as this tiny target does not pay; test_the_batch_policy_* drafts)
    seeded = dict(kw, temperature=0.8, seed=11)
    many = specdecode.generate(target, prompts[:3], **seeded)
    assert [r.token_ids for r in many] == [specdecode.generate(target, p, **seeded).token_ids
                                           for p in prompts[:3]]


def test_a_seeded_rejection_rule_row_takes_its_own_k_beside_any_neighbour(pair):
    """A seeded row of the rejection rule keeps the K it would have alone: its output depends
    on its proposals, so the batch policy's probe (one token after rounds without drafts) must
    not touch it. Found by a break-it pass: "hello there" beside "a" changed its tokens."""
    import specdecode

    target = pair[0]
    kw = dict(method="suffix", max_new_tokens=40, temperature=0.8, seed=5,
              acceptance_rule="rejection", num_speculative_tokens=8)
    alone = specdecode.generate(target, "hello there", **kw).token_ids
    for other in ("def f(x):", "a", "hello there", "zzz zzz"):
        assert specdecode.generate(target, ["hello there", other], **kw)[0].token_ids == alone, other


def test_a_draft_of_another_tokenizer_has_its_positions_in_a_batch(pair):
    """A draft of another tokenizer reads more tokens than the target: its rows in a batch
    get the positions it has alone, so it drafts as much as alone, and a seeded rejection-rule
    row (whose output depends on its proposals) equals its solo run."""
    import specdecode

    target, _, dirs = pair
    foreign = specdecode.load(dirs["foreign"])
    kw = dict(method="draft", draft=foreign, max_new_tokens=40, num_speculative_tokens=3)
    alone = specdecode.generate(target, "def f(x):", **kw)
    [batched] = specdecode.generate(target, ["def f(x):"], **kw)
    assert batched.token_ids == alone.token_ids
    assert batched.stats.num_draft_tokens == alone.stats.num_draft_tokens > 0
    sampled = dict(kw, temperature=0.8, seed=5, acceptance_rule="rejection")
    assert specdecode.generate(target, ["def f(x):"], **sampled)[0].token_ids == \
        specdecode.generate(target, "def f(x):", **sampled).token_ids


def test_generate_batch_bad_input(pair):
    import specdecode

    target, draft, dirs = pair
    with pytest.raises(ValueError, match="max_batch"):
        specdecode.generate(target, ["a", "b"], max_batch=0)
    with pytest.raises(ValueError, match="not both"):
        specdecode.generate(target, ["a"], input_ids=[1, 2])
    with pytest.raises(ValueError, match="suffix_cache='request'"):
        specdecode.generate(target, ["a", "b"], method="suffix", suffix_cache="session")
    hf = specdecode.load(dirs["target"], backend="transformers")
    with pytest.raises(ValueError, match="needs the native runtime"):
        specdecode.generate(hf, ["a", "b"], max_new_tokens=3)


def test_batch_policy_speculates_where_it_pays_and_stops_as_the_batch_grows():
    flat = [0.060 * (1 + 0.03 * (n - 1)) for n in range(1, 18)]  # a verify pass nearly free
    steep = [0.060 * n for n in range(1, 18)]  # every token costs a full pass
    from specdecode.batch import choose_lengths

    # one row, free proposals, high acceptance: the whole proposal; low acceptance: little
    assert choose_lengths([0.9], [0.0], [8], [False], flat) == [8]
    assert choose_lengths([0.05], [0.0], [8], [False], steep) == [0]
    # a draft model's steps cost time: fewer tokens than free lookups at the same acceptance
    assert choose_lengths([0.7], [0.02], [8], [False], flat)[0] < choose_lengths([0.7], [0.0], [8], [False], flat)[0]
    # more rows: the pass grows, and the policy drafts less per row, down to none
    one = choose_lengths([0.6], [0.015], [6], [False], flat)[0]
    eight = choose_lengths([0.6] * 8, [0.015] * 8, [6] * 8, [False] * 8, flat)
    assert one > 0 and max(eight) < one
    assert choose_lengths([0.6] * 16, [0.03] * 16, [6] * 16, [False] * 16, steep) == [0] * 16
    # a fixed row keeps its own K, whatever pays
    assert choose_lengths([0.05, 0.9], [0.0, 0.0], [5, 8], [True, False], steep)[0] == 5
    # rows whose drafts run in one pass (DraftRows) pay a draft step once for all of them:
    # where each row's own steps would not pay, one pass for all does
    alone = choose_lengths([0.6] * 4, [0.02] * 4, [6] * 4, [False] * 4, flat)
    together = choose_lengths([0.6] * 4, [0.02] * 4, [6] * 4, [False] * 4, flat, batched=[True] * 4)
    assert sum(together) > sum(alone)
    assert choose_lengths([0.6], [0.02], [6], [False], flat, batched=[True]) == \
        choose_lengths([0.6], [0.02], [6], [False], flat)  # one row: the same cost


def test_the_batch_policy_keeps_every_output(target, draft):
    """With the K policy on (forward times given), each row still equals its solo run."""
    reqs = cases(draft)
    want = [solo(target, p, params, make(), k) for p, params, make, k in reqs]
    times = [0.01 * (1 + 0.1 * (n - 1)) for n in range(1, 18)]
    engine = BatchEngine(target.fork(), 4, 160, debug=True, forward_seconds=times)
    try:
        # the draft-model rows draft on the batch's rows of one draft cache (one pass a step)
        gens = [engine.add(p, params, proposer=make(engine.draft_view(draft)),
                           schedule=None if k is None else FixedK(k)) for p, params, make, k in reqs]
        engine.run()
        assert [g.token_ids for g in gens] == [w.token_ids for w in want]
        verified = sum(sum(g.stats.speculation_lengths) for g in gens)
        asked = sum(sum(w.stats.speculation_lengths) for w in want)
        assert 0 < verified < asked  # it drafted, and less than each request alone would
    finally:
        engine.close()


def test_an_empty_prompt_list_is_named(pair):
    import specdecode

    with pytest.raises(ValueError, match="prompt is an empty list"):
        specdecode.generate(pair[0], [], max_new_tokens=2)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_long_prefill_stalls_the_others_one_chunk_at_most(target, draft, monkeypatch, weights):
    """A request whose prompt is several PREFILL_CHUNKs joins a row that is generating: each
    step runs one chunk of its prefill (chunks cut where a request alone cuts them) and the
    generating row still gets its block every step; both outputs equal their solo runs.
    int4: Q4_K linears, whose chunks (more than PREFILL_MIN_TOKENS tokens) multiply in bf16
    where the CPU has AMX-BF16 (a path whose bits depend on the pass's shape)."""
    chunk = 128  # (smaller than the default 512, for the tiny model's context)
    monkeypatch.setattr(type(target), "PREFILL_CHUNK", chunk)
    long_passes = []
    if weights == "int4":
        if quant.q4k_kernel()[0] is None:  # int4 runs on the VNNI or AVX2 kernel only: refused, saying so
            with pytest.raises(RuntimeError, match="VNNI"):
                m = tiny_model(0, int8="vnni", int4=True, **KERNEL_SHAPES)
                m.allocate(1, 4)
                m.forward(torch.tensor([[1, 2]]))
            return
        target = tiny_model(0, int8="vnni", int4=True, **KERNEL_SHAPES)
        bf16_linear = quant._bf16_linear
        monkeypatch.setattr(quant, "_bf16_linear", lambda lin, x, run: (long_passes.append(x.shape[1]),
                                                                          bf16_linear(lin, x, run))[1])
    long_prompt = prompt(2 * chunk + 100, 8)
    short = (prompt(12, 9), SamplingParams(max_new_tokens=40), lambda: DraftModelProposer(draft.fork()), 3)
    longer = (long_prompt, SamplingParams(max_new_tokens=8), lambda: None, None)
    want = [solo(target, p, params, make(), k) for p, params, make, k in (short, longer)]
    model = target.fork()
    engine = BatchEngine(model, 2, len(long_prompt) + 16, debug=True)
    sizes = []
    forward_row = model.forward_row
    model.forward_row = lambda b, ids, num_logits=None: (sizes.append((b, ids.shape[1])), forward_row(b, ids, num_logits))[1]
    try:
        a = engine.add(short[0], short[1], proposer=short[2](), schedule=FixedK(3))
        engine.step()  # the short request is generating
        b = engine.add(longer[0], longer[1])
        during = []
        while engine.rows[1] is None or engine.rows[1].prompt is not None:
            out = dict((id(g), t) for g, t in engine.step())
            during.append(len(out.get(id(a), [])))
        assert [n for row, n in sizes if row == 1] == [chunk, chunk, 99]
        assert len(during) == 3 and all(during[:2])  # the short row went on between chunks
        engine.run()
        assert [a.token_ids, b.token_ids] == [w.token_ids for w in want]
        if weights == "int4":  # the solo run's chunks and the batch's took the tile unit
            per_chunk = long_passes.count(99) // 2
            assert long_passes == ([chunk] * 2 * per_chunk + [99] * per_chunk) * 2 and per_chunk > 0 \
                if quant.bf16_prefill() else not long_passes
    finally:
        engine.close()


def test_a_span_of_rows_computes_only_those_rows_with_the_batchs_bits(target):
    """forward_span(1, 3) appends to rows 1 and 2 only, with the logits (bit for bit) and cache
    lengths that a pass over the whole batch gives those rows; a bad span is a ValueError."""
    whole, part = target.fork(), target.fork()
    for m in (whole, part):
        m.allocate(4, 64)
        for b, n in enumerate([5, 9, 3, 7]):
            m.forward_row(b, torch.tensor([prompt(n, 20 + b)]), num_logits=0)
    x = torch.tensor([prompt(3, 30), prompt(3, 31), prompt(3, 32), prompt(3, 33)])
    lengths = [3, 2, 3, 1]
    full = whole.forward_rows(x, lengths).logits
    span = part.forward_span(1, 3, x[1:3], lengths[1:3]).logits
    assert torch.equal(span[0, :2], full[1, :2]) and torch.equal(span[1], full[2])
    assert part.row_lengths == [5, 11, 6, 7] and whole.row_lengths == [8, 11, 6, 8]
    for bad in ((2, 2), (-1, 2), (0, 5)):
        with pytest.raises(ValueError, match="span of cache rows"):
            part.forward_span(*bad, x[:1], [1])


def test_measured_rates_speculate_only_where_measured_faster():
    """The guard that keeps a batch from running slower than plain decoding: plain rounds are
    measured first, then speculative ones; the faster (tokens over seconds of the window: a
    slow round that fed a draft counts, a long acceptance too) is chosen, the other tried
    after explore_every rounds, a gap that doubles while trials change nothing. A batch size
    not measured with speculation takes its neighbours' verdict: slower with fewer rows, off;
    faster with more rows, on."""
    from specdecode.batch import MeasuredRates

    g = MeasuredRates(window=16, min_rounds=3, explore_every=4)
    choices = []
    for _ in range(3):
        choices.append(g.speculate(2))
        g.record(2, False, 2, 0.1)  # plain: 20 tokens/s
    assert choices == [False] * 3
    assert g.speculate(2) is True and g.trial  # speculation not measured yet
    for tokens, seconds in ((3, 0.5), (14, 0.1), (3, 0.1)):  # a round that fed a draft, a long acceptance
        g.record(2, True, tokens, seconds)
    assert g.rate(2, True) == pytest.approx(20 / 0.7) and g.rate(2, False) == pytest.approx(20)
    picks = [(g.speculate(2), g.trial) for _ in range(12)]
    # explores plain after 4 rounds; that left the choice as it was: the next trial after 8
    assert [p for p, _ in picks] == [True] * 3 + [False] + [True] * 7 + [False]
    assert not any(t for _, t in picks)  # speculation measured faster: none is a trial
    for _ in range(16):
        g.record(2, True, 1, 0.1)  # speculation now slower: 10 tokens/s
    # the trial changed the choice: the gap is back to 4
    assert [(g.speculate(2), g.trial) for _ in range(4)] == [(False, False)] * 3 + [(True, True)]
    assert g.speculate(3) is False and g.rate(3, False) is None  # plain first at each size
    for _ in range(3):
        g.record(3, False, 3, 0.1)
        g.record(1, False, 1, 0.1)
    assert g.speculate(3) is False  # slower at 2 rows: not tried at 3
    assert g.speculate(1) is True  # (nothing known with fewer rows: tried)
    for _ in range(3):
        g.record(5, False, 5, 0.1)
        g.record(5, True, 10, 0.1)  # faster at 5 rows
    assert g.speculate(3) is True  # faster with more rows: taken with fewer
    # trials that change nothing come ever later, up to 8 x explore_every rounds apart
    g = MeasuredRates(window=16, min_rounds=3, explore_every=4)
    for _ in range(3):
        g.record(2, False, 2, 0.1)
        g.record(2, True, 4, 0.1)
    trials = [i for i in range(1, 130) if not g.speculate(2)]
    assert [b - a for a, b in zip([0] + trials, trials)] == [4, 8, 16, 32, 32, 32]


def test_the_policy_chooses_k_unless_the_request_gave_one(pair):
    """A request that names no K is the batch policy's to choose (a default K filled in by the
    config is not the request's own); an integer num_speculative_tokens is kept."""
    import specdecode

    target, draft, _ = pair
    engine = BatchEngine(target.lm, 3, 64, forward_seconds=[1e-3] * 17)
    try:
        streams = [specdecode.stream(target, "def f(x):", draft=draft, method="draft", max_new_tokens=8,
                                     num_speculative_tokens=k, batch=engine) for k in (None, 4, "heuristic")]
        for s in streams:
            next(s)  # each joins the batch (the first next() steps it)
        assert [row.fixed_k for row in engine.rows if row is not None] == [False, True, False]
    finally:
        engine.close()


class _Sharing(PromptLookupProposer):
    """Prompt lookup that records what the batch told it before each proposal."""

    def __init__(self):
        super().__init__()
        self.told: list[int] = []
        self.feed: list[bool] = []

    def share_passes(self, rows: int, feed: bool = True) -> None:
        self.told.append(rows)
        self.feed.append(feed)


def test_each_proposer_is_told_how_many_rows_share_its_passes(target):
    """Before each proposal the batch tells a row's proposer how many requests its passes
    hold up (the hybrid charges its draft's catch-up to each): the rows in the batch, and 1
    for a seeded request of the rejection rule, whose proposals must be those it makes alone."""
    engine = BatchEngine(target.fork(), 3, 64)
    greedy, seeded = SamplingParams(max_new_tokens=6), SamplingParams(
        max_new_tokens=6, temperature=0.8, seed=3, acceptance_rule="rejection")
    props = [_Sharing() for _ in range(3)]
    short = SamplingParams(max_new_tokens=1)
    for i, (p, params) in enumerate(zip(props, [short, greedy, seeded])):
        engine.add(prompt(5, i), params, proposer=p, schedule=FixedK(2))
    engine.step()
    assert [p.told for p in props] == [[3], [3], [1]]
    engine.run()  # the first request left after one round: two rows share the passes
    assert props[0].told == [3] and props[1].told[1:] == [2] * (len(props[1].told) - 1)
    assert set(props[2].told) == {1} and len(props[1].told) > 1
    assert all(f for p in props for f in p.feed)  # no guard without forward times: no trials
    engine.close()
    # with the guard: plain rounds of 3 rows measured, speculation not yet: a trial round,
    # in which no clocked row's draft is fed what it skipped
    engine = BatchEngine(target.fork(), 3, 64, forward_seconds=[0.01 * (1 + n / 8) for n in range(17)])
    for _ in range(3):
        engine.rates.record(3, False, 3, 0.1)
    props = [_Sharing() for _ in range(3)]
    for i, (p, params) in enumerate(zip(props, [greedy, greedy, seeded])):
        engine.add(prompt(5, i), params, proposer=p, schedule=FixedK(2))
    engine.step()
    assert [(p.told, p.feed) for p in props] == [([3], [False]), ([3], [False]), ([1], [True])]
    engine.close()


def test_a_lone_rows_rounds_are_not_measured_for_the_guard(target):
    """A lone row takes its own schedule's K, so its rounds say nothing about the batch's
    choice and are left out of the measured rates (which rounds of 2 rows enter)."""
    engine = BatchEngine(target.fork(), 2, 64)
    engine.add(prompt(5, 0), SamplingParams(max_new_tokens=8))
    engine.run()
    assert engine.rates.rate(1, False) is None
    for i in range(2):
        engine.add(prompt(5, i), SamplingParams(max_new_tokens=8))
    engine.run()
    assert engine.rates.rate(2, False) is not None
    engine.close()

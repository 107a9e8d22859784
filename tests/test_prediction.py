"""Predicted outputs: the prediction proposed for free, followed through edits (a token
changed, inserted, removed) and re-joined; the output equal to the request without a
prediction, with any method, alone and in a batch, streamed and not; OpenAI's accepted /
rejected prediction tokens as a longest common subsequence; the errors."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

import specdecode
from helpers import MockLM, hashed_logits
from specdecode.config import SamplingParams
from specdecode.engine import Engine
from specdecode.proposers import PredictionProposer, PromptLookupProposer, prediction_usage
from test_server import hybrid_server
from tiny_dirs import tiny_dirs_in

V = 40


def _lcs(a, b):
    """The textbook dynamic programme."""
    row = [0] * (len(b) + 1)
    for x in a:
        prev = 0
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], prev + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def test_prediction_usage_is_a_longest_common_subsequence():
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(5) for _ in range(rng.randrange(0, 90))]
        b = [rng.randrange(5) for _ in range(rng.randrange(0, 90))]
        accepted, rejected = prediction_usage(a, b)
        assert accepted == _lcs(a, b) and accepted + rejected == len(a)
    # OpenAI's example: an edit of a few tokens in a long prediction rejects just those
    assert prediction_usage([1, 2, 3, 4, 5], [1, 2, 9, 4, 5]) == (4, 1)
    assert prediction_usage([], [1, 2]) == (0, 0) and prediction_usage([1, 2], []) == (0, 2)


def _plain(prompt, n):
    target = MockLM(V, hashed_logits(V, "t", window=2))
    gen = Engine(target).generate(prompt, SamplingParams(max_new_tokens=n)).run()
    return gen.token_ids


EDITS = {
    "exact": lambda o: o,
    "changed": lambda o: o[:20] + [(o[20] + 1) % V] + o[21:],
    "inserted": lambda o: o[:20] + [o[3], o[9], o[1]] + o[20:],
    "removed": lambda o: o[:20] + o[26:],
    "shorter": lambda o: o[:30],
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_the_prediction_is_followed_through_an_edit(edit):
    """The output is the target's whatever the prediction; an edit costs a round or two:
    after it the pointer re-joins the prediction and the rest is proposed again."""
    prompt = [1, 2, 3]
    plain = _plain(prompt, 60)
    prediction = EDITS[edit](plain)
    target = MockLM(V, hashed_logits(V, "t", window=2))
    gen = Engine(target, PredictionProposer(prediction), 16, debug=True).generate(
        prompt, SamplingParams(max_new_tokens=60)).run()
    assert gen.token_ids == plain
    # the most rounds and the fewest tokens kept from it: the 6 tokens the prediction lacks
    # ("removed") and the 30 past its end ("shorter") cost a round each
    # (without re-joining, 41 rounds and 19 tokens after any edit)
    rounds, kept = {"exact": (4, 56), "changed": (7, 50), "inserted": (7, 50), "removed": (14, 46),
                    "shorter": (33, 29)}[edit]
    assert gen.stats.num_verify_passes <= rounds and gen.stats.num_accepted_tokens >= kept


def test_the_methods_proposer_proposes_where_the_prediction_has_nothing():
    """Past the prediction's end the inner proposer (prompt lookup here) takes the rounds;
    unrelated predictions cost nothing to the output."""
    prompt = [5, 6, 7, 8, 9] * 3
    plain = _plain(prompt, 50)
    target = MockLM(V, hashed_logits(V, "t", window=2))
    gen = Engine(target, PredictionProposer(plain[:10], PromptLookupProposer()), 16, debug=True).generate(
        prompt, SamplingParams(max_new_tokens=50)).run()
    assert gen.token_ids == plain
    assert gen.stats.by_proposer["prediction"]["num_accepted_tokens"] >= 9
    noise = [random.Random(1).randrange(V) for _ in range(80)]
    other = Engine(MockLM(V, hashed_logits(V, "t", window=2)), PredictionProposer(noise), 16).generate(
        prompt, SamplingParams(max_new_tokens=50)).run()
    assert other.token_ids == plain


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    dirs = tiny_dirs_in(tmp_path_factory)
    return specdecode.load(dirs["target"]), specdecode.load(dirs["draft"]), dirs


PROMPT = "def add(a, b):\n    return a + b\n\n"


@pytest.mark.parametrize("sampled", [False, True])
def test_a_prediction_keeps_each_methods_output(pair, sampled):
    """Greedy and seeded sampling: with a prediction (the output itself with a change in
    the middle) every method gives the tokens it gives without one, alone and in a batch,
    streamed and not; the usage counts are the LCS of the prediction and the output."""
    target, draft, _ = pair
    params = {"temperature": 0.8, "seed": 5} if sampled else {}
    plain = specdecode.generate(target, PROMPT, max_new_tokens=40, **params)
    cut = len(plain.text) // 2
    prediction = plain.text[:cut] + " x = 1\n" + plain.text[cut:]
    for method in ("ar", "prompt-lookup", "draft", "hybrid"):
        out = specdecode.generate(target, PROMPT, method=method, prediction=prediction, max_new_tokens=40,
                                  draft=draft if method in ("draft", "hybrid") else None, **params)
        assert out.token_ids == plain.token_ids, method
        assert out.stats.by_proposer["prediction"]["num_accepted_tokens"] > 0, method
        ids = target.tokenizer.encode(prediction, add_special_tokens=False)
        assert (out.accepted_prediction_tokens, out.rejected_prediction_tokens) == prediction_usage(ids, out.token_ids)
        assert out.rejected_prediction_tokens >= 1
    chunks = list(specdecode.stream(target, PROMPT, prediction=prediction, max_new_tokens=40, **params))
    assert "".join(c.text for c in chunks) == plain.text
    assert chunks[-1].result.accepted_prediction_tokens == out.accepted_prediction_tokens
    both = specdecode.generate(target, [PROMPT, PROMPT + "# next\n"], prediction=prediction,
                               max_new_tokens=40, **params)
    assert both[0].token_ids == plain.token_ids
    assert both[1].token_ids == specdecode.generate(target, PROMPT + "# next\n", max_new_tokens=40, **params).token_ids
    assert specdecode.generate(target, PROMPT, max_new_tokens=8).accepted_prediction_tokens == 0


def test_a_bad_prediction_is_refused(pair):
    target, _, _ = pair
    with pytest.raises(ValueError, match="prediction must be text"):
        specdecode.generate(target, PROMPT, prediction=["a"], max_new_tokens=4)
    with pytest.raises(ValueError, match="the prediction has .* tokens, more than"):
        specdecode.generate(target, PROMPT, prediction="x " * (target.lm.max_context + 10), max_new_tokens=4)


def test_generate_prediction_file_on_the_command_line(pair, tmp_path):
    target, _, dirs = pair
    plain = specdecode.generate(target, PROMPT, max_new_tokens=24)
    (tmp_path / "old.py").write_text(plain.text)
    run = subprocess.run([sys.executable, "-m", "specdecode", "generate", "--target", str(dirs["target"]),
                          "--prompt", PROMPT, "--prediction-file", str(tmp_path / "old.py"),
                          "--max-new-tokens", "24", "--compare", "--json"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["token_ids"] == plain.token_ids and out["identical"] is True
    ids = target.tokenizer.encode(plain.text, add_special_tokens=False)  # (a random model's ids
    # are not always the canonical split of their text)
    assert (out["accepted_prediction_tokens"], out["rejected_prediction_tokens"]) == prediction_usage(ids, plain.token_ids)
    assert out["accepted_prediction_tokens"] > len(ids) // 2
    assert "tokens are in the output" in run.stderr


server = pytest.fixture(scope="module", name="server")(hybrid_server)


def test_prediction_through_the_openai_client(server, pair):
    """``prediction`` on chat completions (and completions): the text of the same request
    without it, streamed and not, n = 2; usage: OpenAI's counts of the prediction, the
    draft tokens in ``usage.speculation``; a malformed or oversized prediction is a 400
    naming the field."""
    import openai

    target, draft, _ = pair
    client = server.client()
    messages = [{"role": "user", "content": "Write add(a, b) in Python."}]
    want = specdecode.generate(target, messages, max_new_tokens=32, method="hybrid", draft=draft)
    prediction = want.text[:20] + "zz" + want.text[20:]
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=32, temperature=0, n=2,
                                         prediction={"type": "content", "content": prediction})
    assert [c.message.content for c in got.choices] == [want.text] * 2
    details = got.usage.completion_tokens_details
    ids = target.tokenizer.encode(prediction, add_special_tokens=False)
    accepted, rejected = prediction_usage(ids, want.token_ids[:-1] if want.finish_reason == "stop" else want.token_ids)
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (2 * accepted, 2 * rejected)
    assert got.usage.model_extra["speculation"]["num_accepted_tokens"] > 0
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=32, temperature=0, stream=True,
        stream_options={"include_usage": True},
        prediction={"type": "content", "content": [{"type": "text", "text": prediction}]})
    events = list(stream)
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == want.text
    assert events[-1].usage.completion_tokens_details.accepted_prediction_tokens == accepted
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0,
                                      extra_body={"prediction": {"type": "content", "content": "    return a + b\n"}})
    assert plain.choices[0].text == specdecode.generate(target, PROMPT, max_new_tokens=16, method="hybrid",
                                                        draft=draft).text
    for bad in ({"type": "text", "content": "x"}, {"type": "content", "content": 3}, "x",
                {"type": "content", "content": "x " * 600}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, prediction=bad)
        assert e.value.body["param"] == "prediction"
    # text that is not UTF-8 (a lone surrogate, as JSON can carry it) is the prediction's fault
    status, _, out = server.post("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", '
                                 b'"content": "x"}], "max_tokens": 3, "prediction": {"type": "content", '
                                 b'"content": "ab\\udc80"}}')
    assert status == 400 and out["error"]["param"] == "prediction" and "U+DC80" in out["error"]["message"]


def test_a_prediction_that_keeps_missing_proposes_less():
    """Where the output keeps leaving the prediction (every fourth token differs), the
    proposals shrink to what pays at the target's T(n): on a steep profile (T(17) = 7 T(1))
    they average a few tokens, against 16 on a flat one; the output is the target's."""
    prompt = [1, 2, 3]
    plain = _plain(prompt, 60)
    noisy = [(t + 1) % V if i % 4 == 3 else t for i, t in enumerate(plain)]
    lengths = {}
    for name, cost in (("flat", [1.0] * 17), ("steep", [1.0 + 0.375 * i for i in range(17)])):
        gen = Engine(MockLM(V, hashed_logits(V, "t", window=2)), PredictionProposer(noisy, verify_cost=cost),
                     16, debug=True).generate(prompt, SamplingParams(max_new_tokens=60)).run()
        assert gen.token_ids == plain
        lengths[name] = gen.stats.num_draft_tokens / gen.stats.num_drafts
    assert lengths["steep"] < 4 < lengths["flat"], lengths

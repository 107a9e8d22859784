"""Structured output (response_format): the output is plain constrained decoding of the
target (checked against a loop written on llguidance's own mask functions), whatever the
method, greedy and seeded sampling, alone, in a batch and streamed; always valid against the
schema; the grammar's forced tokens proposed for free and drafts cut where the grammar
refuses them; the errors."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.hf
import llguidance.torch
import pytest
import torch

import specdecode
from specdecode.config import SamplingParams
from specdecode.engine import GRAMMAR_SOURCE, Engine
from specdecode.grammar import JSON_LAYOUT, Grammar, GrammarError, response_format_grammar
from specdecode.proposers import DraftModelProposer, Proposer, RequestState
from specdecode.proposers.base import DraftOutput
from specdecode.sampling import GumbelNoise
from test_server import hybrid_server
from tiny_dirs import tiny_dirs_in

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "kind": {"enum": ["function", "method", "class"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["name", "kind", "count", "tags"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
PROMPT = "def add(a, b):\n    return a + b\n\n"
N = 60


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    dirs = tiny_dirs_in(tmp_path_factory)
    return specdecode.load(dirs["target"]), specdecode.load(dirs["draft"])


def _reference(target, prompt: list[int], schema: dict, n: int) -> list[int]:
    """Greedy constrained decoding written on llguidance's functions alone: one-token passes,
    the matcher's bitmask applied by llguidance.torch; where the grammar is complete, EOS."""
    lm, eos = target.lm, list(target.eos_token_ids)
    matcher = llguidance.LLMatcher(
        llguidance.hf.from_tokenizer(target.tokenizer, n_vocab=lm.vocab_size, eos_token=eos),
        llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT))
    bitmask = llguidance.torch.allocate_token_bitmask(1, lm.vocab_size)
    lm.allocate(1, len(prompt) + n + 1)
    logits = lm.forward(torch.tensor([prompt]))[0, -1:].float()
    out = []
    while len(out) < n:
        if matcher.is_stopped():
            token = max(eos, key=lambda e: float(logits[0, e]))
        else:
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
        out.append(token)
        if token in eos:
            break
        assert matcher.consume_token(token)
        logits = lm.forward(torch.tensor([[token]]))[0, -1:].float()
    lm.rollback(0)
    return out


METHODS = [("ar", {}), ("prompt-lookup", {}), ("suffix", {}), ("draft", {}),
           ("draft", {"draft_tree_width": 2}), ("hybrid", {})]


@pytest.mark.parametrize("sampled", [False, True])
def test_structured_output_is_plain_constrained_decoding(pair, sampled):
    """Every method gives plain constrained decoding's tokens (greedy: the loop above;
    seeded: plain decoding's with the seed), valid against the schema; the grammar's forced
    tokens are proposed and kept."""
    target, draft = pair
    params = {"temperature": 1.5, "seed": 1} if sampled else {}
    plain = specdecode.generate(target, PROMPT, method="ar", response_format=FORMAT, max_new_tokens=N, **params)
    greedy = _reference(target, plain.prompt_token_ids, SCHEMA, N)
    assert (plain.token_ids == greedy) != sampled  # (this seed samples another valid output)
    assert plain.finish_reason == "stop"
    jsonschema.validate(json.loads(plain.text), SCHEMA)
    assert plain.stats.num_draft_tokens == 0  # plain decoding proposes nothing, not even forced tokens
    for method, options in METHODS:
        out = specdecode.generate(target, PROMPT, method=method, response_format=FORMAT, max_new_tokens=N,
                                  draft=draft if method in ("draft", "hybrid") else None, debug=True,
                                  **options, **params)
        assert out.token_ids == plain.token_ids, (method, options)
        if method != "ar":
            forced = out.stats.by_proposer[GRAMMAR_SOURCE]
            assert forced["num_accepted_tokens"] > 0, (method, forced)
    chunks = list(specdecode.stream(target, PROMPT, method="hybrid", draft=draft, response_format=FORMAT,
                                    max_new_tokens=N, **params))
    assert "".join(c.text for c in chunks) == plain.text
    # in a batch beside a request without a format and one with another
    other = {"type": "json_object"}
    rows = specdecode.generate(target, [PROMPT, PROMPT, "x = 1\n"], method="prompt-lookup",
                               response_format=FORMAT, max_new_tokens=N, **params)
    assert rows[0].token_ids == rows[1].token_ids == plain.token_ids
    assert rows[2].token_ids == specdecode.generate(target, "x = 1\n", response_format=FORMAT,
                                                    max_new_tokens=N, **params).token_ids
    free = specdecode.generate(target, PROMPT, response_format=other, max_new_tokens=N, **params)
    assert free.finish_reason == "length" or isinstance(json.loads(free.text), dict)


def test_a_sampled_draft_is_masked_row_by_row_not_cut(pair):
    """A sampled draft (the rejection rule, with its distributions) keeps its tokens: the
    rows' masks make a token the grammar refuses have probability 0 at its row, so it is
    rejected there; the output is always valid and the acceptance rule runs on the masked
    rows (a seeded rejection-rule request is deterministic)."""
    target, draft = pair
    kw = dict(method="draft", draft=draft, response_format=FORMAT, max_new_tokens=N, temperature=1.0,
              seed=3, acceptance_rule="rejection", num_speculative_tokens=4)
    one = specdecode.generate(target, PROMPT, **kw)
    assert one.token_ids == specdecode.generate(target, PROMPT, **kw).token_ids
    if one.finish_reason == "stop":
        jsonschema.validate(json.loads(one.text), SCHEMA)
    else:  # cut by the token limit: a prefix of valid JSON
        assert Grammar.for_model(target, FORMAT).start().valid_prefix(one.token_ids) == len(one.token_ids)


class _RightThenNewlines(Proposer):
    """Proposes the next two tokens of a known output, then two newlines (which JSON without
    flexible whitespace never allows)."""

    name = "oracle"

    def __init__(self, output: list[int], newline: int, prompt_len: int):
        self.output, self.newline, self.prompt_len = output, newline, prompt_len

    def propose(self, state, k):
        at = len(state.tokens) - self.prompt_len
        return DraftOutput.point_mass(self.output[at:at + 2] + [self.newline] * 2, self.name)


def test_a_point_mass_draft_is_cut_where_the_grammar_refuses_it(pair):
    """Only the grammar-valid prefix of a lookup-like proposal is verified: every token of
    it verified is kept here, and the newlines are never put in a verify pass."""
    target, _ = pair
    grammar = Grammar.for_model(target, FORMAT)
    prompt = target.tokenizer.encode(PROMPT)
    expected = _reference(target, prompt, SCHEMA, N)
    [newline] = target.tokenizer.encode("\n", add_special_tokens=False)
    proposer = _RightThenNewlines(expected, newline, len(prompt))
    gen = Engine(target.lm, proposer, 4, debug=True).generate(
        prompt, SamplingParams(max_new_tokens=N, grammar=grammar), target.eos_token_ids).run()
    assert gen.token_ids == expected
    mine = gen.stats.by_proposer["oracle"]
    assert mine["num_draft_tokens"] == mine["num_accepted_tokens"] > 0


@pytest.mark.parametrize("rule", ["greedy", "rejection", "gumbel", "rejection-top-p"])
def test_a_draft_model_drafts_only_what_the_grammar_allows(pair, rule):
    """The draft's own logits are masked after each of its tokens, before the sampling
    filters (as the target's rows are: a nucleus of refused tokens alone would leave
    nothing to sample): its proposal is valid JSON so far, and a sampled draft's
    distributions are 0 where the grammar refuses."""
    target, draft = pair
    grammar = Grammar.for_model(target, FORMAT)
    params = SamplingParams(max_new_tokens=N, temperature=0.0 if rule == "greedy" else 1.5,
                            acceptance_rule=None if rule == "greedy" else rule.split("-")[0], seed=2,
                            top_p=0.05 if rule.endswith("top-p") else 1.0, grammar=grammar)
    prompt = target.tokenizer.encode(PROMPT)
    proposer = DraftModelProposer(draft.lm.fork())
    for committed in ([], target.tokenizer.encode('{"name": "', add_special_tokens=False)):
        g = grammar.start()
        g.commit(committed)
        tokens = prompt + committed
        state = RequestState(tokens, len(committed), params, target.eos_token_ids,
                             torch.Generator().manual_seed(0), target.lm.vocab_size,
                             GumbelNoise(2, target.lm.vocab_size) if rule == "gumbel" else None, g)
        proposer.reset(state, 256)
        out = proposer.propose(state, 6)
        ids = out.token_ids[0].tolist()
        assert len(ids) == 6 and g.valid_prefix(ids) == 6, ids
        if out.probs is not None:
            allowed = g.allowed([ids[:i] for i in range(6)])
            assert not out.probs[0][~allowed[:, :out.probs.shape[-1]]].any()


def test_a_long_forced_run_is_verified_in_passes_of_at_most_max_forced(pair):
    """A schema's 200-character constant is forced whole; it goes over several verify
    passes of at most MAX_FORCED tokens (longer passes would leave the exact kernels), and
    the output is plain constrained decoding's."""
    from specdecode.engine import MAX_FORCED

    target, _ = pair
    fmt = {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"kind": {"const": "abc " * 50}}, "required": ["kind"],
        "additionalProperties": False}}}
    plain = specdecode.generate(target, PROMPT, method="ar", response_format=fmt, max_new_tokens=200)
    out = specdecode.generate(target, PROMPT, method="prompt-lookup", response_format=fmt, max_new_tokens=200,
                              debug=True)
    assert out.token_ids == plain.token_ids and plain.finish_reason == "stop"
    assert json.loads(out.text) == {"kind": "abc " * 50}
    assert out.stats.by_proposer[GRAMMAR_SOURCE]["num_draft_tokens"] > 2 * MAX_FORCED
    assert max(out.stats.speculation_lengths) == MAX_FORCED


def test_masks_follow_each_rows_path():
    """GrammarState.allowed: row i's mask is the grammar's after drafts[:i] (equal to a
    fresh matcher's after consuming them); a row after a refused token is all True; the
    state is the committed output's afterwards; forced tokens and valid_prefix."""
    from helpers import local_tokenizer

    tok = local_tokenizer()
    v = len(tok) + 5  # logit rows past the tokenizer's
    grammar = Grammar(response_format_grammar(FORMAT), tok, v, (2,))
    state = grammar.start()
    text = tok.encode('{"name": "ab", "kind": "class", "count": 12, "tags": [true]}', add_special_tokens=False)
    assert state.valid_prefix(text) == len(text)
    forced = state.forced(100)
    assert forced and tok.decode(forced).startswith('{"name')
    bad = tok.encode("}", add_special_tokens=False)
    paths = [text[:i] for i in range(len(text) + 1)] + [bad, bad + text[:1]]
    allowed = state.allowed(paths)
    assert allowed.shape == (len(paths), v) and not allowed[:, len(tok):-5].any()
    for i, path in enumerate(paths[:-2]):
        fresh = grammar.start()
        fresh.commit(path)
        assert torch.equal(allowed[i], fresh.allowed([[]])[0]), i
        if i < len(text):
            assert allowed[i, text[i]]
    assert allowed[-1].all() and allowed[-2].all()  # past "}", which the grammar refuses first
    assert allowed[len(text)].nonzero().flatten().tolist() == [2]  # complete: EOS only
    assert state.valid_prefix(bad) == 0 and state.forced(100) == forced  # nothing consumed
    state.commit(text + [2])
    assert state.done and state.forced(5) == []


def test_bad_response_formats_are_refused(pair):
    target, _ = pair
    for fmt, match in (("json", "must be an object with a 'type'"),
                       ({"type": "yaml"}, "response_format.type 'yaml' is not supported; allowed: text"),
                       ({"type": "json_schema", "json_schema": []}, "must be an object with the JSON schema"),
                       ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}},
                        "the schema cannot be compiled: .*nowhere"),
                       ({"type": "json_schema", "json_schema": {"schema": {"type": "integer",
                                                                          "maximum": 2 ** 64}}},
                        "the schema cannot be compiled")):
        with pytest.raises(GrammarError, match=match):
            specdecode.generate(target, PROMPT, response_format=fmt, max_new_tokens=4)
    with pytest.raises(ValueError, match="min_new_tokens=.* 0 with a response format"):
        specdecode.generate(target, PROMPT, response_format=FORMAT, min_new_tokens=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="eos_token_ids=.* at least one EOS id with a response format"):
        specdecode.generate(target, PROMPT, response_format=FORMAT, eos_token_id=[], max_new_tokens=4)
    with pytest.raises(ValueError, match="grammar=.*specdecode.grammar.Grammar"):
        SamplingParams(grammar="{}")
    with pytest.raises(GrammarError, match="needs the target's tokenizer"):
        Grammar(response_format_grammar(FORMAT), None, 10, ())
    # "text" is no constraint
    assert specdecode.generate(target, PROMPT, response_format={"type": "text"}, max_new_tokens=6).token_ids == \
        specdecode.generate(target, PROMPT, max_new_tokens=6).token_ids


server = pytest.fixture(scope="module", name="server")(hybrid_server)


def test_response_format_through_the_openai_client(server, pair):
    """``response_format`` on chat completions (the client's own ``parse`` from a pydantic
    model, a strict json_schema) and completions (json_object): the solo run's text, streamed
    and not, n = 2, parsed by the client; a format that cannot be served is a 400 naming it."""
    from typing import Annotated, Literal

    import openai
    from pydantic import BaseModel, Field

    class Item(BaseModel):
        name: Annotated[str, Field(max_length=6)]
        kind: Literal["function", "method", "class"]
        count: Annotated[int, Field(ge=0, le=999)]
        tags: Annotated[list[bool], Field(max_length=3)]

    target, draft = pair
    client = server.client()
    messages = [{"role": "user", "content": "Describe add(a, b) as JSON."}]
    parsed = client.chat.completions.parse(model="tiny", messages=messages, max_tokens=N, temperature=0,
                                           response_format=Item, n=2)
    schema = openai.lib._pydantic.to_strict_json_schema(Item)
    fmt = {"type": "json_schema", "json_schema": {"name": "Item", "schema": schema, "strict": True}}
    want = specdecode.generate(target, messages, method="hybrid", draft=draft, response_format=fmt,
                               max_new_tokens=N)
    assert want.finish_reason == "stop"
    assert [c.message.content for c in parsed.choices] == [want.text] * 2
    assert parsed.choices[0].message.parsed == Item.model_validate_json(want.text)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=N, temperature=0,
                                            response_format=fmt, stream=True)
    assert "".join(e.choices[0].delta.content or "" for e in stream if e.choices) == want.text
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert got.choices[0].text == specdecode.generate(target, PROMPT, method="hybrid", draft=draft,
                                                      response_format={"type": "json_object"},
                                                      max_new_tokens=N).text
    for bad, param in (({"type": "yaml"}, "response_format"),
                       ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}},
                        "response_format"),
                       ({"type": "json_schema", "json_schema": "x"}, "response_format")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, response_format=bad)
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, response_format=fmt,
                                       extra_body={"min_tokens": 2})
    assert e.value.body["param"] == "min_tokens"


def test_generate_json_schema_on_the_command_line(pair, tmp_path_factory, tmp_path):
    """``generate --json-schema FILE``: the API's output, identical to plain constrained
    decoding (--compare runs plain decoding with the same schema); a file that is no JSON
    schema is refused naming the flag."""
    import subprocess
    import sys

    target, draft = pair
    dirs = tiny_dirs_in(tmp_path_factory)
    (tmp_path / "item.json").write_text(json.dumps(SCHEMA))
    want = specdecode.generate(target, PROMPT, method="draft", draft=draft, response_format=FORMAT,
                               max_new_tokens=N)
    base = [sys.executable, "-m", "specdecode", "generate", "--target", str(dirs["target"]), "--prompt", PROMPT,
            "--max-new-tokens", str(N)]
    run = subprocess.run(base + ["--draft", str(dirs["draft"]), "--method", "draft", "--json-schema",
                                 str(tmp_path / "item.json"), "--compare", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["token_ids"] == want.token_ids and out["identical"] is True
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    for content, match in (("{nope", "is not JSON"), ("[1]", "must hold a JSON schema object, not list"),
                           ('{"$ref": "#/no"}', "the schema cannot be compiled")):
        (tmp_path / "bad.json").write_text(content)
        run = subprocess.run(base + ["--json-schema", str(tmp_path / "bad.json")], capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 2 and match in run.stderr and "Traceback" not in run.stderr, run.stderr

"""Tool calling: the formats' parsers (Hermes/Qwen, Llama 3.1 JSON, Mistral), the stream's
hold-back equal to the whole reply's parse, the checks of tools and tool_choice; through the
server (a tiny model whose chat template lays tools out in Qwen's format): a forced call
("required", a named function) valid against the function's parameters, the same with any
method and streamed as not; "auto" replies the solo run's text; a tool conversation
accepted; the errors."""

from __future__ import annotations

import json
import random
import shutil

import jsonschema
import openai
import pytest

import specdecode
from specdecode.tools import (FORMATS, CallStream, ToolError, check_tool_choice, check_tools, tool_format)
from tiny_dirs import tiny_dirs_in

HERMES, MISTRAL, LLAMA3 = FORMATS
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 8}},
                                          "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
# Qwen2.5's way of laying tools out and of writing calls, in a few lines
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions.\n<tools>{% for t in tools %}\n"
    "{{ t | tojson }}{% endfor %}\n</tools>\nFor each call reply <tool_call>\n"
    "{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_each_format_parses_its_calls():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert HERMES.parse(text) == ("Let me look.", [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                                                   {"name": "add", "arguments": '{"a": 1, "b": 2}'}])
    assert HERMES.parse('<tool_call>\n{"name": "add", "arguments": {"a": 1}}') == \
        (None, [{"name": "add", "arguments": '{"a": 1}'}])  # (cut before its close: still a call)
    for broken in ('<tool_call>\n{"name": "add", "argu', '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
                   "no call here", '<tool_call>\n["add"]\n</tool_call>'):
        assert HERMES.parse(broken) == (broken, []), broken
    assert LLAMA3.parse('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}') == \
        (None, [{"name": "add", "arguments": '{"a": 1, "b": 2}'}])
    assert LLAMA3.parse("It is sunny.") == ("It is sunny.", [])
    for broken in ('<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>',  # no JSON for clients
                   "<tool_call>" + "[" * 100000, '<tool_call>\n{"name": "f", "arguments": "x"}\n</tool_call>'):
        assert HERMES.parse(broken) == (broken, [])
    two = HERMES.parse(text, parallel=False)
    assert two == ("Let me look.", [{"name": "get_weather", "arguments": '{"city": "Paris"}'}])
    for text in ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
                 ' [{"name": "add", "arguments": {"a": 1, "b": 2}}]'):  # (the marker decoded away)
        assert MISTRAL.parse(text) == (None, [{"name": "add", "arguments": '{"a": 1, "b": 2}'}])
    assert MISTRAL.parse("[1, 2] are numbers") == ("[1, 2] are numbers", [])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_a_streamed_reply_holds_back_only_what_may_begin_a_call(fmt):
    """Whatever the pieces, the content streamed (as it comes, then the rest at the end)
    is the whole reply's parsed content, and the calls are the same."""
    call = {"hermes": '\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
            "mistral": ' [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
            "llama3_json": '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}'}[fmt.name]
    rng = random.Random(0)
    for text in ("Sure: <tool the answer is 4.  ", "  plain text < with a bracket\n", call,
                 "Checking. " + call, "x [TOOL" if fmt.name == "mistral" else "x <tool_ca",
                 "[not, json", "{also not"):
        if fmt.name != "hermes" and text.startswith("Checking"):
            continue  # (a Llama or Mistral call is the whole reply)
        content, calls = fmt.parse(text)
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), min(4, len(text) - 1)))
            pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            stream = CallStream(fmt)
            sent = "".join(stream.add(p) for p in pieces)
            rest, made = stream.finish()
            assert sent + rest == (content or ""), (text, pieces)
            assert made == calls


def test_tools_and_tool_choice_are_checked():
    assert check_tools(TOOLS)[1]["function"]["name"] == "add"
    assert check_tools([{"type": "function", "function": {"name": "f"}}])[0]["function"]["parameters"] == \
        {"type": "object", "properties": {}}
    fn = lambda params: [{"type": "function", "function": {"name": "f", "parameters": params}}]  # noqa: E731
    for bad, match in (([], "non-empty list"), ([{"type": "code"}], r"tools\[0\] must be"),
                       ([{"type": "function", "function": {"name": "a b"}}], "letters, digits"),
                       ([TOOLS[0], TOOLS[0]], "given twice"),
                       (fn([]), "a JSON schema of an object"), (fn({"type": "string"}), "of an object"),
                       (fn({"type": "object", "properties": {"x": {"type": "objekt"}}}), "cannot be compiled"),
                       (fn({"type": "object", "properties": {"x": {"$ref": "#/$defs/Y"}}}), "cannot be compiled")):
        with pytest.raises(ToolError, match=match) as e:
            check_tools(bad)
        assert e.value.param == "tools"
    tools = check_tools(TOOLS)
    assert [check_tool_choice(c, tools) for c in (None, "auto", "none", "required")] == \
        ["auto", "auto", "none", "required"]
    assert check_tool_choice({"type": "function", "function": {"name": "add"}}, tools) == "add"
    assert check_tool_choice(None, None) == "none"
    for bad, match in (("any", "allowed: auto, none, required"), ({"type": "function", "function": {"name": "mul"}},
                                                                    "'mul', which is not in 'tools'"),
                       ({"name": "add"}, "must be a string or")):
        with pytest.raises(ToolError, match=match):
            check_tool_choice(bad, tools)
    with pytest.raises(ToolError, match="'required' needs 'tools'"):
        check_tool_choice("required", None)


def test_a_forced_calls_grammar_takes_each_functions_own_schema():
    """Each function's parameters are a JSON root of their own in the grammar: a pydantic
    schema's $defs resolve; the arguments are always an object; the name is the chosen
    function's; several calls with parallel_tool_calls, one without."""
    from helpers import local_tokenizer
    from specdecode.grammar import Grammar

    tok = local_tokenizer()
    nested = {"type": "function", "function": {"name": "where", "parameters": {
        "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}},
        "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
        "additionalProperties": False}}}
    tools = check_tools([nested, {"type": "function", "function": {"name": "ping"}}])
    for parallel in (True, False):
        grammar = Grammar(HERMES.grammar(tools, tok, parallel), tok, len(tok), (2,))
        ok = '<tool_call>\n{"name": "where", "arguments": {"loc": {"city": "Oslo"}}}\n</tool_call>'
        two = ok + '\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
        for text, valid in ((ok, True), (two, parallel), (ok + "\n", True), (two + "\n", parallel),
                            ('<tool_call>\n{"name": "where", "arguments": {"loc": "Oslo"}}\n</tool_call>', False),
                            ('<tool_call>\n{"name": "ping", "arguments": "x"}\n</tool_call>', False),
                            ('<tool_call>\n{"name": "pong", "arguments": {}}\n</tool_call>', False)):
            ids = tok.encode(text, add_special_tokens=False)
            state = grammar.start()
            assert (state.valid_prefix(ids) == len(ids) and state.allowed([ids])[0, 2]) == valid, (text, parallel)


def test_named_chat_templates_are_read_for_their_tool_use_one():
    class Tok:
        chat_template = {"default": "{{ messages }}", "tool_use": "{{ tools }} <tool_call>"}

    assert tool_format(Tok()) is HERMES
    Tok.chat_template = {"default": "{{ messages }}"}
    assert tool_format(Tok()) is None


@pytest.fixture(scope="module")
def tool_dir(tmp_path_factory):
    """The tiny target with a chat template that lays tools out (Qwen's format)."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tool_target") / "target"
    shutil.copytree(tiny_dirs_in(tmp_path_factory)["target"], d)
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def server(tool_dir, tmp_path_factory):
    from test_server import Server

    dirs = tiny_dirs_in(tmp_path_factory)
    served = specdecode.load(tool_dir), specdecode.load(dirs["draft"])
    s = Server(lambda: served, method="hybrid").start()
    yield s
    s.stop()


def _calls(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def test_a_forced_call_is_valid_and_the_same_with_any_method(server, tool_dir):
    client = server.client()
    assert tool_format(specdecode.load(tool_dir).tokenizer) is HERMES
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        got = {}
        for method in ("ar", "prompt-lookup", "hybrid"):
            r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                               max_tokens=120, temperature=0, extra_body={"method": method})
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and c.message.content is None, c
            got[method] = _calls(c.message)
            for name, args in got[method]:
                jsonschema.validate(args, schemas[name])
            assert all(call.id.startswith("call_") and call.type == "function" for call in c.message.tool_calls)
        assert got["ar"] == got["prompt-lookup"] == got["hybrid"] and got["ar"]
        if isinstance(choice, dict):
            assert {name for name, _ in got["ar"]} == {"add"}
        events = list(client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                     tool_choice=choice, max_tokens=120, temperature=0,
                                                     stream=True))
        deltas = [d for e in events if e.choices for d in e.choices[0].delta.tool_calls or ()]
        assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == got["ar"]
        assert [d.index for d in deltas] == list(range(len(deltas)))
        assert [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason] == \
            ["tool_calls"]
        assert not "".join(e.choices[0].delta.content or "" for e in events if e.choices)


def test_auto_replies_the_solo_runs_text_and_a_tool_conversation_is_taken(server, tool_dir):
    """With tool_choice auto the reply is the model's own (this random one writes no call):
    the solo run of the same prompt, the template's tools section included; streamed the
    same. A conversation with an assistant's tool_calls and a tool message is laid out by
    the template."""
    client = server.client()
    target = specdecode.load(tool_dir)
    ids = target.tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    want = specdecode.generate(target, input_ids=list(ids), max_new_tokens=24)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want.text and not r.choices[0].message.tool_calls
    assert r.usage.prompt_tokens == len(ids)
    events = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=24,
                                            temperature=0, stream=True)
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == want.text
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    expect = target.tokenizer.apply_chat_template(
        history[:1] + [dict(history[1], content="", tool_calls=[dict(history[1]["tool_calls"][0], function={
            "name": "get_weather", "arguments": {"city": "Paris"}})])] + history[2:],
        tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r.usage.prompt_tokens == len(expect)
    none = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=6, temperature=0)
    plain = target.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
    assert none.usage.prompt_tokens == len(plain)  # "none": the tools are not laid out


def test_tool_requests_that_cannot_be_served_are_400s(server, tmp_path_factory):
    client = server.client()
    for kwargs, param in ((dict(tools=[{"type": "function"}]), "tools"),
                          (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "mul"}}), "tool_choice"),
                          (dict(tool_choice="required"), "tool_choice"),
                          (dict(tools=TOOLS, logprobs=True), "logprobs"),
                          (dict(tools=TOOLS, tool_choice="required",
                                response_format={"type": "json_object"}), "tool_choice"),
                          (dict(tools=TOOLS, response_format={"type": "json_object"}), "response_format"),
                          (dict(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **kwargs)
        assert e.value.body["param"] == param, (kwargs, e.value.body)
    bad_history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=bad_history, tools=TOOLS, max_tokens=4)
    assert e.value.body["param"] == "messages" and "not JSON" in e.value.body["message"]
    for message in ({"role": "tool", "tool_call_id": 123456789, "content": "x"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "[" * 100000}}]}):
        status, _, out = server.post("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES + [message],
                                                              "tools": TOOLS, "max_tokens": 4})
        assert status == 400 and out["error"]["param"] == "messages", out
    status, _, out = server.post("/v1/chat/completions", b'{"model": "tiny", "max_tokens": ' + b"1" * 5000 + b"}")
    assert status == 400 and "not valid JSON" in out["error"]["message"]
    from test_server import Server, load_pair

    plain = load_pair(tmp_path_factory)  # the tiny target's own template lays out no tools
    s = Server(lambda: plain, method="ar").start()
    try:
        with pytest.raises(openai.BadRequestError) as e:
            s.client().chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=4)
        assert e.value.body["param"] == "tools" and "lays out no tools" in e.value.body["message"]
    finally:
        s.stop()


def test_langchain_binds_tools_and_asks_for_structured_output(server):
    """LangChain's ChatOpenAI against the server: ``bind_tools(..., tool_choice=...)`` gets
    parsed ``tool_calls``; ``with_structured_output`` (json_schema) gets a parsed object."""
    from typing import Literal

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    llm = ChatOpenAI(model="tiny", base_url=server.url + "/v1", api_key="none", temperature=0, max_tokens=120,
                     max_retries=0)
    reply = llm.bind_tools(TOOLS, tool_choice="add").invoke("Add 1 and 2.")
    assert [c["name"] for c in reply.tool_calls] == ["add"] and set(reply.tool_calls[0]["args"]) == {"a", "b"}

    class Weather(BaseModel):
        city: str = Field(max_length=8)
        sky: Literal["sunny", "cloudy", "rain"]

    got = llm.with_structured_output(Weather, method="json_schema").invoke("Weather in Paris?")
    assert isinstance(got, Weather) and got.sky in ("sunny", "cloudy", "rain")

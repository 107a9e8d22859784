"""Tool calling (OpenAI's ``tools`` and ``tool_choice``): the tools laid out by the target's
chat template, the calls read back out of its reply in the format of the template's family,
and ``tool_choice`` "required" or a named function enforced by a grammar
(:mod:`specdecode.grammar`), so that the reply is a call whose arguments follow the
function's JSON schema.

Formats (as each family's chat template asks the model to reply, and as vLLM's parsers of the
same names read it):

- ``hermes`` (Qwen2.5, Qwen3, Hermes; the template mentions ``<tool_call>``): each call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several separated by a
  newline.
- ``llama3_json`` (Llama 3.1-3.3; the template mentions ``<|python_tag|>``): the reply is one
  JSON object ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``.
- ``mistral`` (the template mentions ``[TOOL_CALLS]``): ``[TOOL_CALLS][{"name": ...,
  "arguments": {...}}, ...]``.

A reply's text is decoded without special tokens, so where the marker of a call is one
(Llama's ``<|python_tag|>``, Mistral's ``[TOOL_CALLS]``) the call is the reply's whole text
as JSON, with or without the marker.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .grammar import JSON_LAYOUT, GrammarError, check_schema

TOOL_CHOICES = ("auto", "none", "required")
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class ToolError(ValueError):
    """Tools a request cannot use (a bad shape, a tool_choice naming no tool, a model whose
    chat template lays out no tools); ``param`` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_tools(tools) -> list[dict]:
    """OpenAI's ``tools``: a non-empty list of ``{"type": "function", "function": {"name",
    "description"?, "parameters"?}}``. Returns them with ``parameters`` defaulted to an empty
    object schema. Raises ToolError naming 'tools'."""
    if not isinstance(tools, list) or not tools:
        raise ToolError("'tools' must be a non-empty list of {\"type\": \"function\", \"function\": {...}}", "tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"tools[{i}].function.name {name!r} must be 1-64 letters, digits, '_' or '-'", "tools")
        if name in names:
            raise ToolError(f"tools[{i}].function.name {name!r} is given twice", "tools")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema of an object", "tools")
        params = dict(params, type="object")  # (arguments are an object whatever the schema allows)
        try:
            check_schema(params)
        except GrammarError as e:
            raise ToolError(f"tools[{i}].function.parameters: {e}", "tools") from None
        if "description" in fn and not isinstance(fn["description"], str):
            raise ToolError(f"tools[{i}].function.description must be a string", "tools")
        out.append({"type": "function", "function": dict(fn, parameters=params)})
    return out


def check_tool_choice(choice, tools: list[dict] | None):
    """OpenAI's ``tool_choice``: "auto" (the default with tools), "none", "required" or
    ``{"type": "function", "function": {"name": NAME}}`` naming one of ``tools``. Returns
    "auto" / "none" / "required" or the name. Raises ToolError naming 'tool_choice'."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ToolError(f"'tool_choice' is {choice!r}; allowed: {', '.join(TOOL_CHOICES)} or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        if choice != "none" and not tools:
            raise ToolError(f"'tool_choice' {choice!r} needs 'tools'", "tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ToolError("'tool_choice' must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        "tool_choice")
    known = [t["function"]["name"] for t in tools or ()]
    if name not in known:
        raise ToolError(f"'tool_choice' names function {name!r}, which is not in 'tools' ({', '.join(known) or 'none'})",
                        "tool_choice")
    return name


@dataclass(frozen=True)
class ToolFormat:
    """How one template family writes tool calls (see the module docstring)."""

    name: str
    marker: str  # the template text that identifies the family
    start: str  # the text a call begins with inside a reply ("": a call is the whole reply)
    opens: str = ""  # where a call is the whole reply: the characters such a reply starts with

    def parse(self, text: str, parallel: bool = True) -> tuple[str | None, list[dict]]:
        """The reply's content and its calls ``[{"name", "arguments": JSON text}]`` (the
        first only, without ``parallel``).

        With calls, the content is the text before the first call (trailing whitespace
        removed; None when empty); without any (or where a call is not valid JSON with a
        string name and object arguments, as vLLM's parsers give up), the text as it is."""
        try:
            before, calls = _PARSERS[self.name](text)
            if not calls:
                return text, []
            for c in calls:
                if not isinstance(c, dict) or not isinstance(c.get("name"), str) or \
                        not isinstance(c.get("arguments"), dict):
                    return text, []
            calls = [{"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False,
                                                                 allow_nan=False)} for c in calls]
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return text, []  # (NaN and Infinity are no JSON a client can read)
        return before.rstrip() or None, calls if parallel else calls[:1]

    def grammar(self, tools: list[dict], tokenizer, parallel: bool = True) -> str:
        """A llguidance grammar (lark) whose every sentence is a reply of one call (several
        with ``parallel``, where the format has a way to write them) to one of ``tools``, its
        arguments valid against the function's parameters; special tokens of the format are
        matched as the tokens they are (``<[id]>``)."""
        # each function's arguments are a JSON root of their own (its $refs resolve there)
        lines = ["call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
        for i, t in enumerate(tools):
            head = json.dumps(f'{{"name": {json.dumps(t["function"]["name"])}, "{_ARGUMENTS[self.name]}": ')
            lines.append(f'call_{i}: {head} args_{i} "}}"')
            lines.append(f"args_{i}: %json {json.dumps(dict(t['function']['parameters'], **{'x-guidance': JSON_LAYOUT}))}")
        if self.name == "hermes":
            one = f'{_literal(tokenizer, "<tool_call>")} "\\n" call "\\n" {_literal(tokenizer, "</tool_call>")}'
            lines.append(f"one: {one}")
            # (a model ends its last call with a newline before EOS, as it was trained to)
            lines.insert(0, 'start: one ("\\n" one)* "\\n"?' if parallel else 'start: one "\\n"?')
        elif self.name == "mistral":
            lines.insert(0, f'start: {_literal(tokenizer, "[TOOL_CALLS]")} "[" call '
                            + ('(", " call)* "]"' if parallel else '"]"'))
        else:
            lines.insert(0, "start: call")
        return "\n".join(lines)


def _literal(tokenizer, text: str) -> str:
    """``text`` in a lark grammar: the token itself where the tokenizer has it as one added
    token (what the model emits), else the quoted text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == text:
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def _hermes(text: str):
    i = text.find("<tool_call>")
    if i < 0:
        return text, []
    blocks = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text[i:], re.DOTALL)
    return text[:i], [json.loads(b) for b in blocks]


def _llama3(text: str):
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    call = json.loads(body)
    return "", [{"name": call["name"], "arguments": call.get("parameters", call.get("arguments"))}]


def _mistral(text: str):
    body = text.strip().removeprefix("[TOOL_CALLS]").strip()
    if not body.startswith("["):
        return text, []
    calls = json.loads(body)
    return "", calls if isinstance(calls, list) else [calls]


_PARSERS = {"hermes": _hermes, "llama3_json": _llama3, "mistral": _mistral}
_ARGUMENTS = {"hermes": "arguments", "llama3_json": "parameters", "mistral": "arguments"}
FORMATS = (ToolFormat("hermes", "<tool_call>", "<tool_call>"),
           ToolFormat("mistral", "[TOOL_CALLS]", "", "["),
           ToolFormat("llama3_json", "<|python_tag|>", "", "{<"))


def tool_format(tokenizer) -> ToolFormat | None:
    """The tool-call format of a tokenizer's chat template, or None when the template lays
    out no tools (it never reads ``tools``)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates (transformers): the one for tools
        template = template.get("tool_use") or template.get("default") or ""
    if not isinstance(template, str) or "tools" not in template:
        return None
    return next((f for f in FORMATS if f.marker in template), None)


def call_ids(n: int) -> list[str]:
    """Fresh ids for n tool calls (``call_`` and 24 hex digits, as OpenAI's look)."""
    return [f"call_{uuid.uuid4().hex[:24]}" for _ in range(n)]


class CallStream:
    """A streamed reply's content, held back where it may begin a call: feed each text
    piece to :meth:`add` (returns the content that can go out now), then :meth:`finish`
    (returns ``(content left, calls)``). The content sent equals :meth:`ToolFormat.parse`'s
    whole-text content: text before the first call with trailing whitespace removed, or the
    whole text where there is no call."""

    def __init__(self, fmt: ToolFormat, parallel: bool = True):
        self.fmt, self.parallel, self.text, self.sent = fmt, parallel, "", 0

    def add(self, piece: str) -> str:
        self.text += piece
        if not self.fmt.start:  # a call is the whole reply: a reply that may be one is held whole
            if self.text.lstrip()[:1] in ("", *self.fmt.opens):
                return ""
            end = len(self.text)
        else:
            end = self.text.find(self.fmt.start)
            if end < 0:  # not begun: hold a tail that may be the start of a call's marker
                end = len(self.text)
                for k in range(min(len(self.fmt.start) - 1, end), 0, -1):
                    if self.fmt.start.startswith(self.text[end - k:]):
                        end -= k
                        break
            end = len(self.text[:end].rstrip())  # whitespace before a call is not content
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent += len(out)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        content, calls = self.fmt.parse(self.text, self.parallel)
        whole = content or ""
        return whole[self.sent:] if whole.startswith(self.text[:self.sent]) else "", calls


def check_messages_tools(messages: list[dict]) -> list[dict]:
    """Chat messages of a tool conversation, for the template: an assistant message's
    ``tool_calls`` with their JSON arguments as objects (as chat templates read them), a
    ``tool`` message's ``tool_call_id``. Raises ToolError naming 'messages'."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise ToolError(f"messages[{i}].{key} must be a string", "messages")
        if m.get("tool_calls") is not None:
            calls = m["tool_calls"]
            if m.get("role") != "assistant" or not isinstance(calls, list):
                raise ToolError(f"messages[{i}].tool_calls must be a list, on an assistant message", "messages")
            fixed = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ToolError(f"messages[{i}].tool_calls: each needs a function with a name", "messages")
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except (ValueError, RecursionError):
                    raise ToolError(f"messages[{i}].tool_calls: the arguments of {fn['name']!r} are not JSON",
                                    "messages") from None
                fixed.append(dict(c, function=dict(fn, arguments=args)))
            m["tool_calls"] = fixed
            if m.get("content") is None:
                m["content"] = ""
        out.append(m)
    return out


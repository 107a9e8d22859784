"""The OpenAI wire format: request bodies checked into :class:`Job` settings, errors in
OpenAI's shape, and the response and stream-chunk bodies (the conventions of vLLM, SGLang and
llama.cpp's server; docs/server.md).

Defaults are OpenAI's API defaults, not the model's generation_config: temperature 1,
top_p 1, max_tokens 16 for completions and the rest of the context for chat completions.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

from ..config import MAX_LOGPROBS, MAX_TEMPERATURE, MIN_TEMPERATURE
from ..methods import METHODS, SpeculativeConfig
from ..tools import ToolError, call_ids, check_messages_tools, check_tool_choice, check_tools

MAX_N = 8  # choices per request
ROLES = ("system", "user", "assistant", "tool")
# OpenAI fields this server does not implement: refused with 501, naming the field, rather
# than silently ignored (a client would get something other than what it asked for)
NOT_IMPLEMENTED = ("echo", "best_of", "logit_bias", "functions", "function_call",
                   "audio", "modalities", "reasoning_effort")
COMMON_FIELDS = ("model", "stream", "stream_options", "max_tokens", "stop", "temperature",
                 "top_p", "seed", "n", "user", "presence_penalty", "frequency_penalty", "logprobs",
                 # through the official client's extra_body
                 "top_k", "repetition_penalty", "min_tokens", "acceptance_rule", "method",
                 "num_speculative_tokens", "return_token_sources", "prediction", "response_format")
FIELDS = {"completions": COMMON_FIELDS + ("prompt", "suffix"),
          "chat": COMMON_FIELDS + ("messages", "max_completion_tokens", "top_logprobs", "tools",
                                   "tool_choice", "parallel_tool_calls")}


class OpenAIError(Exception):
    """An error answered in OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.

    status: HTTP status (400 bad input, 401 key, 404 model, 429 queue full, 501 not
    implemented, 503 not ready); headers: extra response headers (Retry-After)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


@dataclass
class Job:
    """One request, checked: what the worker runs and the responses need.

    prompts: one entry per prompt (token ids); choices run n per prompt. sampling: the
    keyword arguments of :func:`specdecode.api.stream` (max_new_tokens, temperature, ...);
    seed: choice i of a prompt samples with seed + i.
    """

    kind: str  # "completions" or "chat"
    model: str
    prompts: list[list[int]]
    n: int
    stream: bool
    include_usage: bool
    sampling: dict
    method: str | SpeculativeConfig  # the method's name; the app makes it the config served (app.served_method)
    num_speculative_tokens: int | None
    seed: int | None
    logprobs: int | None = None  # alternatives per token (0: the token's own only); None: off
    token_sources: bool = False  # each chunk names who supplied its tokens (the page at /)
    eos_token_ids: tuple[int, ...] | None = None  # None: the target's (FIM: also its FIM stops)
    prediction: str | None = None  # a predicted output's text (OpenAI's Predicted Outputs)
    response_format: object | None = None  # OpenAI's structured output, or a Grammar (a required tool call)
    tool_format: object | None = None  # a ToolFormat: the replies are read for tool calls
    parallel_tool_calls: bool = True  # False: a reply's first call only
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def parse_body(raw: bytes, kind: str) -> dict:
    """The JSON object of a request body whose fields are all ``kind``'s (completions,
    chat); OpenAIError 400 for anything else, 501 for an OpenAI field not implemented."""
    body = json_object(raw)
    for name in body:
        if name in NOT_IMPLEMENTED:
            value = body[name]
            if value is None or value is False or (name == "best_of" and value == 1 and value is not True):
                continue  # the default value: nothing asked
            raise OpenAIError(501, f"'{name}' is not supported by this server", param=name,
                              code="unsupported_parameter")
        if name not in FIELDS[kind]:
            raise bad(f"unrecognized request argument: '{name}'", param=name)
    return body


def json_object(raw: bytes) -> dict:
    """The JSON object of a request body; OpenAIError 400 for anything else."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:  # (also an integer of over 4,300 digits)
        raise bad(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # the decoder's own limit, not a fault of the server
        raise bad("the request body nests JSON arrays or objects too deeply") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    kind = int if integer else (int, float)
    # an int too large for a float is finite but has no float: checked by range, not isfinite
    if isinstance(value, bool) or not isinstance(value, kind) or \
            (isinstance(value, float) and not math.isfinite(value)):
        raise bad(f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    if not lo <= value <= hi:
        shown = value if len(repr(value)) <= 40 else f"{repr(value)[:20]}... ({len(repr(value))} digits)"
        raise bad(f"'{name}' is {shown}; allowed: {lo}..{hi}", name)
    return value


def _text_of(content, i: int) -> str:
    """A chat message's content: a string, or text parts [{"type": "text", "text": ...}]."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        for p in content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise OpenAIError(501, f"messages[{i}].content: only text parts are supported, got "
                                       f"type {p.get('type')!r}", param="messages")
        return "".join(p["text"] for p in content)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _prediction(value) -> str | None:
    """OpenAI's Predicted Outputs field: ``{"type": "content", "content": text or text
    parts}``; its text, None when absent. Raises OpenAIError 400 naming 'prediction'."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "content" or set(value) - {"type", "content"}:
        raise bad("'prediction' must be {\"type\": \"content\", \"content\": text or text parts}, got "
                  f"{json.dumps(value)[:80]}", "prediction")
    content = value.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad("'prediction.content' must be a string or a list of text parts "
              "[{\"type\": \"text\", \"text\": ...}]", "prediction")


def check_request(body: dict, kind: str, ctx) -> Job:
    """A :class:`Job` from a parsed body, or OpenAIError naming the bad value.

    ctx: what the checks need from the server (``model_name``, ``methods`` it can run,
    ``unavailable`` (method -> why it cannot run here), ``default_method``, ``max_context``,
    ``encode(text)``, ``apply_chat(messages)``).
    """
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("'model' is required: a string (GET /v1/models lists them)", "model")
    if model != ctx.model_name:
        raise OpenAIError(404, f"the model '{model}' does not exist; this server serves "
                               f"'{ctx.model_name}'", param="model", code="model_not_found")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad(f"'stream' must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad(f"'stream_options' must be {{\"include_usage\": bool}}, got {options!r}",
                      "stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad("'stream_options.include_usage' must be true or false", "stream_options")

    fim_suffix = body.get("suffix")  # fill in the middle: the text after the gap
    tool_format = laid_out = tools = None  # (chat with tools: the template family's format)
    choice, parallel = "none", True
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("'messages' is required: a non-empty list of {role, content}", "messages")
        chat = []
        for i, m in enumerate(messages):
            calls = isinstance(m, dict) and m.get("tool_calls") is not None
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or ("content" not in m and not calls):
                raise bad(f"messages[{i}] must be an object with a string 'role' and a 'content'",
                          "messages")
            if m["role"] not in ROLES:
                raise bad(f"messages[{i}].role is {m['role']!r}; allowed: {', '.join(ROLES)}", "messages")
            message = {"role": m["role"], "content": "" if calls and m.get("content") is None
                       else _text_of(m["content"], i)}
            message.update({k: m[k] for k in ("tool_calls", "tool_call_id", "name") if m.get(k) is not None})
            chat.append(message)
        tools = body.get("tools")
        try:
            tools = None if tools is None else check_tools(tools)
            choice = check_tool_choice(body.get("tool_choice"), tools)
            chat = check_messages_tools(chat)
        except ToolError as e:
            raise bad(str(e), e.param) from None
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise bad(f"'parallel_tool_calls' must be true or false, got {parallel!r}", "parallel_tool_calls")
        if tools is not None and choice != "none":
            tool_format = ctx.tool_format()
            laid_out = tools
        prompts = [ctx.apply_chat(chat, laid_out)]
    elif fim_suffix is not None:
        prompt = body.get("prompt")
        if not isinstance(fim_suffix, str):
            raise bad(f"'suffix' must be a string (the text after the gap), got "
                      f"{json.dumps(fim_suffix)[:80]}", "suffix")
        if not isinstance(prompt, str):
            raise bad("with 'suffix' (fill in the middle) 'prompt' must be one string: the text "
                      "before the gap", "prompt")
        prompts = [ctx.infill(prompt, fim_suffix)]
    else:
        prompts = _prompts(body.get("prompt", None), ctx)

    n = _number(body, "n", 1, 1, MAX_N, integer=True)
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0:
            raise OpenAIError(501, f"'{name}' is not supported by this server (use "
                                   "'repetition_penalty' in extra_body)", param=name,
                              code="unsupported_parameter")
    room = ctx.max_context - max(len(p) for p in prompts)
    cap_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    default_cap = 16 if kind == "completions" else max(room, 1)
    if room < 1:
        raise bad(f"the prompt has {ctx.max_context - room} tokens: no room is left in the "
                  f"server's {ctx.max_context} positions a request", "messages" if kind == "chat" else "prompt")
    cap = _number(body, cap_name, default_cap, 1, (1 << 31) - 1, integer=True)
    if cap > room:
        raise bad(f"the prompt ({ctx.max_context - room} tokens) plus {cap_name}={cap} is more "
                  f"than the server's {ctx.max_context} positions a request (at most {room} "
                  "new tokens for this prompt)", cap_name)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    if 0 < temperature < MIN_TEMPERATURE or temperature > MAX_TEMPERATURE:
        raise bad(f"'temperature' is {temperature!r}; allowed: 0 or {MIN_TEMPERATURE}..2", "temperature")
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise bad("'stop' must be a non-empty string or a list of them", "stop")
    method = method_of(body, ctx)
    k = body.get("num_speculative_tokens")
    if k is not None and not (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 64):
        raise bad(f"'num_speculative_tokens' must be an integer 1..64, got {k!r}", "num_speculative_tokens")
    rule = body.get("acceptance_rule")
    if rule not in (None, "gumbel", "rejection"):
        raise bad(f"'acceptance_rule' is {rule!r}; allowed: gumbel, rejection", "acceptance_rule")
    sampling = dict(
        max_new_tokens=cap,
        min_new_tokens=_number(body, "min_tokens", 0, 0, cap, integer=True),
        temperature=temperature,
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=_number(body, "top_k", 0, -1, 1 << 31, integer=True),  # -1: off, as vLLM
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 1e-9, 1e9),
        stop=stop, acceptance_rule=rule)
    prediction = _prediction(body.get("prediction"))
    if prediction is not None:
        try:
            prediction.encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad(f"'prediction' is not valid UTF-8 text: character {e.start} is "
                      f"U+{ord(prediction[e.start]):04X}, a lone surrogate", "prediction") from None
        predicted = len(ctx.encode(prediction))
        if predicted > room:
            raise bad(f"the prediction has {predicted} tokens, more than the {room} the server's "
                      f"{ctx.max_context} positions leave after the prompt", "prediction")
    response_format = body.get("response_format")
    if response_format is not None:
        ctx.check_response_format(response_format)
    if choice not in ("auto", "none"):  # a call is forced: its grammar
        if response_format is not None:
            raise bad("give 'response_format' or a 'tool_choice' that forces a call, not both", "tool_choice")
    if response_format is not None and tool_format is not None:
        raise bad("'response_format' with 'tools' would make a call impossible (the reply must be the "
                  "format's JSON): give one of them, or tool_choice 'none'", "response_format")
    if choice not in ("auto", "none"):
        chosen = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice]
        response_format = ctx.tool_grammar(tool_format, chosen, parallel)
    if response_format is not None and sampling["min_new_tokens"]:
        raise bad("'min_tokens' cannot be given with 'response_format' or a forced tool call: the "
                  "grammar decides where the output ends", "min_tokens")
    # choice i samples with seed + i: every one of them must be a valid seed
    seed = _number(body, "seed", None, -(1 << 63), (1 << 63) - n, integer=True)
    sources = body.get("return_token_sources", False)
    if not isinstance(sources, bool):
        raise bad(f"'return_token_sources' must be true or false, got {sources!r}", "return_token_sources")
    eos = ctx.fim_eos() if kind == "completions" and fim_suffix is not None else None
    logprobs = _logprobs(body, kind)
    if tool_format is not None and (logprobs is not None or sources):
        raise bad("'logprobs' and 'return_token_sources' are not supported with 'tools' (a reply's "
                  "text is held back where it may begin a call)", "logprobs" if logprobs is not None
                  else "return_token_sources")
    return Job(kind, model, prompts, n, stream, include_usage, sampling, method, k, seed,
               logprobs, sources, eos, prediction, response_format, tool_format, parallel)


def method_of(body: dict, ctx) -> str:
    """The request's ``method`` (default: the server's), or OpenAIError 400 naming what this
    server runs and why the asked one is not among them."""
    method = body.get("method", ctx.default_method)
    if method not in ctx.methods:
        why = ctx.unavailable.get(method) if isinstance(method, str) else None
        hint = (" (the methods with a draft model need one loaded: start the server with --draft "
                "NAME or --method draft|hybrid)" if isinstance(method, str) and method in METHODS and METHODS[method].needs_draft_model
                else f" ({method} cannot run here: {why})" if why
                else " (a request names a method only; its options are the server's: start it with "
                     "--method NAME:KEY=VALUE)" if isinstance(method, str) and ":" in method else "")
        raise bad(f"'method' is {method!r}; this server runs {', '.join(ctx.methods)}{hint}", "method")
    return method


def _logprobs(body: dict, kind: str) -> int | None:
    """Alternatives per token asked for: completions' ``logprobs: N``; chat's ``logprobs:
    true`` with ``top_logprobs: N`` (0 by default). None when not asked."""
    if kind == "completions":
        return _number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True)
    asked = body.get("logprobs", False)
    if asked is None:
        asked = False
    if not isinstance(asked, bool):
        raise bad(f"'logprobs' must be true or false, got {asked!r}", "logprobs")
    top = _number(body, "top_logprobs", None, 0, MAX_LOGPROBS, integer=True)
    if top is not None and not asked:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if asked else None


def _prompts(prompt, ctx) -> list[list[int]]:
    """'prompt': a string, a list of strings, token ids, or a list of token-id lists."""
    if prompt is None:
        raise bad("'prompt' is required: a string, a list of strings or token ids", "prompt")
    is_ids = lambda p: isinstance(p, list) and p and all(  # noqa: E731
        isinstance(t, int) and not isinstance(t, bool) for t in p)
    if isinstance(prompt, str):
        items = [prompt]
    elif is_ids(prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        items = prompt
    else:
        raise bad("'prompt' must be a string, a list of strings, token ids or a list of "
                  f"token-id lists, got {json.dumps(prompt)[:80]}", "prompt")
    if len(items) > MAX_N:
        raise bad(f"'prompt' holds {len(items)} prompts; at most {MAX_N}", "prompt")
    out = []
    for p in items:
        ids = ctx.encode(p) if isinstance(p, str) else p
        if not ids:
            raise bad("a prompt is empty", "prompt")
        bad_ids = [t for t in ids if not 0 <= t < ctx.vocab_size]
        if bad_ids:
            raise bad(f"token id {bad_ids[0]} is out of range (the vocabulary has "
                      f"{ctx.vocab_size} ids)", "prompt")
        out.append(ids)
    return out


def usage(job: Job, results: list) -> dict:
    """OpenAI's usage. ``completion_tokens_details``: the prediction's tokens that appear in
    the output in order and the rest (OpenAI's Predicted Outputs; 0 without a prediction);
    ``speculation`` (this server's own field): draft tokens proposed and accepted by the
    target. results: one (completion_tokens, stats, (accepted, rejected) prediction tokens)
    per choice."""
    prompt_tokens = sum(len(p) for p in job.prompts)  # once per prompt, whatever n
    completion = sum(r[0] for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "completion_tokens_details": {"accepted_prediction_tokens": sum(r[2][0] for r in results),
                                          "rejected_prediction_tokens": sum(r[2][1] for r in results)},
            "speculation": {"num_draft_tokens": sum(r[1].num_draft_tokens for r in results),
                            "num_accepted_tokens": sum(r[1].num_accepted_tokens for r in results)}}


def chunk(job: Job, choices: list[dict], usage_: dict | None = None) -> dict:
    """One stream event's body (every chunk of a response has the job's id)."""
    obj = "text_completion" if job.kind == "completions" else "chat.completion.chunk"
    prefix = "cmpl-" if job.kind == "completions" else "chatcmpl-"
    return {"id": prefix + job.id, "object": obj, "created": job.created, "model": job.model,
            "choices": choices, "usage": usage_}


@dataclass
class Token:
    """One generated token as the responses show it: its own ``text``, who supplied it
    (``kind``, ``proposer``: :class:`~specdecode.engine.TokenInfo`), ``logprob`` and ``top``
    [(text, logprob)] when asked for, and ``offset``, where its text starts in the choice's
    text (characters)."""

    text: str
    kind: str
    proposer: str
    logprob: float | None
    top: list[tuple[str, float]] | None
    offset: int


def logprobs_body(job: Job, tokens: list[Token]) -> dict | None:
    """OpenAI's logprobs object for these tokens: completions' {tokens, token_logprobs,
    top_logprobs, text_offset}, chat's {content: [{token, logprob, bytes, top_logprobs}]};
    None when the job did not ask."""
    if job.logprobs is None:
        return None
    if job.kind == "completions":
        return {"tokens": [t.text for t in tokens],
                "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [dict(t.top) for t in tokens] if job.logprobs else None,
                "text_offset": [t.offset for t in tokens]}
    entry = lambda text, lp: {"token": text, "logprob": lp, "bytes": list(text.encode())}  # noqa: E731
    return {"content": [dict(entry(t.text, t.logprob), top_logprobs=[entry(a, b) for a, b in t.top])
                        for t in tokens], "refusal": None}


def _extras(job: Job, choice: dict, tokens: list[Token], spans: list[tuple[str, str, str]],
            speculation: dict | None, whole: bool) -> dict:
    """The logprobs (of a stream chunk: only where it carries tokens; of a whole response:
    always), and with ``return_token_sources`` (a specdecode extension) the text's
    ``token_sources`` [{text, kind, proposer}] and the choice's speculation counters so far."""
    if whole or tokens:
        choice["logprobs"] = logprobs_body(job, tokens)
    if job.token_sources:
        choice["token_sources"] = [{"text": t, "kind": k, "proposer": p} for t, k, p in spans]
        if speculation is not None:
            choice["speculation"] = speculation
    return choice


def stream_choice(job: Job, index: int, text: str | None, finish: str | None,
                  role: bool = False, tokens: list[Token] = (), spans=(), speculation=None) -> dict:
    if job.kind == "completions":
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
    else:
        delta = {"role": "assistant"} if role else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return choice if role else _extras(job, choice, list(tokens), list(spans), speculation, False)


def tool_calls(calls: list[dict], stream: bool = False) -> list[dict]:
    """OpenAI's ``tool_calls`` of parsed calls ``[{"name", "arguments"}]`` (in a stream's
    delta each also has its ``index``)."""
    out = [{"id": i, "type": "function", "function": dict(c)} for i, c in zip(call_ids(len(calls)), calls)]
    return [dict(c, index=n) for n, c in enumerate(out)] if stream else out


def tool_finish(finish: str) -> str:
    """A reply that made calls ends with ``tool_calls`` (one cut by the length stays ``length``)."""
    return "tool_calls" if finish == "stop" else finish


def response(job: Job, texts: list[str], finishes: list[str], usage_: dict,
             tokens: list[list[Token]], spans: list[list], speculation: list) -> dict:
    """The non-streamed body (tokens, spans, speculation: per choice)."""
    if job.kind == "completions":
        choices = [_extras(job, {"index": i, "text": t, "logprobs": None, "finish_reason": f},
                           tokens[i], spans[i], speculation[i], True)
                   for i, (t, f) in enumerate(zip(texts, finishes))]
        return {"id": "cmpl-" + job.id, "object": "text_completion", "created": job.created,
                "model": job.model, "choices": choices, "usage": usage_}
    choices = []
    for i, (t, f) in enumerate(zip(texts, finishes)):
        message, calls = {"role": "assistant", "content": t}, []
        if job.tool_format is not None:
            message["content"], calls = job.tool_format.parse(t, job.parallel_tool_calls)
        if calls:
            message["tool_calls"] = tool_calls(calls)
            f = tool_finish(f)
        choices.append(_extras(job, {"index": i, "message": message, "logprobs": None, "finish_reason": f},
                               tokens[i], spans[i], speculation[i], True))
    return {"id": "chatcmpl-" + job.id, "object": "chat.completion", "created": job.created,
            "model": job.model, "choices": choices, "usage": usage_}

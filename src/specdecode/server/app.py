"""The OpenAI-compatible HTTP server (FastAPI): ``POST /v1/completions``,
``POST /v1/chat/completions`` (streamed as server-sent events or not), ``GET /v1/models``,
``GET /health`` (503 until the models are loaded), ``GET /metrics`` (Prometheus) and, at
``GET /``, a page that streams a prompt's answer with each token shaded by who supplied it.

The HTTP layer is thin: :mod:`.protocol` checks requests and shapes bodies, a
:class:`~.worker.Worker` generates. Every error is OpenAI's body with the status a client
expects (400 bad input, never FastAPI's 422; 401, 404, 429 and 503 with Retry-After, 501 for
a field not implemented; a 500 carries ``x-should-retry: false``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import queue
import threading
import time
from dataclasses import replace
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import api, fim
from ..grammar import Grammar, GrammarError
from ..tools import CallStream, ToolFormat, tool_format
from ..methods import Method, SpeculativeConfig, cannot_run, head_dir_for, read_files, speculative_config
from . import infill, protocol
from .protocol import OpenAIError, bad
from .worker import Ticket, Worker

# the page at /: one static file (HTML, CSS and JS, no build step)
PAGE = Path(__file__).with_name("page.html")
# seconds between checks that the client of a non-streamed request is still there (a stream
# learns it at its next write)
DISCONNECT_POLL_S = 0.1


def _has_head(spec: SpeculativeConfig, target: str) -> bool:
    """Whether ``spec``'s method has the head it reads (its head=DIR, else the target's
    default one; True for the methods without a head)."""
    try:
        head_dir_for(spec, target)
    except ValueError:
        return False
    return True


def served_method(served: SpeculativeConfig, name: str) -> SpeculativeConfig:
    """The method a request naming the method ``name`` runs on a server started with
    --method ``served`` (with its options, e.g. "medusa:head=DIR", parsed once):
    ``served`` when the names agree (its options), else ``name`` with its defaults."""
    return served if served.method.value == name else speculative_config(name, False)


class _Context:
    """What :func:`protocol.check_request` needs from the loaded models."""

    def __init__(self, worker: Worker, model_name: str, served: SpeculativeConfig):
        tgt = worker.target
        self.model_name, self.served = model_name, served
        self.default_method = served.method.value
        # what a request may name: the methods whose models, heads and profiles are here
        specs = {m.value: served_method(served, m.value) for m in Method}
        self.unavailable = {m: why for m, spec in specs.items() if (why := cannot_run(spec, tgt)) is not None}
        self.methods = [m.value for m in Method if (not m.needs_draft_model or worker.draft is not None)
                        and _has_head(specs[m.value], tgt.name) and m.value not in self.unavailable]
        self.max_context, self.vocab_size = worker.context, tgt.lm.vocab_size
        self._target = tgt

    def _ids(self, prompt, chat: bool) -> list[int]:
        try:
            return api._prompt_ids(self._target, prompt, None, chat)
        except ValueError as e:
            raise bad(str(e), "messages" if chat else "prompt") from None

    def encode(self, text: str) -> list[int]:
        return self._ids(text, False)

    def apply_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The chat prompt's ids; ``tools`` laid out by the template (its tool section)."""
        try:
            return api._prompt_ids(self._target, messages, None, True, tools)
        except ValueError as e:
            raise bad(str(e), "messages") from None

    def tool_format(self) -> ToolFormat:
        """The target's tool-call format, or a 400 naming 'tools' for a chat template that
        lays out no tools."""
        fmt = tool_format(self._target.tokenizer)
        if fmt is None:
            raise bad(f"the chat template of {self.model_name!r} lays out no tools (no tool-calling "
                      "format known for it: Qwen/Hermes <tool_call>, Llama 3.1 JSON, Mistral "
                      "[TOOL_CALLS]); leave 'tools' out", "tools")
        return fmt

    def tool_grammar(self, fmt: ToolFormat, tools: list[dict], parallel: bool) -> Grammar:
        """The grammar of a forced call to one of ``tools``; a 400 naming 'tools' for
        parameters the grammar library cannot compile."""
        tgt = self._target
        try:
            return Grammar(fmt.grammar(tools, tgt.tokenizer, parallel), tgt.tokenizer, tgt.lm.vocab_size,
                           tgt.eos_token_ids, field="tools")
        except GrammarError as e:
            raise bad(str(e), "tools") from None

    def infill(self, prefix: str, suffix: str, prompt: str = "", extra=(), n_predict: int = 0,
               fields=("prompt", "suffix"), repo: bool = False) -> list[int]:
        """A fill-in-the-middle prompt's ids (:func:`specdecode.fim.infill_ids`); a 400 naming
        ``fields`` (the request's names of prefix and suffix) for a model without FIM tokens
        or text that is not UTF-8."""
        chunks = [(v, "input_extra") for c in (extra if isinstance(extra, (list, tuple)) else ())
                  if isinstance(c, dict) for v in c.values() if isinstance(v, str)]
        for text, name in ((prefix, fields[0]), (suffix, fields[1]), (prompt, "prompt"), *chunks):
            try:
                api._check_utf8(text, f"'{name}'")
            except ValueError as e:
                raise bad(str(e), name) from None
        try:
            return fim.infill_ids(self._target, prefix, suffix, prompt=prompt, extra=extra,
                                  n_ctx=self.max_context, n_predict=n_predict, repo=repo)
        except fim.FIMError as e:
            raise bad(str(e), "input_extra" if str(e).startswith("input_extra") else fields[1]) from None

    def check_response_format(self, response_format) -> None:
        """A 400 naming 'response_format' for one that cannot be served (a bad shape, a
        schema the grammar library cannot compile; :class:`specdecode.grammar.Grammar`)."""
        try:
            Grammar.for_model(self._target, response_format)
        except GrammarError as e:
            raise bad(str(e), "response_format") from None

    def fim_eos(self) -> tuple[int, ...]:
        """A middle's end tokens: the target's EOS and its FIM stops."""
        return tuple(self._target.eos_token_ids) + fim.require_fim(self._target).stops


# the library's names of request fields (its ValueErrors begin "name=value is invalid") -> OpenAI's
_LIBRARY_FIELDS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def _param_of(message: str) -> str | None:
    """The request field a library ValueError names (OpenAI's ``param``), or None."""
    name = message.split("=", 1)[0]
    return _LIBRARY_FIELDS.get(name, name) if name.isidentifier() else None


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


BODY_BYTES_PER_POSITION = 64  # a token's text as JSON, with room for \uXXXX escapes and fields


def default_max_body_bytes(max_len: int, max_batch: int) -> int:
    """The default limit on a request body (bytes): room for ``max_batch`` prompts of
    ``max_len`` positions at BODY_BYTES_PER_POSITION each, plus 1 MiB."""
    return max_len * max_batch * BODY_BYTES_PER_POSITION + (1 << 20)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, or OpenAIError 413 as soon as it is known to exceed ``limit`` bytes:
    from Content-Length before anything is read, else while it streams in."""
    def too_large(size: str) -> OpenAIError:
        return OpenAIError(413, f"the request body is {size} bytes; this server takes at most {limit} "
                                "(serve --max-body-bytes)", code="request_too_large")

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"more than {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(worker: Worker, model_name: str, default_method: str | SpeculativeConfig,
               api_key: str | None = None, max_body_bytes: int | None = None) -> FastAPI:
    """The app over a worker (started by the caller). ``model_name``: the id clients send
    as ``model``; ``default_method``: the method of requests that name none, with the options
    that requests naming it run with (``"medusa:head=DIR"`` or its parsed config:
    :func:`served_method`; its files are read here, once: a choices= tree or profile= edited
    later does not change what is served); ``api_key``: required as ``Authorization: Bearer
    KEY`` on /v1/* when set; ``max_body_bytes``: the largest request body, 413 beyond it
    (default :func:`default_max_body_bytes` of the worker's sizes). Request bodies are parsed,
    tokenized and checked off the event loop, so /health, /metrics and other requests are
    answered meanwhile. Raises ValueError for a bad method or an unreadable file."""
    limit = max_body_bytes if max_body_bytes is not None else default_max_body_bytes(worker.max_len,
                                                                                     worker.max_batch)
    if limit < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {limit}")
    served = read_files(speculative_config(default_method, False))
    app = FastAPI(title="specdecode", docs_url=None, redoc_url=None, openapi_url=None)
    contexts: list[_Context] = []

    def context() -> _Context:
        if not worker.ready.is_set():
            why = f"the models failed to load: {worker.error}" if worker.error else \
                "the models are still loading"
            raise OpenAIError(503, why, type="server_error", code="not_ready",
                              headers={} if worker.error else {"Retry-After": "5"})
        if not contexts:
            contexts.append(_Context(worker, model_name, served))
        return contexts[0]

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise OpenAIError(401, "Incorrect API key provided: send 'Authorization: Bearer "
                                   "KEY' with the server's --api-key", code="invalid_api_key")

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return JSONResponse(bad(f"invalid request: {e.errors()[:1]}").body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        err = OpenAIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                          code="not_found" if e.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        err = OpenAIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
        return JSONResponse(err.body(), status_code=500, headers={"x-should-retry": "false"})

    @app.get("/health")
    async def health():
        if worker.ready.is_set():
            return {"status": "ok"}
        return JSONResponse(OpenAIError(503, worker.error or "the models are still loading",
                                        type="server_error").body(), status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(worker.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return PAGE.read_text(encoding="utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        card = {"id": model_name, "object": "model", "created": int(time.time()),
                "owned_by": "specdecode"}
        if worker.ready.is_set():  # as vLLM's max_model_len; the methods for the page at /
            ctx = context()
            card.update(max_model_len=ctx.max_context, methods=ctx.methods,
                        default_method=ctx.default_method)
        return {"object": "list", "data": [card]}

    async def generate(request: Request, kind: str):
        check_key(request)
        ctx = context()
        raw = await _read_body(request, limit)
        # parsing and tokenizing a large body takes seconds: in a thread, not on the event loop
        job = await asyncio.to_thread(lambda: protocol.check_request(protocol.parse_body(raw, kind), kind, ctx))
        ticket = submit(job, ctx)
        if job.stream:
            return StreamingResponse(_events(ticket), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        total = len(job.prompts) * job.n
        texts, finishes, results = [""] * total, [None] * total, [None] * total
        tokens, spans, speculation = [[] for _ in range(total)], [[] for _ in range(total)], [None] * total
        async for piece in _pieces(request, ticket):
            if piece.kind == "text":
                texts[piece.index] += piece.text
                tokens[piece.index] += piece.tokens
                spans[piece.index] += piece.spans
                speculation[piece.index] = piece.speculation or speculation[piece.index]
            else:
                finishes[piece.index] = piece.finish
                results[piece.index] = (piece.completion_tokens, piece.stats, piece.prediction)
        if None in finishes:  # the client left: nobody reads it
            return Response(status_code=499)
        return protocol.response(job, texts, finishes, protocol.usage(job, results), tokens,
                                 spans, speculation)

    def submit(job: protocol.Job, ctx: _Context) -> Ticket:
        """Queue a checked job with the method's served options; OpenAIError 400 for what
        the library refuses, 429 when the queue is full."""
        job.method = served_method(ctx.served, job.method)  # with the options the server was started with
        try:  # the library's own checks, before anything is queued
            params = api._sampling_params(**job.sampling, do_sample=None, seed=job.seed, eos_token_id=None)
            speculative_config(job.method, job.method.method.needs_draft_model, job.num_speculative_tokens)
        except ValueError as e:
            raise bad(str(e), _param_of(str(e))) from None
        if job.method.lossy_typical is not None and params.greedy:
            # typical acceptance is for sampled requests; at temperature 0 it is greedy
            # verification, which the server's greedy requests get (the library refuses it)
            job.method = replace(job.method, lossy_typical=None)
        ticket = Ticket(job, asyncio.get_running_loop(), asyncio.Queue())
        try:
            worker.submit(ticket)
        except queue.Full:
            raise OpenAIError(429, f"the queue is full ({worker.waiting} requests waiting); "
                                   "retry later", type="rate_limit_error",
                              code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        return ticket

    async def _pieces(request: Request, ticket: Ticket):
        """A non-streamed request's pieces until every choice is done; ends early when its
        client leaves (seen by asking every DISCONNECT_POLL_S) or when the consumer stops
        (the worker then drops the ticket). OpenAIError 500 for a failed generation."""
        total = len(ticket.job.prompts) * ticket.job.n
        try:
            done, asked = 0, time.monotonic()
            while done < total:
                try:
                    piece = await asyncio.wait_for(ticket.pieces.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    piece = None
                if time.monotonic() - asked >= DISCONNECT_POLL_S:
                    # a client that leaves is only seen by asking: its row is freed then
                    asked = time.monotonic()
                    if await request.is_disconnected():  # (finally: the worker drops the ticket)
                        return
                if piece is None:
                    continue
                if piece.kind == "error":
                    raise OpenAIError(500, piece.message, type="server_error",
                                      headers={"x-should-retry": "false"})
                done += piece.kind == "done"
                yield piece
        finally:
            ticket.cancelled.set()  # a no-op once done; frees the worker if the client left

    async def _events(ticket: Ticket):
        job = ticket.job
        total = len(job.prompts) * job.n
        results = [None] * total
        # with tools, a choice's text is held back where it may begin a call
        calls = [CallStream(job.tool_format, job.parallel_tool_calls) for _ in range(total)] \
            if job.tool_format is not None else None
        try:
            if job.kind == "chat":  # the first chunk of each choice carries only the role
                for i in range(total):
                    yield _sse(protocol.chunk(job, [protocol.stream_choice(job, i, None, None, True)]))
            done = 0
            while done < total:
                piece = await ticket.pieces.get()
                if piece.kind == "error":  # after streaming began: an error event, then [DONE]
                    yield _sse(OpenAIError(500, piece.message, type="server_error").body())
                    break
                if piece.kind == "text":
                    text = calls[piece.index].add(piece.text) if calls is not None else piece.text
                    if text or calls is None:
                        yield _sse(protocol.chunk(job, [protocol.stream_choice(
                            job, piece.index, text, None, tokens=piece.tokens, spans=piece.spans,
                            speculation=piece.speculation)]))
                    continue
                results[piece.index] = (piece.completion_tokens, piece.stats, piece.prediction)
                done += 1
                finish = piece.finish
                if calls is not None:
                    rest, made = calls[piece.index].finish()
                    if rest:
                        yield _sse(protocol.chunk(job, [protocol.stream_choice(job, piece.index, rest, None)]))
                    if made:
                        finish = protocol.tool_finish(finish)
                        yield _sse(protocol.chunk(job, [{"index": piece.index, "logprobs": None, "finish_reason": None,
                                                         "delta": {"tool_calls": protocol.tool_calls(made, True)}}]))
                yield _sse(protocol.chunk(job, [protocol.stream_choice(job, piece.index, None, finish)]))
            else:
                if job.include_usage:
                    yield _sse(protocol.chunk(job, [], protocol.usage(job, results)))
            yield "data: [DONE]\n\n"
        finally:
            ticket.cancelled.set()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completions")

    @app.post("/infill")
    async def infill_endpoint(request: Request):
        """llama.cpp server's FIM endpoint (:mod:`.infill`)."""
        check_key(request)
        ctx = context()
        raw = await _read_body(request, limit)
        job, cut, fields = await asyncio.to_thread(
            lambda: infill.check_infill(protocol.json_object(raw), ctx))
        ticket = submit(job, ctx)
        if job.stream:
            return StreamingResponse(_infill_events(request, ticket, cut, fields),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, end, finish, stats, predicted, word = "", None, None, None, 0, ""
        async for piece in _pieces(request, ticket):
            stats = piece.stats or stats
            if piece.kind == "text":
                text += piece.text
                predicted += len(piece.tokens)
                if (end := cut.end(text)) is not None:
                    break  # (the worker drops the rest)
            else:
                finish, predicted, word = piece.finish, piece.completion_tokens, piece.stop_word
        if finish is None and end is None:  # the client left
            return Response(status_code=499)
        return infill.select(infill.body(job, text[:end], finish, stats, predicted, end is not None, word),
                             fields)

    async def _infill_events(request: Request, ticket: Ticket, cut: infill.Cut, fields):
        """llama.cpp's stream: a {content, stop: false} event per piece, then the response's
        fields with stop: true (no [DONE], as llama.cpp's /infill)."""
        text, sent, predicted = "", 0, 0
        finish, stats, end, word = None, None, None, ""
        try:
            async for piece in _pieces(request, ticket):
                stats = piece.stats or stats
                if piece.kind == "done":
                    finish, predicted, word = piece.finish, piece.completion_tokens, piece.stop_word
                    continue
                text += piece.text
                predicted += len(piece.tokens)
                end = cut.end(text)
                delta = text[sent:end]
                sent += len(delta)
                if delta:
                    yield _sse({"index": 0, "content": delta, "tokens": [], "stop": False,
                                "id_slot": 0, "tokens_predicted": predicted,
                                "tokens_evaluated": len(ticket.job.prompts[0])})
                if end is not None:
                    break
        except OpenAIError as e:
            yield _sse(e.body())
            return
        last = infill.body(ticket.job, text[:end] if end is not None else text, finish, stats,
                           predicted, end is not None, word)
        yield _sse(infill.select({**last, "content": ""}, fields))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    return app


def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 30):
    """Run ``app`` with uvicorn in a daemon thread (port 0: any free one); returns (the
    uvicorn server, its port) once it listens. Stop it with ``server.should_exit = True``.
    Raises RuntimeError when it does not start within ``timeout`` seconds."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="error",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + timeout
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.01)
    server.thread = thread
    return server, server.servers[0].sockets[0].getsockname()[1]


class GracefulServer(uvicorn.Server):
    """uvicorn's server with the shutdown ``specdecode serve`` promises: the first SIGINT or
    SIGTERM stops accepting and starts ``grace`` seconds after which ``worker`` ends what still
    runs (:meth:`~specdecode.server.Worker.cut`: each stream gets its last chunk); a second
    exits the process at once, quietly, with ``exit_code``. ``stopped_by`` is the signal, for
    the caller to report (it is not raised again after the shutdown, as uvicorn's own is)."""

    def __init__(self, config: uvicorn.Config, worker: Worker, grace: float, exit_code: int):
        super().__init__(config)
        self.worker, self.grace, self.exit_code, self.stopped_by = worker, grace, exit_code, None

    def handle_exit(self, sig, frame) -> None:
        if self.stopped_by is not None:
            os._exit(self.exit_code)
        self.stopped_by = sig
        self.should_exit = True
        timer = threading.Timer(self.grace, self.worker.cut)
        timer.daemon = True
        timer.start()

"""The server's side of generation: models loaded in the background, a bounded queue of
requests, and one worker thread that runs them in a :class:`~specdecode.batch.BatchEngine`
(up to ``max_batch`` choices share each verify pass; each choice through
:func:`specdecode.api.stream`, so every method, stop rule and seed of the library applies
unchanged, and each output equals its solo run), handing each piece of text to the
request's event loop as it is made. A target without rows of their own lengths (the
transformers and llama.cpp backends) runs one choice at a time.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

from .. import api
from ..batch import BatchEngine
from ..models.base import BatchLM
from ..profile import draft_profile, prefill_profile, verify_profile
from ..stats import SpecDecodingStats
from .protocol import Job, Token

SPECULATION = ("num_draft_tokens", "num_accepted_tokens", "num_verify_passes",
               "num_generated_tokens", "acceptance_rate", "mean_acceptance_length")


@dataclass
class Piece:
    """What the worker hands to a request: ``text`` of choice ``index`` with its new
    ``tokens`` (:class:`~.protocol.Token`, an EOS that ended the choice left out), ``spans``
    [(text, kind, proposer)] and ``speculation`` counters so far (kind "text"), that choice's
    end (kind "done": ``finish``, ``completion_tokens``, ``stats``), or the request's failure
    (kind "error": ``message``)."""

    kind: str
    index: int = 0
    text: str = ""
    finish: str | None = None
    completion_tokens: int = 0
    stats: object = None
    message: str = ""
    tokens: list = field(default_factory=list)
    spans: list = field(default_factory=list)
    speculation: dict | None = None
    stop_word: str = ""  # the stop string that ended the choice (kind "done"), if one did
    prediction: tuple[int, int] = (0, 0)  # (kind "done") accepted and rejected prediction tokens


@dataclass
class Ticket:
    """A queued job and where its pieces go; ``cancelled`` is set when the client leaves (the
    worker stops that request after its current verify pass)."""

    job: Job
    loop: asyncio.AbstractEventLoop
    pieces: asyncio.Queue
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def put(self, piece: Piece) -> None:
        self.loop.call_soon_threadsafe(self.pieces.put_nowait, piece)


@dataclass
class _Choice:
    """One choice of a ticket in flight: its stream and what its metrics need."""

    ticket: Ticket
    index: int
    prompt_tokens: int
    chunks: object
    first: float | None = None
    offset: int = 0  # characters of the choice's tokens' texts so far
    emitted: int = 0  # completion tokens handed out so far
    stats: object = None  # its latest speculation counters


class Worker:
    """Loads the models (``load()`` returns (target, draft), run in a thread of its own so
    that /health answers meanwhile), then runs the queued tickets' choices, ``max_batch`` at
    a time in one batched engine of ``max_len`` positions a row.

    max_queue: tickets waiting beyond those running; ``submit`` raises queue.Full past it.
    metrics: a :class:`~.metrics.Metrics` (observed per choice).
    """

    def __init__(self, load, metrics, max_queue: int = 32, max_batch: int = 8, max_len: int = 4096):
        self._load = load
        self.metrics = metrics
        self.max_batch, self.max_len, self.max_queue = max_batch, max_len, max_queue
        self.target = self.draft = None
        self.engine: BatchEngine | None = None
        self.error: str | None = None
        self.ready = threading.Event()
        self._queue: queue.Queue[Ticket | None] = queue.Queue(maxsize=max_queue)
        self._pending: list[_Choice] = []  # choices of taken tickets that wait for a row
        self._live: list[_Choice] = []
        self._thread = threading.Thread(target=self._main, name="specdecode-worker", daemon=True)
        self._cut = threading.Event()
        self.cut_requests = 0  # requests ended by cut()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends the worker after the step in flight (tickets still queued are dropped)."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(None)

    def cut(self) -> None:
        """End every request in flight or queued, at the worker's next step (thread-safe: a
        shutdown's grace period calls it): each unfinished choice gets its last piece with
        finish reason "abort" (vLLM's name for a request the server ended), so that streams
        close cleanly; ``cut_requests`` counts them."""
        self._cut.set()
        try:
            self._queue.put_nowait(False)  # wakes a worker that waits for work
        except queue.Full:
            pass  # (then it is not waiting)

    def _cut_all(self) -> None:
        tickets = {}
        for c in self._live + self._pending:
            tickets.setdefault(id(c.ticket), c.ticket)
        while True:
            try:
                t = self._queue.get_nowait()
            except queue.Empty:
                break
            if t is None:  # stop(): kept for the loop to see
                self._queue.put_nowait(None)
                break
            if t:
                self._take(t)
                tickets.setdefault(id(t), t)
        for c in self._live + self._pending:
            if c.chunks is not None:
                c.chunks.close()
            c.ticket.put(Piece("done", c.index, finish="abort", completion_tokens=c.emitted,
                               stats=c.stats or SpecDecodingStats()))
        self._live, self._pending = [], []
        self.cut_requests += len(tickets)
        self._cut.clear()

    def wait_loaded(self) -> str | None:
        """Block until the models are loaded (returns None) or have failed to load (returns
        the error, as /health reports it)."""
        while not self.ready.wait(0.2):
            if self.error is not None:  # (set as the worker ends, without ready)
                return self.error
        return None

    @property
    def waiting(self) -> int:
        """Tickets waiting for a row: queued, or taken with no choice running yet."""
        running = {id(c.ticket) for c in list(self._live)}
        return self._queue.qsize() + len({id(c.ticket) for c in list(self._pending)} - running)

    @property
    def context(self) -> int:
        """The most positions a request may use (prompt + max_tokens)."""
        return self.engine.max_len if self.engine is not None else self.target.lm.max_context

    def submit(self, ticket: Ticket) -> None:
        """Queue a ticket; raises queue.Full when ``max_queue`` are waiting (queued, or taken
        from the queue by the worker without a row yet)."""
        if self.waiting >= self.max_queue:
            raise queue.Full
        self._queue.put_nowait(ticket)
        self.metrics.waiting.set(self.waiting)

    def _main(self) -> None:
        try:
            self.target, self.draft = self._load()
            if isinstance(self.target.lm, BatchLM):
                # T(1..17), for the batch's K policy and the hybrid's cost model: measured
                # before the batch holds the target (once per machine, then cached on disk)
                times = verify_profile(self.target)
                self.engine = BatchEngine(self.target.lm, self.max_batch,
                                          min(self.max_len, self.target.lm.max_context),
                                          forward_seconds=times)
            if self.draft is not None:  # its step and feed costs, measured before any request
                draft_profile(self.draft)
                prefill_profile(self.draft)
        except Exception as e:  # noqa: BLE001 (any failure is reported by /health)
            self.error = f"{type(e).__name__}: {e}"
            return
        self.ready.set()
        rows = self.max_batch if self.engine is not None else 1
        while True:
            try:
                ticket = self._queue.get(block=not (self._live or self._pending))
            except queue.Empty:
                ticket = False
            if ticket is None:
                break
            if ticket:
                self._take(ticket)
            if self._cut.is_set():
                self._cut_all()
            while self._pending and len(self._live) < rows:
                self._live.append(self._begin(self._pending.pop(0)))
            self.metrics.waiting.set(self.waiting)
            self.metrics.running.set(len(self._live))
            if self._live:
                self.metrics.batch_size.observe(len(self._live))
            self._round()
            self.metrics.running.set(len(self._live))  # (the loop may block next, idle)
            self.metrics.waiting.set(self.waiting)
        for c in self._live:
            c.chunks.close()
        if self.engine is not None:
            self.engine.close()  # frees the target for others in this process

    def _take(self, ticket: Ticket) -> None:
        job = ticket.job
        for p, prompt in enumerate(job.prompts):
            for c in range(job.n):
                self._pending.append(_Choice(ticket, p * job.n + c, len(prompt), None))

    def _begin(self, choice: _Choice) -> _Choice:
        job = choice.ticket.job
        method = job.method.method  # (the app made job.method the served config)
        c = choice.index % job.n
        choice.chunks = api.stream(
            self.target, input_ids=job.prompts[choice.index // job.n], method=job.method,
            draft=self.draft if method.needs_draft_model else None,
            num_speculative_tokens=job.num_speculative_tokens, batch=self.engine,
            seed=None if job.seed is None else job.seed + c, logprobs=job.logprobs, prediction=job.prediction,
            response_format=job.response_format,
            eos_token_id=None if job.eos_token_ids is None else list(job.eos_token_ids), **job.sampling)
        return choice

    def _tokens(self, choice: _Choice, chunk, eos: set) -> list[Token]:
        """The chunk's tokens as the responses show them (alternatives decoded one id each)."""
        tok = self.target.tokenizer
        out = []
        for tid, text, info in zip(chunk.token_ids, chunk.token_texts, chunk.token_info):
            if tid in eos:
                break  # it ended the choice: not text, not a completion token
            top = None if info.top_logprobs is None else [
                (tok.decode([a], skip_special_tokens=False), lp) for a, lp in info.top_logprobs]
            out.append(Token(text, info.kind, info.proposer, info.logprob, top, choice.offset))
            choice.offset += len(text)
        return out

    def _stop_word(self, job, result, eos: set) -> str:
        """The stop string that ended a result, or "" (an EOS, the length cap)."""
        stops = job.sampling.get("stop") or ()
        ids = result.token_ids
        if result.finish_reason != "stop" or not stops or (ids and ids[-1] in eos):
            return ""
        full = api._decode(self.target.tokenizer, ids)
        return next((s for s in stops if full.startswith(s, len(result.text))), "")

    def _drop(self, ticket: Ticket) -> None:
        """Close every choice of a ticket (its client left, or one of them failed)."""
        for c in [c for c in self._live if c.ticket is ticket]:
            c.chunks.close()
            self._live.remove(c)
        self._pending = [c for c in self._pending if c.ticket is not ticket]

    def _round(self) -> None:
        """One chunk of every live choice: one verify pass of the batch (the first choice's
        next() steps it; the others find their block made)."""
        for choice in list(self._live):
            ticket = choice.ticket
            eos = set(ticket.job.eos_token_ids or self.target.eos_token_ids)
            if choice not in self._live:
                continue  # dropped with its ticket this round
            if ticket.cancelled.is_set():
                self.metrics.cancelled.inc()
                self._drop(ticket)
                continue
            try:
                chunk = next(choice.chunks)
            except Exception as e:  # noqa: BLE001 (a bug must not kill the server)
                traceback.print_exc()
                ticket.put(Piece("error", message=f"{type(e).__name__}: {e}"))
                self._drop(ticket)
                continue
            if chunk.text or chunk.token_ids:
                if chunk.text:
                    choice.first = choice.first or time.perf_counter()
                spec = ({name: getattr(chunk.stats, name) for name in SPECULATION}
                        if ticket.job.token_sources and chunk.stats is not None else None)
                tokens = self._tokens(choice, chunk, eos)
                choice.emitted += len(tokens)
                choice.stats = chunk.stats or choice.stats
                ticket.put(Piece("text", choice.index, chunk.text, tokens=tokens,
                                 spans=[(t, i.kind, i.proposer) for t, i in chunk.spans],
                                 speculation=spec, stats=chunk.stats))
            if chunk.result is not None:
                r = chunk.result
                ids = r.token_ids  # an EOS that ended the request is not text
                n = len(ids) - (r.finish_reason == "stop" and bool(ids) and ids[-1] in eos)
                # a prompt's tokens count once however many choices it has, as usage counts them
                first_of_prompt = choice.index % ticket.job.n == 0
                self.metrics.observe(r, n, choice.prompt_tokens if first_of_prompt else 0,
                                     ticket.arrived, choice.first)
                ticket.put(Piece("done", choice.index, finish=r.finish_reason,
                                 completion_tokens=n, stats=r.stats, stop_word=self._stop_word(ticket.job, r, eos),
                                 prediction=(r.accepted_prediction_tokens, r.rejected_prediction_tokens)))
                choice.chunks.close()
                self._live.remove(choice)

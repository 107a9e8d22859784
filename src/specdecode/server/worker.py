"""The server's side of generation: models loaded in the background, a bounded queue of
requests, and one worker thread that runs them (each choice through
:func:`specdecode.api.stream`, so every method, K schedule and stop rule of the library
applies unchanged), handing each piece of text to the request's event loop as it is made.

One request runs at a time: the batched engine (many requests in each verify pass) is the
next step of this server; until then concurrent requests wait in the queue, and a request's
output is its solo run's by construction.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

from .. import api
from ..methods import Method
from .protocol import Job


@dataclass
class Piece:
    """What the worker hands to a request: ``text`` of choice ``index`` (kind "text"), that
    choice's end (kind "done": ``finish``, ``completion_tokens``, ``stats``), or the
    request's failure (kind "error": ``message``)."""

    kind: str
    index: int = 0
    text: str = ""
    finish: str | None = None
    completion_tokens: int = 0
    stats: object = None
    message: str = ""


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


class Worker:
    """Loads the models (``load()`` returns (target, draft), run in a thread of its own so
    that /health answers meanwhile), then runs queued tickets one at a time.

    max_queue: tickets waiting beyond the one running; ``submit`` raises queue.Full past it.
    metrics: a :class:`~.metrics.Metrics` (observed per request).
    """

    def __init__(self, load, metrics, max_queue: int = 32):
        self._load = load
        self.metrics = metrics
        self.target = self.draft = None
        self.error: str | None = None
        self.ready = threading.Event()
        self._queue: queue.Queue[Ticket | None] = queue.Queue(maxsize=max_queue)
        self.running = 0
        self._thread = threading.Thread(target=self._main, name="specdecode-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends the worker after the request in flight (tickets still queued are dropped)."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(None)

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def submit(self, ticket: Ticket) -> None:
        """Queue a ticket; raises queue.Full when ``max_queue`` are waiting."""
        self._queue.put_nowait(ticket)
        self.metrics.waiting.set(self.waiting)

    def _main(self) -> None:
        try:
            self.target, self.draft = self._load()
        except Exception as e:  # noqa: BLE001 (any failure is reported by /health)
            self.error = f"{type(e).__name__}: {e}"
            return
        self.ready.set()
        while True:
            ticket = self._queue.get()
            self.metrics.waiting.set(self.waiting)
            if ticket is None:
                return
            self.running = 1
            self.metrics.running.set(1)
            try:
                self._run(ticket)
            except Exception as e:  # noqa: BLE001 (a bug must not kill the server)
                traceback.print_exc()
                ticket.put(Piece("error", message=f"{type(e).__name__}: {e}"))
            finally:
                self.running = 0
                self.metrics.running.set(0)

    def _run(self, ticket: Ticket) -> None:
        job = ticket.job
        method = Method(job.method)
        eos = set(self.target.eos_token_ids)
        for p, prompt in enumerate(job.prompts):
            for c in range(job.n):
                index = p * job.n + c
                seed = None if job.seed is None else job.seed + c
                chunks = api.stream(
                    self.target, input_ids=prompt, method=method,
                    draft=self.draft if method.needs_draft_model else None,
                    num_speculative_tokens=job.num_speculative_tokens,
                    suffix_cache="session" if method in (Method.SUFFIX, Method.HYBRID) else "request",
                    seed=seed, **job.sampling)
                first = None
                try:
                    for chunk in chunks:
                        if ticket.cancelled.is_set():
                            self.metrics.cancelled.inc()
                            return
                        if chunk.text:
                            first = first or time.perf_counter()
                            ticket.put(Piece("text", index, chunk.text))
                        if chunk.result is not None:
                            r = chunk.result
                            ids = r.token_ids  # an EOS that ended the request is not text
                            n = len(ids) - (r.finish_reason == "stop" and bool(ids) and ids[-1] in eos)
                            self.metrics.observe(r, n, len(prompt), ticket.arrived, first)
                            ticket.put(Piece("done", index, finish=r.finish_reason,
                                             completion_tokens=n, stats=r.stats))
                finally:
                    chunks.close()

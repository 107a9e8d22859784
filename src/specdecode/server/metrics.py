"""The server's Prometheus metrics (``GET /metrics``), with vLLM's names for speculation so
that dashboards made for vLLM read them: ``specdecode:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``
(acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts),
plus requests, tokens, time to first token, time per output token, end-to-end latency, the
queue and the batch size. Counters are exposed with prometheus-client's ``_total`` suffix."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

P = "specdecode:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """One registry per server (several servers in one process, as in the tests, stay apart)."""

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lab = {"model_name": model_name}
        self.num_drafts = Counter(P + "spec_decode_num_drafts", "verify passes that checked at "
                                  "least one draft token", ["model_name"], registry=r).labels(**lab)
        self.num_draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "draft tokens proposed",
                                        ["model_name"], registry=r).labels(**lab)
        self.num_accepted_tokens = Counter(P + "spec_decode_num_accepted_tokens",
                                           "draft tokens accepted", ["model_name"],
                                           registry=r).labels(**lab)
        self._per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos",
                                "draft tokens accepted at each position of their block",
                                ["model_name", "position"], registry=r)
        self._lab = lab
        self.requests = Counter(P + "request_success", "requests finished, by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        self.cancelled = Counter(P + "request_cancelled", "requests whose client left before "
                                 "the end", ["model_name"], registry=r).labels(**lab)
        self.prompt_tokens = Counter(P + "prompt_tokens", "prompt tokens prefilled",
                                     ["model_name"], registry=r).labels(**lab)
        self.generation_tokens = Counter(P + "generation_tokens", "tokens generated (delivered)",
                                         ["model_name"], registry=r).labels(**lab)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "arrival to first text",
                              ["model_name"], buckets=LATENCY_BUCKETS, registry=r).labels(**lab)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "after the first text, "
                              "seconds per further token (the fair figure under speculation)",
                              ["model_name"], buckets=LATENCY_BUCKETS, registry=r).labels(**lab)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "arrival to the last token",
                             ["model_name"], buckets=LATENCY_BUCKETS, registry=r).labels(**lab)
        self.waiting = Gauge(P + "num_requests_waiting", "requests in the queue",
                             ["model_name"], registry=r).labels(**lab)
        self.running = Gauge(P + "num_requests_running", "requests being generated",
                             ["model_name"], registry=r).labels(**lab)
        self.batch_size = Histogram(P + "batch_size", "requests in each verify pass",
                                    ["model_name"], buckets=(1, 2, 4, 8, 16, 32, 64),
                                    registry=r).labels(**lab)

    def observe(self, result, completion_tokens: int, prompt_tokens: int, arrived: float,
                first_text: float | None) -> None:
        """Count one finished choice (a :class:`~specdecode.api.GenerationResult`);
        ``prompt_tokens``: 0 for the second and later choices of one prompt."""
        now = time.perf_counter()
        s = result.stats
        self.num_drafts.inc(s.num_drafts)
        self.num_draft_tokens.inc(s.num_draft_tokens)
        self.num_accepted_tokens.inc(s.num_accepted_tokens)
        for pos, n in enumerate(s.accepted_per_position):
            self._per_pos.labels(position=str(pos), **self._lab).inc(n)
        self.requests.labels(finished_reason=result.finish_reason, **self._lab).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(now - arrived)
        if first_text is not None:
            self.ttft.observe(first_text - arrived)
            if completion_tokens > 1:
                self.tpot.observe((now - first_text) / (completion_tokens - 1))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

"""The OpenAI-compatible server, started on 127.0.0.1 in the test and spoken to with the
official ``openai`` client (max_retries=0) and raw HTTP: the items of docs/server.md's
checklist that apply to a server that runs one request at a time (tiny models of the test
tokenizer; outputs compared with the same request run in-process)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch

import specdecode
from specdecode.methods import Method, SpeculativeConfig, speculative_config
from specdecode.server import Metrics, Worker, create_app, serve_in_thread

from tiny_dirs import tiny_dirs_in

MODEL = "tiny"
PROMPT = "def add(a, b):\n    return"


class Server:
    """A real server in a thread of this process (uvicorn on an ephemeral port)."""

    def __init__(self, load, api_key=None, max_queue=32, method="hybrid", max_batch=8, max_body_bytes=None):
        self.worker = Worker(load, Metrics(MODEL), max_queue, max_batch, 512)
        self.app = create_app(self.worker, MODEL, method, api_key, max_body_bytes)

    def start(self, wait_ready=True):
        self.uv, self.port = serve_in_thread(self.app)
        self.url = f"http://127.0.0.1:{self.port}"
        self.worker.start()
        if wait_ready:
            assert self.worker.ready.wait(60), self.worker.error
        return self

    def stop(self):
        self.worker.stop()
        self.uv.should_exit = True
        self.uv.thread.join(10)

    def client(self, key="none"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def post(self, path, body, headers=None):
        """(status, headers, parsed body or raw text)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
        return _fetch(req)

    def get(self, path):
        return _fetch(urllib.request.Request(self.url + path))


def _fetch(req):
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw, status, headers = r.read().decode(), r.status, {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        raw, status, headers = e.read().decode(), e.code, {k.lower(): v for k, v in e.headers.items()}
    try:
        return status, headers, json.loads(raw)
    except json.JSONDecodeError:
        return status, headers, raw


def load_pair(tmp_path_factory):
    dirs = tiny_dirs_in(tmp_path_factory)
    return specdecode.load(dirs["target"]), specdecode.load(dirs["draft"])


# three loads of the same tiny pair: a server's batch holds its target while it runs
models = pytest.fixture(scope="module", name="models")(load_pair)  # what the shared server serves
spare = pytest.fixture(scope="module", name="spare")(load_pair)  # for tests that start servers of their own
alone = pytest.fixture(scope="module", name="alone")(load_pair)  # the solo runs the answers are compared with


def hybrid_server(tmp_path_factory):
    """A server of its own tiny pair serving the hybrid, stopped after the module: the body
    of the ``server`` fixture of a feature's test module."""
    served = load_pair(tmp_path_factory)  # (its batch holds them)
    s = Server(lambda: served, method="hybrid").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def server(models):
    s = Server(lambda: models).start()
    yield s
    s.stop()


def solo(pair, prompt, method="hybrid", chat=False, **kw):
    """The same request run in-process: what every server answer must equal."""
    target, draft = pair
    m = Method(method)
    return specdecode.generate(target, prompt, draft=draft if m.needs_draft_model else None,
                               method=m, chat=chat, **kw)


def test_health_is_503_until_the_models_are_loaded_then_200(spare):
    gate = threading.Event()

    def slow_load():
        gate.wait(30)
        return spare

    s = Server(slow_load).start(wait_ready=False)
    try:
        status, headers, body = s.get("/health")
        assert status == 503 and body["error"]["message"] == "the models are still loading"
        status, headers, body = s.post("/v1/completions", {"model": MODEL, "prompt": "x"})
        assert status == 503 and headers.get("retry-after") == "5"
        gate.set()
        assert s.worker.ready.wait(30)
        assert s.get("/health")[0] == 200
    finally:
        gate.set()
        s.stop()


def test_models_list_parses_with_the_official_client(server):
    assert [m.id for m in server.client().models.list()] == [MODEL]


@pytest.mark.parametrize("method", ["ar", "draft", "prompt-lookup", "suffix", "hybrid"])
def test_greedy_completion_equals_the_solo_run(server, alone, method):
    client = server.client()
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                  extra_body={"method": method})
    want = solo(alone, PROMPT, method, max_new_tokens=24)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason
    n = len(want.token_ids) - (want.finish_reason == "stop" and want.token_ids[-1] in alone[0].eos_token_ids)
    assert r.usage.completion_tokens == n <= 24
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # the batch's K policy chooses other lengths than a request alone: other counts, same
    # text; speculation in the server's own field, OpenAI's prediction counts 0 (no prediction)
    details, spec = r.usage.completion_tokens_details, r.usage.model_extra["speculation"]
    assert details.accepted_prediction_tokens == details.rejected_prediction_tokens == 0
    assert 0 <= spec["num_accepted_tokens"] <= min(r.usage.completion_tokens, spec["num_draft_tokens"])
    assert (spec["num_draft_tokens"] == 0) == (method == "ar")


def test_chat_completion_streamed_equals_non_streamed_and_the_solo_run(server, alone):
    client = server.client()
    messages = [{"role": "user", "content": "Write add(a, b) in Python."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    want = solo(alone, messages, max_new_tokens=30)
    assert full.choices[0].message.content == want.text and full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [want.finish_reason]
    totals = lambda u: (u.prompt_tokens, u.completion_tokens, u.total_tokens)  # noqa: E731
    # (the speculation details may differ: the hybrid's suffix cache learns across requests)
    assert chunks[-1].choices == [] and totals(chunks[-1].usage) == totals(full.usage)
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_ends_with_done_and_never_streams_part_of_a_stop_string(server, alone):
    want = solo(alone, PROMPT, max_new_tokens=40)
    stop = want.text[5:8]  # a string the output reaches: cut there, never streamed in part
    status, _, raw = server.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 40,
                                                     "temperature": 0, "stop": [stop], "stream": True})
    assert status == 200 and raw.endswith("data: [DONE]\n\n")
    events = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    deltas = [e["choices"][0]["text"] for e in events]
    assert "".join(deltas) == want.text[:want.text.index(stop)]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert sum(e["choices"][0]["finish_reason"] is not None for e in events) == 1


def test_length_and_several_prompts_and_choices(server, alone):
    client = server.client()
    r = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello there"], max_tokens=5,
                                  temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c, p in zip(r.choices, [PROMPT, PROMPT, "Hello there", "Hello there"]):
        want = solo(alone, p, max_new_tokens=5)
        assert c.text == want.text and c.finish_reason == "length" == want.finish_reason
    prompt_tokens = sum(len(alone[0].tokenizer.encode(p)) for p in (PROMPT, "Hello there"))
    assert r.usage.prompt_tokens == prompt_tokens and r.usage.completion_tokens == 20


def test_token_id_prompts_and_seeded_sampling_repeat(server, alone):
    ids = alone[0].tokenizer.encode(PROMPT)
    client = server.client()
    kw = dict(model=MODEL, prompt=ids, max_tokens=20, temperature=0.9, seed=7)
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    want = solo(alone, None, input_ids=ids, max_new_tokens=20, temperature=0.9, seed=7)
    assert a == b == want.text
    ar = solo(alone, None, "ar", input_ids=ids, max_new_tokens=20, temperature=0.9, seed=7)
    assert want.text == ar.text  # the gumbel rule: the method does not change a seeded text


def test_unseeded_sampled_requests_with_the_same_prompt_differ(server):
    client = server.client()
    texts = {client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0,
                                       extra_body={"method": "ar"}).choices[0].text for _ in range(3)}
    assert len(texts) > 1


def test_concurrent_streams_each_equal_their_solo_run(server, alone):
    """8 concurrent streaming requests mixing methods, prompts and seeded sampling."""
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    cases = [(m, p, t) for m, p, t in zip(
        ["ar", "draft", "prompt-lookup", "suffix", "hybrid", "hybrid", "draft", "ar"],
        [PROMPT, "Hello there", PROMPT * 2, "def f(x):", PROMPT, "Hello there", "x = [1, 2", PROMPT],
        [0, 0, 0, 0, 0, 0.8, 0.8, 0])]

    async def one(method, prompt, temperature):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=20,
                                                 temperature=temperature, seed=3, stream=True,
                                                 extra_body={"method": method})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        return await asyncio.gather(*(one(*c) for c in cases))

    batches = server.worker.metrics.batch_size
    before = (batches._sum.get(), sum(b.get() for b in batches._buckets))
    got = asyncio.run(main())
    rounds = sum(b.get() for b in batches._buckets) - before[1]
    assert (batches._sum.get() - before[0]) / rounds > 2  # the requests shared verify passes
    for (method, prompt, temperature), text in zip(cases, got):
        assert text == solo(alone, prompt, method, max_new_tokens=20, temperature=temperature,
                            seed=3).text, method


def test_bad_requests_get_openai_errors_with_the_right_status(server):
    cases = [
        (b"{not json", 400, None),
        ({"model": MODEL}, 400, "prompt"),
        ({"model": MODEL, "prompt": 5}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 10 ** 6}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "temperature": 3}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "n": 99}, 400, "n"),
        ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"model": MODEL, "prompt": "x", "method": "medusa"}, 400, "method"),
        ({"model": MODEL, "prompt": "x", "colour": "red"}, 400, "colour"),
        ({"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"model": MODEL, "prompt": "x", "echo": True}, 501, "echo"),
        ({"model": MODEL, "prompt": "x", "return_token_sources": 1}, 400, "return_token_sources"),
        ({"model": MODEL, "prompt": "x", "presence_penalty": 0.5}, 501, "presence_penalty"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ({"prompt": "x"}, 400, "model"),
        # from a break-it pass: each was a 500
        ({"model": MODEL, "prompt": "x", "max_tokens": 10 ** 400}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "temperature": 10 ** 400}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "n": 2, "seed": (1 << 63) - 1, "temperature": 1}, 400, "seed"),
        (b"[" * 100000 + b"]" * 100000, 400, None),
        (b'{"model": "tiny", "prompt": "x", "user": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None),
    ]
    for body, status, param in cases:
        got, _, err = server.post("/v1/completions", body)
        assert got == status, (body, got, err)
        assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["param"] == param
    got, _, err = server.post("/v1/chat/completions", {"model": MODEL, "messages": []})
    assert got == 400 and err["error"]["param"] == "messages"
    got, _, err = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]})
    assert got == 400
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for extra, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 2}, "logprobs"),
                         ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")):
        got, _, err = server.post("/v1/chat/completions", dict(chat, **extra))
        assert got == 400 and err["error"]["param"] == param, (extra, err)
    assert server.get("/v1/nothing")[0] == 404
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt="x", max_tokens=-3)
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="x")


def test_openai_and_vllm_value_ranges_are_accepted(server, alone):
    """A negative seed (OpenAI takes any 64-bit integer) samples reproducibly, as the library
    does with it; top_k -1 (vLLM's "off") is top_k 0; a library error names its field."""
    from specdecode.server.app import _param_of

    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 1.0, "seed": -5}
    got, _, first = server.post("/v1/completions", body)
    assert got == 200 and server.post("/v1/completions", body)[2]["choices"] == first["choices"]
    assert first["choices"][0]["text"] == solo(alone, "Hello", max_new_tokens=8, temperature=1.0, seed=-5).text
    off = [server.post("/v1/completions", dict(body, seed=3, top_k=k))[2]["choices"][0]["text"] for k in (0, -1)]
    assert off[0] == off[1]
    assert server.post("/v1/completions", dict(body, top_k=-2))[2]["error"]["param"] == "top_k"
    assert _param_of("max_new_tokens=0 is invalid; allowed: an integer >= 1") == "max_tokens"
    assert _param_of("seed=-1 is invalid") == "seed" and _param_of("no field here") is None


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    """Declared by Content-Length (answered before the body is sent) or streamed chunked
    without one (answered once past the limit): 413 in OpenAI's shape."""
    import http.client
    from specdecode.server.app import default_max_body_bytes

    limit = default_max_body_bytes(512, 8)

    def answer(conn):
        r = conn.getresponse()
        body = json.loads(r.read())
        conn.close()
        return r.status, body["error"]

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(limit + 10))
    conn.endheaders()
    conn.send(b'{"model": "tiny", "prompt": "')  # the rest is never sent: the header is enough
    status, err = answer(conn)
    assert status == 413 and err["code"] == "request_too_large" and str(limit) in err["message"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    piece = b"x" * (1 << 20)
    for _ in range(limit // len(piece) + 1):  # just past the limit, then wait for the answer
        conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
    status, err = answer(conn)
    assert status == 413 and err["code"] == "request_too_large"
    assert server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})[0] == 200


def test_health_and_short_requests_are_answered_while_a_huge_body_is_tokenized(spare):
    """A body within a raised limit whose parsing and tokenizing take a while: /health,
    /metrics and a short completion answer before it does (the order, not a time)."""
    s = Server(lambda: spare, max_body_bytes=1 << 30).start()
    try:
        order, lock = [], threading.Lock()

        def call(name, fn):
            fn()
            with lock:
                order.append(name)

        big = json.dumps({"model": MODEL, "prompt": "word " * 1_000_000}).encode()  # 5 MB
        first = threading.Thread(target=call, args=("huge", lambda: s.post("/v1/completions", big)))
        first.start()
        time.sleep(0.5)  # (it is being sent or parsed: the others must not wait for it)
        call("health", lambda: s.get("/health"))
        call("metrics", lambda: s.get("/metrics"))
        call("short", lambda: s.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}))
        first.join(120)
        assert order == ["health", "metrics", "short", "huge"], order
    finally:
        s.stop()


def test_api_key(spare):
    s = Server(lambda: spare, api_key="sesame").start()
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        assert s.post("/v1/completions", {"model": MODEL, "prompt": "x"})[0] == 401
        assert [m.id for m in s.client("sesame").models.list()] == [MODEL]
        r = s.client("sesame").completions.create(model=MODEL, prompt="Hello", max_tokens=3)
        assert r.usage.completion_tokens <= 3
    finally:
        s.stop()


def test_a_full_queue_answers_429_with_retry_after(spare, monkeypatch):
    """One request running (held at its start), one waiting (max_queue 1): the third is
    refused; then both finish."""
    import specdecode.server.worker as worker_module

    gate, started = threading.Event(), threading.Event()
    real = worker_module.api.stream

    def held(*args, **kwargs):
        started.set()
        gate.wait(30)
        yield from real(*args, **kwargs)

    monkeypatch.setattr(worker_module.api, "stream", held)
    s = Server(lambda: spare, max_queue=1).start()
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
        results = []
        first = threading.Thread(target=lambda: results.append(s.post("/v1/completions", body)))
        first.start()
        assert started.wait(30)
        second = threading.Thread(target=lambda: results.append(s.post("/v1/completions", body)))
        second.start()
        deadline = time.time() + 30
        while s.worker.waiting < 1:
            assert time.time() < deadline
            time.sleep(0.01)
        status, headers, err = s.post("/v1/completions", body)
        assert status == 429 and headers.get("retry-after") == "1", err
        assert err["error"]["code"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            s.client().completions.create(**body)
        gate.set()
        first.join(60)
        second.join(60)
        assert [r[0] for r in results] == [200, 200]
    finally:
        gate.set()
        s.stop()


def test_a_client_that_leaves_frees_the_worker(server):
    """A stream closed after its first chunk: the worker stops that request at its next
    verify pass and the next request runs."""
    before = server.worker.metrics.cancelled._value.get()
    req = urllib.request.Request(server.url + "/v1/completions", method="POST",
                                 data=json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 200,
                                                  "temperature": 0, "method": "ar",
                                                  "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.readline()
    deadline = time.time() + 30
    while server.worker.metrics.cancelled._value.get() == before:
        assert time.time() < deadline, "the worker kept generating for a client that left"
        time.sleep(0.05)
    r = server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


def _slow_rounds(server, monkeypatch, seconds=0.05):
    """Hold each of the worker's rounds ``seconds`` longer: a request of n tokens takes n
    rounds' worth of that, long enough to act on it meanwhile."""
    real = server.worker._round

    def slow():
        time.sleep(seconds)
        real()

    monkeypatch.setattr(server.worker, "_round", slow)


def test_a_non_streaming_client_that_leaves_frees_its_row(spare, monkeypatch):
    """A non-streamed request whose client closes its connection: the worker drops it long
    before its generation would end (each round held 50 ms here: 200 tokens take 10 s)."""
    import http.client

    s = Server(lambda: spare, max_batch=1).start()
    _slow_rounds(s, monkeypatch)
    try:
        before = s.worker.metrics.cancelled._value.get()
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "method": "ar"}),
            {"Content-Type": "application/json"})
        deadline = time.time() + 5
        while not s.worker._live:
            assert time.time() < deadline
            time.sleep(0.01)
        conn.close()
        t0 = time.time()
        while s.worker.metrics.cancelled._value.get() == before:
            assert time.time() - t0 < 3, "the worker kept generating for a client that left"
            time.sleep(0.02)
        assert not s.worker._live
    finally:
        s.stop()


def test_the_queue_bound_counts_requests_taken_but_not_running(spare, monkeypatch):
    """max_queue bounds every request without a row, also those the worker has taken from
    its queue (one a step): with the one row busy and max_queue 2, of 8 more requests 2
    wait and 6 are refused. (A break-it pass saw 7 of 20 accepted.)"""
    s = Server(lambda: spare, max_queue=2, max_batch=1).start()
    _slow_rounds(s, monkeypatch)
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "method": "ar"}
        results = []
        first = threading.Thread(target=lambda: results.append(
            s.post("/v1/completions", dict(body, max_tokens=80))))
        first.start()
        deadline = time.time() + 10
        while not s.worker._live:
            assert time.time() < deadline
            time.sleep(0.01)
        more = []
        for _ in range(8):  # a step apart or more: the worker takes each from its queue
            more.append(threading.Thread(target=lambda: results.append(s.post("/v1/completions", body))))
            more[-1].start()
            time.sleep(0.15)
        refused = [r for r in results if r[0] == 429]
        assert len(refused) == 6 and s.worker.waiting == 2, (len(refused), s.worker.waiting)
        for t in [first, *more]:
            t.join(60)
        assert sorted(r[0] for r in results) == [200] * 3 + [429] * 6
    finally:
        s.stop()


def test_methods_that_cannot_run_here_are_not_offered_and_get_400(spare, monkeypatch, tmp_path):
    """A server without the target's layer-skip profile (it measures it only for --method
    layer-skip or self) neither lists layer-skip, self and early-exit (no exit layer from a
    method name) nor runs them: a 400 that says what to do, not a 500."""
    import specdecode.methods as methods

    monkeypatch.setattr(methods.self_spec, "default_profile_path", lambda target: tmp_path / "none.json")
    s = Server(lambda: spare, method="ar").start()
    try:
        offered = s.get("/v1/models")[2]["data"][0]["methods"]
        assert "ar" in offered and "suffix" in offered
        assert not {"layer-skip", "self", "early-exit"} & set(offered)
        for m in ("layer-skip", "self", "early-exit"):
            status, _, err = s.post("/v1/completions", {"model": MODEL, "prompt": "x", "method": m})
            assert status == 400 and err["error"]["param"] == "method", (m, err)
            assert "cannot run here" in err["error"]["message"]
        status, _, err = s.post("/v1/completions", {"model": MODEL, "prompt": "x", "method": "self"})
        assert "specdecode tune-skip --target" in err["error"]["message"]
    finally:
        s.stop()
    assert "exit layer" in methods.cannot_run(SpeculativeConfig("early-exit"), spare[0])


def test_a_server_started_with_a_methods_options_runs_requests_naming_it_with_them(spare, alone, tmp_path):
    """--method medusa:head=DIR (a head of one's own, not the target's default one): the
    server offers medusa, runs requests naming it or none with that head (loaded at start,
    kept on the target: load_served, as `specdecode serve`, loads it before serving), and
    their greedy output is the target's; early-exit:layer=E makes
    early-exit servable, which its name alone is not; a served lossy-typical= applies to
    sampled requests (greedy ones are verified exactly, not refused). A head that cannot load fails the
    start, naming the directory, as does an option the target cannot honour."""
    from specdecode.heads import MedusaHeads

    target = spare[0]
    head = MedusaHeads(target.lm.args.dim, target.lm.vocab_size, 2).save(tmp_path / "heads")
    s = Server(lambda: spare, method=f"medusa:head={head}").start()
    try:
        card = s.get("/v1/models")[2]["data"][0]
        assert "medusa" in card["methods"] and card["default_method"] == "medusa"
        want = solo(alone, PROMPT, method="ar", max_new_tokens=12).text
        for extra in ({}, {"method": "medusa"}):
            r = s.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                              extra_body=extra)
            assert r.choices[0].text == want, extra
        assert any(k[0] == "medusa" and k[1] == str(Path(head).resolve()) for k in target.heads)
        status, _, err = s.post("/v1/completions", {"model": MODEL, "prompt": "x", "method": "medusa:head=/etc"})
        assert status == 400 and err["error"]["param"] == "method"
        assert "its options are the server's" in err["error"]["message"], err
    finally:
        s.stop()
    # Medusa's typical acceptance served: for sampled requests only; greedy ones verify exactly
    s = Server(lambda: spare, method=f"medusa:head={head}:lossy-typical=0.09").start()
    try:
        r = s.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        assert r.choices[0].text == want
        r = s.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1, seed=1)
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        s.stop()
    s = Server(lambda: spare, method="early-exit:layer=1").start()
    try:
        assert "early-exit" in s.get("/v1/models")[2]["data"][0]["methods"]
        r = s.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        assert r.choices[0].text == want
    finally:
        s.stop()
    from specdecode.cli.serve import load_served
    from types import SimpleNamespace
    args = SimpleNamespace(target=str(target.path), draft=None, dtype="auto", draft_dtype=None,
                           backend="auto", draft_backend=None, device=None)
    text = f"medusa:head={head}"
    loaded, _ = load_served(args, {text: speculative_config(text, False)})  # what `specdecode serve` loads
    assert [k[1] for k in loaded.heads] == [str(Path(head).resolve())]
    for bad, says in ((f"medusa:head={tmp_path / 'nowhere'}", "nowhere"),
                      ("early-exit:layer=99", "exit layer 99 is out of range"),
                      ("layer-skip:layers=99", r"skipped layers \[99\]")):
        with pytest.raises(ValueError, match=f"method {re.escape(bad)} cannot run on this target: .*{says}"):
            load_served(args, {bad: speculative_config(bad, False)})


def test_a_server_reads_its_methods_files_once(tmp_path):
    """A served method's file-valued options (a Medusa tree's choices=FILE, a layer-skip
    profile=FILE) are read when the server starts: requests served after the files are
    deleted or overwritten still run with them, and their greedy output is the target's
    (before, each request read them again: a 500, or a 400 blaming the client)."""
    from transformers import LlamaForCausalLM
    from specdecode.heads import MedusaHeads
    from specdecode.layer_skip import SkipProfile
    from tiny_dirs import _llama_config, _randomize, local_tokenizer

    model = LlamaForCausalLM(_llama_config(len(local_tokenizer()), hidden=64))  # head_dim 16: exact trees
    _randomize(model, seed=0)
    model.save_pretrained(tmp_path / "target")
    local_tokenizer().save_pretrained(tmp_path / "target")
    target, alone = specdecode.load(tmp_path / "target"), specdecode.load(tmp_path / "target")
    assert target.lm.exact_trees
    head = MedusaHeads(target.lm.args.dim, target.lm.vocab_size, 2).save(tmp_path / "heads")
    choices = tmp_path / "tree.json"
    choices.write_text("[[0], [1], [0, 0]]")
    n = target.lm.args.n_layers
    profile = tmp_path / "skip.json"
    SkipProfile((n - 1,), 2, 0.9, 0.5, 1.1, n).save(profile)
    want = specdecode.generate(alone, PROMPT, method="ar", max_new_tokens=12).text
    for method, path, drafted in ((f"medusa:head={head}:choices={choices}", choices, "medusa"),
                                  (f"layer-skip:profile={profile}", profile, "layer-skip")):
        s = Server(lambda: (target, None), method=method)  # (create_app reads the files)
        path.unlink()
        s.start()
        try:
            for i in range(2):
                r = s.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                                  extra_body={"method": drafted})
                assert r.choices[0].text == want, (method, i)
                path.write_text("not JSON")  # overwritten while serving: still the start's
        finally:
            s.stop()


def test_metrics_count_a_prompt_once_however_many_choices(server):
    def prompt_total():
        text = server.get("/metrics")[2]
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                   if ln.startswith("specdecode:prompt_tokens_total"))

    before = prompt_total()
    r = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=3,
                                           temperature=1, seed=3)
    deadline = time.time() + 5
    while prompt_total() == before:
        assert time.time() < deadline
        time.sleep(0.02)
    assert prompt_total() - before == r.usage.prompt_tokens


def test_metrics_count_speculation_with_vllm_names(server):
    client = server.client()
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                              extra_body={"method": "draft"})
    status, _, text = server.get("/metrics")
    assert status == 200

    def value(name):
        lines = [ln for ln in text.splitlines() if ln.startswith(name + "{") or ln.startswith(name + " ")]
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)

    drafts = value("specdecode:spec_decode_num_drafts_total")
    draft_tokens = value("specdecode:spec_decode_num_draft_tokens_total")
    accepted = value("specdecode:spec_decode_num_accepted_tokens_total")
    per_pos = value("specdecode:spec_decode_num_accepted_tokens_per_pos_total")
    assert drafts > 0 and 0 <= accepted <= draft_tokens and per_pos == accepted
    assert value("specdecode:generation_tokens_total") > 0
    assert value("specdecode:request_success_total") >= 1
    assert "specdecode:time_to_first_token_seconds_bucket" in text
    # later requests still speculate: the counters grow
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                              extra_body={"method": "draft"})
    status, _, text = server.get("/metrics")
    assert value("specdecode:spec_decode_num_draft_tokens_total") > draft_tokens
    # idle again: nothing running, nothing waiting (the gauges are set after a round too)
    deadline = time.time() + 5
    while value("specdecode:num_requests_running") and time.time() < deadline:
        time.sleep(0.05)
        text = server.get("/metrics")[2]
    assert value("specdecode:num_requests_running") == 0 == value("specdecode:num_requests_waiting")


def test_bench_serve_client_measures_both_methods_at_each_level(server, alone):
    """bench-serve's client against a real server: every level has both methods, the server's
    token counts, and times that make sense."""
    from specdecode.bench import serving

    prompts = [[{"role": "user", "content": "Write add(a, b)."}], [{"role": "user", "content": "hi"}]]
    seen = []
    results = serving.run(server.url, MODEL, prompts, "draft", "ar", [1, 3], None, 8,
                          progress=lambda c, m, r: seen.append((c, m)))
    assert seen == [(1, "draft"), (1, "ar"), (3, "ar"), (3, "draft")]  # the order alternates
    for level in results["levels"]:
        c = level["concurrency"]
        for m in ("draft", "ar"):
            r = level[m]
            assert r["requests"] == 2 * c and 0 < r["tokens"] <= 2 * c * 8
            assert r["throughput_tok_s"] > 0 and 0 < r["ttft_median_s"] <= r["ttft_p90_s"]
            assert all(s["ttft_s"] <= s["e2e_s"] for s in r["samples"])
        acc = level["draft"]["acceptance_rate"]  # None where the batch policy drafted nothing
        assert level["ar"]["acceptance_rate"] is None and (acc is None or 0 <= acc <= 1)
    text = serving.report(dict(results, command="x", date="d"))
    assert text.count("| draft |") == 2 and "×" in text
    # --check: every response against the solo run of its prompt
    solo_texts = {i: solo(alone, p, "ar", max_new_tokens=8).text for i, p in enumerate(prompts)}
    c = serving.check(results, solo_texts, 0)
    assert c["compared"] == 2 * 2 * (1 + 3) and c["mismatches"] == 0 == c["errors"]
    c = serving.check(results, {0: solo_texts[0], 1: solo_texts[1] + "x"}, 0)
    assert c["mismatches"] == c["compared"] // 2 and c["first_mismatches"][0]["prompt"] == 1
    assert "mismatches" in serving.report(dict(results, command="x", date="d"))
    # pairs of blocks, alternated: the level's figures over both, the ratio the pairs' median
    seen.clear()
    paired = serving.run(server.url, MODEL, prompts, "draft", "ar", [2], 2, 4,
                         progress=lambda c, m, r: seen.append((m, r["requests"])), repeats=3)
    assert seen == [("draft", 2), ("ar", 2), ("ar", 2), ("draft", 2), ("draft", 2), ("ar", 2)]
    level = paired["levels"][0]
    assert level["draft"]["requests"] == 6 == len(level["ar"]["samples"]) and paired["repeats"] == 3
    assert len(level["pair_ratios"]) == 3 and level["ratio_median"] == sorted(level["pair_ratios"])[1]
    low, high = min(level["pair_ratios"]), max(level["pair_ratios"])
    assert f"{level['ratio_median']:.2f}× ({low:.2f}-{high:.2f})" in serving.report(dict(paired, command="x", date="d"))
    with pytest.raises(ValueError, match="repeats=0"):
        serving.run(server.url, MODEL, prompts, "draft", "ar", [1], 1, 4, repeats=0)
    # a failed request is counted, not a crash of the load
    failed = serving.run(server.url, "no-such-model", prompts, "draft", "ar", [2], None, 4)
    assert failed["levels"][0]["ar"]["errors"] == 4 and failed["levels"][0]["ar"]["requests"] == 0
    assert "404" in failed["levels"][0]["ar"]["samples"][0]["error"]


def test_review_findings(server):
    """From a new-user pass: echo set to true is refused, not ignored; an unknown chat role is
    a 400 naming the roles; a method that needs the draft names the fix."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, _, err = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True})
    assert status == 501 and err["error"]["param"] == "echo"
    assert server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                           "logprobs": None, "echo": False, "best_of": 1})[0] == 200
    status, _, err = server.post("/v1/chat/completions",
                                 dict(body, messages=[{"role": "wizard", "content": "hi"}]))
    assert status == 400 and "wizard" in err["error"]["message"] and "assistant" in err["error"]["message"]


def _target_logprobs(pair, prompt_ids, ids):
    """log_softmax of the target's logits at each generated position, from one pass over the
    whole sequence (not through the engine)."""
    lm = pair[0].lm.fork()
    lm.allocate(1, len(prompt_ids) + len(ids))
    logits = lm.forward(torch.tensor([(prompt_ids + ids)[:-1]]))[0, len(prompt_ids) - 1:]
    return torch.log_softmax(logits.float(), -1)


def test_logprobs_come_from_the_target_one_entry_per_token(server, alone):
    """Checklist 12: one entry per emitted token, the target's log-probabilities (never all
    0.0), as many alternatives as asked, streamed and not, completions and chat."""
    client = server.client()
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                  logprobs=3, extra_body={"method": "hybrid"})
    want = solo(alone, PROMPT, max_new_tokens=20)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == r.choices[0].text == want.text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(n)]
    ref = _target_logprobs(alone, want.prompt_token_ids, want.token_ids[:n])
    for i, (tid, got) in enumerate(zip(want.token_ids, lp.token_logprobs)):
        assert got == pytest.approx(float(ref[i, tid]), abs=1e-4) and got <= 0
        assert len(lp.top_logprobs[i]) <= 3  # (two ids may decode to the same text)
        assert max(lp.top_logprobs[i].values()) == pytest.approx(got, abs=1e-6)  # greedy: the top one
    assert any(v < -1e-3 for v in lp.token_logprobs)

    messages = [{"role": "user", "content": "Write add(a, b) in Python."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == len(entries)
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in content]
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in content)
    assert client.chat.completions.create(**dict(kw, logprobs=False, top_logprobs=None)).choices[0].logprobs is None


def test_token_sources_name_who_supplied_the_text(server, alone):
    """The page's extension: each chunk's text cut into runs with the kind of token each came
    from, and the choice's speculation counters; plain decoding's are all the target's."""
    def run(method):
        status, _, raw = server.post("/v1/completions", {
            "model": MODEL, "prompt": PROMPT * 3, "max_tokens": 30, "temperature": 0, "stream": True,
            "method": method, "return_token_sources": True, "stream_options": {"include_usage": True}})
        assert status == 200
        events = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
        choices = [c for e in events for c in e["choices"]]
        text = "".join(c["text"] for c in choices)
        runs = [s for c in choices for s in c["token_sources"]]
        assert "".join(s["text"] for s in runs) == text
        spec = [c["speculation"] for c in choices if c.get("speculation")][-1]
        return text, runs, spec, events[-1]["usage"]

    text, runs, spec, usage = run("ar")
    assert {s["kind"] for s in runs} == {"target"} and spec["num_draft_tokens"] == 0
    assert text == solo(alone, PROMPT * 3, "ar", max_new_tokens=30).text
    text, runs, spec, usage = run("draft")
    kinds = {s["kind"] for s in runs}
    assert "accepted" in kinds and kinds <= {"accepted", "recovered", "bonus", "target"}
    assert {s["proposer"] for s in runs if s["kind"] == "accepted"} == {"draft"}
    assert spec["num_accepted_tokens"] == usage["speculation"]["num_accepted_tokens"]
    assert spec["num_draft_tokens"] == usage["speculation"]["num_draft_tokens"]
    assert spec["num_generated_tokens"] >= usage["completion_tokens"]
    assert text == solo(alone, PROMPT * 3, "draft", max_new_tokens=30).text


# as the machine notes say Chromium runs here: headless, and no calls to Google's hosts
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _chromium() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium")
    if path is None:
        raise RuntimeError("the page test needs Chromium: run 'make browser' (Debian's chromium "
                           "package) or set CHROMIUM=/path/to/chromium")
    return path


def test_the_page_shows_who_supplied_each_token_beside_plain_decoding(server, alone, tmp_path):
    """The page at / in a real headless Chromium against the real server: the answer streams
    with each token shaded by who supplied it, the live acceptance rate, mean acceptance
    length and tokens/s, and the same prompt with speculation off beside it, the same text."""
    from playwright.sync_api import sync_playwright

    prompt = "Write add(a, b) in Python."
    want = solo(alone, [{"role": "user", "content": prompt}], "draft", max_new_tokens=24,
                num_speculative_tokens=4)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url + "/")
            page.wait_for_function("document.querySelector('#method').options.length > 0")
            assert "tiny" in page.text_content("#model")
            page.fill("#prompt", prompt)
            page.fill("#max-tokens", "24")
            page.select_option("#method", "draft")
            page.fill("#k", "4")  # kept every round (the server's policy, on tiny models, drafts little)
            page.check("#compare")
            page.click("#run")
            done = "s => ['done', 'error'].includes(document.querySelector(s).dataset.state)"
            for pane in ("#spec", "#plain"):
                page.wait_for_function(f"({done})('{pane}')", timeout=60_000)
            page.screenshot(path=str(tmp_path / "page.png"))
            assert [page.get_attribute(s, "data-state") for s in ("#spec", "#plain")] == ["done", "done"]
            assert page.text_content("#spec .out") == want.text == page.text_content("#plain .out")
            kinds = page.eval_on_selector_all("#spec .out span", "els => els.map(e => e.className)")
            assert "accepted-draft" in kinds and set(kinds) <= {
                "accepted-draft", "accepted-lookup", "recovered", "bonus", "target"}
            plain = page.eval_on_selector_all("#plain .out span", "els => els.map(e => e.className)")
            assert set(plain) == {"target"}
            stats = page.text_content("#spec .stats")
            assert "acceptance rate" in stats and "mean acceptance length" in stats and "tokens/s" in stats
            rate = float(page.text_content("#spec .stats .acceptance-rate").split()[-1].rstrip("%"))
            assert 0 < rate <= 100
            assert "acceptance rate" not in page.text_content("#plain .stats")
            assert not errors, errors
        finally:
            browser.close()


def test_load_16_concurrent_streams_100_requests(server, alone):
    """A bounded load test on loopback: 100 streaming requests, 16 at a time (twice
    the batch: the queue holds the rest), mixed methods, prompt lengths, greedy and seeded
    sampling: 0 errors, each equals its solo run, and nothing is left running after."""
    methods = ["ar", "draft", "prompt-lookup", "suffix", "hybrid"]
    prompts = [PROMPT, "Hello there", PROMPT * 3, "def f(x):", "x = [1, 2"]
    cases = [(methods[i % 5], prompts[(i // 5) % 5], 0.0 if i % 3 else 0.7, 10 + i % 7) for i in range(25)]
    want = {c: solo(alone, c[1], c[0], max_new_tokens=c[3], temperature=c[2], seed=11).text for c in cases}
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    got, errors = [], []

    async def worker(queue):
        while queue:
            case = queue.pop()
            method, prompt, temperature, n = case
            try:
                stream = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=n, temperature=temperature, seed=11,
                    stream=True, extra_body={"method": method})
                got.append((case, "".join([c.choices[0].text async for c in stream if c.choices])))
            except Exception as e:  # noqa: BLE001 (counted: the test wants none)
                errors.append(repr(e))

    async def main():
        queue = [cases[i % len(cases)] for i in range(100)]
        await asyncio.wait_for(asyncio.gather(*(worker(queue) for _ in range(16))), timeout=600)

    asyncio.run(main())
    assert errors == [] and len(got) == 100
    assert [c for c, text in got if text != want[c]] == []
    deadline = time.time() + 10
    while (server.worker._live or server.worker._pending or server.worker.waiting) and time.time() < deadline:
        time.sleep(0.05)
    assert not server.worker._live and not server.worker._pending and server.worker.waiting == 0
    assert server.worker.engine.active == 0 and not server.worker.engine.waiting


def test_bench_serve_command_with_check(tmp_path, tmp_path_factory, capsys):
    """`specdecode bench-serve --check` end to end on the tiny pair: its own server, both
    methods, then every response compared with the solo run: 0 mismatches, 0 errors, nothing
    left running, in the report and results.json."""
    from specdecode import cli

    dirs = tiny_dirs_in(tmp_path_factory)

    questions = tmp_path / "question.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) for i, (c, t) in
                                   enumerate([("writing", "Write add(a, b)."), ("qa", "What is 2 + 2?")])))
    assert cli.main(["bench-serve", "--target", str(dirs["target"]), "--repeats", "0"]) == 2
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err
    assert cli.main(["bench-serve", "--target", str(dirs["target"]), "--dataset", str(tmp_path / "nothere.jsonl")]) == 2
    assert "Spec-Bench question file not found: " + str(tmp_path / "nothere.jsonl") in capsys.readouterr().err
    assert cli.main(["bench-serve", "--target", str(dirs["target"]), "--method", "ar"]) == 2
    assert "--method and --off-method are both ar" in capsys.readouterr().err
    # a method the target cannot honour ends the run, naming it (it waited forever)
    assert cli.main(["bench-serve", "--target", str(dirs["target"]), "--method", "early-exit:layer=99",
                     "--dataset", str(questions), "--limit", "1", "--concurrency", "1"]) == 2
    assert "method early-exit:layer=99 cannot run on this target" in capsys.readouterr().err
    assert cli.main(["bench-serve", "--url", "http://127.0.0.1:9", "--method", "medusa:head=x",
                     "--dataset", str(questions)]) == 2
    assert "with --url the running server's own --method options hold" in capsys.readouterr().err
    code = cli.main(["bench-serve", "--target", str(dirs["target"]), "--draft", str(dirs["draft"]),
                     "--method", "draft", "--concurrency", "1,2", "--max-tokens", "6", "--limit", "1",
                     "--dataset", str(questions), "--check", "--out", str(tmp_path / "out")])
    out = capsys.readouterr()
    assert code == 0, out.err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["check"]["compared"] == 2 * (2 + 4) and results["check"]["mismatches"] == 0
    assert results["check"]["errors"] == 0 == results["check"]["left_running"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "0 mismatches, 0 errors, 0 requests left running" in report
    # concurrency 1 beside the library alone: both methods, the server's figure the level's
    for m in ("draft", "ar"):
        r = results["beside_generate"][m]
        assert r["requests"] == 2 and r["server_tok_s"] > 0 and r["generate_tok_s"] > 0
        assert f"{m} {r['server_tok_s']:.2f} against {r['generate_tok_s']:.2f} tok/s" in report


def test_beside_generate_takes_the_median_of_per_request_ratios():
    from specdecode.bench import serving

    results = {}
    pairs = {"ar": [((10, 1.0), (10, 0.5)), ((30, 3.0), (30, 3.0)), ((6, 1.0), (6, 2.0))]}
    assert serving.beside_generate(results, pairs) == {"ar": 1.0}  # ratios 0.5, 1, 2
    assert results["beside_generate"]["ar"] == {"server_tok_s": 9.2, "generate_tok_s": round(46 / 5.5, 3),
                                                "ratio": 1.0, "requests": 3}


def test_the_serve_command_ends_saying_why_when_its_models_cannot_serve(tmp_path_factory):
    """`specdecode serve --method early-exit:layer=99` on a 2-layer target: what only the
    loaded target can tell (the layer it lacks) ends the process with exit code 1 and the
    reason on stderr, instead of a server whose /health says 503 for ever."""
    import subprocess
    import sys

    dirs = tiny_dirs_in(tmp_path_factory)
    proc = subprocess.run([sys.executable, "-m", "specdecode.cli", "serve", "--target", str(dirs["target"]),
                           "--method", "early-exit:layer=99", "--port", "0", "--max-len", "512"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert ("error: the models failed to load: ValueError: method early-exit:layer=99 cannot run on this "
            "target: exit layer 99 is out of range") in proc.stderr


def test_the_serve_command_as_the_readme_starts_it(tmp_path_factory):
    """`specdecode serve` in a process of its own (the README's first server command), on
    the tiny pair: /health turns 200, the page and one chat completion through the official
    client answer, and SIGTERM ends it."""
    import signal
    import socket
    import subprocess
    import sys

    dirs = tiny_dirs_in(tmp_path_factory)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "specdecode.cli", "serve", "--target", str(dirs["target"]),
                             "--draft", str(dirs["draft"]), "--method", "hybrid", "--port", str(port),
                             "--max-len", "512"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.time() < deadline, "the server did not become healthy"
            time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
            assert "watch speculation" in r.read().decode()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, temperature=0, max_tokens=8,
                                           messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 8
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


SLOWED_CLI = """
import sys, time
import specdecode.server.worker as worker_module
from specdecode.cli import main
real = worker_module.api.stream
def slow(*args, **kwargs):  # ~20 tokens a second: each request takes seconds
    for i, chunk in enumerate(real(*args, **kwargs)):
        if i == 0:
            print("# generating", file=sys.stderr, flush=True)
        time.sleep(0.05)
        yield chunk
worker_module.api.stream = slow
sys.exit(main(sys.argv[1:]))
"""


def _slowed_cli_child(argv: list[str], err: Path):
    """A forked child running `specdecode ARGV` with its stderr in the file ``err`` and its
    generation slowed to ~20 tokens a second (so that streams are in flight when a signal
    comes; the first piece generated writes "# generating" to ``err``); returns the started
    process."""
    import multiprocessing

    def child():
        import signal
        # as a fresh process starts: not a handler an earlier test left in this one
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        fd = os.open(err, os.O_WRONLY | os.O_CREAT)
        os.dup2(fd, 2)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)  # (not pytest's capture)
        sys.argv = ["specdecode", *argv]
        exec(SLOWED_CLI, {"__name__": "__slowed__"})  # (exits with the command's code)

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    return proc


def _serve_in_a_child(tmp_path_factory, tmp_path, grace: str):
    """`specdecode serve` of the tiny pair in a slowed child (:func:`_slowed_cli_child`);
    returns (process, port, its stderr file) once it is ready."""
    import socket

    target = tiny_dirs_in(tmp_path_factory)["target"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    err = tmp_path / "stderr"
    proc = _slowed_cli_child(["serve", "--target", str(target), "--method", "ar", "--port", str(port),
                              "--shutdown-grace", grace], err)
    deadline = time.time() + 120
    while True:
        try:
            if _fetch(urllib.request.Request(f"http://127.0.0.1:{port}/health"))[0] == 200:
                break
        except OSError:
            pass
        assert time.time() < deadline and proc.is_alive(), err.read_text()[-2000:]
        time.sleep(0.1)
    return proc, port, err


def test_ctrl_c_lets_a_stream_finish_its_grace_then_ends_it_cleanly(tmp_path_factory, tmp_path):
    """SIGINT with a stream in flight: the stream goes on for the grace period, then gets a
    last chunk with finish_reason 'abort' and [DONE]; the server exits 130 saying what it cut,
    without a traceback."""
    import signal
    proc, port, err = _serve_in_a_child(tmp_path_factory, tmp_path, "1")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model="target", prompt=PROMPT, max_tokens=200, stream=True,
                                       temperature=0)
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices and first.choices[0].finish_reason is None
    os.kill(proc.pid, signal.SIGINT)
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "abort"
    assert sum(1 for c in rest if c.choices and c.choices[0].text) >= 5  # it ran on during the grace
    proc.join(30)
    text = err.read_text()
    assert proc.exitcode == 130, text[-2000:]
    assert "stopped by SIGINT: 1 request(s) still running after the 1 s grace were ended" in text
    assert "Traceback" not in text


def test_a_second_signal_exits_at_once(tmp_path_factory, tmp_path):
    import signal
    proc, port, err = _serve_in_a_child(tmp_path_factory, tmp_path, "60")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model="target", prompt=PROMPT, max_tokens=200, stream=True)
    next(iter(stream))
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.5)
    assert proc.is_alive()  # in its 60 s grace
    os.kill(proc.pid, signal.SIGINT)
    proc.join(10)
    assert proc.exitcode == 130 and "Traceback" not in err.read_text()


def test_ctrl_c_stops_bench_serve_at_once_with_its_requests_in_flight(tmp_path_factory, tmp_path):
    """SIGINT in the middle of bench-serve's load (its clients with requests in flight, many
    more to send), in a fresh process: it exits 130 within seconds, saying the load stopped,
    without a traceback, instead of sending the rest of its requests first."""
    import signal
    import subprocess

    target = tiny_dirs_in(tmp_path_factory)["target"]
    err = tmp_path / "stderr"
    path = os.pathsep.join(p for p in (str(Path(specdecode.__file__).parent.parent),
                                       os.environ.get("PYTHONPATH")) if p)
    with open(err, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", SLOWED_CLI, "bench-serve", "--target", str(target),
                                 "--method", "prompt-lookup", "--concurrency", "2", "--requests", "40",
                                 "--max-tokens", "64", "--threads", "1"],
                                stderr=log, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": path})
    try:
        deadline = time.time() + 120
        while "# generating" not in err.read_text():  # the load is under way
            assert time.time() < deadline and proc.poll() is None, err.read_text()[-2000:]
            time.sleep(0.1)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        t0 = time.time()
        code = proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert code == 130, text[-2000:]
    assert time.time() - t0 < 15
    assert "interrupted: the load stopped" in text and "Traceback" not in text

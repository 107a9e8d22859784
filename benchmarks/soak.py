"""A soak test of the OpenAI-compatible server: many mixed requests against one `specdecode
serve` process on loopback, then its health.

What it sends (closed-loop clients, each its next request when its last one ends): chat and
completions requests over a pool of Spec-Bench prompts (the copy inside specdecode), greedy
or seeded sampling, streamed or not, each naming a method the server lists; a share of the
streamed ones disconnect after their first chunks; a few bodies are malformed (bad JSON, a
bad field: 4xx expected) or announced larger than the server takes (413 expected). Before the load,
the prompts' solo outputs are computed once through the library (`specdecode.generate`, plain
decoding, the same sampling and seed), in this process, before the server starts.

What it checks (each a line of the report; the exit code is 1 if one fails): no error but
the intended 4xx; every completed response equal to its solo output; the server's resident
memory after warm-up (the first tenth of the requests) growing by less than --max-rss-growth;
its open file descriptors flat (within --fd-slack of their count after warm-up); the queue
back to 0 (waiting and running, from /metrics) once the clients are done; and the server
stopping on SIGINT with exit 130, having cut no request.

    python benchmarks/soak.py --out soak/small --target smollm2-135m-instruct \\
        --draft smollm2-135m-instruct --requests 2000
    python benchmarks/soak.py --out soak/pair --requests 200     # the default pair

Writes results.json (every sample of memory, descriptors and queue; the failures) and
report.md. `make soak` runs both; not part of CI.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import specdecode
from specdecode.bench.workloads import SPEC_BENCH_PATH, load_spec_bench
from specdecode.bench.run import _commit as commit_of_the_code
from specdecode.bench.serving import sse_events
from specdecode.models import registry
from specdecode.server.app import default_max_body_bytes

WANTED_METHODS = ("ar", "prompt-lookup", "suffix", "draft", "hybrid")


@dataclass(frozen=True)
class Job:
    """One request of the pool: its prompt (index), kind, sampling and shape."""

    prompt: int
    chat: bool
    seed: int | None  # None: greedy
    stream: bool
    method: str
    max_tokens: int
    disconnect: bool = False  # a streamed request the client leaves after its first chunks
    bad: str | None = None  # "json", "field", "oversized": a body the server must refuse


@dataclass
class Outcome:
    """What one request got: its status, its text (complete requests), how long it took."""

    job: Job
    status: int
    text: str | None = None
    seconds: float = 0.0
    error: str | None = None


@dataclass
class Health:
    """Samples of the server process over the run: (seconds since the start, value)."""

    rss_mib: list = field(default_factory=list)
    fds: list = field(default_factory=list)
    queue: list = field(default_factory=list)  # (s, waiting, running)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pool_prompts(count: int, chars: int) -> list[str]:
    """``count`` Spec-Bench first turns, cut to ``chars`` characters (short prompts: many
    requests)."""
    tasks = load_spec_bench(SPEC_BENCH_PATH, None)
    random.Random(0).shuffle(tasks)
    return [t.turns[0][:chars] for t in tasks[:count]]


def make_jobs(n: int, prompts: int, methods: list[str], max_tokens: int, seed: int,
              disconnect_share: float = 0.1, bad_share: float = 0.01) -> list[Job]:
    """``n`` jobs drawn with ``seed``: half greedy, half seeded (4 seeds), half streamed, of
    which ``disconnect_share`` leave early; ``bad_share`` refused bodies."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        if rng.random() < bad_share:
            jobs.append(Job(0, True, None, False, "ar", 8, bad=rng.choice(["json", "field", "oversized"])))
            continue
        stream = rng.random() < 0.5
        jobs.append(Job(rng.randrange(prompts), rng.random() < 0.8,
                        None if rng.random() < 0.5 else rng.randrange(4), stream, rng.choice(methods),
                        rng.choice([max_tokens // 4, max_tokens // 2, max_tokens]),
                        disconnect=stream and rng.random() < disconnect_share))
    return jobs


def solo_key(job: Job) -> tuple:
    return job.prompt, job.chat, job.seed, job.max_tokens


def solo_outputs(target: str, prompts: list[str], jobs: list[Job]) -> dict:
    """The text each (prompt, chat, seed, max_tokens) of ``jobs`` that is compared gets
    alone: plain decoding through the library (seeded sampling at temperature 0.8)."""
    lm = specdecode.load(target)
    out = {}
    for key in sorted({solo_key(j) for j in jobs if j.bad is None and not j.disconnect},
                      key=lambda k: (k[0], k[1], -1 if k[2] is None else k[2], k[3])):
        prompt, chat, seed, max_tokens = key
        text = [{"role": "user", "content": prompts[prompt]}] if chat else prompts[prompt]
        sampling = {"temperature": 0.0} if seed is None else {"temperature": 0.8, "seed": seed}
        out[key] = specdecode.generate(lm, text, method="ar", max_new_tokens=max_tokens, **sampling).text
    return out


def body_of(job: Job, model: str, prompts: list[str]) -> bytes:
    if job.bad == "json":
        return b'{"model": "x", "messages": [{"role": "user", "content": "hi"'
    if job.bad == "field":
        return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                           "temperature": -1}).encode()
    body = {"model": model, "max_tokens": job.max_tokens, "stream": job.stream, "method": job.method,
            "temperature": 0.0 if job.seed is None else 0.8}
    if job.seed is not None:
        body["seed"] = job.seed
    if job.chat:
        body["messages"] = [{"role": "user", "content": prompts[job.prompt]}]
    else:
        body["prompt"] = prompts[job.prompt]
    return json.dumps(body).encode()


def send(port: int, job: Job, model: str, prompts: list[str], max_body: int) -> Outcome:
    """One request; its text from the stream's deltas or the whole response."""
    path = "/v1/chat/completions" if job.chat or job.bad else "/v1/completions"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    try:
        if job.bad == "oversized":  # announced, not sent: the server answers from the header
            conn.putrequest("POST", path)
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(max_body + 1))
            conn.endheaders()
        else:
            conn.request("POST", path, body_of(job, model, prompts), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            resp.read()
            return Outcome(job, resp.status, seconds=time.perf_counter() - t0)
        if not job.stream:
            data = json.loads(resp.read())
            choice = data["choices"][0]
            text = choice["message"]["content"] if job.chat else choice["text"]
            return Outcome(job, 200, text or "", time.perf_counter() - t0)
        parts, chunks = [], 0
        for event in sse_events(resp):
            if "error" in event:
                return Outcome(job, 200, error=f"mid-stream: {event['error'].get('message')}")
            chunks += 1
            if job.disconnect and chunks >= 2:  # the client goes away mid-stream
                resp.close()
                return Outcome(job, 200, seconds=time.perf_counter() - t0)
            if event["choices"]:
                c = event["choices"][0]
                parts.append((c["delta"].get("content") if job.chat else c.get("text")) or "")
        return Outcome(job, 200, "".join(parts), time.perf_counter() - t0)
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        if job.disconnect:
            return Outcome(job, 200, seconds=time.perf_counter() - t0)
        return Outcome(job, 0, error=f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def read_metrics(port: int) -> tuple[float, float]:
    """(waiting, running) from the server's /metrics."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    values = {}
    for name in ("num_requests_waiting", "num_requests_running"):
        m = re.search(rf"^specdecode:{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
        values[name] = float(m.group(1)) if m else float("nan")
    return values["num_requests_waiting"], values["num_requests_running"]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specdecode.cli", "serve", "--target", args.target, "--port", str(port),
           "--max-batch", str(args.clients), "--max-len", str(args.max_len), "--threads", str(args.threads)]
    if args.draft:
        cmd += ["--draft", args.draft]
    log = open(Path(args.out) / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + args.load_timeout
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not come up; see {Path(args.out) / 'server.log'}")
        time.sleep(0.5)


def served_methods(port: int) -> tuple[str, list[str]]:
    """(model id, the methods a request may name) from GET /v1/models."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/v1/models")
    data = json.loads(conn.getresponse().read())
    conn.close()
    model = data["data"][0]
    methods = model.get("methods") or ["ar"]
    return model["id"], [m for m in WANTED_METHODS if m in methods]


def evaluate(outcomes: list[Outcome], solo: dict, health: Health, warm_s: float, end_queue: tuple,
             exit_code: int | None, server_log: str, max_rss_growth: float, fd_slack: int) -> list[str]:
    """The failures, one line each (empty: the soak passed)."""
    failures = []
    for o in outcomes:
        j = o.job
        if j.bad is not None:
            want = (413,) if j.bad == "oversized" else tuple(range(400, 500))
            if o.status not in want:
                failures.append(f"a {j.bad} body got {o.status}, not {'413' if j.bad == 'oversized' else '4xx'}")
        elif o.error is not None or o.status != 200:
            failures.append(f"{j}: {o.status} {o.error}")
        elif not j.disconnect and o.text != solo[solo_key(j)]:
            failures.append(f"{j}: differs from its solo output")
    after = [v for s, v in health.rss_mib if s >= warm_s]
    if after and max(after) > after[0] * (1 + max_rss_growth):
        failures.append(f"resident memory grew {max(after) / after[0] - 1:.1%} after warm-up "
                        f"({after[0]:.0f} -> {max(after):.0f} MiB; allowed {max_rss_growth:.0%})")
    fds = [v for s, v in health.fds if s >= warm_s]
    if fds and fds[-1] > fds[0] + fd_slack:
        failures.append(f"open file descriptors went from {fds[0]} to {fds[-1]} after warm-up")
    if tuple(end_queue) != (0.0, 0.0):
        failures.append(f"the queue did not drain: waiting {end_queue[0]}, running {end_queue[1]}")
    if exit_code != 130 or "no request was cut" not in server_log:
        failures.append(f"the server's stop on SIGINT: exit {exit_code}, "
                        f"log {server_log.strip().splitlines()[-1:] if server_log.strip() else '(empty)'}")
    if "Traceback" in server_log:
        failures.append("the server's log holds a traceback")
    return failures


def report(results: dict) -> str:
    s = results["summary"]
    lines = [f"# Soak: {results['target']}" + (f" with draft {results['draft']}" if results["draft"] else ""),
             "", f"`{results['command']}` ({results['date']}, commit {results['commit']})", "",
             "| requests | seconds | completed | compared with solo | left mid-stream | refused as intended "
             "| RSS after warm-up (MiB) | RSS max | fds after warm-up / end | queue at end |",
             "|---|---|---|---|---|---|---|---|---|---|",
             f"| {s['requests']} | {s['seconds']:.0f} | {s['completed']} | {s['compared']} | {s['disconnected']} "
             f"| {s['refused']} | {s['rss_after_warmup_mib']:.0f} | {s['rss_max_mib']:.0f} "
             f"| {s['fds_after_warmup']} / {s['fds_end']} | {s['queue_end']} |", "",
             f"Methods: {', '.join(results['methods'])}.", "",
             "**passed**" if not results["failures"] else "**failed**:\n\n" + "\n".join(
                 f"- {f}" for f in results["failures"][:50])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", required=True, help="folder for results.json, report.md, server.log")
    p.add_argument("--target", default=registry.DEFAULT_TARGET)
    p.add_argument("--draft", default=registry.DEFAULT_DRAFT, help="the draft model ('' for none)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (the server's --max-batch)")
    p.add_argument("--max-tokens", type=int, default=64, help="the longest answer (a quarter, half or all)")
    p.add_argument("--prompts", type=int, default=24, help="prompts in the pool")
    p.add_argument("--prompt-chars", type=int, default=600, help="each prompt's first characters")
    p.add_argument("--max-len", type=int, default=1024, help="the server's --max-len")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disconnect-share", type=float, default=0.1,
                   help="share of the streamed requests whose client leaves mid-stream")
    p.add_argument("--bad-share", type=float, default=0.01,
                   help="share of the requests with a body the server must refuse")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between health samples")
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--fd-slack", type=int, default=4)
    p.add_argument("--load-timeout", type=float, default=600)
    args = p.parse_args(argv)
    if args.requests < 1 or args.clients < 1 or args.max_tokens < 4 or args.prompts < 1:
        p.error("--requests, --clients and --prompts must be >= 1, --max-tokens >= 4")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.draft = args.draft or None

    prompts = pool_prompts(args.prompts, args.prompt_chars)
    port = free_port()
    # the methods are known only once the server runs; the solo outputs do not depend on them
    draw = make_jobs(args.requests, len(prompts), ["ar"], args.max_tokens, args.seed,
                     args.disconnect_share, args.bad_share)
    keys = {solo_key(j) for j in draw if j.bad is None and not j.disconnect}
    print(f"# solo outputs of {len(keys)} (prompt, sampling, length) keys, through the library...",
          file=sys.stderr, flush=True)
    solo = solo_outputs(args.target, prompts, draw)
    print("# starting the server...", file=sys.stderr, flush=True)
    server = start_server(args, port)
    model, methods = served_methods(port)
    rng = random.Random(args.seed + 1)
    jobs = [j if j.bad else Job(j.prompt, j.chat, j.seed, j.stream, rng.choice(methods), j.max_tokens,
                                j.disconnect) for j in draw]
    max_body = default_max_body_bytes(args.max_len, args.clients)  # the server's own limit

    health, outcomes, lock = Health(), [], threading.Lock()
    queue = list(enumerate(jobs))
    t0 = time.perf_counter()
    warm = max(1, len(jobs) // 10)
    warm_s: list[float] = []

    def client():
        while True:
            with lock:
                if not queue:
                    return
                _, job = queue.pop(0)
            o = send(port, job, model, prompts, max_body)
            with lock:
                outcomes.append(o)
                if len(outcomes) == warm:
                    warm_s.append(time.perf_counter() - t0)
                if len(outcomes) % 100 == 0:
                    print(f"  {len(outcomes)}/{len(jobs)} requests, {time.perf_counter() - t0:.0f} s",
                          file=sys.stderr, flush=True)

    done = threading.Event()

    def sampler():
        while not done.is_set():
            s = time.perf_counter() - t0
            try:
                health.rss_mib.append((s, rss_mib(server.pid)))
                health.fds.append((s, open_fds(server.pid)))
                health.queue.append((s, *read_metrics(port)))
            except (OSError, RuntimeError):
                pass
            done.wait(args.sample_every)

    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    watcher = threading.Thread(target=sampler, daemon=True)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    time.sleep(2.0)  # the disconnected streams' rows leave the batch
    end_queue = read_metrics(port)
    s = time.perf_counter() - t0
    health.rss_mib.append((s, rss_mib(server.pid)))
    health.fds.append((s, open_fds(server.pid)))
    health.queue.append((s, *end_queue))
    done.set()
    server.send_signal(signal.SIGINT)
    try:
        exit_code = server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
        exit_code = None
    log = (out / "server.log").read_text()
    failures = evaluate(outcomes, solo, health, warm_s[0] if warm_s else 0.0, end_queue, exit_code, log,
                        args.max_rss_growth, args.fd_slack)
    after = [v for t, v in health.rss_mib if t >= (warm_s[0] if warm_s else 0.0)] or [float("nan")]
    fds = [v for t, v in health.fds if t >= (warm_s[0] if warm_s else 0.0)] or [0]
    results = {
        "target": args.target, "draft": args.draft, "methods": methods, "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit_of_the_code(),
        "summary": {"requests": len(outcomes), "seconds": seconds,
                    "completed": sum(o.status == 200 and o.error is None and not o.job.disconnect for o in outcomes),
                    "compared": sum(o.status == 200 and o.text is not None and not o.job.disconnect for o in outcomes),
                    "disconnected": sum(o.job.disconnect for o in outcomes),
                    "refused": sum(o.job.bad is not None for o in outcomes),
                    "rss_after_warmup_mib": after[0], "rss_max_mib": max(after),
                    "fds_after_warmup": fds[0], "fds_end": fds[-1], "queue_end": list(end_queue),
                    "server_exit": exit_code},
        "failures": failures, "health": asdict(health),
        "samples": [{**asdict(o.job), "status": o.status, "seconds": round(o.seconds, 3), "error": o.error}
                    for o in outcomes]}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = report(results)
    (out / "report.md").write_text(text)
    print(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

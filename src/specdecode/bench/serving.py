"""``specdecode bench-serve``: a closed-loop load client against the OpenAI-compatible server,
speculation on and off in the same run (the server takes the method per request), at several
concurrencies: throughput, time to first token (TTFT), time per output token (TPOT, the fair
figure under speculation, where one chunk may carry several tokens) and acceptance.

The client is threads over ``http.client`` (each blocks on its socket: little CPU beside the
server on a 2-core machine), streaming with ``include_usage`` so that the server's own token
counts are used. Loopback only when it starts the server itself.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from urllib.parse import urlparse


@dataclass
class Sample:
    """One request: seconds to the first text and to the end, the tokens it got, the
    server's accepted / rejected draft tokens, its text, which prompt it sent, and the error
    that ended it (None when it succeeded)."""

    method: str
    concurrency: int
    ttft_s: float
    e2e_s: float
    completion_tokens: int
    accepted: int
    rejected: int
    text: str = ""
    prompt: int = 0
    error: str | None = None


def sse_events(resp) -> Iterator[dict]:
    """The JSON events of a streamed (server-sent events) response, up to ``[DONE]``.
    Raises ValueError for an event that is not JSON."""
    for raw in resp:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            return
        if line.startswith("data: "):
            yield json.loads(line[6:])


def request(url: str, model: str, messages: list[dict], method: str, max_tokens: int,
            api_key: str | None = None, timeout: float = 600) -> Sample:
    """One streamed chat completion, timed. Raises RuntimeError with the server's error."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "method": method,
                       "stream_options": {"include_usage": True}})
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    t0 = time.perf_counter()
    conn.request("POST", u.path.rstrip("/") + "/v1/chat/completions", body, headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"the server answered {resp.status}: {resp.read()[:300]!r}")
    first, usage, text = None, None, []
    for event in sse_events(resp):
        if "error" in event:
            raise RuntimeError(f"the server failed mid-stream: {event['error']['message']}")
        content = event["choices"][0]["delta"].get("content") if event["choices"] else None
        if content:
            first = first or time.perf_counter()
            text.append(content)
        if event.get("usage"):
            usage = event["usage"]
    end = time.perf_counter()
    conn.close()
    spec = usage.get("speculation") or {}  # the server's draft tokens proposed and accepted
    accepted = spec.get("num_accepted_tokens", 0)
    return Sample(method, 0, (first or end) - t0, end - t0, usage["completion_tokens"], accepted,
                  spec.get("num_draft_tokens", 0) - accepted, "".join(text))


def run_level(url: str, model: str, prompts: list[list[dict]], method: str, concurrency: int,
              requests: int, max_tokens: int, api_key: str | None = None) -> tuple[list[Sample], float]:
    """``requests`` requests, ``concurrency`` in flight at a time (closed loop), the prompts
    in turn; returns the samples (a failed request too, with its ``error``) and the wall time.
    Ctrl-C (KeyboardInterrupt) returns at once: no client sends another request, and those
    in flight are left to end with the server (the clients are daemon threads)."""
    counter = iter(range(requests))
    lock = threading.Lock()
    samples: list[Sample] = []
    stop = threading.Event()

    def client():
        while not stop.is_set():
            with lock:
                i = next(counter, None)
            if i is None:
                return
            t0 = time.perf_counter()
            try:
                s = request(url, model, prompts[i % len(prompts)], method, max_tokens, api_key)
            except Exception as e:  # noqa: BLE001 (counted and reported: a load test wants none)
                s = Sample(method, 0, 0.0, time.perf_counter() - t0, 0, 0, 0, error=f"{type(e).__name__}: {e}")
            s.concurrency, s.prompt = concurrency, i % len(prompts)
            with lock:
                samples.append(s)

    t0 = time.perf_counter()
    clients = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in clients:
        t.start()
    try:
        for t in clients:
            t.join()
    except BaseException:
        stop.set()
        raise
    return samples, time.perf_counter() - t0


def _q(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[8] if q == 0.9 and len(values) > 1 \
        else statistics.median(values)


def summarize(samples: list[Sample], wall_s: float) -> dict:
    """Throughput (tokens/s over the level's wall time), TTFT and TPOT median / p90 (s),
    acceptance rate (accepted / proposed draft tokens, None without drafts), errors (the
    failed requests, left out of the rest)."""
    errors = sum(s.error is not None for s in samples)
    done = len(samples) - errors
    samples = [s for s in samples if s.error is None] or [Sample("", 0, 0.0, 0.0, 0, 0, 0)]
    tokens = sum(s.completion_tokens for s in samples)
    tpot = [(s.e2e_s - s.ttft_s) / (s.completion_tokens - 1) for s in samples if s.completion_tokens > 1]
    ttft = [s.ttft_s for s in samples]
    proposed = sum(s.accepted + s.rejected for s in samples)
    return {"requests": done, "errors": errors, "tokens": tokens, "wall_s": round(wall_s, 3),
            "throughput_tok_s": round(tokens / wall_s, 3),
            "ttft_median_s": round(_q(ttft, 0.5), 4), "ttft_p90_s": round(_q(ttft, 0.9), 4),
            "tpot_median_s": round(_q(tpot, 0.5), 4) if tpot else None,
            "tpot_p90_s": round(_q(tpot, 0.9), 4) if tpot else None,
            "acceptance_rate": round(sum(s.accepted for s in samples) / proposed, 4) if proposed else None}


def _ratio_text(level: dict) -> str:
    """A level's on / off throughput: the pair's ratio, or with several pairs their median
    and range."""
    ratios = [x for x in level["pair_ratios"] if x is not None]
    if not ratios:
        return "—"
    if len(level["pair_ratios"]) == 1:
        return f"{ratios[0]:.2f}×"
    return f"{level['ratio_median']:.2f}× ({min(ratios):.2f}-{max(ratios):.2f})"


def report(results: dict) -> str:
    """The markdown report of :func:`run` 's results."""
    on, off = results["method_on"], results["method_off"]
    pairs = results.get("repeats", 1)
    lines = [f"# specdecode bench-serve\n\ncommand: `{results['command']}`\n",
             f"date: {results['date']}; speculation on: `{on}`, off: `{off}`; "
             f"{results['max_tokens']} tokens a request, greedy"
             + (f"; {pairs} pairs of blocks a level, on / off = the median of the pairs' "
                "throughput ratios (their range)" if pairs > 1 else "") + "\n",
             "| concurrency | method | requests (errors) | throughput tok/s | on / off | TTFT median (p90) s "
             "| TPOT median (p90) s | acceptance |", "|---|---|---|---|---|---|---|---|"]
    for level in results["levels"]:
        c = level["concurrency"]
        ratio = _ratio_text(level)
        for m in (on, off):
            r = level[m]
            acc = f"{r['acceptance_rate']:.0%}" if r["acceptance_rate"] is not None else "—"
            tpot = f"{r['tpot_median_s']:.3f} ({r['tpot_p90_s']:.3f})" if r["tpot_median_s"] else "—"
            lines.append(f"| {c} | {m} | {r['requests']} ({r.get('errors', 0)}) | {r['throughput_tok_s']:.2f} | "
                         f"{ratio if m == on else ''} | {r['ttft_median_s']:.3f} "
                         f"({r['ttft_p90_s']:.3f}) | {tpot} | {acc} |")
    check = results.get("check")
    if check is not None:
        lines.append(f"\ncheck: {check['compared']} responses compared with the target's solo "
                     f"greedy run: {check['mismatches']} mismatches, {check['errors']} errors, "
                     f"{check['left_running']} requests left running after the load")
    solo = results.get("beside_generate")
    if solo is not None:
        lines.append("\nconcurrency 1 beside the library alone (each request through the server, "
                     "then as `specdecode generate` runs it, in turn): " + ", ".join(
                         f"{m} {r['server_tok_s']:.2f} against {r['generate_tok_s']:.2f} tok/s "
                         f"(median ratio {r['ratio']:.2f}×, {r['requests']} requests)"
                         for m, r in solo.items()))
    return "\n".join(lines) + "\n"


def run(url: str, model: str, prompts: list[list[dict]], method_on: str, method_off: str,
        concurrencies: list[int], requests_per_level: int | None, max_tokens: int,
        api_key: str | None = None, progress=None, repeats: int = 1) -> dict:
    """Every concurrency level with speculation on and off, ``repeats`` pairs of blocks of
    ``requests_per_level`` requests (default twice the concurrency) a method, the order
    alternating from block to block and level to level (on off, off on, ...), so that a
    drift of the machine moves both alike. A level's figures per method are over all its
    blocks (throughput: tokens over the blocks' summed wall time); ``pair_ratios`` holds each
    pair's on / off throughput and ``ratio_median`` their median, the figure to quote on a
    shared machine. ``progress(concurrency, method, block summary)`` after each block.
    Raises ValueError for repeats < 1."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} is invalid; allowed: an integer >= 1")
    levels = []
    for j, c in enumerate(concurrencies):
        n = requests_per_level or 2 * c
        level = {"concurrency": c, "pair_ratios": []}
        blocks: dict[str, list] = {method_on: [], method_off: []}
        for r in range(repeats):
            pair = {}
            for m in ((method_on, method_off) if (j + r) % 2 == 0 else (method_off, method_on)):
                samples, wall = run_level(url, model, prompts, m, c, n, max_tokens, api_key)
                blocks[m].append((samples, wall))
                pair[m] = summarize(samples, wall)
                if progress is not None:
                    progress(c, m, pair[m])
            off = pair[method_off]["throughput_tok_s"]
            level["pair_ratios"].append(round(pair[method_on]["throughput_tok_s"] / off, 4) if off else None)
        for m, runs in blocks.items():
            samples = [s for run_samples, _ in runs for s in run_samples]
            level[m] = summarize(samples, sum(w for _, w in runs))
            level[m]["samples"] = [asdict(s) for s in samples]
        known = [x for x in level["pair_ratios"] if x is not None]
        level["ratio_median"] = round(statistics.median(known), 4) if known else None
        levels.append(level)
    return {"method_on": method_on, "method_off": method_off, "max_tokens": max_tokens,
            "repeats": repeats, "levels": levels}


def check(results: dict, solo_texts: dict[int, str], left_running: int) -> dict:
    """Compare every response with the solo run of its prompt (``solo_texts``: prompt index
    -> text); adds ``results["check"]`` (compared, mismatches, errors, left_running, the
    first mismatches) and returns it."""
    compared = mismatches = errors = 0
    first = []
    for level in results["levels"]:
        for m in (results["method_on"], results["method_off"]):
            for s in level[m]["samples"]:
                if s["error"] is not None:
                    errors += 1
                    continue
                compared += 1
                if s["text"] != solo_texts[s["prompt"]]:
                    mismatches += 1
                    if len(first) < 3:
                        first.append({"method": m, "concurrency": level["concurrency"],
                                      "prompt": s["prompt"], "got": s["text"][:200],
                                      "want": solo_texts[s["prompt"]][:200]})
    results["check"] = {"compared": compared, "mismatches": mismatches, "errors": errors,
                        "left_running": left_running, "first_mismatches": first}
    return results["check"]


def beside_generate(results: dict, pairs: dict[str, list[tuple[tuple[int, float], tuple[int, float]]]]
                    ) -> dict[str, float]:
    """Concurrency 1 against the library alone, request by request: ``pairs``: method ->
    [((tokens, seconds) through the server, (tokens, seconds) alone)] of the same requests,
    run in turn. Adds ``results["beside_generate"]`` (method -> both tokens/s over all its
    requests, and the median of the per-request ratios) and returns method -> that median."""
    out = {}
    for m, runs in pairs.items():
        ratios = sorted((a[0] / a[1]) / (b[0] / b[1]) for a, b in runs)
        out[m] = {"server_tok_s": round(sum(a[0] for a, _ in runs) / sum(a[1] for a, _ in runs), 3),
                  "generate_tok_s": round(sum(b[0] for _, b in runs) / sum(b[1] for _, b in runs), 3),
                  "ratio": round(statistics.median(ratios), 3), "requests": len(runs)}
    results["beside_generate"] = out
    return {m: r["ratio"] for m, r in out.items()}

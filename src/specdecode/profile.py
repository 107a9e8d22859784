"""The machine's measured forward times T(n): what a verify pass of n tokens costs here,
measured once per model, dtype, thread count and CPU, and cached on disk (the K schedule's
and the hybrid's cost model read them)."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from .models import quant, registry
from .models.base import busy_lock, lm_device
from .models.loading import LoadedModel


def measure_forward_times(lm, context_len: int, max_n: int = 16, repeats: int = 5,
                          warmup: int = 3) -> list[float]:
    """T(n) in seconds for n = 1..max_n new tokens after ``context_len`` cached tokens.

    Sizes are measured round-robin (1, 2, ..., max_n, 1, 2, ...) after ``warmup`` untimed
    rounds, with one more pass of a single token before each size n >= 2 (1, 2, 1, 3, ...,
    1, max_n), so that drift and a cold first call hit every n alike. T(1) is the cost of
    plain decoding and every other time is compared with it (T(n)/T(1) steers K), so it
    gets max(1, max_n - 1) samples a round: with 3 samples, a single slow T(1) moved every
    ratio by 10 % on this project's 2-core CPU. Each T(n) is the median of its samples.
    Returns [T(1), ..., T(max_n)]."""
    lm.allocate(1, context_len + max_n)
    g = torch.Generator().manual_seed(0)
    lm.forward(torch.randint(0, lm.vocab_size, (1, context_len), generator=g), num_logits=0)
    ids = torch.randint(0, lm.vocab_size, (1, max_n), generator=g)
    order = [1] + [m for n in range(2, max_n + 1) for m in (n, 1)][:-1]
    samples: list[list[float]] = [[] for _ in range(max_n)]
    for r in range(warmup + repeats):
        for n in order:
            t0 = time.perf_counter()
            lm.forward(ids[:, :n])
            if r >= warmup:
                samples[n - 1].append(time.perf_counter() - t0)
            lm.rollback(context_len)
    return [statistics.median(s) for s in samples]


PROFILE_CONTEXT = 256
@functools.cache
def _kernel_source() -> str:
    """A digest of the runtime's source (the C++ kernels, their headers, and the modules that
    drive them): a changed forward is measured again."""
    here = quant.KERNEL_SOURCE.parent
    files = sorted([*here.glob("*.cpp"), *here.glob("*.h"), here / "native.py", here / "fused.py",
                    here / "quant.py", here / "kv_cache.py",
                    here / "attention.py", here / "self_draft.py"])
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]


PROFILE_VERSION = 2  # bumped when the measurement changes: older cached profiles are measured again
PROFILE_DIR: Path | None = None  # where profiles are cached; None: <specdecode cache>/profiles


def profile_path(model: LoadedModel, *what) -> tuple[str, Path]:
    """The key and cache file of something measured once on this model on this machine
    (``what`` tells the measurements apart): per model, dtype, kernels, thread count, torch
    version, CPU, the model's device when it is not the CPU (with the accelerator's name),
    and ``PROFILE_VERSION``."""
    device = lm_device(model.lm)
    # the CPU's keys stay as they were (no re-measuring); an accelerator's times are its own
    off_cpu = [] if device.type == "cpu" else [str(device), _accelerator_name(device)]
    key = json.dumps([PROFILE_VERSION, str(model.path or model.name), type(model.lm).__name__,
                      model.lm.weight_format, _kernel_source(), quant.amx_in_use(),
                      torch.get_num_threads(), torch.__version__, platform.machine(),
                      platform.processor(), _cpu_model(), *off_cpu, *what])
    return key, (PROFILE_DIR or registry.cache_dir() / "profiles") / (
        hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")


def _measured_once(model: LoadedModel, what: tuple, size: int, describe: str, measure) -> list[float]:
    """``measure(lm)`` (``size`` positive seconds) read from this model's cache file for
    ``what`` (:func:`profile_path`), or measured under the model's lock and written there.
    Raises RuntimeError while the model is generating another request."""
    key, path = profile_path(model, *what)
    times = None
    try:
        times = json.loads(path.read_text())["forward_seconds"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if isinstance(times, list) and len(times) == size and all(
            isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in times):
        return times
    lock = busy_lock(model.lm)
    if not lock.acquire(blocking=False):
        raise RuntimeError(f"this model is generating another request: its {describe} can be "
                           "measured once that request is finished or closed")
    print(f"measuring {model.name}'s {describe} once (cached in {path})...", file=sys.stderr)
    try:
        times = measure(model.lm)
    finally:
        lock.release()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # its own: processes measure at once
        tmp.write_text(json.dumps({"key": key, "forward_seconds": times}))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs the profile again next time
    return times


def verify_profile(model: LoadedModel, max_k: int = 16) -> list[float]:
    """A model's forward times T(1..max_k+1) in seconds (:class:`~specdecode.schedule.AutoK`'s cost model; with
    max_k = 0, a draft model's T(1)), measured once by :func:`measure_forward_times` — one
    untimed round, then 3 timed ones (15 for a draft's T(1) alone), after prefilling 256
    tokens (less for a shorter context) — and cached on disk per model, dtype, thread count,
    torch version, CPU and ``PROFILE_VERSION`` (in ``PROFILE_DIR``, default <specdecode
    cache>/profiles), and in memory on the loaded model (``LoadedModel.forward_seconds``).
    Measuring uses the model's KV cache, so it raises RuntimeError while the model is
    generating another request. A cache file that cannot be read or holds anything but
    positive times is measured again."""
    n = max_k + 1
    cached = model.forward_seconds
    if cached is not None and len(cached) >= n:
        return cached[:n]

    def measure(lm):
        context = max(1, min(PROFILE_CONTEXT, lm.max_context - n))
        # a draft's T(1) alone is cheap: 15 samples of it
        return measure_forward_times(lm, context, n, repeats=3 if n > 1 else 15, warmup=1)

    times = _measured_once(model, (n,), n, f"forward times T(1..{n})", measure)
    model.forward_seconds = times
    return times


PARALLEL_DRAFT_ROWS = 8  # a parallel draft's pass: ~2 fed tokens and up to K - 1 = 5 masks, and room


def draft_profile(model: LoadedModel) -> list[float]:
    """A draft model's forward times in seconds, measured once as :func:`verify_profile`
    does: T(1) (a draft step), and for a parallel draft (``model.pard_token``, whose one pass
    reads many rows) T(1..``PARALLEL_DRAFT_ROWS``)."""
    return verify_profile(model, PARALLEL_DRAFT_ROWS - 1 if model.pard_token is not None else 0)


PREFILL_TOKENS = 64  # a short prompt's feed: the hybrid's draft is fed prompts and answers so far


def prefill_profile(model: LoadedModel) -> float:
    """Seconds per token of a prefill pass of ``PREFILL_TOKENS`` tokens into an empty cache
    (the median of 3 timed passes after an untimed one): what feeding a draft the tokens it
    has not seen costs (the hybrid's ``draft_prefill_cost``). A pass of that size costs about
    as much per token as a longer one where prefill is compute-bound, and more per token where
    it is still bound by reading the weights. Measured once and cached as
    :func:`verify_profile`, and in memory on the loaded model (``LoadedModel.prefill_seconds``);
    raises RuntimeError while the model is generating another request."""
    if model.prefill_seconds is not None:
        return model.prefill_seconds

    def measure(lm):
        n = max(1, min(PREFILL_TOKENS, lm.max_context))
        lm.allocate(1, n)
        ids = torch.randint(0, lm.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
        samples = []
        for r in range(4):
            t0 = time.perf_counter()
            lm.forward(ids, num_logits=1)
            if r:
                samples.append((time.perf_counter() - t0) / n)
            lm.rollback(0)
        return [statistics.median(samples)]

    model.prefill_seconds = _measured_once(model, ("prefill", PREFILL_TOKENS), 1,
                                           f"prefill time per token ({PREFILL_TOKENS}-token passes)",
                                           measure)[0]
    return model.prefill_seconds


def _accelerator_name(device: torch.device) -> str:
    """The product name of a CUDA device (another kind of device: its type)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""

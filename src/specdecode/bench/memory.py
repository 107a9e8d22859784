"""Each method's peak resident memory, read where it can be read: a process of its own that
loads only the models that method runs on and makes one generation of the run's longest
prompt. In the bench's own process every method's models are loaded side by side, so its
peak says nothing about one method.

``python -m specdecode.bench.memory SPEC`` is that process (SPEC: the JSON that
:func:`method_peak` passes); its last line of stdout is ``{"peak_rss_bytes": N}``.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import torch

from .runners import BenchModels, build_runners, parse_methods


def method_peak(label: str, target: str, draft: str, dtype: str, backend: str,
                prompt_ids: list[int], max_new_tokens: int,
                temperature: float = 0.0) -> tuple[int | None, str]:
    """Peak resident memory in bytes of a process that runs method ``label`` alone (its
    models loaded, one generation of ``prompt_ids``, this process's thread count), and an
    error line when it could not be measured (None, then)."""
    spec = {"label": label, "target": target, "draft": draft, "dtype": dtype, "backend": backend,
            "prompt_ids": prompt_ids, "max_new_tokens": max_new_tokens,
            "temperature": temperature, "threads": torch.get_num_threads()}
    try:
        r = subprocess.run([sys.executable, "-m", "specdecode.bench.memory", json.dumps(spec)],
                           capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            return None, (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        return int(json.loads(r.stdout.strip().splitlines()[-1])["peak_rss_bytes"]), ""
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError, IndexError) as e:
        return None, f"{type(e).__name__}: {e}"


def _child(spec: dict) -> None:
    torch.set_num_threads(spec["threads"])
    models = BenchModels(spec["target"], spec["draft"], spec["dtype"], spec["backend"])
    runner, _ = build_runners(models, parse_methods(spec["label"]),
                              spec["temperature"])[spec["label"]]
    runner(spec["prompt_ids"], spec["max_new_tokens"])
    print(json.dumps({"peak_rss_bytes": own_peak_bytes()}))


def own_peak_bytes() -> int:
    """This process's peak resident memory in bytes: VmHWM (its memory map's, from exec on),
    where ru_maxrss would also count the parent it was forked from, which Linux carries
    across exec; ru_maxrss where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))

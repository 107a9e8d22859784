"""The cache shared by processes: several started together on an empty cache all succeed
with the same output, and a process killed (SIGKILL) at any moment of its first load leaves
a cache the next run uses or rebuilds, never a wrong output.

The first load of a GGUF target writes every artefact a model has: its config, tokenizer
and tensor table read from the file's metadata (``meta/``), whether the file holds Q4_K
blocks (``int8/q4k-files.json``), and the target's forward-time profile (the hybrid's costs,
``profiles/``); its q4 weights are read from the file at each load, never cached. The kernel library is copied in built: compiling it is the
one step a test cannot afford many times."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import specdecode
from specdecode.models import quant, registry
from specdecode.models.gguf_file import TABLE_FILE as gguf_table
from tiny_dirs import q4k_target_dir, write_tiny_gguf

CHILD = """
import hashlib, sys, torch, specdecode
from specdecode import profile
profile.PROFILE_DIR = None  # (the cache's own profiles/)
m = specdecode.load(sys.argv[1], dtype="q4")
r = specdecode.generate(m, "hello world", max_new_tokens=12, method="hybrid", draft=m, temperature=0)
m.lm.allocate(1, 16)
logits = m.lm(torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]))
print("ids", m.lm.weight_format, hashlib.sha256(logits.numpy().tobytes()).hexdigest()[:16], *r.token_ids)
"""


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-cache")
    write_tiny_gguf(q4k_target_dir(root / "src"), root / "tiny-q4.gguf", q4k=True)
    return root / "tiny-q4.gguf"


@pytest.fixture(scope="module")
def kernels():
    """The built kernel libraries (built in the session's cache if need be)."""
    quant.q4k_kernel()
    return sorted((registry.cache_dir() / "kernels").glob("*.so"))


def _cache(tmp_path: Path, kernels: list[Path]) -> Path:
    cache = tmp_path / "cache"
    (cache / "kernels").mkdir(parents=True)
    for k in kernels:
        shutil.copy2(k, cache / "kernels" / k.name)
    return cache


def _start(gguf: Path, cache: Path) -> subprocess.Popen:
    path = os.pathsep.join(p for p in (str(Path(specdecode.__file__).parent.parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "SPECDECODE_CACHE": str(cache), "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(gguf)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _ids(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    (line,) = [ln for ln in out.splitlines() if ln.startswith("ids ")]
    return line


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_started_together_on_an_empty_cache_all_succeed_alike(gguf_file, kernels, tmp_path, processes):
    cache = _cache(tmp_path, kernels)
    procs = [_start(gguf_file, cache) for _ in range(processes)]
    outputs = [_ids(p) for p in procs]
    assert len(set(outputs)) == 1 and outputs[0].split()[1] == "q4-nk", outputs
    alone = _ids(_start(gguf_file, _cache(tmp_path / "alone", kernels)))
    assert outputs[0] == alone
    # every artefact was written once, whole: no temporary file is left behind
    assert [p.name for p in cache.rglob("*") if p.name.startswith(".") or "partial" in p.name or "tmp" in p.name] == []
    assert list((cache / "int8").glob("*.safetensors")) == []
    assert len(list((cache / "meta").glob(f"*/{gguf_table}"))) == 1
    assert len(list((cache / "profiles").glob("*.json"))) >= 1


def test_a_process_killed_during_its_first_load_leaves_a_cache_the_next_run_uses(gguf_file, kernels, tmp_path):
    """SIGKILL at random moments of the first load (each kill on the cache the last one
    left), then a run to the end: the output of a run on a cache of its own."""
    alone = _ids(_start(gguf_file, _cache(tmp_path / "alone", kernels)))
    cache = _cache(tmp_path, kernels)
    t0 = time.perf_counter()
    _ids(_start(gguf_file, _cache(tmp_path / "timed", kernels)))
    span = time.perf_counter() - t0
    rng = random.Random(7)
    killed_with_partial_cache = 0
    for _ in range(6):
        proc = _start(gguf_file, cache)
        time.sleep(rng.uniform(0.3, 1.0) * span)
        proc.kill()
        proc.communicate()
        killed_with_partial_cache += any(cache.rglob("*.safetensors")) or any((cache / "meta").glob("*"))
        done = _ids(_start(gguf_file, cache))
        assert done == alone
        # the next kill starts from scratch again: an empty cache but for the kernels
        for sub in cache.iterdir():
            if sub.name != "kernels":
                shutil.rmtree(sub) if sub.is_dir() else sub.unlink()
    assert killed_with_partial_cache >= 1  # (some kill came after the load had written something)


HOLDER = """
import json, sys, time
from pathlib import Path
from specdecode.train import run
out = Path(sys.argv[1])
with run.run_lock(out):
    print("held", flush=True)
    time.sleep(1.5)
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / run.STATE_FILE).write_text(json.dumps({"epoch": 3, "epochs": 3}))
"""


def test_a_default_head_trained_by_another_process_meanwhile_is_not_trained_again(tmp_path, monkeypatch, capsys):
    """Two processes asking for the same default head: the second waits for the first's run
    (saying so), then finds the head trained instead of training into the same directory."""
    from types import SimpleNamespace

    from specdecode.heads import default_head_dir
    from specdecode.train import run

    target = SimpleNamespace(name="tiny-target")
    out = default_head_dir(target.name, "medusa")
    out.mkdir(parents=True)
    path = os.pathsep.join(p for p in (str(Path(specdecode.__file__).parent.parent), os.environ.get("PYTHONPATH")) if p)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": path})
    assert holder.stdout.readline().strip() == "held"
    monkeypatch.setattr(run, "train_head", lambda *a, **k: pytest.fail("trained a head another process trained"))
    assert run.ensure_default_head("medusa", target) == out
    assert holder.wait(30) == 0
    assert "another process is training into" in capsys.readouterr().err
    with run.run_lock(out), run.run_lock(out):  # re-entrant in one process
        pass

"""The package as pip installs it: a copy built from this checkout and installed elsewhere
runs without anything beside the checkout (its data files ship inside it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import specdecode

from tiny_dirs import tiny_dirs_in

ROOT = Path(__file__).resolve().parent.parent  # the checkout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """This checkout's package installed by pip (no dependencies, offline) into a temporary
    directory; returns that directory. Built from a copy of the checkout's pyproject.toml,
    README.md and src/, so the build writes nothing into the checkout."""
    root = tmp_path_factory.mktemp("packaging")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so"))
    site = root / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                           "--no-build-isolation", "--target", str(site), str(source)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # installed inside a user's own repository (a project's .venv): its commit is not ours
    for args in (["init", "-q"], ["-c", "user.name=u", "-c", "user.email=u@example.com", "commit", "-q",
                                  "--allow-empty", "-m", "the user's project"]):
        subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, timeout=60)
    return site


def test_the_readmes_bench_runs_from_an_installed_copy(installed, tmp_path_factory, tmp_path):
    """README's `specdecode bench --limit 5 --out bench-out`, shrunk (tiny models, one question
    per subtask, 4 new tokens, ar and the draft; two Spec-Bench subtasks whose questions fit
    the tiny target's 2,048 tokens of context), run from a directory outside the checkout
    with only the installed copy importable: it finds Spec-Bench's questions inside the
    package and completes."""
    dirs = tiny_dirs_in(tmp_path_factory)
    env = {**os.environ, "PYTHONPATH": str(installed)}
    where = subprocess.run([sys.executable, "-c", "import specdecode; print(specdecode.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert Path(where.stdout.strip()).is_relative_to(installed), where.stdout + where.stderr
    out = tmp_path / "bench-out"
    proc = subprocess.run([sys.executable, "-m", "specdecode.cli", "bench", "--limit", "1", "--out", str(out),
                           "--target", str(dirs["target"]), "--draft", str(dirs["draft"]),
                           "--methods", "ar,draft", "--max-new-tokens", "4", "--no-memory",
                           "--subtasks", "mt_bench,qa,humaneval"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["subtask"] for r in records} == {"mt_bench", "qa", "humaneval"}
    assert {r["method"] for r in records} == {"ar", "draft"}
    run = json.loads((out / "run.json").read_text())
    # the version of the code that ran; no commit: the repository around the copy is another's
    assert run["version"] == specdecode.__version__ and run["commit"] is None

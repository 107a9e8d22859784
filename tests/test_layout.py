"""The package's shape: no import cycles, no attribute probing in the engine, and one method
registry that the enum, the CLI, the bench and the README all follow."""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import specdecode
from specdecode import METHODS, Method
from specdecode.cli import build_parser

PACKAGE = Path(specdecode.__file__).parent
README = PACKAGE.parents[1] / "README.md"


def _modules() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def test_no_import_of_our_own_modules_inside_functions():
    """An import cycle held together by a function-level import breaks once the import is
    hoisted; there are none to hoist."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.ImportFrom) and (inner.level > 0 or (inner.module or "").startswith("specdecode")):
                        offenders.append(f"{path.name}:{inner.lineno}")
                    if isinstance(inner, ast.Import) and any(a.name.startswith("specdecode") for a in inner.names):
                        offenders.append(f"{path.name}:{inner.lineno}")
    assert offenders == []


def test_every_module_imports_first():
    """Each module imports on its own, as the first specdecode module of a process: a cycle
    shows up only when its first import is one of the modules in it."""
    code = ("import importlib, sys\n"
            f"for name in {_modules()!r}:\n"
            "    for m in [m for m in sys.modules if m == 'specdecode' or m.startswith('specdecode.')]:\n"
            "        del sys.modules[m]\n"
            "    importlib.import_module(name)\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_engine_asks_proposers_and_schedules_through_their_contracts():
    """No getattr/hasattr probing in the loop: what it may use is declared by Proposer and
    Schedule."""
    tree = ast.parse((PACKAGE / "engine.py").read_text())
    probes = [n.lineno for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr")]
    assert probes == []


# What a model offers beyond CausalLM's four methods, declared by the protocols of
# models/base.py (RowsLM, BatchLM, SelfDrafting, MeasuredDraft, BindableDraft)
MODEL_CAPABILITIES = ("forward_span", "forward_rows", "forward_row", "rollback_rows", "compact", "row_lengths",
                      "cost", "self_draft", "bind", "exact_trees", "PREFILL_CHUNK")


def test_models_are_asked_through_their_declared_protocols():
    """No module outside models/ probes a model for a capability with getattr/hasattr: it asks
    isinstance(model, RowsLM) and the like. (methods.py is left out while it moves into a
    package.)"""
    probes = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "models" or rel == Path("methods.py"):
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr") \
                    and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and n.args[1].value in MODEL_CAPABILITIES:
                probes.append(f"{rel}:{n.lineno}")
    assert probes == []


def test_the_method_registry_is_the_one_list_of_methods():
    assert [m.value for m in Method] == list(METHODS)
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    generate = sub.choices["generate"]
    method_arg = next(a for a in generate._actions if a.dest == "method")
    # --method takes a registry name, with the method's own options (layer-skip:layers=...)
    assert all(method_arg.type(name) == name for name in METHODS)
    with pytest.raises(argparse.ArgumentTypeError, match="is not one of"):
        method_arg.type("no-such-method")
    bench_help = sub.choices["bench"].description
    table = README.read_text().split("Methods (`--method`", 1)[1].split("\n\n", 2)[1]
    readme_methods = re.findall(r"^\| `([a-z0-9-]+)`", table, re.M)
    for name, entry in METHODS.items():
        assert f"  {name} " in bench_help and entry.summary in bench_help
        assert f"'{name}': {entry.summary}" in method_arg.help
        if entry.default_k is not None:
            assert f"{entry.default_k} for {name}" in next(a for a in generate._actions if a.dest == "k").help
    assert sorted(readme_methods) == sorted(METHODS)


def test_version():
    proc = subprocess.run([sys.executable, "-m", "specdecode.cli", "--version"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"specdecode {specdecode.__version__}"

"""The package's shape: no import cycles, no attribute probing in the engine, and one method
registry that the enum, the CLI, the bench and the README all follow."""

from __future__ import annotations

import argparse
import ast
import io
import re
import subprocess
import sys
import tokenize
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
    isinstance(model, RowsLM) and the like."""
    probes = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "models":
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


def _method_names_compared(node: ast.Compare) -> list[str]:
    """The method names a comparison tests against: ``Method.X`` members and string constants
    naming a registered method."""
    found = []
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "Method":
            found.append(f"Method.{n.attr}")
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in METHODS:
            found.append(repr(n.value))
    return found


# names compared with words that are also method names but mean other things: a trained
# head's kind ("medusa", "eagle3", "draft"), a model's role ("target", "draft")
OTHER_CONCEPTS = {"kind", "role"}


def test_no_code_outside_methods_and_proposers_branches_on_a_methods_name():
    """What differs between methods is declared by each method's MethodSpec (its options,
    hooks, export settings): code elsewhere asks the spec, never compares a method's name."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ("methods", "proposers"):
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Compare) or not _method_names_compared(node):
                continue
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Name) and o.id in OTHER_CONCEPTS or
                   isinstance(o, ast.Attribute) and o.attr in OTHER_CONCEPTS for o in operands):
                continue
            offenders.append(f"{rel}:{node.lineno}: {ast.get_source_segment(source, node)}")
    assert offenders == []


def test_the_layout_test_finds_a_method_name_branch(tmp_path):
    """The scan above flags both kinds of branch it forbids."""
    for code in ('if spec.method is Method.HYBRID:\n    pass\n', 'x = name in ("draft", "hybrid")\n'):
        node = next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Compare))
        assert _method_names_compared(node)
    node = next(n for n in ast.walk(ast.parse('kind == "medusa"')) if isinstance(n, ast.Compare))
    assert _method_names_compared(node)  # found, then let through as a head kind by the test


def test_each_methods_module_stays_small():
    """One module per method family, each readable in one sitting (at most ~300 lines)."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "methods").glob("*.py")}
    assert {"spec.py", "options.py", "config.py", "plan.py", "draft.py", "lookups.py", "self_spec.py",
            "heads.py"} <= set(sizes)
    assert max(sizes.values()) <= 320, sizes


# a cited document: a name or repository path ending in .md (../ included, to be refused)
_MD = re.compile(r"(?<![\w/.-])((?:\.\./)*[\w-]+(?:/[\w.-]+)*\.md)\b")
_NUMBERED = re.compile(r"\b(?:issues?|sessions?|work[- ]items?)\s+#?\d+", re.I)
_SECTION = re.compile(r"[\w-]+\.md,?\s+(?:sections?|§)\s*\d")  # a page's section numbers change
_PAPER_SECTION = re.compile(r"arXiv:\d{4}\.\d{4,5}\S*\s+§\s*\d")  # a paper's do not


def _prose(path: Path) -> list[tuple[int, str]]:
    """The docstrings and comments (a run of comment lines as one) of ``path``: (first line,
    text on one line)."""
    text = path.read_text()
    out = [(node.body[0].lineno, ast.get_docstring(node, clean=False)) for node in ast.walk(ast.parse(text))
           if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
           and ast.get_docstring(node, clean=False)]
    last = None
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            line, words = tok.start[0], tok.string.lstrip("#")
            if last == line - 1:
                out[-1] = (out[-1][0], out[-1][1] + " " + words)
            else:
                out.append((line, words))
            last = line
    return [(line, " ".join(words.split())) for line, words in out]


def test_docstrings_and_comments_cite_only_what_the_repository_holds():
    """No docstring or comment names an issue, session or work item by number, or cites a
    document the repository does not hold (a path outside it, a page that is not at the
    cited path, a page's section number): a reader has the repository only. A ``.md`` name
    the package writes itself (a string in its code, e.g. an export's NOTES.md) may be named."""
    root = Path(__file__).resolve().parent.parent
    package = root / "src" / "specdecode"  # this checkout's, whichever copy is imported
    written = {node.value for path in package.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Constant) and isinstance(node.value, str) and _MD.fullmatch(node.value)}
    offenders = []
    for path in sorted([*package.rglob("*.py"), *(root / "tests").rglob("*.py")]):
        for line, text in _prose(path):
            where = f"{path.relative_to(root)}:{line}"
            found = [m.group(0) for m in _NUMBERED.finditer(text)]
            found += [w for w in ("../shared", "TESTPACK") if w in text]
            found += [m.group(0) for m in _SECTION.finditer(text)]
            found += ["§"] if "§" in _PAPER_SECTION.sub("", text) else []
            found += [name for name in _MD.findall(text) if name not in written
                      and (name.startswith("../") or not (root / name).is_file())]
            offenders += [f"{where}: {f}" for f in dict.fromkeys(found)]
    assert offenders == []

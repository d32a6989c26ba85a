"""The rules of the house (docs/architecture.md): one concern a module, each opening with what it owns and which of the
kit's modules it may import (held here to its real imports), no import cycle, no module over 1,000 lines and no
function over 60, and the checker's modules free of torch. Read off the sources with ast: nothing is imported."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KIT = sorted((ROOT / "kit").rglob("*.py"))
ENTRY = {"check_topology.py": 400, "bench_ddp_transformer.py": 500, "bench_stage.py": 500, "idr_torch.py": 1000}
MODULE_LINES, FUNCTION_LINES = 1000, 60


def name_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def kit_imports(path: Path) -> set[str]:
    """The kit modules `path` imports when it runs (anywhere in it), not those under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and ast.unparse(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kit.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kit":
            if node.module == "kit" or node.module == "kit.train":  # from kit import site_slurm
                found |= {f"{node.module}.{a.name}" for a in node.names}
            else:
                found.add(node.module)
    return found - {name_of(path)}


def declared_imports(path: Path) -> set[str] | None:
    """The kit modules the docstring's `Imports:` names; None where it has no such line."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    m = re.search(r"Imports:(.*?)(?:\.(?!\w)|$)", doc, re.S)  # to the sentence's end (kit.x.y holds dots)
    return None if m is None else set(re.findall(r"\bkit(?:\.train)?\.\w+", " ".join(m.group(1).split())))


@pytest.mark.parametrize("path", [p for p in KIT if p.name != "__init__.py"], ids=name_of)
def test_each_module_says_what_it_owns_and_imports(path):
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and "Imports:" in doc, f"{name_of(path)}: its docstring must say what it owns and what it imports"
    assert declared_imports(path) == kit_imports(path), (
        f"{name_of(path)}: its docstring's Imports: names {sorted(declared_imports(path))}, it imports "
        f"{sorted(kit_imports(path))}")


def test_no_import_cycle():
    graph = {name_of(p): {m for m in kit_imports(p) if not m.endswith("__init__")} for p in KIT}
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join(path[path.index(dep):] + [dep]) \
                if dep in path else f"import cycle through {dep}"
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_signals_module_imports_the_standard_library_only():
    """The trainers import it before anything else, to hold the stop signals (tests/test_signals.py)."""
    tree = ast.parse((ROOT / "kit" / "train" / "signals.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= set(sys.stdlib_module_names) | {"__future__"}, names - set(sys.stdlib_module_names)


def test_the_checkers_modules_import_no_torch():
    for path in KIT:
        if "train" in path.relative_to(ROOT / "kit").parts or path.name == "own_model.py":  # the trainers'; --model's
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("torch", "fairscale") for n in names), \
                f"{name_of(path)}:{node.lineno} imports {names}: the checker's path must stay free of torch"


@pytest.mark.parametrize("path", KIT + [ROOT / name for name in ENTRY], ids=lambda p: str(p.relative_to(ROOT)))
def test_sizes(path):
    lines = len(path.read_text().splitlines())
    limit = ENTRY.get(path.name, MODULE_LINES) if path.parent == ROOT else MODULE_LINES
    assert lines <= limit, f"{path.relative_to(ROOT)} has {lines} lines, more than {limit}: split it by concern"
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines, line {n.lineno})" for n in ast.walk(ast.parse(
        path.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.end_lineno - n.lineno + 1 > FUNCTION_LINES]
    assert not long, f"{path.relative_to(ROOT)}: functions over {FUNCTION_LINES} lines: {', '.join(long)}"


def test_the_page_script_opens_with_the_pages_code():
    """bench_ddp_transformer.py: after the signals held and the imports, the page's model is the first thing
    defined, and the page's names are there."""
    tree = ast.parse((ROOT / "bench_ddp_transformer.py").read_text())
    defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert defined[:3] == ["Encoder", "Layer", "Decoder"], defined[:5]
    text = (ROOT / "bench_ddp_transformer.py").read_text()
    for name in ("nb_part", "first_part", "last_part", "chunks", "module_list", "ddp_mp_model"):
        assert re.search(rf"\b{name}\b", text), name


@pytest.mark.parametrize("script", list(ENTRY))
def test_a_script_copied_alone_says_to_copy_the_folder(tmp_path, script):
    """Users used to copy three files; the kit is a folder now: a script without kit/ beside it says so in one line."""
    (tmp_path / script).write_text((ROOT / script).read_text())
    if script != "idr_torch.py":
        (tmp_path / "idr_torch.py").write_text((ROOT / "idr_torch.py").read_text())
    r = subprocess.run([sys.executable, script, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    if script == "idr_torch.py":  # the environment's owner imports nothing of the kit
        assert "Traceback" not in r.stderr, r.stderr
        return
    assert r.returncode == 1 and "copy the kit's whole folder" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_lanes_collect_every_file_that_holds_their_tests():
    """The lanes collect only the files the Makefile's LANE_FILES names (a grep for the markers): it must be every
    file where pytest finds a `core` or `legacy` test, or a lane would silently run fewer."""
    named = subprocess.run(["make", "-s", "lane-files"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert named.returncode == 0, named.stderr
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                "-m", "core or legacy", "tests"], cwd=ROOT, capture_output=True, text=True,
                               timeout=300)
    files = {line.split("::")[0] for line in collected.stdout.splitlines() if "::" in line}
    assert files and files == set(named.stdout.split()), (sorted(files), named.stdout)

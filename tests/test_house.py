"""The rules of the house (docs/architecture.md): one concern a module, each opening with what it owns and which of the
kit's modules it may import (held here to its real imports, those under TYPE_CHECKING too), no import cycle, no arrow
back up (kit/ never imports kit/train/, nor the kit the entry points), nothing imports the page's script but its own
tests, idr_torch alone reads the launcher's variables, no module over 1,000 lines and no function over 60, and the
checker's modules free of torch, and docs/architecture.md true to the import graph (its picture names every module,
its "may import" lists hold each module's imports). Read off the sources with ast: nothing is imported."""
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
    """The kit modules `path` imports, anywhere in it: in a function, and under `if TYPE_CHECKING:` too (a type's
    import is an arrow of the graph like any other: a circle through one is a circle)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
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


def test_kit_never_imports_the_trainers_machinery_or_the_scripts():
    """The arrows run down: the entry points import kit/ and kit/train/, kit/train/ imports kit/, kit/ imports neither
    kit/train/ nor an entry point (kit.own_model reached into kit/train/ for two small names: they live in kit/ now)."""
    scripts = {Path(name).stem for name in ENTRY} - {"idr_torch"}  # idr_torch: the environment, below everything
    for path in KIT:
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        names |= {f"kit.train.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                  and n.module == "kit" for a in n.names if a.name == "train"}
        assert not names & scripts, f"{name_of(path)} imports {sorted(names & scripts)}: a script is not a library"
        if "train" not in path.relative_to(ROOT / "kit").parts:
            up = sorted(n for n in names if n == "kit.train" or n.startswith("kit.train."))
            assert not up, f"{name_of(path)} imports {up}: kit/ never imports kit/train/ (move the name down into kit/)"


# The page's own tests: the only files that may import bench_ddp_transformer (its loop against the kit's builder).
PAGE_TESTS = {"tests/test_page.py"}


def test_nothing_imports_the_pages_script_but_its_own_tests():
    """bench_ddp_transformer.py is the page's code and its main: the trainers' runtime lives in kit/train/, and
    bench_stage.py, the benchmarks, the tests' workers and the tests import it from there. An import of the page's
    script anywhere else, a code string run in a child included (`python -c "import bench_ddp_transformer"`), is one."""
    pattern = re.compile(r"^\s*(?:import\s+bench_ddp_transformer\b|from\s+bench_ddp_transformer\s+import\b)"
                         r"|import [\w., ]*\bbench_ddp_transformer\b", re.M)
    found = [str(p.relative_to(ROOT)) for p in sorted(ROOT.rglob("*.py")) if p != Path(__file__).resolve()
             and not p.relative_to(ROOT).parts[0].startswith(".") and pattern.search(p.read_text())]
    assert set(found) == PAGE_TESTS, f"these import the page's script: {sorted(set(found) - PAGE_TESTS)}"


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
    """The trainers import it before anything else, to hold the stop signals (tests/test_signals.py); idr_torch (the
    standard library and python-hostlist) only inside the handler, when a Ctrl-C asks for the rank."""
    tree = ast.parse((ROOT / "kit" / "train" / "signals.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in top if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= set(sys.stdlib_module_names) | {"__future__"}, names - set(sys.stdlib_module_names)
    inner = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    inner |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert inner - names - {"__future__", "collections.abc"} <= {"idr_torch", "os"}, inner


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


def test_the_page_script_shows_the_pages_code():
    """bench_ddp_transformer.py: after the signals held and the imports, the page's model classes are imported from
    kit/train/transformer.py under the page's names, and the first thing defined is the page's loop (nb_part,
    first_part, last_part, module_list, tmp_list: the Encoder, each Layer, the Decoder), which main() hands to the
    kit's Replica; the Pipe over it with --chunks and its DDP (ddp_mp_model) are the Replica's, in kit/train/."""
    tree = ast.parse((ROOT / "bench_ddp_transformer.py").read_text())
    imported = {a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "kit.train.transformer"
                for a in n.names}
    assert imported == {"Encoder", "Layer", "Decoder"}, imported
    defined = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    loop = defined[0]
    assert loop.name == "build_module_list", [n.name for n in defined]
    assigned = {t.id for n in ast.walk(loop) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    assert {"nb_part", "first_part", "last_part", "module_list", "tmp_list"} <= assigned, assigned
    called = {n.func.id for n in ast.walk(loop) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert {"Encoder", "Layer", "Decoder"} <= called and any(isinstance(n, ast.For) for n in ast.walk(loop)), called
    main = next(n for n in defined if n.name == "main")
    assert "Replica(cfg, plan, engine, own, build_module_list)" in ast.unparse(main)
    replica = ast.unparse(ast.parse((ROOT / "kit" / "train" / "replica.py").read_text()))
    assert "PipeModel(module_list, engine, cfg.chunks" in replica
    assert "self.ddp_mp_model = DistributedDataParallel(self.model)" in replica


# Where the launcher's variables are read: idr_torch alone (its tables: LAUNCHERS, COMMON, ALLOCATION). Any other
# module reading one of them, or any SLURM_*, from the environment (os.environ, os.getenv, a Launch's env) asks
# idr_torch instead; writing them (a child's environment, export_env's own) is not reading. The exceptions, each with
# its reason:
ENV_EXCEPTIONS = {
    ("kit/site_slurm.py", "SLURM_CONF"): "the Slurm commands' own configuration file, which sacctmgr and scontrol read "
                                         "themselves: the live site's cache is keyed by it; not a fact of the launch",
    ("kit/steps.py", "SLURM_EXPORT_ENV"): "a job script's variable as kit.shell's reading holds it at an srun line "
                                          "(launch.env), not this process's environment",
}


def launcher_variables() -> set[str]:
    sys.path.insert(0, str(ROOT))
    import idr_torch
    tables = [*idr_torch.LAUNCHERS.values(), idr_torch.COMMON, idr_torch.ALLOCATION]
    return {v for table in tables for names in table.values() for v in names} | {idr_torch.ELASTIC_RUN}


def environment_reads(path: Path) -> list[tuple[int, str]]:
    """(line, variable) of each read of a named variable from the environment: os.environ.get / [] / in,
    os.getenv, and a Launch's env (`launch.env`)."""
    def environment(node: ast.AST) -> bool:
        text = ast.unparse(node)
        return "environ" in text or text.endswith(".env") or text in ("env", "os.getenv", "getenv")

    def name(node: ast.AST) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
    reads = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and node.args and name(node.args[0]):
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr in ("get", "pop") and environment(func.value)) \
                    or ast.unparse(func) in ("os.getenv", "getenv"):
                reads.append((node.lineno, name(node.args[0])))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and name(node.slice) \
                and environment(node.value):
            reads.append((node.lineno, name(node.slice)))
        elif isinstance(node, ast.Compare) and name(node.left) and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and environment(node.comparators[0]):
            reads.append((node.lineno, name(node.left)))
    return reads


def test_idr_torch_alone_reads_the_launchers_variables():
    """"Rank 0 from the environment" was typed again in four modules, SLURM_CPUS_PER_TASK read in three besides
    idr_torch: each is idr_torch's question now (env_rank, Launch.cpus_asked, allocation(), ...)."""
    variables = launcher_variables()
    assert {"SLURM_PROCID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_CPUS_PER_TASK", "MASTER_ADDR"} <= variables
    files = [*KIT, *(ROOT / name for name in ENTRY if name != "idr_torch.py"),
             *sorted((ROOT / "benchmarks").glob("*.py")), *sorted((ROOT / "slurm").glob("*.py"))]
    found = [(str(p.relative_to(ROOT)), line, var) for p in files for line, var in environment_reads(p)
             if (var in variables or var.startswith("SLURM_"))
             and (str(p.relative_to(ROOT)), var) not in ENV_EXCEPTIONS]
    assert not found, f"read from the environment outside idr_torch (ask idr_torch): {found}"
    for (file, var), why in ENV_EXCEPTIONS.items():  # each exception still exists, or it goes
        assert var in {v for _, v in environment_reads(ROOT / file)}, (file, var, why)


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
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-rs", "-p",
                                "no:cacheprovider", "-m", "core or legacy", "tests"], cwd=ROOT, capture_output=True,
                               text=True, timeout=300)
    files = {line.split("::")[0] for line in collected.stdout.splitlines() if "::" in line}
    # a file skipped whole here (tests/test_zoo_vision.py: its packages import in the 2.14.1 lane only) shows no
    # test to collect; its markers are then read from its text
    skipped = set(re.findall(r"^SKIPPED \[\d+\] (tests/test_\w+\.py):\d+: ", collected.stdout, re.M))
    files |= {f for f in skipped if re.search(r"mark\.(core|legacy)", (ROOT / f).read_text())}
    assert files and files == set(named.stdout.split()), (sorted(files), named.stdout)


# ---- docs/architecture.md true to the import graph ---------------------------------------------------------------------
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def may_import_lists() -> dict[str, list[str]]:
    """docs/architecture.md's "may import" lines: per folder (kit, kit.train), its modules lowest first."""
    text = " ".join(ARCHITECTURE.read_text().split())
    found = {}
    for folder, names in re.findall(r"- may import \((kit/(?:train/)?), lowest first[^)]*\): ([\w, ]+)\.", text):
        package = folder.strip("/").replace("/", ".")
        found[package] = [f"{package}.{n.strip()}" for n in names.split(",")]
    return found


def test_the_architecture_lists_every_module_lowest_first():
    """Each folder's list names each of its modules once, and each module imports, of its own folder, only those
    listed before it (a kit/train/ module any of kit/: kit/ never imports kit/train/, held above)."""
    lists = may_import_lists()
    assert set(lists) == {"kit", "kit.train"}, f"docs/architecture.md: no 'may import' line for {lists.keys()}"
    graph = {name_of(p): kit_imports(p) for p in KIT if p.name != "__init__.py"}
    for package, order in lists.items():
        mine = sorted(m for m in graph if m.rpartition(".")[0] == package)
        assert sorted(order) == mine and len(set(order)) == len(order), (
            f"docs/architecture.md's {package} list: missing {sorted(set(mine) - set(order))}, not modules "
            f"{sorted(set(order) - set(mine))}, twice {sorted({m for m in order if order.count(m) > 1})}")
        for i, module in enumerate(order):
            later = sorted(m for m in graph[module] if m in order[i + 1:] or m == package)
            assert not later, (f"{module} imports {later}, listed after it in docs/architecture.md's {package} "
                               "list: move them before it (or the import down)")


def test_the_architecture_names_the_modules_that_exist():
    """The picture and the 'where a change goes' table name every module of the kit, and no module that is gone
    (a stale name after a move)."""
    text = ARCHITECTURE.read_text()
    modules = {name_of(p) for p in KIT if p.name != "__init__.py"}
    named = set(re.findall(r"\bkit(?:\.train)?\.[a-z_]+\b", text))
    named |= {p.replace("/", ".")[:-3] for p in re.findall(r"\bkit/(?:train/)?[a-z_]+\.py\b", text)}
    named -= {"kit.train"}
    assert not named - modules, f"docs/architecture.md names modules that do not exist: {sorted(named - modules)}"
    picture = text.split("## The picture", 1)[1].split("##", 1)[0]
    shown = set(re.findall(r"\bkit(?:\.train)?\.[a-z_]+\b", picture))
    assert modules <= shown, f"docs/architecture.md's picture lacks {sorted(modules - shown)}"


def test_every_module_says_where_its_tests_are():
    """docs/tests.md's table: a newcomer changing a module finds its tests by name. Every module of the kit and every
    entry point has a row; each file it names exists and one of them names the module; a tests/test_<name>.py is in
    its module's row."""
    text = (ROOT / "docs" / "tests.md").read_text().split("## Where a module's tests are", 1)[1].split("\n## ")[0]
    table = {m: re.findall(r"`(test_\w+\.py)`", files)
             for m, files in re.findall(r"^\| `([\w.]+)` \| (.*) \|$", text, re.M)}
    modules = {name_of(p) for p in KIT if p.name != "__init__.py"} | set(ENTRY)
    assert set(table) == modules, (f"docs/tests.md: no row for {sorted(modules - set(table))}, a row for what is no "
                                   f"module {sorted(set(table) - modules)}")
    for module, files in table.items():
        stem = module[:-3] if module.endswith(".py") else module.rpartition(".")[2]
        missing = [f for f in files if not (ROOT / "tests" / f).is_file()]
        assert files and not missing, f"docs/tests.md: {module}'s tests {missing or 'none'}: no such file in tests/"
        own = ROOT / "tests" / f"test_{stem}.py"
        assert not own.is_file() or own.name in files, f"docs/tests.md: {module}'s row lacks {own.name}"
        said = module[:-3] if module.endswith(".py") else module
        named = [f for f in files if said in (ROOT / "tests" / f).read_text()
                 or said.replace(".", "/") + ".py" in (ROOT / "tests" / f).read_text()]
        assert named, f"docs/tests.md: none of {files} names {said}: is that where its tests are?"

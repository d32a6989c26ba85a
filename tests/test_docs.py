"""Every command shown in README.md and docs/*.md is run, checked, or covered by a named test; a broken one fails.

The commands are read off the Markdown: fenced blocks (```bash, ```sh, ```console: there only the `$ ` lines),
indented code blocks, and inline code that starts with a command word (python, srun, sbatch, make, ...). Each is
classified by classify(), first match wins:
- run on this CPU, where that is cheap: the checker on a job script or a plan (exit 0 or 1, the output shown
  under a `$ ` line is what it prints), a trainer's `--check-args` (its arguments as the trainer reads them),
  a script's `--help` (every option shown is one it has);
- checked: a `make` target exists in the Makefile, a job script given to sbatch exists and the checker accepts it,
  the files a command names exist, srun's and sbatch's options are 22.05's (the checker's own tables), a package
  to install is one the kit's requirements name;
- covered: a test that runs the command for real (a Slurm or multi-process one) is named, and must exist;
- quoted: syntax the prose quotes (`python -c`, `srun [options] CMD`): listed in QUOTED, each with its reason, and
  an entry no document quotes any more fails too, so the list stays the documents' own.
A command that no rule classifies fails, naming its file, line and text.
"""
from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import kit.releases  # noqa: E402  (the repository root, as the other tests import it)
import kit.slurm  # noqa: E402
import checker  # noqa: E402  (tests/checker.py: check_topology.py in this process)
from launch import checker_source  # noqa: E402

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
WORDS = {"python", "python3", "srun", "sbatch", "make", "torchrun", "bash", "sh", "pip", "module", "cp", "cd",
         "scancel", "scontrol", "sacct", "squeue", "sacctmgr", "sinfo", "salloc", "for"}
SCRIPT_WORD = re.compile(r"^(slurm|benchmarks|tests)/[\w.-]+\.sh$")  # a shell script of the kit run by its path
PY = sys.executable


@dataclass
class Command:
    doc: Path
    line: int
    text: str
    shown: list[str] = field(default_factory=list)  # the output a `$ ` line shows under it

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def first_word(text: str) -> str:
    words = text.split()
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value before the command
        words = words[1:]
    if not words:
        return ""
    word = words[0].rsplit("/", 1)[-1] if words[0].endswith(("python", "python3")) else words[0]
    return word


def is_command(text: str) -> bool:
    word = first_word(text)
    return word in WORDS or bool(SCRIPT_WORD.match(word))


def split_and(cmd: Command) -> list[Command]:
    parts = [p.strip() for p in re.split(r"\s&&\s", cmd.text)]
    return [Command(cmd.doc, cmd.line, p, cmd.shown if i == len(parts) - 1 else []) for i, p in enumerate(parts)]


def block_commands(doc: Path, lines: list[tuple[int, str]], console: bool) -> list[Command]:
    """The commands of one code block: its `$ ` lines with the output under them, else (a bash block) every line,
    continuation lines joined; an indented block without `$ ` holds commands only if it starts with one."""
    if any(text.startswith("$ ") for _, text in lines):
        out: list[Command] = []
        for number, text in lines:
            if text.startswith("$ "):
                out.append(Command(doc, number, text[2:].strip()))
            elif out and text.strip():
                out[-1].shown.append(text)
        return out
    if console or not lines or not is_command(lines[0][1]):
        return []
    out, pending = [], None
    for number, text in lines:
        if pending is not None:
            pending.text += " " + text.strip().rstrip("\\").strip()
            if not text.rstrip().endswith("\\"):
                pending = None
            continue
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        out.append(Command(doc, number, text.strip().rstrip("\\").strip()))
        if text.rstrip().endswith("\\"):
            pending = out[-1]
    return out


def read_commands(doc: Path) -> list[Command]:
    lines = doc.read_text().splitlines()
    prose = list(lines)  # the lines outside code blocks, code blanked out, for the inline spans
    found: list[Command] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```\s*([\w-]*)", lines[i])
        if fence:
            lang, body, prose[i] = fence.group(2), [], ""
            i += 1
            while i < len(lines) and not lines[i].strip().startswith("```"):
                body.append((i + 1, lines[i][len(fence.group(1)):]))
                prose[i] = ""
                i += 1
            if i < len(lines):
                prose[i] = ""
            if lang in ("bash", "sh", "shell", "console", ""):
                found += block_commands(doc, body, console=lang == "console")
            i += 1
        elif lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):  # an indented code block
            body = []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append((i + 1, lines[i][4:]))
                prose[i] = ""
                i += 1
            while body and not body[-1][1].strip():
                body.pop()
            found += block_commands(doc, body, console=False)
        else:
            i += 1
    text = "\n".join(prose)
    for m in re.finditer(r"`([^`]+)`", text):  # a span may go on over a line break, never over a blank line
        span = " ".join(m.group(1).split())
        span = span[2:] if span.startswith("$ ") else span
        if "\n\n" not in m.group(1) and len(span.split()) > 1 and is_command(span):
            found.append(Command(doc, text.count("\n", 0, m.start()) + 1, span))
    found.sort(key=lambda c: c.line)
    return [part for cmd in found for part in split_and(cmd)]


COMMANDS = [cmd for doc in DOCS for cmd in read_commands(doc)]


# ---- the rules ------------------------------------------------------------------------------------------------------
# Syntax the prose quotes, not a command to run: the text exactly as written, and why no test runs it.
QUOTED = {
    "bash -c": "a form of launch line the checker's shell reader follows (docs/checker.md, section 3)",
    "srun [options] CMD": "the form of an srun line, options and program left out",
    "bash -c '...'": "a form of launch line the checker's shell reader follows (docs/checker.md, section 3)",
    "module load|add|purge|unload|swap": "the module subcommands the checker reads, not a command",
    "module purge; module load a b": "how the checker reads a module line, with placeholder names",
    "module load pytorch-gpu/py3/X": "the form of the module line, X standing for a release",
    "python [opts] X.py": "a form of launch line the checker recognises",
    "python -m torch.distributed.run": "a form of launch line the checker recognises (torchrun's module)",
    "python -c": "a form of launch line the checker recognises and does not follow",
    "python -": "a form of launch line the checker recognises and does not follow",
    "srun python ...": "a form of launch line, the program left out",
    "python -X importtime": "Python's own import timer, named as a figure's source: no command of the kit",
    "sacctmgr show assoc": "the site's accounting command, named as the source of a Jean Zay fact; it needs Jean Zay",
    "sacctmgr show assoc where user=$USER format=account,partition,qos,defaultqos":
        "the site's accounting command the checker names where its table cannot know a project's grants; needs slurmdbd",
    "sacctmgr show qos format=name,maxwall,maxtrespu,maxtrespa,maxjobspu":
        "the site's accounting command the checker names for a granted QoS's limits; needs slurmdbd",
    "python -c \"import pickle, sys; print(pickle.load(open(sys.argv[1], 'rb')))\" nccl_trace_<job>/rank_0":
        "reads a dump that nccl's flight recorder writes on a GPU; no dump exists without one",
}
# Commands a test runs for real (a Slurm or multi-process one): the pattern, and the test (file::function).
COVERED = [
    (r"^scontrol show (config|partition --oneliner)$",
     "tests/test_site_live.py::test_live_partitions_agree_with_sbatch"),
    (r"^sacctmgr -nP show (qos|assoc) ", "tests/test_site_live.py::test_a_read_is_cached_per_user_and_configuration"),
    (r"^srun\b.*\bpython check_topology\.py\b", "tests/test_launch_slurm.py::test_the_step_check_is_the_file_check"),
    (r"^python check_topology\.py$", "tests/test_launch_slurm.py::test_the_step_check_is_the_file_check"),
    (r"^srun\b.*\btorchrun\b", "tests/test_launch_slurm.py::test_srun_torchrun_workers_are_the_checkers_plan"),
    (r"^scancel\b", "tests/test_templates_slurm.py::test_scancel_then_a_new_submission_resumes"),
    (r"^scontrol requeue\b", "tests/test_templates_slurm.py::test_time_limit_signal_requeues_and_resumes"),
    (r"^slurm/submit_sweep\.sh\b", "tests/test_templates_slurm.py::test_sweep_submit_is_one_job_for_every_count"),
    (r"^slurm/sweep_steps\.sh\b", "tests/test_templates_slurm.py::test_sweep_runs_every_count_as_a_step_of_one_job"),
    (r"^slurm/sweep_local\.sh\b", "tests/test_sweep_report.py::test_local_sweep_end_to_end"),
    (r"^python tests/local_slurm\.py (start|stop)\b",
     "tests/test_templates_slurm.py::test_cluster_stops_without_leftovers"),
    (r"^srun\b.*\bpython benchmarks/speed_profile\.py\b",
     "tests/test_speed.py::test_the_profile_holds_what_the_model_reads"),
    (r"^MODE=predict sbatch\b", "tests/test_templates_slurm.py::test_sweep_predict_mode_measures_the_predicted_best"),
]
# A placeholder in a command, and what the test runs in its place.
PLACEHOLDERS = {"job.slurm": "slurm/page_3nodes_4gpus.slurm"}
TRAINERS = ("bench_ddp_transformer.py", "bench_stage.py")


def words(text: str) -> list[str]:
    """The command's words as the shell splits them; <a placeholder> is one word, [an optional part] is given."""
    text = re.sub(r"<[^<>]*>", "PLACEHOLDER", text)
    text = re.sub(r"\[([^\[\]]*)\]", r"\1", text)
    out = shlex.split(text, comments=True)
    if out and out[0].endswith(("/python", "/python3")) or out[:1] == ["python3"]:
        out[0] = "python"
    return [PLACEHOLDERS.get(w, w) for w in out]


def run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def assert_shows(cmd: Command, output: str) -> None:
    """Each line shown under the command is in what it prints now (wrapped lines too: whitespace is collapsed)."""
    printed = " ".join(output.split())
    for line in cmd.shown:
        text = " ".join(line.split())
        if text and text != "...":
            assert text in printed, (f"{cmd.where}: `{cmd.text}` no longer prints\n  {line.strip()}\n"
                                     f"It prints:\n{output}")


def script_path(name: str) -> Path:
    """A job script as a command names it: from the kit's folder, or copied from slurm/ to $WORK as the README says."""
    for path in (ROOT / name, ROOT / "slurm" / name):
        if path.is_file():
            return path
    raise AssertionError(f"no job script {name} (looked in the kit's folder and slurm/)")


def run_checker(cmd: Command, args: list[str]) -> None:
    args = [str(script_path(a).relative_to(ROOT)) if a.endswith((".slurm", ".sbatch")) else a for a in args]
    r = checker.run_checker(*args, cwd=ROOT)  # the verdict and what it prints: in this process (tests/checker.py)
    out = r.stdout + r.stderr
    assert r.returncode in (0, 1) and "Traceback" not in out, f"{cmd.where}: `{cmd.text}` exits {r.returncode}:\n{out}"
    assert out.startswith("check_topology"), f"{cmd.where}: `{cmd.text}` printed no report:\n{out}"
    assert_shows(cmd, out)


def run_trainer(cmd: Command, script: str, args: list[str]) -> None:
    """--help as given; anything else through the trainer's own --check-args, with as many tasks as --pp asks."""
    if "--help" not in args and "-h" not in args and "--check-args" not in args:
        args = [*args, "--check-args"]
    env = {}
    if "--pp" in args:
        n = args[args.index("--pp") + 1]
        env = {"WORLD_SIZE": n, "LOCAL_WORLD_SIZE": n, "RANK": "0", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "docs",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # never connected to: --check-args stops before
    r = run([PY, script, *args], env)
    out = r.stdout + r.stderr
    assert "Traceback" not in out, f"{cmd.where}: `{cmd.text}`:\n{out}"
    if cmd.shown:
        assert r.returncode != 0 or not any("error" in line for line in cmd.shown), out
        assert_shows(cmd, out)
    else:
        assert r.returncode == 0, f"{cmd.where}: `{cmd.text}` exits {r.returncode}:\n{out}"


def literals(path: Path) -> set[str]:
    return {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


def check_script_args(cmd: Command, script: str, args: list[str]) -> None:
    """A script the test does not run (a benchmark, a GPU check): it exists, and every option and word the command
    gives it is one the script's source has (its argparse options, its modes)."""
    path = ROOT / script
    assert path.is_file(), f"{cmd.where}: `{cmd.text}`: no {script}"
    known = literals(path)
    for w in args:
        if w == "PLACEHOLDER" or re.fullmatch(r"[\d.]+", w) or "/" in w or re.search(r"\.\w+$", w):
            continue  # a number, or a path the user gives
        option = w.split("=")[0]
        assert option in known, f"{cmd.where}: `{cmd.text}`: {script} has no {option}"


def check_pytest(cmd: Command, args: list[str]) -> None:
    for w in args:
        if w.startswith("tests/"):
            assert (ROOT / w.split("::")[0]).is_file(), f"{cmd.where}: `{cmd.text}`: no {w}"


def check_python(cmd: Command, ws: list[str]) -> None:
    if ws[1:3] == ["-m", "pytest"]:
        return check_pytest(cmd, ws[3:])
    if ws[1] == "-m" and ws[2].startswith("kit."):  # a module of the kit run as a program: it runs, or says why not
        assert (ROOT / (ws[2].replace(".", "/") + ".py")).is_file(), f"{cmd.where}: `{cmd.text}`: no module {ws[2]}"
        r = run([PY, *ws[1:]])
        assert r.returncode in (0, 1) and "Traceback" not in r.stderr, f"{cmd.where}: `{cmd.text}`:\n{r.stderr}"
        return None
    script, args = ws[1], ws[2:]
    if script == "check_topology.py":
        return run_checker(cmd, args)
    if script in TRAINERS:
        return run_trainer(cmd, script, args)
    return check_script_args(cmd, script, args)


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    found = set(re.findall(r"^([\w%-]+)\s*:(?!=)", text, re.M))
    return found | {t.replace("%", "") for t in found if "%" in t}


def check_make(cmd: Command, ws: list[str]) -> None:
    text = (ROOT / "Makefile").read_text()
    for w in ws[1:]:
        if "=" in w:
            assert re.search(rf"\b{re.escape(w.split('=')[0])}\b", text), f"{cmd.where}: the Makefile has no {w}"
        else:
            assert w in makefile_targets(), f"{cmd.where}: `{cmd.text}`: the Makefile has no target {w}"


def check_options(cmd: Command, options: list[str], long: dict[str, str], short: dict[str, str]) -> None:
    """Every option is one Slurm 22.05's command has (check_topology's tables, which a test compares with the man
    pages)."""
    for w in options:
        if w.startswith("--"):
            name = w[2:].split("=")[0]
            assert name in long or name in kit.slurm.ALIASES, f"{cmd.where}: `{cmd.text}`: {w} is not an option of 22.05"
        elif w.startswith("-") and len(w) > 1:
            assert w[1] in short, f"{cmd.where}: `{cmd.text}`: {w} is not an option of 22.05"


def split_slurm(ws: list[str], long: dict[str, str], short: dict[str, str]) -> tuple[list[str], list[str]]:
    """srun/sbatch's options, and the program after them."""
    i = 1
    while i < len(ws) and ws[i].startswith("-"):
        w = ws[i]
        takes = (long.get(w[2:], "n") == "r" and "=" not in w) if w.startswith("--") else (
            len(w) == 2 and w[1] in short and long.get(short[w[1]]) == "r")
        i += 2 if takes else 1
    return ws[1:i], ws[i:]


# The templates a Slurm test submits for real on the local cluster; every template in slurm/ also goes through
# `sbatch --test-only` there (tests/test_templates_slurm.py::test_templates_pass_both_checks).
SUBMITTED = {"page_3nodes_4gpus.slurm": "tests/test_templates_slurm.py::test_page_three_node_template_runs",
             "first_run.slurm": "tests/test_first_run.py::test_first_run_on_one_node",
             "sweep_4gpus.slurm": "tests/test_templates_slurm.py::test_sweep_runs_every_count_as_a_step_of_one_job"}


def check_sbatch(cmd: Command, ws: list[str]) -> None:
    """sbatch's options are 22.05's; the job script is one of slurm/'s templates, the checker accepts it, and the
    Slurm tests submit it (for real where SUBMITTED names the test, else with --test-only)."""
    options, rest = split_slurm(ws, kit.slurm.SBATCH_LONG, kit.slurm.SBATCH_SHORT)
    check_options(cmd, options, kit.slurm.SBATCH_LONG, kit.slurm.SBATCH_SHORT)
    if rest:
        script = script_path(rest[0])
        assert script.parent == ROOT / "slurm", f"{cmd.where}: `{cmd.text}`: not one of slurm/'s templates"
        r = checker.run_checker(str(script.relative_to(ROOT)), cwd=ROOT)
        assert r.returncode == 0, f"{cmd.where}: `{cmd.text}`: the checker refuses {rest[0]}:\n{r.stdout}{r.stderr}"
        covered(SUBMITTED.get(script.name, "tests/test_templates_slurm.py::test_templates_pass_both_checks"))


def check_srun(cmd: Command, ws: list[str]) -> None:
    options, rest = split_slurm(ws, kit.slurm.SRUN_LONG, kit.slurm.SRUN_SHORT)
    check_options(cmd, options, kit.slurm.SRUN_LONG, kit.slurm.SRUN_SHORT)
    if rest and rest[0] == "python" and len(rest) > 1 and rest[1] in TRAINERS:
        run_trainer(cmd, rest[1], rest[2:])
    else:  # options alone (quoted from the prose), or a program the prose names as a placeholder
        assert not rest or rest[0] in ("...", "CMD"), f"{cmd.where}: `{cmd.text}`: no rule for srun {rest[0]}"


def check_module(cmd: Command, ws: list[str]) -> None:
    assert ws[1] in ("load", "purge"), f"{cmd.where}: `{cmd.text}`"
    source = checker_source()
    for name in ws[2:]:
        if name.startswith("pytorch"):
            assert kit.releases.torch_version_of(name), f"{cmd.where}: the checker reads no torch release in {name}"
        else:
            assert name in source, f"{cmd.where}: the checker knows no module {name}"


def check_pip(cmd: Command, ws: list[str]) -> None:
    assert ws[1] == "install", f"{cmd.where}: `{cmd.text}`"
    required = {re.split(r"[<>=]", line)[0].strip().lower() for line in (ROOT / "requirements.txt").read_text()
                .splitlines() if line.strip() and not line.startswith("#")}
    pin = re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text()).group(0)
    args = [w for i, w in enumerate(ws[2:]) if not w.startswith("-") and not ws[1 + i].startswith("--index")]
    for w in args:
        if w.startswith("torch=="):
            assert w == pin, f"{cmd.where}: `{cmd.text}`: the Makefile pins {pin}"
        else:
            assert w.lower() in required, f"{cmd.where}: `{cmd.text}`: {w} is not in requirements.txt"


def check_files(cmd: Command, paths: list[str]) -> None:
    for w in paths:
        if not w.startswith("$"):
            assert (ROOT / w).exists(), f"{cmd.where}: `{cmd.text}`: no {w} in the kit"


def check_loop(cmd: Command) -> None:
    m = re.fullmatch(r"for (\w+) in ([^;]+); do (.+); done", cmd.text)
    assert m, f"{cmd.where}: `{cmd.text}`: a loop the test does not read"
    for value in m.group(2).split():
        body = Command(cmd.doc, cmd.line, m.group(3).replace("$" + m.group(1), value))
        check(body)


def covered(test: str) -> None:
    path, name = test.split("::")
    tree = ast.parse((ROOT / path).read_text())
    assert any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body), f"no test {test}"


def classify(cmd: Command):
    """The check for one command, or None when no rule knows it."""
    if cmd.text in QUOTED:
        return lambda: None
    for pattern, test in COVERED:
        if re.search(pattern, cmd.text):
            return lambda: covered(test)
    if cmd.text.startswith("for "):
        return lambda: check_loop(cmd)
    try:
        ws = words(cmd.text)
    except ValueError:
        return None
    env = [w for w in ws if re.match(r"^[A-Z_][A-Z0-9_]*=", w)]
    ws = ws[len(env):] if ws[:len(env)] == env else ws
    if not ws:
        return None
    rules = {
        "python": lambda: check_python(cmd, ws) if len(ws) > 1 else None,
        "make": lambda: check_make(cmd, ws),
        "sbatch": lambda: check_sbatch(cmd, ws),
        "srun": lambda: check_srun(cmd, ws),
        "module": lambda: check_module(cmd, ws),
        "pip": lambda: check_pip(cmd, ws),
        "cp": lambda: check_files(cmd, [w for w in ws[1:-1] if not w.startswith("-")]),
        "bash": lambda: check_files(cmd, ws[1:2]),
        "cd": lambda: None if len(ws) == 2 and ws[1].startswith("$") else check_files(cmd, ws[1:]),
    }
    if ws[0] not in rules or (ws[0] == "python" and len(ws) == 1):
        return None
    return rules[ws[0]]


def check(cmd: Command) -> None:
    rule = classify(cmd)
    assert rule, (f"{cmd.where}: `{cmd.text}`: no rule of tests/test_docs.py runs or checks this command; add one "
                  "(classify(), COVERED, or QUOTED with the reason)")
    rule()


# ---- the tests ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{c.where} {c.text[:50]}" for c in COMMANDS])
def test_every_command_in_the_docs_works(cmd: Command):
    check(cmd)


def test_the_docs_hold_the_users_path():
    """The commands are found at all (the reader is not blind), and a Jean Zay user meets sbatch on the first
    screen of the README."""
    readme = [c for c in COMMANDS if c.doc.name == "README.md"]
    assert len(readme) > 10 and {"make run", "make test"} <= {c.text.split("#")[0].strip() for c in readme}
    first = min(c.line for c in readme if c.text.startswith("sbatch "))
    assert first <= 50, f"README.md: the first sbatch command is on line {first}, past the first screen"


def test_quoted_and_covered_are_the_documents_own():
    """Every QUOTED entry is still quoted somewhere, and every COVERED test exists."""
    texts = {c.text for c in COMMANDS}
    assert set(QUOTED) <= texts, f"QUOTED entries no document quotes any more: {sorted(set(QUOTED) - texts)}"
    for test in [t for _, t in COVERED] + list(SUBMITTED.values()):
        covered(test)


@pytest.mark.parametrize("text", [
    "python check_topology.py slurm/no_such_template.slurm",      # a script that is gone
    "python check_topology.py --nodes 3 --gpus-per-nod 4",         # an option the checker does not have
    "python bench_ddp_transformer.py --check-args --nlayer 4",    # nor the trainer
    "make no-such-target",
    "sbatch slurm/no_such_template.slurm",
    "srun --gpus-per-taks=1 python bench_stage.py",
    "pip install --user hostlist",
    "cp bench_ddp_transformer.py no_such_file.py $WORK/",
    "rsync -a kit/ $WORK/",                                        # a command no rule knows
])
def test_a_broken_command_fails(text):
    with pytest.raises(AssertionError):
        check(Command(ROOT / "README.md", 1, text))


def test_a_changed_output_fails():
    cmd = Command(ROOT / "README.md", 1, "python check_topology.py slurm/page_3nodes_4gpus.slurm",
                  ["  => OK: 0 error(s), 7 warning(s)"])
    with pytest.raises(AssertionError, match="no longer prints"):
        check(cmd)


def test_the_compatibility_table_has_its_file():
    """`make compat-check` and `make compat-table` name the file that holds the table's markers."""
    sys.path.insert(0, str(ROOT / "tests"))
    import compat_table
    text = (ROOT / "Makefile").read_text()
    files = set(re.findall(r"compat_table\.py \$\(COMPAT\) --(?:check|write) (\S+)", text))
    assert files == {"docs/releases.md"}
    _, _, rows = compat_table.readme_rows((ROOT / "docs" / "releases.md").read_text(), "docs/releases.md")
    assert {"2.3.1", "2.13.0"} <= set(rows)

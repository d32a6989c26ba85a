"""One definition of the trainers' arguments (check_topology.ARGS): the checker's verdict on a trainer line is the
trainer's own.

The property: a generated trainer line (abbreviations, unknown options, '_' for '-', '=' and space forms, values
out of range or not dividing, both scripts), put in a job script the checker reads, gets from the checker the
refusals that each task of that job gets from the trainer's --check-args (check_topology.check_args, which the
scripts' --check-args runs: test_check_args_is_the_scripts_own shows it on real processes, and
test_check_args_says_what_the_trainer_says shows --check-args says what the trainer itself says).
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import check_topology as ct
import kit.arguments
import kit.checks
import kit.findings
import kit.jobscript
import kit.trainer_checks
from launch import ROOT, clean_env, srun_envs

SCRIPTS = kit.arguments.SCRIPTS
TASKS = {"replica": 2, "stage": 4}  # the job's tasks on its one node of 4 GPUs
TORCH = kit.trainer_checks.installed_torch_version()
# Nothing wrong in the job but what its trainer line says: no -C/-p (the GPU's memory unknown: no fit to judge), the
# installed torch's module (so the checker knows the release the trainer refuses things for).
HEADER = ("#!/bin/bash\n#SBATCH -N 1 --ntasks-per-node={tasks} --gres=gpu:4 -c 10 --hint=nomultithread -t 1:00:00\n"
          f"module load pytorch-gpu/py3/{TORCH.split('+')[0]}\n")
# What the checker calls a refusal of the torch release, from the job script's module line
RELEASE = {"engine-unavailable": "torch-release", "torch-too-old": "torch-release"}
# Codes whose message names the task (each task of the job gets its own; the checker says the first)
PER_TASK = {"gpu-index-past-visible", "devices-count", "more-tasks-than-gpus"}
# What only the checker sees: two tasks of a node naming the same GPUs with --devices (nccl refuses it at the first
# collective, after start-up; one task alone cannot know what the others chose)
CHECKER_ONLY = {"gpu-shared"}


def task_envs(layout: str) -> list[dict[str, str]]:
    """Every task of the job as srun starts it: SLURM_* and the node's 4 GPUs visible to each task."""
    return [dict(env, CUDA_VISIBLE_DEVICES="0,1,2,3", SLURM_GPUS_ON_NODE="4") for env in srun_envs(TASKS[layout])]


def checker(layout: str, argv: list[str], folder: Path) -> tuple[int, list[kit.findings.Finding]]:
    """The checker on a job script whose trainer line is `argv`: its exit status and findings, the line's
    location taken off their messages."""
    path = folder / "job.slurm"
    path.write_text(HEADER.format(tasks=TASKS[layout]) + f"srun python {SCRIPTS[layout]} {shlex.join(argv)}\n")
    job, training, findings = kit.jobscript.read_sbatch(path)
    report = kit.checks.check_job(job, training)
    report.findings[:0] = findings
    out = [kit.findings.Finding(f.level, f.code, re.sub(r"^job\.slurm:\d+: ", "", f.message)) for f in report.findings]
    line = {"unknown-argument", "bad-argument", "bad-layout", "bad-engine", "bad-schedule"}
    errors = [f for f in out if f.level == "error"]
    status = 2 if any(f.code in line for f in findings if f.level == "error") else 1 if errors else 0
    return status, out


def trainer(layout: str, argv: list[str]) -> list[tuple[int, kit.findings.Findings]]:
    """Every task's --check-args verdict (its status and findings)."""
    return [kit.trainer_checks.check_args(layout, argv, env)[:2] for env in task_envs(layout)]


def compare(layout: str, argv: list[str], folder: Path) -> None:
    status, found = checker(layout, argv, folder)
    tasks = trainer(layout, argv)
    refused = [f for _, fs in tasks for f in fs.errors]
    errors = [f for f in found if f.level == "error"]
    if status == 2:  # the trainer stops at its line; the checker also judges the job's module, whatever the line
        errors = [f for f in errors if f.code not in RELEASE]
    mine = {f.code for f in errors} - CHECKER_ONLY
    theirs = {RELEASE.get(f.code, f.code) for f in refused}
    assert {RELEASE.get(c, c) for c in mine} == theirs, (argv, [str(f) for f in errors], [str(f) for f in refused])
    assert max(s for s, _ in tasks) == status or (status == 1 and {f.code for f in errors} <= CHECKER_ONLY), argv
    if status == 2:  # the line itself: the same refusals, in the same words and order
        assert [(f.code, f.message) for f in errors] == [(f.code, f.message) for f in tasks[0][1].errors]
    same_words = {(f.code, f.message) for f in errors if f.code not in PER_TASK | set(RELEASE) | CHECKER_ONLY}
    assert same_words == {(f.code, f.message) for f in refused if f.code not in PER_TASK | {"torch-release"}}


# ---- generated lines ---------------------------------------------------------------------------------------------
def flags_of(layout: str) -> list[kit.arguments.Arg]:
    # --model and --sample name files of Python to run: tests/test_own_model_train.py gives them real ones
    return [a for a in kit.arguments.ARGS if layout in a.layouts and a.group not in ("mode", "own")]


SMALL = {"nlayers": (1, 20), "chunks": (1, 12), "batch_size": (1, 96), "nb_part": (1, 6), "pp": (1, 6),
         "virtual_stages": (1, 4), "d_model": (2, 40), "n_head": (1, 8)}  # where dividing or not is likely


def good_value(a: kit.arguments.Arg) -> st.SearchStrategy[str]:
    if a.choices:
        return st.sampled_from(a.choices)
    if a.kind is kit.arguments.gpu_indices:
        return st.lists(st.integers(0, 4), min_size=1, max_size=5).map(lambda d: ",".join(map(str, d)))
    if a.kind is int:
        lo, hi = SMALL.get(a.dest, (a.lo, min(a.hi, a.lo + 50)))
        return st.integers(int(lo), int(hi)).map(str)
    if a.kind is float:
        return st.floats(a.lo, a.hi, exclude_min=a.lo_open, exclude_max=a.hi_open, allow_nan=False).map(repr)
    return st.sampled_from(["/tmp/x", "data", "out.jsonl"])


def bad_value(a: kit.arguments.Arg) -> st.SearchStrategy[str]:
    edges = [str(x) for x in (a.lo, a.hi) if x is not None]
    outside = [str(a.lo - 1)] if a.lo is not None and a.kind is int else []
    outside += [str(a.hi + 1), str(10 * a.hi)] if a.hi is not None and a.kind is int else []
    outside += ["nan", "inf", "-inf", "1e999"] if a.kind is float else []
    return st.sampled_from(edges + outside + ["", "abc", "1.5", "0x10", "2 3", "-1", "999999999", "4,x"])


def option(layout: str) -> st.SearchStrategy[list[str]]:
    """One argument as users write it: right, with a bad value, or with a mangled name."""
    @st.composite
    def one(draw) -> list[str]:
        a = draw(st.sampled_from(flags_of(layout)))
        kind = draw(st.sampled_from(["good"] * 5 + ["bad", "abbrev", "underscore", "typo", "other", "switch=",
                                                    "novalue"]))
        value = draw(bad_value(a) if kind == "bad" else good_value(a))
        flag = a.flag
        if kind == "abbrev":
            flag = flag[:draw(st.integers(3, len(flag) - 1))]
        elif kind == "underscore":
            flag = "--" + a.flag[2:].replace("-", "_")
        elif kind == "typo":
            i = draw(st.integers(2, len(flag) - 1))
            flag = flag[:i] + flag[i + 1:] if draw(st.booleans()) else flag[:i] + flag[i] + flag[i:]
        elif kind == "other":
            flag = draw(st.sampled_from([b.flag for b in kit.arguments.ARGS if layout not in b.layouts] + ["--layout"]))
        if a.kind is None and kind != "switch=":
            return [flag]
        if kind == "novalue":
            return [flag]
        if kind == "switch=" and a.kind is None:
            return [f"{flag}=1"]
        return [f"{flag}={value}"] if draw(st.booleans()) else [flag, value]
    return one()


def line(layout: str) -> st.SearchStrategy[list[str]]:
    stray = st.sampled_from([["extra"], ["--"], ["-x"], ["--foo", "1"], ["8"]])
    parts = st.lists(st.one_of(option(layout), option(layout), option(layout), stray), max_size=6)
    return parts.map(lambda ps: [t for p in ps for t in p])


CI = os.environ.get("CI") == "true"


def test_the_checker_refuses_what_the_trainer_refuses(tmp_path):
    lines = set()

    @settings(max_examples=380 if CI else 600, derandomize=CI, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.sampled_from(["replica", "stage"]).flatmap(lambda layout: st.tuples(st.just(layout), line(layout))))
    def judge(case):
        layout, argv = case
        lines.add((layout, tuple(argv)))
        compare(layout, argv, tmp_path)

    judge()
    assert len(lines) >= 300, len(lines)  # distinct lines judged
    print(f"{len(lines)} distinct trainer lines")


@pytest.mark.parametrize("layout,argv", [
    ("replica", ["--batch", "256"]), ("replica", ["--batch_size", "32"]), ("replica", ["--nlayers", "999999999"]),
    ("replica", ["--d-model", "30", "--n-head", "4"]), ("replica", ["--d-model", "33", "--n-head", "3"]),
    ("replica", ["--chunks", "6", "--batch-size", "64"]), ("replica", ["--nb-part", "3"]),
    ("replica", ["--nlayers", "2", "--nb-part", "4"]), ("replica", ["--devices", "0,1", "--nb-part", "2"]),
    ("replica", ["--engine", "torch-pipe"]), ("replica", ["--lr", "nan", "--timeout", "0", "--seed", "-1"]),
    ("replica", ["--layout", "stage", "--pp", "4"]), ("replica", ["--zero=1"]), ("replica", ["--epochs"]),
    ("stage", ["--pp", "3"]), ("stage", ["--pp", "1"]), ("stage", ["--pp", "4", "--chunks", "2"]),
    ("stage", ["--schedule", "interleaved1f1b", "--chunks", "6"]), ("stage", ["--nb-part", "2"]),
    ("stage", ["--precision", "fp16"]), ("stage", ["--virtual-stages", "0"]),
])
def test_hand_picked_lines(tmp_path, layout, argv):
    compare(layout, argv, tmp_path)


# ---- --check-args is the scripts' own, and says what the trainer says --------------------------------------------
def in_process(layout: str, argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = kit.trainer_checks.check_args_main(layout, argv, env)
    return status, out.getvalue(), err.getvalue()


def run_script(layout: str, argv: list[str], env: dict[str, str], check: bool = True) -> tuple[int, str, str]:
    r = subprocess.run([sys.executable, str(ROOT / SCRIPTS[layout]), *(["--check-args"] if check else []), *argv],
                       env=env, capture_output=True, text=True, timeout=120)
    err = "".join(line + "\n" for line in r.stderr.splitlines() if not line.startswith("idr_torch:"))
    return r.returncode, r.stdout, err


@settings(max_examples=12, derandomize=True, deadline=None)
@given(st.sampled_from(["replica", "stage"]).flatmap(lambda layout: st.tuples(st.just(layout), line(layout))))
def test_check_args_is_the_scripts_own(case):
    """`python bench_*.py --check-args LINE` (a real process, task 0 of the job) prints and exits as the in-process
    check_args_main that the property test judges."""
    layout, argv = case
    env = task_envs(layout)[0]
    assert run_script(layout, argv, env) == in_process(layout, argv, env), argv


@pytest.mark.parametrize("layout,argv,status", [
    ("replica", ["--batch", "256"], 2),
    ("replica", ["--d-model", "30", "--n-head", "4"], 1),
    ("stage", ["--pp", "3"], 1),
])
def test_check_args_says_what_the_trainer_says(tmp_path, layout, argv, status):
    """The trainer itself (torch imported, no GPU here) refuses the line with the words and status of --check-args."""
    env = clean_env()
    check = run_script(layout, [*argv, "--cache-dir", str(tmp_path)], env)
    real = run_script(layout, [*argv, "--cache-dir", str(tmp_path)], env, check=False)
    assert real[0] == check[0] == status and real[2] == check[2], (real, check)
    assert check[2].startswith(f"{SCRIPTS[layout][:-3]}: error: ") and check[2].count("\n") == 1


def test_check_args_imports_no_torch(tmp_path):
    """--check-args stops before `import torch`: with a torch that cannot be imported first on the path, it still
    judges the line (the release read from torch/version.py)."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('--check-args imported torch')\n")
    (fake / "version.py").write_text("__version__ = '2.13.0'\n")  # a release that runs both layouts
    for layout, argv in (("replica", ["--nlayers", "8"]), ("stage", ["--pp", "2", "--schedule", "gpipe"])):
        env = dict(srun_envs(TASKS[layout])[0], PYTHONPATH=str(tmp_path))
        status, out, err = run_script(layout, argv, env)
        assert status == 0 and "would start" in out, err
    env = clean_env(PYTHONPATH=str(tmp_path))
    assert run_script("replica", ["--nlayers", "8"], env, check=False)[0] == 1  # the trainer itself does import it


# ---- the definition ------------------------------------------------------------------------------------------------
def test_every_default_is_in_its_range_and_the_views_agree():
    for a in kit.arguments.ARGS:
        for default in {a.gpu, a.cpu_default} - {None}:
            if a.kind is not None:
                assert a.convert(str(default)) == (default, None), a.flag
    assert kit.arguments.GPU_DEFAULTS == {a.dest: a.gpu for a in kit.arguments.ARGS if a.group == "model"}
    assert kit.arguments.CPU_DEFAULTS["nlayers"] == 4 and kit.arguments.GPU_DEFAULTS["nlayers"] == 16
    assert kit.arguments.Training().pp == kit.arguments.ARG["pp"].gpu and kit.arguments.Training().schedule == kit.arguments.ARG["schedule"].gpu
    for layout in SCRIPTS:  # the help of both trainers builds, from the one definition
        text = kit.arguments.trainer_parser(layout, "doc").format_help()
        assert all(a.flag in text for a in kit.arguments.ARGS if layout in a.layouts)


@pytest.mark.parametrize("argv,needle", [
    (["--nlayers", "999999999"], "--nlayers 999999999 must be an integer from 1 to 1024"),
    (["--lr", "nan"], "--lr nan must be a number above 0 and at most 10"),
    (["--lr=-inf"], "--lr -inf must be a number above 0"),
    (["--timeout", "0"], "--timeout 0 must be a number above 0"),
    (["--seed", "-1"], "--seed -1 must be an integer from 0 to 9223372036854775807"),
    (["--max-steps", "-1"], "--max-steps -1 must be an integer from 0 to 1000000000 (0: no limit)"),
    (["--dropout", "1"], "--dropout 1 must be a number at least 0 and below 1"),
    (["--workers", "-2"], "--workers -2 must be an integer from -1 to 64"),
    (["--vocab-size", "2"], "--vocab-size 2 must be an integer from 3"),
    (["--batch", "256"], "--batch is not an option of bench_ddp_transformer.py: did you mean --batch-size?"),
    (["--batch_size", "32"], "did you mean --batch-size? (options are written with '-', not '_')"),
    (["--d", "8"], "did you mean --d-model or --d-hid or --dropout or --devices?"),
    (["--nlayer", "8"], "did you mean --nlayers?"),
    (["--pp", "2"], "bench_ddp_transformer.py has no --pp"),
    (["--epochs"], "--epochs needs a value, e.g. --epochs 3"),
    (["--zero=yes"], "--zero is a switch and takes no value"),
    (["--engine", "pipe"], "--engine 'pipe' is not one of auto, torch-pipe, fairscale"),
])
def test_refusals_name_the_value_and_the_fix(argv, needle):
    with pytest.raises(kit.arguments.ArgumentError) as exc:
        kit.arguments.parse_trainer_args("replica", argv)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_a_dollar_is_text_to_the_trainer():
    """bash expanded the line before the trainer sees it: a '$' left in a value is the value's own."""
    assert kit.arguments.parse_trainer_args("replica", ["--save", "$WORK/x.pt"]).save == "$WORK/x.pt"
    with pytest.raises(kit.arguments.ArgumentError, match=r"--nlayers '\$N' must be an integer"):
        kit.arguments.parse_trainer_args("replica", ["--nlayers", "$N"])


def test_the_checkers_own_flags_come_from_the_definition(capsys):
    assert ct.main(["--nodes", "1", "--gpus-per-node", "4", "--ntasks-per-node", "2", "--batch", "64"]) == 2
    assert "--batch is not an option of check_topology.py: did you mean --batch-size?" in capsys.readouterr().err
    assert ct.main(["--nodes", "1", "--gpus-per-node", "4", "--ntasks-per-node", "2", "--nlayers", "999999999"]) == 2
    assert "--nlayers 999999999 must be an integer from 1 to 1024" in capsys.readouterr().err
    assert ct.main(["--nodes", "1", "--gpus-per-node", "4", "--ntasks-per-node", "2", "--nlayers", "8",
                    "--chunks", "8", "--d-model", "30", "--n-head", "4"]) == 1
    assert "--d-model (30) must be a multiple of --n-head (4)" in capsys.readouterr().out


# ---- shell variables: what they may hold is unknown, never judged as the defaults --------------------------------
V100_16 = ("#!/bin/bash\n#SBATCH -C v100-16g -N 1 --ntasks-per-node={tpn} --gres=gpu:4 -c 10 --hint=nomultithread "
           "-t 1:00:00\n")


def check_line(tmp_path: Path, trainer_line: str, tpn: int = 4, *cli: str) -> tuple[int, str,
                                                                                    list[kit.findings.Finding]]:
    path = tmp_path / "job.slurm"
    path.write_text(V100_16.format(tpn=tpn) + trainer_line + "\n")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = ct.main([str(path), *cli, "--json"])
    import json
    data = json.loads(out.getvalue())
    return status, out.getvalue(), [kit.findings.Finding(**f) for f in data["findings"]]


def codes(findings: list[kit.findings.Finding]) -> set[str]:
    return {f.code for f in findings}


def test_the_defaults_would_not_fit_here(tmp_path):
    status, _, found = check_line(tmp_path, "srun python bench_ddp_transformer.py")
    assert status == 1 and "does-not-fit" in codes(found)  # the GPU defaults, nb_part 1, on a 16 GB V100


@pytest.mark.parametrize("variable", ["$ARGS", '"$@"', "${ARGS[@]}", "$EXTRA_ARGS"])
def test_a_variable_alone_may_hold_any_argument(tmp_path, variable):
    status, _, found = check_line(tmp_path, f"srun python bench_ddp_transformer.py {variable}")
    assert status == 0 and not codes(found) & {"does-not-fit", "pipeline-bubble", "nlayers-below-nb-part"}
    [warning] = [f for f in found if f.code == "unchecked-argument"]
    name = shlex.split(variable)[0]
    assert f"{name} may hold any of bench_ddp_transformer.py's arguments" in warning.message
    assert "the fit in memory" in warning.message and "no default is judged in its place" in warning.message


def test_a_variable_as_a_value_hides_that_value_only(tmp_path):
    line = "srun python bench_ddp_transformer.py --nlayers 3 --nb-part 4 --chunks ${CHUNKS[$SLURM_ARRAY_TASK_ID]}"
    status, _, found = check_line(tmp_path, line, tpn=1)
    assert status == 1 and "nlayers-below-nb-part" in codes(found)  # known: still judged
    assert not codes(found) & {"does-not-fit", "pipeline-bubble", "chunks-not-dividing-batch"}
    [warning] = [f for f in found if f.code == "unchecked-argument"]
    assert "--chunks ${CHUNKS[$SLURM_ARRAY_TASK_ID]} is a shell variable" in warning.message
    assert "the pipeline bubble" in warning.message and "--chunks dividing --batch-size" in warning.message
    status, _, found = check_line(tmp_path, "srun python bench_ddp_transformer.py --nlayers=$N --nb-part 2", tpn=2)
    assert "--nlayers $N is a shell variable" in [f for f in found if f.code == "unchecked-argument"][0].message
    assert not codes(found) & {"does-not-fit", "nlayers-below-nb-part", "nlayers-not-multiple"}


def test_a_path_in_a_variable_is_not_news(tmp_path):
    """Paths are nobody's check: $DSDIR/IMDB or $SCRATCH/ckpt.pt as a value says nothing is unchecked."""
    line = "srun python bench_ddp_transformer.py --nlayers 16 --nb-part 4 --chunks 16 --batch-size 32 " \
           "--data-dir $DSDIR/IMDB --save=$SCRATCH/ckpt.pt --activation-checkpointing"
    status, _, found = check_line(tmp_path, line, tpn=1)
    assert status == 0 and "unchecked-argument" not in codes(found), found


def test_what_comes_after_a_variable_is_known(tmp_path):
    """bash's order is argparse's: an option after the variable wins over whatever the variable holds."""
    _, _, after = check_line(tmp_path, "srun python bench_ddp_transformer.py $ARGS --nlayers 3 --nb-part 4", tpn=1)
    _, _, before = check_line(tmp_path, "srun python bench_ddp_transformer.py --nlayers 3 --nb-part 4 $ARGS", tpn=1)
    assert "nlayers-below-nb-part" in codes(after) and "nlayers-below-nb-part" not in codes(before)


def test_the_command_line_says_what_the_variable_holds(tmp_path):
    line = "srun python bench_ddp_transformer.py $ARGS"
    status, _, found = check_line(tmp_path, line, 4, "--nlayers", "16", "--chunks", "4", "--batch-size", "64")
    assert status == 1 and "does-not-fit" in codes(found)  # now judged: what the user said it holds
    status, _, found = check_line(tmp_path, line, 4, "--nlayers", "16", "--activation-checkpointing")
    assert status == 0 and "does-not-fit" not in codes(found)


def test_a_refused_line_is_not_judged_further(tmp_path):
    status, _, found = check_line(tmp_path, "srun python bench_ddp_transformer.py --batch 8 --chunks 3")
    assert status == 1 and codes(found) & {"unknown-argument"}
    assert not codes(found) & {"does-not-fit", "chunks-not-dividing-batch", "pipeline-bubble"}


# ---- docs/arguments.md lists the definition as it is -----------------------------------------------------------
def doc_row(a: kit.arguments.Arg) -> str:
    """One argument's row in docs/arguments.md's table, from ARGS."""
    kind = "switch" if a.kind is None else "GPU list" if a.kind is kit.arguments.gpu_indices else a.kind.__name__
    where = ", ".join(kit.arguments.SCRIPTS[layout] for layout in a.layouts) if len(a.layouts) == 1 else "both"
    show = (lambda v: "-" if v is None else "off" if v is False else f"`{kit.arguments.show_value(v)}`")
    if a.choices:
        values = " ".join(f"`{c}`" for c in a.choices)
    elif a.lo is not None:
        values = a.range_text().split(" ", 2)[2] + (f" ({a.why})" if a.why else "")
    else:
        values = a.range_text() if a.kind is kit.arguments.gpu_indices else "-"
    values = values.replace("<", "&lt;").replace(">", "&gt;")
    return f"| `{a.flag}` | {where} | {kind} | {show(a.gpu)} | {show(a.cpu_default)} | {values} |"


def test_the_docs_table_is_the_definition():
    text = (ROOT / "docs" / "arguments.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `--")]
    assert rows == [doc_row(a) for a in kit.arguments.ARGS]

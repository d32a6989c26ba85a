"""Modern job scripts (issue 40): the checker's verdict on each case of tests/job_cases.py against what the real Slurm
did with it (measured by tests/test_jobs_slurm.py), the crash it once had, and that no job script makes it print a
traceback: an unexpected exception in a check is one finding (exit 2) and the other checks still run."""
from __future__ import annotations

import json
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kit.allocation
import kit.arguments
import kit.checks
import kit.jobscript
import kit.slurm
import kit.steps
from kit.findings import CATCHES
from checker import run_checker
from job_cases import CASES, NAME, verdict_problems

CI = os.environ.get("CI") == "true"


def check(folder, text: str, *extra: str) -> tuple[int, dict]:
    """The checker's command line on a script, in this process: (exit status, the --json report)."""
    path = folder / NAME
    path.write_text(text)
    r = run_checker("--json", "--site", "jean-zay", str(path), *extra)
    return r.returncode, json.loads(r.stdout)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_checker_agrees_with_slurm(tmp_path, case):
    """Refused with sbatch's words, pending with squeue's reason, or, for a job that ran, an error naming each step
    (and array element) that failed and none on a step that ran, each probed step placed task by task as Slurm
    placed it, and the warnings the case needs."""
    code, report = check(tmp_path, case.script)
    assert not verdict_problems(case, case.fate, report), (verdict_problems(case, case.fate, report),
                                                           [f"{f['code']}: {f['message']}" for f in report["findings"]])
    assert code == (1 if any(f["level"] == "error" for f in report["findings"]) else 0)


CRASH = """#!/bin/bash
#SBATCH -p gpu_p6 -C h100 --gres=gpu:4 --cpus-per-gpu=24 -t 1:00:00
srun -c 48 python {program}
"""


@pytest.mark.parametrize("program", ["bench_ddp_transformer.py --nlayers 8 --chunks 8", "train.py"])
def test_cpus_per_gpu_with_srun_c_is_two_tasks_not_a_crash(tmp_path, program):
    """The crash of issue 40 (ZeroDivisionError: the allocation counted as 0 cores): 4 GPUs x 24 = 96 cores, and
    `srun -c 48` without -n runs 2 tasks (measured); with another program, no false 'holds 0 of its cores'."""
    code, report = check(tmp_path, CRASH.format(program=program))
    errors = [f for f in report["findings"] if f["level"] == "error"]
    assert code == 0 and not errors, errors
    assert report["job"]["cores_per_node"] == [96], report["job"]["cores_per_node"]
    if program.startswith("bench"):
        assert [(t["node"], t["nb_part"]) for t in report["tasks"]] == [(0, 2), (0, 2)]


def test_the_allocation_of_a_cpus_per_gpu_job(monkeypatch):
    """`python check_topology.py` in the batch step of a --cpus-per-gpu job, with the variables the test cluster's
    batch step had (measured: SLURM_TASKS_PER_NODE holds the cores there, 96): one task a node (what a plain srun
    runs), 96 cores, no false 'cpus-per-task-missing'."""
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_CPUS_PER_GPU": "24",
           "SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_GPUS": "0,1,2,3", "SLURM_JOB_CPUS_PER_NODE": "96",
           "SLURM_TASKS_PER_NODE": "96", "SLURM_JOB_PARTITION": "gpu_p6", "SLURM_MEM_PER_GPU": "10240"}
    job = kit.allocation.job_from_allocation(env)
    assert (job.cpus_per_gpu, job.mem_per_gpu, job.cores_per_node, job.tasks_per_node) == (24, 10240, [96], None)
    report = kit.checks.check_job(job, kit.arguments.Training(nlayers=8, chunks=16))
    assert [t.nb_part for t in report.tasks] == [4], report.tasks
    assert not {"cpus-per-task-missing", "cpus-per-task-small"} & {f.code for f in report.findings}, report.findings


def test_a_check_that_raises_is_one_finding_and_the_others_run(tmp_path, monkeypatch):
    """An unexpected exception in a check (here the bubble's, and the batch shell's reading of one command) is one
    internal-error finding naming the script's line and asking for a report, exit 2; the other checks still give
    their findings, and the launch lines around it are still read."""
    def check_bubble(*args, **kwargs):
        raise ValueError("a bug planted by the test")
    monkeypatch.setattr(kit.checks, "check_bubble", check_bubble)
    monkeypatch.setattr(kit.jobscript, "read_batch_shell",
                        lambda ran, name, job: check_bubble() if ran.line == 4 else None)
    code, report = check(tmp_path, "#!/bin/bash\n#SBATCH -N 1 --ntasks-per-node=2 --gres=gpu:4 -C v100-32g -t 60\n"
                                   "srun python bench_ddp_transformer.py --nlayers 8 --chunks 2\necho one\n"
                                   "srun -n 1 -c 1 python bench_ddp_transformer.py --nlayers 3\n")
    internal = {int(f["message"].split(":")[1]): f["message"] for f in report["findings"]
                if f["code"] == "internal-error"}
    assert code == 2 and sorted(internal) == [3, 4, 5], report["findings"]  # each trainer line's bubble, the echo
    assert "check_bubble" in internal[3] and "a bug planted by the test" in internal[3] and "please report" in internal[3]
    assert "ValueError" in internal[4]
    codes = {f["code"] for f in report["findings"]}
    assert {"hint-missing", "cpus-per-task-missing", "nlayers-below-nb-part"} <= codes, codes  # the others ran
    assert [s["where"] for s in report["steps"]] == [f"{NAME}:5"]


def test_four_gpu_nodes_never_plan_or_advise_eight(tmp_path):
    """--gres=gpu:8 on the 4-GPU nodes: sbatch refuses it with its own words; the plan, every finding and every fix
    speak of the node's 4 GPUs, never of 8 (issue 40's false findings)."""
    code, report = check(tmp_path, "#!/bin/bash\n#SBATCH -N 1 --ntasks-per-node=1 --gres=gpu:8 -C v100-32g -c 10 "
                                   "--hint=nomultithread -t 60\nsrun -c 10 python bench_ddp_transformer.py "
                                   "--nlayers 8 --chunks 32 --batch-size 64\n")
    text = " ".join(f["message"] for f in report["findings"] if f["code"] != "gpus-exceed-node")
    [exceed] = [f["message"] for f in report["findings"] if f["code"] == "gpus-exceed-node"]
    assert "'Requested node configuration is not available'" in exceed and "use --gres=gpu:4" in exceed
    assert report["job"]["gpus_per_node"] == 4 and {t["nb_part"] for t in report["tasks"]} == {4}
    assert "gpu:8" not in text and "8 GPU" not in text, text


def test_an_array_too_long_to_read_says_which_elements_it_checked(tmp_path):
    """Elements past the 128 read one by one are said unchecked, in one warning; the reading stays bounded."""
    start = time.process_time()
    code, report = check(tmp_path, "#!/bin/bash\n#SBATCH -N 1 --ntasks-per-node=4 --gres=gpu:4 -C v100-32g -c 10 "
                                   "--hint=nomultithread -t 60 --array=0-299\nsrun -c 10 python "
                                   "bench_ddp_transformer.py --nlayers $((SLURM_ARRAY_TASK_ID % 7 + 1))\n")
    assert time.process_time() - start < 10
    [partly] = [f["message"] for f in report["findings"] if f["code"] == "array-partly-checked"]
    assert "300 elements" in partly and "elements 0-127" in partly and "other 172" in partly, partly
    assert report["job"]["elements"] and sum(len(e) for e in report["job"]["elements"]) == 128
    assert code == 0, report["findings"]  # 8 layers and fewer on nb_part 1: nothing an element refuses


def test_an_array_does_not_multiply_a_costly_reading(tmp_path):
    """A script whose reading spends the shell's whole budget is not read again for each of 1000 elements: the
    reading stops after the first such element and says so."""
    start = time.process_time()
    code, report = check(tmp_path, "#!/bin/bash\n#SBATCH -N 1 --gres=gpu:4 --array=0-999\n"
                                   "srun bash -c 'f() { f; f; f; f; f; f; f; f; }; f'\nsrun python t.py $SLURM_ARRAY_TASK_ID\n")
    assert time.process_time() - start < 5
    codes = [f["code"] for f in report["findings"]]
    assert "too-complex" in codes and "array-partly-checked" in codes and "internal-error" not in codes, codes


def test_many_large_trainer_lines_stay_bounded(tmp_path, monkeypatch):
    """Every trainer line is planned, but not without end: past kit.steps.MAX_PLANNED_TASKS tasks planned in all
    (32768: ten lines of 20000 tasks would cost ten plans and their --json) the later lines are said unplanned
    (too-complex). Here with a bound of 40 and lines of 24 tasks, so that the test stays cheap."""
    monkeypatch.setattr(kit.steps, "MAX_PLANNED_TASKS", 40)
    code, report = check(tmp_path, "#!/bin/bash\n#SBATCH -p gpu_p6 -C h100 --gres=gpu:4 --ntasks=24\n" + "".join(
        f"srun python bench_ddp_transformer.py --nlayers {n}\n" for n in range(4, 14)))
    [cut] = [f["message"] for f in report["findings"] if f["code"] == "too-complex"]
    assert cut.startswith(f"{NAME}:5: ") and len(report["steps"]) == 1, (cut, len(report["steps"]))


# -- no job script makes the checker print a traceback --

ODD = st.one_of(st.integers(-3, 70000).map(str), st.sampled_from(
    ["", "0", "x", "=2", "a b", "'q", "$X", "%j", "1(x2)", "-1", "1-0", "none", "ALL", "gpu:v100:2", "5-1", "1-3:0",
     "singelton", "B:USR3", "arbitrary", "10G", "nomultithreads"]))
# values each option takes in real scripts (the checker's paths past the value checks), beside odd ones
GOOD = {
    "nodes": "1 2 3 1-2", "ntasks": "1 2 4 6 8 12", "ntasks-per-node": "1 2 3 4 8", "cpus-per-task": "1 4 10 24 48",
    "gres": "gpu:1 gpu:2 gpu:4 gpu:8", "gpus-per-node": "1 2 4 8", "gpus-per-task": "1 2", "gpus": "1 4 6 8",
    "cpus-per-gpu": "4 10 16 24 30", "mem-per-gpu": "8G 1000", "mem": "4G", "constraint": "v100-32g h100 a100",
    "partition": "gpu_p13 gpu_p6 gpu_p5 gpu_p2 cpu_p1 prepost", "distribution": "cyclic plane=2 block plane=3 "
    "cyclic:block", "gpu-bind": "none closest map_gpu:0,1 single:1 per_task:1", "hint": "nomultithread "
    "multithread compute_bound", "signal": "B:USR1@300 USR1@60 B:TERM B:KILL@10 B:URG", "export": "NONE ALL "
    "PATH,HOME HOME", "array": "1-4 0-3%2 0-8:4 5 1-200", "dependency": "singleton afterok:12 afterany:3?afterok:4",
    "time": "1:00:00 20:00:00 100:00:00", "qos": "qos_gpu-t3 qos_gpu_h100-t4 qos_gpu-gc", "account": "abc@v100 "
    "abc@h100", "threads-per-core": "1 2", "ntasks-per-gpu": "1 2", "het-group": "0 1 0,1 2", "nodelist": "node1"}
OPTIONS = sorted(set(kit.slurm.SBATCH_LONG) - {"help", "usage", "version", "wrap", "test-only", "parsable"})
SRUN_OPTIONS = sorted(set(kit.slurm.SRUN_LONG) - {"help", "usage", "version", "test-only"})
SRUN_USUAL = ["nodes", "ntasks", "cpus-per-task", "ntasks-per-node", "het-group", "distribution", "export",
              "gpus-per-task", "cpus-per-gpu", "gpu-bind"]


def option(draw, name: str, table: dict) -> str:
    """--name, with a value it takes in real scripts or an odd one."""
    if table[name] == "n":
        return f"--{name}"
    usual = GOOD.get(name)
    value = draw(st.sampled_from(usual.split()) if usual and draw(st.integers(0, 3)) else ODD)
    return f"--{name}={value}"


@st.composite
def job_scripts(draw) -> str:
    """A job script with #SBATCH lines of any option the kit's tables know (a hetjob line among them), then shell
    lines that run srun with any of srun's options, the kit's trainers, other launchers, arrays' indices, traps."""
    header = draw(st.sampled_from([[], ["#SBATCH -N 2 --ntasks-per-node=4 --gres=gpu:4 -C v100-32g -c 10"],
                                   ["#SBATCH -p gpu_p6 -C h100 --gres=gpu:4 --cpus-per-gpu=24"]]))
    for _ in range(draw(st.integers(0, 8))):
        if draw(st.integers(0, 12)) == 0:
            header.append("#SBATCH hetjob")
        names = st.sampled_from(sorted(set(GOOD) & set(OPTIONS)) if draw(st.booleans()) else OPTIONS)
        header.append(f"#SBATCH {option(draw, draw(names), kit.slurm.SBATCH_LONG)}")
    body = []
    for _ in range(draw(st.integers(0, 4))):
        names = st.lists(st.sampled_from(SRUN_USUAL if draw(st.booleans()) else SRUN_OPTIONS), max_size=3)
        srun = " ".join(option(draw, n, kit.slurm.SRUN_LONG) for n in draw(names))
        program = draw(st.sampled_from(
            ["python bench_ddp_transformer.py", "python bench_stage.py", "torchrun --nproc_per_node=gpu train.py",
             "python train.py", "hostname", "bash -c 'python bench_ddp_transformer.py --nlayers $SLURM_PROCID'"]))
        args = draw(st.sampled_from(["", "--nlayers $SLURM_ARRAY_TASK_ID", "--pp 2 --chunks 3", "--chunks 0",
                                     "--nb-part 3 --batch-size 7", "--schedule interleaved1f1b --pp 3",
                                     "--nlayers ${L[$SLURM_ARRAY_TASK_ID]}"]))
        srun_word = draw(st.sampled_from(["srun", "srun", "", "exec srun", "srun -c $SLURM_CPUS_PER_TASK"]))
        body.append(f"{srun_word} {srun} {program} {args}".strip() + draw(st.sampled_from(["", " &"])))
    body += draw(st.sampled_from([[], ["trap 'echo' USR1"], ["scontrol requeue $SLURM_JOB_ID"], ["L=(1 2 3)"],
                                  ["export SLURM_EXPORT_ENV=ALL"], ["wait"]]))
    return "#!/bin/bash\n" + "\n".join(header + body) + "\n"


@settings(max_examples=40 if CI else 150, deadline=None, derandomize=CI,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(job_scripts())
def test_no_job_script_makes_the_checker_fail(tmp_path, text):
    """Whatever the options and their values: --json always parses, no internal-error finding (a check's exception
    is caught as one, but none should happen), exit 0 or 1, and a bounded time (CPU seconds, not wall time)."""
    start = time.process_time()
    code, report = check(tmp_path, text)
    assert time.process_time() - start < 5, text
    internal = [f["message"] for f in report["findings"] if f["code"] == "internal-error"]
    assert not internal and code in (0, 1), (internal, text)
    assert report["ok"] == (code == 0) and all(f["code"] in CATCHES for f in report["findings"]), report["findings"]

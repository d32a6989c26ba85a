"""kit/jobscript.py: job scripts as users write them, the kit's and others' (tests/sbatch/scripts/): what the checker
finds in each, the launch lines it reads, huge numbers and odd files (how it runs the shell: tests/test_shell.py; what
the real Slurm and launchers do with the same lines: tests/test_launch_slurm.py).

Each script in tests/sbatch/scripts/ says in its header comments what the checker must find, exactly:
    # expect: code code ...   (or none)        the finding codes, no more, no fewer
    # exit: 0|1
    # layout: 4,4                               processes per node of the kit's plan, or of the first launch line
    # note: text                                a note that must be printed
    # slurm: accepted | refused <message>       sbatch --test-only on the test cluster (tests marked slurm)
"""
from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kit.checks
import kit.findings
import kit.jobscript
import kit.plan
import kit.shell
import kit.slurm
from checker import run_checker
from launch import ROOT

SCRIPTS = sorted((Path(__file__).resolve().parent / "sbatch" / "scripts").glob("*.slurm"))


def header(path: Path) -> dict:
    text = path.read_text()
    get = lambda key: re.search(rf"^# {key}: (.*)$", text, re.M)  # noqa: E731
    return {"expect": set(get("expect").group(1).split()) - {"none"}, "exit": int(get("exit").group(1)),
            "layout": get("layout").group(1).strip() if get("layout") else None,
            "notes": re.findall(r"^# note: (.*)$", text, re.M), "slurm": get("slurm").group(1)}


def check(path: Path, *extra: str) -> tuple[int, dict]:
    """The checker's command line, in this process (the same main() the script runs)."""
    r = run_checker("--json", str(path), *extra)
    return r.returncode, json.loads(r.stdout)


def layout(report: dict) -> str:
    """Processes per node: of the kit's plan, else of the script's first launch line."""
    if report["tasks"]:
        nodes = [t["node"] for t in report["tasks"]]
        return ",".join(str(nodes.count(n)) for n in sorted(set(nodes)))
    laid = [x["layout"]["processes_per_node"] for x in report["job"]["launches"]
            if x["layout"].get("processes_per_node")]
    return ",".join(map(str, laid[0])) if laid else ""


def test_the_corpus_is_large_enough():
    kit = [p for p in SCRIPTS if "bench_ddp_transformer.py" in p.read_text() or "bench_stage.py" in p.read_text()]
    assert len(SCRIPTS) - len(kit) >= 40 and len(kit) >= 10, (len(SCRIPTS), len(kit))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_each_script_gets_exactly_its_findings(path):
    want = header(path)
    code, report = check(path)
    found = {f["code"] for f in report["findings"]}
    assert found == want["expect"], [f"{f['code']}: {f['message']}" for f in report["findings"]]
    assert code == want["exit"]
    if want["layout"]:
        assert layout(report) == want["layout"], report["job"]["launches"] or report["tasks"]
    for note in want["notes"]:
        assert any(note in n for n in report["notes"]), report["notes"]
    kit = report["job"]["trainer"] is not None
    training_note = [n for n in report["notes"] if n.startswith("training not checked")]
    assert len(training_note) == (0 if kit else 1), report["notes"]  # said once, and only without the kit's trainer
    if not kit:  # nothing about the kit's model for another program
        assert not found & {"pipeline-bubble", "does-not-fit", "memory-tight", "nlayers-below-nb-part",
                            "chunks-above-batch", "chunks-not-dividing-batch", "gpus-not-divisible", "gpu-shared"}
        assert not any(n.startswith("memory estimate") for n in report["notes"])
    for f in report["findings"]:  # every finding names a number or a place, and says what to do
        assert re.search(r"\d", f["message"]), f


# ---- what the launch line is ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("line,launcher,program,srun", [
    ("srun -N 2 python -u train.py --a 1", "python", "train.py", True),
    ("exec time srun python3 -W ignore train.py", "python", "train.py", True),
    ("OMP_NUM_THREADS=1 env A=b srun torchrun --nproc_per_node=4 t.py", "torchrun", "t.py", True),
    ("python -m torch.distributed.run --nproc-per-node 4 --standalone t.py", "torchrun", "t.py", False),
    ("python -m torch.distributed.launch --use_env --nproc_per_node=2 t.py", "torchrun", "t.py", False),
    ("deepspeed --num_gpus 4 --master_port 29501 t.py --deepspeed", "deepspeed", "t.py", False),
    ("accelerate launch --multi_gpu --num_processes 8 t.py", "accelerate", "t.py", False),
    ("srun singularity exec --nv img.sif python t.py", "python", "t.py", True),
    ("srun bash -c 'torchrun --nproc_per_node 2 t.py'", "torchrun", "t.py", True),
    ("srun ./run.sh", "program", "run.sh", True),
])
def test_launch_lines(line, launcher, program, srun):
    found: list = []
    shell = kit.shell.ShellRun({}, None)
    shell.sink = lambda r: found.extend(kit.jobscript.find_launches(r, "x", kit.findings.Findings(), shell=shell))
    shell.run_script(line)
    [launch] = found
    assert (launch.launcher, launch.program, launch.srun is not None) == (launcher, program, srun)


@pytest.mark.parametrize("line", ["cp train.py $JOBSCRATCH/", "echo python train.py", "module load python",
                                  "python -c 'print(1)'", "ls *.py"])
def test_lines_that_launch_nothing(line):
    found: list = []
    shell = kit.shell.ShellRun({}, None)
    shell.sink = lambda r: found.extend(kit.jobscript.find_launches(r, "x", kit.findings.Findings(), shell=shell))
    shell.run_script(line)
    assert found == []


# ---- huge numbers and odd files: one line, fast, bounded memory (issue 22, item 7) ------------------------------------
def limited(args: list[str], stdin=None) -> subprocess.CompletedProcess:
    """The checker with 1 GiB of address space and 30 s: a request that made it grow or spin fails here."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 ** 30, 2 ** 30))
    return subprocess.run([sys.executable, str(ROOT / "check_topology.py"), *args], capture_output=True, text=True,
                          timeout=30, preexec_fn=cap, stdin=stdin)


@pytest.mark.parametrize("directive,words", [
    ("--nodes=999999999", "--nodes=999999999"), ("--gres=gpu:99999999999999999999999", "--gres=gpu:"),
    ("-n 999999999", "--ntasks=999999999"), ("--ntasks-per-node=99999", "--ntasks-per-node=99999"),
])
def test_huge_counts_in_a_script(tmp_path, directive, words):
    script = tmp_path / "huge.slurm"
    script.write_text(f"#!/bin/bash\n#SBATCH {directive} --gres=gpu:4 -t 1:00:00\nsrun python train.py\n")
    out = limited([str(script)])
    errors = [line for line in out.stdout.splitlines() if line.strip().startswith("ERROR")]
    assert out.returncode == 1 and len(errors) == 1 and "count-too-large" in errors[0], out.stdout + out.stderr
    assert words in errors[0]


@pytest.mark.parametrize("flags", [["--nodes", "999999999", "--gpus-per-node", "4"],
                                   ["--nodes", "2", "--gpus-per-node", "99999999999999999999999"],
                                   ["--advise", "--nodes", "999999999", "-C", "v100-32g", "--global-batch", "64"]])
def test_huge_planning_flags(flags):
    out = limited(flags)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "more than" in out.stderr, out


def test_odd_files(tmp_path):
    fifo = tmp_path / "job.fifo"
    os.mkfifo(fifo)
    for path, needle in ((fifo, "is empty"), (Path("/dev/zero"), "character device"), (tmp_path, "a directory")):
        out = limited([str(path)])
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and needle in out.stderr, out
    big = tmp_path / "big.slurm"
    big.write_text("#!/bin/bash\n#SBATCH -N 1\n" + "# padding\n" * 500_000 + "srun python t.py\n")
    out = limited([str(big), "--json"])
    assert out.returncode == 1 and [f["code"] for f in json.loads(out.stdout)["findings"]] == ["script-too-large"]
    nul = tmp_path / "nul.slurm"
    nul.write_bytes(b"#!/bin/bash\n\0\0\0")
    assert [f["code"] for f in json.loads(limited([str(nul), "--json"]).stdout)["findings"]] == ["not-a-script"]


def test_a_pipe_is_read(tmp_path):
    text = "#!/bin/bash\n#SBATCH -N 1 --ntasks-per-node=1 --gres=gpu:4 -C v100-32g -c 40 --hint=nomultithread -t 1:0:0\n"
    text += "srun -c 40 python train.py\n"
    reader, writer = os.pipe()
    os.write(writer, text.encode())
    os.close(writer)
    out = limited(["/dev/stdin"], stdin=reader)
    os.close(reader)
    assert out.returncode == 0 and "training not checked" in out.stdout, out.stdout + out.stderr


VALUES = ["", "0", "1", "4", "-1", "x", "2-3", "gpu:4", "gpu:x:2", "map_gpu:0,1", "per_task:2", "mask_gpu:0x3",
          "cyclic", "plane=2", "USR1@60", "1:00:00", "abc@v100", "qos_gpu-t4", "a100", "v100-32g|h100", "$X",
          "99999999999999999999", "closest", "none", "nomultithread", "END,FAIL", "100G"]


@settings(max_examples=80 if os.environ.get("CI") == "true" else 400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(sorted(kit.slurm.SBATCH_LONG)), st.sampled_from(VALUES)), max_size=6),
       st.sampled_from(["srun python t.py", "srun -c 4 torchrun --nproc_per_node=gpu t.py",
                        "python -m torch.distributed.run --nnodes 2:4 t.py", "srun python bench_ddp_transformer.py",
                        "accelerate launch --num_processes 3 t.py", "deepspeed --num_nodes 3 t.py"]))
def test_any_request_is_judged_without_crashing(tmp_path, options, launch):
    """Whatever the options and values, one report: findings, never a traceback."""
    script = tmp_path / "any.slurm"
    script.write_text("#!/bin/bash\n" + "".join(f"#SBATCH --{n}={shlex_quote(v)}\n" if v else f"#SBATCH --{n}\n"
                                                for n, v in options) + launch + "\n")
    job, training, findings = kit.jobscript.read_sbatch(script)
    report = kit.checks.check_job(job, training)
    assert isinstance(report.text(), str) and json.dumps(report.as_dict())


def shlex_quote(value: str) -> str:
    import shlex
    return shlex.quote(value)


@pytest.mark.parametrize("gpn,workers,nodes", [(4, 1, 2), (4, 2, 2), (4, 4, 1), (8, 2, 2), (8, 4, 3), (4, 3, 1)])
def test_torchrun_workers_idr_torch_and_the_checker_agree(tmp_path, gpn, workers, nodes):
    """The environment torchrun gives each worker (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, as
    tests/test_launch_slurm.py saw them for real) inside an srun task that sees the node's GPUs: the plan idr_torch
    makes from it (what the trainer runs) is the checker's plan of the script, worker by worker."""
    import idr_torch
    script = tmp_path / "tr.slurm"
    script.write_text(f"#!/bin/bash\n#SBATCH -N {nodes} --ntasks-per-node=1 --gres=gpu:{gpn} -c 8\n"
                      f"srun -c 8 torchrun --nnodes {nodes} --nproc_per_node {workers} --rdzv_backend c10d "
                      "--rdzv_endpoint h:1 bench_ddp_transformer.py --nlayers 12\n")
    job, training, _ = kit.jobscript.read_sbatch(script)
    report = kit.checks.check_job(job, training)
    mine = []
    for node in range(nodes):
        for local in range(workers):
            env = {"TORCHELASTIC_RUN_ID": "1", "RANK": str(node * workers + local), "LOCAL_RANK": str(local),
                   "WORLD_SIZE": str(nodes * workers), "LOCAL_WORLD_SIZE": str(workers), "GROUP_RANK": str(node),
                   "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpn))), "SLURM_PROCID": str(node),
                   "SLURM_STEP_ID": "0", "SLURM_NODEID": str(node), "SLURM_GPUS_ON_NODE": str(gpn)}
            launch = idr_torch.Launch(env)
            plan = kit.plan.plan_task(launch.rank, launch.node_id, launch.local_rank, launch.local_world_size,
                                launch.visible_gpus, launch.gpus_on_node, 12)
            mine.append((plan.rank, plan.node, plan.local_rank, plan.nb_part, plan.devices))
    assert mine == [(t.rank, t.node, t.local_rank, t.nb_part, t.devices) for t in report.tasks]
    if gpn % workers:
        assert "gpus-not-divisible" in {f.code for f in report.findings}

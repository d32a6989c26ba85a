"""slurm/first_run.slurm end to end on the local Slurm cluster (CPU, gloo: the fake GPUs give the 4-GPU layout, the
trainers fall back to the CPU), and its report on runs that failed the ways a GPU node fails."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import ROOT, clean_env, copy_kit

sys.path.insert(0, str(ROOT / "slurm"))
import first_run_report  # noqa: E402

EXTRA = ("benchmarks", "slurm/first_run.slurm", "slurm/first_run_report.py", "slurm/report.py")


@pytest.mark.slurm
def test_first_run_on_one_node(slurm_cluster, tmp_path):
    """Every count of tasks a 4-GPU node allows, the stage layout, the GPU benchmarks (not run: no GPU here), one
    report, exit 0."""
    copy_kit(tmp_path, EXTRA)
    # the CPU defaults, given: the pre-flight check would judge the GPU defaults, which the CPU fallback does not run
    env = clean_env(**slurm_cluster.env, STEPS="4", MODEL="--nlayers 4 --d-model 64 --n-head 4 --d-hid 128 "
                    "--seq-len 64 --vocab-size 2000 --chunks 2 --batch-size 32",
                    PROFILE_OPTIONS="--max-micro 8 --repeats 2 --precisions fp32")
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["BASH_FUNC_module%%"] = "() {  :\n}"  # `module` is a no-op, as if Lmod had loaded PyTorch
    r = subprocess.run(["sbatch", "--wait", "--parsable", "slurm/first_run.slurm"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=1200)
    job = r.stdout.strip().split(";")[0]
    folder = tmp_path / f"first_run_{job}"
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(folder.glob("*.log")))
    out = (tmp_path / f"first_run_{job}.out").read_text() if job else ""
    assert r.returncode == 0, f"sbatch: {r.stderr}\n{out[-3000:]}\n{logs}"
    status = {name: code for name, code, _ in first_run_report.read_status(folder)}
    assert status == {"check_replica_1x4": 0, "replica_1x4": 0, "check_replica_2x2": 0, "replica_2x2": 0,
                      "check_replica_4x1": 0, "replica_4x1": 0, "check_stage": 0, "stage": 0, "profile": 0,
                      "gpu_check": 2, "memory_gpu": 2}, status
    assert (folder / "steps.txt").read_text().split() == list(status)  # the plan, written before the first step
    runs = [json.loads(line) for line in (folder / "runs.jsonl").read_text().splitlines()]
    got = sorted((x["layout"], x["tasks_per_node"], x["nb_part"]) for x in runs)
    assert got == [("replica", 1, 4), ("replica", 2, 2), ("replica", 4, 1), ("stage", 4, 2)], got  # pp 2
    assert {x["job_id"] for x in runs} == {job} and all(x["samples_per_s"] for x in runs)
    report = (folder / "report.md").read_text()
    assert report in out  # the job's log ends with it
    for run in ("replica_1x4", "replica_2x2", "replica_4x1", "stage"):
        assert re.search(rf"^\| {run} \| \d \| .+ \| \d+\.\d \| - \| (-|[\d.]+) \| ok \|$", report, re.M), report
    assert "`gpu_check`: not run: no CUDA GPU" in report and "`memory_gpu`: not run: no CUDA GPU" in report
    assert "11 step(s), 0 failed: every run ran" in report
    # the profile's step, and the splits it ranks first, in the report (fastest first, samples/s and terms)
    assert f"`profile`: first_run_{job}/profile.json" in report and "fastest first, by the samples/s" in report
    # each run's tasks got the cores the step asked (-c): 40 cores of the node / tasks
    asked = sorted(set(re.findall(r"^\++ srun --ntasks-per-node=(\d) -n \d -c (\d+) python bench",
                                  (tmp_path / f"first_run_{job}.err").read_text(), re.M)))
    assert asked == [("1", "40"), ("2", "20"), ("4", "10")], asked


def write_run(folder: Path, name: str, code: int, tasks: int, log: str) -> None:
    folder.mkdir(exist_ok=True)
    with open(folder / "status.tsv", "a") as f:
        f.write(f"{name}\t{code}\t{tasks}\n")
    (folder / f"{name}.log").write_text(log)


def test_report_names_the_first_error_and_its_cause(tmp_path):
    folder = tmp_path / "first_run_9"
    write_run(folder, "check_replica_1x4", 0, 1, "=> OK\n")
    write_run(folder, "replica_1x4", 0, 1, "summary: ...\n")
    with open(folder / "runs.jsonl", "w") as f:
        f.write(json.dumps({"layout": "replica", "tasks_per_node": 1, "nb_part": 4, "replicas": 1, "pp": None,
                            "samples_per_s": 812.5, "peak_gpu_mem_gb": 6.1, "estimated_mem_gb": 7.5}) + "\n")
    write_run(folder, "replica_2x2", 1, 2, "bench_ddp_transformer: error: task 1 lost contact with the others\n"
              "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    write_run(folder, "replica_4x1", 1, 4, "NCCL WARN Duplicate GPU detected : rank 0 and rank 1 both on CUDA "
              "device 1a000\nRuntimeError: ncclInvalidUsage\n")
    write_run(folder, "check_stage", 1, 4, "  ERROR   more-tasks-than-gpus: task 3 ...\n")
    write_run(folder, "gpu_check", 2, 1, "gpu_check: error: no CUDA GPU here (torch 2.8.0)\n")
    text, failed = first_run_report.report(folder)
    assert failed == 3
    assert re.search(r"^\| replica_1x4 \| 1 \| 1 replica\(s\) x nb_part 4 \| 812\.5 \| 6\.10 \| 7\.50 \(0\.81 of it\) "
                     r"\| ok \|$", text, re.M), text
    row = next(line for line in text.splitlines() if line.startswith("| replica_2x2"))
    assert "CUDA out of memory" in row and "does not fit" in row and "lost contact" not in row.split("cause")[0]
    row = next(line for line in text.splitlines() if line.startswith("| replica_4x1"))
    assert "Duplicate GPU detected" in row and "two tasks of one node on one GPU" in row
    assert "pre-flight check refused" in next(line for line in text.splitlines() if line.startswith("| check_stage"))
    assert "`gpu_check`: not run: no CUDA GPU" in text and "6 step(s), 3 failed" in text
    r = subprocess.run([sys.executable, str(ROOT / "slurm" / "first_run_report.py"), str(folder)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == text
    r = subprocess.run([sys.executable, str(ROOT / "slurm" / "first_run_report.py"), str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "usage: first_run_report.py FOLDER" in r.stderr

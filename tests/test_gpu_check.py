"""benchmarks/gpu_check.py on the CPU: its arguments and its refusal without a GPU (the GPU run itself needs one)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from launch import ROOT, clean_env


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args],
                          env=clean_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=120)


def test_no_gpu_is_refused_in_one_line():
    r = gpu_check()
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: error: no CUDA GPU here"), r.stderr
    assert "srun --gres=gpu:1" in lines[0] and "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize("args,needle", [
    (["--steps", "0"], "--steps 0 must be at least 1"),
    (["--warmup", "-1"], "--warmup -1 must be 0 or more"),
    (["--chunks", "3"], "--chunks 3 must divide --batch-size 64"),
    (["--precision", "fp8"], "invalid choice: 'fp8'"),
])
def test_bad_arguments_name_the_value(args, needle):
    r = gpu_check(*args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_one_gpu_rows_put_every_part_on_gpu_0():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check as g
    assert g.one_gpu_devices(1, 1) is None and g.one_gpu_devices(2, 2) is None
    assert g.one_gpu_devices(2, 1) == "0,0" and g.one_gpu_devices(4, 1) == "0,0,0,0"


def test_tasks_sharing_a_gpu_each_get_a_host_id():
    """--tasks 2 on a one-GPU machine: both tasks on GPU 0, each with its own NCCL_HOSTID (nccl then treats them as
    two hosts instead of refusing two ranks on one GPU), torchrun's variables so idr_torch reads them even in srun."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check as g
    assert g.one_gpu_devices(1, 1, tasks=2) == "0" and g.one_gpu_devices(2, 1, tasks=2) == "0,0"
    assert g.one_gpu_devices(1, 4, tasks=2) is None and g.one_gpu_devices(2, 4, tasks=2) is None
    shared = g.task_envs(2, shared_gpu=True)
    assert [e["NCCL_HOSTID"] for e in shared] == ["gpu-check-task-0", "gpu-check-task-1"]
    assert [e["RANK"] for e in shared] == ["0", "1"] and {e["WORLD_SIZE"] for e in shared} == {"2"}
    assert len({e["MASTER_PORT"] for e in shared}) == 1 and all(e["TORCHELASTIC_RUN_ID"] for e in shared)
    own = g.task_envs(2, shared_gpu=False)
    assert not any("NCCL_HOSTID" in e for e in own)
    import idr_torch
    launches = [idr_torch.Launch(dict(e, SLURM_PROCID="0", SLURM_STEP_ID="0", SLURM_NTASKS="1")) for e in shared]
    assert [(x.launcher, x.rank, x.local_rank, x.size) for x in launches] == [("torchrun", 0, 0, 2),
                                                                             ("torchrun", 1, 1, 2)]


def test_tasks_must_be_positive():
    r = gpu_check("--tasks", "0")
    assert r.returncode == 2 and "--tasks 0 must be at least 1" in r.stderr, r.stderr

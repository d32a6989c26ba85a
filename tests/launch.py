"""Start N real processes the way srun would (SLURM_* per task), wait for all, and insist they exit."""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from local_slurm import free_port

ROOT = Path(__file__).resolve().parent.parent
# the torch these tests run on, (major, minor): the one parse of its version for every test file
TORCH = tuple(int(x) for x in re.findall(r"\d+", importlib.metadata.version("torch"))[:2])
# what a test must never inherit from the machine it runs on
# what a launcher, a job or nccl_environment() sets: a test's processes get only what the test gives them
_STRIP = ("SLURM_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC",
          "CUDA_VISIBLE_DEVICES", "DSDIR", "SCRATCH", "TORCH_NCCL_", "TORCH_FR_", "NCCL_")


# What a user copies to $WORK (README, "On the cluster"): the entry points and the kit/ folder beside them.
KIT = ("bench_ddp_transformer.py", "bench_stage.py", "check_topology.py", "idr_torch.py", "kit")


def copy_kit(target: Path, extra: tuple[str, ...] = ()) -> None:
    """The kit as a user's copy of it in `target` (no caches), and `extra` paths of the repository beside it."""
    for name in KIT + extra:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, target / name)


def checker_source() -> str:
    """The checker's whole source: its command line and the kit's modules (the checks, tables and findings)."""
    return "\n".join(p.read_text() for p in [ROOT / "check_topology.py", *sorted((ROOT / "kit").glob("*.py"))])


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIP)}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::DeprecationWarning")
    env.update(extra)
    return env


def without_gpu(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """A benchmark (a path under the kit) run on this machine with no GPU visible: its one-line refusals."""
    return subprocess.run([sys.executable, str(ROOT / script), *args], env=clean_env(CUDA_VISIBLE_DEVICES=""),
                          capture_output=True, text=True, timeout=timeout)


def srun_envs(ntasks: int, nodes: int = 1, port: int | None = None, job_id: str = "777") -> list[dict[str, str]]:
    """SLURM_* of every task of `srun -N nodes -n ntasks --ntasks-per-node ntasks/nodes` on this host."""
    per_node = ntasks // nodes
    port = port or free_port()
    envs = []
    for rank in range(ntasks):
        envs.append(clean_env(
            SLURM_JOB_ID=job_id, SLURM_STEP_ID="0", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per_node),
            SLURM_NODEID=str(rank // per_node), SLURM_NTASKS=str(ntasks), SLURM_STEP_NUM_TASKS=str(ntasks),
            SLURM_STEP_TASKS_PER_NODE=f"{per_node}(x{nodes})" if nodes > 1 else str(per_node),
            SLURM_STEP_NODELIST=",".join(["localhost"] * 1 + [f"127.0.0.{i + 1}" for i in range(1, nodes)]),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    return envs


def run_tasks(argv: list[str], envs: list[dict[str, str]], timeout: float = 240, cwd: Path | None = None,
              python: str | None = None) -> list[subprocess.CompletedProcess]:
    """Run `python argv...` once per environment; every process must exit within `timeout` seconds."""
    procs = [subprocess.Popen([python or sys.executable, *argv], env=env, cwd=cwd or ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for env in envs]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError(f"processes still running after {timeout}s: "
                             f"{[i for i, p in enumerate(procs) if p.returncode in (None, -9)]}")
    return results


def bench(args: list[str], ntasks: int = 1, nodes: int = 1, timeout: float = 240, python: str | None = None,
          script: str = "bench_ddp_transformer.py", **extra_env: str) -> list[subprocess.CompletedProcess]:
    """Run a trainer (bench_ddp_transformer.py, or bench_stage.py) as `srun -n ntasks -N nodes` would."""
    envs = srun_envs(ntasks, nodes) if ntasks > 1 or nodes > 1 else [clean_env()]
    for env in envs:
        env.update(extra_env)
    return run_tasks([str(ROOT / script), *args], envs, timeout=timeout, python=python)


@contextlib.contextmanager
def mounted_tmpfs(where: Path, options: str):
    """A tmpfs mounted at `where` with mount's -o `options` ("size=4m", "ro,size=64k", "size=8m,nr_inodes=4"): a
    small or read-only disk for the full-disk tests. Needs root (CI runs as root): skipped with the reason elsewhere,
    failed in CI. Unmounted (lazily, in case a process still holds it) on the way out."""
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode:
        if os.environ.get("CI"):
            pytest.fail(f"cannot mount a tmpfs in CI: {r.stderr.strip()}")
        pytest.skip(f"mounting a tmpfs needs root: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def stage_schedule_runs(schedule: str) -> str:
    """The schedule, or a skip where this torch release refuses it on the CPU (kit.releases: its first release,
    gloo's; tests/test_releases.py checks that refusal)."""
    import torch

    import kit.arguments
    import kit.releases
    refusals = kit.releases.torch_refusals(torch.__version__, kit.arguments.Training(layout="stage", schedule=schedule),
                                           cpu=True)
    if refusals:
        pytest.skip(refusals[0])
    return schedule

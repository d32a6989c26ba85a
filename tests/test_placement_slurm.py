"""The checker's task placement against real srun runs on the local Slurm cluster (slurm-wlm 22.05).

Hypothesis generates requests (-N, -n, --ntasks-per-node, -c in #SBATCH; -N, -n, --ntasks-per-node on the srun
line); each one is submitted for real with srun printing SLURM_PROCID / SLURM_NODEID / SLURM_LOCALID /
SLURM_STEP_TASKS_PER_NODE, and compared with check_topology's plan of the same script, task by task.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from launch import ROOT, clean_env

pytestmark = pytest.mark.slurm
UNEVEN = ("uneven-tasks-per-node", "ntasks-mismatch", "ntasks-per-node-missing")
PROBE = "bash -c 'echo \"R $SLURM_PROCID $SLURM_NODEID $SLURM_LOCALID $SLURM_STEP_TASKS_PER_NODE\"'"


def submit(cluster, cwd: Path, script: str, timeout: float = 90) -> tuple[int, str]:
    """sbatch a script, wait until the job has left the queue; (sbatch's exit code, its stderr + the job's output)."""
    env = clean_env(**cluster.env)
    path = cwd / "probe.slurm"
    path.write_text(script)
    out = subprocess.run(["sbatch", "--parsable", "-o", str(cwd / "probe_%j.out"), str(path)], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=30)
    if out.returncode:
        return out.returncode, out.stderr
    job = out.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queue = subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True)
        if queue.returncode == 0 and not queue.stdout.strip():
            break
        time.sleep(0.2)
    else:
        subprocess.run(["scancel", job], env=env)
        pytest.fail(f"job {job} did not finish within {timeout:.0f}s")
    log = cwd / f"probe_{job}.out"
    for _ in range(50):  # the output file is written by slurmd; it may land a moment after the job leaves
        if log.exists():
            break
        time.sleep(0.1)
    return 0, log.read_text() if log.exists() else ""


def checker_json(script: str, cwd: Path) -> dict:
    path = cwd / "trainer.slurm"
    path.write_text(script)
    out = subprocess.run([sys.executable, str(ROOT / "check_topology.py"), "--json", str(path)], capture_output=True,
                         text=True, timeout=60)
    return json.loads(out.stdout)


def scripts(sbatch: str, srun: str) -> tuple[str, str]:
    """The same request twice: with the trainer's line (for the checker) and with the probe (for Slurm)."""
    head = f"#!/bin/bash\n#SBATCH {sbatch} --gres=gpu:4 -C v100-32g --hint=nomultithread -t 5\n"
    return (head + f"srun {srun} python bench_ddp_transformer.py --nlayers 8 --chunks 8 --nb-part 1\n",
            head + f"srun {srun} {PROBE}\n")


def option(flag: str, value: int | None) -> str:
    return f"{flag} {value}" if value is not None else ""


@st.composite
def requests(draw) -> tuple[str, str]:
    nodes = draw(st.integers(1, 3))
    k = draw(st.one_of(st.none(), st.integers(1, 4)))
    c = draw(st.sampled_from([1, 10]))
    n = draw(st.one_of(st.none(), st.integers(1, 12)))
    assume(n is None or n <= nodes * (40 // c))  # more cores than the nodes have is sbatch's other refusal
    srun_n = draw(st.one_of(st.none(), st.integers(1, 12)))
    srun_nodes = draw(st.one_of(st.none(), st.integers(1, 3)))
    srun_k = draw(st.one_of(st.none(), st.integers(1, 4)))
    sbatch = " ".join(x for x in (f"-N {nodes}", option("-n", n), option("--ntasks-per-node", k), f"-c {c}") if x)
    srun = " ".join(x for x in (option("-N", srun_nodes), option("-n", srun_n),
                                option("--ntasks-per-node", srun_k)) if x)
    return sbatch, srun


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory, slurm_cluster) -> Path:
    return tmp_path_factory.mktemp("placement")


# CI (CI=true) replays one fixed set of 24 requests, so that a landing does not depend on the seed; anywhere else
# each run draws new ones (new seeds found 6 real discrepancies so far, each fixed in check_topology).
@settings(max_examples=24, deadline=None, derandomize=os.environ.get("CI") == "true",
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(requests())
# found by a new seed: with --ntasks-per-node and -n > 1, every node holds k tasks' cores, so srun -N 1 runs both
@example(("-N 2 -n 2 --ntasks-per-node 2 -c 1", "-N 1"))
# and: a step's tasks take 1 core without srun -c, so `srun -n 5` in a one-task -c 10 job is no refused request
@example(("-N 1 -c 10", "-n 5"))
def test_plan_is_the_placement_slurm_makes(slurm_cluster, probe_dir, request_):
    sbatch, srun = request_
    trainer, probe = scripts(sbatch, srun)
    plan = checker_json(trainer, probe_dir)
    errors = [f for f in plan["findings"] if f["level"] == "error"]
    rc, output = submit(slurm_cluster, probe_dir, probe)
    what = f"sbatch {sbatch} / srun {srun}: checker {[f['code'] for f in errors]}, Slurm rc={rc}: {output[-600:]}"
    if any("sbatch refuses" in f["message"] for f in errors):
        assert rc != 0, what
        return
    assert rc == 0, what
    seen = sorted(tuple(map(int, line.split()[1:4])) for line in output.splitlines() if line.startswith("R "))
    if plan["job"]["placement"] == "possible":  # Slurm decides by free cores: the checker said so, with an error
        assert any(f["code"] in ("ntasks-per-node-missing", "srun-ntasks-per-node-conflict") for f in errors), what
        per_node = [sum(1 for _, node, _ in seen if node == n) for n in sorted({node for _, node, _ in seen})]
        assert all(c >= 1 for c in per_node) and len(seen) in (0, len(plan["tasks"])), what
        return
    if any("srun refuses" in f["message"] for f in errors):
        assert not seen and "error" in output, what
        return
    tasks = plan["tasks"]
    assert len(seen) == len(tasks), what
    per_node = [sum(1 for _, node, _ in seen if node == n) for n in sorted({node for _, node, _ in seen})]
    planned = [sum(1 for t in tasks if t["node"] == n) for n in sorted({t["node"] for t in tasks})]
    assert sum(planned) == len(tasks)
    assert seen == sorted((t["rank"], t["node"], t["local_rank"]) for t in tasks), what
    assert all(t["tasks_on_node"] == planned[t["node"]] for t in tasks)
    assert (len(set(per_node)) > 1) == any(f["code"] in UNEVEN for f in errors), what  # "uneven" iff it is

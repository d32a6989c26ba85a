"""CPU binding on a real cluster: the local cluster's "affinity" variant (TaskPlugin=task/affinity, nodes with this
machine's own CPU count, tests/local_slurm.py) runs the kit's page and stage templates as shipped, scaled to its
nodes, and each task reports the cores it may run on (os.sched_getaffinity, in the trainer's JSON record).

srun 22.05 no longer reads SLURM_CPUS_PER_TASK (SchedMD's 22.05 release notes): a step launched without -c asks one
CPU per task, and in a job with --hint=nomultithread (Jean Zay's convention, in every template) task/affinity binds
each task to one core, where its DataLoader workers and threads then share it. Measured here on slurm-wlm 22.05.8,
even with one task per node (without the hint, a lone task would get the node's allocation: the step is not --exact).
Two tasks per node where the machine has 4 CPUs or more, one otherwise.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import ROOT, clean_env, copy_kit

pytestmark = pytest.mark.slurm
OWNED = ("page_3nodes_4gpus.slurm", "page_2nodes_8gpus.slurm", "stage_2nodes_4gpus.slurm")
CORES = len(os.sched_getaffinity(0))
TASKS_PER_NODE = 2 if CORES >= 4 else 1
CPUS_PER_TASK = CORES // TASKS_PER_NODE


@pytest.fixture(scope="module")
def affinity_cluster():
    from conftest import started_cluster
    yield from started_cluster("affinity")


def fit(text: str) -> str:
    """A template scaled to the affinity nodes (2 nodes of the 'bind' partition, 4 fake GPUs each) and to a small
    model; its srun lines, what this test is about, stay as shipped."""
    subs = [(r"^#SBATCH --nodes=\d+", "#SBATCH --nodes=2"),
            (r"^#SBATCH --ntasks-per-node=\d+", f"#SBATCH --ntasks-per-node={TASKS_PER_NODE}"),
            (r"^#SBATCH --cpus-per-task=\d+", f"#SBATCH --cpus-per-task={CPUS_PER_TASK}"),
            (r"^#SBATCH --gres=gpu:\d+", "#SBATCH --gres=gpu:4"),
            (r"^#SBATCH (-C \S+|--partition=\S+)", "#SBATCH --partition=bind"),
            (r"--pp \d+ --schedule 1f1b --nlayers 16 --chunks 8 --batch-size 192", "--pp 2 --schedule 1f1b "
             "--nlayers 4 --chunks 2 --batch-size 16"),
            (r"--nlayers 16 --chunks 4 --batch-size 64", "--nlayers 4 --chunks 2 --batch-size 16"),
            (r"--epochs 2", "--epochs 1 --max-steps 2 --synthetic 300")]
    for pattern, repl in subs:
        text, n = re.subn(pattern, repl, text, flags=re.M)
        assert n or "--pp" in pattern or "16 --chunks 4" in pattern, (pattern, text)
    return text


def run_template(cluster, tmp_path: Path, name: str, text: str) -> tuple[list[dict], str]:
    """sbatch --wait the script: every task's CPU placement from the trainer's record, and the job's output."""
    copy_kit(tmp_path)
    (tmp_path / name).write_text(text)
    env = clean_env(**cluster.env)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["BASH_FUNC_module%%"] = "() {  :\n}"  # `module` is a no-op, as if Lmod had loaded PyTorch
    r = subprocess.run(["sbatch", "--wait", "--parsable", name], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("*_*.out")) + sorted(tmp_path.glob("*_*.err")))
    assert r.returncode == 0, f"sbatch: {r.stderr}\n{logs}"
    [record] = [json.loads(line) for line in (tmp_path / "hybrid_results.jsonl").read_text().splitlines()]
    assert len(record["plans"]) == 2 * TASKS_PER_NODE, record["plans"]
    return record["plans"], "\n".join(p.read_text() for p in sorted(tmp_path.glob("*_*.out")))


@pytest.mark.parametrize("name", OWNED)
def test_template_tasks_run_on_all_their_cpus(affinity_cluster, tmp_path, name):
    text = (ROOT / "slurm" / name).read_text()
    assert re.search(r"^srun -c \$SLURM_CPUS_PER_TASK python", text, re.M), "the template lost its srun -c"
    plans, out = run_template(affinity_cluster, tmp_path, name, fit(text))
    assert "srun did not pass it on" not in out
    assert [p["cpus"] for p in plans] == [CPUS_PER_TASK] * len(plans), plans
    assert all(p["threads"] == CPUS_PER_TASK for p in plans), plans  # torch's threads follow the cores it got
    per_node: dict[int, list] = {}
    for p in plans:
        per_node.setdefault(p["node"], []).extend(p["cpu_ids"])
    assert all(len(ids) == len(set(ids)) for ids in per_node.values()), plans  # no two tasks on one core


def test_plain_srun_without_c(affinity_cluster, tmp_path):
    """The page's template with a plain `srun python ...`: each task bound to one core, the trap its -c avoids."""
    text = fit((ROOT / "slurm" / "page_3nodes_4gpus.slurm").read_text())
    plain = text.replace("srun -c $SLURM_CPUS_PER_TASK python", "srun python")
    assert plain != text
    plans, out = run_template(affinity_cluster, tmp_path, "plain.slurm", plain)
    assert [p["cpus"] for p in plans] == [1] * len(plans), plans
    assert (f"notice: this task may run on 1 core(s) but the job asked --cpus-per-task={CPUS_PER_TASK}: srun did "
            "not pass it on") in out
    assert all(p["threads"] == 1 for p in plans), plans  # and torch's threads follow, rather than crowd one core
    assert all(p["cpus_per_task"] == str(CPUS_PER_TASK) for p in plans)  # what the job asked, not what a task got

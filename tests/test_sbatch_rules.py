"""What sbatch and srun 22.05 accept, measured on the local Slurm cluster, against what check_topology says.

Each row is a job script's header: sbatch --test-only either refuses it or says which nodes it would use; the
checker must refuse the same scripts (with the row's code) and read the same node count from the others.
"""
from __future__ import annotations

import re
import subprocess

import pytest

import idr_torch
from launch import clean_env
from test_placement_slurm import checker_json, submit

pytestmark = pytest.mark.slurm
TRAINER = "srun python bench_ddp_transformer.py --nlayers 8 --chunks 8\n"
BASE = "#SBATCH --gres=gpu:4 -C v100-32g --hint=nomultithread -t 10 -c 10 --ntasks-per-node=1"

# (the lines after '#!/bin/bash' and before the trainer, does sbatch accept it, the checker's code, nodes used)
ROWS = [
    ("#SBATCH -N 2", True, None, 2),
    ("#SBATCH --ntasks-per-nod=1 -N 2", True, "option-prefix", 2),  # getopt_long takes unambiguous prefixes
    ("#SBATCH --node=2", False, "ambiguous-option", None),  # --nodes, --nodelist, --nodefile
    ("#SBATCH --ntask=2", False, "ambiguous-option", None),
    ("#SBATCH --nodes-=2", False, "unknown-option", None),
    ("#SBATCH -N 2 -y", False, "unknown-option", None),
    ("#SBATCH -N=2", False, "bad-value", None),
    ("#SBATCH -N 2 two", False, "stray-token", None),
    ("#SBATCH-N 2", True, None, 2),  # no space needed after #SBATCH
    ("#SBATCH\t-N 2", True, None, 2),
    ("#SBATCH -N 2 # two nodes", True, None, 2),
    ("# hello\n  # indented comment\n   \n#SBATCH -N 2", True, None, 2),  # none of these ends the header
    ("#sbatch -N 2", True, "ignored-directive", 1),  # case matters
    ("  #SBATCH -N 2", True, "ignored-directive", 1),
    ("# SBATCH -N 2", True, "ignored-directive", 1),
    ("echo hi\n#SBATCH -N 2", True, "ignored-directive", 1),
    ("#PBS -l nodes=2", True, "pbs-directive", 2),  # sbatch translates #PBS ...
    ("#BSUB -n 2", True, "pbs-directive", 2),  # ... and #BSUB (-n 2 at 1 per node: 2 nodes)
    ("#PBS -l nodes=2\n#SBATCH --ignore-pbs", True, None, 1),  # unless --ignore-pbs, even after them
    ("#SBATCH -N 2 --tasks-per-node=1", True, None, 2),  # an alias the man page doesn't list
    ("#SLURM -N 2", True, "slurm-directive", 2),  # sbatch applies it: 'Change from #SLURM to #SBATCH'
    # option values sbatch checks itself (slurm_opt.c, proc_args.c, tres_bind.c): refused, or read otherwise
    ("#SBATCH -N 1 --hint=nomultithreads", False, "bad-value", None),  # 'unrecognized --hint argument'
    ("#SBATCH -N 1 --hint=NoMultiThread,compute_bound", True, None, 1),
    ("#SBATCH -N 1 --mem=abc", False, "bad-value", None),
    ("#SBATCH -N 1 --mem=1G --mem-per-cpu=1G", False, "option-conflict", None),
    ("#SBATCH -N 1 --cpus-per-gpu=10", False, "option-conflict", None),  # with BASE's -c 10
    ("#SBATCH -N 1 --gpu-bind=foo", False, "bad-value", None),
    ("#SBATCH -N 1 --gpu-bind=map_gpu:0,x", False, "bad-value", None),
    ("#SBATCH -N 1 --gpu-bind=closes", True, "value-misread", 1),  # closest, by its first letter
    ("#SBATCH -N 1 --gpu-bind=per_task:x", True, "value-misread", 1),
    ("#SBATCH -N 1 --distribution=cycle", False, "bad-value", None),
    ("#SBATCH -N 1 --distribution=cyclic:block,pack", True, None, 1),
    ("#SBATCH -N 1 --distribution=plane=2", True, None, 1),
    ("#SBATCH -N 1 --distribution=arbitrary", False, "bad-value", None),  # needs a node list
    ("#SBATCH -N 1 --exclusive=foo", False, "bad-value", None),
    ("#SBATCH -N 1 --exclusive=user", True, None, 1),
    ("#SBATCH -N 1 --signal=USR3@300", False, "bad-value", None),
    ("#SBATCH -N 1 --signal=USR1@70000", False, "bad-value", None),
    ("#SBATCH -N 1 --signal=B:SIGUSR1@300", True, None, 1),
    ("#SBATCH -N 1 --mail-type=ENDS", False, "bad-value", None),
    ("#SBATCH -N 1 --mail-type=END,FAILS", True, "value-misread", 1),  # FAILS dropped
    ("#SBATCH -N 1 --open-mode=x", False, "bad-value", None),
    ("#SBATCH -N 1 --open-mode=apend", True, "value-misread", 1),
    ("#SBATCH -N 1 --gres-flags=enforce", False, "bad-value", None),
    ("#SBATCH -N 1 --kill-on-invalid-dep=maybe", False, "bad-value", None),
    ("#SBATCH -N 1 --time=1:2:3:4", False, "bad-time", None),
    ("#SBATCH -N 1 --ntasks-per-gpu=1", False, "option-conflict", None),  # with BASE's --ntasks-per-node
    ("#SBATCH -N 2 --gpus=1", False, "gpu-request-conflict", None),  # '--gpus < -N'
    ("#SBATCH -N 1 --ntasks-per-core=1", True, "hint-ignored", 1),  # with BASE's --hint: the hint is dropped
]


def nodes_used(stderr: str) -> int | None:
    m = re.search(r"on nodes (\S+)", stderr)
    return len(idr_torch.expand_nodelist(m.group(1))) if m else None


@pytest.mark.parametrize("lines,accepted,code,nodes", ROWS, ids=[r[0] for r in ROWS])
def test_sbatch_and_checker_read_the_header_alike(slurm_cluster, tmp_path, lines, accepted, code, nodes):
    script = f"#!/bin/bash\n{BASE}\n{lines}\n{TRAINER}"
    (tmp_path / "job.slurm").write_text(script)
    slurm = subprocess.run(["sbatch", "--test-only", "job.slurm"], cwd=tmp_path, env=clean_env(**slurm_cluster.env),
                           capture_output=True, text=True, timeout=60)
    check = checker_json(script, tmp_path)
    codes = {f["code"]: f["level"] for f in check["findings"]}
    assert (slurm.returncode == 0) == accepted, slurm.stderr
    if code:
        assert code in codes, (codes, slurm.stderr)
    if not accepted:
        assert codes[code] == "error"
    elif nodes is not None:
        assert nodes_used(slurm.stderr) == nodes, slurm.stderr
        if codes.get(code) != "error":
            assert check["job"]["nodes"] == nodes, check["job"]


def test_srun_options_on_the_trainer_line(slurm_cluster, tmp_path):
    env = clean_env(**slurm_cluster.env)
    for srun, ok, code in (("--bogus", False, "unknown-option"), ("--ntasks-per-nod=1", True, "option-prefix"),
                           ("--pack-group=0", True, None), ("--exact", True, None),
                           ("--cpu-bind=foo", False, "bad-value"), ("--cpu-bind=cores,verbose", True, None),
                           ("--distribution=cycle", False, "bad-value")):
        r = subprocess.run(["srun", "-N1", *srun.split(), "hostname"], env=env, capture_output=True, text=True,
                           timeout=60)
        assert (r.returncode == 0) == ok, (srun, r.stderr)
        check = checker_json(f"#!/bin/bash\n{BASE}\n#SBATCH -N 1\nsrun {srun} python bench_ddp_transformer.py "
                             "--nlayers 8 --chunks 8\n", tmp_path)
        codes = {f["code"] for f in check["findings"]}
        assert (code in codes) if code else not codes & {"unknown-option", "ambiguous-option", "bad-value"}, (srun,
                                                                                                             codes)


GPU_PAIRS = [  # (GPU options, sbatch accepts, the step runs, the checker's code)
    ("-N 1 --gres=gpu:2 --gpus-per-node=4", True, False, "gpu-request-conflict"),  # the job keeps gpu:2
    ("-N 1 --gpus-per-node=4 --gres=gpu:2", True, False, "gpu-request-conflict"),
    ("-N 1 --gres=gpu:2 --gpus=3", False, False, "gpu-request-conflict"),
    ("-N 1 --gres=gpu:4 --gpus-per-task=1 --ntasks-per-node=2", False, False, "gpu-request-conflict"),
    ("-N 1 --gres=gpu:2 --gpus-per-task=1 --ntasks-per-node=2", True, True, None),
    ("-N 2 --gpus=6 --ntasks-per-node=1", True, True, "gpus-total-multinode"),  # 4 + 2
]


@pytest.mark.parametrize("gpus,accepted,runs,code", GPU_PAIRS, ids=[r[0] for r in GPU_PAIRS])
def test_gpu_request_pairs(slurm_cluster, tmp_path, gpus, accepted, runs, code):
    head = f"#!/bin/bash\n#SBATCH {gpus} -C v100-32g --hint=nomultithread -t 10 -c 10\n"
    rc, output = submit(slurm_cluster, tmp_path, head + "srun bash -c 'echo \"G $SLURM_NODEID "
                                                        "$CUDA_VISIBLE_DEVICES\"'\n")
    assert (rc == 0) == accepted, output
    gpus_seen = {line.split()[1]: line.split()[2] for line in output.splitlines() if line.startswith("G ")}
    assert bool(gpus_seen) == runs, output
    if "--gpus=6" in gpus:
        assert sorted(len(v.split(",")) for v in gpus_seen.values()) == [2, 4], gpus_seen
    check = checker_json(head + TRAINER, tmp_path)
    codes = {f["code"]: f["level"] for f in check["findings"]}
    assert (codes.get(code) == "error") if code else "gpu-request-conflict" not in codes, codes

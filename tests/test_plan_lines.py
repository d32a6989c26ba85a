"""What the checker's plan says about a job script (issue 33, item 5): the GPUs each process of a launch line sees
under Slurm's GPU binding, and the trainer line's own values in the plan, also when the trainer refuses the line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from checker import run_checker

HEAD = ("#!/bin/bash\n#SBATCH -A abc@v100 -C v100-32g -N 1 --ntasks-per-node=4 {gpus} -c 10 --hint=nomultithread "
        "-t 1:00:00\nmodule load pytorch-gpu/py3/2.3.1\n")


def check(tmp_path: Path, text: str) -> tuple[dict, str]:
    """The checker on a script: its --json report and its text report."""
    path = tmp_path / "job.slurm"
    path.write_text(text)
    reports = [run_checker(*extra, str(path)).stdout for extra in (["--json"], [])]
    return json.loads(reports[0]), reports[1]


# srun(1) --gpu-bind: --gpus-per-task implies per_task:<n> unless a binding is given; none turns binding off (each
# task sees the step's GPUs of its node); single:<n> binds each task to one GPU, n tasks per GPU.
@pytest.mark.parametrize("bind,each", [("", 1), ("--gpu-bind=single:1", 1), ("--gpu-bind=none", 4)])
def test_a_launch_line_says_the_gpus_each_task_sees(tmp_path, bind, each):
    report, text = check(tmp_path, HEAD.format(gpus="--gpus-per-task=1") + f"srun -c 10 {bind} python train.py\n")
    [launch] = report["job"]["launches"]
    assert launch["layout"]["gpus_per_process"] == each, launch["layout"]
    assert f"4 process(es) per node on 1 node(s), {each} GPU(s) each" in text, text


def test_single_binding_gives_the_kit_one_gpu_per_task(tmp_path):
    trainer = "python bench_ddp_transformer.py --nlayers 8 --chunks 8"
    report, _ = check(tmp_path, HEAD.format(gpus="--gres=gpu:4") + f"srun -c 10 --gpu-bind=single:1 {trainer}\n")
    assert [t["node_gpus"] for t in report["tasks"]] == [["0"], ["1"], ["2"], ["3"]]
    assert report["ok"], report["findings"]
    report, _ = check(tmp_path, HEAD.format(gpus="--gres=gpu:4") + f"srun -c 10 --gpu-bind=single:2 {trainer}\n")
    [shared] = [f for f in report["findings"] if f["code"] == "gpu-shared"]
    assert "--gpu-bind=single:1 gives each task its own" in shared["message"], shared


def refused(tmp_path: Path, args: str) -> tuple[dict, str]:
    head = HEAD.format(gpus="--gres=gpu:4").replace("--ntasks-per-node=4", "--ntasks-per-node=2")
    return check(tmp_path, head.replace("-c 10", "-c 20") + f"srun -c 20 python bench_ddp_transformer.py {args}\n")


def test_a_refused_trainer_line_is_planned_with_its_own_values(tmp_path):
    """The trainer refuses --lr nan: nothing else on the line is judged (no pipeline-bubble for --chunks 2), but the
    plan shows the line's 8 layers, not the trainer's default 16."""
    report, text = refused(tmp_path, "--nlayers 8 --chunks 2 --lr nan")
    assert {f["code"] for f in report["findings"]} == {"bad-argument"}, report["findings"]
    assert report["training"]["nlayers"] == 8 and report["training"]["chunks"] == 2
    assert "nb_part 2, 8 layers" in text and "Layer 0-3 | cuda:1: Layer 4-7" in text, text
    assert not any("default" in n for n in report["notes"]), report["notes"]


@pytest.mark.parametrize("args", ["--nlayers 999999999 --chunks 8", "--nlayers $N --chunks 8"])
def test_a_default_in_the_plan_is_said(tmp_path, args):
    """Where the line's --nlayers is refused or a shell variable, the table splits the default, and says so."""
    report, text = refused(tmp_path, args)
    assert "nb_part 2, 16 layers" in text
    assert any(n.startswith("the table splits the trainer's default 16 layers") for n in report["notes"]), text

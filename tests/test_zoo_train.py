"""The model families users bring (issue 41, items 4, 5 and 7), trained for real in the stage layout (bench_stage.py,
2 tasks, gloo on the CPU) or refused up front in one line by the trainer and the checker alike: a layer that returns a
transposed view, a last stage without parameters, weights tied across two parts."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import kit.arguments
import kit.releases
from launch import TORCH, bench, clean_env, copy_kit

pytestmark = pytest.mark.multiproc

ZOO = "tests/zoo_families.py"
SHORT = ["--epochs", "1", "--max-steps", "2", "--batch-size", "8", "--chunks", "2", "--synthetic", "200"]


def stage_layout_or_skip() -> None:
    if kit.releases.torch_refusals(torch.__version__, kit.arguments.Training(layout="stage", schedule="gpipe"),
                                   cpu=True):
        pytest.skip("this torch has no stage layout on the CPU")


def stage_run(tmp_path, args: list[str]) -> list[subprocess.CompletedProcess]:
    return bench([*args, *SHORT, "--pp", "2", "--schedule", "gpipe", "--cache-dir", str(tmp_path)], ntasks=2,
                 script="bench_stage.py", timeout=180)


def check_stage_job(tmp_path, args: list[str], zoo: str = ZOO) -> subprocess.CompletedProcess:
    """The checker on a job script (in a user's copy of the kit and of the zoo) whose trainer line is bench_stage.py
    --pp 2 with `args`."""
    copy_kit(tmp_path, extra=(zoo,))
    (tmp_path / "job.slurm").write_text(
        "#!/bin/bash\n#SBATCH -N 1 --ntasks-per-node=2 --gres=gpu:2 -c 10 --hint=nomultithread -t 1:00:00\n"
        f"module load pytorch-gpu/py3/{'.'.join(map(str, TORCH))}.0\nsrun python bench_stage.py {' '.join(args)} "
        "--pp 2 --schedule gpipe --batch-size 8 --chunks 2\n")
    return subprocess.run([sys.executable, "check_topology.py", "job.slurm"], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=120)


def test_a_layer_that_returns_a_transposed_view_trains_in_the_stage_layout(tmp_path):
    """Every layer of the model returns x.transpose(1, 2) of a Linear over its input's transpose: the stage's output
    and its input's gradient are transposed views, which gloo's send refuses ("input tensor has to be contiguous");
    the stage's hooks (bench_stage.contiguous_io) make them contiguous, and the pipeline trains."""
    stage_layout_or_skip()
    runs = stage_run(tmp_path, ["--model", f"{ZOO}:transposed", "--sample", f"{ZOO}:transposed_sample"])
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    assert "replicas in sync" in runs[0].stdout and "epoch   1 | steps     2" in runs[0].stdout, runs[0].stdout


TAIL = ["--model", f"{ZOO}:parameterless_tail", "--sample", f"{ZOO}:image_sample"]


def test_a_stage_without_parameters_is_refused_up_front_with_the_fix(tmp_path):
    """[conv, conv, pool, flatten] split evenly over 2 stages leaves stage 1 pooling and flattening: the trainer
    refuses it before any process group (before: "optimizer got an empty parameter list" on one task, the other
    lost), in one line naming the stage, its layers and a split that works; the checker says the same line, exit 2;
    with that split the pipeline trains."""
    stage_layout_or_skip()
    runs = stage_run(tmp_path, TAIL)
    assert [r.returncode for r in runs] == [2, 2], runs[0].stderr[-3000:]
    [line] = runs[0].stderr.strip().splitlines()
    assert not runs[1].stderr.strip(), runs[1].stderr
    assert "stage 1 (layers 2-3: AdaptiveAvgPool2d, Flatten) has no parameter to train" in line, line
    assert "--split time ([1, 3])" in line and "fewer stages (--pp)" in line, line
    check = check_stage_job(tmp_path / "copy", TAIL)
    assert check.returncode == 2 and "stage 1 (layers 2-3: AdaptiveAvgPool2d, Flatten)" in check.stderr, (
        check.stdout + check.stderr)
    assert " OK" not in check.stdout, check.stdout
    runs = stage_run(tmp_path, [*TAIL, "--split", "time"])
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    assert "sizes [1, 3]" in runs[0].stdout, runs[0].stdout


def test_the_replica_layout_runs_a_part_without_parameters(tmp_path):
    """The replica layout has one optimizer and one DDP over the whole replica: a part that only pools and flattens
    is fine there (not refused)."""
    runs = bench([*TAIL, *SHORT, "--nb-part", "2", "--cache-dir", str(tmp_path)], ntasks=2, timeout=180)
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    assert "sizes [2, 2]" in runs[0].stdout, runs[0].stdout


GPT2 = ["--model", f"{ZOO}:gpt2_tiny_lm", "--sample", "4x16"]


def test_weights_tied_across_parts_are_refused_in_one_line_never_untied(tmp_path):
    """GPT-2's lm_head holds its wte's Parameter (Hugging Face's default): split over 2 parts each part would train
    its own copy (the stage layout's tasks; on GPUs the replica layout's parts too). Both trainers refuse it before
    any process group in one line naming the two layers and the fix; the checker says the same line."""
    needle = "layers '0: GPT2Embedding' and '3: GPT2LMHead' share the parameter wte.weight (tied weights)"
    runs = bench([*GPT2, *SHORT, "--nb-part", "2", "--cache-dir", str(tmp_path)], ntasks=2, timeout=180)
    assert [r.returncode for r in runs] == [2, 2], runs[0].stderr[-3000:]
    [line] = runs[0].stderr.strip().splitlines()
    assert needle in line and "tie_word_embeddings=False" in line and not runs[1].stderr.strip(), line
    stage_layout_or_skip()
    runs = stage_run(tmp_path, GPT2)
    assert [r.returncode for r in runs] == [2, 2] and needle in runs[0].stderr, runs[0].stderr[-3000:]
    check = check_stage_job(tmp_path / "copy", GPT2)
    assert check.returncode == 2 and needle in check.stderr, check.stdout + check.stderr


def test_weights_tied_on_one_part_stay_tied_through_training(tmp_path):
    """On one part the tie is the model's own: after two steps of 2 replicas the checkpoint's wte and lm_head are one
    tensor (one storage), and the run counts the shared weight once (the model line's parameters)."""
    save = tmp_path / "ck.pt"
    runs = bench([*GPT2, *SHORT, "--nb-part", "1", "--cache-dir", str(tmp_path), "--save", str(save)], ntasks=2,
                 timeout=180)
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    state = torch.load(save, weights_only=False)
    wte, head = state["0.0.wte.weight"], state["0.3.lm_head.weight"]
    assert wte.untyped_storage().data_ptr() == head.untyped_storage().data_ptr() and torch.equal(wte, head)

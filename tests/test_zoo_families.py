"""Each model family users bring (issue 41; tests/zoo_families.py) trained for a few steps in both layouts on the CPU
(2 tasks, gloo): the replica layout's Pipe + DDP over 2 parts, the stage layout's pipeline of 2 stages. The token
models with 2 classes train on the kit's data (their embedding's rows given as --vocab-size), the others on
synthetic batches."""
from __future__ import annotations

import pytest
import torch

import kit.arguments
import kit.releases
from launch import bench
from test_zoo_train import check_stage_job

pytestmark = pytest.mark.multiproc

ZOO = "tests/zoo_families.py"
SHORT = ["--epochs", "1", "--max-steps", "2", "--batch-size", "8", "--chunks", "2", "--synthetic", "200"]
FAMILIES = {  # --model, --sample and what else the line needs
    "gpt2-lm": [f"{ZOO}:gpt2_tiny_lm_untied", "8x32"],
    "gpt2-classifier": [f"{ZOO}:gpt2_tiny_classifier", "8x32", "--vocab-size", "512"],
    "bert": [f"{ZOO}:bert_tiny_classifier", "8x32", "--vocab-size", "1000"],
    "lstm": [f"{ZOO}:lstm_classifier", "8x32"],
    "long-encoder": [f"{ZOO}:long_encoder", f"{ZOO}:long_sample"],
    "resnet": [f"{ZOO}:resnet_like", f"{ZOO}:image_sample"],
    "unet": [f"{ZOO}:unet_like", f"{ZOO}:unet_sample"],
}


def line(name: str) -> list[str]:
    spec, sample, *rest = FAMILIES[name]
    return ["--model", spec, "--sample", sample, *rest, *SHORT]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_family_trains_in_the_replica_layout(tmp_path, name):
    runs = bench([*line(name), "--nb-part", "2", "--cache-dir", str(tmp_path)], ntasks=2, timeout=240)
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    assert "replicas in sync: max parameter fingerprint difference 0" in runs[0].stdout, runs[0].stdout


def split_line(out: str) -> str:
    """The trainer's line that says the split (kit.own_split.ModelPlan.text), as the checker's note says it."""
    [found] = [x.strip() for x in out.splitlines() if x.strip().startswith("--model ") and "sizes [" in x]
    return found


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_family_trains_in_the_stage_layout(tmp_path, name):
    """The checker approves a job script's bench_stage.py line and prints the split; the trainer runs that split.
    The LSTM's layers return transposed views (batch_first): what its stage sends is made contiguous."""
    if kit.releases.torch_refusals(torch.__version__, kit.arguments.Training(layout="stage", schedule="gpipe"),
                                   cpu=True):
        pytest.skip("this torch has no stage layout on the CPU")
    spec, sample, *rest = FAMILIES[name]
    stage_run_is_the_checkers_plan(tmp_path, line(name), ["--model", spec, "--sample", sample, *rest], ZOO)


def stage_run_is_the_checkers_plan(tmp_path, argv: list[str], model_args: list[str], zoo: str) -> None:
    """bench_stage.py --pp 2 (gpipe) on 2 tasks with `argv` trains 2 steps; the checker approves a job script's line
    with `model_args` (in a user's copy of the kit and `zoo`), and its split is the one the trainer printed."""
    runs = bench([*argv, "--pp", "2", "--schedule", "gpipe", "--cache-dir", str(tmp_path)], ntasks=2,
                 script="bench_stage.py", timeout=240)
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    assert "epoch   1 | steps     2" in runs[0].stdout, runs[0].stdout
    check = check_stage_job(tmp_path / "copy", model_args, zoo=zoo)
    assert check.returncode == 0, check.stdout + check.stderr
    [note] = [x.strip()[len("note: "):] for x in check.stdout.splitlines() if x.strip().startswith("note: --model")]
    assert note.split("; memory estimate")[0] == split_line(runs[0].stdout), check.stdout

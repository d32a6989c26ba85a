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
from launch import ROOT, bench, clean_env

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


def checker(args: list[str], layout: str = "stage") -> subprocess.CompletedProcess:
    parts = ["--layout", "stage", "--pp", "2", "--schedule", "gpipe"] if layout == "stage" else ["--nb-part", "2"]
    tasks = "2" if layout == "stage" else "1"
    return subprocess.run([sys.executable, str(ROOT / "check_topology.py"), "--nodes", "1", "--gpus-per-node", "2",
                           "--ntasks-per-node", tasks, *parts, "--batch-size", "8", "--chunks", "2", *args], cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True, timeout=120)


def test_a_layer_that_returns_a_transposed_view_trains_in_the_stage_layout(tmp_path):
    """Every layer of the model returns x.transpose(1, 2) of a Linear over its input's transpose: the stage's output
    and its input's gradient are transposed views, which gloo's send refuses ("input tensor has to be contiguous");
    the stage's hooks (bench_stage.contiguous_io) make them contiguous, and the pipeline trains."""
    stage_layout_or_skip()
    runs = stage_run(tmp_path, ["--model", f"{ZOO}:transposed", "--sample", f"{ZOO}:transposed_sample"])
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    assert "replicas in sync" in runs[0].stdout and "epoch   1 | steps     2" in runs[0].stdout, runs[0].stdout

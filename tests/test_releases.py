"""The matrix's own core: what every torch lane must show besides training (tests/test_train.py, test_stage.py).

- a feature the release lacks (TORCH_FEATURES in check_topology) is refused up front: one line naming the flag, the
  releases that have it and this release; before init_process_group (a lone task of a 2-task job returns at once,
  where init_process_group would wait for its missing peer until --timeout);
- `--engine auto` picks the release's engine;
- the checker's plan is the trainer's plan, on this release's trainer.
"""
from __future__ import annotations

import json
import re
import sys
import time

import pytest
import torch

import kit.arguments
import kit.releases
import kit.schedules
from launch import ROOT, bench, run_tasks, srun_envs

pytestmark = [pytest.mark.core, pytest.mark.multiproc]

RELEASE = torch.__version__.split("+")[0]
V = tuple(int(x) for x in RELEASE.split(".")[:2])


def expected_refusal(column: str) -> str | None:
    """What the release must refuse, written here on purpose rather than read from the table: the page's
    torch.distributed.pipeline.sync exists up to 2.3, torch.distributed.pipelining from 2.4, and before 2.8 its
    schedules that batch a send with a receive wait forever on gloo (pytorch/pytorch#132644; measured here)."""
    if column == "replica torch-pipe":
        return "torch <= 2.3" if V > (2, 3) else None
    if V < (2, 4):
        return "torch >= 2.4"
    # the zero-bubble schedules (issue 44): the release whose pipelining ships the class (ScheduleInterleavedZeroBubble
    # 2.5, ScheduleZBVZeroBubble 2.6, ScheduleDualPipeV 2.9), then gloo's: #132644 before 2.8, and ZB-V's task that
    # drops out on 2.8's gloo (measured in the 2.8.0 lane; 2.9 to 2.12 not tried, so refused there too)
    for name, ships, on_gloo in (("interleavedzerobubble", (2, 5), (2, 8)), ("zbvzerobubble", (2, 6), (2, 13)),
                                 ("dualpipev", (2, 9), (2, 9))):
        if column == f"stage {name}":
            return next((f"torch >= {a}.{b}" for a, b in (ships, on_gloo) if V < (a, b)), None)
    return "torch >= 2.8" if column != "stage gpipe" and V < (2, 8) else None


# column -> (the trainer and its arguments, the checker's view of the request, a word its refusal must name)
REQUESTS = {
    "replica torch-pipe": ("bench_ddp_transformer", ["--engine", "torch-pipe"],
                           kit.arguments.Training(engine="torch-pipe"),
                           "torch-pipe"),
    **{f"stage {s}": ("bench_stage", ["--pp", "2", "--schedule", s, "--chunks", "4"],
                      kit.arguments.Training(layout="stage", schedule=s), "stage" if V < (2, 4) else s)
       for s in kit.schedules.SCHEDULES},
}


@pytest.mark.parametrize("column", [pytest.param(c, marks=pytest.mark.compat(c)) for c in REQUESTS])
def test_missing_feature_is_refused_up_front(request, tmp_path, column):
    from conftest import refused
    script, args, training, word = REQUESTS[column]
    needs = expected_refusal(column)
    assert bool(kit.releases.torch_refusals(torch.__version__, training, cpu=True)) == bool(needs), (column, needs)
    if not needs:
        pytest.skip(f"torch {RELEASE} runs {column} on the CPU: its own tests run it")
    [lone] = srun_envs(2)[:1]  # task 0 of 2; task 1 never starts
    t0 = time.monotonic()
    [r] = run_tasks([str(ROOT / f"{script}.py"), *args, "--cache-dir", str(tmp_path)], [lone],
                    timeout=90)
    assert time.monotonic() - t0 < 60, "the refusal came after init_process_group (it waited for task 1)"
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip() and "idr_torch:" not in line]
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error:"), r.stderr
    assert "Traceback" not in r.stderr
    assert word in lines[0] and needs in lines[0] and f"this is torch {torch.__version__}" in lines[0], lines[0]
    refused(request, f"needs {needs}")


@pytest.mark.compat("engine auto")
def test_engine_auto_picks_the_release_engine(tmp_path):
    has_pipe = not kit.releases.torch_refusals(torch.__version__, kit.arguments.Training(engine="torch-pipe"))
    expected = "torch-pipe" if has_pipe else "fairscale"
    [r] = bench(["--synthetic", "200", "--epochs", "1", "--max-steps", "2", "--batch-size", "16", "--cache-dir",
                 str(tmp_path)], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"engine {expected}:" in r.stdout, r.stdout


@pytest.mark.compat("checker = trainer plan")
def test_checker_plan_is_the_trainer_plan(tmp_path):
    # 2 nodes x 2 tasks, 4 GPUs per node as Slurm shows them (no GPU here: the trainer mirrors that plan on the CPU)
    def envs() -> list[dict[str, str]]:
        out = srun_envs(4, nodes=2)
        for e in out:
            e.update(CUDA_VISIBLE_DEVICES="0,1,2,3", SLURM_STEP_GPUS="0,1,2,3", SLURM_GPUS_ON_NODE="4")
        return out
    check = run_tasks([str(ROOT / "check_topology.py"), "--nlayers", "4", "--json"], envs(), timeout=120)
    assert check[0].returncode == 0, check[0].stdout + check[0].stderr
    report = json.loads(check[0].stdout[check[0].stdout.index("{"):])
    out = tmp_path / "run.jsonl"
    train = run_tasks([str(ROOT / "bench_ddp_transformer.py"), "--nlayers", "4", "--synthetic", "400", "--epochs",
                       "1", "--max-steps", "2", "--batch-size", "16", "--cache-dir", str(tmp_path), "--json-out",
                       str(out)], envs(), timeout=240)
    assert all(r.returncode == 0 for r in train), train[0].stderr[-3000:]
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    checker = [(t["node_gpus"], t["nb_part"]) for t in report["tasks"]]
    assert checker == [(["0", "1"], 2), (["2", "3"], 2)] * 2  # the page's split of 4 GPUs between 2 tasks
    assert [(p["node_gpus"], p["nb_part"]) for p in record["plans"]] == checker


def test_the_lane_runs_the_release_it_claims():
    """The matrix's rows are keyed by the release a venv claims: a lane's folder name (torch-<release>-<hash>), or
    the Makefile's pin for the project's own .venv. A venv holding another torch would mislabel its row."""
    lane = sys.prefix.rsplit("/torch-", 1)
    claimed = (lane[1].split("-")[0] if len(lane) == 2 else
               re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text()).group(1))
    assert RELEASE == claimed, (sys.prefix, torch.__version__, claimed)

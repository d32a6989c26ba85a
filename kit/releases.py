"""What each torch release can run (engines, schedules, features) and which release a module name loads.
Owns: TORCH_FEATURES. Imports: kit.arguments.
"""
from __future__ import annotations

import re

from kit.arguments import Training


# One table for the trainers (which refuse up front, before init_process_group) and for this checker (which judges a
# job script's `module load pytorch-gpu/py3/X`). Ranges are (major, minor), inclusive; None: no bound. Read off each
# release's own sources in the matrix's venvs (`make lanes`, one per release): torch/distributed/pipeline/sync/ is in
# 2.3.1 and gone from 2.4.1; torch/distributed/pipelining/ (PipelineStage, ScheduleGPipe, Schedule1F1B,
# ScheduleInterleaved1F1B, ScheduleLoopedBFS) first ships in 2.4.
TORCH_FEATURES = {
    "engine torch-pipe": dict(flag="--engine torch-pipe", first=None, last=(2, 3),
                              why="torch.distributed.pipeline was removed in 2.4",
                              fix="use --engine fairscale (or auto), or module load pytorch-gpu/py3/2.3.1"),
    "layout stage": dict(flag="the stage layout (bench_stage.py)", first=(2, 4), last=None,
                         why="torch.distributed.pipelining first ships in 2.4",
                         fix="use bench_ddp_transformer.py (the page's layout), or module load pytorch-gpu/py3/2.4.0 "
                             "or later"),
    # Only without a GPU (gloo): before 2.8, pipelining's _batch_p2p waited on one of the requests gloo returns for a
    # batch (`batch_isend_irecv(ops).pop()` in 2.4.1 and 2.6.0 schedules.py; pytorch/pytorch#132644, fixed by
    # #152938); nccl coalesces a batch into one request. The hangs measured here: docs/releases.md.
    "gloo schedule": dict(flag="--schedule {schedule} without a GPU (gloo)", first=(2, 8), last=None,
                          why="before 2.8 it waits forever on gloo, pytorch/pytorch#132644",
                          fix="use --schedule gpipe on the CPU (GPUs with nccl are not affected)"),
}


def version_tuple(version: str) -> tuple[int, int]:
    """'2.6.0+cu124' -> (2, 6)."""
    major, minor = (re.findall(r"\d+", version) + ["0", "0"])[:2]
    return int(major), int(minor)


def training_features(t: Training, cpu: bool = False) -> list[str]:
    """The TORCH_FEATURES a training request uses (cpu: no GPU, so gloo)."""
    if t.layout == "stage":
        return ["layout stage"] + (["gloo schedule"] if cpu and t.schedule != "gpipe" else [])
    return ["engine torch-pipe"] if t.engine == "torch-pipe" else []


def feature_range(name: str) -> str:
    f = TORCH_FEATURES[name]
    if f["first"] and f["last"]:
        return f"torch {f['first'][0]}.{f['first'][1]} to {f['last'][0]}.{f['last'][1]}"
    return f"torch >= {f['first'][0]}.{f['first'][1]}" if f["first"] else f"torch <= {f['last'][0]}.{f['last'][1]}"


def torch_refusals(version: str, t: Training, cpu: bool = False) -> list[str]:
    """One line per feature of `t` that torch `version` lacks: the flag, the releases that have it, this release,
    the fix. Empty when this release runs the request. The first refusal is enough: stage before 2.4 says only that."""
    v = version_tuple(version)
    for name in training_features(t, cpu):
        f = TORCH_FEATURES[name]
        if (f["first"] and v < f["first"]) or (f["last"] and v > f["last"]):
            return [f"{f['flag'].format(schedule=t.schedule)} needs {feature_range(name)} ({f['why']}) but this is "
                    f"torch {version}; {f['fix']}"]
    return []


def torch_version_of(module: str | None) -> tuple[int, int] | None:
    m = re.search(r"pytorch[-\w]*/py3/(\d+)\.(\d+)", module or "")
    return (int(m.group(1)), int(m.group(2))) if m else None

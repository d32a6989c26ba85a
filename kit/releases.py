"""What each torch release can run (engines, schedules, features) and which release a module name loads.
Owns: TORCH_FEATURES (a schedule's own releases: kit.schedules). Imports: kit.arguments, kit.schedules.
"""
from __future__ import annotations

import re

from kit.arguments import Training
from kit.schedules import schedule


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
}

# A schedule's own releases are its row of kit.schedules.SCHEDULES: `first`, the release its class ships in, and
# `gloo_first`, the one that runs it on gloo (the CPU). Before 2.8, pipelining's _batch_p2p waited on one of the
# requests gloo returns for a batch (`batch_isend_irecv(ops).pop()` in 2.4.1 and 2.6.0 schedules.py;
# pytorch/pytorch#132644, fixed by #152938); nccl coalesces a batch into one request. The hangs measured here:
# docs/releases.md.
def schedule_features(name: str, cpu: bool) -> list[dict]:
    """The TORCH_FEATURES-like entries of --schedule `name` beyond the stage layout's own (UnknownSchedule for a
    name kit.schedules does not have)."""
    row, out = schedule(name), []
    if row.first > TORCH_FEATURES["layout stage"]["first"]:
        first = f"{row.first[0]}.{row.first[1]}"
        out.append(dict(flag=f"--schedule {name}", first=row.first, last=None,
                        why=f"torch.distributed.pipelining.{row.torch_class} first ships in {first}",
                        fix=f"use --schedule 1f1b, or module load pytorch-gpu/py3/{first}.0 or later"))
    if cpu and row.gloo_first:
        out.append(dict(flag=f"--schedule {name} without a GPU (gloo)", first=row.gloo_first, last=None,
                        why=row.gloo_why or f"before {row.gloo_first[0]}.{row.gloo_first[1]} it waits forever on "
                            "gloo, pytorch/pytorch#132644",
                        fix="use --schedule gpipe on the CPU (GPUs with nccl are not affected)"))
    return out


def version_tuple(version: str) -> tuple[int, int]:
    """'2.6.0+cu124' -> (2, 6)."""
    major, minor = (re.findall(r"\d+", version) + ["0", "0"])[:2]
    return int(major), int(minor)


def training_features(t: Training, cpu: bool = False) -> list[dict]:
    """The features a training request uses (cpu: no GPU, so gloo), each as a TORCH_FEATURES entry."""
    if t.layout != "stage":
        return [TORCH_FEATURES["engine torch-pipe"]] if t.engine == "torch-pipe" else []
    return [TORCH_FEATURES["layout stage"], *schedule_features(t.schedule, cpu)]


def feature_range(f: dict) -> str:
    if f["first"] and f["last"]:
        return f"torch {f['first'][0]}.{f['first'][1]} to {f['last'][0]}.{f['last'][1]}"
    return f"torch >= {f['first'][0]}.{f['first'][1]}" if f["first"] else f"torch <= {f['last'][0]}.{f['last'][1]}"


def torch_refusals(version: str, t: Training, cpu: bool = False) -> list[str]:
    """One line per feature of `t` that torch `version` lacks: the flag, the releases that have it, this release,
    the fix. Empty when this release runs the request. The first refusal is enough: stage before 2.4 says only that."""
    v = version_tuple(version)
    for f in training_features(t, cpu):
        if (f["first"] and v < f["first"]) or (f["last"] and v > f["last"]):
            return [f"{f['flag']} needs {feature_range(f)} ({f['why']}) but this is torch {version}; {f['fix']}"]
    return []


def torch_version_of(module: str | None) -> tuple[int, int] | None:
    m = re.search(r"pytorch[-\w]*/py3/(\d+)\.(\d+)", module or "")
    return (int(m.group(1)), int(m.group(2))) if m else None

"""What a run reports: samples/s, TFLOP/s and the share of the GPU's peak, learning against chance, and the JSON
record appended whole to --json-out. Imports: kit.speed, kit.train.checkpoint, kit.train.errors, kit.train.trainer.
"""
from __future__ import annotations
from typing import TYPE_CHECKING

import argparse
import contextlib
import fcntl
import json
import math
import os
import stat
from pathlib import Path

import torch

import kit.speed
from kit.train.checkpoint import write_failure
from kit.train.errors import RunError

if TYPE_CHECKING:  # a type only
    from kit.train.trainer import Trainer


def chance_accuracy(labels: torch.Tensor) -> tuple[float, float]:
    """What guessing earns on the test set (its majority class's share), and the margin above it that a run must
    clear to have learned: 3 standard errors of an accuracy measured on that many reviews, at least 0.02."""
    n = max(len(labels), 1)
    share = torch.bincount(labels.long()).max().item() / n if len(labels) else 0.5
    return share, max(0.02, 3 * math.sqrt(share * (1 - share) / n))


def throughput(cfg: argparse.Namespace, trainer: Trainer, samples_per_s: float | None,
               gpu_name: str | None) -> dict:
    """The distance to the physical limit: the model's FLOPs per sample (kit.speed.flops_per_sample), the
    TFLOP/s the run reached (all its GPUs, and per GPU), and on a GPU the share of that GPU's dense peak for the
    precision its matmuls run in (kit.speed.PEAK_TFLOPS)."""
    own = getattr(trainer, "own", None)  # --model: its layers' FLOPs as counted by kit.own_model
    fps = own.plan.flops_per_sample if own else kit.speed.flops_per_sample(
        {k: getattr(cfg, k) for k in ("d_model", "d_hid", "seq_len", "nlayers")})
    gpus = trainer.record().get("gpus") or 1
    tflops = fps * samples_per_s / 1e12 if samples_per_s else None
    peak = kit.speed.peak_tflops(gpu_name, cfg.precision, cfg.tf32) if gpu_name else None
    per_gpu = tflops / gpus if tflops is not None and gpu_name else None
    return {"flops_per_sample": fps, "tflops": tflops, "tflops_per_gpu": per_gpu, "peak_tflops": peak,
            "peak_share": per_gpu / peak if per_gpu is not None and peak else None,
            "flops_missed": own.plan.model.flops_missed() if own else ""}


def speed_text(speed: dict, gpu_name: str | None, cfg: argparse.Namespace) -> str:
    """', 41.2 TFLOP/s (41.2 per GPU, 62 % of the H200's fp32 peak of 67)' for the summary line."""
    if speed["tflops"] is None:
        return ""
    text = f", {speed['tflops']:.3g} TFLOP/s"
    if speed["tflops_per_gpu"] is not None:
        text += f" ({speed['tflops_per_gpu']:.3g} per GPU"
        kind = "tf32" if cfg.precision == "fp32" and cfg.tf32 else cfg.precision
        text += (f", {100 * speed['peak_share']:.0f} % of the {gpu_name}'s {kind} peak of {speed['peak_tflops']:g})"
                 if speed["peak_share"] is not None else f"; no {kind} peak known for {gpu_name})")
    if speed.get("flops_missed"):  # kit.own_model could not count some of the model's ops: a lower bound
        text += f" (at least: {speed['flops_missed']})"
    return text


def write_record(cfg: argparse.Namespace, record: dict) -> None:
    """Append the run's record to --json-out as one whole line. A write that fails (a full disk, a quota) leaves the
    file as it was, prints the record on stdout so that it is not lost, and ends the run with one line and exit 1
    (the run itself finished: its record is what failed)."""
    line = json.dumps(record) + "\n"
    try:
        append_whole(Path(cfg.json_out).expanduser(), line.encode())
    except OSError as exc:
        print(line, end="", flush=True)
        raise RunError(f"the run finished, but its record could not be appended to --json-out {cfg.json_out} "
                       f"({write_failure(exc)}): it is printed on stdout instead (the line starting with "
                       f"{{\"time\": \"{record.get('time')}\"); add it to {cfg.json_out} once there is room") from None


def append_whole(path: Path, data: bytes) -> None:
    """Append `data` to `path` whole or not at all: a regular file is locked while it is appended to (other runs of
    a sweep append to the same file) and cut back to its length before if a write fails midway (a full disk writes
    part of a line, and a reader then finds a cut record). A FIFO or character device (/dev/stdout, /dev/null) is
    written as it is; one with no reader fails at once (ENXIO) instead of blocking."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    try:
        os.set_blocking(fd, True)
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        if regular:
            with contextlib.suppress(OSError):  # a file system without locks: appended all the same
                fcntl.lockf(fd, fcntl.LOCK_EX)
        start = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if regular:
                os.fsync(fd)
        except OSError:
            if regular and os.fstat(fd).st_size > start:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)  # and the lock with it

"""The page's closing advice as options: --precision (autocast per part, a GradScaler for fp16),
--activation-checkpointing (its layer: kit.train.transformer.CheckpointedLayer), --zero (ZeroRedundancyOptimizer),
and the memory estimate's start-up line for this run. Owns: Part, the optimizer. Imports: kit.arguments, kit.memory,
kit.plan, kit.releases, kit.train.errors.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

import kit.arguments
import kit.memory
import kit.plan
import kit.releases
from kit.train.errors import RunError


# The page's closing advice as options: mixed precision (--precision), gradient checkpointing
# (--activation-checkpointing) and ZeRO (--zero). Small pieces, so the memory benchmarks can use them as they are.
def autocast_dtype(precision: str) -> torch.dtype | None:
    """--precision's autocast dtype (kit.arguments.AUTOCAST_DTYPE names it); fp32: None."""
    name = kit.arguments.AUTOCAST_DTYPE[precision]
    return None if name is None else getattr(torch, name)


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """--precision's autocast for code on `device_type` ('cuda' or 'cpu'); fp32: none. Autocast computes in low
    precision from the fp32 weights, which stay fp32: checkpoints hold fp32 and load into any precision."""
    dtype = autocast_dtype(precision)
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype)


class Part(nn.Sequential):
    """One part of a replica: the page's nn.Sequential(*tmp_list), same children and state_dict keys, whose
    forward runs under --precision's autocast. Entered here, in each part, not around the Pipe: the Pipe runs
    every part in a worker thread of its own, and autocast is per thread (measured with fairscale 0.4.13: a bf16
    autocast around the Pipe's call leaves its output fp32)."""

    def __init__(self, *modules: nn.Module, precision: str = "fp32") -> None:
        super().__init__(*modules)
        self.precision = precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with autocast(self.precision, x.device.type):
            return super().forward(x)


def make_scaler(precision: str, device_type: str) -> torch.amp.GradScaler | None:
    """fp16 comes with a GradScaler: its narrow range would flush small gradients to zero, so the loss is scaled
    up before backward and the gradients down before the step (skipped when they overflowed). bf16 has fp32's
    range and needs none."""
    return torch.amp.GradScaler(device_type) if precision == "fp16" else None


def make_optimizer(params, lr: float, zero: bool, group: dist.ProcessGroup | None = None) -> torch.optim.Optimizer:
    """AdamW; under --zero the same AdamW in a ZeroRedundancyOptimizer over the data-parallel `group`: each replica
    keeps the state (exp_avg, exp_avg_sq) of its share of the parameters only, updates that share, and
    broadcasts it to the others. The same numbers as plain AdamW (tests/test_options.py)."""
    if not zero:
        return torch.optim.AdamW(params, lr=lr)
    from torch.distributed.optim import ZeroRedundancyOptimizer  # here: its module takes seconds to import
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, process_group=group, lr=lr)


def optimizer_state(optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None = None) -> dict | None:
    """The whole optimizer state in plain AdamW's layout, so that a checkpoint loads with or without --zero (and
    in either layout). Under --zero a collective: every rank of `group` sends its shard to the group's rank 0
    (consolidate_state_dict), which returns the whole; the others return None."""
    if not hasattr(optimizer, "consolidate_state_dict"):  # not a ZeroRedundancyOptimizer
        return optimizer.state_dict()
    optimizer.consolidate_state_dict(to=0)
    return optimizer.state_dict() if dist.get_rank(group) == 0 else None


def training_of(cfg: argparse.Namespace, **layout: object) -> kit.arguments.Training:
    """This run's arguments as check_topology sees them on a trainer line (its checks and its memory model);
    `layout`: the stage layout's fields (layout="stage", ...) where they differ from cfg's."""
    t = kit.arguments.training_from_args(cfg, str(layout.get("layout", "replica")))
    return dataclasses.replace(t, **layout)


def device_arch(plan: kit.plan.TaskPlan) -> tuple[str, float | None]:
    """The memory model's kernels for this task's first GPU (kit.memory.ARCHS) and its memory in GiB; the CPU's."""
    if plan.cpu:
        return "cpu", None
    device = plan.device(0)
    return (kit.memory.arch_of(torch.cuda.get_device_capability(device)),
            torch.cuda.get_device_properties(device).total_memory / kit.memory.GIB)


def memory_estimate(cfg: argparse.Namespace, plan: kit.plan.TaskPlan, nb_part: int, replicas: int,
                    **layout: object) -> tuple[str, float]:
    """check_topology's estimate of one GPU's peak for this run (nb_part is --pp in the stage layout): the start-up
    line and the worst GPU's GiB, with the kernels this device runs (kit.memory.ARCHS), against its memory."""
    t = training_of(cfg, **layout)
    model = kit.arguments.model_args(t)
    arch, gpu_gib = device_arch(plan)
    release = kit.releases.version_tuple(torch.__version__)
    line = kit.memory.memory_line(model, t, nb_part, replicas, gpu_gib, arch, release)
    return line, kit.memory.worst_part(model, t, nb_part, replicas, arch, release).total / kit.memory.GIB


def check_precision(cfg: argparse.Namespace, plan: kit.plan.TaskPlan) -> None:
    """What only the GPU itself can refuse: bf16 where it has none (V100, compute capability 7.0)."""
    if (cfg.precision == "bf16" and not plan.cpu
            and kit.memory.arch_of(torch.cuda.get_device_capability(plan.device(0))) == "sm70"):
        raise RunError(f"--precision bf16: this GPU ({torch.cuda.get_device_name(plan.device(0))}) has no bf16; use "
                       "--precision fp16 (autocast with a GradScaler)")


def options_text(cfg: argparse.Namespace, replicas: int) -> str:
    """The page's memory techniques this run uses, for the start-up line."""
    return (f"precision {cfg.precision}, activation checkpointing {'on' if cfg.activation_checkpointing else 'off'}, "
            + (f"ZeroRedundancyOptimizer(AdamW) over {replicas} replica(s)" if cfg.zero else "AdamW"))

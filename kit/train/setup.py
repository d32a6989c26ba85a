"""A task's setup before any process group: the GPU or CPU defaults, this task's plan from kit.plan and the
checker's verdict on it (the same checks as --check-args), its GPUs (use_gpus), the CPU threads and placement.
Imports: idr_torch, kit.arguments, kit.findings, kit.plan, kit.trainer_checks, kit.train.errors, kit.train.options.
"""
from __future__ import annotations

import argparse
import os

import torch

import idr_torch
import kit.arguments
import kit.findings
import kit.plan
import kit.trainer_checks
from kit.train.errors import RunError, log
from kit.train.options import check_precision


# setup: the defaults, this task's plan and check_topology's verdict, before any process group exists
def resolve(cfg: argparse.Namespace, cuda: bool) -> None:
    """Fill the model's GPU or CPU defaults where the line gives none (each value was checked when parsed)."""
    kit.arguments.resolve_defaults(cfg, cuda)


def task_plan(cuda: bool, nlayers: int, nb_part: int | None, findings: kit.findings.Findings,
              devices: list[int] | None = None) -> kit.plan.TaskPlan:
    """This task's plan from check_topology, from what idr_torch says this task sees."""
    launch = idr_torch.current()
    if cuda:
        count = torch.cuda.device_count()
        visible = launch.visible_gpus if len(launch.visible_gpus) == count else [str(i) for i in range(count)]
    else:  # CPU fallback: mirror the layout of the GPUs Slurm gave (if any), every part on the CPU
        visible = launch.visible_gpus
    plan = kit.plan.plan_task(launch.rank, launch.node_id, launch.local_rank, launch.local_world_size,
                                    visible, launch.gpus_on_node, nlayers, nb_part, findings, devices)
    plan.cpu = plan.cpu or not cuda
    return plan


def verdict(findings: kit.findings.Findings) -> None:
    """Warnings printed once, errors raised as one line: the words of the pre-flight check and of --check-args."""
    for f in findings:
        if f.level != "error":
            log(f"check_topology: {f}")
    if findings.errors:
        raise RunError(kit.findings.refusal_text(findings.errors))


def make_plan(cfg: argparse.Namespace, cuda: bool) -> kit.plan.TaskPlan:
    """The replica layout's plan and verdict: errors stop us here, before init_process_group. The checks are
    check_topology's (check_trainer_task), which --check-args and the pre-flight check run too."""
    findings = kit.findings.Findings()
    plan = task_plan(cuda, cfg.nlayers, cfg.nb_part, findings, cfg.devices)
    kit.trainer_checks.check_trainer_task("replica", cfg, plan, idr_torch.current(), cuda, torch.__version__, findings)
    verdict(findings)
    check_precision(cfg, plan)
    return plan


def use_gpus(plan: kit.plan.TaskPlan) -> list[int]:
    """torch.cuda.set_device(first_part) before anything touches CUDA (both trainers' main() call it right after the
    plan). Without it every CUDA call that takes no device (a context, a pinned-memory thread, an object collective)
    lands on cuda:0, whatever GPUs the task owns; tests/test_gpu_rules.py checks it for every task of a node.
    Returns this task's GPUs, first_part first ([] without one): what init_distributed binds its group to."""
    gpus = [] if plan.cpu else list(dict.fromkeys(plan.devices))
    if gpus:
        torch.cuda.set_device(plan.first_part)
    return gpus


def cpu_threads(launch: idr_torch.Launch) -> int:
    """The cores this task really has (os.sched_getaffinity: what Slurm's task/affinity or cgroup left it), for its
    intra-op threads and its DataLoader workers: its own cores when Slurm bound it, else the node's split between
    its tasks (N tasks each using every core would oversubscribe the node). SLURM_CPUS_PER_TASK (launch.cpus_asked)
    is what was asked, not what the task got (cores_notice)."""
    avail = len(os.sched_getaffinity(0))
    share = max(1, avail // launch.local_world_size)
    asked = launch.cpus_asked
    if asked is not None and avail <= asked:
        return avail  # bound to its own cores
    return min(asked, share) if asked is not None else share


def cores_notice(launch: idr_torch.Launch) -> str | None:
    """The line to say once where the task got fewer cores than the job asked: srun 22.05 does not pass
    --cpus-per-task on to the step, so a plain `srun` in a `-c 10 --hint=nomultithread` job binds each task to one
    core (measured on the test cluster's task/affinity variant, tests/test_cpu_binding.py)."""
    avail, asked = len(os.sched_getaffinity(0)), launch.cpus_asked
    if asked is None or avail >= asked:
        return None
    return (f"notice: this task may run on {avail} core(s) but the job asked --cpus-per-task={asked}: srun did "
            "not pass it on to the step (Slurm 22.05); launch with `srun -c $SLURM_CPUS_PER_TASK ...` or "
            "`export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK`")


def cpu_placement(launch: idr_torch.Launch) -> dict:
    """Where this task runs on the CPU, for the record: the cores it may use, as Slurm bound them, and the CPUs per
    task the job asked (SLURM_CPUS_PER_TASK, as its text)."""
    cores = sorted(os.sched_getaffinity(0))
    return {"cpus": len(cores), "cpu_ids": cores, "threads": torch.get_num_threads(),
            "cpus_per_task": None if launch.cpus_asked is None else str(launch.cpus_asked)}

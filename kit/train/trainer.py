"""What a layout is to the training loop: Trainer, the base both layouts build on (kit.train.replica's Replica, the
page's; bench_stage.py's Stages, a task per GPU) and what train() drives; the one training step both take (zero the
gradients, the layout's forward and backward, the optimizers' step, the watchdog), the loss and the step's figures,
and the replicas' fingerprint (their check after training). Owns: Trainer, the kit's loss (kit_loss), step_stats.
Imports: idr_torch, kit.train.launch, kit.train.own.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import idr_torch
from kit.train.launch import Watchdog
from kit.train.own import OwnModel, synthetic_loss, synthetic_stats


def kit_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The kit's loss, in fp32 whatever --precision (the last part's autocast may give bf16 logits)."""
    return F.cross_entropy(out.float(), y)


def step_stats(loss: torch.Tensor | None, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(loss x samples, correct, samples) of a training step, (correct, samples) of an evaluation step: on the
    device, never read here. Nothing is built from host data: torch.tensor(len(y), device=...) was a synchronous
    host-to-device copy every step (9-20 % of a host-bound bf16 step on an H200); torch.full is a fill kernel whose
    value travels as a kernel argument. tests/test_train.py records the step's ops to hold it."""
    count = torch.full((), len(y), dtype=torch.float32, device=logits.device)
    correct = (logits.argmax(1) == y).sum().float()
    return torch.stack([correct, count] if loss is None else [loss * len(y), correct, count])


def step_functions(own: OwnModel | None) -> tuple[Callable, Callable]:
    """The loss and the step's figures of a run: the kit's (its Transformer, or a --model on the kit's data), or a
    --model's stand-ins on synthetic batches (kit.train.own)."""
    return (kit_loss, step_stats) if own is None or own.kit_data else (synthetic_loss, synthetic_stats)


def forward_backward(ddp_mp_model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                     scaler: torch.amp.GradScaler | None = None,
                     loss_fn: Callable = kit_loss) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's forward and backward through a whole replica; returns the loss and the logits (detached). The loss
    is computed in fp32 whatever --precision (kit_loss: cross-entropy; a --model on synthetic batches:
    synthetic_loss); under fp16 the GradScaler scales it before backward."""
    logits = ddp_mp_model(x)
    loss = loss_fn(logits, y)
    (loss if scaler is None else scaler.scale(loss)).backward()
    return loss.detach(), logits.detach()


def fingerprint(modules: list[nn.Module]) -> torch.Tensor:
    """Per-tensor (sum, sum of squares) in float64: equal on every replica when DDP did its job."""
    with torch.no_grad():
        return torch.stack([torch.stack([p.double().sum(), p.double().pow(2).sum()])
                            for m in modules for p in m.parameters()]).flatten()


def divergence(fp: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> float:
    """Largest difference of fingerprints between the replicas of `group`. `fp` is on the stats device (the same
    part on every task: one communicator, each task on its own GPU)."""
    if size == 1:
        return 0.0
    everyone = [torch.empty_like(fp) for _ in range(size)]
    dist.all_gather(everyone, fp, group=group)
    gap = torch.stack([(e - everyone[0]).abs().max() for e in everyone]).max()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)  # over every group
    return gap.item()


class Trainer:
    """A layout as the training loop (kit.train.loop.train and the functions it calls) drives it. A layout sets
    these attributes and writes the methods below that raise NotImplementedError; the step (train_step) and the
    learning rate (set_lr) are the same for both."""
    name: str  # "replica" or "stage"
    engine: str  # the pipeline engine: torch-pipe, fairscale or pipelining
    equal_batches: bool  # the layout needs every batch the same size (the short last one dropped)
    nb_part: int  # parts of one replica
    dp_size: int  # replicas
    dp_rank: int  # this task's replica (its share of the data)
    stats_device: torch.device | str  # where the loss and accuracy live: the same part on every task
    total_params: int
    memory: str  # the start-up line of the memory estimate
    estimate_gib: float | None  # the estimated peak of one GPU (kit.memory.worst_part: both layouts are modelled)
    own: OwnModel | None = None  # a --model run's layers and data (kit.train.own), else None
    scaler: torch.amp.GradScaler | None = None  # fp16's (the replica layout's only)
    steps: int = 0
    watchdog: Watchdog | None = None  # started by start()

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One step: the gradients zeroed, the layout's forward and backward, every optimizer's step (under fp16
        through the GradScaler: the gradients unscaled, the step skipped if one overflowed, the scale adapted), the
        watchdog told. Returns (loss x samples, correct, samples) on the device, never read here."""
        optimizers = self.all_optimizers()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        stats = self.forward_backward(x, y)
        for opt in optimizers:
            opt.step() if self.scaler is None else self.scaler.step(opt)
        if self.scaler is not None:
            self.scaler.update()
        self.steps += 1
        self.watchdog.tick(self.steps)
        return stats

    def set_lr(self, lr: float) -> None:
        """The schedule's rate for the next step (kit.train.loop.lr_at), in every optimizer's groups: a plain float,
        no tensor, no host sync; under --zero the wrapper's groups, which ZeroRedundancyOptimizer.step() copies into
        its local AdamW."""
        for opt in self.all_optimizers():
            for group in opt.param_groups:
                group["lr"] = lr

    def all_optimizers(self) -> list[torch.optim.Optimizer]:
        raise NotImplementedError

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The layout's forward and backward of one batch; returns the step's figures (step_stats' layout)."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def load(self, model_state: dict, optimizer_state: dict | None) -> None:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def eval_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def state(self) -> tuple[dict, dict] | None:
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError

    def peak_memory_gb(self) -> float:
        raise NotImplementedError

    def divergence(self) -> float:
        raise NotImplementedError

    def placement(self, launch: idr_torch.Launch) -> dict:
        raise NotImplementedError

    def record(self) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

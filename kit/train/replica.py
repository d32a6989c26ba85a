"""The page's layout as a Trainer: this task holds one whole replica, its module_list split over its GPUs by a Pipe
(`model = Pipe(nn.Sequential(*module_list), chunks=args.chunks, checkpoint="never")`), wrapped by DDP across the
tasks (`ddp_mp_model = DistributedDataParallel(model)`), saved as the page saves it (`model.module.state_dict()`
on rank 0) and loaded as the page loads it (every task, before DDP). bench_ddp_transformer.py runs it with the
page's loop; the benchmarks and the tests' workers build it with kit.train.transformer's.
Owns: Replica. Imports: idr_torch, kit.plan, kit.train.launch, kit.train.options, kit.train.own, kit.train.parts,
kit.train.pipe, kit.train.setup, kit.train.trainer.
"""
from __future__ import annotations

import argparse
import os

import torch
from torch.nn.parallel import DistributedDataParallel

import idr_torch
import kit.plan
from kit.train.launch import Watchdog
from kit.train.options import make_optimizer, make_scaler, memory_estimate, optimizer_state, options_text
from kit.train.own import OwnModel, own_memory_estimate
from kit.train.parts import Builder, model_parts
from kit.train.pipe import PipeModel
from kit.train.setup import cpu_placement
from kit.train.trainer import Trainer, divergence, fingerprint, forward_backward, step_functions


class Replica(Trainer):
    """The page's layout: this task holds one whole replica, split over its GPUs by a Pipe; DDP across tasks.
    The training loop (kit.train.loop.train) drives it, as it drives bench_stage.py's Stages. `build`: the kit's
    Transformer's module_list (the page's loop, from bench_ddp_transformer.py; by default kit.train.transformer's)."""
    name = "replica"
    equal_batches = False  # the Pipe takes a short last batch

    def __init__(self, cfg: argparse.Namespace, plan: kit.plan.TaskPlan, engine: str, own: OwnModel | None = None,
                 build: Builder | None = None) -> None:
        self.cfg, self.plan, self.engine, self.own = cfg, plan, engine, own
        self.nb_part, self.dp_size, self.dp_rank = plan.nb_part, idr_torch.size, idr_torch.rank
        # the devices of the page's first_part (inputs) and last_part (labels, loss, accuracy)
        self.first_part_device, self.last_part_device = plan.device(0), plan.device(plan.nb_part - 1)
        self.stats_device = self.last_part_device
        # --model: the user's layers cut by the checker's split (kit.train.parts), else the page's module_list;
        # model = Pipe(nn.Sequential(*module_list), chunks=args.chunks, checkpoint="never")
        module_list = model_parts(cfg, plan, own, build)
        self.model = PipeModel(module_list, engine, cfg.chunks, [plan.device(i) for i in range(plan.nb_part)])
        try:  # the Pipe's worker threads run from here: whatever fails, they are stopped (a live Pipe hangs the exit)
            # the loss and the step's figures: the kit's, or a --model's stand-ins on synthetic batches
            self.loss_fn, self.stats_fn = step_functions(own)
            # beyond the page: --zero shards AdamW's state over the replicas; fp16 comes with a GradScaler
            self.optimizer = make_optimizer(self.model.parameters(), cfg.lr, cfg.zero)
            self.scaler = make_scaler(cfg.precision, "cpu" if plan.cpu else "cuda")
            self.memory, self.estimate_gib = (own_memory_estimate if own else memory_estimate)(cfg, plan, self.nb_part,
                                                                                              self.dp_size)
        except BaseException:
            self.model.close()
            raise
        self.total_params = sum(p.numel() for p in self.model.parameters())
        self.ddp_mp_model: DistributedDataParallel | None = None

    def load(self, model_state: dict, optimizer_state: dict | None) -> None:
        """The page: `model.load_state_dict(torch.load(model_path))` on every process, before DDP wraps it."""
        self.model.load_state_dict(model_state)  # every key, every shape: strict
        if optimizer_state is not None:
            scaler_state = optimizer_state.pop("grad_scaler", None)
            self.optimizer.load_state_dict(optimizer_state)  # AdamW's layout, with or without --zero
            if self.scaler is not None and scaler_state:
                self.scaler.load_state_dict(scaler_state)

    def start(self) -> None:
        # ddp_mp_model = DistributedDataParallel(model): no device_ids / output_device, the module spans
        # several devices (the page's "Important"). Its collectives run on the GPUs of the parameters, the same part
        # on every task: verify_params_across_processes on params[0] (first_part), broadcast_coalesced of the
        # parameters and buffers in buckets that never span GPUs, one all-reduce per gradient bucket on its GPU
        # (reducer.cpp, comm.cpp; every release from 2.3.1 to 2.14.1). So nccl builds one communicator per part,
        # part p of task t on GPU first_part(t) + p: distinct GPUs on a node, as nccl requires.
        self.ddp_mp_model = DistributedDataParallel(self.model)
        self.steps, self.watchdog = 0, Watchdog(self.cfg.timeout, idr_torch.rank)

    def all_optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The inputs go to the GPU of first_part, the labels to the GPU of last_part (where the output comes out);
        the forward and backward through DDP and the Pipe."""
        x, y = x.to(self.first_part_device, non_blocking=True), y.to(self.last_part_device, non_blocking=True)
        loss, logits = forward_backward(self.ddp_mp_model, x, y, self.scaler, self.loss_fn)
        return self.stats_fn(loss, logits, y)

    def state(self) -> tuple[dict, dict] | None:
        """What rank 0 saves: the page's `model.module.state_dict()` (the whole replica, no 'module.' prefix),
        copied to the CPU, and the optimizer's state. The other ranks copy nothing (None). Under --zero every rank
        calls it: the optimizer's shards are consolidated on rank 0 first (a collective)."""
        optimizer = optimizer_state(self.optimizer)
        if idr_torch.rank != 0:
            return None
        if self.scaler is not None:
            optimizer["grad_scaler"] = self.scaler.state_dict()  # resuming fp16 goes on with the same scale
        return {k: v.cpu() for k, v in self.ddp_mp_model.module.state_dict().items()}, optimizer

    # ---- beyond the page: evaluation, timing, memory, the replica check, the record
    @torch.no_grad()
    def eval_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.model.eval()  # the Pipe directly, not DDP: no collectives per batch
        logits = self.model(x.to(self.first_part_device, non_blocking=True))
        self.model.train()
        self.watchdog.tick(self.steps)
        y = y.to(self.last_part_device, non_blocking=True)
        return self.stats_fn(None, logits, y)

    def describe(self) -> str:
        return (f"{self.dp_size} replica(s), nb_part {self.nb_part}, {options_text(self.cfg, self.dp_size)} "
                f"({'cpu' if self.plan.cpu else 'GPUs ' + ','.join(self.plan.node_gpus)} on rank 0), engine "
                f"{self.engine}: " + " | ".join(f"{self.plan.device(i)}: {c}"
                                                 for i, c in enumerate(self.plan.contents)))

    def synchronize(self) -> None:
        if not self.plan.cpu:
            for d in self.plan.devices:
                torch.cuda.synchronize(d)

    def peak_memory_gb(self) -> float:
        return 0.0 if self.plan.cpu else max(torch.cuda.max_memory_allocated(d) for d in self.plan.devices) / 2**30

    def divergence(self) -> float:
        return divergence(fingerprint([self.model]).to(self.stats_device), None, self.dp_size)

    def placement(self, launch: idr_torch.Launch) -> dict:
        return {"rank": launch.rank, "node": launch.node_id, "host": os.uname().nodename, "nb_part": self.nb_part,
                "devices": [self.plan.device(i) for i in range(self.nb_part)], "node_gpus": self.plan.node_gpus,
                **cpu_placement(launch)}

    def record(self) -> dict:
        return {"layout": self.name, "engine": self.engine, "nb_part": self.nb_part, "pp": None,
                "schedule": "gpipe", "gpus": idr_torch.size * self.nb_part, "estimated_mem_gb": self.estimate_gib}

    def close(self) -> None:
        if getattr(self, "watchdog", None):
            self.watchdog.stop()
        self.model.close()

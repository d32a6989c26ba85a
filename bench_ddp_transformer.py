#!/usr/bin/env python
"""
Hybrid pipeline + data parallel training of a transformer classifier on IMDB: the IDRIS page's benchmark.
One task per model replica; each replica's model is split over the task's GPUs with a GPipe Pipe; the
replicas train together with DistributedDataParallel. Runs on current PyTorch (fairscale's Pipe) and on
torch <= 2.3 (the page's torch.distributed.pipeline.sync.Pipe), on GPUs (nccl) or on the CPU (gloo).

On a Slurm cluster (one task per replica; GPUs per task = GPUs per node // tasks per node):
    srun python check_topology.py --nlayers 16 --chunks 4 --batch-size 64     # pre-flight, then:
    srun python bench_ddp_transformer.py --nlayers 16 --chunks 4 --batch-size 64 --data-dir $DSDIR/IMDB
One machine:
    torchrun --nproc-per-node 2 bench_ddp_transformer.py --chunks 4
One replica, no GPU, no data (the synthetic corpus; the model still split in 2 parts on the CPU):
    python bench_ddp_transformer.py
The trainer's verdict on its arguments alone, without importing torch (docs/arguments.md):
    python bench_ddp_transformer.py --check-args --nlayers 16 --chunks 4 --batch-size 64
A task per GPU instead (torch.distributed.pipelining): bench_stage.py, which reuses this file's model and loop.

This file is the page's code, in the page's order: the model (Encoder, Layer, Decoder), the process group,
nb_part / first_part / last_part and the module_list loop, the Pipe, DDP, the training step, saving and loading.
What the page does not have is in kit/train/, one concern a module (docs/architecture.md): the data and its cache
(data), checkpoints and resume (checkpoint), the stop signals and the watchdog (signals), the tasks' meeting
(launch), the Pipe engines (pipe), precision, checkpointing and ZeRO (options), the loop both layouts share (loop),
the JSON record (records). The plan and the checks are the checker's own (kit.plan, kit.trainer_checks).
"""
from __future__ import annotations

import sys

# The stop signals (SIGUSR1 before the time limit, SIGTERM, SIGINT) are held from here, the first statements: they
# can come while torch imports or the tasks meet, where their default actions would kill the task and the job would
# not be requeued (kit/train/signals.py, the standard library only, says how they are acted on).
try:
    from kit.train.signals import hold_stop_signals
except ImportError as exc:  # copied alone: the kit is a folder (README, step 2)
    sys.exit(f"bench_ddp_transformer: error: {exc}: copy the kit's whole folder (the scripts and kit/ beside them)")
if __name__ == "__main__":
    hold_stop_signals()

if __name__ == "__main__" and "--check-args" in sys.argv[1:]:  # judge the arguments as main() does, without torch
    import kit.trainer_checks
    sys.exit(kit.trainer_checks.check_args_main("replica", sys.argv[1:]))

import argparse
import gc
import math
import os
import socket
import traceback
import warnings
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

try:  # before kit.train, which uses it
    import psutil  # noqa: F401 (kit.train uses it)
except ImportError:  # a cluster's PyTorch module brings torch, not this: one line, not a traceback
    sys.exit("bench_ddp_transformer: error: psutil is missing (it measures memory and start-up): "
             "pip install --user psutil")

import idr_torch
import kit.arguments
import kit.plan
import kit.trainer_checks
from kit.train.checkpoint import SaveLock, check_last_save, check_outputs, real_paths
from kit.train.data import data_source
from kit.train.errors import LostContact, RunError, cli, first_line, log
from kit.train.launch import (HOST_GROUP, TASK_GPUS, Watchdog, agree, check_rendezvous, is_comm_error, nccl_environment,
                               rendezvous_deadline, report_hangs)
from kit.train.loop import Trainer, divergence, fingerprint, train
from kit.train.options import (CheckpointedLayer, Part, make_optimizer, make_scaler, memory_estimate, optimizer_state,
    options_text)
from kit.train.own import (OwnModel, kit_loss, own_memory_estimate, own_parts, resolve_model, synthetic_loss,
    synthetic_stats)
from kit.train.pipe import OPEN_PIPES, PipeModel, init_rpc_for_pipe, pick_engine
from kit.train.setup import cpu_placement, cpu_threads, make_plan, resolve

# torch 2.3's DDP warns about its own internal use of the gloo backend object; nothing a user can act on
warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")


# the model of the page: Encoder on the task's first GPU, Layer blocks split by the plan, Decoder on its last
class Encoder(nn.Module):
    """Token embedding + sinusoidal positions.

    Not scaled by sqrt(d_model) (the Transformer paper's tied-embedding habit): nn.Embedding starts at N(0, 1), so
    the scale made each token 32 times larger than its position at d_model 1024 and drowned the positional table
    (ARCHITECTURE post-ln/2)."""

    def __init__(self, ntokens: int, d_model: int, dropout: float, seq_len: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(ntokens, d_model)
        position = torch.arange(seq_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(seq_len, d_model)
        pe[:, 0::2] = torch.sin(position * div)
        pe[:, 1::2] = torch.cos(position * div)
        self.register_buffer("pe", pe, persistent=False)  # derived, not saved
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.embedding(tokens) + self.pe[: tokens.size(1)])


def Layer(d_model: int, n_head: int, d_hid: int, dropout: float, checkpointing: bool = False) -> nn.Module:
    """One transformer block (batch first: Pipe cuts micro-batches along dim 0); with --activation-checkpointing
    a CheckpointedLayer (below), the same block that recomputes its activations in backward."""
    block = CheckpointedLayer if checkpointing else nn.TransformerEncoderLayer
    return block(d_model, n_head, d_hid, dropout, batch_first=True)


class Decoder(nn.Module):
    """Mean over positions, then a 2-class head (negative / positive review)."""

    def __init__(self, d_model: int, d_hid: int, nclasses: int = 2) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Linear(d_model, d_hid), nn.ReLU(), nn.Linear(d_hid, nclasses))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.mean(dim=1))


# the page's path, in its order
def use_gpus(plan: kit.plan.TaskPlan) -> None:
    """torch.cuda.set_device(first_part) before anything touches CUDA (both trainers' main() call it right after the
    plan). Without it every CUDA call that takes no device (a context, a pinned-memory thread, an object collective)
    lands on cuda:0, whatever GPUs the task owns; tests/test_gpu_rules.py checks it for every task of a node."""
    TASK_GPUS[:] = [] if plan.cpu else list(dict.fromkeys(plan.devices))
    if TASK_GPUS:
        torch.cuda.set_device(plan.first_part)


def init_distributed(timeout: float, cuda: bool) -> None:
    """The page's dist.init_process_group(backend='nccl', init_method='env://', world_size=idr_torch.size,
    rank=idr_torch.rank); gloo where there is no GPU.

    device_id= binds the nccl group to one GPU: its communicator is created here (an error shows at start-up, not
    at the first collective), barrier() uses it, and subgroups are split from it. But any collective on another GPU
    then raises "Attempt to perform collective on tensor not on device passed to init_process_group"
    (ProcessGroupNCCL::getNCCLComm, every release from 2.3.1 to 2.14.1), and DDP all-reduces each bucket on the GPU
    of its parameters: so only a task whose parts are all on one GPU binds (nb_part 1, the stage layout, --devices
    0,0); the page's multi-GPU replica does not."""
    if cuda:
        log(f"nccl: {nccl_environment()}")
    report_hangs()
    idr_torch.export_env()  # MASTER_ADDR/PORT (kept if already set), RANK, WORLD_SIZE, LOCAL_RANK
    bind = {"device_id": torch.device("cuda", TASK_GPUS[0])} if cuda and len(TASK_GPUS) == 1 else {}
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://", world_size=idr_torch.size,
                            rank=idr_torch.rank, timeout=timedelta(seconds=timeout), **bind)
    # The CPU side's collectives (the stop flag, Python objects, the data barrier) run on gloo: on nccl an object
    # collective goes to the current device and syncs its stream (_object_to_tensor(obj, "cuda") in 2.3.1 to
    # 2.14.1), and a barrier picks a GPU by its own guess (see load_corpus).
    HOST_GROUP[:] = [dist.new_group(backend="gloo") if cuda else None]


def build_module_list(cfg: argparse.Namespace, plan: kit.plan.TaskPlan) -> list[nn.Sequential]:
    """The page's loop: one nn.Sequential per part, each on its GPU. The plan comes from check_topology (the
    checker approves exactly what runs). Modules are created in the same order whatever the split, so one seed
    gives one model."""
    # The number of parts into which the model will be sharded.
    # page: nb_part = torch.cuda.device_count() // int(os.environ['SLURM_NTASKS_PER_NODE'])
    # kit: the same, or --nb-part, or the GPUs Slurm bound to this task (--gpus-per-task)
    nb_part = plan.nb_part
    if plan.cpu and cfg.precision != "fp32":
        # the evaluation's TransformerEncoderLayer fast path (torch/nn/modules/transformer.py) is refused under
        # torch.is_autocast_enabled(), which sees CUDA's autocast only in some releases: torch 2.4.1 took it under
        # the CPU's and failed ("mat1 and mat2 must have the same dtype"). CUDA's autocast is seen everywhere.
        torch.backends.mha.set_fastpath_enabled(False)
    # The GPU I.D. number into which the first part of the model will go.
    # page: first_part = idr_torch.local_rank * nb_part    kit: the same, or 0 when Slurm bound GPUs per task
    first_part = plan.first_part
    # The GPU I.D. number into which the last part of the model will go.   page: first_part + nb_part - 1
    last_part = plan.last_part
    # page: partition_len = max(nlayers / nb_part, 1), a float: with nlayers % nb_part != 0 it puts layers of
    # two GPUs in one partition. kit: a balanced integer split, the page's own whenever nlayers % nb_part == 0.
    layer_part = kit.plan.split_layers(cfg.nlayers, nb_part)  # the part of each Layer block
    gpu = (lambda index: "cpu") if plan.cpu else (lambda index: f"cuda:{index}")

    module_list = []
    # The encoder will always be loaded by the first GPU
    tmp_list = [Encoder(cfg.vocab_size, cfg.d_model, cfg.dropout, cfg.seq_len).to(gpu(first_part))]
    # Add all the model transformer blocks; they will be loaded by the appropriate GPU
    for i in range(cfg.nlayers):
        transformer_block = Layer(cfg.d_model, cfg.n_head, cfg.d_hid, cfg.dropout, cfg.activation_checkpointing)
        if i != 0 and layer_part[i] != layer_part[i - 1]:
            module_list.append(nn.Sequential(*tmp_list))
            tmp_list = []
        device = layer_part[i]
        # page: .to(first_part + device); plan.devices[device] is that GPU (or the one --devices names)
        tmp_list.append(transformer_block.to(gpu(plan.devices[device] if plan.devices else first_part + device)))
    # The model's head always goes into the last GPU (the checker refuses nlayers < nb_part: no part is empty)
    tmp_list.append(Decoder(cfg.d_model, cfg.d_hid).to(gpu(last_part)))
    module_list.append(nn.Sequential(*tmp_list))
    # --precision: each part runs under autocast (Part, below: the same Sequential, the same keys)
    return [Part(*part, precision=cfg.precision) for part in module_list]


class Replica:
    """The page's layout: this task holds one whole replica, split over its GPUs by a Pipe; DDP across tasks.
    The training loop (train() below) drives it through the Trainer protocol, as it drives bench_stage.py's Stages."""
    name = "replica"
    equal_batches = False  # the Pipe takes a short last batch

    def __init__(self, cfg: argparse.Namespace, plan: kit.plan.TaskPlan, engine: str,
                 own: OwnModel | None = None) -> None:
        self.cfg, self.plan, self.engine, self.own = cfg, plan, engine, own
        self.nb_part, self.dp_size, self.dp_rank = plan.nb_part, idr_torch.size, idr_torch.rank
        # the devices of the page's first_part (inputs) and last_part (labels, loss, accuracy)
        self.first_part_device, self.last_part_device = plan.device(0), plan.device(plan.nb_part - 1)
        self.stats_device = self.last_part_device
        torch.manual_seed(cfg.seed)  # same initial weights on every replica (DDP also broadcasts rank 0's)
        # model = Pipe(nn.Sequential(*module_list), chunks=args.chunks, checkpoint="never")
        # --model: the user's layers cut by the checker's split (kit.train.own), else the page's module_list
        module_list = own_parts(cfg, plan, own) if own else build_module_list(cfg, plan)
        self.model = PipeModel(module_list, engine, cfg.chunks, [plan.device(i) for i in range(plan.nb_part)])
        # the loss and the step's figures: the kit's, or a --model's stand-ins on synthetic batches
        self.loss_fn, self.stats_fn = (kit_loss, step_stats) if own is None or own.kit_data else (synthetic_loss,
                                                                                                 synthetic_stats)
        # beyond the page: --zero shards AdamW's state over the replicas; fp16 comes with a GradScaler
        self.optimizer = make_optimizer(self.model.parameters(), cfg.lr, cfg.zero)
        self.scaler = make_scaler(cfg.precision, "cpu" if plan.cpu else "cuda")
        self.memory, self.estimate_gib = (own_memory_estimate if own else memory_estimate)(cfg, plan, self.nb_part,
                                                                                          self.dp_size)
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

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One step; returns (loss x samples, correct, samples) on the device, never read here."""
        # the inputs go to the GPU of first_part, the labels to the GPU of last_part (where the output comes out)
        x, y = x.to(self.first_part_device, non_blocking=True), y.to(self.last_part_device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        loss, logits = forward_backward(self.ddp_mp_model, x, y, self.scaler, self.loss_fn)
        if self.scaler is None:
            self.optimizer.step()
        else:  # fp16: unscale the gradients, skip the step if one overflowed, adapt the scale
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.steps += 1
        self.watchdog.tick(self.steps)
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

    def set_lr(self, lr: float) -> None:
        """The schedule's rate for the next step (lr_at). A plain float in each group: no tensor, no host sync; under
        --zero the wrapper's groups, which ZeroRedundancyOptimizer.step() copies into its local AdamW."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

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
                **cpu_placement()}

    def record(self) -> dict:
        return {"layout": self.name, "engine": self.engine, "nb_part": self.nb_part, "pp": None,
                "schedule": "gpipe", "gpus": idr_torch.size * self.nb_part, "estimated_mem_gb": self.estimate_gib}

    def close(self) -> None:
        if getattr(self, "watchdog", None):
            self.watchdog.stop()
        self.model.close()


def step_stats(loss: torch.Tensor | None, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(loss x samples, correct, samples) of a training step, (correct, samples) of an evaluation step: on the
    device, never read here. Nothing is built from host data: torch.tensor(len(y), device=...) was a synchronous
    host-to-device copy every step (9-20 % of a host-bound bf16 step on an H200); torch.full is a fill kernel whose
    value travels as a kernel argument. tests/test_train.py records the step's ops to hold it."""
    count = torch.full((), len(y), dtype=torch.float32, device=logits.device)
    correct = (logits.argmax(1) == y).sum().float()
    return torch.stack([correct, count] if loss is None else [loss * len(y), correct, count])


def forward_backward(ddp_mp_model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                     scaler: torch.amp.GradScaler | None = None,
                     loss_fn: Callable = kit_loss) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's forward and backward; returns the loss and the logits (detached). The loss is computed in fp32
    whatever --precision (kit_loss: cross-entropy; a --model on synthetic batches: synthetic_loss); under fp16 the
    GradScaler scales it before backward."""
    logits = ddp_mp_model(x)
    loss = loss_fn(logits, y)
    (loss if scaler is None else scaler.scale(loss)).backward()
    return loss.detach(), logits.detach()


def main(argv: list[str] | None = None) -> int:
    """Arguments and check_topology's verdict before anything is started, then the page's steps (run())."""
    cfg = parse_args(argv)
    if cfg.check_args:
        return kit.trainer_checks.check_args_main("replica", sys.argv[1:] if argv is None else argv)
    cuda = torch.cuda.is_available()
    resolve(cfg, cuda)
    plan = make_plan(cfg, cuda)  # nb_part, first_part, last_part of this task, or one clear error
    own = resolve_model(cfg, plan.nb_part)  # --model: loads, takes --sample, fills the parts; else exit 2
    if own:
        plan.own = own.plan.contents
    engine = pick_engine(cfg.engine)
    use_gpus(plan)  # torch.cuda.set_device(first_part), before anything touches CUDA
    return run(cfg, cuda, engine, lambda: Replica(cfg, plan, engine, own))


def run(cfg: argparse.Namespace, cuda: bool, engine: str, make_trainer: Callable[[], "Trainer"]) -> int:
    """init_process_group, init_rpc where the engine needs it, the model, train(); then tear down whatever was
    built, on every exit path (a Pipe left alive hangs the process at exit)."""
    launch = idr_torch.current()
    lock = trainer = rpc_file = None
    try:
        problem = source = None
        try:  # what this task writes or reads alone: said after the tasks meet, by agree(). Every error here is
            # carried to the meeting: a task that ended before it would leave the others waiting for --timeout
            real_paths(cfg)
            if launch.rank == 0:  # rank 0 writes --save and --json-out
                check_outputs(cfg)
                lock = SaveLock.take(cfg.save) if cfg.save else None
            source = data_source(cfg)
        except RunError as exc:
            problem = str(exc)
        except Exception as exc:  # not one of the kit's (a bug): its traceback here, and the others told at once
            if launch.size == 1:
                raise
            traceback.print_exc()
            problem = f"{type(exc).__name__}: {first_line(exc)[:200]} (its traceback is above)"
        torch.set_num_threads(cpu_threads(launch))
        # --tf32: fp32 matmuls on TF32 tensor cores where the GPU has them (compute capability >= 8.0); off by
        # default (torch's own default since 1.12, and the page's), nothing to do on the CPU or a V100
        torch.backends.cuda.matmul.allow_tf32 = bool(cfg.tf32)
        check_rendezvous(launch, cfg.timeout)
        with rendezvous_deadline(launch, cfg.timeout):
            init_distributed(cfg.timeout, cuda)
        agree(problem, launch)
        rpc_file = init_rpc_for_pipe() if engine == "torch-pipe" else None
        trainer = make_trainer()
        code = train(cfg, trainer, launch, source, cuda)
        if code == 0:
            check_last_save(cfg)  # a run whose last saves failed does not end as if its checkpoint were current
        return code
    except RuntimeError as exc:
        if launch.size > 1 and is_comm_error(exc):
            raise LostContact(f"task {launch.rank} on {socket.gethostname()} lost contact with the others "
                              f"({first_line(exc)[:200]}): a task died or hung, so every task stops instead of "
                              f"waiting for the time limit; start again with --resume to continue from the last "
                              f"checkpoint") from None
        raise
    finally:
        if trainer is not None:
            trainer.close()
        for model in list(OPEN_PIPES):  # built by a trainer whose construction failed
            model.close()
        del trainer
        gc.collect()
        if rpc_file is not None:
            import torch.distributed.rpc as rpc
            rpc.shutdown(graceful=False)
            rpc_file.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        if lock is not None:
            lock.release()


# Beyond the page: arguments, data and cache, checks, checkpoints and resume, stop signals, the training loop
# (shared with bench_stage.py), the replica fingerprint, the JSON record.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, from check_topology's one definition of them (kit.arguments.ARGS: names, types, ranges, GPU and
    CPU defaults); a line it refuses raises kit.arguments.ArgumentError, one line that cli() prints (exit 2)."""
    return kit.arguments.parse_trainer_args("replica", argv, __doc__)


if __name__ == "__main__":
    cli(main, "bench_ddp_transformer")

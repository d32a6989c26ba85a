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
A task per GPU instead (torch.distributed.pipelining): bench_stage.py, which reuses this file's model and loop.

The page's code comes first, in the page's order: process group and RPC, nb_part / first_part / last_part,
the module_list loop, the Pipe, DDP, the training step, saving and loading. Everything the page does not
have (data and cache, checkpoints and resume, stop signals, the JSON record) comes after main().
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import hashlib
import json
import math
import os
import random
import re
import signal
import sys
import tarfile
import tempfile
import threading
import time
import warnings
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

# The page's Pipe, torch.distributed.pipeline.sync.Pipe, exists up to torch 2.3 (removed in 2.4); fairscale.nn.Pipe
# is the library it was upstreamed from, same GPipe and arguments, and runs on current torch. --engine picks one
# (auto: the page's where it exists); pick_engine() below says what to install when the chosen one is missing.
with warnings.catch_warnings():  # both announce their own deprecation on import: known, nothing to act on
    warnings.simplefilter("ignore")
    try:
        from torch.distributed.pipeline.sync import Pipe as TorchPipe
    except ImportError:  # torch >= 2.4
        TorchPipe = None
    try:
        from fairscale.nn import Pipe as FairscalePipe
    except ImportError:  # pip install --user fairscale
        FairscalePipe = None

try:
    import psutil
except ImportError:  # a cluster's PyTorch module brings torch, not this: one line, not a traceback
    sys.exit("bench_ddp_transformer: error: psutil is missing (it measures memory and start-up): "
             "pip install --user psutil")

# torch 2.3's DDP warns about its own internal use of the gloo backend object; nothing a user can act on
warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")

import check_topology
import idr_torch  # the page's idr_torch: rank, size, local_rank, cpus_per_task from Slurm (or torchrun)

CACHE_FORMAT = 2  # bump when the tokenised cache layout changes
RESUME_FORMAT = "bench_ddp_transformer/resume/1"  # the companion file of --save (what resuming needs)
HOST_GROUP: list = [None]  # the gloo group for CPU-side collectives (None: the default group is gloo already)


class RunError(Exception):
    """A user-facing error: one line that names the value and the fix."""


class LostContact(RunError):
    """A collective failed: each surviving task says so (rank 0 may be the one that died)."""


def log(*msg: object) -> None:
    """Print from rank 0 only (Slurm merges every task's stdout into one file)."""
    if idr_torch.rank == 0:
        print(*msg, flush=True)


def pick_engine(requested: str) -> str:
    """--engine auto|torch-pipe|fairscale to the engine that runs here, or one line saying what to install."""
    if requested == "torch-pipe" and TorchPipe is None:  # the line of check_topology.TORCH_FEATURES
        missing = check_topology.torch_refusals(torch.__version__, check_topology.Training(engine="torch-pipe"))
        raise RunError(missing[0] if missing else f"--engine torch-pipe: torch.distributed.pipeline.sync does not "
                       f"load in this torch {torch.__version__}; use --engine fairscale (or auto)")
    engine = ("torch-pipe" if TorchPipe is not None else "fairscale") if requested == "auto" else requested
    if engine == "fairscale" and FairscalePipe is None:
        raise RunError("--engine fairscale needs fairscale next to this torch: pip install --user fairscale"
                       + ("" if TorchPipe is None else ", or use --engine torch-pipe"))
    return engine


# ----------------------------------------------------------------------------------------------------------------
# the model of the page: Encoder on the task's first GPU, Layer blocks split by the plan, Decoder on its last
class Encoder(nn.Module):
    """Token embedding + sinusoidal positions."""

    def __init__(self, ntokens: int, d_model: int, dropout: float, seq_len: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(ntokens, d_model)
        self.scale = math.sqrt(d_model)
        position = torch.arange(seq_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(seq_len, d_model)
        pe[:, 0::2] = torch.sin(position * div)
        pe[:, 1::2] = torch.cos(position * div)
        self.register_buffer("pe", pe, persistent=False)  # derived, not saved
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.embedding(tokens) * self.scale + self.pe[: tokens.size(1)])


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


# ----------------------------------------------------------------------------------------------------------------
# the page's path, in its order
def init_distributed(timeout: float, cuda: bool) -> None:
    """The page's dist.init_process_group(backend='nccl', init_method='env://', world_size=idr_torch.size,
    rank=idr_torch.rank); gloo where there is no GPU."""
    if cuda:  # a collective whose peer died fails after `timeout` instead of blocking forever
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    idr_torch.export_env()  # MASTER_ADDR/PORT (kept if already set), RANK, WORLD_SIZE, LOCAL_RANK
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://", world_size=idr_torch.size,
                            rank=idr_torch.rank, timeout=timedelta(seconds=timeout))
    # Python objects (RNG states, placements) and the stop flag travel on the CPU: nccl would put them on
    # cuda:0 of every task, one GPU shared by the node's tasks (nccl refuses that), and sync the GPU stream.
    HOST_GROUP[:] = [dist.new_group(backend="gloo") if cuda else None]


def init_rpc_for_pipe() -> tempfile.NamedTemporaryFile:
    """torch <= 2.3's Pipe needs RPC in the process, even alone: the page's per-process file:// store.
    _transports=["shm", "uv"] as on Jean Zay (no "ibv"); CUDA channels only where CUDA exists."""
    import torch.distributed.rpc as rpc
    tmpfile = tempfile.NamedTemporaryFile()
    channels = ["cuda_ipc", "cuda_basic", "basic"] if torch.cuda.is_available() else ["basic"]
    rpc.init_rpc(name="worker", rank=0, world_size=1, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
        init_method=f"file://{tmpfile.name}", _transports=["shm", "uv"], _channels=channels))
    return tmpfile


def build_module_list(cfg: argparse.Namespace, plan: check_topology.TaskPlan) -> list[nn.Sequential]:
    """The page's loop: one nn.Sequential per part, each on its GPU. The plan comes from check_topology (the
    checker approves exactly what runs). Modules are created in the same order whatever the split, so one seed
    gives one model."""
    # The number of parts into which the model will be sharded.
    # page: nb_part = torch.cuda.device_count() // int(os.environ['SLURM_NTASKS_PER_NODE'])
    # kit: the same, or --nb-part, or the GPUs Slurm bound to this task (--gpus-per-task)
    nb_part = plan.nb_part
    # The GPU I.D. number into which the first part of the model will go.
    # page: first_part = idr_torch.local_rank * nb_part    kit: the same, or 0 when Slurm bound GPUs per task
    first_part = plan.first_part
    # The GPU I.D. number into which the last part of the model will go.   page: first_part + nb_part - 1
    last_part = plan.last_part
    # page: partition_len = max(nlayers / nb_part, 1), a float: with nlayers % nb_part != 0 it puts layers of
    # two GPUs in one partition. kit: a balanced integer split, the page's own whenever nlayers % nb_part == 0.
    layer_part = check_topology.split_layers(cfg.nlayers, nb_part)  # the part of each Layer block
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


class PipeModel(nn.Sequential):
    """The page's `Pipe(nn.Sequential(*module_list), chunks, checkpoint="never")`.

    It *is* that nn.Sequential for DDP and for state_dict() (keys '0.0.embedding.weight', '1.3.linear1.bias',
    ... whatever the engine), and runs forward through the engine's Pipe, which shares its modules.
    checkpoint="never", as the page says, "so that it can work with DDP": the Pipe's checkpointing is reentrant
    (a nested backward over each part, once per micro-batch), and DDP refuses a parameter made ready twice in one
    step (measured: see CheckpointedLayer). The price is every micro-batch's activations, alive until its
    backward; --activation-checkpointing gets the saving back inside each Layer, in the way DDP supports.
    """

    def __init__(self, module_list: list[nn.Sequential], engine: str, chunks: int,
                 devices: list[str]) -> None:
        super().__init__(*module_list)
        before = set(threading.enumerate())
        if engine == "torch-pipe":
            pipe = TorchPipe(nn.Sequential(*module_list), chunks=chunks, checkpoint="never")
        else:
            with warnings.catch_warnings():  # "upstreamed to PyTorch": not on torch >= 2.4, it was removed
                warnings.simplefilter("ignore", DeprecationWarning)
                pipe = FairscalePipe(nn.Sequential(*module_list), balance=[1] * len(module_list), devices=devices,
                                     chunks=chunks, checkpoint="never")
        object.__setattr__(self, "pipe", pipe)  # not a registered child: parameters and keys stay ours
        self.engine = engine
        self.workers = [t for t in threading.enumerate() if t not in before]  # the Pipe's per-device threads

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.pipe(tokens)
        return out.local_value() if self.engine == "torch-pipe" else out  # torch's Pipe returns an RRef

    def close(self) -> None:
        """Stop the Pipe's worker threads now, before the interpreter exits.

        Both engines run one worker thread per device. fairscale stops them only in Pipeline.__del__, torch
        2.3 never (daemon threads). A worker keeps its last task in its frame, which keeps the pipeline alive,
        so __del__ never runs: at exit the process hangs, or a daemon worker still running when the interpreter
        finalises aborts it with "terminate called without an active exception" (seen with fairscale 0.4.13 on
        torch 2.13). None is the workers' own stop signal and (False, None) their last reply; then we join them."""
        pipe = self.__dict__.pop("pipe", None)
        pipeline = getattr(pipe, "pipeline", None)
        if pipeline is not None:
            for q in set(getattr(pipeline, "in_queues", [])):
                q.put(None)
            for q in set(getattr(pipeline, "out_queues", [])):
                while q.get(timeout=60) != (False, None):
                    pass
            pipeline.in_queues, pipeline.out_queues = [], []  # nothing left for fairscale's __del__ to join
        for t in self.workers:
            t.join(timeout=60)
        self.workers = []
        del pipe, pipeline
        gc.collect()


class Replica:
    """The page's layout: this task holds one whole replica, split over its GPUs by a Pipe; DDP across tasks.
    The training loop (train() below) drives it; bench_stage.py's Stages has the same methods."""
    name = "replica"
    equal_batches = False  # the Pipe takes a short last batch

    def __init__(self, cfg: argparse.Namespace, plan: check_topology.TaskPlan, engine: str) -> None:
        self.cfg, self.plan, self.engine = cfg, plan, engine
        self.nb_part, self.dp_size, self.dp_rank = plan.nb_part, idr_torch.size, idr_torch.rank
        # the devices of the page's first_part (inputs) and last_part (labels, loss, accuracy)
        self.first_part_device, self.last_part_device = plan.device(0), plan.device(plan.nb_part - 1)
        self.stats_device = self.last_part_device
        torch.manual_seed(cfg.seed)  # same initial weights on every replica (DDP also broadcasts rank 0's)
        # model = Pipe(nn.Sequential(*module_list), chunks=args.chunks, checkpoint="never")
        self.model = PipeModel(build_module_list(cfg, plan), engine, cfg.chunks,
                               [plan.device(i) for i in range(plan.nb_part)])
        # beyond the page: --zero shards AdamW's state over the replicas; fp16 comes with a GradScaler
        self.optimizer = make_optimizer(self.model.parameters(), cfg.lr, cfg.zero)
        self.scaler = make_scaler(cfg.precision, "cpu" if plan.cpu else "cuda")
        self.memory, self.estimate_gib = memory_estimate(cfg, plan, self.nb_part, self.dp_size)
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
        # several devices (the page's "Important")
        self.ddp_mp_model = DistributedDataParallel(self.model)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One step; returns (loss x samples, correct, samples) on the device, never read here."""
        # the inputs go to the GPU of first_part, the labels to the GPU of last_part (where the output comes out)
        x, y = x.to(self.first_part_device, non_blocking=True), y.to(self.last_part_device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        loss, logits = forward_backward(self.ddp_mp_model, x, y, self.scaler)
        if self.scaler is None:
            self.optimizer.step()
        else:  # fp16: unscale the gradients, skip the step if one overflowed, adapt the scale
            self.scaler.step(self.optimizer)
            self.scaler.update()
        return torch.stack([loss * len(y), (logits.argmax(1) == y).sum(), torch.tensor(len(y), device=y.device)])

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
        y = y.to(self.last_part_device, non_blocking=True)
        return torch.stack([(logits.argmax(1) == y).sum(), torch.tensor(len(y), device=y.device)])

    def describe(self) -> str:
        return (f"{self.dp_size} replica(s), nb_part {self.nb_part}, {options_text(self.cfg, self.dp_size)} "
                f"({'cpu' if self.plan.cpu else 'GPUs ' + ','.join(self.plan.gpu_ids)} on rank 0), engine "
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
                "devices": [self.plan.device(i) for i in range(self.nb_part)], "gpu_ids": self.plan.gpu_ids}

    def record(self) -> dict:
        return {"layout": self.name, "engine": self.engine, "nb_part": self.nb_part, "pp": None,
                "schedule": "gpipe", "gpus": idr_torch.size * self.nb_part, "estimated_mem_gb": self.estimate_gib}

    def close(self) -> None:
        self.model.close()


def forward_backward(ddp_mp_model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                     scaler: torch.amp.GradScaler | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's forward and backward; returns the loss and the logits (detached). The loss is computed in fp32
    whatever --precision; under fp16 the GradScaler scales it before backward."""
    logits = ddp_mp_model(x)
    loss = F.cross_entropy(logits.float(), y)
    (loss if scaler is None else scaler.scale(loss)).backward()
    return loss.detach(), logits.detach()


def main(argv: list[str] | None = None) -> int:
    """Arguments and check_topology's verdict before anything is started, then the page's steps (run())."""
    cfg = parse_args(argv)
    cuda = torch.cuda.is_available()
    resolve(cfg, cuda)
    plan = make_plan(cfg, cuda)  # nb_part, first_part, last_part of this task, or one clear error
    engine = pick_engine(cfg.engine)
    return run(cfg, cuda, engine, lambda: Replica(cfg, plan, engine))


def run(cfg: argparse.Namespace, cuda: bool, engine: str, make_trainer: Callable[[], "Replica"]) -> int:
    """init_process_group, init_rpc where the engine needs it, the model, train(); then tear it all down, even
    on an error (a Pipe left alive hangs the process at exit)."""
    launch = idr_torch.current()
    check_save_path(cfg.save)
    source = data_source(cfg)
    torch.set_num_threads(cpu_threads(launch))
    init_distributed(cfg.timeout, cuda)
    rpc_file = init_rpc_for_pipe() if engine == "torch-pipe" else None
    trainer = None
    try:
        trainer = make_trainer()
        return train(cfg, trainer, launch, source, cuda)
    except RuntimeError as exc:
        if launch.size > 1 and is_comm_error(exc):
            raise LostContact(f"task {launch.rank} lost contact with the others ({first_line(exc)[:200]}): "
                              f"a task died or hung, so every task stops instead of waiting for the time limit; "
                              f"start again with --resume to continue from the last checkpoint") from None
        raise
    finally:
        if trainer is not None:
            trainer.close()
        del trainer
        gc.collect()
        if rpc_file is not None:
            import torch.distributed.rpc as rpc
            rpc.shutdown(graceful=False)
            rpc_file.close()
        if dist.is_initialized():
            dist.destroy_process_group()


# ================================================================================================================
# The page's closing advice as options: mixed precision (--precision), gradient checkpointing
# (--activation-checkpointing) and ZeRO (--zero). Small pieces, so the memory benchmarks can use them as they are.
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # check_topology.PRECISIONS' names


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """--precision's autocast for code on `device_type` ('cuda' or 'cpu'); fp32: none. Autocast computes in low
    precision from the fp32 weights, which stay fp32: checkpoints hold fp32 and load into any precision."""
    dtype = PRECISIONS[precision]
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


class CheckpointedLayer(nn.TransformerEncoderLayer):
    """A Layer for --activation-checkpointing: it keeps only its input for the backward pass and recomputes the
    rest there. Same parameters and state_dict keys as a plain Layer, so checkpoints move between the two.

    Non-reentrant torch.utils.checkpoint, which DDP supports "without any limitations"; the reentrant kind fails
    under DDP when a layer is checkpointed more than once per step (the note on gradient checkpointing in
    torch/nn/parallel/distributed.py). That is also why the Pipe's own checkpoint= must stay "never" under DDP:
    fairscale's (and torch 2.3's) Checkpoint.backward runs a nested torch.autograd.backward over the recomputed
    part (fairscale/nn/pipe/checkpoint.py), once per micro-batch, so DDP's hook sees each parameter ready once per
    micro-batch. Measured here (fairscale 0.4.13, torch 2.13, 2 processes, gloo): checkpoint="always" and
    "except_last" with chunks 2 fail in the first backward with "Expected to mark a variable ready only once".
    """

    def forward(self, src: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return super().forward(src, *args, **kwargs)
        return checkpoint(super().forward, src, *args, use_reentrant=False, **kwargs)


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


def training_of(cfg: argparse.Namespace, **layout: object) -> check_topology.Training:
    """This run's arguments as check_topology sees them on a trainer line (its checks and its memory model)."""
    model = {k: getattr(cfg, k) for k in ("d_model", "n_head", "d_hid", "seq_len", "vocab_size", "dropout")}
    return check_topology.Training(nlayers=cfg.nlayers, chunks=cfg.chunks, batch_size=cfg.batch_size,
                                   engine=getattr(cfg, "engine", "auto"), nb_part=getattr(cfg, "nb_part", None),
                                   precision=cfg.precision, activation_checkpointing=cfg.activation_checkpointing,
                                   zero=cfg.zero, model=model, **layout)


def memory_estimate(cfg: argparse.Namespace, plan: check_topology.TaskPlan, nb_part: int, replicas: int,
                    **layout: object) -> tuple[str, float]:
    """check_topology's estimate of one GPU's peak for this run (nb_part is --pp in the stage layout): the start-up
    line and the worst GPU's GiB, with the kernels this device runs (check_topology.ARCHS), against its memory."""
    t = training_of(cfg, **layout)
    model = check_topology.model_args(t)
    if plan.cpu:
        arch, gpu_gib = "cpu", None
    else:
        device = plan.device(0)
        arch = "sm80" if torch.cuda.get_device_capability(device) >= (8, 0) else "sm70"
        gpu_gib = torch.cuda.get_device_properties(device).total_memory / check_topology.GIB
    release = check_topology.version_tuple(torch.__version__)
    line = check_topology.memory_line(model, t, nb_part, replicas, gpu_gib, arch, release)
    return line, check_topology.worst_part(model, t, nb_part, replicas, arch, release).total / check_topology.GIB


def check_precision(cfg: argparse.Namespace, plan: check_topology.TaskPlan) -> None:
    """What only the GPU itself can refuse: bf16 where it has none (V100, compute capability 7.0)."""
    if cfg.precision == "bf16" and not plan.cpu and torch.cuda.get_device_capability(plan.device(0)) < (8, 0):
        raise RunError(f"--precision bf16: this GPU ({torch.cuda.get_device_name(plan.device(0))}) has no bf16; use "
                       "--precision fp16 (autocast with a GradScaler)")


def options_text(cfg: argparse.Namespace, replicas: int) -> str:
    """The page's memory techniques this run uses, for the start-up line."""
    return (f"precision {cfg.precision}, activation checkpointing {'on' if cfg.activation_checkpointing else 'off'}, "
            + (f"ZeroRedundancyOptimizer(AdamW) over {replicas} replica(s)" if cfg.zero else "AdamW"))


# ================================================================================================================
# Beyond the page: arguments, data and cache, checks, checkpoints and resume, stop signals, the training loop
# (shared with bench_stage.py), the replica fingerprint, the JSON record.


def base_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments both trainers take. None means "the GPU or CPU default": check_topology.GPU_DEFAULTS /
    CPU_DEFAULTS, the one table of them, which the help shows."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    gpu, cpu = check_topology.GPU_DEFAULTS, check_topology.CPU_DEFAULTS
    for name, kind, text in [("--nlayers", int, "Layer blocks"), ("--d-model", int, "width"),
                             ("--n-head", int, "attention heads"), ("--d-hid", int, "feed-forward width"),
                             ("--dropout", float, "dropout (on the CPU its masks cost as much as the matmuls)"),
                             ("--seq-len", int, "tokens per review"),
                             ("--vocab-size", int, "vocabulary incl. <pad>,<unk>"),
                             ("--chunks", int, "micro-batches per batch: 1 = naive model parallel"),
                             ("--batch-size", int, "samples per step per replica")]:
        key = name[2:].replace("-", "_")
        a(name, type=kind, help=f"{text} (default: GPU {gpu[key]}, CPU {cpu[key]})")
    a("--precision", choices=check_topology.PRECISIONS, default="fp32",
      help="autocast: bf16 (A100, H100, CPU), or fp16 with a GradScaler (V100 has no bf16); weights stay fp32")
    a("--activation-checkpointing", action="store_true",
      help="each Layer keeps only its input and recomputes the rest in backward (torch.utils.checkpoint)")
    a("--zero", action="store_true", help="ZeroRedundancyOptimizer: AdamW's state sharded over the replicas")
    a("--epochs", type=int, default=3)
    a("--max-steps", type=int, default=0, help="stop after this many steps in all (0: no limit)")
    a("--warmup-steps", type=int, default=3, help="steps left out of the timing (allocator, autotuning)")
    a("--lr", type=float, default=1e-3)
    a("--seed", type=int, default=1234)
    a("--data-dir", help="aclImdb/ or aclImdb_v1.tar.gz, or a folder holding one (default $DSDIR/IMDB)")
    a("--cache-dir", help="where the tokenised corpus is cached (default $SCRATCH, else the data's folder "
      "if writable, else ./.cache)")
    a("--synthetic", type=int, default=0, help="N synthetic reviews instead of IMDB (default when no data: 4000)")
    a("--workers", type=int, default=-1, help="DataLoader workers (-1: from cpus_per_task on GPU, 0 on CPU)")
    a("--timeout", type=float, default=600, help="seconds before a collective with a dead rank gives up")
    a("--log-every", type=float, default=30, help="seconds between progress lines within an epoch")
    a("--json-out", help="append one JSON line with the configuration and results (rank 0)")
    a("--save", help="write the checkpoint here after each epoch (rank 0, atomically)")
    a("--load", help="start from this checkpoint (every rank loads it)")
    a("--resume", action="store_true", help="start from the --save file if it exists (a requeued job continues)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__)
    p.add_argument("--nb-part", type=int, help="GPUs per replica (default: the page's GPUs per node // tasks "
                   f"per node; CPU {check_topology.CPU_NB_PART})")
    p.add_argument("--engine", choices=check_topology.ENGINES, default="auto",
                   help="auto: torch-pipe on torch <= 2.3, else fairscale")
    p.add_argument("--devices", help="visible GPU index of each part instead of the page's indexing; 0,0 puts both "
                   "parts on one GPU (benchmarks/gpu_check.py on a one-GPU node)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------------
# data: IMDB from a local folder or tarball (compute nodes have no internet), else a learnable synthetic corpus
_PATTERNS = [(re.compile(p), r) for p, r in [
    (r"\'", " '  "), (r"\"", ""), (r"\.", " . "), (r"<br \/>", " "), (r",", " , "), (r"\(", " ( "), (r"\)", " ) "),
    (r"\!", " ! "), (r"\?", " ? "), (r"\;", " "), (r"\:", " "), (r"\s+", " ")]]
SPECIALS = ["<pad>", "<unk>"]


def basic_english(line: str) -> list[str]:
    """torchtext's basic_english tokenizer, for torch versions where torchtext can't load (it agrees token for
    token; a legacy-lane test checks it)."""
    line = line.lower()
    for pattern, repl in _PATTERNS:
        line = pattern.sub(repl, line)
    return line.split()


def build_vocab(token_lists: list[list[str]], max_tokens: int) -> list[str]:
    """build_vocab_from_iterator(specials=["<pad>", "<unk>"], max_tokens=...): by frequency, ties A-Z."""
    counter = Counter()
    for tokens in token_lists:
        counter.update(tokens)
    ranked = sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))[: max_tokens - len(SPECIALS)]
    return SPECIALS + [w for w, _ in ranked if w not in SPECIALS]


def get_tokenizer() -> tuple[str, object]:
    """torchtext's basic_english where torchtext loads (the torch 2.3 lane), else the equivalent above."""
    try:
        import torchtext
        torchtext.disable_torchtext_deprecation_warning()  # we know: 0.18 is its last release
        from torchtext.data.utils import get_tokenizer as torchtext_tokenizer
        return "torchtext", torchtext_tokenizer("basic_english")
    except (ImportError, OSError, RuntimeError):  # not installed, or its C++ library doesn't load on torch >= 2.4
        return "builtin", basic_english


def make_vocab(tokenizer: str, token_lists: list[list[str]], max_tokens: int) -> list[str]:
    if tokenizer == "torchtext":
        from torchtext.vocab import build_vocab_from_iterator
        return build_vocab_from_iterator(token_lists, specials=SPECIALS, max_tokens=max_tokens).get_itos()
    return build_vocab(token_lists, max_tokens)


def encode(token_lists: list[list[str]], itos: list[str], seq_len: int) -> torch.Tensor:
    stoi = {w: i for i, w in enumerate(itos)}
    out = torch.zeros(len(token_lists), seq_len, dtype=torch.int32)  # 0 = <pad>
    for row, tokens in enumerate(token_lists):
        ids = [stoi.get(w, 1) for w in tokens[:seq_len]]
        if ids:
            out[row, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out


def find_imdb(data_dir: str) -> Path:
    """The aclImdb/ folder or aclImdb_v1.tar.gz that data_dir is or holds."""
    root = Path(data_dir).expanduser()
    for cand in (root, root / "aclImdb", root / "IMDB" / "aclImdb"):
        if (cand / "train").is_dir() and (cand / "test").is_dir():
            return cand
    for cand in (root, root / "aclImdb_v1.tar.gz", root / "IMDB" / "aclImdb_v1.tar.gz"):
        if cand.is_file() and cand.name.endswith((".tar.gz", ".tgz", ".tar")):
            return cand
    if not root.exists():
        raise RunError(f"--data-dir {data_dir} does not exist; give the folder holding aclImdb/ or "
                       "aclImdb_v1.tar.gz, or leave --data-dir out to use the synthetic corpus")
    raise RunError(f"--data-dir {data_dir} holds neither aclImdb/ (with train/ and test/) nor aclImdb_v1.tar.gz; "
                   "download it once on a login node (https://ai.stanford.edu/~amaas/data/sentiment/)")


def read_imdb(source: Path) -> dict[str, tuple[list[str], list[int]]]:
    """{'train': (texts, labels), 'test': (...)} with label 1 = pos, in a fixed (sorted) order."""
    found: dict[str, list[tuple[str, int, str]]] = {"train": [], "test": []}
    pattern = re.compile(r"(?:^|/)(train|test)/(pos|neg)/[^/]+\.txt$")
    if source.is_dir():
        for split in ("train", "test"):
            for label in ("neg", "pos"):
                folder = source / split / label
                if not folder.is_dir():
                    raise RunError(f"{folder} is missing: {source} is not a complete aclImdb folder")
                for f in sorted(folder.glob("*.txt")):
                    try:
                        text = f.read_text(encoding="utf-8", errors="replace")
                    except OSError as exc:
                        raise RunError(f"cannot read review {f}: {exc.strerror}; fix its permissions or "
                                       "re-extract aclImdb") from None
                    found[split].append((f.name, int(label == "pos"), text))
    else:
        try:
            with tarfile.open(source) as tar:
                for member in tar:
                    m = pattern.search(member.name)
                    if m and member.isfile():
                        text = tar.extractfile(member).read().decode("utf-8", errors="replace")
                        found[m.group(1)].append((member.name, int(m.group(2) == "pos"), text))
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise RunError(f"cannot read {source}: {exc}; re-download aclImdb_v1.tar.gz") from None
    for split, items in found.items():
        if not items:
            raise RunError(f"{source} has no {split}/pos or {split}/neg reviews")
        items.sort(key=lambda t: (t[1], t[0]))
    return {s: ([t for _, _, t in items], [y for _, y, _ in items]) for s, items in found.items()}


def synthetic_imdb(n: int, seed: int) -> dict[str, tuple[list[str], list[int]]]:
    """IMDB-like reviews whose label is learnable: filler words plus, now and then, words of the review's
    sentiment (and a little of the other, so it is not trivial)."""
    rng = random.Random(seed)
    filler = [f"w{i}" for i in range(1500)] + ["the", "a", "movie", "film", "plot", "actor", "scene", "and"]
    good = ["great", "wonderful", "superb", "loved", "brilliant", "moving", "best", "fun"]
    bad = ["awful", "boring", "worst", "waste", "terrible", "dull", "hated", "poor"]

    def review(label: int) -> str:
        mine, other = (good, bad) if label else (bad, good)
        words = []
        for _ in range(rng.randint(40, 120)):
            r = rng.random()
            words.append(rng.choice(mine) if r < 0.10 else rng.choice(other) if r < 0.12 else rng.choice(filler))
        return " ".join(words).capitalize() + "."

    ntest = max(n // 4, 64)
    out = {}
    for split, count in (("train", n), ("test", ntest)):
        labels = [i % 2 for i in range(count)]
        out[split] = ([review(y) for y in labels], labels)
    return out


def cache_key(cfg: argparse.Namespace, source: Path | None) -> str:
    h = hashlib.sha256(f"{CACHE_FORMAT}|{cfg.vocab_size}|{cfg.seq_len}|{cfg.synthetic}|{cfg.seed}".encode())
    if source is not None:
        st = source.stat()
        h.update(f"{source.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode())
        if source.is_dir():
            for split in ("train", "test"):
                for label in ("neg", "pos"):
                    d = source / split / label
                    h.update(f"{d}|{d.stat().st_mtime_ns if d.exists() else 0}".encode())
    return h.hexdigest()[:16]


def atomic_torch_save(obj: object, path: Path) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: readers see the old file or the new
    one, never half of one, even if this process is killed mid-write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def data_source(cfg: argparse.Namespace) -> Path | None:
    """The IMDB source to read, or None for the synthetic corpus; a bad --data-dir fails here, before any
    process group exists."""
    if cfg.synthetic:
        return None
    if cfg.data_dir:
        return find_imdb(cfg.data_dir)
    dsdir = os.environ.get("DSDIR")
    if dsdir and Path(dsdir, "IMDB").exists():
        return find_imdb(os.path.join(dsdir, "IMDB"))
    cfg.synthetic = 4000
    log(f"notice: no IMDB data (--data-dir not given{', and no $DSDIR/IMDB' if dsdir else ''}): training on "
        f"{cfg.synthetic} synthetic reviews whose labels are learnable. Nothing is downloaded.")
    return None


def load_corpus(cfg: argparse.Namespace, source: Path | None, world: int) -> dict:
    """Tokenised tensors, built once by rank 0 and cached; the other ranks wait, then load the cache."""
    cache_dir = Path(cfg.cache_dir or os.environ.get("SCRATCH") or
                     (source.parent if source is not None and os.access(source.parent, os.W_OK) else ".cache"))
    name = "synthetic" if source is None else "imdb"
    cache = cache_dir / f"{name}-{cache_key(cfg, source)}.pt"

    def build() -> dict:
        t0 = time.time()
        raw = read_imdb(source) if source is not None else synthetic_imdb(cfg.synthetic, cfg.seed)
        tokenizer, tokenize = get_tokenizer()
        train_tokens = [tokenize(t) for t in raw["train"][0]]
        itos = make_vocab(tokenizer, train_tokens, cfg.vocab_size)  # from the training split only
        data = {"format": CACHE_FORMAT, "tokenizer": tokenizer, "itos": itos,
                "train_x": encode(train_tokens, itos, cfg.seq_len),
                "train_y": torch.tensor(raw["train"][1], dtype=torch.int64),
                "test_x": encode([tokenize(t) for t in raw["test"][0]], itos, cfg.seq_len),
                "test_y": torch.tensor(raw["test"][1], dtype=torch.int64)}
        try:
            atomic_torch_save(data, cache)
            log(f"data: tokenised {len(raw['train'][0])}+{len(raw['test'][0])} reviews ({tokenizer} tokenizer) "
                f"in {time.time() - t0:.1f}s, cached in {cache}")
        except OSError as exc:
            log(f"notice: cannot write the cache {cache} ({exc.strerror}); every run will tokenise again")
        return data

    def read() -> dict | None:
        try:
            data = torch.load(cache, map_location="cpu", weights_only=True)
            if data.get("format") == CACHE_FORMAT and len(data["train_x"]) == len(data["train_y"]):
                return data
        except FileNotFoundError:
            return None
        except Exception as exc:  # truncated or corrupt: rebuild rather than crash
            log(f"notice: the cache {cache} is unreadable ({type(exc).__name__}); rebuilding it")
        return None

    data = None
    if idr_torch.rank == 0:
        data = read() or build()
    if world > 1:
        dist.barrier()
    if data is None:
        data = read() or build()  # the cache folder may not be shared between nodes: build here then
    return data


class BatchTensors(torch.utils.data.Dataset):
    """Indexed by a whole batch of indices: one gather per batch instead of B small ones and a collate."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(idx)
        return self.x[idx].long(), self.y[idx]


def make_loader(x: torch.Tensor, y: torch.Tensor, batch: int, replicas: int, rank: int, drop_last: bool,
                seed: int, workers: int, pin: bool, shuffle: bool = True) -> torch.utils.data.DataLoader:
    """Replica `rank` of `replicas` gets its own share (the tasks of one pipeline share one)."""
    sampler = torch.utils.data.DistributedSampler(BatchTensors(x, y), num_replicas=replicas, rank=rank,
                                                  shuffle=shuffle, seed=seed, drop_last=drop_last)
    batches = torch.utils.data.BatchSampler(sampler, batch, drop_last=drop_last)
    return torch.utils.data.DataLoader(BatchTensors(x, y), sampler=batches, batch_size=None, num_workers=workers,
                                       pin_memory=pin, persistent_workers=workers > 0)


# ----------------------------------------------------------------------------------------------------------------
# setup: the defaults, this task's plan and check_topology's verdict, before any process group exists
POSITIVE = ("nlayers", "d_model", "n_head", "d_hid", "seq_len", "vocab_size", "chunks", "batch_size", "nb_part",
            "epochs", "pp", "virtual_stages")


def resolve(cfg: argparse.Namespace, cuda: bool) -> None:
    """Fill the GPU or CPU defaults; refuse counts below 1 before anything is built."""
    given = {k: getattr(cfg, k) for k in check_topology.GPU_DEFAULTS}
    vars(cfg).update(check_topology.model_args(check_topology.Training(), not cuda, **given))
    bad = check_topology.below_one({k: getattr(cfg, k, None) for k in POSITIVE})
    if bad:
        raise RunError(bad)
    if not 0 <= cfg.dropout < 1:
        raise RunError(f"--dropout {cfg.dropout} must be in [0, 1)")


def task_plan(cuda: bool, nlayers: int, nb_part: int | None, findings: check_topology.Findings,
              devices: list[int] | None = None) -> check_topology.TaskPlan:
    """This task's plan from check_topology, from what idr_torch says this task sees."""
    launch = idr_torch.current()
    if cuda:
        count = torch.cuda.device_count()
        visible = launch.visible_gpus if len(launch.visible_gpus) == count else [str(i) for i in range(count)]
    else:  # CPU fallback: mirror the layout of the GPUs Slurm gave (if any), every part on the CPU
        visible = launch.visible_gpus
    plan = check_topology.plan_task(launch.rank, launch.node_id, launch.local_rank, launch.local_world_size,
                                    visible, launch.gpus_on_node, nlayers, nb_part, findings, devices)
    plan.cpu = plan.cpu or not cuda
    return plan


def verdict(cfg: argparse.Namespace, findings: check_topology.Findings) -> None:
    """Warnings printed once, errors raised with the same message the pre-flight check gives; then what only
    the model can refuse."""
    for f in findings:
        if f.level == "warning":
            log(f"check_topology: {f}")
    errors = findings.errors
    if errors:
        raise RunError("; ".join(f"{f.code}: {f.message}" for f in errors))
    if cfg.d_model % cfg.n_head:
        raise RunError(f"--d-model ({cfg.d_model}) must be a multiple of --n-head ({cfg.n_head}); "
                       f"try --n-head {max(d for d in check_topology.divisors(cfg.d_model) if d <= cfg.n_head)}")
    if cfg.d_model % 2:
        raise RunError(f"--d-model ({cfg.d_model}) must be even (sinusoidal positions)")
    if cfg.vocab_size <= len(SPECIALS):
        raise RunError(f"--vocab-size ({cfg.vocab_size}) must be larger than {len(SPECIALS)}")


def make_plan(cfg: argparse.Namespace, cuda: bool) -> check_topology.TaskPlan:
    """The replica layout's plan and verdict: errors stop us here, before init_process_group."""
    findings = check_topology.Findings()
    devices = None if cfg.devices is None else check_topology.parse_devices(cfg.devices, "this task", findings)
    plan = task_plan(cuda, cfg.nlayers, cfg.nb_part, findings, devices)
    training = training_of(cfg)
    check_topology.check_training(plan.nb_part, training, findings, cpu=not cuda)
    for line in check_topology.torch_refusals(torch.__version__, training, cpu=not cuda):  # what this release lacks
        findings.error("torch-release", line)
    verdict(cfg, findings)
    check_precision(cfg, plan)
    return plan


def check_save_path(path: str | None) -> None:
    """Fail before training, not after an hour of it: really create (and remove) a file beside the target."""
    if not path:
        return
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise RunError(f"--save {path}: folder {folder} does not exist; create it or choose another path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise RunError(f"--save {path}: cannot write in {folder} ({exc.strerror}); choose a path under $WORK or "
                       "$SCRATCH") from None


def cpu_threads(launch: idr_torch.Launch) -> int:
    """This task's share of the cores: its own when Slurm bound it, else the node's split between its tasks
    (N tasks each using every core would oversubscribe the node)."""
    avail = len(os.sched_getaffinity(0))
    share = max(1, avail // launch.local_world_size)
    cpt = os.environ.get("SLURM_CPUS_PER_TASK", "").strip()
    if cpt.isdigit() and avail <= int(cpt):
        return avail  # bound to its own cores
    return min(int(cpt), share) if cpt.isdigit() else share


# ----------------------------------------------------------------------------------------------------------------
# checkpoints. --save PATH is exactly the page's file, `torch.save(ddp_mp_model.module.state_dict(), PATH)`, so
# the page's `model.load_state_dict(torch.load(PATH))` loads it; what resuming needs (optimizer, epoch, batch,
# RNG states, the layout) goes in PATH.resume.pt beside it. Both are written atomically, by rank 0.
def resume_file(path: str | Path) -> Path:
    return Path(path).expanduser().with_name(Path(path).name + ".resume.pt")


def layout_of(cfg: argparse.Namespace, nb_part: int) -> dict:
    """What a checkpoint must match: the model and how many parts it is cut in (whatever the layout:
    nb_part 2 here and bench_stage.py --pp 2 hold the same parts under the same keys)."""
    return {"nb_part": nb_part, "nlayers": cfg.nlayers, "d_model": cfg.d_model, "n_head": cfg.n_head,
            "d_hid": cfg.d_hid, "vocab_size": cfg.vocab_size, "seq_len": cfg.seq_len,
            "part_sizes": check_topology.part_sizes(cfg.nlayers, nb_part)}


def rng_states(world: int) -> list[dict] | None:
    """Every rank's random state (dropout masks differ per replica), gathered on rank 0 for its checkpoint."""
    mine = {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    if world == 1:
        return [mine]
    everyone: list | None = [None] * world if idr_torch.rank == 0 else None
    dist.gather_object(mine, everyone, dst=0, group=HOST_GROUP[0])
    return everyone


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def save_checkpoint(path: str, model_state: dict, resume: dict) -> None:
    """The model file first, then the companion naming its digest: a job killed between the two renames leaves
    a pair that resume_point refuses to mix, never a model resumed with another save's optimizer."""
    target = Path(path).expanduser()
    atomic_torch_save(model_state, target)
    atomic_torch_save(dict(resume, model_sha256=file_digest(target)), resume_file(target))


def save_progress(cfg: argparse.Namespace, trainer: Replica, epoch: int, batch_in_epoch: int, step: int,
                  world: int) -> None:
    """Every rank calls it (the RNG states, and the stage layout's consolidation, are collectives); rank 0
    writes --save and its companion. epoch: epochs fully done; batch_in_epoch: batches done in the next one."""
    if not cfg.save:
        return
    state = trainer.state()
    rngs = rng_states(world)
    if idr_torch.rank == 0:
        model_state, optimizer_state = state
        save_checkpoint(cfg.save, model_state, {
            "format": RESUME_FORMAT, "optimizer": optimizer_state, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
            "step": step, "layout": layout_of(cfg, trainer.nb_part), "engine": trainer.engine, "rng": rngs,
            "args": {k: v for k, v in vars(cfg).items() if isinstance(v, (int, float, str, type(None)))}})


def first_line(exc: BaseException) -> str:
    """An exception's first line, for a one-line error (some, like EOFError, have none)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def read_model(path: str) -> dict:
    """The --load file: a state_dict, the page's or ours (the page's own torch.load, weights only)."""
    try:
        state = torch.load(Path(path).expanduser(), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise RunError(f"--load {path}: no such file") from None
    except Exception as exc:
        raise RunError(f"--load {path} is not a readable model file ({type(exc).__name__}: "
                       f"{first_line(exc)[:120]}); it may be truncated: use an earlier one") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise RunError(f"--load {path} is not a state_dict (what torch.save(model.module.state_dict(), path) "
                       "writes)")
    return state


def read_resume(path: str, cfg: argparse.Namespace, nb_part: int) -> dict | None:
    """The companion of `path`, checked against this run's layout and against the model file; None if absent."""
    companion = resume_file(path)
    if not companion.exists():
        return None
    try:
        state = torch.load(companion, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise RunError(f"{companion} is unreadable ({type(exc).__name__}); delete it to load {path}'s weights "
                       "alone, with a fresh optimizer") from None
    if not isinstance(state, dict) or state.get("format") != RESUME_FORMAT:
        raise RunError(f"{companion} was not written by this kit's --save; delete it to load {path}'s weights alone")
    mine, theirs = layout_of(cfg, nb_part), state["layout"]
    if mine != theirs:
        diff = ", ".join(f"{k} {theirs.get(k)} (now {v})" for k, v in mine.items() if theirs.get(k) != v)
        raise RunError(f"--load {path} was saved with another layout: {diff}; rerun with the saved values "
                       f"(e.g. --nb-part {theirs['nb_part']} --nlayers {theirs['nlayers']})")
    if state.get("model_sha256") != file_digest(Path(path).expanduser()):
        raise RunError(f"{path} and {companion} come from different saves (a job killed between the two "
                       f"writes?); delete {companion} to start from {path}'s weights with a fresh optimizer")
    return state


def resume_point(cfg: argparse.Namespace, trainer: Replica) -> tuple[int, int, int, dict | None]:
    """--load, or --resume's --save file if it exists, into the model on every rank (before DDP wraps it):
    (epoch, batch in that epoch, step, the companion), or a fresh start. A file without a companion (the
    page's own) gives the weights and a fresh optimizer, from epoch 0."""
    load = cfg.load or (cfg.save if cfg.resume and cfg.save and Path(cfg.save).expanduser().exists() else None)
    if not load:
        return 0, 0, 0, None
    model_state, state = read_model(load), read_resume(load, cfg, trainer.nb_part)
    try:
        trainer.load(model_state, state["optimizer"] if state else None)
    except (RuntimeError, ValueError, KeyError, IndexError) as exc:
        raise RunError(f"--load {load} does not fit this model ({first_line(exc)[:160]}); rerun "
                       f"with the options it was saved with"
                       + (f": {state.get('args')}" if state else "")) from None
    if state is None:
        log(f"loaded {load}: weights only (no {resume_file(load).name} beside it): fresh optimizer, epoch 0")
        return 0, 0, 0, None
    start_epoch, skip, step = state["epoch"], state["batch_in_epoch"], state["step"]
    log(f"loaded {load}: epoch {start_epoch}" + (f" + {skip} batches" if skip else "") + f", step {step}")
    return start_epoch, skip, step, state


def restore_rng(state: dict, rank: int) -> None:
    rngs = state.get("rng") or []
    if len(rngs) > rank:  # same world size: each rank continues its own stream
        torch.set_rng_state(rngs[rank]["torch"])
        random.setstate(rngs[rank]["python"])
        if rngs[rank].get("cuda") and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rngs[rank]["cuda"])


class StopRequest:
    """SIGUSR1 (Slurm's --signal=USR1@seconds before the time limit) or SIGTERM (scancel, preemption): finish
    the current step, checkpoint, exit 75. Every rank must stop at the same step, or DDP would wait for the
    missing ones forever: the flags are OR-ed across ranks after every step, on the CPU (gloo), so the GPU
    stream is never synchronised for it."""
    EXIT_CODE = 75  # EX_TEMPFAIL: "try again"; the templates requeue on it

    def __init__(self) -> None:
        self.signal: str | None = None
        self.flag = torch.zeros(1)
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        self.signal = signal.Signals(signum).name

    def agreed(self, world: int) -> bool:
        self.flag[0] = 1.0 if self.signal else 0.0
        if world > 1:
            dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=HOST_GROUP[0])
        return bool(self.flag[0] > 0)


def reduce_max(values: list[float], device: str, world: int) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def fingerprint(modules: list[nn.Module]) -> torch.Tensor:
    """Per-tensor (sum, sum of squares) in float64: equal on every replica when DDP did its job."""
    with torch.no_grad():
        return torch.stack([torch.stack([p.double().sum(), p.double().pow(2).sum()])
                            for m in modules for p in m.parameters()]).flatten()


def divergence(fp: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> float:
    """Largest difference of fingerprints between the replicas of `group`."""
    if size == 1:
        return 0.0
    everyone = [torch.empty_like(fp) for _ in range(size)]
    dist.all_gather(everyone, fp, group=group)
    gap = torch.stack([(e - everyone[0]).abs().max() for e in everyone]).max()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)  # over every group
    return gap.item()


# ----------------------------------------------------------------------------------------------------------------
# the training loop, shared by both layouts (bench_stage.py's Stages has Replica's methods)
@dataclasses.dataclass
class Epoch:
    """One epoch's progress, as train_epoch leaves it."""
    step: int  # steps done in all, this epoch's included
    stats: torch.Tensor  # loss x samples, correct, samples: on the device, summed without a host sync
    batches: int = 0  # batches of this epoch done, the ones skipped on resume included
    timed_steps: int = 0
    t_begin: float = dataclasses.field(default_factory=time.time)
    t_timed: float | None = None  # when the timed steps began (after the warm-up)
    first_batch_at: float | None = None


def train(cfg: argparse.Namespace, trainer: Replica, launch: idr_torch.Launch, source: Path | None,
          cuda: bool) -> int:
    """Data, the resume point, DDP, then per epoch: train, stop if asked, evaluate, save; the record."""
    world, rank, dp = launch.size, launch.rank, trainer.dp_size
    log(f"torch {torch.__version__}, {trainer.name} layout, backend {dist.get_backend()}, world size {world} on "
        f"{launch.num_nodes} node(s), chunks {cfg.chunks}, batch {cfg.batch_size}/replica "
        f"({cfg.batch_size * dp} global)")
    log(f"  {trainer.describe()}")
    train_loader, test_loader = make_loaders(cfg, load_corpus(cfg, source, world), trainer, launch, cuda)
    start_epoch, skip, step, state = resume_point(cfg, trainer)  # loaded before DDP wraps the model
    if start_epoch >= cfg.epochs:
        log(f"nothing to train: the checkpoint holds {start_epoch} epoch(s) and --epochs is {cfg.epochs}; raise "
            f"--epochs to go on, or delete {cfg.load or cfg.save} (and its .resume.pt) to start afresh")
    trainer.start()
    torch.manual_seed(cfg.seed + 1 + rank)  # dropout masks differ between replicas
    if state is not None:
        restore_rng(state, rank)
    stop = StopRequest()
    log(f"  model: {trainer.total_params / 1e6:.2f} M parameters; {len(train_loader)} steps per epoch")
    log(f"  {trainer.memory}")
    history, startup_s = [], None
    for epoch in range(start_epoch, cfg.epochs):
        ep = train_epoch(cfg, trainer, train_loader, epoch, skip, step, stop, world)
        step = ep.step
        if startup_s is None and ep.first_batch_at is not None:  # imports, data, model: before step 1
            startup_s = ep.first_batch_at - psutil.Process().create_time()
        if stop.flag[0] > 0:  # agreed by every rank at the same step (a signal of its own alone is not)
            return stop_and_checkpoint(cfg, trainer, ep, epoch, len(train_loader), stop, world)
        skip = 0
        history.append(end_of_epoch(cfg, trainer, test_loader, epoch, ep, world, cuda))
        if cfg.save:
            save_progress(cfg, trainer, epoch + 1, 0, step, world)
            log(f"  checkpoint saved: {cfg.save} (epoch {epoch + 1}, step {step})")
        if cfg.max_steps and step >= cfg.max_steps:
            break
    finish(cfg, trainer, launch, history, startup_s, cuda)
    return 0


def make_loaders(cfg: argparse.Namespace, data: dict, trainer: Replica, launch: idr_torch.Launch,
                 cuda: bool) -> tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader]:
    dp = trainer.dp_size  # replicas that each see their own share of the data
    workers = cfg.workers if cfg.workers >= 0 else (min(4, max(0, launch.cpus_per_task - 1)) if cuda else 0)
    train_loader = make_loader(data["train_x"], data["train_y"], cfg.batch_size, dp, trainer.dp_rank, True,
                               cfg.seed, workers, cuda)
    # the stage layout's schedules want every batch the same size: a short last test batch is dropped there
    test_loader = make_loader(data["test_x"], data["test_y"], cfg.batch_size, dp, trainer.dp_rank,
                              trainer.equal_batches, cfg.seed, workers, cuda, shuffle=False)
    if len(train_loader) == 0:
        raise RunError(f"{len(data['train_y'])} training reviews give no full batch of {cfg.batch_size} per "
                       f"replica x {dp} replicas; lower --batch-size or add data")
    return train_loader, test_loader


def train_epoch(cfg: argparse.Namespace, trainer: Replica, loader: torch.utils.data.DataLoader, epoch: int,
                skip: int, step: int, stop: StopRequest, world: int) -> Epoch:
    """One epoch from batch `skip` on (resumed inside this epoch: same sampler order, those are done)."""
    loader.sampler.sampler.set_epoch(epoch)
    ep = Epoch(step=step, stats=torch.zeros(3, dtype=torch.float64, device=trainer.stats_device))
    t_last_log = time.time()
    for i, (x, y) in enumerate(loader):
        ep.batches = i + 1
        if i < skip:
            continue
        ep.first_batch_at = ep.first_batch_at or time.time()
        if i == skip + cfg.warmup_steps:  # counted from the first batch this run trains on
            trainer.synchronize()
            ep.t_timed = time.time()
        ep.stats += trainer.train_step(x, y)  # stays on the device: no .item() (a host sync) in the loop
        ep.step += 1
        ep.timed_steps += int(ep.t_timed is not None)
        if stop.agreed(world):
            break
        if idr_torch.rank == 0 and time.time() - t_last_log > cfg.log_every:
            t_last_log = time.time()
            log(f"  epoch {epoch + 1} step {i + 1}/{len(loader)}"
                + (f" loss {(ep.stats[0] / ep.stats[2]).item():.4f}" if ep.stats[2] > 0 else "")
                + f" ({time.time() - ep.t_begin:.0f}s)")
        if cfg.max_steps and ep.step >= cfg.max_steps:
            break
    return ep


def evaluate(trainer: Replica, loader: torch.utils.data.DataLoader, world: int) -> float:
    acc = torch.zeros(2, dtype=torch.float64, device=trainer.stats_device)
    for x, y in loader:
        acc += trainer.eval_step(x, y)
    if world > 1:
        dist.all_reduce(acc)
    return (acc[0] / acc[1].clamp(min=1)).item()


def end_of_epoch(cfg: argparse.Namespace, trainer: Replica, test_loader: torch.utils.data.DataLoader, epoch: int,
                 ep: Epoch, world: int, cuda: bool) -> dict:
    """The epoch's figures (summed over the replicas), evaluation, one line; the row of the record."""
    trainer.synchronize()
    t_end = time.time()
    if world > 1:
        dist.all_reduce(ep.stats)
    timed = t_end - ep.t_timed if ep.t_timed is not None and ep.timed_steps else None
    samples_per_s = ep.timed_steps * cfg.batch_size * trainer.dp_size / timed if timed else None
    test_acc = evaluate(trainer, test_loader, world)
    peak_gb, rss_gb = reduce_max([trainer.peak_memory_gb(), psutil.Process().memory_info().rss / 2**30],
                                 trainer.stats_device, world)
    seen = max(ep.stats[2].item(), 1)
    row = {"epoch": epoch + 1, "steps": ep.batches, "loss": ep.stats[0].item() / seen,
           "train_acc": ep.stats[1].item() / seen, "test_acc": test_acc, "epoch_time_s": t_end - ep.t_begin,
           "samples_per_s": samples_per_s, "timed_steps": ep.timed_steps,
           "peak_gpu_mem_gb": peak_gb if cuda else None, "host_rss_gb": rss_gb}
    log(f"epoch {row['epoch']:3d} | steps {row['steps']:5d} | loss {row['loss']:.4f} | train acc "
        f"{row['train_acc']:.3f} | test acc {test_acc:.3f} | {row['epoch_time_s']:7.1f}s | "
        + (f"{samples_per_s:9.1f} samples/s" if samples_per_s else "   (too few steps to time)")
        + (f" | peak GPU mem {peak_gb:.2f} GiB" if cuda else "")
        + (f" (estimate {trainer.estimate_gib:.2f})" if cuda and trainer.estimate_gib else "")
        + f" | host RSS {rss_gb:.2f} GiB")
    return row


def stop_and_checkpoint(cfg: argparse.Namespace, trainer: Replica, ep: Epoch, epoch: int, n_batches: int,
                        stop: StopRequest, world: int) -> int:
    """Every rank stopped at the same step: checkpoint where we are (mid-epoch too), exit 75 (requeue)."""
    done_all = ep.batches == n_batches
    save_progress(cfg, trainer, epoch + int(done_all), 0 if done_all else ep.batches, ep.step, world)
    log(f"stopping on {stop.signal or 'a signal to another task'} at epoch {epoch + 1}, "
        f"batch {ep.batches}/{n_batches}, step {ep.step}: "
        + (f"checkpoint saved to {cfg.save}; run again with --resume (the templates requeue) to go on"
           if cfg.save else "no --save given, so this progress is lost"))
    return StopRequest.EXIT_CODE


def finish(cfg: argparse.Namespace, trainer: Replica, launch: idr_torch.Launch, history: list[dict],
           startup_s: float | None, cuda: bool) -> None:
    """The replica check, the summary line and the JSON record."""
    gap = trainer.divergence()
    plans: list = [None] * launch.size  # where every task put its parts, for the record
    if launch.size > 1:
        dist.all_gather_object(plans, trainer.placement(launch), group=HOST_GROUP[0])
    else:
        plans = [trainer.placement(launch)]
    log(f"replicas in sync: max parameter fingerprint difference {gap:.3g} over {trainer.dp_size} replica(s)")
    if not history:
        return
    best = max((r["samples_per_s"] for r in history if r["samples_per_s"]), default=None)
    total_s = time.time() - psutil.Process().create_time()
    log(f"summary: {trainer.name} layout, {trainer.dp_size} replica(s) x {trainer.nb_part} part(s), chunks "
        f"{cfg.chunks}, batch {cfg.batch_size}/replica: " + (f"{best:.1f} samples/s (best epoch), " if best else "")
        + f"final test acc {history[-1]['test_acc']:.3f}, total {total_s:.1f}s")
    if cfg.json_out and launch.rank == 0:
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__, **trainer.record(),
                  "backend": dist.get_backend(), "device": "cuda" if cuda else "cpu",
                  "gpu_name": torch.cuda.get_device_name(trainer.stats_device) if cuda else None,
                  "nodes": launch.num_nodes, "tasks": launch.size, "tasks_per_node": launch.local_world_size,
                  "world_size": launch.size, "replicas": trainer.dp_size, "chunks": cfg.chunks,
                  "batch_size": cfg.batch_size, "global_batch": cfg.batch_size * trainer.dp_size,
                  **{k: getattr(cfg, k) for k in ("nlayers", "d_model", "n_head", "d_hid", "seq_len", "vocab_size",
                                                  "precision", "activation_checkpointing", "zero")},
                  "data": "synthetic" if cfg.synthetic else "imdb", "job_id": launch.job_id,
                  "samples_per_s": best, "epoch_time_s": history[-1]["epoch_time_s"],
                  "peak_gpu_mem_gb": history[-1]["peak_gpu_mem_gb"], "host_rss_gb": history[-1]["host_rss_gb"],
                  "test_acc": history[-1]["test_acc"], "replica_divergence": gap, "plans": plans,
                  "startup_s": startup_s, "total_s": total_s, "epochs": history}
        with open(cfg.json_out, "a") as f:
            f.write(json.dumps(record) + "\n")


# What a collective raises when a peer task died or hung, and nothing else: gloo's "Connection closed by peer"
# (seen here, torch 2.13 CPU, a killed peer) and its "Timed out waiting ... for recv"; a reset or broken socket
# (ECONNRESET, EPIPE); NCCL's ncclRemoteError "remote process exited or there was a network error".
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
             "remote process exited or there was a network error")


def is_comm_error(exc: BaseException) -> bool:
    """A collective failed because a peer died, hung (timeout) or closed its connection; any other error keeps
    its own message and traceback."""
    return isinstance(exc, getattr(dist, "DistNetworkError", ())) or any(k in str(exc) for k in PEER_GONE)


def cli(main: Callable[[], int], prog: str) -> None:
    """Run a trainer's main(); a user error is one line (every rank reaches the same verdict: say it once)."""
    try:
        sys.exit(main())
    except (RunError, idr_torch.LaunchError) as exc:
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) or 0)
        if rank == 0 or isinstance(exc, (idr_torch.LaunchError, LostContact)):
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    cli(main, "bench_ddp_transformer")

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

The page's code comes first, in the page's order: process group and RPC, nb_part / first_part / last_part,
the module_list loop, the Pipe, DDP, the training step, saving and loading. Everything the page does not
have (data and cache, checkpoints and resume, stop signals, the JSON record) comes after main().
"""
from __future__ import annotations

import signal
import sys

# The stop signals: SIGUSR1 (Slurm's --signal=USR1@seconds before the time limit), SIGTERM (scancel, preemption, the
# time limit itself) and SIGINT (Ctrl-C) each mean "finish the step, checkpoint, exit 75" (StopRequest). They can come
# while torch imports, the data loads or the tasks meet, where their default actions kill the process (exit 138, 143,
# or a KeyboardInterrupt traceback) and the job is not requeued: so they are held from here, the first statements,
# before anything else is imported. What runs before this line (the interpreter's start and the compilation of this
# file: 10-20 and 33-60 ms measured) is out of reach of any Python program; a launcher that blocks them then has them
# delivered here, held (the unblock below). Only where a trainer is the program (bench_stage.py holds them from its
# own first lines, into its PENDING_SIGNALS, and sets HOLD_STOP_SIGNALS): importers keep their handlers.
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
PENDING_SIGNALS: list[str] = getattr(sys.modules.get("__main__"), "PENDING_SIGNALS", [])  # the names, in order
# Ctrl-C a second time (hold_signal): "saving", the saves under way (interrupts_held); "ending", the stop agreed or
# main() returned, nothing left to cut short; "deferred", a second Ctrl-C that waits for a save's end or the next step
CTRL_C = {"saving": 0, "ending": False, "deferred": False}


def hold_signal(signum: int, frame: object) -> None:
    """Note a stop signal: StopRequest acts on it at the next step. Ctrl-C a second time stops at once (cli() says
    so in one line), but never inside a save: torch.save turns an exception raised in its writer into a RuntimeError
    about the zip file, which the save's error path took for a full disk, and training went on. Nor inside a
    __del__ (Python prints "Exception ignored in ..." with a traceback, and drops the interrupt): it waits for the
    next step there."""
    name = signal.Signals(signum).name
    again = name == "SIGINT" and "SIGINT" in PENDING_SIGNALS
    PENDING_SIGNALS.append(name)
    if name == "SIGINT" and not again and is_rank0():
        import os  # loaded by the interpreter already; os.write, not print: this may interrupt a print
        os.write(2, b"Ctrl-C: stopping after this step, with a checkpoint where --save is given (exit 75); "
                    b"Ctrl-C again stops at once\n")
    if again:
        if CTRL_C["saving"] or CTRL_C["ending"] or in_finalizer(frame):
            CTRL_C["deferred"] = True
        else:
            raise KeyboardInterrupt


def in_finalizer(frame: object) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def is_rank0() -> bool:
    """This task is rank 0, from the launcher's variables (idr_torch is not imported yet where this is needed)."""
    import os
    return (os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0").strip() in ("0", "")


def hold_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored stays ignored (Ctrl-C in a background job)
            signal.signal(sig, hold_signal)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


if __name__ == "__main__" or getattr(sys.modules.get("__main__"), "HOLD_STOP_SIGNALS", False):
    hold_stop_signals()


def interrupts_held(save: Callable) -> Callable:
    """A save decorated with this is not cut by a second Ctrl-C: the interrupt is raised when the save ends."""
    @functools.wraps(save)
    def held(*args: object, **kwargs: object) -> object:
        CTRL_C["saving"] += 1
        try:
            return save(*args, **kwargs)
        finally:
            CTRL_C["saving"] -= 1
            interrupt_if_deferred()
    return held


def interrupt_if_deferred() -> None:
    """Raise the second Ctrl-C that waited (for a save's end, or out of a __del__), unless the run is ending."""
    if CTRL_C["deferred"] and not CTRL_C["saving"] and not CTRL_C["ending"]:
        CTRL_C["deferred"] = False
        raise KeyboardInterrupt


import argparse
import atexit
import contextlib
import dataclasses
import errno
import fcntl
import functools
import gc
import hashlib
import io
import itertools
import json
import math
import os
import pickle
import random
import re
import secrets
import socket
import stat
import tarfile
import tempfile
import threading
import time
import traceback
import warnings
import zlib
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, Protocol

if __name__ == "__main__" and "--check-args" in sys.argv[1:]:  # judge the arguments as main() does, without torch
    import check_topology
    sys.exit(check_topology.check_args_main("replica", sys.argv[1:]))

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
TASK_GPUS: list[int] = []  # this task's GPUs, first_part first (use_gpus); empty without a GPU


class RunError(Exception):
    """A user-facing error: one line that names the value and the fix. Every task reaches the same verdict (the
    arguments, the plan, a verdict gathered by agree()): task 0 says it."""


class TaskError(RunError):
    """This task's own error, or its report of another task's: the task that raises it says it."""


class LostContact(TaskError):
    """A collective failed: each surviving task says so (rank 0 may be the one that died)."""


class Quiet(RunError):
    """Another task says why every task stops: this one exits 1 without a line."""


PROG = ["bench_ddp_transformer"]  # the program's name in error lines (cli() sets it: bench_stage.py's too)


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


# The architecture of the saved model (the companion records it; a checkpoint of another one is refused in one
# line). post-ln/2: the page's blocks (nn.TransformerEncoderLayer: LayerNorm after each residual add), the embedding
# no longer scaled by sqrt(d_model) (post-ln/1 scaled it). What made the GPU defaults collapse to one class on an
# H200 (d_model 1024, AdamW at 1e-3 constant, at every depth) was the rate, not the blocks: lr x d_model about 1.
# Measured on the CPU at d_model 1024, 2 layers, 20 steps (docs/gpu.md): at lr 1e-3 with a 10 % warmup the page's
# blocks went to a running loss of 3.3 and pre-LN blocks with a final LayerNorm to 1.8 (both test acc 0.500); at
# the new default (1e-4, --lr) both stayed at or under 0.74 and learned (0.598 and 0.576 after 20 steps). So the
# page's blocks stay, and with them the memory model's op-by-op tape of that exact layer.
ARCHITECTURE = "post-ln/2"
ARCHITECTURE_CHANGE = "the embedding is no longer scaled by sqrt(d_model)"


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
def use_gpus(plan: check_topology.TaskPlan) -> None:
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


def flight_recorder_names(torch_version: str) -> tuple[str, str]:
    """The names this torch release reads first for nccl's flight recorder: (its buffer size, its dump file). Set
    under the other name, a release either ignores the value or prints "Environment variable ... is deprecated; use
    ... instead" (WARN_ENV_VAR_ONCE in c10d/Utils.hpp: getCvarInt/getCvarString warn for any name of a list but the
    first that is set; 2.11 printed it twice per task, once per FlightRecorder instance). The sources:
      - 2.3.1, 2.4.1 (TraceUtils.h), 2.6.0 (FlightRecorder.hpp:103): getCvarInt({"TORCH_NCCL_TRACE_BUFFER_SIZE"}, 0)
        and getCvarString({"TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}, "/tmp/nccl_trace_rank_"); no TORCH_FR_ name in their
        libtorch_cuda.so. 2.5 and 2.7 lie between: pytorch#152563, which added the TORCH_FR_ names ("Make FR vendor
        neutral"), was merged on 2025-05-07, after 2.7.0.
      - 2.8.0 (FlightRecorder.hpp:100), 2.13.0 and 2.14.1 (FlightRecorder.hpp:111): getCvarInt({"TORCH_FR_BUFFER_SIZE",
        "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 0 in 2.8, 2000 later), and FlightRecorder.cpp's getCvarString(
        {"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}, ...) (both names in 2.8.0's and 2.14.1's
        libtorch_cpu.so); 2.11.0 on the H200 printed the deprecation for TORCH_NCCL_TRACE_BUFFER_SIZE.
    ProcessGroupNCCL itself still reads TORCH_NCCL_TRACE_BUFFER_SIZE alone (its traceBufferSize_, which gates the
    dump, default 2000 from 2.8: the default FlightRecorder's was brought up to by pytorch#172843), and
    TORCH_NCCL_DUMP_ON_TIMEOUT has that one name in every release (ProcessGroupNCCL.hpp)."""
    major, minor = (int(x) for x in re.findall(r"\d+", torch_version)[:2])
    if (major, minor) >= (2, 8):
        return "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"
    return "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"


def nccl_environment() -> str:
    """What a hang and an error leave to read, set before the first nccl group (each release reads these once, in
    ProcessGroupNCCL's constructor); a value the user exported wins. Names and defaults from each release's
    ProcessGroupNCCL.hpp (and FlightRecorder.hpp from 2.8), and the strings in its libtorch_cuda.so:
      - TORCH_NCCL_ASYNC_ERROR_HANDLING (older name NCCL_ASYNC_ERROR_HANDLING, still read, with a deprecation
        warning, by every release from 2.3.1 to 2.14.1): left at the releases' default 3, "SkipCleanUp": when a
        collective times out the watchdog ends the process without ncclCommAbort, which can itself hang on a dead
        peer. 0 (or 2) would leave the job waiting until its time limit; a value the user set is kept and named.
      - TORCH_NCCL_BLOCKING_WAIT: not set. It makes every wait() block the CPU until the collective ends (the
        timeout then raises in Python), so the CPU stops queuing work ahead of DDP's all-reduces; the watchdog
        above times out the same collectives without that cost.
      - Flight recorder, under the names this release reads first (flight_recorder_names): its buffer size = 2000
        last collectives per task (the default is 0, off, in the older sources, 2000 in the newer);
        TORCH_NCCL_DUMP_ON_TIMEOUT=1 (off by default in 2.3) writes them when the watchdog fires, to its dump
        file + <rank>, by default /tmp/nccl_trace_rank_<rank> (~/.cache/torch/comm_lib_trace_rank_ later): a
        compute node's disk, gone with the job, so here the job's folder: nccl_trace_<job>/rank_<rank>. Read it
        with `torchfrtrace nccl_trace_<job>` (2.6 on) or pickle.load (docs/gpu.md).
      - NCCL_DEBUG=WARN: nccl prints its own errors (e.g. "Duplicate GPU detected : rank 0 and rank 1 both on CUDA
        device ...", a network failure) on stderr, not only an error code."""
    env, said = os.environ, []
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT",
                 "NCCL_BLOCKING_WAIT"):
        if env.get(name, "").strip():
            said.append(f"{name}={env[name]} (yours)")
    mode = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", env.get("NCCL_ASYNC_ERROR_HANDLING", "3")).strip()
    if mode in ("0", "2"):
        said.append("warning: with async error handling 0 or 2 a collective whose peer died blocks until the time "
                    "limit; unset it (the default, 3, ends the task after --timeout)")
    size_name, file_name = flight_recorder_names(torch.__version__)
    size = read_first(env, size_name, "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE") or "2000"
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    trace = read_first(env, file_name, "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if trace is None:
        folder = Path(f"nccl_trace_{idr_torch.current().job_id or os.getpid()}").resolve()
        with contextlib.suppress(OSError):
            folder.mkdir(exist_ok=True)
            atexit.register(_remove_if_empty, folder)  # a run that ends normally leaves no empty folder behind
        trace = env[file_name] = f"{folder}/rank_"
    env.setdefault(size_name, size)
    env.setdefault("NCCL_DEBUG", "WARN")
    return ", ".join(said + [f"on a timeout each task writes its last {size} collectives to {trace}<rank> (flight "
                             "recorder) and its Python stacks to stderr"])


def read_first(env: dict[str, str], name: str, *names: str) -> str | None:
    """The user's value: under `name` (the one this release reads first), else under another of `names`, then
    copied to `name` only where this release does not read that other one (an older release and a TORCH_FR_ name:
    ignored there). A value under the older name on a newer release is left as it is, with torch's warning: the
    user's choice."""
    if env.get(name, "").strip():
        return env[name]
    for other in names:
        if other != name and env.get(other, "").strip():
            if other.startswith("TORCH_FR_"):
                env[name] = env[other]
            return env[other]
    return None


def _remove_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):
        folder.rmdir()


def report_hangs() -> None:
    """Python's stacks of every thread on stderr when the process dies of a signal: the nccl watchdog ends a task
    with std::abort (SIGABRT) after --timeout; a segfault in a library likewise. The Watchdog below covers the
    hangs nccl does not see (gloo, a send or receive, Python itself)."""
    import faulthandler
    if not faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr, all_threads=True)


class Watchdog:
    """Ends this task with its stacks and one line when a step makes no progress for `timeout` seconds.

    A rank blocked in a pipelining send or receive waits in C++ with no timeout (gloo's and nccl's point-to-point, on
    the releases tested), a rank stuck in Python (a Pipe worker, the data) has none at all, and Python runs signal
    handlers only between bytecodes, so neither SIGTERM nor the stop request reaches it. This thread still runs (the
    wait releases the GIL). It fires `grace` seconds after --timeout so that on nccl the watchdog's flight-recorder
    dump comes first (TORCH_NCCL_DUMP_ON_TIMEOUT; nccl's watchdog waits TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC, 2 to
    60 s by release, for it before it ends the task)."""

    def __init__(self, timeout: float, rank: int, prog: str = "bench_ddp_transformer", grace: float = 90.0) -> None:
        self.timeout, self.rank, self.prog, self.grace = timeout, rank, prog, grace
        self.step, self.beat = 0, time.monotonic()
        self.done = threading.Event()
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def tick(self, step: int) -> None:
        self.step, self.beat = step, time.monotonic()

    def stop(self) -> None:
        self.done.set()

    def _watch(self) -> None:
        import faulthandler
        limit = self.timeout + self.grace
        while not self.done.wait(min(5.0, limit / 4)):
            idle = time.monotonic() - self.beat
            if idle > limit:
                print(f"{self.prog}: error: task {self.rank} made no progress for {idle:.0f}s after step "
                      f"{self.step} (--timeout {self.timeout:g}): a collective, send or receive never completed "
                      "(a task died or hung; each task's Python stacks follow, and on nccl its last collectives in "
                      "the flight recorder's file); stopping instead of waiting for the time limit",
                      file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(1)


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


OPEN_PIPES: list[PipeModel] = []  # built and not closed yet


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
        OPEN_PIPES.append(self)  # run() closes it on every exit path, even if what holds it was never built

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
        if self in OPEN_PIPES:
            OPEN_PIPES.remove(self)
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


class Trainer(Protocol):
    """What the training loop (train() and the functions it calls) uses of a layout: Replica below (the page's), or
    bench_stage.py's Stages (a task per GPU)."""
    name: str  # "replica" or "stage"
    engine: str  # the pipeline engine: torch-pipe, fairscale or pipelining
    equal_batches: bool  # the layout needs every batch the same size (the short last one dropped)
    nb_part: int  # parts of one replica
    dp_size: int  # replicas
    dp_rank: int  # this task's replica (its share of the data)
    stats_device: torch.device | str  # where the loss and accuracy live: the same part on every task
    total_params: int
    memory: str  # the start-up line of the memory estimate
    estimate_gib: float  # the estimated peak of one GPU (check_topology.worst_part: both layouts are modelled)

    def describe(self) -> str: ...
    def load(self, model_state: dict, optimizer_state: dict | None) -> None: ...
    def start(self) -> None: ...
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...
    def set_lr(self, lr: float) -> None: ...
    def eval_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...
    def state(self) -> tuple[dict, dict] | None: ...
    def synchronize(self) -> None: ...
    def peak_memory_gb(self) -> float: ...
    def divergence(self) -> float: ...
    def placement(self, launch: idr_torch.Launch) -> dict: ...
    def record(self) -> dict: ...
    def close(self) -> None: ...


class Replica:
    """The page's layout: this task holds one whole replica, split over its GPUs by a Pipe; DDP across tasks.
    The training loop (train() below) drives it through the Trainer protocol, as it drives bench_stage.py's Stages."""
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
        loss, logits = forward_backward(self.ddp_mp_model, x, y, self.scaler)
        if self.scaler is None:
            self.optimizer.step()
        else:  # fp16: unscale the gradients, skip the step if one overflowed, adapt the scale
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.steps += 1
        self.watchdog.tick(self.steps)
        return step_stats(loss, logits, y)

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
        return step_stats(None, logits, y)

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
    if cfg.check_args:
        return check_topology.check_args_main("replica", sys.argv[1:] if argv is None else argv)
    cuda = torch.cuda.is_available()
    resolve(cfg, cuda)
    plan = make_plan(cfg, cuda)  # nb_part, first_part, last_part of this task, or one clear error
    engine = pick_engine(cfg.engine)
    use_gpus(plan)  # torch.cuda.set_device(first_part), before anything touches CUDA
    return run(cfg, cuda, engine, lambda: Replica(cfg, plan, engine))


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


# ================================================================================================================
# The page's closing advice as options: mixed precision (--precision), gradient checkpointing
# (--activation-checkpointing) and ZeRO (--zero). Small pieces, so the memory benchmarks can use them as they are.
AUTOCAST_DTYPE = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # each --precision's autocast dtype


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """--precision's autocast for code on `device_type` ('cuda' or 'cpu'); fp32: none. Autocast computes in low
    precision from the fp32 weights, which stay fp32: checkpoints hold fp32 and load into any precision."""
    dtype = AUTOCAST_DTYPE[precision]
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
    micro-batch; the failure measured here: docs/memory.md, --activation-checkpointing.
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
    """This run's arguments as check_topology sees them on a trainer line (its checks and its memory model);
    `layout`: the stage layout's fields (layout="stage", ...) where they differ from cfg's."""
    t = check_topology.training_from_args(cfg, str(layout.get("layout", "replica")))
    return dataclasses.replace(t, **layout)


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
        arch = check_topology.arch_of(torch.cuda.get_device_capability(device))
        gpu_gib = torch.cuda.get_device_properties(device).total_memory / check_topology.GIB
    release = check_topology.version_tuple(torch.__version__)
    line = check_topology.memory_line(model, t, nb_part, replicas, gpu_gib, arch, release)
    return line, check_topology.worst_part(model, t, nb_part, replicas, arch, release).total / check_topology.GIB


def check_precision(cfg: argparse.Namespace, plan: check_topology.TaskPlan) -> None:
    """What only the GPU itself can refuse: bf16 where it has none (V100, compute capability 7.0)."""
    if (cfg.precision == "bf16" and not plan.cpu
            and check_topology.arch_of(torch.cuda.get_device_capability(plan.device(0))) == "sm70"):
        raise RunError(f"--precision bf16: this GPU ({torch.cuda.get_device_name(plan.device(0))}) has no bf16; use "
                       "--precision fp16 (autocast with a GradScaler)")


def options_text(cfg: argparse.Namespace, replicas: int) -> str:
    """The page's memory techniques this run uses, for the start-up line."""
    return (f"precision {cfg.precision}, activation checkpointing {'on' if cfg.activation_checkpointing else 'off'}, "
            + (f"ZeroRedundancyOptimizer(AdamW) over {replicas} replica(s)" if cfg.zero else "AdamW"))


# ================================================================================================================
# Beyond the page: arguments, data and cache, checks, checkpoints and resume, stop signals, the training loop
# (shared with bench_stage.py), the replica fingerprint, the JSON record.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, from check_topology's one definition of them (check_topology.ARGS: names, types, ranges, GPU and
    CPU defaults); a line it refuses raises check_topology.ArgumentError, one line that cli() prints (exit 2)."""
    return check_topology.parse_trainer_args("replica", argv, __doc__)


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


# A review is read whole into memory and tokenised: bound what one file, and all of them, may bring in (a 127 kB
# tarball holding one 100 MB review peaked at 2.6 GB). IMDB's reviews are a few kB each, about 65 MB for the 50,000 of
# train/ and test/ together; tokenising 78 MB of text peaked at 1.1 GB here, so the bound on all is 256 MiB.
REVIEW_BYTES = 1 << 20
CORPUS_BYTES = 256 << 20
TAR_ENTRIES = 1_000_000  # IMDB's tarball has about 100,000 (unsup/ included); each header read takes time and memory


def read_imdb(source: Path) -> dict[str, tuple[list[str], list[int]]]:
    """{'train': (texts, labels), 'test': (...)} with label 1 = pos, in a fixed (sorted) order."""
    found: dict[str, list[tuple[str, int, str]]] = {"train": [], "test": []}
    total = [0]

    def take(split: str, name: str, label: int, size: int, read: Callable[[int], bytes]) -> None:
        if size > REVIEW_BYTES:
            raise RunError(f"review {name} in {source} is {size} bytes, more than {REVIEW_BYTES >> 20} MiB: not an "
                           "IMDB review (they are a few kB); remove it, or download aclImdb_v1.tar.gz again")
        total[0] += size
        if total[0] > CORPUS_BYTES:
            raise RunError(f"the reviews of {source} hold more than {CORPUS_BYTES >> 20} MiB of text (at {name}): not "
                           "the IMDB corpus (about 65 MB); check --data-dir")
        found[split].append((name, label, read(REVIEW_BYTES).decode("utf-8", errors="replace")))

    if source.is_dir():
        read_imdb_folder(source, take)
    else:
        read_imdb_tarball(source, take)
    for split, items in found.items():
        if not items:
            raise RunError(f"{source} has no {split}/pos or {split}/neg reviews: it is not a complete aclImdb; "
                           "download aclImdb_v1.tar.gz again")
        items.sort(key=lambda t: (t[1], t[0]))
    return {s: ([t for _, _, t in items], [y for _, y, _ in items]) for s, items in found.items()}


def read_imdb_folder(source: Path, take: Callable) -> None:
    """Every review file of an aclImdb folder, each opened only if it is a regular file (a FIFO among the reviews
    would block the read forever, before --timeout is armed)."""
    for split in ("train", "test"):
        for label in ("neg", "pos"):
            folder = source / split / label
            if not folder.is_dir():
                raise RunError(f"{folder} is missing: {source} is not a complete aclImdb folder")
            for f in sorted(folder.glob("*.txt")):
                try:
                    with open_regular(f) as review:
                        take(split, f.name, int(label == "pos"), os.fstat(review.fileno()).st_size, review.read)
                except OSError as exc:
                    raise RunError(f"cannot read review {f}: {exc.strerror}; "
                                   + ("remove it" if isinstance(exc, NotAFile) else
                                      "fix its permissions or re-extract aclImdb")) from None


def read_imdb_tarball(source: Path, take: Callable) -> None:
    """Every review of aclImdb_v1.tar.gz, read in place, never extracted (a member's path cannot reach outside);
    only regular members, each read at most to the bound."""
    pattern = re.compile(r"(?:^|/)(train|test)/(pos|neg)/[^/]+\.txt$")
    mode = "r:gz" if source.name.endswith((".gz", ".tgz")) else "r:" if source.name.endswith(".tar") else "r:*"
    try:
        with tarfile.open(source, mode) as tar:
            for count in itertools.count(1):
                member = tar.next()
                if member is None:
                    break
                tar.members.clear()  # tarfile keeps every header read (TarFile.next): 0.5 kB each, 150 MB for 300k
                if count > TAR_ENTRIES:
                    raise RunError(f"{source} holds more than {TAR_ENTRIES} entries: not the IMDB tarball (about "
                                   "100,000); download aclImdb_v1.tar.gz again")
                m = pattern.search(member.name)
                if m and member.isfile():
                    take(m.group(1), member.name, int(m.group(2) == "pos"), member.size,
                         tar.extractfile(member).read)
            # tarfile ends its loop quietly at a garbled header past the first member (tarfile.TarFile.next),
            # so a damaged gzip can look like a short archive: reading the stream to its end makes gzip check
            # its CRC and length (gzip._GzipReader raises BadGzipFile, an OSError).
            while tar.fileobj.read(1 << 20):
                pass
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:  # zlib.error: a damaged deflate stream
        why = " ".join(first_line(exc).split())[:160]
        raise RunError(f"cannot read {source}: {why}; it is damaged or not the IMDB tarball: download "
                       "aclImdb_v1.tar.gz again") from None


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
    """The tokenised cache's name: the options that shape it and the content of what it was built from: the name,
    size and modification time (ns) of every review file read_imdb reads, or of the tarball. A review rewritten in
    place changes its own time, not its folder's (the folder's alone reused a stale cache)."""
    h = hashlib.sha256(f"{CACHE_FORMAT}|{cfg.vocab_size}|{cfg.seq_len}|{cfg.synthetic}|{cfg.seed}".encode())
    if source is None:
        return h.hexdigest()[:16]
    h.update(f"{source.resolve()}\n".encode())
    if not source.is_dir():
        st = source.stat()
        h.update(f"{st.st_size}|{st.st_mtime_ns}".encode())
        return h.hexdigest()[:16]
    for split in ("train", "test"):
        for label in ("neg", "pos"):
            folder = source / split / label
            try:
                with os.scandir(folder) as entries:
                    files = sorted((e.name, e.stat()) for e in entries if e.name.endswith(".txt"))
            except OSError:  # missing or unreadable: read_imdb says so
                files = []
            h.update(f"{split}/{label}:{len(files)}\n".encode())
            for name, st in files:
                h.update(f"{name}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


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
    """Tokenised tensors, built once by rank 0 and cached; the other ranks wait, then load the cache (or build their
    own where they cannot see it). What each task found is gathered (agree): one that cannot read the data stops all."""
    cache_dir = Path(cfg.cache_dir or os.environ.get("SCRATCH") or
                     (source.parent if source is not None and os.access(source.parent, os.W_OK) else ".cache"))
    name, cache, key = "synthetic" if source is None else "imdb", None, None  # rank 0 computes the key; others take it

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
        except (OSError, RuntimeError) as exc:  # torch.save wraps a failed write's OSError in a RuntimeError
            log(f"notice: cannot write the cache {cache} ({write_failure(exc)}); every run will tokenise again")
        return data

    def read() -> dict | None:
        try:
            data = load_weights_only(cache)
        except FileNotFoundError:
            return None
        except Exception as exc:  # truncated, corrupt, or not a plain file of tensors: rebuild rather than crash
            log(f"notice: the cache {cache} is unreadable ({load_refusal(exc)}); rebuilding it")
            return None
        if corpus_fits(data, cfg):
            return data
        log(f"notice: the cache {cache} does not hold this corpus's tensors; rebuilding it")
        return None

    launch, data, problem = idr_torch.current(), None, None
    if launch.rank == 0:
        try:
            key = cache_key(cfg, source)
            cache = cache_dir / f"{name}-{key}.pt"
            data = read() or build()
        except RunError as exc:
            problem = str(exc)
    key = agree(problem, launch, key)[0]  # rank 0's verdict on the data, before the others read what it cached
    cache = cache_dir / f"{name}-{key}.pt"
    # agree() above is the barrier, on gloo (HOST_GROUP), never nccl's: nccl's barrier() picks global rank % GPUs per
    # node, not the current device, and would put task 1 on task 0's GPU (docs/gpu.md, the rule per release)
    problem = None
    try:
        if data is None:
            data = read() or build()  # the cache folder may not be shared between nodes: build here then
        check_classes(data, source, cfg)
    except RunError as exc:
        problem = str(exc)
    agree(problem, launch)
    CORPUS.update(corpus_identity(data))
    return data


def corpus_fits(data: object, cfg: argparse.Namespace) -> bool:
    """A cache holds what build() writes for these options: token ids below --vocab-size, --seq-len columns,
    labels 0 or 1, one per review."""
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("itos"), list):
        return False
    for split in ("train", "test"):
        x, y = data.get(f"{split}_x"), data.get(f"{split}_y")
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() == 2 and y.dim() == 1
                and x.dtype == torch.int32 and y.dtype == torch.int64 and x.size(1) == cfg.seq_len
                and len(x) == len(y) and len(y) > 0):
            return False
        if y.min() < 0 or y.max() > 1 or x.min() < 0 or x.max() >= cfg.vocab_size:
            return False
    return True


def check_classes(data: dict, source: Path | None, cfg: argparse.Namespace) -> None:
    """Both classes in each split: with one alone, training reaches "test acc 1.000" and it means nothing."""
    where = str(source) if source is not None else f"--synthetic {cfg.synthetic}"
    for split in ("train", "test"):
        neg, pos = torch.bincount(data[f"{split}_y"], minlength=2).tolist()[:2]
        if min(neg, pos) == 0:
            have, missing = ("positive", "neg") if pos else ("negative", "pos")
            raise RunError(f"{where}: all {neg + pos} {split} reviews are {have}"
                           + (f" ({split}/{missing} holds none)" if source is not None else "")
                           + ": a classifier needs both classes, and its accuracy would mean nothing; "
                           + (f"add the {split}/{missing} reviews, or check --data-dir" if source is not None
                              else "raise --synthetic"))


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
    return Loader(BatchTensors(x, y), sampler=batches, batch_size=None, num_workers=workers, pin_memory=pin,
                  persistent_workers=workers > 0, worker_init_fn=functools.partial(worker_keeps_on, os.getpid()))


class Loader(torch.utils.data.DataLoader):
    """A DataLoader whose workers live through the job's stop signals, which their trainer acts on (StopRequest).
    Slurm signals every process of a step (scancel, preemption, the time limit), a terminal's Ctrl-C its whole
    foreground group. torch's worker loop (torch/utils/data/_utils/worker.py, _worker_loop) installs DataLoader.cpp's
    handler_SIGTERM: exit 0 if the sender is the worker's parent, else die by SIGTERM, and the trainer fails on
    "DataLoader worker (pid ...) is killed by signal: Terminated"; SIGINT's KeyboardInterrupt ends the loop
    quietly, the trainer waiting for a worker that is gone. The workers are forked in __iter__ (the first one, they
    persist): with the stop signals blocked, so that none reaches a worker before worker_keeps_on has run, and no
    thread of a worker (torch starts some before it) ever takes SIGTERM with torch's handler."""

    def __iter__(self) -> object:
        if not self.num_workers:
            return super().__iter__()
        before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # a signal meanwhile is held, not lost
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


def worker_keeps_on(trainer: int, worker_id: int) -> None:
    """worker_init_fn (Loader): SIGINT and SIGUSR1 ignored; SIGTERM, blocked in every thread, taken by one thread
    that keeps torch's rule for the trainer's own SIGTERM alone: DataLoader's _shutdown_workers and
    multiprocessing's exit handler end a worker with terminate() and then wait for it (ignored, the trainer's exit
    would hang). A worker also ends within 5 s when its trainer dies (the loop's ManagerWatchdog)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if hasattr(signal, "sigwaitinfo"):
        threading.Thread(target=end_on_sigterm_from, args=(trainer,), name="sigterm", daemon=True).start()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGUSR1})
    else:  # macOS has no sigwaitinfo: SIGTERM as torch's handler takes it (a laptop has no Slurm to send it)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def end_on_sigterm_from(trainer: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == trainer:
            os._exit(0)  # as torch's handler_SIGTERM does for its parent's


# ----------------------------------------------------------------------------------------------------------------
# setup: the defaults, this task's plan and check_topology's verdict, before any process group exists
def resolve(cfg: argparse.Namespace, cuda: bool) -> None:
    """Fill the model's GPU or CPU defaults where the line gives none (each value was checked when parsed)."""
    check_topology.resolve_defaults(cfg, cuda)


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


def verdict(findings: check_topology.Findings) -> None:
    """Warnings printed once, errors raised as one line: the words of the pre-flight check and of --check-args."""
    for f in findings:
        if f.level != "error":
            log(f"check_topology: {f}")
    if findings.errors:
        raise RunError(check_topology.refusal_text(findings.errors))


def make_plan(cfg: argparse.Namespace, cuda: bool) -> check_topology.TaskPlan:
    """The replica layout's plan and verdict: errors stop us here, before init_process_group. The checks are
    check_topology's (check_trainer_task), which --check-args and the pre-flight check run too."""
    findings = check_topology.Findings()
    plan = task_plan(cuda, cfg.nlayers, cfg.nb_part, findings, cfg.devices)
    check_topology.check_trainer_task("replica", cfg, plan, idr_torch.current(), cuda, torch.__version__, findings)
    verdict(findings)
    check_precision(cfg, plan)
    return plan


def check_outputs(cfg: argparse.Namespace) -> None:
    """Fail before training, not after an hour of it: every file this run writes (--save, its companion and lock,
    --json-out) must be a regular file or nothing yet, in an existing folder where a file can really be written.
    A device node is refused for --save: the atomic rename would replace it (as root, --save /dev/null would
    replace /dev/null). --json-out is appended to, so a character device or a pipe (/dev/null, /dev/stdout) is
    fine there, a block device is not."""
    if cfg.save and cfg.json_out and Path(cfg.save).expanduser().resolve() == Path(cfg.json_out).expanduser().resolve():
        raise RunError(f"--save and --json-out are both {cfg.save}: the checkpoint would replace the results; give "
                       "them two names")
    for option, path in (("--save", cfg.save), ("--json-out", cfg.json_out)):
        if not path:
            continue
        target = Path(path).expanduser()
        for file in ((target, resume_file(target), lock_file(target)) if option == "--save" else (target,)):
            check_output_file(option, path, file)
        folder = target.resolve().parent
        if not folder.is_dir():
            raise RunError(f"{option} {path}: folder {folder} does not exist; create it (mkdir -p {folder}) or "
                           "choose another path")
        probe_folder(option, path, folder)


PROBE_BYTES = 1 << 20  # what the write check writes: an empty file fits on a full disk and proves nothing


def probe_folder(option: str, path: str, folder: Path) -> None:
    """Really write (and remove) a file in `folder`: permissions, ACLs, a read-only mount, a full disk, quota of
    blocks or of inodes. The bytes are written and fsync'ed, since a network file system (NFS, GPFS) may report a
    full quota only when the data reaches the server."""
    probe = None
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        raise RunError(f"{option} {path}: cannot write in {folder} ({exc.strerror}"
                       + (f": not even {PROBE_BYTES >> 20} MiB fits" if full else "") + "); "
                       + ("free space there (on Jean Zay, idr_quota_user and idr_quota_project show the quotas), or "
                          "choose another path"
                          if full else "choose a path under $WORK or $SCRATCH")) from None
    finally:
        if probe is not None:
            with contextlib.suppress(OSError):
                os.unlink(probe)


def file_kind(mode: int) -> str | None:
    """What a file that is not a regular file or a folder is, in words (None: a regular file or a folder)."""
    return ("a block device" if stat.S_ISBLK(mode) else "a character device" if stat.S_ISCHR(mode) else
            "a pipe (FIFO)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else None)


def check_output_file(option: str, path: str, file: Path) -> None:
    """`file`, if it exists, is one this run may replace (--save) or append to (--json-out)."""
    try:
        mode = file.stat().st_mode  # through a symbolic link: what would be written is what it points to
    except FileNotFoundError:
        return
    except OSError as exc:
        raise RunError(f"{option} {path}: cannot use {file} ({exc.strerror})") from None
    if stat.S_ISDIR(mode):
        raise RunError(f"{option} {path}: {file} is a folder; give a file name, e.g. {option} {file / 'model.pt'}"
                       if file == Path(path).expanduser() else
                       f"{option} {path}: {file} is a folder, where this run writes a file; remove it or choose "
                       "another path")
    kind = file_kind(mode)
    if kind and (option == "--save" or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode)):
        raise RunError(f"{option} {path}: {file} is {kind}, not a regular file: "
                       + ("saving replaces the file by renaming a new one over it, so it would replace the device; "
                          if option == "--save" else "") + "choose a file under $WORK or $SCRATCH")
    if option == "--json-out" and not os.access(file, os.W_OK):
        raise RunError(f"--json-out {path}: {file} is not writable (permission denied); choose another file")


def cpu_threads(launch: idr_torch.Launch) -> int:
    """The cores this task really has (os.sched_getaffinity: what Slurm's task/affinity or cgroup left it), for its
    intra-op threads and its DataLoader workers: its own cores when Slurm bound it, else the node's split between
    its tasks (N tasks each using every core would oversubscribe the node). SLURM_CPUS_PER_TASK is what was asked,
    not what the task got: srun 22.05 does not pass --cpus-per-task on to the step, so a plain `srun` in a
    `-c 10 --hint=nomultithread` job binds each task to one core (measured on the test cluster's task/affinity
    variant, tests/test_cpu_binding.py); say so once."""
    avail = len(os.sched_getaffinity(0))
    share = max(1, avail // launch.local_world_size)
    cpt = os.environ.get("SLURM_CPUS_PER_TASK", "").strip()
    if cpt.isdigit() and avail <= int(cpt):
        if avail < int(cpt) and not _SAID_CORES:
            _SAID_CORES.append(True)
            log(f"notice: this task may run on {avail} core(s) but the job asked --cpus-per-task={cpt}: srun did "
                "not pass it on to the step (Slurm 22.05); launch with `srun -c $SLURM_CPUS_PER_TASK ...` or "
                "`export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK`")
        return avail  # bound to its own cores
    return min(int(cpt), share) if cpt.isdigit() else share


_SAID_CORES: list = []


def cpu_placement() -> dict:
    """Where this task runs on the CPU, for the record: the cores it may use, as Slurm bound them."""
    cores = sorted(os.sched_getaffinity(0))
    return {"cpus": len(cores), "cpu_ids": cores, "threads": torch.get_num_threads(),
            "cpus_per_task": os.environ.get("SLURM_CPUS_PER_TASK")}


# ----------------------------------------------------------------------------------------------------------------
# checkpoints. --save PATH is exactly the page's file, `torch.save(ddp_mp_model.module.state_dict(), PATH)`, so
# the page's `model.load_state_dict(torch.load(PATH))` loads it; what resuming needs (optimizer, epoch, batch, RNG
# states, the layout) goes in PATH.resume.pt beside it, with the SHA-256 of the model file it goes with. Rank 0
# writes both, holding PATH.lock (SaveLock: one writer per PATH).
#
# The two files change as a pair although no rename swaps two files at once: the new companion is first staged,
# whole, as .PATH.resume.pt.next; then the model file is renamed over PATH (the commit point); then the staged
# companion over PATH.resume.pt. A save killed at any point leaves a model file and a companion naming its digest:
# the old companion before the commit, the staged one after it. read_resume() takes whichever matches; the next
# save finishes (or drops) what a killed one left, and removes its temporary files. Each file is written beside its
# target (one file system, so the rename is atomic) and fsync'ed before its rename; the folder is fsync'ed after
# it, so the rename also survives a crash of the node. Files get the user's umask (teams share checkpoints through
# project folders). Every file the kit loads is read with weights_only=True: plain tensors, numbers, strings,
# lists, tuples and dicts (optimizer and GradScaler state_dicts, RNG states are all of those); a pickled object that
# would run code is refused.
def real_paths(cfg: argparse.Namespace) -> None:
    """--save and --load as the files they name, resolved once at start-up through every symbolic link: the
    companion, the staged companion and the lock go beside the data, not beside a link to it (there, --resume
    found no companion and restarted from epoch 0, each save renamed a regular file over the link, and a run
    naming the target directly was not locked out). Every later use, and the checkpoint's record, is this path.
    A path whose last part is no link is kept as given (a linked folder above it holds the pair all the same)."""
    for option in ("save", "load"):
        given = getattr(cfg, option)
        if given and os.path.islink(os.path.expanduser(given)):
            real = os.path.realpath(os.path.expanduser(given))
            what = ("the checkpoint, its companion and its lock are kept" if option == "save" else
                    "the checkpoint and its companion are read")
            log(f"notice: --{option} {given} is a symbolic link to {real}: {what} there")
            setattr(cfg, option, real)


def resume_file(path: str | Path) -> Path:
    return Path(path).expanduser().with_name(Path(path).name + ".resume.pt")


def staged_file(path: str | Path) -> Path:
    """Where a save stages the new companion until its model file is committed."""
    return Path(path).expanduser().with_name(f".{Path(path).name}.resume.pt.next")


def lock_file(path: str | Path) -> Path:
    return Path(path).expanduser().with_name(Path(path).name + ".lock")


def temporary_file(target: Path) -> Path:
    return target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")


def stale_temporaries(target: Path) -> list[Path]:
    """What killed saves of `target` left: its own and its companion's temporary files."""
    own = re.compile(rf"\.{re.escape(target.name)}(\.resume\.pt)?\.[0-9a-f]{{8}}\.tmp")
    return [p for p in target.parent.iterdir() if own.fullmatch(p.name)]


def layout_of(cfg: argparse.Namespace, nb_part: int) -> dict:
    """What a checkpoint must match: the model and how many parts it is cut in (whatever the layout:
    nb_part 2 here and bench_stage.py --pp 2 hold the same parts under the same keys)."""
    return {"architecture": ARCHITECTURE, "nb_part": nb_part,
            **{a.dest: getattr(cfg, a.dest) for a in check_topology.ARGS if a.checkpoint},
            "part_sizes": check_topology.part_sizes(cfg.nlayers, nb_part)}


def rng_states(world: int) -> list[dict] | None:
    """Every rank's random state (dropout masks differ per replica), gathered on rank 0 for its checkpoint: byte
    tensors and Python's (version, tuple of ints, None), which weights_only loads as they were."""
    mine = {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    if world == 1:
        return [mine]
    everyone: list | None = [None] * world if idr_torch.rank == 0 else None
    dist.gather_object(mine, everyone, dst=0, group=HOST_GROUP[0])
    return everyone


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_file(obj: object, target: Path) -> Path:
    """torch.save into a new temporary file beside `target`, created with the user's umask (mkstemp's 0600 would
    keep a team from sharing it), flushed and fsync'ed: whole on disk before anything renames it."""
    tmp = temporary_file(target)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        cause = os_error_in(exc)  # torch.save wraps a failed write's OSError in a RuntimeError about zip offsets
        if cause is not None and cause.filename is None:
            raise OSError(cause.errno, cause.strerror, str(target)) from exc  # say which file could not be written
        raise
    return tmp


def sync_folder(folder: Path) -> None:
    """fsync a folder, so that a rename in it survives a crash of the node, not only of the process."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot sync a folder (EINVAL): the rename is atomic all the same
        pass
    finally:
        os.close(fd)


def atomic_torch_save(obj: object, path: Path) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: readers see the old file or the new
    one, never half of one, even if this process is killed mid-write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = write_file(obj, path)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_folder(path.parent)


@interrupts_held  # a second Ctrl-C waits for the pair to be whole (hold_signal)
def save_checkpoint(path: str, model_state: dict, resume: dict) -> None:
    """The pair, replaced as a pair (see above): both files written whole, the companion staged, the model file
    committed, the companion moved into place. A failure before the commit removes what it wrote and leaves the
    previous pair as it was."""
    target = Path(path).expanduser()
    companion, staged = resume_file(target), staged_file(target)
    settle_pair(target)
    written: list[Path] = []
    try:
        written.append(write_file(model_state, target))
        written.append(write_file(dict(resume, model_sha256=file_digest(written[0])), companion))
        os.replace(written[1], staged)
        written[1] = staged
        sync_folder(target.parent)
        os.replace(written[0], target)  # the commit: from here on the staged companion is the one that matches
        written = []
        sync_folder(target.parent)
        os.replace(staged, companion)
        sync_folder(target.parent)
    except BaseException:
        for file in written:
            file.unlink(missing_ok=True)
        raise


def settle_pair(target: Path) -> None:
    """Before a save, by the lock's holder: finish what a killed save left (its staged companion, when the model
    file it names was committed) or drop it (when it was not), and remove the killed save's temporary files."""
    staged = staged_file(target)
    if staged.exists():
        try:
            state = load_weights_only(staged)
        except Exception:  # written whole before its rename, so only a damaged disk gets here: drop it
            state = None
        if isinstance(state, dict) and target.exists() and state.get("model_sha256") == file_digest(target):
            os.replace(staged, resume_file(target))
        else:
            staged.unlink(missing_ok=True)
        sync_folder(target.parent)
    for tmp in stale_temporaries(target):
        tmp.unlink(missing_ok=True)


def save_progress(cfg: argparse.Namespace, trainer: Trainer, epoch: int, batches: int, n_batches: int, step: int,
                  world: int) -> bool:
    """Every rank calls it (the RNG states, and the stage layout's consolidation, are collectives); rank 0
    writes --save and its companion. epoch: the one in progress (from 0), `batches` of its `n_batches` done: all of
    them is the epoch done, fewer (a stop signal, --max-steps) a point inside it that --resume goes on from.
    A save that fails (a full disk, a quota) is one line, the previous pair stays, and training goes on: the
    next save tries again. Returns whether rank 0 saved (True on the other ranks)."""
    if not cfg.save:
        return False
    done = batches == n_batches
    epoch, batch_in_epoch = (epoch + 1, 0) if done else (epoch, batches)
    state = trainer.state()
    rngs = rng_states(world)
    if idr_torch.rank != 0:
        return True
    model_state, optimizer_state = state
    try:
        save_checkpoint(cfg.save, model_state, {
            "format": RESUME_FORMAT, "optimizer": optimizer_state, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
            "samples_in_epoch": batch_in_epoch * cfg.batch_size * trainer.dp_size,
            "step": step, "layout": layout_of(cfg, trainer.nb_part), "engine": trainer.engine, "rng": rngs,
            "data": dict(CORPUS),
            "args": {k: v for k, v in vars(cfg).items() if isinstance(v, (int, float, str, type(None)))}})
    except (OSError, RuntimeError) as exc:  # torch.save wraps the OSError of a failed write in a RuntimeError
        kept = (f"the previous checkpoint {cfg.save} (with its {resume_file(cfg.save).name}) is kept"
                if Path(cfg.save).expanduser().exists() else f"there is no previous checkpoint in {cfg.save}")
        SAVES["failed"] = f"epoch {epoch}, step {step}: {write_failure(exc)}"
        print(f"{PROG[0]}: error: checkpoint not saved (epoch {epoch}, step {step}): {write_failure(exc)}; {kept}; "
              "training goes on and the next save tries again", file=sys.stderr, flush=True)
        return False
    SAVES.update(failed=None, on_disk=position_text(epoch, batch_in_epoch, step))
    return True


# Rank 0's saves in this run: what the --save file holds, and why the last save failed (None: it did not)
SAVES: dict = {"on_disk": None, "failed": None}
# This run's corpus as read (load_corpus): what a checkpoint records, and a resume checks, of the data it trained on
CORPUS: dict = {}


def position_text(epoch: int, batch_in_epoch: int, step: int) -> str:
    """A checkpoint's position as the resume line says it: 'epoch 1 + 3 batches, step 12'."""
    return f"epoch {epoch}" + (f" + {batch_in_epoch} batches" if batch_in_epoch else "") + f", step {step}"


def check_last_save(cfg: argparse.Namespace) -> None:
    """At the end of a run (rank 0): if the last save failed, the --save file is older than this run's end, and the
    run says so in one line and exits 1, instead of ending as if its checkpoint were current."""
    if not SAVES["failed"] or idr_torch.rank != 0:
        return
    held = (f"{cfg.save} holds {SAVES['on_disk']}" if SAVES["on_disk"] else
            f"{cfg.save} holds an earlier run's checkpoint" if Path(cfg.save).exists() else
            f"there is no checkpoint in {cfg.save}")
    raise RunError(f"training ended, but the last checkpoint was not saved ({SAVES['failed']}): {held}, not where "
                   "this run ended; free space there (or give another --save) and run again with --resume to train "
                   "the rest again")


def corpus_identity(data: dict) -> dict:
    """What a checkpoint records of the corpus it trained on: the review counts, and the vocabulary (which word
    each embedding row stands for), as a digest."""
    itos = "\n".join(data["itos"]).encode("utf-8", errors="surrogatepass")
    return {"train": len(data["train_y"]), "test": len(data["test_y"]),
            "vocab_sha256": hashlib.sha256(itos).hexdigest()[:16]}


def os_error_in(exc: BaseException) -> OSError | None:
    """The OSError an exception is, or was raised from or while handling."""
    while exc is not None and not isinstance(exc, OSError):
        exc = exc.__cause__ or exc.__context__
    return exc


def write_failure(exc: BaseException) -> str:
    """Why a write failed, in a few words: the OSError underneath, and its file."""
    cause = os_error_in(exc)
    if cause is None:
        return first_line(exc)[:160]
    return f"{cause.strerror or cause}" + (f" ({cause.filename})" if cause.filename else "")


def first_line(exc: BaseException) -> str:
    """An exception's first line, for a one-line error (some, like EOFError, have none)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class NotAFile(OSError):
    """A path the kit reads that is not a regular file: a FIFO (reading one waits for a writer forever, before
    --timeout is armed and while SIGTERM is held), a device, a socket, a folder."""


def open_regular(path: str | Path) -> io.BufferedReader:
    """Open `path` for reading only if it is a regular file (through links). A FIFO or device is never opened: stat
    first; then the open itself is non-blocking (a FIFO swapped in meanwhile does not block it) and what was
    opened is checked again (fstat), so no rename in between gets past."""
    def refusal(st: os.stat_result) -> NotAFile:
        what = "a folder" if stat.S_ISDIR(st.st_mode) else file_kind(st.st_mode)
        return NotAFile(errno.EINVAL, f"{what}, not a regular file", str(path))

    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise refusal(st)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise refusal(st)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def load_weights_only(path: Path) -> object:
    """torch.load as every file of the kit is loaded: tensors and plain values only, nothing that runs code, and
    from a regular file only."""
    with open_regular(path) as f:
        return torch.load(f, map_location="cpu", weights_only=True)


def load_refusal(exc: Exception) -> str:
    """Why torch.load refused a file, in one line."""
    if isinstance(exc, pickle.UnpicklingError):  # what weights_only raises on anything but tensors and plain values
        return ("it holds Python objects besides tensors and plain values, which could run code when loaded: "
                "refused")
    if isinstance(exc, NotAFile):
        return f"it is {exc.strerror}"
    return f"{type(exc).__name__}: {first_line(exc)[:120]}"


def read_model(path: str) -> dict:
    """The --load file: a state_dict, the page's or ours (the page's own torch.load, weights only), finite."""
    try:
        state = load_weights_only(Path(path).expanduser())
    except FileNotFoundError:
        raise RunError(f"--load {path}: no such file") from None
    except NotAFile as exc:
        raise RunError(f"--load {path} is {exc.strerror}: give the file --save wrote (or the page's torch.save "
                       "file)") from None
    except Exception as exc:
        raise RunError(f"--load {path} is not a readable model file ({load_refusal(exc)}); it may be truncated: use "
                       "an earlier one") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise RunError(f"--load {path} is not a state_dict (what torch.save(model.module.state_dict(), path) "
                       "writes)")
    for key, value in state.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise RunError(f"--load {path} holds non-finite values (nan or inf) in {key}: it comes from a run that "
                           "diverged; use an earlier checkpoint")
    return state


# What a companion holds, each of its own type (a hand-made or damaged one is one line, not a KeyError)
RESUME_FIELDS = {"format": str, "epoch": int, "batch_in_epoch": int, "step": int, "layout": dict,
                 "optimizer": (dict, type(None)), "rng": (list, type(None)), "model_sha256": str}


def load_companion(companion: Path, path: str) -> dict:
    """A companion, read weights-only and checked field by field."""
    alone = f"delete it to load {path}'s weights alone, with a fresh optimizer"
    try:
        state = load_weights_only(companion)
    except Exception as exc:
        raise RunError(f"{companion} is unreadable ({load_refusal(exc)}); {alone}") from None
    if not isinstance(state, dict) or state.get("format") != RESUME_FORMAT:
        raise RunError(f"{companion} was not written by this kit's --save; {alone}")
    for key, kind in RESUME_FIELDS.items():
        if not isinstance(state.get(key), kind) or (kind is int and state[key] < 0):
            found = "no" if key not in state else f"a bad ({type(state[key]).__name__})"
            raise RunError(f"{companion} has {found} '{key}' field: it is damaged or was edited; {alone}")
    for key, why in (("samples_in_epoch", samples_problem(state)), ("rng", rng_problem(state["rng"]))):
        if why:
            raise RunError(f"{companion} has a bad '{key}' field ({why}): it is damaged or was edited; {alone}")
    return state


def samples_problem(state: dict) -> str | None:
    """Why a companion's samples_in_epoch (absent before it was recorded) cannot be where its batch count is."""
    samples = state.get("samples_in_epoch")
    if samples is None:
        return None
    if type(samples) is not int or samples < 0:
        return f"{samples!r} is not a count of samples"
    if (samples == 0) != (state["batch_in_epoch"] == 0):
        return f"{samples} samples into an epoch at batch {state['batch_in_epoch']}"
    return None


def rng_problem(rngs: list | None) -> str | None:
    """Why a companion's RNG states would not restore (None: they would), tried on throwaway generators so that the
    check changes no stream: every task checks every rank's entry, so all reach the same verdict before any of
    them restores its own (restore_rng)."""
    for rank, entry in enumerate(rngs or []):
        try:
            torch.Generator().set_state(entry["torch"])
            random.Random().setstate(entry["python"])
            cuda = entry.get("cuda", [])
            if not isinstance(cuda, list):
                raise TypeError(f"cuda is a {type(cuda).__name__}, not a list")
            for gpu_state in cuda[: torch.cuda.device_count() if torch.cuda.is_available() else 0]:
                torch.Generator(device="cuda").set_state(gpu_state)
        except Exception as exc:  # what set_state and setstate raise on a damaged state: TypeError, ValueError...
            return f"rank {rank}: {type(exc).__name__}: {first_line(exc)[:100]}"
    return None


def read_resume(path: str, cfg: argparse.Namespace, nb_part: int) -> dict | None:
    """The companion that goes with the model file `path` (the settled one, or the staged one of a save killed after
    its commit), checked against this run's layout; None if there is none (the page's own file)."""
    target = Path(path).expanduser()
    companion, staged = resume_file(target), staged_file(target)
    if not companion.exists() and not staged.exists():
        return None
    digest = file_digest(target)
    state = load_companion(companion, path) if companion.exists() else None
    if state is None or state["model_sha256"] != digest:
        try:
            next_state = load_companion(staged, path) if staged.exists() else None
        except RunError:
            next_state = None
        if next_state is None or next_state["model_sha256"] != digest:
            raise RunError(f"{path} and {companion} come from different saves (the model file was replaced by "
                           f"something other than this kit's --save?); delete {companion} to start from {path}'s "
                           "weights with a fresh optimizer")
        state = next_state
    mine, theirs = layout_of(cfg, nb_part), state["layout"]
    if theirs.get("architecture") != ARCHITECTURE:  # the same keys and shapes, another function of them
        raise RunError(f"--load {path} holds a model of architecture {theirs.get('architecture', 'post-ln/1')} "
                       f"(this kit's is {ARCHITECTURE}: {ARCHITECTURE_CHANGE}); its weights would load and mean "
                       f"something else: start afresh (another --save path), or go on with the kit that saved it")
    if mine != theirs:
        diff = ", ".join(f"{k} {theirs.get(k)} (now {v})" for k, v in mine.items() if theirs.get(k) != v)
        raise RunError(f"--load {path} was saved with another layout: {diff}; rerun with the saved values "
                       f"(e.g. --nb-part {theirs.get('nb_part')} --nlayers {theirs.get('nlayers')})")
    check_resumed_settings(path, cfg, state)
    return state


# What a resume does with each argument given another value than the saved run's (never: keep the saved value while
# the companion records the new one). tests/test_faults_checkpoint.py checks that every argument has its rule.
#   layout:  the parameters' shapes and their cut into parts: refused by read_resume's layout check
#   applied: this run's value runs from its first step (one notice line lists them)
#   refused: one line naming the saved value
#   corpus:  the data, checked as read (review counts, vocabulary), not as the option's text: a copy elsewhere is fine
#   none:    not a setting of the training (files, modes)
RESUME_RULES: dict[str, str] = {
    **{a.dest: "layout" for a in check_topology.ARGS if a.checkpoint}, "nb_part": "layout",
    # the Pipe's and the schedule's cut of each batch, the batch (samples_in_epoch keeps the place in the epoch),
    # the precision (autocast; fp16's GradScaler state is restored where both are fp16, else it starts afresh),
    # ZeRO (the optimizer state is saved in plain AdamW's layout and loads either way), the stages per task (their
    # product, nb_part, is the layout), the length of the run, and what only times or watches it
    **dict.fromkeys(("dropout", "chunks", "batch_size", "precision", "activation_checkpointing", "zero", "engine",
                     "devices", "pp", "schedule", "virtual_stages", "epochs", "max_steps", "untimed_steps", "lr",
                     "lr_warmup", "lr_decay", "tf32",
                     "workers", "timeout", "log_every"), "applied"),
    # the data order: DistributedSampler shuffles epoch e with seed + e, and a resume continues that order at the
    # saved sample (another seed would train some samples twice and others never in the epoch in progress)
    "seed": "refused",
    **dict.fromkeys(("synthetic", "data_dir"), "corpus"),
    **dict.fromkeys(("cache_dir", "json_out", "save", "load", "resume", "check_args"), "none"),
}


def check_resumed_settings(path: str, cfg: argparse.Namespace, state: dict) -> None:
    """Each setting this run gives another value than the saved run: refused in one line, or applied and said."""
    saved, data = state.get("args") or {}, state.get("data") or {}
    if "seed" in saved and saved["seed"] != cfg.seed:
        raise RunError(f"--seed {cfg.seed}: {path} was saved by a run with --seed {saved['seed']}, which fixes the "
                       "order of the data that this resume continues (each epoch is shuffled with seed + epoch); "
                       f"rerun with --seed {saved['seed']}, or start a new run (another --save) with --seed "
                       f"{cfg.seed}")
    if data and CORPUS and data != CORPUS:
        def text(d: dict) -> str:
            return f"{d.get('train')} training reviews, vocabulary {str(d.get('vocab_sha256'))[:8]}"
        given = (f"--data-dir {saved['data_dir']}" if saved.get("data_dir") else
                 f"--synthetic {saved['synthetic']}" if saved.get("synthetic") else "its data")
        raise RunError(f"--load {path} was trained on another corpus ({text(data)}; this run reads {text(CORPUS)}): "
                       "its place in the epoch and the words of its embedding rows belong to that one; rerun with "
                       f"{given}, or, to start from its weights alone, copy {path} without its "
                       f"{resume_file(path).name} and --load the copy")
    changed = [f"{check_topology.ARG[k].flag} {_shown(getattr(cfg, k))} (saved {_shown(v)})"
               + (" (the GradScaler starts at its initial scale)" if k == "precision" and cfg.precision == "fp16"
                  else "")
               for k, v in saved.items() if RESUME_RULES.get(k, "applied") == "applied" and k in check_topology.ARG
               and hasattr(cfg, k) and getattr(cfg, k) != v]
    if changed:
        log(f"  settings changed since the save, applied from this run's first step: {', '.join(changed)}")


def _shown(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else "on" if value is True else "off" if value is False else \
        str(value)


def resume_point(cfg: argparse.Namespace, trainer: Trainer) -> tuple[int, int, int, dict | None]:
    """--load, or --resume's --save file if it exists, into the model on every rank (before DDP wraps it):
    (epoch, batch in that epoch, step, the companion), or a fresh start. A file without a companion (the
    page's own) gives the weights and a fresh optimizer, from epoch 0. Every task reads the files itself (a
    folder one node cannot see, a file truncated on one): their verdicts are gathered (agree)."""
    launch = idr_torch.current()
    found = bool(cfg.resume and not cfg.load and Path(cfg.save).expanduser().exists())
    load = cfg.load or (cfg.save if found else None)
    problem, state = None, None
    if load:
        try:
            model_state, state = read_model(load), read_resume(load, cfg, trainer.nb_part)
            trainer.load(model_state, state["optimizer"] if state else None)
        except RunError as exc:
            problem = str(exc)
        except (RuntimeError, ValueError, KeyError, IndexError) as exc:
            problem = (f"--load {load} does not fit this model ({first_line(exc)[:160]}); rerun with the options it "
                       "was saved with" + (f": {state.get('args')}" if state else ""))
    seen = agree(problem, launch, found)
    if len(set(seen)) > 1:
        raise RunError(f"--resume: {cfg.save} exists for task(s) {[r for r, s in enumerate(seen) if s]} but not for "
                       f"task(s) {[r for r, s in enumerate(seen) if not s]}: every task loads it; keep --save on a "
                       "file system every node sees ($WORK, $SCRATCH)")
    if not load:
        return 0, 0, 0, None
    if state is None:
        log(f"loaded {load}: weights only (no {resume_file(load).name} beside it): fresh optimizer, epoch 0")
        return 0, 0, 0, None
    start_epoch, step = state["epoch"], state["step"]
    log(f"loaded {load}: {position_text(start_epoch, state['batch_in_epoch'], step)}")
    if load == cfg.save:
        SAVES["on_disk"] = position_text(start_epoch, state["batch_in_epoch"], step)
    skip = batches_to_skip(state, cfg.batch_size * trainer.dp_size)
    per_epoch = CORPUS.get("train", 0) // trainer.dp_size // cfg.batch_size  # as make_loaders' drop_last cuts it
    if skip and skip >= per_epoch > 0:  # the save's samples cover every batch this run's epoch holds
        log(f"  epoch {start_epoch + 1}: skipped, its {per_epoch} batches of {cfg.batch_size} x {trainer.dp_size} "
            "replica(s) were all trained before the save")
        start_epoch, skip = start_epoch + 1, 0
    return start_epoch, skip, step, state


def batches_to_skip(state: dict, global_batch: int) -> int:
    """Where a run saved inside an epoch goes on: the first samples_in_epoch of the epoch's order are done.
    DistributedSampler deals the epoch's permutation (seeded by seed + epoch, whatever the replica count) to the
    replicas in turn, so k batches of b on each of d replicas are its first k*b*d samples (torch/utils/data/
    distributed.py): with another batch size or replica count, the same samples are a different batch count."""
    skip, samples = state["batch_in_epoch"], state.get("samples_in_epoch")
    if not skip or samples is None or samples == skip * global_batch:
        return skip
    now = samples // global_batch  # rounded down: at most one global batch is trained twice, none left out
    log(f"  the save was {samples} samples into epoch {state['epoch'] + 1} ({skip} batches of "
        f"{samples // skip} over its replicas); with {global_batch} per step now, this run skips {now} batches")
    return now


def restore_rng(state: dict, rank: int) -> None:
    rngs = state.get("rng") or []
    if len(rngs) > rank:  # same world size: each rank continues its own stream
        torch.set_rng_state(rngs[rank]["torch"])
        random.setstate(rngs[rank]["python"])
        if rngs[rank].get("cuda") and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rngs[rank]["cuda"])


class SaveLock:
    """One writer per --save: rank 0 holds PATH.lock for the whole run, and a second run with the same --save is
    refused at start-up with the holder's job, host and PID (the lock file holds them).

    The lock is a POSIX byte-range lock (fcntl F_SETLK, Python's fcntl.lockf), not flock() and not an O_EXCL lock
    file. It is the kind cluster file systems keep coherent across nodes: on IBM Spectrum Scale (GPFS: Jean Zay's
    $WORK and $SCRATCH) fcntl locks exclude other nodes while flock() is node-local (measured on GPFS clusters:
    tox-dev/filelock#389, ibm-granite/granite.build#322); NFS carries fcntl locks to the server (NLM, NFSv4) and
    emulates flock() with them (flock(2), "NFS details"); Lustre keeps both coherent when mounted with -o flock,
    and fails both (ENOSYS) with -o noflock: then this run says it cannot lock and goes on. The holder's kernel
    (or the cluster's lock manager) releases the lock however the process ends, so a killed job leaves no stale
    lock to guess about (an O_EXCL lock file would, and a PID can only be checked on its own node). Two POSIX
    rules shape the code: the lock is the process's (a fork, as DataLoader workers do, does not inherit it), and
    closing any descriptor of the file releases it, so the file is opened once. A clean exit removes the file."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def take(cls, save: str) -> SaveLock | None:
        lock = lock_file(save)
        for _ in range(5):
            try:  # O_NOFOLLOW: a link planted as the lock file would have this run truncate what it points to
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
            except OSError as exc:
                raise RunError(f"--save {save}: cannot open its lock file {lock} ("
                               + ("a symbolic link: remove it" if exc.errno == errno.ELOOP else
                                  f"{exc.strerror}; {cls.fix(exc)}") + ")") from None
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EACCES, errno.EAGAIN):
                    raise RunError(f"--save {save} is being written by another run: {cls.holder(lock)}; two runs "
                                   "saving to one file overwrite each other's checkpoints: let that one end (or "
                                   "scancel it), or give this one another --save") from None
                log(f"notice: cannot lock {lock} ({exc.strerror}: a file system mounted without locks, such as "
                    f"Lustre's -o noflock): a second run saving to {save} would not be detected")
                return None
            try:  # the holder removes the file when it ends: a lock on a removed file is no lock, take the new one
                if os.path.samestat(os.fstat(fd), os.stat(lock)):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        else:
            raise RunError(f"--save {save}: its lock file {lock} keeps being replaced; is another run starting?")
        me = {"job": os.environ.get("SLURM_JOB_ID"), "job_name": os.environ.get("SLURM_JOB_NAME"),
              "host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        held = cls(lock, fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        except OSError as exc:  # a full disk or quota: held, so no other run uses the file; nothing is left behind
            held.release()
            raise RunError(f"--save {save}: cannot write its lock file {lock} ({exc.strerror}); "
                           f"{cls.fix(exc)}") from None
        return held

    @staticmethod
    def fix(exc: OSError) -> str:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return "the disk or the quota is full: free space there, or choose another --save"
        return "if no run is writing this checkpoint, delete the lock file, or choose another --save"

    @staticmethod
    def holder(lock: Path) -> str:
        """Who holds `lock`, as it wrote itself there. Only for a process that does not hold it: closing any
        descriptor of the file releases the process's POSIX locks on it."""
        try:
            who = json.loads(lock.read_text())
            job = (f"job {who['job']}" + (f" ({who['job_name']})" if who.get("job_name") else "") + " on host "
                   if who.get("job") else "a process on host ")
            return f"{job}{who['host']}, PID {who['pid']}, since {who['since']}"
        except (OSError, ValueError, KeyError, TypeError):
            return f"a process that has not written its name in {lock} yet"

    def release(self) -> None:
        """Remove the file while still holding it, then let go: a run that opened it meanwhile finds it removed and
        takes a new one."""
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)


class StopRequest:
    """SIGUSR1 (Slurm's --signal=USR1@seconds before the time limit), SIGTERM (scancel, preemption) or SIGINT
    (Ctrl-C), held by hold_signal since start-up: finish the current step, checkpoint, exit 75. Every rank must stop
    at the same step, or DDP would wait for the missing ones forever: the flags are OR-ed across ranks after every
    step, on the CPU (gloo), so the GPU stream is never synchronised for it."""
    EXIT_CODE = 75  # EX_TEMPFAIL: "try again"; the templates requeue on it

    def __init__(self) -> None:
        self.flag = torch.zeros(1)
        if threading.current_thread() is threading.main_thread():  # the program holds them already; an importer not
            hold_stop_signals()

    @property
    def signal(self) -> str | None:
        """The first stop signal this task received (the reason), or None."""
        return PENDING_SIGNALS[0] if PENDING_SIGNALS else None

    def agreed(self, world: int) -> bool:
        interrupt_if_deferred()
        self.flag[0] = 1.0 if PENDING_SIGNALS else 0.0
        if world > 1:
            dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=HOST_GROUP[0])
        CTRL_C["ending"] = stop = bool(self.flag[0] > 0)  # the stop's checkpoint next: Ctrl-C again does not cut it
        return stop


def reduce_max(values: list[float], device: str, world: int) -> list[float]:
    """The largest of each value over the tasks. `device`: the stats device, the same part (the last, or the task's
    one GPU) on every task, so on nccl every task meets in the communicator of that part, on its own GPU."""
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
    """Largest difference of fingerprints between the replicas of `group`. `fp` is on the stats device (the same
    part on every task: one communicator, each task on its own GPU)."""
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
    first_bad: torch.Tensor | None = None  # the first step whose loss was not finite (0: none), on the device
    lr: float | None = None  # the schedule's rate at the last step trained


def train(cfg: argparse.Namespace, trainer: Trainer, launch: idr_torch.Launch, source: Path | None,
          cuda: bool) -> int:
    """Data, the resume point, DDP, then per epoch: train, stop if asked, evaluate, save; the record."""
    world, rank, dp = launch.size, launch.rank, trainer.dp_size
    log(f"torch {torch.__version__}, {trainer.name} layout, backend {dist.get_backend()}, world size {world} on "
        f"{launch.num_nodes} node(s), chunks {cfg.chunks}, batch {cfg.batch_size}/replica "
        f"({cfg.batch_size * dp} global)")
    log(f"  {trainer.describe()}")
    data = load_corpus(cfg, source, world)
    train_loader, test_loader = make_loaders(cfg, data, trainer, launch, cuda)
    chance = chance_accuracy(data["test_y"])
    start_epoch, skip, step, state = resume_point(cfg, trainer)  # loaded before DDP wraps the model
    end_epoch = cfg.epochs
    if start_epoch >= cfg.epochs:
        log(f"nothing to train: the checkpoint holds {start_epoch} epoch(s) and --epochs is {cfg.epochs}; raise "
            f"--epochs to go on, or delete {cfg.load or cfg.save} (and its .resume.pt) to start afresh")
    elif cfg.max_steps and step >= cfg.max_steps:  # --max-steps counts the loaded steps too
        end_epoch = start_epoch
        log(f"nothing to train: the checkpoint is at step {step} and --max-steps is {cfg.max_steps}; raise "
            f"--max-steps (or 0: no limit) to go on, or delete {cfg.load or cfg.save} (and its .resume.pt) to start "
            "afresh")
    trainer.start()
    torch.manual_seed(cfg.seed + 1 + rank)  # dropout masks differ between replicas
    if state is not None:
        restore_rng(state, rank)
    stop = StopRequest()
    log(f"  model: {trainer.total_params / 1e6:.2f} M parameters; {len(train_loader)} steps per epoch")
    log(f"  {trainer.memory}")
    history, startup_s = [], None
    for epoch in range(start_epoch, end_epoch):
        ep = train_epoch(cfg, trainer, train_loader, epoch, skip, step, stop, world,
                         run_steps(cfg, len(train_loader)))
        step = ep.step
        check_finite(cfg, ep, epoch, world)  # before anything is saved over the last good checkpoint
        if startup_s is None and ep.first_batch_at is not None:  # imports, data, model: before step 1
            startup_s = ep.first_batch_at - psutil.Process().create_time()
        if stop.flag[0] > 0:  # agreed by every rank at the same step (a signal of its own alone is not)
            return stop_and_checkpoint(cfg, trainer, ep, epoch, len(train_loader), stop, world)
        skip = 0
        history.append(end_of_epoch(cfg, trainer, test_loader, epoch, ep, world, cuda))
        # --max-steps can end the run inside an epoch: the checkpoint says which batch, so that --resume goes on
        # from there (saved as a whole epoch, the rest of that epoch would never be trained)
        if save_progress(cfg, trainer, epoch, ep.batches, len(train_loader), step, world):
            log(f"  checkpoint saved: {cfg.save} (epoch {epoch + 1}"
                + ("" if ep.batches == len(train_loader) else f" up to batch {ep.batches}/{len(train_loader)}")
                + f", step {step})")
        if cfg.max_steps and step >= cfg.max_steps:
            break
    finish(cfg, trainer, launch, history, startup_s, cuda, chance)
    return 0


def chance_accuracy(labels: torch.Tensor) -> tuple[float, float]:
    """What guessing earns on the test set (its majority class's share), and the margin above it that a run must
    clear to have learned: 3 standard errors of an accuracy measured on that many reviews, at least 0.02."""
    n = max(len(labels), 1)
    share = torch.bincount(labels.long()).max().item() / n if len(labels) else 0.5
    return share, max(0.02, 3 * math.sqrt(share * (1 - share) / n))


def throughput(cfg: argparse.Namespace, trainer: Trainer, samples_per_s: float | None,
               gpu_name: str | None) -> dict:
    """The distance to the physical limit: the model's FLOPs per sample (check_topology.flops_per_sample), the
    TFLOP/s the run reached (all its GPUs, and per GPU), and on a GPU the share of that GPU's dense peak for the
    precision its matmuls run in (check_topology.PEAK_TFLOPS)."""
    fps = check_topology.flops_per_sample({k: getattr(cfg, k) for k in ("d_model", "d_hid", "seq_len", "nlayers")})
    gpus = trainer.record().get("gpus") or 1
    tflops = fps * samples_per_s / 1e12 if samples_per_s else None
    peak = check_topology.peak_tflops(gpu_name, cfg.precision, cfg.tf32) if gpu_name else None
    per_gpu = tflops / gpus if tflops is not None and gpu_name else None
    return {"flops_per_sample": fps, "tflops": tflops, "tflops_per_gpu": per_gpu, "peak_tflops": peak,
            "peak_share": per_gpu / peak if per_gpu is not None and peak else None}


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
    return text


def check_finite(cfg: argparse.Namespace, ep: Epoch, epoch: int, world: int) -> None:
    """Stop on a non-finite loss (a learning rate that diverges, bad data): one line that names the first step it
    was seen at, every task at once, before anything is saved over the last good checkpoint. Checked after each
    epoch (or stop), not each step: reading the loss every step would make the GPU wait for the host."""
    never = torch.iinfo(torch.int64).max
    first = torch.where(ep.first_bad > 0, ep.first_bad, never)
    if world > 1:
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
    step = int(first.item())
    if step != never:
        raise RunError(f"the loss is not finite (nan or inf) from step {step} (epoch {epoch + 1}) on: training "
                       f"diverged; lower --lr (now {cfg.lr:g}), or check the data and the --load file"
                       + (f"; {cfg.save} keeps its last save" if cfg.save else ""))


def make_loaders(cfg: argparse.Namespace, data: dict, trainer: Trainer, launch: idr_torch.Launch,
                 cuda: bool) -> tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader]:
    dp = trainer.dp_size  # replicas that each see their own share of the data
    # workers from the cores the task really has (cpu_threads), not from what SLURM_CPUS_PER_TASK asked
    workers = cfg.workers if cfg.workers >= 0 else (min(4, max(0, cpu_threads(launch) - 1)) if cuda else 0)
    train_loader = make_loader(data["train_x"], data["train_y"], cfg.batch_size, dp, trainer.dp_rank, True,
                               cfg.seed, workers, cuda)
    # the stage layout's schedules want every batch the same size: a short last test batch is dropped there
    test_loader = make_loader(data["test_x"], data["test_y"], cfg.batch_size, dp, trainer.dp_rank,
                              trainer.equal_batches, cfg.seed, workers, cuda, shuffle=False)
    if len(train_loader) == 0:
        raise RunError(f"{len(data['train_y'])} training reviews give no full batch of {cfg.batch_size} per "
                       f"replica x {dp} replicas; lower --batch-size or add data")
    return train_loader, test_loader


def run_steps(cfg: argparse.Namespace, steps_per_epoch: int) -> int:
    """The steps the lr's schedule spans: --epochs of them. --max-steps is a stop, not the run's length: a run cut
    by it and resumed follows the uninterrupted run's schedule, step for step (tests/test_faults.py)."""
    return cfg.epochs * steps_per_epoch


LR_FLOOR = 0.1  # where --lr-decay ends, a fraction of --lr: nanoGPT's min_lr = lr / 10 (after Chinchilla's cosine)


def lr_at(cfg: argparse.Namespace, step: int, total: int) -> float:
    """--lr's schedule at `step` (0-based, over the whole run: a resumed run goes on where it was) of `total`:
    a linear warmup from 0 over --lr-warmup of the steps, then --lr-decay (cosine or linear) down to LR_FLOOR x --lr
    at the last step, or constant. Computed from the step, not kept in a scheduler's state: a resume with another
    --lr, --lr-warmup or --epochs follows the new schedule from its step on (the record has each epoch's rate)."""
    warm = round(cfg.lr_warmup * total)
    if step < warm:
        return cfg.lr * (step + 1) / (warm + 1)
    if cfg.lr_decay == "none":
        return cfg.lr
    done = min((step - warm) / max(total - warm - 1, 1), 1.0)
    factor = 1.0 - done if cfg.lr_decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
    return cfg.lr * (LR_FLOOR + (1.0 - LR_FLOOR) * factor)


# benchmarks/gpu_check.py sets KIT_SYNC_DEBUG=error for the script's tasks: a host sync in a timed step (a blocking
# copy between host and GPU, a stream synchronize, .item()) then raises where it happens, instead of costing the
# host-bound bf16 step its time unseen (torch.cuda.set_sync_debug_mode; c10/cuda/CUDAFunctions.h says what counts).
SYNC_DEBUG = os.environ.get("KIT_SYNC_DEBUG", "").strip()


@contextlib.contextmanager
def sync_debug(timed: bool) -> Iterator[None]:
    """torch's sync debug mode around one timed step, where KIT_SYNC_DEBUG asks for it on a GPU; else nothing."""
    if not (timed and SYNC_DEBUG and torch.cuda.is_available()):
        yield
        return
    torch.cuda.set_sync_debug_mode(SYNC_DEBUG)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def train_epoch(cfg: argparse.Namespace, trainer: Trainer, loader: torch.utils.data.DataLoader, epoch: int,
                skip: int, step: int, stop: StopRequest, world: int, total: int) -> Epoch:
    """One epoch from batch `skip` on (resumed inside this epoch: same sampler order, those are done); `total`:
    the run's steps, for the lr's schedule."""
    loader.sampler.sampler.set_epoch(epoch)
    ep = Epoch(step=step, stats=torch.zeros(3, dtype=torch.float64, device=trainer.stats_device),
               first_bad=torch.zeros((), dtype=torch.int64, device=trainer.stats_device))
    t_last_log = time.time()
    for i, (x, y) in enumerate(loader):
        ep.batches = i + 1
        if i < skip:
            continue
        ep.first_batch_at = ep.first_batch_at or time.time()
        if i == skip + cfg.untimed_steps:  # counted from the first batch this run trains on
            trainer.synchronize()
            ep.t_timed = time.time()
        ep.lr = lr_at(cfg, ep.step, total)
        with sync_debug(ep.t_timed is not None):
            trainer.set_lr(ep.lr)
            stats = trainer.train_step(x, y)
            ep.stats += stats  # stays on the device: no .item() (a host sync) in the loop
            ep.step += 1
            ep.first_bad = torch.where(ep.first_bad.eq(0) & ~torch.isfinite(stats[0]), ep.step, ep.first_bad)
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


def evaluate(trainer: Trainer, loader: torch.utils.data.DataLoader, world: int) -> float:
    acc = torch.zeros(2, dtype=torch.float64, device=trainer.stats_device)
    for x, y in loader:
        acc += trainer.eval_step(x, y)
    if world > 1:
        dist.all_reduce(acc)  # on the stats device, as reduce_max: one communicator, each task on its own GPU
    return (acc[0] / acc[1].clamp(min=1)).item()


def end_of_epoch(cfg: argparse.Namespace, trainer: Trainer, test_loader: torch.utils.data.DataLoader, epoch: int,
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
           "samples_per_s": samples_per_s, "timed_steps": ep.timed_steps, "lr": ep.lr,
           "peak_gpu_mem_gb": peak_gb if cuda else None, "host_rss_gb": rss_gb}
    log(f"epoch {row['epoch']:3d} | steps {row['steps']:5d} | loss {row['loss']:.4f} | train acc "
        f"{row['train_acc']:.3f} | test acc {test_acc:.3f} | {row['epoch_time_s']:7.1f}s | "
        + (f"{samples_per_s:9.1f} samples/s" if samples_per_s else "   (too few steps to time)")
        + (f" | peak GPU mem {peak_gb:.2f} GiB" if cuda else "")
        + (f" (estimate {trainer.estimate_gib:.2f})" if cuda and trainer.estimate_gib else "")
        + f" | host RSS {rss_gb:.2f} GiB")
    return row


def stop_and_checkpoint(cfg: argparse.Namespace, trainer: Trainer, ep: Epoch, epoch: int, n_batches: int,
                        stop: StopRequest, world: int) -> int:
    """Every rank stopped at the same step: checkpoint where we are (mid-epoch too), exit 75 (requeue)."""
    saved = save_progress(cfg, trainer, epoch, ep.batches, n_batches, ep.step, world)
    log(f"stopping on {stop.signal or 'a signal to another task'} at epoch {epoch + 1}, "
        f"batch {ep.batches}/{n_batches}, step {ep.step}: "
        + (f"checkpoint saved to {cfg.save}; run again with --resume (the templates requeue) to go on" if saved
           else f"the checkpoint could not be saved: --resume goes on from the previous one in {cfg.save}"
           if cfg.save else "no --save given, so this progress is lost"))
    return StopRequest.EXIT_CODE


def finish(cfg: argparse.Namespace, trainer: Trainer, launch: idr_torch.Launch, history: list[dict],
           startup_s: float | None, cuda: bool, chance: tuple[float, float] = (0.5, 0.02)) -> None:
    """The replica check, the summary line and the JSON record; a run that ends at chance says so in both."""
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
    gpu_name = torch.cuda.get_device_name(trainer.stats_device) if cuda else None
    speed = throughput(cfg, trainer, best, gpu_name)
    acc, (chance_acc, margin) = history[-1]["test_acc"], chance
    learned = acc > chance_acc + margin
    log(f"summary: {trainer.name} layout, {trainer.dp_size} replica(s) x {trainer.nb_part} part(s), chunks "
        f"{cfg.chunks}, batch {cfg.batch_size}/replica: "
        + (f"{best:.1f} samples/s (best epoch){speed_text(speed, gpu_name, cfg)}, " if best else "")
        + f"final test acc {acc:.3f}, total {total_s:.1f}s")
    if not learned:
        log(f"warning: the model did not learn: final test acc {acc:.3f} is not clearly above chance (the test "
            f"set's majority class is {chance_acc:.3f}; above {chance_acc + margin:.3f} is 3 standard errors clear of "
            f"it). Its speed is real, its result is not: if the loss rose, lower --lr (now {cfg.lr:g}) or raise "
            f"--lr-warmup (now {cfg.lr_warmup:g}); if it fell, train longer")
    if cfg.json_out and launch.rank == 0:
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__, **trainer.record(),
                  "backend": dist.get_backend(), "device": "cuda" if cuda else "cpu",
                  "gpu_name": gpu_name, **speed, "learned": learned, "chance_acc": chance_acc,
                  "nodes": launch.num_nodes, "tasks": launch.size, "tasks_per_node": launch.local_world_size,
                  "world_size": launch.size, "replicas": trainer.dp_size, "chunks": cfg.chunks,
                  "batch_size": cfg.batch_size, "global_batch": cfg.batch_size * trainer.dp_size,
                  **{a.dest: getattr(cfg, a.dest) for a in check_topology.ARGS if a.group in ("model", "memory")},
                  "architecture": ARCHITECTURE, "lr": cfg.lr, "lr_warmup": cfg.lr_warmup, "lr_decay": cfg.lr_decay,
                  "untimed_steps": cfg.untimed_steps,
                  "data": "synthetic" if cfg.synthetic else "imdb", "job_id": launch.job_id,
                  "samples_per_s": best, "epoch_time_s": history[-1]["epoch_time_s"],
                  "peak_gpu_mem_gb": history[-1]["peak_gpu_mem_gb"], "host_rss_gb": history[-1]["host_rss_gb"],
                  "test_acc": history[-1]["test_acc"], "replica_divergence": gap, "plans": plans,
                  "startup_s": startup_s, "total_s": total_s, "epochs": history}
        write_record(cfg, record)


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


# ----------------------------------------------------------------------------------------------------------------
# errors every task sees: the start-up network, each task's own verdict, lost contact
def this_task(launch: idr_torch.Launch) -> str:
    """'task 3 on r7i1n2: ' where several tasks run (the prefix of a task's own error line), else ''."""
    return f"task {launch.rank} on {socket.gethostname()}: " if launch.size > 1 else ""


def agree(problem: str | None, launch: idr_torch.Launch, value: object = None) -> list:
    """Every task's verdict on what it read or wrote alone (the folders of its node, files truncated on one node,
    the --load file on node-local storage), gathered on the CPU group: a task that failed says its own error
    (prefixed with its rank and host), the first task that did not says which failed, the others stop quietly;
    the same error on every task is said once. Returns every task's `value` when no task failed."""
    if launch.size == 1:
        if problem:
            raise RunError(problem)
        return [value]
    verdicts: list = [None] * launch.size
    dist.all_gather_object(verdicts, (problem, socket.gethostname(), value), group=HOST_GROUP[0])
    failed = [(rank, host, p) for rank, (p, host, _) in enumerate(verdicts) if p]
    if not failed:
        return [v for _, _, v in verdicts]
    if len(failed) == launch.size and len({p for _, _, p in failed}) == 1:
        raise RunError(problem)  # said once, by task 0
    if problem:
        raise TaskError(f"{this_task(launch)}{problem}")
    if launch.rank == min(rank for rank, (p, _, _) in enumerate(verdicts) if not p):
        rank, host, p = failed[0]
        more = f" (and {len(failed) - 1} other task(s))" if len(failed) > 1 else ""
        raise TaskError(f"{this_task(launch)}stopping: task {rank} on {host} failed{more}: {p[:300]}")
    raise Quiet()


def check_rendezvous(launch: idr_torch.Launch, timeout: float) -> None:
    """Before init_process_group: the master's address resolves (every task, within seconds); on task 0, which
    serves the rendezvous, it is an address of this host and the port is free. One line per task, instead of
    160 lines of C++ frames after 2.6 x --timeout (an unresolvable name) or a task that waits for minutes on a
    port another program holds."""
    addr, port = launch.master_addr, launch.master_port
    given = "MASTER_ADDR" in os.environ
    where = f"node {addr} ({'MASTER_ADDR' if given else 'the first node of the step, where task 0 runs'})"
    fix = ("export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1), or unset it: the kit "
           "then uses the step's first node" if given else "check the node names Slurm gives (SLURM_STEP_NODELIST)")
    limit = max(1.0, min(timeout, 20.0))
    found: dict = {}

    def lookup() -> None:
        try:
            found["ips"] = sorted({info[4][0] for info in socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)})
        except (OSError, UnicodeError) as exc:
            found["error"] = getattr(exc, "strerror", None) or str(exc)

    resolver = threading.Thread(target=lookup, daemon=True)  # a resolver that never answers must not hang us
    resolver.start()
    resolver.join(limit)
    if "ips" not in found:
        why = found.get("error") or f"no answer within {limit:g}s"
        raise TaskError(f"{this_task(launch)}{where} does not resolve ({why}): the tasks cannot meet; {fix}")
    if launch.rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return  # torchrun's agent serves the rendezvous itself, on this port: nothing for task 0 to check
    if not any(local_address(ip) for ip in found["ips"]):
        raise TaskError(f"{this_task(launch)}{where} is {', '.join(found['ips'])}, not an address of this host "
                        f"({socket.gethostname()}), where task 0 serves the rendezvous: the other tasks would wait "
                        f"for nobody; {fix}")
    for family, wildcard in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):  # as torch's TCPStore binds
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((wildcard, port))
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:
                    continue
                held = exc.errno == errno.EADDRINUSE
                raise TaskError(f"{this_task(launch)}port {port} (MASTER_PORT) on {socket.gethostname()} "
                                + ("is in use by another program" if held else f"cannot be used ({exc.strerror})")
                                + ": task 0 serves the rendezvous there; export MASTER_PORT=<a free port in "
                                "10000-29999> (the same for every task), or unset it: the kit derives one from the "
                                "job id") from None


def local_address(ip: str) -> bool:
    """Whether `ip` is one of this host's addresses (only those can be bound)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


@contextlib.contextmanager
def rendezvous_deadline(launch: idr_torch.Launch, timeout: float):
    """init_process_group within --timeout, said in one line. A task whose peer on MASTER_PORT is another program
    (it accepts the connection and never answers) waited 200 s at --timeout 30, in C++, where no Python exception
    reaches it: a timer ends it at --timeout + 15 s."""
    where = f"{launch.master_addr}:{launch.master_port}"
    what = (f"{this_task(launch)}the {launch.size} tasks did not all meet at {where} within --timeout {timeout:g}s"
            if launch.size > 1 else f"the process group did not start at {where} within --timeout {timeout:g}s")

    def give_up() -> None:
        print(f"{PROG[0]}: error: {what}: task 0 is not serving the rendezvous there (it failed to start: see its "
              "error; or the port is another program's); every task stops", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(timeout + 15, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    except (RuntimeError, ValueError) as exc:  # DistNetworkError, DistStoreError (a timeout) and their kin
        raise TaskError(f"{what} ({first_line(exc)[:200]}): a task did not start, or cannot reach task 0's node; "
                        "every task stops") from None
    finally:
        timer.cancel()


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
    """Run a trainer's main(). A user error is one line: a verdict every task reaches is said by task 0, a task's
    own error (TaskError, LaunchError) by that task; Quiet ones exit 1 without a line."""
    PROG[0] = prog
    try:
        code = main()
        CTRL_C["ending"] = True  # what is left is the interpreter's exit: a Ctrl-C there would only add a traceback
        sys.exit(code)
    except check_topology.ArgumentError as exc:  # the line itself: argparse's usage-error status
        if (os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0").strip() in ("0", ""):
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Quiet:
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C twice (hold_signal): at once, one line, the shell's status for SIGINT
        if is_rank0():
            print(f"{prog}: interrupted (Ctrl-C twice): stopped at once, without a checkpoint of this point; "
                  "--resume goes on from the last one --save wrote", file=sys.stderr, flush=True)
        sys.exit(130)
    except (RunError, idr_torch.LaunchError) as exc:
        value = (os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0").strip()
        rank = int(value) if value.isdigit() else 0  # a malformed one is the LaunchError being reported
        if rank == 0 or isinstance(exc, (idr_torch.LaunchError, TaskError)):
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    cli(main, "bench_ddp_transformer")

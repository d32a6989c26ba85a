#!/usr/bin/env python
"""Pre-flight check of a hybrid pipeline + data parallel job, and the plan the trainer runs.

    python check_topology.py slurm/page_3nodes_4gpus.slurm        # before sbatch: #SBATCH header + srun line
    python check_topology.py --nodes 3 --gpus-per-node 4 --ntasks-per-node 2 --nlayers 8    # planning
    python check_topology.py --nlayers 8 --chunks 4                # in a batch script: the allocation itself
    srun python check_topology.py --nlayers 8 --chunks 4           # every task checks what it really sees

Layout of the page: one task per model replica; nb_part = GPUs per node // tasks per node; task `local_rank`
owns GPUs first_part = local_rank * nb_part ... last_part = first_part + nb_part - 1. When Slurm binds GPUs per
task (--gpus-per-task, --gpu-bind) a task sees only its own GPUs, so its plan starts at visible GPU 0.
Layers: a balanced contiguous split, the page's own split whenever nlayers % nb_part == 0; Encoder on the first
part, Decoder on the last.

Exit status: 0 clean (warnings allowed), 1 errors found, 2 usage error or unreadable file.
bench_ddp_transformer.py builds its model from plan_task() below, so what this approves is what runs.
No torch import here: checking a file must stay well under a second on a login node.

One file, in two parts, because users copy it next to the trainers and both trainers import it:
  Part I   the plan the trainers import (their `__all__`): I.1 arguments and defaults, I.2 the layer split,
           I.3 this task's GPUs, I.4 memory, I.5 what each torch release can run, I.6 the trainers' checks of
           their arguments. The trainers call these very functions, so their refusals are the checker's findings.
  Part II  the pre-flight checker: II.1 what it catches, II.2 Slurm 22.05 (option tables and placement: a port
           to a newer Slurm touches this block), II.3 Jean Zay, II.4 reading a job script, II.5 checking a job,
           II.6 the report, II.7 inside an allocation, II.8 the command line.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shlex
import socket
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

import idr_torch

# What the trainers (bench_ddp_transformer.py, bench_stage.py) and the benchmarks take from here: Part I.
__all__ = ["GPU_DEFAULTS", "CPU_DEFAULTS", "CPU_NB_PART", "ENGINES", "PRECISIONS", "SCHEDULES", "MULTI_STAGE",
           "TRAINERS", "Training", "model_args", "below_one", "Finding", "Findings", "part_sizes", "split_layers",
           "part_contents", "TaskPlan", "plan_task", "parse_devices", "GIB", "ARCHS", "PartMemory",
           "attention_kernel", "estimate_memory", "estimate_stage_memory", "stage_actions", "worst_part",
           "memory_line", "TORCH_FEATURES", "torch_refusals", "divisors", "check_training", "stages_per_rank",
           "check_stage", "bubble"]


# ======================================================================================================================
# Part I. The plan the trainers import: arguments, layer split, task plan, memory, torch releases, checks
# ======================================================================================================================


# ---- I.1 Arguments and defaults --------------------------------------------------------------------------------------

# The trainer's defaults live here so the checker (which must not import torch) judges exactly what runs.
# GPU: big enough that the page's reason for model parallelism (activations of a deep model) holds.
GPU_DEFAULTS = dict(nlayers=16, d_model=1024, n_head=16, d_hid=4096, seq_len=256, vocab_size=30000,
                    chunks=4, batch_size=64, dropout=0.1)

# CPU (CI, laptops): small enough for a 2-core machine to learn the synthetic task in well under a minute.
# No dropout there: on the CPU its random masks cost as much as the matmuls of so small a model.
CPU_DEFAULTS = dict(nlayers=4, d_model=64, n_head=4, d_hid=128, seq_len=64, vocab_size=2000,
                    chunks=2, batch_size=32, dropout=0.0)

CPU_NB_PART = 2  # no GPU: still split in two so the pipeline is exercised
ENGINES = ("auto", "torch-pipe", "fairscale")
PRECISIONS = ("fp32", "bf16", "fp16")

# The stage layout (bench_stage.py): torch.distributed.pipelining's schedules, by --schedule name (the one list of
# them: bench_stage.py's choices, and the class it builds); the multi-stage ones hold several stages per task.
# Not offered: the zero-bubble schedules (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble) split the
# weight gradients out of the backward, which DDP's gradient hooks don't follow (ZB-V crashed with DDP here).
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved1f1b": "ScheduleInterleaved1F1B",
             "loopedbfs": "ScheduleLoopedBFS"}

MULTI_STAGE = ("interleaved1f1b", "loopedbfs")
TRAINERS = {"bench_ddp_transformer.py": "replica", "bench_stage.py": "stage"}  # the script sets the layout

# arguments each trainer's argparse refuses (the other layout's): the checker must not approve a line that can't start
NOT_ARGS = {"replica": ("--layout", "--pp", "--schedule", "--virtual-stages"),
            "stage": ("--layout", "--nb-part", "--engine", "--devices")}


@dataclass
class Training:
    nlayers: int | None = None
    chunks: int | None = None
    batch_size: int | None = None
    engine: str = "auto"
    nb_part: int | None = None
    layout: str = "replica"
    pp: int = 2
    schedule: str = "1f1b"
    virtual_stages: int = 2
    precision: str = "fp32"  # fp32, bf16 or fp16 (autocast)
    activation_checkpointing: bool = False  # per Layer, non-reentrant torch.utils.checkpoint
    zero: bool = False  # ZeroRedundancyOptimizer over the data-parallel group
    model: dict = field(default_factory=dict)  # d_model, n_head, d_hid, seq_len, vocab_size, dropout on the line
    devices: list[int] | None = None  # --devices: a visible GPU index per part, else the page's indexing
    unchecked: list[str] = field(default_factory=list)  # arguments given as shell variables


def model_args(t: "Training", cpu: bool = False, **given: int | float | None) -> dict:
    """The model arguments the trainer would use: the line's values, else GPU_DEFAULTS (or CPU_DEFAULTS)."""
    defaults = CPU_DEFAULTS if cpu else GPU_DEFAULTS
    model = {k: v for k, v in defaults.items()}
    model.update({k: v for k, v in dict(nlayers=t.nlayers, chunks=t.chunks, batch_size=t.batch_size).items()
                  if v is not None})
    model.update({k: v for k, v in {**t.model, **given}.items() if v is not None})
    return model


def below_one(values: dict) -> str | None:
    """The one rule for counts, in the trainers and the checker: '--name N must be at least 1' for the first
    count below 1 (None and non-numbers are someone else's business)."""
    for name, v in values.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 1:
            return f"--{name.lstrip('-').replace('_', '-')} {v} must be at least 1"
    return None


@dataclass
class Finding:
    level: str  # "error" or "warning"
    code: str
    message: str

    def __str__(self) -> str:
        return f"{self.level.upper():7s} {self.code}: {self.message}"


class Findings(list):
    def error(self, code: str, message: str) -> None:
        self.append(Finding("error", code, message))

    def warn(self, code: str, message: str) -> None:
        self.append(Finding("warning", code, message))

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self if f.level == "error"]


# ---- I.2 The layer split ---------------------------------------------------------------------------------------------

def part_sizes(nlayers: int, nb_part: int) -> list[int]:
    """Layers per part: balanced, the extra ones on the *last* parts (part 0 already holds the Encoder's
    embedding table, the largest single tensor of the model)."""
    if nb_part < 1 or nlayers < 0:
        raise ValueError(f"need nb_part >= 1 and nlayers >= 0, got nb_part={nb_part}, nlayers={nlayers}")
    base, extra = divmod(nlayers, nb_part)
    return [base + (1 if p >= nb_part - extra else 0) for p in range(nb_part)]


def split_layers(nlayers: int, nb_part: int) -> list[int]:
    """The part (0 .. nb_part-1) of each of the `nlayers` Layer blocks: contiguous, every layer once.

    Identical to the page's loop whenever nlayers % nb_part == 0. With nlayers < nb_part some parts get no
    Layer (only the Encoder or Decoder, or nothing): defined, but warned about, and the checker makes it an error.
    """
    sizes = part_sizes(nlayers, nb_part)
    if nlayers < nb_part:
        warnings.warn(f"nlayers ({nlayers}) < nb_part ({nb_part}): {nb_part - nlayers} part(s) get no Layer block",
                      stacklevel=2)
    return [p for p, n in enumerate(sizes) for _ in range(n)]


def part_contents(nlayers: int, nb_part: int) -> list[str]:
    """What each part holds, for tables: 'Encoder + Layer 0-3', 'Layer 4-7 + Decoder'."""
    sizes, start, out = part_sizes(nlayers, nb_part), 0, []
    for p, n in enumerate(sizes):
        items = ["Encoder"] if p == 0 else []
        if n:
            items.append(f"Layer {start}" if n == 1 else f"Layer {start}-{start + n - 1}")
        if p == nb_part - 1:
            items.append("Decoder")
        out.append(" + ".join(items) or "(nothing)")
        start += n
    return out


# ---- I.3 This task's GPUs: the plan ----------------------------------------------------------------------------------

@dataclass
class TaskPlan:
    """Where one task (one model replica) puts its parts."""
    rank: int
    node: int
    local_rank: int
    tasks_on_node: int
    nb_part: int
    devices: list[int]  # index passed to .to(cuda:i) for each part: first_part .. last_part (empty on CPU)
    gpu_ids: list[str]  # the node's GPU ids behind those indices (what nvidia-smi calls them)
    bound: bool  # Slurm showed this task only its own GPUs
    nlayers: int
    cpu: bool = False
    visible: int = 0  # GPUs this task sees (CUDA_VISIBLE_DEVICES)

    @property
    def first_part(self) -> int:
        return self.devices[0] if self.devices else 0

    @property
    def last_part(self) -> int:
        return self.devices[-1] if self.devices else 0

    def device(self, part: int) -> str:
        return "cpu" if self.cpu else f"cuda:{self.devices[part]}"

    @property
    def contents(self) -> list[str]:
        return part_contents(self.nlayers, self.nb_part) if self.nb_part else []


def page_indexing(local_rank: int, tasks_on_node: int, visible: int) -> tuple[int, int, int]:
    """What the page's own code computes: (nb_part, first_part, last_part) from device_count() // tasks."""
    nb_part = visible // tasks_on_node
    first = local_rank * nb_part
    return nb_part, first, first + nb_part - 1


def plan_task(rank: int, node: int, local_rank: int, tasks_on_node: int, visible: Sequence[str],
              gpus_on_node: int | None, nlayers: int, nb_part: int | None = None,
              findings: Findings | None = None, devices: Sequence[int] | None = None) -> TaskPlan:
    """Plan one task from what it sees.

    visible      the GPU ids this process can use, in CUDA order (CUDA_VISIBLE_DEVICES); [] means CPU only
    gpus_on_node GPUs Slurm gave the step on this node (SLURM_GPUS_ON_NODE); None when unknown (torchrun):
                 when it exceeds what the task sees, Slurm bound GPUs per task and the plan starts at index 0.
    nb_part      an explicit --nb-part, else derived as on the page.
    devices      an explicit --devices: the visible GPU index of each part (0,0 puts two parts on one GPU, for a
                 one-GPU check of nb_part 2); None: the page's indexing.
    """
    findings = Findings() if findings is None else findings
    where = f"task {rank} (node {node}, local rank {local_rank})"
    if not visible:
        n = nb_part or CPU_NB_PART
        return TaskPlan(rank, node, local_rank, tasks_on_node, n, [], [], False, nlayers, cpu=True)
    bound = gpus_on_node is not None and len(visible) < gpus_on_node
    if bound:
        n = nb_part or len(visible)
        first = 0
    else:
        n = nb_part or len(visible) // tasks_on_node
        first = local_rank * n
    if n < 1:
        findings.error("more-tasks-than-gpus",
                       f"{where}: {tasks_on_node} tasks share {len(visible)} visible GPU(s): nb_part = "
                       f"{len(visible)} // {tasks_on_node} = 0; use --ntasks-per-node <= {len(visible)}")
        return TaskPlan(rank, node, local_rank, tasks_on_node, 0, [], [], bound, nlayers, visible=len(visible))
    if devices:
        devices, n = explicit_devices(where, devices, nb_part, findings)
    else:
        devices = list(range(first, first + n))
    past = [d for d in devices if d >= len(visible)]
    if past:
        findings.error("gpu-index-past-visible",
                       f"{where} would use GPU index {past[0]}"
                       + (f" (and {len(past) - 1} more)" if len(past) > 1 else "")
                       + f" but sees only {len(visible)} GPU(s), indices 0-{len(visible) - 1} "
                       f"(CUDA_VISIBLE_DEVICES={','.join(visible)}); "
                       + (f"with per-task binding use --nb-part <= {len(visible)}" if bound
                          else f"use --nb-part <= {len(visible) // tasks_on_node}"))
        devices = [d for d in devices if d < len(visible)]
    return TaskPlan(rank, node, local_rank, tasks_on_node, n, devices, [visible[d] for d in devices], bound,
                    nlayers, visible=len(visible))


def explicit_devices(where: str, devices: Sequence[int], nb_part: int | None,
                     findings: Findings) -> tuple[list[int], int]:
    """--devices: one visible GPU index per part. Parts may share a GPU (then they run one after the other and
    their memory adds up): that is for checking nb_part > 1 on a one-GPU node, not for speed."""
    devices = list(devices)
    n = nb_part or len(devices)
    if len(devices) != n:
        findings.error("devices-count", f"{where}: --devices {','.join(map(str, devices))} lists {len(devices)} "
                       f"GPU(s) for nb_part {n}: give one index per part, e.g. --devices "
                       f"{','.join(str(i % max(len(devices), 1)) for i in range(n))}")
        devices = (devices * n)[:n]
    shared = sorted({d for d in devices if devices.count(d) > 1})
    if shared:
        findings.warn("parts-share-gpu", f"{where}: --devices {','.join(map(str, devices))} puts several parts on "
                      f"GPU {','.join(map(str, shared))}: they run one after the other and their memory adds up "
                      f"(a one-GPU check of the pipeline, not a speed figure)")
    return devices, n


def parse_devices(value: str, where: str, findings: Findings) -> list[int] | None:
    """--devices 0,0: visible GPU indices, one per part."""
    try:
        devices = [int(x) for x in value.split(",")]
        if min(devices) < 0:
            raise ValueError
        return devices
    except ValueError:
        findings.error("bad-value", f"{where}: --devices {value!r} must be GPU indices separated by commas, "
                       "one per part, e.g. --devices 0,0")
        return None


# ---- I.4 Memory: will it fit? ----------------------------------------------------------------------------------------

# What one GPU holds at the worst moment of a training step (the peak), in bytes, from the model arguments alone,
# for the model of bench_ddp_transformer.py: each part of a replica (the page's layout: a GPipe Pipe, then DDP) and
# each task of the stage layout (bench_stage.py: torch.distributed.pipelining). docs/memory.md has the model, its
# sources and its validation: benchmarks/memory_grid.py against torch's MemTracker on the CPU,
# benchmarks/memory_gpu.py against torch.cuda.max_memory_allocated on a GPU.
#
# The step is replayed op by op on a tape (_Tape): every op's outputs are allocated while its inputs are alive, then
# what it consumed is freed, as autograd releases it. One Layer's forward and backward, the Encoder's and the
# Decoder's are written out from torch's sources (nn.TransformerEncoderLayer, F.multi_head_attention_forward,
# tools/autograd/derivatives.yaml) and measured op by op on torch 2.13; a part's step is then composed from them:
#   forward   every micro-batch's forward (GPipe, checkpoint="never": all `chunks` stay alive until their backward);
#             the peak is in the last micro-batch's last block;
#   backward  micro-batches in reverse, each through the part's blocks from the last: the first one back fills the
#             weight gradients as it goes, while the other micro-batches' saved tensors are still alive; the second
#             one finds every gradient there and adds to it;
#   step      AdamW after backward: gradients, states, and its own temporary (CUDA's foreach path: sqrt of every
#             exp_avg_sq of the device at once, torch/optim/adam.py _multi_tensor_adam; the CPU's per tensor path:
#             two tensors of the largest parameter).
# The peak is the largest of these moments. The terms at that moment:
#   params, optimizer   fp32 weights (autocast keeps them: they are the master copy) and AdamW's exp_avg, exp_avg_sq;
#             under --zero the worst rank's share, partitioned as ZeroRedundancyOptimizer does (_partition_parameters)
#   buckets   DDP's gradient buckets, a copy of the gradients (gradient_as_bucket_view=False, reducer.cpp)
#   buffers, inputs   the positional table (and the stage layout's receive buffers); the batch's token ids (first
#             part) and labels (last part)
#   grads     the weight gradients filled so far (fp32)
#   activations   what autograd saved for the backward, of every micro-batch alive
#   weight_copies   under bf16/fp16 autocast, the low-precision copy of each matmul weight saved, per micro-batch
#   recompute     under --activation-checkpointing, the recomputed Layer's saved tensors
#   transient     what the running op holds besides (gradients in flight, temporaries), and what is kept past its
#                 use (fairscale's last task, the stage layout's input gradients and sends not yet waited for)
#   allowance     CUDA context, cuBLAS/NCCL workspaces, the caching allocator's slack: stated, not measured
#                 (ALLOWANCE_GIB plus ALLOWANCE_FRACTION of the rest); a tracker measures everything else
# Kernels, by `arch` (assumptions read in torch's sources, checked on a GPU only by benchmarks/memory_gpu.py):
#   - attention (attention_kernel): "sm80" (A100, H100) runs FlashAttention-2 for bf16/fp16 and the
#     memory-efficient kernel for fp32; "sm70" (V100: no flash, sdp_utils.cpp check_flash_attention_hardware_support
#     wants sm80) the memory-efficient kernel for all; a head_dim it can't take (not a multiple of 8, or above 256)
#     falls to the math path. cuDNN attention, first in some releases on sm90, refuses the layout
#     F.multi_head_attention_forward gives q, k, v (views of the packed projection: check_cudnn_layout), so MHA
#     never takes it. Flash lays its output out like q, so MHA's reshape of it is a view; the memory-efficient kernel
#     writes (B, S, H, D), so the reshape copies it and both copies are kept (the kernel's for its backward,
#     out_proj's input for its own). Neither keeps a dropout mask (the kernels regenerate it from a seed).
#     "cpu": the CPU flash kernel without dropout; with dropout the math path (q, k scaled copies, the full softmax,
#     the mask and the dropped weights, in fp32 under autocast too: attention.cpp upcasts half inputs on the CPU).
#   - dropout: CUDA's fused native_dropout keeps a bool mask; the CPU keeps a mask in the input's dtype
#     (aten/src/ATen/native/Dropout.cpp, is_fused_kernel_acceptable).
#   - fairscale's Pipe (measured on the CPU, read in fairscale 0.4.13): a worker thread keeps the task it ran last,
#     with its input and output, until the next one comes (_worker_holds); fairscale's Copy of a gradient back to the
#     part before runs after everything else that is ready (its node is built in the main thread, whose autograd
#     sequence numbers are the lowest), so a later micro-batch's backward finds the first one's input gradient still
#     there.
#   - gradient accumulation (traced): autograd adds a gradient into one already waiting in place when it holds the
#     only reference (torch/csrc/autograd/input_buffer.cpp), and at::linear adds the bias in place; under any
#     TorchDispatchMode (MemTracker is one) both go out of place (isTensorSubclassLike is true when a dispatch mode
#     is on: measured on torch 2.3.1 to 2.14.1). traced=True models the step as such a tracker sees it.

ALLOWANCE_GIB = 1.0
ALLOWANCE_FRACTION = 0.10
GIB = 2 ** 30
ARCHS = ("sm80", "sm70", "cpu")  # A100/H100 class, V100 class, the CPU


@dataclass
class PartMemory:
    """Bytes one GPU (a part of a replica, or a task of the stage layout) holds at the peak of a training step."""
    part: int
    contents: str
    params: int = 0
    optimizer: int = 0
    buckets: int = 0
    buffers: int = 0
    inputs: int = 0
    grads: int = 0
    activations: int = 0
    weight_copies: int = 0
    recompute: int = 0
    transient: int = 0
    allowance: int = 0
    per_micro_batch: int = 0  # what one micro-batch leaves saved (activations and weight copies)
    alive: int = 0  # micro-batches alive at once at most
    peak_at: str = ""  # where in the step the peak falls
    unit: str = "part"  # "part" of a replica, or "task" of the stage layout

    TERMS = ("params", "optimizer", "buckets", "buffers", "inputs", "grads", "activations", "weight_copies",
             "recompute", "transient", "allowance")

    @property
    def peak(self) -> int:
        """The peak without the allowance: what a memory tracker of the step measures."""
        return self.total - self.allowance

    @property
    def total(self) -> int:
        return sum(getattr(self, n) for n in self.TERMS)

    def breakdown(self) -> dict[str, float]:
        """GiB per term, the non-zero ones, for messages and --json."""
        return {n: round(getattr(self, n) / GIB, 3) for n in self.TERMS if getattr(self, n)}


def _layer_params(d: int, dh: int) -> list[int]:
    """nn.TransformerEncoderLayer's parameters in registration order: in_proj w/b, out_proj w/b, linear1 w/b,
    linear2 w/b, norm1 w/b, norm2 w/b."""
    return [3 * d * d, 3 * d, d * d, d, dh * d, dh, d * dh, d, d, d, d, d]


def _replica_params(model: dict, nb_part: int) -> list[tuple[int, int]]:
    """(elements, part) of every parameter of a replica, in model.parameters() order."""
    d, dh = model["d_model"], model["d_hid"]
    layer_part = [p for p, n in enumerate(part_sizes(model["nlayers"], nb_part)) for _ in range(n)]
    out = [(model["vocab_size"] * d, 0)]  # Encoder: the embedding table
    for part in layer_part:
        out += [(n, part) for n in _layer_params(d, dh)]
    out += [(n, nb_part - 1) for n in (dh * d, dh, 2 * dh, 2)]  # Decoder: Linear(d, dh), ReLU, Linear(dh, 2)
    return out


def _part_params(model: dict, layers: int, first: bool, last: bool) -> tuple[int, int]:
    """Elements of a part holding `layers` Layers (plus the Encoder, the Decoder), and of its largest parameter."""
    d, dh = model["d_model"], model["d_hid"]
    layer = _layer_params(d, dh)
    sizes = ([model["vocab_size"] * d] if first else []) + ([max(layer)] if layers else []) + ([dh * d] if last else [])
    numel = ((model["vocab_size"] * d if first else 0) + layers * sum(layer)
             + (dh * d + dh + 2 * dh + 2 if last else 0))
    return numel, max(sizes, default=0)


@lru_cache(maxsize=1024)
def _stage_zero(d: int, dh: int, vocab: int, layers: int, first: bool, last: bool, replicas: int) -> int:
    """The most elements one rank of a stage's dp group owns under ZeroRedundancyOptimizer."""
    params = (([vocab * d] if first else []) + _layer_params(d, dh) * layers
              + ([dh * d, dh, 2 * dh, 2] if last else []))
    return _zero_owned(tuple((n, 0) for n in params), 1, replicas)[0]


def _zero_shares(params: list[tuple[int, int]], nb_part: int, replicas: int) -> list[int]:
    """Per part, the most parameter elements any one rank owns there under ZeroRedundancyOptimizer."""
    return list(_zero_owned(tuple(params), nb_part, replicas))


@lru_cache(maxsize=1024)
def _zero_owned(params: tuple[tuple[int, int], ...], nb_part: int, replicas: int) -> tuple[int, ...]:
    sizes, owned = [0] * replicas, [[0] * nb_part for _ in range(replicas)]
    for numel, part in sorted(params, key=lambda p: p[0], reverse=True):  # stable, like torch's sorted()
        rank = sizes.index(min(sizes))
        sizes[rank] += numel
        owned[rank][part] += numel
    return tuple(max(owned[r][p] for r in range(replicas)) for p in range(nb_part))


def attention_kernel(arch: str, precision: str, head_dim: int, dropout: float) -> str:
    """The scaled_dot_product_attention kernel a Layer's attention runs: "flash", "efficient" or "math" (see the
    kernels above; aten/src/ATen/native/transformers/cuda/sdp_utils.cpp and sdp_utils_cpp.cpp)."""
    if arch == "cpu":
        return "math" if dropout > 0 else "flash"  # the CPU flash kernel refuses dropout (check_for_dropout)
    if head_dim % 8 or head_dim > 256:
        return "math"
    return "flash" if arch == "sm80" and precision != "fp32" else "efficient"


class _Tape:
    """Bytes alive while one block of the model runs, op by op: an op's outputs are allocated while its inputs are
    alive, then what it consumed is freed. `peak` is the most alive at once, `at_peak` what was alive then. With
    save=False (a checkpointed forward) the tensors autograd would save are freed at their last use (`done`)."""

    def __init__(self, save: bool = True, traced: bool = False, **alive: int) -> None:
        self.save, self.traced = save, traced
        self.alive = dict(alive)
        self.now = sum(alive.values())
        self.peak, self.at_peak = self.now, dict(alive)

    def op(self, *free: str | None, done: tuple[str, ...] = (), **new: int) -> None:
        self.alive.update(new)
        self.now += sum(new.values())
        if self.now > self.peak:
            self.peak, self.at_peak = self.now, dict(self.alive)
        for name in free + (() if self.save else done):
            if name is not None:
                self.now -= self.alive.pop(name)

    def rename(self, old: str, new: str) -> None:
        self.alive[new] = self.alive.pop(old)

    def add(self, old: str, new: str, into: str) -> None:
        """autograd adds gradient `new` to `old` waiting in an input buffer: in place, or out of place when traced."""
        if self.traced:
            self.op(old, new, sum_=self.alive[old])
            self.rename("sum_", into)
        else:
            self.op(new)
            self.rename(old, into)

    def wgrad(self, name: str, low: int, numel: int) -> None:
        """A weight's gradient as its matmul computes it: in the compute dtype (`low` bytes an element), or fp32."""
        self.op(**{f"new_{name}": (low or 4) * numel})

    def keep(self, name: str, low: int, numel: int, mode: str) -> None:
        """Then cast to fp32 under autocast, and kept (mode "steal": the first micro-batch back), added to the one
        waiting in autograd's input buffer ("add": micro-batches sharing one backward) or added in place by
        AccumulateGrad ("add_": one backward per micro-batch)."""
        if low:
            self.op(f"new_{name}", **{f"f32_{name}": 4 * numel})
            self.rename(f"f32_{name}", f"new_{name}")
        if mode == "steal":
            self.rename(f"new_{name}", f"grad_{name}")
        elif mode == "add":
            self.add(f"grad_{name}", f"new_{name}", f"grad_{name}")
        else:
            self.op(f"new_{name}")

    def grad(self, name: str, low: int, numel: int, mode: str) -> None:
        self.wgrad(name, low, numel)
        self.keep(name, low, numel, mode)


@dataclass(frozen=True)
class _Dims:
    """What one block's tape depends on, for one micro-batch."""
    n: int  # tokens of a micro-batch
    nb: int  # samples of a micro-batch
    seq: int
    d: int
    dh: int
    h: int
    vocab: int
    a: int  # bytes of the compute dtype: 4 (fp32) or 2 (bf16, fp16 autocast)
    drop: bool
    cpu: bool
    attn: str  # attention_kernel()
    traced: bool

    def mask(self, elements: int, dtype: int) -> int:
        return elements * (dtype if self.cpu else 1)

    def tape(self, save: bool = True, **alive: int) -> _Tape:
        return _Tape(save, self.traced, **alive)


def _attention_forward(z: _Dims, t: _Tape) -> str:
    """scaled_dot_product_attention as F.multi_head_attention_forward calls it (need_weights=False; q, k, v views of
    `qkv`), then the reshape of its output for out_proj, whose input it returns."""
    E, a, hs = z.d * z.n, z.a, z.h * z.seq * z.n
    if z.attn == "flash":  # logsumexp (B, H, S) fp32; the output reshaped is a view of itself
        t.op(done=("qkv", "lse"), att=a * E, lse=4 * z.h * z.n)
        return "att"
    if z.attn == "efficient":  # logsumexp padded to 32; the reshape copies the (B, S, H, D) output
        t.op(done=("qkv", "lse"), att=a * E, lse=4 * z.h * z.nb * -(-z.seq // 32) * 32)
        t.op(done=("att",), att2=a * E)
        return "att2"
    f = 4 if z.cpu else a  # the math path: fp32 on the CPU, q, k, v upcast under autocast
    up = f != a
    if up:
        t.op(q32=f * E)
        t.op(k32=f * E)
        t.op(v32=f * E)
    t.op(qs=f * E)  # a local of the math kernel until it returns; the scaled k a temporary of its matmul
    t.op(ks=f * E)
    t.op(done=("ks",), sc=f * hs)
    t.op("sc", sm=f * hs)
    if z.drop:
        t.op(mask=z.mask(hs, f))
        t.op(done=("mask", "sm"), ad=f * hs)
    if up:
        t.op(adc=a * hs)  # the attention weights cast back: returned, then dropped
    t.op(done=("ad" if z.drop else "sm", "v32" if up else "qkv", "qs"), o=f * E)
    if up:
        t.op("o", "q32", "k32", "adc", "qkv", oc=a * E)
        t.op("oc", att2=a * E)
    else:
        t.op("o", att2=a * E)
    return "att2"


def _layer_forward(z: _Dims, t: _Tape, keep_input: bool = False) -> None:
    """nn.TransformerEncoderLayer's forward (post-norm, ReLU, batch_first, training), under autocast when a < 4, on
    a tape holding its input x; leaves its output y, what autograd saves and (autocast) the weight copies. in_proj
    reads x transposed: for more than one sample that view is not contiguous and matmul copies it (the copy is
    saved), for one sample addmm reads x itself."""
    E, H, a, low = z.d * z.n, z.dh * z.n, z.a, z.a < 4
    x_saved = z.nb == 1 and not low
    if low:
        t.op(w_in=a * 3 * z.d * z.d, xc=a * E)
    if z.nb > 1:
        t.op(*(("xc",) if low else ()), xin=a * E)
    t.op(done=("xin" if z.nb > 1 else "xc" if low else None,), proj=a * 3 * E)
    if z.nb > 1 and z.traced:  # the bias added out of place (at::linear: in place but under a dispatch mode)
        t.op("proj", projb=a * 3 * E)
        t.rename("projb", "proj")
    t.op("proj", qkv=a * 3 * E)
    out = _attention_forward(z, t)
    if low:
        t.op(w_out=a * z.d * z.d)
    t.op(done=(out,), o1=a * E)
    _out_of_branch(z, t, "o1", "m1", "od1", "s1")
    t.op(done=("s1", "st1"), x1=4 * E, st1=8 * z.n)
    if low:
        t.op(w1=a * z.d * z.dh, x1c=a * E)
    t.op(done=("x1c",) if low else (), h1=a * H)
    t.op("h1", r=a * H)
    if z.drop:
        t.op(done=("m2", "r"), m2=z.mask(H, a), rd=a * H)
    if low:
        t.op(w2=a * z.d * z.dh)
    t.op(done=("rd" if z.drop else "r",), f=a * E)
    _out_of_branch(z, t, "f", "m3", "fd", "s2")
    t.op(done=("s2", "st2"), y=4 * E, st2=8 * z.n)
    # x1 and x are held by the Layer's frame (`x = self.norm2(x + ...)`) and its caller until it returns
    t.op("x1" if low else None, "x" if not x_saved and not keep_input else None,
         done=(() if low else ("x1",)) + (("x",) if x_saved and not keep_input else ()))


def _out_of_branch(z: _Dims, t: _Tape, out: str, mask: str, dropped: str, total: str) -> None:
    """A branch's output through its dropout (the mask saved) into the residual sum, fp32 like the residual."""
    if z.drop:
        t.op(out, done=(mask,), **{mask: z.mask(z.d * z.n, z.a), dropped: z.a * z.d * z.n})
        out = dropped
    t.op(out, **{total: 4 * z.d * z.n})


def _attention_backward(z: _Dims, t: _Tape) -> None:
    """From `ga`, the gradient of out_proj's input, to dq, dk, dv; the kernel's saved tensors freed."""
    E, a, hs = z.d * z.n, z.a, z.h * z.seq * z.n
    if z.attn == "flash":  # FA2 mha_bwd: dq, dk, dv, an fp32 dq accumulator and softmax_d, seq rounded to 128
        s128 = 0 if z.cpu else -(-z.seq // 128) * 128
        t.op(dq=a * E, dk=a * E, dv=a * E, acc=4 * z.nb * s128 * z.d, sd=4 * z.h * z.nb * s128)
        t.op("acc", "sd", "ga", "qkv", "att", "lse")
        return
    if z.attn == "efficient":  # dq, dk, dv in one (B, S, 3, H, D) chunk; delta; an fp32 dq accumulator (16 bits)
        t.op(dqkv=3 * a * E, sd=4 * z.h * z.nb * -(-z.seq // 32) * 32, acc=4 * E if a < 4 else 0)
        t.op("acc", "sd", "ga", "qkv", "att", "lse")
        return
    f = 4 if z.cpu else a
    up = f != a
    g = "ga"
    if up:
        t.op("ga", ga32=f * E)
        g = "ga32"
    t.op(gv=f * E)
    t.op(g, "v32" if up else "qkv", "ad" if z.drop else None, gad=f * hs)
    if z.drop:
        t.op("gad", "mask", gad2=f * hs)
    t.op("gad2" if z.drop else "gad", "sm", gsm=f * hs)
    t.op(gqs=f * E)
    t.op("gsm", "qs", "ks", gks=f * E)
    t.op("gqs", gq=f * E)
    t.op("gks", gk=f * E)
    t.op("gq", dq=a * E)
    t.op("gk", dk=a * E)
    t.op("gv", dv=a * E)


def _split_backward(z: _Dims, t: _Tape) -> None:
    """The backward of q, k, v = proj[0], proj[1], proj[2]: select_backward makes a zeros (3, S, B, E) for each, and
    autograd sums them; then the reshape back to in_proj's output layout copies."""
    a3 = 3 * z.a * z.d * z.n
    packed = "dqkv" in t.alive
    t.op(None if packed else "dq", z1=a3)
    t.op(None if packed else "dk", z2=a3)
    t.add("z1", "z2", "z12")
    t.op("dqkv" if packed else "dv", z3=a3)
    t.add("z12", "z3", "z123")
    t.op("z123", zc=a3)


def _layer_backward(z: _Dims, mode: str, ckpt: bool) -> _Tape:
    """One Layer's backward for one micro-batch: from what it saved and the gradient g of its output to the gradient
    gin of its input; weight gradients by `mode` (_Tape.grad). Under checkpointing (use_reentrant=False) the Layer's
    forward is first recomputed from the input kept, up to norm2's saved statistics (early stop), its output
    dropped."""
    E, H, a, low = z.d * z.n, z.dh * z.n, z.a, z.a < 4
    lp = _layer_params(z.d, z.dh)
    p = dict(in_proj=sum(lp[0:2]), out_proj=sum(lp[2:4]), linear1=sum(lp[4:6]), linear2=sum(lp[6:8]),
             norm1=sum(lp[8:10]), norm2=sum(lp[10:12]))
    lw = a if low else 0
    grads = {f"grad_{k}": 4 * v for k, v in p.items()} if mode != "steal" else {}
    t = z.tape(x=4 * E)
    if ckpt:
        t = z.tape(x=4 * E, g=4 * E, **grads)
        _layer_forward(z, t, keep_input=True)
    else:
        _layer_forward(z, t)
        t = z.tape(**t.alive, g=4 * E, **grads)
    t.op("y")
    t.op("g", "s2", "st2", gs2=4 * E)
    t.grad("norm2", 0, p["norm2"], mode)
    g = _into_branch(z, t, "gfc", "m3", "gfd")
    _linear_backward(t, "linear2", lw, p["linear2"], dict(gr=a * H), (g, "rd" if z.drop else None,
                                                                       "w2" if low else None), mode)
    if z.drop:
        t.op("gr", "m2", grr=a * H)
    t.op("grr" if z.drop else "gr", "r", gh=a * H)
    _linear_backward(t, "linear1", lw, p["linear1"], dict(gx1c=a * E),
                     ("gh", *(("x1c", "w1") if low else ("x1",))), mode)
    if low:
        t.op("gx1c", gx1f=4 * E)
    t.add("gs2", "gx1f" if low else "gx1c", "gx1")
    t.op("gx1", "s1", "st1", gs1=4 * E)
    t.grad("norm1", 0, p["norm1"], mode)
    g = _into_branch(z, t, "goc", "m1", "gdo")
    _linear_backward(t, "out_proj", lw, p["out_proj"], dict(ga=a * E),
                     (g, "att2" if z.attn != "flash" else None, "w_out" if low else None), mode)
    _attention_backward(z, t)
    _split_backward(z, t)
    _linear_backward(t, "in_proj", lw, p["in_proj"], dict(gx=a * E),
                     ("zc", "xin" if z.nb > 1 else "xc" if low else "x", "w_in" if low else None), mode)
    if low:
        t.op("gx", gxf=4 * E)
    t.add("gs1", "gxf" if low else "gx", "gin")
    if "x" in t.alive:  # the input kept by the checkpoint, released with the Layer's graph
        t.op("x")
    return t


def _into_branch(z: _Dims, t: _Tape, cast: str, mask: str, out: str) -> str | None:
    """The residual's gradient into a branch: cast to the branch's dtype under autocast, then through its dropout
    (the mask freed); returns the name of what the branch's last Linear gets (None: the residual's gradient)."""
    g = None
    if z.a < 4:
        t.op(**{cast: z.a * z.d * z.n})
        g = cast
    if z.drop:
        t.op(g, mask, **{out: z.a * z.d * z.n})
        g = out
    return g


def _linear_backward(t: _Tape, name: str, low: int, numel: int, grad_input: dict, free: tuple, mode: str) -> None:
    """A Linear's backward node: the input's gradient, the weight's, then its inputs and saved tensors freed."""
    t.op(**grad_input)
    t.wgrad(name, low, numel)
    t.op(*free)
    t.keep(name, low, numel, mode)


def _encoder_forward(z: _Dims, t: _Tape) -> None:
    """Encoder: embedding (fp32: autocast leaves it alone) * sqrt(d_model) + positions, dropout; output e."""
    E = 4 * z.d * z.n
    t.op(emb=E)
    t.op("emb", es=E)
    t.op("es", e=E)
    if z.drop:
        t.op("e", me=z.mask(E // 4, 4), ed=E)
        t.rename("ed", "e")


def _encoder_backward(z: _Dims, mode: str) -> _Tape:
    """embedding_dense_backward: a dense (vocab, d_model) fp32 gradient. CUDA first sorts the indices and sums per
    segment (aten/src/ATen/native/cuda/Embedding.cu, EmbeddingBackwardKernel.cu): int64 buffers of n and partial
    sums of up to n / 4 + min(n, vocab) rows, an assumption not measured here."""
    E, V = 4 * z.d * z.n, 4 * z.vocab * z.d
    t = z.tape(**({"me": z.mask(E // 4, 4)} if z.drop else {}), g=E, **({} if mode == "steal" else {"grad_emb": V}))
    if z.drop:
        t.op("g", "me", gd=E)
        t.rename("gd", "g")
    t.op("g", gs=E)
    t.op(etmp=0 if z.cpu else 32 * z.n + 4 * z.d * (z.n // 4 + min(z.n, z.vocab)))
    t.op("etmp", "gs", new_emb=V)
    t.keep("emb", 0, z.vocab * z.d, mode)
    return t


def _decoder_forward(z: _Dims, t: _Tape) -> None:
    """Decoder: mean over positions, Linear(d, dh), ReLU, Linear(dh, 2), on a tape holding its input y."""
    a, low, nb = z.a, z.a < 4, z.nb
    t.op(mean=4 * z.d * nb)
    if low:
        t.op("mean", wd1=a * z.d * z.dh, meanc=a * z.d * nb)
    t.op(hd=a * z.dh * nb)
    t.op("hd", rdec=a * z.dh * nb)
    if low:
        t.op(wd2=a * 2 * z.dh)
    t.op("y", logit=a * 2 * nb)  # its input held by the Decoder's frame until it returns


def _decoder_backward(z: _Dims, mode: str) -> _Tape:
    a, low, nb = z.a, z.a < 4, z.nb
    t = z.tape(y=4 * z.d * z.n)
    _decoder_forward(z, t)
    grads = {} if mode == "steal" else {"grad_dec1": 4 * (z.d * z.dh + z.dh), "grad_dec2": 4 * (2 * z.dh + 2)}
    t = z.tape(**{k: v for k, v in t.alive.items() if k != "logit"}, g=a * 2 * nb, **grads)
    t.op(grd=a * z.dh * nb)
    t.wgrad("dec2", a if low else 0, 2 * z.dh + 2)
    t.op("g", "wd2" if low else None)
    t.keep("dec2", a if low else 0, 2 * z.dh + 2, mode)
    t.op("grd", "rdec", ghd=a * z.dh * nb)
    t.op(gm=a * z.d * nb)
    t.wgrad("dec1", a if low else 0, z.d * z.dh + z.dh)
    t.op("ghd", *(("meanc", "wd1") if low else ("mean",)))
    t.keep("dec1", a if low else 0, z.d * z.dh + z.dh, mode)
    if low:
        t.op("gm", gmf=4 * z.d * nb)
    t.op("gmf" if low else "gm", gin=4 * z.d * z.n)  # mean's backward: the gradient expanded, divided: a full copy
    return t


_COPIES = ("w_in", "w_out", "w1", "w2", "wd1", "wd2")  # autocast's weight copies, by tape name
_OUTPUT = {"enc": "e", "layer": "y", "dec": "logit"}


def _terms(at: dict, saved: set, recomputed: bool = False) -> dict[str, int]:
    """A tape's snapshot by term: weight gradients, weight copies, saved activations (recomputed ones under
    checkpointing), and the rest, the transient."""
    out = dict(grads=0, weight_copies=0, activations=0, recompute=0, transient=0)
    for name, n in at.items():
        key = ("grads" if name.startswith("grad_") else "weight_copies" if name in _COPIES
               else ("recompute" if recomputed and name != "x" else "activations") if name in saved else "transient")
        out[key] += n
    return out


def _add(*parts: tuple[int, dict]) -> dict[str, int]:
    """Sum of term dicts, each scaled: _add((2, a), (1, b))."""
    out: dict[str, int] = {}
    for k, terms in parts:
        for name, n in terms.items():
            out[name] = out.get(name, 0) + k * n
    return out


@lru_cache(maxsize=4096)
def _forward(kind: str, z: _Dims, ckpt: bool) -> dict:
    """One block (Encoder, a Layer, the Decoder) forward for one micro-batch: its peak (`fw`), what it leaves until
    the part's forward ends (`kept`: under checkpointing autocast's weight copies too), what it leaves for the
    backward (`saved`), as term dicts, and the names autograd saves (`names`)."""
    ckpt = ckpt and kind == "layer"  # --activation-checkpointing wraps each Layer only
    start = {"x": 4 * z.d * z.n} if kind == "layer" else {"y": 4 * z.d * z.n} if kind == "dec" else {}
    forward = {"enc": _encoder_forward, "layer": _layer_forward, "dec": _decoder_forward}[kind]
    full = z.tape(**start)
    forward(z, full)
    fw = full
    if ckpt:  # nothing saved but the input; the weight copies stay in autocast's cache until the part returns
        fw = z.tape(save=False, **start)
        forward(z, fw)
    kept = {k: v for k, v in fw.alive.items() if k != _OUTPUT[kind]}
    saved = {"x": 4 * z.d * z.n} if ckpt else kept
    kept = {**kept, **saved}  # checkpointed: its input, kept by the checkpoint
    names = set(saved)
    return dict(fw=_terms(fw.at_peak, names), kept=_terms(kept, names), saved=_terms(saved, names),
                names=frozenset(full.alive) | {"x"})


@lru_cache(maxsize=4096)
def _backward(kind: str, z: _Dims, ckpt: bool, mode: str) -> tuple[dict, int]:
    """One block's backward for one micro-batch, gradients by `mode`: its peak as terms, and its weight gradients."""
    ckpt = ckpt and kind == "layer"
    t = (_layer_backward(z, mode, ckpt) if kind == "layer" else
         _encoder_backward(z, mode) if kind == "enc" else _decoder_backward(z, mode))
    grads = sum(n for k, n in t.alive.items() if k.startswith("grad_"))
    return _terms(t.at_peak, _forward(kind, z, ckpt)["names"], recomputed=ckpt), grads


@lru_cache(maxsize=4096)
def _stack(z: _Dims, ckpt: bool, layers: int, first: bool, last: bool, later: str) -> dict:
    """A part's blocks (Encoder if first, `layers` Layers, Decoder if last) for one micro-batch, as term dicts
    relative to what the other micro-batches hold: `mb` what one leaves saved, `fw` its forward's peak, `bw0` the
    peak of the first micro-batch back (gradients filled as it goes), `bw1` of a later one (gradients all there,
    added to by mode `later`), and `grads` the part's weight gradients. Layers are identical, so of the Layers only
    the first and the last back can hold the peak: nothing here grows with the number of Layers."""
    kinds = (["enc"] if first else []) + (["layer"] if layers else []) + (["dec"] if last else [])
    if not kinds:  # a part with no block (nlayers < nb_part: refused by the checks, still estimated)
        zero = dict.fromkeys(("mb", "fw", "bw0", "bw1"), {})
        return dict(zero, grads=0, size=dict.fromkeys(zero, 0))
    count = {"enc": 1, "layer": layers, "dec": 1}
    fwd = {k: _forward(k, z, ckpt) for k in kinds}
    bwd = {(k, mode): _backward(k, z, ckpt, mode) for k in kinds for mode in ("steal", later)}
    g = {k: bwd[k, "steal"][1] for k in kinds}
    grads = sum(count[k] * g[k] for k in kinds)
    fw, bw0, bw1, before_fw, before_bw = [], [], [], [], []  # before_*: (k, terms) the blocks before hold
    for i, k in enumerate(kinds):
        n = count[k] - 1  # blocks of this kind before the last of them
        fw.append(_add(*before_fw, (n, fwd[k]["kept"]), (1, fwd[k]["fw"])))
        after = sum(count[kk] * g[kk] for kk in kinds[i + 1:])
        for j in {0, n}:  # this kind's block j: j of its kind before it, n - j after it
            bw0.append(_add(*before_bw, (j, fwd[k]["saved"]), (1, {"grads": after + (n - j) * g[k]}),
                            (1, bwd[k, "steal"][0])))
        bw1.append(_add(*before_bw, (n, fwd[k]["saved"]), (1, {"grads": grads - g[k]}), (1, bwd[k, later][0])))
        before_fw.append((count[k], fwd[k]["kept"]))
        before_bw.append((count[k], fwd[k]["saved"]))
    largest = lambda moments: max(moments, key=lambda terms: sum(terms.values()))  # noqa: E731
    out = dict(mb=_add(*before_bw), fw=largest(fw), bw0=largest(bw0), bw1=largest(bw1))
    return dict(out, grads=grads, size={k: sum(v.values()) for k, v in out.items()})


def _dims(model: dict, t: "Training", micro: int, arch: str, traced: bool) -> _Dims:
    d, h, drop = model["d_model"], model["n_head"], model.get("dropout", 0.0)
    return _Dims(n=micro * model["seq_len"], nb=micro, seq=model["seq_len"], d=d, dh=model["d_hid"], h=h,
                 vocab=model["vocab_size"], a=4 if t.precision == "fp32" else 2, drop=drop > 0, cpu=arch == "cpu",
                 attn=attention_kernel(arch, t.precision, d // max(h, 1), drop), traced=traced)


def _step_temporary(largest: int, owned: int, arch: str) -> int:
    """AdamW's temporaries in its step: on CUDA the foreach path's sqrt of all exp_avg_sq of the device (the
    `owned` elements), on the CPU the per-tensor path's sqrt and quotient of the largest parameter."""
    return 8 * largest if arch == "cpu" else 4 * owned


def _check_model(model: dict, t: "Training", arch: str) -> None:
    if t.precision not in PRECISIONS:
        raise ValueError(f"precision {t.precision!r} is not one of {', '.join(PRECISIONS)}")
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is not one of {', '.join(ARCHS)}")
    if model["chunks"] < 1 or model["batch_size"] < model["chunks"]:
        raise ValueError(f"need 1 <= chunks <= batch_size, got chunks={model['chunks']}, "
                         f"batch_size={model['batch_size']}")


def _part_memory(part: int, contents: str, static: dict, moments: dict, s: dict, alive: int, arch: str,
                 unit: str = "part") -> PartMemory:
    """The moment with the most bytes alive: `moments` maps its name to [(count, key of s or a term dict)]."""
    def size(parts: list) -> int:
        return sum(k * (s["size"][x] if isinstance(x, str) else sum(x.values())) for k, x in parts)
    where = max(moments, key=lambda w: size(moments[w]))
    terms = _add((1, static), *((k, s[x] if isinstance(x, str) else x) for k, x in moments[where]))
    m = PartMemory(part, contents, per_micro_batch=s["size"]["mb"], alive=alive, peak_at=where, unit=unit,
                   **{k: v for k, v in terms.items() if k in PartMemory.TERMS})
    m.allowance = allowance(m.peak, arch)
    return m


def allowance(peak: int, arch: str) -> int:
    """The stated allowance over a GPU's peak: CUDA context, cuBLAS/NCCL workspaces, the caching allocator's slack;
    none on the CPU."""
    return 0 if arch == "cpu" else int(ALLOWANCE_GIB * GIB + ALLOWANCE_FRACTION * peak)


def _worker_holds(part: int, nb_part: int, io: int, arch: str, chunks: int) -> tuple[dict, dict]:
    """What fairscale's Pipe keeps of its last task: a worker thread holds the task it ran last and that task's
    output in its locals until the next task comes (fairscale/nn/pipe/worker.py), i.e. through the backward and the
    step, and the micro-batch before during a forward. On a GPU each device has its worker: every part keeps its
    last micro-batch's input (the first part's is the token ids, counted already) and output (`io` bytes each; the
    last part's is the logits). On the CPU one worker runs every part: the last part keeps its last input only.
    Returns the terms (through the backward, during the last forward)."""
    last = part == nb_part - 1
    if arch == "cpu":
        return {"transient": io if last and nb_part > 1 else 0}, {}
    return ({"transient": io * ((part > 0) + (not last))},
            {"transient": io if not last and chunks > 1 else 0})


@lru_cache(maxsize=1024)
def _replica_zero(d: int, dh: int, vocab: int, nlayers: int, nb_part: int, replicas: int) -> tuple[int, ...]:
    model = dict(d_model=d, d_hid=dh, vocab_size=vocab, nlayers=nlayers)
    return _zero_owned(tuple(_replica_params(model, nb_part)), nb_part, replicas)


def estimate_memory(model: dict, t: "Training", nb_part: int, replicas: int, arch: str = "sm80",
                    traced: bool = False) -> list[PartMemory]:
    """Per part (GPU) of one replica of the page's layout, the bytes it holds at the peak of a training step (see
    the terms above). `model` holds nlayers, d_model, n_head, d_hid, seq_len, vocab_size, batch_size (per replica),
    chunks and dropout as the trainer resolves them; `arch` the kernels (ARCHS); `traced` the step as a
    TorchDispatchMode such as MemTracker sees it (benchmarks/memory_grid.py)."""
    _check_model(model, t, arch)
    if nb_part < 1 or replicas < 1:
        raise ValueError(f"need nb_part, replicas >= 1, got nb_part={nb_part}, replicas={replicas}")
    m, batch, seq = model["chunks"], model["batch_size"], model["seq_len"]
    z = _dims(model, t, -(-batch // m), arch, traced)
    zero = _replica_zero(model["d_model"], model["d_hid"], model["vocab_size"], model["nlayers"], nb_part,
                         replicas) if t.zero else None
    out = []
    for p, (layers, contents) in enumerate(zip(part_sizes(model["nlayers"], nb_part),
                                               part_contents(model["nlayers"], nb_part))):
        first, last = p == 0, p == nb_part - 1
        numel, largest = _part_params(model, layers, first, last)
        owned = zero[p] if zero else numel
        static = dict(params=4 * numel, optimizer=8 * owned, buckets=4 * numel,
                      buffers=4 * seq * z.d if first else 0, inputs=8 * batch * ((seq if first else 0) + last))
        s = _stack(z, t.activation_checkpointing, layers, first, last, "add")
        held, previous = _worker_holds(p, nb_part, 4 * z.d * z.n, arch, m)
        moments = {"forward": [(m - 1, "mb"), (1, "fw"), (1, previous)],
                   "backward, first micro-batch back": [(m - 1, "mb"), (1, "bw0"), (1, held)],
                   "optimizer step": [(1, {"grads": s["grads"], "transient": _step_temporary(largest, owned, arch)}),
                                      (1, held)]}
        if m > 1:  # the gradient of the first one's input still waits here: fairscale's Copy runs last
            moments["backward, a later micro-batch"] = [(m - 2, "mb"), (1, "bw1"), (1, held),
                                                        (0 if first else 1, {"transient": 4 * z.d * z.n})]
        out.append(_part_memory(p, contents, static, moments, s, m, arch))
    return out


def stage_actions(schedule: str, pp: int, virtual: int, chunks: int, rank: int) -> list[tuple[str, int]]:
    """The forward ("F") and backward ("B") of each micro-batch that task `rank` of a pipeline runs, in order, as
    (kind, local stage): torch.distributed.pipelining's schedules (torch/distributed/pipelining/schedules.py, 2.13):
    GPipe runs every forward first; 1F1B warms up with min(chunks, pp - rank) forwards, then alternates a backward
    and a forward; Interleaved1F1B warms up with (virtual - 1) * chunks-per-round + 2 * (pp - 1 - rank) forwards
    over its stages (_get_warmup_ops, _get_1f1b_rank_ops); LoopedBFS runs each stage's forwards in turn, then the
    backwards in reverse."""
    if schedule == "gpipe":
        return [("F", 0)] * chunks + [("B", 0)] * chunks
    if schedule == "1f1b":
        warm = min(chunks, pp - rank)
        return [("F", 0)] * warm + [a for _ in range(chunks - warm) for a in (("B", 0), ("F", 0))] + [("B", 0)] * warm
    if schedule == "loopedbfs":
        return ([("F", k) for k in range(virtual) for _ in range(chunks)]
                + [("B", k) for k in reversed(range(virtual)) for _ in range(chunks)])
    per_round = chunks // max(1, chunks // pp)
    warm = min((virtual - 1) * per_round + 2 * (pp - 1 - rank), chunks * virtual)
    fwd = lambda op: (op // per_round) % virtual  # noqa: E731
    bwd = lambda op: virtual - 1 - ((op - warm) // per_round) % virtual  # noqa: E731
    out: list[tuple[str, int]] = []
    for op in range(chunks * virtual + warm):
        if op < chunks * virtual:
            out.append(("F", fwd(op)))
        if op >= warm:
            out.append(("B", bwd(op)))
    return out


def _stage_static(model: dict, t: "Training", z: _Dims, s: int, stages: int, replicas: int,
                  layers: int) -> tuple[dict, int, int]:
    """A stage's weights, AdamW state (under --zero the worst rank's share over its dp group), DDP buckets, inputs
    and receive buffers: pipelining keeps one per micro-batch for the activation it receives and one for the
    gradient (PipelineStage._prepare_forward_infra, _prepare_backward_infra)."""
    first, last = s == 0, s == stages - 1
    numel, largest = _part_params(model, layers, first, last)
    owned = (_stage_zero(z.d, z.dh, z.vocab, layers, first, last, replicas) if t.zero else numel)
    E, m = 4 * z.d * z.n, model["chunks"]
    static = dict(params=4 * numel, optimizer=8 * owned, buckets=4 * numel,
                  buffers=(4 * model["seq_len"] * z.d if first else 0) + m * E * ((not first) + (not last)),
                  inputs=8 * model["batch_size"] * ((model["seq_len"] if first else 0) + last))
    return static, owned, largest


def estimate_stage_memory(model: dict, t: "Training", pp: int, replicas: int, arch: str = "sm80",
                          traced: bool = False, torch: tuple[int, int] | None = None) -> list[PartMemory]:
    """Per task of one pipeline of the stage layout (bench_stage.py: a task per GPU, --pp tasks a pipeline, DDP over
    each stage's `replicas`), the bytes it holds at the peak of a step, its schedule replayed (stage_actions). Each
    micro-batch's backward is its own autograd call there, so weight gradients are added in place after the first;
    a stage keeps each micro-batch's output until its backward (fwd_cache). The gradient of a stage's input is left
    on its receive buffer until the next step by torch 2.4 to 2.8 (_backward.py stage_backward); 2.13 and 2.14 drop
    it once sent (`val.grad = None`): releases in between, or `torch` unknown, are taken to keep it."""
    _check_model(model, t, arch)
    virtual = stages_per_rank(t.schedule, t.virtual_stages)
    if pp < 1 or replicas < 1 or t.schedule not in SCHEDULES or virtual < 1:
        raise ValueError(f"need pp, replicas, virtual stages >= 1 and a schedule of {', '.join(SCHEDULES)}, got "
                         f"pp={pp}, replicas={replicas}, schedule={t.schedule!r}, virtual={virtual}")
    m, stages = model["chunks"], pp * virtual
    z = _dims(model, t, -(-model["batch_size"] // m), arch, traced)
    sizes, contents = part_sizes(model["nlayers"], stages), part_contents(model["nlayers"], stages)
    # what a task keeps of each micro-batch after its backward: the gradient of a stage's input, left on its receive
    # buffer (torch <= 2.8); with several stages a task (2.13's _PipelineScheduleRuntime) every tensor it sent, the
    # sends waited for at the end of the step only (schedules.py: `while len(send_ops)`), 2.6 and 2.8 waited each
    retains = (torch is None or torch < (2, 13), virtual > 1 and (torch is None or torch >= (2, 13)))
    return [_stage_task(model, t, z, rank, pp, virtual, replicas, arch, sizes, contents, retains)
            for rank in range(pp)]


def _stage_task(model: dict, t: "Training", z: _Dims, rank: int, pp: int, virtual: int, replicas: int, arch: str,
                sizes: list[int], contents: list[str], retains: tuple[bool, bool]) -> PartMemory:
    """One task of the stage layout: its stages' state, then its schedule replayed, the largest moment kept."""
    E, m, stages = 4 * z.d * z.n, model["chunks"], pp * virtual
    ids = [rank + k * pp for k in range(virtual)]
    st, static, tmp = [], {}, 0
    for s in ids:
        one, owned, largest = _stage_static(model, t, z, s, stages, replicas, sizes[s])
        static = _add((1, static), (1, one))
        tmp = max(tmp, _step_temporary(largest, owned, arch))
        stack = _stack(z, t.activation_checkpointing, sizes[s], s == 0, s == stages - 1, "add_")
        kept = _add((1, stack["mb"]), (1, {"activations": E if s < stages - 1 else 0}))  # the output kept
        if s > 0 and (t.activation_checkpointing or (z.nb == 1 and z.a == 4)):
            kept["activations"] -= E  # the first Layer keeps its input: the receive buffer itself
        st.append(dict(stack, mb=kept, input_grad=E if s > 0 else 0, output=E if s < stages - 1 else 0))
    size = [{key: sum(s[key].values()) for key in ("mb", "fw", "bw0", "bw1")} for s in st]
    alive, done, grads, held, held_bytes, best = [0] * virtual, [False] * virtual, 0, 0, 0, (-1, None)
    for i, (kind, k) in enumerate(stage_actions(t.schedule, pp, virtual, m, rank)):
        back = kind == "B"
        key = "bw1" if back and done[k] else "bw0" if back else "fw"
        mine = st[k]["grads"] if key == "bw1" else 0  # bw1 holds this stage's gradients itself
        now = held_bytes - (size[k]["mb"] if back else 0) + size[k][key] + grads - mine + held
        if now > best[0]:
            counts = [alive[j] - (back and j == k) for j in range(virtual)]
            best = (now, (f"{'backward' if back else 'forward'} of stage {ids[k]}, step {i + 1}", st[k][key],
                          (counts, grads - mine, held)))
        if back:
            alive[k] -= 1
            held_bytes -= size[k]["mb"]
            grads += 0 if done[k] else st[k]["grads"]
            done[k] = True
            held = held + st[k]["input_grad"] if any(retains) else max(held, st[k]["input_grad"])
            held += st[k]["output"] if retains[1] else 0
        else:
            alive[k] += 1
            held_bytes += size[k]["mb"]
    where, rel, (counts, g, h) = best[1]
    moments = {where: [*((counts[j], st[j]["mb"]) for j in range(virtual)), (1, rel),
                       (1, {"grads": g, "transient": h})],
               "optimizer step": [(1, {"grads": grads, "transient": held + tmp})]}
    return _part_memory(rank, " | ".join(contents[s] for s in ids), static, moments,
                        dict(st[0], size={"mb": sum(st[0]["mb"].values())}),
                        _stage_alive(t.schedule, pp, virtual, m, rank), arch, unit="task")


def _stage_alive(schedule: str, pp: int, virtual: int, chunks: int, rank: int) -> int:
    """The most micro-batches (of all a task's stages) alive at once: forwarded, not yet backwarded."""
    alive = most = 0
    for kind, _ in stage_actions(schedule, pp, virtual, chunks, rank):
        alive += 1 if kind == "F" else -1
        most = max(most, alive)
    return most


def worst_part(model: dict, t: "Training", nb_part: int, replicas: int, arch: str = "sm80",
               torch: tuple[int, int] | None = None) -> PartMemory:
    """The GPU that needs the most: the worst part of the replica layout, or the worst task of the stage layout
    (nb_part is then --pp; `torch` the release, which changes what the stage layout keeps)."""
    parts = (estimate_stage_memory(model, t, nb_part, replicas, arch, torch=torch) if t.layout == "stage"
             else estimate_memory(model, t, nb_part, replicas, arch))
    return max(parts, key=lambda m: m.total)


_worst = worst_part


def format_memory(parts: list[PartMemory], gpu_gib: float | None = None) -> str:
    """One line: the worst part, where its peak falls and its breakdown (GiB, or MiB below 1 GiB)."""
    worst = max(parts, key=lambda m: m.total)
    unit, size = ("GiB", GIB) if worst.total >= GIB else ("MiB", 2 ** 20)
    terms = " + ".join(f"{k} {getattr(worst, k) / size:.2f}" for k in PartMemory.TERMS
                       if getattr(worst, k) / size >= 0.005)
    room = f" of {gpu_gib:.1f} GiB" if gpu_gib else ""
    return (f"memory estimate: {worst.total / size:.2f} {unit}{room} on {worst.unit} {worst.part} ({worst.contents}), "
            f"peak at {worst.peak_at} = {terms}; activations {worst.per_micro_batch / size:.3f} {unit} per "
            f"micro-batch, {worst.alive} alive at most")


def memory_line(model: dict, t: "Training", nb_part: int, replicas: int, gpu_gib: float | None = None,
                arch: str = "sm80", torch: tuple[int, int] | None = None) -> str:
    """The trainers' start-up line: the estimate of their layout (nb_part is --pp in the stage layout)."""
    parts = (estimate_stage_memory(model, t, nb_part, replicas, arch, torch=torch) if t.layout == "stage"
             else estimate_memory(model, t, nb_part, replicas, arch))
    return format_memory(parts, gpu_gib)


def shared_gpu_memory(parts: list[PartMemory], devices: list[int] | None) -> tuple[int, list[int], int] | None:
    """The GPU that holds the most bytes when --devices puts several parts on it: (GPU, its parts, bytes)."""
    if not devices or len(set(devices)) == len(devices) or len(devices) != len(parts):
        return None
    per_gpu: dict[int, list[int]] = {}
    for part, gpu in enumerate(devices):
        per_gpu.setdefault(gpu, []).append(part)
    gpu, on_it = max(per_gpu.items(), key=lambda kv: sum(parts[p].total for p in kv[1]))
    total = sum(parts[p].total for p in on_it) - int((len(on_it) - 1) * ALLOWANCE_GIB * GIB)
    return gpu, on_it, total


def memory_fixes(model: dict, t: "Training", nb_part: int, replicas: int, tpn: int, gib: float,
                 v100: bool, torch: tuple[int, int] | None = None) -> list[str]:
    """The cheap fixes for a GPU that does not fit, each with its own new estimate (re-estimated, not scaled).
    nb_part is --pp in the stage layout."""
    arch, low = ("sm70", "fp16") if v100 else ("sm80", "bf16")
    worst_part = lambda *a: _worst(*a, torch=torch)  # noqa: E731
    stage = t.layout == "stage"
    tries: list[tuple[str, dict, Training, int, int]] = []
    if not t.activation_checkpointing:
        tries.append(("--activation-checkpointing", model, replace(t, activation_checkpointing=True), nb_part, replicas))
    if t.precision == "fp32" and not (stage and low == "fp16"):  # the stage layout refuses fp16
        tries.append((f"--precision {low}", model, replace(t, precision=low), nb_part, replicas))
    if not stage and tpn % 2 == 0 and model["nlayers"] >= 2 * nb_part:
        tries.append((f"--ntasks-per-node={tpn // 2} (nb_part {2 * nb_part}, {replicas // 2} replicas)", model, t,
                      2 * nb_part, replicas // 2))
    if stage and t.schedule in ("gpipe", "loopedbfs") and model["chunks"] >= nb_part:
        tries.append(("--schedule 1f1b (at most --pp micro-batches alive)", model, replace(t, schedule="1f1b"),
                      nb_part, replicas))
    if not t.zero and replicas > 1:
        tries.append(("--zero", model, replace(t, zero=True), nb_part, replicas))
    out, fitting = [], []
    for label, m, tt, nb, r in tries:
        total = worst_part(m, tt, nb, r, arch).total / GIB
        out.append(f"{label}: {total:.1f} GiB" + ("" if total <= gib else " (still too big)"))
        fitting.append(total <= gib)
    chunks = model["chunks"]
    batch = next((b for b in range(model["batch_size"] - chunks, 0, -chunks)
                  if worst_part(dict(model, batch_size=b), t, nb_part, replicas, arch).total / GIB <= gib), None)
    if batch:
        est = worst_part(dict(model, batch_size=batch), t, nb_part, replicas, arch).total / GIB
        out.append(f"--batch-size {batch} (a multiple of --chunks {chunks}): {est:.1f} GiB")
    if not any(fitting) and not batch and tries:
        precision = low if t.precision == "fp32" and not (stage and low == "fp16") else t.precision
        all_t = replace(t, activation_checkpointing=True, precision=precision, zero=replicas > 1 or t.zero)
        est = worst_part(model, all_t, nb_part, replicas, arch).total / GIB
        out.append(f"all of --activation-checkpointing"
                   f"{f' --precision {precision}' if precision != t.precision else ''}"
                   f"{' --zero' if all_t.zero else ''} together: {est:.1f} GiB"
                   + ("" if est <= gib else " (still too big: use more GPUs per "
                      f"{'pipeline (--pp)' if stage else 'replica'} or a smaller model)"))
    return out


# ---- I.5 What each torch release can run -----------------------------------------------------------------------------

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
    # Only without a GPU (gloo): before 2.8, pipelining's _batch_p2p kept one of the requests that gloo returns for a
    # batch of sends and receives and waited on that one alone (`batch_isend_irecv(ops).pop()` in 2.4.1 and 2.6.0
    # schedules.py), so the schedules that batch a send with a receive wait forever; nccl coalesces a batch into
    # one request and is not affected. pytorch/pytorch#132644, fixed by #152938 (2.8.0 returns and waits on all).
    # Measured here: 1f1b and loopedbfs hang on 2.4.1 and 1f1b on 2.6.0 (gloo); gpipe sends and receives separately.
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


# ---- I.6 The trainers' checks of their arguments ---------------------------------------------------------------------

def _choices(values: Iterable[int]) -> str:
    values = sorted(set(values))
    if not values:
        return "none"
    return ", ".join(map(str, values[:-1])) + (" or " if len(values) > 1 else "") + str(values[-1])


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_training(nb_part: int, t: Training, findings: Findings, cpu: bool = False) -> None:
    """The model and batch against the split: layers per part, chunks per batch."""
    model = model_args(t, cpu)  # the trainer's defaults where the line gives nothing
    nlayers, chunks, batch = model["nlayers"], model["chunks"], model["batch_size"]
    if nb_part >= 1:
        if nlayers < nb_part:
            findings.error("nlayers-below-nb-part",
                           f"--nlayers={nlayers} < nb_part={nb_part}: {nb_part - nlayers} GPU(s) of each task would "
                           f"hold no Layer block (idle); use --nlayers >= {nb_part} or fewer GPUs per task "
                           f"(more --ntasks-per-node, or --nb-part {max(1, nlayers)})")
        elif nlayers % nb_part:
            sizes = part_sizes(nlayers, nb_part)
            more = [p for p, n in enumerate(sizes) if n > min(sizes)]
            findings.warn("nlayers-not-multiple",
                          f"--nlayers={nlayers} is not a multiple of nb_part={nb_part}: {'parts' if len(more) > 1 else 'part'} {_choices(more)} get "
                          f"{max(sizes)} layers, the others {min(sizes)} (layers per part {sizes}); the slowest "
                          f"part sets the pace: try --nlayers {nlayers - nlayers % nb_part} or "
                          f"{nlayers + nb_part - nlayers % nb_part}")
    if chunks < 1 or batch < 1:
        findings.error("bad-value", f"--chunks ({chunks}) and --batch-size ({batch}) must be positive")
    elif chunks > batch:
        findings.error("chunks-above-batch",
                       f"--chunks={chunks} is larger than the batch size per replica ({batch}): micro-batches "
                       f"would be empty; use --chunks <= {batch}")
    elif batch % chunks:
        near = sorted(divisors(batch), key=lambda d: (abs(d - chunks), d))[:2]
        findings.error("chunks-not-dividing-batch",
                       f"--chunks={chunks} must divide the batch size per replica ({batch}): the micro-batches "
                       f"would differ in size; try --chunks {_choices(near)}")
    if t.engine not in ENGINES:
        findings.error("bad-engine", f"--engine={t.engine!r} is not one of {', '.join(ENGINES)}")
    if t.layout == "stage" and t.precision == "fp16":
        findings.error("fp16-stage", "--precision fp16 needs a GradScaler around backward, but the stage layout's "
                       "schedules (torch.distributed.pipelining) run backward themselves; use --precision bf16, or "
                       "fp16 with bench_ddp_transformer.py (the replica layout)")
    for arg in t.unchecked:
        findings.warn("unchecked-argument", f"{arg} is a shell variable: not checked here; check each value "
                      "with `python check_topology.py ... --nlayers/--chunks/--batch-size N`")


def stages_per_rank(schedule: str, virtual: int) -> int:
    return virtual if schedule in MULTI_STAGE else 1


def check_stage(world: int, tasks_per_node: list[int], gpus_per_node: int | None, t: Training,
                findings: Findings, cpu: bool = False) -> int:
    """The stage layout (bench_stage.py): a task per GPU, pipelines of --pp consecutive tasks. Returns the stages per pipeline."""
    pp, v = t.pp, stages_per_rank(t.schedule, t.virtual_stages)
    chunks = model_args(t, cpu)["chunks"]
    if t.schedule not in SCHEDULES:
        findings.error("bad-schedule", f"--schedule {t.schedule!r} is not one of {', '.join(SCHEDULES)}")
    if pp < 2:
        findings.error("pp-too-small", f"--pp {pp}: a pipeline needs at least 2 stages; for pure data parallel "
                       "use bench_ddp_transformer.py --nb-part 1")
        return max(pp, 1) * v
    if world < pp:
        findings.error("pp-not-dividing-world", f"--pp {pp} needs at least {pp} tasks, one per stage (got {world}); "
                       f"launch {pp} or a multiple of {pp} (srun -n, torchrun --nproc-per-node)")
        return pp * v
    if world % pp:
        findings.error("pp-not-dividing-world", f"--pp {pp} must divide the world size ({world} tasks) into whole "
                       f"pipelines; try --pp {_choices(d for d in divisors(world) if d > 1)}")
    if gpus_per_node:
        for n in sorted(set(tasks_per_node)):
            if n < gpus_per_node:
                findings.warn("gpus-idle", f"{n} task(s) per node for {gpus_per_node} GPUs: the stage layout runs a "
                              f"task per GPU, {gpus_per_node - n} stay idle; use --ntasks-per-node={gpus_per_node}")
                break
    if any(n % pp for n in tasks_per_node):
        findings.warn("pipeline-spans-nodes", f"--pp {pp} does not divide the {_choices(tasks_per_node)} tasks per "
                      f"node: some pipelines cross nodes and send activations over the network at every "
                      f"micro-batch; choose --pp in {_choices(d for d in divisors(min(tasks_per_node)) if d > 1)}")
    if t.schedule == "1f1b" and chunks < pp:
        findings.error("chunks-below-stages", f"--schedule 1f1b needs --chunks >= the {pp} stages of a pipeline "
                       f"(got {chunks}): try --chunks {pp * 2} or --schedule gpipe")
    if t.schedule in MULTI_STAGE:
        rounds = max(1, chunks // pp)
        if chunks % rounds:
            findings.error("chunks-not-rounds", f"--schedule {t.schedule} needs --chunks to be a multiple of "
                           f"chunks // pp = {rounds} (got {chunks}); try --chunks {rounds * pp}")
    return pp * v


def bubble(nb_part: int, chunks: int) -> float:
    """GPipe's idle fraction: (nb_part - 1) / (chunks + nb_part - 1)."""
    return (nb_part - 1) / (chunks + nb_part - 1)


def check_bubble(nb_part: int, t: Training, findings: Findings) -> None:
    """GPipe's bubble: with K parts and M micro-batches each GPU idles (K-1)/(M+K-1) of a step; GPipe's paper
    (Huang et al. 2019, sec. 2.3) finds it negligible when M >= 4 x K."""
    chunks = t.chunks if t.chunks is not None else GPU_DEFAULTS["chunks"]
    batch = t.batch_size if t.batch_size is not None else GPU_DEFAULTS["batch_size"]
    if nb_part < 2 or chunks < 1 or chunks >= 4 * nb_part:
        return
    idle = bubble(nb_part, chunks)
    need = 4 * (nb_part - 1) + 1  # the fewest chunks that bring the bubble under 20 %
    fits = [d for d in divisors(batch) if d >= need] if batch >= 1 else []
    fix = (f"--chunks {fits[0]} ({bubble(nb_part, fits[0]):.0%})" if fits else
           f"--chunks {need} or more, with a batch size it divides")
    findings.warn("pipeline-bubble",
                  f"--chunks={chunks} is below 4 x nb_part = {4 * nb_part}: the pipeline bubble keeps each GPU idle "
                  f"(nb_part-1)/(chunks+nb_part-1) = {nb_part - 1}/{chunks + nb_part - 1} = {idle:.0%} of every "
                  f"step; {fix} brings it under 20 %")


# ======================================================================================================================
# Part II. The pre-flight checker: Slurm 22.05, Jean Zay, reading job scripts, the report, the command line
# ======================================================================================================================


# ---- II.1 What it catches --------------------------------------------------------------------------------------------

class UsageError(Exception):
    """Bad command line or unreadable file: exit 2."""

# Every finding the checker can give, with its level: `--json` carries these codes, and README.md lists exactly
# this table (tests/test_check_topology.py compares the three: this table, the code, the README).
CATCHES = {
    # reading the script as sbatch 22.05 does
    "no-shebang": ("error", "the first line is not #! and an interpreter (sbatch refuses the file)"),
    "dos-line-breaks": ("error", "\\r\\n line ends (sbatch refuses the file)"),
    "unknown-option": ("error", "an option sbatch or srun does not know, with a did-you-mean"),
    "ambiguous-option": ("error", "an abbreviation that matches several options (getopt refuses it)"),
    "option-prefix": ("warning", "an unambiguous abbreviation, which getopt accepts: write it in full"),
    "stray-token": ("error", "a word in a #SBATCH line that is not an option (sbatch refuses the file)"),
    "bad-directive": ("error", "a #SBATCH line that cannot be parsed (unbalanced quotes)"),
    "bad-value": ("error", "a count, GPU request or binding that is not valid, e.g. -N=2"),
    "bad-command": ("error", "a trainer line that cannot be parsed"),
    "variable-in-directive": ("error", "$VARIABLES in #SBATCH lines, which sbatch does not expand"),
    "ignored-directive": ("warning", "a directive sbatch ignores: indented, lower case, '# SBATCH', after the first command"),
    "pbs-directive": ("error", "#PBS / #BSUB lines, which sbatch also reads, without --ignore-pbs"),
    "hetjob": ("warning", "a heterogeneous job, whose components are checked as one"),
    "node-range": ("warning", "--nodes=MIN-MAX: the plan assumes MIN"),
    "no-trainer-line": ("warning", "no trainer line (bench_ddp_transformer.py or bench_stage.py): the defaults are checked"),
    "unchecked-argument": ("warning", "a trainer argument given as a shell variable"),
    # tasks and their placement
    "trainer-without-srun": ("error", "a trainer line without srun in a job of several tasks or nodes (one process runs)"),
    "nodes-missing": ("warning", "--ntasks without --nodes: Slurm picks the node count"),
    "ntasks-per-node-missing": ("error/warning", "--ntasks-per-node missing: an error when several nodes may pack unevenly"),
    "ntasks-mismatch": ("error", "--ntasks above nodes x --ntasks-per-node (refused), or below it and placed unevenly"),
    "ntasks-per-node-max": ("warning", "--ntasks below nodes x --ntasks-per-node but even: SLURM_NTASKS_PER_NODE misleads"),
    "ntasks-below-nodes": ("error", "fewer tasks than nodes"),
    "uneven-tasks-per-node": ("error", "tasks per node differ, so nb_part differs between nodes"),
    "step-nodes": ("error", "srun -N above the job's nodes"),
    "step-too-many-tasks": ("error", "srun -n above what the allocation holds (srun refuses the step)"),
    "srun-ntasks-per-node-ignored": ("warning", "srun --ntasks-per-node that srun ignores (it doesn't match -n)"),
    "srun-ntasks-per-node-conflict": ("error", "srun --ntasks-per-node above what the nodes hold (placed unevenly)"),
    "srun-gpu-option": ("warning", "srun --gres/--gpus* on the trainer's line, not modelled"),
    # GPUs
    "no-gpus": ("error", "no GPU requested"),
    "gpu-request-conflict": ("error", "--gres=gpu:N with a --gpus-per-node, --gpus or --gpus-per-task that disagrees"),
    "gpus-total-multinode": ("error", "--gpus=N (a total) over several nodes: no even split is promised"),
    "gpus-exceed-node": ("error", "more GPUs per node than the node type has"),
    "gpus-not-divisible": ("error", "GPUs per node not divisible by tasks per node"),
    "more-tasks-than-gpus": ("error", "more tasks per node than GPUs: nb_part = 0"),
    "gpu-index-past-visible": ("error", "a task would use a GPU index past what it sees (the first such index)"),
    "devices-count": ("error", "--devices does not give one GPU index per part"),
    "parts-share-gpu": ("warning", "--devices puts several parts on one GPU (a one-GPU check, not a speed figure)"),
    "gpu-shared": ("error", "two tasks of a node on one GPU"),
    "gpus-idle": ("warning", "GPUs nobody uses (how many, which)"),
    "gpus-per-task-cgroup": ("warning", "--gpus-per-task: per-task GPU cgroups hide NVLink from NCCL"),
    "gpu-bind-mask": ("warning", "--gpu-bind=mask_gpu, not modelled"),
    "gpu-bind-closest": ("warning", "--gpu-bind=closest, which depends on the node"),
    # cores, time, account, modules (Jean Zay)
    "cpus-per-task-missing": ("warning", "--cpus-per-task missing (Jean Zay grants memory per core)"),
    "cpus-per-task-small": ("warning", "--cpus-per-task below the node's cores per GPU x GPUs per task"),
    "cpus-exceed-node": ("error", "tasks x --cpus-per-task above the node's cores"),
    "hint-missing": ("warning", "--hint=nomultithread missing"),
    "time-missing": ("warning", "--time missing: 10 minutes on Jean Zay's GPU partitions"),
    "bad-time": ("error", "a --time Slurm does not read"),
    "time-over-qos": ("error", "--time above the QoS limit (dev 2 h, t3 20 h, t4 100 h)"),
    "account-mismatch": ("error", "an account suffix (@v100, @a100, @h100) that does not match the nodes asked for"),
    "arch-h100-missing": ("error", "-C h100 without module load arch/h100 before pytorch-gpu"),
    "engine-unavailable": ("error", "--engine torch-pipe with a pytorch-gpu/py3/2.4+ module"),
    "torch-too-old": ("error", "bench_stage.py with a pytorch-gpu/py3 module older than 2.4"),
    # memory (the section *Will it fit?*)
    "does-not-fit": ("error", "a GPU's estimated peak memory (a part of a replica, a task of a pipeline) "
                              "above its own"),
    "memory-tight": ("warning", "a GPU's estimated peak memory above 90 % of its own"),
    "bf16-on-v100": ("error", "--precision bf16 on V100 GPUs, which have no bf16"),
    "fp16-stage": ("error", "--precision fp16 in the stage layout, whose schedules leave no place for a GradScaler"),
    # the model and the pipeline
    "nlayers-below-nb-part": ("error", "fewer layers than GPUs per task"),
    "nlayers-not-multiple": ("warning", "layers not a multiple of GPUs per task"),
    "chunks-above-batch": ("error", "more chunks than the batch per replica"),
    "chunks-not-dividing-batch": ("error", "chunks not dividing the batch per replica"),
    "pipeline-bubble": ("warning", "chunks < 4 x nb_part: the bubble fraction and the chunks that bring it under 20 %"),
    "bad-engine": ("error", "an --engine the trainer does not have"),
    "bad-layout": ("error", "an argument the trainer's script does not have: --layout, or the other layout's "
                   "(--pp on bench_ddp_transformer.py, --nb-part on bench_stage.py)"),
    "bad-schedule": ("error", "a --schedule the stage layout does not have"),
    "pp-too-small": ("error", "stage layout: --pp below 2"),
    "pp-not-dividing-world": ("error", "stage layout: --pp not dividing the tasks"),
    "pipeline-spans-nodes": ("warning", "stage layout: pipelines that cross nodes"),
    "chunks-below-stages": ("error", "stage layout: 1F1B with fewer chunks than stages"),
    "chunks-not-rounds": ("error", "stage layout: interleaved chunks not a multiple of the rounds"),
    # inside a running step (srun python check_topology.py)
    "task-missing": ("error", "a task that never reported to task 0"),
    "affinity-small": ("warning", "a task may run on fewer CPUs than --cpus-per-task"),
    "no-gpu-visible": ("warning", "a task that sees no GPU"),
}


# ---- II.2 Slurm 22.05: the request, the option tables, the placement of tasks and GPUs -------------------------------

@dataclass
class Job:
    """A Slurm request (from #SBATCH lines, command-line flags, or an allocation's SLURM_* variables)."""
    nodes: int | None = None
    ntasks: int | None = None
    ntasks_per_node: int | None = None
    tasks_per_node: list[int] | None = None  # known per node only inside an allocation
    gpus_per_node: int | None = None
    gpus_per_task: int | None = None
    gpus_total: int | None = None
    gpu_bind: str | None = None
    cpus_per_task: int | None = None
    hint: str | None = None
    constraint: str | None = None
    partition: str | None = None
    time: str | None = None
    torch_module: str | None = None  # `module load pytorch-gpu/py3/<version>`
    gpu_mem: float | None = None  # --gpu-mem: GiB per GPU, given by the user
    gpu_mem_seen: float | None = None  # GiB per GPU as nvidia-smi shows it inside the allocation
    source: str = "command line"
    gres_gpus: int | None = None  # --gres=gpu:N (GPUs per node), kept apart from --gpus-per-node to compare them
    account: str | None = None
    qos: str | None = None
    distribution: str | None = None
    ignore_pbs: bool = False
    modules: list[str] = field(default_factory=list)  # every `module load` argument, in order
    srun: bool | None = None  # the trainer's line starts with srun (None: no trainer line)
    launcher: str | None = None  # what comes before the trainer's script on its line
    trainer: str = "bench_ddp_transformer.py"  # the script on it
    step_nodes: int | None = None  # srun's own -N / -n / --ntasks-per-node on the trainer's line
    step_ntasks: int | None = None
    step_ntasks_per_node: int | None = None
    step_cpus_per_task: int | None = None  # srun -c: 22.05's srun does not inherit the job's --cpus-per-task
    placement: str = "exact"  # "possible": Slurm decides by free cores; the plan shows one placement it may make

# The option tables of Slurm 22.05 (Debian bookworm's slurm-wlm): every option `man sbatch` / `man srun` list, with
# r = takes a value, o = an optional value (only as --name=value), n = a flag; plus the undocumented aliases the real
# commands accepted on the test cluster (sbatch/srun --tasks-per-node, srun --pack-group and --cpu_bind).
# tests/test_check_topology.py compares these tables with the installed man pages. Later releases add options
# (e.g. 23.02's --tres-per-task): a newer one used here is reported as unknown to 22.05.
def _table(spec: str) -> dict[str, str]:
    return dict(item.split(":") for item in spec.split())

SBATCH_LONG = _table(
    "account:r acctg-freq:r array:r batch:r bb:r bbf:r begin:r chdir:r cluster-constraint:r clusters:r comment:r "
    "constraint:r container:r contiguous:n core-spec:r cores-per-socket:r cpu-freq:r cpus-per-gpu:r "
    "cpus-per-task:r deadline:r delay-boot:r dependency:r distribution:r error:r exclude:r exclusive:o export:r "
    "export-file:r extra-node-info:r get-user-env:o gid:r gpu-bind:r gpu-freq:r gpus:r gpus-per-node:r "
    "gpus-per-socket:r gpus-per-task:r gres:r gres-flags:r help:n hint:r hold:n ignore-pbs:n input:r job-name:r "
    "kill-on-invalid-dep:r licenses:r mail-type:r mail-user:r mcs-label:r mem:r mem-bind:r mem-per-cpu:r "
    "mem-per-gpu:r mincpus:r network:r nice:o no-kill:o no-requeue:n nodefile:r nodelist:r nodes:r ntasks:r "
    "ntasks-per-core:r ntasks-per-gpu:r ntasks-per-node:r ntasks-per-socket:r open-mode:r output:r overcommit:n "
    "oversubscribe:n parsable:n partition:r power:r prefer:r priority:r profile:r propagate:o qos:r quiet:n "
    "reboot:n requeue:n reservation:r signal:r sockets-per-node:r spread-job:n switches:r tasks-per-node:r "
    "test-only:n thread-spec:r threads-per-core:r time:r time-min:r tmp:r uid:r usage:n use-min-nodes:n verbose:n "
    "version:n wait:n wait-all-nodes:r wckey:r wrap:r")
SRUN_LONG = _table(
    "accel-bind:r account:r acctg-freq:r bb:r bbf:r bcast:o bcast-exclude:r begin:r chdir:r cluster-constraint:r "
    "clusters:r comment:r compress:o constraint:r container:r contiguous:n core-spec:r cores-per-socket:r "
    "cpu-bind:r cpu-freq:r cpu_bind:r cpus-per-gpu:r cpus-per-task:r deadline:r delay-boot:r dependency:r "
    "disable-status:n distribution:r epilog:r error:r exact:n exclude:r exclusive:o export:r extra-node-info:r "
    "gid:r gpu-bind:r gpu-freq:r gpus:r gpus-per-node:r gpus-per-socket:r gpus-per-task:r gres:r gres-flags:r "
    "help:n het-group:r hint:r hold:n immediate:o input:r job-name:r jobid:r kill-on-bad-exit:o label:n "
    "licenses:r mail-type:r mail-user:r mcs-label:r mem:r mem-bind:r mem-per-cpu:r mem-per-gpu:r mincpus:r mpi:r "
    "msg-timeout:r multi-prog:n network:r nice:o no-allocate:n no-kill:o nodefile:r nodelist:r nodes:r ntasks:r "
    "ntasks-per-core:r ntasks-per-gpu:r ntasks-per-node:r ntasks-per-socket:r open-mode:r output:r overcommit:n "
    "overlap:n oversubscribe:n pack-group:r partition:r power:r prefer:r preserve-env:n priority:r profile:r "
    "prolog:r propagate:o pty:o qos:r quiet:n quit-on-interrupt:n reboot:n relative:r reservation:r resv-ports:o "
    "send-libs:o signal:r slurmd-debug:r sockets-per-node:r spread-job:n switches:r task-epilog:r task-prolog:r "
    "tasks-per-node:r test-only:n thread-spec:r threads:r threads-per-core:r time:r time-min:r tmp:r uid:r "
    "unbuffered:n usage:n use-min-nodes:n verbose:n version:n wait:r wckey:r x11:o")
SBATCH_SHORT = dict(x.split("=") for x in (
    "A=account B=extra-node-info C=constraint D=chdir F=nodefile G=gpus H=hold J=job-name L=licenses M=clusters "
    "N=nodes O=overcommit Q=quiet S=core-spec V=version W=wait a=array b=begin c=cpus-per-task d=dependency "
    "e=error h=help i=input k=no-kill m=distribution n=ntasks o=output p=partition q=qos s=oversubscribe t=time "
    "v=verbose w=nodelist x=exclude").split())
SRUN_SHORT = {k: v for k, v in SBATCH_SHORT.items() if k != "a"} | dict(  # srun has no -a, and more letters
    E="preserve-env", I="immediate", K="kill-on-bad-exit", T="threads", X="disable-status", Z="no-allocate",
    l="label", r="relative", u="unbuffered")
ALIASES = {"tasks-per-node": "ntasks-per-node", "cpu_bind": "cpu-bind", "pack-group": "het-group"}


def long_option(name: str, table: dict[str, str], prog: str, where: str, findings: Findings) -> str | None:
    """Resolve --name as getopt_long does: an exact name, else an unambiguous prefix (sbatch accepted
    --ntasks-per-nod=2 on the test cluster), else the error the command prints."""
    if name in table:
        return name
    matches = [n for n in table if n.startswith(name)] if name else []
    if len(matches) == 1:
        findings.warn("option-prefix", f"{where}: {prog} reads --{name} as --{matches[0]} (an abbreviation "
                      f"getopt accepts); write --{matches[0]} in full")
        return matches[0]
    if matches:
        findings.error("ambiguous-option", f"{where}: {prog} refuses --{name}: it is ambiguous ("
                       + ", ".join(f"--{m}" for m in sorted(matches)[:6]) + "); write the full name")
        return None
    near = difflib.get_close_matches(name, list(table), n=1, cutoff=0.6)
    findings.error("unknown-option", f"{where}: {prog} refuses --{name} (unrecognized option: {prog} exits 255"
                   + (f"); did you mean --{near[0]}?" if near else f"); see `man {prog}`"))
    return None


def parse_options(tokens: list[str], where: str, findings: Findings, prog: str = "sbatch"
                  ) -> tuple[list[tuple[str, str | None]], list[str]]:
    """Split option tokens as getopt_long does for sbatch (a #SBATCH line) or srun (its options stop at the first
    word that is not an option: the command). Returns (name, value) pairs with short and alias names mapped to
    long ones, and the rest of the tokens (srun's command)."""
    table, short = (SBATCH_LONG, SBATCH_SHORT) if prog == "sbatch" else (SRUN_LONG, SRUN_SHORT)
    out, i = [], 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if tok == "--":
            return out, tokens[i:]
        if tok.startswith("--"):
            raw, eq, value = tok[2:].partition("=")
            name = long_option(raw, table, prog, where, findings)
            if name is None:
                continue
            kind = table[name]
            if kind == "n" and eq:
                findings.error("bad-value", f"{where}: {prog} refuses --{name}={value}: --{name} takes no value")
                value = None
            elif kind == "r" and not eq:
                if i >= len(tokens):
                    findings.error("bad-value", f"{where}: --{name} needs a value, e.g. --{name}=<value>")
                    continue
                value, i = tokens[i], i + 1
            elif not eq:
                value = None
            out.append((ALIASES.get(name, name), value))
        elif tok.startswith("-") and len(tok) >= 2:
            j = 1
            while j < len(tok):
                letter = tok[j]
                if letter not in short:
                    findings.error("unknown-option", f"{where}: {prog} refuses -{letter} (invalid option; "
                                   f"{prog} exits 255); see `man {prog}`")
                    break
                name = short[letter]
                if table[name] == "n":
                    out.append((name, None))
                    j += 1
                    continue
                value = tok[j + 1:]
                if not value and table[name] == "r":
                    if i >= len(tokens):
                        findings.error("bad-value", f"{where}: -{letter} needs a value")
                        break
                    value, i = tokens[i], i + 1
                out.append((name, value or None))
                break
        elif prog == "srun":
            return out, tokens[i - 1:]
        else:  # measured: sbatch exits 1 with "Invalid directive found in batch script: stray"
            findings.error("stray-token", f"{where}: {tok!r} is not an option; sbatch refuses the script ('Invalid "
                           f"directive found in batch script: {tok}'); quote values with spaces")
    return out, []


def _int_option(name: str, value: str | None, where: str, findings: Findings, lo: int = 1) -> int | None:
    raw = (value or "").strip()
    if "$" in raw:
        return None  # reported once as a variable
    m = re.fullmatch(r"(?:[A-Za-z0-9_-]+:)?(\d+)", raw) if name.startswith("gpus") else re.fullmatch(r"(\d+)", raw)
    if name == "nodes" and re.fullmatch(r"\d+-\d+", raw):
        findings.warn("node-range", f"{where}: --nodes={raw} is a range; the plan assumes the minimum "
                      f"{raw.split('-')[0]}: fix it (e.g. --nodes={raw.split('-')[0]}) so the layout is known")
        m = re.match(r"(\d+)", raw)
    if not m or int(m.group(1)) < lo:
        hint = f" (write --{name}={raw[1:]}: a short option takes no '=')" if raw.startswith("=") else ""
        findings.error("bad-value", f"{where}: --{name}={raw!r} is not a count >= {lo}; sbatch refuses it{hint}")
        return None
    return int(m.group(1))


def gres_gpus(value: str, where: str, findings: Findings) -> int | None:
    """GPUs per node in --gres: 'gpu:4', 'gpu:v100:4', 'gpu:4(S:0-1)', 'gpu' (one)."""
    for item in re.split(r",(?![^(]*\))", value):  # commas inside '(S:0-1)' don't separate items
        m = re.fullmatch(r"gpu(?::([A-Za-z][\w.-]*))?(?::(\w+))?(\(.*\))?", item.strip())
        if not m:
            if item.strip().startswith("gpu"):
                findings.error("bad-value", f"{where}: --gres={value!r} is not gpu[:type]:count")
                return None
            continue
        count = m.group(2) or "1"
        if not count.isdigit() or int(count) < 1:
            findings.error("bad-value", f"{where}: --gres={value!r}: GPU count {count!r} is not a number >= 1")
            return None
        return int(count)
    return None

INT_FIELDS = {"nodes": "nodes", "ntasks": "ntasks", "ntasks-per-node": "ntasks_per_node",
              "cpus-per-task": "cpus_per_task", "gpus-per-node": "gpus_per_node", "gpus-per-task": "gpus_per_task",
              "gpus": "gpus_total"}
TEXT_FIELDS = {"hint": "hint", "constraint": "constraint", "partition": "partition", "time": "time",
               "account": "account", "qos": "qos", "distribution": "distribution"}


def apply_option(job: Job, name: str, value: str | None, where: str, findings: Findings) -> None:
    if value is not None and "$" in value:
        findings.error("variable-in-directive",
                       f"{where}: --{name}={value} uses a shell variable, but sbatch does not expand variables in "
                       f"#SBATCH lines (it sees the text {value!r}); "
                       + ("use Slurm's patterns (%j job id, %x job name, %u user) or an absolute path"
                          if name in ("output", "error", "job-name", "chdir") else
                          f"write the value, or pass it on the sbatch command line: sbatch --{name}=\"${{VAR}}\" "
                          "job.slurm"))
        return
    if name in INT_FIELDS:
        setattr(job, INT_FIELDS[name], _int_option(name, value, where, findings))
    elif name == "gres":
        n = gres_gpus(value or "", where, findings)
        if n is not None:
            job.gres_gpus = n
    elif name == "gpu-bind":
        job.gpu_bind = value
        check_gpu_bind(value or "", where, findings)
    elif name in TEXT_FIELDS:
        setattr(job, TEXT_FIELDS[name], value)
    elif name == "ignore-pbs":
        job.ignore_pbs = True

STEP_FIELDS = {"nodes": "step_nodes", "ntasks": "step_ntasks", "ntasks-per-node": "step_ntasks_per_node",
               "cpus-per-task": "step_cpus_per_task"}


def apply_srun_option(job: Job, name: str, value: str | None, where: str, findings: Findings) -> None:
    """An srun option on the trainer's line: the step's own shape (it inherits the rest from the job)."""
    if name in STEP_FIELDS:
        setattr(job, STEP_FIELDS[name], _int_option(name, value, where, findings))
    elif name in ("gpus-per-task", "gpu-bind", "distribution"):
        apply_option(job, name, value, where, findings)
    elif name in ("gres", "gpus-per-node", "gpus"):
        findings.warn("srun-gpu-option", f"{where}: srun --{name}={value} changes the step's GPUs, which the plan "
                      "does not model (on 22.05 a step asking more GPUs than the job fails); request GPUs in #SBATCH")


def check_gpu_bind(value: str, where: str, findings: Findings) -> None:
    v = re.sub(r"^verbose,", "", value.lower())
    if v.startswith(("map_gpu:", "mask_gpu:", "per_task:", "single:")) or v in ("closest", "none"):
        if v.startswith("mask_gpu:"):
            findings.warn("gpu-bind-mask", f"{where}: --gpu-bind=mask_gpu is not modelled: the plan assumes each "
                          "task sees all the node's GPUs")
        if v == "closest":
            findings.warn("gpu-bind-closest", f"{where}: --gpu-bind=closest shows each task the GPUs of its NUMA "
                          "domain, which depends on the node; the plan assumes all GPUs are visible")
        if v.startswith("per_task:") and not v.split(":", 1)[1].isdigit():
            findings.error("bad-value", f"{where}: --gpu-bind={value!r}: per_task wants a count")
        if v.startswith("map_gpu:") and not all(x.split("*")[0].isdigit()
                                                 for x in v.split(":", 1)[1].split(",") if x):
            findings.error("bad-value", f"{where}: --gpu-bind={value!r}: map_gpu wants GPU indices")
        return
    findings.error("bad-value", f"{where}: --gpu-bind={value!r} is not a GPU binding Slurm knows "
                   "(closest, map_gpu:, mask_gpu:, per_task:, single:, none)")


def time_minutes(value: str) -> float | None:
    """A Slurm time (man sbatch: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
    days-hours:minutes:seconds) in minutes; None when it is none of those."""
    v = value.strip()
    if v.upper() in ("UNLIMITED", "INFINITE"):
        return float("inf")
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?", v)
    if not m:
        return None
    d, a, b, c = m.groups()
    if d is not None:
        return int(d) * 1440 + int(a) * 60 + int(b or 0) + int(c or 0) / 60
    if c is not None:
        return int(a) * 60 + int(b) + int(c) / 60
    return int(a) + int(b or 0) / 60


def gpu_view(job: Job, local_rank: int, tasks_on_node: int, gpus_on_node: int,
             findings: Findings) -> list[str]:
    """The GPU ids one task sees, as Slurm shows them (seen on the test cluster): all of the node's without
    binding; its own share with --gpus-per-task; the mapped ones with --gpu-bind=map_gpu."""
    everything = [str(i) for i in range(gpus_on_node)]
    bind = re.sub(r"^verbose,", "", (job.gpu_bind or "").lower())
    if bind.startswith("map_gpu:"):
        ids = [x for x in bind.split(":", 1)[1].split(",") if x]
        entry = ids[local_rank % len(ids)]
        return [entry.split("*")[0]]
    if bind.startswith("per_task:"):
        n = int(bind.split(":", 1)[1])
        return everything[local_rank * n:(local_rank + 1) * n]
    if bind in ("", "none") and job.gpus_per_task and bind != "none":
        g = job.gpus_per_task
        return everything[local_rank * g:(local_rank + 1) * g]
    return everything


def allocation_tasks(job: Job, findings: Findings) -> tuple[list[int] | None, int]:
    """What the allocation holds on each node, in tasks (None: Slurm decides by free cores), the job's task count
    (which srun inherits, as SLURM_NTASKS or, without -n, one per node). Measured with slurm-wlm 22.05 on the test
    cluster (tests/test_placement_slurm.py): --ntasks-per-node=k reserves k tasks' cores on every node and
    --ntasks=n then runs n of them; without it -n 6 -N 3 got 4,1,1 and -n 6 -N 2 -c 10 got 4,2."""
    n, k, cap = job.ntasks, job.ntasks_per_node, node_cap(job)
    nodes = job.nodes
    if nodes is None:
        if n and k:
            nodes = -(-n // k)
        elif n and not k and cap and n > cap:
            nodes = -(-n // cap)
        else:
            nodes = 1
        if n and not k:
            findings.warn("nodes-missing", f"--nodes is not given: Slurm picks the node count for --ntasks={n}; "
                          f"assuming {nodes} node(s); add --nodes={nodes}")
        job.nodes = nodes
    if k:
        total = n if n is not None else nodes * k
        if total > nodes * k:
            findings.error("ntasks-mismatch",
                           f"--ntasks={total} exceeds --nodes={nodes} x --ntasks-per-node={k} = {nodes * k}: sbatch "
                           "refuses it ('Requested node configuration is not available'); set "
                           f"--ntasks={nodes * k} or drop --ntasks")
            total = nodes * k
        # with --ntasks the allocation holds the cores of those n tasks only, at most k a node, on at most n nodes
        # (measured: -N 1 -n 1 --ntasks-per-node 2 -c 1 refused srun -n 2, 'More processors requested than
        # permitted'; -N 2 -n 1 --ntasks-per-node 1 -c 10 ran srun -n 4 on its one node)
        return spread(total, [k] * min(nodes, total)), total
    if n is None:  # one task per node, and srun inherits that count like a -n (srun -N 1 in -N 2 was refused)
        return [1] * nodes, nodes
    if n < nodes:
        findings.error("ntasks-below-nodes", f"--ntasks={n} is below --nodes={nodes}: every node needs a task; "
                       f"use --nodes={n}")
        job.nodes = n
        return [1] * n, n
    if nodes == 1 or n == nodes:
        return [n // nodes] * nodes, n
    if cap and n == nodes * cap:
        return [cap] * nodes, n  # full nodes: no other packing fits
    return None, n


def spread(ntasks: int, caps: list[int]) -> list[int]:
    """srun's default block distribution over the allocation: one task per node per round, a node taking no more
    than it holds (srun -n 5 in 4(x3) gave 2,2,1; -n 4 in 2(x3) gave 2,1,1)."""
    counts = [0] * len(caps)
    while sum(counts) < min(ntasks, sum(caps)):
        for i, c in enumerate(caps):
            if counts[i] < c and sum(counts) < ntasks:
                counts[i] += 1
    return counts


def packing(ntasks: int, nodes: int, cap: int | None) -> list[int]:
    """One placement of free-core packing: the first nodes filled, one task left for each other node (what idle
    nodes gave: -n 6 -N 3 -> 4,1,1; -n 9 -N 3 -> 7,1,1)."""
    counts, left = [], ntasks
    for i in range(nodes):
        take = max(1, min(cap or ntasks, left - (nodes - i - 1)))
        counts.append(take)
        left -= take
    return counts


def job_tasks_per_node(job: Job, findings: Findings) -> list[int]:
    """Tasks on each node of the trainer's step, as Slurm places them: the allocation's shape, then srun's
    options on the trainer's line, which override it (and srun -n K alone inherits the job's nodes)."""
    if job.tasks_per_node:  # inside an allocation: Slurm already placed them
        return list(job.tasks_per_node)
    caps, ntasks = allocation_tasks(job, findings)
    nodes = len(caps) if caps else job.nodes
    if job.srun is False:  # the batch step runs the line once: SLURM_PROCID=0, no SLURM_STEP_ID (measured)
        if ntasks > 1 or nodes > 1:
            findings.error("trainer-without-srun",
                           f"the trainer's line starts with '{job.launcher}', not srun: in a job of {ntasks} task(s) "
                           f"on {nodes} node(s) the batch script runs it once, as 1 process on the first node, not "
                           f"{ntasks}; start it with: srun python {job.trainer} ...")
        return [1]
    placed = step_tasks_per_node(job, caps, ntasks, nodes, findings)
    if (job.step_ntasks is None and job.step_nodes is None) or job.placement == "possible":  # the job's shape
        check_allocation_shape(job, caps, ntasks, findings)
    return placed


def step_tasks_per_node(job: Job, caps: list[int] | None, ntasks: int, nodes: int, findings: Findings) -> list[int]:
    """srun's placement of the trainer's step in the allocation (caps: tasks it holds per node, None: packed by
    free cores), with srun's own -N / -n / --ntasks-per-node / -c from the trainer's line."""
    k_step, m_step, j_step = job.step_ntasks, job.step_nodes, job.step_ntasks_per_node
    n_step = k_step if k_step is not None else ntasks  # srun inherits the job's task count (SLURM_NTASKS)
    # srun: "can't run K processes on M nodes, setting nnodes to K" (measured), else the job's nodes
    m_step = min(m_step, n_step) if m_step else min(nodes, n_step)
    if m_step > nodes:
        findings.error("step-nodes", f"srun -N {m_step} but the job has {nodes} node(s): srun refuses the step; "
                       f"use srun -N <= {nodes}")
        m_step = nodes
    if j_step and n_step != m_step * j_step:
        findings.warn("srun-ntasks-per-node-ignored",
                      f"srun --ntasks-per-node={j_step} does not match {n_step} task(s) on {m_step} node(s): srun "
                      "ignores it ('can't honor --ntasks-per-node', measured); drop it or use srun "
                      f"-n {m_step * j_step}")
        j_step = None
    if caps is None:
        if j_step and j_step > 1:
            findings.error("srun-ntasks-per-node-conflict",
                           f"srun --ntasks-per-node={j_step} in an allocation packed by free cores (some nodes may "
                           f"hold 1 task): Slurm then overcommits unevenly (measured: 3,2,1 for -N3 -n6 and srun "
                           f"--ntasks-per-node=2); request --ntasks-per-node={j_step} in #SBATCH")
        elif n_step == m_step:
            return [1] * m_step
        job.placement = "possible"  # go on with one packing Slurm may make (what idle nodes got)
        caps = packing(ntasks, nodes, node_cap(job))
    # the step fits its tasks in the allocation's cores; srun 22.05 does not read SLURM_CPUS_PER_TASK, so without
    # srun -c a task takes 1 core (measured: -N 1 -c 10, then srun -n 2 ran 2 tasks; -N 2 -n 6 -c 10 held 4,2
    # tasks and srun placed 3,3)
    caps = [c * (job.cpus_per_task or 1) // (job.step_cpus_per_task or 1) for c in caps[:m_step]]
    if n_step > sum(caps):
        findings.error("step-too-many-tasks",
                       f"srun would start {n_step} task(s) on {m_step} node(s) whose allocation holds "
                       f"{','.join(map(str, caps))} = {sum(caps)} of its cores: srun "
                       + ("may refuse" if job.placement == "possible" else "refuses") + " the step ('More processors "
                       f"requested than permitted', measured); use srun -n <= {sum(caps)}")
        return caps
    if j_step and any(c < j_step for c in caps):
        findings.error("srun-ntasks-per-node-conflict",
                       f"srun --ntasks-per-node={j_step} on nodes holding {','.join(map(str, caps))} task(s): Slurm "
                       "then overcommits unevenly (measured: 3,2,1 for -N3 -n6 and srun --ntasks-per-node=2); "
                       f"request --ntasks-per-node={j_step} in #SBATCH")
        job.placement = "possible"
        return packing(n_step, m_step, None)
    return [j_step] * m_step if j_step else spread(n_step, caps)


def check_allocation_shape(job: Job, caps: list[int] | None, ntasks: int, findings: Findings) -> None:
    """The #SBATCH task counts: --ntasks-per-node missing, or a maximum because --ntasks asks fewer."""
    n, k, nodes = job.ntasks, job.ntasks_per_node, job.nodes or 1
    if k and n is not None and n < nodes:
        findings.error("ntasks-below-nodes", f"--ntasks={n} is below --nodes={nodes}: srun runs on {n} node(s) "
                       f"only ('can't run {n} processes on {nodes} nodes', measured) and the others idle; use "
                       f"--nodes={n}")
    elif k and n is not None and caps and n < nodes * k:
        placed = spread(n, caps)
        if len(set(placed)) > 1:
            findings.error("ntasks-mismatch",
                           f"--ntasks={n} with --nodes={nodes} x --ntasks-per-node={k} = {nodes * k}: "
                           f"--ntasks-per-node is then a maximum and srun places {','.join(map(str, placed))} "
                           f"(measured); set --ntasks={nodes * k} or drop --ntasks")
        else:
            findings.warn("ntasks-per-node-max",
                          f"--ntasks={n} on {nodes} node(s) runs {placed[0]} task(s) per node, below "
                          f"--ntasks-per-node={k} (a maximum when --ntasks is given): SLURM_NTASKS_PER_NODE={k} then "
                          f"misleads the page's code; set --ntasks-per-node={placed[0]}")
    if k:
        return
    if n is None or n == nodes:
        findings.warn("ntasks-per-node-missing",
                      "--ntasks-per-node is not given: Slurm runs 1 task per node (pure model parallel inside "
                      "each node) and SLURM_NTASKS_PER_NODE does not exist for the page's code; add "
                      "--ntasks-per-node=1 to say so")
    elif nodes == 1 or caps:
        findings.warn("ntasks-per-node-missing",
                      f"--ntasks-per-node is not given: SLURM_NTASKS_PER_NODE will not exist for the page's code; "
                      f"add --ntasks-per-node={n // nodes}")
    elif n % nodes:
        findings.error("ntasks-per-node-missing",
                       f"--ntasks={n} on --nodes={nodes} cannot be even ({n} tasks don't split over {nodes} nodes) "
                       f"and, without --ntasks-per-node, Slurm packs them by free cores (-n 6 -N 3 gave 4,1,1 on the "
                       f"test cluster): nodes get different nb_part; use --ntasks a multiple of {nodes} with "
                       f"--ntasks-per-node")
    else:
        findings.error("ntasks-per-node-missing",
                       f"--ntasks={n} on --nodes={nodes} without --ntasks-per-node may pack unevenly: Slurm packs "
                       f"tasks by free cores (-n 6 -N 3 gave 4,1,1 on the test cluster), so nodes can get "
                       f"different nb_part; add --ntasks-per-node={n // nodes}")


def step_gpus_per_node(job: Job, tasks_per_node: list[int], findings: Findings) -> int | None:
    """GPUs per node from --gres, --gpus-per-node, --gpus-per-task and --gpus, with the pairs Slurm refuses or
    resolves against the user. Measured on slurm-wlm 22.05 (tests/test_sbatch_rules.py): --gres=gpu:2 with
    --gpus-per-node=4 is accepted with the job keeping gpu:2 and every srun step then fails; --gres with a
    --gpus-per-task that doesn't multiply to it, or a --gpus that isn't --gres x nodes, is refused at submission.
    SchedMD's testsuite (testsuite/expect/test39.4) expects the same refusals from later releases."""
    gres, gpn, gpt, total = job.gres_gpus, job.gpus_per_node, job.gpus_per_task, job.gpus_total
    nodes, busiest = len(tasks_per_node), max(tasks_per_node)
    if gres and gpn and gres != gpn:
        findings.error("gpu-request-conflict",
                       f"--gres=gpu:{gres} and --gpus-per-node={gpn} both set the GPUs per node: Slurm 22.05 accepts "
                       f"the job with --gres's {gres} and every srun step then fails ('Step requested "
                       f"gres_per_node=gpu:{gpn} is more than the job's gres_per_node=gpu:{gres}', measured in "
                       f"either order); keep one of them")
    per_node = gres or gpn
    if per_node and gpt and gpt * busiest != per_node:
        findings.error("gpu-request-conflict",
                       f"--gpus-per-task={gpt} x {busiest} task(s) per node = {gpt * busiest} GPUs disagrees with "
                       f"{'--gres=gpu:' if gres else '--gpus-per-node='}{per_node}: sbatch refuses the job (22.05: "
                       f"'Requested node configuration is not available'); keep one of them")
    if per_node and total and total != per_node * nodes:
        findings.error("gpu-request-conflict",
                       f"--gpus={total} disagrees with {'--gres=gpu:' if gres else '--gpus-per-node='}{per_node} "
                       f"x {nodes} node(s) = {per_node * nodes}: sbatch refuses the job ('--gpus is not multiple of "
                       f"--gres=gpu/--gpus-per-node', measured for --gres=gpu:2 --gpus=3); drop --gpus")
    if per_node is None and gpt:
        per_node = gpt * busiest
    if per_node is None and total:
        if nodes > 1:
            even = total // nodes if total % nodes == 0 else None
            findings.error("gpus-total-multinode",
                           f"--gpus={total} is a total for {nodes} nodes: Slurm does not promise an even split "
                           f"(measured: --gpus=6 on 2 nodes gave 4 and 2 GPUs), so nb_part can differ from node to "
                           f"node; " + (f"use --gpus-per-node={even} or --gres=gpu:{even}" if even else
                                        f"use --gres=gpu:N with N x {nodes} GPUs in all"))
            per_node = max(1, total // nodes)
        else:
            per_node = total
    return per_node


# ---- II.3 Jean Zay: node types, GPU memory, cores, time limits, accounts, modules ------------------------------------

# Jean Zay's GPU nodes, by partition and by constraint (-C): GPUs and cores per node. Memory is granted per
# reserved core there, so --cpus-per-task also sizes the task's host memory.
NODE_TYPES = {
    "v100-4": dict(gpus=4, cores=40, label="4-GPU V100 nodes (gpu_p13, 10 cores per GPU)"),
    "v100-8": dict(gpus=8, cores=24, label="8-GPU V100 nodes (gpu_p2, 3 cores per GPU)"),
    "a100": dict(gpus=8, cores=64, label="8-GPU A100 nodes (-C a100, 8 cores per GPU)"),
    "h100": dict(gpus=4, cores=96, label="4-GPU H100 nodes (-C h100, 24 cores per GPU)"),
}

PARTITION_TYPES = {"gpu_p13": "v100-4", "gpu_p1": "v100-4", "gpu_p3": "v100-4", "gpu_p2": "v100-8",
                   "gpu_p2s": "v100-8", "gpu_p2l": "v100-8", "gpu_p5": "a100", "gpu_p6": "h100"}
CONSTRAINT_TYPES = {"a100": "a100", "h100": "h100"}

# Memory of one GPU, GiB as nvidia-smi reports the boards' totals (V100-SXM2-16GB 16160 MiB, -32GB 32510 MiB,
# A100-SXM4-40GB 40960 MiB, A100-SXM4-80GB 81920 MiB, H100 80GB HBM3 81559 MiB). Which board a request gets, from
# IDRIS's "Jean Zay: GPU Slurm partitions" page (idris.fr/en/docs/jean-zay/slurm/slurm_partitions_gpu):
# -C v100-16g (ex gpu_p3) and -C v100-32g (ex gpu_p1) on gpu_p13's 4-GPU nodes, which mix both (so gpu_p13
# without -C may get 16 GB: assume the smaller); gpu_p2 8 x V100 32 GB. The A100s, from the directive block of
# IDRIS's job-script template as users' Jean Zay scripts copy it ("--partition=gpu_p4 ... (40GB A100 GPU)",
# "-C a100 ... gpu_p5 partition (80GB A100 GPU)"): -C a100 means 80 GB, the 40 GB ones are -p gpu_p4.
# -C h100 is gpu_p6's 4 x H100 80 GB (DESIGN.md's Jean Zay facts).
GPU_MEMORY_GIB = {"v100-16g": 16160 / 1024, "v100-32g": 32510 / 1024, "gpu_p2": 32510 / 1024,
                  "gpu_p4": 40960 / 1024, "a100": 81920 / 1024, "h100": 81559 / 1024}

V100_PARTITIONS = ("gpu_p13", "gpu_p1", "gpu_p3", "gpu_p2", "gpu_p2s", "gpu_p2l")
PARTITION_MEMORY = {"gpu_p13": "v100-16g", "gpu_p3": "v100-16g", "gpu_p1": "v100-32g", "gpu_p2": "gpu_p2",
                    "gpu_p2s": "gpu_p2", "gpu_p2l": "gpu_p2", "gpu_p4": "gpu_p4", "gpu_p5": "a100", "gpu_p6": "h100"}

# Jean Zay's time limits. IDRIS, "GPU Partitions" (http://www.idris.fr/en/docs/jean-zay/slurm/slurm_partitions_gpu):
# "By default, the execution time is 10 minutes and cannot exceed 100 hours (... see the QoS)". The QoS hours
# (qos_gpu-dev 2 h, qos_gpu-t3 20 h and the default, qos_gpu-t4 100 h; A100 without t4) are from the same page's
# QoS table as DESIGN.md records it; the QoS table itself was not reachable from this session.
DEFAULT_TIME_MINUTES = 10

QOS_HOURS = {"dev": 2, "t3": 20, "t4": 100}
QOS_WITHOUT_T4 = {"a100"}
ACCOUNT_ARCH = {"v100-4": "v100", "v100-8": "v100", "a100": "a100", "h100": "h100"}
ARCH_REQUEST = {"v100": "-C v100-32g (or no -C: gpu_p13)", "a100": "-C a100", "h100": "-C h100"}


def node_type(job: Job) -> str | None:
    for c in re.split(r"[&|,\[\]*]", job.constraint or ""):
        if c.strip().lower() in CONSTRAINT_TYPES:
            return CONSTRAINT_TYPES[c.strip().lower()]
    if job.partition in PARTITION_TYPES:
        return PARTITION_TYPES[job.partition]
    if job.partition is None and (job.constraint or "").lower().startswith("v100"):
        return "v100-4"  # -C v100-16g / v100-32g select the default partition's 4-GPU nodes
    return None  # unknown nodes: their sizes are not checked


def node_cap(job: Job) -> int | None:
    """Tasks of --cpus-per-task cores that fit on one node, when the node type is known."""
    ntype = node_type(job)
    return NODE_TYPES[ntype]["cores"] // (job.cpus_per_task or 1) if ntype else None


def gpu_memory(job: "Job") -> tuple[float | None, str]:
    """GiB of one of the job's GPUs and where that came from: --gpu-mem, else the GPUs of this allocation
    (nvidia-smi), else the constraint or partition."""
    if job.gpu_mem is not None:
        return job.gpu_mem, f"--gpu-mem {job.gpu_mem:g}"
    if job.gpu_mem_seen is not None:
        return job.gpu_mem_seen, "the allocation's GPUs (nvidia-smi)"
    for c in re.split(r"[&|,\[\]*]", (job.constraint or "").lower()):
        if c.strip() in GPU_MEMORY_GIB:
            return GPU_MEMORY_GIB[c.strip()], f"-C {c.strip()}"
    kind = PARTITION_MEMORY.get(job.partition or "")
    if kind:
        return GPU_MEMORY_GIB[kind], f"partition {job.partition}" + (
            ", which mixes 16 and 32 GB V100s: assuming 16 GB" if job.partition == "gpu_p13" else "")
    return None, "unknown"


def is_v100(job: "Job") -> bool:
    return "v100" in (job.constraint or "").lower() or job.partition in V100_PARTITIONS


def check_cpus(job: Job, nb_part: int, tasks_per_node: list[int], findings: Findings) -> None:
    ntype = node_type(job)
    per_gpu = NODE_TYPES[ntype]["cores"] // NODE_TYPES[ntype]["gpus"] if ntype else None
    want = per_gpu * nb_part if per_gpu else None
    if job.cpus_per_task is None:
        findings.warn("cpus-per-task-missing",
                      "--cpus-per-task is not given: each task gets 1 core for itself and its DataLoader workers "
                      "(and on Jean Zay only 1 core's share of memory); "
                      + (f"add --cpus-per-task={want} ({per_gpu} per GPU x {nb_part} GPUs)" if want
                         else "add --cpus-per-task=<cores per GPU x GPUs per task>"))
    elif want and job.cpus_per_task < want:
        findings.warn("cpus-per-task-small",
                      f"--cpus-per-task={job.cpus_per_task} is below the {want} cores that go with {nb_part} GPU(s) "
                      f"on {NODE_TYPES[ntype]['label']}; memory is granted per reserved core there: "
                      f"use --cpus-per-task={want}")
    elif job.cpus_per_task < 2:
        findings.warn("cpus-per-task-small", f"--cpus-per-task={job.cpus_per_task} leaves no core for DataLoader "
                      "workers; use at least 2")
    if ntype and job.cpus_per_task:
        cores = NODE_TYPES[ntype]["cores"]
        busiest = max(tasks_per_node)
        if job.cpus_per_task * busiest > cores:
            fit = max(1, cores // busiest)
            findings.error("cpus-exceed-node",
                           f"{busiest} task(s) x --cpus-per-task={job.cpus_per_task} = "
                           f"{busiest * job.cpus_per_task} cores, but {NODE_TYPES[ntype]['label']} have {cores}; "
                           f"use --cpus-per-task <= {fit}")
    if (job.hint or "").lower() != "nomultithread":
        findings.warn("hint-missing", "--hint=nomultithread is not set: tasks get hyperthreads instead of "
                      "physical cores (Jean Zay's advice for GPU jobs is --hint=nomultithread)")


def check_time(job: Job, findings: Findings) -> None:
    if job.time == "allocated":  # inside the allocation the limit is already granted
        return
    if job.time is None:
        findings.warn("time-missing", f"--time is not given: the partition's default applies, {DEFAULT_TIME_MINUTES} "
                      "minutes on Jean Zay's GPU partitions; add --time=HH:MM:SS, e.g. --time=02:00:00")
        return
    minutes = time_minutes(job.time)
    if minutes is None:
        findings.error("bad-time", f"--time={job.time!r} is not a Slurm time (MM, HH:MM:SS or D-HH:MM:SS)")
        return
    m = re.search(r"(dev|t3|t4)$", (job.qos or "t3").lower())
    if not m or node_type(job) is None and job.partition is not None:
        return  # a QoS or partition that isn't Jean Zay's
    qos, arch = m.group(1), ACCOUNT_ARCH.get(node_type(job) or "v100-4")
    limit = QOS_HOURS[qos]
    if minutes > limit * 60:
        longer = [q for q, h in QOS_HOURS.items() if h * 60 >= minutes and not (q == "t4" and arch in QOS_WITHOUT_T4)]
        name = job.qos or "the default QoS (t3)"
        findings.error("time-over-qos",
                       f"--time={job.time} ({minutes / 60:.1f} h) is over the {limit} h of {name}: Slurm won't run "
                       f"the job; " + (f"add --qos=qos_gpu{'' if arch == 'v100' else '_' + arch}-{longer[0]}"
                                       f" (up to {QOS_HOURS[longer[0]]} h)" if longer else
                                       f"use --time <= {max(h for q, h in QOS_HOURS.items() if not (q == 't4' and arch in QOS_WITHOUT_T4))}:00:00"
                                       " and resume from a checkpoint"))


def check_jean_zay(job: Job, findings: Findings) -> None:
    """The account's hours and the H100 modules. IDRIS, "GPU Partitions": a project spends V100, A100 or H100
    hours through <project>@v100, @a100 or @h100; the H100 nodes' software stack is loaded with
    `module load arch/h100` before the other modules (IDRIS's H100 examples and users' Jean Zay scripts)."""
    arch = ACCOUNT_ARCH.get(node_type(job) or "v100-4")
    suffix = (job.account or "").rpartition("@")[2].lower() if "@" in (job.account or "") else None
    if suffix in ARCH_REQUEST and arch and suffix != arch:
        findings.error("account-mismatch",
                       f"--account={job.account} spends {suffix.upper()} hours but the job asks for {arch.upper()} "
                       f"nodes ({'-C ' + job.constraint if job.constraint else '-p ' + job.partition if job.partition else 'no -C: the default gpu_p13'}); "
                       f"use --account=<project>@{arch}, or {ARCH_REQUEST[suffix]} for the nodes of that account")
    if node_type(job) == "h100" and job.torch_module:
        mods = job.modules
        before = mods[:mods.index(job.torch_module)] if job.torch_module in mods else mods
        if not any(m.startswith("arch/h100") for m in before):
            findings.error("arch-h100-missing",
                           f"-C h100 with 'module load {job.torch_module}' but no 'module load arch/h100' before it: "
                           "on Jean Zay the H100 nodes need the modules built for them; add 'module load arch/h100' "
                           "before the pytorch-gpu line")


def check_engine(job: Job, t: Training, findings: Findings) -> None:
    """The script's `module load pytorch-gpu/py3/X` against what its trainer line asks for (TORCH_FEATURES)."""
    version = torch_version_of(job.torch_module)
    if not version:
        return
    for line in torch_refusals(f"{version[0]}.{version[1]}", t):
        line = line.replace(f"this is torch {version[0]}.{version[1]}", f"the script loads {job.torch_module}")
        if t.layout == "replica":
            findings.error("engine-unavailable", line)
        else:
            findings.error("torch-too-old", line)


# ---- II.4 Reading a job script as sbatch and srun do -----------------------------------------------------------------

def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, line) with backslash continuations of command lines joined."""
    logical: list[tuple[int, str]] = []
    pending, start = "", 0
    for lineno, line in enumerate(text.splitlines(), 1):
        if pending or (not line.lstrip().startswith("#") and line.rstrip().endswith("\\")):
            if not pending:
                start = lineno
            pending += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
            if not line.rstrip().endswith("\\"):
                logical.append((start, pending))
                pending = ""
            continue
        logical.append((lineno, line))
    if pending:
        logical.append((start, pending))
    return logical


def read_directive(line: str, where: str, job: Job, findings: Findings) -> None:
    """One '#SBATCH' line: sbatch 22.05 reads what follows the 7 letters, with or without a space
    ('#SBATCH-N 2' and '#SBATCH<tab>-N 2' both gave 2 nodes on the test cluster), up to a '#' comment."""
    try:
        tokens = shlex.split(line[len("#SBATCH"):], comments=True)
    except ValueError as exc:
        findings.error("bad-directive", f"{where}: cannot parse '{line.strip()}' ({exc})")
        return
    if tokens[:1] in (["hetjob"], ["packjob"]):
        findings.warn("hetjob", f"{where}: '{line.strip()}' starts a heterogeneous job's next component; the plan "
                      "covers the options of all components as one job: check each component on its own")
        return
    options, _ = parse_options(tokens, where, findings)
    for name, value in options:
        apply_option(job, name, value, where, findings)


def training_from_argv(argv: list[str], t: Training, where: str, findings: Findings) -> None:
    """The trainer's own arguments on its srun line (only the ones the plan depends on)."""
    names = {"--nlayers": "nlayers", "--chunks": "chunks", "--batch-size": "batch_size", "--nb-part": "nb_part",
             "--engine": "engine", "--pp": "pp", "--schedule": "schedule",
             "--virtual-stages": "virtual_stages", "--precision": "precision"}
    model = {"--d-model": "d_model", "--n-head": "n_head", "--d-hid": "d_hid", "--seq-len": "seq_len",
             "--vocab-size": "vocab_size", "--dropout": "dropout"}
    names.update(model)
    i = 0
    while i < len(argv):
        tok = argv[i]
        name, eq, value = tok.partition("=")
        i += 1
        if tok in ("--activation-checkpointing", "--zero"):  # flags: no value
            setattr(t, tok[2:].replace("-", "_"), True)
            continue
        if name == "--devices":
            value, i = (value, i) if eq else (argv[i] if i < len(argv) else "", i + 1)
            t.devices = parse_devices(value, where, findings)
            continue
        if name not in names:
            continue
        if not eq:
            if i >= len(argv):
                findings.error("bad-value", f"{where}: {name} has no value")
                return
            value, i = argv[i], i + 1
        attr = names[name]
        if "$" in value:
            t.unchecked.append(f"{where}: {name} {value}")
            continue
        if attr in ("engine", "schedule", "precision"):
            if attr == "precision" and value not in PRECISIONS:
                findings.error("bad-value", f"{where}: --precision {value!r} is not one of {', '.join(PRECISIONS)}")
                continue
            setattr(t, attr, value)
            continue
        if attr == "dropout":
            try:
                t.model["dropout"] = float(value)
            except ValueError:
                findings.error("bad-value", f"{where}: --dropout {value!r} is not a number")
            continue
        try:
            number = int(value)
        except ValueError:
            findings.error("bad-value", f"{where}: {name} {value!r} is not an integer")
            continue
        if below_one({name: number}):
            findings.error("bad-value", f"{where}: {below_one({name: number})}")
            continue
        if name in model:
            t.model[attr] = number
        else:
            setattr(t, attr, number)


def read_trainer_line(line: str, script: str, where: str, job: Job, training: Training, findings: Findings) -> None:
    """The trainer's line: srun's options (the step's shape), the layout its script runs, its arguments."""
    try:
        argv = shlex.split(line, comments=True)
    except ValueError as exc:
        findings.error("bad-command", f"{where}: cannot parse the trainer's line ({exc})")
        return
    cut = next((i for i, a in enumerate(argv) if a.endswith(script)), None)
    if cut is None:
        return
    training.layout = TRAINERS[script]
    launcher = argv[:cut]
    at = next((i for i, a in enumerate(launcher) if os.path.basename(a) == "srun"), None)
    job.srun = at is not None
    job.launcher = " ".join(launcher) or "(nothing)"
    job.trainer = script
    if at is not None:
        options, _command = parse_options(launcher[at + 1:], where, findings, prog="srun")
        for name, value in options:
            apply_srun_option(job, name, value, where, findings)
    other = [a.partition("=")[0] for a in argv[cut + 1:] if a.partition("=")[0] in NOT_ARGS[training.layout]]
    if other:
        fix = ("use bench_stage.py for the stage layout" if training.layout == "replica"
               else "use bench_ddp_transformer.py for the replica layout")
        findings.error("bad-layout", f"{where}: {script} has no {', '.join(other)} (its argparse refuses the line); "
                       f"{fix}")
    training_from_argv([a for a in argv[cut + 1:] if a.partition("=")[0] != "--layout"], training, where, findings)


def read_sbatch(path: str | os.PathLike) -> tuple[Job, Training, Findings]:
    """Read the job script the way sbatch 22.05 does (measured on the test cluster, tests/test_sbatch_rules.py):
    the header is every line up to the first one that is neither blank nor a comment (an indented '# ...' is a
    comment); in it, lines starting with '#SBATCH' in column 0 (case matters) are directives, and so are
    '#PBS' and '#BSUB' lines, translated, unless --ignore-pbs is given. Then the trainer's srun line."""
    try:
        text = Path(path).read_bytes().decode("utf-8", errors="replace")  # bytes: keep any \r\n to see it
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    job, training, findings = Job(source=str(path)), Training(), Findings()
    name = Path(path).name
    if "\r\n" in text:
        findings.error("dos-line-breaks", f"{name}: the file has DOS line breaks (\\r\\n): sbatch refuses it "
                       f"('Batch script contains DOS line breaks'); convert it: dos2unix {name}")
        text = text.replace("\r\n", "\n")
    if not text.startswith("#!"):
        findings.error("no-shebang", f"{name}:1: the first line is not '#!' and an interpreter: sbatch refuses the "
                       "file ('This does not look like a batch script'); make line 1 '#!/bin/bash'")
    in_header, foreign = True, []
    for lineno, line in logical_lines(text):
        where = f"{name}:{lineno}"
        stripped = line.strip()
        if line.startswith("#SBATCH"):
            if in_header:
                read_directive(line, where, job, findings)
            else:
                findings.warn("ignored-directive", f"{where}: '{stripped}' comes after the first command; "
                              "sbatch ignores it: move it above the first command")
            continue
        if in_header and line.startswith(("#PBS", "#BSUB")):
            foreign.append((where, stripped))
            continue
        if re.match(r"#\s*SBATCH\s*-", stripped, re.I):  # a directive gone wrong, not a comment that says sbatch
            findings.warn("ignored-directive", f"{where}: '{stripped}' is not read by sbatch (a directive is "
                          "'#SBATCH', in capitals, from column 0): write it as '#SBATCH ...' at the start of the line")
            continue
        if not stripped or stripped.startswith("#"):
            continue
        in_header = False
        m = re.match(r"module\s+load\s+(.*)", stripped)
        if m:
            job.modules += m.group(1).split()
            for mod in m.group(1).split():
                if torch_version_of(mod):
                    job.torch_module = mod
        script = next((name for name in TRAINERS if name in stripped), None)
        if script and job.srun is None:
            read_trainer_line(stripped, script, where, job, training, findings)
    if foreign and not job.ignore_pbs:
        where, line = foreign[0]
        findings.error("pbs-directive", f"{where}: sbatch also reads '{line}' ({len(foreign)} #PBS/#BSUB line(s); "
                       "measured: '#PBS -l nodes=2' gave a 2-node job), which this plan does not model; write it as "
                       "#SBATCH, or add '#SBATCH --ignore-pbs'")
    if job.srun is None:
        findings.warn("no-trainer-line", f"{name}: no 'srun ... bench_ddp_transformer.py' (or bench_stage.py) line "
                      "found; the training arguments were taken from the defaults")
    return job, training, findings


# ---- II.5 Checking a job: every task's plan, then the whole ----------------------------------------------------------

def check_job(job: Job, training: Training) -> Report:
    """Plan every task of a request and check the whole."""
    findings = Findings()
    tasks_per_node = job_tasks_per_node(job, findings)
    gpn = step_gpus_per_node(job, tasks_per_node, findings)
    job.gpus_per_node = gpn
    if training.nlayers is None:  # the trainer's own default for what it will run on
        training.nlayers = (GPU_DEFAULTS if gpn else CPU_DEFAULTS)["nlayers"]
    check_gpus_fit(job, gpn, tasks_per_node, findings)
    stage = training.layout == "stage"
    if stage:
        training.nb_part = 1  # a task per GPU
    check_divisible(job, gpn, tasks_per_node, training, findings)
    plans: list[TaskPlan] = []
    for node, tasks in enumerate(tasks_per_node):
        for local in range(tasks):
            visible = gpu_view(job, local, tasks, gpn, findings) if gpn else []
            plans.append(plan_task(len(plans), node, local, tasks, visible, gpn, training.nlayers,
                                   training.nb_part, findings, training.devices))
    _dedupe(findings)
    report = Report(job, training, plans, findings)
    check_node_usage(report)
    nb_parts = [p.nb_part for p in plans if p.nb_part]
    if stage:
        check_training(check_stage(len(plans), tasks_per_node, gpn, training, findings), training, findings)
        if gpn and training.pp >= 1 and len(plans) % training.pp == 0:  # the fit of each pipeline's tasks
            line = check_memory(job, training, training.pp, len(plans) // training.pp, gpn, findings)
            report.notes += [line] if line else []
    elif nb_parts:
        check_training(min(nb_parts), training, findings, cpu=not gpn)
        if gpn:
            check_bubble(min(nb_parts), training, findings)
        line = check_memory(job, training, min(nb_parts), len(plans), max(tasks_per_node), findings) if gpn else None
        report.notes += [line] if line else []
    check_engine(job, training, findings)
    check_gpu_cgroups(job, tasks_per_node, gpn, findings)
    check_cpus(job, min(nb_parts) if nb_parts else 1, tasks_per_node, findings)
    check_time(job, findings)
    check_jean_zay(job, findings)
    note_page_indexing(report)
    if job.placement == "possible":
        report.notes.append(f"placement: Slurm decides by free cores; the table shows one placement it may make "
                            f"({','.join(map(str, tasks_per_node))} task(s) per node)")
    return report


def check_gpus_fit(job: Job, gpn: int | None, tasks_per_node: list[int], findings: Findings) -> None:
    """A GPU request at all, one the node can hold, tasks per node that agree, GPUs that divide among them."""
    ntype = node_type(job)
    if not gpn:
        findings.error("no-gpus", "the job requests no GPU; add --gres=gpu:N (GPUs per node, e.g. --gres=gpu:4) or "
                       "--gpus-per-node=N")
    elif ntype and gpn > NODE_TYPES[ntype]["gpus"]:
        findings.error("gpus-exceed-node", f"{gpn} GPUs per node requested but {NODE_TYPES[ntype]['label']} have "
                       f"{NODE_TYPES[ntype]['gpus']}; use --gres=gpu:{NODE_TYPES[ntype]['gpus']} or another "
                       f"partition (-p gpu_p2 / -C a100 for 8 GPUs)")
    reported = any(f.level == "error" and f.code in ("ntasks-mismatch", "ntasks-per-node-missing") for f in findings)
    if len(set(tasks_per_node)) > 1 and job.placement == "exact" and not reported:
        nbs = {n: (gpn or 0) // n for n in tasks_per_node}
        findings.error("uneven-tasks-per-node",
                       f"tasks per node differ ({','.join(map(str, tasks_per_node))}): nodes get nb_part "
                       f"{_choices(nbs.values())}, so replicas differ in layout and speed (the page's code even "
                       f"lacks SLURM_NTASKS_PER_NODE); use --nodes={len(tasks_per_node)} with the same "
                       f"--ntasks-per-node on every node")


def check_divisible(job: Job, gpn: int | None, tasks_per_node: list[int], training: Training,
                    findings: Findings) -> None:
    bound = bool(job.gpus_per_task) or re.sub(r"^verbose,", "", (job.gpu_bind or "none").lower()) != "none"
    if not gpn or bound or training.nb_part:
        return
    for tasks in sorted(set(tasks_per_node)):
        if tasks <= gpn and gpn % tasks:
            nb = gpn // tasks
            idle = list(range(nb * tasks, gpn))
            findings.error("gpus-not-divisible",
                           f"{gpn} GPUs per node are not divisible by {tasks} tasks per node: nb_part = "
                           f"{gpn} // {tasks} = {nb} and {len(idle)} GPU(s) ({','.join(map(str, idle))}) stay "
                           f"idle; use --ntasks-per-node in {_choices(divisors(gpn))}")
            return


def check_node_usage(report: Report) -> None:
    """Two tasks of a node on one GPU, and GPUs nobody uses."""
    by_node: dict[int, list[TaskPlan]] = {}
    for p in report.tasks:
        by_node.setdefault(p.node, []).append(p)
    gpn = report.job.gpus_per_node
    for node, plans in sorted(by_node.items()):
        owners: dict[str, list[int]] = {}
        for p in plans:
            for g in dict.fromkeys(p.gpu_ids):  # a task's own parts may share a GPU (--devices 0,0)
                owners.setdefault(g, []).append(p.rank)
        shared = {g: r for g, r in owners.items() if len(r) > 1}
        if shared:
            g, r = sorted(shared.items())[0]
            fix = ("give each task its own GPUs, e.g. --gpu-bind=map_gpu:" + ",".join(
                       str(i * (gpn or 1) // len(plans)) for i in range(len(plans)))
                   if "map_gpu" in (report.job.gpu_bind or "") else
                   f"use --nb-part <= {(gpn or 0) // len(plans)} or fewer tasks per node")
            report.findings.error("gpu-shared",
                                  f"node {node}: GPU {g} is used by tasks {', '.join(map(str, r))} "
                                  f"({len(shared)} GPU(s) shared in all); {fix}")
        if gpn and any(p.gpu_ids for p in plans) and not any(f.code == "gpus-not-divisible"
                                                             for f in report.findings):
            idle = [str(i) for i in range(gpn) if str(i) not in owners]
            if idle:
                report.findings.warn("gpus-idle",
                                     f"node {node}: {len(idle)} of {gpn} GPU(s) stay idle ({','.join(idle)}) "
                                     f"({len(plans)} task(s) x nb_part {plans[0].nb_part}); choose "
                                     f"--ntasks-per-node in {_choices(divisors(gpn))} without --nb-part")
                if len(by_node) > 1 and all(len(v) == len(plans) for v in by_node.values()):
                    break  # same layout everywhere: once is enough
        if shared and len(by_node) > 1:
            break
    _dedupe(report.findings)


def check_gpu_cgroups(job: Job, tasks_per_node: list[int], gpn: int | None, findings: Findings) -> None:
    if job.gpus_per_task and max(tasks_per_node) > 1:
        findings.warn("gpus-per-task-cgroup",
                      f"--gpus-per-task={job.gpus_per_task}: each task's GPUs sit in their own device cgroup, so "
                      f"NCCL in one task no longer sees the node's other {(gpn or 0) - job.gpus_per_task} GPU(s) and "
                      f"cannot detect NVLink between the {max(tasks_per_node)} tasks of a node (it falls back to "
                      f"slower paths; NVIDIA/nccl issue 1066); use the page's form: --gres=gpu:{gpn} "
                      f"--ntasks-per-node={max(tasks_per_node)}")


def note_page_indexing(report: Report) -> None:
    """Per-task GPU binding breaks the page's own indexing; say what it would have done."""
    for p in report.tasks:
        if not p.bound or p.tasks_on_node < 2:
            continue
        visible = p.visible
        nb, first, last = page_indexing(p.local_rank, p.tasks_on_node, visible)
        if nb < 1 or last >= visible or nb != p.nb_part:
            report.notes.append(
                f"per-task GPU binding: task {p.rank} sees only {visible} GPU(s); the page's own indexing "
                f"(nb_part = device_count() // {p.tasks_on_node} = {nb}, first_part = local_rank * nb_part = "
                f"{first}) would " + ("index past device_count()" if nb < 1 or last >= visible
                                      else f"use {nb} of its {visible} GPUs")
                + "; bench_ddp_transformer.py starts at visible GPU 0 and uses them all")
            return


def _dedupe(findings: Findings) -> None:
    seen, kept = set(), []
    for f in findings:
        key = (f.level, f.code)
        if key in seen and f.code in ("more-tasks-than-gpus", "gpu-index-past-visible"):
            continue
        seen.add(key)
        kept.append(f)
    findings[:] = kept


def check_memory(job: "Job", t: "Training", nb_part: int, replicas: int, tpn: int,
                 findings: Findings) -> str | None:
    """Refuse a split whose estimated peak exceeds the GPU's memory (and bf16 on V100s, which lack it); nb_part is
    --pp in the stage layout, replicas its pipelines. Returns the estimate's line for the report when it was made."""
    gib, source = gpu_memory(job)
    v100 = is_v100(job)
    if t.precision == "bf16" and v100:
        findings.error("bf16-on-v100", "--precision bf16 on V100 GPUs: V100s have no bf16; use --precision fp16 "
                       "(autocast with a GradScaler)")
    if gib is None or nb_part < 1 or replicas < 1 or t.unchecked:
        return None  # unknown GPU, or shell variables on the line
    model = model_args(t)
    stage = t.layout == "stage"
    try:
        parts = (estimate_stage_memory(model, t, nb_part, replicas, "sm70" if v100 else "sm80",
                                       torch=torch_version_of(job.torch_module)) if stage
                 else estimate_memory(model, t, nb_part, replicas, "sm70" if v100 else "sm80"))
    except ValueError:
        return None  # chunks/batch/schedule already reported by check_training and check_stage
    worst = max(parts, key=lambda m: m.total)
    line = format_memory(parts, gib) + f" ({source})"
    shared = shared_gpu_memory(parts, t.devices)
    if shared:  # --devices 0,0: the parts on one GPU add up (one CUDA context and allocator allowance between them)
        gpu, on_it, total = shared
        line += f"; GPU {gpu} holds parts {','.join(map(str, on_it))}: {total / GIB:.2f} GiB in all"
        if total / GIB > gib:
            findings.error("does-not-fit", f"--devices {','.join(map(str, t.devices))} puts parts "
                           f"{','.join(map(str, on_it))} on GPU {gpu}: an estimated {total / GIB:.1f} GiB in all, "
                           f"but the GPU has {gib:.1f} GiB ({source}); give each part its own GPU, or a smaller "
                           f"--batch-size or --activation-checkpointing")
            return line
    if worst.total / GIB <= gib:
        if worst.total / GIB > 0.9 * gib:
            findings.warn("memory-tight", f"{worst.unit} {worst.part} ({worst.contents}) is estimated at "
                          f"{worst.total / GIB:.1f} GiB of the {gib:.1f} GiB per GPU ({source}): little headroom")
        return line
    terms = " + ".join(f"{k} {v:.2f}" for k, v in worst.breakdown().items() if v >= 0.005)
    why = (f"--schedule {t.schedule} keeps at most {worst.alive} micro-batch(es) of {worst.per_micro_batch / GIB:.2f}"
           f" GiB alive on this task" if stage else
           f"activations are {worst.alive} micro-batch(es) of {worst.per_micro_batch / GIB:.2f} GiB, all alive: with "
           f"checkpoint=\"never\" GPipe keeps every micro-batch until its backward, so more --chunks do not help")
    fixes = memory_fixes(model, t, nb_part, replicas, tpn, gib, v100, torch_version_of(job.torch_module))
    findings.error("does-not-fit",
                   f"{worst.unit} {worst.part} ({worst.contents}) needs an estimated {worst.total / GIB:.1f} GiB per "
                   f"GPU but the GPU has {gib:.1f} GiB ({source}); peak at {worst.peak_at}, GiB: {terms}; {why}. "
                   "Fixes, each estimated: " + "; ".join(fixes))
    return line


def advise(nodes: int, gpn: int, gib: float, model: dict, global_batch: int, v100: bool,
           max_chunks: int = 32) -> list[dict]:
    """Every split of `nodes` x `gpn` GPUs that fits in `gib` per GPU at this global batch, in both layouts (the
    page's replicas; bench_stage.py's pipelines with --schedule 1f1b: GPipe holds every micro-batch for the same
    bubble), sorted by fewest GPUs per replica or pipeline, then by bubble."""
    rows = []
    arch, low = ("sm70", "fp16") if v100 else ("sm80", "bf16")
    for tpn in divisors(gpn):
        nb_part, replicas = gpn // tpn, nodes * tpn
        if global_batch % replicas or model["nlayers"] < nb_part:
            continue
        batch = global_batch // replicas
        for chunks in ([1] if nb_part == 1 else [c for c in divisors(batch) if c <= max_chunks]):
            rows += _advise_rows("replica", dict(model, batch_size=batch, chunks=chunks), nb_part, replicas, tpn,
                                 ("fp32", low), gib, arch)
    for pp in [p for p in divisors(gpn) if p > 1 and model["nlayers"] >= p]:
        replicas = nodes * gpn // pp
        if global_batch % replicas:
            continue
        batch = global_batch // replicas
        for chunks in [c for c in divisors(batch) if pp <= c <= max_chunks]:
            rows += _advise_rows("stage", dict(model, batch_size=batch, chunks=chunks), pp, replicas, gpn,
                                 ("fp32",) if v100 else ("fp32", low), gib, arch)
    return sorted(rows, key=lambda r: (r["nb_part"], r["bubble"], r["peak_gib"], r["layout"]))


def _advise_rows(layout: str, m: dict, nb_part: int, replicas: int, tpn: int, precisions: tuple[str, ...],
                 gib: float, arch: str) -> list[dict]:
    """The options of one split that fit, as --advise rows (nb_part is --pp in the stage layout)."""
    rows = []
    for precision in precisions:
        for ckpt in (False, True):
            for zero in ((False, True) if replicas > 1 else (False,)):
                t = Training(layout=layout, pp=nb_part, schedule="1f1b", precision=precision,
                             activation_checkpointing=ckpt, zero=zero)
                worst = worst_part(m, t, nb_part, replicas, arch)
                peak = worst.total / GIB
                if peak <= gib:
                    rows.append(dict(ntasks_per_node=tpn, nb_part=nb_part, replicas=replicas,
                                     batch_size=m["batch_size"], chunks=m["chunks"], precision=precision,
                                     activation_checkpointing=ckpt, zero=zero, peak_gib=round(peak, 2),
                                     bubble=round(bubble(nb_part, m["chunks"]), 3), layout=layout,
                                     schedule="1f1b" if layout == "stage" else "gpipe", peak_at=worst.peak_at))
    return rows


def advise_text(rows: list[dict], nodes: int, gpn: int, gib: float, source: str, global_batch: int) -> str:
    lines = [f"check_topology --advise: {nodes} node(s) x {gpn} GPU(s) of {gib:.1f} GiB ({source}), global batch "
             f"{global_batch}: {len(rows)} split(s) fit, fewest GPUs per replica (or pipeline) first, then by bubble; "
             "layout replica is bench_ddp_transformer.py (nb_part GPUs a task), stage is bench_stage.py (a task a "
             "GPU, nb_part = --pp)",
             f"  {'layout':7} {'tasks/node':>10} {'nb_part':>7} {'replicas':>8} {'batch':>5} {'chunks':>6} "
             f"{'precision':9} {'ckpt':4} {'zero':4} {'peak GiB':>8} {'bubble':>6}"]
    for r in rows:
        lines.append(f"  {r['layout']:7} {r['ntasks_per_node']:>10} {r['nb_part']:>7} {r['replicas']:>8} "
                     f"{r['batch_size']:>5} {r['chunks']:>6} {r['precision']:9} "
                     f"{'yes' if r['activation_checkpointing'] else 'no':4} {'yes' if r['zero'] else 'no':4} "
                     f"{r['peak_gib']:>8.2f} {r['bubble']:>6.1%}")
    if not rows:
        lines.append("  nothing fits: use more GPUs, a smaller model (--nlayers, --d-model, --seq-len) or a smaller "
                     "global batch")
    return "\n".join(lines)


# ---- II.6 The report -------------------------------------------------------------------------------------------------

@dataclass
class Report:
    job: Job
    training: Training
    tasks: list[TaskPlan]
    findings: Findings
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings.errors

    def as_dict(self) -> dict:
        return {
            "ok": self.ok, "job": asdict(self.job), "training": asdict(self.training),
            "tasks": [dict(asdict(t), first_part=t.first_part, last_part=t.last_part, contents=t.contents)
                      for t in self.tasks],
            "findings": [asdict(f) for f in self.findings], "notes": self.notes,
        }

    def text(self) -> str:
        j, t = self.job, self.training
        lines = [f"check_topology: {j.source}"]
        if self.tasks:
            tpn = sorted({p.tasks_on_node for p in self.tasks})
            nbp = sorted({p.nb_part for p in self.tasks})
            nodes = len({p.node for p in self.tasks})
            gpn = j.gpus_per_node if j.gpus_per_node is not None else "?"
            what = (f"{len(self.tasks)} task(s) = {len(self.tasks) // max(t.pp, 1)} pipeline(s) x pp {t.pp} "
                    f"(stage layout, schedule {t.schedule})" if t.layout == "stage" else
                    f"{len(self.tasks)} task(s) = model replicas, nb_part {_choices(nbp)}")
            lines.append(f"  {nodes} node(s) x {gpn} GPU(s), tasks per node {_choices(tpn)} -> {what}, "
                         f"{t.nlayers} layers")
            lines.append(f"  {'task':>4} {'node':>4} {'local':>5}  {'GPUs (node ids)':16} {'.to() indices':14} "
                         "parts")
            shown = 0
            for p in self.tasks:
                if shown >= 16 and len(self.tasks) > 20:
                    lines.append(f"  ... {len(self.tasks) - shown} more task(s); --json lists them all")
                    break
                gpus = ",".join(p.gpu_ids) if p.gpu_ids else ("cpu" if p.cpu else "-")
                idx = ",".join(map(str, p.devices)) if p.devices else "-"
                if t.layout == "stage" and t.pp >= 2:  # a GPU per task, holding its stage(s) of a pipeline
                    v = stages_per_rank(t.schedule, t.virtual_stages)
                    contents = part_contents(t.nlayers or 0, t.pp * v)
                    ids = [p.rank % t.pp + k * t.pp for k in range(v)]
                    parts = f"{p.device(0) if p.cpu or p.devices else '?'}: " + " | ".join(
                        f"stage {s}: {contents[s]}" for s in ids) + f"  (pipeline {p.rank // t.pp})"
                else:
                    parts = " | ".join(f"{(p.device(i) if p.cpu or i < len(p.devices) else '?')}: {c}"
                                       for i, c in enumerate(p.contents)) if p.nb_part else "-"
                lines.append(f"  {p.rank:>4} {p.node:>4} {p.local_rank:>5}  {gpus:16} {idx:14} {parts}")
                shown += 1
        lines += [f"  note: {n}" for n in self.notes]
        if self.findings:
            lines += [f"  {f}" for f in self.findings]
        e, w = len(self.findings.errors), len(self.findings) - len(self.findings.errors)
        lines.append(f"  => {'OK' if self.ok else 'NOT OK'}: {e} error(s), {w} warning(s)")
        return "\n".join(lines)


# ---- II.7 Inside an allocation: srun python check_topology.py --------------------------------------------------------

def job_from_allocation(env: dict[str, str]) -> Job:
    """The allocation a batch script runs in (SLURM_JOB_NUM_NODES, SLURM_TASKS_PER_NODE, SLURM_JOB_GPUS, ...)."""
    def num(name: str) -> int | None:
        v = env.get(name, "").strip()
        if not v:
            return None
        m = re.match(r"(?:[A-Za-z0-9_-]+:)?(\d+)$", v)
        if not m:
            raise UsageError(f"{name}={v!r} is not a number")
        return int(m.group(1))
    tpn = env.get("SLURM_TASKS_PER_NODE", "").strip()
    gpus = env.get("SLURM_JOB_GPUS", "").strip()
    job = Job(
        nodes=num("SLURM_JOB_NUM_NODES") or num("SLURM_NNODES"),
        ntasks=num("SLURM_NTASKS"), ntasks_per_node=num("SLURM_NTASKS_PER_NODE"),
        tasks_per_node=idr_torch.parse_tasks_per_node(tpn, "SLURM_TASKS_PER_NODE") if tpn else None,
        gpus_per_node=num("SLURM_GPUS_ON_NODE") or (len(gpus.split(",")) if gpus else None),
        gpus_per_task=num("SLURM_GPUS_PER_TASK"), gpu_bind=env.get("SLURM_GPU_BIND") or None,
        cpus_per_task=num("SLURM_CPUS_PER_TASK"), hint=env.get("SLURM_HINT") or None,
        constraint=env.get("SLURM_JOB_CONSTRAINTS") or None, partition=env.get("SLURM_JOB_PARTITION") or None,
        time="allocated",
        source=f"allocation of job {env.get('SLURM_JOB_ID', '?')} ({env.get('SLURM_JOB_NODELIST', '?')})")
    return job


def gpus_memory_here() -> float | None:
    """The smallest GPU memory nvidia-smi shows in this allocation, in GiB (None without nvidia-smi)."""
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        mib = [float(x) for x in out.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(mib) / 1024 if mib else None


def task_facts(launch: idr_torch.Launch, training: Training) -> dict:
    """What this task really sees, for the collective report."""
    visible = launch.visible_gpus
    findings = Findings()
    plan = plan_task(launch.rank, launch.node_id, launch.local_rank, launch.local_world_size, visible,
                     launch.gpus_on_node, training.nlayers or (GPU_DEFAULTS if visible else CPU_DEFAULTS)["nlayers"],
                     1 if training.layout == "stage" else training.nb_part, findings, training.devices)
    try:
        import psutil
        affinity = len(psutil.Process().cpu_affinity())
    except (ImportError, AttributeError):
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cpt = launch.env.get("SLURM_CPUS_PER_TASK", "").strip()
    if cpt.isdigit() and affinity < int(cpt):
        findings.warn("affinity-small", f"task {launch.rank} may run on {affinity} CPU(s) but asked "
                      f"--cpus-per-task={cpt}: its DataLoader workers will share them")
    if not visible:
        findings.warn("no-gpu-visible", f"task {launch.rank} sees no GPU (CUDA_VISIBLE_DEVICES="
                      f"{launch.env.get('CUDA_VISIBLE_DEVICES')!r}): the trainer will run its {plan.nb_part} parts on the CPU")
    return {"host": socket.gethostname(), "plan": asdict(plan), "findings": [asdict(f) for f in findings],
            "gpus_on_node": launch.gpus_on_node}


def collect_reports(launch: idr_torch.Launch, facts: dict,
                    timeout: float = 120.0) -> tuple[list[dict], list[socket.socket]]:
    """Rank 0: collect every task's facts over TCP on the job's master port (no torch, no shared disk).
    Returns the facts by rank ({"missing": True} for a task that never reported) and the open connections,
    on which the verdict is sent back."""
    got, conns = {0: facts}, []
    if launch.size > 1:
        with socket.create_server(("", launch.master_port), backlog=launch.size) as server:
            server.settimeout(1.0)
            deadline = time.monotonic() + timeout
            while len(got) < launch.size and time.monotonic() < deadline:
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    continue
                conn.settimeout(30)
                with conn.makefile("rb") as f:
                    line = f.readline()
                try:
                    msg = json.loads(line)
                    got[int(msg.pop("rank"))] = msg
                    conns.append(conn)
                except (ValueError, KeyError):
                    conn.close()
    return [got.get(r, {"missing": True}) for r in range(launch.size)], conns


def send_report(launch: idr_torch.Launch, facts: dict, timeout: float = 120.0) -> int:
    """Ranks > 0: send this task's facts to rank 0 and return the exit code it decides for everyone."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = socket.create_connection((launch.master_addr, launch.master_port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise UsageError(f"task {launch.rank} could not reach task 0 at {launch.master_addr}:"
                                 f"{launch.master_port} within {timeout:.0f}s")
            time.sleep(0.5)
    with conn:
        conn.sendall((json.dumps({"rank": launch.rank, **facts}) + "\n").encode())
        conn.settimeout(timeout + 30)
        with conn.makefile("rb") as f:
            verdict = f.readline().strip()
    return int(verdict) if verdict.isdigit() else 1


def check_in_step(launch: idr_torch.Launch, training: Training,
                  gpu_mem: float | None = None) -> tuple[Report | None, int]:
    """srun python check_topology.py: every task checks what it sees; rank 0 prints one report."""
    if training.nlayers is None:  # the trainer's default for what this task sees
        training.nlayers = (GPU_DEFAULTS if launch.visible_gpus else CPU_DEFAULTS)["nlayers"]
    facts = task_facts(launch, training)
    if launch.rank != 0:
        return None, send_report(launch, facts)
    result, conns = collect_reports(launch, facts)
    job = job_from_allocation(launch.env)
    job.gpu_mem = gpu_mem
    job.source = (f"srun step {launch.job_id}.{launch.step_id}: {launch.size} task(s) on {launch.nodelist}, "
                  "as each task sees it")
    job.tasks_per_node = launch.tasks_per_node
    findings, plans = Findings(), []
    for r, f in enumerate(result):
        if f.get("missing"):
            findings.error("task-missing", f"task {r} never reported to task 0 within the timeout; is it running?")
            continue
        plans.append(TaskPlan(**f["plan"]))
        findings.extend(Finding(**x) for x in f["findings"])
        if job.gpus_per_node is None and f.get("gpus_on_node") is not None:
            job.gpus_per_node = f["gpus_on_node"]
    _dedupe(findings)
    if len(set(launch.tasks_per_node)) > 1:
        findings.error("uneven-tasks-per-node",
                       f"tasks per node differ ({','.join(map(str, launch.tasks_per_node))}): nodes get different "
                       f"nb_part ({_choices(p.nb_part for p in plans)}); use --ntasks-per-node")
    report = Report(job, training, plans, findings)
    check_node_usage(report)
    nb = [p.nb_part for p in plans if p.nb_part]
    cpu = all(p.cpu for p in plans)
    if training.layout == "stage":
        check_training(check_stage(len(plans), launch.tasks_per_node, job.gpus_per_node, training, findings, cpu),
                       training, findings, cpu=cpu)
        if not cpu and training.pp >= 1 and len(plans) % training.pp == 0:
            job.gpu_mem_seen = gpus_memory_here()
            line = check_memory(job, training, training.pp, len(plans) // training.pp,
                                max(launch.tasks_per_node), findings)
            report.notes += [line] if line else []
    elif nb:
        check_training(min(nb), training, findings, cpu=cpu)
        if not cpu:
            job.gpu_mem_seen = gpus_memory_here()
            line = check_memory(job, training, min(nb), len(plans), max(launch.tasks_per_node), findings)
            report.notes += [line] if line else []
    note_page_indexing(report)
    code = 0 if report.ok else 1
    for c in conns:
        with c:
            try:
                c.sendall(f"{code}\n".encode())
            except OSError:
                pass
    return report, code


# ---- II.8 Command line -----------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="check_topology.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 clean (warnings allowed), 1 errors, 2 usage error or unreadable file.")
    p.add_argument("sbatch_file", nargs="?", help="an sbatch script to check before submitting it")
    plan = p.add_argument_group("planning without a cluster")
    plan.add_argument("--nodes", "-N", type=int)
    plan.add_argument("--gpus-per-node", type=int)
    plan.add_argument("--ntasks-per-node", type=int)
    plan.add_argument("--ntasks", "-n", type=int)
    plan.add_argument("--gpus-per-task", type=int)
    plan.add_argument("--gpu-bind")
    plan.add_argument("--cpus-per-task", "-c", type=int)
    plan.add_argument("--partition", "-p")
    plan.add_argument("--constraint", "-C")
    train = p.add_argument_group("the trainer's arguments (override an sbatch file's srun line)")
    train.add_argument("--nlayers", type=int)
    train.add_argument("--chunks", type=int)
    train.add_argument("--batch-size", type=int, help="per replica (task)")
    train.add_argument("--engine", choices=ENGINES)
    train.add_argument("--nb-part", type=int, help="GPUs per replica (default: derived as on the page)")
    train.add_argument("--devices", help="visible GPU index of each part, e.g. 0,0 (two parts on one GPU)")
    train.add_argument("--layout", choices=("replica", "stage"))
    train.add_argument("--pp", type=int, help="stage layout: tasks per pipeline")
    train.add_argument("--schedule", choices=SCHEDULES)
    train.add_argument("--virtual-stages", type=int)
    mem = p.add_argument_group("will it fit? (the trainer's model arguments, its memory options, the GPU's memory)")
    for flag in ("--d-model", "--n-head", "--d-hid", "--seq-len", "--vocab-size"):
        mem.add_argument(flag, type=int, help=f"default {GPU_DEFAULTS[flag[2:].replace('-', '_')]} (the trainer's GPU default)")
    mem.add_argument("--dropout", type=float)
    mem.add_argument("--precision", choices=PRECISIONS)
    mem.add_argument("--activation-checkpointing", action="store_true", default=None)
    mem.add_argument("--zero", action="store_true", default=None)
    mem.add_argument("--gpu-mem", type=float, metavar="GiB",
                     help="memory of one GPU (default: from -C/-p, or the allocation's GPUs)")
    mem.add_argument("--advise", action="store_true",
                     help="list every split of --nodes x --gpus-per-node that fits, for --global-batch")
    mem.add_argument("--global-batch", type=int, help="--advise: samples per step over all replicas")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def advise_main(args: argparse.Namespace, t: Training) -> int:
    """--advise: every split that fits, from planning flags alone."""
    job = Job(nodes=args.nodes, gpus_per_node=args.gpus_per_node, constraint=args.constraint,
              partition=args.partition, gpu_mem=args.gpu_mem)
    ntype = node_type(job)
    gpn = job.gpus_per_node or (NODE_TYPES[ntype]["gpus"] if ntype else None)
    gib, source = gpu_memory(job)
    missing = [m for m, v in (("--nodes N", job.nodes), ("--gpus-per-node N (or -C/-p of a known node)", gpn),
                              ("-C v100-16g|v100-32g|a100|h100 or --gpu-mem GiB", gib),
                              ("--global-batch N", args.global_batch)) if not v]
    if missing:
        raise UsageError(f"--advise needs {', '.join(missing)}; e.g. --advise --nodes 3 --gpus-per-node 4 "
                         "-C v100-32g --global-batch 384")
    if args.global_batch < 1 or job.nodes < 1 or gpn < 1:
        raise UsageError(f"--nodes ({job.nodes}), --gpus-per-node ({gpn}) and --global-batch ({args.global_batch}) "
                         "must be at least 1")
    rows = advise(job.nodes, gpn, gib, model_args(t), args.global_batch, is_v100(job))
    print(json.dumps(rows, indent=1) if args.json else
          advise_text(rows, job.nodes, gpn, gib, source, args.global_batch))
    return 0 if rows else 1

PLANNING = ("nodes", "gpus_per_node", "ntasks_per_node", "ntasks", "gpus_per_task", "gpu_bind", "cpus_per_task",
            "partition", "constraint")


def override(args: argparse.Namespace, t: Training) -> Training:
    """The trainer's arguments given on the checker's command line, over those of the sbatch file's trainer line."""
    for name in ("nlayers", "chunks", "batch_size", "engine", "nb_part", "layout", "pp", "schedule",
                 "virtual_stages"):
        if below_one({name: getattr(args, name)}):
            raise UsageError(below_one({name: getattr(args, name)}))
        if getattr(args, name) is not None:
            setattr(t, name, getattr(args, name))
    for name in ("d_model", "n_head", "d_hid", "seq_len", "vocab_size", "dropout"):
        value = getattr(args, name)
        if value is not None and (value < 0 if name == "dropout" else value < 1):
            raise UsageError(f"--{name.replace('_', '-')} {value} must be at least {0 if name == 'dropout' else 1}")
        if value is not None:
            t.model[name] = value
    for name in ("precision", "activation_checkpointing", "zero"):
        if getattr(args, name) is not None:
            setattr(t, name, getattr(args, name))
    if args.devices is not None:
        bad = Findings()
        t.devices = parse_devices(args.devices, "command line", bad)
        if bad:
            raise UsageError(bad[0].message)
    return t  # nlayers left None: check_job / task_facts take the trainer's default for GPU or CPU


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
    training = Training()

    try:
        if args.gpu_mem is not None and args.gpu_mem <= 0:
            raise UsageError(f"--gpu-mem {args.gpu_mem:g} must be a positive number of GiB, e.g. --gpu-mem 32")
        if args.advise:
            return advise_main(args, override(args, training))
        planning = any(getattr(args, k) is not None for k in PLANNING)
        if args.sbatch_file:
            if planning:
                raise UsageError("give either an sbatch file or planning flags (--nodes ...), not both")
            job, training, findings = read_sbatch(args.sbatch_file)
            job.gpu_mem = args.gpu_mem
            report = check_job(job, override(args, training))
            report.findings[:0] = findings
        elif planning:
            missing = [f"--{k.replace('_', '-')}" for k in ("nodes", "gpus_per_node") if getattr(args, k) is None]
            if missing and not (args.gpus_per_task and args.nodes):
                raise UsageError(f"planning needs {' and '.join(missing)} (and --ntasks-per-node), e.g. "
                                 "--nodes 3 --gpus-per-node 4 --ntasks-per-node 2")
            bad = below_one({k: getattr(args, k) for k in PLANNING})
            if bad:
                raise UsageError(bad)
            job = Job(**{k: getattr(args, k) for k in PLANNING}, gpu_mem=args.gpu_mem)
            job.source = (f"plan: {args.nodes} node(s) x {args.gpus_per_node or '?'} GPU(s), "
                          f"--ntasks-per-node={args.ntasks_per_node}")
            report = check_job(job, override(args, training))
            # planning flags describe the layout, not the cores, hint or time limit: don't nag about those
            report.findings[:] = [f for f in report.findings
                                  if f.code not in ("cpus-per-task-missing", "hint-missing", "time-missing")]
        else:
            launch = idr_torch.Launch()
            if launch.launcher == "slurm":
                report, code = check_in_step(launch, override(args, training), args.gpu_mem)
                if report is None:
                    return code
            elif launch.job_id:
                job = job_from_allocation(launch.env)
                job.gpu_mem, job.gpu_mem_seen = args.gpu_mem, gpus_memory_here()
                report = check_job(job, override(args, training))
            else:
                raise UsageError("nothing to check: give an sbatch file, planning flags (--nodes 3 --gpus-per-node 4 "
                                 "--ntasks-per-node 2), or run me inside a Slurm allocation")
    except (UsageError, idr_torch.LaunchError) as exc:
        print(f"check_topology: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=1) if args.json else report.text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

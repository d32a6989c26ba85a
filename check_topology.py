#!/usr/bin/env python
"""Pre-flight check of a hybrid pipeline + data parallel job, and the plan the trainer runs.

    python check_topology.py slurm/page_3nodes_4gpus.slurm        # before sbatch: #SBATCH header + srun line
    python check_topology.py their_megatron_job.slurm             # any job script: the Slurm and Jean Zay layer
    python check_topology.py --nodes 3 --gpus-per-node 4 --ntasks-per-node 2 --nlayers 8    # planning
    python check_topology.py --nlayers 8 --chunks 4                # in a batch script: the allocation itself
    srun python check_topology.py --nlayers 8 --chunks 4           # every task checks what it really sees
    python check_topology.py --advise --nodes 2 -C v100-32g --global-batch 512 --profile profile.json
                                                                   # every split that fits, fastest predicted first

Layout of the page: one task per model replica; nb_part = GPUs per node // tasks per node; task `local_rank`
owns GPUs first_part = local_rank * nb_part ... last_part = first_part + nb_part - 1. When Slurm binds GPUs per
task (--gpus-per-task, --gpu-bind) a task sees only its own GPUs, so its plan starts at visible GPU 0.
Layers: a balanced contiguous split, the page's own split whenever nlayers % nb_part == 0; Encoder on the first
part, Decoder on the last.

Exit status: 0 clean (warnings allowed), 1 errors found, 2 usage error or unreadable file.
bench_ddp_transformer.py builds its model from plan_task() below, so what this approves is what runs.
No torch import here: checking a file must stay well under a second on a login node.

One file, in two parts, because users copy it next to the trainers and both trainers import it:
  Part I   the plan the trainers import (their `__all__`): I.1 the trainers' arguments, defined once (their
           argparse, ranges, GPU and CPU defaults), I.2 the layer split, I.3 this task's GPUs, I.4 memory, I.5 what
           each torch release can run, I.6 the trainers' checks of their arguments, and their --check-args, I.7 the
           speed of a split from a profile (benchmarks/speed_profile.py). The trainers call these very functions, so
           their refusals are the checker's findings.
  Part II  the pre-flight checker: II.1 what it catches, II.2 Slurm 22.05 (the request, the option tables, the
           option values sbatch checks, the placement of tasks and GPUs: a port to a newer Slurm touches this
           block), II.3 Jean Zay in one dated table, and Slurm's own rules where it answers (site_slurm.py reads
           them; --site), II.4 reading a job script (the file, sbatch's directives, bash's
           commands, the launch lines), II.5 checking a job (the kit's trainer in depth, any other program at the
           Slurm and site level), II.6 the report, II.7 inside an allocation (the same checks), II.8 the command
           line. How it reads scripts, and the sources of its rules: docs/checker.md.
"""
from __future__ import annotations

import argparse
import bisect
import copy
import difflib
import functools
import json
import math
import os
import re
import shlex
import socket
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Iterable, NoReturn, Sequence

import idr_torch

# What the trainers (bench_ddp_transformer.py, bench_stage.py) and the benchmarks take from here: Part I.
__all__ = ["Arg", "ARGS", "ARG", "GPU_DEFAULTS", "CPU_DEFAULTS", "CPU_NB_PART", "ENGINES", "PRECISIONS", "SCHEDULES",
           "MULTI_STAGE", "TRAINERS", "SCRIPTS", "MAX_GPUS_PER_NODE", "gpu_indices", "Training", "model_args",
           "Finding", "Findings", "refusal_text", "ArgumentError", "trainer_parser", "TrainerLine", "read_trainer_argv",
           "parse_trainer_args", "resolve_defaults", "training_from_args", "part_sizes", "split_layers",
           "part_contents", "TaskPlan", "plan_task", "GIB", "ARCHS", "arch_of", "requested_arch", "PartMemory",
           "attention_kernel",
           "estimate_memory", "estimate_stage_memory", "stage_actions", "worst_part", "memory_line",
           "TORCH_FEATURES", "torch_refusals", "divisors", "check_arguments", "check_training", "stages_per_rank",
           "check_stage", "bubble", "check_trainer_task", "check_args", "check_args_main", "PROFILE_FORMAT",
           "PROFILE_MODEL", "SPEED_TERMS", "ProfileError", "read_profile", "profile_mismatch", "predict_speed"]


# ======================================================================================================================
# Part I. The plan the trainers import: arguments, layer split, task plan, memory, torch releases, checks, speed
# ======================================================================================================================


# ---- I.1 The trainers' arguments, defined once -----------------------------------------------------------------------

# Every argument of the two trainers is defined once, in ARGS: its name, type, GPU and CPU defaults, choices, range,
# help, and the layouts that have it. bench_ddp_transformer.py and bench_stage.py build their argparse from it
# (trainer_parser); the checker reads a job script's trainer line with that same parser (read_trainer_argv) and takes
# the same names on its own command line. So the checker refuses a line exactly when the trainer would, in its words,
# and never judges a default where the line means something else. docs/arguments.md lists them with their ranges.

CPU_NB_PART = 2  # no GPU: still split in two so the pipeline is exercised
ENGINES = ("auto", "torch-pipe", "fairscale")
# --precision's names: fp32 (no autocast), bf16 or fp16 autocast; the trainer maps each name to its torch dtype
# (bench_ddp_transformer.AUTOCAST_DTYPE)
PRECISIONS = ("fp32", "bf16", "fp16")

# The stage layout (bench_stage.py): torch.distributed.pipelining's schedules, by --schedule name (the one list of
# them: bench_stage.py's choices, and the class it builds); the multi-stage ones hold several stages per task.
# Not offered: the zero-bubble schedules (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble) split the
# weight gradients out of the backward, which DDP's gradient hooks don't follow (ZB-V crashed with DDP here).
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved1f1b": "ScheduleInterleaved1F1B",
             "loopedbfs": "ScheduleLoopedBFS"}

MULTI_STAGE = ("interleaved1f1b", "loopedbfs")
TRAINERS = {"bench_ddp_transformer.py": "replica", "bench_stage.py": "stage"}  # the script sets the layout
SCRIPTS = {layout: script for script, layout in TRAINERS.items()}

# What a site can have. Every count is bounded, so that a typo (--nlayers 999999999) is refused at once, in one line,
# instead of a checker that plans a billion layers or a job that fails after its wait in the queue.
MAX_GPUS_PER_NODE = 16  # the largest GPU nodes (DGX-2, HGX-2); Jean Zay's have 4 or 8


def gpu_indices(text: str) -> list[int]:
    """--devices 0,0: a visible GPU index per part (0,0 puts two parts on one GPU, for a one-GPU check)."""
    devices = [int(x) for x in text.split(",")]
    if len(devices) > MAX_GPUS_PER_NODE or not all(0 <= d < MAX_GPUS_PER_NODE for d in devices):
        raise ValueError(text)
    return devices


def _show(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Arg:
    """One trainer argument. `kind` converts its text (None: a switch); `gpu` and `cpu` are its defaults with a GPU
    and without one (cpu=...: the same); lo..hi its range (lo_open, hi_open: that bound excluded); `why` says, in a
    refusal, what the range or a special value means."""
    flag: str
    kind: Callable[[str], object] | None
    gpu: object = None
    cpu: object = ...
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple = ()
    layouts: tuple[str, ...] = ("replica", "stage")
    group: str = "run"  # model (a GPU and a CPU default), memory, pipeline, run, files, mode
    help: str = ""
    why: str = ""
    code: str = "bad-argument"  # the finding of a value the trainer refuses
    checkpoint: bool = False  # a checkpoint must match it (bench_ddp_transformer.layout_of)

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    @property
    def cpu_default(self) -> object:
        return self.gpu if self.cpu is ... else self.cpu

    @property
    def checked(self) -> bool:
        """The checker's plan, memory model or checks use it: the checker's command line takes it too."""
        return self.group in ("model", "memory", "pipeline")

    def example(self) -> str:
        if self.gpu is not None or self.lo is not None:
            return _show(self.gpu if self.gpu is not None else self.lo)
        return "0,0" if self.kind is gpu_indices else "PATH"

    def range_text(self) -> str:
        if self.kind is gpu_indices:
            return f"GPU indices separated by commas, one per part, each from 0 to {MAX_GPUS_PER_NODE - 1}"
        what, lo, hi = "an integer" if self.kind is int else "a number", _show(self.lo), _show(self.hi)
        if not (self.lo_open or self.hi_open):
            return f"{what} from {lo} to {hi}"
        return (f"{what} {'above' if self.lo_open else 'at least'} {lo} and "
                f"{'below' if self.hi_open else 'at most'} {hi}")

    def refusal(self, raw: str) -> str:
        """The one line for a value this argument refuses: the value as written, what it must be, an example."""
        if self.choices:
            return f"{self.flag} {raw!r} is not one of {', '.join(self.choices)}; e.g. {self.flag} {self.example()}"
        try:
            float(raw)
            shown = raw
        except ValueError:
            shown = repr(raw)
        why = f" ({self.why})" if self.why else ""
        return f"{self.flag} {shown} must be {self.range_text()}{why}; e.g. {self.flag} {self.example()}"

    def convert(self, raw: str | bool) -> tuple[object, str | None]:
        """(value, None), or (None, the refusal)."""
        if self.kind is None:
            return bool(raw), None
        if self.group == "files" and not str(raw).strip():  # '' would silently mean "none": no save, no record
            return None, (f"{self.flag} {raw!r} is an empty path; give a file or folder, or leave {self.flag} out")
        try:
            value = self.kind(raw)
        except ValueError:
            return None, self.refusal(raw)
        if self.choices:
            return (value, None) if value in self.choices else (None, self.refusal(raw))
        if isinstance(value, float) and not math.isfinite(value):
            return None, self.refusal(raw)
        if self.lo is not None and (value < self.lo or self.lo_open and value == self.lo):
            return None, self.refusal(raw)
        if self.hi is not None and (value > self.hi or self.hi_open and value == self.hi):
            return None, self.refusal(raw)
        return value, None

    def help_text(self) -> str:
        bits = []
        if self.group == "model":
            bits.append(f"default: GPU {_show(self.gpu)}, CPU {_show(self.cpu_default)}")
        elif self.kind is not None and self.gpu is not None:
            bits.append(f"default {_show(self.gpu)}")
        if self.lo is not None:
            bits.append(self.range_text().split(" ", 2)[2])
        return (self.help + (f" ({'; '.join(bits)})" if bits else "")).replace("%", "%%")


ARGS = (
    # The model and the batch. GPU: big enough that the page's reason for model parallelism (activations of a deep
    # model) holds. CPU (CI, laptops): small enough for a 2-core machine to learn the synthetic task in well under a
    # minute; no dropout there, its random masks cost as much as the matmuls of so small a model.
    Arg("--nlayers", int, 16, 4, 1, 1024, group="model", checkpoint=True, help="Layer blocks"),
    Arg("--d-model", int, 1024, 64, 2, 65536, group="model", checkpoint=True,
        help="width (even, a multiple of --n-head)"),
    Arg("--n-head", int, 16, 4, 1, 1024, group="model", checkpoint=True, help="attention heads"),
    Arg("--d-hid", int, 4096, 128, 1, 262144, group="model", checkpoint=True, help="feed-forward width"),
    Arg("--dropout", float, 0.1, 0.0, 0, 1, hi_open=True, group="model", why="a probability",
        help="dropout (on the CPU its masks cost as much as the matmuls)"),
    Arg("--seq-len", int, 256, 64, 1, 131072, group="model", checkpoint=True, help="tokens per review"),
    Arg("--vocab-size", int, 30000, 2000, 3, 10_000_000, group="model", checkpoint=True,
        why="the two special tokens <pad> and <unk>, and at least one word", help="vocabulary incl. <pad>,<unk>"),
    Arg("--chunks", int, 4, 2, 1, 4096, group="model", help="micro-batches per batch: 1 = naive model parallel"),
    Arg("--batch-size", int, 64, 32, 1, 65536, group="model", help="samples per step per replica"),
    # the page's closing advice: what a GPU holds
    Arg("--precision", str, "fp32", choices=PRECISIONS, group="memory",
        help="autocast: bf16 (A100, H100, CPU), or fp16 with a GradScaler (V100 has no bf16); weights stay fp32"),
    Arg("--activation-checkpointing", None, False, group="memory",
        help="each Layer keeps only its input and recomputes the rest in backward (torch.utils.checkpoint)"),
    Arg("--zero", None, False, group="memory", help="ZeroRedundancyOptimizer: AdamW's state sharded over the replicas"),
    # off by default, as the page has it (and torch since 1.12: torch.backends.cuda.matmul.allow_tf32 = False);
    # the same bytes as fp32 (the memory model has no term for it), TF32's tensor cores on compute capability >= 8.0
    Arg("--tf32", None, False, group="memory",
        help="fp32 matmuls on TF32 tensor cores (A100, H100; a V100 has none): 10-bit mantissa, fp32's range"),
    # the replica layout's pipeline (bench_ddp_transformer.py)
    Arg("--nb-part", int, None, lo=1, hi=MAX_GPUS_PER_NODE, layouts=("replica",), group="pipeline",
        help=f"GPUs per replica (default: the page's GPUs per node // tasks per node; CPU {CPU_NB_PART})"),
    Arg("--engine", str, "auto", choices=ENGINES, layouts=("replica",), group="pipeline", code="bad-engine",
        help="auto: torch-pipe on torch <= 2.3, else fairscale"),
    Arg("--devices", gpu_indices, None, layouts=("replica",), group="pipeline",
        help="visible GPU index of each part instead of the page's indexing; 0,0 puts both parts on one GPU "
             "(benchmarks/gpu_check.py on a one-GPU node)"),
    # the stage layout's pipeline (bench_stage.py)
    Arg("--pp", int, 2, lo=2, hi=1024, layouts=("stage",), group="pipeline",
        why="a pipeline needs at least 2 stages; for pure data parallel use bench_ddp_transformer.py --nb-part 1",
        help="tasks per pipeline (pipelines = world size / pp)"),
    Arg("--schedule", str, "1f1b", choices=tuple(SCHEDULES), layouts=("stage",), group="pipeline",
        code="bad-schedule", help="torch.distributed.pipelining's schedule"),
    Arg("--virtual-stages", int, 2, lo=1, hi=64, layouts=("stage",), group="pipeline",
        help=f"stages per task for {' and '.join(MULTI_STAGE)}"),
    # the run
    Arg("--epochs", int, 3, lo=1, hi=100_000),
    Arg("--max-steps", int, 0, lo=0, hi=10**9, why="0: no limit", help="stop after this many steps in all"),
    Arg("--untimed-steps", int, 3, lo=0, hi=10**6,
        help="first steps of each epoch left out of the samples/s (allocator, autotuning); not the lr's warmup"),
    # The learning rate: AdamW's peak rate, reached after --lr-warmup of the run's steps, then decayed (the
    # Transformer paper's and BERT's practice). Default min(2e-3, LR_TIMES_WIDTH / d_model): 1.6e-3 on the CPU
    # (d_model 64), 1e-4 at the GPU's d_model 1024. Measured on an H200 (docs/gpu.md): lr x d_model about 1 collapsed
    # to one class at every depth, 0.26 learned then slipped, 0.1 learned.
    Arg("--lr", float, None, lo=0, hi=10, lo_open=True, why="AdamW's peak rate",
        help="AdamW's peak learning rate (default min(2e-3, 0.1 / d_model): 1e-4 at d_model 1024)"),
    Arg("--lr-warmup", float, 0.05, lo=0, hi=1, hi_open=True, why="a fraction of the run's steps",
        help="fraction of the run's steps over which the lr rises linearly from 0 to --lr"),
    Arg("--lr-decay", str, "cosine", choices=("cosine", "linear", "none"),
        help="after the warmup: cosine or linear down to --lr / 10 at the run's last step, or none (constant)"),
    # torch.manual_seed takes [-2**63, 2**64 - 1] and maps a negative seed onto a positive one; the trainer seeds
    # rank r with seed + 1 + r and the sampler with seed + epoch, which this range keeps valid and distinct
    Arg("--seed", int, 1234, lo=0, hi=2**63 - 1, help="the model's initial weights, the data order, dropout"),
    Arg("--synthetic", int, 0, lo=0, hi=10_000_000, why="0: IMDB, or 4000 synthetic reviews where there is none",
        help="N synthetic reviews instead of IMDB"),
    Arg("--workers", int, -1, lo=-1, hi=64, why="-1: from --cpus-per-task on a GPU, 0 on the CPU",
        help="DataLoader workers"),
    Arg("--timeout", float, 600.0, lo=0, hi=7 * 86400, lo_open=True, why="seconds, at most a week",
        help="seconds before a collective with a dead rank gives up"),
    Arg("--log-every", float, 30.0, lo=0, hi=86400, help="seconds between progress lines within an epoch"),
    # files
    Arg("--data-dir", str, group="files",
        help="aclImdb/ or aclImdb_v1.tar.gz, or a folder holding one (default $DSDIR/IMDB)"),
    Arg("--cache-dir", str, group="files", help="where the tokenised corpus is cached (default $SCRATCH, else the "
        "data's folder if writable, else ./.cache)"),
    Arg("--json-out", str, group="files", help="append one JSON line with the configuration and results (rank 0)"),
    Arg("--save", str, group="files", help="write the checkpoint here after each epoch (rank 0, atomically)"),
    Arg("--load", str, group="files", help="start from this checkpoint (every rank loads it)"),
    Arg("--resume", None, False, group="files",
        help="start from the --save file if it exists (a requeued job continues)"),
    Arg("--check-args", None, False, group="mode",
        help="check the arguments as the trainer does (this task's plan from the environment, the GPU or CPU "
             "defaults), print the verdict and exit with the trainer's status, without importing torch"),
)
ARG = {a.dest: a for a in ARGS}

# --lr's default: AdamW's peak rate falls with the width, lr x d_model = LR_TIMES_WIDTH, capped at MAX_DEFAULT_LR
# (the measurements are on --lr, above).
LR_TIMES_WIDTH, MAX_DEFAULT_LR = 0.1, 2e-3


def default_lr(d_model: int) -> float:
    """--lr where the line gives none: 1.6e-3 at the CPU's d_model 64, 1e-4 at the GPU's 1024."""
    return min(MAX_DEFAULT_LR, LR_TIMES_WIDTH / d_model)


# The model and batch the trainer runs where the line gives none (views of ARGS, for the memory model and tests).
GPU_DEFAULTS = {a.dest: a.gpu for a in ARGS if a.group == "model"}
CPU_DEFAULTS = {a.dest: a.cpu_default for a in ARGS if a.group == "model"}


@dataclass
class Training:
    """A trainer's arguments as the plan and the checks use them: None where the line gives none (the GPU or CPU
    default applies), the line's own values elsewhere."""
    nlayers: int | None = None
    chunks: int | None = None
    batch_size: int | None = None
    engine: str = ARG["engine"].gpu
    nb_part: int | None = None
    layout: str = "replica"
    pp: int = ARG["pp"].gpu
    schedule: str = ARG["schedule"].gpu
    virtual_stages: int = ARG["virtual_stages"].gpu
    precision: str = ARG["precision"].gpu  # fp32, bf16 or fp16 (autocast)
    activation_checkpointing: bool = False  # per Layer, non-reentrant torch.utils.checkpoint
    zero: bool = False  # ZeroRedundancyOptimizer over the data-parallel group
    tf32: bool = False  # --tf32: fp32 matmuls on TF32 tensor cores (no memory term: the same bytes as fp32)
    model: dict = field(default_factory=dict)  # d_model, n_head, d_hid, seq_len, vocab_size, dropout on the line
    devices: list[int] | None = None  # --devices: a visible GPU index per part, else the page's indexing
    save: str | None = None  # --save PATH (checked for writing by the trainer, at start-up)
    resume: bool = False  # --resume: start from the --save file if it exists
    unchecked: list[str] = field(default_factory=list)  # arguments given as shell variables, as written
    unknown: list[str] = field(default_factory=list)  # names (nlayers, chunks, ...) whose value is not known here

    def known(self, *names: str) -> bool:
        """Whether the checks may judge these arguments: no shell variable (or line the trainer refuses) hides them."""
        return not any(n in self.unknown for n in names)


TRAINING_FIELDS = {f.name for f in fields(Training)}


def model_args(t: "Training", cpu: bool = False, **given: int | float | None) -> dict:
    """The model arguments the trainer would use: the line's values, else GPU_DEFAULTS (or CPU_DEFAULTS)."""
    defaults = CPU_DEFAULTS if cpu else GPU_DEFAULTS
    model = {k: v for k, v in defaults.items()}
    model.update({k: v for k, v in dict(nlayers=t.nlayers, chunks=t.chunks, batch_size=t.batch_size).items()
                  if v is not None})
    model.update({k: v for k, v in {**t.model, **given}.items() if v is not None})
    return model


def below_one_message(values: dict) -> str | None:
    """'--name N must be at least 1' for the first count below 1, else None (None and non-numbers are someone
    else's business): the checker's planning flags (--nodes ...)."""
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


def refusal_text(findings: Iterable[Finding]) -> str:
    """The trainer's one line for its errors: 'code: message; code: message'."""
    return "; ".join(f"{f.code}: {f.message}" for f in findings)


class ArgumentError(ValueError):
    """A trainer line that the trainer's argparse refuses: the trainer prints it as its one line and exits 2."""

    def __init__(self, message: str, findings: Findings | None = None) -> None:
        super().__init__(message)
        self.findings = findings if findings is not None else Findings()


class _TrainerParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse would print its usage and exit: the caller reports it
        raise ArgumentError(message)


# Abbreviations are refused (allow_abbrev=False), with a did-you-mean that names the full option. argparse would take
# any unambiguous prefix (--batch 256 as --batch-size 256), but a prefix that is unambiguous today becomes ambiguous,
# or silently means another option, the day an option is added, and a job script is read later by people who should
# not need argparse's rules to know what it runs. Underscores get the same did-you-mean (--batch_size: --batch-size).
def trainer_parser(layout: str, doc: str | None = None) -> argparse.ArgumentParser:
    """The argparse of bench_ddp_transformer.py (layout "replica") or bench_stage.py ("stage"), built from ARGS.
    Values stay text: read_trainer_argv converts and checks them, so that every refusal is a finding."""
    p = _TrainerParser(prog=SCRIPTS[layout], description=(doc or "").split("\n\n")[0].strip() or None,
                       formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False, add_help=False)
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    for a in ARGS:
        if layout not in a.layouts:
            continue
        if a.kind is None:
            p.add_argument(a.flag, dest=a.dest, action="store_true", help=a.help_text())
        else:
            metavar = "{" + ",".join(a.choices) + "}" if a.choices else None
            p.add_argument(a.flag, dest=a.dest, metavar=metavar, help=a.help_text())
    return p


@functools.lru_cache(maxsize=None)
def _reading_parser(layout: str) -> argparse.ArgumentParser:
    """trainer_parser without its description, built once: argparse's parsers keep no state between parses, and
    building one costs more than reading a line with it."""
    return trainer_parser(layout)


@dataclass
class TrainerLine:
    """A trainer's command line as its argparse reads it."""
    values: argparse.Namespace  # converted; None where the line gives nothing (the GPU or CPU default applies)
    findings: Findings  # what the trainer refuses, in its words
    given: list[str]  # the names (dests) the line gives
    unknown: list[str] = field(default_factory=list)  # names whose value is a shell variable (all: the line is refused)
    unchecked: list[str] = field(default_factory=list)  # the shell variables, as written ('--chunks $C', '$ARGS')
    standalone: list[str] = field(default_factory=list)  # those that may hold any arguments ('$ARGS', '$@')
    help: bool = False


# Options the trainers had and renamed: a line that still has one is refused with the new name and why.
RENAMED = {"--warmup-steps": "--untimed-steps (the steps left out of the timing: it never warmed the learning rate "
                             "up, which is --lr-warmup, a fraction of the run's steps)"}


def unknown_option(token: str, flags: Iterable[str], prog: str) -> str:
    """The refusal of an option argparse does not have, naming the full option it may stand for."""
    name = token.partition("=")[0]
    if name in RENAMED:
        return f"{name} is now {RENAMED[name]}"
    flags = list(flags)
    dashed = "--" + name.lstrip("-").replace("_", "-") if name.startswith("--") else name
    head = f"{name} is not an option of {prog}"
    if dashed != name and dashed in flags:
        return f"{head}: did you mean {dashed}? (options are written with '-', not '_')"
    prefixed = [f for f in flags if len(dashed) > 2 and f.startswith(dashed)]
    if prefixed:
        return (f"{head}: did you mean {' or '.join(prefixed[:4])}? (abbreviations are refused: one that is "
                "unambiguous today may mean another option tomorrow; write the option in full)")
    close = difflib.get_close_matches(dashed, flags, n=3, cutoff=0.7)
    if close:
        return f"{head}: did you mean {' or '.join(close)}?"
    return f"{head}; `python {prog} --help` lists its options"


def _argparse_refusal(message: str) -> str:
    """argparse's own error, said as the other refusals are: the option, what is wrong, the fix."""
    m = re.match(r"argument ([^:]+): (.*)", message)
    if not m:
        return message
    flag, what = m.group(1).split("/")[-1], m.group(2)
    arg = ARG.get(flag[2:].replace("-", "_"))
    if what.startswith("expected one argument") and arg:
        return (f"{flag} needs a value, e.g. {flag} {arg.example()} (a value that starts with '-' is written "
                f"{flag}=VALUE)")
    if what.startswith("ignored explicit argument"):
        return f"{flag} is a switch and takes no value: write {flag} alone"
    return f"{flag}: {what}"


def _is_variable(token: str) -> bool:
    """A shell expansion the script's reader could not do, standing where an option or a word goes ('$ARGS',
    '"$@"', '--$OPT'); '--chunks=$C' is an option whose value is one."""
    return "$" in (token.partition("=")[0] if token.startswith("-") else token)


def _standalone_variables(tokens: list[str], valued: set[str]) -> list[int]:
    """Where shell variables stand alone in a trainer's argv (not as an option's value, which argparse takes as
    the next word when it does not start with '-'): each may hold any arguments."""
    out, i = [], 0
    while i < len(tokens):
        if _is_variable(tokens[i]):
            out.append(i)
        elif tokens[i] in valued and i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
            i += 1
        i += 1
    return out


def _without_other_layouts_options(layout: str, argv: list[str], findings: Findings) -> list[str]:
    """argv less the other layout's options (and --layout) with their values, refused in one finding that names
    them all and the script that has them."""
    prog, other = SCRIPTS[layout], SCRIPTS["stage" if layout == "replica" else "replica"]
    theirs = {a.flag for a in ARGS if layout not in a.layouts} | {"--layout"}
    tokens, foreign, i = [], [], 0
    while i < len(argv):
        name, eq, _ = argv[i].partition("=")
        if name in theirs:
            foreign.append(name)
            takes = name == "--layout" or ARG[name[2:].replace("-", "_")].kind is not None
            i += 2 if takes and not eq and i + 1 < len(argv) and not argv[i + 1].startswith("-") else 1
            continue
        tokens.append(argv[i])
        i += 1
    if foreign:
        names = list(dict.fromkeys(foreign))
        options = [n for n in names if n != "--layout"]
        why = (["the script sets the layout"] if "--layout" in names else []) + (
            [f"{', '.join(options)} {'is' if len(options) == 1 else 'are'} {other}'s"] if options else [])
        findings.error("bad-layout", f"{prog} has no {', '.join(names)} ({'; '.join(why)}); " + (
            f"use {other} for the {TRAINERS[other]} layout" if options else "remove it"))
    return tokens


def read_trainer_argv(layout: str, argv: Sequence[str], shell: bool = False) -> TrainerLine:
    """Read a trainer's argv as its argparse does: the trainers' parse_args and the checker both call this, so the
    checker's findings on a line are the trainer's own refusals. shell=True (the checker): a token with '$' is a
    shell expansion the script's reader could not do; as an option's value that option is unknown, alone it may hold
    any arguments, so every argument it could set is unknown (those given after it are not: they win)."""
    prog, mine = SCRIPTS[layout], {a.flag: a for a in ARGS if layout in a.layouts}
    findings = Findings()
    tokens = _without_other_layouts_options(layout, list(argv), findings)
    standalone = _standalone_variables(tokens, {f for f, a in mine.items() if a.kind is not None}) if shell else []
    parser = _reading_parser(layout)
    try:
        ns, extras = parser.parse_known_args(tokens)
    except ArgumentError as exc:
        findings.error("bad-argument", _argparse_refusal(str(exc)))
        ns, extras = parser.parse_known_args([])
    value_of_unknown = False  # a word after an unknown option is taken as its value, said with it
    for tok in extras:
        if shell and _is_variable(tok):  # a standalone variable (below)
            value_of_unknown = False
        elif tok.startswith("-") and len(tok) > 1:
            findings.error("unknown-argument", unknown_option(tok, mine, prog))
            value_of_unknown = "=" not in tok
        elif not value_of_unknown:
            findings.error("unknown-argument", f"{tok!r} is not an option of {prog}: its arguments are all "
                           "--name VALUE or --switch")
        else:
            value_of_unknown = False
    line = TrainerLine(ns, findings, [], help=bool(ns.help))
    for a in mine.values():
        raw = getattr(ns, a.dest)
        if raw is None or raw is False:
            setattr(ns, a.dest, a.gpu if a.group != "model" else None)
            continue
        line.given.append(a.dest)
        if shell and isinstance(raw, str) and "$" in raw and a.group != "files":  # (paths: nothing judges them)
            line.unknown.append(a.dest)
            line.unchecked.append(f"{a.flag} {raw}")
            setattr(ns, a.dest, None if a.group == "model" else a.gpu)
            continue
        value, problem = a.convert(raw)
        if problem:
            findings.error(a.code, problem)
        setattr(ns, a.dest, value)
    del ns.help
    for i in standalone:
        line.standalone.append(tokens[i])
        line.unchecked.append(tokens[i])
    if standalone:
        after = {tok.partition("=")[0] for tok in tokens[standalone[-1] + 1:]}
        line.unknown += [a.dest for f, a in mine.items() if f not in after and a.dest not in line.unknown]
    if findings.errors:  # the trainer does not start: judge nothing else on this line
        line.unknown = [a.dest for a in mine.values()]
    return line


def parse_trainer_args(layout: str, argv: Sequence[str] | None = None, doc: str | None = None) -> argparse.Namespace:
    """A trainer's parse_args: its values (None where the GPU or CPU default applies: resolve_defaults), or
    ArgumentError with the line's refusals; --help prints the help and exits."""
    line = read_trainer_argv(layout, sys.argv[1:] if argv is None else argv)
    if line.findings.errors:
        raise ArgumentError(refusal_text(line.findings.errors), line.findings)
    if line.help:
        trainer_parser(layout, doc).print_help()
        sys.exit(0)
    return line.values


def resolve_defaults(values: argparse.Namespace, cuda: bool) -> argparse.Namespace:
    """Fill the model's arguments the line left out with the GPU or CPU default (the trainer, and --check-args)."""
    for dest, default in (GPU_DEFAULTS if cuda else CPU_DEFAULTS).items():
        if getattr(values, dest, None) is None:
            setattr(values, dest, default)
    if getattr(values, "lr", 0) is None and getattr(values, "d_model", None):
        values.lr = default_lr(values.d_model)
    return values


def training_from_args(values: argparse.Namespace | dict, layout: str,
                       names: Iterable[str] | None = None) -> Training:
    """The Training of a trainer's arguments (`names`: only those, the others left at Training's defaults)."""
    given = vars(values) if isinstance(values, argparse.Namespace) else dict(values)
    names = set(given if names is None else names)
    t = Training(layout=layout)
    for a in ARGS:
        if a.dest not in names or a.dest not in given or layout not in a.layouts:
            continue
        if a.dest in TRAINING_FIELDS:
            setattr(t, a.dest, given[a.dest])
        elif a.group == "model" and given[a.dest] is not None:
            t.model[a.dest] = given[a.dest]
    return t


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
    node_gpus: list[str]  # the node's GPUs behind those indices, as Slurm and nvidia-smi number them
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


def arch_of(capability: tuple[int, int] | None) -> str:
    """The ARCHS key of a CUDA compute capability (None: the CPU). sm80 and later have bf16 and FlashAttention; the
    trainers, the GPU benchmarks and the checker's -C reading (V100: sm70) share it."""
    return "cpu" if capability is None else "sm80" if tuple(capability) >= (8, 0) else "sm70"


def requested_arch(v100: bool) -> tuple[str, str]:
    """The ARCHS key and the low precision (bf16, or fp16 where there is none) of the GPUs a request gets, read
    from -C or the partition: a V100 is compute capability 7.0, the A100 and H100 8.0 and 9.0 (arch_of)."""
    arch = arch_of((7, 0) if v100 else (8, 0))
    return arch, "bf16" if arch == "sm80" else "fp16"


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


@functools.lru_cache(maxsize=1024)
def _stage_zero(d: int, dh: int, vocab: int, layers: int, first: bool, last: bool, replicas: int) -> int:
    """The most elements one rank of a stage's dp group owns under ZeroRedundancyOptimizer."""
    params = (([vocab * d] if first else []) + _layer_params(d, dh) * layers
              + ([dh * d, dh, 2 * dh, 2] if last else []))
    return _zero_owned(tuple((n, 0) for n in params), 1, replicas)[0]


def _zero_shares(params: list[tuple[int, int]], nb_part: int, replicas: int) -> list[int]:
    """Per part, the most parameter elements any one rank owns there under ZeroRedundancyOptimizer."""
    return list(_zero_owned(tuple(params), nb_part, replicas))


@functools.lru_cache(maxsize=1024)
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
    """Encoder: embedding (fp32: autocast leaves it alone) + positions, dropout; output e."""
    E = 4 * z.d * z.n
    t.op(emb=E)
    t.op("emb", e=E)
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
    t.op(etmp=0 if z.cpu else 32 * z.n + 4 * z.d * (z.n // 4 + min(z.n, z.vocab)))
    t.op("etmp", "g", new_emb=V)
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


@functools.lru_cache(maxsize=4096)
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


@functools.lru_cache(maxsize=4096)
def _backward(kind: str, z: _Dims, ckpt: bool, mode: str) -> tuple[dict, int]:
    """One block's backward for one micro-batch, gradients by `mode`: its peak as terms, and its weight gradients."""
    ckpt = ckpt and kind == "layer"
    t = (_layer_backward(z, mode, ckpt) if kind == "layer" else
         _encoder_backward(z, mode) if kind == "enc" else _decoder_backward(z, mode))
    grads = sum(n for k, n in t.alive.items() if k.startswith("grad_"))
    return _terms(t.at_peak, _forward(kind, z, ckpt)["names"], recomputed=ckpt), grads


@functools.lru_cache(maxsize=4096)
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


@functools.lru_cache(maxsize=1024)
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
    arch, low = requested_arch(v100)
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
    # Only without a GPU (gloo): before 2.8, pipelining's _batch_p2p waited on one of the requests gloo returns for a
    # batch (`batch_isend_irecv(ops).pop()` in 2.4.1 and 2.6.0 schedules.py; pytorch/pytorch#132644, fixed by
    # #152938); nccl coalesces a batch into one request. The hangs measured here: docs/releases.md.
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


def check_arguments(t: Training, cpu: bool = False) -> Findings:
    """The trainers' refusals that need several arguments at once, on the values the trainer runs (the line's, else
    the GPU or CPU defaults). One function for the trainers and the checker: check_training calls it. Each value's
    own type and range are the definition's (Arg.convert, in read_trainer_argv)."""
    findings = Findings()
    if t.resume and not t.save and t.known("save"):
        findings.error("bad-argument", "--resume continues from the --save file, and no --save was given: add --save "
                       "PATH (the templates use --save NAME.pt --resume), or start from a file with --load PATH")
    model = model_args(t, cpu)
    d, h = model["d_model"], model["n_head"]
    if not t.known("d_model", "n_head") or d < 1 or h < 1:
        return findings
    if d % h:
        findings.error("bad-argument", f"--d-model ({d}) must be a multiple of --n-head ({h}): each head gets "
                       f"d_model / n_head dimensions; try --n-head {max(x for x in divisors(d) if x <= h)}")
    if d % 2:
        step = h * 2 // math.gcd(h, 2)
        findings.error("bad-argument", f"--d-model ({d}) must be even (the positional encoding takes sines and "
                       f"cosines in pairs); try --d-model {(d // step + 1) * step}")
    return findings


def check_training(nb_part: int, t: Training, findings: Findings, cpu: bool = False) -> None:
    """The model and batch against the split: check_arguments, layers per part, chunks per batch. What the line
    leaves unknown (a shell variable: t.unknown) is not judged, and no default is judged in its place."""
    findings.extend(check_arguments(t, cpu))
    model = model_args(t, cpu)  # the trainer's defaults where the line gives nothing
    nlayers, chunks, batch = model["nlayers"], model["chunks"], model["batch_size"]
    if nb_part >= 1 and t.known("nlayers", "nb_part"):
        if nlayers < nb_part:
            findings.error("nlayers-below-nb-part",
                           f"--nlayers={nlayers} < nb_part={nb_part}: {nb_part - nlayers} GPU(s) of each task would "
                           f"hold no Layer block (idle); use --nlayers >= {nb_part} or fewer GPUs per task "
                           f"(more --ntasks-per-node, or --nb-part {max(1, nlayers)})")
        elif nlayers % nb_part:
            sizes = part_sizes(nlayers, nb_part)
            more = [p for p, n in enumerate(sizes) if n > min(sizes)]
            which = (f"parts {', '.join(map(str, more[:-1]))} and {more[-1]} get" if len(more) > 1
                     else f"part {more[0]} gets")
            findings.warn("nlayers-not-multiple",
                          f"--nlayers={nlayers} is not a multiple of nb_part={nb_part}: {which} "
                          f"{max(sizes)} layers, the others {min(sizes)} (layers per part {sizes}); the slowest "
                          f"part sets the pace: try --nlayers {nlayers - nlayers % nb_part} or "
                          f"{nlayers + nb_part - nlayers % nb_part}")
    if not t.known("chunks", "batch_size"):
        pass
    elif chunks < 1 or batch < 1:
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
    if t.known("engine") and t.engine not in ENGINES:
        findings.error("bad-engine", f"--engine={t.engine!r} is not one of {', '.join(ENGINES)}")
    if t.layout == "stage" and t.precision == "fp16" and t.known("precision"):
        findings.error("fp16-stage", "--precision fp16 needs a GradScaler around backward, but the stage layout's "
                       "schedules (torch.distributed.pipelining) run backward themselves; use --precision bf16, or "
                       "fp16 with bench_ddp_transformer.py (the replica layout)")


def stages_per_rank(schedule: str, virtual: int) -> int:
    return virtual if schedule in MULTI_STAGE else 1


def check_stage(world: int, tasks_per_node: list[int], gpus_per_node: int | None, t: Training,
                findings: Findings, cpu: bool = False) -> int:
    """The stage layout (bench_stage.py): a task per GPU, pipelines of --pp consecutive tasks. Returns the stages per
    pipeline (0 where the line leaves the pipelines unknown: nothing that depends on them is judged)."""
    pp, v = t.pp, stages_per_rank(t.schedule, t.virtual_stages)
    chunks = model_args(t, cpu)["chunks"]
    if t.known("schedule") and t.schedule not in SCHEDULES:
        findings.error("bad-schedule", f"--schedule {t.schedule!r} is not one of {', '.join(SCHEDULES)}")
    if not t.known("pp", "schedule", "virtual_stages"):
        return 0
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
    if not t.known("chunks"):
        return pp * v
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
    if nb_part < 2 or chunks < 1 or chunks >= 4 * nb_part or not t.known("chunks", "batch_size", "nb_part"):
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


def check_trainer_task(layout: str, values: argparse.Namespace, plan: TaskPlan, launch: idr_torch.Launch,
                       cuda: bool, torch_version: str, findings: Findings) -> None:
    """What a trainer refuses before it builds anything, given its arguments (defaults filled) and this task's
    plan: the pipelines (stage layout), the model and batch against the split (check_training, which runs
    check_arguments), and what this torch release lacks. The trainers' make_plan and their --check-args call it."""
    t = training_from_args(values, layout)
    if layout == "stage":
        parts = check_stage(launch.size, launch.tasks_per_node, launch.gpus_on_node, t, findings, cpu=not cuda)
    else:
        parts = plan.nb_part
    check_training(parts, t, findings, cpu=not cuda)
    for line in torch_refusals(torch_version, t, cpu=not cuda):  # what this release lacks
        findings.error("torch-release", line)


def visible_gpus_here(launch: idr_torch.Launch) -> list[str]:
    """The GPUs this task would use, found without torch: CUDA_VISIBLE_DEVICES (Slurm sets it for --gres and
    --gpus*), else the node's /dev/nvidiaN devices, which CUDA enumerates when nothing restricts it."""
    if "CUDA_VISIBLE_DEVICES" in launch.env:
        return launch.visible_gpus
    return [str(i) for i in range(sum(1 for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)))]


def installed_torch_version() -> str | None:
    """The release of the torch the trainer would import, read without importing it: its torch/version.py, else
    its package metadata; None where there is no torch."""
    import importlib.metadata
    import importlib.util
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    version = Path(spec.origin).parent / "version.py"
    m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", version.read_text(), re.M) if version.is_file() else None
    try:
        return m.group(1) if m else importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_args(layout: str, argv: Sequence[str], environ: dict[str, str] | None = None
               ) -> tuple[int, Findings, TaskPlan | None]:
    """Judge a trainer's line as the trainer does before it touches a GPU: this task's plan from the launcher's
    environment (idr_torch, whose LaunchError it raises as the trainer does), GPU or CPU defaults from the GPUs it
    sees, the torch release installed. Returns the trainer's exit status (0; 1: a refusal; 2: a line its argparse
    refuses), what it says, and the plan."""
    try:
        values = parse_trainer_args(layout, argv)
    except ArgumentError as exc:
        return 2, exc.findings, None
    findings = Findings()
    launch = idr_torch.Launch(environ) if environ is not None else idr_torch.current()
    launch.master_port  # noqa: B018 -- idr_torch's rule for MASTER_PORT (1..65535), which the trainer's rendezvous reads
    version = installed_torch_version()
    if version is None:
        findings.error("torch-release", "torch is not installed for this python: load the cluster's PyTorch module "
                       "(module load pytorch-gpu/py3/...) or pip install torch")
        return 1, findings, None
    visible = visible_gpus_here(launch)
    resolve_defaults(values, cuda=bool(visible))
    plan = plan_task(launch.rank, launch.node_id, launch.local_rank, launch.local_world_size, visible,
                     launch.gpus_on_node, values.nlayers, 1 if layout == "stage" else values.nb_part, findings,
                     getattr(values, "devices", None))
    check_trainer_task(layout, values, plan, launch, bool(visible), version, findings)
    return (1 if findings.errors else 0), findings, plan


def check_args_main(layout: str, argv: Sequence[str], environ: dict[str, str] | None = None) -> int:
    """A trainer's --check-args: check_args, printed as the trainer prints (warnings and the verdict from rank 0,
    a launcher error from every rank), and its exit status. No torch import: it takes a tenth of a second."""
    prog = SCRIPTS[layout].removesuffix(".py")
    env = os.environ if environ is None else environ
    first = (env.get("RANK") or env.get("SLURM_PROCID") or "0").strip() in ("0", "")  # as the trainer's cli()
    try:
        status, findings, plan = check_args(layout, argv, environ)
    except idr_torch.LaunchError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    if first:
        for f in findings:
            if f.level != "error":
                print(f"check_topology: {f}", flush=True)
    if status:
        if first:
            print(f"{prog}: error: {refusal_text(findings.errors)}", file=sys.stderr, flush=True)
    elif first:
        where = f"GPUs {','.join(plan.node_gpus)}" if plan.node_gpus else "the CPU"
        print(f"{prog}: --check-args: task {plan.rank} would start: {plan.nb_part} part(s) on {where}, "
              f"{'CPU' if plan.cpu else 'GPU'} defaults", flush=True)
    return status


# ---- I.7 Speed: a split's step time from a profile -------------------------------------------------------------------
# The model behind `--advise --profile FILE`: the step time of a split, in terms a user can read, from what
# benchmarks/speed_profile.py measured in the allocation. The pipeline is simulated op by op in each layout's own order
# (the shape of Megatron-LM's (m + p - 1) x (t_f + t_b), Narayanan et al. 2021 sec. 2.2, but with each part's own
# times, so unequal parts and parts that share a device come out right): GPipe's fill and drain (fairscale's and
# torch 2.3's Pipe: every forward, then every backward), 1F1B and the interleaved schedules (stage_actions, the
# order torch.distributed.pipelining runs). Parts on different devices overlap as that order allows; parts that
# share one (--devices 0,0, the CPU) run one after the other. To that come the engine's cost per micro-batch, DDP's
# all-reduce where the backward does not hide it, and the optimizer. Every constant comes from the profile: none
# is built in, and none was taken on a GPU here.

# The distance to the physical limit. flops_per_sample counts the model's matmul FLOPs from its shapes (what
# torch.utils.flop_counter counts: tests/test_speed.py holds the two equal); PEAK_TFLOPS are NVIDIA's dense
# (no sparsity) tensor-core peaks of the SXM parts, per precision, from their data sheets (V100: Volta whitepaper,
# 125 TF fp16 and 15.7 fp32, no bf16 or TF32; A100: 312 bf16/fp16, 156 TF32, 19.5 fp32; H100 SXM: 989, 495, 67;
# H200: H100's compute). A PCIe card peaks lower: the share is then an underestimate.
PEAK_TFLOPS = {  # GPU family (a word of torch.cuda.get_device_name): {matmul precision: dense TFLOP/s}
    "V100": {"fp32": 15.7, "fp16": 125.0},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "H100": {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0},
    "H200": {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0},
}


def flops_per_sample(model: dict) -> float:
    """The matmul FLOPs of one training sample of the kit's Transformer: forward + backward = 3 x forward (the
    backward computes the gradients of the inputs and of the weights, each a forward's worth), the convention of
    model FLOPs utilisation (PaLM, Chowdhery et al. 2022, appendix B): activation checkpointing's recomputation is
    not counted. Per Layer: the q, k, v and output projections 4 x 2 s d^2, the feed-forward 2 x 2 s d d_hid, the
    attention scores and their weighted sum 2 x 2 s^2 d; the Decoder's head 2 (d d_hid + 2 d_hid). The embedding is
    a lookup, LayerNorm, softmax and the adds are not matmuls (a few % more on the GPU, uncounted as everywhere)."""
    d, f, s = model["d_model"], model["d_hid"], model["seq_len"]
    layer = 2 * s * (4 * d * d + 2 * d * f) + 4 * s * s * d
    return 3.0 * (model["nlayers"] * layer + 2 * (d * f + f * 2))


def peak_tflops(gpu_name: str | None, precision: str, tf32: bool = False) -> float | None:
    """The dense peak of this GPU for the precision its matmuls run in (fp32, TF32 under --tf32, bf16, fp16), or
    None where PEAK_TFLOPS does not know the GPU or it has no such unit (a V100's bf16; --tf32 on a V100 runs fp32)."""
    kind = "tf32" if precision == "fp32" and tf32 else precision
    for family, peaks in PEAK_TFLOPS.items():
        if gpu_name and family in gpu_name.upper():
            return peaks.get(kind, peaks["fp32"] if kind == "tf32" else None)  # no TF32 unit: fp32 matmuls
    return None


PROFILE_FORMAT = "kit-profile/1"
PROFILE_MODEL = ("d_model", "n_head", "d_hid", "seq_len", "vocab_size", "dropout")  # what a profile is taken for
# DistributedDataParallel's buckets: bucket_cap_mb=25, and the first bucket 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES),
# filled in reverse order of model.parameters() (torch/nn/parallel/distributed.py, 2.3.1 to 2.14.1)
DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES = 25 * 2 ** 20, 2 ** 20
SPEED_TERMS = ("compute", "bubble", "per_micro_batch", "communication", "optimizer")


class ProfileError(ValueError):
    """A profile that cannot be used here: one line, with the fix."""


MAX_PROFILE_BYTES = 2 ** 20  # a profile is about 25 kB (docs/cpu_profile.json); more is not one speed_profile.py wrote
_COUNT = ("count", 1, 4096)  # tasks, threads, replicas: an integer in range
_SECONDS = ("seconds",)  # a time: a finite number, 0 to a day
_POINTS = ("points", 3)  # [micro-batch, forward s, backward s] rows, the first column increasing (_interpolate)
_LAYERS = ("arg", "nlayers")  # the trainer's own range (ARGS): one owner
# What the speed model reads of a profile (benchmarks/speed_profile.py writes it), each value's type and range, so
# that no lookup, division or loop of the model can fail or run long on a damaged or hostile file. A key ending in
# '?' may be missing; other keys are not read.
PROFILE_SCHEMA = {
    "format": ("text",), "device": ("choice", "cpu", "cuda"),
    "key": {"model": ("model",), "nlayers?": _LAYERS, "gpu?": ("text",), "torch?": ("text",),
            "node_type?": ("optional", ("text",))},
    "compute": ("list", {"tasks": _COUNT, "threads?": ("optional", _COUNT), "nlayers": _LAYERS,
                         "blocks": ("map", _POINTS), "whole?": ("map", _POINTS),
                         "engine?": ("optional", {"per_micro_batch_part_s?": ("optional", _SECONDS)})}),
    "optimizer": {"Encoder": _SECONDS, "Layer": _SECONDS, "Decoder": _SECONDS},
    "engine": {"per_step_s": _SECONDS, "per_micro_batch_part_s": _SECONDS},
    "replica_step?": ("optional", ("list", {"tasks": _COUNT, "threads?": ("optional", _COUNT), "replicas": _COUNT,
                                            "micro": ("count", 1, 65536), "nlayers": _LAYERS, "step_s": _SECONDS})),
    "stage_engine?": ("optional", {"per_step_s": _SECONDS, "per_micro_batch_stage_s": _SECONDS}),
    "stage_step?": ("optional", {"tasks": _COUNT, "threads?": ("optional", _COUNT), "pp": ("count", 2, 16),
                                 "replicas": _COUNT, "schedule": ("choice", *SCHEDULES), "nlayers": _LAYERS,
                                 "points": ("optional", ("steps",))}),
    "allreduce": {"node?": ("optional", {"tasks": _COUNT, "points": ("optional", ("points", 2))}),
                  "nodes?": ("optional", {"tasks": _COUNT, "points": ("optional", ("points", 2))})},
    "p2p?": ("optional", ("points", 2)),
}
MAX_ROWS = 256  # rows of a table, entries of a list or map: speed_profile.py writes at most a few tens


def _number(value: object, where: str, lo: float, hi: float, integer: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ProfileError(f"{where} is {_shown(value)}, not {'an integer' if integer else 'a number'}")
    if not lo <= value <= hi:  # NaN and infinities never reach here: the JSON reader refuses them
        raise ProfileError(f"{where} is {_shown(value)}, outside {_show(lo)} to {_show(hi)}")


def _shown(value: object) -> str:
    try:
        text = repr(value) if isinstance(value, str) else json.dumps(value)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _check_rows(rows: object, where: str, columns: int, increasing: bool) -> None:
    """A table of `columns` numbers a row: the first a positive size (increasing: _interpolate's x), the others
    seconds; the stage layout's steps ("steps") are [micro-batch, micro-batches, seconds > 0]."""
    if not isinstance(rows, list) or not 1 <= len(rows) <= MAX_ROWS:
        raise ProfileError(f"{where} is {_shown(rows)}, not a list of 1 to {MAX_ROWS} rows")
    for n, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != columns:
            raise ProfileError(f"{where}[{n}] is {_shown(row)}, not {columns} numbers")
        if increasing:
            _number(row[0], f"{where}[{n}][0]", 1e-9 if n == 0 else rows[n - 1][0] + 1e-9, 1e15)
            for k in range(1, columns):
                _number(row[k], f"{where}[{n}][{k}]", 0, 86400)
        else:
            _number(row[0], f"{where}[{n}][0]", 1, ARG["batch_size"].hi, integer=True)
            _number(row[1], f"{where}[{n}][1]", 1, 64, integer=True)
            _number(row[2], f"{where}[{n}][2]", 1e-9, 86400)


def _check_value(value: object, spec: object, where: str) -> object:
    """`value` against its PROFILE_SCHEMA entry; returns it (a model's values converted by ARGS)."""
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise ProfileError(f"{where} is {_shown(value)}, not an object")
        for key, inner in spec.items():
            name = key.rstrip("?")
            if name in value:
                value[name] = _check_value(value[name], inner, f"{where}.{name}")
            elif not key.endswith("?"):
                raise ProfileError(f"{where} has no {name}: the file was cut short or edited")
        return value
    kind, *args = spec
    if kind == "optional":
        return None if value is None else _check_value(value, args[0], where)
    if kind in ("list", "map"):
        items = list(enumerate(value)) if isinstance(value, list) else list(value.items()) \
            if isinstance(value, dict) else None
        if items is None or not 1 <= len(items) <= MAX_ROWS:
            raise ProfileError(f"{where} is {_shown(value)}, not a {kind} of 1 to {MAX_ROWS} entries")
        for k, item in items:
            value[k] = _check_value(item, args[0], f"{where}[{_shown(k)}]")
        return value
    if kind in ("points", "steps"):
        _check_rows(value, where, args[0] if kind == "points" else 3, kind == "points")
    elif kind == "seconds":
        _number(value, where, 0, 86400)
    elif kind == "count":
        _number(value, where, args[0], args[1], integer=True)
    elif kind in ("text", "choice"):
        if not isinstance(value, str) or len(value) > 200 or (kind == "choice" and value not in args):
            raise ProfileError(f"{where} is {_shown(value)}, not " + ("one of " + ", ".join(args) if kind == "choice"
                                                                      else "a name"))
    elif kind == "arg":
        return _profile_arg(value, args[0], where)
    elif kind == "model":
        if not isinstance(value, dict):
            raise ProfileError(f"{where} is {_shown(value)}, not an object")
        return {k: _profile_arg(value[k], k, f"{where}.{k}") for k in PROFILE_MODEL if k in value}
    return value


def _profile_arg(value: object, dest: str, where: str) -> object:
    """A model value of the profile, refused as the command line refuses it (ARGS: the same ranges and words)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{where} is {_shown(value)}, not a number")
    converted, problem = ARG[dest].convert(str(value))
    if problem:
        raise ProfileError(f"{where}: {problem}")
    return converted


def _profile_text(path: str | os.PathLike) -> str:
    """The file's text, read bounded: a regular file only (a FIFO is never opened: it could block forever), at most
    MAX_PROFILE_BYTES, UTF-8."""
    import stat
    try:
        mode, size = os.stat(path).st_mode, os.stat(path).st_size
        if not stat.S_ISREG(mode):
            raise ProfileError(f"--profile {path} is {'a directory' if stat.S_ISDIR(mode) else 'not a regular file'}"
                               ": give the JSON file benchmarks/speed_profile.py wrote")
        if size > MAX_PROFILE_BYTES:
            raise ProfileError(f"--profile {path} holds {size} bytes, more than a profile ({MAX_PROFILE_BYTES >> 20} "
                               "MiB at most; speed_profile.py writes about 25 kB): give the profile's file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            data = os.read(fd, MAX_PROFILE_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ProfileError(f"--profile {path}: cannot read it ({exc.strerror}); take one with "
                           "benchmarks/speed_profile.py (docs/speed.md)") from None
    try:
        return data[:MAX_PROFILE_BYTES].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProfileError(f"--profile {path} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}): "
                           "not a profile, or a damaged one; take it again with benchmarks/speed_profile.py") from None


def _json_number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:20]} is out of range")
    return value


def _json_integer(text: str) -> int:
    if len(text) > 30:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _json_constant(text: str) -> NoReturn:
    raise ValueError(f"{text} is not a number a profile holds")


def read_profile(path: str | os.PathLike) -> dict:
    """A profile written by benchmarks/speed_profile.py, read bounded and checked against PROFILE_SCHEMA, so that
    the model's lookups cannot fail later: a damaged, cut, foreign or hostile file is one line (ProfileError)."""
    text = _profile_text(path)
    try:
        profile = json.loads(text, parse_float=_json_number, parse_int=_json_integer, parse_constant=_json_constant)
    except (ValueError, RecursionError) as exc:
        why = "nested too deep" if isinstance(exc, RecursionError) else str(exc)[:80]
        raise ProfileError(f"--profile {path} is not JSON ({why}); take it again with "
                           "benchmarks/speed_profile.py") from None
    if not isinstance(profile, dict) or profile.get("format") != PROFILE_FORMAT:
        found = profile.get("format") if isinstance(profile, dict) else type(profile).__name__
        raise ProfileError(f"--profile {path}: format {_shown(found)}, not {PROFILE_FORMAT!r} "
                           "(benchmarks/speed_profile.py writes it); take it again with this kit")
    missing = [k for k in ("key", "device", "compute", "optimizer", "engine", "allreduce") if k not in profile]
    if missing or not profile["compute"]:
        raise ProfileError(f"--profile {path} has no {', '.join(missing) or 'compute'}: it was cut short; take it "
                           "again with benchmarks/speed_profile.py")
    try:
        _check_value(profile, PROFILE_SCHEMA, "profile")
        for name, table in profile["allreduce"].items():  # a ring of n tasks: 2(n-1)/n, timed with n >= 2
            if name in ("node", "nodes") and table and table.get("points") and table["tasks"] < 2:
                raise ProfileError(f"profile.allreduce.{name} has all-reduce times but tasks {table['tasks']}")
    except ProfileError as exc:
        raise ProfileError(f"--profile {path}: {exc}; take it again with benchmarks/speed_profile.py") from None
    return profile


def profile_gpu_mismatch(profile: dict, ntype: str | None) -> str | None:
    """Where the profile's GPU (speed_profile.py's torch.cuda.get_device_name) is another family than the plan's
    Jean Zay nodes (V100, A100, H100): the line that says which."""
    family = lambda text: (re.search(r"[vah]100", (text or "").lower()) or [None])[0]  # noqa: E731
    taken, planned = family(profile["key"].get("gpu")), family(ntype)
    if taken and planned and taken != planned:
        return (f"it was taken on {profile['key']['gpu']} GPUs and the plan is for {JEAN_ZAY[ntype].label}: a "
                "profile's times hold for its GPU only; take one there (docs/speed.md)")
    return None


def profile_mismatch(profile: dict, model: dict) -> str | None:
    """Where the profile was taken for another model block than `model` (--nlayers may differ: a Layer is timed
    once), the one line that says which argument and the fix."""
    taken = profile["key"].get("model", {})
    for name in PROFILE_MODEL:
        if name in taken and name in model and float(taken[name]) != float(model[name]):
            return (f"the profile was taken with --{name.replace('_', '-')} {_show(taken[name])}, the plan has "
                    f"{_show(model[name])}: give the profile's value, or take the profile again with yours")
    return None


def _interpolate(points: list, x: float, column: int = 1) -> float:
    """Piecewise linear in x through measured [x, y...] points; past the last, the last segment's slope (compute
    grows linearly with the micro-batch once the device is busy); below the first, the first value."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][column]
    for (x0, *y0), (x1, *y1) in zip(points, points[1:]):
        if x <= x1:
            return y0[column - 1] + (y1[column - 1] - y0[column - 1]) * (x - x0) / (x1 - x0)
    if len(points) == 1:
        return points[0][column] * x / xs[0]
    (x0, *y0), (x1, *y1) = points[-2], points[-1]
    return y1[column - 1] + max(0.0, (y1[column - 1] - y0[column - 1]) / (x1 - x0)) * (x - x1)


def _nearest(records: list[dict], profile: dict, tasks: int, threads: int | None) -> tuple[dict, float]:
    """The record (a compute context, a real step) timed with this many intra-op threads per task and tasks at work
    on a node, or the nearest; and how much slower a CPU task runs when the split starts more threads than the
    node has cores (they take turns). threads None: the trainer's own, the node's cores // tasks (cpu_threads)."""
    if profile["device"] != "cpu":
        return min(records, key=lambda c: (abs(c["tasks"] - tasks), -c["tasks"])), 1.0
    cores = max(c["tasks"] * (c.get("threads") or 1) for c in profile["compute"])
    want = threads or max(1, cores // tasks)
    rec = min(records, key=lambda c: (abs((c.get("threads") or 1) - want), abs(c["tasks"] - tasks), -c["tasks"]))
    return rec, max(1.0, tasks * want / cores)


def _context(profile: dict, tasks: int, threads: int | None = None) -> tuple[dict, float]:
    return _nearest(profile["compute"], profile, tasks, threads)


def _block_times(ctx: dict, kind: str, precision: str, ckpt: bool, micro: float) -> tuple[float, float]:
    key = f"{kind}|{precision}|{int(ckpt and kind == 'Layer')}"
    if key not in ctx["blocks"]:
        raise ProfileError(f"the profile has no {precision} timings of the {kind}"
                           + (" with activation checkpointing" if ckpt and kind == "Layer" else "")
                           + f"; take it with --precisions {precision} (benchmarks/speed_profile.py)")
    points = ctx["blocks"][key]
    return _interpolate(points, micro, 1), _interpolate(points, micro, 2)


def _blocks_of(nlayers: int, nb_part: int, j: int) -> list[tuple[str, int]]:
    layers = part_sizes(nlayers, nb_part)[j]
    return [("Layer", layers)] + [("Encoder", 1)] * (j == 0) + [("Decoder", 1)] * (j == nb_part - 1)


def _bare(ctx: dict, blocks: list[tuple[str, int]], t: "Training", micro: float) -> tuple[float, float]:
    times = [(n, _block_times(ctx, k, t.precision, t.activation_checkpointing, micro)) for k, n in blocks]
    return sum(n * f for n, (f, _) in times), sum(n * b for n, (_, b) in times)


def _pipe_scale(profile: dict, ctx: dict, t: "Training", micro: float) -> tuple[float, float]:
    """How much slower the blocks run inside the replica layout's Pipe than bare: the whole model timed in it (one
    part, one chunk, less the engine's own cost) against its bare blocks (speed_profile.time_whole)."""
    whole = ctx.get("whole", {}).get(f"{t.precision}|{int(t.activation_checkpointing)}")
    if not whole:
        return 1.0, 1.0
    engine = profile["engine"]
    fixed = (engine["per_step_s"] + engine["per_micro_batch_part_s"]) / 2
    f, b = _bare(ctx, _blocks_of(ctx["nlayers"], 1, 0), t, micro)
    wf, wb = _interpolate(whole, micro, 1) - fixed, _interpolate(whole, micro, 2) - fixed
    return max(wf, 0.5 * f) / f, max(wb, 0.5 * b) / b


def _overlap(chunks: int, pp: int) -> float:
    """The share of a pipeline's clocks in which its stages all compute at once: (m - 1) / (m + p - 1)."""
    return (chunks - 1) / (chunks + pp - 1)


def _least_squares(rows: list[list[float]], rhs: list[float], free: list[bool]) -> list[float]:
    """min |rows x - rhs| over the unknowns marked free (the others 0), by the normal equations (a handful of
    unknowns: Gauss-Jordan with partial pivoting)."""
    idx = [j for j, f in enumerate(free) if f]
    a = [[sum(r[i] * r[j] for r in rows) for j in idx] + [sum(r[i] * y for r, y in zip(rows, rhs))] for i in idx]
    n = len(idx)
    for col in range(n):
        pivot = max(range(col, n), key=lambda k: abs(a[k][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if abs(a[col][col]) < 1e-300:
            return [0.0] * len(free)
        for k in range(n):
            if k != col:
                ratio = a[k][col] / a[col][col]
                a[k] = [x - ratio * y for x, y in zip(a[k], a[col])]
    out = [0.0] * len(free)
    for k, j in enumerate(idx):
        out[j] = a[k][n] / a[k][k]
    return out


def _stage_fit(profile: dict, model: dict, t: "Training") -> dict | None:
    """The stage layout as it really runs, from the profile's real steps (speed_profile.time_stage_steps: the real
    model, pp 2, 2 and 8 micro-batches of 1 to 64 samples): a factor on the bare blocks for each count of
    micro-batches (on a CPU the stages that compute at once share the memory: more of them with more micro-batches),
    a cost per micro-batch and stage, a cost per step. The prediction is linear in all of them (finite
    differences give the slopes), so they are its least squares fit to the steps, each step's error relative to
    it; over micro-batches of 1 to 64 samples the per-micro-batch cost and the blocks' share come apart. None where
    the profile has no real step (the tiny model's engine cost stands, the blocks bare)."""
    rec = profile.get("stage_step")
    if not rec or not rec.get("points"):
        return None
    plain = replace(t, precision="fp32", activation_checkpointing=False, schedule=rec["schedule"], zero=False)
    counts = sorted({c for _, c, _ in rec["points"]})
    rows, rhs = [], []
    for m, c, step in rec["points"]:
        run = dict(model, nlayers=rec["nlayers"], batch_size=m * c, chunks=c)
        at = lambda k, o: predict_speed(profile, run, plain, rec["pp"], rec["replicas"], rec["tasks"],  # noqa: E731
                                        threads=rec["threads"], stage_costs=(k, o, 0.0))["step_s"]
        base = at(1.0, 0.0)
        blocks, per_op = at(2.0, 0.0) - base, (at(1.0, 1e-3) - base) / 1e-3
        rows.append([(blocks if c == k else 0.0) / step for k in counts] + [per_op / step, 1.0 / step])
        rhs.append((step - base + blocks) / step)
    free = [True] * (len(counts) + 2)
    x = _least_squares(rows, rhs, free)
    while any(v < 0 for v in x[-2:]):  # a negative cost is noise: held at 0, the rest fitted again
        free[len(counts) + x[-2:].index(min(x[-2:]))] = False
        x = _least_squares(rows, rhs, free)
    return {"scales": [[_overlap(c, rec["pp"]), max(0.3, k)] for c, k in zip(counts, x)], "per_op": x[-2],
            "per_step": x[-1]}


def _stage_scale(fit: dict, overlap: float) -> float:
    """The fit's factor on the bare blocks at this overlap: linear between those measured (on GPUs it barely moves),
    the nearest past them."""
    points = fit["scales"]
    return _interpolate(points, min(max(overlap, points[0][0]), points[-1][0]))


def _part_costs(profile: dict, ctx: dict, model: dict, t: "Training", nb_part: int, micro: float,
                scale: float = 1.0) -> list[dict]:
    """Per part: forward and backward of one micro-batch (the replica layout's as its Pipe runs them, the stage
    layout's times `scale`), its gradients' bytes, its optimizer step."""
    opt = profile["optimizer"]
    sf, sb = (scale, scale) if t.layout == "stage" else _pipe_scale(profile, ctx, t, micro)
    out = []
    for j in range(nb_part):
        blocks = _blocks_of(model["nlayers"], nb_part, j)
        f, b = _bare(ctx, blocks, t, micro)
        numel, _ = _part_params(model, blocks[0][1], j == 0, j == nb_part - 1)
        out.append({"f": f * sf, "b": b * sb, "bytes": 4 * numel,
                    "optimizer": sum(n * opt[k] for k, n in blocks)})
    return out


def _queues(layout: str, schedule: str, stages: int, pp: int, chunks: int, shared: bool) -> list[list[tuple]]:
    """Each device's (or task's) ops in the order it runs them: (kind, stage, micro-batch). The replica layout's
    Pipe runs every forward, then every backward (GPipe, clock by clock); parts that share a device share one
    queue. The stage layout: a queue per task, torch.distributed.pipelining's order (stage_actions)."""
    if layout == "replica":
        fwd = sorted(((i + s, s, i) for s in range(stages) for i in range(chunks)))
        bwd = sorted((((chunks - 1 - i) + (stages - 1 - s), s, i) for s in range(stages) for i in range(chunks)))
        if shared:
            return [[("F", s, i) for _, s, i in fwd] + [("B", s, i) for _, s, i in bwd]]
        return [[("F", s, i) for _, q, i in fwd if q == s] + [("B", s, i) for _, q, i in bwd if q == s]
                for s in range(stages)]
    virtual = stages // pp
    queues = []
    for rank in range(pp):
        seen: dict = {}
        ops = []
        for kind, k in stage_actions(schedule, pp, virtual, chunks, rank):
            stage = rank + k * pp  # bench_stage.stage_ids: rank r holds stages r, r + pp, ...
            i = seen[kind, stage] = seen.get((kind, stage), -1) + 1
            ops.append((kind, stage, i))
        queues.append(ops)
    return queues


def _simulate(queues: list[list[tuple]], duration: Callable[[str, int], float], delay: float, stages: int
              ) -> tuple[float, dict]:
    """Each queue runs its ops in order, an op as soon as its queue is free and its inputs are there: a forward
    after the previous stage's forward of that micro-batch, a backward after its own forward and the next stage's
    backward (plus `delay` where they come from another queue: a send). Returns the makespan and each op's end."""
    owner = {s: q for q, ops in enumerate(queues) for _, s, _ in ops}
    end: dict = {}
    heads, free = [0] * len(queues), [0.0] * len(queues)
    left = sum(len(ops) for ops in queues)
    while left:
        moved = False
        for q, ops in enumerate(queues):
            while heads[q] < len(ops):
                kind, s, i = ops[heads[q]]
                deps = ([("F", s - 1, i)] if kind == "F" and s > 0 else []) + (
                    [("F", s, i)] + ([("B", s + 1, i)] if s < stages - 1 else []) if kind == "B" else [])
                if any(d not in end for d in deps):
                    break
                ready = max((end[d] + (delay if owner[d[1]] != q else 0.0) for d in deps), default=0.0)
                end[kind, s, i] = max(free[q], ready) + duration(kind, s)
                free[q] = end[kind, s, i]
                heads[q] += 1
                left -= 1
                moved = True
        if not moved:
            stuck = [ops[h] for ops, h in zip(queues, heads) if h < len(ops)]
            raise RuntimeError(f"pipeline schedule stalls at {stuck}")
    return max(free), end


def _allreduce_time(profile: dict, nbytes: float, replicas: int, across_nodes: bool) -> tuple[float, str | None]:
    """One all-reduce of `nbytes` among `replicas` tasks: the profile's table (between nodes where the replicas
    span nodes), scaled by a ring's 2(n-1)/n from the count it was timed with."""
    tables = profile["allreduce"]
    table = (tables.get("nodes") if across_nodes else None) or tables.get("node")
    note = None
    if across_nodes and table is tables.get("node"):
        note = "the all-reduce between nodes was not profiled (one node): estimated from one node's"
    if not table or not table.get("points"):
        raise ProfileError("the profile timed no all-reduce (it ran as one task): take it with the tasks per node "
                           "you train with (srun --ntasks-per-node=K ... benchmarks/speed_profile.py)")
    n = table["tasks"]
    ring = ((replicas - 1) / replicas) / ((n - 1) / n)
    return _interpolate(table["points"], nbytes) * ring, note


def _buckets(nbytes: int, first: bool) -> list[int]:
    """DDP's buckets of one device's gradients (the model's last parameters fill the first, 1 MiB, bucket)."""
    out, left = [], nbytes
    while left > 0:
        cap = DDP_FIRST_BUCKET_BYTES if first and not out else DDP_BUCKET_BYTES
        out.append(min(cap, left))
        left -= out[-1]
    return out


def _exposed_allreduce(profile: dict, ready: list[tuple[float, int]], makespan: float, replicas: int,
                       across: bool, notes: list[str]) -> float:
    """The all-reduce time the step waits for: buckets reduced one after the other as their gradients are ready
    (`ready`: (time, bytes) per part, the last part first). A GPU reduces while it computes (its own stream);
    a CPU's cores are the ones computing, so there none of it is hidden."""
    done, total, first = 0.0, 0.0, True
    for at, nbytes in sorted(ready):
        for size in _buckets(nbytes, first):
            cost, note = _allreduce_time(profile, size, replicas, across)
            if note and note not in notes:
                notes.append(note)
            done, total, first = max(done, at) + cost, total + cost, False
    return total if profile["device"] == "cpu" else max(0.0, done - makespan)


def _step_residual(profile: dict, model: dict, t: "Training", tasks: int, threads: int | None) -> float:
    """The replica layout's fixed cost per step that its parts do not show: one real step of the whole model
    (speed_profile.time_replica_step: DDP, the Pipe, AdamW, the stop flag) less its blocks, its optimizer and the
    engine's own cost; scaled by the gradients' bytes where the plan's model has more or fewer layers."""
    steps = profile.get("replica_step") or []
    if not steps:
        return 0.0
    rec, _ = _nearest(steps, profile, tasks, threads)
    plain = replace(t, precision="fp32", activation_checkpointing=False)
    ctx, _ = _context(profile, rec["tasks"], rec.get("threads"))
    measured_model = dict(model, nlayers=rec["nlayers"])
    (part,) = _part_costs(profile, ctx, measured_model, plain, 1, rec["micro"])
    engine = profile["engine"]
    rest = rec["step_s"] - part["f"] - part["b"] - part["optimizer"] - engine["per_step_s"] \
        - engine["per_micro_batch_part_s"]
    bytes_now = sum(p["bytes"] for p in _part_costs(profile, ctx, model, plain, 1, 1))
    return max(0.0, rest) * (bytes_now / part["bytes"] if rec["replicas"] > 1 else 1.0)


def _engine_costs(profile: dict, ctx: dict, stage: bool, stage_costs: tuple | None, notes: list[str]
                  ) -> tuple[float, float]:
    """The engine's cost per op (a forward or a backward of a micro-batch on a part or stage) and per step: the
    stage layout's from the fit to its real steps, else the tiny model's; the replica layout's hand-off as measured
    with the real model in the same context, where it was."""
    if stage_costs:
        return stage_costs[1], stage_costs[2]
    if stage:
        engine = profile.get("stage_engine")
        if engine is None:
            notes.append("the stage layout's engine was not profiled (one task, or torch < 2.4): its cost per "
                         "micro-batch is left out")
            return 0.0, 0.0
        return engine["per_micro_batch_stage_s"] / 2, engine["per_step_s"]
    engine, real = profile["engine"], (ctx.get("engine") or {}).get("per_micro_batch_part_s")
    return (real if real is not None else engine["per_micro_batch_part_s"]) / 2, engine["per_step_s"]


def predict_speed(profile: dict, model: dict, t: "Training", nb_part: int, replicas: int, tasks_per_node: int,
                  nodes: int = 1, threads: int | None = None,
                  stage_costs: tuple[float, float, float] | None = None) -> dict:
    """Step time and samples/s of one split (model: the model's arguments with batch_size and chunks; nb_part: the
    replica's parts, or --pp in the stage layout; threads: a CPU task's, default the trainer's), with the terms
    that add up to it (SPEED_TERMS). The stage layout's costs, (factor on the blocks, cost per forward or backward
    of a micro-batch on a stage, cost per step), default to the fit to the profile's real steps (_stage_fit)."""
    stage = t.layout == "stage"
    chunks, batch = model["chunks"], model["batch_size"]
    pp = nb_part if stage else 1
    stages = nb_part * (stages_per_rank(t.schedule, t.virtual_stages) if stage else 1)
    micro = batch / chunks
    ctx, slower = _context(profile, tasks_per_node, threads)
    fit = _stage_fit(profile, model, t) if stage and stage_costs is None else None
    if fit:
        stage_costs = (_stage_scale(fit, _overlap(chunks, pp)), fit["per_op"], fit["per_step"])
    parts = _part_costs(profile, ctx, model, t, stages, micro, stage_costs[0] if stage_costs else 1.0)
    notes: list[str] = []
    per_op, per_step = _engine_costs(profile, ctx, stage, stage_costs, notes)
    shared = not stage and (profile["device"] == "cpu" or bool(t.devices and len(set(t.devices)) < len(t.devices)))
    queues = _queues(t.layout, t.schedule, stages, pp, chunks, shared)
    act = micro * model["seq_len"] * model["d_model"] * 4  # a micro-batch's activations between stages, fp32
    # the engine's cost already holds a send of its tiny activation: the delay is what a larger one adds
    p2p = profile.get("p2p") if stage else None
    delay = max(0.0, _interpolate(p2p, act) - p2p[0][1]) if p2p else 0.0
    compute = lambda kind, s: parts[s]["f" if kind == "F" else "b"] * slower  # noqa: E731
    bare, _ = _simulate(queues, lambda k, s: compute(k, s) + per_op, 0.0, stages)
    makespan, end = _simulate(queues, lambda k, s: compute(k, s) + per_op, delay, stages)
    busy = max(queues, key=lambda ops: sum(compute(k, s) for k, s, _ in ops))
    work, overhead = sum(compute(k, s) for k, s, _ in busy), per_op * len(busy) + per_step
    comm = makespan - bare
    residual = 0.0 if stage else _step_residual(profile, model, t, tasks_per_node, threads)
    if replicas > 1:
        ready = [(max(v for (k, s, _), v in end.items() if k == "B" and s == j), parts[j]["bytes"])
                 for j in reversed(range(stages))]
        per_node = tasks_per_node // pp if stage else tasks_per_node
        across = nodes > 1 and replicas > per_node
        groups = [[r] for r in ready] if stage else [ready]  # a stage layout's stages reduce at the same time
        exposed = [_exposed_allreduce(profile, g, makespan, replicas, across, notes) for g in groups]
        if stage or not residual:
            comm += max(exposed)
        else:  # the all-reduce as it ran in the real step, less what the backward hides on a GPU
            full = _exposed_allreduce(dict(profile, device="cpu"), ready, makespan, replicas, across, [])
            comm += residual * (exposed[0] / full if full else 1.0)
    elif residual:
        overhead += residual
    optimizer = (max(sum(parts[s]["optimizer"] for s in {s for _, s, _ in ops}) for ops in queues)
                 if stage else sum(p["optimizer"] for p in parts))
    if t.zero and replicas > 1:  # each replica steps its share, then broadcasts it: about half an all-reduce
        share = sum(p["bytes"] for p in parts) / (pp if stage else 1)
        optimizer = optimizer / replicas + _allreduce_time(profile, share, replicas, replicas > tasks_per_node)[0] / 2
    terms = {"compute": work, "bubble": bare - work - per_op * len(busy), "per_micro_batch": overhead,
             "communication": comm, "optimizer": optimizer}
    terms["bubble"] = max(0.0, terms["bubble"]) if terms["bubble"] > -1e-9 else terms["bubble"]  # rounding only
    step = sum(terms.values())
    return {"step_s": step, "samples_per_s": batch * replicas / step, "terms": terms, "notes": notes}


# ======================================================================================================================
# Part II. The pre-flight checker: Slurm 22.05, Jean Zay, reading job scripts, the report, the command line
# ======================================================================================================================


# ---- II.1 What it catches --------------------------------------------------------------------------------------------

class UsageError(Exception):
    """Bad command line or unreadable file: exit 2."""

# Every finding the checker can give, with its level: `--json` carries these codes, and docs/checker.md (section 9)
# lists exactly this table (tests/test_check_topology.py compares the three: this table, the code, the docs).
CATCHES = {
    # reading the script as sbatch 22.05 does
    "no-shebang": ("error", "the first line is not #! and an interpreter (sbatch refuses the file)"),
    "dos-line-breaks": ("error", "\\r\\n line ends (sbatch refuses the file)"),
    "cr-line-breaks": ("error", "\\r line ends alone (sbatch and bash read the file as one line)"),
    "script-too-large": ("error", "a script over 4 MiB (slurmctld refuses it)"),
    "not-a-script": ("error", "a file with NUL bytes, e.g. a binary (sbatch refuses it)"),
    "unknown-option": ("error", "an option sbatch or srun does not know, with a did-you-mean"),
    "ambiguous-option": ("error", "an abbreviation that matches several options (getopt refuses it)"),
    "option-prefix": ("warning", "an unambiguous abbreviation, which getopt accepts: write it in full"),
    "stray-token": ("error", "a word in a #SBATCH line that is not an option (sbatch refuses the file)"),
    "bad-directive": ("error", "a #SBATCH line that cannot be parsed (unbalanced quotes)"),
    "bad-value": ("error", "a value sbatch or srun refuses: a count (-N=2), --hint, --mem, --gpu-bind, --cpu-bind, "
                  "--distribution, --exclusive, --signal, --mail-type, --open-mode, --gres-flags ..."),
    "value-misread": ("warning", "a value sbatch accepts but reads otherwise than written (--gpu-bind=closes is "
                      "closest, unknown --mail-type words are dropped)"),
    "option-conflict": ("error", "options sbatch refuses together (--mem with --mem-per-cpu, --cpus-per-gpu with "
                        "--cpus-per-task, --ntasks-per-gpu with --ntasks-per-node)"),
    "hint-ignored": ("warning", "--hint with --ntasks-per-core or --threads-per-core: Slurm drops the hint"),
    "count-too-large": ("error", "a count above what any Jean Zay node or partition has (nothing is planned from it)"),
    "bad-command": ("error", "a command line bash cannot parse (a quote never closed)"),
    "shell-unread": ("warning", "a script nested too deeply to follow"),
    "too-complex": ("warning", "a script too costly to follow to its end (10^8 function calls, values doubled "
                    "to gigabytes, more than 50000 words): checked up to the line named"),
    "variable-in-directive": ("error", "$VARIABLES in #SBATCH lines, which sbatch does not expand"),
    "ignored-directive": ("warning", "a directive sbatch ignores: indented, lower case, '# SBATCH', after the first "
                          "command, inside a here-document"),
    "slurm-directive": ("warning", "#SLURM lines, which sbatch applies as directives"),
    "pbs-directive": ("error", "#PBS / #BSUB lines, which sbatch also reads, without --ignore-pbs"),
    "hetjob": ("warning", "a heterogeneous job, whose components are checked as one"),
    "node-range": ("warning", "--nodes=MIN-MAX: the plan assumes MIN"),
    "unchecked-argument": ("warning", "a trainer argument given as a shell variable: it, and what depends on it, is "
                           "not checked (a variable alone may hold any argument: then nothing that depends on them)"),
    # tasks and their placement
    "trainer-without-srun": ("error", "a launch line without srun in a job of several nodes (or tasks, for the kit's "
                             "trainer): it runs once, on the first node"),
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
    "srun-cpus-per-task": ("warning", "srun without -c in a job with --cpus-per-task (22.05 and 23.02 give each task "
                           "1 CPU)"),
    "launcher-agents-per-node": ("error", "several torchrun/deepspeed/accelerate agents per node (srun's tasks): "
                                 "they race for the rendezvous"),
    "launcher-nodes-mismatch": ("error", "a launcher's node count (--nnodes, --num_machines, --num_nodes) that "
                                "disagrees with the nodes that start it, or a node rank (--node_rank, --machine_rank) "
                                "that is not each agent's own"),
    "launcher-not-modelled": ("warning", "the kit's trainer under deepspeed or accelerate"),
    "processes-exceed-gpus": ("error/warning", "more processes per node than GPUs (a launcher's workers; srun tasks of "
                              "another program: a warning)"),
    # GPUs
    "no-gpus": ("error/warning", "no GPU requested for the kit's trainer (a warning on CPU nodes), or GPU nodes "
                "asked for without a GPU"),
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
    "distribution-not-modelled": ("warning", "--distribution=arbitrary: which task runs where is not modelled"),
    # cores, time, account, modules (Jean Zay)
    "cpus-per-task-missing": ("warning", "--cpus-per-task missing (Jean Zay grants memory per core)"),
    "cpus-per-task-small": ("warning", "--cpus-per-task below the node's cores per GPU x GPUs per task"),
    "cpus-exceed-node": ("error", "tasks x --cpus-per-task above the node's cores"),
    "hint-missing": ("warning", "--hint=nomultithread missing"),
    "time-missing": ("warning", "--time missing: 10 minutes on Jean Zay's GPU partitions"),
    "bad-time": ("error", "a --time Slurm does not read"),
    "time-over-qos": ("error/warning", "--time above the QoS or partition limit (dev 2 h, t3 20 h, t4 100 h; A100 "
                      "20 h; prepost 20 h); a warning where only the default QoS's limit is passed (an association "
                      "may default to a longer one)"),
    "account-mismatch": ("error", "an account suffix (@v100, @a100, @h100, @cpu) that does not match the nodes asked "
                         "for; live: an account none of your associations has"),
    "arch-module-missing": ("error/warning", "H100 nodes without module load arch/h100 first (an error); A100 80 GB "
                            "nodes without module load cpuarch/amd (a warning)"),
    "constraint-unavailable": ("error", "a -C feature no node of the partition has, or a retired partition"),
    "qos-mismatch": ("error/warning", "a --qos of another node type (qos_gpu-t4 on A100, which has none: an error); a "
                     "QoS the table does not know (qos_gpu-gc, a project's grant: a warning naming sacctmgr)"),
    "qos-limit": ("error", "more GPUs (or cores) than the QoS allows a job (or, live, a user)"),
    "partition-unknown": ("error", "-p names no partition of Slurm's configuration here (--site live)"),
    "engine-unavailable": ("error", "--engine torch-pipe with a pytorch-gpu/py3/2.4+ module"),
    "torch-too-old": ("error", "bench_stage.py with a pytorch-gpu/py3 module older than 2.4"),
    # memory (the section *Will it fit?*)
    "does-not-fit": ("error", "a GPU's estimated peak memory (a part of a replica, a task of a pipeline) "
                              "above its own"),
    "memory-tight": ("warning", "a GPU's estimated peak memory above 90 % of its own"),
    "bf16-on-v100": ("error", "--precision bf16 on V100 GPUs, which have no bf16"),
    "tf32-on-v100": ("warning", "--tf32 on V100 GPUs, which have no TF32 units: fp32 matmuls as without it"),
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
    # the trainer's own refusals of its line (the one definition of its arguments, read by its own parser)
    "unknown-argument": ("error", "an option the trainer does not have: an abbreviation (refused), '_' for '-', a "
                         "typo, with the full option it may stand for"),
    "bad-argument": ("error", "a trainer argument's value the trainer refuses: not a number, outside its range "
                     "(every count is bounded), no value, or a model it cannot build (--d-model not a multiple of "
                     "--n-head)"),
    "torch-release": ("error", "what the installed torch lacks (the trainer and its --check-args; in a job script "
                      "the module line gives engine-unavailable / torch-too-old)"),
    "no-training": ("warning", "a trainer line with --help or --check-args, which exits without training"),
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


# ---- II.2 Slurm 22.05: the request, the option tables and values, the placement of tasks and GPUs --------------------

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
    trainer: str | None = "bench_ddp_transformer.py"  # the kit's script on it; None: the script runs no kit trainer
    workers: int | None = None  # torchrun --nproc_per_node on the trainer's line: workers per srun task (agent)
    step_nodes: int | None = None  # srun's own -N / -n / --ntasks-per-node on the trainer's line
    step_ntasks: int | None = None
    step_ntasks_per_node: int | None = None
    step_cpus_per_task: int | None = None  # srun -c: 22.05's srun does not inherit the job's --cpus-per-task
    placement: str = "exact"  # "possible": Slurm decides by free cores; the plan shows one placement it may make
    options: dict[str, str | None] = field(default_factory=dict)  # every option the directives give, last value
    option_lines: dict[str, str] = field(default_factory=dict)  # where each was given (file:line)
    trainer_line: "LaunchLine | None" = None  # the kit trainer's launch line, as bash runs it
    srun_cpus: bool = False  # its srun gets -c (or SRUN_CPUS_PER_TASK)
    launches: list = field(default_factory=list)  # the script's other launch lines (LaunchLine), their layout
    sourced: list[str] = field(default_factory=list)  # files the script sources (not read)
    torch_version: str | None = None  # inside an allocation: the torch installed there
    unplanned: str | None = None  # why nothing is planned (a count no node has): the findings say it all
    # whose rules judge the account, QoS and time: "jean-zay" (the dated table), "live" (Slurm's configuration here,
    # in `site`: a site_slurm.SiteFacts), "none" (Slurm's own behaviour only)
    site_rules: str = "jean-zay"
    site: object = None

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


# What the checker plans at most, so that no request can make it loop or fill the login node's memory: more than
# any Jean Zay partition (all of Jean Zay has fewer than 4096 nodes; its nodes have at most 8 GPUs and 96 cores, 192
# hardware threads). A count above its bound is refused (the test cluster's slurmctld refused them all: 'Requested
# node configuration is not available', 'Invalid Trackable RESource (TRES) specification').
COUNT_LIMITS = {"nodes": 4096, "ntasks": 4096 * 8, "ntasks-per-node": 192, "cpus-per-task": 192,
                "gpus-per-node": 16, "gpus-per-task": 16, "gpus": 4096 * 16, "gres": 16}


def too_many_tasks(per_node: list[int], findings: Findings) -> bool:
    """A placement with more tasks on a node, or in all, than COUNT_LIMITS allows: one error, nothing planned."""
    busiest, total = max(per_node, default=0), sum(per_node)
    if busiest <= COUNT_LIMITS["ntasks-per-node"] and total <= COUNT_LIMITS["ntasks"]:
        return False
    findings.error("count-too-large", f"{total} task(s), up to {busiest} on a node: more than any Jean Zay node "
                   f"runs ({COUNT_LIMITS['ntasks-per-node']} hardware threads at most) or the checker plans "
                   f"({COUNT_LIMITS['ntasks']} tasks); ask for --nodes and --ntasks-per-node the nodes hold")
    return True


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
    return bounded(name, int(m.group(1)), where, findings)


def bounded(name: str, count: int, where: str, findings: Findings) -> int | None:
    """A count within COUNT_LIMITS, else one error (and None: nothing is planned from it)."""
    limit = COUNT_LIMITS.get(name)
    if limit is None or count <= limit:
        return count
    shown = str(count) if len(str(count)) <= 12 else f"{str(count)[:6]}...({len(str(count))} digits)"
    shown = f"gpu:{shown}" if name == "gres" else shown
    findings.error("count-too-large", f"{where}: --{name}={shown} is more than any Jean Zay node or partition has "
                   f"(the checker plans up to {limit}); Slurm refuses it ('Requested node configuration is not "
                   f"available'): ask for what the nodes have")
    return None


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
        return bounded("gres", int(count), where, findings)
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
    """What the plan does not model of a --gpu-bind sbatch accepts (its refusals are option_value_problem's)."""
    v = re.sub(r"^verbose,", "", value.lower())
    if v.startswith("mask_gpu:"):
        findings.warn("gpu-bind-mask", f"{where}: --gpu-bind=mask_gpu is not modelled: the plan assumes each "
                      "task sees all the node's GPUs")
    elif v.startswith("c"):
        findings.warn("gpu-bind-closest", f"{where}: --gpu-bind=closest shows each task the GPUs of its NUMA "
                      "domain, which depends on the node; the plan assumes all GPUs are visible")


# -- the option values sbatch and srun 22.05 check themselves, before anything is submitted (each refusal below was
# measured with sbatch --test-only on the test cluster: tests/test_sbatch_rules.py) --

HINTS = ("compute_bound", "memory_bound", "multithread", "nomultithread", "help")
CPU_BINDS = ("q", "quiet", "v", "verbose", "one_thread", "no", "none", "rank", "rank_ldom", "socket", "sockets",
             "core", "cores", "thread", "threads", "ldom", "ldoms", "help")
MAIL_TYPES = ("NONE", "ARRAY_TASKS", "BEGIN", "END", "FAIL", "INVALID_DEPEND", "REQUEUE", "ALL", "STAGE_OUT",
              "TIME_LIMIT", "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50")
SIGNALS = ("HUP", "INT", "QUIT", "ABRT", "KILL", "ALRM", "TERM", "USR1", "USR2", "URG", "CONT", "STOP", "TSTP",
           "TTIN", "TTOU", "XCPU")


def _tokens(value: str) -> list[str]:
    """verify_hint's and slurm_verify_cpu_bind's split: a comma not followed by a digit separates tokens."""
    return re.split(r",(?![0-9])", value)


def _near(word: str, choices: Iterable[str]) -> str:
    near = difflib.get_close_matches(word.lower(), [c.lower() for c in choices], n=1, cutoff=0.6)
    return f"; did you mean {near[0]}?" if near else f"; one of {', '.join(choices)}"


def gpu_bind_problem(v: str, prog: str) -> tuple[str | None, str | None]:
    """--gpu-bind as common/tres_bind.c _valid_gpu_bind reads it: closest and none match on their first letter."""
    b = v[8:] if v.lower().startswith("verbose,") else v
    low = b.lower()
    if low.startswith("map_gpu:") or low.startswith("mask_gpu:"):
        digits = "[0-9a-fA-Fx*]" if low.startswith("mask") else "[0-9*]"
        items = low.split(":", 1)[1].split(",")
        if not all(re.fullmatch(digits + "+", x) for x in items):
            return f"--gpu-bind={v}: {low.split(':')[0]} wants a comma-separated list of GPU numbers", None
        return None, None
    for word, prefix in (("closest", "c"), ("none", "n")):
        if low.startswith(prefix):
            return None, (None if low == word else f"{prog} reads --gpu-bind={v} as '{word}' (it compares the "
                          f"first letter only); write {word}")
    if low.startswith(("per_task:", "single:")):
        n = low.split(":", 1)[1]
        return None, (None if n.isdigit() else f"{prog} reads --gpu-bind={v} as {low.split(':')[0]}:0 (not a "
                      "number); give a count")
    return f"--gpu-bind={v} is not a GPU binding (closest, map_gpu:, mask_gpu:, none, per_task:, single:)", None


def cpu_bind_problem(v: str) -> str | None:
    """--cpu-bind as common/slurm_resource_info.c slurm_verify_cpu_bind reads it."""
    for t in _tokens(v):
        low = t.lower()
        if re.match(r"(map_?cpu|mask_?cpu|map_?ldom|mask_?ldom)", low):
            if not re.search(r"[:=].+", low):
                return f"--cpu-bind={v}: missing list for '{t}'"
        elif low not in CPU_BINDS:
            return f"--cpu-bind={v}: unrecognized --cpu-bind argument \"{t}\"{_near(t, CPU_BINDS)}"
    return None


def option_value_problem(name: str, value: str | None, prog: str = "sbatch") -> tuple[str | None, str | None]:
    """(why sbatch or srun refuse this value, how they read it other than written); (None, None) when fine.
    Each rule is 22.05's own parser, named beside it."""
    v = value or ""
    if name == "hint":  # proc_args.c verify_hint
        bad = [t for t in _tokens(v) if t.lower() not in HINTS]
        return (f"--hint={v}: unrecognized --hint argument \"{bad[0]}\"{_near(bad[0], HINTS)}", None) if bad else (None, None)
    if name in ("mem", "mem-per-cpu", "mem-per-gpu"):  # proc_args.c str_to_mbytes
        if not re.fullmatch(r"\d+([KMGTkmgt][Bb]?)?", v):
            return f"--{name}={v} is not a size (a number of MB, or with K, M, G or T)", None
        return None, None
    if name == "gpu-bind":  # common/tres_bind.c _valid_gpu_bind
        return gpu_bind_problem(v, prog)
    if name == "cpu-bind":  # common/slurm_resource_info.c slurm_verify_cpu_bind
        return cpu_bind_problem(v), None
    if name == "distribution":  # proc_args.c verify_dist_type
        if re.fullmatch(r"(?i)plane=\d+", v) and int(v.split("=")[1]) > 0:
            return None, None
        base, _, flag = v.partition(",")
        levels = base.split(":")
        ok = (0 < len(levels) <= 3 and levels[0].lower() in ("*", "block", "cyclic", "arbitrary", "hostfile")
              and all(x.lower() in ("*", "block", "cyclic", "fcyclic") for x in levels[1:])
              and (not flag or flag.lower() in ("pack", "nopack")))
        return (None, None) if ok else (f"--distribution={v} is not a distribution (block, cyclic, plane=N, "
                                        "arbitrary, with :block|cyclic|fcyclic levels and ,pack|nopack)", None)
    if name == "exclusive":  # slurm_opt.c arg_set_exclusive
        ok = value is None or v.lower() in ("exclusive", "oversubscribe", "user", "mcs")
        return (None, None) if ok else (f"--exclusive={v}: Invalid --exclusive specification (user, mcs, or no "
                                        "value)", None)
    if name == "signal":  # proc_args.c get_signal_opts: [R|B[R]:]SIGNAL[@SECONDS], SECONDS at most 65535
        m = re.fullmatch(r"(?i)(?:R?B?R?:)?(?:SIG)?(\w+?)(?:@(\d+))?", v)
        sig = m.group(1).upper() if m else ""
        ok = m and ((sig.isdigit() and 0 < int(sig) <= 0xffff) or sig in SIGNALS) and int(m.group(2) or 0) <= 0xffff
        return (None, None) if ok else (f"--signal={v}: Invalid --signal specification ([B:]SIGNAL[@seconds], "
                                        "e.g. USR1@300; seconds at most 65535)", None)
    if name == "mail-type":  # proc_args.c parse_mail_type: unknown words are dropped, all unknown is an error
        words = [w for w in v.split(",") if w]
        bad = [w for w in words if w.upper() not in MAIL_TYPES]
        if len(bad) == len(words):
            return f"--mail-type={v}: Invalid --mail-type specification{_near(bad[0] if bad else '', MAIL_TYPES)}", None
        return None, (f"{prog} drops {', '.join(bad)} from --mail-type={v} (not a mail type)" if bad else None)
    if name == "open-mode":  # slurm_opt.c arg_set_open_mode: the first letter decides
        if v[:1].lower() not in ("a", "t"):
            return f"--open-mode={v}: Invalid --open-mode specification (append or truncate)", None
        word = "append" if v[:1].lower() == "a" else "truncate"
        return None, (None if v.lower() == word else f"{prog} reads --open-mode={v} as {word}; write {word}")
    if name == "gres-flags":  # slurm_opt.c arg_set_gres_flags
        ok = v.lower() in ("disable-binding", "enforce-binding")
        return (None, None) if ok else (f"--gres-flags={v}: Invalid --gres-flags specification (enforce-binding or "
                                        "disable-binding)", None)
    if name == "kill-on-invalid-dep":  # slurm_opt.c arg_set_kill_on_invalid_dep
        ok = v.lower() in ("yes", "no")
        return (None, None) if ok else (f"--kill-on-invalid-dep={v}: yes or no", None)
    if name in ("time", "time-min") and v and time_minutes(v) is None:  # parse_time.c time_str2mins
        return f"--{name}={v} is not a Slurm time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)", None
    return None, None


def check_option_values(job: Job, options: list[tuple[str, str | None]], where: str, findings: Findings,
                        prog: str = "sbatch", record: bool = True) -> None:
    """Each option's value as sbatch (or srun) checks it; `record`: keep them in job.options for the pairs."""
    for name, value in options:
        if record:
            job.options[name] = value
            job.option_lines[name] = where
        if (value is not None and "$" in value) or name == "time":  # a variable: said once; bad-time: its own
            continue
        refused, misread = option_value_problem(name, value, prog)
        if refused:
            findings.error("bad-value", f"{where}: {refused}; {prog} refuses it")
        elif misread:
            findings.warn("value-misread", f"{where}: {misread}")


def check_option_conflicts(job: Job, findings: Findings) -> None:
    """The pairs sbatch 22.05 refuses, or resolves by dropping one (src/common/slurm_opt.c
    validate_options_salloc_sbatch_srun, validate_hint_option; common/gres.c _job_state_validate)."""
    given = job.options

    def at(*names: str) -> str:  # the line of the last of them
        lines = [job.option_lines[n] for n in names if n in job.option_lines]
        return max(lines, key=lambda w: int(w.rpartition(":")[2]) if w.rpartition(":")[2].isdigit() else 0,
                   default="the directives")

    def shown(name: str) -> str:
        return f"--{name}" + (f"={given[name]}" if given.get(name) is not None else "")
    mem = [m for m in ("mem", "mem-per-cpu", "mem-per-gpu") if m in given]
    if len(mem) > 1:
        findings.error("option-conflict", f"{at(*mem)}: {' and '.join(map(shown, mem))}: sbatch refuses them "
                       "together ('--mem, --mem-per-cpu, and --mem-per-gpu are mutually exclusive'); keep one")
    if "cpus-per-gpu" in given and "cpus-per-task" in given:
        findings.error("option-conflict", f"{at('cpus-per-gpu', 'cpus-per-task')}: {shown('cpus-per-gpu')} with "
                       f"{shown('cpus-per-task')}: sbatch refuses the job ('--cpus-per-gpu is mutually exclusive "
                       "with --cpus-per-task'); keep --cpus-per-task (Jean Zay's examples use it)")
    if "ntasks-per-gpu" in given:
        other = [o for o in ("ntasks-per-node", "gpus-per-task", "gpus-per-socket") if o in given]
        if other:
            findings.error("option-conflict", f"{at('ntasks-per-gpu', *other)}: {shown('ntasks-per-gpu')} with "
                           f"{', '.join(map(shown, other))}: sbatch refuses it ('--{other[0]} is mutually exclusive "
                           "with --ntasks-per-gpu'); keep one")
    if "hint" in given:
        other = [o for o in ("ntasks-per-core", "threads-per-core", "extra-node-info") if o in given]
        if other:
            findings.warn("hint-ignored", f"{at('hint', *other)}: {shown('hint')} with {', '.join(map(shown, other))}"
                          ": Slurm drops the hint ('mutually exclusive with --hint ... Ignoring --hint'); keep --hint "
                          f"and remove --{other[0]}")
    if (given.get("distribution") or "").lower().startswith(("arbitrary", "hostfile")) and not (
            "nodelist" in given or "nodefile" in given):
        findings.error("bad-value", f"{at('distribution')}: {shown('distribution')} needs the nodes listed "
                       "(-w/--nodelist or a hostfile): sbatch refuses it ('With Arbitrary distribution you need to "
                       "specify a nodelist')")


def time_minutes(value: str) -> float | None:
    """A Slurm time (man sbatch: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
    days-hours:minutes:seconds) in minutes; None when it is none of those."""
    v = value.strip()
    if v.upper() in ("UNLIMITED", "INFINITE", "-1", "0"):  # time_str2mins: -1 and 0 mean no limit too
        return float("inf")
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?", v)
    if not m:
        return None
    d, a, b, c = m.groups()
    if d is not None:
        minutes = int(d) * 1440 + int(a) * 60 + int(b or 0) + int(c or 0) / 60
    elif c is not None:
        minutes = int(a) * 60 + int(b) + int(c) / 60
    else:
        minutes = int(a) + int(b or 0) / 60
    return minutes or float("inf")  # arg_set_time_limit: a limit of 0 minutes is no limit


# -- the placement: where Slurm puts the tasks and which GPUs each sees (measured on the test cluster) --

def gpu_view(job: Job, local_rank: int, tasks_on_node: int, gpus_on_node: int,
             findings: Findings) -> list[str]:
    """The GPU ids one task sees, as Slurm shows them (seen on the test cluster): all of the node's without
    binding; its own share with --gpus-per-task; the mapped ones with --gpu-bind=map_gpu."""
    everything = [str(i) for i in range(gpus_on_node)]
    bind = re.sub(r"^verbose,", "", (job.gpu_bind or "").lower())
    if bind.startswith("map_gpu:") and re.fullmatch(r"[0-9*,]+", bind.split(":", 1)[1]):
        ids = [x for x in bind.split(":", 1)[1].split(",") if x]
        entry = ids[local_rank % len(ids)]
        return [entry.split("*")[0]]
    if bind.startswith("per_task:") and bind.split(":", 1)[1].isdigit() and int(bind.split(":", 1)[1]) > 0:
        n = int(bind.split(":", 1)[1])
        return everything[local_rank * n:(local_rank + 1) * n]
    if bind.startswith("single:") and bind.split(":", 1)[1].isdigit() and int(bind.split(":", 1)[1]) > 0:
        # one GPU per task, N tasks per GPU, the first GPU with room (srun(1) --gpu-bind): which one also depends
        # on the task's socket, so the ids are the order without NUMA; the count is exact
        return [everything[local_rank // int(bind.split(":", 1)[1]) % len(everything)]] if everything else []
    if bind in ("", "none") and job.gpus_per_task and bind != "none":
        g = job.gpus_per_task
        return everything[local_rank * g:(local_rank + 1) * g]
    return everything


def allocation_tasks(job: Job, findings: Findings) -> tuple[list[int] | None, int]:
    """What the allocation holds on each node, in tasks (None: Slurm decides by free cores), the job's task count
    (which srun inherits, as SLURM_NTASKS or, without -n, one per node): slurm-wlm 22.05's placement as measured on
    the test cluster (docs/checker.md, section 10)."""
    n, k, cap = job.ntasks, job.ntasks_per_node, node_cap(job)
    nodes = job.nodes
    if nodes is None:
        if n and k:
            nodes = -(-n // k)
        elif n and not k and cap and n > cap:
            nodes = -(-n // cap)
        else:
            nodes = 1
        if n and n > 1 and not k:
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
    than it holds (srun -n 5 in 4(x3) gave 2,2,1; -n 4 in 2(x3) gave 2,1,1). Computed by levels, not round by
    round, so that thousands of nodes cost no more than a sort."""
    n = min(ntasks, sum(caps))
    level, placed = 0, 0  # the round every node with room still gets a task in
    for cap in sorted(set(caps)):
        full = sum(1 for c in caps if c > level)
        if placed + full * (cap - level) > n:
            break
        placed += full * (cap - level)
        level = cap
    rounds, extra = divmod(n - placed, max(1, sum(1 for c in caps if c > level)))
    counts = [min(c, level + rounds) for c in caps]
    for i, c in enumerate(caps):
        if extra and c > level + rounds:
            counts[i] += 1
            extra -= 1
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


def step_placement(job: Job, findings: Findings, kit: bool = True) -> list[int]:
    """Tasks on each node of a launch line's step (the trainer's by default), as Slurm places them: the
    allocation's shape, then srun's options on the line, which override it (srun -n K alone inherits the job's
    nodes); one task on the first node for a line the batch shell runs itself."""
    if job.tasks_per_node:  # inside an allocation: Slurm already placed them
        return list(job.tasks_per_node)
    caps, ntasks = allocation_tasks(job, findings)
    nodes = len(caps) if caps else job.nodes
    if job.srun is False:  # the batch step runs the line once: SLURM_PROCID=0, no SLURM_STEP_ID (measured)
        own = job.workers is not None or not kit  # torchrun, or a program that may start its own processes
        if nodes > 1 or (ntasks > 1 and not own):
            what = f"the trainer's line starts with '{job.launcher}'" if kit else (
                f"{job.trainer} is started by '{job.launcher or job.trainer}'")
            findings.error("trainer-without-srun",
                           f"{what}, not srun: in a job of {ntasks} task(s) on {nodes} node(s) the batch script runs "
                           f"it once, on the first node"
                           + (f", as 1 process, not {ntasks}" if not own else f"; the other {nodes - 1} node(s) "
                              "idle") + "; start it with srun"
                           + (f": srun python {job.trainer} ..." if kit and job.workers is None else
                              " --ntasks-per-node=1 (one per node)"))
        return [1]
    placed = step_tasks_per_node(job, caps, ntasks, nodes, findings)
    if (job.step_ntasks is None and job.step_nodes is None) or job.placement == "possible":  # the job's shape
        check_allocation_shape(job, caps, ntasks, findings, kit)
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
    # srun -c a task takes 1 core (measured: docs/checker.md, section 10)
    held = caps[:m_step]
    if job.ntasks_per_node and ntasks > 1:  # slurmctld then reserves k tasks' cores on every node, whatever -n
        held = [max(c, job.ntasks_per_node) for c in held]  # (job_mgr.c: pn_min_cpus = cpus_per_task x k)
    caps = [c * (job.cpus_per_task or 1) // (job.step_cpus_per_task or 1) for c in held]
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


def check_allocation_shape(job: Job, caps: list[int] | None, ntasks: int, findings: Findings,
                           kit: bool = True) -> None:
    """The #SBATCH task counts: --ntasks-per-node missing, or a maximum because --ntasks asks fewer. The warnings
    about SLURM_NTASKS_PER_NODE are for the kit's trainer (the page's code reads it); the errors (tasks placed
    unevenly) hold for any program."""
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
        elif kit:
            findings.warn("ntasks-per-node-max",
                          f"--ntasks={n} on {nodes} node(s) runs {placed[0]} task(s) per node, below "
                          f"--ntasks-per-node={k} (a maximum when --ntasks is given): SLURM_NTASKS_PER_NODE={k} then "
                          f"misleads the page's code; set --ntasks-per-node={placed[0]}")
    if k:
        return
    if not kit and (n is None or n == nodes or nodes == 1 or caps):
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
    resolves against the user, as slurm-wlm 22.05 did on the test cluster (docs/checker.md, section 10) and
    SchedMD's testsuite (testsuite/expect/test39.4) expects from later releases."""
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
    ntype = node_type(job)
    full = JEAN_ZAY[ntype].gpus if ntype else None
    if per_node is None and total and nodes > 1 and full and total == full * nodes:
        per_node = full  # every node must give all its GPUs: Slurm has no choice (-N 2 --gpus=8 gave 4 and 4)
    elif per_node is None and total and nodes > 1 and total < nodes:
        findings.error("gpu-request-conflict", f"--gpus={total} on {nodes} nodes: sbatch refuses it ('Failed to "
                       f"validate job spec, --gpus < -N', measured); ask for --gpus-per-node=N")
        per_node = 1
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


# ---- II.3 Jean Zay in one table: its node types, their partitions, constraints, GPUs, cores, hours, QoS, modules ---

@dataclass(frozen=True)
class NodeType:
    label: str
    partitions: tuple[str, ...]  # the -p names that give these nodes; the first is the one to write
    gpus: int  # per node (0: CPU nodes)
    gpu_gib: float | None  # one GPU's memory as nvidia-smi shows it (the smaller where the nodes mix two boards)
    cores: int | None  # physical cores per node (None: not confirmed, not checked)
    accounts: tuple[str, ...]  # <project>@suffix that pays for them; () hours not deducted
    qos: tuple[str, ...]  # the QoS families that run there (qos_gpu-t3 is family qos_gpu); () none
    qos_hours: dict  # QoS -> its time limit in hours (the first is the default)
    max_hours: float  # the partition's own limit
    default_minutes: int  # --time when the script gives none
    features: dict = field(default_factory=dict)  # -C feature -> GPU GiB of the nodes that carry it
    arch: str | None = None  # the module that must come before the others on these nodes
    arch_required: bool = False  # without it the modules for these nodes are not found (else: advised)
    bf16: bool = True
    qos_limit: dict = field(default_factory=dict)  # QoS -> most GPUs (GPU nodes) or cores (CPU nodes) per job


V100_HOURS = {"t3": 20, "dev": 2, "t4": 100}
# Sources, by fact (IDRIS's pages as stored for this work; users' job scripts where IDRIS's text was not reachable):
# - partitions, constraints, boards, default time, limits: IDRIS "GPU Partitions" and "CPU Partitions"
#   (idris.fr/en/docs/jean-zay/slurm/slurm_partitions_gpu and _cpu): gpu_p13 the default, 4 V100 of 16 or 32 GB
#   selected by -C v100-16g / -C v100-32g (the old gpu_p3 / gpu_p1), gpu_p2 (gpu_p2s 360 GB, gpu_p2l 720 GB of RAM)
#   8 x V100 32 GB; 10 min by default, at most 100 h; cpu_p1 the CPU default, 10 min / 100 h; prepost 2 h / 20 h;
#   visu 10 min / 4 h; archive and compil 2 h / 20 h, hours not deducted; compil_H100 for gpu_p6's software.
# - the QoS names and limits per job (qos_gpu-t3 20 h 512 GPUs, -t4 100 h 16 GPUs, -dev 2 h 32 GPUs; qos_cpu-t3
#   20 h 20480 cores, -t4 100 h 160 cores, -dev 2 h 5120 cores): IDRIS's QoS table as users' tools copy it; the
#   A100 and H100 QoS (qos_gpu_a100-dev/-t3, no t4; qos_gpu_h100-dev/-t3/-t4) and the @cpu QoS: `sacctmgr show
#   assoc` listings in users' notes. IDRIS's own QoS table was not reachable: per-job GPU limits of the A100 and
#   H100 QoS are not checked.
# - cores: 40 per V100 node and per cpu_p1 node (2 x Cascade Lake 6248), 24 on gpu_p2, 48 on gpu_p4, 64 on gpu_p5
#   (2 x AMD Milan), 96 on gpu_p6 (2 x 48-core Sapphire Rapids, press release of the 2024 extension); prepost's
#   not confirmed. Memory is granted per reserved core.
# - modules: `module load cpuarch/amd` for gpu_p5 (IDRIS's job-script template, as users' scripts copy it: "if you
#   are using the gpu_p5 partition"), `module load arch/h100` before the others on gpu_p6.
# - gpu_p4: users' scripts pay its hours with @v100 or @a100 and run it under qos_gpu-*: both are accepted here.
JEAN_ZAY = {
    "v100-4": NodeType("4-GPU V100 nodes (gpu_p13)", ("gpu_p13",), 4, 16160 / 1024, 40, ("v100",), ("qos_gpu",),
                       V100_HOURS, 100, 10, {"v100-16g": 16160 / 1024, "v100-32g": 32510 / 1024}, bf16=False,
                       qos_limit={"dev": 32, "t3": 512, "t4": 16}),
    "v100-8": NodeType("8-GPU V100 nodes (gpu_p2)", ("gpu_p2", "gpu_p2s", "gpu_p2l"), 8, 32510 / 1024, 24, ("v100",),
                       ("qos_gpu",), V100_HOURS, 100, 10, bf16=False, qos_limit={"dev": 32, "t3": 512, "t4": 16}),
    "a100-40": NodeType("8-GPU A100 40 GB nodes (gpu_p4)", ("gpu_p4",), 8, 40960 / 1024, 48, ("a100", "v100"),
                        ("qos_gpu_a100", "qos_gpu"), {"t3": 20, "dev": 2, "t4": 100}, 100, 10),
    "a100": NodeType("8-GPU A100 80 GB nodes (-C a100, gpu_p5)", ("gpu_p5",), 8, 81920 / 1024, 64, ("a100",),
                     ("qos_gpu_a100",), {"t3": 20, "dev": 2}, 20, 10, {"a100": 81920 / 1024}, arch="cpuarch/amd"),
    "h100": NodeType("4-GPU H100 nodes (-C h100, gpu_p6)", ("gpu_p6",), 4, 81559 / 1024, 96, ("h100",),
                     ("qos_gpu_h100",), V100_HOURS, 100, 10, {"h100": 81559 / 1024}, arch="arch/h100",
                     arch_required=True),
    "cpu": NodeType("CPU nodes (cpu_p1)", ("cpu_p1",), 0, None, 40, ("cpu",), ("qos_cpu",), V100_HOURS, 100, 10,
                    qos_limit={"dev": 5120, "t3": 20480, "t4": 160}),
    "prepost": NodeType("pre/post-processing nodes (prepost)", ("prepost",), 0, None, None, (), (), {}, 20, 120),
    "visu": NodeType("visualisation nodes (visu)", ("visu",), 0, None, None, (), (), {}, 4, 10),
    "archive": NodeType("data-management nodes (archive)", ("archive",), 0, None, None, (), (), {}, 20, 120),
    "compil": NodeType("compilation nodes (compil)", ("compil", "compil_h100"), 0, None, None, (), (), {}, 20, 120),
}
# The date of the table above (its last review against the sources named there), and how a finding it alone decides
# is worded: the site's documented rule, not Slurm's configuration (issue 33: a project's grants are in no table).
JEAN_ZAY_DATE = "2026-12-01"
TABLE_SAYS = f"Jean Zay's documented rule (table of {JEAN_ZAY_DATE})"
TABLE_QOS = f"Jean Zay's documented QoS (table of {JEAN_ZAY_DATE})"
# What settles what the table cannot know, on a Jean Zay login node: the user's accounts and QoS, and a QoS's limits.
ASSOC_COMMAND = "sacctmgr show assoc where user=$USER format=account,partition,qos,defaultqos"
QOS_COMMAND = "sacctmgr show qos format=name,maxwall,maxtrespu,maxtrespa,maxjobspu"
RETIRED_PARTITIONS = {"gpu_p1": "-C v100-32g", "gpu_p3": "-C v100-16g"}  # merged into gpu_p13 on 8/12/2020 (IDRIS)
FEATURE_TYPES = {f: name for name, t in JEAN_ZAY.items() for f in t.features}
PARTITION_TYPES = {p: name for name, t in JEAN_ZAY.items() for p in t.partitions}


def constraint_features(constraint: str | None) -> list[list[str]]:
    """-C's alternatives ('|'), each the features it needs ('&', ','), lower case."""
    return [[f.strip().lower() for f in re.split(r"[&,\[\]*()]", alt) if f.strip()]
            for alt in (constraint or "").split("|") if alt.strip()]


def looks_like_jean_zay(job: Job) -> bool:
    """An account <project>@v100/@a100/@h100/@cpu or a qos_gpu*/qos_cpu* QoS: then no -p means Jean Zay's default."""
    suffix = (job.account or "").rpartition("@")[2].lower() if "@" in (job.account or "") else ""
    return suffix in ("v100", "a100", "h100", "cpu") or (job.qos or "").lower().startswith(("qos_gpu", "qos_cpu"))


def asks_gpus(job: Job) -> bool:
    return any((job.gres_gpus, job.gpus_per_node, job.gpus_total, job.gpus_per_task))


def node_type(job: Job) -> str | None:
    """The JEAN_ZAY row the job runs on: its -p, else its -C's feature (-C a100 sends a job to gpu_p5), else the
    default partition when the job is Jean Zay's (gpu_p13 for GPUs, cpu_p1 otherwise); None: nodes not known."""
    if job.partition in PARTITION_TYPES:
        return PARTITION_TYPES[job.partition]
    if job.partition in RETIRED_PARTITIONS:
        return "v100-4"
    if job.partition:
        return None  # another cluster's partition: its sizes are not checked
    for alternative in constraint_features(job.constraint):
        for f in alternative:
            if f in FEATURE_TYPES:
                return FEATURE_TYPES[f]
    if looks_like_jean_zay(job):
        return "v100-4" if asks_gpus(job) else "cpu"
    return None


def node_cap(job: Job) -> int | None:
    """Tasks of --cpus-per-task cores that fit on one node, when the node type is known."""
    ntype = node_type(job)
    cores = JEAN_ZAY[ntype].cores if ntype else None
    return cores // (job.cpus_per_task or 1) if cores else None


def gpu_memory(job: "Job") -> tuple[float | None, str]:
    """GiB of one of the job's GPUs and where that came from: --gpu-mem, else the GPUs of this allocation
    (nvidia-smi), else the constraint or partition."""
    if job.gpu_mem is not None:
        return job.gpu_mem, f"--gpu-mem {job.gpu_mem:g}"
    if job.gpu_mem_seen is not None:
        return job.gpu_mem_seen, "the allocation's GPUs (nvidia-smi)"
    ntype = node_type(job)
    for alternative in constraint_features(job.constraint):
        for f in alternative:
            if f in FEATURE_TYPES and (ntype is None or FEATURE_TYPES[f] == ntype):
                return JEAN_ZAY[FEATURE_TYPES[f]].features[f], f"-C {f}"
    if ntype and JEAN_ZAY[ntype].gpu_gib and (job.partition or looks_like_jean_zay(job)):
        name = job.partition or JEAN_ZAY[ntype].partitions[0]
        mixed = ", which mixes 16 and 32 GB V100s: assuming 16 GB" if ntype == "v100-4" else ""
        return JEAN_ZAY[ntype].gpu_gib, f"partition {name}{mixed}"
    return None, "unknown"


def is_v100(job: "Job") -> bool:
    ntype = node_type(job)
    return (not JEAN_ZAY[ntype].bf16 and JEAN_ZAY[ntype].gpus > 0) if ntype else "v100" in (job.constraint or "").lower()


def check_nodes(job: Job, findings: Findings) -> None:
    """The partition and the constraint against the table: a retired partition, a feature no node of the partition
    has (Slurm: 'Requested node configuration is not available', measured with -p gpu_p2 -C v100-16g)."""
    if job.partition in RETIRED_PARTITIONS:
        findings.error("constraint-unavailable", f"--partition={job.partition} no longer exists on Jean Zay (merged "
                       f"into gpu_p13 on 8 December 2020, IDRIS): use {RETIRED_PARTITIONS[job.partition]} instead")
        return
    ntype = node_type(job)
    alternatives = constraint_features(job.constraint)

    def elsewhere(feature: str) -> bool:  # a feature the table puts on other nodes (unknown features: not judged)
        return feature in FEATURE_TYPES and FEATURE_TYPES[feature] != ntype
    if ntype and alternatives and all(any(elsewhere(f) for f in a) for a in alternatives):
        feature = next(f for a in alternatives for f in a if elsewhere(f))
        other = JEAN_ZAY[FEATURE_TYPES[feature]]
        findings.error("constraint-unavailable", f"-C {job.constraint} asks for {other.label.split(' (')[0]}, but "
                       f"no node of {JEAN_ZAY[ntype].label} has '{feature}': Slurm refuses the job ('Requested node "
                       f"configuration is not available'); drop -C, or use -p {other.partitions[0]} (or -C {feature} "
                       "alone)")


def check_cpus(job: Job, gpus_per_task: int, tasks_per_node: list[int], findings: Findings) -> None:
    """Cores per task against the node's cores per GPU (Jean Zay grants memory per reserved core), and tasks x
    --cpus-per-task against the node's cores. `gpus_per_task` is what each task holds (GPUs per node / tasks)."""
    ntype = node_type(job)
    t = JEAN_ZAY[ntype] if ntype else None
    per_gpu = t.cores // t.gpus if t and t.cores and t.gpus else None
    want = per_gpu * gpus_per_task if per_gpu and gpus_per_task else None
    if job.cpus_per_task is None:
        if gpus_per_task or (t and t.gpus):
            findings.warn("cpus-per-task-missing",
                          "--cpus-per-task is not given: each task gets 1 core for itself and its DataLoader workers "
                          "(and on Jean Zay only 1 core's share of memory); "
                          + (f"add --cpus-per-task={want} ({per_gpu} per GPU x {gpus_per_task} GPUs)" if want
                             else "add --cpus-per-task=<cores per GPU x GPUs per task>"))
    elif want and job.cpus_per_task < want:
        findings.warn("cpus-per-task-small",
                      f"--cpus-per-task={job.cpus_per_task} is below the {want} cores that go with {gpus_per_task} "
                      f"GPU(s) on {t.label}; memory is granted per reserved core there: use --cpus-per-task={want}")
    elif gpus_per_task and job.cpus_per_task < 2:
        findings.warn("cpus-per-task-small", f"--cpus-per-task={job.cpus_per_task} leaves no core for DataLoader "
                      "workers; use at least 2")
    if t and t.cores and job.cpus_per_task and tasks_per_node:
        busiest = max(tasks_per_node)
        if job.cpus_per_task * busiest > t.cores:
            findings.error("cpus-exceed-node",
                           f"{busiest} task(s) x --cpus-per-task={job.cpus_per_task} = "
                           f"{busiest * job.cpus_per_task} cores, but {t.label} have {t.cores}; "
                           f"use --cpus-per-task <= {max(1, t.cores // busiest)}")
    hints = [h.lower() for h in _tokens(job.hint or "")]
    if "nomultithread" not in hints and all(h in HINTS for h in hints if h):  # a hint sbatch refuses: bad-value
        findings.warn("hint-missing", "--hint=nomultithread is not set: tasks get hyperthreads instead of "
                      "physical cores (Jean Zay's advice for its jobs is --hint=nomultithread)")


def qos_of(job: Job) -> tuple[str | None, str | None]:
    """(family, level) of --qos: qos_gpu_h100-t4 -> (qos_gpu_h100, t4); (None, None) without --qos."""
    return qos_words(job.qos)


def qos_words(qos: str | None) -> tuple[str | None, str | None]:
    m = re.fullmatch(r"(qos_\w+?)-(dev|t3|t4)", (qos or "").lower())
    return (m.group(1), m.group(2)) if m else ((qos.lower(), None) if qos else (None, None))


def check_time(job: Job, findings: Findings, limits: bool = True) -> None:
    """--time against the QoS's limit and the partition's, on Jean Zay (limits=False: its form only)."""
    if job.time == "allocated":  # inside the allocation the limit is already granted
        return
    ntype = node_type(job)
    t = JEAN_ZAY[ntype] if ntype else None
    if job.time is None:
        default = t.default_minutes if t else DEFAULT_TIME_MINUTES
        findings.warn("time-missing", f"--time is not given: the partition's default applies, {default} minutes"
                      + (f" on {t.label}" if t else " on Jean Zay's GPU partitions") + "; add --time=HH:MM:SS, e.g. "
                      "--time=02:00:00")
        return
    minutes = time_minutes(job.time)
    if minutes is None:
        findings.error("bad-time", f"--time={job.time!r} is not a Slurm time (MM, HH:MM:SS or D-HH:MM:SS)")
        return
    if t is None or not limits:
        return  # a partition that isn't Jean Zay's, or the limits are Slurm's own (check_live) or not judged
    family, level = qos_of(job)
    shown = "unlimited" if minutes == float("inf") else f"{minutes / 60:.1f} h"
    implicit = False
    if t.qos and level in t.qos_hours and family in t.qos:
        limit, name = t.qos_hours[level], job.qos
    elif t.qos and not job.qos:  # the association's default QoS: the table knows the documented one only
        level = next(iter(t.qos_hours))
        limit, name, implicit = t.qos_hours[level], f"the default QoS ({t.qos[0]}-{level})", True
    elif not t.qos:
        limit, name = t.max_hours, f"{t.label.split(' (')[0]} ({t.partitions[0]})"
    elif not qos_in_table(job.qos):  # a project's own QoS (check_qos says so): its limit is its grant's
        limit, name = t.max_hours, f"the partition {t.partitions[0]}"
    else:  # a QoS of other nodes (check_qos says so): the longest these nodes have
        limit, name = max(t.qos_hours.values()), f"the longest QoS of {t.label}"
    if minutes > limit * 60:
        longer = [q for q, h in t.qos_hours.items() if h * 60 >= minutes]
        fix = (f"add --qos={t.qos[0]}-{longer[0]} (up to {t.qos_hours[longer[0]]} h)" if longer else
               f"use --time <= {max(list(t.qos_hours.values()) or [t.max_hours]):g}:00:00 and resume from a checkpoint")
        if implicit and minutes <= t.max_hours * 60:  # a project's association may default to a longer QoS
            findings.warn("time-over-qos", f"--time={job.time} ({shown}) is over the {limit:g} h of {name}, "
                          f"{TABLE_SAYS}: Slurm won't run a job left on it (refused, or pending with "
                          f"QOSMaxWallDurationPerJobLimit); {fix}, "
                          f"unless your association's default QoS is longer (`{ASSOC_COMMAND}`)")
        else:
            findings.error("time-over-qos", f"--time={job.time} ({shown}) is over the {limit:g} h of {name}, "
                           f"{TABLE_SAYS}: Slurm won't run the job; {fix}")


def check_jean_zay(job: Job, findings: Findings, gpus_asked: int | None = None,
                   cores_asked: int | None = None, table_qos: bool = True) -> None:
    """The account's hours, the QoS's family and size, the modules the nodes need (IDRIS: a project spends V100,
    A100, H100 or CPU hours through <project>@v100, @a100, @h100 or @cpu; sources at JEAN_ZAY)."""
    ntype = node_type(job)
    if ntype is None:
        return
    t = JEAN_ZAY[ntype]
    suffix = (job.account or "").rpartition("@")[2].lower() if "@" in (job.account or "") else None
    if suffix and suffix in ("v100", "a100", "h100", "cpu") and t.accounts and suffix not in t.accounts:
        where = ("-C " + job.constraint if job.constraint else "-p " + job.partition if job.partition
                 else "no -p: the default " + t.partitions[0])
        owner = next((n for n, r in JEAN_ZAY.items() if suffix in r.accounts), "v100-4")
        findings.error("account-mismatch",
                       f"--account={job.account} spends {suffix.upper()} hours but the job asks for {t.label} "
                       f"({where}), {TABLE_SAYS}; use --account=<project>@{t.accounts[0]}, or "
                       f"{'-p ' + JEAN_ZAY[owner].partitions[0] if suffix != 'v100' else '-p gpu_p13'} for the nodes "
                       "of that account")
    if job.time != "allocated" and table_qos:  # a running job already has its account and QoS
        check_qos(job, t, gpus_asked, cores_asked, findings)
    mods = job.modules
    if not t.arch or not mods:
        return
    at = next((i for i, m in enumerate(mods) if m.startswith(t.arch)), None)
    late = [m for m in mods[:at] if not m.startswith(("arch/", "cpuarch/"))] if at is not None else []
    if at is None or any(m.startswith("pytorch") for m in late):
        first = job.torch_module or next((m for m in mods if not m.startswith(("arch/", "cpuarch/"))), mods[0])
        msg = (f"{t.label} with 'module load {first}' but no 'module load {t.arch}' before it: the modules built "
               f"for these nodes are found only after it; add 'module load {t.arch}' first")
        if t.arch_required:  # IDRIS: the H100 stack is loaded with arch/h100 before the other modules
            findings.error("arch-module-missing", msg)
        else:  # IDRIS's template: cpuarch/amd gives gpu_p5 the modules built for its AMD CPUs
            findings.warn("arch-module-missing", msg)


def qos_in_table(qos: str | None) -> bool:
    """Whether --qos is a family and level of Jean Zay's table (qos_gpu-t3, qos_gpu_a100-t4: known words, whether or
    not those nodes have it); qos_gpu-gc, a QoS granted to one project, is not: no table can know it."""
    family, level = qos_words(qos)
    return bool(level) and any(family in t.qos for t in JEAN_ZAY.values())


def check_qos(job: Job, t: NodeType, gpus_asked: int | None, cores_asked: int | None, findings: Findings) -> None:
    family, level = qos_of(job)
    if not job.qos or not t.qos:
        return
    valid = ", ".join(f"{t.qos[0]}-{q}" for q in t.qos_hours)
    if not qos_in_table(job.qos):
        findings.warn("qos-mismatch", f"--qos={job.qos} is not in {TABLE_QOS} for {t.label} ({valid}): a project "
                      f"may be granted its own QoS; `{ASSOC_COMMAND}` lists yours and `{QOS_COMMAND}` their limits")
        return
    if family not in t.qos or level not in t.qos_hours:
        findings.error("qos-mismatch", f"--qos={job.qos} is not a QoS of {t.label}, {TABLE_SAYS}: Slurm refuses the "
                       f"job ('Invalid qos specification'); use one of {valid}")
        return
    limit = t.qos_limit.get(level)
    count, unit = (gpus_asked, "GPUs") if t.gpus else (cores_asked, "cores")
    if limit and count and count > limit:
        findings.error("qos-limit", f"--qos={job.qos} allows at most {limit} {unit} per job ({TABLE_SAYS}) and this "
                       f"job asks for {count}: it would wait forever (or be refused); use fewer {unit}"
                       + (" or --qos=" + t.qos[0] + "-t3 (20 h)" if level == "t4" else ""))

# What Slurm does with a job its configuration forbids, measured on the test cluster with slurmdbd
# (tests/test_site_slurmdbd.py): refused at submission, or accepted and then pending with this reason forever.
PENDING = {"wall": "QOSMaxWallDurationPerJobLimit", "gpu_job": "QOSMaxGRESPerJob", "gpu_user": "QOSMaxGRESPerUser",
           "cpu_job": "QOSMaxCpuPerJobLimit", "cpu_user": "QOSMaxCpuPerUserLimit", "part_time": "PartitionTimeLimit",
           "allow_qos": "Job's QOS not permitted to use this partition"}  # (a sentence, not a code, in 22.05)
REFUSED = {"partition": "Invalid partition name specified", "qos": "Invalid qos specification",
           "account": "Invalid account or account/partition combination specified",
           "deny": "Job violates accounting/QOS policy (job submit limit, user's size and/or time limits)",
           "part_time": "Requested time limit is invalid (missing or exceeds some limit)"}


def fate(refused: str | None, pending: str) -> str:
    """How a job Slurm won't run fails: at submission (sbatch's message) or pending forever (squeue's reason)."""
    return (f"sbatch refuses it ('{REFUSED[refused]}')" if refused else
            f"sbatch accepts it and it pends forever (squeue's reason: {PENDING[pending]})")


def check_live(job: Job, facts, gpus: int | None, cores: int | None, findings: Findings) -> None:
    """The partition, account, QoS and their limits as Slurm's configuration here states them (a site_slurm.SiteFacts
    read by --site live): the site's own rules, in place of the table's."""
    if job.time == "allocated":  # a running job already has its partition, account and QoS
        return
    here = f"Slurm's configuration here ({facts.cluster or 'this cluster'}, Slurm {facts.version})"
    names = [p for p in (job.partition or "").split(",") if p] or \
        [n for n, p in facts.partitions.items() if p["default"]][:1]
    unknown = [p for p in names if p not in facts.partitions]
    if unknown:
        findings.error("partition-unknown", f"-p {unknown[0]} is not a partition of {here}: "
                       f"{fate('partition', '')}; use one of {', '.join(sorted(facts.partitions))}")
        return
    part = facts.partitions[names[0]] if names else None
    qos = live_qos(job, facts, names[0] if names else "", here, findings)
    if qos is False:
        return
    allow = part["allow_qos"] if part else "ALL"
    if qos and allow.upper() != "ALL" and qos not in allow.lower().split(","):
        # slurm.conf(5) AllowQos: checked when the job is scheduled, not at submission, unless EnforcePartLimits
        # is set (then sbatch refuses 'Invalid qos specification'): measured, tests/site_cases.py
        refused = "qos" if facts.enforce_part_limits.upper() in ("ANY", "ALL", "YES") else None
        findings.error("qos-mismatch", f"QoS {qos}{'' if job.qos else ' (your association default)'} is not allowed "
                       f"on partition {names[0]} in {here} (AllowQos={allow}): {fate(refused, 'allow_qos')}; use one "
                       f"of {allow}" + ("" if job.qos else " with --qos"))
        return
    live_limits(job, facts, part, names[0] if names else "", qos, gpus, cores, here, findings)


def live_qos(job: Job, facts, partition: str, here: str, findings: Findings):
    """The QoS the job runs under (its --qos, else its association's default), or False where Slurm refuses the
    account or the QoS."""
    assocs = [a for a in facts.assocs if a["partition"] in ("", partition)]
    accounts = sorted({a["account"] for a in assocs})
    if job.account and facts.enforces("associations") and job.account.lower() not in accounts:
        findings.error("account-mismatch", f"--account={job.account} is none of your associations in {here} "
                       f"({', '.join(accounts) or 'none'}): {fate('account', '')}; `{ASSOC_COMMAND}` lists them")
        return False
    account = (job.account or facts.default_account).lower()  # sbatch(1) --account: else the user's default
    mine = [a for a in assocs if not account or a["account"] == account]
    allowed = sorted({q for a in mine for q in a["qos"]})
    if not job.qos:
        return next((a["default_qos"] for a in mine if a["default_qos"]), None)
    if facts.enforces("qos") and job.qos.lower() not in allowed:
        findings.error("qos-mismatch", f"--qos={job.qos} is not among your QoS in {here}"
                       f"{' for --account=' + job.account if job.account else ''} ({', '.join(allowed) or 'none'}): "
                       f"{fate('qos', '')}; use one of them, or ask for it (`{ASSOC_COMMAND}` lists yours)")
        return False
    return job.qos.lower()


def live_limits(job: Job, facts, part: dict | None, partition: str, qos: str | None, gpus: int | None,
                cores: int | None, here: str, findings: Findings) -> None:
    """--time against the QoS's MaxWall and the partition's MaxTime; the GPUs and cores against the QoS's per-job
    and per-user TRES limits (enforced with AccountingStorageEnforce=limits; DenyOnLimit refuses at submission)."""
    q = facts.qos.get(qos) if qos and facts.enforces("limits") else None
    deny = "deny" if q and "DenyOnLimit" in q["flags"] else None
    minutes = time_minutes(job.time) if job.time else None
    wall = time_minutes(q["max_wall"]) if q and q["max_wall"] else None
    longest = time_minutes(part["max_time"]) if part and part["max_time"] else None
    shown = f"--time={job.time} ({minutes / 60:.1f} h)" if minutes and minutes != float("inf") else f"--time={job.time}"
    if minutes and wall and minutes > wall and "PartitionTimeLimit" not in (q or {}).get("flags", ""):
        findings.error("time-over-qos", f"{shown} is over QoS {qos}'s MaxWall {q['max_wall']} in {here}: "
                       f"{fate(deny, 'wall')}; use --time <= {q['max_wall']} or a QoS of yours that allows it")
    elif minutes and longest and minutes > longest:
        refused = "part_time" if facts.enforce_part_limits.upper() in ("ANY", "ALL", "YES") else None
        findings.error("time-over-qos", f"{shown} is over partition {partition}'s MaxTime {part['max_time']} in "
                       f"{here}: {fate(refused, 'part_time')}; use --time <= {part['max_time']}")
    for count, tres, unit in ((gpus, "gres/gpu", "GPUs"), (cores, "cpu", "cores")):
        key = "gpu" if unit == "GPUs" else "cpu"
        for scope, limits in (("job", q["max_tres"] if q else {}), ("user", q["max_tres_pu"] if q else {})):
            if count and tres in limits and count > limits[tres]:
                findings.error("qos-limit", f"the job asks for {count} {unit} and QoS {qos} allows {limits[tres]} "
                               f"per {scope} in {here}: {fate(deny, f'{key}_{scope}')}; use fewer {unit}")
                return

DEFAULT_TIME_MINUTES = 10  # Jean Zay's GPU partitions, when the node type isn't known


def check_engine(job: Job, t: Training, findings: Findings) -> None:
    """The script's `module load pytorch-gpu/py3/X` (inside an allocation: the torch installed there) against what
    its trainer line asks for (TORCH_FEATURES)."""
    version = version_tuple(job.torch_version) if job.torch_version else torch_version_of(job.torch_module)
    if not version:
        return
    source = f"torch {job.torch_version} is installed here" if job.torch_version else f"the script loads {job.torch_module}"
    for line in torch_refusals(f"{version[0]}.{version[1]}", t):
        line = line.replace(f"this is torch {version[0]}.{version[1]}", source)
        if t.layout == "replica":
            findings.error("engine-unavailable", line)
        else:
            findings.error("torch-too-old", line)


# ---- II.4 Reading a job script: the file, sbatch's directives, bash's commands, the launch lines ---------------------

# slurmctld refuses a batch script longer than max_script_size, 4 MiB unless SchedulerParameters says otherwise
# (22.05 src/slurmctld/job_mgr.c, _test_job_desc_fields); the checker reads no more than that.
MAX_SCRIPT_BYTES = 4 * 2 ** 20


def read_script_text(path: str | os.PathLike) -> tuple[str, bool]:
    """The script's text and whether it is longer than slurmctld accepts. Only a regular file or a pipe is read,
    at most MAX_SCRIPT_BYTES + 1 bytes of it: a device (/dev/zero) never ends, and a FIFO nobody writes to never
    opens for a plain open()."""
    import select
    import stat
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    kind = next((name for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                                         (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
                 if test(mode)), None)
    if kind:
        raise UsageError(f"cannot read {path}: it is {kind}, not a job script; give the script's file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    chunks, size, deadline = [], 0, time.monotonic() + 2.0  # a pipe's writer gets 2 s to say everything
    try:
        while size <= MAX_SCRIPT_BYTES:
            try:
                chunk = os.read(fd, min(1 << 16, MAX_SCRIPT_BYTES + 1 - size))
            except BlockingIOError:
                if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    raise UsageError(f"cannot read {path}: nothing more came through the pipe within 2 s; save the "
                                     "script to a file and check that") from None
                continue
            except OSError as exc:
                raise UsageError(f"cannot read {path}: {exc.strerror}") from None
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)[:MAX_SCRIPT_BYTES].decode("utf-8", errors="replace"), size > MAX_SCRIPT_BYTES


def read_directive(line: str, magic: str, where: str, job: Job, findings: Findings) -> None:
    """One '#SBATCH' (or '#SLURM') line: sbatch 22.05 reads what follows the magic word, with or without a space
    ('#SBATCH-N 2' and '#SBATCH<tab>-N 2' both gave 2 nodes on the test cluster), up to a '#' comment."""
    try:
        tokens = shlex.split(line[len(magic):], comments=True)
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
    check_option_values(job, options, where, findings)


# the first line that is neither blank nor a comment (str.strip's and re's whitespace are the same set), and the lines
# of the header that sbatch may take as directives: found by regular expressions, not a Python loop over the lines, so
# that a 4 MiB script of comments is read in milliseconds
_FIRST_COMMAND = re.compile(r"^[^\S\n]*[^#\s]", re.M)
_HEADER_DIRECTIVE = re.compile(r"^#(?:SBATCH|SLURM|PBS|BSUB)[^\n]*", re.M)
_STRAY_DIRECTIVE = re.compile(r"^[^\S\n]*#[^\S\n]*(?:SBATCH|SLURM)[^\n]*", re.M | re.I)
MAX_DIRECTIVES = 1000  # directive lines read (shlex on each, a Python loop per character); a real header has tens
MAX_DIRECTIVE_TEXT = 64 * 1024  # and their characters, together
MAX_STRAY_SAID = 20  # stray directives reported one by one; past these, the first ones say enough


def read_directives(text: str, name: str, job: Job, findings: Findings) -> int:
    """The header as sbatch 22.05 reads it (src/sbatch/opt.c, _opt_batch_script): every line up to the first one that
    is neither blank nor a comment; in it, lines starting with '#SBATCH', or '#SLURM' (applied too, with sbatch's
    'Change from #SLURM to #SBATCH'), in column 0, case sensitive, are directives; '#PBS' and '#BSUB' lines are
    translated unless --ignore-pbs. Returns the line number of the first command (0: none). Raises TooComplex past
    MAX_DIRECTIVES directive lines (what was read stands)."""
    first = _FIRST_COMMAND.search(text)
    end = first.start() if first else len(text)
    foreign, slurm_lines, at, lineno, size = [], [], 0, 1, 0
    for count, m in enumerate(_HEADER_DIRECTIVE.finditer(text, 0, end)):
        lineno += text.count("\n", at, m.start())
        at, line, where = m.start(), m.group(0), f"{name}:{lineno}"
        size += len(line)
        if count == MAX_DIRECTIVES or size > MAX_DIRECTIVE_TEXT:
            raise TooComplex(lineno, f"more than {MAX_DIRECTIVES} directive lines or {MAX_DIRECTIVE_TEXT // 1024} "
                             "KiB of them")
        magic = next((x for x in ("#SBATCH", "#SLURM") if line.startswith(x)), None)
        if magic:
            read_directive(line, magic, where, job, findings)
            slurm_lines += [where] if magic == "#SLURM" else []
        else:
            foreign.append((where, line.strip()))
    if slurm_lines:
        findings.warn("slurm-directive", f"{slurm_lines[0]}: sbatch 22.05 applies '#SLURM' lines as directives "
                      f"({len(slurm_lines)} line(s); it prints 'Change from #SLURM to #SBATCH in your script', "
                      "measured); write them as '#SBATCH'")
    if foreign and not job.ignore_pbs:
        where, line = foreign[0]
        findings.error("pbs-directive", f"{where}: sbatch also reads '{line}' ({len(foreign)} #PBS/#BSUB line(s); "
                       "measured: '#PBS -l nodes=2' gave a 2-node job), which this plan does not model; write it as "
                       "#SBATCH, or add '#SBATCH --ignore-pbs'")
    return text.count("\n", 0, end) + 1 if first else 0


def stray_directives(text: str, name: str, first_command: int, heredocs: list["HereDoc"],
                     findings: Findings) -> None:
    """Directives sbatch does not read: after the first command, inside a here-document (text the script writes
    for another program: a generated job script), indented, lower case, '# SBATCH'. Only the lines that look like
    one are visited (a regular expression), and the first MAX_STRAY_SAID are reported."""
    starts = [h.first for h in heredocs]  # here-documents come in order and do not overlap
    said: set[int] = set()
    at, lineno, told = 0, 1, 0
    for m in _STRAY_DIRECTIVE.finditer(text):
        if told >= MAX_STRAY_SAID:
            return
        lineno += text.count("\n", at, m.start())
        at, line = m.start(), m.group(0)
        stripped, where = line.strip(), f"{name}:{lineno}"
        k = bisect.bisect_right(starts, lineno) - 1
        if k >= 0 and lineno <= heredocs[k].last:
            h = heredocs[k]
            if k not in said:
                said.add(k)
                told += 1
                findings.warn("ignored-directive", f"{where}: '{stripped}' is inside a here-document (lines "
                              f"{h.first}-{h.last}, up to '{h.delimiter}'): text this script writes, not a directive "
                              "of this job; check the script it generates on its own")
            continue
        if line.startswith(("#SBATCH", "#SLURM")):
            if first_command and lineno > first_command:
                told += 1
                findings.warn("ignored-directive", f"{where}: '{stripped}' comes after the first command (line "
                              f"{first_command}); sbatch ignores it: move it above the first command")
        elif re.match(r"#\s*SBATCH\s*-", stripped, re.I):  # a directive gone wrong, not a comment that says sbatch
            told += 1
            findings.warn("ignored-directive", f"{where}: '{stripped}' is not read by sbatch (a directive is "
                          "'#SBATCH', in capitals, from column 0): write it as '#SBATCH ...' at the start of the line")


# -- bash's words: quotes, expansions, operators and here-documents, as bash reads them --

@dataclass
class Word:
    """One shell word as pieces (kind, text): 'lit' unquoted text, 'sq' single-quoted, 'dq' double-quoted text, 'var'
    an unquoted $expansion (bash splits its value into fields), 'qvar' one inside double quotes, 'array' the inside of
    NAME=( ... )."""
    parts: list[tuple[str, str]]
    line: int

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.parts)

    @property
    def plain(self) -> bool:
        return all(k == "lit" for k, _ in self.parts)


@dataclass
class HereDoc:
    first: int  # the lines of its body
    last: int
    delimiter: str


OPERATORS = ("&&", "||", ";;&", ";;", ";&", "|&", ";", "|", "&", "(", ")")
REDIRECTIONS = ("<<<", "<<-", "<<", "&>>", "&>", ">>", ">&", "<&", "<>", ">|", "<", ">")
BREAK = set(" \t\r\n;&|()<>")
# Runs of characters with nothing to decide in them, taken whole (a regular expression, not a Python loop per
# character: a 4 MiB word or string is read in milliseconds): in a word, inside double quotes, inside $( ) and ${ },
# blank and comment lines after a newline, the text of `...` and $'...'
_PLAIN = re.compile(r"[^ \t\r\n;&|()<>\\'\"$`]+")
_DQ_PLAIN = re.compile(r"[^\"\\$`]+")
_BALANCED_STOP = {"(": re.compile(r"[\\'\"()]"), "{": re.compile(r"[\\{}]")}
_COMMAND_LINE = re.compile(r"^[ \t\r]*[^ \t\r\n#]", re.M)  # the next line that is not blank or a comment
_BACKQUOTED = re.compile(r"(?:[^`\\]|\\.)*", re.S)
_ANSI_C = re.compile(r"(?:[^'\\]|\\.)*", re.S)
_REDIRECTION_START = re.compile(r"\d*[<>&]")
_BLANKS = re.compile(r"[ \t\r]+")


class TooComplex(Exception):
    """The reading of a script spent its budget at `line` (ShellBudget, MAX_TOKENS, MAX_DIRECTIVES): what was read
    up to there stands, the rest is not followed."""

    def __init__(self, line: int, what: str) -> None:
        super().__init__(f"line {line}: {what}")
        self.line, self.what = line, what


class ShellLexer:
    """bash's tokens: Word, or (operator, line) for control operators and newlines. Redirections and their targets
    are dropped (they are not arguments); here-document bodies are set aside in `heredocs`, never read as commands.
    At most MAX_TOKENS steps are taken (a token, a piece of a word, a run of blanks: each token costs a few hundred
    bytes and the parser's and runner's time): past them `cut` is the line where reading stopped, and the tokens so
    far stand. Blank and comment lines make one newline token."""

    MAX_TOKENS = 50_000

    def __init__(self, text: str) -> None:
        self.s, self.i, self.line = text, 0, 1
        self.tokens: list = []
        self.heredocs: list[HereDoc] = []
        self.pending: list[tuple[str, bool]] = []
        self.unclosed: tuple[int, str] | None = None  # where a quote opens that never closes
        self.cut: int | None = None  # where MAX_TOKENS stopped the reading
        self.count = 0  # tokens, and pieces of words (a word of a million $X is a million pieces)

    def run(self) -> "ShellLexer":
        s = self.s
        while self.i < len(s) and not self.spent():
            self.count += 1
            c = s[self.i]
            if c in " \t\r":
                self.i = _BLANKS.match(s, self.i).end()
            elif s.startswith("\\\n", self.i):
                self.i, self.line = self.i + 2, self.line + 1
            elif c == "\n":
                if not (self.tokens and self.tokens[-1].__class__ is tuple and self.tokens[-1][0] == "\n"):
                    self.tokens.append(("\n", self.line))
                self.i, self.line = self.i + 1, self.line + 1
                self.bodies()
                found = _COMMAND_LINE.search(s, self.i)  # the blank and comment lines that follow: skipped at once
                end = found.start() if found else max(self.i, s.rfind("\n") + 1)
                self.line += s.count("\n", self.i, end)
                self.i = end
            elif c == "#":
                end = s.find("\n", self.i)
                self.i = len(s) if end < 0 else end
            elif s.startswith("((", self.i):  # (( arithmetic )): a command that is no launch
                end = self.balanced(self.i, "(", ")")
                self.tokens.append(Word([("var", "$" + s[self.i:end])], self.line))
                self.line += s.count("\n", self.i, end)
                self.i = end
            elif self.redirection():
                continue
            elif c in ";&|()" or (c in "<>" and not s.startswith("(", self.i + 1)):
                op = next((o for o in OPERATORS if s.startswith(o, self.i)), c)
                self.tokens.append((op, self.line))
                self.i += len(op)
            else:
                self.word()
        if self.cut:  # the command the reading stopped in is left out whole (half a trainer line would mislead)
            while self.tokens and not (self.tokens[-1].__class__ is tuple and self.tokens[-1][0] == "\n"):
                dropped = self.tokens.pop()
                self.cut = dropped.line if isinstance(dropped, Word) else dropped[1]
        return self

    def spent(self) -> bool:
        """Past MAX_TOKENS: the reading stops here (the rest of the text is left)."""
        if self.count < self.MAX_TOKENS:
            return False
        self.cut, self.i = self.cut or self.line, len(self.s)
        return True

    def redirection(self) -> bool:
        s, j = self.s, self.i
        if not _REDIRECTION_START.match(s, j):  # most tokens: no redirection, decided in one step
            return False
        while j < len(s) and s[j].isdigit():
            j += 1
        op = next((r for r in REDIRECTIONS if s.startswith(r, j)), None)
        if op is None or (j > self.i and op.startswith("&")) or s.startswith("(", j + len(op)):
            return False
        self.i = j + len(op)
        while self.i < len(s) and s[self.i] in " \t":
            self.i += 1
        target = self.word(emit=False)
        if op in ("<<", "<<-") and target is not None:
            self.pending.append((target.text, op == "<<-"))
        return True

    def bodies(self) -> None:
        """The bodies of the here-documents announced on the line that just ended, each up to its delimiter line
        (found by a regular expression: a body of a million lines costs no Python loop)."""
        for delimiter, strip in self.pending:
            first, s = self.line, self.s
            if self.i >= len(s):
                self.heredocs.append(HereDoc(first, first - 1, delimiter))
                continue
            end = re.compile("^" + ("\t*" if strip else "") + re.escape(delimiter) + "$", re.M).search(s, self.i)
            stop = end.end() if end else len(s)
            lines = s.count("\n", self.i, stop) + 1
            self.i, self.line = stop + 1, self.line + lines
            self.heredocs.append(HereDoc(first, self.line - 1, delimiter))
        self.pending = []

    def word(self, emit: bool = True) -> Word | None:
        s, parts, lit, line = self.s, [], [], self.line

        def flush() -> None:
            if lit:
                parts.append(("lit", "".join(lit)))
                lit.clear()
        while self.i < len(s) and not self.spent():
            self.count += 1
            c = s[self.i]
            if c == "(" and not parts and re.fullmatch(r"[A-Za-z_]\w*\+?=", "".join(lit)):  # NAME=( array )
                flush()
                end = self.balanced(self.i, "(", ")")
                parts.append(("array", s[self.i + 1:end - 1]))
                self.line += s.count("\n", self.i, end)
                self.i = end
            elif c in BREAK and not (c in "<>" and s.startswith("(", self.i + 1)):
                break
            elif c == "\\":
                if s.startswith("\\\n", self.i):
                    self.line += 1
                else:
                    lit.append(s[self.i + 1:self.i + 2])
                self.i += 2
            elif c == "'":
                end = s.find("'", self.i + 1)
                if end < 0:
                    self.unclosed = self.unclosed or (self.line, "'")
                    end = len(s)
                flush()
                parts.append(("sq", s[self.i + 1:end]))
                self.line += s.count("\n", self.i, end)
                self.i = end + 1
            elif s.startswith("$'", self.i):
                end = _ANSI_C.match(s, self.i + 2).end()
                flush()
                parts.append(("sq", s[self.i + 2:end].replace("\\n", "\n").replace("\\t", "\t")))
                self.i = end + 1
            elif c == '"':
                flush()
                self.double_quoted(parts)
            elif c in "$`<>":
                flush()
                parts.append(("var", self.expansion()))
            else:
                end = _PLAIN.match(s, self.i).end()
                lit.append(s[self.i:end])
                self.i = end
        flush()
        if not parts:
            return None
        w = Word(parts, line)
        if emit:
            self.tokens.append(w)
        return w

    def double_quoted(self, parts: list) -> None:
        s, text = self.s, []
        self.i += 1
        while self.i < len(s) and s[self.i] != '"' and not self.spent():
            self.count += 1
            c = s[self.i]
            if c == "\\" and s[self.i + 1:self.i + 2] in ('$', '`', '"', '\\', '\n'):
                text.append(s[self.i + 1] if s[self.i + 1] != "\n" else "")
                self.line += s[self.i + 1] == "\n"
                self.i += 2
            elif c == "`" or (c == "$" and re.match(r"[{(\w@*#?$!-]", s[self.i + 1:self.i + 2] or " ")):
                if text:
                    parts.append(("dq", "".join(text)))
                    text = []
                parts.append(("qvar", self.expansion()))
            elif c in "\\$":
                text.append(c)
                self.i += 1
            else:
                end = _DQ_PLAIN.match(s, self.i).end()
                self.line += s.count("\n", self.i, end)
                text.append(s[self.i:end])
                self.i = end
        if self.i >= len(s) and self.cut is None:
            self.unclosed = self.unclosed or (self.line, '"')
        if text or not parts or parts[-1][0] != "qvar":
            parts.append(("dq", "".join(text)))
        self.i += 1

    def expansion(self) -> str:
        """$name, ${...}, $(...), $((...)), `...`, <(...) as written, balanced, quotes respected."""
        s, start = self.s, self.i
        if s[self.i] == "`":
            self.i = _BACKQUOTED.match(s, self.i + 1).end() + 1
        elif s[self.i] in "<>":
            self.i = self.balanced(self.i + 1, "(", ")")
        elif s.startswith("${", self.i):
            self.i = self.balanced(self.i + 1, "{", "}")
        elif s.startswith("$(", self.i):
            self.i = self.balanced(self.i + 1, "(", ")")
        else:
            self.i = re.compile(r"\$(?:[A-Za-z_]\w*|[0-9@*#?$!-])?").match(s, self.i).end()
        self.line += s.count("\n", start, self.i)
        return s[start:self.i]

    def balanced(self, at: int, open_: str, close: str) -> int:
        """The index after the bracket that closes the one at `at` (quoted text skipped)."""
        s, depth, j, stop = self.s, 0, at, _BALANCED_STOP[open_]
        while j < len(s):
            self.count += 1  # a bracket or quote: a step of the budget (a million '$(' never closed)
            if self.spent():
                return len(s)
            m = stop.search(s, j)
            if m is None:
                return len(s)
            j = m.start()
            c = s[j]
            if c == "\\":
                j += 2
                continue
            if c in "'\"":
                j = s.find(c, j + 1)
                j = len(s) if j < 0 else j + 1
                continue
            depth += (c == open_) - (c == close)
            j += 1
            if depth == 0:
                return j
        return len(s)


# -- bash's grammar, far enough to know which commands run, in which order, under which conditions --

@dataclass
class Node:
    kind: str  # simple, seq, andor, pipe, if, loop, case, group, subshell, func
    line: int = 0
    words: list = field(default_factory=list)  # simple: its words; loop: the words after 'in'; case: the word
    children: list = field(default_factory=list)
    name: str = ""  # the loop's variable, the function's name


class ShellParser:
    """Commands as a tree. Compound commands nest at most MAX_DEPTH deep (a real script nests a few; each level is a
    few Python frames here and in ShellRun): past that the parse stops and `cut` is the line it reached."""

    MAX_DEPTH = 40

    def __init__(self, tokens: list) -> None:
        self.t, self.i = tokens, 0
        self.depth, self.cut = 0, None

    def peek(self, ahead: int = 0):
        return self.t[self.i + ahead] if self.i + ahead < len(self.t) else None

    def op(self, *names: str, ahead: int = 0) -> bool:
        tok = self.peek(ahead)
        return isinstance(tok, tuple) and tok[0] in names

    def keyword(self, *names: str) -> bool:
        tok = self.peek()
        return isinstance(tok, Word) and tok.plain and tok.text in names

    def skip(self, *ops: str) -> None:
        while self.op("\n", *ops):
            self.i += 1

    def expect(self, name: str) -> None:
        self.skip(";")
        if self.keyword(name):
            self.i += 1

    def parse_list(self, stop: tuple[str, ...] = ()) -> Node:
        self.depth += 1
        try:
            return self._parse_list(stop)
        finally:
            self.depth -= 1

    def _parse_list(self, stop: tuple[str, ...]) -> Node:
        seq = Node("seq")
        if self.depth > self.MAX_DEPTH:
            tok = self.peek()
            self.cut = self.cut or (tok.line if isinstance(tok, Word) else tok[1] if tok else 0)
            self.i = len(self.t)
            return seq
        while True:
            self.skip(";", "&")
            if self.peek() is None or self.keyword(*stop) or self.op(")", ";;", ";&", ";;&"):
                return seq
            start = self.i
            seq.children.append(self.parse_andor())
            if self.i == start:  # a token no rule takes: skip it rather than loop
                self.i += 1

    def parse_andor(self) -> Node:
        node = Node("andor", children=[self.parse_pipeline()])
        while self.op("&&", "||"):
            self.i += 1
            self.skip()
            node.children.append(self.parse_pipeline())
        return node if len(node.children) > 1 else node.children[0]

    def parse_pipeline(self) -> Node:
        while self.keyword("!"):
            self.i += 1
        node = Node("pipe", children=[self.parse_command()])
        while self.op("|", "|&"):
            self.i += 1
            self.skip()
            node.children.append(self.parse_command())
        return node if len(node.children) > 1 else node.children[0]

    def parse_command(self) -> Node:
        tok = self.peek()
        line = tok.line if isinstance(tok, Word) else (tok[1] if tok else 0)
        if self.op("("):
            self.i += 1
            body = self.parse_list()
            self.i += self.op(")")
            return Node("subshell", line, children=[body])
        if isinstance(tok, Word) and tok.plain and tok.text in ("if", "for", "select", "while", "until", "case",
                                                                 "{", "[[", "function"):
            return getattr(self, "parse_" + {"{": "group", "[[": "test", "select": "for"}.get(tok.text, tok.text))(line)
        words = []
        while isinstance(self.peek(), Word):
            words.append(self.peek())
            self.i += 1
        if len(words) == 1 and self.op("(") and self.op(")", ahead=1):  # name() { ...; }
            self.i += 2
            return self.parse_function_body(words[0].text, line)
        return Node("simple", line, words=words)

    def parse_if(self, line: int) -> Node:
        self.i += 1
        node = Node("if", line)
        while True:
            node.children.append(self.parse_list(("then",)))
            self.expect("then")
            node.children.append(self.parse_list(("elif", "else", "fi")))
            if not self.keyword("elif"):
                break
            self.i += 1
        if self.keyword("else"):
            self.i += 1
            node.children += [Node("seq"), self.parse_list(("fi",))]
            node.name = "else"
        self.expect("fi")
        return node

    def parse_for(self, line: int) -> Node:
        self.i += 1
        node = Node("loop", line)
        if isinstance(self.peek(), Word):
            node.name = self.peek().text if self.peek().plain and self.peek().text.isidentifier() else ""
            self.i += 1
        self.skip(";")
        if self.keyword("in"):
            self.i += 1
            while isinstance(self.peek(), Word):
                node.words.append(self.peek())
                self.i += 1
        self.expect("do")
        node.children = [self.parse_list(("done",))]
        self.expect("done")
        return node

    def parse_while(self, line: int) -> Node:
        self.i += 1
        node = Node("loop", line, children=[self.parse_list(("do",))])
        self.expect("do")
        node.children.append(self.parse_list(("done",)))
        self.expect("done")
        return node

    parse_until = parse_while

    def parse_case(self, line: int) -> Node:
        self.i += 1
        node = Node("case", line)
        if isinstance(self.peek(), Word):
            node.words.append(self.peek())
            self.i += 1
        self.expect("in")
        while True:
            self.skip(";;", ";&", ";;&")
            if self.peek() is None or self.keyword("esac"):
                self.i += self.peek() is not None
                return node
            patterns = []
            while self.peek() is not None and not self.op(")"):
                if isinstance(self.peek(), Word):
                    patterns.append(self.peek().text)
                self.i += 1
            self.i += 1
            arm = self.parse_list(("esac",))
            arm.name = "|".join(patterns)
            node.children.append(arm)

    def parse_group(self, line: int) -> Node:
        self.i += 1
        body = self.parse_list(("}",))
        self.expect("}")
        return Node("group", line, children=[body])

    def parse_test(self, line: int) -> Node:
        while self.peek() is not None and not (isinstance(self.peek(), Word) and self.peek().text == "]]"):
            self.i += 1
        self.i += 1
        return Node("simple", line, words=[Word([("lit", "[[")], line)])

    def parse_function(self, line: int) -> Node:
        self.i += 1
        name = self.peek().text if isinstance(self.peek(), Word) else ""
        self.i += 1
        if self.op("(") and self.op(")", ahead=1):
            self.i += 2
        return self.parse_function_body(name, line)

    def parse_function_body(self, name: str, line: int) -> Node:
        self.skip()
        return Node("func", line, children=[self.parse_command()], name=name)


# -- what each variable holds at each command: bash run in the mind --

class Arr(list):
    """An array variable: a list of values."""


UNKNOWN = None  # a value this reading cannot know: set by the environment, a command, a loop, a branch not taken
PER_TASK = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_TASK_PID", "SLURM_STEP_ID", "SLURM_STEPID",
            "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE",
            "SLURMD_NODENAME", "SLURM_GTIDS")


@dataclass
class Ran:
    """A simple command as bash runs it: its fields after expansion (an expansion this reading cannot know stays as
    written, e.g. '$ARGS' or '${CHUNKS[$SLURM_ARRAY_TASK_ID]}', so it contains '$'), its NAME=value prefixes, and
    the SRUN_/SLURM_ variables exported at that point (srun reads them)."""
    fields: list[str]
    env: dict[str, str | None]
    line: int
    conditional: bool
    exported: dict[str, str | None]


class StopScript(Exception):
    """An `exit` that always runs: nothing after it does."""


class ShellBudget:
    """What reading one script may cost, shared by every shell run in it (the script's, eval's, bash -c's): STEPS
    commands run, expansions, and variables carried through a branch; BYTES of values made by expansions, all
    values together (a piece of a value counts its text and 8 bytes, its slot in the list). A script of a few
    hundred bytes can ask for more than any budget: a function that calls itself ten times, 8 calls deep, is 10^8
    calls; a value doubled on each of 40 lines is 2^40 bytes. Past the budget, TooComplex stops the reading at the
    line being run, and what was read up to there stands. Measured on the worst scripts tried (docs/faults.md): a
    few tenths of a second and under 100 MB."""

    STEPS = 50_000
    BYTES = 32 * 2 ** 20

    def __init__(self) -> None:
        self.steps = self.bytes = 0
        self.line = 0  # the script's line being run (inside a function: the line that called it)

    def spend(self, steps: int = 0, nbytes: int = 0) -> None:
        self.steps += steps
        self.bytes += nbytes
        if self.steps > self.STEPS:
            raise TooComplex(self.line, f"more than {self.STEPS} commands and expansions to follow")
        if self.bytes > self.BYTES:
            raise TooComplex(self.line, f"its variables' values grow past {self.BYTES >> 20} MiB")

    def value(self, value) -> None:
        """Spend what a value just made holds (pieces, or an Arr of pieces)."""
        items = value if isinstance(value, Arr) else [value]
        self.spend(0, sum(len(t) + 8 for item in items for t, _ in item))


class ShellRun:
    """Walks the parsed script keeping what each variable holds; `sink` gets every simple command that runs. A value
    is a list of (text, known) pieces, so '--chunks $CH' keeps '$CH' whole when CH is unknown."""

    MAX_CALLS = 8  # functions calling functions: the depth; the count is the budget's
    MAX_ARITHMETIC = 1000  # characters of a $(( )) this reading works out; longer ones are left unknown

    def __init__(self, variables: dict, sink, exported: set[str] | None = None,
                 budget: ShellBudget | None = None) -> None:
        self.budget = budget or ShellBudget()
        self.top = budget is None  # the script's own shell (not eval's or bash -c's text): it tells the line
        self.cut: TooComplex | None = None  # where the budget stopped the reading
        self.vars: dict = dict(variables)
        self.exported = set(variables) if exported is None else set(exported)
        self.functions: dict[str, Node] = {}
        self.positional: list | None = None  # the script's own $1 ... are unknown (sbatch job.slurm ARGS)
        self.sink, self.conditional, self.calls, self.nesting = sink, 0, 0, 0
        self.sourced: list[str] = []

    @staticmethod
    def known(text: str) -> list:
        return [(text, True)]

    @staticmethod
    def joined(value) -> list:
        """An array's elements joined by spaces, as "${a[*]}" gives them; a scalar as it is."""
        if isinstance(value, Arr):
            out = []
            for n, item in enumerate(value):
                out += ([(" ", True)] if n else []) + item
            return out
        return value

    def text_of(self, value) -> str | None:
        if value is UNKNOWN:
            return None
        pieces = self.joined(value)
        self.budget.value(pieces)
        return "".join(t for t, _ in pieces) if all(k for _, k in pieces) else None

    # ---- expansions ----
    def lookup(self, name: str, index: str | None = None):
        if name.isdigit() or name in ("@", "*", "#"):
            if self.positional is None:
                return UNKNOWN
            if name in ("@", "*"):
                return Arr(list(p) for p in self.positional)
            if name == "#":
                return self.known(str(len(self.positional)))
            k = int(name)
            return list(self.positional[k - 1]) if 0 < k <= len(self.positional) else []
        value = self.vars.get(name, UNKNOWN)
        if value is UNKNOWN or index is None:
            return value[0] if isinstance(value, Arr) and value else ([] if isinstance(value, Arr) else value)
        if index in ("@", "*"):
            return value if isinstance(value, Arr) else Arr([value])
        n = self.arith(index)
        items = value if isinstance(value, Arr) else Arr([value])
        return UNKNOWN if n is None else (items[n] if 0 <= n < len(items) else [])

    def arith(self, expr: str) -> int | None:
        """bash's integer $(( )) with the variables this reading knows; None when it cannot tell."""
        import ast
        self.budget.spend(1)
        if len(expr) > self.MAX_ARITHMETIC:
            return None

        def value(m: re.Match) -> str:
            text = self.text_of(self.lookup(m.group(1) or m.group(2)))
            if text is None or not re.fullmatch(r"\s*-?\d*\s*", text):
                raise ValueError(m.group(0))
            return f"({text.strip() or '0'})"
        try:
            src = re.sub(r"\$\{?([A-Za-z_]\w*)\}?|\b([A-Za-z_]\w*)\b", value, expr)
            tree = ast.parse(src.replace("/", "//").strip() or "0", mode="eval")
        except (ValueError, SyntaxError):
            return None
        allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv,
                   ast.Mod, ast.USub, ast.UAdd)
        if not all(isinstance(n, allowed) and not (isinstance(n, ast.Constant) and type(n.value) is not int)
                   for n in ast.walk(tree)):
            return None
        try:  # only integer literals and + - * // % are left: nothing here can run code or grow without bound
            result = eval(compile(tree, "<arithmetic>", "eval"), {"__builtins__": {}})
        except ArithmeticError:
            return None
        return result if abs(result) < 2 ** 63 else None

    def expansion(self, raw: str):
        """The value of one expansion as written ($X, ${X:-d}, ${A[1]}, $((1+2)), ...), or UNKNOWN."""
        self.budget.spend(1)
        if raw.startswith("$((") and raw.endswith("))"):
            n = self.arith(raw[3:-2])
            return UNKNOWN if n is None else self.known(str(n))
        m = re.fullmatch(r"\$(?:([A-Za-z_]\w*|[0-9@*#])|\{(#?)([A-Za-z_]\w*|[0-9]+|[@*#])(?:\[([^\]]*)\])?"
                         r"(?:(:?[-=+?])(.*))?\})", raw, re.S)
        if raw == "$":
            return self.known("$")
        sliced = re.fullmatch(r"\$\{([@*])(?::(\d+))(?::(\d+))?\}", raw)  # ${@:2}, ${@:2:3}: positional slices
        if sliced:
            args = self.lookup(sliced.group(1))
            if args is UNKNOWN:
                return UNKNOWN
            start = int(sliced.group(2)) - 1 if int(sliced.group(2)) else 0
            end = start + int(sliced.group(3)) if sliced.group(3) else None
            return Arr(args[max(0, start):end])
        if not m:
            return UNKNOWN  # $(command), `command`, <(...), ${X%pattern} ...
        if m.group(1):
            return self.lookup(m.group(1))
        length, name, index, op, alt = m.groups()[1:]
        value = self.lookup(name, index)
        if length:
            text = self.text_of(value)
            if isinstance(value, Arr):
                return self.known(str(len(value)))
            return UNKNOWN if text is None else self.known(str(len(text)))
        # a variable the script never sets is taken as unset (its default applies: the idiom's intent); one the
        # script sets to something this reading can't know leaves the branch unknown
        unset = name not in self.vars and not (name.isdigit() and self.positional is not None)
        if not op or (value is UNKNOWN and not unset):
            return value
        empty = unset or self.text_of(value) == ""
        if (op in (":-", ":=") and empty) or (op in ("-", "=") and unset):
            word = self.expand_text(alt)
            if op.endswith("=") and word is not UNKNOWN:
                self.vars[name] = word
            return word
        if op in (":+", "+"):
            return [] if (empty if op == ":+" else unset) else self.expand_text(alt)
        return value

    def expand_text(self, text: str):
        """Text expanded as inside double quotes (a default value); unknown where defaults nest past MAX_CALLS."""
        self.budget.spend(1, len(text))
        if self.nesting >= self.MAX_CALLS:
            return UNKNOWN
        word = ShellLexer('"' + text.replace('"', '\\"') + '"').word(emit=False)
        self.nesting += 1
        try:
            return self.scalar(word) if word else []
        finally:
            self.nesting -= 1

    def scalar(self, word: Word) -> list:
        """The value of a word where bash does not split it (an assignment): pieces, unknown ones kept as written."""
        out = []
        for kind, text in word.parts:
            if kind in ("lit", "sq", "dq"):
                out.append((text, True))
            elif kind == "array":
                out.append(("(" + text + ")", True))
            else:
                value = self.expansion(text)
                out += [(self.written(text), False)] if value is UNKNOWN else self.joined(value)
        self.budget.value(out)
        return out

    @staticmethod
    def written(raw: str) -> str:
        """An unknown expansion as it stays in a field: always with a '$' (backquotes and <(...) rewritten)."""
        if raw.startswith("`"):
            return "$(" + raw.strip("`") + ")"
        return raw if raw.startswith("$") else "$" + raw[1:]

    def fields(self, word: Word) -> list[str]:
        """bash's expansion of a word into fields: known values split where unquoted, unknown ones kept whole."""
        fields: list[list] = [[]]  # each: the field's text pieces; a field with None first exists even if empty
        for kind, text in word.parts:
            if kind in ("lit", "sq", "dq", "array"):
                fields[-1].append(text if kind != "array" else "(" + text + ")")
                if kind in ("sq", "dq"):
                    fields[-1].insert(0, None)
                continue
            value = self.expansion(text)
            if value is UNKNOWN:
                fields[-1].append(self.written(text))
                continue
            quoted = kind == "qvar"
            if isinstance(value, Arr) and not (quoted and ("[*]" in text or text in ("$*", "${*}"))):
                items = value
            else:
                items = [self.joined(value)]
            for n, item in enumerate(items):
                if n:
                    fields.append([None] if quoted else [])
                if quoted:
                    fields[-1][:0] = [None]
                    fields[-1] += [t for t, _ in item]
                    continue
                for piece, known in item:
                    if not known:
                        fields[-1].append(piece)
                        continue
                    # each field a string of its own: paid for before the split makes them (a 16 MiB value of
                    # "a a a ..." would be 8 million strings, 500 MB)
                    self.budget.spend(0, 64 * (piece.count(" ") + piece.count("\t") + piece.count("\n")))
                    parts = re.split(r"[ \t\n]+", piece)
                    fields[-1].append(parts[0])
                    for p in parts[1:]:
                        fields.append([p])
        out = ["".join(p for p in f if p is not None) for f in fields
               if None in f or "".join(p for p in f if p is not None)]
        self.budget.spend(len(out), sum(len(f) + 8 for f in out))
        return out

    # ---- running ----
    def branch(self, *bodies: Node, taken_for_sure: bool = False) -> None:
        """Run each body from the same state (an if's branches, a case's arms, a loop's body that may not run);
        afterwards a variable keeps a value only if every way through agrees on it."""
        before, outcomes = dict(self.vars), [] if taken_for_sure else [dict(self.vars)]
        self.conditional += 1
        try:
            for body in bodies:
                self.budget.spend(2 * len(before))  # the copy, and the comparison after
                self.vars = dict(before)
                try:
                    self.run(body)
                except StopScript:
                    pass
                outcomes.append(self.vars)
        finally:
            self.conditional -= 1
        self.vars = {k: v for k, v in outcomes[0].items()  # `is` first: a value no branch changed is not compared
                     if all((x := o.get(k, UNKNOWN)) is v or x == v for o in outcomes[1:])}
        for o in outcomes:
            for k in o:
                self.vars.setdefault(k, UNKNOWN)

    def run(self, node: Node) -> None:
        kind = node.kind
        if self.top and not self.calls and node.line:
            self.budget.line = node.line
        self.budget.spend(1)
        if kind in ("seq", "group"):
            for child in (node.children if kind == "seq" else node.children[0].children):
                self.run(child)
        elif kind == "andor":
            self.run(node.children[0])
            self.branch(Node("seq", children=node.children[1:]))
        elif kind in ("pipe", "subshell"):  # each part of a pipeline runs in a subshell: its variables stay there
            saved = dict(self.vars)
            for child in node.children:
                try:
                    self.run(child)
                except StopScript:
                    pass
                self.vars = dict(saved)
        elif kind == "if":
            pairs = [Node("seq", children=[c, b]) for c, b in zip(node.children[::2], node.children[1::2])]
            self.branch(*pairs, taken_for_sure=node.name == "else")
        elif kind == "loop":
            if node.name:
                self.vars[node.name] = UNKNOWN  # one of its words, or what the loop reads
            self.branch(Node("seq", children=node.children))
        elif kind == "case":
            self.branch(*node.children, taken_for_sure=any(c.name.strip() in ("*", "(*") for c in node.children))
        elif kind == "func":
            self.functions[node.name] = node.children[0]
        elif kind == "simple":
            self.simple(node)

    ASSIGNMENT = re.compile(r"([A-Za-z_]\w*)(\[[^\]]*\])?(\+?)=")

    def split_assignment(self, word: Word) -> tuple[str, str, Word] | None:
        kind, text = word.parts[0]
        m = self.ASSIGNMENT.match(text) if kind == "lit" else None
        if not m:
            return None
        rest = [("lit", text[m.end():])] if text[m.end():] else []
        return m.group(1), m.group(3), Word(rest + word.parts[1:], word.line)

    def assign(self, name: str, append: str, value_word: Word) -> None:
        if value_word.parts and value_word.parts[0][0] == "array":
            self.budget.spend(1, len(value_word.parts[0][1]))
            inner = ShellLexer(value_word.parts[0][1]).run().tokens
            value = Arr(self.known(f) if "$" not in f else [(f, False)]
                        for w in inner if isinstance(w, Word) for f in self.fields(w))
        else:
            value = self.scalar(value_word)
        old = self.vars.get(name, UNKNOWN)
        if append and old is not UNKNOWN:
            value = Arr(old + value) if isinstance(old, Arr) or isinstance(value, Arr) else old + value
            self.budget.value(value)
        elif append:
            value = UNKNOWN
        self.vars[name] = value

    def simple(self, node: Node) -> None:
        words, prefix = list(node.words), []
        while words and (a := self.split_assignment(words[0])):
            prefix.append(a)
            words.pop(0)
        if not words:
            for name, append, value in prefix:
                self.assign(name, append, value)
            return
        fields = [f for w in words for f in self.fields(w)]
        if not fields:
            return
        cmd, args = fields[0], fields[1:]
        if cmd in ("export", "declare", "typeset", "local", "readonly"):
            for w in words[1:]:
                a = self.split_assignment(w)
                if a:
                    self.assign(*a)
                if cmd == "export" or (cmd != "local" and "-x" in args):
                    self.exported.add(a[0] if a else w.text)
            return
        if cmd == "unset":
            for name in args:
                self.vars[name] = []
            return
        if cmd in ("source", ".") and args:
            self.sourced.append(args[0])
            return
        if cmd == "read":
            for name in args:
                if name.isidentifier():
                    self.vars[name] = UNKNOWN
            return
        if cmd == "set" and args[:1] == ["--"]:
            self.positional = [[(a, "$" not in a)] for a in args[1:]]
            return
        if cmd == "shift" and self.positional:
            self.positional = self.positional[int(args[0]) if args and args[0].isdigit() else 1:]
            return
        if cmd == "exit":
            if not self.conditional:
                raise StopScript
            return
        if cmd == "eval":
            self.eval(args)
            return
        if cmd in self.functions and self.calls < self.MAX_CALLS:
            saved, self.positional = self.positional, [[(a, "$" not in a)] for a in args]
            self.calls += 1
            self.conditional += 1
            try:
                self.run(self.functions[cmd])
            finally:
                self.positional, self.calls, self.conditional = saved, self.calls - 1, self.conditional - 1
            return
        env = {name: self.text_of(self.scalar(value)) for name, _, value in prefix if name.startswith("SRUN_")}
        exported = {n: self.text_of(self.vars.get(n, UNKNOWN)) for n in self.exported if n.startswith("SRUN_")}
        self.sink(Ran(fields, env, node.line, self.conditional > 0, {**exported, **env}))

    def eval(self, args: list[str]) -> None:
        """eval: its words as a script; an eval of itself goes as deep as functions do (MAX_CALLS), no deeper."""
        if self.calls < self.MAX_CALLS:
            self.calls += 1
            try:
                self.run_text(" ".join(args))
            finally:
                self.calls -= 1

    def run_text(self, text: str) -> None:
        """A piece of shell given as a string (eval, bash -c): parsed and run here."""
        self.budget.spend(1, len(text))
        lexer = ShellLexer(text).run()
        self.budget.spend(len(lexer.tokens))
        self.run(ShellParser(lexer.tokens).parse_list())

    def run_script(self, text: str) -> ShellLexer:
        """Run the script; where the budget runs out (TooComplex), `cut` says where and the commands so far stand."""
        lexer = ShellLexer(text).run()
        parser = ShellParser(lexer.tokens)
        tree = parser.parse_list()
        try:
            self.run(tree)
        except StopScript:
            pass
        except TooComplex as exc:
            self.cut = exc
        except RecursionError:  # functions calling functions, each nesting commands: deeper than Python goes
            self.cut = TooComplex(self.budget.line, "functions and commands nested too deep")
        if parser.cut and not (self.cut and self.cut.line <= parser.cut):
            self.cut = TooComplex(parser.cut, f"commands nested more than {parser.MAX_DEPTH} deep")
        return lexer


# -- the launch lines: which program each command starts, through srun and which launcher --

@dataclass
class LaunchLine:
    """A command that starts a Python program: through srun or not, with which launcher, and the launcher's options.
    `words` is the whole command as bash runs it (srun ... torchrun ... script args), `script` the index in it of the
    program's script (or module)."""
    where: str
    words: list[str]
    script: int
    launcher: str  # "python" (a script run by python), "torchrun", "deepspeed", "accelerate", "program" (anything)
    srun: list[tuple[str, str | None]] | None  # srun's options; None: run by the batch shell, once
    options: dict[str, str | None] = field(default_factory=dict)  # the launcher's own, names with '-' for '_'
    env: dict[str, str | None] = field(default_factory=dict)  # exported SRUN_/SLURM_ variables srun reads
    module: bool = False  # python -m / torchrun -m: `script` names a module
    per_task: bool = False  # inside `srun bash -c '...'`: $SLURM_PROCID and the like are each task's own
    layout: dict = field(default_factory=dict)  # check_job's verdict: agents, processes per node, GPUs each

    @property
    def program(self) -> str:
        return os.path.basename(self.words[self.script]) if self.script < len(self.words) else ""

    @property
    def args(self) -> list[str]:
        return self.words[self.script + 1:]


# The launchers' options that take no value (each launcher's own argparse): torch/distributed/run.py (torch 2.13,
# same names since 1.10 with '-' or '_'), deepspeed/launcher/runner.py, accelerate/commands/launch.py. Any other
# option takes a value, as `--name value` or `--name=value`.
LAUNCHER_FLAGS = {
    "torchrun": {"standalone", "module", "m", "no-python", "run-path", "virtual-local-rank", "use-env"},
    "deepspeed": {"module", "no-python", "no-local-rank", "no-ssh", "no-ssh-check", "force-multi", "save-pid",
                  "elastic-training", "bind-cores-to-rank"},
    "accelerate": {"cpu", "multi-gpu", "tpu", "ipex", "enable-cpu-affinity", "dynamo-use-fullgraph",
                   "dynamo-use-dynamic", "use-deepspeed", "use-fsdp", "use-megatron-lm", "use-xpu", "same-network",
                   "module", "m", "no-python", "tpu-cluster", "no-tpu-cluster", "tpu-use-sudo", "downcast-bf16",
                   "quiet", "q", "debug"},
}
LAUNCHER_SHORT = {"deepspeed": {"H": "hostfile", "i": "include", "e": "exclude"},
                  "accelerate": {"t": "tee"}, "torchrun": {"r": "redirects", "t": "tee"}}
PYTHON_MODULES = {"torch.distributed.run": "torchrun", "torch.distributed.launch": "torchrun",
                  "deepspeed.launcher.runner": "deepspeed", "accelerate.commands.launch": "accelerate"}
WRAPPERS = {"exec", "command", "builtin", "nohup", "time", "nice", "stdbuf", "env", "timeout", "numactl", "taskset",
            "singularity", "apptainer", "unbuffer"}
KIT_TOOLS = ("check_topology.py", "idr_torch.py")  # the kit's own helpers: no training


def launcher_options(kind: str, words: list[str], start: int) -> tuple[dict[str, str | None], int, bool]:
    """A launcher's options from words[start:]: (options, index of the script, -m given)."""
    flags, short, options, i = LAUNCHER_FLAGS[kind], LAUNCHER_SHORT.get(kind, {}), {}, start
    while i < len(words):
        w = words[i]
        if w == "--":
            return options, i + 1, bool(options.keys() & {"module", "m"})
        if not w.startswith("-") or w == "-":
            break
        name, eq, value = w.lstrip("-").partition("=")
        name = short.get(name, name).replace("_", "-")
        i += 1
        if name in flags:
            options[name] = None
        elif eq:
            options[name] = value
        elif i < len(words) and not (words[i].startswith("--") or words[i].endswith(".py")):
            options[name], i = words[i], i + 1
        else:
            options[name] = None
    return options, i, bool(options.keys() & {"module", "m"})


def python_script(words: list[str], start: int) -> tuple[int, bool, bool]:
    """python's own options from words[start:]: (index of the script or module, -m given, -c given)."""
    i = start
    while i < len(words):
        w = words[i]
        if w == "--":
            return i + 1, False, False
        if not w.startswith("-") or w == "-" or w.startswith("--"):
            if w.startswith("--") and w != "--":
                i += 1 + (w == "--check-hash-based-pycs")
                continue
            return i, False, False
        i += 1
        for j, letter in enumerate(w[1:], 1):
            if letter in "mc":
                rest = w[j + 1:]
                if rest:  # python -mtorch.distributed.run
                    words.insert(i, rest)
                return i, letter == "m", letter == "c"
            if letter in "WX":
                i += 0 if w[j + 1:] else 1
                break
    return i, False, False


def skip_wrappers(words: list[str], i: int) -> int:
    """Past exec, time, env A=b, nohup, nice -n 5, numactl/taskset/timeout ..., singularity exec [opts] IMAGE."""
    while i < len(words):
        prog = os.path.basename(words[i])
        if prog not in WRAPPERS:
            return i
        i += 1
        if prog in ("singularity", "apptainer"):
            if i < len(words) and words[i] in ("exec", "run"):
                i += 1
            while i < len(words) and words[i].startswith("-"):
                has_value = "=" not in words[i] and words[i] not in (
                    "--nv", "--nvccli", "--rocm", "-e", "--cleanenv", "-c", "--contain", "-C", "--containall",
                    "-w", "--writable", "--no-home", "-f", "--fakeroot", "-u", "--userns")
                i += 1 + has_value
            i += 1  # the image
            continue
        while i < len(words) and (words[i].startswith("-") or (prog == "env" and "=" in words[i])):
            takes = {"nice": ("-n",), "env": ("-u", "--unset", "-C", "--chdir"), "timeout": ("-s", "-k"),
                     "taskset": (), "stdbuf": ("-i", "-o", "-e"), "command": (), "time": ("-o", "-f")}.get(prog, ())
            i += 2 if words[i] in takes else 1
        if prog in ("timeout", "taskset") and i < len(words):
            i += 1  # the duration, the CPU mask
    return i


def find_launches(ran: Ran, name: str, findings: Findings, srun: list | None = None, per_task: bool = False,
                  shell: "ShellRun | None" = None) -> list[LaunchLine]:
    """The Python programs one command starts (none for cp, echo, module ...), through srun, bash -c and the
    launchers torchrun, python -m torch.distributed.run, deepspeed and accelerate launch."""
    words, where = ran.fields, f"{name}:{ran.line}"
    i = skip_wrappers(words, 0)
    if i >= len(words):
        return []
    prog, env = os.path.basename(words[i]), ran.exported
    if prog == "srun" and srun is None:
        options, rest = parse_options(words[i + 1:], where, findings, prog="srun")
        prefix = words[:len(words) - len(rest)]
        inner = Ran(list(rest), ran.env, ran.line, ran.conditional, ran.exported)
        found = find_launches(inner, name, findings, options, per_task, shell)
        for launch in found:
            launch.words = prefix + launch.words
            launch.script += len(prefix)
        if found or not rest:
            return found
        return [LaunchLine(where, words, len(prefix), "program", options, env=env, per_task=per_task)]
    if prog in ("bash", "sh", "dash", "zsh") and "-c" in words[i + 1:] and shell is not None:
        text = words[words.index("-c", i) + 1] if words.index("-c", i) + 1 < len(words) else ""
        found: list[LaunchLine] = []
        inner = ShellRun({k: v for k, v in shell.vars.items() if k in shell.exported}, lambda r: found.extend(
            find_launches(r, name, findings, srun, srun is not None, None)), shell.exported, shell.budget)
        if srun is not None:
            inner.vars.update({k: UNKNOWN for k in PER_TASK})
        try:
            inner.run_text(text)
        except (StopScript, RecursionError):
            pass
        for launch in found:
            launch.where = where
        return found
    kind, start, module = None, i + 1, False
    if re.fullmatch(r"python[0-9.]*|pypy3?", prog):
        start, module, command = python_script(words, i + 1)
        if command or start >= len(words):
            return [LaunchLine(where, words, min(start, len(words) - 1), "program", srun, env=env)] if srun else []
        if module and words[start].split(".")[0] in ("pip", "venv", "ensurepip", "json", "http", "site"):
            return []  # python's own tools: an install, not a program of the job
        kind = PYTHON_MODULES.get(words[start]) if module else "python"
        if kind is None:
            kind = "python"
        elif kind != "python":
            start += 1
    elif prog == "torchrun" or prog == "deepspeed":
        kind = prog
    elif prog == "accelerate" and words[i + 1:i + 2] == ["launch"]:
        kind, start = "accelerate", i + 2
    elif prog.endswith(".py"):
        kind, start = "python", i
    if kind is None:
        return [LaunchLine(where, words, i, "program", srun, env=env, per_task=per_task)] if srun is not None else []
    options = {}
    if kind != "python":
        options, start, module = launcher_options(kind, words, start)
    if start >= len(words):
        return []
    return [LaunchLine(where, list(words), start, kind, srun, options, env, module, per_task)]



# What the checker judges from which arguments, in which layout: said when a shell variable hides some of them.
DEPENDS = (("the fit in memory", ("nlayers", "d_model", "n_head", "d_hid", "seq_len", "vocab_size",
                                 "dropout", "chunks", "batch_size", "precision", "activation_checkpointing", "zero",
                                 "nb_part", "devices", "pp", "schedule", "virtual_stages"), ("replica", "stage")),
           ("the pipeline bubble", ("chunks", "batch_size", "nb_part"), ("replica",)),
           ("--chunks dividing --batch-size", ("chunks", "batch_size"), ("replica", "stage")),
           ("the layers per part", ("nlayers", "nb_part", "pp", "schedule", "virtual_stages"), ("replica", "stage")),
           ("the pipelines against the tasks", ("pp", "schedule", "virtual_stages", "chunks"), ("stage",)),
           ("--d-model against --n-head", ("d_model", "n_head"), ("replica", "stage")))


def training_from_argv(argv: list[str], t: Training, where: str, findings: Findings) -> None:
    """The trainer's arguments on its line, read by the trainer's own parser (read_trainer_argv): its refusals
    become findings in its words; a shell variable leaves what it may set unknown (t.unknown), never judged."""
    line = read_trainer_argv(t.layout, argv, shell=True)
    findings.extend(Finding(f.level, f.code, f"{where}: {f.message}") for f in line.findings)
    if line.findings.errors:  # refused: nothing is judged (all unknown), but the plan shows the line's accepted values
        hidden = {ARG[u.split(" ")[0][2:].replace("-", "_")].dest for u in line.unchecked if u.startswith("--")}
        # less the placement (nb_part, devices): the plan's own checks would judge a refused line's values
        take_values(t, line.values, [] if line.standalone else
                    [d for d in line.given if d not in hidden and d not in ("nb_part", "devices")
                     and getattr(line.values, d) is not None])
        t.unknown = line.unknown
        return
    take_values(t, line.values, [d for d in line.given if d not in line.unknown])
    t.unknown, t.unchecked = line.unknown, t.unchecked + [f"{where}: {u}" for u in line.unchecked]
    script, source = SCRIPTS[t.layout], where.rpartition(":")[0] or "SCRIPT"
    for token in line.unchecked:
        alone = token in line.standalone
        names = line.unknown if alone else [ARG[token.split(" ")[0][2:].replace("-", "_")].dest]
        hidden = [what for what, needs, layouts in DEPENDS if t.layout in layouts and set(needs) & set(names)]
        say = (f"may hold any of {script}'s arguments: nothing that depends on them is checked" if alone else
               "is a shell variable: its value is not checked, nor what depends on it")
        fix = (f"give the values it holds on the checker's command line (python check_topology.py {source} "
               f"--nlayers N --chunks N --batch-size N ...): the arguments not given there are then taken at "
               f"{script}'s defaults" if alone else
               f"give its value on the checker's command line (python check_topology.py {source} "
               f"{token.split(' ')[0]} VALUE)")
        findings.warn("unchecked-argument", f"{where}: {token} {say}" + (f" ({', '.join(hidden)})" if hidden else "")
                      + f", and no default is judged in its place; {fix}")
    if line.help or line.values.check_args:
        findings.warn("no-training", f"{where}: {script} {'--help' if line.help else '--check-args'} prints "
                      f"{'its help' if line.help else 'its verdict on the arguments'} and exits: this line trains "
                      "nothing; remove it to train")


def take_values(t: Training, values: argparse.Namespace, names: list[str]) -> None:
    """The line's values of `names` into t (the others keep what t holds)."""
    known = training_from_args(values, t.layout, names)
    for name in names:
        if name in TRAINING_FIELDS:
            setattr(t, name, getattr(known, name))
        elif name in known.model:
            t.model[name] = known.model[name]


def read_trainer_line(launch: "LaunchLine", script: str, where: str, job: Job, training: Training,
                      findings: Findings) -> None:
    """The trainer's line as bash runs it (find_launches): srun's options (the step's shape), torchrun's workers,
    the layout its script runs, its arguments."""
    argv, cut = launch.words, launch.script
    training.layout = TRAINERS[script]
    job.srun = launch.srun is not None
    job.launcher = " ".join(argv[:cut]) or "(nothing)"
    job.trainer, job.trainer_line = script, launch
    if launch.srun is not None:
        apply_step(job, launch, findings)
        check_option_values(job, launch.srun, where, findings, prog="srun", record=False)
    if launch.launcher == "torchrun":
        job.workers = workers_of(launch)
        if job.workers is None:
            job.workers = 1  # planned as one worker per agent; what depends on the split is left unjudged
            nproc = launch.options.get("nproc-per-node")
            training.unchecked.append(f"{where}: torchrun --nproc_per_node {nproc}")
            findings.warn("unchecked-argument", f"{where}: torchrun --nproc_per_node {nproc} is a shell variable: the "
                          "workers per node, so each one's GPUs (nb_part), the bubble and the fit are not checked; "
                          "write the number, or check each value with --ntasks-per-node N on the checker's line")
    elif launch.launcher in ("deepspeed", "accelerate"):
        findings.warn("launcher-not-modelled", f"{where}: the kit's trainer under {launch.launcher}: its processes "
                      "are planned as srun's tasks; start it with srun or torchrun, as the templates do")
    training_from_argv(argv[cut + 1:], training, where, findings)
    if launch.launcher == "torchrun" and workers_of(launch) is None:  # the split depends on the workers per node
        training.unknown = list(dict.fromkeys([*training.unknown, "nb_part"]))


# -- the script as a whole: directives, then bash's run of it, then its launch lines --

def batch_variables(job: Job) -> dict:
    """The SLURM_ variables the batch script sees, as far as the request decides them (read off the test cluster's
    batch steps: tests/test_launch_slurm.py compares them): known ones as values, the others present but unknown."""
    known: dict[str, str] = {"SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    nodes = job.nodes if job.nodes and "nodes" in job.options and "-" not in str(job.options.get("nodes")) else None
    if nodes:
        known["SLURM_JOB_NUM_NODES"] = known["SLURM_NNODES"] = str(nodes)
    ntasks = job.ntasks or (nodes * job.ntasks_per_node if nodes and job.ntasks_per_node else None)
    if ntasks:
        known["SLURM_NTASKS"] = known["SLURM_NPROCS"] = str(ntasks)
    for name, value in (("SLURM_NTASKS_PER_NODE", job.ntasks_per_node), ("SLURM_CPUS_PER_TASK", job.cpus_per_task),
                        ("SLURM_GPUS_PER_NODE", job.options.get("gpus-per-node")),
                        ("SLURM_GPUS", job.options.get("gpus")), ("SLURM_HINT", job.hint),
                        ("SLURM_JOB_PARTITION", job.partition)):
        if value is not None and "$" not in str(value):
            known[name] = str(value)
    gpn = job.gres_gpus or job.gpus_per_node or (job.gpus_per_task * job.ntasks_per_node if job.gpus_per_task and
                                                 job.ntasks_per_node else None)
    if gpn is None and job.gpus_total and nodes and job.gpus_total % nodes == 0:
        gpn = job.gpus_total // nodes if nodes == 1 else None
    out = {k: ShellRun.known(v) for k, v in known.items()}
    if gpn:
        out["SLURM_GPUS_ON_NODE"] = ShellRun.known(str(gpn))
    for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURMD_NODENAME",
                 "SLURM_SUBMIT_DIR", "SLURM_JOB_NAME", "SLURM_JOB_CPUS_PER_NODE", "SLURM_TASKS_PER_NODE",
                 "SLURM_CLUSTER_NAME", "SLURM_JOB_ACCOUNT", "SLURM_JOB_QOS", "SLURM_JOB_GPUS", "SLURM_JOB_PARTITION",
                 "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_GPUS_ON_NODE", "SLURM_RESTART_COUNT"):
        out.setdefault(name, UNKNOWN)
    if "array" in job.options:
        for name in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN",
                     "SLURM_ARRAY_TASK_MAX", "SLURM_ARRAY_TASK_STEP"):
            out[name] = UNKNOWN
    return out


MODULE_COMMANDS = ("module", "ml")


def read_modules(ran: Ran, job: Job) -> None:
    """module load/add/purge/unload/swap and Lmod's ml, in every form: the modules loaded, in order."""
    words = ran.fields
    if os.path.basename(words[0]) not in MODULE_COMMANDS:
        return
    args = [w for w in words[1:] if not w.startswith("-")]
    verb = args[0] if args else ""
    if words[0] == "ml" and verb not in ("load", "add", "purge", "unload", "rm", "del", "swap", "switch", "list",
                                         "av", "avail", "spider", "show", "help", "save", "restore"):
        verb, args = "load", ["load"] + [w for w in words[1:] if not w.startswith("-")]
        job.modules = [m for m in job.modules if m not in [w[1:] for w in words[1:] if w.startswith("-")]]
    if verb == "purge":
        job.modules = []
    elif verb in ("load", "add", "try-load", "try-add"):
        job.modules += args[1:]
    elif verb in ("unload", "rm", "del", "remove"):
        job.modules = [m for m in job.modules if m not in args[1:] and m.split("/")[0] not in args[1:]]
    elif verb in ("swap", "switch") and len(args) >= 3:
        job.modules = [args[2] if m == args[1] or m.split("/")[0] == args[1] else m for m in job.modules]
    loaded = [m for m in job.modules if torch_version_of(m)]
    job.torch_module = loaded[-1] if loaded else None


def script_file_problems(path: str | os.PathLike, text: str, too_large: bool, job: Job,
                         findings: Findings) -> str | None:
    """What sbatch refuses in the file itself (size, NUL bytes, DOS line breaks, no '#!', empty): the text to read
    on, or None where nothing more can be read (job.unplanned says why)."""
    name = Path(path).name
    if too_large:
        findings.error("script-too-large", f"{name}: the script is larger than {MAX_SCRIPT_BYTES // 2 ** 20} MiB: "
                       "slurmctld refuses it ('Pathname of a file, directory or other parameter too long', measured "
                       "at 4.3 MB); keep data out of the script")
        job.unplanned = "the script is too large for Slurm"
        return None
    if "\0" in text:
        findings.error("not-a-script", f"{name}: the file holds NUL bytes (a binary file?): sbatch refuses it ('does "
                       "not allow scripts that contain a NULL character'); give the job script")
        job.unplanned = "not a job script"
        return None
    if "\r\n" in text:
        findings.error("dos-line-breaks", f"{name}: the file has DOS line breaks (\\r\\n): sbatch refuses it "
                       f"('Batch script contains DOS line breaks'); convert it: dos2unix {name}")
        text = text.replace("\r\n", "\n")
    lone = text.count("\r")
    if lone and lone >= text.count("\n"):  # old Mac line ends: every line but one ends in \r alone
        findings.error("cr-line-breaks", f"{name}: the lines end with \\r alone ({lone} of them, {text.count(chr(10))} "
                       "\\n): sbatch accepts the file (it refuses only \\r\\n, src/sbatch/sbatch.c "
                       "contains_dos_linebreak), but sbatch and bash read it as one line: no #SBATCH line applies and "
                       f"nothing runs; convert it: tr '\\r' '\\n' < {name} > fixed_{name}")
    if not text.startswith("#!"):
        findings.error("no-shebang", f"{name}:1: the first line is not '#!' and an interpreter: sbatch refuses the "
                       "file ('This does not look like a batch script'); make line 1 '#!/bin/bash'")
    if not text.strip():
        raise UsageError(f"{path} is empty: nothing to check (sbatch refuses it too: 'Batch script is empty!')")
    return text


def read_sbatch(path: str | os.PathLike) -> tuple[Job, Training, Findings]:
    """Read the job script the way sbatch 22.05 and bash do: the header's directives (read_directives), then every
    command bash would run (its variables expanded, here-documents set aside, functions called), for the modules it
    loads and the programs it launches. The first launch of a kit trainer is the trainer line; without one, the
    other launch lines are judged at the Slurm level only (job.trainer is None)."""
    text, too_large = read_script_text(path)
    job, training, findings = Job(source=str(path)), Training(), Findings()
    name = Path(path).name
    text = script_file_problems(path, text, too_large, job, findings)
    if text is None:
        return job, training, findings
    try:
        first_command = read_directives(text, name, job, findings)
    except TooComplex as cut:
        too_complex(name, cut, findings)
        check_option_conflicts(job, findings)
        read_launch_lines(job, [], findings)
        job.trainer, job.srun = None, None
        return job, training, findings
    if any(f.code == "count-too-large" for f in findings):
        job.unplanned = "a count no node has"
        return job, training, findings
    check_option_conflicts(job, findings)
    ran: list[Ran] = []
    shell = ShellRun(batch_variables(job), ran.append)
    launches: list[LaunchLine] = []

    def sink(r: Ran) -> None:
        read_modules(r, job)
        launches.extend(find_launches(r, name, findings, shell=shell))
    shell.sink = sink
    try:
        lexer = shell.run_script(text)
        heredocs = lexer.heredocs
        cuts = [c for c in (shell.cut, TooComplex(lexer.cut, f"more than {lexer.MAX_TOKENS} words to read")
                            if lexer.cut else None) if c]
        if cuts:
            too_complex(name, min(cuts, key=lambda c: c.line), findings)
        if lexer.unclosed:
            line, quote = lexer.unclosed
            findings.error("bad-command", f"{name}:{line}: the {quote} opened here is never closed: bash stops the "
                           f"job there ('unexpected EOF while looking for matching `{quote}'') and what follows is "
                           "read as one string; close the quote")
    except RecursionError:
        heredocs = []
        findings.warn("shell-unread", f"{name}: the script nests too deeply to follow; its launch lines may be "
                      "missed")
    stray_directives(text, name, first_command, heredocs, findings)
    kit = next((x for x in launches if x.program in TRAINERS and not x.module), None)
    if kit is None:
        job.trainer, job.srun, job.sourced = None, None, shell.sourced
        read_launch_lines(job, [x for x in launches if x.program not in KIT_TOOLS], findings)
        return job, training, findings
    read_trainer_line(kit, kit.program, kit.where, job, training, findings)
    read_launch_lines(job, [x for x in launches if x is not kit and x.srun is not None], findings)
    return job, training, findings


def too_complex(name: str, cut: TooComplex, findings: Findings) -> None:
    """The one finding of a script whose reading spent its budget (ShellBudget, MAX_TOKENS, MAX_DIRECTIVES)."""
    findings.warn("too-complex", f"{name}:{cut.line}: this script is too complex to follow past line {cut.line} "
                  f"({cut.what}); checked up to there: check what comes after by hand, or simplify it (generated "
                  "commands, deep function calls and huge values are what cost)")


def read_launch_lines(job: Job, launches: list[LaunchLine], findings: Findings) -> None:
    """The launch lines besides the trainer's: srun's option values checked now, their layout in check_job."""
    for launch in launches:
        if launch.srun:
            check_option_values(job, launch.srun, launch.where, findings, prog="srun", record=False)
    job.launches = launches


def apply_step(job: Job, launch: LaunchLine, findings: Findings) -> None:
    """srun's options on a launch line, and SRUN_CPUS_PER_TASK from its environment (srun 22.05 reads it as -c)."""
    for name, value in launch.srun or []:
        apply_srun_option(job, name, value, launch.where, findings)
    cpus = launch.env.get("SRUN_CPUS_PER_TASK")
    if job.step_cpus_per_task is None and cpus and cpus.isdigit():
        job.step_cpus_per_task = int(cpus)
    job.srun_cpus = job.step_cpus_per_task is not None or "SRUN_CPUS_PER_TASK" in launch.env or any(
        n == "cpus-per-task" for n, _ in launch.srun or [])


def workers_of(launch: LaunchLine) -> int | str | None:
    """torchrun's --nproc_per_node (default 1): a count, 'gpu' / 'auto' (one per GPU it sees), 'cpu', or None when
    written with a shell variable this reading doesn't know."""
    value = launch.options.get("nproc-per-node", "1") or "1"
    if "$" in value:
        return None
    if value.isdigit():
        return int(value) if int(value) <= COUNT_LIMITS["ntasks-per-node"] else None
    return value.lower() if value.lower() in ("gpu", "auto", "cpu") else None


# ---- II.5 Checking a job: every task's plan, then the whole ----------------------------------------------------------

def check_job(job: Job, training: Training) -> Report:
    """Plan every task of a request and check the whole. Without a kit trainer in the script (job.trainer None),
    only the Slurm and site layer: the request, the placement, each launch line's processes, Jean Zay's rules."""
    findings = Findings()
    if job.unplanned:
        return Report(job, training, [], findings, [f"nothing planned: {job.unplanned}"])
    if job.trainer is None:
        return check_other_program(job, training, findings)
    tasks_per_node = step_placement(job, findings)
    if too_many_tasks(tasks_per_node, findings):
        return Report(job, training, [], findings, ["nothing planned: more tasks than the nodes run"])
    gpn = step_gpus_per_node(job, tasks_per_node, findings)
    job.gpus_per_node = gpn
    defaulted = training.nlayers is None and not training.known("nlayers")  # a shell variable, or refused
    if training.nlayers is None:  # the trainer's own default for what it will run on
        training.nlayers = (GPU_DEFAULTS if gpn else CPU_DEFAULTS)["nlayers"]
    check_gpus_fit(job, gpn, tasks_per_node, findings)
    procs_per_node, agent_view = tasks_per_node, None
    if job.workers is not None:  # torchrun: its workers are the trainer's processes (LOCAL_WORLD_SIZE = workers)
        procs_per_node, agent_view = torchrun_processes(job, tasks_per_node, gpn, findings)
        if too_many_tasks(procs_per_node, findings):
            return Report(job, training, [], findings, ["nothing planned: more processes than the nodes run"])
    stage = training.layout == "stage"
    if stage:
        training.nb_part = 1  # a task per GPU
    check_divisible(job, gpn, procs_per_node, training, findings)
    plans: list[TaskPlan] = []
    ranks = task_ranks(job, procs_per_node, findings)
    planned: dict[tuple[int, int], TaskPlan] = {}  # a task's plan depends on its node's count and its local rank
    for node, tasks in enumerate(procs_per_node):
        for local in range(tasks):
            if (tasks, local) not in planned:
                visible = (agent_view if agent_view is not None else gpu_view(job, local, tasks, gpn, findings)
                           ) if gpn else []
                # under torchrun idr_torch knows no SLURM_GPUS_ON_NODE (launcher torchrun): the plan is the page's
                planned[tasks, local] = plan_task(0, node, local, tasks, visible,
                                                  None if job.workers is not None else gpn, training.nlayers,
                                                  training.nb_part, findings, training.devices)
            plan = copy.copy(planned[tasks, local])  # its lists are shared, never changed after planning
            plan.rank, plan.node = ranks[node, local], node
            plans.append(plan)
    plans.sort(key=lambda p: p.rank)
    _dedupe(findings)
    report = Report(job, training, plans, findings)
    if defaulted:
        report.notes.append(f"the table splits the trainer's default {training.nlayers} layers: the line's --nlayers "
                            "is not known here (a shell variable, or a value the trainer refuses)")
    check_kit(report, procs_per_node, gpn)
    gpus_per_task = (gpn // max(tasks_per_node)) if gpn else 0
    check_site(job, tasks_per_node, gpus_per_task, gpn, findings)
    check_steps_cpus(job, findings)
    if job.placement == "possible":
        report.notes.append(f"placement: Slurm decides by free cores; the table shows one placement it may make "
                            f"({','.join(map(str, tasks_per_node))} task(s) per node)")
    return report


def task_ranks(job: Job, per_node: list[int], findings: Findings) -> dict[tuple[int, int], int]:
    """The global rank of each (node, local rank) as srun's --distribution numbers them (man srun -m): block (the
    default) fills a node before the next, cyclic deals one task a node per round, plane=N deals N at a time.
    torchrun numbers its workers node by node (block) whatever srun does."""
    dist = (job.distribution or "block").lower() if job.workers is None else "block"
    base = dist.split(":")[0].split(",")[0]
    deal = 1 if base == "cyclic" else int(dist.split("=")[1]) if re.fullmatch(r"plane=\d+", base) and \
        int(dist.split("=")[1]) > 0 else max(per_node) if base in ("block", "*", "") else None
    if deal is None:
        findings.warn("distribution-not-modelled", f"{job.option_lines.get('distribution', 'srun')}: "
                      f"--distribution={job.distribution}: which task runs where is given by a node list here, not "
                      f"modelled; the plan numbers the {sum(per_node)} tasks node by node")
        deal = max(per_node)
    ranks, done, rank = {}, [0] * len(per_node), 0
    while rank < sum(per_node):
        for node, count in enumerate(per_node):
            for _ in range(min(deal, count - done[node])):
                ranks[node, done[node]] = rank
                done[node] += 1
                rank += 1
    return ranks


def check_kit(report: Report, procs_per_node: list[int], gpn: int | None) -> None:
    """What only the kit's trainer is judged on: its GPUs per task, its model and pipeline, its fit, its torch."""
    job, training, findings, plans = report.job, report.training, report.findings, report.tasks
    check_node_usage(report)
    nb_parts = [p.nb_part for p in plans if p.nb_part]
    cpu = all(p.cpu for p in plans) if plans else not gpn
    if training.layout == "stage":
        stages = check_stage(len(plans), procs_per_node, gpn, training, findings, cpu)
        check_training(stages, training, findings, cpu=cpu)
        if not cpu and stages and len(plans) % training.pp == 0:  # the fit of each pipeline's tasks
            line = check_memory(job, training, training.pp, len(plans) // training.pp, gpn, findings)
            report.notes += [line] if line else []
    elif nb_parts:
        check_training(min(nb_parts), training, findings, cpu=cpu)
        if not cpu:  # each leaves alone what a shell variable may hold (training.unknown)
            check_bubble(min(nb_parts), training, findings)
            line = check_memory(job, training, min(nb_parts), len(plans), max(procs_per_node), findings)
            report.notes += [line] if line else []
    check_engine(job, training, findings)
    check_gpu_cgroups(job, procs_per_node, gpn, findings)
    note_page_indexing(report)


def check_site(job: Job, tasks_per_node: list[int], gpus_per_task: int, gpn: int | None, findings: Findings) -> None:
    """The cores, the time, the nodes and the site's accounts, QoS and modules: the same for every program. The
    account, QoS and time limits are the dated table's, or Slurm's own read here (check_live), or none (--site)."""
    check_cpus(job, gpus_per_task, tasks_per_node, findings)
    live = job.site_rules == "live" and job.site is not None
    check_time(job, findings, limits=job.site_rules == "jean-zay")
    check_nodes(job, findings)
    gpus, cores = (gpn or 0) * len(tasks_per_node) or None, sum(tasks_per_node) * (job.cpus_per_task or 1)
    if live:
        check_live(job, job.site, gpus, cores, findings)
    if job.site_rules != "none":
        check_jean_zay(job, findings, gpus_asked=gpus, cores_asked=cores, table_qos=not live)


def check_steps_cpus(job: Job, findings: Findings) -> None:
    """srun without -c in a job with --cpus-per-task: srun 22.05 and 23.02 do not pass the job's value on to the
    step (SchedMD's 22.05 RELEASE_NOTES: 'srun will no longer read in SLURM_CPUS_PER_TASK'; 23.11 went back:
    'Replace SRUN_CPUS_PER_TASK with SLURM_CPUS_PER_TASK and get back the previous behavior before Slurm 22.05'),
    so each task gets 1 CPU where CPUs are bound, and may be placed otherwise than the allocation (measured)."""
    if not job.cpus_per_task or job.cpus_per_task < 2:
        return
    lines = [job.trainer_line.where] if job.trainer_line and job.srun and not job.srun_cpus else []
    for launch in job.launches:
        if launch.srun is not None and launch.program not in SMALL_STEPS and not (
                "SRUN_CPUS_PER_TASK" in launch.env or any(n == "cpus-per-task" for n, _ in launch.srun)):
            lines.append(launch.where)
    if lines:
        lines = sorted(dict.fromkeys(lines), key=lambda w: int(w.rpartition(":")[2]))
        findings.warn("srun-cpus-per-task", f"{lines[0]}: srun without -c in a job with --cpus-per-task="
                      f"{job.cpus_per_task}" + (f" ({len(lines)} srun lines: {', '.join(l.rpartition(':')[2] for l in lines)})" if len(lines) > 1 else "")
                      + ": Slurm 22.05 and 23.02 do not pass it on to the step, so each task runs on 1 CPU where "
                      "CPUs are bound (its DataLoader workers and threads share it) and the step may be placed "
                      "unlike the allocation (measured); write srun -c $SLURM_CPUS_PER_TASK, or export "
                      "SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK once (23.11 and later inherit it again)")


# steps that need no more than the one CPU srun gives them (a node's name, its GPUs, a copy to local disk)
SMALL_STEPS = {"hostname", "nvidia-smi", "echo", "env", "printenv", "date", "true", "sleep", "cat", "ls", "mkdir",
               "rm", "cp", "mv", "rsync", "tar", "df", "free", "uname", "scontrol"}


def torchrun_processes(job: Job, agents_per_node: list[int], gpn: int | None,
                       findings: Findings) -> tuple[list[int], list[str] | None]:
    """torchrun on the trainer's line: one agent per node starting `workers` processes, each with LOCAL_RANK and
    LOCAL_WORLD_SIZE = workers, seeing what its agent's srun task sees. Returns (processes per node, what each
    process sees)."""
    launch = job.trainer_line
    view = gpu_view(job, 0, agents_per_node[0], gpn, findings) if gpn else []
    layout = launcher_layout(job, launch, agents_per_node, gpn, view, findings)
    # with several agents on a node only one wins the rendezvous (launcher-agents-per-node says so): plan that one
    per_node = [p // a for p, a in zip(layout["processes_per_node"], agents_per_node)]
    fallback = job.workers if isinstance(job.workers, int) else 1  # a count this reading can't know: one
    return per_node or [fallback] * len(agents_per_node), view


def check_gpus_fit(job: Job, gpn: int | None, tasks_per_node: list[int], findings: Findings) -> None:
    """A GPU request at all, one the node can hold, tasks per node that agree."""
    check_gpu_request(job, gpn, findings)
    check_even(job, gpn, tasks_per_node, findings)


def check_gpu_request(job: Job, gpn: int | None, findings: Findings) -> None:
    ntype = node_type(job)
    t = JEAN_ZAY[ntype] if ntype else None
    if not gpn:
        if t and not t.gpus:
            findings.warn("no-gpus", f"the job asks for {t.label}, which have no GPU: the trainer runs its CPU model "
                          "(slow); for training ask for GPU nodes, e.g. --gres=gpu:4 -C v100-32g")
        else:
            findings.error("no-gpus", "the job requests no GPU; add --gres=gpu:N (GPUs per node, e.g. --gres=gpu:4) "
                           "or --gpus-per-node=N")
    elif t and gpn > t.gpus:
        findings.error("gpus-exceed-node", f"{gpn} GPUs per node requested but {t.label} have {t.gpus}"
                       + (f"; use --gres=gpu:{t.gpus} or another partition (-p gpu_p2 / -C a100 for 8 GPUs)"
                          if t.gpus else "; ask for GPU nodes (-C v100-32g, -C a100, -C h100) or drop the GPUs"))


def check_even(job: Job, gpn: int | None, tasks_per_node: list[int], findings: Findings) -> None:
    """Tasks per node that differ give nodes different nb_part (reported once: not when the request's packing
    already was)."""
    reported = any(f.level == "error" and f.code in ("ntasks-mismatch", "ntasks-per-node-missing") for f in findings)
    if len(set(tasks_per_node)) > 1 and job.placement == "exact" and not reported:
        nbs = {n: (gpn or 0) // n for n in tasks_per_node}
        findings.error("uneven-tasks-per-node",
                       f"tasks per node differ ({','.join(map(str, tasks_per_node))}): nodes get nb_part "
                       f"{_choices(nbs.values())}, so replicas differ in layout and speed (the page's code even "
                       f"lacks SLURM_NTASKS_PER_NODE); use --nodes={len(tasks_per_node)} with the same "
                       f"--ntasks-per-node on every node")


def check_other_program(job: Job, training: Training, findings: Findings) -> Report:
    """A script that runs no kit trainer: its request, its placement, each launch line's processes against the
    GPUs, Jean Zay's rules; and one note that the training itself was not checked, and why."""
    caps, ntasks = allocation_tasks(job, findings)
    nodes = len(caps) if caps else (job.nodes or 1)
    shape = caps or packing(ntasks, nodes, node_cap(job))
    if too_many_tasks(shape, findings):
        return Report(job, training, [], findings, ["nothing planned: more tasks than the nodes run"])
    gpn = step_gpus_per_node(job, shape, findings)
    job.gpus_per_node = gpn
    ntype = node_type(job)
    t = JEAN_ZAY[ntype] if ntype else None
    if not gpn and t and t.gpus:
        findings.warn("no-gpus", f"the job asks for {t.label} but for no GPU: it gets none; add --gres=gpu:N, or "
                      "use a CPU partition (-p cpu_p1, prepost) for work without GPUs")
    elif gpn and t and gpn > t.gpus:
        findings.error("gpus-exceed-node", f"{gpn} GPUs per node requested but {t.label} have {t.gpus}"
                       + (f"; use --gres=gpu:{t.gpus} or another partition (-p gpu_p2 / -C a100 for 8 GPUs)"
                          if t.gpus else "; ask for GPU nodes (-C v100-32g, -C a100, -C h100) or drop the GPUs"))
    check_gpu_cgroups(job, shape, gpn, findings)
    stepped = any(x.srun is not None for x in job.launches)
    for launch in job.launches:
        if stepped and launch.srun is None and launch.launcher in ("python", "program"):
            continue  # a helper the batch shell runs once beside srun's steps (data preparation, pip install ...)
        layout_of_launch(job, launch, gpn, findings)
    per_task = (gpn // max(shape)) if gpn else 0
    check_site(job, shape, per_task, gpn, findings)
    check_steps_cpus(job, findings)
    _unique(findings)
    report = Report(job, training, [], findings)
    programs = sorted({f"{x.launcher} {x.program}" if x.launcher not in ("python", "program") else x.program
                       for x in job.launches}) if job.launches else []
    why = (f"the script runs {', '.join(programs[:3])}{' ...' if len(programs) > 3 else ''}, not the kit's "
           "bench_ddp_transformer.py or bench_stage.py" if programs else
           "no launch line (srun, python, torchrun, deepspeed, accelerate launch) was found in the script"
           + (f"; it sources {', '.join(job.sourced[:2])}, which is not read" if job.sourced else ""))
    report.notes.append(f"training not checked: {why}; checked: the Slurm request, the placement, "
                        + ("each launch line's processes against the GPUs, " if job.launches else "")
                        + "Jean Zay's rules")
    report.notes += [n for x in job.launches for n in x.layout.get("notes", [])]
    return report


def _unique(findings: Findings) -> None:
    seen, kept = set(), []
    for f in findings:
        if (f.code, f.message) not in seen:
            seen.add((f.code, f.message))
            kept.append(f)
    findings[:] = kept


def layout_of_launch(job: Job, launch: "LaunchLine", gpn: int | None, findings: Findings) -> None:
    """One launch line of a script without a kit trainer: where srun puts its tasks, then what its launcher does."""
    step = replace(job, step_nodes=None, step_ntasks=None, step_ntasks_per_node=None, step_cpus_per_task=None,
                   srun=launch.srun is not None, trainer=launch.program, launcher=" ".join(launch.words[:launch.script]),
                   placement="exact", options=dict(job.options), launches=[])
    quiet = launch.launcher in ("deepspeed", "accelerate") and launch.srun is None  # they start other nodes themselves
    if launch.srun is not None:
        apply_step(step, launch, findings)
    sub = Findings()
    agents = [1] if quiet else step_placement(step, sub, kit=False)
    findings.extend(f for f in sub if f.code != "trainer-without-srun" or launch.launcher in ("python", "torchrun"))
    view = gpu_view(step, 0, agents[0], gpn, findings) if gpn else []
    launch.layout = launcher_layout(step, launch, agents, gpn, view, findings)


def launcher_layout(job: Job, launch: "LaunchLine", agents: list[int], gpn: int | None, view: list[str],
                    findings: Findings) -> dict:
    """The processes a launch line starts on each node and what each sees: srun's tasks (agents), times the workers
    each agent starts (LAUNCHER_WORKERS). Checks one agent per node, the node count the launcher expects, and one
    GPU per process. What a launcher's own configuration file decides is not modelled, and said so in a note."""
    kind, where = launch.launcher, launch.where
    layout = {"agents_per_node": list(agents), "processes_per_node": list(agents), "gpus_per_process": None,
              "notes": []}
    if kind in ("python", "program"):
        layout["gpus_per_process"] = len(view) if gpn else 0
        if gpn and launch.srun is not None and max(agents) > gpn and kind == "python" and job.trainer not in TRAINERS:
            findings.warn("processes-exceed-gpus", f"{where}: srun starts {max(agents)} tasks of {launch.program} on "
                          f"a node with {gpn} GPU(s): tasks share GPUs (nccl refuses two ranks on one GPU: 'Duplicate "
                          f"GPU detected'); use --ntasks-per-node <= {gpn}")
        return layout
    workers, expected = LAUNCHER_WORKERS[kind](job, launch, len(agents), gpn, view, layout, findings)
    if workers is False:  # refused, or decided by a file: said already
        layout["processes_per_node"] = []
        return layout
    check_agents(launch, agents, expected, findings)
    if workers is None:
        layout["notes"].append(f"{where}: {kind}'s processes per node are given by a shell variable: not checked")
        layout["processes_per_node"] = []
        return layout
    layout.update(processes_per_node=[workers * a for a in agents], gpus_per_process=1 if gpn else 0)
    if gpn and workers > len(view):
        findings.error("processes-exceed-gpus", f"{where}: {kind} starts {workers} processes per node for the "
                       f"{len(view)} GPU(s) they see: two processes on one GPU (nccl refuses it: 'Duplicate GPU "
                       f"detected'); start {len(view)} per node")
    elif gpn and workers < len(view) and job.trainer not in TRAINERS:
        findings.warn("gpus-idle", f"{where}: {kind} starts {workers} process(es) per node for the {len(view)} GPU(s) "
                      f"they see: {len(view) - workers} GPU(s) per node stay idle (one GPU per process); start "
                      f"{len(view)}, or ask for {workers} GPU(s) per node")
    return layout


def check_agents(launch: "LaunchLine", agents: list[int], expected: tuple[int, int] | None,
                 findings: Findings) -> None:
    """One agent per node, and as many nodes as the launcher waits for (torchrun --nnodes MIN:MAX, accelerate
    --num_machines)."""
    kind, where, nodes = launch.launcher, launch.where, len(agents)
    if max(agents) > 1:
        findings.error("launcher-agents-per-node",
                       f"{where}: srun starts {max(agents)} {kind} agents per node (one per task), each starting its "
                       f"own workers: they race for the rendezvous and some die (measured with torchrun: "
                       f"RendezvousConnectionError); start one per node: srun --ntasks-per-node=1 (or -n "
                       f"{nodes}) {kind} ...")
    if expected is None or expected[0] <= nodes <= expected[1]:
        return
    want = expected[0] if nodes < expected[0] else expected[1]
    how = "srun starts it on" if launch.srun is not None else "the batch script starts it once, on"
    findings.error("launcher-nodes-mismatch",
                   f"{where}: {kind} expects {want} node(s) ({'--nnodes' if kind == 'torchrun' else '--num_machines'}) "
                   f"but {how} {nodes}: " + ("the rendezvous waits for agents that never come, until its timeout"
                                             if want > nodes else "the extra agents are refused")
                   + (f"; start one per node with srun --ntasks-per-node=1 on --nodes={want}" if launch.srun is None
                      else f"; make them agree (--nodes={want}, or the launcher's count = {nodes})"))


def torchrun_workers(job: Job, launch: "LaunchLine", nodes: int, gpn: int | None, view: list[str], layout: dict,
                     findings: Findings):
    """torchrun's --nproc_per_node (default 1; 'gpu' and 'auto': the GPUs the agent sees, torch/distributed/run.py
    determine_local_world_size) and --nnodes (default 1:1; --standalone: 1); a --node_rank the batch shell expanded
    once gives every agent the same rank in a static rendezvous."""
    opts, where = launch.options, launch.where
    workers = workers_of(launch)
    if workers == "gpu" and not gpn:
        findings.error("no-gpus", f"{where}: torchrun --nproc_per_node=gpu needs GPUs (torch: 'Cuda is not "
                       "available') and the job asks for none; give a count, or ask for GPUs")
        return False, None
    if workers in ("gpu", "auto"):
        workers = len(view) if gpn else node_cores(job)
    elif workers == "cpu":
        workers = node_cores(job)
    if (opts.get("rdzv-backend") or "static") == "static":  # c10d ignores it (torch/distributed/run.py)
        check_node_rank(launch, "node_rank", nodes, "--rdzv_backend=c10d", findings)
    return workers, nodes_expected(opts.get("nnodes"), "standalone" in opts)


def check_node_rank(launch: "LaunchLine", option: str, nodes: int, other: str | None, findings: Findings) -> None:
    """A launcher's node rank (torchrun --node_rank, accelerate --machine_rank, deepspeed --no_ssh --node_rank) must
    be each agent's own. The batch shell expands $SLURM_NODEID (0 there), a variable set from it, or a number once,
    before srun: every agent then claims the same rank. Single-quoted, nobody expands it: srun runs the launcher
    without a shell, and its argparse (type=int) refuses the text. Only `srun bash -c '...'` expands it per task."""
    rank, kind, where = launch.options.get(option.replace("_", "-")), launch.launcher, launch.where
    prog = {"accelerate": "accelerate launch", "deepspeed": "deepspeed --no_ssh"}.get(kind, kind)
    fix = f"srun bash -c '{prog} --{option} $SLURM_NODEID ...'" + (f", or use {other}" if other else "")
    if rank is None or launch.srun is None:
        return
    if "$" not in rank and nodes > 1:  # per task too: `bash -c "..."` in double quotes, a value set before srun
        findings.error("launcher-nodes-mismatch", f"{where}: every {kind} agent gets --{option}={rank}: the batch "
                       "shell expanded it once, before srun ($SLURM_NODEID and $SLURM_PROCID are 0 there), so the "
                       f"{nodes} agents claim the same node rank; let each task expand it: {fix}")
    elif not launch.per_task and re.fullmatch(r"\$\{?(" + "|".join(PER_TASK) + r")\}?", rank):
        findings.error("launcher-nodes-mismatch", f"{where}: {kind} gets the text --{option}={rank}, unexpanded "
                       f"(quoted: srun starts {kind} without a shell), and refuses it ('invalid int value', exit 2, "
                       f"on all {nodes} node(s)); let a shell in each task expand it: {fix}")


def deepspeed_workers(job: Job, launch: "LaunchLine", nodes: int, gpn: int | None, view: list[str], layout: dict,
                      findings: Findings):
    """deepspeed without a hostfile runs on its own node: --num_gpus, else every GPU it sees; --num_nodes > 1 is
    refused there (deepspeed/launcher/runner.py). A hostfile, --include or another --launcher decide themselves."""
    opts, where = launch.options, launch.where
    if "no-ssh" in opts:  # each node's deepspeed starts its own share, as --node_rank says (runner.py main)
        check_node_rank(launch, "node_rank", nodes, None, findings)
    if "hostfile" in opts or "include" in opts or (opts.get("launcher") or "pdsh").lower() != "pdsh":
        given = "a hostfile" if "hostfile" in opts else "--include or --launcher"
        layout["notes"].append(f"{where}: deepspeed with {given}: the nodes and processes it starts come from there, "
                               "not modelled")
        return False, None
    count = opts.get("num-gpus") or opts.get("num-accelerators")
    workers = int(count) if count and count.isdigit() and int(count) > 0 else (len(view) if gpn else None)
    asked = int(opts["num-nodes"]) if (opts.get("num-nodes") or "").isdigit() else None
    if asked and asked > 1:
        findings.error("launcher-nodes-mismatch", f"{where}: deepspeed --num_nodes={asked} without a hostfile: it "
                       "refuses to start ('Num nodes is >1 but no extra nodes available via hostfile'); give it a "
                       "hostfile of the job's nodes, or launch one per node with srun and torchrun")
    elif nodes > 1 and "no-ssh" not in opts:
        findings.error("launcher-nodes-mismatch", f"{where}: srun starts deepspeed on {nodes} nodes without a "
                       f"hostfile: each one runs its own single-node training (master 127.0.0.1), {nodes} separate "
                       "jobs; give deepspeed a hostfile and start it once, or use srun with torchrun")
    return workers, None


def accelerate_workers(job: Job, launch: "LaunchLine", nodes: int, gpn: int | None, view: list[str], layout: dict,
                       findings: Findings):
    """accelerate launch: --num_processes over --num_machines machines (accelerate/commands/launch.py gives each
    machine num_processes // num_machines); without --num_processes its configuration file decides."""
    opts, where = launch.options, launch.where
    if (opts.get("rdzv-backend") or "static") == "static":  # passed to torchrun as --node_rank (launch.py)
        check_node_rank(launch, "machine_rank", nodes, "--rdzv_backend c10d", findings)
    procs, machines = opts.get("num-processes"), opts.get("num-machines") or "1"
    if not (procs or "").isdigit() or not machines.isdigit():
        layout["notes"].append(f"{where}: accelerate launch without a known --num_processes"
                               + (f" (--config_file {opts['config-file']})" if opts.get("config-file") else "")
                               + ": its configuration file decides the processes, not modelled")
        return False, None
    procs, machines = int(procs), max(1, int(machines))
    if procs % machines:
        findings.error("launcher-nodes-mismatch", f"{where}: accelerate --num_processes={procs} is not a multiple of "
                       f"--num_machines={machines}: it starts {procs // machines} per machine and the world size "
                       f"never adds up; use --num_processes={machines * (len(view) or procs // machines)}")
        return False, None
    return max(1, procs // machines), (machines, machines)


LAUNCHER_WORKERS = {"torchrun": torchrun_workers, "deepspeed": deepspeed_workers, "accelerate": accelerate_workers}


def nodes_expected(nnodes: str | None, standalone: bool) -> tuple[int, int] | None:
    """torchrun's --nnodes N or MIN:MAX (default 1:1) as (fewest, most) agents it runs with, None when unknown."""
    if standalone or nnodes is None:
        return 1, 1
    m = re.fullmatch(r"(\d+)(?::(\d+))?", nnodes)
    return (int(m.group(1)), int(m.group(2) or m.group(1))) if m else None


def node_cores(job: Job) -> int | None:
    ntype = node_type(job)
    return JEAN_ZAY[ntype].cores if ntype else None


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
    seen: set[tuple] = set()
    for node, plans in sorted(by_node.items()):
        shape = tuple(tuple(p.node_gpus) for p in plans)
        if shape in seen:  # a node laid out like one already judged says nothing new
            continue
        seen.add(shape)
        owners: dict[str, list[int]] = {}
        for p in plans:
            for g in dict.fromkeys(p.node_gpus):  # a task's own parts may share a GPU (--devices 0,0)
                owners.setdefault(g, []).append(p.rank)
        shared = {g: r for g, r in owners.items() if len(r) > 1}
        if shared:
            g, r = sorted(shared.items())[0]
            fix = ("give each task its own GPUs, e.g. --gpu-bind=map_gpu:" + ",".join(
                       str(i * (gpn or 1) // len(plans)) for i in range(len(plans)))
                   if "map_gpu" in (report.job.gpu_bind or "") else
                   f"--gpu-bind={report.job.gpu_bind} puts {report.job.gpu_bind.split(':')[-1]} tasks on each GPU; "
                   "--gpu-bind=single:1 gives each task its own"
                   if "single:" in (report.job.gpu_bind or "").lower() else
                   f"--devices {','.join(map(str, report.training.devices))} names the same visible GPUs in every "
                   f"task: drop --devices (each task then takes its own nb_part GPUs), or run one task per node"
                   if report.training.devices else
                   f"use --nb-part <= {(gpn or 0) // len(plans)} or fewer tasks per node")
            report.findings.error("gpu-shared",
                                  f"node {node}: GPU {g} is used by tasks {', '.join(map(str, r))} "
                                  f"({len(shared)} GPU(s) shared in all); {fix}")
        if gpn and any(p.node_gpus for p in plans) and not any(f.code == "gpus-not-divisible"
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
    if t.tf32 and v100:
        findings.warn("tf32-on-v100", "--tf32 on V100 GPUs: TF32 tensor cores start with the A100 (compute "
                      "capability 8.0), so fp32 matmuls run as without it; for speed on a V100 use --precision fp16")
    if gib is None or nb_part < 1 or replicas < 1 or t.unknown:
        return None  # unknown GPU, or arguments the line leaves unknown (shell variables)
    model = model_args(t)
    stage = t.layout == "stage"
    arch = requested_arch(v100)[0]
    try:
        parts = (estimate_stage_memory(model, t, nb_part, replicas, arch, torch=torch_version_of(job.torch_module))
                 if stage else estimate_memory(model, t, nb_part, replicas, arch))
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


def stage_schedule(version: str | None, cpu: bool = False) -> tuple[str | None, str | None]:
    """The schedule --advise gives the stage layout's rows, and why where it is not 1f1b (GPipe holds every
    micro-batch for the same bubble): gpipe where this torch refuses 1f1b (on gloo before 2.8), None where it has
    no stage layout at all (before 2.4). Without a release (no profile) 1f1b."""
    if version is None or not torch_refusals(version, Training(layout="stage", schedule="1f1b"), cpu):
        return "1f1b", None
    refused = torch_refusals(version, Training(layout="stage", schedule="gpipe"), cpu)
    if refused:
        return None, f"no stage layout rows: {refused[0]}"
    return "gpipe", ("stage layout rows run --schedule gpipe: "
                     + torch_refusals(version, Training(layout="stage", schedule="1f1b"), cpu)[0])


def advise(nodes: int, gpn: int, gib: float, model: dict, global_batch: int, v100: bool,
           max_chunks: int = 32, schedule: str | None = "1f1b") -> list[dict]:
    """Every split of `nodes` x `gpn` GPUs that fits in `gib` per GPU at this global batch, in both layouts (the
    page's replicas; bench_stage.py's pipelines with `schedule`, stage_schedule's, none where it is None), sorted
    by fewest GPUs per replica or pipeline, then by bubble."""
    rows = []
    arch, low = requested_arch(v100)
    for tpn in divisors(gpn):
        nb_part, replicas = gpn // tpn, nodes * tpn
        if global_batch % replicas or model["nlayers"] < nb_part:
            continue
        batch = global_batch // replicas
        for chunks in ([1] if nb_part == 1 else [c for c in divisors(batch) if c <= max_chunks]):
            rows += _advise_rows("replica", dict(model, batch_size=batch, chunks=chunks), nb_part, replicas, tpn,
                                 ("fp32", low), gib, arch)
    for pp in [p for p in divisors(gpn) if p > 1 and model["nlayers"] >= p and schedule]:
        replicas = nodes * gpn // pp
        if global_batch % replicas:
            continue
        batch = global_batch // replicas
        for chunks in [c for c in divisors(batch) if pp <= c <= max_chunks]:
            rows += _advise_rows("stage", dict(model, batch_size=batch, chunks=chunks), pp, replicas, gpn,
                                 ("fp32",) if v100 else ("fp32", low), gib, arch, schedule)
    return sorted(rows, key=lambda r: (r["nb_part"], r["bubble"], r["peak_gib"], r["layout"]))


def _advise_rows(layout: str, m: dict, nb_part: int, replicas: int, tpn: int, precisions: tuple[str, ...],
                 gib: float, arch: str, schedule: str = "1f1b") -> list[dict]:
    """The options of one split that fit, as --advise rows (nb_part is --pp in the stage layout)."""
    rows = []
    for precision in precisions:
        for ckpt in (False, True):
            for zero in ((False, True) if replicas > 1 else (False,)):
                t = Training(layout=layout, pp=nb_part, schedule=schedule, precision=precision,
                             activation_checkpointing=ckpt, zero=zero)
                worst = worst_part(m, t, nb_part, replicas, arch)
                peak = worst.total / GIB
                if peak <= gib:
                    rows.append(dict(ntasks_per_node=tpn, nb_part=nb_part, replicas=replicas,
                                     batch_size=m["batch_size"], chunks=m["chunks"], precision=precision,
                                     activation_checkpointing=ckpt, zero=zero, peak_gib=round(peak, 2),
                                     bubble=round(bubble(nb_part, m["chunks"]), 3), layout=layout,
                                     schedule=schedule if layout == "stage" else "gpipe", peak_at=worst.peak_at))
    return rows


def advise_text(rows: list[dict], nodes: int, gpn: int, gib: float, source: str, global_batch: int,
                profile: dict | None = None, schedule_note: str | None = None) -> str:
    ranked = (f"fastest first, by the samples/s predicted from the profile ({profile['key']['gpu']}, torch "
              f"{profile['key']['torch']}, taken {profile.get('taken', '?')}; terms in ms per step)" if profile else
              "fewest GPUs per replica (or pipeline) first, then by bubble (no speed is predicted without "
              "--profile FILE: benchmarks/speed_profile.py takes one in a minute, docs/speed.md)")
    lines = [f"check_topology --advise: {nodes} node(s) x {gpn} GPU(s) of {gib:.1f} GiB ({source}), global batch "
             f"{global_batch}: {len(rows)} split(s) shown that fit, {ranked}; layout replica is "
             "bench_ddp_transformer.py (nb_part GPUs a task), stage is bench_stage.py (a task a GPU, nb_part = --pp)",
             f"  {'layout':7} {'tasks/node':>10} {'nb_part':>7} {'replicas':>8} {'batch':>5} {'chunks':>6} "
             f"{'precision':9} {'ckpt':4} {'zero':4} {'peak GiB':>8} {'bubble':>6}"
             + (f" {'samples/s':>9}  compute / bubble / per-micro-batch / communication / optimizer" if profile
                else "")]
    for r in rows:
        speed = ""
        if profile:
            terms = r.get("terms_ms")
            speed = (f" {r['samples_per_s']:>9.1f}  " + " / ".join(f"{terms[k]:.1f}" for k in SPEED_TERMS)
                     if terms else f" {'-':>9}  {r.get('why', '')}")
        lines.append(f"  {r['layout']:7} {r['ntasks_per_node']:>10} {r['nb_part']:>7} {r['replicas']:>8} "
                     f"{r['batch_size']:>5} {r['chunks']:>6} {r['precision']:9} "
                     f"{'yes' if r['activation_checkpointing'] else 'no':4} {'yes' if r['zero'] else 'no':4} "
                     f"{r['peak_gib']:>8.2f} {r['bubble']:>6.1%}" + speed)
    notes = sorted({n for r in rows for n in r.get("notes", [])}) + [schedule_note] * bool(schedule_note)
    lines += [f"  note: {n}" for n in notes]
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
                gpus = ",".join(p.node_gpus) if p.node_gpus else ("cpu" if p.cpu else "-")
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
        if not self.tasks and j.trainer is None and not j.unplanned:
            lines.append(f"  {j.nodes or 1} node(s) x {j.gpus_per_node or 0} GPU(s)"
                         + (f", {j.ntasks_per_node} task(s) per node" if j.ntasks_per_node else "")
                         + (f", {j.cpus_per_task} CPU(s) per task" if j.cpus_per_task else ""))
        for x in j.launches if not self.tasks else []:
            lay = x.layout
            if lay.get("processes_per_node"):
                per = lay["processes_per_node"]
                lines.append(f"  {x.where}: {x.launcher if x.launcher != 'program' else 'srun'} {x.program}: "
                             f"{_choices(per)} process(es) per node on {len(per)} node(s)"
                             + (f" ({_choices(lay['agents_per_node'])} agent(s) per node)" if x.launcher in (
                                 "torchrun", "deepspeed", "accelerate") else "")
                             + (f", {lay['gpus_per_process']} GPU(s) each" if lay.get("gpus_per_process") else ""))
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
        account=env.get("SLURM_JOB_ACCOUNT") or None, qos=env.get("SLURM_JOB_QOS") or None, time="allocated",
        source=f"allocation of job {env.get('SLURM_JOB_ID', '?')} ({env.get('SLURM_JOB_NODELIST', '?')})")
    # Lmod and Environment Modules keep the loaded modules in LOADEDMODULES; the torch that runs is the installed
    # one (its package metadata: no torch import)
    job.modules = [m for m in env.get("LOADEDMODULES", "").split(":") if m]
    job.torch_module = next((m for m in reversed(job.modules) if torch_version_of(m)), None)
    try:
        import importlib.metadata
        job.torch_version = importlib.metadata.version("torch")
    except Exception:  # no torch here, or broken metadata: the module line, if any, says which
        job.torch_version = None
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
    report = Report(job, training, plans, findings)
    if any(not p.cpu for p in plans):
        job.gpu_mem_seen = gpus_memory_here()
    gpn = job.gpus_per_node
    if gpn:
        check_gpu_request(job, gpn, findings)
    check_even(job, gpn, launch.tasks_per_node, findings)
    check_kit(report, launch.tasks_per_node, gpn)
    check_site(job, launch.tasks_per_node, (gpn // max(launch.tasks_per_node)) if gpn else 0, gpn, findings)
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
    p = argparse.ArgumentParser(  # no abbreviations, as in the trainers (I.1)
        prog="check_topology.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
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
    train = p.add_argument_group("the trainer's arguments (over those of an sbatch file's trainer line; the "
                                 "trainers' own definition: same names, ranges and defaults, docs/arguments.md)")
    train.add_argument("--layout", choices=("replica", "stage"),
                       help="plan bench_ddp_transformer.py (replica, the default) or bench_stage.py (stage)")
    for a in ARGS:
        if not a.checked:
            continue
        only = f" [{SCRIPTS[a.layouts[0]]}]" if len(a.layouts) == 1 else ""
        if a.kind is None:
            train.add_argument(a.flag, dest=a.dest, action="store_true", default=None, help=a.help_text() + only)
        else:
            train.add_argument(a.flag, dest=a.dest, metavar="{" + ",".join(a.choices) + "}" if a.choices else None,
                               help=a.help_text() + only)
    mem = p.add_argument_group("will it fit? (the GPU's memory)")
    mem.add_argument("--gpu-mem", type=float, metavar="GiB",
                     help="memory of one GPU (default: from -C/-p, or the allocation's GPUs)")
    mem.add_argument("--advise", action="store_true",
                     help="list every split of --nodes x --gpus-per-node that fits, for --global-batch")
    mem.add_argument("--global-batch", help="--advise: samples per step over all replicas (several: 256,512)")
    mem.add_argument("--profile", metavar="FILE", help="--advise: rank the splits by the samples/s predicted from "
                     "this profile (benchmarks/speed_profile.py, taken in the allocation: docs/speed.md)")
    mem.add_argument("--top", type=int, metavar="K", help="--advise: the first K splits only")
    mem.add_argument("--commands", action="store_true", help="--advise: each split as the line that runs it: "
                     "tasks per node, the trainer, its arguments (the sweep's predict mode reads them)")
    p.add_argument("--site", choices=("auto", "live", "jean-zay", "none"), default="auto",
                   help="whose account, QoS and time rules judge the job: live (Slurm's configuration here: "
                        "scontrol, sacctmgr), jean-zay (the dated table), none; auto (the default): live where Slurm "
                        "answers within site_slurm.py's deadline, else the table")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def advise_main(args: argparse.Namespace, t: Training) -> int:
    """--advise: every split that fits, from planning flags alone; with --profile ranked by predicted speed."""
    job = Job(nodes=args.nodes, gpus_per_node=args.gpus_per_node, constraint=args.constraint,
              partition=args.partition, gpu_mem=args.gpu_mem)
    ntype = node_type(job)
    gpn = job.gpus_per_node or (JEAN_ZAY[ntype].gpus or None if ntype else None)
    gib, source = gpu_memory(job)
    missing = [m for m, v in (("--nodes N", job.nodes), ("--gpus-per-node N (or -C/-p of a known node)", gpn),
                              ("-C v100-16g|v100-32g|a100|h100 or --gpu-mem GiB", gib),
                              ("--global-batch N", args.global_batch)) if not v]
    if missing:
        raise UsageError(f"--advise needs {', '.join(missing)}; e.g. --advise --nodes 3 --gpus-per-node 4 "
                         "-C v100-32g --global-batch 384")
    batches = global_batches(args.global_batch)
    if job.nodes < 1 or gpn < 1:
        raise UsageError(f"--nodes ({job.nodes}) and --gpus-per-node ({gpn}) must be at least 1")
    if args.top is not None and args.top < 1:
        raise UsageError(f"--top {args.top} must be at least 1, e.g. --top 3")
    profile = None
    if args.profile:
        try:
            profile = read_profile(args.profile)
        except ProfileError as exc:
            raise UsageError(str(exc)) from None
        mismatch = profile_mismatch(profile, t.model)  # the values given on the command line
        taken_on = profile["key"].get("node_type")
        if taken_on and ntype and taken_on != ntype:
            mismatch = (f"it was taken on {taken_on} nodes and the plan is for {ntype}: a profile's times hold for "
                        "its node type only; take one there (docs/speed.md)")
        mismatch = mismatch or profile_gpu_mismatch(profile, ntype)
        if mismatch:
            raise UsageError(f"--profile {args.profile}: {mismatch}")
        # what the command line does not give is the profile's model: the one it was taken with
        t.model = {**profile["key"]["model"], **t.model}
        t.nlayers = t.nlayers or profile["key"].get("nlayers")
    model = model_args(t)
    # the profile's torch and device say which schedule the stage layout's trainer will run (TORCH_FEATURES)
    schedule, schedule_note = stage_schedule(profile["key"].get("torch") if profile else None,
                                             bool(profile) and profile["device"] == "cpu")
    rows = [r for batch in batches for r in advise(job.nodes, gpn, gib, model, batch, is_v100(job),
                                                   schedule=schedule)]
    if profile:
        rows = rank_by_speed(rows, profile, model, job.nodes)
    rows = rows[:args.top] if args.top else rows
    if args.commands:
        print("\n".join(f"{r['ntasks_per_node']} {SCRIPTS[r['layout']]} {shlex.join(trainer_argv(r, model))}"
                        for r in rows))
    else:
        print(json.dumps(rows, indent=1) if args.json else
              advise_text(rows, job.nodes, gpn, gib, source, args.global_batch, profile, schedule_note))
    return 0 if rows else 1


def global_batches(text: str) -> list[int]:
    """--global-batch 512, or several: 256,512."""
    try:
        values = [int(v) for v in str(text).split(",")]
    except ValueError:
        raise UsageError(f"--global-batch {text!r} must be a number of samples, or several separated by commas: "
                         "--global-batch 256,512") from None
    if min(values) < 1:
        raise UsageError(f"--global-batch {text} must be at least 1")
    return values


def trainer_argv(row: dict, model: dict) -> list[str]:
    """The trainer's arguments that run an --advise row (its script: SCRIPTS[row["layout"]])."""
    argv = [f"--{k.replace('_', '-')}={_show(model[k])}" for k in ("nlayers", *PROFILE_MODEL)]
    argv += (["--nb-part", str(row["nb_part"])] if row["layout"] == "replica" else
             ["--pp", str(row["nb_part"]), "--schedule", row["schedule"]])
    argv += ["--chunks", str(row["chunks"]), "--batch-size", str(row["batch_size"])]
    argv += ["--precision", row["precision"]] if row["precision"] != "fp32" else []
    argv += ["--activation-checkpointing"] * bool(row["activation_checkpointing"]) + ["--zero"] * bool(row["zero"])
    return argv


def rank_by_speed(rows: list[dict], profile: dict, model: dict, nodes: int) -> list[dict]:
    """--advise's rows with the samples/s predicted from the profile and its terms (ms), fastest first; a row the
    profile cannot predict (a precision it did not time) goes last, with the reason."""
    for r in rows:
        t = Training(layout=r["layout"], pp=r["nb_part"], schedule=r["schedule"], precision=r["precision"],
                     activation_checkpointing=r["activation_checkpointing"], zero=r["zero"])
        m = dict(model, batch_size=r["batch_size"], chunks=r["chunks"])
        try:
            guess = predict_speed(profile, m, t, r["nb_part"], r["replicas"], r["ntasks_per_node"], nodes)
        except ProfileError as exc:
            r.update(samples_per_s=None, why=str(exc))
            continue
        except (ArithmeticError, ValueError):  # times the checks let through but the model divides by: all zero
            r.update(samples_per_s=None, why="the profile's times are zero where the model divides by them: take "
                     "it again with benchmarks/speed_profile.py")
            continue
        r.update(samples_per_s=round(guess["samples_per_s"], 1), step_ms=round(guess["step_s"] * 1e3, 2),
                 terms_ms={k: round(v * 1e3, 2) for k, v in guess["terms"].items()}, notes=guess["notes"])
    return sorted(rows, key=lambda r: -(r["samples_per_s"] or -1))

PLANNING = ("nodes", "gpus_per_node", "ntasks_per_node", "ntasks", "gpus_per_task", "gpu_bind", "cpus_per_task",
            "partition", "constraint")


def planning_counts(args: argparse.Namespace) -> None:
    """The planning flags' counts within what a node and Jean Zay have (COUNT_LIMITS), in one line; --advise's own
    flags only with --advise."""
    if (args.profile or args.top is not None or args.commands) and not args.advise:
        raise UsageError("--profile, --top and --commands go with --advise, e.g. --advise --profile profile.json "
                         "--nodes 2 --gpus-per-node 4 --gpu-mem 32 --global-batch 256")
    for name in ("nodes", "gpus_per_node", "ntasks_per_node", "ntasks", "gpus_per_task", "cpus_per_task"):
        flag = name.replace("_", "-")
        value = getattr(args, name, None)
        if value is not None and value > COUNT_LIMITS[flag]:
            raise UsageError(f"--{flag} {value} is more than any Jean Zay node or partition has (the checker plans "
                             f"up to {COUNT_LIMITS[flag]}); give what the nodes have")


def override(args: argparse.Namespace, t: Training) -> Training:
    """The trainer's arguments given on the checker's command line, over those of the sbatch file's trainer line,
    read with the trainers' definition (the same ranges, in the same words). They say what the line's shell
    variables hold: nothing is left unknown, and what they do not give is the trainer's default."""
    given = False
    for a in ARGS:
        raw = getattr(args, a.dest, None) if a.checked else None
        if raw is None:
            continue
        value, problem = a.convert(raw)
        if problem:
            raise UsageError(problem)
        if a.dest in TRAINING_FIELDS:
            setattr(t, a.dest, value)
        else:
            t.model[a.dest] = value
        given = True
    if args.layout is not None:
        t.layout = args.layout
    if given:
        t.unknown = []
    return t  # nlayers left None: check_job / task_facts take the trainer's default for GPU or CPU


def use_site(job: Job, choice: str) -> str:
    """Sets whose rules judge the job's account, QoS and time (--site); returns the report's note saying which."""
    if choice in ("auto", "live"):
        try:
            import site_slurm  # here only: the table's path runs no command
        except ImportError:  # copied without it: the table, said in the note (or refused, for --site live)
            site_slurm = None
        facts = site_slurm.site_facts() if site_slurm else None
        if facts is not None:
            job.site_rules, job.site = "live", facts
            qos = (f"{len(facts.qos)} QoS and your {len(facts.assocs)} association(s)" if facts.accounting else
                   "no accounting (no QoS or association limits)")
            return (f"site rules: Slurm's configuration here ({facts.cluster}, Slurm {facts.version}: "
                    f"{len(facts.partitions)} partitions, {qos}; read in {facts.read_seconds:.2f} s)")
        if choice == "live":
            raise UsageError("--site live: " + ("site_slurm.py is not beside check_topology.py; copy it there" if not
                             site_slurm else f"Slurm does not answer here (scontrol absent, or no answer within "
                             f"{site_slurm.READ_SECONDS:g} s)") + "; or use --site jean-zay (the dated table) or --site none")
    job.site_rules = "none" if choice == "none" else "jean-zay"
    return ("site rules: none (--site none): Slurm's own behaviour only, no account, QoS or time limit judged"
            if choice == "none" else f"site rules: Jean Zay's documented table of {JEAN_ZAY_DATE}"
            + (" (Slurm does not answer here)" if choice == "auto" else ""))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
    if extras:  # what argparse would refuse, with the did-you-mean the trainers give
        flags = re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", parser.format_usage())
        print(f"check_topology: {unknown_option(extras[0], flags, 'check_topology.py')}" if extras[0].startswith("-")
              else f"check_topology: unexpected {extras[0]!r}: give one sbatch file at most", file=sys.stderr)
        return 2
    training = Training()
    try:
        if args.gpu_mem is not None and args.gpu_mem <= 0:
            raise UsageError(f"--gpu-mem {args.gpu_mem:g} must be a positive number of GiB, e.g. --gpu-mem 32")
        planning_counts(args)
        if args.advise:
            return advise_main(args, override(args, training))
        planning = any(getattr(args, k) is not None for k in PLANNING)
        if args.sbatch_file:
            if planning:
                raise UsageError("give either an sbatch file or planning flags (--nodes ...), not both")
            job, training, findings = read_sbatch(args.sbatch_file)
            job.gpu_mem, note = args.gpu_mem, use_site(job, args.site)
            report = check_job(job, override(args, training))
            report.findings[:0] = findings
            report.notes.append(note)
        elif planning:
            missing = [f"--{k.replace('_', '-')}" for k in ("nodes", "gpus_per_node") if getattr(args, k) is None]
            if missing and not (args.gpus_per_task and args.nodes):
                raise UsageError(f"planning needs {' and '.join(missing)} (and --ntasks-per-node), e.g. "
                                 "--nodes 3 --gpus-per-node 4 --ntasks-per-node 2")
            bad = below_one_message({k: getattr(args, k) for k in PLANNING})
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

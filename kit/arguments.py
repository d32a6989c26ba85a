"""The trainers' arguments, defined once: ARGS, each Arg the whole record of its option (name, type, GPU and CPU
defaults, range, help, layouts, its rule on a resume), the argparse both trainers build from it and the reader of a
job script's trainer line with that same parser (the checker's and python -m kit.own_model's options are theirs);
the Training a run or a check is about, derived from ARGS.
Owns: every trainer default and range (docs/arguments.md lists them), RESUME_RULES. Imports: kit.findings,
kit.schedules."""
from __future__ import annotations

import argparse
import difflib
import functools
import math
import re
import sys
from dataclasses import dataclass, field, make_dataclass
from typing import Callable, Iterable, NoReturn, Sequence

from kit.findings import Findings, refusal_text
from kit.schedules import MULTI_STAGE, SCHEDULES


# Every argument of the two trainers is defined once, in ARGS: its name, type, GPU and CPU defaults, choices, range,
# help, and the layouts that have it. bench_ddp_transformer.py and bench_stage.py build their argparse from it
# (trainer_parser); the checker reads a job script's trainer line with that same parser (read_trainer_argv) and takes
# the same names on its own command line. So the checker refuses a line exactly when the trainer would, in its words,
# and never judges a default where the line means something else. docs/arguments.md lists them with their ranges.

CPU_NB_PART = 2  # no GPU: still split in two so the pipeline is exercised

ENGINES = ("auto", "torch-pipe", "fairscale")


# --precision's names: fp32 (no autocast), bf16 or fp16 autocast
PRECISIONS = ("fp32", "bf16", "fp16")

SPLITS = ("even", "time", "memory")  # --split of a --model: the even split, or balanced by FLOPs or by memory

# each --precision's autocast dtype, by its name in torch (torch-free here): the trainers' autocast
# (kit.train.options.autocast_dtype) and kit.own_model's measurement read it
AUTOCAST_DTYPE = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}

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


def show_value(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# What a resume does with each argument given another value than the saved run's (never: keep the saved value while
# the companion records the new one); each Arg names its rule (resume=), kit.train.checkpoint applies them.
RESUME_RULES = {
    "layout": "the parameters' shapes and their cut into parts: refused by the checkpoint's layout check",
    "applied": "this run's value runs from its first step (one notice line lists them)",
    "refused": "one line naming the saved value",
    "corpus": "the data, checked as read (review counts, vocabulary), not as the option's text: a copy elsewhere is "
              "fine",
    "none": "not a setting of the training (files, modes)",
}


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
    group: str = "run"  # model (a GPU and a CPU default), memory, pipeline, own (--model), run, files, mode
    help: str = ""
    why: str = ""
    code: str = "bad-argument"  # the finding of a value the trainer refuses
    resume: str = ""  # what --resume does with another value than the saved run's: RESUME_RULES (each Arg names one)
    checkpoint: bool = False  # in the checkpoint's layout, which a load must match (kit.train.checkpoint.layout_of)
    shape: bool = False  # the kit's Transformer's shape: in Training.model (the line's values), a profile's key
    judged: bool = False  # outside the checked groups, in Training all the same: the checks read it (--save)
    name: str = ""  # the attribute, where the flag's own would clash (--model: Training.model is the kit's dict)

    def __post_init__(self) -> None:
        if self.resume not in RESUME_RULES or (self.checkpoint and self.resume != "layout"):
            raise ValueError(f"{self.flag}: resume={self.resume!r}; each argument names its rule, one of "
                             f"{', '.join(RESUME_RULES)} (layout where checkpoint=True)")

    @property
    def dest(self) -> str:
        return self.name or self.flag[2:].replace("-", "_")

    @property
    def in_training(self) -> bool:
        """A field of Training (a checked argument, or one the checks read), or of its `model` (shape=True)."""
        return self.checked or self.judged

    @property
    def cpu_default(self) -> object:
        return self.gpu if self.cpu is ... else self.cpu

    @property
    def checked(self) -> bool:
        """The checker's plan, memory model or checks use it: the checker's command line takes it too."""
        return self.group in ("model", "memory", "pipeline", "own")

    def example(self) -> str:
        if self.gpu is not None or self.lo is not None:
            return show_value(self.gpu if self.gpu is not None else self.lo)
        return "0,0" if self.kind is gpu_indices else "PATH"

    def range_text(self) -> str:
        if self.kind is gpu_indices:
            return f"GPU indices separated by commas, one per part, each from 0 to {MAX_GPUS_PER_NODE - 1}"
        what, lo, hi = "an integer" if self.kind is int else "a number", show_value(self.lo), show_value(self.hi)
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
            shown = raw if len(raw) <= 40 else f"{raw[:20]}...({len(raw)} characters)"  # 5,000 digits: their start
        except ValueError:
            shown = repr(raw if len(raw) <= 40 else raw[:20] + "...")
        why = f" ({self.why})" if self.why else ""
        return f"{self.flag} {shown} must be {self.range_text()}{why}; e.g. {self.flag} {self.example()}"

    def convert(self, raw: str | bool) -> tuple[object, str | None]:
        """(value, None), or (None, the refusal)."""
        if self.kind is None:
            return bool(raw), None
        if self.group in ("files", "own") and not str(raw).strip():  # '' would silently mean "none": no save, no record
            return None, (f"{self.flag} {raw!r} is an empty path; give a file or folder, or leave {self.flag} out")
        if self.kind in (int, float, gpu_indices) and not str(raw).isascii():  # int() takes '٣' for 3 (issue 42)
            return None, self.refusal(raw)
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
            bits.append(f"default: GPU {show_value(self.gpu)}, CPU {show_value(self.cpu_default)}")
        elif self.kind is not None and self.gpu is not None:
            bits.append(f"default {show_value(self.gpu)}")
        if self.lo is not None:
            bits.append(self.range_text().split(" ", 2)[2])
        return (self.help + (f" ({'; '.join(bits)})" if bits else "")).replace("%", "%%")


ARGS = (
    # The model and the batch. GPU: big enough that the page's reason for model parallelism (activations of a deep
    # model) holds. CPU (CI, laptops): small enough for a 2-core machine to learn the synthetic task in well under a
    # minute; no dropout there, its random masks cost as much as the matmuls of so small a model. On a resume the
    # shapes are the checkpoint's layout; the batch and its cut into micro-batches apply from the first step
    # (samples_in_epoch keeps the place in the epoch), as does the dropout.
    Arg("--nlayers", int, 16, 4, 1, 1024, group="model", resume="layout", checkpoint=True, help="Layer blocks"),
    Arg("--d-model", int, 1024, 64, 2, 65536, group="model", resume="layout", checkpoint=True, shape=True,
        help="width (even, a multiple of --n-head)"),
    Arg("--n-head", int, 16, 4, 1, 1024, group="model", resume="layout", checkpoint=True, shape=True,
        help="attention heads"),
    Arg("--d-hid", int, 4096, 128, 1, 262144, group="model", resume="layout", checkpoint=True, shape=True,
        help="feed-forward width"),
    Arg("--dropout", float, 0.1, 0.0, 0, 1, hi_open=True, group="model", resume="applied", shape=True,
        why="a probability", help="dropout (on the CPU its masks cost as much as the matmuls)"),
    Arg("--seq-len", int, 256, 64, 1, 131072, group="model", resume="layout", checkpoint=True, shape=True,
        help="tokens per review"),
    Arg("--vocab-size", int, 30000, 2000, 3, 10_000_000, group="model", resume="layout", checkpoint=True, shape=True,
        why="the two special tokens <pad> and <unk>, and at least one word", help="vocabulary incl. <pad>,<unk>"),
    Arg("--chunks", int, 4, 2, 1, 4096, group="model", resume="applied",
        help="micro-batches per batch: 1 = naive model parallel"),
    Arg("--batch-size", int, 64, 32, 1, 65536, group="model", resume="applied", help="samples per step per replica"),
    # the page's closing advice: what a GPU holds. On a resume each applies from the first step: autocast (fp16's
    # GradScaler state is restored where both runs are fp16, else it starts afresh), checkpointing, ZeRO (the
    # optimizer state is saved in plain AdamW's layout and loads either way)
    Arg("--precision", str, "fp32", choices=PRECISIONS, group="memory", resume="applied",
        help="autocast: bf16 (A100, H100, CPU), or fp16 with a GradScaler (V100 has no bf16); weights stay fp32"),
    Arg("--activation-checkpointing", None, False, group="memory", resume="applied",
        help="each Layer keeps only its input and recomputes the rest in backward (torch.utils.checkpoint)"),
    Arg("--zero", None, False, group="memory", resume="applied",
        help="ZeroRedundancyOptimizer: AdamW's state sharded over the replicas"),
    # off by default, as the page has it (and torch since 1.12: torch.backends.cuda.matmul.allow_tf32 = False);
    # the same bytes as fp32 (the memory model has no term for it), TF32's tensor cores on compute capability >= 8.0
    Arg("--tf32", None, False, group="memory", resume="applied",
        help="fp32 matmuls on TF32 tensor cores (A100, H100; a V100 has none): 10-bit mantissa, fp32's range"),
    # the replica layout's pipeline (bench_ddp_transformer.py); nb_part is the checkpoint's cut into parts
    Arg("--nb-part", int, None, lo=1, hi=MAX_GPUS_PER_NODE, layouts=("replica",), group="pipeline", resume="layout",
        help=f"GPUs per replica (default: the page's GPUs per node // tasks per node; CPU {CPU_NB_PART})"),
    Arg("--engine", str, "auto", choices=ENGINES, layouts=("replica",), group="pipeline", resume="applied",
        code="bad-engine", help="auto: torch-pipe on torch <= 2.3, else fairscale"),
    Arg("--devices", gpu_indices, None, layouts=("replica",), group="pipeline", resume="applied",
        help="visible GPU index of each part instead of the page's indexing; 0,0 puts both parts on one GPU "
             "(benchmarks/gpu_check.py on a one-GPU node)"),
    # the stage layout's pipeline (bench_stage.py); on a resume the stages per task may change (their product with
    # --pp, nb_part, is the checkpoint's layout)
    Arg("--pp", int, 2, lo=2, hi=1024, layouts=("stage",), group="pipeline", resume="applied",
        why="a pipeline needs at least 2 stages; for pure data parallel use bench_ddp_transformer.py --nb-part 1",
        help="tasks per pipeline (pipelines = world size / pp)"),
    Arg("--schedule", str, "1f1b", choices=tuple(SCHEDULES), layouts=("stage",), group="pipeline", resume="applied",
        code="bad-schedule", help="torch.distributed.pipelining's schedule (kit/schedules.py)"),
    Arg("--virtual-stages", int, 2, lo=1, hi=64, layouts=("stage",), group="pipeline", resume="applied",
        help=f"stages per task for {', '.join(MULTI_STAGE)} (the V ones, zbvzerobubble and dualpipev: exactly 2)"),
    # the user's own model instead of the kit's Transformer (kit.model, kit.own_model, kit.own_split;
    # docs/own_model.md); on a resume another model's weights, or another cut of them, are the checkpoint's layout
    # (layout_of's "model" and "part_sizes")
    Arg("--model", str, group="own", resume="layout", name="model_spec",
        help="FILE.py:function or module:function returning your layers (an nn.Sequential or a list of modules) "
             "instead of the kit's Transformer"),
    Arg("--sample", str, group="own", resume="applied",
        help="with --model: a batch the first layer takes, FILE.py:function, or BxS for token ids (then the kit's "
             "data, if the model outputs its 2 classes' logits); default --batch-size x --seq-len"),
    Arg("--split", str, "even", choices=SPLITS, group="own", resume="layout",
        help="with --model: the page's even split of the layers, or balanced by FLOPs (time) or by memory"),
    # the run: its length and what only times or watches it apply from a resume's first step
    Arg("--epochs", int, 3, lo=1, hi=100_000, resume="applied"),
    Arg("--max-steps", int, 0, lo=0, hi=10**9, resume="applied", why="0: no limit",
        help="stop after this many steps in all"),
    Arg("--untimed-steps", int, 3, lo=0, hi=10**6, resume="applied",
        help="first steps of each epoch left out of the samples/s (allocator, autotuning); not the lr's warmup"),
    # The learning rate: AdamW's peak rate, reached after --lr-warmup of the run's steps, then decayed (the
    # Transformer paper's and BERT's practice). Default min(2e-3, LR_TIMES_WIDTH / d_model): 1.6e-3 on the CPU
    # (d_model 64), 1e-4 at the GPU's d_model 1024. Measured on an H200 (docs/gpu.md): lr x d_model about 1 collapsed
    # to one class at every depth, 0.26 learned then slipped, 0.1 learned.
    Arg("--lr", float, None, lo=0, hi=10, lo_open=True, resume="applied", why="AdamW's peak rate",
        help="AdamW's peak learning rate (default min(2e-3, 0.1 / d_model): 1e-4 at d_model 1024)"),
    Arg("--lr-warmup", float, 0.05, lo=0, hi=1, hi_open=True, resume="applied", why="a fraction of the run's steps",
        help="fraction of the run's steps over which the lr rises linearly from 0 to --lr"),
    Arg("--lr-decay", str, "cosine", choices=("cosine", "linear", "none"), resume="applied",
        help="after the warmup: cosine or linear down to --lr / 10 at the run's last step, or none (constant)"),
    # torch.manual_seed takes [-2**63, 2**64 - 1] and maps a negative seed onto a positive one; the trainer seeds
    # rank r with seed + 1 + r and the sampler with seed + epoch, which this range keeps valid and distinct. A resume
    # refuses another seed: DistributedSampler shuffles epoch e with seed + e, and a resume continues that order at
    # the saved sample (another seed would train some samples twice and others never in the epoch in progress)
    Arg("--seed", int, 1234, lo=0, hi=2**63 - 1, resume="refused",
        help="the model's initial weights, the data order, dropout"),
    Arg("--synthetic", int, 0, lo=0, hi=10_000_000, resume="corpus",
        why="0: IMDB, or 4000 synthetic reviews where there is none", help="N synthetic reviews instead of IMDB"),
    Arg("--workers", int, -1, lo=-1, hi=64, resume="applied", why="-1: from --cpus-per-task on a GPU, 0 on the CPU",
        help="DataLoader workers"),
    Arg("--timeout", float, 600.0, lo=0, hi=7 * 86400, lo_open=True, resume="applied", why="seconds, at most a week",
        help="seconds before a collective with a dead rank gives up"),
    Arg("--log-every", float, 30.0, lo=0, hi=86400, resume="applied",
        help="seconds between progress lines within an epoch"),
    # files
    Arg("--data-dir", str, group="files", resume="corpus",
        help="aclImdb/ or aclImdb_v1.tar.gz, or a folder holding one (default $DSDIR/IMDB)"),
    Arg("--cache-dir", str, group="files", resume="none", help="where the tokenised corpus is cached (default "
        "$SCRATCH, else the data's folder if writable, else ./.cache)"),
    Arg("--json-out", str, group="files", resume="none",
        help="append one JSON line with the configuration and results (rank 0)"),
    Arg("--save", str, group="files", resume="none", judged=True,
        help="write the checkpoint here after each epoch (rank 0, atomically)"),
    Arg("--load", str, group="files", resume="none", help="start from this checkpoint (every rank loads it)"),
    Arg("--resume", None, False, group="files", resume="none", judged=True,
        help="start from the --save file if it exists (a requeued job continues)"),
    Arg("--check-args", None, False, group="mode", resume="none",
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


def _known(self: "Training", *names: str) -> bool:
    """Whether the checks may judge these arguments: no shell variable (or line the trainer refuses) hides them."""
    return not any(n in self.unknown for n in names)


def _training_field(a: Arg) -> tuple[str, object, object]:
    """A's field of Training: the line's value, else None for the model's (the GPU or CPU default applies:
    model_args), the default of the others."""
    kind = {None: bool, int: int, float: float, str: str, gpu_indices: list}[a.kind]
    return a.dest, kind | None, field(default=None if a.group == "model" else a.gpu)


# A trainer's arguments as the plan and the checks use them: derived from ARGS, the arguments the checker judges
# (Arg.in_training), each at its default (None for the model's: the line's own value, or None where the GPU or CPU
# default applies); the kit's Transformer's shape (shape=True) in `model`, the values the line gives; the layout; and
# what a job script's shell variables hide (`unknown`, `unchecked`).
Training = make_dataclass("Training", [
    *(_training_field(a) for a in ARGS if a.in_training and not a.shape),
    ("layout", str, field(default="replica")),  # replica (bench_ddp_transformer.py) or stage (bench_stage.py)
    ("model", dict, field(default_factory=dict)),  # d_model, n_head, d_hid, seq_len, vocab_size, dropout on the line
    ("unchecked", list, field(default_factory=list)),  # arguments given as shell variables, as written
    ("unknown", list, field(default_factory=list)),  # names (nlayers, chunks, ...) whose value is not known here
], namespace={"known": _known, "__doc__": "A trainer's arguments as the plan and the checks use them (derived "
              "from ARGS): None where the line gives a model argument none (the GPU or CPU default applies), the "
              "line's own values elsewhere."})
Training.__module__ = __name__


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
    add_options(p, [a for a in ARGS if layout in a.layouts])
    return p


def add_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, args: Iterable[Arg],
                suffix: Callable[[Arg], str] | None = None) -> None:
    """Each of `args` as an option of `parser` (a trainer's, the checker's, python -m kit.own_model's): its flag,
    dest, choices and help (`suffix`: words added to it). Values stay text, None where not given (a switch too):
    read_trainer_argv, or given_values, converts and checks them with the Arg's own rules."""
    for a in args:
        text = a.help_text() + (suffix(a) if suffix else "")
        if a.kind is None:
            parser.add_argument(a.flag, dest=a.dest, action="store_true", default=None, help=text)
        else:
            parser.add_argument(a.flag, dest=a.dest, metavar="{" + ",".join(a.choices) + "}" if a.choices else None,
                                help=text)


def given_values(values: argparse.Namespace, args: Iterable[Arg]) -> dict[str, object]:
    """The values of `args` that a parser built by add_options read, converted and checked (Arg.convert), by dest;
    those not given are left out. ArgumentError with the refusal of the first bad one."""
    out = {}
    for a in args:
        raw = getattr(values, a.dest, None)
        if raw is None:
            continue
        value, problem = a.convert(raw)
        if problem:
            raise ArgumentError(problem)
        out[a.dest] = value
    return out


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


def set_values(t: Training, values: dict[str, object], layout: str | None = None) -> Training:
    """Put `values` (by dest) into t: each in its field, the Transformer's shape in t.model (None there: not given);
    `layout`: only that layout's arguments. The one mapping of argument values to Training (the trainers' checks,
    a job script's trainer line, the checker's command line)."""
    for a in ARGS:
        if a.dest not in values or not a.in_training or (layout and layout not in a.layouts):
            continue
        if a.shape:
            if values[a.dest] is not None:
                t.model[a.dest] = values[a.dest]
        else:
            setattr(t, a.dest, values[a.dest])
    return t


def training_from_args(values: argparse.Namespace | dict, layout: str,
                       names: Iterable[str] | None = None) -> Training:
    """The Training of a trainer's arguments (`names`: only those, the others left at Training's defaults)."""
    given = vars(values) if isinstance(values, argparse.Namespace) else dict(values)
    names = set(given if names is None else names)
    return set_values(Training(layout=layout), {k: v for k, v in given.items() if k in names}, layout)

"""The trainers' errors and how a task ends on one: RunError (a verdict every task reaches, said by task 0),
TaskError and LostContact (said by the task that meets it), Quiet; log() from rank 0; cli() runs a trainer's main().
Owns: the exit statuses (1, 2, 75 via StopRequest, 130). Imports: idr_torch, kit.arguments, kit.train.signals.
"""
from __future__ import annotations

import os
import sys
from typing import Callable

import idr_torch
import kit.arguments
from kit.train.signals import CTRL_C, StopBeforeTraining, is_rank0


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


def first_line(exc: BaseException) -> str:
    """An exception's first line, for a one-line error (some, like EOFError, have none)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def cli(main: Callable[[], int], prog: str) -> None:
    """Run a trainer's main(). A user error is one line: a verdict every task reaches is said by task 0, a task's
    own error (TaskError, LaunchError) by that task; Quiet ones exit 1 without a line."""
    PROG[0] = prog
    try:
        code = main()
        CTRL_C["ending"] = True  # what is left is the interpreter's exit: a Ctrl-C there would only add a traceback
        sys.exit(code)
    except kit.arguments.ArgumentError as exc:  # the line itself: argparse's usage-error status
        if (os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0").strip() in ("0", ""):
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Quiet:
        sys.exit(1)
    except StopBeforeTraining as exc:  # a stop signal during a first --model measurement: at once, within KillWait
        if is_rank0():
            print(f"{prog}: stopped: {exc.signal_name} while {exc.doing}, before any training: nothing to save; exit "
                  "75 (the templates requeue it; the measurement is taken again)", file=sys.stderr, flush=True)
        sys.exit(75)
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

"""The trainers' errors and how a task ends on one: RunError (a verdict every task reaches, said by task 0),
TaskError and LostContact (said by the task that meets it), Quiet; log() from rank 0; cli() runs a trainer's main().
Owns: the exit statuses (1, 2, 75 via StopRequest, 130). Imports: idr_torch, kit.arguments, kit.train.signals.
"""
from __future__ import annotations

import sys
from typing import Callable

import idr_torch
import kit.arguments
from kit.train.signals import HELD, StopBeforeTraining


class RunError(Exception):
    """A user-facing error: one line that names the value and the fix. Every task reaches the same verdict (the
    arguments, the plan, a verdict gathered by agree()): task 0 says it."""


class TaskError(RunError):
    """This task's own error, or its report of another task's: the task that raises it says it."""


class LostContact(TaskError):
    """A collective failed: each surviving task says so (rank 0 may be the one that died)."""


class Quiet(RunError):
    """Another task says why every task stops: this one exits 1 without a line."""


def log(*msg: object) -> None:
    """Print from rank 0 only (Slurm merges every task's stdout into one file)."""
    if idr_torch.rank == 0:
        print(*msg, flush=True)


def cli(main: Callable[[], int], prog: str) -> None:
    """Run a trainer's main(). A user error is one line: a verdict every task reaches is said by task 0, a task's
    own error (TaskError, LaunchError) by that task; Quiet ones exit 1 without a line. Before the launch is read
    whole (an argument error) or where it could not be (a LaunchError), the rank is the launcher variable's own
    (idr_torch.env_rank; a malformed one is the LaunchError being reported)."""
    first = idr_torch.env_rank() in (0, None)
    try:
        code = main()
        HELD.end()  # what is left is the interpreter's exit: a Ctrl-C there would only add a traceback
        sys.exit(code)
    except kit.arguments.ArgumentError as exc:  # the line itself: argparse's usage-error status
        if first:
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Quiet:
        sys.exit(1)
    except StopBeforeTraining as exc:  # a stop signal during a first --model measurement: at once, within KillWait
        if first:
            print(f"{prog}: stopped: {exc.signal_name} while {exc.doing}, before any training: nothing to save; exit "
                  "75 (the templates requeue it; the measurement is taken again)", file=sys.stderr, flush=True)
        sys.exit(75)
    except KeyboardInterrupt:  # Ctrl-C twice (hold_signal): at once, one line, the shell's status for SIGINT
        if first:
            print(f"{prog}: interrupted (Ctrl-C twice): stopped at once, without a checkpoint of this point; "
                  "--resume goes on from the last one --save wrote", file=sys.stderr, flush=True)
        sys.exit(130)
    except (RunError, idr_torch.LaunchError) as exc:
        if first or isinstance(exc, (idr_torch.LaunchError, TaskError)):
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)

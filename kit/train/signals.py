"""The job's stop signals and hangs: SIGUSR1 (Slurm's warning before the time limit), SIGTERM (scancel, preemption)
and SIGINT (Ctrl-C) are held from a trainer's first lines and acted on at the next step (kit.train.loop.StopRequest);
a second Ctrl-C stops at once but never inside a save. (A task that makes no progress: kit.train.launch's Watchdog.)
Owns: HELD, what the handler received and where the run stands (the process's one Held), stoppable. Imports: the
standard library only, and little of it: the trainers import it first (idr_torch, for the notice's rank, only when a
Ctrl-C comes).
"""
from __future__ import annotations

import functools
import signal
from collections.abc import Callable


# The stop signals: SIGUSR1 (Slurm's --signal=USR1@seconds before the time limit), SIGTERM (scancel, preemption, the
# time limit itself) and SIGINT (Ctrl-C) each mean "finish the step, checkpoint, exit 75" (StopRequest). They can come
# while torch imports, the data loads or the tasks meet, where their default actions kill the process (exit 138, 143,
# or a KeyboardInterrupt traceback) and the job is not requeued: so each trainer calls hold_stop_signals() in its
# first statements, right after importing this module (which imports only the standard library: 1-2 ms), before
# anything else is imported. What runs before (the interpreter's start, 10-20 ms measured, and the compilation of the
# trainer, 3-22 ms) is out of reach of any Python program; a launcher that blocks them then has them delivered at the
# unblock below, held. Only where a trainer is the program: importers keep their handlers.
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


class Held:
    """What the stop signals' handler has received, and where the run stands for a second Ctrl-C. A signal handler
    is the process's, so there is one (HELD); its state changes only through these methods and the handler."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.pending: list[str] = []  # the signals' names, in order
        self.saving = 0  # the saves under way (interrupts_held)
        self.ending = False  # the stop agreed, or main() returned: nothing left for a second Ctrl-C to cut short
        self.deferred = False  # a second Ctrl-C that waits for a save's end or the next step
        self.stoppable = ""  # what the run is doing where a stop signal ends it at once (stoppable); "": nowhere

    @property
    def first(self) -> str | None:
        """The first stop signal this task received (the reason), or None."""
        return self.pending[0] if self.pending else None

    def end(self, ending: bool = True) -> None:
        """The run is ending (the stop agreed after a step, or main() returned): a second Ctrl-C no longer cuts it."""
        self.ending = ending

    def interrupt_if_deferred(self) -> None:
        """Raise the second Ctrl-C that waited (for a save's end, or out of a __del__), unless the run is ending."""
        if self.deferred and not self.saving and not self.ending:
            self.deferred = False
            raise KeyboardInterrupt


HELD = Held()


class StopBeforeTraining(BaseException):
    """A stop signal during a long piece of start-up before any training (a first measurement of a --model): nothing
    is lost by stopping at once, and waiting for the first step would outlast Slurm's KillWait (30 s by default,
    slurm.conf(5)), after which SIGKILL ends the job without its exit 75. A BaseException: the measurement's own
    `except Exception` (a layer measured otherwise) must not take it."""

    def __init__(self, signal_name: str, doing: str) -> None:
        super().__init__(f"{signal_name} while {doing}")
        self.signal_name, self.doing = signal_name, doing


class stoppable:
    """`with stoppable("measuring --model x.py:f"):` a stop signal inside (or one already pending) raises
    StopBeforeTraining at once; outside, signals wait for the next step as before."""

    def __init__(self, doing: str) -> None:
        self.doing = doing

    def __enter__(self) -> None:
        HELD.stoppable = self.doing
        if HELD.pending:
            HELD.stoppable = ""
            raise StopBeforeTraining(HELD.pending[0], self.doing)

    def __exit__(self, *exc: object) -> None:
        HELD.stoppable = ""


def hold_signal(signum: int, frame: object) -> None:
    """Note a stop signal: StopRequest acts on it at the next step. Ctrl-C a second time stops at once (cli() says
    so in one line), but never inside a save: torch.save turns an exception raised in its writer into a RuntimeError
    about the zip file, which the save's error path took for a full disk, and training went on. Nor inside a
    __del__ (Python prints "Exception ignored in ..." with a traceback, and drops the interrupt): it waits for the
    next step there."""
    name = signal.Signals(signum).name
    again = name == "SIGINT" and "SIGINT" in HELD.pending
    HELD.pending.append(name)
    if HELD.stoppable and not in_finalizer(frame):  # nothing trained yet: at once (stoppable)
        doing, HELD.stoppable = HELD.stoppable, ""
        raise StopBeforeTraining(name, doing)
    if name == "SIGINT" and not again and is_rank0():
        import os  # loaded by the interpreter already; os.write, not print: this may interrupt a print
        os.write(2, b"Ctrl-C: stopping after this step, with a checkpoint where --save is given (exit 75); "
                    b"Ctrl-C again stops at once\n")
    if again:
        if HELD.saving or HELD.ending or in_finalizer(frame):
            HELD.deferred = True
        else:
            raise KeyboardInterrupt


def in_finalizer(frame: object) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def is_rank0() -> bool:
    """This task is rank 0, as idr_torch reads it from the launcher's variables. Imported here, when a Ctrl-C comes,
    not above: the trainers import this module before anything else. Where the signal interrupts idr_torch's own
    import (its names not defined yet), the notice is said."""
    import idr_torch
    try:
        return idr_torch.env_rank() in (0, None)
    except AttributeError:
        return True


def hold_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored stays ignored (Ctrl-C in a background job)
            signal.signal(sig, hold_signal)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def interrupts_held(save: Callable) -> Callable:
    """A save decorated with this is not cut by a second Ctrl-C: the interrupt is raised when the save ends."""
    @functools.wraps(save)
    def held(*args: object, **kwargs: object) -> object:
        HELD.saving += 1
        try:
            return save(*args, **kwargs)
        finally:
            HELD.saving -= 1
            HELD.interrupt_if_deferred()
    return held

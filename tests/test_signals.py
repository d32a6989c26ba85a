"""The job's stop signals: SIGTERM, SIGUSR1 and SIGINT to every process of a run (its DataLoader workers too), in
both layouts; a signal at any moment of start-up; Ctrl-C once, twice, and inside a save."""
from __future__ import annotations

import ast
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from launch import ROOT, clean_env, srun_envs

import kit.train.checkpoint
import kit.train.loop
import kit.train.signals

COMMON = ["--synthetic", "800", "--batch-size", "16", "--nlayers", "2", "--epochs", "2", "--log-every", "0"]
LAYOUTS = {"replica": ("bench_ddp_transformer.py", 1, []),
           "stage": ("bench_stage.py", 2, ["--pp", "2", "--chunks", "2", "--schedule", "gpipe"])}


def group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` (/proc/PID/stat's fifth field)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def start_run(script: str, ntasks: int, args: list[str], logs: list[Path], **popen: object) -> list[subprocess.Popen]:
    """The run's tasks in one new process group, as the processes of a Slurm step, which scancel, a preemption and
    the time limit all signal (the DataLoader workers the tasks fork join it)."""
    envs = srun_envs(ntasks) if ntasks > 1 else [clean_env()]
    procs: list[subprocess.Popen] = []
    for env, log in zip(envs, logs):
        group = {"process_group": procs[0].pid if procs else 0}  # one group, in this session (setpgid)
        procs.append(subprocess.Popen([sys.executable, str(ROOT / script), *args], env=env, stdout=open(log, "w"),
                                      stderr=subprocess.STDOUT, **group, **popen))
    return procs


def wait_for(log: Path, text: str, procs: list[subprocess.Popen], limit: float = 180) -> None:
    deadline = time.monotonic() + limit
    while text not in log.read_text():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), log.read_text()[-3000:]
        time.sleep(0.05)


def ended(procs: list[subprocess.Popen], limit: float = 120) -> list[int]:
    try:
        return [p.wait(timeout=limit) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(os.getpgid(p.pid), signal.SIGKILL)


# ---- every process of the run signalled, workers included: the checkpoint and exit 75 --------------------------------
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT], ids=lambda s: s.name)
def test_signal_to_the_process_group_with_workers(tmp_path, layout, sig):
    """Before, SIGTERM killed the DataLoader workers (torch's worker handler dies on a SIGTERM not sent by its
    parent) and the trainer died on "DataLoader worker (pid ...) is killed by signal: Terminated", rc 1, no
    checkpoint; SIGINT ended in a KeyboardInterrupt traceback. Now each stops as SIGUSR1 did: checkpoint, 75."""
    script, ntasks, extra = LAYOUTS[layout]
    ckpt = tmp_path / "ck.pt"
    logs = [tmp_path / f"rank{r}.log" for r in range(ntasks)]
    procs = start_run(script, ntasks, [*COMMON, *extra, "--workers", "2", "--cache-dir", str(tmp_path),
                                       "--save", str(ckpt)], logs)
    try:
        wait_for(logs[0], "epoch 1 step 2/", procs)  # the workers serve the steps: they exist
        assert len(group_members(procs[0].pid)) >= ntasks * 3, "the workers were not started"
        os.killpg(procs[0].pid, sig)
    finally:
        codes = ended(procs)
    text = [log.read_text() for log in logs]
    assert codes == [75] * ntasks, text[0][-3000:] + text[-1][-3000:]
    assert f"stopping on {sig.name} at epoch 1" in text[0] and f"checkpoint saved to {ckpt}" in text[0], text[0]
    assert not any("Traceback" in t or "killed by signal" in t for t in text), text
    assert kit.train.checkpoint.resume_file(ckpt).exists()


# ---- a stop signal at any moment of start-up -------------------------------------------------------------------
def held_from(script: str) -> int:
    """The line of `script` that installs the stop signals' handler; every statement before it imports only signal,
    sys and kit.train.signals (the standard library only: tests/test_house.py), or is the docstring or
    `from __future__`."""
    tree = ast.parse((ROOT / script).read_text())
    for node in tree.body:
        if "signal.signal(" in ast.unparse(node) or "hold_stop_signals()" in ast.unparse(node):
            return node.lineno
        for inner in ast.walk(node):
            if isinstance(inner, ast.Import):
                assert {a.name for a in inner.names} <= {"signal", "sys"}, (script, inner.lineno, ast.unparse(inner))
            elif isinstance(inner, ast.ImportFrom):
                assert inner.module in ("__future__", "kit.train.signals"), (script, inner.lineno, ast.unparse(inner))
        assert isinstance(node, (ast.Expr, ast.Import, ast.ImportFrom, ast.Try)), (script, node.lineno)
    raise AssertionError(f"{script} never installs a handler for the stop signals at its top level")


@pytest.mark.parametrize("script", ["bench_ddp_transformer.py", "bench_stage.py"])
def test_stop_signals_are_held_before_any_import(script):
    """bench_stage.py held them only once bench_ddp_transformer was imported (compiled: 2,000 lines, 30-60 ms)."""
    held_from(script)


def blocked_at_exec(*sigs: signal.Signals) -> None:
    """preexec_fn: the child starts with `sigs` blocked, as a launcher can hold them over the interpreter's own
    start, before any line of the program runs."""
    signal.pthread_sigmask(signal.SIG_BLOCK, set(sigs))


@pytest.mark.parametrize("delay_ms", [0, 20, 100])
def test_sigusr1_at_a_fixed_moment_of_startup_stops_cleanly(tmp_path, delay_ms):
    """SIGUSR1 from 0 ms after the start on: a signal that came before the program's first line (held blocked by
    the launcher) is delivered there and held like any other: the run checkpoints after its first step and exits
    75, never 138. Before, the trainer never unblocked it and trained to the end, deaf to the time limit."""
    ckpt = tmp_path / "early.pt"
    log = tmp_path / "out.log"
    [p] = start_run("bench_ddp_transformer.py", 1, [*COMMON, "--cache-dir", str(tmp_path), "--save", str(ckpt)], [log],
                    preexec_fn=lambda: blocked_at_exec(signal.SIGUSR1))
    try:
        time.sleep(delay_ms / 1000)
        p.send_signal(signal.SIGUSR1)
    finally:
        [code] = ended([p], limit=240)
    out = log.read_text()
    assert code == 75, (code, out[-3000:])
    assert "stopping on SIGUSR1 at epoch 1, batch 1/" in out and "checkpoint saved to" in out, out


@pytest.mark.multiproc
def test_bench_stage_stops_on_a_signal_sent_at_its_start(tmp_path):
    """The stage layout, 2 tasks, each sent SIGTERM at once (0 ms): both checkpoint after step 1 and exit 75."""
    ckpt = tmp_path / "early.pt"
    script, ntasks, extra = LAYOUTS["stage"]
    logs = [tmp_path / f"rank{r}.log" for r in range(ntasks)]
    procs = start_run(script, ntasks, [*COMMON, *extra, "--cache-dir", str(tmp_path), "--save", str(ckpt)], logs,
                      preexec_fn=lambda: blocked_at_exec(signal.SIGTERM))
    try:
        for p in procs:
            p.send_signal(signal.SIGTERM)
    finally:
        codes = ended(procs, limit=240)
    out = logs[0].read_text()
    assert codes == [75, 75], out[-3000:] + logs[1].read_text()[-3000:]
    assert "stopping on SIGTERM at epoch 1, batch 1/" in out and "checkpoint saved to" in out, out


# ---- Ctrl-C: once, a stop with the checkpoint (above); twice, at once; never swallowed by a save ---------------
@pytest.fixture
def holding():
    """hold_signal as this process's handler of the stop signals, as the trainer has it; put back afterwards."""
    before = {sig: signal.getsignal(sig) for sig in kit.train.signals.STOP_SIGNALS}
    kit.train.signals.hold_stop_signals()
    kit.train.signals.HELD.reset()
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        kit.train.signals.HELD.reset()


class CtrlC:
    """Pickled by torch.save: the process gets SIGINT in the middle of the save (its handler runs right there)."""

    def __reduce__(self) -> tuple:
        os.kill(os.getpid(), signal.SIGINT)
        return (int, (7,))


def test_ctrl_c_twice_stops_at_once(holding):
    kit.train.signals.hold_signal(signal.SIGINT, None)  # the first: held, acted on at the next step
    assert kit.train.signals.HELD.pending == ["SIGINT"]
    with pytest.raises(KeyboardInterrupt):
        kit.train.signals.hold_signal(signal.SIGINT, None)


class Finalized:
    def __del__(self) -> None:  # Ctrl-C while Python runs a finalizer
        kit.train.signals.hold_signal(signal.SIGINT, sys._getframe())


def test_ctrl_c_twice_in_a_finalizer_waits_for_the_next_step(holding):
    """Raised inside a __del__, the interrupt would be a traceback ("Exception ignored in ...", seen when the
    DataLoader's iterator shut its workers down) and lost: it waits for the next step instead."""
    kit.train.signals.HELD.pending.append("SIGINT")
    Finalized()
    assert kit.train.signals.HELD.deferred
    with pytest.raises(KeyboardInterrupt):
        kit.train.loop.StopRequest().agreed(1)


def test_ctrl_c_twice_once_the_stop_is_agreed_lets_the_checkpoint_be(holding):
    """The stop is under way (its checkpoint comes next): a second Ctrl-C no longer cuts it short."""
    kit.train.signals.HELD.pending.append("SIGINT")
    assert kit.train.loop.StopRequest().agreed(1)
    kit.train.signals.hold_signal(signal.SIGINT, None)
    assert kit.train.signals.HELD.pending == ["SIGINT", "SIGINT"]


def test_ctrl_c_inside_a_save_waits_for_the_whole_pair(holding, tmp_path):
    """The second Ctrl-C comes while torch.save writes: before, the KeyboardInterrupt raised inside torch.save came
    out as a RuntimeError about the zip file ("checkpoint not saved", and training went on). Now the save
    finishes, the pair is whole, then the interrupt stops the run."""
    kit.train.signals.HELD.pending.append("SIGINT")
    target = tmp_path / "ck.pt"
    weights = {"w": torch.arange(6.0)}
    with pytest.raises(KeyboardInterrupt):
        kit.train.checkpoint.save_checkpoint(str(target), weights, {"epoch": 1, "during": CtrlC()})
    assert kit.train.signals.HELD.pending == ["SIGINT", "SIGINT"]
    torch.testing.assert_close(torch.load(target), weights)
    companion = torch.load(kit.train.checkpoint.resume_file(target), weights_only=False)
    assert companion["during"] == 7 and companion["model_sha256"] == kit.train.checkpoint.file_digest(target)


def test_ctrl_c_once_during_a_save_is_held(holding, tmp_path):
    """A first Ctrl-C inside a save is only noted: the save is whole, the stop comes at the next step."""
    target = tmp_path / "ck.pt"
    kit.train.checkpoint.save_checkpoint(str(target), {"w": torch.ones(2)}, {"during": CtrlC()})
    assert kit.train.signals.HELD.pending == ["SIGINT"] and torch.load(kit.train.checkpoint.resume_file(target),
                                                                          weights_only=False)["during"] == 7


def test_ctrl_c_twice_on_a_run_is_one_line(tmp_path):
    """A terminal's Ctrl-C twice during training (SIGINT to the whole foreground group, workers included): the
    second stops at once with one line and 130, or, where the run was already stopping, it ends with its
    checkpoint and 75. Never a traceback."""
    ckpt = tmp_path / "ck.pt"
    log = tmp_path / "out.log"
    [p] = start_run("bench_ddp_transformer.py", 1, [*COMMON, "--workers", "2", "--cache-dir", str(tmp_path),
                                                    "--save", str(ckpt)], [log])
    try:
        wait_for(log, "epoch 1 step 2/", [p])
        os.killpg(p.pid, signal.SIGINT)
        wait_for(log, "Ctrl-C again stops at once", [p])
        with contextlib.suppress(ProcessLookupError):  # it may have stopped already: that outcome is checked below
            os.killpg(p.pid, signal.SIGINT)
    finally:
        [code] = ended([p])
    out = log.read_text()
    assert "Traceback" not in out and "killed by signal" not in out, out[-3000:]
    if code == 130:
        assert out.rstrip().endswith("bench_ddp_transformer: interrupted (Ctrl-C twice): stopped at once, without "
                                     "a checkpoint of this point; --resume goes on from the last one --save wrote")
    else:
        assert code == 75 and "stopping on SIGINT at epoch 1" in out, (code, out[-3000:])

"""The checkpoint pair against faults: a kill at each step of a save, a full disk, two writers, bad output paths,
the user's umask, and files that would run code when loaded. The trainer's own code, real processes, real
SIGKILLs, a real tmpfs that fills up."""
from __future__ import annotations

import io
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from launch import ROOT, bench, clean_env, mounted_tmpfs
from local_slurm import free_port

import idr_torch
import kit.arguments
import kit.train.checkpoint
import kit.train.errors
import kit.train.launch
import kit.train.setup

SMALL = ["--synthetic", "300", "--nlayers", "2", "--batch-size", "32"]


@pytest.fixture(scope="session")
def one_epoch(tmp_path_factory) -> Path:
    """A folder holding what one epoch of SMALL leaves with --save ckpt.pt: the pair and the tokenised cache."""
    folder = tmp_path_factory.mktemp("one_epoch")
    [r] = bench([*SMALL, "--epochs", "1", "--cache-dir", str(folder), "--save", str(folder / "ckpt.pt")])
    assert r.returncode == 0, r.stderr[-2000:]
    return folder


def copy_of(one_epoch: Path, tmp_path: Path) -> Path:
    """The one-epoch pair and cache, copied into tmp_path (byte for byte: the companion's digest still matches);
    returns the copied checkpoint's path."""
    for f in one_epoch.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    return tmp_path / "ckpt.pt"


def one_error(result: subprocess.CompletedProcess) -> str:
    """The run failed with exactly one error line and no traceback; returns that line."""
    lines = [line for line in result.stderr.splitlines() if line.strip() and "idr_torch:" not in line]
    assert result.returncode == 1 and len(lines) == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert lines[0].startswith(("bench_ddp_transformer: error:", "bench_stage: error:")), lines
    return lines[0]


# ---- a kill at each step of a save: the next reader finds a whole pair, old or new -----------------------------------
def small_cfg():
    cfg = kit.arguments.parse_trainer_args("replica", ["--nlayers", "2"])
    kit.train.setup.resolve(cfg, False)
    return cfg


def pair(version: int) -> tuple[dict, dict]:
    """A model file's state and its companion, both marked with `version` (the companion as save_progress
    writes it: optimizer, RNG states, layout)."""
    model = {"w": torch.full((256, 1024), float(version)), "b": torch.arange(8.0) + version}
    resume = {"format": kit.train.checkpoint.RESUME_FORMAT,
              "optimizer": {"state": {0: {"step": torch.tensor(float(version))}},
                                                       "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999),
                                                                         "params": [0]}]},
              "epoch": version, "batch_in_epoch": 0, "step": 10 * version, "layout": kit.train.checkpoint.layout_of(small_cfg(), 2),
              "engine": "fairscale", "rng": kit.train.checkpoint.rng_states(kit.train.launch.Tasks(idr_torch.current())),
              "args": {"lr": 1e-3}}
    return model, resume


def read_pair(path: Path) -> int:
    """What a resuming run reads: the model file and the companion that goes with it; their versions agree."""
    model, state = kit.train.checkpoint.read_model(str(path)), kit.train.checkpoint.read_resume(str(path),
                                                                                                small_cfg(), 2)
    assert state is not None and model["w"][0, 0].item() == state["epoch"], (model["w"][0, 0], state["epoch"])
    return state["epoch"]


def save_killed_at(path: Path, kill_at: int) -> tuple[list[str], int]:
    """The second save, pair(2), in a forked child that goes through every step of the save as an event (each
    write, before its first byte and half-way through its bytes; each fsync; each rename) and SIGKILLs itself at
    event `kill_at` (-1: never). Returns the events it reached and its wait status."""
    model, resume = pair(2)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing here returns to pytest
        try:
            os.close(read_end)
            count = [0]

            def event(name: str) -> None:
                name = re.sub(r"\.[0-9a-f]{8}\.tmp", ".<random>.tmp", name)  # the same name in every run
                os.write(write_end, (name + "\n").encode())
                count[0] += 1
                if count[0] - 1 == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

            real_save, real_fsync, real_replace = torch.save, os.fsync, os.replace

            def save(obj, f) -> None:
                buf = io.BytesIO()
                real_save(obj, buf)
                data, name = buf.getvalue(), Path(os.readlink(f"/proc/self/fd/{f.fileno()}")).name
                event(f"write {name}")
                f.write(data[: len(data) // 2])
                f.flush()
                event(f"half-written {name}")
                f.write(data[len(data) // 2:])

            def fsync(fd: int) -> None:
                event("fsync")
                real_fsync(fd)

            def replace(src, dst) -> None:
                event(f"rename {Path(src).name} -> {Path(dst).name}")
                real_replace(src, dst)

            torch.save, os.fsync, os.replace = save, fsync, replace
            kit.train.checkpoint.save_checkpoint(str(path), model, resume)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        events = f.read().splitlines()
    return events, os.waitpid(pid, 0)[1]


@pytest.mark.core
def test_kill_at_each_step_of_the_save_leaves_a_whole_pair(tmp_path):
    """The second save of a pair is killed (SIGKILL) at each of its steps in turn: every write (before its first
    byte and half-way), every fsync, every rename. Each time, what a resuming run reads is a whole pair, the old
    one (killed before the commit) or the new one (after it); the next save leaves exactly the pair, no temporary
    or staged file."""
    path = tmp_path / "ckpt.pt"

    def fresh() -> None:  # the first pair, alone in the folder
        for p in tmp_path.iterdir():
            p.unlink()
        kit.train.checkpoint.save_checkpoint(str(path), *pair(1))

    fresh()
    events, status = save_killed_at(path, -1)
    assert os.WIFEXITED(status) and read_pair(path) == 2
    assert sum(e.startswith("rename") for e in events) == 3 and events.count("fsync") >= 5, events
    seen = []
    for kill_at, name in enumerate(events):
        fresh()
        reached, status = save_killed_at(path, kill_at)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL and reached[-1] == name, reached
        seen.append((name, read_pair(path)))
        kit.train.checkpoint.save_checkpoint(str(path), *pair(3))  # the next save settles what the killed one left
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "ckpt.pt.resume.pt"], (name, kill_at)
        assert read_pair(path) == 3
    # the old pair until the model file's rename (the commit), the new one from then on
    commit = next(i for i, e in enumerate(events) if e.startswith("rename .ckpt.pt.") and e.endswith("-> ckpt.pt"))
    assert [v for _, v in seen] == [1] * (commit + 1) + [2] * (len(events) - commit - 1), seen


def test_the_next_save_removes_only_its_own_leftovers(tmp_path):
    path = tmp_path / "ckpt.pt"
    kit.train.checkpoint.save_checkpoint(str(path), *pair(1))
    stale = [tmp_path / ".ckpt.pt.0badc0de.tmp", tmp_path / ".ckpt.pt.resume.pt.12345678.tmp"]
    others = [tmp_path / ".ckpt.pt.old.12345678.tmp", tmp_path / ".other.pt.0badc0de.tmp", tmp_path / "notes.txt"]
    for p in stale + others:
        p.write_bytes(b"x")
    torch.save({"format": kit.train.checkpoint.RESUME_FORMAT, "model_sha256": "0" * 64},
               kit.train.checkpoint.staged_file(path))  # a save killed early
    kit.train.checkpoint.save_checkpoint(str(path), *pair(2))
    assert not any(p.exists() for p in stale) and not kit.train.checkpoint.staged_file(path).exists()
    assert all(p.exists() for p in others)
    assert read_pair(path) == 2


# ---- a full disk: the failed save is one line, the previous pair stays whole -----------------------------------------
def small_disk(where: Path, size_kib: int):
    """A tmpfs of `size_kib` KiB mounted at `where` (launch.mounted_tmpfs: root, as CI)."""
    return mounted_tmpfs(where, f"size={size_kib}k")


@pytest.mark.parametrize("fails_at", ["model file", "companion"])
def test_full_disk_keeps_the_previous_pair(tmp_path, fails_at):
    """The disk fills during the second epoch's save: one line says the previous checkpoint is kept, training
    goes on to its end, which says that the checkpoint is the previous one and exits 1 (it ended 0 as if the
    checkpoint were current); nothing half-written is left, and --resume continues from the previous pair."""
    args = [*SMALL, "--cache-dir", str(tmp_path), "--json-out", str(tmp_path / "runs.jsonl")]
    # one pair is about 0.8 MB (model) + 1.7 MB (companion); a save needs room for a second pair's files
    size = {"model file": 2900, "companion": 4000}[fails_at]
    with small_disk(tmp_path / "disk", size) as disk:
        ckpt = disk / "ckpt.pt"
        [r] = bench([*args, "--epochs", "2", "--save", str(ckpt)])
        assert r.returncode == 1, r.stderr[-3000:]
        errors = [line for line in r.stderr.splitlines() if "error:" in line]
        written = ckpt if fails_at == "model file" else kit.train.checkpoint.resume_file(ckpt)
        failure = f"epoch 2, step 18: No space left on device ({written})"
        assert len(errors) == 2 and (f"checkpoint not saved (epoch 2, step 18): No space left on device ({written})"
                                     in errors[0]), errors
        assert f"the previous checkpoint {ckpt} (with its ckpt.pt.resume.pt) is kept" in errors[0], errors
        assert errors[1] == (f"bench_ddp_transformer: error: training ended, but the last checkpoint was not saved "
                             f"({failure}): {ckpt} holds epoch 1, step 9, not where this run ended; free space there "
                             "(or give another --save) and run again with --resume to train the rest again"), errors
        assert "epoch   2 |" in r.stdout and len((tmp_path / "runs.jsonl").read_text().splitlines()) == 1
        assert r.stdout.count("checkpoint saved:") == 1 and "Traceback" not in r.stderr
        assert sorted(p.name for p in disk.iterdir()) == ["ckpt.pt", "ckpt.pt.resume.pt"]
        cfg = kit.arguments.parse_trainer_args("replica", SMALL)
        kit.train.setup.resolve(cfg, False)
        state = kit.train.checkpoint.read_resume(str(ckpt), cfg, 2)
        assert (state["epoch"], state["step"]) == (1, 9)
        # what the last line says to do: free space (here: a bigger disk), run again with --resume
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
        [again] = bench([*args, "--epochs", "2", "--save", str(ckpt), "--resume"])
        assert again.returncode == 0 and f"loaded {ckpt}: epoch 1, step 9" in again.stdout, again.stderr[-2000:]
        assert (kit.train.checkpoint.read_resume(str(ckpt), cfg, 2)["epoch"], "error:" in again.stderr) == (2, False)


# ---- a job stopped by SIGTERM, then SIGKILL 0.3 s later (a grace period shorter than the save) -----------------------
@pytest.mark.multiproc
def test_sigterm_then_sigkill_during_a_save_then_resume(tmp_path):
    """A model big enough that a save takes a while; SIGTERM starts the stop-and-checkpoint, SIGKILL lands 0.3 s
    later, during it or just after. The requeued --resume run starts from a whole pair, whichever it is."""
    ckpt = tmp_path / "big.pt"
    args = ["--synthetic", "200", "--batch-size", "8", "--nlayers", "4", "--d-model", "256", "--d-hid", "2048",
            "--cache-dir", str(tmp_path), "--save", str(ckpt), "--epochs", "3", "--log-every", "0"]
    log = tmp_path / "run.log"
    p = subprocess.Popen([sys.executable, str(ROOT / "bench_ddp_transformer.py"), *args], env=clean_env(),
                         stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "checkpoint saved: " not in log.read_text():  # one pair exists; the job is training epoch 2
            assert time.monotonic() < deadline and p.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        p.kill()
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    cfg = kit.arguments.parse_trainer_args("replica", args)
    kit.train.setup.resolve(cfg, False)
    state = kit.train.checkpoint.read_resume(str(ckpt), cfg, 2)  # whole: the digest of the model file matches
    assert state is not None and state["epoch"] >= 1, log.read_text()[-2000:]
    [r] = bench(args[:-4] + ["--epochs", "2", "--resume", "--log-every", "30"], timeout=240)
    assert r.returncode == 0 and f"loaded {ckpt}: epoch" in r.stdout, r.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("*big.pt*")) == ["big.pt", "big.pt.resume.pt"]


# ---- two runs, one --save: the second is refused, naming the first ---------------------------------------------------
def test_second_writer_is_refused_and_a_killed_writer_leaves_no_lock(tmp_path):
    ckpt = tmp_path / "shared.pt"
    args = [*SMALL, "--cache-dir", str(tmp_path), "--save", str(ckpt)]
    # a batch script's python without srun, inside job 4242 (the port would be derived from the job id)
    env = clean_env(SLURM_JOB_ID="4242", SLURM_JOB_NAME="hybrid_3x4", MASTER_PORT=str(free_port()))
    log = tmp_path / "first.log"
    first = subprocess.Popen([sys.executable, str(ROOT / "bench_ddp_transformer.py"), *args, "--epochs", "100"],
                             env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "model:" not in log.read_text():
            assert time.monotonic() < deadline and first.poll() is None, log.read_text()
            time.sleep(0.1)
        [second] = bench([*args, "--epochs", "1"])
        line = one_error(second)
        assert (f"--save {ckpt} is being written by another run: job 4242 (hybrid_3x4) on host {os.uname().nodename}, "
                f"PID {first.pid}, since ") in line, line
        assert "give this one another --save" in line
    finally:
        first.kill()
        first.wait()
    assert kit.train.checkpoint.lock_file(ckpt).exists()  # a killed holder cannot remove it, but the kernel released its lock
    [third] = bench([*args, "--epochs", "1"])
    assert third.returncode == 0, third.stderr[-2000:]
    assert not kit.train.checkpoint.lock_file(ckpt).exists()  # removed at a clean exit


def test_lock_holder_details_and_release(tmp_path):
    ckpt = tmp_path / "x.pt"
    lock = kit.train.checkpoint.SaveLock.take(str(ckpt))  # (reading the file here would release it: POSIX locks are per process)
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import kit.train.checkpoint; "
            f"kit.train.checkpoint.SaveLock.take({str(ckpt)!r})")
    r = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert "is being written by another run" in r.stderr and f"PID {os.getpid()}" in r.stderr, r.stderr
    lock.release()
    assert not kit.train.checkpoint.lock_file(ckpt).exists()
    r = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


# ---- every output path checked before training -----------------------------------------------------------------------
def outputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    (tmp_path / "folder.pt").mkdir()
    (tmp_path / "taken.pt.resume.pt").mkdir()
    os.mkfifo(tmp_path / "fifo.pt")
    return {
        "save is a folder": (["--save", str(tmp_path / "folder.pt")], f"{tmp_path / 'folder.pt'} is a folder"),
        "save is /dev/null": (["--save", "/dev/null"], "/dev/null is a character device, not a regular file"),
        "save is a fifo": (["--save", str(tmp_path / "fifo.pt")], "is a pipe (FIFO), not a regular file"),
        "companion is a folder": (["--save", str(tmp_path / "taken.pt")], "taken.pt.resume.pt is a folder"),
        "save in a missing folder": (["--save", str(tmp_path / "no" / "x.pt")], f"folder {tmp_path / 'no'} does not"),
        "json-out in a missing folder": (["--json-out", str(tmp_path / "no" / "r.jsonl")],
                                         f"--json-out {tmp_path / 'no' / 'r.jsonl'}: folder {tmp_path / 'no'} "
                                         "does not"),
        "json-out is a folder": (["--json-out", str(tmp_path / "folder.pt")], "is a folder"),
        "save is json-out": (["--save", str(tmp_path / "a.pt"), "--json-out", str(tmp_path / "a.pt")],
                             "--save and --json-out are both"),
    }


CASES = ["save is a folder", "save is /dev/null", "save is a fifo", "companion is a folder", "save in a missing folder",
         "json-out in a missing folder", "json-out is a folder", "save is json-out"]


@pytest.mark.parametrize("case", CASES)
def test_output_paths_are_checked(tmp_path, case):
    args, needle = outputs(tmp_path)[case]
    cfg = kit.arguments.parse_trainer_args("replica", args)
    with pytest.raises(kit.train.errors.RunError, match=re.escape(needle)):
        kit.train.checkpoint.check_outputs(cfg)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize("case", ["save is /dev/null", "json-out in a missing folder"])
def test_output_paths_are_checked_before_training(tmp_path, case):
    """The trainer itself: one line, before any training, nothing written (not even the cache). As root,
    --save /dev/null used to replace /dev/null."""
    args, needle = outputs(tmp_path)[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    [r] = bench([*SMALL, "--cache-dir", str(tmp_path / "cache"), *args], timeout=120)
    assert needle in one_error(r)
    assert "epoch" not in r.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize("umask", [0o002, 0o027])
def test_checkpoints_get_the_users_umask(tmp_path, umask):
    ckpt = tmp_path / "team.pt"
    r = subprocess.run([sys.executable, str(ROOT / "bench_ddp_transformer.py"), *SMALL, "--epochs", "1",
                        "--cache-dir", str(tmp_path), "--save", str(ckpt)], env=clean_env(), capture_output=True,
                       text=True, timeout=240, preexec_fn=lambda: os.umask(umask))
    assert r.returncode == 0, r.stderr[-2000:]
    for f in (ckpt, kit.train.checkpoint.resume_file(ckpt), *tmp_path.glob("synthetic-*.pt")):
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, (f, oct(f.stat().st_mode))


# ---- nothing the kit loads can run code ------------------------------------------------------------------------------
class Payload:
    """Unpickled, it runs a shell command: what a poisoned checkpoint carries."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("poisoned", ["model file", pytest.param("companion", marks=pytest.mark.core),
                                      "staged companion", "cache"])
def test_a_poisoned_file_never_runs(tmp_path, one_epoch, poisoned):
    """A pickled os.system call in each file the kit loads: the run refuses it (or, for the cache and a staged
    companion, rebuilds or drops it) and the payload never runs."""
    marker = tmp_path / "PWNED"
    ckpt = copy_of(one_epoch, tmp_path)
    common = [*SMALL, "--epochs", "1", "--cache-dir", str(tmp_path)]
    good = torch.load(ckpt)
    assert isinstance(Payload(marker).__reduce__()[0], type(os.system))
    if poisoned == "model file":
        torch.save({**good, "evil": Payload(marker)}, ckpt)
        [r] = bench([*common, "--load", str(ckpt)])
        assert "could run code when loaded: refused" in one_error(r)
    elif poisoned == "companion":
        state = torch.load(kit.train.checkpoint.resume_file(ckpt), weights_only=True)
        torch.save({**state, "evil": Payload(marker)}, kit.train.checkpoint.resume_file(ckpt))
        [r] = bench([*common, "--load", str(ckpt)])
        line = one_error(r)
        assert "ckpt.pt.resume.pt is unreadable" in line and "could run code" in line, line
    elif poisoned == "staged companion":  # what a save killed after its commit leaves, read by the next save
        state = torch.load(kit.train.checkpoint.resume_file(ckpt), weights_only=True)
        torch.save({**state, "evil": Payload(marker)}, kit.train.checkpoint.staged_file(ckpt))
        [r] = bench([*common, "--epochs", "2", "--save", str(ckpt), "--resume"])
        assert r.returncode == 0 and not kit.train.checkpoint.staged_file(ckpt).exists(), r.stderr[-2000:]
    else:
        [cache] = tmp_path.glob("synthetic-*.pt")
        torch.save({**torch.load(cache), "evil": Payload(marker)}, cache)
        [r] = bench(common)
        assert r.returncode == 0 and "is unreadable (it holds Python objects" in r.stdout, r.stdout + r.stderr
        assert "tokenised" in r.stdout  # rebuilt
    time.sleep(0.2)
    assert not marker.exists(), "the payload ran"
    if poisoned in ("model file", "companion"):  # and the payload is real: an unsafe load of the file runs it
        torch.load(ckpt if poisoned == "model file" else kit.train.checkpoint.resume_file(ckpt), weights_only=False)
        assert marker.exists()


@pytest.mark.core
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_resume_reads_the_companion_weights_only(tmp_path, precision):
    """What a resumed run reads, weights-only, on every release: optimizer state, every rank's RNG states, and
    (fp16) the GradScaler's state."""
    ckpt = tmp_path / "ckpt.pt"
    # a narrow model: fp16 on the CPU runs emulated and slowly in some releases (2.4.1: 100 s at SMALL's width)
    common = [*SMALL, "--d-model", "16", "--n-head", "2", "--d-hid", "32", "--seq-len", "16", "--cache-dir",
              str(tmp_path), "--save", str(ckpt), "--precision", precision]
    first = bench([*common, "--epochs", "1"])[0]
    assert first.returncode == 0, first.stderr[-2000:]
    state = torch.load(kit.train.checkpoint.resume_file(ckpt), weights_only=True)
    assert ("grad_scaler" in state["optimizer"]) == (precision == "fp16")
    assert isinstance(state["rng"][0]["python"], tuple)  # random.setstate wants the tuple back
    [r] = bench([*common, "--epochs", "2", "--resume"])
    assert r.returncode == 0 and f"loaded {ckpt}: epoch 1, step 9" in r.stdout, r.stderr[-2000:]

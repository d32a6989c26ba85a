"""The trainer's files against round 2 of faults (issue 35): a full disk or quota at start-up on one task or two, a
checkpoint saved through a symbolic link, settings given again on --resume, a record or a last save that fails at
the end, empty paths, damaged companions, FIFOs where files are read, and reviews that would fill the memory. Real
runs, real files, a real tmpfs that the test mounts (as root: CI runs as root)."""
from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from launch import ROOT, bench, clean_env, mounted_tmpfs, run_tasks, srun_envs
from local_slurm import free_port
from test_faults_checkpoint import SMALL, copy_of, one_epoch, one_error, small_disk  # noqa: F401 (a fixture)
from test_train import write_imdb

import kit.train.checkpoint
import kit.train.data
import kit.train.errors
import kit.train.records
import kit.arguments

TRAINER = str(ROOT / "bench_ddp_transformer.py")
HOST = socket.gethostname()


def fill(disk: Path) -> None:
    """Fill a mounted tmpfs to its last block."""
    subprocess.run(["dd", "if=/dev/zero", f"of={disk / 'fill'}", "bs=4k"], capture_output=True)
    assert os.statvfs(disk).f_bavail == 0


# ---- a full disk or quota at start-up: one line on every task, within seconds, nothing left ------------------------
@pytest.mark.multiproc
@pytest.mark.parametrize("ntasks", [1, 2])
def test_a_full_disk_at_startup_ends_every_task_with_one_line(tmp_path, ntasks):
    """The write check's empty probe fitted on a full disk, then the lock's write raised ENOSPC: a traceback, an
    empty lock file left, and with 2 tasks task 1 waited --timeout + 15 s for a task 0 that was gone. Now the probe
    writes bytes, and a task's start-up error reaches the others at the meeting: one line each, at once."""
    with small_disk(tmp_path / "disk", 4096) as disk:
        fill(disk)
        args = [*SMALL, "--epochs", "1", "--cache-dir", str(tmp_path), "--save", str(disk / "ckpt.pt"),
                "--timeout", "300"]
        t0 = time.monotonic()
        results = bench(args, ntasks=ntasks, timeout=150)  # the old task 1 waited 315 s: this fails on it
        took = time.monotonic() - t0
        mine = f"--save {disk / 'ckpt.pt'}: cannot write in {disk} (No space left on device: not even 1 MiB fits)"
        line = one_error(results[0])
        assert mine in line and "free space there" in line, line
        if ntasks == 2:
            assert line.startswith(f"bench_ddp_transformer: error: task 0 on {HOST}: "), line
            assert one_error(results[1]).startswith(f"bench_ddp_transformer: error: task 1 on {HOST}: stopping: task 0 "
                                                    f"on {HOST} failed: {mine}")
        assert sorted(p.name for p in disk.iterdir()) == ["fill"]  # no lock, no probe, nothing half-written
    assert took < 150


def test_a_lock_file_that_cannot_be_written_is_one_line_and_removed(tmp_path):
    """The disk is full when the lock is taken (it filled after the write check): its file is created (an inode
    needs no block) but its holder's line cannot be written. One line, and no lock file left behind."""
    with small_disk(tmp_path / "disk", 4096) as disk:
        fill(disk)
        with pytest.raises(kit.train.errors.RunError) as err:
            kit.train.checkpoint.SaveLock.take(str(disk / "ckpt.pt"))
        assert str(err.value) == (f"--save {disk / 'ckpt.pt'}: cannot write its lock file {disk / 'ckpt.pt.lock'} (No "
                                  "space left on device); the disk or the quota is full: free space there, or choose "
                                  "another --save")
        assert sorted(p.name for p in disk.iterdir()) == ["fill"]


def test_a_lock_file_that_is_a_link_is_not_followed(tmp_path):
    """A link planted as the lock file would have had the run truncate and overwrite what it points to."""
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    (tmp_path / "ckpt.pt.lock").symlink_to(victim)
    with pytest.raises(kit.train.errors.RunError,
                       match=r"cannot open its lock file .*ckpt.pt.lock \(a symbolic link: remove it\)"):
        kit.train.checkpoint.SaveLock.take(str(tmp_path / "ckpt.pt"))
    assert victim.read_text() == "keep me"


FAILING_STARTUP = """
import os, runpy, sys; sys.path.insert(0, {root!r})
import kit.train.data
import kit.train.run
real = kit.train.data.data_source
def data_source(cfg):  # before the tasks meet: an error that is not one of the kit's
    if os.environ["SLURM_PROCID"] == {rank!r}:
        raise OSError(5, "Input/output error", "/gpfs/lost")
    return real(cfg)
kit.train.run.data_source = data_source  # where run() looks it up
sys.argv = ["bench_ddp_transformer.py"] + {args!r}
runpy.run_path({trainer!r}, run_name="__main__")  # the page's script, as `python bench_ddp_transformer.py` runs it
"""


@pytest.mark.multiproc
@pytest.mark.parametrize("rank", ["0", "1"])
def test_any_startup_error_on_one_task_ends_every_task_at_once(tmp_path, rank):
    """An error that is not one of the kit's, before the tasks meet, on either task: it keeps its traceback on its
    task, and every other task ends at the meeting naming it (task 0 dying there left task 1 waiting for
    --timeout + 15 s)."""
    args = [*SMALL, "--cache-dir", str(tmp_path), "--timeout", "300"]
    results = run_tasks(["-c", FAILING_STARTUP.format(root=str(ROOT), rank=rank, args=args, trainer=TRAINER)], srun_envs(2),
                        timeout=150)
    other = 1 - int(rank)
    failed = results[int(rank)]
    assert failed.returncode == 1 and "Traceback" in failed.stderr, failed.stderr[-2000:]
    assert (f"error: task {rank} on {HOST}: OSError: [Errno 5] Input/output error: '/gpfs/lost' (its traceback is "
            "above)") in failed.stderr.splitlines()[-1], failed.stderr[-2000:]
    assert f"task {other} on {HOST}: stopping: task {rank} on {HOST} failed: OSError" in one_error(results[other])


# ---- --save through a symbolic link: everything where the data is --------------------------------------------------
def test_save_and_resume_through_a_symbolic_link(tmp_path):
    """The companion, the staged file and the lock go beside the link's target; --resume through the link
    continues (epoch, optimizer); the link stays a link and its target is what is updated."""
    data = tmp_path / "data"
    data.mkdir()
    real, link = data / "real.pt", tmp_path / "link.pt"
    link.symlink_to(real)  # dangling until the first save
    common = [*SMALL, "--cache-dir", str(tmp_path), "--save", str(link)]
    [first] = bench([*common, "--epochs", "1"])
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"notice: --save {link} is a symbolic link to {real}" in first.stdout
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert sorted(p.name for p in data.iterdir()) == ["real.pt", "real.pt.resume.pt"]
    assert sorted(p.name for p in tmp_path.glob("link.pt*")) == ["link.pt"]
    [again] = bench([*common, "--epochs", "2", "--resume"])
    assert again.returncode == 0 and f"loaded {real}: epoch 1, step 9" in again.stdout, again.stdout + again.stderr
    assert "weights only" not in again.stdout and "epoch   2 |" in again.stdout and "epoch   1 |" not in again.stdout
    assert link.is_symlink() and os.readlink(link) == str(real)
    state = torch.load(kit.train.checkpoint.resume_file(real), weights_only=True)
    assert (state["epoch"], state["step"]) == (2, 18) and state["optimizer"]["state"]


def test_a_run_through_a_link_locks_out_a_run_naming_its_target(tmp_path):
    real, link = tmp_path / "real.pt", tmp_path / "link.pt"
    link.symlink_to(real)
    env = clean_env(SLURM_JOB_ID="4343", SLURM_JOB_NAME="through_link", MASTER_PORT=str(free_port()))
    log = tmp_path / "first.log"
    first = subprocess.Popen([sys.executable, TRAINER, *SMALL, "--cache-dir", str(tmp_path), "--save", str(link),
                              "--epochs", "100"], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "model:" not in log.read_text():
            assert time.monotonic() < deadline and first.poll() is None, log.read_text()
            time.sleep(0.1)
        [second] = bench([*SMALL, "--cache-dir", str(tmp_path), "--save", str(real), "--epochs", "1"])
        line = one_error(second)
        assert f"--save {real} is being written by another run: job 4343 (through_link)" in line, line
    finally:
        first.kill()
        first.wait()
    assert not (tmp_path / "link.pt.lock").exists()


# ---- settings given again on --resume: applied and said, or refused in one line ------------------------------------
def test_every_argument_has_a_resume_rule():
    """A new argument must be decided (its Arg's resume=): applied on resume, refused, part of the layout, the corpus,
    or no setting; an Arg without one is refused when kit.arguments is imported."""
    assert set(kit.arguments.RESUME_RULES) == {"layout", "applied", "refused", "corpus", "none"}
    assert all(a.resume in kit.arguments.RESUME_RULES for a in kit.arguments.ARGS)
    assert all(a.resume == "layout" for a in kit.arguments.ARGS if a.checkpoint)
    with pytest.raises(ValueError, match="--new: resume=''; each argument names its rule"):
        kit.arguments.Arg("--new", int, 1)


@pytest.mark.parametrize("change,needle", [
    (["--seed", "99"], "--seed 99: {ckpt} was saved by a run with --seed 1234, which fixes the order of the data"),
    (["--synthetic", "400"], "--load {ckpt} was trained on another corpus (300 training reviews, vocabulary "),
    (["--nlayers", "3"], "--load {ckpt} was saved with another layout: nlayers 2 (now 3)")])
def test_a_resume_refuses_what_it_cannot_apply(tmp_path, one_epoch, change, needle):
    """The seed (the order of the epoch in progress), the corpus (its vocabulary and place in the epoch), the
    model's shapes: one line naming the saved value, before any training (the seed and the corpus were taken
    silently)."""
    ckpt = copy_of(one_epoch, tmp_path)
    [r] = bench([*SMALL, "--epochs", "2", "--cache-dir", str(tmp_path), "--save", str(ckpt), "--resume", *change])
    line = one_error(r)
    assert needle.format(ckpt=ckpt) in line, line
    assert "epoch   2 |" not in r.stdout


def test_a_resume_applies_and_records_the_settings_it_can(tmp_path, one_epoch):
    """Dropout, batch size, chunks, precision, ZeRO's switch...: this run's values run, the start says which changed,
    and the next companion records them (the record and what runs agree)."""
    ckpt = copy_of(one_epoch, tmp_path)
    change = ["--dropout", "0.2", "--batch-size", "16", "--chunks", "4", "--precision", "bf16", "--epochs", "2"]
    [r] = bench([*SMALL, "--cache-dir", str(tmp_path), "--save", str(ckpt), "--resume", *change])
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("settings changed since the save, applied from this run's first step: --dropout 0.2 (saved 0), "
            "--chunks 4 (saved 2), --batch-size 16 (saved 32), --precision bf16 (saved fp32), --epochs 2 (saved 1)"
            in r.stdout), r.stdout
    assert "precision bf16" in r.stdout and "epoch   2 | steps    18 |" in r.stdout
    saved = torch.load(kit.train.checkpoint.resume_file(ckpt), weights_only=True)["args"]
    assert (saved["dropout"], saved["batch_size"], saved["chunks"], saved["precision"]) == (0.2, 16, 4, "bf16")


# ---- the end of a run: a record or a last save that could not be written -------------------------------------------
def test_a_record_that_cannot_be_written_is_printed_and_the_run_fails(tmp_path):
    """The disk holds the checkpoint, then has no inode left for --json-out: the finished run says so in one line,
    exits 1, and prints its record on stdout (it was a traceback, and the record was lost)."""
    # 3 inodes besides the root: the lock and the pair (the probes are removed before the lock is taken)
    with mounted_tmpfs(tmp_path / "disk", "size=8m,nr_inodes=4") as where:
        [run] = bench([*SMALL, "--epochs", "1", "--cache-dir", str(tmp_path), "--save", str(where / "ckpt.pt"),
                       "--json-out", str(where / "runs.jsonl")])
        line = one_error(run)
        assert (f"the run finished, but its record could not be appended to --json-out {where / 'runs.jsonl'} (No "
                "space left on device") in line, line
        [record] = [json.loads(x) for x in run.stdout.splitlines() if x.startswith('{"time"')]
        assert record["epochs"][0]["epoch"] == 1 and record["tasks"] == 1
        assert sorted(p.name for p in where.iterdir()) == ["ckpt.pt", "ckpt.pt.resume.pt"]


def test_a_record_cut_by_a_full_disk_is_taken_back(tmp_path, capsys):
    """The disk fills in the middle of the record: what was written of it is cut off again, so that the file holds
    whole lines only (a reader of a sweep's runs.jsonl found a cut line), and the record goes to stdout."""
    with small_disk(tmp_path / "disk", 4096) as disk:
        out = disk / "runs.jsonl"
        out.write_text('{"earlier": 1}\n')
        fill(disk)
        cfg = kit.arguments.parse_trainer_args("replica", ["--json-out", str(out)])
        record = {"time": "2025-01-01T00:00:00", "pad": "x" * 20000}
        with pytest.raises(kit.train.errors.RunError, match="the run finished, but its record could not be appended"):
            kit.train.records.write_record(cfg, record)
        assert out.read_text() == '{"earlier": 1}\n'
        assert json.loads(capsys.readouterr().out) == record


# ---- empty paths, damaged companions, FIFOs, reviews too big -------------------------------------------------------
@pytest.mark.parametrize("option", ["--save", "--json-out", "--load", "--data-dir", "--cache-dir"])
def test_an_empty_path_is_refused(option):
    """--save '' and --json-out '' turned saving off without a word; --data-dir '' fell back to synthetic data."""
    with pytest.raises(kit.arguments.ArgumentError,
                       match=f"{option} '' is an empty path; give a file or folder, or leave "
                                               f"{option} out"):
        kit.arguments.parse_trainer_args("replica", [option, ""])


def test_an_empty_save_is_one_line_from_the_trainer_and_the_checker():
    r = subprocess.run([sys.executable, TRAINER, "--save", ""], env=clean_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip().endswith("--save '' is an empty path; give a file or folder, or "
                                                           "leave --save out"), r.stderr
    r = subprocess.run([sys.executable, TRAINER, "--check-args", "--json-out", " "], env=clean_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--json-out ' ' is an empty path" in r.stderr, r.stderr


@pytest.mark.parametrize("field,value,why", [
    ("samples_in_epoch", "many", "'many' is not a count of samples"),
    ("samples_in_epoch", -64, "-64 is not a count of samples"),
    ("samples_in_epoch", 96, "96 samples into an epoch at batch 0"),
    ("rng", [{"torch": torch.zeros(3, dtype=torch.uint8), "python": (3, (1,) * 625, None)}], "rank 0: RuntimeError"),
    ("rng", [{"torch": torch.get_rng_state(), "python": (3, (1, 2), None)}], "rank 0: ValueError"),
    ("rng", ["not a state"], "rank 0: TypeError")])
def test_a_damaged_companion_is_one_line(tmp_path, one_epoch, field, value, why):
    ckpt = copy_of(one_epoch, tmp_path)
    state = torch.load(kit.train.checkpoint.resume_file(ckpt), weights_only=True)
    state[field] = value
    torch.save(state, kit.train.checkpoint.resume_file(ckpt))
    [r] = bench([*SMALL, "--epochs", "2", "--cache-dir", str(tmp_path), "--load", str(ckpt)])
    line = one_error(r)
    assert f"{kit.train.checkpoint.resume_file(ckpt)} has a bad '{field}' field ({why}" in line and "delete it to load" in line, line


def test_an_epoch_covered_by_the_save_is_skipped_not_trained_empty(tmp_path, one_epoch):
    """Saved 8 batches of 32 into an epoch of 9 (--max-steps); resumed with batches of 128, an epoch holds 2, both
    covered by the 256 samples done: the epoch is said to be skipped (it printed "loss 0.0000"), the next trains."""
    ckpt = tmp_path / "ckpt.pt"
    common = [*SMALL, "--cache-dir", str(tmp_path), "--save", str(ckpt)]
    [cut] = bench([*common, "--epochs", "2", "--max-steps", "8"])
    assert cut.returncode == 0 and "(epoch 1 up to batch 8/9, step 8)" in cut.stdout, cut.stdout + cut.stderr
    [r] = bench([*common, "--epochs", "2", "--resume", "--batch-size", "128"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "epoch 1: skipped, its 2 batches of 128 x 1 replica(s) were all trained before the save" in r.stdout
    assert "loss 0.0000" not in r.stdout and "epoch   1 |" not in r.stdout and "epoch   2 | steps     2" in r.stdout


@pytest.mark.parametrize("where", ["--load", "companion", "review"])
def test_a_fifo_is_never_opened(tmp_path, one_epoch, where):
    """A FIFO read before --timeout is armed (and while SIGTERM is held) blocked forever: one line instead."""
    if where == "review":
        imdb = write_imdb(tmp_path / "data", per_class=8)
        fifo = imdb / "train" / "pos" / "99_9.txt"
        os.mkfifo(fifo)
        args = ["--data-dir", str(imdb), "--batch-size", "8", "--nlayers", "2"]
        needle = f"cannot read review {fifo}: a pipe (FIFO), not a regular file; remove it"
    elif where == "--load":
        fifo = tmp_path / "ckpt.pt"
        os.mkfifo(fifo)
        args = [*SMALL, "--load", str(fifo)]
        needle = f"--load {fifo} is a pipe (FIFO), not a regular file"
    else:
        ckpt = copy_of(one_epoch, tmp_path)
        kit.train.checkpoint.resume_file(ckpt).unlink()
        os.mkfifo(kit.train.checkpoint.resume_file(ckpt))
        args = [*SMALL, "--load", str(ckpt)]
        needle = f"{kit.train.checkpoint.resume_file(ckpt)} is unreadable (it is a pipe (FIFO), not a regular file)"
    [r] = bench([*args, "--cache-dir", str(tmp_path / "cache")], timeout=120)  # the old code never ended
    assert needle in one_error(r)


def review_tarball(folder: Path, size: int) -> Path:
    """An aclImdb_v1.tar.gz whose first review is `size` bytes (of one letter: a 100 MB one compresses to 100 kB)."""
    imdb = write_imdb(folder / "src", per_class=4)
    tarball = folder / "aclImdb_v1.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        info = tarfile.TarInfo("aclImdb/train/pos/0_9.txt")
        info.size = size
        tar.addfile(info, io.BytesIO(b"a" * size))
        tar.add(imdb, arcname="aclImdb")
    return tarball


def test_a_huge_review_is_refused_naming_it(tmp_path):
    """A 127 kB tarball holding one 100 MB review peaked at 2.6 GB: a review is read at most to 1 MiB, and one
    bigger is refused in one line naming it."""
    tarball = review_tarball(tmp_path, 100 << 20)
    assert tarball.stat().st_size < 200_000
    with pytest.raises(kit.train.errors.RunError) as err:
        kit.train.data.read_imdb(tarball)
    assert str(err.value).startswith(f"review aclImdb/train/pos/0_9.txt in {tarball} is 104857600 bytes, more than "
                                     "1 MiB: not an IMDB review")
    code = (f"import resource, sys; sys.path.insert(0, {str(ROOT)!r}); import pathlib, kit.train.data, kit.train.errors\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            f"try:\n    kit.train.data.read_imdb(pathlib.Path({str(tarball)!r}))\nexcept kit.train.errors.RunError:\n    pass\n"
            "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)")
    grew = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert int(grew.stdout) < 50, grew.stdout + grew.stderr  # MiB: nothing of the review was read


def test_a_tarball_of_too_many_entries_or_too_much_text_is_refused(tmp_path, monkeypatch):
    tarball = review_tarball(tmp_path, 10)
    monkeypatch.setattr(kit.train.data, "TAR_ENTRIES", 5)
    with pytest.raises(kit.train.errors.RunError, match="holds more than 5 entries: not the IMDB tarball"):
        kit.train.data.read_imdb(tarball)
    monkeypatch.setattr(kit.train.data, "TAR_ENTRIES", 1000)
    monkeypatch.setattr(kit.train.data, "CORPUS_BYTES", 100)
    with pytest.raises(kit.train.errors.RunError, match=r"hold more than 0 MiB of text \(at aclImdb/"):
        kit.train.data.read_imdb(tarball)

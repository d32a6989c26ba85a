"""Start-up and error paths: the network before the tasks meet, a setup error after the Pipe exists, one task's
error seen by every task, a stop signal during start-up, bad companions, tarballs and environments, data that
would train to a meaningless result, a loss that diverges."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from launch import ROOT, bench, clean_env, run_tasks, srun_envs
from test_faults_checkpoint import SMALL, copy_of, one_epoch, one_error  # noqa: F401 (a fixture)
from test_train import write_imdb

import kit.train.checkpoint
import kit.train.data
import kit.train.errors
import kit.train.launch
import kit.train.options

TRAINER = str(ROOT / "bench_ddp_transformer.py")


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if "error:" in line]


# ---- the network, before the tasks meet: one line per task, within seconds or --timeout ------------------------------
@pytest.mark.multiproc
def test_unresolvable_master_is_one_line_per_task(tmp_path):
    envs = srun_envs(2)
    for env in envs:
        env["MASTER_ADDR"] = "no-such-node.invalid"
    t0 = time.monotonic()
    results = run_tasks([TRAINER, *SMALL, "--cache-dir", str(tmp_path), "--timeout", "30"], envs, timeout=120)
    assert time.monotonic() - t0 < 90  # was 2.6 x --timeout and 162 lines of C++ frames
    for rank, r in enumerate(results):
        line = one_error(r)
        assert f"task {rank} on {socket.gethostname()}: node no-such-node.invalid (MASTER_ADDR) does not resolve" \
            in line, line


@pytest.mark.multiproc
def test_master_port_held_by_another_program(tmp_path):
    """Another program listens on MASTER_PORT (and never answers): task 0 says so at once; task 1, which
    connected to that program, ends within --timeout + 15 s (it hung for 200 s at --timeout 30)."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(16)
        port = other.getsockname()[1]
        t0 = time.monotonic()
        results = run_tasks([TRAINER, *SMALL, "--cache-dir", str(tmp_path), "--timeout", "10"],
                            srun_envs(2, port=port), timeout=120)
        took = time.monotonic() - t0
    assert took < 10 + 15 + 60, took  # start-up on a loaded machine, then --timeout + 15 s at most
    assert f"port {port} (MASTER_PORT) on {socket.gethostname()} is in use by another program" in one_error(results[0])
    assert (f"task 1 on {socket.gethostname()}: the 2 tasks did not all meet at 127.0.0.1:{port} within --timeout "
            "10s") in one_error(results[1])


def test_rank0_master_address_of_another_host(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # TEST-NET-1: resolves, never this host's
    launch = type("L", (), {"master_addr": "192.0.2.1", "master_port": 12345, "rank": 0, "size": 2,
                            "master_addr_given": True, "agent_store": False})()
    with pytest.raises(kit.train.errors.TaskError,
                       match=r"node 192.0.2.1 \(MASTER_ADDR\) is 192.0.2.1, not an address of this host"):
        kit.train.launch.check_rendezvous(launch, 10)


# ---- a setup error after the Pipe's worker threads started: every task exits, promptly ------------------------------
FAILING_SETUP = """
import os, runpy, sys, torch; sys.path.insert(0, {root!r})
import kit.train.options
import kit.train.replica
real = kit.train.options.make_optimizer
def make_optimizer(params, lr, zero, group=None):  # called by Replica.__init__ right after the Pipe is built
    if os.environ["SLURM_PROCID"] in {ranks!r}:
        return torch.optim.AdamW(params, lr=-1.0)  # AdamW's own ValueError, as --lr -1 gave
    return real(params, lr, zero, group)
kit.train.replica.make_optimizer = make_optimizer  # where Replica looks it up
sys.argv = ["bench_ddp_transformer.py"] + {args!r}
runpy.run_path({trainer!r}, run_name="__main__")  # the page's script, as `python bench_ddp_transformer.py` runs it
"""


@pytest.mark.multiproc
@pytest.mark.parametrize("failing", [("0", "1"), ("1",)])
def test_setup_error_after_the_pipe_exits_within_timeout(tmp_path, failing):
    """Replica.__init__ raises after fairscale's worker threads started (they used to hang the process in
    fairscale's __del__ / join_workers, on both tasks, past --timeout): every task exits within --timeout."""
    args = [*SMALL, "--cache-dir", str(tmp_path), "--timeout", "60"]
    code = FAILING_SETUP.format(root=str(ROOT), ranks=failing, args=args,
                                trainer=str(ROOT / "bench_ddp_transformer.py"))
    t0 = time.monotonic()
    results = run_tasks(["-c", code], srun_envs(2), timeout=150)
    assert time.monotonic() - t0 < 60, "a task outlived --timeout"
    for rank, r in enumerate(results):
        assert r.returncode == 1, (rank, r.stderr[-2000:])
        if str(rank) in failing:
            assert "ValueError: Invalid learning rate: -1.0" in r.stderr
        else:  # the healthy task finds its peer gone at the next collective
            assert "task 0 on" in one_error(r) and "lost contact with the others" in one_error(r)


# ---- one task's error is seen: the task says it, the others name it --------------------------------------------------
@pytest.mark.multiproc
@pytest.mark.parametrize("what", ["--load", "--data-dir"])
def test_one_tasks_error_is_seen(tmp_path, one_epoch, what):
    """A file only task 0 can see (node-local storage): a relative path that exists in task 0's working folder
    and not in task 1's. Task 1 prints its own error prefixed with its rank and host; task 0 says which task
    failed; nobody says "lost contact"."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    for f in folders:
        f.mkdir()
    if what == "--load":
        copy_of(one_epoch, folders[0])
        args = [*SMALL, "--load", "ckpt.pt"]
        theirs = "--load ckpt.pt: no such file"
    else:
        write_imdb(folders[0] / "imdb", per_class=8)
        args = ["--data-dir", "imdb", "--nlayers", "2", "--batch-size", "8"]
        theirs = "--data-dir imdb does not exist"
    envs = srun_envs(2)
    procs = [subprocess.Popen([sys.executable, TRAINER, "--cache-dir", str(tmp_path), *args], env=env,
                              cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for env, folder in zip(envs, folders)]
    results = [subprocess.CompletedProcess(p.args, p.wait(timeout=180), *p.communicate()) for p in procs]
    host = socket.gethostname()
    assert one_error(results[1]).startswith(f"bench_ddp_transformer: error: task 1 on {host}: {theirs}")
    line = one_error(results[0])
    assert line.startswith(f"bench_ddp_transformer: error: task 0 on {host}: stopping: task 1 on {host} failed: "
                           f"{theirs}"), line
    assert "lost contact" not in results[0].stderr + results[1].stderr


@pytest.mark.multiproc
def test_the_same_error_everywhere_is_said_once(tmp_path):
    """Every task fails the same way: one line, from task 0 (not one per task)."""
    envs = srun_envs(2)
    results = run_tasks([TRAINER, *SMALL, "--cache-dir", str(tmp_path), "--load", str(tmp_path / "missing.pt")], envs,
                        timeout=180)
    assert one_error(results[0]) == f"bench_ddp_transformer: error: --load {tmp_path / 'missing.pt'}: no such file"
    assert results[1].returncode == 1 and not error_lines(results[1])


# ---- a stop signal during start-up: held, then checkpoint and exit 75 (the job is requeued) --------------------------
def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler installed for `sig` (/proc/PID/status, SigCgt)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def signalled_at_startup(script: str, args: list[str]) -> subprocess.CompletedProcess:
    """Run a trainer and send it SIGUSR1 as soon as it can catch it, while torch still imports."""
    p = subprocess.Popen([sys.executable, str(ROOT / script), *args], env=clean_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not catches(p.pid, signal.SIGUSR1):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.005)
    p.send_signal(signal.SIGUSR1)
    out, err = p.communicate(timeout=240)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_sigusr1_during_startup_is_not_fatal(tmp_path):
    """Before, the process died with 138 (SIGUSR1's default action) and Slurm did not requeue the job. Now it
    checkpoints after the first step and exits 75."""
    ckpt = tmp_path / "early.pt"
    r = signalled_at_startup("bench_ddp_transformer.py",
                             [*SMALL, "--epochs", "2", "--cache-dir", str(tmp_path), "--save", str(ckpt)])
    out = r.stdout
    assert r.returncode == 75, (r.returncode, r.stderr[-2000:])
    assert "stopping on SIGUSR1 at epoch 1, batch 1/" in out and "checkpoint saved to" in out, out
    state = torch.load(kit.train.checkpoint.resume_file(ckpt), weights_only=True)
    assert (state["epoch"], state["batch_in_epoch"], state["step"]) == (0, 1, 1)


def test_bench_stage_holds_sigusr1_from_its_first_lines():
    """bench_stage.py too: a signal while torch imports is held (here the run then stops on its arguments: one
    task cannot make a pipeline), instead of killing the process (-10)."""
    r = signalled_at_startup("bench_stage.py", [*SMALL])
    assert r.returncode == 1 and "bench_stage: error:" in r.stderr, (r.returncode, r.stderr[-2000:])


# ---- small things, one line each -------------------------------------------------------------------------------------
def test_resume_without_save_is_refused(tmp_path):
    [r] = bench(["--resume", "--cache-dir", str(tmp_path)], timeout=120)
    assert "--resume continues from the --save file, and no --save was given" in one_error(r)


def test_companion_without_layout_is_one_line(tmp_path, one_epoch):
    ckpt = copy_of(one_epoch, tmp_path)
    common = [*SMALL, "--cache-dir", str(tmp_path)]
    state = torch.load(kit.train.checkpoint.resume_file(ckpt), weights_only=True)
    del state["layout"]
    torch.save(state, kit.train.checkpoint.resume_file(ckpt))
    [r] = bench([*common, "--epochs", "2", "--load", str(ckpt)])
    line = one_error(r)
    assert f"{kit.train.checkpoint.resume_file(ckpt)} has no 'layout' field" in line and "delete it to load" in line, line


def imdb_tarball(folder: Path) -> bytes:
    """A small aclImdb_v1.tar.gz, whole."""
    imdb = write_imdb(folder / "src", per_class=40)
    good = folder / "good.tar.gz"
    with tarfile.open(good, "w:gz") as tar:
        tar.add(imdb, arcname="aclImdb")
    return good.read_bytes()


def damaged_tarballs(folder: Path) -> dict[str, Path]:
    """Not gzip at all; a gzip cut in the middle; a gzip whose compressed bytes are damaged."""
    data = imdb_tarball(folder)
    damaged = bytearray(data)
    damaged[len(data) // 2: len(data) // 2 + 64] = bytes(64)
    out = {}
    for name, blob in (("random", os.urandom(5000)), ("truncated", data[: len(data) // 2]),
                       ("damaged", bytes(damaged))):
        (folder / name).mkdir()
        (folder / name / "aclImdb_v1.tar.gz").write_bytes(blob)
        out[name] = folder / name / "aclImdb_v1.tar.gz"
    return out


@pytest.mark.parametrize("kind", ["random", "truncated", "damaged"])
def test_corrupt_tarball_is_one_line(tmp_path, kind):
    tarball = damaged_tarballs(tmp_path)[kind]
    [r] = bench(["--data-dir", str(tarball.parent), "--cache-dir", str(tmp_path / "cache"), "--batch-size", "8"],
                timeout=120)
    line = one_error(r)
    assert f"cannot read {tarball}: " in line and "download aclImdb_v1.tar.gz again" in line, line


def test_damage_anywhere_in_the_gzip_is_caught(tmp_path):
    """tarfile stops quietly at a garbled header past the first member, so damage that garbles a header used to
    read as a short archive ("has no train/... reviews", 12 offsets in 40 before the fix): every offset must be
    refused as a damaged file, by the tar's checksum or gzip's CRC."""
    data = imdb_tarball(tmp_path)
    for off in range(64, len(data) - 128, max(1, (len(data) - 192) // 40)):
        damaged = bytearray(data)
        damaged[off: off + 64] = bytes(64)
        tarball = tmp_path / f"{off}" / "aclImdb_v1.tar.gz"
        tarball.parent.mkdir()
        tarball.write_bytes(bytes(damaged))
        with pytest.raises(kit.train.errors.RunError, match="download aclImdb_v1.tar.gz again") as err:
            kit.train.data.read_imdb(tarball)
        assert f"cannot read {tarball}: " in str(err.value), (off, str(err.value))


@pytest.mark.parametrize("script", ["bench_ddp_transformer.py", "bench_stage.py"])
def test_malformed_slurm_procid_is_one_message(script):
    env = clean_env(SLURM_JOB_ID="9", SLURM_STEP_ID="0", SLURM_PROCID="abc", SLURM_NTASKS="2",
                    SLURM_STEP_NUM_TASKS="2", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="2",
                    SLURM_STEP_NODELIST="n1")
    r = subprocess.run([sys.executable, str(ROOT / script)], env=env, capture_output=True, text=True, timeout=120)
    assert "SLURM_PROCID='abc' is not an integer" in one_error(r)
    assert "Traceback" not in r.stderr


# ---- data that would train to a meaningless result -------------------------------------------------------------------
def test_reviews_rewritten_in_place_rebuild_the_cache(tmp_path):
    """The cache is keyed on every review file (name, size, time), not on its folder's time, which does not change
    when a file is rewritten in place: the stale cache was reused (test accuracy 0.812 instead of 0.500)."""
    imdb = write_imdb(tmp_path / "data", per_class=16)
    args = ["--data-dir", str(imdb), "--cache-dir", str(tmp_path / "cache"), "--epochs", "1", "--batch-size", "8",
            "--nlayers", "2"]
    first = bench(args)[0]
    assert first.returncode == 0 and "tokenised" in first.stdout, first.stderr[-2000:]
    assert "tokenised" not in bench(args)[0].stdout  # unchanged: the cache is used
    for i, review in enumerate(sorted((imdb / "train" / "pos").glob("*.txt"))[:3]):
        folder_times = os.stat(review.parent)
        if i == 0:  # same size, new content and time
            review.write_text(review.read_text().replace("wonderful", "dreadful!"))
        else:  # another size
            review.write_text("Dull.")
        os.utime(review.parent, ns=(folder_times.st_atime_ns, folder_times.st_mtime_ns))  # the folder's time as it was
    again = bench(args)[0]
    assert again.returncode == 0 and "tokenised" in again.stdout, again.stdout[-2000:]
    assert len(list((tmp_path / "cache").glob("imdb-*.pt"))) == 2


def test_one_class_corpus_is_refused(tmp_path):
    imdb = write_imdb(tmp_path / "data", per_class=16)
    for review in (imdb / "train" / "neg").glob("*.txt"):
        review.unlink()
    [r] = bench(["--data-dir", str(imdb), "--cache-dir", str(tmp_path / "cache"), "--batch-size", "8"], timeout=120)
    line = one_error(r)
    assert f"{imdb}: all 16 train reviews are positive (train/neg holds none): a classifier needs both" in line, line


def test_a_diverging_loss_stops_with_the_step(tmp_path, one_epoch):
    """A learning rate that diverges (the largest the argument checks accept, in fp16, whose logits overflow within
    a few steps at it; fp32 at lr 10 stays finite on this model): the run stops after the epoch,
    naming the first step whose loss was not finite, and the checkpoint of an earlier run is not overwritten."""
    ckpt = copy_of(one_epoch, tmp_path)
    common = [*SMALL, "--cache-dir", str(tmp_path), "--save", str(ckpt)]
    saved = torch.load(ckpt)
    # a fresh start (a resumed one keeps the saved lr)
    [r] = bench([*common, "--epochs", "1", "--lr", "10", "--precision", "fp16"])
    line = one_error(r)
    step = int(re.search(r"the loss is not finite \(nan or inf\) from step (\d+) \(epoch 1\) on", line).group(1))
    assert 1 <= step <= 9 and "lower --lr (now 10)" in line, line
    for k, v in torch.load(ckpt).items():  # not overwritten by the diverged epoch
        assert torch.equal(v, saved[k]), k


def test_nan_weights_are_refused_at_load(tmp_path, one_epoch):
    ckpt = copy_of(one_epoch, tmp_path)
    state = torch.load(ckpt)
    key = next(iter(state))
    state[key][0] = float("nan")
    torch.save(state, ckpt)
    [r] = bench([*SMALL, "--cache-dir", str(tmp_path), "--load", str(ckpt)])
    assert f"--load {ckpt} holds non-finite values (nan or inf) in {key}" in one_error(r)

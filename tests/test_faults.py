"""Jobs that survive: resume, stop signals, a dead rank, a kill during a save, and bad input everywhere."""
from __future__ import annotations

import os
import re
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kit.checks
import kit.findings
import kit.jobscript
import idr_torch
from launch import ROOT, bench, clean_env, srun_envs

# ---- resume: the same trajectory as an uninterrupted run ----------------------------------------------------------
COMMON = ["--synthetic", "800", "--batch-size", "16", "--nlayers", "2", "--dropout", "0", "--seed", "5"]


def params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path)  # the --save file is the page's state_dict


@pytest.mark.multiproc
def test_resume_continues_the_same_trajectory(tmp_path):
    """--max-steps ends the first run 3 steps into epoch 2 (an epoch's end and a batch inside one are saved);
    --resume trains the rest of epoch 2 and ends where the uninterrupted run ends."""
    args = [*COMMON, "--cache-dir", str(tmp_path), "--epochs", "2"]
    straight, half = tmp_path / "straight.pt", tmp_path / "half.pt"
    [first, _] = bench([*args, "--save", str(straight)], ntasks=2)
    assert first.returncode == 0, first.stderr[-2000:]
    per_epoch = int(re.search(r"(\d+) steps per epoch", first.stdout)[1])
    cut = bench([*args, "--max-steps", str(per_epoch + 3), "--save", str(half)], ntasks=2)
    assert all(r.returncode == 0 for r in cut), cut[0].stderr[-2000:]
    assert f"(epoch 2 up to batch 3/{per_epoch}, step {per_epoch + 3})" in cut[0].stdout
    resumed = bench([*args, "--save", str(half), "--resume"], ntasks=2)
    assert all(r.returncode == 0 for r in resumed), resumed[0].stderr[-2000:]
    assert f"loaded {half}: epoch 1 + 3 batches, step {per_epoch + 3}" in resumed[0].stdout
    a, b = params(straight), params(half)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
    # --max-steps counts the loaded steps: a file already past it trains nothing and is left as it is
    again = bench([*args, "--epochs", "3", "--save", str(half), "--resume", "--max-steps", "5"], ntasks=2)
    assert all(r.returncode == 0 for r in again), again[0].stderr[-2000:]
    assert f"nothing to train: the checkpoint is at step {2 * per_epoch} and --max-steps is 5" in again[0].stdout
    assert "checkpoint saved" not in again[0].stdout and all(torch.equal(params(half)[k], b[k]) for k in b)


@pytest.mark.parametrize("saved,now,skip", [
    ((5, 16 * 2), 16 * 2, 5),  # same batch and replicas: the batch count as saved
    ((5, 16 * 2), 32 * 1, 5),  # one replica of 32 instead of two of 16: the same 160 samples
    ((5, 16 * 2), 16 * 4, 2),  # 160 samples are 2.5 steps of 64: 2 (half a step trained twice, none skipped)
    ((3, None), 64, 3),  # a companion from before samples_in_epoch: its batch count
    ((0, 0), 64, 0)])
def test_resume_inside_an_epoch_with_another_global_batch(saved, now, skip):
    import kit.train.checkpoint
    import kit.train.launch
    batches, per_step = saved
    state = {"epoch": 0, "batch_in_epoch": batches}
    if per_step is not None:
        state["samples_in_epoch"] = batches * per_step
    assert kit.train.checkpoint.batches_to_skip(state, now) == skip


@pytest.mark.multiproc
def test_stop_signal_mid_epoch_then_resume(tmp_path):
    """SIGUSR1 (what Slurm's --signal sends before the time limit) to every task at once, mid-epoch: they
    agree on one step, rank 0 checkpoints, all exit 75; --resume finishes with the uninterrupted result."""
    args = [*COMMON, "--cache-dir", str(tmp_path), "--epochs", "2"]
    straight, ckpt = tmp_path / "straight.pt", tmp_path / "ckpt.pt"
    assert all(r.returncode == 0 for r in bench([*args, "--save", str(straight)], ntasks=2))
    envs = srun_envs(2)
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, str(ROOT / "bench_ddp_transformer.py"), *args, "--save", str(ckpt),
                               "--log-every", "0"], env=e, stdout=open(log, "w"), stderr=subprocess.STDOUT)
             for e, log in zip(envs, logs)]
    deadline = time.monotonic() + 120
    while "epoch 1 step 5/" not in logs[0].read_text():
        assert time.monotonic() < deadline and procs[0].poll() is None, logs[0].read_text()
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGUSR1)
    codes = [p.wait(timeout=60) for p in procs]
    out = logs[0].read_text()
    assert codes == [75, 75], out + logs[1].read_text()
    assert "stopping on SIGUSR1 at epoch 1" in out and "checkpoint saved to" in out
    state = torch.load(ckpt.with_name(ckpt.name + ".resume.pt"), weights_only=False)
    assert state["epoch"] == 0 and 5 <= state["batch_in_epoch"] < 25 and len(state["rng"]) == 2
    resumed = bench([*args, "--save", str(ckpt), "--resume"], ntasks=2)
    assert all(r.returncode == 0 for r in resumed), resumed[0].stderr[-2000:]
    assert f"epoch 0 + {state['batch_in_epoch']} batches" in resumed[0].stdout
    a, b = params(straight), params(ckpt)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


# ---- a dead rank: the others stop, promptly, instead of hanging until the time limit --------------------------------
@pytest.mark.multiproc
def test_dead_rank_stops_every_other_task(tmp_path):
    envs = srun_envs(4, nodes=2)
    logs = [tmp_path / f"rank{r}.log" for r in range(4)]
    procs = [subprocess.Popen([sys.executable, str(ROOT / "bench_ddp_transformer.py"), "--epochs", "100",
                               "--synthetic", "2000", "--batch-size", "16", "--timeout", "30", "--cache-dir",
                               str(tmp_path)], env=e, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                              start_new_session=True) for e, log in zip(envs, logs)]
    try:
        deadline = time.monotonic() + 120
        while "model:" not in logs[0].read_text():
            assert time.monotonic() < deadline, logs[0].read_text()
            time.sleep(0.2)
        time.sleep(2)  # well inside the training loop
        procs[2].kill()
        t0 = time.monotonic()
        for p in procs:
            p.wait(timeout=60)
        assert time.monotonic() - t0 < 60
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert [p.returncode for p in procs] == [1, 1, -9, 1]
    for r in (0, 1, 3):
        text = logs[r].read_text()
        assert f"bench_ddp_transformer: error: task {r} on {os.uname().nodename} lost contact with the others" \
            in text, text[-1500:]
        assert "Traceback" not in text


def test_only_a_dead_peer_is_lost_contact():
    import kit.train.checkpoint
    import kit.train.launch
    assert kit.train.launch.is_comm_error(RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                                        "[127.0.0.1]:20866. This is typically caused by a remote worker crashing."))
    assert kit.train.launch.is_comm_error(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or "
                                        "there was a network error, NCCL version 2.21.5"))
    for other in ("CUDA out of memory. Tried to allocate 2.00 GiB (NCCL buffers in use)",
                  "Tensors must be CUDA and dense (gloo)", "peer access is not supported between these devices",
                  "mat1 and mat2 shapes cannot be multiplied (32x64 and 128x2)", "connection layer weight mismatch"):
        assert not kit.train.launch.is_comm_error(RuntimeError(other)), other


# ---- a dependency missing next to a cluster's PyTorch module: one line that says what to install ----------------------
@pytest.mark.parametrize("module,argv,needle", [
    ("psutil", ["bench_ddp_transformer.py"], "error: psutil is missing (it measures memory and start-up): "
     "pip install --user psutil"),
    ("hostlist", ["check_topology.py"], "error: python-hostlist is missing (it reads Slurm's node lists): "
     "pip install --user python-hostlist"),
    ("fairscale", ["bench_ddp_transformer.py", "--engine", "fairscale"],
     "--engine fairscale needs fairscale next to this torch: pip install --user fairscale"),
])
def test_a_missing_dependency_is_one_line(module, argv, needle):
    code = (f"import sys, runpy; sys.modules[{module!r}] = None; sys.argv = {argv!r}; "
            f"runpy.run_path({str(ROOT / argv[0])!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---- a kill during a save leaves the previous checkpoint whole -------------------------------------------------------
def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path):
    """SIGKILL while the checkpoint is being written: the file on disk is still the previous whole one."""
    target = tmp_path / "ckpt.pt"
    code = f"""
import sys, pathlib, torch; sys.path.insert(0, {str(ROOT)!r})
from kit.train.checkpoint import atomic_torch_save
big = torch.zeros(64, 2**20)  # 256 MiB: a save takes a good fraction of a second
for i in range(1, 100):
    big[0, 0] = i
    print("saving", i, flush=True)
    atomic_torch_save({{"version": i, "data": big}}, pathlib.Path({str(target)!r}))
"""
    interrupted = 0
    for kill_at in (2, 3):
        for stale in tmp_path.glob(".ckpt.pt.*"):
            stale.unlink()
        target.unlink(missing_ok=True)
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=clean_env())
        for line in p.stdout:
            if line.split() == ["saving", str(kill_at)]:
                time.sleep(0.05)  # inside torch.save of version kill_at
                p.kill()
                break
        p.wait()
        interrupted += bool(list(tmp_path.glob(".ckpt.pt.*.tmp")))  # the half-written temporary file
        state = torch.load(target, weights_only=True)  # loads: a whole file
        assert state["version"] == kill_at - 1 and state["data"][0, 0].item() == kill_at - 1
    assert interrupted, "the kill never landed inside a save: the test proved nothing"


# ---- bad checkpoints, caches and reviews ---------------------------------------------------------------------------
def test_truncated_or_foreign_checkpoint_is_refused(tmp_path):
    good = tmp_path / "good.pt"
    assert bench(["--synthetic", "300", "--epochs", "1", "--cache-dir", str(tmp_path), "--save", str(good)])[0] \
        .returncode == 0
    data = good.read_bytes()
    cases = {"truncated.pt": data[: len(data) // 2], "garbage.pt": b"not a checkpoint at all" * 10,
             "empty.pt": b""}
    for name, blob in cases.items():
        (tmp_path / name).write_bytes(blob)
    torch.save({"some": "dict"}, tmp_path / "foreign.pt")
    for name in [*cases, "foreign.pt"]:
        [r] = bench(["--synthetic", "300", "--cache-dir", str(tmp_path), "--load", str(tmp_path / name)], timeout=90)
        assert r.returncode == 1, (name, r.stderr)
        errors = [line for line in r.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and str(tmp_path / name) in errors[0] and "Traceback" not in r.stderr, r.stderr
        assert ("not a readable model file" in errors[0]) or ("is not a state_dict" in errors[0]), errors[0]


def test_corrupt_cache_is_rebuilt(tmp_path):
    args = ["--synthetic", "300", "--epochs", "1", "--cache-dir", str(tmp_path)]
    assert bench(args)[0].returncode == 0
    [cache] = list(tmp_path.glob("synthetic-*.pt"))
    cache.write_bytes(cache.read_bytes()[:1000])
    [r] = bench(args)
    assert r.returncode == 0, r.stderr
    assert "is unreadable" in r.stdout and "rebuilding it" in r.stdout and "tokenised" in r.stdout
    assert torch.load(cache, weights_only=True)["format"] >= 1


def test_unreadable_review_is_named(tmp_path):
    from test_train import write_imdb
    folder = write_imdb(tmp_path / "data", per_class=4)
    (folder / "train" / "pos" / "999_9.txt").symlink_to(tmp_path / "gone.txt")  # dangling: unreadable
    [r] = bench(["--data-dir", str(folder), "--cache-dir", str(tmp_path)], timeout=90)
    assert r.returncode == 1
    assert "cannot read review" in r.stderr and "999_9.txt" in r.stderr and "Traceback" not in r.stderr


# ---- fuzzing: a finding or a clear error, never a traceback -----------------------------------------------------------
OPTION = st.sampled_from(["-N", "--nodes", "-n", "--ntasks", "--ntasks-per-node", "--tasks-per-node", "-c",
                          "--cpus-per-task", "--gres", "--gpus-per-node", "--gpus-per-task", "--gpus", "--gpu-bind",
                          "--hint", "-C", "--constraint", "-t", "--time", "-p", "--partition", "--exclusive",
                          "--output", "-x", "--mem"])
VALUE = st.one_of(st.integers(-3, 100).map(str), st.sampled_from(["gpu:4", "gpu:v100:8", "gpu", "gpu:0", "gpu:x",
                  "map_gpu:0,0", "per_task:x", "closest", "nomultithread", "1:00:00", "1h", "$X", "2-4", "",
                  "'a b'", "\"", "v100-32g", "gpu_p2", "=3", "4(x2)"]),
                  st.text(string.printable, max_size=12))
LINE = st.one_of(
    st.builds(lambda o, v, sep: f"#SBATCH {o}{sep}{v}", OPTION, VALUE, st.sampled_from(["=", " ", ""])),
    st.builds(lambda o, v: f"  #SBATCH {o}={v}", OPTION, VALUE),
    st.builds(lambda v: f"srun python bench_ddp_transformer.py --nlayers {v} --chunks {v} --batch-size {v}", VALUE),
    st.sampled_from(["", "# comment", "module load pytorch-gpu/py3/2.6.0", "set -x", "echo \\", "srun \\"]),
    st.text(string.printable, max_size=40))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(LINE, max_size=12))
def test_fuzz_sbatch_parser(tmp_path, lines):
    path = tmp_path / "fuzz.slurm"
    path.write_text("#!/bin/bash\n" + "\n".join(lines) + "\n")
    try:
        job, training, findings = kit.jobscript.read_sbatch(path)
        report = kit.checks.check_job(job, training)
    except kit.findings.UsageError:
        return
    report.text()
    report.as_dict()
    for f in report.findings:
        assert f.level in ("error", "warning") and f.message


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=string.ascii_letters + string.digits + "[],-()x ", max_size=30))
def test_fuzz_hostlist_and_tasks_per_node(value):
    for parse in (idr_torch.expand_nodelist, idr_torch.parse_tasks_per_node):
        try:
            out = parse(value)
        except idr_torch.LaunchError as exc:
            assert repr(value) in str(exc)
            continue
        assert out and all(out)


NUMERIC = st.one_of(st.integers(-5, 12).map(str), st.sampled_from(["", "x", "1.5", "2(x3)", " 3", "99999999999"]))


@settings(max_examples=400, deadline=None)
@given(st.fixed_dictionaries({
    "SLURM_PROCID": NUMERIC, "SLURM_LOCALID": NUMERIC, "SLURM_NODEID": NUMERIC, "SLURM_NTASKS": NUMERIC,
    "SLURM_STEP_NUM_TASKS": NUMERIC, "SLURM_CPUS_PER_TASK": NUMERIC, "MASTER_PORT": NUMERIC,
    "SLURM_STEP_TASKS_PER_NODE": st.sampled_from(["2(x3)", "2(x2),1", "0", "x", "", "3", "1(x6)"]),
    "SLURM_STEP_NODELIST": st.sampled_from(["node[1-3]", "n1", "bad[", "", "a[1-2]b[1-3]"]),
    "SLURM_STEP_ID": st.sampled_from(["0", "batch", "", "7"]), "SLURM_JOB_ID": st.sampled_from(["12", "", "x"]),
}))
def test_fuzz_nonsense_environments(env):
    try:
        launch = idr_torch.Launch(env)
        launch.summary()
        launch.cpus_per_task, launch.master_port
    except idr_torch.LaunchError as exc:
        assert str(exc)
        return
    assert 0 <= launch.rank < launch.size and 0 <= launch.local_rank < launch.local_world_size


def test_nonsense_environment_on_the_command_line():
    env = clean_env(SLURM_JOB_ID="9", SLURM_STEP_ID="0", SLURM_PROCID="7", SLURM_NTASKS="4",
                    SLURM_STEP_NUM_TASKS="4", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="4",
                    SLURM_STEP_NODELIST="n1")
    for script in ("bench_ddp_transformer.py", "bench_stage.py", "check_topology.py", "idr_torch.py"):
        r = subprocess.run([sys.executable, str(ROOT / script)], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode in (1, 2), (script, r.stderr)
        assert "rank 7 (from SLURM_PROCID) is not below the world size 4" in r.stderr, (script, r.stderr)
        assert "Traceback" not in r.stderr

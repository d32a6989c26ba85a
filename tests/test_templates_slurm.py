"""Against a real Slurm cluster (slurmctld, a slurmd per node, munged on this machine, see local_slurm.py).

The fake GPUs are character devices, so Slurm sets CUDA_VISIBLE_DEVICES as on a real node; they are not
CUDA, so training runs on the CPU fallback (gloo) with the layout the GPUs would have had.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import idr_torch
from launch import ROOT, clean_env, copy_kit

pytestmark = pytest.mark.slurm
TEMPLATES = sorted((ROOT / "slurm").glob("*.slurm"))


@pytest.fixture
def workdir(tmp_path_factory, slurm_cluster) -> Path:
    """A user's $WORK: the scripts and the templates, world-traversable for the job's processes."""
    work = tmp_path_factory.mktemp("work")
    copy_kit(work)
    for t in TEMPLATES:
        shutil.copy(t, work / t.name)
    return work


def slurm_env(cluster, **extra: str) -> dict[str, str]:
    env = clean_env(**cluster.env)
    # `python` in the job is this test's interpreter; `module` is a no-op as if Lmod had loaded PyTorch
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["BASH_FUNC_module%%"] = "() {  :\n}"
    env.update(extra)
    return env


def run(cmd: list[str], cluster, cwd: Path, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=slurm_env(cluster, **extra), capture_output=True, text=True,
                          timeout=timeout)


def read_job_files(cwd: Path, prefix: str, job_id: str) -> tuple[str, str]:
    return ((cwd / f"{prefix}_{job_id}.out").read_text(), (cwd / f"{prefix}_{job_id}.err").read_text())


# ---- idr_torch under real srun ------------------------------------------------------------------------------------
def test_idr_torch_under_srun(slurm_cluster, workdir):
    r = run(["srun", "-N3", "--ntasks-per-node=2", "python", "idr_torch.py"], slurm_cluster, workdir)
    assert r.returncode == 0, r.stderr
    blocks = {int(m.group(1)): m.group(0) for m in re.finditer(r"---- task (\d) of 6 ----\n(?:.*\n){8}", r.stdout)}
    assert sorted(blocks) == list(range(6))
    for rank, text in blocks.items():
        assert f"rank / size   {rank} / 6   (local rank {rank % 2})" in text
        assert f"node          {rank // 2} of 3" in text
        assert "node[1-3] -> node1, node2, node3" in text and "per node [2, 2, 2]" in text
        assert re.search(r"master        node1:\d+", text)
    assert len(set(re.findall(r"master        (\S+)", r.stdout))) == 1  # every task agrees


# ---- the page's 3-node template, submitted and run to the end ---------------------------------------------------
def test_page_three_node_template_runs(slurm_cluster, workdir):
    """The template as shipped (16 layers, the CPU defaults' width) on 1500 synthetic reviews rather than 4000: six
    tasks share this machine's cores, and the smaller corpus is what takes this test from 140 s to about 60."""
    text = (workdir / "page_3nodes_4gpus.slurm").read_text()
    assert text.count(" --epochs 2 ") == 1
    (workdir / "page_3nodes_4gpus.slurm").write_text(text.replace(" --epochs 2 ", " --epochs 2 --synthetic 1500 "))
    r = run(["sbatch", "--wait", "--parsable", "page_3nodes_4gpus.slurm"], slurm_cluster, workdir, timeout=600)
    job = r.stdout.strip().split(";")[0]
    out, err = read_job_files(workdir, "hybrid_3x4", job) if job else ("", r.stderr)
    assert r.returncode == 0, f"sbatch: {r.stderr}\n--- out\n{out[-3000:]}\n--- err\n{err[-3000:]}"
    # the pre-flight step checked 6 real tasks, pairs (0,1) and (2,3) on every node
    assert "6 task(s) = model replicas, nb_part 2" in out and "=> OK" in out
    assert len(re.findall(r"^\s+\d+\s+\d+\s+[01]\s+(0,1|2,3)\s", out, re.M)) == 6
    # training: rank 0 alone printed, with world size 6 and nb_part 2
    assert "world size 6" in out and "nb_part 2" in out
    assert out.count("summary:") == 1 and len(re.findall(r"^epoch +\d+ \|", out, re.M)) == 2
    [record] = [json.loads(line) for line in (workdir / "hybrid_results.jsonl").read_text().splitlines()]
    assert (record["world_size"], record["nodes"], record["nb_part"], record["tasks_per_node"]) == (6, 3, 2, 2)
    assert record["replica_divergence"] == 0.0
    assert [p["node_gpus"] for p in record["plans"]] == [["0", "1"], ["2", "3"]] * 3
    assert [p["node"] for p in record["plans"]] == [0, 0, 1, 1, 2, 2]
    # the checkpoint: one file, written by rank 0 only (once per epoch, atomically)
    assert sorted(p.name for p in workdir.glob("*hybrid_3x4*.pt*")) == ["hybrid_3x4.pt", "hybrid_3x4.pt.resume.pt"]
    assert out.count("checkpoint saved:") == 2


def test_page_eight_gpu_template_preflight_in_allocation(slurm_cluster, workdir):
    """2 nodes x 8 GPUs x 4 tasks: each task sees 8 GPUs and owns a pair; checked by srun inside the job."""
    r = run(["salloc", "--partition=gpu_p2", "-N2", "--gres=gpu:8", "--ntasks-per-node=4", "--cpus-per-task=6",
             "srun", "python", "check_topology.py", "--nlayers", "16", "--json"], slurm_cluster, workdir)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout[r.stdout.index("{"):])
    assert report["ok"] and len(report["tasks"]) == 8
    assert [t["node_gpus"] for t in report["tasks"]] == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]] * 2
    assert [t["devices"] for t in report["tasks"]] == [[0, 1], [2, 3], [4, 5], [6, 7]] * 2


# ---- per-task binding: the checker sees through it and the trainer's plan matches -----------------------------------
def test_gpus_per_task_binding(slurm_cluster, workdir):
    common = ["srun", "-N2", "--ntasks-per-node=2", "--gpus-per-task=2"]
    r = run([*common, "python", "check_topology.py", "--nlayers", "4", "--json"], slurm_cluster, workdir)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout[r.stdout.index("{"):])
    assert [t["node_gpus"] for t in report["tasks"]] == [["0", "1"], ["2", "3"]] * 2  # what Slurm showed each task
    assert [t["devices"] for t in report["tasks"]] == [[0, 1]] * 4  # from visible GPU 0, never past 2
    assert all(t["bound"] for t in report["tasks"])
    assert any("the page's own indexing" in n for n in report["notes"])
    r = run([*common, "python", "bench_ddp_transformer.py", "--nlayers", "4", "--synthetic", "600", "--epochs", "1",
             "--batch-size", "16", "--cache-dir", str(workdir), "--json-out", "bound.jsonl"], slurm_cluster, workdir,
            timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    [record] = [json.loads(line) for line in (workdir / "bound.jsonl").read_text().splitlines()]
    trainer = [(p["node_gpus"], p["nb_part"]) for p in record["plans"]]
    assert trainer == [(t["node_gpus"], t["nb_part"]) for t in report["tasks"]]


# ---- uneven tasks per node ---------------------------------------------------------------------------------------
def test_uneven_tasks_per_node_reported(slurm_cluster, workdir):
    """The step's own placement (task 0 prints SLURM_STEP_TASKS_PER_NODE) is the one the report names."""
    r = run(["srun", "-N3", "-n5", "--gres=gpu:4", "bash", "-c", 'if [ "$SLURM_PROCID" = 0 ]; then echo '
             '"STEP $SLURM_STEP_TASKS_PER_NODE"; fi; exec python check_topology.py --nlayers 8'], slurm_cluster, workdir)
    assert r.returncode == 1
    assert "uneven-tasks-per-node" in r.stdout
    m = re.search(r"tasks per node differ \(([\d,]+)\)", r.stdout)
    step = idr_torch.parse_tasks_per_node(re.search(r"^STEP (\S+)$", r.stdout, re.M).group(1))
    assert m and list(map(int, m.group(1).split(","))) == step and sum(step) == 5 and len(set(step)) > 1, r.stdout
    script = workdir / "uneven.slurm"
    script.write_text("#!/bin/bash\n#SBATCH -N 3\n#SBATCH -n 5\n#SBATCH --gres=gpu:4\n"
                      "srun python bench_ddp_transformer.py --nlayers 8\n")
    r = run([sys.executable, "check_topology.py", str(script)], slurm_cluster, workdir)
    assert r.returncode == 1 and "ntasks-per-node-missing" in r.stdout


# ---- sbatch --test-only and check_topology agree -------------------------------------------------------------------
REQUESTS = [  # (sbatch options, can Slurm place it)
    (["-C", "v100-32g", "-N3", "--gres=gpu:4", "--ntasks-per-node=2", "--cpus-per-task=20"], True),
    (["--partition=gpu_p2", "-N2", "--gres=gpu:8", "--ntasks-per-node=4", "--cpus-per-task=6"], True),
    (["-C", "v100-32g", "-N1", "--gres=gpu:4", "--ntasks-per-node=4", "--cpus-per-task=10"], True),
    (["-C", "v100-32g", "-N1", "--gres=gpu:8", "--ntasks-per-node=4", "--cpus-per-task=10"], False),
    (["--partition=gpu_p2", "-N1", "--gres=gpu:8", "--ntasks-per-node=4", "--cpus-per-task=10"], False),
    (["-C", "v100-32g", "-N1", "--gres=gpu:4", "--ntasks-per-node=2", "--cpus-per-task=40"], False),
]


@pytest.mark.parametrize("options,placeable", REQUESTS, ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_test_only_agrees_with_checker(slurm_cluster, workdir, options, placeable):
    script = workdir / "req.slurm"
    script.write_text(f"#!/bin/bash\n#SBATCH {' '.join(options)}\n"
                      "#SBATCH --hint=nomultithread --time=1:00:00\nsrun python bench_ddp_transformer.py\n")
    slurm = run(["sbatch", "--test-only", str(script)], slurm_cluster, workdir)
    check = run([sys.executable, "check_topology.py", "--json", str(script)], slurm_cluster, workdir)
    codes = {f["code"] for f in json.loads(check.stdout)["findings"] if f["level"] == "error"}
    assert (slurm.returncode == 0) == placeable, slurm.stderr
    if not placeable:
        assert "Requested node configuration is not available" in slurm.stderr
    assert bool(codes & {"gpus-exceed-node", "cpus-exceed-node"}) == (not placeable), codes


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_templates_pass_both_checks(slurm_cluster, workdir, template):
    check = run([sys.executable, "check_topology.py", template.name], slurm_cluster, workdir)
    assert check.returncode == 0, check.stdout
    assert "ERROR" not in check.stdout
    slurm = run(["sbatch", "--test-only", template.name], slurm_cluster, workdir)
    assert slurm.returncode == 0, slurm.stderr
    assert "to start at" in slurm.stderr


def test_sweep_submit_is_one_job_for_every_count(slurm_cluster, workdir):
    (workdir / "slurm").mkdir()
    for t in ("sweep_4gpus.slurm", "sweep_8gpus.slurm", "sweep_steps.sh", "submit_sweep.sh"):
        shutil.copy(ROOT / "slurm" / t, workdir / "slurm" / t)
    r = run(["bash", "slurm/submit_sweep.sh", "8", "--hold"], slurm_cluster, workdir)
    assert r.returncode == 0, r.stderr
    assert sorted(re.findall(r"^skip ntasks=(\d+): ERROR +gpus-not-divisible", r.stdout, re.M)) == ["3", "5", "6",
                                                                                                   "7"]
    [(job, counts)] = re.findall(r"^job (\d+): ntasks ([\d ]+) on one node, one srun step per count$", r.stdout, re.M)
    assert counts == "2 4 8"
    shown = run(["scontrol", "show", "job", job], slurm_cluster, workdir)
    assert "NumTasks=8" in shown.stdout and "CPUs/Task=3" in shown.stdout  # the whole node, once
    subprocess.run(["scancel", job], env=slurm_env(slurm_cluster), check=True)


def test_sweep_runs_every_count_as_a_step_of_one_job(slurm_cluster, workdir):
    """sweep_4gpus.slurm for real, small: counts 1, 2, 4 as srun steps of one allocation, each with its own
    tasks per node and cores per task; 3 skipped with the checker's reason."""
    (workdir / "slurm").mkdir()
    shutil.copy(ROOT / "slurm" / "sweep_steps.sh", workdir / "slurm")
    shutil.copy(ROOT / "slurm" / "sweep_4gpus.slurm", workdir / "slurm")
    r = run(["sbatch", "--wait", "--parsable", "slurm/sweep_4gpus.slurm"], slurm_cluster, workdir, timeout=600,
            BATCH_PER_GPU="4", CHUNKS="1", ZERO="off on", MODEL="--nlayers 4 --d-model 32 --d-hid 64 --seq-len 32",
            EXTRA=f"--synthetic 200 --cache-dir {workdir}")
    job = r.stdout.strip().split(";")[0]
    out, err = read_job_files(workdir, "sweep_4gpus", job) if job else ("", r.stderr)
    assert r.returncode == 0, f"sbatch: {r.stderr}\n--- out\n{out[-3000:]}\n--- err\n{err[-3000:]}"
    assert re.search(r"^skip ntasks=3: ERROR +gpus-not-divisible", out, re.M), out
    assert "failed:" not in out, out + err[-3000:]
    records = [json.loads(line) for line in (workdir / "sweep_results.jsonl").read_text().splitlines()]
    got = sorted((x["tasks_per_node"], x["nb_part"], x["zero"]) for x in records)  # --zero: a dimension
    assert got == [(1, 4, False), (2, 2, False), (2, 2, True), (4, 1, False), (4, 1, True)], got
    assert {x["job_id"] for x in records} == {job}  # one allocation, queued once
    # each step asked for its own tasks per node and cores per task: 40 cores / tasks (the template's set -x)
    asked = sorted(set(re.findall(r"^\++ srun --ntasks-per-node=(\d) -n (\d) -c (\d+) python", err, re.M)))
    assert asked == [("1", "1", "40"), ("2", "2", "20"), ("4", "4", "10")], err[-3000:]
    assert "skip: ntasks=1 --zero (one replica: nothing to shard)" in out


def test_sweep_predict_mode_measures_the_predicted_best(slurm_cluster, workdir):
    """MODE=predict: the profile as a step of the allocation, every split that fits ranked by check_topology.py
    --advise --profile, the best TOP and the page's own configuration measured REPEATS times each; report.py puts
    predicted beside measured, and --advise --profile reads the profile the job took."""
    for folder, names in (("slurm", ("sweep_steps.sh", "sweep_4gpus.slurm", "report.py")),
                          ("benchmarks", ("speed_profile.py",))):
        (workdir / folder).mkdir()
        for name in names:
            shutil.copy(ROOT / folder / name, workdir / folder)
    model = "--nlayers 2 --d-model 32 --n-head 2 --d-hid 64 --seq-len 32 --vocab-size 500"
    r = run(["sbatch", "--wait", "--parsable", "slurm/sweep_4gpus.slurm"], slurm_cluster, workdir, timeout=900,
            MODE="predict", TOP="2", REPEATS="2", BATCH_PER_GPU="4", MODEL=model,
            PROFILE_OPTIONS="--max-micro 8 --repeats 2 --precisions fp32",
            EXTRA=f"--synthetic 320 --max-steps 8 --cache-dir {workdir}")
    job = r.stdout.strip().split(";")[0]
    out, err = read_job_files(workdir, "sweep_4gpus", job) if job else ("", r.stderr)
    assert r.returncode == 0, f"sbatch: {r.stderr}\n--- out\n{out[-3000:]}\n--- err\n{err[-3000:]}"
    assert "profile: 4 task(s) -> sweep_results.profile.json" in out and "failed:" not in out, out + err[-3000:]
    best = re.findall(r"^predicted best: (\d) (bench_\w+\.py) (.*)$", out, re.M)
    assert len(best) == 2, out
    records = [json.loads(line) for line in (workdir / "sweep_results.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 2 and {x["job_id"] for x in records} == {job}  # (TOP + the page's) x REPEATS
    assert sum(x["tasks_per_node"] == 2 and x["nb_part"] == 2 for x in records) >= 2  # the page's own, twice
    report = subprocess.run([sys.executable, "slurm/report.py", "sweep_results.jsonl", "--profile",
                             "sweep_results.profile.json", "--out", "rep"], cwd=workdir, capture_output=True,
                            text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    rows = re.findall(r"^\| (.+?) \| ([\d.]+) \| ([\d.]+) \| 2 \| [+-]\d+% \| (\d)(?: \*\*wrong\*\*)? \| (\d) \|$",
                      report.stdout, re.M)
    assert len(rows) in (2, 3), report.stdout  # the page's own may be one of the best
    advise = run([sys.executable, "check_topology.py", "--advise", "--profile", "sweep_results.profile.json",
                  "--nodes", "1", "--gpus-per-node", "4", "-C", "v100-32g", "--global-batch", "16", "--top", "2"],
                 slurm_cluster, workdir)
    assert advise.returncode == 0 and "fastest first, by the samples/s predicted" in advise.stdout, advise


def test_every_daemon_has_its_own_port(slurm_cluster):
    """slurmctld, slurmdbd and each node's slurmd on distinct ports (local_slurm.daemon_port never repeats one), all
    below the kernel's ephemeral range, where no bind(0) of a test running beside the cluster can take one first."""
    conf = slurm_cluster.conf.read_text()
    ports = [int(p) for p in re.findall(r"(?:^|\s)(?:SlurmctldPort|Port|AccountingStoragePort)=(\d+)", conf, re.M)]
    assert len(ports) == len(set(ports)) > 1, ports
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(1024 <= p < low for p in ports), (ports, low)
    from local_slurm import free_port
    given = [free_port() for _ in range(3000)]
    assert len(set(given)) == len(given)


def test_cluster_stops_without_leftovers(tmp_path_factory):
    """A second cluster, started and stopped here: its daemons are gone and /etc/hosts is as before."""
    from conftest import skip_or_fail
    from local_slurm import PARTITIONS, LocalCluster, unavailable_reason
    if unavailable_reason():
        skip_or_fail(unavailable_reason(), "KIT_REQUIRE_SLURM")
    import tempfile
    hosts_before = Path("/etc/hosts").read_text()
    cluster = LocalCluster(tempfile.mkdtemp(prefix="kit-slurm-2-"))
    cluster.start()
    pids = [int(p.read_text().split()[0]) for p in cluster._pidfiles()]
    assert len(pids) == 1 + sum(len(names) for names, *_ in PARTITIONS.values())  # slurmctld + one slurmd a node
    cluster.stop()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]
    assert Path("/etc/hosts").read_text() == hosts_before
    shutil.rmtree(cluster.root, ignore_errors=True)


# ---- the time-limit signal: checkpoint, requeue, resume, complete ------------------------------------------------
def job_state(cluster, cwd: Path, job: str) -> dict[str, str]:
    out = run(["scontrol", "show", "job", job], cluster, cwd).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def test_time_limit_signal_requeues_and_resumes(slurm_cluster, workdir):
    """The page's template as shipped (its --signal, --requeue, exit-75 block), with a smaller model.
    Slurm's time-limit warning is SIGUSR1 to every task of the steps: `scancel --signal=USR1` sends exactly
    that, now rather than 5 minutes before a limit."""
    import time
    text = (workdir / "page_3nodes_4gpus.slurm").read_text()
    text = text.replace("--nlayers 16 --chunks 4 --batch-size 64 --epochs 2",
                        "--nlayers 2 --chunks 2 --batch-size 16 --epochs 2 --synthetic 1500 --log-every 0")
    assert "--log-every 0" in text and "scontrol requeue" in text and "--signal=USR1@" in text
    (workdir / "requeue.slurm").write_text(text)
    r = run(["sbatch", "--parsable", "requeue.slurm"], slurm_cluster, workdir)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    log = workdir / f"hybrid_3x4_{job}.out"
    deadline = time.monotonic() + 240
    while not (log.exists() and "epoch 1 step 3/" in log.read_text()):
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.2)
    assert run(["scancel", "--signal=USR1", job], slurm_cluster, workdir).returncode == 0
    seen = []
    # poll until COMPLETED: around the requeue Slurm shows passing states for the stopped run. The requeued job
    # waits cred_expire (15 s on the test cluster, 120 s by default) before it may start again.
    while (state := job_state(slurm_cluster, workdir, job)).get("JobState") != "COMPLETED":
        seen.append(str(state.get("JobState")))
        assert time.monotonic() < deadline + 240, (state, sorted(set(seen)))
        time.sleep(0.5)
    out = log.read_text()
    err = (workdir / f"hybrid_3x4_{job}.err").read_text()
    assert state["JobState"] == "COMPLETED" and state.get("Restarts") == "1", (state, out[-3000:], err[-3000:])
    assert "stopping on SIGUSR1 at epoch 1" in out and "checkpoint saved to" in out
    stopped_at = re.search(r"at epoch 1, batch (\d+)/", out).group(1)
    assert f"loaded hybrid_3x4.pt: epoch 0 + {stopped_at} batches" in out
    assert out.count("summary:") == 1 and "=> OK" in out.split("stopping on SIGUSR1")[1]  # pre-flight ran again
    [record] = [json.loads(line) for line in (workdir / "hybrid_results.jsonl").read_text().splitlines()]
    assert record["world_size"] == 6 and len(record["epochs"]) == 2


def test_scancel_then_a_new_submission_resumes(slurm_cluster, workdir):
    """scancel (SIGTERM to every task, as a preemption does): the tasks agree on a step, checkpoint and stop; the
    job ends CANCELLED, not requeued. A new `sbatch` of the same script (a new job id) continues from the file."""
    import time
    text = (workdir / "page_3nodes_4gpus.slurm").read_text()
    text = text.replace("--nlayers 16 --chunks 4 --batch-size 64 --epochs 2",
                        "--nlayers 2 --chunks 2 --batch-size 16 --epochs 2 --synthetic 1500 --log-every 0")
    (workdir / "again.slurm").write_text(text)
    first = run(["sbatch", "--parsable", "again.slurm"], slurm_cluster, workdir).stdout.strip().split(";")[0]
    log = workdir / f"hybrid_3x4_{first}.out"
    deadline = time.monotonic() + 240
    while not (log.exists() and "epoch 1 step 3/" in log.read_text()):
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.2)
    assert run(["scancel", first], slurm_cluster, workdir).returncode == 0
    while job_state(slurm_cluster, workdir, first).get("JobState") != "CANCELLED":
        assert time.monotonic() < deadline, job_state(slurm_cluster, workdir, first)
        time.sleep(0.5)
    out = log.read_text()
    assert "stopping on SIGTERM at epoch 1" in out, out[-3000:]
    stopped_at = re.search(r"at epoch 1, batch (\d+)/", out).group(1)
    r = run(["sbatch", "--wait", "--parsable", "again.slurm"], slurm_cluster, workdir, timeout=600)
    second = r.stdout.strip().split(";")[0]
    out2 = (workdir / f"hybrid_3x4_{second}.out").read_text()
    assert r.returncode == 0 and second != first, (r.stderr, out2[-3000:])
    assert f"loaded hybrid_3x4.pt: epoch 0 + {stopped_at} batches" in out2, out2[-3000:]
    assert out2.count("summary:") == 1 and len(re.findall(r"^epoch +\d+ \|", out2, re.M)) == 2


def page_job_with_workers(workdir: Path, name: str) -> str:
    """The page's template, a small model, and 2 DataLoader workers per task (as a GPU run has them): 6 trainers
    and 12 workers, every one of them a process of the step that Slurm signals."""
    text = (workdir / "page_3nodes_4gpus.slurm").read_text()
    text = text.replace("--nlayers 16 --chunks 4 --batch-size 64 --epochs 2",
                        "--nlayers 2 --chunks 2 --batch-size 16 --epochs 2 --synthetic 1500 --log-every 0 --workers 2")
    text = text.replace("hybrid_3x4", name)
    assert "--workers 2" in text and f"--save {name}.pt" in text
    (workdir / f"{name}.slurm").write_text(text)
    return f"{name}.slurm"


def submitted_and_training(cluster, workdir: Path, script: str, name: str) -> tuple[str, Path]:
    import time
    r = run(["sbatch", "--parsable", script], cluster, workdir)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    log = workdir / f"{name}_{job}.out"
    deadline = time.monotonic() + 300
    while not (log.exists() and "epoch 1 step 3/" in log.read_text()):  # the workers serve the steps
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.2)
    return job, log


def test_scancel_with_dataloader_workers_checkpoints(slurm_cluster, workdir):
    """scancel (SIGCONT then SIGTERM to every process of every step, the workers included; SIGKILL KillWait
    later, 5 s here): the trainers checkpoint and every task exits 75. Before, each worker died by the SIGTERM
    (torch's worker handler), its trainer on "DataLoader worker (pid ...) is killed by signal: Terminated",
    rc 1, and no checkpoint."""
    import time
    job, log = submitted_and_training(slurm_cluster, workdir, page_job_with_workers(workdir, "cancel_w"), "cancel_w")
    assert run(["scancel", job], slurm_cluster, workdir).returncode == 0
    deadline = time.monotonic() + 120
    while job_state(slurm_cluster, workdir, job).get("JobState") != "CANCELLED":
        assert time.monotonic() < deadline, job_state(slurm_cluster, workdir, job)
        time.sleep(0.5)
    out, err = read_job_files(workdir, "cancel_w", job)
    assert "stopping on SIGTERM at epoch 1" in out and "checkpoint saved to cancel_w.pt" in out, out[-3000:] + err
    assert "killed by signal" not in out + err and "Traceback" not in out + err, err[-3000:]
    assert (workdir / "cancel_w.pt").exists() and (workdir / "cancel_w.pt.resume.pt").exists()


def test_sigterm_to_the_steps_with_workers_requeues_and_resumes(slurm_cluster, workdir):
    """`scancel --signal=TERM` (SIGTERM to every process of the steps, the job kept, as a preemption notice):
    with 2 workers per task, the step exits 75, so the template requeues the job, which resumes and completes."""
    import time
    job, log = submitted_and_training(slurm_cluster, workdir, page_job_with_workers(workdir, "term_w"), "term_w")
    assert run(["scancel", "--signal=TERM", job], slurm_cluster, workdir).returncode == 0
    deadline = time.monotonic() + 480
    while (state := job_state(slurm_cluster, workdir, job)).get("JobState") != "COMPLETED":
        assert time.monotonic() < deadline, state
        time.sleep(0.5)
    out, err = read_job_files(workdir, "term_w", job)
    assert state.get("Restarts") == "1", (state, out[-3000:], err[-3000:])
    assert "stopping on SIGTERM at epoch 1" in out and "checkpoint saved to term_w.pt" in out, out[-3000:]
    stopped_at = re.search(r"at epoch 1, batch (\d+)/", out).group(1)
    assert f"loaded term_w.pt: epoch 0 + {stopped_at} batches" in out and out.count("summary:") == 1, out[-3000:]
    assert "killed by signal" not in out + err, err[-3000:]

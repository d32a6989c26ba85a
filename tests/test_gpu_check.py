"""benchmarks/gpu_check.py on the CPU: its arguments, its refusal without a GPU, and how it compares like with like
(the interleaving, the medians, the bare loop in as many processes as the script's tasks); the GPU run needs one."""
from __future__ import annotations

import subprocess
import sys

import pytest

from launch import ROOT, without_gpu

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check as g  # noqa: E402


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return without_gpu("benchmarks/gpu_check.py", *args)


def test_no_gpu_is_refused_in_one_line():
    r = gpu_check()
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: error: no CUDA GPU here"), r.stderr
    assert "srun --gres=gpu:1" in lines[0] and "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize("args,needle", [
    (["--steps", "0"], "--steps 0 must be at least 1"),
    (["--untimed-steps", "-1"], "--untimed-steps -1 must be 0 or more"),
    (["--warmup", "-1"], "--untimed-steps -1 must be 0 or more"),
    (["--repeats", "2"], "--repeats 2 must be at least 3"),
    (["--chunks", "3"], "--chunks 3 must divide --batch-size 64"),
    (["--precision", "fp8"], "invalid choice: 'fp8'"),
    (["--sync-debug", "loud"], "invalid choice: 'loud'"),
])
def test_bad_arguments_name_the_value(args, needle):
    r = gpu_check(*args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_one_gpu_rows_put_every_part_on_gpu_0():
    assert g.one_gpu_devices(1, 1) is None and g.one_gpu_devices(2, 2) is None
    assert g.one_gpu_devices(2, 1) == "0,0" and g.one_gpu_devices(4, 1) == "0,0,0,0"


def test_tasks_sharing_a_gpu_each_get_a_host_id():
    """--tasks 2 on a one-GPU machine: both tasks on GPU 0, each with its own NCCL_HOSTID (nccl then treats them as
    two hosts instead of refusing two ranks on one GPU), torchrun's variables so idr_torch reads them even in srun."""
    assert g.one_gpu_devices(1, 1, tasks=2) == "0" and g.one_gpu_devices(2, 1, tasks=2) == "0,0"
    assert g.one_gpu_devices(1, 4, tasks=2) is None and g.one_gpu_devices(2, 4, tasks=2) is None
    shared = g.task_envs(2, shared_gpu=True)
    assert [e["NCCL_HOSTID"] for e in shared] == ["gpu-check-task-0", "gpu-check-task-1"]
    assert [e["RANK"] for e in shared] == ["0", "1"] and {e["WORLD_SIZE"] for e in shared} == {"2"}
    assert len({e["MASTER_PORT"] for e in shared}) == 1 and all(e["TORCHELASTIC_RUN_ID"] for e in shared)
    own = g.task_envs(2, shared_gpu=False)
    assert not any("NCCL_HOSTID" in e for e in own)
    import idr_torch
    launches = [idr_torch.Launch(dict(e, SLURM_PROCID="0", SLURM_STEP_ID="0", SLURM_NTASKS="1")) for e in shared]
    assert [(x.launcher, x.rank, x.local_rank, x.size) for x in launches] == [("torchrun", 0, 0, 2),
                                                                             ("torchrun", 1, 1, 2)]


def test_tasks_must_be_positive():
    r = gpu_check("--tasks", "0")
    assert r.returncode == 2 and "--tasks 0 must be at least 1" in r.stderr, r.stderr


def test_script_and_bare_loop_alternate_and_the_medians_are_compared():
    """A B A B A B, --repeats of each; the ratio is of the medians, so one slow run on either side (a clock dip, a
    neighbour's burst) does not move it. The old check ran each side once: the first script run against one loop."""
    order: list[str] = []
    script_rates, bare_rates = iter([100.0, 40.0, 98.0]), iter([104.0, 103.0, 200.0])

    def script() -> float:
        order.append("script")
        return next(script_rates)

    def bare() -> float:
        order.append("bare")
        return next(bare_rates)
    a, b = g.interleave(3, script, bare)
    assert order == ["script", "bare"] * 3 and a == [100.0, 40.0, 98.0] and b == [104.0, 103.0, 200.0]
    c = g.compare(a, b)
    assert c["script_samples_per_s"] == 98.0 and c["bare_samples_per_s"] == 104.0
    assert c["ratio"] == pytest.approx(98.0 / 104.0) and c["script_runs"] == a and c["bare_runs"] == b
    assert g.cell(a, c["script_samples_per_s"]) == "98.0 (40.0-100.0)"


def test_bare_rate_is_every_process_over_the_common_span():
    """Two processes sharing a GPU: their samples together over the span from the first start to the last end (the
    script's rate is over all its replicas), not one process's rate, nor the sum of rates over different spans."""
    windows = [dict(samples=640, t0=10.0, t1=20.0), dict(samples=640, t0=10.5, t1=21.0)]
    assert g.aggregate(windows) == pytest.approx(1280 / 11.0)
    assert g.aggregate(windows[:1]) == pytest.approx(64.0)


@pytest.mark.multiproc
def test_bare_loop_runs_in_as_many_processes_as_the_scripts_tasks():
    """--tasks 2: the bare loop is two processes at once (the trainer's own parts, on the CPU here: no GPU), kept for
    the row's repeats, each run timing a fresh window in both; a row of 2 tasks on one GPU compared with one process
    owning the GPU was the old 0.341."""
    args = g.parse_args(["--tasks", "2", "--nlayers", "2", "--steps", "2", "--untimed-steps", "1", "--batch-size",
                         "8", "--chunks", "2", "--timeout", "120"])
    bare = g.BareLoops(args, nb_part=2, devices=None)
    try:
        rates = [bare.run("fp32"), bare.run("bf16")]
        windows = bare.windows
    finally:
        bare.close()
    assert all(r > 0 for r in rates), rates
    assert len({w["pid"] for w in windows}) == 2 and all(w["samples"] == 2 * 8 for w in windows), windows
    assert {p.pid for p in bare.procs} == {w["pid"] for w in windows}
    assert all(p.returncode == 0 for p in bare.procs), bare.log


def test_a_bare_loop_that_fails_says_why_in_one_line():
    args = g.parse_args(["--timeout", "60"])
    args.nlayers = 0  # past gpu_check's own check: the trainer's parser, in the worker, refuses it
    with pytest.raises(RuntimeError, match=r"^the bare loop's process 0 ended \(exit 1\): .*--nlayers 0 must be"):
        g.BareLoops(args, nb_part=1, devices=None)

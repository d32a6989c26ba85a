"""idr_torch: launcher facts from environment tables (no processes, no torch)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import hostlist
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import idr_torch
from idr_torch import Launch, LaunchError

ROOT = Path(__file__).resolve().parent.parent

# Every variable the module may read, cleared before each test so the host's own environment never leaks in.
LAUNCH_VARS = [
    "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS",
    "SLURM_NPROCS", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
    "SLURM_NTASKS_PER_NODE", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_CPUS_PER_TASK",
    "SLURM_STEP_GPUS", "SLURM_JOB_ID", "SLURM_JOBID", "CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT",
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)


def srun_env(procid: int, localid: int, nodeid: int, ntasks: int = 6, tpn: str = "2(x3)",
             nodelist: str = "node[1-3]", **extra: str) -> dict[str, str]:
    """The variables srun gives one task (seen on the test cluster: srun -N3 --ntasks-per-node=2)."""
    env = {
        "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid),
        "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": str(ntasks),
        "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_STEP_TASKS_PER_NODE": tpn, "SLURM_TASKS_PER_NODE": tpn,
        "SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_NODELIST": nodelist, "SLURM_CPUS_PER_TASK": "10",
        "SLURM_STEP_GPUS": "0,1,2,3", "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    }
    env.update(extra)
    return env


# ---- the page's 3 nodes x 2 tasks ------------------------------------------------------------------------------
LAYOUT_3x2 = [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1), (4, 0, 2), (5, 1, 2)]


@pytest.mark.parametrize("procid,localid,nodeid", LAYOUT_3x2)
def test_srun_three_nodes_two_tasks(procid, localid, nodeid):
    launch = Launch(srun_env(procid, localid, nodeid))
    assert launch.launcher == "slurm"
    assert (launch.rank, launch.size, launch.world_size) == (procid, 6, 6)
    assert (launch.local_rank, launch.node_id, launch.num_nodes) == (localid, nodeid, 3)
    assert launch.local_world_size == launch.ntasks_per_node == 2
    assert launch.hostnames == ["node1", "node2", "node3"]
    assert launch.nodelist == "node[1-3]"
    assert launch.master_addr == "node1"
    assert launch.cpus_per_task == 10
    assert launch.step_gpus == ["0", "1", "2", "3"]
    assert launch.job_id == "4242"
    assert launch.is_master == (procid == 0)


def test_every_task_derives_the_same_port_and_jobs_differ():
    ports = {Launch(srun_env(*t)).master_port for t in LAYOUT_3x2}
    assert len(ports) == 1
    port = ports.pop()
    assert 10000 <= port < 30000
    other_job = Launch(srun_env(0, 0, 0, SLURM_JOB_ID="4243")).master_port
    other_step = Launch(srun_env(0, 0, 0, SLURM_STEP_ID="1")).master_port
    assert len({port, other_job, other_step}) == 3


@pytest.mark.parametrize("procid,localid,nodeid,expect_local", [
    (0, 0, 0, 2), (1, 1, 0, 2), (2, 0, 1, 2), (3, 1, 1, 2), (4, 0, 2, 1)])
def test_uneven_tasks_per_node(procid, localid, nodeid, expect_local):
    env = srun_env(procid, localid, nodeid, ntasks=5, tpn="2(x2),1")
    launch = Launch(env)
    assert launch.tasks_per_node == [2, 2, 1]
    assert launch.local_world_size == expect_local
    assert launch.num_nodes == 3


def test_uneven_first_node_larger():
    launch = Launch(srun_env(4, 0, 1, ntasks=8, tpn="4,2(x2)"))
    assert launch.tasks_per_node == [4, 2, 2]
    assert launch.local_world_size == 2


def test_step_values_win_over_job_values():
    # a step on part of the allocation: the job has 3 nodes x 2, the step runs 2 tasks on node2
    env = srun_env(1, 1, 0, ntasks=2, tpn="2", nodelist="node2",
                   SLURM_NTASKS="6", SLURM_TASKS_PER_NODE="2(x3)", SLURM_JOB_NODELIST="node[1-3]")
    launch = Launch(env)
    assert (launch.size, launch.tasks_per_node, launch.hostnames, launch.master_addr) == (2, [2], ["node2"], "node2")


def test_ntasks_per_node_only_used_when_lists_are_missing():
    env = srun_env(3, 1, 1)
    del env["SLURM_STEP_TASKS_PER_NODE"], env["SLURM_TASKS_PER_NODE"]
    env["SLURM_NTASKS_PER_NODE"] = "2"
    assert Launch(env).tasks_per_node == [2, 2, 2]


def test_torchrun():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           "MASTER_ADDR": "host-a", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "none"}
    launch = Launch(env)
    assert launch.launcher == "torchrun"
    assert (launch.rank, launch.size, launch.local_rank, launch.local_world_size) == (5, 8, 1, 4)
    assert (launch.node_id, launch.num_nodes, launch.master_addr, launch.master_port) == (1, 2, "host-a", 29400)


def test_torchrun_inside_srun_uses_torchrun_ranks():
    env = srun_env(0, 0, 0, ntasks=3, tpn="1(x3)")
    env.update(RANK="6", WORLD_SIZE="12", LOCAL_RANK="2", LOCAL_WORLD_SIZE="4", TORCHELASTIC_RUN_ID="j",
               MASTER_ADDR="node1", MASTER_PORT="29500")
    launch = Launch(env)
    assert (launch.launcher, launch.rank, launch.size, launch.node_id) == ("torchrun", 6, 12, 1)


def test_stale_rank_variables_do_not_beat_srun():
    # RANK exported by hand in the batch script is the same in every task; SLURM_PROCID is not
    env = srun_env(3, 1, 1, RANK="0", WORLD_SIZE="6", LOCAL_RANK="0")
    assert Launch(env).launcher == "slurm"
    assert Launch(env).rank == 3


def test_plain_python():
    launch = Launch({})
    assert launch.launcher == "python"
    assert (launch.rank, launch.size, launch.local_rank, launch.num_nodes) == (0, 1, 0, 1)
    assert launch.master_addr == "127.0.0.1"
    assert 0 < launch.master_port < 65536
    assert launch.cpus_per_task == len(os.sched_getaffinity(0))


def test_batch_script_without_srun_is_one_process():
    # the batch step has SLURM_PROCID=0 and SLURM_NTASKS=6 but no step id (seen on the test cluster)
    env = srun_env(0, 0, 0)
    del env["SLURM_STEP_ID"], env["SLURM_STEP_NUM_TASKS"], env["SLURM_STEP_TASKS_PER_NODE"]
    launch = Launch(env)
    assert (launch.launcher, launch.size) == ("python", 1)


def test_plain_python_says_so_once(monkeypatch, capsys):
    monkeypatch.setattr(idr_torch, "_said_plain", False)
    monkeypatch.setattr(idr_torch, "_current", None)
    assert (idr_torch.rank, idr_torch.size, idr_torch.local_rank) == (0, 1, 0)
    assert idr_torch.hostnames
    err = capsys.readouterr().err
    assert err.count("running as rank 0 of 1") == 1


def test_module_names_follow_the_environment(monkeypatch):
    for k, v in srun_env(5, 1, 2).items():
        monkeypatch.setenv(k, v)
    assert (idr_torch.rank, idr_torch.size, idr_torch.local_rank, idr_torch.cpus_per_task) == (5, 6, 1, 10)
    assert idr_torch.hostnames == ["node1", "node2", "node3"]
    with pytest.raises(AttributeError):
        idr_torch.no_such_name


# ---- MASTER_* precedence and export ---------------------------------------------------------------------------
def test_master_set_by_user_is_kept(monkeypatch):
    env = srun_env(2, 0, 1, MASTER_ADDR="10.0.0.7", MASTER_PORT="23456")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    exported = idr_torch.export_env()
    assert exported["MASTER_ADDR"] == os.environ["MASTER_ADDR"] == "10.0.0.7"
    assert exported["MASTER_PORT"] == os.environ["MASTER_PORT"] == "23456"
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("2", "6", "0")
    assert os.environ["LOCAL_WORLD_SIZE"] == "2"
    # exporting RANK must not turn an srun task into a "torchrun" one
    assert idr_torch.current().launcher == "slurm"


def test_master_derived_when_unset(monkeypatch):
    for k, v in srun_env(4, 0, 2, SLURM_STEP_NODELIST="r7i[0-2]", SLURM_JOB_NODELIST="r7i[0-2]").items():
        monkeypatch.setenv(k, v)
    exported = idr_torch.export_env()
    assert exported["MASTER_ADDR"] == "r7i0"
    assert int(exported["MASTER_PORT"]) == Launch(srun_env(0, 0, 0)).master_port


# ---- hostlists ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,hosts", [
    ("r7i[0-2,5],r8i1", ["r7i0", "r7i1", "r7i2", "r7i5", "r8i1"]),
    ("n[001-010]", [f"n{i:03d}" for i in range(1, 11)]),
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
    ("jean-zay-iam01", ["jean-zay-iam01"]),
])
def test_hostlist_forms(value, hosts):
    assert idr_torch.expand_nodelist(value) == hosts


@pytest.mark.parametrize("value", ["r7i[0-2", "r7i[3-1]", "n]1", "a[1-2],b[", "node[1-2]"])
def test_malformed_hostlist_names_variable_and_value(value):
    env = srun_env(0, 0, 0, SLURM_STEP_NODELIST=value, SLURM_JOB_NODELIST=value)
    with pytest.raises(LaunchError) as err:
        Launch(env)
    assert "SLURM_STEP_NODELIST" in str(err.value) and repr(value) in str(err.value)


@pytest.mark.parametrize("value,counts", [("2(x3)", [2, 2, 2]), ("2(x2),1", [2, 2, 1]), ("4,2(x2)", [4, 2, 2]),
                                          ("1", [1])])
def test_tasks_per_node_forms(value, counts):
    assert idr_torch.parse_tasks_per_node(value) == counts


@pytest.mark.parametrize("value", ["2(x", "two", "2(x0)", "0", "-1", "2,,1", "2(x2)1"])
def test_malformed_tasks_per_node(value):
    with pytest.raises(LaunchError) as err:
        Launch(srun_env(0, 0, 0, SLURM_STEP_TASKS_PER_NODE=value))
    assert "SLURM_STEP_TASKS_PER_NODE" in str(err.value) and repr(value) in str(err.value)


# ---- missing and malformed variables ---------------------------------------------------------------------------
@pytest.mark.parametrize("var,value,needle", [
    ("SLURM_PROCID", "abc", "SLURM_PROCID='abc' is not an integer"),
    ("SLURM_PROCID", "7", "rank 7"),
    ("SLURM_LOCALID", "-1", "SLURM_LOCALID='-1' must be >= 0"),
    ("SLURM_LOCALID", "2", "local rank 2"),
    ("SLURM_NODEID", "3", "SLURM_NODEID"),
    ("SLURM_STEP_NUM_TASKS", "0", "SLURM_STEP_NUM_TASKS='0' must be >= 1"),
    ("SLURM_STEP_NUM_TASKS", "5", "adds up to 6 tasks but the world size is 5"),
    ("SLURM_CPUS_PER_TASK", "ten", "SLURM_CPUS_PER_TASK='ten'"),
    ("MASTER_PORT", "99999", "MASTER_PORT=99999"),
    ("MASTER_PORT", "x", "MASTER_PORT='x'"),
])
def test_bad_values_name_the_variable(var, value, needle):
    env = srun_env(0, 0, 0, **{var: value})
    with pytest.raises(LaunchError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        launch = Launch(env)
        launch.cpus_per_task, launch.master_port


def test_missing_nodelist_is_named():
    env = srun_env(0, 0, 0, SLURM_STEP_NODELIST="", SLURM_JOB_NODELIST="")
    with pytest.raises(LaunchError, match="SLURM_STEP_NODELIST / SLURM_JOB_NODELIST is not set"):
        Launch(env)


def test_missing_variable_is_named():
    env = srun_env(0, 0, 0)
    del env["SLURM_LOCALID"]
    with pytest.raises(LaunchError, match="SLURM_LOCALID is not set"):
        Launch(env)


def test_torchrun_world_not_multiple_of_local():
    with pytest.raises(LaunchError, match="WORLD_SIZE=6 is not a multiple of LOCAL_WORLD_SIZE=4"):
        Launch({"RANK": "0", "WORLD_SIZE": "6", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4",
                "TORCHELASTIC_RUN_ID": "x"})


def test_cli_summary_and_cli_error():
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    ok = subprocess.run([sys.executable, str(ROOT / "idr_torch.py")], env={**env, **srun_env(3, 1, 1)},
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "rank / size   3 / 6" in ok.stdout and "node1:" in ok.stdout and "per node [2, 2, 2]" in ok.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "idr_torch.py")],
                         env={**env, **srun_env(0, 0, 0, SLURM_NODEID="x")}, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == ["idr_torch: SLURM_NODEID='x' is not an integer; fix or unset it"]


def test_no_torch_import():
    out = subprocess.run([sys.executable, "-c", "import sys, idr_torch; idr_torch.current(); "
                          "print('torch' in sys.modules)"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# ---- property: collecting then expanding gives the hosts back -------------------------------------------------
host_names = st.builds(lambda prefix, num, width: f"{prefix}{num:0{width}d}",
                       st.sampled_from(["n", "r7i", "gpu-", "jz", "a1b"]), st.integers(0, 999), st.integers(1, 4))


@settings(max_examples=200, deadline=None)
@given(st.lists(host_names, min_size=1, max_size=30, unique=True))
def test_collected_hostlist_expands_back(hosts):
    collected = hostlist.collect_hostlist(hosts)
    assert sorted(idr_torch.expand_nodelist(collected)) == sorted(hosts)

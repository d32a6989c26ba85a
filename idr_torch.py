#!/usr/bin/env python
"""Who am I? Facts about this process, read from whatever launched it.

    import idr_torch
    idr_torch.rank, idr_torch.size, idr_torch.local_rank, idr_torch.hostnames, idr_torch.cpus_per_task
    idr_torch.export_env()        # MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK for init_method="env://"

    python idr_torch.py           # one-screen summary of this process (under srun: one per task)

Three launchers are recognised, in this order:
  torchrun  TORCHELASTIC_RUN_ID, or RANK/WORLD_SIZE/LOCAL_RANK outside a Slurm task
  slurm     a task started by srun (SLURM_PROCID inside a job step)
  python    anything else, including a batch script that forgot srun: rank 0 of 1

The names are the page's (hostnames, size, rank, local_rank, cpus_per_task) plus a few more.
This module is the kit's one reader of the launch environment: each fact's variables are in one table per launcher
(LAUNCHERS, COMMON; the job's allocation: ALLOCATION), read in one place (Launch); every other module asks it
(tests/test_house.py holds that no other module reads SLURM_*, RANK, WORLD_SIZE, ... itself).
This module never imports torch: the pre-flight checker uses it before any GPU hour is spent.
"""
from __future__ import annotations

import os
import re
import socket
import sys
from functools import cached_property
from typing import Mapping

try:
    import hostlist
except ImportError:  # a cluster's PyTorch module brings torch, not this: one line, not a traceback
    sys.exit("idr_torch: error: python-hostlist is missing (it reads Slurm's node lists): "
             "pip install --user python-hostlist")

__all__ = ["Launch", "LaunchError", "allocation", "current", "env_rank", "export_env", "parse_tasks_per_node",
           "expand_nodelist"]


class LaunchError(ValueError):
    """A launcher variable is missing or malformed; the message names it, its value and the fix."""


# The most nodes a step's tasks-per-node list may describe: the largest machines have tens of thousands of nodes,
# Jean Zay about 2000. python-hostlist expands '1(x99999999)' into a list of that many counts: 11 kB of such text
# cost 1.5 GB before this bound (issue 35).
MAX_NODES = 65536


def expand_nodelist(value: str, variable: str = "nodelist") -> list[str]:
    """Expand a Slurm hostlist ('r7i[0-2,5],r8i1', 'n[001-010]', 'a[1-2]b[3-4]') into host names."""
    try:
        hosts = hostlist.expand_hostlist(value)
    except hostlist.BadHostlist as exc:
        raise LaunchError(f"{variable}={value!r} is not a valid Slurm hostlist ({exc}); "
                          "expected something like 'node[1-3],gpu7'") from None
    if not hosts or any(not h or any(c in h for c in "[]{},() \t") for h in hosts):
        raise LaunchError(f"{variable}={value!r} is not a valid Slurm hostlist; "
                          "expected something like 'node[1-3],gpu7'")
    return hosts


def parse_tasks_per_node(value: str, variable: str = "tasks per node") -> list[int]:
    """Expand Slurm's tasks-per-node string ('2(x3)', '2(x2),1', '4,2(x2)') into one count per node."""
    nodes = 0
    for item in value.split(","):
        m = re.search(r"\(x(\d{1,9})\)", item)
        nodes += int(m.group(1)) if m else 1
        if nodes > MAX_NODES or re.search(r"\(x\d{10}", item):
            raise LaunchError(f"{variable}={value[:40]!r}{'...' if len(value) > 40 else ''} describes more than "
                              f"{MAX_NODES} nodes, more than any machine has; Slurm sets it for each step: unset it, "
                              "or start the task with srun")
    try:
        counts = hostlist.parse_slurm_tasks_per_node(value.strip())
    except hostlist.BadHostlist as exc:
        raise LaunchError(f"{variable}={value!r} is not a Slurm tasks-per-node list ({exc}); "
                          "expected counts like '2(x3)' or '2(x2),1'") from None
    # python-hostlist accepts '0' and '2(x0)'; Slurm never writes them and they would mean a node with no task.
    if not counts or min(counts) < 1 or any(p.strip().endswith("(x0)") for p in value.split(",")):
        raise LaunchError(f"{variable}={value!r} lists a node with no task or no node at all; "
                          "expected positive counts like '2(x3)' or '2(x2),1'")
    return counts


# The launchers' variables, one table per launcher (submitit's JobEnvironment._env is the anchor: each fact of the
# process and the variables it is read from, in one place). The first variable set (and not empty) of a fact's tuple
# wins. A fact missing from a launcher's table is not that launcher's to say: a plain `python` is rank 0 of 1 on
# this host, torchrun's node id follows from its rank. Launch reads every fact through these tables (_names).
NODELIST = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
LAUNCHERS: dict[str, dict[str, tuple[str, ...]]] = {
    "slurm": {  # a task of an srun step
        "rank": ("SLURM_PROCID",),
        "size": ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"),
        "local_rank": ("SLURM_LOCALID",),
        "node_id": ("SLURM_NODEID",),
        "tasks_per_node": ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),  # srun always sets these
        "ntasks_per_node": ("SLURM_NTASKS_PER_NODE",),  # only --ntasks-per-node sets it: where the lists are missing
        "nodelist": NODELIST,
        "gpus_on_node": ("SLURM_GPUS_ON_NODE",),  # the step's GPUs on this node
    },
    "torchrun": {  # a worker of torchrun (also inside an srun task: its nodes are then the step's)
        "rank": ("RANK",),
        "size": ("WORLD_SIZE",),
        "local_rank": ("LOCAL_RANK",),
        "node_id": ("GROUP_RANK",),
        "local_world_size": ("LOCAL_WORLD_SIZE",),
        "nodelist": NODELIST,
    },
    "python": {},  # anything else, a batch script that forgot srun included: rank 0 of 1
}
# What any launcher's process may be given
COMMON: dict[str, tuple[str, ...]] = {
    "job_id": ("SLURM_JOB_ID", "SLURM_JOBID"),
    "job_name": ("SLURM_JOB_NAME",),
    "step_id": ("SLURM_STEP_ID", "SLURM_STEPID"),
    "cpus_per_task": ("SLURM_CPUS_PER_TASK",),  # what the job asked (-c), not what the task got (its affinity)
    "step_gpus": ("SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES"),
    "visible_gpus": ("CUDA_VISIBLE_DEVICES",),
    "master_addr": ("MASTER_ADDR",),
    "master_port": ("MASTER_PORT",),
    "agent_store": ("TORCHELASTIC_USE_AGENT_STORE",),  # torchrun's agent serves the rendezvous store itself
}
# How a launcher is recognised (detect), in this order
ELASTIC_RUN = "TORCHELASTIC_RUN_ID"
NOT_A_TASK = ("batch", "extern", "interactive")  # SLURM_STEP_ID of the job's own steps: a bare `python` there is alone

# The job's allocation as a batch script (and its steps) see it: what kit.allocation.job_from_allocation reads
# (`srun python check_topology.py`), and the modules the job loaded (Lmod and Environment Modules keep them there)
ALLOCATION: dict[str, tuple[str, ...]] = {
    "nodes": ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"), "ntasks": ("SLURM_NTASKS",),
    "ntasks_per_node": ("SLURM_NTASKS_PER_NODE",), "tasks_per_node": ("SLURM_TASKS_PER_NODE",),
    "gpus_on_node": ("SLURM_GPUS_ON_NODE",), "job_gpus": ("SLURM_JOB_GPUS",), "gpus_per_task": ("SLURM_GPUS_PER_TASK",),
    "gpu_bind": ("SLURM_GPU_BIND",), "cpus_per_task": ("SLURM_CPUS_PER_TASK",), "hint": ("SLURM_HINT",),
    "constraint": ("SLURM_JOB_CONSTRAINTS",), "partition": ("SLURM_JOB_PARTITION",),
    "account": ("SLURM_JOB_ACCOUNT",), "qos": ("SLURM_JOB_QOS",), "job_id": ("SLURM_JOB_ID", "SLURM_JOBID"),
    "nodelist": ("SLURM_JOB_NODELIST", "SLURM_NODELIST"), "modules": ("LOADEDMODULES",),
    # per-GPU sizing (sbatch --cpus-per-gpu, --mem-per-gpu) and the cores each node holds (issue 40)
    "cpus_per_gpu": ("SLURM_CPUS_PER_GPU",), "mem_per_gpu": ("SLURM_MEM_PER_GPU",),
    "cpus_per_node": ("SLURM_JOB_CPUS_PER_NODE",),
}


def first_set(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | tuple[None, None]:
    """The first of `names` that is set and not empty in `env`, as (name, value)."""
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None, None


def detect(env: Mapping[str, str]) -> str:
    """Which launcher started the process: torchrun (its run id, or its rank variables outside an srun task), slurm
    (an srun task: a rank inside a job step), or python (anything else)."""
    if env.get(ELASTIC_RUN):
        return "torchrun"
    slurm, torchrun = LAUNCHERS["slurm"], LAUNCHERS["torchrun"]
    step = first_set(env, COMMON["step_id"])[1]
    if first_set(env, slurm["rank"])[1] and step and step not in NOT_A_TASK:
        return "slurm"
    if all(env.get(torchrun[fact][0]) for fact in ("rank", "size", "local_rank")):
        return "torchrun"
    return "python"


def env_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's rank as its launcher's variable says it, unchecked: None where that is not a number. For what
    must be said once before the launch is read whole (Launch), or where reading it failed: a trainer's argument
    error, the stop signals' first notice, --check-args."""
    env = os.environ if environ is None else environ
    names = LAUNCHERS[detect(env)].get("rank")
    if names is None:
        return 0
    value = first_set(env, names)[1] or "0"
    return int(value) if value.isdigit() else None


def allocation(environ: Mapping[str, str] | None = None) -> dict[str, tuple[str, str] | tuple[None, None]]:
    """The job's allocation (ALLOCATION's facts), each as (variable, value) or (None, None) where unset."""
    env = os.environ if environ is None else environ
    return {fact: first_set(env, names) for fact, names in ALLOCATION.items()}


class Launch:
    """The launch facts of one process, computed from an environment mapping (os.environ by default) through its
    launcher's table (LAUNCHERS) and COMMON."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.env = dict(os.environ if environ is None else environ)
        self.launcher = detect(self.env)
        self._check()

    # ---- small helpers over the environment ------------------------------------------------------------
    def _names(self, fact: str) -> tuple[str, ...]:
        """The variables `fact` is read from under this launcher (COMMON's for every launcher); () where it has none."""
        return LAUNCHERS[self.launcher].get(fact) or COMMON.get(fact, ())

    def _get(self, fact: str) -> tuple[str, str] | tuple[None, None]:
        """The fact's first variable that is set and non-empty, as (name, value)."""
        return first_set(self.env, self._names(fact))

    def _int(self, fact: str, default: int | None = None, minimum: int = 0) -> int:
        names = self._names(fact)
        name, value = first_set(self.env, names)
        if name is None:
            if default is not None:
                return default
            raise LaunchError(f"{' / '.join(names)} is not set, but the {self.launcher} launcher needs it; "
                              "start one process per task with srun or torchrun, or unset the other variables")
        # ASCII digits, at most 18 (int() takes '٣' as 3 and raises on 5,000 digits: issue 42)
        if not re.fullmatch(r"[+-]?[0-9]{1,18}", value):
            raise LaunchError(f"{name}={value[:40]!r} is not an integer; fix or unset it")
        number = int(value)
        if number < minimum:
            raise LaunchError(f"{name}={value!r} must be >= {minimum}; fix or unset it")
        return number

    def _check(self) -> None:
        """Read every fact once so a bad variable fails here, with its name, not at first use."""
        for attr in ("size", "rank", "local_rank", "tasks_per_node", "node_id", "hostnames", "cpus_per_task",
                     "visible_gpus"):
            getattr(self, attr)
        if self.node_id >= self.num_nodes:
            node_var = (self._names("node_id") or ("node id",))[0]
            raise LaunchError(f"{node_var}={self.node_id} is not below the {self.num_nodes} node(s) of the step "
                              f"({self._tasks_var}={self.env.get(self._tasks_var or '', '')!r})")
        if self.rank >= self.size:
            raise LaunchError(f"rank {self.rank} (from {self._rank_var}) is not below the world size {self.size}; "
                              "the launcher's variables disagree: start the job with srun or torchrun")
        if self.local_rank >= self.local_world_size:
            raise LaunchError(f"local rank {self.local_rank} is not below the {self.local_world_size} task(s) on "
                              f"node {self.node_id} ({self._tasks_var}={self.env.get(self._tasks_var or '', '')!r})")
        if sum(self.tasks_per_node) != self.size:
            raise LaunchError(f"{self._tasks_var}={self.env.get(self._tasks_var or '', '')!r} adds up to "
                              f"{sum(self.tasks_per_node)} tasks but the world size is {self.size}")

    @property
    def _rank_var(self) -> str:
        return (self._names("rank") or ("default",))[0]

    # ---- the page's names: each read through the launcher's table, a plain python's default where it has none
    @cached_property
    def rank(self) -> int:
        """Global rank: SLURM_PROCID under srun, RANK under torchrun."""
        return self._int("rank", default=None if self._names("rank") else 0)

    @cached_property
    def size(self) -> int:
        """Number of processes (the page's `size`, torch's world size)."""
        return self._int("size", default=None if self._names("size") else 1, minimum=1)

    @property
    def world_size(self) -> int:
        return self.size

    @cached_property
    def local_rank(self) -> int:
        """Rank among the tasks of this node: it picks the task's GPUs."""
        return self._int("local_rank", default=None if self._names("local_rank") else 0)

    @cached_property
    def _tasks(self) -> tuple[str | None, list[int]]:
        if self.launcher == "slurm":
            name, value = self._get("tasks_per_node")
            if name is None:
                per_node = self._int("ntasks_per_node", minimum=1)
                return self._names("ntasks_per_node")[0], [per_node] * max(1, self.size // per_node)
            return name, parse_tasks_per_node(value, name)
        if self.launcher == "torchrun":
            per_node = self._int("local_world_size", default=self.size, minimum=1)
            if self.size % per_node:
                raise LaunchError(f"WORLD_SIZE={self.size} is not a multiple of LOCAL_WORLD_SIZE={per_node}")
            return self._names("local_world_size")[0], [per_node] * (self.size // per_node)
        return None, [1]

    @property
    def _tasks_var(self) -> str | None:
        return self._tasks[0]

    @property
    def tasks_per_node(self) -> list[int]:
        """Tasks on each node of the step, in node order (uneven counts such as 2(x2),1 are kept)."""
        return list(self._tasks[1])

    @cached_property
    def node_id(self) -> int:
        """Index of this node in the step (SLURM_NODEID, torchrun's GROUP_RANK)."""
        if self.launcher == "torchrun":
            return self._int("node_id", default=self.rank // self.tasks_per_node[0])
        return self._int("node_id", default=None if self._names("node_id") else 0)

    @property
    def num_nodes(self) -> int:
        return len(self.tasks_per_node)

    @property
    def local_world_size(self) -> int:
        """Tasks on *this* node (SLURM_NTASKS_PER_NODE only exists with --ntasks-per-node; this always does)."""
        return self.tasks_per_node[self.node_id]

    @property
    def ntasks_per_node(self) -> int:
        return self.local_world_size

    @cached_property
    def nodelist(self) -> str:
        """The step's nodes as Slurm writes them ('r7i[0-2,5],r8i1'); this host's name outside Slurm."""
        name, value = self._get("nodelist")
        if name is not None:
            return value
        if self.launcher == "slurm":
            raise LaunchError("SLURM_STEP_NODELIST / SLURM_JOB_NODELIST is not set in this srun task; "
                              "srun always sets them: start the task with srun, not by copying its variables")
        return socket.gethostname()

    @cached_property
    def hostnames(self) -> list[str]:
        """The nodes of the step, expanded and in Slurm's order (rank 0 runs on the first)."""
        name, _ = self._get("nodelist")
        hosts = expand_nodelist(self.nodelist, name or "hostname")
        if self.launcher == "slurm" and len(hosts) != self.num_nodes:
            raise LaunchError(f"{name}={self.nodelist!r} names {len(hosts)} node(s) but "
                              f"{self._tasks_var} describes {self.num_nodes}")
        return hosts

    @cached_property
    def cpus_asked(self) -> int | None:
        """SLURM_CPUS_PER_TASK: the CPUs per task the job asked for (-c); None where it asked none. Not what the task
        got: srun 22.05 does not pass --cpus-per-task on to a step (its affinity says what it got)."""
        return self._int("cpus_per_task", minimum=1) if self._get("cpus_per_task")[0] else None

    @cached_property
    def cpus_per_task(self) -> int:
        """SLURM_CPUS_PER_TASK, else the CPUs this process may run on (its affinity)."""
        if self.cpus_asked is not None:
            return self.cpus_asked
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:  # macOS has no affinity
            return os.cpu_count() or 1

    @cached_property
    def step_gpus(self) -> list[str]:
        """The node's GPUs Slurm gave this step (SLURM_STEP_GPUS, the node's numbering), else CUDA_VISIBLE_DEVICES;
        [] when none. Not what this process may use: that is visible_gpus."""
        name, value = self._get("step_gpus")
        if name is None or value in ("-1", "NoDevFiles"):
            return []
        return [g.strip() for g in value.split(",") if g.strip()]

    @cached_property
    def cuda_visible_devices(self) -> str | None:
        """CUDA_VISIBLE_DEVICES as it was given (None: unset), for the words of a report."""
        return self.env.get(self._names("visible_gpus")[0])

    @cached_property
    def visible_gpus(self) -> list[str]:
        """CUDA_VISIBLE_DEVICES as a list: the GPUs this process may use, in CUDA order; [] when none."""
        value = (self.cuda_visible_devices or "").strip()
        gpus = [] if value in ("-1", "NoDevFiles") else [g.strip() for g in value.split(",") if g.strip()]
        # CUDA and torch read a repeated index as no GPU at all (torch/cuda/__init__.py, _parse_visible_devices:
        # "Repeated ordinal results in empty set"): the plan would name GPUs the process cannot see
        ids = [str(int(g)) if g.isdigit() else g for g in gpus]
        twice = next((g for n, g in enumerate(ids) if g in ids[:n]), None)
        if twice is not None:
            raise LaunchError(f"CUDA_VISIBLE_DEVICES={value!r} names GPU {twice} twice: CUDA then shows no GPU at all "
                              "(a repeated index empties the list); give each GPU once, e.g. "
                              f"CUDA_VISIBLE_DEVICES={','.join(str(i) for i in range(len(gpus)))}, or unset it")
        return gpus

    @cached_property
    def gpus_on_node(self) -> int | None:
        """SLURM_GPUS_ON_NODE inside an srun task (the step's GPUs on this node), else None."""
        value = self._get("gpus_on_node")[1] or ""
        return int(value) if value.isdigit() else None

    @cached_property
    def job_id(self) -> str | None:
        return self._get("job_id")[1]

    @cached_property
    def job_name(self) -> str | None:
        return self._get("job_name")[1]

    @cached_property
    def step_id(self) -> int:
        value = self._get("step_id")[1]
        return int(value) if value and value.isdigit() else 0

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def master_addr_given(self) -> bool:
        """Whether someone set MASTER_ADDR (else the kit derives it: the step's first node)."""
        return self._names("master_addr")[0] in self.env

    @property
    def agent_store(self) -> bool:
        """torchrun's agent serves the rendezvous store itself, on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE)."""
        return self._get("agent_store")[1] == "True"

    @cached_property
    def master_addr(self) -> str:
        """MASTER_ADDR if someone set it, else the first host of the step (where rank 0 runs)."""
        set_by = self._get("master_addr")[1]
        if set_by:
            return set_by
        if self.launcher == "python":
            return "127.0.0.1"
        return self.hostnames[0]

    @cached_property
    def master_port(self) -> int:
        """MASTER_PORT if someone set it, else a port every task derives alone from the job and step ids.

        Derived ports stay in 10000..29999, below Linux's ephemeral range (32768+) so an outgoing
        connection never holds them; the step id keeps two steps of one job on one node apart.
        """
        if self._get("master_port")[0]:
            port = self._int("master_port", minimum=1)
            if port > 65535:
                raise LaunchError(f"MASTER_PORT={port} is not a TCP port (1..65535): export a free one, e.g. "
                                  "MASTER_PORT=29500, or unset it (the kit then derives one from the job id)")
            return port
        if self.job_id and self.job_id.isdigit():
            return 10000 + (int(self.job_id) % 4000) * 5 + self.step_id % 5
        if self.launcher == "python":  # one process: any free port will do
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return s.getsockname()[1]
        raise LaunchError(f"MASTER_PORT is not set and there is no numeric SLURM_JOB_ID to derive it from "
                          f"(SLURM_JOB_ID={self.job_id!r}); export MASTER_PORT=<free port> before launching")

    # ---- what init_process_group(init_method="env://") reads ------------------------------------------
    def export_env(self) -> dict[str, str]:
        """Export MASTER_ADDR/PORT (never overwriting ones already set), RANK, WORLD_SIZE, LOCAL_RANK,
        LOCAL_WORLD_SIZE into os.environ, and return what was exported."""
        exported = {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
        }
        os.environ.update(exported)
        self.env.update(exported)
        return exported

    def summary(self) -> str:
        lines = [
            f"launcher      {self.launcher}" + (f" (job {self.job_id}, step {self.step_id})" if self.job_id else ""),
            f"rank / size   {self.rank} / {self.size}   (local rank {self.local_rank})",
            f"node          {self.node_id} of {self.num_nodes}: {socket.gethostname()}",
            f"hosts         {self.nodelist} -> {', '.join(self.hostnames[:8])}"
            + (f", ... ({len(self.hostnames)})" if len(self.hostnames) > 8 else ""),
            f"tasks / node  {self.local_world_size} here; per node {self.tasks_per_node}",
            f"GPUs          {','.join(self.step_gpus) or 'none'}"
            + f"   (CUDA_VISIBLE_DEVICES={self.env.get('CUDA_VISIBLE_DEVICES', 'unset')})",
            f"CPUs / task   {self.cpus_per_task}",
            f"master        {self.master_addr}:{self.master_port}",
        ]
        return "\n".join(lines)


# ---- module-level names, as in IDRIS's idr_torch: `idr_torch.rank` ------------------------------------------
_current: Launch | None = None
_current_key: tuple | None = None
_said_plain = False


def current() -> Launch:
    """The Launch of this process, recomputed when the environment changed (tests, export_env)."""
    global _current, _current_key, _said_plain
    key = tuple(sorted(os.environ.items()))
    if _current is None or key != _current_key:
        _current, _current_key = Launch(), key
        if _current.launcher == "python" and not _said_plain:
            _said_plain = True
            where = f" inside Slurm job {_current.job_id} (no srun)" if _current.job_id else ""
            print(f"idr_torch: no srun or torchrun launcher found{where}: running as rank 0 of 1", file=sys.stderr)
    return _current


def export_env() -> dict[str, str]:
    """Export what init_process_group(init_method='env://') needs; see Launch.export_env."""
    return current().export_env()


def __getattr__(name: str):
    if name.startswith("_") or not hasattr(Launch, name):
        raise AttributeError(f"module 'idr_torch' has no attribute {name!r}")
    return getattr(current(), name)


if __name__ == "__main__":
    try:
        launch = current()
        text = launch.summary()
    except LaunchError as exc:
        print(f"idr_torch: {exc}", file=sys.stderr)
        sys.exit(2)
    # One write per task so srun's merged output keeps each summary in one piece.
    sys.stdout.write(f"---- task {launch.rank} of {launch.size} ----\n{text}\n")

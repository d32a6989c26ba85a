"""Inside an allocation (`srun python check_topology.py`): the job read from Slurm's environment, every
task's facts gathered on rank 0, and the same checks as for a file. Owns: the in-step check.
Imports: idr_torch, kit.arguments, kit.bounded, kit.checks, kit.findings, kit.plan, kit.releases, kit.report, kit.slurm.
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import asdict

import idr_torch
from kit.arguments import CPU_DEFAULTS, GPU_DEFAULTS, MAX_GPUS_PER_NODE, Training
from kit.bounded import read_commands, whole_number
from kit.checks import check_even, check_gpu_request, check_kit, check_site, dedupe_findings
from kit.findings import Finding, Findings, UsageError
from kit.plan import TaskPlan, plan_task
from kit.releases import torch_version_of
from kit.report import Report
from kit.slurm import Job


def job_from_allocation(env: dict[str, str]) -> Job:
    """The allocation a batch script runs in (SLURM_JOB_NUM_NODES, SLURM_TASKS_PER_NODE, SLURM_JOB_GPUS, ...), as
    idr_torch reads it from `env` (idr_torch.ALLOCATION)."""
    facts = idr_torch.allocation(env)

    def num(fact: str) -> int | None:
        name, v = facts[fact]
        if name is None:
            return None
        m = re.match(r"(?:[A-Za-z0-9_-]+:)?([0-9]+)$", v)  # ASCII digits, bounded (kit.bounded.whole_number)
        if not m:
            raise UsageError(f"{name}={v[:40]!r} is not a number")
        return whole_number(m.group(1))

    def text(fact: str, default: str | None = None) -> str | None:
        return facts[fact][1] or default
    tpn, cpn, gpus = facts["tasks_per_node"], facts["cpus_per_node"], text("job_gpus")
    job = Job(
        nodes=num("nodes"), ntasks=num("ntasks"), ntasks_per_node=num("ntasks_per_node"),
        # without a task count (no SLURM_NTASKS) the batch step's SLURM_TASKS_PER_NODE is no task count: it held the
        # cores (96, 40(x2)) for --cpus-per-gpu jobs (measured); srun runs one task a node there, as planned without
        tasks_per_node=idr_torch.parse_tasks_per_node(tpn[1], tpn[0]) if tpn[0] and facts["ntasks"][0] else None,
        gpus_per_node=num("gpus_on_node") or (len(gpus.split(",")) if gpus else None),
        gpus_per_task=num("gpus_per_task"), gpu_bind=text("gpu_bind"),
        cpus_per_task=num("cpus_per_task"), hint=text("hint"),
        constraint=text("constraint"), partition=text("partition"),
        account=text("account"), qos=text("qos"), time="allocated",
        # per-GPU sizing as the batch step and srun's tasks see it (measured: SLURM_CPUS_PER_GPU=24,
        # SLURM_MEM_PER_GPU=10240 for --mem-per-gpu=10G, SLURM_JOB_CPUS_PER_NODE=96 or 40(x2))
        cpus_per_gpu=num("cpus_per_gpu"), mem_per_gpu=num("mem_per_gpu"),
        cores_per_node=idr_torch.parse_tasks_per_node(cpn[1], cpn[0]) if cpn[0] else None,
        source=f"allocation of job {text('job_id', '?')} ({text('nodelist', '?')})")
    # Lmod and Environment Modules keep the loaded modules in LOADEDMODULES; the torch that runs is the installed
    # one (its package metadata: no torch import)
    job.modules = [m for m in (text("modules") or "").split(":") if m]
    job.torch_module = next((m for m in reversed(job.modules) if torch_version_of(m)), None)
    try:
        import importlib.metadata
        job.torch_version = importlib.metadata.version("torch")
    except Exception:  # no torch here, or broken metadata: the module line, if any, says which
        job.torch_version = None
    return job


def gpus_memory_here() -> tuple[float | None, str | None]:
    """The smallest GPU memory nvidia-smi shows in this allocation, in GiB (None without nvidia-smi), and why it is
    not known where nvidia-smi is there but its answer is not one: read bounded (kit.bounded.read_commands: 20 s in
    all, 64 kB; an endless nvidia-smi held 4.85 GB before), whole MiB in ASCII digits, one line per GPU."""
    import shutil
    if not shutil.which("nvidia-smi"):
        return None, None
    answer = read_commands({"smi": ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]},
                           20.0, max_bytes=1 << 16)["smi"]
    rows = answer.text.split()
    mib = [whole_number(x) for x in rows[:MAX_GPUS_PER_NODE + 1]]
    if answer.why or not 0 < len(rows) <= MAX_GPUS_PER_NODE or not all(mib) or max(mib) > 2 ** 24:
        why = answer.why or f"not 1 to {MAX_GPUS_PER_NODE} lines of whole MiB"
        return None, f"nvidia-smi's answer was not used ({why}): the GPUs' memory comes from -C/-p or --gpu-mem"
    return min(mib) / 1024, None


def task_facts(launch: idr_torch.Launch, training: Training) -> dict:
    """What this task really sees, for the collective report."""
    visible = launch.visible_gpus
    findings = Findings()
    plan = plan_task(launch.rank, launch.node_id, launch.local_rank, launch.local_world_size, visible,
                     launch.gpus_on_node, training.nlayers or (GPU_DEFAULTS if visible else CPU_DEFAULTS)["nlayers"],
                     1 if training.layout == "stage" else training.nb_part, findings, training.devices)
    try:
        import psutil
        affinity = len(psutil.Process().cpu_affinity())
    except (ImportError, AttributeError):
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    asked = launch.cpus_asked
    if asked is not None and affinity < asked:
        findings.warn("affinity-small", f"task {launch.rank} may run on {affinity} CPU(s) but asked "
                      f"--cpus-per-task={asked}: its DataLoader workers will share them")
    if not visible:
        findings.warn("no-gpu-visible", f"task {launch.rank} sees no GPU (CUDA_VISIBLE_DEVICES="
                      f"{launch.cuda_visible_devices!r}): the trainer will run its {plan.nb_part} parts on the CPU")
    return {"host": socket.gethostname(), "plan": asdict(plan), "findings": [asdict(f) for f in findings],
            "gpus_on_node": launch.gpus_on_node}


def collect_reports(launch: idr_torch.Launch, facts: dict,
                    timeout: float = 120.0) -> tuple[list[dict], list[socket.socket]]:
    """Rank 0: collect every task's facts over TCP on the job's master port (no torch, no shared disk).
    Returns the facts by rank ({"missing": True} for a task that never reported) and the open connections,
    on which the verdict is sent back."""
    got, conns = {0: facts}, []
    if launch.size > 1:
        with socket.create_server(("", launch.master_port), backlog=launch.size) as server:
            server.settimeout(1.0)
            deadline = time.monotonic() + timeout
            while len(got) < launch.size and time.monotonic() < deadline:
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    continue
                conn.settimeout(30)
                with conn.makefile("rb") as f:
                    line = f.readline(1 << 20)  # a task's facts are a few kB
                try:
                    msg = json.loads(line)
                    got[int(msg.pop("rank"))] = msg
                    conns.append(conn)
                except (ValueError, KeyError):
                    conn.close()
    return [got.get(r, {"missing": True}) for r in range(launch.size)], conns


def send_report(launch: idr_torch.Launch, facts: dict, timeout: float = 120.0) -> int:
    """Ranks > 0: send this task's facts to rank 0 and return the exit code it decides for everyone."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = socket.create_connection((launch.master_addr, launch.master_port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise UsageError(f"task {launch.rank} could not reach task 0 at {launch.master_addr}:"
                                 f"{launch.master_port} within {timeout:.0f}s")
            time.sleep(0.5)
    with conn:
        conn.sendall((json.dumps({"rank": launch.rank, **facts}) + "\n").encode())
        conn.settimeout(timeout + 30)
        with conn.makefile("rb") as f:
            verdict = f.readline(64).strip().decode("ascii", "replace")
    return whole_number(verdict) if whole_number(verdict) is not None and whole_number(verdict) < 256 else 1


def check_in_step(launch: idr_torch.Launch, training: Training,
                  gpu_mem: float | None = None) -> tuple[Report | None, int]:
    """srun python check_topology.py: every task checks what it sees; rank 0 prints one report."""
    defaulted = {"nlayers"} if training.nlayers is None else set()
    if training.nlayers is None:  # the trainer's default for what this task sees
        training.nlayers = (GPU_DEFAULTS if launch.visible_gpus else CPU_DEFAULTS)["nlayers"]
    facts = task_facts(launch, training)
    if launch.rank != 0:
        return None, send_report(launch, facts)
    result, conns = collect_reports(launch, facts)
    job = job_from_allocation(launch.env)
    job.gpu_mem = gpu_mem
    job.source = (f"srun step {launch.job_id}.{launch.step_id}: {launch.size} task(s) on {launch.nodelist}, "
                  "as each task sees it")
    job.tasks_per_node = launch.tasks_per_node
    findings, plans = Findings(), []
    for r, f in enumerate(result):
        if f.get("missing"):
            findings.error("task-missing", f"task {r} never reported to task 0 within the timeout; is it running?")
            continue
        plans.append(TaskPlan(**f["plan"]))
        findings.extend(Finding(**x) for x in f["findings"])
        if job.gpus_per_node is None and f.get("gpus_on_node") is not None:
            job.gpus_per_node = f["gpus_on_node"]
    dedupe_findings(findings)
    report = Report(job, training, plans, findings, defaulted=defaulted)  # the line's options, not the defaults
    if any(not p.cpu for p in plans):
        job.gpu_mem_seen, why = gpus_memory_here()
        report.notes += [why] if why else []
    gpn = job.gpus_per_node
    if gpn:
        check_gpu_request(job, gpn, findings)
    check_even(job, gpn, launch.tasks_per_node, findings)
    check_kit(report, launch.tasks_per_node, gpn)
    check_site(job, launch.tasks_per_node, (gpn // max(launch.tasks_per_node)) if gpn else 0, gpn, findings)
    code = 0 if report.ok else 1
    for c in conns:
        with c:
            try:
                c.sendall(f"{code}\n".encode())
            except OSError:
                pass
    return report, code

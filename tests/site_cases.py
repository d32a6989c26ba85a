"""Jean Zay's QoS and association rules as a real Slurm applies them: a table of batch scripts and what Slurm 22.05
(slurmctld + slurmdbd + MariaDB: tests/local_slurm.py's "accounting" variant) did with each, measured by
tests/test_site_slurmdbd.py. The checker's comparison can reuse CASES and fate().

A script's fate is one of:
  refused  `sbatch` exits 1 and no job exists; the text is its message (after "Batch job submission failed: ")
  pending  `sbatch` gives a job id, and the job waits with a reason that no time will change (squeue(1) %r, the
           reason codes of squeue(1) "JOB REASON CODES"): it pends forever, until scancel
  runs     the job starts (RUNNING, or already ended)
and `sbatch --test-only` says 'accepted' (it would start; "Job N to start at ...") or its refusal message.

What the cluster holds (local_slurm.ACCOUNTING_*): QoS qos_gpu-t3 (20 h, 512 GPUs per job, the default of the
@v100 accounts), qos_gpu-t4 (100 h, 16 GPUs), qos_gpu-dev (2 h, 32 GPUs), qos_gpu_a100-t3/-dev, qos_cpu-t3/-t4/-dev,
and qos_gpu-gc (a project's grant: 200 h, 64 GPUs) held by xyz@v100 only; the user's accounts abc@v100 (the default),
abc@a100, abc@cpu, xyz@v100; each partition's AllowQos names its node type's QoS. The QoS carry no flags, as sacctmgr
adds them, except where a case sets DenyOnLimit (sacctmgr(1) QOS "Flags"), which turns a limit into a refusal.

What the measures say (Slurm 22.05.8, AccountingStorageEnforce=associations,limits,qos, EnforcePartLimits unset):
- a QoS limit (MaxWall, MaxTRESPerJob) refuses nothing: sbatch gives a job id and the job pends forever with the
  reason code (QOSMaxWallDurationPerJobLimit, QOSMaxGRESPerJob), in squeue and in sacct; `sbatch --test-only` even
  names a start time. A --time equal to the QoS's MaxWall runs. With DenyOnLimit on the QoS, both refuse instead:
  "sbatch: error: <reason code>" then "Job violates accounting/QOS policy (...)";
- a QoS that is not in the association's list, or does not exist, and an account the user is not associated with
  are refused at submission, by --test-only too, and leave no job (no id, nothing in sacct);
- a QoS the partition's AllowQos does not name is accepted, and pends forever with a sentence for its reason
  ("Job's QOS not permitted to use this partition (gpu_p13 allows ... not qos_gpu_a100-t3)"), not a code. With
  EnforcePartLimits=ALL in slurm.conf (measured once by hand, not by the tests) it is refused at submission instead,
  by --test-only too: "Invalid qos specification"; the QoS limits still pend.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, NamedTuple

from local_slurm import ACCOUNTING_ACCOUNTS, LocalCluster

# squeue(1) JOB REASON CODES that only say the job waits its turn: it may still start
TRANSIENT_REASONS = ("None", "Priority", "Resources")
ACTIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED")

QOS_POLICY = "Job violates accounting/QOS policy (job submit limit, user's size and/or time limits)"
INVALID_QOS = "Invalid qos specification"
INVALID_ACCOUNT = "Invalid account or account/partition combination specified"
ALLOW_QOS_P13 = ("Job's QOS not permitted to use this partition (gpu_p13 allows qos_gpu-t3,qos_gpu-t4,qos_gpu-dev,"
                 "qos_gpu-gc not {qos})")


class Case(NamedTuple):
    name: str
    script: str
    kind: str  # the real sbatch's fate: 'refused' | 'pending' | 'runs'
    text: str  # the refusal's message, the pending reason, or "" when it runs
    test_only: str  # what `sbatch --test-only` said: 'accepted' or its refusal message
    deny_on_limit: tuple[str, ...] = ()  # QoS given Flags=DenyOnLimit while this case is measured


def script(*options: str, body: str = "srun hostname") -> str:
    """A batch script: one #SBATCH line per option, then the body."""
    return "#!/bin/bash\n" + "".join(f"#SBATCH {o}\n" for o in ("--job-name=site-case", *options)) + body + "\n"


V100 = ("--nodes=1", "--ntasks=1", "--gres=gpu:1", "--cpus-per-task=10")
CASES = [
    # slurm.conf(5) AccountingStorageEnforce=limits: a limit of the QoS does not refuse the job, it pends
    Case("time over qos_gpu-t3 (20 h)", script("--account=abc@v100", "--qos=qos_gpu-t3", "--time=25:00:00", *V100),
         "pending", "QOSMaxWallDurationPerJobLimit", "accepted"),
    Case("time over the default QoS, no --qos", script("--account=abc@v100", "--time=25:00:00", *V100),
         "pending", "QOSMaxWallDurationPerJobLimit", "accepted"),
    Case("time at qos_gpu-t3's 20 h", script("--account=abc@v100", "--qos=qos_gpu-t3", "--time=20:00:00", *V100),
         "runs", "", "accepted"),
    Case("time over qos_gpu-dev (2 h)", script("--account=abc@v100", "--qos=qos_gpu-dev", "--time=03:00:00", *V100),
         "pending", "QOSMaxWallDurationPerJobLimit", "accepted"),
    Case("qos_gpu-t4 with 20 GPUs (limit 16)", script("--account=abc@v100", "--qos=qos_gpu-t4", "--time=50:00:00",
                                                     "--nodes=5", "--ntasks-per-node=4", "--gres=gpu:4",
                                                     "--cpus-per-task=10"),
         "pending", "QOSMaxGRESPerJob", "accepted"),
    Case("qos_gpu-t4 with 16 GPUs, 100 h", script("--account=abc@v100", "--qos=qos_gpu-t4", "--time=100:00:00",
                                                 "--nodes=4", "--ntasks-per-node=4", "--gres=gpu:4",
                                                 "--cpus-per-task=10"),
         "runs", "", "accepted"),
    # DenyOnLimit on the QoS: the same limits refuse at submission (sbatch prints the reason code, then the policy)
    Case("time over qos_gpu-t3, DenyOnLimit", script("--account=abc@v100", "--qos=qos_gpu-t3", "--time=25:00:00",
                                                    *V100),
         "refused", f"QOSMaxWallDurationPerJobLimit | {QOS_POLICY}", f"QOSMaxWallDurationPerJobLimit | {QOS_POLICY}",
         ("qos_gpu-t3",)),
    Case("qos_gpu-t4 with 20 GPUs, DenyOnLimit", script("--account=abc@v100", "--qos=qos_gpu-t4", "--time=50:00:00",
                                                       "--nodes=5", "--ntasks-per-node=4", "--gres=gpu:4",
                                                       "--cpus-per-task=10"),
         "refused", f"QOSMaxGRESPerJob | {QOS_POLICY}", f"QOSMaxGRESPerJob | {QOS_POLICY}", ("qos_gpu-t4",)),
    # AccountingStorageEnforce=qos: the QoS must be in the association's list
    Case("qos_gpu-gc from abc@v100 (not granted)", script("--account=abc@v100", "--qos=qos_gpu-gc", *V100),
         "refused", INVALID_QOS, INVALID_QOS),
    Case("qos_gpu-gc from xyz@v100 (granted)", script("--account=xyz@v100", "--qos=qos_gpu-gc", "--time=150:00:00",
                                                     *V100),
         "runs", "", "accepted"),
    Case("a QoS that does not exist", script("--account=abc@v100", "--qos=qos_gpu-t5", *V100),
         "refused", INVALID_QOS, INVALID_QOS),
    Case("qos_gpu-t4 from abc@a100 (A100 has no t4)", script("--account=abc@a100", "--qos=qos_gpu-t4",
                                                             "--partition=gpu_p5", *V100),
         "refused", INVALID_QOS, INVALID_QOS),
    # AccountingStorageEnforce=associations: the account must be one of the user's
    Case("an account the user does not have", script("--account=nope@v100", *V100),
         "refused", INVALID_ACCOUNT, INVALID_ACCOUNT),
    # the partition's AllowQos (slurm.conf(5) PartitionName) is checked when the job is scheduled, not at submission
    Case("A100 QoS on the V100 partition", script("--account=abc@a100", "--qos=qos_gpu_a100-t3",
                                                  "--partition=gpu_p13", "--time=10:00:00", *V100),
         "pending", ALLOW_QOS_P13.format(qos="qos_gpu_a100-t3"), "accepted"),
    Case("@cpu account on the V100 partition", script("--account=abc@cpu", "--partition=gpu_p13", "--time=10:00:00",
                                                      *V100),
         "pending", ALLOW_QOS_P13.format(qos="qos_cpu-t3"), "accepted"),
    Case("good: V100 job, default QoS", script("--account=abc@v100", "--time=10:00:00", "--nodes=1",
                                              "--ntasks-per-node=4", "--gres=gpu:4", "--cpus-per-task=10"),
         "runs", "", "accepted"),
    Case("good: A100 job, qos_gpu_a100-dev", script("--account=abc@a100", "--partition=gpu_p5",
                                                   "--qos=qos_gpu_a100-dev", "--time=01:00:00", "--gres=gpu:8",
                                                   "--ntasks=8", "--cpus-per-task=8"),
         "runs", "", "accepted"),
    Case("good: CPU job, qos_cpu-t4", script("--account=abc@cpu", "--partition=cpu_p1", "--qos=qos_cpu-t4",
                                            "--time=90:00:00", "--ntasks=40"),
         "runs", "", "accepted"),
]


def _sbatch(cluster: LocalCluster, text: str, *flags: str) -> subprocess.CompletedProcess:
    """sbatch the script from a fresh folder under the cluster's (the job's output lands there)."""
    folder = Path(tempfile.mkdtemp(prefix="case-", dir=cluster.root))
    os.chmod(folder, 0o755)
    (folder / "job.sh").write_text(text)
    return subprocess.run(["sbatch", *flags, "job.sh"], cwd=folder, env=slurm_env(cluster), capture_output=True,
                          text=True, timeout=60)


def slurm_env(cluster: LocalCluster) -> dict[str, str]:
    """This process's environment less any SLURM_* / SBATCH_* of an enclosing job, with the cluster's SLURM_CONF."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    return {**env, **cluster.env}


def refusal(stderr: str) -> str:
    """sbatch's error lines, less their prefixes, joined by ' | ' (DenyOnLimit prints the reason code first)."""
    lines = []
    for line in stderr.splitlines():
        for prefix in ("sbatch: error: ", "Batch job submission failed: ", "allocation failure: "):
            line = line[len(prefix):] if line.startswith(prefix) else line
        if line.strip() and line not in lines:
            lines.append(line.strip())
    return " | ".join(lines)


def sbatch_test_only(cluster: LocalCluster, text: str) -> str:
    """What `sbatch --test-only` says of the script: 'accepted' (it names a start time) or its refusal."""
    out = _sbatch(cluster, text, "--test-only")
    return "accepted" if out.returncode == 0 and " to start at " in out.stderr else refusal(out.stderr)


def fate(cluster: LocalCluster, text: str, deadline_s: float = 30.0) -> tuple[str, str]:
    """Submit the script for real and read its fate: ('refused', message), ('pending', reason) or ('runs', ""). The
    job is cancelled after, and gone from the queue before this returns."""
    out = _sbatch(cluster, text, "--parsable")
    if out.returncode != 0:
        return "refused", refusal(out.stderr)
    job = out.stdout.strip().split(";")[0]
    try:
        return _watch(cluster, job, time.monotonic() + deadline_s)
    finally:
        _cancel(cluster, job, time.monotonic() + deadline_s)


def _job(cluster: LocalCluster, job: str) -> tuple[str, str]:
    """(state, reason) from squeue, or from sacct once slurmctld has forgotten the job (MinJobAge)."""
    out = subprocess.run(["squeue", "-h", "-t", "all", "-j", job, "-o", "%T|%r"], env=slurm_env(cluster),
                         capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        state, reason = out.stdout.strip().splitlines()[0].split("|", 1)
        return state, reason
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State,Reason"], env=slurm_env(cluster),
                         capture_output=True, text=True)
    state, _, reason = (out.stdout.strip().splitlines() or ["UNKNOWN|"])[0].partition("|")
    return state.split()[0] if state else "UNKNOWN", reason


def _watch(cluster: LocalCluster, job: str, deadline: float) -> tuple[str, str]:
    """Poll the job every 0.2 s until it has started (runs) or pends for a reason that is not its turn."""
    while True:
        state, reason = _job(cluster, job)
        if state not in ("PENDING", "UNKNOWN"):
            return "runs", ""
        if state == "PENDING" and reason not in TRANSIENT_REASONS:
            return "pending", reason
        if time.monotonic() > deadline:
            return ("pending", reason) if state == "PENDING" else ("unknown", f"{state} {reason}")
        time.sleep(0.2)


def _cancel(cluster: LocalCluster, job: str, deadline: float) -> None:
    """scancel the job and wait until it no longer holds nodes (the next case then finds the cluster empty)."""
    subprocess.run(["scancel", job], env=slurm_env(cluster), capture_output=True)
    while _job(cluster, job)[0] in ACTIVE_STATES and time.monotonic() < deadline:
        time.sleep(0.2)


@contextmanager
def deny_on_limit(cluster: LocalCluster, qos: tuple[str, ...], deadline_s: float = 30.0) -> Iterator[None]:
    """Give the QoS Flags=DenyOnLimit for the block (sacctmgr(1) "modify qos ... set Flags="), then take it back.
    slurmdbd pushes the change to slurmctld, which `scontrol show assoc_mgr` does not show the flags of: wait
    until a probe over the QoS's MaxWall is refused by `sbatch --test-only` (accepted again after)."""
    if not qos:
        yield
        return
    _set_flags(cluster, qos, "DenyOnLimit", refused=True, deadline=time.monotonic() + deadline_s)
    try:
        yield
    finally:
        _set_flags(cluster, qos, "-1", refused=False, deadline=time.monotonic() + deadline_s)


def _set_flags(cluster: LocalCluster, qos: tuple[str, ...], flags: str, refused: bool, deadline: float) -> None:
    account = next(a for a, (names, _) in ACCOUNTING_ACCOUNTS.items() if set(qos) <= set(names))
    cluster.sacctmgr("modify", "qos", ",".join(qos), "set", f"Flags={flags}")
    for q in qos:
        probe = script(f"--account={account}", f"--qos={q}", "--time=9999:00:00", "--gres=gpu:1")
        while (sbatch_test_only(cluster, probe) != "accepted") != refused:
            if time.monotonic() > deadline:
                raise TimeoutError(f"slurmctld did not apply Flags={flags} to {q}")
            time.sleep(0.2)

"""Jean Zay's QoS and association rules against a real slurmctld + slurmdbd + MariaDB (local_slurm.py's "accounting"
variant): what Slurm really does with each batch script of site_cases.CASES. `pytest -s` prints the measured table."""
from __future__ import annotations

import subprocess
import time

import pytest

from local_slurm import ACCOUNTING_ACCOUNTS, ACCOUNTING_QOS
from site_cases import CASES, INVALID_QOS, TRANSIENT_REASONS, deny_on_limit, fate, sbatch_test_only, script, slurm_env

pytestmark = pytest.mark.slurm


def sacctmgr_rows(cluster, *args: str) -> list[list[str]]:
    out = subprocess.run(["sacctmgr", "-n", "-P", "show", *args], env=slurm_env(cluster), capture_output=True,
                         text=True, check=True)
    return [line.split("|") for line in out.stdout.splitlines() if line]


def test_accounting_holds_jean_zays_qos_and_accounts(slurm_accounting):
    """The QoS and associations as slurmdbd keeps them ('@' is accepted in an account name), and slurmctld enforces
    them (slurm.conf(5) AccountingStorageEnforce)."""
    qos = {name: (wall, tres) for name, wall, tres in sacctmgr_rows(slurm_accounting, "qos",
                                                                     "format=name,maxwall,maxtres")}
    assert {name: qos[name] for name in ACCOUNTING_QOS} == ACCOUNTING_QOS
    assoc = {account: (tuple(sorted(q.split(","))), default) for account, q, default in
             sacctmgr_rows(slurm_accounting, "assoc", "user=root", "format=account,qos,defaultqos")
             if account != "root"}
    assert assoc == {a: (tuple(sorted(q)), d) for a, (q, d) in ACCOUNTING_ACCOUNTS.items()}
    assert sacctmgr_rows(slurm_accounting, "user", "root", "format=defaultaccount") == [["abc@v100"]]
    config = subprocess.run(["scontrol", "show", "config"], env=slurm_env(slurm_accounting), capture_output=True,
                            text=True, check=True).stdout
    assert "AccountingStorageEnforce = associations,limits,qos" in config
    assert "AccountingStorageTRES   = cpu,mem,energy,node,billing,fs/disk,vmem,pages,gres/gpu" in config


def test_each_case_meets_its_measured_fate(slurm_accounting):
    """Every case of site_cases.CASES: `sbatch --test-only`, then the real sbatch's fate, as measured."""
    rows, wrong = [], []
    for case in CASES:
        with deny_on_limit(slurm_accounting, case.deny_on_limit):
            said = sbatch_test_only(slurm_accounting, case.script)
            kind, text = fate(slurm_accounting, case.script)
        rows.append((case.name, said, kind, text))
        if (said, kind, text) != (case.test_only, case.kind, case.text):
            wrong.append(f"{case.name}: measured test-only={said!r} fate=({kind!r}, {text!r}); "
                         f"expected test-only={case.test_only!r} fate=({case.kind!r}, {case.text!r})")
    width = max(len(r[0]) for r in rows)
    print(f"\n{'case':{width}}  {'sbatch --test-only':25}  {'sbatch':8}  message or pending reason")
    for name, said, kind, text in rows:
        said = "refused, the same" if kind == "refused" and said == text else said
        print(f"{name:{width}}  {said:25}  {kind:8}  {text}")
    assert not wrong, "\n".join(wrong)


def test_refused_leaves_no_job_and_pending_stays_listed(slurm_accounting):
    """A refused script leaves no job anywhere (no id, nothing in squeue or sacct); a job over a QoS limit is a real
    job that squeue lists as PENDING with its reason, and sacct too (once slurmctld has told slurmdbd, about 3 s
    here), until it is cancelled (CANCELLED)."""
    env = slurm_env(slurm_accounting)
    refused = script("--account=abc@v100", "--qos=qos_gpu-gc", "--gres=gpu:1", "--job-name=refused-probe")
    assert fate(slurm_accounting, refused) == ("refused", INVALID_QOS)
    out = subprocess.run(["sbatch", "--parsable", "--account=abc@v100", "--time=25:00:00", "--gres=gpu:1",
                          "--output=/dev/null", "--wrap=srun hostname"], env=env, capture_output=True, text=True)
    job = out.stdout.strip()
    try:
        assert out.returncode == 0 and job.isdigit(), out.stderr
        assert squeue_once_settled(slurm_accounting, job) == "PENDING|QOSMaxWallDurationPerJobLimit"
        # slurmdbd first records the job with reason None and hears the reason slurmctld gave it later, when
        # slurmctld next sends the job's record (seconds on an idle machine; once not within 90 s at a load of 7):
        # the job's row is what is held, its reason either of the two, so no race decides the test
        row = sacct_once(slurm_accounting, job, lambda row: row.startswith("PENDING|")).split("|")
        assert row[0] == "PENDING" and row[1] in ("None", "QOSMaxWallDurationPerJobLimit") and \
            row[2:] == ["qos_gpu-t3", "abc@v100", "1-01:00:00"], row
        # by now slurmdbd has heard of the later job (named "wrap"): the refused script left nothing
        assert subprocess.run(["sacct", "-n", "-X", "-P", "-a", "--name=refused-probe,wrap", "-S", "now-1days",
                               "-o", "JobID"], env=env, capture_output=True, text=True).stdout.split() == [job]
    finally:
        subprocess.run(["scancel", job], env=env)
    assert sacct_once(slurm_accounting, job, lambda row: not row.startswith("PENDING")).startswith("CANCELLED")


def squeue_once_settled(cluster, job: str, seconds: float = 90) -> str:
    """squeue's "state|reason" once the reason is no longer one that only says the job waits its turn."""
    deadline = time.monotonic() + seconds
    while True:
        row = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T|%r"], env=slurm_env(cluster),
                             capture_output=True, text=True).stdout.strip()
        if row.split("|")[-1] not in TRANSIENT_REASONS or time.monotonic() > deadline:
            return row
        time.sleep(0.2)


def sacct_once(cluster, job: str, done, seconds: float = 90) -> str:
    """The job's sacct row "state|reason|qos|account|timelimit" once done(row) (slurmdbd hears of a job from
    slurmctld's agent a few seconds after slurmctld: about 3 s on an idle machine, more than 20 s once on a loaded
    one, so the bound is generous; it returns as soon as the row is there)."""
    deadline = time.monotonic() + seconds
    while True:
        row = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State,Reason,QOS,Account,Timelimit"],
                             env=slurm_env(cluster), capture_output=True, text=True).stdout.strip()
        if done(row) or time.monotonic() > deadline:
            return row
        time.sleep(0.2)

"""The checker's site layer (issue 33): Slurm's own configuration read where the checker runs (kit/site_slurm.py,
--site live), the dated Jean Zay table where Slurm does not answer (kit/site.py), and never a long wait on a slow
controller.
The verdicts against a real slurmdbd's: tests/test_site_slurmdbd.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checker import run_checker
from kit import site_slurm
from launch import ROOT, clean_env

JOB = "#!/bin/bash\n#SBATCH {options} -N 1 --ntasks-per-node=4 --gres=gpu:4 -c 10 --hint=nomultithread\n" \
      "srun -c 10 python bench_ddp_transformer.py --nlayers 8 --chunks 4\n"


def checker(tmp_path: Path, options: str, *flags: str, env: dict | None = None) -> tuple[int, dict, str]:
    """check_topology.py --json on a one-node job with `options`: (exit status, report, stderr)."""
    path = tmp_path / "job.slurm"
    path.write_text(JOB.format(options=options))
    env = env or clean_env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    r = run_checker("--json", *flags, str(path), env=env, cwd=tmp_path)  # in this process: tests/checker.py
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else {}, r.stderr


def errors(report: dict) -> set[str]:
    return {f["code"] for f in report["findings"] if f["level"] == "error"}


def fake_slurm(bin_dir: Path, body: str) -> dict:
    """An environment whose scontrol and sacctmgr are `body` (a bash script): a controller that hangs, or none."""
    bin_dir.mkdir()
    for name in ("scontrol", "sacctmgr"):
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", XDG_CACHE_HOME=str(bin_dir.parent / "cache"))


def test_without_slurm_the_table_judges_and_says_its_date(tmp_path):
    env = fake_slurm(tmp_path / "bin", "exit 1")  # Slurm's commands present, no controller (a laptop, CI)
    rc, report, _ = checker(tmp_path, "-C v100-32g -t 30:00:00 --qos=qos_gpu-t3", env=env)
    assert rc == 1 and "time-over-qos" in errors(report), report["findings"]
    [said] = [f["message"] for f in report["findings"] if f["code"] == "time-over-qos"]
    assert f"Jean Zay's documented rule (table of {__import__('check_topology').JEAN_ZAY_DATE})" in said, said
    assert any(n.startswith("site rules: Jean Zay's documented table of") for n in report["notes"])


def test_site_live_where_slurm_does_not_answer_is_one_line(tmp_path):
    env = fake_slurm(tmp_path / "bin", "exit 1")
    rc, report, err = checker(tmp_path, "-t 1:00:00", "--site", "live", env=env)
    assert rc == 2 and report == {} and len(err.strip().splitlines()) == 1, err
    assert "--site live: Slurm does not answer here" in err and "--site jean-zay" in err, err


def test_a_slow_controller_costs_the_deadline_then_the_table(tmp_path):
    """scontrol that never answers: the check takes the read's deadline (2 s), not the controller's time, and then
    judges by the table. Not a timing test: the bound (20 s) is ten times the deadline, the fake hangs 600 s."""
    env = fake_slurm(tmp_path / "bin", "sleep 600")
    t0 = time.monotonic()
    rc, report, _ = checker(tmp_path, "-C v100-32g -t 1:00:00", env=env)
    assert time.monotonic() - t0 < 20 and rc == 0, report
    assert any("Slurm does not answer here" in n for n in report["notes"]), report["notes"]


def test_site_none_judges_no_site_rule(tmp_path):
    rc, report, _ = checker(tmp_path, "-A abc@a100 -C v100-32g -t 300:00:00 --qos=qos_gpu-gc", "--site", "none")
    assert not {"time-over-qos", "qos-mismatch", "account-mismatch"} & {f["code"] for f in report["findings"]}
    assert rc == 0 and any(n.startswith("site rules: none") for n in report["notes"]), report


SCONTROL_CONFIG = """Configuration data as of 2026-12-04T21:00:00
AccountingStorageEnforce = associations,limits,qos
AccountingStorageType   = accounting_storage/slurmdbd
ClusterName             = jz
EnforcePartLimits       = NO
SLURM_VERSION           = 22.05.8
"""


def test_parsers_read_slurms_own_formats():
    """The formats as 22.05's scontrol and sacctmgr -nP print them (copied from the local cluster's output)."""
    parts = site_slurm.parse_partitions(
        "PartitionName=gpu_p13 AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A "
        "DefaultTime=00:10:00 DisableRootJobs=NO MaxTime=4-04:00:00 MinNodes=0 Nodes=node[1-3] State=UP\n"
        "PartitionName=gpu_p5 AllowQos=qos_gpu_a100-t3,qos_gpu_a100-dev Default=NO MaxTime=20:00:00 Nodes=amd[1-2]\n")
    assert parts["gpu_p13"] == {"max_time": "4-04:00:00", "default_time": "00:10:00", "allow_qos": "ALL",
                                "qos": "N/A", "default": True, "allow_accounts": "ALL"}
    assert parts["gpu_p5"]["allow_qos"] == "qos_gpu_a100-t3,qos_gpu_a100-dev" and not parts["gpu_p5"]["default"]
    qos = site_slurm.parse_qos("qos_gpu-t3|20:00:00|gres/gpu=512|||||\nqos_cpu-t4|4-04:00:00|cpu=160||||DenyOnLimit\n")
    assert qos["qos_gpu-t3"]["max_tres"] == {"gres/gpu": 512} and qos["qos_cpu-t4"]["flags"] == "DenyOnLimit"
    assocs = site_slurm.parse_assocs("abc@v100||qos_gpu-dev,qos_gpu-t3,qos_gpu-t4|qos_gpu-t3\n")
    assert assocs == [{"account": "abc@v100", "partition": "", "qos": ["qos_gpu-dev", "qos_gpu-t3", "qos_gpu-t4"],
                       "default_qos": "qos_gpu-t3"}]
    assert site_slurm.parse_config(SCONTROL_CONFIG)["AccountingStorageEnforce"] == "associations,limits,qos"


def test_a_read_is_cached_per_user_and_configuration(tmp_path):
    """The second check asks Slurm nothing (the fake counts its calls); another SLURM_CONF is read anew."""
    calls = tmp_path / "calls"
    config = SCONTROL_CONFIG.replace("\n", "\\n")
    body = (f'echo "$0 $*" >> {calls}\ncase "$0 $1 $2" in\n*scontrol\\ show\\ config) printf "{config}";;\n'
            '*scontrol\\ show\\ partition) echo "PartitionName=gpu_p13 Default=YES MaxTime=UNLIMITED";;\n'
            '*sacctmgr*) if [[ "$*" == *assoc* ]]; then echo "abc@v100||qos_gpu-t3|qos_gpu-t3"; '
            'elif [[ "$*" == *user* ]]; then echo abc@v100; '
            'else echo "qos_gpu-t3|20:00:00|gres/gpu=512||||"; fi;;\nesac')
    env = fake_slurm(tmp_path / "bin", body)
    for name in ("a", "b"):  # the cache is kept per cluster too: the one slurm.conf names (issue 42)
        (tmp_path / f"{name}.conf").write_text("ClusterName=jz\n")
    env["SLURM_CONF"] = str(tmp_path / "a.conf")
    first = checker(tmp_path, "-A abc@v100 -t 1:00:00", env=env)
    n = len(calls.read_text().splitlines())
    second = checker(tmp_path, "-A abc@v100 -t 1:00:00", env=env)
    notes = [[x for x in r[1]["notes"] if x.startswith("site rules:")][0] for r in (first, second)]
    assert first[0] == second[0] and first[1]["findings"] == second[1]["findings"], (first, second)
    assert n == 5 and len(calls.read_text().splitlines()) == n, calls.read_text()
    assert notes[0].startswith("site rules: Slurm's configuration here (jz, Slurm 22.05.8") and "read in" in notes[0]
    assert "a cached read of" in notes[1], notes[1]  # said as a cached read, with its age
    env["SLURM_CONF"] = str(tmp_path / "b.conf")
    checker(tmp_path, "-A abc@v100 -t 1:00:00", env=env)
    assert len(calls.read_text().splitlines()) == 2 * n


@pytest.mark.slurm
def test_live_partitions_agree_with_sbatch(slurm_cluster, tmp_path):
    """On the local cluster (no accounting: Slurm enforces no QoS, MaxTime=UNLIMITED): the live checker's verdict is
    sbatch --test-only's, where the table's is not."""
    env = clean_env(**slurm_cluster.env, XDG_CACHE_HOME=str(tmp_path / "cache"))
    for options, live_errors, table_errors in (
            ("-p nosuch -t 1:00:00", {"partition-unknown"}, set()),
            ("-p gpu_p13 -t 30:00:00 --qos=qos_gpu-t3", set(), {"time-over-qos"})):
        rc, live, _ = checker(tmp_path, options, env=env)
        _, table, _ = checker(tmp_path, options, "--site", "jean-zay", env=env)
        slurm = subprocess.run(["sbatch", "--test-only", str(tmp_path / "job.slurm")], env=env, capture_output=True,
                               text=True, timeout=60)
        assert errors(live) == live_errors and errors(table) >= table_errors, (options, live, table)
        assert (slurm.returncode == 0) == (not live_errors), (options, slurm.stderr)
        if live_errors:  # the words the finding quotes are sbatch's own
            assert "Invalid partition name specified" in slurm.stderr, slurm.stderr
            assert "('Invalid partition name specified')" in str(live["findings"])
        assert any(n.startswith("site rules: Slurm's configuration here (kit, Slurm") for n in live["notes"])


SITE_CODES = {"partition-unknown", "account-mismatch", "qos-mismatch", "time-over-qos", "qos-limit"}


def verdict(report: dict) -> tuple[str, str]:
    """The checker's site verdict: ('runs', '') with no site error, else the kind its first site error says."""
    said = [f["message"] for f in report["findings"] if f["level"] == "error" and f["code"] in SITE_CODES]
    if not said:
        return "runs", ""
    return ("refused" if "sbatch refuses it" in said[0] else "pending" if "pends forever" in said[0] else "?"), said[0]


@pytest.mark.slurm
def test_the_live_checker_agrees_with_slurms_real_fate(slurm_accounting, tmp_path):
    """Each case of tests/site_cases.py (measured: refused at submission, pending forever, or runs) checked with
    --site live on the same slurmctld + slurmdbd: the same fate, the same words (sbatch's message or squeue's reason).
    Under the table (--site jean-zay) the same scripts get the table's verdicts, worded as the table's. Printed."""
    from site_cases import CASES, deny_on_limit
    rows, wrong = [], []
    for i, case in enumerate(CASES):
        # a cache per case: DenyOnLimit is switched on for its cases only, and a cached read would not see it
        env = clean_env(**slurm_accounting.env, XDG_CACHE_HOME=str(tmp_path / f"cache{i}"))
        path = tmp_path / f"case{i}.slurm"
        path.write_text(case.script)
        with deny_on_limit(slurm_accounting, case.deny_on_limit):
            live, table = (json.loads(subprocess.run(
                [sys.executable, str(ROOT / "check_topology.py"), "--json", "--site", site, str(path)], env=env,
                capture_output=True, text=True, timeout=120).stdout) for site in ("live", "jean-zay"))
        kind, said = verdict(live)
        words = case.text.split(" | ")[-1].split(" (gpu_p13 allows")[0]
        if kind != case.kind or (words and words not in said):
            wrong.append(f"{case.name}: Slurm {case.kind} ({case.text}); the live checker {kind}: {said}")
        table_said = [f["message"] for f in table["findings"] if f["code"] in SITE_CODES]
        if not all("table of " in m for m in table_said):
            wrong.append(f"{case.name}: a table finding not worded as the table's: {table_said}")
        read = next(n for n in live["notes"] if n.startswith("site rules:"))
        levels = {f["level"] for f in table["findings"] if f["code"] in SITE_CODES}
        rows.append((case.name, case.kind, kind, "error" if "error" in levels else "warning" if levels else "-",
                     read.rpartition("read in ")[2].rstrip(")")))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'case':{width}}  {'Slurm':8}  {'live':8}  {'table':8}  live read")
    for row in rows:
        print(f"{row[0]:{width}}  {row[1]:8}  {row[2]:8}  {row[3]:8}  {row[4]}")
    assert not wrong, "\n".join(wrong)

"""A real Slurm cluster on this one machine, for the test suite (Debian's slurm-wlm + munge, run as root).

    python tests/local_slurm.py start DIR     # writes DIR/env.sh (SLURM_CONF=...), prints it
    python tests/local_slurm.py start DIR affinity   # the CPU-binding variant (below)
    python tests/local_slurm.py start DIR accounting # QoS and associations enforced by a real slurmdbd (below)
    python tests/local_slurm.py stop DIR      # stops the daemons by their pid files

Layout (mirrors Jean Zay's partitions, small):
  gpu_p13 (default)  node[1-3]  4 fake GPUs, 40 CPUs each (features v100, v100-16g, v100-32g)
  gpu_p2             big[1-2]   8 fake GPUs, 24 CPUs each
  gpu_p5             amd[1-2]   8 fake GPUs, 64 CPUs each (feature a100)
  gpu_p6             hop[1-2]   4 fake GPUs, 96 CPUs each (feature h100)
  cpu_p1             cpu[1-2]   no GPU, 40 CPUs each
  prepost            pp1        no GPU, 48 CPUs

Facts this relies on (slurm-wlm 22.05 on Debian bookworm):
- several slurmd on one host: one NodeName line per node with its own Port, started as `slurmd -D -N name`;
- declaring more CPUs than the machine has needs SlurmdParameters=config_overrides, and then only
  TaskPlugin=task/none launches steps;
- fake GPUs must be character devices (mknod c 195 N) for Slurm to set CUDA_VISIBLE_DEVICES;
- state persists between starts, so every start begins from a wiped state directory.
With accounting (the "accounting" variant):
- slurmctld and the clients reach slurmdbd through munge too: with a private munged its socket must be named by
  AccountingStoragePass (slurm.conf(5)), else they try /run/munge;
- slurmctld resolves a partition's AllowQos names once, when it starts: the QoS must exist in slurmdbd before;
- the gres/gpu TRES exists in slurmdbd only once slurmctld has registered it (AccountingStorageTRES=gres/gpu), and
  sacctmgr refuses a QoS limit on a TRES it does not know: the GPU limits are set after slurmctld starts;
- '@' in an account name (Jean Zay's abc@v100) is accepted by sacctmgr and sbatch.

The "affinity" variant binds CPUs as a production cluster does (TaskPlugin=task/affinity: each task may run only on
the cores Slurm gave it). It needs nodes that advertise no more CPUs than this machine has, so its nodes
(AFFINITY_PARTITIONS) have the machine's own count (2 here) and it runs without config_overrides.

The "accounting" variant enforces Jean Zay's QoS and associations as slurmctld does with a real database
(slurm.conf(5) AccountingStorageEnforce=associations,limits,qos): a private MariaDB server (its own datadir, socket
and port under DIR, run as root with --user=root, no system service), a slurmdbd on a free port
(StorageType=accounting_storage/mysql), and the QoS, accounts and the submitting user's associations of
ACCOUNTING_QOS / ACCOUNTING_ACCOUNTS loaded with `sacctmgr -i` before slurmctld starts. Its nodes
(ACCOUNTING_PARTITIONS) give gpu_p13 20 GPUs, so that a job over qos_gpu-t4's 16 fits the partition and Slurm
judges it by the QoS alone; each partition's AllowQos names the QoS of its node type (ACCOUNTING_ALLOW_QOS).
"""
from __future__ import annotations

import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PARTITIONS = {  # name: (node names, GPUs per node, CPUs per node, features)
    "gpu_p13": (["node1", "node2", "node3"], 4, 40, "v100,v100-16g,v100-32g"),
    "gpu_p2": (["big1", "big2"], 8, 24, "v100,v100-32g"),
    "gpu_p5": (["amd1", "amd2"], 8, 64, "a100"),
    "gpu_p6": (["hop1", "hop2"], 4, 96, "h100"),
    "cpu_p1": (["cpu1", "cpu2"], 0, 40, "cpu"),
    "prepost": (["pp1"], 0, 48, "prepost"),
}


# the "affinity" variant's nodes: the machine's own CPUs each, and fake GPUs as on gpu_p13
AFFINITY_PARTITIONS = {
    "bind": (["bind1", "bind2"], 4, len(os.sched_getaffinity(0)), "v100,v100-32g"),
}

# ---- the "accounting" variant: Jean Zay's QoS and a project's accounts, loaded into a real slurmdbd -----------------
ACCOUNTING_PARTITIONS = {
    "gpu_p13": ([f"v100n{i}" for i in range(1, 6)], 4, 40, "v100,v100-16g,v100-32g"),
    "gpu_p5": (["a100n1"], 8, 64, "a100"),
    "cpu_p1": (["cpun1"], 0, 40, "cpu"),
}

# name: (MaxWall, MaxTRESPerJob), sacctmgr(1) "add qos". IDRIS's table as check_topology.py quotes it (qos_gpu-t3 20 h
# 512 GPUs, -t4 100 h 16 GPUs, -dev 2 h 32 GPUs; qos_cpu-t3 20 h 20480 cores, -t4 100 h 160, -dev 2 h 5120; the A100
# QoS's per-job GPU limits are not documented: none here). qos_gpu-gc stands for a project's own grant (200 h, 64 GPUs).
# The GPU limits apply only because slurm.conf tracks the TRES (AccountingStorageTRES=gres/gpu).
ACCOUNTING_QOS = {
    "qos_gpu-t3": ("20:00:00", "gres/gpu=512"),
    "qos_gpu-t4": ("4-04:00:00", "gres/gpu=16"),
    "qos_gpu-dev": ("02:00:00", "gres/gpu=32"),
    "qos_gpu_a100-t3": ("20:00:00", ""),
    "qos_gpu_a100-dev": ("02:00:00", ""),
    "qos_cpu-t3": ("20:00:00", "cpu=20480"),
    "qos_cpu-t4": ("4-04:00:00", "cpu=160"),
    "qos_cpu-dev": ("02:00:00", "cpu=5120"),
    "qos_gpu-gc": ("8-08:00:00", "gres/gpu=64"),
}

# Jean Zay's <project>@<hours> accounts: account: (its QoS list, its DefaultQOS). The submitting user is associated
# with each one (DefaultAccount: the first); only xyz@v100 holds the project QoS qos_gpu-gc.
ACCOUNTING_ACCOUNTS = {
    "abc@v100": (("qos_gpu-t3", "qos_gpu-t4", "qos_gpu-dev"), "qos_gpu-t3"),
    "abc@a100": (("qos_gpu_a100-t3", "qos_gpu_a100-dev"), "qos_gpu_a100-t3"),
    "abc@cpu": (("qos_cpu-t3", "qos_cpu-t4", "qos_cpu-dev"), "qos_cpu-t3"),
    "xyz@v100": (("qos_gpu-t3", "qos_gpu-t4", "qos_gpu-dev", "qos_gpu-gc"), "qos_gpu-t3"),
}

# partition: its AllowQos (slurm.conf(5) PartitionName): the QoS of its node type. An assumption: Jean Zay's own
# partitions' AllowQos was not read (`scontrol show partition` there says).
ACCOUNTING_ALLOW_QOS = {
    "gpu_p13": "qos_gpu-t3,qos_gpu-t4,qos_gpu-dev,qos_gpu-gc",
    "gpu_p5": "qos_gpu_a100-t3,qos_gpu_a100-dev",
    "cpu_p1": "qos_cpu-t3,qos_cpu-t4,qos_cpu-dev",
}

VARIANTS = {"default": PARTITIONS, "affinity": AFFINITY_PARTITIONS, "accounting": ACCOUNTING_PARTITIONS}

# `sbatch --wait` polls the job at 2, 8, then 32 s intervals, and stays at 2 s only while MinJobAge <= 4
# (sbatch.c `_job_wait`, Slurm 22.05: the interval grows while it is < min_job_age / 2, capped at 32). With
# Slurm's default (300) a 12 s job returned after 42 s. A finished job's record then lives 4 s to about a minute
# (slurmctld purges old jobs every PURGE_JOB_INTERVAL, 60 s): the tests that read a job's state poll it every
# 0.5 s, and a 2 s poll sees it before it goes.
MIN_JOB_AGE = 4


class SlurmUnavailable(RuntimeError):
    """This machine can't run the test cluster; the message says why."""


_GIVEN: set[int] = set()  # every port this process handed out


def free_port() -> int:
    """A port free now, and never one this process handed out before: the kernel may give a port it just gave again
    once its socket is closed, and two slurmds on one port (node2's and cpu1's, in one fresh-clone run) made node2's
    slurmd run cpu1's batch job ("Batch completion for JobId=... sent from wrong node"), which never ended."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def daemon_port() -> int:
    """A port for one of the cluster's daemons (slurmctld, a slurmd, slurmdbd, mariadb), below the kernel's ephemeral
    range (net.ipv4.ip_local_port_range): no bind(0) anywhere (a test's MASTER_PORT from free_port, a gloo or Slurm
    connection, another pytest run beside this one in `make test`) can be handed it between the moment it is chosen
    and the moment the daemon binds it. Checked free by binding it, and never handed out twice."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    first = max(1024, low - 12000)
    for offset in random.sample(range(low - first), low - first):
        port = first + offset
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise SlurmUnavailable(f"no free port between {first} and {low} for the local cluster's daemons")


def unavailable_reason(variant: str = "default") -> str | None:
    """Why a local cluster of `variant` can't be started here, or None when it can."""
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (slurmd runs jobs as any user)"
    missing = [b for b in ("slurmctld", "slurmd", "munged", "sbatch", "srun") if shutil.which(b) is None]
    if missing:
        return f"{', '.join(missing)} not installed: apt-get install -y slurm-wlm munge"
    if variant == "accounting":
        missing = [b for b in ("slurmdbd", "sacctmgr", "mariadbd", "mariadb-install-db", "mariadb")
                   if shutil.which(b) is None]
        if missing:
            return (f"{', '.join(missing)} not installed: the accounting tests need a real slurmdbd and its database "
                    "(apt-get install -y slurmdbd mariadb-server, or make slurm-deps as root)")
    return None


class LocalCluster:
    def __init__(self, root: str | os.PathLike, variant: str = "default") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant {variant!r}: one of {', '.join(map(repr, VARIANTS))}")
        self.root = Path(root).resolve()
        self.conf = self.root / "etc" / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.variant = variant
        self.partitions = VARIANTS[variant]
        self.dbd_port = 0  # the accounting variant's slurmdbd port (slurm.conf AccountingStoragePort)

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm client needs: SLURM_CONF (gres.conf is read from the same folder)."""
        return {"SLURM_CONF": str(self.conf)}

    def _pidfiles(self) -> list[Path]:
        return sorted(self.root.glob("run/*.pid"))

    def start(self, timeout: float | None = None) -> None:
        # the accounting variant runs MariaDB, slurmdbd and 14 sacctmgr calls first (12.7 s alone, more under load)
        timeout = timeout or (180.0 if self.variant == "accounting" else 60.0)
        reason = unavailable_reason(self.variant)
        if reason:
            raise SlurmUnavailable(reason)
        self.stop()
        for sub in ("etc", "state", "run", "log", "dev", "munge", "db"):
            shutil.rmtree(self.root / sub, ignore_errors=True)
            (self.root / sub).mkdir(parents=True)
        self._start_munge()
        nodes = [n for names, *_ in self.partitions.values() for n in names]
        for n in nodes:
            (self.root / "state" / f"spool-{n}").mkdir()
        for i in range(max(g for _, g, _, _ in self.partitions.values())):
            os.mknod(self.root / "dev" / f"nvidia{i}", 0o666 | 0o020000, os.makedev(195, i))
        self.dbd_port = daemon_port() if self.variant == "accounting" else 0
        self._write_conf()
        self._add_hosts([n for n in nodes])
        deadline = time.monotonic() + timeout
        if self.variant == "accounting":
            self._start_accounting(deadline)
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
        for n in nodes:
            self._spawn(["slurmd", "-D", "-N", n, "-f", str(self.conf)], f"slurmd-{n}")
        if self.variant == "accounting":
            self._load_gpu_limits(deadline)
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env={**os.environ, **self.env},
                                 capture_output=True, text=True)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            if out.returncode == 0 and len(states) == len(nodes) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.5)
        self._give_up(f"the local cluster did not come up within {timeout:.0f}s; sinfo said "
                      f"{out.stdout.strip() or out.stderr.strip()}")

    def _give_up(self, message: str) -> None:
        """Stop what started, and raise SlurmUnavailable with the message and the daemons' logs' tails."""
        # the .out files hold what a daemon says before it opens its log (slurmdbd's fatal errors)
        logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                         for p in sorted((self.root / "log").glob("*.*")) if p.stat().st_size)
        self.stop()
        raise SlurmUnavailable(f"{message}\n{logs}")

    def _start_munge(self) -> None:
        m = self.root / "munge"
        key = m / "munge.key"
        key.write_bytes(os.urandom(1024))
        shutil.chown(m, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        os.chmod(self.root, 0o755)  # munged (user munge) and job users must reach the socket
        os.chmod(m, 0o755)
        os.chmod(key, 0o400)
        subprocess.run(["runuser", "-u", "munge", "--", "munged", f"--key-file={key}", f"--socket={m}/munge.socket",
                        f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"],
                       check=True)

    def _write_conf(self) -> None:
        r = self.root
        host = socket.gethostname()
        lines = [
            "ClusterName=kit",
            # job ids (and so the trainers' derived MASTER_PORT, 10000 + job % 4000 * 5 + step % 5) apart from those
            # of another test cluster running on this machine at the same time
            f"FirstJobId={random.randrange(1, 4000) * 10}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={daemon_port()}",
            "AuthType=auth/munge", "CredType=cred/munge",
            # cred_expire also sets how long a requeued job waits before it may start again (default 120 s);
            # restarting sooner than that fails with "Job credential revoked", so shorten the wait, not skip it
            f"AuthInfo=socket={r}/munge/munge.socket,cred_expire=15",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/state/spool-%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/affinity" if self.variant == "affinity" else "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "GresTypes=gpu",
            *(["SlurmdParameters=config_overrides"] if self.variant != "affinity" else []),
            "ReturnToService=2", "MpiDefault=none", "SwitchType=switch/none",
            *(self._accounting_conf() if self.variant == "accounting" else
              ["AccountingStorageType=accounting_storage/none"]),
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none", "SchedulerType=sched/backfill",
            # slurm.conf(5) of 22.05.8: batch jobs wait batch_sched_delay (default 3 s) before their first scheduling
            # attempt, and a job that becomes eligible without an event (a requeued job, once cred_expire has
            # passed) waits for the backfill pass (bf_interval, default 30 s) or the main loop (sched_interval,
            # default 60 s). Measured here: a trivial sbatch left the queue after 2.2-2.9 s, now 0.5-0.9 s; a requeued
            # job ran again after 23 s, now 16 s (cred_expire + 1). Scheduling itself is Slurm's, unchanged.
            "SchedulerParameters=batch_sched_delay=0,bf_interval=1,sched_interval=2",
            f"MinJobAge={MIN_JOB_AGE}", "KillWait=5", "InactiveLimit=0", "SlurmdTimeout=30", "MessageTimeout=20",
        ]
        gres = ["AutoDetect=off"]
        for i, (part, (names, gpus, cpus, feats)) in enumerate(self.partitions.items()):
            for n in names:
                lines.append(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={daemon_port()} "
                             f"CPUs={cpus}{f' Gres=gpu:{gpus}' if gpus else ''} Features={feats} State=UNKNOWN")
                gres += [f"NodeName={n} Name=gpu File={r}/dev/nvidia[0-{gpus - 1}]"] if gpus else []
            allow = f" AllowQos={ACCOUNTING_ALLOW_QOS[part]}" if self.variant == "accounting" else ""
            lines.append(f"PartitionName={part} Nodes={','.join(names)} Default={'YES' if i == 0 else 'NO'} "
                         f"MaxTime=INFINITE State=UP OverSubscribe=NO{allow}")
        self.conf.write_text("\n".join(lines) + "\n")
        (self.conf.parent / "gres.conf").write_text("\n".join(gres) + "\n")

    # ---- the accounting variant: MariaDB, slurmdbd, then the QoS and associations, before slurmctld starts ----
    def _accounting_conf(self) -> list[str]:
        """slurm.conf(5) lines that make slurmctld enforce QoS and associations kept by this cluster's slurmdbd."""
        return ["AccountingStorageType=accounting_storage/slurmdbd", "AccountingStorageHost=127.0.0.1",
                f"AccountingStoragePort={self.dbd_port}",
                # with slurmdbd this is the munge socket that the clients' and slurmctld's messages to it use
                # (slurm.conf(5) AccountingStoragePass): without it they try the system's /run/munge
                f"AccountingStoragePass={self.root}/munge/munge.socket",
                # associations: a job must name an account (and QoS) the user is associated with; limits: the QoS's
                # and associations' limits (MaxWall, MaxTRESPerJob); qos: the QoS must be in the association's list
                "AccountingStorageEnforce=associations,limits,qos",
                # GPUs are tracked (a TRES), so MaxTRESPerJob=gres/gpu=N applies
                "AccountingStorageTRES=gres/gpu"]

    def _start_accounting(self, deadline: float) -> None:
        """MariaDB, then slurmdbd, then the cluster (sacctmgr -i add cluster)."""
        password = os.urandom(12).hex()
        db_port = self._start_mariadb(password, deadline)
        conf = self.conf.parent / "slurmdbd.conf"
        r = self.root
        conf.write_text("\n".join([
            "AuthType=auth/munge", f"AuthInfo=socket={r}/munge/munge.socket",
            "DbdHost=localhost", "DbdAddr=127.0.0.1", f"DbdPort={self.dbd_port}", "SlurmUser=root",
            f"LogFile={r}/log/slurmdbd.log", f"PidFile={r}/run/slurmdbd.pid",
            "StorageType=accounting_storage/mysql", "StorageHost=127.0.0.1", f"StoragePort={db_port}",
            "StorageUser=slurm", f"StoragePass={password}", "StorageLoc=slurm_acct_db",
        ]) + "\n")
        # it holds the password: slurmdbd exits on any other mode ("fatal: slurmdbd.conf file ... should be 600")
        os.chmod(conf, 0o600)
        # slurmdbd reads slurmdbd.conf from SLURM_CONF's folder (it has no -f)
        self._spawn(["slurmdbd", "-D"], "slurmdbd")
        self._wait_for(["sacctmgr", "-n", "-P", "show", "cluster"], deadline, "slurmdbd did not answer sacctmgr")
        try:  # before slurmctld starts: it registers as that cluster, and resolves AllowQos's names once
            self.sacctmgr("add", "cluster", "kit")
            self._load_associations()
        except SlurmUnavailable as exc:
            self._give_up(str(exc))

    def _load_gpu_limits(self, deadline: float) -> None:
        """Once slurmctld has registered gres/gpu as a TRES, the QoS's GPU limits: sacctmgr cannot add a TRES, and a
        QoS naming an unknown one fails ("no TRES known by type gres/gpu"). Then wait until slurmctld holds them
        (`scontrol show assoc_mgr`): slurmdbd forwards the change, and the tests must not race it."""
        self._wait_for(["sacctmgr", "-n", "-P", "show", "tres", "type=gres", "name=gpu"], deadline,
                       "slurmctld did not register gres/gpu with slurmdbd", need_output=True)
        gpu = {name: tres for name, (_, tres) in ACCOUNTING_QOS.items() if tres.startswith("gres/gpu=")}
        try:
            for name, tres in gpu.items():
                self.sacctmgr("modify", "qos", name, "set", f"MaxTRESPerJob={tres}")
        except SlurmUnavailable as exc:
            self._give_up(str(exc))
        for name, tres in gpu.items():
            self._wait_for(["scontrol", "show", "assoc_mgr", "flags=qos", f"qos={name}"], deadline,
                           f"slurmctld did not learn {name}'s MaxTRESPerJob", need_output=f"MaxTRESPJ={tres}\n")

    def _start_mariadb(self, password: str, deadline: float) -> int:
        """A private MariaDB server (datadir, socket, pid file under DIR) with a user `slurm` for slurmdbd."""
        r, port = self.root, daemon_port()
        sock = r / "run" / "mariadb.sock"
        init = r / "db" / "init.sql"
        # install_db bootstraps with the grant tables off: FLUSH PRIVILEGES turns them on for CREATE USER
        init.write_text(f"FLUSH PRIVILEGES;\nCREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';\n"
                        "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';\n")
        small = ["--innodb-buffer-pool-size=32M", "--innodb-log-file-size=8M", "--skip-name-resolve"]
        out = subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={r}/db/data", "--user=root",
                              "--skip-test-db", f"--extra-file={init}", *small], capture_output=True, text=True)
        init.unlink()
        if out.returncode != 0:
            self._give_up(f"mariadb-install-db failed: {out.stdout[-1500:]}{out.stderr[-1500:]}")
        self._spawn(["mariadbd", "--no-defaults", f"--datadir={r}/db/data", "--user=root", f"--socket={sock}",
                     f"--port={port}", "--bind-address=127.0.0.1", f"--pid-file={r}/run/mariadb.pid",
                     f"--log-error={r}/log/mariadb.log", "--innodb-flush-log-at-trx-commit=0", *small], "mariadb")
        self._wait_for(["mariadb", "--no-defaults", f"--socket={sock}", "-uroot", "-e", "select 1"], deadline,
                       "mariadbd did not accept connections")
        return port

    def _wait_for(self, cmd: list[str], deadline: float, what: str, need_output: bool | str = False) -> None:
        """Run cmd every 0.2 s until it succeeds (and prints something, or need_output's text); past the deadline,
        give up with its last output."""
        while True:
            out = subprocess.run(cmd, env={**os.environ, **self.env}, capture_output=True, text=True)
            printed = need_output in out.stdout if isinstance(need_output, str) else out.stdout.strip()
            if out.returncode == 0 and (printed or not need_output):
                return
            if time.monotonic() > deadline:
                self._give_up(f"{what}: {' '.join(cmd[:3])} said {out.stdout.strip()} {out.stderr.strip()}")
            time.sleep(0.2)

    def sacctmgr(self, *args: str) -> str:
        """`sacctmgr -i` (no confirmation) against this cluster's slurmdbd; its output, or SlurmUnavailable."""
        for _ in range(3):  # slurmdbd busy with slurmctld's registration may refuse a connection once: try again
            out = subprocess.run(["sacctmgr", "-i", *args], env={**os.environ, **self.env}, capture_output=True,
                                 text=True)
            if out.returncode == 0 or "connect" not in (out.stdout + out.stderr).lower():
                break
            time.sleep(1)
        if out.returncode != 0:
            raise SlurmUnavailable(f"sacctmgr {' '.join(args)}: {out.stdout.strip()} {out.stderr.strip()}")
        return out.stdout

    def _load_associations(self) -> None:
        """ACCOUNTING_QOS, ACCOUNTING_ACCOUNTS and this user's associations, as sacctmgr(1) adds them."""
        for name, (wall, tres) in ACCOUNTING_QOS.items():  # the GPU limits come once gres/gpu is known
            per_job = [f"MaxTRESPerJob={tres}"] if tres and not tres.startswith("gres/") else []
            self.sacctmgr("add", "qos", name, f"MaxWall={wall}", *per_job)
        user = pwd.getpwuid(os.geteuid()).pw_name
        for account, (qos, default) in ACCOUNTING_ACCOUNTS.items():
            self.sacctmgr("add", "account", account, "Cluster=kit", f"Organization={account.split('@')[0]}",
                          f"Description=project {account}", f"QOS={','.join(qos)}", f"DefaultQOS={default}")
        self.sacctmgr("add", "user", user, f"Account={','.join(ACCOUNTING_ACCOUNTS)}",
                      f"DefaultAccount={next(iter(ACCOUNTING_ACCOUNTS))}")

    HOSTS_MARK = "# local_slurm test cluster"

    def _add_hosts(self, nodes: list[str]) -> None:
        """Node names must resolve (MASTER_ADDR is the first node's name), as DNS does on a real cluster."""
        self._remove_hosts()
        with open("/etc/hosts", "a") as f:
            f.write(f"127.0.0.1 {' '.join(nodes)} {self.HOSTS_MARK} {self.root}\n")

    def _remove_hosts(self) -> None:
        try:
            lines = Path("/etc/hosts").read_text().splitlines(keepends=True)
        except OSError:
            return
        kept = [line for line in lines if f"{self.HOSTS_MARK} {self.root}" not in line]
        if kept != lines:
            # /etc/hosts may be a bind mount (containers): rewrite in place, never replace the file
            with open("/etc/hosts", "w") as f:
                f.writelines(kept)

    def _spawn(self, cmd: list[str], name: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env={**os.environ, **self.env}, start_new_session=True))

    def stop(self, timeout: float = 20.0) -> None:
        """Stop every daemon this cluster started, by its pid file (never by process name)."""
        pids = []
        for pidfile in self._pidfiles() + [self.root / "munge" / "munged.pid"]:
            try:
                pids.append(int(pidfile.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                continue
            pidfile.unlink(missing_ok=True)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            time.sleep(0.1)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:  # reap our own children (no zombies left behind)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs = []
        self._remove_hosts()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] not in ("start", "stop"):
        sys.exit(f"usage: {sys.argv[0]} start|stop DIR [{'|'.join(VARIANTS)}]")
    cluster = LocalCluster(sys.argv[2], *sys.argv[3:])
    if sys.argv[1] == "start":
        try:
            cluster.start()
        except SlurmUnavailable as exc:
            sys.exit(f"local_slurm: {exc}")
        (cluster.root / "env.sh").write_text(f"export SLURM_CONF={cluster.conf}\n")
        print(f"export SLURM_CONF={cluster.conf}")
    else:
        cluster.stop()

"""A real Slurm cluster on this one machine, for the test suite (Debian's slurm-wlm + munge, run as root).

    python tests/local_slurm.py start DIR     # writes DIR/env.sh (SLURM_CONF=...), prints it
    python tests/local_slurm.py start DIR affinity   # the CPU-binding variant (below)
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

The "affinity" variant binds CPUs as a production cluster does (TaskPlugin=task/affinity: each task may run only on
the cores Slurm gave it). It needs nodes that advertise no more CPUs than this machine has, so its nodes
(AFFINITY_PARTITIONS) have the machine's own count (2 here) and it runs without config_overrides.
"""
from __future__ import annotations

import os
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

# `sbatch --wait` polls the job at 2, 8, then 32 s intervals, and stays at 2 s only while MinJobAge <= 4
# (sbatch.c `_job_wait`, Slurm 22.05: the interval grows while it is < min_job_age / 2, capped at 32). With
# Slurm's default (300) a 12 s job returned after 42 s. A finished job's record then lives 4 s to about a minute
# (slurmctld purges old jobs every PURGE_JOB_INTERVAL, 60 s): the tests that read a job's state poll it every
# 0.5 s, and a 2 s poll sees it before it goes.
MIN_JOB_AGE = 4


class SlurmUnavailable(RuntimeError):
    """This machine can't run the test cluster; the message says why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unavailable_reason() -> str | None:
    """Why a local cluster can't be started here, or None when it can."""
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (slurmd runs jobs as any user)"
    missing = [b for b in ("slurmctld", "slurmd", "munged", "sbatch", "srun") if shutil.which(b) is None]
    if missing:
        return f"{', '.join(missing)} not installed: apt-get install -y slurm-wlm munge"
    return None


class LocalCluster:
    def __init__(self, root: str | os.PathLike, variant: str = "default") -> None:
        if variant not in ("default", "affinity"):
            raise ValueError(f"variant {variant!r}: 'default' or 'affinity'")
        self.root = Path(root).resolve()
        self.conf = self.root / "etc" / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.variant = variant
        self.partitions = AFFINITY_PARTITIONS if variant == "affinity" else PARTITIONS

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm client needs: SLURM_CONF (gres.conf is read from the same folder)."""
        return {"SLURM_CONF": str(self.conf)}

    def _pidfiles(self) -> list[Path]:
        return sorted(self.root.glob("run/*.pid"))

    def start(self, timeout: float = 60.0) -> None:
        reason = unavailable_reason()
        if reason:
            raise SlurmUnavailable(reason)
        self.stop()
        for sub in ("etc", "state", "run", "log", "dev", "munge"):
            shutil.rmtree(self.root / sub, ignore_errors=True)
            (self.root / sub).mkdir(parents=True)
        self._start_munge()
        nodes = [n for names, *_ in self.partitions.values() for n in names]
        for n in nodes:
            (self.root / "state" / f"spool-{n}").mkdir()
        for i in range(max(g for _, g, _, _ in self.partitions.values())):
            os.mknod(self.root / "dev" / f"nvidia{i}", 0o666 | 0o020000, os.makedev(195, i))
        self._write_conf()
        self._add_hosts([n for n in nodes])
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
        for n in nodes:
            self._spawn(["slurmd", "-D", "-N", n, "-f", str(self.conf)], f"slurmd-{n}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env={**os.environ, **self.env},
                                 capture_output=True, text=True)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            if out.returncode == 0 and len(states) == len(nodes) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.5)
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((self.root / "log").glob("*.log")))
        self.stop()
        raise SlurmUnavailable(f"the local cluster did not come up within {timeout:.0f}s; sinfo said "
                               f"{out.stdout.strip() or out.stderr.strip()}\n{logs}")

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
            f"SlurmctldPort={free_port()}",
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
            *(["SlurmdParameters=config_overrides"] if self.variant == "default" else []),
            "ReturnToService=2", "MpiDefault=none", "SwitchType=switch/none",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none", "SchedulerType=sched/backfill",
            f"MinJobAge={MIN_JOB_AGE}", "KillWait=5", "InactiveLimit=0", "SlurmdTimeout=30", "MessageTimeout=20",
        ]
        gres = ["AutoDetect=off"]
        for i, (part, (names, gpus, cpus, feats)) in enumerate(self.partitions.items()):
            for n in names:
                lines.append(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} "
                             f"CPUs={cpus}{f' Gres=gpu:{gpus}' if gpus else ''} Features={feats} State=UNKNOWN")
                gres += [f"NodeName={n} Name=gpu File={r}/dev/nvidia[0-{gpus - 1}]"] if gpus else []
            lines.append(f"PartitionName={part} Nodes={','.join(names)} Default={'YES' if i == 0 else 'NO'} "
                         "MaxTime=INFINITE State=UP OverSubscribe=NO")
        self.conf.write_text("\n".join(lines) + "\n")
        (self.conf.parent / "gres.conf").write_text("\n".join(gres) + "\n")

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
        sys.exit(f"usage: {sys.argv[0]} start|stop DIR [default|affinity]")
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

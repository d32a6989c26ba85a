"""The site's rules as Slurm itself states them, read where the checker runs (issue 33).

Owns: the live read of the Slurm configuration (`scontrol show config`, `scontrol show partition`, `sacctmgr show
qos`, `sacctmgr show assoc`) into SiteFacts, its deadline and its per-user cache. Imports: the standard library only.
kit.site turns the facts into findings, and keeps the dated Jean Zay table for where Slurm does not answer.

    python -m kit.site_slurm        # what the checker would read here, as JSON (and how long it took)

Each command gets the same deadline (READ_SECONDS, started together): a slow or absent controller costs a check at
most that long, and then the table stands in. A good read is cached for CACHE_SECONDS per user and configuration,
in ~/.cache/hybrid-kit/site/ (a login node's checks of several scripts ask Slurm once). sacctmgr answers only
where a slurmdbd does (AccountingStorageType=accounting_storage/slurmdbd): elsewhere Slurm enforces no QoS.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

READ_SECONDS = 2.0
CACHE_SECONDS = 300
# sacctmgr(1) "LIST/ADD/MODIFY QOS": MaxTRES is MaxTRESPerJob, MaxTRESPU per user, MaxTRESPA per account
QOS_FIELDS = "name,maxwall,maxtres,maxtrespu,maxtrespa,maxjobspu,flags"
ASSOC_FIELDS = "account,partition,qos,defaultqos"


@dataclass
class SiteFacts:
    """What Slurm says here. Times are Slurm's strings ('20:00:00', '4-04:00:00', 'UNLIMITED'; '' for none)."""
    source: str  # "live": read from Slurm now or from the cache of a read
    user: str
    read_at: float  # time.time() of the read
    read_seconds: float  # how long the read took
    version: str = ""
    cluster: str = ""
    enforce: str = ""  # AccountingStorageEnforce: "associations,limits,qos", or "none"
    enforce_part_limits: str = "NO"  # EnforcePartLimits: ANY/ALL refuse at submission what NO leaves pending
    accounting: bool = False  # a slurmdbd answers (sacctmgr's lists below are real)
    partitions: dict = field(default_factory=dict)  # name -> {max_time, default_time, allow_qos, qos, default}
    qos: dict = field(default_factory=dict)  # name -> {max_wall, max_tres, max_tres_pu, max_tres_pa, flags}
    assocs: list = field(default_factory=list)  # {account, partition, qos: [...], default_qos} of this user
    default_account: str = ""  # the account a job without --account is charged to (sacctmgr show user)

    def enforces(self, what: str) -> bool:
        return self.accounting and what in self.enforce.lower().split(",")


def current_user() -> str:
    return os.environ.get("USER") or pwd.getpwuid(os.getuid()).pw_name


def commands(user: str) -> dict[str, list[str]]:
    return {"config": ["scontrol", "show", "config"],
            "partitions": ["scontrol", "show", "partition", "--oneliner"],
            "qos": ["sacctmgr", "-nP", "show", "qos", f"format={QOS_FIELDS}"],
            "assocs": ["sacctmgr", "-nP", "show", "assoc", "where", f"user={user}", f"format={ASSOC_FIELDS}"],
            "user": ["sacctmgr", "-nP", "show", "user", user, "format=defaultaccount"]}


def run_all(cmds: dict[str, list[str]], deadline: float) -> dict[str, str | None]:
    """Every command started at once; each one's stdout, or None if it failed or passed the deadline (killed)."""
    procs = {}
    for name, argv in cmds.items():
        try:
            # its own session: past the deadline the whole group goes (a wrapper's child would hold the pipe open)
            procs[name] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                           stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError:
            procs[name] = None
    out: dict[str, str | None] = {}
    for name, proc in procs.items():
        if proc is None:
            out[name] = None
            continue
        try:
            text, _ = proc.communicate(timeout=max(0.01, deadline - time.monotonic()))
            out[name] = text if proc.returncode == 0 else None
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=1)
            out[name] = None
    return out


def parse_config(text: str) -> dict[str, str]:
    """`scontrol show config`: 'Name = value' lines."""
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs}


def parse_partitions(text: str) -> dict[str, dict]:
    """`scontrol show partition --oneliner`: one 'Key=value Key=value ...' line per partition."""
    parts = {}
    for line in text.splitlines():
        kv = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        if "PartitionName" in kv:
            parts[kv["PartitionName"]] = {
                "max_time": kv.get("MaxTime", ""), "default_time": kv.get("DefaultTime", ""),
                "allow_qos": kv.get("AllowQos", "ALL"), "qos": kv.get("QoS", "N/A"),
                "default": kv.get("Default", "NO") == "YES", "allow_accounts": kv.get("AllowAccounts", "ALL")}
    return parts


def parse_qos(text: str) -> dict[str, dict]:
    """`sacctmgr -nP show qos format=name,maxwall,maxtres,maxtrespu,maxtrespa,maxjobspu,flags`."""
    keys = QOS_FIELDS.split(",")
    rows = (dict(zip(keys, line.split("|"))) for line in text.splitlines() if line.strip())
    return {r["name"]: {"max_wall": r.get("maxwall", ""), "max_tres": tres(r.get("maxtres", "")),
                        "max_tres_pu": tres(r.get("maxtrespu", "")), "max_tres_pa": tres(r.get("maxtrespa", "")),
                        "flags": r.get("flags", "")} for r in rows}


def tres(text: str) -> dict[str, int]:
    """'cpu=160,gres/gpu=16' -> {'cpu': 160, 'gres/gpu': 16}."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, count = item.partition("=")
        if count.isdigit():
            out[name] = int(count)
    return out


def parse_assocs(text: str) -> list[dict]:
    """`sacctmgr -nP show assoc where user=U format=account,partition,qos,defaultqos`."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        account, partition, qos, default = (line.split("|") + ["", "", "", ""])[:4]
        rows.append({"account": account, "partition": partition, "qos": [q for q in qos.split(",") if q],
                     "default_qos": default})
    return rows


def read_live(user: str, seconds: float = READ_SECONDS) -> SiteFacts | None:
    """Slurm's configuration here, or None where scontrol is absent or does not answer within `seconds`."""
    if not shutil.which("scontrol"):
        return None
    start = time.monotonic()
    out = run_all(commands(user), start + seconds)
    if out["config"] is None or out["partitions"] is None:
        return None
    config = parse_config(out["config"])
    accounting = "slurmdbd" in config.get("AccountingStorageType", "") and out["qos"] is not None \
        and out["assocs"] is not None
    return SiteFacts("live", user, time.time(), round(time.monotonic() - start, 3),
                     version=config.get("SLURM_VERSION", ""), cluster=config.get("ClusterName", ""),
                     enforce=config.get("AccountingStorageEnforce", "none"), accounting=accounting,
                     enforce_part_limits=config.get("EnforcePartLimits", "NO"),
                     partitions=parse_partitions(out["partitions"]),
                     qos=parse_qos(out["qos"]) if accounting else {},
                     assocs=parse_assocs(out["assocs"]) if accounting else [],
                     default_account=(out["user"] or "").strip().splitlines()[0] if accounting and out["user"]
                     and out["user"].strip() else "")


def cache_path(user: str) -> Path:
    """Per user and per configuration (SLURM_CONF, or the default one)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybrid-kit" / "site"
    key = hashlib.sha256(f"{user}\0{os.environ.get('SLURM_CONF', '/etc/slurm/slurm.conf')}".encode()).hexdigest()
    return base / f"{key[:16]}.json"


def from_cache(user: str, max_age: float = CACHE_SECONDS) -> SiteFacts | None:
    try:
        data = json.loads(cache_path(user).read_text())
        facts = SiteFacts(**data)
    except (OSError, ValueError, TypeError):
        return None
    return facts if facts.user == user and 0 <= time.time() - facts.read_at <= max_age else None


def to_cache(facts: SiteFacts) -> None:
    """Written whole or not at all (a temporary file renamed); a cache that can't be written is no error."""
    path = cache_path(facts.user)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(asdict(facts), f)
        os.replace(f.name, path)
    except OSError:
        pass


_SILENT: set[tuple[str, str]] = set()  # (user, SLURM_CONF) where Slurm did not answer: asked once per process


def site_facts(use_cache: bool = True) -> SiteFacts | None:
    """The live facts (cached), or None where Slurm does not answer here."""
    user = current_user()
    where = (user, os.environ.get("SLURM_CONF", ""))
    facts = from_cache(user) if use_cache else None
    if facts is None and where not in _SILENT:
        facts = read_live(user)
        if facts is None:
            _SILENT.add(where)
        elif use_cache:
            to_cache(facts)
    return facts


if __name__ == "__main__":
    t0 = time.monotonic()
    got = site_facts(use_cache="--no-cache" not in sys.argv[1:])
    if got is None:
        print(f"site_slurm: Slurm does not answer here (scontrol absent, or no answer within {READ_SECONDS:g} s): "
              "the checker uses its dated Jean Zay table", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(asdict(got), indent=1))
    print(f"site_slurm: read in {time.monotonic() - t0:.3f} s", file=sys.stderr)

"""The site's rules as Slurm itself states them, read where the checker runs (issue 33).

Owns: the live read of the Slurm configuration (`scontrol show config`, `scontrol show partition`, `sacctmgr show
qos`, `sacctmgr show assoc`) into SiteFacts, its deadline and its per-user, per-cluster cache. Imports: kit.bounded.
kit.site turns the facts into findings, and keeps the dated Jean Zay table for where Slurm does not answer.

    python -m kit.site_slurm        # what the checker would read here, as JSON (and how long it took)

Each command gets the same deadline (READ_SECONDS, started together, a total) and its answer is read bounded
(kit.bounded.read_commands: MAX_ANSWER_BYTES, bytes that are not UTF-8 replaced, an empty answer not believed): a
slow or absent controller costs a check at most that long, and then the table stands in. sacctmgr answers only where
a slurmdbd does (AccountingStorageType=accounting_storage/slurmdbd): elsewhere Slurm enforces no QoS. Where a
slurmdbd is configured but sacctmgr does not answer in time (a busy database), the read says so
(`accounting_problem`): the partitions are Slurm's, the QoS, account and time rules the table's, and nothing of it is
cached (issue 42). A whole read is cached for CACHE_SECONDS per user and cluster (ClusterName in slurm.conf; a HOME
shared by two clusters keeps one cache each) in ~/.cache/hybrid-kit/site/, a folder and files of the user's own,
each read checked (a regular file of the user's, CACHE_BYTES at most, every field of its type) before it is believed.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import pwd
import re
import shutil
import stat
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from kit.bounded import FileProblem, read_commands, read_regular, whole_number

READ_SECONDS = 2.0
CACHE_SECONDS = 300
CACHE_BYTES = 8 * 2 ** 20  # a cached read: tens of kB on a large site; more is not one this module wrote
MAX_ROWS = 10_000  # partitions, QoS, associations: a few tens on Jean Zay, hundreds on the largest sites
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
    # why the accounting was not read where a slurmdbd is configured (sacctmgr slow or failing): then the table
    # judges the QoS, account and time, and the read is not cached; "" when read, or when there is no slurmdbd
    accounting_problem: str = ""

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
        if whole_number(count) is not None:  # ASCII digits only: 'gres/gpu=²' is no count
            out[name] = whole_number(count)
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


def read_live(user: str, seconds: float | None = None) -> tuple[SiteFacts | None, str]:
    """Slurm's configuration here, or (None, why not) where scontrol is absent or its answers are not ones to believe
    within `seconds` (READ_SECONDS): missing, slow, cut, empty, or not scontrol's. Where a slurmdbd is configured but
    sacctmgr's answers are not whole, the facts say why in `accounting_problem` (the partitions are still Slurm's)."""
    if not shutil.which("scontrol"):
        return None, "scontrol is not installed here"
    start = time.monotonic()
    out = read_commands(commands(user), READ_SECONDS if seconds is None else seconds, empty_ok=("assocs", "user"))
    for name in ("config", "partitions"):
        if out[name].why:
            return None, f"`{' '.join(out[name].argv)}` {out[name].why}"
    config, partitions = parse_config(out["config"].text), parse_partitions(out["partitions"].text)
    if "ClusterName" not in config and "SLURM_VERSION" not in config:
        return None, "`scontrol show config` printed no Slurm configuration (no ClusterName, no SLURM_VERSION)"
    if not partitions or len(partitions) > MAX_ROWS:
        return None, (f"`scontrol show partition` listed {len(partitions) or 'no'} partitions"
                      + (f", more than the {MAX_ROWS} read" if partitions else ""))
    slurmdbd = "slurmdbd" in config.get("AccountingStorageType", "")
    qos, assocs = parse_qos(out["qos"].text), parse_assocs(out["assocs"].text)
    problem = next((f"`{' '.join(out[k].argv[:4])} ...` {out[k].why}" for k in ("qos", "assocs", "user")
                    if out[k].why), "") if slurmdbd else ""
    if slurmdbd and not problem and (len(qos) > MAX_ROWS or len(assocs) > MAX_ROWS):
        problem = f"sacctmgr listed more than {MAX_ROWS} QoS or associations"
    accounting = slurmdbd and not problem
    return SiteFacts("live", user, time.time(), round(time.monotonic() - start, 3),
                     version=config.get("SLURM_VERSION", ""), cluster=config.get("ClusterName", ""),
                     enforce=config.get("AccountingStorageEnforce", "none"), accounting=accounting,
                     enforce_part_limits=config.get("EnforcePartLimits", "NO"), partitions=partitions,
                     qos=qos if accounting else {}, assocs=assocs if accounting else [],
                     default_account=(out["user"].text.split() or [""])[0] if accounting else "",
                     accounting_problem=problem), ""


def configured_cluster() -> str | None:
    """ClusterName in the slurm.conf this host's commands read (SLURM_CONF, else /etc/slurm/slurm.conf; slurm.conf(5):
    parameter names are not case sensitive), read bounded; None where no such file names one (a configless client:
    then no read is cached)."""
    try:
        data, _ = read_regular(os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf", 4 * 2 ** 20)
    except FileProblem:
        return None
    m = re.search(r"^[ \t]*ClusterName[ \t]*=[ \t]*([^\s#]+)", data.decode("utf-8", "replace"), re.M | re.I)
    return m.group(1) if m else None


def cache_path(user: str, cluster: str) -> Path:
    """Per user, configuration (SLURM_CONF, or the default one) and cluster."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybrid-kit" / "site"
    conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    key = hashlib.sha256(f"{user}\0{conf}\0{cluster}".encode()).hexdigest()
    return base / f"{key[:16]}.json"


def from_cache(user: str, cluster: str, max_age: float = CACHE_SECONDS) -> SiteFacts | None:
    """A cached read of this user on this cluster, if the file is one to believe: a regular file (not a link, a
    FIFO, a device) of the user's own, not writable by others, in a folder of the user's own, at most CACHE_BYTES,
    every field of its type, the same user and cluster, younger than max_age. Anything else is read afresh."""
    path = cache_path(user, cluster)
    try:
        folder = os.lstat(path.parent)
        if not stat.S_ISDIR(folder.st_mode) or folder.st_uid != os.getuid() or folder.st_mode & 0o022:
            return None
        data, st = read_regular(path, CACHE_BYTES, nofollow=True)
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            return None
        facts = checked_facts(json.loads(data.decode("utf-8")))
    except (FileProblem, OSError, ValueError, RecursionError):
        return None
    fresh = facts is not None and 0 <= time.time() - facts.read_at <= max_age
    if not fresh or (facts.user, facts.cluster) != (user, cluster):
        return None
    facts.source = "cache"
    return facts


def _is(value: object, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


PARTITION_TYPES = {"max_time": str, "default_time": str, "allow_qos": str, "qos": str, "default": bool,
                   "allow_accounts": str}
QOS_TYPES = {"max_wall": str, "max_tres": dict, "max_tres_pu": dict, "max_tres_pa": dict, "flags": str}
ASSOC_TYPES = {"account": str, "partition": str, "qos": list, "default_qos": str}


def checked_facts(data: object) -> SiteFacts | None:
    """SiteFacts from a cached read if every field has the type read_live gives it (a hand-edited or foreign file
    is no traceback), else None."""
    kinds = {"str": str, "float": float, "bool": bool, "dict": dict, "list": list}
    if not isinstance(data, dict) or set(data) != {f.name for f in fields(SiteFacts)}:
        return None
    for f in fields(SiteFacts):
        if not _is(data[f.name], kinds[f.type]):
            return None

    def rows(table: object, types: dict) -> bool:
        return all(isinstance(r, dict) and set(r) == set(types) and all(_is(r[k], t) for k, t in types.items())
                   for r in table)
    tres = [t for q in data["qos"].values() if isinstance(q, dict) for k in ("max_tres", "max_tres_pu", "max_tres_pa")
            for t in [q.get(k)]]
    if not (rows(data["partitions"].values(), PARTITION_TYPES) and rows(data["qos"].values(), QOS_TYPES)
            and rows(data["assocs"], ASSOC_TYPES) and all(isinstance(q, str) for a in data["assocs"] for q in a["qos"])
            and all(_is(n, int) and n >= 0 for t in tres for n in t.values())):
        return None
    return SiteFacts(**data)


def to_cache(facts: SiteFacts) -> None:
    """Written whole or not at all (a temporary file renamed), readable by the user only, in a folder of the user's
    own; a partial read (accounting_problem) is never cached; a cache that can't be written is no error."""
    if facts.accounting_problem or not facts.cluster:
        return
    path = cache_path(facts.user, facts.cluster)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        text = json.dumps(asdict(facts))
        if len(text) > CACHE_BYTES:
            return
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            f.write(text)
        os.replace(f.name, path)
    except OSError:
        pass


_SILENT: dict[tuple[str, str], str] = {}  # (user, SLURM_CONF) where Slurm did not answer, and why: asked once a process


def site_facts(use_cache: bool = True) -> tuple[SiteFacts | None, str]:
    """The live facts (a cached read where one is to believe), or (None, why not) where Slurm does not answer here."""
    user = current_user()
    where = (user, os.environ.get("SLURM_CONF", ""))
    if where in _SILENT:
        return None, _SILENT[where]
    cluster = configured_cluster() if use_cache else None
    facts = from_cache(user, cluster) if cluster else None
    if facts is not None:
        return facts, ""
    facts, why = read_live(user)
    if facts is None:
        _SILENT[where] = why
    elif use_cache and cluster and facts.cluster == cluster:  # a read of another cluster than slurm.conf's: not kept
        to_cache(facts)
    return facts, why


if __name__ == "__main__":
    t0 = time.monotonic()
    got, why_not = site_facts(use_cache="--no-cache" not in sys.argv[1:])
    if got is None:
        print(f"site_slurm: Slurm does not answer here ({why_not}): the checker uses its dated Jean Zay table",
              file=sys.stderr)
        sys.exit(1)
    print(json.dumps(asdict(got), indent=1))
    print(f"site_slurm: read in {time.monotonic() - t0:.3f} s", file=sys.stderr)

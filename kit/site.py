"""The site: Jean Zay in one dated table (node types, partitions, constraints, GPUs, cores, hours, QoS, modules),
and the same checks against Slurm's own configuration where it answers (kit.site_slurm reads it; --site).
Owns: JEAN_ZAY and its date, how a site finding is worded. Imports: kit.arguments, kit.bounded, kit.findings,
kit.releases, kit.slurm.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from kit.arguments import Training
from kit.bounded import listed, number_shown
from kit.findings import Findings
from kit.releases import torch_refusals, torch_version_of, version_tuple
from kit.slurm import HINTS, Job, time_minutes, value_tokens


@dataclass(frozen=True)
class NodeType:
    label: str
    partitions: tuple[str, ...]  # the -p names that give these nodes; the first is the one to write
    gpus: int  # per node (0: CPU nodes)
    gpu_gib: float | None  # one GPU's memory as nvidia-smi shows it (the smaller where the nodes mix two boards)
    cores: int | None  # physical cores per node (None: not confirmed, not checked)
    accounts: tuple[str, ...]  # <project>@suffix that pays for them; () hours not deducted
    qos: tuple[str, ...]  # the QoS families that run there (qos_gpu-t3 is family qos_gpu); () none
    qos_hours: dict  # QoS -> its time limit in hours (the first is the default)
    max_hours: float  # the partition's own limit
    default_minutes: int  # --time when the script gives none
    features: dict = field(default_factory=dict)  # -C feature -> GPU GiB of the nodes that carry it
    arch: str | None = None  # the module that must come before the others on these nodes
    arch_required: bool = False  # without it the modules for these nodes are not found (else: advised)
    bf16: bool = True
    qos_limit: dict = field(default_factory=dict)  # QoS -> most GPUs (GPU nodes) or cores (CPU nodes) per job


V100_HOURS = {"t3": 20, "dev": 2, "t4": 100}


# Sources, by fact (IDRIS's pages as stored for this work; users' job scripts where IDRIS's text was not reachable):
# - partitions, constraints, boards, default time, limits: IDRIS "GPU Partitions" and "CPU Partitions"
#   (idris.fr/en/docs/jean-zay/slurm/slurm_partitions_gpu and _cpu): gpu_p13 the default, 4 V100 of 16 or 32 GB
#   selected by -C v100-16g / -C v100-32g (the old gpu_p3 / gpu_p1), gpu_p2 (gpu_p2s 360 GB, gpu_p2l 720 GB of RAM)
#   8 x V100 32 GB; 10 min by default, at most 100 h; cpu_p1 the CPU default, 10 min / 100 h; prepost 2 h / 20 h;
#   visu 10 min / 4 h; archive and compil 2 h / 20 h, hours not deducted; compil_H100 for gpu_p6's software.
# - the QoS names and limits per job (qos_gpu-t3 20 h 512 GPUs, -t4 100 h 16 GPUs, -dev 2 h 32 GPUs; qos_cpu-t3
#   20 h 20480 cores, -t4 100 h 160 cores, -dev 2 h 5120 cores): IDRIS's QoS table as users' tools copy it; the
#   A100 and H100 QoS (qos_gpu_a100-dev/-t3, no t4; qos_gpu_h100-dev/-t3/-t4) and the @cpu QoS: `sacctmgr show
#   assoc` listings in users' notes. IDRIS's own QoS table was not reachable: per-job GPU limits of the A100 and
#   H100 QoS are not checked.
# - cores: 40 per V100 node and per cpu_p1 node (2 x Cascade Lake 6248), 24 on gpu_p2, 48 on gpu_p4, 64 on gpu_p5
#   (2 x AMD Milan), 96 on gpu_p6 (24 a GPU in IDRIS's own H100 scripts: the row's comment); prepost's
#   not confirmed. Memory is granted per reserved core.
# - modules: `module load cpuarch/amd` for gpu_p5 (IDRIS's job-script template, as users' scripts copy it: "if you
#   are using the gpu_p5 partition"), `module load arch/h100` before the others on gpu_p6.
# - gpu_p4: users' scripts pay its hours with @v100 or @a100 and run it under qos_gpu-*: both are accepted here.
JEAN_ZAY = {
    "v100-4": NodeType("4-GPU V100 nodes (gpu_p13)", ("gpu_p13",), 4, 16160 / 1024, 40, ("v100",), ("qos_gpu",),
                       V100_HOURS, 100, 10, {"v100-16g": 16160 / 1024, "v100-32g": 32510 / 1024}, bf16=False,
                       qos_limit={"dev": 32, "t3": 512, "t4": 16}),
    "v100-8": NodeType("8-GPU V100 nodes (gpu_p2)", ("gpu_p2", "gpu_p2s", "gpu_p2l"), 8, 32510 / 1024, 24, ("v100",),
                       ("qos_gpu",), V100_HOURS, 100, 10, bf16=False, qos_limit={"dev": 32, "t3": 512, "t4": 16}),
    "a100-40": NodeType("8-GPU A100 40 GB nodes (gpu_p4)", ("gpu_p4",), 8, 40960 / 1024, 48, ("a100", "v100"),
                        ("qos_gpu_a100", "qos_gpu"), {"t3": 20, "dev": 2, "t4": 100}, 100, 10),
    "a100": NodeType("8-GPU A100 80 GB nodes (-C a100, gpu_p5)", ("gpu_p5",), 8, 81920 / 1024, 64, ("a100",),
                     ("qos_gpu_a100",), {"t3": 20, "dev": 2}, 20, 10, {"a100": 81920 / 1024}, arch="cpuarch/amd"),
    # H100, checked 2026-12-07 against IDRIS's own sources: "CPU Partitions" (idris.fr/en/docs/jean-zay/slurm/
    # slurm_partitions_cpu: gpu_p6 is "the Eviden H100 partition", compil_H100 compiles for it) and IDRIS's job
    # scripts for these nodes (github.com/idriscnrs/picotron_tutorial_jean-zay, slurm/run_step*.slurm:
    # --constraint=h100, --account=...@h100, --gres=gpu:4 with --ntasks-per-node=4 and --cpus-per-task=24, i.e. 24
    # cores a GPU and 96 a node, --qos=qos_gpu_h100-dev, `module load arch/h100` before pytorch-gpu). The -t3 (the
    # default) and -t4 names, and the hours, are users' (their scripts and sacctmgr listings), not IDRIS's pages:
    # the stored "GPU Partitions" page stops before its H100 section.
    "h100": NodeType("4-GPU H100 nodes (-C h100, gpu_p6)", ("gpu_p6",), 4, 81559 / 1024, 96, ("h100",),
                     ("qos_gpu_h100",), V100_HOURS, 100, 10, {"h100": 81559 / 1024}, arch="arch/h100",
                     arch_required=True),
    "cpu": NodeType("CPU nodes (cpu_p1)", ("cpu_p1",), 0, None, 40, ("cpu",), ("qos_cpu",), V100_HOURS, 100, 10,
                    qos_limit={"dev": 5120, "t3": 20480, "t4": 160}),
    "prepost": NodeType("pre/post-processing nodes (prepost)", ("prepost",), 0, None, None, (), (), {}, 20, 120),
    "visu": NodeType("visualisation nodes (visu)", ("visu",), 0, None, None, (), (), {}, 4, 10),
    "archive": NodeType("data-management nodes (archive)", ("archive",), 0, None, None, (), (), {}, 20, 120),
    "compil": NodeType("compilation nodes (compil)", ("compil", "compil_h100"), 0, None, None, (), (), {}, 20, 120),
}


# The date of the table above (its last review against the sources named there), and how a finding it alone decides
# is worded: the site's documented rule, not Slurm's configuration (issue 33: a project's grants are in no table).
JEAN_ZAY_DATE = "2026-12-01"

TABLE_SAYS = f"Jean Zay's documented rule (table of {JEAN_ZAY_DATE})"

TABLE_QOS = f"Jean Zay's documented QoS (table of {JEAN_ZAY_DATE})"


# What settles what the table cannot know, on a Jean Zay login node: the user's accounts and QoS, and a QoS's limits.
ASSOC_COMMAND = "sacctmgr show assoc where user=$USER format=account,partition,qos,defaultqos"

QOS_COMMAND = "sacctmgr show qos format=name,maxwall,maxtrespu,maxtrespa,maxjobspu"

RETIRED_PARTITIONS = {"gpu_p1": "-C v100-32g", "gpu_p3": "-C v100-16g"}  # merged into gpu_p13 on 8/12/2020 (IDRIS)

FEATURE_TYPES = {f: name for name, t in JEAN_ZAY.items() for f in t.features}

PARTITION_TYPES = {p: name for name, t in JEAN_ZAY.items() for p in t.partitions}


def constraint_features(constraint: str | None) -> list[list[str]]:
    """-C's alternatives ('|'), each the features it needs ('&', ','), lower case."""
    return [[f.strip().lower() for f in re.split(r"[&,\[\]*()]", alt) if f.strip()]
            for alt in (constraint or "").split("|") if alt.strip()]


def looks_like_jean_zay(job: Job) -> bool:
    """An account <project>@v100/@a100/@h100/@cpu or a qos_gpu*/qos_cpu* QoS: then no -p means Jean Zay's default."""
    suffix = (job.account or "").rpartition("@")[2].lower() if "@" in (job.account or "") else ""
    return suffix in ("v100", "a100", "h100", "cpu") or (job.qos or "").lower().startswith(("qos_gpu", "qos_cpu"))


def asks_gpus(job: Job) -> bool:
    return any((job.gres_gpus, job.gpus_per_node, job.gpus_total, job.gpus_per_task))


def node_type(job: Job) -> str | None:
    """The JEAN_ZAY row the job runs on: its -p, else its -C's feature (-C a100 sends a job to gpu_p5), else the
    default partition when the job is Jean Zay's (gpu_p13 for GPUs, cpu_p1 otherwise); None: nodes not known."""
    if job.partition in PARTITION_TYPES:
        return PARTITION_TYPES[job.partition]
    if job.partition in RETIRED_PARTITIONS:
        return "v100-4"
    if job.partition:
        return None  # another cluster's partition: its sizes are not checked
    for alternative in constraint_features(job.constraint):
        for f in alternative:
            if f in FEATURE_TYPES:
                return FEATURE_TYPES[f]
    if looks_like_jean_zay(job):
        return "v100-4" if asks_gpus(job) else "cpu"
    return None


def node_cap(job: Job) -> int | None:
    """Tasks of --cpus-per-task cores that fit on one node, when the node type is known."""
    ntype = node_type(job)
    cores = JEAN_ZAY[ntype].cores if ntype else None
    return cores // (job.cpus_per_task or 1) if cores else None


def gpu_memory(job: "Job") -> tuple[float | None, str]:
    """GiB of one of the job's GPUs and where that came from: --gpu-mem, else the GPUs of this allocation
    (nvidia-smi), else the constraint or partition."""
    if job.gpu_mem is not None:
        return job.gpu_mem, f"--gpu-mem {job.gpu_mem:g}"
    if job.gpu_mem_seen is not None:
        return job.gpu_mem_seen, "the allocation's GPUs (nvidia-smi)"
    ntype = node_type(job)
    for alternative in constraint_features(job.constraint):
        for f in alternative:
            if f in FEATURE_TYPES and (ntype is None or FEATURE_TYPES[f] == ntype):
                return JEAN_ZAY[FEATURE_TYPES[f]].features[f], f"-C {f}"
    if ntype and JEAN_ZAY[ntype].gpu_gib and (job.partition or looks_like_jean_zay(job)):
        name = job.partition or JEAN_ZAY[ntype].partitions[0]
        mixed = ", which mixes 16 and 32 GB V100s: assuming 16 GB" if ntype == "v100-4" else ""
        return JEAN_ZAY[ntype].gpu_gib, f"partition {name}{mixed}"
    return None, "unknown"


def is_v100(job: "Job") -> bool:
    ntype = node_type(job)
    return (not JEAN_ZAY[ntype].bf16 and JEAN_ZAY[ntype].gpus > 0) if ntype else "v100" in (job.constraint or "").lower()


def check_nodes(job: Job, findings: Findings) -> None:
    """The partition and the constraint against the table: a retired partition, a feature no node of the partition
    has (Slurm: 'Requested node configuration is not available', measured with -p gpu_p2 -C v100-16g)."""
    if job.partition in RETIRED_PARTITIONS:
        findings.error("constraint-unavailable", f"--partition={job.partition} no longer exists on Jean Zay (merged "
                       f"into gpu_p13 on 8 December 2020, IDRIS): use {RETIRED_PARTITIONS[job.partition]} instead")
        return
    ntype = node_type(job)
    alternatives = constraint_features(job.constraint)

    def elsewhere(feature: str) -> bool:  # a feature the table puts on other nodes (unknown features: not judged)
        return feature in FEATURE_TYPES and FEATURE_TYPES[feature] != ntype
    if ntype and alternatives and all(any(elsewhere(f) for f in a) for a in alternatives):
        feature = next(f for a in alternatives for f in a if elsewhere(f))
        other = JEAN_ZAY[FEATURE_TYPES[feature]]
        findings.error("constraint-unavailable", f"-C {job.constraint} asks for {other.label.split(' (')[0]}, but "
                       f"no node of {JEAN_ZAY[ntype].label} has '{feature}': Slurm refuses the job ('Requested node "
                       f"configuration is not available'); drop -C, or use -p {other.partitions[0]} (or -C {feature} "
                       "alone)")


def check_cpus(job: Job, gpus_per_task: int, tasks_per_node: list[int], findings: Findings) -> None:
    """Cores per task against the node's cores per GPU (Jean Zay grants memory per reserved core), and tasks x
    --cpus-per-task against the node's cores. `gpus_per_task` is what each task holds (GPUs per node / tasks)."""
    ntype = node_type(job)
    t = JEAN_ZAY[ntype] if ntype else None
    per_gpu = t.cores // t.gpus if t and t.cores and t.gpus else None
    want = per_gpu * gpus_per_task if per_gpu and gpus_per_task else None
    if job.cpus_per_task is None and job.cpus_per_gpu:  # the cores come with the GPUs: --cpus-per-gpu x GPUs
        check_cpus_per_gpu(job, t, per_gpu, findings)
    elif job.cpus_per_task is None:
        if gpus_per_task or (t and t.gpus):
            findings.warn("cpus-per-task-missing",
                          "--cpus-per-task is not given: each task gets 1 core for itself and its DataLoader workers "
                          "(and on Jean Zay only 1 core's share of memory); "
                          + (f"add --cpus-per-task={want} ({per_gpu} per GPU x {gpus_per_task} GPUs)" if want
                             else "add --cpus-per-task=<cores per GPU x GPUs per task>"))
    elif want and (job.step_cpus_per_task or job.cpus_per_task) < want:
        said = f"srun -c {job.step_cpus_per_task}" if job.step_cpus_per_task else f"--cpus-per-task={job.cpus_per_task}"
        findings.warn("cpus-per-task-small",
                      f"{said} is below the {want} cores that go with {gpus_per_task} GPU(s) on {t.label}; memory is "
                      f"granted per reserved core there: use {said.rpartition(' ')[0] or '--cpus-per-task'}"
                      f"{'=' if not job.step_cpus_per_task else ' '}{want}")
    elif gpus_per_task and (job.step_cpus_per_task or job.cpus_per_task) < 2:
        findings.warn("cpus-per-task-small", f"--cpus-per-task={job.cpus_per_task} leaves no core for DataLoader "
                      "workers; use at least 2")
    # the request's own tasks a node (what sbatch judges: --ntasks-per-node, or -n on one node), not a step's: srun
    # gives a step's task 1 core without -c (measured: -N 1 -c 10 ran `srun -n 5`)
    busiest = job.ntasks_per_node or (job.ntasks if job.ntasks and (job.nodes or 1) == 1 else None)
    if t and t.cores and job.cpus_per_task and busiest:
        if job.cpus_per_task * busiest > t.cores:
            findings.error("cpus-exceed-node",
                           f"{busiest} task(s) x --cpus-per-task={job.cpus_per_task} = "
                           f"{busiest * job.cpus_per_task} cores, but {t.label} have {t.cores}: sbatch refuses the "
                           "job ('CPU count per node can not be satisfied', measured); "
                           f"use --cpus-per-task <= {max(1, t.cores // busiest)}")
    hints = [h.lower() for h in value_tokens(job.hint or "")]
    if "nomultithread" not in hints and all(h in HINTS for h in hints if h):  # a hint sbatch refuses: bad-value
        findings.warn("hint-missing", "--hint=nomultithread is not set: tasks get hyperthreads instead of "
                      "physical cores (Jean Zay's advice for its jobs is --hint=nomultithread)")


def check_cpus_per_gpu(job: Job, t: NodeType | None, per_gpu: int | None, findings: Findings) -> None:
    """--cpus-per-gpu: the allocation holds that many cores per GPU on each node (measured on the test cluster:
    --cpus-per-gpu=24 with 4 GPUs held 96 cores); more than the node has is refused, fewer than its share leaves
    memory unused on Jean Zay (granted per core)."""
    gpn, cpg = job.gpus_per_node, job.cpus_per_gpu
    where = job.option_lines.get("cpus-per-gpu", "the directives")
    if t and t.cores and gpn and cpg * gpn > t.cores:
        findings.error("cpus-exceed-node", f"{where}: --cpus-per-gpu={cpg} x {gpn} GPU(s) = {cpg * gpn} cores per "
                       f"node, but {t.label} have {t.cores}: sbatch refuses the job ('Requested node configuration "
                       f"is not available', measured); use --cpus-per-gpu <= {t.cores // gpn}")
    elif per_gpu and cpg < per_gpu:
        findings.warn("cpus-per-task-small", f"{where}: --cpus-per-gpu={cpg} is below the {per_gpu} cores per GPU of "
                      f"{t.label}; memory is granted per reserved core there: use --cpus-per-gpu={per_gpu}")


def qos_of(job: Job) -> tuple[str | None, str | None]:
    """(family, level) of --qos: qos_gpu_h100-t4 -> (qos_gpu_h100, t4); (None, None) without --qos."""
    return qos_words(job.qos)


def qos_words(qos: str | None) -> tuple[str | None, str | None]:
    m = re.fullmatch(r"(qos_\w+?)-(dev|t3|t4)", (qos or "").lower())
    return (m.group(1), m.group(2)) if m else ((qos.lower(), None) if qos else (None, None))


def check_time(job: Job, findings: Findings, limits: bool = True) -> None:
    """--time against the QoS's limit and the partition's, on Jean Zay (limits=False: its form only)."""
    if job.time == "allocated":  # inside the allocation the limit is already granted
        return
    ntype = node_type(job)
    t = JEAN_ZAY[ntype] if ntype else None
    if job.time is None:
        default = t.default_minutes if t else DEFAULT_TIME_MINUTES
        findings.warn("time-missing", f"--time is not given: the partition's default applies, {default} minutes"
                      + (f" on {t.label}" if t else " on Jean Zay's GPU partitions") + "; add --time=HH:MM:SS, e.g. "
                      "--time=02:00:00")
        return
    minutes = time_minutes(job.time)
    if minutes is None:
        findings.error("bad-time", f"--time={number_shown(job.time, 40)!r} is not a Slurm time (MM, HH:MM:SS or "
                       "D-HH:MM:SS)")
        return
    if t is None or not limits:
        return  # a partition that isn't Jean Zay's, or the limits are Slurm's own (check_live) or not judged
    family, level = qos_of(job)
    shown = "unlimited" if minutes == float("inf") else f"{minutes / 60:.1f} h"
    written = number_shown(job.time, 40)  # 5,000 digits are quoted by their start and length
    implicit = False
    if t.qos and level in t.qos_hours and family in t.qos:
        limit, name = t.qos_hours[level], job.qos
    elif t.qos and not job.qos:  # the association's default QoS: the table knows the documented one only
        level = next(iter(t.qos_hours))
        limit, name, implicit = t.qos_hours[level], f"the default QoS ({t.qos[0]}-{level})", True
    elif not t.qos:
        limit, name = t.max_hours, f"{t.label.split(' (')[0]} ({t.partitions[0]})"
    elif not qos_in_table(job.qos):  # a project's own QoS (check_qos says so): its limit is its grant's
        limit, name = t.max_hours, f"the partition {t.partitions[0]}"
    else:  # a QoS of other nodes (check_qos says so): the longest these nodes have
        limit, name = max(t.qos_hours.values()), f"the longest QoS of {t.label}"
    if minutes > limit * 60:
        longer = [q for q, h in t.qos_hours.items() if h * 60 >= minutes]
        fix = (f"add --qos={t.qos[0]}-{longer[0]} (up to {t.qos_hours[longer[0]]} h)" if longer else
               f"use --time <= {max(list(t.qos_hours.values()) or [t.max_hours]):g}:00:00 and resume from a checkpoint")
        if implicit and minutes <= t.max_hours * 60:  # a project's association may default to a longer QoS
            findings.warn("time-over-qos", f"--time={written} ({shown}) is over the {limit:g} h of {name}, "
                          f"{TABLE_SAYS}: Slurm won't run a job left on it (refused, or pending with "
                          f"QOSMaxWallDurationPerJobLimit); {fix}, "
                          f"unless your association's default QoS is longer (`{ASSOC_COMMAND}`)")
        else:
            findings.error("time-over-qos", f"--time={written} ({shown}) is over the {limit:g} h of {name}, "
                           f"{TABLE_SAYS}: Slurm won't run the job; {fix}")


def check_jean_zay(job: Job, findings: Findings, gpus_asked: int | None = None,
                   cores_asked: int | None = None, table_qos: bool = True) -> None:
    """The account's hours, the QoS's family and size, the modules the nodes need (IDRIS: a project spends V100,
    A100, H100 or CPU hours through <project>@v100, @a100, @h100 or @cpu; sources at JEAN_ZAY)."""
    ntype = node_type(job)
    if ntype is None:
        return
    t = JEAN_ZAY[ntype]
    suffix = (job.account or "").rpartition("@")[2].lower() if "@" in (job.account or "") else None
    if suffix and suffix in ("v100", "a100", "h100", "cpu") and t.accounts and suffix not in t.accounts:
        where = ("-C " + job.constraint if job.constraint else "-p " + job.partition if job.partition
                 else "no -p: the default " + t.partitions[0])
        owner = next((n for n, r in JEAN_ZAY.items() if suffix in r.accounts), "v100-4")
        findings.error("account-mismatch",
                       f"--account={job.account} spends {suffix.upper()} hours but the job asks for {t.label} "
                       f"({where}), {TABLE_SAYS}; use --account=<project>@{t.accounts[0]}, or "
                       f"{'-p ' + JEAN_ZAY[owner].partitions[0] if suffix != 'v100' else '-p gpu_p13'} for the nodes "
                       "of that account")
    if job.time != "allocated" and table_qos:  # a running job already has its account and QoS
        check_qos(job, t, gpus_asked, cores_asked, findings)
    mods = job.modules
    if not t.arch or not mods:
        return
    at = next((i for i, m in enumerate(mods) if m.startswith(t.arch)), None)
    late = [m for m in mods[:at] if not m.startswith(("arch/", "cpuarch/"))] if at is not None else []
    if at is None or any(m.startswith("pytorch") for m in late):
        first = job.torch_module or next((m for m in mods if not m.startswith(("arch/", "cpuarch/"))), mods[0])
        msg = (f"{t.label} with 'module load {first}' but no 'module load {t.arch}' before it: the modules built "
               f"for these nodes are found only after it; add 'module load {t.arch}' first")
        if t.arch_required:  # IDRIS: the H100 stack is loaded with arch/h100 before the other modules
            findings.error("arch-module-missing", msg)
        else:  # IDRIS's template: cpuarch/amd gives gpu_p5 the modules built for its AMD CPUs
            findings.warn("arch-module-missing", msg)


def qos_in_table(qos: str | None) -> bool:
    """Whether --qos is a family and level of Jean Zay's table (qos_gpu-t3, qos_gpu_a100-t4: known words, whether or
    not those nodes have it); qos_gpu-gc, a QoS granted to one project, is not: no table can know it."""
    family, level = qos_words(qos)
    return bool(level) and any(family in t.qos for t in JEAN_ZAY.values())


def check_qos(job: Job, t: NodeType, gpus_asked: int | None, cores_asked: int | None, findings: Findings) -> None:
    family, level = qos_of(job)
    if not job.qos or not t.qos:
        return
    valid = ", ".join(f"{t.qos[0]}-{q}" for q in t.qos_hours)
    if not qos_in_table(job.qos):
        findings.warn("qos-mismatch", f"--qos={job.qos} is not in {TABLE_QOS} for {t.label} ({valid}): a project "
                      f"may be granted its own QoS; `{ASSOC_COMMAND}` lists yours and `{QOS_COMMAND}` their limits")
        return
    if family not in t.qos or level not in t.qos_hours:
        findings.error("qos-mismatch", f"--qos={job.qos} is not a QoS of {t.label}, {TABLE_SAYS}: Slurm refuses the "
                       f"job ('Invalid qos specification'); use one of {valid}")
        return
    limit = t.qos_limit.get(level)
    count, unit = (gpus_asked, "GPUs") if t.gpus else (cores_asked, "cores")
    if limit and count and count > limit:
        findings.error("qos-limit", f"--qos={job.qos} allows at most {limit} {unit} per job ({TABLE_SAYS}) and this "
                       f"job asks for {count}: it would wait forever (or be refused); use fewer {unit}"
                       + (" or --qos=" + t.qos[0] + "-t3 (20 h)" if level == "t4" else ""))

# What Slurm does with a job its configuration forbids, measured on the test cluster with slurmdbd
# (tests/test_site_slurmdbd.py): refused at submission, or accepted and then pending with this reason forever.
PENDING = {"wall": "QOSMaxWallDurationPerJobLimit", "gpu_job": "QOSMaxGRESPerJob", "gpu_user": "QOSMaxGRESPerUser",
           "cpu_job": "QOSMaxCpuPerJobLimit", "cpu_user": "QOSMaxCpuPerUserLimit", "part_time": "PartitionTimeLimit",
           "allow_qos": "Job's QOS not permitted to use this partition"}  # (a sentence, not a code, in 22.05)

REFUSED = {"partition": "Invalid partition name specified", "qos": "Invalid qos specification",
           "account": "Invalid account or account/partition combination specified",
           "deny": "Job violates accounting/QOS policy (job submit limit, user's size and/or time limits)",
           "part_time": "Requested time limit is invalid (missing or exceeds some limit)"}


def fate(refused: str | None, pending: str) -> str:
    """How a job Slurm won't run fails: at submission (sbatch's message) or pending forever (squeue's reason)."""
    return (f"sbatch refuses it ('{REFUSED[refused]}')" if refused else
            f"sbatch accepts it and it pends forever (squeue's reason: {PENDING[pending]})")


def check_live(job: Job, facts, gpus: int | None, cores: int | None, findings: Findings) -> None:
    """The partition, account, QoS and their limits as Slurm's configuration here states them (a site_slurm.SiteFacts
    read by --site live): the site's own rules, in place of the table's."""
    if job.time == "allocated":  # a running job already has its partition, account and QoS
        return
    here = f"Slurm's configuration here ({facts.cluster or 'this cluster'}, Slurm {facts.version})"
    names = [p for p in (job.partition or "").split(",") if p] or \
        [n for n, p in facts.partitions.items() if p["default"]][:1]
    unknown = [p for p in names if p not in facts.partitions]
    if unknown:
        findings.error("partition-unknown", f"-p {unknown[0]} is not a partition of {here}: "
                       f"{fate('partition', '')}; use one of {listed(sorted(facts.partitions))}")
        return
    part = facts.partitions[names[0]] if names else None
    qos = live_qos(job, facts, names[0] if names else "", here, findings)
    if qos is False:
        return
    allow = part["allow_qos"] if part else "ALL"
    if qos and allow.upper() != "ALL" and qos not in allow.lower().split(","):
        # slurm.conf(5) AllowQos: checked when the job is scheduled, not at submission, unless EnforcePartLimits
        # is set (then sbatch refuses 'Invalid qos specification'): measured, tests/site_cases.py
        refused = "qos" if facts.enforce_part_limits.upper() in ("ANY", "ALL", "YES") else None
        findings.error("qos-mismatch", f"QoS {qos}{'' if job.qos else ' (your association default)'} is not allowed "
                       f"on partition {names[0]} in {here} (AllowQos={listed(allow.split(','))}): "
                       f"{fate(refused, 'allow_qos')}; use one of them" + ("" if job.qos else " with --qos"))
        return
    live_limits(job, facts, part, names[0] if names else "", qos, gpus, cores, here, findings)


def live_qos(job: Job, facts, partition: str, here: str, findings: Findings):
    """The QoS the job runs under (its --qos, else its association's default), or False where Slurm refuses the
    account or the QoS."""
    assocs = [a for a in facts.assocs if a["partition"] in ("", partition)]
    accounts = sorted({a["account"] for a in assocs})
    if job.account and facts.enforces("associations") and job.account.lower() not in accounts:
        findings.error("account-mismatch", f"--account={job.account} is none of your associations in {here} "
                       f"({listed(accounts) or 'none'}): {fate('account', '')}; `{ASSOC_COMMAND}` lists them")
        return False
    account = (job.account or facts.default_account).lower()  # sbatch(1) --account: else the user's default
    mine = [a for a in assocs if not account or a["account"] == account]
    allowed = sorted({q for a in mine for q in a["qos"]})
    if not job.qos:
        return next((a["default_qos"] for a in mine if a["default_qos"]), None)
    if facts.enforces("qos") and job.qos.lower() not in allowed:
        findings.error("qos-mismatch", f"--qos={job.qos} is not among your QoS in {here}"
                       f"{' for --account=' + job.account if job.account else ''} ({listed(allowed) or 'none'}): "
                       f"{fate('qos', '')}; use one of them, or ask for it (`{ASSOC_COMMAND}` lists yours)")
        return False
    return job.qos.lower()


def live_limits(job: Job, facts, part: dict | None, partition: str, qos: str | None, gpus: int | None,
                cores: int | None, here: str, findings: Findings) -> None:
    """--time against the QoS's MaxWall and the partition's MaxTime; the GPUs and cores against the QoS's per-job
    and per-user TRES limits (enforced with AccountingStorageEnforce=limits; DenyOnLimit refuses at submission)."""
    q = facts.qos.get(qos) if qos and facts.enforces("limits") else None
    deny = "deny" if q and "DenyOnLimit" in q["flags"] else None
    minutes = time_minutes(job.time) if job.time else None
    wall = time_minutes(q["max_wall"]) if q and q["max_wall"] else None
    longest = time_minutes(part["max_time"]) if part and part["max_time"] else None
    written = number_shown(job.time or "", 40)
    shown = f"--time={written} ({minutes / 60:.1f} h)" if minutes and minutes != float("inf") else f"--time={written}"
    if minutes and wall and minutes > wall and "PartitionTimeLimit" not in (q or {}).get("flags", ""):
        findings.error("time-over-qos", f"{shown} is over QoS {qos}'s MaxWall {q['max_wall']} in {here}: "
                       f"{fate(deny, 'wall')}; use --time <= {q['max_wall']} or a QoS of yours that allows it")
    elif minutes and longest and minutes > longest:
        refused = "part_time" if facts.enforce_part_limits.upper() in ("ANY", "ALL", "YES") else None
        findings.error("time-over-qos", f"{shown} is over partition {partition}'s MaxTime {part['max_time']} in "
                       f"{here}: {fate(refused, 'part_time')}; use --time <= {part['max_time']}")
    for count, tres, unit in ((gpus, "gres/gpu", "GPUs"), (cores, "cpu", "cores")):
        key = "gpu" if unit == "GPUs" else "cpu"
        for scope, limits in (("job", q["max_tres"] if q else {}), ("user", q["max_tres_pu"] if q else {})):
            if count and tres in limits and count > limits[tres]:
                findings.error("qos-limit", f"the job asks for {count} {unit} and QoS {qos} allows {limits[tres]} "
                               f"per {scope} in {here}: {fate(deny, f'{key}_{scope}')}; use fewer {unit}")
                return

DEFAULT_TIME_MINUTES = 10  # Jean Zay's GPU partitions, when the node type isn't known


def check_engine(job: Job, t: Training, findings: Findings) -> None:
    """The script's `module load pytorch-gpu/py3/X` (inside an allocation: the torch installed there) against what
    its trainer line asks for (TORCH_FEATURES)."""
    version = version_tuple(job.torch_version) if job.torch_version else torch_version_of(job.torch_module)
    if not version:
        return
    source = f"torch {job.torch_version} is installed here" if job.torch_version else f"the script loads {job.torch_module}"
    for line in torch_refusals(f"{version[0]}.{version[1]}", t):
        line = line.replace(f"this is torch {version[0]}.{version[1]}", source)
        if t.layout == "replica":
            findings.error("engine-unavailable", line)
        else:
            findings.error("torch-too-old", line)

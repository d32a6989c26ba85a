"""Slurm 22.05 as the checker reads a request: the Job, sbatch's and srun's option tables, and the option values
they check themselves before anything is submitted (a port to a newer Slurm touches this module and kit.placement).
Owns: SBATCH_LONG/SRUN_LONG and friends, COUNT_LIMITS. Imports: kit.bounded, kit.findings.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Iterable

from kit.bounded import number_shown, quoted, whole_number
from kit.findings import Findings


@dataclass
class Job:
    """A Slurm request (from #SBATCH lines, command-line flags, or an allocation's SLURM_* variables)."""
    nodes: int | None = None
    ntasks: int | None = None
    ntasks_per_node: int | None = None
    tasks_per_node: list[int] | None = None  # known per node only inside an allocation
    gpus_per_node: int | None = None
    gpus_per_task: int | None = None
    gpus_total: int | None = None
    gpu_bind: str | None = None
    cpus_per_task: int | None = None
    hint: str | None = None
    constraint: str | None = None
    partition: str | None = None
    time: str | None = None
    torch_module: str | None = None  # `module load pytorch-gpu/py3/<version>`
    gpu_mem: float | None = None  # --gpu-mem: GiB per GPU, given by the user
    gpu_mem_seen: float | None = None  # GiB per GPU as nvidia-smi shows it inside the allocation
    source: str = "command line"
    gres_gpus: int | None = None  # --gres=gpu:N (GPUs per node), kept apart from --gpus-per-node to compare them
    account: str | None = None
    qos: str | None = None
    distribution: str | None = None
    ignore_pbs: bool = False
    modules: list[str] = field(default_factory=list)  # every `module load` argument, in order
    srun: bool | None = None  # the trainer's line starts with srun (None: no trainer line)
    launcher: str | None = None  # what comes before the trainer's script on its line
    trainer: str | None = "bench_ddp_transformer.py"  # the kit's script on it; None: the script runs no kit trainer
    workers: int | None = None  # torchrun --nproc_per_node on the trainer's line: workers per srun task (agent)
    step_nodes: int | None = None  # srun's own -N / -n / --ntasks-per-node on the trainer's line
    step_ntasks: int | None = None
    step_ntasks_per_node: int | None = None
    step_cpus_per_task: int | None = None  # srun -c: 22.05's srun does not inherit the job's --cpus-per-task
    placement: str = "exact"  # "possible": Slurm decides by free cores; the plan shows one placement it may make
    options: dict[str, str | None] = field(default_factory=dict)  # every option the directives give, last value
    option_lines: dict[str, str] = field(default_factory=dict)  # where each was given (file:line)
    trainer_line: object = None  # the kit trainer's launch line (kit.jobscript.LaunchLine, which imports this), or None
    srun_cpus: bool = False  # its srun gets -c (or SRUN_CPUS_PER_TASK)
    launches: list = field(default_factory=list)  # the script's other launch lines (LaunchLine), their layout
    sourced: list[str] = field(default_factory=list)  # files the script sources (not read)
    torch_version: str | None = None  # inside an allocation: the torch installed there
    unplanned: str | None = None  # why nothing is planned (a count no node has): the findings say it all
    # whose rules judge the account, QoS and time: "jean-zay" (the dated table), "live" (Slurm's configuration here,
    # in `site`: a site_slurm.SiteFacts), "none" (Slurm's own behaviour only)
    site_rules: str = "jean-zay"
    site: object = None
    # per-GPU sizing (sbatch --cpus-per-gpu, --mem-per-gpu) and the memory options, in MB (str_to_mbytes)
    cpus_per_gpu: int | None = None
    mem_per_gpu: int | None = None
    mem: int | None = None
    mem_per_cpu: int | None = None
    cores_per_node: list[int] | None = None  # the cores the allocation holds on each node (kit.placement)
    # the whole script: its heterogeneous components (this job is component 0), every kit trainer line (Step), the
    # array's elements read one by one, what the batch shell does about signals, requeue and the steps' environment
    components: list = field(default_factory=list)
    component: int = 0  # which component this Job is (srun --het-group)
    het_groups: list[int] | None = None  # srun --het-group on the step's line: the components it runs on
    steps: list = field(default_factory=list)
    elements: list = field(default_factory=list)
    traps: dict[str, str] = field(default_factory=dict)  # signal name -> where the batch shell traps it
    requeues: list[str] = field(default_factory=list)  # where the script runs `scontrol requeue`

# The option tables of Slurm 22.05 (Debian bookworm's slurm-wlm): every option `man sbatch` / `man srun` list, with
# r = takes a value, o = an optional value (only as --name=value), n = a flag; plus the undocumented aliases the real
# commands accepted on the test cluster (sbatch/srun --tasks-per-node, srun --pack-group and --cpu_bind).
# tests/test_check_topology.py compares these tables with the installed man pages. Later releases add options
# (e.g. 23.02's --tres-per-task): a newer one used here is reported as unknown to 22.05.
def _table(spec: str) -> dict[str, str]:
    return dict(item.split(":") for item in spec.split())

SBATCH_LONG = _table(
    "account:r acctg-freq:r array:r batch:r bb:r bbf:r begin:r chdir:r cluster-constraint:r clusters:r comment:r "
    "constraint:r container:r contiguous:n core-spec:r cores-per-socket:r cpu-freq:r cpus-per-gpu:r "
    "cpus-per-task:r deadline:r delay-boot:r dependency:r distribution:r error:r exclude:r exclusive:o export:r "
    "export-file:r extra-node-info:r get-user-env:o gid:r gpu-bind:r gpu-freq:r gpus:r gpus-per-node:r "
    "gpus-per-socket:r gpus-per-task:r gres:r gres-flags:r help:n hint:r hold:n ignore-pbs:n input:r job-name:r "
    "kill-on-invalid-dep:r licenses:r mail-type:r mail-user:r mcs-label:r mem:r mem-bind:r mem-per-cpu:r "
    "mem-per-gpu:r mincpus:r network:r nice:o no-kill:o no-requeue:n nodefile:r nodelist:r nodes:r ntasks:r "
    "ntasks-per-core:r ntasks-per-gpu:r ntasks-per-node:r ntasks-per-socket:r open-mode:r output:r overcommit:n "
    "oversubscribe:n parsable:n partition:r power:r prefer:r priority:r profile:r propagate:o qos:r quiet:n "
    "reboot:n requeue:n reservation:r signal:r sockets-per-node:r spread-job:n switches:r tasks-per-node:r "
    "test-only:n thread-spec:r threads-per-core:r time:r time-min:r tmp:r uid:r usage:n use-min-nodes:n verbose:n "
    "version:n wait:n wait-all-nodes:r wckey:r wrap:r")

SRUN_LONG = _table(
    "accel-bind:r account:r acctg-freq:r bb:r bbf:r bcast:o bcast-exclude:r begin:r chdir:r cluster-constraint:r "
    "clusters:r comment:r compress:o constraint:r container:r contiguous:n core-spec:r cores-per-socket:r "
    "cpu-bind:r cpu-freq:r cpu_bind:r cpus-per-gpu:r cpus-per-task:r deadline:r delay-boot:r dependency:r "
    "disable-status:n distribution:r epilog:r error:r exact:n exclude:r exclusive:o export:r extra-node-info:r "
    "gid:r gpu-bind:r gpu-freq:r gpus:r gpus-per-node:r gpus-per-socket:r gpus-per-task:r gres:r gres-flags:r "
    "help:n het-group:r hint:r hold:n immediate:o input:r job-name:r jobid:r kill-on-bad-exit:o label:n "
    "licenses:r mail-type:r mail-user:r mcs-label:r mem:r mem-bind:r mem-per-cpu:r mem-per-gpu:r mincpus:r mpi:r "
    "msg-timeout:r multi-prog:n network:r nice:o no-allocate:n no-kill:o nodefile:r nodelist:r nodes:r ntasks:r "
    "ntasks-per-core:r ntasks-per-gpu:r ntasks-per-node:r ntasks-per-socket:r open-mode:r output:r overcommit:n "
    "overlap:n oversubscribe:n pack-group:r partition:r power:r prefer:r preserve-env:n priority:r profile:r "
    "prolog:r propagate:o pty:o qos:r quiet:n quit-on-interrupt:n reboot:n relative:r reservation:r resv-ports:o "
    "send-libs:o signal:r slurmd-debug:r sockets-per-node:r spread-job:n switches:r task-epilog:r task-prolog:r "
    "tasks-per-node:r test-only:n thread-spec:r threads:r threads-per-core:r time:r time-min:r tmp:r uid:r "
    "unbuffered:n usage:n use-min-nodes:n verbose:n version:n wait:r wckey:r x11:o")

SBATCH_SHORT = dict(x.split("=") for x in (
    "A=account B=extra-node-info C=constraint D=chdir F=nodefile G=gpus H=hold J=job-name L=licenses M=clusters "
    "N=nodes O=overcommit Q=quiet S=core-spec V=version W=wait a=array b=begin c=cpus-per-task d=dependency "
    "e=error h=help i=input k=no-kill m=distribution n=ntasks o=output p=partition q=qos s=oversubscribe t=time "
    "v=verbose w=nodelist x=exclude").split())

SRUN_SHORT = {k: v for k, v in SBATCH_SHORT.items() if k != "a"} | dict(  # srun has no -a, and more letters
    E="preserve-env", I="immediate", K="kill-on-bad-exit", T="threads", X="disable-status", Z="no-allocate",
    l="label", r="relative", u="unbuffered")

ALIASES = {"tasks-per-node": "ntasks-per-node", "cpu_bind": "cpu-bind", "pack-group": "het-group"}


def long_option(name: str, table: dict[str, str], prog: str, where: str, findings: Findings) -> str | None:
    """Resolve --name as getopt_long does: an exact name, else an unambiguous prefix (sbatch accepted
    --ntasks-per-nod=2 on the test cluster), else the error the command prints."""
    if name in table:
        return name
    matches = [n for n in table if n.startswith(name)] if name else []
    if len(matches) == 1:
        findings.warn("option-prefix", f"{where}: {prog} reads --{name} as --{matches[0]} (an abbreviation "
                      f"getopt accepts); write --{matches[0]} in full")
        return matches[0]
    if matches:
        findings.error("ambiguous-option", f"{where}: {prog} refuses --{name}: it is ambiguous ("
                       + ", ".join(f"--{m}" for m in sorted(matches)[:6]) + "); write the full name")
        return None
    near = difflib.get_close_matches(name, list(table), n=1, cutoff=0.6)
    findings.error("unknown-option", f"{where}: {prog} refuses --{name} (unrecognized option: {prog} exits 255"
                   + (f"); did you mean --{near[0]}?" if near else f"); see `man {prog}`"))
    return None


def parse_options(tokens: list[str], where: str, findings: Findings, prog: str = "sbatch"
                  ) -> tuple[list[tuple[str, str | None]], list[str]]:
    """Split option tokens as getopt_long does for sbatch (a #SBATCH line) or srun (its options stop at the first
    word that is not an option: the command). Returns (name, value) pairs with short and alias names mapped to
    long ones, and the rest of the tokens (srun's command)."""
    table, short = (SBATCH_LONG, SBATCH_SHORT) if prog == "sbatch" else (SRUN_LONG, SRUN_SHORT)
    out, i = [], 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if tok == "--":
            return out, tokens[i:]
        if tok.startswith("--"):
            raw, eq, value = tok[2:].partition("=")
            name = long_option(raw, table, prog, where, findings)
            if name is None:
                continue
            kind = table[name]
            if kind == "n" and eq:
                findings.error("bad-value", f"{where}: {prog} refuses --{name}={value}: --{name} takes no value")
                value = None
            elif kind == "r" and not eq:
                if i >= len(tokens):
                    findings.error("bad-value", f"{where}: --{name} needs a value, e.g. --{name}=<value>")
                    continue
                value, i = tokens[i], i + 1
            elif not eq:
                value = None
            out.append((ALIASES.get(name, name), value))
        elif tok.startswith("-") and len(tok) >= 2:
            j = 1
            while j < len(tok):
                letter = tok[j]
                if letter not in short:
                    findings.error("unknown-option", f"{where}: {prog} refuses -{letter} (invalid option; "
                                   f"{prog} exits 255); see `man {prog}`")
                    break
                name = short[letter]
                if table[name] == "n":
                    out.append((name, None))
                    j += 1
                    continue
                value = tok[j + 1:]
                if not value and table[name] == "r":
                    if i >= len(tokens):
                        findings.error("bad-value", f"{where}: -{letter} needs a value")
                        break
                    value, i = tokens[i], i + 1
                out.append((name, value or None))
                break
        elif prog == "srun":
            return out, tokens[i - 1:]
        else:  # measured: sbatch exits 1 with "Invalid directive found in batch script: stray"
            findings.error("stray-token", f"{where}: {tok!r} is not an option; sbatch refuses the script ('Invalid "
                           f"directive found in batch script: {tok}'); quote values with spaces")
    return out, []


# What the checker plans at most, so that no request can make it loop or fill the login node's memory: more than
# any Jean Zay partition (all of Jean Zay has fewer than 4096 nodes; its nodes have at most 8 GPUs and 96 cores, 192
# hardware threads). A count above its bound is refused (the test cluster's slurmctld refused them all: 'Requested
# node configuration is not available', 'Invalid Trackable RESource (TRES) specification').
COUNT_LIMITS = {"nodes": 4096, "ntasks": 4096 * 8, "ntasks-per-node": 192, "cpus-per-task": 192,
                "gpus-per-node": 16, "gpus-per-task": 16, "gpus": 4096 * 16, "gres": 16, "cpus-per-gpu": 192}


def too_many_tasks(per_node: list[int], findings: Findings) -> bool:
    """A placement with more tasks on a node, or in all, than COUNT_LIMITS allows: one error, nothing planned."""
    busiest, total = max(per_node, default=0), sum(per_node)
    if busiest <= COUNT_LIMITS["ntasks-per-node"] and total <= COUNT_LIMITS["ntasks"]:
        return False
    findings.error("count-too-large", f"{total} task(s), up to {busiest} on a node: more than any Jean Zay node "
                   f"runs ({COUNT_LIMITS['ntasks-per-node']} hardware threads at most) or the checker plans "
                   f"({COUNT_LIMITS['ntasks']} tasks); ask for --nodes and --ntasks-per-node the nodes hold")
    return True


def _int_option(name: str, value: str | None, where: str, findings: Findings, lo: int = 1) -> int | None:
    raw = (value or "").strip()
    if "$" in raw:
        return None  # reported once as a variable
    # ASCII digits only, read by kit.bounded.whole_number: sbatch refuses '--nodes=٣' ("is not a valid node count",
    # measured), and a number of thousands of digits is one finding, never Python's int-conversion limit
    m = re.fullmatch(r"(?:[A-Za-z0-9_-]+:)?([0-9]+)" if name.startswith("gpus") else r"([0-9]+)", raw)
    if name == "nodes" and re.fullmatch(r"[0-9]+-[0-9]+", raw):
        low = raw.split('-')[0]
        findings.warn("node-range", f"{where}: --nodes={number_shown(raw, 40)} is a range; the plan assumes the "
                      f"minimum {number_shown(low)}: fix it (e.g. --nodes={number_shown(low)}) so the layout is known")
        m = re.match(r"([0-9]+)", raw)
    if not m or whole_number(m.group(1)) < lo:
        hint = f" (write --{name}={raw[1:]}: a short option takes no '=')" if raw.startswith("=") else ""
        findings.error("bad-value", f"{where}: --{name}={number_shown(raw, 60)!r} is not a count >= {lo}; sbatch "
                       f"refuses it{hint}")
        return None
    return bounded(name, whole_number(m.group(1)), where, findings, m.group(1))


def bounded(name: str, count: int, where: str, findings: Findings, raw: str | None = None) -> int | None:
    """A count within COUNT_LIMITS, else one error (and None: nothing is planned from it). `raw`: the count as
    written (a number of thousands of digits is quoted by its start and its length)."""
    limit = COUNT_LIMITS.get(name)
    if limit is None or count <= limit:
        return count
    shown = number_shown(raw.lstrip("0") or "0" if raw else str(count))
    shown = f"gpu:{shown}" if name == "gres" else shown
    findings.error("count-too-large", f"{where}: --{name}={shown} is more than any Jean Zay node or partition has "
                   f"(the checker plans up to {limit}); {COUNT_FATE.get(name, COUNT_FATE['gres'])}: ask for what the "
                   "nodes have")
    return None


# What slurmctld 22.05 does with a count no node or partition holds (measured on the test cluster): tasks and nodes
# are accepted and pend for good; GPUs and cores per GPU are refused at submission.
COUNT_FATE = dict.fromkeys(("nodes", "ntasks", "ntasks-per-node", "cpus-per-task"),
                           "sbatch accepts it and the job pends forever (squeue's reason: PartitionConfig, measured)")
COUNT_FATE.update(dict.fromkeys(("gres", "gpus-per-node", "gpus", "cpus-per-gpu"), "sbatch refuses it ('Requested "
                                "node configuration is not available', measured)"))
COUNT_FATE["gpus-per-task"] = "sbatch refuses it"


def gres_gpus(value: str, where: str, findings: Findings) -> int | None:
    """GPUs per node in --gres: 'gpu:4', 'gpu:v100:4', 'gpu:4(S:0-1)', 'gpu' (one)."""
    for item in re.split(r",(?![^(]*\))", value):  # commas inside '(S:0-1)' don't separate items
        m = re.fullmatch(r"gpu(?::([A-Za-z][\w.-]*))?(?::(\w+))?(\(.*\))?", item.strip())
        if not m:
            if item.strip().startswith("gpu"):
                findings.error("bad-value", f"{where}: --gres={value!r} is not gpu[:type]:count")
                return None
            continue
        count = m.group(2) or "1"
        if not whole_number(count):  # ASCII digits: 'gpu:²' is no count (str.isdigit says it is; int() refuses it)
            findings.error("bad-value", f"{where}: --gres={number_shown(value, 60)!r}: GPU count "
                           f"{number_shown(count)!r} is not a number >= 1")
            return None
        return bounded("gres", whole_number(count), where, findings, count)
    return None

INT_FIELDS = {"nodes": "nodes", "ntasks": "ntasks", "ntasks-per-node": "ntasks_per_node",
              "cpus-per-task": "cpus_per_task", "gpus-per-node": "gpus_per_node", "gpus-per-task": "gpus_per_task",
              "gpus": "gpus_total", "cpus-per-gpu": "cpus_per_gpu"}

MEM_FIELDS = {"mem": "mem", "mem-per-gpu": "mem_per_gpu", "mem-per-cpu": "mem_per_cpu"}


def mbytes(value: str) -> int | None:
    """A size as sbatch 22.05 reads it (src/common/proc_args.c str_to_mbytes): a number of MB, or with K (rounded
    up), M, G or T; None where sbatch refuses it (option_value_problem says so)."""
    m = re.fullmatch(r"(\d+)([KMGTkmgt]?)[Bb]?", value.strip())
    if not m or len(m.group(1)) > 15:
        return None
    n, unit = int(m.group(1)), m.group(2).upper()
    return -(-n // 1024) if unit == "K" else n * {"": 1, "M": 1, "G": 1024, "T": 1024 ** 2}[unit]

TEXT_FIELDS = {"hint": "hint", "constraint": "constraint", "partition": "partition", "time": "time",
               "account": "account", "qos": "qos", "distribution": "distribution"}


def apply_option(job: Job, name: str, value: str | None, where: str, findings: Findings) -> None:
    if value is not None and "$" in value:
        findings.error("variable-in-directive",
                       f"{where}: --{name}={value} uses a shell variable, but sbatch does not expand variables in "
                       f"#SBATCH lines (it sees the text {value!r}); "
                       + ("use Slurm's patterns (%j job id, %x job name, %u user) or an absolute path"
                          if name in ("output", "error", "job-name", "chdir") else
                          f"write the value, or pass it on the sbatch command line: sbatch --{name}=\"${{VAR}}\" "
                          "job.slurm"))
        return
    if name in INT_FIELDS:
        setattr(job, INT_FIELDS[name], _int_option(name, value, where, findings))
    elif name in MEM_FIELDS:
        setattr(job, MEM_FIELDS[name], mbytes(value or ""))
    elif name == "gres":
        n = gres_gpus(value or "", where, findings)
        if n is not None:
            job.gres_gpus = n
    elif name == "gpu-bind":
        job.gpu_bind = value
        check_gpu_bind(value or "", where, findings)
    elif name in TEXT_FIELDS:
        setattr(job, TEXT_FIELDS[name], value)
    elif name == "ignore-pbs":
        job.ignore_pbs = True

STEP_FIELDS = {"nodes": "step_nodes", "ntasks": "step_ntasks", "ntasks-per-node": "step_ntasks_per_node",
               "cpus-per-task": "step_cpus_per_task"}


def apply_srun_option(job: Job, name: str, value: str | None, where: str, findings: Findings) -> None:
    """An srun option on the trainer's line: the step's own shape (it inherits the rest from the job)."""
    if name in STEP_FIELDS:
        setattr(job, STEP_FIELDS[name], _int_option(name, value, where, findings))
    elif name == "het-group":
        job.het_groups = het_groups(value or "")
    elif name in ("gpus-per-task", "gpu-bind", "distribution"):
        apply_option(job, name, value, where, findings)
    elif name in ("gres", "gpus-per-node", "gpus"):
        findings.warn("srun-gpu-option", f"{where}: srun --{name}={value} changes the step's GPUs, which the plan "
                      "does not model (on 22.05 a step asking more GPUs than the job fails); request GPUs in #SBATCH")


def check_gpu_bind(value: str, where: str, findings: Findings) -> None:
    """What the plan does not model of a --gpu-bind sbatch accepts (its refusals are option_value_problem's)."""
    v = re.sub(r"^verbose,", "", value.lower())
    if v.startswith("mask_gpu:"):
        findings.warn("gpu-bind-mask", f"{where}: --gpu-bind=mask_gpu is not modelled: the plan assumes each "
                      "task sees all the node's GPUs")
    elif v.startswith("c"):
        findings.warn("gpu-bind-closest", f"{where}: --gpu-bind=closest shows each task the GPUs of its NUMA "
                      "domain, which depends on the node; the plan assumes all GPUs are visible")


# -- the option values sbatch and srun 22.05 check themselves, before anything is submitted (each refusal below was
# measured with sbatch --test-only on the test cluster: tests/test_sbatch_rules.py) --

HINTS = ("compute_bound", "memory_bound", "multithread", "nomultithread", "help")

CPU_BINDS = ("q", "quiet", "v", "verbose", "one_thread", "no", "none", "rank", "rank_ldom", "socket", "sockets",
             "core", "cores", "thread", "threads", "ldom", "ldoms", "help")

MAIL_TYPES = ("NONE", "ARRAY_TASKS", "BEGIN", "END", "FAIL", "INVALID_DEPEND", "REQUEUE", "ALL", "STAGE_OUT",
              "TIME_LIMIT", "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50")

SIGNALS = ("HUP", "INT", "QUIT", "ABRT", "KILL", "ALRM", "TERM", "USR1", "USR2", "URG", "CONT", "STOP", "TSTP",
           "TTIN", "TTOU", "XCPU")


def value_tokens(value: str) -> list[str]:
    """verify_hint's and slurm_verify_cpu_bind's split: a comma not followed by a digit separates tokens."""
    return re.split(r",(?![0-9])", value)


def _near(word: str, choices: Iterable[str]) -> str:
    near = difflib.get_close_matches(word.lower(), [c.lower() for c in choices], n=1, cutoff=0.6)
    return f"; did you mean {near[0]}?" if near else f"; one of {', '.join(choices)}"


def gpu_bind_problem(v: str, prog: str) -> tuple[str | None, str | None]:
    """--gpu-bind as common/tres_bind.c _valid_gpu_bind reads it: closest and none match on their first letter."""
    q = quoted(v)  # as messages quote it
    b = v[8:] if v.lower().startswith("verbose,") else v
    low = b.lower()
    if low.startswith("map_gpu:") or low.startswith("mask_gpu:"):
        digits = "[0-9a-fA-Fx*]" if low.startswith("mask") else "[0-9*]"
        items = low.split(":", 1)[1].split(",")
        if not all(re.fullmatch(digits + "+", x) for x in items):
            return f"--gpu-bind={q}: {low.split(':')[0]} wants a comma-separated list of GPU numbers", None
        return None, None
    for word, prefix in (("closest", "c"), ("none", "n")):
        if low.startswith(prefix):
            return None, (None if low == word else f"{prog} reads --gpu-bind={q} as '{word}' (it compares the "
                          f"first letter only); write {word}")
    if low.startswith(("per_task:", "single:")):
        n = low.split(":", 1)[1]
        return None, (None if whole_number(n) is not None else f"{prog} reads --gpu-bind={q} as "
                      f"{low.split(':')[0]}:0 (not a "
                      "number); give a count")
    return f"--gpu-bind={q} is not a GPU binding (closest, map_gpu:, mask_gpu:, none, per_task:, single:)", None


def cpu_bind_problem(v: str) -> str | None:
    """--cpu-bind as common/slurm_resource_info.c slurm_verify_cpu_bind reads it."""
    q = quoted(v)  # as messages quote it
    for t in value_tokens(v):
        low = t.lower()
        if re.match(r"(map_?cpu|mask_?cpu|map_?ldom|mask_?ldom)", low):
            if not re.search(r"[:=].+", low):
                return f"--cpu-bind={q}: missing list for '{t}'"
        elif low not in CPU_BINDS:
            return f"--cpu-bind={q}: unrecognized --cpu-bind argument \"{t}\"{_near(t, CPU_BINDS)}"
    return None


def distribution_problem(v: str) -> str | None:
    """--distribution as proc_args.c verify_dist_type reads it: plane=N, or up to three levels and a pack flag."""
    if re.fullmatch(r"(?i)plane=[0-9]+", v) and whole_number(v.split("=")[1]) > 0:
        return None
    base, _, flag = v.partition(",")
    levels = base.split(":")
    ok = (0 < len(levels) <= 3 and levels[0].lower() in ("*", "block", "cyclic", "arbitrary", "hostfile")
          and all(x.lower() in ("*", "block", "cyclic", "fcyclic") for x in levels[1:])
          and (not flag or flag.lower() in ("pack", "nopack")))
    return None if ok else (f"--distribution={quoted(v)} is not a distribution (block, cyclic, plane=N, arbitrary, "
                            "with :block|cyclic|fcyclic levels and ,pack|nopack)")


def signal_problem(v: str) -> str | None:
    """--signal as proc_args.c get_signal_opts reads it: [R|B[R]:]SIGNAL[@SECONDS], SECONDS at most 65535."""
    m = re.fullmatch(r"(?i)(?:R?B?R?:)?(?:SIG)?(\w+?)(?:@([0-9]+))?", v)
    sig = m.group(1).upper() if m else ""
    number = whole_number(sig)  # ASCII digits, bounded: '@' and 5,000 digits is one finding
    ok = m and ((number is not None and 0 < number <= 0xffff) or sig in SIGNALS) \
        and whole_number(m.group(2) or "0") <= 0xffff
    return None if ok else (f"--signal={quoted(v)}: Invalid --signal specification ([B:]SIGNAL[@seconds], e.g. "
                            "USR1@300; seconds at most 65535)")


def option_value_problem(name: str, value: str | None, prog: str = "sbatch") -> tuple[str | None, str | None]:
    """(why sbatch or srun refuse this value, how they read it other than written); (None, None) when fine.
    Each rule is 22.05's own parser, named beside it."""
    v = value or ""
    q = quoted(v)  # as messages quote it
    if name == "hint":  # proc_args.c verify_hint
        bad = [t for t in value_tokens(v) if t.lower() not in HINTS]
        return (f"--hint={q}: unrecognized --hint argument \"{bad[0]}\"{_near(bad[0], HINTS)}",
                None) if bad else (None, None)
    if name in ("mem", "mem-per-cpu", "mem-per-gpu"):  # proc_args.c str_to_mbytes
        if not re.fullmatch(r"[0-9]+([KMGTkmgt][Bb]?)?", v):
            return f"--{name}={q} is not a size (a number of MB, or with K, M, G or T)", None
        return None, None
    if name == "gpu-bind":  # common/tres_bind.c _valid_gpu_bind
        return gpu_bind_problem(v, prog)
    if name == "cpu-bind":  # common/slurm_resource_info.c slurm_verify_cpu_bind
        return cpu_bind_problem(v), None
    if name == "distribution":  # proc_args.c verify_dist_type
        return distribution_problem(v), None
    if name == "exclusive":  # slurm_opt.c arg_set_exclusive
        ok = value is None or v.lower() in ("exclusive", "oversubscribe", "user", "mcs")
        return (None, None) if ok else (f"--exclusive={q}: Invalid --exclusive specification (user, mcs, or no "
                                        "value)", None)
    if name == "signal":  # proc_args.c get_signal_opts
        return signal_problem(v), None
    if name == "mail-type":  # proc_args.c parse_mail_type: unknown words are dropped, all unknown is an error
        words = [w for w in v.split(",") if w]
        bad = [w for w in words if w.upper() not in MAIL_TYPES]
        if len(bad) == len(words):
            return f"--mail-type={q}: Invalid --mail-type specification{_near(bad[0] if bad else '', MAIL_TYPES)}", None
        return None, (f"{prog} drops {', '.join(bad)} from --mail-type={q} (not a mail type)" if bad else None)
    if name == "open-mode":  # slurm_opt.c arg_set_open_mode: the first letter decides
        if v[:1].lower() not in ("a", "t"):
            return f"--open-mode={q}: Invalid --open-mode specification (append or truncate)", None
        word = "append" if v[:1].lower() == "a" else "truncate"
        return None, (None if v.lower() == word else f"{prog} reads --open-mode={q} as {word}; write {word}")
    if name == "gres-flags":  # slurm_opt.c arg_set_gres_flags
        ok = v.lower() in ("disable-binding", "enforce-binding")
        return (None, None) if ok else (f"--gres-flags={q}: Invalid --gres-flags specification (enforce-binding or "
                                        "disable-binding)", None)
    if name == "kill-on-invalid-dep":  # slurm_opt.c arg_set_kill_on_invalid_dep
        ok = v.lower() in ("yes", "no")
        return (None, None) if ok else (f"--kill-on-invalid-dep={q}: yes or no", None)
    if name in ("dependency", "array", "het-group"):
        return job_shape_problem(name, v), None
    if name in ("time", "time-min") and v and time_minutes(v) is None:  # parse_time.c time_str2mins
        return f"--{name}={q} is not a Slurm time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)", None
    return None, None


def check_option_values(job: Job, options: list[tuple[str, str | None]], where: str, findings: Findings,
                        prog: str = "sbatch", record: bool = True) -> None:
    """Each option's value as sbatch (or srun) checks it; `record`: keep them in job.options for the pairs."""
    for name, value in options:
        if record:
            job.options[name] = value
            job.option_lines[name] = where
        if (value is not None and "$" in value) or name == "time":  # a variable: said once; bad-time: its own
            continue
        refused, misread = option_value_problem(name, value, prog)
        if refused:
            said = "" if re.search(r"refuses|submission fails", refused) else f"; {prog} refuses it"
            findings.error("bad-value", f"{where}: {refused}{said}")
        elif misread:
            findings.warn("value-misread", f"{where}: {misread}")


def check_option_conflicts(job: Job, findings: Findings) -> None:
    """The pairs sbatch 22.05 refuses, or resolves by dropping one (src/common/slurm_opt.c
    validate_options_salloc_sbatch_srun, validate_hint_option; common/gres.c _job_state_validate)."""
    given = job.options

    def at(*names: str) -> str:  # the line of the last of them
        lines = [job.option_lines[n] for n in names if n in job.option_lines]
        return max(lines, key=lambda w: int(w.rpartition(":")[2]) if w.rpartition(":")[2].isdigit() else 0,
                   default="the directives")

    def shown(name: str) -> str:
        return f"--{name}" + (f"={given[name]}" if given.get(name) is not None else "")
    mem = [m for m in ("mem", "mem-per-cpu", "mem-per-gpu") if m in given]
    if len(mem) > 1:
        findings.error("option-conflict", f"{at(*mem)}: {' and '.join(map(shown, mem))}: sbatch refuses them "
                       "together ('--mem, --mem-per-cpu, and --mem-per-gpu are mutually exclusive'); keep one")
    if "cpus-per-gpu" in given and "cpus-per-task" in given:
        findings.error("option-conflict", f"{at('cpus-per-gpu', 'cpus-per-task')}: {shown('cpus-per-gpu')} with "
                       f"{shown('cpus-per-task')}: sbatch refuses the job ('--cpus-per-gpu is mutually exclusive "
                       "with --cpus-per-task'); keep --cpus-per-task (Jean Zay's examples use it)")
    if "ntasks-per-gpu" in given:
        other = [o for o in ("ntasks-per-node", "gpus-per-task", "gpus-per-socket") if o in given]
        if other:
            findings.error("option-conflict", f"{at('ntasks-per-gpu', *other)}: {shown('ntasks-per-gpu')} with "
                           f"{', '.join(map(shown, other))}: sbatch refuses it ('--{other[0]} is mutually exclusive "
                           "with --ntasks-per-gpu'); keep one")
    if "hint" in given:
        other = [o for o in ("ntasks-per-core", "threads-per-core", "extra-node-info") if o in given]
        if other:
            findings.warn("hint-ignored", f"{at('hint', *other)}: {shown('hint')} with {', '.join(map(shown, other))}"
                          ": Slurm drops the hint ('mutually exclusive with --hint ... Ignoring --hint'); keep --hint "
                          f"and remove --{other[0]}")
    if (given.get("distribution") or "").lower().startswith(("arbitrary", "hostfile")) and not (
            "nodelist" in given or "nodefile" in given):
        findings.error("bad-value", f"{at('distribution')}: {shown('distribution')} needs the nodes listed "
                       "(-w/--nodelist or a hostfile): sbatch refuses it ('With Arbitrary distribution you need to "
                       "specify a nodelist')")


def time_minutes(value: str) -> float | None:
    """A Slurm time (man sbatch: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
    days-hours:minutes:seconds) in minutes; None when it is none of those."""
    v = value.strip()
    if v.upper() in ("UNLIMITED", "INFINITE", "-1", "0"):  # time_str2mins: -1 and 0 mean no limit too
        return float("inf")
    m = re.fullmatch(r"(?:([0-9]+)-)?([0-9]+)(?::([0-9]{1,2}))?(?::([0-9]{1,2}))?", v)
    if not m:
        return None
    # ASCII digits, each read bounded (kit.bounded.whole_number): sbatch 22.05 accepts a --time of 5,000 digits
    # (measured, --test-only): it is longer than any limit, never an int-conversion or float overflow here
    d, a, b, c = (None if x is None else whole_number(x) for x in m.groups())
    if d is not None:
        minutes = int(d) * 1440 + int(a) * 60 + int(b or 0) + int(c or 0) / 60
    elif c is not None:
        minutes = int(a) * 60 + int(b) + int(c) / 60
    else:
        minutes = int(a) + int(b or 0) / 60
    return minutes or float("inf")  # arg_set_time_limit: a limit of 0 minutes is no limit


# -- job arrays, dependencies and heterogeneous groups, as Slurm 22.05 reads them --

# slurm.conf(5) MaxArraySize: 1001 by default, so the largest index is 1000 (measured: --array=1000 runs,
# --array=1-1001 is refused with 'Invalid job array specification'). A site may raise it: `scontrol show config`.
MAX_ARRAY_INDEX = 1000


def array_indices(spec: str) -> list[int] | None:
    """--array's indices in order (slurmctld/job_mgr.c _valid_array_inx and _parse_array_tok: comma-separated
    tokens N, N-M or N-M:step, each may be in [ ], a %limit after the last; strtol's reading of each number), or
    None where slurmctld refuses the specification."""
    found: set[int] = set()
    for tok in spec.split(","):
        if not tok:  # strtok_r skips empty tokens (measured: --array=1,,3 ran 1 and 3)
            continue
        m = re.fullmatch(r"\[?\s*\+?(\d{1,9})\]?(?:-\s*\+?(\d{1,9})\]?(?::\s*\+?(\d{1,9})\]?)?)?(%.*)?", tok)
        if not m:
            return None
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
        step = int(m.group(3)) if m.group(3) is not None else 1
        if last < first or last > MAX_ARRAY_INDEX or not 0 < step <= MAX_ARRAY_INDEX:
            return None
        found.update(range(first, last + 1, step))
    return sorted(found) if found else None


def job_shape_problem(name: str, v: str) -> str | None:
    """--dependency, --array (refused when sbatch submits: slurmctld's words) and srun's --het-group."""
    if name == "dependency":  # slurmctld/job_scheduler.c update_job_dependency
        return dependency_problem(v)
    if name == "array":  # slurmctld/job_mgr.c _valid_array_inx
        return None if array_indices(v) is not None else (
            f"--array={v}: sbatch's submission fails ('Invalid job array specification'): indices from 0 to "
            f"{MAX_ARRAY_INDEX}, as N, N-M, N-M:step, comma-separated, with an optional %limit")
    if het_groups(v) is None:  # srun/libsrun/opt.c: _parse_single_range
        return f"--het-group={v}: srun refuses it ('Invalid --het-group value: {v}'); give component numbers"
    return None


def index_ranges(indices: list[int]) -> str:
    """1,2,3,5,7,8 as '1-3,5,7-8' (how Slurm writes array indices)."""
    out, start = [], None
    for i, n in enumerate(indices):
        if start is None:
            start = n
        if i + 1 == len(indices) or indices[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ",".join(out)


DEPEND_TYPES = ("afternotok", "aftercorr", "afterany", "afterok", "afterburstbuffer", "after")


def dependency_problem(spec: str) -> str | None:
    """What slurmctld 22.05 refuses in --dependency (src/slurmctld/job_scheduler.c update_job_dependency and
    _parse_dependency_jobid_new: 'singleton', or TYPE:JOBID[_TASK][+MINUTES][:JOBID...], or old-style job ids,
    joined by ',' or '?'; the types match without case), in sbatch's words; None when it is read. Job ids that no
    longer exist are accepted (measured: afterok:77 ran at once)."""
    fail = (f"--dependency={spec}: sbatch's submission fails ('Job dependency problem'); write singleton, or "
            "after|afterany|afterok|afternotok|aftercorr:JOBID[:JOBID...] joined by ',' (all) or '?' (any)")
    rest = spec
    while True:
        low = rest.lower()
        if low.startswith("singleton"):
            rest = re.sub(r"^\([^)]*\)", "", rest[9:])
        elif ":" not in rest and rest[:1].isdigit():  # the old form: job ids joined by ','
            return None if re.fullmatch(r"(\d+(_(\d+|\*))?)(,\d+(_(\d+|\*))?)*", rest) and not re.search(
                r"(^|,)0+(_|,|$)", rest) else fail
        elif low.startswith("expand:"):  # permit_job_expansion is off by default (slurm.conf(5) SchedulerParameters)
            return (f"--dependency={spec}: sbatch's submission fails ('Requested operation not supported on this "
                    "system': expand needs SchedulerParameters=permit_job_expansion)")
        else:
            # each type is compared with its ':' but afterburstbuffer, whose 11 first letters are (a quirk of the
            # source: strncasecmp(tok, "afterburstbuffer:", 11)); the job ids start after the first ':'
            kind = next((t for t in DEPEND_TYPES if low.startswith(t[:11] if t == "afterburstbuffer" else t + ":")),
                        None)
            if kind is None or ":" not in rest:
                return fail
            rest = rest[rest.index(":") + 1:]
            m = re.match(r"(?:\d+(?:_(?:\d+|\*))?(?:\+\d+)?(?:\([^)]*\))?)(?::\d+(?:_(?:\d+|\*))?(?:\+\d+)?"
                         r"(?:\([^)]*\))?)*", rest)
            ids = m.group(0) if m else ""
            if not ids or re.search(r"(^|:)0+(_|\+|\(|:|$)", ids) or re.search(r"\+0+(\D|$)", ids):
                return fail
            rest = rest[len(ids):]
        if not rest:
            return None
        if rest[0] not in ",?" or len(rest) == 1:
            return fail
        rest = rest[1:]


def het_groups(value: str) -> list[int] | None:
    """srun --het-group: component numbers, comma-separated, with ranges N-M (srun/libsrun/opt.c reads it with
    _parse_single_range: 'Invalid --het-group value: 1-0'); None when srun refuses it."""
    found: list[int] = []
    for tok in value.split(","):
        m = re.fullmatch(r"(\d{1,4})(?:-(\d{1,4}))?", tok.strip())
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            return None
        found += range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1)
    return sorted(set(found)) or None


# Linux's signal numbers (signal(7), x86 and ARM), for --signal and bash's `trap` given by number; and the signals
# whose default action does not end a process (ignored, or stop/continue)
SIGNAL_NUMBERS = dict(enumerate(("HUP INT QUIT ILL TRAP ABRT BUS FPE KILL USR1 SEGV USR2 PIPE ALRM TERM STKFLT CHLD CONT "
                                 "STOP TSTP TTIN TTOU URG XCPU XFSZ VTALRM PROF WINCH IO PWR SYS").split(), 1))

SIGNALS_NOT_FATAL = ("CHLD", "CONT", "URG", "WINCH", "STOP", "TSTP", "TTIN", "TTOU")


def signal_name(word: str) -> str:
    """A signal as bash's trap or Slurm's --signal names it: USR1, SIGUSR1, usr1 or 10 are all USR1."""
    w = word.strip().upper()
    w = w[3:] if w.startswith("SIG") else w
    return SIGNAL_NUMBERS.get(int(w), w) if w.isdigit() else w


def signal_spec(value: str) -> tuple[bool, str, int] | None:
    """--signal=[R|B[R]:]SIG[@SECONDS] (proc_args.c get_signal_opts): (to the batch shell only, the signal, the
    seconds before the end: 60 by default), or None where sbatch refuses it (option_value_problem says so)."""
    m = re.fullmatch(r"(?i)(?:([RB]{1,2}):)?(\w+?)(?:@(\d+))?", value.strip())
    if not m or option_value_problem("signal", value)[0]:
        return None
    return "B" in (m.group(1) or "").upper(), signal_name(m.group(2)), int(m.group(3) or 60)


def implicit_ntasks(job: Job) -> int | None:
    """The task count sbatch 22.05 sets by itself (sbatch/opt.c _opt_verify, "1 proc / min_[socket * core * thread]
    default"): with -N N exact (or -B) and neither -n nor --ntasks-per-node, a --hint other than multithread, or
    --threads-per-core / --cores-per-socket / --sockets-per-node / -B, make SLURM_NTASKS = N x their product, which
    srun then inherits (measured: -N 1 --cpus-per-gpu=16 on 4 GPUs with --hint=nomultithread set SLURM_NTASKS=1 and
    `srun -c 32` ran 1 task; without the hint, 2). None where sbatch sets none."""
    o = job.options
    if job.ntasks is not None or job.ntasks_per_node or "ntasks" in o or "ntasks-per-node" in o:
        return None
    if not (("nodes" in o and re.fullmatch(r"\d+", o["nodes"] or "")) or "extra-node-info" in o):
        return None
    factors = {}
    b = re.fullmatch(r"(\d+|\*)(?::(\d+|\*))?(?::(\d+|\*))?", o.get("extra-node-info") or "")
    for name, value in zip(("sockets", "cores", "threads"), b.groups() if b else ()):
        if value and value != "*":
            factors[name] = int(value)
    for name, option in (("sockets", "sockets-per-node"), ("cores", "cores-per-socket"), ("threads", "threads-per-core")):
        if (o.get(option) or "").isdigit():
            factors[name] = int(o[option])
    hints = [h.lower() for h in value_tokens(o.get("hint") or "")] if "hint" in o and not (
        {"ntasks-per-core", "threads-per-core", "extra-node-info"} & set(o)) else []  # validate_hint_option
    for h in hints:  # proc_args.c verify_hint: the last word decides each count
        if h in ("compute_bound", "nomultithread"):
            factors["threads"] = 1
        elif h == "memory_bound":
            factors.update(cores=1, threads=1)
        elif h == "multithread":
            factors.pop("threads", None)
    if not factors:
        return None
    count = int(o["nodes"]) if (o.get("nodes") or "").isdigit() else 1
    for value in factors.values():
        count *= value
    return count

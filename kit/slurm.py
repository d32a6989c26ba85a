"""Slurm 22.05 as the checker reads a request: the Job, sbatch's and srun's option tables, and the option values
they check themselves before anything is submitted (a port to a newer Slurm touches this module and kit.placement).
Owns: SBATCH_LONG/SRUN_LONG and friends, COUNT_LIMITS. Imports: kit.findings.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Iterable

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
                "gpus-per-node": 16, "gpus-per-task": 16, "gpus": 4096 * 16, "gres": 16}


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
    m = re.fullmatch(r"(?:[A-Za-z0-9_-]+:)?(\d+)", raw) if name.startswith("gpus") else re.fullmatch(r"(\d+)", raw)
    if name == "nodes" and re.fullmatch(r"\d+-\d+", raw):
        findings.warn("node-range", f"{where}: --nodes={raw} is a range; the plan assumes the minimum "
                      f"{raw.split('-')[0]}: fix it (e.g. --nodes={raw.split('-')[0]}) so the layout is known")
        m = re.match(r"(\d+)", raw)
    if not m or int(m.group(1)) < lo:
        hint = f" (write --{name}={raw[1:]}: a short option takes no '=')" if raw.startswith("=") else ""
        findings.error("bad-value", f"{where}: --{name}={raw!r} is not a count >= {lo}; sbatch refuses it{hint}")
        return None
    return bounded(name, int(m.group(1)), where, findings)


def bounded(name: str, count: int, where: str, findings: Findings) -> int | None:
    """A count within COUNT_LIMITS, else one error (and None: nothing is planned from it)."""
    limit = COUNT_LIMITS.get(name)
    if limit is None or count <= limit:
        return count
    shown = str(count) if len(str(count)) <= 12 else f"{str(count)[:6]}...({len(str(count))} digits)"
    shown = f"gpu:{shown}" if name == "gres" else shown
    findings.error("count-too-large", f"{where}: --{name}={shown} is more than any Jean Zay node or partition has "
                   f"(the checker plans up to {limit}); Slurm refuses it ('Requested node configuration is not "
                   f"available'): ask for what the nodes have")
    return None


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
        if not count.isdigit() or int(count) < 1:
            findings.error("bad-value", f"{where}: --gres={value!r}: GPU count {count!r} is not a number >= 1")
            return None
        return bounded("gres", int(count), where, findings)
    return None

INT_FIELDS = {"nodes": "nodes", "ntasks": "ntasks", "ntasks-per-node": "ntasks_per_node",
              "cpus-per-task": "cpus_per_task", "gpus-per-node": "gpus_per_node", "gpus-per-task": "gpus_per_task",
              "gpus": "gpus_total"}

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
    b = v[8:] if v.lower().startswith("verbose,") else v
    low = b.lower()
    if low.startswith("map_gpu:") or low.startswith("mask_gpu:"):
        digits = "[0-9a-fA-Fx*]" if low.startswith("mask") else "[0-9*]"
        items = low.split(":", 1)[1].split(",")
        if not all(re.fullmatch(digits + "+", x) for x in items):
            return f"--gpu-bind={v}: {low.split(':')[0]} wants a comma-separated list of GPU numbers", None
        return None, None
    for word, prefix in (("closest", "c"), ("none", "n")):
        if low.startswith(prefix):
            return None, (None if low == word else f"{prog} reads --gpu-bind={v} as '{word}' (it compares the "
                          f"first letter only); write {word}")
    if low.startswith(("per_task:", "single:")):
        n = low.split(":", 1)[1]
        return None, (None if n.isdigit() else f"{prog} reads --gpu-bind={v} as {low.split(':')[0]}:0 (not a "
                      "number); give a count")
    return f"--gpu-bind={v} is not a GPU binding (closest, map_gpu:, mask_gpu:, none, per_task:, single:)", None


def cpu_bind_problem(v: str) -> str | None:
    """--cpu-bind as common/slurm_resource_info.c slurm_verify_cpu_bind reads it."""
    for t in value_tokens(v):
        low = t.lower()
        if re.match(r"(map_?cpu|mask_?cpu|map_?ldom|mask_?ldom)", low):
            if not re.search(r"[:=].+", low):
                return f"--cpu-bind={v}: missing list for '{t}'"
        elif low not in CPU_BINDS:
            return f"--cpu-bind={v}: unrecognized --cpu-bind argument \"{t}\"{_near(t, CPU_BINDS)}"
    return None


def option_value_problem(name: str, value: str | None, prog: str = "sbatch") -> tuple[str | None, str | None]:
    """(why sbatch or srun refuse this value, how they read it other than written); (None, None) when fine.
    Each rule is 22.05's own parser, named beside it."""
    v = value or ""
    if name == "hint":  # proc_args.c verify_hint
        bad = [t for t in value_tokens(v) if t.lower() not in HINTS]
        return (f"--hint={v}: unrecognized --hint argument \"{bad[0]}\"{_near(bad[0], HINTS)}",
                None) if bad else (None, None)
    if name in ("mem", "mem-per-cpu", "mem-per-gpu"):  # proc_args.c str_to_mbytes
        if not re.fullmatch(r"\d+([KMGTkmgt][Bb]?)?", v):
            return f"--{name}={v} is not a size (a number of MB, or with K, M, G or T)", None
        return None, None
    if name == "gpu-bind":  # common/tres_bind.c _valid_gpu_bind
        return gpu_bind_problem(v, prog)
    if name == "cpu-bind":  # common/slurm_resource_info.c slurm_verify_cpu_bind
        return cpu_bind_problem(v), None
    if name == "distribution":  # proc_args.c verify_dist_type
        if re.fullmatch(r"(?i)plane=\d+", v) and int(v.split("=")[1]) > 0:
            return None, None
        base, _, flag = v.partition(",")
        levels = base.split(":")
        ok = (0 < len(levels) <= 3 and levels[0].lower() in ("*", "block", "cyclic", "arbitrary", "hostfile")
              and all(x.lower() in ("*", "block", "cyclic", "fcyclic") for x in levels[1:])
              and (not flag or flag.lower() in ("pack", "nopack")))
        return (None, None) if ok else (f"--distribution={v} is not a distribution (block, cyclic, plane=N, "
                                        "arbitrary, with :block|cyclic|fcyclic levels and ,pack|nopack)", None)
    if name == "exclusive":  # slurm_opt.c arg_set_exclusive
        ok = value is None or v.lower() in ("exclusive", "oversubscribe", "user", "mcs")
        return (None, None) if ok else (f"--exclusive={v}: Invalid --exclusive specification (user, mcs, or no "
                                        "value)", None)
    if name == "signal":  # proc_args.c get_signal_opts: [R|B[R]:]SIGNAL[@SECONDS], SECONDS at most 65535
        m = re.fullmatch(r"(?i)(?:R?B?R?:)?(?:SIG)?(\w+?)(?:@(\d+))?", v)
        sig = m.group(1).upper() if m else ""
        ok = m and ((sig.isdigit() and 0 < int(sig) <= 0xffff) or sig in SIGNALS) and int(m.group(2) or 0) <= 0xffff
        return (None, None) if ok else (f"--signal={v}: Invalid --signal specification ([B:]SIGNAL[@seconds], "
                                        "e.g. USR1@300; seconds at most 65535)", None)
    if name == "mail-type":  # proc_args.c parse_mail_type: unknown words are dropped, all unknown is an error
        words = [w for w in v.split(",") if w]
        bad = [w for w in words if w.upper() not in MAIL_TYPES]
        if len(bad) == len(words):
            return f"--mail-type={v}: Invalid --mail-type specification{_near(bad[0] if bad else '', MAIL_TYPES)}", None
        return None, (f"{prog} drops {', '.join(bad)} from --mail-type={v} (not a mail type)" if bad else None)
    if name == "open-mode":  # slurm_opt.c arg_set_open_mode: the first letter decides
        if v[:1].lower() not in ("a", "t"):
            return f"--open-mode={v}: Invalid --open-mode specification (append or truncate)", None
        word = "append" if v[:1].lower() == "a" else "truncate"
        return None, (None if v.lower() == word else f"{prog} reads --open-mode={v} as {word}; write {word}")
    if name == "gres-flags":  # slurm_opt.c arg_set_gres_flags
        ok = v.lower() in ("disable-binding", "enforce-binding")
        return (None, None) if ok else (f"--gres-flags={v}: Invalid --gres-flags specification (enforce-binding or "
                                        "disable-binding)", None)
    if name == "kill-on-invalid-dep":  # slurm_opt.c arg_set_kill_on_invalid_dep
        ok = v.lower() in ("yes", "no")
        return (None, None) if ok else (f"--kill-on-invalid-dep={v}: yes or no", None)
    if name in ("time", "time-min") and v and time_minutes(v) is None:  # parse_time.c time_str2mins
        return f"--{name}={v} is not a Slurm time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)", None
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
            findings.error("bad-value", f"{where}: {refused}; {prog} refuses it")
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
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?", v)
    if not m:
        return None
    d, a, b, c = m.groups()
    if d is not None:
        minutes = int(d) * 1440 + int(a) * 60 + int(b or 0) + int(c or 0) / 60
    elif c is not None:
        minutes = int(a) * 60 + int(b) + int(c) / 60
    else:
        minutes = int(a) + int(b or 0) / 60
    return minutes or float("inf")  # arg_set_time_limit: a limit of 0 minutes is no limit

"""Reading a job script: the file, sbatch's directives, then bash's run of it (kit.shell), then its launch
lines (which program, through srun and which launcher) and the kit trainer's line.
Owns: read_sbatch, the launchers' option tables. Imports: kit.arguments, kit.findings, kit.releases, kit.shell,
kit.slurm.
"""
from __future__ import annotations

import argparse
import bisect
import os
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from kit.arguments import ARG, SCRIPTS, TRAINERS, Training, read_trainer_argv, set_values
from kit.findings import Finding, Findings, UsageError
from kit.releases import torch_version_of
from kit.shell import HereDoc, PER_TASK, Ran, ShellRun, StopScript, TooComplex, UNKNOWN
from kit.slurm import (COUNT_LIMITS, Job, apply_option, apply_srun_option, check_option_conflicts, check_option_values,
    parse_options)


# slurmctld refuses a batch script longer than max_script_size, 4 MiB unless SchedulerParameters says otherwise
# (22.05 src/slurmctld/job_mgr.c, _test_job_desc_fields); the checker reads no more than that.
MAX_SCRIPT_BYTES = 4 * 2 ** 20


def read_script_text(path: str | os.PathLike) -> tuple[str, bool]:
    """The script's text and whether it is longer than slurmctld accepts. Only a regular file or a pipe is read,
    at most MAX_SCRIPT_BYTES + 1 bytes of it: a device (/dev/zero) never ends, and a FIFO nobody writes to never
    opens for a plain open()."""
    import select
    import stat
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    kind = next((name for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                                         (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
                 if test(mode)), None)
    if kind:
        raise UsageError(f"cannot read {path}: it is {kind}, not a job script; give the script's file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    chunks, size, deadline = [], 0, time.monotonic() + 2.0  # a pipe's writer gets 2 s to say everything
    try:
        while size <= MAX_SCRIPT_BYTES:
            try:
                chunk = os.read(fd, min(1 << 16, MAX_SCRIPT_BYTES + 1 - size))
            except BlockingIOError:
                if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    raise UsageError(f"cannot read {path}: nothing more came through the pipe within 2 s; save the "
                                     "script to a file and check that") from None
                continue
            except OSError as exc:
                raise UsageError(f"cannot read {path}: {exc.strerror}") from None
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)[:MAX_SCRIPT_BYTES].decode("utf-8", errors="replace"), size > MAX_SCRIPT_BYTES


def read_directive(line: str, magic: str, where: str, job: Job, findings: Findings) -> None:
    """One '#SBATCH' (or '#SLURM') line: sbatch 22.05 reads what follows the magic word, with or without a space
    ('#SBATCH-N 2' and '#SBATCH<tab>-N 2' both gave 2 nodes on the test cluster), up to a '#' comment."""
    try:
        tokens = shlex.split(line[len(magic):], comments=True)
    except ValueError as exc:
        findings.error("bad-directive", f"{where}: cannot parse '{line.strip()}' ({exc})")
        return
    if tokens[:1] in (["hetjob"], ["packjob"]):
        findings.warn("hetjob", f"{where}: '{line.strip()}' starts a heterogeneous job's next component; the plan "
                      "covers the options of all components as one job: check each component on its own")
        return
    options, _ = parse_options(tokens, where, findings)
    for name, value in options:
        apply_option(job, name, value, where, findings)
    check_option_values(job, options, where, findings)


# the first line that is neither blank nor a comment (str.strip's and re's whitespace are the same set), and the lines
# of the header that sbatch may take as directives: found by regular expressions, not a Python loop over the lines, so
# that a 4 MiB script of comments is read in milliseconds
_FIRST_COMMAND = re.compile(r"^[^\S\n]*[^#\s]", re.M)

_HEADER_DIRECTIVE = re.compile(r"^#(?:SBATCH|SLURM|PBS|BSUB)[^\n]*", re.M)

_STRAY_DIRECTIVE = re.compile(r"^[^\S\n]*#[^\S\n]*(?:SBATCH|SLURM)[^\n]*", re.M | re.I)

MAX_DIRECTIVES = 1000  # directive lines read (shlex on each, a Python loop per character); a real header has tens

MAX_DIRECTIVE_TEXT = 64 * 1024  # and their characters, together

MAX_STRAY_SAID = 20  # stray directives reported one by one; past these, the first ones say enough


def read_directives(text: str, name: str, job: Job, findings: Findings) -> int:
    """The header as sbatch 22.05 reads it (src/sbatch/opt.c, _opt_batch_script): every line up to the first one that
    is neither blank nor a comment; in it, lines starting with '#SBATCH', or '#SLURM' (applied too, with sbatch's
    'Change from #SLURM to #SBATCH'), in column 0, case sensitive, are directives; '#PBS' and '#BSUB' lines are
    translated unless --ignore-pbs. Returns the line number of the first command (0: none). Raises TooComplex past
    MAX_DIRECTIVES directive lines (what was read stands)."""
    first = _FIRST_COMMAND.search(text)
    end = first.start() if first else len(text)
    foreign, slurm_lines, at, lineno, size = [], [], 0, 1, 0
    for count, m in enumerate(_HEADER_DIRECTIVE.finditer(text, 0, end)):
        lineno += text.count("\n", at, m.start())
        at, line, where = m.start(), m.group(0), f"{name}:{lineno}"
        size += len(line)
        if count == MAX_DIRECTIVES or size > MAX_DIRECTIVE_TEXT:
            raise TooComplex(lineno, f"more than {MAX_DIRECTIVES} directive lines or {MAX_DIRECTIVE_TEXT // 1024} "
                             "KiB of them")
        magic = next((x for x in ("#SBATCH", "#SLURM") if line.startswith(x)), None)
        if magic:
            read_directive(line, magic, where, job, findings)
            slurm_lines += [where] if magic == "#SLURM" else []
        else:
            foreign.append((where, line.strip()))
    if slurm_lines:
        findings.warn("slurm-directive", f"{slurm_lines[0]}: sbatch 22.05 applies '#SLURM' lines as directives "
                      f"({len(slurm_lines)} line(s); it prints 'Change from #SLURM to #SBATCH in your script', "
                      "measured); write them as '#SBATCH'")
    if foreign and not job.ignore_pbs:
        where, line = foreign[0]
        findings.error("pbs-directive", f"{where}: sbatch also reads '{line}' ({len(foreign)} #PBS/#BSUB line(s); "
                       "measured: '#PBS -l nodes=2' gave a 2-node job), which this plan does not model; write it as "
                       "#SBATCH, or add '#SBATCH --ignore-pbs'")
    return text.count("\n", 0, end) + 1 if first else 0


def stray_directives(text: str, name: str, first_command: int, heredocs: list["HereDoc"],
                     findings: Findings) -> None:
    """Directives sbatch does not read: after the first command, inside a here-document (text the script writes
    for another program: a generated job script), indented, lower case, '# SBATCH'. Only the lines that look like
    one are visited (a regular expression), and the first MAX_STRAY_SAID are reported."""
    starts = [h.first for h in heredocs]  # here-documents come in order and do not overlap
    said: set[int] = set()
    at, lineno, told = 0, 1, 0
    for m in _STRAY_DIRECTIVE.finditer(text):
        if told >= MAX_STRAY_SAID:
            return
        lineno += text.count("\n", at, m.start())
        at, line = m.start(), m.group(0)
        stripped, where = line.strip(), f"{name}:{lineno}"
        k = bisect.bisect_right(starts, lineno) - 1
        if k >= 0 and lineno <= heredocs[k].last:
            h = heredocs[k]
            if k not in said:
                said.add(k)
                told += 1
                findings.warn("ignored-directive", f"{where}: '{stripped}' is inside a here-document (lines "
                              f"{h.first}-{h.last}, up to '{h.delimiter}'): text this script writes, not a directive "
                              "of this job; check the script it generates on its own")
            continue
        if line.startswith(("#SBATCH", "#SLURM")):
            if first_command and lineno > first_command:
                told += 1
                findings.warn("ignored-directive", f"{where}: '{stripped}' comes after the first command (line "
                              f"{first_command}); sbatch ignores it: move it above the first command")
        elif re.match(r"#\s*SBATCH\s*-", stripped, re.I):  # a directive gone wrong, not a comment that says sbatch
            told += 1
            findings.warn("ignored-directive", f"{where}: '{stripped}' is not read by sbatch (a directive is "
                          "'#SBATCH', in capitals, from column 0): write it as '#SBATCH ...' at the start of the line")


# -- the launch lines: which program each command starts, through srun and which launcher --

@dataclass
class LaunchLine:
    """A command that starts a Python program: through srun or not, with which launcher, and the launcher's options.
    `words` is the whole command as bash runs it (srun ... torchrun ... script args), `script` the index in it of the
    program's script (or module)."""
    where: str
    words: list[str]
    script: int
    launcher: str  # "python" (a script run by python), "torchrun", "deepspeed", "accelerate", "program" (anything)
    srun: list[tuple[str, str | None]] | None  # srun's options; None: run by the batch shell, once
    options: dict[str, str | None] = field(default_factory=dict)  # the launcher's own, names with '-' for '_'
    env: dict[str, str | None] = field(default_factory=dict)  # exported SRUN_/SLURM_ variables srun reads
    module: bool = False  # python -m / torchrun -m: `script` names a module
    per_task: bool = False  # inside `srun bash -c '...'`: $SLURM_PROCID and the like are each task's own
    layout: dict = field(default_factory=dict)  # check_job's verdict: agents, processes per node, GPUs each

    @property
    def program(self) -> str:
        return os.path.basename(self.words[self.script]) if self.script < len(self.words) else ""

    @property
    def args(self) -> list[str]:
        return self.words[self.script + 1:]


# The launchers' options that take no value (each launcher's own argparse): torch/distributed/run.py (torch 2.13,
# same names since 1.10 with '-' or '_'), deepspeed/launcher/runner.py, accelerate/commands/launch.py. Any other
# option takes a value, as `--name value` or `--name=value`.
LAUNCHER_FLAGS = {
    "torchrun": {"standalone", "module", "m", "no-python", "run-path", "virtual-local-rank", "use-env"},
    "deepspeed": {"module", "no-python", "no-local-rank", "no-ssh", "no-ssh-check", "force-multi", "save-pid",
                  "elastic-training", "bind-cores-to-rank"},
    "accelerate": {"cpu", "multi-gpu", "tpu", "ipex", "enable-cpu-affinity", "dynamo-use-fullgraph",
                   "dynamo-use-dynamic", "use-deepspeed", "use-fsdp", "use-megatron-lm", "use-xpu", "same-network",
                   "module", "m", "no-python", "tpu-cluster", "no-tpu-cluster", "tpu-use-sudo", "downcast-bf16",
                   "quiet", "q", "debug"},
}

LAUNCHER_SHORT = {"deepspeed": {"H": "hostfile", "i": "include", "e": "exclude"},
                  "accelerate": {"t": "tee"}, "torchrun": {"r": "redirects", "t": "tee"}}

PYTHON_MODULES = {"torch.distributed.run": "torchrun", "torch.distributed.launch": "torchrun",
                  "deepspeed.launcher.runner": "deepspeed", "accelerate.commands.launch": "accelerate"}

WRAPPERS = {"exec", "command", "builtin", "nohup", "time", "nice", "stdbuf", "env", "timeout", "numactl", "taskset",
            "singularity", "apptainer", "unbuffer"}

KIT_TOOLS = ("check_topology.py", "idr_torch.py")  # the kit's own helpers: no training


def launcher_options(kind: str, words: list[str], start: int) -> tuple[dict[str, str | None], int, bool]:
    """A launcher's options from words[start:]: (options, index of the script, -m given)."""
    flags, short, options, i = LAUNCHER_FLAGS[kind], LAUNCHER_SHORT.get(kind, {}), {}, start
    while i < len(words):
        w = words[i]
        if w == "--":
            return options, i + 1, bool(options.keys() & {"module", "m"})
        if not w.startswith("-") or w == "-":
            break
        name, eq, value = w.lstrip("-").partition("=")
        name = short.get(name, name).replace("_", "-")
        i += 1
        if name in flags:
            options[name] = None
        elif eq:
            options[name] = value
        elif i < len(words) and not (words[i].startswith("--") or words[i].endswith(".py")):
            options[name], i = words[i], i + 1
        else:
            options[name] = None
    return options, i, bool(options.keys() & {"module", "m"})


def python_script(words: list[str], start: int) -> tuple[int, bool, bool]:
    """python's own options from words[start:]: (index of the script or module, -m given, -c given)."""
    i = start
    while i < len(words):
        w = words[i]
        if w == "--":
            return i + 1, False, False
        if not w.startswith("-") or w == "-" or w.startswith("--"):
            if w.startswith("--") and w != "--":
                i += 1 + (w == "--check-hash-based-pycs")
                continue
            return i, False, False
        i += 1
        for j, letter in enumerate(w[1:], 1):
            if letter in "mc":
                rest = w[j + 1:]
                if rest:  # python -mtorch.distributed.run
                    words.insert(i, rest)
                return i, letter == "m", letter == "c"
            if letter in "WX":
                i += 0 if w[j + 1:] else 1
                break
    return i, False, False


def skip_wrappers(words: list[str], i: int) -> int:
    """Past exec, time, env A=b, nohup, nice -n 5, numactl/taskset/timeout ..., singularity exec [opts] IMAGE."""
    while i < len(words):
        prog = os.path.basename(words[i])
        if prog not in WRAPPERS:
            return i
        i += 1
        if prog in ("singularity", "apptainer"):
            if i < len(words) and words[i] in ("exec", "run"):
                i += 1
            while i < len(words) and words[i].startswith("-"):
                has_value = "=" not in words[i] and words[i] not in (
                    "--nv", "--nvccli", "--rocm", "-e", "--cleanenv", "-c", "--contain", "-C", "--containall",
                    "-w", "--writable", "--no-home", "-f", "--fakeroot", "-u", "--userns")
                i += 1 + has_value
            i += 1  # the image
            continue
        while i < len(words) and (words[i].startswith("-") or (prog == "env" and "=" in words[i])):
            takes = {"nice": ("-n",), "env": ("-u", "--unset", "-C", "--chdir"), "timeout": ("-s", "-k"),
                     "taskset": (), "stdbuf": ("-i", "-o", "-e"), "command": (), "time": ("-o", "-f")}.get(prog, ())
            i += 2 if words[i] in takes else 1
        if prog in ("timeout", "taskset") and i < len(words):
            i += 1  # the duration, the CPU mask
    return i


def find_launches(ran: Ran, name: str, findings: Findings, srun: list | None = None, per_task: bool = False,
                  shell: "ShellRun | None" = None) -> list[LaunchLine]:
    """The Python programs one command starts (none for cp, echo, module ...), through srun, bash -c and the
    launchers torchrun, python -m torch.distributed.run, deepspeed and accelerate launch."""
    words, where = ran.fields, f"{name}:{ran.line}"
    i = skip_wrappers(words, 0)
    if i >= len(words):
        return []
    prog, env = os.path.basename(words[i]), ran.exported
    if prog == "srun" and srun is None:
        options, rest = parse_options(words[i + 1:], where, findings, prog="srun")
        prefix = words[:len(words) - len(rest)]
        inner = Ran(list(rest), ran.env, ran.line, ran.conditional, ran.exported)
        found = find_launches(inner, name, findings, options, per_task, shell)
        for launch in found:
            launch.words = prefix + launch.words
            launch.script += len(prefix)
        if found or not rest:
            return found
        return [LaunchLine(where, words, len(prefix), "program", options, env=env, per_task=per_task)]
    if prog in ("bash", "sh", "dash", "zsh") and "-c" in words[i + 1:] and shell is not None:
        text = words[words.index("-c", i) + 1] if words.index("-c", i) + 1 < len(words) else ""
        found: list[LaunchLine] = []
        inner = ShellRun({k: v for k, v in shell.vars.items() if k in shell.exported}, lambda r: found.extend(
            find_launches(r, name, findings, srun, srun is not None, None)), shell.exported, shell.budget)
        if srun is not None:
            inner.vars.update({k: UNKNOWN for k in PER_TASK})
        try:
            inner.run_text(text)
        except (StopScript, RecursionError):
            pass
        for launch in found:
            launch.where = where
        return found
    kind, start, module = None, i + 1, False
    if re.fullmatch(r"python[0-9.]*|pypy3?", prog):
        start, module, command = python_script(words, i + 1)
        if command or start >= len(words):
            return [LaunchLine(where, words, min(start, len(words) - 1), "program", srun, env=env)] if srun else []
        if module and words[start].split(".")[0] in ("pip", "venv", "ensurepip", "json", "http", "site"):
            return []  # python's own tools: an install, not a program of the job
        kind = PYTHON_MODULES.get(words[start]) if module else "python"
        if kind is None:
            kind = "python"
        elif kind != "python":
            start += 1
    elif prog == "torchrun" or prog == "deepspeed":
        kind = prog
    elif prog == "accelerate" and words[i + 1:i + 2] == ["launch"]:
        kind, start = "accelerate", i + 2
    elif prog.endswith(".py"):
        kind, start = "python", i
    if kind is None:
        return [LaunchLine(where, words, i, "program", srun, env=env, per_task=per_task)] if srun is not None else []
    options = {}
    if kind != "python":
        options, start, module = launcher_options(kind, words, start)
    if start >= len(words):
        return []
    return [LaunchLine(where, list(words), start, kind, srun, options, env, module, per_task)]


# What the checker judges from which arguments, in which layout: said when a shell variable hides some of them.
DEPENDS = (("the fit in memory", ("nlayers", "d_model", "n_head", "d_hid", "seq_len", "vocab_size",
                                 "dropout", "chunks", "batch_size", "precision", "activation_checkpointing", "zero",
                                 "nb_part", "devices", "pp", "schedule", "virtual_stages"), ("replica", "stage")),
           ("the pipeline bubble", ("chunks", "batch_size", "nb_part"), ("replica",)),
           ("--chunks dividing --batch-size", ("chunks", "batch_size"), ("replica", "stage")),
           ("the layers per part", ("nlayers", "nb_part", "pp", "schedule", "virtual_stages"), ("replica", "stage")),
           ("the pipelines against the tasks", ("pp", "schedule", "virtual_stages", "chunks"), ("stage",)),
           ("--d-model against --n-head", ("d_model", "n_head"), ("replica", "stage")))


def training_from_argv(argv: list[str], t: Training, where: str, findings: Findings) -> None:
    """The trainer's arguments on its line, read by the trainer's own parser (read_trainer_argv): its refusals
    become findings in its words; a shell variable leaves what it may set unknown (t.unknown), never judged."""
    line = read_trainer_argv(t.layout, argv, shell=True)
    findings.extend(Finding(f.level, f.code, f"{where}: {f.message}") for f in line.findings)
    if line.findings.errors:  # refused: nothing is judged (all unknown), but the plan shows the line's accepted values
        hidden = {ARG[u.split(" ")[0][2:].replace("-", "_")].dest for u in line.unchecked if u.startswith("--")}
        # less the placement (nb_part, devices): the plan's own checks would judge a refused line's values
        take_values(t, line.values, [] if line.standalone else
                    [d for d in line.given if d not in hidden and d not in ("nb_part", "devices")
                     and getattr(line.values, d) is not None])
        t.unknown = line.unknown
        return
    take_values(t, line.values, [d for d in line.given if d not in line.unknown])
    t.unknown, t.unchecked = line.unknown, t.unchecked + [f"{where}: {u}" for u in line.unchecked]
    script, source = SCRIPTS[t.layout], where.rpartition(":")[0] or "SCRIPT"
    for token in line.unchecked:
        alone = token in line.standalone
        names = line.unknown if alone else [ARG[token.split(" ")[0][2:].replace("-", "_")].dest]
        hidden = [what for what, needs, layouts in DEPENDS if t.layout in layouts and set(needs) & set(names)]
        say = (f"may hold any of {script}'s arguments: nothing that depends on them is checked" if alone else
               "is a shell variable: its value is not checked, nor what depends on it")
        fix = (f"give the values it holds on the checker's command line (python check_topology.py {source} "
               f"--nlayers N --chunks N --batch-size N ...): the arguments not given there are then taken at "
               f"{script}'s defaults" if alone else
               f"give its value on the checker's command line (python check_topology.py {source} "
               f"{token.split(' ')[0]} VALUE)")
        findings.warn("unchecked-argument", f"{where}: {token} {say}" + (f" ({', '.join(hidden)})" if hidden else "")
                      + f", and no default is judged in its place; {fix}")
    if line.help or line.values.check_args:
        findings.warn("no-training", f"{where}: {script} {'--help' if line.help else '--check-args'} prints "
                      f"{'its help' if line.help else 'its verdict on the arguments'} and exits: this line trains "
                      "nothing; remove it to train")


def take_values(t: Training, values: argparse.Namespace, names: list[str]) -> None:
    """The line's values of `names` into t (the others keep what t holds)."""
    set_values(t, {name: getattr(values, name) for name in names}, t.layout)


def read_trainer_line(launch: "LaunchLine", script: str, where: str, job: Job, training: Training,
                      findings: Findings) -> None:
    """The trainer's line as bash runs it (find_launches): srun's options (the step's shape), torchrun's workers,
    the layout its script runs, its arguments."""
    argv, cut = launch.words, launch.script
    training.layout = TRAINERS[script]
    job.srun = launch.srun is not None
    job.launcher = " ".join(argv[:cut]) or "(nothing)"
    job.trainer, job.trainer_line = script, launch
    if launch.srun is not None:
        apply_step(job, launch, findings)
        check_option_values(job, launch.srun, where, findings, prog="srun", record=False)
    if launch.launcher == "torchrun":
        job.workers = workers_of(launch)
        if job.workers is None:
            job.workers = 1  # planned as one worker per agent; what depends on the split is left unjudged
            nproc = launch.options.get("nproc-per-node")
            training.unchecked.append(f"{where}: torchrun --nproc_per_node {nproc}")
            findings.warn("unchecked-argument", f"{where}: torchrun --nproc_per_node {nproc} is a shell variable: the "
                          "workers per node, so each one's GPUs (nb_part), the bubble and the fit are not checked; "
                          "write the number, or check each value with --ntasks-per-node N on the checker's line")
    elif launch.launcher in ("deepspeed", "accelerate"):
        findings.warn("launcher-not-modelled", f"{where}: the kit's trainer under {launch.launcher}: its processes "
                      "are planned as srun's tasks; start it with srun or torchrun, as the templates do")
    training_from_argv(argv[cut + 1:], training, where, findings)
    if launch.launcher == "torchrun" and workers_of(launch) is None:  # the split depends on the workers per node
        training.unknown = list(dict.fromkeys([*training.unknown, "nb_part"]))


# -- the script as a whole: directives, then bash's run of it, then its launch lines --

def batch_variables(job: Job) -> dict:
    """The SLURM_ variables the batch script sees, as far as the request decides them (read off the test cluster's
    batch steps: tests/test_launch_slurm.py compares them): known ones as values, the others present but unknown."""
    known: dict[str, str] = {"SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    nodes = job.nodes if job.nodes and "nodes" in job.options and "-" not in str(job.options.get("nodes")) else None
    if nodes:
        known["SLURM_JOB_NUM_NODES"] = known["SLURM_NNODES"] = str(nodes)
    ntasks = job.ntasks or (nodes * job.ntasks_per_node if nodes and job.ntasks_per_node else None)
    if ntasks:
        known["SLURM_NTASKS"] = known["SLURM_NPROCS"] = str(ntasks)
    for name, value in (("SLURM_NTASKS_PER_NODE", job.ntasks_per_node), ("SLURM_CPUS_PER_TASK", job.cpus_per_task),
                        ("SLURM_GPUS_PER_NODE", job.options.get("gpus-per-node")),
                        ("SLURM_GPUS", job.options.get("gpus")), ("SLURM_HINT", job.hint),
                        ("SLURM_JOB_PARTITION", job.partition)):
        if value is not None and "$" not in str(value):
            known[name] = str(value)
    gpn = job.gres_gpus or job.gpus_per_node or (job.gpus_per_task * job.ntasks_per_node if job.gpus_per_task and
                                                 job.ntasks_per_node else None)
    if gpn is None and job.gpus_total and nodes and job.gpus_total % nodes == 0:
        gpn = job.gpus_total // nodes if nodes == 1 else None
    out = {k: ShellRun.known(v) for k, v in known.items()}
    if gpn:
        out["SLURM_GPUS_ON_NODE"] = ShellRun.known(str(gpn))
    for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURMD_NODENAME",
                 "SLURM_SUBMIT_DIR", "SLURM_JOB_NAME", "SLURM_JOB_CPUS_PER_NODE", "SLURM_TASKS_PER_NODE",
                 "SLURM_CLUSTER_NAME", "SLURM_JOB_ACCOUNT", "SLURM_JOB_QOS", "SLURM_JOB_GPUS", "SLURM_JOB_PARTITION",
                 "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_GPUS_ON_NODE", "SLURM_RESTART_COUNT"):
        out.setdefault(name, UNKNOWN)
    if "array" in job.options:
        for name in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN",
                     "SLURM_ARRAY_TASK_MAX", "SLURM_ARRAY_TASK_STEP"):
            out[name] = UNKNOWN
    return out


MODULE_COMMANDS = ("module", "ml")


def read_modules(ran: Ran, job: Job) -> None:
    """module load/add/purge/unload/swap and Lmod's ml, in every form: the modules loaded, in order."""
    words = ran.fields
    if os.path.basename(words[0]) not in MODULE_COMMANDS:
        return
    args = [w for w in words[1:] if not w.startswith("-")]
    verb = args[0] if args else ""
    if words[0] == "ml" and verb not in ("load", "add", "purge", "unload", "rm", "del", "swap", "switch", "list",
                                         "av", "avail", "spider", "show", "help", "save", "restore"):
        verb, args = "load", ["load"] + [w for w in words[1:] if not w.startswith("-")]
        job.modules = [m for m in job.modules if m not in [w[1:] for w in words[1:] if w.startswith("-")]]
    if verb == "purge":
        job.modules = []
    elif verb in ("load", "add", "try-load", "try-add"):
        job.modules += args[1:]
    elif verb in ("unload", "rm", "del", "remove"):
        job.modules = [m for m in job.modules if m not in args[1:] and m.split("/")[0] not in args[1:]]
    elif verb in ("swap", "switch") and len(args) >= 3:
        job.modules = [args[2] if m == args[1] or m.split("/")[0] == args[1] else m for m in job.modules]
    loaded = [m for m in job.modules if torch_version_of(m)]
    job.torch_module = loaded[-1] if loaded else None


def script_file_problems(path: str | os.PathLike, text: str, too_large: bool, job: Job,
                         findings: Findings) -> str | None:
    """What sbatch refuses in the file itself (size, NUL bytes, DOS line breaks, no '#!', empty): the text to read
    on, or None where nothing more can be read (job.unplanned says why)."""
    name = Path(path).name
    if too_large:
        findings.error("script-too-large", f"{name}: the script is larger than {MAX_SCRIPT_BYTES // 2 ** 20} MiB: "
                       "slurmctld refuses it ('Pathname of a file, directory or other parameter too long', measured "
                       "at 4.3 MB); keep data out of the script")
        job.unplanned = "the script is too large for Slurm"
        return None
    if "\0" in text:
        findings.error("not-a-script", f"{name}: the file holds NUL bytes (a binary file?): sbatch refuses it ('does "
                       "not allow scripts that contain a NULL character'); give the job script")
        job.unplanned = "not a job script"
        return None
    if "\r\n" in text:
        findings.error("dos-line-breaks", f"{name}: the file has DOS line breaks (\\r\\n): sbatch refuses it "
                       f"('Batch script contains DOS line breaks'); convert it: dos2unix {name}")
        text = text.replace("\r\n", "\n")
    lone = text.count("\r")
    if lone and lone >= text.count("\n"):  # old Mac line ends: every line but one ends in \r alone
        findings.error("cr-line-breaks", f"{name}: the lines end with \\r alone ({lone} of them, {text.count(chr(10))} "
                       "\\n): sbatch accepts the file (it refuses only \\r\\n, src/sbatch/sbatch.c "
                       "contains_dos_linebreak), but sbatch and bash read it as one line: no #SBATCH line applies and "
                       f"nothing runs; convert it: tr '\\r' '\\n' < {name} > fixed_{name}")
    if not text.startswith("#!"):
        findings.error("no-shebang", f"{name}:1: the first line is not '#!' and an interpreter: sbatch refuses the "
                       "file ('This does not look like a batch script'); make line 1 '#!/bin/bash'")
    if not text.strip():
        raise UsageError(f"{path} is empty: nothing to check (sbatch refuses it too: 'Batch script is empty!')")
    return text


def read_sbatch(path: str | os.PathLike) -> tuple[Job, Training, Findings]:
    """Read the job script the way sbatch 22.05 and bash do: the header's directives (read_directives), then every
    command bash would run (its variables expanded, here-documents set aside, functions called), for the modules it
    loads and the programs it launches. The first launch of a kit trainer is the trainer line; without one, the
    other launch lines are judged at the Slurm level only (job.trainer is None)."""
    text, too_large = read_script_text(path)
    job, training, findings = Job(source=str(path)), Training(), Findings()
    name = Path(path).name
    text = script_file_problems(path, text, too_large, job, findings)
    if text is None:
        return job, training, findings
    try:
        first_command = read_directives(text, name, job, findings)
    except TooComplex as cut:
        too_complex(name, cut, findings)
        check_option_conflicts(job, findings)
        read_launch_lines(job, [], findings)
        job.trainer, job.srun = None, None
        return job, training, findings
    if any(f.code == "count-too-large" for f in findings):
        job.unplanned = "a count no node has"
        return job, training, findings
    check_option_conflicts(job, findings)
    ran: list[Ran] = []
    shell = ShellRun(batch_variables(job), ran.append)
    launches: list[LaunchLine] = []

    def sink(r: Ran) -> None:
        read_modules(r, job)
        launches.extend(find_launches(r, name, findings, shell=shell))
    shell.sink = sink
    try:
        lexer = shell.run_script(text)
        heredocs = lexer.heredocs
        cuts = [c for c in (shell.cut, TooComplex(lexer.cut, f"more than {lexer.MAX_TOKENS} words to read")
                            if lexer.cut else None) if c]
        if cuts:
            too_complex(name, min(cuts, key=lambda c: c.line), findings)
        if lexer.unclosed:
            line, quote = lexer.unclosed
            findings.error("bad-command", f"{name}:{line}: the {quote} opened here is never closed: bash stops the "
                           f"job there ('unexpected EOF while looking for matching `{quote}'') and what follows is "
                           "read as one string; close the quote")
    except RecursionError:
        heredocs = []
        findings.warn("shell-unread", f"{name}: the script nests too deeply to follow; its launch lines may be "
                      "missed")
    stray_directives(text, name, first_command, heredocs, findings)
    kit = next((x for x in launches if x.program in TRAINERS and not x.module), None)
    if kit is None:
        job.trainer, job.srun, job.sourced = None, None, shell.sourced
        read_launch_lines(job, [x for x in launches if x.program not in KIT_TOOLS], findings)
        return job, training, findings
    read_trainer_line(kit, kit.program, kit.where, job, training, findings)
    read_launch_lines(job, [x for x in launches if x is not kit and x.srun is not None], findings)
    return job, training, findings


def too_complex(name: str, cut: TooComplex, findings: Findings) -> None:
    """The one finding of a script whose reading spent its budget (ShellBudget, MAX_TOKENS, MAX_DIRECTIVES)."""
    findings.warn("too-complex", f"{name}:{cut.line}: this script is too complex to follow past line {cut.line} "
                  f"({cut.what}); checked up to there: check what comes after by hand, or simplify it (generated "
                  "commands, deep function calls and huge values are what cost)")


def read_launch_lines(job: Job, launches: list[LaunchLine], findings: Findings) -> None:
    """The launch lines besides the trainer's: srun's option values checked now, their layout in check_job."""
    for launch in launches:
        if launch.srun:
            check_option_values(job, launch.srun, launch.where, findings, prog="srun", record=False)
    job.launches = launches


def apply_step(job: Job, launch: LaunchLine, findings: Findings) -> None:
    """srun's options on a launch line, and SRUN_CPUS_PER_TASK from its environment (srun 22.05 reads it as -c)."""
    for name, value in launch.srun or []:
        apply_srun_option(job, name, value, launch.where, findings)
    cpus = launch.env.get("SRUN_CPUS_PER_TASK")
    if job.step_cpus_per_task is None and cpus and cpus.isdigit():
        job.step_cpus_per_task = int(cpus)
    job.srun_cpus = job.step_cpus_per_task is not None or "SRUN_CPUS_PER_TASK" in launch.env or any(
        n == "cpus-per-task" for n, _ in launch.srun or [])


def workers_of(launch: LaunchLine) -> int | str | None:
    """torchrun's --nproc_per_node (default 1): a count, 'gpu' / 'auto' (one per GPU it sees), 'cpu', or None when
    written with a shell variable this reading doesn't know."""
    value = launch.options.get("nproc-per-node", "1") or "1"
    if "$" in value:
        return None
    if value.isdigit():
        return int(value) if int(value) <= COUNT_LIMITS["ntasks-per-node"] else None
    return value.lower() if value.lower() in ("gpu", "auto", "cpu") else None

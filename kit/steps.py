"""A job script as Slurm runs it, beyond one launch line: every kit trainer line planned and judged in order, each on
its heterogeneous component (srun --het-group; component 0 without it), each array element (or the elements that run
the same commands), each component's own request, and what the batch shell does about signals, requeue and the
steps' environment. Owns: check_script. Imports: kit.arguments, kit.checks, kit.findings, kit.jobscript,
kit.placement, kit.report, kit.site, kit.slurm.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from kit.arguments import Training
from kit.checks import SMALL_STEPS, check_job, check_whole, layout_of_launch
from kit.findings import Finding, Findings, guarded
from kit.jobscript import Step, step_group
from kit.placement import allocation_tasks, packing, step_gpus_per_node
from kit.report import Report
from kit.site import node_cap
from kit.slurm import SIGNALS_NOT_FATAL, Job, het_groups, index_ranges, parse_options, signal_spec

Tune = Callable[[Training], Training] | None  # the checker's command line over a line's arguments (--nlayers ...)


def check_script(job: Job, training: Training, tune: Tune = None) -> Report:
    """The whole script (kit.jobscript.read_sbatch's reading of it): one report whose plan is the first trainer
    line's, with the later lines' plans in report.steps and every finding naming its line where it is a line's."""
    if job.elements:
        return check_elements(job, tune)
    return check_steps(job, training, tune)


def checked(job: Job, training: Training, whole: bool = True) -> Report:
    """check_job, or, where it fails unexpectedly, a report holding that one internal-error finding."""
    findings = Findings()
    report = guarded(findings, job.trainer_line.where if job.trainer_line else job.source.rpartition("/")[2],
                     check_job, job, training, whole)
    return report if report is not None else Report(job, training, [], findings, ["nothing planned: see the "
                                                                                   "internal-error finding"])


# tasks planned in all, over a script's trainer lines and array elements: each plan holds up to
# COUNT_LIMITS["ntasks"] tasks, and a script could repeat such a line many times (each one costs its plan and its
# --json); past this many the later lines are said unplanned (too-complex)
MAX_PLANNED_TASKS = 32768


def check_steps(job: Job, training: Training, tune: Tune, planned: list[int] | None = None) -> Report:
    """Each kit trainer line on its own component, in order; the job's own checks once; each component; the
    batch shell. Each finding of a line is named by it. `planned`: the tasks planned so far (shared by elements)."""
    steps = job.steps if job.steps or not job.trainer else [Step(job.trainer_line, job, training)]
    planned = [0] if planned is None else planned
    if not steps:
        report = checked(job, tune(training) if tune else training)
    else:
        reports = []
        for n, step in enumerate(steps):
            if n and planned[0] > MAX_PLANNED_TASKS:
                reports[0].findings.warn("too-complex", f"{step.launch.where}: the script's trainer lines plan more "
                                         f"than {MAX_PLANNED_TASKS} tasks in all: this line and those after it are "
                                         "not planned; check them with fewer tasks")
                steps = steps[:n]
                break
            share_site(job, step.job)
            t = tune(step.training) if tune and step.training is not training else step.training
            reports.append(checked(step.job, t, whole=False))
            reports[-1].where = step.launch.where if step.launch else None
            planned[0] += len(reports[-1].tasks)
        report = merge_steps(steps, reports)
    where = job.source.rpartition("/")[2]
    guarded(report.findings, where, check_components, job, steps, report.findings)
    if steps:
        guarded(report.findings, where, check_other_lines, job, report)
    guarded(report.findings, where, check_batch_shell, job, steps, report.findings)
    return report


def share_site(job: Job, other: Job) -> None:
    """A step's job judged by the script's site rules and --gpu-mem (set on the first by check_topology)."""
    other.site_rules, other.site, other.gpu_mem, other.source = job.site_rules, job.site, job.gpu_mem, job.source


def merge_steps(steps: list[Step], reports: list[Report]) -> Report:
    """The first step's report holds the others' plans (report.steps) and their findings, each named by its line;
    a finding a later line repeats word for word is said once; then the job's own checks, on the first plan."""
    first = reports[0]
    head = steps[0].job
    per_node = first.placed if first.tasks else []
    seen = set()
    merged = Findings()
    for n, (step, report) in enumerate(zip(steps, reports)):
        maybe = n > 0 and step.launch is not None and step.launch.conditional
        for f in report.findings:
            if (f.level, f.code, f.message) in seen:
                continue
            seen.add((f.level, f.code, f.message))
            if maybe and f.level == "error":  # a later line the script may skip: said, not held against the job
                f = Finding("warning", f.code, f"(if it runs: the line is under a condition) {f.message}")
            merged.append(named(f, step.launch.where) if step.launch else f)
    first.findings[:] = merged
    first.steps = reports[1:]
    if per_node:
        check_whole(head, per_node, head.gpus_per_node, first.findings)
    if len(steps) > 1:
        first.notes.append(f"{len(steps)} trainer lines, each planned as Slurm runs it: lines "
                           + ", ".join(s.launch.where.rpartition(":")[2] for s in steps) + " (the table: the first; "
                           "--json lists every step)")
    return first


def check_other_lines(job: Job, report: Report) -> None:
    """The script's other srun lines (a data copy, a test program, a launcher) beside its trainer lines: each placed
    on its component and its launcher judged (kit.checks.layout_of_launch), its findings named by it; what the job's
    own checks said already (the same code) is not said again."""
    trainers = {id(s.launch) for s in job.steps}
    said = {f.code for f in report.findings}
    for launch in job.launches:
        if id(launch) in trainers or launch.srun is None or launch.program in SMALL_STEPS:
            continue
        group = step_group(launch)
        components = job.components or [job]
        base = components[group] if group < len(components) else job
        own = Findings()
        guarded(own, launch.where, layout_of_launch, base, launch, base.gpus_per_node, own)
        report.findings += [named(f, launch.where) for f in own if f.code not in said]


def named(f: Finding, where: str) -> Finding:
    """The finding with its line in front, unless it names one already."""
    name = where.rpartition(":")[0]
    return f if f.message.startswith(name + ":") else Finding(f.level, f.code, f"{where}: {f.message}")


# -- array elements: each group of elements that run the same commands, judged, then merged --

def check_elements(job: Job, tune: Tune) -> Report:
    """A job array whose script reads its index: each Element (kit.jobscript.read_elements) checked; a finding
    every element has is said once, the others name the elements they hold for."""
    spec = job.options.get("array")
    everyone = sorted(i for e in job.elements for i in e.indices)
    results, planned = [], [0]
    for element in job.elements:
        share_site(job, element.job)
        report = check_steps(element.job, element.training, tune, planned)
        report.findings[:0] = element.findings
        results.append((element.indices, report))
    main = results[0][1]
    main.findings[:] = merge_by_elements([(i, r.findings) for i, r in results], everyone, spec)
    notes = {}
    for indices, report in results:
        for note in report.notes:
            notes.setdefault(note, []).extend(indices)
    main.notes[:] = [n if sorted(i) == everyone else f"array element(s) {index_ranges(sorted(i))}: {n}"
                     for n, i in notes.items()]
    main.notes.append(f"--array={spec}: {len(everyone)} element(s) read one by one, {len(results)} distinct reading(s) "
                      f"of the script; the table shows element(s) {index_ranges(results[0][0])}")
    return main


def merge_by_elements(parts: list[tuple[list[int], Findings]], everyone: list[int], spec: str | None) -> Findings:
    """Findings of every element once; the others prefixed by the elements they hold for."""
    holds: dict[tuple[str, str, str], list[int]] = {}
    for indices, findings in parts:
        for f in findings:
            holds.setdefault((f.level, f.code, f.message), []).extend(indices)
    out = Findings()
    for (level, code, message), indices in holds.items():
        indices = sorted(set(indices))
        out.append(Finding(level, code, message if indices == everyone else
                           f"array element(s) {index_ranges(indices)} of --array={spec}: {message}"))
    return out


# -- heterogeneous components: each one's own request, and the steps' --het-group --

def check_components(job: Job, steps: list[Step], findings: Findings) -> None:
    """A heterogeneous job (#SBATCH hetjob): srun runs on component 0 unless --het-group says otherwise (measured);
    a group past the last is srun's refusal; a component no trainer line plans gets its request checked."""
    components, count = job.components, len(job.components) or 1
    lines = {id(x): x for x in [s.launch for s in steps if s.launch] + list(job.launches)}
    for launch in lines.values():
        value = next((v for n, v in reversed(launch.srun or []) if n == "het-group"), None)
        if value is None or "$" in value:
            continue
        groups = het_groups(value)
        if groups and groups[-1] >= count:  # srun/libsrun/srun_job.c: the offsets past the job's components
            findings.error("het-group", f"{launch.where}: srun --het-group={value} but the job has {count} "
                           f"component(s), 0 to {count - 1}" + ("" if components else " (no '#SBATCH hetjob' line)")
                           + f": srun refuses the step ('Requested het-group offset exceeds highest hetjob index "
                           f"({groups[-1]} > {count - 1})', measured); use --het-group <= {count - 1}")
        elif groups and len(groups) > 1:
            findings.warn("het-group", f"{launch.where}: srun --het-group={value} starts one step over components "
                          f"{','.join(map(str, groups))} (ranks numbered across them, measured); the plan shows "
                          f"component {groups[0]}'s part only")
    planned = {s.job.component for s in steps}
    for component in components:
        if component.component not in planned:
            check_component(component, job, findings)


def check_component(component: Job, job: Job, findings: Findings) -> None:
    """A component of a heterogeneous job that no trainer line plans: its request, placement and site rules, each
    finding named by its component."""
    share_site(job, component)
    own = Findings()
    caps, ntasks = allocation_tasks(component, own)
    nodes = len(caps) if caps else (component.nodes or 1)
    shape = caps or packing(ntasks, nodes, node_cap(component))
    gpn = step_gpus_per_node(component, shape, own)
    component.gpus_per_node = gpn
    check_whole(component, shape, gpn, own)
    seen = {(f.level, f.code, f.message) for f in findings}
    for f in own:
        if (f.level, f.code, f.message) not in seen:
            findings.append(Finding(f.level, f.code, f"hetjob component {component.component}: {f.message}"))


# -- the batch shell: signals, requeue, the steps' environment --

def check_batch_shell(job: Job, steps: list[Step], findings: Findings) -> None:
    check_signal(job, findings)
    check_requeue(job, findings)
    check_exports(job, steps, findings)


def check_signal(job: Job, findings: Findings) -> None:
    """--signal=B:SIG sends the signal to the batch shell only (sbatch(1) --signal: 'B: signal only the batch
    shell, none of the other processes will be signaled'). Without a trap bash dies of it: measured on the test
    cluster, --signal=B:USR1 killed the batch shell, the job ended FAILED (ExitCode 0:10) and its step was killed;
    with a trap the job went on; without B: the step got the signal."""
    value = job.options.get("signal")
    spec = signal_spec(value) if value and "$" not in value else None
    if not spec or not spec[0] or spec[1] in SIGNALS_NOT_FATAL:
        return
    _, sig, seconds = spec
    where = job.option_lines.get("signal", job.source.rpartition("/")[2])
    plain = value.split(":", 1)[1]
    if sig in ("KILL", "STOP"):
        findings.warn("signal-no-trap", f"{where}: --signal={value} sends SIG{sig} to the batch shell, which no "
                      f"trap can catch: the job ends {seconds} s before its time limit; send --signal={plain} to the "
                      "steps, or another signal")
        return
    if sig in job.traps:
        return
    findings.warn("signal-no-trap", f"{where}: --signal={value} sends SIG{sig} to the batch shell only, {seconds} s "
                  f"before the time limit, and the script sets no trap for it: bash dies of it, the job ends FAILED "
                  f"and its steps are killed (measured with B:USR1: exit code 0:10), so the trainer never gets the "
                  f"signal nor checkpoints; write --signal={plain} to signal the steps (the kit's trainers checkpoint "
                  f"on SIGUSR1), or trap it and pass it on: trap 'scancel --signal={sig} $SLURM_JOB_ID' {sig}, with "
                  "the step started in the background (srun ... &) and `wait` (bash runs a trap only once the "
                  "command in the foreground ends)")


def check_requeue(job: Job, findings: Findings) -> None:
    """`scontrol requeue` in a job submitted with --no-requeue (the last of --requeue / --no-requeue counts):
    measured, 'Requested operation is presently disabled for job N', exit 1, and the job ends there."""
    if "no-requeue" not in job.options or not job.requeues:
        return
    lines = job.option_lines

    def line_of(name: str) -> int:
        tail = lines.get(name, "").rpartition(":")[2]
        return int(tail) if tail.isdigit() else 0
    if "requeue" in job.options and line_of("requeue") > line_of("no-requeue"):
        return
    findings.warn("requeue-disabled", f"{job.requeues[0]}: scontrol requeue in a job submitted with --no-requeue "
                  f"({lines.get('no-requeue', 'the directives')}): Slurm refuses it ('Requested operation is "
                  "presently disabled for job N', measured) and the job ends instead of coming back to resume; "
                  "drop --no-requeue (the kit's templates use --requeue)")


def export_restores(value: str | None) -> bool:
    """An --export / SLURM_EXPORT_ENV value that gives a step PATH: ALL (the default) or a list naming PATH; an
    unknown value (a variable) is given the benefit of the doubt."""
    if value is None or "$" in value or not value.strip():
        return True
    names = [t.split("=")[0].strip() for t in value.split(",")]
    return any(n.upper() == "ALL" for n in names) or "PATH" in names


def step_program(launch) -> str:
    """The program srun starts on a launch line (the first word after srun's options)."""
    words = launch.words
    at = next((i for i, w in enumerate(words) if os.path.basename(w) == "srun"), None)
    if at is None:
        return ""
    _, rest = parse_options(words[at + 1:], launch.where, Findings(), prog="srun")
    return rest[0] if rest else ""


def check_exports(job: Job, steps: list[Step], findings: Findings) -> None:
    """sbatch --export=NONE (or a list without PATH) passes SLURM_EXPORT_ENV on to srun (sbatch/opt.c; man sbatch:
    'To avoid steps inheriting environment export settings (e.g. "NONE") from sbatch command, the environment
    variable SLURM_EXPORT_ENV should be set to "ALL" in the job script'): the steps then get the SLURM_* variables
    only. Measured: `srun bash -c ...` failed, 'execve(): bash: No such file or directory', exit code 2; the same
    with `export SLURM_EXPORT_ENV=ALL` or `srun --export=ALL` ran; `srun /bin/bash` ran with no module's PATH."""
    export = job.options.get("export")
    launches = list({id(x): x for x in [s.launch for s in steps if s.launch] + list(job.launches)}.values())
    bare, absolute = [], []
    for launch in launches:
        if launch.srun is None:
            continue
        # srun's own --export, else SRUN_EXPORT_ENV (it overrides), else SLURM_EXPORT_ENV as the script leaves it
        # (sbatch's --export: batch_variables), else ALL (srun/libsrun/opt.c env_vars)
        own = next((v for n, v in reversed(launch.srun) if n == "export"), None)
        env = launch.env
        value = own if own is not None else env["SRUN_EXPORT_ENV"] if "SRUN_EXPORT_ENV" in env else env.get(
            "SLURM_EXPORT_ENV", export)
        program = step_program(launch)
        if export_restores(value) or not program or "$" in program:
            continue
        (absolute if "/" in program else bare).append((launch.where, program, own))
    where = job.option_lines.get("export", "the directives") if export and not export_restores(export) else ""
    if bare:
        first, program, own = bare[0]
        why = (f"srun --export={own} gives it" if own is not None else f"--export={export} ({where}) reaches the "
               "steps through SLURM_EXPORT_ENV, so they get")
        findings.error("export-no-path", f"{first}: srun starts '{program}' with no PATH: {why} the SLURM_* variables "
                       f"only and slurmstepd cannot find the program ('execve(): {program}: No such file or "
                       "directory', the step exits 2, measured)"
                       + (f"; {len(bare)} srun line(s): {', '.join(w.rpartition(':')[2] for w, _, _ in bare)}"
                          if len(bare) > 1 else "")
                       + ("; write srun --export=ALL (or a list naming PATH)" if own is not None else
                          "; add `export SLURM_EXPORT_ENV=ALL` after the #SBATCH lines (man sbatch), or srun "
                          "--export=ALL"))
    elif absolute:
        first, program, own = absolute[0]
        why = f"srun --export={own}" if own is not None else f"--export={export}, {where}, reaches the steps"
        findings.warn("export-no-path", f"{first}: srun starts {program} with the SLURM_* variables only ({why}): no "
                      "PATH, no LD_LIBRARY_PATH or other variable of the modules the script loads; "
                      + ("write srun --export=ALL" if own is not None else "add `export SLURM_EXPORT_ENV=ALL` after "
                         "the #SBATCH lines, or srun --export=ALL"))

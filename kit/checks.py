"""Checking a job: every task's plan (the kit's trainer in depth), then the whole; any other program at the
Slurm and site level; the launchers' agents and workers. Owns: check_job. Imports: kit.arguments, kit.bounded,
kit.findings, kit.plan, kit.memory, kit.releases, kit.trainer_checks, kit.slurm, kit.placement, kit.site, kit.shell,
kit.jobscript, kit.report, kit.model and kit.own_split (--model only: the model is measured in a bounded child
process, no torch in this one).
"""
from __future__ import annotations

import copy
import re
from dataclasses import replace

from kit.bounded import whole_number
from kit.arguments import CPU_DEFAULTS, GPU_DEFAULTS, TRAINERS, Training, model_args
from kit.findings import Findings, UsageError, guarded
from kit.jobscript import LaunchLine, apply_step, workers_of
from kit.memory import (GIB, NotEstimated, estimate_memory, estimate_stage_memory, format_memory, memory_fixes, requested_arch,
    shared_gpu_memory)
from kit.placement import (allocation_cores, allocation_tasks, gpu_view, packing, step_gpus_per_node,
    step_placement)
from kit.plan import TaskPlan, page_indexing, plan_task
from kit.releases import torch_version_of
from kit.report import Report
from kit.shell import PER_TASK
from kit.site import (ASSOC_COMMAND, JEAN_ZAY, check_cpus, check_engine, check_jean_zay, check_live, check_nodes,
    check_time, gpu_memory, is_v100, node_cap, node_type)
from kit.slurm import Job, too_many_tasks
from kit.trainer_checks import check_bubble, check_stage, check_training, choice_list, divisors


def check_job(job: Job, training: Training, whole: bool = True) -> Report:
    """Plan every task of a request and check the whole. Without a kit trainer in the script (job.trainer None),
    only the Slurm and site layer: the request, the placement, each launch line's processes, Jean Zay's rules.
    whole=False: a later step of the script (kit.steps), judged on its own plan; the job's own checks (cores, time,
    site) are the first step's. A check that fails unexpectedly becomes one internal-error finding naming the
    trainer's line (kit.findings.guarded), and the others still run."""
    findings = Findings()
    if job.unplanned:
        return Report(job, training, [], findings, [f"nothing planned: {job.unplanned}"])
    if job.trainer is None:
        return check_other_program(job, training, findings)
    where = job.trainer_line.where if job.trainer_line else job.source
    given = {"nlayers"} if training.nlayers is not None else set()
    defaulted = training.nlayers is None and not training.known("nlayers")  # a shell variable, or refused
    planned = plan_tasks(job, training, findings)
    if isinstance(planned, Report):
        return planned
    report, tasks_per_node, procs_per_node, gpn = planned
    report.defaulted, report.placed = {"nlayers"} - given, list(tasks_per_node)
    if defaulted:
        report.notes.append(f"the table splits the trainer's default {training.nlayers} layers: the line's --nlayers "
                            "is not known here (a shell variable, or a value the trainer refuses)")
    guarded(findings, where, check_kit, report, procs_per_node, gpn)
    if whole:
        check_whole(job, tasks_per_node, gpn, findings)
    if job.placement == "possible":
        report.notes.append(f"placement: Slurm decides by free cores; the table shows one placement it may make "
                            f"({','.join(map(str, tasks_per_node))} task(s) per node)")
    return report


def check_whole(job: Job, tasks_per_node: list[int], gpn: int | None, findings: Findings) -> None:
    """The job's own checks, once per script: its cores, time and site rules, and every srun line's -c."""
    gpus_per_task = (gpn // max(tasks_per_node)) if gpn and tasks_per_node else 0
    where = job.source.rpartition("/")[2]
    guarded(findings, where, check_site, job, tasks_per_node, gpus_per_task, gpn, findings)
    guarded(findings, where, check_steps_cpus, job, findings)


def plan_tasks(job: Job, training: Training, findings: Findings):
    """Where Slurm puts the trainer's tasks, the GPUs each sees, and each task's plan (kit.plan.plan_task, the
    trainers' own): (report, tasks per node, processes per node, GPUs per node), or a Report when nothing is
    planned."""
    tasks_per_node = step_placement(job, findings)
    if too_many_tasks(tasks_per_node, findings):
        return Report(job, training, [], findings, ["nothing planned: more tasks than the nodes run"])
    gpn = step_gpus_per_node(job, tasks_per_node, findings)
    job.gpus_per_node = gpn
    if training.nlayers is None:  # the trainer's own default for what it will run on
        training.nlayers = (GPU_DEFAULTS if gpn else CPU_DEFAULTS)["nlayers"]
    check_gpus_fit(job, gpn, tasks_per_node, findings)
    notes = []
    if any(f.code == "gpus-exceed-node" for f in findings):  # sbatch refuses it: plan what a node holds instead
        gpn = job.gpus_per_node = JEAN_ZAY[node_type(job)].gpus or None
        notes.append(f"the table plans the {gpn or 0} GPU(s) a node has, not the request that sbatch refuses")
    procs_per_node, agent_view = tasks_per_node, None
    if job.workers is not None:  # torchrun: its workers are the trainer's processes (LOCAL_WORLD_SIZE = workers)
        procs_per_node, agent_view = torchrun_processes(job, tasks_per_node, gpn, findings)
        if too_many_tasks(procs_per_node, findings):
            return Report(job, training, [], findings, ["nothing planned: more processes than the nodes run"])
    if training.layout == "stage":
        training.nb_part = 1  # a task per GPU
    check_divisible(job, gpn, procs_per_node, training, findings)
    plans = task_plans(job, training, procs_per_node, gpn, agent_view, findings)
    dedupe_findings(findings)
    return Report(job, training, plans, findings, notes), tasks_per_node, procs_per_node, gpn


def task_plans(job: Job, training: Training, procs_per_node: list[int], gpn: int | None,
               agent_view: list[str] | None, findings: Findings) -> list[TaskPlan]:
    """Every task's plan, numbered as srun's --distribution numbers them (task_ranks)."""
    plans: list[TaskPlan] = []
    ranks = task_ranks(job, procs_per_node, findings)
    planned: dict[tuple[int, int], TaskPlan] = {}  # a task's plan depends on its node's count and its local rank
    for node, tasks in enumerate(procs_per_node):
        for local in range(tasks):
            if (tasks, local) not in planned:
                visible = (agent_view if agent_view is not None else gpu_view(job, local, tasks, gpn, findings)
                           ) if gpn else []
                # under torchrun idr_torch knows no SLURM_GPUS_ON_NODE (launcher torchrun): the plan is the page's
                planned[tasks, local] = plan_task(0, node, local, tasks, visible,
                                                  None if job.workers is not None else gpn, training.nlayers,
                                                  training.nb_part, findings, training.devices)
            plan = copy.copy(planned[tasks, local])  # its lists are shared, never changed after planning
            plan.rank, plan.node = ranks[node, local], node
            plans.append(plan)
    plans.sort(key=lambda p: p.rank)
    return plans


def task_ranks(job: Job, per_node: list[int], findings: Findings) -> dict[tuple[int, int], int]:
    """The global rank of each (node, local rank) as srun's --distribution numbers them (man srun -m): block (the
    default) fills a node before the next, cyclic deals one task a node per round, plane=N deals N at a time.
    torchrun numbers its workers node by node (block) whatever srun does."""
    dist = (job.distribution or "block").lower() if job.workers is None else "block"
    base = dist.split(":")[0].split(",")[0]
    plane = whole_number(base[6:]) if base.startswith("plane=") else None  # ASCII digits, bounded (kit.bounded)
    deal = 1 if base == "cyclic" else plane if plane else max(per_node) if base in ("block", "*", "") else None
    if deal is None:
        findings.warn("distribution-not-modelled", f"{job.option_lines.get('distribution', 'srun')}: "
                      f"--distribution={job.distribution}: which task runs where is given by a node list here, not "
                      f"modelled; the plan numbers the {sum(per_node)} tasks node by node")
        deal = max(per_node)
    ranks, done, rank = {}, [0] * len(per_node), 0
    while rank < sum(per_node):
        for node, count in enumerate(per_node):
            for _ in range(min(deal, count - done[node])):
                ranks[node, done[node]] = rank
                done[node] += 1
                rank += 1
    return ranks


def check_kit(report: Report, procs_per_node: list[int], gpn: int | None) -> None:
    """What only the kit's trainer is judged on: its GPUs per task, its model and pipeline, its fit, its torch. Each
    check that fails unexpectedly is one internal-error finding; the others run."""
    job, training, findings, plans = report.job, report.training, report.findings, report.tasks
    where = job.trainer_line.where if job.trainer_line else job.source

    def run(check, *args):
        return guarded(findings, where, check, *args)
    run(check_node_usage, report)
    nb_parts = [p.nb_part for p in plans if p.nb_part]
    cpu = all(p.cpu for p in plans) if plans else not gpn
    if training.layout == "stage":
        stages = run(check_stage, len(plans), procs_per_node, gpn, training, findings, cpu) or 0
        run(check_pipelines_cross_nodes, report)
        run(check_training, stages, training, findings, cpu)
        own_model_split(report, stages, cpu)
        if not cpu and stages and len(plans) % training.pp == 0:  # the fit of each pipeline's tasks
            line = run(check_memory, job, training, training.pp, len(plans) // training.pp, gpn, findings)
            report.notes += [line] if line else []
    elif nb_parts:
        run(check_training, min(nb_parts), training, findings, cpu)
        own_model_split(report, min(nb_parts), cpu)
        if not cpu:  # each leaves alone what a shell variable may hold (training.unknown)
            run(check_bubble, min(nb_parts), training, findings)
            line = run(check_memory, job, training, min(nb_parts), len(plans), max(procs_per_node), findings)
            report.notes += [line] if line else []
    run(check_engine, job, training, findings)
    run(check_gpu_cgroups, job, procs_per_node, gpn, findings)
    run(note_page_indexing, report)


def check_pipelines_cross_nodes(report: Report) -> None:
    """The stage layout's pipelines are --pp consecutive ranks (bench_stage.py's DeviceMesh (dp, pp)): where srun's
    --distribution (cyclic, plane=N) numbers the ranks across nodes, a pipeline crosses nodes even when --pp divides
    the tasks per node (measured on the test cluster: -m cyclic put ranks 0 and 1 on two nodes). check_stage judges
    the block numbering from the counts; this one the ranks as the plan numbers them."""
    t, plans, findings = report.training, report.tasks, report.findings
    if t.pp < 2 or not t.known("pp") or any(f.code == "pipeline-spans-nodes" for f in findings):
        return
    node_of = {p.rank: p.node for p in plans}
    crossing = [r // t.pp for r in range(0, len(plans) - len(plans) % t.pp, t.pp)
                if len({node_of.get(r + k) for k in range(t.pp)}) > 1]
    if crossing:
        first = crossing[0] * t.pp
        dist = report.job.distribution or "block"
        findings.warn("pipeline-spans-nodes", f"--distribution={dist} numbers the ranks across nodes: {len(crossing)} "
                      f"of the {len(plans) // t.pp} pipeline(s) cross nodes (pipeline {crossing[0]}: ranks {first}-"
                      f"{first + t.pp - 1} on nodes {','.join(str(node_of[first + k]) for k in range(t.pp))}) and "
                      "send activations over the network at every micro-batch; drop --distribution (block keeps "
                      "consecutive ranks on one node), or srun -m block")


def own_model_split(report: Report, nb_part: int, cpu: bool) -> None:
    """--model: the split the trainer will run (kit.own_split, the trainers' own function), in every task's parts and
    in a note; a model that does not load, take the sample or fill the parts is a usage error (exit 2), in one line.
    torch is imported only here, in model mode."""
    t = report.training
    if not t.model_spec or nb_part < 1 or not t.known("model_spec", "sample", "split", "nb_part", "pp"):
        return
    ignored = [k for k in ("d_model", "n_head", "d_hid", "dropout") if k in t.model]
    ignored += ["nlayers"] * (t.nlayers is not None and "nlayers" not in report.defaulted)
    if ignored:  # the line's own values (the checker's Training holds only those): the kit's Transformer's shape
        report.findings.warn("ignored-with-model", f"{', '.join('--' + k.replace('_', '-') for k in ignored)} shape "
                             f"the kit's own Transformer: with --model {t.model_spec} your function builds the layers, "
                             "so the trainer ignores them; leave them out (--seq-len and --vocab-size still shape the "
                             "kit's data)")
    from kit.model import ModelError
    from kit.own_split import checker_note  # the model measured in a bounded child (kit.measure_child)
    try:
        plan, note = checker_note(t, nb_part, cpu)
    except ModelError as exc:
        raise UsageError(str(exc)) from None
    t.nlayers = len(plan.names)
    for p in report.tasks:
        p.own, p.nlayers = plan.contents, len(plan.names)
    report.notes.append(note)


def check_site(job: Job, tasks_per_node: list[int], gpus_per_task: int, gpn: int | None, findings: Findings) -> None:
    """The cores, the time, the nodes and the site's accounts, QoS and modules: the same for every program. The
    account, QoS and time limits are the dated table's, or Slurm's own read here (check_live), or none (--site).
    Where Slurm answered but its accounting (slurmdbd) did not, the partitions are Slurm's and the QoS, account and
    time limits the table's, worded as the table's (issue 42: a slow database is not "no limits")."""
    where = job.source.rpartition("/")[2]
    guarded(findings, where, check_cpus, job, gpus_per_task, tasks_per_node, findings)
    live = job.site_rules == "live" and job.site is not None
    table = job.site_rules == "jean-zay" or (live and bool(job.site.accounting_problem))
    guarded(findings, where, check_time, job, findings, limits=table)
    guarded(findings, where, check_nodes, job, findings)
    gpus = (gpn or 0) * len(tasks_per_node) or None
    cores = sum(job.cores_per_node) if job.cores_per_node else sum(tasks_per_node) * (job.cpus_per_task or 1)
    if live:
        guarded(findings, where, check_live, job, job.site, gpus, cores, findings)
    if live and job.site.accounting_problem and job.time != "allocated":
        findings.warn("accounting-unread", f"Slurm's accounting here did not answer ({job.site.accounting_problem}):"
                      f" {', '.join(w for w, v in (('--account', job.account), ('--qos', job.qos)) if v) or 'the job'}"
                      " and its time were judged by Jean Zay's documented table, not by your associations and QoS: "
                      f"check again when slurmdbd answers, or ask it yourself (`{ASSOC_COMMAND}`)")
    if job.site_rules != "none":
        guarded(findings, where, check_jean_zay, job, findings, gpus_asked=gpus, cores_asked=cores, table_qos=table)


def check_steps_cpus(job: Job, findings: Findings) -> None:
    """srun without -c in a job with --cpus-per-task: srun 22.05 and 23.02 do not pass the job's value on to the
    step (SchedMD's 22.05 RELEASE_NOTES: 'srun will no longer read in SLURM_CPUS_PER_TASK'; 23.11 went back:
    'Replace SRUN_CPUS_PER_TASK with SLURM_CPUS_PER_TASK and get back the previous behavior before Slurm 22.05'),
    so each task gets 1 CPU where CPUs are bound, and may be placed otherwise than the allocation (measured)."""
    if not job.cpus_per_task or job.cpus_per_task < 2:
        return
    lines = [job.trainer_line.where] if job.trainer_line and job.srun and not job.srun_cpus else []
    for launch in job.launches:
        if launch.srun is not None and launch.program not in SMALL_STEPS and not (
                "SRUN_CPUS_PER_TASK" in launch.env or any(n == "cpus-per-task" for n, _ in launch.srun)):
            lines.append(launch.where)
    if lines:
        lines = sorted(dict.fromkeys(lines), key=lambda w: int(w.rpartition(":")[2]))
        findings.warn("srun-cpus-per-task", f"{lines[0]}: srun without -c in a job with --cpus-per-task="
                      f"{job.cpus_per_task}" + (f" ({len(lines)} srun lines: {', '.join(l.rpartition(':')[2] for l in lines)})" if len(lines) > 1 else "")
                      + ": Slurm 22.05 and 23.02 do not pass it on to the step, so each task runs on 1 CPU where "
                      "CPUs are bound (its DataLoader workers and threads share it) and the step may be placed "
                      "unlike the allocation (measured); write srun -c $SLURM_CPUS_PER_TASK, or export "
                      "SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK once (23.11 and later inherit it again)")


# steps that need no more than the one CPU srun gives them (a node's name, its GPUs, a copy to local disk)
SMALL_STEPS = {"hostname", "nvidia-smi", "echo", "env", "printenv", "date", "true", "sleep", "cat", "ls", "mkdir",
               "rm", "cp", "mv", "rsync", "tar", "df", "free", "uname", "scontrol"}


def torchrun_processes(job: Job, agents_per_node: list[int], gpn: int | None,
                       findings: Findings) -> tuple[list[int], list[str] | None]:
    """torchrun on the trainer's line: one agent per node starting `workers` processes, each with LOCAL_RANK and
    LOCAL_WORLD_SIZE = workers, seeing what its agent's srun task sees. Returns (processes per node, what each
    process sees)."""
    launch = job.trainer_line
    view = gpu_view(job, 0, agents_per_node[0], gpn, findings) if gpn else []
    layout = launcher_layout(job, launch, agents_per_node, gpn, view, findings)
    # with several agents on a node only one wins the rendezvous (launcher-agents-per-node says so): plan that one
    per_node = [p // a for p, a in zip(layout["processes_per_node"], agents_per_node)]
    fallback = job.workers if isinstance(job.workers, int) else 1  # a count this reading can't know: one
    return per_node or [fallback] * len(agents_per_node), view


def check_gpus_fit(job: Job, gpn: int | None, tasks_per_node: list[int], findings: Findings) -> None:
    """A GPU request at all, one the node can hold, tasks per node that agree."""
    check_gpu_request(job, gpn, findings)
    check_even(job, gpn, tasks_per_node, findings)


def check_gpu_request(job: Job, gpn: int | None, findings: Findings) -> None:
    ntype = node_type(job)
    t = JEAN_ZAY[ntype] if ntype else None
    if not gpn:
        if t and not t.gpus:
            findings.warn("no-gpus", f"the job asks for {t.label}, which have no GPU: the trainer runs its CPU model "
                          "(slow); for training ask for GPU nodes, e.g. --gres=gpu:4 -C v100-32g")
        else:
            findings.error("no-gpus", "the job requests no GPU; add --gres=gpu:N (GPUs per node, e.g. --gres=gpu:4) "
                           "or --gpus-per-node=N")
    elif t and gpn > t.gpus:
        findings.error("gpus-exceed-node", gpus_exceed_message(gpn, t, job))


def gpus_exceed_message(gpn: int, t, job: Job | None = None) -> str:
    """More GPUs per node than the node type has: what sbatch says (measured: --gres=gpu:8 and --gpus-per-task=2 x
    3 tasks on the 4-GPU nodes) and the fix, in the option the request used."""
    gpt = job.gpus_per_task if job and not {"gres", "gpus-per-node", "gpus"} & set(job.options) else None
    if not t.gpus:
        fix = "ask for GPU nodes (-C v100-32g, -C a100, -C h100) or drop the GPUs"
    elif gpt:
        fix = (f"use --ntasks-per-node <= {max(1, t.gpus // gpt)} or --gpus-per-task <= "
               f"{max(1, t.gpus // max(1, gpn // gpt))}")
    else:
        fix = f"use --gres=gpu:{t.gpus}" + (" or another partition (-p gpu_p2 / -C a100 for 8 GPUs)" if t.gpus < 8
                                             else "")
    return (f"{gpn} GPUs per node requested but {t.label} have {t.gpus}: sbatch refuses the job ('Requested node "
            f"configuration is not available', measured); {fix}")


def check_even(job: Job, gpn: int | None, tasks_per_node: list[int], findings: Findings) -> None:
    """Tasks per node that differ give nodes different nb_part (reported once: not when the request's packing
    already was)."""
    reported = any(f.level == "error" and f.code in ("ntasks-mismatch", "ntasks-per-node-missing") for f in findings)
    if len(set(tasks_per_node)) > 1 and job.placement == "exact" and not reported:
        nbs = {n: (gpn or 0) // n for n in tasks_per_node}
        findings.error("uneven-tasks-per-node",
                       f"tasks per node differ ({','.join(map(str, tasks_per_node))}): nodes get nb_part "
                       f"{choice_list(nbs.values())}, so replicas differ in layout and speed (the page's code even "
                       f"lacks SLURM_NTASKS_PER_NODE); use --nodes={len(tasks_per_node)} with the same "
                       f"--ntasks-per-node on every node")


def check_other_program(job: Job, training: Training, findings: Findings) -> Report:
    """A script that runs no kit trainer: its request, its placement, each launch line's processes against the
    GPUs, Jean Zay's rules; and one note that the training itself was not checked, and why."""
    caps, ntasks = allocation_tasks(job, findings)
    nodes = len(caps) if caps else (job.nodes or 1)
    shape = caps or packing(ntasks, nodes, node_cap(job))
    if too_many_tasks(shape, findings):
        return Report(job, training, [], findings, ["nothing planned: more tasks than the nodes run"])
    gpn = step_gpus_per_node(job, shape, findings)
    job.gpus_per_node = gpn
    allocation_cores(job, shape, ntasks)  # job.cores_per_node, for the report
    ntype = node_type(job)
    t = JEAN_ZAY[ntype] if ntype else None
    if not gpn and t and t.gpus:
        findings.warn("no-gpus", f"the job asks for {t.label} but for no GPU: it gets none; add --gres=gpu:N, or "
                      "use a CPU partition (-p cpu_p1, prepost) for work without GPUs")
    elif gpn and t and gpn > t.gpus:
        findings.error("gpus-exceed-node", gpus_exceed_message(gpn, t, job))
        gpn = job.gpus_per_node = t.gpus or None  # sbatch refuses the request: what follows is of the node's GPUs
    check_gpu_cgroups(job, shape, gpn, findings)
    stepped = any(x.srun is not None for x in job.launches)
    for launch in job.launches:
        if stepped and launch.srun is None and launch.launcher in ("python", "program"):
            continue  # a helper the batch shell runs once beside srun's steps (data preparation, pip install ...)
        layout_of_launch(job, launch, gpn, findings)
    per_task = (gpn // max(shape)) if gpn else 0
    check_site(job, shape, per_task, gpn, findings)
    check_steps_cpus(job, findings)
    _unique(findings)
    report = Report(job, training, [], findings)
    programs = sorted({f"{x.launcher} {x.program}" if x.launcher not in ("python", "program") else x.program
                       for x in job.launches}) if job.launches else []
    why = (f"the script runs {', '.join(programs[:3])}{' ...' if len(programs) > 3 else ''}, not the kit's "
           "bench_ddp_transformer.py or bench_stage.py" if programs else
           "no launch line (srun, python, torchrun, deepspeed, accelerate launch) was found in the script"
           + (f"; it sources {', '.join(job.sourced[:2])}, which is not read" if job.sourced else ""))
    report.notes.append(f"training not checked: {why}; checked: the Slurm request, the placement, "
                        + ("each launch line's processes against the GPUs, " if job.launches else "")
                        + "Jean Zay's rules")
    report.notes += [n for x in job.launches for n in x.layout.get("notes", [])]
    return report


def _unique(findings: Findings) -> None:
    seen, kept = set(), []
    for f in findings:
        if (f.code, f.message) not in seen:
            seen.add((f.code, f.message))
            kept.append(f)
    findings[:] = kept


def layout_of_launch(job: Job, launch: "LaunchLine", gpn: int | None, findings: Findings) -> None:
    """One launch line of a script without a kit trainer: where srun puts its tasks, then what its launcher does."""
    step = replace(job, step_nodes=None, step_ntasks=None, step_ntasks_per_node=None, step_cpus_per_task=None,
                   srun=launch.srun is not None, trainer=launch.program, launcher=" ".join(launch.words[:launch.script]),
                   placement="exact", options=dict(job.options), launches=[])
    quiet = launch.launcher in ("deepspeed", "accelerate") and launch.srun is None  # they start other nodes themselves
    if launch.srun is not None:
        apply_step(step, launch, findings)
    sub = Findings()
    agents = [1] if quiet else step_placement(step, sub, kit=False)
    findings.extend(f for f in sub if f.code != "trainer-without-srun" or launch.launcher in ("python", "torchrun"))
    view = gpu_view(step, 0, agents[0], gpn, findings) if gpn else []
    launch.layout = launcher_layout(step, launch, agents, gpn, view, findings)


def launcher_layout(job: Job, launch: "LaunchLine", agents: list[int], gpn: int | None, view: list[str],
                    findings: Findings) -> dict:
    """The processes a launch line starts on each node and what each sees: srun's tasks (agents), times the workers
    each agent starts (LAUNCHER_WORKERS). Checks one agent per node, the node count the launcher expects, and one
    GPU per process. What a launcher's own configuration file decides is not modelled, and said so in a note."""
    kind, where = launch.launcher, launch.where
    layout = {"agents_per_node": list(agents), "processes_per_node": list(agents), "gpus_per_process": None,
              "notes": []}
    if kind in ("python", "program"):
        layout["gpus_per_process"] = len(view) if gpn else 0
        if gpn and launch.srun is not None and max(agents) > gpn and kind == "python" and job.trainer not in TRAINERS:
            findings.warn("processes-exceed-gpus", f"{where}: srun starts {max(agents)} tasks of {launch.program} on "
                          f"a node with {gpn} GPU(s): tasks share GPUs (nccl refuses two ranks on one GPU: 'Duplicate "
                          f"GPU detected'); use --ntasks-per-node <= {gpn}")
        return layout
    workers, expected = LAUNCHER_WORKERS[kind](job, launch, len(agents), gpn, view, layout, findings)
    if workers is False:  # refused, or decided by a file: said already
        layout["processes_per_node"] = []
        return layout
    check_agents(launch, agents, expected, findings)
    if workers is None:
        layout["notes"].append(f"{where}: {kind}'s processes per node are given by a shell variable: not checked")
        layout["processes_per_node"] = []
        return layout
    layout.update(processes_per_node=[workers * a for a in agents], gpus_per_process=1 if gpn else 0)
    if gpn and workers > len(view):
        findings.error("processes-exceed-gpus", f"{where}: {kind} starts {workers} processes per node for the "
                       f"{len(view)} GPU(s) they see: two processes on one GPU (nccl refuses it: 'Duplicate GPU "
                       f"detected'); start {len(view)} per node")
    elif gpn and workers < len(view) and job.trainer not in TRAINERS:
        findings.warn("gpus-idle", f"{where}: {kind} starts {workers} process(es) per node for the {len(view)} GPU(s) "
                      f"they see: {len(view) - workers} GPU(s) per node stay idle (one GPU per process); start "
                      f"{len(view)}, or ask for {workers} GPU(s) per node")
    return layout


def check_agents(launch: "LaunchLine", agents: list[int], expected: tuple[int, int] | None,
                 findings: Findings) -> None:
    """One agent per node, and as many nodes as the launcher waits for (torchrun --nnodes MIN:MAX, accelerate
    --num_machines)."""
    kind, where, nodes = launch.launcher, launch.where, len(agents)
    if max(agents) > 1:
        findings.error("launcher-agents-per-node",
                       f"{where}: srun starts {max(agents)} {kind} agents per node (one per task), each starting its "
                       f"own workers: they race for the rendezvous and some die (measured with torchrun: "
                       f"RendezvousConnectionError); start one per node: srun --ntasks-per-node=1 (or -n "
                       f"{nodes}) {kind} ...")
    if expected is None or expected[0] <= nodes <= expected[1]:
        return
    want = expected[0] if nodes < expected[0] else expected[1]
    how = "srun starts it on" if launch.srun is not None else "the batch script starts it once, on"
    findings.error("launcher-nodes-mismatch",
                   f"{where}: {kind} expects {want} node(s) ({'--nnodes' if kind == 'torchrun' else '--num_machines'}) "
                   f"but {how} {nodes}: " + ("the rendezvous waits for agents that never come, until its timeout"
                                             if want > nodes else "the extra agents are refused")
                   + (f"; start one per node with srun --ntasks-per-node=1 on --nodes={want}" if launch.srun is None
                      else f"; make them agree (--nodes={want}, or the launcher's count = {nodes})"))


def torchrun_workers(job: Job, launch: "LaunchLine", nodes: int, gpn: int | None, view: list[str], layout: dict,
                     findings: Findings):
    """torchrun's --nproc_per_node (default 1; 'gpu' and 'auto': the GPUs the agent sees, torch/distributed/run.py
    determine_local_world_size) and --nnodes (default 1:1; --standalone: 1); a --node_rank the batch shell expanded
    once gives every agent the same rank in a static rendezvous."""
    opts, where = launch.options, launch.where
    workers = workers_of(launch)
    if workers == "gpu" and not gpn:
        findings.error("no-gpus", f"{where}: torchrun --nproc_per_node=gpu needs GPUs (torch: 'Cuda is not "
                       "available') and the job asks for none; give a count, or ask for GPUs")
        return False, None
    if workers in ("gpu", "auto"):
        workers = len(view) if gpn else node_cores(job)
    elif workers == "cpu":
        workers = node_cores(job)
    if (opts.get("rdzv-backend") or "static") == "static":  # c10d ignores it (torch/distributed/run.py)
        check_node_rank(launch, "node_rank", nodes, "--rdzv_backend=c10d", findings)
    return workers, nodes_expected(opts.get("nnodes"), "standalone" in opts)


def check_node_rank(launch: "LaunchLine", option: str, nodes: int, other: str | None, findings: Findings) -> None:
    """A launcher's node rank (torchrun --node_rank, accelerate --machine_rank, deepspeed --no_ssh --node_rank) must
    be each agent's own. The batch shell expands $SLURM_NODEID (0 there), a variable set from it, or a number once,
    before srun: every agent then claims the same rank. Single-quoted, nobody expands it: srun runs the launcher
    without a shell, and its argparse (type=int) refuses the text. Only `srun bash -c '...'` expands it per task."""
    rank, kind, where = launch.options.get(option.replace("_", "-")), launch.launcher, launch.where
    prog = {"accelerate": "accelerate launch", "deepspeed": "deepspeed --no_ssh"}.get(kind, kind)
    fix = f"srun bash -c '{prog} --{option} $SLURM_NODEID ...'" + (f", or use {other}" if other else "")
    if rank is None or launch.srun is None:
        return
    if "$" not in rank and nodes > 1:  # per task too: `bash -c "..."` in double quotes, a value set before srun
        findings.error("launcher-nodes-mismatch", f"{where}: every {kind} agent gets --{option}={rank}: the batch "
                       "shell expanded it once, before srun ($SLURM_NODEID and $SLURM_PROCID are 0 there), so the "
                       f"{nodes} agents claim the same node rank; let each task expand it: {fix}")
    elif not launch.per_task and re.fullmatch(r"\$\{?(" + "|".join(PER_TASK) + r")\}?", rank):
        findings.error("launcher-nodes-mismatch", f"{where}: {kind} gets the text --{option}={rank}, unexpanded "
                       f"(quoted: srun starts {kind} without a shell), and refuses it ('invalid int value', exit 2, "
                       f"on all {nodes} node(s)); let a shell in each task expand it: {fix}")


def deepspeed_workers(job: Job, launch: "LaunchLine", nodes: int, gpn: int | None, view: list[str], layout: dict,
                      findings: Findings):
    """deepspeed without a hostfile runs on its own node: --num_gpus, else every GPU it sees; --num_nodes > 1 is
    refused there (deepspeed/launcher/runner.py). A hostfile, --include or another --launcher decide themselves."""
    opts, where = launch.options, launch.where
    if "no-ssh" in opts:  # each node's deepspeed starts its own share, as --node_rank says (runner.py main)
        check_node_rank(launch, "node_rank", nodes, None, findings)
    if "hostfile" in opts or "include" in opts or (opts.get("launcher") or "pdsh").lower() != "pdsh":
        given = "a hostfile" if "hostfile" in opts else "--include or --launcher"
        layout["notes"].append(f"{where}: deepspeed with {given}: the nodes and processes it starts come from there, "
                               "not modelled")
        return False, None
    count = opts.get("num-gpus") or opts.get("num-accelerators")
    workers = whole_number(count or "") or (len(view) if gpn else None)
    asked = whole_number(opts.get("num-nodes") or "")
    if asked and asked > 1:
        findings.error("launcher-nodes-mismatch", f"{where}: deepspeed --num_nodes={asked} without a hostfile: it "
                       "refuses to start ('Num nodes is >1 but no extra nodes available via hostfile'); give it a "
                       "hostfile of the job's nodes, or launch one per node with srun and torchrun")
    elif nodes > 1 and "no-ssh" not in opts:
        findings.error("launcher-nodes-mismatch", f"{where}: srun starts deepspeed on {nodes} nodes without a "
                       f"hostfile: each one runs its own single-node training (master 127.0.0.1), {nodes} separate "
                       "jobs; give deepspeed a hostfile and start it once, or use srun with torchrun")
    return workers, None


def accelerate_workers(job: Job, launch: "LaunchLine", nodes: int, gpn: int | None, view: list[str], layout: dict,
                       findings: Findings):
    """accelerate launch: --num_processes over --num_machines machines (accelerate/commands/launch.py gives each
    machine num_processes // num_machines); without --num_processes its configuration file decides."""
    opts, where = launch.options, launch.where
    if (opts.get("rdzv-backend") or "static") == "static":  # passed to torchrun as --node_rank (launch.py)
        check_node_rank(launch, "machine_rank", nodes, "--rdzv_backend c10d", findings)
    procs, machines = opts.get("num-processes"), opts.get("num-machines") or "1"
    if whole_number(procs or "") is None or whole_number(machines) is None:
        layout["notes"].append(f"{where}: accelerate launch without a known --num_processes"
                               + (f" (--config_file {opts['config-file']})" if opts.get("config-file") else "")
                               + ": its configuration file decides the processes, not modelled")
        return False, None
    procs, machines = whole_number(procs), max(1, whole_number(machines))
    if procs % machines:
        findings.error("launcher-nodes-mismatch", f"{where}: accelerate --num_processes={procs} is not a multiple of "
                       f"--num_machines={machines}: it starts {procs // machines} per machine and the world size "
                       f"never adds up; use --num_processes={machines * (len(view) or procs // machines)}")
        return False, None
    return max(1, procs // machines), (machines, machines)


LAUNCHER_WORKERS = {"torchrun": torchrun_workers, "deepspeed": deepspeed_workers, "accelerate": accelerate_workers}


def nodes_expected(nnodes: str | None, standalone: bool) -> tuple[int, int] | None:
    """torchrun's --nnodes N or MIN:MAX (default 1:1) as (fewest, most) agents it runs with, None when unknown."""
    if standalone or nnodes is None:
        return 1, 1
    m = re.fullmatch(r"([0-9]+)(?::([0-9]+))?", nnodes)
    return (whole_number(m.group(1)), whole_number(m.group(2) or m.group(1))) if m else None


def node_cores(job: Job) -> int | None:
    ntype = node_type(job)
    return JEAN_ZAY[ntype].cores if ntype else None


def check_divisible(job: Job, gpn: int | None, tasks_per_node: list[int], training: Training,
                    findings: Findings) -> None:
    bound = bool(job.gpus_per_task) or re.sub(r"^verbose,", "", (job.gpu_bind or "none").lower()) != "none"
    if not gpn or bound or training.nb_part:
        return
    for tasks in sorted(set(tasks_per_node)):
        if tasks <= gpn and gpn % tasks:
            nb = gpn // tasks
            idle = list(range(nb * tasks, gpn))
            findings.error("gpus-not-divisible",
                           f"{gpn} GPUs per node are not divisible by {tasks} tasks per node: nb_part = "
                           f"{gpn} // {tasks} = {nb} and {len(idle)} GPU(s) ({','.join(map(str, idle))}) stay "
                           f"idle; use --ntasks-per-node in {choice_list(divisors(gpn))}")
            return


def check_node_usage(report: Report) -> None:
    """Two tasks of a node on one GPU, and GPUs nobody uses."""
    by_node: dict[int, list[TaskPlan]] = {}
    for p in report.tasks:
        by_node.setdefault(p.node, []).append(p)
    gpn = report.job.gpus_per_node
    seen: set[tuple] = set()
    for node, plans in sorted(by_node.items()):
        shape = tuple(tuple(p.node_gpus) for p in plans)
        if shape in seen:  # a node laid out like one already judged says nothing new
            continue
        seen.add(shape)
        owners: dict[str, list[int]] = {}
        for p in plans:
            for g in dict.fromkeys(p.node_gpus):  # a task's own parts may share a GPU (--devices 0,0)
                owners.setdefault(g, []).append(p.rank)
        shared = {g: r for g, r in owners.items() if len(r) > 1}
        if shared:
            g, r = sorted(shared.items())[0]
            fix = ("give each task its own GPUs, e.g. --gpu-bind=map_gpu:" + ",".join(
                       str(i * (gpn or 1) // len(plans)) for i in range(len(plans)))
                   if "map_gpu" in (report.job.gpu_bind or "") else
                   f"--gpu-bind={report.job.gpu_bind} puts {report.job.gpu_bind.split(':')[-1]} tasks on each GPU; "
                   "--gpu-bind=single:1 gives each task its own"
                   if "single:" in (report.job.gpu_bind or "").lower() else
                   f"--devices {','.join(map(str, report.training.devices))} names the same visible GPUs in every "
                   f"task: drop --devices (each task then takes its own nb_part GPUs), or run one task per node"
                   if report.training.devices else
                   f"use --nb-part <= {(gpn or 0) // len(plans)} or fewer tasks per node")
            report.findings.error("gpu-shared",
                                  f"node {node}: GPU {g} is used by tasks {', '.join(map(str, r))} "
                                  f"({len(shared)} GPU(s) shared in all); {fix}")
        if gpn and any(p.node_gpus for p in plans) and not any(f.code == "gpus-not-divisible"
                                                             for f in report.findings):
            idle = [str(i) for i in range(gpn) if str(i) not in owners]
            if idle:
                report.findings.warn("gpus-idle",
                                     f"node {node}: {len(idle)} of {gpn} GPU(s) stay idle ({','.join(idle)}) "
                                     f"({len(plans)} task(s) x nb_part {plans[0].nb_part}); choose "
                                     f"--ntasks-per-node in {choice_list(divisors(gpn))} without --nb-part")
                if len(by_node) > 1 and all(len(v) == len(plans) for v in by_node.values()):
                    break  # same layout everywhere: once is enough
        if shared and len(by_node) > 1:
            break
    dedupe_findings(report.findings)


def check_gpu_cgroups(job: Job, tasks_per_node: list[int], gpn: int | None, findings: Findings) -> None:
    if job.gpus_per_task and max(tasks_per_node) > 1:
        findings.warn("gpus-per-task-cgroup",
                      f"--gpus-per-task={job.gpus_per_task}: each task's GPUs sit in their own device cgroup, so "
                      f"NCCL in one task no longer sees the node's other {(gpn or 0) - job.gpus_per_task} GPU(s) and "
                      f"cannot detect NVLink between the {max(tasks_per_node)} tasks of a node (it falls back to "
                      f"slower paths; NVIDIA/nccl issue 1066); use the page's form: --gres=gpu:{gpn} "
                      f"--ntasks-per-node={max(tasks_per_node)}")


def note_page_indexing(report: Report) -> None:
    """Per-task GPU binding breaks the page's own indexing; say what it would have done."""
    for p in report.tasks:
        if not p.bound or p.tasks_on_node < 2:
            continue
        visible = p.visible
        nb, first, last = page_indexing(p.local_rank, p.tasks_on_node, visible)
        if nb < 1 or last >= visible or nb != p.nb_part:
            report.notes.append(
                f"per-task GPU binding: task {p.rank} sees only {visible} GPU(s); the page's own indexing "
                f"(nb_part = device_count() // {p.tasks_on_node} = {nb}, first_part = local_rank * nb_part = "
                f"{first}) would " + ("index past device_count()" if nb < 1 or last >= visible
                                      else f"use {nb} of its {visible} GPUs")
                + "; bench_ddp_transformer.py starts at visible GPU 0 and uses them all")
            return


def dedupe_findings(findings: Findings) -> None:
    seen, kept = set(), []
    for f in findings:
        key = (f.level, f.code)
        if key in seen and f.code in ("more-tasks-than-gpus", "gpu-index-past-visible"):
            continue
        seen.add(key)
        kept.append(f)
    findings[:] = kept


def check_memory(job: "Job", t: "Training", nb_part: int, replicas: int, tpn: int,
                 findings: Findings) -> str | None:
    """Refuse a split whose estimated peak exceeds the GPU's memory (and bf16 on V100s, which lack it); nb_part is
    --pp in the stage layout, replicas its pipelines. Returns the estimate's line for the report when it was made."""
    gib, source = gpu_memory(job)
    v100 = is_v100(job)
    if t.precision == "bf16" and v100:
        findings.error("bf16-on-v100", "--precision bf16 on V100 GPUs: V100s have no bf16; use --precision fp16 "
                       "(autocast with a GradScaler)")
    if t.tf32 and v100:
        findings.warn("tf32-on-v100", "--tf32 on V100 GPUs: TF32 tensor cores start with the A100 (compute "
                      "capability 8.0), so fp32 matmuls run as without it; for speed on a V100 use --precision fp16")
    if gib is None or nb_part < 1 or replicas < 1 or t.unknown:
        return None  # unknown GPU, or arguments the line leaves unknown (shell variables)
    model = model_args(t)
    stage = t.layout == "stage"
    arch = requested_arch(v100)[0]
    try:
        if t.model_spec:  # --model: its layers' figures composed with the same terms (model mode: torch)
            from kit.own_split import own_memory
            parts = own_memory(t, nb_part, replicas, arch)
        else:
            parts = (estimate_stage_memory(model, t, nb_part, replicas, arch, torch=torch_version_of(job.torch_module))
                     if stage else estimate_memory(model, t, nb_part, replicas, arch))
    except ValueError as exc:  # chunks/batch/schedule already reported by check_training and check_stage
        return f"memory estimate: none, {exc}" if isinstance(exc, NotEstimated) else None
    worst = max(parts, key=lambda m: m.total)
    line = format_memory(parts, gib) + f" ({source})"
    shared = shared_gpu_memory(parts, t.devices)
    if shared:  # --devices 0,0: the parts on one GPU add up (one CUDA context and allocator allowance between them)
        gpu, on_it, total = shared
        line += f"; GPU {gpu} holds parts {','.join(map(str, on_it))}: {total / GIB:.2f} GiB in all"
        if total / GIB > gib:
            findings.error("does-not-fit", f"--devices {','.join(map(str, t.devices))} puts parts "
                           f"{','.join(map(str, on_it))} on GPU {gpu}: an estimated {total / GIB:.1f} GiB in all, "
                           f"but the GPU has {gib:.1f} GiB ({source}); give each part its own GPU, or a smaller "
                           f"--batch-size or --activation-checkpointing")
            return line
    if worst.total / GIB <= gib:
        if worst.total / GIB > 0.9 * gib:
            findings.warn("memory-tight", f"{worst.unit} {worst.part} ({worst.contents}) is estimated at "
                          f"{worst.total / GIB:.1f} GiB of the {gib:.1f} GiB per GPU ({source}): little headroom")
        return line
    terms = " + ".join(f"{k} {v:.2f}" for k, v in worst.breakdown().items() if v >= 0.005)
    why = (f"--schedule {t.schedule} keeps at most {worst.alive} micro-batch(es) of {worst.per_micro_batch / GIB:.2f}"
           f" GiB alive on this task" if stage else
           f"activations are {worst.alive} micro-batch(es) of {worst.per_micro_batch / GIB:.2f} GiB, all alive: with "
           f"checkpoint=\"never\" GPipe keeps every micro-batch until its backward, so more --chunks do not help")
    if t.model_spec:
        from kit.own_split import own_fixes
        fixes = own_fixes(t, nb_part, replicas, arch, v100, gib)
    else:
        fixes = memory_fixes(model, t, nb_part, replicas, tpn, gib, v100, torch_version_of(job.torch_module))
    findings.error("does-not-fit",
                   f"{worst.unit} {worst.part} ({worst.contents}) needs an estimated {worst.total / GIB:.1f} GiB per "
                   f"GPU but the GPU has {gib:.1f} GiB ({source}); peak at {worst.peak_at}, GiB: {terms}; {why}. "
                   "Fixes, each estimated: " + "; ".join(fixes))
    return line

"""The report: the checker's text and --json output of a job's findings and its plan.
Owns: Report. Imports: kit.arguments, kit.bounded, kit.findings, kit.plan, kit.schedules, kit.slurm,
kit.trainer_checks.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from kit.arguments import Training
from kit.bounded import printable
from kit.findings import Findings
from kit.plan import TaskPlan, part_contents
from kit.slurm import Job
from kit.schedules import schedule
from kit.trainer_checks import choice_list


@dataclass
class Report:
    job: Job
    training: Training
    tasks: list[TaskPlan]
    findings: Findings
    notes: list[str] = field(default_factory=list)
    defaulted: set[str] = field(default_factory=set)  # the trainer's defaults the checker filled in (not the line's)
    steps: list["Report"] = field(default_factory=list)  # the script's later trainer lines, each planned (kit.steps)
    where: str | None = None  # the trainer's line this plan is for (file:line), where the script has several
    placed: list[int] = field(default_factory=list)  # srun's tasks per node (a launcher's agents, not its workers)

    @property
    def ok(self) -> bool:
        return not self.findings.errors

    @property
    def internal(self) -> bool:
        """A check failed unexpectedly (kit.findings.guarded): the checker exits 2."""
        return any(f.code == "internal-error" for f in self.findings)

    def plan_dict(self) -> dict:
        """The plan as --json gives it. Each task's fields are plain values and lists (vars() of the dataclass, not
        asdict's deep copy), its parts' contents computed once per shape: tens of thousands of tasks, on every
        trainer line of a script, stay well under a second."""
        contents: dict[tuple, list[str]] = {}
        tasks = []
        for t in self.tasks:
            shape = (t.nlayers, t.nb_part, id(t.own))
            if shape not in contents:
                contents[shape] = t.contents
            tasks.append(dict(vars(t), first_part=t.first_part, last_part=t.last_part, contents=contents[shape]))
        return {"where": self.where, "training": asdict(self.training), "tasks": tasks, "notes": self.notes}

    def as_dict(self) -> dict:
        job = asdict(replace(self.job, steps=[], elements=[], components=[]))
        job["components"] = [{"nodes": c.nodes, "ntasks": c.ntasks, "ntasks_per_node": c.ntasks_per_node,
                              "gpus_per_node": c.gpus_per_node, "partition": c.partition} for c in self.job.components]
        job["elements"] = [e.indices for e in self.job.elements]
        return {"ok": self.ok, "job": job, **{k: v for k, v in self.plan_dict().items() if k != "notes"},
                "steps": [s.plan_dict() for s in self.steps],
                "findings": [asdict(f) for f in self.findings], "notes": self.notes}

    def text(self) -> str:
        lines = [f"check_topology: {self.job.source}"] + self.plan_lines()
        for step in self.steps:
            lines += [f"  step {step.where}:"] + ["  " + line for line in step.plan_lines()]
        lines += [f"  note: {n}" for n in self.notes]
        if self.findings:
            lines += [f"  {f}" for f in self.findings]
        e, w = len(self.findings.errors), len(self.findings) - len(self.findings.errors)
        lines.append(f"  => {'OK' if self.ok else 'NOT OK'}: {e} error(s), {w} warning(s)")
        # what a line quotes from Slurm's answers or the script (a partition named with a terminal escape, a
        # million names) is printed without control characters and cut to kit.bounded.LINE_CHARS (issue 42)
        return "\n".join(printable(line) for line in lines)

    def plan_lines(self) -> list[str]:
        """The plan's table (or the launch lines' processes), and the allocation's cores and memory where per-GPU
        options size them."""
        j, t = self.job, self.training
        lines = []
        if j.cpus_per_gpu or j.mem_per_gpu:
            lines.append(allocation_line(j))
        if self.tasks:
            tpn = sorted({p.tasks_on_node for p in self.tasks})
            nbp = sorted({p.nb_part for p in self.tasks})
            nodes = len({p.node for p in self.tasks})
            gpn = j.gpus_per_node if j.gpus_per_node is not None else "?"
            what = (f"{len(self.tasks)} task(s) = {len(self.tasks) // max(t.pp, 1)} pipeline(s) x pp {t.pp} "
                    f"(stage layout, schedule {t.schedule})" if t.layout == "stage" else
                    f"{len(self.tasks)} task(s) = model replicas, nb_part {choice_list(nbp)}")
            lines.append(f"  {nodes} node(s) x {gpn} GPU(s), tasks per node {choice_list(tpn)} -> {what}, "
                         f"{t.nlayers} layers")
            lines.append(f"  {'task':>4} {'node':>4} {'local':>5}  {'GPUs (node ids)':16} {'.to() indices':14} "
                         "parts")
            shown = 0
            for p in self.tasks:
                if shown >= 16 and len(self.tasks) > 20:
                    lines.append(f"  ... {len(self.tasks) - shown} more task(s); --json lists them all")
                    break
                gpus = ",".join(p.node_gpus) if p.node_gpus else ("cpu" if p.cpu else "-")
                idx = ",".join(map(str, p.devices)) if p.devices else "-"
                if t.layout == "stage" and t.pp >= 2:  # a GPU per task, holding its stage(s) of a pipeline
                    row = schedule(t.schedule)
                    contents = p.own or part_contents(t.nlayers or 0, t.pp * row.stages_per_rank(t.virtual_stages))
                    ids = row.stages(p.rank % t.pp, t.pp, t.virtual_stages)  # --model: p.own, its split
                    parts = f"{p.device(0) if p.cpu or p.devices else '?'}: " + " | ".join(
                        f"stage {s}: {contents[s]}" for s in ids) + f"  (pipeline {p.rank // t.pp})"
                else:
                    parts = " | ".join(f"{(p.device(i) if p.cpu or i < len(p.devices) else '?')}: {c}"
                                       for i, c in enumerate(p.contents)) if p.nb_part else "-"
                lines.append(f"  {p.rank:>4} {p.node:>4} {p.local_rank:>5}  {gpus:16} {idx:14} {parts}")
                shown += 1
        if not self.tasks and j.trainer is None and not j.unplanned:
            lines.append(f"  {j.nodes or 1} node(s) x {j.gpus_per_node or 0} GPU(s)"
                         + (f", {j.ntasks_per_node} task(s) per node" if j.ntasks_per_node else "")
                         + (f", {j.cpus_per_task} CPU(s) per task" if j.cpus_per_task else ""))
        for x in j.launches if not self.tasks else []:
            lay = x.layout
            if lay.get("processes_per_node"):
                per = lay["processes_per_node"]
                lines.append(f"  {x.where}: {x.launcher if x.launcher != 'program' else 'srun'} {x.program}: "
                             f"{choice_list(per)} process(es) per node on {len(per)} node(s)"
                             + (f" ({choice_list(lay['agents_per_node'])} agent(s) per node)" if x.launcher in (
                                 "torchrun", "deepspeed", "accelerate") else "")
                             + (f", {lay['gpus_per_process']} GPU(s) each" if lay.get("gpus_per_process") else ""))
        return lines


def allocation_line(j: Job) -> str:
    """What --cpus-per-gpu and --mem-per-gpu give each node, as Slurm computes it (kit.placement.allocation_cores)."""
    gpus = j.gpus_per_node or 0
    cores = f"{choice_list(sorted(set(j.cores_per_node)))} core(s)" if j.cores_per_node else "cores not known"
    memory = f", {j.mem_per_gpu * gpus / 1024:g} GiB (--mem-per-gpu x {gpus} GPU(s))" if j.mem_per_gpu and gpus else ""
    return f"  allocation per node: {cores}" + (f" (--cpus-per-gpu={j.cpus_per_gpu} x {gpus} GPU(s), or the tasks' "
                                                "cores where more)" if j.cpus_per_gpu else "") + memory

"""The report: the checker's text and --json output of a job's findings and its plan.
Owns: Report. Imports: kit.arguments, kit.findings, kit.plan, kit.schedules, kit.slurm, kit.trainer_checks.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kit.arguments import Training
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

    @property
    def ok(self) -> bool:
        return not self.findings.errors

    def as_dict(self) -> dict:
        return {
            "ok": self.ok, "job": asdict(self.job), "training": asdict(self.training),
            "tasks": [dict(asdict(t), first_part=t.first_part, last_part=t.last_part, contents=t.contents)
                      for t in self.tasks],
            "findings": [asdict(f) for f in self.findings], "notes": self.notes,
        }

    def text(self) -> str:
        j, t = self.job, self.training
        lines = [f"check_topology: {j.source}"]
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
        lines += [f"  note: {n}" for n in self.notes]
        if self.findings:
            lines += [f"  {f}" for f in self.findings]
        e, w = len(self.findings.errors), len(self.findings) - len(self.findings.errors)
        lines.append(f"  => {'OK' if self.ok else 'NOT OK'}: {e} error(s), {w} warning(s)")
        return "\n".join(lines)

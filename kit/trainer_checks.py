"""The trainers' checks of their arguments (the same functions the checker calls, so the trainers'
refusals are the checker's findings) and the trainers' --check-args.
Owns: divisors, the stage layout's rules (a schedule's own: kit.schedules), the bubble. Imports: kit.arguments,
kit.findings, kit.plan, kit.releases, kit.schedules.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Iterable, Sequence

import idr_torch
from kit.arguments import (ArgumentError, ENGINES, GPU_DEFAULTS, SCRIPTS, Training, model_args, parse_trainer_args,
    resolve_defaults, training_from_args)
from kit.findings import Findings, refusal_text
from kit.plan import TaskPlan, part_sizes, plan_task
from kit.releases import torch_refusals
from kit.schedules import SCHEDULES, UnknownSchedule, schedule


def choice_list(values: Iterable[int]) -> str:
    values = sorted(set(values))
    if not values:
        return "none"
    return ", ".join(map(str, values[:-1])) + (" or " if len(values) > 1 else "") + str(values[-1])


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_arguments(t: Training, cpu: bool = False) -> Findings:
    """The trainers' refusals that need several arguments at once, on the values the trainer runs (the line's, else
    the GPU or CPU defaults). One function for the trainers and the checker: check_training calls it. Each value's
    own type and range are the definition's (Arg.convert, in read_trainer_argv)."""
    findings = Findings()
    if t.resume and not t.save and t.known("save"):
        findings.error("bad-argument", "--resume continues from the --save file, and no --save was given: add --save "
                       "PATH (the templates use --save NAME.pt --resume), or start from a file with --load PATH")
    if not t.model_spec and (t.sample is not None or t.split != "even") and t.known("model_spec"):
        findings.error("bad-argument", "--sample and --split go with --model FILE.py:function (the kit's own "
                       "Transformer has its own split): add --model, or leave them out")
    if t.model_spec:
        return findings  # the d_model / n_head rules below are the kit's Transformer's, not a --model's
    model = model_args(t, cpu)
    d, h = model["d_model"], model["n_head"]
    if not t.known("d_model", "n_head") or d < 1 or h < 1:
        return findings
    if d % h:
        findings.error("bad-argument", f"--d-model ({d}) must be a multiple of --n-head ({h}): each head gets "
                       f"d_model / n_head dimensions; try --n-head {max(x for x in divisors(d) if x <= h)}")
    if d % 2:
        step = h * 2 // math.gcd(h, 2)
        findings.error("bad-argument", f"--d-model ({d}) must be even (the positional encoding takes sines and "
                       f"cosines in pairs); try --d-model {(d // step + 1) * step}")
    return findings


def check_training(nb_part: int, t: Training, findings: Findings, cpu: bool = False) -> None:
    """The model and batch against the split: check_arguments, layers per part, chunks per batch. What the line
    leaves unknown (a shell variable: t.unknown) is not judged, and no default is judged in its place."""
    findings.extend(check_arguments(t, cpu))
    model = model_args(t, cpu)  # the trainer's defaults where the line gives nothing
    nlayers, chunks, batch = model["nlayers"], model["chunks"], model["batch_size"]
    if nb_part >= 1 and t.known("nlayers", "nb_part") and not t.model_spec:  # --model: kit.own_split's own rule
        if nlayers < nb_part:
            findings.error("nlayers-below-nb-part",
                           f"--nlayers={nlayers} < nb_part={nb_part}: {nb_part - nlayers} GPU(s) of each task would "
                           f"hold no Layer block (idle); use --nlayers >= {nb_part} or fewer GPUs per task "
                           f"(more --ntasks-per-node, or --nb-part {max(1, nlayers)})")
        elif nlayers % nb_part:
            sizes = part_sizes(nlayers, nb_part)
            more = [p for p, n in enumerate(sizes) if n > min(sizes)]
            which = (f"parts {', '.join(map(str, more[:-1]))} and {more[-1]} get" if len(more) > 1
                     else f"part {more[0]} gets")
            findings.warn("nlayers-not-multiple",
                          f"--nlayers={nlayers} is not a multiple of nb_part={nb_part}: {which} "
                          f"{max(sizes)} layers, the others {min(sizes)} (layers per part {sizes}); the slowest "
                          f"part sets the pace: try --nlayers {nlayers - nlayers % nb_part} or "
                          f"{nlayers + nb_part - nlayers % nb_part}")
    if not t.known("chunks", "batch_size"):
        pass
    elif chunks < 1 or batch < 1:
        findings.error("bad-value", f"--chunks ({chunks}) and --batch-size ({batch}) must be positive")
    elif chunks > batch:
        findings.error("chunks-above-batch",
                       f"--chunks={chunks} is larger than the batch size per replica ({batch}): micro-batches "
                       f"would be empty; use --chunks <= {batch}")
    elif batch % chunks:
        near = sorted(divisors(batch), key=lambda d: (abs(d - chunks), d))[:2]
        findings.error("chunks-not-dividing-batch",
                       f"--chunks={chunks} must divide the batch size per replica ({batch}): the micro-batches "
                       f"would differ in size; try --chunks {choice_list(near)}")
    if t.known("engine") and t.engine not in ENGINES:
        findings.error("bad-engine", f"--engine={t.engine!r} is not one of {', '.join(ENGINES)}")
    if t.layout == "stage" and t.precision == "fp16" and t.known("precision"):
        findings.error("fp16-stage", "--precision fp16 needs a GradScaler around backward, but the stage layout's "
                       "schedules (torch.distributed.pipelining) run backward themselves; use --precision bf16, or "
                       "fp16 with bench_ddp_transformer.py (the replica layout)")


def check_stage(world: int, tasks_per_node: list[int], gpus_per_node: int | None, t: Training,
                findings: Findings, cpu: bool = False) -> int:
    """The stage layout (bench_stage.py): a task per GPU, pipelines of --pp consecutive tasks. Returns the stages per
    pipeline (0 where the line leaves the pipelines unknown: nothing that depends on them is judged)."""
    pp, chunks = t.pp, model_args(t, cpu)["chunks"]
    try:
        row = schedule(t.schedule)
    except UnknownSchedule:
        row = None
        if t.known("schedule"):
            findings.error("bad-schedule", f"--schedule {t.schedule!r} is not one of {', '.join(SCHEDULES)}")
    v = row.stages_per_rank(t.virtual_stages) if row else 1
    if not t.known("pp", "schedule", "virtual_stages"):
        return 0
    if pp < 2:
        findings.error("pp-too-small", f"--pp {pp}: a pipeline needs at least 2 stages; for pure data parallel "
                       "use bench_ddp_transformer.py --nb-part 1")
        return max(pp, 1) * v
    if world < pp:
        findings.error("pp-not-dividing-world", f"--pp {pp} needs at least {pp} tasks, one per stage (got {world}); "
                       f"launch {pp} or a multiple of {pp} (srun -n, torchrun --nproc-per-node)")
        return pp * v
    if world % pp:
        findings.error("pp-not-dividing-world", f"--pp {pp} must divide the world size ({world} tasks) into whole "
                       f"pipelines; try --pp {choice_list(d for d in divisors(world) if d > 1)}")
    if gpus_per_node:
        for n in sorted(set(tasks_per_node)):
            if n < gpus_per_node:
                findings.warn("gpus-idle", f"{n} task(s) per node for {gpus_per_node} GPUs: the stage layout runs a "
                              f"task per GPU, {gpus_per_node - n} stay idle; use --ntasks-per-node={gpus_per_node}")
                break
    if any(n % pp for n in tasks_per_node):
        findings.warn("pipeline-spans-nodes", f"--pp {pp} does not divide the {choice_list(tasks_per_node)} tasks per "
                      f"node: some pipelines cross nodes and send activations over the network at every "
                      f"micro-batch; choose --pp in {choice_list(d for d in divisors(min(tasks_per_node)) if d > 1)}")
    if not t.known("chunks") or row is None:
        return pp * v
    row.check(pp, chunks, t.virtual_stages, findings)  # the schedule's own rules (kit.schedules)
    return pp * v


def bubble(nb_part: int, chunks: int) -> float:
    """GPipe's idle fraction: (nb_part - 1) / (chunks + nb_part - 1)."""
    return (nb_part - 1) / (chunks + nb_part - 1)


def check_bubble(nb_part: int, t: Training, findings: Findings) -> None:
    """GPipe's bubble: with K parts and M micro-batches each GPU idles (K-1)/(M+K-1) of a step; GPipe's paper
    (Huang et al. 2019, sec. 2.3) finds it negligible when M >= 4 x K."""
    chunks = t.chunks if t.chunks is not None else GPU_DEFAULTS["chunks"]
    batch = t.batch_size if t.batch_size is not None else GPU_DEFAULTS["batch_size"]
    if nb_part < 2 or chunks < 1 or chunks >= 4 * nb_part or not t.known("chunks", "batch_size", "nb_part"):
        return
    idle = bubble(nb_part, chunks)
    need = 4 * (nb_part - 1) + 1  # the fewest chunks that bring the bubble under 20 %
    fits = [d for d in divisors(batch) if d >= need] if batch >= 1 else []
    fix = (f"--chunks {fits[0]} ({bubble(nb_part, fits[0]):.0%})" if fits else
           f"--chunks {need} or more, with a batch size it divides")
    findings.warn("pipeline-bubble",
                  f"--chunks={chunks} is below 4 x nb_part = {4 * nb_part}: the pipeline bubble keeps each GPU idle "
                  f"(nb_part-1)/(chunks+nb_part-1) = {nb_part - 1}/{chunks + nb_part - 1} = {idle:.0%} of every "
                  f"step; {fix} brings it under 20 %")


def check_trainer_task(layout: str, values: argparse.Namespace, plan: TaskPlan, launch: idr_torch.Launch,
                       cuda: bool, torch_version: str, findings: Findings) -> None:
    """What a trainer refuses before it builds anything, given its arguments (defaults filled) and this task's
    plan: the pipelines (stage layout), the model and batch against the split (check_training, which runs
    check_arguments), and what this torch release lacks. The trainers' make_plan and their --check-args call it."""
    t = training_from_args(values, layout)
    if layout == "stage":
        parts = check_stage(launch.size, launch.tasks_per_node, launch.gpus_on_node, t, findings, cpu=not cuda)
    else:
        parts = plan.nb_part
    check_training(parts, t, findings, cpu=not cuda)
    for line in torch_refusals(torch_version, t, cpu=not cuda):  # what this release lacks
        findings.error("torch-release", line)


def visible_gpus_here(launch: idr_torch.Launch) -> list[str]:
    """The GPUs this task would use, found without torch: CUDA_VISIBLE_DEVICES (Slurm sets it for --gres and
    --gpus*), else the node's /dev/nvidiaN devices, which CUDA enumerates when nothing restricts it."""
    if launch.cuda_visible_devices is not None:
        return launch.visible_gpus
    return [str(i) for i in range(sum(1 for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)))]


def installed_torch_version() -> str | None:
    """The release of the torch the trainer would import, read without importing it: its torch/version.py, else
    its package metadata; None where there is no torch."""
    import importlib.metadata
    import importlib.util
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    version = Path(spec.origin).parent / "version.py"
    m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", version.read_text(), re.M) if version.is_file() else None
    try:
        return m.group(1) if m else importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_args(layout: str, argv: Sequence[str], environ: dict[str, str] | None = None
               ) -> tuple[int, Findings, TaskPlan | None]:
    """Judge a trainer's line as the trainer does before it touches a GPU: this task's plan from the launcher's
    environment (idr_torch, whose LaunchError it raises as the trainer does), GPU or CPU defaults from the GPUs it
    sees, the torch release installed. Returns the trainer's exit status (0; 1: a refusal; 2: a line its argparse
    refuses), what it says, and the plan."""
    try:
        values = parse_trainer_args(layout, argv)
    except ArgumentError as exc:
        return 2, exc.findings, None
    findings = Findings()
    launch = idr_torch.Launch(environ) if environ is not None else idr_torch.current()
    launch.master_port  # noqa: B018 -- idr_torch's rule for MASTER_PORT (1..65535), which the trainer's rendezvous reads
    version = installed_torch_version()
    if version is None:
        findings.error("torch-release", "torch is not installed for this python: load the cluster's PyTorch module "
                       "(module load pytorch-gpu/py3/...) or pip install torch")
        return 1, findings, None
    visible = visible_gpus_here(launch)
    resolve_defaults(values, cuda=bool(visible))
    plan = plan_task(launch.rank, launch.node_id, launch.local_rank, launch.local_world_size, visible,
                     launch.gpus_on_node, values.nlayers, 1 if layout == "stage" else values.nb_part, findings,
                     getattr(values, "devices", None))
    check_trainer_task(layout, values, plan, launch, bool(visible), version, findings)
    return (1 if findings.errors else 0), findings, plan


def check_args_main(layout: str, argv: Sequence[str], environ: dict[str, str] | None = None) -> int:
    """A trainer's --check-args: check_args, printed as the trainer prints (warnings and the verdict from rank 0,
    a launcher error from every rank), and its exit status. No torch import: it takes a tenth of a second."""
    prog = SCRIPTS[layout].removesuffix(".py")
    first = idr_torch.env_rank(environ) in (0, None)  # as the trainer's cli()
    try:
        status, findings, plan = check_args(layout, argv, environ)
    except idr_torch.LaunchError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    if first:
        for f in findings:
            if f.level != "error":
                print(f"check_topology: {f}", flush=True)
    if status:
        if first:
            print(f"{prog}: error: {refusal_text(findings.errors)}", file=sys.stderr, flush=True)
    elif first:
        where = f"GPUs {','.join(plan.node_gpus)}" if plan.node_gpus else "the CPU"
        print(f"{prog}: --check-args: task {plan.rank} would start: {plan.nb_part} part(s) on {where}, "
              f"{'CPU' if plan.cpu else 'GPU'} defaults", flush=True)
    return status

#!/usr/bin/env python
"""Pre-flight check of a hybrid pipeline + data parallel job, and the plan the trainer runs.

    python check_topology.py slurm/page_3nodes_4gpus.slurm        # before sbatch: #SBATCH header + srun line
    python check_topology.py their_megatron_job.slurm             # any job script: the Slurm and Jean Zay layer
    python check_topology.py --nodes 3 --gpus-per-node 4 --ntasks-per-node 2 --nlayers 8    # planning
    python check_topology.py --nlayers 8 --chunks 4                # in a batch script: the allocation itself
    srun python check_topology.py --nlayers 8 --chunks 4           # every task checks what it really sees
    python check_topology.py --advise --nodes 2 -C v100-32g --global-batch 512 --profile profile.json
                                                                   # every split that fits, fastest predicted first

Layout of the page: one task per model replica; nb_part = GPUs per node // tasks per node; task `local_rank`
owns GPUs first_part = local_rank * nb_part ... last_part = first_part + nb_part - 1. When Slurm binds GPUs per
task (--gpus-per-task, --gpu-bind) a task sees only its own GPUs, so its plan starts at visible GPU 0.
Layers: a balanced contiguous split, the page's own split whenever nlayers % nb_part == 0; Encoder on the first
part, Decoder on the last.

Exit status: 0 clean (warnings allowed), 1 errors found, 2 usage error or unreadable file.
This file is the checker's command line; the checks live in the kit/ folder beside it (docs/architecture.md):
kit.jobscript reads a job script (through kit.shell), kit.checks judges it with kit.slurm, kit.placement and
kit.site, and the trainers build their model from kit.plan, so what this approves is what runs.
No torch import on this path: checking a file must stay well under a second on a login node.
How it reads scripts, and the sources of its rules: docs/checker.md.
"""
from __future__ import annotations

import argparse
import json
import re
import sys

try:
    import idr_torch
    from kit import site_slurm
    from kit.advise import advise_main
    from kit.allocation import check_in_step, gpus_memory_here, job_from_allocation
    from kit.arguments import (ARGS, SCRIPTS, ArgumentError, Training, add_options, below_one_message, given_values,
        set_values, unknown_option)
    from kit.checks import check_job
    from kit.findings import UsageError
    from kit.jobscript import read_sbatch
    from kit.site import JEAN_ZAY_DATE
    from kit.slurm import COUNT_LIMITS, Job
except ImportError as exc:  # copied alone: the kit is a folder (README, "On the cluster")
    sys.exit(f"check_topology.py: {exc}: copy the kit's whole folder (check_topology.py, idr_torch.py and kit/), "
             "e.g. `cp -r hybrid-kit $WORK/`")


CHECKED = [a for a in ARGS if a.checked]  # the trainers' arguments the checker's own command line takes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(  # no abbreviations, as in the trainers (kit.arguments)
        prog="check_topology.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        epilog="Exit status: 0 clean (warnings allowed), 1 errors, 2 usage error or unreadable file.")
    p.add_argument("sbatch_file", nargs="?", help="an sbatch script to check before submitting it")
    plan = p.add_argument_group("planning without a cluster")
    plan.add_argument("--nodes", "-N", type=int)
    plan.add_argument("--gpus-per-node", type=int)
    plan.add_argument("--ntasks-per-node", type=int)
    plan.add_argument("--ntasks", "-n", type=int)
    plan.add_argument("--gpus-per-task", type=int)
    plan.add_argument("--gpu-bind")
    plan.add_argument("--cpus-per-task", "-c", type=int)
    plan.add_argument("--partition", "-p")
    plan.add_argument("--constraint", "-C")
    train = p.add_argument_group("the trainer's arguments (over those of an sbatch file's trainer line; the "
                                 "trainers' own definition: same names, ranges and defaults, docs/arguments.md)")
    train.add_argument("--layout", choices=("replica", "stage"),
                       help="plan bench_ddp_transformer.py (replica, the default) or bench_stage.py (stage)")
    add_options(train, CHECKED, lambda a: f" [{SCRIPTS[a.layouts[0]]}]" if len(a.layouts) == 1 else "")
    mem = p.add_argument_group("will it fit? (the GPU's memory)")
    mem.add_argument("--gpu-mem", type=float, metavar="GiB",
                     help="memory of one GPU (default: from -C/-p, or the allocation's GPUs)")
    mem.add_argument("--advise", action="store_true",
                     help="list every split of --nodes x --gpus-per-node that fits, for --global-batch")
    mem.add_argument("--global-batch", help="--advise: samples per step over all replicas (several: 256,512)")
    mem.add_argument("--profile", metavar="FILE", help="--advise: rank the splits by the samples/s predicted from "
                     "this profile (benchmarks/speed_profile.py, taken in the allocation: docs/speed.md)")
    mem.add_argument("--top", type=int, metavar="K", help="--advise: the first K splits only")
    mem.add_argument("--commands", action="store_true", help="--advise: each split as the line that runs it: "
                     "tasks per node, the trainer, its arguments (the sweep's predict mode reads them)")
    p.add_argument("--site", choices=("auto", "live", "jean-zay", "none"), default="auto",
                   help="whose account, QoS and time rules judge the job: live (Slurm's configuration here: "
                        "scontrol, sacctmgr), jean-zay (the dated table), none; auto (the default): live where Slurm "
                        "answers within kit/site_slurm.py's deadline, else the table")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p

PLANNING = ("nodes", "gpus_per_node", "ntasks_per_node", "ntasks", "gpus_per_task", "gpu_bind", "cpus_per_task",
            "partition", "constraint")


def planning_counts(args: argparse.Namespace) -> None:
    """The planning flags' counts within what a node and Jean Zay have (COUNT_LIMITS), in one line; --advise's own
    flags only with --advise."""
    if (args.profile or args.top is not None or args.commands) and not args.advise:
        raise UsageError("--profile, --top and --commands go with --advise, e.g. --advise --profile profile.json "
                         "--nodes 2 --gpus-per-node 4 --gpu-mem 32 --global-batch 256")
    for name in ("nodes", "gpus_per_node", "ntasks_per_node", "ntasks", "gpus_per_task", "cpus_per_task"):
        flag = name.replace("_", "-")
        value = getattr(args, name, None)
        if value is not None and value > COUNT_LIMITS[flag]:
            raise UsageError(f"--{flag} {value} is more than any Jean Zay node or partition has (the checker plans "
                             f"up to {COUNT_LIMITS[flag]}); give what the nodes have")


def override(args: argparse.Namespace, t: Training) -> Training:
    """The trainer's arguments given on the checker's command line, over those of the sbatch file's trainer line,
    read with the trainers' definition (the same ranges, in the same words). They say what the line's shell
    variables hold: nothing is left unknown, and what they do not give is the trainer's default."""
    try:
        given = given_values(args, CHECKED)
    except ArgumentError as exc:
        raise UsageError(str(exc)) from None
    set_values(t, given)
    if args.layout is not None:
        t.layout = args.layout
    if given:
        t.unknown = []
    return t  # nlayers left None: check_job / task_facts take the trainer's default for GPU or CPU


def use_site(job: Job, choice: str) -> str:
    """Sets whose rules judge the job's account, QoS and time (--site); returns the report's note saying which."""
    if choice in ("auto", "live"):
        facts = site_slurm.site_facts()  # None where Slurm's commands are absent or don't answer in time
        if facts is not None:
            job.site_rules, job.site = "live", facts
            qos = (f"{len(facts.qos)} QoS and your {len(facts.assocs)} association(s)" if facts.accounting else
                   "no accounting (no QoS or association limits)")
            return (f"site rules: Slurm's configuration here ({facts.cluster}, Slurm {facts.version}: "
                    f"{len(facts.partitions)} partitions, {qos}; read in {facts.read_seconds:.2f} s)")
        if choice == "live":
            raise UsageError(f"--site live: Slurm does not answer here (scontrol absent, or no answer within "
                             f"{site_slurm.READ_SECONDS:g} s); or use --site jean-zay (the dated table) or --site none")
    job.site_rules = "none" if choice == "none" else "jean-zay"
    return ("site rules: none (--site none): Slurm's own behaviour only, no account, QoS or time limit judged"
            if choice == "none" else f"site rules: Jean Zay's documented table of {JEAN_ZAY_DATE}"
            + (" (Slurm does not answer here)" if choice == "auto" else ""))


def advise(args: argparse.Namespace, training: Training) -> int:
    """--advise: the kit's Transformer's splits (kit.advise), or with --model the user's layers' (kit.own_model:
    torch, in this mode only)."""
    if training.model_spec:
        from kit.own_model import checker_advise
        return checker_advise(args, training)
    return advise_main(args, training)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
    if extras:  # what argparse would refuse, with the did-you-mean the trainers give
        flags = re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", parser.format_usage())
        print(f"check_topology: {unknown_option(extras[0], flags, 'check_topology.py')}" if extras[0].startswith("-")
              else f"check_topology: unexpected {extras[0]!r}: give one sbatch file at most", file=sys.stderr)
        return 2
    training = Training()
    try:
        if args.gpu_mem is not None and args.gpu_mem <= 0:
            raise UsageError(f"--gpu-mem {args.gpu_mem:g} must be a positive number of GiB, e.g. --gpu-mem 32")
        planning_counts(args)
        if args.advise:
            return advise(args, override(args, training))
        planning = any(getattr(args, k) is not None for k in PLANNING)
        if args.sbatch_file:
            if planning:
                raise UsageError("give either an sbatch file or planning flags (--nodes ...), not both")
            job, training, findings = read_sbatch(args.sbatch_file)
            job.gpu_mem, note = args.gpu_mem, use_site(job, args.site)
            report = check_job(job, override(args, training))
            report.findings[:0] = findings
            report.notes.append(note)
        elif planning:
            missing = [f"--{k.replace('_', '-')}" for k in ("nodes", "gpus_per_node") if getattr(args, k) is None]
            if missing and not (args.gpus_per_task and args.nodes):
                raise UsageError(f"planning needs {' and '.join(missing)} (and --ntasks-per-node), e.g. "
                                 "--nodes 3 --gpus-per-node 4 --ntasks-per-node 2")
            bad = below_one_message({k: getattr(args, k) for k in PLANNING})
            if bad:
                raise UsageError(bad)
            job = Job(**{k: getattr(args, k) for k in PLANNING}, gpu_mem=args.gpu_mem)
            job.source = (f"plan: {args.nodes} node(s) x {args.gpus_per_node or '?'} GPU(s), "
                          f"--ntasks-per-node={args.ntasks_per_node}")
            report = check_job(job, override(args, training))
            # planning flags describe the layout, not the cores, hint or time limit: don't nag about those
            report.findings[:] = [f for f in report.findings
                                  if f.code not in ("cpus-per-task-missing", "hint-missing", "time-missing")]
        else:
            launch = idr_torch.Launch()
            if launch.launcher == "slurm":
                report, code = check_in_step(launch, override(args, training), args.gpu_mem)
                if report is None:
                    return code
            elif launch.job_id:
                job = job_from_allocation(launch.env)
                job.gpu_mem, job.gpu_mem_seen = args.gpu_mem, gpus_memory_here()
                report = check_job(job, override(args, training))
            else:
                raise UsageError("nothing to check: give an sbatch file, planning flags (--nodes 3 --gpus-per-node 4 "
                                 "--ntasks-per-node 2), or run me inside a Slurm allocation")
    except (UsageError, idr_torch.LaunchError) as exc:
        print(f"check_topology: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=1) if args.json else report.text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

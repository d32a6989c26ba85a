"""--advise: every split that fits, ranked by the samples/s a profile predicts (or by memory without one); and a
user's model's splits (kit.own_model --advise), ranked by a FLOPs proxy.
Owns: the advice table. Imports: kit.arguments, kit.findings, kit.layer_memory, kit.memory, kit.model, kit.releases,
kit.schedules, kit.site, kit.slurm, kit.speed, kit.trainer_checks.
"""
from __future__ import annotations

import argparse
import json
import shlex

from kit.arguments import SCRIPTS, SPLITS, Training, model_args, show_value
from kit.findings import Findings, UsageError
from kit.layer_memory import estimate_peaks
from kit.memory import GIB, requested_arch, worst_part
from kit.model import Model
from kit.releases import torch_refusals
from kit.schedules import SCHEDULES
from kit.schedules import schedule as schedule_row
from kit.site import JEAN_ZAY, gpu_memory, is_v100, node_type
from kit.slurm import Job
from kit.speed import (PROFILE_MODEL, ProfileError, SPEED_TERMS, predict_speed, profile_gpu_mismatch, profile_mismatch,
    read_profile, schedule_bubble)
from kit.trainer_checks import bubble, divisors


def stage_schedule(version: str | None, cpu: bool = False) -> tuple[str | None, str | None]:
    """The schedule --advise gives the stage layout's rows, and why where it is not 1f1b (GPipe holds every
    micro-batch for the same bubble): gpipe where this torch refuses 1f1b (on gloo before 2.8), None where it has
    no stage layout at all (before 2.4). Without a release (no profile) 1f1b."""
    if version is None or not torch_refusals(version, Training(layout="stage", schedule="1f1b"), cpu):
        return "1f1b", None
    refused = torch_refusals(version, Training(layout="stage", schedule="gpipe"), cpu)
    if refused:
        return None, f"no stage layout rows: {refused[0]}"
    return "gpipe", ("stage layout rows run --schedule gpipe: "
                     + torch_refusals(version, Training(layout="stage", schedule="1f1b"), cpu)[0])


def stage_schedules(version: str, cpu: bool = False) -> list[str]:
    """Every schedule of kit.schedules that this release runs on this device (TORCH_FEATURES, the rows' first
    releases): what --advise ranks beside the splits when a profile predicts their speed."""
    return [n for n in SCHEDULES if not torch_refusals(version, Training(layout="stage", schedule=n), cpu)]


def _accepts(name: str, pp: int, chunks: int) -> bool:
    """The schedule's own rules (kit.schedules) on this pipeline, at the default 2 stages a task."""
    findings = Findings()
    schedule_row(name).check(pp, chunks, 2, findings)
    return not findings.errors


def advise(nodes: int, gpn: int, gib: float, model: dict, global_batch: int, v100: bool,
           max_chunks: int = 32, schedule: str | tuple[str, ...] | None = "1f1b") -> list[dict]:
    """Every split of `nodes` x `gpn` GPUs that fits in `gib` per GPU at this global batch, in both layouts (the
    page's replicas; bench_stage.py's pipelines with `schedule`, stage_schedule's, or each of several that accepts
    the split, none where it is None), sorted by fewest GPUs per replica or pipeline, then by bubble."""
    schedules = (schedule,) if isinstance(schedule, str) else tuple(schedule or ())
    rows = []
    arch, low = requested_arch(v100)
    for tpn in divisors(gpn):
        nb_part, replicas = gpn // tpn, nodes * tpn
        if global_batch % replicas or model["nlayers"] < nb_part:
            continue
        batch = global_batch // replicas
        for chunks in ([1] if nb_part == 1 else [c for c in divisors(batch) if c <= max_chunks]):
            rows += _advise_rows("replica", dict(model, batch_size=batch, chunks=chunks), nb_part, replicas, tpn,
                                 ("fp32", low), gib, arch)
    for pp in [p for p in divisors(gpn) if p > 1 and model["nlayers"] >= p and schedules]:
        replicas = nodes * gpn // pp
        if global_batch % replicas:
            continue
        batch = global_batch // replicas
        for chunks in [c for c in divisors(batch) if pp <= c <= max_chunks]:
            for name in [n for n in schedules if _accepts(n, pp, chunks)
                         and model["nlayers"] >= pp * schedule_row(n).stages_per_rank(2)]:
                rows += _advise_rows("stage", dict(model, batch_size=batch, chunks=chunks), pp, replicas, gpn,
                                     ("fp32",) if v100 else ("fp32", low), gib, arch, name)
    return sorted(rows, key=lambda r: (r["nb_part"], r["bubble"], r["peak_gib"], r["layout"]))


def _advise_rows(layout: str, m: dict, nb_part: int, replicas: int, tpn: int, precisions: tuple[str, ...],
                 gib: float, arch: str, schedule: str = "1f1b") -> list[dict]:
    """The options of one split that fit, as --advise rows (nb_part is --pp in the stage layout)."""
    rows = []
    for precision in precisions:
        for ckpt in (False, True):
            for zero in ((False, True) if replicas > 1 else (False,)):
                t = Training(layout=layout, pp=nb_part, schedule=schedule, precision=precision,
                             activation_checkpointing=ckpt, zero=zero)
                worst = worst_part(m, t, nb_part, replicas, arch)
                peak = worst.total / GIB
                if peak <= gib:
                    rows.append(dict(ntasks_per_node=tpn, nb_part=nb_part, replicas=replicas,
                                     batch_size=m["batch_size"], chunks=m["chunks"], precision=precision,
                                     activation_checkpointing=ckpt, zero=zero, peak_gib=round(peak, 2),
                                     bubble=round(schedule_bubble(schedule, nb_part, m["chunks"]) if layout
                                                  == "stage" else bubble(nb_part, m["chunks"]), 3), layout=layout,
                                     schedule=schedule if layout == "stage" else "gpipe", peak_at=worst.peak_at))
    return rows


def advise_text(rows: list[dict], nodes: int, gpn: int, gib: float, source: str, global_batch: int,
                profile: dict | None = None, schedule_note: str | None = None) -> str:
    ranked = (f"fastest first, by the samples/s predicted from the profile ({profile['key']['gpu']}, torch "
              f"{profile['key']['torch']}, taken {profile.get('taken', '?')}; terms in ms per step)" if profile else
              "fewest GPUs per replica (or pipeline) first, then by bubble (no speed is predicted without "
              "--profile FILE: benchmarks/speed_profile.py takes one in a minute, docs/speed.md)")
    lines = [f"check_topology --advise: {nodes} node(s) x {gpn} GPU(s) of {gib:.1f} GiB ({source}), global batch "
             f"{global_batch}: {len(rows)} split(s) shown that fit, {ranked}; layout replica is "
             "bench_ddp_transformer.py (nb_part GPUs a task), stage is bench_stage.py (a task a GPU, nb_part = --pp)",
             f"  {'layout':7} {'schedule':21} {'tasks/node':>10} {'nb_part':>7} {'replicas':>8} {'batch':>5} {'chunks':>6} "
             f"{'precision':9} {'ckpt':4} {'zero':4} {'peak GiB':>8} {'bubble':>6}"
             + (f" {'samples/s':>9}  compute / bubble / per-micro-batch / communication / optimizer" if profile
                else "")]
    for r in rows:
        speed = ""
        if profile:
            terms = r.get("terms_ms")
            speed = (f" {r['samples_per_s']:>9.1f}  " + " / ".join(f"{terms[k]:.1f}" for k in SPEED_TERMS)
                     if terms else f" {'-':>9}  {r.get('why', '')}")
        lines.append(f"  {r['layout']:7} {r['schedule']:21} {r['ntasks_per_node']:>10} {r['nb_part']:>7} {r['replicas']:>8} "
                     f"{r['batch_size']:>5} {r['chunks']:>6} {r['precision']:9} "
                     f"{'yes' if r['activation_checkpointing'] else 'no':4} {'yes' if r['zero'] else 'no':4} "
                     f"{r['peak_gib']:>8.2f} {r['bubble']:>6.1%}" + speed)
    notes = sorted({n for r in rows for n in r.get("notes", [])}) + [schedule_note] * bool(schedule_note)
    lines += [f"  note: {n}" for n in notes]
    if not rows:
        lines.append("  nothing fits: use more GPUs, a smaller model (--nlayers, --d-model, --seq-len) or a smaller "
                     "global batch")
    return "\n".join(lines)


def advise_request(args: argparse.Namespace) -> tuple[Job, int, float, str, list[int]]:
    """--advise's request, checked: the job (nodes, GPUs a node, GPU memory and its source) and the global batches;
    one UsageError naming what is missing."""
    job = Job(nodes=args.nodes, gpus_per_node=args.gpus_per_node, constraint=args.constraint,
              partition=args.partition, gpu_mem=args.gpu_mem)
    ntype = node_type(job)
    gpn = job.gpus_per_node or (JEAN_ZAY[ntype].gpus or None if ntype else None)
    gib, source = gpu_memory(job)
    missing = [m for m, v in (("--nodes N", job.nodes), ("--gpus-per-node N (or -C/-p of a known node)", gpn),
                              ("-C v100-16g|v100-32g|a100|h100 or --gpu-mem GiB", gib),
                              ("--global-batch N", args.global_batch)) if not v]
    if missing:
        raise UsageError(f"--advise needs {', '.join(missing)}; e.g. --advise --nodes 3 --gpus-per-node 4 "
                         "-C v100-32g --global-batch 384")
    batches = global_batches(args.global_batch)
    if job.nodes < 1 or gpn < 1:
        raise UsageError(f"--nodes ({job.nodes}) and --gpus-per-node ({gpn}) must be at least 1")
    if args.top is not None and args.top < 1:
        raise UsageError(f"--top {args.top} must be at least 1, e.g. --top 3")
    return job, gpn, gib, source, batches


def advise_main(args: argparse.Namespace, t: Training) -> int:
    """--advise: every split that fits, from planning flags alone; with --profile ranked by predicted speed."""
    job, gpn, gib, source, batches = advise_request(args)
    ntype = node_type(job)
    profile = None
    if args.profile:
        try:
            profile = read_profile(args.profile)
        except ProfileError as exc:
            raise UsageError(str(exc)) from None
        mismatch = profile_mismatch(profile, t.model)  # the values given on the command line
        taken_on = profile["key"].get("node_type")
        if taken_on and ntype and taken_on != ntype:
            mismatch = (f"it was taken on {taken_on} nodes and the plan is for {ntype}: a profile's times hold for "
                        "its node type only; take one there (docs/speed.md)")
        mismatch = mismatch or profile_gpu_mismatch(profile, ntype)
        if mismatch:
            raise UsageError(f"--profile {args.profile}: {mismatch}")
        # what the command line does not give is the profile's model: the one it was taken with
        t.model = {**profile["key"]["model"], **t.model}
        t.nlayers = t.nlayers or profile["key"].get("nlayers")
    model = model_args(t)
    # the profile's torch and device say which schedules the stage layout's trainer will run (TORCH_FEATURES);
    # with a profile every one of them is ranked by its predicted speed, beside the splits
    schedule, schedule_note = stage_schedule(profile["key"].get("torch") if profile else None,
                                             bool(profile) and profile["device"] == "cpu")
    if profile and schedule:
        schedule = tuple(stage_schedules(profile["key"]["torch"], profile["device"] == "cpu"))
    rows = [r for batch in batches for r in advise(job.nodes, gpn, gib, model, batch, is_v100(job),
                                                   schedule=schedule)]
    if profile:
        rows = rank_by_speed(rows, profile, model, job.nodes)
    rows = rows[:args.top] if args.top else rows
    if args.commands:
        print("\n".join(f"{r['ntasks_per_node']} {SCRIPTS[r['layout']]} {shlex.join(trainer_argv(r, model))}"
                        for r in rows))
    else:
        print(json.dumps(rows, indent=1) if args.json else
              advise_text(rows, job.nodes, gpn, gib, source, args.global_batch, profile, schedule_note))
    return 0 if rows else 1


def global_batches(text: str) -> list[int]:
    """--global-batch 512, or several: 256,512."""
    try:
        values = [int(v) for v in str(text).split(",")]
    except ValueError:
        raise UsageError(f"--global-batch {text!r} must be a number of samples, or several separated by commas: "
                         "--global-batch 256,512") from None
    if min(values) < 1:
        raise UsageError(f"--global-batch {text} must be at least 1")
    return values


def trainer_argv(row: dict, model: dict) -> list[str]:
    """The trainer's arguments that run an --advise row (its script: SCRIPTS[row["layout"]])."""
    argv = [f"--{k.replace('_', '-')}={show_value(model[k])}" for k in ("nlayers", *PROFILE_MODEL)]
    argv += (["--nb-part", str(row["nb_part"])] if row["layout"] == "replica" else
             ["--pp", str(row["nb_part"]), "--schedule", row["schedule"]])
    argv += ["--chunks", str(row["chunks"]), "--batch-size", str(row["batch_size"])]
    argv += ["--precision", row["precision"]] if row["precision"] != "fp32" else []
    argv += ["--activation-checkpointing"] * bool(row["activation_checkpointing"]) + ["--zero"] * bool(row["zero"])
    return argv


def rank_by_speed(rows: list[dict], profile: dict, model: dict, nodes: int) -> list[dict]:
    """--advise's rows with the samples/s predicted from the profile and its terms (ms), fastest first; a row the
    profile cannot predict (a precision it did not time) goes last, with the reason."""
    for r in rows:
        t = Training(layout=r["layout"], pp=r["nb_part"], schedule=r["schedule"], precision=r["precision"],
                     activation_checkpointing=r["activation_checkpointing"], zero=r["zero"])
        m = dict(model, batch_size=r["batch_size"], chunks=r["chunks"])
        try:
            guess = predict_speed(profile, m, t, r["nb_part"], r["replicas"], r["ntasks_per_node"], nodes)
        except ProfileError as exc:
            r.update(samples_per_s=None, why=str(exc))
            continue
        except (ArithmeticError, ValueError):  # times the checks let through but the model divides by: all zero
            r.update(samples_per_s=None, why="the profile's times are zero where the model divides by them: take "
                     "it again with benchmarks/speed_profile.py")
            continue
        r.update(samples_per_s=round(guess["samples_per_s"], 1), step_ms=round(guess["step_s"] * 1e3, 2),
                 terms_ms={k: round(v * 1e3, 2) for k, v in guess["terms"].items()}, notes=guess["notes"])
    return sorted(rows, key=lambda r: -(r["samples_per_s"] or -1))


# ---- a user's model (kit.own_model --advise): its splits ranked, from its layers' figures ---------------------------

GPUS = ("h100", "a100", "v100-32g", "v100-16g")  # the -C features of Jean Zay's GPUs (kit.site.JEAN_ZAY)


def gpu_of(feature: str, gib: float | None = None) -> tuple[float, str, str]:
    """GiB of one GPU of that -C feature (or `gib`), its words, and kit.memory's arch key for its kernels."""
    job = Job(constraint=feature, gpu_mem=gib)
    usable, source = gpu_memory(job)
    return usable, f"{feature}, {source}", requested_arch(is_v100(job))[0]


def advise_layers(model: Model, gpus: int, gib: float, arch: str, global_batch: int,
                  max_chunks: int = 32) -> list[dict]:
    """Every split of `gpus` GPUs (nb_part x replicas, the page's layout) for a user's model, each --split (kit.model:
    the sizes the trainers run) with the first option that fits in `gib` (fp32, --zero, the low precision,
    --activation-checkpointing, in that order; the smallest if none does), ranked: those that fit first, then by a
    speed proxy, the samples per unit of the slowest part's FLOPs: global batch / (that part's FLOPs a micro-batch x
    (chunks + nb_part - 1) micro-batch times, the pipeline with its bubble; 4/3 of it under checkpointing, a forward
    again). Splits that come out the same are one row ('time=memory')."""
    low = "fp16" if arch == "sm70" else "bf16"
    rows: dict[tuple, dict] = {}
    for nb_part in [n for n in divisors(gpus) if n <= model.nlayers]:
        replicas = gpus // nb_part
        if global_batch % replicas:
            continue
        batch = global_batch // replicas
        for chunks in ([1] if nb_part == 1 else [c for c in divisors(batch) if c <= max_chunks]):
            for split in SPLITS:
                row = _layer_row(model, nb_part, split, batch // chunks, chunks, replicas, gib, arch, low,
                                 global_batch)
                key = (nb_part, chunks, tuple(row["sizes"]), row["precision"], row["activation_checkpointing"],
                       row["zero"])
                if key in rows:
                    rows[key]["split"] += f"={split}"
                else:
                    rows[key] = row
    out = list(rows.values())
    best = max((r["speed"] for r in out if r["fits"] or not any(r["fits"] for r in out)), default=1.0) or 1.0
    for r in out:
        r["relative_speed"] = round(r.pop("speed") / best, 3)
    # among equal speeds (the slowest part the same) the more even parts first, then fewer parts, less memory
    return sorted(out, key=lambda r: (not r["fits"], -r["relative_speed"], r.pop("spread"), r["nb_part"],
                                      r["peak_gib"]))


def _layer_row(model: Model, nb_part: int, split: str, micro: int, chunks: int, replicas: int, gib: float,
               arch: str, low: str, global_batch: int) -> dict:
    """One split's row: the first option that fits (or the smallest), the split's sizes under it (the split by memory
    balances that option's peaks), its worst part's peak and the speed proxy."""
    options = [(p, c, z) for c in (False, True) for p in ("fp32", low) for z in ((False, True) if replicas > 1
                                                                                 else (False,))]
    tried = []
    for precision, ckpt, zero in options:
        sizes = model.sizes(nb_part, split, micro, chunks, precision, ckpt)
        peak = max(m.total for m in estimate_peaks(model.costs, sizes, micro, chunks, precision, replicas, zero, ckpt,
                                                   arch=arch, kit_model=model.kit)) / GIB
        tried.append((peak, precision, ckpt, zero, sizes))
        if peak <= gib:
            break
    peak, precision, ckpt, zero, sizes = tried[-1] if tried[-1][0] <= gib else min(tried)
    costs = model.costs
    bounds = [sum(sizes[:p]) for p in range(len(sizes) + 1)]
    flops = [sum(c.flops for c in costs[a:b]) * micro for a, b in zip(bounds, bounds[1:])]
    slowest = max(flops)
    step = slowest * (chunks + len(sizes) - 1) * (4 / 3 if ckpt else 1)
    return dict(nb_part=len(sizes), replicas=replicas, batch_size=micro * chunks, chunks=chunks, split=split,
                sizes=sizes, precision=precision, activation_checkpointing=ckpt, zero=zero, peak_gib=round(peak, 3),
                fits=peak <= gib, bubble=round(bubble(len(sizes), chunks), 3),
                speed=global_batch / step if step else 0.0, spread=sum(f * f for f in flops) / (slowest or 1) ** 2)


def advise_layers_text(rows: list[dict], gpus: int, gib: float, source: str, global_batch: int,
                       top: int | None = None) -> str:
    """--advise for a --model (python -m kit.own_model, check_topology): the same columns as check_topology
    --advise's, with the split."""
    fit = sum(r["fits"] for r in rows)
    shown = rows[:top] if top else rows
    lines = [f"--advise for --model: {gpus} GPU(s) of {gib:.1f} GiB ({source}), global batch {global_batch}: "
             f"{len(rows)} split(s), {fit} fit, {len(shown)} shown; those that fit first, fastest first by the "
             "slowest part's FLOPs with the bubble (a proxy: relative samples/s, 1 = the best that fits; no profile "
             "of this model), each with the first option that fits (fp32, --zero, low precision, checkpointing)",
             f"  {'nb_part':>7} {'replicas':>8} {'batch':>5} {'chunks':>6} {'split':17} {'layers per part':20} "
             f"{'precision':9} {'ckpt':4} {'zero':4} {'peak GiB':>8} {'bubble':>6} {'speed':>6}  fits"]
    for r in shown:
        lines.append(f"  {r['nb_part']:>7} {r['replicas']:>8} {r['batch_size']:>5} {r['chunks']:>6} "
                     f"{r['split']:17} {str(r['sizes']):20} {r['precision']:9} "
                     f"{'yes' if r['activation_checkpointing'] else 'no':4} {'yes' if r['zero'] else 'no':4} "
                     f"{r['peak_gib']:>8.3f} {r['bubble']:>6.1%} {r['relative_speed']:>6.3f}  "
                     f"{'yes' if r['fits'] else 'NO'}")
    if not fit:
        lines.append("  nothing fits: use more GPUs, a smaller sample batch or a smaller model")
    return "\n".join(lines)

"""Speed: a split's step time from a measured profile (benchmarks/speed_profile.py writes it; docs/speed.md).
Owns: PROFILE_FORMAT, SPEED_TERMS, FLOPs per sample and the GPUs' dense peaks. Imports: kit.arguments, kit.bounded,
kit.plan, kit.memory, kit.schedules, kit.site.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import replace
from typing import Callable, NoReturn

from kit.arguments import ARG, Training, show_value
from kit.bounded import FileProblem, read_regular
from kit.memory import part_params
from kit.plan import part_sizes
from kit.schedules import (BACKWARD, BACKWARD_INPUT, FORWARD, SCHEDULES, Action, depends, schedule,
                           split_backward)
from kit.site import JEAN_ZAY


# The model behind `--advise --profile FILE`: the step time of a split, in terms a user can read, from what
# benchmarks/speed_profile.py measured in the allocation. The pipeline is simulated op by op in each layout's own order
# (the shape of Megatron-LM's (m + p - 1) x (t_f + t_b), Narayanan et al. 2021 sec. 2.2, but with each part's own
# times, so unequal parts and parts that share a device come out right): GPipe's fill and drain (fairscale's and
# torch 2.3's Pipe: every forward, then every backward), 1F1B and the interleaved schedules (kit.schedules, the
# order torch.distributed.pipelining runs). Parts on different devices overlap as that order allows; parts that
# share one (--devices 0,0, the CPU) run one after the other. To that come the engine's cost per micro-batch, DDP's
# all-reduce where the backward does not hide it, and the optimizer. Every constant comes from the profile: none
# is built in, and none was taken on a GPU here.

# The distance to the physical limit. flops_per_sample counts the model's matmul FLOPs from its shapes (what
# torch.utils.flop_counter counts: tests/test_speed.py holds the two equal); PEAK_TFLOPS are NVIDIA's dense
# (no sparsity) tensor-core peaks of the SXM parts, per precision, from their data sheets (V100: Volta whitepaper,
# 125 TF fp16 and 15.7 fp32, no bf16 or TF32; A100: 312 bf16/fp16, 156 TF32, 19.5 fp32; H100 SXM: 989, 495, 67;
# H200: H100's compute). A PCIe card peaks lower: the share is then an underestimate.
PEAK_TFLOPS = {  # GPU family (a word of torch.cuda.get_device_name): {matmul precision: dense TFLOP/s}
    "V100": {"fp32": 15.7, "fp16": 125.0},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "H100": {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0},
    "H200": {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0},
}


def flops_per_sample(model: dict) -> float:
    """The matmul FLOPs of one training sample of the kit's Transformer: forward + backward = 3 x forward (the
    backward computes the gradients of the inputs and of the weights, each a forward's worth), the convention of
    model FLOPs utilisation (PaLM, Chowdhery et al. 2022, appendix B): activation checkpointing's recomputation is
    not counted. Per Layer: the q, k, v and output projections 4 x 2 s d^2, the feed-forward 2 x 2 s d d_hid, the
    attention scores and their weighted sum 2 x 2 s^2 d; the Decoder's head 2 (d d_hid + 2 d_hid). The embedding is
    a lookup, LayerNorm, softmax and the adds are not matmuls (a few % more on the GPU, uncounted as everywhere)."""
    d, f, s = model["d_model"], model["d_hid"], model["seq_len"]
    layer = 2 * s * (4 * d * d + 2 * d * f) + 4 * s * s * d
    return 3.0 * (model["nlayers"] * layer + 2 * (d * f + f * 2))


def peak_tflops(gpu_name: str | None, precision: str, tf32: bool = False) -> float | None:
    """The dense peak of this GPU for the precision its matmuls run in (fp32, TF32 under --tf32, bf16, fp16), or
    None where PEAK_TFLOPS does not know the GPU or it has no such unit (a V100's bf16; --tf32 on a V100 runs fp32)."""
    kind = "tf32" if precision == "fp32" and tf32 else precision
    for family, peaks in PEAK_TFLOPS.items():
        if gpu_name and family in gpu_name.upper():
            return peaks.get(kind, peaks["fp32"] if kind == "tf32" else None)  # no TF32 unit: fp32 matmuls
    return None


PROFILE_FORMAT = "kit-profile/1"

PROFILE_MODEL = ("d_model", "n_head", "d_hid", "seq_len", "vocab_size", "dropout")  # what a profile is taken for


# DistributedDataParallel's buckets: bucket_cap_mb=25, and the first bucket 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES),
# filled in reverse order of model.parameters() (torch/nn/parallel/distributed.py, 2.3.1 to 2.14.1)
DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES = 25 * 2 ** 20, 2 ** 20

SPEED_TERMS = ("compute", "bubble", "per_micro_batch", "communication", "optimizer")


class ProfileError(ValueError):
    """A profile that cannot be used here: one line, with the fix."""


MAX_PROFILE_BYTES = 2 ** 20  # a profile is about 25 kB (docs/cpu_profile.json); more is not one speed_profile.py wrote

_COUNT = ("count", 1, 4096)  # tasks, threads, replicas: an integer in range

_SECONDS = ("seconds",)  # a time: a finite number, 0 to a day

_POINTS = ("points", 3)  # [micro-batch, forward s, backward s] rows, the first column increasing (_interpolate)

_LAYERS = ("arg", "nlayers")  # the trainer's own range (ARGS): one owner


# What the speed model reads of a profile (benchmarks/speed_profile.py writes it), each value's type and range, so
# that no lookup, division or loop of the model can fail or run long on a damaged or hostile file. A key ending in
# '?' may be missing; other keys are not read.
PROFILE_SCHEMA = {
    "format": ("text",), "device": ("choice", "cpu", "cuda"),
    # the GPU and the torch it was taken with: --advise and report.py --profile name both (a profile without them was
    # a KeyError traceback there, issue 42)
    "key": {"model": ("model",), "nlayers?": _LAYERS, "gpu": ("text",), "torch": ("text",),
            "node_type?": ("optional", ("text",))},
    "compute": ("list", {"tasks": _COUNT, "threads?": ("optional", _COUNT), "nlayers": _LAYERS,
                         "blocks": ("map", _POINTS), "whole?": ("map", _POINTS),
                         "engine?": ("optional", {"per_micro_batch_part_s?": ("optional", _SECONDS)})}),
    "optimizer": {"Encoder": _SECONDS, "Layer": _SECONDS, "Decoder": _SECONDS},
    "engine": {"per_step_s": _SECONDS, "per_micro_batch_part_s": _SECONDS},
    "replica_step?": ("optional", ("list", {"tasks": _COUNT, "threads?": ("optional", _COUNT), "replicas": _COUNT,
                                            "micro": ("count", 1, 65536), "nlayers": _LAYERS, "step_s": _SECONDS})),
    "stage_engine?": ("optional", {"per_step_s": _SECONDS, "per_micro_batch_stage_s": _SECONDS}),
    "stage_step?": ("optional", {"tasks": _COUNT, "threads?": ("optional", _COUNT), "pp": ("count", 2, 16),
                                 "replicas": _COUNT, "schedule": ("choice", *SCHEDULES), "nlayers": _LAYERS,
                                 "points": ("optional", ("steps",))}),
    "allreduce": {"node?": ("optional", {"tasks": _COUNT, "points": ("optional", ("points", 2))}),
                  "nodes?": ("optional", {"tasks": _COUNT, "points": ("optional", ("points", 2))})},
    "p2p?": ("optional", ("points", 2)),
}

MAX_ROWS = 256  # rows of a table, entries of a list or map: speed_profile.py writes at most a few tens


def _number(value: object, where: str, lo: float, hi: float, integer: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ProfileError(f"{where} is {_shown(value)}, not {'an integer' if integer else 'a number'}")
    if not lo <= value <= hi:  # NaN and infinities never reach here: the JSON reader refuses them
        raise ProfileError(f"{where} is {_shown(value)}, outside {show_value(lo)} to {show_value(hi)}")


def _shown(value: object) -> str:
    try:
        text = repr(value) if isinstance(value, str) else json.dumps(value)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _check_rows(rows: object, where: str, columns: int, increasing: bool) -> None:
    """A table of `columns` numbers a row: the first a positive size (increasing: _interpolate's x), the others
    seconds; the stage layout's steps ("steps") are [micro-batch, micro-batches, seconds > 0]."""
    if not isinstance(rows, list) or not 1 <= len(rows) <= MAX_ROWS:
        raise ProfileError(f"{where} is {_shown(rows)}, not a list of 1 to {MAX_ROWS} rows")
    for n, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != columns:
            raise ProfileError(f"{where}[{n}] is {_shown(row)}, not {columns} numbers")
        if increasing:
            _number(row[0], f"{where}[{n}][0]", 1e-9 if n == 0 else rows[n - 1][0] + 1e-9, 1e15)
            for k in range(1, columns):
                _number(row[k], f"{where}[{n}][{k}]", 0, 86400)
        else:
            _number(row[0], f"{where}[{n}][0]", 1, ARG["batch_size"].hi, integer=True)
            _number(row[1], f"{where}[{n}][1]", 1, 64, integer=True)
            _number(row[2], f"{where}[{n}][2]", 1e-9, 86400)


def _check_value(value: object, spec: object, where: str) -> object:
    """`value` against its PROFILE_SCHEMA entry; returns it (a model's values converted by ARGS)."""
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise ProfileError(f"{where} is {_shown(value)}, not an object")
        for key, inner in spec.items():
            name = key.rstrip("?")
            if name in value:
                value[name] = _check_value(value[name], inner, f"{where}.{name}")
            elif not key.endswith("?"):
                raise ProfileError(f"{where} has no {name}: the file was cut short or edited")
        return value
    kind, *args = spec
    if kind == "optional":
        return None if value is None else _check_value(value, args[0], where)
    if kind in ("list", "map"):
        items = list(enumerate(value)) if isinstance(value, list) else list(value.items()) \
            if isinstance(value, dict) else None
        if items is None or not 1 <= len(items) <= MAX_ROWS:
            raise ProfileError(f"{where} is {_shown(value)}, not a {kind} of 1 to {MAX_ROWS} entries")
        for k, item in items:
            value[k] = _check_value(item, args[0], f"{where}[{_shown(k)}]")
        return value
    if kind in ("points", "steps"):
        _check_rows(value, where, args[0] if kind == "points" else 3, kind == "points")
    elif kind == "seconds":
        _number(value, where, 0, 86400)
    elif kind == "count":
        _number(value, where, args[0], args[1], integer=True)
    elif kind in ("text", "choice"):  # printed in the reports: no control character (a terminal escape), 200 at most
        if not isinstance(value, str) or len(value) > 200 or not value.isprintable() or (
                kind == "choice" and value not in args):
            raise ProfileError(f"{where} is {_shown(value)}, not " + ("one of " + ", ".join(args) if kind == "choice"
                                                                      else "a name"))
    elif kind == "arg":
        return _profile_arg(value, args[0], where)
    elif kind == "model":
        if not isinstance(value, dict):
            raise ProfileError(f"{where} is {_shown(value)}, not an object")
        return {k: _profile_arg(value[k], k, f"{where}.{k}") for k in PROFILE_MODEL if k in value}
    return value


def _profile_arg(value: object, dest: str, where: str) -> object:
    """A model value of the profile, refused as the command line refuses it (ARGS: the same ranges and words)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{where} is {_shown(value)}, not a number")
    converted, problem = ARG[dest].convert(str(value))
    if problem:
        raise ProfileError(f"{where}: {problem}")
    return converted


def _profile_text(path: str | os.PathLike) -> str:
    """The file's text, read bounded (kit.bounded.read_regular): a regular file only (a FIFO is never opened: it could
    block forever), at most MAX_PROFILE_BYTES, UTF-8."""
    try:
        data, _ = read_regular(path, MAX_PROFILE_BYTES, what="a profile (speed_profile.py writes about 25 kB)")
    except FileProblem as exc:
        raise ProfileError(f"--profile {path}: {exc}; give the JSON file benchmarks/speed_profile.py wrote "
                           "(docs/speed.md)") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProfileError(f"--profile {path} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}): "
                           "not a profile, or a damaged one; take it again with benchmarks/speed_profile.py") from None


def _json_number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:20]} is out of range")
    return value


def _json_integer(text: str) -> int:
    if len(text) > 30:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _json_constant(text: str) -> NoReturn:
    raise ValueError(f"{text} is not a number a profile holds")


def read_profile(path: str | os.PathLike) -> dict:
    """A profile written by benchmarks/speed_profile.py, read bounded and checked against PROFILE_SCHEMA, so that
    the model's lookups cannot fail later: a damaged, cut, foreign or hostile file is one line (ProfileError)."""
    text = _profile_text(path)
    try:
        profile = json.loads(text, parse_float=_json_number, parse_int=_json_integer, parse_constant=_json_constant)
    except (ValueError, RecursionError) as exc:
        why = "nested too deep" if isinstance(exc, RecursionError) else str(exc)[:80]
        raise ProfileError(f"--profile {path} is not JSON ({why}); take it again with "
                           "benchmarks/speed_profile.py") from None
    if not isinstance(profile, dict) or profile.get("format") != PROFILE_FORMAT:
        found = profile.get("format") if isinstance(profile, dict) else type(profile).__name__
        raise ProfileError(f"--profile {path}: format {_shown(found)}, not {PROFILE_FORMAT!r} "
                           "(benchmarks/speed_profile.py writes it); take it again with this kit")
    missing = [k for k in ("key", "device", "compute", "optimizer", "engine", "allreduce") if k not in profile]
    if missing or not profile["compute"]:
        raise ProfileError(f"--profile {path} has no {', '.join(missing) or 'compute'}: it was cut short; take it "
                           "again with benchmarks/speed_profile.py")
    try:
        _check_value(profile, PROFILE_SCHEMA, "profile")
        for name, table in profile["allreduce"].items():  # a ring of n tasks: 2(n-1)/n, timed with n >= 2
            if name in ("node", "nodes") and table and table.get("points") and table["tasks"] < 2:
                raise ProfileError(f"profile.allreduce.{name} has all-reduce times but tasks {table['tasks']}")
    except ProfileError as exc:
        raise ProfileError(f"--profile {path}: {exc}; take it again with benchmarks/speed_profile.py") from None
    return profile


def profile_gpu_mismatch(profile: dict, ntype: str | None) -> str | None:
    """Where the profile's GPU (speed_profile.py's torch.cuda.get_device_name) is another family than the plan's
    Jean Zay nodes (V100, A100, H100): the line that says which."""
    family = lambda text: (re.search(r"[vah]100", (text or "").lower()) or [None])[0]  # noqa: E731
    taken, planned = family(profile["key"].get("gpu")), family(ntype)
    if taken and planned and taken != planned:
        return (f"it was taken on {profile['key']['gpu']} GPUs and the plan is for {JEAN_ZAY[ntype].label}: a "
                "profile's times hold for its GPU only; take one there (docs/speed.md)")
    return None


def profile_mismatch(profile: dict, model: dict) -> str | None:
    """Where the profile was taken for another model block than `model` (--nlayers may differ: a Layer is timed
    once), the one line that says which argument and the fix."""
    taken = profile["key"].get("model", {})
    for name in PROFILE_MODEL:
        if name in taken and name in model and float(taken[name]) != float(model[name]):
            return (f"the profile was taken with --{name.replace('_', '-')} {show_value(taken[name])}, the plan has "
                    f"{show_value(model[name])}: give the profile's value, or take the profile again with yours")
    return None


def _interpolate(points: list, x: float, column: int = 1) -> float:
    """Piecewise linear in x through measured [x, y...] points; past the last, the last segment's slope (compute
    grows linearly with the micro-batch once the device is busy); below the first, the first value."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][column]
    for (x0, *y0), (x1, *y1) in zip(points, points[1:]):
        if x <= x1:
            return y0[column - 1] + (y1[column - 1] - y0[column - 1]) * (x - x0) / (x1 - x0)
    if len(points) == 1:
        return points[0][column] * x / xs[0]
    (x0, *y0), (x1, *y1) = points[-2], points[-1]
    return y1[column - 1] + max(0.0, (y1[column - 1] - y0[column - 1]) / (x1 - x0)) * (x - x1)


def _nearest(records: list[dict], profile: dict, tasks: int, threads: int | None) -> tuple[dict, float]:
    """The record (a compute context, a real step) timed with this many intra-op threads per task and tasks at work
    on a node, or the nearest; and how much slower a CPU task runs when the split starts more threads than the
    node has cores (they take turns). threads None: the trainer's own, the node's cores // tasks (cpu_threads)."""
    if profile["device"] != "cpu":
        return min(records, key=lambda c: (abs(c["tasks"] - tasks), -c["tasks"])), 1.0
    cores = max(c["tasks"] * (c.get("threads") or 1) for c in profile["compute"])
    want = threads or max(1, cores // tasks)
    rec = min(records, key=lambda c: (abs((c.get("threads") or 1) - want), abs(c["tasks"] - tasks), -c["tasks"]))
    return rec, max(1.0, tasks * want / cores)


def _context(profile: dict, tasks: int, threads: int | None = None) -> tuple[dict, float]:
    return _nearest(profile["compute"], profile, tasks, threads)


def _block_times(ctx: dict, kind: str, precision: str, ckpt: bool, micro: float) -> tuple[float, float]:
    key = f"{kind}|{precision}|{int(ckpt and kind == 'Layer')}"
    if key not in ctx["blocks"]:
        raise ProfileError(f"the profile has no {precision} timings of the {kind}"
                           + (" with activation checkpointing" if ckpt and kind == "Layer" else "")
                           + f"; take it with --precisions {precision} (benchmarks/speed_profile.py)")
    points = ctx["blocks"][key]
    return _interpolate(points, micro, 1), _interpolate(points, micro, 2)


def _blocks_of(nlayers: int, nb_part: int, j: int) -> list[tuple[str, int]]:
    layers = part_sizes(nlayers, nb_part)[j]
    return [("Layer", layers)] + [("Encoder", 1)] * (j == 0) + [("Decoder", 1)] * (j == nb_part - 1)


def _bare(ctx: dict, blocks: list[tuple[str, int]], t: "Training", micro: float) -> tuple[float, float]:
    times = [(n, _block_times(ctx, k, t.precision, t.activation_checkpointing, micro)) for k, n in blocks]
    return sum(n * f for n, (f, _) in times), sum(n * b for n, (_, b) in times)


def _pipe_scale(profile: dict, ctx: dict, t: "Training", micro: float) -> tuple[float, float]:
    """How much slower the blocks run inside the replica layout's Pipe than bare: the whole model timed in it (one
    part, one chunk, less the engine's own cost) against its bare blocks (speed_profile.time_whole)."""
    whole = ctx.get("whole", {}).get(f"{t.precision}|{int(t.activation_checkpointing)}")
    if not whole:
        return 1.0, 1.0
    engine = profile["engine"]
    fixed = (engine["per_step_s"] + engine["per_micro_batch_part_s"]) / 2
    f, b = _bare(ctx, _blocks_of(ctx["nlayers"], 1, 0), t, micro)
    wf, wb = _interpolate(whole, micro, 1) - fixed, _interpolate(whole, micro, 2) - fixed
    return max(wf, 0.5 * f) / f, max(wb, 0.5 * b) / b


def _overlap(chunks: int, pp: int) -> float:
    """The share of a pipeline's clocks in which its stages all compute at once: (m - 1) / (m + p - 1)."""
    return (chunks - 1) / (chunks + pp - 1)


def _least_squares(rows: list[list[float]], rhs: list[float], free: list[bool]) -> list[float]:
    """min |rows x - rhs| over the unknowns marked free (the others 0), by the normal equations (a handful of
    unknowns: Gauss-Jordan with partial pivoting)."""
    idx = [j for j, f in enumerate(free) if f]
    a = [[sum(r[i] * r[j] for r in rows) for j in idx] + [sum(r[i] * y for r, y in zip(rows, rhs))] for i in idx]
    n = len(idx)
    for col in range(n):
        pivot = max(range(col, n), key=lambda k: abs(a[k][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if abs(a[col][col]) < 1e-300:
            return [0.0] * len(free)
        for k in range(n):
            if k != col:
                ratio = a[k][col] / a[col][col]
                a[k] = [x - ratio * y for x, y in zip(a[k], a[col])]
    out = [0.0] * len(free)
    for k, j in enumerate(idx):
        out[j] = a[k][n] / a[k][k]
    return out


def _stage_fit(profile: dict, model: dict, t: "Training") -> dict | None:
    """The stage layout as it really runs, from the profile's real steps (speed_profile.time_stage_steps: the real
    model, pp 2, 2 and 8 micro-batches of 1 to 64 samples): a factor on the bare blocks for each count of
    micro-batches (on a CPU the stages that compute at once share the memory: more of them with more micro-batches),
    a cost per micro-batch and stage, a cost per step. The prediction is linear in all of them (finite
    differences give the slopes), so they are its least squares fit to the steps, each step's error relative to
    it; over micro-batches of 1 to 64 samples the per-micro-batch cost and the blocks' share come apart. None where
    the profile has no real step (the tiny model's engine cost stands, the blocks bare)."""
    rec = profile.get("stage_step")
    if not rec or not rec.get("points"):
        return None
    plain = replace(t, precision="fp32", activation_checkpointing=False, schedule=rec["schedule"], zero=False)
    counts = sorted({c for _, c, _ in rec["points"]})
    rows, rhs = [], []
    for m, c, step in rec["points"]:
        run = dict(model, nlayers=rec["nlayers"], batch_size=m * c, chunks=c)
        at = lambda k, o: predict_speed(profile, run, plain, rec["pp"], rec["replicas"], rec["tasks"],  # noqa: E731
                                        threads=rec["threads"], stage_costs=(k, o, 0.0))["step_s"]
        base = at(1.0, 0.0)
        blocks, per_op = at(2.0, 0.0) - base, (at(1.0, 1e-3) - base) / 1e-3
        rows.append([(blocks if c == k else 0.0) / step for k in counts] + [per_op / step, 1.0 / step])
        rhs.append((step - base + blocks) / step)
    free = [True] * (len(counts) + 2)
    x = _least_squares(rows, rhs, free)
    while any(v < 0 for v in x[-2:]):  # a negative cost is noise: held at 0, the rest fitted again
        free[len(counts) + x[-2:].index(min(x[-2:]))] = False
        x = _least_squares(rows, rhs, free)
    return {"scales": [[_overlap(c, rec["pp"]), max(0.3, k)] for c, k in zip(counts, x)], "per_op": x[-2],
            "per_step": x[-1]}


def _stage_scale(fit: dict, overlap: float) -> float:
    """The fit's factor on the bare blocks at this overlap: linear between those measured (on GPUs it barely moves),
    the nearest past them."""
    points = fit["scales"]
    return _interpolate(points, min(max(overlap, points[0][0]), points[-1][0]))


def _part_costs(profile: dict, ctx: dict, model: dict, t: "Training", nb_part: int, micro: float,
                scale: float = 1.0) -> list[dict]:
    """Per part: forward and backward of one micro-batch (the replica layout's as its Pipe runs them, the stage
    layout's times `scale`), its gradients' bytes, its optimizer step."""
    opt = profile["optimizer"]
    sf, sb = (scale, scale) if t.layout == "stage" else _pipe_scale(profile, ctx, t, micro)
    out = []
    for j in range(nb_part):
        blocks = _blocks_of(model["nlayers"], nb_part, j)
        f, b = _bare(ctx, blocks, t, micro)
        numel, _ = part_params(model, blocks[0][1], j == 0, j == nb_part - 1)
        out.append({"f": f * sf, "b": b * sb, "bytes": 4 * numel,
                    "optimizer": sum(n * opt[k] for k, n in blocks)})
    return out


def _queues(layout: str, schedule_name: str, stages: int, pp: int, chunks: int, shared: bool) -> list[list[tuple]]:
    """Each device's (or task's) ops in the order it runs them: (kind, stage, micro-batch). The replica layout's
    Pipe runs every forward, then every backward (GPipe, clock by clock); parts that share a device share one
    queue. The stage layout: a queue per task, torch.distributed.pipelining's order (kit.schedules)."""
    if layout == "replica":
        fwd = sorted(((i + s, s, i) for s in range(stages) for i in range(chunks)))
        bwd = sorted((((chunks - 1 - i) + (stages - 1 - s), s, i) for s in range(stages) for i in range(chunks)))
        if shared:
            return [[("F", s, i) for _, s, i in fwd] + [("B", s, i) for _, s, i in bwd]]
        return [[("F", s, i) for _, q, i in fwd if q == s] + [("B", s, i) for _, q, i in bwd if q == s]
                for s in range(stages)]
    virtual = stages // pp
    return [[(a.kind, a.stage, a.mb) for a in schedule(schedule_name).actions(pp, virtual, chunks, rank)]
            for rank in range(pp)]


# The split backward's halves, from a stage's measured full backward (the profile times whole backwards): each
# Linear's backward is two matmuls of its forward's cost, one for the input's gradient and one for the weight's
# (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, sec. 2: T_F ~ T_B ~ T_W for a transformer layer; torch's
# ScheduleZBVZeroBubble docstring assumes the same), so I and W are half of B each. On the first stage torch's I runs
# nothing and its W the whole backward (stage.py backward_one_chunk, backward_weight_one_chunk).
INPUT_SHARE = 0.5


def op_time(part: dict, kind: str, stage: int) -> float:
    """One action's compute on a stage (part: its "f" and "b"): F, B, and the split backward's I and W."""
    if kind == FORWARD:
        return part["f"]
    if kind == BACKWARD:
        return part["b"]
    share = 0.0 if stage == 0 else INPUT_SHARE
    return part["b"] * (share if kind == BACKWARD_INPUT else 1 - share)


def schedule_bubble(name: str, pp: int, chunks: int, virtual: int = 2) -> float:
    """The idle fraction of a schedule's busiest-idle task with equal stages (a backward twice a forward, its halves
    equal): GPipe's and 1F1B's (pp - 1) / (chunks + pp - 1), less for the interleaved and zero-bubble orders."""
    stages = pp * schedule(name).stages_per_rank(virtual)
    queues = _queues("stage", name, stages, pp, chunks, False)
    cost = lambda kind, s: op_time({"f": 1.0, "b": 2.0}, kind, s)  # noqa: E731
    makespan, _ = _simulate(queues, cost, 0.0, stages)
    return max(1 - sum(cost(k, s) for k, s, _ in ops) / makespan for ops in queues)


def _done_key(key: tuple) -> tuple:
    """A backward's input gradient is there after its B or its I, whichever the schedule ran (DualPipeV runs both
    kinds): one key for either."""
    return ("dx", key[1], key[2]) if key[0] in (BACKWARD, BACKWARD_INPUT) else key


def _simulate(queues: list[list[tuple]], duration: Callable[[str, int], float], delay: float, stages: int
              ) -> tuple[float, dict]:
    """Each queue runs its ops in order, an op as soon as its queue is free and its inputs are there: a forward
    after the previous stage's forward of that micro-batch, a backward after its own forward and the next stage's
    backward (plus `delay` where they come from another queue: a send). Returns the makespan and each op's end."""
    owner = {s: q for q, ops in enumerate(queues) for _, s, _ in ops}
    end: dict = {}
    heads, free = [0] * len(queues), [0.0] * len(queues)
    left = sum(len(ops) for ops in queues)
    while left:
        moved = False
        for q, ops in enumerate(queues):
            while heads[q] < len(ops):
                kind, s, i = ops[heads[q]]
                deps = [_done_key(d) if d[1] != s else d for d in depends(Action(kind, i, s), stages)]
                if any(d not in end for d in deps):
                    break
                ready = max((end[d] + (delay if owner[d[1]] != q else 0.0) for d in deps), default=0.0)
                end[kind, s, i] = max(free[q], ready) + duration(kind, s)
                end[_done_key((kind, s, i))] = free[q] = end[kind, s, i]
                heads[q] += 1
                left -= 1
                moved = True
        if not moved:
            stuck = [ops[h] for ops, h in zip(queues, heads) if h < len(ops)]
            raise RuntimeError(f"pipeline schedule stalls at {stuck}")
    return max(free), end


def _gradients_ready(end: dict, parts: list[dict], makespan: float, split: bool) -> list[tuple[float, int]]:
    """(time, bytes) of each part's gradients, the last part first: at its last backward; a split backward's after
    the step (bench_stage.py all-reduces them itself then, without DDP)."""
    return [(makespan if split else max(v for (k, s, _), v in end.items() if k == BACKWARD and s == j),
             parts[j]["bytes"]) for j in reversed(range(len(parts)))]


def _allreduce_time(profile: dict, nbytes: float, replicas: int, across_nodes: bool) -> tuple[float, str | None]:
    """One all-reduce of `nbytes` among `replicas` tasks: the profile's table (between nodes where the replicas
    span nodes), scaled by a ring's 2(n-1)/n from the count it was timed with."""
    tables = profile["allreduce"]
    table = (tables.get("nodes") if across_nodes else None) or tables.get("node")
    note = None
    if across_nodes and table is tables.get("node"):
        note = "the all-reduce between nodes was not profiled (one node): estimated from one node's"
    if not table or not table.get("points"):
        raise ProfileError("the profile timed no all-reduce (it ran as one task): take it with the tasks per node "
                           "you train with (srun --ntasks-per-node=K ... benchmarks/speed_profile.py)")
    n = table["tasks"]
    ring = ((replicas - 1) / replicas) / ((n - 1) / n)
    return _interpolate(table["points"], nbytes) * ring, note


def _buckets(nbytes: int, first: bool) -> list[int]:
    """DDP's buckets of one device's gradients (the model's last parameters fill the first, 1 MiB, bucket)."""
    out, left = [], nbytes
    while left > 0:
        cap = DDP_FIRST_BUCKET_BYTES if first and not out else DDP_BUCKET_BYTES
        out.append(min(cap, left))
        left -= out[-1]
    return out


def _exposed_allreduce(profile: dict, ready: list[tuple[float, int]], makespan: float, replicas: int,
                       across: bool, notes: list[str]) -> float:
    """The all-reduce time the step waits for: buckets reduced one after the other as their gradients are ready
    (`ready`: (time, bytes) per part, the last part first). A GPU reduces while it computes (its own stream);
    a CPU's cores are the ones computing, so there none of it is hidden."""
    done, total, first = 0.0, 0.0, True
    for at, nbytes in sorted(ready):
        for size in _buckets(nbytes, first):
            cost, note = _allreduce_time(profile, size, replicas, across)
            if note and note not in notes:
                notes.append(note)
            done, total, first = max(done, at) + cost, total + cost, False
    return total if profile["device"] == "cpu" else max(0.0, done - makespan)


def _step_residual(profile: dict, model: dict, t: "Training", tasks: int, threads: int | None) -> float:
    """The replica layout's fixed cost per step that its parts do not show: one real step of the whole model
    (speed_profile.time_replica_step: DDP, the Pipe, AdamW, the stop flag) less its blocks, its optimizer and the
    engine's own cost; scaled by the gradients' bytes where the plan's model has more or fewer layers."""
    steps = profile.get("replica_step") or []
    if not steps:
        return 0.0
    rec, _ = _nearest(steps, profile, tasks, threads)
    plain = replace(t, precision="fp32", activation_checkpointing=False)
    ctx, _ = _context(profile, rec["tasks"], rec.get("threads"))
    measured_model = dict(model, nlayers=rec["nlayers"])
    (part,) = _part_costs(profile, ctx, measured_model, plain, 1, rec["micro"])
    engine = profile["engine"]
    rest = rec["step_s"] - part["f"] - part["b"] - part["optimizer"] - engine["per_step_s"] \
        - engine["per_micro_batch_part_s"]
    bytes_now = sum(p["bytes"] for p in _part_costs(profile, ctx, model, plain, 1, 1))
    return max(0.0, rest) * (bytes_now / part["bytes"] if rec["replicas"] > 1 else 1.0)


def _engine_costs(profile: dict, ctx: dict, stage: bool, stage_costs: tuple | None, notes: list[str]
                  ) -> tuple[float, float]:
    """The engine's cost per op (a forward or a backward of a micro-batch on a part or stage) and per step: the
    stage layout's from the fit to its real steps, else the tiny model's; the replica layout's hand-off as measured
    with the real model in the same context, where it was."""
    if stage_costs:
        return stage_costs[1], stage_costs[2]
    if stage:
        engine = profile.get("stage_engine")
        if engine is None:
            notes.append("the stage layout's engine was not profiled (one task, or torch < 2.4): its cost per "
                         "micro-batch is left out")
            return 0.0, 0.0
        return engine["per_micro_batch_stage_s"] / 2, engine["per_step_s"]
    engine, real = profile["engine"], (ctx.get("engine") or {}).get("per_micro_batch_part_s")
    return (real if real is not None else engine["per_micro_batch_part_s"]) / 2, engine["per_step_s"]


def predict_speed(profile: dict, model: dict, t: "Training", nb_part: int, replicas: int, tasks_per_node: int,
                  nodes: int = 1, threads: int | None = None,
                  stage_costs: tuple[float, float, float] | None = None) -> dict:
    """Step time and samples/s of one split (model: the model's arguments with batch_size and chunks; nb_part: the
    replica's parts, or --pp in the stage layout; threads: a CPU task's, default the trainer's), with the terms
    that add up to it (SPEED_TERMS). The stage layout's costs, (factor on the blocks, cost per forward or backward
    of a micro-batch on a stage, cost per step), default to the fit to the profile's real steps (_stage_fit)."""
    stage = t.layout == "stage"
    chunks, batch = model["chunks"], model["batch_size"]
    pp = nb_part if stage else 1
    stages = nb_part * (schedule(t.schedule).stages_per_rank(t.virtual_stages) if stage else 1)
    micro = batch / chunks
    ctx, slower = _context(profile, tasks_per_node, threads)
    fit = _stage_fit(profile, model, t) if stage and stage_costs is None else None
    if fit:
        stage_costs = (_stage_scale(fit, _overlap(chunks, pp)), fit["per_op"], fit["per_step"])
    parts = _part_costs(profile, ctx, model, t, stages, micro, stage_costs[0] if stage_costs else 1.0)
    notes: list[str] = []
    per_op, per_step = _engine_costs(profile, ctx, stage, stage_costs, notes)
    shared = not stage and (profile["device"] == "cpu" or bool(t.devices and len(set(t.devices)) < len(t.devices)))
    queues = _queues(t.layout, t.schedule, stages, pp, chunks, shared)
    act = micro * model["seq_len"] * model["d_model"] * 4  # a micro-batch's activations between stages, fp32
    # the engine's cost already holds a send of its tiny activation: the delay is what a larger one adds
    p2p = profile.get("p2p") if stage else None
    delay = max(0.0, _interpolate(p2p, act) - p2p[0][1]) if p2p else 0.0
    compute = lambda kind, s: op_time(parts[s], kind, s) * slower  # noqa: E731
    bare, _ = _simulate(queues, lambda k, s: compute(k, s) + per_op, 0.0, stages)
    makespan, end = _simulate(queues, lambda k, s: compute(k, s) + per_op, delay, stages)
    busy = max(queues, key=lambda ops: sum(compute(k, s) for k, s, _ in ops))
    work, overhead = sum(compute(k, s) for k, s, _ in busy), per_op * len(busy) + per_step
    comm = makespan - bare
    residual = 0.0 if stage else _step_residual(profile, model, t, tasks_per_node, threads)
    if replicas > 1:
        ready = _gradients_ready(end, parts, makespan, stage and split_backward(t.schedule))
        per_node = tasks_per_node // pp if stage else tasks_per_node
        across = nodes > 1 and replicas > per_node
        groups = [[r] for r in ready] if stage else [ready]  # a stage layout's stages reduce at the same time
        exposed = [_exposed_allreduce(profile, g, makespan, replicas, across, notes) for g in groups]
        if stage or not residual:
            comm += max(exposed)
        else:  # the all-reduce as it ran in the real step, less what the backward hides on a GPU
            full = _exposed_allreduce(dict(profile, device="cpu"), ready, makespan, replicas, across, [])
            comm += residual * (exposed[0] / full if full else 1.0)
    elif residual:
        overhead += residual
    optimizer = (max(sum(parts[s]["optimizer"] for s in {s for _, s, _ in ops}) for ops in queues)
                 if stage else sum(p["optimizer"] for p in parts))
    if t.zero and replicas > 1:  # each replica steps its share, then broadcasts it: about half an all-reduce
        share = sum(p["bytes"] for p in parts) / (pp if stage else 1)
        optimizer = optimizer / replicas + _allreduce_time(profile, share, replicas, replicas > tasks_per_node)[0] / 2
    terms = {"compute": work, "bubble": bare - work - per_op * len(busy), "per_micro_batch": overhead,
             "communication": comm, "optimizer": optimizer}
    terms["bubble"] = max(0.0, terms["bubble"]) if terms["bubble"] > -1e-9 else terms["bubble"]  # rounding only
    step = sum(terms.values())
    speed = batch * replicas / step
    if not (math.isfinite(speed) and speed > 0):  # times of 5e-324 s passed the schema: 'inf samples/s' (issue 42)
        raise ProfileError(f"the profile's times give a step of {step:.3g} s: too short to be a measurement; "
                           "take it again with benchmarks/speed_profile.py")
    return {"step_s": step, "samples_per_s": speed, "terms": terms, "notes": notes}

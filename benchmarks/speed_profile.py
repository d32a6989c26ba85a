#!/usr/bin/env python
"""The one-minute speed profile that `check_topology.py --advise --profile FILE` ranks the splits by.

Run it as one job step of the allocation you will train in, with the most tasks per node you will train with, the
module you will train with, and the trainer's model options (the blocks are timed as the trainer builds them):
    srun --ntasks-per-node=4 -n 4 -c 10 python benchmarks/speed_profile.py --out profile.json --nlayers 16
    torchrun --standalone --nproc-per-node 2 benchmarks/speed_profile.py --out profile.json      (CPU: gloo)
then
    python check_topology.py --advise --profile profile.json --nodes 2 -C v100-32g --global-batch 512 --nlayers 16

What it measures, each the median of --repeats timings on this task's first device (kit/speed.py reads it):
  - each block the trainer builds (Encoder, one Layer, Decoder): forward and backward at micro-batch sizes 1, 2, 4,
    ... --max-micro, in each precision this device has, a Layer with and without activation checkpointing; with
    every task of the node timing at once (their share of the cores on a CPU), and on a CPU also one task alone
    with all of them (one process per node runs that way);
  - the Pipe engine's fixed cost per step and per micro-batch and part (the trainer's own PipeModel on two tiny
    parts: scatter, gather, the hand-off to each part's worker; and with the real model in two parts, in each
    context: where parts share a CPU the hand-offs cost more), and, from 2 tasks on torch >= 2.4, the stage
    layout's per micro-batch and stage (bench_stage.py's own Stages on a tiny model: the schedule and its sends);
  - all-reduce time against bytes between the tasks of one node and, with 2 nodes or more, between nodes (one task
    each), on the job's backend; send/receive between two tasks of one node;
  - AdamW's step on each block's parameters.
It writes one JSON file (rank 0, atomically) keyed by node type, GPU, torch release and model; numbers in seconds.
"""
import argparse
import json
import os
import socket
import stat
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kit.train.checkpoint  # noqa: E402
import kit.train.errors  # noqa: E402
import kit.train.launch  # noqa: E402
import kit.train.options  # noqa: E402
import kit.train.parts  # noqa: E402
import kit.train.pipe  # noqa: E402
import kit.train.setup  # noqa: E402
import kit.train.trainer  # noqa: E402
import kit.train.transformer  # noqa: E402
import kit.allocation  # noqa: E402
import kit.arguments  # noqa: E402
import kit.findings  # noqa: E402
import kit.memory  # noqa: E402
import kit.plan  # noqa: E402
import kit.releases  # noqa: E402
import kit.site  # noqa: E402
import kit.speed  # noqa: E402
import idr_torch  # noqa: E402


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """The profile's own options, then the trainer's (its parser: the same names, ranges and refusals)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                epilog="Other options are the trainer's (bench_ddp_transformer.py --help): the "
                                       "model's size; --chunks, --batch-size and the layout's are not used.")
    p.add_argument("--out", required=True, help="the JSON file to write (rank 0)")
    p.add_argument("--max-micro", type=int, default=64, help="largest micro-batch timed (a power of 2 up to it); "
                   "larger ones are extrapolated: give the largest batch / chunks you will run (default 64)")
    p.add_argument("--precisions", help="comma-separated (default: fp32 and the device's low precision)")
    p.add_argument("--repeats", type=int, default=5, help="timings per figure, the median kept (default 5)")
    args, rest = p.parse_known_args(argv)
    if args.max_micro < 1 or args.repeats < 1:
        p.error(f"--max-micro ({args.max_micro}) and --repeats ({args.repeats}) must be at least 1")
    try:
        cfg = kit.arguments.parse_trainer_args("replica", rest)
    except kit.arguments.ArgumentError as exc:
        p.error(str(exc))
    return args, cfg


def precisions_of(args: argparse.Namespace, cuda: bool) -> list[str]:
    """fp32 and the low precision the trainer offers on this device (V100: fp16 only; kit.memory.arch_of)."""
    if args.precisions:
        chosen = args.precisions.split(",")
        bad = [x for x in chosen if x not in kit.arguments.PRECISIONS]
        if bad:
            raise SystemExit(f"profile: --precisions {bad[0]!r} is not one of {', '.join(kit.arguments.PRECISIONS)}")
        return chosen
    arch = kit.memory.arch_of(torch.cuda.get_device_capability() if cuda else None)
    return ["fp32", "fp16" if arch == "sm70" else "bf16"]


class Timer:
    """Wall time of a callable on the task's devices, synchronised before and after (GPU kernels are asynchronous).
    `device` is the first: the blocks are timed there."""

    def __init__(self, devices: list[torch.device], repeats: int) -> None:
        self.devices, self.device, self.repeats = devices, devices[0], repeats

    def sync(self) -> None:
        for d in self.devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)

    def median(self, fn, warmup: int = 1) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def make_block(kind: str, cfg: argparse.Namespace, precision: str, ckpt: bool, device: torch.device):
    """One block as the trainer builds it (kit.train.transformer's classes), in a Part for its autocast."""
    if kind == "Encoder":
        block = kit.train.transformer.Encoder(cfg.vocab_size, cfg.d_model, cfg.dropout, cfg.seq_len)
    elif kind == "Layer":
        block = kit.train.transformer.Layer(cfg.d_model, cfg.n_head, cfg.d_hid, cfg.dropout, ckpt)
    else:
        block = kit.train.transformer.Decoder(cfg.d_model, cfg.d_hid)
    return kit.train.options.Part(block, precision=precision).to(device)


def time_block(kind: str, block, cfg: argparse.Namespace, micro: int, timer: Timer, tokens: bool = False
               ) -> tuple[float, float]:
    """(forward, backward) of one micro-batch through one block, inputs as the pipeline hands them over: each the
    median of --repeats, forward and backward timed in the same iteration, after two warm-up iterations."""
    dev = timer.device
    if kind == "Encoder" or tokens:
        x = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len), device=dev)
    else:
        x = torch.randn(micro, cfg.seq_len, cfg.d_model, device=dev, requires_grad=True)
    y = torch.randint(0, 2, (micro,), device=dev)
    fwd, bwd = [], []
    for i in range(timer.repeats + 2):
        timer.sync()
        t0 = time.perf_counter()
        out = block(x)
        loss = F.cross_entropy(out.float(), y) if kind == "Decoder" else out.float().sum()
        timer.sync()
        t1 = time.perf_counter()
        loss.backward()
        timer.sync()
        if i >= 2:
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)
        block.zero_grad(set_to_none=True)
        x.grad = None if x.is_floating_point() else x.grad
    return statistics.median(fwd), statistics.median(bwd)


def time_blocks(cfg: argparse.Namespace, precisions: list[str], max_micro: int, timer: Timer) -> dict:
    """{"Encoder|fp32|0": [[micro, fwd_s, bwd_s], ...], "Layer|bf16|1": ...}: the key names the block, the
    precision, and activation checkpointing (Layers only: the others are never checkpointed). Bare, in this
    thread, as the stage layout's schedules run them."""
    table = {}
    for precision in precisions:
        for kind, ckpts in (("Encoder", (0,)), ("Layer", (0, 1)), ("Decoder", (0,))):
            for ckpt in ckpts:
                torch.manual_seed(0)
                block = make_block(kind, cfg, precision, bool(ckpt), timer.device)
                table[f"{kind}|{precision}|{ckpt}"] = [[m, *time_block(kind, block, cfg, m, timer)]
                                                       for m in micro_sizes(max_micro)]
                del block
    return table


def micro_sizes(max_micro: int) -> list[int]:
    return [1 << i for i in range(max_micro.bit_length()) if 1 << i <= max_micro]


def model_parts(cfg: argparse.Namespace, nb_part: int, precision: str, ckpt: bool, devices: list) -> list:
    """The trainer's own module_list (kit.train.parts.model_parts: the page's loop's parts) in nb_part parts, each
    moved to its device (the last one's for every part past the task's devices)."""
    run = argparse.Namespace(**{**vars(cfg), "precision": precision, "activation_checkpointing": bool(ckpt),
                                "seed": 0})
    parts = kit.train.parts.model_parts(run, kit.plan.plan_task(0, 0, 0, 1, [], None, cfg.nlayers, nb_part))
    return [p.to(devices[min(i, len(devices) - 1)]) for i, p in enumerate(parts)]


def time_whole(cfg: argparse.Namespace, precisions: list[str], max_micro: int, timer: Timer, engine: str) -> dict:
    """The whole model (Encoder, --nlayers Layers, Decoder) as one part inside the replica layout's Pipe, one
    chunk: {"fp32|0": [[micro, fwd_s, bwd_s], ...], ...}. The Pipe runs a part in a worker thread of its own; on a
    CPU that thread's intra-op threads and the main thread's take turns on the same cores (measured with the CPU
    defaults on 2 cores, 2 threads: 22 ms a step bare, 42-48 ms through the Pipe), which the bare blocks do not
    show. The model splits this time between parts as the bare blocks split theirs."""
    table = {}
    for precision in precisions:
        for ckpt in (0, 1):
            [part] = model_parts(cfg, 1, precision, ckpt, [timer.device])
            model = kit.train.pipe.PipeModel([part], engine, 1, [str(timer.device)])
            try:
                table[f"{precision}|{ckpt}"] = [[m, *time_block("Decoder", model, cfg, m, timer, tokens=True)]
                                                for m in micro_sizes(max_micro)]
            finally:
                model.close()
    return table


def time_engine_real(cfg: argparse.Namespace, max_micro: int, timer: Timer, engine: str, whole: list) -> dict | None:
    """The Pipe's cost per micro-batch and part with the real model split in two parts (batch 16: chunks 1 and 16),
    beyond what the same micro-batches cost through one part: where parts share a CPU, every hand-off switches the
    work between the Pipe's worker thread and the main thread (backward), whose intra-op thread teams then compete
    for the cores, a cost a tiny part does not show (its ops run on one thread). None below 2 Layers."""
    if cfg.nlayers < 2 or max_micro < 16:
        return None
    devices = [timer.devices[0], timer.devices[-1]]
    parts = model_parts(cfg, 2, "fp32", False, devices)
    times = {}
    for chunks in (1, 16):
        model = kit.train.pipe.PipeModel(parts, engine, chunks, [str(d) for d in devices])
        try:
            times[chunks] = sum(time_block("Decoder", model, cfg, 16, timer, tokens=True))
        finally:
            model.close()
    one = {m: f + b for m, f, b in whole}
    per = (times[16] - times[1] - (16 * one[1] - one[16])) / (15 * 2)
    return {"per_micro_batch_part_s": max(per, 0.0), "batch": 16, "chunks": [1, 16],
            "step_s": [times[1], times[16]]}


def time_optimizer(cfg: argparse.Namespace, timer: Timer) -> dict:
    """AdamW's step on each block's parameters, in seconds (the trainer's optimizer, kit.train.options.make_optimizer)."""
    out = {}
    for kind in ("Encoder", "Layer", "Decoder"):
        block = make_block(kind, cfg, "fp32", False, timer.device)
        for q in block.parameters():
            q.grad = torch.randn_like(q)
        opt = kit.train.options.make_optimizer(block.parameters(), 1e-3, False)
        out[kind] = timer.median(opt.step, warmup=2)
    return out


def time_engine(engine: str, timer: Timer) -> dict:
    """The Pipe's own cost (kit.train.pipe.PipeModel, the trainer's engine) on two parts so small that what
    is timed is the engine: scatter into micro-batches, the hand-off to each part's worker, the gather. Fitted as
    per_step + chunks x parts x per_micro_batch_part from chunks 1 and 16 (batch 16)."""
    devices = [timer.devices[0], timer.devices[-1]]
    times = {}
    for chunks in (1, 16):
        parts = [torch.nn.Sequential(torch.nn.Linear(8, 8)).to(d) for d in devices]
        model = kit.train.pipe.PipeModel(parts, engine, chunks, [str(d) for d in devices])
        x = torch.randn(16, 8, device=devices[0])
        try:
            times[chunks] = timer.median(lambda: model(x).float().sum().backward(), warmup=3)
        finally:
            model.close()
    per = max(times[16] - times[1], 0.0) / (15 * len(devices))
    return {"engine": engine, "per_step_s": max(times[1] - len(devices) * per, 0.0), "per_micro_batch_part_s": per,
            "shared_device": devices[0] == devices[-1]}


def time_stage_engine(cuda: bool, timer: Timer, tasks: kit.train.launch.Tasks) -> dict | None:
    """bench_stage.py's Stages (torch.distributed.pipelining, pp 2 over all tasks) on a tiny model: its cost
    per step and per micro-batch and stage (the schedule, the sends and receives of a tiny activation). Every task
    takes part; None where the stage layout cannot run (one task, an odd count, torch < 2.4)."""
    world = idr_torch.size
    if world < 2 or world % 2 or kit.releases.version_tuple(torch.__version__) < (2, 4):
        return None
    import bench_stage
    # 1F1B, or GPipe where the trainer refuses 1F1B (on gloo before torch 2.8: kit.releases.TORCH_FEATURES)
    one_f_one_b = kit.arguments.Training(layout="stage", schedule="1f1b")
    schedule = "gpipe" if kit.releases.torch_refusals(torch.__version__, one_f_one_b, cpu=not cuda) else "1f1b"
    times = {}
    for chunks in (2, 16):
        cfg = bench_stage.parse_args(["--pp", "2", "--schedule", schedule, "--nlayers", "2", "--d-model", "8",
                                      "--n-head", "1", "--d-hid", "8",
                                      "--seq-len", "4", "--vocab-size", "16", "--chunks", str(chunks),
                                      "--batch-size", "16", "--dropout", "0"])
        kit.train.setup.resolve(cfg, cuda)
        stages = bench_stage.Stages(cfg, bench_stage.make_plan(cfg, cuda), cuda, tasks)
        stages.start()
        x, y = torch.randint(0, 16, (16, 4)), torch.randint(0, 2, (16,))
        try:
            times[chunks] = timer.median(lambda: stages.train_step(x, y), warmup=3)
        finally:
            stages.close()
    per = max(times[16] - times[2], 0.0) / (14 * 2)
    return {"schedule": schedule, "per_step_s": max(times[2] - 2 * 2 * per, 0.0), "per_micro_batch_stage_s": per}


STAGE_MODEL = ("nlayers", "d_model", "n_head", "d_hid", "seq_len", "vocab_size", "dropout")


def time_stage_steps(cfg: argparse.Namespace, cuda: bool, max_micro: int, timer: Timer, tasks: kit.train.launch.Tasks
                     ) -> dict | None:
    """Real steps of the stage layout with the real model: bench_stage.Stages, pp 2 over all tasks (dp = tasks / 2),
    the schedule the trainer allows here; 2 and 8 micro-batches of 1, 4, 16 and 64 samples (up to --max-micro):
    [[micro, chunks, seconds], ...]. kit.speed._stage_fit finds in them what the stage layout costs beyond its
    bare blocks: per micro-batch DDP's hooks on every stage (find_unused_parameters' graph walk), the loss, the
    schedule's bookkeeping (a tiny model's stages, time_stage_engine, showed 2 to 4 times less); on the blocks, a
    stage's distinct Layers, whose weights a single Layer timed alone keeps in the cache, and on a CPU the stages
    that compute at once (more of the step with more micro-batches) sharing the memory's bandwidth.
    None where the stage layout cannot run (one task, an odd count, torch < 2.4, under 2 Layers)."""
    world = idr_torch.size
    if world < 2 or world % 2 or kit.releases.version_tuple(torch.__version__) < (2, 4) or cfg.nlayers < 2:
        return None
    import bench_stage
    one_f_one_b = kit.arguments.Training(layout="stage", schedule="1f1b")
    schedule = "gpipe" if kit.releases.torch_refusals(torch.__version__, one_f_one_b, cpu=not cuda) else "1f1b"
    model_argv = [a for k in STAGE_MODEL for a in (f"--{k.replace('_', '-')}", str(getattr(cfg, k)))]
    points = []
    for micro, chunks in [(m, c) for m in (1, 4, 16, 64) for c in (2, 8) if m <= max_micro]:
        batch = micro * chunks
        stage_cfg = bench_stage.parse_args(["--pp", "2", "--schedule", schedule, "--chunks", str(chunks),
                                            "--batch-size", str(batch), *model_argv])
        kit.train.setup.resolve(stage_cfg, cuda)
        stages = bench_stage.Stages(stage_cfg, bench_stage.make_plan(stage_cfg, cuda), cuda, tasks)
        stages.start()
        x, y = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len)), torch.randint(0, 2, (batch,))
        flag = torch.zeros(1)

        def step():  # as train_epoch runs it: the step, then the stop flag's all-reduce (StopRequest.agreed)
            stages.train_step(x, y)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=tasks.host_group)
        try:
            points.append([micro, chunks, timer.median(step, warmup=2)])
        finally:
            stages.close()
    launch = idr_torch.current()
    return {"tasks": launch.local_world_size, "threads": None if cuda else torch.get_num_threads(), "pp": 2,
            "replicas": world // 2, "schedule": schedule, "nlayers": cfg.nlayers, "points": points}


def time_replica_step(cfg: argparse.Namespace, engine: str, micro: int, timer: Timer, group,
                      tasks: kit.train.launch.Tasks) -> float:
    """One real step of the replica layout with the whole model in one part: the trainer's PipeModel inside DDP over
    `group`, its forward_backward, AdamW's step and the stop flag's all-reduce (StopRequest.agreed), as
    Replica.train_step and train_epoch run them. What this costs beyond its blocks and its optimizer is the step's
    fixed cost: DDP's hooks and all-reduces as they really run beside the compute, the Pipe's per-step work, the
    flag."""
    from torch.nn.parallel import DistributedDataParallel
    parts = model_parts(cfg, 1, "fp32", False, [timer.device])
    model = kit.train.pipe.PipeModel(parts, engine, 1, [str(timer.device)])
    try:
        ddp = DistributedDataParallel(model, process_group=group)
        opt = kit.train.options.make_optimizer(model.parameters(), 1e-3, False)
        flag = torch.zeros(1)
        x = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len), device=timer.device)
        y = torch.randint(0, 2, (micro,), device=timer.device)

        def step():
            opt.zero_grad(set_to_none=True)
            kit.train.trainer.forward_backward(ddp, x, y)
            opt.step()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=tasks.host_group or group)
        return timer.median(step, warmup=3)
    finally:
        model.close()


def replica_steps(cfg: argparse.Namespace, engine: str, timer: Timer, cuda: bool, tasks: kit.train.launch.Tasks
                  ) -> list[dict]:
    """time_replica_step at micro-batch 8 with every task of the job in one DDP group, then on a CPU task 0 alone in
    a group of its own, as the compute contexts are."""
    launch, micro = idr_torch.current(), 8
    threads = None if cuda else torch.get_num_threads()
    out = [{"tasks": launch.local_world_size, "threads": threads, "replicas": idr_torch.size, "micro": micro,
            "nlayers": cfg.nlayers, "step_s": time_replica_step(cfg, engine, micro, timer, None, tasks)}]
    alone = dist.new_group([0]) if idr_torch.size > 1 else None
    for t in alone_threads(cuda, launch.local_world_size, threads):
        barrier(tasks)
        rec = hold_others(lambda: with_threads(t, lambda: {
            "tasks": 1, "threads": t, "replicas": 1, "micro": micro, "nlayers": cfg.nlayers,
            "step_s": time_replica_step(cfg, engine, micro, timer, alone, tasks)}))
        out += [rec] if rec else []
    return out


def alone_threads(cuda: bool, tasks: int, threads: int | None) -> list[int]:
    """The thread counts task 0 is timed with alone, on a CPU: one, and every core it may use (what a task alone
    on a node runs with, the trainer's cpu_threads), less the context every task was timed in already."""
    if cuda:
        return []
    return [t for t in sorted({1, len(os.sched_getaffinity(0))}) if (1, t) != (tasks, threads)]


def with_threads(n: int, work):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return work()
    finally:
        torch.set_num_threads(before)


def hold_others(work):
    """Task 0 runs work() alone and returns its value; the others wait in a blocking receive (gloo's barrier polls,
    and would take a core from task 0: measured) and return None."""
    flag = torch.zeros(1)
    if idr_torch.rank == 0:
        out = work()
        for peer in range(1, idr_torch.size):
            dist.send(flag, peer)
        return out
    dist.recv(flag, 0)
    return None


SIZES = [1 << k for k in range(12, 27, 2)]  # 4 KiB to 64 MiB: a bucket of DDP (25 MiB by default) and more


def time_allreduce(ranks: list[int], timer: Timer) -> list[list[float]] | None:
    """[[bytes, seconds], ...] of one all-reduce among `ranks` (a new group: every task must call this)."""
    if len(ranks) < 2:
        return None
    group = dist.new_group(ranks)
    if idr_torch.rank not in ranks:
        return None
    points = []
    for size in SIZES:
        t = torch.ones(size // 4, device=timer.device)
        points.append([size, timer.median(lambda: dist.all_reduce(t, group=group), warmup=2)])
    return points


def time_p2p(timer: Timer) -> list[list[float]] | None:
    """[[bytes, seconds], ...] of one send from task 0 to task 1 (half a round trip), where they share a node."""
    if idr_torch.size < 2 or idr_torch.current().tasks_per_node[0] < 2 or idr_torch.rank > 1:
        return None
    points = []
    for size in SIZES[:5]:  # activations between stages: micro x seq x d_model x 4 bytes
        t = torch.ones(size // 4, device=timer.device)
        peer = 1 - idr_torch.rank

        def round_trip():
            if idr_torch.rank == 0:
                dist.send(t, peer)
                dist.recv(t, peer)
            else:
                dist.recv(t, peer)
                dist.send(t, peer)
        points.append([size, timer.median(round_trip, warmup=2) / 2])
    return points


def node_ranks(launch: idr_torch.Launch) -> tuple[list[int], list[int]]:
    """The ranks of node 0, and the first rank of each node (tasks are numbered node by node: Slurm's block
    distribution, torchrun's)."""
    starts = [sum(launch.tasks_per_node[:i]) for i in range(launch.num_nodes)]
    return list(range(launch.tasks_per_node[0])), starts


def barrier(tasks: kit.train.launch.Tasks) -> None:
    if tasks.launch.size > 1:
        dist.barrier(group=tasks.host_group)


def compute_contexts(cfg: argparse.Namespace, precisions: list[str], max_micro: int, timer: Timer,
                     cuda: bool, engine: str, tasks: kit.train.launch.Tasks) -> list[dict]:
    """The blocks (bare) and the whole model (in the Pipe) timed by every task at once, each with its share of the
    cores; then on a CPU by task 0 alone, with one thread and with all the cores it may use."""
    launch = idr_torch.current()
    threads = None if cuda else torch.get_num_threads()

    def context(tasks: int, threads: int | None) -> dict:
        whole = time_whole(cfg, precisions, max_micro, timer, engine)
        return {"tasks": tasks, "threads": threads, "nlayers": cfg.nlayers,
                "blocks": time_blocks(cfg, precisions, max_micro, timer), "whole": whole,
                "engine": time_engine_real(cfg, max_micro, timer, engine, [*whole.values()][0])}
    barrier(tasks)
    contexts = [context(launch.local_world_size, threads)]
    for t in alone_threads(cuda, launch.local_world_size, threads):
        barrier(tasks)
        ctx = hold_others(lambda: with_threads(t, lambda: context(1, t)))
        contexts += [ctx] if ctx else []
    return contexts


def profile_key(cfg: argparse.Namespace, cuda: bool, device: torch.device) -> dict:
    """What a profile holds for: the node type (check_topology's reading of the allocation), the GPU, the torch
    release, the model's block (--nlayers does not matter: a Layer is timed once)."""
    node_type, allocation = None, idr_torch.allocation()
    if allocation["job_id"][1]:
        node_type = kit.site.node_type(kit.allocation.job_from_allocation(dict(os.environ)))
    return {"node_type": node_type, "partition": allocation["partition"][1],
            "gpu": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
            "model": {k: getattr(cfg, k) for k in kit.speed.PROFILE_MODEL}, "nlayers": cfg.nlayers}


def out_problem(out: str) -> str | None:
    """Why --out cannot be written (or None), checked by rank 0 before any timing: the profile is written to a
    temporary file beside it and renamed over it, so it must be a regular file or nothing yet (a device would be
    replaced), in an existing folder where a file can really be created (permissions, a read-only mount)."""
    if not out.strip():
        return f"--out {out!r} names no file; give one, e.g. --out profile.json"
    target = Path(out).expanduser()
    try:
        mode = target.stat().st_mode  # through a link: the file written is the one it points to (see main)
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        return f"--out {out}: cannot use it ({exc.strerror}); give another file, e.g. --out profile.json"
    if mode is not None and stat.S_ISDIR(mode):
        return f"--out {out} is a folder; give a file name, e.g. --out {target / 'profile.json'}"
    if mode is not None and not stat.S_ISREG(mode):
        return (f"--out {out} is not a regular file (a device, pipe or socket): the profile is renamed over it, "
                "which would replace it; give a file, e.g. --out profile.json")
    folder = target.resolve().parent
    if not folder.is_dir():
        return f"--out {out}: folder {folder} does not exist; create it (mkdir -p {folder})"
    try:  # really create (and remove) a file there, as the trainer checks its outputs (kit.train.checkpoint.check_outputs)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"--out {out}: cannot write in {folder} ({exc.strerror}); give a folder you can write, e.g. $WORK"
    return None


def write_json(obj: dict, target: Path) -> None:
    """Whole or not at all: a new temporary file beside `target` (one file system, so the rename is atomic),
    fsync'ed, renamed over it, the folder fsync'ed; on any failure (a full disk, Ctrl-C) the temporary file is
    removed and `target` is as it was."""
    tmp = kit.train.checkpoint.temporary_file(target)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the user's umask, as the trainer's files
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(obj, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    kit.train.checkpoint.sync_folder(target.parent)


def measure(args: argparse.Namespace, cfg: argparse.Namespace, cuda: bool, plan: kit.plan.TaskPlan,
            engine: str, tasks: kit.train.launch.Tasks) -> dict:
    launch = idr_torch.current()
    devices = [torch.device(plan.device(i)) for i in range(plan.nb_part)] or [torch.device("cpu")]
    timer = Timer(devices, args.repeats)
    t0 = time.time()
    profile = {"format": kit.speed.PROFILE_FORMAT, "key": profile_key(cfg, cuda, devices[0]),
               "taken": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": socket.gethostname(),
               "device": "cuda" if cuda else "cpu", "backend": dist.get_backend() if launch.size > 1 else None,
               "nodes": launch.num_nodes, "tasks_per_node": launch.local_world_size, "max_micro": args.max_micro,
               "compute": compute_contexts(cfg, precisions_of(args, cuda), args.max_micro, timer, cuda, engine,
                                           tasks)}
    profile["optimizer"] = time_optimizer(cfg, timer)
    profile["engine"] = time_engine(engine, timer)
    profile["replica_step"] = replica_steps(cfg, engine, timer, cuda, tasks)
    barrier(tasks)
    profile["stage_engine"] = time_stage_engine(cuda, Timer([devices[0]], args.repeats), tasks)
    barrier(tasks)
    profile["stage_step"] = time_stage_steps(cfg, cuda, args.max_micro, Timer([devices[0]], args.repeats), tasks)
    on_node, firsts = node_ranks(launch)
    profile["allreduce"] = {"node": {"tasks": len(on_node), "points": time_allreduce(on_node, timer)},
                            "nodes": {"tasks": len(firsts), "points": time_allreduce(firsts, timer)}}
    barrier(tasks)
    profile["p2p"] = time_p2p(timer)
    profile["seconds"] = round(time.time() - t0, 1)
    return profile


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse(argv)
    cuda = torch.cuda.is_available()
    kit.train.setup.resolve(cfg, cuda)
    findings = kit.findings.Findings()
    plan = kit.train.setup.task_plan(cuda, cfg.nlayers, None, findings)
    kit.train.setup.verdict(findings)
    gpus = kit.train.setup.use_gpus(plan)  # torch.cuda.set_device(first_part) before anything touches CUDA
    launch = idr_torch.current()
    torch.set_num_threads(kit.train.setup.cpu_threads(launch))
    engine = kit.train.pipe.pick_engine(cfg.engine)
    rpc_file = None
    problem = out_problem(args.out) if launch.rank == 0 else None
    # resolved once: through a link, the file it points to is replaced and the link stays
    out = Path(args.out).expanduser().resolve()
    try:
        kit.train.launch.check_rendezvous(launch, cfg.timeout)
        tasks = kit.train.launch.init_distributed(cfg.timeout, cuda, gpus, "speed_profile")
        tasks.agree(problem)  # every task stops on task 0's verdict, before a minute of timing
        rpc_file = kit.train.pipe.init_rpc_for_pipe() if engine == "torch-pipe" else None
        profile = measure(args, cfg, cuda, plan, engine, tasks)
        if launch.rank == 0:
            try:
                write_json(profile, out)
            except OSError as exc:  # the folder was checked: a disk or quota that filled during the timing
                problem = (f"--out {args.out}: the profile could not be written ({exc.strerror or exc}); nothing "
                           "half-written is left: free some space (or give another --out) and run it again")
        tasks.agree(problem)
        if launch.rank == 0:
            kit.train.errors.log(f"profile: {args.out} written in {profile['seconds']:.0f} s ({profile['key']['gpu']}, torch "
                      f"{profile['key']['torch']}, {launch.size} task(s) on {launch.num_nodes} node(s))")
        barrier(tasks)
    finally:
        if rpc_file is not None:
            import torch.distributed.rpc as rpc
            rpc.shutdown(graceful=False)
            rpc_file.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    kit.train.errors.cli(lambda: main(), "speed_profile")

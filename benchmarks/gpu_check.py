#!/usr/bin/env python
"""The one-GPU check: what to run first on a GPU node (one task, nccl), in one short run.

    srun --gres=gpu:1 -n 1 python benchmarks/gpu_check.py             # or `make gpu-check` on the node
    python benchmarks/gpu_check.py --steps 40 --json-out report/gpu_check.jsonl
    python benchmarks/gpu_check.py --tasks 2      # two tasks with nccl between them, even on one GPU

Rows: the replica layout with nb_part 1 and with nb_part 2 (on a one-GPU node both parts on GPU 0, the trainer's
--devices 0,0, which the checker knows as parts-share-gpu), in fp32 and bf16. Each row runs the full script (bench_ddp_transformer.py,
nccl, one task) and then a bare loop on the same model, micro-batches and optimizer on the same GPU(s) in the same
process run: plain forward/backward per micro-batch, one AdamW step, no Pipe, no DDP. ratio = script samples/s /
bare samples/s; the goal is >= 0.95. One table out, and one JSON line per row (the trainer's record plus the bare
loop's figures) that slurm/report.py reads. Without a GPU it stops at once and says so (exit 2).

--tasks N runs the script as N tasks (torchrun's variables, one process each), so DDP's all-reduces and the kit's
collectives go through nccl between processes: the multi-task path. Where the tasks' parts outnumber the GPUs
(two tasks on a one-GPU machine), every part goes on GPU 0 and each task gets its own NCCL_HOSTID: nccl refuses two
ranks of one communicator on one GPU of one host ("Duplicate GPU detected", src/init.cc compares the host hash and
the GPU's bus id), and NCCL_HOSTID replaces the host hash (getHostHash, src/misc/utils.cc), so the tasks look like
two hosts and talk over nccl's network transport (sockets on `lo` unless NCCL_SOCKET_IFNAME says otherwise).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GOAL = 0.95


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps per row (after --warmup)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--nlayers", type=int, default=16)
    p.add_argument("--precision", choices=("fp32", "bf16", "both"), default="both")
    p.add_argument("--json-out", help="append one JSON line per row here")
    p.add_argument("--timeout", type=float, default=300, help="seconds one row's run may take")
    p.add_argument("--tasks", type=int, default=1, help="tasks (processes) per row, nccl between them; more tasks "
                   "than GPUs share GPU 0, each with its own NCCL_HOSTID")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "chunks", "nlayers", "timeout", "tasks"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup} must be 0 or more")
    if args.batch_size % args.chunks:
        p.error(f"--chunks {args.chunks} must divide --batch-size {args.batch_size}")
    return args


def one_gpu_devices(nb_part: int, gpus: int, tasks: int = 1) -> str | None:
    """--devices for a row: None where the node has a GPU per part of every task; else every part on GPU 0 (the
    pipeline still runs its nb_part stages and their sends, one after the other on one GPU)."""
    return None if nb_part * tasks <= gpus else ",".join("0" * nb_part)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def task_envs(tasks: int, shared_gpu: bool) -> list[dict[str, str]]:
    """The environment of each task of a row: this one for a single task; torchrun's variables for several (so
    idr_torch reads them, even inside an srun step), and an NCCL_HOSTID per task where they share a GPU."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_",
                                 "TORCHELASTIC", "NCCL_HOSTID"))}
    if tasks == 1:
        return [base]
    port = str(free_port())
    envs = []
    for rank in range(tasks):
        env = dict(base, RANK=str(rank), WORLD_SIZE=str(tasks), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(tasks),
                   GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHELASTIC_RUN_ID="gpu_check")
        if shared_gpu:
            env["NCCL_HOSTID"] = f"gpu-check-task-{rank}"
            env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        envs.append(env)
    return envs


def run_script(args: argparse.Namespace, nb_part: int, precision: str, work: Path, devices: str | None) -> dict:
    """The full script, --tasks tasks, nccl: its JSON record (samples/s of the timed steps, all replicas)."""
    out = work / f"row-{nb_part}-{precision}.jsonl"
    cmd = [sys.executable, str(ROOT / "bench_ddp_transformer.py"), "--nb-part", str(nb_part), "--nlayers",
           str(args.nlayers), "--batch-size", str(args.batch_size), "--chunks", str(args.chunks), "--epochs", "1",
           "--synthetic", str(args.batch_size * args.tasks * (args.steps + args.warmup + 2)), "--max-steps",
           str(args.steps + args.warmup), "--warmup-steps", str(args.warmup), "--cache-dir", str(work),
           "--json-out", str(out), "--timeout", str(args.timeout)]
    if precision != "fp32":
        cmd += ["--precision", precision]
    if devices:
        cmd += ["--devices", devices]
    if args.tasks > 1:
        cmd += ["--nb-part", str(nb_part)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for env in task_envs(args.tasks, devices is not None and args.tasks > 1)]
    try:
        results = [(p.wait(timeout=args.timeout + 60), *p.communicate()) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise
    for rank, (code, _, err) in enumerate(results):
        if code != 0:
            raise RuntimeError(f"the script failed on nb_part {nb_part} {precision}, task {rank} of {args.tasks} "
                               f"(exit {code}): {(err.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(out.read_text().splitlines()[-1])


def bare_loop(args: argparse.Namespace, nb_part: int, precision: str, devices: str | None) -> float:
    """The same model, micro-batches and AdamW, with nothing around them: samples/s on the same GPU(s)."""
    import torch
    import torch.nn.functional as F
    import bench_ddp_transformer as bench
    import check_topology
    cfg = bench.parse_args(["--nlayers", str(args.nlayers), "--batch-size", str(args.batch_size),
                            "--chunks", str(args.chunks), "--nb-part", str(nb_part)])
    bench.resolve(cfg, cuda=True)
    plan = check_topology.plan_task(0, 0, 0, 1, [str(i) for i in range(torch.cuda.device_count())], None,
                                    cfg.nlayers, nb_part, None, None if devices is None else
                                    [int(d) for d in devices.split(",")])
    parts = bench.build_module_list(cfg, plan)
    model = torch.nn.Sequential(*parts)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    first, last = plan.device(0), plan.device(nb_part - 1)
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), device=first)
    y = torch.randint(0, 2, (cfg.batch_size,), device=last)
    dtype = torch.bfloat16 if precision == "bf16" else None

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for xm, ym in zip(x.chunk(cfg.chunks), y.chunk(cfg.chunks)):
            h = xm
            for part, dev in zip(parts, [plan.device(i) for i in range(nb_part)]):
                with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                    h = part(h.to(dev))
            (F.cross_entropy(h.float(), ym) / cfg.chunks).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    return args.steps * cfg.batch_size / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print(f"gpu_check: error: no CUDA GPU here (torch {torch.__version__}, torch.cuda.is_available() is "
              f"False); run it on a GPU node: srun --gres=gpu:1 -n 1 python benchmarks/gpu_check.py",
              file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    rows, lines = [], []
    print(f"gpu_check: {name} x {gpus}, torch {torch.__version__}, nccl, {args.tasks} task(s); {args.steps} timed "
          f"steps, batch {args.batch_size} per task, chunks {args.chunks}, nlayers {args.nlayers}")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for nb_part in (1, 2):
            for precision in precisions:
                devices = one_gpu_devices(nb_part, gpus, args.tasks)
                label = (f"nb_part {nb_part} {precision}" + (f" x {args.tasks} tasks" if args.tasks > 1 else "")
                         + (f" (--devices {devices}" + (", NCCL_HOSTID per task)" if args.tasks > 1 else ")")
                            if devices else ""))
                if precision == "bf16" and not torch.cuda.is_bf16_supported():  # V100: the trainer refuses it
                    lines.append(f"| {label} | - | - | - | not run: {name} has no bf16 |")
                    continue
                try:
                    record = run_script(args, nb_part, precision, Path(tmp), devices)
                    bare = bare_loop(args, nb_part, precision, devices)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:  # one row's failure keeps the others
                    lines.append(f"| {label} | - | - | - | failed: {str(exc).splitlines()[0]} |")
                    rows.append({"check": "gpu_check", "row": label, "failed": str(exc)})
                    continue
                # tasks on GPUs of their own run one bare loop's work each; tasks sharing GPU 0 share one
                bare *= 1 if devices else args.tasks
                ratio = record["samples_per_s"] / bare
                record.update(check="gpu_check", row=label, precision=precision, bare_samples_per_s=bare,
                              ratio=ratio, goal=GOAL, tasks=args.tasks)
                rows.append(record)
                lines.append(f"| {label} | {record['samples_per_s']:.1f} | {bare:.1f} | {ratio:.3f} | "
                             f"{'ok' if ratio >= GOAL else f'below the goal {GOAL}'} |")
                if args.json_out:  # row by row: a later failure or time limit loses nothing
                    with open(args.json_out, "a") as f:
                        f.write(json.dumps(record) + "\n")
    print("| row | script samples/s | bare loop samples/s | ratio | |\n| --- | --- | --- | --- | --- |")
    print("\n".join(lines))
    return 0 if rows and all(r.get("ratio", 0) >= GOAL for r in rows) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"gpu_check: error: {exc}", file=sys.stderr)
        sys.exit(1)

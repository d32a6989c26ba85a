#!/usr/bin/env python
"""The memory estimate against torch.cuda.max_memory_allocated and max_memory_reserved, per GPU, on a GPU machine.

    python benchmarks/memory_gpu.py                # the trainer's GPU defaults, fp32/bf16 x checkpointing
    python benchmarks/memory_gpu.py --nb-part 2    # split over 2 GPUs (with fewer GPUs, every part on cuda:0)
    python benchmarks/memory_gpu.py --jobs 4       # the four configurations side by side (`make gpu-check`)

Each configuration runs the trainer's own Replica (kit.train.replica: its model, --precision,
--activation-checkpointing, fairscale's Pipe, DDP over nccl in one process, its AdamW or GradScaler) three steps; the
peak of the third (optimizer state there, as in every later step) is compared per GPU with the estimate for this GPU's
kernels (kit.memory.ARCHS): the estimate without its allowance against max_memory_allocated, with it against
max_memory_reserved (the CUDA context is in neither, so the allowance should cover more than the difference). Then,
where torch has MemTracker (2.5 and later), a fourth step under benchmarks/memory_grid.py's tracker gives the ratio
per term: the static terms (weights, AdamW's state, DDP's buckets) and the rest of the peak (activations, weight
copies, gradients, temporaries), against the estimate of the step as a dispatch mode sees it (traced=True).
The estimate's GPU kernels (flash or memory-efficient attention, bool dropout masks) are assumptions read in
torch's sources (kit/memory.py): this is where they are checked.

Each configuration runs in a process of its own (this script again, --child), its measured steps before any
tracker. In one process, as before, the figures were wrong: torch's MemTracker keeps the model's parameters and
their gradients alive after its step (torch 2.13 on the CPU: all but 4 of the model's parameters survive the
trainer's close() and gc.collect(), 49 of 53 at the CPU defaults; tests/test_memory_gpu.py), so every later
configuration's max_memory_allocated carried the earlier ones' weights and gradients (the H200 of 2026-12-04: 1.33,
1.23 and 1.97 of the estimate, 1.00 with nothing before it), and without an empty_cache() max_memory_reserved showed
the first configuration's cache in every row. In a fresh process the caching allocator starts empty: empty_cache(),
then memory_allocated() and memory_reserved() are read before the model is built; the peak is counted from that
baseline (a note says when it is not 0), and the reserved memory is compared only where the cache was empty.
torch's caching allocator counts per process (torch.cuda.max_memory_allocated reads this process's allocator), so
--jobs N measures N configurations at once without changing a figure, as long as their peaks fit on the GPU
together.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import kit.train.replica  # noqa: E402
import kit.train.setup  # noqa: E402
import kit.arguments  # noqa: E402
import kit.memory  # noqa: E402
import kit.plan  # noqa: E402

GIB = kit.memory.GIB


def model_of(cpu: bool, dropout: float | None) -> dict:
    """The trainer's defaults for the device: the GPU's, or on the CPU (the tests) its small ones."""
    model = dict(kit.arguments.CPU_DEFAULTS if cpu else kit.arguments.GPU_DEFAULTS)
    if dropout is not None:
        model["dropout"] = dropout
    return model


def plan_of(model: dict, precision: str, ckpt: bool, nb_part: int, cuda: bool) -> tuple:
    """The trainer's configuration and plan on this machine's GPUs (every part on cuda:0 when there are fewer than
    nb_part), or on the CPU."""
    args = [f"--{k.replace('_', '-')}={v}" for k, v in model.items()]
    cfg = kit.arguments.parse_trainer_args("replica", args + ["--precision", precision, "--nb-part", str(nb_part)]
                                           + (["--activation-checkpointing"] if ckpt else []))
    kit.train.setup.resolve(cfg, cuda=cuda)
    gpus = torch.cuda.device_count() if cuda else 0
    plan = kit.plan.plan_task(0, 0, 0, 1, [str(i) for i in range(gpus)], gpus or None, cfg.nlayers, nb_part,
                                    devices=[0] * nb_part if cuda and gpus < nb_part else None)
    return cfg, plan


def replica(cfg, plan) -> tuple[kit.train.replica.Replica, torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """The trainer's Replica, started, and one batch where its step puts it."""
    torch.manual_seed(0)
    trainer = kit.train.replica.Replica(cfg, plan, "fairscale")
    trainer.start()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), generator=g)
    y = torch.randint(0, 2, (cfg.batch_size,), generator=g)
    return trainer, x.to(plan.device(0)), y.to(plan.device(plan.nb_part - 1))


def measure(model: dict, precision: str, ckpt: bool, nb_part: int, cuda: bool) -> dict:
    """Per part's device: memory_allocated and memory_reserved before the model (after empty_cache()), and
    max_memory_allocated and max_memory_reserved over the third step. On the CPU the steps run and nothing is read
    (the CPU has no caching allocator)."""
    cfg, plan = plan_of(model, precision, ckpt, nb_part, cuda)
    devices = [plan.device(i) for i in range(nb_part)]
    if cuda:
        torch.cuda.empty_cache()
        before = {d: (torch.cuda.memory_allocated(d), torch.cuda.memory_reserved(d)) for d in set(devices)}
    trainer, x, y = replica(cfg, plan)
    try:
        for step in range(3):
            if step == 2 and cuda:
                for d in set(devices):
                    torch.cuda.synchronize(d)
                    torch.cuda.reset_peak_memory_stats(d)
            trainer.train_step(x, y)
        if not cuda:
            return dict(allocated=None, reserved=None, before_allocated=None, before_reserved=None)
        for d in set(devices):
            torch.cuda.synchronize(d)
        return dict(allocated=[torch.cuda.max_memory_allocated(d) - before[d][0] for d in devices],
                    reserved=[torch.cuda.max_memory_reserved(d) for d in devices],
                    before_allocated=[before[d][0] for d in devices], before_reserved=[before[d][1] for d in devices])
    finally:
        trainer.close()


def terms(model: dict, precision: str, ckpt: bool, nb_part: int, cuda: bool) -> dict | None:
    """Per part, MemTracker's peak (benchmarks/memory_grid.py's tracker, each part on its own GPU here) by kind, and
    DDP's buckets; None without MemTracker. It leaves the model alive (see the docstring): run it last."""
    if importlib.util.find_spec("torch.distributed._tools.mem_tracker") is None:
        return None
    import memory_grid
    trainer, x, y = replica(*plan_of(model, precision, ckpt, nb_part, cuda))
    parts, box, buckets = list(trainer.model), [None], {}
    memory_grid.watch_parts(parts, box)

    def hook(state, bucket):  # noqa: ANN001  DDP's own allreduce, naming the buckets it runs on
        buckets[bucket.buffer().untyped_storage().data_ptr()] = bucket.buffer()
        return memory_grid.allreduce_hook(None, bucket)
    trainer.ddp_mp_model.register_comm_hook(None, hook)
    try:
        for _ in range(2):
            buckets.clear()
            trainer.train_step(x, y)
        trainer.optimizer.zero_grad(set_to_none=True)
        return memory_grid._traced_step(trainer, parts, box, buckets, x, y)
    finally:
        trainer.close()


def child(conf: dict, result: Path) -> int:
    """One configuration, in this fresh process: the measured steps, then the tracked step; JSON to `result`."""
    cuda = not conf["cpu"]
    torch.set_num_threads(conf["threads"])
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = model_of(conf["cpu"], conf["dropout"])
    args = (model, conf["precision"], conf["ckpt"], conf["nb_part"], cuda)
    out = measure(*args)
    shared = cuda and torch.cuda.device_count() < conf["nb_part"]
    out["terms"] = None if shared else terms(*args)
    out["pid"] = os.getpid()
    dist.destroy_process_group()
    result.write_text(json.dumps(out))
    return 0


def run_configuration(conf: dict, timeout: float) -> dict:
    """One configuration in a process of its own (this script, --child): its figures, or {"failed": why}."""
    with tempfile.TemporaryDirectory(prefix="memory-gpu-") as tmp:
        out = Path(tmp) / "result.json"
        try:
            r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(conf), str(out)],
                               capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"failed": f"no result within --timeout {timeout:g}s"}
        if r.returncode != 0 or not out.exists():
            return {"failed": f"exit {r.returncode}: {(r.stderr.strip().splitlines() or ['no output'])[-1]}"}
        return json.loads(out.read_text())


def arch_here(cpu: bool) -> str:
    return "cpu" if cpu else kit.memory.arch_of(torch.cuda.get_device_capability(0))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nb-part", type=int, default=1)
    p.add_argument("--dropout", type=float, help="the model's dropout (default: the trainer's)")
    p.add_argument("--jobs", type=int, default=1, help="configurations measured at once, each in its own process "
                   "(no figure changes; their peaks must fit on the GPU together)")
    p.add_argument("--timeout", type=float, default=300, help="seconds one configuration may take")
    p.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)  # the tests: the flow, on the CPU
    args = p.parse_args(argv)
    for name in ("nb_part", "jobs", "timeout"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("memory_gpu: no CUDA GPU here; run it on a GPU node (the CPU validation is benchmarks/memory_grid.py)",
              file=sys.stderr)
        return 2
    model, arch = model_of(args.cpu, args.dropout), arch_here(args.cpu)
    shared = not args.cpu and torch.cuda.device_count() < args.nb_part
    low = "bf16" if args.cpu or torch.cuda.is_bf16_supported() else "fp16"
    where = "the CPU (no allocator figures: the flow only)" if args.cpu else torch.cuda.get_device_name(0)
    print(f"{where} ({arch} kernels), torch {torch.__version__}, {'CPU' if args.cpu else 'GPU'} defaults, nb_part "
          f"{args.nb_part}" + (" (all parts on cuda:0: compared as one sum)" if shared else "")
          + "; each configuration in a fresh process", flush=True)
    print("| precision | ckpt | part | estimated peak GiB | max_memory_allocated GiB | allocated / estimated | "
          "estimate with allowance GiB | max_memory_reserved GiB | reserved / with allowance | peak at (estimate) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |", flush=True)
    confs = [dict(precision=p, ckpt=c, nb_part=args.nb_part, cpu=args.cpu, dropout=args.dropout)
             for p in ("fp32", low) for c in (False, True)]
    jobs, notes = jobs_that_fit(args, model, arch, shared, confs)
    for conf in confs:
        conf["threads"] = max(1, len(os.sched_getaffinity(0)) // jobs)
    worst, per_term, failed = 0.0, [], 0
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for conf, got in zip(confs, pool.map(lambda c: run_configuration(c, args.timeout), confs)):
            if "failed" in got:
                failed += 1
                print(f"| {conf['precision']} | {'yes' if conf['ckpt'] else 'no'} | - | - | - | - | - | - | - | "
                      f"failed: {got['failed']} |", flush=True)
                continue
            worst = max([worst, *rows(model, conf, got, arch, shared, notes)])
            per_term += term_rows(model, conf, got, arch)
    if not args.cpu:
        print(f"\nworst |allocated / estimated - 1| = {worst:.1%}")
    if notes:
        print("\n" + "\n".join(notes))
    if per_term:
        print("\nper term, MemTracker / estimate (traced): weights, AdamW state, the rest of the peak (activations, "
              "weight copies, gradients, temporaries), the whole peak without buckets; then DDP's buckets")
        print("| precision | ckpt | part | params | optimizer | rest | peak |\n"
              "| --- | --- | --- | ---: | ---: | ---: | ---: |")
        print("\n".join(per_term))
    return 1 if failed else 0


def jobs_that_fit(args: argparse.Namespace, model: dict, arch: str, shared: bool,
                  confs: list[dict]) -> tuple[int, list[str]]:
    """--jobs, or fewer where that many of the largest configuration (its estimate with allowance, per GPU) would
    not fit in 90 % of the GPU's memory together (a V100's 32 GB holds one at the GPU defaults, an H200 four)."""
    if args.cpu or args.jobs == 1:
        return args.jobs, []
    need = 0
    for conf in confs:
        t = kit.arguments.Training(precision=conf["precision"], activation_checkpointing=conf["ckpt"])
        est = kit.memory.estimate_memory(model, t, args.nb_part, 1, arch)
        need = max(need, kit.memory.shared_gpu_memory(est, [0] * args.nb_part)[2] if shared
                   else max(m.total for m in est))
    gpu = torch.cuda.get_device_properties(0).total_memory
    jobs = max(1, min(args.jobs, int(0.9 * gpu // need)))
    return jobs, [] if jobs == args.jobs else [
        f"note: --jobs {args.jobs}: {jobs} at once, as {jobs} of the largest configuration ({need / GIB:.1f} GiB with "
        f"its allowance) fit in 90 % of the GPU's {gpu / GIB:.1f} GiB"]


def rows(model: dict, conf: dict, got: dict, arch: str, shared: bool, notes: list[str]) -> list[float]:
    """Print a configuration's rows (one per part, or the parts' sum where they share cuda:0); |ratio - 1| each."""
    precision, ckpt, nb_part = conf["precision"], conf["ckpt"], conf["nb_part"]
    t = kit.arguments.Training(precision=precision, activation_checkpointing=ckpt)
    est = kit.memory.estimate_memory(model, t, nb_part, 1, arch)
    n = len(est)
    allocated, reserved = got["allocated"] or [None] * n, got["reserved"] or [None] * n
    clean = [r == 0 for r in got["before_reserved"] or [False] * n]
    for i, b in enumerate(got["before_allocated"] or []):
        if b:
            notes.append(f"note: {precision} ckpt {'yes' if ckpt else 'no'} part {i}: {b / GIB:.2f} GiB allocated "
                         "before the model was built (a fresh process holds none); its peak is counted from there")
    for i, r in enumerate(got["before_reserved"] or []):
        if r:
            notes.append(f"note: {precision} ckpt {'yes' if ckpt else 'no'} part {i}: the cache held {r / GIB:.2f} "
                         "GiB before the model was built: max_memory_reserved not compared")
    lines = [(m.peak, m.total, a, r if ok else None, m.peak_at) for m, a, r, ok in zip(est, allocated, reserved, clean)]
    if shared:
        lines = [(sum(m.peak for m in est), kit.memory.shared_gpu_memory(est, [0] * nb_part)[2], allocated[0],
                  reserved[0] if clean[0] else None, "sum of the parts")]
    out = []
    for i, (peak, total, a, r, at) in enumerate(lines):
        if a is not None:
            out.append(abs(a / peak - 1))
        print(f"| {precision} | {'yes' if ckpt else 'no'} | {'all' if shared else i} | {peak / GIB:.2f} | "
              f"{'-' if a is None else f'{a / GIB:.2f}'} | {'-' if a is None else f'{a / peak:.3f}'} | "
              f"{total / GIB:.2f} | {'-' if r is None else f'{r / GIB:.2f}'} | "
              f"{'-' if r is None else f'{r / total:.3f}'} | {at} |", flush=True)
    return out


def term_rows(model: dict, conf: dict, got: dict, arch: str) -> list[str]:
    """The per-term table's rows of a configuration: MemTracker's peak by kind against the traced estimate."""
    measured = got["terms"]
    if not measured:
        return []
    precision, ckpt = conf["precision"], conf["ckpt"]
    t = kit.arguments.Training(precision=precision, activation_checkpointing=ckpt)
    traced = kit.memory.estimate_memory(model, t, conf["nb_part"], 1, arch, traced=True)
    out = []
    for i, (m, e) in enumerate(zip(measured["parts"], traced)):
        kinds = m["kinds"]
        fixed = sum(kinds.get(k, 0) for k in ("Parameter", "Optstate", "Buffer", "Other"))
        rest = e.peak - e.params - e.optimizer - e.buckets - e.buffers - e.inputs
        out.append(f"| {precision} | {'yes' if ckpt else 'no'} | {i} | {kinds.get('Parameter', 0) / e.params:.3f} | "
                   f"{kinds.get('Optstate', 0) / e.optimizer:.3f} | {(m['peak'] - fixed) / rest:.3f} | "
                   f"{m['peak'] / (e.peak - e.buckets):.3f} |")
    out.append(f"| {precision} | {'yes' if ckpt else 'no'} | buckets | "
               f"{measured['buckets'] / sum(e.buckets for e in traced):.3f} | | | |")
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child(json.loads(sys.argv[2]), Path(sys.argv[3])))
    sys.exit(main())

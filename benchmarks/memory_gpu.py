#!/usr/bin/env python
"""The memory estimate against torch.cuda.max_memory_allocated and max_memory_reserved, per GPU, on a GPU machine.

    python benchmarks/memory_gpu.py                # the trainer's GPU defaults, fp32/bf16 x checkpointing
    python benchmarks/memory_gpu.py --nb-part 2    # split over 2 GPUs (with fewer GPUs, every part on cuda:0)

Each configuration runs the trainer's own Replica (bench_ddp_transformer.py: its model, --precision,
--activation-checkpointing, fairscale's Pipe, DDP over nccl in one process, its AdamW or GradScaler) three steps; the
peak of the third (optimizer state there, as in every later step) is compared per GPU with the estimate for this GPU's
kernels (check_topology.ARCHS): the estimate without its allowance against max_memory_allocated, with it against
max_memory_reserved (the CUDA context is in neither, so the allowance should cover more than the difference). Then,
where torch has MemTracker (2.5 and later), a fourth step under benchmarks/memory_grid.py's tracker gives the ratio
per term: the static terms (weights, AdamW's state, DDP's buckets) and the rest of the peak (activations, weight
copies, gradients, temporaries), against the estimate of the step as a dispatch mode sees it (traced=True).
The estimate's GPU kernels (flash or memory-efficient attention, bool dropout masks) are assumptions read in
torch's sources (check_topology I.4): this is where they are checked.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import bench_ddp_transformer as bench  # noqa: E402
import check_topology  # noqa: E402

GIB = check_topology.GIB


def replica(model: dict, precision: str, ckpt: bool, nb_part: int) -> tuple[bench.Replica, torch.Tensor,
                                                                           torch.Tensor]:
    """The trainer's Replica on this machine's GPUs (every part on cuda:0 when there are fewer than nb_part)."""
    args = [f"--{k.replace('_', '-')}={v}" for k, v in model.items() if k in check_topology.GPU_DEFAULTS]
    cfg = bench.parse_args(args + ["--precision", precision, "--nb-part", str(nb_part)]
                           + (["--activation-checkpointing"] if ckpt else []))
    bench.resolve(cfg, cuda=True)
    gpus = torch.cuda.device_count()
    plan = check_topology.plan_task(0, 0, 0, 1, [str(i) for i in range(gpus)], gpus, cfg.nlayers, nb_part,
                                    devices=[0] * nb_part if gpus < nb_part else None)
    torch.manual_seed(0)
    trainer = bench.Replica(cfg, plan, "fairscale")
    trainer.start()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), generator=g)
    y = torch.randint(0, 2, (cfg.batch_size,), generator=g)
    return trainer, x.to(plan.device(0)), y.to(plan.device(nb_part - 1))  # where the step puts them


def measure(model: dict, precision: str, ckpt: bool, nb_part: int) -> tuple[list[int], list[int]]:
    """max_memory_allocated and max_memory_reserved per part's device over the third step."""
    trainer, x, y = replica(model, precision, ckpt, nb_part)
    try:
        devices = [trainer.plan.device(i) for i in range(nb_part)]
        for step in range(3):
            if step == 2:
                for d in set(devices):
                    torch.cuda.synchronize(d)
                    torch.cuda.reset_peak_memory_stats(d)
            trainer.train_step(x, y)
        for d in set(devices):
            torch.cuda.synchronize(d)
        return ([torch.cuda.max_memory_allocated(d) for d in devices],
                [torch.cuda.max_memory_reserved(d) for d in devices])
    finally:
        trainer.close()


def terms(model: dict, precision: str, ckpt: bool, nb_part: int) -> dict | None:
    """Per part, MemTracker's peak (benchmarks/memory_grid.py's tracker, each part on its own GPU here) by kind, and
    DDP's buckets; None without MemTracker."""
    if importlib.util.find_spec("torch.distributed._tools.mem_tracker") is None:
        return None
    import memory_grid
    trainer, x, y = replica(model, precision, ckpt, nb_part)
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


def arch_here() -> str:
    return check_topology.arch_of(torch.cuda.get_device_capability(0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nb-part", type=int, default=1)
    p.add_argument("--dropout", type=float, default=check_topology.GPU_DEFAULTS["dropout"])
    args = p.parse_args(argv)
    if args.nb_part < 1:
        print(f"memory_gpu: --nb-part {args.nb_part} must be at least 1", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("memory_gpu: no CUDA GPU here; run it on a GPU node (the CPU validation is benchmarks/memory_grid.py)",
              file=sys.stderr)
        return 2
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    model = dict(check_topology.GPU_DEFAULTS, dropout=args.dropout)
    arch = arch_here()
    shared = torch.cuda.device_count() < args.nb_part
    print(f"{torch.cuda.get_device_name(0)} ({arch} kernels), torch {torch.__version__}, GPU defaults, nb_part "
          f"{args.nb_part}" + (" (all parts on cuda:0: compared as one sum)" if shared else ""))
    print("| precision | ckpt | part | estimated peak GiB | max_memory_allocated GiB | allocated / estimated | "
          "estimate with allowance GiB | max_memory_reserved GiB | reserved / with allowance | peak at (estimate) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    worst, per_term = 0.0, []
    for precision in ("fp32", "bf16" if torch.cuda.is_bf16_supported() else "fp16"):
        for ckpt in (False, True):
            t = check_topology.Training(precision=precision, activation_checkpointing=ckpt)
            est = check_topology.estimate_memory(model, t, args.nb_part, 1, arch)
            allocated, reserved = measure(model, precision, ckpt, args.nb_part)
            rows = [(m.peak, m.total, a, r, m.peak_at) for m, a, r in zip(est, allocated, reserved)]
            if shared:
                rows = [(sum(m.peak for m in est), check_topology.shared_gpu_memory(est, [0] * args.nb_part)[2],
                         allocated[0], reserved[0], "sum of the parts")]
            for i, (peak, total, a, r, at) in enumerate(rows):
                worst = max(worst, abs(a / peak - 1))
                print(f"| {precision} | {'yes' if ckpt else 'no'} | {'all' if shared else i} | {peak / GIB:.2f} | "
                      f"{a / GIB:.2f} | {a / peak:.3f} | {total / GIB:.2f} | {r / GIB:.2f} | {r / total:.3f} | {at} |")
            measured = None if shared else terms(model, precision, ckpt, args.nb_part)
            traced = check_topology.estimate_memory(model, t, args.nb_part, 1, arch, traced=True)
            for i, (m, e) in enumerate(zip(measured["parts"] if measured else [], traced)):
                kinds = m["kinds"]
                fixed = sum(kinds.get(k, 0) for k in ("Parameter", "Optstate", "Buffer", "Other"))
                rest = e.peak - e.params - e.optimizer - e.buckets - e.buffers - e.inputs
                per_term.append(f"| {precision} | {'yes' if ckpt else 'no'} | {i} | "
                                f"{kinds.get('Parameter', 0) / e.params:.3f} | "
                                f"{kinds.get('Optstate', 0) / e.optimizer:.3f} | {(m['peak'] - fixed) / rest:.3f} | "
                                f"{m['peak'] / (e.peak - e.buckets):.3f} |")
            if measured:
                per_term.append(f"| {precision} | {'yes' if ckpt else 'no'} | buckets | "
                                f"{measured['buckets'] / sum(e.buckets for e in traced):.3f} | | | |")
    print(f"\nworst |allocated / estimated - 1| = {worst:.1%}")
    if per_term:
        print("\nper term, MemTracker / estimate (traced): weights, AdamW state, the rest of the peak (activations, "
              "weight copies, gradients, temporaries), the whole peak without buckets; then DDP's buckets")
        print("| precision | ckpt | part | params | optimizer | rest | peak |\n"
              "| --- | --- | --- | ---: | ---: | ---: | ---: |")
        print("\n".join(per_term))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The memory estimate against torch.cuda.max_memory_allocated, per GPU, on a GPU machine.

    python benchmarks/memory_gpu.py                # the trainer's GPU defaults, fp32/bf16 x checkpointing
    python benchmarks/memory_gpu.py --nb-part 2    # split over 2 GPUs (with fewer GPUs, every part on cuda:0)

Each configuration runs the trainer's model (bench_ddp_transformer.build_module_list) through the trainer's Pipe
(fairscale, checkpoint="never") inside DDP (nccl, one process) with AdamW, two steps; the peak of the second step
(optimizer state already there, as in every later step) is compared with the estimate without its allowance
(the CUDA context is not in max_memory_allocated, and the allocator's slack is not either). Precision and
checkpointing: the trainer's own --precision and --activation-checkpointing.
Not run yet: no GPU machine was lent to this work; the README says so.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import bench_ddp_transformer as bench  # noqa: E402
import check_topology  # noqa: E402


def measure(model: dict, precision: str, ckpt: bool, nb_part: int) -> list[int]:
    """Peak bytes allocated per part's device during the second training step."""
    torch.manual_seed(0)
    cfg = SimpleNamespace(precision=precision, activation_checkpointing=ckpt, **model)  # the trainer's options
    gpus = torch.cuda.device_count()
    plan = check_topology.plan_task(0, 0, 0, 1, [str(i) for i in range(gpus)], gpus, model["nlayers"], nb_part)
    if gpus < nb_part:  # not enough GPUs: every part on cuda:0, compared with the sum of the parts
        plan.devices = [0] * nb_part
    parts = bench.build_module_list(cfg, plan)
    devices = [plan.device(i) for i in range(nb_part)]
    pipe = bench.PipeModel(parts, "fairscale", model["chunks"], devices)
    try:
        ddp = DistributedDataParallel(pipe)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
        x = torch.randint(0, model["vocab_size"], (model["batch_size"], model["seq_len"]), device=devices[0])
        y = torch.randint(0, 2, (model["batch_size"],), device=devices[-1])
        for step in range(2):
            if step == 1:
                for d in set(devices):
                    torch.cuda.synchronize(d)
                    torch.cuda.reset_peak_memory_stats(d)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(F.cross_entropy(ddp(x).float(), y)).backward()
            scaler.step(optimizer)
            scaler.update()
        for d in set(devices):
            torch.cuda.synchronize(d)
        return [torch.cuda.max_memory_allocated(d) for d in devices]
    finally:
        pipe.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nb-part", type=int, default=1)
    p.add_argument("--dropout", type=float, default=check_topology.GPU_DEFAULTS["dropout"])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("memory_gpu: no CUDA GPU here; run it on a GPU node (the CPU validation is benchmarks/memory_grid.py)",
              file=sys.stderr)
        return 2
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    model = dict(check_topology.GPU_DEFAULTS, dropout=args.dropout)
    shared = torch.cuda.device_count() < args.nb_part
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, GPU defaults, nb_part {args.nb_part}"
          + (" (all parts on cuda:0: compared as one sum)" if shared else ""))
    print("| precision | ckpt | part | estimated GiB (no allowance) | max_memory_allocated GiB | measured / estimated |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    worst = 0.0
    for precision in ("fp32", "bf16" if torch.cuda.is_bf16_supported() else "fp16"):
        for ckpt in (False, True):
            t = check_topology.Training(precision=precision, activation_checkpointing=ckpt)
            est = [m.total - m.allowance for m in check_topology.estimate_memory(model, t, args.nb_part, 1)]
            got = measure(model, precision, ckpt, args.nb_part)
            if shared:
                est, got = [sum(est)], [got[0]]
            for i, (e, g) in enumerate(zip(est, got)):
                worst = max(worst, abs(g / e - 1))
                print(f"| {precision} | {'yes' if ckpt else 'no'} | {'all' if shared else i} | {e / 2**30:.2f} | "
                      f"{g / 2**30:.2f} | {g / e:.3f} |")
    print(f"\nworst |measured / estimated - 1| = {worst:.1%}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

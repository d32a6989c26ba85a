#!/usr/bin/env python
"""Where the script's overhead goes: the budget model trained by a bare loop, through fairscale's Pipe, and
through the Pipe wrapped in DDP (one process), 35 timed steps each.

    for m in bare pipe ddp; do python benchmarks/overhead_breakdown.py $m; done
"""
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kit.arguments  # noqa: E402
import kit.train.parts  # noqa: E402
import kit.train.pipe  # noqa: E402
import kit.train.setup  # noqa: E402
from budget import MODEL as BUDGET_MODEL  # noqa: E402
import kit.plan  # noqa: E402
import idr_torch  # noqa: E402

MODEL = [*BUDGET_MODEL, "--chunks", "4"]  # the budget's model, at its chunks


def main(mode: str) -> None:
    cfg = kit.arguments.parse_trainer_args("replica", MODEL)
    kit.train.setup.resolve(cfg, cuda=False)
    torch.set_num_threads(kit.train.setup.cpu_threads(idr_torch.current()))
    module_list = kit.train.parts.model_parts(cfg, kit.plan.plan_task(0, 0, 0, 1, [], None, cfg.nlayers, 2))
    model = torch.nn.Sequential(*module_list) if mode == "bare" else \
        kit.train.pipe.PipeModel(module_list, "fairscale", cfg.chunks, ["cpu", "cpu"])
    run = model
    if mode == "ddp":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(idr_torch.current().master_port))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        run = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (40, cfg.batch_size, cfg.seq_len), generator=g)
    y = torch.randint(0, 2, (40, cfg.batch_size), generator=g)
    for i in range(40):
        if i == 5:
            t0 = time.time()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(run(x[i]), y[i]).backward()
        opt.step()
    print(f"{mode}: {35 * cfg.batch_size / (time.time() - t0):.1f} samples/s")
    if mode != "bare":
        model.close()
    if mode == "ddp":
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("bare", "pipe", "ddp"):
        sys.exit("usage: overhead_breakdown.py bare|pipe|ddp")
    main(sys.argv[1])

"""One training step of the hybrid model on this rank's shard of a fixed global batch; saves the loss and
the (DDP-averaged) gradients. Started once per task by tests/test_train.py, under srun-like variables."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_ddp_transformer as bench  # noqa: E402
import idr_torch  # noqa: E402


def global_batch(cfg, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2024)
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size * world, cfg.seq_len), generator=g)
    y = torch.randint(0, 2, (cfg.batch_size * world,), generator=g)
    return x, y


def main() -> None:
    out_dir = Path(sys.argv[1])
    cfg = bench.parse_args(sys.argv[2:])
    bench.resolve(cfg, cuda=False)
    plan = bench.make_plan(cfg, cuda=False)
    engine = bench.pick_engine(cfg.engine)
    bench.init_distributed(120, cuda=False)
    rpc_file = bench.init_rpc_for_pipe() if engine == "torch-pipe" else None
    rank, world = idr_torch.rank, idr_torch.size
    torch.manual_seed(cfg.seed)
    model = bench.PipeModel(bench.build_module_list(cfg, plan), engine, cfg.chunks,
                            [plan.device(i) for i in range(plan.nb_part)])
    ddp_mp_model = DistributedDataParallel(model)
    x, y = global_batch(cfg, world)
    shard = slice(rank * cfg.batch_size, (rank + 1) * cfg.batch_size)
    loss, _ = bench.forward_backward(ddp_mp_model, x[shard], y[shard])
    torch.save({"loss": loss, "engine": engine, "nb_part": plan.nb_part,
                "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}, out_dir / f"rank{rank}.pt")
    model.close()
    if rpc_file is not None:
        torch.distributed.rpc.shutdown()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

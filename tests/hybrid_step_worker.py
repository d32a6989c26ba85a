"""One training step of the trainer's own Replica (kit.train.replica: its seed, module list, Pipe, optimizer, and the
page's DDP from Replica.start) on this rank's shard of a fixed global batch, through Replica.train_step with the optimizer's update
held back; saves the loss and the (DDP-averaged) gradients. Started once per task by tests/test_train.py and
tests/test_options.py, under srun-like variables."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kit.arguments  # noqa: E402
import kit.train.launch  # noqa: E402
import kit.train.pipe  # noqa: E402
import kit.train.replica  # noqa: E402
import kit.train.setup  # noqa: E402
import idr_torch  # noqa: E402


def global_batch(cfg, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2024)
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size * world, cfg.seq_len), generator=g)
    y = torch.randint(0, 2, (cfg.batch_size * world,), generator=g)
    return x, y


def start_replica(argv: list[str]):
    """The trainer's Replica for `argv`, started on the CPU as the trainer starts it (process group, RPC for the
    built-in Pipe): (cfg, plan, engine, trainer, rpc_file). Also used by tests/host_sync_worker.py."""
    cfg = kit.arguments.parse_trainer_args("replica", argv)
    kit.train.setup.resolve(cfg, cuda=False)
    plan = kit.train.setup.make_plan(cfg, cuda=False)
    engine = kit.train.pipe.pick_engine(cfg.engine)
    kit.train.launch.init_distributed(120, cuda=False, gpus=[])
    rpc_file = kit.train.pipe.init_rpc_for_pipe() if engine == "torch-pipe" else None
    trainer = kit.train.replica.Replica(cfg, plan, engine)
    trainer.start()
    return cfg, plan, engine, trainer, rpc_file


def stop_replica(trainer, rpc_file) -> None:
    trainer.close()
    if rpc_file is not None:
        torch.distributed.rpc.shutdown()
    torch.distributed.destroy_process_group()


def main() -> None:
    out_dir = Path(sys.argv[1])
    cfg, plan, engine, trainer, rpc_file = start_replica(sys.argv[2:])
    rank, world = idr_torch.rank, idr_torch.size
    trainer.optimizer.step = lambda *a, **k: None  # gradients only: the step's update must not run
    x, y = global_batch(cfg, world)
    shard = slice(rank * cfg.batch_size, (rank + 1) * cfg.batch_size)
    stats = trainer.train_step(x[shard], y[shard])  # (loss x samples, correct, samples)
    torch.save({"loss": stats[0] / stats[2], "engine": engine, "nb_part": plan.nb_part,
                "grads": {n: p.grad.clone() for n, p in trainer.model.named_parameters()}}, out_dir / f"rank{rank}.pt")
    stop_replica(trainer, rpc_file)


if __name__ == "__main__":
    main()

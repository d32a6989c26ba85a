"""One training step of bench_stage.py (torch.distributed.pipelining, DDP per stage) on a fixed global batch;
saves the loss seen by the last stage and every local stage's gradients under the replica layout's names.
Started once per task by tests/test_stage.py, under srun-like variables."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kit.train.launch  # noqa: E402
import kit.train.setup  # noqa: E402
import bench_stage  # noqa: E402
import idr_torch  # noqa: E402
from hybrid_step_worker import global_batch  # noqa: E402


def main() -> None:
    out_dir = Path(sys.argv[1])
    cfg = bench_stage.parse_args(sys.argv[2:])
    kit.train.setup.resolve(cfg, cuda=False)
    plan = bench_stage.make_plan(cfg, cuda=False)
    tasks = kit.train.launch.init_distributed(120, cuda=False, gpus=[])
    trainer = bench_stage.Stages(cfg, plan, cuda=False, tasks=tasks)
    trainer.start()
    x, y = global_batch(cfg, trainer.dp_size)
    shard = slice(trainer.dp_rank * cfg.batch_size, (trainer.dp_rank + 1) * cfg.batch_size)
    stepping = os.environ.get("STAGE_STEP_WEIGHTS") == "1"  # the whole step, its update too: the weights after it
    if not stepping:
        for opt in trainer.optimizers.values():  # gradients only: the step's update must not run
            opt.step = lambda *a, **k: None
    stats = trainer.train_step(x[shard], y[shard])
    weights = {s: [p.detach().clone() for p in m.parameters()] for s, m in trainer.modules.items()}
    torch.save({"stats": stats, "last": trainer.last_holder, "weights": weights if stepping else None,
                "grads": {} if stepping else {f"{s}.{n}": p.grad.clone() for s, m in trainer.modules.items()
                                              for n, p in m.named_parameters()}}, out_dir / f"rank{idr_torch.rank}.pt")
    trainer.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

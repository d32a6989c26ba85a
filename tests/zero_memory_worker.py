"""One step of the trainer's replica (kit.train.replica.Replica: Pipe + DDP) with --zero, so its optimizer is the
trainer's own make_optimizer(zero=True): ZeroRedundancyOptimizer(AdamW) over the replicas. Writes, per part, the
bytes of optimizer state this rank holds. Started once per task by tests/test_memory.py, under srun-like variables."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kit.arguments  # noqa: E402
import kit.train.launch  # noqa: E402
import kit.train.replica  # noqa: E402
import kit.train.setup  # noqa: E402
import idr_torch  # noqa: E402
from hybrid_step_worker import global_batch  # noqa: E402


def main() -> None:
    cfg = kit.arguments.parse_trainer_args("replica", sys.argv[2:])
    kit.train.setup.resolve(cfg, cuda=False)
    plan = kit.train.setup.make_plan(cfg, cuda=False)
    kit.train.launch.init_distributed(120, cuda=False, gpus=[])
    replica = kit.train.replica.Replica(cfg, plan, "fairscale")
    if not isinstance(replica.optimizer, ZeroRedundancyOptimizer):
        raise SystemExit(f"--zero gave the trainer a {type(replica.optimizer).__name__}, not ZeroRedundancyOptimizer")
    replica.start()
    x, y = global_batch(cfg, 1)
    replica.train_step(x, y)
    state = replica.optimizer.optim.state  # this rank's shard only
    held = [sum(v.numel() * v.element_size() for p in part.parameters() for v in state.get(p, {}).values()
                if v.numel() == p.numel()) for part in replica.model]
    Path(sys.argv[1], f"rank{idr_torch.rank}.json").write_text(json.dumps(held))
    replica.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

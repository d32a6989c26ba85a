"""One training step with ZeroRedundancyOptimizer(AdamW) over the replicas; writes, per part, the bytes of the
optimizer state this rank holds. Started once per task by tests/test_memory.py, under srun-like variables."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_ddp_transformer as bench  # noqa: E402
import idr_torch  # noqa: E402


def main() -> None:
    out_dir = Path(sys.argv[1])
    cfg = bench.parse_args(sys.argv[2:])
    bench.resolve(cfg, cuda=False)
    plan = bench.make_plan(cfg, cuda=False)
    bench.init_distributed(120, cuda=False)
    torch.manual_seed(cfg.seed)
    parts = bench.build_module_list(cfg, plan)
    model = bench.PipeModel(parts, "fairscale", cfg.chunks, [plan.device(i) for i in range(plan.nb_part)])
    ddp = DistributedDataParallel(model)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len))
    y = torch.randint(0, 2, (cfg.batch_size,))
    F.cross_entropy(ddp(x), y).backward()
    zero.step()
    held = [sum(v.numel() * v.element_size() for p in part.parameters() for v in zero.optim.state.get(p, {}).values()
                if v.numel() == p.numel()) for part in parts]
    (out_dir / f"rank{idr_torch.rank}.json").write_text(json.dumps(held))
    model.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

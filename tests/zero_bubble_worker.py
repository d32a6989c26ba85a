"""What torch itself accepts and runs of the zero-bubble schedules: for each (schedule, chunks, stages a task) the
schedule class is built on small Linear stages (the row's placement: a V for two stages a task, else looped) and, if
its constructor accepts it, one step runs. Writes {case: "ran" | "refused: ..." | "failed: ..."} per rank.
Started once per task by tests/test_zero_bubble.py, under srun-like variables."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed import pipelining

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kit.schedules  # noqa: E402
import kit.train.launch  # noqa: E402
import idr_torch  # noqa: E402


def one_case(name: str, chunks: int, virtual: int, group) -> str:  # noqa: ANN001
    row = kit.schedules.schedule(name)
    pp, rank = idr_torch.size, idr_torch.rank
    placement = kit.schedules.PLACEMENTS["v" if row.placement == "v" and virtual == 2 else "loop"]
    ids, n = placement(rank, pp, virtual), pp * virtual
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(n)]
    stages = [pipelining.PipelineStage(layers[s], s, n, torch.device("cpu"), group=group) for s in ids]
    try:
        schedule = getattr(pipelining, row.torch_class)(stages, n_microbatches=chunks,
                                                        loss_fn=torch.nn.functional.mse_loss)
    except (ValueError, RuntimeError) as exc:
        return f"refused: {exc}"
    x, y = torch.randn(2 * chunks, 8), torch.randn(2 * chunks, 8)
    try:
        args = (x,) if 0 in ids else ()
        schedule.step(*args, target=y) if n - 1 in ids else schedule.step(*args)
    except Exception as exc:  # noqa: BLE001 - what torch raises is the finding
        return f"failed: {type(exc).__name__}: {exc}"
    return "ran"


def main() -> None:
    out, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
    kit.train.launch.init_distributed(60, cuda=False, gpus=[])
    group = torch.distributed.group.WORLD
    seen = {f"{n} {c} {v}": one_case(n, c, v, group) for n, c, v in cases}
    (out / f"rank{idr_torch.rank}.json").write_text(json.dumps(seen))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

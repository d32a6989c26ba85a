"""The trainer's own training and evaluation steps (Replica.train_step and eval_step: its model, Pipe, DDP,
optimizer), recorded op by op in the calling thread: any op that builds a tensor from host data (aten.lift_fresh:
torch.tensor(...), a synchronous host-to-device copy on a GPU) or reads a value back to the host
(aten._local_scalar_dense: .item(), bool(t), int(t)) is written to OUT. On a GPU each is a host sync in the step.
Started by tests/test_gpu_truth.py as one task: python host_sync_worker.py OUT [trainer arguments]."""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import kit.train.loop  # noqa: E402
from hybrid_step_worker import global_batch, start_replica, stop_replica  # noqa: E402

HOST_OPS = ("aten.lift_fresh", "aten._local_scalar_dense")
# the kit's own code: the trainers and their machinery
KIT_FILES = (ROOT / "bench_ddp_transformer.py", ROOT / "bench_stage.py")
KIT_TRAIN = ROOT / "kit" / "train"
# the frames torch puts between the op's caller and __torch_dispatch__ (the mode runs with dynamo disabled)
DISPATCH_MACHINERY = ("torch/_dynamo/", "torch/_compile.py", "torch/utils/_python_dispatch.py", "torch/_ops.py")


class HostOps(TorchDispatchMode):
    """Records the host-data ops run in this thread (dispatch modes are per thread: the Pipe's workers and DDP's
    autograd threads are not seen, only what the step's own code runs), with the frame of the kit that ran them."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(HOST_OPS):
            # the Python frame that asked for it: the kit's own code, or torch's (AdamW reads its step counter, a
            # CPU tensor unless capturable or fused, with .item(): no GPU sync; the CPU can't tell the two apart)
            caller = [f for f in traceback.extract_stack() if f.filename != __file__
                      and not any(m in f.filename for m in DISPATCH_MACHINERY)][-1]
            where = Path(caller.filename).resolve()
            if where in KIT_FILES or where.parent == KIT_TRAIN:
                self.seen.append(f"{func} at {where.relative_to(ROOT)}:{caller.lineno} ({caller.line})")
        return func(*args, **(kwargs or {}))


def main() -> None:
    out = Path(sys.argv[1])
    cfg, _, _, trainer, rpc_file = start_replica(sys.argv[2:])
    x, y = global_batch(cfg, 1)
    trainer.set_lr(kit.train.loop.lr_at(cfg, 0, 10))
    trainer.train_step(x, y)  # the first step builds DDP's buckets: not what is timed
    with HostOps() as rec:
        trainer.set_lr(kit.train.loop.lr_at(cfg, 1, 10))
        stats = trainer.train_step(x, y)
        evals = trainer.eval_step(x, y)
    out.write_text(json.dumps({"ops": rec.seen, "stats": stats.tolist(), "eval": evals.tolist()}))
    stop_replica(trainer, rpc_file)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""The per-GPU peak estimate of a user's model (kit.layer_memory.estimate_peaks, from kit.own_model's per-layer
figures) against the peak torch's MemTracker measures in a real CPU training step of that model.

    python benchmarks/own_model_memory.py            # the grid of docs/own_model.md (5 minutes)
    python benchmarks/own_model_memory.py --quick    # the rows tests/test_own_memory.py enforces

The step is the page's GPipe replica on one CPU, as benchmarks/memory_grid.py measures the kit's own model (its
PartTracker): the batch cut into `chunks` micro-batches, each through the parts in turn (each part's forward under
its own autocast, as a trainer runs a part), every tensor charged to the part a GPU would hold it on (a part's output
moves to the next part when made, a gradient to the part before when it leaves); then the outputs gathered into one
batch on the last part and the trainer's loss on it (the kit's cross-entropy on its data, else the stand-in), one
backward (all micro-batches' saved tensors alive until theirs), and AdamW's step, one optimizer a part. Two steps
first, the third measured. With --activation-checkpointing each layer is wrapped in torch.utils.checkpoint
(use_reentrant=False). DDP is not run: the estimate's buckets term is left out of the comparison (as memory_grid's).
Targets: every part within 10 % of the measured peak, and never more than 5 % below it.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed._tools.mem_tracker import _MemRefType  # noqa: E402

import kit.layer_memory  # noqa: E402
import kit.own_model as own  # noqa: E402
from kit.model import is_token_ids  # noqa: E402
from kit.train.options import autocast_dtype  # noqa: E402
from kit.train.own import synthetic_loss  # noqa: E402
from kit.train.trainer import kit_loss  # noqa: E402
from memory_grid import HIGH, LOW, PartTracker, table, yes  # noqa: E402

ZOO = str(ROOT / "tests" / "models_zoo.py")
FAMILIES = str(ROOT / "tests" / "zoo_families.py")
MODELS = {"conv": (f"{ZOO}:conv_stack", f"{ZOO}:conv_sample"), "mlp": (f"{ZOO}:residual_mlp", f"{ZOO}:mlp_sample"),
          "transformer": (f"{ZOO}:kit_transformer", "8x64"),
          # GPT-2 as a language model (its 50257-token vocabulary's logits, its 12 blocks; 256 wide, to run here)
          "gpt2-lm": (f"{FAMILIES}:gpt2_narrow_lm_untied", "8x64"),
          "gpt2-lm-tied": (f"{FAMILIES}:gpt2_narrow_lm", "8x64"),
          "gpt2-tiny-lm": (f"{FAMILIES}:gpt2_tiny_lm_untied", "8x32"),
          "gpt2-tiny-lm-tied": (f"{FAMILIES}:gpt2_tiny_lm", "8x32")}
# model, parts (layers each), chunks; each row in fp32 and bf16, with and without checkpointing
GRID = [("conv", [6], 2), ("conv", [3, 3], 4), ("conv", [2, 4], 2), ("mlp", [10], 4), ("mlp", [3, 7], 4),
        ("mlp", [4, 3, 3], 2), ("transformer", [6], 2), ("transformer", [3, 3], 4), ("transformer", [2, 1, 3], 2)]
VARIANTS = [(p, c) for p in ("fp32", "bf16") for c in (False, True)]
# GPT-2 as a language model (issue 41: its logits' loss on the last part): 1 part tied, a 1x4-like and a 2x8-like
# split untied (the fix the trainers' refusal of a tie across parts names); 45 s a row here
LM_ROWS = [("gpt2-lm-tied", [14], 2, "fp32", False), ("gpt2-lm", [4, 3, 3, 4], 4, "fp32", False),
           ("gpt2-lm", [4, 3, 3, 4], 4, "bf16", False), ("gpt2-lm", [4, 3, 3, 4], 2, "fp32", True),
           ("gpt2-lm", [2, 2, 2, 2, 2, 2, 1, 1], 4, "fp32", False)]
QUICK = [("conv", [3, 3], 4, "fp32", False), ("conv", [2, 4], 2, "bf16", True), ("mlp", [3, 7], 4, "bf16", False),
         ("mlp", [10], 4, "fp32", True)]


class Checkpointed(nn.Module):
    """A layer recomputed in its backward: torch.utils.checkpoint, non-reentrant (the kit's Layers' way)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False)


def real_batch(sample: str, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = own.sample_batch(sample)()
    x = (torch.randn(x.shape, generator=g) if x.is_floating_point()
         else torch.randint(0, 100, x.shape, generator=g, dtype=x.dtype))
    return x, torch.randint(0, classes, (x.shape[0],), generator=g)


def train_step(parts: list[nn.Module], optimizers: list, x: torch.Tensor, y: torch.Tensor, chunks: int,
               precision: str, tracker: PartTracker | None = None, loss_fn=kit_loss) -> None:
    """GPipe's step as the replica trainer runs it: every micro-batch forward through the parts, their outputs
    gathered into one batch on the last part (the Pipe's torch.cat), the trainer's loss on it (kit_loss, or
    synthetic_loss: kit.train.trainer.step_functions) and its one backward, the gathered output kept until the
    backward ends (the trainer's step figures read it), then AdamW."""
    dtype, last, outs = autocast_dtype(precision), len(parts) - 1, []
    for xm in x.chunk(chunks):
        h = xm
        for k, part in enumerate(parts):
            if tracker:
                tracker.enter_part(h, k)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                h = part(h)
            if tracker:
                tracker.leave_part(h, k, last)
        outs.append(h)
    out = torch.cat(outs)
    del outs, h
    loss_fn(out, y).backward()
    del out
    for k, opt in enumerate(optimizers):
        if tracker:
            tracker.forced = k
        opt.step()
        opt.zero_grad(set_to_none=True) if tracker is None else None
    if tracker:
        tracker.forced = None


def measure_step(name: str, sizes: list[int], chunks: int, precision: str, ckpt: bool) -> list[dict]:
    """Per part, MemTracker's peak of the third step and what was alive then by kind."""
    spec, sample = MODELS[name]
    torch.manual_seed(0)
    layers, _ = own.build_layers(spec, device="cpu")
    layers = [Checkpointed(m) if ckpt else m for m in layers]
    bounds = [sum(sizes[:p]) for p in range(len(sizes) + 1)]
    parts = [nn.Sequential(*layers[a:b]).train() for a, b in zip(bounds, bounds[1:])]
    optimizers = [torch.optim.AdamW(p.parameters(), lr=1e-4) for p in parts]
    x, y = real_batch(sample, 2 if name != "conv" else 10)
    model = own.describe(spec, sample)  # the trainers' loss: the kit's data's, or the stand-in
    loss_fn = kit_loss if is_token_ids(sample) and model.classes == 2 else synthetic_loss
    for _ in range(2):
        train_step(parts, optimizers, x, y, chunks, precision, loss_fn=loss_fn)
    tr = PartTracker(len(parts))
    for k, part in enumerate(parts):
        tr.register(k, list(part.parameters()), _MemRefType.PARAM)
        tr.register(k, list(part.buffers()), _MemRefType.BUFFER)
        state = optimizers[k].state
        tr.register(k, [v for p in part.parameters() for v in state[p].values() if torch.is_tensor(v)],
                    _MemRefType.OPT)
    tr.register(0, [x], _MemRefType.OTH)
    tr.register(len(parts) - 1, [y], _MemRefType.OTH)
    gc.collect()
    with tr:
        train_step(parts, optimizers, x, y, chunks, precision, tr, loss_fn)
    kinds = lambda k: {str(getattr(r, "value", r)): n for r, n in tr.peak_kinds[k].items() if n}  # noqa: E731
    return [dict(peak=tr.peak[k], at=tr.peak_at[k], kinds=kinds(k)) for k in range(len(parts))]


def compare(name: str, sizes: list[int], chunks: int, precision: str, ckpt: bool) -> list[dict]:
    """Per part: the estimate (traced, on the CPU, without DDP's buckets) against MemTracker's peak."""
    spec, sample = MODELS[name]
    costs = own.describe(spec, sample).costs  # tied weights counted once, as the trainers' plan counts them
    batch = own.sample_batch(sample)().shape[0]
    got = measure_step(name, sizes, chunks, precision, ckpt)
    est, before = (kit.layer_memory.estimate_peaks(costs, sizes, batch // chunks, chunks, precision,
                                                   checkpointing=ckpt, arch="cpu", traced=True, loss=loss)
                   for loss in (True, False))  # with the loss's terms, and without them (the estimate before them)
    return [dict(model=name, sizes=sizes, chunks=chunks, precision=precision, ckpt=ckpt, part=e.part,
                 measured=m["peak"], measured_at=m["at"], kinds=m["kinds"], estimated=e.peak - e.buckets,
                 estimated_at=e.peak_at, ratio=(e.peak - e.buckets) / m["peak"],
                 without_loss=(b.peak - b.buckets) / m["peak"]) for e, b, m in zip(est, before, got)]


def within(rows: list[dict]) -> bool:
    return all(1 - LOW <= r["ratio"] <= 1 + HIGH for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the rows tests/test_own_memory.py enforces")
    p.add_argument("--json", help="also write every row here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    start, rows = time.monotonic(), []
    runs = QUICK if args.quick else [(n, s, c, pr, ck) for n, s, c in GRID for pr, ck in VARIANTS] + LM_ROWS
    for name, sizes, chunks, precision, ckpt in runs:
        rows += compare(name, sizes, chunks, precision, ckpt)
    kib = lambda n: f"{n / 1024:.1f}"  # noqa: E731
    print(table([("model", "---", lambda r: r["model"]), ("layers per part", "---", lambda r: r["sizes"]),
                 ("chunks", "---:", lambda r: r["chunks"]), ("precision", "---", lambda r: r["precision"]),
                 ("ckpt", "---", lambda r: yes(r["ckpt"])), ("part", "---:", lambda r: r["part"]),
                 ("measured KiB", "---:", lambda r: kib(r["measured"])),
                 ("estimated KiB", "---:", lambda r: kib(r["estimated"])),
                 ("estimate / measured", "---:", lambda r: f"{r['ratio']:.3f}"),
                 ("without the loss's terms", "---:", lambda r: f"{r['without_loss']:.3f}"),
                 ("peak estimated at", "---", lambda r: r["estimated_at"])], rows))
    lo, hi = min(r["ratio"] for r in rows), max(r["ratio"] for r in rows)
    print(f"\n{len(rows)} parts, estimate / measured from {lo:.3f} to {hi:.3f} (target {1 - LOW:.2f} to "
          f"{1 + HIGH:.2f}): {'met' if within(rows) else 'NOT met'}; {time.monotonic() - start:.0f} s on torch "
          f"{torch.__version__}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0 if within(rows) else 1


if __name__ == "__main__":
    sys.exit(main())

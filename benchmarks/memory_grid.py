#!/usr/bin/env python
"""The memory estimate (check_topology.estimate_memory) against the bytes a real training step holds, on the CPU.

    python benchmarks/memory_grid.py            # the whole grid: one row per (configuration, part), worst case last
    python benchmarks/memory_grid.py --quick    # the small grid tests/test_memory.py enforces

For each configuration it builds the trainer's model (bench_ddp_transformer.build_module_list), splits it into
nb_part parts on the CPU, runs it through the trainer's Pipe (fairscale's GPipe, checkpoint="never") inside
DistributedDataParallel (gloo, one process), and takes one AdamW step. It counts, per part:
  - saved: every tensor autograd saves for the backward pass during the part's forward
    (torch.autograd.graph.saved_tensors_hooks, entered in the part's own forward since the Pipe runs parts in
    worker threads), deduplicated by storage so views are real bytes once, parameters left out (counted as
    params); the peak of what is alive at once. With activation checkpointing, plus the working set of one
    Layer recomputed on one micro-batch (what autograd saves when that Layer runs without checkpointing);
  - params, grads (after backward), optimizer (AdamW's state tensors after the step).
Precision and checkpointing are the trainer's own --precision (bench_ddp_transformer.Part: autocast in each
part's forward) and --activation-checkpointing (CheckpointedLayer: non-reentrant torch.utils.checkpoint). The terms not counted here (DDP buckets, the allowance, the logits)
are stated formulas, compared on a GPU by benchmarks/memory_gpu.py.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import bench_ddp_transformer as bench  # noqa: E402
import check_topology  # noqa: E402

TOLERANCE = 0.10
# The model grid: each row a d_model, n_head, d_hid, seq_len, batch, chunks, nb_part; every row runs in every
# precision x checkpointing combination. Small enough for a 2-core CPU, wide enough that each term dominates
# somewhere (long sequences: activations; wide d_hid: the FFN; many chunks: the micro-batch bookkeeping).
FULL = [
    dict(d_model=64, n_head=4, d_hid=128, seq_len=64, batch_size=16, chunks=1, nb_part=1),
    dict(d_model=64, n_head=4, d_hid=128, seq_len=64, batch_size=16, chunks=4, nb_part=2),
    dict(d_model=128, n_head=8, d_hid=512, seq_len=32, batch_size=8, chunks=2, nb_part=2),
    dict(d_model=96, n_head=2, d_hid=384, seq_len=128, batch_size=8, chunks=8, nb_part=4),
    dict(d_model=256, n_head=8, d_hid=256, seq_len=16, batch_size=32, chunks=4, nb_part=2),
    dict(d_model=32, n_head=1, d_hid=64, seq_len=256, batch_size=4, chunks=2, nb_part=4),
]
QUICK = [FULL[1], FULL[3]]
VARIANTS = [(p, c) for p in ("fp32", "bf16") for c in (False, True)]


class Counter:
    """Bytes autograd keeps alive for backward, per storage (a storage saved twice counts once)."""

    def __init__(self, skip: set[int]) -> None:
        self.skip, self.alive, self.current, self.peak = skip, {}, 0, 0
        self.lock = threading.Lock()

    def pack(self, t: torch.Tensor) -> object:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.skip or storage.nbytes() == 0:
            return t
        with self.lock:
            n, refs = self.alive.get(key, (storage.nbytes(), 0))
            if refs == 0:
                self.current += n
                self.peak = max(self.peak, self.current)
            self.alive[key] = (n, refs + 1)
        return Saved(t, key, self)

    def release(self, key: int) -> None:
        with self.lock:
            n, refs = self.alive[key]
            if refs == 1:
                del self.alive[key]
                self.current -= n
            else:
                self.alive[key] = (n, refs - 1)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda s: s.t if isinstance(s, Saved) else s)


class Saved:
    __slots__ = ("t", "key", "counter")

    def __init__(self, t: torch.Tensor, key: int, counter: Counter) -> None:
        self.t, self.key, self.counter = t, key, counter

    def __del__(self) -> None:
        self.counter.release(self.key)


class Counted(nn.Module):
    """One part under the part's counter, in whichever thread the Pipe runs it (the part enters its own autocast)."""

    def __init__(self, part: nn.Sequential, counter: Counter) -> None:
        super().__init__()
        self.part, self.counter = part, counter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.counter.hooks():
            return self.part(x)


def init_process_group() -> None:
    if not dist.is_initialized():  # DDP needs a group: one process, gloo, an in-memory store
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def recompute_bytes(layer: nn.Module, micro: int, cfg: SimpleNamespace, precision: str, skip: set[int]) -> int:
    """What one checkpointed Layer saves on one micro-batch when it runs without checkpointing (its
    recomputation): the plain TransformerEncoderLayer forward of the same module."""
    counter = Counter(skip)
    x = torch.randn(micro, cfg.seq_len, cfg.d_model, requires_grad=True)
    with counter.hooks(), bench.autocast(precision, "cpu"):
        y = nn.TransformerEncoderLayer.forward(layer, x)
    del y
    return counter.peak


def count_step(row: dict, precision: str, ckpt: bool, nlayers: int = 4, vocab: int = 500) -> list[dict]:
    """One real training step of the trainer's model; per part: params, grads, optimizer, saved (bytes)."""
    init_process_group()
    torch.manual_seed(0)
    cfg = SimpleNamespace(vocab_size=vocab, nlayers=nlayers, dropout=0.0, precision=precision,
                          activation_checkpointing=ckpt, **row)  # the trainer's own options
    plan = check_topology.plan_task(0, 0, 0, 1, [], None, nlayers, row["nb_part"])
    parts = bench.build_module_list(cfg, plan)
    skip = {p.untyped_storage().data_ptr() for part in parts for p in part.parameters()}
    counters = [Counter(skip) for _ in parts]
    model = bench.PipeModel([Counted(p, c) for p, c in zip(parts, counters)], "fairscale",
                            row["chunks"], ["cpu"] * len(parts))
    try:
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, vocab, (row["batch_size"], row["seq_len"]))
        y = torch.randint(0, 2, (row["batch_size"],))
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        micro = row["batch_size"] // row["chunks"]
        out = []
        for part, counter in zip(parts, counters):
            ps = list(part.parameters())
            layers = [m for m in part if isinstance(m, bench.CheckpointedLayer)]
            recompute = max((recompute_bytes(m, micro, cfg, precision, skip) for m in layers), default=0)
            state = [v for p in ps for v in optimizer.state[p].values() if v.numel() == p.numel()]
            out.append(dict(params=nbytes(ps), grads=nbytes([p.grad for p in ps if p.grad is not None]),
                            optimizer=nbytes(state), saved=counter.peak + recompute))
        return out
    finally:
        model.close()


def compare(row: dict, precision: str, ckpt: bool, nlayers: int = 4, vocab: int = 500) -> list[dict]:
    """Counted against estimated, per part: the terms both have (params, grads, optimizer, saved)."""
    counted = count_step(row, precision, ckpt, nlayers, vocab)
    model = dict(nlayers=nlayers, vocab_size=vocab, dropout=0.0,
                 **{k: v for k, v in row.items() if k != "nb_part"})
    t = check_topology.Training(precision=precision, activation_checkpointing=ckpt)
    est = check_topology.estimate_memory(model, t, row["nb_part"], 1)
    rows = []
    for c, e in zip(counted, est):
        e_terms = dict(params=e.params, grads=e.grads, optimizer=e.optimizer, saved=e.saved)
        total_c, total_e = sum(c.values()), sum(e_terms.values())
        rows.append(dict(row, precision=precision, ckpt=ckpt, part=e.part, counted=c, estimated=e_terms,
                         error=total_e / total_c - 1, saved_error=e.saved / c["saved"] - 1))
    return rows


def table(rows: list[dict]) -> str:
    head = ("| d_model | n_head | d_hid | seq_len | batch | chunks | nb_part | precision | ckpt | part | counted KiB "
            "| estimated KiB | error | saved counted KiB | saved estimated KiB | saved error |")
    lines = [head, "|" + " ---: |" * 7 + " --- | --- |" + " ---: |" * 7]
    for r in rows:
        c, e = r["counted"], r["estimated"]
        lines.append(f"| {r['d_model']} | {r['n_head']} | {r['d_hid']} | {r['seq_len']} | {r['batch_size']} | "
                     f"{r['chunks']} | {r['nb_part']} | {r['precision']} | {'yes' if r['ckpt'] else 'no'} | "
                     f"{r['part']} | {sum(c.values()) / 1024:.1f} | {sum(e.values()) / 1024:.1f} | "
                     f"{r['error']:+.2%} | {c['saved'] / 1024:.1f} | {e['saved'] / 1024:.1f} | "
                     f"{r['saved_error']:+.2%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the small grid the test enforces")
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    rows = [r for row, (prec, ck) in itertools.product(QUICK if args.quick else FULL, VARIANTS)
            for r in compare(row, prec, ck)]
    print(table(rows))
    worst = max(rows, key=lambda r: abs(r["error"]))
    worst_saved = max(rows, key=lambda r: abs(r["saved_error"]))
    print(f"\n{len(rows)} parts in {len(rows) and len({(r['d_model'], r['seq_len'], r['batch_size'], r['chunks'], r['nb_part'], r['precision'], r['ckpt']) for r in rows})} "
          f"configurations; worst total error {worst['error']:+.2%} (d_model {worst['d_model']}, "
          f"{worst['precision']}, ckpt {worst['ckpt']}, part {worst['part']}); worst saved-activation error "
          f"{worst_saved['saved_error']:+.2%} (d_model {worst_saved['d_model']}, {worst_saved['precision']}, "
          f"ckpt {worst_saved['ckpt']}, part {worst_saved['part']}); tolerance {TOLERANCE:.0%}")
    dist.destroy_process_group()
    return 0 if abs(worst["error"]) <= TOLERANCE and abs(worst_saved["saved_error"]) <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())

"""The per-GPU memory estimate (check_topology.estimate_memory) against what a real training step holds on the CPU.

The harness is benchmarks/memory_grid.py: it counts the bytes autograd saves (saved_tensors_hooks, storages
deduplicated), the parameters, gradients and AdamW state of each part in a real Pipe + DDP step.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import check_topology as ct  # noqa: E402
import memory_grid  # noqa: E402


@pytest.mark.parametrize("precision,ckpt", memory_grid.VARIANTS)
@pytest.mark.parametrize("row", memory_grid.QUICK, ids=lambda r: "d{d_model}-s{seq_len}-b{batch_size}-c{chunks}-p{nb_part}".format(**r))
def test_estimate_within_tolerance_of_counted_bytes(row, precision, ckpt):
    for r in memory_grid.compare(row, precision, ckpt):
        assert abs(r["error"]) <= memory_grid.TOLERANCE, (r["part"], r["counted"], r["estimated"])
        assert abs(r["saved_error"]) <= memory_grid.TOLERANCE, (r["part"], r["counted"], r["estimated"])


def test_chunks_do_not_lower_counted_activations():
    """GPipe with checkpoint="never": every micro-batch stays alive until its backward (measured, not assumed)."""
    base = dict(d_model=64, n_head=4, d_hid=128, seq_len=64, batch_size=16, nb_part=2)
    one = memory_grid.count_step(dict(base, chunks=1), "fp32", False)
    four = memory_grid.count_step(dict(base, chunks=4), "fp32", False)
    ckpt = memory_grid.count_step(dict(base, chunks=4), "fp32", True)
    for a, b, c in zip(one, four, ckpt):
        assert abs(b["saved"] / a["saved"] - 1) < 0.01, (a, b)
        assert c["saved"] < 0.5 * b["saved"], (b, c)


def test_zero_partition_is_torchs():
    """Our pure-Python ZeRO shares against ZeroRedundancyOptimizer's own partition of the same parameters
    (its private _partition_parameters, re-run for 3 ranks: one process cannot hold a 3-rank group)."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    memory_grid.init_process_group()
    model = dict(ct.GPU_DEFAULTS, nlayers=6, d_model=32, d_hid=48, vocab_size=300)
    params = ct._replica_params(model, 3)
    tensors = [torch.nn.Parameter(torch.zeros(n)) for n, _ in params]
    part_of = {id(t): part for t, (_, part) in zip(tensors, params)}
    zero = ZeroRedundancyOptimizer(tensors, optimizer_class=torch.optim.AdamW, lr=1e-3)
    zero.world_size, zero._partition_parameters_cache = 3, []
    owned = [[0] * 3 for _ in range(3)]
    for rank, groups in enumerate(zero._partition_parameters()):
        for t in groups[0]["params"]:
            owned[rank][part_of[id(t)]] += t.numel()
    assert ct._zero_shares(params, 3, 3) == [max(owned[r][p] for r in range(3)) for p in range(3)]
    assert ct._zero_shares([(10, 0), (7, 1), (5, 0), (5, 1), (1, 1)], 2, 2) == [10, 8]


def test_estimate_terms():
    model = dict(ct.GPU_DEFAULTS, batch_size=64, chunks=4)
    plain = ct.estimate_memory(model, ct.Training(), 2, 6)
    assert [m.contents for m in plain] == ct.part_contents(16, 2)
    assert all(m.alive == 4 and m.activations == 4 * m.per_micro_batch for m in plain)
    more_chunks = ct.estimate_memory(dict(model, chunks=16), ct.Training(), 2, 6)
    assert sum(m.activations for m in more_chunks) <= sum(m.activations for m in plain)  # not lower by much
    assert sum(m.activations for m in more_chunks) > 0.95 * sum(m.activations for m in plain)
    zero = ct.estimate_memory(model, ct.Training(zero=True), 2, 6)
    assert all(z.optimizer < p.optimizer for z, p in zip(zero, plain))
    ckpt = ct.estimate_memory(model, ct.Training(activation_checkpointing=True), 2, 6)
    assert all(c.total < p.total for c, p in zip(ckpt, plain))
    line = ct.format_memory(plain, 32.0)
    assert line.startswith("memory estimate: ") and "of 32.0 GiB" in line and "x 4 alive" in line


def test_estimate_refuses_bad_input():
    model = dict(ct.GPU_DEFAULTS)
    with pytest.raises(ValueError, match="precision 'fp8'"):
        ct.estimate_memory(model, ct.Training(precision="fp8"), 2, 1)
    with pytest.raises(ValueError, match="chunks=128"):
        ct.estimate_memory(dict(model, chunks=128), ct.Training(), 2, 1)

"""The per-GPU memory estimate (check_topology.estimate_memory) against what a real training step holds on the CPU.

The harness is benchmarks/memory_grid.py: it counts the bytes autograd saves (saved_tensors_hooks, storages
deduplicated), the parameters, gradients and AdamW state of each part in a real Pipe + DDP step.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import check_topology as ct  # noqa: E402
import memory_grid  # noqa: E402
from launch import run_tasks, srun_envs  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _one_process_group():
    """The grid's in-process gloo group (world size 1) is not left behind for other test modules."""
    yield
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


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


@pytest.mark.multiproc
def test_zero_optimizer_state_counted_over_three_replicas(tmp_path):
    """3 real processes, ZeroRedundancyOptimizer(AdamW): the state each rank holds on each part, against the
    estimate's worst-rank share."""
    args = ["--nb-part", "2", "--batch-size", "8", "--chunks", "2", "--seq-len", "16"]
    results = run_tasks([str(ROOT / "tests" / "zero_memory_worker.py"), str(tmp_path), *args], srun_envs(3))
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    held = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    model = dict(ct.CPU_DEFAULTS, batch_size=8, chunks=2, seq_len=16)
    est = ct.estimate_memory(model, ct.Training(zero=True), 2, 3)
    assert [max(h[p] for h in held) for p in range(2)] == [m.optimizer for m in est]
    plain = ct.estimate_memory(model, ct.Training(), 2, 3)
    assert sum(sum(h) for h in held) == sum(m.optimizer for m in plain)  # every state once, on one rank


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
    assert ct.memory_line(model, ct.Training(), 2, 6, 32.0) == line
    assert "not modelled for the stage layout" in ct.memory_line(model, ct.Training(layout="stage"), 2, 6)


def test_estimate_refuses_bad_input():
    model = dict(ct.GPU_DEFAULTS)
    with pytest.raises(ValueError, match="precision 'fp8'"):
        ct.estimate_memory(model, ct.Training(precision="fp8"), 2, 1)
    with pytest.raises(ValueError, match="chunks=128"):
        ct.estimate_memory(dict(model, chunks=128), ct.Training(), 2, 1)


# ---- using it before the queue: the checker ---------------------------------------------------------------
PAGE = ROOT / "slurm" / "page_3nodes_4gpus.slurm"


def plan(*extra: str) -> tuple[int, str]:
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = ct.main(list(extra))
    return code, out.getvalue()


@pytest.mark.parametrize("constraint,gib", [("v100-16g", 16160 / 1024), ("v100-32g", 32510 / 1024),
                                            ("a100", 80.0), ("h100", 81559 / 1024)])
def test_gpu_memory_from_constraint(constraint, gib):
    assert ct.gpu_memory(ct.Job(constraint=constraint)) == (gib, f"-C {constraint}")
    assert ct.gpu_memory(ct.Job(constraint=constraint, gpu_mem=12.5))[0] == 12.5  # --gpu-mem wins
    assert ct.gpu_memory(ct.Job(partition="gpu_p4"))[0] == 40.0  # the 40 GB A100s
    assert ct.gpu_memory(ct.Job(partition="gpu_p13"))[1].endswith("assuming 16 GB")
    assert ct.gpu_memory(ct.Job()) == (None, "unknown")  # then the fit is not checked


def test_page_template_fits_on_v100():
    for c in ("v100-32g", "v100-16g"):
        job, training, _ = ct.read_sbatch(PAGE)
        job.constraint = c
        report = ct.check_job(job, training)
        assert not [f for f in report.findings if f.code in ("does-not-fit", "memory-tight")], report.text()
        assert any(n.startswith("memory estimate: 13.35 GiB") and f"(-C {c})" in n for n in report.notes)



def test_shell_variables_on_the_line_are_not_judged(tmp_path):
    f = tmp_path / "sweep.slurm"
    f.write_text(PAGE.read_text().replace("--batch-size 64 --epochs", '--batch-size "$batch" --epochs'))
    job, training, _ = ct.read_sbatch(f)
    report = ct.check_job(job, training)
    assert training.unchecked and not [n for n in report.notes if "memory" in n], report.text()
    assert not [x for x in report.findings if x.code == "does-not-fit"]


def test_split_that_cannot_fit_is_refused_with_right_fixes():
    code, out = plan("--nodes", "3", "--gpus-per-node", "4", "--ntasks-per-node", "4", "-C", "v100-16g",
                     "--nlayers", "16", "--batch-size", "64", "--chunks", "4")
    assert code == 1
    line = next(x for x in out.splitlines() if "does-not-fit" in x)
    model = dict(ct.GPU_DEFAULTS, nlayers=16, batch_size=64, chunks=4)
    worst = max(ct.estimate_memory(model, ct.Training(), 1, 12), key=lambda m: m.total)
    assert f"part 0 (Encoder + Layer 0-15 + Decoder) needs an estimated {worst.total / ct.GIB:.1f} GiB" in line
    assert f"activations {worst.activations / ct.GIB:.2f}" in line and "more --chunks do not help" in line
    expected = {
        "--activation-checkpointing": (model, ct.Training(activation_checkpointing=True), 1, 12),
        "--precision fp16": (model, ct.Training(precision="fp16"), 1, 12),  # V100: fp16, not bf16
        "--ntasks-per-node=2 (nb_part 2, 6 replicas)": (model, ct.Training(), 2, 6),
        "--zero": (model, ct.Training(zero=True), 1, 12),
        "--batch-size 32 (a multiple of --chunks 4)": (dict(model, batch_size=32), ct.Training(), 1, 12),
    }
    gib = 16160 / 1024
    for label, args in expected.items():
        total = max(m.total for m in ct.estimate_memory(*args)) / ct.GIB
        shown = f"{label}: {total:.1f} GiB" + ("" if total <= gib else " (still too big)")
        assert shown in line, (shown, line)
    # the batch fix is the largest multiple of chunks that fits
    assert max(m.total for m in ct.estimate_memory(dict(model, batch_size=36), ct.Training(), 1, 12)) / ct.GIB > gib


def test_trainer_line_model_and_memory_options(tmp_path):
    text = PAGE.read_text().replace(
        "--nlayers 16 --chunks 4 --batch-size 64 --epochs 2",
        "--nlayers 16 --chunks 4 --batch-size 64 --d-model 2048 --seq-len 512 --dropout 0 --precision fp16 "
        "--activation-checkpointing --zero --epochs 2")
    f = tmp_path / "job.slurm"
    f.write_text(text)
    job, training, findings = ct.read_sbatch(f)
    assert training.model == dict(d_model=2048, seq_len=512, dropout=0.0)
    assert (training.precision, training.activation_checkpointing, training.zero) == ("fp16", True, True)
    report = ct.check_job(job, training)
    assert not [x for x in report.findings if x.code == "does-not-fit"], report.text()
    code, out = plan(str(f), "--gpu-mem", "2")
    assert code == 1 and "does-not-fit" in out and "(--gpu-mem 2)" in out
    f.write_text(text.replace("--precision fp16", "--precision bf16"))
    code, out = plan(str(f))
    assert code == 1 and "bf16-on-v100" in out
    f.write_text(text.replace("--precision fp16", "--precision fp8"))
    code, out = plan(str(f))
    assert code == 1 and "--precision 'fp8' is not one of fp32, bf16, fp16" in out


def test_advise_lists_splits_that_fit():
    code, out = plan("--advise", "--nodes", "3", "--gpus-per-node", "4", "-C", "v100-32g", "--global-batch", "384",
                     "--json")
    assert code == 0
    import json
    rows = json.loads(out)
    gib = 32510 / 1024
    assert rows and all(r["peak_gib"] <= gib for r in rows)
    assert [(r["nb_part"], r["bubble"]) for r in rows] == sorted((r["nb_part"], r["bubble"]) for r in rows)
    page = [r for r in rows if (r["ntasks_per_node"], r["chunks"], r["precision"], r["activation_checkpointing"],
                                r["zero"]) == (2, 4, "fp32", False, False)]
    assert page and page[0]["nb_part"] == 2 and page[0]["batch_size"] == 64 and page[0]["bubble"] == 0.2
    for r in rows[:: max(1, len(rows) // 10)]:
        t = ct.Training(precision=r["precision"], activation_checkpointing=r["activation_checkpointing"],
                        zero=r["zero"])
        m = dict(ct.GPU_DEFAULTS, batch_size=r["batch_size"], chunks=r["chunks"])
        assert round(max(x.total for x in ct.estimate_memory(m, t, r["nb_part"], r["replicas"])) / ct.GIB, 2) \
            == r["peak_gib"]
    assert {r["precision"] for r in rows} == {"fp32", "fp16"}  # V100: fp16, never bf16
    code, out = plan("--advise", "--nodes", "1", "--gpus-per-node", "4", "--gpu-mem", "1", "--global-batch", "64")
    assert code == 1 and "nothing fits" in out
    code, out = plan("--advise", "--nodes", "1", "--gpus-per-node", "4")
    assert code == 2 and "--advise needs" in out and "--global-batch N" in out


def test_gpu_memory_inside_an_allocation(tmp_path, monkeypatch):
    """Inside an allocation the GPUs' own memory wins over the constraint: nvidia-smi's
    --query-gpu=memory.total --format=csv,noheader,nounits prints MiB, one GPU per line (a stand-in prints it
    here: this machine has no GPU); the smallest GPU counts."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '32510\\n16160\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    seen = ct.gpus_memory_here()
    assert seen == 16160 / 1024
    job = ct.Job(constraint="v100-32g", gpu_mem_seen=seen)
    assert ct.gpu_memory(job) == (seen, "the allocation's GPUs (nvidia-smi)")
    smi.write_text("#!/bin/sh\nexit 9\n")
    assert ct.gpus_memory_here() is None  # a failing nvidia-smi: back to the constraint


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 24), st.integers(1, 8), st.integers(1, 64), st.integers(1, 8), st.integers(1, 512),
       st.integers(1, 8), st.sampled_from(ct.PRECISIONS), st.booleans(), st.booleans())
def test_estimate_properties(nlayers, heads, per_head, nb_part, seq, chunks, precision, ckpt, zero):
    """Over generated models: every term >= 0, the parts hold every parameter once, a larger batch never needs
    less, ZeRO never needs more and with one replica changes nothing."""
    model = dict(nlayers=nlayers, d_model=heads * per_head, n_head=heads, d_hid=4 * per_head, seq_len=seq,
                 vocab_size=1000, batch_size=chunks * 2, chunks=chunks, dropout=0.1)
    t = ct.Training(precision=precision, activation_checkpointing=ckpt, zero=zero)
    parts = ct.estimate_memory(model, t, nb_part, 3)
    assert len(parts) == nb_part and all(v >= 0 for m in parts for v in vars(m).values() if isinstance(v, int))
    assert sum(m.params for m in parts) == 4 * sum(n for n, _ in ct._replica_params(model, nb_part))
    bigger = ct.estimate_memory(dict(model, batch_size=chunks * 4), t, nb_part, 3)
    assert all(b.total >= p.total for b, p in zip(bigger, parts))
    plain = ct.estimate_memory(model, ct.Training(precision=precision, activation_checkpointing=ckpt), nb_part, 3)
    assert all(z.optimizer <= p.optimizer for z, p in zip(parts, plain))
    assert ct.estimate_memory(model, t, nb_part, 1) == ct.estimate_memory(model, replace(t, zero=False), nb_part, 1)

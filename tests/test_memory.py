"""The per-GPU memory estimate (kit/memory.py) against the peak torch's MemTracker measures in the trainers' own
steps on the CPU, and the checker's use of it (does-not-fit with its fixes, memory-tight, --advise, both layouts).

The harness is benchmarks/memory_grid.py (its --quick grid here; the whole grid is a benchmark, run by hand).
"""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import kit.allocation  # noqa: E402
import kit.arguments  # noqa: E402
import kit.checks  # noqa: E402
import kit.jobscript  # noqa: E402
import kit.memory  # noqa: E402
import kit.plan  # noqa: E402
import kit.site  # noqa: E402
import kit.slurm  # noqa: E402
from checker import run_checker  # noqa: E402
from launch import run_tasks, srun_envs  # noqa: E402

# MemTracker (torch.distributed._tools.mem_tracker) arrived in torch 2.5: the 2.3.1 and 2.4.1 lanes lack it, 2.6.0 on
# have it. Without it the measured tests can't run; they are not `core`, so only .venv (2.13) runs them.
HAS_MEMTRACKER = importlib.util.find_spec("torch.distributed._tools.mem_tracker") is not None
needs_memtracker = pytest.mark.skipif(not HAS_MEMTRACKER, reason="torch < 2.5 has no MemTracker to measure with")
if HAS_MEMTRACKER:
    import memory_grid  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _one_process_group():
    """The grid's in-process gloo group (world size 1) is not left behind for other test modules."""
    yield
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- the estimate against what a real step holds ---------------------------------------------------------------

QUICK = memory_grid.QUICK if HAS_MEMTRACKER else []


@needs_memtracker
@pytest.mark.parametrize("row,precision,ckpt", QUICK, ids=lambda v: (
    "d{d_model}-s{seq_len}-c{chunks}-p{nb_part}-drop{dropout}".format(**v) if isinstance(v, dict) else str(v)))
def test_estimate_within_targets_of_measured_peak(row, precision, ckpt):
    """Every part within 10 % of MemTracker's peak and never more than 5 % below it; DDP's buckets as estimated."""
    rows = memory_grid.compare_replica(row, precision, ckpt)
    for r in rows:
        assert 1 - memory_grid.LOW <= r["ratio"] <= 1 + memory_grid.HIGH, (r["part"], r["ratio"], r["kinds"])
    assert rows[0]["buckets_measured"] == rows[0]["buckets_estimated"]
    # the allocator saw at least what the tracker counted (the rest is the CPU's own: oneDNN, Python objects)
    assert 0.99 < rows[0]["malloc_vs_tracker"] < 1.5


@needs_memtracker
def test_estimate_of_the_untraced_step_bounds_malloc():
    """One part per replica, no dispatch mode: the checker's own estimate (traced=False) against malloc's count."""
    row = dict(memory_grid.FULL[0], seq_len=32)
    rows = memory_grid.compare_replica(row, "bf16", False)
    assert 1 - memory_grid.LOW <= rows[0]["real_ratio"] <= 1 + memory_grid.HIGH, rows[0]


@needs_memtracker
@pytest.mark.multiproc
def test_stage_estimate_within_targets_of_measured_peak():
    """The stage layout: bench_stage.py's tasks (torchrun, 2 processes), MemTracker in each."""
    rows = memory_grid.compare_stage(memory_grid.QUICK_STAGE[0])
    assert len(rows) == memory_grid.QUICK_STAGE[0]["pp"]
    for r in rows:
        assert 1 - memory_grid.LOW <= r["ratio"] <= 1 + memory_grid.HIGH, (r["part"], r["ratio"], r["kinds"])
        assert r["buckets_measured"] == r["buckets_estimated"]


@needs_memtracker
def test_chunks_do_not_lower_the_measured_peak():
    """GPipe with checkpoint="never" keeps every micro-batch alive until its backward (measured, not assumed): with
    four times the chunks the activations alive at the peak are the same (only the running op's temporaries shrink
    with the micro-batch); checkpointing lowers them."""
    base = dict(d_model=64, n_head=4, d_hid=128, seq_len=64, batch_size=16, nb_part=2, dropout=0.0)
    one = memory_grid.replica_step(dict(base, chunks=1), "fp32", False)["parts"]
    four = memory_grid.replica_step(dict(base, chunks=4), "fp32", False)["parts"]
    ckpt = memory_grid.replica_step(dict(base, chunks=4), "fp32", True)["parts"]
    for a, b, c in zip(one, four, ckpt):
        acts = [x["kinds"]["Activation"] for x in (a, b, c)]
        assert acts[1] > 0.95 * acts[0], acts
        assert acts[2] < 0.5 * acts[1], acts


def test_zero_partition_is_torchs():
    """Our pure-Python ZeRO shares against ZeroRedundancyOptimizer's own partition of the same parameters
    (its private _partition_parameters, re-run for 3 ranks: one process cannot hold a 3-rank group)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = dict(kit.arguments.GPU_DEFAULTS, nlayers=6, d_model=32, d_hid=48, vocab_size=300)
    params = kit.memory._replica_params(model, 3)
    tensors = [torch.nn.Parameter(torch.zeros(n)) for n, _ in params]
    part_of = {id(t): part for t, (_, part) in zip(tensors, params)}
    zero = ZeroRedundancyOptimizer(tensors, optimizer_class=torch.optim.AdamW, lr=1e-3)
    zero.world_size, zero._partition_parameters_cache = 3, []
    owned = [[0] * 3 for _ in range(3)]
    for rank, groups in enumerate(zero._partition_parameters()):
        for t in groups[0]["params"]:
            owned[rank][part_of[id(t)]] += t.numel()
    assert kit.memory._zero_shares(params, 3, 3) == [max(owned[r][p] for r in range(3)) for p in range(3)]
    assert kit.memory._zero_shares([(10, 0), (7, 1), (5, 0), (5, 1), (1, 1)], 2, 2) == [10, 8]


@pytest.mark.multiproc
def test_zero_optimizer_state_counted_over_three_replicas(tmp_path):
    """3 real processes, the trainer's own --zero (make_optimizer: ZeroRedundancyOptimizer(AdamW)): the state each
    rank holds on each part, against the estimate's worst-rank share."""
    args = ["--nb-part", "2", "--batch-size", "8", "--chunks", "2", "--seq-len", "16", "--zero"]
    results = run_tasks([str(ROOT / "tests" / "zero_memory_worker.py"), str(tmp_path), *args], srun_envs(3))
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    held = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    model = dict(kit.arguments.CPU_DEFAULTS, batch_size=8, chunks=2, seq_len=16)
    est = kit.memory.estimate_memory(model, kit.arguments.Training(zero=True), 2, 3, arch="cpu")
    assert [max(h[p] for h in held) for p in range(2)] == [m.optimizer for m in est]
    plain = kit.memory.estimate_memory(model, kit.arguments.Training(), 2, 3, arch="cpu")
    assert sum(sum(h) for h in held) == sum(m.optimizer for m in plain)  # every state once, on one rank


# ---- the model's terms and assumptions -------------------------------------------------------------------------

def test_estimate_terms():
    model = dict(kit.arguments.GPU_DEFAULTS, batch_size=64, chunks=4)
    plain = kit.memory.estimate_memory(model, kit.arguments.Training(), 2, 6)
    assert [m.contents for m in plain] == kit.plan.part_contents(16, 2)
    assert all(m.alive == 4 and m.total == m.peak + m.allowance for m in plain)
    assert all(m.allowance == int(kit.memory.ALLOWANCE_GIB * kit.memory.GIB + kit.memory.ALLOWANCE_FRACTION * m.peak) for m in plain)
    assert all(m.buckets == m.params and m.optimizer == 2 * m.params for m in plain)
    assert all(m.peak_at == "backward, first micro-batch back" for m in plain)  # the GPU defaults' peak
    more_chunks = kit.memory.estimate_memory(dict(model, chunks=16), kit.arguments.Training(), 2, 6)
    assert all(0.9 * p.activations < c.activations <= 1.01 * p.activations for c, p in zip(more_chunks, plain))
    zero = kit.memory.estimate_memory(model, kit.arguments.Training(zero=True), 2, 6)
    assert all(z.optimizer < p.optimizer for z, p in zip(zero, plain))
    ckpt = kit.memory.estimate_memory(model, kit.arguments.Training(activation_checkpointing=True), 2, 6)
    assert all(c.total < p.total and c.recompute > 0 for c, p in zip(ckpt, plain))
    bf16 = kit.memory.estimate_memory(model, kit.arguments.Training(precision="bf16"), 2, 6)
    assert all(b.weight_copies > 0 and b.activations < p.activations for b, p in zip(bf16, plain))
    assert kit.memory.estimate_memory(model, kit.arguments.Training(), 2, 6, arch="cpu")[0].allowance == 0
    line = kit.memory.format_memory(plain, 32.0)
    assert line.startswith("memory estimate: ") and "of 32.0 GiB" in line and "4 alive at most" in line
    assert "peak at backward, first micro-batch back" in line
    assert kit.memory.memory_line(model, kit.arguments.Training(), 2, 6, 32.0) == line
    stage = kit.memory.memory_line(model, kit.arguments.Training(layout="stage", pp=2, schedule="1f1b"), 2, 6, 32.0)
    assert " on task " in stage and "at most" in stage


def test_attention_kernels_per_device_and_precision():
    """The kernel choices the estimate assumes (sdp_utils.cpp): flash for 16 bits on sm80, memory-efficient for
    fp32 and on V100, the math path for head dims the fused kernels refuse and for dropout on the CPU."""
    assert kit.memory.attention_kernel("sm80", "bf16", 64, 0.1) == "flash"
    assert kit.memory.attention_kernel("sm80", "fp32", 64, 0.1) == "efficient"
    assert kit.memory.attention_kernel("sm70", "fp16", 64, 0.1) == "efficient"
    assert kit.memory.attention_kernel("sm80", "bf16", 12, 0.0) == "math"
    assert kit.memory.attention_kernel("cpu", "fp32", 16, 0.0) == "flash"
    assert kit.memory.attention_kernel("cpu", "bf16", 16, 0.1) == "math"


def test_memory_efficient_attention_keeps_its_output_twice():
    """The memory-efficient kernel writes (B, S, H, D), MHA's reshape copies it for out_proj, and both are saved: one
    more output per Layer than flash, whose output the reshape only views."""
    z = dict(n=512, nb=2, seq=256, d=1024, dh=4096, h=16, vocab=30000, a=2, drop=True, cpu=False, traced=False)
    flash = kit.memory._forward("layer", kit.memory._Dims(attn="flash", **z), False)["saved"]["activations"]
    efficient = kit.memory._forward("layer", kit.memory._Dims(attn="efficient", **z), False)["saved"]["activations"]
    lse_pad = 4 * 16 * 2 * 256 - 4 * 16 * 512  # logsumexp: (B, H, S) for both here (256 is a multiple of 32)
    assert efficient - flash == 2 * 512 * 1024 + lse_pad


def test_dropout_masks_by_device():
    """CUDA's fused dropout keeps a bool per element, the CPU a mask in the input's dtype."""
    z = dict(n=64, nb=1, seq=64, d=32, dh=64, h=2, vocab=100, a=4, attn="flash", traced=False)
    cuda = kit.memory._forward("enc", kit.memory._Dims(drop=True, cpu=False, **z), False)["saved"]["activations"]
    cpu = kit.memory._forward("enc", kit.memory._Dims(drop=True, cpu=True, **z), False)["saved"]["activations"]
    assert (cuda, cpu) == (64 * 32, 4 * 64 * 32)


def test_estimate_refuses_bad_input():
    model = dict(kit.arguments.GPU_DEFAULTS)
    with pytest.raises(ValueError, match="precision 'fp8'"):
        kit.memory.estimate_memory(model, kit.arguments.Training(precision="fp8"), 2, 1)
    with pytest.raises(ValueError, match="chunks=128"):
        kit.memory.estimate_memory(dict(model, chunks=128), kit.arguments.Training(), 2, 1)
    with pytest.raises(ValueError, match="arch 'sm99'"):
        kit.memory.estimate_memory(model, kit.arguments.Training(), 2, 1, arch="sm99")


# ---- using it before the queue: the checker ---------------------------------------------------------------
PAGE = ROOT / "slurm" / "page_3nodes_4gpus.slurm"
STAGE_TEMPLATE = ROOT / "slurm" / "stage_2nodes_4gpus.slurm"


def plan(*extra: str) -> tuple[int, str]:
    r = run_checker(*extra)
    return r.returncode, r.stdout + r.stderr


@pytest.mark.parametrize("constraint,gib", [("v100-16g", 16160 / 1024), ("v100-32g", 32510 / 1024),
                                            ("a100", 80.0), ("h100", 81559 / 1024)])
def test_gpu_memory_from_constraint(constraint, gib):
    assert kit.site.gpu_memory(kit.slurm.Job(constraint=constraint)) == (gib, f"-C {constraint}")
    assert kit.site.gpu_memory(kit.slurm.Job(constraint=constraint, gpu_mem=12.5))[0] == 12.5  # --gpu-mem wins
    assert kit.site.gpu_memory(kit.slurm.Job(partition="gpu_p4"))[0] == 40.0  # the 40 GB A100s
    assert kit.site.gpu_memory(kit.slurm.Job(partition="gpu_p13"))[1].endswith("assuming 16 GB")
    assert kit.site.gpu_memory(kit.slurm.Job()) == (None, "unknown")  # then the fit is not checked


def test_page_template_fits_on_v100():
    model = dict(kit.arguments.GPU_DEFAULTS, nlayers=16, chunks=4, batch_size=64)
    for c in ("v100-32g", "v100-16g"):
        job, training, _ = kit.jobscript.read_sbatch(PAGE)
        job.constraint = c
        report = kit.checks.check_job(job, training)
        assert not [f for f in report.findings if f.code in ("does-not-fit", "memory-tight")], report.text()
        worst = kit.memory.worst_part(model, kit.arguments.Training(), 2, 6, "sm70")
        assert any(n.startswith(f"memory estimate: {worst.total / kit.memory.GIB:.2f} GiB") and f"(-C {c})" in n
                   for n in report.notes), report.notes


def test_stage_layout_fit_is_judged():
    """bench_stage.py's template: the checker estimates each task of a pipeline and judges its fit."""
    code, out = plan(str(STAGE_TEMPLATE))
    assert code == 0 and re.search(r"memory estimate: [\d.]+ GiB of 31\.7 GiB on task 0 \(Encoder", out), out
    code, out = plan(str(STAGE_TEMPLATE), "--gpu-mem", "4")
    line = next(x for x in out.splitlines() if "does-not-fit" in x)
    assert code == 1 and "task 0 (Encoder + Layer 0-3) needs an estimated" in line
    assert "--schedule 1f1b keeps at most 4 micro-batch(es)" in line and "--activation-checkpointing:" in line
    gpipe = STAGE_TEMPLATE.read_text().replace("--schedule 1f1b", "--schedule gpipe")
    assert "--schedule 1f1b (at most --pp micro-batches alive)" in plan_text(gpipe, "--gpu-mem", "4")


def plan_text(text: str, *extra: str) -> str:
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        f = Path(d, "job.slurm")
        f.write_text(text)
        return plan(str(f), *extra)[1]


def test_shell_variables_on_the_line_are_not_judged(tmp_path):
    f = tmp_path / "sweep.slurm"
    f.write_text(PAGE.read_text().replace("--batch-size 64 --epochs", '--batch-size "$batch" --epochs'))
    job, training, _ = kit.jobscript.read_sbatch(f)
    report = kit.checks.check_job(job, training)
    assert training.unchecked and not [n for n in report.notes if "memory" in n], report.text()
    assert not [x for x in report.findings if x.code == "does-not-fit"]
    # the stage layout likewise: a size the line leaves unknown, or the pipelines themselves, judge no fit
    for var in ('--chunks "$C"', '--pp "$PP"', '$EXTRA'):
        out = plan_text(STAGE_TEMPLATE.read_text().replace("--chunks 8", var), "--gpu-mem", "4")
        assert "does-not-fit" not in out and "memory estimate" not in out, out
        assert "the fit in memory" in next(x for x in out.splitlines() if "unchecked-argument" in x), out


SPLIT = ["--nodes", "3", "--gpus-per-node", "4", "--ntasks-per-node", "4", "-C", "v100-16g", "--nlayers", "16",
         "--batch-size", "64", "--chunks", "4"]


def apply_fix(args: list[str], label: str) -> list[str]:
    """The checker's command line with one of its own suggested fixes applied, as a user would type it."""
    out = list(args)
    for flag, value in re.findall(r"(--[a-z-]+)(?:[ =](\d+|fp16|bf16|1f1b))?", label.split(":")[0]):
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag] + ([value] if value else [])
    return out


def test_split_that_cannot_fit_is_refused_and_each_fix_is_what_the_checker_then_says():
    """The fixes in the does-not-fit message, each applied to the line and checked again: the checker's verdict on
    the fixed line is the one the message gave (its estimate to 0.1 GiB, and 'still too big' iff it fails)."""
    code, out = plan(*SPLIT)
    assert code == 1
    line = next(x for x in out.splitlines() if "does-not-fit" in x)
    assert "part 0 (Encoder + Layer 0-15 + Decoder) needs an estimated" in line and "more --chunks do not help" in line
    fixes = line.split("Fixes, each estimated: ")[1].split("; ")
    labels = [f.split(":")[0] for f in fixes]
    assert {"--activation-checkpointing", "--precision fp16", "--zero"} <= set(labels)  # V100: fp16, not bf16
    assert any(x.startswith("--ntasks-per-node=2") for x in labels)
    assert any(x.startswith("--batch-size") for x in labels)
    for fix in fixes:
        gib = float(re.search(r": ([\d.]+) GiB", fix).group(1))
        code, again = plan(*apply_fix(SPLIT, fix))
        note = re.search(r"memory estimate: ([\d.]+) GiB", again)
        assert note and abs(float(note.group(1)) - gib) <= 0.051, (fix, again)  # 2 decimals there, 1 in the fix
        assert ("does-not-fit" in again) == ("still too big" in fix), (fix, again)
    batch = int(re.search(r"--batch-size (\d+)", line).group(1))  # the largest multiple of --chunks that fits
    assert "does-not-fit" in plan(*apply_fix(SPLIT, f"--batch-size {batch + 4}"))[1]


def test_memory_tight_warns_close_to_the_gpus_memory():
    """memory-tight appears above 90 % of the GPU (and the job is not refused); below it, or over it, it does not."""
    args = ["--nodes", "1", "--gpus-per-node", "4", "--ntasks-per-node", "2", "--nlayers", "16"]
    worst = kit.memory.worst_part(dict(kit.arguments.GPU_DEFAULTS), kit.arguments.Training(), 2, 2,
                                  "sm80").total / kit.memory.GIB
    code, out = plan(*args, "--gpu-mem", f"{worst / 0.95:.3f}")
    assert code == 0 and "memory-tight" in out and f"estimated at {worst:.1f} GiB" in out, out
    code, out = plan(*args, "--gpu-mem", f"{worst / 0.85:.3f}")
    assert code == 0 and "memory-tight" not in out
    code, out = plan(*args, "--gpu-mem", f"{worst / 1.02:.3f}")
    assert code == 1 and "memory-tight" not in out and "does-not-fit" in out


def test_trainer_line_model_and_memory_options(tmp_path):
    text = PAGE.read_text().replace(
        "--nlayers 16 --chunks 4 --batch-size 64 --epochs 2",
        "--nlayers 16 --chunks 4 --batch-size 64 --d-model 2048 --seq-len 512 --dropout 0 --precision fp16 "
        "--activation-checkpointing --zero --epochs 2")
    f = tmp_path / "job.slurm"
    f.write_text(text)
    job, training, findings = kit.jobscript.read_sbatch(f)
    assert training.model == dict(d_model=2048, seq_len=512, dropout=0.0)
    assert (training.precision, training.activation_checkpointing, training.zero) == ("fp16", True, True)
    report = kit.checks.check_job(job, training)
    assert not [x for x in report.findings if x.code == "does-not-fit"], report.text()
    code, out = plan(str(f), "--gpu-mem", "2")
    assert code == 1 and "does-not-fit" in out and "(--gpu-mem 2)" in out
    f.write_text(text.replace("--precision fp16", "--precision bf16"))
    code, out = plan(str(f))
    assert code == 1 and "bf16-on-v100" in out
    f.write_text(text.replace("--precision fp16", "--precision fp8"))
    code, out = plan(str(f))
    assert code == 1 and "--precision 'fp8' is not one of fp32, bf16, fp16" in out


def test_advise_lists_splits_that_fit_in_both_layouts():
    code, out = plan("--advise", "--nodes", "3", "--gpus-per-node", "4", "-C", "v100-32g", "--global-batch", "384",
                     "--json")
    assert code == 0
    rows = json.loads(out)
    gib = 32510 / 1024
    assert rows and all(r["peak_gib"] <= gib for r in rows)
    assert [(r["nb_part"], r["bubble"]) for r in rows] == sorted((r["nb_part"], r["bubble"]) for r in rows)
    page = [r for r in rows if (r["layout"], r["ntasks_per_node"], r["chunks"], r["precision"],
                                r["activation_checkpointing"], r["zero"]) == ("replica", 2, 4, "fp32", False, False)]
    assert page and page[0]["nb_part"] == 2 and page[0]["batch_size"] == 64 and page[0]["bubble"] == 0.2
    assert {r["layout"] for r in rows} == {"replica", "stage"}
    assert all(r["schedule"] == "1f1b" and r["chunks"] >= r["nb_part"] and r["ntasks_per_node"] == 4
               for r in rows if r["layout"] == "stage")
    for r in rows[:: max(1, len(rows) // 12)]:
        t = kit.arguments.Training(layout=r["layout"], pp=r["nb_part"], schedule=r["schedule"],
                                   precision=r["precision"],
                        activation_checkpointing=r["activation_checkpointing"], zero=r["zero"])
        m = dict(kit.arguments.GPU_DEFAULTS, batch_size=r["batch_size"], chunks=r["chunks"])
        assert round(kit.memory.worst_part(m, t, r["nb_part"], r["replicas"], "sm70").total / kit.memory.GIB,
                     2) == r["peak_gib"]
    assert {r["precision"] for r in rows if r["layout"] == "replica"} == {"fp32", "fp16"}  # V100: never bf16
    assert {r["precision"] for r in rows if r["layout"] == "stage"} == {"fp32"}  # the stage layout refuses fp16
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
    seen, why = kit.allocation.gpus_memory_here()
    assert seen == 16160 / 1024 and why is None
    job = kit.slurm.Job(constraint="v100-32g", gpu_mem_seen=seen)
    assert kit.site.gpu_memory(job) == (seen, "the allocation's GPUs (nvidia-smi)")
    smi.write_text("#!/bin/sh\nexit 9\n")
    seen, why = kit.allocation.gpus_memory_here()  # a failing nvidia-smi: back to the constraint, and why
    assert seen is None and "exit status 9" in why


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 24), st.integers(1, 8), st.integers(1, 64), st.integers(1, 8), st.integers(1, 512),
       st.integers(1, 8), st.sampled_from(kit.arguments.PRECISIONS), st.booleans(), st.booleans(),
       st.sampled_from(kit.memory.ARCHS),
       st.sampled_from([0.0, 0.1]))
def test_estimate_properties(nlayers, heads, per_head, nb_part, seq, chunks, precision, ckpt, zero, arch, dropout):
    """Over generated models: every term >= 0, the parts hold every parameter once, a larger batch never needs
    less, ZeRO never needs more and with one replica changes nothing, checkpointing never needs more activations;
    the stage layout's tasks likewise non-negative, with the same weights. (1F1B is not always below GPipe: with
    tiny activations its later forwards run with every gradient already there.)"""
    model = dict(nlayers=nlayers, d_model=heads * per_head, n_head=heads, d_hid=4 * per_head, seq_len=seq,
                 vocab_size=1000, batch_size=chunks * 2, chunks=chunks, dropout=dropout)
    t = kit.arguments.Training(precision=precision, activation_checkpointing=ckpt, zero=zero)
    parts = kit.memory.estimate_memory(model, t, nb_part, 3, arch)
    assert len(parts) == nb_part and all(getattr(m, k) >= 0 for m in parts for k in kit.memory.PartMemory.TERMS)
    assert sum(m.params for m in parts) == 4 * sum(n for n, _ in kit.memory._replica_params(model, nb_part))
    bigger = kit.memory.estimate_memory(dict(model, batch_size=chunks * 4), t, nb_part, 3, arch)
    assert all(b.total >= p.total for b, p in zip(bigger, parts))
    plain = kit.memory.estimate_memory(model, replace(t, zero=False), nb_part, 3, arch)
    assert all(z.optimizer <= p.optimizer for z, p in zip(parts, plain))
    assert kit.memory.estimate_memory(model, t, nb_part, 1, arch) == kit.memory.estimate_memory(model, replace(t, zero=False),
                                                                                nb_part, 1, arch)
    if ckpt:
        full = kit.memory.estimate_memory(model, replace(t, activation_checkpointing=False), nb_part, 3, arch)
        assert all(c.per_micro_batch <= f.per_micro_batch for c, f in zip(parts, full))
    if nb_part > 1:
        stage_t = replace(t, layout="stage", pp=nb_part, schedule="1f1b",
                          precision="bf16" if precision == "fp16" else precision)
        tasks = kit.memory.estimate_stage_memory(model, stage_t, nb_part, 3, arch)
        assert len(tasks) == nb_part and all(getattr(m, k) >= 0 for m in tasks for k in kit.memory.PartMemory.TERMS)
        assert sum(m.params for m in tasks) == sum(m.params for m in parts)  # the same weights, split alike

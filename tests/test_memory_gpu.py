"""benchmarks/memory_gpu.py measures honestly: each configuration in a process of its own, its measured steps before
any tracker. Run here on the CPU (its --cpu flow: the trainer's Replica at the CPU defaults, gloo, MemTracker); the
allocator figures themselves need a GPU.

On the H200 (2026-12-04) it ran every configuration in one process, a MemTracker step after each: 1.33, 1.23 and 1.97
of the estimate, because MemTracker keeps the model's parameters and gradients alive after its step, and every later
configuration's max_memory_allocated carried them."""
from __future__ import annotations

import gc
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from launch import ROOT, clean_env, without_gpu

sys.path.insert(0, str(ROOT / "benchmarks"))

HAS_MEMTRACKER = importlib.util.find_spec("torch.distributed._tools.mem_tracker") is not None
needs_memtracker = pytest.mark.skipif(not HAS_MEMTRACKER, reason="torch < 2.5 has no MemTracker to measure with")


def live_parameters() -> int:
    import torch
    gc.collect()
    return sum(issubclass(type(o), torch.nn.Parameter) for o in gc.get_objects())


@needs_memtracker
def test_a_configuration_runs_in_its_own_process_and_leaves_the_parent_no_parameter():
    """The benchmark's own flow for one configuration: a child process measures, then runs the tracked step; this
    process builds nothing and holds no parameter after it, and the child's figures come back (per term within 10 %
    of the traced estimate, as benchmarks/memory_grid.py holds them on the CPU)."""
    import memory_gpu
    before = live_parameters()
    conf = dict(precision="fp32", ckpt=False, nb_part=1, cpu=True, dropout=None, threads=1)
    got = memory_gpu.run_configuration(conf, timeout=240)
    assert "failed" not in got, got
    assert live_parameters() <= before  # none added here (an earlier test's garbage may have gone meanwhile)
    assert got["pid"] != os.getpid() and got["terms"] is not None
    rows = memory_gpu.term_rows(memory_gpu.model_of(True, None), conf, got, "cpu")
    ratios = [float(v) for row in rows for v in row.strip("| ").split(" | ")[3:] if v.strip()]
    assert len(rows) == 2 and len(ratios) == 5 and all(0.9 <= r <= 1.1 for r in ratios), rows


@needs_memtracker
def test_the_tracked_step_keeps_the_model_alive_in_its_process():
    """Why a process per configuration, measured steps first: after the trainer's steps and close() no parameter is
    left; after a step under MemTracker (memory_grid's tracker, as memory_gpu runs it) and close(), parameters are
    (torch 2.13: 49 of the 53 at the CPU defaults, with their gradients), so in one process every later configuration's
    max_memory_allocated counted them. In a subprocess: what it leaves must not stay in the test process."""
    code = textwrap.dedent(f"""
        import gc, sys
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'benchmarks')!r}]
        import torch, torch.distributed as dist
        import memory_gpu
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        model = memory_gpu.model_of(True, None)
        def alive():
            gc.collect()
            return sum(issubclass(type(o), torch.nn.Parameter) for o in gc.get_objects())
        memory_gpu.measure(model, "fp32", False, 1, False)
        print("after the measured steps", alive())
        memory_gpu.terms(model, "fp32", False, 1, False)
        print("after the tracked step", alive())
    """)
    r = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    counts = dict(line.rsplit(" ", 1) for line in r.stdout.splitlines() if line.startswith("after"))
    assert counts["after the measured steps"] == "0", r.stdout
    assert int(counts["after the tracked step"]) > 0, r.stdout  # 49 on torch 2.13


def test_no_gpu_is_refused_in_one_line():
    r = without_gpu("benchmarks/memory_gpu.py")
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memory_gpu: no CUDA GPU here"), r.stderr


@pytest.mark.parametrize("args,needle", [(["--jobs", "0"], "--jobs 0 must be at least 1"),
                                         (["--nb-part", "0"], "--nb-part 0 must be at least 1")])
def test_bad_arguments_name_the_value(args, needle):
    r = without_gpu("benchmarks/memory_gpu.py", *args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("gib,jobs", [(139.8, 4), (80.0, 2), (32.0, 1)])
def test_configurations_side_by_side_only_as_many_as_fit(monkeypatch, gib, jobs):
    """--jobs 4 (`make gpu-check`): the largest configuration at the GPU defaults is 25.4 GiB with its allowance, so
    an H200 takes four at once, an 80 GB GPU two, a V100 one; fewer than asked is said in a note."""
    import types

    import memory_gpu
    monkeypatch.setattr(memory_gpu.torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(total_memory=int(gib * 2**30)))
    confs = [dict(precision=p, ckpt=c) for p in ("fp32", "bf16") for c in (False, True)]
    got, notes = memory_gpu.jobs_that_fit(memory_gpu.parse(["--jobs", "4"]), memory_gpu.model_of(False, None),
                                          "sm80", False, confs)
    assert got == jobs and len(notes) == (jobs < 4)
    assert not notes or notes[0].startswith(f"note: --jobs 4: {jobs} at once, as {jobs} of the largest configuration")


def test_a_baseline_that_is_not_zero_is_said_and_reserved_memory_compared_only_from_an_empty_cache(capsys):
    """The GPU's rows from a child's figures (made up here): the peak counted from memory_allocated() before the
    model, a note where that was not 0; max_memory_reserved compared only where the cache was empty before it."""
    import memory_gpu
    gib = 2**30
    model, conf = memory_gpu.model_of(False, None), dict(precision="fp32", ckpt=False, nb_part=1)
    clean = dict(allocated=[int(22.26 * gib)], reserved=[int(22.51 * gib)], before_allocated=[0],
                 before_reserved=[0])
    notes: list[str] = []
    worst = memory_gpu.rows(model, conf, clean, "sm80", False, notes)
    row = capsys.readouterr().out.strip()
    assert notes == [] and row.startswith("| fp32 | no | 0 | 22.17 | 22.26 | 1.004 | 25.38 | 22.51 | 0.887 |")
    assert worst == [pytest.approx(0.004, abs=0.001)]
    dirty = dict(clean, before_allocated=[int(1.76 * gib)], before_reserved=[int(2.0 * gib)])
    memory_gpu.rows(model, conf, dirty, "sm80", False, notes)
    row = capsys.readouterr().out.strip()
    assert row.startswith("| fp32 | no | 0 | 22.17 | 22.26 | 1.004 | 25.38 | - | - |"), row
    assert len(notes) == 2 and "1.76 GiB allocated before the model was built" in notes[0]
    assert "the cache held 2.00 GiB before the model was built: max_memory_reserved not compared" in notes[1]

"""`make gpu-check` (benchmarks/gpu_all.py) on the CPU: its one-line refusal without a GPU, its steps' time caps and
budget, the report it writes whatever fails, the wheels it installs where a package is missing, and what it reads
in each step's output. The steps themselves need a GPU."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

from launch import ROOT, clean_env, without_gpu

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_all  # noqa: E402


def test_no_gpu_is_said_in_one_line_and_exits_non_zero():
    r = without_gpu("benchmarks/gpu_all.py")
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_all: error: no CUDA GPU here"), r.stderr
    assert "make gpu-check GPU_PYTHON=" in lines[0]


def test_make_gpu_check_without_a_gpu_says_so_in_one_line():
    r = subprocess.run(["make", "-s", "gpu-check", f"GPU_PYTHON={sys.executable}", "GPU_WHEELS=/nonexistent"],
                       cwd=ROOT, env=clean_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stdout == "", r.stdout + r.stderr
    said = [line for line in r.stderr.splitlines() if not line.startswith("make")]
    assert len(said) == 1 and said[0].startswith("gpu_all: error: no CUDA GPU here"), r.stderr


def test_a_python_without_torch_is_named():
    r = subprocess.run([sys.executable, "-S", "-c", "import runpy, sys; sys.argv = ['gpu_all.py']; "
                        f"runpy.run_path({str(ROOT / 'benchmarks' / 'gpu_all.py')!r}, run_name='__main__')"],
                       env=clean_env(PYTHONPATH=""), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "cannot import torch" in r.stderr, r.stderr


def probe(name: str, code: str) -> gpu_all.Step:
    """A step that runs `code` and passes on exit 0."""
    return gpu_all.Step(name, 0, [sys.executable, "-c", textwrap.dedent(code)], f"probe {name}",
                        lambda step, out, rc, log: (rc == 0, f"exit {rc}: {log.strip()[-40:]}", [log.strip()]))


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"  # a zombie is dead
    except FileNotFoundError:
        return True


def test_each_step_is_capped_with_what_it_started_and_the_report_says_so(tmp_path):
    """A step past its cap is stopped with every process it started (SIGTERM to its group, then SIGKILL); a step
    that fails does not stop the others; once the budget is spent the rest are skipped; the report is rewritten
    after each step, so it exists whatever happens next."""
    pidfile = tmp_path / "child.pid"
    ok = probe("ok", "print('fine')")
    fails = probe("fails", "import sys; sys.exit('broken')")
    hangs = probe("hangs", f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        open({str(pidfile)!r}, "w").write(str(child.pid))
        print("started", flush=True)
        time.sleep(300)
    """)
    late = probe("late", "print('never')")
    ok.cap, fails.cap, hangs.cap, late.cap = 8, 8, 8, 20
    todo = [ok, fails, hangs, late]
    reports = []

    def report(done):
        gpu_all.write_report(tmp_path / "REPORT.md", ["# probe"], done, todo)
        reports.append((tmp_path / "REPORT.md").read_text())
    t0 = time.monotonic()
    # 25 s: 15 s of room (the budget less the 10 s grace) for the first three, then under 20 s: the last is skipped
    done = gpu_all.run_all(todo, tmp_path, budget=25, env=clean_env(), report=report, start=t0)
    assert [o.rc for o in done[:2]] == [0, 1] and done[0].passed and not done[1].passed
    assert done[2].timed_out and not done[2].passed and done[2].result.startswith("cut at its cap")
    assert done[3].rc is None and done[3].result == "skipped: the budget is spent"
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 30
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gone(child), "the step's own child outlived the step's cap"
    assert len(reports) == 4 and "| ok | probe ok | exit 0: fine |" in reports[0]
    assert "| hangs | probe hangs | not run yet |" in reports[1] and "started" in (tmp_path / "hangs.txt").read_text()
    assert "| late | probe late | skipped: the budget is spent |" in reports[-1]
    assert "broken" in (tmp_path / "fails.txt").read_text()


def make_wheel(folder: Path, module: str) -> Path:
    """A minimal pure-Python wheel holding `module`.py (the layout pip installs: PEP 427)."""
    dist = f"{module}-1.0.dist-info"
    path = folder / f"{module}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}.py", "VALUE = 42\n")
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


def test_a_missing_package_comes_from_the_wheels_or_is_named(tmp_path, monkeypatch):
    """Where the GPU's python lacks a package, the wheels `make gpu-wheels` made are installed in a folder of their
    own and the steps get it on PYTHONPATH; without a wheel for it, one line names it and the make target."""
    module = "kit_gpu_probe_pkg"
    monkeypatch.setattr(gpu_all, "PACKAGES", {module: "kit-gpu-probe-pkg", "json": "json"})
    empty = tmp_path / "none"
    extra, why = gpu_all.bring_packages(empty, tmp_path / "site0")
    assert extra == {} and "lacks kit-gpu-probe-pkg" in why and "make gpu-wheels" in why and "\n" not in why
    wheels = tmp_path / "whl"
    wheels.mkdir()
    make_wheel(wheels, module)
    extra, why = gpu_all.bring_packages(wheels, tmp_path / "site")
    assert why is None and extra["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "site")
    r = subprocess.run([sys.executable, "-c", f"import {module}; print({module}.VALUE)"],
                       env=clean_env(**extra), capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "42", r.stderr


GPU_CHECK_LOG = """gpu_check: NVIDIA H200 x 1, torch 2.11.0+cu130, nccl, 1 task(s); 3 interleaved runs of each side
| row | script samples/s, median (min-max) | bare loop samples/s, median (min-max) | script / bare loop | |
| --- | --- | --- | --- | --- |
| nb_part 1 bf16 | 390.1 (388.0-391.2) | 401.0 (399.9-402.3) | 0.973 | ok |
| nb_part 1 fp32 | 125.5 (125.1-125.6) | 127.4 (127.0-127.5) | 0.985 | ok |
| nb_part 2 bf16 (--devices 0,0) | 360.0 (358.0-361.0) | 401.0 (399.0-402.0) | 0.898 | below the goal 0.95 |
| nb_part 2 fp32 (--devices 0,0) | - | - | - | failed: the script failed on nb_part 2 fp32 |
"""


def test_what_each_step_says_is_read_off_its_output(tmp_path):
    step = gpu_all.Step("x", 1, ["x"], "x", gpu_all.judge_gpu_check)
    passed, result, details = gpu_all.judge_gpu_check(step, tmp_path, 1, GPU_CHECK_LOG)
    assert not passed and result == "2 of 4 row(s) at script / bare loop >= 0.95; 2 below or failed"
    assert details[0].startswith("gpu_check: NVIDIA H200") and len([d for d in details if d.startswith("|")]) == 6
    at_chance = "epoch   1 | steps    62 | loss 0.71 | train acc 0.49 | test acc 0.500 |    32.1s |\n"
    passed, result, _ = gpu_all.judge_train(step, tmp_path, 0, at_chance)
    assert not passed and result.startswith("**did not learn**: test acc 0.500 (chance 0.50")
    (tmp_path / "train.jsonl").write_text('{"test_acc": 0.955, "samples_per_s": 125.5}\n')
    passed, result, _ = gpu_all.judge_train(step, tmp_path, 0, at_chance)
    assert passed and result == "learned: test acc 0.955 (chance 0.50, goal >= 0.60), 125.5 samples/s"
    memory = "| fp32 | no | 0 | 22.17 | 22.26 | 1.004 |\n\nworst |allocated / estimated - 1| = 32.9%\n"
    passed, result, _ = gpu_all.judge_memory(step, tmp_path, 0, memory)
    assert not passed and result.startswith("worst |max_memory_allocated / estimate - 1| = 32.9% (target <= 10%)")


def test_the_budget_fits_eight_minutes():
    """8 minutes in all on an H200: the budget leaves make and the report their seconds, and the steps' expected
    times (2026-12-04's timings) fit in it, the last (memory_gpu_2p) where time is left; every cap above its
    expected time, so a step cut at its cap is one that ran long."""
    todo = gpu_all.steps("python", Path("/tmp/out"), 1, 139.8)
    assert [s.name for s in todo] == [n for n in gpu_all.STEPS if n != "zero_bubble"]  # the stage layout: 2 GPUs
    two = gpu_all.steps("python", Path("/tmp/out"), 2, 139.8)
    assert [s.name for s in two] == list(gpu_all.STEPS) and "zbvzerobubble" in two[-1].argv
    budget = gpu_all.parse([]).budget
    assert budget <= 8 * 60 - 10
    assert sum(s.expect for s in todo[:-1]) + 10 + gpu_all.GRACE <= budget  # 10 s: torch's import, the wheels
    assert all(s.cap >= 1.1 * s.expect for s in todo)
    assert todo[0].argv[1:3] == ["bench_ddp_transformer.py", "--synthetic"] and "--max-steps" in todo[0].argv


@pytest.mark.parametrize("args,needle", [(["--budget", "0"], "--budget 0 must be at least 1 second"),
                                         (["--only", "gpu_check,trian"], "--only: no step trian; the steps: train,")])
def test_bad_arguments_name_the_value(args, needle):
    r = without_gpu("benchmarks/gpu_all.py", *args, timeout=60)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr

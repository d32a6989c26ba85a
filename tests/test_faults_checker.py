"""The checker's input as accidents and attackers give it (issue 35): job scripts that cost more than any budget
(a few hundred bytes asking for 10^8 function calls or gigabytes of values, megabytes on one line), profiles that
are damaged, cut, foreign or hostile, and launcher variables that are out of range. Each must be one finding or one
line, within a second or so and a bounded memory, never a traceback. docs/faults.md lists what is guaranteed.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import check_topology as ct
import kit.jobscript
import kit.trainer_checks
import idr_torch
from checker import run_checker
from launch import ROOT

CI = os.environ.get("CI") == "true"
# CPU seconds of one script's check (time.process_time: what a loaded machine's other work does not add) and how
# much its memory rose. The checker takes well under a second and tens of MB on each (docs/faults.md); the bounds
# leave room for a slow, shared 2-core box.
SECONDS, MIB = 5.0, 300


def limited(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """The checker with 1 GiB of address space and 60 s: a file that made it grow or spin fails here."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 ** 30, 2 ** 30))
    return subprocess.run([sys.executable, str(ROOT / "check_topology.py"), *args], capture_output=True, text=True,
                          timeout=60, preexec_fn=cap, env=env)


def _rss_mib(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) // 1024


def measured(path: Path) -> tuple[int, dict, float, float]:
    """The checker's main() on one script in this process: exit code, JSON report, CPU seconds, and how far the
    process's resident memory rose above where it was (Linux's peak, VmHWM, reset first through
    /proc/self/clear_refs; tracemalloc's peak, a run of its own, where that is not available: tracemalloc makes
    the run several times slower, so the time is not taken under it)."""
    out = io.StringIO()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        rss = True
    except OSError:
        rss = False
    before = _rss_mib("VmRSS") if rss else 0
    start = time.process_time()
    with contextlib.redirect_stdout(out):
        code = ct.main(["--json", str(path)])
    seconds = time.process_time() - start
    if rss:
        peak = _rss_mib("VmHWM") - before
    else:
        tracemalloc.start()
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                ct.main(["--json", str(path)])
            peak = tracemalloc.get_traced_memory()[1] / 2 ** 20
        finally:
            tracemalloc.stop()
    return code, json.loads(out.getvalue()), seconds, peak


def codes(report: dict) -> list[str]:
    return [f["code"] for f in report["findings"]]


# ---- serious fault 5: scripts that cost more than any budget ----------------------------------------------------------
FORK = "#!/bin/bash\n#SBATCH -N 1 --gres=gpu:4 -t 1:00:00\nf() { f; f; f; f; f; f; f; f; f; f; }; f\nsrun python t.py\n"
DOUBLING = "#!/bin/bash\nX0=ab\n" + "".join(f'X{i + 1}="$X{i}$X{i}"\n' for i in range(40)) + "srun python t.py\n"


@pytest.mark.parametrize("text,line", [(FORK, 3), (DOUBLING, 23)], ids=["function-calls", "doubling-values"])
def test_the_issues_two_scripts_are_one_finding_within_a_second(tmp_path, text, line):
    """The issue's examples: 10^8 calls (12 minutes before) and a value doubled 40 times (MemoryError at 3 GB):
    one `too-complex` warning naming the line where the reading stopped, the rest checked as usual."""
    script = tmp_path / "job.slurm"
    script.write_text(text)
    out = limited([str(script), "--json"])
    assert out.returncode in (0, 1) and not out.stderr, out.stderr[-2000:]
    report = json.loads(out.stdout)
    [finding] = [f for f in report["findings"] if f["code"] == "too-complex"]
    assert f"job.slurm:{line}: this script is too complex to follow past line {line}" in finding["message"]
    assert "checked up to there" in finding["message"]
    code, _, seconds, peak = measured(script)
    assert seconds < SECONDS and peak < MIB, (seconds, peak)


@pytest.mark.parametrize("line", [
    "echo " + "a " * (2 * 2 ** 20 - 8),  # two million words
    'echo "' + "a" * (4 * 2 ** 20 - 40) + '"',  # one string
    "X=" + "$Y" * (2 * 2 ** 20 - 8),  # two million expansions in one word
    "echo " + "$(" * (2 * 2 ** 20 - 8),  # never closed
], ids=["words", "string", "expansions", "substitutions"])
def test_a_line_of_megabytes_is_read_within_a_second(tmp_path, line):
    """Lines of several MB (quadratic before: about 4 minutes at the 4 MiB cap): linear now, and cut by the budget."""
    script = tmp_path / "long.slurm"
    text = ("#!/bin/bash\n#SBATCH -N 1\n" + line)[:kit.jobscript.MAX_SCRIPT_BYTES - 20] + "\nsrun python t.py\n"
    script.write_text(text)
    assert 4 * 10 ** 6 < script.stat().st_size <= kit.jobscript.MAX_SCRIPT_BYTES
    out = limited([str(script), "--json"])
    assert out.returncode in (0, 1) and not out.stderr, out.stderr[-2000:]
    code, report, seconds, peak = measured(script)
    assert seconds < SECONDS and peak < MIB, (seconds, peak)


def test_blank_comment_and_heredoc_megabytes_are_read_within_a_second(tmp_path):
    for name, text in (("comments", "#\n" * (2 ** 21 - 16)),
                       ("heredoc", "cat <<EOF\n" + "a\n" * (2 ** 21 - 16) + "EOF\n"),
                       ("directives", "#SBATCH --comment=x\n" * 200_000),
                       ("stray", "true\n" + "#SBATCH -N 1\n" * 300_000)):
        script = tmp_path / f"{name}.slurm"
        script.write_text("#!/bin/bash\n" + text + "srun python t.py\n")
        code, report, seconds, peak = measured(script)
        assert code in (0, 1) and seconds < SECONDS and peak < MIB, (name, seconds, peak)
        assert len(report["findings"]) < 30, (name, codes(report))  # stray directives: the first 20 said


def test_a_budget_cut_keeps_what_was_read(tmp_path):
    """The trainer line before the costly part is checked as usual; the one after is not followed."""
    script = tmp_path / "cut.slurm"
    script.write_text("#!/bin/bash\n#SBATCH -N 1 --ntasks-per-node=2 --gres=gpu:4 -C v100-32g -c 20 --hint=nomultithread"
                      " -t 1:00:00\nsrun python bench_ddp_transformer.py --chunks 3 --batch-size 64\n" + FORK.split("\n")[2]
                      + "\nsrun python bench_ddp_transformer.py --chunks 7\n")
    code, report, seconds, peak = measured(script)
    found = codes(report)
    assert "too-complex" in found and "chunks-not-dividing-batch" in found and code == 1
    assert "chunks 7" not in json.dumps(report)


def test_nesting_past_the_parsers_depth_is_one_finding(tmp_path):
    script = tmp_path / "deep.slurm"
    script.write_text("#!/bin/bash\n" + "if a; then\n" * 300 + "srun python t.py\n" + "fi\n" * 300)
    code, report, seconds, peak = measured(script)
    [finding] = [f for f in report["findings"] if f["code"] == "too-complex"]
    assert "nested more than 40 deep" in finding["message"] and seconds < SECONDS


# hostile pieces: functions calling each other, self-doubling values, long lines, deep nesting, eval and bash -c
def _functions(draw) -> str:
    n, calls = draw(st.integers(1, 4)), draw(st.integers(1, 12))
    names = [f"f{i}" for i in range(n)]
    return "".join(f"{a}() {{ {'; '.join(draw(st.sampled_from(names)) for _ in range(calls))}; }}\n" for a in names) \
        + names[0] + "\n"


def _doubling(draw) -> str:
    name, lines = draw(st.sampled_from(["X", "A"])), draw(st.integers(1, 45))
    step = 'X="$X$X"' if name == "X" else 'A=(${A[@]} ${A[@]})'
    return ("X=ab\n" if name == "X" else "A=(a b)\n") + (step + "\n") * lines + f"echo ${name} ${{{name}[@]}}\n"


def _long_line(draw) -> str:
    unit = draw(st.sampled_from(["a ", "$Y", '"b"', "${Z:-", "$((1+", "'q' ", "; ", "x=1 ", "\\\n", "# c\n", "\n"]))
    return "echo " + unit * draw(st.integers(1, 300_000)) + "\n"


def _nesting(draw) -> str:
    depth = draw(st.integers(1, 400))
    opener, closer = draw(st.sampled_from([("if a; then ", "; fi"), ("for i in 1 2; do ", "; done"), ("{ ", "; }"),
                                           ("( ", " )"), ("while a; do ", "; done"), ("case $x in a) ", ";; esac")]))
    return opener * depth + "srun python t.py" + closer * depth + "\n"


def _evals(draw) -> str:
    return draw(st.sampled_from([
        "X='eval \"$X\"; eval \"$X\"'\neval \"$X\"\n",
        "srun bash -c 'f() { f; f; f; f; f; f; f; f; }; f'\n",
        "echo " + "${X:-" * 500 + "a" + "}" * 500 + "\n",
        "echo $((" + "1*" * 100_000 + "1))\n",
        "".join(f"V{i}=$V{i - 1}x\n" for i in range(1, 3000)) + "if a; then b; fi\n" * 3000,
    ]))


@st.composite
def hostile_scripts(draw) -> str:
    pieces = draw(st.lists(st.sampled_from([_functions, _doubling, _long_line, _nesting, _evals]), min_size=1,
                           max_size=3))
    return "#!/bin/bash\n#SBATCH -N 1 --gres=gpu:4\n" + "".join(p(draw) for p in pieces) + "srun python t.py\n"


@settings(max_examples=15 if CI else 60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(hostile_scripts())
def test_any_hostile_script_is_a_report_within_a_second(tmp_path, text):
    """Generated hostile scripts: a report (findings, never a traceback), in bounded CPU time and memory each."""
    script = tmp_path / "hostile.slurm"
    script.write_bytes(text.encode()[:kit.jobscript.MAX_SCRIPT_BYTES])
    code, report, seconds, peak = measured(script)
    assert code in (0, 1) and isinstance(report["findings"], list)
    assert seconds < SECONDS and peak < MIB, (seconds, peak, text[:200])


# ---- serious fault 4: profiles --------------------------------------------------------------------------------------
def good_profile() -> dict:
    return json.loads((ROOT / "docs" / "cpu_profile.json").read_text())


def edited(change) -> dict:
    profile = good_profile()
    change(profile)
    return profile


def nested(depth: int) -> str:
    return '{"format": "kit-profile/1", "junk": ' + "[" * depth + "]" * depth + "}"


PROFILES = {  # the file's content, what the one line says
    "nlayers 1e9": (edited(lambda p: p["key"].update(nlayers=1e9)), "--nlayers 1000000000.0 must be an integer"),
    "nlayers 10^9": (edited(lambda p: p["key"].update(nlayers=10 ** 9)), "--nlayers 1000000000 must be an integer"),
    "d_model NaN": ('{"format": "kit-profile/1", "key": {"model": {"d_model": NaN}}}', "NaN is not a number"),
    "time 1e999": ('{"format": "kit-profile/1", "optimizer": {"Layer": 1e999}}', "the number 1e999 is out of range"),
    "5000 digits": ('{"format": "kit-profile/1", "n": ' + "9" * 5000 + "}", "an integer of 5000 digits"),
    "truncated": (json.dumps(good_profile())[:5000], "is not JSON"),
    "non-UTF-8": (b'{"format": "kit-profile/1", "host": "\xff\xfe"}', "is not UTF-8 text (byte 0xff"),
    "nested junk": (nested(100_000), "nested too deep"),
    "compute a string": (edited(lambda p: p.update(compute="fast")), "profile.compute is 'fast', not a list"),
    "points not increasing": (edited(lambda p: p["compute"][0]["blocks"]["Layer|fp32|0"].reverse()),
                              "profile.compute[0].blocks['Layer|fp32|0'][1][0]"),
    "row of 2": (edited(lambda p: p["p2p"].append([1])), "not 2 numbers"),
    "stage step of 0 s": (edited(lambda p: p["stage_step"]["points"][0].__setitem__(2, 0)), "outside 1e-09"),
    "pp 10^6": (edited(lambda p: p["stage_step"].update(pp=10 ** 6)), "profile.stage_step.pp is 1000000"),
    "tasks true": (edited(lambda p: p["compute"][0].update(tasks=True)), "tasks is true, not an integer"),
    "d_model a string": (edited(lambda p: p["key"]["model"].update(d_model="64")), "d_model is '64', not a number"),
    "all-reduce of one task": (edited(lambda p: p["allreduce"]["node"].update(tasks=1)), "tasks 1"),
    "optimizer missing": (edited(lambda p: p["optimizer"].pop("Layer")), "profile.optimizer has no Layer"),
    "another format": (edited(lambda p: p.update(format="kit-profile/2")), "format 'kit-profile/2'"),
    "a list": ("[1, 2, 3]", "format 'list'"),
    "empty": ("", "is not JSON"),
    "too large": ('{"format": "kit-profile/1", "pad": "' + "x" * 2 ** 21 + '"}',
                  "more than a profile"),
}
PLAN = ["--advise", "--nodes", "1", "--gpus-per-node", "2", "--gpu-mem", "16", "--global-batch", "32"]


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_a_malformed_profile_is_one_line(tmp_path, name):
    """Damaged, cut, hostile files: the same ranges and refusals as the command line (ARGS), one line, exit 2,
    within the memory and time bounds (nlayers 1e9 took 15 GiB in 2 minutes before)."""
    content, says = PROFILES[name]
    path = tmp_path / "p.json"
    if isinstance(content, dict):
        content = json.dumps(content)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = limited([*PLAN, "--profile", str(path)])
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and not out.stdout, out.stderr[-3000:]
    assert lines[0].startswith(f"check_topology: --profile {path}") and says in lines[0], lines[0]


def test_a_profile_that_is_not_a_file_is_one_line_and_never_blocks(tmp_path):
    fifo = tmp_path / "p.fifo"
    os.mkfifo(fifo)  # nobody writes to it: an open() would wait forever
    for path, says in ((fifo, "is a FIFO (named pipe), not a regular file"), (tmp_path, "is a directory"),
                       (tmp_path / "no.json", "cannot read it")):
        out = limited([*PLAN, "--profile", str(path)])
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and says in out.stderr, out.stderr


def test_a_foreign_profile_says_what_differs(tmp_path):
    """Another model (the command line's value), another GPU (the plan's nodes): one line naming it."""
    path = tmp_path / "p.json"
    path.write_text(json.dumps(edited(lambda p: p["key"].update(gpu="NVIDIA A100-SXM4-80GB"))))
    out = run_checker("--advise", "--nodes", "1", "-C", "v100-32g", "--global-batch", "32", "--profile", str(path))
    assert out.returncode == 2 and "taken on NVIDIA A100-SXM4-80GB GPUs and the plan is for 4-GPU V100" in out.stderr
    out = run_checker(*PLAN, "--profile", str(path), "--d-model", "128")  # the verdicts: in this process
    assert out.returncode == 2 and "taken with --d-model 64, the plan has 128" in out.stderr
    good = tmp_path / "good.json"
    good.write_text(json.dumps(good_profile()))
    out = run_checker(*PLAN, "--profile", str(good))
    assert out.returncode == 0 and "fastest first" in out.stdout, out.stderr


# ---- the minor faults: line ends, the launcher's variables ------------------------------------------------------------
def test_cr_only_line_ends_are_an_error(tmp_path):
    """sbatch refuses \\r\\n only (src/sbatch/sbatch.c, contains_dos_linebreak); \\r alone makes one line of it."""
    script = tmp_path / "mac.slurm"
    script.write_bytes(b"#!/bin/bash\r#SBATCH -N 2 --gres=gpu:4\rsrun python t.py\r")
    code, report, _, _ = measured(script)
    assert code == 1 and "cr-line-breaks" in codes(report)
    script.write_bytes(b"#!/bin/bash\n#SBATCH -N 1\necho 'a\rb'\nsrun python t.py\n")  # a \r inside a line: fine
    assert "cr-line-breaks" not in codes(measured(script)[1])


SLURM_TASK = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
              "SLURM_NODEID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1",
              "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_JOB_NODELIST": "n1"}


@pytest.mark.parametrize("variable,value,says", [
    ("CUDA_VISIBLE_DEVICES", "0,0", "names GPU 0 twice"), ("CUDA_VISIBLE_DEVICES", "1,2,01", "names GPU 1 twice"),
    ("SLURM_CPUS_PER_TASK", "0", "SLURM_CPUS_PER_TASK='0' must be >= 1"),
    ("SLURM_CPUS_PER_TASK", "-4", "SLURM_CPUS_PER_TASK='-4' must be >= 1"),
    ("MASTER_PORT", "70000", "MASTER_PORT=70000 is not a TCP port (1..65535)"),
    ("MASTER_PORT", "0", "MASTER_PORT='0' must be >= 1"),
])
def test_check_args_refuses_what_the_trainer_refuses(capsys, variable, value, says):
    """--check-args and the trainer read these with idr_torch's rules (one owner): one line, exit 1."""
    for layout in ("replica", "stage"):
        assert kit.trainer_checks.check_args_main(layout, [], {**SLURM_TASK, variable: value}) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    with pytest.raises(idr_torch.LaunchError, match=re.escape(says)):
        idr_torch.Launch({**SLURM_TASK, variable: value}).master_port


def test_the_checker_in_an_allocation_refuses_them_too():
    env = {**os.environ, **SLURM_TASK, "SLURM_CPUS_PER_TASK": "0"}
    out = limited([], env=env)
    assert out.returncode == 2 and "SLURM_CPUS_PER_TASK='0' must be >= 1" in out.stderr and not out.stdout


def test_a_huge_tasks_per_node_list_is_one_line_in_bounded_memory():
    """11 kB of '1(x999999)' cost 1.5 GB before: python-hostlist expanded every repeat."""
    value = ",".join(["1(x999999)"] * 1000)
    assert len(value) > 10_000
    tracemalloc.start()
    try:
        with pytest.raises(idr_torch.LaunchError, match="describes more than 65536 nodes"):
            idr_torch.Launch({**SLURM_TASK, "SLURM_STEP_TASKS_PER_NODE": value})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 * 2 ** 20, peak
    assert idr_torch.parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]

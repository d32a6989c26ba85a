"""The records' readers (slurm/report.py, slurm/first_run_report.py) on damaged and hostile records, and report.py's
--out: one note per bad line or figure, naming the file and line, the rest of the report made from the good lines;
one line and a non-zero exit where nothing is usable; no traceback; nothing half-written (issue 35)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from checker import run_main
from launch import ROOT, clean_env, mounted_tmpfs

sys.path.insert(0, str(ROOT / "slurm"))
import first_run_report  # noqa: E402
import report as results_report  # noqa: E402

REPORT, FIRST_RUN = ROOT / "slurm" / "report.py", ROOT / "slurm" / "first_run_report.py"
MAINS = {"report.py": results_report.main, "first_run_report.py": first_run_report.main}


def record(tasks: int, nb_part: int, sps: object, /, **changed: object) -> dict:
    """A record as bench_ddp_transformer.py finish() writes it (its first key "time"), the fields the readers use;
    `changed` replaces some."""
    return {"time": "2025-03-02T10:14:05", "torch": "2.13.0", "layout": "replica", "engine": "fairscale",
            "nb_part": nb_part, "pp": None, "schedule": "gpipe", "gpus": tasks * nb_part, "estimated_mem_gb": 2.5,
            "backend": "nccl", "device": "cuda", "nodes": 1, "tasks": tasks, "tasks_per_node": tasks,
            "replicas": tasks, "chunks": 2, "batch_size": 64, "samples_per_s": sps, "epoch_time_s": 10.0,
            "peak_gpu_mem_gb": 2.0, "host_rss_gb": 1.0, "test_acc": 0.9} | changed


def line(r: dict) -> bytes:
    return json.dumps(r).encode() + b"\n"


def run(script: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The reader's command line in this process (tests/checker.py's run_main: the same result as a process, without
    a Python start-up and matplotlib's import each time)."""
    return run_main(script, MAINS[script.name], *args, env=clean_env(), cwd=cwd)


def first_run_folder(tmp_path: Path, runs: bytes) -> Path:
    """A first_run_<job> folder: the three replica runs ran (status 0), their records in runs.jsonl."""
    folder = tmp_path / "first_run_7"
    folder.mkdir()
    (folder / "status.tsv").write_text("".join(f"replica_{n}x{4 // n}\t0\t{n}\n" for n in (1, 2, 4)))
    for n in (1, 2, 4):
        (folder / f"replica_{n}x{4 // n}.log").write_text("summary: ...\n")
    (folder / "runs.jsonl").write_bytes(runs)
    return folder


# A cut line (the trainer's append cut by a full $WORK), junk, and JSON that is not a record, among good records.
DAMAGED = (line(record(1, 4, 101.5)) + b"{ not json at all\n" + b"[1, 2, 3]\n" + line(record(2, 2, 202.5))
           + b"\x00\x00\x00\x00\n" + b'"a string"\n' + line(record(4, 1, 404.5))[:70])


def test_both_readers_read_the_good_records_and_name_the_bad_lines(tmp_path):
    """Serious fault 6: first_run_report.py raised on the cut line (29 lines of traceback, and first_run.slurm sent
    its empty stdout to report.md); report.py skipped it. Both now read the records the same way."""
    folder = first_run_folder(tmp_path, DAMAGED)
    r = run(FIRST_RUN, str(folder))
    assert r.returncode == 0 and "Traceback" not in r.stdout + r.stderr, r.stderr
    text = r.stdout
    assert "| replica_1x4 | 1 | 1 replica(s) x nb_part 4 | 101.5 | 2.00 | 2.50 (0.80 of it) | ok |" in text
    assert "| replica_2x2 | 2 | 2 replica(s) x nb_part 2 | 202.5 |" in text
    assert "| replica_4x1 | 4 | ? | - | - | - | ok |" in text  # its record is the cut one
    runs = folder / "runs.jsonl"
    for n, why in ((2, "not a whole JSON record"), (3, "a list, not a record"), (5, "not a whole JSON record"),
                   (6, "a string, not a record"), (7, "the last line is cut short")):
        assert f"- {runs}:{n}: skipped: {why}" in text, text
    assert f"{runs}:1:" not in text and f"{runs}:4:" not in text
    r = run(REPORT, str(runs), "--out", str(tmp_path / "out"))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    notes = [x for x in r.stderr.splitlines() if x.startswith(str(runs))]
    assert [x.split(":")[1] for x in notes] == ["2", "3", "5", "6", "7"], r.stderr  # the same lines, in order
    md = (tmp_path / "out" / "sweep.md").read_text()
    assert "| 101.5 |" in md and "| 202.5 |" in md and "404.5" not in md
    assert md.split("## Lines not read\n\nEach costs its own record or figure only.\n\n")[1] \
        == "".join(f"- {x}\n" for x in notes) + "\n"  # the report itself names them too


def test_a_record_appended_after_a_cut_one_is_kept(tmp_path):
    """The cut append has no newline: the next run's record follows it on the same line. It costs the cut record
    only."""
    runs = tmp_path / "runs.jsonl"
    runs.write_bytes(line(record(1, 4, 101.5))[:90] + line(record(2, 2, 202.5)))
    r = run(REPORT, str(runs), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert f"{runs}:1: a cut record (its run's append did not finish) then a whole one: the cut one skipped" \
        in r.stderr
    md = (tmp_path / "out" / "sweep.md").read_text()
    assert "| 202.5 |" in md and "101.5" not in md


# each: (what is wrong, the damaged record or line, what the note says)
BAD_RECORDS = [
    ("no device", {k: v for k, v in record(4, 1, 404.5).items() if k != "device"}, "skipped: no 'device'"),
    ("device null", record(4, 1, 404.5, device=None), "skipped: device null is not cuda or cpu"),
    ("tasks a string", record(4, 1, 404.5, tasks="4"), 'skipped: tasks "4" is not a whole number'),
    ("nb_part zero", record(4, 1, 404.5, nb_part=0), "skipped: nb_part 0 is not a whole number from 1"),
    ("chunks huge", record(4, 1, 404.5, chunks=10**9), "skipped: chunks 1000000000 is not what the trainer takes"),
    ("batch a float", record(4, 1, 404.5, batch_size=2.5), "skipped: batch_size 2.5 is not what the trainer takes"),
    ("precision a list", record(4, 1, 404.5, precision=["fp32"]), 'skipped: precision ["fp32"] is not one of'),
    ("zero a string", record(4, 1, 404.5, zero="yes"), 'skipped: zero "yes" is not true or false'),
    ("layout unknown", record(4, 1, 404.5, layout="tensor"), 'skipped: layout "tensor" is not replica or stage'),
    ("not UTF-8", b'{"time": "2025", "device": "cu\xffda"}', "skipped: byte 0xff at column 31 is not UTF-8"),
    ("nested too deeply", b"[" * 100_000, "skipped: not a record (nested too deeply)"),
]


@pytest.mark.parametrize("case,bad,says", BAD_RECORDS, ids=[c[0] for c in BAD_RECORDS])
def test_a_bad_record_costs_that_record_only(tmp_path, case, bad, says):
    runs = tmp_path / "runs.jsonl"
    runs.write_bytes(line(record(2, 2, 202.5)) + (bad if isinstance(bad, bytes) else json.dumps(bad).encode())
                     + b"\n")
    r = run(REPORT, str(runs), "--out", str(tmp_path / "out"))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[0].startswith(f"{runs}:2: {says}"), r.stderr
    md = (tmp_path / "out" / "sweep.md").read_text()
    assert "| 202.5 |" in md and "404.5" not in md
    # alone in its file: nothing usable, one line that says so after the note, exit 1, nothing written
    runs.write_bytes(bad if isinstance(bad, bytes) else json.dumps(bad).encode())
    r = run(REPORT, str(runs), "--out", str(tmp_path / "alone"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == f"report.py: no usable result in {runs} (1 note(s) above)"
    assert not (tmp_path / "alone").exists()


# each: a figure that is not a measurement
BAD_FIGURES = [("samples_per_s", "fast"), ("samples_per_s", 0), ("samples_per_s", -5.0),
               ("samples_per_s", float("nan")), ("samples_per_s", float("inf")), ("samples_per_s", True),
               ("epoch_time_s", 0), ("peak_gpu_mem_gb", -1.0), ("test_acc", 1.5), ("test_acc", float("nan")),
               ("estimated_mem_gb", {"gib": 2})]


@pytest.mark.parametrize("field,value", BAD_FIGURES, ids=[f"{f}={v!r}" for f, v in BAD_FIGURES])
def test_a_figure_that_is_not_a_measurement_is_left_out(tmp_path, field, value):
    """The run stays in the table with that figure missing; a run whose samples/s is not a measurement is never the
    fastest (a NaN run was picked as the fastest)."""
    runs = tmp_path / "runs.jsonl"
    bad = record(4, 1, 999.5, **{field: value})
    runs.write_bytes(line(record(2, 2, 202.5)) + line(bad))
    r = run(REPORT, str(runs), "--out", str(tmp_path / "out"))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"{runs}:2: {field} {json.dumps(value)} is not "), r.stderr
    md = (tmp_path / "out" / "sweep.md").read_text()
    row = next(x for x in md.splitlines() if x.startswith("| 4 | 1 |"))  # the run is still in the table
    fastest = next(x for x in md.splitlines() if x.startswith("Fastest:"))
    if field == "samples_per_s":
        assert "999.5" not in md and "| fp32 | no | no |  |" in row
        assert fastest.startswith("Fastest: 2 task(s) x nb_part 2") and "202.5 samples/s" in fastest
    else:
        assert "| 999.5 |" in row and "999.5 samples/s" in fastest
    folder = first_run_folder(tmp_path, runs.read_bytes())
    r = run(FIRST_RUN, str(folder))
    assert r.returncode == 0 and f"- {folder / 'runs.jsonl'}:2: {field} {json.dumps(value)} is not " in r.stdout


def test_no_measured_speed_anywhere_says_so(tmp_path):
    runs = tmp_path / "runs.jsonl"
    runs.write_bytes(line(record(2, 2, float("nan"))) + line(record(4, 1, None)))
    r = run(REPORT, str(runs), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert "Fastest: none: no run here has a measured samples/s" in (tmp_path / "out" / "sweep.md").read_text()


def test_a_run_that_did_not_learn_is_marked(tmp_path):
    """The fastest run at chance (0.5: two classes) is still the fastest, and says that it did not learn."""
    runs = tmp_path / "runs.jsonl"
    runs.write_bytes(line(record(2, 2, 202.5)) + line(record(4, 1, 404.5, test_acc=0.5)))
    assert run(REPORT, str(runs), "--out", str(tmp_path / "out")).returncode == 0
    md = (tmp_path / "out" / "sweep.md").read_text()
    assert "404.5 samples/s; but its test acc 0.500 is chance (0.5): this run did not learn" in md
    assert "| 0.500 (chance: did not learn) | 1 |" in md and "| 0.900 | 1 |" in md


def test_a_results_file_that_cannot_be_read_is_one_line(tmp_path):
    for path, why in ((tmp_path / "missing.jsonl", "cannot read it (No such file or directory)"),
                      (tmp_path, "it is a directory, not a regular file")):
        r = run(REPORT, str(path), "--out", str(tmp_path / "out"))
        assert r.returncode == 2 and r.stderr == f"report.py: {path}: {why}; give the file the runs' " \
            "--json-out wrote\n"
    assert not (tmp_path / "out").exists()


def test_a_cut_status_line_costs_that_step_only(tmp_path):
    folder = first_run_folder(tmp_path, line(record(1, 4, 101.5)))
    with open(folder / "status.tsv", "ab") as f:
        f.write(b"replica_8x")  # first_run.slurm's done_() cut by a full disk
    r = run(FIRST_RUN, str(folder))
    assert r.returncode == 0 and "3 step(s), 0 failed" in r.stdout, r.stderr
    assert f"- {folder / 'status.tsv'}:4: skipped: not 'step<TAB>exit status<TAB>tasks'" in r.stdout


# ---- --out: checked before any work, written whole or not at all -------------------------------------------------
@contextmanager
def read_only_folder(where: Path):
    """A folder no file can be created in: a read-only tmpfs as root (root ignores permissions), mode 0555 else."""
    if os.geteuid() != 0:
        where.mkdir()
        where.chmod(0o555)
        try:
            yield where
        finally:
            where.chmod(0o755)
        return
    with mounted_tmpfs(where, "ro,size=64k") as folder:
        yield folder


def test_out_is_checked_before_any_work(tmp_path):
    runs = tmp_path / "runs.jsonl"
    runs.write_bytes(line(record(2, 2, 202.5)))
    (tmp_path / "afile").write_text("mine\n")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "sweep.csv").mkdir()
    cases = [("afile", "--out {out} is a file, not a folder: the report is 3 files (sweep.md, sweep.csv, "
                       "throughput.png); give a folder, e.g. --out report"),
             ("afile/new", "--out {out}: {tmp}/afile is a file, not a folder; give a folder, e.g. --out report"),
             ("taken", "--out {out}: {out}/sweep.csv is a folder, where the report writes a file; remove it or "
                       "give another --out")]
    for name, says in cases:
        out = tmp_path / name
        # the results file named does not exist: --out is checked first, before anything is read
        r = run(REPORT, str(tmp_path / "not-read.jsonl"), "--out", str(out))
        assert r.returncode == 2 and r.stderr == f"report.py: {says.format(out=out, tmp=tmp_path)}\n", r.stderr
    assert (tmp_path / "afile").read_text() == "mine\n"
    with read_only_folder(tmp_path / "ro") as ro:
        for out in (ro, ro / "new" / "deeper"):
            r = run(REPORT, str(runs), "--out", str(out))
            assert r.returncode == 2 and r.stderr.startswith(f"report.py: --out {out}: cannot write in {ro} ("), \
                r.stderr
            assert r.stderr.endswith("); give a folder you can write, e.g. --out $WORK/report\n")
        assert list(ro.iterdir()) == []


def test_a_full_disk_replaces_nothing_and_leaves_no_temporary_file(tmp_path):
    """The disk fills while the report is written: the previous report stays whole, one line, exit 1."""
    runs = tmp_path / "runs.jsonl"
    runs.write_bytes(line(record(2, 2, 202.5)))
    with mounted_tmpfs(tmp_path / "disk", "size=256k") as disk:
        out = disk / "report"
        assert run(REPORT, str(runs), "--out", str(out), "--title", "before").returncode == 0
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        with open(disk / "filler", "wb", buffering=0) as f:  # fill it: ENOSPC on the report's next write
            try:
                while f.write(b"\0" * 4096):
                    pass
            except OSError:
                pass
        runs.write_bytes(line(record(2, 2, 202.5)) + line(record(4, 1, 404.5)))
        r = run(REPORT, str(runs), "--out", str(out), "--title", "after")
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr == f"report.py: the report could not be written in {out} (No space left on device); " \
            "nothing in it was replaced\n"
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # whole, and no .tmp left


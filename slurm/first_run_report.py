#!/usr/bin/env python
"""The report of slurm/first_run.slurm: one table from the runs of one job, and the first error of each failed run
with its probable cause.

    python slurm/first_run_report.py first_run_<job> > first_run_<job>/report.md

Reads FOLDER/steps.txt (the steps the job was to run, written before the first), FOLDER/status.tsv (step, exit
status, tasks: one line per step that ended), FOLDER/runs.jsonl (the trainers' records, read as report.py reads them:
a line that is not a whole record costs that line only, and the report names it), FOLDER/gpu_check.jsonl and
FOLDER/<step>.log, each bounded (kit.bounded.read_regular: a regular file only, never a FIFO or a device; a long log
read at both ends). Exit status 1 when a run failed or did not run (a job killed half-way: its time limit, a node
failure, scancel), or when no step ran (a GPU benchmark that found no GPU is 'not run', not failed). No torch import:
it runs anywhere, on the job's folder copied to a laptop too.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RecordsError, capped, read_records, value_problem  # noqa: E402  (one reader of the records)
import kit.bounded  # noqa: E402  (report.py puts the kit on the path: one bounded reader of every file)

MAX_LOG, MAX_LIST = 8 * 2 ** 20, 2 ** 20  # a log is read at both ends past 8 MiB; status.tsv, steps.txt are lines
MAX_STEPS = 200

# The first line that matches a pattern is the run's error; the cause is what it most likely means. Ordered: a
# task that lost contact is usually not the cause, so the patterns of the cause come first.
CAUSES = [
    (r"Duplicate GPU detected", "two tasks of one node on one GPU in one nccl communicator (nccl's init.cc refuses "
     "it): a collective whose GPU was not named; the kit's tests say its own cannot: please report it"),
    (r"CUDA out of memory|OutOfMemoryError", "the model does not fit in this layout's GPUs: more GPUs per replica "
     "(fewer tasks per node), --activation-checkpointing, --precision bf16 (fp16 on V100) or a smaller --batch-size; "
     "python check_topology.py <the same options> says by how much"),
    (r"has no bf16|bf16.*not supported", "this GPU has no bf16 (V100): use --precision fp16"),
    (r"Watchdog caught collective operation timeout|made no progress for", "a task hung or died and the others "
     "waited --timeout: each task's last collectives are in nccl_trace_<job>/ (torchfrtrace), its Python stacks in "
     "this log"),
    (r"no CUDA GPU here|Found no NVIDIA driver|CUDA driver version is insufficient|no CUDA-capable device",
     "no usable GPU: not a GPU node, no --gres, or a torch without CUDA (module load pytorch-gpu/...)"),
    (r"EADDRINUSE|[Aa]ddress already in use", "the rendezvous port is taken (another step of the node uses it): "
     "export MASTER_PORT=<a free port>"),
    (r"ncclSystemError|ncclRemoteError|remote process exited|NET/IB|unhandled system error|NCCL WARN",
     "nccl could not reach a peer: a task died (its own error is the cause) or the network failed; rerun with "
     "NCCL_DEBUG=INFO"),
    (r"No module named|is missing", "a package is missing next to the module's torch (the line says which)"),
    (r"^\s*ERROR\s+\S+:", "the pre-flight check refused this layout: the line says why and what to change"),
    (r"lost contact with the others", "another task died first: its own error, in the same log, is the cause"),
    (r"error:|Error|Traceback", "see the log"),
]


def first_error(log: str) -> tuple[str, str] | None:
    """(the first line of the most telling error, its probable cause), or None for a clean log."""
    lines = log.splitlines()
    for pattern, cause in CAUSES:
        for line in lines:
            if re.search(pattern, line):
                return kit.bounded.printable(line.strip(), 240), cause  # no terminal escape in report.md
    return None


def read_status(folder: Path, notes: list[str] | None = None) -> list[tuple[str, int, int]]:
    """The job's steps as first_run.slurm's done_() appends them; a line that is not one (cut by a full disk) is
    skipped, with a note in `notes`."""
    rows, path = [], folder / "status.tsv"
    data, _ = kit.bounded.read_regular(path, MAX_LIST, what="a first run's status (a line per step)")
    for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        fields = line.split("\t")
        try:  # ASCII digits, bounded (kit.bounded.whole_number): '٣' or 5,000 digits are no exit status
            name, code, tasks = fields[0], kit.bounded.whole_number(fields[1]), kit.bounded.whole_number(fields[2])
            if len(fields) != 3 or not re.fullmatch(r"[\w.-]+", name, re.A) or code is None or code > 255 or not tasks:
                raise ValueError
        except (ValueError, IndexError):
            if line.strip() and notes is not None:
                notes.append(f"{path}:{n}: skipped: not 'step<TAB>exit status<TAB>tasks' "
                             f"({kit.bounded.printable(line, 60)!r})")
            continue
        rows.append((name, code, tasks))
    return rows


def text_of(path: Path, notes: list[str], limit: int = MAX_LOG) -> str:
    """A file of the folder as text, read bounded (kit.bounded.read_regular: a regular file only, never a FIFO or a
    device; past `limit`, its two ends); '' where it is missing, and a note where it is not a file to read."""
    if not os.path.lexists(path):
        return ""
    try:
        data, _ = kit.bounded.read_regular(path, limit, ends=True)
    except kit.bounded.FileProblem as exc:
        notes.append(f"{path}: not read: {exc}")
        return ""
    return data.decode("utf-8", "replace")


def read_plan(folder: Path, notes: list[str]) -> list[str] | None:
    """The steps first_run.slurm was to run (steps.txt, written before the first step), or None for a folder
    without it (an older first_run.slurm): then which steps were to run is not known."""
    if not os.path.lexists(folder / "steps.txt"):
        return None
    steps = [line.strip() for line in text_of(folder / "steps.txt", notes, MAX_LIST).splitlines() if line.strip()]
    steps = [x for x in steps if re.fullmatch(r"[\w.-]+", x, re.A)]
    if len(steps) > MAX_STEPS:  # first_run.slurm plans 11 on a 4-GPU node, 15 on 8 GPUs
        notes.append(f"{folder / 'steps.txt'}: not read: {len(steps):,} steps, not a first run's plan")
        return None
    return steps or None


def records(path: Path, notes: list[str]) -> list[dict]:
    """The trainers' records (report.read_records); what it skips or leaves out goes to `notes`."""
    if not os.path.lexists(path):
        return []
    try:
        found, problems = read_records(path)
    except RecordsError as exc:
        notes.append(str(exc))
        return []
    notes += problems
    return [r for _, r in found]


def record_of(name: str, runs: list[dict]) -> dict | None:
    """The trainer's record of a step named replica_<tasks>x<nb_part> or stage."""
    for r in runs:
        if name == "stage" and r.get("layout") == "stage":
            return r
        if name == f"replica_{r.get('tasks_per_node')}x{r.get('nb_part')}" and r.get("layout") == "replica":
            return r
    return None


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def layout_of(rec: dict | None) -> str:
    """'2 replica(s) x nb_part 2' or 'pp 2 x 2 pipeline(s)' from a record, '?' where its counts are not counts."""
    stage = (rec or {}).get("layout") == "stage"
    if rec is None or any(value_problem(rec, k) for k in ("replicas", "pp" if stage else "nb_part")):
        return "?"
    return f"pp {rec['pp']} x {rec['replicas']} pipeline(s)" if stage else \
        f"{rec['replicas']} replica(s) x nb_part {rec['nb_part']}"


def run_rows(folder: Path, status: list[tuple[str, int, int]], notes: list[str]) -> tuple[list[str], int]:
    runs, failed, lines = records(folder / "runs.jsonl", notes), 0, []
    for name, code, tasks in status:
        if name in ("gpu_check", "memory_gpu", "profile"):
            continue
        log = text_of(folder / f"{name}.log", notes)
        rec = record_of(name, runs) if not name.startswith("check_") else None
        if code == 0:
            if name.startswith("check_"):
                lines.append(f"| {name} | {tasks} | pre-flight check | - | - | - | ok |")
                continue
            peak, est = (rec or {}).get("peak_gpu_mem_gb"), (rec or {}).get("estimated_mem_gb")
            speed = (rec or {}).get("samples_per_s")
            ratio = f" ({peak / est:.2f} of it)" if peak and est else ""
            lines.append(f"| {name} | {tasks} | {layout_of(rec)} | {'-' if speed is None else f'{speed:.1f}'} | "
                         f"{gib(peak)} | {gib(est)}{ratio} | ok |")
            continue
        failed += 1
        error = first_error(log)
        said = f"exit {code}: `{error[0]}`; probable cause: {error[1]}" if error else f"exit {code}, no error line"
        lines.append(f"| {name} | {tasks} | - | - | - | - | failed: {said} |")
    return lines, failed


def benchmark_lines(folder: Path, status: list[tuple[str, int, int]], notes: list[str]) -> tuple[list[str], int]:
    out, failed = [], 0
    codes = {name: code for name, code, _ in status}
    for name in ("gpu_check", "memory_gpu"):
        if name not in codes:
            continue
        log = text_of(folder / f"{name}.log", notes)
        code = codes[name]
        if code == 2 and re.search(r"no CUDA GPU here", log):
            out.append(f"- `{name}`: not run: no CUDA GPU in this job "
                       f"(`{kit.bounded.printable(log.strip().splitlines()[-1], 200)}`)")
            continue
        table = [line for line in log.splitlines() if line.startswith("|") or line.startswith("worst")]
        if name == "gpu_check" and code == 1 and table:  # it ran; a row below the goal or failed says so itself
            out.append(f"- `{name}` ran; its rows:")
        elif code != 0:
            failed += 1
            error = first_error(log)
            out.append(f"- `{name}` failed (exit {code})" + (f": `{error[0]}`; probable cause: {error[1]}"
                                                             if error else ""))
        else:
            out.append(f"- `{name}`:")
        out += ["", *table, ""] if table else []
    return out, failed


def profile_lines(folder: Path, status: list[tuple[str, int, int]], notes: list[str]) -> tuple[list[str], int]:
    """The speed profile's step, and the splits its predictions put first (advise.txt)."""
    codes = {name: code for name, code, _ in status}
    if "profile" not in codes:
        return [], 0
    if codes["profile"] != 0:
        log = text_of(folder / "profile.log", notes)
        error = first_error(log)
        return [f"- `profile` failed (exit {codes['profile']})" + (f": `{error[0]}`; probable cause: {error[1]}"
                                                                   if error else "")], 1
    advice = [kit.bounded.printable(line, 200) for line in text_of(folder / "advise.txt", notes, MAX_LIST).splitlines()]
    return [f"- `profile`: {folder.name}/profile.json; the splits it predicts fastest "
            "(`check_topology.py --advise --profile`, measure them with the sweep's MODE=predict):", "", "```",
            *advice[:12], "```", ""], 0


def report(folder: Path) -> tuple[str, int]:
    """The report's text and the count of steps that failed or did not run (or 1 where no step ran at all)."""
    notes: list[str] = []
    status, planned = read_status(folder, notes), read_plan(folder, notes)
    rows, failed = run_rows(folder, status, notes)
    bench, bench_failed = benchmark_lines(folder, status, notes)
    speed, speed_failed = profile_lines(folder, status, notes)
    bench, bench_failed = speed + bench, bench_failed + speed_failed
    ran = {name for name, _, _ in status}
    missing = [x for x in planned or [] if x not in ran]
    rows += [f"| {name} | - | - | - | - | - | did not run: the job ended before this step (its time limit, a node "
             "failure, scancel: `sacct -j <job>` says which) |" for name in missing]
    text = [f"# First run: {folder.name}", "",
            "| run | tasks | layout | samples/s | peak GPU GiB | estimate GiB | |",
            "| --- | ---: | --- | ---: | ---: | ---: | --- |", *rows, "", *bench]
    failed += bench_failed
    text += ["", summary(len(status), failed, missing, planned)]
    if notes:  # in the report itself (report.md), where the user reads the job's outcome
        text += ["", "Lines not read (each costs its own record or figure only):", *(f"- {n}" for n in capped(notes))]
    return "\n".join(text) + "\n", failed + len(missing) + (not status)


def summary(done: int, failed: int, missing: list[str], planned: list[str] | None) -> str:
    """The report's last line: never 'every run ran' for a job that ended half-way or ran nothing (issue 42)."""
    if planned is None:
        return (f"{done} step(s), {failed} failed" + ("" if failed or not done else ": every step listed in status.tsv "
                "ran") + ("" if done else ": no step ran (status.tsv is empty)") + "; this folder has no steps.txt (an"
                " older first_run.slurm): whether the job ran every step is not known")
    if not done:
        return f"0 step(s) of the {len(planned)} planned ran: the job ended before its first step ended"
    if missing:
        return (f"{done} step(s) of the {len(planned)} planned ran, {failed} failed, {len(missing)} did not run "
                f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}): the job ended before them")
    return f"{done} step(s), {failed} failed" + ("" if failed else ": every run ran")


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not os.path.lexists(Path(argv[0]) / "status.tsv"):
        print("usage: first_run_report.py FOLDER (the first_run_<job> folder holding status.tsv)", file=sys.stderr)
        return 2
    try:
        text, failed = report(Path(argv[0]))
    except kit.bounded.FileProblem as exc:  # status.tsv itself: a FIFO, a device, a folder, too large
        print(f"first_run_report.py: cannot read {Path(argv[0]) / 'status.tsv'}: {exc}; give the first_run_<job> "
              "folder first_run.slurm wrote", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

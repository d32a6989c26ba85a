#!/usr/bin/env python
"""The benchmark's results as the page shows them: a table and a throughput-against-chunks figure.

    python slurm/report.py sweep_results.jsonl                 # writes report/sweep.md, .csv, throughput.png
    python slurm/report.py results.jsonl --out report --title "4 x V100"
    python slurm/report.py sweep_results.jsonl --profile profile.json     # predicted against measured too

Reads the JSON lines bench_ddp_transformer.py --json-out appends (one per run), with read_records(), which
slurm/first_run_report.py uses too: a line that is not a whole record (cut by a full disk, damaged) costs that line
only, a figure that is not a measurement (NaN, "fast", 0) that figure only, each with a note naming the file and
line. --out is checked before anything is read, and the report's files are replaced whole. Runs of the same
configuration (split, batch, chunks, --precision, --activation-checkpointing, --zero) are merged (median
samples/s); memory stands beside throughput: measured peak and the start-up estimate. matplotlib is optional:
without it the tables are still written and the report says why there is no plot. With --profile (written by
benchmarks/speed_profile.py in the same allocation) each configuration also gets the samples/s check_topology's
speed model predicts for it, and the table marks where the predicted order was wrong.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import secrets
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kit.arguments  # noqa: E402  (torch-free: the speed model)
import kit.bounded  # noqa: E402  (one bounded reader of every file a user names)
import kit.speed  # noqa: E402  (torch-free: the speed model)

KEY = ("device", "gpus", "tasks", "nb_part", "batch_per_gpu", "batch_size", "chunks", "layout", "precision",
       "activation_checkpointing", "zero")
# the trainer's options as they read in a table; records written before the options existed ran without them
OPTION_DEFAULTS = {"precision": "fp32", "activation_checkpointing": False, "zero": False}


def options(r: dict) -> str:
    """The options a run used beyond the page's fp32 GPipe, in the trainer's own words ('' for none)."""
    used = [r["precision"]] if r["precision"] != "fp32" else []
    used += ["ckpt"] * bool(r["activation_checkpointing"]) + ["zero"] * bool(r["zero"])
    return " ".join(used)


def kind(tasks: int, nb_part: int, layout: str = "replica") -> str:
    """The page's three regimes, and the stage layout."""
    if layout == "stage":
        return f"stage: pp {nb_part} x dp {tasks // nb_part}"
    if tasks == 1:
        return "pure model parallel"
    if nb_part == 1:
        return "pure data parallel"
    return "hybrid"


# ---- reading the records: one reader for report.py and first_run_report.py -------------------------------------------
# How the trainers write them (bench_ddp_transformer.py finish(), which bench_stage.py shares): rank 0 appends
# json.dumps(record) + "\n" per run, the record's first key "time". json.dumps writes NaN and Infinity as bare words,
# which json.loads reads back. A full disk or quota can cut an append short; the next run's append then follows the
# cut text on the same line. One bad line costs that line only, one bad figure that figure only.
RECORD_START = '{"time": '
# a measured figure: a finite number in its range, or null where the run measured nothing (no timed step:
# --max-steps under the warm-up)
POSITIVE, AT_LEAST_0, FRACTION = ("a positive number", lambda v: v > 0), ("a number >= 0", lambda v: v >= 0), \
    ("a number from 0 to 1", lambda v: 0 <= v <= 1)
FIGURES = {"samples_per_s": POSITIVE, "epoch_time_s": POSITIVE, "peak_gpu_mem_gb": AT_LEAST_0,
           "host_rss_gb": AT_LEAST_0, "estimated_mem_gb": AT_LEAST_0, "test_acc": FRACTION}
COUNT_MAX = 1_000_000  # tasks, GPUs, replicas, parts, nodes: far above any allocation, far below a hostile value
# batch_size, chunks, pp, the model: the trainer's own ranges (not nb_part: a stage layout record holds its pp there)
TRAINER_ARGS = {a.dest: a for a in kit.arguments.ARGS if a.dest != "nb_part"}


# A results file is read whole into records: bounded, so that a hostile or runaway file (a million records cost 7
# times their size before) is one line. A record is 0.5 to 2 kB; a line above MAX_LINE is no record.
MAX_RESULTS_BYTES, MAX_LINE = 64 * 2 ** 20, 2 ** 20
# and at most MAX_LINES lines (a run appends one: 60 MB of empty lines took 162 s), the first MAX_NOTES notes shown
MAX_LINES, MAX_NOTES = 100_000, 100


def capped(notes: list[str]) -> list[str]:
    """The first MAX_NOTES notes and how many more there are: 100,000 damaged lines are not 100,000 lines of report."""
    more = len(notes) - MAX_NOTES
    return notes[:MAX_NOTES] + ([f"... and {more:,} more line(s) not read or left out"] if more > 0 else [])


def interned(pairs: list) -> dict:
    """A record's object with its keys shared by every record (json makes new key strings for each line)."""
    return {sys.intern(k): v for k, v in pairs}


class RecordsError(Exception):
    """A results file that cannot be read at all (missing, a folder, no permission)."""


def shown(value: object) -> str:
    """A record's value as the file has it, cut to a readable length."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def read_records(path: Path) -> tuple[list[tuple[str, dict]], list[str]]:
    """The records of a JSONL file the trainers append to, each with where it is ("path:line"), and a note for each
    line that is not a record (cut short, junk, not UTF-8, a JSON value that is not an object, longer than MAX_LINE)
    or figure that is not a measurement (FIGURES: left out, as if not measured). The file is read line by line,
    bounded (kit.bounded.open_regular: a regular file of at most MAX_RESULTS_BYTES; a FIFO or a device is never
    read). Raises RecordsError where the file cannot be read."""
    try:
        f, _ = kit.bounded.open_regular(path, MAX_RESULTS_BYTES, what=f"a sweep's records ({MAX_RESULTS_BYTES >> 20} "
                                        "MiB is tens of thousands of runs; split the file, e.g. tail -n 10000)")
    except kit.bounded.FileProblem as exc:
        raise RecordsError(f"{path}: {exc}; give the file the runs' --json-out wrote") from None
    records, notes, size = [], [], 0
    with f:
        for n, raw in enumerate(iter(lambda: f.readline(MAX_LINE + 1), b""), 1):
            size += len(raw)
            if size > MAX_RESULTS_BYTES or n > MAX_LINES:
                raise RecordsError(f"{path}: more than {MAX_RESULTS_BYTES >> 20} MiB or {MAX_LINES:,} lines (a run "
                                   "appends one): not a sweep's records; split the file, e.g. tail -n 10000")
            where, unfinished = f"{path}:{n}", not raw.endswith(b"\n")  # no "\n" after it: its append was cut
            if len(raw) > MAX_LINE:
                while raw and not raw.endswith(b"\n"):  # the rest of the line, read and dropped
                    raw = f.readline(MAX_LINE + 1)
                    size += len(raw)
                notes.append(f"{where}: skipped: a line of more than {MAX_LINE >> 10} KiB, not a record")
                continue
            if not raw.strip():
                continue
            record, why = parse_record(raw.rstrip(b"\n"), unfinished)
            if why:
                notes.append(f"{where}: {why}")
            if record is not None:
                notes += checked_figures(where, record)
                records.append((where, record))
    return records, notes


def parse_record(raw: bytes, unfinished: bool) -> tuple[dict | None, str | None]:
    """(the record, None), (None, why not), or (the whole record after a cut one, what was skipped)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"skipped: byte 0x{raw[exc.start]:02x} at column {exc.start + 1} is not UTF-8 (a damaged file?)"
    try:
        value = json.loads(text, object_pairs_hook=interned)
    except RecursionError:
        return None, "skipped: not a record (nested too deeply)"
    except ValueError as exc:
        glued = whole_record_after(text)
        if glued is not None:
            return glued, "a cut record (its run's append did not finish) then a whole one: the cut one skipped"
        return None, ("skipped: the last line is cut short (its run's append did not finish: a full disk or quota?)"
                      if unfinished else f"skipped: not a whole JSON record, cut short or damaged "
                      f"({getattr(exc, 'msg', exc)} at column {getattr(exc, 'colno', '?')})")
    if not isinstance(value, dict):
        kind = {list: "a list", str: "a string", bool: "true/false", type(None): "null"}.get(type(value), "a number")
        return None, f"skipped: {kind}, not a record (a JSON object)"
    return value, None


def whole_record_after(text: str) -> dict | None:
    """The whole record that follows a cut one on the same line (the next run appended after the cut text)."""
    start = text.rfind(RECORD_START)
    if start <= 0:
        return None
    try:
        value, end = json.JSONDecoder(object_pairs_hook=interned).raw_decode(text, start)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) and not text[end:].strip() else None


def checked_figures(where: str, record: dict) -> list[str]:
    """Each measured figure that is not one (a string, zero, negative, NaN, inf) is left out, as if not measured: it
    is never shown, merged or picked as the fastest. A note for each."""
    notes = []
    for field, (what, in_range) in FIGURES.items():
        v = record.get(field)
        if v is None:
            continue
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not (number and in_range(v)):
            record[field] = None
            notes.append(f"{where}: {field} {shown(v)} is not {what}: left out, as if not measured")
    return notes


def value_problem(record: dict, field: str) -> str | None:
    """Why record[field] is not a value the trainers write, or None: for the trainer's own arguments (batch_size,
    chunks, the model) what its command line takes (kit.arguments.ARGS), for counts of tasks, GPUs, replicas,
    parts and nodes a whole number from 1 to COUNT_MAX."""
    if field not in record:
        return f"no {field!r}"
    v, arg = record[field], TRAINER_ARGS.get(field)
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    if arg is not None and arg.kind in (int, float):
        if number and arg.convert(str(v))[1] is None:
            return None
        return f"{field} {shown(v)} is not what the trainer takes ({arg.range_text()})"
    if number and isinstance(v, int) and 1 <= v <= COUNT_MAX:
        return None
    return f"{field} {shown(v)} is not a whole number from 1 to {COUNT_MAX:,}"


def load(paths: list[Path]) -> tuple[list[dict], list[str]]:
    """The records of the table (read_records), with a note for each that cannot be placed in it (a count that is
    not one, no device, an unknown layout or option). Raises RecordsError where a file cannot be read."""
    records, problems = [], []
    for path in paths:
        found, notes = read_records(path)
        for where, r in found:
            for k, default in (("layout", "replica"), *OPTION_DEFAULTS.items()):
                r[k] = r.get(k, default)
            why = table_problem(r)
            if why:
                notes.append(f"{where}: skipped: {why}")
                continue
            # replica layout: a task per replica over nb_part GPUs; stage layout: a task per GPU
            r["gpus"] = r.get("gpus") or r["tasks"] * r["nb_part"]
            r["batch_per_gpu"] = r["batch_size"] // r["nb_part"]
            records.append(r)
        problems += capped(sorted(notes, key=lambda note: int(note[len(str(path)) + 1:].split(":", 1)[0])))
    return records, problems


def table_problem(r: dict) -> str | None:
    """Why a record has no place in the table (its key fields: KEY), or None."""
    for field in ("tasks", "nb_part", "batch_size", "chunks") + (("gpus",) if r.get("gpus") is not None else ()):
        if why := value_problem(r, field):
            return why
    for field in MODEL_FIELDS:  # the model's shape, where the record has it: NaN or 1e9 is a damaged record
        if r.get(field) is not None and (why := value_problem(r, field)):
            return why
    if r.get("device") not in ("cuda", "cpu"):
        return ("no 'device' (cuda or cpu): a GPU's figures and a CPU's cannot be told apart" if "device" not in r
                else f"device {shown(r['device'])} is not cuda or cpu")
    if r["layout"] not in ("replica", "stage"):
        return f"layout {shown(r['layout'])} is not replica or stage"
    if r["precision"] not in kit.arguments.PRECISIONS:
        return f"precision {shown(r['precision'])} is not one of {', '.join(kit.arguments.PRECISIONS)}"
    for field in ("activation_checkpointing", "zero"):
        if not isinstance(r[field], bool):
            return f"{field} {shown(r[field])} is not true or false"
    return None


def merge(records: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[tuple(r[k] for k in KEY)].append(r)
    rows = []
    for key, runs in groups.items():
        def med(field: str) -> float | None:
            vals = [r[field] for r in runs if r.get(field) is not None]
            return statistics.median(vals) if vals else None
        row = dict(zip(KEY, key))
        row.update(runs=len(runs), kind=kind(row["tasks"], row["nb_part"], row["layout"]), samples_per_s=med("samples_per_s"),
                   epoch_time_s=med("epoch_time_s"), peak_gpu_mem_gb=med("peak_gpu_mem_gb"),
                   host_rss_gb=med("host_rss_gb"), estimated_mem_gb=med("estimated_mem_gb"),
                   test_acc=med("test_acc"), engine=runs[-1].get("engine"), torch=runs[-1].get("torch"),
                   record=runs[-1])
        rows.append(row)
    rows.sort(key=lambda r: (r["device"], r["gpus"], r["layout"], r["tasks"], r["batch_per_gpu"], r["chunks"],
                             r["precision"], r["activation_checkpointing"], r["zero"]))
    return rows


MODEL_FIELDS = ("nlayers", "d_model", "n_head", "d_hid", "dropout", "seq_len", "vocab_size")


def predict(row: dict, profile: dict) -> float | str:
    """check_topology's predicted samples/s for a merged row, from the configuration its run recorded; or why not."""
    rec, stage = row["record"], row["layout"] == "stage"
    needed = [*MODEL_FIELDS, "replicas", "tasks_per_node", *(["pp"] if stage else []),
              *(["nodes"] if rec.get("nodes") is not None else [])]
    if why := next(filter(None, (value_problem(rec, k) for k in needed)), None):
        return f"not predicted ({why})"  # a hostile value (nlayers 1e9, pp 1e9) never reaches the simulation
    try:
        t = kit.arguments.Training(layout=row["layout"], pp=int(rec.get("pp") or 2), schedule=rec.get("schedule") or "1f1b",
                        precision=row["precision"], activation_checkpointing=bool(row["activation_checkpointing"]),
                        zero=bool(row["zero"]))
        model = {k: rec[k] for k in MODEL_FIELDS} | {"batch_size": row["batch_size"], "chunks": row["chunks"]}
        guess = kit.speed.predict_speed(profile, model, t, t.pp if stage else row["nb_part"], int(rec["replicas"]),
                                 int(rec["tasks_per_node"]), int(rec.get("nodes") or 1))
    except (KeyError, TypeError, ValueError) as exc:  # ProfileError is a ValueError
        return f"not predicted ({type(exc).__name__}: {exc})"
    speed = guess["samples_per_s"]
    ok = isinstance(speed, (int, float)) and math.isfinite(speed) and speed > 0
    return float(speed) if ok else f"not predicted (samples/s {speed})"


def ranked(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: -values[i])
    out = [0] * len(values)
    for place, i in enumerate(order, 1):
        out[i] = place
    return out


def predicted_markdown(rows: list[dict], profile: dict) -> str:
    """Predicted against measured, fastest measured first; a mark where the predicted order put a row elsewhere."""
    done = [(r, predict(r, profile)) for r in rows if r["samples_per_s"]]
    ok = [(r, p) for r, p in done if isinstance(p, float)]
    out = ["## Predicted against measured", "",
           f"Profile: {profile['key']['gpu']}, torch {profile['key']['torch']}, taken {profile.get('taken', '?')}. "
           "Ranks are over the configurations measured here; a mark means the model ranked it elsewhere.", "",
           "| configuration | predicted samples/s | measured (median) | runs | error | predicted rank "
           "| measured rank |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    pred_rank, meas_rank = ranked([p for _, p in ok]), ranked([r["samples_per_s"] for r, _ in ok])
    order = sorted(range(len(ok)), key=lambda i: meas_rank[i])
    for i in order:
        r, p = ok[i]
        name = (f"{r['kind']}, {r['tasks']} task(s) x nb_part {r['nb_part']}, batch {r['batch_size']}/replica, "
                f"chunks {r['chunks']}" + (f", {options(r)}" if options(r) else ""))
        mark = "" if pred_rank[i] == meas_rank[i] else " **wrong**"
        out.append(f"| {name} | {p:.1f} | {r['samples_per_s']:.1f} | {r['runs']} | "
                   f"{(p - r['samples_per_s']) / r['samples_per_s']:+.0%} | {pred_rank[i]}{mark} | {meas_rank[i]} |")
    out += [f"- {r['kind']}, nb_part {r['nb_part']}, chunks {r['chunks']}: {p}" for r, p in done
            if not isinstance(p, float)]
    if ok:
        best = max(ok, key=lambda rp: rp[1])[0]
        top = max(r["samples_per_s"] for r, _ in ok)
        out += ["", f"The predicted fastest measured {best['samples_per_s']:.1f} samples/s, "
                f"{1 - best['samples_per_s'] / top:.1%} below the fastest measured ({top:.1f})."]
    return "\n".join(out) + "\n"


def fmt(v: object, spec: str = "") -> str:
    return "" if v is None else format(v, spec)


# The labels are two classes (IMDB and the synthetic corpus are balanced): chance is 0.5, and the kit's defaults end
# above 0.9 (tests/test_train.py). A run under AT_CHANCE did not learn (the collapse to one class of docs/gpu.md).
CHANCE, AT_CHANCE = 0.5, 0.55


def accuracy(acc: float | None) -> str:
    return "" if acc is None else f"{acc:.3f}" + (" (chance: did not learn)" if acc < AT_CHANCE else "")


def fastest(group: list[dict]) -> str:
    """The fastest run of a group, among those with a measured samples/s; marked when it did not learn."""
    timed = [r for r in group if r["samples_per_s"]]
    if not timed:
        return "Fastest: none: no run here has a measured samples/s"
    best = max(timed, key=lambda r: r["samples_per_s"])
    acc = best["test_acc"]
    return (f"Fastest: {best['tasks']} task(s) x nb_part {best['nb_part']} ({best['kind']}), batch "
            f"{best['batch_per_gpu']}/GPU, chunks {best['chunks']}" + (f", {options(best)}" if options(best) else "")
            + f": {best['samples_per_s']:.1f} samples/s"
            + (f"; but its test acc {acc:.3f} is chance ({CHANCE}): this run did not learn"
               if acc is not None and acc < AT_CHANCE else ""))


def markdown(rows: list[dict], title: str) -> str:
    out = [f"# {title}", ""]
    for (device, gpus), group in _groups(rows):
        cuda = device == "cuda"
        unit = "GPUs" if cuda else "parts (CPU processes, gloo: not a GPU result)"
        # memory beside throughput: measured (the GPU's peak; on the CPU the process's RSS) and estimated
        measured, mem = ("peak_gpu_mem_gb", "peak GPU mem") if cuda else ("host_rss_gb", "host RSS")
        out += [f"## {gpus} {unit}", "", fastest(group), "",
                "| ntasks | nb_part | layout | batch/GPU | batch/replica | chunks | precision | act. ckpt | zero "
                f"| samples/s | {mem} (GiB) | estimate (GiB/GPU) | s/epoch | test acc | runs |",
                "| ---: | ---: | --- | ---: | ---: | ---: | --- | --- | --- " + "| ---: " * 6 + "|"]
        for r in group:
            out.append(f"| {r['tasks']} | {r['nb_part']} | {r['kind']} "
                       f"| {r['batch_per_gpu']} | {r['batch_size']} | {r['chunks']} | {r['precision']} | "
                       f"{'yes' if r['activation_checkpointing'] else 'no'} | {'yes' if r['zero'] else 'no'} | "
                       f"{fmt(r['samples_per_s'], '.1f')} | {fmt(r[measured], '.2f')} | "
                       f"{fmt(r['estimated_mem_gb'], '.2f')} | {fmt(r['epoch_time_s'], '.1f')} | "
                       f"{accuracy(r['test_acc'])} | {r['runs']} |")
        out.append("")
    return "\n".join(out)


def _groups(rows: list[dict]):
    keys = sorted({(r["device"], r["gpus"]) for r in rows})
    return [(k, [r for r in rows if (r["device"], r["gpus"]) == k]) for k in keys]


def write_csv(rows: list[dict], path: Path) -> None:
    fields = ["device", "gpus", "tasks", "nb_part", "kind", "layout", "batch_per_gpu", "batch_size", "chunks",
              "precision", "activation_checkpointing", "zero", "samples_per_s", "peak_gpu_mem_gb", "host_rss_gb",
              "estimated_mem_gb", "epoch_time_s", "test_acc", "runs", "engine", "torch"]
    # engine and torch are copied as the record has them: a JSON escape can hold a lone surrogate, not UTF-8
    with open(path, "w", newline="", encoding="utf-8", errors="backslashreplace") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def plot(rows: list[dict], path: Path, title: str) -> str | None:
    """Throughput against chunks, a line per batch size per GPU and options, a panel per ntasks (and GPU count).
    Returns why there is no plot, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); the tables are complete without it"
    groups = _groups(rows)
    ncols = max(len({(r["layout"], r["tasks"], r["nb_part"]) for r in g}) for _, g in groups)
    fig, axes = plt.subplots(len(groups), ncols, figsize=(3.6 * ncols, 3.2 * len(groups)), squeeze=False,
                             sharey="row")
    for gi, ((device, gpus), group) in enumerate(groups):
        panels = sorted({(r["layout"], r["tasks"], r["nb_part"]) for r in group})
        for pi in range(ncols):
            ax = axes[gi][pi]
            if pi >= len(panels):
                ax.axis("off")
                continue
            layout, tasks, nb_part = panels[pi]
            sub = [r for r in group if (r["layout"], r["tasks"], r["nb_part"]) == (layout, tasks, nb_part)]
            for bpg, opts in sorted({(r["batch_per_gpu"], options(r)) for r in sub}):
                pts = sorted((r["chunks"], r["samples_per_s"]) for r in sub
                             if (r["batch_per_gpu"], options(r)) == (bpg, opts) and r["samples_per_s"])
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            label=f"{bpg}/{'GPU' if device == 'cuda' else 'part'} {opts}".strip())
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r["chunks"] for r in sub}))
            ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_title(f"{sub[0]['kind']}" if layout == "stage" else
                         f"{tasks} task(s) x nb_part {nb_part}\n{sub[0]['kind']}", fontsize=9)
            ax.set_xlabel("chunks")
            if pi == 0:
                ax.set_ylabel(f"{gpus} {'GPUs' if device == 'cuda' else 'CPU parts'}: samples/s")
            ax.grid(alpha=0.3)
            if ax.lines:  # a panel of runs without a measured samples/s has no line to name
                ax.legend(fontsize=7, title="batch", title_fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")  # `path` is a temporary name (write_report)
    plt.close(fig)
    return None


REPORT_FILES = ("sweep.md", "sweep.csv", "throughput.png")


def out_problem(out: Path) -> str | None:
    """Why the report cannot be written in the folder `out` (or None), found before anything is read or written:
    not a folder, a folder where a report file would go, a folder (or the nearest one that exists, for a new
    one) where no file can be created (permissions, a read-only mount, a full quota of inodes)."""
    if out.is_symlink() and not out.exists():
        return f"--out {out} is a link to nothing ({os.readlink(out)}); give a folder, e.g. --out report"
    if out.exists() and not out.is_dir():
        return (f"--out {out} is a file, not a folder: the report is {len(REPORT_FILES)} files "
                f"({', '.join(REPORT_FILES)}); give a folder, e.g. --out report")
    for name in REPORT_FILES:
        if (out / name).is_dir():
            return (f"--out {out}: {out / name} is a folder, where the report writes a file; remove it or give "
                    "another --out")
    folder = out
    while not folder.exists():  # a new folder: the report creates it in the nearest one that exists
        folder = folder.parent
    if not folder.is_dir():
        return f"--out {out}: {folder} is a file, not a folder; give a folder, e.g. --out report"
    try:  # really create (and remove) a file there, as the trainer checks its own outputs (check_outputs)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return (f"--out {out}: cannot write in {folder} ({exc.strerror}); give a folder you can write, e.g. "
                "--out $WORK/report")
    return None


def write_report(out: Path, writers: dict) -> list[Path]:
    """Each file written whole into a temporary file in `out`, fsync'ed, then all of them renamed into place: a
    failure (a full disk, Ctrl-C) replaces nothing and leaves no temporary file. A writer that writes nothing (no
    matplotlib) leaves its file as it was. Returns the files written; raises OSError."""
    out.mkdir(parents=True, exist_ok=True)
    staged: list[tuple[Path, Path]] = []
    try:
        for name, write in writers.items():
            tmp = out / f".{name}.{secrets.token_hex(4)}.tmp"
            staged.append((tmp, out / name))
            write(tmp)
            if tmp.exists():
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
        written = [target for tmp, target in staged if tmp.exists()]
        for tmp, target in staged:
            if tmp.exists():
                os.replace(tmp, target)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
    try:  # the renames survive a crash of the node, not only of the process
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # some file systems cannot sync a folder (EINVAL): the renames are atomic all the same
        pass
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="JSONL files written by --json-out")
    p.add_argument("--out", type=Path, default=Path("report"), help="output folder (default: report/)")
    p.add_argument("--title", default="Hybrid pipeline + data parallel benchmark")
    p.add_argument("--profile", help="a profile (benchmarks/speed_profile.py): predicted samples/s beside measured")
    args = p.parse_args(argv)
    if why := out_problem(args.out):  # before any work: nothing is read, nothing half-written
        print(f"report.py: {why}", file=sys.stderr)
        return 2
    try:
        profile = kit.speed.read_profile(args.profile) if args.profile else None
        records, problems = load(args.results)
    except (RecordsError, kit.speed.ProfileError) as exc:
        print(f"report.py: {exc}", file=sys.stderr)
        return 2
    for msg in problems:
        print(msg, file=sys.stderr)
    if not records:
        print(f"report.py: no usable result in {', '.join(map(str, args.results))}"
              + (f" ({len(problems)} note(s) above)" if problems else "; run the sweep first"),
              file=sys.stderr)
        return 1
    rows = merge(records)
    text = markdown(rows, args.title) + ("\n" + predicted_markdown(rows, profile) if profile else "")
    # the report says what it did not read (stderr, above, said it too)
    notes = "".join(["\n## Lines not read\n\nEach costs its own record or figure only.\n\n",
                     *(f"- {n}\n" for n in problems)]) if problems else ""
    no_plot: list[str] = []

    def png(path: Path) -> None:
        if why := plot(rows, path, args.title):
            no_plot.append(why)

    try:
        written = write_report(args.out, {
            "sweep.md": lambda path: path.write_text(text + notes + "\n", encoding="utf-8"),
            "sweep.csv": lambda path: write_csv(rows, path), "throughput.png": png})
    except OSError as exc:
        print(f"report.py: the report could not be written in {args.out} ({exc.strerror or exc}); nothing in it "
              "was replaced", file=sys.stderr)
        return 1
    print(text)
    print(f"wrote {', '.join(map(str, written))}" + (f"; no plot: {no_plot[0]}" if no_plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

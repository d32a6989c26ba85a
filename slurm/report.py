#!/usr/bin/env python
"""The benchmark's results as the page shows them: a table and a throughput-against-chunks figure.

    python slurm/report.py sweep_results.jsonl                 # writes report/sweep.md, .csv, throughput.png
    python slurm/report.py results.jsonl --out report --title "4 x V100"
    python slurm/report.py sweep_results.jsonl --profile profile.json     # predicted against measured too

Reads the JSON lines bench_ddp_transformer.py --json-out appends (one per run). Runs of the same
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
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import check_topology as ct  # noqa: E402  (torch-free: the speed model)

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


def load(paths: list[Path]) -> tuple[list[dict], list[str]]:
    """Records from JSONL files; malformed lines are reported, not fatal."""
    records, problems = [], []
    for path in paths:
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise SystemExit(f"report.py: cannot read {path}: {exc.strerror}")
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                r["tasks"], r["nb_part"], r["batch_size"], r["chunks"] = (int(r["tasks"]), int(r["nb_part"]),
                                                                          int(r["batch_size"]), int(r["chunks"]))
            except (ValueError, KeyError, TypeError) as exc:
                problems.append(f"{path}:{n}: skipped ({type(exc).__name__}: {exc})")
                continue
            r["layout"] = r.get("layout", "replica")
            for k, default in OPTION_DEFAULTS.items():
                r[k] = r.get(k, default)
            # replica layout: a task per replica over nb_part GPUs; stage layout: a task per GPU
            r["gpus"] = int(r.get("gpus") or r["tasks"] * r["nb_part"])
            r["batch_per_gpu"] = r["batch_size"] // r["nb_part"]
            records.append(r)
    return records, problems


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
    rec = row["record"]
    try:
        stage = row["layout"] == "stage"
        t = ct.Training(layout=row["layout"], pp=int(rec.get("pp") or 2), schedule=rec.get("schedule") or "1f1b",
                        precision=row["precision"], activation_checkpointing=bool(row["activation_checkpointing"]),
                        zero=bool(row["zero"]))
        model = {k: rec[k] for k in MODEL_FIELDS} | {"batch_size": row["batch_size"], "chunks": row["chunks"]}
        guess = ct.predict_speed(profile, model, t, t.pp if stage else row["nb_part"], int(rec["replicas"]),
                                 int(rec["tasks_per_node"]), int(rec.get("nodes") or 1))
    except (KeyError, TypeError, ValueError) as exc:  # ProfileError is a ValueError
        return f"not predicted ({type(exc).__name__}: {exc})"
    return guess["samples_per_s"]


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


def markdown(rows: list[dict], title: str) -> str:
    out = [f"# {title}", ""]
    for (device, gpus), group in _groups(rows):
        best = max(group, key=lambda r: r["samples_per_s"] or 0)
        cuda = device == "cuda"
        unit = "GPUs" if cuda else "parts (CPU processes, gloo: not a GPU result)"
        # memory beside throughput: measured (the GPU's peak; on the CPU the process's RSS) and estimated
        measured, mem = ("peak_gpu_mem_gb", "peak GPU mem") if cuda else ("host_rss_gb", "host RSS")
        out += [f"## {gpus} {unit}", "",
                f"Fastest: {best['tasks']} task(s) x nb_part {best['nb_part']} ({best['kind']}), batch "
                f"{best['batch_per_gpu']}/GPU, chunks {best['chunks']}"
                + (f", {options(best)}" if options(best) else "") + f": {fmt(best['samples_per_s'], '.1f')} "
                "samples/s", "",
                "| ntasks | nb_part | layout | batch/GPU | batch/replica | chunks | precision | act. ckpt | zero "
                f"| samples/s | {mem} (GiB) | estimate (GiB/GPU) | s/epoch | test acc | runs |",
                "| ---: | ---: | --- | ---: | ---: | ---: | --- | --- | --- " + "| ---: " * 6 + "|"]
        for r in group:
            out.append(f"| {r['tasks']} | {r['nb_part']} | {r['kind']} "
                       f"| {r['batch_per_gpu']} | {r['batch_size']} | {r['chunks']} | {r['precision']} | "
                       f"{'yes' if r['activation_checkpointing'] else 'no'} | {'yes' if r['zero'] else 'no'} | "
                       f"{fmt(r['samples_per_s'], '.1f')} | {fmt(r[measured], '.2f')} | "
                       f"{fmt(r['estimated_mem_gb'], '.2f')} | {fmt(r['epoch_time_s'], '.1f')} | "
                       f"{fmt(r['test_acc'], '.3f')} | {r['runs']} |")
        out.append("")
    return "\n".join(out)


def _groups(rows: list[dict]):
    keys = sorted({(r["device"], r["gpus"]) for r in rows})
    return [(k, [r for r in rows if (r["device"], r["gpus"]) == k]) for k in keys]


def write_csv(rows: list[dict], path: Path) -> None:
    fields = ["device", "gpus", "tasks", "nb_part", "kind", "layout", "batch_per_gpu", "batch_size", "chunks",
              "precision", "activation_checkpointing", "zero", "samples_per_s", "peak_gpu_mem_gb", "host_rss_gb",
              "estimated_mem_gb", "epoch_time_s", "test_acc", "runs", "engine", "torch"]
    with open(path, "w", newline="") as f:
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
            ax.legend(fontsize=7, title="batch", title_fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="JSONL files written by --json-out")
    p.add_argument("--out", type=Path, default=Path("report"), help="output folder (default: report/)")
    p.add_argument("--title", default="Hybrid pipeline + data parallel benchmark")
    p.add_argument("--profile", help="a profile (benchmarks/speed_profile.py): predicted samples/s beside measured")
    args = p.parse_args(argv)
    try:
        profile = ct.read_profile(args.profile) if args.profile else None
    except ct.ProfileError as exc:
        print(f"report.py: {exc}", file=sys.stderr)
        return 2
    records, problems = load(args.results)
    for msg in problems:
        print(msg, file=sys.stderr)
    if not records:
        print(f"report.py: no usable result in {', '.join(map(str, args.results))}; run the sweep first",
              file=sys.stderr)
        return 1
    rows = merge(records)
    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, args.title) + ("\n" + predicted_markdown(rows, profile) if profile else "")
    (args.out / "sweep.md").write_text(text + "\n")
    write_csv(rows, args.out / "sweep.csv")
    why = plot(rows, args.out / "throughput.png", args.title)
    print(text)
    print(f"wrote {args.out / 'sweep.md'}, {args.out / 'sweep.csv'}"
          + (f"; no plot: {why}" if why else f", {args.out / 'throughput.png'}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

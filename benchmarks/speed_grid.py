#!/usr/bin/env python
"""How good is the speed model? Profile this machine, predict a grid of splits, then measure each one.

    python benchmarks/speed_grid.py                      # the full grid: 32 splits x 5 repeats, about 35 minutes
    python benchmarks/speed_grid.py --quick              # 6 splits x 1 repeat, a smoke test

For each model size: benchmarks/speed_profile.py (2 tasks, as torchrun starts them), kit.speed.predict_speed
for every split, then the trainers themselves (torchrun, gloo, synthetic data), the repeats interleaved so that a
slow minute of a noisy host falls on every split alike; the median of the repeats is compared with the prediction.
The grid: the replica layout with nb_part 1 and 2 (its parts share the CPU, so they run in turn) and 1 or 2 replicas
(a real all-reduce), the stage layout with pp 2 and one thread per process (two processes on two cores overlap,
so its bubble is real), chunks 1 to 16, batches 8 to 64, two model sizes; one intra-op thread per process
throughout (a single process is held to one core with taskset): one process with 2 threads through the Pipe's
worker thread is not reproducible on this host (the same split measured 39 and 76 samples/s). Targets: Spearman rank correlation >= 0.9,
median absolute error <= 15 %, the predicted best within 5 % of the measured best. Writes report/speed_grid.json
and prints the table docs/speed.md shows.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import kit.arguments  # noqa: E402
import kit.speed  # noqa: E402

MODELS = {"small": [],  # the CPU defaults: 4 layers, d_model 64, seq 64
          "wide": ["--nlayers", "8", "--d-model", "128", "--d-hid", "512"]}
# (layout, nb_part or pp, replicas, batch per replica, chunks)
GRID = ([("replica", 1, 1, b, 1) for b in (16, 64)] + [("replica", 1, 2, b, 1) for b in (16, 64)]
        + [("replica", 2, 1, b, m) for b, m in ((8, 1), (8, 8), (32, 1), (32, 4), (32, 16), (64, 4))]
        + [("replica", 2, 2, 32, m) for m in (1, 8)]
        + [("stage", 2, 1, b, m) for b, m in ((16, 2), (16, 16), (64, 2), (64, 8))])
QUICK = [GRID[0], GRID[2], GRID[5], GRID[8], GRID[10], GRID[13]]


def torchrun(nproc: int, script: str, args: list[str], timeout: float = 900, cores: str | None = None) -> None:
    """torchrun on this host; `cores`: taskset's list (the trainer takes its threads from the cores it may use)."""
    cmd = [*(["taskset", "-c", cores] if cores else []), sys.executable, "-m", "torch.distributed.run",
           "--standalone", "--nproc-per-node", str(nproc), str(ROOT / script), *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        sys.exit(f"speed_grid: {' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def predict(profile: dict, model_argv: list[str], split: tuple) -> dict:
    layout, parts, replicas, batch, chunks = split
    t = kit.arguments.training_from_args(kit.arguments.read_trainer_argv(layout, model_argv).values, layout)
    t.schedule, t.pp = "1f1b", parts if layout == "stage" else t.pp
    model = kit.arguments.model_args(t, cpu=True, batch_size=batch, chunks=chunks)
    return kit.speed.predict_speed(profile, model, t, parts, replicas,
                                   parts * replicas if layout == "stage" else replicas,
                            threads=1)


def measure(split: tuple, model_argv: list[str], predicted_step: float, out: Path) -> float:
    """One run of the trainer on this split: enough steps for about 3 timed seconds; its samples/s."""
    layout, parts, replicas, batch, chunks = split
    steps = int(min(60, max(8, 3.0 / predicted_step)))
    common = ["--chunks", str(chunks), "--batch-size", str(batch), "--epochs", "1", "--max-steps", str(steps + 3),
              "--untimed-steps", "3", "--synthetic", str(batch * replicas * (steps + 4)), "--json-out", str(out),
              "--seed", "1"]
    if layout == "replica":  # one replica on one core: one thread per process, as every other run here
        torchrun(replicas, "bench_ddp_transformer.py", ["--nb-part", str(parts), *common, *model_argv],
                 cores="0" if replicas == 1 else None)
    else:
        torchrun(parts * replicas, "bench_stage.py", ["--pp", str(parts), "--schedule", "1f1b", *common, *model_argv])
    return json.loads(out.read_text().splitlines()[-1])["samples_per_s"]


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def summary(rows: list[dict]) -> dict:
    pred, meas = [r["predicted"] for r in rows], [r["measured"] for r in rows]
    errors = [abs(p - m) / m for p, m in zip(pred, meas)]
    best_pred = max(rows, key=lambda r: r["predicted"])
    best = max(meas)
    return {"splits": len(rows), "spearman": spearman(pred, meas), "median_abs_error": statistics.median(errors),
            "predicted_best": best_pred["name"], "predicted_best_gap": 1 - best_pred["measured"] / best}


def name_of(split: tuple) -> str:
    layout, parts, replicas, batch, chunks = split
    return (f"replica nb_part {parts} x {replicas}" if layout == "replica" else f"stage pp {parts} x {replicas}") \
        + f", batch {batch}, chunks {chunks}"


def table(rows: list[dict]) -> str:
    lines = ["| model | split | predicted samples/s | measured (median of repeats) | error | terms, ms per step |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        terms = ", ".join(f"{k.replace('_', ' ')} {v * 1000:.1f}" for k, v in r["terms"].items() if abs(v) >= 5e-5)
        lines.append(f"| {r['model']} | {r['name']} | {r['predicted']:.0f} | {r['measured']:.0f} | "
                     f"{(r['predicted'] - r['measured']) / r['measured']:+.0%} | {terms} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="6 splits of the small model, 1 repeat")
    p.add_argument("--repeats", type=int, default=5,
                   help="runs of each split, interleaved, the median kept (default 5: with 3 the repeats of the two fastest splits overlapped on this host)")
    p.add_argument("--out", default=str(ROOT / "report" / "speed_grid.json"))
    args = p.parse_args()
    models = {"small": MODELS["small"]} if args.quick else MODELS
    grid, repeats = (QUICK, 1) if args.quick else (GRID, args.repeats)
    t0 = time.time()
    rows = []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for label, argv in models.items():
            profile_path = Path(tmp) / f"profile_{label}.json"
            torchrun(2, "benchmarks/speed_profile.py", ["--out", str(profile_path), *argv])
            profile = kit.speed.read_profile(profile_path)
            shutil.copy(profile_path, Path(args.out).parent / f"speed_profile_{label}.json")
            print(f"{label}: profile in {profile['seconds']:.0f} s", flush=True)
            for split in grid:
                guess = predict(profile, argv, split)
                rows.append({"model": label, "argv": argv, "split": split, "name": name_of(split),
                             "predicted": guess["samples_per_s"], "terms": guess["terms"], "step_s": guess["step_s"],
                             "runs": []})
        for rep in range(repeats):  # interleaved: each repeat runs every split once
            for r in rows:
                r["runs"].append(measure(r["split"], r["argv"], r["step_s"], Path(tmp) / "run.jsonl"))
                print(f"repeat {rep + 1}: {r['model']} {r['name']}: {r['runs'][-1]:.0f} samples/s "
                      f"(predicted {r['predicted']:.0f})", flush=True)
    for r in rows:
        r["measured"] = statistics.median(r["runs"])
    overall = summary(rows)
    per_model = {m: summary([r for r in rows if r["model"] == m]) for m in models}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "overall": overall, "per_model": per_model,
                                          "minutes": (time.time() - t0) / 60, "host_cores": os.cpu_count()},
                                         indent=1))
    print(table(rows))
    print(f"\n{len(rows)} splits, {repeats} repeat(s), {(time.time() - t0) / 60:.1f} min: Spearman "
          f"{overall['spearman']:.2f} (target >= 0.9), median absolute error {overall['median_abs_error']:.1%} "
          "(target <= 15 %)")
    for m, s in per_model.items():
        print(f"  {m}: Spearman {s['spearman']:.2f}, median error {s['median_abs_error']:.1%}, predicted best "
              f"{s['predicted_best']} measured {s['predicted_best_gap']:.1%} below the measured best (target <= 5 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

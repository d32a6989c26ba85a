#!/usr/bin/env python
"""Which pipeline schedule, measured: each of the stage layout's schedules on the CPU, the same model, pp 2.

    python benchmarks/pipeline_schedules.py                 # 7 schedules x chunks 2, 4, 8: about 5 minutes
    python benchmarks/pipeline_schedules.py --chunks 4 --schedule gpipe,zbvzerobubble

Each run is bench_stage.py's own Stages (torchrun, 2 processes, gloo, one thread each, synthetic batches): 2 steps
to warm up, then --steps steps, in which every stage's forward, backward, input backward (I) and weight backward
(W) is timed where torch runs it (PipelineStage's forward_one_chunk, backward_one_chunk, backward_weight_one_chunk).
Per task: the measured idle fraction of the schedule's step (1 - time computing / the step's time), beside the
predicted one: kit.speed's simulation of the kit's order of that schedule (kit.schedules) with these measured
times per action and stage (no transfer delay): what the order alone costs. Samples/s: the batch over the mean
time of a whole training step (the optimizer's too). The multi-stage schedules hold 2 stages a task (4 in all),
the others 1: the same model, cut in 4 or in 2. Prints the table docs/speed.md shows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import kit.arguments  # noqa: E402
import kit.findings  # noqa: E402
import kit.releases  # noqa: E402
import kit.schedules  # noqa: E402
import kit.speed  # noqa: E402

MODEL = ["--nlayers", "8", "--d-model", "64", "--n-head", "4", "--d-hid", "256", "--seq-len", "128",
         "--vocab-size", "500", "--dropout", "0", "--batch-size", "16"]
CHUNKS = (2, 4, 8)


def worker(schedule: str, chunks: int, steps: int, out: Path) -> None:
    """One task: the trainer's Stages, its stages' compute timed, `steps` measured steps."""
    import torch
    from torch.distributed.pipelining import stage as stage_module
    import bench_stage
    import idr_torch
    import kit.train.launch
    import kit.train.setup
    torch.set_num_threads(1)
    spans: list[tuple[str, int, float, float]] = []
    base = stage_module._PipelineStageBase

    def timed(method, kind_of):  # noqa: ANN001, ANN202
        def run(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                spans.append((kind_of(kwargs), self.stage_index, t0, time.perf_counter()))
        return run
    base.forward_one_chunk = timed(base.forward_one_chunk, lambda kw: "F")
    base.backward_one_chunk = timed(base.backward_one_chunk, lambda kw: "B" if kw.get("full_backward", True) else "I")
    base.backward_weight_one_chunk = timed(base.backward_weight_one_chunk, lambda kw: "W")
    cfg = bench_stage.parse_args([*MODEL, "--pp", "2", "--schedule", schedule, "--chunks", str(chunks),
                                  "--virtual-stages", "2"])
    kit.train.setup.resolve(cfg, cuda=False)
    plan = bench_stage.make_plan(cfg, cuda=False)
    tasks = kit.train.launch.init_distributed(120, cuda=False, gpus=[])
    trainer = bench_stage.Stages(cfg, plan, cuda=False, tasks=tasks)
    trainer.start()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), generator=g)
    y = torch.randint(0, 2, (cfg.batch_size,), generator=g)
    step = trainer.schedule.step
    windows: list[tuple[float, float]] = []

    def timed_step(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            windows.append((t0, time.perf_counter()))
    trainer.schedule.step = timed_step
    walls = []
    for i in range(2 + steps):
        torch.distributed.barrier()
        if i == 2:
            spans.clear()
            windows.clear()
        t0 = time.perf_counter()
        trainer.train_step(x, y)
        walls.append(time.perf_counter() - t0)
    Path(out, f"rank{idr_torch.rank}.json").write_text(json.dumps(dict(
        rank=trainer.pp_rank, spans=spans, windows=windows, walls=walls[2:], batch=cfg.batch_size)))
    trainer.close()
    torch.distributed.destroy_process_group()


def run(schedule: str, chunks: int, steps: int) -> dict:
    """Both tasks of one schedule, then the measured and predicted idle fractions per task."""
    with tempfile.TemporaryDirectory() as out:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE",
                                                                         "LOCAL_RANK", "TORCHELASTIC"))}
        env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               __file__, "--worker", json.dumps([schedule, chunks, steps]), "--out", out],
                              env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
        if done.returncode:
            raise RuntimeError(f"{schedule} chunks {chunks}: the tasks failed:\n{done.stderr[-3000:]}")
        ranks = sorted((json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)),
                       key=lambda d: d["rank"])
    measured, means = [], {}
    for d in ranks:
        step_time = sum(b - a for a, b in d["windows"])
        busy = sum(t1 - t0 for _, _, t0, t1 in d["spans"])
        measured.append(1 - busy / step_time)
        for kind, s, t0, t1 in d["spans"]:
            means.setdefault((kind, s), []).append(t1 - t0)
    return dict(schedule=schedule, chunks=chunks, measured=measured, predicted=predicted_idle(schedule, chunks, means),
                samples_per_s=ranks[0]["batch"] / statistics.mean(ranks[0]["walls"]),
                timed={f"{k} {s}": len(v) for (k, s), v in sorted(means.items())})


def predicted_idle(schedule: str, chunks: int, means: dict) -> list[float]:
    """kit.speed's simulation of the kit's order with the measured mean time of each (action, stage)."""
    row = kit.schedules.schedule(schedule)
    virtual = row.stages_per_rank(2)
    queues = kit.speed._queues("stage", schedule, 2 * virtual, 2, chunks, False)
    cost = {k: statistics.mean(v) for k, v in means.items()}
    makespan, _ = kit.speed._simulate(queues, lambda k, s: cost.get((k, s), 0.0), 0.0, 2 * virtual)
    return [1 - sum(cost.get((k, s), 0.0) for k, s, _ in ops) / makespan for ops in queues]


def table(rows: list[dict]) -> str:
    lines = ["| schedule | chunks | idle task 0 measured | predicted | idle task 1 measured | predicted | samples/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        m, p = r["measured"], r["predicted"]
        lines.append(f"| {r['schedule']} | {r['chunks']} | {m[0]:.0%} | {p[0]:.0%} | {m[1]:.0%} | {p[1]:.0%} | "
                     f"{r['samples_per_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", default=",".join(kit.schedules.SCHEDULES), help="comma-separated")
    p.add_argument("--chunks", default=",".join(map(str, CHUNKS)), help="comma-separated")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", help="also write every row here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        schedule, chunks, steps = json.loads(args.worker)
        worker(schedule, chunks, steps, Path(args.out))
        return 0
    import torch
    rows, start = [], time.monotonic()
    for chunks in map(int, args.chunks.split(",")):
        for name in args.schedule.split(","):
            t = kit.schedules.schedule(name)
            findings = kit.findings.Findings()
            t.check(2, chunks, 2, findings)
            refused = kit.releases.torch_refusals(torch.__version__, kit.arguments.Training(
                layout="stage", schedule=name), cpu=True)
            if findings.errors or refused:
                print(f"{name} chunks {chunks}: not run: {(findings.errors[0].message if findings.errors else refused[0])}")
                continue
            rows.append(run(name, chunks, args.steps))
            print(f"{name} chunks {chunks}: {rows[-1]['samples_per_s']:.1f} samples/s", flush=True)
    print("\n" + table(rows))
    print(f"\n{len(rows)} runs in {time.monotonic() - start:.0f} s on torch {torch.__version__}, "
          f"{os.cpu_count()} cores")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

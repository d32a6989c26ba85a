#!/usr/bin/env python
"""The one-GPU check: what to run first on a GPU node (one task, nccl), in one short run.

    srun --gres=gpu:1 -n 1 python benchmarks/gpu_check.py             # or `make gpu-check` on the node
    python benchmarks/gpu_check.py --steps 10 --repeats 5 --json-out report/gpu_check.jsonl
    python benchmarks/gpu_check.py --tasks 2      # two tasks with nccl between them, even on one GPU

Rows: the replica layout with nb_part 1 and with nb_part 2 (on a one-GPU node both parts on GPU 0, the trainer's
--devices 0,0, which the checker knows as parts-share-gpu), in bf16 and fp32. Each row compares the full script
(bench_ddp_transformer.py, nccl) with a bare loop on the same model, micro-batches and AdamW on the same GPU(s):
plain forward/backward per micro-batch through the trainer's own parts, one AdamW step, no Pipe, no DDP, no data
loader. Like with like:
  - interleaved: script, bare loop, script, bare loop, ... --repeats times each (at least 3), so that a drift of the
    GPU's clocks or of the machine's load falls on both; each side's median is kept, and ratio = script median /
    bare loop median, with >= 0.95 the goal;
  - both timed the same way: --untimed-steps steps first (allocator, autotuning), then --steps timed steps between
    two synchronisations; the script restarts for each repeat (its start-up is not timed), the bare loop keeps its
    processes for a row's repeats, timing a fresh window each time;
  - the same number of processes: with --tasks N the bare loop runs in N processes at once, each on the GPU(s) of
    the script's task of that rank (all on GPU 0 where the tasks share it), started together, and its rate is all
    their samples over the span from the first start to the last end, as the script's is over its replicas. (Before,
    one task's rate was compared with one process owning the whole GPU: 0.341 on the H200 of 2026-12-04.)
The script's tasks get KIT_SYNC_DEBUG (--sync-debug, "error" by default): the trainer runs its timed steps under
torch.cuda.set_sync_debug_mode with that value, so a host synchronisation inside the step fails the row loudly
instead of slowing it quietly.
One table out (each row printed as it ends), and one JSON line per row (the last script run's record, both sides'
runs, medians and ratio) that slurm/report.py reads. Without a GPU it stops at once and says so (exit 2).

--tasks N runs the script as N tasks (torchrun's variables, one process each), so DDP's all-reduces and the kit's
collectives go through nccl between processes: the multi-task path. Where the tasks' parts outnumber the GPUs
(two tasks on a one-GPU machine), every part goes on GPU 0 and each task gets its own NCCL_HOSTID: nccl refuses two
ranks of one communicator on one GPU of one host ("Duplicate GPU detected", src/init.cc compares the host hash and
the GPU's bus id), and NCCL_HOSTID replaces the host hash (getHostHash, src/misc/utils.cc), so the tasks look like
two hosts and talk over nccl's network transport (sockets on `lo` unless NCCL_SOCKET_IFNAME says otherwise).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GOAL = 0.95
SYNC_DEBUG_VARIABLE = "KIT_SYNC_DEBUG"  # the trainer reads it: its timed steps run under set_sync_debug_mode(value)
WORKER_TAG = "gpu_check-bare "  # a bare loop worker's protocol lines on its stdout (anything else is its log)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per run (after --untimed-steps)")
    p.add_argument("--untimed-steps", "--warmup", dest="untimed", type=int, default=3,
                   help="steps of each run left out of the timing (allocator, autotuning); --warmup is its old name")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side per row, interleaved; the medians "
                   "are compared (at least 3)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--nlayers", type=int, default=16)
    p.add_argument("--precision", choices=("fp32", "bf16", "both"), default="both")
    p.add_argument("--json-out", help="append one JSON line per row here")
    p.add_argument("--timeout", type=float, default=300, help="seconds one run (script or bare loop) may take")
    p.add_argument("--tasks", type=int, default=1, help="tasks (processes) per row, nccl between them; more tasks "
                   "than GPUs share GPU 0, each with its own NCCL_HOSTID; the bare loop runs in as many processes")
    p.add_argument("--sync-debug", choices=("error", "warn", "off"), default="error",
                   help=f"the script's timed steps under torch.cuda.set_sync_debug_mode (passed as "
                        f"{SYNC_DEBUG_VARIABLE}); off: timed as they are")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "chunks", "nlayers", "timeout", "tasks"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    if args.untimed < 0:
        p.error(f"--untimed-steps {args.untimed} must be 0 or more")
    if args.repeats < 3:
        p.error(f"--repeats {args.repeats} must be at least 3 (each side's median of 3 runs or more)")
    if args.batch_size % args.chunks:
        p.error(f"--chunks {args.chunks} must divide --batch-size {args.batch_size}")
    return args


def one_gpu_devices(nb_part: int, gpus: int, tasks: int = 1) -> str | None:
    """--devices for a row: None where the node has a GPU per part of every task; else every part on GPU 0 (the
    pipeline still runs its nb_part stages and their sends, one after the other on one GPU)."""
    return None if nb_part * tasks <= gpus else ",".join("0" * nb_part)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def task_envs(tasks: int, shared_gpu: bool) -> list[dict[str, str]]:
    """The environment of each task of a row: this one for a single task; torchrun's variables for several (so
    idr_torch reads them, even inside an srun step), and an NCCL_HOSTID per task where they share a GPU."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_",
                                 "TORCHELASTIC", "NCCL_HOSTID"))}
    if tasks == 1:
        return [base]
    port = str(free_port())
    envs = []
    for rank in range(tasks):
        env = dict(base, RANK=str(rank), WORLD_SIZE=str(tasks), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(tasks),
                   GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHELASTIC_RUN_ID="gpu_check")
        if shared_gpu:
            env["NCCL_HOSTID"] = f"gpu-check-task-{rank}"
            env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        envs.append(env)
    return envs


# ---- like with like: the interleaving and the medians (no GPU needed: tests/test_gpu_check.py runs them) ----------
def interleave(repeats: int, script: Callable[[], float], bare: Callable[[], float]) -> tuple[list[float],
                                                                                          list[float]]:
    """script, bare, script, bare, ...: `repeats` rates of each side, in the order they ran."""
    a: list[float] = []
    b: list[float] = []
    for _ in range(repeats):
        a.append(script())
        b.append(bare())
    return a, b


def compare(script: list[float], bare: list[float]) -> dict:
    """Each side's median and the ratio of the medians (a median: one slow run, a clock dip or a neighbour's burst,
    moves it less than a mean)."""
    s, b = statistics.median(script), statistics.median(bare)
    return {"script_samples_per_s": s, "bare_samples_per_s": b, "ratio": s / b, "script_runs": list(script),
            "bare_runs": list(bare)}


def aggregate(windows: list[dict]) -> float:
    """The bare loop's rate over its processes: all their samples over the span from the first start to the last
    end (the script's rate is over all its replicas the same way)."""
    span = max(w["t1"] for w in windows) - min(w["t0"] for w in windows)
    return sum(w["samples"] for w in windows) / span


def cell(runs: list[float], median: float) -> str:
    return f"{median:.1f} ({min(runs):.1f}-{max(runs):.1f})"


# ---- the script --------------------------------------------------------------------------------------------------
def run_script(args: argparse.Namespace, nb_part: int, precision: str, work: Path, devices: str | None) -> dict:
    """The full script, --tasks tasks, nccl: its JSON record (samples/s of the timed steps, all replicas)."""
    out = work / f"row-{nb_part}-{precision}.jsonl"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "bench_ddp_transformer.py"), "--nb-part", str(nb_part), "--nlayers",
           str(args.nlayers), "--batch-size", str(args.batch_size), "--chunks", str(args.chunks), "--epochs", "1",
           "--synthetic", str(args.batch_size * args.tasks * (args.steps + args.untimed + 2)), "--max-steps",
           str(args.steps + args.untimed), "--untimed-steps", str(args.untimed), "--cache-dir", str(work),
           "--json-out", str(out), "--timeout", str(args.timeout)]
    if precision != "fp32":
        cmd += ["--precision", precision]
    if devices:
        cmd += ["--devices", devices]
    envs = task_envs(args.tasks, devices is not None and args.tasks > 1)
    if args.sync_debug != "off":
        envs = [dict(env, **{SYNC_DEBUG_VARIABLE: args.sync_debug}) for env in envs]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for env in envs]
    try:
        results = [(p.wait(timeout=args.timeout + 60), *p.communicate()) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise
    for rank, (code, _, err) in enumerate(results):
        if code != 0:
            last = (err.strip().splitlines() or ["no output"])[-1]
            hint = (f" (a host synchronisation in a timed step, {SYNC_DEBUG_VARIABLE}={args.sync_debug}; "
                    "--sync-debug off times it anyway)" if "synchronizing CUDA operation" in err else "")
            raise RuntimeError(f"the script failed on nb_part {nb_part} {precision}, task {rank} of {args.tasks} "
                               f"(exit {code}){hint}: {last}")
    return json.loads(out.read_text().splitlines()[-1])


# ---- the bare loop: worker processes kept for a row's repeats ------------------------------------------------------
class BareLoops:
    """The bare loop in `tasks` processes at once (this script's --bare-worker), task r's on the GPU(s) the script's
    task r uses. Started once for a row's repeats (the model built once), each run() times a fresh window in every
    process: --untimed-steps steps, all processes ready, then --steps timed steps, started together."""

    def __init__(self, args: argparse.Namespace, nb_part: int, devices: str | None, python: str = sys.executable):
        self.args, self.log, self.windows = args, [], []
        self.procs, self.lines = [], queue.Queue()
        for rank in range(args.tasks):
            conf = dict(rank=rank, tasks=args.tasks, nb_part=nb_part, devices=devices, nlayers=args.nlayers,
                        batch_size=args.batch_size, chunks=args.chunks)
            p = subprocess.Popen([python, str(Path(__file__).resolve()), "--bare-worker", json.dumps(conf)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 bufsize=1, env=task_envs(1, False)[0])
            threading.Thread(target=self._read, args=(rank, p), daemon=True).start()
            self.procs.append(p)
        try:
            self._gather("built")
        except BaseException:
            self.close()
            raise

    def _read(self, rank: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            if line.startswith(WORKER_TAG):
                self.lines.put((rank, json.loads(line[len(WORKER_TAG):])))
            else:
                self.log.append(line.rstrip())
        self.lines.put((rank, None))  # its output ended: it exited

    def _send(self, message: dict) -> None:
        for p in self.procs:
            p.stdin.write(json.dumps(message) + "\n")
            p.stdin.flush()

    def _gather(self, key: str) -> list[dict]:
        """One message with `key` from every worker, within --timeout; one that exits first fails the row."""
        got, deadline = {}, time.monotonic() + self.args.timeout
        while len(got) < len(self.procs):
            try:
                rank, msg = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"the bare loop did not answer within {self.args.timeout:g}s") from None
            if msg is None:
                last = (self.log or ["no output"])[-1]
                raise RuntimeError(f"the bare loop's process {rank} ended (exit {self.procs[rank].wait()}): {last}")
            if key in msg:
                got[rank] = msg
        return [got[r] for r in range(len(self.procs))]

    def run(self, precision: str) -> float:
        self._send({"precision": precision, "untimed": self.args.untimed, "steps": self.args.steps})
        self._gather("ready")
        self._send({"go": True})
        self.windows = self._gather("samples")
        return aggregate(self.windows)

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write(json.dumps({"quit": True}) + "\n")
                p.stdin.close()
            except (BrokenPipeError, ValueError):
                pass
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def bare_model(conf: dict):
    """The bare loop's model for one process: the trainer's own parts (kit.train.parts.model_parts, each part's
    autocast at the precision asked), its AdamW, one batch; on the GPU(s) the script's task of this rank uses
    (the CPU where there is none: the tests). Returns (cfg, parts, their devices, the optimizer, x, y)."""
    import torch
    import idr_torch
    import kit.arguments
    import kit.plan
    import kit.train.parts
    import kit.train.setup
    cuda = torch.cuda.is_available()
    cfg = kit.arguments.parse_trainer_args("replica", ["--nlayers", str(conf["nlayers"]), "--batch-size",
                                                       str(conf["batch_size"]), "--chunks", str(conf["chunks"]),
                                                       "--nb-part", str(conf["nb_part"])])
    kit.train.setup.resolve(cfg, cuda=cuda)
    devices = None if conf["devices"] is None else [int(d) for d in conf["devices"].split(",")]
    visible = [str(i) for i in range(torch.cuda.device_count())] if cuda else []
    plan = kit.plan.plan_task(conf["rank"], 0, conf["rank"], conf["tasks"], visible, None, cfg.nlayers,
                              conf["nb_part"], None, devices)
    kit.train.setup.use_gpus(plan)
    # the intra-op threads the trainer's task of this rank takes (its cores, or the node's split between the tasks)
    task = types.SimpleNamespace(local_world_size=conf["tasks"], cpus_asked=idr_torch.current().cpus_asked)
    torch.set_num_threads(kit.train.setup.cpu_threads(task))
    parts = kit.train.parts.model_parts(cfg, plan)
    where = [plan.device(i) for i in range(plan.nb_part)]
    opt = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=cfg.lr)
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), device=where[0])
    y = torch.randint(0, 2, (cfg.batch_size,), device=where[-1])
    return cfg, parts, where, opt, x, y


def bare_worker(conf: dict) -> int:
    """One process of the bare loop (bare_model): the parts one after the other, cross entropy, one AdamW step.
    Answers on stdout, WORKER_TAG first."""
    import torch
    import torch.nn.functional as F
    cuda = torch.cuda.is_available()
    cfg, parts, where, opt, x, y = bare_model(conf)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for xm, ym in zip(x.chunk(cfg.chunks), y.chunk(cfg.chunks)):
            h = xm
            for part, dev in zip(parts, where):
                h = part(h.to(dev))
            (F.cross_entropy(h.float(), ym) / cfg.chunks).backward()
        opt.step()

    def sync() -> None:
        for d in set(where) if cuda else ():
            torch.cuda.synchronize(d)

    def say(**msg: object) -> None:
        print(WORKER_TAG + json.dumps(msg), flush=True)

    say(built=os.getpid())
    for line in sys.stdin:
        order = json.loads(line)
        if order.get("quit"):
            break
        for part in parts:
            part.precision = order["precision"]  # Part.forward's autocast, as the trainer's
        for _ in range(order["untimed"]):
            step()
        sync()
        say(ready=os.getpid())
        if not json.loads(sys.stdin.readline() or "{}").get("go"):
            break
        t0 = time.time()  # the wall clock: the processes' windows are put together
        for _ in range(order["steps"]):
            step()
        sync()
        t1 = time.time()
        say(samples=order["steps"] * cfg.batch_size, t0=t0, t1=t1, pid=os.getpid())
        if cuda:  # an idle worker holds its weights and AdamW's state only, while the script runs
            torch.cuda.empty_cache()
    return 0


# ---- the rows ----------------------------------------------------------------------------------------------------
def row_label(nb_part: int, precision: str, tasks: int, devices: str | None) -> str:
    return (f"nb_part {nb_part} {precision}" + (f" x {tasks} tasks" if tasks > 1 else "")
            + (f" (--devices {devices}" + (", NCCL_HOSTID per task)" if tasks > 1 else ")") if devices else ""))


def measure_row(args: argparse.Namespace, nb_part: int, precision: str, work: Path, devices: str | None,
                bare: BareLoops) -> dict:
    """The row's interleaved runs; the last script run's record, with both sides' runs, medians and ratio."""
    records: list[dict] = []

    def script() -> float:
        records.append(run_script(args, nb_part, precision, work, devices))
        return records[-1]["samples_per_s"]

    a, b = interleave(args.repeats, script, lambda: bare.run(precision))
    return dict(records[-1], **compare(a, b), samples_per_s=statistics.median(a))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print(f"gpu_check: error: no CUDA GPU here (torch {torch.__version__}, torch.cuda.is_available() is "
              f"False); run it on a GPU node: srun --gres=gpu:1 -n 1 python benchmarks/gpu_check.py",
              file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    # bf16 first: the rows below the goal on the H200 (2026-12-04), should a time limit end the run early
    precisions = ["bf16", "fp32"] if args.precision == "both" else [args.precision]
    rows = []
    print(f"gpu_check: {name} x {gpus}, torch {torch.__version__}, nccl, {args.tasks} task(s); {args.repeats} "
          f"interleaved runs of each side, {args.untimed} untimed + {args.steps} timed steps each, batch "
          f"{args.batch_size} per task, chunks {args.chunks}, nlayers {args.nlayers}; sync debug {args.sync_debug}")
    print("| row | script samples/s, median (min-max) | bare loop samples/s, median (min-max) | script / bare loop "
          "| |\n| --- | --- | --- | --- | --- |", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for nb_part in (1, 2):
            devices = one_gpu_devices(nb_part, gpus, args.tasks)
            bare = None
            try:
                for precision in precisions:
                    label = row_label(nb_part, precision, args.tasks, devices)
                    if precision == "bf16" and not torch.cuda.is_bf16_supported():  # V100: the trainer refuses it
                        print(f"| {label} | - | - | - | not run: {name} has no bf16 |", flush=True)
                        continue
                    try:
                        bare = bare or BareLoops(args, nb_part, devices)
                        record = measure_row(args, nb_part, precision, Path(tmp), devices, bare)
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:  # one row's failure keeps the others
                        print(f"| {label} | - | - | - | failed: {str(exc).splitlines()[0]} |", flush=True)
                        rows.append({"check": "gpu_check", "row": label, "failed": str(exc)})
                        continue
                    record.update(check="gpu_check", row=label, precision=precision, goal=GOAL, tasks=args.tasks,
                                  bare_processes=args.tasks, repeats=args.repeats)
                    rows.append(record)
                    ok = "ok" if record["ratio"] >= GOAL else f"below the goal {GOAL}"
                    print(f"| {label} | {cell(record['script_runs'], record['script_samples_per_s'])} | "
                          f"{cell(record['bare_runs'], record['bare_samples_per_s'])} | {record['ratio']:.3f} | "
                          f"{ok} |", flush=True)
                    if args.json_out:  # row by row: a later failure or time limit loses nothing
                        with open(args.json_out, "a") as f:
                            f.write(json.dumps(record) + "\n")
            finally:
                if bare is not None:
                    bare.close()
    return 0 if rows and all(r.get("ratio", 0) >= GOAL for r in rows) else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--bare-worker"]:
        sys.exit(bare_worker(json.loads(sys.argv[2])))
    try:
        sys.exit(main())
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"gpu_check: error: {exc}", file=sys.stderr)
        sys.exit(1)

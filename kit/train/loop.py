"""The training loop both layouts share (kit.train.replica's Replica, bench_stage.py's Stages: a kit.train.trainer
Trainer): epochs, the learning-rate schedule, timed steps without a host sync, evaluation, the agreed stop and its
checkpoint, the end of the run and its record. Owns: the schedule (LR_FLOOR).
Imports: idr_torch, kit.arguments, kit.train.checkpoint, kit.train.data, kit.train.errors, kit.train.launch,
kit.train.own, kit.train.records, kit.train.setup, kit.train.signals, kit.train.trainer.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import psutil
import threading
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

import idr_torch
import kit.arguments
from kit.train.checkpoint import ARCHITECTURE, Saves, check_last_save, corpus_identity, restore_rng, resume_point, \
    save_progress
from kit.train.data import load_corpus, make_loader
from kit.train.errors import RunError, log
from kit.train.launch import Tasks
from kit.train.own import SYNTHETIC_LOSS, synthetic_corpus
from kit.train.records import chance_accuracy, speed_text, throughput, write_record
from kit.train.setup import cpu_threads
from kit.train.signals import HELD, hold_stop_signals
from kit.train.trainer import Trainer


class StopRequest:
    """SIGUSR1 (Slurm's --signal=USR1@seconds before the time limit), SIGTERM (scancel, preemption) or SIGINT
    (Ctrl-C), held by hold_signal since start-up: finish the current step, checkpoint, exit 75. Every rank must stop
    at the same step, or DDP would wait for the missing ones forever: the flags are OR-ed across ranks after every
    step, on the CPU (gloo: the tasks' host group), so the GPU stream is never synchronised for it."""
    EXIT_CODE = 75  # EX_TEMPFAIL: "try again"; the templates requeue on it

    def __init__(self, host_group: dist.ProcessGroup | None = None) -> None:
        self.flag, self.host_group = torch.zeros(1), host_group
        if threading.current_thread() is threading.main_thread():  # the program holds them already; an importer not
            hold_stop_signals()

    @property
    def signal(self) -> str | None:
        """The first stop signal this task received (the reason), or None."""
        return HELD.first

    def agreed(self, world: int) -> bool:
        HELD.interrupt_if_deferred()
        self.flag[0] = 1.0 if HELD.pending else 0.0
        if world > 1:
            dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.host_group)
        stop = bool(self.flag[0] > 0)
        HELD.end(stop)  # the stop's checkpoint next: Ctrl-C again does not cut it
        return stop


def reduce_max(values: list[float], device: str, world: int) -> list[float]:
    """The largest of each value over the tasks. `device`: the stats device, the same part (the last, or the task's
    one GPU) on every task, so on nccl every task meets in the communicator of that part, on its own GPU."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# the training loop, shared by both layouts
@dataclasses.dataclass
class Epoch:
    """One epoch's progress, as train_epoch leaves it."""
    step: int  # steps done in all, this epoch's included
    stats: torch.Tensor  # loss x samples, correct, samples: on the device, summed without a host sync
    batches: int = 0  # batches of this epoch done, the ones skipped on resume included
    timed_steps: int = 0
    t_begin: float = dataclasses.field(default_factory=time.time)
    t_timed: float | None = None  # when the timed steps began (after the warm-up)
    first_batch_at: float | None = None
    first_bad: torch.Tensor | None = None  # the first step whose loss was not finite (0: none), on the device
    lr: float | None = None  # the schedule's rate at the last step trained


def train(cfg: argparse.Namespace, trainer: Trainer, tasks: Tasks, source: Path | None, cuda: bool) -> int:
    """Data, the resume point, DDP, then per epoch: train, stop if asked, evaluate, save; the record. A run whose
    last saves failed does not end as if its checkpoint were current (check_last_save)."""
    launch = tasks.launch
    world, rank, dp = launch.size, launch.rank, trainer.dp_size
    log(f"torch {torch.__version__}, {trainer.name} layout, backend {dist.get_backend()}, world size {world} on "
        f"{launch.num_nodes} node(s), chunks {cfg.chunks}, batch {cfg.batch_size}/replica "
        f"({cfg.batch_size * dp} global)")
    log(f"  {trainer.describe()}")
    saves, data = Saves(), own_data(cfg, trainer)
    if data is None:  # the kit's corpus (a --model on synthetic batches has none: nothing to record or check of it)
        data = load_corpus(cfg, source, tasks)
        saves.corpus = corpus_identity(data)
    train_loader, test_loader = make_loaders(cfg, data, trainer, launch, cuda)
    chance = chance_accuracy(data["test_y"])
    start_epoch, skip, step, state = resume_point(cfg, trainer, tasks, saves)  # loaded before DDP wraps the model
    end_epoch = cfg.epochs
    if start_epoch >= cfg.epochs:
        log(f"nothing to train: the checkpoint holds {start_epoch} epoch(s) and --epochs is {cfg.epochs}; raise "
            f"--epochs to go on, or delete {cfg.load or cfg.save} (and its .resume.pt) to start afresh")
    elif cfg.max_steps and step >= cfg.max_steps:  # --max-steps counts the loaded steps too
        end_epoch = start_epoch
        log(f"nothing to train: the checkpoint is at step {step} and --max-steps is {cfg.max_steps}; raise "
            f"--max-steps (or 0: no limit) to go on, or delete {cfg.load or cfg.save} (and its .resume.pt) to start "
            "afresh")
    trainer.start()
    torch.manual_seed(cfg.seed + 1 + rank)  # dropout masks differ between replicas
    if state is not None:
        restore_rng(state, rank)
    stop = StopRequest(tasks.host_group)
    log(f"  model: {trainer.total_params / 1e6:.2f} M parameters; {len(train_loader)} steps per epoch")
    log(f"  {trainer.memory}")
    history, startup_s = [], None
    for epoch in range(start_epoch, end_epoch):
        ep = train_epoch(cfg, trainer, train_loader, epoch, skip, step, stop, world,
                         run_steps(cfg, len(train_loader)))
        step = ep.step
        check_finite(cfg, ep, epoch, world)  # before anything is saved over the last good checkpoint
        if startup_s is None and ep.first_batch_at is not None:  # imports, data, model: before step 1
            startup_s = ep.first_batch_at - psutil.Process().create_time()
        if stop.flag[0] > 0:  # agreed by every rank at the same step (a signal of its own alone is not)
            return stop_and_checkpoint(cfg, trainer, tasks, saves, ep, epoch, len(train_loader), stop)
        skip = 0
        history.append(end_of_epoch(cfg, trainer, test_loader, epoch, ep, world, cuda))
        # --max-steps can end the run inside an epoch: the checkpoint says which batch, so that --resume goes on
        # from there (saved as a whole epoch, the rest of that epoch would never be trained)
        if save_progress(cfg, trainer, tasks, saves, epoch, ep.batches, len(train_loader), step):
            log(f"  checkpoint saved: {cfg.save} (epoch {epoch + 1}"
                + ("" if ep.batches == len(train_loader) else f" up to batch {ep.batches}/{len(train_loader)}")
                + f", step {step})")
        if cfg.max_steps and step >= cfg.max_steps:
            break
    finish(cfg, trainer, tasks, history, startup_s, cuda, chance)
    check_last_save(cfg, saves)
    return 0


def own_data(cfg: argparse.Namespace, trainer: Trainer) -> dict | None:
    """A --model run: its split said as the checker says it; the synthetic batches of a model the kit's data does not
    fit (None: the kit's data), and the one line that says such a run measures speed, not learning."""
    own = getattr(trainer, "own", None)
    if own is None:
        return None
    log(f"  {own.plan.text()}")
    if own.kit_data:
        return None
    log(f"  --model {own.plan.spec} does not take token ids and return the kit's 2 classes' logits: it runs on "
        f"synthetic batches shaped like --sample {cfg.sample} with a stand-in loss ({SYNTHETIC_LOSS}); this run "
        "measures speed, not learning")
    return synthetic_corpus(cfg, own, trainer.dp_size)


def learning_run(trainer: Trainer) -> bool:
    """Whether the run learns a task (the kit's model, or a --model on the kit's data), or measures speed only."""
    own = getattr(trainer, "own", None)
    return own is None or own.learning


def check_finite(cfg: argparse.Namespace, ep: Epoch, epoch: int, world: int) -> None:
    """Stop on a non-finite loss (a learning rate that diverges, bad data): one line that names the first step it
    was seen at, every task at once, before anything is saved over the last good checkpoint. Checked after each
    epoch (or stop), not each step: reading the loss every step would make the GPU wait for the host."""
    never = torch.iinfo(torch.int64).max
    first = torch.where(ep.first_bad > 0, ep.first_bad, never)
    if world > 1:
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
    step = int(first.item())
    if step != never:
        raise RunError(f"the loss is not finite (nan or inf) from step {step} (epoch {epoch + 1}) on: training "
                       f"diverged; lower --lr (now {cfg.lr:g}), or check the data and the --load file"
                       + (f"; {cfg.save} keeps its last save" if cfg.save else ""))


def make_loaders(cfg: argparse.Namespace, data: dict, trainer: Trainer, launch: idr_torch.Launch,
                 cuda: bool) -> tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader]:
    dp = trainer.dp_size  # replicas that each see their own share of the data
    # workers from the cores the task really has (cpu_threads), not from what SLURM_CPUS_PER_TASK asked
    workers = cfg.workers if cfg.workers >= 0 else (min(4, max(0, cpu_threads(launch) - 1)) if cuda else 0)
    train_loader = make_loader(data["train_x"], data["train_y"], cfg.batch_size, dp, trainer.dp_rank, True,
                               cfg.seed, workers, cuda)
    # the stage layout's schedules want every batch the same size: a short last test batch is dropped there
    test_loader = make_loader(data["test_x"], data["test_y"], cfg.batch_size, dp, trainer.dp_rank,
                              trainer.equal_batches, cfg.seed, workers, cuda, shuffle=False)
    if len(train_loader) == 0:
        raise RunError(f"{len(data['train_y'])} training reviews give no full batch of {cfg.batch_size} per "
                       f"replica x {dp} replicas; lower --batch-size or add data")
    return train_loader, test_loader


def run_steps(cfg: argparse.Namespace, steps_per_epoch: int) -> int:
    """The steps the lr's schedule spans: --epochs of them. --max-steps is a stop, not the run's length: a run cut
    by it and resumed follows the uninterrupted run's schedule, step for step (tests/test_faults.py)."""
    return cfg.epochs * steps_per_epoch


LR_FLOOR = 0.1  # where --lr-decay ends, a fraction of --lr: nanoGPT's min_lr = lr / 10 (after Chinchilla's cosine)


def lr_at(cfg: argparse.Namespace, step: int, total: int) -> float:
    """--lr's schedule at `step` (0-based, over the whole run: a resumed run goes on where it was) of `total`:
    a linear warmup from 0 over --lr-warmup of the steps, then --lr-decay (cosine or linear) down to LR_FLOOR x --lr
    at the last step, or constant. Computed from the step, not kept in a scheduler's state: a resume with another
    --lr, --lr-warmup or --epochs follows the new schedule from its step on (the record has each epoch's rate)."""
    warm = round(cfg.lr_warmup * total)
    if step < warm:
        return cfg.lr * (step + 1) / (warm + 1)
    if cfg.lr_decay == "none":
        return cfg.lr
    done = min((step - warm) / max(total - warm - 1, 1), 1.0)
    factor = 1.0 - done if cfg.lr_decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
    return cfg.lr * (LR_FLOOR + (1.0 - LR_FLOOR) * factor)


# benchmarks/gpu_check.py sets KIT_SYNC_DEBUG=error for the script's tasks: a host sync in a timed step (a blocking
# copy between host and GPU, a stream synchronize, .item()) then raises where it happens, instead of costing the
# host-bound bf16 step its time unseen (torch.cuda.set_sync_debug_mode; c10/cuda/CUDAFunctions.h says what counts).
SYNC_DEBUG = os.environ.get("KIT_SYNC_DEBUG", "").strip()


@contextlib.contextmanager
def sync_debug(timed: bool) -> Iterator[None]:
    """torch's sync debug mode around one timed step, where KIT_SYNC_DEBUG asks for it on a GPU; else nothing."""
    if not (timed and SYNC_DEBUG and torch.cuda.is_available()):
        yield
        return
    torch.cuda.set_sync_debug_mode(SYNC_DEBUG)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def train_epoch(cfg: argparse.Namespace, trainer: Trainer, loader: torch.utils.data.DataLoader, epoch: int,
                skip: int, step: int, stop: StopRequest, world: int, total: int) -> Epoch:
    """One epoch from batch `skip` on (resumed inside this epoch: same sampler order, those are done); `total`:
    the run's steps, for the lr's schedule."""
    loader.sampler.sampler.set_epoch(epoch)
    ep = Epoch(step=step, stats=torch.zeros(3, dtype=torch.float64, device=trainer.stats_device),
               first_bad=torch.zeros((), dtype=torch.int64, device=trainer.stats_device))
    t_last_log = time.time()
    for i, (x, y) in enumerate(loader):
        ep.batches = i + 1
        if i < skip:
            continue
        ep.first_batch_at = ep.first_batch_at or time.time()
        if i == skip + cfg.untimed_steps:  # counted from the first batch this run trains on
            trainer.synchronize()
            ep.t_timed = time.time()
        ep.lr = lr_at(cfg, ep.step, total)
        with sync_debug(ep.t_timed is not None):
            trainer.set_lr(ep.lr)
            stats = trainer.train_step(x, y)
            ep.stats += stats  # stays on the device: no .item() (a host sync) in the loop
            ep.step += 1
            ep.first_bad = torch.where(ep.first_bad.eq(0) & ~torch.isfinite(stats[0]), ep.step, ep.first_bad)
        ep.timed_steps += int(ep.t_timed is not None)
        if stop.agreed(world):
            break
        if idr_torch.rank == 0 and time.time() - t_last_log > cfg.log_every:
            t_last_log = time.time()
            log(f"  epoch {epoch + 1} step {i + 1}/{len(loader)}"
                + (f" loss {(ep.stats[0] / ep.stats[2]).item():.4f}" if ep.stats[2] > 0 else "")
                + f" ({time.time() - ep.t_begin:.0f}s)")
        if cfg.max_steps and ep.step >= cfg.max_steps:
            break
    return ep


def evaluate(trainer: Trainer, loader: torch.utils.data.DataLoader, world: int) -> float:
    acc = torch.zeros(2, dtype=torch.float64, device=trainer.stats_device)
    for x, y in loader:
        acc += trainer.eval_step(x, y)
    if world > 1:
        dist.all_reduce(acc)  # on the stats device, as reduce_max: one communicator, each task on its own GPU
    return (acc[0] / acc[1].clamp(min=1)).item()


def end_of_epoch(cfg: argparse.Namespace, trainer: Trainer, test_loader: torch.utils.data.DataLoader, epoch: int,
                 ep: Epoch, world: int, cuda: bool) -> dict:
    """The epoch's figures (summed over the replicas), evaluation, one line; the row of the record."""
    trainer.synchronize()
    t_end = time.time()
    if world > 1:
        dist.all_reduce(ep.stats)
    timed = t_end - ep.t_timed if ep.t_timed is not None and ep.timed_steps else None
    samples_per_s = ep.timed_steps * cfg.batch_size * trainer.dp_size / timed if timed else None
    test_acc = evaluate(trainer, test_loader, world)
    peak_gb, rss_gb = reduce_max([trainer.peak_memory_gb(), psutil.Process().memory_info().rss / 2**30],
                                 trainer.stats_device, world)
    seen = max(ep.stats[2].item(), 1)
    row = {"epoch": epoch + 1, "steps": ep.batches, "loss": ep.stats[0].item() / seen,
           "train_acc": ep.stats[1].item() / seen, "test_acc": test_acc, "epoch_time_s": t_end - ep.t_begin,
           "samples_per_s": samples_per_s, "timed_steps": ep.timed_steps, "lr": ep.lr,
           "peak_gpu_mem_gb": peak_gb if cuda else None, "host_rss_gb": rss_gb}
    accuracy = (f"train acc {row['train_acc']:.3f} | test acc {test_acc:.3f}" if learning_run(trainer) else
                "speed only")  # a --model on synthetic batches: its accuracy means nothing
    log(f"epoch {row['epoch']:3d} | steps {row['steps']:5d} | loss {row['loss']:.4f} | {accuracy} | "
        f"{row['epoch_time_s']:7.1f}s | "
        + (f"{samples_per_s:9.1f} samples/s" if samples_per_s else "   (too few steps to time)")
        + (f" | peak GPU mem {peak_gb:.2f} GiB" if cuda else "")
        + (f" (estimate {trainer.estimate_gib:.2f})" if cuda and trainer.estimate_gib else "")
        + f" | host RSS {rss_gb:.2f} GiB")
    return row


def stop_and_checkpoint(cfg: argparse.Namespace, trainer: Trainer, tasks: Tasks, saves: Saves, ep: Epoch, epoch: int,
                        n_batches: int, stop: StopRequest) -> int:
    """Every rank stopped at the same step: checkpoint where we are (mid-epoch too), exit 75 (requeue)."""
    saved = save_progress(cfg, trainer, tasks, saves, epoch, ep.batches, n_batches, ep.step)
    log(f"stopping on {stop.signal or 'a signal to another task'} at epoch {epoch + 1}, "
        f"batch {ep.batches}/{n_batches}, step {ep.step}: "
        + (f"checkpoint saved to {cfg.save}; run again with --resume (the templates requeue) to go on" if saved
           else f"the checkpoint could not be saved: --resume goes on from the previous one in {cfg.save}"
           if cfg.save else "no --save given, so this progress is lost"))
    return StopRequest.EXIT_CODE


def finish(cfg: argparse.Namespace, trainer: Trainer, tasks: Tasks, history: list[dict], startup_s: float | None,
           cuda: bool, chance: tuple[float, float] = (0.5, 0.02)) -> None:
    """The replica check, the summary line and the JSON record; a run that ends at chance says so in both."""
    launch = tasks.launch
    gap = trainer.divergence()
    plans: list = [None] * launch.size  # where every task put its parts, for the record
    if launch.size > 1:
        dist.all_gather_object(plans, trainer.placement(launch), group=tasks.host_group)
    else:
        plans = [trainer.placement(launch)]
    log(f"replicas in sync: max parameter fingerprint difference {gap:.3g} over {trainer.dp_size} replica(s)")
    if not history:
        return
    best = max((r["samples_per_s"] for r in history if r["samples_per_s"]), default=None)
    total_s = time.time() - psutil.Process().create_time()
    gpu_name = torch.cuda.get_device_name(trainer.stats_device) if cuda else None
    speed = throughput(cfg, trainer, best, gpu_name)
    acc, (chance_acc, margin) = history[-1]["test_acc"], chance
    own = getattr(trainer, "own", None)
    learning = learning_run(trainer)  # a --model on synthetic batches measures speed only
    learned = acc > chance_acc + margin if learning else None
    log(f"summary: {trainer.name} layout, {trainer.dp_size} replica(s) x {trainer.nb_part} part(s), chunks "
        f"{cfg.chunks}, batch {cfg.batch_size}/replica: "
        + (f"{best:.1f} samples/s (best epoch){speed_text(speed, gpu_name, cfg)}, " if best else "")
        + (f"final test acc {acc:.3f}, " if learning else "speed only (synthetic batches), ")
        + f"total {total_s:.1f}s")
    if learning and not learned:
        log(f"warning: the model did not learn: final test acc {acc:.3f} is not clearly above chance (the test "
            f"set's majority class is {chance_acc:.3f}; above {chance_acc + margin:.3f} is 3 standard errors clear of "
            f"it). Its speed is real, its result is not: if the loss rose, lower --lr (now {cfg.lr:g}) or raise "
            f"--lr-warmup (now {cfg.lr_warmup:g}); if it fell, train longer")
    if cfg.json_out and launch.rank == 0:
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__, **trainer.record(),
                  "backend": dist.get_backend(), "device": "cuda" if cuda else "cpu",
                  "gpu_name": gpu_name, **speed, "learned": learned, "chance_acc": chance_acc, "learning": learning,
                  "loss_fn": "cross-entropy" if learning else SYNTHETIC_LOSS, "part_sizes": own and own.plan.sizes,
                  "nodes": launch.num_nodes, "tasks": launch.size, "tasks_per_node": launch.local_world_size,
                  "world_size": launch.size, "replicas": trainer.dp_size, "chunks": cfg.chunks,
                  "batch_size": cfg.batch_size, "global_batch": cfg.batch_size * trainer.dp_size,
                  **{a.dest: getattr(cfg, a.dest) for a in kit.arguments.ARGS
                     if a.group in ("model", "memory", "own")},
                  "architecture": ARCHITECTURE, "lr": cfg.lr, "lr_warmup": cfg.lr_warmup, "lr_decay": cfg.lr_decay,
                  "untimed_steps": cfg.untimed_steps,
                  "data": "synthetic" if cfg.synthetic else "imdb",
                  **({} if learning else {"data": "synthetic batches shaped like --sample"}), "job_id": launch.job_id,
                  "samples_per_s": best, "epoch_time_s": history[-1]["epoch_time_s"],
                  "peak_gpu_mem_gb": history[-1]["peak_gpu_mem_gb"], "host_rss_gb": history[-1]["host_rss_gb"],
                  "test_acc": history[-1]["test_acc"], "replica_divergence": gap, "plans": plans,
                  "startup_s": startup_s, "total_s": total_s, "epochs": history}
        write_record(cfg, record)

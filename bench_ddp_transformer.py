#!/usr/bin/env python
"""
Hybrid pipeline + data parallel training of a transformer classifier on IMDB: the IDRIS page's benchmark.
One task per model replica; each replica's model is split over the task's GPUs with a GPipe Pipe; the
replicas train together with DistributedDataParallel. Runs on current PyTorch (fairscale's Pipe) and on
torch <= 2.3 (the page's torch.distributed.pipeline.sync.Pipe), on GPUs (nccl) or on the CPU (gloo).

On a Slurm cluster (one task per replica; GPUs per task = GPUs per node // tasks per node):
    srun python check_topology.py --nlayers 16 --chunks 4 --batch-size 64     # pre-flight, then:
    srun python bench_ddp_transformer.py --nlayers 16 --chunks 4 --batch-size 64 --data-dir $DSDIR/IMDB
One machine:
    torchrun --nproc-per-node 2 bench_ddp_transformer.py --chunks 4
One replica, no GPU, no data (the synthetic corpus; the model still split in 2 parts on the CPU):
    python bench_ddp_transformer.py
The trainer's verdict on its arguments alone, without importing torch (docs/arguments.md):
    python bench_ddp_transformer.py --check-args --nlayers 16 --chunks 4 --batch-size 64
A task per GPU instead (torch.distributed.pipelining): bench_stage.py, the same model, data and loop.

This file is the page's code, in the page's order: the model (Encoder, Layer, Decoder: kit/train/transformer.py,
imported below), nb_part / first_part / last_part and the module_list loop (build_module_list), then main(): the
plan, the process group, the Pipe over module_list with --chunks and DDP over it (ddp_mp_model), saving and loading.
Those steps, and what the page does not have, are the trainers' runtime in kit/train/, one concern a module
(docs/architecture.md): the run from start to teardown (run), the process group and the tasks' meeting (launch),
this task's GPUs and CPUs (setup), the page's layout as a Trainer (replica: the Pipe, ddp_mp_model, the page's save
and load), the Pipe engines (pipe), the step both layouts share (trainer), the model builder (parts), precision,
checkpointing and ZeRO (options), the data and its cache (data), checkpoints and resume (checkpoint), the stop
signals (signals), the loop (loop), the JSON record (records). The plan and the checks are the checker's own
(kit.plan, kit.trainer_checks).
"""
from __future__ import annotations

import sys

# The stop signals (SIGUSR1 before the time limit, SIGTERM, SIGINT) are held from here, the first statements: they
# can come while torch imports or the tasks meet, where their default actions would kill the task and the job would
# not be requeued (kit/train/signals.py, the standard library only, says how they are acted on).
try:
    from kit.train.signals import hold_stop_signals
except ImportError as exc:  # copied alone: the kit is a folder (README, step 2)
    sys.exit(f"bench_ddp_transformer: error: {exc}: copy the kit's whole folder (the scripts and kit/ beside them)")
if __name__ == "__main__":
    hold_stop_signals()

if __name__ == "__main__" and "--check-args" in sys.argv[1:]:  # judge the arguments as main() does, without torch
    import kit.trainer_checks
    sys.exit(kit.trainer_checks.check_args_main("replica", sys.argv[1:]))

import argparse

import torch
import torch.nn as nn

try:  # before kit.train, which uses it
    import psutil  # noqa: F401 (kit.train uses it)
except ImportError:  # a cluster's PyTorch module brings torch, not this: one line, not a traceback
    sys.exit("bench_ddp_transformer: error: psutil is missing (it measures memory and start-up): "
             "pip install --user psutil")

import kit.arguments
import kit.plan
import kit.trainer_checks
from kit.train.errors import cli
from kit.train.own import resolve_model
from kit.train.pipe import pick_engine
from kit.train.replica import Replica
from kit.train.run import run
from kit.train.setup import make_plan, resolve, use_gpus
# the model of the page: Encoder on the task's first GPU, Layer blocks split by the plan, Decoder on its last
from kit.train.transformer import Decoder, Encoder, Layer

PROG = "bench_ddp_transformer"


# the page's path, in its order
def build_module_list(cfg: argparse.Namespace, plan: kit.plan.TaskPlan) -> list[nn.Sequential]:
    """The page's loop: one nn.Sequential per part, each on its GPU. The plan comes from check_topology (the
    checker approves exactly what runs). Modules are created in the same order whatever the split, so one seed
    gives one model (the stage layout's, kit.train.transformer.module_list: tests/test_page.py holds them equal)."""
    # The number of parts into which the model will be sharded.
    # page: nb_part = torch.cuda.device_count() // int(os.environ['SLURM_NTASKS_PER_NODE'])
    # kit: the same, or --nb-part, or the GPUs Slurm bound to this task (--gpus-per-task)
    nb_part = plan.nb_part
    # The GPU I.D. number into which the first part of the model will go.
    # page: first_part = idr_torch.local_rank * nb_part    kit: the same, or 0 when Slurm bound GPUs per task
    first_part = plan.first_part
    # The GPU I.D. number into which the last part of the model will go.   page: first_part + nb_part - 1
    last_part = plan.last_part
    # page: partition_len = max(nlayers / nb_part, 1), a float: with nlayers % nb_part != 0 it puts layers of
    # two GPUs in one partition. kit: a balanced integer split, the page's own whenever nlayers % nb_part == 0.
    layer_part = kit.plan.split_layers(cfg.nlayers, nb_part)  # the part of each Layer block
    gpu = (lambda index: "cpu") if plan.cpu else (lambda index: f"cuda:{index}")

    module_list = []
    # The encoder will always be loaded by the first GPU
    tmp_list = [Encoder(cfg.vocab_size, cfg.d_model, cfg.dropout, cfg.seq_len).to(gpu(first_part))]
    # Add all the model transformer blocks; they will be loaded by the appropriate GPU
    for i in range(cfg.nlayers):
        transformer_block = Layer(cfg.d_model, cfg.n_head, cfg.d_hid, cfg.dropout, cfg.activation_checkpointing)
        if i != 0 and layer_part[i] != layer_part[i - 1]:
            module_list.append(nn.Sequential(*tmp_list))
            tmp_list = []
        device = layer_part[i]
        # page: .to(first_part + device); plan.devices[device] is that GPU (or the one --devices names)
        tmp_list.append(transformer_block.to(gpu(plan.devices[device] if plan.devices else first_part + device)))
    # The model's head always goes into the last GPU (the checker refuses nlayers < nb_part: no part is empty)
    tmp_list.append(Decoder(cfg.d_model, cfg.d_hid).to(gpu(last_part)))
    module_list.append(nn.Sequential(*tmp_list))
    return module_list


def main(argv: list[str] | None = None) -> int:
    """Arguments and check_topology's verdict before anything is started, then the page's steps: the process group
    (dist.init_process_group, and init_rpc for torch <= 2.3's Pipe: kit.train.run), the module_list above under
    --precision's autocast, `model = Pipe(nn.Sequential(*module_list), chunks=args.chunks, checkpoint="never")`, any
    --load (`model.load_state_dict(torch.load(path))` on every task), `ddp_mp_model = DistributedDataParallel(model)`
    (kit.train.replica.Replica), the training, and `torch.save(ddp_mp_model.module.state_dict(), path)` on rank 0."""
    cfg = parse_args(argv)
    if cfg.check_args:
        return kit.trainer_checks.check_args_main("replica", sys.argv[1:] if argv is None else argv)
    cuda = torch.cuda.is_available()
    resolve(cfg, cuda)
    plan = make_plan(cfg, cuda)  # nb_part, first_part, last_part of this task, or one clear error
    own = resolve_model(cfg, plan.nb_part)  # --model: loads, takes --sample, fills the parts; else exit 2
    if own:
        plan.own = own.plan.contents
    engine = pick_engine(cfg.engine)
    gpus = use_gpus(plan)  # torch.cuda.set_device(first_part), before anything touches CUDA
    return run(cfg, cuda, engine, gpus, lambda tasks: Replica(cfg, plan, engine, own, build_module_list), PROG)


# Beyond the page: arguments, data and cache, checks, checkpoints and resume, stop signals, the training loop
# (shared with bench_stage.py), the replica fingerprint, the JSON record: kit/train/.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, from check_topology's one definition of them (kit.arguments.ARGS: names, types, ranges, GPU and
    CPU defaults); a line it refuses raises kit.arguments.ArgumentError, one line that cli() prints (exit 2)."""
    return kit.arguments.parse_trainer_args("replica", argv, __doc__)


if __name__ == "__main__":
    cli(main, PROG)

"""A trainer's run, from what each task checks alone to the last teardown, the same for both layouts: the files
checked (the outputs, the lock, the data), the tasks meeting (the rendezvous, the process group: kit.train.launch),
their verdicts agreed, RPC where torch <= 2.3's Pipe needs it, the Trainer built and trained (kit.train.loop), and
whatever was built torn down on every exit path (a Pipe left alive hangs the process at exit).
Owns: run(). Imports: idr_torch, kit.findings, kit.train.checkpoint, kit.train.data, kit.train.errors,
kit.train.launch, kit.train.loop, kit.train.pipe, kit.train.setup, kit.train.trainer.
"""
from __future__ import annotations

import argparse
import gc
import socket
import traceback
import warnings
from typing import Callable

import torch
import torch.distributed as dist

import idr_torch
from kit.findings import first_line
from kit.train.checkpoint import SaveLock, check_outputs, real_paths
from kit.train.data import data_source
from kit.train.errors import LostContact, RunError, log
from kit.train.launch import Tasks, check_rendezvous, init_distributed, is_comm_error, rendezvous_deadline
from kit.train.loop import train
from kit.train.pipe import init_rpc_for_pipe
from kit.train.setup import cores_notice, cpu_threads
from kit.train.trainer import Trainer

# torch 2.3's DDP warns about its own internal use of the gloo backend object; nothing a user can act on
warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")

def run(cfg: argparse.Namespace, cuda: bool, engine: str, gpus: list[int], make_trainer: Callable[[Tasks], Trainer],
        prog: str) -> int:
    """init_process_group, init_rpc where the engine needs it, the model (make_trainer), train(); then tear down
    whatever was built, on every exit path. `gpus`: this task's (kit.train.setup.use_gpus); `prog`: the trainer's
    name in its error lines."""
    launch = idr_torch.current()
    lock = trainer = rpc_file = None
    try:
        problem, source = None, None
        try:  # what this task writes or reads alone: said after the tasks meet, by agree(). Every error here is
            # carried to the meeting: a task that ended before it would leave the others waiting for --timeout
            real_paths(cfg)
            if launch.rank == 0:  # rank 0 writes --save and --json-out
                check_outputs(cfg)
                lock = SaveLock.take(cfg.save) if cfg.save else None
            source = data_source(cfg)
        except RunError as exc:
            problem = str(exc)
        except Exception as exc:  # not one of the kit's (a bug): its traceback here, and the others told at once
            if launch.size == 1:
                raise
            traceback.print_exc()
            problem = f"{type(exc).__name__}: {first_line(exc)[:200]} (its traceback is above)"
        torch.set_num_threads(cpu_threads(launch))
        if cores_notice(launch):
            log(cores_notice(launch))
        # --tf32: fp32 matmuls on TF32 tensor cores where the GPU has them (compute capability >= 8.0); off by
        # default (torch's own default since 1.12, and the page's), nothing to do on the CPU or a V100
        torch.backends.cuda.matmul.allow_tf32 = bool(cfg.tf32)
        check_rendezvous(launch, cfg.timeout)
        with rendezvous_deadline(launch, cfg.timeout, prog):
            tasks = init_distributed(cfg.timeout, cuda, gpus, prog)
        tasks.agree(problem)
        rpc_file = init_rpc_for_pipe() if engine == "torch-pipe" else None
        trainer = make_trainer(tasks)
        return train(cfg, trainer, tasks, source, cuda)
    except RuntimeError as exc:
        if launch.size > 1 and is_comm_error(exc):
            raise LostContact(f"task {launch.rank} on {socket.gethostname()} lost contact with the others "
                              f"({first_line(exc)[:200]}): a task died or hung, so every task stops instead of "
                              f"waiting for the time limit; start again with --resume to continue from the last "
                              f"checkpoint") from None
        raise
    finally:
        if trainer is not None:
            trainer.close()
        del trainer
        gc.collect()
        if rpc_file is not None:
            import torch.distributed.rpc as rpc
            rpc.shutdown(graceful=False)
            rpc_file.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        if lock is not None:
            lock.release()

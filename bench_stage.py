#!/usr/bin/env python
"""
The stage layout: the same model and training loop as bench_ddp_transformer.py, a different process layout.
One task per GPU; `--pp` consecutive tasks form one pipeline (torch.distributed.pipelining: PipelineStage and
a schedule, --schedule gpipe|1f1b|interleaved1f1b|loopedbfs|interleavedzerobubble|zbvzerobubble|dualpipev); DDP
over each stage's group of pipelines (the zero-bubble schedules: one all-reduce a stage after the step): a 2-D
mesh (dp, pp) as in torchtitan. Needs torch >= 2.4. Checkpoints have bench_ddp_transformer.py's keys, so they
move between the two layouts.

On a Slurm cluster (a task per GPU):
    srun python check_topology.py --layout stage --pp 2 --schedule 1f1b    # pre-flight, then:
    srun python bench_stage.py --pp 2 --schedule 1f1b --chunks 8 --batch-size 128 --data-dir $DSDIR/IMDB
One machine, no GPU:
    torchrun --nproc-per-node 4 bench_stage.py --pp 2
The trainer's verdict on its arguments alone, without importing torch (docs/arguments.md):
    srun python bench_stage.py --check-args --pp 2 --schedule 1f1b --chunks 8
"""
from __future__ import annotations

import sys

# The stop signals (SIGUSR1 before the time limit, SIGTERM, SIGINT) are held from here, the first statements: they
# can come while torch imports or the tasks meet, where their default actions would kill the task and the job would
# not be requeued (kit/train/signals.py, the standard library only, says how they are acted on).
try:
    from kit.train.signals import hold_stop_signals
except ImportError as exc:  # copied alone: the kit is a folder (README, step 2)
    sys.exit(f"bench_stage: error: {exc}: copy the kit's whole folder (the scripts and kit/ beside them)")
if __name__ == "__main__":
    hold_stop_signals()

if __name__ == "__main__" and "--check-args" in sys.argv[1:]:  # judge the arguments as main() does, without torch
    import kit.trainer_checks
    sys.exit(kit.trainer_checks.check_args_main("stage", sys.argv[1:]))

import argparse  # noqa: E402
import inspect  # noqa: E402
import os  # noqa: E402

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import kit.arguments
import kit.findings
import kit.plan
import kit.schedules
import kit.trainer_checks
import idr_torch
from kit.train import options  # its optimizer_state: Stages has its own method of that name
from kit.train.errors import RunError, cli
from kit.train.launch import Tasks, Watchdog  # shared: a rank blocked in a pipelining receive waits forever
from kit.train.options import make_optimizer, memory_estimate, options_text
from kit.train.own import OwnModel, own_memory_estimate, resolve_model, stage_io
from kit.train.parts import model_parts
from kit.train.run import run
from kit.train.setup import cpu_placement, resolve, task_plan, use_gpus, verdict
from kit.train.trainer import Trainer, divergence, fingerprint, step_functions

PROG = "bench_stage"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, from check_topology's one definition of them (the stage layout's: --pp, --schedule,
    --virtual-stages instead of --nb-part, --engine, --devices)."""
    return kit.arguments.parse_trainer_args("stage", argv, __doc__)


def make_plan(cfg: argparse.Namespace, cuda: bool) -> kit.plan.TaskPlan:
    """A GPU per task; check_topology's verdict on the pipelines and the batch, before any process group."""
    findings = kit.findings.Findings()
    plan = task_plan(cuda, cfg.nlayers, 1, findings)
    kit.trainer_checks.check_trainer_task("stage", cfg, plan, idr_torch.current(), cuda, torch.__version__, findings)
    verdict(findings)
    return plan


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if cfg.check_args:
        return kit.trainer_checks.check_args_main("stage", sys.argv[1:] if argv is None else argv)
    cuda = torch.cuda.is_available()
    resolve(cfg, cuda)
    plan = make_plan(cfg, cuda)
    # --model: loads, takes --sample, fills one pipeline's stages (else exit 2), before any process group
    own = resolve_model(cfg, cfg.pp * kit.schedules.stages_per_rank(cfg.schedule, cfg.virtual_stages), "stage")
    gpus = use_gpus(plan)  # torch.cuda.set_device(the task's GPU), before anything touches CUDA
    return run(cfg, cuda, "pipelining", gpus, lambda tasks: Stages(cfg, plan, cuda, tasks, own), PROG)


class Stages(Trainer):
    """Beyond the page: one task per GPU, torch.distributed.pipelining (PipelineStage + a schedule) across the
    `pp` tasks of a pipeline, DDP across the dp pipelines over each stage's group: a 2-D mesh (dp, pp) as in
    torchtitan. Consecutive ranks form a pipeline, so its stages stay on one node when tasks per node allow.
    `tasks`: the run's (kit.train.launch.init_distributed), whose CPU-side group gathers the checkpoint."""
    name = "stage"
    engine = "pipelining"
    equal_batches = True  # the schedules want every batch the same size

    def __init__(self, cfg: argparse.Namespace, plan: kit.plan.TaskPlan, cuda: bool, tasks: Tasks,
                 own: OwnModel | None = None) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        self.cfg, self.plan, self.tasks, self.own = cfg, plan, tasks, own
        self.row = kit.schedules.schedule(cfg.schedule)  # its torch class, its stages a task (kit.schedules)
        self.pp, self.virtual = cfg.pp, self.row.stages_per_rank(cfg.virtual_stages)
        self.dp_size = idr_torch.size // self.pp
        self.nb_part = self.pp * self.virtual  # stages of one pipeline = parts of one replica
        # One GPU per task, set before the mesh (main's use_gpus): init_device_mesh sets a device only when it creates
        # the default group itself (rank % GPUs per node, _get_or_create_default_group, 2.4.1 to 2.13), and
        # init_distributed bound the nccl group to this GPU (device_id=), so the mesh's dp and pp groups are split
        # from it (split_group, where the release has it) and every collective below runs on it: DDP per stage
        # over the dp group, the schedules' send/recv over the pp group (a communicator per pair, on
        # PipelineStage's device), the shape inference's objects (device=self.device).
        self.device = torch.device(plan.device(0))
        self.mesh = init_device_mesh("cuda" if cuda else "cpu", (self.dp_size, self.pp), mesh_dim_names=("dp", "pp"))
        self.pp_rank, self.dp_rank = self.mesh["pp"].get_local_rank(), self.mesh["dp"].get_local_rank()
        self.ids = self.row.stages(self.pp_rank, self.pp, self.virtual)
        self.first_holder, self.last_holder = 0 in self.ids, self.nb_part - 1 in self.ids
        self.stats_device = self.device
        # Build the whole replica on the CPU with the replica layout's seed and order, keep our stages: the same
        # initial weights as bench_ddp_transformer.py, and the same state_dict keys.
        cpu_plan = kit.plan.plan_task(0, 0, 0, 1, [], None, cfg.nlayers, self.nb_part)
        # --model: the user's layers cut by the checker's split (kit.train.parts), a stage a part
        module_list = model_parts(cfg, cpu_plan, own)
        self.loss_fn, self.stats_fn = step_functions(own)
        self.param_counts = [len(list(m.parameters())) for m in module_list]
        self.total_params = sum(p.numel() for m in module_list for p in m.parameters())
        self.modules = {s: contiguous_io(module_list[s].to(self.device)) for s in self.ids}
        del module_list
        # --zero: each stage's AdamW sharded over that stage's replicas (the dp group)
        self.optimizers = {s: make_optimizer(m.parameters(), cfg.lr, cfg.zero,
                                                               self.mesh["dp"].get_group())
                           for s, m in self.modules.items()}
        self.memory, self.estimate_gib = (own_memory_estimate if own else memory_estimate)(
            cfg, plan, self.pp, self.dp_size, layout="stage", pp=self.pp, schedule=cfg.schedule,
            virtual_stages=cfg.virtual_stages)
        self.schedule = None

    def describe(self) -> str:
        contents = self.own.plan.contents if self.own else kit.plan.part_contents(self.cfg.nlayers, self.nb_part)
        return (f"{self.dp_size} pipeline(s) x pp {self.pp} ({self.virtual} stage(s) per task), schedule "
                f"{self.cfg.schedule}, {options_text(self.cfg, self.dp_size)}; rank 0 holds "
                + " | ".join(f"stage {s}: {contents[s]}" for s in self.ids)
                + f" on {self.device}")

    def load(self, model_state: dict, optimizer_state: dict | None) -> None:
        pieces = split_optimizer_state(optimizer_state, self.param_counts) if optimizer_state else None
        for s, m in self.modules.items():
            prefix = f"{s}."
            m.load_state_dict({k[len(prefix):]: v for k, v in model_state.items() if k.startswith(prefix)})
            if pieces:
                self.optimizers[s].load_state_dict(pieces[s])

    def start(self) -> None:
        from torch.distributed import pipelining
        self.watchdog, self.steps = Watchdog(self.cfg.timeout, idr_torch.rank, "bench_stage"), 0
        dp_group, pp_group = self.mesh["dp"].get_group(), self.mesh["pp"].get_group()
        # The schedule runs one backward per micro-batch (no_sync on all but the last). DDP's first-iteration
        # bucket rebuild then counts every parameter once per micro-batch and fails an internal assert
        # (torch 2.13); static_graph=True runs but leaves the replicas apart (seen with the fingerprint check).
        # find_unused_parameters=True skips that rebuild: one more graph traversal per backward, replicas equal.
        # The zero-bubble schedules split each backward (I, then W later: kit.schedules.split_backward), which DDP's
        # hooks don't follow: their stages hold the bare modules, and reduce_split_gradients averages the gradients
        # over the replicas after the step.
        self.split = kit.schedules.split_backward(self.cfg.schedule)
        wrap = ((lambda m: m) if self.split else
                (lambda m: DistributedDataParallel(m, process_group=dp_group, find_unused_parameters=True)))
        self.ddp = {s: wrap(m) for s, m in self.modules.items()}
        stages = [pipelining.PipelineStage(self.ddp[s], s, self.nb_part, self.device,
                                           *self.example_io(pipelining, s), group=pp_group) for s in self.ids]
        cls = getattr(pipelining, self.row.torch_class, None)
        if cls is None:
            raise RunError(f"--schedule {self.cfg.schedule}: this torch ({torch.__version__}) has no "
                           f"{self.row.torch_class}; use gpipe or 1f1b")
        self.eval_schedule = self.forward_only_schedule(pipelining, pp_group)
        # scale_grads (the mean over micro-batches, on by default) is a schedule argument in 2.8.0 and later; 2.4.1
        # and 2.6.0 have none and their gradients are the micro-batches' sum
        self.scales_grads = "scale_grads" in inspect.signature(cls.__init__).parameters
        try:
            # a multi-stage schedule (the table's word: a PipelineScheduleMulti) takes the list of its stages
            self.schedule = cls(stages if self.row.multi_stage else stages[0], n_microbatches=self.cfg.chunks,
                                loss_fn=self.loss_fn)
        except ValueError as exc:
            raise RunError(f"--schedule {self.cfg.schedule} with --chunks {self.cfg.chunks} and --pp {self.pp}: "
                           f"{exc}") from None

    def example_io(self, pipelining, s: int) -> tuple[torch.Tensor, ...]:
        """Stage s's input and output for one micro-batch (meta tensors) where PipelineStage requires them: torch 2.4
        (input_args has no default in 2.4.1's stage.py). Later releases infer them, and 2.13 given them wants the
        gradients' shapes too, so they get none."""
        param = inspect.signature(pipelining.PipelineStage.__init__).parameters.get("input_args")
        if param is None or param.default is not inspect.Parameter.empty:
            return ()
        mb, cfg = self.cfg.batch_size // self.cfg.chunks, self.cfg
        if self.own:
            return stage_io(self.own, s, mb)
        act = torch.empty(mb, cfg.seq_len, cfg.d_model, device="meta")
        first = torch.empty(mb, cfg.seq_len, dtype=torch.long, device="meta")
        return (first if s == 0 else act), (torch.empty(mb, 2, device="meta") if s == self.nb_part - 1 else act)

    def forward_only_schedule(self, pipelining, pp_group):
        """Evaluation where the schedules have no eval() (2.4.1 to 2.8.0; 2.13.0 has it), or where it fails (the V
        schedules: 2.13's eval() still runs their I and B actions, and a V's local hand-over of a gradient asserts,
        stage.py get_local_bwd_output): stages over the bare modules (no DDP hooks under no_grad) and a schedule
        without loss_fn, which runs no backward; a V's keeps only its forwards."""
        if hasattr(pipelining.ScheduleGPipe, "eval") and self.row.placement != "v":
            return None
        stages = [pipelining.PipelineStage(self.modules[s], s, self.nb_part, self.device,
                                           *self.example_io(pipelining, s), group=pp_group) for s in self.ids]
        if self.row.placement == "v":
            return v_forward_only(getattr(pipelining, self.row.torch_class)(stages, n_microbatches=self.cfg.chunks))
        one = len(stages) == 1  # fill and drain: GPipe for a stage a task, LoopedBFS for several
        fill_drain = getattr(pipelining, kit.schedules.SCHEDULES["gpipe" if one else "loopedbfs"].torch_class)
        return fill_drain(stages[0] if one else stages, n_microbatches=self.cfg.chunks)

    def _run(self, x: torch.Tensor, y: torch.Tensor, run) -> torch.Tensor | None:
        args = (x.to(self.device, non_blocking=True),) if self.first_holder else ()
        target = y.to(self.device, non_blocking=True) if self.last_holder else None
        return run(*args, target=target, losses=self._losses) if self.last_holder else run(*args)

    def all_optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.optimizers.values())

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The schedule's step over the micro-batches: inputs to the first stage only, the loss and accuracy from the
        last (zeros elsewhere)."""
        self._losses: list[torch.Tensor] = []
        out = self._run(x, y, self.schedule.step)
        if not self.scales_grads:  # the micro-batches' gradients were added up: make them their mean
            for m in self.modules.values():
                for p in m.parameters():
                    if p.grad is not None:
                        p.grad.div_(self.cfg.chunks)
        if self.split and self.dp_size > 1:
            self.reduce_split_gradients()
        if not self.last_holder:  # inputs go to the first stage only; loss and accuracy live on the last
            return torch.zeros(3, device=self.device)
        y = y.to(self.device, non_blocking=True)
        loss = torch.stack([l.detach() for l in self._losses]).mean()
        return self.stats_fn(loss, out.detach(), y)

    @torch.no_grad()
    def reduce_split_gradients(self) -> None:
        """DDP's work for the zero-bubble schedules: each stage's gradients averaged over its replicas (the dp
        group), one flat all-reduce per stage after the step's last W (DDP's buckets would fire at the first B)."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        group = self.mesh["dp"].get_group()
        for m in self.modules.values():
            grads = [p.grad for p in m.parameters() if p.grad is not None]
            if not grads:
                continue
            flat = _flatten_dense_tensors(grads).div_(self.dp_size)
            dist.all_reduce(flat, group=group)
            for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)

    @torch.no_grad()
    def eval_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for m in self.modules.values():
            m.eval()
        self._losses = []
        if self.eval_schedule is None:
            out = self._run(x, y, self.schedule.eval)
        else:
            out = self.eval_schedule.step(*((x.to(self.device, non_blocking=True),) if self.first_holder else ()))
        self.watchdog.tick(self.steps)
        for m in self.modules.values():
            m.train()
        if not self.last_holder:
            return torch.zeros(2, device=self.device)
        y = y.to(self.device, non_blocking=True)
        return self.stats_fn(None, out, y)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def peak_memory_gb(self) -> float:
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else 0.0

    def state(self) -> tuple[dict, dict] | None:
        """Consolidated on rank 0 (a collective; the other ranks get None): the first pipeline's stages, under
        bench_ddp_transformer.py's keys, so a checkpoint moves between the layouts. Under --zero each stage's
        optimizer shards are first consolidated on its dp rank 0 (a collective over the dp group)."""
        dp_group = self.mesh["dp"].get_group()
        optimizers = {s: options.optimizer_state(o, dp_group) for s, o in self.optimizers.items()}
        mine = {s: ({k: v.cpu() for k, v in m.state_dict().items()}, optimizers[s])
                for s, m in self.modules.items()} if self.dp_rank == 0 else {}
        everyone: list | None = [None] * dist.get_world_size() if idr_torch.rank == 0 else None
        dist.gather_object(mine, everyone, dst=0, group=self.tasks.host_group)
        if everyone is None:
            return None
        by_stage = {s: v for d in everyone for s, v in d.items()}
        model = {f"{s}.{k}": v for s in sorted(by_stage) for k, v in by_stage[s][0].items()}
        return model, merge_optimizer_states([by_stage[s][1] for s in sorted(by_stage)])

    def divergence(self) -> float:
        fp = fingerprint([self.modules[s] for s in self.ids]).to(self.device)
        return divergence(fp, self.mesh["dp"].get_group(), self.dp_size)

    def placement(self, launch: idr_torch.Launch) -> dict:
        return {"rank": launch.rank, "node": launch.node_id, "host": os.uname().nodename, "stages": self.ids,
                "pp_rank": self.pp_rank, "dp_rank": self.dp_rank, "nb_part": 1, "devices": [str(self.device)],
                "node_gpus": self.plan.node_gpus, **cpu_placement(launch)}

    def record(self) -> dict:
        return {"layout": self.name, "engine": self.engine, "nb_part": self.nb_part, "pp": self.pp,
                "schedule": self.cfg.schedule, "gpus": idr_torch.size, "estimated_mem_gb": self.estimate_gib}

    def close(self) -> None:
        self.schedule = self.eval_schedule = None
        if getattr(self, "watchdog", None):
            self.watchdog.stop()



class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous: a stage's input gradient is sent to the stage
    before it, and a layer that transposes its input gives a transposed gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def contiguous_io(module: torch.nn.Module) -> torch.nn.Module:
    """What a stage sends made contiguous: its output (forward) and its input's gradient (backward). gloo's send
    and recv take contiguous tensors only ("input tensor has to be contiguous": ProcessGroupGloo.cpp's
    checkSingleTensor; nccl's check_gpu_single_tensor too), and torch.distributed.pipelining sends the stage's
    outputs as they are and allocates the next stage's receive buffers with their strides (stage.py, 2.13): a layer
    returning x.transpose(1, 2) (ViT's patch embedding, an LSTM's batch_first swap) fails there. Hooks on the
    stage's own module: DDP and the evaluation's bare stages both run them, and the state_dict keys stay the replica
    layout's. A contiguous tensor is returned as it is (no copy)."""
    def inputs(_: torch.nn.Module, args: tuple) -> tuple:
        return tuple(_ContiguousGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)

    def output(_: torch.nn.Module, args: tuple, out: object) -> object:
        return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.contiguous(), out)
    module.register_forward_pre_hook(inputs)
    module.register_forward_hook(output)
    return module


def _letter(action) -> str:
    """An action's kind as torch prints it (F, I, W, B, ...): _ComputationType's value is the letter from 2.9 and a
    number before it (2.8's schedules.py), whose str() is the letter."""
    kind = action.computation_type
    return kind.value if isinstance(kind.value, str) else str(kind)


def v_forward_only(schedule):
    """A V schedule (torch 2.13's _PipelineScheduleRuntime) lowered again with its forwards alone: each task's
    forwards in the schedule's own order, their sends and receives added by the lowering of
    _prepare_schedule_with_comms (_add_send_recv, private; its validation wants every backward, so not it)."""
    from torch.distributed.pipelining.schedules import _add_send_recv
    order = {r: [a for op in ops if op is not None for a in (getattr(op, "sub_actions", None) or (op,))  # OVERLAP_F_B (2.9+): its F, B
                 if _letter(a) == "F"] for r, ops in schedule.pipeline_order.items()}
    schedule.pipeline_order = order
    schedule.pipeline_order_with_comms = _add_send_recv(order, lambda s: schedule.stage_index_to_group_rank[s],
                                                        schedule._num_stages)
    return schedule


def split_optimizer_state(state: dict, counts: list[int]) -> list[dict]:
    """A whole-model AdamW state (parameters numbered in module order) cut into consecutive pieces of
    `counts` parameters, each renumbered from 0: one per pipeline stage."""
    pieces, start = [], 0
    for n in counts:
        group = {k: v for k, v in state["param_groups"][0].items() if k != "params"}
        pieces.append({"state": {i - start: v for i, v in state["state"].items() if start <= i < start + n},
                       "param_groups": [dict(group, params=list(range(n)))]})
        start += n
    return pieces


def merge_optimizer_states(pieces: list[dict]) -> dict:
    """The inverse of split_optimizer_state."""
    merged, start = {"state": {}, "param_groups": []}, 0
    for piece in pieces:
        merged["state"].update({i + start: v for i, v in piece["state"].items()})
        start += len(piece["param_groups"][0]["params"])
    group = {k: v for k, v in pieces[0]["param_groups"][0].items() if k != "params"}
    merged["param_groups"] = [dict(group, params=list(range(start)))]
    return merged



if __name__ == "__main__":
    cli(main, PROG)

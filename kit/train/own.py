"""The trainers' side of --model (issue 34): the user's layers checked before any process group (kit.own_split's
plan, the checker's own; kit.train.parts builds them for real and cuts them by that split for either layout), their
checkpointing; the data and the loss: a model that takes token ids (--sample BxS) and returns the kit's 2 classes'
logits trains on the kit's data and reports accuracy, any other one runs on synthetic batches drawn like --sample
with a stand-in loss, and the run says it measures speed, not learning.
Owns: OwnModel, resolve_model, recompute_in_backward, the synthetic batches and loss.
Imports: kit.arguments, kit.memory, kit.model, kit.own_model, kit.own_split, kit.plan, kit.train.errors,
kit.train.options, kit.train.signals.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import kit.arguments
import kit.memory
import kit.plan
from kit.model import default_sample, is_token_ids
from kit.own_split import ModelPlan, plan_model
from kit.train.errors import RunError
from kit.train.options import device_arch, training_of
from kit.train.signals import stoppable

NCLASSES = 2  # the kit's task: a review's two classes (kit.train.transformer.Decoder's head)

SYNTHETIC_STEPS = 16  # an epoch of synthetic batches: --epochs and --max-steps set the run's length

SYNTHETIC_LOSS = "the mean square of the model's output"  # said in the run's line and its record


@dataclass
class OwnModel:
    """A --model run: the plan both layouts cut the layers by, and what its data is."""
    plan: ModelPlan
    sample_shape: list[int]  # one sample (the sample's batch dimension dropped)
    sample_dtype: torch.dtype
    out_shapes: list[list[int]]  # each layer's output per sample, as measured (kit.model.LayerCost.out_shape)
    kit_data: bool  # token ids in, the kit's 2 logits out: the kit's data, accuracy, learning

    @property
    def learning(self) -> bool:
        return self.kit_data


def resolve_model(cfg: argparse.Namespace, nb_part: int, layout: str = "replica") -> OwnModel | None:
    """--model's verdict, on every task before any process group (the same verdict everywhere, rank 0 says it:
    ArgumentError, exit 2): it loads, is a sequence, takes --sample, has nb_part layers at least. Sets what the rest
    of the run reads of it: --sample's default, --seq-len from a token-id sample, nlayers and the split's sizes."""
    if not cfg.model_spec:  # (--sample or --split without it: check_arguments refused them with the checker)
        return None
    from kit import own_model  # here: a run of the kit's own model never imports the measuring machinery
    cfg.sample = cfg.sample or default_sample(cfg.batch_size, cfg.seq_len)
    try:  # a first measurement of a large model takes minutes: a stop signal then ends the run at once (issue 42)
        with stoppable(f"measuring --model {cfg.model_spec} (its first run; later runs read the cache)"):
            plan = plan_model(cfg.model_spec, cfg.sample, nb_part, cfg.split, max(1, cfg.batch_size // cfg.chunks),
                              cfg.chunks, cfg.precision, cfg.activation_checkpointing, layout, isolated=False)
        x = own_model.sample_batch(cfg.sample)()
    except own_model.ModelError as exc:
        raise kit.arguments.ArgumentError(str(exc)) from None
    shapes = [c.out_shape for c in plan.model.costs]
    kit_data = is_token_ids(cfg.sample) and plan.model.classes == NCLASSES
    if kit_data:
        cfg.seq_len = x.shape[1]  # the reviews are cut to the length the model takes
        check_vocabulary(cfg)
    cfg.nlayers, cfg.model_sizes = len(plan.names), plan.sizes  # the checkpoint's layout (layout_of)
    if not kit_data and not cfg.synthetic:  # no review is read (data_source would look for IMDB and say it found none)
        cfg.synthetic = SYNTHETIC_STEPS * cfg.batch_size
    return OwnModel(plan, list(x.shape[1:]), x.dtype, shapes, kit_data)


def check_vocabulary(cfg: argparse.Namespace) -> None:
    """The kit's data gives token ids below --vocab-size: a first embedding with fewer rows would fail at the first
    step (an index error on the CPU, a device-side assert on a GPU). Said before any process group, with the fix."""
    from kit import own_model
    layers, _ = own_model.build_layers(cfg.model_spec, device="meta")
    rows = next((m.num_embeddings for m in layers[0].modules() if isinstance(m, nn.Embedding)), None)
    if rows is not None and rows < cfg.vocab_size:
        raise kit.arguments.ArgumentError(
            f"--model {cfg.model_spec}: its first embedding has {rows} rows but the kit's data gives token ids up to "
            f"--vocab-size {cfg.vocab_size}; add --vocab-size {rows} (or build the embedding with "
            f"{cfg.vocab_size} rows)")




def recompute_in_backward(layer: nn.Module) -> None:
    """--activation-checkpointing for a user's layer: it keeps only its input for the backward and recomputes the
    rest there, as the kit's CheckpointedLayer (kit.train.transformer: non-reentrant torch.utils.checkpoint, which DDP
    supports, and the Pipe's own checkpoint= stays "never"). The layer's forward is replaced on the instance, not
    wrapped: the state_dict keys stay those of the plain model, so checkpoints move between the two."""
    plain = layer.forward

    def forward(*args: object, **kwargs: object) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return plain(*args, **kwargs)
        return checkpoint(plain, *args, use_reentrant=False, **kwargs)

    layer.forward = forward


def own_memory_estimate(cfg: argparse.Namespace, plan: kit.plan.TaskPlan, nb_part: int, replicas: int,
                        **layout: object) -> tuple[str, float | None]:
    """The checker's estimate of one GPU's peak for this --model run (kit.own_split.own_memory: the layers' figures
    composed with kit.memory's terms), with this device's kernels: the start-up line and the worst GPU's GiB."""
    from kit.own_split import own_memory
    arch, gpu_gib = device_arch(plan)
    t = training_of(cfg, **layout)
    try:
        parts = own_memory(t, nb_part, replicas, arch, cpu=plan.cpu, isolated=False)
    except kit.memory.NotEstimated as exc:
        return f"memory estimate: none, {exc}", None
    return (kit.memory.format_memory(parts, gpu_gib) + f" ({arch} kernels)",
            max(p.total for p in parts) / kit.memory.GIB)


def synthetic_corpus(cfg: argparse.Namespace, own: OwnModel, replicas: int) -> dict:
    """Batches drawn like --sample (its shape and dtype; floats from N(0, 1), integers 0): SYNTHETIC_STEPS steps'
    worth for training, one for the evaluation, labels 0 (the stand-in loss reads none)."""
    g = torch.Generator().manual_seed(cfg.seed)

    def draw(n: int) -> torch.Tensor:
        shape = [n, *own.sample_shape]
        if own.sample_dtype.is_floating_point:
            return torch.randn(shape, generator=g).to(own.sample_dtype)
        return torch.zeros(shape, dtype=own.sample_dtype)
    n_train, n_test = SYNTHETIC_STEPS * cfg.batch_size * replicas, cfg.batch_size * replicas
    return {"train_x": draw(n_train), "train_y": torch.zeros(n_train, dtype=torch.int64),
            "test_x": draw(n_test), "test_y": torch.zeros(n_test, dtype=torch.int64)}


def synthetic_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """SYNTHETIC_LOSS: a stand-in whose gradient reaches every layer; `y` unused (it measures speed only)."""
    return out.float().pow(2).mean()


def synthetic_stats(loss: torch.Tensor | None, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """step_stats' layout without an accuracy (no classes): (loss x samples, 0, samples), or (0, samples)."""
    count = torch.full((), len(y), dtype=torch.float32, device=out.device)
    zero = torch.zeros((), dtype=torch.float32, device=out.device)
    return torch.stack([zero, count] if loss is None else [loss * len(y), zero, count])


def stage_io(own: OwnModel, stage: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage `stage`'s input and output for one micro-batch (meta tensors), where torch 2.4's PipelineStage wants
    them: from the measured shapes."""
    ends = [sum(own.plan.sizes[:s + 1]) - 1 for s in range(len(own.plan.sizes))]
    out = own.out_shapes[ends[stage]]
    inp = (own.sample_shape, own.sample_dtype) if stage == 0 else (own.out_shapes[ends[stage - 1]], torch.float32)
    return (torch.empty(micro, *inp[0], dtype=inp[1], device="meta"), torch.empty(micro, *out, device="meta"))

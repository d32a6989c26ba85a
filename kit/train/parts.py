"""The model builder both layouts share: a task's module_list, seeded (every replica and both layouts start from the
same weights), the kit's Transformer (the page's loop in bench_ddp_transformer.py, or kit.train.transformer's
module_list) or a --model's layers built for real and cut by the checker's split, each part under --precision's
autocast (kit.train.options.Part: the same children and state_dict keys).
Owns: model_parts, own_module_list. Imports: kit.own_model (a --model's layers), kit.plan, kit.train.errors,
kit.train.options, kit.train.own, kit.train.transformer.
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.nn as nn

import kit.plan
from kit.train import transformer
from kit.train.errors import RunError
from kit.train.options import Part
from kit.train.own import OwnModel, recompute_in_backward

Builder = Callable[[argparse.Namespace, kit.plan.TaskPlan], list[nn.Sequential]]


def model_parts(cfg: argparse.Namespace, plan: kit.plan.TaskPlan, own: OwnModel | None = None,
                build: Builder | None = None) -> list[Part]:
    """The parts of this task's replica, each on its device under --precision's autocast: a --model's layers
    (own_module_list), else the kit's Transformer by `build` (the page's loop; by default kit.train.transformer's
    module_list), created after torch.manual_seed(--seed)."""
    if plan.cpu and cfg.precision != "fp32":
        # the evaluation's TransformerEncoderLayer fast path (torch/nn/modules/transformer.py) is refused under
        # torch.is_autocast_enabled(), which sees CUDA's autocast only in some releases: torch 2.4.1 took it under
        # the CPU's and failed ("mat1 and mat2 must have the same dtype"). CUDA's autocast is seen everywhere.
        torch.backends.mha.set_fastpath_enabled(False)
    torch.manual_seed(cfg.seed)  # same initial weights on every replica (DDP also broadcasts rank 0's)
    module_list = own_module_list(cfg, plan, own) if own else (build or transformer.module_list)(cfg, plan)
    return [Part(*part, precision=cfg.precision) for part in module_list]


def own_module_list(cfg: argparse.Namespace, plan: kit.plan.TaskPlan, own: OwnModel) -> list[nn.Sequential]:
    """The page's module_list for the user's layers: the whole model built on the CPU (the caller seeded torch, so
    every replica and both layouts start from the same weights), cut by the plan's sizes, part p on its device."""
    from kit import own_model  # here: a run of the kit's own model never imports the measuring machinery
    layers, _ = own_model.build_layers(own.plan.spec, device="cpu")
    if len(layers) != sum(own.plan.sizes):  # the model changed between the plan and now (a file edited meanwhile)
        raise RunError(f"--model {own.plan.spec} built {len(layers)} layers here but {sum(own.plan.sizes)} when it was "
                       "planned: the model changed during start-up; start again")
    if cfg.activation_checkpointing:  # the layers kit.model says (the kit's Encoder and Decoder never)
        for layer, again in zip(layers, own.plan.model.recomputed()):
            if again:
                recompute_in_backward(layer)
    return transformer.cut(list(layers), own.plan.sizes, plan)

"""The kit's Transformer, the page's model (as nanoGPT keeps model.py apart from train.py): Encoder (token embedding
and positions), Layer (one block, or CheckpointedLayer, the same block recomputed in backward under
--activation-checkpointing), Decoder (mean over positions, the 2-class head); the model as a list of layers in the
order they are created (one seed, one model), and that list cut into a task's parts (module_list) by the plan's
split: the Encoder with the first part, the Decoder with the last, the blocks between by kit.plan.
bench_ddp_transformer.py imports and shows these classes, and runs the page's own loop over them; the stage layout
and the benchmarks build the same parts here (tests/test_page.py holds the two equal). kit.own_split and kit.own_model recognise these classes
in a --model by this module's name.
Owns: the kit's model. Imports: kit.plan.
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import kit.plan


# the model of the page: Encoder on the task's first GPU, Layer blocks split by the plan, Decoder on its last
class Encoder(nn.Module):
    """Token embedding + sinusoidal positions.

    Not scaled by sqrt(d_model) (the Transformer paper's tied-embedding habit): nn.Embedding starts at N(0, 1), so
    the scale made each token 32 times larger than its position at d_model 1024 and drowned the positional table
    (ARCHITECTURE post-ln/2)."""

    def __init__(self, ntokens: int, d_model: int, dropout: float, seq_len: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(ntokens, d_model)
        position = torch.arange(seq_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(seq_len, d_model)
        pe[:, 0::2] = torch.sin(position * div)
        pe[:, 1::2] = torch.cos(position * div)
        self.register_buffer("pe", pe, persistent=False)  # derived, not saved
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.embedding(tokens) + self.pe[: tokens.size(1)])


class CheckpointedLayer(nn.TransformerEncoderLayer):
    """A Layer for --activation-checkpointing: it keeps only its input for the backward pass and recomputes the
    rest there. Same parameters and state_dict keys as a plain Layer, so checkpoints move between the two.

    Non-reentrant torch.utils.checkpoint, which DDP supports "without any limitations"; the reentrant kind fails
    under DDP when a layer is checkpointed more than once per step (the note on gradient checkpointing in
    torch/nn/parallel/distributed.py). That is also why the Pipe's own checkpoint= must stay "never" under DDP:
    fairscale's (and torch 2.3's) Checkpoint.backward runs a nested torch.autograd.backward over the recomputed
    part (fairscale/nn/pipe/checkpoint.py), once per micro-batch, so DDP's hook sees each parameter ready once per
    micro-batch; the failure measured here: docs/memory.md, --activation-checkpointing.
    """

    def forward(self, src: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return super().forward(src, *args, **kwargs)
        return checkpoint(super().forward, src, *args, use_reentrant=False, **kwargs)


def Layer(d_model: int, n_head: int, d_hid: int, dropout: float, checkpointing: bool = False) -> nn.Module:
    """One transformer block (batch first: Pipe cuts micro-batches along dim 0); with --activation-checkpointing
    a CheckpointedLayer, the same block that recomputes its activations in backward."""
    block = CheckpointedLayer if checkpointing else nn.TransformerEncoderLayer
    return block(d_model, n_head, d_hid, dropout, batch_first=True)


class Decoder(nn.Module):
    """Mean over positions, then a 2-class head (negative / positive review)."""

    def __init__(self, d_model: int, d_hid: int, nclasses: int = 2) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Linear(d_model, d_hid), nn.ReLU(), nn.Linear(d_hid, nclasses))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.mean(dim=1))


def layers(cfg: argparse.Namespace) -> list[nn.Module]:
    """The whole model on the CPU, in the page's order of creation (the Encoder, each Layer, the Decoder): one seed,
    the same weights, whatever the split."""
    return [Encoder(cfg.vocab_size, cfg.d_model, cfg.dropout, cfg.seq_len),
            *(Layer(cfg.d_model, cfg.n_head, cfg.d_hid, cfg.dropout, cfg.activation_checkpointing)
              for _ in range(cfg.nlayers)),
            Decoder(cfg.d_model, cfg.d_hid)]


def cut(modules: list[nn.Module], sizes: list[int], plan: kit.plan.TaskPlan) -> list[nn.Sequential]:
    """`modules` cut into consecutive parts of `sizes`, part p an nn.Sequential on the plan's device p."""
    parts, start = [], 0
    for p, n in enumerate(sizes):
        parts.append(nn.Sequential(*modules[start:start + n]).to(plan.device(p)))
        start += n
    return parts


def module_list(cfg: argparse.Namespace, plan: kit.plan.TaskPlan) -> list[nn.Sequential]:
    """The page's module_list for this task's plan: one nn.Sequential per part on its device, the Encoder in the
    first, the Decoder in the last, the blocks by kit.plan's split (the page's loop's result whenever nlayers is a
    multiple of nb_part)."""
    return cut(layers(cfg), kit.plan.layer_split(cfg.nlayers + 2, plan.nb_part, ends=True), plan)

"""Models the kit did not write for itself, as a user would hand them to `--model FILE.py:function` (issue 34):
a plain convolutional stack, a residual MLP with uneven blocks, and the kit's own Transformer built from the page's
classes. Each `*_sample` function returns a batch of the shape its model takes (values never matter)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class Residual(nn.Module):
    """x + MLP(x): the width of the hidden layer sets the block's cost."""

    def __init__(self, d: int, widen: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, widen * d), nn.GELU(), nn.Linear(widen * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def conv_stack() -> nn.Sequential:
    """Conv-BN-ReLU blocks, halving the image twice, then a 10-class head."""
    def block(cin: int, cout: int, pool: bool) -> nn.Sequential:
        layers = [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
        return nn.Sequential(*layers, *([nn.MaxPool2d(2)] if pool else []))
    return nn.Sequential(block(3, 32, False), block(32, 32, True), block(32, 64, False), block(64, 64, True),
                         block(64, 128, False), nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10)))


def conv_sample() -> torch.Tensor:
    return torch.zeros(8, 3, 32, 32)


def residual_mlp() -> list[nn.Module]:
    """Blocks of very different costs (hidden widths 1x to 8x): the even split is far from the balanced one."""
    d = 128
    return [nn.Linear(64, d), *(Residual(d, w) for w in (1, 8, 1, 1, 4, 1, 8, 1)), nn.Linear(d, 2)]


def mlp_sample() -> torch.Tensor:
    return torch.zeros(16, 64)


def mlp_large_sample() -> torch.Tensor:
    """A batch large enough that each part's time (about 2 ms on one core) stands above the noise of timing it, and
    small enough that the time still follows the FLOPs (at 512 the memory-bound adds and activations weigh more)."""
    return torch.zeros(64, 64)


def kit_transformer() -> list[nn.Module]:
    """The kit's own model (kit.train.transformer's Encoder, Layer, Decoder: bench_ddp_transformer.py's) at its CPU
    defaults."""
    import kit.arguments
    from kit.train.transformer import Decoder, Encoder, Layer
    m = kit.arguments.CPU_DEFAULTS
    return [Encoder(m["vocab_size"], m["d_model"], 0.0, m["seq_len"]),
            *(Layer(m["d_model"], m["n_head"], m["d_hid"], 0.0) for _ in range(m["nlayers"])),
            Decoder(m["d_model"], m["d_hid"])]


def kit_ends_mixed() -> list[nn.Module]:
    """The kit's Encoder and Decoder (kit.train.transformer's) around the user's own middle layers (4 residual MLP
    blocks of uneven widths, on each position): the even split keeps the Encoder with the first part and the Decoder
    with the last, as the kit's own model (6 layers on 4 GPUs: [2, 1, 1, 2]); kit.memory's estimate does not apply."""
    import kit.arguments
    from kit.train.transformer import Decoder, Encoder
    m = kit.arguments.CPU_DEFAULTS
    return [Encoder(m["vocab_size"], m["d_model"], 0.0, m["seq_len"]),
            *(Residual(m["d_model"], w) for w in (1, 4, 1, 2)), Decoder(m["d_model"], m["d_hid"])]


def not_a_sequence() -> nn.Module:
    return nn.Linear(4, 4)


class MeanOverPositions(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def small_vocabulary() -> list[nn.Module]:
    """A token-id classifier of the kit's task whose embedding has 500 rows (the kit's data: --vocab-size ids)."""
    return [nn.Sequential(nn.Embedding(500, 32), MeanOverPositions()), nn.Linear(32, 32), nn.Linear(32, 2)]

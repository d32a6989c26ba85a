"""The model families users bring (issue 41), written here as a user would hand them to `--model FILE.py:function`:
a layer that returns a transposed view (as ViT's and an LSTM's do), a model whose last layers have no parameter
(pooling, flatten), GPT-2 from Hugging Face's transformers (as a language model with its head tied to its embedding,
untied, and with a 2-class head), and small ResNet-, U-Net- and encoder-like models. Each `*_sample` function returns
a batch of the shape its model takes (values never matter). Small sizes: the tests run them on 2 CPU cores."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class SwapMix(nn.Module):
    """Mixes along the positions: x (batch, positions, features) transposed, a Linear over the positions, transposed
    back. Its output is a transposed view (not contiguous), and so is its input's gradient."""

    def __init__(self, positions: int) -> None:
        super().__init__()
        self.mix = nn.Linear(positions, positions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x.transpose(1, 2)).transpose(1, 2)


def transposed() -> list[nn.Module]:
    """Four SwapMix layers over 8 positions of 16 features: every layer returns x.transpose(1, 2)."""
    return [SwapMix(8) for _ in range(4)]


def transposed_sample() -> torch.Tensor:
    return torch.zeros(8, 8, 16)


def parameterless_tail() -> list[nn.Module]:
    """Two convolutions, then pooling and flattening as layers of their own: a split that gives the last stage only
    these has no parameter to train."""
    return [nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()), nn.Sequential(nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU()), nn.AdaptiveAvgPool2d(1), nn.Flatten()]


def image_sample() -> torch.Tensor:
    return torch.zeros(8, 3, 16, 16)

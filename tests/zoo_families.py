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


class GPT2Embedding(nn.Module):
    """GPT-2's input: token embedding (wte) plus position embedding (wpe), dropout; token ids in."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(positions))


class GPT2LMHead(nn.Module):
    """GPT-2's output as a language model: the last layer norm, then the vocabulary's logits (lm_head, whose weight
    is wte's own Parameter where the config ties them, Hugging Face's default)."""

    def __init__(self, transformer: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = transformer.ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT2ClassHead(nn.Module):
    """GPT-2 as the kit's classifier: the last layer norm, the mean over positions, 2 logits."""

    def __init__(self, transformer: nn.Module, d: int) -> None:
        super().__init__()
        self.ln_f, self.score = transformer.ln_f, nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.score(self.ln_f(x).mean(dim=1))


def gpt2_layers(head: str = "lm", tie: bool = True, **config: int) -> list[nn.Module]:
    """transformers' GPT2LMHeadModel, random-init from a config, as layers: the embeddings, each block, the head
    ("lm": the vocabulary's logits; "classes": 2)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(tie_word_embeddings=tie, **config))
    t = model.transformer
    last = GPT2LMHead(t, model.lm_head) if head == "lm" else GPT2ClassHead(t, t.config.n_embd)
    return [GPT2Embedding(t), *t.h, last]


TINY_GPT2 = dict(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=512, bos_token_id=0, eos_token_id=0)


def gpt2_tiny_lm() -> list[nn.Module]:
    """A 2-block GPT-2 language model, its head tied to its embedding (Hugging Face's default)."""
    return gpt2_layers("lm", True, **TINY_GPT2)


def gpt2_tiny_lm_untied() -> list[nn.Module]:
    return gpt2_layers("lm", False, **TINY_GPT2)


def gpt2_tiny_classifier() -> list[nn.Module]:
    return gpt2_layers("classes", True, **TINY_GPT2)


def gpt2_small_lm_untied() -> list[nn.Module]:
    """GPT-2 small (124 M parameters with the head tied; 163 M untied) as a language model."""
    return gpt2_layers("lm", False)


NARROW_GPT2 = dict(n_embd=256, n_head=4)  # GPT-2 small's vocabulary, positions and 12 blocks, a third of its width


def gpt2_narrow_lm() -> list[nn.Module]:
    return gpt2_layers("lm", True, **NARROW_GPT2)


def gpt2_narrow_lm_untied() -> list[nn.Module]:
    return gpt2_layers("lm", False, **NARROW_GPT2)

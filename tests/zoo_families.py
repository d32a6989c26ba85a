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


def gpt2_tiny_lm_sample() -> torch.Tensor:
    return torch.zeros(8, 32, dtype=torch.long)


class BertHead(nn.Module):
    """BERT's pooler (the first token's state through a tanh Linear) and a 2-class score."""

    def __init__(self, pooler: nn.Module, d: int) -> None:
        super().__init__()
        self.pooler, self.score = pooler, nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.score(self.pooler(x))


def bert_tiny_classifier() -> list[nn.Module]:
    """transformers' BertModel (2 layers, 64 wide, 1000 tokens), random-init, as layers: embeddings, each BertLayer,
    the pooler and a 2-class head: the kit's task."""
    from transformers import BertConfig, BertModel
    model = BertModel(BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=128, max_position_embeddings=128))
    return [model.embeddings, *model.encoder.layer, BertHead(model.pooler, 64)]


class LSTMLayer(nn.Module):
    """nn.LSTM (batch first) as one layer: its output sequence alone (a transposed view of the kernel's)."""

    def __init__(self, d_in: int, d: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d_in, d, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


class LastPosition(nn.Module):
    def __init__(self, d: int, classes: int) -> None:
        super().__init__()
        self.score = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.score(x[:, -1])


def lstm_classifier() -> list[nn.Module]:
    """Token ids of the kit's vocabulary (20000) embedded, two LSTM layers, the last position's 2 logits."""
    return [nn.Embedding(20000, 32), LSTMLayer(32, 48), LSTMLayer(48, 48), LastPosition(48, 2)]


def long_encoder() -> list[nn.Module]:
    """A long-context encoder: a projection in, four nn.TransformerEncoderLayer (batch first, pre-norm), a pooled
    10-class head, on sequences of 256 positions of 16 features."""
    d = 32
    return [nn.Linear(16, d), *(nn.TransformerEncoderLayer(d, 2, 64, 0.0, batch_first=True, norm_first=True)
                                for _ in range(4)), nn.Sequential(nn.LayerNorm(d), MeanOfPositions(), nn.Linear(d, 10))]


class MeanOfPositions(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def long_sample() -> torch.Tensor:
    return torch.zeros(4, 256, 16)


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with batch norm, the input added (projected when it changes)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                                  nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Identity() if stride == 1 and cin == cout else
                     nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def resnet_like() -> list[nn.Module]:
    """A small ResNet: stem, four basic blocks (two halving the image), pooled 10-class head."""
    return [nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()),
            BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 32, 1), BasicBlock(32, 64, 2),
            nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))]


class UNetLevel(nn.Module):
    """One level of a U-Net: two convolutions, the inner levels on the halved image, upsampled and concatenated with
    this level's features (the skip connection), two convolutions."""

    def __init__(self, c: int, inner: nn.Module | None) -> None:
        super().__init__()
        conv = lambda a, b: nn.Sequential(nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU())  # noqa: E731
        self.down, self.inner = conv(c, c), inner
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2) if inner is not None else None
        self.merge = conv(2 * c if inner is not None else c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(x)
        if self.inner is None:
            return self.merge(h)
        deep = self.inner(nn.functional.max_pool2d(h, 2))
        return self.merge(torch.cat([h, self.up(deep)], dim=1))


class Widen(nn.Module):
    """The channels doubled for the level below (a 1x1 convolution)."""

    def __init__(self, c: int, level: nn.Module) -> None:
        super().__init__()
        self.proj, self.level, self.back = nn.Conv2d(c, 2 * c, 1), level, nn.Conv2d(2 * c, 2 * c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.back(self.level(self.proj(x)))


def unet_like() -> list[nn.Module]:
    """A three-level U-Net for segmentation (2 classes a pixel): its skip connections live inside the nested level,
    so the layers the kit cuts are the stem, the U, and the head."""
    u = UNetLevel(8, Widen(8, UNetLevel(16, Widen(16, UNetLevel(32, None)))))
    return [nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()), u, nn.Conv2d(8, 2, 1)]


def unet_sample() -> torch.Tensor:
    return torch.zeros(4, 3, 32, 32)


def gpt2_small_lm() -> list[nn.Module]:
    """GPT-2 small as Hugging Face builds it: 124.4 M parameters, the head tied to the embedding."""
    return gpt2_layers("lm", True)

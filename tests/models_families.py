"""The families of models users bring (issue 41), written here as a user hands them to `--model FILE.py:function`,
random-initialised from configurations: GPT-2 small and BERT-base (Hugging Face transformers, optional: None where
it is not installed), an LSTM classifier (and a GRU one), a long-context encoder of nn.TransformerEncoderLayer, and a ResNet-like and
a U-Net-like convolutional model of the kit's own (torchvision is not a dependency). Each `*_sample` returns a batch
of the shape its model takes (values never matter). benchmarks/plan_times.py times their planning."""
from __future__ import annotations

import torch
import torch.nn as nn

SEQ = 512  # GPT-2, BERT and the LSTM at a typical fine-tuning length; the encoder at LONG
LONG = 4096


# ---- Hugging Face (optional) -------------------------------------------------------------------------------------
class Embed(nn.Module):
    """Token and position embeddings (GPT-2's wte + wpe), then the blocks' hidden states."""

    def __init__(self, vocab: int, positions: int, d: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(positions, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))


class Head(nn.Module):
    """A final norm and the 2-class head on the last token (GPT-2) or the first ([CLS], BERT)."""

    def __init__(self, d: int, token: int, norm: bool = True) -> None:
        super().__init__()
        self.norm, self.fc, self.token = nn.LayerNorm(d) if norm else nn.Identity(), nn.Linear(d, 2), token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x[:, self.token]))


class Block(nn.Module):
    """A transformers block as one layer: its hidden states in, its hidden states out."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def gpt2() -> list[nn.Module] | None:
    try:
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    except ImportError:
        return None
    c = GPT2Config()
    c._attn_implementation = "sdpa"
    return [Embed(c.vocab_size, c.n_positions, c.n_embd),
            *[Block(GPT2Block(c, layer_idx=i)) for i in range(c.n_layer)], Head(c.n_embd, -1)]


def bert() -> list[nn.Module] | None:
    try:
        from transformers import BertConfig
        from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer
    except ImportError:
        return None
    c = BertConfig()
    c._attn_implementation = "sdpa"
    return [BertEmbeddings(c), *[Block(BertLayer(c)) for _ in range(c.num_hidden_layers)],
            Head(c.hidden_size, 0, norm=False)]


def tokens() -> torch.Tensor:
    return torch.zeros(8, SEQ, dtype=torch.int64)


# ---- the kit's own writing ---------------------------------------------------------------------------------------
class LSTMBody(nn.Module):
    def __init__(self, d: int, h: int, n: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d, h, num_layers=n, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


def lstm() -> nn.Sequential:
    """nn.Embedding -> a 2-layer LSTM (hidden 1024, batch first) -> a 2-class head on the last step."""
    return nn.Sequential(nn.Embedding(32000, 512), LSTMBody(512, 1024, 2), Head(1024, -1, norm=False))


class GRUBody(nn.Module):
    def __init__(self, d: int, h: int, n: int) -> None:
        super().__init__()
        self.gru = nn.GRU(d, h, num_layers=n, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(x)[0]


def gru() -> nn.Sequential:
    """The LSTM classifier with a GRU: no fused CPU kernel, so it runs step by step under fake tensors."""
    return nn.Sequential(nn.Embedding(32000, 512), GRUBody(512, 1024, 2), Head(1024, -1, norm=False))


def encoder() -> list[nn.Module]:
    """A long-context encoder: an embedding, 8 nn.TransformerEncoderLayer (d 512, 8 heads, batch first), a head."""
    return [nn.Embedding(32000, 512), *[nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
                                        for _ in range(8)], Head(512, 0)]


def long_tokens() -> torch.Tensor:
    return torch.zeros(2, LONG, dtype=torch.int64)


class Bottleneck(nn.Module):
    """ResNet's bottleneck: 1x1, 3x3 (stride), 1x1 convolutions with BatchNorm, in-place ReLU, a projected skip."""

    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = 4 * mid
        self.body = nn.Sequential(nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
                                  nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid),
                                  nn.ReLU(inplace=True), nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Identity() if cin == cout and stride == 1 else
                     nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.skip(x))


def resnet() -> list[nn.Module]:
    """A ResNet-50-like: stem, 3-4-6-3 bottlenecks, pooled 1000-class head."""
    layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                             nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))]
    cin = 64
    for mid, n, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(n):
            layers.append(Bottleneck(cin, mid, stride if i == 0 else 1))
            cin = 4 * mid
    return layers + [nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 1000))]


def images() -> torch.Tensor:
    return torch.zeros(16, 3, 224, 224)


def conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class Level(nn.Module):
    """One level of a U-Net: its block, then (below it) the next level at half the resolution, whose output is
    upsampled and concatenated with this level's (the skip) before the level's up block."""

    def __init__(self, cin: int, width: int, depth: int) -> None:
        super().__init__()
        self.down = conv_block(cin, width)
        self.below = None
        if depth > 1:
            self.below = nn.Sequential(nn.MaxPool2d(2), Level(width, 2 * width, depth - 1),
                                       nn.ConvTranspose2d(2 * width, width, 2, stride=2))
            self.up = conv_block(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.down(x)
        return x if self.below is None else self.up(torch.cat([x, self.below(x)], dim=1))


def unet() -> list[nn.Module]:
    """A U-Net-like segmenter (4 levels, 32 to 256 channels, 2 classes a pixel). Its skips cross the middle of the
    network, so as a sequence it is stem | the U (its levels nested) | head: a pipeline of it has three layers."""
    return [conv_block(3, 32), Level(32, 64, 4), nn.Conv2d(64, 2, 1)]


def unet_images() -> torch.Tensor:
    return torch.zeros(8, 3, 256, 256)

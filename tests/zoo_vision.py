"""The vision families users bring from packages (issue 41): torchvision's ResNet-18 and ViT-B/16 and timm's ViT-S/16,
random-initialised with a 2-class head, cut into the list of layers `--model` takes as a user would cut them: the
ResNet by its stem, its four stages and its head; a ViT by its patch embedding (the class token and the positions
with it), each encoder block, and its head on the class token. Each has a narrow twin of the same classes (the same
code, a few layers, 32 x 32 images) that trains in seconds on 2 cores.

torchvision and timm import only beside a CUDA torch here (PyPI's torchvision for torch 2.13.0 is the CUDA build, which
the kit's CPU torch cannot load): they are installed in the torch 2.14.1 lane (requirements-torch-2.14.1.txt)."""
from __future__ import annotations

import timm
import torch
import torch.nn as nn
import torchvision


def _resnet_layers(m: nn.Module) -> list[nn.Module]:
    return [nn.Sequential(m.conv1, m.bn1, m.relu, m.maxpool), m.layer1, m.layer2, m.layer3, m.layer4,
            nn.Sequential(m.avgpool, nn.Flatten(1), m.fc)]


def resnet18() -> list[nn.Module]:
    """torchvision.models.resnet18, 11.2 M parameters (ReLU(inplace=True) throughout)."""
    return _resnet_layers(torchvision.models.resnet18(num_classes=2))


def resnet18_narrow() -> list[nn.Module]:
    """torchvision's ResNet class with one BasicBlock a stage (the same stem, blocks and head code)."""
    return _resnet_layers(torchvision.models.resnet.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1],
                                                           num_classes=2))


class Patches(nn.Module):
    """torchvision's VisionTransformer up to its first block (its _process_input, the class token, the positions):
    the patches flattened and transposed, a view the stage layout must send contiguous."""

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.conv_proj, self.class_token = vit.conv_proj, vit.class_token
        self.pos_embedding, self.dropout = vit.encoder.pos_embedding, vit.encoder.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.dropout(x + self.pos_embedding)


class ClassHead(nn.Module):
    """A ViT's last norm, then its head on the class token."""

    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x)[:, 0])


def _torchvision_vit_layers(vit: nn.Module) -> list[nn.Module]:
    return [Patches(vit), *vit.encoder.layers, ClassHead(vit.encoder.ln, vit.heads)]


def vit_b_16() -> list[nn.Module]:
    """torchvision.models.vit_b_16 (224 x 224 images), 85.8 M parameters with a 2-class head."""
    return _torchvision_vit_layers(torchvision.models.vit_b_16(num_classes=2))


def vit_narrow() -> list[nn.Module]:
    """torchvision's VisionTransformer on 32 x 32 images: 2 blocks of width 32."""
    return _torchvision_vit_layers(torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=2))


class TimmPatches(nn.Module):
    """timm's VisionTransformer up to its first block: patch_embed, the class token and positions, norm_pre."""

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.patch_embed, self.cls_token, self.pos_embed = vit.patch_embed, vit.cls_token, vit.pos_embed
        self.pos_drop, self.norm_pre = vit.pos_drop, vit.norm_pre

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.norm_pre(self.pos_drop(x))


def _timm_vit_layers(vit: nn.Module) -> list[nn.Module]:
    return [TimmPatches(vit), *vit.blocks, ClassHead(vit.norm, nn.Sequential(vit.fc_norm, vit.head_drop, vit.head))]


def timm_vit_s_16() -> list[nn.Module]:
    """timm's vit_small_patch16_224, random-init (no download), 21.7 M parameters with a 2-class head."""
    return _timm_vit_layers(timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=2))


def timm_vit_narrow() -> list[nn.Module]:
    """timm's VisionTransformer on 32 x 32 images: 2 blocks of width 32."""
    return _timm_vit_layers(timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=2))


def image_224() -> torch.Tensor:
    return torch.zeros(8, 3, 224, 224)


def image_32() -> torch.Tensor:
    return torch.zeros(8, 3, 32, 32)


def image_224_pair() -> torch.Tensor:
    """Two images: a real CPU step of ViT-B/16 (benchmarks/model_zoo.py's MemTracker) in seconds, not minutes."""
    return torch.zeros(2, 3, 224, 224)

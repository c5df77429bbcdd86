"""Small vision models for the DP-SGD tests and benchmarks, built from layers Opacus supports.

``SmallResNet``: a CIFAR-style ResNet with GroupNorm in place of BatchNorm (BatchNorm mixes the
samples of a batch, so DP-SGD cannot use it; Opacus's ModuleValidator makes the same swap): a 3x3
stem, three stages of basic blocks (two 3x3 convolutions each), the stages that halve the image
taking a strided 1x1 convolution on the shortcut, average pooling and a Linear head.

``TinyViT``: a vision transformer: 4x4 patches embedded by a strided Conv2d, learned positions as an
``nn.Embedding`` (Opacus has no per-sample rule for a bare ``nn.Parameter``), pre-norm blocks of
attention and MLP written with ``nn.Linear``, mean pooling and a Linear head.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1, groups: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.GroupNorm(groups, cout))

    def forward(self, x):
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + (x if self.shortcut is None else self.shortcut(x)))


class SmallResNet(nn.Module):
    """One block per stage: 9 convolutions (7 of them 3x3, two strided 1x1 shortcuts). The default widths
    (64, 128, 256) are WRN-16-4's, the GroupNorm ResNet DP-SGD work trains on CIFAR-10 (De et al.,
    2022), 1.2M parameters; (16, 32, 64) is a narrow one whose peak is its activations."""

    def __init__(self, classes: int = 10, widths: tuple[int, ...] = (64, 128, 256), blocks_per_stage: int = 1):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.GroupNorm(8, widths[0]),
                                  nn.ReLU())
        stages, cin = [], widths[0]
        for i, width in enumerate(widths):
            for j in range(blocks_per_stage):
                stages.append(BasicBlock(cin, width, stride=2 if i and not j else 1))
                cin = width
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


class _ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attended)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyViT(nn.Module):
    def __init__(self, classes: int = 10, image: int = 32, patch: int = 4, dim: int = 64, depth: int = 2,
                 heads: int = 4):
        super().__init__()
        self.patches = nn.Conv2d(3, dim, patch, stride=patch)
        self.positions = nn.Embedding((image // patch) ** 2, dim)
        self.blocks = nn.Sequential(*[_ViTBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        tokens = self.patches(x).flatten(2).transpose(1, 2)                 # [B, T, dim]
        positions = torch.arange(tokens.shape[1], device=x.device).expand(x.shape[0], -1)   # per sample, for Opacus
        return self.head(self.norm(self.blocks(tokens + self.positions(positions))).mean(1))

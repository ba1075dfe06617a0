"""A small ResNet (He et al. 2016, "Deep Residual Learning"), CIFAR-style:
a 3x3 stem, stages of basic blocks (two 3x3 convolutions, each followed by
batch norm, Ioffe & Szegedy 2015) with identity shortcuts, or a strided 1x1
convolution + batch norm where the shape changes, global average pooling and a
linear classifier, trained with cross-entropy.

Batch norm normalises with the statistics of the current batch (train mode)
and updates its running mean and variance buffers in place, as
``nn.BatchNorm2d`` does by default; ``track_running_stats=False`` keeps no
buffers (batch statistics in eval mode too)."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ResNetConfig:
    image: int = 16
    channels: int = 3
    widths: tuple = (8, 16, 32)
    blocks_per_stage: int = 1
    classes: int = 10
    track_running_stats: bool = True
    """False: batch statistics only, no running mean and variance buffers."""


def bn(cfg: ResNetConfig, c: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(c, track_running_stats=cfg.track_running_stats)


class BasicBlock(nn.Module):
    def __init__(self, cfg: ResNetConfig, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = bn(cfg, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = bn(cfg, c_out)
        self.shortcut = None
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), bn(cfg, c_out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.shortcut is None else self.shortcut(x)))


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig):
        super().__init__()
        self.cfg = cfg
        self.stem = nn.Conv2d(cfg.channels, cfg.widths[0], 3, padding=1, bias=False)
        self.stem_bn = bn(cfg, cfg.widths[0])
        blocks, c = [], cfg.widths[0]
        for i, w in enumerate(cfg.widths):
            for j in range(cfg.blocks_per_stage):
                blocks.append(BasicBlock(cfg, c, w, stride=2 if i > 0 and j == 0 else 1))
                c = w
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(c, cfg.classes)

    def forward(self, images):
        x = F.relu(self.stem_bn(self.stem(images)))
        x = self.blocks(x)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def small(batch: int = 8):
    """FACTORY for the CLI: a 3-stage ResNet on 16x16 images, its batch and loss."""
    torch.manual_seed(0)
    cfg = ResNetConfig()
    model = ResNet(cfg)
    images = torch.randn(batch, cfg.channels, cfg.image, cfg.image)
    labels = torch.randint(0, cfg.classes, (batch,))
    return model, (images, labels), F.cross_entropy

"""A plain convolutional classifier (LeNet-style, LeCun et al. 1998, with ReLU and
max pooling): two conv -> ReLU -> 2x2 max-pool stages, flatten, two linear
layers, cross-entropy. No batch norm."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class CNNConfig:
    image: int = 16
    channels: int = 3
    widths: tuple = (8, 16)
    hidden: int = 32
    classes: int = 10


class CNN(nn.Module):
    def __init__(self, cfg: CNNConfig):
        super().__init__()
        self.cfg = cfg
        c1, c2 = cfg.widths
        self.conv1 = nn.Conv2d(cfg.channels, c1, 3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
        side = cfg.image // 4
        self.fc1 = nn.Linear(c2 * side * side, cfg.hidden)
        self.fc2 = nn.Linear(cfg.hidden, cfg.classes)

    def forward(self, images):
        x = F.max_pool2d(F.relu(self.conv1(images)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def small(batch: int = 8):
    """FACTORY for the CLI: a 2-conv CNN on 16x16 RGB images, its batch and loss."""
    torch.manual_seed(0)
    cfg = CNNConfig()
    model = CNN(cfg)
    images = torch.randn(batch, cfg.channels, cfg.image, cfg.image)
    labels = torch.randint(0, cfg.classes, (batch,))
    return model, (images, labels), F.cross_entropy

"""A Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16
Words"): non-overlapping patches embedded by a strided Conv2d, a learned class
token prepended, learned position embeddings, pre-LN encoder blocks with
bidirectional attention and a GELU MLP, and a linear head on the class token,
trained with cross-entropy."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ViTConfig:
    image: int = 16
    patch: int = 4
    channels: int = 3
    hidden: int = 64
    heads: int = 4
    mlp: int = 128
    layers: int = 2
    classes: int = 10

    @property
    def patches(self) -> int:
        return (self.image // self.patch) ** 2


class Attention(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        # No key bias (as in Whisper): it shifts every logit of a query equally,
        # so softmax cancels it and its gradient is rounding noise, which Adam
        # would turn into full-size updates.
        self.k = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.v = nn.Linear(cfg.hidden, cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t(x).view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class Block(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=1e-6)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=1e-6)
        self.fc = nn.Linear(cfg.hidden, cfg.mlp)
        self.proj = nn.Linear(cfg.mlp, cfg.hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        if cfg.image % cfg.patch:
            raise ValueError(f"image size ({cfg.image}) must be a multiple of the patch size ({cfg.patch})")
        self.cfg = cfg
        self.patch_embed = nn.Conv2d(cfg.channels, cfg.hidden, kernel_size=cfg.patch, stride=cfg.patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, cfg.hidden) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, cfg.patches + 1, cfg.hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.hidden, eps=1e-6)
        self.head = nn.Linear(cfg.hidden, cfg.classes)

    def forward(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (b, patches, hidden)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat((cls, x), dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)[:, 0])


def small(batch: int = 8):
    """FACTORY for the CLI: a 2-layer ViT on 16x16 RGB images, its batch and loss."""
    torch.manual_seed(0)
    cfg = ViTConfig()
    model = ViT(cfg)
    images = torch.randn(batch, cfg.channels, cfg.image, cfg.image)
    labels = torch.randint(0, cfg.classes, (batch,))
    return model, (images, labels), F.cross_entropy

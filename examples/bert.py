"""A BERT-style encoder (Devlin et al. 2019): token + position + segment
embeddings with layer norm, post-LN blocks of bidirectional multi-head
attention (padding positions masked out) and a GELU MLP, the tanh pooler on the
first ([CLS]) token and a classification head, trained with cross-entropy."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

PAD = 0


@dataclass(frozen=True)
class BertConfig:
    vocab: int = 256
    seq: int = 32
    hidden: int = 64
    heads: int = 4
    ffn: int = 128
    layers: int = 2
    segments: int = 2
    classes: int = 4
    dropout: float = 0.0
    eps: float = 1e-12


class Attention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.heads = cfg.heads
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.k = nn.Linear(cfg.hidden, cfg.hidden)
        self.v = nn.Linear(cfg.hidden, cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x, mask):
        b, s, h = x.shape
        q, k, v = (p(x).view(b, s, self.heads, h // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


class Layer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attn = Attention(cfg)
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.fc = nn.Linear(cfg.hidden, cfg.ffn)
        self.proj = nn.Linear(cfg.ffn, cfg.hidden)
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, mask):
        x = self.ln1(x + self.drop(self.attn(x, mask)))
        return self.ln2(x + self.drop(self.proj(F.gelu(self.fc(x)))))


class Bert(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden)
        self.seg = nn.Embedding(cfg.segments, cfg.hidden)
        self.ln = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))
        self.pool = nn.Linear(cfg.hidden, cfg.hidden)
        self.cls = nn.Linear(cfg.hidden, cfg.classes)

    def forward(self, idx, segments):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.ln(self.tok(idx) + self.pos(pos) + self.seg(segments))
        mask = (idx != PAD)[:, None, None, :]  # (b, 1, 1, s): every query sees every real token
        for layer in self.layers:
            x = layer(x, mask)
        pooled = torch.tanh(self.pool(x[:, 0]))
        return self.cls(pooled)


def small(batch: int = 8):
    """FACTORY for the CLI: a 2-layer BERT classifier, its batch (ids, segments, labels) and loss."""
    torch.manual_seed(0)
    cfg = BertConfig()
    model = Bert(cfg)
    idx = torch.randint(1, cfg.vocab, (batch, cfg.seq))
    idx[:, -4:] = PAD  # a padded tail, masked out of attention
    segments = (torch.arange(cfg.seq) >= cfg.seq // 2).long().expand(batch, cfg.seq).contiguous()
    labels = torch.randint(0, cfg.classes, (batch,))
    return model, (idx, segments, labels), F.cross_entropy

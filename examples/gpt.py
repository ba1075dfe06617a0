"""A GPT-2-style decoder: token + position embedding, pre-LN blocks with causal
scaled-dot-product attention and a GELU MLP, final layer norm and an LM head,
trained with cross-entropy (Radford et al. 2019)."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 32
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    dropout: float = 0.0
    attention: str = "sdpa"
    """"sdpa": torch's fused scaled_dot_product_attention; "explicit": the
    s x s scores materialised, softmax and attention dropout as separate ops
    (GPT-2, Megatron-LM 2021)."""


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        # Separate projections without bias (as in Llama): a bias on k only
        # shifts every logit of a row equally, so its gradient is rounding noise.
        self.q = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.k = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.v = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        if cfg.attention not in ("sdpa", "explicit"):
            raise ValueError(f"GPTConfig.attention {cfg.attention!r} is not 'sdpa' or 'explicit'")
        self.explicit = cfg.attention == "explicit"
        if self.explicit:
            self.register_buffer("future", torch.ones(cfg.seq, cfg.seq, dtype=torch.bool).triu(1), persistent=False)
            self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t(x).view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (self.q, self.k, self.v))
        if self.explicit:
            scores = (q @ k.transpose(-2, -1)) * (h // self.heads) ** -0.5
            y = self.drop(scores.masked_fill(self.future[:s, :s], float("-inf")).softmax(-1)) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.proj = nn.Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _factory(cfg: GPTConfig, batch: int):
    """(model, (idx, target), lm_loss): the GPT of ``cfg`` (seed 0) and a random batch of ``batch`` sequences."""
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    target = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    return model, (idx, target), lm_loss


def small(batch: int = 8):
    """FACTORY for the CLI: a 2-layer GPT, its example batch and its loss."""
    return _factory(GPTConfig(), batch)


def medium(batch: int = 8):
    """FACTORY: a 2-layer GPT of hidden size 256 (vocabulary 512, context 64),
    whose best plan on two A100s changes with the batch size (docs/concepts.md,
    "Dynamic shapes": ``--dynamic batch=1..1024``)."""
    return _factory(GPTConfig(vocab=512, seq=64, hidden=256, heads=4, layers=2), batch)


def explicit(batch: int = 8):
    """FACTORY: ``small`` with explicit attention (the s x s scores kept for
    backward), where selective recomputation frees memory."""
    return _factory(GPTConfig(seq=128, attention="explicit"), batch)


def demo(batch: int = 8):
    """FACTORY for the README: big enough (hidden 512) that an A100 cluster
    plan shards it, small enough to train on 4 CPU processes in seconds."""
    return _factory(GPTConfig(vocab=1024, seq=64, hidden=512, heads=8, layers=2), batch)


def gpt3_6_7b(batch: int = 8, layers: int = 32):
    """FACTORY for the CLI: GPT-3 6.7B (Brown et al. 2020, Table 2.1: 32 layers,
    d_model 4096, 32 heads, context 2048; GPT-2's vocabulary padded to 51200,
    as Megatron-LM pads it), built on the meta device for planning, a batch of
    ``batch`` sequences."""
    cfg = GPTConfig(vocab=51200, seq=2048, hidden=4096, heads=32, layers=layers)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.zeros(batch, cfg.seq, dtype=torch.long)
        target = torch.zeros(batch, cfg.seq, dtype=torch.long)
    return model, (idx, target), lm_loss

"""A Llama-style decoder (Touvron et al. 2023, "LLaMA"; Llama 2 for grouped-query
attention): pre-normalisation with RMSNorm (Zhang & Sennrich 2019), rotary
position embeddings (Su et al. 2021, RoFormer), a SwiGLU MLP (Shazeer 2020),
grouped-query attention with separate q/k/v projections (Ainslie et al. 2023),
causal scaled-dot-product attention, no biases, untied LM head, cross-entropy
next-token loss."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 256
    seq: int = 32
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    layers: int = 2
    eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * g, as written in the reference implementation."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(cfg: LlamaConfig):
    """cos and sin of position * theta^(-2i/d), each (seq, head_dim), halves repeated."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """Rotate each (x_i, x_{i+d/2}) pair by its position's angle; x is (b, heads, s, d)."""
    return x * cos + rotate_half(x) * sin


def repeat_kv(x, n_rep: int):
    """(b, kv_heads, s, d) -> (b, kv_heads * n_rep, s, d): each kv head serves n_rep query heads."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        n_rep = self.heads // self.kv_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)  # gate
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, mlp=None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.ffn = (mlp or SwiGLU)(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    """``mlp``: the feed-forward module class of every block (SwiGLU by default;
    examples/moe.py passes its mixture of experts)."""

    def __init__(self, cfg: LlamaConfig, mlp=None):
        super().__init__()
        if cfg.heads % cfg.kv_heads:
            raise ValueError(f"heads ({cfg.heads}) must be a multiple of kv_heads ({cfg.kv_heads})")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg, mlp) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx):
        s = idx.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def small(batch: int = 8):
    """FACTORY for the CLI: a 2-layer Llama with 4 query / 2 kv heads, its batch and loss."""
    torch.manual_seed(0)
    cfg = LlamaConfig()
    model = Llama(cfg)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    target = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    return model, (idx, target), lm_loss


def long_context(seq: int = 32768, layers: int = 4, batch: int = 1):
    """FACTORY for the CLI: Llama 3 8B's layer shapes (Dubey et al. 2024, Table 3:
    hidden 4096, 32 query / 8 key-value heads, FFN 14336, vocabulary 128256)
    at a 32k-token sequence, ``layers`` of its 32 layers, built on the meta
    device (nothing allocated: for planning). Long-context training, where
    the attention's activations outgrow what tensor parallelism divides."""
    cfg = LlamaConfig(vocab=128256, seq=seq, hidden=4096, heads=32, kv_heads=8, ffn=14336, layers=layers,
                      rope_theta=500000.0)
    return _on_meta(cfg, batch)


def qwen_long_context(seq: int = 32768, layers: int = 4, batch: int = 1):
    """FACTORY for the CLI: Qwen2.5-7B's layer shapes (Qwen Team, Qwen2.5
    Technical Report, 2024, Table 1: hidden 3584, 28 query / 4 key-value
    heads, 18944 FFN; vocabulary 152064 and RoPE base 10^6 from its released
    configuration; its q/k/v biases left out) at a 32k-token sequence, on
    the meta device. 28 heads do not split 8 ways: on one 8-GPU node tensor
    parallelism alone divides attention by at most 4."""
    cfg = LlamaConfig(vocab=152064, seq=seq, hidden=3584, heads=28, kv_heads=4, ffn=18944, layers=layers,
                      rope_theta=1000000.0)
    return _on_meta(cfg, batch)


def _on_meta(cfg: LlamaConfig, batch: int):
    with torch.device("meta"):
        model = Llama(cfg)
        idx = torch.zeros(batch, cfg.seq, dtype=torch.long)
        target = torch.zeros(batch, cfg.seq, dtype=torch.long)
    return model, (idx, target), lm_loss

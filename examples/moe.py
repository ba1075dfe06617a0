"""A small decoder with Mixtral-style mixture-of-experts MLPs (Jiang et al.
2024, "Mixtral of Experts"; Shazeer et al. 2017; Fedus et al. 2022): each
token's router logits go through a softmax, the top-2 experts are kept and
their weights renormalised; every expert is a SwiGLU MLP, and the experts'
weights are stored batched as (experts, in, out) tensors.

Everything but the feed-forward is Llama's (examples/llama.py).

Dispatch is dense: every expert runs on every token (einsum over the batched
weights) and a (tokens, experts) combine matrix, zero except at each token's two
experts, mixes the results. Shapes are static and nothing is dropped, so the
sharded program can match the single-device one exactly."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llama import Llama, lm_loss


@dataclass(frozen=True)
class MoEConfig:
    vocab: int = 256
    seq: int = 16
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 64
    experts: int = 4
    top_k: int = 2
    layers: int = 2
    eps: float = 1e-5
    rope_theta: float = 10000.0
    grouped: bool = False
    """GShard-style dispatch: tokens are placed into per-expert slots
    (experts, batch, seq, hidden) within their sequence (the group), so a
    batch split and an expert split of the same tensor meet in an all-to-all."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class MoE(nn.Module):
    """Top-k routed SwiGLU experts with batched weights w1, w3: (E, h, f), w2: (E, f, h)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        if not 1 <= cfg.top_k <= cfg.experts:
            raise ValueError(f"top_k ({cfg.top_k}) must be between 1 and experts ({cfg.experts})")
        self.top_k, self.experts, self.grouped = cfg.top_k, cfg.experts, cfg.grouped
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        e, h, f = cfg.experts, cfg.hidden, cfg.ffn
        self.w1 = nn.Parameter(torch.randn(e, h, f) / h ** 0.5)  # gate
        self.w3 = nn.Parameter(torch.randn(e, h, f) / h ** 0.5)  # up
        self.w2 = nn.Parameter(torch.randn(e, f, h) / f ** 0.5)  # down

    def forward(self, x):
        if self.grouped:
            return self.grouped_forward(x)
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        probs = F.softmax(self.router(tokens), dim=-1)                          # (t, E)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)                 # (t, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        # (t, E) combine weights; an int one-hot times float weights is float (no .to(), which
        # torch.export records as an _assert_tensor_metadata node that capture rejects today)
        combine = (F.one_hot(chosen, self.experts) * weights[..., None]).sum(dim=1)
        gate = torch.einsum("th,ehf->etf", tokens, self.w1)
        up = torch.einsum("th,ehf->etf", tokens, self.w3)
        y = torch.einsum("etf,efh->eth", F.silu(gate) * up, self.w2)            # (E, t, h)
        return torch.einsum("te,eth->th", combine, y).reshape(b, s, h)

    def grouped_forward(self, x):
        """Each sequence is a group; every expert gets a slot per token of the
        group (capacity = sequence length, so nothing is dropped), filled for
        the tokens routed to it. The slots, not the tokens, are what the
        experts' weights meet (Lepikhin et al. 2021, GShard, sec. 2.2)."""
        probs = F.softmax(self.router(x), dim=-1)                              # (b, s, E)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        routed = F.one_hot(chosen, self.experts).sum(dim=2)                    # (b, s, E) 0/1
        combine = (F.one_hot(chosen, self.experts) * weights[..., None]).sum(dim=2)
        slots = torch.einsum("bse,bsh->ebsh", routed * 1.0, x)                 # dispatch
        gate = torch.einsum("ebsh,ehf->ebsf", slots, self.w1)
        up = torch.einsum("ebsh,ehf->ebsf", slots, self.w3)
        y = torch.einsum("ebsf,efh->ebsh", F.silu(gate) * up, self.w2)
        return torch.einsum("bse,ebsh->bsh", combine, y)                       # combine


class MoETransformer(Llama):
    """Llama with the feed-forward of every block replaced by the mixture of experts."""

    def __init__(self, cfg: MoEConfig):
        super().__init__(cfg, mlp=MoE)


def small(batch: int = 8):
    """FACTORY for the CLI: a 2-layer decoder with 4-expert top-2 MoE MLPs, its batch and loss."""
    torch.manual_seed(0)
    cfg = MoEConfig()
    model = MoETransformer(cfg)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    target = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    return model, (idx, target), lm_loss


def grouped(batch: int = 8):
    """FACTORY: the same decoder with GShard-style grouped dispatch (expert parallel by all-to-all)."""
    torch.manual_seed(0)
    cfg = MoEConfig(grouped=True)
    model = MoETransformer(cfg)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    target = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    return model, (idx, target), lm_loss

"""The example GPT with its LM head tied to the token embedding (as in GPT-2):
one parameter under two names."""
import torch

from gpt import GPT, GPTConfig, lm_loss


def small(batch: int = 8):
    """FACTORY: a 2-layer GPT whose head shares the embedding's weight."""
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    model.head.weight = model.tok.weight
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    target = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    return model, (idx, target), lm_loss

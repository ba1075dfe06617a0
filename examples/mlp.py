"""A multi-layer perceptron regressor: Linear -> ReLU -> Linear, mean squared error.
The smallest model that has a data-parallel and a tensor-parallel plan."""
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int, d_out: int, layers: int = 2):
        super().__init__()
        if layers < 1:
            raise ValueError(f"layers must be at least 1, got {layers}")
        dims = [d_in] + [hidden] * (layers - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


def make(batch: int = 8, hidden: int = 64, d_in: int = 32, d_out: int = 16, layers: int = 2):
    """FACTORY with every size a parameter: (model, (x, y), mse_loss)."""
    torch.manual_seed(0)
    model = MLP(d_in, hidden, d_out, layers)
    x = torch.randn(batch, d_in)
    y = torch.randn(batch, d_out)
    return model, (x, y), F.mse_loss


def small(batch: int = 8):
    """FACTORY for the CLI: a 2-layer MLP 32 -> 64 -> 16."""
    return make(batch)


def wide(batch: int = 64):
    """FACTORY: a wider MLP (256 -> 1024 -> 256) whose plan shards its weights."""
    return make(batch, hidden=1024, d_in=256, d_out=256)

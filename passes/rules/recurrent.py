"""Recurrent layers (nn.LSTM, nn.GRU, nn.RNN): one ATen op runs every layer
and time step."""
from __future__ import annotations

from torch.ops import aten

from autopar.ir import OpInfo
from autopar.passes.rules.base import ReplicatedOnly, register
from autopar.passes.strategy import R, Row, S

RECURRENT = (aten.lstm.input, aten.gru.input, aten.rnn_tanh.input, aten.rnn_relu.input)
"""Their arguments alike: input, the initial state (a list of two tensors
for LSTM), the weights, has_biases, num_layers, dropout, train,
bidirectional, batch_first."""


@register(*RECURRENT, matmul=True)
def recurrent_rule(info: OpInfo):
    """Batch split: each sequence runs its own recurrence over the same,
    replicated weights, so its outputs and final states split with it (the
    weights' gradients are Partial sums). The states always have the batch on
    dim 1; the input and output on dim 1 too when time-major (PyTorch's
    default), on dim 0 with batch_first. Refused with the reason: dropout
    between layers in training (every shard would draw the same mask),
    unbatched input."""
    x = info.inputs[0]
    states = 2 if info.target is aten.lstm.input else 1
    n_in = len(info.inputs)
    dropout, train, batch_first = info.arg(5, "dropout"), info.arg(6, "train"), info.arg(8, "batch_first")
    if x.ndim != 3:
        raise ReplicatedOnly("an unbatched sequence has no batch dim to split")
    if dropout and train and info.arg(4, "num_layers") > 1:
        raise ReplicatedOnly(f"dropout={dropout} between its layers in training would draw the same mask on "
                             "every batch shard")
    rows = [Row(R, (R,) * n_in)]
    batch = S(0) if batch_first else S(1)
    if x.shape[batch.dim] > 1:
        inputs = (batch,) + (S(1),) * states + (R,) * (n_in - 1 - states)
        rows.append(Row(batch, inputs, (batch,) + (S(1),) * states if batch_first else None))
    return rows

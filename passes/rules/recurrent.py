"""Recurrent layers (nn.LSTM, nn.GRU, nn.RNN): one ATen op runs every layer
and time step."""
from __future__ import annotations

from torch.ops import aten

from autopar.passes.rules import OpInfo, ReplicatedOnly, register
from autopar.passes.strategy import R, Row, S

RECURRENT = (aten.lstm.input, aten.gru.input, aten.rnn_tanh.input, aten.rnn_relu.input)
"""Their arguments alike: input, the initial state (a list of two tensors
for LSTM), the weights, has_biases, num_layers, dropout, train,
bidirectional, batch_first."""


@register(*RECURRENT, matmul=True)
def recurrent_rule(info: OpInfo):
    """Batch split: each sequence runs its own recurrence over the same,
    replicated weights, so its outputs and final states split with it (the
    weights' gradients are Partial sums). Time-major input (batch_first
    False, PyTorch's default) has the batch on dim 1 of the input, of the
    output and of every state tensor: one placement says all of them.
    Refused with the reason: batch_first (the output's batch is dim 0, the
    states' dim 1, which one placement cannot say), dropout between layers
    in training (every shard would draw the same mask), unbatched input."""
    x = info.inputs[0]
    states = 2 if info.target is aten.lstm.input else 1
    n_in = len(info.inputs)
    dropout, train, batch_first = info.arg(5, "dropout"), info.arg(6, "train"), info.arg(8, "batch_first")
    if x.ndim != 3:
        raise ReplicatedOnly("an unbatched sequence has no batch dim to split")
    if batch_first:
        raise ReplicatedOnly("with batch_first=True its output has the batch on dim 0 and its final states on "
                             "dim 1, which one placement cannot describe; a time-major layer (batch_first=False) "
                             "splits the batch")
    if dropout and train and info.arg(4, "num_layers") > 1:
        raise ReplicatedOnly(f"dropout={dropout} between its layers in training would draw the same mask on "
                             "every batch shard")
    rows = [Row(R, (R,) * n_in)]
    if x.shape[1] > 1:
        rows.append(Row(S(1), (S(1),) * (1 + states) + (R,) * (n_in - 1 - states)))
    return rows

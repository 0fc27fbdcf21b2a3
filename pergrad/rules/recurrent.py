"""Per-sample gradients of ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM``, by one small backward per sample.

A recurrent layer's weight gradient sums over time steps through the recurrence, so it has no
outer-product form, and torch.func cannot vmap PyTorch's fused RNN kernels. This rule re-runs the
layer on each sample alone and pulls that sample's output gradient back to the weights with
autograd: exact, and B times one sample's backward of the layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from ..errors import UnsupportedLayerError
from ..registry import LayerCall, default_registry

_Recurrent = (nn.RNN, nn.GRU, nn.LSTM)


def _sample(state: Any, i: int) -> Any:
    """Sample i of an initial state ``[layers * directions, B, H]`` (or the LSTM's pair of them)."""
    if state is None:
        return None
    if isinstance(state, tuple):
        return tuple(s.narrow(1, i, 1) for s in state)
    return state.narrow(1, i, 1)


@default_registry.register(*_Recurrent, all_inputs=True)
def recurrent(layer: nn.Module, call: LayerCall, d: Tensor) -> dict[str, Tensor]:
    """``g_i = (d output_i / d theta)^T d_i`` for sample i's input and initial state alone.

    Index conventions: n sample; d: [n, *output of one sample] (the output sequence only: gradients
    reaching ``h_n``/``c_n`` are not seen, and the wrapper's first-backward check reports it if they
    matter). The layer's own ``batch_first`` must match the wrapper's.
    """
    assert isinstance(layer, nn.RNNBase)
    x = call.args[0] if call.args else call.kwargs["input"]
    state = call.args[1] if len(call.args) > 1 else call.kwargs.get("hx")
    if isinstance(x, PackedSequence):
        raise UnsupportedLayerError(
            f"{type(layer).__name__} was called with a PackedSequence: pergrad's recurrent rule needs padded "
            "tensors (pad_packed_sequence), with the loss masking the padding"
        )
    if layer.training and layer.dropout > 0:
        raise UnsupportedLayerError(
            f"{type(layer).__name__} has dropout={layer.dropout} between layers in training mode: re-running a "
            "sample draws new dropout masks, so its gradient cannot be recomputed exactly. Use dropout=0 or eval()"
        )
    params = {n: p for n, p in layer.named_parameters() if p.requires_grad}
    batch_dim = 0 if layer.batch_first else 1
    out = {n: d.new_zeros((d.shape[0], *p.shape)) for n, p in params.items()}
    with torch.enable_grad():
        for i in range(d.shape[0]):
            xi = x.narrow(batch_dim, i, 1).detach()
            output = layer.forward(xi, _sample(state, i))[0]  # forward(): no hooks, nothing kept
            grads = torch.autograd.grad(output, list(params.values()), d[i].unsqueeze(batch_dim), allow_unused=True)
            for (name, _), g in zip(params.items(), grads, strict=True):
                if g is not None:
                    out[name][i] = g
    return out

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
    matter). The layer's own ``batch_first`` must match the wrapper's. With a ``PackedSequence``
    input, each sample runs on its own steps only, and d is the gradient of the packed data.
    """
    assert isinstance(layer, nn.RNNBase)
    x = call.args[0] if call.args else call.kwargs["input"]
    state = call.args[1] if len(call.args) > 1 else call.kwargs.get("hx")
    if layer.training and layer.dropout > 0:
        raise UnsupportedLayerError(
            f"{type(layer).__name__} has dropout={layer.dropout} between layers in training mode: re-running a "
            "sample draws new dropout masks, so its gradient cannot be recomputed exactly. Use dropout=0 or eval()"
        )
    params = {n: p for n, p in layer.named_parameters() if p.requires_grad}
    batch_dim = 0 if layer.batch_first else 1
    samples = _packed_samples(x, d) if isinstance(x, PackedSequence) else _padded_samples(x, d, batch_dim)
    out = {n: d.new_zeros((len(samples), *p.shape)) for n, p in params.items()}
    with torch.enable_grad():
        for i, (xi, di) in enumerate(samples):
            xi = xi.detach().unsqueeze(batch_dim)
            output = layer.forward(xi, _sample(state, i))[0]  # forward(): no hooks, nothing kept
            grads = torch.autograd.grad(output, list(params.values()), di.reshape(output.shape), allow_unused=True)
            for (name, _), g in zip(params.items(), grads, strict=True):
                if g is not None:
                    out[name][i] = g
    return out


def _padded_samples(x: Tensor, d: Tensor, batch_dim: int) -> list[tuple[Tensor, Tensor]]:
    """Each sample's input sequence and output gradient, from a padded batch (d: batch on dim 0)."""
    return [(x.select(batch_dim, i), d[i]) for i in range(d.shape[0])]


def _packed_samples(x: PackedSequence, d: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Each sample's own steps, in the caller's order, from a PackedSequence and the gradient of its
    data (time-major blocks, each block sorted by length: row = start of step t + sorted position)."""
    sizes = x.batch_sizes
    starts = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    n = int(sizes[0])
    position = x.unsorted_indices if x.unsorted_indices is not None else torch.arange(n)
    samples = []
    for i in range(n):
        p = int(position[i])
        rows = (starts[: int((sizes > p).sum())] + p).to(x.data.device)
        samples.append((x.data[rows], d[rows]))
    return samples

"""Per-sample gradients of ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM``, by one small backward per sample.

A recurrent layer's weight gradient sums over time steps through the recurrence, so it has no
outer-product form, and torch.func cannot vmap PyTorch's fused RNN kernels. This rule re-runs the
layer on each sample alone and pulls that sample's output gradient back to the weights with
autograd: exact, and B times one sample's backward of the layer. The rule takes the gradients of
all the layer's outputs (``output, h_n`` or ``output, (h_n, c_n)``): a classifier reading ``h_n``
gets them as one reading the output sequence does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from pergrad._core.memory.layout import recorded

from ..errors import UnsupportedLayerError
from ..registry import LayerCall, OutputGrads, default_registry, output_tensors
from .fallback import RERUNNING

_Recurrent = (nn.RNN, nn.GRU, nn.LSTM)


def _sample(state: Any, i: int) -> Any:
    """Sample i of an initial state ``[layers * directions, B, H]`` (or the LSTM's pair of them)."""
    if state is None:
        return None
    if isinstance(state, tuple):
        return tuple(s.narrow(1, i, 1) for s in state)
    return state.narrow(1, i, 1)


def _output_dims(layer: nn.Module, output: Any, batch_dim: int) -> tuple[int | None, ...]:
    """``output, h_n`` (``output, (h_n, c_n)`` for an LSTM): the output sequence has the batch on
    the wrapper's batch dim (its data, as it is, for a PackedSequence); ``h_n`` and ``c_n`` are
    ``[layers * directions, B, H]`` whatever ``batch_first`` is, in the caller's sample order."""
    sequence = None if isinstance(output[0], PackedSequence) else batch_dim
    return (sequence, *(1 for _ in output_tensors(output[1])))


@default_registry.register(*_Recurrent, all_inputs=True, output_dims=_output_dims)
def recurrent(layer: nn.Module, call: LayerCall, d: OutputGrads | Tensor) -> dict[str, Tensor]:
    """``g_i = sum_k (d output_k,i / d theta)^T d_k,i`` for sample i's input and initial state alone,
    over the outputs ``k`` that received a gradient (the output sequence, ``h_n``, ``c_n``): one
    backward per sample with all of them.

    Index conventions: n sample; d: one gradient per output tensor (None where none arrived), each
    [n, *that output of one sample] (``h_n``: [n, layers * directions, H]); a bare tensor is the
    output sequence's alone. The layer's own ``batch_first`` must match the wrapper's. With a
    ``PackedSequence`` input, each sample runs on its own steps only, and the output sequence's
    gradient is that of the packed data.
    """
    assert isinstance(layer, nn.RNNBase)
    grads = (d,) if isinstance(d, Tensor) else d
    x = call.args[0] if call.args else call.kwargs["input"]
    state = call.args[1] if len(call.args) > 1 else call.kwargs.get("hx")
    if layer.training and layer.dropout > 0:
        raise UnsupportedLayerError(
            f"{type(layer).__name__} has dropout={layer.dropout} between layers in training mode: re-running a "
            "sample draws new dropout masks, so its gradient cannot be recomputed exactly. Use dropout=0 or eval()"
        )
    params = {n: p for n, p in layer.named_parameters() if p.requires_grad}
    batch_dim = 0 if layer.batch_first else 1
    inputs = _packed_samples(x) if isinstance(x, PackedSequence) else _padded_samples(x, batch_dim)
    like = next(g for g in grads if g is not None)
    second = recorded()  # create_graph=True: g_i differentiable (w.r.t. the parameters and the input)
    found_per_sample: list[tuple[Tensor | None, ...]] = []
    with torch.enable_grad():
        for i, (xi, rows) in enumerate(inputs):
            xi = xi if second else xi.detach()
            outputs = output_tensors(layer.forward(xi.unsqueeze(batch_dim), _sample(state, i)))  # no hooks
            pairs = [
                (o, (g[i] if rows is None or k > 0 else g[rows]).reshape(o.shape))
                for k, (o, g) in enumerate(zip(outputs, grads, strict=False))
                if g is not None
            ]
            found_per_sample.append(
                torch.autograd.grad(
                    [o for o, _ in pairs],
                    list(params.values()),
                    [g for _, g in pairs],
                    allow_unused=True,
                    create_graph=second,
                )
            )
    return {
        name: torch.stack([_or_zeros(f[k], p, like) for f in found_per_sample])
        if found_per_sample
        else like.new_zeros((0, *p.shape))
        for k, (name, p) in enumerate(params.items())
    }


RERUNNING.add(recurrent)


def _or_zeros(g: Tensor | None, p: Tensor, like: Tensor) -> Tensor:
    return like.new_zeros(p.shape) if g is None else g


def _padded_samples(x: Tensor, batch_dim: int) -> list[tuple[Tensor, None]]:
    """Each sample's input sequence, from a padded batch (its output gradients: row i of each)."""
    return [(x.select(batch_dim, i), None) for i in range(x.shape[batch_dim])]


def _packed_samples(x: PackedSequence) -> list[tuple[Tensor, Tensor]]:
    """Each sample's own steps, in the caller's order, from a PackedSequence, with their rows in its
    data (time-major blocks, each block sorted by length: row = start of step t + sorted position),
    where the output's gradient has them too."""
    sizes = x.batch_sizes
    starts = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    n = int(sizes[0])
    position = x.unsorted_indices if x.unsorted_indices is not None else torch.arange(n)
    samples = []
    for i in range(n):
        p = int(position[i])
        rows = (starts[: int((sizes > p).sum())] + p).to(x.data.device)
        samples.append((x.data[rows], rows))
    return samples

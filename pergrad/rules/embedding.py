"""Per-sample gradients of ``nn.Embedding``: row ``idx`` of the weight receives the output gradient."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..registry import default_registry


@default_registry.register(nn.Embedding)
def embedding(layer: nn.Module, idx: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``g_i(W)[v] = sum_{t : idx_it = v} d_it``; the ``padding_idx`` row stays zero, as in autograd.

    Index conventions: n sample, t token positions (all dims after the batch), v vocabulary row,
    e embedding features. idx: [n, t], d: [n, t, e]. Computed as one ``index_add`` into the
    flattened ``[n * v, e]`` result.
    """
    assert isinstance(layer, nn.Embedding)
    if not layer.weight.requires_grad:
        return {}
    n, (vocab, dim) = idx.shape[0], layer.weight.shape
    flat_rows = (idx.reshape(n, -1) + torch.arange(n, device=idx.device).unsqueeze(1) * vocab).reshape(-1)
    out = d.new_zeros(n * vocab, dim)
    out.index_add_(0, flat_rows, d.reshape(-1, dim))
    out = out.view(n, vocab, dim)
    if layer.padding_idx is not None:
        out[:, layer.padding_idx] = 0
    return {"weight": out}

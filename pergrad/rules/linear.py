"""Per-sample gradients of ``nn.Linear``: ``y = a W^T + b``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..layout import rows
from ..registry import default_registry


@default_registry.register(nn.Linear)
def linear(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``g_i(W) = sum_s d_is a_is^T``, ``g_i(b) = sum_s d_is``.

    Index conventions: n sample, s shared positions (all dims between batch and features),
    i input features, o output features. a: [n, s, i], d: [n, s, o].
    """
    assert isinstance(layer, nn.Linear)
    out: dict[str, Tensor] = {}
    if layer.weight.requires_grad:
        if a.dim() == 2:
            # one position per sample: an outer product, written once, nothing summed
            out["weight"] = torch.mul(d.unsqueeze(2), a.unsqueeze(1))  # [n, o, i]
        else:
            out["weight"] = torch.bmm(rows(d).transpose(1, 2), rows(a))  # nso,nsi->noi
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = d.clone() if d.dim() == 2 else rows(d).sum(1)
    return out

"""Per-sample gradients of normalisation layers with an elementwise affine ``y = x_hat * w + b``."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..registry import default_registry


def affine_grads(layer: nn.Module, x_hat: Tensor, d: Tensor, sum_dims: tuple[int, ...]) -> dict[str, Tensor]:
    """``g_i(w) = sum_{dims} d_i * x_hat_i``, ``g_i(b) = sum_{dims} d_i``, summed over ``sum_dims``
    (every axis the affine parameters are broadcast along, except the batch)."""
    out: dict[str, Tensor] = {}
    weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
    if isinstance(weight, nn.Parameter) and weight.requires_grad:
        wd = d * x_hat
        out["weight"] = wd.sum(sum_dims) if sum_dims else wd
    if isinstance(bias, nn.Parameter) and bias.requires_grad:
        out["bias"] = d.sum(sum_dims) if sum_dims else d.clone()
    return out


@default_registry.register(nn.LayerNorm)
def layer_norm(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``x_hat = (a - mean) / sqrt(var + eps)`` over the trailing ``normalized_shape`` dims.

    Index conventions: a, d: [n, *shared, *normalized_shape]; the shared dims are summed.
    """
    assert isinstance(layer, nn.LayerNorm)
    x_hat = F.layer_norm(a, layer.normalized_shape, eps=layer.eps)
    shared = tuple(range(1, a.dim() - len(layer.normalized_shape)))
    return affine_grads(layer, x_hat, d, shared)

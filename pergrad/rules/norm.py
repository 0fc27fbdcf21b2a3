"""Per-sample gradients of normalisation layers with an elementwise affine ``y = x_hat * w + b``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..registry import default_registry


def affine_grads(layer: nn.Module, x_hat: Tensor, d: Tensor, sum_dims: tuple[int, ...]) -> dict[str, Tensor]:
    """``g_i(w) = sum_{dims} d_i * x_hat_i``, ``g_i(b) = sum_{dims} d_i``, summed over ``sum_dims``
    (every axis the affine parameters are broadcast along, except the batch). ``x_hat`` is the caller's
    temporary, given up: it may be overwritten."""
    out: dict[str, Tensor] = {}
    weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
    if isinstance(weight, nn.Parameter) and weight.requires_grad:
        out["weight"] = _dot(d, x_hat, sum_dims)
    if isinstance(bias, nn.Parameter) and bias.requires_grad:
        out["bias"] = d.sum(sum_dims) if sum_dims else d.clone()
    return out


def _dot(d: Tensor, x: Tensor, dims: tuple[int, ...]) -> Tensor:
    """``(d * x).sum(dims)``, ``x`` a temporary it may overwrite; over trailing dims of contiguous tensors
    as one batched dot product (a bmm), without the product's temporary."""
    if not dims:
        return d * x
    trailing = dims == tuple(range(d.dim() - len(dims), d.dim()))
    if not (trailing and d.is_contiguous() and x.is_contiguous()):
        # the product in x's memory where autograd need not see it: a second temporary of x's size
        # alive beside it makes the allocator hand fresh pages back and forth (a page fault per 4 KiB)
        inplace = x.shape == d.shape and x.dtype == d.dtype and not (x.requires_grad or d.requires_grad)
        return (x.mul_(d) if inplace else d * x).sum(dims)
    length = math.prod(d.shape[i] for i in dims)
    lhs, rhs = d.reshape(-1, 1, length), x.reshape(-1, length, 1)
    return torch.bmm(lhs, rhs).view(d.shape[: d.dim() - len(dims)])


def _as_computed(a: Tensor, d: Tensor) -> Tensor:
    """The layer's input in the dtype it was normalised in: autocast runs the norms in float32 on a
    lower-precision input (a bf16 conv output on CUDA), and their output, hence ``d``, is float32."""
    wider = torch.promote_types(a.dtype, d.dtype)
    return a if wider == a.dtype else a.to(wider)


@default_registry.register(nn.LayerNorm)
def layer_norm(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``x_hat = (a - mean) / sqrt(var + eps)`` over the trailing ``normalized_shape`` dims.

    Index conventions: a, d: [n, *shared, *normalized_shape]; the shared dims are summed.
    """
    assert isinstance(layer, nn.LayerNorm)
    a = _as_computed(a, d)
    # a weight of ones gives the same values (x * 1 is exact) by the affine kernel, twice as fast on the CPU
    ones = torch.ones(layer.normalized_shape, dtype=a.dtype, device=a.device)
    x_hat = F.layer_norm(a, layer.normalized_shape, ones, eps=layer.eps)
    shared = tuple(range(1, a.dim() - len(layer.normalized_shape)))
    return affine_grads(layer, x_hat, d, shared)


@default_registry.register(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, batch_dim_fixed=True)
def batch_norm_eval(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """BatchNorm with its running statistics (eval mode): ``x_hat = (a - mean) / sqrt(var + eps)``
    with the fixed running mean and variance, so samples do not mix and ``g_i`` is defined.

    Index conventions: a, d: [n, c, *spatial]; the spatial dims are summed. Training mode, or
    ``track_running_stats=False``, normalises with batch statistics: the wrapper refuses those in
    the forward, before this rule could run.
    """
    assert isinstance(layer, nn.modules.batchnorm._BatchNorm)
    a = _as_computed(a, d)
    assert layer.running_mean is not None and layer.running_var is not None
    shape = (1, -1, *([1] * (a.dim() - 2)))
    x_hat = (a - layer.running_mean.view(shape)) * (layer.running_var.view(shape) + layer.eps).rsqrt()
    return affine_grads(layer, x_hat, d, tuple(range(2, a.dim())))


@default_registry.register(nn.GroupNorm, batch_dim_fixed=True)
def group_norm(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``x_hat``: each sample's channels normalised within their group (statistics of the sample alone).

    Index conventions: a, d: [n, c, *spatial]; the spatial dims are summed.
    """
    assert isinstance(layer, nn.GroupNorm)
    a = _as_computed(a, d)
    x_hat = F.group_norm(a, layer.num_groups, eps=layer.eps)
    return affine_grads(layer, x_hat, d, tuple(range(2, a.dim())))


@default_registry.register(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, batch_dim_fixed=True)
def instance_norm(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``x_hat`` from each sample's own per-channel statistics, or from the running ones in eval mode
    with ``track_running_stats=True`` (training mode updates the running buffers, which mixes
    nothing into any sample's output). Index conventions: a, d: [n, c, *spatial]; spatial summed.
    """
    assert isinstance(layer, nn.modules.instancenorm._InstanceNorm)
    a = _as_computed(a, d)
    spatial = tuple(range(2, a.dim()))
    if layer.training or layer.running_mean is None or layer.running_var is None:
        mean, var = a.mean(spatial, keepdim=True), a.var(spatial, unbiased=False, keepdim=True)
    else:
        shape = (1, -1, *([1] * len(spatial)))
        mean, var = layer.running_mean.view(shape), layer.running_var.view(shape)
    return affine_grads(layer, (a - mean) * (var + layer.eps).rsqrt(), d, spatial)


@default_registry.register(nn.RMSNorm)
def rms_norm(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``x_hat = a / sqrt(mean(a^2) + eps)`` over the trailing ``normalized_shape`` dims (``eps=None``:
    the dtype's machine epsilon, as PyTorch). Index conventions: a, d: [n, *shared, *normalized]."""
    assert isinstance(layer, nn.RMSNorm)
    a = _as_computed(a, d)
    dims = tuple(range(a.dim() - len(layer.normalized_shape), a.dim()))
    eps = torch.finfo(a.dtype).eps if layer.eps is None else layer.eps
    x_hat = a * (a.square().mean(dims, keepdim=True) + eps).rsqrt()
    return affine_grads(layer, x_hat, d, tuple(range(1, a.dim() - len(layer.normalized_shape))))

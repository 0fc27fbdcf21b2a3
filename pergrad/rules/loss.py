"""``nn.LinearCrossEntropyLoss`` (torch 2.13): the logits ``z = W x + b`` and their cross-entropy in one
module, whose ``linear`` child holds ``W`` and ``b`` but is never called.

The layer returns the loss itself: reduced over the batch (``"mean"``, ``"sum"``) or one per sample
and position (``"none"``). Sample i's part of it depends on ``z_i = W x_i + b`` alone (a ``"mean"``
divides by a count or weight sum fixed by the targets), so ``dL/dz_i``, read off cross-entropy's
own backward on the recomputed logits, times ``x_i`` is sample i's gradient of ``W``: with
``loss_reduction="sum"`` the gradient of its own loss, with ``"mean"`` B times its share of the
batch's (the mean of its positions' losses when every sample has as many counted positions, as
``mean`` over ``[B, *out_features]`` targets without ``ignore_index`` hits or class weights has).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import BatchSizeError, TokenLossWarning
from ..registry import LayerCall, OutputGrads, default_registry

_LOSS = getattr(nn, "LinearCrossEntropyLoss", None)


def _arguments(call: LayerCall) -> tuple[Tensor, Tensor]:
    names = ("input", "target")
    found = list(call.args[:2]) + [call.kwargs[n] for n in names[len(call.args[:2]) :]]
    return found[0], found[1]


def output_dims(layer: nn.Module, output: Any, batch_dim: int) -> tuple[int | None, ...]:
    """The loss per sample and position (``reduction="none"``) has the batch on dim 0; a reduced
    loss has none (the batch size is then its input's)."""
    return (0,) if layer.reduction == "none" else (None,)


def _check_mean(weight: Tensor | None, target: Tensor, ignore_index: int) -> None:
    """``reduction="mean"`` divides by the weight of the whole batch's counted positions (their number,
    without class weights): each sample's share is the mean of its own positions' losses only when
    every sample counts as much. Warn (one host sync per backward) when they differ."""
    counted = target != ignore_index
    # an ignore_index outside [0, C) indexes no class weight: those positions count 0, whatever they would index
    each = counted.to(torch.float64) if weight is None else torch.where(counted, weight[target.where(counted, 0)], 0)
    per_sample = each.reshape(target.shape[0], -1).sum(1)
    if per_sample.numel() > 1 and bool(per_sample.min() != per_sample.max()):
        warnings.warn(
            "pergrad: nn.LinearCrossEntropyLoss(reduction='mean') divides by the "
            + ("class weights" if weight is not None else "number")
            + " of the whole batch's counted targets (those not equal to ignore_index), and its samples count "
            f"differently ({float(per_sample.min()):g} to {float(per_sample.max()):g}): each sample's share is "
            "divided by the whole batch's count, so grad_sample is not the gradient of any sample's own loss and a "
            "clipping bound moves with the other samples' targets. Use reduction='none' and sum (or average) each "
            "sample's positions yourself, or reduction='sum' (loss_reduction='sum').",
            TokenLossWarning,
            stacklevel=2,
        )


def linear_cross_entropy(layer: nn.Module, call: LayerCall, d: OutputGrads) -> dict[str, Tensor]:
    """``g_i(W)[c, k, :] = dL/dz_i[c, k] x_i``, ``g_i(b)[c, k] = dL/dz_i[c, k]``, flattened as ``linear``
    stores them.

    n: sample, c: class, k: the loss's positions (``out_features``, flattened), i: input features.
    """
    module: Any = layer  # an nn.LinearCrossEntropyLoss (not a class pergrad can name before torch 2.13)
    x, target = _arguments(call)
    if x.dim() != 2:
        raise BatchSizeError(
            f"nn.LinearCrossEntropyLoss got input of shape {tuple(x.shape)}; pergrad needs a batch, [N, in_features]"
        )
    linear: nn.Linear = module.linear
    (g,) = d
    if g is None:
        return {}
    ignore_index = -100 if module.ignore_index is None else module.ignore_index
    if module.reduction == "mean" and not target.is_floating_point():
        _check_mean(module.weight, target, ignore_index)
    dtype = linear.weight.dtype
    x = x.to(dtype)
    logits_shape = (x.shape[0], module.num_classes, *module.out_features)
    with torch.enable_grad():
        z = F.linear(x, linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        z = z.reshape(logits_shape).detach().requires_grad_()
        loss = F.cross_entropy(
            z,
            target,
            weight=module.weight,
            reduction=module.reduction,
            ignore_index=ignore_index,
            label_smoothing=module.label_smoothing,
        )
        (dz,) = torch.autograd.grad(loss, z, g.to(loss.dtype))
    dz = dz.reshape(x.shape[0], math.prod(logits_shape[1:]))  # [n, c * k], as linear stores its rows
    out: dict[str, Tensor] = {}
    if linear.weight.requires_grad:
        out["linear.weight"] = torch.einsum("no,ni->noi", dz, x)
    if linear.bias is not None and linear.bias.requires_grad:
        out["linear.bias"] = dz
    return out


if _LOSS is not None:
    default_registry.register(_LOSS, all_inputs=True, subtree=True, batch_dim_fixed=True, output_dims=output_dims)(
        linear_cross_entropy
    )

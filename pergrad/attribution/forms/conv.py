"""Projected forms of the convolutions (``nn.Conv1d/2d/3d``) and transposed convolutions: the Kronecker
features of ``g_i(W) = sum_{g,l} d_i[g, :, l] patch_i[g, l]^T`` with ``P_col`` applied to every patch as a
convolution (nothing unfolded)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pergrad.attribution.projectors import Projector, add_kron_features
from pergrad.rules.conv import (
    CONV_TRANSPOSES,
    CONVS,
    FEW_CHANNELS,
    batch_as_groups,
    batch_as_groups_is_faster,
    bias_sums,
    conv_args,
    im2col,
    input_and_padding,
    transpose_twin,
    transpose_window,
)


def conv_project(
    layer: nn.Module, a: Tensor, d: Tensor, projectors: dict[str, Projector], total: Tensor, scale: float
) -> bool:
    """``total += scale P vec(g_i)``, ``P vec(g_i) = sum_{g,l} (P_row[:, g] d_i[g, :, l]) (P_col patch_i[g, l])^T`` for the weight
    ``[O, C/g, *kernel]`` (``P_row [p, O]``, ``P_col [q, C/g * k]``): for one group by the cheapest of
    ``_conv_kron``'s contractions; for several, from the factors (``conv_factors``: ``P_col`` applied to every
    patch as a convolution of ``a`` with ``P_col`` as a ``[q, C/g, *kernel]`` weight repeated once per group,
    ``P_row d`` a contraction over each group's output channels). The bias's block is applied to
    ``sum_l d_i[:, l]``. False, adding nothing, if the weight's block is dense (``g_i`` must be built)."""
    weight = projectors.get("weight")
    if weight is not None and weight.kron and layer.groups == 1:  # channels first throughout: nothing transposed
        _conv_kron(layer, a, d, weight, total, scale)
    else:
        factors = conv_factors(layer, a, d, projectors)
        if factors is None:
            return False
        for u, v in factors.values():
            add_kron_features(total, u, v, scale)
    if "bias" in projectors:
        projectors["bias"].apply(d.flatten(2).sum(2), total, scale)
    return True


def _conv_kron(layer: nn.Module, a: Tensor, d: Tensor, weight: Projector, total: Tensor, scale: float) -> None:
    """Adds ``conv_project``'s weight features for one group into ``total`` by whichever of three
    contractions costs the fewest flops (per sample; l positions, O outputs, w = C*k the patch width):

    - ``U V^T``, ``U = P_row d_i`` ``[n, p, l]``, ``V = conv(a_i, P_col)`` ``[n, q, l]`` (a bmm reading ``V``
      transposed in place, where ``conv_factors``' ``[n, l, q]`` layout copies both): ``l (w q + p (O + q))``;
    - ``P_row (d_i V^T)`` (few output channels: no ``U``): ``l (w q + O q) + O p q``;
    - ``(P_row g_i(W)) P_col^T``, ``P_row g_i(W)`` the weight gradient of ``U_i`` ``[n, p, w]`` (few input
      channels, an RGB stem: ``V`` would cost more than the gradient): ``l (O p + p w) + p w q``, by
      batch-as-groups or from the unfolded patches, whichever the weight rule would use (``conv``).
    """
    n = a.shape[0]
    row, col = weight.factors(d)
    (p, channels), (q, width) = row.shape, col.shape
    flat = d.reshape(n, channels, -1)
    out = total.view(n, p, q)
    positions = flat.shape[2]
    by_u = positions * (width * q + p * (channels + q))
    by_dv = positions * (width * q + channels * q) + channels * p * q
    by_gradient = positions * p * (channels + width) + p * width * q
    if by_gradient < min(by_u, by_dv):
        u = torch.matmul(row, flat)  # [n, p, l]
        if batch_as_groups_is_faster(layer, a, d):
            z = batch_as_groups(layer, a, u.view(n, p, *d.shape[2:])).view(n, p, width)
        else:  # (an RGB stem: 1.9 ms on [64, 3, 32, 32] -> 32 channels at 2 threads, against 5.2 by batch-as-groups)
            z = torch.bmm(u, im2col(layer, a).transpose(1, 2))  # npl,nwl->npw
        out.baddbmm_(z, col.T.expand(n, width, q), alpha=scale)
        return
    v = _projected_patches(layer, a, col)  # [n, q, l]
    if by_dv < by_u:
        out.baddbmm_(row.expand(n, p, channels), torch.bmm(flat, v.transpose(1, 2)), alpha=scale)  # [n, O, q]
    else:
        out.baddbmm_(torch.matmul(row, flat), v.transpose(1, 2), alpha=scale)  # U: [p, O] @ [n, O, l]


def _projected_patches(layer: nn.Module, a: Tensor, col: Tensor) -> Tensor:
    """``P_col`` applied to every patch of each group, ``[n, g*q, l]`` (l output positions, flattened): the
    convolution of ``a`` with ``P_col`` as a ``[q, C/g, *kernel]`` weight repeated once per group. For a 2-D
    input with few channels (``FEW_CHANNELS``; one group) the convolution runs channels-last, and the result
    is a transposed view of its ``[n, l, q]`` memory: on ``[64, 3, 32, 32]`` to 32 channels, 2 threads, 0.64
    ms, against 6.2 ms channels-first and 1.0 ms for ``P_col`` times the unfolded patches."""
    assert isinstance(layer, CONVS)
    n, groups, q = a.shape[0], layer.groups, col.shape[0]
    stride, zeros, dilation, _ = conv_args(layer)
    x, padding = input_and_padding(layer, a)
    kernel = col.reshape(q, *layer.weight.shape[1:])
    if groups == 1 and x.dim() == 4 and x.shape[1] < FEW_CHANNELS:
        x = x.contiguous(memory_format=torch.channels_last)
        y = torch.ops.aten.convolution(x, kernel, None, stride, padding, dilation, False, zeros, 1)
        return y.permute(0, 2, 3, 1).reshape(n, -1, q).transpose(1, 2)  # (a view where y is channels-last)
    if groups > 1:
        kernel = kernel.repeat(groups, *([1] * (x.dim() - 1)))
    y = torch.ops.aten.convolution(x, kernel, None, stride, padding, dilation, False, zeros, groups)
    return y.reshape(n, groups * q, -1)


def conv_factors(
    layer: nn.Module, a: Tensor, d: Tensor, projectors: dict[str, Projector]
) -> dict[str, tuple[Tensor, Tensor]] | None:
    """The weight's Kronecker factors at every (group, output position) ``(g, l)``
    (n sample, g group, o output channels of the group, l output positions, flattened; p and q
    projected features; d: [n, O, *out_positions], O = g*o):
    ``u = P_row[:, g] d_i[g, :, l]`` ``[n, g*l, p]`` and ``v = P_col patch_i[g, l]`` ``[n, g*l, q]``, as
    ``conv_project`` computes them (``P_col`` as a convolution, nothing unfolded); its features are
    ``vec(sum_{g,l} u v^T)``. None if the weight's block is dense."""
    assert isinstance(layer, CONVS)
    weight = projectors.get("weight")
    if weight is None:
        return {}
    if not weight.kron:
        return None
    n, groups = a.shape[0], layer.groups
    row, col = weight.factors(d)
    v = _projected_patches(layer, a, col).reshape(n, groups, col.shape[0], -1).transpose(2, 3)  # [n, g, l, q]
    u = torch.einsum("pgo,ngol->nglp", row.reshape(row.shape[0], groups, -1), d.reshape(n, groups, -1, v.shape[2]))
    return {"weight": (u.reshape(n, -1, row.shape[0]), v.reshape(n, -1, col.shape[0]))}


def conv_transpose_project(
    layer: nn.Module, a: Tensor, d: Tensor, projectors: dict[str, Projector], total: Tensor, scale: float
) -> bool:
    """``total += scale P vec(g_i)`` of the weight ``[C_in, C_out/g, *kernel]`` as the twin convolution's (``conv_project``
    with the window of ``d`` as its input and ``a`` as its output gradient: ``P_row`` over ``C_in``,
    ``P_col`` applied to every patch of the window by one convolution); the bias's block applied to
    ``sum_l d_i[:, l]``. False, adding nothing, if the weight's block is dense (``g_i`` must be built)."""
    assert isinstance(layer, CONV_TRANSPOSES)
    weight = projectors.get("weight")
    if weight is not None and not weight.kron:
        return False
    if weight is not None:
        conv_project(transpose_twin(layer), transpose_window(layer, d), a, {"weight": weight}, total, scale)
    if "bias" in projectors:
        projectors["bias"].apply(bias_sums(d), total, scale)
    return True

"""Per-sample gradients of ``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d`` (every constructor option).

A convolution is a Linear layer applied to every patch of the (padded) input, so the weight
gradient of one sample is the outer product of output gradients and patches, summed over output
positions -- the Linear rule on unfolded input, one product per group.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pergrad._core.memory.layout import new_buffer, owned, recorded

from ..registry import FusedRule, default_registry
from .linear import gram_is_cheaper, outer_sq_norms

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
# below this many input channels per group (an RGB stem), a convolution grouped by sample runs far below its
# flop rate on the CPU: the weight gradient unfolds the input instead, the Kronecker features convolve it with
# P_col channels-last (benchmarks/README.md)
FEW_CHANNELS = 8


def conv_padding(layer: nn.Module) -> list[int]:
    """The explicit padding the layer applies, in ``F.pad`` order (last dim first, left then right).

    ``padding="same"`` may pad one more on the right than on the left (even effective kernel).
    """
    assert isinstance(layer, CONVS)
    kernel, dilation = layer.kernel_size, layer.dilation
    if isinstance(layer.padding, str):
        if layer.padding == "valid":
            pairs = [(0, 0)] * len(kernel)
        else:  # "same": total padding dilation*(k-1), the odd one out on the right
            totals = [dl * (k - 1) for k, dl in zip(kernel, dilation)]
            pairs = [(t // 2, t - t // 2) for t in totals]
    else:
        pairs = [(p, p) for p in layer.padding]
    return [side for pair in reversed(pairs) for side in pair]


def padded_input(layer: nn.Module, a: Tensor) -> Tensor:
    """The input exactly as the convolution sees it after padding (any ``padding_mode``)."""
    assert isinstance(layer, CONVS)
    pad = conv_padding(layer)
    if not any(pad):
        return a
    mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
    return F.pad(a, pad, mode=mode)


def patches(x: Tensor, kernel: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...]) -> Tensor:
    """``[n, c, *spatial] -> [n, c, *out_positions, *kernel]`` (a strided view, no copy).

    Each spatial dim is windowed with the dilated kernel extent, then every ``dilation``-th
    element of a window is kept.
    """
    spatial = len(kernel)
    for dim, (k, s, dl) in enumerate(zip(kernel, stride, dilation)):
        x = x.unfold(2 + dim, dl * (k - 1) + 1, s)
    if any(dl > 1 for dl in dilation):
        every_dl: tuple[Any, ...] = (..., *(slice(None, None, dl) for dl in dilation))
        x = x[every_dl]
    assert x.dim() == 2 + 2 * spatial
    return x


@default_registry.register(*CONVS, batch_dim_fixed=True)
def conv(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``g_i(W)[g, o, c, k] = sum_l d_i[g, o, l] * patch_i[g, c, l, k]``, ``g_i(b)[o] = sum_l d_i[o, l]``.

    Index conventions: n sample, g group, o output channels of the group, c input channels of the
    group, l output positions (flattened), k kernel positions (flattened).
    a: [n, C, *spatial] (C = g*c), d: [n, O, *out_positions] (O = g*o).
    """
    assert isinstance(layer, CONVS)
    out: dict[str, Tensor] = {}
    n, groups = a.shape[0], layer.groups
    if layer.weight.requires_grad and batch_as_groups_is_faster(layer, a, d):
        out["weight"] = batch_as_groups(layer, a, d)
    elif layer.weight.requires_grad:
        p, dg = _as_linear(layer, a, d)  # [n*g, l, c*k], [n*g, l, o]
        if recorded():  # (second order: no out= buffer)
            out["weight"] = torch.bmm(dg.transpose(1, 2), p).view(n, *layer.weight.shape)
        else:
            result = new_buffer((n, *layer.weight.shape), d)
            torch.bmm(dg.transpose(1, 2), p, out=result.view(n * groups, -1, p.shape[2]))  # ngol,ngclk->ngock
            out["weight"] = result
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = owned(d.flatten(2).sum(2))
    return out


def input_and_padding(layer: nn.Module, a: Tensor) -> tuple[Tensor, list[int]]:
    """The input and padding to hand ``aten.convolution`` (and its backward): zero padding that is
    the same on both sides is left to the convolution; anything else is applied to a copy."""
    assert isinstance(layer, CONVS)
    pad = conv_padding(layer)
    if layer.padding_mode == "zeros" and pad[0::2] == pad[1::2]:
        return a, pad[-2::-2]
    return padded_input(layer, a), [0] * len(layer.kernel_size)


def batch_as_groups_is_faster(layer: nn.Module, a: Tensor, d: Tensor) -> bool:
    """Whether the batch-as-groups weight gradient beats unfold + bmm for these shapes.

    Measured on CPU (benchmarks/README.md): unfolding writes ``k`` copies of the input and is
    memory-bound, so it loses on 2-D/3-D inputs with many channels and many output positions;
    it wins for few input channels (an RGB stem), few positions, and 1-D inputs.
    """
    assert isinstance(layer, CONVS)
    channels = a.shape[1] // layer.groups
    positions = math.prod(d.shape[2:])
    return a.dim() >= 4 and channels >= FEW_CHANNELS and positions >= 4 * channels


def batch_as_groups(layer: nn.Module, a: Tensor, d: Tensor) -> Tensor:
    """``g_i(W)`` for every sample at once, ``[n, O, C/g, *kernel]``: the weight gradient of ONE
    convolution over the whole batch folded into the channels, ``[1, n*C, ...] -> [1, n*O, ...]``
    with ``n*g`` groups, so that no group mixes two samples. Computed by the convolution's own
    weight backward, with no unfolded copy of the input. (One group: ``d`` may have any number of
    channels, e.g. ``P_row d_i``: then ``P_row g_i(W)``.)
    """
    assert isinstance(layer, CONVS)
    n, groups, outputs = a.shape[0], layer.groups, d.shape[1]  # (outputs: any number, for one group)
    stride, zeros, dilation, _ = conv_args(layer)
    x, padding = input_and_padding(layer, a)
    shape = (n * outputs, *layer.weight.shape[1:])
    _, grad_w, _ = torch.ops.aten.convolution_backward(
        d.reshape(1, n * outputs, *d.shape[2:]), x.reshape(1, n * x.shape[1], *x.shape[2:]),
        x.new_empty(shape), None, stride, padding, dilation, False, zeros, n * groups, [False, True, False],
    )  # fmt: skip
    return owned(grad_w.view(n, outputs, *layer.weight.shape[1:]))


# -- fused: a convolution is the Linear layout [batch * groups, positions, patch] -------------------


def im2col(layer: nn.Module, a: Tensor) -> Tensor:
    """``[n, C, *spatial] -> [n, C*k, l]``: every receptive field of the padded input as a column,
    channels major and kernel positions minor (the weight's layout): one copy of a strided view of the
    padded input (``patches``), 2-12x faster than ``F.unfold`` on the CPU, the same values
    (``benchmarks/README.md``)."""
    assert isinstance(layer, CONVS)
    x = padded_input(layer, a)
    p = patches(x, layer.kernel_size, layer.stride, layer.dilation)  # [n, C, *l, *k]
    spatial = len(layer.kernel_size)
    order = (0, 1, *range(2 + spatial, 2 + 2 * spatial), *range(2, 2 + spatial))
    return p.permute(order).reshape(a.shape[0], -1, math.prod(p.shape[2 : 2 + spatial]))


def _as_linear(layer: nn.Module, a: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    """Patches ``[n*g, l, c*k]`` and output gradients ``[n*g, l, o]`` (one row per group), as
    transposed views: the Linear layout, with no copy beyond the unfold."""
    assert isinstance(layer, CONVS)
    n, groups = a.shape[0], layer.groups
    cols = im2col(layer, a)  # [n, C*k, l]
    p = cols.reshape(n * groups, cols.shape[1] // groups, cols.shape[2]).transpose(1, 2)
    dg = d.reshape(n * groups, d.shape[1] // groups, cols.shape[2]).transpose(1, 2)
    return p, dg


def conv_sq_norms(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``||g_i(W)||^2``: the Linear norm on unfolded patches, summed over groups."""
    assert isinstance(layer, CONVS)
    out = {}
    if layer.weight.requires_grad and batch_as_groups_is_faster(layer, a, d):
        out["weight"] = torch.linalg.vector_norm(batch_as_groups(layer, a, d).flatten(1), dim=1).square()
    elif layer.weight.requires_grad:
        p, dg = _as_linear(layer, a, d)
        out["weight"] = outer_sq_norms(p, dg).view(a.shape[0], layer.groups).sum(1)
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = d.flatten(2).sum(2).square().sum(1)
    return out


def conv_args(layer: nn.Module) -> tuple[list[int], list[int], list[int], int]:
    assert isinstance(layer, CONVS)
    zeros = [0] * len(layer.kernel_size)
    return list(layer.stride), zeros, list(layer.dilation), layer.groups


def conv_summed(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``sum_i g_i``: the convolution's own weight/bias backward (no unfold)."""
    assert isinstance(layer, CONVS)
    stride, zeros, dilation, groups = conv_args(layer)
    x, padding = input_and_padding(layer, a)
    out = {}
    if layer.weight.requires_grad:  # (mkldnn computes a bias gradient only together with this one)
        out["weight"] = torch.ops.aten.convolution_backward(
            d, x, layer.weight, None, stride, padding, dilation, False, zeros, groups, [False, True, False]
        )[1]
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = d.sum((0, *range(2, d.dim())))
    return out


def conv_dots(layer: nn.Module, a: Tensor, d: Tensor, other: dict[str, Tensor]) -> dict[str, Tensor]:
    """``<g_i(W), G> = sum_{o,l} d_i[o, l] * conv(a_i, G)[o, l]``: one convolution, no unfold."""
    assert isinstance(layer, CONVS)
    out = {}
    if layer.weight.requires_grad:
        stride, zeros, dilation, groups = conv_args(layer)
        x, padding = input_and_padding(layer, a)
        y = torch.ops.aten.convolution(x, other["weight"], None, stride, padding, dilation, False, zeros, groups)
        out["weight"] = (y * d).flatten(1).sum(1)
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = d.flatten(2).sum(2) @ other["bias"]
    return out


def conv_builds(layer: nn.Module, a: Tensor, d: Tensor) -> bool:
    """Whether ``conv_sq_norms`` builds every ``g_i`` (batch-as-groups or outer product, not Gram)."""
    assert isinstance(layer, CONVS)
    if batch_as_groups_is_faster(layer, a, d):
        return True
    channels, positions = a.shape[1] // layer.groups, math.prod(d.shape[2:])
    kernel = math.prod(layer.kernel_size)
    return not gram_is_cheaper(positions, channels * kernel, d.shape[1] // layer.groups)


CONV_FUSED = FusedRule(conv_sq_norms, conv_summed, conv_dots, bilinear=True, builds=conv_builds)
default_registry.register_fused(CONVS, CONV_FUSED)


# -- transposed convolutions: the weight gradient of the convolution they transpose ------------------

CONV_TRANSPOSES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def transpose_twin(layer: nn.Module) -> nn.Module:
    """The convolution whose input gradient ``layer`` computes: from ``C_out`` to ``C_in`` channels
    with the same kernel, stride, dilation and groups, on input padded beforehand (meta device:
    shapes only)."""
    assert isinstance(layer, CONV_TRANSPOSES)
    conv_type = CONVS[CONV_TRANSPOSES.index(type(layer))]
    # from the weight, [C_in, C_out / g, *kernel]: a lazy layer materialised by load_state_dict keeps in_channels=0
    c_in, c_out = layer.weight.shape[0], layer.weight.shape[1] * layer.groups
    geometry: dict[str, Any] = {
        "kernel_size": layer.kernel_size, "stride": layer.stride, "padding": 0,
        "dilation": layer.dilation, "groups": layer.groups,
    }  # fmt: skip
    return conv_type(c_out, c_in, bias=False, device="meta", **geometry)


@default_registry.register(*CONV_TRANSPOSES, batch_dim_fixed=True)
def conv_transpose(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``y = conv_transpose(a, W)`` is the input gradient of ``conv(., W)``, so ``g_i(W)`` is the
    weight gradient of that convolution with ``d_i`` as its input and ``a_i`` as its output
    gradient: the conv rule with the roles swapped. ``g_i(b)[o] = sum_l d_i[o, l]``.

    Index conventions as in ``conv``, with the convolution running from d (``C_out`` channels) to a
    (``C_in`` channels); W: [C_in, C_out / g, *kernel].
    """
    assert isinstance(layer, CONV_TRANSPOSES)
    out: dict[str, Tensor] = {}
    if layer.weight.requires_grad:
        out["weight"] = conv(transpose_twin(layer), transpose_window(layer, d), a)["weight"]
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = d.flatten(2).sum(2)
    return out


def transpose_window(layer: nn.Module, d: Tensor) -> Tensor:
    """``d`` as the input of the twin convolution (``transpose_twin``): padded by ``padding`` on the left; on
    the right by ``padding`` less the whole strides that ``output_padding`` added (those windows reach
    no input position; negative pads crop)."""
    assert isinstance(layer, CONV_TRANSPOSES)
    padding: tuple[int, ...] = tuple(int(p) for p in layer.padding)  # never a string for ConvTranspose
    pairs = [(p, p - s * (op // s)) for p, s, op in zip(padding, layer.stride, layer.output_padding, strict=True)]
    return F.pad(d, [side for pair in reversed(pairs) for side in pair])


# -- fused: the twin convolution's fused forms, with d as its input and a as its output gradient ----


def bias_sums(d: Tensor) -> Tensor:
    """``g_i(b) = sum_l d_i[:, l]``: ``[n, C_out]``."""
    return d.flatten(2).sum(2)


def conv_transpose_sq_norms(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``||g_i(W)||^2`` of the twin convolution (``conv_sq_norms``), ``||sum_l d_i[:, l]||^2``."""
    assert isinstance(layer, CONV_TRANSPOSES)
    out = {}
    if layer.weight.requires_grad:
        out["weight"] = conv_sq_norms(transpose_twin(layer), transpose_window(layer, d), a)["weight"]
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = bias_sums(d).square().sum(1)
    return out


def conv_transpose_summed(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``sum_i g_i``: the transposed convolution's own weight backward (no unfold)."""
    assert isinstance(layer, CONV_TRANSPOSES)
    out = {}
    if layer.weight.requires_grad:
        twin, window = transpose_twin(layer), transpose_window(layer, d)
        stride, zeros, dilation, groups = conv_args(twin)
        out["weight"] = torch.ops.aten.convolution_backward(
            a, window, layer.weight, None, stride, zeros, dilation, False, zeros, groups, [False, True, False]
        )[1]  # the twin's weight has the shape of layer.weight: [C_in, C_out / g, *kernel]
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = d.sum((0, *range(2, d.dim())))
    return out


def conv_transpose_dots(layer: nn.Module, a: Tensor, d: Tensor, other: dict[str, Tensor]) -> dict[str, Tensor]:
    """``<g_i(W), G>`` of the twin convolution (``conv_dots``: one convolution of the window of ``d``)."""
    assert isinstance(layer, CONV_TRANSPOSES)
    out = {}
    if layer.weight.requires_grad:
        out["weight"] = conv_dots(transpose_twin(layer), transpose_window(layer, d), a, {"weight": other["weight"]})[
            "weight"
        ]
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = bias_sums(d) @ other["bias"]
    return out


def conv_transpose_builds(layer: nn.Module, a: Tensor, d: Tensor) -> bool:
    assert isinstance(layer, CONV_TRANSPOSES)
    return conv_builds(transpose_twin(layer), transpose_window(layer, d), a)


CONV_TRANSPOSE_FUSED = FusedRule(
    conv_transpose_sq_norms, conv_transpose_summed, conv_transpose_dots, bilinear=True, builds=conv_transpose_builds
)
default_registry.register_fused(CONV_TRANSPOSES, CONV_TRANSPOSE_FUSED)

"""Hypothesis strategies that draw only valid layer configurations (and a matching input shape).

Each strategy returns ``(layer, input_shape)`` with the batch on dim 0; the layer is float64.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from torch import nn

batch_sizes = st.integers(1, 4)


@st.composite
def linear_layers(draw: st.DrawFn) -> tuple[nn.Module, tuple[int, ...]]:
    in_f, out_f = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    shared = draw(st.lists(st.integers(1, 4), max_size=2))  # [B, D], [B, T, D], [B, T1, T2, D]
    layer = nn.Linear(in_f, out_f, bias=draw(st.booleans()))
    return layer.double(), (draw(batch_sizes), *shared, in_f)


@st.composite
def conv_layers(draw: st.DrawFn, wide: bool = False) -> tuple[nn.Module, tuple[int, ...]]:
    """Any convolution; ``wide``: 2-D/3-D with 8 input channels per group and at least 6 output
    positions per dim, the shapes for which the rule takes its batch-as-groups path."""
    nd = draw(st.sampled_from([2, 3] if wide else [1, 2, 3]))
    groups = draw(st.integers(1, 2 if wide else 3))  # groups first, channels as multiples of it
    in_ch, out_ch = groups * (8 if wide else draw(st.integers(1, 2))), groups * draw(st.integers(1, 2))
    per_dim = st.integers(1, 3) if nd < 3 else st.integers(1, 2)
    kernel = tuple(draw(per_dim) for _ in range(nd))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(nd))
    mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    padding_kind = draw(st.sampled_from(["int", "tuple", "same", "valid"]))
    stride = (1,) * nd if padding_kind == "same" or wide else tuple(draw(st.integers(1, 2)) for _ in range(nd))
    extent = [dl * (k - 1) + 1 for k, dl in zip(kernel, dilation)]
    if padding_kind == "int":
        padding: int | str | tuple[int, ...] = draw(st.integers(0, 2))
        pads = [padding] * nd
    elif padding_kind == "tuple":
        padding = tuple(draw(st.integers(0, 2)) for _ in range(nd))
        pads = list(padding)
    else:
        padding = padding_kind
        pads = [(e - 1 + 1) // 2 for e in extent] if padding_kind == "same" else [0] * nd
    # reflect needs pad < size, circular pad <= size; the padded input must hold one kernel extent
    low = [max(p + 1, e - 2 * p, 1) + (5 if wide else 0) for p, e in zip(pads, extent)]
    size = tuple(draw(st.integers(lo, lo + (1 if wide else 3))) for lo in low)
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[nd - 1]
    layer = conv(
        in_ch,
        out_ch,
        kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        bias=draw(st.booleans()),
        padding_mode=mode,
    )
    return layer.double(), (draw(batch_sizes), in_ch, *size)


@st.composite
def layer_norms(draw: st.DrawFn) -> tuple[nn.Module, tuple[int, ...]]:
    normalized = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    shared = draw(st.lists(st.integers(1, 3), max_size=2))
    # elementwise_affine=False has no parameters: covered by the model tests, not here
    layer = nn.LayerNorm(normalized, bias=draw(st.booleans()))
    with torch.no_grad():  # off the (1, 0) init, so every gradient term shows
        for p in layer.parameters():
            p.normal_()
    return layer.double(), (draw(batch_sizes), *shared, *normalized)


@st.composite
def embeddings(draw: st.DrawFn) -> tuple[nn.Module, tuple[int, ...]]:
    vocab, dim = draw(st.integers(1, 8)), draw(st.integers(1, 5))
    padding_idx = draw(st.one_of(st.none(), st.integers(-vocab, vocab - 1)))
    shared = draw(st.lists(st.integers(1, 5), max_size=2))
    layer = nn.Embedding(vocab, dim, padding_idx=padding_idx)
    return layer.double(), (draw(batch_sizes), *shared)


@st.composite
def group_norms(draw: st.DrawFn) -> tuple[nn.Module, tuple[int, ...]]:
    groups = draw(st.integers(1, 3))  # groups first, channels as a multiple
    channels = groups * draw(st.integers(1, 2))
    spatial = draw(st.lists(st.integers(2, 3), min_size=1, max_size=2))  # group statistics need > 1 value
    layer = nn.GroupNorm(groups, channels)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    return layer.double(), (draw(batch_sizes), channels, *spatial)


@st.composite
def instance_norms(draw: st.DrawFn) -> tuple[nn.Module, tuple[int, ...]]:
    nd = draw(st.integers(1, 3))
    channels = draw(st.integers(1, 3))
    track = draw(st.booleans())
    layer = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)[nd - 1](
        channels, affine=True, track_running_stats=track
    )
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
        if track:
            layer.running_mean.normal_()
            layer.running_var.uniform_(0.5, 2.0)
    layer.train(draw(st.booleans()))
    size = st.integers(2, 3)  # instance statistics need more than one position
    return layer.double(), (draw(batch_sizes), channels, *(draw(size) for _ in range(nd)))


@st.composite
def rms_norms(draw: st.DrawFn) -> tuple[nn.Module, tuple[int, ...]]:
    normalized = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    shared = draw(st.lists(st.integers(1, 3), max_size=2))
    layer = nn.RMSNorm(normalized, eps=draw(st.sampled_from([None, 1e-6, 0.1])))
    with torch.no_grad():
        layer.weight.normal_()
    return layer.double(), (draw(batch_sizes), *shared, *normalized)


@st.composite
def conv_transposes(draw: st.DrawFn) -> tuple[nn.Module, tuple[int, ...]]:
    nd = draw(st.sampled_from([1, 2, 3]))
    groups = draw(st.integers(1, 3))  # groups first, channels as multiples of it
    in_ch, out_ch = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    kernel = tuple(draw(st.integers(1, 3 if nd < 3 else 2)) for _ in range(nd))
    stride = tuple(draw(st.integers(1, 2)) for _ in range(nd))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(nd))
    output_padding = tuple(draw(st.integers(0, max(s, dl) - 1)) for s, dl in zip(stride, dilation, strict=True))
    size = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    # padding small enough that every output size (h-1)s - 2p + dl(k-1) + op + 1 stays >= 1
    room = [
        (h - 1) * s + dl * (k - 1) + op
        for h, s, dl, k, op in zip(size, stride, dilation, kernel, output_padding, strict=True)
    ]
    padding = tuple(draw(st.integers(0, r // 2)) for r in room)
    conv = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)[nd - 1]
    layer = conv(
        in_ch, out_ch, kernel, stride=stride, padding=padding, output_padding=output_padding,
        groups=groups, bias=draw(st.booleans()), dilation=dilation,
    )  # fmt: skip
    return layer.double(), (draw(batch_sizes), in_ch, *size)

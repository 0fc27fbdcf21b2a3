"""Ops that make a row of their result depend on several samples, where the forward feeds a hooked layer from
them: refused (``BatchMixingError``), where they used to be followed as if each row were one sample's (silently
wrong ``grad_sample``). The same ops used per sample are exact.

- two operands with the batch on two dims of the result pair the samples (``h @ h.T``, ``cdist(h, h)``,
  ``cosine_similarity(h[:, None], h[None])``);
- attention with the batch as its positions (``scaled_dot_product_attention(h[None], ...)``, an unbatched
  ``nn.MultiheadAttention`` called on ``[B, D]``);
- functions of a whole matrix over the batch's rows (``linalg.qr``, ``svd``, ``pinv``, ...).

Each case: ``head(pick(tanh(body(x))))`` in float64, several steps with the batch size changing, against each loss
term's gradient by plain autograd through the whole batch forward (``tests.test_counted_aranges.run``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pergrad.errors import BatchMixingError
from tests.test_counted_aranges import REORDERED, run

pytestmark = pytest.mark.usefixtures("float64")


def _unbatched_attention(m, h):
    if not hasattr(m, "attention"):
        m.attention = nn.MultiheadAttention(h.shape[1], 1).to(h.dtype)
    return m.attention(h, h, h)[0]


MIXING = {
    "h @ h.T, its first columns": lambda m, h: (h @ h.T)[:, :3],
    "cdist(h, h)": lambda m, h: torch.cdist(h, h)[:, :3],
    "cosine similarity of every pair": lambda m, h: F.cosine_similarity(h[:, None], h[None], dim=-1)[:, :3],
    "h[:, None] - h[None], summed": lambda m, h: (h[:, None] - h[None]).sum(1),
    "attention across the batch (sdpa)": lambda m, h: F.scaled_dot_product_attention(h[None], h[None], h[None])[0],
    "unbatched nn.MultiheadAttention on [B, D]": _unbatched_attention,
    "linalg.qr": lambda m, h: torch.linalg.qr(h)[0],
    "linalg.svd": lambda m, h: torch.linalg.svd(h, full_matrices=False)[0][:, :3],
    "torch.svd": lambda m, h: torch.svd(h)[0][:, :3],
    "linalg.pinv, transposed": lambda m, h: torch.linalg.pinv(h).T,
    "matrix_norm over the rows": lambda m, h: h / torch.linalg.matrix_norm(h),
    "torch.gradient along the batch": lambda m, h: torch.gradient(h, dim=0)[0],
    "torch.gradient along every dim": lambda m, h: torch.gradient(h)[0],
    "fft.fftshift of every dim": lambda m, h: torch.fft.fftshift(h),
    "fft.ifftshift along the batch": lambda m, h: torch.fft.ifftshift(h, dim=0),
    "inner(h, h), its first columns": lambda m, h: torch.inner(h, h)[:, :3],
    "inner over the batch dim": lambda m, h: torch.inner(h.T, torch.ones(3, h.shape[0])),
    "put of the batch, reversed": lambda m, h: torch.zeros_like(h).put(torch.arange(h.numel()).flip(0), h.flatten()),
    "masked_scatter of the batch, a varying count per row": lambda m, h: torch.zeros(h.shape[0], 5).masked_scatter(
        torch.arange(5 * h.shape[0]).remainder(2).bool().view(h.shape[0], 5), h
    )[:, :3],
    "pixel_shuffle with the batch as channels": lambda m, h: F.pixel_shuffle(h[None, :, :, None], 2).reshape(
        h.shape[0], 3
    ),
    "channel_shuffle with the batch as channels": lambda m, h: F.channel_shuffle(h[None], 2)[0],
    "h.T reshaped to [B, 3]": lambda m, h: h.T.contiguous().view(h.shape[0], 3),
    "h reshaped to [3, B], transposed": lambda m, h: h.reshape(3, h.shape[0]).T,
    "cosine_similarity with ones_like(h) over the batch": lambda m, h: (
        h * F.cosine_similarity(h, torch.ones_like(h), dim=0)
    ),
    "P @ the batch folded into one dim": lambda m, h: (_square(h.numel()) @ h.reshape(-1)).view(h.shape[0], 3),
    "the batch folded, @ P": lambda m, h: (h.reshape(-1) @ _square(h.numel())).view(h.shape[0], 3),
    "bmm over the batch folded": lambda m, h: torch.bmm(_square(h.numel())[None], h.reshape(1, -1, 1)).view(
        h.shape[0], 3
    ),
    "F.linear over the batch folded": lambda m, h: F.linear(h.reshape(1, -1), _square(h.numel())).view(h.shape[0], 3),
    "einsum over the batch folded": lambda m, h: torch.einsum("ij,j->i", _square(h.numel()), h.reshape(-1)).view(
        h.shape[0], 3
    ),
    "P @ [B * T, D] (tokens of every sample)": lambda m, h: (_square(3 * h.shape[0]) @ _tokens(h)).view(
        h.shape[0], 3, 2
    )[..., 0],
}


def _square(n):
    return torch.linspace(-1, 1, n * n).view(n, n)


def _tokens(h):
    """``[B * 3, 2]``: each sample's 3 tokens of 2 features, the batch folded with the tokens."""
    return torch.stack([h, h.flip(1)], -1).reshape(-1, 2)


# B == 3: torch.cross without dim takes the first dim of size 3, the batch's
CROSSING = {
    "torch.cross without dim": lambda m, h: torch.cross(h, torch.ones_like(h)),
    "linalg.cross along the batch": lambda m, h: torch.linalg.cross(h, torch.ones_like(h), dim=0),
    "Tensor.cross along the batch": lambda m, h: h.cross(torch.linspace(1, 2, 9).view(3, 3), dim=0),
}


@pytest.mark.parametrize("pick", MIXING.values(), ids=MIXING.keys())
def test_an_op_mixing_the_samples_before_a_layer_is_refused(pick):
    with pytest.raises(BatchMixingError, match=REORDERED):
        run(pick, sizes=(4, 5))


PER_SAMPLE = {
    "cdist to fixed centroids": lambda m, h: torch.cdist(h, torch.linspace(-1, 1, 9).view(3, 3)),
    "W @ h.T, transposed back": lambda m, h: (torch.linspace(-1, 1, 9).view(3, 3) @ h.T).T,
    "cosine similarity to a fixed vector": lambda m, h: h * F.cosine_similarity(h, torch.ones(1, 3), dim=-1)[:, None],
    "sdpa within each sample": lambda m, h: F.scaled_dot_product_attention(h[:, :, None], h[:, :, None], h[:, :, None])[
        ..., 0
    ],
    "linalg.qr of each sample's outer product": lambda m, h: torch.linalg.qr(h[:, :, None] @ h[:, None, :])[0].sum(-1),
    "vector_norm of each row": lambda m, h: h / torch.linalg.vector_norm(h, dim=-1, keepdim=True),
    "F.batch_norm in eval with running statistics": lambda m, h: F.batch_norm(h, torch.zeros(3), torch.ones(3)),
    "kron with a 1 x 1": lambda m, h: torch.kron(h, torch.full((1, 1), 2.0)),
    "[B * T, D] @ W, unfolded": lambda m, h: (_tokens(h) @ _square(2)).view(h.shape[0], 3, 2)[..., 0],
    "F.linear of [B * T, D], unfolded": lambda m, h: F.linear(_tokens(h), _square(2)).view(h.shape[0], 3, 2)[..., 0],
    "einsum over the features of [B * T, D]": lambda m, h: torch.einsum("nd,de->ne", _tokens(h), _square(2)).view(
        h.shape[0], 3, 2
    )[..., 0],
    "torch.gradient within each sample": lambda m, h: torch.gradient(h, dim=1)[0] + h,
    "fft.fftshift within each sample": lambda m, h: torch.fft.fftshift(h, dim=-1),
    "inner with fixed vectors": lambda m, h: torch.inner(h, torch.linspace(-1, 1, 9).view(3, 3)),
    "inner of fixed vectors with h": lambda m, h: torch.inner(torch.linspace(-1, 1, 9).view(3, 3), h).T,
    "put of fixed values into h": lambda m, h: h.put(torch.tensor([0, 4]), torch.tensor([1.0, 2.0])),
    "masked_scatter of fixed values into h": lambda m, h: h.masked_scatter(
        torch.arange(h.numel()).view_as(h).remainder(2).bool(), torch.linspace(0, 1, h.numel())
    ),
    "cross along the features": lambda m, h: torch.linalg.cross(h, torch.linspace(1, 2, 3).expand_as(h)),
    "torch.cross without dim, B != 3": lambda m, h: torch.cross(h, torch.linspace(1, 2, 3).expand_as(h)),
    "pixel_shuffle within each sample": lambda m, h: F.pixel_shuffle(h.repeat(1, 4)[:, :, None, None], 2).mean((2, 3)),
    "channel_shuffle within each sample": lambda m, h: F.channel_shuffle(h.repeat(1, 2)[:, :, None], 2)[:, :3, 0],
}


@pytest.mark.filterwarnings("ignore:Using torch.cross without specifying the dim")
@pytest.mark.parametrize("pick", CROSSING.values(), ids=CROSSING.keys())
def test_a_cross_product_along_the_batch_is_refused(pick):
    with pytest.raises(BatchMixingError, match=REORDERED):
        run(pick, sizes=(3, 3))


@pytest.mark.parametrize("pick", PER_SAMPLE.values(), ids=PER_SAMPLE.keys())
def test_the_same_ops_per_sample_are_exact(pick):
    assert run(pick, sizes=(4, 5, 4)) < 1e-10


def test_the_batch_split_over_two_dims_and_put_back_is_exact():
    """``view(2, B // 2, D)``: the batch split over dims of its own, each row still one sample's."""
    assert run(lambda m, h: torch.tanh(h.view(2, h.shape[0] // 2, 3)).view(h.shape[0], 3), sizes=(4, 6)) < 1e-10


def test_a_batch_of_one_sample_is_not_refused_for_pairing():
    """With one sample, nothing can be paired or mixed: ``h @ h.T`` of ``[1, D]`` is that sample's alone."""
    assert run(lambda m, h: h * (h @ h.T), sizes=(1, 1)) < 1e-10


def _picked_by(rows: Callable[[int], list[tuple[int, int]]], transposed: bool = False):
    """``h[mask]`` of a ``[B, 3]`` mask picking ``rows(B)`` (sample, feature) pairs, as a ``[B, 3]`` input; with
    ``transposed``, ``h.T[mask.T]`` (the batch the mask's second dim: picked in the features' order)."""

    def pick(m, h):
        mask = torch.zeros(h.shape[0], 3, dtype=torch.bool)
        for i, j in rows(h.shape[0]):
            mask[i, j] = True
        picked = h.T[mask.T] if transposed else h[mask]
        return picked[:, None] * torch.ones(3)

    return pick


def _one_each(b):
    return [(i, (b - i) % 3) for i in range(b)]


def test_a_mask_picking_one_position_of_each_sample_is_followed_in_order():
    """The last token of each sample by a ``[B, T]`` mask: its picks are the samples in order."""
    assert run(_picked_by(_one_each), sizes=(4, 5, 3)) < 1e-10


MASKS = {
    "two positions of sample 0, none of sample 1": lambda b: [(0, 0), (0, 1), *_one_each(b)[2:]],
    "one of each, the batch the mask's second dim": None,
}


@pytest.mark.parametrize("rows", MASKS.values(), ids=MASKS.keys())
def test_a_mask_picking_b_positions_not_one_of_each_sample_in_order_is_refused(rows):
    """As many picks as samples, but row ``i`` of the result is not sample ``i``: refused (it was followed)."""
    pick = _picked_by(rows) if rows is not None else _picked_by(_one_each, transposed=True)
    with pytest.raises(BatchMixingError, match=REORDERED):
        run(pick, sizes=(4, 5))

"""nn.EmbeddingBag: every mode and input form against per-bag autograd.

The reference is a loop: bags are independent, so the gradient of bag b's own loss, computed by
autograd through the whole call, is bag b's per-sample gradient (torch.func cannot vmap a 1-D
input with offsets, whose entries are not split along a batch dim).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from pergrad import PerSampleModule, UnsupportedLayerError
from tests.reference import assert_close


@given(
    mode=st.sampled_from(["sum", "mean", "max"]),
    form=st.sampled_from(["2d", "offsets", "last_offset"]),
    weighted=st.booleans(),
    padding=st.booleans(),
    bags=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_embedding_bag_matches_per_bag_autograd(
    mode: str, form: str, weighted: bool, padding: bool, bags: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    weighted = weighted and mode == "sum"  # per_sample_weights exist only for mode="sum"
    layer = nn.EmbeddingBag(
        6, 3, mode=mode, include_last_offset=form == "last_offset", padding_idx=1 if padding else None
    )
    layer = layer.double()
    if form == "2d":
        idx = torch.randint(0, 6, (bags, 3), generator=gen)
        args: tuple = (idx,)
        n_entries = idx.numel()
    else:
        lengths = torch.randint(1, 4, (bags,), generator=gen)
        idx = torch.randint(0, 6, (int(lengths.sum()),), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        if form == "last_offset":
            offsets = torch.cat([offsets, lengths.sum().view(1)])
        args = (idx, offsets)
        n_entries = idx.numel()
    kwargs = (
        {"per_sample_weights": torch.rand(n_entries, generator=gen, dtype=torch.float64).view(idx.shape)}
        if weighted
        else {}
    )
    target = torch.randn(bags, 3, generator=gen, dtype=torch.float64)
    expected = []
    for b in range(bags):
        layer.zero_grad()
        (layer(*args, **kwargs)[b] - target[b]).pow(2).sum().backward()
        expected.append(layer.weight.grad.clone())
    layer.zero_grad()
    with PerSampleModule(layer, loss_reduction="sum") as psm:
        (psm(*args, **kwargs) - target).pow(2).sum().backward()
        assert_close(layer.weight.grad_sample, torch.stack(expected))


def test_embedding_bag_options_without_a_per_sample_gradient() -> None:
    layer = nn.EmbeddingBag(5, 2, scale_grad_by_freq=True)
    with PerSampleModule(layer) as psm:
        loss = psm(torch.randint(0, 5, (3, 2))).sum()
        with pytest.raises(UnsupportedLayerError, match=r"scale_grad_by_freq=True or sparse=True"):
            loss.backward()

"""Projected features beyond tests/test_projection.py: the Kronecker form of transposed
convolutions. Every step of a loop is checked in float64 against
torch.func (or one-sample-at-a-time autograd), with ``P`` regenerated from the parameters' names."""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import pytest
import torch
from torch import Tensor, nn

import pergrad.sources
from pergrad import PerSampleModule, transforms
from pergrad.projectors import Projector, Spec
from tests.reference import assert_close, clipped_mean, reference_grad_sample, run_pergrad
from tests.test_projection import DIM

BATCHES = [3, 5, 4, 6]  # detaching starts after the first backward: four steps, changing sizes


def _features(grads: dict[str, Tensor], net: nn.Module, spec: Spec, prefix: str = "") -> Tensor:
    """``sum_p P_p vec(g(p))`` over the parameters under ``prefix``, for ``grads[name]`` ``[*lead, *shape]``
    (per sample ``[B, ...]`` or per token ``[B, T, ...]``)."""
    total: Tensor | None = None
    for name, p in net.named_parameters():
        if name.startswith(prefix):
            g = grads[name]
            flat = g.reshape(*g.shape[: g.dim() - p.dim()], -1)
            term = flat @ Projector(spec, name, tuple(p.shape)).matrix().T
            total = term if total is None else total + term
    assert total is not None
    return total


def _target_like(net: nn.Module, x: Tensor) -> Tensor:
    with torch.no_grad():  # (not a forward pergrad follows)
        return torch.randn_like(net(x))


# -- 2. transposed convolutions: Kronecker, nothing built -------------------------------------------

# name -> (model for p input positions, input of a batch)
TRANSPOSED: dict[str, Callable[[int], tuple[nn.Module, Callable[[int], Tensor]]]] = {
    "1d": lambda p: (
        nn.Sequential(nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, dilation=2)),
        lambda b: torch.randn(b, 4, p, dtype=torch.float64),
    ),
    "2d": lambda p: (
        nn.Sequential(
            nn.ConvTranspose2d(2, 4, (3, 2), stride=(2, 1), padding=(1, 0), output_padding=(1, 0), dilation=(1, 2)),
            nn.Tanh(),
            nn.ConvTranspose2d(4, 2, 2, bias=False),
        ),
        lambda b: torch.randn(b, 2, p, 1, dtype=torch.float64),
    ),
    "3d": lambda p: (
        nn.Sequential(
            nn.ConvTranspose3d(2, 3, (1, 2, 3), stride=(1, 1, 2), padding=(0, 0, 1), output_padding=(0, 0, 1))
        ),
        lambda b: torch.randn(b, 2, 1, 1, p, dtype=torch.float64),
    ),
}


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
@pytest.mark.parametrize("positions", [15, 17])
@pytest.mark.parametrize("case", sorted(TRANSPOSED))
def test_conv_transpose_features_every_step(case: str, positions: int, keep_grad_sample: bool, clip: bool) -> None:
    """Features, ``.grad`` (clipped: the fused norms and weighted sums) and norms, every step."""
    torch.manual_seed(0)
    net, batch_of = TRANSPOSED[case](positions)
    net = net.double()
    psm = PerSampleModule(net, keep_grad_sample=keep_grad_sample, track_norms=True)
    if clip:
        psm.register_transform(net, transforms.clip_norm(0.5))
    psm.register_projection(net, dim=DIM, seed=2)
    psm.register_projection("0.weight", dim=16, kind="dense", seed=4)
    names = dict(net.named_parameters())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    for step, batch in enumerate(BATCHES):
        x = batch_of(batch)
        y = _target_like(net, x)
        ref = reference_grad_sample(net, x, y)
        optimizer.zero_grad()
        run_pergrad(psm, x, y)
        found = psm.per_sample_projections()
        assert_close(found[""], _features(ref, net, Spec(DIM, seed=2)), f"step {step}: kron features")
        dense = _features(ref, net, Spec(16, "dense", seed=4), "0.weight")
        assert_close(found["0.weight"], dense, f"step {step}: dense features")
        grads = clipped_mean(ref, 0.5) if clip else {n: g.mean(0) for n, g in ref.items()}
        norms = psm.per_sample_norms()
        for name, p in names.items():
            assert p.grad is not None
            assert_close(p.grad, grads[name], f"step {step}: {name}.grad")
            assert_close(norms[name], ref[name].flatten(1).norm(dim=1), f"step {step}: norms of {name}")
        optimizer.step()
    psm.remove()


@pytest.mark.parametrize("case", sorted(TRANSPOSED))
def test_conv_transpose_features_build_no_per_sample_gradient(case: str) -> None:
    torch.manual_seed(0)
    net, batch_of = TRANSPOSED[case](17)
    net = net.double()
    psm = PerSampleModule(net, keep_grad_sample=False, verify=False)
    psm.register_projection(net, dim=DIM)
    for batch in BATCHES:
        x = batch_of(batch)
        y = _target_like(net, x)
        ref = reference_grad_sample(net, x, y)
        with mock.patch.object(pergrad.sources, "run_rule", side_effect=AssertionError("a rule built g_i")):
            run_pergrad(psm, x, y)
        assert_close(psm.per_sample_projections()[""], _features(ref, net, Spec(DIM)), "features")
    psm.remove()

"""Weights of small Linears stay attached (``pergrad._core.shortcuts.detach.FEW_FLOPS``), on both sides of the threshold.

Detaching a weight saves autograd's weight gradient (``2 B L |W|`` flops) and costs the host a fixed amount of
Python at every call of the layer, so below ``FEW_FLOPS`` a Linear's weight stays attached (a convolution's runs
detached at any size: its weight gradient costs the host more than its flops say). The same layer crosses the
threshold as the batch changes between steps: each step is checked against a one-sample-at-a-time reference, and
which weights ran detached against the threshold's rule.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from pergrad import PerSampleModule, transforms
from pergrad._core.shortcuts import detach
from tests.conftest import LIBRARY_FEW_FLOPS
from tests.reference import assert_close, clipped_mean, reference_grad_sample

pytestmark = pytest.mark.usefixtures("float64")

BOUND = 0.5
BATCHES = [2, 3, 4, 3, 2, 5]


def flops(batch: int, positions: int, weight: Tensor) -> int:
    """Autograd's weight gradient of one call: ``2 B L |W|``."""
    return 2 * batch * positions * weight.numel()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3, padding=1)  # 18 weights at 5 positions
        self.up = nn.Linear(3, 8)  # 24 weights at 5 positions
        self.head = nn.Linear(8, 2)  # 16 weights at 1 position

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.conv(x)).transpose(1, 2)  # [B, 5, 3]
        return self.head(torch.tanh(self.up(h)).mean(1))


def costs(model: Net, batch: int) -> dict[str, int]:
    """The Linears' weight gradients (a convolution runs detached whatever its flops)."""
    return {"up.weight": flops(batch, 5, model.up.weight), "head.weight": flops(batch, 1, model.head.weight)}


@pytest.mark.parametrize("few", [0, 700, 1_000, LIBRARY_FEW_FLOPS])
def test_small_linears_stay_attached_and_every_step_is_exact(monkeypatch: pytest.MonkeyPatch, few: int) -> None:
    """At 700 and 1,000 flops the up layer (240 B flops) changes sides as the batch goes 2..5; the convolution
    runs detached at every size."""
    monkeypatch.setattr(detach, "FEW_FLOPS", few)
    torch.manual_seed(0)
    model = Net()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    params = dict(model.named_parameters())
    sides = set()
    for step, batch in enumerate(BATCHES):
        x, target = torch.randn(batch, 2, 5), torch.randn(batch, 2)
        expected = clipped_mean(reference_grad_sample(model, x, target), BOUND)
        psm.zero_grad()
        out = psm(x)
        detached = {n for n, p in params.items() if p in psm._engine.detacher.current and n.endswith("weight")}
        if step > 0:  # (the first backward's check needs autograd's weight gradients: nothing detached)
            should = {"conv.weight"} | {n for n, cost in costs(model, batch).items() if cost >= few}
            assert detached == should, f"step {step} (B={batch})"
            sides.add(frozenset(detached))
        (out - target).pow(2).sum(1).mean().backward()
        for name, p in params.items():
            assert p.grad is not None
            assert_close(p.grad, expected[name], f"step {step} (B={batch}) {name}")
    if few in (700, 1_000):
        assert len(sides) > 1, "no layer crossed the threshold: the test does not test it"


def test_built_grad_sample_detaches_only_the_weights_of_many_flops(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``grad_sample`` built at many positions, a weight of few flops stays attached too; one of many runs
    detached, and both give the reference's per-sample gradients and mean."""
    monkeypatch.setattr(detach, "FEW_FLOPS", 2**12)
    torch.manual_seed(1)
    small, large = nn.Linear(2, 2), nn.Linear(16, 16)
    model = nn.Sequential(small, nn.Tanh(), nn.Linear(2, 16), nn.Tanh(), large)
    psm = PerSampleModule(model)
    for step, batch in enumerate([3, 4, 3]):
        x, target = torch.randn(batch, 20, 2), torch.randn(batch, 20, 16)
        expected = reference_grad_sample(model, x, target)
        psm.zero_grad()
        out = psm(x)
        current = psm._engine.detacher.current
        if step > 0:
            assert small.weight not in current and large.weight in current, f"step {step}"
        (out - target).pow(2).sum((1, 2)).mean().backward()
        for name, p in model.named_parameters():
            assert_close(p.grad_sample, expected[name], f"step {step} {name} grad_sample")
            assert_close(p.grad, expected[name].mean(0), f"step {step} {name}")

"""Adding a consumer of ``(a, d)`` is adding one class (a ``Consumer``, handed to ``Engine.add``): this one computes
``<g_i, v>`` per sample against a fixed direction ``v`` (what TracIn scores against a test gradient),
from built ``g_i`` or from each layer's fused rule, and is checked against torch.func every step."""

from __future__ import annotations

import pytest
import torch
from reference import assert_close, clipped_mean, reference_grad_sample, run_pergrad
from torch import Tensor, nn

from pergrad import PerSampleModule, transforms
from pergrad._core.capture.calls import Kept
from pergrad._core.consumers import Batch, Consumer


class InnerProducts(Consumer):
    """``<g_i, v>`` summed over the parameters ``v`` names (a consumer, as in ``pergrad/_core/consumers/``)."""

    def __init__(self, direction: dict[nn.Parameter, Tensor]) -> None:
        self.direction = direction
        self.last: Tensor | None = None

    def reads(self, kept: Kept) -> bool:
        return any(p in self.direction for _, p in kept.layer.trainable())

    def consume(self, batch: Batch) -> None:
        reached = {p: v for p, v in self.direction.items() if p in batch.params}
        dots = batch.source.dots(reached)
        self.last = torch.stack(list(dots.values())).sum(0)


def model(positions: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(4 * positions, 2)).double()


@pytest.mark.parametrize("clip", [True, False], ids=["clipped", "alone"])  # alone: only it reads (a, d)
@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
@pytest.mark.parametrize("positions", [15, 17])  # both sides of detach.MANY
def test_a_consumer_added_beside_the_built_in_ones(keep_grad_sample: bool, positions: int, clip: bool) -> None:
    net = model(positions)
    psm = PerSampleModule(net, keep_grad_sample=keep_grad_sample)
    if clip:
        psm.register_transform(net, transforms.clip_norm(0.5))
    names = dict(net.named_parameters())
    direction = {p: torch.randn_like(p) for p in net.parameters()}
    consumer = InnerProducts(direction)
    psm._engine.add(consumer)  # as a feature adds its consumer
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(4):  # the detaching shortcut starts at the second backward
        batch = 5 + step
        x, y = torch.randn(batch, 3, positions, dtype=torch.float64), torch.randn(batch, 2, dtype=torch.float64)
        ref = reference_grad_sample(net, x, y)
        optimizer.zero_grad()
        run_pergrad(psm, x, y)
        expected = torch.stack([ref[n].flatten(1) @ direction[p].flatten() for n, p in names.items()]).sum(0)
        assert consumer.last is not None
        assert_close(consumer.last, expected, f"step {step}: <g_i, v>")
        expected_grads = clipped_mean(ref, 0.5) if clip else {n: g.mean(0) for n, g in ref.items()}
        for n, g in expected_grads.items():  # the built-in consumers are unchanged beside it
            grad = names[n].grad
            assert grad is not None
            assert_close(grad, g, f"step {step}: {n}.grad")
        optimizer.step()

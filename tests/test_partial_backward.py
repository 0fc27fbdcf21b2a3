"""Backward passes that ask autograd for part of the graph: ``torch.autograd.grad`` and
``backward(inputs=...)``, on steps where weights run detached (from the second backward on).

Exact where autograd can answer (a bias, the input, every parameter of a target), refused with an
error naming the layer and the fix where it cannot (a weight pergrad computes itself; part of a
transform's target)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pergrad import DetachedWeightError, PerSampleModule, TransformError, transforms
from tests.reference import assert_close, reference_grad_sample


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def batch(step: int, positions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    shape = (3 + step % 3, 4) if positions is None else (2 + step % 2, positions, 4)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return x, torch.randn(*shape[:-1], 3, generator=gen, dtype=torch.float64)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).flatten(1).sum(1).mean()


def test_autograd_grad_of_a_detached_weight_is_refused_and_the_rest_is_exact() -> None:
    net, plain = model(), model()
    psm = PerSampleModule(net)
    psm.register_transform(net, transforms.clip_norm(0.5))
    for step in range(4):
        x, y = batch(step)
        plain.load_state_dict(net.state_dict())
        net.zero_grad()
        loss_of(psm(x), y).backward()  # from here on the weights run detached
        xr = x.clone().requires_grad_()
        loss = loss_of(psm(xr), y)
        expected = loss_of(plain(xr), y)
        want = torch.autograd.grad(expected, [plain[2].bias, xr], retain_graph=True)
        got = torch.autograd.grad(loss, [net[2].bias, xr], retain_graph=True)
        for g, w in zip(got, want):
            assert_close(g, w, f"step {step}")
        if step == 0:
            continue  # the first backward (the check) runs every weight attached
        with pytest.raises(DetachedWeightError, match=r"weight of layer '2' \(Linear\).*detach_transformed=False"):
            torch.autograd.grad(loss, [net[2].weight], retain_graph=True)
        assert [p.grad is not None for p in net.parameters()] == [True] * 4  # nothing written by the refusals


def test_autograd_grad_of_every_weight_with_detach_transformed_false() -> None:
    """captum's TracInCP on a model still wrapped: per-parameter gradients of one sample's loss."""
    net, plain = model(), model()
    psm = PerSampleModule(net, detach_transformed=False)
    psm.register_transform(net, transforms.clip_norm(0.5))
    for step in range(3):
        x, y = batch(step)
        plain.load_state_dict(net.state_dict())
        loss_of(psm(x), y).backward()
        got = torch.autograd.grad(loss_of(psm(x[:1]), y[:1]), list(net.parameters()))
        want = torch.autograd.grad(loss_of(plain(x[:1]), y[:1]), list(plain.parameters()))
        for g, w in zip(got, want):
            assert_close(g, w, f"step {step}")


@pytest.mark.parametrize("keep", [True, False])
def test_backward_inputs_with_a_root_transform(keep: bool) -> None:
    net = model()
    psm = PerSampleModule(net, keep_grad_sample=keep)
    psm.register_transform(net, transforms.clip_norm(0.5))
    for step in range(3):
        x, y = batch(step)
        net.zero_grad()
        if step == 0:
            loss_of(psm(x), y).backward()
            continue
        with pytest.raises(DetachedWeightError, match=r"weight of layer '0' \(Linear\)"):
            loss_of(psm(x), y).backward(inputs=[net[0].weight])
        with pytest.raises(TransformError, match=r"the whole model covers, but not into \['2.weight'\]"):
            loss_of(psm(x), y).backward(inputs=[net[2].bias])


@pytest.mark.parametrize("positions", [None, 17], ids=["vectors", "sequences"])
def test_backward_inputs_without_transforms_writes_what_it_names(positions: int | None) -> None:
    """At 17 positions grad_sample is built and the weights run detached (pergrad writes their .grad):
    ``inputs=`` naming the biases leaves the weights' .grad alone, and naming a detached weight is
    refused; on vectors the weights stay in autograd's graph and may be named."""
    net, plain = model(), model()
    psm = PerSampleModule(net)
    for step in range(4):
        x, y = batch(step, positions)
        plain.load_state_dict(net.state_dict())
        ref = reference_grad_sample(plain, x, y, lambda out, t: (out - t).pow(2).sum())
        net.zero_grad()
        named = [net[0].bias, net[2].bias] if positions else [net[0].bias, net[2].bias, net[2].weight]
        if step and positions:
            with pytest.raises(DetachedWeightError, match=r"weight of layer '2' \(Linear\)"):
                loss_of(psm(x), y).backward(inputs=[net[2].weight])
        loss_of(psm(x), y).backward(inputs=named if step else None)
        for p, name in [(net[0].bias, "0.bias"), (net[2].bias, "2.bias")]:
            assert_close(p.grad, ref[name].mean(0), f"{name} at step {step}")
        if step == 0:
            assert_close(net[0].weight.grad, ref["0.weight"].mean(0))
        else:
            assert net[0].weight.grad is None
        if step == 0 or not positions:
            assert_close(net[2].weight.grad, ref["2.weight"].mean(0), f"step {step}")
            assert_close(net[2].weight.grad_sample, ref["2.weight"], f"step {step}")
        else:
            assert net[2].weight.grad is None

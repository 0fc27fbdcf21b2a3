"""Gradient accumulation over micro-batches, both ways users write it, over several optimizer steps:

- ``accumulate="samples"``: ``.grad`` is the mean of ``T(g_i)`` over every sample of every micro-batch
  since ``.grad`` was cleared (``zero_grad()`` with ``set_to_none`` either way), also for weights that
  run detached (from the second backward on);
- dividing each micro-batch's loss by k (Lightning's ``accumulate_grad_batches``, HF ``Trainer``):
  ``loss_scale=1/k`` says so, the transforms see each sample's own ``g_i``, and ``.grad`` is the mean
  over the micro-batches of their ``(1/B) sum_i T(g_i)``.

Every step's ``.grad`` is checked against torch.func on the concatenated samples.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pergrad import PerSampleModule, transforms
from tests.reference import assert_close, clipped, reference_grad_sample

CLIP = 0.4


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3, bias=False)).double()


def per_sample_transformed(ref: dict[str, torch.Tensor], clip: float | None) -> dict[str, torch.Tensor]:
    """Each sample's ``T(g_i)``: clipped over the whole model, or as is."""
    return ref if clip is None else clipped(ref, clip)


def micro_batches(step: int, positions: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two or three micro-batches of changing sizes; on ``[B, T, 4]`` inputs, T on both sides of 16."""
    sizes = [(3, 2), (1, 4, 2), (2, 5), (4, 1)][step % 4]
    gen = torch.Generator().manual_seed(step)
    out = []
    for b in sizes:
        shape = (b, 4) if positions is None else (b, positions + step % 2 * 2 - 1, 4)
        x = torch.randn(*shape, generator=gen, dtype=torch.float64)
        out.append((x, torch.randn(*shape[:-1], 3, generator=gen, dtype=torch.float64)))
    return out


def per_sample_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).flatten(1).sum(1)


@pytest.mark.parametrize("positions", [None, 16], ids=["vectors", "sequences"])
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize(("keep", "clip"), [(True, CLIP), (False, CLIP), (True, None)])
def test_accumulate_samples_over_optimizer_steps(
    keep: bool, clip: float | None, set_to_none: bool, positions: int | None
) -> None:
    net, plain = model(), model()
    psm = PerSampleModule(net, keep_grad_sample=keep, accumulate="samples")
    if clip is not None:
        psm.register_transform(net, transforms.clip_norm(clip))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    for step in range(5):
        plain.load_state_dict(net.state_dict())
        batches = micro_batches(step, positions)
        opt.zero_grad(set_to_none=set_to_none)
        for x, y in batches:
            per_sample_loss(psm(x), y).mean().backward()
        x, y = (torch.cat(t) for t in zip(*batches))
        expected = {n: g.mean(0) for n, g in per_sample_transformed(reference_grad_sample(plain, x, y), clip).items()}
        for name, p in net.named_parameters():
            assert_close(p.grad, expected[name], f".grad of {name} at step {step}")
        opt.step()
    psm.remove()


@pytest.mark.parametrize("scaler", [False, True], ids=["plain", "grad_scaler"])
@pytest.mark.parametrize("how", ["argument", "attribute", "callable"])
@pytest.mark.parametrize("keep", [True, False])
def test_a_loss_divided_by_the_number_of_micro_batches(keep: bool, how: str, scaler: bool) -> None:
    net, plain = model(), model()
    k = 3
    options: dict[str, object] = {"keep_grad_sample": keep, "track_norms": True}
    if how == "argument":
        options["loss_scale"] = 1 / k
    elif how == "callable":
        options["loss_scale"] = lambda: torch.tensor(1 / k, dtype=torch.float64)
    amp = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None
    psm = PerSampleModule(net, grad_scaler=amp, **options)  # type: ignore[arg-type]
    if how == "attribute":
        psm.loss_scale = 1 / k  # what an integration sets
    assert psm.loss_scale is not None
    psm.register_transform(net, transforms.clip_norm(CLIP))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        plain.load_state_dict(net.state_dict())
        opt.zero_grad()
        expected = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
        for x, y in micro_batches(step, 15 if step % 2 else None)[:k]:
            loss = per_sample_loss(psm(x), y).mean() / k
            (loss if amp is None else amp.scale(loss)).backward()
            ref = reference_grad_sample(plain, x, y)
            norms = psm.per_sample_norms()
            for name, g in ref.items():  # each sample's own gradient, not 1/k of it
                assert_close(norms[name], g.flatten(1).norm(dim=1), f"norms of {name} at step {step}")
            for name, g in clipped(ref, CLIP).items():
                expected[name] += g.mean(0) / k
        if amp is not None:
            amp.unscale_(opt)
        for name, p in net.named_parameters():
            assert_close(p.grad, expected[name], f".grad of {name} at step {step}")
        if amp is None:
            opt.step()
        else:
            amp.step(opt)
            amp.update()
    psm.remove()


def test_a_bad_loss_scale_is_refused() -> None:
    with pytest.raises(ValueError, match="loss_scale: the loss scale must be a finite number > 0"):
        PerSampleModule(model(), loss_scale=0.0)
    with pytest.raises(TypeError, match="loss_scale must be the factor the loss is multiplied by"):
        PerSampleModule(model(), loss_scale="1/4")  # type: ignore[arg-type]

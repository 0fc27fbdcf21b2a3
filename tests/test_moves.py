"""A model moved or converted after wrapping (``model.to(...)``, ``.double()``, ``.half()``, ``.cuda()``).

torch gives every parameter new data and, with it, a new ``AccumulateGrad`` node: the hooks the wrapper
had on the old nodes never run again. pergrad sees the change at the next forward and wraps the model as
it is then; every step, before and after each move, is checked against each sample's own gradient from
plain autograd on a copy of the model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pergrad import PerSampleModule, transforms

C = 0.3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.ReLU(), nn.Linear(7, 3))


def per_sample_reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[list[torch.Tensor]]:
    """Each sample's own gradient, one sample at a time, on a copy (no pergrad hooks)."""
    copied = copy.deepcopy(model)
    grads = []
    for i in range(x.shape[0]):
        loss = F.cross_entropy(copied(x[i : i + 1]), y[i : i + 1])
        grads.append([g.detach() for g in torch.autograd.grad(loss, list(copied.parameters()))])
    return grads


def clipped_mean(grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    out = [torch.zeros_like(g) for g in grads[0]]
    for g in grads:
        norm = torch.sqrt(sum(t.double().square().sum() for t in g))
        factor = min(1.0, C / float(norm))
        for o, t in zip(out, g):
            o += t * factor
    return [o / len(grads) for o in out]


MOVES = {
    "double": lambda m: m.double(),
    "to_float64": lambda m: m.to(torch.float64),
    "float_back": lambda m: m.float(),
    "bfloat16": lambda m: m.bfloat16(),
    # there and back: dtype, device and tensor as before, new AccumulateGrad nodes (seen at the backward)
    "round_trip": lambda m: m.float().double(),
}


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {
        torch.float64: dict(rtol=1e-10, atol=1e-12),
        torch.float32: dict(rtol=1e-4, atol=1e-6),
        torch.bfloat16: dict(rtol=5e-2, atol=5e-3),
    }[dtype]


@pytest.mark.parametrize("transform", [True, False], ids=["clipped", "plain"])
@pytest.mark.parametrize("keep", [True, False], ids=["grad_sample", "fused"])
def test_every_step_is_exact_before_and_after_each_move(keep: bool, transform: bool) -> None:
    model = make_model()
    psm = PerSampleModule(model, keep_grad_sample=keep)
    if transform:
        psm.register_transform(model, transforms.clip_norm(C))
    schedule = ["double", None, "round_trip", None, "float_back", None, "to_float64", "round_trip", "bfloat16", None]
    generator = torch.Generator().manual_seed(1)
    for step, move in enumerate(schedule):
        if move is not None:
            MOVES[move](model)
        dtype = next(model.parameters()).dtype
        batch = 3 + step % 3
        x = torch.randn(batch, 5, generator=generator).to(dtype)
        y = torch.randint(0, 3, (batch,), generator=generator)
        reference = per_sample_reference(model, x, y)
        expected = clipped_mean(reference) if transform else [torch.stack(g).mean(0) for g in zip(*reference)]
        model.zero_grad()
        psm.zero_grad()
        F.cross_entropy(psm(x), y).backward()
        for k, (p, e) in enumerate(zip(model.parameters(), expected)):
            assert p.grad is not None and p.grad.dtype == dtype, (step, move, k)
            torch.testing.assert_close(p.grad, e, **_tolerance(dtype), msg=f"step {step} ({move}) param {k}")
            if keep:
                stacked = torch.stack([r[k] for r in reference])
                torch.testing.assert_close(p.grad_sample, stacked, **_tolerance(dtype))
    psm.remove()


def test_a_conversion_by_swap_tensors_is_exact_or_refused_by_torch() -> None:
    """With ``torch.__future__.set_swap_module_params_on_conversion(True)`` a conversion swaps each
    parameter's tensor. Where nothing else holds the tensor it is exact from the next forward on;
    after a forward with a transform, the parameter aliases of pergrad's regulariser check (one per
    parameter, kept until the next forward) hold it, and torch refuses the swap itself, loudly."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model = make_model()
        psm = PerSampleModule(model)
        x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
        F.cross_entropy(psm(x), y).backward()
        model.double()  # no transform: swapped
        x = x.double()
        reference = per_sample_reference(model, x, y)
        model.zero_grad()
        F.cross_entropy(psm(x), y).backward()
        for k, p in enumerate(model.parameters()):
            torch.testing.assert_close(p.grad_sample, torch.stack([r[k] for r in reference]), rtol=1e-10, atol=1e-12)
        psm.register_transform(model, transforms.clip_norm(C))
        F.cross_entropy(psm(x), y).backward()
        with pytest.raises(RuntimeError, match="Couldn't swap"):
            model.float()
        psm.remove()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def test_a_move_between_steps_leaves_removal_complete() -> None:
    model = make_model()
    psm = PerSampleModule(model)
    psm.register_transform(model, transforms.clip_norm(C))
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    F.cross_entropy(psm(x), y).backward()
    model.double()
    F.cross_entropy(psm(x.double()), y).backward()
    psm.remove()
    model.zero_grad()
    F.cross_entropy(model(x.double()), y).backward()  # plain autograd again
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
    plain = copy.deepcopy(model)
    plain.zero_grad()
    F.cross_entropy(plain(x.double()), y).backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_model_to_cuda_after_wrapping_is_exact_every_step() -> None:
    model = make_model().double()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(C))
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    F.cross_entropy(psm(x), y).backward()
    model.cuda()
    for _ in range(3):
        xc, yc = x.cuda(), y.cuda()
        expected = clipped_mean(per_sample_reference(model, xc, yc))
        model.zero_grad()
        F.cross_entropy(psm(xc), yc).backward()
        for p, e in zip(model.parameters(), expected):
            torch.testing.assert_close(p.grad, e, rtol=1e-10, atol=1e-12)

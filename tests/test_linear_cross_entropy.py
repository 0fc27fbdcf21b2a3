"""``nn.LinearCrossEntropyLoss`` (torch's fused linear + cross-entropy): each sample's gradient of its
``linear`` weight and bias from its input and the softmax error, against torch.func on each
sample's own loss, for several steps; refused when wrapping with a registry without its rule."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pergrad import PerSampleModule, TokenLossWarning, UnsupportedLayerError, transforms
from pergrad.registry import RuleRegistry, default_registry
from tests.reference import assert_close
from tests.test_construction import state

pytestmark = pytest.mark.skipif(
    not hasattr(nn, "LinearCrossEntropyLoss"), reason="torch without nn.LinearCrossEntropyLoss"
)
CLIP = 0.1
CLASSES = 6


class Model(nn.Module):
    """A body and the fused head; it returns the loss (``psm(x, y)``)."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 5)
        self.loss = nn.LinearCrossEntropyLoss(5, CLASSES, **options)
        self.double()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(torch.tanh(self.body(x)), y)


def reference(model: Model, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """``d f_i / d p`` with ``f_i`` the module's loss on sample i alone, summed over its positions for
    ``reduction="none"`` (torch.func; the chunked kernel does not run under it, the reference one does)."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    options, model.loss.options = model.loss.options, None

    def f(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (xi[None], yi[None])).sum()

    try:
        return torch.func.vmap(torch.func.grad(f), in_dims=(None, 0, 0))(params, x, y)
    finally:
        model.loss.options = options


CASES: dict[str, tuple[dict[str, Any], str]] = {  # module options, loss_reduction
    "sum": ({"reduction": "sum"}, "sum"),
    "mean, positions, bias, smoothing": (
        {"out_features": (2,), "bias": True, "label_smoothing": 0.1},
        "mean",
    ),
    "sum, class weights, ignore_index": (
        {"reduction": "sum", "bias": True, "weight": torch.rand(CLASSES) + 0.5, "ignore_index": 0},
        "sum",
    ),
    "none, positions": ({"reduction": "none", "out_features": (3,)}, "sum"),
    "mean, chunked": ({"options": "chunked"}, "mean"),
    "sum, chunked, bias": ({"reduction": "sum", "bias": True, "options": "chunked"}, "sum"),
}


@pytest.mark.parametrize("keep_grad_sample", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_linear_cross_entropy_loss_matches_torch_func(case: str, keep_grad_sample: bool) -> None:
    options, loss_reduction = CASES[case]
    if options.get("options") == "chunked":
        options = options | {"options": nn.LinearCrossEntropyOptions()}
    model = Model(**options)
    psm = PerSampleModule(model, loss_reduction=loss_reduction, keep_grad_sample=keep_grad_sample)
    psm.register_transform(model, transforms.clip_norm(CLIP))
    positions = model.loss.out_features
    gen = torch.Generator().manual_seed(2)
    for step, b in enumerate((4, 1, 5, 3)):
        x = 3 * torch.randn(b, 4, generator=gen, dtype=torch.float64)
        y = torch.randint(0, CLASSES, (b, *positions), generator=gen)
        psm.zero_grad()
        psm(x, y).sum().backward()
        ref = reference(model, x, y)
        norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in ref.values()]).sum(0).sqrt()
        factor = (CLIP / norms).clamp(max=1)
        assert (factor < 1).any(), "samples are clipped: the test sees the transform"
        for name, p in model.named_parameters():
            clipped = ref[name] * factor.view(-1, *[1] * p.dim())
            expected = clipped.mean(0) if loss_reduction == "mean" else clipped.sum(0)
            assert_close(p.grad, expected, f"step {step} {name}.grad")
            if keep_grad_sample:
                assert_close(p.grad_sample, ref[name], f"step {step} {name}.grad_sample")
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad
    psm.remove()


def test_mean_over_unequal_counts_warns() -> None:
    """``reduction="mean"`` divides by the batch's count of targets not ignored: a sample's share is
    its own mean only when every sample counts as many."""
    model = Model(out_features=(3,), ignore_index=-1)
    psm = PerSampleModule(model)
    x = torch.randn(3, 4, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (3, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        psm(x, y).backward()  # equal counts: no warning
        y[1, 0] = -1
        psm.zero_grad()
        with pytest.warns(TokenLossWarning, match=r"reduction='mean'\) divides by the number .* \(2 to 3\)"):
            psm(x, y).backward()


def test_refused_at_wrap_without_its_rule_with_a_fix_that_works() -> None:
    """A private registry without the rule: refused when wrapping (the Linear inside is never called);
    the replacement the message names trains exactly."""
    model = Model(out_features=(2,), bias=True, reduction="sum")
    rules = RuleRegistry({nn.Linear: default_registry.lookup_type(nn.Linear)})  # type: ignore[dict-item]
    before = state(model)
    for fallback in (False, True):
        with pytest.raises(
            UnsupportedLayerError,
            match=r"layer 'loss' \(torch.nn.modules.loss.LinearCrossEntropyLoss\) multiplies its input by its "
            r"parameters \['linear.weight', 'linear.bias'\].*parent.loss = parent.loss.linear.*reduction='none'",
        ):
            PerSampleModule(model, rules=rules, fallback=fallback)
    assert state(model) == before
    model.loss.requires_grad_(False)  # frozen, it is no concern of pergrad's
    PerSampleModule(model, rules=rules).remove()
    model.loss.requires_grad_(True)

    fused = model.loss
    body = nn.Sequential(model.body, nn.Tanh(), fused.linear)  # its own Linear: the same parameters

    def per_sample_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.unflatten(1, (CLASSES, 2)), y, reduction="none").sum()

    psm = PerSampleModule(body, loss_reduction="sum", rules=rules)
    gen = torch.Generator().manual_seed(2)
    for step, b in enumerate((4, 1, 5, 3)):
        x = torch.randn(b, 4, generator=gen, dtype=torch.float64)
        y = torch.randint(0, CLASSES, (b, 2), generator=gen)
        psm.zero_grad()
        loss = per_sample_loss(psm(x), y)
        assert_close(loss, fused(torch.tanh(model.body(x)), y), f"step {step}: the fused module's loss")
        loss.backward()
        ref = reference(model, x, y)
        for name, p in body.named_parameters():
            full = {"0": "body", "2": "loss.linear"}[name[0]] + name[1:]
            assert_close(p.grad_sample, ref[full], f"step {step} {name}.grad_sample")
            assert_close(p.grad, ref[full].sum(0), f"step {step} {name}.grad")
        with torch.no_grad():
            for p in body.parameters():
                p -= 0.5 * p.grad

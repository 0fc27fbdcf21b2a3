"""Lazy modules (``nn.LazyLinear``, ``nn.LazyConv*``, ``nn.LazyConvTranspose*``) wrapped before their
first forward: bound once materialised, transforms registered before that included, every step
checked against torch.func."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pergrad import PerSampleModule, transforms
from tests.reference import assert_close, reference_grad_sample, run_pergrad

CLIP = 0.05
SIZES = (3, 5, 1, 4)

# (lazy layer, shape of one sample's input)
LAYERS = {
    "Linear": (lambda: nn.LazyLinear(4), (5,)),
    "Conv1d": (lambda: nn.LazyConv1d(3, 3, padding=1), (2, 6)),
    "Conv2d": (lambda: nn.LazyConv2d(3, 2, stride=2), (2, 5, 5)),
    "Conv3d": (lambda: nn.LazyConv3d(2, 2), (2, 3, 3, 3)),
    "ConvTranspose1d": (lambda: nn.LazyConvTranspose1d(3, 3, stride=2), (2, 4)),
    "ConvTranspose2d": (lambda: nn.LazyConvTranspose2d(2, 2, groups=2), (2, 3, 3)),
    "ConvTranspose3d": (lambda: nn.LazyConvTranspose3d(2, 2), (2, 2, 2, 2)),
}


def lazy_model(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(LAYERS[kind][0](), nn.Tanh(), nn.Flatten(), nn.LazyLinear(3)).double()


def clipped_mean(grads: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """``mean_i`` of ``g_i``, clipped to CLIP over the parameters ``names`` together."""
    norms = torch.stack([grads[n].flatten(1).pow(2).sum(1) for n in names]).sum(0).sqrt()
    factor = (CLIP / norms).clamp(max=1)
    assert (factor < 1).all(), "every sample is clipped: the test sees the transform"
    return {n: (g * factor.view(-1, *[1] * (g.dim() - 1)) if n in names else g).mean(0) for n, g in grads.items()}


@pytest.mark.parametrize("keep_grad_sample", [True, False])
@pytest.mark.parametrize("start", ["dry-run", "first-step", "state-dict"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_lazy_layers_wrapped_before_their_first_forward(kind: str, start: str, keep_grad_sample: bool) -> None:
    model = lazy_model(kind)
    psm = PerSampleModule(model, keep_grad_sample=keep_grad_sample)
    # registered before materialisation: on the lazy module itself, and on the head by name
    psm.register_transform(model[0], transforms.clip_norm(CLIP))
    psm.register_transform("3", transforms.clip_norm(CLIP))
    shape = LAYERS[kind][1]
    gen = torch.Generator().manual_seed(1)
    if start == "dry-run":  # as users build an optimizer: one forward to materialise, without gradients
        with torch.no_grad():
            psm(torch.randn(2, *shape, generator=gen, dtype=torch.float64))
    elif start == "state-dict":  # a checkpoint materialises the parameters; the class changes in the forward
        trained = lazy_model(kind)
        trained(torch.randn(2, *shape, dtype=torch.float64))
        psm.load_state_dict({k: v + 0.1 for k, v in trained.state_dict().items()})
    for step, b in enumerate(SIZES):
        x = torch.randn(b, *shape, generator=gen, dtype=torch.float64)
        y = torch.randn(b, 3, generator=gen, dtype=torch.float64)
        psm.zero_grad()
        run_pergrad(psm, x, y)
        assert type(model[0]).__name__ == kind and type(model[3]) is nn.Linear
        ref = reference_grad_sample(model, x, y)
        expected = clipped_mean(ref, ["0.weight", "0.bias"])  # the two targets are clipped apart
        expected |= {n: g for n, g in clipped_mean(ref, ["3.weight", "3.bias"]).items() if n.startswith("3.")}
        for name, p in model.named_parameters():
            assert_close(p.grad, expected[name], f"step {step} {name}.grad")
            if keep_grad_sample:
                assert_close(p.grad_sample, ref[name], f"step {step} {name}.grad_sample")
            else:
                assert not hasattr(p, "grad_sample")
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad
    psm.remove()
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_lazy_layer_with_fallback_and_transform_by_parameter_name() -> None:
    """``fallback=True`` for another layer of the model, a transform on one lazy parameter by name."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(4), nn.PReLU(), nn.LazyLinear(3)).double()
    psm = PerSampleModule(model, fallback=True)
    psm.register_transform("0.weight", lambda g: 2 * g)
    gen = torch.Generator().manual_seed(1)
    for step, b in enumerate(SIZES):
        x = torch.randn(b, 5, generator=gen, dtype=torch.float64)
        y = torch.randn(b, 3, generator=gen, dtype=torch.float64)
        psm.zero_grad()
        run_pergrad(psm, x, y)
        ref = reference_grad_sample(model, x, y)
        for name, p in model.named_parameters():
            assert_close(p.grad_sample, ref[name], f"step {step} {name}.grad_sample")
            assert_close(p.grad, ref[name].mean(0) * (2 if name == "0.weight" else 1), f"step {step} {name}.grad")


class LazyScale(nn.modules.lazy.LazyModuleMixin, nn.Module):
    """A lazy module of one's own, that stays of its class (no ``cls_to_become``): ``y = x * w``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.parameter.UninitializedParameter(dtype=torch.float64)

    def initialize_parameters(self, x: torch.Tensor) -> None:
        if self.has_uninitialized_params():
            with torch.no_grad():
                self.w.materialize((x.shape[-1],))
                self.w.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


@pytest.mark.parametrize("fallback", [False, True])
def test_own_lazy_module_with_raw_parameters_or_fallback(fallback: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(LazyScale(), nn.Tanh(), nn.LazyLinear(3)).double()
    psm = PerSampleModule(model, fallback=fallback)
    psm.register_transform(model, transforms.clip_norm(CLIP))
    gen = torch.Generator().manual_seed(1)
    for step, b in enumerate(SIZES):
        x = torch.randn(b, 5, generator=gen, dtype=torch.float64)
        y = torch.randn(b, 3, generator=gen, dtype=torch.float64)
        psm.zero_grad()
        run_pergrad(psm, x, y)
        ref = reference_grad_sample(model, x, y)
        expected = clipped_mean(ref, list(ref))
        for name, p in model.named_parameters():
            assert_close(p.grad_sample, ref[name], f"step {step} {name}.grad_sample")
            assert_close(p.grad, expected[name], f"step {step} {name}.grad")
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad


class LateBranch(nn.Module):
    """A convolution whose weight runs detached once checked, and a lazy head first called later."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3)
        self.head = nn.Linear(12, 3)
        self.late = nn.LazyLinear(3)
        self.use_late = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)).flatten(1)
        return self.head(h) + self.late(h) if self.use_late else self.head(h)


def test_lazy_module_first_called_after_some_steps() -> None:
    """The call that materialises it is checked against autograd, so no weight runs detached before;
    from the step after, the transformed convolution's weight does again."""
    torch.manual_seed(0)
    model = LateBranch().double()
    psm = PerSampleModule(model)
    psm.register_transform(model.conv, transforms.clip_norm(CLIP))
    gen = torch.Generator().manual_seed(1)
    for step, b in enumerate((3, 4, 2, 5, 3)):
        model.use_late = step >= 2
        x = torch.randn(b, 2, 6, generator=gen, dtype=torch.float64)
        y = torch.randn(b, 3, generator=gen, dtype=torch.float64)
        psm.zero_grad()
        run_pergrad(psm, x, y)
        if model.use_late:
            ref = reference_grad_sample(model, x, y)
        else:  # torch.func cannot read the lazy module's parameters yet
            late, model.late = model.late, nn.Identity()
            ref = reference_grad_sample(model, x, y)
            model.late = late
        expected = clipped_mean(ref, ["conv.weight", "conv.bias"])
        for name, p in model.named_parameters():
            if name.startswith("late") and not model.use_late:
                continue
            assert_close(p.grad_sample, ref[name], f"step {step} {name}.grad_sample")
            assert_close(p.grad, expected[name], f"step {step} {name}.grad")
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.5 * p.grad
    assert psm._engine.detacher.current, "the convolution's weight runs detached again"

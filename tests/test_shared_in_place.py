"""In-place ops on a layer output shared by the batch (``pergrad._core.shortcuts.shared``): a position embedding
``pos(torch.arange(T))`` or of HuggingFace's ``position_ids`` buffer ``[1, T]``, or a Linear on Fourier features ``sin(arange(T)[:, None] * freqs)`` built inside
the forward, rewritten in place by the user's forward hook (``out.mul_(s)``, ``out.add_(b)``,
``out.copy_(...)``) or by the model right after the layer (``out *= s``, ``ReLU(inplace=True)``, some
positions scaled in place, the output scaled in place after it met the batch once).

Each sample's gradient is pulled back to the layer's output as the layer returned it, not to the tensor
the in-place op rewrote: every step is checked against a one-sample-at-a-time autograd loop on a copy of
the model (the user's hooks included), in float64, on steps with T == B and T != B on both sides of 16
positions, ``keep_grad_sample`` both ways, ``clip_norm`` at the median per-sample norm. The factor is 1
at step 0, where the first backward's check compares with autograd: the later steps are what is tested.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from pergrad import PerSampleModule, transforms
from tests.reference import assert_close

STEPS = [(3, 3), (4, 7), (2, 15), (16, 16), (3, 17), (17, 17), (5, 5)]  # (batch, positions): T == B four times
SCALES = [1.0, 2.0, 0.5, 3.0, 0.25, 1.5, -2.0]  # the factor at each step
FEATURES, WIDTH, OUTPUTS = 2, 3, 2


@pytest.fixture(autouse=True)
def float64() -> object:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


class Factor:
    """The factor of the step, read by the model's forward and the user's hooks (the same in the copy)."""

    value = 1.0


Hook = Callable[[nn.Module, tuple[object, ...], Tensor], Tensor | None]


def scale_without_returning(module: nn.Module, args: tuple[object, ...], out: Tensor) -> None:
    out.mul_(Factor.value)


HOOKS: dict[str, Hook] = {
    "hook: out.mul_(s)": lambda m, a, out: out.mul_(Factor.value),
    "hook: out.mul_(s), returns None": scale_without_returning,
    "hook: out.add_(bias)": lambda m, a, out: out.add_(torch.linspace(-1.0, 1.0, WIDTH) * Factor.value),
    "hook: out.copy_(tanh(out) * s)": lambda m, a, out: out.copy_(torch.tanh(out.clone()) * Factor.value),
    "hook: out.copy_(constant)": lambda m, a, out: out.copy_(torch.full_like(out, Factor.value)),
}
IN_FORWARD = ["out *= s", "ReLU(inplace=True)", "out[..., :2, :].mul_(s)", "out.mul_(s) after it met the batch"]


class Net(nn.Module):
    """A Linear on the input plus a tensor shared by the batch (``block``), then tanh and a head; ``how``
    rewrites the shared layer's output in place (the hooks of ``HOOKS`` are registered on it)."""

    def __init__(self, block: str, how: str) -> None:
        super().__init__()
        self.block, self.how = block, how
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.shared = nn.Linear(4, WIDTH) if block == "fourier" else nn.Embedding(24, WIDTH)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(WIDTH, OUTPUTS)
        self.register_buffer("freqs", torch.tensor([0.5, 1.0, 2.0, 4.0]))
        self.register_buffer("position_ids", torch.arange(24).expand(1, -1))  # HuggingFace's

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        if self.block == "fourier":
            out = self.shared(torch.sin(1 + torch.arange(t, dtype=x.dtype)[:, None] * self.freqs))  # [T, D]
        elif self.block == "positions":
            out = self.shared(torch.arange(t))  # [T, D]
        else:
            out = self.shared(self.position_ids[:, :t])  # [1, T, D]
        if self.how == "out *= s":
            out *= Factor.value
        elif self.how == "ReLU(inplace=True)":
            out = self.act(out)
        elif self.how == "out[..., :2, :].mul_(s)":
            out[..., :2, :].mul_(Factor.value)
        elif self.how == "out.mul_(s) after it met the batch":
            h = torch.tanh(self.inp(x) + out)
            out.mul_(Factor.value)
            return self.head(h * out)
        return self.head(torch.tanh(self.inp(x) + out))


def reference(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """``[B, *p.shape]`` by name: each sample's loss alone, by autograd through a copy of the model (the
    user's forward hooks copied with it; the copy of a wrapped model carries none of pergrad's)."""
    copied = copy.deepcopy(model)
    named = list(copied.named_parameters())
    found: dict[str, list[Tensor]] = {n: [] for n, _ in named}
    for i in range(x.shape[0]):
        loss = (copied(x[i : i + 1]) - y[i : i + 1]).pow(2).sum()
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        for (n, p), g in zip(named, grads, strict=True):
            found[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(g) for n, g in found.items()}


def norms_of(ref: dict[str, Tensor]) -> Tensor:
    return torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()


@pytest.mark.parametrize(("keep", "clip"), [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("how", [*HOOKS, *IN_FORWARD])
@pytest.mark.parametrize("block", ["positions", "position_ids", "fourier"])
def test_in_place_on_an_output_shared_by_the_batch(block: str, how: str, keep: bool, clip: bool) -> None:
    torch.manual_seed(0)
    model = Net(block, how)
    if how in HOOKS:
        model.shared.register_forward_hook(HOOKS[how])
    gen = torch.Generator().manual_seed(1)
    clipper = transforms.clip_norm(1.0)
    with PerSampleModule(model, keep_grad_sample=keep, track_norms=True) as psm:
        if clip:
            psm.register_transform(model, clipper)
        for step, (b, t) in enumerate(STEPS):
            Factor.value = SCALES[step]
            x, y = torch.randn(b, t, FEATURES, generator=gen), torch.randn(b, t, OUTPUTS, generator=gen)
            ref = reference(model, x, y)
            norms = norms_of(ref)
            clipper.max_norm = float(norms.median())
            factor = (clipper.max_norm / norms).clamp(max=1) if clip else torch.ones(b)
            psm.zero_grad()
            (psm(x) - y).pow(2).flatten(1).sum(1).mean().backward()
            found = psm.per_sample_norms()
            for name, p in model.named_parameters():
                what = f"step {step} (B={b}, T={t}, s={SCALES[step]}): {name}"
                want = (ref[name] * factor.view(-1, *[1] * (ref[name].dim() - 1))).mean(0)
                assert_close(p.grad, want, f".grad of {what}")
                assert_close(found[name], ref[name].flatten(1).norm(dim=1), f"norms of {what}")
                if keep:
                    assert_close(p.grad_sample, ref[name], f"grad_sample of {what}")


class RawInPlace(nn.Module):
    """A raw parameter shared by the batch (outside ``torch.nn``), scaled in place in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.randn(1, WIDTH))
        self.head = nn.Linear(WIDTH, OUTPUTS)

    def forward(self, x: Tensor) -> Tensor:
        offset = self.offset
        offset.mul_(2.0)
        return self.head(x + offset)


def test_a_raw_parameter_written_in_place_is_refused_as_without_pergrad() -> None:
    model = RawInPlace()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(3, 4, WIDTH)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad is being used in an in-place operation"):
        model(x)
    with (
        PerSampleModule(model) as psm,
        pytest.raises(RuntimeError, match="leaf Variable that requires grad is being used in an in-place"),
    ):
        psm(x)
    assert type(model._parameters["offset"]) is nn.Parameter  # the tracked alias taken out again
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def second_order_reference(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """``d mean_i |g_i|^2 / d theta`` by autograd on a copy of the model: each sample's own gradient
    (its loss alone) differentiated with ``create_graph=True``, then the penalty differentiated."""
    copied = copy.deepcopy(model)
    named = list(copied.named_parameters())
    penalty = torch.zeros(())
    for i in range(x.shape[0]):
        loss = (copied(x[i : i + 1]) - y[i : i + 1]).pow(2).sum()
        grads = torch.autograd.grad(loss, [p for _, p in named], create_graph=True, allow_unused=True)
        penalty = penalty + sum(g.square().sum() for g in grads if g is not None)
    found = torch.autograd.grad(penalty / x.shape[0], [p for _, p in named], allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named, found, strict=True)}


@pytest.mark.parametrize("how", ["hook: out.mul_(s)", "ReLU(inplace=True)", "out.mul_(s) after it met the batch"])
@pytest.mark.parametrize("block", ["positions", "fourier"])
def test_second_order_through_an_output_written_in_place(block: str, how: str) -> None:
    """After ``backward(create_graph=True)``, the gradient of the mean squared per-sample gradient norm
    (from ``grad_sample``) is autograd's double differentiation, every step."""
    torch.manual_seed(0)
    model = Net(block, how)
    if how in HOOKS:
        model.shared.register_forward_hook(HOOKS[how])
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(1)
    with PerSampleModule(model, keep_grad_sample=True) as psm:
        for step, (b, t) in enumerate(STEPS[:5]):
            Factor.value = SCALES[step]
            x, y = torch.randn(b, t, FEATURES, generator=gen), torch.randn(b, t, OUTPUTS, generator=gen)
            expected = second_order_reference(model, x, y)
            for p in params.values():
                p.grad = None
            (psm(x) - y).pow(2).flatten(1).sum(1).mean().backward(create_graph=True)
            samples = [p.grad_sample for p in params.values()]  # type: ignore[attr-defined]
            penalty = torch.stack([g.flatten(1).square().sum(1) for g in samples]).sum(0).mean()
            got = torch.autograd.grad(penalty, list(params.values()), allow_unused=True)
            for (name, p), g in zip(params.items(), got, strict=True):
                found = torch.zeros_like(p) if g is None else g
                assert_close(found, expected[name], f"step {step} (B={b}, T={t}): d penalty / d {name}")

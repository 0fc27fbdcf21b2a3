"""The user's hooks and penalties of issue 39 ("never silently wrong, part three"), every step checked
against a one-sample-at-a-time autograd loop on a copy of the model (its forward hooks included), in
float64, on both sides of 16 positions per sample (weights run detached from the second step where a
transform covers them; the fused paths switch at 16 positions), with ``clip_norm`` at the median
per-sample norm and ``keep_grad_sample`` both ways:

- a forward hook that rescales a layer's output (a schedule, stochastic depth) is an op of the model
  after the layer: exact;
- freezing a layer after a scaling forward hook wraps again, exactly;
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from pergrad import PerSampleModule, transforms
from tests.reference import assert_close

STEPS = [(4, 1), (3, 15), (4, 16), (3, 17), (5, 1), (4, 24)]  # (batch, positions); 1: a flat [B, features] input
FEATURES, OUTPUTS = 5, 3

Losses = Callable[[nn.Module, Tensor, Tensor, int, slice], Tensor]  # (model, x, y, step, rows) -> [len(rows)]


@pytest.fixture(autouse=True)
def float64() -> object:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


class Net(nn.Module):
    """Linear (on every position), LayerNorm, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 6)
        self.norm = nn.LayerNorm(6)
        self.fc2 = nn.Linear(6, OUTPUTS)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def batch(b: int, t: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    shape = (b, FEATURES) if t == 1 else (b, t, FEATURES)
    return torch.randn(*shape, generator=gen), torch.randn(*shape[:-1], OUTPUTS, generator=gen)


def squared(model: nn.Module, x: Tensor, y: Tensor, step: int, rows: slice) -> Tensor:
    """Each sample's own loss."""
    return (model(x) - y).pow(2).flatten(1).sum(1)


def reference(model: nn.Module, losses: Losses, x: Tensor, y: Tensor, step: int) -> dict[str, Tensor]:
    """``[B, *p.shape]`` by name: each sample's loss alone, through a copy of the model (a copy of a wrapped
    model carries none of pergrad's hooks, and the user's forward hooks as they are)."""
    copied = copy.deepcopy(model)
    named = [(n, p) for n, p in copied.named_parameters() if p.requires_grad]
    found: dict[str, list[Tensor]] = {n: [] for n, _ in named}
    for i in range(x.shape[0]):
        loss = losses(copied, x[i : i + 1], y[i : i + 1], step, slice(i, i + 1)).sum()
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        for (n, p), g in zip(named, grads):
            found[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(g) for n, g in found.items()}


def median_norm(ref: dict[str, Tensor]) -> float:
    return float(torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt().median())


def clipped_mean(ref: dict[str, Tensor], bound: float) -> dict[str, Tensor]:
    norms = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
    factor = (bound / norms).clamp(max=1)
    return {n: (g * factor.view(-1, *[1] * (g.dim() - 1))).mean(0) for n, g in ref.items()}


def run_steps(
    model: nn.Module,
    losses: Losses,
    *,
    keep: bool,
    clip: bool,
    detach: bool = True,
    before: Callable[[int], None] | None = None,
    after: Callable[[int, dict[str, Tensor]], None] | None = None,
    psm: PerSampleModule | None = None,
) -> None:
    """Every step of ``STEPS`` through the wrapper, checked against ``reference``: ``.grad`` (clipped at
    the median per-sample norm where ``clip``) and ``grad_sample``; ``after`` gets each step's reference."""
    gen = torch.Generator().manual_seed(0)
    psm = PerSampleModule(model, keep_grad_sample=keep, detach_transformed=detach) if psm is None else psm
    clipper = transforms.clip_norm(1.0)
    if clip:
        psm.register_transform(model, clipper)
    try:
        for step, (b, t) in enumerate(STEPS):
            if before is not None:
                before(step)
            x, y = batch(b, t, gen)
            ref = reference(model, losses, x, y, step)
            clipper.max_norm = median_norm(ref)
            expected = clipped_mean(ref, clipper.max_norm) if clip else {n: g.mean(0) for n, g in ref.items()}
            psm.zero_grad()
            losses(psm.module, x, y, step, slice(0, b)).mean().backward()
            for name, p in model.named_parameters():
                if not p.requires_grad:
                    assert p.grad is None, name
                    continue
                what = f"step {step} (B={b}, T={t}): {name}"
                assert_close(p.grad, expected[name], f".grad of {what}")
                if keep:
                    assert_close(p.grad_sample, ref[name], f"grad_sample of {what}")
            if after is not None:
                after(step, ref)
    finally:
        psm.remove()


# -- a forward hook that rescales a layer's output ---------------------------------------------------

SCHEDULE = [1.0, 0.5, 2.0, 0.7, 1.3, 0.4]  # 1 at step 0: the first backward's check cannot see the hook


@pytest.mark.parametrize(("keep", "clip"), [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("how", ["out * s", "out.mul_(s)", "stochastic depth"])
@pytest.mark.parametrize("registered", ["before wrapping", "after wrapping"])
def test_a_forward_hook_that_rescales_an_output_is_exact_on_every_step(
    keep: bool, clip: bool, how: str, registered: str
) -> None:
    """The output gradient is that of the layer's own output: the hook's op comes after the layer.
    (Registering the transform installs pergrad's hooks again, after a hook registered after wrapping.)"""
    torch.manual_seed(0)
    model = Net()
    state: dict[str, Tensor] = {}

    def rescale(module: nn.Module, args: object, out: Tensor) -> Tensor | None:
        s = state["s"].view(-1, *[1] * (out.dim() - 1))  # one factor, or one per sample
        if how == "out.mul_(s)":
            out.mul_(s)
            return None
        return out * s

    def losses(m: nn.Module, x: Tensor, y: Tensor, step: int, rows: slice) -> Tensor:
        if how == "stochastic depth":  # each sample's branch kept (scaled by 1 / 0.6) or dropped
            kept = torch.Generator().manual_seed(step)
            state["s"] = (torch.rand(8, generator=kept) < 0.6).double()[rows] / 0.6 if step else torch.ones(1)
        else:
            state["s"] = torch.tensor([SCHEDULE[step]])
        return squared(m, x, y, step, rows)

    def hook_layers() -> None:
        model.fc1.register_forward_hook(rescale)
        model.norm.register_forward_hook(rescale)

    if registered == "before wrapping":
        hook_layers()
    psm = PerSampleModule(model, keep_grad_sample=keep)
    if registered == "after wrapping":
        hook_layers()
    run_steps(model, losses, keep=keep, clip=clip, psm=psm)


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("registered", ["before wrapping", "after wrapping"])
def test_freezing_a_layer_after_a_scaling_forward_hook_wraps_again_exactly(keep: bool, registered: str) -> None:
    """Freezing ``fc2`` at step 3 wraps the model again (and checks the next backward against autograd):
    pergrad's hooks are installed again before the user's, so the check sees the layer's own output."""
    torch.manual_seed(1)
    model = Net()
    scale = {"s": 1.0}

    def rescale(module: nn.Module, args: object, out: Tensor) -> Tensor:
        return out * scale["s"]

    def before(step: int) -> None:
        scale["s"] = SCHEDULE[step]
        if step == 3:
            model.fc2.requires_grad_(False)

    if registered == "before wrapping":
        model.fc1.register_forward_hook(rescale)
    psm = PerSampleModule(model, keep_grad_sample=keep)
    if registered == "after wrapping":
        model.fc1.register_forward_hook(rescale)
    run_steps(model, squared, keep=keep, clip=True, before=before, psm=psm)
